//! Parts failing under live jobs (docs/reliability.md, "Engines and parts failing under
//! live jobs"): a container holds an MPS client of the simulator while a supervisor or a
//! control daemon is killed with SIGKILL, or while the state directory's file system is
//! full, read-only or deleted. Each test states what the running container keeps, what the
//! next container gets and what the operator sees (status, doctor, gc, the log);
//! docs/reliability.md tabulates the same.
//!
//! The simulator's client does not notice its server dying (a real CUDA client does, and
//! fails: docs/reliability.md's real-GPU section), so "the running client keeps" here means
//! the container keeps running and keeps its mounts; what a real job keeps is the GPU
//! tier's to say.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use testkit::*;

const HOLD: &str = "gpushare-mps-sim client --hold 120";
const CLIENT: &str = "gpushare-mps-sim client";

fn kill9(pid: i32) {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
}

/// A started container whose client holds its server, and its daemon; returns once the
/// client is served.
fn holder<'a>(env: &'a Env, id: &str) -> (Container<'a>, String) {
    let c = env.request(id, 1000, "0").sh(HOLD).create();
    c.start();
    assert!(
        c.wait_stdout("shm=ok", Duration::from_secs(40)),
        "holder {id} served; stdout: {} stderr: {}",
        c.stdout(),
        c.stderr()
    );
    let daemon = env.daemon_of(&c);
    (c, daemon)
}

fn running(c: &Container) -> bool {
    c.state().is_some_and(|s| s["status"] == "running")
}

fn pid_of(rec: &serde_json::Value, key: &str) -> i32 {
    rec[key]["pid"].as_i64().expect("pid in record") as i32
}

