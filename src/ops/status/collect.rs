//! What `gpushare status` sees: every daemon under the state directory, its record, its
//! processes, its health and its containers, and the NRI plugin's state, as one view
//! (`StatusView`) whose JSON form has a stable schema (`gpushare.status/v1`).
//!
//! Invariants: reads records without taking any lock a create could wait on; every daemon
//! directory is shown, also one without a record (`pending`: a create is making it;
//! `abandoned`: a create that failed left it, until it is taken back); a daemon's
//! health comes from its control interface (a record or a socket alone proves nothing),
//! and the live daemons are asked side by side, at most `PROBE_THREADS` at once, so a
//! node's status costs a few probes, not one per daemon in a row; adding fields to the
//! JSON keeps the schema name, renaming or removing one changes it.
use std::time::Duration;

use serde::Serialize;

use crate::config::Config;
use crate::device::Inventory;
use crate::mps::control::{resolve_binary, Control};
use crate::state::{ContainerRecord, DaemonStatus, StateDir};

pub(crate) const SCHEMA: &str = "gpushare.status/v1";

/// One device of a daemon, described from the inventory when it can be read.
#[derive(Debug, Serialize)]
pub(crate) struct DeviceView {
    pub uuid: String,
    /// `GPU 0` or `MIG 1:0`.
    pub name: Option<String>,
    pub model: Option<String>,
    pub mig_profile: Option<String>,
}

/// A daemon's limits as `status` shows them: every limit's row, set or not.
#[derive(Debug, Default)]
pub(crate) struct LimitsView(pub crate::identity::LimitValues);

impl Serialize for LimitsView {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = s.serialize_map(None)?;
        for (key, limit, _) in crate::request::limits() {
            map.serialize_entry(limit.status_field, &self.0.get(key))?;
        }
        map.end()
    }
}

impl LimitsView {
    /// Each limit that is set as the table shows it: `threads=25%`, `mem=4096M`.
    pub(crate) fn labels(&self) -> impl Iterator<Item = String> + '_ {
        crate::request::limits().filter_map(|(key, limit, number)| {
            let value = self.0.get(key)?;
            Some(format!(
                "{}={}{}",
                limit.label,
                number.mps_text(value),
                limit.unit
            ))
        })
    }
}

#[derive(Debug, Serialize)]
pub(crate) struct DaemonView {
    pub id: String,
    pub devices: Vec<DeviceView>,
    /// Host UID the daemon serves (0 and `multi_user` for a multi-user daemon).
    pub uid: u32,
    pub multi_user: bool,
    /// Its tenant beside the UID under `mps.tenant = "namespace"` (`{"namespace": …}` or
    /// `"no-namespace"`); absent under `"uid"`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tenant: Option<crate::identity::Tenant>,
    pub ipc: &'static str,
    /// The limits it enforces, each its row's `status_field` (`active_thread_percentage`,
    /// `pinned_memory_limit_bytes`), `null` when unset.
    #[serde(flatten)]
    pub limits: LimitsView,
    pub status: ViewStatus,
    pub pid: Option<i32>,
    pub supervisor_pid: Option<i32>,
    /// Seconds since the current daemon process became ready.
    pub uptime_seconds: Option<u64>,
    pub restarts: u32,
    /// `ok` (processes alive and control interface answering), `unconfirmed` (so, but
    /// the supervisor's limit checks of a multi-user daemon get no answer), `unresponsive`
    /// (alive, not answering), `unknown` (alive, but the control binary to ask with is
    /// missing), `down`.
    pub health: &'static str,
    /// Why the health is not `ok`; `None` when it is.
    pub health_reason: Option<String>,
    /// Unix seconds since the supervisor's limit checks of this multi-user daemon stopped
    /// confirming its limits (the record's), whether or not `status` reached it itself.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub limits_unconfirmed_since: Option<u64>,
    pub servers: Option<usize>,
    pub clients: Option<usize>,
    pub error: Option<String>,
    /// The directories a client needs (CUDA_MPS_PIPE_DIRECTORY, and /dev/shm unless ipc=host).
    pub pipe_dir: String,
    pub shm_dir: Option<String>,
    pub log_dir: String,
    pub containers: Vec<ContainerRecord>,
    /// `"v3"` for an MPS v3 daemon (docs/mps.md, "Two backends"); absent for legacy.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub protocol: Option<&'static str>,
    /// A v3 daemon's namespaces: each container record's, then each the daemon lists
    /// that no record names; absent for legacy.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub namespaces: Option<Vec<NamespaceView>>,
}

