//! The configuration file (`/etc/gpushare/runtime.toml`, or `$GPUSHARE_CONFIG`).
//!
//! Invariants: keys are kebab-case and an unknown key is an error naming it; a missing
//! file at the default location means the built-in defaults (which equal the documented
//! `config/runtime.toml`), while a missing file named by `GPUSHARE_CONFIG` is an error.
//! Every value is validated here, once, so the rest of the program works with typed data.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::request::KeySpec;
use crate::request::Number;
use crate::request::ProfileValue;

mod rows;

/// Where the configuration is read from when `GPUSHARE_CONFIG` is not set.
pub(crate) const DEFAULT_PATH: &str = "/etc/gpushare/runtime.toml";
/// Environment variable naming another configuration file.
pub(crate) const ENV_VAR: &str = "GPUSHARE_CONFIG";
/// Daemons without containers stop after this long, so that short-lived containers with
/// distinct limits cannot leave daemons behind forever.
pub(crate) const DEFAULT_IDLE_TIMEOUT: &str = "5m";

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
    limits: Vec<(&'static KeySpec, rows::Written)>,
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
const MAX_PROFILE_NAME: usize = 32;
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

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct RawConfig {
    low_level_runtime: Option<Vec<String>>,
    state_dir: Option<String>,
    log_file: Option<String>,
    log_level: Option<String>,
    log_format: Option<LogFormat>,
    accept_env_requests: Option<bool>,
    default_device: Option<String>,
    accept_visible_devices_env: Option<bool>,
    inventory: Option<String>,
    inventory_cache_ttl: Option<String>,
    driver_root: Option<String>,
    #[serde(default)]
    mps: RawMps,
    #[serde(default)]
    cdi: RawCdi,
    #[serde(default)]
    watch: RawWatch,
    #[serde(default)]
    nri: RawNri,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct RawWatch {
    policy: Option<WatchPolicy>,
    interval: Option<String>,
    memory_margin: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct RawNri {
    skip_namespaces: Option<Vec<String>>,
}

/// `[nri] skip-namespaces` by default: the cluster's own and the GPU Operator's (its Helm
/// chart's and OpenShift's namespaces), whose pods (validators, device plugins) must see
/// their GPU as it is.
pub(crate) const DEFAULT_NRI_SKIP_NAMESPACES: [&str; 3] =
    ["kube-system", "gpu-operator", "nvidia-gpu-operator"];

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct RawCdi {
    #[serde(default)]
    profiles: std::collections::BTreeMap<String, CdiProfile>,
}

/// `[mps]`: its own keys, and the rows' default and ceiling keys (`rows`).
#[derive(Default)]
struct RawMps {
    fields: MpsFields,
    /// The rows' keys that are set, by config key (`mps.<name>`), as written.
    rows: Vec<(&'static str, rows::Written)>,
}

/// `[mps]`'s own keys. Unknown keys are refused by `rows` (whose line lists these and the
/// rows' keys); `deny_unknown_fields` stays as the derive's own guard.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct MpsFields {
    control_binary: Option<String>,
    user_mode: Option<UserMode>,
    tenant: Option<TenantMode>,
    multi_user_flag: Option<String>,
    limits: Option<Limits>,
    ipc: Option<IpcConfig>,
    allow_ipc_override: Option<bool>,
    container_pipe_dir: Option<String>,
    container_log_dir: Option<String>,
    shm_size: Option<String>,
    shm_size_per_uid: Option<String>,
    shm_size_total: Option<String>,
    start_timeout: Option<String>,
    idle_timeout: Option<String>,
    daemon_gid: Option<u32>,
    max_daemons: Option<u32>,
    max_daemons_per_uid: Option<u32>,
    log_size: Option<String>,
    limit_check_interval: Option<String>,
    daemon_memory_max: Option<String>,
    daemon_pids_max: Option<u32>,
}

/// The configuration file to read: `$GPUSHARE_CONFIG` if set, else the default path.
/// The flag says whether the file must exist.
pub(crate) fn location() -> (PathBuf, bool) {
    match std::env::var_os(ENV_VAR) {
        // Absolute, so that processes started elsewhere (supervisors run in `/`) read the
        // same file.
        Some(p) if !p.is_empty() => {
            let p = PathBuf::from(p);
            (std::path::absolute(&p).unwrap_or(p), true)
        }
        _ => (PathBuf::from(DEFAULT_PATH), false),
    }
}

/// Loads and validates the configuration from its usual location.
pub(crate) fn load() -> Result<Config, ConfigError> {
    let (path, required) = location();
    load_from(&path, required)
}

/// Loads `path`; when it does not exist and `required` is false, the defaults apply.
pub(crate) fn load_from(path: &Path, required: bool) -> Result<Config, ConfigError> {
    match std::fs::read_to_string(path) {
        Ok(text) => parse(&text, Some(path)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && !required => parse("", None),
        Err(source) => Err(ConfigError::Read {
            path: path.to_owned(),
            source,
        }),
    }
}

/// Only the low-level runtime candidates: the one setting the shim needs for commands
/// it passes through untouched. Reads nothing but this key, so a passthrough costs one
/// small file read.
pub(crate) fn low_level_runtime() -> Result<Vec<String>, ConfigError> {
    fast_path().map(|f| f.low_level_runtime)
}

/// The settings the shim's no-request path reads, from one file read: the low-level
/// runtime, and whether `default-device` is set (then a spec whose bytes spell no request
/// may still hold an allocation that is one). Its value is judged by [`load`], on the
/// path that uses it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct FastPath {
    pub low_level_runtime: Vec<String>,
    pub default_device: bool,
}

/// Reads [`FastPath`]'s keys from the usual location and nothing else.
pub(crate) fn fast_path() -> Result<FastPath, ConfigError> {
    let (path, required) = location();
    fast_path_from(&path, required)
}

/// [`fast_path`] from `path`; when it does not exist and `required` is false, the defaults.
pub(crate) fn fast_path_from(path: &Path, required: bool) -> Result<FastPath, ConfigError> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && !required => {
            return Ok(FastPath {
                low_level_runtime: default_runtimes(),
                default_device: false,
            })
        }
        Err(source) => {
            return Err(ConfigError::Read {
                path: path.to_owned(),
                source,
            })
        }
    };
    #[derive(Deserialize)]
    #[serde(rename_all = "kebab-case")]
    struct Only {
        low_level_runtime: Option<Vec<String>>,
        default_device: Option<serde::de::IgnoredAny>,
    }
    let only: Only = toml::from_str(&text).map_err(|e| ConfigError::Parse {
        path: path.to_owned(),
        message: crate::util::one_line(&e.to_string()),
    })?;
    let list = only.low_level_runtime.unwrap_or_else(default_runtimes);
    check_runtimes(path, &list)?;
    Ok(FastPath {
        low_level_runtime: list,
        default_device: only.default_device.is_some(),
    })
}

fn default_runtimes() -> Vec<String> {
    vec!["runc".into(), "crun".into()]
}

fn check_runtimes(path: &Path, list: &[String]) -> Result<(), ConfigError> {
    if list.is_empty() || list.iter().any(|r| r.is_empty() || r.contains('\0')) {
        return Err(ConfigError::Value {
            path: path.to_owned(),
            key: "low-level-runtime",
            value: format!("{list:?}"),
            allowed: "a non-empty list of runtime names on PATH or absolute paths".into(),
        });
    }
    Ok(())
}

/// Parses configuration text; `path` is only used in messages and recorded in the result.
pub fn parse(text: &str, path: Option<&Path>) -> Result<Config, ConfigError> {
    let shown = path
        .map(Path::to_owned)
        .unwrap_or_else(|| PathBuf::from("<defaults>"));
    let raw: RawConfig = toml::from_str(text).map_err(|e| ConfigError::Parse {
        path: shown.clone(),
        message: crate::util::one_line(&e.to_string()),
    })?;
    let check = Check { path: shown };

    let low_level_runtime = raw.low_level_runtime.unwrap_or_else(default_runtimes);
    check_runtimes(&check.path, &low_level_runtime)?;
    let state_dir = check.abs(
        "state-dir",
        raw.state_dir.as_deref().unwrap_or("/run/gpushare"),
    )?;
    let log_file = check.log_file(raw.log_file.as_deref())?;
    let log_level = check.log_level(raw.log_level.as_deref().unwrap_or("info"))?;
    let default_device = check.default_device(raw.default_device.as_deref())?;
    let inventory = check.inventory(raw.inventory.as_deref().unwrap_or("nvml"))?;
    let inventory_cache_ttl = check.duration(
        "inventory-cache-ttl",
        raw.inventory_cache_ttl.as_deref().unwrap_or("30s"),
        |d| d <= Duration::from_secs(3600),
        "a duration up to 1h such as \"30s\", or \"0\" to load the NVML inventory on every create",
    )?;
    let driver_root = check.driver_root(raw.driver_root.as_deref().unwrap_or(""))?;

    let mps = check.mps(&raw.mps)?;
    let cdi_profiles = check.cdi_profiles(raw.cdi.profiles, &mps)?;
    let nri_skip_namespaces = check.namespaces("nri.skip-namespaces", raw.nri.skip_namespaces)?;
    Ok(Config {
        path: path.map(Path::to_owned),
        low_level_runtime,
        state_dir,
        log_file,
        log_level,
        log_format: raw.log_format.unwrap_or(LogFormat::Text),
        accept_env_requests: raw.accept_env_requests.unwrap_or(true),
        default_device,
        accept_visible_devices_env: raw.accept_visible_devices_env.unwrap_or(false),
        inventory,
        inventory_cache_ttl,
        driver_root,
        mps,
        cdi_profiles,
        watch: check.watch(&raw.watch)?,
        nri_skip_namespaces,
    })
}

impl RawMps {
    /// The value of a row's `default_key` or `ceiling_key` (`mps.<name>`), as written.
    fn number(&self, config_key: &str) -> Option<ProfileValue<'_>> {
        let (_, value) = self.rows.iter().find(|(k, _)| *k == config_key)?;
        Some(value.as_profile())
    }
}

