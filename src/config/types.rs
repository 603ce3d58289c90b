//! The typed configuration: `Config` and its tables' types, the error every step of
//! loading returns, the built-in defaults, and a limit row's value as the file wrote it
//! (`Written`, which a CDI profile keeps).
//!
//! Invariant: plain data; `raw`, `rows` and `check` take their types from here and this
//! file takes nothing from them, so the module's files depend one way (the module root,
//! which loads and parses, uses them all).

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use crate::request::{KeySpec, ProfileValue};

/// A row's value as the file wrote it: an integer for an integer grammar, a string for a
/// size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Written {
    Integer(u64),
    Text(String),
}

impl Written {
    pub(crate) fn as_profile(&self) -> ProfileValue<'_> {
        match self {
            Written::Integer(v) => ProfileValue::Integer(*v),
            Written::Text(s) => ProfileValue::Text(s),
        }
    }
}

/// Daemons without containers stop after this long, so that short-lived containers with
/// distinct limits cannot leave daemons behind forever.
pub(crate) const DEFAULT_IDLE_TIMEOUT: &str = "5m";

/// `[nri] shim-handlers` by default: the runtime `gpushare install containerd` registers,
/// which the RuntimeClass names.
pub(crate) const DEFAULT_NRI_SHIM_HANDLERS: [&str; 1] = ["gpushare"];

/// `[nri] skip-namespaces` by default: the cluster's own and the GPU Operator's (its Helm
/// chart's and OpenShift's namespaces), whose pods (validators, device plugins) must see
/// their GPU as it is.
pub(crate) const DEFAULT_NRI_SKIP_NAMESPACES: [&str; 3] =
    ["kube-system", "gpu-operator", "nvidia-gpu-operator"];

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid config {path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("invalid config {path}: {key} = {value:?}: {allowed}")]
    Value {
        path: PathBuf,
        key: &'static str,
        value: String,
        allowed: String,
    },
    #[error("invalid config {path}: [cdi.profiles.{name}]: {message}")]
    Profile {
        path: PathBuf,
        name: String,
        message: String,
    },
}

/// How MPS servers are shared between users (docs/design.md, "Identity").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum UserMode {
    /// One unprivileged daemon per (device set, UID, limit profile).
    PerUser,
    /// One root daemon per device set with NVIDIA's multi-user server option.
    MultiUser,
}

/// Which MPS the node's daemons speak (docs/mps.md, "Two backends").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Protocol {
    /// The daemons of `user-mode`: one per (device set, host UID, limit profile), or one
    /// multi-user daemon per device set.
    Legacy,
    /// MPS v3 (driver 615 and later): one root multi-user daemon per device set, one MPS
    /// namespace per container, created and capped before its first process.
    V3,
    /// `v3` where the driver is 615 or later and the control binary speaks it, else
    /// `legacy`: decided per node.
    Auto,
}

/// Whether a v3 container's pinned-memory limit also becomes its cgroup's hard device
/// memory limit (the driver's per-cgroup memory limits, docs/mps.md, "Memory limits").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum CgroupMemoryLimit {
    /// Where the node has them (cgroup v2 with NVIDIA's controller), never on MIG.
    Auto,
    /// Always, on every non-MIG device: a create whose limit cannot be set fails.
    On,
    /// Never.
    Off,
}

/// What a tenant is beside the host UID: which containers of one UID may share a daemon
/// (docs/design.md, "Tenants").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TenantMode {
    /// The host UID alone.
    Uid,
    /// The Kubernetes namespace and the host UID: a daemon per (namespace, UID).
    Namespace,
}

/// Whether MPS limits are enforced by the daemon or only advised to clients.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Limits {
    Enforced,
    Advisory,
}

/// What the NRI plugin's audit does about a container with a request that runs without
/// its adjustment (docs/configuration.md, `[nri] unserved`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum NriUnserved {
    /// Log it, name it in `status`, count it; touch nothing.
    Report,
    /// Also end it: its init process is killed (the kubelet recreates it).
    Evict,
}

/// What the GPU process watcher does about what it finds (docs/configuration.md, `[watch]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum WatchPolicy {
    /// Report every GPU process; touch none.
    Report,
    /// Also stop what escapes enforced limits.
    Act,
}

/// `[watch]`: the GPU process watcher (`gpushare watch`).
#[derive(Debug, Clone, PartialEq)]
pub struct WatchConfig {
    pub policy: WatchPolicy,
    /// How often it lists the GPUs' processes.
    pub interval: Duration,
    /// What an MPS client may use above its pinned limit before it counts as over it:
    /// NVML counts the client's own context, which the limit does not.
    pub memory_margin: u64,
}

