//! End-to-end tests of the simulator: the built binary run as real daemons, servers and
//! clients in per-test temporary directories, other uids through `CommandExt::uid/gid`.
//!
//! Cargo builds the binary for them (`CARGO_BIN_EXE_gpushare-mps-sim`). The tests that switch
//! uids need root and skip otherwise, listed with their reason in the test command's
//! summary (and failing under `CI=true`: see `skip`).
//!
//! Invariants: nothing sleeps a fixed time to let something happen, everything polls with a
//! deadline; every process a test starts is stopped by a guard's `Drop`, also when the test
//! fails (daemons get SIGTERM first, so they stop their servers and remove their shm files).

use std::collections::HashMap;
use std::fs;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

const DAEMON_START: Duration = Duration::from_secs(10);
const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);

/// The simulator Cargo built for these tests (an integration test of its package).
fn bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_gpushare-mps-sim"))
}

fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// The running test cannot run here, for `reason`; the caller returns after. The test kit's
/// `skip` (testkit/src/common.rs), which this package does not depend on: under `CI=true`
/// it fails (CI runs the tests as root); elsewhere it says why and lists the test in the
/// file `GPUSHARE_TEST_SKIPS` names, which the test command prints at its end.
fn skip(reason: &str) {
    let test = std::thread::current()
        .name()
        .unwrap_or("<unnamed test>")
        .to_owned();
    assert!(
        std::env::var("CI").as_deref() != Ok("true"),
        "{test}: {reason}; under CI=true a test that cannot run fails"
    );
    eprintln!("skipped: {reason}");
    if let Some(file) = std::env::var_os("GPUSHARE_TEST_SKIPS") {
        let line = format!("sim {test}: {reason}\n");
        fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&file)
            .and_then(|mut f| f.write_all(line.as_bytes()))
            .expect("cannot list a skipped test in $GPUSHARE_TEST_SKIPS");
    }
}

fn wait_until(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Gone, or a zombie nobody reaped yet (the test's PID 1 may not reap orphans).
fn process_gone(pid: i32) -> bool {
    match fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit_once(')')
            .map(|(_, rest)| rest.trim_start().starts_with('Z'))
            .unwrap_or(false),
    }
}

fn stop_pid(pid: i32) {
    let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
    let deadline = Instant::now() + Duration::from_secs(5);
    while !process_gone(pid) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    if !process_gone(pid) {
        let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
    }
}

/// A child process killed and reaped on drop.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Proc {
    fn pid(&self) -> i32 {
        i32::try_from(self.0.id()).expect("pid fits i32")
    }

    /// The one stdout line a client prints once attached.
    fn read_line(&mut self) -> String {
        let out = self.0.stdout.as_mut().expect("stdout piped");
        let mut line = String::new();
        BufReader::new(out)
            .read_line(&mut line)
            .expect("read stdout");
        line
    }

    fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.0.try_wait().expect("try_wait") {
                return status;
            }
            assert!(Instant::now() < deadline, "process did not exit in time");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn stderr(&mut self) -> String {
        let mut text = String::new();
        if let Some(err) = self.0.stderr.as_mut() {
            let _ = err.read_to_string(&mut text);
        }
        text
    }
}

/// Runs a command to completion with `input` on stdin; kills it after `timeout`.
fn run_output(mut cmd: Command, input: &str, timeout: Duration) -> Output {
    cmd.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("spawn");
    let pid = i32::try_from(child.id()).expect("pid");
    let mut stdin = child.stdin.take().expect("stdin");
    let input = input.to_string();
    let writer = std::thread::spawn(move || {
        let _ = stdin.write_all(input.as_bytes());
    });
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(timeout) {
        Ok(out) => {
            let _ = writer.join();
            out.expect("wait for command")
        }
        Err(_) => {
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
            panic!("command did not finish within {timeout:?}");
        }
    }
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// `key=value` fields of a client line (`pinned_mem_limit=0=1G` keeps `0=1G`).
fn fields(line: &str) -> HashMap<String, String> {
    assert!(
        line.starts_with("mps-client "),
        "not a client line: {line:?}"
    );
    line.split_whitespace()
        .skip(1)
        .filter_map(|w| w.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// The real and effective uid of a process, from /proc.
fn proc_uid(pid: &str) -> Option<(u32, u32)> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("Uid:"))?;
    let mut ids = line.split_whitespace().skip(1).map(|v| v.parse().ok());
    Some((ids.next()??, ids.next()??))
}

fn shm_file(server: &str) -> PathBuf {
    PathBuf::from(format!("/dev/shm/cuda.shm.sim.{server}"))
}

/// One simulated node: pipe and log directories, the daemons started on them.
struct Sim {
    dir: tempfile::TempDir,
    /// The simulator, copied where every uid reaches it.
    exe: PathBuf,
    pipe: PathBuf,
    log: PathBuf,
    daemon: Option<Proc>,
    /// Daemons started with -d: not our children, stopped by pid.
    detached: Vec<i32>,
}

impl Drop for Sim {
    fn drop(&mut self) {
        if let Some(daemon) = self.daemon.take() {
            stop_pid(daemon.pid());
            drop(daemon);
        }
        for pid in self.detached.drain(..) {
            stop_pid(pid);
        }
    }
}

impl Sim {
    fn new() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        // Clients of other uids must reach the socket (the daemon leaves existing modes alone).
        fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).expect("chmod");
        let pipe = dir.path().join("pipe");
        fs::create_dir(&pipe).expect("mkdir pipe");
        fs::set_permissions(&pipe, fs::Permissions::from_mode(0o755)).expect("chmod pipe");
        let log = dir.path().join("log");
        // In the test's directory: other uids cannot reach target/ in a checkout under a
        // 0700 directory (root's home, `mktemp -d`). A hard link where the file system
        // allows one: a copy is a file open for writing, which a child forked by another
        // test thread in that instant holds until it execs (spawning the copy then fails
        // with ETXTBSY).
        let exe = dir.path().join("gpushare-mps-sim");
        if fs::hard_link(bin(), &exe).is_err() {
            fs::copy(bin(), &exe).expect("copy the simulator");
            fs::set_permissions(&exe, fs::Permissions::from_mode(0o755)).expect("chmod copy");
        }
        Sim {
            dir,
            exe,
            pipe,
            log,
            daemon: None,
            detached: Vec::new(),
        }
    }

    fn cmd(&self) -> Command {
        let mut cmd = Command::new(&self.exe);
        cmd.env("CUDA_MPS_PIPE_DIRECTORY", &self.pipe)
            .env("CUDA_MPS_LOG_DIRECTORY", &self.log)
            .env_remove("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
            .env_remove("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")
            .env_remove("CUDA_VISIBLE_DEVICES");
        cmd
    }

    fn socket(&self) -> PathBuf {
        self.pipe.join("control")
    }

    fn pid_file(&self) -> PathBuf {
        self.pipe.join("nvidia-cuda-mps-control.pid")
    }

    /// Starts `-f` with extra options and waits until it answers control commands.
    fn start(&mut self, opts: &[&str], configure: impl FnOnce(&mut Command)) {
        let mut cmd = self.cmd();
        cmd.arg("-f").args(opts);
        configure(&mut cmd);
        let stderr = fs::File::create(self.dir.path().join("daemon.stderr")).expect("stderr file");
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr);
        let mut daemon = Proc(cmd.spawn().expect("spawn daemon"));
        let deadline = Instant::now() + DAEMON_START;
        loop {
            if let Some(status) = daemon.0.try_wait().expect("try_wait") {
                panic!(
                    "daemon exited with {status} before answering: {}",
                    fs::read_to_string(self.dir.path().join("daemon.stderr")).unwrap_or_default()
                );
            }
            if self.control("get_server_list").status.success() {
                break;
            }
            assert!(Instant::now() < deadline, "daemon did not answer in time");
            std::thread::sleep(Duration::from_millis(10));
        }
        self.daemon = Some(daemon);
    }

    fn control(&self, input: &str) -> Output {
        run_output(self.cmd(), &format!("{input}\n"), COMMAND_TIMEOUT)
    }

    /// A control command that must succeed; its stdout.
    fn ok(&self, input: &str) -> String {
        let out = self.control(input);
        assert!(
            out.status.success(),
            "{input:?} failed: {} {}",
            text(&out.stdout),
            text(&out.stderr)
        );
        text(&out.stdout)
    }

    /// Starts `client` with stdout and stderr piped, as `uid` (its gid the same) if given.
    fn client(&self, args: &[&str], uid: Option<u32>, envs: &[(&str, &str)]) -> Proc {
        self.client_in(&self.pipe, args, uid, envs)
    }

    /// Runs a client to completion and returns its fields; it must succeed.
    fn attach(&self, envs: &[(&str, &str)]) -> HashMap<String, String> {
        let mut cmd = self.cmd();
        cmd.arg("client").envs(envs.iter().copied());
        let out = run_output(cmd, "", COMMAND_TIMEOUT);
        assert!(out.status.success(), "client failed: {}", text(&out.stderr));
        let stdout = text(&out.stdout);
        assert_eq!(stdout.lines().count(), 1, "one line expected: {stdout:?}");
        fields(stdout.trim_end())
    }

    fn log_lines(&self) -> Vec<String> {
        let text = fs::read_to_string(self.log.join("control.log")).unwrap_or_default();
        text.lines()
            .map(|l| {
                // Strip `[date time.ms Control pid] `.
                l.split_once("] ")
                    .map_or_else(|| l.to_string(), |(_, m)| m.to_string())
            })
            .collect()
    }

    fn log_has(&self, message: &str) -> bool {
        self.log_lines().iter().any(|l| l == message)
    }

    fn daemon_pid(&self) -> i32 {
        self.daemon.as_ref().expect("daemon").pid()
    }
}

