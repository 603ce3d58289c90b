//! The core path on a real GPU with real containers (`--containers`): two users' containers
//! at once through gpushare-runtime and real runc against the real nvidia-cuda-mps-control,
//! each running the PyTorch workload from inside the container (A); one of them raising its
//! own limits through its daemon's control socket while its job runs (A2); then the same
//! two users' containers on one shared MPS daemon without gpushare, showing the queue
//! gpushare removes (B).
//!
//! There is no container engine on the GPU machine: the containers are plain OCI bundles run
//! by runc, the way Docker's or containerd's shim would run them. Their root file system is
//! an empty directory with the host's /usr, /etc and /opt bind-mounted read-only (that is
//! where the driver's libraries and PyTorch are), the GPU's device nodes given the way
//! NVIDIA's runtime gives them (linux.devices plus a device-cgroup rule), and a tmpfs /tmp.
//! Container A asks for 50 % of the threads and an 8G pinned limit, so the supervisor's
//! limit check runs against the real daemon's replies.
//!
//! Invariants: every container is deleted (here, or by the tier's restore when a section
//! panics) before the daemons are stopped; the containers' daemons live in the tier's state
//! directory, so the restore's `daemon stop --all --force` stops them too.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::calc::{self, epoch_now};
use crate::opts::Options;
use crate::proc;
use crate::tier::Tier;
use testkit::common::which;

/// Annotations of alice's container: GPU 0, half the threads, an 8G pinned limit.
const ALICE: &[(&str, &str)] = &[
    ("gpushare.io/device", "0"),
    ("gpushare.io/active-thread-percentage", "50"),
    ("gpushare.io/pinned-memory-limit", "8G"),
];
const BOB: &[(&str, &str)] = &[("gpushare.io/device", "0")];

#[derive(Clone, Copy, PartialEq)]
pub enum Mode {
    /// Through gpushare-runtime: the annotations ask for GPU 0.
    Gpushare,
    /// The shared daemon's pipe dir and the host's /dev/shm, as `--ipc=host` plus a
    /// hand-mounted pipe dir would give.
    Shared,
}

#[derive(Clone)]
pub struct Ct {
    pub dir: PathBuf,
    pub runc: PathBuf,
    pub root: PathBuf,
    pub rootfs: PathBuf,
    pub config: PathBuf,
    pub bin: PathBuf,
    pub py: PathBuf,
}

