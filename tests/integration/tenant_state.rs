//! Issue 18: tenant-proof daemon state, through real runc. A tenant owns its daemon's pipe
//! directory (and, with `container-log-dir`, its log directory) and can plant anything in
//! it or make its daemon log without end; none of that may break `gc`, a daemon restart,
//! the node's other tenants or the state directory's file system. Daemons are capped per
//! node and per UID. Every test here fails when the protection it names is removed.

use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use nix::fcntl::OFlag;
use nix::sys::stat::Mode;

use crate::harness::*;

const CLIENT: &str = "gpushare-mps-sim client";

/// Deeper than the usual `ulimit -n` of 1024: a removal that holds an fd per level fails.
const DEPTH: usize = 1500;

/// Plants a chain of `DEPTH` directories under `dir`, as a tenant would (mkdir, cd,
/// repeat), with a file at the bottom and a symlink to `outside` half-way.
fn plant_chain(dir: &Path, outside: &Path) {
    let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let mut cur = nix::fcntl::open(dir, flags, Mode::empty()).unwrap();
    for i in 0..DEPTH {
        nix::sys::stat::mkdirat(&cur, "d", Mode::from_bits_truncate(0o755)).unwrap();
        if i == DEPTH / 2 {
            nix::unistd::symlinkat(outside, &cur, "out").unwrap();
        }
        cur = nix::fcntl::openat(&cur, "d", flags, Mode::empty()).unwrap();
    }
    nix::fcntl::openat(
        &cur,
        "f",
        OFlag::O_CREAT | OFlag::O_WRONLY | OFlag::O_CLOEXEC,
        Mode::from_bits_truncate(0o644),
    )
    .unwrap();
}

