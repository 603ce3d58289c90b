//! The real engines — a private dockerd configured by `gpushare install docker`,
//! a private containerd driven by `ctr`, Podman with gpushare's hooks.d files (hook-only
//! mode), and the chaining to NVIDIA's runtime. Each daemon is started by the test with
//! its own sockets, roots and state under the test's temp dir and stopped at the end,
//! even on failure; the machine's /etc/docker and /etc/containerd are never touched.
//! Engines also write where no flag moves them (dockerd's /etc/docker/key.json and
//! /run/docker/plugins, the containerd shim's /run/containerd/{s,fifo,runc}, Podman's
//! /var/lib/containers/cache and /var/cache/containers): each engine runs in a mount
//! namespace of its own (`PrivateMounts`) where those places are empty tmpfs.
//!
//! The engine tier (`engine_tier`) runs on every engine version users run: Debian 12's
//! Docker 20.10, containerd 1.6 and Podman 4.3, and the newer ones `scripts/fetch-engines`
//! extracts from Debian trixie and sid (Docker 26 and 28, containerd 1.7 and 2.x, Podman
//! 5), found through the `GPUSHARE_TEST_*` variables scripts/test exports. A test whose
//! engine is not fetched fails, saying how to fetch it.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use testkit::*;

const CLIENT: &str = "gpushare-mps-sim client";

pub(crate) struct Dockerd {
    dir: PathBuf,
    sock: String,
    child: Child,
    config: PathBuf,
    /// A fetched Docker's directory (dockerd, docker, and the containerd it starts); `None`:
    /// Debian 12's, on PATH.
    bin: Option<PathBuf>,
}

impl Dockerd {
    fn start(env: &Env, ns: &PrivateMounts) -> Dockerd {
        Dockerd::start_with(env, ns, false)
    }

    /// A private dockerd configured by `gpushare install docker`, plus `live-restore` when
    /// asked (what Docker users turn on to keep containers through a dockerd restart).
    pub(crate) fn start_with(env: &Env, ns: &PrivateMounts, live_restore: bool) -> Dockerd {
        Dockerd::start_in(env, ns, live_restore, None)
    }

    /// As `start_with`, with the Docker whose binaries are in `bin` (see `fetched`).
    fn start_in(env: &Env, ns: &PrivateMounts, live_restore: bool, bin: Option<&Path>) -> Dockerd {
        Dockerd::start_configured(env, ns, bin, &|daemon_json| {
            if live_restore {
                let mut v: serde_json::Value =
                    serde_json::from_slice(&std::fs::read(daemon_json).unwrap()).unwrap();
                v["live-restore"] = serde_json::json!(true);
                std::fs::write(daemon_json, v.to_string()).unwrap();
            }
        })
    }

    /// A private dockerd (the one in `bin`, else Debian 12's) configured by `gpushare
    /// install docker`, then by `configure` on its daemon.json before it starts.
    pub(crate) fn start_configured(
        env: &Env,
        ns: &PrivateMounts,
        bin: Option<&Path>,
        configure: &dyn Fn(&Path),
    ) -> Dockerd {
        let dir = env.path().join("d");
        std::fs::create_dir_all(&dir).unwrap();
        // Configured by our own installer.
        let daemon_json = dir.join("daemon.json");
        let out = env
            .cmd(gpushare())
            .args(["install", "docker", "--config"])
            .arg(&daemon_json)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", text(&out));
        assert!(
            text(&out).contains("SIGHUP") || text(&out).contains("-HUP"),
            "{}",
            text(&out)
        );
        configure(&daemon_json);
        let d = Dockerd {
            sock: format!("unix://{}", dir.join("docker.sock").display()),
            child: Dockerd::spawn(&dir, &env.config, ns, bin),
            dir,
            config: env.config.clone(),
            bin: bin.map(Path::to_owned),
        };
        d.wait_up();
        let tar = rootfs_tar(&d.dir);
        let out = d.docker(&["import", tar.to_str().unwrap(), "gpushare-test:latest"]);
        assert!(out.status.success(), "{}", text(&out));
        d
    }

    /// Stops dockerd (SIGTERM, as `systemctl restart docker` does) and starts it again.
    pub(crate) fn restart(&mut self, ns: &PrivateMounts) {
        stop_child(&mut self.child, Duration::from_secs(30));
        self.child = Dockerd::spawn(&self.dir, &self.config, ns, self.bin.as_deref());
        self.wait_up();
    }

    fn spawn(dir: &Path, config: &Path, ns: &PrivateMounts, bin: Option<&Path>) -> Child {
        let dockerd = match bin {
            Some(bin) => bin.join("dockerd"),
            None => need("dockerd", "docker.io"),
        };
        let daemon_json = dir.join("daemon.json");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("dockerd.log"))
            .unwrap();
        let mut cmd = ns.cmd(dockerd);
        if let Some(bin) = bin {
            // dockerd starts the containerd (and its shim) it finds on PATH: its own.
            cmd.env("PATH", path_with(bin));
        }
        cmd.env("GPUSHARE_CONFIG", config)
            .arg("--data-root")
            .arg(dir.join("data"))
            .arg("--exec-root")
            .arg(dir.join("exec"))
            .arg("--pidfile")
            .arg(dir.join("docker.pid"))
            .arg("--host")
            .arg(format!("unix://{}", dir.join("docker.sock").display()))
            .arg("--config-file")
            .arg(&daemon_json)
            .args([
                "--bridge",
                "none",
                "--iptables=false",
                "--ip-masq=false",
                "--ip-forward=false",
                "--storage-driver",
                "vfs",
            ])
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap()
    }

    fn wait_up(&self) {
        let up = wait_until(Duration::from_secs(60), || {
            self.docker(&["version"]).status.success()
        });
        assert!(
            up,
            "dockerd did not come up:\n{}",
            std::fs::read_to_string(self.dir.join("dockerd.log")).unwrap_or_default()
        );
    }

    pub(crate) fn docker(&self, args: &[&str]) -> Output {
        let docker = match &self.bin {
            Some(bin) => bin.join("docker"),
            None => PathBuf::from("docker"),
        };
        Command::new(docker)
            .arg("--host")
            .arg(&self.sock)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    }
}

impl Drop for Dockerd {
    fn drop(&mut self) {
        let ids = self.docker(&["ps", "-aq"]);
        for id in String::from_utf8_lossy(&ids.stdout).split_whitespace() {
            let _ = self.docker(&["rm", "-f", id]);
        }
        stop_child(&mut self.child, Duration::from_secs(20));
        umount_below(&self.dir);
    }
}

/// `gpushare uninstall docker` gives back daemon.json as it was before `install docker`
/// (here: no file), and says that dockerd must restart to forget the runtime: a reload
/// keeps the runtimes dockerd loaded when it finds no `runtimes` key at all.
#[test]
fn docker_uninstall_gives_back_daemon_json_as_it_was() {
    let env = Env::new();
    let ns = PrivateMounts::new();
    let d = Dockerd::start(&env, &ns);
    let daemon_json = d.dir.join("daemon.json");
    let out = env
        .cmd(gpushare())
        .args(["uninstall", "docker", "--config"])
        .arg(&daemon_json)
        .output()
        .unwrap();
    assert_succeeded_saying(&out, "systemctl restart docker");
    assert!(!daemon_json.exists(), "there was none before install");
    assert!(!d.dir.join("daemon.json.gpushare-undo").exists());
    // Twice changes nothing.
    let out = env
        .cmd(gpushare())
        .args(["uninstall", "docker", "--config"])
        .arg(&daemon_json)
        .output()
        .unwrap();
    assert!(text(&out).contains("nothing to do"), "{}", text(&out));
}