#[test]
fn version_and_unknown_option() {
    let mut cmd = Command::new(bin());
    cmd.arg("-v");
    let out = run_output(cmd, "", COMMAND_TIMEOUT);
    assert!(out.status.success());
    let version = text(&out.stdout);
    assert!(
        version.starts_with("gpushare-mps-sim ")
            && version
                .trim_end()
                .ends_with("(simulates nvidia-cuda-mps-control)"),
        "{version:?}"
    );
    for bad in [
        &["-x"][..],
        &["-d", "-f"],
        &["-M"],
        &["client", "--hold", "x"],
    ] {
        let mut cmd = Command::new(bin());
        cmd.args(bad);
        let out = run_output(cmd, "", COMMAND_TIMEOUT);
        assert_eq!(out.status.code(), Some(2), "{bad:?}");
        assert_eq!(text(&out.stderr).lines().count(), 1, "{bad:?}");
    }
}

#[test]
fn without_daemon_control_and_client_fail() {
    let sim = Sim::new();
    let out = sim.control("get_server_list");
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        text(&out.stdout),
        "Cannot find MPS control daemon process\n"
    );

    let mut client = sim.client(&[], None, &[]);
    assert_eq!(client.wait_exit(COMMAND_TIMEOUT).code(), Some(1));
    let err = client.stderr();
    let want = format!(
        "gpushare-mps-sim client: cannot connect to MPS control daemon at {}: ",
        sim.socket().display()
    );
    assert!(
        err.starts_with(&want) && err.trim_end().ends_with("(CUDA error 805)"),
        "{err:?}"
    );
}

#[test]
fn foreground_daemon_files_log_and_commands() {
    let mut sim = Sim::new();
    sim.start(&[], |c| {
        c.env("CUDA_VISIBLE_DEVICES", "GPU-1234");
    });
    let pid = sim.daemon_pid();
    assert_eq!(
        fs::read_to_string(sim.pid_file()).expect("pid file"),
        format!("{pid}\n")
    );
    let mode = fs::metadata(sim.socket()).expect("socket").mode() & 0o777;
    assert_eq!(mode, 0o666);
    // Missing log dir is created 0700; the existing pipe dir keeps its 0755.
    assert_eq!(
        fs::metadata(&sim.log).expect("log dir").mode() & 0o777,
        0o700
    );
    assert_eq!(
        fs::metadata(&sim.pipe).expect("pipe dir").mode() & 0o777,
        0o755
    );

    assert_eq!(sim.ok("get_default_active_thread_percentage"), "100.0\n");
    assert_eq!(sim.ok("set_default_active_thread_percentage 25"), "");
    assert_eq!(sim.ok("get_default_active_thread_percentage"), "25.0\n");
    sim.ok("set_default_active_thread_percentage 25.5");
    assert_eq!(sim.ok("get_default_active_thread_percentage"), "25.5\n");
    sim.ok("set_default_device_pinned_mem_limit 0 4096M");
    sim.ok("set_default_device_pinned_mem_limit GPU-1234 2G");
    assert_eq!(sim.ok("get_default_device_pinned_mem_limit 0"), "4G\n");
    assert_eq!(
        sim.ok("get_default_device_pinned_mem_limit GPU-1234"),
        "2G\n"
    );
    assert_eq!(sim.ok("get_default_device_pinned_mem_limit 1"), "\n");
    sim.ok("set_default_device_pinned_mem_limit 1 1536M");
    assert_eq!(sim.ok("get_default_device_pinned_mem_limit 1"), "1536M\n");
    assert_eq!(sim.ok("get_server_list"), "");
    assert_eq!(sim.ok("ps"), "PID ID SERVER DEVICE NAMESPACE COMMAND\n");

    for bad in [
        "bogus_command",
        "set_default_active_thread_percentage 0",
        "set_default_active_thread_percentage 101",
        "set_default_device_pinned_mem_limit 0 5T",
        "get_server_status 999999",
        "get_client_list 999999",
    ] {
        let out = sim.control(bad);
        assert_eq!(out.status.code(), Some(1), "{bad}");
        assert!(!text(&out.stdout).is_empty(), "{bad}: error text expected");
    }
    // Several commands in one session: all run, the exit code reports the failure.
    let out = sim.control("get_default_active_thread_percentage\nbogus\nget_server_list");
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stdout).starts_with("25.5\n"));
    // The bad commands did not change anything.
    assert_eq!(sim.ok("get_default_active_thread_percentage"), "25.5\n");

    let socket = sim.socket();
    let pipe = sim.pipe.display().to_string();
    for want in [
        format!("Starting control daemon using socket {}", socket.display()),
        format!(
            "To connect CUDA applications to this daemon, set env CUDA_MPS_PIPE_DIRECTORY={pipe}"
        ),
        "gpushare-sim: uid=0 gid=0 multiuser=false CUDA_VISIBLE_DEVICES=GPU-1234".to_string(),
        "NEW UI".to_string(),
        "Cmd:set_default_device_pinned_mem_limit 0 4096M".to_string(),
        "UI closed".to_string(),
    ] {
        if want.contains("uid=0") && !is_root() {
            continue;
        }
        assert!(
            sim.log_has(&want),
            "log lacks {want:?}: {:#?}",
            sim.log_lines()
        );
    }
    let raw = fs::read_to_string(sim.log.join("control.log")).expect("log");
    let first = raw.lines().next().expect("a line");
    // [YYYY-MM-DD HH:MM:SS.mmm Control <pid>] message
    let head = format!(" Control {pid}] ");
    assert!(first.starts_with('[') && first.contains(&head), "{first}");
    let stamp = &first[1..first.find(" Control").expect("stamp")];
    assert_eq!(stamp.len(), "2013-08-05 12:50:23.347".len(), "{stamp}");
}

#[test]
fn defaults_reach_new_servers_and_clients() {
    let mut sim = Sim::new();
    sim.start(&[], |_| {});
    sim.ok("set_default_active_thread_percentage 25");
    sim.ok("set_default_device_pinned_mem_limit 0 1G");
    let first = sim.attach(&[]);
    assert_eq!(first["active_thread_percentage"], "25.0");
    assert_eq!(first["pinned_mem_limit"], "0=1G");
    assert_eq!(first["shm"], "ok");
    assert!(first["waited_ms"].parse::<u64>().expect("ms") < 1000);
    let server = first["server"].clone();
    assert_eq!(sim.ok("get_server_list"), format!("{server}\n"));
    assert_eq!(sim.ok(&format!("get_server_status {server}")), "ACTIVE\n");
    assert!(shm_file(&server).exists());

    // The server logged its limits when it became ready, before the client attached.
    let lines = sim.log_lines();
    let ready =
        format!("NEW SERVER {server}: Ready active_thread_percentage=25.0 pinned_mem_limit=0=1G");
    assert!(lines.contains(&format!(
        "Starting new server {server} for user {}",
        nix::unistd::getuid()
    )));
    assert!(lines.contains(&ready), "{lines:#?}");

    // New defaults apply to later servers only: the lingering server keeps its settings.
    sim.ok("set_default_active_thread_percentage 50");
    let second = sim.attach(&[]);
    assert_eq!(second["server"], server, "server lingers and is reused");
    assert_eq!(second["active_thread_percentage"], "25.0");

    // Per-server settings reach clients attaching afterwards.
    sim.ok(&format!("set_active_thread_percentage {server} 40"));
    assert_eq!(
        sim.ok(&format!("get_active_thread_percentage {server}")),
        "40.0\n"
    );
    sim.ok(&format!("set_device_pinned_mem_limit {server} 1 512M"));
    assert_eq!(
        sim.ok(&format!("get_device_pinned_mem_limit {server} 1")),
        "512M\n"
    );
    assert_eq!(
        sim.ok(&format!("get_device_pinned_mem_limit {server} 7")),
        "\n"
    );
    let third = sim.attach(&[]);
    assert_eq!(third["active_thread_percentage"], "40.0");
    assert_eq!(third["pinned_mem_limit"], "0=1G,1=512M");
}

