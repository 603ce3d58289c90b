//! The GPU inventory: which GPUs and MIG devices this node has, read from NVML or from a JSON
//! file (DESIGN.md §6), and the resolution of a device request against it.
//!
//! Invariants:
//! - Everything here is plain data. Nothing edits a spec or talks to MPS; the only I/O is
//!   [`load`] (one file read, or NVML queries).
//! - An [`Inventory`] returned by [`load`] has passed [`Inventory::validate`]: at most
//!   [`MAX_GPUS`] GPUs, unique GPU indices, unique MIG indices per GPU, unique and well-formed
//!   `GPU-`/`MIG-` UUIDs, non-zero memory, a `major.minor` compute capability and MIG profile
//!   names that are safe to put in identifiers.
//! - [`Inventory::resolve`] never guesses: a request names exactly the devices it gets, in the
//!   order it names them, or the resolution fails with one line naming the request key, its
//!   value and what exists on this node.
//! - The device selectors ([`DeviceSelector`], [`DeviceRequest`]) live here, not in `request`,
//!   so that dependencies flow one way (`request` → `device`); `request` re-exports them and
//!   owns their parsing and validation.
//! - A GPU's `minor` is the minor number of its device node `/dev/nvidia<minor>` (NVML's
//!   `nvmlDeviceGetMinorNumber`). It is optional, so that inventory files written before it
//!   existed stay valid; when given, it is unique among the GPUs. Only a request for the
//!   devices a container was allocated through CDI-injected device nodes needs it
//!   ([`Inventory::gpus_by_minor`]): without it such a request is refused, nothing else is.

use std::fmt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The most GPUs an inventory may hold.
pub const MAX_GPUS: usize = 64;

/// Longest MIG profile name accepted (`1g.10gb+me` is 10).
const MAX_PROFILE_LEN: usize = 64;

/// Profile name used when NVML cannot tell a MIG device's profile.
pub const UNKNOWN_MIG_PROFILE: &str = "mig";

/// Longest value shown in an error message before it is cut with `…`.
const QUOTE_MAX_CHARS: usize = 64;

/// Longest list of existing devices shown in an error message before `and N more`.
const LIST_MAX_ITEMS: usize = 8;

/// The GPUs (and their MIG devices) of this node.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Inventory {
    pub driver_version: String,
    pub gpus: Vec<Gpu>,
}

/// One physical GPU.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Gpu {
    /// NVML enumeration index, the one `nvidia-smi` and `CUDA_VISIBLE_DEVICES` use.
    pub index: u32,
    pub uuid: String,
    pub name: String,
    pub memory_bytes: u64,
    /// CUDA compute capability, `"major.minor"`.
    pub compute_capability: String,
    pub compute_mode: ComputeMode,
    /// Minor number of the GPU's device node `/dev/nvidia<minor>`; `None` in inventory files
    /// that do not give it (then device nodes cannot be mapped to this GPU).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub minor: Option<u32>,
    /// Empty when MIG is disabled (or enabled with no instance created).
    #[serde(default)]
    pub mig_devices: Vec<MigDevice>,
}

/// One MIG device (a GPU instance + compute instance) of a GPU.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct MigDevice {
    /// NVML MIG device index on its parent GPU: the `1` of `0:1`.
    pub index: u32,
    pub uuid: String,
    /// Profile name such as `1g.6gb`, or [`UNKNOWN_MIG_PROFILE`].
    pub profile: String,
    pub memory_bytes: u64,
    /// Minor number of `/dev/nvidia-caps/nvidia-cap<minor>`, the access node of this MIG
    /// device's GPU instance (`gpu<minor>/gi<id>/access` in
    /// `/proc/driver/nvidia-caps/mig-minors`); shared by the MIG devices of one GPU
    /// instance. `None` where unknown (then the device cannot be found by its nodes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gi_caps_minor: Option<u32>,
    /// Minor number of the access node of this MIG device's compute instance
    /// (`gpu<minor>/gi<id>/ci<id>/access`): one MIG device's own. `None` where unknown.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ci_caps_minor: Option<u32>,
}

/// NVML compute mode. NVML's removed `EXCLUSIVE_THREAD` is reported as `ExclusiveProcess`, the
/// closest mode that still exists (both allow a single context owner, e.g. an MPS server).
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum ComputeMode {
    Default,
    ExclusiveProcess,
    Prohibited,
}

/// Where the inventory comes from: the `inventory` config key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InventorySource {
    Nvml,
    File(PathBuf),
}

impl InventorySource {
    /// Parses `nvml` or `file:<absolute path>`.
    pub fn parse(s: &str) -> Result<Self, DeviceError> {
        if s == "nvml" {
            return Ok(Self::Nvml);
        }
        if let Some(path) = s.strip_prefix("file:") {
            let path = Path::new(path);
            if path.is_absolute() && !s.chars().any(char::is_control) {
                return Ok(Self::File(path.to_path_buf()));
            }
        }
        Err(DeviceError::InvalidSource {
            value: s.to_owned(),
        })
    }
}

impl fmt::Display for InventorySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Nvml => f.write_str("nvml"),
            Self::File(path) => write!(f, "file:{}", path.display()),
        }
    }
}

/// One entry of a device request, as the user wrote it (syntax checked by `request`).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq, Hash)]
#[serde(rename_all = "snake_case")]
pub enum DeviceSelector {
    /// `0`: the GPU with this index.
    Index(u32),
    /// `GPU-<uuid>`: the GPU with this UUID (full UUID, hex matched case-insensitively).
    GpuUuid(String),
    /// `MIG-<uuid>`: the MIG device with this UUID.
    MigUuid(String),
    /// `0:1`: MIG device `mig` of GPU `gpu`.
    MigIndex { gpu: u32, mig: u32 },
}

impl DeviceSelector {
    /// Whether this names a MIG device (which must stand alone in a request).
    pub fn is_mig(&self) -> bool {
        matches!(self, Self::MigUuid(_) | Self::MigIndex { .. })
    }
}

impl fmt::Display for DeviceSelector {
    /// The request syntax: `0`, `GPU-…`, `MIG-…`, `0:1`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Index(i) => write!(f, "{i}"),
            Self::GpuUuid(u) | Self::MigUuid(u) => f.write_str(u),
            Self::MigIndex { gpu, mig } => write!(f, "{gpu}:{mig}"),
        }
    }
}

/// A device request: one MIG device, or one or more full GPUs.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq, Hash)]
pub struct DeviceRequest(pub Vec<DeviceSelector>);

impl fmt::Display for DeviceRequest {
    /// The request syntax, entries joined by `,`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, sel) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{sel}")?;
        }
        Ok(())
    }
}

/// Whether a resolved request is a set of full GPUs or one MIG device.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    Gpus,
    Mig,
}

/// The devices a request resolved to.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct ResolvedDevices {
    pub kind: DeviceKind,
    /// Full UUIDs as the inventory spells them, in request order.
    pub uuids: Vec<String>,
    /// Parent GPU index of each entry of `uuids`.
    pub gpu_indices: Vec<u32>,
    /// Memory of the smallest device of the set (for MIG: the MIG device's own memory).
    pub memory_bytes: u64,
    /// The MIG profile, for kind `Mig` only.
    pub mig_profile: Option<String>,
}

