//! One run of the GPU tier: its work directory, config, binaries and GPU facts, the checks
//! and JSON lines it writes, the clients and daemons it starts, and the restore at the end.
//! The sections (sections.rs) only call what is here.
//!
//! Invariants: every daemon and client the run starts is found again by the restore
//! (clients by their handles, gpushare's daemons by `daemon stop`, hand-started ones by
//! their pipe directory, anything else by the work directory in its environment or argv)
//! and the restore runs even when a section panics or the run is interrupted; compute mode
//! and MIG mode are only read; simulated figures never go to the real-figures file.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde_json::{json, Map, Value};

use crate::calc::{self, first_line, one_line};
use crate::client::{self, Kind, Raw, Record};
use crate::opts::Options;
use crate::proc::{self, ClientSpec, Ran, Running, SAFE_PATH};
use testkit::common::{mounts_below, note_skip, which};

pub const ME: &str = "gpu tier";
/// The test UIDs: numeric, no passwd entry needed.
pub const UIDS: [u32; 4] = [1000, 2000, 3000, 4000];
pub const UA: u32 = UIDS[0];
pub const UB: u32 = UIDS[1];
/// The simulated GPU (an H100-like entry in a file inventory).
const SIM_UUID: &str = "GPU-8f8bff94-112e-9541-43da-cfd453333404";

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: nix::libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// SIGINT and SIGTERM end the sections at the next wait, and the restore still runs.
pub fn catch_signals() {
    use nix::sys::signal::{sigaction, SaFlags, SigAction, SigHandler, SigSet, Signal};
    let action = SigAction::new(
        SigHandler::Handler(on_signal),
        SaFlags::empty(),
        SigSet::empty(),
    );
    for sig in [Signal::SIGINT, Signal::SIGTERM] {
        // SAFETY: the handler only stores to an atomic.
        let _ = unsafe { sigaction(sig, &action) };
    }
}

/// SIGINT or SIGTERM has come.
pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::SeqCst)
}

/// Panics (caught around the sections) once SIGINT or SIGTERM has come.
pub fn stop_if_interrupted() {
    if INTERRUPTED.load(Ordering::SeqCst) {
        panic!("interrupted by SIGINT or SIGTERM");
    }
}

/// A sleep that notices an interruption.
pub fn pause(d: Duration) {
    stop_if_interrupted();
    std::thread::sleep(d);
}

/// The binaries the tier drives.
#[derive(Debug, Clone)]
pub struct Bins {
    pub gpushare: PathBuf,
    pub runtime: PathBuf,
    pub sim: PathBuf,
}

/// Finds the binaries: `--bin-dir`/GPUSHARE_BIN_DIR; else this build's own target dir
/// (compiled in: absent on a machine the test executable was carried to); else
/// `target/release` under the current directory.
pub fn locate_bins(bin_dir: Option<&Path>, simulate: bool) -> Result<Bins, String> {
    let cwd = std::env::current_dir().unwrap_or_default();
    let built = Path::new(env!("CARGO_BIN_EXE_gpushare"));
    let dir = match bin_dir {
        Some(d) => {
            let d = cwd.join(d);
            if !d.join("gpushare").is_file() {
                return Err(format!(
                    "{} not found (--bin-dir or GPUSHARE_BIN_DIR): build with `cargo build --release` there, or name the directory that holds gpushare, gpushare-runtime and gpushare-mps-sim",
                    d.join("gpushare").display()
                ));
            }
            d
        }
        None => {
            let candidates = [
                built.parent().map(Path::to_path_buf).unwrap_or_default(),
                cwd.join("target/release"),
            ];
            candidates
                .iter()
                .find(|d| d.join("gpushare").is_file())
                .cloned()
                .ok_or_else(|| {
                    format!(
                        "gpushare not found in {} (this build's target dir) nor in {}: pass --bin-dir DIR or set GPUSHARE_BIN_DIR to the directory that holds gpushare, gpushare-runtime and gpushare-mps-sim",
                        candidates[0].display(),
                        candidates[1].display()
                    )
                })?
        }
    };
    let gpushare = dir.join("gpushare");
    let runtime = dir.join("gpushare-runtime");
    if !runtime.is_file() {
        return Err(format!(
            "{} not found: build with `cargo build --release` or pass --bin-dir",
            runtime.display()
        ));
    }
    let sources = Path::new(env!("CARGO_MANIFEST_DIR")).join("sim");
    let sim = if simulate {
        testkit::common::sim_beside(&gpushare, &sources)?
    } else {
        dir.join("gpushare-mps-sim")
    };
    Ok(Bins {
        gpushare,
        runtime,
        sim,
    })
}

