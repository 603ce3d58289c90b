//! The locks: one flock per daemon identity (`locks/<id>.lock`), one per daemon's
//! supervisor (`locks/<id>.sup`), the node lock (`locks/node.lock`), and one per daemon's
//! container records (`mps/<id>/containers/records.lock`: shared by whoever writes or
//! removes a record, exclusive while a sweep compares and removes what it judged stale).
//!
//! Invariants: lock files are opened without following a link and never removed (a
//! records lock goes with its daemon's directory); the node lock is taken after an
//! identity's lock, never before (under it, other identities' locks are only tried, never
//! waited for: `reclaim`); every wait has a deadline and a timeout names the lock. A supervisor holds its daemon's supervisor lock for its
//! whole life and holds no other lock while waiting for it.

use std::fs::File;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use nix::fcntl::{Flock, FlockArg};

use super::dir::{io, StateDir, StateError};
use crate::util;

impl StateDir {
    /// Takes the exclusive lock of one daemon identity, waiting until `deadline`.
    pub fn lock(&self, id: &str, deadline: Instant) -> Result<Flock<File>, StateError> {
        Self::check_id(id)?;
        self.lock_file(self.lock_path(id), deadline)
    }

    /// Takes the node lock, which serializes the creation of new daemon directories (so
    /// two creates cannot both pass a cap). Taken after an identity's lock, never before.
    pub(crate) fn lock_node(&self, deadline: Instant) -> Result<Flock<File>, StateError> {
        self.lock_file(self.node_lock_path(), deadline)
    }

    /// The supervisor lock of daemon `id`: held by its supervisor from before it names
    /// itself in the record until it exits, so that one identity never has two
    /// supervisors (and two daemons) even when the process that started one was killed
    /// before the supervisor could name itself. `None` while another process holds it.
    pub(crate) fn try_lock_supervisor(&self, id: &str) -> Result<Option<Flock<File>>, StateError> {
        Self::check_id(id)?;
        match self.lock_file(self.supervisor_lock_path(id), Instant::now()) {
            Ok(lock) => Ok(Some(lock)),
            Err(StateError::LockTimeout { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The agent's lock (`mps::agent`), held by the node's one agent for its whole life;
    /// `None` while another agent holds it.
    pub(crate) fn try_lock_agent(&self) -> Result<Option<Flock<File>>, StateError> {
        self.try_lock_one(self.agent_lock_path())
    }

    /// The GPU process watcher's lock (`watch`), held by the node's one watcher for its
    /// whole life; `None` while another watcher holds it.
    pub(crate) fn try_lock_watch(&self) -> Result<Option<Flock<File>>, StateError> {
        self.try_lock_one(self.watch_lock_path())
    }

    /// The records lock of daemon `id`, shared (a writer of one container record) or
    /// exclusive (a sweep removing records it judged stale), waiting until `deadline`.
    /// Held for one write or one comparison and removal, never across a wait for anything
    /// else. A daemon without its `containers/` directory has no records to lock: the
    /// error is `StateError::Io` with `NotFound`, as a write there would fail.
    pub(crate) fn lock_records(
        &self,
        id: &str,
        hold: Hold,
        deadline: Instant,
    ) -> Result<Flock<File>, StateError> {
        Self::check_id(id)?;
        let path = self.records_lock_path(id);
        let file = open_lock(&path).map_err(io("open lock", &path))?;
        take(path, file, hold, deadline)
    }

    /// The NRI validator's lock (`nri::validator`), held by the node's one connected
    /// validator for its whole life; `None` while another validator holds it.
    pub(crate) fn try_lock_nri_validator(&self) -> Result<Option<Flock<File>>, StateError> {
        self.try_lock_one(self.nri_validator_lock_path())
    }

    fn try_lock_one(&self, path: PathBuf) -> Result<Option<Flock<File>>, StateError> {
        match self.lock_file(path, Instant::now()) {
            Ok(lock) => Ok(Some(lock)),
            Err(StateError::LockTimeout { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn lock_file(&self, path: PathBuf, deadline: Instant) -> Result<Flock<File>, StateError> {
        let file = match open_lock(&path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                // First use of this state dir on this host.
                self.ensure_root()?;
                open_lock(&path)
            }
            other => other,
        }
        .map_err(io("open lock", &path))?;
        take(path, file, Hold::Exclusive, deadline)
    }
}

/// How a lock is held: by one process, or by any number of them at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Hold {
    Shared,
    Exclusive,
}

fn open_lock(path: &std::path::Path) -> std::io::Result<File> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .mode(0o600)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(path)
}

/// Takes the lock on `file`, trying until `deadline`.
fn take(
    path: PathBuf,
    file: File,
    hold: Hold,
    deadline: Instant,
) -> Result<Flock<File>, StateError> {
    let started = Instant::now();
    let arg = match hold {
        Hold::Shared => FlockArg::LockSharedNonblock,
        Hold::Exclusive => FlockArg::LockExclusiveNonblock,
    };
    // Flock::lock takes the file and hands it back when the lock is busy: `file` is
    // there again for every next try.
    let mut file = Some(file);
    let taken = util::poll_until(
        deadline,
        Duration::from_millis(1),
        Duration::from_millis(20),
        || match Flock::lock(file.take()?, arg) {
            Ok(lock) => Some(Ok(lock)),
            Err((f, nix::errno::Errno::EWOULDBLOCK | nix::errno::Errno::EINTR)) => {
                file = Some(f);
                None
            }
            Err((_, e)) => Some(Err(e)),
        },
    );
    match taken {
        Some(Ok(lock)) => Ok(lock),
        Some(Err(e)) => Err(io("lock", &path)(std::io::Error::from_raw_os_error(
            e as i32,
        ))),
        None => Err(StateError::LockTimeout {
            path,
            waited: started.elapsed(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lock_times_out_while_held() {
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::new(dir.path().join("s"));
        state.ensure_root().unwrap();
        let id = "0123456789abcdef0123456789abcdef";
        let held = state.lock(id, Instant::now()).unwrap();
        let err = state
            .lock(id, Instant::now() + Duration::from_millis(30))
            .unwrap_err();
        assert!(matches!(err, StateError::LockTimeout { .. }), "{err}");
        drop(held);
        assert!(state.lock(id, Instant::now()).is_ok());
    }

    #[test]
    fn the_supervisor_lock_is_held_by_one() {
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::new(dir.path().join("s"));
        let id = "0123456789abcdef0123456789abcdef";
        let held = state.try_lock_supervisor(id).unwrap().expect("free");
        assert!(state.try_lock_supervisor(id).unwrap().is_none());
        // Not the identity's lock: a create may hold that one meanwhile.
        assert!(state.lock(id, Instant::now()).is_ok());
        drop(held);
        assert!(state.try_lock_supervisor(id).unwrap().is_some());
    }
}