impl Ct {
    pub fn bundle(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    pub fn runtime(&self) -> PathBuf {
        self.bin.join("gpushare-runtime")
    }

    /// `program --root <this tier's runc root>`: runc, or the shim with runc's command line.
    pub fn rooted(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut cmd = Command::new(program);
        cmd.arg("--root").arg(&self.root);
        cmd
    }

    /// `runc spec`, then the changes above; `hold` s of 4096² matmuls.
    fn make_bundle(
        &self,
        name: &str,
        uid: u32,
        mode: Mode,
        annotations: &[(&str, &str)],
        hold: f64,
        shared_pipe: &Path,
    ) -> Result<(), String> {
        self.make_bundle_with(name, uid, mode, annotations, hold, shared_pipe, &[], &[])
    }

    /// `make_bundle`, with `before` put in front of the workload's command (a tenant's
    /// `env VAR=…` wrapper) and `workload` replacing the matmul arguments when not empty.
    #[allow(clippy::too_many_arguments)]
    pub fn make_bundle_with(
        &self,
        name: &str,
        uid: u32,
        mode: Mode,
        annotations: &[(&str, &str)],
        hold: f64,
        shared_pipe: &Path,
        before: &[&str],
        workload: &[&str],
    ) -> Result<(), String> {
        let b = self.bundle(name);
        proc::mkdir(&b, 0o755).map_err(|e| format!("{}: {e}", b.display()))?;
        let _ = std::fs::remove_file(b.join("config.json"));
        let spec = Command::new(&self.runc)
            .arg("spec")
            .current_dir(&b)
            .output()
            .map_err(|e| format!("runc spec: {e}"))?;
        if !spec.status.success() {
            return Err(format!("runc spec: {}", testkit::common::text(&spec)));
        }
        let path = b.join("config.json");
        let mut c: Value = std::fs::read(&path)
            .ok()
            .and_then(|t| serde_json::from_slice(&t).ok())
            .ok_or("runc spec wrote no config.json")?;
        c["root"] = json!({"path": self.rootfs, "readonly": true});
        let p = &mut c["process"];
        p["terminal"] = json!(false);
        p["user"] = json!({"uid": uid, "gid": uid});
        p["cwd"] = json!("/tmp");
        let mut env = vec![
            "PATH=/usr/local/bin:/usr/bin:/bin".to_owned(),
            "HOME=/tmp".into(),
            "LANG=C.UTF-8".into(),
            "PYTHONDONTWRITEBYTECODE=1".into(),
            "CUDA_CACHE_PATH=/tmp/.nv".into(),
        ];
        let hold = format!("{hold}");
        let matmul = [
            "matmul",
            "--size",
            "4096",
            "--seconds",
            &hold,
            "--batch",
            "10",
        ];
        let mut args: Vec<String> = before.iter().map(|a| a.to_string()).collect();
        args.push(self.py.display().to_string());
        args.push("/gpu/workload.py".into());
        let what: &[&str] = if workload.is_empty() {
            &matmul
        } else {
            workload
        };
        args.extend(what.iter().map(|a| a.to_string()));
        p["args"] = json!(args);
        c["hostname"] = json!(name);
        let mut mounts: Vec<Value> = c["mounts"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .into_iter()
            .filter(|m| m["destination"] != "/dev/shm" || mode == Mode::Gpushare)
            .collect();
        for src in ["/usr", "/etc", "/opt"] {
            if Path::new(src).is_dir() {
                mounts.push(json!({"destination": src, "type": "bind", "source": src,
                    "options": ["rbind", "ro", "nosuid", "nodev"]}));
            }
        }
        mounts.push(json!({"destination": "/gpu", "type": "bind",
            "source": self.dir.join("gpu"), "options": ["bind", "ro"]}));
        mounts.push(
            json!({"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
            "options": ["nosuid", "nodev", "mode=1777", "size=1g"]}),
        );
        if mode == Mode::Shared {
            mounts.push(
                json!({"destination": "/dev/shm", "type": "bind", "source": "/dev/shm",
                "options": ["rbind", "rw"]}),
            );
            mounts.push(json!({"destination": "/tmp/nvidia-mps", "type": "bind",
                "source": shared_pipe, "options": ["bind", "rw"]}));
            env.push("CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps".into());
            if let Some(ns) = c["linux"]["namespaces"].as_array_mut() {
                ns.retain(|n| n["type"] != "ipc");
            }
        }
        c["process"]["env"] = json!(env);
        c["mounts"] = json!(mounts);
        let (devices, rules) = gpu_devices();
        let linux = &mut c["linux"];
        linux["devices"] = json!(devices);
        if !linux["resources"].is_object() {
            linux["resources"] = json!({});
        }
        let mut all_rules = linux["resources"]["devices"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        all_rules.extend(rules);
        linux["resources"]["devices"] = json!(all_rules);
        if let Some(l) = linux.as_object_mut() {
            l.remove("seccomp");
        }
        let ann: serde_json::Map<String, Value> = annotations
            .iter()
            .map(|(k, v)| (k.to_string(), json!(v)))
            .collect();
        c["annotations"] = Value::Object(ann);
        std::fs::write(&path, serde_json::to_vec_pretty(&c).unwrap_or_default())
            .map_err(|e| format!("{}: {e}", path.display()))
    }

    /// `RUNTIME create` + `start`; the container's stdout and stderr go to files in its
    /// bundle. Returns the launch time.
    pub fn start(&self, runtime: &Path, name: &str) -> Result<f64, String> {
        let b = self.bundle(name);
        let t0 = epoch_now();
        let _ = std::fs::write(b.join("t0"), format!("{t0}"));
        let (out, err) = (
            std::fs::File::create(b.join("out")).map_err(|e| e.to_string())?,
            std::fs::File::create(b.join("err")).map_err(|e| e.to_string())?,
        );
        let log = b.join("log.json");
        let created = Command::new(runtime)
            .env("GPUSHARE_CONFIG", &self.config)
            .arg("--root")
            .arg(&self.root)
            .arg("--log")
            .arg(&log)
            .args(["--log-format", "json", "create", "--bundle"])
            .arg(&b)
            .arg(name)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .status()
            .map_err(|e| format!("{}: {e}", runtime.display()))?;
        if !created.success() {
            let tail = |p: PathBuf| {
                let t = std::fs::read_to_string(p).unwrap_or_default();
                let n = t.chars().count().saturating_sub(600);
                t.chars().skip(n).collect::<String>()
            };
            return Err(format!(
                "create {name} failed: {} {}",
                tail(log),
                tail(b.join("err"))
            ));
        }
        let started = proc::run(
            Command::new(runtime)
                .env("GPUSHARE_CONFIG", &self.config)
                .arg("--root")
                .arg(&self.root)
                .args(["start", name]),
            None,
            Duration::from_secs(60),
            Duration::from_secs(5),
        );
        if !started.ok() {
            return Err(format!("start {name} failed: {}", started.out.trim()));
        }
        Ok(t0)
    }

    /// `runc state <name>`.
    pub fn state(&self, name: &str) -> proc::Ran {
        proc::run(
            self.rooted(&self.runc).args(["state", name]),
            None,
            Duration::from_secs(10),
            Duration::from_secs(2),
        )
    }

    /// Whether container `name` has stopped; one runc no longer knows counts as stopped.
    pub fn stopped(&self, name: &str) -> bool {
        let st = self.state(name);
        !st.ok() || st.out.contains("\"status\": \"stopped\"")
    }

    fn wait_stopped(&self, name: &str, timeout_s: u64) -> bool {
        let deadline = Instant::now() + Duration::from_secs(timeout_s);
        while Instant::now() < deadline {
            if self.stopped(name) {
                return true;
            }
            crate::tier::pause(Duration::from_millis(100));
        }
        false
    }

    /// The workload in the container ran its first kernel; false if it stopped first.
    fn wait_first_kernel(&self, name: &str, timeout_s: u64) -> bool {
        let deadline = Instant::now() + Duration::from_secs(timeout_s);
        let out = self.bundle(name).join("out");
        while Instant::now() < deadline {
            let text = std::fs::read_to_string(&out).unwrap_or_default();
            if text.contains("\"event\": \"first_kernel\"") {
                return true;
            }
            if self.stopped(name) {
                return false;
            }
            crate::tier::pause(Duration::from_millis(50));
        }
        false
    }

    /// The container's first_kernel and result lines, merged.
    fn result(&self, name: &str) -> Value {
        let text = std::fs::read_to_string(self.bundle(name).join("out")).unwrap_or_default();
        let mut r = serde_json::Map::new();
        for line in text.lines() {
            if let Ok(Value::Object(o)) = serde_json::from_str::<Value>(line.trim()) {
                if matches!(
                    o.get("event").and_then(Value::as_str),
                    Some("result" | "first_kernel")
                ) {
                    r.extend(o);
                }
            }
        }
        Value::Object(r)
    }

    pub fn delete(&self, name: &str) {
        let _ = proc::run(
            self.rooted(&self.runc).args(["delete", "-f", name]),
            None,
            Duration::from_secs(30),
            Duration::from_secs(5),
        );
    }

    fn print_output(&self, name: &str) {
        println!("-- {name} printed:");
        for f in ["out", "err"] {
            print!(
                "{}",
                std::fs::read_to_string(self.bundle(name).join(f)).unwrap_or_default()
            );
        }
    }

    /// `gpushare` with the containers' config.
    pub fn gpushare(&self, args: &[&str]) -> proc::Ran {
        proc::run(
            Command::new(self.bin.join("gpushare"))
                .env("GPUSHARE_CONFIG", &self.config)
                .args(args),
            None,
            Duration::from_secs(120),
            Duration::from_secs(5),
        )
    }
}

/// The GPU's device nodes and their device-cgroup rules, as NVIDIA's runtime gives them.
fn gpu_devices() -> (Vec<Value>, Vec<Value>) {
    let mut paths: Vec<String> = [
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
        "/dev/nvidia-uvm-tools",
        "/dev/nvidia-modeset",
    ]
    .map(String::from)
    .to_vec();
    let mut numbered: Vec<String> = std::fs::read_dir("/dev")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| {
            n.strip_prefix("nvidia")
                .is_some_and(|d| !d.is_empty() && d.bytes().all(|c| c.is_ascii_digit()))
        })
        .map(|n| format!("/dev/{n}"))
        .collect();
    numbered.sort();
    paths.extend(numbered);
    let (mut devices, mut rules) = (Vec::new(), Vec::new());
    for p in paths {
        let Ok(m) = std::fs::metadata(&p) else {
            continue;
        };
        use std::os::unix::fs::FileTypeExt;
        if !m.file_type().is_char_device() {
            continue;
        }
        let (ma, mi) = (
            nix::sys::stat::major(m.rdev()),
            nix::sys::stat::minor(m.rdev()),
        );
        devices.push(json!({"path": p, "type": "c", "major": ma, "minor": mi,
            "fileMode": 0o666, "uid": 0, "gid": 0}));
        rules.push(json!({"allow": true, "type": "c", "major": ma, "minor": mi, "access": "rwm"}));
    }
    (devices, rules)
}

/// Seconds, rounded to 2 decimals, of `a - b` where both are known.
fn diff(a: Option<f64>, b: Option<f64>) -> String {
    calc::f2(a.zip(b).map(|(a, b)| a - b))
}

fn num(v: &Value, k: &str) -> Option<f64> {
    v.get(k).and_then(Value::as_f64)
}

fn text(v: &Value, k: &str) -> String {
    match v.get(k) {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Number(n)) if n.is_f64() => calc::fixed(n.as_f64(), 3),
        Some(x) => x.to_string(),
    }
}

fn ok(v: &Value) -> bool {
    v.get("ok").and_then(Value::as_bool).unwrap_or(false)
}

pub fn run(t: &mut Tier, opts: &Options) {
    t.section("containers: two users' PyTorch containers through gpushare-runtime and runc");
    if t.simulate {
        t.skip_sim(
            "containers",
            "needs a GPU (real containers with PyTorch, real MPS)",
        );
        return;
    }
    match setup(t) {
        Ok(ct) => {
            if opts.wants("containers") {
                sections(t, &ct);
            }
            if opts.wants("skip-mps") {
                skip_mps(t, &ct);
            }
            if opts.wants("cdi") {
                cdi(t, &ct);
            }
        }
        Err(e) => t.check("FAIL", "containers: setup", &e),
    }
}

pub fn setup(t: &mut Tier) -> Result<Ct, String> {
    let runc = t
        .runc_arg
        .clone()
        .or_else(|| which("runc"))
        .ok_or("runc not found (pass --runc PATH; Debian's runc needs libseccomp.so.2)")?;
    let py = t.py.clone();
    // Not resolved through links: a venv's python must be run by its own path.
    if !(py.starts_with("/usr") || py.starts_with("/opt")) {
        return Err(format!(
            "{} is outside /usr and /opt: the containers would not see it (pass --python)",
            py.display()
        ));
    }
    let dir = t.work.join("ct");
    let bin = dir.join("bin");
    let rootfs = dir.join("rootfs");
    let mk = |d: &Path, mode| proc::mkdir(d, mode).map_err(|e| format!("{}: {e}", d.display()));
    mk(&dir, 0o711)?;
    mk(&bin, 0o755)?;
    mk(&dir.join("gpu"), 0o755)?;
    for (from, name) in [
        (&t.bins.gpushare, "gpushare"),
        (&t.bins.runtime, "gpushare-runtime"),
    ] {
        std::fs::copy(from, bin.join(name)).map_err(|e| format!("copy {name}: {e}"))?;
    }
    std::fs::copy(&t.workload, dir.join("gpu/workload.py"))
        .map_err(|e| format!("copy workload.py: {e}"))?;
    {
        use std::os::unix::fs::PermissionsExt;
        let _ = std::fs::set_permissions(
            dir.join("gpu/workload.py"),
            std::fs::Permissions::from_mode(0o644),
        );
    }
    // /mnt stays empty: the pipe directory of a tenant that skips MPS (section C).
    for d in [
        "proc", "dev", "sys", "tmp", "usr", "etc", "opt", "gpu", "mnt",
    ] {
        mk(&rootfs.join(d), 0o755)?;
    }
    for l in ["bin", "sbin", "lib", "lib64", "lib32", "libx32"] {
        let host = Path::new("/").join(l);
        if let Ok(target) = std::fs::read_link(&host) {
            let _ = std::os::unix::fs::symlink(target, rootfs.join(l));
        } else if host.is_dir() {
            mk(&rootfs.join(l), 0o755)?;
        }
    }
    // The containers' daemons live in the tier's state dir: the restore stops them.
    let config = dir.join("runtime.toml");
    let toml = format!(
        "low-level-runtime = [{:?}]\nstate-dir = {:?}\nlog-file = {:?}\nlog-level = \"debug\"\ninventory = {:?}\n[mps]\ncontrol-binary = {:?}\nshm-size = \"8G\"\n",
        runc.display().to_string(),
        t.state.display().to_string(),
        dir.join("gpushare.log").display().to_string(),
        t.inventory,
        t.control.display().to_string(),
    );
    std::fs::write(&config, toml).map_err(|e| format!("config: {e}"))?;
    let root = dir.join("runc");
    t.runc_roots.push((runc.clone(), root.clone()));
    let v = proc::run(
        Command::new(&runc).arg("--version"),
        None,
        Duration::from_secs(10),
        Duration::from_secs(2),
    );
    println!(
        "runc: {}; python: {}; control: {}",
        v.out.lines().next().unwrap_or("?"),
        py.display(),
        t.control.display()
    );
    Ok(Ct {
        dir,
        runc,
        root,
        rootfs,
        config,
        bin,
        py,
    })
}

fn sections(t: &mut Tier, ct: &Ct) {
    let hold = t.hold;
    let shared_pipe = t.work.join("h/ct-shared/pipe");
    // ---------------------------------------------------------------- A. through gpushare
    t.section("containers A: two users' containers at once through gpushare-runtime (GPU 0, per-user daemons)");
    let made = ct
        .make_bundle("ct-alice", 1000, Mode::Gpushare, ALICE, hold, &shared_pipe)
        .and_then(|_| ct.make_bundle("ct-bob", 2000, Mode::Gpushare, BOB, hold, &shared_pipe));
    if let Err(e) = made {
        t.check("FAIL", "containers: bundles", &e);
        return;
    }
    let runtime = ct.runtime();
    let t_start = Instant::now();
    let (ta, tb) = match ct
        .start(&runtime, "ct-alice")
        .and_then(|a| Ok((a, ct.start(&runtime, "ct-bob")?)))
    {
        Ok(v) => v,
        Err(e) => {
            t.check(
                "FAIL",
                "gpushare: two users' containers compute at once",
                &e,
            );
            for c in ["ct-alice", "ct-bob"] {
                ct.delete(c);
            }
            return;
        }
    };
    println!(
        "both created and started in {:.3} s",
        t_start.elapsed().as_secs_f64()
    );
    ct.wait_first_kernel("ct-alice", 120);
    ct.wait_first_kernel("ct-bob", 120);
    println!("-- gpushare status while both run");
    print!("{}", ct.gpushare(&["status"]).out);
    println!("-- nvidia-smi compute apps");
    print!(
        "{}",
        proc::nvidia_smi("--query-compute-apps=pid,process_name,used_memory").out
    );
    for c in ["ct-alice", "ct-bob"] {
        if !ct.wait_stopped(c, hold as u64 + 180) {
            println!("{c} did not stop");
        }
    }
    for (c, t0) in [("ct-alice", ta), ("ct-bob", tb)] {
        ct.print_output(c);
        record(t, ct, c, &format!("gpushare-{c}"), t0);
    }
    let (a, b) = (ct.result("ct-alice"), ct.result("ct-bob"));
    let name = "gpushare: two users' containers compute at once";
    if ok(&a) && ok(&b) {
        let ov = num(&a, "t_end")
            .zip(num(&b, "t_end"))
            .map(|(x, y)| x.min(y))
            .zip(
                num(&a, "t_first_kernel")
                    .zip(num(&b, "t_first_kernel"))
                    .map(|(x, y)| x.max(y)),
            )
            .map(|(end, start)| end - start);
        if ov.is_some_and(|o| o > 1.0) {
            let ev = format!(
                "both computing for {}s (alice uid 1000 at 50 %/8G, bob uid 2000)",
                calc::f2(ov)
            );
            t.check("PASS", name, &ev);
        } else {
            t.check("FAIL", name, &format!("overlap {}s", calc::f2(ov)));
        }
    } else {
        let ev = format!(
            "alice ok={}, bob ok={}: {} {}",
            ok(&a),
            ok(&b),
            text(&a, "error"),
            text(&b, "error")
        );
        t.check("FAIL", name, &ev);
    }
    let ev = format!(
        "alice {} TFLOP/s, bob {} TFLOP/s (fp32 4096², while both ran part of the time)",
        calc::f2(num(&a, "tflops")),
        calc::f2(num(&b, "tflops"))
    );
    t.check(
        "INFO",
        "gpushare: throughput, alice at 50 % and bob at 100 %",
        &ev,
    );
    let lat_b = diff(num(&b, "t_first_kernel"), Some(tb));
    let ev = format!(
        "alice {}s, bob {lat_b}s (daemon start, torch import, CUDA context)",
        diff(num(&a, "t_first_kernel"), Some(ta))
    );
    t.check("INFO", "gpushare: create to first kernel", &ev);
    let log = std::fs::read_to_string(ct.dir.join("gpushare.log")).unwrap_or_default();
    let warnings: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("ERROR") || l.contains("WARN"))
        .collect();
    if !warnings.is_empty() {
        let tail = warnings[warnings.len().saturating_sub(5)..].join("|");
        t.check(
            "INFO",
            "gpushare log: warnings and errors",
            &calc::cut(&tail, 900),
        );
    }
    let raised: Vec<&str> = log
        .lines()
        .filter(|l| {
            let l = l.to_lowercase();
            l.contains("cannot read a server's limit")
                || l.contains("limits were raised")
                || l.contains("limits were changed")
        })
        .collect();
    let name = "supervisor limit check accepted the real replies";
    if raised.is_empty() {
        let ev = format!(
            "no limit found raised and every reply read, in {} log lines",
            log.lines().filter(|l| !l.is_empty()).count()
        );
        t.check("PASS", name, &ev);
    } else {
        let ev = raised.iter().take(2).copied().collect::<Vec<_>>().join("|");
        t.check("FAIL", name, &ev);
    }
    println!("-- daemon logs (control.log, tail)");
    for d in std::fs::read_dir(t.state.join("mps"))
        .into_iter()
        .flatten()
        .flatten()
    {
        println!("# {}", d.path().display());
        for (f, n) in [("log/control.log", 15), ("daemon.out", 5)] {
            let text = std::fs::read_to_string(d.path().join(f)).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            for l in &lines[lines.len().saturating_sub(n)..] {
                println!("{l}");
            }
        }
    }
    for c in ["ct-alice", "ct-bob"] {
        ct.delete(c);
    }
    attack(t, ct, &shared_pipe);
    shared(t, ct, &shared_pipe, &lat_b);
}

