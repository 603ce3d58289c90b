//! The node's agent (`gpushare agent`): supervisors belong to no engine. An engine that is
//! a child subreaper (conmon, containerd's runc shim) adopts whatever a hook leaves behind;
//! conmon 2.1.12 then waits for it before `podman run` returns, 2.1.6 stays alive as long
//! as it does. With the agent, the supervisor is the agent's child: the engine neither
//! adopts it nor waits. Tested with a stand-in subreaper that waits as conmon 2.1.12 does
//! (`gpushare-mps-sim subreaper`), Podman 4.3's own conmon (hooks.d), containerd's shim
//! (ctr), and the agent's socket fed hostile-shaped requests.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::engines::Containerd;
use testkit::*;

/// The parent pid of `pid` (field 4 of /proc/<pid>/stat).
fn ppid(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat[stat.rfind(')')? + 2..].split(' ').nth(1)?.parse().ok()
}

/// The live processes whose command line contains `needle`, with their command lines.
fn processes_with(needle: &str) -> Vec<(i32, String)> {
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(raw) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
            continue;
        };
        let line = String::from_utf8_lossy(&raw).replace('\0', " ");
        if line.contains(needle) && alive(pid) {
            found.push((pid, line));
        }
    }
    found
}

/// The supervisor of the env's one daemon.
fn supervisor(env: &Env) -> i32 {
    let id = env.daemon_ids().remove(0);
    env.record(&id)["supervisor"]["pid"]
        .as_i64()
        .expect("a supervisor in the record") as i32
}

/// `create` and `start` of a container with a request, both under a subreaper that waits
/// for everything it adopted (as conmon 2.1.12 does), cold daemon then warm: it returns as
/// soon as the container has exited, and the supervisor is the agent's child. Fails with
/// the agent path removed (the hook starts the supervisor itself, the subreaper adopts it
/// and waits until the daemon idles out).
#[test]
fn a_waiting_subreaper_returns_when_the_container_exits_cold_or_warm() {
    require_root_and_runc();
    // Long enough that a subreaper waiting for the daemon would be caught.
    let mut env = Env::with_config("idle-timeout = \"120s\"");
    let agent = env.start_agent();
    for round in ["cold", "warm"] {
        let c = env.container(&format!("sr-{round}")).device("0").bundle();
        c.track();
        let script = format!(
            "{rt} --root {root} --log {log} --log-format json create --bundle {b} {id} </dev/null >/dev/null 2>&1 && {rt} --root {root} --log {log} --log-format json start {id}",
            rt = runtime(),
            root = env.runc_root.display(),
            log = c.log().display(),
            b = c.bundle.display(),
            id = c.id,
        );
        let started = Instant::now();
        let mut waiter = env
            .cmd(env.sim().to_str().unwrap())
            .args(["subreaper", "sh", "-c", &script])
            .stdin(Stdio::null())
            .spawn()
            .unwrap();
        let returned = wait_until(Duration::from_secs(20), || {
            matches!(waiter.try_wait(), Ok(Some(_)))
        });
        let took = started.elapsed();
        if !returned {
            stop_child(&mut waiter, Duration::from_secs(1));
        }
        let sup = supervisor(&env);
        assert!(
            returned,
            "{round}: the waiting subreaper did not return within 20 s of the container's exit: it adopted the supervisor {sup} (parent {:?}, agent {agent})\n{}",
            ppid(sup),
            env.gpushare_log()
        );
        assert!(
            waiter.wait().unwrap().success(),
            "{round}: create/start failed: {}",
            c.last_error()
        );
        assert!(took < Duration::from_secs(10), "{round}: took {took:?}");
        assert_eq!(ppid(sup), Some(agent), "{round}: the agent's child");
        c.wait();
        c.delete();
    }
    assert!(
        !env.gpushare_log()
            .contains("no gpushare agent started the supervisor"),
        "no fallback with an agent:\n{}",
        env.gpushare_log()
    );
}

