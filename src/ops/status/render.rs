//! The status for people and for Prometheus: `table` (one line per daemon, one per
//! container under it) and `prometheus` (the text exposition format, for node-exporter's
//! textfile collector). JSON is the view itself, serialized (`collect`).
//!
//! Invariants: pure functions of the view; every value a tenant or an engine named (a
//! container's id, its Kubernetes names, a device's UUID) is printed escaped, so no
//! control character reaches a terminal and no label value ends its label early; metric
//! names and types stay as they are (dashboards and alerts use them).

use std::collections::HashMap;
use std::fmt::Write as _;

use super::collect::{
    DaemonView, DirectoryState, NamespaceView, StatusView, ViewStatus, WatchView,
};
use crate::state::{CapUse, Capacity};
use crate::watch::report::{Kind, Process};

/// The first 12 characters of a 64-hex-digit engine id (as `docker ps` and `crictl ps`
/// show them); any other id in full.
fn short_container_id(id: &str) -> &str {
    if id.len() == 64 && id.bytes().all(|b| b.is_ascii_hexdigit()) {
        &id[..12]
    } else {
        id
    }
}

/// One GPU process, for the table: `pid <pid>  <kind>  GPU <index>  <used>  [verdict]`.
fn process_line(out: &mut String, indent: &str, p: &Process) {
    let _ = write!(
        out,
        "{indent}gpu pid {}  {}  GPU {} {}  {}",
        p.pid,
        p.kind.word(),
        p.gpu_index,
        p.gpu,
        p.used_memory_bytes
            .map_or_else(|| "-".to_owned(), |b| format!("{}MiB", b >> 20))
    );
    if let Some(v) = &p.verdict {
        let _ = write!(out, "  [{v}]");
    }
    out.push('\n');
}

/// The watcher's state in one line, and the processes of no served container.
fn watch_lines(out: &mut String, w: &WatchView, now: u64) {
    let _ = write!(
        out,
        "GPU process watcher: {}, policy {}{}, last scan {} ago, {} GPU process(es); stopped {} outside MPS, ended {} MPS client(s)",
        if w.fresh { "running" } else { "NOT RUNNING or stale" },
        match w.policy {
            crate::config::WatchPolicy::Report => "report",
            crate::config::WatchPolicy::Act => "act",
        },
        if w.enforced { "" } else { " (limits advisory: report only)" },
        human_duration(now.saturating_sub(w.scanned_at)),
        w.processes.len(),
        w.actions.stopped_direct,
        w.actions.ended_clients,
    );
    out.push('\n');
    if let Some(e) = &w.error {
        let _ = writeln!(out, "  └ {e}");
    }
    for u in &w.unlisted {
        let _ = writeln!(
            out,
            "  └ GPU {} {}: not listed in the last scan, none of its processes judged ({} failed listings of a GPU since the watcher started): {}",
            u.gpu_index,
            u.gpu.as_deref().unwrap_or("(no UUID)"),
            w.gpu_list_failures,
            u.error
        );
    }
    let unserved: Vec<&Process> = w
        .processes
        .iter()
        .filter(|p| p.container_id.is_none() && p.daemon.is_none())
        .collect();
    if !unserved.is_empty() {
        let _ = writeln!(
            out,
            "GPU processes of no container gpushare serves (the host's, other containers'):"
        );
        for p in unserved {
            process_line(out, "  └ ", p);
        }
    }
}

fn human_duration(secs: u64) -> String {
    match secs {
        s if s < 120 => format!("{s}s"),
        s if s < 7200 => format!("{}m", s / 60),
        s if s < 172_800 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86_400),
    }
}