/// The checks of one config file's values: each refusal is a `ConfigError::Value` naming
/// the file, the key, the value and what is allowed.
struct Check {
    /// The file, or `<defaults>`.
    path: PathBuf,
}

impl Check {
    fn bad(&self, key: &'static str, value: &str, allowed: &str) -> ConfigError {
        ConfigError::Value {
            path: self.path.clone(),
            key,
            value: value.to_owned(),
            allowed: allowed.to_owned(),
        }
    }

    /// An absolute path without `..`.
    fn abs(&self, key: &'static str, value: &str) -> Result<PathBuf, ConfigError> {
        let p = PathBuf::from(value);
        if !p.is_absolute() || value.contains('\0') || p.components().any(|c| c.as_os_str() == "..")
        {
            return Err(self.bad(key, value, "an absolute path without '..'"));
        }
        Ok(p)
    }

    /// A duration (`parse_duration`) that `ok` accepts; `allowed` says which.
    fn duration(
        &self,
        key: &'static str,
        value: &str,
        ok: impl Fn(Duration) -> bool,
        allowed: &'static str,
    ) -> Result<Duration, ConfigError> {
        parse_duration(value)
            .filter(|d| ok(*d))
            .ok_or_else(|| self.bad(key, value, allowed))
    }

    /// A size with a unit, in bytes.
    fn size(&self, key: &'static str, value: &str) -> Result<u64, ConfigError> {
        crate::request::parse_size(key, value)
            .map_err(|_| self.bad(key, value, "a size with a unit, like 512M or 4G"))
    }

    /// A count of at least 1, `default` when unset.
    fn count(
        &self,
        key: &'static str,
        value: Option<u32>,
        default: u32,
    ) -> Result<u32, ConfigError> {
        let v = value.unwrap_or(default);
        if v == 0 {
            return Err(self.bad(key, "0", "an integer of at least 1"));
        }
        Ok(v)
    }

    /// `log-file`: the default file when unset, none when empty.
    fn log_file(&self, value: Option<&str>) -> Result<Option<PathBuf>, ConfigError> {
        match value {
            None => Ok(Some(PathBuf::from("/var/log/gpushare.log"))),
            Some("") => Ok(None),
            Some(s) => Ok(Some(self.abs("log-file", s)?)),
        }
    }

    fn log_level(&self, value: &str) -> Result<tracing::Level, ConfigError> {
        // The five names only: tracing would also take digits and any case.
        ["error", "warn", "info", "debug", "trace"]
            .contains(&value)
            .then(|| value.parse::<tracing::Level>().ok())
            .flatten()
            .ok_or_else(|| self.bad("log-level", value, "one of error, warn, info, debug, trace"))
    }

    fn default_device(
        &self,
        value: Option<&str>,
    ) -> Result<Option<crate::request::DefaultDevice>, ConfigError> {
        match value {
            None => Ok(None),
            Some(crate::request::ALLOCATED) => Ok(Some(crate::request::DefaultDevice::Allocated)),
            Some(other) => Err(self.bad(
                crate::request::DEFAULT_DEVICE_KEY,
                other,
                "\"allocated\" (the devices a device plugin or DRA driver allocated to the container), or unset",
            )),
        }
    }

