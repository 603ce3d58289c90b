//! Round 5's `r5-v3-backend` (docs/gpu-validation.md "Round 5"): gpushare's own MPS v3
//! backend (`[mps] protocol = "v3"`) end to end through gpushare-runtime and runc, with the
//! real `nvidia-cuda-mps-control` on a driver >= 615 (the simulator's v3 under
//! `--simulate`). Two containers of UIDs 1000 and 2000 on GPU 0, each with its own thread
//! percentage and pinned limit, whose clients report what they got (the workload's SM
//! count and `cuMemGetInfo`; the simulator's client line); then, as root through the
//! daemon's `control`: one root daemon, each namespace capped as asked, a tenant's
//! `namespace set` through its own socket refused, the namespace remade at its name after
//! a `kill -9` of the control daemon (whether the running client survived is recorded, an
//! open question), and each container's end deleting its namespace. Where
//! `/sys/fs/cgroup/dmem.capacity` lists nvidia, `cgroup-memory-limit = "on"` and the
//! container's cgroup's `nvidia-smi memory-limits --get` are recorded too. Below driver 615
//! it prints the driver version and one SKIP line.
//!
//! Invariants: compute and MIG mode only read; every wait has a deadline; the section's
//! containers are deleted through gpushare-runtime (so their poststop hooks run) and its
//! daemons stopped before it returns (`guarded` deletes and stops again after a panic).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::{json, Value};

use crate::calc::{self, first_line};
use crate::containers::{self, Ct, Mode};
use crate::proc;
use crate::tier::{Tier, UA, UB};

/// Seconds the section takes on a GPU (from 615): two containers' torch import and CUDA
/// context, a held client across the control daemon's restart, the deletes.
pub const ESTIMATE_S: f64 = 60.0;

/// The two tenants: container name, UID, thread percentage, pinned limit (as annotated
/// and in bytes).
const TENANTS: [(&str, u32, u32, &str, u64); 2] = [
    ("r5v3-a", UA, 30, "2G", 2 << 30),
    ("r5v3-b", UB, 60, "4G", 4 << 30),
];

/// Seconds the first tenant's client holds its server (across the daemon's restart).
fn hold_s(simulate: bool) -> f64 {
    if simulate {
        6.0
    } else {
        25.0
    }
}

pub fn run(t: &mut Tier) {
    t.section(&format!(
        "r5-v3-backend: gpushare's MPS v3 backend end to end (a driver >= 615 only; about {ESTIMATE_S} s there)"
    ));
    let driver = if t.simulate {
        "simulated (gpushare-mps-sim's v3, no driver)".to_owned()
    } else {
        t.gpu.driver.clone()
    };
    println!("driver: {driver}");
    let name = "r5-v3-backend: two UIDs' containers on one v3 daemon";
    if !t.simulate && calc::driver_major(&t.gpu.driver).is_none_or(|m| m < 615) {
        t.check(
            "SKIP",
            name,
            &format!("MPS v3 needs driver >= 615; this one is {driver}"),
        );
        return;
    }
    if let Err(e) = crate::round5::ensure_python(t) {
        t.check("SKIP", name, &e);
        return;
    }
    // No runc, or a Python the containers cannot see: a SKIP that says so, as r5-coloc's.
    let ct = match containers::setup(t) {
        Ok(ct) => ct,
        Err(e) => {
            t.check("SKIP", name, &e);
            return;
        }
    };
    let (ct, dmem) = match config(t, &ct) {
        Ok(c) => c,
        Err(e) => {
            t.check("FAIL", &format!("{name}: its config"), &e);
            return;
        }
    };
    let mut v = V3 { t, ct, dmem };
    v.body(name);
    v.cleanup();
}

