//! Round 4 (docs/gpu-validation.md "Round 4"): what a driver shows of MPS clients
//! that only a GPU can confirm, as six sections `--only round4` selects (or each by name):
//!
//! - `r4-nodes` (E1): does an MPS client need the GPU's device nodes (a client with /dev/null
//!   over each /dev/nvidia*)? What a client holds open (/proc/<pid>/fd), what strace sees
//!   (openat, connect, sendmsg, recvmsg; any SCM_RIGHTS), and whether a private /dev/shm is
//!   enough (pinned host memory included);
//! - `r4-nvml` (E2, E6): NVML's two process lists (the watcher's calls), beside
//!   `nvidia-smi`, with an MPS client holding 1 GiB and a process that skips MPS holding
//!   2 GiB; the same calls from a new PID namespace;
//! - `r4-terminate` (E5): a client holding 4 GiB ended by `terminate_client`: NVML every
//!   100 ms, when its memory goes, what it printed, whether another client of the server
//!   computes on;
//! - `r4-threads` (E9, E7): one client at 100 %, one at 25 %, four at 25 % at once (one
//!   UID): each one's throughput, and what `nvidia-smi pmon` and NVML say per process;
//! - `r4-watch` (item 5): `gpushare watch` (policy act) against a served container run by
//!   gpushare-runtime and runc (containers.rs);
//! - `r4-privileged` (item 6): root's commands on a multi-user daemon's
//!   `control_privileged`, a non-root connect to it, and the supervisor's limit check while
//!   a tenant holds 20 connections on `control`.
//!
//! Simulated, each runs what the simulator and the fake NVML (tests/integration/
//! fake_nvml.c, compiled here with `cc` when there is one) can show, and lists the rest as
//! SKIP with its reason.
//!
//! Invariants: every section runs inside `guarded`: a panic or a failure in one is a FAIL
//! of that section, the others still run, and its clients and daemons are ended before the
//! next starts (the tier's restore still checks nothing is left); compute mode and MIG are
//! never set; every wait has a deadline (`--r4-hold` sets how long clients hold).

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::{json, Value};

use crate::calc::{self, f2, first_line};
use crate::opts::Options;
use crate::proc;
use crate::tier::{Daemon, Tier, UA, UB};

use crate::opts::ROUND4_SECTIONS as SECTIONS;

const G: u64 = 1 << 30;

/// What a section started: ended by `guarded` whatever happened.
#[derive(Default)]
pub struct Scope {
    pub labels: Vec<String>,
    pub daemons: Vec<String>,
}

/// What the sections share: the helper executable (a copy every UID can run), NVML's
/// environment (simulated: the fake's), and the hold time.
struct R4 {
    helper: PathBuf,
    nvml_env: Vec<(String, String)>,
    /// Why NVML cannot be asked here; `None` when it can.
    no_nvml: Option<String>,
    hold: f64,
}

/// Seconds each section takes on a GPU at most in the usual case, with `hold` s holds.
pub fn estimate(name: &str, hold: f64) -> f64 {
    match name {
        "r4-nodes" => 35.0 + hold,
        "r4-nvml" => 20.0 + hold,
        "r4-terminate" => 25.0 + hold,
        "r4-threads" => 35.0 + 3.0 * hold,
        "r4-watch" => 50.0 + hold,
        "r4-privileged" => 20.0,
        _ => 0.0,
    }
}

pub fn run(t: &mut Tier, opts: &Options, flag: &str) {
    let wanted: Vec<&str> = SECTIONS.iter().copied().filter(|s| opts.wants(s)).collect();
    if wanted.is_empty() {
        return;
    }
    let hold = opts.r4_hold(t.simulate);
    let total: f64 = wanted.iter().map(|s| estimate(s, hold)).sum();
    t.section(&format!(
        "round 4: {} (holds {hold} s; about {total:.0} s on a GPU)",
        wanted.join(", ")
    ));
    t.record(json!({"event": "round4", "sections": wanted, "hold_s": hold, "estimate_s": total}));
    let r4 = match setup(t, hold) {
        Ok(r) => r,
        Err(e) => {
            t.check("FAIL", "round 4: setup", &e);
            return;
        }
    };
    for name in wanted {
        guarded(t, name, |t, s| match name {
            "r4-nodes" => nodes(t, &r4, s),
            "r4-nvml" => nvml_lists(t, &r4, s),
            "r4-terminate" => terminate(t, &r4, s),
            "r4-threads" => threads(t, &r4, s),
            "r4-watch" => crate::containers::r4_watch(t, hold, &mut s.labels),
            "r4-privileged" => privileged(t, &r4, s, flag),
            _ => {}
        });
    }
}

fn setup(t: &mut Tier, hold: f64) -> Result<R4, String> {
    let home0 = t.work.join("home/0");
    proc::mkdir(&home0, 0o700).map_err(|e| format!("{}: {e}", home0.display()))?;
    let exe = std::env::current_exe().map_err(|e| format!("this executable: {e}"))?;
    let helper = t.work.join("bin/r4-helper");
    std::fs::copy(&exe, &helper).map_err(|e| format!("copy {}: {e}", exe.display()))?;
    {
        use std::os::unix::fs::PermissionsExt;
        let _ = std::fs::set_permissions(&helper, std::fs::Permissions::from_mode(0o755));
    }
    let mut nvml_env = Vec::new();
    let mut no_nvml = None;
    if t.simulate {
        // The fake NVML lists the simulator's processes (those started with --gpu).
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/integration/fake_nvml.c");
        match testkit::common::which("cc") {
            Some(cc) if src.is_file() => {
                let dir = t.work.join("nvml");
                let _ = proc::mkdir(&dir, 0o755);
                let built = proc::run(
                    Command::new(cc)
                        .args(["-shared", "-fPIC", "-pthread", "-Wl,-z,nodelete", "-o"])
                        .arg(dir.join("libnvidia-ml.so.1"))
                        .arg(&src),
                    None,
                    Duration::from_secs(60),
                    Duration::from_secs(5),
                );
                if built.ok() {
                    nvml_env.push(("LD_LIBRARY_PATH".into(), dir.display().to_string()));
                    nvml_env.push(("FAKE_NVML_GPUS".into(), t.gpu.uuid.clone()));
                } else {
                    no_nvml = Some(format!("cc fake_nvml.c: {}", first_line(&built.out, 160)));
                }
            }
            _ => {
                no_nvml = Some(
                    "no cc (or no tests/integration/fake_nvml.c) to build the fake NVML".into(),
                )
            }
        }
    }
    Ok(R4 {
        helper,
        nvml_env,
        no_nvml,
        hold,
    })
}

