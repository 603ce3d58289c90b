//! Removing a daemon's directories, whatever a tenant planted in them, and without
//! racing a create (`remove_if_unused`: the directory is renamed to a tombstone before
//! its last check).
//!
//! Invariants: the tmpfs mounts are unmounted first, then the tree goes with
//! `fsops::remove_all`/`remove_contents`, which never follow a link and need a fixed
//! number of fds whatever was planted; a tombstone (`.<id>.removing`) a crash left is
//! finished by `gc`.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use super::dir::{io, StateDir, StateError};
use super::record::{ContainerRecord, MAX_RECORD_BYTES};
use crate::fsops;

/// The tmpfs mounts of a daemon directory, unmounted before it is removed.
pub(super) const MOUNTS: [&str; 2] = ["shm", "log"];

/// Whether `<dir>/<name>` is a mount point (its device differs from `dir`'s).
pub(super) fn mounted_in(dir: &Path, name: &str) -> bool {
    match (
        std::fs::symlink_metadata(dir),
        std::fs::symlink_metadata(dir.join(name)),
    ) {
        (Ok(d), Ok(s)) => s.is_dir() && s.dev() != d.dev(),
        _ => false,
    }
}

/// Unmounts `<dir>/shm` and `<dir>/log` if mounted and removes `dir`, whatever a tenant
/// planted in it (`fsops::remove_all`); a missing `dir` is fine.
pub(super) fn remove_tree(dir: &Path) -> Result<(), StateError> {
    for name in MOUNTS {
        if mounted_in(dir, name) {
            let _ = nix::mount::umount2(&dir.join(name), nix::mount::MntFlags::MNT_DETACH);
        }
    }
    fsops::remove_all(dir).map_err(io("remove", dir))
}

impl StateDir {
    /// Unmounts the log and shm tmpfs and removes one daemon's directories (daemon
    /// stopped), whatever was planted in them.
    pub(crate) fn remove_daemon_dir(&self, id: &str) -> Result<(), StateError> {
        Self::check_id(id)?;
        remove_tree(&self.daemon_dir(id))
    }

