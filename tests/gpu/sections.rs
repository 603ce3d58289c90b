//! The GPU tier's sections, in order, each printing its checks as they are decided:
//! 0. preflight (real GPU): the workload runs as UID 1000;
//! 1. per-user daemons: two UIDs on one GPU start CUDA work at the same time;
//! 2. one shared (plain, root) daemon: the second UID queues behind the first;
//! 3. which multi-user flag the driver accepts (-M, -multiuser-server);
//! 4. gpushare's user-mode = "multi-user" with it;
//! 4. (b) what a non-root client can do to a multi-user daemon (its control commands);
//! 5. enforced limits: 25 % threads slower than 100 %, an allocation beyond the pinned limit
//!    fails, a client's own env cannot raise either; UUID-keyed limits (INFO);
//! 6. the small-batch experiment of NVIDIA's KubeCon NA 2024 GPU-sharing study, plus four
//!    UIDs on one multi-user daemon;
//! 7. the shim's create path: what inventory = "nvml" costs every create with a request;
//! 8. driver-root: the driver's files under a root of their own, as NVIDIA's GPU Operator
//!    lays them out.
//! 9. round 5 (round5.rs): MPS v3's control interface and gpushare's v3 backend (from
//!    driver 615), and an
//!    inference tenant's tail latency beside a training tenant, alone, time-sliced and
//!    through gpushare; then round 4 (round4.rs): what NVML, `terminate_client`, the
//!    thread cap, the watcher and the privileged channel do on a real driver.
//!
//! The restore (8) is `Tier::restore`. Simulated, what needs real CUDA prints
//! `SKIP (simulated)`; everything about daemons, users, queueing, flags, limit read-back and
//! cleanup runs for real against gpushare-mps-sim. The checks, their criteria and evidence
//! are those of scripts/gpu-check, which this replaces (docs/gpu-validation.md).

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::json;

use crate::calc::{self, f2, first_line, fixed, Total};
use crate::opts::Options;
use crate::proc;
use crate::tier::{Daemon, Tier, UA, UB, UIDS};

/// How the sections ended: all of them ran, or one stopped the run on purpose (MIG on,
/// the workload cannot run) with this exit status.
pub enum Ended {
    Done,
    Stop(u8),
}

/// Every section `opts` wants (all of them without `--only`); then, with `--containers`,
/// the containers (containers.rs).
pub fn run(t: &mut Tier, opts: &Options) -> Ended {
    if let Ended::Stop(code) = header(t) {
        return Ended::Stop(code);
    }
    if !t.simulate {
        if let Ended::Stop(code) = preflight(t) {
            return Ended::Stop(code);
        }
    }
    if opts.wants("per-user") {
        per_user(t);
    }
    if opts.wants("shared") {
        shared(t);
    }
    // Without section 3, the configured default (accepted by every driver seen so far).
    let flag = if opts.wants("flags") {
        multi_user_flags(t)
    } else {
        "-M".to_owned()
    };
    if opts.wants("multi-user") {
        gpushare_multi_user(t, &flag);
    }
    if opts.wants("tenant-control") {
        tenant_control(t, &flag);
    }
    if opts.wants("limits") {
        limits(t);
    }
    if opts.wants("uuid-limit") {
        uuid_limit(t);
    }
    if opts.wants("small-batch") {
        kubecon(t, &flag);
    }
    if opts.wants("create-path") {
        create_path(t);
    }
    if opts.wants("driver-root") {
        driver_root(t);
    }
    crate::round5::run(t, opts, &flag);
    crate::round4::run(t, opts, &flag);
    if opts.containers {
        crate::containers::run(t, opts);
    }
    println!();
    println!("{}: all sections done", crate::tier::ME);
    Ended::Done
}

fn header(t: &mut Tier) -> Ended {
    let mode = if t.simulate {
        "SIMULATE mode (gpushare-mps-sim, no GPU)"
    } else {
        "real GPU"
    };
    t.section(&format!("gpu tier {}: {mode}", t.run_id));
    let g = t.gpu.clone();
    println!(
        "gpu 0: {} ({}), driver {}, compute mode {}, MIG {}",
        g.name, g.uuid, g.driver, g.compute_mode, g.mig_mode
    );
    println!(
        "control binary: {} (-v: {}); gpushare: {}; work dir: {}",
        t.control.display(),
        if t.ctl_version.is_empty() {
            "no answer"
        } else {
            &t.ctl_version
        },
        t.bins.gpushare.display(),
        t.work.display()
    );
    let gpus = t
        .gpu_state_before
        .clone()
        .unwrap_or_else(|| "simulated".into());
    let fields = json!({"event": "run", "gpu": g.name, "uuid": g.uuid, "driver": g.driver,
        "compute_mode": g.compute_mode, "mig_mode": g.mig_mode, "memory": g.memory,
        "control": t.control.display().to_string(), "control_version": t.ctl_version,
        "hold_s": t.hold, "iterations": t.iterations, "gpus": gpus});
    t.record(fields);
    if t.simulate {
        return Ended::Done;
    }
    if g.mig_mode.starts_with("Enabled") {
        t.check(
            "SKIP",
            "whole tier",
            "MIG is enabled on GPU 0; this tier needs a whole GPU and never changes MIG",
        );
        return Ended::Stop(0);
    }
    if g.compute_mode != "Default" {
        let ev = format!("GPU 0 is in {}, not Default: per-user daemons and time-slicing are expected to fail (left as it is)", g.compute_mode);
        t.check("INFO", "compute mode", &ev);
    }
    let apps = smi(&[
        "--query-compute-apps=pid,process_name",
        "--format=csv,noheader",
    ]);
    if !apps.trim().is_empty() {
        let ev = format!(
            "already running (timings may suffer): {}",
            first_line(&apps, 220)
        );
        t.check("INFO", "other GPU processes", &ev);
    }
    if Path::new("/tmp/nvidia-mps/control").exists() {
        t.check("INFO", "host MPS daemon", "/tmp/nvidia-mps/control exists: a system MPS daemon may be running (this run never uses it)");
    }
    Ended::Done
}

/// `nvidia-smi ARGS` (stdout and stderr), never failing.
fn smi(args: &[&str]) -> String {
    proc::run(
        Command::new("nvidia-smi").args(args),
        None,
        Duration::from_secs(30),
        Duration::from_secs(5),
    )
    .out
}

fn preflight(t: &mut Tier) -> Ended {
    t.section(&format!("0. preflight: the workload as UID {UA}"));
    t.py = match t.python_arg.clone() {
        Some(p) => p,
        None => {
            let r = proc::run(
                Command::new("python3").args(["-c", "import sys; print(sys.executable)"]),
                None,
                Duration::from_secs(30),
                Duration::from_secs(5),
            );
            PathBuf::from(r.out.trim())
        }
    };
    let uuid = t.gpu.uuid.clone();
    let nomps = t.work.join("nomps");
    let cmd = t.workload_cmd(&["probe"]);
    t.launch(
        "probe",
        UA,
        Some(&nomps),
        None,
        300.0,
        &[("CUDA_VISIBLE_DEVICES", &uuid)],
        cmd,
    );
    t.wait_done(310.0, &["probe"]);
    let probe = t.collect("probe", UA, "preflight");
    let py = t.py.display().to_string();
    if probe.ok() {
        let ev = format!(
            "{}, {py}, first kernel after {}s",
            probe.text("device"),
            f2(probe.num("first_kernel_latency_s"))
        );
        t.check("PASS", &format!("workload runs as UID {UA} (no MPS)"), &ev);
        Ended::Done
    } else {
        let ev = format!(
            "{py}: {} (pass --python with a torch every UID can run)",
            probe.error()
        );
        t.check("FAIL", &format!("workload runs as UID {UA} (no MPS)"), &ev);
        Ended::Stop(1)
    }
}

fn start_pair(t: &mut Tier, cfg: &Path, a: &[&str], b: &[&str]) -> (Daemon, Option<Daemon>) {
    let da = t.gs_start(cfg, a);
    if !da.ok {
        return (da, None);
    }
    let db = t.gs_start(cfg, b);
    (da, Some(db))
}

