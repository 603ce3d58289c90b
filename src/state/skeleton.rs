//! A daemon's directories (`pipe/`, `containers/`) and its log and shm tmpfs mounts, made
//! idempotently under the daemon's lock, and the caps on how many daemons the node and
//! one UID may have.
//!
//! Invariants: a new daemon directory is made only under the node lock, after counting
//! the daemons against `mps.max-daemons` and `mps.max-daemons-per-uid` and their shm
//! tmpfs sizes against `mps.shm-size-total` and `mps.shm-size-per-uid`, and one that
//! cannot be completed is removed again; a cap that is full first takes back the places
//! nobody uses (abandoned directories, then idle daemons, oldest idle first, only among
//! the daemons the cap counts) and refuses only when every daemon it counts is in use;
//! the warm path (`skeleton_ready`) takes no lock; what a tenant can write (log/, shm/)
//! is its own sized tmpfs, nosuid, nodev, noexec.

use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::Instant;

use nix::fcntl::Flock;

use super::budget::Budget;
use super::dir::{StateDir, StateError};
use super::reclaim::Abandoned;
use super::remove::{mounted_in, remove_tree};

/// Ownership and modes of one daemon's directories.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Owner {
    pub uid: u32,
    pub gid: u32,
    /// Multi-user daemons are root's and serve everyone: pipe 0755, shm 1777.
    pub shared: bool,
    /// The daemon has its own shm tmpfs (isolated IPC); host-IPC daemons use the host's.
    pub shm: bool,
    /// A v3 daemon: its pipe directory is root's alone (0700; each container gets only
    /// its namespace's directory), and its sockets lie one namespace deeper.
    pub namespaces: bool,
}

