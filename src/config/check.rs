//! The configuration's values checked, once: each refusal is a `ConfigError::Value`
//! naming the file, the key, the value and what is allowed; what passes is typed data.

use std::path::PathBuf;
use std::time::Duration;

use super::raw::{RawMps, RawWatch};
use super::types::*;
use crate::request::{Number, ProfileValue};

/// The checks of one config file's values: each refusal is a `ConfigError::Value` naming
/// the file, the key, the value and what is allowed.
pub(super) struct Check {
    /// The file, or `<defaults>`.
    pub(super) path: PathBuf,
}

impl Check {
    pub(super) fn bad(&self, key: &'static str, value: &str, allowed: &str) -> ConfigError {
        ConfigError::Value {
            path: self.path.clone(),
            key,
            value: value.to_owned(),
            allowed: allowed.to_owned(),
        }
    }

    /// An absolute path without `..`.
    pub(super) fn abs(&self, key: &'static str, value: &str) -> Result<PathBuf, ConfigError> {
        let p = PathBuf::from(value);
        if !p.is_absolute() || value.contains('\0') || p.components().any(|c| c.as_os_str() == "..")
        {
            return Err(self.bad(key, value, "an absolute path without '..'"));
        }
        Ok(p)
    }

    /// A duration (`parse_duration`) that `ok` accepts; `allowed` says which.
    pub(super) fn duration(
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
    pub(super) fn size(&self, key: &'static str, value: &str) -> Result<u64, ConfigError> {
        crate::request::parse_size(key, value)
            .map_err(|_| self.bad(key, value, "a size with a unit, like 512M or 4G"))
    }

    /// A count of at least 1, `default` when unset.
    pub(super) fn count(
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
    pub(super) fn log_file(&self, value: Option<&str>) -> Result<Option<PathBuf>, ConfigError> {
        match value {
            None => Ok(Some(PathBuf::from("/var/log/gpushare.log"))),
            Some("") => Ok(None),
            Some(s) => Ok(Some(self.abs("log-file", s)?)),
        }
    }

    pub(super) fn log_level(&self, value: &str) -> Result<tracing::Level, ConfigError> {
        // The five names only: tracing would also take digits and any case.
        ["error", "warn", "info", "debug", "trace"]
            .contains(&value)
            .then(|| value.parse::<tracing::Level>().ok())
            .flatten()
            .ok_or_else(|| self.bad("log-level", value, "one of error, warn, info, debug, trace"))
    }

    pub(super) fn default_device(
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
    pub(super) fn namespaces(
        &self,
        key: &'static str,
        list: Option<Vec<String>>,
    ) -> Result<Vec<String>, ConfigError> {
        let list = list.unwrap_or_else(|| DEFAULT_NRI_SKIP_NAMESPACES.map(String::from).to_vec());
        self.labels(key, list, "Kubernetes namespace names")
    }

    /// `[nri] shim-handlers`: RuntimeClass handlers (RFC 1123 labels, as Kubernetes
    /// requires of a handler).
    pub(super) fn handlers(
        &self,
        key: &'static str,
        list: Option<Vec<String>>,
    ) -> Result<Vec<String>, ConfigError> {
        let list = list.unwrap_or_else(|| DEFAULT_NRI_SHIM_HANDLERS.map(String::from).to_vec());
        self.labels(key, list, "RuntimeClass handler names")
    }

    /// `list` when every name is an RFC 1123 label.
    fn labels(
        &self,
        key: &'static str,
        list: Vec<String>,
        what: &str,
    ) -> Result<Vec<String>, ConfigError> {
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
                    &format!("a list of {what} (at most 63 lowercase letters, digits and -, starting and ending with a letter or digit), [] for none"),
                ));
            }
        }
        Ok(list)
    }

    /// `driver-root`: `""` for the host's own paths, else an absolute path without `..`
    /// (and not `/`, which is the host's own paths spelled another way).
    pub(super) fn driver_root(&self, value: &str) -> Result<Option<PathBuf>, ConfigError> {
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

    pub(super) fn inventory(
        &self,
        value: &str,
    ) -> Result<crate::device::InventorySource, ConfigError> {
        crate::device::InventorySource::parse(value)
            .map_err(|_| self.bad("inventory", value, "\"nvml\" or \"file:<absolute path>\""))
    }

    /// `[mps]`, its keys checked one after the other: the first bad one is the error.
    pub(super) fn mps(&self, raw: &RawMps) -> Result<MpsConfig, ConfigError> {
        let m = &raw.fields;
        let control_binary = self.control_binary(m.control_binary.as_deref())?;
        let nvidia_smi = self.program(
            "mps.nvidia-smi",
            m.nvidia_smi.as_deref().unwrap_or("nvidia-smi"),
        )?;
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
            protocol: m.protocol.unwrap_or(Protocol::Legacy),
            cgroup_memory_limit: m.cgroup_memory_limit.unwrap_or(CgroupMemoryLimit::Auto),
            nvidia_smi,
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
    pub(super) fn cdi_profiles(
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

    pub(super) fn control_binary(&self, value: Option<&str>) -> Result<String, ConfigError> {
        self.program(
            "mps.control-binary",
            value.unwrap_or("nvidia-cuda-mps-control"),
        )
    }

    /// A program gpushare runs: a name on PATH or an absolute path.
    pub(super) fn program(&self, key: &'static str, binary: &str) -> Result<String, ConfigError> {
        if binary.is_empty() || binary.contains('\0') {
            return Err(self.bad(key, binary, "a program name on PATH or an absolute path"));
        }
        Ok(binary.to_owned())
    }

    pub(super) fn multi_user_flag(&self, value: &str) -> Result<String, ConfigError> {
        if !value.starts_with('-') || value.contains(char::is_whitespace) {
            return Err(self.bad(
                "mps.multi-user-flag",
                value,
                "a single option such as \"-M\" or \"-multiuser-server\"",
            ));
        }
        Ok(value.to_owned())
    }

    pub(super) fn shm_size(&self, key: &'static str, value: &str) -> Result<ShmSize, ConfigError> {
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
    pub(super) fn shm_bound(
        &self,
        key: &'static str,
        value: &str,
    ) -> Result<Option<ShmSize>, ConfigError> {
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

    pub(super) fn start_timeout(&self, value: &str) -> Result<Duration, ConfigError> {
        self.duration(
            "mps.start-timeout",
            value,
            |d| !d.is_zero() && d <= Duration::from_secs(300),
            "a duration from 1ms to 300s, like \"10s\" or \"500ms\"",
        )
    }

    pub(super) fn idle_timeout(&self, value: &str) -> Result<Duration, ConfigError> {
        self.duration(
            "mps.idle-timeout",
            value,
            |_| true,
            "a duration like \"10m\", or \"0\" for never",
        )
    }

    pub(super) fn watch(&self, w: &RawWatch) -> Result<WatchConfig, ConfigError> {
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

    pub(super) fn limit_check_interval(&self, value: &str) -> Result<Duration, ConfigError> {
        self.duration(
            "mps.limit-check-interval",
            value,
            |d| d >= Duration::from_millis(100) && d <= Duration::from_secs(60),
            "a duration from 100ms to 60s, like \"2s\"",
        )
    }

    /// `mps.daemon-memory-max`: 4G when unset, `0` for no limit.
    pub(super) fn daemon_memory_max(&self, value: Option<&str>) -> Result<u64, ConfigError> {
        match value {
            None => Ok(4 << 30),
            Some("0") => Ok(0),
            Some(s) => self.size("mps.daemon-memory-max", s),
        }
    }

    /// The default limits and the ceilings (the rows' `default_key` and `ceiling_key`),
    /// each default at most its ceiling. Every default is read before the ceilings, each
    /// ceiling then compared with its default.
    pub(super) fn client_limits(
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
    pub(super) fn limit(
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
    pub(super) fn log_size(&self, value: &str) -> Result<u64, ConfigError> {
        let log_size = self.size("mps.log-size", value)?;
        if log_size < 1 << 20 {
            return Err(self.bad("mps.log-size", value, "a size of at least 1M"));
        }
        Ok(log_size)
    }
}

pub(super) fn parse_shm_size(s: &str) -> Option<ShmSize> {
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
