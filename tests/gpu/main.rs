//! The real-GPU validation tier of gpushare, as a test target with a main of its own
//! (`harness = false`): its sections run in order, one after the other, and print every
//! check as PASS, FAIL, SKIP or INFO with one line of evidence, whatever libtest would
//! capture. docs/gpu-validation.md says what each section shows and what to carry to a GPU
//! machine.
//!
//! ```text
//! cargo test --test gpu [-- OPTIONS]        # as root, from the repository root
//! target/release/deps/gpu-<hash> [OPTIONS]  # the executable alone, on a machine without cargo
//! ```
//!
//! Modes: on a machine where `nvidia-smi -L` lists a GPU and `nvidia-cuda-mps-control` is on
//! PATH, the real tier: `gpushare daemon start|stop` (the library's own daemon code) with the
//! real control daemon and a PyTorch workload (scripts/gpu/workload.py) run as numeric UIDs
//! 1000-4000. Anywhere else it prints `gpu tier: SKIP real GPU: <reason>` and runs the same
//! orchestration against the simulator (gpushare-mps-sim as the control binary, a file
//! inventory with one H100-like GPU, `gpushare-mps-sim client` as the workload), which is
//! what `cargo test --workspace --tests` (scripts/test, CI) exercises; `--simulate` asks for
//! it on a GPU machine too. `--containers` adds two users' PyTorch containers through
//! gpushare-runtime and real runc (real GPU only; containers.rs).
//!
//! Exit status: 0 when no check failed, 1 when a check that should hold failed (the restore
//! checks included), 2 on a usage or setup error (not root, a binary missing). Raw figures:
//! JSON lines appended to `--out`.
//!
//! Invariants: a test that cannot run here says why out loud, never passes silently; the
//! restore runs whatever happened in the sections; nothing compiled in (`CARGO_BIN_EXE_*`,
//! `CARGO_MANIFEST_DIR`) is required at run time (see `tier::locate_bins`).

// Cargo compiles a `harness = false` target with `--cfg test` but without libtest: the
// modules' `#[test]` functions vanish (gpu-unit runs them) and leave their helpers unused.
#![cfg_attr(test, allow(unused_imports, dead_code))]

mod calc;
mod client;
mod coloc;
mod containers;
mod helper;
mod opts;
mod proc;
mod round4;
mod round5;
mod sections;
mod tier;
mod v3backend;

use std::process::{Command, ExitCode};
use std::time::Duration;

use tier::ME;

/// Why the real tier cannot run here; `None` when it can.
fn no_gpu_reason() -> Option<String> {
    if testkit::common::which("nvidia-smi").is_none() {
        return Some("nvidia-smi not found on PATH".into());
    }
    let l = proc::run(
        Command::new("nvidia-smi").arg("-L"),
        None,
        Duration::from_secs(30),
        Duration::from_secs(5),
    );
    if !l.ok() {
        return Some(format!(
            "nvidia-smi -L failed with exit code {}: {}",
            l.code,
            l.out.lines().next().unwrap_or_default()
        ));
    }
    if !l.out.lines().any(|line| line.starts_with("GPU ")) {
        return Some("nvidia-smi -L lists no GPU".into());
    }
    if testkit::common::which("nvidia-cuda-mps-control").is_none() {
        return Some("nvidia-cuda-mps-control not found on PATH".into());
    }
    None
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Some(code) = helper::run(&args) {
        return ExitCode::from(code);
    }
    let opts = match opts::parse(&args, &|k| std::env::var(k).ok()) {
        Ok(o) => o,
        // A usage error (exit 2) or --help (exit 0), printed as clap prints it.
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(e.exit_code() as u8);
        }
    };
    if opts.libtest.list {
        println!("{}: test", opts::TEST_NAME);
        return ExitCode::SUCCESS;
    }
    if let Some(why) = opts.libtest.filtered_out(opts::TEST_NAME) {
        println!("{ME}: nothing to run: {why}");
        return ExitCode::SUCCESS;
    }
    let mut simulate = opts.simulate;
    if !simulate {
        if let Some(reason) = no_gpu_reason() {
            println!("{ME}: SKIP real GPU: {reason}");
            println!("{ME}: running the simulated orchestration instead (gpushare-mps-sim, a file inventory)");
            simulate = true;
        }
    }
    ExitCode::from(run(&opts, simulate))
}

fn run(opts: &opts::Options, simulate: bool) -> u8 {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("{ME}: error: run as root (sudo): it starts MPS daemons as other UIDs and mounts tmpfs; the README's test command (./scripts/test) runs as root");
        return 2;
    }
    let setup = tier::locate_bins(opts.bin_dir.as_deref(), simulate)
        .and_then(|bins| tier::Tier::setup(opts, simulate, bins));
    let mut t = match setup {
        Ok(t) => t,
        Err(e) => {
            eprintln!("{ME}: error: {e}");
            return 2;
        }
    };
    tier::catch_signals();
    let ran =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| sections::run(&mut t, opts)));
    let (aborted, stop) = match ran {
        Ok(sections::Ended::Done) => (None, None),
        Ok(sections::Ended::Stop(code)) => (None, Some(code)),
        Err(panic) => {
            let why = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic".into());
            (Some(why), None)
        }
    };
    let code = t.restore(aborted);
    code.max(stop.unwrap_or(0))
}