/// Clients of UIDs `UA` and `UB` at once, each running `cmd` on its daemon (`a`, `b`; one
/// daemon for both where they share it), labelled `la` and `lb`.
fn launch_two_users(
    t: &mut Tier,
    (la, a): (&str, &Daemon),
    (lb, b): (&str, &Daemon),
    timeout_s: f64,
    cmd: Vec<OsString>,
) {
    for (label, uid, d) in [(la, UA, a), (lb, UB, b)] {
        t.launch(
            label,
            uid,
            Some(&d.pipe),
            Some(&d.shm),
            timeout_s,
            &[],
            cmd.clone(),
        );
    }
}

fn per_user(t: &mut Tier) {
    t.section(&format!(
        "1. per-user daemons: UIDs {UA} and {UB} on one GPU at the same time"
    ));
    let cfg = t.cfg.clone();
    let (ua, ub) = (UA.to_string(), UB.to_string());
    let (da, db) = start_pair(t, &cfg, &["--uid", &ua], &["--uid", &ub]);
    let db = match db {
        Some(db) if db.ok => db,
        other => {
            let ev = first_line(
                &format!("{} {}", da.out, other.map(|d| d.out).unwrap_or_default()),
                220,
            );
            t.check(
                "FAIL",
                &format!("gpushare daemon start, UIDs {UA} and {UB}"),
                &ev,
            );
            t.gs_stop(&[&da.id]);
            return;
        }
    };
    let ev = format!(
        "daemons {} ({} ms) and {} ({} ms)",
        da.id, da.ms, db.id, db.ms
    );
    t.check(
        "PASS",
        &format!("gpushare daemon start, UIDs {UA} and {UB}"),
        &ev,
    );
    let hold = t.hold;
    let (la, lb) = (format!("pu-{UA}"), format!("pu-{UB}"));
    let cmd = t.client_cmd(hold);
    launch_two_users(t, (&la, &da), (&lb, &db), t.tmo(hold), cmd);
    let mut servers = String::new();
    let (mut sa, mut sb) = (String::new(), String::new());
    if t.wait_attached(t.tmo(hold), &la) && t.wait_attached(t.tmo(hold), &lb) {
        sa = t.ctl1(UA, &da.pipe, "get_server_list");
        sb = t.ctl1(UB, &db.pipe, "get_server_list");
        let none = |s: &str| {
            if s.is_empty() {
                "none".to_owned()
            } else {
                s.to_owned()
            }
        };
        servers = format!(
            "daemon of {UA}: server {}; daemon of {UB}: server {}",
            none(&sa),
            none(&sb)
        );
        if !t.simulate {
            let apps = smi(&[
                "--query-compute-apps=pid,process_name,used_memory",
                "--format=csv,noheader",
            ])
            .replace('\n', ";");
            t.record(json!({"event": "nvidia_smi_apps", "section": "per-user", "output": apps}));
            servers.push_str(&format!("; nvidia-smi: {apps}"));
        }
    }
    t.wait_done(t.tmo(hold), &[&la, &lb]);
    let a = t.collect(&la, UA, "per-user");
    let b = t.collect(&lb, UB, "per-user");
    if a.ok() && b.ok() {
        let ov = calc::overlap(&a.times(), &b.times());
        let mut ev = format!(
            "first kernel after {}s (UID {UA}) and {}s (UID {UB}); both computing for {}s",
            f2(a.num("first_kernel_latency_s")),
            f2(b.num("first_kernel_latency_s")),
            f2(ov)
        );
        if t.simulate {
            ev.push_str(&format!(
                "; waited_ms {}/{}",
                a.text("waited_ms"),
                b.text("waited_ms")
            ));
        }
        let status = if ov.is_some_and(|o| o > 0.0) {
            "PASS"
        } else {
            "FAIL"
        };
        t.check(status, "per-user: both UIDs start at once", &ev);
        let numeric = |s: &str| !s.is_empty() && s.bytes().all(|c| c.is_ascii_digit());
        let mode = t.gpu.compute_mode.clone();
        if numeric(&sa) && numeric(&sb) && sa != sb {
            t.check(
                "PASS",
                "two MPS servers of two users side by side",
                &format!("compute mode {mode}; {servers}"),
            );
        } else {
            let seen = if servers.is_empty() {
                "no server list read while both ran".to_owned()
            } else {
                servers
            };
            let clients = if a.text("server_pid").is_empty() {
                String::new()
            } else {
                format!(
                    " (client servers {}/{})",
                    a.text("server_pid"),
                    b.text("server_pid")
                )
            };
            t.check(
                "FAIL",
                "two MPS servers of two users side by side",
                &format!("compute mode {mode}; {seen}{clients}"),
            );
        }
    } else {
        let ev = format!("UID {UA}: {}; UID {UB}: {}", a.error(), b.error());
        t.check("FAIL", "per-user: both UIDs start at once", &ev);
    }
    // What a client that does NOT share the daemon's /dev/shm gets (ipc=isolated needs the
    // mount).
    let cmd = t.client_cmd(0.5);
    let noshm_tmo = if t.simulate { 20.0 } else { 90.0 };
    let label = format!("noshm-{UA}");
    t.launch(&label, UA, Some(&da.pipe), None, noshm_tmo, &[], cmd);
    t.wait_done(noshm_tmo, &[&label]);
    let n = t.collect(&label, UA, "per-user");
    let ev = if n.ok() {
        "works: rc 0 (so /dev/shm need not be shared with this driver)".to_owned()
    } else {
        format!("fails: rc {}: {}", n.text("rc"), calc::cut(&n.error(), 160))
    };
    t.check("INFO", "client without the daemon's /dev/shm", &ev);
    t.gs_stop(&[&da.id, &db.id]);
}

fn shared(t: &mut Tier) {
    t.section(&format!(
        "2. contrast: UIDs {UA} and {UB} on one shared (plain) MPS daemon"
    ));
    let name = "shared daemon: second UID queues";
    let hand = t.hand_start("shared", &[]);
    if !hand.ok {
        let ev = format!(
            "nvidia-cuda-mps-control -d did not start (rc {}): {}",
            hand.rc, hand.out
        );
        t.check("FAIL", name, &ev);
        return;
    }
    let sp = hand.pipe.clone();
    let hold = t.hold;
    let (la, lb) = (format!("sh-{UA}"), format!("sh-{UB}"));
    let cmd = t.client_cmd(hold);
    t.launch(&la, UA, Some(&sp), None, t.tmo(hold), &[], cmd);
    if t.wait_attached(t.tmo(hold), &la) {
        let cmd = t.client_cmd(0.5);
        t.launch(&lb, UB, Some(&sp), None, t.tmo(2.0 * hold), &[], cmd);
        t.wait_done(t.tmo(2.0 * hold), &[&la, &lb]);
        let a = t.collect(&la, UA, "shared");
        let b = t.collect(&lb, UB, "shared");
        if a.ok() && b.ok() {
            let (at, bt) = (a.times(), b.times());
            let sub = |x: Option<f64>, y: Option<f64>| x.zip(y).map(|(x, y)| x - y);
            let waited = sub(bt.t_first_kernel, bt.t_launch);
            let behind = sub(bt.t_first_kernel, at.t_end);
            let mut ev = format!(
                "UID {UB} launched {}s after UID {UA}'s first kernel, got its first kernel {}s after launch, {}s after UID {UA} ended",
                f2(sub(bt.t_launch, at.t_first_kernel)),
                f2(waited),
                f2(behind)
            );
            if t.simulate {
                ev.push_str(&format!("; waited_ms {}", b.text("waited_ms")));
            }
            if behind.is_some_and(|b| b > -0.5) {
                t.check("PASS", name, &ev);
            } else {
                ev.push_str(&format!(" (expected it to wait for UID {UA} to finish)"));
                t.check("FAIL", name, &ev);
            }
        } else {
            let ev = format!("UID {UA}: {}; UID {UB}: {}", a.error(), b.error());
            t.check("FAIL", name, &ev);
        }
    } else {
        t.wait_done(5.0, &[&la]);
        let a = t.collect(&la, UA, "shared");
        t.check("FAIL", name, &format!("UID {UA} never ran: {}", a.error()));
    }
    t.quit_hand_daemon(&hand.dir);
}