    /// A list of Kubernetes namespace names (RFC 1123 labels: at most 63 lowercase letters,
    /// digits and `-`, a letter or digit at each end); `None`: the defaults.
    fn namespaces(
        &self,
        key: &'static str,
        list: Option<Vec<String>>,
    ) -> Result<Vec<String>, ConfigError> {
        let Some(list) = list else {
            return Ok(DEFAULT_NRI_SKIP_NAMESPACES.map(String::from).to_vec());
        };
        for name in &list {
            let edge =
                |c: Option<char>| c.is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
            if name.len() > 63
                || !edge(name.chars().next())
                || !edge(name.chars().last())
                || !name
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
            {
                return Err(self.bad(
                    key,
                    name,
                    "a list of Kubernetes namespace names (at most 63 lowercase letters, digits and -, starting and ending with a letter or digit), [] for none",
                ));
            }
        }
        Ok(list)
    }

    /// `driver-root`: `""` for the host's own paths, else an absolute path without `..`
    /// (and not `/`, which is the host's own paths spelled another way).
    fn driver_root(&self, value: &str) -> Result<Option<PathBuf>, ConfigError> {
        if value.is_empty() {
            return Ok(None);
        }
        let root = self
            .abs("driver-root", value)
            .ok()
            .filter(|p| p.parent().is_some())
            .ok_or_else(|| {
                self.bad(
                    "driver-root",
                    value,
                    "\"\" (the host's own paths) or an absolute path without '..' other than \"/\", like \"/run/nvidia/driver\"",
                )
            })?;
        Ok(Some(root))
    }

    fn inventory(&self, value: &str) -> Result<crate::device::InventorySource, ConfigError> {
        crate::device::InventorySource::parse(value)
            .map_err(|_| self.bad("inventory", value, "\"nvml\" or \"file:<absolute path>\""))
    }

    /// `[mps]`, its keys checked one after the other: the first bad one is the error.
    fn mps(&self, raw: &RawMps) -> Result<MpsConfig, ConfigError> {
        let m = &raw.fields;
        let control_binary = self.control_binary(m.control_binary.as_deref())?;
        let multi_user_flag = self.multi_user_flag(m.multi_user_flag.as_deref().unwrap_or("-M"))?;
        let container_pipe_dir = self.abs(
            "mps.container-pipe-dir",
            m.container_pipe_dir.as_deref().unwrap_or("/tmp/nvidia-mps"),
        )?;
        let container_log_dir = m
            .container_log_dir
            .as_deref()
            .map(|s| self.abs("mps.container-log-dir", s))
            .transpose()?;
        let shm_size = self.shm_size("mps.shm-size", m.shm_size.as_deref().unwrap_or("1G"))?;
        let shm_size_per_uid = self.shm_bound(
            "mps.shm-size-per-uid",
            m.shm_size_per_uid.as_deref().unwrap_or("8G"),
        )?;
        let shm_size_total = self.shm_bound(
            "mps.shm-size-total",
            m.shm_size_total.as_deref().unwrap_or("25%"),
        )?;
        let start_timeout = self.start_timeout(m.start_timeout.as_deref().unwrap_or("10s"))?;
        let idle_timeout =
            self.idle_timeout(m.idle_timeout.as_deref().unwrap_or(DEFAULT_IDLE_TIMEOUT))?;
        let (defaults, ceilings) = self.client_limits(raw)?;
        let max_daemons = self.count("mps.max-daemons", m.max_daemons, 64)?;
        let max_daemons_per_uid =
            self.count("mps.max-daemons-per-uid", m.max_daemons_per_uid, 8)?;
        let log_size = self.log_size(m.log_size.as_deref().unwrap_or("16M"))?;
        let limit_check_interval =
            self.limit_check_interval(m.limit_check_interval.as_deref().unwrap_or("2s"))?;
        let daemon_memory_max = self.daemon_memory_max(m.daemon_memory_max.as_deref())?;
        let user_mode = m.user_mode.unwrap_or(UserMode::PerUser);
        let tenant = m.tenant.unwrap_or(TenantMode::Uid);
        if tenant == TenantMode::Namespace && user_mode == UserMode::MultiUser {
            // One multi-user server per namespace would be several root daemons on one
            // device, which EXCLUSIVE_PROCESS (multi-user mode's setup) cannot run at once.
            return Err(self.bad(
                "mps.tenant",
                "namespace",
                "\"uid\" under user-mode = \"multi-user\" (one server for every tenant of a device, by design); \"namespace\" needs user-mode = \"per-user\"",
            ));
        }
        Ok(MpsConfig {
            control_binary,
            user_mode,
            tenant,
            multi_user_flag,
            limits: m.limits.unwrap_or(Limits::Enforced),
            ipc: m.ipc.unwrap_or(IpcConfig::Isolated),
            allow_ipc_override: m.allow_ipc_override.unwrap_or(false),
            container_pipe_dir,
            container_log_dir,
            shm_size,
            shm_size_per_uid,
            shm_size_total,
            start_timeout,
            idle_timeout,
            defaults,
            ceilings,
            daemon_gid: m.daemon_gid,
            max_daemons,
            max_daemons_per_uid,
            log_size,
            limit_check_interval,
            daemon_memory_max,
            daemon_pids_max: m.daemon_pids_max.unwrap_or(1024),
        })
    }