/// A2: alice raises her limits through her daemon's control socket while her job runs.
fn attack(t: &mut Tier, ct: &Ct, shared_pipe: &Path) {
    t.section("containers A2: alice raises her limits through her daemon's control socket while her job runs");
    if let Err(e) = ct.make_bundle("ct-alice2", 1000, Mode::Gpushare, ALICE, 20.0, shared_pipe) {
        t.check("FAIL", "containers: bundles", &e);
        return;
    }
    let t0 = match ct.start(&ct.runtime(), "ct-alice2") {
        Ok(t0) => t0,
        Err(e) => {
            t.check("FAIL", "tenant attack: alice2's client attached", &e);
            ct.delete("ct-alice2");
            return;
        }
    };
    let pipe = std::fs::read_dir(t.state.join("mps"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|d| d.path().join("pipe"))
        .find(|p| std::fs::metadata(p).is_ok_and(|m| m.uid() == 1000));
    match pipe {
        Some(pipe) if ct.wait_first_kernel("ct-alice2", 120) => {
            let as1000 = |cmd: &str| t.ctl1(1000, &pipe, cmd);
            let before = as1000("get_default_active_thread_percentage");
            let r1 = as1000("set_default_active_thread_percentage 100");
            let servers = as1000("get_server_list");
            let srv = servers.split_whitespace().next().unwrap_or("").to_owned();
            let r2 = as1000(&format!("set_active_thread_percentage {srv} 100"));
            let r3 = as1000(&format!("get_active_thread_percentage {srv}"));
            let r4 = as1000(&format!("set_device_pinned_mem_limit {srv} 0 64G"));
            let ev = format!("default before '{before}'; set default 100 -> '{r1}'; server {srv}: set 100 -> '{r2}', reads '{r3}'; set its pinned limit 64G -> '{r4}'");
            t.check("INFO", "tenant's own commands on its daemon", &ev);
            // The supervisor's limit check runs every mps.limit-check-interval (2 s): what
            // it left after 5 s is the measurement.
            crate::tier::pause(Duration::from_secs(5));
            let as1000 = |cmd: &str| t.ctl1(1000, &pipe, cmd);
            let after = as1000("get_default_active_thread_percentage");
            let afterm = as1000("get_default_device_pinned_mem_limit 0");
            let servers = as1000("get_server_list");
            let srv_t = as1000(&format!("get_active_thread_percentage {srv}"));
            let srv_m = as1000(&format!("get_device_pinned_mem_limit {srv} 0"));
            let name = "supervisor restored the default thread limit";
            let ev = format!("reads '{after}' 5 s later");
            t.check(
                if after.contains("50") { "PASS" } else { "FAIL" },
                name,
                &ev,
            );
            t.check("INFO", "pinned limit 5 s later", &format!("'{afterm}'"));
            let name = "supervisor set the server's limits back";
            let ev =
                format!("server {srv} reads '{srv_t}' '{srv_m}' 5 s later; servers '{servers}'");
            let back = matches!(srv_t.as_str(), "50.0" | "50") && srv_m == "8G";
            t.check(if back { "PASS" } else { "FAIL" }, name, &ev);
        }
        pipe => {
            let out = std::fs::read_to_string(ct.bundle("ct-alice2").join("out"))
                .unwrap_or_default()
                + &std::fs::read_to_string(ct.bundle("ct-alice2").join("err")).unwrap_or_default();
            let n = out.chars().count().saturating_sub(400);
            let ev = format!(
                "pipe '{}'; {}",
                pipe.map(|p| p.display().to_string()).unwrap_or_default(),
                out.chars().skip(n).collect::<String>()
            );
            t.check("FAIL", "tenant attack: alice2's client attached", &ev);
        }
    }
    if !ct.wait_stopped("ct-alice2", 200) {
        println!("ct-alice2 did not stop");
    }
    ct.print_output("ct-alice2");
    record(t, ct, "ct-alice2", "gpushare-ct-alice2-attacked", t0);
    let r = ct.result("ct-alice2");
    if ok(&r) {
        let ev = format!(
            "{} TFLOP/s, {} SMs visible",
            calc::f2(num(&r, "tflops")),
            text(&r, "multi_processor_count")
        );
        t.check("PASS", "alice2's job ran to its end", &ev);
    } else {
        t.check("FAIL", "alice2's job ran to its end", &text(&r, "error"));
    }
    let log = std::fs::read_to_string(ct.dir.join("gpushare.log")).unwrap_or_default();
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| {
            let l = l.to_lowercase();
            l.contains("limit") || l.contains("shutdown")
        })
        .collect();
    for l in &lines[lines.len().saturating_sub(8)..] {
        println!("{l}");
    }
    ct.delete("ct-alice2");
    let stop = ct.gpushare(&["daemon", "stop", "--all", "--force"]);
    if !stop.ok() {
        let ev = calc::first_line(&stop.out, 220);
        t.check(
            "FAIL",
            "gpushare daemon stop --all --force (containers)",
            &ev,
        );
    }
}

