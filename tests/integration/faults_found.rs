//! Instants of the create path that the fault tier's (tests/faults/) random SIGKILL hits
//! only by chance, each reproduced here on purpose, one test each (a low-level runtime
//! that kills itself, a supervisor held stopped before it names itself, a zombie
//! supervisor).

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use testkit::*;

/// A child killed and reaped when the test ends, whichever way it ends.
struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn state_letter(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat[stat.rfind(')')? + 2..].chars().next()
}

/// Replaces the config's `low-level-runtime` line.
fn set_low_level_runtime(env: &Env, runtime: &Path) {
    let text = std::fs::read_to_string(&env.config).unwrap();
    let line = text
        .lines()
        .find(|l| l.starts_with("low-level-runtime"))
        .unwrap()
        .to_owned();
    let new = format!("low-level-runtime = [{:?}]", runtime.display().to_string());
    std::fs::write(&env.config, text.replace(&line, &new)).unwrap();
}

#[test]
fn a_shim_killed_before_runc_create_returned_leaves_no_record_that_keeps_its_daemon() {
    // Before: the shim's pending record (no pid yet) counted as a container for
    // pending-grace (2 x start-timeout + 30 s, 50 s here) whatever became of the shim, so
    // the daemon could not idle out and gc kept the record (and restarted a daemon whose
    // supervisor was gone "for" it).
    let env = Env::with_config("idle-timeout = \"1s\"");
    let holder = env.request("holder", 1000, "0").sh("sleep 1000").create();
    holder.start();
    let id = env.daemon_of(&holder);
    // The shim execs a low-level runtime that is SIGKILLed at once: the instant between
    // the shim's pending record and the createRuntime hook's record.
    let killed_runc = env.path().join("killed-runc");
    std::fs::write(&killed_runc, "#!/bin/sh\nkill -KILL $$\n").unwrap();
    std::fs::set_permissions(
        &killed_runc,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let real_runc = which("runc").unwrap();
    set_low_level_runtime(&env, &killed_runc);
    let doomed = env.request("doomed", 1000, "0").bundle();
    assert!(!doomed.try_create().status.success());
    set_low_level_runtime(&env, &real_runc);
    let pending = env
        .state
        .join("mps")
        .join(&id)
        .join("containers/doomed.json");
    assert!(pending.exists(), "the shim's pending record is there");
    holder.delete();
    // gc takes the record of a gone shim for stale at once...
    let out = env.gpushare(&["gc"]);
    assert!(out.status.success(), "gc: {}", text(&out));
    assert!(
        !pending.exists(),
        "gc kept the dead shim's record: {}",
        text(&out)
    );
    // ...and the daemon, used by nobody, idles out (1 s) instead of living 50 s more.
    assert!(
        wait_until(Duration::from_secs(10), || !env
            .state
            .join("mps")
            .join(&id)
            .exists()),
        "daemon {id} still there: {:?}",
        env.daemon_ids()
    );
}

/// The `gpushare-mps-sim -f` processes serving pipe directory `pipe`.
/// Rewrites daemon `id`'s record as `ensure` writes it while it starts the daemon (status
/// `starting`, no supervisor, no daemon); the record's path.
fn mark_starting(env: &Env, id: &str) -> PathBuf {
    let mut starting = env.record(id);
    starting["status"] = "starting".into();
    starting["supervisor"] = serde_json::Value::Null;
    starting["daemon"] = serde_json::Value::Null;
    let record = env.state.join("mps").join(id).join("daemon.json");
    std::fs::write(&record, serde_json::to_vec_pretty(&starting).unwrap()).unwrap();
    record
}

fn control_daemons(pipe: &Path) -> Vec<i32> {
    let want = format!("CUDA_MPS_PIPE_DIRECTORY={}", pipe.display());
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let args = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
        let env = std::fs::read(e.path().join("environ")).unwrap_or_default();
        let has = |hay: &[u8], needle: &[u8]| hay.split(|&b| b == 0).any(|s| s == needle);
        if has(&args, b"-f")
            && String::from_utf8_lossy(&args).contains("gpushare-mps-sim")
            && has(&env, want.as_bytes())
            && alive(pid)
        {
            out.push(pid);
        }
    }
    out
}

#[test]
fn a_supervisor_started_for_a_killed_create_never_runs_beside_another() {
    // Before: a create killed after it started a supervisor, but before that supervisor
    // wrote its pid into the record, left a record naming none; the next create took it
    // for stale and started a second supervisor, and both ran a daemon for the identity.
    // Now each supervisor holds the identity's supervisor lock all its life: the late one
    // finds the record naming the other and leaves.
    let env = Env::new();
    let start = start_uid_1000_on_gpu_0;
    let first = start(&env);
    let id = first["id"].as_str().unwrap().to_owned();
    let pipe = PathBuf::from(first["pipe_dir"].as_str().unwrap());
    // The state a killed create leaves: its supervisor spawned but not yet named (held
    // stopped before it even execs gpushare), the record `starting` with no supervisor.
    let rec = env.record(&id);
    let old_sup = rec["supervisor"]["pid"].as_i64().unwrap() as i32;
    stop_process(old_sup, rec["supervisor"]["start_time"].as_u64());
    mark_starting(&env, &id);
    let late = KillOnDrop(
        env.cmd("sh")
            .arg("-c")
            .arg(format!(
                "kill -STOP $$; exec {} daemon supervise --id {id}",
                gpushare()
            ))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let late_pid = late.0.id();
    assert!(wait_until(Duration::from_secs(5), || state_letter(
        late_pid
    ) == Some('T')));
    // The next create of the identity starts its own supervisor and is served.
    let second = start(&env);
    assert_eq!(second["id"], id.as_str());
    assert_eq!(second["started"], true, "{second}");
    let sup = env.record(&id)["supervisor"]["pid"].as_i64().unwrap() as i32;
    // The late supervisor goes on: it must leave the daemon to the one the record names.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(late_pid as i32),
        nix::sys::signal::Signal::SIGCONT,
    )
    .unwrap();
    let left = wait_until(Duration::from_secs(10), || {
        state_letter(late_pid).is_none_or(|s| s == 'Z')
    });
    let daemons = control_daemons(&pipe);
    assert!(
        left,
        "the late supervisor {late_pid} still runs; daemons {daemons:?}"
    );
    assert_eq!(daemons.len(), 1, "control daemons for {id}: {daemons:?}");
    let rec = env.record(&id);
    assert_eq!(rec["status"], "ready", "{rec}");
    assert_eq!(rec["supervisor"]["pid"].as_i64(), Some(sup.into()), "{rec}");
    assert!(env
        .gpushare_log()
        .contains("another supervisor runs this daemon"));
}