    /// `[cdi.profiles.*]`: each name valid, at least one limit, each limit valid and
    /// within the `[mps]` ceilings (a profile is the node's own request, so it is held to
    /// what a container's would be).
    fn cdi_profiles(
        &self,
        profiles: std::collections::BTreeMap<String, CdiProfile>,
        mps: &MpsConfig,
    ) -> Result<std::collections::BTreeMap<String, CdiProfile>, ConfigError> {
        for (name, p) in &profiles {
            let bad = |message: String| ConfigError::Profile {
                path: self.path.clone(),
                name: crate::util::escape(name).chars().take(64).collect(),
                message,
            };
            if !valid_profile_name(name) {
                return Err(bad(format!(
                    "the name is invalid: allowed is {PROFILE_NAME_ALLOWED}"
                )));
            }
            let limits = p.limits();
            if limits.is_empty() {
                let names: Vec<&str> = crate::request::profile_keys().map(|k| k.name).collect();
                let allowed = match names.as_slice() {
                    [a, b] => format!("{a}, {b} or both"),
                    _ => format!("one or more of {}", names.join(", ")),
                };
                return Err(bad(format!("sets no limit: allowed is {allowed}")));
            }
            for (key, raw) in limits {
                let Some(number) = key.number() else {
                    continue;
                };
                let value = match raw {
                    ProfileValue::Integer(v) => {
                        if !number.allows(v) {
                            return Err(bad(format!(
                                "{} = {v}: allowed is {}",
                                key.name,
                                number.allowed()
                            )));
                        }
                        v
                    }
                    ProfileValue::Text(raw) => number
                        .parse(key.name, raw)
                        .map_err(|e| bad(e.to_string()))?,
                };
                let ceiling = mps.ceilings.0.iter().find(|(k, _)| *k == key);
                if let Some(&(_, max)) = ceiling.filter(|(_, max)| value > *max) {
                    let written = match raw {
                        ProfileValue::Integer(v) => v.to_string(),
                        ProfileValue::Text(raw) => format!("{raw:?}"),
                    };
                    let ceiling_key = key.ceiling_key.unwrap_or_default();
                    let max = match number {
                        Number::Size => format!("({} MiB)", max >> 20),
                        Number::Integer { .. } => format!("= {max}"),
                    };
                    return Err(bad(format!(
                        "{} = {written} is above {ceiling_key} {max}",
                        key.name
                    )));
                }
            }
        }
        Ok(profiles)
    }

    fn control_binary(&self, value: Option<&str>) -> Result<String, ConfigError> {
        let binary = value.unwrap_or("nvidia-cuda-mps-control");
        if binary.is_empty() || binary.contains('\0') {
            return Err(self.bad(
                "mps.control-binary",
                binary,
                "a program name on PATH or an absolute path",
            ));
        }
        Ok(binary.to_owned())
    }

    fn multi_user_flag(&self, value: &str) -> Result<String, ConfigError> {
        if !value.starts_with('-') || value.contains(char::is_whitespace) {
            return Err(self.bad(
                "mps.multi-user-flag",
                value,
                "a single option such as \"-M\" or \"-multiuser-server\"",
            ));
        }
        Ok(value.to_owned())
    }

    fn shm_size(&self, key: &'static str, value: &str) -> Result<ShmSize, ConfigError> {
        parse_shm_size(value).ok_or_else(|| {
            self.bad(
                key,
                value,
                "a percentage of memory like \"25%\" or a size like \"2G\"",
            )
        })
    }

    /// `mps.shm-size-per-uid`, `mps.shm-size-total`: a size or a percentage, `"0"` for no
    /// bound.
    fn shm_bound(&self, key: &'static str, value: &str) -> Result<Option<ShmSize>, ConfigError> {
        if value == "0" {
            return Ok(None);
        }
        parse_shm_size(value).map(Some).ok_or_else(|| {
            self.bad(
                key,
                value,
                "a percentage of memory like \"25%\", a size like \"8G\", or \"0\" for no bound",
            )
        })
    }

    fn start_timeout(&self, value: &str) -> Result<Duration, ConfigError> {
        self.duration(
            "mps.start-timeout",
            value,
            |d| !d.is_zero() && d <= Duration::from_secs(300),
            "a duration from 1ms to 300s, like \"10s\" or \"500ms\"",
        )
    }

    fn idle_timeout(&self, value: &str) -> Result<Duration, ConfigError> {
        self.duration(
            "mps.idle-timeout",
            value,
            |_| true,
            "a duration like \"10m\", or \"0\" for never",
        )
    }

    fn watch(&self, w: &RawWatch) -> Result<WatchConfig, ConfigError> {
        Ok(WatchConfig {
            policy: w.policy.unwrap_or(WatchPolicy::Report),
            interval: self.duration(
                "watch.interval",
                w.interval.as_deref().unwrap_or("5s"),
                |d| d >= Duration::from_millis(500) && d <= Duration::from_secs(300),
                "a duration from 500ms to 5m, like \"5s\"",
            )?,
            memory_margin: match w.memory_margin.as_deref() {
                None => 512 << 20,
                Some("0") => 0,
                Some(s) => self.size("watch.memory-margin", s)?,
            },
        })
    }

    fn limit_check_interval(&self, value: &str) -> Result<Duration, ConfigError> {
        self.duration(
            "mps.limit-check-interval",
            value,
            |d| d >= Duration::from_millis(100) && d <= Duration::from_secs(60),
            "a duration from 100ms to 60s, like \"2s\"",
        )
    }

    /// `mps.daemon-memory-max`: 4G when unset, `0` for no limit.
    fn daemon_memory_max(&self, value: Option<&str>) -> Result<u64, ConfigError> {
        match value {
            None => Ok(4 << 30),
            Some("0") => Ok(0),
            Some(s) => self.size("mps.daemon-memory-max", s),
        }
    }

    /// The default limits and the ceilings (the rows' `default_key` and `ceiling_key`),
    /// each default at most its ceiling. Every default is read before the ceilings, each
    /// ceiling then compared with its default.
    fn client_limits(
        &self,
        m: &RawMps,
    ) -> Result<(Defaults, crate::request::Ceilings), ConfigError> {
        let mut defaults = Vec::new();
        for (key, number) in crate::request::numeric() {
            if let Some(value) = self.limit(m, key.default_key, number)? {
                defaults.push((key, value));
            }
        }
        let mut ceilings = Vec::new();
        for (key, number) in crate::request::numeric() {
            let Some(max) = self.limit(m, key.ceiling_key, number)? else {
                continue;
            };
            if let (Some(&(_, d)), Some(default_key)) =
                (defaults.iter().find(|(k, _)| *k == key), key.default_key)
            {
                if d > max {
                    let ceiling_key = key.ceiling_key.unwrap_or_default();
                    return Err(self.bad(
                        default_key,
                        &d.to_string(),
                        &format!("at most {ceiling_key}"),
                    ));
                }
            }
            ceilings.push((key, max));
        }
        Ok((defaults, crate::request::Ceilings(ceilings)))
    }

    /// The value of a numeric request key's config key `config_key`, checked against the
    /// key's grammar, when set.
    fn limit(
        &self,
        m: &RawMps,
        config_key: Option<&'static str>,
        number: Number,
    ) -> Result<Option<u64>, ConfigError> {
        let Some(config_key) = config_key else {
            return Ok(None);
        };
        match m.number(config_key) {
            None => Ok(None),
            Some(ProfileValue::Integer(p)) => number
                .parse(config_key, &p.to_string())
                .map(Some)
                .map_err(|_| self.bad(config_key, &p.to_string(), number.allowed())),
            Some(ProfileValue::Text(s)) => number
                .parse(config_key, s)
                .map(Some)
                .map_err(|_| self.bad(config_key, s, number.config_allowed())),
        }
    }

