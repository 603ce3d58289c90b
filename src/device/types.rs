//! The inventory's types: the GPUs and MIG devices of a node, the device selectors a
//! request names, what a resolution gives, and the module's error; the limits every
//! inventory is held to (`MAX_GPUS`, a MIG profile name's form).
//!
//! Invariant: plain data and their formatting only; the files beside this one (`inventory`,
//! `nvml`, `reader`, `resolve`, `preset`) take their types from here, and this file takes
//! nothing from them but the quoting of values (`quote`), so the module's files depend one
//! way.

use std::fmt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::quote::{cap_list, gpu_list, mig_list, minor_list, parent_node, quote, uuid_list};

/// The argv word of the `gpushare` subcommand that prints the NVML inventory.
pub const NVML_SUBCOMMAND: &str = "nvml-inventory";

/// The most GPUs an inventory may hold.
pub(crate) const MAX_GPUS: usize = 64;

/// The most bytes of inventory JSON read from `gpushare nvml-inventory` (64 GPUs with 7 MIG
/// devices each are about 60 KiB).
pub(crate) const MAX_NVML_JSON_BYTES: usize = 1 << 20;

/// Profile name used when NVML cannot tell a MIG device's profile.
pub(crate) const UNKNOWN_MIG_PROFILE: &str = "mig";

/// Longest MIG profile name accepted (`1g.10gb+me` is 10).
pub(super) const MAX_PROFILE_LEN: usize = 64;

/// Whether `s` can be a MIG profile name: 1 to `MAX_PROFILE_LEN` letters, digits and
/// `.+-_`, safe in identifiers. The inventory's validation and the NVML reader both apply it.
pub(super) fn is_safe_profile(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_PROFILE_LEN
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'+' | b'-' | b'_'))
}

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
    /// Profile name such as `1g.6gb`, or `UNKNOWN_MIG_PROFILE`.
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
    pub(crate) fn parse(s: &str) -> Result<Self, DeviceError> {
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
    pub(crate) fn is_mig(&self) -> bool {
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

    /// NVML's library is not where `driver-root` says the driver is.
    #[error(transparent)]
    Driver(#[from] crate::driver::DriverError),

    /// `gpushare nvml-inventory` failed: its own line (an NVML error above, as it printed it).
    #[error("{message}")]
    NvmlHelperFailed { message: String },

    #[error("cannot run {} to read the NVML inventory (it must be beside gpushare-runtime)", .helper.display())]
    NvmlHelper {
        helper: PathBuf,
        #[source]
        error: std::io::Error,
    },

    #[error("{} {}: its output is not an inventory: {reason}", .helper.display(), NVML_SUBCOMMAND)]
    NvmlHelperOutput { helper: PathBuf, reason: String },

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
