//! The load tier (docs/reliability.md, "Load held"): 8 users × 16 containers created at
//! once through the shim, and a soak of containers of several users starting, running an
//! MPS client and being deleted, sampled for leaks. Real `gpushare-runtime`, `gpushare` and
//! `gpushare-mps-sim` through real runc, as root, on the test kit's harness (the integration
//! tests' `Env`, testkit/src/harness.rs; nothing here is a second harness).
//!
//! ```text
//! cargo test --test load                      # the burst and a 1-minute soak (./scripts/test)
//! GPUSHARE_SOAK_MINUTES=30 cargo test --test load -- --ignored --nocapture   # the long run
//! ```
//!
//! The figures of the long run and what they do not guarantee: docs/reliability.md, "Load
//! held". The tests of this target take one lock each: they measure latency, and two loads
//! on a 2-core runner would measure each other.
//!
//! Invariants: every count is taken from the node (state dir, /proc, mountinfo, cgroupfs,
//! runc's list; `measure`), never from gpushare's own reports; a leak is judged between two
//! quiet moments (no container of the env left, several samples each, the least of each
//! taken), so a file or fd that exists only while a container runs or while the supervisor
//! checks its daemon's limits is never taken for one.

mod measure;
mod scale;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Barrier, Mutex};
use std::time::{Duration, Instant};

use measure::{percentile_ms, Procs, Sample};
use testkit::*;

/// The simulator's stand-in for a CUDA process: connects to the daemon of the container's
/// pipe dir, gets its server, checks the server's shm is visible, exits.
const CLIENT: &str = "gpushare-mps-sim client";

/// One load at a time in this target.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

// ---------------------------------------------------------------------------------------
// Burst

const BURST_USERS: u32 = 8;
const BURST_PER_USER: u32 = 16;
/// Host UIDs of the burst: 1100..1108 (no other test uses them: their daemon ids, which
/// hash the identity, are this tier's alone).
const BURST_UID: u32 = 1100;

/// A device and an active-thread percentage, if any.
type Request = (&'static str, Option<&'static str>);

/// What container `j` of a user asks for: GPU 0 or GPU 2, with or without a thread limit:
/// four identities per user, 32 in all, four containers each.
fn burst_request(j: u32) -> Request {
    let device = if j % 2 == 0 { "0" } else { "2" };
    let threads = (j / 2 % 2 == 1).then_some("50");
    (device, threads)
}

