//! The messages of NRI's plugin protocol (`nri.pkg.api.v1alpha1`, NRI's `pkg/api/api.proto`)
//! and of ttrpc's envelope (containerd's ttrpc `request.proto`) that the plugin reads or
//! writes, declared with prost's derive: only the fields gpushare uses, at the field numbers
//! of those protos. Fields a message has and this file does not name are skipped on decode
//! (protobuf's rule for unknown fields), so a newer runtime's additions do no harm, and an
//! older runtime's missing fields decode as empty (NRI before 0.11 has no `Container.user`:
//! `None` here).

use std::collections::HashMap;

/// ttrpc's request envelope.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct Request {
    #[prost(string, tag = "1")]
    pub service: String,
    #[prost(string, tag = "2")]
    pub method: String,
    #[prost(bytes = "vec", tag = "3")]
    pub payload: Vec<u8>,
    #[prost(int64, tag = "4")]
    pub timeout_nano: i64,
}

/// ttrpc's response envelope.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct Response {
    #[prost(message, optional, tag = "1")]
    pub status: Option<Status>,
    #[prost(bytes = "vec", tag = "2")]
    pub payload: Vec<u8>,
}

/// google.rpc.Status, as ttrpc carries it.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct Status {
    #[prost(int32, tag = "1")]
    pub code: i32,
    #[prost(string, tag = "2")]
    pub message: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct RegisterPluginRequest {
    #[prost(string, tag = "1")]
    pub plugin_name: String,
    #[prost(string, tag = "2")]
    pub plugin_idx: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct ConfigureRequest {
    #[prost(string, tag = "1")]
    pub config: String,
    #[prost(string, tag = "2")]
    pub runtime_name: String,
    #[prost(string, tag = "3")]
    pub runtime_version: String,
    #[prost(int64, tag = "4")]
    pub registration_timeout: i64,
    #[prost(int64, tag = "5")]
    pub request_timeout: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct ConfigureResponse {
    #[prost(int32, tag = "2")]
    pub events: i32,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct SynchronizeRequest {
    #[prost(message, repeated, tag = "1")]
    pub pods: Vec<PodSandbox>,
    #[prost(message, repeated, tag = "2")]
    pub containers: Vec<Container>,
    #[prost(bool, tag = "3")]
    pub more: bool,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct SynchronizeResponse {
    #[prost(bool, tag = "2")]
    pub more: bool,
}

/// Every container event's request: CreateContainer, PostCreateContainer,
/// StartContainer, StopContainer, RemoveContainer (pod 1, container 2).
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct ContainerEvent {
    #[prost(message, optional, tag = "1")]
    pub pod: Option<PodSandbox>,
    #[prost(message, optional, tag = "2")]
    pub container: Option<Container>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct CreateContainerResponse {
    #[prost(message, optional, tag = "1")]
    pub adjust: Option<ContainerAdjustment>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct PodSandbox {
    #[prost(string, tag = "1")]
    pub id: String,
    #[prost(string, tag = "2")]
    pub name: String,
    #[prost(string, tag = "4")]
    pub namespace: String,
    #[prost(map = "string, string", tag = "6")]
    pub annotations: HashMap<String, String>,
    #[prost(string, tag = "7")]
    pub runtime_handler: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct Container {
    #[prost(string, tag = "1")]
    pub id: String,
    #[prost(string, tag = "2")]
    pub pod_sandbox_id: String,
    #[prost(string, tag = "3")]
    pub name: String,
    #[prost(int32, tag = "4")]
    pub state: i32,
    #[prost(map = "string, string", tag = "6")]
    pub annotations: HashMap<String, String>,
    #[prost(string, repeated, tag = "8")]
    pub env: Vec<String>,
    #[prost(message, repeated, tag = "9")]
    pub mounts: Vec<Mount>,
    #[prost(message, optional, tag = "10")]
    pub hooks: Option<Hooks>,
    #[prost(message, optional, tag = "11")]
    pub linux: Option<LinuxContainer>,
    #[prost(uint32, tag = "12")]
    pub pid: u32,
    #[prost(message, optional, tag = "21")]
    pub user: Option<User>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct Mount {
    #[prost(string, tag = "1")]
    pub destination: String,
    #[prost(string, tag = "2")]
    pub r#type: String,
    #[prost(string, tag = "3")]
    pub source: String,
    #[prost(string, repeated, tag = "4")]
    pub options: Vec<String>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct Hooks {
    #[prost(message, repeated, tag = "1")]
    pub prestart: Vec<Hook>,
    #[prost(message, repeated, tag = "2")]
    pub create_runtime: Vec<Hook>,
    #[prost(message, repeated, tag = "3")]
    pub create_container: Vec<Hook>,
    #[prost(message, repeated, tag = "4")]
    pub start_container: Vec<Hook>,
    #[prost(message, repeated, tag = "5")]
    pub poststart: Vec<Hook>,
    #[prost(message, repeated, tag = "6")]
    pub poststop: Vec<Hook>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct Hook {
    #[prost(string, tag = "1")]
    pub path: String,
    #[prost(string, repeated, tag = "2")]
    pub args: Vec<String>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct LinuxContainer {
    #[prost(message, repeated, tag = "1")]
    pub namespaces: Vec<LinuxNamespace>,
    #[prost(message, repeated, tag = "2")]
    pub devices: Vec<LinuxDevice>,
    #[prost(message, optional, tag = "3")]
    pub resources: Option<LinuxResources>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct LinuxNamespace {
    #[prost(string, tag = "1")]
    pub r#type: String,
    #[prost(string, tag = "2")]
    pub path: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct LinuxDevice {
    #[prost(string, tag = "1")]
    pub path: String,
    #[prost(string, tag = "2")]
    pub r#type: String,
    #[prost(int64, tag = "3")]
    pub major: i64,
    #[prost(int64, tag = "4")]
    pub minor: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct LinuxResources {
    #[prost(message, repeated, tag = "7")]
    pub devices: Vec<LinuxDeviceCgroup>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct LinuxDeviceCgroup {
    #[prost(bool, tag = "1")]
    pub allow: bool,
    #[prost(string, tag = "2")]
    pub r#type: String,
    #[prost(message, optional, tag = "3")]
    pub major: Option<OptionalInt64>,
    #[prost(message, optional, tag = "4")]
    pub minor: Option<OptionalInt64>,
    #[prost(string, tag = "5")]
    pub access: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct OptionalInt64 {
    #[prost(int64, tag = "1")]
    pub value: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct User {
    #[prost(uint32, tag = "1")]
    pub uid: u32,
    #[prost(uint32, tag = "2")]
    pub gid: u32,
    #[prost(uint32, repeated, tag = "3")]
    pub additional_gids: Vec<u32>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct ContainerAdjustment {
    #[prost(message, repeated, tag = "3")]
    pub mounts: Vec<Mount>,
    #[prost(message, repeated, tag = "4")]
    pub env: Vec<KeyValue>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct KeyValue {
    #[prost(string, tag = "1")]
    pub key: String,
    #[prost(string, tag = "2")]
    pub value: String,
}

/// What a validation plugin (NRI 0.10, containerd 2.2 and later) is asked after every
/// plugin has answered a `CreateContainer`: the pod, the container as the runtime made
/// it, and the adjustment the plugins made (its mounts and env: the rest of it, the other
/// containers' updates, the owners and the plugins consulted are skipped on decode).
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct ValidateContainerAdjustmentRequest {
    #[prost(message, optional, tag = "1")]
    pub pod: Option<PodSandbox>,
    #[prost(message, optional, tag = "2")]
    pub container: Option<Container>,
    #[prost(message, optional, tag = "3")]
    pub adjust: Option<ContainerAdjustment>,
    #[prost(message, repeated, tag = "6")]
    pub plugins: Vec<PluginInstance>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct PluginInstance {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(string, tag = "2")]
    pub index: String,
}

/// A validator's verdict: `reject` fails the container's creation with `reason`.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct ValidateContainerAdjustmentResponse {
    #[prost(bool, tag = "1")]
    pub reject: bool,
    #[prost(string, tag = "2")]
    pub reason: String,
}

/// NRI's `Event` numbers the plugin subscribes to; the subscription is a mask of
/// `1 << (event - 1)`.
pub(crate) mod event {
    pub(crate) const CREATE_CONTAINER: i32 = 4;
    pub(crate) const POST_CREATE_CONTAINER: i32 = 5;
    pub(crate) const START_CONTAINER: i32 = 6;
    pub(crate) const STOP_CONTAINER: i32 = 10;
    pub(crate) const REMOVE_CONTAINER: i32 = 11;
    pub(crate) const VALIDATE_CONTAINER_ADJUSTMENT: i32 = 14;

    pub(crate) fn mask(events: &[i32]) -> i32 {
        events.iter().fold(0, |m, e| m | (1 << (e - 1)))
    }
}
