//! How a supervisor or a reaper is started so that it belongs to no engine.
//!
//! A process that exits leaves its children to the nearest ancestor that is a child
//! subreaper (`PR_SET_CHILD_SUBREAPER`), not to PID 1, and conmon and containerd's runc
//! shim are subreapers: a supervisor the hook starts itself is adopted by the engine,
//! whatever it does to detach (a new session, a double fork). conmon 2.1.12 then waits for
//! it before `podman run` returns; 2.1.6 stays alive as long as it does. So the hook asks
//! the node's agent (`agent`, `gpushare agent`), which is in no engine's process tree, to
//! start the process as its own child; only where no agent answers does the hook start it
//! itself, with one warn line for a supervisor saying that the engine adopts it.
//!
//! Invariants: either way the process is the one `job::command` spells; a missing,
//! refusing or stalled agent never fails the create (a refusal is logged and the process
//! is started here), and every exchange with it has a deadline.

use std::process::Child;
use std::time::Duration;

use anyhow::Context;

use super::agent;
use super::job::{command, Job};
use crate::config::Config;
use crate::state::{ProcRef, StateDir};

/// A started supervisor or reaper: this process's child, or the agent's.
#[derive(Debug)]
pub(crate) enum Launched {
    Here(Child),
    Agent(ProcRef),
}

impl Launched {
    pub(crate) fn pid(&self) -> u32 {
        match self {
            Launched::Here(child) => child.id(),
            Launched::Agent(p) => p.pid as u32,
        }
    }

    /// Whether it has exited (an agent's child counts as exited once it is a zombie).
    pub(crate) fn exited(&mut self) -> bool {
        match self {
            Launched::Here(child) => child.try_wait().ok().flatten().is_some(),
            Launched::Agent(p) => !p.alive(),
        }
    }

    /// SIGTERM, then SIGKILL if it is still there after `grace` (this process's child is
    /// reaped; the agent reaps its own).
    pub(crate) fn stop(&mut self, grace: Duration) {
        use nix::sys::signal::{kill, Signal};
        match self {
            Launched::Here(child) => {
                if let Ok(None) = child.try_wait() {
                    let _ = kill(
                        nix::unistd::Pid::from_raw(child.id() as i32),
                        Signal::SIGTERM,
                    );
                }
                crate::util::wait_or_kill(child, grace);
            }
            Launched::Agent(p) => {
                let p = *p;
                if p.alive() {
                    let _ = kill(nix::unistd::Pid::from_raw(p.pid), Signal::SIGTERM);
                }
                let every = Duration::from_millis(10);
                let gone = crate::util::poll_until(
                    std::time::Instant::now() + grace,
                    every,
                    every,
                    || (!p.alive()).then_some(()),
                );
                if gone.is_none() && p.alive() {
                    let _ = kill(nix::unistd::Pid::from_raw(p.pid), Signal::SIGKILL);
                }
            }
        }
    }
}

/// Starts `job` for daemon `id`: by the node's agent when one answers, else here (`exe`
/// is this very binary, looked up only then).
pub(crate) fn launch(
    cfg: &Config,
    exe: impl FnOnce() -> anyhow::Result<std::path::PathBuf>,
    job: Job,
    id: &str,
) -> anyhow::Result<Launched> {
    let state = StateDir::new(&cfg.state_dir);
    let why = match agent::ask(&state, job, id) {
        Ok(started) => {
            tracing::debug!(daemon = %id, pid = started.pid, job = job.word(), "started by the agent");
            return Ok(Launched::Agent(started));
        }
        Err(e) => e,
    };
    match job {
        Job::Supervise => tracing::warn!(
            daemon = %id,
            "no gpushare agent started the supervisor ({why}); started here instead, so the engine's subreaper (conmon, containerd's shim) adopts it, and Podman 5 and CRI-O wait for it (start `gpushare agent`: docs/install.md)"
        ),
        Job::Reap => tracing::debug!(daemon = %id, "reaper started here: {why}"),
    }
    let exe = exe()?;
    let child = command(&exe, cfg.path.as_deref(), job, id)
        .spawn()
        .with_context(|| format!("start the {} {}", job.word(), exe.display()))?;
    Ok(Launched::Here(child))
}
