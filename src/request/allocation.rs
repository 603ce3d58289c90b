//! `allocated`: the devices a container was allocated, read from what NVIDIA's device plugin
//! or DRA driver wrote into its spec (k8s-facts.md §1.2, §1.3, §1.6, §2, §6.2).
//!
//! Invariants:
//! - Plain data in, plain data out, no I/O: [`allocation`] reads the spec's annotations, env,
//!   mounts and device nodes; device nodes become GPUs only against the inventory
//!   ([`Allocation::resolve`], by minor number).
//! - The sources are read in this order, and the first that names any device is the
//!   allocation (the others are not read). 1–3 are NVIDIA's toolkit's own precedence
//!   (`VisibleDevices()`); device nodes come last because they name GPUs only, never a MIG
//!   device:
//!   1. `cdi.k8s.io/*` annotations (device plugin `cdi-annotations`; the key's suffix is
//!      random): every entry `k8s.device-plugin.nvidia.com/gpu=<id>` or `nvidia.com/gpu=<id>`
//!      of their comma-separated values, keys in sorted order. Other vendors and classes
//!      (a DRA claim, `…/gdrcopy=all`, IMEX channels) and the CDI `all` device are not read.
//!   2. mounts at `/var/run/nvidia-container-devices/<id>` (`volume-mounts`), in mount
//!      order; deeper paths (`imex/<channel>`, `cdi/…`) are not devices.
//!   3. `NVIDIA_VISIBLE_DEVICES` (`envvar`), the last entry of the name, comma-separated.
//!   4. `/dev/nvidia<N>` nodes in `linux.devices` (`cdi-cri`, the DRA driver): the GPUs with
//!      minor number N, in spec order. Not read in a privileged container (one whose
//!      `linux.resources.devices` allows every device), which holds every node of the host.
//! - An id is what the device plugin writes: `GPU-<uuid>`, `MIG-<uuid>`, an index `0` or
//!   `<gpu>:<mig>` (its replicas' `::<n>` suffix is stripped before the spec). The ids then
//!   meet the rules of named devices, so a list of MIG devices is refused.
//! - Not an allocation: `NVIDIA_VISIBLE_DEVICES` that is empty, `void`, `none`, `all`, or a
//!   list holding one of them (the toolkit reads such a list as that word), or the
//!   volume-mounts marker `/var/run/nvidia-container-devices` itself. `all` is the one
//!   ambiguous value: CUDA base images set `NVIDIA_VISIBLE_DEVICES=all` in their own env,
//!   which stays in the spec whenever the device plugin uses CDI strategies only; and the
//!   device plugin never writes `all` (it writes the ids it allocated), nor does the DRA
//!   driver (it writes no `NVIDIA_VISIBLE_DEVICES`). So `all` never counts, whoever set it,
//!   and a value naming devices always does: an image that bakes in specific ids is read as
//!   allocated those.
//! - MIG devices are read from names only. A MIG device injected by CDI (`cdi-cri`, DRA) is
//!   its parent's `/dev/nvidia<N>` plus `/dev/nvidia-caps/nvidia-cap<M>` nodes for its GPU and
//!   compute instances; nothing gpushare reads maps a cap number to a MIG device, and the
//!   parent GPU is in MIG mode, where CUDA cannot run, so such an allocation is refused
//!   rather than resolved to the parent.
//! - Old MIG UUIDs `MIG-GPU-<uuid>/<gi>/<ci>` (drivers before R470) are refused: the
//!   inventory knows MIG devices by `MIG-<uuid>` only.
//! - An allocation that carries its allocator's MPS — `CUDA_MPS_PIPE_DIRECTORY=<dir>` in the
//!   env and a mount at `<dir>`, as the device plugin's `sharing.mps` and the DRA driver's
//!   MPS both add — is refused: gpushare never stacks a second MPS on it.
//! - Every source spells `nvidia` (`NVIDIA_VISIBLE_DEVICES`, `nvidia-container-devices`,
//!   `/dev/nvidia`, the two CDI vendors): a spec whose bytes cannot spell it holds no
//!   allocation (`RawSpec::may_hold_allocation` relies on this).

use std::fmt;
use std::path::Path;

use super::{
    env_lookup, parse_index, parse_selector, quote, DeviceError, DeviceRequest, Inputs, Inventory,
    RequestError, ResolvedDevices, MAX_DEVICES,
};

/// What [`RequestError::NoAllocation`] says was looked at.
pub(super) const LOOKED_AT: &str = "no cdi.k8s.io/* annotation names an NVIDIA GPU, no mount is under /var/run/nvidia-container-devices/, NVIDIA_VISIBLE_DEVICES names no device (all, none, void and empty are no allocation), and linux.devices holds no /dev/nvidia<N> (not read in a privileged container)";

const VOLUME_DIR: &str = "/var/run/nvidia-container-devices";
const CDI_PREFIX: &str = "cdi.k8s.io/";
/// The CDI kinds whose devices are NVIDIA GPUs named by device-plugin ids: the device
/// plugin's, and the toolkit's own (`nvidia-ctk cdi generate`, Docker's `--gpus`).
const CDI_KINDS: [&str; 2] = ["k8s.device-plugin.nvidia.com/gpu", "nvidia.com/gpu"];
const VISIBLE_DEVICES: &str = "NVIDIA_VISIBLE_DEVICES";
const PIPE_ENV: &str = "CUDA_MPS_PIPE_DIRECTORY";