/// B: the same two users' containers on one shared MPS daemon (no gpushare).
fn shared(t: &mut Tier, ct: &Ct, shared_pipe: &Path, lat_b: &str) {
    t.section(
        "containers B: the same two users' containers on one shared MPS daemon (no gpushare)",
    );
    let hand = t.hand_start("ct-shared", &[]);
    if !hand.ok || hand.pipe != shared_pipe {
        let ev = format!(
            "nvidia-cuda-mps-control -d did not start (rc {}): {}",
            hand.rc, hand.out
        );
        t.check("FAIL", "shared daemon: clients", &ev);
        t.quit_hand_daemon(&hand.dir);
        return;
    }
    let hold = t.hold;
    let made = ct
        .make_bundle("sh-alice", 1000, Mode::Shared, &[], hold, shared_pipe)
        .and_then(|_| ct.make_bundle("sh-bob", 2000, Mode::Shared, &[], hold, shared_pipe));
    let runc = ct.runc.clone();
    let started = made.and_then(|_| {
        let ta = ct.start(&runc, "sh-alice")?;
        if !ct.wait_first_kernel("sh-alice", 120) {
            println!("sh-alice: no first kernel");
        }
        Ok((ta, ct.start(&runc, "sh-bob")?))
    });
    match started {
        Ok((ta, tb)) => {
            for c in ["sh-alice", "sh-bob"] {
                if !ct.wait_stopped(c, hold as u64 + 180) {
                    println!("{c} did not stop");
                }
            }
            for (c, t0) in [("sh-alice", ta), ("sh-bob", tb)] {
                ct.print_output(c);
                record(t, ct, c, &format!("shared-{c}"), t0);
            }
            println!("-- shared daemon's control.log");
            let log = std::fs::read_to_string(hand.dir.join("log/control.log")).unwrap_or_default();
            let lines: Vec<&str> = log.lines().collect();
            for l in &lines[lines.len().saturating_sub(20)..] {
                println!("{l}");
            }
            let (a, b) = (ct.result("sh-alice"), ct.result("sh-bob"));
            if ok(&a) && ok(&b) {
                let ev = format!(
                    "{}s; his first kernel came {}s after alice's end (gpushare: {lat_b}s)",
                    diff(num(&b, "t_first_kernel"), Some(tb)),
                    diff(num(&b, "t_first_kernel"), num(&a, "t_end"))
                );
                t.check("INFO", "shared daemon: bob's create to first kernel", &ev);
            } else {
                let ev = format!(
                    "alice ok={} bob ok={}: {} {}",
                    ok(&a),
                    ok(&b),
                    text(&a, "error"),
                    text(&b, "error")
                );
                t.check("INFO", "shared daemon: clients", &ev);
            }
        }
        Err(e) => t.check("FAIL", "shared daemon: clients", &e),
    }
    for c in ["sh-alice", "sh-bob"] {
        ct.delete(c);
    }
    t.quit_hand_daemon(&hand.dir);
}