/// How much longer a v3 namespace's socket path is than the daemon's `control`:
/// `/s/c<20 hex>` (`identity::Namespace`).
const NAMESPACE_PATH_EXTRA: usize = 24;

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
        if owner.namespaces {
            PipeOwner {
                uid: nix::unistd::geteuid().as_raw(),
                gid: 0,
                mode: 0o700,
            }
        } else if owner.shared {
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
    /// completed is removed again. Returns whether the directory is new: its maker starts
    /// a reaper for it (`gpushare daemon reap`), in case the create fails.
    pub(crate) fn ensure_skeleton(
        &self,
        id: &str,
        owner: Owner,
        budget: &Budget,
    ) -> Result<bool, StateError> {
        Self::check_id(id)?;
        let mut socket = self.control_socket(id);
        if owner.namespaces {
            socket = self
                .namespace_dir(id, &"c".repeat(NAMESPACE_PATH_EXTRA - 3))
                .join("control");
        }
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
        let node_lock = self.admit_if_new(&dir, pipe.uid, owner.shm, budget)?;
        let built = self.build_skeleton(id, owner, pipe, budget);
        if built.is_err() && node_lock.is_some() {
            // Nothing half-made is left of a new daemon.
            let _ = remove_tree(&dir);
        }
        built.map(|()| node_lock.is_some())
    }

    /// A daemon whose directory `dir` does not exist yet is new: takes the node lock and
    /// counts the daemons against the caps (`check_caps`), returning the lock. A directory
    /// that is present (`ensure_dir` refuses anything but a directory) or unreadable
    /// needs neither: `None`.
    fn admit_if_new(
        &self,
        dir: &Path,
        uid: u32,
        shm: bool,
        budget: &Budget,
    ) -> Result<Option<Flock<File>>, StateError> {
        match std::fs::symlink_metadata(dir) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let lock = self.lock_node(Instant::now() + budget.lock_wait)?;
                self.check_caps(uid, shm, budget)?;
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

    /// Every daemon directory as the caps count it.
    fn census(&self) -> Result<Vec<Slot>, StateError> {
        Ok(self
            .daemon_ids()?
            .into_iter()
            .map(|id| {
                let uid = std::fs::symlink_metadata(self.pipe_dir(&id))
                    .ok()
                    .map(|m| m.uid());
                let shm = if self.shm_mounted(&id) {
                    nix::sys::statfs::statfs(&self.shm_dir(&id))
                        .map_or(0, |f| f.blocks() * f.block_size() as u64)
                } else {
                    0
                };
                Slot { id, uid, shm }
            })
            .collect())
    }

    /// Admits a new daemon for `uid` (the owner of its pipe directory; `shm`: it gets an
    /// shm tmpfs of `budget.shm_bytes`) under every cap, or refuses it naming the cap.
    /// A full cap first takes back what nobody uses among the daemons it counts
    /// (`make_room`). Call with the node lock held.
    fn check_caps(&self, uid: u32, shm: bool, budget: &Budget) -> Result<(), StateError> {
        let mut slots = self.census()?;
        for cap in &caps(budget, uid, shm) {
            if !cap.admits(&slots) {
                self.make_room(&mut slots, cap, budget);
            }
            if !cap.admits(&slots) {
                return Err(cap.refusal(&slots, budget));
            }
        }
        Ok(())
    }

    /// Takes back places among the daemons `cap` counts until it admits one more: first
    /// every abandoned directory (no supervisor, no live container: nobody loses
    /// anything), then idle daemons (a supervisor, no live container), the longest idle
    /// first (by when their container records last changed), only as many as needed. A
    /// daemon in use, or whose lock another process holds, stays.
    fn make_room(&self, slots: &mut Vec<Slot>, cap: &Cap, budget: &Budget) {
        let counted: Vec<String> = slots
            .iter()
            .filter(|s| cap.counts(s))
            .map(|s| s.id.clone())
            .collect();
        let take = |slots: &mut Vec<Slot>, id: &str| slots.retain(|s| s.id != id);
        for id in &counted {
            match self.reclaim_abandoned(id, budget.pending_grace) {
                Ok(Abandoned::Reclaimed | Abandoned::Gone) => {
                    tracing::info!(daemon = %id, cap = cap.key, "abandoned daemon directory removed to make room");
                    take(slots, id);
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(daemon = %id, error = %e, "cannot reclaim a daemon directory")
                }
            }
        }
        // When its container records last changed; unknown sorts last.
        if cap.admits(slots) {
            return;
        }
        let idle_since = |id: &String| {
            let since = std::fs::symlink_metadata(self.containers_dir(id))
                .and_then(|m| m.modified())
                .ok();
            (since.is_none(), since)
        };
        let mut idle: Vec<_> = counted
            .iter()
            .filter(|id| slots.iter().any(|s| &s.id == *id))
            .map(|id| (idle_since(id), id))
            .collect();
        idle.sort();
        for (_, id) in idle {
            match self.reclaim_idle(id, budget) {
                Ok(true) => {
                    take(slots, id);
                    if cap.admits(slots) {
                        return;
                    }
                }
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(daemon = %id, error = %e, "cannot reclaim an idle daemon")
                }
            }
        }
    }
}

/// The caps a new daemon of `uid` must fit under (`shm`: it gets an shm tmpfs of
/// `budget.shm_bytes`; the shm caps bound only such daemons).
fn caps(budget: &Budget, uid: u32, shm: bool) -> Vec<Cap> {
    let new_shm = if shm { budget.shm_bytes } else { 0 };
    let mut caps = vec![
        Cap {
            key: "mps.max-daemons",
            uid: None,
            limit: Limit::Daemons(budget.max_daemons),
        },
        Cap {
            key: "mps.max-daemons-per-uid",
            uid: Some(uid),
            limit: Limit::Daemons(budget.max_daemons_per_uid),
        },
    ];
    if shm {
        if let Some(total) = budget.shm_total {
            caps.push(Cap {
                key: "mps.shm-size-total",
                uid: None,
                limit: Limit::Shm(total, new_shm),
            });
        }
        if let Some(per_uid) = budget.shm_per_uid {
            caps.push(Cap {
                key: "mps.shm-size-per-uid",
                uid: Some(uid),
                limit: Limit::Shm(per_uid, new_shm),
            });
        }
    }
    caps
}