fn gpushare(env: &Env, args: &[&str]) -> (bool, String, String) {
    let out = env.cmd(testkit::gpushare()).args(args).output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// No panic text anywhere an operator reads.
fn no_panic(what: &str, text: &str) {
    assert!(
        !text.contains("panicked") && !text.contains("RUST_BACKTRACE"),
        "{what} panicked:\n{text}"
    );
}

#[test]
fn a_supervisor_killed_with_sigkill_takes_its_daemon_and_the_next_create_replaces_it() {
    let env = Env::new();
    let (c, id) = holder(&env, "sup1");
    let rec = env.record(&id);
    let (sup, daemon) = (pid_of(&rec, "supervisor"), pid_of(&rec, "daemon"));
    kill9(sup);
    // The daemon runs with a parent-death signal: nothing is left that no one watches.
    assert!(
        wait_until(Duration::from_secs(5), || !alive(sup) && !alive(daemon)),
        "daemon {daemon} outlived its supervisor {sup}"
    );
    // The running container keeps running (its client does not notice here; see above).
    assert!(running(&c), "holder still running");
    // The operator sees it down, with the reason.
    let d = env.status_of(&id);
    assert!(d.is_object(), "daemon {id} in status");
    assert_eq!(d["health"], "down", "{d}");
    assert!(
        d["health_reason"]
            .as_str()
            .is_some_and(|r| r.contains("supervisor is gone")),
        "{d}"
    );
    // The next create for the same identity replaces it, and serves the next client.
    let next = env.request("sup2", 1000, "0").sh(CLIENT).create();
    assert_eq!(env.daemon_of(&next), id);
    let rec2 = env.record(&id);
    assert_eq!(rec2["status"], "ready", "{rec2}");
    assert!(alive(pid_of(&rec2, "supervisor")) && pid_of(&rec2, "supervisor") != sup);
    assert_eq!(client_line(&next.run())["shm"], "ok");
    next.delete();
    c.delete();
    // What the killed supervisor could not remove, its cgroups, gc removes once its
    // daemon's last server has gone with the holder's client.
    let cleaned = wait_until(Duration::from_secs(15), || {
        let (ok, out, err) = gpushare(&env, &["gc"]);
        assert!(ok, "gc: {out}{err}");
        no_panic("gc", &(out + &err));
        daemon_cgroups(&[sup]).is_empty()
    });
    assert!(cleaned, "left: {:?}", daemon_cgroups(&[sup]));
}

#[test]
fn a_control_daemon_killed_with_sigkill_under_a_live_client_is_restarted_and_serves_the_next() {
    let env = Env::new();
    let c = env
        .request("ctl1", 1000, "0")
        .annotation("gpushare.io/active-thread-percentage", "40")
        .sh(HOLD)
        .create();
    c.start();
    assert!(c.wait_stdout("shm=ok", Duration::from_secs(40)));
    let id = env.daemon_of(&c);
    let rec = env.record(&id);
    let (sup, daemon) = (pid_of(&rec, "supervisor"), pid_of(&rec, "daemon"));
    kill9(daemon);
    let restarted = env.daemon_restarted(&id, daemon, Duration::from_secs(15));
    assert!(restarted, "record: {}", env.record(&id));
    assert_eq!(
        pid_of(&env.record(&id), "supervisor"),
        sup,
        "same supervisor"
    );
    assert!(running(&c), "holder still running");
    let log = env.control_log(&id);
    assert_eq!(
        log.matches("Cmd:set_default_active_thread_percentage 40")
            .count(),
        2,
        "limits re-applied:\n{log}"
    );
    let st = env.status();
    let d = &st.as_array().unwrap()[0];
    assert_eq!(d["health"], "ok", "{d}");
    assert_eq!(d["restarts"], 1, "{d}");
    let next = env.client("ctl2", 1000, "40");
    let line = client_line(&next.run());
    assert_eq!(percentage(&line), 40.0);
    assert_eq!(env.daemon_of(&next), id);
    next.delete();
    c.delete();
}

/// What every command says while the state dir is unusable: one clear line, no panic.
fn one_clear_error(what: &str, ok: bool, out: &str, err: &str) {
    // What the operator sees, for docs/reliability.md (`--nocapture` shows it).
    eprintln!("{what}: ok={ok}\n{out}{err}");
    no_panic(what, &format!("{out}{err}"));
    // doctor's report, failures included, is its stdout (`doctor_says` reads it).
    if !ok && what != "doctor" {
        let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
        assert!(
            !lines.is_empty() && lines.len() <= 2,
            "{what}: one clear error line expected, got:\n{err}"
        );
    }
}

/// `gpushare doctor` fails with a state-dir-space line saying `problem`.
fn doctor_says(env: &Env, problem: &str) {
    let (ok, out, err) = gpushare(env, &["doctor"]);
    let line = out.lines().find(|l| l.contains("state-dir-space"));
    assert!(
        !ok && line.is_some_and(|l| l.contains(problem)),
        "doctor: {out}{err}"
    );
}

/// A create that must fail: one error line naming `want`, no container left, and
/// config.json whole: as it was, or (when the hook failed after the shim's atomic save)
/// the complete edited spec, which the engine removes with the bundle.
fn create_fails_cleanly<'a>(env: &'a Env, id: &str, uid: u32, want: &str) -> Container<'a> {
    let c = env.request(id, uid, "0").sh(CLIENT).bundle();
    let before = c.config_bytes();
    let out = c.try_create();
    assert!(!out.status.success(), "create {id} succeeded");
    let err = c.last_error();
    eprintln!("create {id}: {err}");
    no_panic("create", &format!("{err}{}", c.stderr()));
    assert!(err.contains(want), "create {id}: {err}");
    let after = c.config_bytes();
    assert!(
        after == before
            || serde_json::from_slice::<serde_json::Value>(&after)
                .is_ok_and(|v| v["annotations"]["gpushare.io/daemon"].is_string()),
        "config.json neither unchanged nor the whole edited spec"
    );
    assert!(
        c.state().is_none_or(|s| s["status"] == "stopped"),
        "no container {id} left running"
    );
    c
}

/// A small tmpfs mounted at the env's state dir.
fn state_on_tmpfs(env: &Env, size: &str) {
    std::fs::create_dir_all(&env.state).unwrap();
    nix::mount::mount(
        Some("tmpfs"),
        &env.state,
        Some("tmpfs"),
        nix::mount::MsFlags::empty(),
        Some(format!("size={size},mode=0755").as_str()),
    )
    .unwrap();
}

