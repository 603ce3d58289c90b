//! The records: `daemon.json` (what the hook, the supervisor and `status` know about one
//! daemon) and `containers/<cid>.json` (one container using it).
//!
//! Invariants: records are written atomically and read without locks; a container record
//! is written or removed under its daemon's records lock held shared, and a sweep removes
//! one only under that lock held exclusively and while it holds the bytes judged stale;
//! a record that does not serialise writes nothing; a daemon record is trusted only under
//! its own id (the record's id and its identity's); a container id passes runc's rule
//! before it names a file; `ProcRef` pairs a pid with its start time, so a reused pid
//! never passes for the process it named.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use std::time::{Duration, Instant};

use super::dir::{io, StateDir, StateError};
use super::lock::Hold;
use crate::identity::Identity;
use crate::{fsops, util};

/// A daemon or container record larger than this is not read (a record is under 4 KiB).
pub(super) const MAX_RECORD_BYTES: u64 = 1 << 20;

fn serialise(path: &Path) -> impl FnOnce(serde_json::Error) -> StateError + '_ {
    move |source| StateError::Serialise {
        path: path.to_owned(),
        source,
    }
}

/// A process named for good: pid plus its start time, so a reused pid never passes for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ProcRef {
    pub pid: i32,
    pub start_time: u64,
}

impl ProcRef {
    pub(crate) fn of(pid: i32) -> Option<Self> {
        util::proc_start_time(pid).map(|start_time| ProcRef { pid, start_time })
    }

    /// Whether this very process is still running (not a zombie, not a reused pid).
    pub(crate) fn alive(&self) -> bool {
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
    /// Unix seconds since the limit checks of this (multi-user) daemon stopped confirming
    /// its limits; `None` while they confirm them. Such a daemon is not restarted: other
    /// tenants' clients use its server (`mps::supervisor::limits`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limits_unconfirmed_since: Option<u64>,
}

impl DaemonRecord {
    /// Ready, and the supervisor and the daemon are the very processes the record names.
    pub(crate) fn live(&self) -> bool {
        self.status == DaemonStatus::Ready
            && self.supervisor.is_some_and(|p| p.alive())
            && self.daemon.is_some_and(|p| p.alive())
    }

    /// SIGKILL to the supervisor and the daemon the record names, where they are still
    /// those very processes.
    pub(crate) fn kill_processes(&self) {
        use nix::sys::signal::{kill, Signal};
        for p in [self.supervisor, self.daemon].into_iter().flatten() {
            if p.alive() {
                let _ = kill(nix::unistd::Pid::from_raw(p.pid), Signal::SIGKILL);
            }
        }
    }

    /// Stops the daemon the way `gpushare daemon stop` does: SIGTERM to its supervisor,
    /// which quits the daemon cleanly, then SIGKILL to whatever is left after `grace`.
    /// Call with the identity's lock held.
    pub(crate) fn stop_processes(&self, grace: std::time::Duration) {
        use nix::sys::signal::{kill, Signal};
        if let Some(sup) = self.supervisor.filter(|p| p.alive()) {
            let _ = kill(nix::unistd::Pid::from_raw(sup.pid), Signal::SIGTERM);
            let every = std::time::Duration::from_millis(10);
            util::poll_until(std::time::Instant::now() + grace, every, every, || {
                (!sup.alive()).then_some(())
            });
        }
        self.kill_processes();
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
    /// While the create is pending (`pid` none): the process making it, the shim, which
    /// execs the low-level runtime under the same pid and start time, so it lives until
    /// `runc create` returns (by when the hook has replaced this record with one naming
    /// the container's pid). A shim killed before that leaves a record that names a dead
    /// process: stale at once, not after `pending_grace`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub creator: Option<ProcRef>,
    /// The Kubernetes namespace, pod and container the engine named, where it did.
    #[serde(flatten)]
    pub names: PodNames,
    /// On a v3 daemon, the container's MPS namespace and its limits: what the supervisor
    /// makes again after a daemon restart.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mps_namespace: Option<crate::identity::Namespace>,
}

/// A container's Kubernetes names, as the CRI engine wrote them into its spec (see
/// `hook::pod_names`). Text a pod's author chose, and on engines without CRI any text the
/// container's author chose: kept at most `MAX_BYTES` each, never trusted, and
/// escaped wherever it is shown (`status`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodNames {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container: Option<String>,
}

impl PodNames {
    /// The longest name kept, in bytes: Kubernetes' longest (a pod name, a DNS subdomain
    /// of at most 253 characters; namespaces and container names are labels of at most 63).
    pub const MAX_BYTES: usize = 253;

