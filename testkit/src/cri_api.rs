//! A small CRI client for the tests: the Kubernetes Container Runtime Interface
//! (`runtime.v1`, cri-api's `pkg/apis/runtime/v1/api.proto`), the part of it a kubelet uses
//! to run pods, spoken to containerd's CRI plugin over its Unix socket.
//!
//! Only the messages and fields the tests use are declared, with the field numbers of
//! api.proto (protobuf skips the fields a side does not know, so a subset is a valid
//! client). gRPC over HTTP/2 is thin enough to write here: a POST to
//! `/<package>.<Service>/<Method>` with `content-type: application/grpc`, a body of
//! length-prefixed messages (1 byte "compressed" = 0, 4 bytes big-endian length), and the
//! outcome in the `grpc-status`/`grpc-message` trailers (or headers, for a trailers-only
//! answer) — <https://github.com/grpc/grpc/blob/master/doc/PROTOCOL-HTTP2.md>.

#![allow(dead_code)]

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use prost::Message;

// ---- messages (api.proto field numbers) ----

#[derive(Clone, PartialEq, Message)]
pub struct VersionRequest {
    #[prost(string, tag = "1")]
    pub version: String,
}

#[derive(Clone, PartialEq, Message)]
pub struct VersionResponse {
    #[prost(string, tag = "1")]
    pub version: String,
    #[prost(string, tag = "2")]
    pub runtime_name: String,
    #[prost(string, tag = "3")]
    pub runtime_version: String,
    #[prost(string, tag = "4")]
    pub runtime_api_version: String,
}

/// Any of the empty responses (`StartContainerResponse`, `StopPodSandboxResponse`, …).
#[derive(Clone, PartialEq, Message)]
pub struct Empty {}

#[derive(Clone, PartialEq, Message)]
pub struct Int64Value {
    #[prost(int64, tag = "1")]
    pub value: i64,
}

/// `NamespaceMode`: POD = 0, CONTAINER = 1, NODE = 2, TARGET = 3.
pub const NAMESPACE_NODE: i32 = 2;

#[derive(Clone, PartialEq, Message)]
pub struct NamespaceOption {
    #[prost(int32, tag = "1")]
    pub network: i32,
    #[prost(int32, tag = "2")]
    pub pid: i32,
    #[prost(int32, tag = "3")]
    pub ipc: i32,
    /// A `hostUsers: false` pod's user namespace (mode POD with the pod's mappings); the
    /// node's when absent.
    #[prost(message, optional, tag = "5")]
    pub userns_options: Option<UserNamespace>,
}

#[derive(Clone, PartialEq, Message)]
pub struct UserNamespace {
    #[prost(int32, tag = "1")]
    pub mode: i32,
    #[prost(message, repeated, tag = "2")]
    pub uids: Vec<IdMapping>,
    #[prost(message, repeated, tag = "3")]
    pub gids: Vec<IdMapping>,
}

/// `IDMapping`: container ids `container_id..container_id+length` are host ids from `host_id`.
#[derive(Clone, PartialEq, Message)]
pub struct IdMapping {
    #[prost(uint32, tag = "1")]
    pub host_id: u32,
    #[prost(uint32, tag = "2")]
    pub container_id: u32,
    #[prost(uint32, tag = "3")]
    pub length: u32,
}

#[derive(Clone, PartialEq, Message)]
pub struct LinuxSandboxSecurityContext {
    #[prost(message, optional, tag = "1")]
    pub namespace_options: Option<NamespaceOption>,
    #[prost(message, optional, tag = "3")]
    pub run_as_user: Option<Int64Value>,
    #[prost(message, optional, tag = "8")]
    pub run_as_group: Option<Int64Value>,
}

#[derive(Clone, PartialEq, Message)]
pub struct LinuxPodSandboxConfig {
    #[prost(string, tag = "1")]
    pub cgroup_parent: String,
    #[prost(message, optional, tag = "2")]
    pub security_context: Option<LinuxSandboxSecurityContext>,
}

#[derive(Clone, PartialEq, Message)]
pub struct PodSandboxMetadata {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(string, tag = "2")]
    pub uid: String,
    #[prost(string, tag = "3")]
    pub namespace: String,
    #[prost(uint32, tag = "4")]
    pub attempt: u32,
}