/// One MPS namespace of a v3 daemon.
#[derive(Debug, Serialize)]
pub(crate) struct NamespaceView {
    /// Its name, escaped (one the daemon lists is the daemon's text).
    pub name: String,
    /// `container`: a container record names it; `default`: the server's own, where a
    /// client that reaches the server's directory lands; `unrecorded`: the daemon lists
    /// it and no container record names it (a container ended while the daemon was not
    /// reachable; the supervisor deletes it at its next check).
    pub kind: &'static str,
    /// The container whose record names it; `null` for the other kinds.
    pub container_id: Option<String>,
    /// Its limits: the record's for a container's, else as the daemon lists them.
    #[serde(flatten)]
    pub limits: LimitsView,
    /// Its clients in the daemon's `client list`; `null` when the daemon did not answer.
    pub clients: Option<usize>,
    /// Whether the daemon's `namespace list` has it (a container's namespace that it
    /// lacks is made again by the supervisor); `null` when the daemon did not answer.
    pub listed: Option<bool>,
}

/// A daemon's status: its record's, or for a directory without a record, what it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub(crate) enum ViewStatus {
    Record(DaemonStatus),
    Directory(DirectoryState),
}

/// A daemon directory without a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum DirectoryState {
    /// A live container record (a create between the shim and its hook) uses it.
    Pending,
    /// Nothing uses it: a create that failed left it. Its reaper, the next create that
    /// needs its place under a cap, or `gpushare gc` removes it.
    Abandoned,
}

impl DaemonView {
    /// The UID it serves, or `multi` for a multi-user daemon.
    pub(crate) fn uid_label(&self) -> String {
        if self.multi_user {
            "multi".to_owned()
        } else {
            self.uid.to_string()
        }
    }
}

#[derive(Debug, Serialize)]
pub(crate) struct StatusView {
    pub schema: &'static str,
    pub state_dir: String,
    pub daemons: Vec<DaemonView>,
    /// The NRI plugin (`gpushare nri`), where one ever ran on this node.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nri: Option<NriView>,
    /// The daemon caps, their use and the one that binds (`capacity`); `None` when the
    /// state directory cannot be read.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub capacity: Option<crate::state::Capacity>,
    /// The GPU processes, from the watcher's last scan (`gpushare watch`), where one ever
    /// ran on this node.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub watch: Option<WatchView>,
}

/// What the GPU process watcher last wrote (`watch::report`), names escaped.
#[derive(Debug, Serialize)]
pub(crate) struct WatchView {
    /// Its watcher runs and the scan is at most three intervals old.
    pub fresh: bool,
    pub policy: crate::config::WatchPolicy,
    pub enforced: bool,
    pub scanned_at: u64,
    pub interval_seconds: f64,
    pub scan_seconds: f64,
    pub error: Option<String>,
    /// The GPUs whose processes the last scan could not list (none of theirs is in
    /// `processes`), and how many (scan, GPU) listings failed since the watcher started.
    pub unlisted: Vec<crate::watch::report::Unlisted>,
    pub gpu_list_failures: u64,
    /// Every process with a context on a GPU: its container and pod where gpushare serves
    /// it, its daemon for an MPS server, neither for the host's and other containers'.
    pub processes: Vec<crate::watch::report::Process>,
    pub actions: crate::watch::report::Counters,
}

