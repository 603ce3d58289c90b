//! Tenant-proof daemon state, through real runc. A tenant owns its daemon's pipe directory
//! (and, with `container-log-dir`, its log directory) and can plant anything in it or make
//! its daemon log without end; none of that may break `gc`, a daemon restart, the node's
//! other tenants or the state directory's file system. Daemons are capped per node and per
//! UID. Every test here fails when the protection it names is removed.

use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use nix::fcntl::OFlag;
use nix::sys::stat::Mode;

use testkit::*;

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
    cmd.args(["-c", "ulimit -n 1024 && exec \"$0\" gc", gpushare()]);
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
    let c = env.request(name, uid, "0").sh(CLIENT).create();
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
    let holder = env.request("ctl-hold", 1000, "0").sh("sleep 60").create();
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
    let pid = env.kill_daemon(&id);
    let restarted = env.daemon_restarted(&id, pid, Duration::from_secs(10));
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
    let next = env.request("ctl-next", 1000, "0").sh(CLIENT).create();
    assert_eq!(client_line(&next.run())["shm"], "ok");
    assert_eq!(env.daemon_of(&next), id);
    holder.delete();
}

fn with_tp<'a>(env: &'a Env, name: &str, uid: u32, tp: &str) -> Container<'a> {
    env.request(name, uid, "0")
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
    let out = env.start_daemon("0", "1000", "40");
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("mps.max-daemons-per-uid = 2 reached (2 daemons, none idle)"),
        "{}",
        text(&out.stderr)
    );
    // Another uid still gets its daemon.
    let other = with_tp(&env, "cap-other", 2000, "30");
    other.must_create();
    assert_eq!(env.daemon_ids().len(), 3);
    // A stopped daemon frees its place.
    let first = env
        .daemon_ids()
        .into_iter()
        .find(|id| env.record(id)["identity"]["active_thread_percentage"] == 10)
        .unwrap();
    let out = env.gpushare(&["daemon", "stop", "--force", "--id", &first]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let again = with_tp(&env, "cap-3b", 1000, "30");
    again.must_create();

    // The node-wide cap.
    let env = Env::with_config("max-daemons = 2");
    let config = env.config.display().to_string();
    for (name, uid) in [("node-1", 1000), ("node-2", 2000)] {
        let c = with_tp(&env, name, uid, "10");
        c.must_create();
    }
    let third = with_tp(&env, "node-3", 3000, "10");
    let before = third.config_bytes();
    assert_eq!(
        third.refuse(),
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
    let holder = env.request("flood-hold", 1000, "0").sh("sleep 60").create();
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
    let mut flood = Command::new(env.sim())
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
    let other = env.request("flood-other", 2000, "0").sh(CLIENT).create();
    assert_eq!(client_line(&other.run())["shm"], "ok");
    holder.delete();
}

/// Replaces one line of the env's `[mps]` config (the harness writes `shm-size = "64M"`).
fn replace_config(env: &Env, old: &str, new: &str) {
    let text = std::fs::read_to_string(&env.config).unwrap();
    assert!(text.contains(old), "the harness config has {old}: {text}");
    std::fs::write(&env.config, text.replace(old, new)).unwrap();
}

/// A request of `uid` with thread percentage `tp` (a daemon of its own) that runc fails
/// after the shim made the daemon's directories: a bind mount whose source is missing,
/// which the shim does not look at.
fn doomed<'a>(env: &'a Env, name: &str, uid: u32, tp: &str) -> Container<'a> {
    let c = with_tp(env, name, uid, tp);
    let path = c.bundle.join("config.json");
    let mut spec: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let missing = env.path().join("no-such-source");
    spec["mounts"]
        .as_array_mut()
        .unwrap()
        .push(serde_json::json!({
            "destination": "/mnt", "type": "bind", "source": missing, "options": ["rbind"]
        }));
    std::fs::write(&path, serde_json::to_vec_pretty(&spec).unwrap()).unwrap();
    c
}