/// Runs section `name`; whatever happens in it (a panic included), its clients and
/// daemons are ended afterwards and the next section runs. An interruption still ends the
/// run.
pub fn guarded(t: &mut Tier, name: &str, f: impl FnOnce(&mut Tier, &mut Scope)) {
    let mut scope = Scope::default();
    let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(t, &mut scope)));
    t.abort_clients(&scope.labels);
    t.delete_containers();
    let ids: Vec<&str> = scope.daemons.iter().map(String::as_str).collect();
    t.gs_stop(&ids);
    if let Err(panic) = ran {
        if crate::tier::interrupted() {
            std::panic::resume_unwind(panic);
        }
        let why = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic".into());
        t.check("FAIL", &format!("{name}: ran to its end"), &why);
    }
}

// ------------------------------------------------------------------ shared pieces

/// A per-user daemon of UID 1000 (`args` added), noted in `s`; `None` after a FAIL.
fn daemon(t: &mut Tier, s: &mut Scope, what: &str, args: &[&str]) -> Option<Daemon> {
    let cfg = t.cfg.clone();
    let ua = UA.to_string();
    let mut all = vec!["--uid", ua.as_str()];
    all.extend_from_slice(args);
    let d = t.gs_start(&cfg, &all);
    if !d.id.is_empty() {
        s.daemons.push(d.id.clone());
    }
    if !d.ok {
        let ev = first_line(&d.out, 220);
        t.check("FAIL", &format!("{what}: daemon start"), &ev);
        return None;
    }
    Some(d)
}

/// A client that allocates `bytes` on the GPU and holds them `hold` s: the workload's
/// `alloc --hold`, or the simulator's `client --gpu --alloc` (which the fake NVML lists).
fn alloc_cmd(t: &Tier, bytes: u64, hold: f64) -> Vec<OsString> {
    if t.simulate {
        let mut cmd = t.client_cmd(hold);
        cmd.extend([
            "--gpu".into(),
            t.gpu.uuid.clone().into(),
            "--alloc".into(),
            format!("{}G", bytes / G).into(),
        ]);
        cmd
    } else {
        t.workload_cmd(&[
            "alloc",
            "--bytes",
            &bytes.to_string(),
            "--hold",
            &format!("{hold}"),
        ])
    }
}

/// Launches `label` (noted in `s`).
#[allow(clippy::too_many_arguments)]
fn start(
    t: &mut Tier,
    s: &mut Scope,
    label: &str,
    uid: u32,
    pipe: Option<&Path>,
    shm: Option<&Path>,
    env: &[(&str, &str)],
    argv: Vec<OsString>,
    timeout_s: f64,
) {
    s.labels.push(label.to_owned());
    t.launch(label, uid, pipe, shm, timeout_s, env, argv);
}

/// The client holds its allocation (real: its `allocated` line; simulated: its
/// `mps-client`/`direct-client` line) within `timeout_s`; false when it ended first.
fn wait_holding(t: &Tier, label: &str, timeout_s: f64) -> bool {
    let out = t.run_dir.join(format!("{label}.out"));
    let sim = t.simulate;
    testkit::common::wait_until(Duration::from_secs_f64(timeout_s), || {
        crate::tier::stop_if_interrupted();
        let text = std::fs::read_to_string(&out).unwrap_or_default();
        let holding = if sim {
            text.lines()
                .any(|l| l.starts_with("mps-client ") || l.starts_with("direct-client "))
        } else {
            text.contains("\"event\": \"allocated\"")
        };
        holding || t.done_of(label).is_some()
    }) && t.done_of(label).is_none()
}

/// A client's output, stdout then stderr, cut to one line.
fn output(t: &Tier, label: &str, max: usize) -> String {
    let read = |ext: &str| {
        std::fs::read_to_string(t.run_dir.join(format!("{label}.{ext}"))).unwrap_or_default()
    };
    calc::cut(
        &calc::one_line(&format!("{} {}", read("out"), read("err"))),
        max,
    )
}

/// `nvidia-smi --query-compute-apps=pid,used_memory`, one line; simulated, why not.
fn smi_apps(t: &Tier) -> String {
    if t.simulate {
        return "(simulated: no nvidia-smi)".into();
    }
    let r = proc::nvidia_smi("--query-compute-apps=pid,used_memory");
    r.out.trim().lines().collect::<Vec<_>>().join("; ")
}

/// The helper's NVML lists, once (`prefix` runs it, e.g. `unshare -p -f --mount-proc`).
fn nvml_once(t: &Tier, r4: &R4, prefix: &[&str]) -> Value {
    nvml_last(t, r4, prefix, 1, 0)
}