/// `scripts/gpu/workload.py`: under the current directory (the repository root the tier
/// runs from), else in the repository this executable was built from.
pub fn locate_workload() -> Result<PathBuf, String> {
    let rel = Path::new("scripts/gpu/workload.py");
    let cwd = std::env::current_dir().unwrap_or_default().join(rel);
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join(rel);
    [cwd.clone(), built.clone()]
        .into_iter()
        .find(|p| p.is_file())
        .ok_or_else(|| {
            format!(
                "{} is missing (nor is {} there): run from the repository root",
                cwd.display(),
                built.display()
            )
        })
}

#[derive(Debug, Clone, Default)]
pub struct Gpu {
    pub uuid: String,
    pub name: String,
    pub driver: String,
    pub compute_mode: String,
    pub mig_mode: String,
    pub memory: String,
}

/// A `gpushare daemon start` and what it printed.
#[derive(Debug, Clone, Default)]
pub struct Daemon {
    pub ok: bool,
    pub pipe: PathBuf,
    pub shm: PathBuf,
    pub id: String,
    pub ms: u128,
    pub out: String,
}

/// A control daemon started by hand (`nvidia-cuda-mps-control -d`).
#[derive(Debug, Clone)]
pub struct Hand {
    pub ok: bool,
    pub rc: i32,
    pub out: String,
    pub dir: PathBuf,
    pub pipe: PathBuf,
}

pub struct Tier {
    pub simulate: bool,
    pub hold: f64,
    pub iterations: u64,
    pub create_rounds: u32,
    pub keep: bool,
    pub run_id: String,
    pub work: PathBuf,
    pub run_dir: PathBuf,
    pub bins: Bins,
    pub control: PathBuf,
    pub gpu: Gpu,
    pub inventory: String,
    pub cfg: PathBuf,
    pub state: PathBuf,
    pub out_file: PathBuf,
    pub workload: PathBuf,
    pub py: PathBuf,
    pub python_arg: Option<PathBuf>,
    pub runc_arg: Option<PathBuf>,
    /// The runc and `--root` of every container a section made: deleted first at the end.
    pub runc_roots: Vec<(PathBuf, PathBuf)>,
    pub gpu_state_before: Option<String>,
    pub ctl_version: String,
    log: Vec<String>,
    checks: Vec<String>,
    fails: usize,
    hand_dirs: Vec<PathBuf>,
    clients: BTreeMap<String, Running>,
    records: BTreeMap<String, Record>,
    collected: Vec<String>,
    stopped: Vec<String>,
    stop_failed: Vec<String>,
    shm_before: BTreeSet<String>,
    /// Round 4 (E1): the next `launch` gets a private /dev/shm and these nodes hidden.
    pub next_private_shm: bool,
    pub next_hide: Vec<PathBuf>,
    /// Tables the sections made (round 5's co-location), printed after the summary.
    pub tables: Vec<String>,
}

fn shm_entries() -> BTreeSet<String> {
    std::fs::read_dir("/dev/shm")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}

/// `nvidia-smi --query-gpu=index,uuid,compute_mode,mig.mode.current`: the GPU state that
/// must be the same after the run.
pub fn gpu_state() -> String {
    let r = proc::nvidia_smi("--query-gpu=index,uuid,compute_mode,mig.mode.current");
    r.out.trim_end().to_owned()
}

impl Tier {
    /// The work directory, its config and the GPU's facts; `Err` is a setup error (exit 2).
    pub fn setup(opts: &Options, simulate: bool, bins: Bins) -> Result<Tier, String> {
        let run_id = format!(
            "{}-{}",
            calc::compact_utc(std::time::SystemTime::now()),
            std::process::id()
        );
        let work = tempfile::Builder::new()
            .prefix("gpuchk.")
            .tempdir_in("/tmp")
            .map_err(|e| format!("cannot make a work directory in /tmp: {e}"))?
            .keep();
        let mut tier = Tier {
            simulate,
            hold: opts.hold(simulate),
            iterations: opts.iterations,
            create_rounds: opts.create_rounds,
            keep: opts.keep,
            run_id,
            run_dir: work.join("run"),
            cfg: work.join("runtime.toml"),
            state: work.join("s"),
            work,
            bins,
            control: PathBuf::new(),
            gpu: Gpu::default(),
            inventory: String::new(),
            out_file: PathBuf::new(),
            workload: PathBuf::new(),
            py: PathBuf::new(),
            python_arg: opts.python.clone(),
            runc_arg: opts.runc.clone(),
            runc_roots: Vec::new(),
            gpu_state_before: None,
            ctl_version: String::new(),
            log: Vec::new(),
            checks: Vec::new(),
            fails: 0,
            hand_dirs: Vec::new(),
            clients: BTreeMap::new(),
            records: BTreeMap::new(),
            collected: Vec::new(),
            stopped: Vec::new(),
            stop_failed: Vec::new(),
            shm_before: shm_entries(),
            next_private_shm: false,
            next_hide: Vec::new(),
            tables: Vec::new(),
        };
        if let Err(e) = tier.prepare(opts) {
            let _ = std::fs::remove_dir_all(&tier.work);
            return Err(e);
        }
        Ok(tier)
    }