#[derive(Clone, PartialEq, Message)]
pub struct PodSandboxConfig {
    #[prost(message, optional, tag = "1")]
    pub metadata: Option<PodSandboxMetadata>,
    #[prost(string, tag = "2")]
    pub hostname: String,
    #[prost(string, tag = "3")]
    pub log_directory: String,
    #[prost(map = "string, string", tag = "6")]
    pub labels: HashMap<String, String>,
    #[prost(map = "string, string", tag = "7")]
    pub annotations: HashMap<String, String>,
    #[prost(message, optional, tag = "8")]
    pub linux: Option<LinuxPodSandboxConfig>,
}

#[derive(Clone, PartialEq, Message)]
pub struct RunPodSandboxRequest {
    #[prost(message, optional, tag = "1")]
    pub config: Option<PodSandboxConfig>,
    #[prost(string, tag = "2")]
    pub runtime_handler: String,
}

#[derive(Clone, PartialEq, Message)]
pub struct PodSandboxIdRequest {
    /// `pod_sandbox_id` of Stop/RemovePodSandboxRequest and PodSandboxStatusRequest.
    #[prost(string, tag = "1")]
    pub pod_sandbox_id: String,
    /// PodSandboxStatusRequest only.
    #[prost(bool, tag = "2")]
    pub verbose: bool,
}

#[derive(Clone, PartialEq, Message)]
pub struct RunPodSandboxResponse {
    #[prost(string, tag = "1")]
    pub pod_sandbox_id: String,
}

#[derive(Clone, PartialEq, Message)]
pub struct PodSandboxStatus {
    #[prost(string, tag = "1")]
    pub id: String,
    /// SANDBOX_READY = 0, SANDBOX_NOTREADY = 1.
    #[prost(int32, tag = "3")]
    pub state: i32,
}

#[derive(Clone, PartialEq, Message)]
pub struct PodSandboxStatusResponse {
    #[prost(message, optional, tag = "1")]
    pub status: Option<PodSandboxStatus>,
    /// With `verbose`: containerd's `info`, a JSON document that holds the `runtimeSpec`.
    #[prost(map = "string, string", tag = "2")]
    pub info: HashMap<String, String>,
}

#[derive(Clone, PartialEq, Message)]
pub struct ListPodSandboxRequest {}

#[derive(Clone, PartialEq, Message)]
pub struct PodSandbox {
    #[prost(string, tag = "1")]
    pub id: String,
    #[prost(int32, tag = "3")]
    pub state: i32,
}

#[derive(Clone, PartialEq, Message)]
pub struct ListPodSandboxResponse {
    #[prost(message, repeated, tag = "1")]
    pub items: Vec<PodSandbox>,
}

#[derive(Clone, PartialEq, Message)]
pub struct ImageSpec {
    #[prost(string, tag = "1")]
    pub image: String,
}

#[derive(Clone, PartialEq, Message)]
pub struct KeyValue {
    #[prost(string, tag = "1")]
    pub key: String,
    #[prost(string, tag = "2")]
    pub value: String,
}

#[derive(Clone, PartialEq, Message)]
pub struct Device {
    #[prost(string, tag = "1")]
    pub container_path: String,
    #[prost(string, tag = "2")]
    pub host_path: String,
    #[prost(string, tag = "3")]
    pub permissions: String,
}

/// `CDIDevice` of api.proto: a fully qualified CDI device name (`vendor/class=name`),
/// which the kubelet takes from a device plugin's `CDIDevices` or a DRA driver.
#[derive(Clone, PartialEq, Message)]
pub struct CdiDevice {
    #[prost(string, tag = "1")]
    pub name: String,
}

/// `Mount` of api.proto (named apart from oci-spec's).
#[derive(Clone, PartialEq, Message)]
pub struct CriMount {
    #[prost(string, tag = "1")]
    pub container_path: String,
    #[prost(string, tag = "2")]
    pub host_path: String,
    #[prost(bool, tag = "3")]
    pub readonly: bool,
}

#[derive(Clone, PartialEq, Message)]
pub struct ContainerMetadata {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(uint32, tag = "2")]
    pub attempt: u32,
}

#[derive(Clone, PartialEq, Message)]
pub struct LinuxContainerSecurityContext {
    /// kubelet gives each container its pod's namespace options (the user namespace's
    /// mappings among them).
    #[prost(message, optional, tag = "3")]
    pub namespace_options: Option<NamespaceOption>,
    #[prost(message, optional, tag = "5")]
    pub run_as_user: Option<Int64Value>,
    #[prost(message, optional, tag = "12")]
    pub run_as_group: Option<Int64Value>,
}

