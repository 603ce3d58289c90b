//! The configuration file (`/etc/gpushare/runtime.toml`, or `$GPUSHARE_CONFIG`).
//!
//! Invariants: keys are kebab-case and an unknown key is an error naming it; a missing
//! file at the default location means the built-in defaults (which equal the documented
//! `config/runtime.toml`), while a missing file named by `GPUSHARE_CONFIG` is an error.
//! Every value is validated here, once, so the rest of the program works with typed data.
//!
//! One file per job: the loading here; `types` (the typed configuration, which the
//! others take from it), `raw` (the file as written, serde's shapes), `check` (every value
//! checked and typed), `rows` (the limit rows' default and ceiling keys, read by row),
//! `tests`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

mod check;
mod raw;
mod rows;
#[cfg(test)]
mod tests;
mod types;

use check::Check;
use raw::RawConfig;
pub use types::{
    CdiProfile, CgroupMemoryLimit, Config, ConfigError, IpcConfig, Limits, LogFormat, MpsConfig,
    NriUnserved, Protocol, ShmSize, TenantMode, UserMode, WatchConfig, WatchPolicy,
};

/// Where the configuration is read from when `GPUSHARE_CONFIG` is not set.
pub(crate) const DEFAULT_PATH: &str = "/etc/gpushare/runtime.toml";
/// Environment variable naming another configuration file.
pub(crate) const ENV_VAR: &str = "GPUSHARE_CONFIG";

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
        nri_audit_interval: check.duration(
            "nri.audit-interval",
            raw.nri.audit_interval.as_deref().unwrap_or("10s"),
            |d| d >= Duration::from_secs(1) && d <= Duration::from_secs(600),
            "a duration from 1s to 10m, like \"10s\"",
        )?,
        nri_unserved: raw.nri.unserved.unwrap_or(NriUnserved::Report),
        nri_shim_handlers: check.handlers("nri.shim-handlers", raw.nri.shim_handlers)?,
    })
}
