//! A daemon's directories (`pipe/`, `containers/`) and its log and shm tmpfs mounts, made
//! idempotently under the daemon's lock, and the caps on how many daemons the node and
//! one UID may have.
//!
//! Invariants: a new daemon directory is made only under the node lock, after counting
//! the daemons against `mps.max-daemons` and `mps.max-daemons-per-uid`, and one that
//! cannot be completed is removed again; the warm path (`skeleton_ready`) takes no lock;
//! what a tenant can write (log/, shm/) is its own sized tmpfs, nosuid, nodev, noexec.

use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::fcntl::Flock;

use super::remove::remove_tree;
use super::{StateDir, StateError};

/// Ownership and modes of one daemon's directories.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Owner {
    pub uid: u32,
    pub gid: u32,
    /// Multi-user daemons are root's and serve everyone: pipe 0755, shm 1777.
    pub shared: bool,
    /// The daemon has its own shm tmpfs (isolated IPC); host-IPC daemons use the host's.
    pub shm: bool,
}

/// What a new daemon may take on this node (`[mps]` in the config): the sizes of its
/// tmpfs mounts and the caps on the number of daemons.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Budget {
    /// The shm tmpfs `size=` option (`50%`, or bytes).
    pub shm_size: String,
    /// Bytes of the log tmpfs.
    pub log_size: u64,
    /// `mps.max-daemons`: daemon directories on the node.
    pub max_daemons: u32,
    /// `mps.max-daemons-per-uid`: daemon directories whose pipe directory a UID owns
    /// (multi-user daemons are root's, uid 0).
    pub max_daemons_per_uid: u32,
    /// How long a new daemon waits for the node lock.
    pub lock_wait: Duration,
    /// The config file a refusal names.
    pub config: PathBuf,
}

/// Files the log tmpfs may hold: the daemon's few logs and their rotations. Bounds the
/// kernel memory a flood of empty files could take, which `size=` does not count.
const LOG_INODES: u32 = 1024;

/// Who owns a daemon's pipe directory and its log tmpfs, and the pipe directory's mode:
/// the daemon's user (0700), or root (0755) for a multi-user daemon that serves everyone.
#[derive(Debug, Clone, Copy)]
struct PipeOwner {
    uid: u32,
    gid: u32,
    mode: u32,
}

impl PipeOwner {
    fn of(owner: Owner) -> Self {
        if owner.shared {
            PipeOwner {
                uid: nix::unistd::geteuid().as_raw(),
                gid: 0,
                mode: 0o755,
            }
        } else {
            PipeOwner {
                uid: owner.uid,
                gid: owner.gid,
                mode: 0o700,
            }
        }
    }
}

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

impl StateDir {
    /// Whether the daemon's directories are in place, with its log tmpfs mounted and its
    /// shm tmpfs when it has one: three or four stats, the shim's whole warm path here.
    pub(crate) fn skeleton_ready(&self, id: &str, shm: bool) -> bool {
        let dir = self.daemon_dir(id);
        let Ok(d) = std::fs::symlink_metadata(&dir) else {
            return false;
        };
        let mounted = |name: &str| {
            std::fs::symlink_metadata(dir.join(name))
                .is_ok_and(|m| m.is_dir() && m.dev() != d.dev())
        };
        (!shm || mounted("shm")) && mounted("log") && self.pipe_dir(id).is_dir()
    }

    /// Whether the shm tmpfs is mounted (its device differs from its parent's).
    pub(crate) fn shm_mounted(&self, id: &str) -> bool {
        mounted_in(&self.daemon_dir(id), "shm")
    }

    /// Whether the log tmpfs is mounted.
    pub(crate) fn log_mounted(&self, id: &str) -> bool {
        mounted_in(&self.daemon_dir(id), "log")
    }