pub(crate) fn table(view: &StatusView) -> String {
    let mut out = String::new();
    // The watcher's processes by container and by daemon (servers), looked up per line:
    // a node of a thousand containers and as many processes stays linear.
    let mut by_container: HashMap<&str, Vec<&Process>> = HashMap::new();
    let mut servers: HashMap<&str, Vec<&Process>> = HashMap::new();
    for p in view.watch.iter().flat_map(|w| &w.processes) {
        match (&p.container_id, &p.daemon) {
            (Some(c), _) => by_container.entry(c.as_str()).or_default().push(p),
            (None, Some(d)) => servers.entry(d.as_str()).or_default().push(p),
            (None, None) => {}
        }
    }
    let _ = writeln!(
        out,
        "{:<32}  {:<22}  {:<6}  {:<22}  {:>7}  {:>6}  {:>8}  {:<12}  {:>7}  {:>7}",
        "DAEMON",
        "DEVICE",
        "UID",
        "LIMITS",
        "PID",
        "UPTIME",
        "RESTARTS",
        "HEALTH",
        "SERVERS",
        "CLIENTS"
    );
    for d in &view.daemons {
        let device = d
            .devices
            .iter()
            .map(|v| match (&v.name, &v.mig_profile) {
                (Some(n), Some(p)) => format!("{n} {p}"),
                (Some(n), None) => n.clone(),
                _ => v.uuid.chars().take(12).collect(),
            })
            .collect::<Vec<_>>()
            .join(",");
        let uid = d.uid_label();
        let mut limits: Vec<String> = d.limits.labels().collect();
        if d.ipc == "host" {
            limits.push("ipc=host".into());
        }
        if let Some(protocol) = d.protocol {
            limits.push(format!("mps={protocol}"));
        }
        match &d.tenant {
            Some(crate::identity::Tenant::Namespace(ns)) => {
                limits.push(format!("ns={}", crate::util::escape(ns)))
            }
            Some(crate::identity::Tenant::NoNamespace) => limits.push("ns=(none)".into()),
            None => {}
        }
        let dash = || "-".to_owned();
        let _ = writeln!(
            out,
            "{:<32}  {:<22}  {:<6}  {:<22}  {:>7}  {:>6}  {:>8}  {:<12}  {:>7}  {:>7}",
            d.id,
            device,
            uid,
            if limits.is_empty() {
                dash()
            } else {
                limits.join(",")
            },
            d.pid.map_or_else(dash, |p| p.to_string()),
            d.uptime_seconds.map_or_else(dash, human_duration),
            d.restarts,
            d.health,
            d.servers.map_or_else(dash, |n| n.to_string()),
            d.clients.map_or_else(dash, |n| n.to_string()),
        );
        if let Some(why) = &d.health_reason {
            let _ = writeln!(out, "  └ {}: {why}", d.health);
        }
        for p in servers.get(d.id.as_str()).into_iter().flatten() {
            process_line(&mut out, "  └ ", p);
        }
        for c in &d.containers {
            // Engines' ids are 64 hex digits; 12 identify a container as `docker ps` shows.
            let _ = write!(
                out,
                "  └ container {}  engine={}  pid={}",
                short_container_id(&c.id),
                c.engine.as_deref().unwrap_or("-"),
                c.pid.map_or_else(dash, |p| p.to_string())
            );
            // Kubernetes' names (already escaped), where the engine gave them.
            let n = &c.names;
            if n.namespace.is_some() || n.pod.is_some() {
                let _ = write!(
                    out,
                    "  pod={}/{}",
                    n.namespace.as_deref().unwrap_or("-"),
                    n.pod.as_deref().unwrap_or("-")
                );
            }
            if let Some(name) = &n.container {
                let _ = write!(out, "  container={name}");
            }
            let ns = d
                .namespaces
                .iter()
                .flatten()
                .find(|ns| ns.container_id.as_deref() == Some(c.id.as_str()));
            if let Some(ns) = ns {
                let _ = write!(out, "  {}", namespace_text(ns));
            }
            out.push('\n');
            for p in by_container.get(c.id.as_str()).into_iter().flatten() {
                process_line(&mut out, "      ", p);
            }
        }
        for ns in d
            .namespaces
            .iter()
            .flatten()
            .filter(|n| n.container_id.is_none())
        {
            let what = match ns.kind {
                "default" => "the server's own",
                _ => "no container record names it",
            };
            let _ = writeln!(out, "  └ {}  ({what})", namespace_text(ns));
        }
    }
    if view.daemons.is_empty() {
        let _ = writeln!(out, "(no MPS daemons under {})", view.state_dir);
    }
    if let Some(nri) = &view.nri {
        let _ = writeln!(out, "{}", nri.line());
    }
    if let Some(w) = &view.watch {
        watch_lines(&mut out, w, crate::util::unix_now());
    }
    if let Some(capacity) = &view.capacity {
        capacity_table(&mut out, capacity);
    }
    out
}

/// A v3 namespace as the table shows it: `ns=<name>`, its limits, its clients, and
/// `missing` where the daemon's list lacks it.
fn namespace_text(ns: &NamespaceView) -> String {
    let mut words = vec![format!("ns={}", ns.name)];
    words.extend(ns.limits.labels());
    words.push(format!(
        "clients={}",
        ns.clients.map_or_else(|| "-".to_owned(), |n| n.to_string())
    ));
    if ns.listed == Some(false) {
        words.push("missing".to_owned());
    }
    words.join("  ")
}

/// `24 GiB` for a whole number of GiB, else whole MiB.
fn human_bytes(bytes: u64) -> String {
    const GIB: u64 = 1 << 30;
    if bytes % GIB == 0 {
        format!("{} GiB", bytes / GIB)
    } else {
        format!("{} MiB", bytes >> 20)
    }
}

/// One cap's figure in its unit.
fn cap_amount(c: &CapUse, n: u64) -> String {
    if c.unit == "bytes" {
        human_bytes(n)
    } else {
        n.to_string()
    }
}

/// A daemon count, `unbounded` for none.
fn daemons(n: u64) -> String {
    if n == u64::MAX {
        "unbounded".to_owned()
    } else {
        n.to_string()
    }
}

/// The line `doctor` and `status` give the node's capacity.
pub(crate) fn capacity_line(c: &Capacity) -> String {
    format!(
        "room for {} MPS daemons on this node ({} now; bound by {}), {} per UID (bound by {})",
        daemons(c.effective_daemons),
        c.daemons,
        c.binding,
        daemons(c.effective_daemons_per_uid),
        c.binding_per_uid
    )
}