#[test]
fn docker_runs_shared_gpu_containers_through_gpushare() {
    let env = Env::new();
    let ns = PrivateMounts::new();
    let d = Dockerd::start(&env, &ns);
    let info = text(&d.docker(&["info"]));
    assert!(
        info.contains("gpushare"),
        "the installed runtime is known to dockerd:\n{info}"
    );

    let run = |extra: &[&str], cmd: &str| {
        let mut args = vec!["run", "--rm", "--runtime", "gpushare"];
        args.extend_from_slice(extra);
        args.extend_from_slice(&["gpushare-test", "sh", "-c", cmd]);
        d.docker(&args)
    };
    // A request by env var (Docker 20.10 has no --annotation): daemon, mounts, a server.
    let out = run(
        &["-u", "1000", "-e", "GPUSHARE_DEVICE=0"],
        &format!("echo PIPE=$CUDA_MPS_PIPE_DIRECTORY; {CLIENT}"),
    );
    let s = text(&out);
    assert!(out.status.success(), "{s}");
    assert!(s.contains("PIPE=/tmp/nvidia-mps"), "{s}");
    assert_eq!(client_line(&s)["shm"], "ok");
    assert_eq!(client_line(&s)["server_uid"], "1000");

    // docker exec into a running gpushare container goes through the shim untouched.
    let out = d.docker(&[
        "run",
        "-d",
        "--runtime",
        "gpushare",
        "-u",
        "1000",
        "-e",
        "GPUSHARE_DEVICE=0",
        "gpushare-test",
        "sleep",
        "60",
    ]);
    assert!(out.status.success(), "{}", text(&out));
    let id = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    let out = d.docker(&["exec", &id, "sh", "-c", CLIENT]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(client_line(&text(&out))["shm"], "ok");
    let _ = d.docker(&["rm", "-f", &id]);

    // A bad request: gpushare's line in docker's error output, nothing runs.
    let out = run(
        &[
            "-u",
            "1000",
            "-e",
            "GPUSHARE_DEVICE=0",
            "-e",
            "GPUSHARE_ACTIVE_THREAD_PERCENTAGE=101",
        ],
        "true",
    );
    assert!(!out.status.success());
    assert!(
        text(&out).contains("gpushare: GPUSHARE_ACTIVE_THREAD_PERCENTAGE=\"101\" is invalid: allowed is an integer from 1 to 100"),
        "{}",
        text(&out)
    );

    // Without a request: unaffected.
    let before = env.daemon_ids();
    let out = run(&[], "echo plain");
    assert!(
        out.status.success() && text(&out).contains("plain"),
        "{}",
        text(&out)
    );
    assert_eq!(env.daemon_ids(), before);

    // --shm-size does not break isolated mode: /dev/shm is the daemon's 64M tmpfs.
    let out = run(
        &[
            "-u",
            "2000",
            "--shm-size",
            "256m",
            "-e",
            "GPUSHARE_DEVICE=0",
        ],
        &format!("df -k /dev/shm | tail -1; {CLIENT}"),
    );
    let s = text(&out);
    assert!(out.status.success(), "{s}");
    assert_eq!(client_line(&s)["shm"], "ok");
    let size: u64 = s
        .lines()
        .find(|l| l.contains("/dev/shm"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert_eq!(
        size, 65536,
        "the daemon's shm tmpfs, not Docker's 256m:\n{s}"
    );
}

/// A private containerd (no CRI plugin) with its sockets and roots under `dir`, for `ctr`.
pub(crate) struct Containerd {
    dir: PathBuf,
    sock: PathBuf,
    config: PathBuf,
    child: Child,
    /// A fetched containerd's directory (containerd, its shim, ctr); `None`: Debian 12's.
    bin: Option<PathBuf>,
}

impl Containerd {
    pub(crate) fn start(env: &Env, ns: &PrivateMounts, dir: &Path) -> Containerd {
        Containerd::start_in(env, ns, dir, None, 2)
    }

    /// As `start`, with the containerd whose binaries are in `bin` (see `fetched`), on a
    /// config of `version` (2: containerd 1.x, 3: 2.x).
    fn start_in(
        env: &Env,
        ns: &PrivateMounts,
        dir: &Path,
        bin: Option<&Path>,
        version: u32,
    ) -> Containerd {
        std::fs::create_dir_all(dir).unwrap();
        let sock = dir.join("c.sock");
        // No CRI plugin: ctr needs none (2.x's is split in three; their ids are allowed to
        // be absent from the list in every version).
        std::fs::write(
            dir.join("daemon.toml"),
            format!(
                "version = {version}\nroot = {:?}\nstate = {:?}\ndisabled_plugins = [\"io.containerd.grpc.v1.cri\", \"io.containerd.cri.v1.runtime\", \"io.containerd.cri.v1.images\"]\n[grpc]\n  address = {:?}\n{}",
                dir.join("root").display().to_string(),
                dir.join("state").display().to_string(),
                sock.display().to_string(),
                containerd_opt_plugin(dir),
            ),
        )
        .unwrap();
        let c = Containerd {
            child: Containerd::spawn(dir, &env.config, ns, bin),
            dir: dir.to_owned(),
            sock,
            config: env.config.clone(),
            bin: bin.map(Path::to_owned),
        };
        c.wait_up(ns);
        c
    }

    fn spawn(dir: &Path, config: &Path, ns: &PrivateMounts, bin: Option<&Path>) -> Child {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("containerd.log"))
            .unwrap();
        let mut cmd = match bin {
            // containerd finds its shim on PATH before beside itself.
            Some(bin) => {
                let mut cmd = ns.cmd(bin.join("containerd"));
                cmd.env("PATH", path_with(bin));
                cmd
            }
            None => ns.cmd(need("containerd", "containerd")),
        };
        cmd.env("GPUSHARE_CONFIG", config)
            .arg("--config")
            .arg(dir.join("daemon.toml"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap()
    }

    fn wait_up(&self, ns: &PrivateMounts) {
        assert!(
            wait_until(Duration::from_secs(30), || self
                .ctr(ns, &["version"])
                .status
                .success()),
            "containerd did not come up"
        );
    }

    /// Stops containerd (SIGTERM; its shims and their containers stay) and starts it again.
    pub(crate) fn restart(&mut self, ns: &PrivateMounts) {
        stop_child(&mut self.child, Duration::from_secs(10));
        self.child = Containerd::spawn(&self.dir, &self.config, ns, self.bin.as_deref());
        self.wait_up(ns);
    }

    pub(crate) fn ctr(&self, ns: &PrivateMounts, args: &[&str]) -> Output {
        let ctr = match &self.bin {
            Some(bin) => bin.join("ctr"),
            None => PathBuf::from("ctr"),
        };
        ns.cmd(ctr)
            .arg("--address")
            .arg(&self.sock)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    }

    /// `ctr run <flags>` of container `id` on `rootfs` with gpushare-runtime as its runc,
    /// asking for GPU 0 (`gpushare.io/device=0`), running `command`.
    pub(crate) fn run_request(
        &self,
        ns: &PrivateMounts,
        flags: &[&str],
        rootfs: &Path,
        id: &str,
        command: &[&str],
    ) -> Output {
        let mut args = vec!["run"];
        args.extend_from_slice(flags);
        args.extend_from_slice(&[
            "--rootfs",
            "--runc-binary",
            runtime(),
            "--annotation",
            "gpushare.io/device=0",
            "--env",
            "PATH=/usr/bin:/bin",
            rootfs.to_str().unwrap(),
            id,
        ]);
        args.extend_from_slice(command);
        self.ctr(ns, &args)
    }

    /// A copy of the test rootfs of its own (ctr --rootfs uses the directory as is).
    pub(crate) fn rootfs(&self) -> PathBuf {
        let own = self.dir.join("rootfs");
        if !own.exists() {
            assert!(Command::new("cp")
                .arg("-a")
                .arg(rootfs())
                .arg(&own)
                .status()
                .unwrap()
                .success());
        }
        own
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        stop_child(&mut self.child, Duration::from_secs(10));
        umount_below(&self.dir);
    }
}

#[test]
fn containerd_accepts_the_installed_config_and_ctr_runs_through_gpushare() {
    let env = Env::new();
    let containerd = need("containerd", "containerd");
    need("ctr", "containerd");
    let dir = env.path().join("c");
    std::fs::create_dir_all(&dir).unwrap();

    // The installer on a copy of a real containerd 1.6 config, and on a new file.
    for (name, seed) in [
        (
            "copy.toml",
            std::fs::read_to_string("/etc/containerd/config.toml").unwrap_or_default(),
        ),
        ("new.toml", String::new()),
    ] {
        let cfg = dir.join(name);
        std::fs::write(&cfg, &seed).unwrap();
        let out = env
            .cmd(gpushare())
            .args(["install", "containerd", "--config"])
            .arg(&cfg)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", text(&out));
        // Every line of the original survives, in order (the new table goes beside its parent).
        let after = std::fs::read_to_string(&cfg).unwrap();
        let mut rest = after.lines();
        for line in seed.lines() {
            assert!(
                rest.any(|l| l == line),
                "{name}: line {line:?} of the original was lost:\n{after}"
            );
        }
        let dump = Command::new(&containerd)
            .arg("--config")
            .arg(&cfg)
            .args(["config", "dump"])
            .output()
            .unwrap();
        let dump = text(&dump);
        assert!(
            dump.contains(r#"[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.gpushare]"#),
            "{name}:\n{dump}"
        );
        assert!(
            dump.contains(&format!(
                "BinaryName = \"{}\"",
                Path::new(runtime()).display()
            )),
            "{dump}"
        );
        assert!(dump.contains(&testkit::pod_annotations_line()), "{dump}");
        let again = env
            .cmd(gpushare())
            .args(["install", "containerd", "--config"])
            .arg(&cfg)
            .output()
            .unwrap();
        assert!(
            text(&again).contains("nothing to do"),
            "idempotent: {}",
            text(&again)
        );
    }

    // A private containerd; ctr runs a container with gpushare-runtime as its runc.
    let ns = PrivateMounts::new();
    let c = Containerd::start(&env, &ns, &dir);
    let ctr = |args: &[&str]| c.ctr(&ns, args);
    let own_rootfs = c.rootfs();
    let script = format!("echo PIPE=$CUDA_MPS_PIPE_DIRECTORY; {CLIENT}");
    let out = c.run_request(&ns, &["--rm"], &own_rootfs, "ctr1", &["sh", "-c", &script]);
    let s = text(&out);
    assert!(
        out.status.success(),
        "{s}\n{}",
        std::fs::read_to_string(dir.join("containerd.log")).unwrap_or_default()
    );
    assert!(s.contains("PIPE=/tmp/nvidia-mps"), "{s}");
    assert_eq!(client_line(&s)["shm"], "ok");
    // ctr runs as root: that root container's daemon still has no capabilities.
    let id = env.daemon_ids().remove(0);
    assert_eq!(
        uid_and_capeff(env.daemon_pid(&id)),
        (0, 0),
        "root's per-user daemon is capless"
    );
    // The README's step 4b, its two `ctr run` lines as it shows them (`$T/runtime` is
    // gpushare-runtime with this env's config, as the README's wrapper is; `$T/rootfs`
    // the test rootfs): GPU 0, then MIG 1:0 at 25 % of the threads.
    let readme = std::fs::read_to_string(repo().join("README.md")).unwrap();
    let mut lines = readme.lines();
    let mut runs = Vec::new();
    while let Some(line) = lines.next() {
        if let Some(first) = line.strip_prefix("ctr run --rm --runc-binary $T/runtime ") {
            let rest = lines.next().unwrap_or_default();
            runs.push(format!("{} {}", first.trim_end_matches('\\'), rest.trim()));
        }
    }
    assert_eq!(runs.len(), 2, "the README's step 4b has changed: {runs:#?}");
    for (run, threads) in runs.iter().zip(["100.0", "25.0"]) {
        let mut args = vec!["run", "--rm", "--runc-binary", runtime()];
        for word in run.split_whitespace() {
            args.push(match word {
                "$T/rootfs" => own_rootfs.to_str().unwrap(),
                w => w,
            });
        }
        let out = ctr(&args);
        let s = text(&out);
        assert!(out.status.success(), "ctr {run}: {s}");
        let client = client_line(&s);
        assert_eq!(client["uid"], "0", "{s}");
        assert_eq!(client["server_uid"], "0", "{s}");
        assert_eq!(client["active_thread_percentage"], threads, "{s}");
        assert_eq!(client["shm"], "ok", "{s}");
    }
}

#[test]
fn podman_hook_only_mode_mounts_the_daemon_into_the_container() {
    let env = Env::new();
    let p = Podman::new(&env, None);
    let run = |user: &str, extra: &[&str], cmd: &str| p.run_rm(user, extra, cmd);
    let out = run(
        "1000",
        &["--annotation", "gpushare.io/device=0"],
        &format!("ls /tmp/nvidia-mps; {CLIENT}; cat /proc/self/mountinfo"),
    );
    let s = text(&out);
    assert!(out.status.success(), "{s}");
    // The pipe directory read-only, both mounts nosuid,nodev,noexec (the topmost
    // mount at each place; tenant_mounts.rs tests the same through plain runc).
    for (at, want) in [
        ("/tmp/nvidia-mps", "ro,nosuid,nodev,noexec"),
        ("/dev/shm", "rw,nosuid,nodev,noexec"),
    ] {
        let options = s
            .lines()
            .rfind(|l| l.split(' ').nth(4) == Some(at))
            .and_then(|l| l.split(' ').nth(5))
            .unwrap_or_default();
        assert!(
            options.starts_with(want),
            "{at} is mounted {options:?}:\n{s}"
        );
    }
    assert!(
        s.lines().any(|l| l == "control"),
        "the pipe dir is at CUDA's default path:\n{s}"
    );
    let line = client_line(&s);
    assert_eq!(
        (line["shm"].as_str(), line["server_uid"].as_str()),
        ("ok", "1000")
    );
    let id = env.daemon_ids().remove(0);
    assert_eq!(uid_and_capeff(env.daemon_pid(&id)).0, 1000);
    // The poststop hook released the container.
    assert!(wait_until(Duration::from_secs(5), || env.status()[0]
        ["containers"]
        .as_array()
        .unwrap()
        .is_empty()));

    // A bad request fails the container with gpushare's line.
    let out = run(
        "1000",
        &[
            "--annotation",
            "gpushare.io/device=0",
            "--annotation",
            "gpushare.io/pinned-memory-limit=99G",
        ],
        "true",
    );
    assert!(!out.status.success());
    assert!(
        text(&out).contains("gpushare.io/pinned-memory-limit=\"99G\" exceeds the memory"),
        "{}",
        text(&out)
    );
    // Without the annotation the hook is not even run.
    let out = run("1000", &[], "echo plain; ls /tmp/nvidia-mps 2>&1 | head -1");
    assert!(
        out.status.success() && text(&out).contains("plain"),
        "{}",
        text(&out)
    );
    assert!(!text(&out).contains("control"));
}

/// `bin` first on PATH (a fetched engine's helpers: containerd's shim, docker-init).
fn path_with(bin: &Path) -> std::ffi::OsString {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut dirs = vec![bin.to_owned()];
    dirs.extend(std::env::split_paths(&path));
    std::env::join_paths(dirs).unwrap()
}

/// How a container asks: an annotation or an env var (`key=value`).
#[derive(Clone, Copy)]
enum Ask<'a> {
    Annotation(&'a str),
    Env(&'a str),
}

/// One engine version as the tier drives it: containers by name, as a user, asking in
/// the given ways, running `sh -c <cmd>`.
trait Engine {
    /// Starts a container and leaves it running; its id.
    fn start(&self, name: &str, uid: u32, asks: &[Ask], cmd: &str) -> String;
    /// What a started container printed so far.
    fn output(&self, id: &str) -> String;
    /// Runs a container to its end and removes it.
    fn run(&self, name: &str, uid: u32, asks: &[Ask], cmd: &str) -> Output;
    /// Removes a started container (stopping it first).
    fn remove(&self, id: &str);
    /// The containers the engine still has.
    fn listed(&self) -> String;
}

/// The README's step 4a as it is written, on a running dockerd: `gpushare install docker
/// --name gpushare-try --runtime-path …`, then `kill -HUP` of dockerd (a reload: the
/// runtime is known without a restart), then each of the README's `docker` lines of the
/// trial exactly as it shows them (its image `gpushare-sim` is the test rootfs, tagged),
/// with the outcome the README prints: each user's client on a server of its own, the
/// MIG device's memory limit, and gpushare's line for the two refused requests.
#[test]
fn docker_takes_a_runtime_on_sighup_and_runs_the_readme_s_docker_lines() {
    let env = Env::new();
    let ns = PrivateMounts::new();
    let d = Dockerd::start(&env, &ns);
    let out = env
        .cmd(gpushare())
        .args([
            "install",
            "docker",
            "--name",
            "gpushare-try",
            "--runtime-path",
        ])
        .arg(runtime())
        .arg("--config")
        .arg(d.dir.join("daemon.json"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    // `kill -HUP $(pidof dockerd)`: this dockerd's pid, from its pidfile.
    let pid: i32 = std::fs::read_to_string(d.dir.join("docker.pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGHUP,
    )
    .unwrap();
    assert!(
        wait_until(Duration::from_secs(30), || text(&d.docker(&["info"]))
            .contains("gpushare-try")),
        "dockerd did not take runtimes.gpushare-try on SIGHUP:\n{}",
        text(&d.docker(&["info"]))
    );
    let out = d.docker(&["tag", "gpushare-test:latest", "gpushare-sim"]);
    assert!(out.status.success(), "{}", text(&out));
    let readme = std::fs::read_to_string(repo().join("README.md")).unwrap();
    let lines: Vec<&str> = readme
        .lines()
        .filter(|l| l.starts_with("docker run ") && l.contains("--runtime gpushare-try"))
        .chain(readme.lines().filter(|l| *l == "docker rm -f alice"))
        .collect();
    assert_eq!(lines.len(), 7, "the README's trial has changed: {lines:#?}");
    for line in lines {
        let args: Vec<&str> = line.split_whitespace().skip(1).collect();
        let out = d.docker(&args);
        let said = text(&out);
        if line.contains("GPUSHARE_DEVICE=1 ") {
            assert!(!out.status.success(), "{line}: {said}");
            assert!(
                said.contains("gpushare: GPUSHARE_DEVICE=\"1\" names GPU 1, which is in MIG mode: allowed is one of its MIG devices (1:0, 1:1, 1:2)"),
                "{line}: {said}"
            );
        } else if line.contains("GPUSHARE_PINNED_MEMORY_LIMIT=12G") {
            assert!(!out.status.success(), "{line}: {said}");
            assert!(
                said.contains(
                    "gpushare: GPUSHARE_PINNED_MEMORY_LIMIT=\"12G\" exceeds the memory of MIG-"
                ) && said.contains("(10 GiB): allowed is 1M up to 10G"),
                "{line}: {said}"
            );
        } else {
            assert!(out.status.success(), "{line}: {said}");
            if line.contains("--rm") {
                let uid = if line.contains("-u 1000") { 1000 } else { 2000 };
                let mine = format!("uid={uid} server=");
                let own = format!("server_uid={uid} ");
                assert!(
                    said.contains("mps-client pid=1 ")
                        && said.contains(&mine)
                        && said.contains(&own)
                        && said.contains("shm=ok"),
                    "{line}: {said}"
                );
                if line.contains("PINNED_MEMORY_LIMIT=4GB") {
                    assert!(said.contains("pinned_mem_limit=0=4096M"), "{line}: {said}");
                }
            }
        }
    }
}

/// The tier every engine version runs: a bad request fails with gpushare's line and
/// nothing started; a container without a request passes through; two users at once on
/// GPU 0, each with a daemon of their own (`first` and `second` say how each asks); and
/// once they are removed, nothing of theirs is left.
fn engine_tier(env: &Env, e: &dyn Engine, first: Ask, second: Ask, bad: Ask) {
    let out = e.run("bad", 1000, &[first, bad], "echo ran");
    let s = text(&out);
    assert!(!out.status.success(), "{s}");
    assert!(
        s.contains("gpushare: ")
            && s.contains("=\"101\" is invalid: allowed is an integer from 1 to 100"),
        "{s}"
    );
    assert!(!s.contains("ran"), "{s}");
    assert!(
        env.daemon_ids().is_empty(),
        "a refused request starts nothing"
    );
    assert!(e.listed().trim().is_empty(), "{}", e.listed());

    let out = e.run(
        "plain",
        1000,
        &[],
        "echo plain; ls /tmp/nvidia-mps; echo PIPE=$CUDA_MPS_PIPE_DIRECTORY",
    );
    let s = text(&out);
    assert!(out.status.success() && s.contains("plain"), "{s}");
    assert!(
        !s.contains("control") && s.contains("PIPE=\n"),
        "passed through:\n{s}"
    );
    assert!(env.daemon_ids().is_empty());

    // The pipe directory at CUDA's default path (hook-only mode cannot set the env).
    let script = format!("ls /tmp/nvidia-mps; {CLIENT}; exec sleep 60");
    let a = e.start("u1000", 1000, &[first], &script);
    let b = e.start("u2000", 2000, &[second], &script);
    for (id, uid) in [(&a, "1000"), (&b, "2000")] {
        let mut s = String::new();
        let served = wait_until(Duration::from_secs(30), || {
            s = e.output(id);
            s.contains("mps-client ")
        });
        assert!(served, "{uid}:\n{s}\n{}", env.gpushare_log());
        assert!(s.lines().any(|l| l == "control"), "{s}");
        let line = client_line(&s);
        assert_eq!(
            (line["shm"].as_str(), line["server_uid"].as_str()),
            ("ok", uid),
            "{s}"
        );
    }
    let ids = env.daemon_ids();
    assert_eq!(ids.len(), 2, "one daemon per user: {ids:?}");
    let mut uids: Vec<u32> = ids
        .iter()
        .map(|id| uid_and_capeff(env.daemon_pid(id)).0)
        .collect();
    uids.sort();
    assert_eq!(uids, [1000, 2000]);

    e.remove(&a);
    e.remove(&b);
    assert!(e.listed().trim().is_empty(), "{}", e.listed());
    let mut status = serde_json::Value::Null;
    let released = wait_until(Duration::from_secs(10), || {
        status = env.status();
        status
            .as_array()
            .unwrap()
            .iter()
            .all(|d| d["containers"].as_array().unwrap().is_empty())
    });
    assert!(released, "every container released:\n{status:#}");
}

/// A dockerd of one version configured by `gpushare install docker`, containers through
/// `--runtime gpushare`.
struct DockerTier(Dockerd);

impl DockerTier {
    fn args<'a>(name: &'a str, uid: &'a str, asks: &[Ask<'a>]) -> Vec<&'a str> {
        let mut args = vec!["--name", name, "--runtime", "gpushare", "-u", uid];
        for ask in asks {
            match ask {
                Ask::Annotation(kv) => args.extend(["--annotation", kv]),
                Ask::Env(kv) => args.extend(["-e", kv]),
            }
        }
        args
    }
}

impl Engine for DockerTier {
    fn start(&self, name: &str, uid: u32, asks: &[Ask], cmd: &str) -> String {
        let uid = uid.to_string();
        let mut args = vec!["run", "-d"];
        args.extend(DockerTier::args(name, &uid, asks));
        args.extend(["gpushare-test", "sh", "-c", cmd]);
        let out = self.0.docker(&args);
        assert!(out.status.success(), "{}", text(&out));
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    fn output(&self, id: &str) -> String {
        text(&self.0.docker(&["logs", id]))
    }

    fn run(&self, name: &str, uid: u32, asks: &[Ask], cmd: &str) -> Output {
        let uid = uid.to_string();
        let mut args = vec!["run", "--rm"];
        args.extend(DockerTier::args(name, &uid, asks));
        args.extend(["gpushare-test", "sh", "-c", cmd]);
        self.0.docker(&args)
    }

    fn remove(&self, id: &str) {
        let out = self.0.docker(&["rm", "-f", id]);
        assert!(out.status.success(), "{}", text(&out));
    }

    fn listed(&self) -> String {
        String::from_utf8_lossy(&self.0.docker(&["ps", "-aq"]).stdout).into_owned()
    }
}

/// Docker `bin` (`None`: Debian 12's 20.10) through the tier. Docker 20.10 asks by env
/// only; Docker ≥ 24 passes `--annotation` into the spec, which the first user uses.
fn docker_tier(bin: Option<PathBuf>) {
    let env = Env::new();
    let ns = match &bin {
        Some(bin) => PrivateMounts::keeping(env.path(), &[&fetched_root(bin)]),
        None => PrivateMounts::new(),
    };
    let d = DockerTier(Dockerd::start_in(&env, &ns, false, bin.as_deref()));
    let version = text(&d.0.docker(&["version", "--format", "{{.Server.Version}}"]));
    eprintln!("dockerd {version}");
    let first = match bin {
        Some(_) => Ask::Annotation("gpushare.io/device=0"),
        None => Ask::Env("GPUSHARE_DEVICE=0"),
    };
    engine_tier(
        &env,
        &d,
        first,
        Ask::Env("GPUSHARE_DEVICE=0"),
        Ask::Env("GPUSHARE_ACTIVE_THREAD_PERCENTAGE=101"),
    );
}

#[test]
fn docker_20_10_engine_tier() {
    docker_tier(None);
}

#[test]
fn docker_26_engine_tier() {
    docker_tier(Some(fetched(
        "GPUSHARE_TEST_DOCKER26",
        "trixie",
        &["dockerd", "docker", "containerd", "containerd-shim-runc-v2"],
    )));
}

#[test]
fn docker_28_engine_tier() {
    docker_tier(Some(fetched(
        "GPUSHARE_TEST_DOCKER28",
        "sid",
        &["dockerd", "docker", "containerd", "containerd-shim-runc-v2"],
    )));
}

/// A private containerd of one version driven by `ctr run --runc-binary gpushare-runtime`,
/// each container on a rootfs of its own whose /out collects what it prints.
struct CtrTier<'a> {
    c: Containerd,
    ns: &'a PrivateMounts,
    /// ctr has `--user` (1.7 on); containerd 1.6's ctr is given the whole spec instead
    /// (`--config`: `ctr oci spec` with the user, command, env and annotations set).
    user_flag: bool,
    /// Appended to every container id: ctr's cgroups are /default/<id> on the host,
    /// shared by every containerd the tests run at once.
    tag: String,
}

impl CtrTier<'_> {
    fn rootfs(&self, name: &str) -> PathBuf {
        let own = self.c.dir.join(format!("rootfs-{name}"));
        assert!(Command::new("cp")
            .arg("-a")
            .arg(rootfs())
            .arg(&own)
            .status()
            .unwrap()
            .success());
        // What the container prints, for any user.
        std::fs::write(own.join("out"), "").unwrap();
        std::fs::set_permissions(
            own.join("out"),
            std::os::unix::fs::PermissionsExt::from_mode(0o666),
        )
        .unwrap();
        own
    }

    /// `ctr oci spec` made into the container's: for a ctr without `--user`.
    fn spec(&self, name: &str, rootfs: &Path, uid: u32, asks: &[Ask], cmd: &str) -> PathBuf {
        let out = self.c.ctr(self.ns, &["oci", "spec"]);
        assert!(out.status.success(), "{}", text(&out));
        let mut spec: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        spec["process"]["user"] = serde_json::json!({"uid": uid, "gid": uid});
        spec["process"]["args"] = serde_json::json!(["sh", "-c", cmd]);
        spec["root"] = serde_json::json!({"path": rootfs});
        // As ctr does with an image or --rootfs (the spec's own is /default itself).
        spec["linux"]["cgroupsPath"] = format!("/default/{name}").into();
        let mut env = vec!["PATH=/usr/bin:/bin".to_owned()];
        let mut annotations = serde_json::Map::new();
        for ask in asks {
            match ask {
                Ask::Annotation(kv) => {
                    let (k, v) = kv.split_once('=').unwrap();
                    annotations.insert(k.to_owned(), v.into());
                }
                Ask::Env(kv) => env.push((*kv).to_owned()),
            }
        }
        spec["process"]["env"] = serde_json::json!(env);
        spec["annotations"] = annotations.into();
        let path = self.c.dir.join(format!("spec-{name}.json"));
        std::fs::write(&path, spec.to_string()).unwrap();
        path
    }

    /// The container `name` is run as `<name>-<tag>`: its id.
    fn ctr_run(&self, detach: bool, name: &str, uid: u32, asks: &[Ask], cmd: &str) -> Output {
        let id = format!("{name}-{}", self.tag);
        let name = id.as_str();
        let rootfs = self.rootfs(name);
        let uid = uid.to_string();
        let cmd = format!("exec >/out 2>&1; {cmd}");
        let mut args = vec![
            "run",
            if detach { "-d" } else { "--rm" },
            "--rootfs",
            "--runc-binary",
            runtime(),
            "--user",
            &uid,
            "--env",
            "PATH=/usr/bin:/bin",
        ];
        for ask in asks {
            match ask {
                Ask::Annotation(kv) => args.extend(["--annotation", kv]),
                Ask::Env(kv) => args.extend(["--env", kv]),
            }
        }
        let rootfs_arg = rootfs.to_str().unwrap();
        let spec;
        if self.user_flag {
            args.extend([rootfs_arg, name, "sh", "-c", &cmd]);
        } else {
            spec = self.spec(name, &rootfs, uid.parse().unwrap(), asks, &cmd);
            args = vec![
                "run",
                if detach { "-d" } else { "--rm" },
                "--runc-binary",
                runtime(),
                "--config",
                spec.to_str().unwrap(),
                name,
            ];
        }
        let out = self.c.ctr(self.ns, &args);
        if !detach {
            // What the container printed, after ctr's own lines.
            let printed = std::fs::read(rootfs.join("out")).unwrap_or_default();
            let _ = self.c.ctr(self.ns, &["containers", "delete", name]);
            let mut out = out;
            out.stdout.extend(printed);
            return out;
        }
        out
    }
}

impl Engine for CtrTier<'_> {
    fn start(&self, name: &str, uid: u32, asks: &[Ask], cmd: &str) -> String {
        let out = self.ctr_run(true, name, uid, asks, cmd);
        assert!(out.status.success(), "{}", text(&out));
        format!("{name}-{}", self.tag)
    }

    fn output(&self, id: &str) -> String {
        std::fs::read_to_string(self.c.dir.join(format!("rootfs-{id}/out"))).unwrap_or_default()
    }

    fn run(&self, name: &str, uid: u32, asks: &[Ask], cmd: &str) -> Output {
        self.ctr_run(false, name, uid, asks, cmd)
    }

    fn remove(&self, id: &str) {
        let out = self.c.ctr(self.ns, &["tasks", "delete", "--force", id]);
        assert!(out.status.success(), "{}", text(&out));
        let out = self.c.ctr(self.ns, &["containers", "delete", id]);
        assert!(out.status.success(), "{}", text(&out));
    }

    fn listed(&self) -> String {
        String::from_utf8_lossy(&self.c.ctr(self.ns, &["containers", "list", "-q"]).stdout)
            .into_owned()
    }
}

/// containerd `bin` (`None`: Debian 12's 1.6) through the tier with ctr, after `gpushare
/// install containerd` wrote a config of `version` for it that it accepts.
fn containerd_tier(bin: Option<PathBuf>, version: u32) {
    let env = Env::new();
    let dir = env.path().join("c");
    std::fs::create_dir_all(&dir).unwrap();
    let containerd = match &bin {
        Some(bin) => bin.join("containerd"),
        None => need("containerd", "containerd"),
    };
    // The installer on a new file, with this containerd first on PATH (it picks the config
    // version by asking `containerd --version`), then the containerd reads it back with the
    // runtime where that version's CRI plugin looks.
    let cfg = dir.join("installed.toml");
    let mut install = env.cmd(gpushare());
    if let Some(bin) = &bin {
        install.env("PATH", path_with(bin));
    }
    let out = install
        .args(["install", "containerd", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let written = std::fs::read_to_string(&cfg).unwrap();
    assert!(
        written.starts_with(&format!("version = {version}\n")),
        "{written}"
    );
    let dump = Command::new(&containerd)
        .arg("--config")
        .arg(&cfg)
        .args(["config", "dump"])
        .output()
        .unwrap();
    let dump = text(&dump);
    // containerd 2.x dumps its config with single quotes, and its CRI plugin is split.
    let (table, quote) = match version {
        2 => (
            r#"[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.gpushare]"#,
            '"',
        ),
        _ => (
            "[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.gpushare]",
            '\'',
        ),
    };
    assert!(dump.contains(table), "{dump}");
    assert!(
        dump.contains(&format!(
            "BinaryName = {quote}{}{quote}",
            Path::new(runtime()).display()
        )),
        "{dump}"
    );
    assert!(
        dump.contains(&format!(
            "pod_annotations = [{quote}gpushare.io/device{quote}"
        )),
        "{dump}"
    );

    let ns = match &bin {
        Some(bin) => PrivateMounts::keeping(env.path(), &[&fetched_root(bin)]),
        None => PrivateMounts::new(),
    };
    let c = Containerd::start_in(&env, &ns, &dir, bin.as_deref(), version);
    let version = text(&c.ctr(&ns, &["version"]));
    eprintln!("{version}");
    let tier = CtrTier {
        c,
        ns: &ns,
        user_flag: bin.is_some(),
        tag: env
            .path()
            .file_name()
            .unwrap()
            .to_string_lossy()
            .into_owned(),
    };
    engine_tier(
        &env,
        &tier,
        Ask::Annotation("gpushare.io/device=0"),
        Ask::Annotation("gpushare.io/device=0"),
        Ask::Annotation("gpushare.io/active-thread-percentage=101"),
    );
}

#[test]
fn containerd_1_6_engine_tier() {
    containerd_tier(None, 2);
}

#[test]
fn containerd_1_7_engine_tier() {
    containerd_tier(
        Some(fetched(
            "GPUSHARE_TEST_CONTAINERD17",
            "trixie",
            &["containerd", "containerd-shim-runc-v2", "ctr"],
        )),
        2,
    );
}

#[test]
fn containerd_2_engine_tier() {
    containerd_tier(
        Some(fetched(
            "GPUSHARE_TEST_CONTAINERD2",
            "sid",
            &["containerd", "containerd-shim-runc-v2", "ctr"],
        )),
        3,
    );
}

/// Podman of one version (testkit's `Podman`) as an engine of the tier.
struct PodmanTier(Podman);

impl PodmanTier {
    fn args<'b>(name: &'b str, uid: &'b str, asks: &[Ask<'b>]) -> Vec<&'b str> {
        let mut args = vec!["--name", name];
        args.extend(Podman::run_args(uid));
        for ask in asks {
            match ask {
                Ask::Annotation(kv) => args.extend(["--annotation", kv]),
                Ask::Env(kv) => args.extend(["--env", kv]),
            }
        }
        args
    }

    fn pm(&self, args: &[&str]) -> Output {
        self.0.run(args)
    }
}

impl Engine for PodmanTier {
    fn start(&self, name: &str, uid: u32, asks: &[Ask], cmd: &str) -> String {
        let uid = uid.to_string();
        let mut args = vec!["run", "-d"];
        args.extend(PodmanTier::args(name, &uid, asks));
        args.extend(["gpushare-test", "sh", "-c", cmd]);
        let out = self.pm(&args);
        assert!(out.status.success(), "{}", text(&out));
        name.to_owned()
    }

    fn output(&self, id: &str) -> String {
        text(&self.pm(&["logs", id]))
    }

    fn run(&self, name: &str, uid: u32, asks: &[Ask], cmd: &str) -> Output {
        let uid = uid.to_string();
        let mut args = vec!["run", "--rm"];
        args.extend(PodmanTier::args(name, &uid, asks));
        args.extend(["gpushare-test", "sh", "-c", cmd]);
        let out = self.pm(&args);
        // A container whose prestart hook failed is left created: removed here too.
        let _ = self.pm(&["rm", "-f", name]);
        out
    }

    fn remove(&self, id: &str) {
        let out = self.pm(&["rm", "-f", "-t", "0", id]);
        assert!(out.status.success(), "{}", text(&out));
    }

    fn listed(&self) -> String {
        String::from_utf8_lossy(&self.pm(&["ps", "-aq"]).stdout).into_owned()
    }
}

/// Podman `bin` (`None`: Debian 12's 4.3) through the tier, asking by annotation (the
/// hooks.d files run the hook on `gpushare.io/device`).
///
/// This tier starts no agent, so a daemon's supervisor is the hook's and conmon adopts it;
/// Podman 5's conmon waits for the processes it adopted before it exits (the agent tests
/// show a foreground `podman run` with the agent). The tier starts its served containers
/// detached (`run -d`, which returns once the container
/// runs) and removes them with `rm -f`, and every podman command is bounded.
fn podman_tier(bin: Option<PathBuf>) {
    let env = Env::new();
    let mut podman = Podman::new(&env, bin.as_deref());
    podman.limit = 60;
    let p = PodmanTier(podman);
    eprintln!("{}", text(&p.pm(&["--version"])));
    engine_tier(
        &env,
        &p,
        Ask::Annotation("gpushare.io/device=0"),
        Ask::Annotation("gpushare.io/device=0"),
        Ask::Annotation("gpushare.io/active-thread-percentage=101"),
    );
}

#[test]
fn podman_4_3_engine_tier() {
    podman_tier(None);
}

#[test]
fn podman_5_engine_tier() {
    podman_tier(Some(fetched_podman5()));
}

#[test]
fn chaining_to_nvidia_container_runtime_passes_argv_and_visible_devices() {
    let env = Env::new();
    // A stand-in for NVIDIA's shim: records its argv and the spec it was given, then runs runc.
    let dir = nvidia_stand_in(&env, &["runc"]);

    // A host-wide MPS pipe dir that NVIDIA's toolkit would mount over ours: warned about.
    let host_pipe = Path::new("/tmp/nvidia-mps");
    let created = !host_pipe.exists() && std::fs::create_dir(host_pipe).is_ok();
    let c = env.request("nv1", 1000, "2").sh(CLIENT).create();
    if created {
        let _ = std::fs::remove_dir(host_pipe);
    }
    let log = env.gpushare_log();
    assert!(
        log.contains("WARN")
            && log.contains("NVIDIA's container toolkit mounts into GPU containers"),
        "{log}"
    );
    assert_eq!(client_line(&c.run())["shm"], "ok");
    let argv = std::fs::read_to_string(dir.join("argv")).unwrap();
    let first: Vec<&str> = argv.lines().take(8).collect();
    assert_eq!(
        first,
        [
            "--root",
            env.runc_root.to_str().unwrap(),
            "--log",
            c.log().to_str().unwrap(),
            "--log-format",
            "json",
            "create",
            "--bundle"
        ],
        "argv forwarded verbatim"
    );
    let spec: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join(format!("{}.json", c.id))).unwrap())
            .unwrap();
    let env_list: Vec<&str> = spec["process"]["env"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v.as_str())
        .collect();
    assert!(
        env_list.contains(&format!("NVIDIA_VISIBLE_DEVICES={GPU2}").as_str()),
        "{env_list:?}"
    );
    assert!(
        argv.lines().any(|l| l == "start"),
        "other commands pass through the stand-in too"
    );
}

/// Every file in deploy/ (and its directories) is parsed and checked for what it must say;
/// a file of a kind this test does not know fails it, so nothing there goes unchecked.
#[test]
fn deploy_manifests_are_valid() {
    use yaml_rust2::{Yaml, YamlLoader};
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let root = repo.join("deploy");
    let mut files = Vec::new();
    let mut dirs = vec![root.clone()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                dirs.push(p);
            } else {
                files.push(p);
            }
        }
    }
    files.sort();
    let read = |p: &Path| std::fs::read_to_string(p).unwrap();
    let y = |v: &Yaml, path: &str| -> Yaml { path.split('.').fold(v.clone(), |v, k| v[k].clone()) };
    let s = |v: &Yaml, path: &str| y(v, path).as_str().map(str::to_owned);

    let rc = YamlLoader::load_from_str(&read(&root.join("runtimeclass.yaml"))).unwrap();
    assert_eq!(s(&rc[0], "apiVersion").as_deref(), Some("node.k8s.io/v1"));
    assert_eq!(s(&rc[0], "kind").as_deref(), Some("RuntimeClass"));
    let handler = s(&rc[0], "handler").unwrap();
    assert_eq!(handler, "gpushare");
    // DNS-1123 label, as Kubernetes requires for a handler.
    assert!(
        handler.len() <= 63
            && handler
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    );
    // GPU nodes by the label NVIDIA's stack sets, and their usual taint tolerated.
    let node_selector = y(&rc[0], "scheduling.nodeSelector");
    assert_eq!(
        node_selector["nvidia.com/gpu.present"].as_str(),
        Some("true")
    );
    let tolerations = y(&rc[0], "scheduling.tolerations");
    assert!(
        tolerations
            .as_vec()
            .unwrap()
            .iter()
            .any(|t| t["key"].as_str() == Some("nvidia.com/gpu")
                && t["operator"].as_str() == Some("Exists")
                && t["effect"].as_str() == Some("NoSchedule")),
        "runtimeclass.yaml tolerates nvidia.com/gpu:NoSchedule"
    );

    let mut seen = std::collections::BTreeMap::<String, usize>::new();
    let mut entrypoint_in_image = None;
    let mut daemonsets = std::collections::BTreeMap::new();
    let mut configmaps = std::collections::BTreeMap::new();
    for file in &files {
        let name = file.strip_prefix(&root).unwrap().display().to_string();
        let ext = file.extension().and_then(|e| e.to_str()).unwrap_or("");
        let fname = file.file_name().unwrap().to_str().unwrap();
        match (ext, fname) {
            ("yaml" | "yml", _) => {
                for doc in
                    YamlLoader::load_from_str(&read(file)).unwrap_or_else(|e| panic!("{name}: {e}"))
                {
                    let kind = s(&doc, "kind").unwrap_or_else(|| panic!("{name}: no kind"));
                    assert!(s(&doc, "apiVersion").is_some(), "{name}: no apiVersion");
                    assert!(
                        s(&doc, "metadata.name").is_some(),
                        "{name}: no metadata.name"
                    );
                    *seen.entry(kind.clone()).or_default() += 1;
                    match kind.as_str() {
                        "RuntimeClass" => assert_eq!(s(&doc, "handler"), Some(handler.clone())),
                        "Pod" => check_pod(&name, &doc, &handler),
                        "DaemonSet" => {
                            let ds_name = s(&doc, "metadata.name").unwrap();
                            daemonsets.insert(ds_name, (name.clone(), doc.clone()));
                        }
                        "ConfigMap" => {
                            configmaps.insert(s(&doc, "metadata.name").unwrap(), doc.clone());
                        }
                        other => panic!("{name}: a {other} this test does not check"),
                    }
                }
            }
            ("toml", _) => {
                let dropin: toml::Table =
                    toml::from_str(&read(file)).unwrap_or_else(|e| panic!("{name}: {e}"));
                let rt = &dropin["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]
                    [handler.as_str()];
                assert_eq!(rt["runtime_type"].as_str(), Some("io.containerd.runc.v2"));
                let listed: Vec<&str> = rt["pod_annotations"]
                    .as_array()
                    .map(|a| a.iter().filter_map(|v| v.as_str()).collect())
                    .unwrap_or_default();
                let keys: Vec<&str> = gpushare::request::KEYS
                    .iter()
                    .map(|k| k.annotation)
                    .collect();
                assert_eq!(listed, keys, "{name}: exactly the request annotations");
                assert!(rt["options"]["BinaryName"]
                    .as_str()
                    .unwrap()
                    .ends_with("/gpushare-runtime"));
                *seen.entry("containerd drop-in".into()).or_default() += 1;
            }
            ("sh", _) => {
                let st = Command::new("sh").arg("-n").arg(file).status().unwrap();
                assert!(st.success(), "{name}: sh -n");
                use std::os::unix::fs::PermissionsExt;
                let mode = std::fs::metadata(file).unwrap().permissions().mode();
                assert!(mode & 0o111 != 0, "{name} is executable");
                *seen.entry("script".into()).or_default() += 1;
            }
            ("Dockerfile", _) => {
                // Every COPY source is in the repository or is a binary of this package.
                let text = read(file);
                for line in text.lines().filter(|l| l.starts_with("COPY ")) {
                    let words: Vec<&str> = line.split_whitespace().skip(1).collect();
                    let (dest, sources) = words.split_last().unwrap();
                    for src in sources {
                        match src.strip_prefix("target/release/") {
                            Some(bin) => assert!(
                                ["gpushare", "gpushare-runtime"].contains(&bin),
                                "{name}: {src}"
                            ),
                            None => assert!(repo.join(src).is_file(), "{name}: {src} is missing"),
                        }
                        if src.ends_with(".sh") {
                            entrypoint_in_image = Some(dest.to_string());
                        }
                    }
                }
                let entry = text
                    .lines()
                    .find_map(|l| l.strip_prefix("ENTRYPOINT "))
                    .expect("an ENTRYPOINT");
                let entry: Vec<String> = serde_json::from_str(entry).unwrap();
                assert_eq!(Some(&entry[0]), entrypoint_in_image.as_ref(), "{name}");
                *seen.entry("Dockerfile".into()).or_default() += 1;
            }
            _ => panic!("{name}: a file this test does not check"),
        }
    }
    let (name, ds) = &daemonsets["gpushare-node-installer"];
    let command = check_daemonset(name, ds, &rc[0], &configmaps);
    // The DaemonSet runs the script the image holds.
    assert_eq!(Some(command), entrypoint_in_image.map(|e| vec![e]));
    let (nri_name, nri) = &daemonsets["gpushare-nri-plugin"];
    check_nri_daemonset(nri_name, nri, ds);
    for (cm_name, cm) in &configmaps {
        match cm_name.as_str() {
            "gpushare-config" => {
                let text = cm["data"]["runtime.toml"]
                    .as_str()
                    .expect("gpushare-config: data.runtime.toml");
                gpushare::config::parse(text, None)
                    .unwrap_or_else(|e| panic!("gpushare-config's runtime.toml: {e}"));
            }
            _ => check_device_plugin_config(cm_name, cm),
        }
    }
    let want: std::collections::BTreeMap<String, usize> = [
        ("RuntimeClass", 1),
        ("Pod", 4),
        ("DaemonSet", 2),
        ("ConfigMap", 2),
        ("containerd drop-in", 1),
        ("script", 1),
        ("Dockerfile", 1),
    ]
    .into_iter()
    .map(|(k, n)| (k.to_owned(), n))
    .collect();
    assert_eq!(seen, want);

    for name in ["gpushare.json", "gpushare-poststop.json"] {
        let v: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(repo.join("hooks/oci-hooks.d").join(name)).unwrap(),
        )
        .unwrap();
        assert_eq!(v["version"], "1.0.0");
        assert!(v["hook"]["path"].as_str().unwrap().starts_with('/'));
        assert_eq!(v["when"]["annotations"]["^gpushare\\.io/device$"], ".+");
        assert!(v["hook"]["env"]
            .as_array()
            .unwrap()
            .iter()
            .all(|e| !e.as_str().unwrap().starts_with("LD_")));
    }
}