    /// `raw` cut to at most `MAX_BYTES` bytes, on a character boundary.
    pub(crate) fn bounded(raw: &str) -> String {
        let mut end = raw.len().min(Self::MAX_BYTES);
        while !raw.is_char_boundary(end) {
            end -= 1;
        }
        raw[..end].to_owned()
    }

    /// Each name cut to `PodNames::MAX_BYTES` (a record on disk is root's, but bounded anyway)
    /// and [`util::escape`]d: safe on a terminal, in JSON read by people, in a log.
    pub(crate) fn escaped(&self) -> PodNames {
        let e = |n: &Option<String>| n.as_deref().map(|n| util::escape(&Self::bounded(n)));
        PodNames {
            namespace: e(&self.namespace),
            pod: e(&self.pod),
            container: e(&self.container),
        }
    }
}

impl ContainerRecord {
    /// A record made now: the start time is `pid`'s own, read from /proc (none while the
    /// create is pending, `pid` = `None`).
    pub(crate) fn new(
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
            creator: None,
            names: PodNames::default(),
            mps_namespace: None,
        }
    }

    /// The record the shim writes before it edits the spec: no pid yet, and this process
    /// (the shim, soon the low-level runtime it execs) as its creator.
    pub(crate) fn pending(id: String, bundle: Option<PathBuf>) -> Self {
        ContainerRecord {
            creator: ProcRef::of(std::process::id() as i32),
            ..ContainerRecord::new(id, None, bundle, None)
        }
    }

