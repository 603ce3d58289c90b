//! The reaper: one short-lived detached process per new daemon directory, so that what a
//! create that fails leaves behind (the directory and its two tmpfs mounts, with no
//! supervisor) goes without an operator and without waiting for the next create.
//!
//! Whoever makes a new daemon directory (the shim, or the hook's `ensure` in hook-only
//! mode and for `gpushare daemon start`) starts `gpushare daemon reap --id <id>` the way
//! the supervisor is started (`launch`: by the agent where one runs): stdio on /dev/null,
//! an explicit environment, its own session, no inherited fds. It looks at the directory every few milliseconds
//! (`StateDir::reclaim_abandoned`) and exits as soon as a supervisor runs the daemon or
//! the daemon was ready once (the create worked: from then on the directory is the
//! supervisor's, and `gc`'s if that one crashes), the directory is gone, or it has
//! removed it (nothing uses it: the pending create's creator, runc, has exited and no
//! hook took it over, or the daemon never got ready).
//! Invariants: it never waits for a lock (a create holding the identity's lock is looked
//! at again later); it lives at most `mps.pending-grace` (the longest a pending create
//! may keep a directory in use) plus one look; it removes only through
//! `reclaim_abandoned`, under the identity's lock.

use std::time::{Duration, Instant};

use crate::config::Config;
use crate::state::{Abandoned, StateDir};

/// The reaper's loop (the caller has detached): returns what it last found.
pub(crate) fn run(cfg: &Config, id: &str) -> anyhow::Result<Abandoned> {
    let state = StateDir::new(&cfg.state_dir);
    let grace = cfg.mps.pending_grace();
    let mut last = Abandoned::Busy;
    poll_looks(Instant::now() + grace, || {
        // A daemon that was ready once belongs to its supervisor (and to `gc` if that
        // one crashes): the create worked, whenever this reaper got to look.
        if state
            .read_record(id)
            .ok()
            .flatten()
            .is_some_and(|r| r.ready_at.is_some())
        {
            last = Abandoned::Supervised;
            return Ok(true);
        }
        last = state.reclaim_abandoned(id, grace.as_secs())?;
        Ok(!matches!(last, Abandoned::Busy | Abandoned::InUse))
    })?;
    match last {
        Abandoned::Reclaimed => {
            tracing::info!(daemon = %id, "a create left this daemon directory without a supervisor or a container; removed it and its tmpfs mounts")
        }
        Abandoned::Busy | Abandoned::InUse => {
            tracing::debug!(daemon = %id, ?last, "reaper leaves: still in use at its deadline")
        }
        Abandoned::Gone | Abandoned::Supervised => {}
    }
    Ok(last)
}

/// Calls `look` every few milliseconds (5 ms, doubling to 100 ms: a create's supervisor
/// is named within tens of milliseconds, and a failed runc exits as fast) until it says
/// done, errs, or `deadline` passes.
fn poll_looks(
    deadline: Instant,
    mut look: impl FnMut() -> Result<bool, crate::state::StateError>,
) -> anyhow::Result<()> {
    let done = crate::util::poll_until(
        deadline,
        Duration::from_millis(5),
        Duration::from_millis(100),
        || match look() {
            Ok(true) => Some(Ok(())),
            Ok(false) => None,
            Err(e) => Some(Err(e)),
        },
    );
    match done {
        Some(r) => Ok(r?),
        None => Ok(()),
    }
}