    /// `mps.log-size`: at least 1M, room for the daemon's logs and their rotations.
    fn log_size(&self, value: &str) -> Result<u64, ConfigError> {
        let log_size = self.size("mps.log-size", value)?;
        if log_size < 1 << 20 {
            return Err(self.bad("mps.log-size", value, "a size of at least 1M"));
        }
        Ok(log_size)
    }
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

fn parse_shm_size(s: &str) -> Option<ShmSize> {
    if let Some(p) = s.strip_suffix('%') {
        let p: u8 = p.parse().ok()?;
        return (1..=100).contains(&p).then_some(ShmSize::Percent(p));
    }
    crate::request::parse_size("mps.shm-size", s)
        .ok()
        .map(ShmSize::Bytes)
}

/// `"10s"`, `"500ms"`, `"5m"`, `"1h"`, or `"0"`. Not humantime's parser: it reads every
/// one of these the same, but it also takes `"1M"` as a month (in a file where `"1M"` is a
/// size of 1 MiB), `"1.5h"`, `"1h 30m"`, `" 10s"` and microseconds, all refused here.
pub(crate) fn parse_duration(s: &str) -> Option<Duration> {
    if s == "0" {
        return Some(Duration::ZERO);
    }
    let split = s.find(|c: char| !c.is_ascii_digit())?;
    let (num, unit) = s.split_at(split);
    let n: u64 = num.parse().ok()?;
    match unit {
        "ms" => Some(Duration::from_millis(n)),
        "s" => Some(Duration::from_secs(n)),
        "m" => n.checked_mul(60).map(Duration::from_secs),
        "h" => n.checked_mul(3600).map(Duration::from_secs),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_match_the_documented_file() {
        let shipped = include_str!("../config/runtime.toml");
        let from_file = parse(shipped, None).expect("shipped config parses");
        let defaults = parse("", None).expect("empty config parses");
        assert_eq!(from_file, defaults);
    }

    #[test]
    fn cdi_profiles_are_named_limits_within_the_ceilings() {
        let cfg = parse(
            "[mps]\nmax-active-thread-percentage = 50\n[cdi.profiles.small]\nactive-thread-percentage = 25\n[cdi.profiles.mem4]\npinned-memory-limit = \"4G\"\n",
            None,
        )
        .expect("profiles");
        assert_eq!(
            cfg.cdi_profiles.keys().collect::<Vec<_>>(),
            ["mem4", "small"]
        );
        assert_eq!(
            cfg.cdi_profiles["small"].limits(),
            [(
                &crate::request::ACTIVE_THREAD_PERCENTAGE,
                ProfileValue::Integer(25)
            )]
        );
        for (text, want) in [
            ("[cdi.profiles.Big]\nactive-thread-percentage = 5", "[cdi.profiles.Big]: the name is invalid: allowed is 1 to 32 lowercase letters"),
            ("[cdi.profiles.mig]\nactive-thread-percentage = 5", "[cdi.profiles.mig]: the name is invalid"),
            ("[cdi.profiles.a-b]\nactive-thread-percentage = 5", "[cdi.profiles.a-b]: the name is invalid"),
            ("[cdi.profiles.none]\n", "[cdi.profiles.none]: sets no limit"),
            ("[cdi.profiles.p]\nactive-thread-percentage = 0", "active-thread-percentage = 0: allowed is an integer from 1 to 100"),
            ("[cdi.profiles.p]\npinned-memory-limit = \"4\"", "pinned-memory-limit=\"4\" is invalid"),
            ("[mps]\nmax-active-thread-percentage = 50\n[cdi.profiles.p]\nactive-thread-percentage = 60", "above mps.max-active-thread-percentage = 50"),
            ("[mps]\nmax-pinned-memory-limit = \"2G\"\n[cdi.profiles.p]\npinned-memory-limit = \"4G\"", "above mps.max-pinned-memory-limit"),
            ("[cdi.profiles.p]\nthreads = 5", "threads"),
        ] {
            let err = parse(text, None).expect_err(text).to_string();
            assert!(err.contains(want), "{text}: {err}");
            assert!(!err.contains('\n'), "{err}");
        }
    }

    /// Every row's `default_key`, `ceiling_key` and profile key is read: set each to the
    /// key's smallest value, written as the config writes it, and find it back by row. A
    /// row whose config key the serde structs lack fails here, not silently at a node.
    #[test]
    fn every_rows_config_keys_are_read() {
        let mut mps = String::from("[mps]\n");
        let mut profile = String::from("[cdi.profiles.p]\n");
        let min = |number: Number| match number {
            Number::Integer { min, .. } => min,
            Number::Size => crate::request::parse_size("k", &number.min_text()).unwrap(),
        };
        let toml = |number: Number| match number {
            Number::Integer { .. } => number.config_text(min(number)),
            Number::Size => format!("{:?}", number.config_text(min(number))),
        };
        for (key, number) in crate::request::numeric() {
            for config_key in [key.default_key, key.ceiling_key].into_iter().flatten() {
                let name = config_key.strip_prefix("mps.").expect("an [mps] key");
                mps.push_str(&format!("{name} = {}\n", toml(number)));
            }
        }
        for key in crate::request::profile_keys() {
            let number = key.number().expect("numeric");
            profile.push_str(&format!("{} = {}\n", key.name, toml(number)));
        }
        let cfg = parse(&(mps + &profile), None).unwrap();
        for (key, number) in crate::request::numeric() {
            let want = key.default_key.map(|_| min(number));
            assert_eq!(cfg.mps.default_for(key), want, "{}", key.name);
            let ceiling = cfg.mps.ceilings().0.iter().find(|(k, _)| *k == key);
            let want = key.ceiling_key.map(|_| (key, min(number)));
            assert_eq!(ceiling.copied(), want, "{}", key.name);
        }
        let limits = cfg.cdi_profiles["p"].limits();
        let read: Vec<_> = limits.iter().map(|(k, _)| k.name).collect();
        let rows: Vec<_> = crate::request::profile_keys().map(|k| k.name).collect();
        assert_eq!(read, rows);
    }

    /// An unknown key's line lists every key its table takes, the rows' among them, once
    /// each: every numeric row's default and ceiling key under `[mps]` beside `[mps]`'s own
    /// keys, and every limit's name under `[cdi.profiles.<name>]`.
    #[test]
    fn unknown_key_lines_list_the_rows_keys() {
        let listed = |text: &str| -> Vec<String> {
            let err = parse(text, None).unwrap_err().to_string();
            let want = "TOML parse error at line 2, column 1 | 2 | zz = 1 | ^^ unknown field `zz`, expected ";
            let (_, list) = err.split_once(want).unwrap_or_else(|| panic!("{err}"));
            let list = list.strip_prefix("one of ").unwrap_or(list);
            list.split(", ")
                .flat_map(|item| item.split(" or "))
                .map(|k| k.trim_matches('`').to_owned())
                .collect()
        };
        let mps = listed("[mps]\nzz = 1");
        let mut rows_keys = Vec::new();
        for (key, _) in crate::request::numeric() {
            for config_key in [key.default_key, key.ceiling_key].into_iter().flatten() {
                rows_keys.push(config_key.strip_prefix("mps.").expect("an [mps] key"));
            }
        }
        assert!(rows_keys.len() >= 4, "{rows_keys:?}");
        for name in rows_keys
            .iter()
            .chain(&["control-binary", "daemon-pids-max"])
        {
            assert_eq!(
                mps.iter().filter(|k| k == name).count(),
                1,
                "{name} in {mps:?}"
            );
        }
        let mut unique = mps.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), mps.len(), "a key twice: {mps:?}");
        let profile = listed("[cdi.profiles.p]\nzz = 1");
        let names: Vec<_> = crate::request::profile_keys().map(|k| k.name).collect();
        assert_eq!(profile, names);
    }