/// Section 3; returns the flag section 4 uses (the first accepted, else -M).
fn multi_user_flags(t: &mut Tier) -> String {
    t.section("3. which multi-user flag the control daemon accepts");
    let mut accepted: Vec<&str> = Vec::new();
    for flag in ["-M", "-multiuser-server"] {
        let name = format!(
            "mu{}",
            flag.chars()
                .filter(char::is_ascii_lowercase)
                .collect::<String>()
        );
        let check = format!("control -d {flag}");
        let hand = t.hand_start(&name, &[flag]);
        if hand.ok {
            let mp = hand.pipe.clone();
            let hold = t.hold;
            let (la, lb) = (format!("{name}-{UA}"), format!("{name}-{UB}"));
            let cmd = t.client_cmd(hold);
            t.launch(&la, UA, Some(&mp), None, t.tmo(hold), &[], cmd.clone());
            t.launch(&lb, UB, Some(&mp), None, t.tmo(2.0 * hold), &[], cmd);
            t.wait_done(t.tmo(2.0 * hold), &[&la, &lb]);
            let a = t.collect(&la, UA, "multi-user-flag");
            let b = t.collect(&lb, UB, "multi-user-flag");
            let log = std::fs::read_to_string(hand.dir.join("log/control.log")).unwrap_or_default();
            let users = calc::from_user_counts(&log);
            let users = if users.is_empty() {
                "n/a".to_owned()
            } else {
                users
            };
            if a.ok() && b.ok() {
                let ov = calc::overlap(&a.times(), &b.times());
                let mut detail = format!("both computing for {}s", f2(ov));
                if t.simulate {
                    detail.push_str(&format!(
                        "; servers {}/{} of UID {}",
                        a.text("server_pid"),
                        b.text("server_pid"),
                        a.text("server_uid")
                    ));
                }
                if ov.is_some_and(|o| o > 0.0) {
                    accepted.push(flag);
                    let ev = format!(
                        "starts; UIDs {UA} and {UB} served at once: {detail}; control.log: {users}"
                    );
                    t.check("INFO", &check, &ev);
                } else {
                    let ev = format!("starts, but UIDs are served one after the other ({detail}); control.log: {users}");
                    t.check("INFO", &check, &ev);
                }
            } else {
                let ev = format!(
                    "starts; clients failed: {} / {}",
                    calc::cut(&a.error(), 100),
                    calc::cut(&b.error(), 100)
                );
                t.check("INFO", &check, &ev);
            }
        } else {
            let ev = format!("does not start (rc {}): {}", hand.rc, hand.out);
            t.check("INFO", &check, &ev);
        }
        t.quit_hand_daemon(&hand.dir);
    }
    t.record(json!({"event": "multi_user_flags", "accepted": accepted.join(" ")}));
    if accepted.is_empty() {
        t.check(
            "FAIL",
            "a multi-user flag works",
            "neither -M nor -multiuser-server served two UIDs at once",
        );
    } else {
        let ev = format!("accepted: {}", accepted.join(" "));
        t.check("PASS", "a multi-user flag works", &ev);
    }
    let name = "config default multi-user-flag = \"-M\" works";
    if accepted.contains(&"-M") {
        let ev = format!("accepted by driver {}", t.gpu.driver);
        t.check("PASS", name, &ev);
    } else {
        let list = if accepted.is_empty() {
            "none".to_owned()
        } else {
            accepted.join(" ")
        };
        t.check("FAIL", name, &format!("not accepted; accepted: {list}"));
    }
    accepted.first().copied().unwrap_or("-M").to_owned()
}

fn gpushare_multi_user(t: &mut Tier, flag: &str) {
    t.section(&format!(
        "4. gpushare user-mode = \"multi-user\" (multi-user-flag = \"{flag}\")"
    ));
    let cfg_mu = t.work.join("runtime-multi-user.toml");
    if let Err(e) = std::fs::write(&cfg_mu, t.config("multi-user", Some(flag))) {
        t.check(
            "FAIL",
            "gpushare multi-user: daemon start",
            &format!("config: {e}"),
        );
        return;
    }
    let dm = t.gs_start(&cfg_mu, &[]);
    if !dm.ok {
        let ev = first_line(&dm.out, 220);
        t.check("FAIL", "gpushare multi-user: daemon start", &ev);
        return;
    }
    let hold = t.hold;
    let (la, lb) = (format!("gm-{UA}"), format!("gm-{UB}"));
    let cmd = t.client_cmd(hold);
    launch_two_users(t, (&la, &dm), (&lb, &dm), t.tmo(hold), cmd);
    let mut servers = String::new();
    if t.wait_attached(t.tmo(hold), &la) && t.wait_attached(t.tmo(hold), &lb) {
        servers = t.ctl1(0, &dm.pipe, "get_server_list");
    }
    t.wait_done(t.tmo(hold), &[&la, &lb]);
    let a = t.collect(&la, UA, "gpushare-multi-user");
    let b = t.collect(&lb, UB, "gpushare-multi-user");
    let name = "gpushare multi-user: both UIDs at once";
    if a.ok() && b.ok() {
        let ov = calc::overlap(&a.times(), &b.times());
        let mut ev = format!(
            "daemon {} ({} ms); both computing for {}s; server(s) while both ran: {}",
            dm.id,
            dm.ms,
            f2(ov),
            if servers.is_empty() { "?" } else { &servers }
        );
        if t.simulate {
            ev.push_str(&format!(
                "; client servers {}/{} of UID {}",
                a.text("server_pid"),
                b.text("server_pid"),
                a.text("server_uid")
            ));
        }
        let status = if ov.is_some_and(|o| o > 0.0) {
            "PASS"
        } else {
            "FAIL"
        };
        t.check(status, name, &ev);
    } else {
        let ev = format!("UID {UA}: {}; UID {UB}: {}", a.error(), b.error());
        t.check("FAIL", name, &ev);
    }
    t.gs_stop(&[&dm.id]);
}

