//! The configuration file as written: serde's shapes of its tables, every value as text
//! until `check` reads it. Unknown keys are refused here (`deny_unknown_fields`, and the
//! rows' visitor for `[mps]`).

use serde::Deserialize;

use super::types::{
    CdiProfile, CgroupMemoryLimit, IpcConfig, Limits, LogFormat, Protocol, TenantMode, UserMode,
    WatchPolicy, Written,
};
use crate::request::ProfileValue;

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub(super) struct RawConfig {
    pub(super) low_level_runtime: Option<Vec<String>>,
    pub(super) state_dir: Option<String>,
    pub(super) log_file: Option<String>,
    pub(super) log_level: Option<String>,
    pub(super) log_format: Option<LogFormat>,
    pub(super) accept_env_requests: Option<bool>,
    pub(super) default_device: Option<String>,
    pub(super) accept_visible_devices_env: Option<bool>,
    pub(super) inventory: Option<String>,
    pub(super) inventory_cache_ttl: Option<String>,
    pub(super) driver_root: Option<String>,
    #[serde(default)]
    pub(super) mps: RawMps,
    #[serde(default)]
    pub(super) cdi: RawCdi,
    #[serde(default)]
    pub(super) watch: RawWatch,
    #[serde(default)]
    pub(super) nri: RawNri,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub(super) struct RawWatch {
    pub(super) policy: Option<WatchPolicy>,
    pub(super) interval: Option<String>,
    pub(super) memory_margin: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub(super) struct RawNri {
    pub(super) skip_namespaces: Option<Vec<String>>,
    pub(super) audit_interval: Option<String>,
    pub(super) unserved: Option<super::NriUnserved>,
    pub(super) shim_handlers: Option<Vec<String>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub(super) struct RawCdi {
    #[serde(default)]
    pub(super) profiles: std::collections::BTreeMap<String, CdiProfile>,
}

/// `[mps]`: its own keys, and the rows' default and ceiling keys (`rows`).
#[derive(Default)]
pub(super) struct RawMps {
    pub(super) fields: MpsFields,
    /// The rows' keys that are set, by config key (`mps.<name>`), as written.
    pub(super) rows: Vec<(&'static str, Written)>,
}

/// `[mps]`'s own keys. Unknown keys are refused by `rows` (whose line lists these and the
/// rows' keys); `deny_unknown_fields` stays as the derive's own guard.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub(super) struct MpsFields {
    pub(super) control_binary: Option<String>,
    pub(super) protocol: Option<Protocol>,
    pub(super) cgroup_memory_limit: Option<CgroupMemoryLimit>,
    pub(super) nvidia_smi: Option<String>,
    pub(super) user_mode: Option<UserMode>,
    pub(super) tenant: Option<TenantMode>,
    pub(super) multi_user_flag: Option<String>,
    pub(super) limits: Option<Limits>,
    pub(super) ipc: Option<IpcConfig>,
    pub(super) allow_ipc_override: Option<bool>,
    pub(super) container_pipe_dir: Option<String>,
    pub(super) container_log_dir: Option<String>,
    pub(super) shm_size: Option<String>,
    pub(super) shm_size_per_uid: Option<String>,
    pub(super) shm_size_total: Option<String>,
    pub(super) start_timeout: Option<String>,
    pub(super) idle_timeout: Option<String>,
    pub(super) daemon_gid: Option<u32>,
    pub(super) max_daemons: Option<u32>,
    pub(super) max_daemons_per_uid: Option<u32>,
    pub(super) log_size: Option<String>,
    pub(super) limit_check_interval: Option<String>,
    pub(super) daemon_memory_max: Option<String>,
    pub(super) daemon_pids_max: Option<u32>,
}

impl RawMps {
    /// The value of a row's `default_key` or `ceiling_key` (`mps.<name>`), as written.
    pub(super) fn number(&self, config_key: &str) -> Option<ProfileValue<'_>> {
        let (_, value) = self.rows.iter().find(|(k, _)| *k == config_key)?;
        Some(value.as_profile())
    }
}