/// One cap as `doctor`, `status` and the metrics show it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub(crate) struct CapUse {
    /// Its config key (`mps.max-daemons`, …).
    pub key: &'static str,
    /// It counts one UID's daemons (the owner of their pipe directories), not the node's.
    pub per_uid: bool,
    /// What it counts: `daemons`, or `bytes` of shm tmpfs.
    pub unit: &'static str,
    pub limit: u64,
    /// What it counts now; for a per-UID cap, the busiest UID's (`uid`).
    pub used: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    /// How many daemons it admits in all, each with an shm tmpfs of `mps.shm-size`.
    pub capacity_daemons: u64,
}

/// The node's daemon caps, their use, and the one that binds.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub(crate) struct Capacity {
    /// Daemon directories now.
    pub daemons: u64,
    /// How many daemons (each with its own shm tmpfs, as `ipc = isolated` gives them) the
    /// node admits: the smallest capacity of its node-wide caps.
    pub effective_daemons: u64,
    /// The node-wide cap that sets it (the first, on a tie).
    pub binding: &'static str,
    /// How many of them one UID may have: the smallest capacity of every cap.
    pub effective_daemons_per_uid: u64,
    /// The cap that sets that.
    pub binding_per_uid: &'static str,
    pub caps: Vec<CapUse>,
}

impl StateDir {
    /// Each cap of `budget`, what it counts now, and what it lets the node have (as
    /// `check_caps` counts, without its lock: a snapshot).
    pub(crate) fn capacity(&self, budget: &Budget) -> Result<Capacity, StateError> {
        let slots = self.census()?;
        let mut out = Vec::new();
        for cap in caps(budget, 0, true) {
            // A per-UID cap is shown for the UID that has the most of what it counts.
            let (uid, (n, bytes)) = match cap.uid {
                None => (None, cap.usage(&slots)),
                Some(_) => {
                    let busiest = slots
                        .iter()
                        .filter_map(|s| s.uid)
                        .map(|uid| {
                            let c = Cap {
                                uid: Some(uid),
                                ..cap
                            };
                            (uid, c.usage(&slots))
                        })
                        .max_by_key(|(_, (n, b))| match cap.limit {
                            Limit::Daemons(_) => *n as u64,
                            Limit::Shm(..) => *b,
                        });
                    match busiest {
                        Some((uid, used)) => (Some(uid), used),
                        None => (None, (0, 0)),
                    }
                }
            };
            let (unit, limit, used, capacity_daemons) = match cap.limit {
                Limit::Daemons(max) => ("daemons", u64::from(max), n as u64, u64::from(max)),
                Limit::Shm(max, each) => (
                    "bytes",
                    max,
                    bytes,
                    max.checked_div(each).unwrap_or(u64::MAX),
                ),
            };
            out.push(CapUse {
                key: cap.key,
                per_uid: cap.uid.is_some(),
                unit,
                limit,
                used,
                uid,
                capacity_daemons,
            });
        }
        let least = |caps: &mut dyn Iterator<Item = &CapUse>| {
            caps.fold((u64::MAX, ""), |best, c| {
                if c.capacity_daemons < best.0 {
                    (c.capacity_daemons, c.key)
                } else {
                    best
                }
            })
        };
        let (effective_daemons, binding) = least(&mut out.iter().filter(|c| !c.per_uid));
        let (effective_daemons_per_uid, binding_per_uid) = least(&mut out.iter());
        Ok(Capacity {
            daemons: slots.len() as u64,
            effective_daemons,
            binding,
            effective_daemons_per_uid,
            binding_per_uid,
            caps: out,
        })
    }
}

/// One daemon directory as the caps count it: the owner of its pipe directory and the
/// size of its shm tmpfs (0 without one).
struct Slot {
    id: String,
    uid: Option<u32>,
    shm: u64,
}

/// What a cap bounds.
#[derive(Clone, Copy)]
enum Limit {
    /// This many daemon directories.
    Daemons(u32),
    /// This many bytes of shm tmpfs, and the new daemon's own.
    Shm(u64, u64),
}

/// One cap: its config key, the UID whose daemons it counts (`None`: every daemon) and
/// its limit.
#[derive(Clone, Copy)]
struct Cap {
    key: &'static str,
    uid: Option<u32>,
    limit: Limit,
}