const IDS_ALLOWED: &str = "device ids as NVIDIA's device plugin writes them: GPU-<uuid>, MIG-<uuid>, a GPU index like 0 or <gpu>:<mig> like 0:1, comma-separated, at most 16";
const OLD_MIG_ALLOWED: &str = "MIG-<uuid>, the MIG device names of NVIDIA drivers R470 and later";
const NODES_ALLOWED: &str = "device nodes as CDI injects them: /dev/nvidia<N> with minor number N";
const MIG_NODES_ALLOWED: &str = "an allocation that names its MIG device (cdi.k8s.io/* annotations, which containerd passes with container_annotations = [\"cdi.k8s.io/*\"]; NVIDIA_VISIBLE_DEVICES; volume mounts), or gpushare.io/device=MIG-<uuid>";

/// Where an allocation was read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AllocationSource {
    CdiAnnotations,
    VolumeMounts,
    Env,
    DeviceNodes,
}

impl AllocationSource {
    /// How errors name it, in place of a request key.
    pub fn key(self) -> &'static str {
        match self {
            Self::CdiAnnotations => "cdi.k8s.io/*",
            Self::VolumeMounts => "/var/run/nvidia-container-devices/*",
            Self::Env => VISIBLE_DEVICES,
            Self::DeviceNodes => "linux.devices",
        }
    }
}

impl fmt::Display for AllocationSource {
    /// The device plugin's strategy names, for logs.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::CdiAnnotations => "cdi-annotations",
            Self::VolumeMounts => "volume-mounts",
            Self::Env => "envvar",
            Self::DeviceNodes => "device-nodes",
        })
    }
}

/// The devices of an allocation, as the spec gives them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AllocatedDevices {
    /// By device-plugin id.
    Named(DeviceRequest),
    /// By the minor number of `/dev/nvidia<N>`, deduplicated, in spec order.
    Minors(Vec<u32>),
}

/// What [`allocation`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allocation {
    pub source: AllocationSource,
    /// What the source says, for errors: the ids joined by `,` (for device nodes, their paths).
    pub found: String,
    pub devices: AllocatedDevices,
}

impl Allocation {
    /// The devices against the inventory, under the rules of named devices; errors name the
    /// source and what it said.
    pub fn resolve(&self, inventory: &Inventory) -> Result<ResolvedDevices, DeviceError> {
        let key = self.source.key();
        match &self.devices {
            AllocatedDevices::Named(req) => inventory.resolve(key, &self.found, req),
            AllocatedDevices::Minors(minors) => inventory.resolve(
                key,
                &self.found,
                &inventory.gpus_by_minor(key, &self.found, minors)?,
            ),
        }
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
/// the request's (`gpushare.io/device=allocated`, `default-device`), for errors.
pub fn allocation(
    c: &Inputs<'_>,
    key: &'static str,
    value: &str,
) -> Result<Option<Allocation>, RequestError> {
    let found = from_cdi_annotations(c)
        .transpose()
        .or_else(|| from_volume_mounts(c).transpose())
        .or_else(|| from_env(c).transpose())
        .or_else(|| from_device_nodes(c).transpose())
        .transpose()
        .map_err(|u| RequestError::AllocationUnreadable {
            key,
            value: value.to_owned(),
            source_key: u.source.key(),
            found: u.found,
            problem: u.problem,
            allowed: u.allowed,
        })?;
    if found.is_some() {
        if let Some(pipe) = env_lookup(c.env, PIPE_ENV).filter(|p| !p.is_empty()) {
            if let Some(mount) = c.mounts.iter().find(|m| m.destination() == Path::new(pipe)) {
                return Err(RequestError::AllocatorMps {
                    key,
                    value: value.to_owned(),
                    pipe: pipe.to_owned(),
                    mount_source: mount
                        .source()
                        .as_deref()
                        .map(|s| s.display().to_string())
                        .unwrap_or_default(),
                });
            }
        }
    }
    Ok(found)
}

/// Device-plugin ids → named devices; `found` is what errors show.
fn named(source: AllocationSource, found: String, ids: &[&str]) -> Result<Allocation, Unreadable> {
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
    Ok(Allocation {
        source,
        found,
        devices: AllocatedDevices::Named(DeviceRequest(selectors)),
    })
}

fn from_cdi_annotations(c: &Inputs<'_>) -> Result<Option<Allocation>, Unreadable> {
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

fn from_volume_mounts(c: &Inputs<'_>) -> Result<Option<Allocation>, Unreadable> {
    let ids: Vec<&str> = c
        .mounts
        .iter()
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

fn from_env(c: &Inputs<'_>) -> Result<Option<Allocation>, Unreadable> {
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

fn from_device_nodes(c: &Inputs<'_>) -> Result<Option<Allocation>, Unreadable> {
    if c.all_devices_allowed {
        return Ok(None);
    }
    let mut minors = Vec::new();
    let mut paths = Vec::new();
    let mut cap = None;
    for node in c.devices {
        let Some(path) = node.path().to_str() else {
            continue;
        };
        if path.starts_with("/dev/nvidia-caps/") {
            cap.get_or_insert(path);
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
    let found = paths.join(",");
    if let Some(cap) = cap {
        return Err(Unreadable {
            source: AllocationSource::DeviceNodes,
            found,
            problem: format!(
                "comes with {cap}, a MIG device's capability node, and gpushare cannot tell which MIG device it is"
            ),
            allowed: MIG_NODES_ALLOWED,
        });
    }
    Ok(Some(Allocation {
        source: AllocationSource::DeviceNodes,
        found,
        devices: AllocatedDevices::Minors(minors),
    }))
}