/// The JSON line `"event": "container"` of one container run.
fn record(t: &mut Tier, ct: &Ct, name: &str, label: &str, t_launch: f64) {
    let text = std::fs::read_to_string(ct.bundle(name).join("out")).unwrap_or_default();
    let payload = text
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l.trim()).ok())
        .rfind(|o| o.get("event").and_then(Value::as_str) == Some("result"))
        .unwrap_or_else(|| json!({}));
    t.record(
        json!({"event": "container", "section": "containers", "label": label,
        "t_launch": t_launch, "payload": payload}),
    );
}

/// The tenant of section C: GPU 0, a quarter of the threads, a 2G pinned limit.
const QUARTER: &[(&str, &str)] = &[
    ("gpushare.io/device", "0"),
    ("gpushare.io/active-thread-percentage", "25"),
    ("gpushare.io/pinned-memory-limit", "2G"),
];

/// One container from create to its end; its merged result lines. `smi` prints
/// nvidia-smi's process table once its first kernel ran.
fn run_to_end(t: &mut Tier, ct: &Ct, runtime: &Path, name: &str, smi: bool) -> Value {
    let t0 = match ct.start(runtime, name) {
        Ok(t0) => t0,
        Err(e) => {
            ct.delete(name);
            return json!({"ok": false, "error": e});
        }
    };
    if ct.wait_first_kernel(name, 120) && smi {
        let out = proc::run(
            &mut Command::new("nvidia-smi"),
            None,
            Duration::from_secs(30),
            Duration::from_secs(5),
        )
        .out;
        let lines: Vec<&str> = out.lines().collect();
        println!("-- nvidia-smi while {name} computes (processes)");
        for l in &lines[lines.len().saturating_sub(8)..] {
            println!("{l}");
        }
    }
    if !ct.wait_stopped(name, 240) {
        println!("{name} did not stop");
    }
    ct.print_output(name);
    record(t, ct, name, &format!("skip-mps-{name}"), t0);
    let r = ct.result(name);
    ct.delete(name);
    r
}

