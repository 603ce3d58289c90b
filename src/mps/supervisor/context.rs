//! The supervisor's own state: what one supervisor knows of its daemon (`Supervisor`,
//! built by `run` in the module root), and its writes to the daemon's record.
//!
//! Invariants: every record write names this supervisor (`update`); giving up leaves the
//! record failed with no daemon (`failed`). The parts (`limits`, `logs`, `confine`,
//! `namespaces`, `lifecycle`) add their methods to `Supervisor` and take it from here,
//! never from the module root, so the module's files depend one way.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;

use crate::identity::Identity;
use crate::mps::control::Control;
use crate::state::{DaemonStatus, ProcRef, StateDir};

/// One supervisor: its daemon's identity, paths and settings, read once from the config.
pub(super) struct Supervisor {
    pub(super) state: StateDir,
    pub(super) id: String,
    pub(super) ident: Identity,
    pub(super) binary: PathBuf,
    pub(super) multi_user_flag: String,
    pub(super) start_timeout: Duration,
    pub(super) control: Control,
    pub(super) log_size: u64,
    /// How often limits are checked; `None` when there is nothing to enforce.
    pub(super) limit_check: Option<Duration>,
    /// This process: every record update names it (see `update`).
    pub(super) me: Option<ProcRef>,
    /// `driver-root`: the daemon's servers load the driver libraries under it.
    pub(super) driver_root: Option<PathBuf>,
    /// `mps.pending-grace`'s seconds: how long a pending container record counts as live.
    pub(super) pending_grace: u64,
}

impl Supervisor {
    /// Changes the record with `f`. Every write names this supervisor: it holds the
    /// supervisor lock, so it is the daemon's one supervisor, and a create that replaced
    /// the record meanwhile (its own supervisor waits for the lock) learns so.
    pub(super) fn update(
        &self,
        f: impl FnOnce(&mut crate::state::DaemonRecord),
    ) -> anyhow::Result<()> {
        let mut rec = self
            .state
            .read_record(&self.id)?
            .with_context(|| format!("record of daemon {} disappeared", self.id))?;
        f(&mut rec);
        rec.supervisor = self.me;
        self.state.write_record(&rec)?;
        Ok(())
    }
    /// Records that the supervisor gives up with `e` (status failed, no daemon): the hook
    /// waiting on a start reports it to the user. Returns `e` for the caller to return.
    pub(super) fn failed(&self, e: anyhow::Error) -> anyhow::Error {
        let msg = format!("{e:#}");
        let _ = self.update(|r| {
            r.status = DaemonStatus::Failed;
            r.error = Some(msg);
            r.daemon = None;
        });
        e
    }
    /// Empties the pipe directory: a socket or pid file left by a dead daemon is stale,
    /// and anything a tenant planted (a directory named `control`) goes too.
    /// A v3 daemon's server directory stays: the namespace directories in it are bound
    /// into running containers, and a restarted daemon makes their sockets again in them.
    pub(super) fn clean_pipe_dir(&self) {
        let keep = self.ident.v3.then_some(crate::identity::V3_SERVER);
        if let Err(e) = self.state.clean_pipe_dir(&self.id, keep) {
            tracing::warn!(daemon = %self.id, error = %e, "cannot empty the pipe directory");
        }
    }
}