impl WatchView {
    pub(crate) fn read(state: &StateDir) -> Option<WatchView> {
        let r = crate::watch::report::Report::read(state)?;
        let esc = |s: &Option<String>| s.as_deref().map(crate::util::escape);
        Some(WatchView {
            fresh: r.fresh(crate::util::unix_now()),
            policy: r.policy,
            enforced: r.enforced,
            scanned_at: r.scanned_at,
            interval_seconds: r.interval_seconds,
            scan_seconds: r.scan_seconds,
            error: esc(&r.error),
            unlisted: r
                .unlisted
                .into_iter()
                .map(|u| crate::watch::report::Unlisted {
                    gpu: esc(&u.gpu),
                    error: crate::util::escape(&u.error),
                    ..u
                })
                .collect(),
            gpu_list_failures: r.gpu_list_failures,
            processes: r
                .processes
                .into_iter()
                .map(|p| crate::watch::report::Process {
                    gpu: crate::util::escape(&p.gpu),
                    container_id: esc(&p.container_id),
                    daemon: esc(&p.daemon),
                    names: p.names.escaped(),
                    verdict: esc(&p.verdict),
                    ..p
                })
                .collect(),
            actions: r.actions,
        })
    }
}

/// Where the NRI plugin stands, from what it wrote of itself (`nri::PluginState`).
#[derive(Debug, Serialize)]
pub(crate) struct NriView {
    /// Its process runs and is registered with a runtime.
    pub connected: bool,
    /// Its process runs (registered or not).
    pub running: bool,
    pub runtime: Option<String>,
    /// Since when (Unix seconds) it has been connected, or not.
    pub since: u64,
    pub error: Option<String>,
    /// Containers with a request that its audits found running unserved.
    pub unserved: Vec<String>,
    /// How many such containers it ended (`[nri] unserved = "evict"`).
    pub evicted: u64,
}

impl NriView {
    pub(crate) fn read(state: &StateDir) -> Option<NriView> {
        let s = crate::nri::PluginState::read(state)?;
        Some(NriView {
            connected: s.live_and_connected(),
            running: s.process.is_some_and(|p| p.alive()),
            runtime: s.runtime.as_deref().map(crate::util::escape),
            since: s.since,
            error: s.error.as_deref().map(crate::util::escape),
            unserved: s.unserved.iter().map(|u| crate::util::escape(u)).collect(),
            evicted: s.evicted,
        })
    }

    /// One line for people: connected to what, or why not and what a pod gets meanwhile.
    pub(crate) fn line(&self) -> String {
        let mut line = self.state_line();
        if self.evicted > 0 {
            line += &format!(
                "; it evicted {} unserved container(s) ([nri] unserved = \"evict\")",
                self.evicted
            );
        }
        line
    }

    fn state_line(&self) -> String {
        match (self.running, self.connected) {
            (true, true) if !self.unserved.is_empty() => format!(
                "NRI plugin connected to {}; {} container(s) with a request run unserved, created while it was not connected or stalled (recreate them): {}",
                self.runtime.as_deref().unwrap_or("the runtime"),
                self.unserved.len(),
                self.unserved.join(", ")
            ),
            (true, true) => format!(
                "NRI plugin connected to {}",
                self.runtime.as_deref().unwrap_or("the runtime")
            ),
            (true, false) => format!(
                "NRI plugin running but not connected ({}): the runtime creates pods without it, and a pod with a request runs unserved",
                self.error.as_deref().unwrap_or("not registered yet")
            ),
            (false, _) => "NRI plugin not running (it ran here before): the runtime creates pods without it, and a pod with a request runs unserved; removed on purpose: `gpushare gc` forgets it".to_owned(),
        }
    }
}

