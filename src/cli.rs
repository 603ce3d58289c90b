//! The `gpushare` command line: `hook`, `status`, `daemon`.
//!
//! Invariants: a hook failure is one line `gpushare: …` on stderr and exit 1 (runc shows
//! it to the user); `poststop` always exits 0; `status` reads state without taking any
//! lock a create could wait on.

use std::io::Write;

use clap::{Parser, Subcommand, ValueEnum};
use serde::Serialize;

use crate::config::Config;
use crate::state::{DaemonRecord, DaemonStatus, StateDir};

#[derive(Parser)]
#[command(name = "gpushare", version, about = "Share NVIDIA GPUs between containers through per-user CUDA MPS daemons")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run an OCI hook (called by runc; the container state comes on stdin).
    Hook {
        #[arg(value_enum)]
        stage: HookStage,
    },
    /// Show MPS daemons and the containers using them.
    Status {
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Manage MPS daemons directly.
    Daemon {
        #[command(subcommand)]
        command: DaemonCommand,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum HookStage {
    CreateRuntime,
    Poststop,
}

#[derive(Subcommand)]
enum DaemonCommand {
    /// Supervise one daemon (started by the hook; not for interactive use).
    #[command(hide = true)]
    Supervise {
        #[arg(long)]
        id: String,
    },
}

fn load_config() -> Result<Config, i32> {
    crate::config::load().map_err(|e| {
        eprintln!("gpushare: {:#}", anyhow::Error::new(e));
        1
    })
}

/// Entry point of the `gpushare` binary; returns the exit code.
pub fn main() -> i32 {
    let cli = Cli::parse();
    let cfg = match load_config() {
        Ok(c) => c,
        Err(code) => return code,
    };
    crate::logging::init(&cfg);
    match cli.command {
        Command::Hook { stage } => {
            let state = match crate::hook::read_state(std::io::stdin().lock()) {
                Ok(s) => s,
                Err(e) if matches!(stage, HookStage::Poststop) => {
                    tracing::warn!("poststop: {e:#}");
                    return 0;
                }
                Err(e) => {
                    eprintln!("gpushare: {e:#}");
                    return 1;
                }
            };
            let span = tracing::info_span!("hook", container_id = %state.id);
            let _enter = span.enter();
            match stage {
                HookStage::CreateRuntime => match crate::hook::create_runtime(&cfg, &state) {
                    Ok(()) => 0,
                    Err(e) => {
                        tracing::error!("create-runtime: {e:#}");
                        eprintln!("gpushare: {e:#}");
                        1
                    }
                },
                HookStage::Poststop => {
                    crate::hook::poststop(&cfg, &state);
                    0
                }
            }
        }
        Command::Status { json } => status(&cfg, json),
        Command::Daemon { command } => match command {
            DaemonCommand::Supervise { id } => {
                if !crate::identity::valid_id(&id) {
                    eprintln!("gpushare: daemon id {id:?} is invalid: allowed is 12 lowercase hex digits");
                    return 2;
                }
                let span = tracing::info_span!("supervisor", daemon = %id);
                let _enter = span.enter();
                match crate::mps::supervisor::run(&cfg, &id) {
                    Ok(()) => 0,
                    Err(e) => {
                        tracing::error!("supervisor: {e:#}");
                        1
                    }
                }
            }
        },
    }
}

/// One daemon as `status` shows it.
#[derive(Debug, Serialize)]
pub struct DaemonView {
    pub id: String,
    pub devices: Vec<String>,
    pub uid: u32,
    pub multi_user: bool,
    pub active_thread_percentage: Option<u8>,
    pub pinned_memory_limit: Option<u64>,
    pub status: Option<DaemonStatus>,
    pub pid: Option<i32>,
    pub supervisor_pid: Option<i32>,
    /// Supervisor and daemon are the processes the record names.
    pub alive: bool,
    pub restarts: u32,
    pub error: Option<String>,
    pub containers: Vec<crate::state::ContainerRecord>,
}

pub fn collect(state: &StateDir) -> Vec<DaemonView> {
    let mut out = Vec::new();
    for id in state.daemon_ids().unwrap_or_default() {
        let Ok(Some(rec)) = state.read_record(&id) else { continue };
        let DaemonRecord { identity, status, supervisor, daemon, restarts, error, .. } = rec;
        let alive = status == DaemonStatus::Ready
            && supervisor.is_some_and(|p| p.alive())
            && daemon.is_some_and(|p| p.alive());
        out.push(DaemonView {
            containers: state.containers(&id).unwrap_or_default(),
            id,
            devices: identity.devices,
            uid: identity.uid,
            multi_user: identity.multi_user,
            active_thread_percentage: identity.active_thread_percentage,
            pinned_memory_limit: identity.pinned_memory_limit,
            status: Some(status),
            pid: daemon.map(|p| p.pid),
            supervisor_pid: supervisor.map(|p| p.pid),
            alive,
            restarts,
            error,
        });
    }
    out
}

fn status(cfg: &Config, json: bool) -> i32 {
    let views = collect(&StateDir::new(&cfg.state_dir));
    let mut out = std::io::stdout().lock();
    if json {
        let _ = writeln!(out, "{}", serde_json::to_string_pretty(&views).unwrap_or_default());
        return 0;
    }
    let _ = writeln!(out, "{:<12}  {:<16}  {:<6}  {:<18}  {:>7}  {:<5}  {:>10}", "DAEMON", "DEVICE", "UID", "LIMITS", "PID", "ALIVE", "CONTAINERS");
    for v in &views {
        let device = v.devices.iter().map(|d| d.chars().take(12).collect::<String>()).collect::<Vec<_>>().join(",");
        let uid = if v.multi_user { "multi".to_owned() } else { v.uid.to_string() };
        let mut limits = Vec::new();
        if let Some(p) = v.active_thread_percentage {
            limits.push(format!("threads={p}%"));
        }
        if let Some(m) = v.pinned_memory_limit {
            limits.push(format!("mem={}", crate::request::format_mps_size(m)));
        }
        let limits = if limits.is_empty() { "-".to_owned() } else { limits.join(",") };
        let pid = v.pid.map_or_else(|| "-".to_owned(), |p| p.to_string());
        let _ = writeln!(out, "{:<12}  {:<16}  {:<6}  {:<18}  {:>7}  {:<5}  {:>10}", v.id, device, uid, limits, pid, if v.alive { "yes" } else { "no" }, v.containers.len());
        for c in &v.containers {
            let _ = writeln!(out, "  └ container {} (pid {})", c.id, c.pid.map_or_else(|| "-".into(), |p| p.to_string()));
        }
    }
    if views.is_empty() {
        let _ = writeln!(out, "(no MPS daemons under {})", cfg.state_dir.display());
    }
    0
}
