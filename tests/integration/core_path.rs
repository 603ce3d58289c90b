//! The core path in the default configuration (per-user daemons, enforced limits, isolated
//! IPC), through real runc with a busybox rootfs.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use testkit::*;

const CLIENT: &str = "gpushare-mps-sim client";

#[test]
fn container_gets_pipe_dir_and_daemon_shm_and_daemon_runs_as_its_user() {
    let env = Env::new();
    let c = env
        .request("c1", 1000, "0")
        .sh(&format!(
            "echo PIPE=$CUDA_MPS_PIPE_DIRECTORY; ls $CUDA_MPS_PIPE_DIRECTORY; {CLIENT}"
        ))
        .create();
    let out = c.run();
    assert!(out.contains("PIPE=/tmp/nvidia-mps"), "{out}");
    assert!(
        out.lines().any(|l| l == "control"),
        "control socket visible in the container:\n{out}"
    );
    let line = client_line(&out);
    assert_eq!(
        line["shm"], "ok",
        "the container's /dev/shm is the daemon's: {out}"
    );
    assert_eq!(line["server_uid"], "1000");

    let ids = env.daemon_ids();
    assert_eq!(ids.len(), 1, "{ids:?}");
    let id = &ids[0];
    let pid = env.daemon_pid(id);
    let (uid, capeff) = uid_and_capeff(pid);
    assert_eq!(uid, 1000, "daemon runs as the container's uid");
    assert_eq!(capeff, 0, "daemon has no capabilities");
    assert!(
        environ(pid).contains(&format!("CUDA_VISIBLE_DEVICES={GPU0}")),
        "{:?}",
        environ(pid)
    );
    let shm = env.state.join("mps").join(id).join("shm");
    assert_eq!(
        dev_of(Path::new(&format!("/proc/{pid}/root/dev/shm"))),
        dev_of(&shm),
        "the daemon's /dev/shm is its shm tmpfs"
    );
    assert_ne!(
        dev_of(&shm),
        dev_of(Path::new("/dev/shm")),
        "not the host's /dev/shm"
    );

    // The spec carries what the hook needs, and status shows daemon and container.
    let cfg = c.config();
    assert_eq!(cfg["annotations"]["gpushare.io/daemon"], id.as_str());
    assert_eq!(cfg["annotations"]["gpushare.io/host-uid"], "1000");
    let status = env.status();
    assert_eq!(status[0]["id"], id.as_str());
    assert_eq!(status[0]["health"], "ok");
    assert_eq!(status[0]["containers"][0]["id"], "c1");
    c.delete();
    assert!(
        env.status()[0]["containers"].as_array().unwrap().is_empty(),
        "poststop released the container"
    );
}

#[test]
fn env_request_works_like_the_annotation() {
    let env = Env::new();
    let c = env
        .container("e1")
        .uid(1000)
        .env("GPUSHARE_DEVICE=2")
        .sh(CLIENT)
        .create();
    let out = c.run();
    assert_eq!(client_line(&out)["shm"], "ok");
    let id = &env.daemon_ids()[0];
    assert!(environ(env.daemon_pid(id)).contains(&format!("CUDA_VISIBLE_DEVICES={GPU2}")));
}

#[test]
fn two_users_get_their_servers_at_once() {
    let env = Env::new();
    let hold = "--hold 1.5";
    let [a, b] = env.two_users(["a", "b"], &format!("{CLIENT} {hold}"));
    let [la, lb] = run_at_once([&a, &b]);
    for l in [&la, &lb] {
        let waited: u64 = l["waited_ms"].parse().unwrap();
        assert!(waited < 1000, "no user waits for the other: {l:?}");
        assert_eq!(l["shm"], "ok");
    }
    assert_eq!(la["server_uid"], "1000");
    assert_eq!(lb["server_uid"], "2000");
    assert_eq!(env.daemon_ids().len(), 2, "one daemon per user");
}

