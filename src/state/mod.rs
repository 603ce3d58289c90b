//! The state directory: the one type that owns every host path gpushare uses.
//!
//! Layout (DESIGN §5), short names so the socket path fits in 108 bytes:
//! ```text
//! <state-dir>/                 0711 root   (refused if writable by group/others or a symlink)
//!   locks/<id>.lock            0600 root   flock per daemon identity; never removed
//!   locks/node.lock            0600 root   flock held while a new daemon's directories are made
//!   mps/                       0711 root
//!     <id>/                    0711 root
//!       daemon.json            0644 root   record of the daemon (identity, pids, status)
//!       pipe/                  0700 uid    CUDA_MPS_PIPE_DIRECTORY (multi-user: 0755 root)
//!       log/                   tmpfs of mps.log-size, 0700 uid (multi-user: 0755 root): CUDA_MPS_LOG_DIRECTORY
//!       shm/                   tmpfs, 0700 uid (multi-user: 1777): the daemon's and the clients' /dev/shm
//!       containers/<cid>.json  0700 root   one record per container using the daemon
//!     .<id>.removing/          a daemon directory being removed (gc finishes it after a crash)
//! ```
//! Invariants: every parent is traversable by the daemon's UID and writable by root only;
//! records are written atomically and read without locks; every name that reaches a path
//! (daemon id, container id) is validated first. What a tenant can write (pipe/, and log/
//! and shm/ when mounted into containers) is on its own sized tmpfs or emptied and removed
//! with `util::remove_contents`/`remove_all`, which never follow a link and need a fixed
//! number of fds whatever was planted. A new daemon directory is made only under the node
//! lock, after counting the daemons against `mps.max-daemons` and
//! `mps.max-daemons-per-uid`; the warm path (directories present) takes no lock.

use std::fs::{DirBuilder, File};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::fcntl::{Flock, FlockArg};
use serde::{Deserialize, Serialize};

use crate::identity::{valid_id, Identity};
use crate::util;

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("cannot {op} {path}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("state directory {path} is unusable: {why}")]
    Unsafe { path: PathBuf, why: String },
    #[error(
        "timed out after {waited:?} waiting for the lock {path}: another gpushare process holds it"
    )]
    LockTimeout { path: PathBuf, waited: Duration },
    #[error("cannot mount the {what} tmpfs on {path}")]
    Mount {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: nix::Error,
    },
    #[error("invalid {what} {value:?}: {allowed}")]
    Name {
        what: &'static str,
        value: String,
        allowed: &'static str,
    },
    #[error("MPS pipe path {path} is {len} bytes: a Unix socket path must be shorter than 108; use a shorter state-dir")]
    SocketPathTooLong { path: PathBuf, len: usize },
    #[error("corrupt record {path}: {message}")]
    Corrupt { path: PathBuf, message: String },
    #[error("cannot serialise the record {path}")]
    Serialise {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("cannot start another MPS daemon {scope}: {key} = {cap} reached ({count} daemons); stopped daemons free their place (gpushare daemon list / gc), or raise it in {config}")]
    DaemonCap {
        /// `for uid 1000`, `on this node`.
        scope: String,
        key: &'static str,
        cap: u32,
        count: usize,
        config: PathBuf,
    },
}

fn io<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> StateError + 'a {
    move |source| StateError::Io {
        op,
        path: path.to_owned(),
        source,
    }
}

fn serialise(path: &Path) -> impl FnOnce(serde_json::Error) -> StateError + '_ {
    move |source| StateError::Serialise {
        path: path.to_owned(),
        source,
    }
}

/// A process named for good: pid plus its start time, so a reused pid never passes for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcRef {
    pub pid: i32,
    pub start_time: u64,
}

impl ProcRef {
    pub fn of(pid: i32) -> Option<Self> {
        util::proc_start_time(pid).map(|start_time| ProcRef { pid, start_time })
    }