/// `24 GiB` for a whole number of GiB, else whole MiB.
fn human(bytes: u64) -> String {
    const GIB: u64 = 1 << 30;
    if bytes % GIB == 0 {
        format!("{} GiB", bytes / GIB)
    } else {
        format!("{} MiB", bytes >> 20)
    }
}

impl Cap {
    fn counts(&self, slot: &Slot) -> bool {
        self.uid.is_none() || slot.uid == self.uid
    }

    /// The daemons it counts and their shm bytes.
    fn usage(&self, slots: &[Slot]) -> (usize, u64) {
        slots
            .iter()
            .filter(|s| self.counts(s))
            .fold((0, 0), |(n, b), s| (n + 1, b + s.shm))
    }

    /// Whether one more daemon fits.
    fn admits(&self, slots: &[Slot]) -> bool {
        let (n, bytes) = self.usage(slots);
        match self.limit {
            Limit::Daemons(max) => n < max as usize,
            Limit::Shm(max, new) => bytes.saturating_add(new) <= max,
        }
    }

    fn refusal(&self, slots: &[Slot], budget: &Budget) -> StateError {
        let (n, bytes) = self.usage(slots);
        let (cap, why) = match self.limit {
            Limit::Daemons(max) => (
                max.to_string(),
                format!("reached ({n} daemons, none idle)"),
            ),
            Limit::Shm(max, new) => (
                human(max),
                format!(
                    "would be exceeded ({n} daemons, none idle, have {} of shm tmpfs and this one's is {})",
                    human(bytes),
                    human(new)
                ),
            ),
        };
        StateError::DaemonCap {
            scope: match self.uid {
                Some(uid) => format!("for uid {uid}"),
                None => "on this node".into(),
            },
            key: self.key,
            cap,
            why,
            config: budget.config.clone(),
        }
    }
}