/// IPC sharing between the MPS server and its clients (docs/design.md, "IPC").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum IpcConfig {
    Isolated,
    Host,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ShmSize {
    /// Percent of physical memory, passed to tmpfs as `size=N%`.
    Percent(u8),
    Bytes(u64),
}

impl ShmSize {
    /// The tmpfs `size=` option value.
    pub(crate) fn tmpfs_option(&self) -> String {
        match self {
            ShmSize::Percent(p) => format!("{p}%"),
            ShmSize::Bytes(b) => b.to_string(),
        }
    }

    /// The size in bytes: a percentage of the node's physical memory as tmpfs reckons it
    /// (`size=N%` is N % of the RAM the kernel counts), in whole pages.
    pub(crate) fn bytes(&self) -> u64 {
        match self {
            ShmSize::Percent(p) => {
                let ram = nix::sys::sysinfo::sysinfo().map_or(0, |i| i.ram_total());
                (ram / 4096 * u64::from(*p) / 100) * 4096
            }
            ShmSize::Bytes(b) => *b,
        }
    }
}

/// The validated configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// The file this was read from; `None` for built-in defaults.
    pub path: Option<PathBuf>,
    pub low_level_runtime: Vec<String>,
    pub state_dir: PathBuf,
    pub log_file: Option<PathBuf>,
    pub log_level: tracing::Level,
    pub log_format: LogFormat,
    pub accept_env_requests: bool,
    /// What a container without a device key asks for (`default-device`); `None`: nothing,
    /// it passes through.
    pub default_device: Option<crate::request::DefaultDevice>,
    /// Whether a container's own `NVIDIA_VISIBLE_DEVICES` counts as an allocation
    /// (`accept-visible-devices-env`): a pod author can write it, so it is off unless the
    /// node's allocator writes nothing else.
    pub accept_visible_devices_env: bool,
    pub inventory: crate::device::InventorySource,
    /// Where the NVIDIA driver's files are (`driver-root`): `None` for the host's own
    /// paths, else a directory (the GPU Operator's `/run/nvidia/driver`) under which NVML,
    /// the MPS control binary and an MPS server's libraries are looked up (`driver`).
    /// Checked here for its form only: whether it exists is told where it is used, in one
    /// line, so that a driver container that restarts fails creates but never `status`,
    /// `gc` or a poststop hook.
    pub driver_root: Option<PathBuf>,
    /// How long the create path may use the cached NVML inventory (`inventory_cache`);
    /// zero: never.
    pub inventory_cache_ttl: Duration,
    pub mps: MpsConfig,
    /// `[nri] skip-namespaces`: the Kubernetes namespaces whose pods the NRI plugin
    /// leaves alone, from the runtime's own `PodSandbox.namespace`.
    pub nri_skip_namespaces: Vec<String>,
    /// `[nri] audit-interval`: how often the plugin re-audits the unserved containers it
    /// knows of (and, under `evict`, ends them).
    pub nri_audit_interval: Duration,
    /// `[nri] unserved`: report only, or also end what the audit finds.
    pub nri_unserved: NriUnserved,
    /// `[nri] shim-handlers`: the runtime handlers whose containers gpushare's shim serves
    /// (the RuntimeClass's), which the NRI validator lets through unadjusted.
    pub nri_shim_handlers: Vec<String>,
    /// `[cdi.profiles.<name>]`: the named limit profiles `gpushare cdi generate` offers as
    /// CDI devices `<device>-<name>`, by name.
    pub cdi_profiles: std::collections::BTreeMap<String, CdiProfile>,
    pub watch: WatchConfig,
}

/// A named limit profile (`[cdi.profiles.<name>]`): the limits a CDI device `<dev>-<name>`
/// asks for, kept as written (the request pipeline parses them as it parses a request's).
/// At least one is set; each is valid and within the `[mps]` ceilings. Its keys are the
/// limit rows' names (`request::profile_keys`), read by `rows`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CdiProfile {
    pub(super) limits: Vec<(&'static KeySpec, Written)>,
}

impl CdiProfile {
    /// The limits the profile sets, in the rows' order, as written.
    pub(crate) fn limits(&self) -> Vec<(&'static KeySpec, ProfileValue<'_>)> {
        crate::request::profile_keys()
            .filter_map(|key| {
                let (_, value) = self.limits.iter().find(|(k, _)| *k == key)?;
                Some((key, value.as_profile()))
            })
            .collect()
    }
}