/// The failure gpushare exists to remove, shown with the simulator alone: one root
/// control daemon shared by two users serves the second only after the first is done.
#[test]
fn one_shared_daemon_makes_the_second_user_wait() {
    use std::os::unix::process::CommandExt;
    require_root_and_runc();
    let dir = tempfile::Builder::new()
        .prefix("gs")
        .tempdir_in("/tmp")
        .unwrap();
    let pipe = dir.path().join("pipe");
    let log = dir.path().join("log");
    let sim = sim_copy(dir.path());
    // A host-wide daemon shared by several users needs a pipe dir they can all enter.
    std::fs::create_dir(&pipe).unwrap();
    std::fs::set_permissions(&pipe, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let mut daemon = Command::new(&sim)
        .arg("-f")
        .env("CUDA_MPS_PIPE_DIRECTORY", &pipe)
        .env("CUDA_MPS_LOG_DIRECTORY", &log)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let guard = scopeguard(daemon.id() as i32);
    // The pid file comes after the socket's chmod 0666: before it, another uid's connect
    // may be refused (seen under load).
    assert!(wait_until(Duration::from_secs(5), || pipe
        .join("nvidia-cuda-mps-control.pid")
        .exists()));
    let client = |uid: u32| {
        Command::new(&sim)
            .args(["client", "--hold", "1.5"])
            .env("CUDA_MPS_PIPE_DIRECTORY", &pipe)
            .uid(uid)
            .gid(uid)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let mut first = client(1000);
    // The first client holds its server once its line is printed; only then start the second.
    let mut first_line = String::new();
    let mut first_out = std::io::BufReader::new(first.stdout.take().unwrap());
    std::io::BufRead::read_line(&mut first_out, &mut first_line).unwrap();
    let second = client(2000).wait_with_output().unwrap();
    assert!(first.wait().unwrap().success());
    let (l1, l2) = (
        client_line(&first_line),
        client_line(&String::from_utf8_lossy(&second.stdout)),
    );
    assert_eq!(l1["server_uid"], "1000");
    assert_eq!(l2["server_uid"], "2000");
    let waited: u64 = l2["waited_ms"].parse().unwrap();
    assert!(
        waited >= 1000,
        "the second user queued behind the first: {l2:?}"
    );
    assert_ne!(
        l1["server"], l2["server"],
        "the server was replaced for the second user"
    );
    drop(guard);
    let _ = daemon.wait();
}

/// A guard that stops a process on drop (test cleanup on failure).
struct Guard(i32);
fn scopeguard(pid: i32) -> Guard {
    Guard(pid)
}
impl Drop for Guard {
    fn drop(&mut self) {
        stop_process(self.0, None);
    }
}

#[test]
fn sixteen_simultaneous_creates_start_exactly_one_daemon() {
    let env = Env::new();
    let containers: Vec<Container> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..16)
            .map(|i| {
                let env = &env;
                s.spawn(move || {
                    let c = env.request(&format!("p{i}"), 1000, "0").sh(CLIENT).bundle();
                    let out = c.try_create();
                    (c, out.status.success())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                let (c, ok) = h.join().unwrap();
                assert!(ok, "create {} failed: {}", c.id, c.last_error());
                c
            })
            .collect()
    });
    let ids = env.daemon_ids();
    assert_eq!(ids.len(), 1, "{ids:?}");
    let log = env.control_log(&ids[0]);
    assert_eq!(log.matches("Starting control daemon").count(), 1, "{log}");
    assert_eq!(env.record(&ids[0])["restarts"], 0);
    // While all 16 are created and none has exited: once they exit, the supervisor may
    // prune their records as stale before the assertion reads them.
    assert_eq!(env.status()[0]["containers"].as_array().unwrap().len(), 16);
    for c in &containers {
        c.start();
    }
    let mut servers = std::collections::BTreeSet::new();
    for c in &containers {
        c.wait();
        let l = client_line(&c.stdout());
        assert_eq!(l["shm"], "ok");
        servers.insert(l["server"].clone());
    }
    assert_eq!(
        servers.len(),
        1,
        "every container reached the same server: {servers:?}"
    );
}

#[test]
fn each_limit_profile_gets_its_own_daemon_with_limits_before_its_first_client() {
    let env = Env::new();
    let low = env
        .request("low", 1000, "0")
        .annotation("gpushare.io/active-thread-percentage", "25")
        .annotation("gpushare.io/pinned-memory-limit", "1G")
        .sh(CLIENT)
        .create();
    let high = env.client("high", 1000, "50");
    let (ll, lh) = (client_line(&low.run()), client_line(&high.run()));
    assert_eq!(percentage(&ll), 25.0);
    assert!(ll["pinned_mem_limit"].contains("1024M"), "{ll:?}");
    assert_eq!(percentage(&lh), 50.0);
    assert_ne!(ll["server"], lh["server"]);
    let ids = env.daemon_ids();
    assert_eq!(ids.len(), 2, "{ids:?}");
    for id in &ids {
        let log = env.control_log(id);
        let set = log
            .find("Cmd:set_default_active_thread_percentage")
            .unwrap_or_else(|| panic!("limits applied:\n{log}"));
        // The first client makes the daemon start a server, which takes the defaults.
        let client = log
            .find("Starting new server")
            .unwrap_or_else(|| panic!("a client came:\n{log}"));
        assert!(set < client, "limits before the first client:\n{log}");
    }
    let server_line = |c: &Container| {
        let id = c.config()["annotations"]["gpushare.io/daemon"]
            .as_str()
            .unwrap()
            .to_owned();
        env.control_log(&id)
            .lines()
            .find(|l| l.contains("NEW SERVER"))
            .unwrap_or_default()
            .to_owned()
    };
    assert!(
        server_line(&low).contains("active_thread_percentage=25"),
        "{}",
        server_line(&low)
    );
    assert!(
        server_line(&high).contains("active_thread_percentage=50"),
        "{}",
        server_line(&high)
    );
    let low_id = low.config()["annotations"]["gpushare.io/daemon"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(env
        .control_log(&low_id)
        .contains("Cmd:set_default_device_pinned_mem_limit 0 1024M"));
}

#[test]
fn bad_requests_fail_create_cleanly() {
    let env = Env::with_config("");
    let big = "x".repeat(2000);
    // (key, value, text the error must contain besides key and value)
    let cases: &[(&str, &str, &str)] = &[
        ("gpushare.io/device", "7", "this node has GPUs 0, 1, 2"),
        (
            "gpushare.io/device",
            "1",
            "in MIG mode: allowed is one of its MIG devices (1:0, 1:1, 1:2)",
        ),
        (
            "gpushare.io/device",
            "GPU-00000000-0000-0000-0000-000000000000",
            "does not exist",
        ),
        ("gpushare.io/device", "0:5", "GPU 0 has no MIG devices"),
        ("gpushare.io/device", "1:5", "GPU 1 has MIG devices 0, 1, 2"),
        (
            "gpushare.io/device",
            &format!("0,{MIG0}"),
            "must stand alone",
        ),
        ("gpushare.io/device", "../0", "allowed"),
        ("gpushare.io/device", "0/1", "allowed"),
        ("gpushare.io/device", &big, "allowed"),
        ("gpushare.io/active-thread-percentage", "0", "from 1 to 100"),
        (
            "gpushare.io/active-thread-percentage",
            "101",
            "from 1 to 100",
        ),
        (
            "gpushare.io/active-thread-percentage",
            "abc",
            "from 1 to 100",
        ),
        ("gpushare.io/pinned-memory-limit", "0", "allowed"),
        (
            "gpushare.io/pinned-memory-limit",
            "100G",
            "allowed is 1M up to 24G",
        ),
        ("gpushare.io/pinned-memory-limit", "garbage", "allowed"),
        ("gpushare.io/ipc", "host", "allow-ipc-override"),
        ("gpushare.io/ipc", "shared", "allowed"),
    ];
    for (i, (key, value, expect)) in cases.iter().enumerate() {
        let mut b = env.container(&format!("bad{i}")).uid(1000);
        if *key != "gpushare.io/device" {
            b = b.device("0");
        }
        let c = b.annotation(key, value).bundle();
        let before = c.config_bytes();
        let out = c.try_create();
        assert_eq!(out.status.code(), Some(1), "{key}={value}");
        assert!(
            out.stdout.is_empty() && out.stderr.is_empty(),
            "the shim printed nothing: {out:?}"
        );
        let msg = c.last_error();
        let shown: String = value.chars().take(20).collect();
        assert!(msg.starts_with("gpushare: "), "{msg}");
        assert!(
            msg.contains(key) && msg.contains(&shown) && msg.contains(expect),
            "{key}={value}: {msg}"
        );
        assert_eq!(msg.lines().count(), 1, "{msg}");
        assert_eq!(
            c.config_bytes(),
            before,
            "config.json byte-identical for {key}={value}"
        );
        assert!(
            c.state().is_none(),
            "no container was created for {key}={value}"
        );
    }
    assert!(
        env.daemon_ids().is_empty(),
        "no daemon directory was created"
    );
}

#[test]
fn container_without_request_passes_through_untouched() {
    let env = Env::new();
    let c = env
        .container("plain")
        .uid(1000)
        .annotation("other.io/x", "1")
        .sh("echo hello")
        .bundle();
    let before = c.config_bytes();
    assert!(
        !before
            .to_ascii_lowercase()
            .windows(8)
            .any(|w| w == b"gpushare"),
        "the bundle must not spell gpushare for this test to mean anything"
    );
    let log_len = || {
        std::fs::metadata(env.path().join("gpushare.log"))
            .map(|m| m.len())
            .unwrap_or(0)
    };
    let logged = log_len();
    let out = c.try_create();
    assert!(out.status.success(), "{}", c.last_error());
    assert_eq!(c.config_bytes(), before, "config.json byte-identical");
    assert_eq!(
        log_len(),
        logged,
        "no request in its bytes: exec'd like a passthrough, nothing logged"
    );
    assert_eq!(c.run(), "hello\n");
    assert!(
        !env.state.exists(),
        "no state created for a container without a request"
    );
}

#[test]
fn killed_daemon_is_replaced_and_daemons_outlive_their_containers() {
    let env = Env::new();
    let first = env.request("k1", 1000, "0").sh(CLIENT).create();
    assert_eq!(client_line(&first.run())["shm"], "ok");
    first.delete();
    let id = env.daemon_ids().remove(0);
    let pid = env.daemon_pid(&id);
    assert!(
        alive(pid),
        "the daemon outlives the deletion of the container that started it"
    );

    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    assert!(wait_until(Duration::from_secs(5), || !alive(pid)));
    let second = env.request("k2", 1000, "0").sh(CLIENT).create();
    assert_eq!(
        client_line(&second.run())["shm"],
        "ok",
        "the next create got a working daemon"
    );
    let new_pid = env.daemon_pid(&id);
    assert_ne!(new_pid, pid);
    assert!(alive(new_pid));

    // Kill the supervisor and the daemon both: the state is stale and replaced.
    let rec = env.record(&id);
    let sup = rec["supervisor"]["pid"].as_i64().unwrap() as i32;
    for p in [sup, new_pid] {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(p),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    assert!(wait_until(Duration::from_secs(5), || !alive(sup) && !alive(new_pid)));
    let third = env.request("k3", 1000, "0").sh(CLIENT).create();
    assert_eq!(client_line(&third.run())["shm"], "ok");
    let rec = env.record(&id);
    assert_ne!(
        rec["supervisor"]["pid"].as_i64().unwrap() as i32,
        sup,
        "a fresh supervisor"
    );
}

#[test]
fn supervisor_is_detached_and_directories_have_owners_and_modes() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let env = Env::new();
    let c = env.request("d1", 1000, "0").sh("sleep 30").create();
    c.start();
    let id = env.daemon_ids().remove(0);
    let rec = env.record(&id);
    let sup = rec["supervisor"]["pid"].as_i64().unwrap() as i32;
    let daemon = env.daemon_pid(&id);

    // Own session: the supervisor leads it.
    let stat = std::fs::read_to_string(format!("/proc/{sup}/stat")).unwrap();
    let fields: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..].split(' ').collect();
    assert_eq!(
        fields[3],
        sup.to_string(),
        "session id (field 6) is the supervisor's pid"
    );
    // stdio on /dev/null; every other fd is its own (signalfd, its log, the supervisor
    // lock it holds all its life), none inherited.
    let mut saw_log = false;
    for entry in std::fs::read_dir(format!("/proc/{sup}/fd"))
        .unwrap()
        .flatten()
    {
        let fd: i32 = entry.file_name().to_str().unwrap().parse().unwrap();
        let target = std::fs::read_link(entry.path())
            .map(|p| p.display().to_string())
            .unwrap_or_default();
        if fd <= 2 {
            assert_eq!(target, "/dev/null", "fd {fd}");
        } else {
            saw_log |= target.ends_with("gpushare.log");
            let lock = env.state.join("locks").join(format!("{id}.sup"));
            assert!(
                target.contains("signalfd")
                    || target.ends_with("gpushare.log")
                    || target == lock.display().to_string(),
                "unexpected fd {fd} -> {target}"
            );
        }
    }
    assert!(saw_log, "the supervisor keeps its own log open");
    assert!(
        env.gpushare_log().contains("supervisor{daemon="),
        "the supervisor's lines reach the log"
    );
    // In its own cgroup in every hierarchy (cpuset included: it needs its CPUs set first).
    // own_cgroup only warns when it joins nothing, so this is where that fails. A line
    // still at the root ("…:/") is a hierarchy not mounted under /sys/fs/cgroup here, or
    // one the supervisor was refused: that one the log check below catches.
    let own = std::fs::read_to_string(format!("/proc/{sup}/cgroup")).unwrap();
    let mine = format!("/gpushare/{id}-{sup}");
    assert!(
        own.lines().any(|l| l.ends_with(&mine)),
        "the supervisor joined no gpushare cgroup ({mine} in no hierarchy), so its daemon shares the cgroup of whoever started it; /proc/{sup}/cgroup:\n{own}"
    );
    let elsewhere: Vec<&str> = own
        .lines()
        .filter(|l| !l.ends_with(":/") && !l.ends_with(&mine))
        .collect();
    assert!(
        elsewhere.is_empty(),
        "the supervisor stayed in its starter's cgroup in {elsewhere:?}, not in {mine}: own_cgroup joins every hierarchy under /sys/fs/cgroup; /proc/{sup}/cgroup:\n{own}"
    );
    assert!(
        !env.gpushare_log().contains("cannot move the supervisor"),
        "{}",
        env.gpushare_log()
    );
    // Not in the container's cgroup.
    let init = c.state().unwrap()["pid"].as_i64().unwrap();
    let container_cg = std::fs::read_to_string(format!("/proc/{init}/cgroup")).unwrap();
    let sup_cg = std::fs::read_to_string(format!("/proc/{sup}/cgroup")).unwrap();
    for line in sup_cg.lines().filter(|l| !l.ends_with(":/")) {
        assert!(
            !container_cg.lines().any(|l| l == line),
            "supervisor shares {line} with the container"
        );
    }
    // The daemon: the container's uid and gid, no supplementary groups, child of the supervisor.
    let status = std::fs::read_to_string(format!("/proc/{daemon}/status")).unwrap();
    let line = |k: &str| {
        status
            .lines()
            .find(|l| l.starts_with(k))
            .unwrap()
            .to_owned()
    };
    assert!(
        line("Gid:").split_whitespace().skip(1).all(|g| g == "1000"),
        "{}",
        line("Gid:")
    );
    assert_eq!(line("Groups:").trim(), "Groups:");
    assert!(line("PPid:").ends_with(&sup.to_string()));
    assert_eq!(line("NoNewPrivs:").split_whitespace().nth(1), Some("1"));

    let dir = env.state.join("mps").join(&id);
    for (sub, uid, mode) in [
        ("pipe", 1000, 0o700),
        ("log", 1000, 0o700),
        ("shm", 1000, 0o700),
        ("containers", 0, 0o700),
        ("", 0, 0o711),
    ] {
        let md = std::fs::metadata(dir.join(sub)).unwrap();
        assert_eq!(
            (md.uid(), md.permissions().mode() & 0o7777),
            (uid, mode),
            "{sub}"
        );
    }
    let md = std::fs::metadata(&env.state).unwrap();
    assert_eq!((md.uid(), md.permissions().mode() & 0o777), (0, 0o711));
    c.delete();
}

#[test]
fn poststop_never_fails() {
    let env = Env::new();
    for stdin in [
        "",
        "garbage",
        r#"{"id":"../x"}"#,
        r#"{"id":"ok","annotations":{"gpushare.io/daemon":"../../etc"}}"#,
    ] {
        let out = env.gpushare_with_stdin(&["hook", "poststop"], stdin.as_bytes());
        assert!(out.status.success(), "poststop with {stdin:?}: {out:?}");
    }
    // create-runtime with the same input fails with one gpushare line.
    let out = env.gpushare_with_stdin(&["hook", "create-runtime"], br#"{"id":"ok"}"#);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.starts_with("gpushare: ") && err.trim_end().lines().count() == 1,
        "{err}"
    );
    // Not even when its config is unreadable (create-runtime fails then, naming it).
    let broken = env.path().join("broken.toml");
    std::fs::write(&broken, "no-such-key = 1\n").unwrap();
    for (stage, code) in [("poststop", 0), ("create-runtime", 1)] {
        let out = env
            .cmd(gpushare())
            .env("GPUSHARE_CONFIG", &broken)
            .args(["hook", stage])
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(code), "{stage}: {out:?}");
        if code != 0 {
            assert!(
                String::from_utf8_lossy(&out.stderr).contains("no-such-key"),
                "{out:?}"
            );
        }
    }
}