fn describe(inventory: Option<&Inventory>, uuid: &str) -> DeviceView {
    let mut v = DeviceView {
        uuid: uuid.to_owned(),
        name: None,
        model: None,
        mig_profile: None,
    };
    let Some(inv) = inventory else { return v };
    for gpu in &inv.gpus {
        if gpu.uuid.eq_ignore_ascii_case(uuid) {
            v.name = Some(format!("GPU {}", gpu.index));
            v.model = Some(gpu.name.clone());
        }
        for mig in &gpu.mig_devices {
            if mig.uuid.eq_ignore_ascii_case(uuid) {
                v.name = Some(format!("MIG {}:{}", gpu.index, mig.index));
                v.model = Some(gpu.name.clone());
                v.mig_profile = Some(mig.profile.clone());
            }
        }
    }
    v
}

/// What a daemon answered `probe`.
#[derive(Debug, PartialEq)]
struct Probed {
    servers: usize,
    clients: usize,
    /// A v3 daemon's namespaces.
    v3: Option<V3Answer>,
}

/// A v3 daemon's clients per namespace (`client list --all`, its namespace column) and
/// its namespaces (`namespace list`; `None` where that did not answer), names escaped.
#[derive(Debug, PartialEq)]
struct V3Answer {
    clients: std::collections::BTreeMap<String, usize>,
    listed: Option<Vec<crate::mps::v3::Listed>>,
}

/// A daemon's answer to `probe`, or why it did not answer.
type Answer = Result<Probed, String>;

/// How long `status` waits for one daemon's answers.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// Asks the daemon for its servers and their clients; the error says why it could not.
fn probe(control: &Control) -> Answer {
    if control.v3 {
        return probe_v3(control);
    }
    let servers = control.clients(PROBE_TIMEOUT).map_err(|e| e.to_string())?;
    let clients = servers.iter().map(|(_, n)| n.unwrap_or(0)).sum();
    Ok(Probed {
        servers: servers.len(),
        clients,
        v3: None,
    })
}

/// A v3 daemon's one server, its clients by namespace, and its namespaces, within
/// [`PROBE_TIMEOUT`] in all.
fn probe_v3(control: &Control) -> Answer {
    use crate::mps::v3;
    let deadline = std::time::Instant::now() + PROBE_TIMEOUT;
    let reply = control
        .client_list(PROBE_TIMEOUT)
        .map_err(|e| e.to_string())?;
    let clients = client_rows(&reply);
    let listed = v3::listed(control, deadline).ok().map(|rows| {
        rows.into_iter()
            .map(|l| v3::Listed {
                name: crate::util::escape(&l.name),
                ..l
            })
            .collect()
    });
    Ok(Probed {
        servers: 1,
        clients: clients.values().sum(),
        v3: Some(V3Answer { clients, listed }),
    })
}

/// The clients of a `client list --all --format=csv,noheader` reply by namespace (its
/// fourth column: pid, server, device, namespace, command), names escaped; a row without
/// one counts under `""`.
fn client_rows(reply: &str) -> std::collections::BTreeMap<String, usize> {
    let mut by = std::collections::BTreeMap::new();
    for row in crate::mps::reply::csv_rows(reply) {
        let ns = row
            .get(3)
            .map_or_else(String::new, |n| crate::util::escape(n));
        *by.entry(ns).or_insert(0) += 1;
    }
    by
}

