//! `gpushare-mps-sim`: a simulator of NVIDIA's `nvidia-cuda-mps-control`, so gpushare can be
//! tested end to end on a machine without a GPU. It imitates the documented behaviour that
//! docs/mps.md states (the control daemon and its commands, one server per user, limits).
//!
//! Same command line shape as the real tool: `-f`/`-d` run the control daemon, `-v` prints the
//! version, no option reads control commands from stdin; `client` is a stand-in CUDA process,
//! `hold-control` a stand-in tenant that jams the control socket (`hold`). With `-M` the daemon
//! also listens on a root-only `control_privileged`, as NVIDIA's multi-user daemon does.
//! The daemon starts real server processes (this binary re-executed) under the client's uid,
//! queues users behind each other as the real one does, and creates `/dev/shm` markers that a
//! client must see, which is what shows a container shares the daemon's /dev/shm.
//!
//! This binary stands alone (its own package, sim/, a test tool that is not shipped): it does
//! not use the gpushare library, so it builds even while the library does not. Its end-to-end
//! tests are sim/tests/sim.rs. Environment: CUDA_MPS_PIPE_DIRECTORY (default /tmp/nvidia-mps),
//! CUDA_MPS_LOG_DIRECTORY (default /var/log/nvidia-mps), CUDA_VISIBLE_DEVICES (logged only),
//! CUDA_MPS_ACTIVE_THREAD_PERCENTAGE and CUDA_MPS_PINNED_DEVICE_MEM_LIMIT (daemon: initial
//! defaults; client: its own, lower-only limits), CUDA_MPS_CLIENT_PRIORITY (client: reported).

#![forbid(unsafe_code)]

mod args;
mod control;
mod control_client;
mod cuda_client;
mod daemon;
mod gpu;
mod hold;
mod limits;
mod log;
mod sched;
mod server;
mod session;
mod subreaper;
mod wire;

use std::path::PathBuf;
use std::process::ExitCode;

use args::Mode;
use daemon::{DaemonOptions, Launch};

const DEFAULT_PIPE_DIR: &str = "/tmp/nvidia-mps";
const DEFAULT_LOG_DIR: &str = "/var/log/nvidia-mps";

fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args_os()
        .skip(1)
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let mode = match args::parse(&argv) {
        Ok(mode) => mode,
        Err(e) => {
            eprintln!("gpushare-mps-sim: {e}");
            return ExitCode::from(2);
        }
    };
    ExitCode::from(run(mode))
}

fn run(mode: Mode) -> u8 {
    match mode {
        Mode::Version => {
            println!(
                "gpushare-mps-sim {} (simulates nvidia-cuda-mps-control)",
                env!("CARGO_PKG_VERSION")
            );
            0
        }
        Mode::Daemon {
            background: true,
            multiuser,
        } => report(daemon::launch_background(multiuser)),
        Mode::Daemon {
            background: false,
            multiuser,
        } => report(daemon::run(&daemon_options(multiuser), Launch::Foreground).map(|()| 0)),
        Mode::DaemonChild { multiuser } => {
            report(daemon::run(&daemon_options(multiuser), Launch::Background).map(|()| 0))
        }
        Mode::Control => control_client::run(&env_dir("CUDA_MPS_PIPE_DIRECTORY", DEFAULT_PIPE_DIR)),
        Mode::Client(opts) => {
            cuda_client::run(&env_dir("CUDA_MPS_PIPE_DIRECTORY", DEFAULT_PIPE_DIR), &opts)
        }
        Mode::Server => report(server::run_server().map(|()| 0)),
        Mode::Subreaper(command) => report(subreaper::run(&command)),
        Mode::HoldControl { connections, every } => report(hold::run(
            &env_dir("CUDA_MPS_PIPE_DIRECTORY", DEFAULT_PIPE_DIR),
            connections,
            every,
        )),
    }
}

fn report(result: anyhow::Result<u8>) -> u8 {
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("gpushare-mps-sim: {e:#}");
            1
        }
    }
}

fn env_dir(name: &str, default: &str) -> PathBuf {
    match std::env::var_os(name) {
        Some(v) if !v.is_empty() => PathBuf::from(v),
        _ => PathBuf::from(default),
    }
}

fn daemon_options(multiuser: bool) -> DaemonOptions {
    DaemonOptions {
        pipe_dir: env_dir("CUDA_MPS_PIPE_DIRECTORY", DEFAULT_PIPE_DIR),
        log_dir: env_dir("CUDA_MPS_LOG_DIRECTORY", DEFAULT_LOG_DIR),
        multiuser,
        visible_devices: std::env::var("CUDA_VISIBLE_DEVICES").ok(),
        initial_percentage: std::env::var("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE").ok(),
        initial_mem: std::env::var("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT").ok(),
    }
}