/// A pod names the RuntimeClass and asks in one of the two ways: a `gpushare.io/device`
/// annotation naming devices, or a device plugin's `nvidia.com/gpu` (with `allocated`, or
/// no device annotation and the node's `default-device = "allocated"`). Each is parsed as
/// the node would parse its container — for an `nvidia.com/gpu` pod, with the
/// `/dev/null` mount at `/var/run/nvidia-container-devices/<uuid>` that
/// deploy/nvidia-device-plugin-config.yaml's strategy writes, on a node of the documented
/// defaults — and must be a valid request.
fn check_pod(name: &str, pod: &yaml_rust2::Yaml, handler: &str) {
    use gpushare::request::{DefaultDevice, Inputs, Options};
    assert_eq!(
        pod["spec"]["runtimeClassName"].as_str(),
        Some(handler),
        "{name}"
    );
    let containers = pod["spec"]["containers"].as_vec().expect("containers");
    assert!(!containers.is_empty());
    let ann: std::collections::HashMap<String, String> = pod["metadata"]["annotations"]
        .as_hash()
        .into_iter()
        .flatten()
        .filter_map(|(k, v)| Some((k.as_str()?.to_owned(), v.as_str()?.to_owned())))
        .collect();
    let device = ann.get("gpushare.io/device").map(String::as_str);
    let plugin_env = ["NVIDIA_VISIBLE_DEVICES=/var/run/nvidia-container-devices".to_owned()];
    let plugin_mounts = [oci_spec::runtime::MountBuilder::default()
        .destination(format!("/var/run/nvidia-container-devices/{GPU0}"))
        .typ("bind")
        .source("/dev/null")
        .options(vec!["ro".to_owned(), "rbind".to_owned()])
        .build()
        .unwrap()];
    for c in containers {
        let allocated = !c["resources"]["limits"]["nvidia.com/gpu"].is_badvalue();
        if matches!(device, None | Some("allocated")) {
            assert!(
                allocated,
                "{name}: asks the device plugin for nvidia.com/gpu"
            );
        }
        let inputs = Inputs {
            annotations: Some(&ann),
            env: if allocated { &plugin_env } else { &[] },
            mounts: if allocated { &plugin_mounts } else { &[] },
            ..Default::default()
        };
        let opts = Options {
            accept_env: true,
            default_device: device.is_none().then_some(DefaultDevice::Allocated),
            accept_visible_devices_env: false,
        };
        gpushare::request::parse(&inputs, &opts)
            .unwrap_or_else(|e| panic!("{name}: {e}"))
            .expect("a request");
    }
}