    /// Whether the container may still use its daemon: its init process runs, or its
    /// create is pending, younger than `pending_grace` seconds and its creator (when the
    /// record names one) still runs. A stopped container (process gone, not yet deleted)
    /// no longer uses MPS.
    pub(crate) fn live(&self, pending_grace: u64) -> bool {
        match (self.pid, self.start_time) {
            (Some(pid), Some(start_time)) => ProcRef { pid, start_time }.alive(),
            (Some(pid), None) => util::proc_start_time(pid).is_some(),
            (None, _) => {
                util::unix_now().saturating_sub(self.created_at) <= pending_grace
                    && self.creator.is_none_or(|p| p.alive())
            }
        }
    }
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

impl StateDir {
    pub(crate) fn read_record(&self, id: &str) -> Result<Option<DaemonRecord>, StateError> {
        Self::check_id(id)?;
        let path = self.record_path(id);
        let bytes = match fsops::read_regular(&path, MAX_RECORD_BYTES) {
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
    pub(crate) fn write_record(&self, rec: &DaemonRecord) -> Result<(), StateError> {
        Self::check_id(&rec.id)?;
        let path = self.record_path(&rec.id);
        let data = serde_json::to_vec_pretty(rec).map_err(serialise(&path))?;
        // Atomic but not fsynced, like a container record: the record names processes
        // that a crash ends, so nothing in it is worth keeping across one (a record lost
        // or stale after a crash is replaced by the next create, or removed by gc). A
        // cold start writes it three times (starting, the supervisor's pid, ready).
        fsops::write_atomic_with(&path, &data, 0o644, false).map_err(io("write", &path))
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
    /// path that is not UTF-8 does not). Holds the daemon's records lock shared while it
    /// writes, so that no sweep removes the record it replaces after judging the old one.
    pub(crate) fn add_container(&self, id: &str, rec: &ContainerRecord) -> Result<(), StateError> {
        let path = self.container_path(id, &rec.id)?;
        let data = serde_json::to_vec(rec).map_err(serialise(&path))?;
        let _writing = self.lock_records(id, Hold::Shared, Instant::now() + RECORDS_LOCK_WAIT)?;
        // Atomic but not fsynced: a container record does not outlive a reboot's meaning
        // (the container is gone too), and the shim writes one on every create.
        fsops::write_atomic_with(&path, &data, 0o600, false).map_err(io("write", &path))
    }

    /// Removes a container's record, for its owner (the container's end, a refused
    /// create); `Ok(false)` if there was none. A sweep removes only what it judged
    /// (`sweep_containers`).
    pub(crate) fn remove_container(&self, id: &str, cid: &str) -> Result<bool, StateError> {
        let path = self.container_path(id, cid)?;
        let _writing = match self.lock_records(id, Hold::Shared, Instant::now() + RECORDS_LOCK_WAIT)
        {
            Ok(l) => l,
            Err(StateError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
                return Ok(false)
            }
            Err(e) => return Err(e),
        };
        match std::fs::remove_file(&path) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(io("remove", &path)(e)),
        }
    }

    /// Container `cid`'s record on daemon `id`, if there is a readable one.
    pub(crate) fn read_container(&self, id: &str, cid: &str) -> Option<ContainerRecord> {
        let path = self.container_path(id, cid).ok()?;
        let bytes = fsops::read_regular(&path, MAX_RECORD_BYTES).ok()?;
        serde_json::from_slice(&bytes).ok()
    }

    pub(crate) fn containers(&self, id: &str) -> Result<Vec<ContainerRecord>, StateError> {
        Ok(self
            .container_files(id)?
            .into_iter()
            .map(|(rec, _, _)| rec)
            .collect())
    }

    /// Every container record of daemon `id` that parses, with the bytes it was read from
    /// and the file that held them, sorted by container id.
    fn container_files(&self, id: &str) -> Result<Vec<RecordFile>, StateError> {
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
            if let Ok(bytes) = fsops::read_regular(&entry.path(), MAX_RECORD_BYTES) {
                if let Ok(rec) = serde_json::from_slice::<ContainerRecord>(&bytes) {
                    out.push((rec, bytes, entry.path()));
                }
            }
        }
        out.sort_by(|a, b| a.0.id.cmp(&b.0.id));
        Ok(out)
    }

    /// The containers still using daemon `id`; stale records (see `ContainerRecord::live`)
    /// are removed on the way.
    pub(crate) fn live_containers(
        &self,
        id: &str,
        pending_grace: u64,
    ) -> Result<Vec<ContainerRecord>, StateError> {
        Ok(self.sweep_containers(id, pending_grace)?.0)
    }

    /// `live_containers`, and how many stale records it removed, from one read of the
    /// records.
    pub(crate) fn sweep_containers(
        &self,
        id: &str,
        pending_grace: u64,
    ) -> Result<(Vec<ContainerRecord>, usize), StateError> {
        self.sweep_with(id, pending_grace, || {})
    }

    /// The sweep, with `judged` run between the judgement and the removal (a test's seam).
    /// Records are read and judged without a lock; a stale one is removed only under the
    /// records lock held exclusively (`lock::Hold`), and only while its file still holds
    /// the bytes that were judged: a record replaced meanwhile (the hook's record over the
    /// shim's pending one) is judged again, never removed by its name. A sweep that cannot
    /// have the lock within `SWEEP_LOCK_WAIT` removes nothing this time.
    fn sweep_with(
        &self,
        id: &str,
        pending_grace: u64,
        judged: impl FnOnce(),
    ) -> Result<(Vec<ContainerRecord>, usize), StateError> {
        let (live, stale): (Vec<_>, Vec<_>) = self
            .container_files(id)?
            .into_iter()
            .partition(|(rec, _, _)| rec.live(pending_grace));
        let mut live: Vec<ContainerRecord> = live.into_iter().map(|(rec, _, _)| rec).collect();
        if stale.is_empty() {
            return Ok((live, 0));
        }
        judged();
        let Ok(_sweeping) =
            self.lock_records(id, Hold::Exclusive, Instant::now() + SWEEP_LOCK_WAIT)
        else {
            return Ok((live, 0));
        };
        let mut removed = 0;
        // The very file that was judged, not the one its record's id would name.
        for (_, judged_bytes, path) in stale {
            let now = match fsops::read_regular(&path, MAX_RECORD_BYTES) {
                Ok(b) => b,
                Err(_) => continue,
            };
            if now == judged_bytes {
                if std::fs::remove_file(&path).is_ok() {
                    removed += 1;
                }
            } else if let Ok(rec) = serde_json::from_slice::<ContainerRecord>(&now) {
                if rec.live(pending_grace) {
                    live.push(rec);
                }
            }
        }
        live.sort_by(|a, b| a.id.cmp(&b.id));
        Ok((live, removed))
    }
}

/// A container record as read: what it says, its bytes, the file that held them.
type RecordFile = (ContainerRecord, Vec<u8>, PathBuf);

/// How long a writer of one container record waits for a sweep's comparison and removal.
const RECORDS_LOCK_WAIT: Duration = Duration::from_secs(2);
/// How long a sweep waits for the writers of one daemon's records before it gives up
/// removing this time: it never holds up a create for longer than a few removals.
const SWEEP_LOCK_WAIT: Duration = Duration::from_millis(200);

#[cfg(test)]
mod tests {
    use super::*;