    fn prepare(&mut self, opts: &Options) -> Result<(), String> {
        let cwd = std::env::current_dir().unwrap_or_default();
        self.out_file = cwd.join(opts.out.clone().unwrap_or_else(|| {
            if self.simulate {
                // Simulated figures never go to the real-figures file, nor outside the build
                // dir when Cargo runs the tier (scripts/test leaves nothing behind).
                let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
                if tmp.is_dir() { tmp } else { Path::new("/tmp") }.join("gpu-simulate.jsonl")
            } else {
                "docs/gpu-validation-raw.jsonl".into()
            }
        }));
        let w = self.work.clone();
        let io = |what: &str, e: std::io::Error| format!("{what}: {e}");
        // Per-user daemons (UIDs 1000...) must traverse it to their pipe directories.
        proc::mkdir(&w, 0o711).map_err(|e| io("work dir", e))?;
        proc::mkdir(&self.run_dir, 0o700).map_err(|e| io("run dir", e))?;
        for (d, mode) in [
            ("bin", 0o755),
            ("nomps", 0o755),
            ("home", 0o711),
            ("h", 0o711),
        ] {
            proc::mkdir(&w.join(d), mode).map_err(|e| io(d, e))?;
        }
        for u in UIDS {
            let home = w.join("home").join(u.to_string());
            proc::mkdir(&home, 0o700).map_err(|e| io("home", e))?;
            let id = Some(u);
            std::os::unix::fs::chown(&home, id, id).map_err(|e| io("chown home", e))?;
        }
        let install = |from: &Path, to: &Path| -> Result<(), String> {
            use std::os::unix::fs::PermissionsExt;
            std::fs::copy(from, to)
                .and_then(|_| std::fs::set_permissions(to, std::fs::Permissions::from_mode(0o755)))
                .map_err(|e| format!("install {} as {}: {e}", from.display(), to.display()))
        };
        if self.simulate {
            // Everything a test UID executes must be reachable by it: a repository under
            // /root is not.
            self.control = w.join("bin/gpushare-mps-sim");
            install(&self.bins.sim, &self.control)?;
            self.gpu = Gpu {
                uuid: SIM_UUID.into(),
                name: "NVIDIA H100 80GB HBM3 (simulated)".into(),
                driver: "gpushare-mps-sim".into(),
                compute_mode: "Default".into(),
                mig_mode: "[N/A]".into(),
                memory: "81920 MiB".into(),
            };
            let inv = json!({"driver_version": "sim", "gpus": [{"index": 0, "uuid": SIM_UUID,
                "name": self.gpu.name, "memory_bytes": 85899345920u64,
                "compute_capability": "9.0", "compute_mode": "default"}]});
            std::fs::write(w.join("inventory.json"), inv.to_string())
                .map_err(|e| io("inventory", e))?;
            self.inventory = format!("file:{}", w.join("inventory.json").display());
        } else {
            self.workload = w.join("bin/workload.py");
            install(&locate_workload()?, &self.workload)?;
            self.control = which("nvidia-cuda-mps-control")
                .ok_or("nvidia-cuda-mps-control not found on PATH")?;
            self.inventory = "nvml".into();
            self.gpu_state_before = Some(gpu_state());
            let q = proc::run(
                Command::new("nvidia-smi").args([
                    "-i",
                    "0",
                    "--query-gpu=uuid,name,driver_version,compute_mode,mig.mode.current,memory.total",
                    "--format=csv,noheader",
                ]),
                None,
                Duration::from_secs(30),
                Duration::from_secs(5),
            );
            if !q.ok() {
                return Err(format!("nvidia-smi --query-gpu failed: {}", q.out.trim()));
            }
            let f: Vec<String> = q
                .out
                .trim()
                .splitn(6, ',')
                .map(|s| s.trim().to_owned())
                .collect();
            let at = |i: usize| f.get(i).cloned().unwrap_or_default();
            self.gpu = Gpu {
                uuid: at(0),
                name: at(1),
                driver: at(2),
                compute_mode: at(3),
                mig_mode: at(4),
                memory: at(5),
            };
        }
        // A test hook: GPUSHARE_GPU_INVENTORY=file:/… replaces the NVML inventory.
        if let Some(inv) = &opts.inventory_override {
            self.inventory = inv.clone();
        }
        std::fs::write(&self.cfg, self.config("per-user", None)).map_err(|e| io("config", e))?;
        let v = proc::run(
            Command::new(&self.control).arg("-v"),
            None,
            Duration::from_secs(10),
            Duration::from_secs(2),
        );
        self.ctl_version = v.out.lines().take(2).collect::<Vec<_>>().join(" ") + " ";
        if self.ctl_version.trim().is_empty() {
            self.ctl_version.clear();
        }
        Ok(())
    }