/// The section's config: the containers' own with `protocol = "v3"` (and the cgroup's
/// device memory limit where the driver keeps one); simulated, the simulator's binary in
/// the containers' /gpu.
fn config(t: &mut Tier, ct: &Ct) -> Result<(Ct, bool), String> {
    let mut text = std::fs::read_to_string(&ct.config)
        .map_err(|e| format!("{}: {e}", ct.config.display()))?
        .replace("shm-size = \"8G\"", "shm-size = \"2G\"");
    // The config ends in its [mps] table: the keys below land there.
    text.push_str("protocol = \"v3\"\n");
    let dmem = !t.simulate
        && std::fs::read_to_string("/sys/fs/cgroup/dmem.capacity")
            .is_ok_and(|c| c.lines().any(|l| l.starts_with("nvidia")));
    if dmem {
        text.push_str("cgroup-memory-limit = \"on\"\n");
    }
    let path = ct.dir.join("v3.toml");
    std::fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))?;
    if t.simulate {
        let to = ct.dir.join("gpu/gpushare-mps-sim");
        std::fs::copy(&t.control, &to).map_err(|e| format!("copy the simulator: {e}"))?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&to, std::fs::Permissions::from_mode(0o755))
            .map_err(|e| format!("chmod {}: {e}", to.display()))?;
    }
    Ok((
        Ct {
            config: path,
            ..ct.clone()
        },
        dmem,
    ))
}

struct V3<'a> {
    t: &'a mut Tier,
    ct: Ct,
    /// `cgroup-memory-limit = "on"`: the driver keeps per-cgroup limits here.
    dmem: bool,
}

/// One row of `namespace list --format=csv,noheader`: name, pinned limit, percentage.
type Listed = Vec<(String, String, String)>;