/// Without an agent a create still works (the hook starts the supervisor itself, with one
/// warn line), and an agent killed and started again serves the next daemon.
#[test]
fn a_missing_agent_never_breaks_a_create() {
    require_root_and_runc();
    let mut env = Env::new();
    let c = env.container("no-agent").device("0").create();
    c.start();
    c.wait();
    let log = env.gpushare_log();
    assert_eq!(
        log.matches("no gpushare agent started the supervisor")
            .count(),
        1,
        "one warn line for the one daemon:\n{log}"
    );
    let first = supervisor(&env);
    assert_ne!(ppid(first), Some(std::process::id() as i32));
    c.delete();

    // An agent killed by SIGKILL leaves its socket: creates fall back, and the next agent
    // takes its place and serves the next daemon.
    let agent = env.start_agent();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(agent),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    assert!(wait_until(Duration::from_secs(5), || !alive(agent)));
    assert!(env.state.join("agent.sock").exists(), "a stale socket");
    let c = env.container("dead-agent").device("1:0").create();
    c.start();
    c.wait();
    c.delete();
    let again = env.start_agent();
    let c = env.container("new-agent").device("2").create();
    let id = env.daemon_of(&c);
    let sup = env.record(&id)["supervisor"]["pid"].as_i64().unwrap() as i32;
    assert_eq!(ppid(sup), Some(again));
    c.start();
    c.wait();
    c.delete();
}

/// One exchange with the agent, as root: what it answered (empty if it dropped us).
fn ask(sock: &Path, line: &[u8]) -> String {
    let mut s = UnixStream::connect(sock).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let _ = s.write_all(line);
    let mut answer = String::new();
    let _ = s.read_to_string(&mut answer);
    answer
}

/// The agent's socket takes one well-formed request from root, for a daemon that exists
/// and has no supervisor: anything else is refused with one line, a stalled or endless
/// peer is dropped without holding up the next one, a peer that is not root is refused
/// before it is read. Fails with any of those checks removed from `mps::agent`.
#[test]
fn the_agent_takes_only_a_wellformed_request_from_root_for_a_daemon_without_supervisor() {
    require_root_and_runc();
    let mut env = Env::new();
    env.start_agent();
    let sock = env.state.join("agent.sock");
    let md = std::fs::symlink_metadata(&sock).unwrap();
    use std::os::unix::fs::MetadataExt;
    assert_eq!((md.mode() & 0o777, md.uid()), (0o600, 0));

    let c = env.container("has-daemon").device("0").create();
    let id = env.daemon_of(&c);
    let unknown = "0123456789abcdef0123456789abcdef";
    for (line, want) in [
        (
            format!("supervise {unknown}\n"),
            "refused daemon 0123456789abcdef0123456789abcdef has no record",
        ),
        (
            format!("reap {unknown}\n"),
            "refused daemon 0123456789abcdef0123456789abcdef has no directory",
        ),
        (
            format!("supervise {id}\n"),
            "refused a supervisor of daemon",
        ),
        (
            "supervise ../../../etc\n".into(),
            "refused daemon id \"../../../etc\" is invalid: allowed is 32 lowercase hex digits",
        ),
        (format!("supervise {}\n", id.to_uppercase()), "is invalid"),
        (format!("exec {id}\n"), "refused unknown request \"exec\""),
        (
            format!("supervise {id} --config /tmp/x\n"),
            "refused malformed request",
        ),
        ("ping\n".into(), "ok "),
    ] {
        let answer = ask(&sock, line.as_bytes());
        assert!(
            answer.contains(want),
            "{line:?} -> {answer:?}, want {want:?}"
        );
    }
    // No second supervisor was started for the daemon that has one.
    assert_eq!(processes_with(&format!("supervise --id {id}")).len(), 1);

    // An endless line is dropped; a peer that sends nothing is dropped at the deadline and
    // the next request is still answered.
    assert_eq!(ask(&sock, &[b'a'; 4096]), "");
    let stalled = UnixStream::connect(&sock).unwrap();
    let started = Instant::now();
    assert!(ask(&sock, b"ping\n").starts_with("ok "));
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    drop(stalled);

    // A peer that is not root: the socket's own mode keeps it out (0600); past that (a
    // hard link made reachable and writable), the agent refuses it by its credentials.
    let peer_dir = tempfile::Builder::new()
        .prefix("gs-peer")
        .tempdir_in("/tmp")
        .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(peer_dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::hard_link(&sock, peer_dir.path().join("agent.sock")).unwrap();
    std::fs::set_permissions(
        peer_dir.path().join("agent.sock"),
        std::fs::Permissions::from_mode(0o666),
    )
    .unwrap();
    let config = peer_dir.path().join("runtime.toml");
    let text = std::fs::read_to_string(&env.config).unwrap();
    let text: String = text
        .lines()
        .map(|l| {
            if l.starts_with("state-dir = ") {
                format!("state-dir = {:?}", peer_dir.path().display().to_string())
            } else {
                l.to_owned()
            }
        })
        .collect::<Vec<_>>()
        .join("\n");
    std::fs::write(&config, text).unwrap();
    std::fs::set_permissions(&config, std::fs::Permissions::from_mode(0o644)).unwrap();
    let out = Command::new(need("setpriv", "util-linux"))
        .args([
            "--reuid",
            "1000",
            "--regid",
            "1000",
            "--clear-groups",
            gpushare(),
            "doctor",
        ])
        .env("GPUSHARE_CONFIG", &config)
        .output()
        .unwrap();
    let report = text_of(&out);
    assert!(report.contains("refused: peer uid 1000 (pid "), "{report}");
    std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(0o600)).unwrap();
    c.start();
    c.wait();
    c.delete();
}