/// A budget of 1 MiB tmpfs mounts under the two daemon caps given, for the state
/// directory's unit tests.
#[cfg(test)]
pub(super) fn test_budget(max_daemons: u32, max_daemons_per_uid: u32) -> Budget {
    Budget {
        shm_size: "1M".into(),
        shm_bytes: 1 << 20,
        shm_per_uid: None,
        shm_total: None,
        log_size: 1 << 20,
        max_daemons,
        max_daemons_per_uid,
        lock_wait: std::time::Duration::from_secs(1),
        pending_grace: 30,
        stop_grace: std::time::Duration::from_secs(1),
        config: "/etc/gpushare/runtime.toml".into(),
        clients: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(max_daemons: u32, max_daemons_per_uid: u32) -> Budget {
        test_budget(max_daemons, max_daemons_per_uid)
    }

    /// Each cap with its use and the daemons it admits; the node's capacity is the least
    /// of its node-wide caps, one UID's the least of all: with the defaults' shape
    /// (64 daemons, 6 GiB of shm in all at 1 GiB each) the shm total binds at 6.
    #[test]
    fn capacity_shows_each_cap_its_use_and_the_one_that_binds() {
        const GIB: u64 = 1 << 30;
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::new(dir.path().join("s"));
        state.ensure_root().unwrap();
        let a = "0000000000000000000000000000000a";
        for id in [a, "0000000000000000000000000000000b"] {
            std::fs::create_dir_all(state.pipe_dir(id)).unwrap();
            std::fs::create_dir_all(state.shm_dir(id)).unwrap();
        }
        // One daemon has its shm tmpfs (2 MiB), as the census measures it.
        nix::mount::mount(
            Some("tmpfs"),
            &state.shm_dir(a),
            Some("tmpfs"),
            nix::mount::MsFlags::empty(),
            Some("size=2m"),
        )
        .unwrap();
        let mut budget = Budget {
            shm_bytes: GIB,
            shm_total: Some(6 * GIB),
            ..budget(64, 8)
        };
        let c = state.capacity(&budget);
        budget.shm_per_uid = Some(2 * GIB);
        let per_uid = state.capacity(&budget);
        budget.shm_total = None;
        budget.shm_per_uid = None;
        let no_shm_caps = state.capacity(&budget);
        nix::mount::umount(&state.shm_dir(a)).unwrap();
        let c = c.unwrap();
        let euid = nix::unistd::geteuid().as_raw();
        assert_eq!(
            (c.daemons, c.effective_daemons, c.binding),
            (2, 6, "mps.shm-size-total")
        );
        assert_eq!(
            (c.effective_daemons_per_uid, c.binding_per_uid),
            (6, "mps.shm-size-total")
        );
        let cap = |c: &Capacity, key: &str| c.caps.iter().find(|x| x.key == key).cloned().unwrap();
        assert_eq!(
            cap(&c, "mps.shm-size-total"),
            CapUse {
                key: "mps.shm-size-total",
                per_uid: false,
                unit: "bytes",
                limit: 6 * GIB,
                used: 2 << 20,
                uid: None,
                capacity_daemons: 6,
            }
        );
        let m = cap(&c, "mps.max-daemons-per-uid");
        assert_eq!((m.used, m.uid, m.capacity_daemons), (2, Some(euid), 8));
        assert_eq!(cap(&c, "mps.max-daemons").used, 2);
        let per_uid = per_uid.unwrap();
        assert_eq!(
            (
                per_uid.effective_daemons,
                per_uid.effective_daemons_per_uid,
                per_uid.binding_per_uid
            ),
            (6, 2, "mps.shm-size-per-uid")
        );
        let no_shm_caps = no_shm_caps.unwrap();
        assert_eq!(no_shm_caps.caps.len(), 2);
        assert_eq!(
            (no_shm_caps.effective_daemons, no_shm_caps.binding),
            (64, "mps.max-daemons")
        );
        assert_eq!(
            (
                no_shm_caps.effective_daemons_per_uid,
                no_shm_caps.binding_per_uid
            ),
            (8, "mps.max-daemons-per-uid")
        );
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
                    namespaces: false,
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
        // Two daemons of this uid, one of another (its pipe directory owned by it), each
        // in use by a pending create of this process: none can be reclaimed.
        for id in [
            "0000000000000000000000000000000a",
            "0000000000000000000000000000000b",
            "0000000000000000000000000000000c",
        ] {
            std::fs::create_dir_all(state.pipe_dir(id)).unwrap();
            std::fs::create_dir_all(state.containers_dir(id)).unwrap();
            state
                .add_container(
                    id,
                    &crate::state::ContainerRecord::pending("c".into(), None),
                )
                .unwrap();
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
            namespaces: false,
        };
        let new = "0123456789abcdef0123456789abcdef";
        let err = state
            .ensure_skeleton(new, owner, &budget(64, 2))
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            format!("cannot start another MPS daemon for uid {euid}: mps.max-daemons-per-uid = 2 reached (2 daemons, none idle); their containers free their place when they end (gpushare status), or raise it in /etc/gpushare/runtime.toml")
        );
        let err = state
            .ensure_skeleton(new, owner, &budget(3, 8))
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "cannot start another MPS daemon on this node: mps.max-daemons = 3 reached (3 daemons, none idle); their containers free their place when they end (gpushare status), or raise it in /etc/gpushare/runtime.toml"
        );
        assert!(matches!(
            err,
            StateError::DaemonCap {
                key: "mps.max-daemons",
                ..
            }
        ));
        assert!(!state.daemon_dir(new).exists(), "nothing made");
        // Once their creates are gone, the three are abandoned: a full cap takes back
        // every abandoned directory it counts.
        for id in [
            "0000000000000000000000000000000a",
            "0000000000000000000000000000000b",
            "0000000000000000000000000000000c",
        ] {
            std::fs::remove_dir_all(state.containers_dir(id)).unwrap();
        }
        let _node = state.lock_node(Instant::now()).unwrap();
        state.check_caps(euid, true, &budget(3, 8)).unwrap();
        assert!(state.daemon_ids().unwrap().is_empty());
        assert!(state.node_lock_path().exists());
        assert_ne!(state.node_lock_path(), state.lock_path(new));
    }
}