/// Longest profile name.
pub(super) const MAX_PROFILE_NAME: usize = 32;
/// What a profile name may be: it becomes the suffix of CDI device names (`0-<name>`).
pub(crate) const PROFILE_NAME_ALLOWED: &str =
    "1 to 32 lowercase letters and digits, starting with a letter, not \"mig\"";

/// Whether `name` may name a CDI profile ([`PROFILE_NAME_ALLOWED`]): no `-`, so that a
/// device name splits at its last `-` only where a profile begins, and not `mig`, which
/// would read as a MIG device (`1-mig-0`).
pub(crate) fn valid_profile_name(name: &str) -> bool {
    (1..=MAX_PROFILE_NAME).contains(&name.len())
        && name.starts_with(|c: char| c.is_ascii_lowercase())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        && name != "mig"
}

/// The node's default for each numeric request key that has one, by row.
pub(crate) type Defaults = Vec<(&'static KeySpec, u64)>;

#[derive(Debug, Clone, PartialEq)]
pub struct MpsConfig {
    pub control_binary: String,
    /// Which MPS the daemons speak (`mps.protocol`).
    pub protocol: Protocol,
    /// Whether a v3 container's pinned-memory limit is also its cgroup's hard device
    /// memory limit (`mps.cgroup-memory-limit`), and the `nvidia-smi` that sets it.
    pub cgroup_memory_limit: CgroupMemoryLimit,
    pub nvidia_smi: String,
    pub user_mode: UserMode,
    pub tenant: TenantMode,
    pub multi_user_flag: String,
    pub limits: Limits,
    pub ipc: IpcConfig,
    pub allow_ipc_override: bool,
    pub container_pipe_dir: PathBuf,
    pub container_log_dir: Option<PathBuf>,
    pub shm_size: ShmSize,
    /// Bounds on the sum of the shm tmpfs sizes of one host UID's daemons, and of every
    /// daemon on the node (`None`: no bound), counted when a new daemon is admitted.
    pub shm_size_per_uid: Option<ShmSize>,
    pub shm_size_total: Option<ShmSize>,
    pub start_timeout: Duration,
    pub idle_timeout: Duration,
    /// The node's defaults for the numeric request keys (the rows' `default_key`), by row;
    /// a key not listed has none. Read through [`MpsConfig::default_for`].
    pub(crate) defaults: Defaults,
    /// The operator's ceilings (the rows' `ceiling_key`): requests above them are refused.
    pub(crate) ceilings: crate::request::Ceilings,
    /// The group every per-user daemon runs as; `None`: the group numbered like its UID.
    /// Never the container's group (a container's `disk` or `video` must not reach a
    /// daemon that sees the host).
    pub daemon_gid: Option<u32>,
    /// At most this many daemons on the node, and per host UID.
    pub max_daemons: u32,
    pub max_daemons_per_uid: u32,
    /// Size of each daemon's log tmpfs (control.log and friends); the supervisor rotates
    /// a log that passes a quarter of it (keeping its last part in `<name>.1`).
    pub log_size: u64,
    /// How often the supervisor checks that the daemon's limits are still the enforced
    /// ones (a tenant can send control commands through its socket).
    pub limit_check_interval: Duration,
    /// cgroup limits of each supervisor with its daemon and servers (0: no limit).
    pub daemon_memory_max: u64,
    pub daemon_pids_max: u32,
}

impl MpsConfig {
    /// The configured IPC mode, in the request's terms.
    pub(crate) fn ipc_mode(&self) -> crate::request::IpcMode {
        match self.ipc {
            IpcConfig::Isolated => crate::request::IpcMode::Isolated,
            IpcConfig::Host => crate::request::IpcMode::Host,
        }
    }

    /// The node's default for a numeric request key (the row's `default_key`), if it sets
    /// one.
    pub(crate) fn default_for(&self, key: &KeySpec) -> Option<u64> {
        self.defaults
            .iter()
            .find(|(k, _)| *k == key)
            .map(|&(_, v)| v)
    }

    /// The operator's ceilings on the numeric request keys (the rows' `ceiling_key`).
    pub(crate) fn ceilings(&self) -> &crate::request::Ceilings {
        &self.ceilings
    }

    /// How long a container record written by the shim (create pending, no pid yet) keeps
    /// its daemon from idling: a create that has not reached the hook by then has failed.
    pub(crate) fn pending_grace(&self) -> Duration {
        self.start_timeout * 2 + Duration::from_secs(30)
    }
}