    /// The run's gpushare config: `user_mode` "per-user" or "multi-user" (with its flag).
    pub fn config(&self, user_mode: &str, multi_user_flag: Option<&str>) -> String {
        let mut text = format!(
            "# written by the GPU tier (tests/gpu) for one run\nstate-dir = {:?}\nlog-file = {:?}\nlog-level = \"debug\"\ninventory = {:?}\n[mps]\ncontrol-binary = {:?}\nuser-mode = \"{user_mode}\"\nstart-timeout = \"60s\"\n",
            self.state.display().to_string(),
            self.work.join("gpushare.log").display().to_string(),
            self.inventory,
            self.control.display().to_string(),
        );
        if let Some(flag) = multi_user_flag {
            text.push_str(&format!("multi-user-flag = {flag:?}\n"));
        }
        text
    }

    pub fn work_str(&self) -> String {
        self.work.display().to_string()
    }

    // ------------------------------------------------------------- checks and JSON lines

    /// One JSON line of this run: `run` and `simulate` first, then `fields`.
    pub fn record(&mut self, fields: Value) {
        let mut m = Map::new();
        m.insert("run".into(), json!(self.run_id));
        m.insert("simulate".into(), json!(self.simulate));
        if let Value::Object(f) = fields {
            m.extend(f);
        }
        self.log.push(Value::Object(m).to_string());
    }

    /// PASS, FAIL, SKIP or INFO with one line of evidence, printed at once; a SKIP is also
    /// listed in the test command's summary (a check that needs a real GPU, under the
    /// simulator, is not a failure anywhere, CI included).
    pub fn check(&mut self, status: &str, name: &str, evidence: &str) {
        let line = format!("{status:<4}  {name:<46} {evidence}");
        println!("{line}");
        if status == "SKIP" {
            note_skip(&format!("gpu {name}"), evidence);
        }
        self.checks.push(line);
        if status == "FAIL" {
            self.fails += 1;
        }
        self.record(
            json!({"event": "check", "status": status, "name": name, "evidence": evidence}),
        );
    }

    pub fn skip_sim(&mut self, name: &str, why: &str) {
        self.check("SKIP", name, &format!("(simulated) {why}"));
    }

    pub fn section(&self, title: &str) {
        println!();
        println!("== {title}");
    }

    // ------------------------------------------------------------- clients

    /// The "hold an MPS server while computing" workload.
    pub fn client_cmd(&self, hold: f64) -> Vec<OsString> {
        if self.simulate {
            vec![
                self.control.clone().into(),
                "client".into(),
                "--hold".into(),
                format!("{hold}").into(),
                "--timeout".into(),
                "60".into(),
            ]
        } else {
            self.workload_cmd(&[
                "matmul",
                "--size",
                "4096",
                "--seconds",
                &format!("{hold}"),
                "--batch",
                "10",
            ])
        }
    }

    /// `python workload.py ARGS…`.
    pub fn workload_cmd(&self, args: &[&str]) -> Vec<OsString> {
        let mut v: Vec<OsString> = vec![self.py.clone().into(), self.workload.clone().into()];
        v.extend(args.iter().map(OsString::from));
        v
    }

    /// Deadline of a client that computes `hold` s: torch's import, the CUDA context and
    /// queueing are generous.
    pub fn tmo(&self, hold: f64) -> f64 {
        (hold + if self.simulate { 30.0 } else { 180.0 }).round()
    }

