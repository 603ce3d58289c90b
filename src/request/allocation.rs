//! `allocated`: the devices a container was allocated, read from what NVIDIA's device plugin
//! or DRA driver wrote into its spec (docs/requests.md, "Allocated devices").
//!
//! Invariants:
//! - Plain data in, plain data out, no I/O: [`allocation`] reads the spec's annotations, env,
//!   mounts and device nodes; device nodes become GPUs only against the inventory
//!   ([`Allocation::resolve`], by minor number).
//! - An allocation is read only from what a pod's author cannot write: the kubelet and the
//!   engine write these sources, a pod's spec does not reach them. Every source that names
//!   devices is read, and they must name the same devices ([`Allocation::resolve`], after
//!   the inventory, since an index and a UUID, or a device node and a name, may be one
//!   GPU): sources that disagree are refused, never merged. The first in this order (NVIDIA's
//!   toolkit's own precedence, `VisibleDevices()`, device nodes last) gives the order of the
//!   devices:
//!   1. `cdi.k8s.io/*` annotations (device plugin `cdi-annotations`; the key's suffix is
//!      random): every entry `k8s.device-plugin.nvidia.com/gpu=<id>` or `nvidia.com/gpu=<id>`
//!      of their comma-separated values, keys in sorted order. Other vendors and classes
//!      (a DRA claim, `…/gdrcopy=all`, IMEX channels) and the CDI `all` device are not read.
//!      containerd takes a container's annotations from the kubelet's allocation only
//!      (pod annotations reach it only through `pod_annotations`, which must not pass
//!      `cdi.k8s.io/*`).
//!   2. mounts at `/var/run/nvidia-container-devices/<id>` whose source is `/dev/null`
//!      (`volume-mounts`), in mount order, as NVIDIA's toolkit reads them; deeper paths
//!      (`imex/<channel>`, `cdi/…`) are not devices. A mount there from any other source (a
//!      pod's own `emptyDir`) is no allocation and is ignored, as the toolkit ignores it.
//!   3. `/dev/nvidia<N>` nodes in `linux.devices` (`cdi-cri`, the DRA driver): the GPUs with
//!      minor number N, in spec order, and with them the MIG access nodes
//!      `/dev/nvidia-caps/nvidia-cap<M>` (see below). Read only when a `/dev/nvidia<N>` is
//!      there. Not read in a privileged container (one whose `linux.resources.devices` allows
//!      every device), which holds every node of the host.
//!   4. `NVIDIA_VISIBLE_DEVICES` (`envvar`), the last entry of the name, comma-separated,
//!      and only where the node accepts it (`accept-visible-devices-env`, off by default): a
//!      pod's own env replaces the device plugin's value of the same name, so the variable
//!      is forgeable. It then only ever has to agree with the other sources.
//! - An id is what the device plugin writes: `GPU-<uuid>`, `MIG-<uuid>`, an index `0` or
//!   `<gpu>:<mig>` (its replicas' `::<n>` suffix is stripped before the spec). The ids then
//!   meet the rules of named devices, so a list of MIG devices is refused.
//! - Not an allocation: `NVIDIA_VISIBLE_DEVICES` that is empty, `void`, `none`, `all`, or a
//!   list holding one of them (the toolkit reads such a list as that word), or the
//!   volume-mounts marker `/var/run/nvidia-container-devices` itself. `all` is the one
//!   ambiguous value: CUDA base images set `NVIDIA_VISIBLE_DEVICES=all` in their own env,
//!   which stays in the spec whenever the device plugin uses CDI strategies only; and the
//!   device plugin never writes `all` (it writes the ids it allocated), nor does the DRA
//!   driver (it writes no `NVIDIA_VISIBLE_DEVICES`). So `all` never counts, whoever set it.
//! - A MIG device injected by CDI (`cdi-cri`, DRA) is its parent's `/dev/nvidia<N>` plus the
//!   `/dev/nvidia-caps/nvidia-cap<M>` access nodes of its GPU instance and compute instance,
//!   M as the driver's `/proc/driver/nvidia-caps/mig-minors` gives them
//!   (`gpu<N>/gi<gi>/access`, `gpu<N>/gi<gi>/ci<ci>/access`), which the inventory records
//!   per MIG device (`gi_caps_minor`, `ci_caps_minor`). [`Inventory::devices_by_nodes`] maps
//!   them: a compute instance's node names its MIG device, a GPU instance's node without any
//!   of its compute instances' names every MIG device of that instance, and the parent's
//!   node then stands for the MIG device (it must be there). The result meets the rules of
//!   named devices, so two MIG devices, or a MIG device and a GPU, are refused; a cap node
//!   the inventory gives no MIG device for (a file inventory without cap minors, the
//!   driver's `config`/`monitor` nodes) is refused, never resolved to the parent, which is
//!   in MIG mode, where CUDA cannot run.
//! - Old MIG UUIDs `MIG-GPU-<uuid>/<gi>/<ci>` (drivers before R470) are refused: the
//!   inventory knows MIG devices by `MIG-<uuid>` only.
//! - An allocation that carries its allocator's MPS is refused: gpushare never stacks a
//!   second MPS on it. The allocator's MPS is known by a mount at an MPS pipe directory,
//!   which a pod cannot remove: where the env's `CUDA_MPS_PIPE_DIRECTORY` points, CUDA's
//!   default `/tmp/nvidia-mps` (the DRA driver's), or `/mps/<resource>/pipe` (the device
//!   plugin's `sharing.mps`). The env alone is not enough, either way: a pod's own env
//!   replaces the allocator's `CUDA_MPS_PIPE_DIRECTORY`.
//! - Every source spells `nvidia` (`NVIDIA_VISIBLE_DEVICES`, `nvidia-container-devices`,
//!   `/dev/nvidia`, the two CDI vendors): a spec whose bytes cannot spell it holds no
//!   allocation (`RawSpec::may_hold_allocation` relies on this).

use std::fmt;
use std::path::Path;

use super::grammar::{env_lookup, parse_index, parse_selector, MAX_DEVICES};
use super::types::{Inputs, RequestError};
use crate::device::{quote, DeviceError, DeviceRequest, Inventory, ResolvedDevices};

const VOLUME_DIR: &str = "/var/run/nvidia-container-devices";
/// The only source a volume-mounts allocation has (the device plugin's, and what NVIDIA's
/// toolkit requires): a pod's own volumes come from elsewhere.
const VOLUME_SOURCE: &str = "/dev/null";
const CDI_PREFIX: &str = "cdi.k8s.io/";
/// The CDI kinds whose devices are NVIDIA GPUs named by device-plugin ids: the device
/// plugin's, and the toolkit's own (`nvidia-ctk cdi generate`, Docker's `--gpus`).
const CDI_KINDS: [&str; 2] = ["k8s.device-plugin.nvidia.com/gpu", "nvidia.com/gpu"];
const VISIBLE_DEVICES: &str = "NVIDIA_VISIBLE_DEVICES";
const PIPE_ENV: &str = "CUDA_MPS_PIPE_DIRECTORY";
/// Where MPS clients look without `CUDA_MPS_PIPE_DIRECTORY`; the DRA driver's MPS mounts
/// its pipe directory there.
const DEFAULT_PIPE_DIR: &str = "/tmp/nvidia-mps";

const IDS_ALLOWED: &str = "device ids as NVIDIA's device plugin writes them: GPU-<uuid>, MIG-<uuid>, a GPU index like 0 or <gpu>:<mig> like 0:1, comma-separated, at most 16";
const OLD_MIG_ALLOWED: &str = "MIG-<uuid>, the MIG device names of NVIDIA drivers R470 and later";
const NODES_ALLOWED: &str = "device nodes as CDI injects them: /dev/nvidia<N> with minor number N";
const CAP_NODES_ALLOWED: &str =
    "MIG access nodes as CDI injects them: /dev/nvidia-caps/nvidia-cap<M> with minor number M";
