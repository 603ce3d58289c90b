//! What a new daemon may take on this node (`Budget`, from `[mps]` in the config), the
//! caps a new daemon directory is counted against (`skeleton`) and that taking back an
//! idle daemon's place reads (`reclaim`).
//!
//! Invariant: plain data; the state directory never talks to daemons itself, it is handed
//! `AskClients` by `mps`.

use std::path::PathBuf;
use std::time::Duration;

use super::dir::StateDir;
use crate::identity::Identity;

/// Asks a daemon whether MPS clients are attached to it: `Some(true)`, `Some(false)`, or
/// `None` when it did not say. The state directory does not talk to daemons; `mps` gives
/// this to a `Budget`, and a cap asks it before it stops an idle daemon.
pub(crate) type AskClients = dyn Fn(&StateDir, &str, &Identity) -> Option<bool> + Send + Sync;

/// What a new daemon may take on this node (`[mps]` in the config): the sizes of its
/// tmpfs mounts and the caps on the number of daemons.
#[derive(Clone)]
pub(crate) struct Budget {
    /// The shm tmpfs `size=` option (`25%`, or bytes).
    pub shm_size: String,
    /// The same size in bytes, as the shm caps count it.
    pub shm_bytes: u64,
    /// `mps.shm-size-per-uid`: bytes of shm tmpfs the daemons of one UID (the owner of
    /// their pipe directories) may have together; `None`: no bound.
    pub shm_per_uid: Option<u64>,
    /// `mps.shm-size-total`: bytes of shm tmpfs every daemon of the node may have
    /// together; `None`: no bound.
    pub shm_total: Option<u64>,
    /// Bytes of the log tmpfs.
    pub log_size: u64,
    /// `mps.max-daemons`: daemon directories on the node.
    pub max_daemons: u32,
    /// `mps.max-daemons-per-uid`: daemon directories whose pipe directory a UID owns
    /// (multi-user daemons are root's, uid 0).
    pub max_daemons_per_uid: u32,
    /// How long a new daemon waits for the node lock.
    pub lock_wait: Duration,
    /// Seconds a pending container record keeps its daemon in use (`live`).
    pub pending_grace: u64,
    /// How long an idle daemon's supervisor has to stop it when a cap needs its place.
    pub stop_grace: Duration,
    /// The config file a refusal names.
    pub config: PathBuf,
    /// Whether an idle daemon still has MPS clients (whatever its records say): one that
    /// has, or does not say, is not stopped to make room. `None`: not asked.
    pub clients: Option<std::sync::Arc<AskClients>>,
}