/// The node installer, as an API server and the kubelet would take it: the selector
/// matches the pods, every mount names a volume, the ConfigMap it mounts exists in its
/// namespace with the runtime.toml the script copies; it runs where the RuntimeClass
/// `rc` schedules and registers its handler; the host's / is at HOST_ROOT, so INSTALL_DIR
/// and CONTAINERD_CONFIG need no volume of their own; a versioned image that upgrades
/// pull; Ready when the script says its action is done. Returns its command.
fn check_daemonset(
    name: &str,
    ds: &yaml_rust2::Yaml,
    rc: &yaml_rust2::Yaml,
    configmaps: &std::collections::BTreeMap<String, yaml_rust2::Yaml>,
) -> Vec<String> {
    let spec = &ds["spec"]["template"]["spec"];
    assert_selects_its_pods(name, ds);
    let namespace = ds["metadata"]["namespace"].as_str().unwrap();
    assert_eq!(
        &spec["nodeSelector"], &rc["scheduling"]["nodeSelector"],
        "{name}: the RuntimeClass's nodes"
    );
    assert_eq!(
        &spec["tolerations"], &rc["scheduling"]["tolerations"],
        "{name}: the RuntimeClass's tolerations"
    );
    assert_eq!(spec["hostPID"].as_bool(), Some(true), "{name}");
    let containers = spec["containers"].as_vec().unwrap();
    assert_eq!(containers.len(), 1, "{name}");
    let c = &containers[0];
    assert!(c["name"].as_str().is_some_and(|n| !n.is_empty()));
    let image = c["image"].as_str().unwrap();
    let (_, tag) = image.rsplit_once(':').expect("a tagged image");
    assert_eq!(
        tag,
        env!("CARGO_PKG_VERSION"),
        "{name}: the image's tag is gpushare's version"
    );
    assert_eq!(c["imagePullPolicy"].as_str(), Some("Always"), "{name}");
    assert_eq!(c["securityContext"]["privileged"].as_bool(), Some(true));
    let env: std::collections::HashMap<&str, &str> = c["env"]
        .as_vec()
        .unwrap()
        .iter()
        .map(|e| (e["name"].as_str().unwrap(), e["value"].as_str().unwrap()))
        .collect();
    assert_eq!(env["GPUSHARE_NODE_ACTION"], "install");
    assert_eq!(
        Some(env["RUNTIME_NAME"]),
        rc["handler"].as_str(),
        "{name}: registers the RuntimeClass's handler"
    );
    let volumes: std::collections::HashMap<&str, &yaml_rust2::Yaml> = spec["volumes"]
        .as_vec()
        .unwrap()
        .iter()
        .map(|v| (v["name"].as_str().unwrap(), v))
        .collect();
    let mut mounts = std::collections::HashMap::new();
    for m in c["volumeMounts"].as_vec().unwrap() {
        let volume = m["name"].as_str().unwrap();
        assert!(
            volumes.contains_key(volume),
            "{name}: the mount of {volume} names no volume"
        );
        mounts.insert(m["mountPath"].as_str().unwrap(), volumes[volume]);
    }
    let host_root = &mounts[env["HOST_ROOT"]]["hostPath"];
    assert_eq!(host_root["path"].as_str(), Some("/"), "{name}");
    for key in ["INSTALL_DIR", "CONTAINERD_CONFIG"] {
        assert!(env[key].starts_with('/'), "{name}: {key}");
    }
    let source = Path::new(env["GPUSHARE_CONFIG_SOURCE"]);
    let cm = &mounts[source.parent().unwrap().to_str().unwrap()]["configMap"]["name"];
    let cm = &configmaps[cm.as_str().unwrap()];
    assert_eq!(cm["metadata"]["namespace"].as_str(), Some(namespace));
    assert!(
        cm["data"][source.file_name().unwrap().to_str().unwrap()]
            .as_str()
            .is_some(),
        "{name}: the ConfigMap has {}",
        source.display()
    );
    let script = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/node-installer.sh"),
    )
    .unwrap();
    let probe: Vec<&str> = c["readinessProbe"]["exec"]["command"]
        .as_vec()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert!(
        script.contains(&format!("READY_FILE=${{READY_FILE:-{}}}", probe[2])),
        "{name}: the probe's file is the script's READY_FILE: {probe:?}"
    );
    argv(&c["command"])
}