const CAPS_DIR: &str = "/dev/nvidia-caps/";

/// Where an allocation was read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AllocationSource {
    CdiAnnotations,
    VolumeMounts,
    DeviceNodes,
    Env,
}

impl AllocationSource {
    /// How errors name it, in place of a request key.
    pub(crate) fn key(self) -> &'static str {
        match self {
            Self::CdiAnnotations => "cdi.k8s.io/*",
            Self::VolumeMounts => "/var/run/nvidia-container-devices/*",
            Self::DeviceNodes => "linux.devices",
            Self::Env => VISIBLE_DEVICES,
        }
    }
}

impl fmt::Display for AllocationSource {
    /// The device plugin's strategy names, for logs.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::CdiAnnotations => "cdi-annotations",
            Self::VolumeMounts => "volume-mounts",
            Self::DeviceNodes => "device-nodes",
            Self::Env => "envvar",
        })
    }
}

/// The devices of an allocation, as the spec gives them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AllocatedDevices {
    /// By device-plugin id.
    Named(DeviceRequest),
    /// By device node, deduplicated, in spec order: the minor numbers of `/dev/nvidia<N>`
    /// (`gpus`) and of `/dev/nvidia-caps/nvidia-cap<M>` (`caps`).
    Nodes { gpus: Vec<u32>, caps: Vec<u32> },
}

/// What one source of an allocation says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Said {
    pub source: AllocationSource,
    /// What the source says, for errors: the ids joined by `,` (for device nodes, their paths).
    pub found: String,
    pub devices: AllocatedDevices,
}

impl Said {
    /// The devices against the inventory, under the rules of named devices; errors name the
    /// source and what it said.
    fn resolve(&self, inventory: &Inventory) -> Result<ResolvedDevices, DeviceError> {
        let key = self.source.key();
        match &self.devices {
            AllocatedDevices::Named(req) => inventory.resolve(key, &self.found, req),
            AllocatedDevices::Nodes { gpus, caps } => inventory.resolve(
                key,
                &self.found,
                &inventory.devices_by_nodes(key, &self.found, gpus, caps)?,
            ),
        }
    }
}

/// What [`allocation`] found: every source that names devices, in the module doc's order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allocation {
    /// The first source; its order of the devices is the allocation's.
    pub first: Said,
    /// The other sources that name devices, which must name the same ones.
    pub others: Vec<Said>,
}

impl Allocation {
    /// Every source, the first first.
    pub fn sources(&self) -> impl Iterator<Item = &Said> {
        std::iter::once(&self.first).chain(&self.others)
    }

    /// The devices against the inventory, under the rules of named devices, once every
    /// source has resolved to the same set of devices. `key` and `value` are the request's,
    /// for errors: a source that does not resolve is named with what it said; sources that
    /// disagree are refused naming both.
    pub(crate) fn resolve(
        &self,
        key: &'static str,
        value: &str,
        inventory: &Inventory,
    ) -> Result<ResolvedDevices, RequestError> {
        let resolve = |said: &Said| {
            said.resolve(inventory)
                .map_err(|source| RequestError::AllocationUnusable {
                    key,
                    value: value.to_owned(),
                    source: Box::new(source),
                })
        };
        let devices = resolve(&self.first)?;
        let set = |d: &ResolvedDevices| {
            let mut uuids = d.uuids.clone();
            uuids.sort();
            uuids
        };
        for other in &self.others {
            let theirs = resolve(other)?;
            if set(&theirs) != set(&devices) {
                let says = |said: &Said, d: &ResolvedDevices| {
                    format!(
                        "{}={} names {}",
                        said.source.key(),
                        quote(&said.found),
                        d.uuids.join(",")
                    )
                };
                return Err(RequestError::AllocationDisagrees {
                    key,
                    value: value.to_owned(),
                    first: says(&self.first, &devices),
                    other: says(other, &theirs),
                });
            }
        }
        Ok(devices)
    }
}

/// Why a source's allocation cannot be read.
struct Unreadable {
    source: AllocationSource,
    found: String,
    problem: String,
    allowed: &'static str,
}

/// The devices this container was allocated, or `None` when no source names any (see the
/// module doc for the sources, their order and what does not count). `key` and `value` are
/// the request's (`gpushare.io/device=allocated`, `default-device`), for errors;
/// `env_read`: whether the node accepts `NVIDIA_VISIBLE_DEVICES` as a source.
pub(crate) fn allocation(
    c: &Inputs<'_>,
    key: &'static str,
    value: &str,
    env_read: bool,
) -> Result<Option<Allocation>, RequestError> {
    let unreadable = |u: Unreadable| RequestError::AllocationUnreadable {
        key,
        value: value.to_owned(),
        source_key: u.source.key(),
        found: u.found,
        problem: u.problem,
        allowed: u.allowed,
    };
    let mut sources = Vec::with_capacity(1);
    for said in [
        from_cdi_annotations(c),
        from_volume_mounts(c),
        from_device_nodes(c),
        if env_read { from_env(c) } else { Ok(None) },
    ] {
        sources.extend(said.map_err(unreadable)?);
    }
    let mut sources = sources.into_iter();
    let Some(first) = sources.next() else {
        return Ok(None);
    };
    if let Some((pipe, mount_source, why)) = allocator_mps(c) {
        return Err(RequestError::AllocatorMps {
            key,
            value: value.to_owned(),
            pipe,
            mount_source,
            why,
        });
    }
    Ok(Some(Allocation {
        first,
        others: sources.collect(),
    }))
}

/// The allocator's MPS, if the spec carries it: the mount at an MPS pipe directory (see
/// the module doc), as (its destination, its source, which pipe directory that is).
fn allocator_mps(c: &Inputs<'_>) -> Option<(String, String, &'static str)> {
    let pipe_env = env_lookup(c.env, PIPE_ENV).filter(|p| !p.is_empty());
    c.mounts.iter().find_map(|m| {
        let dest = m.destination().to_str()?;
        let why = if Some(dest) == pipe_env {
            "where the container's CUDA_MPS_PIPE_DIRECTORY points"
        } else if dest == DEFAULT_PIPE_DIR {
            "CUDA's default MPS pipe directory, where the DRA driver's MPS puts its own"
        } else if dest.starts_with("/mps/") && dest.ends_with("/pipe") {
            "where the device plugin's sharing.mps puts its pipe directory"
        } else {
            return None;
        };
        let source = m
            .source()
            .as_deref()
            .map(|s| s.display().to_string())
            .unwrap_or_default();
        Some((dest.to_owned(), source, why))
    })
}

/// Device-plugin ids → named devices; `found` is what errors show.
fn named(source: AllocationSource, found: String, ids: &[&str]) -> Result<Said, Unreadable> {
    let unreadable = |problem: String, allowed| Unreadable {
        source,
        found: found.clone(),
        problem,
        allowed,
    };
    if ids.len() > MAX_DEVICES {
        return Err(unreadable(
            format!("lists {} devices", ids.len()),
            IDS_ALLOWED,
        ));
    }
    let mut selectors = Vec::with_capacity(ids.len());
    for (n, id) in ids.iter().enumerate() {
        if id.starts_with("MIG-GPU-") && id.contains('/') {
            return Err(unreadable(
                format!(
                    "has entry {} ({}), a MIG device named as drivers before R470 did (MIG-GPU-<uuid>/<gi>/<ci>), which the inventory cannot map",
                    n + 1,
                    quote(id)
                ),
                OLD_MIG_ALLOWED,
            ));
        }
        match parse_selector(id) {
            Some(selector) => selectors.push(selector),
            None if id.is_empty() => {
                return Err(unreadable(
                    format!("has entry {} empty", n + 1),
                    IDS_ALLOWED,
                ))
            }
            None => {
                return Err(unreadable(
                    format!("has entry {} ({}), which is not a device", n + 1, quote(id)),
                    IDS_ALLOWED,
                ))
            }
        }
    }
    Ok(Said {
        source,
        found,
        devices: AllocatedDevices::Named(DeviceRequest(selectors)),
    })
}

