//! The fault tier (docs/reliability.md, "Crash at any instant"): the create path, driven
//! over and over across two users and two devices with concurrent creates, while one of
//! gpushare's processes is killed with SIGKILL at a random instant; after every kill the
//! invariants of check.rs are checked. docs/reliability.md holds the figures of a long run
//! and what is not guaranteed.
//!
//! ```text
//! cargo test --test faults                               # the short run (scripts/test)
//! cargo test --release --test faults -- --kills 1000 --seed 7   # the long run (scripts/faults)
//! ```
//!
//! A round: one to three container lifecycles (shim `create` → createRuntime hook →
//! supervisor start → control daemon start → limits applied → `start` → `delete` →
//! poststop), sometimes with `gpushare daemon start`, `gpushare daemon stop --force`,
//! `gpushare gc` or `gpushare status` beside them, all at once; the supervisors' idle
//! timeout (1 s) stops daemons between rounds. At a random instant (a timer, not an
//! instrumented point) one process of the run is picked — its kind first, uniformly among
//! the kinds running then (three times in four among the short-lived ones, the create
//! path's, when one runs), then a process of that kind — and killed with SIGKILL. Some
//! rounds instead wait for an idle stop to begin (its tombstone appears), or for a
//! supervisor to start its daemon (the record says `starting`), and kill that supervisor
//! or its daemon a random moment later: a timer alone rarely lands in those few
//! milliseconds. Then: the next
//! create of the killed process's identity must succeed within its timeout and serve an
//! MPS client, `gpushare gc` must succeed, and every invariant must hold. A sampler looks
//! for two control daemons of one identity all along.
//!
//! Exit status: 0 with no violation, 1 with any (each printed as it is found), 2 on a
//! usage or setup error. The seed makes the choices of a run repeatable (not the instants
//! the processes reach, which the machine decides).
//!
//! Invariants of the tier itself: everything lives under one temp dir (state dir, runc
//! root, bundles, logs) and the containers' cgroups under `gsfault-<pid>/`; it never
//! touches /run/gpushare or the machine's engines; only processes of this run are killed
//! (procs.rs); every process it started is stopped, and every cgroup removed, even when a
//! check fails.

mod check;
mod procs;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use procs::{Kind, Proc};
use serde_json::Value;
use testkit::libtest::Libtest;
use testkit::{gpushare, runtime, Env};

const TEST_NAME: &str = "fault_tier";
/// The short run's kills (scripts/test).
const SHORT_KILLS: u32 = 25;

/// The command line; each variable fills its option where the command line leaves it unset.
#[derive(Parser)]
#[command(
    bin_name = "cargo test [--release] --test faults --",
    about = "The fault tier, as root.",
    args_override_self = true,
    disable_version_flag = true
)]
struct Cli {
    /// Stop after N kills (default 25, the short run; the long run: 1000)
    /// [GPUSHARE_FAULT_KILLS]
    #[arg(long, value_name = "N")]
    kills: Option<u32>,
    /// The long run: --kills 1000
    #[arg(long)]
    long: bool,
    /// The random choices' seed (default: from the clock; printed) [GPUSHARE_FAULT_SEED]
    #[arg(long, value_name = "S")]
    seed: Option<u64>,
    /// Print every round
    #[arg(long)]
    verbose: bool,
    #[command(flatten)]
    libtest: Libtest,
}

/// The options, `None` when there is nothing to run (`--help`, `--list`, filtered out).
fn parse_options() -> Result<Option<Options>, String> {
    let o = match Cli::try_parse() {
        Ok(o) => o,
        Err(e) if e.use_stderr() => return Err(e.to_string()),
        Err(help) => {
            print!("{help}");
            return Ok(None);
        }
    };
    if o.libtest.list {
        println!("{TEST_NAME}: test");
        return Ok(None);
    }
    if let Some(why) = o.libtest.filtered_out(TEST_NAME) {
        println!("{TEST_NAME}: filtered out: {why}");
        return Ok(None);
    }
    let env = |k: &str| -> Result<Option<u64>, String> {
        match std::env::var(k).ok().filter(|v| !v.is_empty()) {
            None => Ok(None),
            Some(v) => v
                .parse()
                .map(Some)
                .map_err(|_| format!("{k}={v:?} is not a number")),
        }
    };
    let kills = match (o.long, o.kills) {
        (true, _) => 1000,
        (false, Some(k)) => k,
        (false, None) => match env("GPUSHARE_FAULT_KILLS")? {
            Some(k) => {
                u32::try_from(k).map_err(|_| format!("GPUSHARE_FAULT_KILLS={k} is too large"))?
            }
            None => SHORT_KILLS,
        },
    };
    let seed = match o.seed {
        Some(s) => s,
        None => env("GPUSHARE_FAULT_SEED")?.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64 % 1_000_000)
        }),
    };
    Ok(Some(Options {
        kills,
        seed,
        verbose: o.verbose,
    }))
}

