//! Round 5 (docs/gpu-validation.md "Round 5"): three sections `--only round5` selects (or
//! each by name), run before round 4's:
//!
//! - `r5-v3`: MPS v3's control interface, raw. The driver version first; below 615 one SKIP
//!   line; from 615 scripts/gpu/v3probe.py (as root) asks the open questions the round lists,
//!   with its own daemon, clients, mounts and cgroups under the work directory;
//! - `r5-v3-backend` (v3backend.rs): gpushare's own v3 backend end to end, two UIDs'
//!   containers through gpushare-runtime and runc on one v3 daemon; the same gate;
//! - `r5-coloc`: co-location tail latency. An inference tenant (UID 1000: a small MLP's
//!   forward passes at a fixed request rate) beside a training tenant (UID 2000: a saturating
//!   loop), each alone, time-sliced without MPS, and through gpushare containers (gpushare-
//!   runtime and runc) per-user, multi-user, and multi-user with the training tenant capped;
//!   both tenants measure the same window (they start on one go file). One markdown table
//!   at the end of the run, and a JSON line per setup.
//!
//! Simulated, `r5-v3` runs the probe script to its SKIP line, `r5-v3-backend` runs to its end
//! against the simulator's v3, and `r5-coloc` runs every setup
//! with the workload's CPU stand-in (the containers still go through gpushare-runtime, runc
//! and the simulator) and marks its table "simulated".
//!
//! Invariants: as round 4's (each section `guarded`; compute and MIG mode only read; every
//! wait has a deadline); each setup's containers are deleted and its daemons stopped before
//! the next setup starts, so none measures another's leftovers.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::{json, Value};

use crate::calc::{self, first_line};
use crate::coloc::{summary, table, How, Row, Setup, RATE, SETUPS};
use crate::containers::{self, Ct, Mode};
use crate::opts::Options;
use crate::opts::ROUND5_SECTIONS as SECTIONS;
use crate::proc::{self, SAFE_PATH};
use crate::round4::{guarded, Scope};
use crate::tier::{self, Tier, UA, UB};

/// The probe script's own budget on a driver >= 615 (it stops starting probes after it).
const V3_BUDGET_S: u32 = 150;

/// Seconds each section takes on a GPU in the usual case (`seconds` per co-location setup).
pub fn estimate(name: &str, seconds: f64) -> f64 {
    match name {
        // Below 615 (every lent GPU so far): one line. From 615 up to the budget.
        "r5-v3" => 2.0,
        // Below 615 one line too; from 615 `v3backend::ESTIMATE_S`.
        "r5-v3-backend" => 2.0,
        // Daemons, containers, torch's import and a CUDA context per setup, then the window.
        "r5-coloc" => SETUPS.len() as f64 * (12.0 + seconds),
        _ => 0.0,
    }
}

pub fn run(t: &mut Tier, opts: &Options, flag: &str) {
    let wanted: Vec<&str> = SECTIONS.iter().copied().filter(|s| opts.wants(s)).collect();
    if wanted.is_empty() {
        return;
    }
    let seconds = opts.r5_seconds(t.simulate);
    let total: f64 = wanted.iter().map(|s| estimate(s, seconds)).sum();
    t.section(&format!(
        "round 5: {} ({seconds} s per co-location setup; about {total:.0} s on a GPU below driver 615)",
        wanted.join(", ")
    ));
    t.record(
        json!({"event": "round5", "sections": wanted, "seconds": seconds, "estimate_s": total}),
    );
    for name in wanted {
        guarded(t, name, |t, s| match name {
            "r5-v3" => v3(t),
            "r5-v3-backend" => crate::v3backend::run(t),
            "r5-coloc" => coloc(t, s, seconds, flag),
            _ => {}
        });
    }
}

/// The Python and the workload the section's processes run: on a GPU the tier's (the
/// preflight found the Python; the setup installed the workload); simulated,
/// /usr/bin/python3 (a container sees /usr) and an installed copy of workload.py.
pub(crate) fn ensure_python(t: &mut Tier) -> Result<(), String> {
    if !t.simulate {
        return Ok(());
    }
    if t.py.as_os_str().is_empty() {
        let py = Path::new("/usr/bin/python3");
        if !py.is_file() {
            return Err("no /usr/bin/python3 to run the workload's CPU stand-in".into());
        }
        t.py = py.to_path_buf();
    }
    if t.workload.as_os_str().is_empty() {
        let to = t.work.join("bin/workload.py");
        let from = tier::locate_workload()?;
        std::fs::copy(&from, &to).map_err(|e| format!("copy {}: {e}", from.display()))?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&to, std::fs::Permissions::from_mode(0o755))
            .map_err(|e| format!("chmod {}: {e}", to.display()))?;
        t.workload = to;
    }
    Ok(())
}