fn from_cdi_annotations(c: &Inputs<'_>) -> Result<Option<Said>, Unreadable> {
    let Some(annotations) = c.annotations else {
        return Ok(None);
    };
    let mut keys: Vec<&String> = annotations
        .keys()
        .filter(|k| k.starts_with(CDI_PREFIX))
        .collect();
    keys.sort();
    let ids: Vec<&str> = keys
        .iter()
        .flat_map(|k| annotations[*k].split(','))
        .filter_map(|entry| entry.split_once('='))
        .filter(|(kind, name)| CDI_KINDS.contains(kind) && *name != "all")
        .map(|(_, name)| name)
        .collect();
    if ids.is_empty() {
        return Ok(None);
    }
    named(AllocationSource::CdiAnnotations, ids.join(","), &ids).map(Some)
}

fn from_volume_mounts(c: &Inputs<'_>) -> Result<Option<Said>, Unreadable> {
    let ids: Vec<&str> = c
        .mounts
        .iter()
        .filter(|m| m.source().as_deref() == Some(Path::new(VOLUME_SOURCE)))
        .filter_map(|m| {
            m.destination()
                .to_str()?
                .strip_prefix(VOLUME_DIR)?
                .strip_prefix('/')
        })
        .filter(|id| !id.is_empty() && !id.contains('/'))
        .collect();
    if ids.is_empty() {
        return Ok(None);
    }
    named(AllocationSource::VolumeMounts, ids.join(","), &ids).map(Some)
}

fn from_env(c: &Inputs<'_>) -> Result<Option<Said>, Unreadable> {
    let Some(value) = env_lookup(c.env, VISIBLE_DEVICES) else {
        return Ok(None);
    };
    let ids: Vec<&str> = value.split(',').collect();
    if value.is_empty()
        || value == VOLUME_DIR
        || ids.iter().any(|id| matches!(*id, "all" | "none" | "void"))
    {
        return Ok(None);
    }
    named(AllocationSource::Env, value.to_owned(), &ids).map(Some)
}

fn from_device_nodes(c: &Inputs<'_>) -> Result<Option<Said>, Unreadable> {
    if c.all_devices_allowed {
        return Ok(None);
    }
    let mut minors = Vec::new();
    let mut paths = Vec::new();
    let mut caps = Vec::new();
    let mut cap_paths = Vec::new();
    for node in c.devices {
        let Some(path) = node.path().to_str() else {
            continue;
        };
        if let Some(name) = path.strip_prefix(CAPS_DIR) {
            let cap = name.strip_prefix("nvidia-cap").and_then(parse_index);
            let problem = match cap {
                None => Some(format!("has {path}, which is not a MIG access node")),
                Some(cap) if node.major() != 0 && node.minor() != i64::from(cap) => {
                    Some(format!("has {path} with minor number {}", node.minor()))
                }
                Some(_) => None,
            };
            if let Some(problem) = problem {
                return Err(Unreadable {
                    source: AllocationSource::DeviceNodes,
                    found: path.to_owned(),
                    problem,
                    allowed: CAP_NODES_ALLOWED,
                });
            }
            if let Some(cap) = cap.filter(|cap| !caps.contains(cap)) {
                caps.push(cap);
                cap_paths.push(path);
            }
            continue;
        }
        // Not /dev/nvidiactl, /dev/nvidia-uvm, /dev/nvidia-modeset, …: only GPUs.
        let Some(minor) = path.strip_prefix("/dev/nvidia").and_then(parse_index) else {
            continue;
        };
        // runc makes the node from major/minor; the path is only its name. nvcdi writes
        // the host's own node, whose name is its minor number.
        if node.major() != 0 && node.minor() != i64::from(minor) {
            return Err(Unreadable {
                source: AllocationSource::DeviceNodes,
                found: path.to_owned(),
                problem: format!("has {path} with minor number {}", node.minor()),
                allowed: NODES_ALLOWED,
            });
        }
        if !minors.contains(&minor) {
            minors.push(minor);
            paths.push(path);
        }
    }
    if minors.is_empty() {
        return Ok(None);
    }
    paths.extend(cap_paths);
    Ok(Some(Said {
        source: AllocationSource::DeviceNodes,
        found: paths.join(","),
        devices: AllocatedDevices::Nodes { gpus: minors, caps },
    }))
}

#[cfg(test)]
mod tests {
    //! Every allocation strategy of docs/kubernetes.md ("Let the scheduler pick the GPU"),
    //! as the spec shapes it names, on top of the captured
    //! engine fixtures, through the real spec parsing (`SpecFile`) and request parsing.

    use std::path::Path;

    use serde_json::{json, Value};

    use crate::bundle::{RawSpec, SpecFile};
    use crate::device::testing::{GPU0, GPU1, GPU2, MIG1, MIG2};
    use crate::device::{sample, DeviceKind};
    use crate::request::types::looked_at;
    use crate::request::{
        parse, DefaultDevice, DeviceValue, Options, Request, RequestError, ALLOCATED,
    };

    use super::*;

    // The sample inventory: GPU 0 (minor 2) and GPU 2 (minor 1) without MIG, GPU 1 (minor 0)
    // in MIG mode with MIG devices 1:0–1:2 (access nodes 12/13, 21/22, 30/31).
    /// The device plugin's cdi-annotations key: a fresh random UUID per response.
    const CDI_KEY: &str = "cdi.k8s.io/nvidia-device-plugin_4b0c2d7e-9a51-4f39-8e3a-55d1f0c2a6b7";
    /// What CUDA base images put in their own env.
    const IMAGE_ALL: &str = "NVIDIA_VISIBLE_DEVICES=all";

    fn fixture(name: &str) -> Value {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures")
            .join(name);
        serde_json::from_slice(&std::fs::read(path).expect("fixture")).expect("fixture json")
    }

    /// containerd's captured spec without its gpushare annotations: a CRI container as
    /// the kubelet asks containerd for one, before any allocation.
    fn cri() -> Value {
        let mut v = fixture("containerd-1.6-config.json");
        v["annotations"] = json!({
            "io.kubernetes.cri.container-type": "container",
            "io.kubernetes.cri.container-name": "cuda",
            "io.kubernetes.cri.sandbox-id": "5a3f0c8f2b1e4d6c9a7b8e0f1d2c3b4a5f6e7d8c9b0a1f2e3d4c5b6a7f8e9d0c",
        });
        v
    }

    fn push_env(v: &mut Value, entries: &[&str]) {
        let env = v["process"]["env"].as_array_mut().expect("env");
        env.extend(entries.iter().map(|e| json!(e)));
    }

    fn push_mount(v: &mut Value, source: &str, destination: &str, options: &[&str]) {
        v["mounts"].as_array_mut().expect("mounts").push(json!({
            "destination": destination, "type": "bind", "source": source, "options": options,
        }));
    }

    /// A CDI-injected device node, as containerd and CRI-O write it into `linux.devices`
    /// (with its device cgroup rule).
    fn push_node(v: &mut Value, path: &str, major: i64, minor: i64) {
        let devices = v["linux"]
            .as_object_mut()
            .expect("linux")
            .entry("devices")
            .or_insert_with(|| json!([]));
        devices.as_array_mut().expect("devices").push(json!({
            "path": path, "type": "c", "major": major, "minor": minor, "fileMode": 438, "uid": 0, "gid": 0,
        }));
        v["linux"]["resources"]["devices"]
            .as_array_mut()
            .expect("device rules")
            .push(json!({"allow": true, "type": "c", "major": major, "minor": minor, "access": "rwm"}));
    }