#[derive(Clone, PartialEq, Message)]
pub struct LinuxContainerConfig {
    #[prost(message, optional, tag = "2")]
    pub security_context: Option<LinuxContainerSecurityContext>,
}

#[derive(Clone, PartialEq, Message)]
pub struct ContainerConfig {
    #[prost(message, optional, tag = "1")]
    pub metadata: Option<ContainerMetadata>,
    #[prost(message, optional, tag = "2")]
    pub image: Option<ImageSpec>,
    #[prost(string, repeated, tag = "3")]
    pub command: Vec<String>,
    #[prost(string, repeated, tag = "4")]
    pub args: Vec<String>,
    #[prost(message, repeated, tag = "6")]
    pub envs: Vec<KeyValue>,
    /// What the kubelet passes for the pod's volumes and a device plugin's `Mounts`.
    #[prost(message, repeated, tag = "7")]
    pub mounts: Vec<CriMount>,
    #[prost(message, repeated, tag = "8")]
    pub devices: Vec<Device>,
    #[prost(map = "string, string", tag = "9")]
    pub labels: HashMap<String, String>,
    #[prost(map = "string, string", tag = "10")]
    pub annotations: HashMap<String, String>,
    /// Relative to the pod's `log_directory`.
    #[prost(string, tag = "11")]
    pub log_path: String,
    #[prost(message, optional, tag = "15")]
    pub linux: Option<LinuxContainerConfig>,
    /// `CDI_devices`: the CDI devices the engine injects (containerd 1.7+ with CDI on).
    #[prost(message, repeated, tag = "17")]
    pub cdi_devices: Vec<CdiDevice>,
}

#[derive(Clone, PartialEq, Message)]
pub struct CreateContainerRequest {
    #[prost(string, tag = "1")]
    pub pod_sandbox_id: String,
    #[prost(message, optional, tag = "2")]
    pub config: Option<ContainerConfig>,
    /// The pod's config again, as the kubelet sends it (containerd takes the cgroup parent
    /// from here).
    #[prost(message, optional, tag = "3")]
    pub sandbox_config: Option<PodSandboxConfig>,
}

#[derive(Clone, PartialEq, Message)]
pub struct CreateContainerResponse {
    #[prost(string, tag = "1")]
    pub container_id: String,
}

#[derive(Clone, PartialEq, Message)]
pub struct ContainerIdRequest {
    /// `container_id` of Start/Stop/RemoveContainerRequest and ContainerStatusRequest.
    #[prost(string, tag = "1")]
    pub container_id: String,
    /// StopContainerRequest: `timeout` (field 2, int64) — 0 kills at once.
    /// ContainerStatusRequest: `verbose` (field 2, bool) — the same varint on the wire.
    #[prost(int64, tag = "2")]
    pub field2: i64,
}

/// `ContainerState`: CREATED = 0, RUNNING = 1, EXITED = 2, UNKNOWN = 3.
pub const CONTAINER_RUNNING: i32 = 1;
pub const CONTAINER_EXITED: i32 = 2;

#[derive(Clone, PartialEq, Message)]
pub struct ContainerStatus {
    #[prost(string, tag = "1")]
    pub id: String,
    #[prost(int32, tag = "3")]
    pub state: i32,
    #[prost(int32, tag = "7")]
    pub exit_code: i32,
    #[prost(string, tag = "10")]
    pub reason: String,
    #[prost(string, tag = "11")]
    pub message: String,
}

#[derive(Clone, PartialEq, Message)]
pub struct ContainerStatusResponse {
    #[prost(message, optional, tag = "1")]
    pub status: Option<ContainerStatus>,
    /// With `verbose`: containerd's `info`, a JSON document that holds the `runtimeSpec`.
    #[prost(map = "string, string", tag = "2")]
    pub info: HashMap<String, String>,
}

#[derive(Clone, PartialEq, Message)]
pub struct ContainerFilter {
    #[prost(string, tag = "1")]
    pub id: String,
    #[prost(string, tag = "3")]
    pub pod_sandbox_id: String,
}

#[derive(Clone, PartialEq, Message)]
pub struct ListContainersRequest {
    #[prost(message, optional, tag = "1")]
    pub filter: Option<ContainerFilter>,
}

