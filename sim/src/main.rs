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
//! With `-p 3` (or CUDA_MPS_PROTOCOL_VERSION=3, which wins over the flag) the daemon is an
//! MPS v3 one instead (`v3`): named servers, namespaces with their own limits and sockets
//! (`<pipe>/<server>/<ns>/control`), the `<module> <verb> …` CLI with its authorization by
//! uid, and one server process for every uid. The v3 rules come from NVIDIA's MPS guide
//! (docs.nvidia.com/deploy/mps, "MPS v3 interface", "Namespaces", "Configuration file") and
//! from measurements on driver r615 by NVIDIA's KAI GPU-fractioning agent and NVIDIA
//! Dynamo's GPU-sharing docs; none of it has been run on a driver here.
//! GPUSHARE_SIM_PROTOCOLS=2 makes the binary one from before driver 615 (`-p 3` refused).
//! Run under the name `nvidia-smi` (a link), it is a fake `nvidia-smi memory-limits`
//! (`smi`), the driver's per-cgroup memory limits.
//!
//! This binary stands alone (its own package, sim/, a test tool that is not shipped): it does
//! not use the gpushare library, so it builds even while the library does not. Its end-to-end
//! tests are sim/tests/sim.rs. Environment: CUDA_MPS_PIPE_DIRECTORY (default /tmp/nvidia-mps),
//! CUDA_MPS_LOG_DIRECTORY (default /var/log/nvidia-mps), CUDA_VISIBLE_DEVICES (logged only),
//! CUDA_MPS_PROTOCOL_VERSION and GPUSHARE_SIM_PROTOCOLS (above),
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
mod smi;
mod subreaper;
mod v3;
mod wire;

use std::path::PathBuf;
use std::process::ExitCode;

use args::Mode;
use daemon::{DaemonOptions, Launch};

const DEFAULT_PIPE_DIR: &str = "/tmp/nvidia-mps";
const DEFAULT_LOG_DIR: &str = "/var/log/nvidia-mps";

fn main() -> ExitCode {
    let mut all = std::env::args_os().map(|a| a.to_string_lossy().into_owned());
    let argv0 = all.next().unwrap_or_default();
    let argv: Vec<String> = all.collect();
    // Run as `nvidia-smi` (a link to this binary): the fake `nvidia-smi memory-limits`.
    if std::path::Path::new(&argv0).file_name() == Some(std::ffi::OsStr::new("nvidia-smi")) {
        return ExitCode::from(smi::run(&argv0, &argv));
    }
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
        Mode::Help { protocol } => match resolve(protocol) {
            Ok(_) => {
                print!("{}", v3::grammar::general_usage(!legacy_only()));
                0
            }
            Err(code) => code,
        },
        Mode::Daemon {
            background,
            multiuser,
            protocol,
        } => match (resolve(protocol), background) {
            (Err(code), _) => code,
            (Ok(p), true) => report(daemon::launch_background(multiuser, p)),
            (Ok(2), false) => {
                report(daemon::run(&daemon_options(multiuser), Launch::Foreground).map(|()| 0))
            }
            (Ok(_), false) => report(v3::daemon::run(
                &daemon_options(multiuser),
                Launch::Foreground,
            )),
        },
        Mode::DaemonChild {
            multiuser,
            protocol: 3,
        } => report(v3::daemon::run(
            &daemon_options(multiuser),
            Launch::Background,
        )),
        Mode::DaemonChild { multiuser, .. } => {
            report(daemon::run(&daemon_options(multiuser), Launch::Background).map(|()| 0))
        }
        Mode::Cli(words) if legacy_only() => {
            eprintln!(
                "gpushare-mps-sim: {}",
                args::UsageError::Unknown(words.first().cloned().unwrap_or_default())
            );
            2
        }
        Mode::Cli(words) => v3::cli::run(
            &env_dir("CUDA_MPS_PIPE_DIRECTORY", DEFAULT_PIPE_DIR),
            &words,
        ),
        Mode::Control => control_client::run(&env_dir("CUDA_MPS_PIPE_DIRECTORY", DEFAULT_PIPE_DIR)),
        Mode::Quit => control_client::quit(&env_dir("CUDA_MPS_PIPE_DIRECTORY", DEFAULT_PIPE_DIR)),
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

/// GPUSHARE_SIM_PROTOCOLS=2: behave as a binary from before driver 615 (protocol 2 only).
fn legacy_only() -> bool {
    std::env::var("GPUSHARE_SIM_PROTOCOLS").is_ok_and(|v| v.trim() == "2")
}

/// The protocol a daemon or `-h` runs, or the exit code of a usage error already printed.
fn resolve(flag: Option<u8>) -> Result<u8, u8> {
    let env = std::env::var("CUDA_MPS_PROTOCOL_VERSION").ok();
    let supported = std::env::var("GPUSHARE_SIM_PROTOCOLS").ok();
    args::resolve_protocol(flag, env.as_deref(), supported.as_deref()).map_err(|e| {
        eprintln!("gpushare-mps-sim: {e}");
        2
    })
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