#[test]
fn daemon_environment_sets_initial_defaults() {
    let mut sim = Sim::new();
    sim.start(&[], |c| {
        c.env("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "30")
            .env("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=2G");
    });
    assert_eq!(sim.ok("get_default_active_thread_percentage"), "30.0\n");
    assert_eq!(sim.ok("get_default_device_pinned_mem_limit 0"), "2G\n");
}

#[test]
fn client_environment_only_lowers_limits() {
    let mut sim = Sim::new();
    sim.start(&[], |_| {});
    sim.ok("set_default_active_thread_percentage 50");
    sim.ok("set_default_device_pinned_mem_limit 0 1G");
    let lower = sim.attach(&[
        ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "20"),
        ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=512MB,1=2G"),
    ]);
    assert_eq!(lower["active_thread_percentage"], "20.0");
    assert_eq!(lower["pinned_mem_limit"], "0=512M,1=2G");
    let higher = sim.attach(&[
        ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "80"),
        ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=4G"),
    ]);
    assert_eq!(higher["active_thread_percentage"], "50.0");
    assert_eq!(higher["pinned_mem_limit"], "0=1G");
    // A malformed client setting is the client's error, before it connects.
    let mut bad = sim.client(&[], None, &[("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "lots")]);
    assert_eq!(bad.wait_exit(COMMAND_TIMEOUT).code(), Some(1));
}

#[test]
fn same_uid_clients_share_one_server_at_once() {
    let mut sim = Sim::new();
    sim.start(&[], |_| {});
    let mut a = sim.client(&["--hold", "3"], None, &[]);
    let fa = fields(a.read_line().trim_end());
    let mut b = sim.client(&["--hold", "3"], None, &[]);
    let fb = fields(b.read_line().trim_end());
    assert_eq!(fa["server"], fb["server"]);
    assert!(fb["waited_ms"].parse::<u64>().expect("ms") < 1000, "{fb:?}");
    let server = &fa["server"];
    let mut clients: Vec<String> = sim
        .ok(&format!("get_client_list {server}"))
        .lines()
        .map(str::to_string)
        .collect();
    clients.sort();
    let mut want = vec![a.pid().to_string(), b.pid().to_string()];
    want.sort();
    assert_eq!(clients, want);
    let ps = sim.ok("ps");
    let rows: Vec<&str> = ps.lines().skip(1).collect();
    assert_eq!(rows.len(), 2, "{ps}");
    for row in rows {
        let cols: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(cols[2], server.as_str(), "{row}");
        assert_eq!(cols[3], "sim", "{row}");
        assert!(cols[4].parse::<u64>().expect("ns inode") > 0, "{row}");
    }
    assert!(sim.log_has(&format!(
        "NEW CLIENT {} from user {}: Server already exists",
        b.pid(),
        nix::unistd::getuid()
    )));
    assert!(a.wait_exit(COMMAND_TIMEOUT).success());
    assert!(b.wait_exit(COMMAND_TIMEOUT).success());
    // Detached clients are gone from the server, which lingers.
    wait_until("clients to detach", COMMAND_TIMEOUT, || {
        sim.ok(&format!("get_client_list {server}")).is_empty()
    });
    assert_eq!(sim.ok("get_server_list"), format!("{server}\n"));
}

#[test]
fn root_daemon_queues_other_uid_until_server_is_idle() {
    if !is_root() {
        skip("needs root to run clients as other uids");
        return;
    }
    let mut sim = Sim::new();
    sim.start(&[], |_| {});
    let mut a = sim.client(&["--hold", "1.5"], Some(1000), &[]);
    let fa = fields(a.read_line().trim_end());
    assert_eq!(fa["uid"], "1000");
    assert_eq!(fa["server_uid"], "1000");
    let server_a = fa["server"].clone();
    assert_eq!(
        proc_uid(&server_a),
        Some((1000, 1000)),
        "server runs as the client's uid"
    );
    let mut b = sim.client(&[], Some(2000), &[]);
    let fb = fields(b.read_line().trim_end());
    assert!(b.wait_exit(COMMAND_TIMEOUT).success());
    assert_eq!(fb["uid"], "2000");
    assert_eq!(fb["server_uid"], "2000");
    assert_ne!(fb["server"], server_a, "a new server for the new uid");
    let waited: u64 = fb["waited_ms"].parse().expect("ms");
    assert!(
        waited >= 1000,
        "uid 2000 should wait for uid 1000's client: {waited} ms"
    );
    assert!(a.wait_exit(COMMAND_TIMEOUT).success());

    let pid_a: i32 = server_a.parse().expect("pid");
    wait_until("uid 1000's server to exit", COMMAND_TIMEOUT, || {
        process_gone(pid_a)
    });
    assert!(!shm_file(&server_a).exists(), "server removes its shm file");
    assert!(sim.log_has(&format!(
        "NEW CLIENT {} from user 2000: Server is not ready, push client to pending list",
        b.pid()
    )));
    assert!(sim.log_has(&format!("Server {server_a} exited with status 0")));
    assert!(sim.log_has(&format!(
        "Starting new server {} for user 2000",
        fb["server"]
    )));
    // The uid 2000 server now lingers.
    assert_eq!(sim.ok("get_server_list"), format!("{}\n", fb["server"]));
}

#[test]
fn start_server_runs_as_requested_uid() {
    if !is_root() {
        skip("needs root to start servers as other uids");
        return;
    }
    let mut sim = Sim::new();
    sim.start(&[], |_| {});
    assert_eq!(sim.ok("start_server -uid 1000"), "");
    let server = sim.ok("get_server_list").trim().to_string();
    assert_eq!(proc_uid(&server), Some((1000, 1000)));
    // Idempotent for the same uid, refused for another while this one runs.
    assert_eq!(sim.ok("start_server -uid 1000"), "");
    assert_eq!(sim.control("start_server -uid 2000").status.code(), Some(1));
    let mut client = sim.client(&[], Some(1000), &[]);
    let f = fields(client.read_line().trim_end());
    assert_eq!(f["server"], server);
    assert!(client.wait_exit(COMMAND_TIMEOUT).success());
}

#[test]
fn multiuser_daemon_serves_all_uids_from_one_server() {
    if !is_root() {
        skip("needs root to run clients as other uids");
        return;
    }
    let mut sim = Sim::new();
    sim.start(&["-M"], |_| {});
    let mut a = sim.client(&["--hold", "1.5"], Some(1000), &[]);
    let fa = fields(a.read_line().trim_end());
    let mut b = sim.client(&[], Some(2000), &[]);
    let fb = fields(b.read_line().trim_end());
    assert_eq!(fa["server"], fb["server"]);
    assert_eq!(fa["server_uid"], "0");
    assert_eq!(fb["server_uid"], "0");
    assert_eq!(fb["uid"], "2000");
    assert!(fb["waited_ms"].parse::<u64>().expect("ms") < 1000, "{fb:?}");
    assert_eq!(proc_uid(&fa["server"]), Some((0, 0)));
    assert!(sim.log_has("gpushare-sim: uid=0 gid=0 multiuser=true CUDA_VISIBLE_DEVICES=unset"));
    assert!(b.wait_exit(COMMAND_TIMEOUT).success());
    assert!(a.wait_exit(COMMAND_TIMEOUT).success());
}

/// A directory whose `control` is a link to the daemon's `control_privileged`, reachable by
/// every uid: a control client pointed at it reaches the privileged socket.
fn privileged_view(sim: &Sim) -> PathBuf {
    let view = sim.dir.path().join("privileged-view");
    fs::create_dir(&view).expect("mkdir view");
    fs::set_permissions(&view, fs::Permissions::from_mode(0o755)).expect("chmod view");
    std::os::unix::fs::symlink(sim.pipe.join("control_privileged"), view.join("control"))
        .expect("link");
    view
}

#[test]
fn multiuser_daemon_answers_root_on_control_privileged_while_control_is_jammed() {
    if !is_root() {
        skip("needs root to run clients as other uids");
        return;
    }
    let mut sim = Sim::new();
    sim.start(&["-M"], |_| {});
    let privileged = sim.pipe.join("control_privileged");
    let meta = fs::symlink_metadata(&privileged).expect("control_privileged");
    assert_eq!((meta.mode(), meta.uid()), (0o140755, 0), "srwxr-xr-x root");
    let as_uid = |uid: u32, pipe: &PathBuf, input: &str| {
        let mut cmd = sim.cmd();
        cmd.env("CUDA_MPS_PIPE_DIRECTORY", pipe).uid(uid).gid(uid);
        run_output(cmd, &format!("{input}\n"), COMMAND_TIMEOUT)
    };
    // Through `control`, another uid may read but not change the daemon (driver 580).
    assert!(as_uid(1000, &sim.pipe, "get_server_list").status.success());
    let set = as_uid(1000, &sim.pipe, "set_default_active_thread_percentage 10");
    assert_eq!(set.status.code(), Some(1));
    assert!(
        text(&set.stdout).starts_with("Insufficient privileges for UID 1000."),
        "{set:?}"
    );
    let quit = as_uid(1000, &sim.pipe, "quit");
    assert_eq!(
        text(&quit.stdout),
        "Not enough privilege to execute quit command\n"
    );
    assert_eq!(sim.ok("get_default_active_thread_percentage"), "100.0\n");
    // control_privileged: root only (the socket's mode), control commands only.
    let view = privileged_view(&sim);
    let denied = as_uid(1000, &view, "get_server_list");
    assert_eq!(
        text(&denied.stdout),
        "Cannot find MPS control daemon process\n"
    );
    let mut hello = UnixStream::connect(&privileged).expect("connect as root");
    hello.write_all(b"CLIENT 1 - -\n").expect("hello");
    let mut reply = String::new();
    hello.read_to_string(&mut reply).expect("reply");
    assert!(reply.starts_with("ERR\n"), "{reply:?}");

    // A uid-1000 tenant holds every connection `control` takes, with slow partial lines.
    let mut jam = sim.cmd();
    jam.args(["hold-control", "520", "--every", "0.5"])
        .uid(1000)
        .gid(1000)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let mut jam = Proc(jam.spawn().expect("spawn hold-control"));
    // Past the cap the daemon closes a connection before it reads the command.
    wait_until("control jammed", DAEMON_START, || {
        !sim.control("get_server_list").status.success()
    });
    // Root still reaches the daemon through control_privileged and changes its defaults.
    let root = |input: &str| as_uid(0, &view, input);
    let out = root("set_default_active_thread_percentage 40");
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        text(&root("get_default_active_thread_percentage").stdout),
        "40.0\n"
    );
    assert!(jam.read_line().starts_with("holding "));
    drop(jam);
    assert_eq!(root("quit").status.code(), Some(0));
    let mut daemon = sim.daemon.take().expect("daemon");
    assert!(daemon.wait_exit(COMMAND_TIMEOUT).success());
    assert!(!privileged.exists(), "quit removes control_privileged");
}

#[test]
fn queued_client_times_out_and_leaves_the_queue() {
    if !is_root() {
        skip("needs root to run clients as other uids");
        return;
    }
    let mut sim = Sim::new();
    sim.start(&[], |_| {});
    let mut a = sim.client(&["--hold", "4"], Some(1000), &[]);
    let fa = fields(a.read_line().trim_end());
    let mut b = sim.client(&["--timeout", "0.5"], Some(2000), &[]);
    assert_eq!(b.wait_exit(COMMAND_TIMEOUT).code(), Some(3));
    let err = b.stderr();
    assert!(
        err.contains("still queued") && err.contains("0.5 s"),
        "{err:?}"
    );
    // The gone client no longer blocks: uid 1000 attaches to its server again.
    let mut c = sim.client(&[], Some(1000), &[]);
    let fc = fields(c.read_line().trim_end());
    assert_eq!(fc["server"], fa["server"]);
    assert!(fc["waited_ms"].parse::<u64>().expect("ms") < 1000, "{fc:?}");
    assert!(c.wait_exit(COMMAND_TIMEOUT).success());
}

#[test]
fn non_root_daemon_refuses_other_uids() {
    if !is_root() {
        skip("needs root to run the daemon as another uid");
        return;
    }
    let mut sim = Sim::new();
    let uid = nix::unistd::Uid::from_raw(1000);
    let gid = nix::unistd::Gid::from_raw(1000);
    fs::create_dir(&sim.log).expect("mkdir log");
    for dir in [&sim.pipe, &sim.log] {
        nix::unistd::chown(dir, Some(uid), Some(gid)).expect("chown");
    }
    sim.start(&[], |c| {
        c.uid(1000).gid(1000);
    });
    let mut other = sim.client(&[], Some(2000), &[]);
    assert_eq!(other.wait_exit(COMMAND_TIMEOUT).code(), Some(1));
    let err = other.stderr();
    assert!(err.contains("control daemon runs as user 1000"), "{err:?}");
    assert!(sim.log_has("Server failed to start for user 2000: control daemon runs as user 1000"));
    let mut own = sim.client(&[], Some(1000), &[]);
    let f = fields(own.read_line().trim_end());
    assert_eq!(f["server_uid"], "1000");
    assert!(own.wait_exit(COMMAND_TIMEOUT).success());
}

#[test]
fn quit_stops_server_and_removes_files() {
    let mut sim = Sim::new();
    sim.start(&[], |_| {});
    let server = sim.attach(&[])["server"].clone();
    assert!(shm_file(&server).exists());
    assert_eq!(sim.ok("quit"), "");
    // The answer comes after the cleanup, so no polling is needed for the files.
    assert!(!sim.socket().exists(), "socket removed");
    assert!(!sim.pid_file().exists(), "pid file removed");
    let mut daemon = sim.daemon.take().expect("daemon");
    assert!(daemon.wait_exit(COMMAND_TIMEOUT).success());
    assert!(!shm_file(&server).exists(), "server stopped");
    assert!(process_gone(server.parse().expect("pid")));
    let lines = sim.log_lines();
    assert_eq!(lines.last().map(String::as_str), Some("Exit"));
    assert!(lines.contains(&format!("Server {server} exited with status 0")));
    assert_eq!(
        text(&sim.control("get_server_list").stdout),
        "Cannot find MPS control daemon process\n"
    );
}

#[test]
fn sigterm_behaves_like_quit() {
    let mut sim = Sim::new();
    sim.start(&[], |_| {});
    let server = sim.attach(&[])["server"].clone();
    let mut daemon = sim.daemon.take().expect("daemon");
    kill(Pid::from_raw(daemon.pid()), Signal::SIGTERM).expect("kill");
    assert!(daemon.wait_exit(COMMAND_TIMEOUT).success());
    assert!(!sim.socket().exists());
    assert!(!sim.pid_file().exists());
    assert!(!shm_file(&server).exists());
    assert_eq!(sim.log_lines().last().map(String::as_str), Some("Exit"));
}

#[test]
fn stale_socket_is_taken_over_and_live_daemon_is_not() {
    let mut sim = Sim::new();
    // A socket file nobody listens on, as a killed daemon leaves it.
    drop(UnixListener::bind(sim.socket()).expect("bind"));
    assert!(sim.socket().exists());
    sim.start(&[], |_| {});
    assert_eq!(sim.ok("get_server_list"), "");

    // A second daemon on the same directory refuses to start and leaves the first alone.
    let mut second = sim.cmd();
    second.arg("-f");
    let out = run_output(second, "", COMMAND_TIMEOUT);
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(err.contains("another control daemon"), "{err:?}");
    assert_eq!(err.lines().count(), 1);
    assert_eq!(sim.ok("get_server_list"), "");
}

#[test]
fn socket_answered_by_someone_else_is_not_replaced() {
    let sim = Sim::new();
    let _listener = UnixListener::bind(sim.socket()).expect("bind");
    let mut cmd = sim.cmd();
    cmd.arg("-f");
    let out = run_output(cmd, "", COMMAND_TIMEOUT);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("another control daemon is answering"));
    assert!(sim.socket().exists());
}