    /// Whether this very process is still running (not a zombie, not a reused pid).
    pub fn alive(&self) -> bool {
        self.pid > 0 && util::proc_start_time(self.pid) == Some(self.start_time)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DaemonStatus {
    /// The supervisor is starting the daemon for the first time.
    Starting,
    /// Daemon answering, limits applied: clients may connect.
    Ready,
    /// The daemon died; the supervisor is starting it again.
    Restarting,
    /// The supervisor gave up; `error` says why.
    Failed,
    /// Stopped on request or idle.
    Stopped,
}

/// `daemon.json`: what the hook, the supervisor and `status` know about one daemon.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DaemonRecord {
    pub id: String,
    pub identity: Identity,
    pub status: DaemonStatus,
    pub supervisor: Option<ProcRef>,
    pub daemon: Option<ProcRef>,
    /// Unix seconds when the supervisor was started.
    pub started_at: u64,
    /// Unix seconds when the current daemon process became ready.
    pub ready_at: Option<u64>,
    pub restarts: u32,
    pub error: Option<String>,
}

impl DaemonRecord {
    /// Ready, and the supervisor and the daemon are the very processes the record names.
    pub fn live(&self) -> bool {
        self.status == DaemonStatus::Ready
            && self.supervisor.is_some_and(|p| p.alive())
            && self.daemon.is_some_and(|p| p.alive())
    }
}

/// `containers/<id>.json`: one container using a daemon.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ContainerRecord {
    pub id: String,
    /// The container's init pid (runtime namespace); `None` while the create is pending
    /// (written by the shim, before runc has started anything).
    pub pid: Option<i32>,
    /// Start time of `pid` (see `ProcRef`): a reused pid never keeps a daemon alive.
    #[serde(default)]
    pub start_time: Option<u64>,
    /// Which engine created it (docker, containerd, kubernetes, podman, runc), when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine: Option<String>,
    pub bundle: Option<PathBuf>,
    pub created_at: u64,
}

impl ContainerRecord {
    /// A record made now: the start time is `pid`'s own, read from /proc (none while the
    /// create is pending, `pid` = `None`).
    pub fn new(
        id: String,
        pid: Option<i32>,
        bundle: Option<PathBuf>,
        engine: Option<String>,
    ) -> Self {
        ContainerRecord {
            id,
            pid,
            start_time: pid.and_then(util::proc_start_time),
            engine,
            bundle,
            created_at: util::unix_now(),
        }
    }

    /// Whether the container may still use its daemon: its init process runs, or its
    /// create is pending and younger than `pending_grace` seconds. A stopped container
    /// (process gone, not yet deleted) no longer uses MPS.
    pub fn live(&self, pending_grace: u64) -> bool {
        match (self.pid, self.start_time) {
            (Some(pid), Some(start_time)) => ProcRef { pid, start_time }.alive(),
            (Some(pid), None) => util::proc_start_time(pid).is_some(),
            (None, _) => util::unix_now().saturating_sub(self.created_at) <= pending_grace,
        }
    }
}

/// Ownership and modes of one daemon's directories.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Owner {
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
pub struct Budget {
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

/// The tmpfs mounts of a daemon directory, unmounted before it is removed.
const MOUNTS: [&str; 2] = ["shm", "log"];

/// Whether `<dir>/<name>` is a mount point (its device differs from `dir`'s).
fn mounted_in(dir: &Path, name: &str) -> bool {
    match (
        std::fs::symlink_metadata(dir),
        std::fs::symlink_metadata(dir.join(name)),
    ) {
        (Ok(d), Ok(s)) => s.is_dir() && s.dev() != d.dev(),
        _ => false,
    }
}

/// Unmounts `<dir>/shm` and `<dir>/log` if mounted and removes `dir`, whatever a tenant
/// planted in it (`util::remove_all`); a missing `dir` is fine.
fn remove_tree(dir: &Path) -> Result<(), StateError> {
    for name in MOUNTS {
        if mounted_in(dir, name) {
            let _ = nix::mount::umount2(&dir.join(name), nix::mount::MntFlags::MNT_DETACH);
        }
    }
    util::remove_all(dir).map_err(io("remove", dir))
}

/// Checks that a container id can name a file: runc's own rule (`^[\w+-\.]+$`), not `.`
/// or `..`, at most 1024 bytes.
pub fn valid_container_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 1024
        && id != "."
        && id != ".."
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'+' | b'-' | b'.'))
}