/// A request in an image at `rootfs` (made by `make` under the test's dir), optionally in
/// a new user namespace (container 0 → host 300000).
fn in_image<'a>(env: &'a Env, name: &str, make: impl FnOnce(&Path), userns: bool) -> Container<'a> {
    let root = env.path().join(format!("image-{name}"));
    std::fs::create_dir_all(&root).unwrap();
    make(&root);
    let mut c = env.request(name, 1000, "0");
    if userns {
        c = c.userns(300000, 65536);
    }
    let c = c.bundle();
    let path = c.bundle.join("config.json");
    let mut spec: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    spec["root"]["path"] = serde_json::json!(root);
    std::fs::write(&path, serde_json::to_vec_pretty(&spec).unwrap()).unwrap();
    c
}

#[test]
fn an_image_runc_cannot_mount_the_pipe_dir_into_is_refused_before_anything_is_made() {
    let env = Env::new();
    // An image whose /tmp is a file (runc: "not a directory"), and one without /tmp in a
    // user namespace whose root does not own the image's / (runc: mkdir permission
    // denied): each fails with gpushare's line, config.json untouched, nothing made.
    let file = |r: &Path| std::fs::write(r.join("tmp"), "not a directory").unwrap();
    let bare = |_: &Path| {};
    for (name, c, want) in [
        ("tmp-file", in_image(&env, "tmp-file", file, false), "/tmp is not a directory in the image"),
        ("no-tmp-userns", in_image(&env, "no-tmp-userns", bare, true), "/tmp is missing from the image, and the container's root (host uid 300000) may not create it in /"),
    ] {
        let before = c.config_bytes();
        assert_eq!(c.try_create().status.code(), Some(1), "{name}");
        let err = c.last_error();
        assert!(
            err.starts_with("gpushare: the MPS pipe directory cannot be mounted at /tmp/nvidia-mps (mps.container-pipe-dir): ")
                && err.contains(want)
                && !err.contains('\n'),
            "{name}: {err}"
        );
        assert_eq!(c.config_bytes(), before, "{name}: config.json untouched");
        assert!(env.daemon_ids().is_empty(), "{name}: nothing made: {:?}", env.daemon_ids());
    }
    // Without a user namespace runc makes a missing /tmp itself: served.
    let only_true = |r: &Path| {
        std::fs::create_dir(r.join("bin")).unwrap();
        std::fs::copy(busybox().unwrap(), r.join("bin/true")).unwrap();
    };
    let made = in_image(&env, "no-tmp", only_true, false);
    assert_eq!(
        made.try_create().status.code(),
        Some(0),
        "{}",
        made.last_error()
    );
    made.delete();
}