    /// Creates one daemon's directories and mounts its log tmpfs and (`owner.shm`) its shm
    /// tmpfs, idempotently. Must be called with the daemon's lock held (a mount is not
    /// idempotent by itself). A daemon whose directory does not exist yet is new: it is
    /// counted against the caps of `budget` under the node lock and refused with
    /// `StateError::DaemonCap` before anything is made; a new directory that cannot be
    /// completed is removed again.
    pub(crate) fn ensure_skeleton(
        &self,
        id: &str,
        owner: Owner,
        budget: &Budget,
    ) -> Result<(), StateError> {
        Self::check_id(id)?;
        let socket = self.control_socket(id);
        let len = socket.as_os_str().len();
        if len >= 108 {
            return Err(StateError::SocketPathTooLong { path: socket, len });
        }
        self.ensure_root()?;
        if !owner.shared {
            self.check_traversable()?;
        }
        let pipe = PipeOwner::of(owner);
        let dir = self.daemon_dir(id);
        // Held until the directories are made, so that two creates cannot both pass a cap.
        let node_lock = self.admit_if_new(&dir, pipe.uid, budget)?;
        let built = self.build_skeleton(id, owner, pipe, budget);
        if built.is_err() && node_lock.is_some() {
            // Nothing half-made is left of a new daemon.
            let _ = remove_tree(&dir);
        }
        built
    }