    /// nvcdi's common edits plus one GPU's: `/dev/nvidiactl`, uvm, and `/dev/nvidia<minor>`.
    fn push_cdi_gpu(v: &mut Value, minor: i64) {
        push_node(v, "/dev/nvidiactl", 195, 255);
        push_node(v, "/dev/nvidia-uvm", 508, 0);
        push_node(v, "/dev/nvidia-uvm-tools", 508, 1);
        push_node(v, &format!("/dev/nvidia{minor}"), 195, minor);
        push_env(v, &["NVIDIA_CTK_LIBCUDA_DIR=/usr/lib/x86_64-linux-gnu"]);
    }

    fn annotate(v: &mut Value, key: &str, value: &str) {
        v["annotations"][key] = json!(value);
    }

    struct Parsed {
        bytes: Vec<u8>,
        result: Result<Option<Request>, RequestError>,
    }

    impl Parsed {
        /// The request it parsed to; panics when it did not parse or was none.
        fn request(&self) -> &Request {
            self.result
                .as_ref()
                .expect("parses")
                .as_ref()
                .expect("request")
        }
    }

    /// Parsed on a node that accepts `NVIDIA_VISIBLE_DEVICES` (`accept-visible-devices-env =
    /// true`, the envvar strategy's node).
    fn run(v: &Value, default_device: Option<DefaultDevice>) -> Parsed {
        run_with(v, default_device, true)
    }

    /// Parsed on a node of the documented defaults: `NVIDIA_VISIBLE_DEVICES` is not read.
    fn run_default(v: &Value, default_device: Option<DefaultDevice>) -> Parsed {
        run_with(v, default_device, false)
    }

    fn run_with(v: &Value, default_device: Option<DefaultDevice>, visible_env: bool) -> Parsed {
        let bytes = serde_json::to_vec(v).expect("json");
        let spec = SpecFile::from_bytes(Path::new("config.json"), &bytes).expect("a spec");
        let result = parse(
            &spec.request_inputs(),
            &Options {
                accept_env: true,
                default_device,
                accept_visible_devices_env: visible_env,
            },
        );
        Parsed { bytes, result }
    }

    /// `gpushare.io/device=allocated` on the spec.
    fn asked(mut v: Value) -> Parsed {
        annotate(&mut v, "gpushare.io/device", ALLOCATED);
        run(&v, None)
    }

    /// The first source of the allocation.
    fn found(p: &Parsed) -> Said {
        allocation_of(p).first
    }

    fn allocation_of(p: &Parsed) -> Allocation {
        match p.result.as_ref().expect("parses") {
            Some(Request {
                device:
                    crate::request::Sourced {
                        value: DeviceValue::Allocated(found),
                        ..
                    },
                ..
            }) => found.clone(),
            other => panic!("not an allocated request: {other:?}"),
        }
    }

    fn refusal(p: &Parsed) -> String {
        let err = p.result.as_ref().expect_err("refused");
        let msg = err.to_string();
        assert!(!msg.contains('\n'), "{msg}");
        msg
    }

    /// Why the allocation's devices do not resolve against the sample inventory, on one line.
    fn resolve_refusal(p: &Parsed) -> String {
        let req = p.request();
        format!(
            "{:#}",
            anyhow::Error::new(req.device.resolve(&sample()).expect_err("refused"))
        )
    }

    /// The allocation's devices against the sample inventory: UUIDs and kind.
    fn resolved(p: &Parsed) -> (Vec<String>, DeviceKind) {
        let req = p.request();
        let d = req.device.resolve(&sample()).expect("resolves");
        (d.uuids, d.kind)
    }

    #[test]
    fn envvar_strategy_ids_as_the_device_plugin_writes_them() {
        use AllocationSource::Env;
        // (NVIDIA_VISIBLE_DEVICES, devices, kind)
        let cases: &[(&str, &[&str], DeviceKind)] = &[
            // --device-id-strategy=uuid
            (GPU2, &[GPU2], DeviceKind::Gpus),
            (&format!("{GPU0},{GPU2}"), &[GPU0, GPU2], DeviceKind::Gpus),
            // --device-id-strategy=index
            ("2", &[GPU2], DeviceKind::Gpus),
            ("2,0", &[GPU2, GPU0], DeviceKind::Gpus),
            // MIG strategies single/mixed: MIG UUIDs, or gpu:mig under index.
            (MIG1, &[MIG1], DeviceKind::Mig),
            ("1:2", &[MIG2], DeviceKind::Mig),
        ];
        for (value, want, kind) in cases {
            let mut v = cri();
            // The image's own value first, the kubelet's after it: the last one counts.
            push_env(
                &mut v,
                &[IMAGE_ALL, &format!("NVIDIA_VISIBLE_DEVICES={value}")],
            );
            let p = asked(v);
            let a = found(&p);
            assert_eq!((a.source, a.found.as_str()), (Env, *value));
            let want: Vec<String> = want.iter().map(|s| s.to_string()).collect();
            assert_eq!(resolved(&p), (want, *kind), "{value}");
            assert!(RawSpec::from(&p).may_hold_allocation());
        }
        // Docker's --gpus fallback on the Docker fixture, as a Docker user would ask.
        let mut v = fixture("docker-20.10-config.json");
        v["process"]["env"] = json!(["PATH=/bin", "NVIDIA_VISIBLE_DEVICES=0"]);
        let p = asked(v);
        assert_eq!(resolved(&p).0, vec![GPU0]);
    }

    #[test]
    fn what_is_not_an_allocation() {
        // The image's own all (CDI-only strategies leave it in the spec), none, void, empty,
        // a list holding one of them, and the volume-mounts marker without mounts.
        for value in [
            "all",
            "none",
            "void",
            "",
            "0,void",
            "all,1",
            "/var/run/nvidia-container-devices",
        ] {
            let mut v = cri();
            push_env(&mut v, &[&format!("NVIDIA_VISIBLE_DEVICES={value}")]);
            let p = asked(v.clone());
            let msg = refusal(&p);
            assert_eq!(
                msg,
                format!("gpushare.io/device=\"allocated\" found no devices allocated to the container: {}; allowed is allocated in a container given GPUs by a device plugin or DRA driver, or devices named explicitly (0, GPU-<uuid>, MIG-<uuid>, 0:1)", looked_at(true)),
                "{value}"
            );
            // With the node's default, the same container passes through.
            assert!(run(&v, Some(DefaultDevice::Allocated))
                .result
                .expect(value)
                .is_none());
        }
        // Nothing at all: the bare fixtures.
        for name in [
            "containerd-1.6-config.json",
            "docker-20.10-config.json",
            "podman-4.3-config.json",
        ] {
            let mut v = fixture(name);
            v["annotations"] = json!({});
            v["process"]["env"] = json!(["PATH=/bin"]);
            assert!(refusal(&asked(v.clone())).contains("found no devices allocated"));
            let p = run(&v, Some(DefaultDevice::Allocated));
            assert!(p.result.as_ref().expect(name).is_none());
            assert!(!RawSpec::from(&p).may_hold_allocation(), "{name}");
        }
    }