/// A v3 daemon's namespaces as `status` shows them: each container record's (its
/// limits from the record), then each the daemon lists, or has clients in, that no
/// record names.
fn namespace_views(
    containers: &[ContainerRecord],
    answer: Option<&V3Answer>,
) -> Vec<NamespaceView> {
    use std::collections::BTreeSet;
    let listed_names: Option<BTreeSet<&str>> = answer
        .and_then(|a| a.listed.as_ref())
        .map(|l| l.iter().map(|n| n.name.as_str()).collect());
    let clients_of = |name: &str| answer.map(|a| a.clients.get(name).copied().unwrap_or(0));
    let mut out: Vec<NamespaceView> = containers
        .iter()
        .filter_map(|c| {
            let ns = c.mps_namespace.as_ref()?;
            Some(NamespaceView {
                name: crate::util::escape(&ns.name),
                kind: "container",
                container_id: Some(c.id.clone()),
                limits: LimitsView(ns.limits.clone()),
                clients: clients_of(&ns.name),
                listed: listed_names.as_ref().map(|l| l.contains(ns.name.as_str())),
            })
        })
        .collect();
    let recorded: BTreeSet<String> = out.iter().map(|n| n.name.clone()).collect();
    let Some(answer) = answer else { return out };
    let mut others: Vec<(String, Option<&crate::mps::v3::Listed>)> = Vec::new();
    for l in answer.listed.iter().flatten() {
        others.push((l.name.clone(), Some(l)));
    }
    for name in answer.clients.keys() {
        if !others.iter().any(|(n, _)| n == name) {
            others.push((name.clone(), None));
        }
    }
    for (name, listed) in others {
        if recorded.contains(&name) {
            continue;
        }
        use crate::request::{ACTIVE_THREAD_PERCENTAGE, PINNED_MEMORY_LIMIT};
        let limits = listed
            .map(|l| {
                [
                    l.active_thread_percentage
                        .map(|p| (&ACTIVE_THREAD_PERCENTAGE, p.round().max(0.0) as u64)),
                    l.pinned_memory_limit.map(|b| (&PINNED_MEMORY_LIMIT, b)),
                ]
                .into_iter()
                .flatten()
                .collect()
            })
            .unwrap_or_default();
        out.push(NamespaceView {
            kind: if name == "default" {
                "default"
            } else {
                "unrecorded"
            },
            container_id: None,
            limits: LimitsView(limits),
            clients: Some(answer.clients.get(&name).copied().unwrap_or(0)),
            listed: answer.listed.as_ref().map(|_| listed.is_some()),
            name,
        });
    }
    out
}

/// How many daemons are asked at once. A probe is mostly waiting (the control client's
/// start, the daemon's answer), so a node's daemons are asked side by side; the bound
/// keeps a node with hundreds of daemons from starting hundreds of clients at once.
const PROBE_THREADS: usize = 8;

/// `probe` for each `Some` control, up to `PROBE_THREADS` at a time; the answers in the
/// same order (`None` where there was no control). The calling thread probes too, so a
/// thread that cannot be started only makes it slower.
fn probe_all(controls: &[Option<Control>]) -> Vec<Option<Answer>> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let next = AtomicUsize::new(0);
    let work = || {
        let mut done = Vec::new();
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            let Some(control) = controls.get(i) else {
                return done;
            };
            if let Some(c) = control {
                done.push((i, probe(c)));
            }
        }
    };
    let wanted = controls.iter().flatten().count().min(PROBE_THREADS);
    let done: Vec<(usize, Answer)> = std::thread::scope(|s| {
        let helpers: Vec<_> = (1..wanted)
            .filter_map(|_| std::thread::Builder::new().spawn_scoped(s, work).ok())
            .collect();
        let mut done = work();
        for h in helpers {
            done.extend(h.join().unwrap_or_default());
        }
        done
    });
    let mut out: Vec<_> = controls.iter().map(|_| None).collect();
    for (i, answer) in done {
        out[i] = Some(answer);
    }
    out
}