/// Errors of inventory loading, validation and request resolution.
///
/// Resolution errors carry `key` (the annotation or env name the request came from) and
/// `value` (the raw request), so that each is the one line a user needs.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("inventory={} is invalid: allowed is nvml or file:<absolute path>", quote(.value))]
    InvalidSource { value: String },

    #[error("cannot read inventory file {}", .path.display())]
    ReadFile {
        path: PathBuf,
        #[source]
        error: std::io::Error,
    },

    #[error("cannot parse inventory file {}", .path.display())]
    ParseFile {
        path: PathBuf,
        #[source]
        error: serde_json::Error,
    },

    #[error("inventory {origin}: {entry} has {field} {}, which is invalid: allowed is {allowed}", quote(.value))]
    InvalidEntry {
        origin: String,
        entry: String,
        field: &'static str,
        value: String,
        allowed: &'static str,
    },

    #[error("inventory {origin}: {entry} repeats {field} {}: allowed is each {field} once", quote(.value))]
    DuplicateEntry {
        origin: String,
        entry: String,
        field: &'static str,
        value: String,
    },

    #[error("inventory {origin} lists {count} GPUs: allowed is at most {MAX_GPUS}")]
    TooManyGpus { origin: String, count: usize },

    // The NVML error is shown, not chained: its Display already carries its own source
    // (a library-loading error), which a chain would print a second time.
    #[error("cannot initialise NVML (is the NVIDIA driver installed and loaded?): {error}")]
    NvmlInit {
        error: nvml_wrapper::error::NvmlError,
    },

    #[error("cannot {operation} through NVML")]
    Nvml {
        operation: String,
        #[source]
        error: nvml_wrapper::error::NvmlError,
    },

    #[error("{key}={} is invalid: allowed is at least one device", quote(.value))]
    EmptyRequest { key: &'static str, value: String },

    #[error("{key}={} names GPU {index}, which does not exist: {}", quote(.value), gpu_list(.existing))]
    NoSuchGpuIndex {
        key: &'static str,
        value: String,
        index: u32,
        existing: Vec<u32>,
    },

    #[error("{key}={} names {uuid}, which does not exist: {}", quote(.value), uuid_list("GPUs", .existing))]
    NoSuchGpuUuid {
        key: &'static str,
        value: String,
        uuid: String,
        existing: Vec<String>,
    },

    #[error("{key}={} names {uuid}, which does not exist: {}", quote(.value), uuid_list("MIG devices", .existing))]
    NoSuchMigUuid {
        key: &'static str,
        value: String,
        uuid: String,
        existing: Vec<String>,
    },

    #[error("{key}={} names MIG device {mig} of GPU {gpu}, which does not exist: {}", quote(.value), mig_list(*.gpu, .existing))]
    NoSuchMigIndex {
        key: &'static str,
        value: String,
        gpu: u32,
        mig: u32,
        existing: Vec<u32>,
    },

    #[error("{key}={} names the GPU with minor number {minor} (/dev/nvidia{minor}), which does not exist: {}", quote(.value), minor_list(.existing, *.unknown))]
    NoSuchGpuMinor {
        key: &'static str,
        value: String,
        minor: u32,
        /// The minor numbers the inventory gives.
        existing: Vec<u32>,
        /// How many GPUs of the inventory give no minor number.
        unknown: usize,
    },

    #[error("{key}={} holds /dev/nvidia-caps/nvidia-cap{cap}, which is the access node of no MIG device: {}", quote(.value), cap_list(.existing, *.unknown))]
    NoSuchCapMinor {
        key: &'static str,
        value: String,
        cap: u32,
        /// The cap minors the inventory gives (GPU and compute instances).
        existing: Vec<u32>,
        /// How many MIG devices of the inventory give no cap minors.
        unknown: usize,
    },

    #[error("{key}={} holds /dev/nvidia-caps/nvidia-cap{cap}, an access node of MIG device {uuid} of GPU {gpu}, without its GPU's node {}: allowed is a MIG device's nodes as CDI injects them, its GPU's /dev/nvidia<N> with them", quote(.value), parent_node(*.minor))]
    MigWithoutParentNode {
        key: &'static str,
        value: String,
        cap: u32,
        uuid: String,
        gpu: u32,
        minor: Option<u32>,
    },

    #[error("{key}={} lists GPU {gpu} twice: allowed is each GPU at most once", quote(.value))]
    DuplicateGpu {
        key: &'static str,
        value: String,
        gpu: u32,
    },

    #[error("{key}={} is invalid: a MIG device must stand alone, not in a list", quote(.value))]
    MigInList { key: &'static str, value: String },

    /// CUDA cannot run on a GPU in MIG mode, only on its MIG devices.
    #[error("{key}={} names GPU {gpu}, which is in MIG mode: allowed is one of its MIG devices ({})", quote(.value), .migs.join(", "))]
    GpuInMigMode {
        key: &'static str,
        value: String,
        gpu: u32,
        migs: Vec<String>,
    },
}

/// Quotes a user-supplied value for a one-line message: in double quotes, with NUL, newlines,
/// other control characters, `"` and `\` escaped as in Rust (`\0`, `\n`, `\u{1b}`), and cut
/// with `…` after 64 characters.
pub fn quote(raw: &str) -> String {
    let mut out = String::from("\"");
    let mut chars = raw.chars();
    for c in chars.by_ref().take(QUOTE_MAX_CHARS) {
        out.extend(c.escape_debug());
    }
    if chars.next().is_some() {
        out.push('…');
    }
    out.push('"');
    out
}

fn gpu_list(existing: &[u32]) -> String {
    if existing.is_empty() {
        "this node has no GPUs".to_owned()
    } else {
        format!("this node has GPUs {}", join_capped(existing))
    }
}

fn uuid_list(what: &str, existing: &[String]) -> String {
    if existing.is_empty() {
        format!("this node has no {what}")
    } else {
        format!("this node has {what} {}", join_capped(existing))
    }
}

fn minor_list(existing: &[u32], unknown: usize) -> String {
    match (existing.is_empty(), unknown) {
        (true, 0) => "this node has no GPUs".to_owned(),
        (true, _) => "this node's inventory gives no minor numbers (an inventory file needs \"minor\" on each GPU)".to_owned(),
        (false, 0) => format!("this node's GPUs have minor numbers {}", join_capped(existing)),
        (false, n) => format!(
            "this node's GPUs have minor numbers {}, and {n} give none (an inventory file needs \"minor\" on each GPU)",
            join_capped(existing)
        ),
    }
}

fn cap_list(existing: &[u32], unknown: usize) -> String {
    const NEEDS: &str =
        "an inventory file needs \"gi_caps_minor\" and \"ci_caps_minor\" on each MIG device";
    match (existing.is_empty(), unknown) {
        (true, 0) => "this node has no MIG devices".to_owned(),
        (true, _) => {
            format!("this node's inventory gives no cap minors for its MIG devices ({NEEDS})")
        }
        (false, 0) => format!(
            "this node's MIG devices have cap minors {}",
            join_capped(existing)
        ),
        (false, n) => format!(
            "this node's MIG devices have cap minors {}, and {n} give none ({NEEDS})",
            join_capped(existing)
        ),
    }
}

fn parent_node(minor: Option<u32>) -> String {
    match minor {
        Some(minor) => format!("/dev/nvidia{minor}"),
        None => "(the inventory gives that GPU no minor number)".to_owned(),
    }
}

fn mig_list(gpu: u32, existing: &[u32]) -> String {
    if existing.is_empty() {
        format!("GPU {gpu} has no MIG devices (MIG is not enabled or no instance is created)")
    } else {
        format!("GPU {gpu} has MIG devices {}", join_capped(existing))
    }
}

fn join_capped<T: fmt::Display>(items: &[T]) -> String {
    let mut out = items
        .iter()
        .take(LIST_MAX_ITEMS)
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ");
    if items.len() > LIST_MAX_ITEMS {
        out.push_str(&format!(" and {} more", items.len() - LIST_MAX_ITEMS));
    }
    out
}

/// Whether `s` is `prefix` (`GPU-` or `MIG-`) followed by hex digits and single dashes, starting
/// and ending with a hex digit, at most 64 characters after the prefix. NVML prints the usual
/// 8-4-4-4-12 form; the looser rule keeps us working if a driver ever prints another grouping.
pub fn is_well_formed_uuid(s: &str, prefix: &str) -> bool {
    let Some(rest) = s.strip_prefix(prefix) else {
        return false;
    };
    let bytes = rest.as_bytes();
    match (bytes.first(), bytes.last()) {
        (Some(first), Some(last)) => {
            bytes.len() <= 64
                && first.is_ascii_hexdigit()
                && last.is_ascii_hexdigit()
                && bytes.iter().all(|b| b.is_ascii_hexdigit() || *b == b'-')
                && !rest.contains("--")
        }
        _ => false,
    }
}

fn is_compute_capability(s: &str) -> bool {
    let digits = |p: &str| !p.is_empty() && p.len() <= 3 && p.bytes().all(|b| b.is_ascii_digit());
    matches!(s.split_once('.'), Some((major, minor)) if digits(major) && digits(minor))
}

fn is_safe_profile(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_PROFILE_LEN
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'+' | b'-' | b'_'))
}

/// Loads and validates the inventory.
pub fn load(source: &InventorySource) -> Result<Inventory, DeviceError> {
    let inventory = match source {
        InventorySource::Nvml => nvml::load()?,
        InventorySource::File(path) => {
            let text = std::fs::read_to_string(path).map_err(|error| DeviceError::ReadFile {
                path: path.clone(),
                error,
            })?;
            serde_json::from_str(&text).map_err(|error| DeviceError::ParseFile {
                path: path.clone(),
                error,
            })?
        }
    };
    inventory.validate(&source.to_string())?;
    Ok(inventory)
}