    /// The config module spells no limit outside its tests: the rows are the one home of
    /// their keys, which `rows` reads by row (a limit spelled here again is a second home
    /// that a new row would have to find).
    #[test]
    fn the_config_module_spells_no_limit() {
        let sources = [
            ("src/config.rs", include_str!("config.rs")),
            ("src/config/rows.rs", include_str!("config/rows.rs")),
        ];
        for (file, text) in sources {
            let code = text.split("#[cfg(test)]").next().unwrap_or(text);
            for key in crate::request::profile_keys() {
                let snake = key.name.replace('-', "_");
                for spelled in [key.name.to_owned(), snake.to_uppercase(), snake] {
                    assert!(!code.contains(&spelled), "{file} spells {spelled}");
                }
            }
        }
    }

    /// The config's lines about the limits' defaults, ceilings and CDI profiles, pinned
    /// whole: they are built from the request-key rows, and must read as they always have.
    #[test]
    fn limit_lines_are_pinned() {
        for (text, want) in [
            (
                "[mps]\ndefault-active-thread-percentage = 0",
                "invalid config <defaults>: mps.default-active-thread-percentage = \"0\": an integer from 1 to 100",
            ),
            (
                "[mps]\ndefault-active-thread-percentage = 300",
                "invalid config <defaults>: mps.default-active-thread-percentage = \"300\": an integer from 1 to 100",
            ),
            (
                "[mps]\ndefault-active-thread-percentage = \"5\"",
                "invalid config <defaults>: TOML parse error at line 2, column 36 | 2 | default-active-thread-percentage = \"5\" | ^^^ invalid type: string \"5\", expected an integer from 1 to 100",
            ),
            (
                "[mps]\ndefault-active-thread-percentage = -1",
                "invalid config <defaults>: TOML parse error at line 2, column 36 | 2 | default-active-thread-percentage = -1 | ^^ invalid value: integer `-1`, expected an integer from 1 to 100",
            ),
            (
                "[mps]\nmax-active-thread-percentage = 1.5",
                "invalid config <defaults>: TOML parse error at line 2, column 32 | 2 | max-active-thread-percentage = 1.5 | ^^^ invalid type: floating point `1.5`, expected an integer from 1 to 100",
            ),
            (
                "[mps]\nmax-pinned-memory-limit = 4",
                "invalid config <defaults>: TOML parse error at line 2, column 27 | 2 | max-pinned-memory-limit = 4 | ^ invalid type: integer `4`, expected a string with a size and a unit, like \"512M\" or \"4G\"",
            ),
            (
                "[mps]\nmax-active-thread-percentage = 101",
                "invalid config <defaults>: mps.max-active-thread-percentage = \"101\": an integer from 1 to 100",
            ),
            (
                "[mps]\ndefault-pinned-memory-limit = \"4\"",
                "invalid config <defaults>: mps.default-pinned-memory-limit = \"4\": a size with a unit, like 512M or 4G",
            ),
            (
                "[mps]\nmax-pinned-memory-limit = \"lots\"",
                "invalid config <defaults>: mps.max-pinned-memory-limit = \"lots\": a size with a unit, like 512M or 4G",
            ),
            (
                "[mps]\ndefault-pinned-memory-limit = \"1K\"\nmax-active-thread-percentage = 0",
                "invalid config <defaults>: mps.default-pinned-memory-limit = \"1K\": a size with a unit, like 512M or 4G",
            ),
            (
                "[mps]\ndefault-pinned-memory-limit = \"bad\"\nmax-active-thread-percentage = 0",
                "invalid config <defaults>: mps.default-pinned-memory-limit = \"bad\": a size with a unit, like 512M or 4G",
            ),
            (
                "[mps]\ndefault-active-thread-percentage = 60\nmax-active-thread-percentage = 50",
                "invalid config <defaults>: mps.default-active-thread-percentage = \"60\": at most mps.max-active-thread-percentage",
            ),
            (
                "[mps]\ndefault-pinned-memory-limit = \"4G\"\nmax-pinned-memory-limit = \"2G\"",
                "invalid config <defaults>: mps.default-pinned-memory-limit = \"4294967296\": at most mps.max-pinned-memory-limit",
            ),
            (
                "[mps]\ndefault-pinned-memory-limit = \"4G\"\nmax-pinned-memory-limit = \"2G\"\ndefault-active-thread-percentage = 60\nmax-active-thread-percentage = 50",
                "invalid config <defaults>: mps.default-active-thread-percentage = \"60\": at most mps.max-active-thread-percentage",
            ),
            (
                "[mps]\nmax-threads = 5",
                "invalid config <defaults>: TOML parse error at line 2, column 1 | 2 | max-threads = 5 | ^^^^^^^^^^^ unknown field `max-threads`, expected one of `control-binary`, `user-mode`, `tenant`, `multi-user-flag`, `limits`, `ipc`, `allow-ipc-override`, `container-pipe-dir`, `container-log-dir`, `shm-size`, `shm-size-per-uid`, `shm-size-total`, `start-timeout`, `idle-timeout`, `daemon-gid`, `max-daemons`, `max-daemons-per-uid`, `log-size`, `limit-check-interval`, `daemon-memory-max`, `daemon-pids-max`, `default-active-thread-percentage`, `default-pinned-memory-limit`, `max-active-thread-percentage`, `max-pinned-memory-limit`",
            ),
            (
                "[cdi.profiles.none]\n",
                "invalid config <defaults>: [cdi.profiles.none]: sets no limit: allowed is active-thread-percentage, pinned-memory-limit or both",
            ),
            (
                "[cdi.profiles.p]\nactive-thread-percentage = 0",
                "invalid config <defaults>: [cdi.profiles.p]: active-thread-percentage = 0: allowed is an integer from 1 to 100",
            ),
            (
                "[cdi.profiles.p]\nactive-thread-percentage = 300",
                "invalid config <defaults>: [cdi.profiles.p]: active-thread-percentage = 300: allowed is an integer from 1 to 100",
            ),
            (
                "[cdi.profiles.p]\nactive-thread-percentage = \"25\"",
                "invalid config <defaults>: TOML parse error at line 2, column 28 | 2 | active-thread-percentage = \"25\" | ^^^^ invalid type: string \"25\", expected an integer from 1 to 100",
            ),
            (
                "[cdi.profiles.p]\npinned-memory-limit = \"4\"",
                "invalid config <defaults>: [cdi.profiles.p]: pinned-memory-limit=\"4\" is invalid: it has no unit, which is ambiguous; allowed is a size with a unit, like 512M, 4G, 4GiB or 1536MiB (K, M, G, T; every unit is 1024-based, so 4GB is 4GiB)",
            ),
            (
                "[cdi.profiles.p]\npinned-memory-limit = 4",
                "invalid config <defaults>: TOML parse error at line 2, column 23 | 2 | pinned-memory-limit = 4 | ^ invalid type: integer `4`, expected a string with a size and a unit, like \"512M\" or \"4G\"",
            ),
            (
                "[mps]\nmax-active-thread-percentage = 50\n[cdi.profiles.p]\nactive-thread-percentage = 60",
                "invalid config <defaults>: [cdi.profiles.p]: active-thread-percentage = 60 is above mps.max-active-thread-percentage = 50",
            ),
            (
                "[mps]\nmax-pinned-memory-limit = \"2G\"\n[cdi.profiles.p]\npinned-memory-limit = \"4G\"",
                "invalid config <defaults>: [cdi.profiles.p]: pinned-memory-limit = \"4G\" is above mps.max-pinned-memory-limit (2048 MiB)",
            ),
            (
                "[mps]\nmax-pinned-memory-limit = \"2G\"\nmax-active-thread-percentage = 50\n[cdi.profiles.p]\npinned-memory-limit = \"4G\"\nactive-thread-percentage = 60",
                "invalid config <defaults>: [cdi.profiles.p]: active-thread-percentage = 60 is above mps.max-active-thread-percentage = 50",
            ),
            (
                "[cdi.profiles.p]\nthreads = 5",
                "invalid config <defaults>: TOML parse error at line 2, column 1 | 2 | threads = 5 | ^^^^^^^ unknown field `threads`, expected `active-thread-percentage` or `pinned-memory-limit`",
            ),
        ] {
            let err = parse(text, None).expect_err(text).to_string();
            assert_eq!(err, want, "{text}");
        }
        let limits = |text| {
            let c = parse(text, None).expect(text);
            let d = |k| c.mps.default_for(k);
            let ceilings = c
                .mps
                .ceilings()
                .0
                .iter()
                .map(|(k, v)| (k.name, *v))
                .collect::<Vec<_>>();
            (
                d(&crate::request::ACTIVE_THREAD_PERCENTAGE),
                d(&crate::request::PINNED_MEMORY_LIMIT),
                ceilings,
            )
        };
        assert_eq!(
            limits("[mps]\ndefault-active-thread-percentage = 30\ndefault-pinned-memory-limit = \"1536M\"\nmax-active-thread-percentage = 50\nmax-pinned-memory-limit = \"8G\""),
            (Some(30), Some(1536 << 20), vec![("active-thread-percentage", 50), ("pinned-memory-limit", 8 << 30)])
        );
        assert_eq!(
            limits("[mps]\nmax-pinned-memory-limit = \"8G\""),
            (None, None, vec![("pinned-memory-limit", 8 << 30)])
        );
        assert_eq!(limits(""), (None, None, vec![]));
    }