/// A DaemonSet's `spec.selector.matchLabels`: required, and matching its pods' labels.
fn assert_selects_its_pods(name: &str, ds: &yaml_rust2::Yaml) {
    let labels = ds["spec"]["template"]["metadata"]["labels"]
        .as_hash()
        .unwrap();
    let selector = ds["spec"]["selector"]["matchLabels"].as_hash().unwrap();
    assert!(!selector.is_empty(), "{name}: spec.selector is required");
    for (k, v) in selector {
        assert_eq!(
            labels.get(k),
            Some(v),
            "{name}: the selector matches the pods"
        );
    }
}

/// A container's `command` (or a probe's) as strings.
fn argv(c: &yaml_rust2::Yaml) -> Vec<String> {
    c.as_vec()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().to_owned())
        .collect()
}

/// The NRI plugin's DaemonSet (deploy/nri-plugin.yaml), against the node installer's
/// `installer`: on the same nodes and namespace, from the same image; it runs the
/// gpushare the installer copied to the host (INSTALL_DIR), in the host's mount namespace
/// (nsenter into the host's PID 1: hostPID, privileged), as `gpushare nri --socket` on
/// NRI's socket, and its validator as a container of its own (`gpushare nri-validate`);
/// an init container waits until that binary runs there; Ready while `gpushare status`
/// says the plugin is connected.
fn check_nri_daemonset(name: &str, ds: &yaml_rust2::Yaml, installer: &yaml_rust2::Yaml) {
    let spec = &ds["spec"]["template"]["spec"];
    let ispec = &installer["spec"]["template"]["spec"];
    assert_selects_its_pods(name, ds);
    assert_ne!(
        &ds["spec"]["selector"], &installer["spec"]["selector"],
        "{name}: selects its own pods, not the installer's"
    );
    assert_eq!(
        &ds["metadata"]["namespace"], &installer["metadata"]["namespace"],
        "{name}"
    );
    for key in ["nodeSelector", "tolerations", "priorityClassName"] {
        assert_eq!(&spec[key], &ispec[key], "{name}: the installer's {key}");
    }
    assert_eq!(spec["hostPID"].as_bool(), Some(true), "{name}");
    let install_dir = ispec["containers"][0]["env"]
        .as_vec()
        .unwrap()
        .iter()
        .find(|e| e["name"].as_str() == Some("INSTALL_DIR"))
        .and_then(|e| e["value"].as_str())
        .unwrap();
    let gpushare = format!("{install_dir}/gpushare");
    let in_host = ["nsenter", "--target=1", "--mount", "--", gpushare.as_str()];
    let image = ispec["containers"][0]["image"].as_str();
    let inits = spec["initContainers"].as_vec().unwrap();
    assert_eq!(inits.len(), 1, "{name}");
    let containers = spec["containers"].as_vec().unwrap();
    assert_eq!(containers.len(), 2, "{name}: the plugin and its validator");
    for c in inits.iter().chain(containers) {
        assert!(c["name"].as_str().is_some_and(|n| !n.is_empty()));
        assert_eq!(c["image"].as_str(), image, "{name}: the installer's image");
        assert_eq!(c["imagePullPolicy"].as_str(), Some("Always"), "{name}");
        assert_eq!(c["securityContext"]["privileged"].as_bool(), Some(true));
        assert!(
            c["volumeMounts"].is_badvalue(),
            "{name}: the host's own paths"
        );
    }
    assert!(spec["volumes"].is_badvalue(), "{name}");
    let wait = argv(&inits[0]["command"]);
    assert_eq!(wait[..2], ["sh", "-c"], "{name}");
    assert!(
        wait[2].contains(&format!("{} --version", in_host.join(" "))),
        "{name}: waits for the installer's binary: {wait:?}"
    );
    let c = &containers[0];
    let mut want: Vec<String> = in_host.iter().map(|a| a.to_string()).collect();
    want.extend(["nri", "--socket", "/var/run/nri/nri.sock", "--no-validator"].map(String::from));
    assert_eq!(argv(&c["command"]), want, "{name}");
    // The validator: a container of its own, on the same socket.
    let mut want: Vec<String> = in_host.iter().map(|a| a.to_string()).collect();
    want.extend(["nri-validate", "--socket", "/var/run/nri/nri.sock"].map(String::from));
    assert_eq!(argv(&containers[1]["command"]), want, "{name}");
    let probe = argv(&c["readinessProbe"]["exec"]["command"]);
    assert_eq!(
        probe,
        [
            "sh",
            "-c",
            &format!(
                "{} status | grep -q '^NRI plugin connected'",
                in_host.join(" ")
            )
        ],
        "{name}: Ready while connected (the line of `gpushare status`)"
    );
}