/// Each cap as `key = limit (used)`, for `doctor`.
pub(crate) fn caps_summary(c: &Capacity) -> String {
    c.caps
        .iter()
        .map(|cap| {
            let whose = match cap.uid {
                Some(uid) => format!(" by uid {uid}"),
                None => String::new(),
            };
            format!(
                "{} = {} ({} used{whose})",
                cap.key,
                cap_amount(cap, cap.limit),
                cap_amount(cap, cap.used)
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// The caps below the daemons: each cap, its use, how many daemons it admits.
fn capacity_table(out: &mut String, c: &Capacity) {
    let _ = writeln!(out, "\n{}", capacity_line(c));
    let _ = writeln!(
        out,
        "{:<24}  {:>10}  {:>10}  {:>8}  {:<10}",
        "CAP", "LIMIT", "USED", "DAEMONS", "SCOPE"
    );
    for cap in &c.caps {
        let binding = cap.key == c.binding || (cap.per_uid && cap.key == c.binding_per_uid);
        let _ = writeln!(
            out,
            "{:<24}  {:>10}  {:>10}  {:>8}  {:<10}{}",
            cap.key,
            cap_amount(cap, cap.limit),
            cap_amount(cap, cap.used),
            daemons(cap.capacity_daemons),
            match (cap.per_uid, cap.uid) {
                (false, _) => "node".to_owned(),
                (true, Some(uid)) => format!("uid {uid}"),
                (true, None) => "per uid".to_owned(),
            },
            if binding { "  binding" } else { "" }
        );
    }
}

/// Writes one metric: its name, type, help and rows of (labels, value).
type Metric<'a> = dyn FnMut(&str, &str, &str, Vec<(String, String)>) + 'a;

/// The caps as metrics: each one's limit, use and capacity in daemons, and the node's
/// effective capacity with the cap that binds.
fn capacity_metrics(metric: &mut Metric, c: &Capacity) {
    let cap = |c: &CapUse| format!("{{cap=\"{}\",unit=\"{}\"}}", c.key, c.unit);
    metric(
        "gpushare_cap_limit",
        "gauge",
        "A daemon cap of the config (mps.max-daemons, …), in its unit (daemons or bytes of shm tmpfs).",
        c.caps.iter().map(|c| (cap(c), c.limit.to_string())).collect(),
    );
    metric(
        "gpushare_cap_used",
        "gauge",
        "What the cap counts now (for a per-UID cap, the busiest UID's), in its unit.",
        c.caps
            .iter()
            .map(|c| (cap(c), c.used.to_string()))
            .collect(),
    );
    metric(
        "gpushare_cap_capacity_daemons",
        "gauge",
        "How many MPS daemons (each with an shm tmpfs of mps.shm-size) the cap admits.",
        c.caps
            .iter()
            .filter(|c| c.capacity_daemons != u64::MAX)
            .map(|c| (cap(c), c.capacity_daemons.to_string()))
            .collect(),
    );
    metric(
        "gpushare_capacity_daemons",
        "gauge",
        "How many MPS daemons the node admits: the least capacity of its node-wide caps, labelled with that cap.",
        vec![(
            format!("{{binding=\"{}\"}}", c.binding),
            daemons(c.effective_daemons).replace("unbounded", "+Inf"),
        )],
    );
}

/// A label value: [`crate::util::escape`]d (no control character is left, a newline
/// included), then escaped as the exposition format wants (`label_escaped`).
fn label(v: &str) -> String {
    label_escaped(&crate::util::escape(v))
}

/// A label value already [`crate::util::escape`]d (a container's names in the view),
/// escaped as the exposition format wants: `\\` and `\"` (no newline is left).
fn label_escaped(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"")
}

/// Prometheus text exposition format (node-exporter textfile collector).
pub(crate) fn prometheus(view: &StatusView) -> String {
    let mut out = String::new();
    let mut metric = |name: &str, kind: &str, help: &str, rows: Vec<(String, String)>| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (labels, value) in rows {
            let _ = writeln!(out, "{name}{labels} {value}");
        }
    };
    let labels = |d: &DaemonView| {
        let device = d
            .devices
            .iter()
            .map(|v| v.uuid.as_str())
            .collect::<Vec<_>>()
            .join(",");
        let uid = d.uid_label();
        format!(
            "{{daemon=\"{}\",device=\"{}\",uid=\"{}\"}}",
            label(&d.id),
            label(&device),
            label(&uid)
        )
    };
    metric(
        "gpushare_daemons",
        "gauge",
        "MPS control daemons managed by gpushare on this node.",
        vec![(String::new(), view.daemons.len().to_string())],
    );
    metric(
        "gpushare_daemon_directories_abandoned",
        "gauge",
        "Daemon directories a failed create left (no supervisor, no live container), not yet removed.",
        vec![(
            String::new(),
            view.daemons
                .iter()
                .filter(|d| d.status == ViewStatus::Directory(DirectoryState::Abandoned))
                .count()
                .to_string(),
        )],
    );
    metric(
        "gpushare_daemon_up",
        "gauge",
        "1 when the daemon's processes run and its control interface answers.",
        view.daemons
            .iter()
            .map(|d| {
                let up = matches!(d.health, "ok" | "unconfirmed");
                (labels(d), u8::from(up).to_string())
            })
            .collect(),
    );
    metric(
        "gpushare_daemon_limits_unconfirmed",
        "gauge",
        "1 while the supervisor's limit checks cannot confirm a multi-user daemon's limits (it is not restarted for it).",
        view.daemons
            .iter()
            .map(|d| {
                let unconfirmed = d.limits_unconfirmed_since.is_some();
                (labels(d), u8::from(unconfirmed).to_string())
            })
            .collect(),
    );
    metric(
        "gpushare_daemon_restarts_total",
        "counter",
        "Restarts of the daemon by its supervisor.",
        view.daemons
            .iter()
            .map(|d| (labels(d), d.restarts.to_string()))
            .collect(),
    );
    metric(
        "gpushare_containers",
        "gauge",
        "Containers recorded as using the daemon.",
        view.daemons
            .iter()
            .map(|d| (labels(d), d.containers.len().to_string()))
            .collect(),
    );
    // One row per container, named as DCGM exporter names a pod's GPU metrics
    // (`namespace`, `pod`, `container`), so that the two join; empty outside Kubernetes.
    metric(
        "gpushare_container_info",
        "gauge",
        "A container using the daemon: its id and, in Kubernetes, its namespace, pod and container.",
        view.daemons
            .iter()
            .flat_map(|d| {
                let daemon = labels(d);
                d.containers.iter().map(move |c| {
                    let name = |n: &Option<String>| label_escaped(n.as_deref().unwrap_or(""));
                    let labels = format!(
                        "{},container_id=\"{}\",namespace=\"{}\",pod=\"{}\",container=\"{}\"}}",
                        daemon.trim_end_matches('}'),
                        label(&c.id),
                        name(&c.names.namespace),
                        name(&c.names.pod),
                        name(&c.names.container)
                    );
                    (labels, "1".to_owned())
                })
            })
            .collect(),
    );
    if view.daemons.iter().any(|d| d.namespaces.is_some()) {
        namespace_metrics(&mut metric, view, &labels);
    }
    if let Some(w) = &view.watch {
        watch_metrics(&mut metric, w);
    }
    if let Some(capacity) = &view.capacity {
        capacity_metrics(&mut metric, capacity);
    }
    if let Some(nri) = &view.nri {
        metric(
            "gpushare_nri_unserved_containers",
            "gauge",
            "Containers with a request that the NRI plugin's audits (at each connection, each container's creation and start, and every [nri] audit-interval) found running without its adjustment.",
            vec![(String::new(), nri.unserved.len().to_string())],
        );
        metric(
            "gpushare_nri_evicted_containers_total",
            "counter",
            "Unserved containers with a request that the NRI plugin ended ([nri] unserved = \"evict\") since it started.",
            vec![(String::new(), nri.evicted.to_string())],
        );
    }
    out
}

/// The namespaces of the v3 daemons, only where there is one (a legacy node's text does
/// not change): one row per namespace, labelled with its daemon's labels, `mps_namespace`
/// (its name) and `container_id` (the container whose record names it, as in
/// `gpushare_container_info`, so the two join; empty for the server's `default` and a
/// namespace no record names), and `kind` on the info row.
fn namespace_metrics(
    metric: &mut impl FnMut(&str, &str, &str, Vec<(String, String)>),
    view: &StatusView,
    daemon_labels: &impl Fn(&DaemonView) -> String,
) {
    let rows = || {
        view.daemons.iter().flat_map(|d| {
            let daemon = daemon_labels(d);
            d.namespaces.iter().flatten().map(move |ns| {
                let labels = format!(
                    "{},mps_namespace=\"{}\",container_id=\"{}\"",
                    daemon.trim_end_matches('}'),
                    label_escaped(&ns.name),
                    label(ns.container_id.as_deref().unwrap_or(""))
                );
                (labels, ns)
            })
        })
    };
    metric(
        "gpushare_namespace_info",
        "gauge",
        "An MPS namespace of a v3 daemon: kind container (a container record names it), default (the server's own) or unrecorded (listed by the daemon, named by no record).",
        rows()
            .map(|(l, ns)| (format!("{l},kind=\"{}\"}}", ns.kind), "1".to_owned()))
            .collect(),
    );
    metric(
        "gpushare_namespace_clients",
        "gauge",
        "Clients of the MPS namespace in its daemon's client list (no row when the daemon did not answer).",
        rows()
            .filter_map(|(l, ns)| Some((format!("{l}}}"), ns.clients?.to_string())))
            .collect(),
    );
    for (key, limit, _) in crate::request::limits() {
        metric(
            &format!("gpushare_namespace_{}", limit.status_field),
            "gauge",
            &format!(
                "The MPS namespace's {} (the container record's; as the daemon lists it for the others); no row when unset.",
                limit.status_field.replace('_', " ")
            ),
            rows()
                .filter_map(|(l, ns)| Some((format!("{l}}}"), ns.limits.0.get(key)?.to_string())))
                .collect(),
        );
    }
}

/// The GPU processes, summed per container and GPU with DCGM exporter's labels (`gpu`,
/// `UUID`, `namespace`, `pod`, `container`) so that the series join DCGM's; the host's
/// and other containers' processes per GPU; the GPUs the last scan could not list; the
/// watcher's health and actions. The series of the last scan's processes and GPUs are
/// exported only while the watcher is up (`fresh`): a stopped or stalled watcher's last
/// scan is not the present, and its series end rather than stay flat.
fn watch_metrics(metric: &mut impl FnMut(&str, &str, &str, Vec<(String, String)>), w: &WatchView) {
    use std::collections::BTreeMap;
    let processes: &[Process] = if w.fresh { &w.processes } else { &[] };
    let unlisted: &[crate::watch::report::Unlisted] = if w.fresh { &w.unlisted } else { &[] };
    let gpu = |p: &Process| format!("gpu=\"{}\",UUID=\"{}\"", p.gpu_index, label_escaped(&p.gpu));
    let mut memory: BTreeMap<String, u64> = BTreeMap::new();
    let mut count: BTreeMap<String, u64> = BTreeMap::new();
    let mut unserved: BTreeMap<String, u64> = BTreeMap::new();
    let mut unserved_count: BTreeMap<String, u64> = BTreeMap::new();
    let mut servers: BTreeMap<String, u64> = BTreeMap::new();
    for p in processes {
        let used = p.used_memory_bytes.unwrap_or(0);
        let name = |n: &Option<String>| label_escaped(n.as_deref().unwrap_or(""));
        match (&p.container_id, &p.daemon) {
            (Some(c), daemon) => {
                let key = format!(
                    "{},namespace=\"{}\",pod=\"{}\",container=\"{}\",container_id=\"{}\",daemon=\"{}\"",
                    gpu(p),
                    name(&p.names.namespace),
                    name(&p.names.pod),
                    name(&p.names.container),
                    label_escaped(c),
                    label_escaped(daemon.as_deref().unwrap_or(""))
                );
                *memory.entry(format!("{{{key}}}")).or_default() += used;
                *count
                    .entry(format!("{{{key},kind=\"{}\"}}", p.kind.word()))
                    .or_default() += 1;
            }
            (None, Some(d)) if p.kind == Kind::MpsServer => {
                *servers
                    .entry(format!("{{{},daemon=\"{}\"}}", gpu(p), label_escaped(d)))
                    .or_default() += used;
            }
            _ => {
                *unserved.entry(format!("{{{}}}", gpu(p))).or_default() += used;
                *unserved_count
                    .entry(format!("{{{},kind=\"{}\"}}", gpu(p), p.kind.word()))
                    .or_default() += 1;
            }
        }
    }
    let rows = |m: BTreeMap<String, u64>| m.into_iter().map(|(l, v)| (l, v.to_string())).collect();
    metric(
        "gpushare_container_gpu_memory_used_bytes",
        "gauge",
        "GPU memory the processes of a served container use on one GPU (NVML, at the watcher's last scan).",
        rows(memory),
    );
    metric(
        "gpushare_container_gpu_processes",
        "gauge",
        "Processes of a served container with a context on one GPU, by kind (mps-client, direct).",
        rows(count),
    );
    metric(
        "gpushare_mps_server_gpu_memory_used_bytes",
        "gauge",
        "GPU memory the MPS servers of a daemon use on one GPU.",
        rows(servers),
    );
    metric(
        "gpushare_unserved_gpu_memory_used_bytes",
        "gauge",
        "GPU memory used by processes of no container gpushare serves (the host's, other containers').",
        rows(unserved),
    );
    metric(
        "gpushare_unserved_gpu_processes",
        "gauge",
        "Processes of no container gpushare serves with a context on one GPU, by kind.",
        rows(unserved_count),
    );
    metric(
        "gpushare_watch_gpu_unlisted",
        "gauge",
        "1 for a GPU whose processes the watcher's last scan could not list (none of them judged in it).",
        unlisted
            .iter()
            .map(|u| {
                (
                    format!(
                        "{{gpu=\"{}\",UUID=\"{}\"}}",
                        u.gpu_index,
                        label_escaped(u.gpu.as_deref().unwrap_or(""))
                    ),
                    "1".to_owned(),
                )
            })
            .collect(),
    );
    metric(
        "gpushare_watch_gpu_list_failures_total",
        "counter",
        "Scans that could not list one GPU's processes, per GPU and scan, since the watcher started.",
        vec![(String::new(), w.gpu_list_failures.to_string())],
    );
    metric(
        "gpushare_watch_up",
        "gauge",
        "1 when the GPU process watcher runs and its last scan is recent; 0: the per-process and per-GPU series of its last scan are not exported.",
        vec![(String::new(), u8::from(w.fresh).to_string())],
    );
    metric(
        "gpushare_watch_last_scan_timestamp_seconds",
        "gauge",
        "When the watcher's last scan ended (Unix time).",
        vec![(String::new(), w.scanned_at.to_string())],
    );
    metric(
        "gpushare_watch_scan_duration_seconds",
        "gauge",
        "How long the watcher's last scan took.",
        vec![(String::new(), format!("{:.6}", w.scan_seconds))],
    );
    let a = &w.actions;
    metric(
        "gpushare_watch_actions_total",
        "counter",
        "What the watcher did: stop-direct (killed a served container's process outside MPS), end-client (terminate_client then kill of an MPS client above its container's limit), unconfirmed-termination (of those, killed without a confirmed terminate_client), failed.",
        [
            ("stop-direct", a.stopped_direct),
            ("end-client", a.ended_clients),
            ("unconfirmed-termination", a.unconfirmed_terminations),
            ("failed", a.failed),
        ]
        .into_iter()
        .map(|(action, n)| (format!("{{action=\"{action}\"}}"), n.to_string()))
        .collect(),
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::status::collect::{shown, DeviceView, SCHEMA};
    use crate::state::{ContainerRecord, DaemonStatus};

    #[test]
    fn engine_ids_are_shortened_like_docker_ps_and_others_kept() {
        let long = "28d3f31c1da9e220f4ff0d667ffe0881aaac3c6b708dae20229b81e67002ffee";
        assert_eq!(short_container_id(long), "28d3f31c1da9");
        assert_eq!(short_container_id("st-a"), "st-a");
        assert_eq!(short_container_id(&"z".repeat(64)), "z".repeat(64));
    }

    /// docs/state.md's example of `--format prometheus` declares the metrics the
    /// renderer prints, in its order (its `# HELP` and `# TYPE` lines are the renderer's).
    #[test]
    fn the_prometheus_example_in_docs_state_md_declares_every_metric() {
        let view = StatusView {
            schema: SCHEMA,
            state_dir: "/run/gpushare".into(),
            nri: None,
            daemons: Vec::new(),
            watch: None,
            capacity: Some(Capacity {
                daemons: 0,
                effective_daemons: 5,
                binding: "mps.shm-size-total",
                effective_daemons_per_uid: 5,
                binding_per_uid: "mps.shm-size-total",
                caps: vec![CapUse {
                    key: "mps.max-daemons",
                    per_uid: false,
                    unit: "daemons",
                    limit: 64,
                    used: 0,
                    uid: None,
                    capacity_daemons: 64,
                }],
            }),
        };
        let declared = |text: &str| -> Vec<String> {
            text.lines()
                .filter(|l| l.starts_with("# HELP ") || l.starts_with("# TYPE "))
                .map(str::to_owned)
                .collect()
        };
        let doc = std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/state.md"),
        )
        .unwrap();
        assert_eq!(declared(&doc), declared(&prometheus(&view)));
    }

    #[test]
    fn prometheus_escapes_labels_and_declares_types() {
        let view = StatusView {
            schema: SCHEMA,
            state_dir: "/run/gpushare".into(),
            nri: None,
            watch: None,
            capacity: Some(Capacity {
                daemons: 1,
                effective_daemons: 5,
                binding: "mps.shm-size-total",
                effective_daemons_per_uid: 5,
                binding_per_uid: "mps.shm-size-total",
                caps: vec![
                    CapUse {
                        key: "mps.max-daemons",
                        per_uid: false,
                        unit: "daemons",
                        limit: 64,
                        used: 1,
                        uid: None,
                        capacity_daemons: 64,
                    },
                    CapUse {
                        key: "mps.shm-size-total",
                        per_uid: false,
                        unit: "bytes",
                        limit: 6026 << 20,
                        used: 1 << 30,
                        uid: None,
                        capacity_daemons: 5,
                    },
                ],
            }),
            daemons: vec![DaemonView {
                id: "0123456789abcdef0123456789abcdef".into(),
                devices: vec![DeviceView {
                    uuid: "GPU-a\"b".into(),
                    name: None,
                    model: None,
                    mig_profile: None,
                }],
                uid: 1000,
                multi_user: false,
                tenant: None,
                ipc: "isolated",
                limits: Default::default(),
                status: ViewStatus::Record(DaemonStatus::Ready),
                pid: Some(5),
                supervisor_pid: Some(4),
                uptime_seconds: Some(3),
                restarts: 2,
                health: "ok",
                health_reason: None,
                limits_unconfirmed_since: None,
                servers: Some(1),
                clients: Some(1),
                error: None,
                pipe_dir: String::new(),
                shm_dir: None,
                log_dir: String::new(),
                containers: shown(vec![ContainerRecord {
                    names: crate::state::PodNames {
                        namespace: Some("team-a".into()),
                        pod: Some("evil\n\"} 1\ngpushare_daemons 99\u{1b}[2J".into()),
                        container: None,
                    },
                    ..ContainerRecord::new("c1".into(), None, None, Some("kubernetes".into()))
                }]),
                protocol: None,
                namespaces: None,
            }],
        };
        let text = prometheus(&view);
        assert!(
            !text.contains("gpushare_namespace"),
            "a legacy node's text is as it was"
        );
        // The pod's name stays inside its label: escaped, then quoted for the format.
        assert!(
            text.contains(
                "gpushare_container_info{daemon=\"0123456789abcdef0123456789abcdef\",device=\"GPU-a\\\"b\",uid=\"1000\",container_id=\"c1\",namespace=\"team-a\",pod=\"evil\\\\n\\\"} 1\\\\ngpushare_daemons 99\\\\u{1b}[2J\",container=\"\"} 1\n"
            ),
            "{text}"
        );
        assert!(
            !text.lines().any(|l| l.starts_with("gpushare_daemons 99")),
            "{text}"
        );
        assert!(!text.contains('\u{1b}'));
        let table = table(&view);
        assert!(
            table.contains(
                "  └ container c1  engine=kubernetes  pid=-  pod=team-a/evil\\n\"} 1\\ngpushare_daemons 99\\u{1b}[2J\n"
            ),
            "{table}"
        );
        assert!(text.contains("# TYPE gpushare_daemon_restarts_total counter"));
        // Every cap, its use, and the node's capacity with the cap that binds.
        for line in [
            "gpushare_cap_limit{cap=\"mps.shm-size-total\",unit=\"bytes\"} 6318718976\n",
            "gpushare_cap_used{cap=\"mps.max-daemons\",unit=\"daemons\"} 1\n",
            "gpushare_cap_capacity_daemons{cap=\"mps.shm-size-total\",unit=\"bytes\"} 5\n",
            "gpushare_capacity_daemons{binding=\"mps.shm-size-total\"} 5\n",
        ] {
            assert!(text.contains(line), "{line}: {text}");
        }
        assert!(
            table.contains("room for 5 MPS daemons on this node (1 now; bound by mps.shm-size-total), 5 per UID")
                && table.contains("mps.shm-size-total          6026 MiB       1 GiB         5  node        binding\n"),
            "{table}"
        );
        assert!(
            text.contains(
                "gpushare_daemon_up{daemon=\"0123456789abcdef0123456789abcdef\",device=\"GPU-a\\\"b\",uid=\"1000\"} 1"
            ),
            "{text}"
        );
        assert!(text.contains("gpushare_daemons 1\n"));
        assert!(text.contains("gpushare_daemon_directories_abandoned 0\n"));
        assert_eq!(
            serde_json::to_value(ViewStatus::Directory(DirectoryState::Abandoned)).unwrap(),
            "abandoned"
        );
        assert_eq!(
            serde_json::to_value(ViewStatus::Record(DaemonStatus::Ready)).unwrap(),
            "ready"
        );
        assert_eq!(human_duration(59), "59s");
        // The watcher's processes: the same escaping, per container with DCGM's labels.
        let hostile = "evil\n\"} 1\ngpushare_daemons 99\u{1b}[2J";
        let mut view = view;
        view.watch = Some(WatchView {
            fresh: true,
            policy: crate::config::WatchPolicy::Act,
            enforced: true,
            scanned_at: 0,
            interval_seconds: 5.0,
            scan_seconds: 0.01,
            error: None,
            unlisted: vec![crate::watch::report::Unlisted {
                gpu_index: 1,
                gpu: Some("GPU-2".into()),
                error: "cannot list the processes of GPU 1 through NVML (compute processes)".into(),
            }],
            gpu_list_failures: 7,
            processes: vec![
                Process {
                    pid: 42,
                    kind: Kind::MpsClient,
                    gpu: "GPU-1".into(),
                    gpu_index: 0,
                    used_memory_bytes: Some(1 << 30),
                    container_id: Some("c1".into()),
                    daemon: Some("0123456789abcdef0123456789abcdef".into()),
                    names: crate::state::PodNames {
                        namespace: Some("team-a".into()),
                        pod: Some(hostile.into()),
                        container: Some("main".into()),
                    }
                    .escaped(),
                    verdict: None,
                },
                Process {
                    pid: 43,
                    kind: Kind::Direct,
                    gpu: "GPU-1".into(),
                    gpu_index: 0,
                    used_memory_bytes: Some(2 << 30),
                    container_id: None,
                    daemon: None,
                    names: Default::default(),
                    verdict: None,
                },
            ],
            actions: crate::watch::report::Counters {
                stopped_direct: 3,
                ..Default::default()
            },
        });
        let text = prometheus(&view);
        assert!(
            text.contains("gpushare_container_gpu_memory_used_bytes{gpu=\"0\",UUID=\"GPU-1\",namespace=\"team-a\",pod=\"evil\\\\n\\\"} 1\\\\ngpushare_daemons 99\\\\u{1b}[2J\",container=\"main\",container_id=\"c1\",daemon=\"0123456789abcdef0123456789abcdef\"} 1073741824\n"),
            "{text}"
        );
        assert!(
            text.contains(
                "gpushare_unserved_gpu_memory_used_bytes{gpu=\"0\",UUID=\"GPU-1\"} 2147483648\n"
            ),
            "{text}"
        );
        assert!(
            text.contains("gpushare_watch_actions_total{action=\"stop-direct\"} 3\n"),
            "{text}"
        );
        assert!(
            !text.lines().any(|l| l.starts_with("gpushare_daemons 99")),
            "{text}"
        );
        let table = super::table(&view);
        assert!(
            table.contains("      gpu pid 42  mps-client  GPU 0 GPU-1  1024MiB\n"),
            "{table}"
        );
        assert!(
            table.contains("  └ gpu pid 43  direct  GPU 0 GPU-1  2048MiB\n"),
            "{table}"
        );
        assert!(!table.contains('\u{1b}'));
        assert_eq!(human_duration(7300), "2h");
        // A GPU the last scan could not list: shown, counted, its gauge set.
        assert!(
            table.contains("  └ GPU 1 GPU-2: not listed in the last scan, none of its processes judged (7 failed listings of a GPU since the watcher started): cannot list"),
            "{table}"
        );
        for series in [
            "gpushare_watch_gpu_unlisted{gpu=\"1\",UUID=\"GPU-2\"} 1\n",
            "gpushare_watch_gpu_list_failures_total 7\n",
            "gpushare_watch_up 1\n",
        ] {
            assert!(text.contains(series), "{series} in {text}");
        }
        // A stopped watcher: its last scan's processes and GPUs are no longer exported; its
        // health says so, its counters and the time of its last scan stay.
        let mut stale = view;
        if let Some(w) = &mut stale.watch {
            w.fresh = false;
        }
        let text = prometheus(&stale);
        for gone in [
            "gpushare_container_gpu_memory_used_bytes{",
            "gpushare_container_gpu_processes{",
            "gpushare_unserved_gpu_memory_used_bytes{",
            "gpushare_unserved_gpu_processes{",
            "gpushare_watch_gpu_unlisted{",
        ] {
            assert!(!text.contains(gone), "{gone} in {text}");
        }
        for kept in [
            "gpushare_watch_up 0\n",
            "gpushare_watch_last_scan_timestamp_seconds 0\n",
            "gpushare_watch_actions_total{action=\"stop-direct\"} 3\n",
            "gpushare_watch_gpu_list_failures_total 7\n",
        ] {
            assert!(text.contains(kept), "{kept} in {text}");
        }
    }

    /// A v3 daemon: `mps=v3` among its labels, each container's namespace on its line
    /// with its limits and clients, a namespace no record names on a line of its own, and
    /// a Prometheus series per namespace, the daemon's name escaped inside its label.
    #[test]
    fn a_v3_daemon_shows_its_namespaces_in_the_table_and_in_prometheus() {
        use super::super::collect::NamespaceView;
        use crate::identity::test_limits;
        let ns =
            |name: &str, kind, container: Option<&str>, limits, clients, listed| NamespaceView {
                name: name.into(),
                kind,
                container_id: container.map(str::to_owned),
                limits: super::super::collect::LimitsView(limits),
                clients,
                listed,
            };
        let view = StatusView {
            schema: SCHEMA,
            state_dir: "/run/gpushare".into(),
            nri: None,
            watch: None,
            capacity: None,
            daemons: vec![DaemonView {
                id: "0123456789abcdef0123456789abcdef".into(),
                devices: Vec::new(),
                uid: 0,
                multi_user: true,
                tenant: None,
                ipc: "isolated",
                limits: Default::default(),
                status: ViewStatus::Record(DaemonStatus::Ready),
                pid: Some(5),
                supervisor_pid: Some(4),
                uptime_seconds: Some(3),
                restarts: 0,
                health: "ok",
                health_reason: None,
                limits_unconfirmed_since: None,
                servers: Some(1),
                clients: Some(3),
                error: None,
                pipe_dir: String::new(),
                shm_dir: None,
                log_dir: String::new(),
                containers: shown(vec![ContainerRecord::new("c1".into(), None, None, None)]),
                protocol: Some("v3"),
                namespaces: Some(vec![
                    ns(
                        "c0123",
                        "container",
                        Some("c1"),
                        test_limits(Some(25), Some(2 << 30)),
                        Some(2),
                        Some(true),
                    ),
                    ns(
                        "default",
                        "default",
                        None,
                        test_limits(Some(10), None),
                        Some(0),
                        Some(true),
                    ),
                    ns(
                        "x\\\"} 1",
                        "unrecorded",
                        None,
                        test_limits(None, None),
                        Some(1),
                        Some(true),
                    ),
                ]),
            }],
        };
        let table = table(&view);
        assert!(table.contains("  mps=v3  "), "{table}");
        assert!(
            table.contains(
                "  └ container c1  engine=-  pid=-  ns=c0123  threads=25%  mem=2048M  clients=2\n"
            ),
            "{table}"
        );
        assert!(
            table.contains("  └ ns=default  threads=10%  clients=0  (the server's own)\n"),
            "{table}"
        );
        assert!(
            table.contains("  └ ns=x\\\"} 1  clients=1  (no container record names it)\n"),
            "{table}"
        );
        let text = prometheus(&view);
        let daemon = "daemon=\"0123456789abcdef0123456789abcdef\",device=\"\",uid=\"multi\"";
        for row in [
            format!("gpushare_namespace_info{{{daemon},mps_namespace=\"c0123\",container_id=\"c1\",kind=\"container\"}} 1\n"),
            format!("gpushare_namespace_clients{{{daemon},mps_namespace=\"c0123\",container_id=\"c1\"}} 2\n"),
            format!("gpushare_namespace_active_thread_percentage{{{daemon},mps_namespace=\"c0123\",container_id=\"c1\"}} 25\n"),
            format!("gpushare_namespace_pinned_memory_limit_bytes{{{daemon},mps_namespace=\"c0123\",container_id=\"c1\"}} 2147483648\n"),
            format!("gpushare_namespace_info{{{daemon},mps_namespace=\"default\",container_id=\"\",kind=\"default\"}} 1\n"),
            format!("gpushare_namespace_clients{{{daemon},mps_namespace=\"x\\\\\\\"}} 1\",container_id=\"\"}} 1\n"),
        ] {
            assert!(text.contains(&row), "{row} in\n{text}");
        }
        assert!(text.contains("# TYPE gpushare_namespace_clients gauge\n"));
        assert!(!text.contains("gpushare_namespace_pinned_memory_limit_bytes{daemon=\"0123456789abcdef0123456789abcdef\",device=\"\",uid=\"multi\",mps_namespace=\"default\""), "no row for an unset limit");
    }
}