/// Collects the view of every daemon under the state dir. The live daemons are asked
/// for their servers and clients side by side (`probe_all`).
pub(crate) fn collect(cfg: &Config) -> StatusView {
    let state = StateDir::new(&cfg.state_dir);
    let inventory = crate::device::load(&cfg.inventory, cfg.driver_root.as_deref()).ok();
    let binary = resolve_binary(&cfg.mps.control_binary, cfg.driver_root.as_deref())
        .map_err(|e| e.to_string());
    let now = crate::util::unix_now();
    let mut bare = Vec::new();
    let records: Vec<_> = state
        .daemon_ids()
        .unwrap_or_default()
        .into_iter()
        .filter_map(|id| match state.read_record(&id) {
            Ok(Some(rec)) => Some((id, rec)),
            _ => {
                bare.push(id);
                None
            }
        })
        .map(|(id, rec)| {
            let alive = rec.live();
            (id, rec, alive)
        })
        .collect();
    let controls: Vec<Option<Control>> = records
        .iter()
        .map(|(id, rec, alive)| {
            let b = binary.as_ref().ok().filter(|_| *alive)?;
            Some(Control::of_daemon(b.clone(), &state, id, &rec.identity))
        })
        .collect();
    let answers = probe_all(&controls);
    let mut daemons = Vec::new();
    for ((id, rec, alive), answer) in records.into_iter().zip(answers) {
        let ident = &rec.identity;
        // Down: `None`; alive: its answer, or why there is no control binary to ask with.
        let probed = alive.then(|| {
            binary.clone().map(|_| {
                // Every alive daemon with a binary was asked (`probe_all`).
                answer.unwrap_or_else(|| Err("the daemon was not asked".to_owned()))
            })
        });
        let unconfirmed = rec.limits_unconfirmed_since.filter(|_| alive);
        let (health, health_reason) = match &probed {
            Some(Ok(Ok(_))) if unconfirmed.is_some() => (
                "unconfirmed",
                unconfirmed.map(|since| format!("its supervisor's limit checks have not confirmed its limits for {} s (control jammed? see gpushare.log); a multi-user daemon is not restarted for it", now.saturating_sub(since))),
            ),
            Some(Ok(Ok(_))) => ("ok", None),
            Some(Ok(Err(e))) => ("unresponsive", Some(e.clone())),
            Some(Err(e)) => ("unknown", Some(format!("cannot ask the daemon: {e}"))),
            None => (
                "down",
                Some(rec.error.clone().unwrap_or_else(|| {
                    format!(
                        "{:?}: {}",
                        rec.status,
                        if rec.supervisor.is_some_and(|p| p.alive()) {
                            "the daemon process is gone"
                        } else {
                            "its supervisor is gone"
                        }
                    )
                    .to_lowercase()
                })),
            ),
        };
        let probed = probed.and_then(Result::ok).and_then(Result::ok);
        let containers = shown(state.containers(&id).unwrap_or_default());
        let namespaces = ident
            .v3
            .then(|| namespace_views(&containers, probed.as_ref().and_then(|p| p.v3.as_ref())));
        daemons.push(DaemonView {
            devices: ident
                .devices
                .iter()
                .map(|u| describe(inventory.as_ref(), u))
                .collect(),
            uid: ident.uid,
            multi_user: ident.multi_user,
            tenant: ident.tenant.clone(),
            ipc: if ident.ipc_host { "host" } else { "isolated" },
            limits: LimitsView(ident.limits.clone()),
            status: ViewStatus::Record(rec.status),
            pid: rec.daemon.filter(|_| alive).map(|p| p.pid),
            supervisor_pid: rec.supervisor.map(|p| p.pid),
            uptime_seconds: rec
                .ready_at
                .filter(|_| alive)
                .map(|t| now.saturating_sub(t)),
            restarts: rec.restarts,
            health,
            health_reason,
            limits_unconfirmed_since: unconfirmed,
            servers: probed.as_ref().map(|p| p.servers),
            clients: probed.as_ref().map(|p| p.clients),
            error: rec.error.clone(),
            pipe_dir: state.pipe_dir(&id).display().to_string(),
            shm_dir: (!ident.ipc_host).then(|| state.shm_dir(&id).display().to_string()),
            log_dir: state.log_dir(&id).display().to_string(),
            containers,
            protocol: ident.v3.then_some("v3"),
            namespaces,
            id,
        });
    }
    let grace = cfg.mps.pending_grace().as_secs();
    for id in bare {
        daemons.push(directory_view(&state, id, grace));
    }
    daemons.sort_by(|a, b| a.id.cmp(&b.id));
    StatusView {
        schema: SCHEMA,
        state_dir: cfg.state_dir.display().to_string(),
        daemons,
        nri: NriView::read(&state),
        watch: WatchView::read(&state),
        capacity: capacity(cfg, &state),
    }
}