/// The last of `samples` samples `every_ms` apart (per-process utilization needs a
/// second look: the first returns what the driver buffered before it).
fn nvml_last(t: &Tier, r4: &R4, prefix: &[&str], samples: u32, every_ms: u32) -> Value {
    if let Some(why) = &r4.no_nvml {
        return json!({"error": why});
    }
    let mut cmd = match prefix.split_first() {
        Some((p, rest)) => {
            let mut c = Command::new(p);
            c.args(rest).arg(&r4.helper);
            c
        }
        None => Command::new(&r4.helper),
    };
    cmd.arg("--r4-nvml")
        .arg(samples.to_string())
        .arg(every_ms.to_string())
        .env_clear()
        .env("PATH", proc::SAFE_PATH);
    for (k, v) in &r4.nvml_env {
        cmd.env(k, v);
    }
    if !t.simulate {
        if let Some(v) = std::env::var_os("LD_LIBRARY_PATH") {
            cmd.env("LD_LIBRARY_PATH", v);
        }
    }
    let r = proc::run(
        &mut cmd,
        None,
        Duration::from_secs(60),
        Duration::from_secs(5),
    );
    r.out
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str::<Value>(l).ok())
        .unwrap_or_else(|| json!({"error": format!("rc {}: {}", r.code, first_line(&r.out, 200))}))
}

/// One sample's lists, with the pids named by `names`: `compute [pid(name) MiB, …]; mps […]`.
fn lists_text(sample: &Value, names: &[(i32, &str)]) -> String {
    if let Some(e) = sample.get("error") {
        return format!("error: {}", e.as_str().unwrap_or_default());
    }
    let name = |pid: i64| {
        names
            .iter()
            .find(|(p, _)| i64::from(*p) == pid)
            .map_or(String::new(), |(_, n)| format!("({n})"))
    };
    let mut parts = Vec::new();
    for g in sample["gpus"].as_array().into_iter().flatten() {
        for key in ["compute", "mps"] {
            let v = &g[key];
            let text = match v.as_array() {
                Some(a) => a
                    .iter()
                    .map(|p| {
                        let pid = p[0].as_i64().unwrap_or(-1);
                        let mib = p[1]
                            .as_u64()
                            .map_or("n/a".to_owned(), |b| format!("{} MiB", b >> 20));
                        format!("{pid}{} {mib}", name(pid))
                    })
                    .collect::<Vec<_>>()
                    .join(", "),
                None => format!("error {}", v["error"].as_str().unwrap_or("?")),
            };
            parts.push(format!("gpu {} {key} [{text}]", g["index"]));
        }
    }
    if parts.is_empty() {
        "no GPU listed".into()
    } else {
        parts.join("; ")
    }
}

/// The pids of a daemon's MPS servers (`get_server_list`, as root).
fn servers(t: &Tier, d: &Daemon) -> Vec<String> {
    t.ctl1(0, &d.pipe, "get_server_list")
        .split_whitespace()
        .filter(|w| w.chars().all(|c| c.is_ascii_digit()))
        .map(str::to_owned)
        .collect()
}

// ------------------------------------------------------------------ E1

fn nodes(t: &mut Tier, r4: &R4, s: &mut Scope) {
    t.section("r4-nodes (E1): does an MPS client need the GPU's device nodes?");
    let Some(d) = daemon(t, s, "r4-nodes", &[]) else {
        return;
    };
    // Long enough to read its fds (a simulated client needs no torch import).
    let hold = r4.hold.max(if t.simulate { 1.5 } else { 3.0 });
    // A normal client: what it holds open while it holds 1 GiB.
    let cmd = alloc_cmd(t, G, hold);
    let tmo = t.tmo(hold);
    start(
        t,
        s,
        "r4-e1-fds",
        UA,
        Some(&d.pipe),
        Some(&d.shm),
        &[],
        cmd,
        tmo,
    );
    if wait_holding(t, "r4-e1-fds", tmo) {
        let pid = t.pid_of("r4-e1-fds").unwrap_or(-1);
        let fds = fd_summary(pid);
        t.record(json!({"event": "r4_fds", "pid": pid, "fds": fds}));
        t.check(
            "INFO",
            "E1: a client's open files (/proc/<pid>/fd)",
            &fds.join(", "),
        );
    } else {
        let ev = output(t, "r4-e1-fds", 240);
        t.check("FAIL", "E1: a client holding 1 GiB", &ev);
    }
    // strace of a client's start (as UID 1000: it traces its own child).
    let (strace, strace_env) = find_strace(t);
    // strace writes it as UID 1000: in that UID's home, not the root-only run directory.
    let trace = t.work.join(format!("home/{UA}/r4-e1-strace.trace"));
    if let Some(strace) = &strace {
        let mut argv: Vec<OsString> = vec![
            strace.clone().into(),
            "-f".into(),
            "-qq".into(),
            "-s".into(),
            "96".into(),
            "-e".into(),
            "trace=openat,connect,sendmsg,recvmsg".into(),
            "-o".into(),
            trace.clone().into(),
        ];
        argv.extend(if t.simulate {
            t.client_cmd(0.2)
        } else {
            t.workload_cmd(&["probe"])
        });
        start(
            t,
            s,
            "r4-e1-strace",
            UA,
            Some(&d.pipe),
            Some(&d.shm),
            &strace_env
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect::<Vec<_>>(),
            argv,
            tmo,
        );
    }
    // Without the device nodes: /dev/null over each /dev/nvidia* (a private mount
    // namespace of the client's).
    let hidden = device_nodes();
    if hidden.is_empty() {
        let why = "no /dev/nvidia* here to hide (the simulator opens none)";
        if t.simulate {
            t.skip_sim("E1: cuInit without the device nodes", why);
        } else {
            t.check("SKIP", "E1: cuInit without the device nodes", why);
        }
    } else {
        t.next_hide = hidden.clone();
        let cmd = if t.simulate {
            t.client_cmd(0.2)
        } else {
            t.workload_cmd(&["alloc", "--bytes", &G.to_string()])
        };
        start(
            t,
            s,
            "r4-e1-nodev",
            UA,
            Some(&d.pipe),
            Some(&d.shm),
            &[],
            cmd,
            tmo,
        );
    }
    // A private /dev/shm (its own tmpfs instead of the daemon's), pinned host memory too.
    t.next_private_shm = true;
    let cmd = if t.simulate {
        t.client_cmd(0.2)
    } else {
        t.workload_cmd(&[
            "alloc",
            "--bytes",
            &G.to_string(),
            "--host-pinned",
            &(64u64 << 20).to_string(),
        ])
    };
    start(
        t,
        s,
        "r4-e1-privshm",
        UA,
        Some(&d.pipe),
        Some(&d.shm),
        &[],
        cmd,
        tmo,
    );
    let labels = ["r4-e1-fds", "r4-e1-strace", "r4-e1-nodev", "r4-e1-privshm"];
    t.wait_done(tmo, &labels);
    if !hidden.is_empty() {
        let r = t.collect("r4-e1-nodev", UA, "r4-nodes");
        let names: Vec<String> = hidden.iter().map(|p| p.display().to_string()).collect();
        let ev = format!(
            "/dev/null over {}: ok={} rc={} {}",
            names.join(" "),
            r.text("ok"),
            r.text("rc"),
            if r.ok() {
                "(the client ran its first kernel and allocated 1 GiB)".to_owned()
            } else {
                calc::cut(&r.error(), 200)
            }
        );
        t.check("INFO", "E1: cuInit without the device nodes", &ev);
    }
    let r = t.collect("r4-e1-privshm", UA, "r4-nodes");
    let ev = format!(
        "own tmpfs on /dev/shm: ok={} rc={} {}",
        r.text("ok"),
        r.text("rc"),
        if r.ok() {
            "(1 GiB and 64 MiB of pinned host memory)".to_owned()
        } else {
            calc::cut(&r.error(), 200)
        }
    );
    let ev = if t.simulate {
        format!("{ev} (the simulator's model: a client must see its server's /dev/shm)")
    } else {
        ev
    };
    t.check("INFO", "E1b: a private /dev/shm", &ev);
    let fds = t.collect("r4-e1-fds", UA, "r4-nodes");
    if !fds.ok() && !t.simulate {
        let ev = calc::cut(&fds.error(), 200);
        t.check("INFO", "E1: the client holding 1 GiB ended", &ev);
    }
    match strace {
        None => t.check(
            "INFO",
            "E1: strace of a client",
            "strace is not on this machine (carry a static one to see device opens and SCM_RIGHTS)",
        ),
        Some(_) => {
            let text = std::fs::read_to_string(&trace).unwrap_or_default();
            let summary = strace_summary(&text);
            t.record(
                json!({"event": "r4_strace", "summary": summary, "lines": text.lines().count()}),
            );
            t.check(
                "INFO",
                "E1: strace of a client (openat, connect, sendmsg, recvmsg)",
                &summary,
            );
            let _ = t.collect("r4-e1-strace", UA, "r4-nodes");
        }
    }
}

