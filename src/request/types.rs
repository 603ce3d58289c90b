//! The leaf items of `request` that every file of it uses: [`RequestError`], what the
//! pipeline reads from a spec ([`Inputs`]), [`IpcMode`], and what the error's messages name
//! (the value length limit, the device values allowed without a container, the size
//! formatters, what an allocation search looked at). It uses nothing else of `request`, so
//! `grammar`, `keys`, `allocation` and `request` itself all take these from here and never
//! from each other's files above them.

use std::collections::HashMap;
use std::fmt;

use oci_spec::runtime::{LinuxDevice, Mount};
use serde::{Deserialize, Serialize};

use crate::device::{quote, DeviceError};

/// The device value meaning "the devices this container was allocated".
pub(crate) const ALLOCATED: &str = "allocated";
/// The CDI kind of gpushare's devices; errors about a CDI device name it as `<kind>=<name>`.
pub(crate) const CDI_KIND: &str = "gpushare.io/gpu";

/// Longest value accepted for any key, in bytes: room for 16 full GPU UUIDs and commas.
pub(crate) const MAX_VALUE_LEN: usize = 1024;
/// What a device key allows where there is no container to take an allocation from
/// (`gpushare daemon start --device`).
pub(super) const NAMED_DEVICE_ALLOWED: &str = "a GPU index like 0, GPU-<uuid>, MIG-<uuid>, <gpu>:<mig> like 0:1, or a comma-separated list of GPU indices and GPU-<uuid>s";

pub(super) const MIB: u64 = 1 << 20;
pub(super) const GIB: u64 = 1 << 30;

/// `24 GiB` for a whole number of GiB, else whole MiB rounded down (`5952 MiB`).
pub(super) fn human_size(bytes: u64) -> String {
    if bytes % GIB == 0 {
        format!("{} GiB", bytes / GIB)
    } else {
        format!("{} MiB", bytes / MIB)
    }
}

/// `24G` for a whole number of GiB, else whole MiB rounded down (`5952M`).
pub(super) fn short_size(bytes: u64) -> String {
    if bytes % GIB == 0 {
        format!("{}G", bytes / GIB)
    } else {
        format_mps_size(bytes)
    }
}

/// The MPS control syntax for a byte count: whole MiB, rounded down, as `<n>M`. Inputs come
/// from [`super::parse_size`], which refuses anything below 1M.
pub(crate) fn format_mps_size(bytes: u64) -> String {
    format!("{}M", bytes / MIB)
}

/// What [`RequestError::NoAllocation`] says was looked at; `env_read`: whether the node
/// accepts `NVIDIA_VISIBLE_DEVICES` (`accept-visible-devices-env`).
pub(super) fn looked_at(env_read: bool) -> &'static str {
    if env_read {
        "no cdi.k8s.io/* annotation names an NVIDIA GPU, no mount from /dev/null is under /var/run/nvidia-container-devices/, linux.devices holds no /dev/nvidia<N> (not read in a privileged container), and NVIDIA_VISIBLE_DEVICES names no device (all, none, void and empty are no allocation)"
    } else {
        "no cdi.k8s.io/* annotation names an NVIDIA GPU, no mount from /dev/null is under /var/run/nvidia-container-devices/, and linux.devices holds no /dev/nvidia<N> (not read in a privileged container); NVIDIA_VISIBLE_DEVICES is not read on this node (accept-visible-devices-env = false)"
    }
}

/// What the request pipeline reads from a container's spec: plain data borrowed from it
/// (`SpecFile::request_inputs`).
#[derive(Debug, Clone, Copy, Default)]
pub struct Inputs<'a> {
    pub annotations: Option<&'a HashMap<String, String>>,
    /// `process.env`.
    pub env: &'a [String],
    /// `mounts`.
    pub mounts: &'a [Mount],
    /// `linux.devices`.
    pub devices: &'a [LinuxDevice],
    /// `linux.resources.devices` allows every device: a privileged container, which sees
    /// every device node of the host, so its device nodes are no allocation.
    pub all_devices_allowed: bool,
}

impl<'a> Inputs<'a> {
    pub(crate) fn annotation(&self, key: &str) -> Option<&'a str> {
        self.annotations?.get(key).map(String::as_str)
    }
}

/// How the container reaches the MPS server's shared memory.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[serde(rename_all = "lowercase")]
pub enum IpcMode {
    /// The daemon's own shm directory over the container's `/dev/shm`.
    #[default]
    Isolated,
    /// The host IPC namespace and `/dev/shm`, as `docker run --ipc=host`.
    Host,
}

impl fmt::Display for IpcMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Isolated => "isolated",
            Self::Host => "host",
        })
    }
}