#[test]
fn burst_8_users_x_16_containers_created_at_once() {
    let _one = serial();
    let env = Env::new();
    let mut plan = Vec::new();
    for u in 0..BURST_USERS {
        for j in 0..BURST_PER_USER {
            plan.push((BURST_UID + u, j));
        }
    }
    // Bundles first (runc spec), untimed.
    let containers: Vec<(Container, u32, Request)> = plan
        .iter()
        .map(|&(uid, j)| {
            let req = burst_request(j);
            let mut b = env
                .request(&format!("ldb-{uid}-{j}"), uid, req.0)
                .sh(CLIENT);
            if let Some(t) = req.1 {
                b = b.annotation("gpushare.io/active-thread-percentage", t);
            }
            (b.bundle(), uid, req)
        })
        .collect();
    let n = containers.len();
    let barrier = Barrier::new(n);
    let began = Instant::now();
    let results: Vec<(Duration, bool)> = std::thread::scope(|s| {
        let handles: Vec<_> = containers
            .iter()
            .map(|(c, _, _)| {
                let barrier = &barrier;
                s.spawn(move || {
                    barrier.wait();
                    let t0 = Instant::now();
                    let ok = c.try_create().status.success();
                    (t0.elapsed(), ok)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let wall = began.elapsed();
    let latencies: Vec<Duration> = results.iter().map(|r| r.0).collect();
    let failures: Vec<String> = containers
        .iter()
        .zip(&results)
        .filter(|(_, r)| !r.1)
        .map(|((c, _, _), _)| format!("{}: {}", c.id, c.last_error()))
        .collect();

    // One daemon per identity: the containers of one (user, device, limit) share one, and
    // no two of them share a daemon.
    let mut by_request: BTreeMap<(u32, &str, Option<&str>), BTreeSet<String>> = BTreeMap::new();
    let mut missing_records = Vec::new();
    for (c, uid, req) in &containers {
        let daemon = env.daemon_of(c);
        let record = env
            .state
            .join("mps")
            .join(&daemon)
            .join("containers")
            .join(format!("{}.json", c.id));
        if !record.is_file() {
            missing_records.push(record.display().to_string());
        }
        by_request
            .entry((*uid, req.0, req.1))
            .or_default()
            .insert(daemon);
    }
    let ids = env.daemon_ids();
    let procs = Procs::scan(&env);
    let started: usize = ids
        .iter()
        .map(|id| {
            env.control_log(id)
                .matches("Starting control daemon")
                .count()
        })
        .sum();
    let restarts: i64 = ids
        .iter()
        .map(|id| env.record(id)["restarts"].as_i64().unwrap_or(-1))
        .sum();
    let figures = format!(
        "burst: {n} creates at once ({BURST_USERS} users x {BURST_PER_USER}, {} identities): failures {}, daemons {} (control daemons started {started}, running {}, supervisors {}, restarts {restarts}), create p50 {:.0} ms p99 {:.0} ms max {:.0} ms, wall {:.0} ms",
        by_request.len(),
        failures.len(),
        ids.len(),
        procs.daemons.values().map(Vec::len).sum::<usize>(),
        procs.supervisors.values().map(Vec::len).sum::<usize>(),
        percentile_ms(&latencies, 50.0),
        percentile_ms(&latencies, 99.0),
        percentile_ms(&latencies, 100.0),
        ms(wall),
    );
    println!("{figures}");
    assert!(
        failures.is_empty(),
        "{figures}\nfailed creates:\n{}",
        failures.join("\n")
    );
    assert!(
        missing_records.is_empty(),
        "container records missing: {missing_records:?}"
    );
    let expected = (BURST_USERS * 4) as usize;
    assert_eq!(by_request.len(), expected);
    let shared: Vec<_> = by_request.iter().filter(|(_, d)| d.len() != 1).collect();
    assert!(
        shared.is_empty(),
        "requests served by several daemons: {shared:?}"
    );
    let distinct: BTreeSet<&String> = by_request.values().flatten().collect();
    assert_eq!(
        distinct.len(),
        expected,
        "identities sharing a daemon: {by_request:?}"
    );
    assert_eq!(ids.len(), expected, "{figures}");
    assert_eq!(started, expected, "{figures}");
    assert_eq!(restarts, 0, "{figures}");
    for (id, pids) in procs.daemons.iter().chain(&procs.supervisors) {
        assert_eq!(pids.len(), 1, "daemon {id}: processes {pids:?}");
    }
    assert_eq!(procs.daemons.len(), expected, "{figures}");

    // Every container is served by its own user's daemon, with its limit.
    run_all(&containers.iter().map(|(c, _, _)| c).collect::<Vec<_>>());
    for (c, uid, req) in &containers {
        let line = client_line(&c.stdout());
        assert_eq!(line["shm"], "ok", "{}: {line:?}", c.id);
        assert_eq!(line["server_uid"], uid.to_string(), "{}: {line:?}", c.id);
        let pct: f64 = line["active_thread_percentage"].parse().unwrap();
        assert_eq!(pct, if req.1.is_some() { 50.0 } else { 100.0 }, "{}", c.id);
    }

    // Deleted, every record is released (the poststop hooks ran).
    parallel(&containers, 8, |(c, _, _)| {
        let out = c.try_delete();
        assert!(out.status.success(), "delete {}: {}", c.id, text(&out));
    });
    let quiet = Sample::take(&env, 0.0, &ids.iter().cloned().collect(), "ldb-");
    assert_eq!(quiet.container_records, 0, "{}", quiet.line());
    assert_eq!(quiet.runc_containers, 0, "{}", quiet.line());
    assert_eq!(quiet.container_cgroups, 0, "{}", quiet.line());
}

/// Starts every container, 8 at a time, and waits for each to exit.
fn run_all(cs: &[&Container]) {
    parallel(cs, 8, |c| {
        c.start();
        c.wait();
    });
}

/// `f` over `items` on `threads` threads.
fn parallel<T: Sync>(items: &[T], threads: usize, f: impl Fn(&T) + Sync) {
    let next = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(item) = items.get(i) else { break };
                f(item);
            });
        }
    });
}

// ---------------------------------------------------------------------------------------
// Soak

/// The soak's shape: two envs side by side.
/// - steady: 4 users × (GPU 0, GPU 2 with a 50 % thread limit): 8 identities, `STEADY_WORKERS` threads each creating,
///   starting, running a client in and deleting one container after another, round robin
///   over the identities. Its daemons live through the run (idle-timeout 5 m): the same
///   supervisor and daemon pids at the end, no restart, and their fds and mounts as at
///   the start.
/// - churn: 2 users × MIG device 1:0 with `idle-timeout = 2s`, one thread pausing 0–4 s
///   between containers: its daemons stop when idle and start again, many times over,
///   with creates arriving around the moment a daemon is removed. At the end everything
///   of it is gone.
const STEADY_UIDS: [u32; 4] = [1200, 1201, 1202, 1203];
/// GPU 2's daemons enforce a limit, so their supervisors check it every 2 s (a control
/// client started each time) all through the run: the periodic work of a long-lived daemon.
const STEADY_REQUESTS: [Request; 2] = [("0", None), ("2", Some("50"))];
const STEADY_WORKERS: usize = 3;
const CHURN_UIDS: [u32; 2] = [1300, 1301];
const CHURN_REQUEST: Request = ("1:0", None);
const CHURN_IDLE: &str = "2s";

#[test]
fn soak_short() {
    let secs = std::env::var("GPUSHARE_SOAK_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    soak(Duration::from_secs(secs), Duration::from_secs(10));
}

/// The documented long run: `GPUSHARE_SOAK_MINUTES` (default 30) minutes.
#[test]
#[ignore = "the long run (30 minutes): cargo test --test load -- --ignored --nocapture"]
fn soak_long() {
    let minutes = std::env::var("GPUSHARE_SOAK_MINUTES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(30);
    soak(Duration::from_secs(minutes * 60), Duration::from_secs(60));
}

/// Creates, failures and latencies of one env's workers.
#[derive(Default)]
struct Tally {
    creates: Vec<Duration>,
    create_failures: Vec<String>,
    other_failures: Vec<String>,
}

/// One container's life: create (timed), start, the client's line, delete, its bundle
/// removed. `Err` names the step that failed; the container is deleted either way.
fn cycle(env: &Env, id: &str, uid: u32, req: Request, tally: &Mutex<Tally>) {
    let mut b = env.request(id, uid, req.0).sh(CLIENT);
    if let Some(t) = req.1 {
        b = b.annotation("gpushare.io/active-thread-percentage", t);
    }
    let c = b.bundle();
    let t0 = Instant::now();
    let out = c.try_create();
    let took = t0.elapsed();
    if !out.status.success() {
        let e = format!("{id}: create: {}", c.last_error());
        tally.lock().unwrap().create_failures.push(e);
        let _ = c.try_delete();
        return;
    }
    tally.lock().unwrap().creates.push(took);
    let result = (|| -> Result<(), String> {
        let out = c.try_start();
        if !out.status.success() {
            return Err(format!("start: {}", text(&out)));
        }
        let stopped = wait_until(Duration::from_secs(30), || {
            c.state().is_some_and(|s| s["status"] == "stopped")
        });
        if !stopped {
            return Err("did not stop within 30 s".into());
        }
        let line = parse_client_line(&c.stdout())
            .ok_or_else(|| format!("no client line: {} {}", c.stdout(), c.stderr()))?;
        // The client runs with its own user's server and its identity's limit.
        let pct = line
            .get("active_thread_percentage")
            .and_then(|p| p.parse::<f64>().ok());
        let want: f64 = req.1.map_or(100.0, |t| t.parse().unwrap());
        if line.get("shm").map(String::as_str) != Some("ok")
            || line.get("server_uid") != Some(&uid.to_string())
            || pct != Some(want)
        {
            return Err(format!("client: {line:?}"));
        }
        Ok(())
    })();
    let deleted = c.try_delete();
    let result = result.and_then(|()| {
        deleted
            .status
            .success()
            .then_some(())
            .ok_or_else(|| format!("delete: {}", text(&deleted)))
    });
    match result {
        Ok(()) => {
            let _ = std::fs::remove_dir_all(&c.bundle);
        }
        Err(e) => tally
            .lock()
            .unwrap()
            .other_failures
            .push(format!("{id}: {e}")),
    }
}

/// Quiet samples: once no container of `env` is left, `n` samples 0.7 s apart.
fn quiet(env: &Env, began: Instant, ids: &BTreeSet<String>, prefix: &str, n: usize) -> Vec<Sample> {
    let gone = wait_until(Duration::from_secs(30), || {
        let s = Sample::take(env, 0.0, ids, prefix);
        s.container_records == 0 && s.runc_containers == 0 && s.procs.others == 0
    });
    assert!(
        gone,
        "containers left: {}",
        Sample::take(env, 0.0, ids, prefix).line()
    );
    (0..n)
        .map(|i| {
            if i > 0 {
                std::thread::sleep(Duration::from_millis(700));
            }
            Sample::take(env, began.elapsed().as_secs_f64(), ids, prefix)
        })
        .collect()
}

/// Each measure's least value over a window of quiet samples.
fn least(window: &[Sample]) -> BTreeMap<String, usize> {
    let mut out: BTreeMap<String, usize> = BTreeMap::new();
    for s in window {
        for (k, v) in s.measures() {
            out.entry(k).and_modify(|m| *m = (*m).min(v)).or_insert(v);
        }
    }
    out
}

/// A tiny deterministic generator for the churn thread's pauses (xorshift64).
struct Pauses(u64);

impl Pauses {
    fn next(&mut self, max: Duration) -> Duration {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        max.mul_f64((self.0 % 1000) as f64 / 1000.0)
    }
}

fn soak(duration: Duration, sample_every: Duration) {
    let _one = serial();
    let steady = Env::new();
    let churn = Env::with_config(&format!("idle-timeout = \"{CHURN_IDLE}\""));
    let began = Instant::now();
    let identities: Vec<(u32, Request)> = STEADY_UIDS
        .iter()
        .flat_map(|&u| STEADY_REQUESTS.iter().map(move |&r| (u, r)))
        .collect();

    // Warm-up: one container per steady identity, so that its daemons run from the start.
    let warm = Mutex::new(Tally::default());
    for (i, (uid, req)) in identities.iter().enumerate() {
        cycle(&steady, &format!("lds-w{i}"), *uid, *req, &warm);
    }
    let warm = warm.into_inner().unwrap();
    assert!(
        warm.create_failures.is_empty() && warm.other_failures.is_empty(),
        "warm-up: {:?} {:?}",
        warm.create_failures,
        warm.other_failures
    );
    let steady_ids: BTreeSet<String> = steady.daemon_ids().into_iter().collect();
    assert_eq!(steady_ids.len(), identities.len(), "{steady_ids:?}");
    let start = quiet(&steady, began, &steady_ids, "lds-", 5);
    let churn_start = quiet(&churn, began, &BTreeSet::new(), "ldc-", 1);
    println!("soak: quiet start, steady: {}", start[0].line());
    println!("soak: quiet start, churn:  {}", churn_start[0].line());

    let stop = AtomicBool::new(false);
    let steady_tally = Mutex::new(Tally::default());
    let churn_tally = Mutex::new(Tally::default());
    let churn_ids = Mutex::new(BTreeSet::<String>::new());
    let churn_supervisors = Mutex::new(BTreeSet::<i32>::new());
    let violations = Mutex::new(Vec::<String>::new());
    let samples = Mutex::new(Vec::<(Sample, Sample)>::new());
    let end_at = Instant::now() + duration;
    std::thread::scope(|s| {
        for w in 0..STEADY_WORKERS {
            let (steady, identities, tally, stop) = (&steady, &identities, &steady_tally, &stop);
            s.spawn(move || {
                let mut n = 0usize;
                while !stop.load(Ordering::Relaxed) && Instant::now() < end_at {
                    let (uid, req) = identities[(n * STEADY_WORKERS + w) % identities.len()];
                    cycle(steady, &format!("lds-{w}-{n}"), uid, req, tally);
                    n += 1;
                }
            });
        }
        {
            let (churn, tally, stop) = (&churn, &churn_tally, &stop);
            s.spawn(move || {
                let mut pauses = Pauses(0x9e37_79b9_7f4a_7c15);
                let mut n = 0usize;
                while !stop.load(Ordering::Relaxed) && Instant::now() < end_at {
                    let uid = CHURN_UIDS[n % CHURN_UIDS.len()];
                    cycle(churn, &format!("ldc-{n}"), uid, CHURN_REQUEST, tally);
                    n += 1;
                    std::thread::sleep(pauses.next(Duration::from_secs(4)));
                }
            });
        }
        // The watcher: every 0.5 s, one control daemon per identity and no more records
        // than the workers can hold; every `sample_every`, a full sample of both envs.
        let watcher = s.spawn(|| {
            let mut next_sample = Instant::now() + sample_every;
            let mut last_count = (0usize, 0usize);
            while Instant::now() < end_at {
                for (name, env, workers, max_daemons) in [
                    ("steady", &steady, STEADY_WORKERS, identities.len()),
                    ("churn", &churn, 1, CHURN_UIDS.len()),
                ] {
                    let procs = Procs::scan(env);
                    // One scan reads the daemons' directories one after another, while
                    // a worker may delete its container in one and create the next in
                    // another: an excess counts only when a second scan still sees it.
                    let records = container_records(env);
                    let records = if records.len() > workers {
                        let again = container_records(env);
                        if again.len() > workers {
                            format!("{records:?}, then {again:?}")
                        } else {
                            String::new()
                        }
                    } else {
                        String::new()
                    };
                    let daemons = env.daemon_ids().len();
                    let mut v = violations.lock().unwrap();
                    // Like the records: an excess counts when a second scan still sees it.
                    if !procs.doubled().is_empty() {
                        for (id, pids) in Procs::scan(env).doubled() {
                            v.push(format!(
                                "{name}: daemon {id} served by control daemons {pids:?} (first scan {:?})",
                                procs.daemons.get(&id)
                            ));
                        }
                    }
                    if !records.is_empty() {
                        v.push(format!(
                            "{name}: container records {records}, {workers} workers"
                        ));
                    }
                    if daemons > max_daemons {
                        v.push(format!(
                            "{name}: {daemons} daemon records, {max_daemons} identities"
                        ));
                    }
                    if name == "churn" {
                        churn_ids
                            .lock()
                            .unwrap()
                            .extend(procs.supervisors.keys().cloned());
                        churn_supervisors
                            .lock()
                            .unwrap()
                            .extend(procs.supervisors.values().flatten());
                    }
                }
                if Instant::now() >= next_sample {
                    next_sample += sample_every;
                    let t = began.elapsed().as_secs_f64();
                    let a = Sample::take(&steady, t, &steady_ids, "lds-");
                    let b = Sample::take(&churn, t, &churn_ids.lock().unwrap(), "ldc-");
                    if a.records != start[0].records {
                        violations.lock().unwrap().push(format!(
                            "steady daemons changed at t={t:.0}s: {:?} -> {:?}",
                            start[0].records, a.records
                        ));
                    }
                    let (sc, cc) = (
                        steady_tally.lock().unwrap().creates.len(),
                        churn_tally.lock().unwrap().creates.len(),
                    );
                    println!(
                        "soak: steady +{} creates: {}\nsoak: churn  +{} creates: {}",
                        sc - last_count.0,
                        a.line(),
                        cc - last_count.1,
                        b.line()
                    );
                    last_count = (sc, cc);
                    samples.lock().unwrap().push((a, b));
                }
                std::thread::sleep(Duration::from_millis(500));
            }
        });
        if watcher.join().is_err() {
            stop.store(true, Ordering::Relaxed);
        }
    });
    let ran = began.elapsed();

    // The quiet end: the steady daemons still up, the churn daemons idled out.
    let end = quiet(&steady, began, &steady_ids, "lds-", 5);
    let churn_ids = churn_ids.into_inner().unwrap();
    let churn_gone = wait_until(Duration::from_secs(30), || {
        let s = Sample::take(&churn, 0.0, &churn_ids, "ldc-");
        s.daemon_records == 0 && s.procs.total() == 0 && s.cgroups == 0
    });
    let churn_end = Sample::take(&churn, began.elapsed().as_secs_f64(), &churn_ids, "ldc-");
    println!("soak: quiet end, steady: {}", end[0].line());
    println!("soak: quiet end, churn:  {}", churn_end.line());

    let st = steady_tally.into_inner().unwrap();
    let ch = churn_tally.into_inner().unwrap();
    let all: Vec<Duration> = st.creates.iter().chain(&ch.creates).copied().collect();
    let violations = violations.into_inner().unwrap();
    let churn_supervisors = churn_supervisors.into_inner().unwrap();
    println!(
        "soak: {:.1} min, creates {} (steady {}, churn {}), failed creates {}, other failures {}, create p50 {:.0} ms p99 {:.0} ms max {:.0} ms (steady p50 {:.0} p99 {:.0}; churn p50 {:.0} p99 {:.0}); churn daemons started {} (supervisors seen); one-daemon-per-identity violations {}",
        ran.as_secs_f64() / 60.0,
        all.len(),
        st.creates.len(),
        ch.creates.len(),
        st.create_failures.len() + ch.create_failures.len(),
        st.other_failures.len() + ch.other_failures.len(),
        percentile_ms(&all, 50.0),
        percentile_ms(&all, 99.0),
        percentile_ms(&all, 100.0),
        percentile_ms(&st.creates, 50.0),
        percentile_ms(&st.creates, 99.0),
        percentile_ms(&ch.creates, 50.0),
        percentile_ms(&ch.creates, 99.0),
        churn_supervisors.len(),
        violations.len(),
    );

    // Leaks: each measure at the quiet end against the quiet start (the least of 5 each).
    let (a, b) = (least(&start), least(&end));
    let mut grew = Vec::new();
    for (k, &v0) in &a {
        let v1 = b.get(k).copied().unwrap_or(0);
        println!("soak: steady {k}: {v0} -> {v1}");
        if v1 > v0 {
            grew.push(format!("{k}: {v0} -> {v1}"));
        }
    }
    for k in b.keys().filter(|k| !a.contains_key(*k)) {
        grew.push(format!("{k}: new at the end"));
    }
    // The churn env against its empty start: nothing of its daemons left but their lock
    // files (two per identity, never removed: state.md) and the directories holding them.
    let mut churn_left = Vec::new();
    for (k, v) in churn_end.measures() {
        let v0 = churn_start[0].measures().get(&k).copied().unwrap_or(0);
        println!("soak: churn {k}: {v0} -> {v}");
        let allowed = match k.as_str() {
            // <id>.lock and the supervisor's <id>.sup per identity, and node.lock.
            "lock files" => 2 * CHURN_UIDS.len() + 1,
            // locks/, its files, mps/.
            "state-dir entries" => 2 * CHURN_UIDS.len() + 3,
            _ => v0,
        };
        if v > allowed {
            churn_left.push(format!("{k}: {v0} -> {v} (allowed {allowed})"));
        }
    }

    let fails: Vec<&String> = st
        .create_failures
        .iter()
        .chain(&ch.create_failures)
        .chain(&st.other_failures)
        .chain(&ch.other_failures)
        .collect();
    assert!(fails.is_empty(), "failures: {fails:#?}");
    assert!(violations.is_empty(), "{violations:#?}");
    assert!(
        st.creates.len() >= STEADY_WORKERS && ch.creates.len() > 1,
        "the soak ran too few containers"
    );
    // The same daemons served the steady identities throughout: same supervisor and
    // daemon processes, never restarted.
    assert_eq!(start[0].records, end[0].records, "steady daemons changed");
    assert!(
        end[0].records.values().all(|r| r.2 == 0),
        "restarts: {:?}",
        end[0].records
    );
    assert!(
        grew.is_empty(),
        "grew between the quiet start and end: {grew:#?}"
    );
    assert!(churn_gone, "churn env not released: {}", churn_end.line());
    assert!(churn_left.is_empty(), "churn env left: {churn_left:#?}");
}

/// The container records of `env`, as `<daemon id prefix>/<container id>`.
fn container_records(env: &Env) -> Vec<String> {
    let mut out = Vec::new();
    for id in env.daemon_ids().iter().filter(|id| !id.starts_with('.')) {
        let dir = env.state.join("mps").join(id).join("containers");
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            // Not a record being written (`.<id>.json.<writer>.tmp`, renamed when whole).
            if !name.starts_with('.') && name.ends_with(".json") {
                out.push(format!("{}/{name}", &id[..8]));
            }
        }
    }
    out
}