#[derive(Clone, PartialEq, Message)]
pub struct ListedContainer {
    #[prost(string, tag = "1")]
    pub id: String,
    #[prost(string, tag = "2")]
    pub pod_sandbox_id: String,
    #[prost(int32, tag = "6")]
    pub state: i32,
}

#[derive(Clone, PartialEq, Message)]
pub struct ListContainersResponse {
    #[prost(message, repeated, tag = "1")]
    pub containers: Vec<ListedContainer>,
}

#[derive(Clone, PartialEq, Message)]
pub struct ImageStatusRequest {
    #[prost(message, optional, tag = "1")]
    pub image: Option<ImageSpec>,
}

#[derive(Clone, PartialEq, Message)]
pub struct Image {
    #[prost(string, tag = "1")]
    pub id: String,
    #[prost(string, repeated, tag = "2")]
    pub repo_tags: Vec<String>,
}

#[derive(Clone, PartialEq, Message)]
pub struct ImageStatusResponse {
    #[prost(message, optional, tag = "1")]
    pub image: Option<Image>,
}

// ---- the client ----

/// A gRPC status other than OK, or a transport failure (code 14, UNAVAILABLE).
#[derive(Debug, Clone)]
pub struct Status {
    pub code: u32,
    pub message: String,
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "gRPC status {}: {}", self.code, self.message)
    }
}

fn unavailable(what: impl std::fmt::Display) -> Status {
    Status {
        code: 14,
        message: what.to_string(),
    }
}

