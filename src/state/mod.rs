//! The state directory: the one type that owns every host path gpushare uses.
//!
//! Layout (docs/design.md, "Layout"), short names so the socket path fits in 108 bytes:
//! ```text
//! <state-dir>/                 0711 root   (refused if writable by group/others or a symlink)
//!   locks/<id>.lock            0600 root   flock per daemon identity; never removed
//!   locks/<id>.sup             0600 root   flock held by the daemon's supervisor all its life
//!   locks/node.lock            0600 root   flock held while a new daemon's directories are made
//!   locks/agent.lock           0600 root   flock held by the node's agent all its life
//!   agent.sock                 0600 root   the agent's socket (`mps::agent`)
//!   mps/                       0711 root
//!     <id>/                    0711 root
//!       daemon.json            0644 root   record of the daemon (identity, pids, status)
//!       pipe/                  0700 uid    CUDA_MPS_PIPE_DIRECTORY (multi-user: 0755 root)
//!       log/                   tmpfs of mps.log-size, 0700 uid (multi-user: 0755 root): CUDA_MPS_LOG_DIRECTORY
//!       shm/                   tmpfs, 0700 uid (multi-user: 1777): the daemon's and the clients' /dev/shm
//!       containers/<cid>.json  0700 root   one record per container using the daemon
//!       containers/records.lock 0600 root  flock: shared by record writers, exclusive by a sweep
//!     .<id>.removing/          a daemon directory being removed (gc finishes it after a crash)
//! ```
//! Invariants: every parent is traversable by the daemon's UID and writable by root only;
//! records are written atomically and read without locks; every name that reaches a path
//! (daemon id, container id) is validated first. What a tenant can write (pipe/, and log/
//! and shm/ when mounted into containers) is on its own sized tmpfs or emptied and removed
//! with `fsops::remove_contents`/`remove_all`, which never follow a link and need a fixed
//! number of fds whatever was planted. A new daemon directory is made only under the node
//! lock, after counting the daemons against `mps.max-daemons` and
//! `mps.max-daemons-per-uid` and their shm tmpfs against `mps.shm-size-total` and
//! `mps.shm-size-per-uid`; the warm path (directories present) takes no lock.
//!
//! A full cap first takes back abandoned directories and idle daemons among those it
//! counts (`reclaim`).
//!
//! One file per job: the layout above and its paths in `dir` (`StateDir`, `StateError`),
//! which every other file takes them from; `record` (daemon.json and the
//! container records), `lock` (an identity's lock and the node lock), `budget` (what a
//! new daemon may take: the sizes and caps `skeleton` and `reclaim` both read),
//! `skeleton` (a daemon's directories, its tmpfs mounts, the daemon and shm caps),
//! `reclaim` (taking back abandoned directories and idle daemons), `remove` (removal
//! without racing a create, and the tombstones a crash leaves).

mod budget;
mod dir;
mod lock;
mod reclaim;
mod record;
mod remove;
mod skeleton;

pub(crate) use budget::{AskClients, Budget};
pub use dir::{StateDir, StateError};
pub(crate) use reclaim::Abandoned;
pub use record::{
    valid_container_id, ContainerRecord, DaemonRecord, DaemonStatus, PodNames, ProcRef,
};
pub(crate) use skeleton::{CapUse, Capacity, Owner};