/// The node's daemon caps as the next create counts them (`mps::ensure::budget`).
pub(crate) fn capacity(cfg: &Config, state: &StateDir) -> Option<crate::state::Capacity> {
    state.capacity(&crate::mps::ensure::budget(cfg)).ok()
}

/// The view of a daemon directory without a (readable) record: its owner and mounts from
/// the directory itself, and whether a live container record still uses it. Read only:
/// stale records are not removed here.
fn directory_view(state: &StateDir, id: String, pending_grace: u64) -> DaemonView {
    use std::os::unix::fs::MetadataExt;
    let containers = state.containers(&id).unwrap_or_default();
    let pending = containers.iter().any(|c| c.live(pending_grace));
    let (status, reason) = if pending {
        (
            DirectoryState::Pending,
            "no daemon record yet: a create is making this daemon",
        )
    } else {
        (
            DirectoryState::Abandoned,
            "abandoned: no supervisor and no live container (a create that failed left it); its reaper, the next create that needs its place under a cap, or gpushare gc removes it",
        )
    };
    let shm = state.shm_mounted(&id);
    DaemonView {
        devices: Vec::new(),
        uid: std::fs::symlink_metadata(state.pipe_dir(&id)).map_or(0, |m| m.uid()),
        multi_user: false,
        tenant: None,
        ipc: if shm { "isolated" } else { "host" },
        limits: LimitsView::default(),
        status: ViewStatus::Directory(status),
        pid: None,
        supervisor_pid: None,
        uptime_seconds: None,
        restarts: 0,
        health: "down",
        health_reason: Some(reason.to_owned()),
        limits_unconfirmed_since: None,
        servers: None,
        clients: None,
        error: None,
        pipe_dir: state.pipe_dir(&id).display().to_string(),
        shm_dir: shm.then(|| state.shm_dir(&id).display().to_string()),
        log_dir: state.log_dir(&id).display().to_string(),
        containers: shown(containers),
        protocol: None,
        namespaces: None,
        id,
    }
}