    /// Starts client `label` as `uid`: `CUDA_MPS_PIPE_DIRECTORY=pipe` (none: no MPS), the
    /// daemon's `shm` as its /dev/shm (none: the host's), `env` added, under `timeout_s`.
    #[allow(clippy::too_many_arguments)]
    pub fn launch(
        &mut self,
        label: &str,
        uid: u32,
        pipe: Option<&Path>,
        shm: Option<&Path>,
        timeout_s: f64,
        env: &[(&str, &str)],
        argv: Vec<OsString>,
    ) {
        stop_if_interrupted();
        let home = self.work.join("home").join(uid.to_string());
        let mut e: Vec<(String, String)> = vec![
            ("PATH".into(), SAFE_PATH.into()),
            ("HOME".into(), home.display().to_string()),
            ("LANG".into(), "C.UTF-8".into()),
            ("PYTHONDONTWRITEBYTECODE".into(), "1".into()),
        ];
        if let Some(p) = pipe {
            e.push(("CUDA_MPS_PIPE_DIRECTORY".into(), p.display().to_string()));
        }
        for k in ["LD_LIBRARY_PATH", "PYTHONPATH"] {
            if let Some(v) = std::env::var_os(k).filter(|v| !v.is_empty()) {
                e.push((k.into(), v.to_string_lossy().into_owned()));
            }
        }
        e.extend(env.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        let running = proc::launch(ClientSpec {
            uid,
            shm: shm.map(Path::to_path_buf),
            private_shm: std::mem::take(&mut self.next_private_shm),
            hide: std::mem::take(&mut self.next_hide),
            env: e,
            argv,
            cwd: home,
            out: self.run_dir.join(format!("{label}.out")),
            err: self.run_dir.join(format!("{label}.err")),
            limit: Duration::from_secs_f64(timeout_s),
        });
        if let Some(mut old) = self.clients.insert(label.to_owned(), running) {
            old.abort();
            old.join();
        }
    }

    /// Ends these clients now (SIGTERM, SIGKILL 5 s later) and waits up to 10 s for them:
    /// a section's cleanup.
    pub fn abort_clients(&mut self, labels: &[String]) {
        for l in labels {
            if let Some(c) = self.clients.get(l).filter(|c| c.done().is_none()) {
                c.abort();
            }
        }
        let _ = testkit::common::wait_until(Duration::from_secs(10), || {
            labels.iter().all(|l| self.is_done(l))
        });
    }

    /// `runc delete -f` of every container a section made (a section's cleanup, the
    /// restore's first step).
    pub fn delete_containers(&self) {
        for (runc, root) in &self.runc_roots {
            for c in std::fs::read_dir(root).into_iter().flatten().flatten() {
                let _ = proc::run(
                    Command::new(runc)
                        .arg("--root")
                        .arg(root)
                        .args(["delete", "-f"])
                        .arg(c.file_name()),
                    None,
                    Duration::from_secs(30),
                    Duration::from_secs(5),
                );
            }
        }
    }

    /// A client's pid while it runs.
    pub fn pid_of(&self, label: &str) -> Option<i32> {
        self.clients
            .get(label)
            .filter(|c| c.done().is_none())
            .and_then(|c| c.pid)
    }

    /// Its exit status and time, once it has exited.
    pub fn done_of(&self, label: &str) -> Option<(i32, f64)> {
        self.clients.get(label).and_then(Running::done)
    }

    fn is_done(&self, label: &str) -> bool {
        self.clients.get(label).is_none_or(|c| c.done().is_some())
    }

    /// Every label finished within `timeout_s` (+1 s).
    pub fn wait_done(&self, timeout_s: f64, labels: &[&str]) -> bool {
        let deadline = Instant::now() + Duration::from_secs_f64(timeout_s + 1.0);
        for l in labels {
            while !self.is_done(l) {
                if Instant::now() >= deadline {
                    return false;
                }
                pause(Duration::from_millis(20));
            }
        }
        true
    }

    /// The client has run its first kernel (attached to a server) within `timeout_s`;
    /// false when it ended first.
    pub fn wait_attached(&self, timeout_s: f64, label: &str) -> bool {
        let deadline = Instant::now() + Duration::from_secs_f64(timeout_s);
        let out = self.run_dir.join(format!("{label}.out"));
        let attached = || {
            let text = std::fs::read_to_string(&out).unwrap_or_default();
            if self.simulate {
                text.lines().any(|l| l.starts_with("mps-client "))
            } else {
                text.contains("\"event\": \"first_kernel\"")
            }
        };
        loop {
            if attached() {
                return true;
            }
            if self.is_done(label) || Instant::now() >= deadline {
                return false;
            }
            pause(Duration::from_millis(20));
        }
    }

    /// Normalizes a client's run into its record and its JSON line (`section`).
    pub fn collect(&mut self, label: &str, uid: u32, section: &str) -> Record {
        let read = |ext: &str| {
            std::fs::read_to_string(self.run_dir.join(format!("{label}.{ext}"))).unwrap_or_default()
        };
        let (rc, t_exit) = match self.clients.get(label).and_then(Running::done) {
            Some((rc, t)) => (Some(rc), Some(t)),
            None => (None, None),
        };
        let raw = Raw {
            label: label.to_owned(),
            uid,
            rc,
            t_launch: self.clients.get(label).map(|c| c.t_launch),
            t_exit,
            out: read("out"),
            err: read("err"),
        };
        let kind = if self.simulate { Kind::Sim } else { Kind::Real };
        let rec = client::normalize(&raw, kind);
        self.log
            .push(rec.line(&self.run_id, section, self.simulate));
        self.records.insert(label.to_owned(), rec.clone());
        self.collected.push(label.to_owned());
        rec
    }

    /// A collected client's record (empty when it was not collected).
    pub fn r(&self, label: &str) -> Record {
        self.records.get(label).cloned().unwrap_or_default()
    }

    // ------------------------------------------------------------- control daemons

    /// One control command, as `uid` (the daemon's user), with the pipe dir only.
    pub fn ctl(&self, uid: u32, pipe: &Path, command: &str) -> Ran {
        let mut cmd = Command::new(&self.control);
        cmd.env_clear()
            .env("PATH", SAFE_PATH)
            .env("CUDA_MPS_PIPE_DIRECTORY", pipe);
        if uid != 0 {
            // std drops the supplementary groups too (setgroups(0) as root).
            cmd.uid(uid).gid(uid);
        }
        proc::run(
            &mut cmd,
            Some(&format!("{command}\n")),
            Duration::from_secs(10),
            Duration::from_secs(2),
        )
    }

    /// The reply (or error) on one line; never fails.
    pub fn ctl1(&self, uid: u32, pipe: &Path, command: &str) -> String {
        one_line(&self.ctl(uid, pipe, command).out)
    }

    /// `gpushare daemon start --device 0 ARGS` with config `cfg`.
    pub fn gs_start(&mut self, cfg: &Path, args: &[&str]) -> Daemon {
        stop_if_interrupted();
        let t0 = Instant::now();
        let ran = proc::run(
            Command::new(&self.bins.gpushare)
                .env("GPUSHARE_CONFIG", cfg)
                .args(["daemon", "start", "--device", "0"])
                .args(args),
            None,
            Duration::from_secs(120),
            Duration::from_secs(5),
        );
        let ms = t0.elapsed().as_millis();
        let out = ran.out.trim_end().to_owned();
        let pipe = out
            .lines()
            .filter_map(|l| l.split_once("CUDA_MPS_PIPE_DIRECTORY=").map(|(_, p)| p))
            .next_back()
            .unwrap_or_default()
            .to_owned();
        let id = daemon_id(&out).unwrap_or_default();
        self.record(
            json!({"event": "daemon_start", "args": args.join(" "), "rc": ran.code,
            "ms": ms as u64, "output": out}),
        );
        let pipe = PathBuf::from(pipe);
        let shm = pipe.with_file_name("shm");
        Daemon {
            ok: ran.ok() && !pipe.as_os_str().is_empty() && !id.is_empty(),
            pipe,
            shm,
            id,
            ms,
            out,
        }
    }

    /// `gpushare daemon stop --id`, as each section ends.
    pub fn gs_stop(&mut self, ids: &[&str]) {
        for id in ids.iter().filter(|i| !i.is_empty()) {
            let ran = proc::run(
                Command::new(&self.bins.gpushare)
                    .env("GPUSHARE_CONFIG", &self.cfg)
                    .args(["daemon", "stop", "--id", id]),
                None,
                Duration::from_secs(60),
                Duration::from_secs(5),
            );
            let out = ran.out.trim_end().to_owned();
            self.record(json!({"event": "daemon_stop", "id": id, "rc": ran.code, "output": out}));
            if ran.ok() {
                self.stopped.push(id.to_string());
            } else {
                self.stop_failed
                    .push(format!("{id}: {}", first_line(&out, 220)));
            }
        }
    }

    /// `nvidia-cuda-mps-control -d FLAGS` as root in a private pipe dir (never
    /// /tmp/nvidia-mps), ready once `get_server_list` answers.
    pub fn hand_start(&mut self, name: &str, flags: &[&str]) -> Hand {
        stop_if_interrupted();
        let dir = self.work.join("h").join(name);
        let pipe = dir.join("pipe");
        for d in [&dir, &pipe, &dir.join("log")] {
            let _ = proc::mkdir(d, 0o755);
        }
        self.hand_dirs.push(dir.clone());
        let mut cmd = Command::new(&self.control);
        cmd.env_clear()
            .env("PATH", SAFE_PATH)
            .env("CUDA_MPS_PIPE_DIRECTORY", &pipe)
            .env("CUDA_MPS_LOG_DIRECTORY", dir.join("log"))
            .arg("-d")
            .args(flags);
        if !self.simulate {
            cmd.env("CUDA_VISIBLE_DEVICES", &self.gpu.uuid);
        }
        let ran = proc::run(
            &mut cmd,
            None,
            Duration::from_secs(30),
            Duration::from_secs(5),
        );
        let _ = std::fs::write(dir.join("start.out"), &ran.out);
        let out = calc::cut(&ran.out, 400).replace('\n', " ");
        // A launcher that failed gets a short grace only (a daemon may still have forked).
        let grace = Duration::from_secs(if ran.ok() { 20 } else { 3 });
        let ready = testkit::common::wait_until(grace, || {
            stop_if_interrupted();
            self.ctl(0, &pipe, "get_server_list").ok()
        });
        Hand {
            ok: ready,
            rc: ran.code,
            out,
            dir,
            pipe,
        }
    }

    /// Quits a daemon started by hand; kills it past a deadline.
    pub fn quit_hand_daemon(&self, dir: &Path) {
        let pipe = dir.join("pipe");
        if !pipe.is_dir() {
            return;
        }
        let pid = std::fs::read_to_string(pipe.join("nvidia-cuda-mps-control.pid"))
            .ok()
            .and_then(|p| p.trim().parse::<i32>().ok());
        if pipe.join("control").exists() {
            let _ = self.ctl(0, &pipe, "quit");
        }
        if let Some(pid) = pid {
            let work = self.work_str();
            let gone = testkit::common::wait_until(Duration::from_secs(15), || {
                !proc::alive_ours(pid, &work)
            });
            if !gone {
                proc::signal(pid, nix::sys::signal::Signal::SIGKILL);
            }
        }
    }

    // ------------------------------------------------------------- the end

    /// Stops everything, checks nothing is left, prints the summary, appends the JSON
    /// lines; the exit status: 1 when a check failed, else 0.
    pub fn restore(&mut self, aborted: Option<String>) -> u8 {
        if let Some(why) = aborted {
            self.check("FAIL", "tier ran to the end", &format!("aborted: {why}"));
        }
        self.section("restore");
        // Clients first (their deadlines are generous; nothing should be running here).
        for c in self.clients.values().filter(|c| c.done().is_none()) {
            c.abort();
        }
        let _ = testkit::common::wait_until(Duration::from_secs(15), || {
            self.clients.values().all(|c| c.done().is_some())
        });
        for c in self.clients.values_mut() {
            if c.done().is_some() {
                c.join();
            }
        }
        // Containers before their daemons (their poststop hooks run).
        self.delete_containers();
        if !self.stop_failed.is_empty() {
            let ev = self.stop_failed.join(" ");
            self.check("FAIL", "gpushare daemon stop --id, per section", &ev);
        } else if !self.stopped.is_empty() {
            let ev = format!(
                "{} daemons stopped: {}",
                self.stopped.len(),
                self.stopped.join(" ")
            );
            self.check("PASS", "gpushare daemon stop --id, per section", &ev);
        }
        if self.cfg.exists() {
            let ran = proc::run(
                Command::new(&self.bins.gpushare)
                    .env("GPUSHARE_CONFIG", &self.cfg)
                    .args(["daemon", "stop", "--all", "--force"]),
                None,
                Duration::from_secs(120),
                Duration::from_secs(5),
            );
            let out = ran.out.trim_end();
            if ran.ok() {
                let ev = first_line(
                    if out.is_empty() {
                        "nothing to stop"
                    } else {
                        out
                    },
                    220,
                );
                self.check("PASS", "gpushare daemon stop --all --force", &ev);
            } else {
                let ev = format!("exit {}: {}", ran.code, first_line(out, 220));
                self.check("FAIL", "gpushare daemon stop --all --force", &ev);
            }
        }
        for d in self.hand_dirs.clone() {
            self.quit_hand_daemon(&d);
        }
        // Anything of this run still alive? (Its env or argv names the work dir.)
        let work = self.work_str();
        let mut pids = proc::leftover_pids(&work);
        let _ = testkit::common::wait_until(Duration::from_secs(10), || {
            pids = proc::leftover_pids(&work);
            pids.is_empty()
        });
        if pids.is_empty() {
            self.check(
                "PASS",
                "no process left behind",
                &format!("no live process names {work}"),
            );
        } else {
            let left: Vec<String> = pids
                .iter()
                .map(|p| format!("{p}({})", calc::cut(&proc::cmdline(*p), 60)))
                .collect();
            for p in &pids {
                proc::signal(*p, nix::sys::signal::Signal::SIGTERM);
            }
            std::thread::sleep(Duration::from_secs(1));
            for p in &pids {
                if proc::alive_ours(*p, &work) {
                    proc::signal(*p, nix::sys::signal::Signal::SIGKILL);
                }
            }
            let ev = format!("still alive after stop (now killed): {}", left.join(" "));
            self.check("FAIL", "no process left behind", &ev);
        }
        let mounts = mounts_below(&self.work);
        if mounts.is_empty() {
            self.check(
                "PASS",
                "no mount left behind",
                &format!("/proc/mounts has nothing under {work}"),
            );
        } else {
            testkit::common::umount_below(&self.work);
            let ev = format!("left mounted (now lazily unmounted): {}", mounts.join(" "));
            self.check("FAIL", "no mount left behind", &ev);
        }
        let new_shm: Vec<String> = shm_entries()
            .difference(&self.shm_before)
            .cloned()
            .collect();
        if !new_shm.is_empty() {
            let ev = format!(
                "new entries since the start (left as they are): {}",
                new_shm.join(" ")
            );
            self.check("INFO", "host /dev/shm", &ev);
        }
        if let Some(before) = self.gpu_state_before.clone() {
            let after = gpu_state();
            let semi = |s: &str| s.lines().map(|l| format!("{l};")).collect::<String>();
            if after == before {
                self.check("PASS", "compute mode and MIG unchanged", &semi(&after));
            } else {
                let ev = format!("before: {} after: {}", semi(&before), semi(&after));
                self.check("FAIL", "compute mode and MIG unchanged", &ev);
            }
        } else if self.simulate {
            self.skip_sim(
                "compute mode and MIG unchanged",
                "no driver: only read on a GPU, never set",
            );
        }
        // Results.
        let what = if self.simulate {
            "SIMULATOR, not a GPU".to_owned()
        } else {
            format!("{}, driver {}", self.gpu.name, self.gpu.driver)
        };
        self.section(&format!("summary ({what})"));
        for c in &self.checks {
            println!("{c}");
        }
        let rows: Vec<&Record> = self
            .collected
            .iter()
            .filter_map(|l| self.records.get(l))
            .collect();
        if !rows.is_empty() {
            println!();
            println!("clients (seconds since the run's first client was launched; latency = launch to first kernel):");
            print!("{}", client::table(&rows));
        }
        for table in &self.tables {
            println!();
            print!("{table}");
        }
        match self.append_out() {
            Ok(()) => {
                println!();
                println!(
                    "{ME}: raw JSON lines appended to {}",
                    self.out_file.display()
                );
            }
            Err(e) => {
                println!("{ME}: cannot append to {}: {e}", self.out_file.display());
                self.fails += 1;
            }
        }
        let _ = std::fs::write(self.work.join("run.jsonl"), self.log.join("\n") + "\n");
        if self.keep {
            println!("{ME}: work directory kept: {work}");
        } else if mounts_below(&self.work).is_empty() {
            let _ = std::fs::remove_dir_all(&self.work);
        } else {
            println!("{ME}: {work} still has mounts; not removed");
        }
        let count = |s: &str| self.checks.iter().filter(|c| c.starts_with(s)).count();
        println!(
            "{ME}: {} passed, {} failed, {} skipped{}",
            count("PASS"),
            count("FAIL"),
            count("SKIP"),
            if self.simulate { " (simulator)" } else { "" }
        );
        u8::from(self.fails > 0)
    }

    fn append_out(&self) -> std::io::Result<()> {
        if let Some(dir) = self.out_file.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.out_file)?;
        for line in &self.log {
            writeln!(f, "{line}")?;
        }
        Ok(())
    }
}

/// The 32-hex-digit daemon id in `daemon start`'s output (`… daemon <id> (pid …`).
pub fn daemon_id(out: &str) -> Option<String> {
    let mut found = None;
    let mut rest = out;
    while let Some(at) = rest.find("daemon ") {
        let tail = &rest[at + 7..];
        let hex: String = tail.chars().take_while(|c| c.is_ascii_hexdigit()).collect();
        if hex.len() == 32
            && hex.chars().all(|c| !c.is_ascii_uppercase())
            && tail[32..].starts_with(' ')
        {
            found = Some(hex);
        }
        rest = &rest[at + 7..];
    }
    found
}