#[test]
fn background_daemon_answers_when_launcher_returns() {
    let mut sim = Sim::new();
    let mut cmd = sim.cmd();
    cmd.arg("-d");
    let out = run_output(cmd, "", COMMAND_TIMEOUT);
    let pid: i32 = fs::read_to_string(sim.pid_file())
        .ok()
        .and_then(|p| p.trim().parse().ok())
        .expect("pid file written before -d returns");
    sim.detached.push(pid);
    assert!(out.status.success(), "{}", text(&out.stderr));
    // No polling: -d returns only once the socket listens.
    assert_eq!(sim.ok("get_default_active_thread_percentage"), "100.0\n");
    // Detached: its own session.
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).expect("stat");
    let after = stat.rsplit_once(')').expect("stat format").1;
    let session: i32 = after
        .split_whitespace()
        .nth(3)
        .and_then(|s| s.parse().ok())
        .expect("session id");
    assert_eq!(session, pid);
    let client = sim.attach(&[]);
    assert_eq!(client["shm"], "ok");

    // -d against a running daemon fails with its reason and exit 1.
    let mut again = sim.cmd();
    again.arg("-d");
    let out = run_output(again, "", COMMAND_TIMEOUT);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("another control daemon"));

    assert_eq!(sim.ok("quit"), "");
    wait_until("background daemon to exit", COMMAND_TIMEOUT, || {
        process_gone(pid)
    });
}

