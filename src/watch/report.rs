//! `<state-dir>/watch.json`: what the watcher found at its last scan, which `gpushare
//! status` and its metrics read instead of asking NVML themselves (a node's status stays
//! one file read, however many processes run).
//!
//! Invariants: written atomically by the watcher only (root, mode 0600: it names every
//! tenant's pods), read as a bounded regular file; names in it are stored as the records
//! hold them and escaped where they are shown; adding fields keeps the schema name.

use serde::{Deserialize, Serialize};

use crate::config::WatchPolicy;
use crate::state::{PodNames, ProcRef, StateDir};

pub(crate) const SCHEMA: &str = "gpushare.watch/v1";

/// The largest report read (a node with thousands of GPU processes writes a few MiB).
const MAX_BYTES: u64 = 64 << 20;

/// What a GPU process is to MPS.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum Kind {
    /// The MPS server of one of gpushare's daemons.
    MpsServer,
    /// In NVML's MPS list: a client of some MPS server.
    MpsClient,
    /// A context of its own, outside MPS.
    Direct,
}

impl Kind {
    pub(crate) fn word(self) -> &'static str {
        match self {
            Kind::MpsServer => "mps-server",
            Kind::MpsClient => "mps-client",
            Kind::Direct => "direct",
        }
    }
}

/// One process with a context on one GPU.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Process {
    /// In the host's PID namespace.
    pub pid: i32,
    pub kind: Kind,
    /// The GPU's UUID and NVML index.
    pub gpu: String,
    pub gpu_index: u32,
    /// As NVML reports it; `None` where it reports none.
    pub used_memory_bytes: Option<u64>,
    /// The served container it belongs to (by cgroup), and that container's daemon; for
    /// an MPS server, only its daemon. `None`: no container gpushare serves.
    pub container_id: Option<String>,
    pub daemon: Option<String>,
    #[serde(flatten)]
    pub names: PodNames,
    /// What the watcher did or would do about it, and why; `None`: nothing.
    pub verdict: Option<String>,
}

/// What the watcher did since it started, cumulative (Prometheus counters).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Counters {
    /// Processes of served containers killed for using a served GPU outside MPS.
    pub stopped_direct: u64,
    /// MPS clients ended (`terminate_client`, then SIGKILL) above their container's limit.
    pub ended_clients: u64,
    /// Of those, the ones whose `terminate_client` the daemon did not confirm (killed anyway).
    pub unconfirmed_terminations: u64,
    /// Actions not carried out: the process was no longer the one listed and judged (its
    /// PID taken by another, or it left its cgroup), it could not be pinned, or the kill
    /// failed. A process that ended on its own before it was stopped is not counted.
    pub failed: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Report {
    pub schema: String,
    pub watcher: Option<ProcRef>,
    pub policy: WatchPolicy,
    /// Whether `mps.limits` is `enforced` (only then does `act` act).
    pub enforced: bool,
    pub interval_seconds: f64,
    /// Unix seconds at the end of the last scan, and how long it took.
    pub scanned_at: u64,
    pub scan_seconds: f64,
    /// Why the last scan saw no GPU (NVML did not answer); `None` when it did.
    pub error: Option<String>,
    /// The GPUs whose processes the last scan could not list (after its retries): their
    /// processes are missing from `processes`, and got no verdict in it; every other GPU's
    /// did.
    #[serde(default)]
    pub unlisted: Vec<Unlisted>,
    /// How many times, since the watcher started, a scan could not list one GPU
    /// (cumulative, per scan and GPU).
    #[serde(default)]
    pub gpu_list_failures: u64,
    pub processes: Vec<Process>,
    pub actions: Counters,
}

/// A GPU whose processes a scan could not list.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Unlisted {
    /// Its NVML index, and its UUID where NVML gave it.
    pub gpu_index: u32,
    pub gpu: Option<String>,
    pub error: String,
}

impl Report {
    /// The last report, where a watcher ever wrote one that parses.
    pub(crate) fn read(state: &StateDir) -> Option<Report> {
        let bytes = crate::fsops::read_regular(&state.watch_report_path(), MAX_BYTES).ok()?;
        serde_json::from_slice::<Report>(&bytes)
            .ok()
            .filter(|r| r.schema == SCHEMA)
    }

    pub(crate) fn write(&self, state: &StateDir) -> std::io::Result<()> {
        let bytes = serde_json::to_vec(self).map_err(std::io::Error::other)?;
        // Root's only: it names every tenant's pods and processes, at a path anyone can
        // guess. Rewritten every interval and worthless after a crash: no fsync.
        crate::fsops::write_atomic_with(&state.watch_report_path(), &bytes, 0o600, false)
    }

    /// Whether it tells the present: its watcher runs and it is at most three intervals old.
    pub(crate) fn fresh(&self, now: u64) -> bool {
        self.watcher.is_some_and(|p| p.alive())
            && (now.saturating_sub(self.scanned_at) as f64) <= 3.0 * self.interval_seconds + 1.0
    }
}