impl V3<'_> {
    fn c(&self) -> &Ct {
        &self.ct
    }

    /// The container's command: the workload's `alloc` (SM count, `cuMemGetInfo`, 256 MiB
    /// touched twice a second for `hold` s), or the simulator's client.
    fn argv(&self, hold: f64) -> Vec<String> {
        let hold = format!("{hold}");
        if self.t.simulate {
            vec![
                "/gpu/gpushare-mps-sim".into(),
                "client".into(),
                "--hold".into(),
                hold,
            ]
        } else {
            let py = self.c().py.display().to_string();
            [
                py.as_str(),
                "/gpu/workload.py",
                "alloc",
                "--bytes",
                "268435456",
                "--hold",
                &hold,
            ]
            .map(String::from)
            .to_vec()
        }
    }

    /// The bundle, then its process's args replaced by `argv`.
    fn bundle(
        &self,
        name: &str,
        uid: u32,
        pct: u32,
        pinned: &str,
        argv: &[String],
    ) -> Result<(), String> {
        let pct = pct.to_string();
        let ann = [
            ("gpushare.io/device", "0"),
            ("gpushare.io/active-thread-percentage", pct.as_str()),
            ("gpushare.io/pinned-memory-limit", pinned),
        ];
        let c = self.c();
        let shared = self.t.work.join("h/ct-shared/pipe");
        c.make_bundle_with(name, uid, Mode::Gpushare, &ann, 1.0, &shared, &[], &[])?;
        let path = c.bundle(name).join("config.json");
        let mut cfg = read_json(&path)?;
        cfg["process"]["args"] = json!(argv);
        std::fs::write(&path, serde_json::to_vec_pretty(&cfg).unwrap_or_default())
            .map_err(|e| format!("{}: {e}", path.display()))
    }

    /// `gpushare-runtime delete -f`: its poststop hook runs.
    fn delete(&self, name: &str) {
        let c = self.c();
        let r = proc::run(
            c.rooted(c.runtime())
                .env("GPUSHARE_CONFIG", &c.config)
                .args(["delete", "-f", name]),
            None,
            Duration::from_secs(60),
            Duration::from_secs(5),
        );
        if !r.ok() {
            println!(
                "delete {name}: exit {}: {}",
                r.code,
                first_line(&r.out, 200)
            );
        }
    }

    /// The daemon's record (its state directory's daemon.json).
    fn record(&self, id: &str) -> Value {
        read_json(&self.t.state.join("mps").join(id).join("daemon.json")).unwrap_or(Value::Null)
    }

    /// A v3 command through daemon `id`'s top-level `control`, as root.
    fn root_ctl(&self, id: &str, args: &[&str]) -> proc::Ran {
        proc::run(
            Command::new(&self.t.control)
                .args(args)
                .env_clear()
                .env("PATH", proc::SAFE_PATH)
                .env(
                    "CUDA_MPS_PIPE_DIRECTORY",
                    self.t.state.join("mps").join(id).join("pipe"),
                ),
            None,
            Duration::from_secs(30),
            Duration::from_secs(5),
        )
    }

    fn listed(&self, id: &str) -> (Listed, String) {
        let r = self.root_ctl(
            id,
            &["namespace", "list", "--server=s", "--format=csv,noheader"],
        );
        let rows = r
            .out
            .lines()
            .map(|l| {
                l.split(',')
                    .map(|f| f.trim().to_owned())
                    .collect::<Vec<_>>()
            })
            .filter(|f| f.len() >= 5)
            .map(|f| (f[0].clone(), f[3].clone(), f[4].clone()))
            .collect();
        (rows, format!("exit {}: {}", r.code, oneline(&r.out, 400)))
    }

    /// The container's client's first line: the simulator's `mps-client …` line, the
    /// workload's `allocated` event (or its result, when it failed first).
    fn wait_client(&self, name: &str, timeout_s: f64) -> Option<String> {
        let out = self.c().bundle(name).join("out");
        let mut got = None;
        testkit::common::wait_until(Duration::from_secs_f64(timeout_s), || {
            crate::tier::stop_if_interrupted();
            let text = std::fs::read_to_string(&out).unwrap_or_default();
            got = text
                .lines()
                .find(|l| {
                    l.starts_with("mps-client ")
                        || l.contains("\"event\": \"allocated\"")
                        || l.contains("\"event\": \"result\"")
                })
                .map(str::to_owned);
            got.is_some()
        });
        got
    }

    fn body(&mut self, name: &str) {
        let sim = self.t.simulate;
        let hold = hold_s(sim);
        // The GPU's SM count, read without MPS before any daemon runs.
        let full = self.full_sms();
        let mut made = Vec::new();
        for (i, (ct, uid, pct, pinned, _)) in TENANTS.iter().enumerate() {
            // The first tenant's client holds on across the daemon's restart.
            let argv = self.argv(if i == 0 { hold } else { 1.0 });
            let r = self
                .bundle(ct, *uid, *pct, pinned, &argv)
                .and_then(|()| self.c().start(&self.c().runtime(), ct).map(|_| ()));
            if let Err(e) = r {
                self.t
                    .check("FAIL", &format!("{name}: {ct} created and started"), &e);
                return;
            }
            made.push(*ct);
        }
        // Which daemon and namespace each got, from the configs the shim rewrote.
        let mut ids = Vec::new();
        let mut nss = Vec::new();
        for ct in &made {
            let cfg = read_json(&self.c().bundle(ct).join("config.json")).unwrap_or(Value::Null);
            ids.push(
                cfg["annotations"]["gpushare.io/daemon"]
                    .as_str()
                    .unwrap_or("")
                    .to_owned(),
            );
            let src = cfg["mounts"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|m| m["destination"] == "/tmp/nvidia-mps")
                .and_then(|m| m["source"].as_str())
                .map(PathBuf::from)
                .unwrap_or_default();
            let leaf = src.file_name().map(|n| n.to_string_lossy().into_owned());
            let under_s = src
                .parent()
                .and_then(Path::file_name)
                .is_some_and(|n| n == "s");
            nss.push(leaf.filter(|_| under_s).unwrap_or_default());
        }
        let id = ids[0].clone();
        let rec = self.record(&id);
        let pid = rec["daemon"]["pid"].as_i64().unwrap_or(0) as i32;
        let owner = std::fs::metadata(format!("/proc/{pid}"))
            .map(|m| std::os::unix::fs::MetadataExt::uid(&m))
            .ok();
        let one = !id.is_empty() && ids.iter().all(|i| *i == id) && rec["identity"]["v3"] == true;
        self.t.check(
            if one && owner == Some(0) && nss.iter().all(|n| !n.is_empty()) {
                "PASS"
            } else {
                "FAIL"
            },
            "r5-v3-backend: one root v3 daemon, a namespace's directory per container",
            &format!(
                "daemons {ids:?}, v3 {}, pid {pid} of uid {owner:?}; namespaces {nss:?}",
                rec["identity"]["v3"]
            ),
        );
        if id.is_empty() {
            return;
        }
        // Each namespace capped as asked, read as root.
        let (rows, raw) = self.listed(&id);
        self.t
            .record(json!({"event": "r5_v3_backend_namespaces", "when": "running", "list": raw}));
        for (i, (ct, _, pct, pinned, bytes)) in TENANTS.iter().enumerate() {
            let row = rows.iter().find(|r| r.0 == nss[i]);
            let ok = row.is_some_and(|r| capped(r, *pct, *bytes));
            self.t.check(
                if ok { "PASS" } else { "FAIL" },
                &format!("r5-v3-backend: {ct}'s namespace capped at {pct} % and {pinned}"),
                &format!("{row:?}; namespace list: {raw}"),
            );
        }
        // Each client within its cap.
        for (ct, _, pct, pinned, bytes) in TENANTS {
            let line = self.wait_client(ct, if sim { 20.0 } else { 90.0 });
            self.client_check(ct, pct, pinned, bytes, full, line.as_deref());
        }
        // A tenant's own `namespace set` through its own namespace's socket.
        self.tenant_set(&id, &nss[0]);
        // kill -9 of the control daemon: the supervisor remakes the namespace.
        self.restart(&id, pid, &nss[0]);
        // Where the driver keeps per-cgroup limits: what the container's cgroup got.
        if self.dmem {
            self.memory_limits(TENANTS[0].0);
        } else {
            let why = if sim {
                "simulated (tests/integration/v3.rs covers it with the nvidia-smi fake)"
            } else {
                "/sys/fs/cgroup/dmem.capacity lists no nvidia device here"
            };
            self.t.check(
                "SKIP",
                "r5-v3-backend: the cgroup's device memory limit",
                why,
            );
        }
        // Each container's end deletes its namespace.
        self.wait_exit(TENANTS[0].0, hold + if sim { 15.0 } else { 60.0 });
        self.survived(TENANTS[0].0);
        for (i, (ct, ..)) in TENANTS.iter().enumerate() {
            self.delete(ct);
            let (rows, raw) = self.listed(&id);
            let gone = !rows.iter().any(|r| r.0 == nss[i]);
            self.t.check(
                if gone && !rows.is_empty() {
                    "PASS"
                } else {
                    "FAIL"
                },
                &format!("r5-v3-backend: {ct}'s end deletes its namespace"),
                &format!("namespace list after: {raw}"),
            );
        }
    }

    /// The GPU's SM count as torch reads it, as root without MPS (nvidia-smi does not
    /// list it); `None` simulated.
    fn full_sms(&self) -> Option<u64> {
        if self.t.simulate {
            return None;
        }
        let r = proc::run(
            Command::new(&self.c().py).args([
                "-c",
                "import torch; print(torch.cuda.get_device_properties(0).multi_processor_count)",
            ]).env("CUDA_MPS_PIPE_DIRECTORY", self.t.work.join("nomps")),
            None,
            Duration::from_secs(60),
            Duration::from_secs(5),
        );
        r.out
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .next_back()
    }

    fn client_check(
        &mut self,
        ct: &str,
        pct: u32,
        pinned: &str,
        bytes: u64,
        full: Option<u64>,
        line: Option<&str>,
    ) {
        let what = format!("r5-v3-backend: {ct}'s client within {pct} % and {pinned}");
        let Some(line) = line else {
            let out = std::fs::read_to_string(self.c().bundle(ct).join("out")).unwrap_or_default();
            let err = std::fs::read_to_string(self.c().bundle(ct).join("err")).unwrap_or_default();
            self.t.check(
                "FAIL",
                &what,
                &format!(
                    "no client line: {} {}",
                    oneline(&out, 200),
                    oneline(&err, 200)
                ),
            );
            return;
        };
        self.t
            .record(json!({"event": "r5_v3_backend_client", "container": ct, "line": line}));
        if self.t.simulate {
            let field = |k: &str| {
                line.split_whitespace()
                    .find_map(|f| f.strip_prefix(&format!("{k}=")))
                    .unwrap_or_default()
                    .to_owned()
            };
            let p = field("active_thread_percentage").parse::<f64>().ok();
            let ok = p == Some(f64::from(pct)) && {
                // `0=2048M,GPU-…=2048M`: every device's limit is the namespace's.
                let pinned = field("pinned_mem_limit");
                let sizes: Vec<Option<u64>> = pinned
                    .split(',')
                    .map(|d| d.rsplit_once('=').and_then(|(_, v)| calc::mps_size(v)))
                    .collect();
                !sizes.is_empty() && sizes.iter().all(|s| *s == Some(bytes))
            };
            self.t.check(
                if ok { "PASS" } else { "FAIL" },
                &format!("{what} (simulated)"),
                line,
            );
            return;
        }
        // The result line carries the SM count and cuMemGetInfo (free is the pinned
        // limit under MPS; total stays the GPU's).
        let text = std::fs::read_to_string(self.c().bundle(ct).join("out")).unwrap_or_default();
        let mut r = serde_json::Map::new();
        for l in text.lines() {
            if let Ok(Value::Object(o)) = serde_json::from_str::<Value>(l.trim()) {
                r.extend(o);
            }
        }
        let sms = r.get("multi_processor_count").and_then(Value::as_u64);
        let free = r.get("mem_get_info").and_then(|m| m["free"].as_u64());
        // MPS rounds a percentage's SMs up to its own granularity: 2 SMs of slack.
        let sm_ok = match (sms, full) {
            (Some(s), Some(f)) => s < f && s <= (f * u64::from(pct)).div_ceil(100) + 2,
            _ => false,
        };
        let mem_ok = free.is_some_and(|f| f <= bytes);
        self.t.check(
            if sm_ok && mem_ok { "PASS" } else { "FAIL" },
            &what,
            &format!(
                "{} of {} SMs; cuMemGetInfo free {} (limit {bytes}); {}",
                opt(sms),
                opt(full),
                opt(free),
                oneline(line, 200)
            ),
        );
    }

    /// The first tenant runs the control binary in its container, as UID 1000, through its
    /// own namespace's socket: `namespace set` its own namespace to 100 % must be refused,
    /// and the cap must read back unchanged.
    fn tenant_set(&mut self, id: &str, ns: &str) {
        let (ct, uid, pct, ..) = TENANTS[0];
        let ctl = if self.t.simulate {
            "/gpu/gpushare-mps-sim"
        } else {
            "nvidia-cuda-mps-control"
        };
        let c = self.c();
        let r = proc::run(
            Command::new(&c.runc).arg("--root").arg(&c.root).args([
                "exec",
                "--user",
                &format!("{uid}:{uid}"),
                ct,
                ctl,
                "namespace",
                "set",
                ns,
                "--server=s",
                "--active-thread-percentage=100",
            ]),
            None,
            Duration::from_secs(30),
            Duration::from_secs(5),
        );
        let (rows, _) = self.listed(id);
        let now = rows
            .iter()
            .find(|r| r.0 == ns)
            .map(|r| r.2.clone())
            .unwrap_or_default();
        let kept = now.parse::<f64>().ok() == Some(f64::from(pct));
        self.t.check(
            if !r.ok() && kept { "PASS" } else { "FAIL" },
            &format!("r5-v3-backend: {ct}'s own namespace set refused"),
            &format!(
                "exit {}: {}; its percentage now {now}",
                r.code,
                oneline(&r.out, 300)
            ),
        );
    }

    /// `kill -9` of the control daemon; the supervisor starts a new one and remakes the
    /// running container's namespace at its name with its limits.
    fn restart(&mut self, id: &str, pid: i32, ns: &str) {
        let (ct, _, pct, _, bytes) = TENANTS[0];
        let what = format!("r5-v3-backend: {ct}'s namespace remade after kill -9 of the daemon");
        if pid <= 0 {
            self.t.check("FAIL", &what, "no daemon pid in its record");
            return;
        }
        proc::signal(pid, nix::sys::signal::Signal::SIGKILL);
        let t0 = std::time::Instant::now();
        let mut new_pid = 0;
        let back = testkit::common::wait_until(
            Duration::from_secs(if self.t.simulate { 20 } else { 45 }),
            || {
                crate::tier::stop_if_interrupted();
                let rec = self.record(id);
                new_pid = rec["daemon"]["pid"].as_i64().unwrap_or(0) as i32;
                rec["status"] == "ready" && new_pid > 0 && new_pid != pid
            },
        );
        let took = t0.elapsed().as_secs_f64();
        let (rows, raw) = self.listed(id);
        let row = rows.iter().find(|r| r.0 == ns);
        let ok = back && row.is_some_and(|r| capped(r, pct, bytes));
        self.t.record(
            json!({"event": "r5_v3_backend_restart", "old_pid": pid, "new_pid": new_pid,
            "ready": back, "seconds": took, "list": raw}),
        );
        self.t.check(
            if ok { "PASS" } else { "FAIL" },
            &what,
            &format!("daemon {pid} -> {new_pid} ready {back} in {took:.1} s; {row:?}; namespace list: {raw}"),
        );
    }

    fn wait_exit(&self, ct: &str, timeout_s: f64) {
        let c = self.c();
        testkit::common::wait_until(Duration::from_secs_f64(timeout_s), || {
            crate::tier::stop_if_interrupted();
            c.stopped(ct)
        });
    }

    /// Whether the first tenant's client, running across the restart, ran to its end: an
    /// open question, recorded as INFO.
    fn survived(&mut self, ct: &str) {
        let b = self.c().bundle(ct);
        let out = std::fs::read_to_string(b.join("out")).unwrap_or_default();
        let err = std::fs::read_to_string(b.join("err")).unwrap_or_default();
        let result = out
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l.trim()).ok())
            .rfind(|v| v["event"] == "result");
        let ev = match (&result, self.t.simulate) {
            (Some(v), _) => format!(
                "ran to its end: {}; {} touches of its allocation in its hold, the restart among them; error {}",
                v["ok"], v["touches"], v["error"]
            ),
            (None, true) => format!("simulated client: {}", oneline(&out, 200)),
            (None, false) => format!("no result: {} {}", oneline(&out, 200), oneline(&err, 200)),
        };
        self.t.record(
            json!({"event": "r5_v3_backend_survived", "container": ct, "result": result,
            "stderr": oneline(&err, 600)}),
        );
        self.t.check(
            "INFO",
            &format!("r5-v3-backend: {ct}'s running client across the restart"),
            &ev,
        );
    }

    /// `nvidia-smi memory-limits --get` of the container's own cgroup (as runc made it).
    fn memory_limits(&mut self, ct: &str) {
        let c = self.c();
        let st = c.state(ct);
        let pid = serde_json::from_str::<Value>(&st.out)
            .ok()
            .and_then(|v| v["pid"].as_i64())
            .unwrap_or(0);
        let rel = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("0::").map(|r| r.trim().to_owned()))
            .unwrap_or_default();
        let cg = format!("/sys/fs/cgroup{rel}");
        let r = proc::run(
            Command::new("nvidia-smi").args([
                "memory-limits",
                "--get",
                "-n",
                &cg,
                "-i",
                &self.t.gpu.uuid,
            ]),
            None,
            Duration::from_secs(30),
            Duration::from_secs(5),
        );
        let dmem_max = std::fs::read_to_string(format!("{cg}/dmem.max")).unwrap_or_default();
        self.t.record(
            json!({"event": "r5_v3_backend_memory_limits", "cgroup": cg, "code": r.code,
            "get": r.out, "dmem_max": dmem_max}),
        );
        self.t.check(
            "INFO",
            &format!("r5-v3-backend: {ct}'s cgroup's device memory limit"),
            &format!(
                "{cg}: exit {}: {}; dmem.max {}",
                r.code,
                oneline(&r.out, 300),
                oneline(&dmem_max, 120)
            ),
        );
    }

    /// Every container deleted, the section's daemons stopped.
    fn cleanup(&mut self) {
        for (ct, ..) in TENANTS {
            self.delete(ct);
        }
        let stop = self.c().gpushare(&["daemon", "stop", "--all", "--force"]);
        if !stop.ok() {
            self.t.check(
                "FAIL",
                "r5-v3-backend: daemon stop --all --force",
                &first_line(&stop.out, 200),
            );
        }
    }
}

/// A listed namespace's pinned limit and percentage are `bytes` and `pct`.
fn capped(row: &(String, String, String), pct: u32, bytes: u64) -> bool {
    calc::mps_size(&row.1) == Some(bytes) && row.2.parse::<f64>().ok() == Some(f64::from(pct))
}

fn read_json(path: &Path) -> Result<Value, String> {
    let text = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    serde_json::from_slice(&text).map_err(|e| format!("{}: {e}", path.display()))
}

fn oneline(text: &str, n: usize) -> String {
    crate::calc::cut(&crate::calc::one_line(text), n)
}

fn opt(v: Option<u64>) -> String {
    v.map_or("?".into(), |v| v.to_string())
}