    /// A daemon whose directory `dir` does not exist yet is new: takes the node lock and
    /// counts the daemons against the caps (`check_caps`), returning the lock. A directory
    /// that is present (`ensure_dir` refuses anything but a directory) or unreadable
    /// needs neither: `None`.
    fn admit_if_new(
        &self,
        dir: &Path,
        uid: u32,
        budget: &Budget,
    ) -> Result<Option<Flock<File>>, StateError> {
        match std::fs::symlink_metadata(dir) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let lock = self.lock_node(Instant::now() + budget.lock_wait)?;
                self.check_caps(uid, budget)?;
                Ok(Some(lock))
            }
            _ => Ok(None),
        }
    }

    /// Makes daemon `id`'s directories and mounts its log tmpfs and (`owner.shm`) its shm
    /// tmpfs, each only where it is missing.
    fn build_skeleton(
        &self,
        id: &str,
        owner: Owner,
        pipe: PipeOwner,
        budget: &Budget,
    ) -> Result<(), StateError> {
        let euid = nix::unistd::geteuid().as_raw();
        Self::ensure_dir(&self.daemon_dir(id), 0o711, euid, 0)?;
        Self::ensure_dir(&self.pipe_dir(id), pipe.mode, pipe.uid, pipe.gid)?;
        Self::ensure_dir(&self.containers_dir(id), 0o700, euid, 0)?;
        // Only an empty mount point is root's; once mounted, a tmpfs root is the daemon
        // user's and must not be touched here.
        if !self.log_mounted(id) {
            let mode = if owner.shared { "0755" } else { "0700" };
            self.mount_tmpfs(
                "log",
                &self.log_dir(id),
                &format!(
                    "size={},nr_inodes={LOG_INODES},mode={mode},uid={},gid={}",
                    budget.log_size, pipe.uid, pipe.gid
                ),
            )?;
        }
        if owner.shm && !self.shm_mounted(id) {
            let mode = if owner.shared { "1777" } else { "0700" };
            self.mount_tmpfs(
                "shm",
                &self.shm_dir(id),
                &format!(
                    "size={},mode={mode},uid={},gid={}",
                    budget.shm_size, owner.uid, owner.gid
                ),
            )?;
        }
        Ok(())
    }

    /// Mounts a daemon's tmpfs on `path` (made a root-owned empty directory first):
    /// no setuid, no devices, no executables.
    fn mount_tmpfs(&self, what: &'static str, path: &Path, data: &str) -> Result<(), StateError> {
        let euid = nix::unistd::geteuid().as_raw();
        Self::ensure_dir(path, 0o700, euid, 0)?;
        use nix::mount::{mount, MsFlags};
        mount(
            Some(format!("gpushare-{what}").as_str()),
            path,
            Some("tmpfs"),
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
            Some(data),
        )
        .map_err(|source| StateError::Mount {
            what,
            path: path.to_owned(),
            source,
        })
    }

    /// Refuses a new daemon for `uid` (the owner of its pipe directory) once the node
    /// or that uid has its cap of daemon directories. Call with the node lock held.
    fn check_caps(&self, uid: u32, budget: &Budget) -> Result<(), StateError> {
        let ids = self.daemon_ids()?;
        let refuse = |scope: String, key, cap, count| StateError::DaemonCap {
            scope,
            key,
            cap,
            count,
            config: budget.config.clone(),
        };
        if ids.len() >= budget.max_daemons as usize {
            return Err(refuse(
                "on this node".into(),
                "mps.max-daemons",
                budget.max_daemons,
                ids.len(),
            ));
        }
        let of_uid = ids
            .iter()
            .filter(|id| std::fs::symlink_metadata(self.pipe_dir(id)).is_ok_and(|m| m.uid() == uid))
            .count();
        if of_uid >= budget.max_daemons_per_uid as usize {
            return Err(refuse(
                format!("for uid {uid}"),
                "mps.max-daemons-per-uid",
                budget.max_daemons_per_uid,
                of_uid,
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(max_daemons: u32, max_daemons_per_uid: u32) -> Budget {
        Budget {
            shm_size: "1M".into(),
            log_size: 1 << 20,
            max_daemons,
            max_daemons_per_uid,
            lock_wait: Duration::from_secs(1),
            config: "/etc/gpushare/runtime.toml".into(),
        }
    }

    #[test]
    fn socket_path_limit_is_checked() {
        let long = format!("/tmp/{}", "x".repeat(100));
        let err = StateDir::new(long)
            .ensure_skeleton(
                "0123456789abcdef0123456789abcdef",
                Owner {
                    uid: 0,
                    gid: 0,
                    shared: false,
                    shm: true,
                },
                &budget(64, 8),
            )
            .unwrap_err();
        assert!(matches!(err, StateError::SocketPathTooLong { .. }), "{err}");
    }

    #[test]
    fn a_new_daemon_past_a_cap_is_refused_before_anything_is_made() {
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::new(dir.path().join("s"));
        state.ensure_root().unwrap();
        let euid = nix::unistd::geteuid().as_raw();
        // Two daemons of this uid, one of another (its pipe directory owned by it).
        for id in [
            "0000000000000000000000000000000a",
            "0000000000000000000000000000000b",
            "0000000000000000000000000000000c",
        ] {
            std::fs::create_dir_all(state.pipe_dir(id)).unwrap();
        }
        let other = euid.wrapping_add(1);
        if euid == 0 {
            nix::unistd::chown(
                &state.pipe_dir("0000000000000000000000000000000c"),
                Some(other.into()),
                None,
            )
            .unwrap();
        }
        let owner = Owner {
            uid: euid,
            gid: 0,
            shared: false,
            shm: true,
        };
        let new = "0123456789abcdef0123456789abcdef";
        let err = state
            .ensure_skeleton(new, owner, &budget(64, 2))
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            format!("cannot start another MPS daemon for uid {euid}: mps.max-daemons-per-uid = 2 reached (2 daemons); stopped daemons free their place (gpushare daemon list / gc), or raise it in /etc/gpushare/runtime.toml")
        );
        let err = state
            .ensure_skeleton(new, owner, &budget(3, 8))
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "cannot start another MPS daemon on this node: mps.max-daemons = 3 reached (3 daemons); stopped daemons free their place (gpushare daemon list / gc), or raise it in /etc/gpushare/runtime.toml"
        );
        assert!(matches!(
            err,
            StateError::DaemonCap {
                cap: 3,
                count: 3,
                ..
            }
        ));
        assert!(!state.daemon_dir(new).exists(), "nothing made");
        assert!(state.node_lock_path().exists());
        assert_ne!(state.node_lock_path(), state.lock_path(new));
    }
}