#[test]
fn a_failed_create_leaves_nothing_that_holds_a_cap_slot_or_a_mount() {
    let env = Env::with_config("max-daemons-per-uid = 2");
    // More failed creates than the cap, each a daemon of its own: runc fails on a mount,
    // after the shim made the daemon's directories and mounts.
    for (name, tp) in [("fail-1", "10"), ("fail-2", "20"), ("fail-3", "30")] {
        let c = doomed(&env, name, 1000, tp);
        let before = c.config_bytes();
        assert_eq!(c.try_create().status.code(), Some(1), "{name} must fail");
        let err = c.last_error();
        assert!(!err.contains("mps.max-daemons"), "{name}: {err}");
        assert_ne!(c.config_bytes(), before, "the shim edited it; runc failed");
    }
    // Nothing stays past mps.start-timeout, without an operator: no directory, no mount.
    let cleared = wait_until(Duration::from_secs(10), || {
        env.daemon_ids().is_empty() && mounts_under(&env) == 0
    });
    assert!(
        cleared,
        "left behind: {:?}, {} mounts\n{}",
        env.daemon_ids(),
        mounts_under(&env),
        env.gpushare_log()
    );

    // Where the reaper could not run (a copy of the shim without `gpushare` beside it),
    // the abandoned directories show in `status` and hold no cap slot: the next create
    // of the UID takes their place.
    let lone = env.path().join("lone");
    std::fs::create_dir(&lone).unwrap();
    let shim = lone.join("gpushare-runtime");
    std::fs::copy(runtime(), &shim).unwrap();
    for (name, tp) in [("lone-1", "40"), ("lone-2", "50")] {
        let c = doomed(&env, name, 1000, tp);
        assert_eq!(
            c.try_create_with(shim.to_str().unwrap()).status.code(),
            Some(1)
        );
    }
    let abandoned = env.daemon_ids();
    assert_eq!(abandoned.len(), 2, "{abandoned:?}");
    assert_eq!(mounts_under(&env), 4, "shm and log of each");
    let status = env.status();
    for id in &abandoned {
        let d = status
            .as_array()
            .unwrap()
            .iter()
            .find(|d| d["id"] == id.as_str())
            .unwrap_or_else(|| panic!("status shows {id}: {status}"));
        assert_eq!(d["status"], "abandoned", "{d}");
        assert_eq!(d["uid"], 1000, "{d}");
    }
    let table = env.gpushare(&["status"]);
    assert!(
        text(&table.stdout).contains(&abandoned[0]) && text(&table.stdout).contains("abandoned"),
        "{}",
        text(&table.stdout)
    );
    let next = env.client("after-abandoned", 1000, "60");
    assert_eq!(client_line(&next.run())["shm"], "ok");
    for id in &abandoned {
        assert!(gone(&env, id), "{id} taken back");
    }
    assert_eq!(mounts_under(&env), 2, "only the new daemon's mounts");
    next.delete();
}

/// The supervisor pid a daemon's record names.
fn supervisor_pid(env: &Env, id: &str) -> i32 {
    env.record(id)["supervisor"]["pid"].as_i64().unwrap() as i32
}