impl Inventory {
    /// Checks the invariants listed in the module doc. `origin` names the inventory in errors
    /// (`nvml`, `file:/etc/…`).
    pub fn validate(&self, origin: &str) -> Result<(), DeviceError> {
        if self.gpus.len() > MAX_GPUS {
            return Err(DeviceError::TooManyGpus {
                origin: origin.to_owned(),
                count: self.gpus.len(),
            });
        }
        let invalid = |entry: String, field, value: &str, allowed| DeviceError::InvalidEntry {
            origin: origin.to_owned(),
            entry,
            field,
            value: value.to_owned(),
            allowed,
        };
        let duplicate = |entry: String, field, value: String| DeviceError::DuplicateEntry {
            origin: origin.to_owned(),
            entry,
            field,
            value,
        };
        let mut gpu_indices = Vec::new();
        let mut minors = Vec::new();
        let mut ci_caps: Vec<u32> = Vec::new();
        // (position of the GPU, minor)
        let mut gi_caps: Vec<(usize, u32)> = Vec::new();
        let mut uuids: Vec<String> = Vec::new();
        let mut check_uuid = |entry: &str, uuid: &str| {
            let lower = uuid.to_ascii_lowercase();
            if uuids.contains(&lower) {
                return Err(duplicate(entry.to_owned(), "uuid", uuid.to_owned()));
            }
            uuids.push(lower);
            Ok(())
        };
        for (pos, gpu) in self.gpus.iter().enumerate() {
            let entry = format!("gpus[{pos}] (GPU {})", gpu.index);
            if gpu_indices.contains(&gpu.index) {
                return Err(duplicate(entry, "index", gpu.index.to_string()));
            }
            gpu_indices.push(gpu.index);
            if let Some(minor) = gpu.minor {
                if minors.contains(&minor) {
                    return Err(duplicate(entry, "minor", minor.to_string()));
                }
                minors.push(minor);
            }
            if !is_well_formed_uuid(&gpu.uuid, "GPU-") {
                return Err(invalid(
                    entry,
                    "uuid",
                    &gpu.uuid,
                    "GPU- followed by hex digits and dashes",
                ));
            }
            check_uuid(&entry, &gpu.uuid)?;
            if gpu.memory_bytes == 0 {
                return Err(invalid(entry, "memory_bytes", "0", "more than 0 bytes"));
            }
            if !is_compute_capability(&gpu.compute_capability) {
                return Err(invalid(
                    entry,
                    "compute_capability",
                    &gpu.compute_capability,
                    "major.minor, like 8.0",
                ));
            }
            let mut mig_indices = Vec::new();
            for (mpos, mig) in gpu.mig_devices.iter().enumerate() {
                let here = format!(
                    "gpus[{pos}].mig_devices[{mpos}] (GPU {} MIG device {})",
                    gpu.index, mig.index
                );
                // A compute instance's node is one MIG device's; a GPU instance's node is
                // shared only by the MIG devices of that instance, so of one GPU; no node is
                // both.
                if let Some(ci) = mig.ci_caps_minor {
                    if ci_caps.contains(&ci) {
                        return Err(duplicate(here, "ci_caps_minor", ci.to_string()));
                    }
                    if gi_caps.iter().any(|&(_, gi)| gi == ci) {
                        return Err(invalid(
                            here,
                            "ci_caps_minor",
                            &ci.to_string(),
                            "a minor that no gi_caps_minor uses",
                        ));
                    }
                    ci_caps.push(ci);
                }
                if let Some(gi) = mig.gi_caps_minor {
                    if ci_caps.contains(&gi)
                        || gi_caps.iter().any(|&(g, other)| other == gi && g != pos)
                    {
                        return Err(invalid(
                            here,
                            "gi_caps_minor",
                            &gi.to_string(),
                            "a minor that no ci_caps_minor and no other GPU's MIG device uses",
                        ));
                    }
                    gi_caps.push((pos, gi));
                }
                let entry = format!(
                    "gpus[{pos}].mig_devices[{mpos}] (GPU {} MIG device {})",
                    gpu.index, mig.index
                );
                if mig_indices.contains(&mig.index) {
                    return Err(duplicate(entry, "index", mig.index.to_string()));
                }
                mig_indices.push(mig.index);
                if !is_well_formed_uuid(&mig.uuid, "MIG-") {
                    return Err(invalid(
                        entry,
                        "uuid",
                        &mig.uuid,
                        "MIG- followed by hex digits and dashes",
                    ));
                }
                check_uuid(&entry, &mig.uuid)?;
                if mig.memory_bytes == 0 {
                    return Err(invalid(entry, "memory_bytes", "0", "more than 0 bytes"));
                }
                if !is_safe_profile(&mig.profile) {
                    return Err(invalid(
                        entry,
                        "profile",
                        &mig.profile,
                        "letters, digits, '.', '+', '-' and '_', like 1g.6gb",
                    ));
                }
            }
        }
        Ok(())
    }

    /// Resolves a device request. `key` and `value` are the annotation/env name and the raw
    /// text the request was parsed from; they only appear in errors.
    ///
    /// Rules: an empty request is refused; a MIG selector must be the only entry; every GPU
    /// may appear once (whether named by index or UUID). The GPU request's memory is that of
    /// its smallest GPU.
    pub fn resolve(
        &self,
        key: &'static str,
        value: &str,
        req: &DeviceRequest,
    ) -> Result<ResolvedDevices, DeviceError> {
        let selectors = &req.0;
        if selectors.is_empty() {
            return Err(DeviceError::EmptyRequest {
                key,
                value: value.to_owned(),
            });
        }
        if selectors.len() > 1 && selectors.iter().any(DeviceSelector::is_mig) {
            return Err(DeviceError::MigInList {
                key,
                value: value.to_owned(),
            });
        }
        if let [sel] = selectors.as_slice() {
            if sel.is_mig() {
                let (gpu, mig) = self.find_mig(key, value, sel)?;
                return Ok(ResolvedDevices {
                    kind: DeviceKind::Mig,
                    uuids: vec![mig.uuid.clone()],
                    gpu_indices: vec![gpu.index],
                    memory_bytes: mig.memory_bytes,
                    mig_profile: Some(mig.profile.clone()),
                });
            }
        }
        let mut uuids = Vec::with_capacity(selectors.len());
        let mut gpu_indices: Vec<u32> = Vec::with_capacity(selectors.len());
        let mut memory_bytes = u64::MAX;
        for sel in selectors {
            let gpu = self.find_gpu(key, value, sel)?;
            if gpu_indices.contains(&gpu.index) {
                return Err(DeviceError::DuplicateGpu {
                    key,
                    value: value.to_owned(),
                    gpu: gpu.index,
                });
            }
            if !gpu.mig_devices.is_empty() {
                return Err(DeviceError::GpuInMigMode {
                    key,
                    value: value.to_owned(),
                    gpu: gpu.index,
                    migs: gpu
                        .mig_devices
                        .iter()
                        .map(|m| format!("{}:{}", gpu.index, m.index))
                        .collect(),
                });
            }
            gpu_indices.push(gpu.index);
            uuids.push(gpu.uuid.clone());
            memory_bytes = memory_bytes.min(gpu.memory_bytes);
        }
        Ok(ResolvedDevices {
            kind: DeviceKind::Gpus,
            uuids,
            gpu_indices,
            memory_bytes,
            mig_profile: None,
        })
    }

    /// The GPUs whose device nodes are `/dev/nvidia<minor>` for these minors, as a request
    /// naming them by UUID in the same order (then [`Inventory::resolve`] applies the usual
    /// rules: each GPU once, none in MIG mode). `key` and `value` only appear in errors.
    pub fn gpus_by_minor(
        &self,
        key: &'static str,
        value: &str,
        minors: &[u32],
    ) -> Result<DeviceRequest, DeviceError> {
        minors
            .iter()
            .map(|&minor| {
                self.gpus
                    .iter()
                    .find(|g| g.minor == Some(minor))
                    .map(|g| DeviceSelector::GpuUuid(g.uuid.clone()))
                    .ok_or_else(|| DeviceError::NoSuchGpuMinor {
                        key,
                        value: value.to_owned(),
                        minor,
                        existing: self.gpus.iter().filter_map(|g| g.minor).collect(),
                        unknown: self.gpus.iter().filter(|g| g.minor.is_none()).count(),
                    })
            })
            .collect::<Result<_, _>>()
            .map(DeviceRequest)
    }