    #[test]
    fn malformed_and_old_ids_are_refused_naming_the_source() {
        #[rustfmt::skip]
        let cases: &[(&str, &str)] = &[
            ("foo", "NVIDIA_VISIBLE_DEVICES=\"foo\" has entry 1 (\"foo\"), which is not a device; allowed is device ids as NVIDIA's device plugin writes them"),
            ("1,,2", "NVIDIA_VISIBLE_DEVICES=\"1,,2\" has entry 2 empty; allowed is device ids"),
            ("GPU-x", "has entry 1 (\"GPU-x\"), which is not a device"),
            // The replicas' ::n suffix never reaches a spec.
            ("GPU-a1b2c3d4-e5f6-4789-9abc-def012345678::1", "which is not a device"),
            ("MIG-GPU-8f8bff94-112e-9541-43da-cfd453333404/1/0", "has entry 1 (\"MIG-GPU-8f8bff94-112e-9541-43da-cfd453333404/1/0\"), a MIG device named as drivers before R470 did (MIG-GPU-<uuid>/<gi>/<ci>), which the inventory cannot map; allowed is MIG-<uuid>, the MIG device names of NVIDIA drivers R470 and later"),
            ("0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16", "lists 17 devices; allowed is device ids"),
        ];
        for (value, want) in cases {
            let mut v = cri();
            push_env(&mut v, &[&format!("NVIDIA_VISIBLE_DEVICES={value}")]);
            let msg = refusal(&asked(v));
            assert!(
                msg.starts_with("gpushare.io/device=\"allocated\" cannot use the container's allocation: NVIDIA_VISIBLE_DEVICES="),
                "{msg}"
            );
            assert!(msg.contains(want), "{msg}\n lacks {want}");
        }
        // The ids then meet the rules of named devices: MIG devices stand alone, a GPU in
        // MIG mode is refused, an unknown GPU is named.
        #[rustfmt::skip]
        let unusable: &[(&str, &str)] = &[
            (&format!("{MIG1},{MIG2}"), "NVIDIA_VISIBLE_DEVICES=\"MIG-33a1d16a-6d03-4fb3-a3a8-8a97a6767ed1,MIG-44b2e27b-7e14-40c4-…\" is invalid: a MIG device must stand alone, not in a list"),
            ("1", "NVIDIA_VISIBLE_DEVICES=\"1\" names GPU 1, which is in MIG mode: allowed is one of its MIG devices (1:0, 1:1, 1:2)"),
            ("7", "NVIDIA_VISIBLE_DEVICES=\"7\" names GPU 7, which does not exist: this node has GPUs 0, 1, 2"),
        ];
        for (value, want) in unusable {
            let mut v = cri();
            push_env(&mut v, &[&format!("NVIDIA_VISIBLE_DEVICES={value}")]);
            let p = asked(v);
            let req = p.result.expect("parses").expect("request");
            let err = req.device.resolve(&sample()).expect_err(value);
            let line = format!("{:#}", anyhow::Error::new(err));
            assert_eq!(
                line,
                format!("gpushare.io/device=\"allocated\" takes the devices allocated to the container: {want}")
            );
        }
    }

    #[test]
    fn volume_mounts_strategy() {
        let mut v = cri();
        push_env(
            &mut v,
            &["NVIDIA_VISIBLE_DEVICES=/var/run/nvidia-container-devices"],
        );
        for id in [GPU0, GPU2] {
            push_mount(
                &mut v,
                "/dev/null",
                &format!("/var/run/nvidia-container-devices/{id}"),
                &["ro", "nosuid", "nodev", "bind"],
            );
        }
        // IMEX channels sit deeper and are no GPU.
        push_mount(
            &mut v,
            "/dev/null",
            "/var/run/nvidia-container-devices/imex/0",
            &["ro", "bind"],
        );
        let p = asked(v);
        let a = found(&p);
        assert_eq!(a.source, AllocationSource::VolumeMounts);
        assert_eq!(a.found, format!("{GPU0},{GPU2}"));
        assert_eq!(
            resolved(&p),
            (vec![GPU0.to_owned(), GPU2.to_owned()], DeviceKind::Gpus)
        );
        // A MIG device by index.
        let mut v = cri();
        push_env(
            &mut v,
            &["NVIDIA_VISIBLE_DEVICES=/var/run/nvidia-container-devices"],
        );
        push_mount(
            &mut v,
            "/dev/null",
            "/var/run/nvidia-container-devices/1:1",
            &["ro", "bind"],
        );
        assert_eq!(
            resolved(&asked(v)),
            (vec![MIG1.to_owned()], DeviceKind::Mig)
        );
    }

    #[test]
    fn cdi_annotations_strategy() {
        // The device plugin's annotation, with the image's own all still in the env; other
        // vendors, other NVIDIA classes and DRA claims are not read.
        let mut v = cri();
        push_env(&mut v, &[IMAGE_ALL]);
        annotate(
            &mut v,
            CDI_KEY,
            &format!(
                "k8s.device-plugin.nvidia.com/gpu={GPU2},k8s.device-plugin.nvidia.com/gdrcopy=all"
            ),
        );
        annotate(&mut v, "cdi.k8s.io/other_9f1c", "vendor.example/gpu=0");
        annotate(
            &mut v,
            "cdi.k8s.io/dra_1",
            "k8s.gpu.nvidia.com/claim=6d1c0b3a-gpu-1",
        );
        let p = asked(v);
        let a = found(&p);
        assert_eq!(
            (a.source, a.found.as_str()),
            (AllocationSource::CdiAnnotations, GPU2)
        );
        assert_eq!(resolved(&p), (vec![GPU2.to_owned()], DeviceKind::Gpus));

        // The operator's default, cdi-annotations,cdi-cri: the annotation and the injected
        // node agree; the annotation names the device and wins. A MIG device by UUID.
        let mut v = cri();
        push_env(&mut v, &[IMAGE_ALL]);
        annotate(
            &mut v,
            CDI_KEY,
            &format!("k8s.device-plugin.nvidia.com/gpu={MIG2}"),
        );
        push_cdi_gpu(&mut v, 0);
        push_node(&mut v, "/dev/nvidia-caps/nvidia-cap30", 511, 30);
        push_node(&mut v, "/dev/nvidia-caps/nvidia-cap31", 511, 31);
        let p = asked(v);
        assert_eq!(found(&p).source, AllocationSource::CdiAnnotations);
        assert_eq!(resolved(&p), (vec![MIG2.to_owned()], DeviceKind::Mig));

        // Two annotations (two resources): every GPU, keys in sorted order; index ids; the
        // toolkit's own vendor.
        let mut v = cri();
        annotate(
            &mut v,
            "cdi.k8s.io/nvidia-device-plugin_b",
            "nvidia.com/gpu=0",
        );
        annotate(
            &mut v,
            "cdi.k8s.io/nvidia-device-plugin_a",
            "k8s.device-plugin.nvidia.com/gpu=2",
        );
        let p = asked(v);
        assert_eq!(found(&p).found, "2,0");
        assert_eq!(resolved(&p).0, vec![GPU2, GPU0]);

        // Only other kinds: no allocation.
        let mut v = cri();
        annotate(&mut v, CDI_KEY, "k8s.device-plugin.nvidia.com/gpu=all");
        assert!(refusal(&asked(v)).contains("found no devices allocated"));
    }