#[test]
fn idle_daemons_of_one_tenant_never_lock_out_another() {
    let env = Env::with_config("max-daemons = 3\nmax-daemons-per-uid = 3");
    let config = env.config.display().to_string();
    // One tenant fills the node's cap with one-shot containers, all exited and deleted:
    // their daemons stay for mps.idle-timeout (5 minutes).
    let mut idle = Vec::new();
    for (name, tp) in [("shot-10", "10"), ("shot-20", "20"), ("shot-30", "30")] {
        let c = env.client(name, 1000, tp);
        assert_eq!(client_line(&c.run())["shm"], "ok");
        c.delete();
        let id = env.daemon_of(&c);
        idle.push((id.clone(), supervisor_pid(&env, &id)));
        // Distinct "idle since" times, oldest first.
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(env.daemon_ids().len(), 3);
    // Another tenant's create is served: the longest idle daemon is stopped for it.
    let victim = env.request("victim", 2000, "0").sh("sleep 60").create();
    victim.start();
    let vid = env.daemon_of(&victim);
    let vsup = supervisor_pid(&env, &vid);
    assert!(gone(&env, &idle[0].0), "the oldest idle daemon went");
    assert!(
        wait_until(Duration::from_secs(5), || !alive(idle[0].1)),
        "its supervisor exited"
    );
    assert!(!gone(&env, &idle[1].0) && !gone(&env, &idle[2].0));
    assert!(
        env.gpushare_log()
            .contains("idle MPS daemon stopped and removed to make room under a cap"),
        "{}",
        env.gpushare_log()
    );
    // The tenant comes back for more: only idle daemons make room, never one in use.
    let again = env
        .request("shot-40", 1000, "0")
        .annotation("gpushare.io/active-thread-percentage", "40")
        .sh("sleep 60")
        .create();
    assert!(gone(&env, &idle[1].0));
    let third = env.request("t3000", 3000, "0").sh("sleep 60").create();
    assert!(gone(&env, &idle[2].0));
    // Every daemon now has a live container: the cap holds, naming itself.
    let refused = env.request("t4000", 4000, "0").sh("true").bundle();
    assert_eq!(
        refused.refuse(),
        format!("gpushare: cannot start another MPS daemon on this node: mps.max-daemons = 3 reached (3 daemons, none idle); their containers free their place when they end (gpushare status), or raise it in {config}")
    );
    assert_eq!(
        supervisor_pid(&env, &vid),
        vsup,
        "the victim's daemon was never touched"
    );
    assert!(alive(vsup));
    assert_eq!(
        mounts_under(&env),
        6,
        "two mounts for each of the three daemons"
    );
    for c in [&victim, &again, &third] {
        c.delete();
    }
}

/// Bytes used and the size of the tmpfs at `path`.
fn tmpfs_use(path: &Path) -> (u64, u64) {
    let fs = nix::sys::statfs::statfs(path).unwrap();
    let bs = fs.block_size() as u64;
    ((fs.blocks() - fs.blocks_free()) * bs, fs.blocks() * bs)
}

#[test]
fn daemon_shm_is_bounded_per_daemon_per_uid_and_per_node() {
    const MIB: u64 = 1 << 20;
    let env = Env::new();
    replace_config(
        &env,
        "shm-size = \"64M\"",
        "shm-size = \"16M\"\nshm-size-per-uid = \"32M\"\nshm-size-total = \"48M\"",
    );
    let config = env.config.display().to_string();
    let hold = |name: &str, uid: u32, tp: &str| {
        let c = env
            .request(name, uid, "0")
            .annotation("gpushare.io/active-thread-percentage", tp)
            .sh("dd if=/dev/zero of=/dev/shm/park-$$ bs=1M count=24 2>/dev/null; sleep 60")
            .create();
        c.start();
        c
    };
    // Each container tries to park 24 MiB in /dev/shm, the daemon's tmpfs: 16 MiB fit.
    let a = hold("shm-a", 1000, "10");
    let b = hold("shm-b", 1000, "20");
    for c in [&a, &b] {
        let shm = env.state.join("mps").join(env.daemon_of(c)).join("shm");
        assert!(wait_until(Duration::from_secs(10), || tmpfs_use(&shm).0 >= 15 * MIB));
        let (used, size) = tmpfs_use(&shm);
        assert_eq!(size, 16 * MIB, "mps.shm-size bounds each daemon");
        assert!(used <= 16 * MIB, "{used}");
    }
    // A third daemon of the same UID would bring its daemons' shm past mps.shm-size-per-uid.
    let third = with_tp(&env, "shm-c", 1000, "30");
    let before = third.config_bytes();
    assert_eq!(
        third.refuse(),
        format!("gpushare: cannot start another MPS daemon for uid 1000: mps.shm-size-per-uid = 32 MiB would be exceeded (2 daemons, none idle, have 32 MiB of shm tmpfs and this one's is 16 MiB); their containers free their place when they end (gpushare status), or raise it in {config}")
    );
    assert_eq!(third.config_bytes(), before, "config.json untouched");
    assert_eq!(env.daemon_ids().len(), 2, "nothing made");
    // Another UID gets one; then the node's total is reached.
    let other = hold("shm-d", 2000, "10");
    let fourth = with_tp(&env, "shm-e", 3000, "10");
    assert_eq!(
        fourth.refuse(),
        format!("gpushare: cannot start another MPS daemon on this node: mps.shm-size-total = 48 MiB would be exceeded (3 daemons, none idle, have 48 MiB of shm tmpfs and this one's is 16 MiB); their containers free their place when they end (gpushare status), or raise it in {config}")
    );
    // What a deleted container parked goes with its daemon when a cap needs the room.
    other.delete();
    let fifth = with_tp(&env, "shm-f", 3000, "10");
    fifth.must_create();
    assert_eq!(env.daemon_ids().len(), 3);
    for c in [&a, &b, &fifth] {
        c.delete();
    }
}