/// `grpc-message` is percent-encoded.
fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            if let Some(v) = s
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
            {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// One HTTP/2 connection to a CRI socket; every call blocks with a deadline.
pub struct Cri {
    rt: tokio::runtime::Runtime,
    h2: h2::client::SendRequest<Bytes>,
    pub deadline: Duration,
}

impl Cri {
    pub fn connect(sock: &Path) -> Result<Cri, Status> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .build()
            .map_err(unavailable)?;
        let h2 = rt.block_on(async {
            let io = tokio::net::UnixStream::connect(sock)
                .await
                .map_err(|e| unavailable(format!("connect {}: {e}", sock.display())))?;
            let (send, conn) = h2::client::handshake(io).await.map_err(unavailable)?;
            // Driven whenever a call runs on this current-thread runtime.
            tokio::spawn(async move {
                let _ = conn.await;
            });
            Ok::<_, Status>(send)
        })?;
        Ok(Cri {
            rt,
            h2,
            deadline: Duration::from_secs(60),
        })
    }

    /// One unary call: `service` is `runtime.v1.RuntimeService` or `runtime.v1.ImageService`.
    pub fn call<Q: Message, R: Message + Default>(
        &self,
        service: &str,
        method: &str,
        req: &Q,
    ) -> Result<R, Status> {
        let path = format!("/{service}/{method}");
        let fut = async {
            let mut send = self.h2.clone().ready().await.map_err(unavailable)?;
            let request = http::Request::builder()
                .method("POST")
                .uri(format!("http://localhost{path}"))
                .header("content-type", "application/grpc")
                .header("te", "trailers")
                .body(())
                .map_err(unavailable)?;
            let (response, mut stream) = send.send_request(request, false).map_err(unavailable)?;
            let msg = req.encode_to_vec();
            let mut frame = BytesMut::with_capacity(5 + msg.len());
            frame.put_u8(0);
            frame.put_u32(msg.len() as u32);
            frame.put_slice(&msg);
            stream
                .send_data(frame.freeze(), true)
                .map_err(unavailable)?;
            let response = response.await.map_err(unavailable)?;
            let (parts, mut body) = response.into_parts();
            let mut buf = BytesMut::new();
            while let Some(chunk) = body.data().await {
                let chunk = chunk.map_err(unavailable)?;
                let _ = body.flow_control().release_capacity(chunk.len());
                buf.extend_from_slice(&chunk);
            }
            let trailers = body.trailers().await.map_err(unavailable)?;
            let field = |name: &str| {
                trailers
                    .as_ref()
                    .and_then(|t| t.get(name))
                    .or_else(|| parts.headers.get(name))
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned)
            };
            let code: u32 = field("grpc-status")
                .and_then(|c| c.parse().ok())
                .unwrap_or(2);
            if code != 0 {
                return Err(Status {
                    code,
                    message: percent_decode(&field("grpc-message").unwrap_or_default()),
                });
            }
            if buf.len() < 5 {
                return Ok(R::default());
            }
            let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
            let body = buf.get(5..5 + len).ok_or_else(|| {
                unavailable(format!("{path}: a short message ({} bytes)", buf.len()))
            })?;
            R::decode(body).map_err(|e| unavailable(format!("{path}: {e}")))
        };
        self.rt
            .block_on(async { tokio::time::timeout(self.deadline, fut).await })
            .unwrap_or_else(|_| {
                Err(unavailable(format!(
                    "{path}: no answer in {:?}",
                    self.deadline
                )))
            })
    }

    fn runtime<Q: Message, R: Message + Default>(
        &self,
        method: &str,
        req: &Q,
    ) -> Result<R, Status> {
        self.call("runtime.v1.RuntimeService", method, req)
    }

    pub fn version(&self) -> Result<VersionResponse, Status> {
        self.runtime("Version", &VersionRequest::default())
    }

    pub fn image_status(&self, image: &str) -> Result<Option<Image>, Status> {
        let r: ImageStatusResponse = self.call(
            "runtime.v1.ImageService",
            "ImageStatus",
            &ImageStatusRequest {
                image: Some(ImageSpec {
                    image: image.into(),
                }),
            },
        )?;
        Ok(r.image)
    }

    pub fn run_pod(&self, config: &PodSandboxConfig, handler: &str) -> Result<String, Status> {
        let r: RunPodSandboxResponse = self.runtime(
            "RunPodSandbox",
            &RunPodSandboxRequest {
                config: Some(config.clone()),
                runtime_handler: handler.into(),
            },
        )?;
        Ok(r.pod_sandbox_id)
    }

    fn pod_call<R: Message + Default>(
        &self,
        method: &str,
        id: &str,
        verbose: bool,
    ) -> Result<R, Status> {
        self.runtime(
            method,
            &PodSandboxIdRequest {
                pod_sandbox_id: id.into(),
                verbose,
            },
        )
    }

    pub fn stop_pod(&self, id: &str) -> Result<(), Status> {
        self.pod_call::<Empty>("StopPodSandbox", id, false)
            .map(drop)
    }

    pub fn remove_pod(&self, id: &str) -> Result<(), Status> {
        self.pod_call::<Empty>("RemovePodSandbox", id, false)
            .map(drop)
    }

    pub fn pod_status(&self, id: &str) -> Result<PodSandboxStatusResponse, Status> {
        self.pod_call("PodSandboxStatus", id, true)
    }

    pub fn list_pods(&self) -> Result<Vec<PodSandbox>, Status> {
        let r: ListPodSandboxResponse =
            self.runtime("ListPodSandbox", &ListPodSandboxRequest {})?;
        Ok(r.items)
    }

    pub fn create_container(
        &self,
        pod: &str,
        config: &ContainerConfig,
        sandbox_config: &PodSandboxConfig,
    ) -> Result<String, Status> {
        let r: CreateContainerResponse = self.runtime(
            "CreateContainer",
            &CreateContainerRequest {
                pod_sandbox_id: pod.into(),
                config: Some(config.clone()),
                sandbox_config: Some(sandbox_config.clone()),
            },
        )?;
        Ok(r.container_id)
    }

    fn container_call<R: Message + Default>(
        &self,
        method: &str,
        id: &str,
        field2: i64,
    ) -> Result<R, Status> {
        self.runtime(
            method,
            &ContainerIdRequest {
                container_id: id.into(),
                field2,
            },
        )
    }

    pub fn start_container(&self, id: &str) -> Result<(), Status> {
        self.container_call::<Empty>("StartContainer", id, 0)
            .map(drop)
    }

    /// Stops with `timeout` seconds of grace (0: SIGKILL at once).
    pub fn stop_container(&self, id: &str, timeout: i64) -> Result<(), Status> {
        self.container_call::<Empty>("StopContainer", id, timeout)
            .map(drop)
    }

    pub fn remove_container(&self, id: &str) -> Result<(), Status> {
        self.container_call::<Empty>("RemoveContainer", id, 0)
            .map(drop)
    }

    pub fn container_status(&self, id: &str) -> Result<ContainerStatusResponse, Status> {
        self.container_call("ContainerStatus", id, 1)
    }

    pub fn list_containers(&self) -> Result<Vec<ListedContainer>, Status> {
        let r: ListContainersResponse =
            self.runtime("ListContainers", &ListContainersRequest { filter: None })?;
        Ok(r.containers)
    }
}