#[test]
fn socket_path_too_long_is_named() {
    let sim = Sim::new();
    let long = sim.dir.path().join("p".repeat(110));
    let mut cmd = sim.cmd();
    cmd.env("CUDA_MPS_PIPE_DIRECTORY", &long).arg("-f");
    let out = run_output(cmd, "", COMMAND_TIMEOUT);
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(
        err.contains(&long.join("control").display().to_string()) && err.contains("107"),
        "{err:?}"
    );
}

#[test]
fn client_without_shared_dev_shm_exits_4() {
    let probe = Command::new("unshare")
        .args(["-m", "sh", "-c", "mount -t tmpfs tmpfs /dev/shm"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    if !matches!(probe, Ok(s) if s.success()) {
        skip("cannot mount a private /dev/shm with unshare -m here");
        return;
    }
    let mut sim = Sim::new();
    sim.start(&[], |_| {});
    let mut cmd = Command::new("unshare");
    cmd.args([
        "-m",
        "sh",
        "-c",
        "mount -t tmpfs tmpfs /dev/shm && exec \"$0\" client",
    ])
    .arg(bin())
    .env("CUDA_MPS_PIPE_DIRECTORY", &sim.pipe)
    .env_remove("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    .env_remove("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT");
    let out = run_output(cmd, "", COMMAND_TIMEOUT);
    assert_eq!(out.status.code(), Some(4), "{}", text(&out.stderr));
    let server = sim.ok("get_server_list").trim().to_string();
    assert_eq!(
        text(&out.stderr).trim_end(),
        format!(
            "gpushare-mps-sim client: MPS server {server} shared memory /dev/shm/cuda.shm.sim.{server} not visible: /dev/shm is not shared with the MPS daemon (CUDA error 805)"
        )
    );
    assert!(text(&out.stdout).is_empty());
}

#[test]
fn garbage_silence_and_bad_hello_do_not_hurt_the_daemon() {
    let mut sim = Sim::new();
    sim.start(&[], |_| {});
    let exchange = |send: &[u8]| -> String {
        let mut s = UnixStream::connect(sim.socket()).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(20)))
            .expect("timeout");
        let _ = s.write_all(send);
        let mut reply = String::new();
        let _ = s.read_to_string(&mut reply);
        reply
    };
    assert!(exchange(b"\x00\x01\xfe garbage\n").starts_with("ERR\n"));
    assert!(exchange(&vec![b'x'; 10_000]).starts_with("ERR\n"));
    assert!(exchange(b"CLIENT 1 500 -\n").starts_with("ERROR "));
    assert!(exchange(b"CLIENT\n").starts_with("ERROR "));
    // A peer that sends nothing is dropped after the first-line timeout.
    let started = Instant::now();
    assert_eq!(exchange(b""), "ERR\nno command received within 5 s\n");
    assert!(started.elapsed() < Duration::from_secs(15));
    assert_eq!(sim.ok("get_default_active_thread_percentage"), "100.0\n");
    assert_eq!(sim.ok("get_server_list"), "");
}

#[test]
fn terminate_client_ends_one_client_and_leaves_the_others_and_the_server() {
    let mut sim = Sim::new();
    sim.start(&[], |_| {});
    let mut a = sim.client(&["--hold", "30"], None, &[]);
    let fa = fields(a.read_line().trim_end());
    let mut b = sim.client(&["--hold", "3"], None, &[]);
    let fb = fields(b.read_line().trim_end());
    let server = fa["server"].clone();
    assert_eq!(
        sim.ok(&format!("terminate_client {server} {}", a.pid())),
        "0\n"
    );
    // The client is told (a real one gets CUDA error 810) and runs on until killed.
    assert_eq!(
        a.read_line().trim_end(),
        format!("mps-client terminated pid={} (CUDA error 810)", a.pid())
    );
    assert!(!process_gone(a.pid()));
    assert_eq!(
        sim.ok(&format!("get_client_list {server}")),
        format!("{}\n", b.pid())
    );
    assert!(sim.log_has(&format!("Client {} terminated", a.pid())));
    // Unknown clients and servers are errors.
    for bad in [
        format!("terminate_client {server} {}", a.pid()),
        format!("terminate_client 999999 {}", b.pid()),
    ] {
        assert!(!sim.control(&bad).status.success(), "{bad}");
    }
    assert!(b.wait_exit(COMMAND_TIMEOUT).success());
    assert_eq!(fb["server"], server);
    assert_eq!(sim.ok("get_server_list"), format!("{server}\n"));
    stop_pid(a.pid());
}

#[test]
fn a_client_with_a_gpu_holds_a_context_through_mps_or_directly_and_its_limit_binds_unless_lifted() {
    let mut sim = Sim::new();
    sim.start(&[], |_| {});
    let gpu = "GPU-0fa4e000-0000-4000-8000-00000000beef";
    assert_eq!(
        sim.ok("set_default_device_pinned_mem_limit 0 2G"),
        "",
        "a limit before the first server"
    );
    // Above the limit: refused, as the client's CUDA library refuses it.
    let over = run_output(
        {
            let mut c = sim.cmd();
            c.args(["client", "--gpu", gpu, "--alloc", "3G"]);
            c
        },
        "",
        COMMAND_TIMEOUT,
    );
    assert_eq!(over.status.code(), Some(2), "{}", text(&over.stderr));
    assert!(text(&over.stderr).contains("(CUDA error 2)"));
    // An entry of its own for a device it cannot see lifts the limit (driver 580).
    let mut lifted = sim.client(
        &["--gpu", gpu, "--alloc", "3G", "--hold", "30"],
        None,
        &[("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "1=64G")],
    );
    let line = fields(lifted.read_line().trim_end());
    assert_eq!(line["allocated"], (3u64 << 30).to_string());
    // Its context is a memfd the fake NVML reads: GPU, kind, bytes.
    let context = |pid: i32| {
        fs::read_dir(format!("/proc/{pid}/fd"))
            .expect("fds")
            .flatten()
            .find(|f| {
                fs::read_link(f.path())
                    .is_ok_and(|l| l.to_string_lossy().starts_with("/memfd:gpushare-fake-nvml"))
            })
            .map(|f| fs::read_to_string(f.path()).expect("read the context"))
    };
    assert_eq!(
        context(lifted.pid()).as_deref(),
        Some(format!("{gpu} mps {}\n", 3u64 << 30).as_str())
    );
    // Without a daemon at its pipe directory: a context of its own, outside MPS.
    let empty = sim.dir.path().join("empty");
    fs::create_dir(&empty).expect("mkdir");
    let mut direct = sim.client(
        &["--gpu", gpu, "--alloc", "1G", "--hold", "30"],
        None,
        &[("CUDA_MPS_PIPE_DIRECTORY", empty.to_str().expect("utf-8"))],
    );
    let line = direct.read_line();
    assert!(line.starts_with("direct-client pid="), "{line}");
    assert_eq!(
        context(direct.pid()).as_deref(),
        Some(format!("{gpu} compute {}\n", 1u64 << 30).as_str())
    );
    stop_pid(lifted.pid());
    stop_pid(direct.pid());
}

// ---- MPS v3 (`-p 3`): servers, namespaces, the CLI, and the fake `nvidia-smi memory-limits`.

impl Sim {
    /// Starts `-p 3 -f` with extra options and waits until it answers `server list`.
    fn start_v3(&mut self, opts: &[&str]) {
        self.start_v3_with(opts, Stdio::null());
    }

    fn start_v3_with(&mut self, opts: &[&str], stdin: Stdio) {
        let mut cmd = self.cmd();
        cmd.args(["-p", "3", "-f"]).args(opts);
        let stderr = fs::File::create(self.dir.path().join("daemon.stderr")).expect("stderr file");
        cmd.stdin(stdin).stdout(Stdio::null()).stderr(stderr);
        let mut daemon = Proc(cmd.spawn().expect("spawn daemon"));
        let deadline = Instant::now() + DAEMON_START;
        loop {
            if let Some(status) = daemon.0.try_wait().expect("try_wait") {
                panic!(
                    "daemon exited with {status} before answering: {}",
                    fs::read_to_string(self.dir.path().join("daemon.stderr")).unwrap_or_default()
                );
            }
            if self.cli(&["server", "list"]).status.success() {
                break;
            }
            assert!(Instant::now() < deadline, "daemon did not answer in time");
            std::thread::sleep(Duration::from_millis(10));
        }
        self.daemon = Some(daemon);
    }

    /// A v3 CLI call through `dir`'s `control` (the top-level pipe directory if `None`), as `uid`.
    fn cli_as(&self, dir: Option<&std::path::Path>, uid: Option<u32>, words: &[&str]) -> Output {
        let mut cmd = self.cmd();
        cmd.args(words);
        if let Some(dir) = dir {
            cmd.env("CUDA_MPS_PIPE_DIRECTORY", dir);
        }
        if let Some(uid) = uid {
            cmd.uid(uid).gid(uid);
        }
        run_output(cmd, "", COMMAND_TIMEOUT)
    }

    fn cli(&self, words: &[&str]) -> Output {
        self.cli_as(None, None, words)
    }

    /// A CLI call that must succeed; its stdout.
    fn cli_ok(&self, words: &[&str]) -> String {
        let out = self.cli(words);
        assert!(
            out.status.success(),
            "{words:?} failed: {} {}",
            text(&out.stdout),
            text(&out.stderr)
        );
        text(&out.stdout)
    }

    /// A CLI call that must fail with exactly one line on stderr; that line.
    fn cli_err(&self, dir: Option<&std::path::Path>, uid: Option<u32>, words: &[&str]) -> String {
        let out = self.cli_as(dir, uid, words);
        assert!(
            !out.status.success(),
            "{words:?} succeeded: {}",
            text(&out.stdout)
        );
        let err = text(&out.stderr);
        assert_eq!(err.lines().count(), 1, "{words:?}: {err:?}");
        err.trim_end().to_string()
    }

    /// A client through `dir` (a server or namespace directory), as `uid` if given.
    fn client_in(
        &self,
        dir: &std::path::Path,
        args: &[&str],
        uid: Option<u32>,
        envs: &[(&str, &str)],
    ) -> Proc {
        let mut cmd = self.cmd();
        cmd.env("CUDA_MPS_PIPE_DIRECTORY", dir)
            .arg("client")
            .args(args)
            .envs(envs.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some(uid) = uid {
            cmd.uid(uid).gid(uid);
        }
        Proc(cmd.spawn().expect("spawn client"))
    }

    fn leaf(&self, server: &str, ns: &str) -> PathBuf {
        self.pipe.join(server).join(ns)
    }

    /// Kills the daemon with SIGKILL (a crash: nothing cleaned up) and reaps it.
    fn crash(&mut self) {
        let mut daemon = self.daemon.take().expect("daemon");
        let _ = daemon.0.kill();
        let _ = daemon.0.wait();
    }
}

/// Whether this machine lets a test bind-mount in a mount namespace of its own.
fn can_unshare_mounts() -> bool {
    let probe = Command::new("unshare")
        .args(["-m", "sh", "-c", "mount -t tmpfs tmpfs /mnt"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    matches!(probe, Ok(s) if s.success())
}

#[test]
fn v3_namespaces_cap_two_uids_on_one_server_through_their_leaf_directories_alone() {
    if !is_root() || !can_unshare_mounts() {
        skip("needs root and unshare -m to run clients as other uids through a bind-mounted leaf");
        return;
    }
    let mut sim = Sim::new();
    sim.start_v3(&["-m"]);
    sim.cli_ok(&["server", "create", "s", "--uid=0"]);
    sim.cli_ok(&["namespace", "create", "a", "--server=s"]);
    sim.cli_ok(&["namespace", "create", "b", "--server=s"]);
    sim.cli_ok(&[
        "namespace",
        "set",
        "a",
        "--server=s",
        "--active-thread-percentage=30",
        "--pinned-memory-limit=1G",
    ]);
    sim.cli_ok(&[
        "namespace",
        "set",
        "b",
        "server=s",
        "active-thread-percentage=60",
    ]);
    let leaf_a = sim.leaf("s", "a");
    assert_eq!(
        fs::metadata(&leaf_a).expect("leaf").permissions().mode() & 0o777,
        0o755
    );
    assert_eq!(
        sim.cli_ok(&["namespace", "list", "--server=s", "--format=csv,noheader"]),
        format!(
            "a,s,Ready,1G,30.00,0,{}\nb,s,Ready,unlimited,60.00,0,{}\ndefault,s,Ready,unlimited,100.00,0,{}\n",
            leaf_a.display(),
            sim.leaf("s", "b").display(),
            sim.leaf("s", "default").display()
        )
    );

    // UID 1000 through its leaf; UID 2000 through only its leaf, bind-mounted read-only at
    // another path in a mount namespace of its own, asking for more than its cap.
    let mut a = sim.client_in(&leaf_a, &["--hold", "30"], Some(1000), &[]);
    let fa = fields(a.read_line().trim_end());
    let mnt = sim.dir.path().join("mnt");
    fs::create_dir(&mnt).expect("mkdir mnt");
    let mut cmd = Command::new("unshare");
    cmd.args([
        "-m",
        "sh",
        "-c",
        "mount --bind -o ro \"$1\" \"$2\" && exec setpriv --reuid=2000 --regid=2000 --clear-groups \"$0\" client --hold 30",
    ])
    .arg(&sim.exe)
    .arg(sim.leaf("s", "b"))
    .arg(&mnt)
    .env("CUDA_MPS_PIPE_DIRECTORY", &mnt)
    .env("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "80")
    .env_remove("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let mut b = Proc(cmd.spawn().expect("spawn unshare"));
    let fb = fields(b.read_line().trim_end());

    assert_eq!((fa["uid"].as_str(), fb["uid"].as_str()), ("1000", "2000"));
    assert_eq!(fa["active_thread_percentage"], "30.0");
    assert_eq!(fa["pinned_mem_limit"], "0=1024M");
    // The lower of the client's 80 and the namespace's 60; no pinned limit inherited.
    assert_eq!(fb["active_thread_percentage"], "60.0");
    assert_eq!(fb["pinned_mem_limit"], "none");
    assert_eq!(
        (fa["namespace"].as_str(), fb["namespace"].as_str()),
        ("a", "b")
    );
    assert_eq!(fa["server_name"], "s");
    // One server process, root's, serves both at once: nobody queued.
    assert_eq!(fa["server"], fb["server"]);
    assert_eq!(fb["server_uid"], "0");
    assert_eq!(fb["waited_ms"], "0");
    assert_eq!(proc_uid(&fa["server"]), Some((0, 0)));
    let clients = sim.cli_ok(&["client", "list", "--format=csv"]);
    assert!(
        clients.starts_with("pid,server,device,namespace,cmd\n"),
        "{clients}"
    );
    for (p, ns) in [(a.pid(), "a"), (b.pid(), "b")] {
        assert!(
            clients.contains(&format!("{p},s,0,{ns},")),
            "{p} {ns}: {clients}"
        );
    }

    // A tenant reads everything but changes nothing, even through its own leaf.
    assert!(sim
        .cli_as(Some(&leaf_a), Some(1000), &["namespace", "list"])
        .status
        .success());
    assert_eq!(
        sim.cli_err(
            Some(&leaf_a),
            Some(1000),
            &[
                "namespace",
                "set",
                "a",
                "--server=s",
                "--active-thread-percentage=100"
            ]
        ),
        "Insufficient privileges for UID 1000. 'NAMESPACE SET' requires server owner."
    );
    for (words, title) in [
        (
            &["namespace", "delete", "b", "--server=s", "--force"][..],
            "NAMESPACE DELETE",
        ),
        (&["server", "delete", "s", "--force"], "SERVER DELETE"),
        (&["server", "create", "t"], "SERVER CREATE"),
    ] {
        assert_eq!(
            sim.cli_err(Some(&leaf_a), Some(1000), words),
            format!("Insufficient privileges for UID 1000. '{title}' requires server owner.")
        );
    }
    let b_pid = b.pid().to_string();
    assert_eq!(
        sim.cli_err(Some(&leaf_a), Some(1000), &["client", "terminate", &b_pid]),
        "Insufficient privileges for UID 1000. 'CLIENT TERMINATE' requires server owner."
    );
    let quit = run_output(
        {
            let mut c = sim.cmd();
            c.env("CUDA_MPS_PIPE_DIRECTORY", &leaf_a)
                .uid(1000)
                .gid(1000);
            c
        },
        "quit\n",
        COMMAND_TIMEOUT,
    );
    assert!(!quit.status.success());
    assert_eq!(
        text(&quit.stdout).trim_end(),
        "Insufficient privileges for UID 1000. 'QUIT' requires server owner."
    );

    // Root: limits cannot change under an attached client, nor the namespace go without --force.
    assert_eq!(
        sim.cli_err(None, None, &["namespace", "set", "a", "--server=s", "--client-priority=1"]),
        "namespace set: namespace a on server s has 1 attached client(s); its limits cannot change while a client is attached"
    );
    assert_eq!(
        sim.cli_err(None, None, &["namespace", "delete", "a", "--server=s"]),
        "namespace delete: namespace a on server s has 1 attached client(s); use --force to terminate them"
    );
    sim.cli_ok(&["namespace", "delete", "a", "--server=s", "--force"]);
    assert_eq!(
        a.read_line().trim_end(),
        format!("mps-client terminated pid={} (CUDA error 810)", a.pid())
    );
    assert!(!leaf_a.exists());
    assert!(sim.cli_ok(&["namespace", "list", "a"]).lines().count() == 1);
    // Root may end a client anywhere.
    assert_eq!(sim.cli_ok(&["client", "terminate", &b_pid]), "");
    assert_eq!(
        b.read_line().trim_end(),
        format!("mps-client terminated pid={} (CUDA error 810)", b.pid())
    );
    stop_pid(a.pid());
    stop_pid(b.pid());
}

#[test]
fn v3_server_dir_routes_to_default_main_socket_to_the_uid_server_and_logs() {
    let mut sim = Sim::new();
    sim.start_v3(&[]);
    sim.cli_ok(&["server", "create", "s"]);
    sim.cli_ok(&[
        "server",
        "set",
        "s",
        "--active-thread-percentage=40",
        "--pinned-memory-limit=512M",
    ]);
    let uid = nix::unistd::getuid().as_raw();
    let mut c = sim.client_in(&sim.pipe.join("s"), &[], None, &[]);
    let f = fields(c.read_line().trim_end());
    assert!(c.wait_exit(COMMAND_TIMEOUT).success());
    assert_eq!(f["active_thread_percentage"], "40.0");
    assert_eq!(f["pinned_mem_limit"], "0=512M");
    assert_eq!(
        (f["namespace"].as_str(), f["server_name"].as_str()),
        ("default", "s")
    );
    assert_eq!(f["server_uid"], uid.to_string());
    // The default namespace's pinned limit binds, unless the client's own
    // CUDA_MPS_PINNED_DEVICE_MEM_LIMIT names a device it cannot see: that drops every
    // pinned limit, the namespace's too (measured on r615 in NVIDIA Dynamo's docs).
    let server_dir = sim.pipe.join("s");
    let mut over = sim.client_in(&server_dir, &["--alloc", "1G"], None, &[]);
    assert_eq!(over.wait_exit(COMMAND_TIMEOUT).code(), Some(2));
    let mut lifted = sim.client_in(
        &server_dir,
        &["--alloc", "1G"],
        None,
        &[("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "1=4G")],
    );
    assert!(
        lifted.wait_exit(COMMAND_TIMEOUT).success(),
        "{}",
        lifted.stderr()
    );
    // The main socket: the uid's own `uid_<uid>` server, made on demand, without limits.
    let top = sim.attach(&[("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "25")]);
    assert_eq!(top["server_name"], format!("uid_{uid}"));
    assert_eq!(top["namespace"], "default");
    assert_eq!(top["active_thread_percentage"], "25.0");
    assert_ne!(top["server"], f["server"]);
    let servers = sim.cli_ok(&["server", "list", "--format=csv"]);
    assert_eq!(
        servers,
        format!(
            "name,uid,pid,status,pipe-directory,allowed-devices,context-ids\ns,{uid},{},Ready,{},all,-\nuid_{uid},{uid},{},Ready,{},all,-\n",
            f["server"],
            sim.pipe.join("s").display(),
            top["server"],
            sim.pipe.join(format!("uid_{uid}")).display()
        )
    );
    assert_eq!(sim.cli_ok(&["server", "get", "s", "status"]), "Ready\n");
    assert_eq!(
        sim.cli_ok(&[
            "namespace",
            "get",
            "default",
            "s",
            "active-thread-percentage"
        ]),
        "40.00\n"
    );
    assert!(sim
        .cli_err(None, None, &["server", "get", "s", "bogus"])
        .starts_with("unknown field \"bogus\"; fields: name, uid, pid,"));
    let table = sim.cli_ok(&["server", "list"]);
    assert!(table.starts_with("NAME "), "{table}");
    assert!(sim
        .log_lines()
        .iter()
        .any(|l| l.starts_with("Server s created for user")));
    let server_log = fs::read_to_string(sim.log.join("s").join("server.log")).expect("server.log");
    assert!(
        server_log.contains("NEW CLIENT ") && server_log.contains(" Server "),
        "{server_log}"
    );
    // Legacy commands other than quit are refused; names and sizes follow the rules.
    let out = sim.control("get_server_list");
    assert!(!out.status.success());
    assert_eq!(
        sim.cli_err(None, None, &["server", "create", "Bad-Name"]),
        "invalid server name \"Bad-Name\": names are 1 to 64 lowercase letters, digits or underscores"
    );
    assert_eq!(
        sim.cli_err(None, None, &["server", "create", "s"]),
        "server s already exists"
    );
    // Delete refuses while a client is attached, --force ends it.
    let mut held = sim.client_in(&server_dir, &["--hold", "30"], None, &[]);
    held.read_line();
    assert_eq!(
        sim.cli_err(None, None, &["server", "delete", "s"]),
        "server delete: server s has 1 active client(s); use --force to terminate them"
    );
    sim.cli_ok(&["server", "delete", "s", "--force"]);
    assert_eq!(
        held.read_line().trim_end(),
        format!("mps-client terminated pid={} (CUDA error 810)", held.pid())
    );
    assert!(process_gone(f["server"].parse().expect("pid")));
    assert!(!sim.pipe.join("s").exists());
    stop_pid(held.pid());
}

#[test]
fn v3_multiuser_refuses_a_server_of_another_uid() {
    let mut sim = Sim::new();
    sim.start_v3(&["--multiuser"]);
    assert_eq!(
        sim.cli_err(None, None, &["server", "create", "s", "--uid=1000"]),
        "server create: --uid=1000 is not allowed in multiuser mode; every server is owned by root"
    );
    assert!(sim
        .cli_ok(&["server", "list", "--format=csv,noheader"])
        .is_empty());
    sim.cli_ok(&["server", "create", "s", "--uid=0"]);
    assert_eq!(sim.cli_ok(&["server", "get", "s", "uid"]), "0\n");
}

#[test]
fn v3_restart_loses_every_namespace_and_recreates_them_in_the_same_directories() {
    if !is_root() || !can_unshare_mounts() {
        skip("needs root and unshare -m to hold a bind mount of a leaf across a restart");
        return;
    }
    let mut sim = Sim::new();
    sim.start_v3(&["-m"]);
    sim.cli_ok(&["server", "create", "s"]);
    sim.cli_ok(&["namespace", "create", "a", "--server=s"]);
    let leaf = sim.leaf("s", "a");
    let inode = fs::metadata(&leaf).expect("leaf").ino();
    // A "container": the leaf bind-mounted at another path, held across the restart; its
    // client starts only once `go` exists.
    let mnt = sim.dir.path().join("mnt");
    fs::create_dir(&mnt).expect("mkdir mnt");
    let go = sim.dir.path().join("go");
    let mut cmd = Command::new("unshare");
    cmd.args([
        "-m",
        "sh",
        "-c",
        "mount --bind \"$1\" \"$2\" || exit 9; while [ ! -e \"$3\" ]; do sleep 0.05; done; exec \"$0\" client",
    ])
    .arg(&sim.exe)
    .arg(&leaf)
    .arg(&mnt)
    .arg(&go)
    .env("CUDA_MPS_PIPE_DIRECTORY", &mnt)
    .env_remove("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    .env_remove("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let mut container = Proc(cmd.spawn().expect("spawn unshare"));
    wait_until("the container's mount", COMMAND_TIMEOUT, || {
        fs::read_to_string(format!("/proc/{}/mountinfo", container.pid()))
            .is_ok_and(|m| m.contains(&mnt.display().to_string()))
    });

    sim.crash();
    sim.start_v3(&["-m"]);
    assert!(sim
        .cli_ok(&["server", "list", "--format=csv,noheader"])
        .is_empty());
    assert!(sim
        .cli_ok(&["namespace", "list", "--format=csv,noheader"])
        .is_empty());
    // The dead daemon's directories and sockets are still there; recreating works.
    assert!(leaf.join("control").exists());
    sim.cli_ok(&["server", "create", "s"]);
    sim.cli_ok(&["namespace", "create", "a", "--server=s"]);
    sim.cli_ok(&[
        "namespace",
        "set",
        "a",
        "--server=s",
        "--active-thread-percentage=20",
    ]);
    assert_eq!(fs::metadata(&leaf).expect("leaf").ino(), inode);
    fs::write(&go, "").expect("touch go");
    let f = fields(container.read_line().trim_end());
    assert_eq!(f["namespace"], "a");
    assert_eq!(f["active_thread_percentage"], "20.0");
    assert!(container.wait_exit(COMMAND_TIMEOUT).success());
}

#[test]
fn v3_socket_paths_that_do_not_fit_fail_with_the_bare_line() {
    let sim = Sim::new();
    let long = sim.dir.path().join("p".repeat(110));
    let log = sim.dir.path().join("long-log");
    let mut cmd = sim.cmd();
    cmd.env("CUDA_MPS_PIPE_DIRECTORY", &long)
        .env("CUDA_MPS_LOG_DIRECTORY", &log)
        .args(["-p", "3", "-f"]);
    let out = run_output(cmd, "", COMMAND_TIMEOUT);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        text(&out.stderr),
        "Failed to initialize MPS control daemon\n"
    );
    assert!(!log.exists(), "a log was written");

    // A pipe directory that fits, whose namespace socket would not.
    let base = sim.dir.path().display().to_string().len();
    let mut sim = Sim::new();
    let room = 107 - "/control".len() - base;
    let pipe = sim.dir.path().join("q".repeat(room - 20));
    fs::create_dir(&pipe).expect("mkdir");
    fs::set_permissions(&pipe, fs::Permissions::from_mode(0o755)).expect("chmod");
    sim.pipe = pipe;
    sim.start_v3(&[]);
    sim.cli_ok(&["server", "create", "s"]);
    let ns = "n".repeat(30);
    assert_eq!(
        sim.cli_err(None, None, &["namespace", "create", &ns, "--server=s"]),
        "Failed to initialize MPS control daemon"
    );
    assert!(!sim.leaf("s", &ns).exists());
    assert!(sim.cli_ok(&["namespace", "list", &ns]).lines().count() == 1);
}

#[test]
fn v3_protocol_selection_help_and_a_binary_from_before_615() {
    let sim = Sim::new();
    let run = |args: &[&str], envs: &[(&str, &str)]| {
        let mut cmd = sim.cmd();
        cmd.args(args).envs(envs.iter().copied());
        run_output(cmd, "", COMMAND_TIMEOUT)
    };
    let help = run(&["-p", "3", "-h"], &[]);
    assert!(help.status.success());
    assert!(
        text(&help.stdout).contains(
            "Modules: server namespace client device sm-partition feature memacct context-share"
        ),
        "{}",
        text(&help.stdout)
    );
    let old = [("GPUSHARE_SIM_PROTOCOLS", "2")];
    for args in [
        &["-p", "3", "-h"][..],
        &["-p", "3", "-f"],
        &["server", "list"],
    ] {
        let out = run(args, &old);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert_eq!(text(&out.stderr).lines().count(), 1, "{args:?}");
    }
    let out = run(&["-h"], &[("CUDA_MPS_PROTOCOL_VERSION", "3"), old[0]]);
    assert_eq!(out.status.code(), Some(2));
    let out = run(&["-h"], &old);
    assert!(out.status.success() && !text(&out.stdout).contains("namespace"));

    // The environment wins over the flag: `-p 3` with CUDA_MPS_PROTOCOL_VERSION=2 is legacy,
    // and a v3 CLI call against it fails.
    let mut legacy = Sim::new();
    legacy.start(&["-p", "3"], |c| {
        c.env("CUDA_MPS_PROTOCOL_VERSION", "2");
    });
    assert_eq!(
        legacy.cli_err(None, None, &["server", "list"]),
        format!(
            "the MPS control daemon at {} runs protocol 2 (legacy); 'server list' needs a protocol 3 daemon",
            legacy.pipe.display()
        )
    );
    let mut v3 = Sim::new();
    let mut cmd = v3.cmd();
    cmd.arg("-d").env("CUDA_MPS_PROTOCOL_VERSION", "3");
    let out = run_output(cmd, "", COMMAND_TIMEOUT);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let pid: i32 = fs::read_to_string(v3.pid_file())
        .expect("pid file")
        .trim()
        .parse()
        .expect("pid");
    v3.detached.push(pid);
    assert!(v3
        .cli_ok(&["server", "list", "--format=csv"])
        .starts_with("name,uid,pid,"));
    // Control mode's quit stops a v3 daemon.
    assert!(v3.control("quit").status.success());
    wait_until("the -d daemon to exit", COMMAND_TIMEOUT, || {
        process_gone(pid)
    });
    assert!(!v3.socket().exists());
}

#[test]
fn v3_foreground_daemon_quits_on_stdin() {
    let mut sim = Sim::new();
    sim.start_v3_with(&[], Stdio::piped());
    sim.cli_ok(&["server", "create", "s"]);
    sim.cli_ok(&["namespace", "create", "a", "--server=s"]);
    let server: i32 = sim
        .cli_ok(&["server", "get", "s", "pid"])
        .trim()
        .parse()
        .expect("pid");
    let mut daemon = sim.daemon.take().expect("daemon");
    daemon
        .0
        .stdin
        .take()
        .expect("stdin")
        .write_all(b"quit\n")
        .expect("write quit");
    assert!(daemon.wait_exit(COMMAND_TIMEOUT).success());
    assert!(process_gone(server));
    assert!(!shm_file(&server.to_string()).exists());
    // Sockets go, directories stay for the next daemon.
    assert!(!sim.socket().exists() && !sim.leaf("s", "a").join("control").exists());
    assert!(sim.leaf("s", "a").is_dir());
}

#[test]
fn fake_nvidia_smi_memory_limits_grammar_permissions_and_log() {
    let sim = Sim::new();
    let bin_dir = sim.dir.path().join("bin");
    fs::create_dir(&bin_dir).expect("mkdir bin");
    fs::set_permissions(&bin_dir, fs::Permissions::from_mode(0o777)).expect("chmod bin");
    let smi = bin_dir.join("nvidia-smi");
    std::os::unix::fs::symlink(&sim.exe, &smi).expect("link nvidia-smi");
    let cgroup = sim.dir.path().join("cg");
    fs::create_dir(&cgroup).expect("mkdir cgroup");
    let cg = cgroup.display().to_string();
    let run = |args: &[&str], uid: Option<u32>| {
        let mut cmd = Command::new(&smi);
        cmd.args(args);
        if let Some(uid) = uid {
            cmd.uid(uid).gid(uid);
        }
        run_output(cmd, "", COMMAND_TIMEOUT)
    };
    let fails = |args: &[&str], code: i32, msg: &str| {
        let out = run(args, None);
        assert_eq!(out.status.code(), Some(code), "{args:?}");
        assert_eq!(text(&out.stderr).trim_end(), msg, "{args:?}");
    };
    let usage = "Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.";
    fails(&["-i", "0", "memory-limits", "--get", "-n", &cg], 2, usage);
    fails(
        &[
            "memory-limits",
            "--set",
            "-n",
            &cg,
            "--hard-limit",
            "40G",
            "-i",
            "0",
        ],
        2,
        "Invalid value \"40G\": expected an integer number of MiB, max or default",
    );
    fails(
        &[
            "memory-limits",
            "--set",
            "-n",
            "/nonexistent/cg",
            "--hard-limit",
            "1",
            "-i",
            "0",
        ],
        if is_root() { 6 } else { 4 },
        if is_root() {
            "Unable to set memory limit: Not Found"
        } else {
            "Insufficient Permissions"
        },
    );
    let log = bin_dir.join("memory-limits.jsonl");
    let get = || {
        let out = run(&["memory-limits", "--get", "-n", &cg, "-i", "0"], None);
        assert!(out.status.success(), "{}", text(&out.stderr));
        text(&out.stdout)
    };
    assert_eq!(get(), "hard: max soft: 0 MiB\n");
    if !is_root() {
        skip("needs root to set a memory limit and to try as another uid");
        return;
    }
    let as_user = run(
        &[
            "memory-limits",
            "--set",
            "-n",
            &cg,
            "--hard-limit",
            "3000",
            "-i",
            "0",
        ],
        Some(1000),
    );
    assert_eq!(as_user.status.code(), Some(4));
    assert_eq!(text(&as_user.stderr).trim_end(), "Insufficient Permissions");
    assert!(!log.exists());
    let set = run(
        &[
            "memory-limits",
            "--set",
            "-n",
            &cg,
            "--soft-limit",
            "0",
            "--hard-limit",
            "3000",
            "-i",
            "0",
        ],
        None,
    );
    assert!(set.status.success(), "{}", text(&set.stderr));
    assert_eq!(
        fs::read_to_string(&log).expect("log"),
        format!("{{\"cgroup\":\"{cg}\",\"gpu\":\"0\",\"soft_mib\":0,\"hard_mib\":3000}}\n")
    );
    assert_eq!(get(), "hard: 3000 MiB soft: 0 MiB\n");
    assert!(run(
        &[
            "memory-limits",
            "--set",
            "-n",
            &cg,
            "--hard-limit",
            "max",
            "-i",
            "0"
        ],
        None
    )
    .status
    .success());
    assert_eq!(get(), "hard: max soft: 0 MiB\n");
    assert_eq!(fs::read_to_string(&log).expect("log").lines().count(), 2);
}