fn text_of(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Podman 4.3 with gpushare's hooks.d files (hook-only mode, prestart): conmon 2.1.6 is a
/// subreaper that stays alive as long as a process it adopted does. With the agent it
/// exits when the container does, cold daemon or warm, and the supervisor is the agent's
/// child. Fails with the agent path removed (conmon stays, the supervisor is conmon's).
fn podman_run_returns_at_once(bin: Option<PathBuf>) {
    let mut env = Env::with_config("idle-timeout = \"120s\"");
    // The agent runs where the hooks run: in the engine's mount namespace. A fetched
    // Podman (5) brings its conmon and helpers, named in a containers.conf of its own.
    let p = Podman::new(&env, bin.as_deref());
    env.enter(&p.ns);
    let agent = env.start_agent();
    let runroot = p.runroot();
    let conmons = || {
        processes_with("conmon --api-version 1 -c")
            .into_iter()
            .filter(|(_, l)| l.contains(runroot.to_str().unwrap()))
            .collect::<Vec<_>>()
    };
    for round in ["cold", "warm"] {
        let started = Instant::now();
        let out = p.run_rm("1000", &["--annotation", "gpushare.io/device=0"], "true");
        assert!(out.status.success(), "{round}: {}", text(&out));
        let left = !wait_until(Duration::from_secs(5), || conmons().is_empty());
        let sup = supervisor(&env);
        assert!(
            !left,
            "{round}: conmon stays after its container exited: {:?}; the supervisor {sup}'s parent is {:?} (agent {agent})",
            conmons(),
            ppid(sup)
        );
        assert_eq!(ppid(sup), Some(agent), "{round}");
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{round}: {:?}",
            started.elapsed()
        );
    }
}

#[test]
fn podman_conmon_exits_with_its_container_and_adopts_no_supervisor() {
    podman_run_returns_at_once(None);
}

/// Podman 5: its conmon (2.1.12) waits for every process it adopted before it exits, so a
/// supervisor it adopted would hold `podman run` until the daemon idles out (120 s here).
#[test]
fn podman_5_run_returns_as_soon_as_the_container_exits_cold_or_warm() {
    podman_run_returns_at_once(Some(fetched_podman5()));
}

/// containerd's runc shim (`ctr run`, the shim path): the supervisor is the agent's child,
/// not the shim's, and the shim exits once its container is deleted. Fails with the agent
/// path removed (the shim, a subreaper, adopts the supervisor).
#[test]
fn containerd_shim_adopts_no_supervisor() {
    let mut env = Env::with_config("idle-timeout = \"120s\"");
    need("containerd", "containerd");
    need("ctr", "containerd");
    let dir = env.path().join("c");
    let ns = PrivateMounts::new();
    env.enter(&ns);
    let agent = env.start_agent();
    let c = Containerd::start(&env, &ns, &dir);
    let own_rootfs = c.rootfs();
    let out = c.run_request(&ns, &["--rm"], &own_rootfs, "ctr-agent", &["true"]);
    assert!(out.status.success(), "{}", text(&out));
    let sock = dir.join("c.sock");
    let shims = || {
        processes_with("containerd-shim")
            .into_iter()
            .filter(|(_, l)| l.contains(sock.to_str().unwrap()))
            .collect::<Vec<_>>()
    };
    assert!(
        wait_until(Duration::from_secs(10), || shims().is_empty()),
        "the shim stays after its container was deleted: {:?}",
        shims()
    );
    let sup = supervisor(&env);
    assert_eq!(
        ppid(sup),
        Some(agent),
        "the supervisor is the agent's child"
    );
}