    /// The devices whose nodes a container holds: GPU nodes `/dev/nvidia<minor>` and MIG
    /// access nodes `/dev/nvidia-caps/nvidia-cap<cap>`, as a request for [`Inventory::resolve`]
    /// (which then applies the usual rules: a MIG device stands alone, each GPU once, none
    /// in MIG mode). A compute instance's cap names its MIG device; a GPU instance's cap
    /// that comes without the cap of any of its compute instances names every MIG device of
    /// that instance. A named MIG device needs its GPU's node among `minors`, and that node
    /// then stands for the MIG device, not for the GPU. Without caps this is
    /// [`Inventory::gpus_by_minor`]. `key` and `value` only appear in errors.
    pub fn devices_by_nodes(
        &self,
        key: &'static str,
        value: &str,
        minors: &[u32],
        caps: &[u32],
    ) -> Result<DeviceRequest, DeviceError> {
        let migs = || {
            self.gpus
                .iter()
                .flat_map(|g| g.mig_devices.iter().map(move |m| (g, m)))
        };
        // (GPU, MIG device, the cap that named it), in the order of the caps.
        let mut named: Vec<(&Gpu, &MigDevice, u32)> = Vec::new();
        let mut gi_only = Vec::new();
        for &cap in caps {
            if let Some((g, m)) = migs().find(|(_, m)| m.ci_caps_minor == Some(cap)) {
                if !named.iter().any(|(_, n, _)| n.uuid == m.uuid) {
                    named.push((g, m, cap));
                }
            } else if migs().any(|(_, m)| m.gi_caps_minor == Some(cap)) {
                gi_only.push(cap);
            } else {
                let mut existing: Vec<u32> = migs()
                    .flat_map(|(_, m)| [m.gi_caps_minor, m.ci_caps_minor])
                    .flatten()
                    .collect();
                existing.sort_unstable();
                existing.dedup();
                return Err(DeviceError::NoSuchCapMinor {
                    key,
                    value: value.to_owned(),
                    cap,
                    existing,
                    unknown: migs()
                        .filter(|(_, m)| m.gi_caps_minor.is_none() || m.ci_caps_minor.is_none())
                        .count(),
                });
            }
        }
        for &cap in &gi_only {
            if named.iter().any(|(_, m, _)| m.gi_caps_minor == Some(cap)) {
                continue;
            }
            for (g, m) in migs().filter(|(_, m)| m.gi_caps_minor == Some(cap)) {
                if !named.iter().any(|(_, n, _)| n.uuid == m.uuid) {
                    named.push((g, m, cap));
                }
            }
        }
        for &(g, m, cap) in &named {
            if !g.minor.is_some_and(|minor| minors.contains(&minor)) {
                return Err(DeviceError::MigWithoutParentNode {
                    key,
                    value: value.to_owned(),
                    cap,
                    uuid: m.uuid.clone(),
                    gpu: g.index,
                    minor: g.minor,
                });
            }
        }
        let gpu_minors: Vec<u32> = minors
            .iter()
            .copied()
            .filter(|&minor| !named.iter().any(|(g, _, _)| g.minor == Some(minor)))
            .collect();
        let mut request = self.gpus_by_minor(key, value, &gpu_minors)?;
        request.0.extend(
            named
                .iter()
                .map(|(_, m, _)| DeviceSelector::MigUuid(m.uuid.clone())),
        );
        Ok(request)
    }

    fn find_gpu(
        &self,
        key: &'static str,
        value: &str,
        sel: &DeviceSelector,
    ) -> Result<&Gpu, DeviceError> {
        match sel {
            DeviceSelector::Index(index) => {
                self.gpus.iter().find(|g| g.index == *index).ok_or_else(|| {
                    DeviceError::NoSuchGpuIndex {
                        key,
                        value: value.to_owned(),
                        index: *index,
                        existing: self.gpus.iter().map(|g| g.index).collect(),
                    }
                })
            }
            DeviceSelector::GpuUuid(uuid) => self
                .gpus
                .iter()
                .find(|g| g.uuid.eq_ignore_ascii_case(uuid))
                .ok_or_else(|| DeviceError::NoSuchGpuUuid {
                    key,
                    value: value.to_owned(),
                    uuid: uuid.clone(),
                    existing: self.gpus.iter().map(|g| g.uuid.clone()).collect(),
                }),
            // Callers check `is_mig` first; answer as if it were in a list.
            DeviceSelector::MigUuid(_) | DeviceSelector::MigIndex { .. } => {
                Err(DeviceError::MigInList {
                    key,
                    value: value.to_owned(),
                })
            }
        }
    }

    fn find_mig(
        &self,
        key: &'static str,
        value: &str,
        sel: &DeviceSelector,
    ) -> Result<(&Gpu, &MigDevice), DeviceError> {
        match sel {
            DeviceSelector::MigUuid(uuid) => self
                .gpus
                .iter()
                .flat_map(|g| g.mig_devices.iter().map(move |m| (g, m)))
                .find(|(_, m)| m.uuid.eq_ignore_ascii_case(uuid))
                .ok_or_else(|| DeviceError::NoSuchMigUuid {
                    key,
                    value: value.to_owned(),
                    uuid: uuid.clone(),
                    existing: self
                        .gpus
                        .iter()
                        .flat_map(|g| g.mig_devices.iter().map(|m| m.uuid.clone()))
                        .collect(),
                }),
            DeviceSelector::MigIndex { gpu, mig } => {
                let parent = self.find_gpu(key, value, &DeviceSelector::Index(*gpu))?;
                parent
                    .mig_devices
                    .iter()
                    .find(|m| m.index == *mig)
                    .map(|m| (parent, m))
                    .ok_or_else(|| DeviceError::NoSuchMigIndex {
                        key,
                        value: value.to_owned(),
                        gpu: *gpu,
                        mig: *mig,
                        existing: parent.mig_devices.iter().map(|m| m.index).collect(),
                    })
            }
            DeviceSelector::Index(_) | DeviceSelector::GpuUuid(_) => {
                // Unreachable through `resolve`; fail closed rather than panic.
                Err(DeviceError::EmptyRequest {
                    key,
                    value: value.to_owned(),
                })
            }
        }
    }
}

/// The minor number that the driver's `/proc/driver/nvidia-caps/mig-minors` text gives for
/// `name` (`gpu<gpu minor>/gi<gpu instance id>/access` or
/// `gpu<gpu minor>/gi<id>/ci<compute instance id>/access`): its lines are `<name> <minor>`.
/// `None` when no line names it (or its number is not one).
pub fn mig_cap_minor(text: &str, name: &str) -> Option<u32> {
    text.lines().find_map(|line| {
        let mut fields = line.split_whitespace();
        match (fields.next(), fields.next(), fields.next()) {
            (Some(n), Some(minor), None) if n == name => minor.parse().ok(),
            _ => None,
        }
    })
}

/// Test data, public so that other modules' tests and the integration tests share it: one
/// NVIDIA A30 (GPU 0, 24 GiB, MIG enabled with four `1g.6gb` devices of 6 GiB, indices 0–3) and
/// one NVIDIA A100 80GB (GPU 1, 80 GiB, MIG disabled) and a second A30 (GPU 2, 24 GiB, MIG
/// disabled). GPU 0 and its MIG device 0 carry the UUIDs of DESIGN.md §6. Their device nodes
/// are `/dev/nvidia0`, `/dev/nvidia1` and `/dev/nvidia3` (minor numbers need not follow the
/// index). Not a description of any real machine.
pub fn sample() -> Inventory {
    const GIB: u64 = 1 << 30;
    let mig = |index: u32, uuid: &str| MigDevice {
        // MIG device i on GPU instance i + 1, compute instance 0, numbered as the driver's
        // mig-minors does on GPU minor 0 (`gpu0/gi1/access 12`, `gpu0/gi1/ci0/access 13`,
        // nine minors per GPU instance): 12/13, 21/22, 30/31, 39/40.
        gi_caps_minor: Some(12 + 9 * index),
        ci_caps_minor: Some(13 + 9 * index),
        index,
        uuid: uuid.to_owned(),
        profile: "1g.6gb".to_owned(),
        memory_bytes: 6 * GIB,
    };
    Inventory {
        driver_version: "580.159.04".to_owned(),
        gpus: vec![
            Gpu {
                index: 0,
                uuid: "GPU-8f8bff94-112e-9541-43da-cfd453333404".to_owned(),
                name: "NVIDIA A30".to_owned(),
                memory_bytes: 24 * GIB,
                compute_capability: "8.0".to_owned(),
                compute_mode: ComputeMode::Default,
                minor: Some(0),
                mig_devices: vec![
                    mig(0, "MIG-22f0c05f-5cf2-5ea2-8297-789695656dc0"),
                    mig(1, "MIG-3b5c1f7e-0d4a-5a0e-9c61-2f1e8d7b6a01"),
                    mig(2, "MIG-4c6d2a8f-1e5b-5b1f-8d72-3a2f9e8c7b12"),
                    mig(3, "MIG-5d7e3b9a-2f6c-5c2a-9e83-4b3a0f9d8c23"),
                ],
            },
            Gpu {
                index: 1,
                uuid: "GPU-a1b2c3d4-e5f6-4789-9abc-def012345678".to_owned(),
                name: "NVIDIA A100-SXM4-80GB".to_owned(),
                memory_bytes: 80 * GIB,
                compute_capability: "8.0".to_owned(),
                compute_mode: ComputeMode::ExclusiveProcess,
                minor: Some(1),
                mig_devices: Vec::new(),
            },
            Gpu {
                index: 2,
                uuid: "GPU-c0ffee00-1234-4abc-8def-0123456789ab".to_owned(),
                name: "NVIDIA A30".to_owned(),
                memory_bytes: 24 * GIB,
                compute_capability: "8.0".to_owned(),
                compute_mode: ComputeMode::Default,
                // Not 2: minor numbers need not follow NVML's enumeration order.
                minor: Some(3),
                mig_devices: Vec::new(),
            },
        ],
    }
}

/// NVML queries. Kept apart so the rest of the module is plain data.
mod nvml {
    use nvml_wrapper::enum_wrappers::device::ComputeMode as NvmlComputeMode;
    use nvml_wrapper::error::NvmlError;
    use nvml_wrapper::{Device, Nvml};