/// Container records as `status` shows them: their Kubernetes names bounded and
/// escaped (`PodNames::escaped`), the one form every output starts from.
pub(super) fn shown(containers: Vec<ContainerRecord>) -> Vec<ContainerRecord> {
    containers
        .into_iter()
        .map(|c| ContainerRecord {
            names: c.names.escaped(),
            ..c
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A daemon's limits in `status`: every limit's JSON field, set or `null`, and the
    /// table's labels of those set; pinned (docs/state.md documents them).
    #[test]
    fn limits_show_as_documented() {
        let both = LimitsView(crate::identity::test_limits(Some(25), Some(2 << 30)));
        assert_eq!(
            serde_json::to_string(&both).unwrap(),
            r#"{"active_thread_percentage":25,"pinned_memory_limit_bytes":2147483648}"#
        );
        assert_eq!(
            both.labels().collect::<Vec<_>>(),
            ["threads=25%", "mem=2048M"]
        );
        let none = LimitsView::default();
        assert_eq!(
            serde_json::to_string(&none).unwrap(),
            r#"{"active_thread_percentage":null,"pinned_memory_limit_bytes":null}"#
        );
        assert_eq!(none.labels().count(), 0);
    }

    #[test]
    fn probe_all_asks_every_daemon_once_and_keeps_the_order() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        // A control client whose daemon `<n>` has servers 1..=n, each with clients 1..=n.
        let bin = dir.path().join("control");
        std::fs::write(
            &bin,
            "#!/bin/sh\nread cmd\nseq \"${CUDA_MPS_PIPE_DIRECTORY##*/}\"\n",
        )
        .unwrap();
        std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
        // More daemons than threads, some down (no control to ask).
        let controls: Vec<Option<Control>> = (0..2 * PROBE_THREADS + 3)
            .map(|n| {
                (n % 3 != 1).then(|| Control {
                    binary: bin.clone(),
                    pipe_dir: dir.path().join(n.to_string()),
                    user: None,
                    privileged: None,
                    v3: false,
                })
            })
            .collect();
        let answers = probe_all(&controls);
        assert_eq!(answers.len(), controls.len());
        for (n, answer) in answers.into_iter().enumerate() {
            match answer {
                None => assert_eq!(n % 3, 1, "daemon {n} was not asked"),
                Some(a) => assert_eq!(
                    a.map(|p| (p.servers, p.clients)),
                    Ok((n, n * n)),
                    "daemon {n}"
                ),
            }
        }
        assert!(probe_all(&[]).is_empty());
    }

    /// A v3 daemon's namespaces: each record's with the record's limits and its clients
    /// from the daemon's client list, one the record names but the daemon lacks marked
    /// so, and each the daemon lists (or has clients in) that no record names, its name
    /// escaped; before the daemon answers, the records' alone with no counts.
    #[test]
    fn namespaces_come_from_the_records_and_the_daemon_s_lists() {
        use crate::identity::{test_limits, Namespace};
        use crate::mps::v3::Listed;
        let rec = |id: &str, limits| ContainerRecord {
            mps_namespace: Some(Namespace::of_container(id, limits)),
            ..ContainerRecord::new(id.into(), None, None, None)
        };
        let records = vec![
            rec("one", test_limits(Some(25), Some(2 << 30))),
            rec("gone", test_limits(Some(50), None)),
        ];
        let one = Namespace::name_for("one");
        let reply = format!(
            "101,s,0,{one},app\n102,s,0,{one},app\n103,s,0,stray\u{1b}[2J,app\n104,s,0,default,app\n"
        );
        let clients = client_rows(&reply);
        assert_eq!(clients.get("stray\\u{1b}[2J"), Some(&1), "{clients:?}");
        let listed = |name: &str, pct| Listed {
            name: name.into(),
            pinned_memory_limit: None,
            active_thread_percentage: Some(pct),
        };
        let answer = V3Answer {
            clients,
            listed: Some(vec![
                listed(&one, 25.0),
                listed("default", 10.0),
                listed("orphan", 100.0),
            ]),
        };
        let views = namespace_views(&records, Some(&answer));
        let got: Vec<_> = views
            .iter()
            .map(|v| {
                (
                    v.name.as_str(),
                    v.kind,
                    v.container_id.as_deref(),
                    v.clients,
                    v.listed,
                )
            })
            .collect();
        let gone = Namespace::name_for("gone");
        assert_eq!(
            got,
            [
                (one.as_str(), "container", Some("one"), Some(2), Some(true)),
                (
                    gone.as_str(),
                    "container",
                    Some("gone"),
                    Some(0),
                    Some(false)
                ),
                ("default", "default", None, Some(1), Some(true)),
                ("orphan", "unrecorded", None, Some(0), Some(true)),
                ("stray\\u{1b}[2J", "unrecorded", None, Some(1), Some(false)),
            ]
        );
        assert_eq!(
            serde_json::to_value(&views[0]).unwrap(),
            serde_json::json!({"name": one, "kind": "container", "container_id": "one",
                "active_thread_percentage": 25, "pinned_memory_limit_bytes": 2147483648u64,
                "clients": 2, "listed": true})
        );
        assert_eq!(
            views[2]
                .limits
                .0
                .get(&crate::request::ACTIVE_THREAD_PERCENTAGE),
            Some(10)
        );
        let unasked = namespace_views(&records, None);
        assert_eq!(unasked.len(), 2);
        assert!(unasked
            .iter()
            .all(|v| v.clients.is_none() && v.listed.is_none()));
    }
}