fn fill(dir: &Path) -> std::path::PathBuf {
    let filler = dir.join("filler");
    let _ = Command::new("dd")
        .args(["if=/dev/zero", "bs=64k"])
        .arg(format!("of={}", filler.display()))
        .stderr(std::process::Stdio::null())
        .status();
    filler
}

/// With the state dir broken: `c` and its daemon `id` (supervisor and daemon process)
/// keep running, `status`, `doctor` and `gc` each fail with one clear error, and doctor's
/// report says `says`.
fn still_runs_and_each_command_fails_in_one_line(env: &Env, c: &Container, id: &str, says: &str) {
    assert!(running(c));
    let rec = env.record(id);
    assert!(alive(pid_of(&rec, "supervisor")) && alive(pid_of(&rec, "daemon")));
    for args in [&["status"][..], &["doctor"], &["gc"]] {
        let (ok, out, err) = gpushare(env, args);
        one_clear_error(args[0], ok, &out, &err);
    }
    doctor_says(env, says);
}

#[test]
fn a_full_state_dir_fails_creates_cleanly_keeps_running_daemons_and_recovers() {
    let env = Env::new();
    state_on_tmpfs(&env, "2M");
    let (c, id) = holder(&env, "full1");
    let filler = fill(&env.state);
    // A new identity needs a new daemon: its record cannot be written.
    let bad = env.request("full2", 1001, "0").sh(CLIENT).bundle();
    let before = bad.config_bytes();
    let out = bad.try_create();
    let err = bad.last_error();
    eprintln!("create full2: {err}");
    no_panic("create", &format!("{err}{}", bad.stderr()));
    if out.status.success() {
        // The shim writes config.json before the hook; only the hook needs the state dir.
        panic!("create with a full state dir succeeded: {}", bad.stdout());
    }
    assert!(
        err.contains("No space left") || err.contains("no space"),
        "{err}"
    );
    assert_eq!(bad.config_bytes(), before, "config.json unchanged");
    // The running daemon and its container keep going.
    still_runs_and_each_command_fails_in_one_line(&env, &c, &id, "has less than 1 MiB free");
    // Space comes back: the same create works.
    std::fs::remove_file(filler).unwrap();
    let _ = env.runtime(&["delete", "-f", "full2"], &bad.log());
    let again = env.request("full3", 1001, "0").sh(CLIENT).create();
    assert_eq!(client_line(&again.run())["shm"], "ok");
    again.delete();
    c.delete();
}

#[test]
fn a_read_only_state_dir_fails_creates_cleanly_keeps_running_daemons_and_recovers() {
    use nix::mount::MsFlags;
    let env = Env::new();
    let (c, id) = holder(&env, "ro1");
    // A file system cannot be remounted read-only while the supervisor holds daemon.out
    // open for writing (EBUSY); a read-only bind over the state dir is what new opens see
    // when the file system went read-only. The daemons' tmpfs below stay writable.
    nix::mount::mount(
        Some(&env.state),
        &env.state,
        None::<&str>,
        MsFlags::MS_BIND | MsFlags::MS_REC,
        None::<&str>,
    )
    .unwrap();
    nix::mount::mount(
        None::<&str>,
        &env.state,
        None::<&str>,
        MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY,
        None::<&str>,
    )
    .unwrap();
    // A new identity: no daemon directory can be made.
    let bad = create_fails_cleanly(&env, "ro2", 1001, "Read-only file system");
    // A container of the running daemon: its container record cannot be written.
    let same = create_fails_cleanly(&env, "ro3", 1000, "Read-only file system");
    still_runs_and_each_command_fails_in_one_line(&env, &c, &id, "is on a read-only file system");
    nix::mount::umount2(&env.state, nix::mount::MntFlags::MNT_DETACH).unwrap();
    for old in [&bad, &same] {
        let _ = env.runtime(&["delete", "-f", &old.id], &old.log());
    }
    let again = env.request("ro4", 1000, "0").sh(CLIENT).create();
    assert_eq!(env.daemon_of(&again), id);
    assert_eq!(client_line(&again.run())["shm"], "ok");
    again.delete();
    c.delete();
}