#[derive(Debug, Clone)]
pub struct StateDir {
    root: PathBuf,
}

impl StateDir {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        StateDir { root: root.into() }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }
    pub fn mps_dir(&self) -> PathBuf {
        self.root.join("mps")
    }
    pub fn daemon_dir(&self, id: &str) -> PathBuf {
        self.mps_dir().join(id)
    }
    pub fn pipe_dir(&self, id: &str) -> PathBuf {
        self.daemon_dir(id).join("pipe")
    }
    pub fn log_dir(&self, id: &str) -> PathBuf {
        self.daemon_dir(id).join("log")
    }
    pub fn shm_dir(&self, id: &str) -> PathBuf {
        self.daemon_dir(id).join("shm")
    }
    pub fn containers_dir(&self, id: &str) -> PathBuf {
        self.daemon_dir(id).join("containers")
    }
    pub fn record_path(&self, id: &str) -> PathBuf {
        self.daemon_dir(id).join("daemon.json")
    }
    pub fn lock_path(&self, id: &str) -> PathBuf {
        self.root.join("locks").join(format!("{id}.lock"))
    }
    /// The node lock: not a daemon id, so no identity's lock can be it.
    pub fn node_lock_path(&self) -> PathBuf {
        self.root.join("locks").join("node.lock")
    }
    pub fn control_socket(&self, id: &str) -> PathBuf {
        self.pipe_dir(id).join("control")
    }

    fn check_id(id: &str) -> Result<(), StateError> {
        if valid_id(id) {
            Ok(())
        } else {
            Err(StateError::Name {
                what: "daemon id",
                value: id.chars().take(64).collect(),
                allowed: crate::identity::ID_ALLOWED,
            })
        }
    }

    /// Makes `path` a directory with exactly `mode` and owner, refusing a symlink or a
    /// non-directory in its place.
    fn ensure_dir(path: &Path, mode: u32, uid: u32, gid: u32) -> Result<(), StateError> {
        match DirBuilder::new().mode(mode).create(path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(io("create directory", path)(e)),
        }
        let md = std::fs::symlink_metadata(path).map_err(io("inspect", path))?;
        if !md.is_dir() {
            return Err(StateError::Unsafe {
                path: path.to_owned(),
                why: "it is not a directory (a symlink is refused)".into(),
            });
        }
        if md.uid() != uid || md.gid() != gid {
            nix::unistd::chown(path, Some(uid.into()), Some(gid.into()))
                .map_err(|e| io("chown", path)(std::io::Error::from_raw_os_error(e as i32)))?;
        }
        if md.mode() & 0o7777 != mode {
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
                .map_err(io("chmod", path))?;
        }
        Ok(())
    }

    /// Creates the state root (0711 root) or checks an existing one is safe.
    pub fn ensure_root(&self) -> Result<(), StateError> {
        if let Some(parent) = self.root.parent() {
            std::fs::create_dir_all(parent).map_err(io("create directory", parent))?;
        }
        match DirBuilder::new().mode(0o711).create(&self.root) {
            Ok(()) => {
                std::fs::set_permissions(&self.root, std::fs::Permissions::from_mode(0o711))
                    .map_err(io("chmod", &self.root))?;
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(io("create directory", &self.root)(e)),
        }
        let md = std::fs::symlink_metadata(&self.root).map_err(io("inspect", &self.root))?;
        let euid = nix::unistd::geteuid().as_raw();
        let why = if !md.is_dir() {
            Some("it is not a directory; it must be a root-owned directory".to_owned())
        } else if md.uid() != euid {
            Some(format!(
                "it is owned by uid {}; it must be owned by root",
                md.uid()
            ))
        } else if md.mode() & 0o022 != 0 {
            Some(format!(
                "its mode is {:04o}; it must not be writable by group or others",
                md.mode() & 0o7777
            ))
        } else {
            None
        };
        if let Some(why) = why {
            return Err(StateError::Unsafe {
                path: self.root.clone(),
                why,
            });
        }
        Self::ensure_dir(&self.mps_dir(), 0o711, euid, 0)?;
        Self::ensure_dir(&self.root.join("locks"), 0o700, euid, 0)
    }

    /// Per-user daemons run as the container's UID and must reach their pipe directory
    /// through every ancestor of the state dir: each must be searchable by others.
    pub fn check_traversable(&self) -> Result<(), StateError> {
        for dir in self.root.ancestors().skip(1) {
            let Ok(md) = std::fs::metadata(dir) else {
                continue;
            };
            if md.mode() & 0o001 == 0 {
                return Err(StateError::Unsafe {
                    path: self.root.clone(),
                    why: format!(
                        "its parent {} has mode {:04o}, so per-user MPS daemons cannot reach their pipe directory (make it searchable: chmod o+x)",
                        dir.display(),
                        md.mode() & 0o7777
                    ),
                });
            }
        }
        Ok(())
    }

    /// Takes the exclusive lock of one daemon identity, waiting until `deadline`.
    pub fn lock(&self, id: &str, deadline: Instant) -> Result<Flock<File>, StateError> {
        Self::check_id(id)?;
        self.lock_file(self.lock_path(id), deadline)
    }

    /// Takes the node lock, which serializes the creation of new daemon directories (so
    /// two creates cannot both pass a cap). Taken after an identity's lock, never before.
    pub fn lock_node(&self, deadline: Instant) -> Result<Flock<File>, StateError> {
        self.lock_file(self.node_lock_path(), deadline)
    }

    fn lock_file(&self, path: PathBuf, deadline: Instant) -> Result<Flock<File>, StateError> {
        let started = Instant::now();
        let open = || {
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .mode(0o600)
                .custom_flags(nix::libc::O_NOFOLLOW)
                .open(&path)
        };
        let file = match open() {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                // First use of this state dir on this host.
                self.ensure_root()?;
                open()
            }
            other => other,
        }
        .map_err(io("open lock", &path))?;
        // Flock::lock takes the file and hands it back when the lock is busy: `file` is
        // there again for every next try.
        let mut file = Some(file);
        let taken = util::poll_until(
            deadline,
            Duration::from_millis(1),
            Duration::from_millis(20),
            || match Flock::lock(file.take()?, FlockArg::LockExclusiveNonblock) {
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

    /// Whether the daemon's directories are in place, with its log tmpfs mounted and its
    /// shm tmpfs when it has one: three or four stats, the shim's whole warm path here.
    pub fn skeleton_ready(&self, id: &str, shm: bool) -> bool {
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
    pub fn shm_mounted(&self, id: &str) -> bool {
        mounted_in(&self.daemon_dir(id), "shm")
    }

    /// Whether the log tmpfs is mounted.
    pub fn log_mounted(&self, id: &str) -> bool {
        mounted_in(&self.daemon_dir(id), "log")
    }

    /// Creates one daemon's directories and mounts its log tmpfs and (`owner.shm`) its shm
    /// tmpfs, idempotently. Must be called with the daemon's lock held (a mount is not
    /// idempotent by itself). A daemon whose directory does not exist yet is new: it is
    /// counted against the caps of `budget` under the node lock and refused with
    /// `StateError::DaemonCap` before anything is made; a new directory that cannot be
    /// completed is removed again.
    pub fn ensure_skeleton(
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
        let euid = nix::unistd::geteuid().as_raw();
        let (pipe_owner, pipe_mode) = if owner.shared {
            ((euid, 0), 0o755)
        } else {
            ((owner.uid, owner.gid), 0o700)
        };
        let dir = self.daemon_dir(id);
        let node_lock = match std::fs::symlink_metadata(&dir) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let lock = self.lock_node(Instant::now() + budget.lock_wait)?;
                self.check_caps(pipe_owner.0, budget)?;
                Some(lock)
            }
            // Present (ensure_dir refuses anything but a directory) or unreadable.
            _ => None,
        };
        let built = (|| {
            Self::ensure_dir(&dir, 0o711, euid, 0)?;
            Self::ensure_dir(&self.pipe_dir(id), pipe_mode, pipe_owner.0, pipe_owner.1)?;
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
                        budget.log_size, pipe_owner.0, pipe_owner.1
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
        })();
        if built.is_err() && node_lock.is_some() {
            // Nothing half-made is left of a new daemon.
            let _ = remove_tree(&dir);
        }
        built
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

    /// Unmounts the log and shm tmpfs and removes one daemon's directories (daemon
    /// stopped), whatever was planted in them.
    pub fn remove_daemon_dir(&self, id: &str) -> Result<(), StateError> {
        Self::check_id(id)?;
        remove_tree(&self.daemon_dir(id))
    }

    /// Empties daemon `id`'s pipe directory in place (it is bind-mounted into running
    /// containers): a socket, a pid file or anything else a tenant or a dead daemon left
    /// there, a directory planted under a name the daemon needs (`control`) included.
    /// A missing pipe directory is fine; a symlink in its place is refused.
    pub fn clean_pipe_dir(&self, id: &str) -> Result<(), StateError> {
        Self::check_id(id)?;
        let pipe = self.pipe_dir(id);
        match util::remove_contents(&pipe) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io("empty", &pipe)(e)),
        }
    }

    pub fn read_record(&self, id: &str) -> Result<Option<DaemonRecord>, StateError> {
        Self::check_id(id)?;
        let path = self.record_path(id);
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io("read", &path)(e)),
        };
        let rec: DaemonRecord =
            serde_json::from_slice(&bytes).map_err(|e| StateError::Corrupt {
                path: path.clone(),
                message: e.to_string(),
            })?;
        if rec.id != id || rec.identity.id() != id {
            return Err(StateError::Corrupt {
                path,
                message: format!("record is for daemon {:?}", rec.id),
            });
        }
        Ok(Some(rec))
    }

    /// Writes a daemon's record atomically; nothing if it does not serialise.
    pub fn write_record(&self, rec: &DaemonRecord) -> Result<(), StateError> {
        Self::check_id(&rec.id)?;
        let path = self.record_path(&rec.id);
        let data = serde_json::to_vec_pretty(rec).map_err(serialise(&path))?;
        util::write_atomic(&path, &data, 0o644).map_err(io("write", &path))
    }

    fn container_path(&self, id: &str, cid: &str) -> Result<PathBuf, StateError> {
        Self::check_id(id)?;
        if !valid_container_id(cid) {
            return Err(StateError::Name {
                what: "container id",
                value: cid.chars().take(64).collect(),
                allowed: "letters, digits and _ + - . (runc's rule), at most 1024 bytes",
            });
        }
        Ok(self.containers_dir(id).join(format!("{cid}.json")))
    }

    /// Writes a container's record atomically; nothing if it does not serialise (a bundle
    /// path that is not UTF-8 does not).
    pub fn add_container(&self, id: &str, rec: &ContainerRecord) -> Result<(), StateError> {
        let path = self.container_path(id, &rec.id)?;
        let data = serde_json::to_vec(rec).map_err(serialise(&path))?;
        // Atomic but not fsynced: a container record does not outlive a reboot's meaning
        // (the container is gone too), and the shim writes one on every create.
        util::write_atomic_with(&path, &data, 0o600, false).map_err(io("write", &path))
    }

    /// Removes a container's record; `Ok(false)` if there was none.
    pub fn remove_container(&self, id: &str, cid: &str) -> Result<bool, StateError> {
        let path = self.container_path(id, cid)?;
        match std::fs::remove_file(&path) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(io("remove", &path)(e)),
        }
    }

    pub fn containers(&self, id: &str) -> Result<Vec<ContainerRecord>, StateError> {
        Self::check_id(id)?;
        let dir = self.containers_dir(id);
        let entries = match std::fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(io("list", &dir)(e)),
        };
        let mut out = Vec::new();
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            if !name.ends_with(".json") || name.starts_with('.') {
                continue;
            }
            if let Ok(bytes) = std::fs::read(entry.path()) {
                if let Ok(rec) = serde_json::from_slice::<ContainerRecord>(&bytes) {
                    out.push(rec);
                }
            }
        }
        out.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(out)
    }

    /// The containers still using daemon `id`; stale records (see `ContainerRecord::live`)
    /// are removed on the way.
    pub fn live_containers(
        &self,
        id: &str,
        pending_grace: u64,
    ) -> Result<Vec<ContainerRecord>, StateError> {
        let mut live = Vec::new();
        for rec in self.containers(id)? {
            if rec.live(pending_grace) {
                live.push(rec);
            } else {
                let _ = self.remove_container(id, &rec.id);
            }
        }
        Ok(live)
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
    pub fn remove_if_unused(
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
                    .filter_map(|e| std::fs::read(e.path()).ok())
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
    pub fn remove_tombstones(&self) -> Vec<(PathBuf, Result<(), StateError>)> {
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

    /// Ids of every daemon directory, sorted; names that are not ids are ignored.
    pub fn daemon_ids(&self) -> Result<Vec<String>, StateError> {
        let dir = self.mps_dir();
        let entries = match std::fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(io("list", &dir)(e)),
        };
        let mut ids: Vec<String> = entries
            .flatten()
            .filter_map(|e| e.file_name().to_str().map(str::to_owned))
            .filter(|n| valid_id(n))
            .collect();
        ids.sort();
        Ok(ids)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn identity() -> Identity {
        Identity {
            devices: vec!["GPU-8f8bff94-112e-9541-43da-cfd453333404".into()],
            uid: 1000,
            gid: 1000,
            multi_user: false,
            active_thread_percentage: Some(50),
            pinned_memory_limit: None,
            ipc_host: false,
        }
    }

    #[test]
    fn records_round_trip_and_are_checked_against_their_id() {
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::new(dir.path().join("s"));
        let ident = identity();
        let id = ident.id();
        std::fs::create_dir_all(state.daemon_dir(&id)).unwrap();
        assert_eq!(state.read_record(&id).unwrap(), None);
        let rec = DaemonRecord {
            id: id.clone(),
            identity: ident,
            status: DaemonStatus::Ready,
            supervisor: ProcRef::of(std::process::id() as i32),
            daemon: None,
            started_at: 1,
            ready_at: Some(2),
            restarts: 0,
            error: None,
        };
        state.write_record(&rec).unwrap();
        assert_eq!(state.read_record(&id).unwrap(), Some(rec.clone()));
        // A record planted under another id is corrupt, not trusted.
        let other = "0123456789abcdef0123456789abcdef";
        std::fs::create_dir_all(state.daemon_dir(other)).unwrap();
        std::fs::copy(state.record_path(&id), state.record_path(other)).unwrap();
        assert!(matches!(
            state.read_record(other),
            Err(StateError::Corrupt { .. })
        ));
        assert_eq!(state.daemon_ids().unwrap(), {
            let mut v = vec![id.clone(), other.to_owned()];
            v.sort();
            v
        });
    }

    #[test]
    fn bad_names_never_reach_a_path() {
        let state = StateDir::new("/nonexistent-gpushare");
        assert!(matches!(
            state.read_record("../../etc"),
            Err(StateError::Name { .. })
        ));
        for cid in ["", ".", "..", "a/b", "a\0b", "x\ny", &"a".repeat(1025)] {
            let rec = ContainerRecord {
                id: cid.into(),
                pid: None,
                start_time: None,
                bundle: None,
                created_at: 0,
                engine: None,
            };
            assert!(
                matches!(
                    state.add_container("0123456789abcdef0123456789abcdef", &rec),
                    Err(StateError::Name { .. })
                ),
                "{cid:?}"
            );
        }
        assert!(valid_container_id(
            "28d3f31c1da9e220f4ff0d667ffe0881aaac3c6b708dae20229b81e67002ffee"
        ));
    }

    #[test]
    fn container_records() {
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::new(dir.path());
        let id = "0123456789abcdef0123456789abcdef";
        std::fs::create_dir_all(state.containers_dir(id)).unwrap();
        let rec = ContainerRecord {
            id: "c1".into(),
            pid: Some(5),
            start_time: None,
            bundle: None,
            created_at: 3,
            engine: None,
        };
        state.add_container(id, &rec).unwrap();
        assert_eq!(state.containers(id).unwrap(), vec![rec]);
        assert!(state.remove_container(id, "c1").unwrap());
        assert!(!state.remove_container(id, "c1").unwrap());
        assert!(state.containers(id).unwrap().is_empty());
    }

    #[test]
    fn a_record_that_does_not_serialise_writes_nothing() {
        use std::os::unix::ffi::OsStrExt;
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::new(dir.path());
        let id = "0123456789abcdef0123456789abcdef";
        std::fs::create_dir_all(state.containers_dir(id)).unwrap();
        let good = ContainerRecord {
            id: "c1".into(),
            pid: Some(5),
            start_time: None,
            bundle: Some("/run/bundle".into()),
            created_at: 3,
            engine: None,
        };
        state.add_container(id, &good).unwrap();
        // serde refuses a path that is not UTF-8; the record on disk stays as it was.
        let bad = ContainerRecord {
            bundle: Some(std::ffi::OsStr::from_bytes(b"/run/\xff").into()),
            ..good.clone()
        };
        let err = state.add_container(id, &bad).unwrap_err();
        assert!(matches!(err, StateError::Serialise { .. }), "{err}");
        assert_eq!(state.containers(id).unwrap(), vec![good]);
    }

    #[test]
    fn liveness_of_container_records() {
        let me = std::process::id() as i32;
        let now = util::unix_now();
        let rec = |pid, start_time, created_at| ContainerRecord {
            id: "c".into(),
            pid,
            start_time,
            bundle: None,
            created_at,
            engine: None,
        };
        assert!(rec(Some(me), util::proc_start_time(me), now).live(10));
        assert!(!rec(Some(me), Some(1), now).live(10), "reused pid");
        assert!(!rec(Some(i32::MAX), None, now).live(10), "dead pid");
        assert!(rec(None, None, now).live(10), "pending and young");
        assert!(!rec(None, None, now - 60).live(10), "pending and expired");
    }

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
    fn unsafe_root_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("state");
        std::fs::create_dir(&root).unwrap();
        std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o777)).unwrap();
        let err = StateDir::new(&root).ensure_root().unwrap_err();
        assert!(matches!(err, StateError::Unsafe { .. }), "{err}");
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(dir.path(), &link).unwrap();
        assert!(StateDir::new(&link).ensure_root().is_err());
    }

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
    fn unsearchable_parent_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let parent = dir.path().join("private");
        std::fs::create_dir(&parent).unwrap();
        std::fs::set_permissions(&parent, std::fs::Permissions::from_mode(0o700)).unwrap();
        let state = StateDir::new(parent.join("state"));
        let err = state.check_traversable().unwrap_err().to_string();
        assert!(
            err.contains("private") && err.contains("0700") && err.contains("chmod o+x"),
            "{err}"
        );
        std::fs::set_permissions(&parent, std::fs::Permissions::from_mode(0o711)).unwrap();
        assert!(state.check_traversable().is_ok());
    }

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
        state.clean_pipe_dir(id).unwrap();
        assert!(pipe.is_dir());
        assert_eq!(std::fs::read_dir(&pipe).unwrap().count(), 0);
        assert!(outside.join("keep").exists());
        // Missing is fine; bad ids never reach a path.
        state
            .clean_pipe_dir("0000000000000000000000000000000a")
            .unwrap();
        assert!(matches!(
            state.clean_pipe_dir("../x"),
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
