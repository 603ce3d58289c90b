//! gpushare's own log: `log-file` and `log-level` from the config, `GPUSHARE_LOG` overrides
//! the level, `log-format = "json"` writes JSON lines.
//!
//! Levels (docs/configuration.md, `log-level`): error = what the user asked for failed;
//! warn = degraded but continuing; info = state changed (spec edited, daemon
//! started/stopped); debug = decisions; trace = full specs. The shim never logs to
//! stdout/stderr during `create`, so a log file that cannot be opened means no log, not a
//! failure.

use std::sync::Mutex;

use crate::config::{Config, LogFormat};

/// Installs the global subscriber for this process. Idempotent; best effort.
pub(crate) fn init(cfg: &Config) {
    let Some(path) = &cfg.log_file else { return };
    if let Some(dir) = path.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    let Ok(file) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
    else {
        return;
    };
    let level = std::env::var("GPUSHARE_LOG")
        .ok()
        .and_then(|l| l.parse::<tracing::Level>().ok())
        .unwrap_or(cfg.log_level);
    let builder = tracing_subscriber::fmt()
        .with_writer(Mutex::new(file))
        .with_ansi(false)
        .with_max_level(level);
    let _ = match cfg.log_format {
        LogFormat::Json => builder.json().try_init(),
        LogFormat::Text => builder.try_init(),
    };
}