#[test]
fn gc_removes_the_cgroup_of_a_supervisor_that_is_a_zombie() {
    // Before: the sweep of `gpushare/<id>-<pid>` took a pid with a /proc entry for a
    // running supervisor, zombies included: a supervisor SIGKILLed while its parent (the
    // hook that started it, or a subreaper) had not reaped it kept its cgroup through gc.
    let env = Env::new();
    let root = Path::new("/sys/fs/cgroup");
    let hierarchy = if root.join("cgroup.procs").exists() {
        root.to_owned()
    } else {
        ["memory", "pids", "cpu"]
            .iter()
            .map(|h| root.join(h))
            .find(|h| h.join("cgroup.procs").exists())
            .expect("a cgroup hierarchy")
    };
    let mut zombie = Command::new("true").spawn().unwrap();
    let pid = zombie.id();
    assert!(wait_until(Duration::from_secs(5), || state_letter(pid) == Some('Z')));
    let top = hierarchy.join("gpushare");
    let _ = std::fs::create_dir(&top);
    let cg = top.join(format!("0123456789abcdef0123456789abcdef-{pid}"));
    std::fs::create_dir(&cg).unwrap();
    let out = env.gpushare(&["gc"]);
    let gone = !cg.exists();
    let _ = std::fs::remove_dir(&cg);
    let _ = zombie.wait();
    assert!(out.status.success(), "gc: {}", text(&out));
    assert!(gone, "gc kept the cgroup of zombie {pid}: {}", text(&out));
}

/// Whether process `pid` has `path` open.
fn has_open(pid: u32, path: &Path) -> bool {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .into_iter()
        .flatten()
        .flatten()
        .any(|fd| std::fs::read_link(fd.path()).is_ok_and(|t| t == path))
}

#[test]
fn gc_keeps_a_daemon_started_while_it_waited_for_the_identitys_lock() {
    // Before: gc read a daemon's record, found its supervisor gone, waited for the
    // identity's lock, and then removed the directory on what it had read: a daemon that
    // `gpushare daemon start` (or a create) started while gc waited lost its directories
    // and quit. gc now reads the record again under the lock.
    let env = Env::new();
    let id = start_uid_1000_on_gpu_0(&env)["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let rec = env.record(&id);
    let old = rec["supervisor"]["pid"].as_i64().unwrap() as i32;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(old),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    assert!(wait_until(Duration::from_secs(5), || !alive(old)));
    // The test holds the identity's lock, as a create starting a daemon does.
    let lock_path = env.state.join("locks").join(format!("{id}.lock"));
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&lock_path)
        .unwrap();
    let held = nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusive).unwrap();
    let gc = KillOnDrop(
        env.cmd(gpushare())
            .arg("gc")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    // gc has read the stale record and waits for the lock.
    assert!(wait_until(Duration::from_secs(10), || has_open(
        gc.0.id(),
        &lock_path
    )));
    // Meanwhile the daemon is started again (what ensure does under the lock).
    let record = mark_starting(&env, &id);
    let _sup = KillOnDrop(
        env.cmd(gpushare())
            .args(["daemon", "supervise", "--id", &id])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    assert!(wait_until(Duration::from_secs(10), || env.record(&id)
        ["status"]
        == "ready"));
    drop(held);
    let mut gc = gc;
    let status = gc.0.wait().unwrap();
    let mut said = String::new();
    for pipe in [
        gc.0.stdout.take().map(|p| Box::new(p) as Box<dyn Read>),
        gc.0.stderr.take().map(|p| Box::new(p) as Box<dyn Read>),
    ]
    .into_iter()
    .flatten()
    {
        let mut pipe = pipe;
        pipe.read_to_string(&mut said).unwrap();
    }
    assert!(status.success(), "gc: {said}");
    // The daemon started meanwhile keeps its directories, and keeps running.
    assert!(record.exists(), "gc removed the new daemon: {said}");
    let rec = env.record(&id);
    assert_eq!(rec["status"], "ready", "{rec}");
    let sup = rec["supervisor"]["pid"].as_i64().unwrap() as i32;
    assert!(
        !wait_until(Duration::from_secs(3), || !alive(sup)),
        "the new supervisor {sup} left"
    );
}

/// `gpushare daemon start --device 0 --uid 1000 --json`, which must succeed: its output.
fn start_uid_1000_on_gpu_0(env: &Env) -> serde_json::Value {
    let out = env.gpushare(&[
        "daemon", "start", "--device", "0", "--uid", "1000", "--json",
    ]);
    assert!(out.status.success(), "daemon start: {}", text(&out));
    serde_json::from_slice(&out.stdout).unwrap()
}