#[test]
fn a_deleted_state_dir_loses_its_daemons_to_no_one_and_the_next_create_starts_afresh() {
    let env = Env::new();
    let (c, id) = holder(&env, "rm1");
    let rec = env.record(&id);
    let (sup, daemon) = (pid_of(&rec, "supervisor"), pid_of(&rec, "daemon"));
    // Env cannot stop them by their records once the state dir is gone.
    let _reap = Reap(vec![
        (sup, rec["supervisor"]["start_time"].as_u64()),
        (daemon, rec["daemon"]["start_time"].as_u64()),
    ]);
    // What a host reboot does to /run, done while everything runs: unmount the daemons'
    // tmpfs (rm -rf cannot remove a mount point) and remove the tree.
    umount_below(&env.state);
    std::fs::remove_dir_all(&env.state).unwrap();
    // The supervisor notices its daemon directory is gone and stops its daemon: nothing
    // runs that no record names.
    let ended = wait_until(Duration::from_secs(30), || !alive(sup) && !alive(daemon));
    let (ok, out, err) = gpushare(&env, &["status"]);
    one_clear_error("status", ok, &out, &err);
    let (ok, out, err) = gpushare(&env, &["doctor"]);
    one_clear_error("doctor", ok, &out, &err);
    let (ok, out, err) = gpushare(&env, &["gc"]);
    one_clear_error("gc", ok, &out, &err);
    // The next create recreates the state dir and a daemon.
    let next = env.request("rm2", 1000, "0").sh(CLIENT).create();
    assert_eq!(env.daemon_of(&next), id);
    assert_eq!(client_line(&next.run())["shm"], "ok");
    next.delete();
    let _ = c.state();
    assert!(
        ended,
        "supervisor {sup} / daemon {daemon} still run after their state dir was deleted"
    );
}

/// A dockerd restart (SIGTERM and start again) while a `docker run -d` container holds
/// an MPS client: the daemon is not the engine's (its own session and cgroup), so it keeps
/// running, and the next `docker run` is served by the same daemon. Without live-restore
/// dockerd stops its containers as it goes (their poststop hooks release them); with it,
/// the container keeps running and stays on the daemon's list.
fn docker_restart_keeps_the_daemon(live_restore: bool) {
    let env = Env::new();
    let ns = PrivateMounts::new();
    let mut d = crate::engines::Dockerd::start_with(&env, &ns, live_restore);
    let run = |d: &crate::engines::Dockerd, detach: bool, cmd: &str| {
        let mut args = vec!["run", "--runtime", "gpushare", "-u", "1000"];
        args.extend_from_slice(if detach { &["-d"] } else { &["--rm"] });
        args.extend_from_slice(&["-e", "GPUSHARE_DEVICE=0", "gpushare-test", "sh", "-c", cmd]);
        d.docker(&args)
    };
    let out = run(&d, true, HOLD);
    assert!(out.status.success(), "{}", text(&out));
    let cid = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    assert!(
        wait_until(Duration::from_secs(40), || text(&d.docker(&["logs", &cid]))
            .contains("shm=ok")),
        "holder served: {}",
        text(&d.docker(&["logs", &cid]))
    );
    let ids = env.daemon_ids();
    assert_eq!(ids.len(), 1, "{ids:?}");
    let id = ids[0].clone();
    let rec = env.record(&id);
    let (sup, daemon) = (pid_of(&rec, "supervisor"), pid_of(&rec, "daemon"));

    d.restart(&ns);

    assert!(alive(sup) && alive(daemon), "daemon survived the engine");
    let after = env.record(&id);
    assert_eq!(
        (pid_of(&after, "daemon"), after["restarts"].as_u64()),
        (daemon, Some(0)),
        "{after}"
    );
    let running = text(&d.docker(&["inspect", "-f", "{{.State.Running}}", &cid]));
    assert_eq!(
        running.trim() == "true",
        live_restore,
        "holder running: {running}"
    );
    let out = run(&d, false, CLIENT);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(client_line(&text(&out))["shm"], "ok");
    assert_eq!(env.daemon_ids(), vec![id.clone()], "the same daemon");
    assert_eq!(pid_of(&env.record(&id), "supervisor"), sup);
    let listed = |n: usize| {
        env.status()[0]["containers"]
            .as_array()
            .is_some_and(|c| c.len() == n)
    };
    assert!(
        wait_until(Duration::from_secs(20), || listed(usize::from(
            live_restore
        ))),
        "containers on the daemon: {}",
        env.status()[0]["containers"]
    );
    let _ = d.docker(&["rm", "-f", &cid]);
}