/// strace: the machine's, else one carried beside the binaries (scripts/gpu/round4-pack:
/// `strace` and the libraries it needs in `strace-lib/`), copied into the work directory
/// where UID 1000 can run it, with the environment it needs (its libraries, which the
/// traced client then also sees; only its output is read, no figure).
fn find_strace(t: &Tier) -> (Option<PathBuf>, Vec<(String, String)>) {
    if let Some(s) = testkit::common::which("strace") {
        return (Some(s), Vec::new());
    }
    let Some(dir) = t.bins.gpushare.parent() else {
        return (None, Vec::new());
    };
    if !dir.join("strace").is_file() {
        return (None, Vec::new());
    }
    use std::os::unix::fs::PermissionsExt;
    let mode = |p: &Path, m| {
        let _ = std::fs::set_permissions(p, std::fs::Permissions::from_mode(m));
    };
    let bin = t.work.join("bin/strace");
    let libs = t.work.join("strace-lib");
    if std::fs::copy(dir.join("strace"), &bin).is_err() {
        return (None, Vec::new());
    }
    mode(&bin, 0o755);
    let _ = proc::mkdir(&libs, 0o755);
    for e in std::fs::read_dir(dir.join("strace-lib"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let to = libs.join(e.file_name());
        if std::fs::copy(e.path(), &to).is_ok() {
            mode(&to, 0o644);
        }
    }
    let env = vec![("LD_LIBRARY_PATH".to_owned(), libs.display().to_string())];
    (Some(bin), env)
}

/// The GPU's device nodes (files only) under /dev and /dev/nvidia-caps.
fn device_nodes() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = ["/dev", "/dev/nvidia-caps"]
        .iter()
        .flat_map(|d| std::fs::read_dir(d).into_iter().flatten().flatten())
        .filter(|e| e.file_name().to_string_lossy().starts_with("nvidia"))
        .filter(|e| e.file_type().is_ok_and(|t| !t.is_dir()))
        .map(|e| e.path())
        .collect();
    v.sort();
    v
}