    fn identity() -> Identity {
        Identity {
            devices: vec!["GPU-8f8bff94-112e-9541-43da-cfd453333404".into()],
            uid: 1000,
            gid: 1000,
            multi_user: false,
            limits: crate::identity::test_limits(Some(50), None),
            ipc_host: false,
            tenant: None,
            v3: false,
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
            limits_unconfirmed_since: None,
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
                creator: None,
                names: PodNames::default(),
                mps_namespace: None,
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
            creator: None,
            names: PodNames::default(),
            mps_namespace: None,
        };
        state.add_container(id, &rec).unwrap();
        assert_eq!(state.containers(id).unwrap(), vec![rec]);
        assert!(state.remove_container(id, "c1").unwrap());
        assert!(!state.remove_container(id, "c1").unwrap());
        assert!(state.containers(id).unwrap().is_empty());
    }

    #[test]
    fn pod_names_round_trip_are_optional_and_bounded() {
        // A record written before the names existed still loads, without names.
        let old: ContainerRecord = serde_json::from_str(
            r#"{"id":"c1","pid":5,"start_time":7,"engine":"kubernetes","bundle":null,"created_at":3}"#,
        )
        .unwrap();
        assert_eq!(old.names, PodNames::default());
        assert_eq!(old.engine.as_deref(), Some("kubernetes"));
        let named = ContainerRecord {
            names: PodNames {
                namespace: Some("team-a".into()),
                pod: Some("trainer-0".into()),
                container: Some("cuda".into()),
            },
            ..old.clone()
        };
        let json = serde_json::to_value(&named).unwrap();
        assert_eq!(
            (&json["namespace"], &json["pod"], &json["container"]),
            (
                &serde_json::json!("team-a"),
                &serde_json::json!("trainer-0"),
                &serde_json::json!("cuda")
            )
        );
        assert_eq!(
            serde_json::from_value::<ContainerRecord>(json).unwrap(),
            named
        );
        assert!(serde_json::to_value(&old).unwrap().get("pod").is_none());
        // Bounded on a character boundary; escaped for showing.
        let long = "é".repeat(200);
        let cut = PodNames::bounded(&long);
        assert!(
            cut.len() <= PodNames::MAX_BYTES && cut.len() >= PodNames::MAX_BYTES - 1,
            "{}",
            cut.len()
        );
        assert!(long.starts_with(&cut));
        let evil = PodNames {
            pod: Some("a\n\"b\u{1b}[2J\u{202e}".into()),
            ..PodNames::default()
        };
        assert_eq!(
            evil.escaped().pod.as_deref(),
            Some("a\\n\"b\\u{1b}[2J\\u{202e}")
        );
        assert_eq!(
            PodNames {
                pod: Some("x".repeat(1000)),
                ..PodNames::default()
            }
            .escaped()
            .pod
            .map(|p| p.len()),
            Some(PodNames::MAX_BYTES)
        );
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
            creator: None,
            names: PodNames::default(),
            mps_namespace: None,
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
    fn a_sweep_keeps_the_live_records_and_counts_the_stale_it_removed() {
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::new(dir.path());
        let id = "0123456789abcdef0123456789abcdef";
        std::fs::create_dir_all(state.containers_dir(id)).unwrap();
        let me = std::process::id() as i32;
        let live = ContainerRecord::new("live".into(), Some(me), None, None);
        state.add_container(id, &live).unwrap();
        for cid in ["gone1", "gone2"] {
            let rec = ContainerRecord::new(cid.into(), Some(i32::MAX), None, None);
            state.add_container(id, &rec).unwrap();
        }
        assert_eq!(
            state.sweep_containers(id, 10).unwrap(),
            (vec![live.clone()], 2)
        );
        assert_eq!(state.containers(id).unwrap(), vec![live.clone()]);
        assert_eq!(
            state.sweep_containers(id, 10).unwrap(),
            (vec![live.clone()], 0)
        );
        assert_eq!(state.live_containers(id, 10).unwrap(), vec![live]);
    }

    /// The race a node's scale makes frequent: a sweep reads the shim's pending record,
    /// the createRuntime hook replaces it with the container's (pid) record, runc create
    /// exits (the pending record's creator is gone), and the sweep judges what it read
    /// stale. It must not remove the record that now has that name.
    #[test]
    fn a_sweep_never_removes_a_record_replaced_after_it_was_judged() {
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::new(dir.path());
        let id = "0123456789abcdef0123456789abcdef";
        std::fs::create_dir_all(state.containers_dir(id)).unwrap();
        // The pending record of a create whose creator (the shim, then runc) has exited.
        let mut exited = std::process::Command::new("true").spawn().unwrap();
        let creator = ProcRef::of(exited.id() as i32).unwrap_or(ProcRef {
            pid: exited.id() as i32,
            start_time: 1,
        });
        exited.wait().unwrap();
        let pending = ContainerRecord {
            creator: Some(creator),
            ..ContainerRecord::new("c1".into(), None, None, None)
        };
        state.add_container(id, &pending).unwrap();
        assert!(
            !pending.live(60),
            "the pending record is stale once its creator exited"
        );
        // The hook's record, written between the sweep's judgement and its removal.
        let me = std::process::id() as i32;
        let running = ContainerRecord::new("c1".into(), Some(me), None, None);
        let (live, removed) = state
            .sweep_with(id, 60, || state.add_container(id, &running).unwrap())
            .unwrap();
        assert_eq!(
            state.containers(id).unwrap(),
            vec![running.clone()],
            "the running container's record was removed by a sweep that judged the record it replaced"
        );
        assert_eq!((live, removed), (vec![running], 0));
        // A record still holding what was judged stale is removed.
        state.add_container(id, &pending).unwrap();
        assert_eq!(state.sweep_with(id, 60, || {}).unwrap(), (vec![], 1));
        assert!(state.containers(id).unwrap().is_empty());
    }

    /// A sweep removes the file it judged, whatever id the record inside names: a stale
    /// record at `a.json` that says it is `b` goes, the live `b.json` stays.
    #[test]
    fn a_sweep_removes_the_file_it_judged_not_the_one_its_id_names() {
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::new(dir.path());
        let id = "0123456789abcdef0123456789abcdef";
        std::fs::create_dir_all(state.containers_dir(id)).unwrap();
        let me = std::process::id() as i32;
        let live = ContainerRecord::new("b".into(), Some(me), None, None);
        state.add_container(id, &live).unwrap();
        let stale = ContainerRecord::new("b".into(), Some(i32::MAX), None, None);
        let misnamed = state.containers_dir(id).join("a.json");
        std::fs::write(&misnamed, serde_json::to_vec(&stale).unwrap()).unwrap();
        assert_eq!(
            state.sweep_containers(id, 10).unwrap(),
            (vec![live.clone()], 1)
        );
        assert!(!misnamed.exists());
        assert_eq!(state.containers(id).unwrap(), vec![live]);
    }

    /// A sweep removes nothing while a writer holds the records lock (it gives up after
    /// `SWEEP_LOCK_WAIT`, never holding up the writer), and a writer waits out a sweep.
    #[test]
    fn a_sweep_removes_nothing_while_a_writer_holds_the_records_lock() {
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::new(dir.path());
        let id = "0123456789abcdef0123456789abcdef";
        std::fs::create_dir_all(state.containers_dir(id)).unwrap();
        let gone = ContainerRecord::new("gone".into(), Some(i32::MAX), None, None);
        state.add_container(id, &gone).unwrap();
        let writing = state
            .lock_records(id, Hold::Shared, Instant::now())
            .unwrap();
        let began = Instant::now();
        assert_eq!(state.sweep_containers(id, 10).unwrap(), (vec![], 0));
        assert!(began.elapsed() < Duration::from_secs(2));
        assert_eq!(state.containers(id).unwrap(), vec![gone.clone()]);
        // Writers share the lock with each other.
        state.add_container(id, &gone).unwrap();
        drop(writing);
        assert_eq!(state.sweep_containers(id, 10).unwrap(), (vec![], 1));
        // A daemon without its containers/ directory: nothing to remove, nothing made.
        let other = "fedcba9876543210fedcba9876543210";
        assert!(!state.remove_container(other, "gone").unwrap());
        assert!(!state.containers_dir(other).exists());
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
            creator: None,
            names: PodNames::default(),
            mps_namespace: None,
        };
        assert!(rec(Some(me), util::proc_start_time(me), now).live(10));
        assert!(!rec(Some(me), Some(1), now).live(10), "reused pid");
        assert!(!rec(Some(i32::MAX), None, now).live(10), "dead pid");
        assert!(rec(None, None, now).live(10), "pending and young");
        assert!(!rec(None, None, now - 60).live(10), "pending and expired");
        // A pending record names its creator (the shim): stale as soon as it is gone.
        let pending = ContainerRecord::pending("c".into(), None);
        assert_eq!(pending.creator.map(|p| p.pid), Some(me));
        assert!(pending.live(10), "pending, creator alive");
        let dead = ProcRef {
            pid: me,
            start_time: 1,
        };
        let orphan = ContainerRecord {
            creator: Some(dead),
            ..pending
        };
        assert!(!orphan.live(10), "pending, creator gone");
    }
}