/// SIGKILLs a daemon's supervisor and daemon, as a crash or an OOM kill would.
fn crash(env: &Env, id: &str) {
    let rec = env.record(id);
    let pids: Vec<i32> = ["supervisor", "daemon"]
        .iter()
        .filter_map(|k| rec[k]["pid"].as_i64().map(|p| p as i32))
        .collect();
    for &p in &pids {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(p),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    assert!(wait_until(Duration::from_secs(5), || pids
        .iter()
        .all(|&p| !alive(p))));
}

/// `gpushare gc` with the open-file limit a login shell or a systemd service usually has.
fn gc(env: &Env) -> Output {
    let mut cmd = env.cmd("/bin/sh");
    cmd.args(["-c", "ulimit -n 1024 && exec \"$0\" gc", GPUSHARE]);
    cmd.output().unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn gone(env: &Env, id: &str) -> bool {
    std::fs::symlink_metadata(env.state.join("mps").join(id)).is_err()
}

/// Replaces `start-timeout` in the env's config (it bounds gc's wait for a lock).
fn set_start_timeout(env: &Env, value: &str) {
    let old = "start-timeout = \"10s\"";
    let text = std::fs::read_to_string(&env.config).unwrap();
    assert!(text.contains(old), "the harness config sets {old}: {text}");
    std::fs::write(
        &env.config,
        text.replace(old, &format!("start-timeout = {value:?}")),
    )
    .unwrap();
}

/// One stale daemon per uid: created, used, its container deleted, then crashed.
fn stale_daemon(env: &Env, name: &str, uid: u32) -> String {
    let c = env.container(name).uid(uid).device("0").sh(CLIENT).create();
    assert_eq!(client_line(&c.run())["shm"], "ok");
    c.delete();
    let id = env.daemon_of(&c);
    crash(env, &id);
    id
}

#[test]
fn gc_survives_a_planted_deep_tree_and_cleans_past_what_it_cannot() {
    let env = Env::new();
    set_start_timeout(&env, "2s");
    let mut ids: Vec<String> = [("gc-a", 1000), ("gc-b", 2000), ("gc-c", 3000)]
        .iter()
        .map(|&(name, uid)| stale_daemon(&env, name, uid))
        .collect();
    ids.sort();
    let (locked, planted, plain) = (ids[0].clone(), ids[1].clone(), ids[2].clone());
    let outside = env.path().join("outside");
    std::fs::create_dir(&outside).unwrap();
    std::fs::write(outside.join("keep"), "keep").unwrap();
    // The tenant's deep tree in one daemon's pipe directory, and another in the directory
    // of a removal that was cut short (a previous gc that died on it).
    plant_chain(&env.state.join("mps").join(&planted).join("pipe"), &outside);
    let tomb = env
        .state
        .join("mps")
        .join(".0123456789abcdef0123456789abcdef.removing");
    std::fs::create_dir_all(tomb.join("pipe")).unwrap();
    plant_chain(&tomb.join("pipe"), &outside);
    // The first daemon in gc's order cannot be cleaned now: another process holds its lock.
    let state = gpushare::state::StateDir::new(&env.state);
    let held = state.lock(&locked, Instant::now()).unwrap();

    let out = gc(&env);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(1), "{stdout}{stderr}");
    let failures: Vec<&str> = stderr.lines().collect();
    assert_eq!(failures.len(), 1, "one line per failure: {stderr}");
    assert!(
        failures[0].starts_with(&format!("gpushare: gc: daemon {locked}: timed out")),
        "{stderr}"
    );
    for id in [&planted, &plain] {
        assert!(
            stdout.contains(&format!(
                "daemon {id}: supervisor gone and no containers; removed"
            )),
            "{stdout}"
        );
        assert!(gone(&env, id), "{id} removed");
    }
    assert!(
        stdout.contains("removed half-removed directory"),
        "{stdout}"
    );
    assert!(
        std::fs::symlink_metadata(&tomb).is_err(),
        "tombstone removed"
    );
    assert!(!gone(&env, &locked), "the locked one is left for later");
    assert_eq!(
        std::fs::read_to_string(outside.join("keep")).unwrap(),
        "keep",
        "nothing removed through the planted links"
    );

    // Once the lock is free, the next gc finishes the job and succeeds.
    drop(held);
    let out = gc(&env);
    assert!(
        out.status.success(),
        "{}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    assert!(gone(&env, &locked));
    assert!(env.daemon_ids().is_empty(), "{:?}", env.daemon_ids());
    assert!(
        !std::fs::read_to_string("/proc/mounts")
            .unwrap()
            .contains(&env.state.display().to_string()),
        "every tmpfs unmounted"
    );
    assert!(outside.join("keep").exists());
}

#[test]
fn a_directory_planted_as_control_does_not_stop_a_restart() {
    let env = Env::new();
    let holder = env
        .container("ctl-hold")
        .uid(1000)
        .device("0")
        .sh("sleep 60")
        .create();
    holder.start();
    let id = env.daemon_of(&holder);
    let pipe = env.state.join("mps").join(&id).join("pipe");
    // The tenant (same uid as its daemon) swaps the control socket for a directory tree.
    let planted = Command::new("/bin/sh")
        .args([
            "-c",
            "cd \"$0\" && rm control && mkdir -p control/inner && touch control/inner/f",
        ])
        .arg(&pipe)
        .uid(1000)
        .gid(1000)
        .status()
        .unwrap();
    assert!(planted.success());
    assert!(pipe.join("control").is_dir());
    let pid = env.daemon_pid(&id);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let restarted = wait_until(Duration::from_secs(10), || {
        let rec = env.record(&id);
        rec["status"] == "ready"
            && rec["daemon"]["pid"]
                .as_i64()
                .is_some_and(|p| p as i32 != pid)
    });
    assert!(
        restarted,
        "record: {}\nlog: {}",
        env.record(&id),
        env.gpushare_log()
    );
    let meta = std::fs::symlink_metadata(pipe.join("control")).unwrap();
    assert!(
        !meta.is_dir(),
        "the planted directory is gone, a socket in its place"
    );
    let next = env
        .container("ctl-next")
        .uid(1000)
        .device("0")
        .sh(CLIENT)
        .create();
    assert_eq!(client_line(&next.run())["shm"], "ok");
    assert_eq!(env.daemon_of(&next), id);
    holder.delete();
}

fn with_tp<'a>(env: &'a Env, name: &str, uid: u32, tp: &str) -> Container<'a> {
    env.container(name)
        .uid(uid)
        .device("0")
        .annotation("gpushare.io/active-thread-percentage", tp)
        .sh("true")
        .bundle()
}