#[test]
fn a_dockerd_restart_without_live_restore_stops_containers_but_not_the_daemon() {
    docker_restart_keeps_the_daemon(false);
}

#[test]
fn a_dockerd_restart_with_live_restore_keeps_containers_and_the_daemon() {
    docker_restart_keeps_the_daemon(true);
}

/// A containerd restart while a `ctr run -d` container holds an MPS client: containerd's
/// shims keep their containers through it, and the daemon is neither containerd's nor
/// a shim's child, so all of it stays; the next `ctr run` gets the same daemon.
#[test]
fn a_containerd_restart_keeps_containers_and_the_daemon() {
    let env = Env::new();
    need("ctr", "containerd");
    let ns = PrivateMounts::new();
    let mut c = crate::engines::Containerd::start(&env, &ns, &env.path().join("c"));
    let own_rootfs = c.rootfs();
    let run = |c: &crate::engines::Containerd, extra: &[&str], id: &str, cmd: &str| {
        c.run_request(&ns, extra, &own_rootfs, id, &["sh", "-c", cmd])
    };
    // The holder's output goes to a file in the rootfs: `ctr run -d` keeps no logs.
    let out = run(&c, &["-d"], "hold1", &format!("{HOLD} > /tmp/hold.out"));
    assert!(out.status.success(), "{}", text(&out));
    let held = own_rootfs.join("tmp/hold.out");
    assert!(
        wait_until(Duration::from_secs(40), || std::fs::read_to_string(&held)
            .is_ok_and(|s| s.contains("shm=ok"))),
        "holder served"
    );
    let ids = env.daemon_ids();
    assert_eq!(ids.len(), 1, "{ids:?}");
    let id = ids[0].clone();
    let rec = env.record(&id);
    let (sup, daemon) = (pid_of(&rec, "supervisor"), pid_of(&rec, "daemon"));

    c.restart(&ns);

    assert!(alive(sup) && alive(daemon), "daemon survived the engine");
    assert_eq!(pid_of(&env.record(&id), "daemon"), daemon);
    let tasks = text(&c.ctr(&ns, &["task", "ls"]));
    assert!(
        tasks
            .lines()
            .any(|l| l.starts_with("hold1") && l.contains("RUNNING")),
        "holder still running:\n{tasks}"
    );
    let out = run(&c, &["--rm"], "next1", CLIENT);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(client_line(&text(&out))["shm"], "ok");
    assert_eq!(env.daemon_ids(), vec![id.clone()], "the same daemon");
    assert_eq!(pid_of(&env.record(&id), "supervisor"), sup);
    let _ = c.ctr(&ns, &["task", "kill", "-s", "SIGKILL", "hold1"]);
    let _ = wait_until(Duration::from_secs(10), || {
        c.ctr(&ns, &["task", "rm", "hold1"]).status.success()
    });
    let _ = c.ctr(&ns, &["container", "rm", "hold1"]);
}

/// Stops these processes when the test ends, however it ends.
struct Reap(Vec<(i32, Option<u64>)>);

impl Drop for Reap {
    fn drop(&mut self) {
        for &(pid, start) in &self.0 {
            stop_process(pid, start);
        }
    }
}