    /// `mps.tenant`: `uid` by default, `namespace` only with per-user daemons (one
    /// multi-user server serves every tenant of a device by design).
    #[test]
    fn tenant_is_uid_by_default_and_namespace_needs_per_user_daemons() {
        assert_eq!(parse("", None).unwrap().mps.tenant, TenantMode::Uid);
        let ns = parse("[mps]\ntenant = \"namespace\"", None).unwrap();
        assert_eq!(ns.mps.tenant, TenantMode::Namespace);
        let err = parse(
            "[mps]\ntenant = \"namespace\"\nuser-mode = \"multi-user\"",
            None,
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("mps.tenant = \"namespace\"")
                && err.contains("needs user-mode = \"per-user\"")
                && !err.contains('\n'),
            "{err}"
        );
        let err = parse("[mps]\ntenant = \"pod\"", None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("pod") && err.contains("namespace"), "{err}");
    }

    #[test]
    fn unknown_key_is_named() {
        let err = parse("stat-dir = \"/run/x\"\n", None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("stat-dir"), "{err}");
        let err = parse("[mps]\nshm = \"1G\"\n", None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("shm"), "{err}");
    }

    #[test]
    fn bad_values_name_key_value_and_allowed() {
        let cases = [
            ("state-dir = \"run/x\"", "state-dir", "absolute"),
            ("state-dir = \"/run/../x\"", "state-dir", "absolute"),
            ("log-level = \"loud\"", "log-level", "one of"),
            (
                "inventory-cache-ttl = \"2h\"",
                "inventory-cache-ttl",
                "a duration up to 1h",
            ),
            (
                "inventory = \"file:rel\"",
                "inventory",
                "file:<absolute path>",
            ),
            ("low-level-runtime = []", "low-level-runtime", "non-empty"),
            ("[mps]\nshm-size = \"lots\"", "mps.shm-size", "percentage"),
            ("[watch]\ninterval = \"100ms\"", "watch.interval", "500ms to 5m"),
            ("[watch]\nmemory-margin = \"lots\"", "watch.memory-margin", "a size"),
            ("[mps]\nshm-size = \"0%\"", "mps.shm-size", "percentage"),
            (
                "[mps]\nshm-size-per-uid = \"lots\"",
                "mps.shm-size-per-uid",
                "\"0\" for no bound",
            ),
            (
                "[mps]\nshm-size-total = \"101%\"",
                "mps.shm-size-total",
                "percentage",
            ),
            (
                "[mps]\nstart-timeout = \"0\"",
                "mps.start-timeout",
                "duration",
            ),
            (
                "[mps]\nstart-timeout = \"10\"",
                "mps.start-timeout",
                "duration",
            ),
            (
                "[mps]\nidle-timeout = \"soon\"",
                "mps.idle-timeout",
                "duration",
            ),
            (
                "[mps]\ndefault-active-thread-percentage = 0",
                "mps.default-active-thread-percentage",
                "1 to 100",
            ),
            (
                "[mps]\nmulti-user-flag = \"M\"",
                "mps.multi-user-flag",
                "single option",
            ),
            ("[mps]\nuser-mode = \"shared\"", "user-mode", "per-user"),
            (
                "default-device = \"0\"",
                "default-device = \"0\"",
                "\"allocated\" (the devices a device plugin or DRA driver allocated to the container), or unset",
            ),
            ("default-device = \"Allocated\"", "default-device", "\"allocated\""),
            ("default-device = \"\"", "default-device", "or unset"),
            ("driver-root = \"run/nvidia/driver\"", "driver-root", "an absolute path"),
            (
                "driver-root = \"/run/nvidia/../driver\"",
                "driver-root = \"/run/nvidia/../driver\"",
                "without '..'",
            ),
            ("driver-root = \"/\"", "driver-root", "other than \"/\""),
        ];
        for (text, key, allowed) in cases {
            let err = parse(text, None).unwrap_err().to_string();
            assert!(err.contains(key) && err.contains(allowed), "{text}: {err}");
        }
    }