    #[test]
    fn cdi_cri_and_dra_device_nodes() {
        // cdi-cri (and the DRA driver): only the applied edits, the image's all in the env.
        let mut v = cri();
        push_env(&mut v, &[IMAGE_ALL]);
        push_cdi_gpu(&mut v, 2);
        let p = asked(v.clone());
        let a = found(&p);
        assert_eq!(a.source, AllocationSource::DeviceNodes);
        assert_eq!(a.found, "/dev/nvidia2");
        assert_eq!(
            a.devices,
            AllocatedDevices::Nodes {
                gpus: vec![2],
                caps: vec![]
            }
        );
        assert_eq!(resolved(&p), (vec![GPU0.to_owned()], DeviceKind::Gpus));
        // Two GPUs, in spec order; the common nodes once.
        push_cdi_gpu(&mut v, 1);
        let p = asked(v);
        assert_eq!(found(&p).found, "/dev/nvidia2,/dev/nvidia1");
        assert_eq!(resolved(&p).0, vec![GPU0, GPU2]);

        // DRA MIG: the parent node and the GI/CI access nodes; no name anywhere. The sample
        // gives MIG device 1:1 caps 21 (gi) and 22 (ci); its GPU's node is /dev/nvidia0.
        let mut v = cri();
        push_cdi_gpu(&mut v, 0);
        push_node(&mut v, "/dev/nvidia-caps/nvidia-cap21", 511, 21);
        push_node(&mut v, "/dev/nvidia-caps/nvidia-cap22", 511, 22);
        let p = asked(v.clone());
        let a = found(&p);
        assert_eq!(
            a.found,
            "/dev/nvidia0,/dev/nvidia-caps/nvidia-cap21,/dev/nvidia-caps/nvidia-cap22"
        );
        assert_eq!(
            a.devices,
            AllocatedDevices::Nodes {
                gpus: vec![0],
                caps: vec![21, 22]
            }
        );
        assert_eq!(resolved(&p), (vec![MIG1.to_owned()], DeviceKind::Mig));
        // The same with the nodes in another order, and the GPU instance's node alone
        // (its one compute instance).
        let mut w = cri();
        push_node(&mut w, "/dev/nvidia-caps/nvidia-cap22", 511, 22);
        push_cdi_gpu(&mut w, 0);
        assert_eq!(
            resolved(&asked(w)),
            (vec![MIG1.to_owned()], DeviceKind::Mig)
        );
        let mut w = cri();
        push_cdi_gpu(&mut w, 0);
        push_node(&mut w, "/dev/nvidia-caps/nvidia-cap30", 511, 30);
        assert_eq!(
            resolved(&asked(w)),
            (vec![MIG2.to_owned()], DeviceKind::Mig)
        );

        // Two MIG devices: refused as a named list of them is.
        push_node(&mut v, "/dev/nvidia-caps/nvidia-cap30", 511, 30);
        push_node(&mut v, "/dev/nvidia-caps/nvidia-cap31", 511, 31);
        assert_eq!(
            resolve_refusal(&asked(v)),
            "gpushare.io/device=\"allocated\" takes the devices allocated to the container: linux.devices=\"/dev/nvidia0,/dev/nvidia-caps/nvidia-cap21,/dev/nvidia-caps/nvid…\" is invalid: a MIG device must stand alone, not in a list"
        );
        // A MIG device with a full GPU: the same.
        let mut v = cri();
        push_cdi_gpu(&mut v, 0);
        push_node(&mut v, "/dev/nvidia-caps/nvidia-cap21", 511, 21);
        push_node(&mut v, "/dev/nvidia-caps/nvidia-cap22", 511, 22);
        push_cdi_gpu(&mut v, 1);
        assert!(resolve_refusal(&asked(v))
            .ends_with("is invalid: a MIG device must stand alone, not in a list"));

        // A cap node no MIG device has (the driver's config node, say): refused, never the
        // parent; with an inventory that gives no cap minors too.
        let mut v = cri();
        push_cdi_gpu(&mut v, 0);
        push_node(&mut v, "/dev/nvidia-caps/nvidia-cap1", 511, 1);
        let p = asked(v);
        assert_eq!(
            resolve_refusal(&p),
            "gpushare.io/device=\"allocated\" takes the devices allocated to the container: linux.devices=\"/dev/nvidia0,/dev/nvidia-caps/nvidia-cap1\" holds /dev/nvidia-caps/nvidia-cap1, which is the access node of no MIG device: this node's MIG devices have cap minors 12, 13, 21, 22, 30, 31"
        );
        let mut bare = sample();
        for gpu in &mut bare.gpus {
            for mig in &mut gpu.mig_devices {
                (mig.gi_caps_minor, mig.ci_caps_minor) = (None, None);
            }
        }
        let req = p.request();
        let line = format!(
            "{:#}",
            anyhow::Error::new(req.device.resolve(&bare).expect_err("no caps"))
        );
        assert!(line.ends_with("holds /dev/nvidia-caps/nvidia-cap1, which is the access node of no MIG device: this node's inventory gives no cap minors for its MIG devices (an inventory file needs \"gi_caps_minor\" and \"ci_caps_minor\" on each MIG device)"), "{line}");

        // A MIG device's caps without its GPU's node.
        let mut v = cri();
        push_cdi_gpu(&mut v, 1);
        push_node(&mut v, "/dev/nvidia-caps/nvidia-cap21", 511, 21);
        push_node(&mut v, "/dev/nvidia-caps/nvidia-cap22", 511, 22);
        assert_eq!(
            resolve_refusal(&asked(v)),
            format!("gpushare.io/device=\"allocated\" takes the devices allocated to the container: linux.devices=\"/dev/nvidia1,/dev/nvidia-caps/nvidia-cap21,/dev/nvidia-caps/nvid…\" holds /dev/nvidia-caps/nvidia-cap22, an access node of MIG device {MIG1} of GPU 1, without its GPU's node /dev/nvidia0: allowed is a MIG device's nodes as CDI injects them, its GPU's /dev/nvidia<N> with them")
        );

        // The parent alone is the GPU, in MIG mode: refused as a name of it is.
        let mut v = cri();
        push_cdi_gpu(&mut v, 0);
        assert!(resolve_refusal(&asked(v)).contains("names GPU 1, which is in MIG mode"));

        // A cap node whose path and minor disagree, or a path that is no access node.
        let mut v = cri();
        push_cdi_gpu(&mut v, 0);
        push_node(&mut v, "/dev/nvidia-caps/nvidia-cap21", 511, 22);
        assert_eq!(refusal(&asked(v)), "gpushare.io/device=\"allocated\" cannot use the container's allocation: linux.devices=\"/dev/nvidia-caps/nvidia-cap21\" has /dev/nvidia-caps/nvidia-cap21 with minor number 22; allowed is MIG access nodes as CDI injects them: /dev/nvidia-caps/nvidia-cap<M> with minor number M");
        let mut v = cri();
        push_cdi_gpu(&mut v, 0);
        push_node(&mut v, "/dev/nvidia-caps/other", 511, 3);
        assert!(refusal(&asked(v))
            .contains("has /dev/nvidia-caps/other, which is not a MIG access node"));

        // A node whose path and minor disagree was not written by nvcdi.
        let mut v = cri();
        push_node(&mut v, "/dev/nvidia1", 195, 3);
        assert!(refusal(&asked(v)).contains("linux.devices=\"/dev/nvidia1\" has /dev/nvidia1 with minor number 3; allowed is device nodes as CDI injects them"));

        // A minor the inventory does not know, resolved with the source named.
        let mut v = cri();
        push_cdi_gpu(&mut v, 9);
        let req = asked(v).result.expect("parses").expect("request");
        let line = format!(
            "{:#}",
            anyhow::Error::new(req.device.resolve(&sample()).expect_err("9"))
        );
        assert_eq!(line, "gpushare.io/device=\"allocated\" takes the devices allocated to the container: linux.devices=\"/dev/nvidia9\" names the GPU with minor number 9 (/dev/nvidia9), which does not exist: this node's GPUs have minor numbers 2, 0, 1");
    }

    #[test]
    fn a_privileged_containers_device_nodes_are_no_allocation() {
        // containerd's privileged container: every host device, every device allowed.
        let mut v = cri();
        push_cdi_gpu(&mut v, 1);
        push_cdi_gpu(&mut v, 2);
        v["linux"]["resources"]["devices"] = json!([{"allow": true, "access": "rwm"}]);
        assert!(refusal(&asked(v.clone())).contains("found no devices allocated"));
        assert!(run(&v, Some(DefaultDevice::Allocated))
            .result
            .expect("passes")
            .is_none());
        // Its env allocation still counts.
        push_env(&mut v, &["NVIDIA_VISIBLE_DEVICES=2"]);
        assert_eq!(resolved(&asked(v)).0, vec![GPU2]);
    }