// ------------------------------------------------------------------ r5-v3

fn v3(t: &mut Tier) {
    t.section("r5-v3: MPS v3's control interface, raw (a driver >= 615 only)");
    let driver = if t.simulate {
        "simulated (gpushare-mps-sim, no driver)".to_owned()
    } else {
        t.gpu.driver.clone()
    };
    println!("driver: {driver}");
    t.record(json!({"event": "r5_driver", "driver": driver}));
    let name = "r5-v3: MPS v3 probes (O1-O9, O13-O15)";
    let script = match ensure_python(t)
        .and_then(|()| tier::locate_workload())
        .map(|w| w.with_file_name("v3probe.py"))
    {
        Ok(s) if s.is_file() => s,
        Ok(s) => {
            t.check("FAIL", name, &format!("{} is missing", s.display()));
            return;
        }
        Err(e) => {
            t.check("SKIP", name, &e);
            return;
        }
    };
    let jsonl = t.work.join("v3.jsonl");
    let mut cmd = Command::new(&t.py);
    cmd.arg(&script)
        .arg("--work")
        .arg(t.work.join("v3"))
        .args(["--driver", &t.gpu.driver, "--uuid", &t.gpu.uuid])
        .arg("--python")
        .arg(&t.py)
        .arg("--workload")
        .arg(&t.workload)
        .arg("--jsonl")
        .arg(&jsonl)
        .arg("--control")
        .arg(&t.control)
        .args(["--budget", &V3_BUDGET_S.to_string()])
        .env_clear()
        .env("PATH", SAFE_PATH);
    for k in ["LD_LIBRARY_PATH", "PYTHONPATH"] {
        if let Some(v) = std::env::var_os(k).filter(|v| !v.is_empty()) {
            cmd.env(k, v);
        }
    }
    if t.simulate {
        cmd.arg("--simulate");
    }
    // Its budget, then the probes in flight and its cleanup.
    let r = proc::run(
        &mut cmd,
        None,
        Duration::from_secs(u64::from(V3_BUDGET_S) + 90),
        Duration::from_secs(15),
    );
    print!("{}", r.out);
    let lines: Vec<Value> = std::fs::read_to_string(&jsonl)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    for v in &lines {
        let mut v = v.clone();
        v["section"] = json!("r5-v3");
        t.record(v.clone());
        let text = |k: &str| v[k].as_str().unwrap_or_default().to_owned();
        match v["event"].as_str() {
            Some("v3_skip") => t.check("SKIP", name, &text("why")),
            Some("v3_reading") => t.check(
                &text("status"),
                &format!("v3 {}: {}", text("probe"), text("what")),
                &text("evidence"),
            ),
            _ => {}
        }
    }
    if !r.ok() {
        let ev = format!("exit {}: {}", r.code, first_line(&r.out, 200));
        t.check("FAIL", "r5-v3: v3probe.py ran to its end", &ev);
    } else if lines.is_empty() {
        t.check(
            "FAIL",
            "r5-v3: v3probe.py ran to its end",
            "it wrote no JSON line",
        );
    }
}

// ------------------------------------------------------------------ r5-coloc

/// One tenant of a setup: where its output goes, and how to end it.
struct Tenant {
    role: &'static str,
    out: PathBuf,
    /// A plain process's label, or a container's name.
    label: String,
    container: bool,
}

fn coloc(t: &mut Tier, s: &mut Scope, seconds: f64, flag: &str) {
    t.section(&format!(
        "r5-coloc: inference (UID {UA}, {RATE} requests/s) beside training (UID {UB}), {seconds} s per setup"
    ));
    if let Err(e) = ensure_python(t) {
        t.check("SKIP", "r5-coloc", &e);
        return;
    }
    // The containers' bundles and configs; without runc, the plain setups still run.
    let cts = match containers::setup(t) {
        Ok(ct) => match configs(&ct, flag) {
            Ok(c) => Some(c),
            Err(e) => {
                t.check("FAIL", "r5-coloc: the containers' configs", &e);
                None
            }
        },
        Err(e) => {
            t.check("SKIP", "r5-coloc: the gpushare setups", &e);
            None
        }
    };
    let go_dir = t.work.join("bin");
    let mut rows = Vec::new();
    for (i, setup) in SETUPS.iter().enumerate() {
        crate::tier::stop_if_interrupted();
        let ct = match (setup.how, &cts) {
            (How::Plain, _) => None,
            (How::PerUser, Some(c)) => Some(&c.0),
            (How::MultiUser { enforced: true }, Some(c)) => Some(&c.1),
            (How::MultiUser { enforced: false }, Some(c)) => Some(&c.2),
            (_, None) => {
                t.check(
                    "SKIP",
                    &format!("r5-coloc: {}", setup.name),
                    "no containers here",
                );
                continue;
            }
        };
        let row = one_setup(t, s, i, setup, ct, &go_dir, seconds);
        rows.push(row);
    }
    let table = table(&rows, t.simulate, seconds);
    t.record(
        json!({"event": "r5_coloc_table", "markdown": table, "seconds": seconds,
        "rate": RATE}),
    );
    t.tables.push(table);
}