    use super::{ComputeMode, DeviceError, Gpu, Inventory, MigDevice, UNKNOWN_MIG_PROFILE};

    /// `NVML_DEVICE_MIG_ENABLE` from nvml.h.
    const MIG_ENABLED: u32 = 1;

    fn op(operation: String) -> impl FnOnce(NvmlError) -> DeviceError {
        move |error| DeviceError::Nvml { operation, error }
    }

    pub(super) fn load() -> Result<Inventory, DeviceError> {
        let nvml = Nvml::init().map_err(|error| DeviceError::NvmlInit { error })?;
        let driver_version = nvml
            .sys_driver_version()
            .map_err(op("read the driver version".to_owned()))?;
        let count = nvml
            .device_count()
            .map_err(op("count the GPUs".to_owned()))?;
        // Without the file (no MIG support, another platform) MIG devices get no cap minors.
        let mig_minors = std::fs::read_to_string(MIG_MINORS).unwrap_or_default();
        let mut gpus = Vec::new();
        for index in 0..count {
            let device = nvml
                .device_by_index(index)
                .map_err(op(format!("open GPU {index}")))?;
            gpus.push(gpu(index, &device, &mig_minors)?);
        }
        Ok(Inventory {
            driver_version,
            gpus,
        })
    }

    fn gpu(index: u32, device: &Device<'_>, mig_minors: &str) -> Result<Gpu, DeviceError> {
        let what = |field: &str| format!("read the {field} of GPU {index}");
        let capability = device
            .cuda_compute_capability()
            .map_err(op(what("compute capability")))?;
        let compute_mode = match device.compute_mode().map_err(op(what("compute mode")))? {
            NvmlComputeMode::Default => ComputeMode::Default,
            NvmlComputeMode::ExclusiveThread | NvmlComputeMode::ExclusiveProcess => {
                ComputeMode::ExclusiveProcess
            }
            NvmlComputeMode::Prohibited => ComputeMode::Prohibited,
        };
        let minor = match device.minor_number() {
            Ok(minor) => Some(minor),
            // Not on every platform (NVML documents it for Linux only): the GPU stays
            // usable by every request but one that names its device node.
            Err(NvmlError::NotSupported) => None,
            Err(error) => return Err(op(what("minor number"))(error)),
        };
        Ok(Gpu {
            index,
            uuid: device.uuid().map_err(op(what("UUID")))?,
            name: device.name().map_err(op(what("name")))?,
            memory_bytes: device.memory_info().map_err(op(what("memory")))?.total,
            compute_capability: format!("{}.{}", capability.major, capability.minor),
            compute_mode,
            minor,
            mig_devices: mig_devices(index, device, minor, mig_minors)?,
        })
    }

    fn mig_devices(
        index: u32,
        device: &Device<'_>,
        minor: Option<u32>,
        mig_minors: &str,
    ) -> Result<Vec<MigDevice>, DeviceError> {
        match device.mig_mode() {
            Ok(mode) if mode.current == MIG_ENABLED => {}
            // GPUs without MIG support answer NotSupported: no MIG devices.
            Ok(_) | Err(NvmlError::NotSupported) => return Ok(Vec::new()),
            Err(error) => return Err(op(format!("read the MIG mode of GPU {index}"))(error)),
        }
        let slots = device
            .mig_device_count()
            .map_err(op(format!("count the MIG devices of GPU {index}")))?;
        let mut out = Vec::new();
        for slot in 0..slots {
            // Slots without a created instance answer NotFound (or InvalidArg on some drivers).
            let mig = match device.mig_device_by_index(slot) {
                Ok(mig) => mig,
                Err(NvmlError::NotFound | NvmlError::InvalidArg) => continue,
                Err(error) => {
                    return Err(op(format!("open MIG device {slot} of GPU {index}"))(error))
                }
            };
            let what = |field: &str| format!("read the {field} of GPU {index} MIG device {slot}");
            // A MIG device's name is "<GPU name> MIG <profile>", e.g. "NVIDIA A30 MIG 1g.6gb".
            let name = mig.name().map_err(op(what("name")))?;
            // The cap minors are optional data: a driver without the instance-id calls, or
            // a mig-minors without the entry, leaves the device usable by name only.
            let (gi_caps_minor, ci_caps_minor) =
                match (minor, crate::sys::nvml_mig_instance_ids(&mig)) {
                    (Some(minor), Some((gi, ci))) => (
                        super::mig_cap_minor(mig_minors, &format!("gpu{minor}/gi{gi}/access")),
                        super::mig_cap_minor(
                            mig_minors,
                            &format!("gpu{minor}/gi{gi}/ci{ci}/access"),
                        ),
                    ),
                    _ => (None, None),
                };
            out.push(MigDevice {
                gi_caps_minor,
                ci_caps_minor,
                index: slot,
                uuid: mig.uuid().map_err(op(what("UUID")))?,
                profile: profile_from_name(&name),
                memory_bytes: mig.memory_info().map_err(op(what("memory")))?.total,
            });
        }
        Ok(out)
    }

    /// The file where the NVIDIA driver lists the minor numbers of `/dev/nvidia-caps/nvidia-cap*`.
    pub(super) const MIG_MINORS: &str = "/proc/driver/nvidia-caps/mig-minors";

    /// `"NVIDIA A30 MIG 1g.6gb"` → `"1g.6gb"`; anything else → [`UNKNOWN_MIG_PROFILE`].
    pub(super) fn profile_from_name(name: &str) -> String {
        name.rsplit_once("MIG ")
            .map(|(_, profile)| profile.trim())
            .filter(|p| super::is_safe_profile(p))
            .unwrap_or(UNKNOWN_MIG_PROFILE)
            .to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    const DESIGN_JSON: &str = r#"{"driver_version": "580.159.04",
 "gpus": [{"index": 0, "uuid": "GPU-8f8bff94-112e-9541-43da-cfd453333404",
           "name": "NVIDIA A30", "memory_bytes": 25769803776,
           "compute_capability": "8.0", "compute_mode": "default",
           "mig_devices": [{"index": 0, "uuid": "MIG-22f0c05f-5cf2-5ea2-8297-789695656dc0",
                            "profile": "1g.6gb", "memory_bytes": 6442450944}]}]}"#;

    const GIB: u64 = 1 << 30;
    const KEY: &str = "gpushare.io/device";
    const GPU0: &str = "GPU-8f8bff94-112e-9541-43da-cfd453333404";
    const GPU1: &str = "GPU-a1b2c3d4-e5f6-4789-9abc-def012345678";
    const GPU2: &str = "GPU-c0ffee00-1234-4abc-8def-0123456789ab";
    const MIG0: &str = "MIG-22f0c05f-5cf2-5ea2-8297-789695656dc0";
    const MIG2: &str = "MIG-4c6d2a8f-1e5b-5b1f-8d72-3a2f9e8c7b12";

    fn write_temp(text: &str) -> tempfile::NamedTempFile {
        let mut file = tempfile::NamedTempFile::new().expect("temp file");
        file.write_all(text.as_bytes()).expect("write");
        file
    }

    fn load_text(text: &str) -> (tempfile::NamedTempFile, Result<Inventory, DeviceError>) {
        let file = write_temp(text);
        let result = load(&InventorySource::File(file.path().to_path_buf()));
        (file, result)
    }

    use crate::util::error_chain as chain;

    #[test]
    fn source_parse() {
        let ok: &[(&str, InventorySource)] = &[
            ("nvml", InventorySource::Nvml),
            (
                "file:/etc/gpushare/inventory.json",
                InventorySource::File("/etc/gpushare/inventory.json".into()),
            ),
        ];
        for (text, want) in ok {
            assert_eq!(&InventorySource::parse(text).expect(text), want, "{text}");
            assert_eq!(&want.to_string(), text);
        }
        for bad in [
            "",
            "NVML",
            "nvml ",
            "file:",
            "file:relative.json",
            "file",
            "/abs.json",
            "file:/a\nb",
        ] {
            let msg = InventorySource::parse(bad).expect_err(bad).to_string();
            assert!(msg.starts_with("inventory=\""), "{msg}");
            assert!(msg.contains(&quote(bad)), "{msg}");
            assert!(
                msg.ends_with("allowed is nvml or file:<absolute path>"),
                "{msg}"
            );
            assert!(!msg.contains('\n'), "{msg}");
        }
    }

    #[test]
    fn quote_escapes_and_truncates() {
        let cases: &[(&str, &str)] = &[
            ("0", "\"0\""),
            ("a\0b", "\"a\\0b\""),
            ("a\nb", "\"a\\nb\""),
            ("\u{1b}[31m", "\"\\u{1b}[31m\""),
            ("say \"hi\"", "\"say \\\"hi\\\"\""),
        ];
        for (raw, want) in cases {
            assert_eq!(&quote(raw), want);
        }
        let long = "x".repeat(65);
        assert_eq!(quote(&long), format!("\"{}…\"", "x".repeat(64)));
        assert_eq!(quote(&"x".repeat(64)), format!("\"{}\"", "x".repeat(64)));
    }