    #[test]
    fn the_allocators_own_mps_is_refused() {
        // Device plugin sharing.mps: env, pipe and shm mounts of its own.
        let mut plugin = cri();
        push_env(
            &mut plugin,
            &[
                &format!("NVIDIA_VISIBLE_DEVICES={GPU2}"),
                "CUDA_MPS_PIPE_DIRECTORY=/mps/nvidia.com/gpu/pipe",
            ],
        );
        push_mount(
            &mut plugin,
            "/run/nvidia/mps/nvidia.com/gpu/pipe",
            "/mps/nvidia.com/gpu/pipe",
            &["rbind"],
        );
        push_mount(&mut plugin, "/run/nvidia/mps/shm", "/dev/shm", &["rbind"]);
        // DRA driver MPS: the applied edits only.
        let mut dra = cri();
        push_cdi_gpu(&mut dra, 1);
        push_env(&mut dra, &["CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps"]);
        let dir = "/var/lib/kubelet/plugins/gpu.nvidia.com/mps/6d1c0b3a";
        push_mount(&mut dra, &format!("{dir}/shm"), "/dev/shm", &["rbind"]);
        push_mount(
            &mut dra,
            &format!("{dir}/pipe"),
            "/tmp/nvidia-mps",
            &["rbind"],
        );
        const BY_ENV: &str = "where the container's CUDA_MPS_PIPE_DIRECTORY points";
        const PLUGIN: &str = "where the device plugin's sharing.mps puts its pipe directory";
        const DRA: &str =
            "CUDA's default MPS pipe directory, where the DRA driver's MPS puts its own";
        // A pod's own env replaces the allocator's CUDA_MPS_PIPE_DIRECTORY in place (the
        // kubelet puts it after the device plugin's, containerd keeps one entry per name):
        // the mount still gives the allocator's MPS away.
        let forged = |mut v: Value| {
            for e in v["process"]["env"].as_array_mut().expect("env") {
                if e.as_str()
                    .is_some_and(|e| e.starts_with("CUDA_MPS_PIPE_DIRECTORY="))
                {
                    *e = json!("CUDA_MPS_PIPE_DIRECTORY=/pod/elsewhere");
                }
            }
            v
        };
        for (v, pipe, source, why) in [
            (
                plugin.clone(),
                "/mps/nvidia.com/gpu/pipe",
                "/run/nvidia/mps/nvidia.com/gpu/pipe".to_owned(),
                BY_ENV,
            ),
            (
                forged(plugin),
                "/mps/nvidia.com/gpu/pipe",
                "/run/nvidia/mps/nvidia.com/gpu/pipe".to_owned(),
                PLUGIN,
            ),
            (
                dra.clone(),
                "/tmp/nvidia-mps",
                format!("{dir}/pipe"),
                BY_ENV,
            ),
            (forged(dra), "/tmp/nvidia-mps", format!("{dir}/pipe"), DRA),
        ] {
            let tail = format!("is refused: the container's allocation already carries its allocator's MPS (a mount at \"{pipe}\" from {}, {why}), and gpushare never stacks a second MPS on it; allowed is an allocation without the allocator's MPS sharing (device plugin sharing.mps, DRA driver MPS)", crate::device::quote(&source));
            assert_eq!(
                refusal(&asked(v.clone())),
                format!("gpushare.io/device=\"allocated\" {tail}")
            );
            assert_eq!(
                refusal(&run(&v, Some(DefaultDevice::Allocated))),
                format!("default-device=\"allocated\" {tail}")
            );
        }
        // The variable alone (an image's own, say) is no allocator's MPS.
        let mut v = cri();
        push_env(
            &mut v,
            &[
                "NVIDIA_VISIBLE_DEVICES=2",
                "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps",
            ],
        );
        assert_eq!(resolved(&asked(v)).0, vec![GPU2]);
    }

    /// A pod's `emptyDir` at `/var/run/nvidia-container-devices/<id>`, as containerd writes
    /// the kubelet's volume mount.
    fn push_pod_volume(v: &mut Value, id: &str) {
        push_mount(
            v,
            "/var/lib/kubelet/pods/8d3b6a3c/volumes/kubernetes.io~empty-dir/forged",
            &format!("/var/run/nvidia-container-devices/{id}"),
            &["rbind", "rprivate", "rw"],
        );
    }

    #[test]
    fn only_what_a_pod_cannot_write_is_an_allocation() {
        // A pod allocated no GPU names another tenant's in its own env, or with an
        // emptyDir where the device plugin's volume mounts go: on a node of the documented
        // defaults, neither is an allocation.
        let mut env_only = cri();
        push_env(&mut env_only, &[&format!("NVIDIA_VISIBLE_DEVICES={GPU2}")]);
        let mut volume_only = cri();
        push_pod_volume(&mut volume_only, GPU2);
        for v in [&env_only, &volume_only] {
            assert!(run_default(v, Some(DefaultDevice::Allocated))
                .result
                .expect("passes through")
                .is_none());
            let mut asked = v.clone();
            annotate(&mut asked, "gpushare.io/device", ALLOCATED);
            let msg = refusal(&run_default(&asked, None));
            assert!(msg.contains("found no devices allocated to the container: no cdi.k8s.io/* annotation names an NVIDIA GPU, no mount from /dev/null is under /var/run/nvidia-container-devices/, and linux.devices holds no /dev/nvidia<N> (not read in a privileged container); NVIDIA_VISIBLE_DEVICES is not read on this node (accept-visible-devices-env = false)"), "{msg}");
        }
        // A volume that is not /dev/null is no allocation on a node that reads the env too.
        assert!(run(&volume_only, Some(DefaultDevice::Allocated))
            .result
            .expect("passes through")
            .is_none());

        // A pod allocated GPU 0 (/dev/nvidia2) by CDI, plus the emptyDir naming GPU 2, plus
        // the env naming GPU 2: served GPU 0 alone.
        let mut v = cri();
        push_cdi_gpu(&mut v, 2);
        push_pod_volume(&mut v, GPU2);
        push_env(&mut v, &[&format!("NVIDIA_VISIBLE_DEVICES={GPU2}")]);
        let p = run_default(&v, Some(DefaultDevice::Allocated));
        let a = allocation_of(&p);
        assert_eq!(
            (a.first.source, a.others.len()),
            (AllocationSource::DeviceNodes, 0)
        );
        assert_eq!(resolved(&p), (vec![GPU0.to_owned()], DeviceKind::Gpus));

        // The device plugin's /dev/null mounts still count, beside a pod's emptyDir.
        let mut v = cri();
        push_mount(
            &mut v,
            "/dev/null",
            &format!("/var/run/nvidia-container-devices/{GPU0}"),
            &["ro", "bind"],
        );
        push_pod_volume(&mut v, GPU2);
        let p = run_default(&v, Some(DefaultDevice::Allocated));
        assert_eq!(found(&p).found, GPU0);
        assert_eq!(resolved(&p).0, vec![GPU0]);

        // The image's own all is never one, wherever the env is read.
        let mut v = cri();
        push_env(&mut v, &[IMAGE_ALL]);
        for p in [
            run(&v, Some(DefaultDevice::Allocated)),
            run_default(&v, Some(DefaultDevice::Allocated)),
        ] {
            assert!(p.result.expect("passes through").is_none());
        }
    }