fn mounts_under(env: &Env) -> usize {
    std::fs::read_to_string("/proc/mounts")
        .unwrap()
        .matches(&env.state.display().to_string())
        .count()
}

#[test]
fn daemons_are_capped_per_uid_and_per_node() {
    let env = Env::with_config("max-daemons-per-uid = 2");
    let config = env.config.display().to_string();
    for (name, tp) in [("cap-1", "10"), ("cap-2", "20")] {
        let c = with_tp(&env, name, 1000, tp);
        let out = c.try_create();
        assert!(out.status.success(), "{}", c.last_error());
    }
    assert_eq!(env.daemon_ids().len(), 2);
    let mounts = mounts_under(&env);
    let third = with_tp(&env, "cap-3", 1000, "30");
    let before = third.config_bytes();
    let out = third.try_create();
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        third.last_error(),
        format!("gpushare: cannot start another MPS daemon for uid 1000: mps.max-daemons-per-uid = 2 reached (2 daemons, none idle); their containers free their place when they end (gpushare status), or raise it in {config}")
    );
    assert_eq!(third.config_bytes(), before, "config.json untouched");
    assert_eq!(env.daemon_ids().len(), 2, "no third daemon directory");
    assert_eq!(mounts_under(&env), mounts, "no third mount");
    // `gpushare daemon start` is refused the same way.
    let out = env
        .cmd(GPUSHARE)
        .args([
            "daemon",
            "start",
            "--device",
            "0",
            "--uid",
            "1000",
            "--active-thread-percentage",
            "40",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("mps.max-daemons-per-uid = 2 reached (2 daemons, none idle)"),
        "{}",
        text(&out.stderr)
    );
    // Another uid still gets its daemon.
    let other = with_tp(&env, "cap-other", 2000, "30");
    assert!(
        other.try_create().status.success(),
        "{}",
        other.last_error()
    );
    assert_eq!(env.daemon_ids().len(), 3);
    // A stopped daemon frees its place.
    let first = env
        .daemon_ids()
        .into_iter()
        .find(|id| env.record(id)["identity"]["active_thread_percentage"] == 10)
        .unwrap();
    let out = env
        .cmd(GPUSHARE)
        .args(["daemon", "stop", "--force", "--id", &first])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let again = with_tp(&env, "cap-3b", 1000, "30");
    assert!(
        again.try_create().status.success(),
        "{}",
        again.last_error()
    );

    // The node-wide cap.
    let env = Env::with_config("max-daemons = 2");
    let config = env.config.display().to_string();
    for (name, uid) in [("node-1", 1000), ("node-2", 2000)] {
        let c = with_tp(&env, name, uid, "10");
        assert!(c.try_create().status.success(), "{}", c.last_error());
    }
    let third = with_tp(&env, "node-3", 3000, "10");
    let before = third.config_bytes();
    assert_eq!(third.try_create().status.code(), Some(1));
    assert_eq!(
        third.last_error(),
        format!("gpushare: cannot start another MPS daemon on this node: mps.max-daemons = 2 reached (2 daemons, none idle); their containers free their place when they end (gpushare status), or raise it in {config}")
    );
    assert_eq!(third.config_bytes(), before);
    assert_eq!(env.daemon_ids().len(), 2);
}