/// NVIDIA's device plugin config: time-slicing replicas of nvidia.com/gpu (the share
/// count), the GPU's UUID as a /dev/null volume mount (a source no pod can write, unlike
/// NVIDIA_VISIBLE_DEVICES), and never the plugin's own MPS.
fn check_device_plugin_config(name: &str, cm: &yaml_rust2::Yaml) {
    let text = cm["data"]["config"].as_str().expect("data.config");
    let cfg = &yaml_rust2::YamlLoader::load_from_str(text).unwrap()[0];
    assert_eq!(cfg["version"].as_str(), Some("v1"), "{name}");
    assert!(
        cfg["sharing"]["mps"].is_badvalue(),
        "{name}: the plugin's own MPS is refused by gpushare"
    );
    assert_eq!(
        cfg["flags"]["plugin"]["deviceListStrategy"].as_str(),
        Some("volume-mounts")
    );
    assert_eq!(
        cfg["flags"]["plugin"]["deviceIDStrategy"].as_str(),
        Some("uuid")
    );
    let ts = &cfg["sharing"]["timeSlicing"];
    assert_eq!(ts["failRequestsGreaterThanOne"].as_bool(), Some(true));
    let r = &ts["resources"][0];
    assert_eq!(r["name"].as_str(), Some("nvidia.com/gpu"));
    assert!(r["replicas"].as_i64().is_some_and(|n| n > 1), "{name}");
}