    /// Empties daemon `id`'s pipe directory in place (it is bind-mounted into running
    /// containers): a socket, a pid file or anything else a tenant or a dead daemon left
    /// there, a directory planted under a name the daemon needs (`control`) included.
    /// A missing pipe directory is fine; a symlink in its place is refused.
    pub(crate) fn clean_pipe_dir(&self, id: &str, keep: Option<&str>) -> Result<(), StateError> {
        Self::check_id(id)?;
        let pipe = self.pipe_dir(id);
        let emptied = match keep {
            None => fsops::remove_contents(&pipe),
            Some(keep) => fsops::remove_contents_but(&pipe, keep),
        };
        match emptied {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io("empty", &pipe)(e)),
        }
    }

    fn tombstone(&self, id: &str) -> PathBuf {
        self.mps_dir().join(format!(".{id}.removing"))
    }

    /// Removes an unused daemon's directories without racing a create. Call with the
    /// identity's lock held and the daemon stopped or about to be (`before_remove` runs
    /// after the last check). The shim writes a pending container record *before* it
    /// checks the directories (without the lock), so: rename the directory away
    /// atomically, then look for records once more inside it; a create that saw the
    /// directory wrote its record before the rename and is found here (the rename is
    /// undone), and a create that did not see it takes the lock and rebuilds it.
    /// Returns whether the directory was removed.
    pub(crate) fn remove_if_unused(
        &self,
        id: &str,
        pending_grace: u64,
        before_remove: impl FnOnce(&Path),
    ) -> Result<bool, StateError> {
        Self::check_id(id)?;
        if !self.live_containers(id, pending_grace)?.is_empty() {
            return Ok(false);
        }
        let dir = self.daemon_dir(id);
        let tomb = self.tombstone(id);
        let _ = remove_tree(&tomb);
        match std::fs::rename(&dir, &tomb) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(true),
            Err(e) => return Err(io("rename", &dir)(e)),
        }
        let late = std::fs::read_dir(tomb.join("containers"))
            .map(|d| {
                d.flatten()
                    .filter_map(|e| fsops::read_regular(&e.path(), MAX_RECORD_BYTES).ok())
                    .filter_map(|b| serde_json::from_slice::<ContainerRecord>(&b).ok())
                    .any(|r| r.live(pending_grace))
            })
            .unwrap_or(false);
        if late {
            std::fs::rename(&tomb, &dir).map_err(io("rename", &tomb))?;
            return Ok(false);
        }
        before_remove(&tomb);
        remove_tree(&tomb)?;
        Ok(true)
    }

    /// Removes directories left half-removed by a crash (`.<id>.removing`): each one
    /// with whether it went, so that one that cannot be removed stops none of the others.
    pub(crate) fn remove_tombstones(&self) -> Vec<(PathBuf, Result<(), StateError>)> {
        let mut out = Vec::new();
        let Ok(entries) = std::fs::read_dir(self.mps_dir()) else {
            return out;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') && name.ends_with(".removing") {
                let path = e.path();
                let result = remove_tree(&path);
                out.push((path, result));
            }
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::util;

    #[test]
    fn removal_backs_off_while_a_create_is_pending() {
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::new(dir.path().join("s"));
        let id = "0123456789abcdef0123456789abcdef";
        std::fs::create_dir_all(state.containers_dir(id)).unwrap();
        // A pending create's record, as the shim writes it: the directory stays.
        let pending = ContainerRecord {
            id: "p".into(),
            pid: None,
            start_time: None,
            bundle: None,
            created_at: util::unix_now(),
            engine: None,
            creator: None,
            names: Default::default(),
            mps_namespace: None,
        };
        state.add_container(id, &pending).unwrap();
        assert!(!state
            .remove_if_unused(id, 30, |_| panic!("must not remove"))
            .unwrap());
        assert!(state.daemon_dir(id).exists());
        // Once the pending record has expired, the directory goes through its tombstone.
        let expired = ContainerRecord {
            created_at: util::unix_now() - 100,
            ..pending
        };
        state.add_container(id, &expired).unwrap();
        let mut seen = PathBuf::new();
        assert!(state
            .remove_if_unused(id, 30, |p| seen = p.to_owned())
            .unwrap());
        assert!(
            seen.ends_with(".0123456789abcdef0123456789abcdef.removing"),
            "{seen:?}"
        );
        assert!(!state.daemon_dir(id).exists() && !seen.exists());
    }

    #[test]
    fn clean_pipe_dir_takes_a_planted_control_directory_and_keeps_the_dir() {
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::new(dir.path().join("s"));
        let id = "0123456789abcdef0123456789abcdef";
        let pipe = state.pipe_dir(id);
        std::fs::create_dir_all(pipe.join("control/deeper")).unwrap();
        std::fs::write(pipe.join("control/deeper/f"), "").unwrap();
        std::fs::write(pipe.join("nvidia-cuda-mps-control.pid"), "1").unwrap();
        let outside = dir.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        std::fs::write(outside.join("keep"), "").unwrap();
        std::os::unix::fs::symlink(&outside, pipe.join("control_lock")).unwrap();
        state.clean_pipe_dir(id, None).unwrap();
        assert!(pipe.is_dir());
        assert_eq!(std::fs::read_dir(&pipe).unwrap().count(), 0);
        assert!(outside.join("keep").exists());
        // Missing is fine; bad ids never reach a path.
        state
            .clean_pipe_dir("0000000000000000000000000000000a", None)
            .unwrap();
        assert!(matches!(
            state.clean_pipe_dir("../x", None),
            Err(StateError::Name { .. })
        ));
    }

    #[test]
    fn tombstones_are_removed_one_by_one() {
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::new(dir.path().join("s"));
        for id in [
            "0000000000000000000000000000000a",
            "0000000000000000000000000000000b",
        ] {
            std::fs::create_dir_all(state.tombstone(id).join("pipe/control/x")).unwrap();
        }
        let removed = state.remove_tombstones();
        assert_eq!(removed.len(), 2);
        assert!(removed.iter().all(|(p, r)| r.is_ok() && !p.exists()));
        assert!(state.remove_tombstones().is_empty());
    }
}