struct Options {
    kills: u32,
    seed: u64,
    verbose: bool,
}

/// splitmix64: the run's random choices, repeatable from the seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// One identity: a user on a device, with its own thread percentage (so that a start
/// applies limits). `daemon` and `reference` come from an undisturbed first create.
struct Identity {
    uid: u32,
    device: &'static str,
    percentage: &'static str,
    daemon: String,
    reference: Value,
}

impl Identity {
    fn label(&self) -> String {
        format!("uid {} on GPU {}", self.uid, self.device)
    }
}

/// What one round's processes did; shared with the threads that run them.
#[derive(Default)]
struct Outcomes {
    violations: Vec<String>,
}

/// The run: its env, its identities, the containers it made, its counts.
struct Run {
    env: Env,
    ids: Vec<Identity>,
    cgroup_parent: String,
    seq: Mutex<u64>,
    containers: Mutex<Vec<String>>,
    runc: PathBuf,
}

/// Runs `cmd` until it exits or `limit` passes (then kills it): its status, or `None` when
/// it had to be killed. A command that cannot be started at all panics: that is the
/// machine's failure, not gpushare's, and the run says so rather than count it.
fn run_limited(cmd: &mut Command, limit: Duration) -> Option<ExitStatus> {
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {:?}: {e}", cmd.get_program()));
    let deadline = Instant::now() + limit;
    loop {
        if let Ok(Some(st)) = child.try_wait() {
            return Some(st);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A create's limit: `start-timeout` (10 s) plus the hook's own margin and a slow machine's.
const CREATE_LIMIT: Duration = Duration::from_secs(25);

impl Run {
    fn new_id(&self) -> String {
        let mut s = self.seq.lock().unwrap();
        *s += 1;
        format!("f{}", *s)
    }

    /// A bundle for identity `i` running `script`: its path and config.json's bytes.
    fn bundle(&self, i: usize, cid: &str, script: &str) -> (PathBuf, Vec<u8>) {
        let ident = &self.ids[i];
        let c = self
            .env
            .request(cid, ident.uid, ident.device)
            .annotation("gpushare.io/active-thread-percentage", ident.percentage)
            .sh(script)
            .bundle();
        let path = c.bundle.join("config.json");
        let mut v: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        v["linux"]["cgroupsPath"] = Value::from(format!("/{}/{cid}", self.cgroup_parent));
        let bytes = serde_json::to_vec_pretty(&v).unwrap();
        std::fs::write(&path, &bytes).unwrap();
        (c.bundle.clone(), bytes)
    }

    /// The shim with runc's flags for this run, in the bundle (so that runc and its hooks
    /// run there too: procs.rs tells a hook's container by its working directory).
    fn shim(&self, bundle: &Path, args: &[&str]) -> Command {
        let mut c = self.env.cmd(runtime());
        c.current_dir(bundle)
            .arg("--root")
            .arg(&self.env.runc_root)
            .arg("--log")
            .arg(bundle.join("log.json"))
            .args(["--log-format", "json"])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        c
    }

    fn runc_state(&self, cid: &str) -> Option<String> {
        let out = Command::new(&self.runc)
            .arg("--root")
            .arg(&self.env.runc_root)
            .args(["state", cid])
            .stderr(Stdio::null())
            .output()
            .ok()?;
        let v: Value = serde_json::from_slice(&out.stdout).ok()?;
        v["status"].as_str().map(str::to_owned)
    }

    fn runc_delete(&self, cid: &str) {
        let _ = run_limited(
            Command::new(&self.runc)
                .arg("--root")
                .arg(&self.env.runc_root)
                .args(["delete", "-f", cid])
                .stdout(Stdio::null())
                .stderr(Stdio::null()),
            Duration::from_secs(20),
        );
    }

    /// One container's life: create, start (it runs `script`), wait for it, delete (its
    /// poststop hook). Returns whether the create succeeded, its bundle and original bytes,
    /// and its stdout; `hung` gets a line for a step that passed its limit.
    fn lifecycle(&self, i: usize, script: &str, hung: &Mutex<Outcomes>) -> Lifecycle {
        let cid = self.new_id();
        let (bundle, original) = self.bundle(i, &cid, script);
        self.containers.lock().unwrap().push(cid.clone());
        let stdout = bundle.join("stdout");
        let mut exit = String::from("killed at its limit");
        let created = {
            let mut cmd = self.shim(&bundle, &["create", "--bundle"]);
            cmd.arg(&bundle).arg(&cid);
            if let Ok(f) = std::fs::File::create(&stdout) {
                cmd.stdout(f);
            }
            match run_limited(&mut cmd, CREATE_LIMIT) {
                Some(st) => {
                    exit = st.to_string();
                    st.success()
                }
                None => {
                    hung.lock().unwrap().violations.push(format!(
                        "create of {cid} ({}) did not end within {CREATE_LIMIT:?}",
                        self.ids[i].label()
                    ));
                    false
                }
            }
        };
        if created {
            let started = run_limited(
                &mut self.shim(&bundle, &["start", &cid]),
                Duration::from_secs(20),
            )
            .is_some_and(|s| s.success());
            if started {
                testkit::wait_until(Duration::from_secs(20), || {
                    self.runc_state(&cid).is_none_or(|s| s == "stopped")
                });
            }
            let _ = run_limited(
                &mut self.shim(&bundle, &["delete", "-f", &cid]),
                Duration::from_secs(20),
            );
        }
        Lifecycle {
            cid,
            identity: i,
            created,
            exit,
            bundle,
            original,
            stdout: std::fs::read_to_string(&stdout).unwrap_or_default(),
        }
    }

    fn gpushare(&self, args: &[&str], limit: Duration) -> Option<std::process::Output> {
        let mut child = self
            .env
            .cmd(gpushare())
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .ok()?;
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return child.wait_with_output().ok();
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = child.kill();
        let _ = child.wait();
        None
    }

    fn daemon_start_args(&self, i: usize) -> Vec<String> {
        let ident = &self.ids[i];
        [
            "daemon",
            "start",
            "--device",
            ident.device,
            "--uid",
            &ident.uid.to_string(),
            "--active-thread-percentage",
            ident.percentage,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    }

    /// Which identity a killed process worked for, when it can be told.
    fn identity_of(&self, p: &Proc) -> Option<usize> {
        if let Some(d) = &p.daemon {
            return self.ids.iter().position(|i| &i.daemon == d);
        }
        if matches!(p.kind, Kind::DaemonStart) {
            let uid = p
                .args
                .iter()
                .position(|a| a == "--uid")
                .and_then(|i| p.args.get(i + 1));
            let dev = p
                .args
                .iter()
                .position(|a| a == "--device")
                .and_then(|i| p.args.get(i + 1));
            return self.ids.iter().position(|i| {
                Some(&i.uid.to_string()) == uid && dev.is_some_and(|d| d == i.device)
            });
        }
        // The shim, runc and the hooks run in the container's bundle (cwd).
        let cid = p.cwd.as_ref()?.file_name()?.to_string_lossy().into_owned();
        let cfg: Value = serde_json::from_slice(
            &std::fs::read(
                self.env
                    .path()
                    .join("bundles")
                    .join(&cid)
                    .join("config.json"),
            )
            .ok()?,
        )
        .ok()?;
        let uid = cfg["process"]["user"]["uid"].as_u64()?;
        let dev = cfg["annotations"]["gpushare.io/device"]
            .as_str()?
            .to_owned();
        self.ids
            .iter()
            .position(|i| u64::from(i.uid) == uid && i.device == dev)
    }

    /// What the killed process was doing, in words (its phase).
    fn phase(&self, p: &Proc, all: &[Proc]) -> String {
        let rec = |id: &str| -> Option<Value> {
            serde_json::from_slice(
                &std::fs::read(self.env.state.join("mps").join(id).join("daemon.json")).ok()?,
            )
            .ok()
        };
        let tomb = |id: &str| {
            self.env
                .state
                .join("mps")
                .join(format!(".{id}.removing"))
                .exists()
        };
        match (p.kind, p.daemon.as_deref()) {
            (Kind::Supervisor, Some(id)) => {
                if tomb(id) {
                    return "idle stop".into();
                }
                let has_daemon = all
                    .iter()
                    .any(|d| d.kind == Kind::ControlDaemon && d.ppid == p.pid);
                match rec(id)
                    .as_ref()
                    .and_then(|r| r["status"].as_str().map(str::to_owned))
                {
                    Some(s) if s == "starting" || s == "restarting" => {
                        if has_daemon {
                            "daemon started, limits being applied".into()
                        } else {
                            "start (before its daemon)".into()
                        }
                    }
                    Some(s) if s == "ready" => "watching a ready daemon".into(),
                    Some(s) => s,
                    None => "no record".into(),
                }
            }
            (Kind::ControlDaemon, Some(id)) => {
                match rec(id)
                    .as_ref()
                    .and_then(|r| r["status"].as_str().map(str::to_owned))
                {
                    Some(s) if s == "ready" => "ready".into(),
                    Some(_) => "being started (limits)".into(),
                    None => "no record".into(),
                }
            }
            _ => "-".into(),
        }
    }
}

struct Lifecycle {
    cid: String,
    identity: usize,
    created: bool,
    /// How the shim's create exited.
    exit: String,
    bundle: PathBuf,
    original: Vec<u8>,
    stdout: String,
}

/// The figures printed at the end.
#[derive(Default)]
struct Tally {
    rounds: u64,
    kills: u64,
    by_kind: BTreeMap<(String, String), u64>,
    violations: Vec<String>,
    creates: u64,
    creates_failed: u64,
    transient_doubles: u64,
    started: Option<Instant>,
}

fn main() {
    let opts = match parse_options() {
        Ok(Some(o)) => o,
        Ok(None) => return,
        Err(e) => {
            eprintln!("faults: {e}");
            std::process::exit(2);
        }
    };
    if !nix::unistd::geteuid().is_root() {
        eprintln!("faults: run as root (the tier drives real runc and mounts tmpfs): ./scripts/test or sudo");
        std::process::exit(2);
    }
    let code = run(&opts);
    std::process::exit(code);
}

fn run(opts: &Options) -> i32 {
    let started = Instant::now();
    println!(
        "fault tier: seed {}, target {} kills (SIGKILL at random instants), 2 users x 2 devices",
        opts.seed, opts.kills
    );
    let env = Env::with_config("idle-timeout = \"1s\"\nlimit-check-interval = \"500ms\"");
    let runc = testkit::which("runc").expect("runc");
    let mut r = Run {
        env,
        ids: Vec::new(),
        cgroup_parent: format!("gsfault-{}", std::process::id()),
        seq: Mutex::new(0),
        containers: Mutex::new(Vec::new()),
        runc,
    };
    for (uid, percentage) in [(1000, "50"), (2000, "30")] {
        for device in ["0", "2"] {
            r.ids.push(Identity {
                uid,
                device,
                percentage,
                daemon: String::new(),
                reference: Value::Null,
            });
        }
    }
    let mut tally = Tally {
        started: Some(started),
        ..Tally::default()
    };
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        rounds(&mut r, opts, &mut tally);
    }));
    if let Err(p) = result {
        let msg = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default();
        tally.violations.push(format!("the tier stopped: {msg}"));
    }
    let left = cleanup(&r);
    tally.violations.extend(left);
    if tally.kills < u64::from(opts.kills) {
        // A run that kills less than asked has not shown what it claims.
        tally.violations.push(format!(
            "only {} of {} kills in {} rounds",
            tally.kills, opts.kills, tally.rounds
        ));
    }
    report(opts, &tally, started.elapsed());
    drop(r);
    i32::from(!tally.violations.is_empty())
}

/// The first, undisturbed create of each identity: its daemon id and its reference edit.
fn warm_up(r: &mut Run) {
    let hung = Mutex::new(Outcomes::default());
    for i in 0..r.ids.len() {
        let l = r.lifecycle(i, "gpushare-mps-sim client", &hung);
        assert!(
            l.created && l.stdout.contains("shm=ok"),
            "the undisturbed create of {} failed: {}; stdout {:?}",
            r.ids[i].label(),
            std::fs::read_to_string(l.bundle.join("log.json")).unwrap_or_default(),
            l.stdout
        );
        let v: Value =
            serde_json::from_slice(&std::fs::read(l.bundle.join("config.json")).unwrap()).unwrap();
        check::complete_edit(&v).unwrap_or_else(|e| panic!("reference edit of {}: {e}", l.cid));
        r.ids[i].daemon = v["annotations"]["gpushare.io/daemon"]
            .as_str()
            .unwrap()
            .to_owned();
        r.ids[i].reference = check::normalise(v);
        r.runc_delete(&l.cid);
    }
    let mut daemons: Vec<&str> = r.ids.iter().map(|i| i.daemon.as_str()).collect();
    daemons.sort();
    daemons.dedup();
    assert_eq!(daemons.len(), 4, "four identities, four daemons");
    assert!(hung.into_inner().unwrap().violations.is_empty());
}

/// The sampler: two control daemons of one identity, looked for every 20 ms while the
/// rounds run. A pair seen in two samples in a row is a violation; in one only, counted
/// as transient (a sample can fall between a supervisor's death and its daemon's).
fn sampler(
    config: PathBuf,
    state: PathBuf,
    stop: Arc<AtomicBool>,
    found: Arc<Mutex<(Vec<String>, u64)>>,
) {
    let mut last: BTreeMap<String, Vec<i32>> = BTreeMap::new();
    let mut reported: Vec<Vec<i32>> = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        let now = procs::supervised_daemons(&procs::scan(&config, &state));
        for (id, pids) in &now {
            let persisted = last
                .get(id)
                .is_some_and(|before| before.iter().filter(|p| pids.contains(p)).count() > 1);
            let mut f = found.lock().unwrap();
            if !persisted {
                f.1 += 1;
            } else if !reported.contains(pids) {
                reported.push(pids.clone());
                f.0.push(format!(
                    "daemon {id} has two control daemons under live supervisors: pids {pids:?}"
                ));
            }
        }
        last = now;
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn rounds(r: &mut Run, opts: &Options, tally: &mut Tally) {
    warm_up(r);
    let mut rng = Rng(opts.seed);
    let stop = Arc::new(AtomicBool::new(false));
    let doubles = Arc::new(Mutex::new((Vec::new(), 0u64)));
    let sampler_thread = {
        let (c, s, st, d) = (
            r.env.config.clone(),
            r.env.state.clone(),
            stop.clone(),
            doubles.clone(),
        );
        std::thread::spawn(move || sampler(c, s, st, d))
    };
    // Rounds end at the kill target, or at a round limit that a run without kills
    // (something wrong with the targets) cannot pass.
    let max_rounds = u64::from(opts.kills) * 4 + 20;
    while tally.kills < u64::from(opts.kills) && tally.rounds < max_rounds {
        tally.rounds += 1;
        let found = round(r, &mut rng, tally, opts);
        let mut d = doubles.lock().unwrap();
        tally.transient_doubles = d.1;
        let all: Vec<String> = found.into_iter().chain(d.0.drain(..)).collect();
        for v in &all {
            println!("VIOLATION round {}: {v}", tally.rounds);
        }
        tally.violations.extend(all);
        if tally.rounds % 50 == 0 {
            println!(
                "fault tier: round {}, {} kills, {} violations, {:.0} s",
                tally.rounds,
                tally.kills,
                tally.violations.len(),
                tally.started.map_or(0.0, |s| s.elapsed().as_secs_f64())
            );
        }
    }
    stop.store(true, Ordering::Relaxed);
    let _ = sampler_thread.join();
    let d = doubles.lock().unwrap();
    tally.transient_doubles = d.1;
    tally.violations.extend(d.0.iter().cloned());
}

/// What runs beside the containers in a round.
#[derive(Debug, Clone, Copy)]
enum Extra {
    DaemonStart(usize),
    DaemonStop(usize),
    Gc,
    Status,
}

/// One round: the operations at once, one kill, the next create, gc, the checks.
fn round(r: &Run, rng: &mut Rng, tally: &mut Tally, opts: &Options) -> Vec<String> {
    let n = r.ids.len() as u64;
    let lifecycles: Vec<usize> = (0..1 + rng.below(3))
        .map(|_| rng.below(n) as usize)
        .collect();
    let mut extras = Vec::new();
    if rng.chance(25) {
        extras.push(Extra::DaemonStart(rng.below(n) as usize));
    }
    if rng.chance(15) {
        extras.push(Extra::DaemonStop(rng.below(n) as usize));
    }
    if rng.chance(20) {
        extras.push(Extra::Gc);
    }
    if rng.chance(30) {
        extras.push(Extra::Status);
    }
    // An idle-stop round: no timer, the kill comes when an idle stop begins; a start
    // round: when a supervisor starts its daemon (and applies its limits).
    let idle_round = rng.chance(8);
    let start_round = !idle_round && rng.chance(10);
    let start_delay = Duration::from_millis(rng.below(25));
    let start_daemon = rng.chance(50);
    let delay = if rng.chance(70) {
        Duration::from_millis(rng.below(300))
    } else {
        Duration::from_millis(rng.below(1500))
    };
    let kind_pick = rng.next() >> 8;
    let proc_pick = rng.next();
    let outcomes = Mutex::new(Outcomes::default());
    let mut killed: Option<(Proc, String)> = None;
    let mut results: Vec<Lifecycle> = Vec::new();
    std::thread::scope(|s| {
        let mut handles = Vec::new();
        for &i in &lifecycles {
            let o = &outcomes;
            handles.push(s.spawn(move || Some(r.lifecycle(i, "true", o))));
        }
        let mut extra_handles = Vec::new();
        for &e in &extras {
            let o = &outcomes;
            extra_handles.push(s.spawn(move || extra(r, e, o)));
        }
        let ops_done = || {
            handles.iter().all(|h| h.is_finished()) && extra_handles.iter().all(|h| h.is_finished())
        };
        if idle_round {
            killed = idle_kill(r);
        } else if start_round {
            killed = start_kill(r, start_delay, start_daemon);
        } else {
            std::thread::sleep(delay);
            let mut salt = 0u64;
            loop {
                let all = procs::scan(&r.env.config, &r.env.state);
                let mut kinds: Vec<Kind> = Kind::ALL
                    .into_iter()
                    .filter(|k| all.iter().any(|p| p.kind == *k))
                    .collect();
                // Supervisors and daemons are there at nearly every instant, the create
                // path's processes for a few hundred milliseconds: three times in four, a
                // short-lived one is picked when one runs.
                let brief: Vec<Kind> = kinds.iter().copied().filter(|k| k.brief()).collect();
                if !brief.is_empty() && kind_pick % 4 != 0 {
                    kinds = brief;
                }
                if !kinds.is_empty() {
                    let k = kinds[((kind_pick + salt) % kinds.len() as u64) as usize];
                    let of: Vec<&Proc> = all.iter().filter(|p| p.kind == k).collect();
                    let p = of[((proc_pick + salt) % of.len() as u64) as usize].clone();
                    let phase = r.phase(&p, &all);
                    if procs::kill(&p) {
                        killed = Some((p, phase));
                        break;
                    }
                }
                if ops_done() {
                    break;
                }
                salt += 1;
                std::thread::sleep(Duration::from_millis(2 + (salt * 7) % 40));
            }
        }
        for h in handles {
            match h.join() {
                Ok(Some(l)) => results.push(l),
                Ok(None) => {}
                Err(p) => std::panic::resume_unwind(p),
            }
        }
        for h in extra_handles {
            if let Err(p) = h.join() {
                std::panic::resume_unwind(p);
            }
        }
    });
    let mut found = outcomes.into_inner().unwrap().violations;
    // Every container of the round goes, whatever its create did.
    for l in &results {
        r.runc_delete(&l.cid);
    }
    tally.creates += results.len() as u64;
    tally.creates_failed += results.iter().filter(|l| !l.created).count() as u64;
    // config.json: the original bytes or a complete edit, whatever was killed.
    for l in &results {
        if let Some(v) = check::config_json(&l.bundle, &l.original, &r.ids[l.identity].reference) {
            found.push(v);
        }
    }
    let target = killed
        .as_ref()
        .and_then(|(p, _)| r.identity_of(p))
        .unwrap_or_else(|| lifecycles[0]);
    if let Some((p, phase)) = &killed {
        tally.kills += 1;
        *tally
            .by_kind
            .entry((p.kind.name().to_owned(), phase.clone()))
            .or_default() += 1;
        if opts.verbose {
            println!(
                "[{:.1} s] round {}: killed {} pid {} ({phase}); next create: {}",
                tally.started.map_or(0.0, |s| s.elapsed().as_secs_f64()),
                tally.rounds,
                p.kind.name(),
                p.pid,
                r.ids[target].label()
            );
        }
    }
    // The next create of the identity: within its limit, and its client served.
    let hung = Mutex::new(Outcomes::default());
    let next = r.lifecycle(target, "gpushare-mps-sim client", &hung);
    found.extend(hung.into_inner().unwrap().violations);
    r.runc_delete(&next.cid);
    if !next.created || !next.stdout.contains("shm=ok") {
        let why = std::fs::read_to_string(next.bundle.join("log.json")).unwrap_or_default();
        found.push(format!(
            "the next create of {} after {} failed (create {}): {} stdout {:?}",
            r.ids[target].label(),
            killed
                .as_ref()
                .map_or("no kill".to_owned(), |(p, ph)| format!(
                    "killing the {} ({ph})",
                    p.kind.name()
                )),
            next.exit,
            why.lines().last().unwrap_or("(no log)"),
            next.stdout.trim()
        ));
    }
    if let Some(v) = check::config_json(&next.bundle, &next.original, &r.ids[target].reference) {
        found.push(v);
    }
    // gc cleans whatever the kill left; then every record must name a live process.
    match r.gpushare(&["gc"], Duration::from_secs(40)) {
        None => found.push("gpushare gc did not end within 40 s".into()),
        Some(o) if !o.status.success() => {
            found.push(format!("gpushare gc failed: {}", testkit::text(&o).trim()))
        }
        Some(_) => {}
    }
    let supervised: Vec<String> = procs::scan(&r.env.config, &r.env.state)
        .into_iter()
        .filter(|p| p.kind == Kind::Supervisor)
        .filter_map(|p| p.daemon)
        .collect();
    found.extend(check::records(&r.env.state, &supervised));
    found.extend(check::locks(&r.env.state.join("locks")));
    found.extend(check::status(&r.env));
    // Each violation says what the round killed.
    let context = killed.as_ref().map_or("no kill".to_owned(), |(p, phase)| {
        format!(
            "killed {} pid {} ({phase}): {:?}",
            p.kind.name(),
            p.pid,
            p.args
        )
    });
    found
        .into_iter()
        .map(|v| format!("{v} [round {}: {context}]", tally.rounds))
        .collect()
}

/// An idle-stop round: waits (up to 4 s, while the ops run and after) for a tombstone
/// `.<id>.removing` to appear, and kills that daemon's supervisor then.
fn idle_kill(r: &Run) -> Option<(Proc, String)> {
    let deadline = Instant::now() + Duration::from_secs(4);
    let mps = r.env.state.join("mps");
    while Instant::now() < deadline {
        let tomb = std::fs::read_dir(&mps)
            .into_iter()
            .flatten()
            .flatten()
            .find_map(|e| {
                let n = e.file_name().to_string_lossy().into_owned();
                n.strip_prefix('.')
                    .and_then(|n| n.strip_suffix(".removing"))
                    .map(str::to_owned)
            });
        if let Some(id) = tomb {
            let all = procs::scan(&r.env.config, &r.env.state);
            if let Some(p) = all
                .iter()
                .find(|p| p.kind == Kind::Supervisor && p.daemon.as_deref() == Some(id.as_str()))
            {
                if procs::kill(p) {
                    return Some((p.clone(), "idle stop".into()));
                }
            }
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    None
}

/// A start round: waits (up to 4 s) for a daemon record that says `starting` or
/// `restarting` under a live supervisor, then, `delay` later, kills that supervisor or
/// (`daemon`, when it has one by then) its control daemon: the instants between a
/// supervisor's start and its daemon's readiness, limits applied, that a timer rarely
/// hits with a daemon that starts in tens of milliseconds.
fn start_kill(r: &Run, delay: Duration, daemon: bool) -> Option<(Proc, String)> {
    let deadline = Instant::now() + Duration::from_secs(4);
    let mps = r.env.state.join("mps");
    while Instant::now() < deadline {
        let starting = r.ids.iter().find_map(|i| {
            let rec: Value = serde_json::from_slice(
                &std::fs::read(mps.join(&i.daemon).join("daemon.json")).ok()?,
            )
            .ok()?;
            let status = rec["status"].as_str()?;
            (status == "starting" || status == "restarting").then(|| i.daemon.clone())
        });
        if let Some(id) = starting {
            std::thread::sleep(delay);
            let all = procs::scan(&r.env.config, &r.env.state);
            let sup = all
                .iter()
                .find(|p| p.kind == Kind::Supervisor && p.daemon.as_deref() == Some(id.as_str()));
            if let Some(sup) = sup {
                let child = all
                    .iter()
                    .find(|d| d.kind == Kind::ControlDaemon && d.ppid == sup.pid);
                let target = match child {
                    Some(d) if daemon => d,
                    _ => sup,
                };
                let phase = r.phase(target, &all);
                if procs::kill(target) {
                    return Some((target.clone(), phase));
                }
            }
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    None
}

fn extra(r: &Run, e: Extra, o: &Mutex<Outcomes>) {
    let limit = Duration::from_secs(40);
    let (args, what): (Vec<String>, String) = match e {
        Extra::DaemonStart(i) => (
            r.daemon_start_args(i),
            format!("daemon start for {}", r.ids[i].label()),
        ),
        Extra::DaemonStop(i) => (
            ["daemon", "stop", "--force", "--id", &r.ids[i].daemon]
                .iter()
                .map(|s| s.to_string())
                .collect(),
            "daemon stop".into(),
        ),
        Extra::Gc => (vec!["gc".into()], "gc".into()),
        Extra::Status => (vec!["status".into(), "--json".into()], "status".into()),
    };
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    match r.gpushare(&argv, limit) {
        None => o
            .lock()
            .unwrap()
            .violations
            .push(format!("gpushare {what} did not end within {limit:?}")),
        Some(out) => {
            // status must succeed whatever it finds mid-round; the others may fail when
            // their own process or one they wait on was killed.
            if matches!(e, Extra::Status) && !out.status.success() {
                o.lock().unwrap().violations.push(format!(
                    "gpushare status failed mid-round: {}",
                    testkit::text(&out).trim()
                ));
            }
        }
    }
}

/// Stops everything the run started: every daemon (`daemon stop --all --force`), every
/// container, any process of the run still there (a violation: something outlived its
/// stop), and the containers' cgroups. Returns what was left.
fn cleanup(r: &Run) -> Vec<String> {
    let mut left = Vec::new();
    let ids = r.containers.lock().unwrap().clone();
    for cid in &ids {
        if r.runc_state(cid).is_some() {
            r.runc_delete(cid);
        }
    }
    let _ = r.gpushare(
        &["daemon", "stop", "--all", "--force"],
        Duration::from_secs(60),
    );
    let gone = testkit::wait_until(Duration::from_secs(10), || {
        procs::scan(&r.env.config, &r.env.state)
            .iter()
            .all(|p| !matches!(p.kind, Kind::Supervisor | Kind::ControlDaemon))
    });
    if !gone {
        for p in procs::scan(&r.env.config, &r.env.state) {
            left.push(format!(
                "{} pid {} outlived `gpushare daemon stop --all` ({:?})",
                p.kind.name(),
                p.pid,
                p.args
            ));
            procs::kill(&p);
        }
    }
    // Any process of the run (a runc init a killed runc create left, say).
    for p in procs::scan(&r.env.config, &r.env.state) {
        procs::kill(&p);
    }
    // The daemons' cgroups `gpushare/<id>-<pid>`: a supervisor removes its own, gc those
    // of the killed ones; none may be left (scripts/test looks for them too).
    // Ids are the identities' hashes, the same in another state dir on this host: a
    // cgroup whose supervisor still runs is another run's (this run's are all stopped
    // by now, or reported above).
    let ours = |p: &PathBuf| {
        let name = p.file_name().unwrap_or_default().to_string_lossy();
        r.ids
            .iter()
            .any(|i| name.starts_with(&format!("{}-", i.daemon)))
            && testkit::cgroup_pid(p).is_some_and(|p| gpushare::util::proc_start_time(p).is_none())
    };
    let mut cgroups = Vec::new();
    let clean = testkit::wait_until(Duration::from_secs(15), || {
        let _ = r.gpushare(&["gc"], Duration::from_secs(30));
        cgroups = testkit::daemon_cgroups_all()
            .into_iter()
            .filter(ours)
            .collect();
        cgroups.is_empty()
    });
    if !clean {
        left.push(format!("daemon cgroups left after gc: {cgroups:?}"));
        for cg in &cgroups {
            let _ = std::fs::remove_dir(cg);
        }
    }
    remove_cgroups(&r.cgroup_parent);
    left
}

/// Removes `<hierarchy>/<parent>/` in every cgroup hierarchy, killing what is left in it.
fn remove_cgroups(parent: &str) {
    let root = Path::new("/sys/fs/cgroup");
    let mut tops: Vec<PathBuf> = std::fs::read_dir(root)
        .into_iter()
        .flatten()
        .flatten()
        .map(|h| h.path().join(parent))
        .collect();
    tops.push(root.join(parent));
    for top in tops.into_iter().filter(|t| t.is_dir()) {
        let children = std::fs::read_dir(&top).into_iter().flatten().flatten();
        for c in children.filter(|c| c.file_type().is_ok_and(|t| t.is_dir())) {
            let procs = std::fs::read_to_string(c.path().join("cgroup.procs")).unwrap_or_default();
            for pid in procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            let p = c.path();
            testkit::wait_until(Duration::from_secs(5), || {
                std::fs::remove_dir(&p).is_ok() || !p.exists()
            });
        }
        let _ = std::fs::remove_dir(&top);
    }
}

fn report(opts: &Options, t: &Tally, took: Duration) {
    println!();
    println!("fault tier: seed {}", opts.seed);
    println!(
        "fault tier: {} rounds, {} kills, {} container creates in rounds ({} failed: a kill of their own path or of a process they waited on)",
        t.rounds, t.kills, t.creates, t.creates_failed
    );
    println!("fault tier: kills per process and phase:");
    for ((kind, phase), n) in &t.by_kind {
        println!("  {n:>5}  {kind}: {phase}");
    }
    println!(
        "fault tier: two control daemons of one identity seen in one sample only (not a violation): {}",
        t.transient_doubles
    );
    println!("fault tier: took {:.0} s", took.as_secs_f64());
    println!("fault tier: {} violations", t.violations.len());
    for v in &t.violations {
        println!("  {v}");
    }
}