    #[test]
    fn uuid_shapes() {
        let cases: &[(&str, &str, bool)] = &[
            (GPU0, "GPU-", true),
            ("GPU-8F8BFF94-112E-9541-43DA-CFD453333404", "GPU-", true),
            (MIG0, "MIG-", true),
            ("GPU-abc", "GPU-", true),
            (MIG0, "GPU-", false),
            ("GPU-", "GPU-", false),
            ("GPU--abc", "GPU-", false),
            ("GPU-abc-", "GPU-", false),
            ("GPU-ab--c", "GPU-", false),
            ("GPU-xyz", "GPU-", false),
            ("gpu-abc", "GPU-", false),
            ("GPU-abc/0", "GPU-", false),
            (
                "MIG-GPU-8f8bff94-112e-9541-43da-cfd453333404/1/0",
                "MIG-",
                false,
            ),
        ];
        for (s, prefix, want) in cases {
            assert_eq!(is_well_formed_uuid(s, prefix), *want, "{s}");
        }
        assert!(!is_well_formed_uuid(
            &format!("GPU-{}", "a".repeat(65)),
            "GPU-"
        ));
    }

    #[test]
    fn load_design_json() {
        let (_file, result) = load_text(DESIGN_JSON);
        let inv = result.expect("design json loads");
        assert_eq!(inv.driver_version, "580.159.04");
        assert_eq!(inv.gpus.len(), 1);
        let gpu = &inv.gpus[0];
        assert_eq!(gpu.uuid, GPU0);
        assert_eq!(gpu.memory_bytes, 24 * GIB);
        assert_eq!(gpu.compute_mode, ComputeMode::Default);
        assert_eq!(gpu.mig_devices[0].profile, "1g.6gb");
        assert_eq!(gpu.mig_devices[0].memory_bytes, 6 * GIB);
        // Written before `minor` existed: still valid, the minor unknown.
        assert_eq!(gpu.minor, None);
    }

    #[test]
    fn minor_numbers_load_validate_and_map_device_nodes() {
        let with_minor = DESIGN_JSON.replace(
            "\"compute_mode\": \"default\"",
            "\"compute_mode\": \"default\", \"minor\": 7",
        );
        let (_file, result) = load_text(&with_minor);
        assert_eq!(result.expect("loads").gpus[0].minor, Some(7));
        let (_file, result) = load_text(&DESIGN_JSON.replace(
            "\"compute_mode\": \"default\"",
            "\"compute_mode\": \"default\", \"minor\": -1",
        ));
        assert!(chain(&result.expect_err("negative")).contains("cannot parse inventory file"));

        let mut dup = sample();
        dup.gpus[2].minor = Some(0);
        let msg = dup.validate("t").expect_err("dup minor").to_string();
        assert_eq!(
            msg,
            "inventory t: gpus[2] (GPU 2) repeats minor \"0\": allowed is each minor once"
        );

        let inv = sample();
        let key = "linux.devices";
        use DeviceSelector::GpuUuid;
        assert_eq!(
            inv.gpus_by_minor(key, "/dev/nvidia3,/dev/nvidia1", &[3, 1])
                .expect("3, 1"),
            req(&[GpuUuid(GPU2.into()), GpuUuid(GPU1.into())])
        );
        let err = |inv: &Inventory, minors: &[u32]| {
            inv.gpus_by_minor(key, "/dev/nvidia9", minors)
                .expect_err("absent")
                .to_string()
        };
        assert_eq!(
            err(&inv, &[1, 9]),
            "linux.devices=\"/dev/nvidia9\" names the GPU with minor number 9 (/dev/nvidia9), which does not exist: this node's GPUs have minor numbers 0, 1, 3"
        );
        let mut partial = sample();
        partial.gpus[0].minor = None;
        assert!(err(&partial, &[9]).ends_with("this node's GPUs have minor numbers 1, 3, and 1 give none (an inventory file needs \"minor\" on each GPU)"));
        let mut none = sample();
        for g in &mut none.gpus {
            g.minor = None;
        }
        assert!(err(&none, &[0]).ends_with("which does not exist: this node's inventory gives no minor numbers (an inventory file needs \"minor\" on each GPU)"));
        // The mapped GPUs then meet the usual rules: GPU 0 is in MIG mode.
        let gpu0 = inv.gpus_by_minor(key, "/dev/nvidia0", &[0]).expect("0");
        assert!(matches!(
            inv.resolve(key, "/dev/nvidia0", &gpu0),
            Err(DeviceError::GpuInMigMode { gpu: 0, .. })
        ));
    }