/// C: a tenant that skips MPS. UID 1000's container, served by a 25 % / 2G daemon and
/// given the GPU's device nodes, runs the throughput workload as given and with
/// `CUDA_MPS_PIPE_DIRECTORY` pointing at an empty directory, and a 4 GiB allocation with
/// the client limit variable unset, with and without MPS, and with a limit that names a
/// device the container cannot see. What runs and what is refused is the evidence for what
/// SECURITY.md may claim; the two refusals that gpushare's limits promise are checks.
fn skip_mps(t: &mut Tier, ct: &Ct) {
    t.section("containers C: a tenant that skips MPS (UID 1000, 25 % threads, 2G pinned, device nodes given)");
    let shared_pipe = t.work.join("h/ct-shared/pipe");
    let hold = t.hold.clamp(3.0, 5.0);
    let gib4 = (4u64 << 30).to_string();
    let alloc: [&str; 3] = ["alloc", "--bytes", &gib4];
    let env = "/usr/bin/env";
    let no_pipe = "CUDA_MPS_PIPE_DIRECTORY=/mnt";
    let unset = ["-u", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"];
    let dev1 = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=1=64G";
    let fake_uuid = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=GPU-00000000-1111-2222-3333-444444444444=64G";
    // (name, through gpushare, wrapper, workload, print nvidia-smi)
    type Run<'a> = (&'a str, bool, Vec<&'a str>, &'a [&'a str], bool);
    let runs: Vec<Run> = vec![
        ("c-ref", false, vec![], &[], false),
        ("c-mps", true, vec![], &[], true),
        ("c-skip", true, vec![env, no_pipe], &[], true),
        (
            "c-alloc-mps",
            true,
            [&[env][..], &unset].concat(),
            &alloc,
            false,
        ),
        (
            "c-alloc-skip",
            true,
            [&[env][..], &unset, &[no_pipe]].concat(),
            &alloc,
            false,
        ),
        ("c-alloc-dev1", true, vec![env, dev1], &alloc, false),
        ("c-alloc-uuid", true, vec![env, fake_uuid], &alloc, false),
    ];
    let mut res = std::collections::BTreeMap::new();
    for (name, gs, before, workload, smi) in runs {
        let ann = if gs { QUARTER } else { &[] };
        if let Err(e) = ct.make_bundle_with(
            name,
            1000,
            Mode::Gpushare,
            ann,
            hold,
            &shared_pipe,
            &before,
            workload,
        ) {
            t.check("FAIL", "containers: bundles", &e);
            return;
        }
        let runtime = if gs { ct.runtime() } else { ct.runc.clone() };
        let r = run_to_end(t, ct, &runtime, name, smi);
        println!(
            "{name}: ok={} tflops={} error={}",
            ok(&r),
            calc::f2(num(&r, "tflops")),
            text(&r, "error")
        );
        res.insert(name, r);
    }
    let tf = |n: &str| res.get(n).and_then(|r| num(r, "tflops"));
    let ratio = |n: &str| tf(n).zip(tf("c-ref")).map(|(x, r)| x / r);
    let ev = format!(
        "fp32 4096²: no MPS (plain runc) {} TFLOP/s; through its 25 % daemon {} ({} of it); with an empty CUDA_MPS_PIPE_DIRECTORY {} ({} of it)",
        calc::f2(tf("c-ref")),
        calc::f2(tf("c-mps")),
        calc::f2(ratio("c-mps")),
        calc::f2(tf("c-skip")),
        calc::f2(ratio("c-skip"))
    );
    t.check("INFO", "skip MPS: the thread limit", &ev);
    let verdict = |n: &str| match res.get(n) {
        Some(r) if ok(r) => "allocated".to_owned(),
        Some(r) => format!("refused ({})", calc::cut(&text(r, "error"), 90)),
        None => "not run".to_owned(),
    };
    let ev = format!(
        "4 GiB under a 2G limit, the client variable unset: through MPS {}; with an empty CUDA_MPS_PIPE_DIRECTORY {}",
        verdict("c-alloc-mps"),
        verdict("c-alloc-skip")
    );
    t.check("INFO", "skip MPS: the pinned memory limit", &ev);
    let refused = |n: &str| {
        res.get(n)
            .is_some_and(|r| !ok(r) && !text(r, "error").is_empty())
    };
    t.check(
        if refused("c-alloc-mps") {
            "PASS"
        } else {
            "FAIL"
        },
        "the daemon's 2G limit binds an MPS client without the client variable",
        &verdict("c-alloc-mps"),
    );
    // Driver 580.159.04 drops the daemon's limit for such a client (SECURITY.md row 22):
    // gpushare refuses the variable in a container's spec and documents the pinned limit
    // as binding cooperative clients only, so this is a measurement, not a promise.
    for (n, what) in [
        ("c-alloc-dev1", "1=64G"),
        ("c-alloc-uuid", "an unknown GPU's UUID=64G"),
    ] {
        let ev = if refused(n) {
            format!(
                "4 GiB: {} (the limit held: SECURITY.md row 22 may be relaxed for this driver)",
                verdict(n)
            )
        } else {
            format!("4 GiB: {} (the driver dropped the limit for this client, as SECURITY.md row 22 says)", verdict(n))
        };
        t.check(
            "INFO",
            &format!("a client's own limit naming another device ({what})"),
            &ev,
        );
    }
    let stop = ct.gpushare(&["daemon", "stop", "--all", "--force"]);
    if !stop.ok() {
        let ev = calc::first_line(&stop.out, 220);
        t.check("FAIL", "gpushare daemon stop --all --force (skip MPS)", &ev);
    }
}

/// D: a CDI-shaped request. The bundle carries exactly what the CDI spec that `gpushare
/// cdi generate` wrote adds for device `0` (its prestart and poststop hooks), plus the
/// GPU's device nodes as NVIDIA's CDI spec would add them, and is run by plain runc: the
/// hook serves UID 2000's PyTorch client from a daemon of its own.
fn cdi(t: &mut Tier, ct: &Ct) {
    t.section("containers D: a CDI-shaped request: the hooks of `gpushare cdi generate`, run by plain runc");
    let name = "cdi-bob";
    let spec_path = ct.dir.join("cdi.json");
    let g = ct.gpushare(&[
        "cdi",
        "generate",
        "--output",
        &spec_path.display().to_string(),
    ]);
    let spec: Option<Value> = std::fs::read(&spec_path)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok());
    let hooks = spec
        .as_ref()
        .and_then(|s| s["devices"].as_array())
        .and_then(|d| d.iter().find(|d| d["name"] == "0"))
        .and_then(|d| d["containerEdits"]["hooks"].as_array())
        .cloned();
    let Some(hooks) = hooks.filter(|_| g.ok()) else {
        let ev = format!("rc {}: {}", g.code, calc::first_line(&g.out, 220));
        t.check("FAIL", "cdi: gpushare cdi generate", &ev);
        return;
    };
    println!(
        "-- the CDI spec's edits for device 0: {}",
        Value::Array(hooks.clone())
    );
    let shared_pipe = t.work.join("h/ct-shared/pipe");
    let made = ct.make_bundle(
        name,
        2000,
        Mode::Gpushare,
        &[],
        t.hold.clamp(3.0, 5.0),
        &shared_pipe,
    );
    let edited = made.and_then(|_| {
        let path = ct.bundle(name).join("config.json");
        let mut c: Value = std::fs::read(&path)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .ok_or("config.json unreadable")?;
        for h in &hooks {
            let stage = h["hookName"].as_str().unwrap_or_default().to_owned();
            let mut h = h.clone();
            if let Some(o) = h.as_object_mut() {
                o.remove("hookName");
            }
            if !c["hooks"].is_object() {
                c["hooks"] = json!({});
            }
            let list = &mut c["hooks"][stage.as_str()];
            if !list.is_array() {
                *list = json!([]);
            }
            if let Some(a) = list.as_array_mut() {
                a.push(h);
            }
        }
        std::fs::write(&path, serde_json::to_vec_pretty(&c).unwrap_or_default())
            .map_err(|e| format!("{}: {e}", path.display()))
    });
    if let Err(e) = edited {
        t.check("FAIL", "cdi: bundle", &e);
        return;
    }
    let t0 = match ct.start(&ct.runc, name) {
        Ok(t0) => t0,
        Err(e) => {
            t.check("FAIL", "cdi: the hook served UID 2000's client", &e);
            ct.delete(name);
            return;
        }
    };
    let kernel = ct.wait_first_kernel(name, 120);
    let status = ct.gpushare(&["status"]).out;
    println!("-- gpushare status while {name} computes\n{status}");
    if !ct.wait_stopped(name, 240) {
        println!("{name} did not stop");
    }
    ct.print_output(name);
    record(t, ct, name, "cdi-bob", t0);
    let r = ct.result(name);
    ct.delete(name);
    let served = status
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .any(|w| w.contains(&"2000") && w.contains(&"ok"));
    let ev = format!(
        "first kernel {kernel}, ok={}, {} TFLOP/s; status showed a daemon of UID 2000: {served}",
        ok(&r),
        calc::f2(num(&r, "tflops"))
    );
    t.check(
        if ok(&r) && kernel && served {
            "PASS"
        } else {
            "FAIL"
        },
        "cdi: the hook served UID 2000's client",
        &ev,
    );
    let after = ct.gpushare(&["status"]).out;
    println!("-- gpushare status after delete (poststop released the client)\n{after}");
    let stop = ct.gpushare(&["daemon", "stop", "--all", "--force"]);
    if !stop.ok() {
        let ev = calc::first_line(&stop.out, 220);
        t.check("FAIL", "gpushare daemon stop --all --force (cdi)", &ev);
    }
}

/// Round 4, item 5 (`r4-watch`): `gpushare watch` (policy act, 1 s) on the real driver
/// against a served container (GPU 0, 2G pinned limit) whose processes are an MPS client
/// with 1 GiB, one that skips MPS with 1 GiB, and an MPS client that lifts its own limit
/// (a pinned-limit entry for device 1) and takes 3 GiB; plus a host process with 1 GiB.
/// The watcher is to kill the one that skips MPS, end the one above the limit, and leave
/// the others alone; `status` is set beside `nvidia-smi`.
pub fn r4_watch(t: &mut Tier, hold: f64, labels: &mut Vec<String>) {
    t.section("r4-watch (item 5): gpushare watch on the real driver, a served container");
    let name = "item 5: the watcher end to end";
    if t.simulate {
        t.skip_sim(name, "needs a GPU and runc with PyTorch containers; tests/integration/watch.rs runs the same against the simulator and the fake NVML");
        return;
    }
    let ct = match setup(t) {
        Ok(ct) => ct,
        Err(e) => {
            t.check("SKIP", name, &e);
            return;
        }
    };
    // The runtime and the watcher share a config of their own: the containers' state
    // dir, a 1G shm (three small clients; 8G may exceed a small machine's shm total), and
    // the watcher's policy.
    let watch_cfg = ct.dir.join("watch.toml");
    let text = std::fs::read_to_string(&ct.config)
        .unwrap_or_default()
        .replace("shm-size = \"8G\"", "shm-size = \"1G\"")
        + "[watch]\ninterval = \"1s\"\npolicy = \"act\"\nmemory-margin = \"0\"\n";
    if let Err(e) = std::fs::write(&watch_cfg, text) {
        t.check("FAIL", name, &format!("watch config: {e}"));
        return;
    }
    let ct = Ct {
        dir: ct.dir.clone(),
        runc: ct.runc.clone(),
        root: ct.root.clone(),
        rootfs: ct.rootfs.clone(),
        config: watch_cfg.clone(),
        bin: ct.bin.clone(),
        py: ct.py.clone(),
    };
    let keep = 45.0_f64.max(hold * 4.0);
    // The section's guard ends them if anything below panics.
    labels.extend(["r4-watch".to_owned(), "r4-w-host".to_owned()]);
    let gpushare = ct.bin.join("gpushare");
    let cfg = watch_cfg.display().to_string();
    t.launch(
        "r4-watch",
        0,
        None,
        None,
        keep + 120.0,
        &[("GPUSHARE_CONFIG", &cfg)],
        vec![gpushare.into_os_string(), "watch".into()],
    );
    let nomps = t.work.join("nomps");
    let host_cmd = t.workload_cmd(&[
        "alloc",
        "--bytes",
        &(1u64 << 30).to_string(),
        "--hold",
        &format!("{keep}"),
    ]);
    t.launch(
        "r4-w-host",
        crate::tier::UB,
        Some(&nomps),
        None,
        t.tmo(keep),
        &[],
        host_cmd,
    );
    let c = "r4w";
    let py = ct.py.display().to_string();
    let script = format!(
        "W=/gpu/workload.py; \
         {py} $W alloc --bytes {g1} --hold {keep} & \
         env CUDA_MPS_PIPE_DIRECTORY=/mnt {py} $W alloc --bytes {g1} --hold {keep} & \
         env CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=1=64G {py} $W alloc --bytes {g3} --hold {keep} & \
         wait",
        g1 = 1u64 << 30,
        g3 = 3u64 << 30
    );
    let ann = [
        ("gpushare.io/device", "0"),
        ("gpushare.io/pinned-memory-limit", "2G"),
    ];
    let shared_pipe = t.work.join("h/ct-shared/pipe");
    let made = ct
        .make_bundle(c, 1000, Mode::Gpushare, &ann, hold, &shared_pipe)
        .and_then(|()| {
            let path = ct.bundle(c).join("config.json");
            let mut v: Value = std::fs::read(&path)
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok())
                .ok_or("no config.json")?;
            v["process"]["args"] = json!(["/bin/sh", "-c", script]);
            std::fs::write(&path, serde_json::to_vec_pretty(&v).unwrap_or_default())
                .map_err(|e| e.to_string())
        })
        .and_then(|()| ct.start(&ct.runtime(), c).map(|_| ()));
    if let Err(e) = made {
        t.check("FAIL", name, &e);
        t.abort_clients(&["r4-watch".to_owned(), "r4-w-host".to_owned()]);
        ct.delete(c);
        return;
    }
    // The watcher's report: both actions, or the deadline.
    let report = t.state.join("watch.json");
    let read = || -> Value {
        std::fs::read(&report)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or(Value::Null)
    };
    // (Also over when all three of the container's processes have ended: nothing left to
    // act on.)
    let out = ct.bundle(c).join("out");
    let t_wait = Instant::now();
    let _ = testkit::common::wait_until(Duration::from_secs_f64(keep - 5.0), || {
        crate::tier::stop_if_interrupted();
        let ended = std::fs::read_to_string(&out)
            .unwrap_or_default()
            .matches("\"event\": \"result\"")
            .count();
        if ended >= 3 {
            return true;
        }
        let r = read();
        r["actions"]["stopped_direct"].as_u64().unwrap_or(0) >= 1
            && r["actions"]["ended_clients"].as_u64().unwrap_or(0) >= 1
    });
    let waited = t_wait.elapsed().as_secs_f64();
    // Two more scans, then what is left.
    crate::tier::pause(Duration::from_secs(3));
    let r = read();
    let status = ct.gpushare(&["status", "--json"]);
    let smi = proc::nvidia_smi("--query-compute-apps=pid,used_memory");
    let st: Value = serde_json::from_str(&status.out).unwrap_or(Value::Null);
    t.record(json!({"event": "r4_watch", "report": r, "status": st, "nvidia_smi": smi.out}));
    let procs: Vec<String> = r["processes"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|p| {
            format!(
                "{} {} {} MiB {}{}",
                p["pid"],
                p["kind"].as_str().unwrap_or("?"),
                p["used_memory_bytes"]
                    .as_u64()
                    .map_or("?".into(), |b| (b >> 20).to_string()),
                p["container_id"].as_str().unwrap_or("-"),
                p["verdict"]
                    .as_str()
                    .map_or(String::new(), |v| format!(" [{v}]"))
            )
        })
        .collect();
    t.check(
        "INFO",
        "item 5: the watcher's last report",
        &format!("actions {}; processes: {}", r["actions"], procs.join(", ")),
    );
    let n = |k: &str| r["actions"][k].as_u64().unwrap_or(0);
    t.check(
        if n("stopped_direct") >= 1 {
            "PASS"
        } else {
            "FAIL"
        },
        "item 5: the served process that skips MPS is killed",
        &format!(
            "stopped_direct {} (waited {waited:.1} s of at most {:.0})",
            n("stopped_direct"),
            keep - 5.0
        ),
    );
    t.check(
        if n("ended_clients") >= 1 {
            "PASS"
        } else {
            "FAIL"
        },
        "item 5: the client that lifted its own limit is ended above 2G",
        &format!(
            "ended_clients {}, unconfirmed_terminations {}",
            n("ended_clients"),
            n("unconfirmed_terminations")
        ),
    );
    let host_alive = t.done_of("r4-w-host").is_none();
    t.check(
        if host_alive { "PASS" } else { "FAIL" },
        "item 5: a host process on the GPU is left alone",
        &if host_alive {
            "still running".to_owned()
        } else {
            format!(
                "ended: {}",
                calc::cut(
                    &std::fs::read_to_string(t.run_dir.join("r4-w-host.err")).unwrap_or_default(),
                    160
                )
            )
        },
    );
    let st_procs: Vec<String> = st["watch"]["processes"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|p| {
            format!(
                "{} {} MiB",
                p["pid"],
                p["used_memory_bytes"]
                    .as_u64()
                    .map_or("?".into(), |b| (b >> 20).to_string())
            )
        })
        .collect();
    t.check(
        "INFO",
        "item 5: status --json memory beside nvidia-smi",
        &format!(
            "status: {}; nvidia-smi: {}",
            st_procs.join(", "),
            smi.out.trim().lines().collect::<Vec<_>>().join("; ")
        ),
    );
    ct.print_output(c);
    t.abort_clients(&["r4-watch".to_owned(), "r4-w-host".to_owned()]);
    ct.delete(c);
    let stop = ct.gpushare(&["daemon", "stop", "--all", "--force"]);
    if !stop.ok() {
        let ev = calc::first_line(&stop.out, 220);
        t.check("FAIL", "gpushare daemon stop --all --force (r4-watch)", &ev);
    }
}