    #[test]
    fn sources_that_disagree_are_refused_never_merged() {
        let tail = "and gpushare never merges them; allowed is an allocation whose sources all name the same devices";
        // Allocated GPU 0 by DRA-style device nodes, GPU 2 in the pod's env, on a node that
        // reads the env: refused, naming both (the env would have moved it to GPU 2).
        let mut v = cri();
        push_cdi_gpu(&mut v, 2);
        push_env(&mut v, &[&format!("NVIDIA_VISIBLE_DEVICES={GPU2}")]);
        let p = run(&v, Some(DefaultDevice::Allocated));
        assert_eq!(
            resolve_refusal(&p),
            format!("default-device=\"allocated\" is refused: the sources of the container's allocation disagree (linux.devices=\"/dev/nvidia2\" names {GPU0}, but NVIDIA_VISIBLE_DEVICES=\"{GPU2}\" names {GPU2}), {tail}")
        );
        // Allocated GPU 0 by CDI annotation, plus a /dev/null volume (a pod allowed hostPath
        // volumes) for GPU 2 as well: refused, never "GPU 0, GPU 2".
        let mut v = cri();
        annotate(
            &mut v,
            CDI_KEY,
            &format!("k8s.device-plugin.nvidia.com/gpu={GPU0}"),
        );
        for id in [GPU0, GPU2] {
            push_mount(
                &mut v,
                "/dev/null",
                &format!("/var/run/nvidia-container-devices/{id}"),
                &["ro", "bind"],
            );
        }
        let msg = resolve_refusal(&run_default(&v, Some(DefaultDevice::Allocated)));
        assert!(
            msg.contains(&format!("(cdi.k8s.io/*=\"{GPU0}\" names {GPU0}, but /var/run/nvidia-container-devices/*=\"{GPU0},GPU-7b2c3d4e-5f60-4182-…\" names {GPU0},{GPU2})")),
            "{msg}"
        );
        // Sources that name the same devices, spelled differently (an index, a UUID, a
        // device node), agree; the order is the first source's.
        let mut v = cri();
        annotate(
            &mut v,
            CDI_KEY,
            "k8s.device-plugin.nvidia.com/gpu=2,k8s.device-plugin.nvidia.com/gpu=0",
        );
        push_cdi_gpu(&mut v, 2);
        push_cdi_gpu(&mut v, 1);
        push_env(&mut v, &[&format!("NVIDIA_VISIBLE_DEVICES={GPU0},{GPU2}")]);
        let p = run(&v, Some(DefaultDevice::Allocated));
        let a = allocation_of(&p);
        let sources: Vec<AllocationSource> = a.sources().map(|s| s.source).collect();
        assert_eq!(
            sources,
            [
                AllocationSource::CdiAnnotations,
                AllocationSource::DeviceNodes,
                AllocationSource::Env
            ]
        );
        assert_eq!(resolved(&p).0, vec![GPU2, GPU0]);
        // A second source that does not resolve is refused as it would be alone.
        let mut v = cri();
        push_cdi_gpu(&mut v, 2);
        push_env(&mut v, &["NVIDIA_VISIBLE_DEVICES=7"]);
        assert!(resolve_refusal(&run(&v, Some(DefaultDevice::Allocated)))
            .ends_with("NVIDIA_VISIBLE_DEVICES=\"7\" names GPU 7, which does not exist: this node has GPUs 0, 1, 2"));
    }

    #[test]
    fn default_device_makes_an_allocation_a_request() {
        let mut v = cri();
        push_env(&mut v, &[IMAGE_ALL]);
        push_cdi_gpu(&mut v, 2);
        let p = run(&v, Some(DefaultDevice::Allocated));
        let req = p
            .result
            .as_ref()
            .expect("parses")
            .as_ref()
            .expect("a request");
        assert_eq!(
            (req.device.key, req.device.raw.as_str()),
            ("default-device", "allocated")
        );
        assert_eq!(resolved(&p).0, vec![GPU0]);
        // Without the default: no request, whatever the allocation.
        assert!(run(&v, None).result.expect("parses").is_none());
        // A device key still wins over the default, and the other keys are read.
        annotate(&mut v, "gpushare.io/device", "2");
        annotate(&mut v, "gpushare.io/active-thread-percentage", "30");
        let p = run(&v, Some(DefaultDevice::Allocated));
        assert_eq!(resolved(&p).0, vec![GPU2]);
        let req = p.result.expect("parses").expect("request");
        assert_eq!(
            req.settings
                .value(&crate::request::ACTIVE_THREAD_PERCENTAGE),
            Some(30)
        );
        // The env spelling, and its refusal where env requests are off.
        let mut v = cri();
        push_env(
            &mut v,
            &["NVIDIA_VISIBLE_DEVICES=0", "GPUSHARE_DEVICE=allocated"],
        );
        assert_eq!(resolved(&run(&v, None)).0, vec![GPU0]);
        let bytes = serde_json::to_vec(&v).expect("json");
        let spec = SpecFile::from_bytes(Path::new("c"), &bytes).expect("spec");
        let off = Options {
            accept_env: false,
            default_device: Some(DefaultDevice::Allocated),
            accept_visible_devices_env: true,
        };
        let err = parse(&spec.request_inputs(), &off)
            .expect_err("env off")
            .to_string();
        assert!(
            err.starts_with("GPUSHARE_DEVICE=\"allocated\" is refused: env requests are disabled"),
            "{err}"
        );
    }

    #[test]
    fn sandboxes_are_never_a_request() {
        // The pod annotations containerd (pod_annotations) and CRI-O copy into the pause
        // container's spec, a bad value among them, and an allocation too.
        let markers = [
            ("io.kubernetes.cri.container-type", "sandbox"),
            ("io.kubernetes.cri-o.ContainerType", "sandbox"),
            ("io.kubernetes.docker.type", "podsandbox"),
        ];
        for (key, value) in markers {
            for name in [
                "containerd-1.6-config.json",
                "podman-4.3-config.json",
                "docker-20.10-config.json",
            ] {
                let mut v = fixture(name);
                annotate(&mut v, "gpushare.io/device", "allocated");
                annotate(&mut v, "gpushare.io/pinned-memory-limit", "bogus");
                push_env(
                    &mut v,
                    &["GPUSHARE_IPC=nonsense", "NVIDIA_VISIBLE_DEVICES=1"],
                );
                annotate(&mut v, key, value);
                for default_device in [None, Some(DefaultDevice::Allocated)] {
                    assert!(
                        run(&v, default_device).result.expect("no error").is_none(),
                        "{name} {key}"
                    );
                }
                // Env requests refused on the node: still nothing, not an error.
                let bytes = serde_json::to_vec(&v).expect("json");
                let spec = SpecFile::from_bytes(Path::new("s"), &bytes).expect("spec");
                let off = Options {
                    accept_env: false,
                    default_device: None,
                    accept_visible_devices_env: true,
                };
                assert!(parse(&spec.request_inputs(), &off)
                    .expect("no error")
                    .is_none());
            }
        }
        // The workload container of the same pod: the request, and its bad value reported.
        for (key, value) in [
            ("io.kubernetes.cri.container-type", "container"),
            ("io.kubernetes.cri-o.ContainerType", "container"),
            ("io.kubernetes.docker.type", "container"),
            ("io.kubernetes.cri.container-type", "Sandbox"),
        ] {
            let mut v = cri();
            annotate(&mut v, key, value);
            annotate(&mut v, "gpushare.io/device", "1");
            annotate(&mut v, "gpushare.io/pinned-memory-limit", "bogus");
            let msg = refusal(&run(&v, None));
            assert!(
                msg.starts_with("gpushare.io/pinned-memory-limit=\"bogus\" is invalid"),
                "{msg}"
            );
        }
    }

    #[test]
    fn every_source_spells_nvidia() {
        // What the fast path relies on: a spec holding an allocation spells "nvidia".
        let mut shapes = Vec::new();
        let mut v = cri();
        push_env(&mut v, &["NVIDIA_VISIBLE_DEVICES=1"]);
        shapes.push(v);
        let mut v = cri();
        push_mount(
            &mut v,
            "/dev/null",
            &format!("/var/run/nvidia-container-devices/{GPU1}"),
            &["bind"],
        );
        shapes.push(v);
        let mut v = cri();
        annotate(&mut v, CDI_KEY, "nvidia.com/gpu=1");
        shapes.push(v);
        let mut v = cri();
        push_node(&mut v, "/dev/nvidia1", 195, 1);
        shapes.push(v);
        for v in shapes {
            let p = run(&v, Some(DefaultDevice::Allocated));
            assert!(p.result.as_ref().expect("parses").is_some());
            assert!(RawSpec::from(&p).may_hold_allocation());
            assert!(
                !RawSpec::from(&p).may_request(),
                "no gpushare in these bytes"
            );
        }
    }

    impl From<&Parsed> for RawSpec {
        fn from(p: &Parsed) -> RawSpec {
            RawSpec {
                path: "config.json".into(),
                mode: 0o644,
                bytes: p.bytes.clone(),
            }
        }
    }
}