/// Errors of request parsing and checking. `key` is the annotation or env name actually used,
/// `value` the raw value as given (quoted and cut when displayed).
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error("{key}={} is invalid: it is {len} bytes long; allowed is at most {MAX_VALUE_LEN} bytes", quote(.value))]
    TooLong {
        key: &'static str,
        value: String,
        len: usize,
    },

    #[error("{key}={} is invalid: allowed is {allowed}", quote(.value))]
    Invalid {
        key: &'static str,
        value: String,
        allowed: &'static str,
    },

    #[error("{key}={} is invalid: {problem}; allowed is {allowed}", quote(.value))]
    Rejected {
        key: &'static str,
        value: String,
        problem: String,
        allowed: &'static str,
    },

    #[error("{key}={} is invalid: a MIG device must stand alone, not in a list", quote(.value))]
    MigInList { key: &'static str, value: String },

    #[error("{key}={} is refused: {ALLOCATED} means the devices allocated to a container, and {what} has no container; allowed is {NAMED_DEVICE_ALLOWED}", quote(.value))]
    AllocatedWithoutContainer {
        key: &'static str,
        value: String,
        /// What was asked to take it (`gpushare daemon start`).
        what: &'static str,
    },

    #[error("{key}={} found no devices allocated to the container: {}; allowed is {ALLOCATED} in a container given GPUs by a device plugin or DRA driver, or devices named explicitly (0, GPU-<uuid>, MIG-<uuid>, 0:1)", quote(.value), looked_at(*.env_read))]
    NoAllocation {
        key: &'static str,
        value: String,
        /// Whether `NVIDIA_VISIBLE_DEVICES` was read (`accept-visible-devices-env`).
        env_read: bool,
    },

    #[error("{key}={} is refused: the container's allocation already carries its allocator's MPS (a mount at {} from {}, {why}), and gpushare never stacks a second MPS on it; allowed is an allocation without the allocator's MPS sharing (device plugin sharing.mps, DRA driver MPS)", quote(.value), quote(.pipe), quote(.mount_source))]
    AllocatorMps {
        key: &'static str,
        value: String,
        /// The mount's destination: an MPS pipe directory.
        pipe: String,
        /// The host side of that mount.
        mount_source: String,
        /// Which pipe directory that is.
        why: &'static str,
    },

    #[error("{key}={} is refused: the sources of the container's allocation disagree ({first}, but {other}), and gpushare never merges them; allowed is an allocation whose sources all name the same devices", quote(.value))]
    AllocationDisagrees {
        key: &'static str,
        value: String,
        /// The first source, what it said and the devices it names.
        first: String,
        /// A source that names other devices.
        other: String,
    },

    #[error("{key}={} cannot use the container's allocation: {source_key}={} {problem}; allowed is {allowed}", quote(.value), quote(.found))]
    AllocationUnreadable {
        key: &'static str,
        value: String,
        /// Where the allocation was read (`AllocationSource::key`).
        source_key: &'static str,
        /// What it said.
        found: String,
        problem: String,
        allowed: &'static str,
    },

    #[error("{key}={} takes the devices allocated to the container", quote(.value))]
    AllocationUnusable {
        key: &'static str,
        value: String,
        /// Boxed: an NVML error inside would make every `RequestError` large.
        #[source]
        source: Box<DeviceError>,
    },

    #[error(transparent)]
    Device(Box<DeviceError>),

    #[error("{key}={} is refused: it asks for something other than the container's CDI device {CDI_KIND}={device} ({what}), whose request is the node's; allowed is no gpushare request key beside a CDI device of gpushare's, or one that repeats what the device asks", quote(.value))]
    BesideCdi {
        key: &'static str,
        value: String,
        /// The CDI device's base name.
        device: String,
        /// What the CDI device asks instead.
        what: String,
    },

    #[error("{key}={} is refused: env requests are disabled by accept-env-requests = false; use the annotation {annotation} instead", quote(.value))]
    EnvDisabled {
        key: &'static str,
        value: String,
        annotation: &'static str,
    },

    #[error("{key}={} exceeds the memory of {device} ({}): allowed is 1M up to {}", quote(.value), human_size(*.memory_bytes), short_size(*.memory_bytes))]
    ExceedsMemory {
        key: &'static str,
        value: String,
        /// The device UUID, or `the smallest of <uuid>, <uuid>` for a GPU list.
        device: String,
        memory_bytes: u64,
    },

    #[error("{key}={} is above this node's {ceiling_key} = {ceiling}; allowed is {min} to {ceiling}", quote(.value))]
    AboveCeiling {
        key: &'static str,
        value: String,
        /// The config key that sets the ceiling.
        ceiling_key: &'static str,
        /// The ceiling in the config's syntax (`50`, `4G`).
        ceiling: String,
        /// The smallest value the key accepts (`1`, `1M`).
        min: String,
    },
}