/// `/proc/<pid>/fd`, each link read, counted: `/dev/nvidia0 x3, anon_inode:… x2, …`.
fn fd_summary(pid: i32) -> Vec<String> {
    let mut counts: std::collections::BTreeMap<String, usize> = Default::default();
    for e in std::fs::read_dir(format!("/proc/{pid}/fd"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let target = std::fs::read_link(e.path())
            .map(|p| p.display().to_string())
            .unwrap_or_else(|e| format!("?({e})"));
        // socket:[123] and pipe:[456]: the kind, not the inode.
        let key = match target.split_once(":[") {
            Some((kind, _)) => format!("{kind}:[…]"),
            None => target,
        };
        *counts.entry(key).or_default() += 1;
    }
    counts
        .into_iter()
        .map(|(k, n)| if n > 1 { format!("{k} x{n}") } else { k })
        .collect()
}

/// What an strace shows: the files opened under /dev, sockets connected, and whether a
/// recvmsg carried SCM_RIGHTS.
fn strace_summary(text: &str) -> String {
    let mut dev = std::collections::BTreeSet::new();
    let mut connects = std::collections::BTreeSet::new();
    let (mut recv, mut rights) = (0, 0);
    for l in text.lines() {
        if let Some(at) = l.find("openat(") {
            let rest = &l[at..];
            if let Some(p) = rest.split('"').nth(1) {
                if p.starts_with("/dev/") && !l.contains("= -1") {
                    dev.insert(p.to_owned());
                }
            }
        }
        if l.contains("connect(") {
            if let Some(p) = l.split('"').nth(1) {
                let ok = if l.contains("= -1") { " (failed)" } else { "" };
                connects.insert(format!("{p}{ok}"));
            }
        }
        if l.contains("recvmsg(") {
            recv += 1;
            if l.contains("SCM_RIGHTS") {
                rights += 1;
            }
        }
    }
    format!(
        "opened under /dev: {}; connected: {}; recvmsg calls {recv}, with SCM_RIGHTS {rights}",
        if dev.is_empty() {
            "nothing".to_owned()
        } else {
            dev.into_iter().collect::<Vec<_>>().join(" ")
        },
        if connects.is_empty() {
            "nothing".to_owned()
        } else {
            connects.into_iter().collect::<Vec<_>>().join(" ")
        }
    )
}

// ------------------------------------------------------------------ E2, E6

fn nvml_lists(t: &mut Tier, r4: &R4, s: &mut Scope) {
    t.section("r4-nvml (E2, E6): what NVML lists of an MPS client and of a process that skips MPS");
    let Some(d) = daemon(t, s, "r4-nvml", &[]) else {
        return;
    };
    let hold = r4.hold.max(3.0) + 5.0;
    let tmo = t.tmo(hold);
    let nomps = t.work.join("nomps");
    let cmd = alloc_cmd(t, G, hold);
    start(
        t,
        s,
        "r4-e2-mps",
        UA,
        Some(&d.pipe),
        Some(&d.shm),
        &[],
        cmd,
        tmo,
    );
    let cmd = alloc_cmd(t, 2 * G, hold);
    start(t, s, "r4-e2-direct", UB, Some(&nomps), None, &[], cmd, tmo);
    let held = wait_holding(t, "r4-e2-mps", tmo) & wait_holding(t, "r4-e2-direct", tmo);
    if !held {
        let ev = format!(
            "mps: {}; direct: {}",
            output(t, "r4-e2-mps", 160),
            output(t, "r4-e2-direct", 160)
        );
        t.check("FAIL", "E2: both clients hold their allocation", &ev);
        return;
    }
    let mut names: Vec<(i32, String)> = vec![
        (t.pid_of("r4-e2-mps").unwrap_or(-1), "mps client 1G".into()),
        (t.pid_of("r4-e2-direct").unwrap_or(-1), "direct 2G".into()),
    ];
    for srv in servers(t, &d) {
        if let Ok(p) = srv.parse() {
            names.push((p, "mps server".into()));
        }
    }
    let names_ref: Vec<(i32, &str)> = names.iter().map(|(p, n)| (*p, n.as_str())).collect();
    let host = nvml_once(t, r4, &[]);
    let smi = smi_apps(t);
    t.record(json!({"event": "r4_nvml", "where": "host", "names": names, "sample": host, "nvidia_smi": smi}));
    t.check(
        "INFO",
        "E2: NVML's lists (the watcher's calls)",
        &lists_text(&host, &names_ref),
    );
    if t.simulate {
        t.skip_sim(
            "E2: nvidia-smi --query-compute-apps",
            "no nvidia-smi; the lists above are the fake NVML's",
        );
    } else {
        t.check(
            "INFO",
            "E2: nvidia-smi --query-compute-apps=pid,used_memory",
            &smi,
        );
    }
    match testkit::common::which("unshare") {
        Some(u) => {
            let u = u.display().to_string();
            let inner = nvml_once(t, r4, &[&u, "-p", "-f", "--mount-proc"]);
            t.record(json!({"event": "r4_nvml", "where": "new pid namespace", "sample": inner}));
            let ev = lists_text(&inner, &names_ref);
            let ev = if t.simulate {
                format!("{ev} (the fake NVML walks the namespace's /proc; a driver does not)")
            } else {
                ev
            };
            t.check(
                "INFO",
                "E2: the same calls in a new PID namespace (unshare -p -f --mount-proc)",
                &ev,
            );
        }
        None => t.check(
            "SKIP",
            "E2: the same calls in a new PID namespace",
            "unshare (util-linux) is not on this machine",
        ),
    }
    let e6 = "E6 is read from the lists above: a process that skips MPS in the MPS list would make the watcher's classification spoofable";
    t.check(
        "INFO",
        "E6: can a direct process pass for an MPS client",
        e6,
    );
}

// ------------------------------------------------------------------ E5

fn terminate(t: &mut Tier, r4: &R4, s: &mut Scope) {
    t.section("r4-terminate (E5): what terminate_client frees, and when");
    let Some(d) = daemon(t, s, "r4-terminate", &[]) else {
        return;
    };
    // The hog holds long enough to be ended by terminate_client, then killed.
    let (after_term, after_kill) = if t.simulate { (2.0, 1.0) } else { (4.0, 2.0) };
    let hold = after_term + after_kill + 60.0;
    let tmo = t.tmo(hold);
    let cmd = alloc_cmd(t, 4 * G, hold);
    start(
        t,
        s,
        "r4-e5-hog",
        UA,
        Some(&d.pipe),
        Some(&d.shm),
        &[],
        cmd,
        tmo,
    );
    let other_hold = if t.simulate {
        after_term + after_kill + 2.0
    } else {
        r4.hold.max(3.0) + after_term + after_kill + 6.0
    };
    let cmd = t.client_cmd(other_hold);
    start(
        t,
        s,
        "r4-e5-other",
        UA,
        Some(&d.pipe),
        Some(&d.shm),
        &[],
        cmd,
        t.tmo(other_hold),
    );
    if !wait_holding(t, "r4-e5-hog", tmo) || !t.wait_attached(tmo, "r4-e5-other") {
        let ev = format!(
            "hog: {}; other: {}",
            output(t, "r4-e5-hog", 160),
            output(t, "r4-e5-other", 160)
        );
        t.check(
            "FAIL",
            "E5: a client holding 4 GiB and a second client",
            &ev,
        );
        return;
    }
    let hog = t.pid_of("r4-e5-hog").unwrap_or(-1);
    // NVML every 100 ms from 1 s before terminate_client to `after_kill` s after the kill.
    let samples = ((1.0 + after_term + after_kill + 2.0) * 10.0) as u32;
    let sampler = match &r4.no_nvml {
        None => {
            let mut argv: Vec<OsString> = vec![r4.helper.clone().into(), "--r4-nvml".into()];
            argv.push(samples.to_string().into());
            argv.push("100".into());
            let env: Vec<(&str, &str)> = r4
                .nvml_env
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            start(t, s, "r4-e5-nvml", 0, None, None, &env, argv, 60.0);
            crate::tier::pause(Duration::from_secs(1));
            true
        }
        Some(why) => {
            let why = why.clone();
            t.check("SKIP", "E5: NVML sampling", &why);
            false
        }
    };
    let srv = servers(t, &d).into_iter().next().unwrap_or_default();
    let t_term = calc::epoch_now();
    let reply = t.ctl1(0, &d.pipe, &format!("terminate_client {srv} {hog}"));
    crate::tier::pause(Duration::from_millis(500));
    let smi_term = smi_apps(t);
    crate::tier::pause(Duration::from_secs_f64(after_term - 0.5));
    let alive_before_kill = t.done_of("r4-e5-hog").is_none();
    let t_kill = calc::epoch_now();
    t.abort_clients(&["r4-e5-hog".to_owned()]);
    crate::tier::pause(Duration::from_secs_f64(after_kill));
    let smi_kill = smi_apps(t);
    let hog_done = t.done_of("r4-e5-hog");
    let hog_rec = t.collect("r4-e5-hog", UA, "r4-terminate");
    let printed = output(t, "r4-e5-hog", 400);
    let ev = format!(
        "terminate_client {srv} {hog} -> '{reply}'; the client was {} {after_term} s later (then ended by the tier); it exited {} with rc {}; it printed: {printed}",
        if alive_before_kill { "still running" } else { "gone" },
        hog_done.map_or("?".to_owned(), |(_, te)| format!("{:+.2} s after terminate", te - t_term)),
        hog_rec.text("rc"),
    );
    t.check("INFO", "E5: the terminated client", &ev);
    if sampler {
        t.wait_done(30.0, &["r4-e5-nvml"]);
        let text = std::fs::read_to_string(t.run_dir.join("r4-e5-nvml.out")).unwrap_or_default();
        let seen: Vec<(f64, Option<u64>)> = text
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .map(|v| (v["t"].as_f64().unwrap_or(0.0), used_by(&v, hog)))
            .collect();
        t.record(
            json!({"event": "r4_terminate_samples", "hog": hog, "t_terminate": t_term,
            "t_kill": t_kill, "t_exit": hog_done.map(|d| d.1), "samples": seen}),
        );
        let last = seen
            .iter()
            .filter(|(_, u)| u.is_some())
            .map(|(t, _)| *t)
            .fold(None, |a: Option<f64>, t| Some(a.map_or(t, |a| a.max(t))));
        let before = seen
            .iter()
            .rev()
            .find(|(ts, u)| *ts < t_term && u.is_some())
            .and_then(|(_, u)| *u);
        let ev = format!(
            "{} samples; held {} MiB before terminate_client; last listed {}; the tier's kill at {:+.2} s; nvidia-smi 0.5 s after terminate: {smi_term}; after the kill: {smi_kill}",
            seen.len(),
            before.map_or("?".to_owned(), |b| (b >> 20).to_string()),
            last.map_or("never".to_owned(), |l| format!("{:+.2} s after terminate", l - t_term)),
            t_kill - t_term,
        );
        t.check(
            "INFO",
            "E5: the client's memory in NVML (every 100 ms)",
            &ev,
        );
    }
    t.wait_done(t.tmo(other_hold), &["r4-e5-other"]);
    let other = t.collect("r4-e5-other", UA, "r4-terminate");
    let kept = other.ok() && other.num("t_end").is_some_and(|e| e > t_kill);
    let ev = format!(
        "ok={} ended {} after terminate{}",
        other.text("ok"),
        other
            .num("t_end")
            .map_or("?".to_owned(), |e| format!("{:+.2} s", e - t_term)),
        if other.ok() {
            other
                .num("iters_per_s")
                .map_or(String::new(), |i| format!(", {i:.1} it/s"))
        } else {
            format!(": {}", calc::cut(&other.error(), 160))
        }
    );
    t.check(
        "INFO",
        "E5: another client of the same server",
        &format!(
            "{} {ev}",
            if kept {
                "kept running:"
            } else {
                "did NOT keep running:"
            }
        ),
    );
}

/// The bytes NVML lists for `pid` in one sample (any GPU, either list).
fn used_by(sample: &Value, pid: i32) -> Option<u64> {
    sample["gpus"]
        .as_array()
        .into_iter()
        .flatten()
        .find_map(|g| {
            ["compute", "mps"].iter().find_map(|k| {
                g[*k].as_array().into_iter().flatten().find_map(|p| {
                    (p[0].as_i64() == Some(i64::from(pid))).then(|| p[1].as_u64().unwrap_or(0))
                })
            })
        })
}

// ------------------------------------------------------------------ E9, E7

fn threads(t: &mut Tier, r4: &R4, s: &mut Scope) {
    t.section("r4-threads (E9, E7): does a 25 % cap multiply with a UID's processes?");
    let Some(d100) = daemon(t, s, "r4-threads", &["--active-thread-percentage", "100"]) else {
        return;
    };
    let Some(d25) = daemon(t, s, "r4-threads", &["--active-thread-percentage", "25"]) else {
        return;
    };
    let hold = r4.hold;
    let matmul = |t: &Tier| {
        if t.simulate {
            t.client_cmd(hold)
        } else {
            t.workload_cmd(&[
                "matmul",
                "--size",
                "8192",
                "--seconds",
                &format!("{hold}"),
                "--batch",
                "5",
            ])
        }
    };
    let tmo = t.tmo(hold);
    for (label, d) in [("r4-e9-100", &d100), ("r4-e9-25", &d25)] {
        let cmd = matmul(t);
        start(t, s, label, UA, Some(&d.pipe), Some(&d.shm), &[], cmd, tmo);
        t.wait_done(tmo, &[label]);
        t.collect(label, UA, "r4-threads");
    }
    let four: Vec<String> = (0..4).map(|i| format!("r4-e9-4x25-{i}")).collect();
    for l in &four {
        let cmd = matmul(t);
        start(t, s, l, UA, Some(&d25.pipe), Some(&d25.shm), &[], cmd, tmo);
    }
    // While the four compute: pmon and NVML's per-process utilization.
    let all_in = four.iter().all(|l| t.wait_attached(tmo, l));
    crate::tier::pause(Duration::from_secs_f64((hold / 2.0).min(3.0)));
    let pids: Vec<(i32, String)> = four
        .iter()
        .map(|l| (t.pid_of(l).unwrap_or(-1), l.clone()))
        .collect();
    if t.simulate {
        t.skip_sim("E7: nvidia-smi pmon -c 1", "no nvidia-smi");
    } else {
        let pmon = proc::run(
            Command::new("nvidia-smi").args(["pmon", "-c", "1", "-s", "u"]),
            None,
            Duration::from_secs(30),
            Duration::from_secs(5),
        );
        println!("-- nvidia-smi pmon -c 1 -s u (the four clients: {pids:?})");
        print!("{}", pmon.out);
        t.record(json!({"event": "r4_pmon", "pids": pids, "out": pmon.out}));
    }
    let util = nvml_last(t, r4, &[], 3, 500);
    let per: Vec<String> = util["gpus"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|g| {
            g["util"]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .into_iter()
                .map(|u| {
                    let pid = u[0].as_i64().unwrap_or(-1);
                    let who = pids
                        .iter()
                        .find(|(p, _)| i64::from(*p) == pid)
                        .map_or("", |(_, l)| l.as_str());
                    format!(
                        "{pid}{} sm {}%",
                        if who.is_empty() {
                            String::new()
                        } else {
                            format!("({who})")
                        },
                        u[1]
                    )
                })
                .collect::<Vec<_>>()
        })
        .collect();
    t.record(json!({"event": "r4_util", "pids": pids, "sample": util}));
    let util_err = util["gpus"][0]["util"]["error"]
        .as_str()
        .map(str::to_owned)
        .or_else(|| util["error"].as_str().map(str::to_owned));
    let ev = match util_err {
        Some(e) => format!("process_utilization_stats: {e}"),
        None if per.is_empty() => "no samples".to_owned(),
        None => per.join(", "),
    };
    t.check("INFO", "E7: NVML per-process utilization (the four)", &ev);
    t.wait_done(tmo, &four.iter().map(String::as_str).collect::<Vec<_>>());
    let recs: Vec<_> = four
        .iter()
        .map(|l| t.collect(l, UA, "r4-threads"))
        .collect();
    let (r100, r25) = (t.r("r4-e9-100"), t.r("r4-e9-25"));
    if t.simulate {
        let tps: Vec<String> = recs
            .iter()
            .map(|r| r.text("active_thread_percentage"))
            .collect();
        let all25 = all_in && tps.iter().all(|p| calc::is_25(p));
        t.check(
            if all25 { "PASS" } else { "FAIL" },
            "E9: four clients of the 25 % daemon each get 25 %",
            &format!("they report {}", tps.join(", ")),
        );
        t.skip_sim(
            "E9: throughput of one and of four clients at 25 %",
            "needs CUDA kernels",
        );
        return;
    }
    let each: Vec<Option<f64>> = recs.iter().map(|r| r.num("tflops")).collect();
    let sum: f64 = each.iter().flatten().sum();
    let ev = format!(
        "8192² fp32 TFLOP/s: one client at 100 % {}; one at 25 % {} ({} of 100 %); four at 25 % at once: {} = {sum:.2} in all ({} of one at 25 %, {} of 100 %){}",
        f2(r100.num("tflops")),
        f2(r25.num("tflops")),
        f2(r25.num("tflops").zip(r100.num("tflops")).map(|(a, b)| a / b)),
        each.iter().map(|v| f2(*v)).collect::<Vec<_>>().join(" + "),
        f2(r25.num("tflops").map(|one| sum / one)),
        f2(r100.num("tflops").map(|full| sum / full)),
        if recs.iter().all(|r| r.ok()) { String::new() } else { format!("; errors: {}", recs.iter().filter(|r| !r.ok()).map(|r| calc::cut(&r.error(), 80)).collect::<Vec<_>>().join(" | ")) }
    );
    t.check(
        "INFO",
        "E9: throughput of one and of four clients at 25 %",
        &ev,
    );
}

// ------------------------------------------------------------------ item 6

fn privileged(t: &mut Tier, r4: &R4, s: &mut Scope, flag: &str) {
    t.section(&format!("r4-privileged (item 6): a multi-user daemon's control_privileged (multi-user-flag = \"{flag}\")"));
    let cfg = t.work.join("runtime-r4-privileged.toml");
    if let Err(e) = std::fs::write(&cfg, t.config("multi-user", Some(flag))) {
        t.check("FAIL", "r4-privileged: config", &e.to_string());
        return;
    }
    let d = t.gs_start(&cfg, &["--active-thread-percentage", "50"]);
    if !d.id.is_empty() {
        s.daemons.push(d.id.clone());
    }
    if !d.ok {
        let ev = first_line(&d.out, 220);
        t.check("FAIL", "r4-privileged: daemon start", &ev);
        return;
    }
    let privileged = d.pipe.join("control_privileged");
    if !privileged.exists() {
        t.check(
            "INFO",
            "item 6: control_privileged",
            "absent: this driver's multi-user daemon has no privileged channel",
        );
    }
    // Root, through gpushare's privileged view (control -> the daemon's control_privileged).
    let view = d.pipe.with_file_name("priv");
    let mut ev = Vec::new();
    for c in [
        "get_server_list",
        "get_default_active_thread_percentage",
        "set_default_active_thread_percentage 40",
        "get_default_active_thread_percentage",
        "set_default_active_thread_percentage 50",
        "get_default_device_pinned_mem_limit 0",
    ] {
        let r = t.ctl(0, &view, c);
        ev.push(format!(
            "{c} -> rc {} '{}'",
            r.code,
            calc::cut(&calc::one_line(&r.out), 80)
        ));
    }
    t.record(json!({"event": "r4_privileged_root", "replies": ev}));
    t.check(
        "INFO",
        "item 6: root's commands on control_privileged",
        &ev.join("; "),
    );
    // A non-root UID at the socket itself.
    let mut c = Command::new(&r4.helper);
    {
        use std::os::unix::process::CommandExt;
        c.env_clear()
            .arg("--r4-connect")
            .arg(&privileged)
            .uid(UA)
            .gid(UA);
    }
    let r = proc::run(
        &mut c,
        None,
        Duration::from_secs(20),
        Duration::from_secs(2),
    );
    let ev = format!("{} (rc {})", first_line(&r.out, 200), r.code);
    t.check(
        "INFO",
        &format!("item 6: UID {UA} connects to control_privileged"),
        &ev,
    );
    // A tenant holds 20 connections on control; the supervisor's check still confirms?
    let holder = t.work.join("bin/gpushare-mps-sim");
    if !holder.is_file() {
        let src = t.bins.sim.clone();
        if src.is_file() {
            let _ = std::fs::copy(&src, &holder);
        }
    }
    if !holder.is_file() {
        t.check("SKIP", "item 6: the limit check while a tenant holds control", &format!("{} not found (carry target/release/gpushare-mps-sim: its hold-control is the tenant)", t.bins.sim.display()));
        return;
    }
    {
        use std::os::unix::fs::PermissionsExt;
        let _ = std::fs::set_permissions(&holder, std::fs::Permissions::from_mode(0o755));
    }
    let argv: Vec<OsString> = vec![
        holder.into(),
        "hold-control".into(),
        "20".into(),
        "--every".into(),
        "1".into(),
    ];
    start(
        t,
        s,
        "r4-hold-control",
        UB,
        Some(&d.pipe),
        None,
        &[],
        argv,
        60.0,
    );
    // The supervisor checks every 2 s: root raises the default through the privileged
    // view, and the check, through the same channel, is to set it back.
    crate::tier::pause(Duration::from_secs(if t.simulate { 2 } else { 3 }));
    let raise = t.ctl1(0, &view, "set_default_active_thread_percentage 100");
    let back = testkit::common::wait_until(Duration::from_secs(12), || {
        crate::tier::stop_if_interrupted();
        calc::one_line(&t.ctl(0, &view, "get_default_active_thread_percentage").out) == "50.0"
    });
    let reads = t.ctl1(0, &view, "get_default_active_thread_percentage");
    let ev = format!("set_default_active_thread_percentage 100 -> '{raise}'; reads '{reads}' after up to 12 s (set back to 50: {back})");
    t.check(
        "INFO",
        "item 6: the supervisor sets back a raised default while control is held",
        &ev,
    );
    let mut entry = Value::Null;
    let _ = testkit::common::wait_until(Duration::from_secs(15), || {
        crate::tier::stop_if_interrupted();
        let status = proc::run(
            Command::new(&t.bins.gpushare)
                .env("GPUSHARE_CONFIG", &cfg)
                .args(["status", "--json"]),
            None,
            Duration::from_secs(30),
            Duration::from_secs(5),
        );
        let v: Value = serde_json::from_str(&status.out).unwrap_or(Value::Null);
        entry = find_id(&v, &d.id).cloned().unwrap_or(Value::Null);
        entry["health"] == "ok"
    });
    let held = std::fs::read_to_string(t.run_dir.join("r4-hold-control.out")).unwrap_or_default();
    let held = held.lines().last().unwrap_or("nothing printed").to_owned();
    let health = entry["health"].as_str().unwrap_or("?").to_owned();
    t.record(json!({"event": "r4_privileged_status", "held": held, "status": entry}));
    let ev = format!(
        "UID {UB} {held} on control; status health '{health}'{}",
        entry["health_reason"]
            .as_str()
            .map_or(String::new(), |r| format!(" ({r})"))
    );
    // Only a tenant that held all 20 tests the check (a daemon whose control is not a
    // stream socket would refuse hold-control's connections).
    let verdict = match (held == "holding 20", health == "ok") {
        (true, true) => "PASS",
        (true, false) => "FAIL",
        (false, _) => "INFO",
    };
    t.check(
        verdict,
        "item 6: the limit check confirms while a tenant holds 20 connections on control",
        &ev,
    );
}

/// The object in `v` (at any depth) with a `health` that names `id` in one of its fields.
fn find_id<'a>(v: &'a Value, id: &str) -> Option<&'a Value> {
    match v {
        Value::Object(m) => {
            if m.contains_key("health") && m.values().any(|x| x.as_str() == Some(id)) {
                return Some(v);
            }
            m.values().find_map(|x| find_id(x, id))
        }
        Value::Array(a) => a.iter().find_map(|x| find_id(x, id)),
        _ => None,
    }
}