    #[test]
    fn load_without_mig_devices_field() {
        let text = r#"{"driver_version":"1","gpus":[{"index":0,"uuid":"GPU-ab","name":"x",
            "memory_bytes":1,"compute_capability":"9.0","compute_mode":"exclusive_process"}]}"#;
        let (_file, result) = load_text(text);
        let inv = result.expect("loads");
        assert!(inv.gpus[0].mig_devices.is_empty());
        assert_eq!(inv.gpus[0].compute_mode, ComputeMode::ExclusiveProcess);
    }

    #[test]
    fn sample_round_trips_and_validates() {
        let inv = sample();
        inv.validate("sample").expect("sample is valid");
        let text = serde_json::to_string(&inv).expect("serialize");
        let (_file, result) = load_text(&text);
        assert_eq!(result.expect("loads"), inv);
    }

    #[test]
    fn load_bad_files() {
        // (json, substrings of the full error chain)
        let cases: &[(&str, &[&str])] = &[
            (
                r#"{"driver_version":"1","gpus":[],"extra":1}"#,
                &["cannot parse inventory file", "unknown field `extra`"],
            ),
            (
                &DESIGN_JSON.replace("\"name\"", "\"nom\""),
                &["cannot parse inventory file", "unknown field `nom`"],
            ),
            (
                &DESIGN_JSON.replace("\"profile\"", "\"profile_id\": 1, \"profile\""),
                &["cannot parse inventory file", "unknown field `profile_id`"],
            ),
            (
                &DESIGN_JSON.replace("\"default\"", "\"shared\""),
                &["cannot parse inventory file", "unknown variant `shared`"],
            ),
            ("{not json", &["cannot parse inventory file"]),
            (
                &DESIGN_JSON.replace(GPU0, "GPU-8f8bff94/../x"),
                &["gpus[0] (GPU 0) has uuid \"GPU-8f8bff94/../x\", which is invalid: allowed is GPU- followed by hex digits and dashes"],
            ),
            (
                &DESIGN_JSON.replace(MIG0, "GPU-22f0c05f"),
                &["gpus[0].mig_devices[0] (GPU 0 MIG device 0) has uuid \"GPU-22f0c05f\", which is invalid: allowed is MIG-"],
            ),
            (
                &DESIGN_JSON.replace("\"8.0\"", "\"eight\""),
                &["has compute_capability \"eight\", which is invalid: allowed is major.minor"],
            ),
            (
                &DESIGN_JSON.replace("\"1g.6gb\"", "\"1g 6gb\""),
                &["has profile \"1g 6gb\", which is invalid"],
            ),
            (
                &DESIGN_JSON.replace("25769803776", "0"),
                &["has memory_bytes \"0\", which is invalid: allowed is more than 0 bytes"],
            ),
        ];
        for (text, wants) in cases {
            let (file, result) = load_text(text);
            let err = result.expect_err(text);
            let msg = chain(&err);
            for want in *wants {
                assert!(msg.contains(want), "{msg:?} lacks {want:?}");
            }
            if msg.starts_with("cannot parse") {
                assert!(msg.contains(&file.path().display().to_string()), "{msg}");
            } else {
                assert!(
                    msg.contains(&format!("inventory file:{}", file.path().display())),
                    "{msg}"
                );
            }
        }
    }

    #[test]
    fn validate_duplicates_and_count() {
        let mut dup_index = sample();
        dup_index.gpus[1].index = 0;
        let mut dup_uuid = sample();
        dup_uuid.gpus[1].uuid = GPU0.to_uppercase();
        let mut dup_mig_index = sample();
        dup_mig_index.gpus[0].mig_devices[3].index = 1;
        let mut dup_mig_uuid = sample();
        dup_mig_uuid.gpus[0].mig_devices[3].uuid = MIG0.to_owned();
        let mut too_many = sample();
        too_many.gpus = (0..65)
            .map(|i| Gpu {
                index: i,
                uuid: format!("GPU-{i:08x}"),
                ..sample().gpus[1].clone()
            })
            .collect();
        let dup_mig_uuid_msg = format!("repeats uuid \"{MIG0}\": allowed is each uuid once");
        let cases: Vec<(Inventory, &str)> = vec![
            (dup_index, "inventory t: gpus[1] (GPU 0) repeats index \"0\": allowed is each index once"),
            (dup_uuid, "inventory t: gpus[1] (GPU 1) repeats uuid \"GPU-8F8BFF94-112E-9541-43DA-CFD453333404\": allowed is each uuid once"),
            (dup_mig_index, "gpus[0].mig_devices[3] (GPU 0 MIG device 1) repeats index \"1\""),
            (dup_mig_uuid, &dup_mig_uuid_msg),
            (too_many, "inventory t lists 65 GPUs: allowed is at most 64"),
        ];
        for (inv, want) in cases {
            let msg = inv.validate("t").expect_err(want).to_string();
            assert!(msg.contains(want), "{msg:?} lacks {want:?}");
        }
    }

    #[test]
    fn missing_file_names_path() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("absent.json");
        let err = load(&InventorySource::File(path.clone())).expect_err("missing");
        assert!(matches!(err, DeviceError::ReadFile { .. }));
        let msg = chain(&err);
        assert!(
            msg.starts_with(&format!("cannot read inventory file {}: ", path.display())),
            "{msg}"
        );
        // A directory is unreadable as a file.
        let err = load(&InventorySource::File(dir.path().to_path_buf())).expect_err("dir");
        assert!(err.to_string().contains(&dir.path().display().to_string()));
    }

    #[test]
    fn nvml_without_driver_is_an_error_not_a_panic() {
        match load(&InventorySource::Nvml) {
            // A GPU machine: whatever NVML reports must be a valid inventory.
            Ok(inv) => inv.validate("nvml").expect("nvml inventory valid"),
            Err(err) => {
                let msg = chain(&err);
                assert!(
                    msg.starts_with(
                        "cannot initialise NVML (is the NVIDIA driver installed and loaded?): "
                    ) || msg.contains("through NVML"),
                    "{msg}"
                );
                assert!(!msg.contains('\n'), "{msg}");
            }
        }
    }

    #[test]
    fn nvml_profile_from_name() {
        let cases = [
            ("NVIDIA A30 MIG 1g.6gb", "1g.6gb"),
            ("NVIDIA A100-SXM4-40GB MIG 1g.5gb+me", "1g.5gb+me"),
            ("NVIDIA H100 80GB HBM3 MIG 3g.40gb", "3g.40gb"),
            ("NVIDIA A30", UNKNOWN_MIG_PROFILE),
            ("NVIDIA A30 MIG ", UNKNOWN_MIG_PROFILE),
            ("NVIDIA A30 MIG 1g 6gb", UNKNOWN_MIG_PROFILE),
        ];
        for (name, want) in cases {
            assert_eq!(nvml::profile_from_name(name), want, "{name}");
        }
    }

    fn req(sels: &[DeviceSelector]) -> DeviceRequest {
        DeviceRequest(sels.to_vec())
    }

    #[test]
    fn resolve_ok() {
        use DeviceSelector::*;
        let inv = sample();
        let gpus = |uuids: &[&str], idx: &[u32], mem: u64| ResolvedDevices {
            kind: DeviceKind::Gpus,
            uuids: uuids.iter().map(|s| s.to_string()).collect(),
            gpu_indices: idx.to_vec(),
            memory_bytes: mem,
            mig_profile: None,
        };
        let mig = |uuid: &str| ResolvedDevices {
            kind: DeviceKind::Mig,
            uuids: vec![uuid.to_owned()],
            gpu_indices: vec![0],
            memory_bytes: 6 * GIB,
            mig_profile: Some("1g.6gb".to_owned()),
        };
        let cases: Vec<(DeviceRequest, ResolvedDevices)> = vec![
            (req(&[Index(2)]), gpus(&[GPU2], &[2], 24 * GIB)),
            (req(&[Index(1)]), gpus(&[GPU1], &[1], 80 * GIB)),
            (
                req(&[GpuUuid(GPU1.to_owned())]),
                gpus(&[GPU1], &[1], 80 * GIB),
            ),
            (
                req(&[GpuUuid(GPU1.to_uppercase())]),
                gpus(&[GPU1], &[1], 80 * GIB),
            ),
            (
                req(&[Index(1), Index(2)]),
                gpus(&[GPU1, GPU2], &[1, 2], 24 * GIB),
            ),
            (
                req(&[GpuUuid(GPU2.to_owned()), Index(1)]),
                gpus(&[GPU2, GPU1], &[2, 1], 24 * GIB),
            ),
            (req(&[MigUuid(MIG2.to_owned())]), mig(MIG2)),
            (req(&[MigUuid(MIG2.to_uppercase())]), mig(MIG2)),
            (req(&[MigIndex { gpu: 0, mig: 2 }]), mig(MIG2)),
            (req(&[MigIndex { gpu: 0, mig: 0 }]), mig(MIG0)),
        ];
        for (request, want) in cases {
            assert_eq!(
                inv.resolve(KEY, &request.to_string(), &request)
                    .expect("resolves"),
                want,
                "{request}"
            );
        }
    }

    #[test]
    fn resolve_errors() {
        use DeviceSelector::*;
        let inv = sample();
        let cases: Vec<(DeviceRequest, &str, String)> = vec![
            (req(&[]), "", "gpushare.io/device=\"\" is invalid: allowed is at least one device".into()),
            (req(&[Index(3)]), "3", "gpushare.io/device=\"3\" names GPU 3, which does not exist: this node has GPUs 0, 1, 2".into()),
            (req(&[Index(0)]), "0", "gpushare.io/device=\"0\" names GPU 0, which is in MIG mode: allowed is one of its MIG devices (0:0, 0:1, 0:2, 0:3)".into()),
            (req(&[Index(1), GpuUuid(GPU0.into())]), "1,GPU-8f8b", "gpushare.io/device=\"1,GPU-8f8b\" names GPU 0, which is in MIG mode".into()),
            (
                req(&[GpuUuid("GPU-8f8bff94".into())]),
                "GPU-8f8bff94",
                format!("gpushare.io/device=\"GPU-8f8bff94\" names GPU-8f8bff94, which does not exist: this node has GPUs {GPU0}, {GPU1}, {GPU2}"),
            ),
            (
                req(&[MigUuid("MIG-abc".into())]),
                "MIG-abc",
                format!("gpushare.io/device=\"MIG-abc\" names MIG-abc, which does not exist: this node has MIG devices {MIG0}, "),
            ),
            (
                req(&[MigIndex { gpu: 0, mig: 4 }]),
                "0:4",
                "gpushare.io/device=\"0:4\" names MIG device 4 of GPU 0, which does not exist: GPU 0 has MIG devices 0, 1, 2, 3".into(),
            ),
            (
                req(&[MigIndex { gpu: 1, mig: 0 }]),
                "1:0",
                "gpushare.io/device=\"1:0\" names MIG device 0 of GPU 1, which does not exist: GPU 1 has no MIG devices (MIG is not enabled or no instance is created)".into(),
            ),
            (
                req(&[MigIndex { gpu: 7, mig: 0 }]),
                "7:0",
                "gpushare.io/device=\"7:0\" names GPU 7, which does not exist: this node has GPUs 0, 1, 2".into(),
            ),
            (req(&[Index(2), Index(2)]), "2,2", "gpushare.io/device=\"2,2\" lists GPU 2 twice: allowed is each GPU at most once".into()),
            (
                req(&[Index(1), GpuUuid(GPU1.into())]),
                "1,GPU-a1b2",
                "gpushare.io/device=\"1,GPU-a1b2\" lists GPU 1 twice: allowed is each GPU at most once".into(),
            ),
            (
                req(&[Index(0), MigUuid(MIG0.into())]),
                "0,MIG-22f0",
                "gpushare.io/device=\"0,MIG-22f0\" is invalid: a MIG device must stand alone, not in a list".into(),
            ),
            (
                req(&[MigIndex { gpu: 0, mig: 0 }, MigIndex { gpu: 0, mig: 1 }]),
                "0:0,0:1",
                "gpushare.io/device=\"0:0,0:1\" is invalid: a MIG device must stand alone, not in a list".into(),
            ),
        ];
        for (request, raw, want) in cases {
            let msg = inv.resolve(KEY, raw, &request).expect_err(raw).to_string();
            assert!(msg.starts_with(&want), "{msg:?}\n  !starts_with {want:?}");
            assert!(!msg.contains('\n'));
        }
    }

    #[test]
    fn resolve_on_empty_inventory_and_long_lists() {
        let empty = Inventory {
            driver_version: "1".into(),
            gpus: Vec::new(),
        };
        let msg = empty
            .resolve("GPUSHARE_DEVICE", "0", &req(&[DeviceSelector::Index(0)]))
            .expect_err("no gpus")
            .to_string();
        assert_eq!(
            msg,
            "GPUSHARE_DEVICE=\"0\" names GPU 0, which does not exist: this node has no GPUs"
        );

        let mut many = sample();
        many.gpus = (0..10)
            .map(|i| Gpu {
                index: i,
                uuid: format!("GPU-{i:08x}"),
                ..sample().gpus[1].clone()
            })
            .collect();
        let msg = many
            .resolve(KEY, "10", &req(&[DeviceSelector::Index(10)]))
            .expect_err("absent")
            .to_string();
        assert!(
            msg.ends_with("this node has GPUs 0, 1, 2, 3, 4, 5, 6, 7 and 2 more"),
            "{msg}"
        );
    }

    #[test]
    fn selector_display() {
        use DeviceSelector::*;
        let cases: &[(DeviceRequest, &str)] = &[
            (req(&[Index(3)]), "3"),
            (req(&[MigIndex { gpu: 0, mig: 1 }]), "0:1"),
            (
                req(&[Index(0), GpuUuid(GPU1.into())]),
                "0,GPU-a1b2c3d4-e5f6-4789-9abc-def012345678",
            ),
            (req(&[MigUuid(MIG0.into())]), MIG0),
        ];
        for (request, want) in cases {
            assert_eq!(&request.to_string(), want);
        }
    }

    /// What a driver publishes for GPU minor 0 with GPU instances 1 and 2, one compute
    /// instance each, and GPU minor 1 with GPU instance 1 (the shape of
    /// `/proc/driver/nvidia-caps/mig-minors`).
    const MIG_MINORS: &str = "config 1\nmonitor 2\ngpu0/gi0/access 3\ngpu0/gi0/ci0/access 4\ngpu0/gi1/access 12\ngpu0/gi1/ci0/access 13\ngpu0/gi1/ci1/access 14\ngpu0/gi2/access 21\ngpu0/gi2/ci0/access 22\ngpu1/gi1/access 147\ngpu1/gi1/ci0/access 148\n";

    #[test]
    fn mig_minors_parse() {
        let cases: &[(&str, Option<u32>)] = &[
            ("gpu0/gi1/access", Some(12)),
            ("gpu0/gi1/ci0/access", Some(13)),
            ("gpu0/gi1/ci1/access", Some(14)),
            ("gpu0/gi2/ci0/access", Some(22)),
            ("gpu1/gi1/access", Some(147)),
            ("gpu1/gi1/ci0/access", Some(148)),
            ("config", Some(1)),
            // Absent entries, and no prefix match.
            ("gpu0/gi3/access", None),
            ("gpu1/gi1/ci1/access", None),
            ("gpu0/gi1", None),
            ("gpu0/gi1/ci0/acces", None),
            ("gpu10/gi1/access", None),
        ];
        for (name, want) in cases {
            assert_eq!(mig_cap_minor(MIG_MINORS, name), *want, "{name}");
        }
        // A missing file reads as empty text; odd lines are skipped, not errors.
        assert_eq!(mig_cap_minor("", "gpu0/gi1/access"), None);
        let odd =
            "gpu0/gi1/access\ngpu0/gi1/access x\ngpu0/gi1/access 12 13\n  gpu0/gi1/access   12  \n";
        assert_eq!(mig_cap_minor(odd, "gpu0/gi1/access"), Some(12));
        assert_eq!(mig_cap_minor("gpu0/gi1/access -1", "gpu0/gi1/access"), None);
    }

    #[test]
    fn caps_minors_in_files() {
        // Old inventories (no caps) still load; the fields round-trip.
        let (_f, inv) = load_text(DESIGN_JSON);
        assert_eq!(
            inv.expect("old inventory").gpus[0].mig_devices[0].ci_caps_minor,
            None
        );
        let with = DESIGN_JSON.replace(
            r#""memory_bytes": 6442450944}"#,
            r#""memory_bytes": 6442450944, "gi_caps_minor": 12, "ci_caps_minor": 13}"#,
        );
        assert_ne!(with, DESIGN_JSON);
        let (_f, inv) = load_text(&with);
        let inv = inv.expect("with caps");
        let mig = &inv.gpus[0].mig_devices[0];
        assert_eq!((mig.gi_caps_minor, mig.ci_caps_minor), (Some(12), Some(13)));
        let text = serde_json::to_string(&inv).expect("ser");
        assert!(
            text.contains(r#""gi_caps_minor":12,"ci_caps_minor":13"#),
            "{text}"
        );
        sample().validate("t").expect("the sample is valid");

        // Two MIG devices of one GPU instance share its node; a compute instance's is one
        // device's; no node is both; a GPU instance's node is one GPU's.
        let mut shared_gi = sample();
        shared_gi.gpus[0].mig_devices[1].gi_caps_minor = Some(12);
        shared_gi
            .validate("t")
            .expect("one GPU instance, two compute instances");
        let mut dup_ci = sample();
        dup_ci.gpus[0].mig_devices[1].ci_caps_minor = Some(13);
        let mut ci_is_gi = sample();
        ci_is_gi.gpus[0].mig_devices[1].ci_caps_minor = Some(12);
        let mut gi_is_ci = sample();
        gi_is_ci.gpus[0].mig_devices[1].gi_caps_minor = Some(13);
        let mut gi_two_gpus = sample();
        gi_two_gpus.gpus[1].mig_devices = vec![MigDevice {
            index: 0,
            uuid: "MIG-6e8f4cab-3a7d-5d3b-af94-5c4b1a0e9d34".to_owned(),
            profile: "1g.10gb".to_owned(),
            memory_bytes: 10 * GIB,
            gi_caps_minor: Some(12),
            ci_caps_minor: Some(148),
        }];
        let cases: Vec<(Inventory, &str)> = vec![
            (dup_ci, "inventory t: gpus[0].mig_devices[1] (GPU 0 MIG device 1) repeats ci_caps_minor \"13\": allowed is each ci_caps_minor once"),
            (ci_is_gi, "inventory t: gpus[0].mig_devices[1] (GPU 0 MIG device 1) has ci_caps_minor \"12\""),
            (gi_is_ci, "inventory t: gpus[0].mig_devices[1] (GPU 0 MIG device 1) has gi_caps_minor \"13\""),
            (gi_two_gpus, "inventory t: gpus[1].mig_devices[0] (GPU 1 MIG device 0) has gi_caps_minor \"12\""),
        ];
        for (inv, want) in cases {
            let msg = inv.validate("t").expect_err(want).to_string();
            assert!(msg.contains(want), "{msg:?} lacks {want:?}");
        }
    }

    #[test]
    fn devices_by_nodes_maps_caps() {
        let inv = sample();
        let key = "linux.devices";
        let mig = |uuid: &str| DeviceRequest(vec![DeviceSelector::MigUuid(uuid.to_owned())]);
        // Without caps: the GPUs.
        assert_eq!(
            inv.devices_by_nodes(key, "v", &[3, 1], &[]).expect("gpus"),
            inv.gpus_by_minor(key, "v", &[3, 1]).expect("gpus")
        );
        // gi + ci, ci alone, gi alone (one compute instance): the MIG device; the parent's
        // node stands for it.
        for caps in [&[12, 13][..], &[13], &[12], &[13, 12]] {
            assert_eq!(
                inv.devices_by_nodes(key, "v", &[0], caps).expect("mig"),
                mig(MIG0),
                "{caps:?}"
            );
        }
        // Two compute instances of one GPU instance: its node alone names both.
        let mut two_ci = sample();
        two_ci.gpus[0].mig_devices[1].gi_caps_minor = Some(12);
        assert_eq!(
            two_ci
                .devices_by_nodes(key, "v", &[0], &[12])
                .expect("both")
                .0
                .len(),
            2
        );
        assert_eq!(
            two_ci
                .devices_by_nodes(key, "v", &[0], &[12, 22])
                .expect("one"),
            mig("MIG-3b5c1f7e-0d4a-5a0e-9c61-2f1e8d7b6a01")
        );
        // Another GPU's node with it: a list, refused by `resolve`.
        let req = inv
            .devices_by_nodes(key, "v", &[1, 0], &[12, 13])
            .expect("list");
        assert!(matches!(
            inv.resolve(key, "v", &req),
            Err(DeviceError::MigInList { .. })
        ));
        // Unknown cap, parent missing.
        assert!(matches!(
            inv.devices_by_nodes(key, "v", &[0], &[2]),
            Err(DeviceError::NoSuchCapMinor {
                cap: 2,
                unknown: 0,
                ..
            })
        ));
        assert!(matches!(
            inv.devices_by_nodes(key, "v", &[1], &[13]),
            Err(DeviceError::MigWithoutParentNode {
                cap: 13,
                gpu: 0,
                minor: Some(0),
                ..
            })
        ));
    }

    #[test]
    fn serde_names() {
        let cases: &[(ComputeMode, &str)] = &[
            (ComputeMode::Default, "\"default\""),
            (ComputeMode::ExclusiveProcess, "\"exclusive_process\""),
            (ComputeMode::Prohibited, "\"prohibited\""),
        ];
        for (mode, want) in cases {
            assert_eq!(&serde_json::to_string(mode).expect("ser"), want);
        }
        assert_eq!(
            serde_json::to_string(&DeviceKind::Gpus).expect("ser"),
            "\"gpus\""
        );
        assert_eq!(
            serde_json::to_string(&DeviceKind::Mig).expect("ser"),
            "\"mig\""
        );
    }
}