/// Section 4b: what a non-root client of a multi-user daemon can do to it and to the other
/// users' work: each control command as UID 1000 against a daemon gpushare started with a
/// 50 % default, while UID 2000's client computes on it. Informative: the answers are the
/// driver's, and SECURITY.md's multi-user table follows from them.
fn tenant_control(t: &mut Tier, flag: &str) {
    t.section(&format!(
        "4b. what a non-root client can do to a multi-user daemon (multi-user-flag = \"{flag}\")"
    ));
    let cfg_mu = t.work.join("runtime-tenant-control.toml");
    if let Err(e) = std::fs::write(&cfg_mu, t.config("multi-user", Some(flag))) {
        t.check(
            "FAIL",
            "tenant control: daemon start",
            &format!("config: {e}"),
        );
        return;
    }
    let dm = t.gs_start(&cfg_mu, &["--active-thread-percentage", "50"]);
    if !dm.ok {
        let ev = first_line(&dm.out, 220);
        t.check("FAIL", "tenant control: daemon start", &ev);
        return;
    }
    let listing: Vec<String> = std::fs::read_dir(&dm.pipe)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| {
            let m = e.metadata().ok();
            let (mode, uid) = m
                .map(|m| {
                    use std::os::unix::fs::MetadataExt;
                    (m.mode(), m.uid())
                })
                .unwrap_or_default();
            format!("{} {:o} uid {uid}", e.file_name().to_string_lossy(), mode)
        })
        .collect();
    let privileged = dm.pipe.join("control_privileged");
    t.check(
        "INFO",
        "multi-user pipe directory",
        &format!(
            "{}; control_privileged {}",
            listing.join(", "),
            if privileged.exists() {
                "exists"
            } else {
                "absent"
            }
        ),
    );
    // UID 2000's client holds a server while UID 1000 issues the commands.
    let hold = if t.simulate {
        9.0
    } else {
        t.hold.max(4.0) + 8.0
    };
    let lb = format!("tc-{UB}");
    let cmd = t.client_cmd(hold);
    t.launch(
        &lb,
        UB,
        Some(&dm.pipe),
        Some(&dm.shm),
        t.tmo(hold),
        &[],
        cmd,
    );
    let attached = t.wait_attached(t.tmo(hold), &lb);
    let root = |t: &Tier, c: &str| t.ctl1(0, &dm.pipe, c);
    let servers = root(t, "get_server_list");
    let srv = servers.split_whitespace().next().unwrap_or("").to_owned();
    let mut ev = vec![format!(
        "UID {UB}'s client attached: {attached}; servers '{servers}'"
    )];
    let as_a = |t: &Tier, c: &str| t.ctl1(UA, &dm.pipe, c);
    ev.push(format!(
        "get_server_list -> '{}'",
        as_a(t, "get_server_list")
    ));
    let r = as_a(t, "set_default_active_thread_percentage 10");
    ev.push(format!(
        "set_default_active_thread_percentage 10 -> '{r}', root reads '{}'",
        root(t, "get_default_active_thread_percentage")
    ));
    if !srv.is_empty() {
        let r = as_a(t, &format!("set_active_thread_percentage {srv} 10"));
        ev.push(format!(
            "set_active_thread_percentage {srv} 10 -> '{r}', root reads '{}'",
            root(t, &format!("get_active_thread_percentage {srv}"))
        ));
        let r = as_a(t, &format!("set_device_pinned_mem_limit {srv} 0 1G"));
        ev.push(format!(
            "set_device_pinned_mem_limit {srv} 0 1G -> '{r}', root reads '{}'",
            root(t, &format!("get_device_pinned_mem_limit {srv} 0"))
        ));
    }
    t.check(
        "INFO",
        "tenant control: limit commands as UID 1000",
        &ev.join("; "),
    );
    // What the supervisor made of it (its check runs every 2 s).
    crate::tier::pause(Duration::from_secs(5));
    let after = root(t, "get_default_active_thread_percentage");
    let srv_after = if srv.is_empty() {
        String::new()
    } else {
        root(t, &format!("get_active_thread_percentage {srv}"))
    };
    t.check(
        "INFO",
        "tenant control: 5 s later",
        &format!("default reads '{after}', server {srv} reads '{srv_after}'"),
    );
    if privileged.exists() {
        // Can UID 1000 connect to control_privileged at all? (The nvidia-cuda-mps-control
        // client has no switch to use it.)
        let script = "import socket,sys\ns=socket.socket(socket.AF_UNIX,socket.SOCK_SEQPACKET)\ntry:\n s.connect(sys.argv[1]); print('connected')\nexcept OSError as e: print('refused:', e)";
        let mut c = Command::new(&t.py);
        {
            use std::os::unix::process::CommandExt;
            c.arg("-c").arg(script).arg(&privileged).uid(UA).gid(UA);
        }
        let r = proc::run(
            &mut c,
            None,
            Duration::from_secs(20),
            Duration::from_secs(2),
        );
        t.check(
            "INFO",
            "tenant control: connect to control_privileged as UID 1000",
            &first_line(&r.out, 200),
        );
        // What the supervisor's limit check relies on (docs/mps.md, "The privileged
        // channel"): root's commands answered through its privileged view, whose
        // `control` and `control_privileged` lead to the daemon's `control_privileged`.
        let view = dm.pipe.with_file_name("priv");
        let read = "get_default_active_thread_percentage";
        let set = "set_default_active_thread_percentage 50";
        t.check(
            "INFO",
            "tenant control: root through control_privileged",
            &format!(
                "{read} -> '{}'; {set} -> '{}'",
                t.ctl1(0, &view, read),
                t.ctl1(0, &view, set)
            ),
        );
    }
    let mut ev = Vec::new();
    if !srv.is_empty() {
        let r = as_a(t, &format!("shutdown_server {srv} -f"));
        crate::tier::pause(Duration::from_secs(1));
        ev.push(format!(
            "shutdown_server {srv} -f -> '{r}'; servers after: '{}'",
            root(t, "get_server_list")
        ));
    }
    let r = as_a(t, "quit");
    crate::tier::pause(Duration::from_secs(1));
    let alive = t.ctl(0, &dm.pipe, "get_server_list");
    ev.push(format!(
        "quit -> '{r}'; the daemon then answers root: {} ('{}')",
        alive.ok(),
        calc::cut(&alive.out.replace('\n', " "), 80)
    ));
    t.check(
        "INFO",
        "tenant control: shutdown and quit as UID 1000",
        &ev.join("; "),
    );
    t.wait_done(t.tmo(hold), &[&lb]);
    let b = t.collect(&lb, UB, "tenant-control");
    let ev = if b.ok() {
        "ran to its end".to_owned()
    } else {
        format!("failed: {}", calc::cut(&b.error(), 200))
    };
    t.check("INFO", &format!("tenant control: UID {UB}'s client"), &ev);
    let status = proc::run(
        Command::new(&t.bins.gpushare)
            .env("GPUSHARE_CONFIG", &cfg_mu)
            .args(["status"]),
        None,
        Duration::from_secs(30),
        Duration::from_secs(5),
    );
    println!("-- gpushare status after the commands");
    print!("{}", status.out);
    t.gs_stop(&[&dm.id]);
}

fn limits(t: &mut Tier) {
    t.section(&format!("5. enforced limits (UID {UA})"));
    let cfg = t.cfg.clone();
    let ua = UA.to_string();
    let mut started = Vec::new();
    for args in [
        vec!["--uid", &ua, "--active-thread-percentage", "25"],
        vec!["--uid", &ua, "--active-thread-percentage", "100"],
        vec!["--uid", &ua, "--pinned-memory-limit", "2G"],
    ] {
        let d = t.gs_start(&cfg, &args);
        let ok = d.ok;
        started.push(d);
        if !ok {
            break;
        }
    }
    if started.len() < 3 || !started.iter().all(|d| d.ok) {
        let outs: Vec<String> = started.iter().map(|d| d.out.clone()).collect();
        let ev = first_line(&outs.join(" "), 220);
        t.check("FAIL", "gpushare daemon start with limits", &ev);
        let ids: Vec<&str> = started.iter().map(|d| d.id.as_str()).collect();
        t.gs_stop(&ids);
        return;
    }
    let (l25, l100, lm) = (started[0].clone(), started[1].clone(), started[2].clone());
    let uuid = t.gpu.uuid.clone();
    let rb_tp = t.ctl1(UA, &l25.pipe, "get_default_active_thread_percentage");
    let rb_mem = t.ctl1(UA, &lm.pipe, "get_default_device_pinned_mem_limit 0");
    let rb_mem_uuid = t.ctl1(
        UA,
        &lm.pipe,
        &format!("get_default_device_pinned_mem_limit {uuid}"),
    );
    t.record(
        json!({"event": "read_back", "active_thread_percentage_25": rb_tp,
        "pinned_mem_limit_2G_ordinal": rb_mem, "pinned_mem_limit_2G_uuid": rb_mem_uuid}),
    );
    let ev = format!("get_default_active_thread_percentage -> '{rb_tp}'; get_default_device_pinned_mem_limit 0 -> '{rb_mem}'; … {uuid} -> '{rb_mem_uuid}'");
    t.check("INFO", "read-back formats", &ev);
    if calc::is_25(&rb_tp) {
        t.check(
            "PASS",
            "daemon default threads set by gpushare",
            &format!("reads back {rb_tp}"),
        );
    } else {
        let ev = format!("reads back '{rb_tp}', expected 25");
        t.check("FAIL", "daemon default threads set by gpushare", &ev);
    }
    if t.simulate {
        limits_simulated(t, &l25, &lm);
    } else {
        limits_real(t, &l25, &l100, &lm);
    }
    t.gs_stop(&[&l25.id, &l100.id, &lm.id]);
}