/// Bytes of the files under `dir` that live on `dir`'s own file system (mounts skipped).
fn usage_outside_mounts(dir: &Path) -> u64 {
    let dev = std::fs::symlink_metadata(dir).unwrap().dev();
    let mut total = 0;
    let mut stack = vec![dir.to_owned()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let Ok(m) = std::fs::symlink_metadata(e.path()) else {
                continue;
            };
            if m.dev() != dev {
                continue;
            }
            total += m.blocks() * 512;
            if m.is_dir() {
                stack.push(e.path());
            }
        }
    }
    total
}

#[test]
fn a_log_flood_stays_in_the_daemons_log_tmpfs() {
    const LOG_SIZE: u64 = 1 << 20;
    let env = Env::with_config("log-size = \"1M\"");
    let holder = env
        .container("flood-hold")
        .uid(1000)
        .device("0")
        .sh("sleep 60")
        .create();
    holder.start();
    let id = env.daemon_of(&holder);
    let dir = env.state.join("mps").join(&id);
    let log = dir.join("log");
    // The log directory is its own tmpfs of the configured size, the daemon user's.
    let fs = nix::sys::statfs::statfs(&log).unwrap();
    assert_eq!(fs.filesystem_type(), nix::sys::statfs::TMPFS_MAGIC);
    assert_eq!(fs.blocks() * fs.block_size() as u64, LOG_SIZE);
    let meta = std::fs::metadata(&log).unwrap();
    assert_eq!((meta.uid(), meta.mode() & 0o7777), (1000, 0o700));
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let line = mountinfo
        .lines()
        .find(|l| l.split(' ').nth(4) == Some(log.to_str().unwrap()))
        .unwrap_or_else(|| panic!("no mount at {}", log.display()));
    for opt in ["nosuid", "nodev", "noexec"] {
        assert!(line.contains(opt), "{line}");
    }
    let before = usage_outside_mounts(&env.state);

    // The tenant floods its daemon with junk control commands, each logged in full: four
    // times the log's size, faster than any periodic rotation could keep up with.
    let lines = 4 * LOG_SIZE as usize / 4000;
    let junk = env.path().join("junk");
    let mut f = std::fs::File::create(&junk).unwrap();
    for i in 0..lines {
        writeln!(f, "junk{i:06} {}", "x".repeat(3990)).unwrap();
    }
    drop(f);
    let answers = env.path().join("answers");
    let mut flood = Command::new(sim())
        .env_clear()
        .env("CUDA_MPS_PIPE_DIRECTORY", dir.join("pipe"))
        .stdin(std::fs::File::open(&junk).unwrap())
        .stdout(std::fs::File::create(&answers).unwrap())
        .stderr(Stdio::null())
        .uid(1000)
        .gid(1000)
        .spawn()
        .unwrap();
    // The state directory's own file system, sampled all along the flood.
    let mut peak = before;
    let done = wait_until(Duration::from_secs(60), || {
        peak = peak.max(usage_outside_mounts(&env.state));
        flood.try_wait().ok().flatten().is_some()
    });
    if !done {
        let _ = flood.kill();
        let _ = flood.wait();
    }
    peak = peak.max(usage_outside_mounts(&env.state));
    let answered = std::fs::read_to_string(&answers).unwrap();
    assert!(
        done && answered.lines().count() >= lines && !answered.contains("Cannot find"),
        "the daemon answered every junk command ({} lines)",
        answered.lines().count()
    );
    let fs = nix::sys::statfs::statfs(&log).unwrap();
    let used = (fs.blocks() - fs.blocks_free()) * fs.block_size() as u64;
    assert!(used <= LOG_SIZE, "{used}");
    assert!(
        peak - before < LOG_SIZE / 4,
        "the state directory's file system grew from {before} to {peak} bytes under a flood of {} bytes",
        lines * 4000
    );
    // The node's other tenants are unaffected.
    let other = env
        .container("flood-other")
        .uid(2000)
        .device("0")
        .sh(CLIENT)
        .create();
    assert_eq!(client_line(&other.run())["shm"], "ok");
    holder.delete();
}