/// The runtime's configs: per-user (the containers' own), multi-user, and multi-user with
/// advisory limits; each with a 2G shm per daemon (two small tenants).
fn configs(ct: &Ct, flag: &str) -> Result<(Ct, Ct, Ct), String> {
    let base = std::fs::read_to_string(&ct.config)
        .map_err(|e| format!("{}: {e}", ct.config.display()))?
        .replace("shm-size = \"8G\"", "shm-size = \"2G\"");
    // The containers' config ends in its [mps] table: the keys below land there.
    let mu = format!("{base}user-mode = \"multi-user\"\nmulti-user-flag = {flag:?}\n");
    let adv = format!("{mu}limits = \"advisory\"\n");
    let mut out = Vec::new();
    for (file, text) in [
        ("coloc-per-user.toml", base),
        ("coloc-multi-user.toml", mu),
        ("coloc-multi-user-advisory.toml", adv),
    ] {
        let path = ct.dir.join(file);
        std::fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))?;
        out.push(Ct {
            config: path,
            ..ct.clone()
        });
    }
    match <[Ct; 3]>::try_from(out) {
        Ok([a, b, c]) => Ok((a, b, c)),
        Err(_) => Err("three configs".into()),
    }
}

#[allow(clippy::too_many_arguments)]
fn one_setup(
    t: &mut Tier,
    s: &mut Scope,
    i: usize,
    setup: &Setup,
    ct: Option<&Ct>,
    go_dir: &Path,
    seconds: f64,
) -> Row {
    let mut row = Row {
        name: setup.name,
        infer: None,
        train: None,
        errors: Vec::new(),
        daemons: Vec::new(),
    };
    println!("-- {}", setup.name);
    let go_name = format!("r5-go-{i}");
    // Plain processes see the host path; containers their /gpu (the bundle dir's gpu/).
    let go_host = match ct {
        Some(c) => c.dir.join("gpu").join(&go_name),
        None => go_dir.join(&go_name),
    };
    let go_arg = match ct {
        Some(_) => format!("/gpu/{go_name}"),
        None => go_host.display().to_string(),
    };
    let _ = std::fs::remove_file(&go_host);
    let secs = format!("{seconds}");
    let rate = format!("{RATE}");
    let mut tenants: Vec<Tenant> = Vec::new();
    for (role, uid, wanted) in [("infer", UA, setup.infer), ("train", UB, setup.train)] {
        if !wanted {
            continue;
        }
        let mut args: Vec<&str> = vec![role, "--seconds", &secs, "--go", &go_arg];
        if role == "infer" {
            args.extend(["--rate", &rate]);
        }
        if t.simulate {
            args.push("--stand-in");
        }
        let label = format!("r5-{i}-{role}");
        match ct {
            None => {
                let nomps = t.work.join("nomps");
                let argv: Vec<OsString> = t.workload_cmd(&args);
                let tmo = t.tmo(seconds);
                s.labels.push(label.clone());
                t.launch(&label, uid, Some(&nomps), None, tmo, &[], argv);
                tenants.push(Tenant {
                    role,
                    out: t.run_dir.join(format!("{label}.out")),
                    label,
                    container: false,
                });
            }
            Some(c) => {
                let mut ann = vec![("gpushare.io/device", "0")];
                if role == "train" {
                    if let Some(cap) = setup.cap {
                        ann.push(("gpushare.io/active-thread-percentage", cap));
                    }
                }
                let shared = t.work.join("h/ct-shared/pipe");
                let made = c
                    .make_bundle_with(
                        &label,
                        uid,
                        Mode::Gpushare,
                        &ann,
                        seconds,
                        &shared,
                        &[],
                        &args,
                    )
                    .and_then(|()| c.start(&c.runtime(), &label).map(|_| ()));
                if let Err(e) = made {
                    row.errors.push(format!("{role}: {}", calc::cut(&e, 300)));
                }
                tenants.push(Tenant {
                    role,
                    out: c.bundle(&label).join("out"),
                    label,
                    container: true,
                });
            }
        }
    }
    if row.errors.is_empty() {
        // Both ready (torch imported, model built, warmed up), then the one go.
        let ready_s = if t.simulate { 30.0 } else { 120.0 };
        let ready = wait_for(&tenants, "\"event\": \"ready\"", ready_s);
        std::fs::write(&go_host, "go\n")
            .and_then(|()| {
                use std::os::unix::fs::PermissionsExt;
                std::fs::set_permissions(&go_host, std::fs::Permissions::from_mode(0o644))
            })
            .unwrap_or_else(|e| row.errors.push(format!("go file: {e}")));
        if !ready {
            row.errors
                .push(format!("not every tenant was ready within {ready_s} s"));
        }
        let end_s = seconds + if t.simulate { 30.0 } else { 90.0 };
        wait_for(&tenants, "\"event\": \"result\"", end_s);
    }
    // Which daemons served the setup (before the deletes end them).
    if let Some(c) = ct {
        let st = c.gpushare(&["status", "--json"]);
        let v: Value = serde_json::from_str(&st.out).unwrap_or(Value::Null);
        row.daemons = v["daemons"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|d| {
                format!(
                    "uid {} {}{}",
                    d["uid"],
                    if d["multi_user"] == true {
                        "multi-user"
                    } else {
                        "per-user"
                    },
                    d["active_thread_percentage"]
                        .as_u64()
                        .map_or(String::new(), |p| format!(" {p} %"))
                )
            })
            .collect();
        if row.daemons.len() != setup.daemons {
            row.errors.push(format!(
                "{} gpushare daemons, expected {} (status --json: {})",
                row.daemons.len(),
                setup.daemons,
                first_line(&st.out, 160)
            ));
        }
    }
    for tn in &tenants {
        let text = std::fs::read_to_string(&tn.out).unwrap_or_default();
        let res = text
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .rfind(|v| v["event"] == "result");
        match res {
            Some(v) if v["ok"] == true => {
                if tn.role == "infer" {
                    row.infer = Some(v);
                } else {
                    row.train = Some(v);
                }
            }
            Some(v) => row.errors.push(format!(
                "{}: {}",
                tn.role,
                calc::cut(v["error"].as_str().unwrap_or("failed"), 200)
            )),
            None => row.errors.push(format!(
                "{}: no result ({})",
                tn.role,
                calc::cut(&calc::one_line(&text), 200)
            )),
        }
    }
    // This setup's processes, containers and daemons end before the next starts.
    let labels: Vec<String> = tenants
        .iter()
        .filter(|tn| !tn.container)
        .map(|tn| tn.label.clone())
        .collect();
    t.abort_clients(&labels);
    if let Some(c) = ct {
        for tn in tenants.iter().filter(|tn| tn.container) {
            c.delete(&tn.label);
        }
        let stop = c.gpushare(&["daemon", "stop", "--all", "--force"]);
        if !stop.ok() {
            row.errors
                .push(format!("daemon stop: {}", first_line(&stop.out, 200)));
        }
    }
    let _ = std::fs::remove_file(&go_host);
    t.record(
        json!({"event": "r5_coloc", "setup": setup.name, "seconds": seconds,
        "rate": RATE, "train_cap": setup.cap, "infer": row.infer, "train": row.train,
        "daemons": row.daemons, "errors": row.errors}),
    );
    let ev = summary(&row);
    let status = if row.errors.is_empty() {
        "PASS"
    } else {
        "FAIL"
    };
    t.check(
        status,
        &format!(
            "r5-coloc: {}{}",
            setup.name,
            if t.simulate { " (simulated)" } else { "" }
        ),
        &ev,
    );
    row
}

/// Every tenant's output has `needle` within `timeout_s` (a tenant that printed its
/// result has nothing more to print).
fn wait_for(tenants: &[Tenant], needle: &str, timeout_s: f64) -> bool {
    testkit::common::wait_until(Duration::from_secs_f64(timeout_s), || {
        crate::tier::stop_if_interrupted();
        tenants.iter().all(|tn| {
            let text = std::fs::read_to_string(&tn.out).unwrap_or_default();
            text.contains(needle) || text.contains("\"event\": \"result\"")
        })
    })
}