    #[test]
    fn driver_root_is_unset_or_an_absolute_path() {
        assert_eq!(parse("", None).unwrap().driver_root, None);
        assert_eq!(
            parse("driver-root = \"\"\n", None).unwrap().driver_root,
            None
        );
        assert_eq!(
            parse("driver-root = \"/run/nvidia/driver\"\n", None)
                .unwrap()
                .driver_root,
            Some(PathBuf::from("/run/nvidia/driver"))
        );
        // Whether it exists is not the config's to say (`driver`).
        assert!(parse("driver-root = \"/nonexistent/driver\"\n", None).is_ok());
        for bad in ["run/nvidia/driver", "/run/nvidia/../../etc", "/", "/x\u{0}"] {
            let err = parse(&format!("driver-root = {bad:?}\n"), None)
                .expect_err(bad)
                .to_string();
            assert!(err.contains("driver-root") && !err.contains('\n'), "{err}");
        }
    }

    #[test]
    fn visible_devices_env_is_off_unless_the_node_says_so() {
        assert!(!parse("", None).unwrap().accept_visible_devices_env);
        assert!(
            parse("accept-visible-devices-env = true\n", None)
                .unwrap()
                .accept_visible_devices_env
        );
        let err = parse("accept-visible-devices-env = \"yes\"\n", None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("accept-visible-devices-env"), "{err}");
    }

    #[test]
    fn nri_skip_namespaces_are_namespace_names_with_defaults() {
        assert_eq!(
            parse("", None).unwrap().nri_skip_namespaces,
            DEFAULT_NRI_SKIP_NAMESPACES
        );
        let got = |text: &str| parse(text, None).map(|c| c.nri_skip_namespaces);
        assert_eq!(
            got("[nri]\nskip-namespaces = []\n").unwrap(),
            Vec::<String>::new()
        );
        assert_eq!(
            got("[nri]\nskip-namespaces = [\"ops\", \"a-1\"]\n").unwrap(),
            ["ops", "a-1"]
        );
        for bad in ["Ops", "-a", "a-", "", "a.b", &"a".repeat(64)] {
            let err = got(&format!("[nri]\nskip-namespaces = [{bad:?}]\n"))
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("nri.skip-namespaces")
                    && err.contains("Kubernetes namespace names")
                    && !err.contains('\n'),
                "{err}"
            );
        }
        assert!(got("[nri]\nnamespaces = []\n").is_err(), "an unknown key");
    }

    #[test]
    fn default_device_is_unset_or_allocated() {
        assert_eq!(parse("", None).unwrap().default_device, None);
        assert_eq!(
            parse("default-device = \"allocated\"\n", None)
                .unwrap()
                .default_device,
            Some(crate::request::DefaultDevice::Allocated)
        );
        // A top-level key: under [mps] it is unknown.
        let err = parse("[mps]\ndefault-device = \"allocated\"\n", None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("default-device"), "{err}");
        // Not a string: the parser names the key.
        let err = parse("default-device = 0\n", None).unwrap_err().to_string();
        assert!(err.contains("default-device"), "{err}");
    }

    #[test]
    fn fast_path_reads_the_runtime_and_whether_default_device_is_set() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("runtime.toml");
        let shipped = include_str!("../config/runtime.toml");
        for (text, want) in [
            (shipped.to_owned(), false),
            (format!("default-device = \"allocated\"\n{shipped}"), true),
            // Its value is judged where it is used, not on the fast path.
            (format!("default-device = \"bogus\"\n{shipped}"), true),
        ] {
            std::fs::write(&path, &text).unwrap();
            let got = fast_path_from(&path, true).unwrap();
            assert_eq!(got.default_device, want, "{text}");
            assert_eq!(got.low_level_runtime, vec!["runc", "crun"]);
        }
        let absent = dir.path().join("absent.toml");
        assert!(!fast_path_from(&absent, false).unwrap().default_device);
        assert!(fast_path_from(&absent, true).is_err());
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("0"), Some(Duration::ZERO));
        assert_eq!(parse_duration("250ms"), Some(Duration::from_millis(250)));
        assert_eq!(parse_duration("10s"), Some(Duration::from_secs(10)));
        assert_eq!(parse_duration("2m"), Some(Duration::from_secs(120)));
        assert_eq!(parse_duration("s"), None);
        assert_eq!(parse_duration("10"), None);
        assert_eq!(parse_duration("-1s"), None);
    }

    #[test]
    fn missing_default_file_means_defaults_but_named_file_must_exist() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nope.toml");
        assert!(load_from(&missing, false).is_ok());
        let err = load_from(&missing, true).unwrap_err().to_string();
        assert!(err.contains("nope.toml"), "{err}");
    }
}