fn limits_simulated(t: &mut Tier, l25: &Daemon, lm: &Daemon) {
    let cmd = t.client_cmd(0.2);
    let tmo = t.tmo(1.0);
    t.launch(
        "lim25",
        UA,
        Some(&l25.pipe),
        Some(&l25.shm),
        tmo,
        &[],
        cmd.clone(),
    );
    let raise_tp = [("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "100")];
    t.launch(
        "lim25env",
        UA,
        Some(&l25.pipe),
        Some(&l25.shm),
        tmo,
        &raise_tp,
        cmd.clone(),
    );
    let raise_mem = [("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=8G")];
    t.launch(
        "memenv",
        UA,
        Some(&lm.pipe),
        Some(&lm.shm),
        tmo,
        &raise_mem,
        cmd,
    );
    t.wait_done(tmo, &["lim25", "lim25env", "memenv"]);
    let lim25 = t.collect("lim25", UA, "limits");
    let lim25env = t.collect("lim25env", UA, "limits");
    let memenv = t.collect("memenv", UA, "limits");
    let tp = lim25.text("active_thread_percentage");
    let tpe = lim25env.text("active_thread_percentage");
    let me = memenv.text("pinned_mem_limit");
    let name = "client of the 25 % daemon gets 25 %";
    if calc::is_25(&tp) {
        t.check(
            "PASS",
            name,
            &format!("client reports active_thread_percentage={tp}"),
        );
    } else {
        let ev = format!("client reports '{tp}' {}", lim25.error());
        t.check("FAIL", name, &ev);
    }
    let name = "client env cannot raise threads";
    if calc::is_25(&tpe) {
        let ev = format!("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100 -> active_thread_percentage={tpe}");
        t.check("PASS", name, &ev);
    } else {
        let ev = format!(
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100 -> '{tpe}' {}",
            lim25env.error()
        );
        t.check("FAIL", name, &ev);
    }
    let name = "client env cannot raise pinned memory";
    if me == "0=2048M" {
        let ev = format!("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=8G -> pinned_mem_limit={me}");
        t.check("PASS", name, &ev);
    } else {
        let ev = format!(
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=8G -> '{me}' {}",
            memenv.error()
        );
        t.check("FAIL", name, &ev);
    }
    t.skip_sim(
        "25 % daemon measurably slower than 100 %",
        "needs CUDA kernels",
    );
    t.skip_sim(
        "allocation beyond the pinned limit fails",
        "needs CUDA allocations",
    );
}

fn limits_real(t: &mut Tier, l25: &Daemon, l100: &Daemon, lm: &Daemon) {
    let lim_s = (t.hold.max(5.0) * 10.0).round() / 10.0;
    let lim_arg = format!("{lim_s}");
    let big = [
        "matmul",
        "--size",
        "8192",
        "--seconds",
        &lim_arg,
        "--batch",
        "5",
    ];
    let raise_tp = [("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "100")];
    for (label, d, env) in [
        ("lim100", l100, &[][..]),
        ("lim25", l25, &[][..]),
        ("lim25env", l25, &raise_tp[..]),
    ] {
        let cmd = t.workload_cmd(&big);
        t.launch(
            label,
            UA,
            Some(&d.pipe),
            Some(&d.shm),
            t.tmo(lim_s),
            env,
            cmd,
        );
        t.wait_done(t.tmo(lim_s), &[label]);
        t.collect(label, UA, "limits");
    }
    let (r100, r25, r25e) = (t.r("lim100"), t.r("lim25"), t.r("lim25env"));
    let (i100, i25, i25e) = (
        r100.num("iters_per_s"),
        r25.num("iters_per_s"),
        r25e.num("iters_per_s"),
    );
    let ratio = |a: Option<f64>, b: Option<f64>| a.zip(b).map(|(a, b)| a / b);
    let slower = |x: Option<f64>| x.zip(i100).is_some_and(|(x, full)| x < 0.6 * full);
    let name = "25 % daemon measurably slower than 100 %";
    if slower(i25) {
        let ev = format!(
            "8192² fp32: 100 % {}/s ({} TFLOP/s), 25 % {}/s: ratio {}",
            f2(i100),
            f2(r100.num("tflops")),
            f2(i25),
            f2(ratio(i25, i100))
        );
        t.check("PASS", name, &ev);
    } else {
        let or = |v: Option<f64>, e: String| v.map_or(e, |v| format!("{v:.6}"));
        let ev = format!(
            "100 %: {}; 25 %: {} it/s",
            or(i100, r100.error()),
            or(i25, r25.error())
        );
        t.check("FAIL", name, &ev);
    }
    let name = "client env cannot raise threads";
    if slower(i25e) {
        let ev = format!(
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100 on the 25 % daemon: {}/s, ratio {}",
            f2(i25e),
            f2(ratio(i25e, i100))
        );
        t.check("PASS", name, &ev);
    } else {
        let ev = format!(
            "with env: {} it/s vs 100 %: {}",
            i25e.map_or(r25e.error(), |v| format!("{v:.6}")),
            i100.map_or("?".to_owned(), |v| format!("{v:.6}"))
        );
        t.check("FAIL", name, &ev);
    }
    const G: u64 = 1 << 30;
    let raise_mem = [("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=8G")];
    for (label, d, bytes, env) in [
        ("mem1g", lm, G, &[][..]),
        ("mem4g", lm, 4 * G, &[][..]),
        ("memenv", lm, 4 * G, &raise_mem[..]),
        ("mem4g-nolimit", l100, 4 * G, &[][..]),
    ] {
        let cmd = t.workload_cmd(&["alloc", "--bytes", &bytes.to_string()]);
        t.launch(label, UA, Some(&d.pipe), Some(&d.shm), t.tmo(5.0), env, cmd);
        t.wait_done(t.tmo(5.0), &[label]);
        t.collect(label, UA, "limits");
    }
    let (m1, m4, me, mn) = (
        t.r("mem1g"),
        t.r("mem4g"),
        t.r("memenv"),
        t.r("mem4g-nolimit"),
    );
    let name = "allocation beyond the pinned limit fails";
    if m4.text("ok") == "0" && m1.ok() && mn.ok() {
        let ev = format!(
            "2G limit: 1 GiB ok, 4 GiB refused ({}); 4 GiB ok without a limit",
            calc::cut(&m4.error(), 120)
        );
        t.check("PASS", name, &ev);
    } else {
        let ev = format!(
            "1 GiB ok={}, 4 GiB ok={}, 4 GiB without limit ok={}: {}{}",
            m1.text("ok"),
            m4.text("ok"),
            mn.text("ok"),
            m4.error(),
            calc::cut(&m1.error(), 80)
        );
        t.check("FAIL", name, &ev);
    }
    let name = "client env cannot raise pinned memory";
    if me.text("ok") == "0" && mn.ok() {
        t.check(
            "PASS",
            name,
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=8G: 4 GiB still refused",
        );
    } else {
        let ev = format!(
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=8G: 4 GiB ok={} {}",
            me.text("ok"),
            calc::cut(&me.error(), 80)
        );
        t.check("FAIL", name, &ev);
    }
}

/// UUID-keyed limits: the open question (NVIDIA's device plugin found them ignored;
/// gpushare therefore sets limits by ordinal). Informative only.
fn uuid_limit(t: &mut Tier) {
    let name = "UUID-keyed pinned memory limit";
    if t.simulate {
        t.skip_sim(name, "the simulator accepts any key");
        return;
    }
    let hand = t.hand_start("uuidlimit", &[]);
    if hand.ok {
        let uuid = t.gpu.uuid.clone();
        let set = t.ctl1(
            0,
            &hand.pipe,
            &format!("set_default_device_pinned_mem_limit {uuid} 2G"),
        );
        let rb = t.ctl1(
            0,
            &hand.pipe,
            &format!("get_default_device_pinned_mem_limit {uuid}"),
        );
        let rb0 = t.ctl1(0, &hand.pipe, "get_default_device_pinned_mem_limit 0");
        let cmd = t.workload_cmd(&["alloc", "--bytes", &(4u64 << 30).to_string()]);
        t.launch("uuid4g", UA, Some(&hand.pipe), None, t.tmo(5.0), &[], cmd);
        t.wait_done(t.tmo(5.0), &["uuid4g"]);
        let r = t.collect("uuid4g", UA, "uuid-limit");
        let verdict = if r.text("ok") == "0" {
            "enforced (4 GiB refused)"
        } else {
            "NOT enforced (4 GiB allocated)"
        };
        let ev = format!(
            "set by UUID: '{set}'; reads back '{rb}' by UUID, '{rb0}' by ordinal; {verdict}"
        );
        t.check("INFO", name, &ev);
    } else {
        let ev = format!("control daemon did not start: {}", hand.out);
        t.check("INFO", name, &ev);
    }
    t.quit_hand_daemon(&hand.dir);
}

/// One KubeCon configuration's report: the JSON line and an INFO (or FAIL) check; its
/// total.
fn kc_report(t: &mut Tier, how: Total, name: &str, labels: &[String]) -> Option<f64> {
    let runs: Vec<calc::Times> = labels.iter().map(|l| t.r(l).times()).collect();
    let s = calc::span(how, &runs);
    let total = s.total_s.map(|v| calc::round(v, 2));
    let gpu = s.sum_first_kernel_to_end_s.map(|v| calc::round(v, 2));
    t.record(json!({"event": "kubecon", "config": name, "total_s": total,
        "total_is": how.what(), "sum_first_kernel_to_end_s": gpu, "all_ok": s.all_ok,
        "iterations": t.iterations}));
    let check = format!("small batch: {name}");
    if s.all_ok {
        let ev = format!(
            "total {}s ({}); first kernel to end, summed over the 4: {}s",
            f2(total),
            how.what(),
            f2(gpu)
        );
        t.check("INFO", &check, &ev);
        total
    } else {
        let errors: String = labels.iter().map(|l| t.r(l).error()).collect();
        let ev = format!("a process failed: {}", calc::cut(&errors, 200));
        t.check("FAIL", &check, &ev);
        None
    }
}

fn kubecon(t: &mut Tier, flag: &str) {
    let n = t.iterations;
    t.section(&format!(
        "6. small-batch experiment (KubeCon NA 2024): 4 processes x {n} 256x256 fp32 products"
    ));
    if t.simulate {
        for name in [
            "small batch: one process alone x4",
            "small batch: 4 concurrent, time-slicing",
            "small batch: 4 concurrent, one gpushare daemon",
            "small batch: 4 UIDs, 4 per-user daemons",
            "small batch: 4 UIDs, one multi-user gpushare daemon",
        ] {
            t.skip_sim(name, "needs CUDA kernels");
        }
        return;
    }
    let iters = n.to_string();
    let kc: Vec<OsString> = t.workload_cmd(&["matmul", "--size", "256", "--iterations", &iters]);
    let ktmo = (600 + n / 1000) as f64;
    let uuid = t.gpu.uuid.clone();
    let visible = [("CUDA_VISIBLE_DEVICES", uuid.as_str())];
    let nomps = t.work.join("nomps");
    let labels = |prefix: &str, ids: &[u32]| -> Vec<String> {
        ids.iter().map(|i| format!("{prefix}-{i}")).collect()
    };
    // (a) one process alone, four times in a row (no MPS)
    let alone = labels("kc-alone", &[1, 2, 3, 4]);
    for l in &alone {
        t.launch(l, UA, Some(&nomps), None, ktmo, &visible, kc.clone());
        t.wait_done(ktmo, &[l]);
        t.collect(l, UA, "kubecon");
    }
    let t_alone = kc_report(
        t,
        Total::Sequential,
        "one process alone x4 (sequential)",
        &alone,
    );
    // (b) four at once without MPS: time-slicing
    let ts = labels("kc-ts", &[1, 2, 3, 4]);
    for l in &ts {
        t.launch(l, UA, Some(&nomps), None, ktmo, &visible, kc.clone());
    }
    t.wait_done(ktmo, &ts.iter().map(String::as_str).collect::<Vec<_>>());
    for l in &ts {
        t.collect(l, UA, "kubecon");
    }
    let t_ts = kc_report(
        t,
        Total::Parallel,
        "4 concurrent, time-slicing (no MPS)",
        &ts,
    );
    // (c) four at once, one UID, one gpushare daemon
    let cfg = t.cfg.clone();
    let ua = UA.to_string();
    let d = t.gs_start(&cfg, &["--uid", &ua]);
    let mut t_gs = None;
    if d.ok {
        let gs = labels("kc-gs", &[1, 2, 3, 4]);
        for l in &gs {
            t.launch(l, UA, Some(&d.pipe), Some(&d.shm), ktmo, &[], kc.clone());
        }
        t.wait_done(ktmo, &gs.iter().map(String::as_str).collect::<Vec<_>>());
        for l in &gs {
            t.collect(l, UA, "kubecon");
        }
        t_gs = kc_report(
            t,
            Total::Parallel,
            "4 concurrent, one gpushare daemon (1 UID)",
            &gs,
        );
        t.gs_stop(&[&d.id]);
    } else {
        let ev = first_line(&d.out, 220);
        t.check("FAIL", "small batch: gpushare daemon start", &ev);
    }
    // (d) four UIDs, four per-user daemons: gpushare's multi-tenant case (servers
    // time-slice)
    let mut daemons = Vec::new();
    for u in UIDS {
        let us = u.to_string();
        daemons.push((u, t.gs_start(&cfg, &["--uid", &us])));
    }
    let mut t_pu = None;
    if daemons.iter().all(|(_, d)| d.ok) {
        let pu = labels("kc-pu", &UIDS);
        for ((u, d), l) in daemons.iter().zip(&pu) {
            t.launch(l, *u, Some(&d.pipe), Some(&d.shm), ktmo, &[], kc.clone());
        }
        t.wait_done(ktmo, &pu.iter().map(String::as_str).collect::<Vec<_>>());
        for (u, l) in UIDS.iter().zip(&pu) {
            t.collect(l, *u, "kubecon");
        }
        t_pu = kc_report(
            t,
            Total::Parallel,
            "4 UIDs, 4 per-user gpushare daemons",
            &pu,
        );
    } else {
        let outs: Vec<String> = daemons.iter().map(|(_, d)| d.out.clone()).collect();
        let ev = first_line(&outs.join(" "), 220);
        t.check("FAIL", "small batch: per-user daemons start", &ev);
    }
    let ids: Vec<&str> = daemons.iter().map(|(_, d)| d.id.as_str()).collect();
    t.gs_stop(&ids);
    // (e) four UIDs on one multi-user gpushare daemon: one server (as root) for all four
    let cfg_mu = t.work.join("runtime-kc-multi-user.toml");
    let mut t_mu = None;
    let dm = match std::fs::write(&cfg_mu, t.config("multi-user", Some(flag))) {
        Ok(()) => t.gs_start(&cfg_mu, &[]),
        Err(e) => {
            t.check(
                "FAIL",
                "small batch: multi-user daemon start",
                &format!("config: {e}"),
            );
            return;
        }
    };
    if dm.ok {
        let mu = labels("kc-mu", &UIDS);
        for (u, l) in UIDS.iter().zip(&mu) {
            t.launch(l, *u, Some(&dm.pipe), Some(&dm.shm), ktmo, &[], kc.clone());
        }
        let servers = if t.wait_attached(ktmo, &mu[3]) {
            t.ctl1(0, &dm.pipe, "get_server_list")
        } else {
            String::new()
        };
        t.wait_done(ktmo, &mu.iter().map(String::as_str).collect::<Vec<_>>());
        for (u, l) in UIDS.iter().zip(&mu) {
            t.collect(l, *u, "kubecon");
        }
        t_mu = kc_report(
            t,
            Total::Parallel,
            "4 UIDs, one multi-user gpushare daemon",
            &mu,
        );
        t.check(
            "INFO",
            "small batch: multi-user servers",
            &format!("while the fourth ran: '{servers}'"),
        );
    } else {
        let ev = first_line(&dm.out, 220);
        t.check("FAIL", "small batch: multi-user daemon start", &ev);
    }
    t.gs_stop(&[&dm.id]);
    if let (Some(a), Some(ts), Some(gs)) = (t_alone, t_ts, t_gs) {
        let ev = format!(
            "alone x4 {}s, time-slicing {}s, gpushare 1 daemon {}s (x{} vs time-slicing), 4 per-user daemons {}s, 4 UIDs on 1 multi-user daemon {}s",
            f2(Some(a)),
            f2(Some(ts)),
            f2(Some(gs)),
            f2(Some(ts / gs)),
            f2(t_pu),
            f2(t_mu)
        );
        t.check("INFO", "small batch: comparison", &ev);
    }
}

/// Section 7: `gpushare-runtime create` with `low-level-runtime = true` — the shim's whole
/// create (request checked against the inventory, directories, config.json edited,
/// record) and none of runc's. inventory = "nvml" through the inventory cache (a), NVML on
/// every create (inventory-cache-ttl = "0", c) and a file describing the same GPU (b),
/// alternating, the median of each: c - b is what Nvml::init plus the enumeration cost a
/// create, a - b what is left with the cache. Simulated: file against file.
fn create_path(t: &mut Tier) {
    t.section("7. the shim's create path: what the inventory costs every create with a request");
    let rounds = t.create_rounds;
    let cr = t.work.join("create");
    let b = cr.join("b");
    let _ = proc::mkdir(&cr, 0o711).and_then(|_| proc::mkdir(&b, 0o711));
    let mem_mib: u64 = t
        .gpu
        .memory
        .chars()
        .filter(char::is_ascii_digit)
        .collect::<String>()
        .parse()
        .unwrap_or(0);
    let mode = match t.gpu.compute_mode.as_str() {
        "Exclusive_Process" => "exclusive_process",
        "Prohibited" => "prohibited",
        _ => "default",
    };
    let inv = json!({"driver_version": t.gpu.driver, "gpus": [{"index": 0, "uuid": t.gpu.uuid,
        "name": t.gpu.name, "memory_bytes": mem_mib * 1_048_576,
        "compute_capability": "9.0", "compute_mode": mode}]});
    let inv_file = cr.join("inventory.json");
    let mut fail: Option<String> = None;
    if let Err(e) = std::fs::write(&inv_file, inv.to_string()) {
        fail = Some(format!("inventory: {e}"));
    }
    // "nvml" on a GPU (unless GPUSHARE_GPU_INVENTORY replaces it), the file simulated.
    let inv_a = t.inventory.clone();
    let truth = testkit::common::which("true").unwrap_or_else(|| PathBuf::from("/bin/true"));
    for (v, inv, ttl) in [
        ("a", inv_a.clone(), "30s"),
        ("b", format!("file:{}", inv_file.display()), "30s"),
        ("c", inv_a.clone(), "0"),
    ] {
        let toml = format!(
            "low-level-runtime = [{:?}]\nstate-dir = {:?}\nlog-file = {:?}\ninventory = {inv:?}\ninventory-cache-ttl = \"{ttl}\"\n[mps]\ncontrol-binary = {:?}\n",
            truth.display().to_string(),
            cr.join("s").display().to_string(),
            cr.join("gpushare.log").display().to_string(),
            t.control.display().to_string(),
        );
        if let Err(e) = std::fs::write(cr.join(format!("{v}.toml")), toml) {
            fail.get_or_insert(format!("config {v}: {e}"));
        }
    }
    let spec = json!({"ociVersion": "1.0.2",
        "process": {"user": {"uid": UA, "gid": UA}, "args": ["true"], "cwd": "/"},
        "root": {"path": "rootfs"}, "annotations": {"gpushare.io/device": "0"}});
    let mut ms: std::collections::BTreeMap<&str, Vec<f64>> = Default::default();
    let log = cr.join("runc.log");
    for i in 1..=rounds {
        crate::tier::stop_if_interrupted();
        let order = if i % 2 == 0 {
            ["c", "b", "a"]
        } else {
            ["a", "b", "c"]
        };
        for v in order {
            let _ = std::fs::write(b.join("config.json"), spec.to_string());
            let mut cmd = Command::new(&t.bins.runtime);
            cmd.env("GPUSHARE_CONFIG", cr.join(format!("{v}.toml")))
                .arg("--log")
                .arg(&log)
                .args(["--log-format", "json", "create", "--bundle"])
                .arg(&b)
                .arg(format!("cr-{v}-{i}"));
            let t0 = Instant::now();
            let ran = proc::run(
                &mut cmd,
                None,
                Duration::from_secs(60),
                Duration::from_secs(5),
            );
            let took = t0.elapsed().as_secs_f64() * 1000.0;
            if !ran.ok() && fail.is_none() {
                let last = std::fs::read_to_string(&log).unwrap_or_default();
                let last = last.lines().last().unwrap_or_default();
                fail = Some(format!(
                    "{v} round {i}: rc {}: {}",
                    ran.code,
                    calc::cut(last, 200)
                ));
            }
            ms.entry(v).or_default().push(took);
        }
    }
    let med = |v: &str| {
        calc::median(ms.get(v).map(Vec::as_slice).unwrap_or_default()).map(|m| calc::round(m, 3))
    };
    let (a, bm, c) = (med("a"), med("b"), med("c"));
    // The first create with the cache is the fill on a fresh node (empty state dir).
    let first_fill = ms
        .get("a")
        .and_then(|v| v.first())
        .map(|m| calc::round(*m, 3));
    let shim_bytes = std::fs::read(&t.bins.runtime).unwrap_or_default();
    let linked = match calc::elf_has_interpreter(&shim_bytes) {
        Some(true) => "dynamic (it names a program interpreter)",
        Some(false) => "static (no program interpreter)",
        None => "not a 64-bit ELF file",
    };
    let cache = std::fs::read_to_string(cr.join("s").join("inventory.json")).unwrap_or_default();
    let stop = proc::run(
        Command::new(&t.bins.gpushare)
            .env("GPUSHARE_CONFIG", cr.join("b.toml"))
            .args(["daemon", "stop", "--all", "--force"]),
        None,
        Duration::from_secs(60),
        Duration::from_secs(5),
    );
    if !stop.ok() && fail.is_none() {
        fail = Some(format!("daemon stop: {}", first_line(&stop.out, 220)));
    }
    if !testkit::common::mounts_below(&cr).is_empty() && fail.is_none() {
        fail = Some(format!("a mount under {} is left", cr.display()));
    }
    t.record(
        json!({"event": "create_path", "rounds": rounds, "inventory_a": inv_a,
        "median_ms_a": a, "median_ms_uncached": c, "median_ms_file": bm,
        "first_create_ms_a": first_fill, "shim": linked,
        "failure": fail.clone().unwrap_or_default()}),
    );
    println!("shim {}: {linked}", t.bins.runtime.display());
    println!(
        "-- the inventory cache after the run: {}",
        calc::cut(&cache, 600)
    );
    let name = format!("create path: {rounds} creates per inventory");
    if let Some(f) = fail {
        t.check("FAIL", &name, &f);
    } else if t.simulate {
        let ev = format!(
            "file inventory: median {} ms per shim create (no runc)",
            fixed(bm, 3)
        );
        t.check("PASS", &name, &ev);
        t.skip_sim("create path: NVML's cost per create", "needs a driver");
    } else {
        t.check(
            "PASS",
            &name,
            "every create succeeded with inventory = nvml and with a file",
        );
        let sub = |x: Option<f64>, y: Option<f64>| x.zip(y).map(|(x, y)| x - y);
        let ev = format!(
            "median shim create {} ms with inventory = nvml uncached, {} ms through the inventory cache, {} ms with a file inventory: NVML adds {} ms, the cache {} ms",
            fixed(c, 3),
            fixed(a, 3),
            fixed(bm, 3),
            fixed(sub(c, bm), 3),
            fixed(sub(a, bm), 3)
        );
        t.check("INFO", "create path: NVML's cost per create", &ev);
        let ev = format!(
            "the first create with the cache (the fill, an empty state dir) took {} ms; the shim is {linked}",
            fixed(first_fill, 3)
        );
        t.check("INFO", "create path: the cache's first fill", &ev);
        let inv = proc::run(
            Command::new(&t.bins.gpushare).arg("nvml-inventory"),
            None,
            Duration::from_secs(30),
            Duration::from_secs(5),
        );
        println!(
            "-- gpushare nvml-inventory (what the static shim runs): rc {}",
            inv.code
        );
        println!("{}", calc::cut(&inv.out, 900));
        let same = serde_json::from_str::<serde_json::Value>(inv.out.trim())
            .ok()
            .zip(
                serde_json::from_str::<serde_json::Value>(&cache)
                    .ok()
                    .map(|c| c["inventory"].clone()),
            )
            .map(|(x, y)| x == y);
        t.check(
            "INFO",
            "create path: nvml-inventory and the cache agree",
            &format!("{same:?} (None: one of them did not parse as expected)"),
        );
    }
}

/// Where the driver's `name` library is: `ldconfig -p`, else the usual directories.
fn driver_library(name: &str) -> Option<PathBuf> {
    let ld = proc::run(
        Command::new("ldconfig").arg("-p"),
        None,
        Duration::from_secs(30),
        Duration::from_secs(5),
    );
    let listed = ld
        .out
        .lines()
        .filter(|l| l.trim_start().starts_with(&format!("{name} ")) && l.contains("x86-64"))
        .filter_map(|l| l.rsplit_once("=> ").map(|(_, p)| PathBuf::from(p.trim())))
        .next();
    listed.or_else(|| {
        [
            "/usr/local/nvidia/lib64",
            "/usr/lib/x86_64-linux-gnu",
            "/usr/lib64",
        ]
        .iter()
        .map(|d| Path::new(d).join(name))
        .find(|p| p.exists())
    })
}

/// Section 8: gpushare with `driver-root` (the GPU Operator's layout: the driver's files
/// under `/run/nvidia/driver`, not on the host's paths), pointed at the real driver's
/// files: by default a root made of read-only binds of the directories that hold the
/// control binary (as `usr/bin`) and NVML with libcuda (as `usr/lib/x86_64-linux-gnu`), so
/// that nothing is found on the host's paths by accident. The config names only the root
/// and the control binary's bare name: doctor's lines, a per-user daemon whose control
/// binary and server libraries come from under the root (read from /proc), a client on
/// it, and one shim create whose NVML comes from under the root (the static shim runs
/// `gpushare nvml-inventory --library`).
fn driver_root(t: &mut Tier) {
    t.section(
        "8. driver-root: the driver's files under a root of their own (the GPU Operator's layout)",
    );
    if t.simulate {
        t.skip_sim("driver-root", "needs the real driver's files");
        return;
    }
    let mut binds: Vec<PathBuf> = Vec::new();
    let root = match std::env::var_os("GPUSHARE_GPU_DRIVER_ROOT").filter(|v| !v.is_empty()) {
        Some(r) => PathBuf::from(r),
        None => {
            let root = t.work.join("driver");
            let lib = driver_library("libnvidia-ml.so.1");
            let Some(lib_dir) = lib.as_deref().and_then(Path::parent).map(Path::to_path_buf) else {
                t.check(
                    "FAIL",
                    "driver-root: the driver's files",
                    "libnvidia-ml.so.1 not found",
                );
                return;
            };
            let bin_dir = t
                .control
                .parent()
                .map(Path::to_path_buf)
                .unwrap_or_default();
            for (src, rel) in [
                (&bin_dir, "usr/bin"),
                (&lib_dir, "usr/lib/x86_64-linux-gnu"),
            ] {
                let dst = root.join(rel);
                let made = std::fs::create_dir_all(&dst)
                    .map_err(|e| e.to_string())
                    .and_then(|_| {
                        let m = proc::run(
                            Command::new("mount")
                                .args(["--bind", "-o", "ro"])
                                .arg(src)
                                .arg(&dst),
                            None,
                            Duration::from_secs(30),
                            Duration::from_secs(5),
                        );
                        if m.ok() {
                            Ok(())
                        } else {
                            Err(m.out)
                        }
                    });
                match made {
                    Ok(()) => binds.push(dst),
                    Err(e) => {
                        t.check(
                            "FAIL",
                            "driver-root: bind the driver's directories",
                            &first_line(&e, 200),
                        );
                        unbind(&binds);
                        return;
                    }
                }
            }
            println!(
                "driver root {}: usr/bin <- {}, usr/lib/x86_64-linux-gnu <- {} (read-only binds)",
                root.display(),
                bin_dir.display(),
                lib_dir.display()
            );
            root
        }
    };
    let cfg = t.work.join("runtime-driver-root.toml");
    let truth = testkit::common::which("true").unwrap_or_else(|| PathBuf::from("/bin/true"));
    let toml = format!(
        "driver-root = {:?}\nstate-dir = {:?}\nlog-file = {:?}\nlog-level = \"debug\"\ninventory = \"nvml\"\ninventory-cache-ttl = \"0\"\nlow-level-runtime = [{:?}]\n[mps]\ncontrol-binary = \"nvidia-cuda-mps-control\"\nstart-timeout = \"60s\"\n",
        root.display().to_string(),
        t.state.display().to_string(),
        t.work.join("gpushare-driver-root.log").display().to_string(),
        truth.display().to_string(),
    );
    if let Err(e) = std::fs::write(&cfg, toml) {
        t.check("FAIL", "driver-root: config", &e.to_string());
        unbind(&binds);
        return;
    }
    let doctor = proc::run(
        Command::new(&t.bins.gpushare)
            .env("GPUSHARE_CONFIG", &cfg)
            .arg("doctor"),
        None,
        Duration::from_secs(60),
        Duration::from_secs(5),
    );
    println!("-- gpushare doctor with driver-root\n{}", doctor.out);
    for name in ["driver-root", "driver", "mps-control"] {
        let line = doctor
            .out
            .lines()
            .find(|l| l.split_whitespace().nth(1) == Some(name))
            .unwrap_or("")
            .to_owned();
        let status = if line.starts_with("ok") {
            "PASS"
        } else {
            "FAIL"
        };
        t.check(
            status,
            &format!("driver-root: doctor's {name} line"),
            &calc::cut(&line, 300),
        );
    }
    let ua = UA.to_string();
    let d = t.gs_start(&cfg, &["--uid", &ua, "--active-thread-percentage", "50"]);
    if d.ok {
        let pid = std::fs::read_to_string(d.pipe.join("nvidia-cuda-mps-control.pid"))
            .unwrap_or_default()
            .trim()
            .to_owned();
        let exe = std::fs::read_link(format!("/proc/{pid}/exe")).unwrap_or_default();
        let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        let ld: String = environ
            .split(|b| *b == 0)
            .map(String::from_utf8_lossy)
            .find(|v| v.starts_with("LD_LIBRARY_PATH="))
            .map(|v| v.into_owned())
            .unwrap_or_else(|| "no LD_LIBRARY_PATH".into());
        t.check(
            "INFO",
            "driver-root: the control daemon",
            &format!("pid {pid}, exe {}, {ld}", exe.display()),
        );
        let hold = t.hold.max(4.0);
        let cmd = t.client_cmd(hold);
        t.launch(
            "dr-1000",
            UA,
            Some(&d.pipe),
            Some(&d.shm),
            t.tmo(hold),
            &[],
            cmd,
        );
        let mut maps = String::from("no server seen");
        if t.wait_attached(t.tmo(hold), "dr-1000") {
            let srv = t.ctl1(0, &d.pipe, "get_server_list");
            let srv = srv.split_whitespace().next().unwrap_or("").to_owned();
            let text = std::fs::read_to_string(format!("/proc/{srv}/maps")).unwrap_or_default();
            let mut libs: Vec<&str> = text
                .lines()
                .filter_map(|l| l.split_whitespace().nth(5))
                .filter(|p| p.contains("libcuda.so") || p.contains("libnvidia-ml"))
                .collect();
            libs.sort();
            libs.dedup();
            maps = format!("server {srv} mapped {}", libs.join(", "));
        }
        t.wait_done(t.tmo(hold), &["dr-1000"]);
        let r = t.collect("dr-1000", UA, "driver-root");
        let ev = if r.ok() {
            format!("ran to its end; {maps}")
        } else {
            format!("failed: {}; {maps}", calc::cut(&r.error(), 200))
        };
        t.check(
            if r.ok() { "PASS" } else { "FAIL" },
            "driver-root: a client of the daemon",
            &ev,
        );
    } else {
        t.check(
            "FAIL",
            "driver-root: gpushare daemon start",
            &first_line(&d.out, 220),
        );
    }
    t.gs_stop(&[&d.id]);
    // One shim create, NVML uncached: the static shim runs `gpushare nvml-inventory
    // --library <under the root>`.
    let b = t.work.join("driver-bundle");
    let _ = proc::mkdir(&b, 0o711);
    let spec = json!({"ociVersion": "1.0.2",
        "process": {"user": {"uid": UA, "gid": UA}, "args": ["true"], "cwd": "/"},
        "root": {"path": "rootfs"}, "annotations": {"gpushare.io/device": "0"}});
    let _ = std::fs::write(b.join("config.json"), spec.to_string());
    let log = t.work.join("driver-runc.log");
    let t0 = Instant::now();
    let ran = proc::run(
        Command::new(&t.bins.runtime)
            .env("GPUSHARE_CONFIG", &cfg)
            .arg("--log")
            .arg(&log)
            .args(["--log-format", "json", "create", "--bundle"])
            .arg(&b)
            .arg("dr-create"),
        None,
        Duration::from_secs(60),
        Duration::from_secs(5),
    );
    let ms = t0.elapsed().as_secs_f64() * 1000.0;
    let last = std::fs::read_to_string(&log).unwrap_or_default();
    let ev = if ran.ok() {
        format!("created in {ms:.1} ms with inventory = nvml from under the root")
    } else {
        format!(
            "rc {}: {}",
            ran.code,
            calc::cut(last.lines().last().unwrap_or(""), 250)
        )
    };
    t.check(
        if ran.ok() { "PASS" } else { "FAIL" },
        "driver-root: a shim create",
        &ev,
    );
    let stop = proc::run(
        Command::new(&t.bins.gpushare)
            .env("GPUSHARE_CONFIG", &cfg)
            .args(["daemon", "stop", "--all", "--force"]),
        None,
        Duration::from_secs(60),
        Duration::from_secs(5),
    );
    if !stop.ok() {
        t.check(
            "FAIL",
            "driver-root: daemon stop --all --force",
            &first_line(&stop.out, 220),
        );
    }
    unbind(&binds);
}

/// Unmounts the binds of a driver root, last first.
fn unbind(binds: &[PathBuf]) {
    for b in binds.iter().rev() {
        let _ = proc::run(
            Command::new("umount").arg(b),
            None,
            Duration::from_secs(30),
            Duration::from_secs(5),
        );
    }
}
