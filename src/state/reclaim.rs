//! Taking back daemon directories that hold a place nobody uses: abandoned ones (no
//! supervisor and no live container: what a create that failed or was killed leaves) and
//! idle ones (a supervisor, no live container), which a cap may need the room of.
//!
//! Invariants: a directory is reclaimed only under its identity's lock, taken without
//! waiting (the caller may hold the node lock, and an identity's lock is never waited for
//! after it), and only through `remove_if_unused`, so a create that saw the directory
//! keeps it; an idle daemon is stopped the way `gpushare daemon stop` stops one (SIGTERM
//! to its supervisor, which quits it cleanly) before its directory goes.

use std::time::Instant;

use super::budget::Budget;
use super::dir::{StateDir, StateError};

/// What `reclaim_abandoned` found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Abandoned {
    /// The directory is not there (any more).
    Gone,
    /// Another process holds the identity's lock (a create, a stop, an idle removal).
    Busy,
    /// A supervisor runs it: not abandoned.
    Supervised,
    /// No supervisor, but a live container or a pending create still uses it.
    InUse,
    /// It was abandoned and is removed, its tmpfs mounts with it.
    Reclaimed,
}

impl StateDir {
    /// The identity's lock if no other process holds it now; `None` if one does.
    fn try_lock(&self, id: &str) -> Result<Option<nix::fcntl::Flock<std::fs::File>>, StateError> {
        match self.lock(id, Instant::now()) {
            Ok(lock) => Ok(Some(lock)),
            Err(StateError::LockTimeout { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Whether a supervisor runs daemon `id`: one holds its supervisor lock (also one that
    /// has not named itself in the record yet), or the record names a live one.
    fn supervised(&self, id: &str) -> bool {
        matches!(self.try_lock_supervisor(id), Ok(None))
            || self
                .read_record(id)
                .ok()
                .flatten()
                .is_some_and(|r| r.supervisor.is_some_and(|p| p.alive()))
    }

    /// Removes daemon `id`'s directory (both tmpfs mounts, whatever was planted) if it is
    /// abandoned: no process holds its identity's lock, no supervisor runs it, and no
    /// container record is live (a pending create's names its creator, which must run).
    /// The processes a stale record still names are killed first.
    pub(crate) fn reclaim_abandoned(
        &self,
        id: &str,
        pending_grace: u64,
    ) -> Result<Abandoned, StateError> {
        Self::check_id(id)?;
        if std::fs::symlink_metadata(self.daemon_dir(id)).is_err() {
            return Ok(Abandoned::Gone);
        }
        let Some(_lock) = self.try_lock(id)? else {
            return Ok(Abandoned::Busy);
        };
        if self.supervised(id) {
            return Ok(Abandoned::Supervised);
        }
        let rec = self.read_record(id).ok().flatten();
        let removed = self.remove_if_unused(id, pending_grace, |_| {
            if let Some(rec) = &rec {
                rec.kill_processes();
            }
        })?;
        Ok(if removed {
            Abandoned::Reclaimed
        } else {
            Abandoned::InUse
        })
    }

    /// Stops daemon `id` and removes its directory if it is idle: no process holds its
    /// identity's lock, a supervisor runs it, no container record is live, and no MPS
    /// client is attached (`Budget::clients`; a daemon that does not say stays). Its
    /// supervisor gets `budget.stop_grace` to quit the daemon. A create that comes while it
    /// stops keeps the directory (`remove_if_unused`) and its hook starts the daemon again.
    /// Returns whether the directory went.
    pub(crate) fn reclaim_idle(&self, id: &str, budget: &Budget) -> Result<bool, StateError> {
        Self::check_id(id)?;
        let Some(_lock) = self.try_lock(id)? else {
            return Ok(false);
        };
        let Some(rec) = self.read_record(id).ok().flatten() else {
            return Ok(false);
        };
        if !rec.supervisor.is_some_and(|p| p.alive())
            || !self.live_containers(id, budget.pending_grace)?.is_empty()
        {
            return Ok(false);
        }
        if let Some(ask) = &budget.clients {
            if ask(self, id, &rec.identity) != Some(false) {
                tracing::warn!(daemon = %id, "an idle daemon has MPS clients but no live container record (a client without a record), or did not say: not stopped to make room");
                return Ok(false);
            }
        }
        rec.stop_processes(budget.stop_grace);
        let removed = self.remove_if_unused(id, budget.pending_grace, |_| {})?;
        if removed {
            tracing::info!(daemon = %id, "idle MPS daemon stopped and removed to make room under a cap");
        }
        Ok(removed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{ContainerRecord, DaemonRecord, DaemonStatus, ProcRef};

    /// The one identity these tests' daemon has (a host-IPC per-user daemon on GPU 0).
    fn identity() -> crate::identity::Identity {
        crate::identity::Identity {
            devices: vec!["GPU-8f8bff94-112e-9541-43da-cfd453333404".into()],
            uid: 1000,
            gid: 1000,
            multi_user: false,
            limits: Default::default(),
            ipc_host: true,
            tenant: None,
            v3: false,
        }
    }

    fn record(id: &str, supervisor: Option<ProcRef>) -> DaemonRecord {
        let identity = identity();
        assert_eq!(identity.id(), id);
        DaemonRecord {
            id: id.into(),
            identity,
            status: DaemonStatus::Failed,
            supervisor,
            daemon: None,
            started_at: 1,
            ready_at: None,
            restarts: 0,
            error: None,
            limits_unconfirmed_since: None,
        }
    }

    #[test]
    fn only_an_unlocked_unsupervised_unused_directory_is_reclaimed() {
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::new(dir.path().join("s"));
        state.ensure_root().unwrap();
        let id = identity().id();
        assert_eq!(state.reclaim_abandoned(&id, 30).unwrap(), Abandoned::Gone);
        std::fs::create_dir_all(state.containers_dir(&id)).unwrap();
        std::fs::create_dir_all(state.pipe_dir(&id)).unwrap();
        // This process as the supervisor the record names: supervised.
        state
            .write_record(&record(&id, ProcRef::of(std::process::id() as i32)))
            .unwrap();
        assert_eq!(
            state.reclaim_abandoned(&id, 30).unwrap(),
            Abandoned::Supervised
        );
        state.write_record(&record(&id, None)).unwrap();
        // The supervisor lock held (a supervisor that has not named itself yet).
        let sup = state.try_lock_supervisor(&id).unwrap().unwrap();
        assert_eq!(
            state.reclaim_abandoned(&id, 30).unwrap(),
            Abandoned::Supervised
        );
        drop(sup);
        // The identity's lock held (a create at work).
        let held = state.lock(&id, Instant::now()).unwrap();
        assert_eq!(state.reclaim_abandoned(&id, 30).unwrap(), Abandoned::Busy);
        drop(held);
        // A pending create whose creator runs (this process).
        let pending = ContainerRecord::pending("c".into(), None);
        state.add_container(&id, &pending).unwrap();
        assert_eq!(state.reclaim_abandoned(&id, 30).unwrap(), Abandoned::InUse);
        assert!(!state.reclaim_idle(&id, &budget(None)).unwrap());
        // Its creator gone: abandoned.
        let dead = ContainerRecord {
            creator: Some(ProcRef {
                pid: i32::MAX,
                start_time: 1,
            }),
            ..pending
        };
        state.add_container(&id, &dead).unwrap();
        assert_eq!(
            state.reclaim_abandoned(&id, 30).unwrap(),
            Abandoned::Reclaimed
        );
        assert!(!state.daemon_dir(&id).exists());
    }

    fn budget(clients: Option<std::sync::Arc<crate::state::AskClients>>) -> Budget {
        Budget {
            clients,
            ..crate::state::skeleton::test_budget(1, 1)
        }
    }

    /// A cap never stops an idle daemon (no live record) that still has MPS clients, or
    /// that does not say whether it has: only one that answers "none".
    #[test]
    fn a_cap_stops_no_idle_daemon_with_clients_or_that_does_not_say() {
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::new(dir.path().join("s"));
        state.ensure_root().unwrap();
        let id = identity().id();
        let id = id.as_str();
        std::fs::create_dir_all(state.containers_dir(id)).unwrap();
        // The supervisor the record names: a process of this test's, stopped by SIGTERM.
        let mut supervisor = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = supervisor.id() as i32;
        state.write_record(&record(id, ProcRef::of(pid))).unwrap();
        for (answer, what) in [(Some(true), "clients attached"), (None, "no answer")] {
            let ask: std::sync::Arc<crate::state::AskClients> = std::sync::Arc::new(
                move |_: &StateDir, _: &str, _: &crate::identity::Identity| answer,
            );
            assert!(
                !state.reclaim_idle(id, &budget(Some(ask))).unwrap(),
                "{what}"
            );
            assert!(state.daemon_dir(id).exists(), "{what}");
            assert!(
                ProcRef::of(pid).is_some(),
                "{what}: the supervisor was stopped"
            );
        }
        let none: std::sync::Arc<crate::state::AskClients> =
            std::sync::Arc::new(|_: &StateDir, _: &str, _: &crate::identity::Identity| Some(false));
        assert!(state.reclaim_idle(id, &budget(Some(none))).unwrap());
        assert!(!state.daemon_dir(id).exists());
        supervisor.wait().unwrap();
    }
}
