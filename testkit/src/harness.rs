//! Test harness: real binaries, real runc, a busybox rootfs, the file inventory and the MPS
//! simulator. Every `Env` lives in its own short temp dir (socket paths stay short) and
//! cleans up its containers, supervisors, daemons and mounts in `Drop`, even when the test
//! fails. Waits poll with deadlines; nothing sleeps a fixed time to "let it start".

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use serde_json::{json, Value};

use crate::common::{
    alive, parse_client_line, sim_beside, stop_process, text, umount_below, wait_until, which,
};

/// The repository this kit was built from (its parent directory): the files the tests
/// read (the example inventory, the shipped hooks, the simulator's sources).
pub fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("testkit/ is in the repository")
}

/// The directories of this build: the executables (`<target>/<profile>`) and Cargo's temp
/// dir for tests (`<target>/tmp`, its `CARGO_TARGET_TMPDIR`), found from the running test
/// executable, `<target>/<profile>/deps/<test>-<hash>`.
struct Build {
    bins: PathBuf,
    tmp: PathBuf,
}

fn build() -> &'static Build {
    static BUILD: OnceLock<Build> = OnceLock::new();
    BUILD.get_or_init(|| {
        let exe = std::env::current_exe().expect("the test executable's path");
        let deps = exe.parent().expect("the test executable's directory");
        let bins = match deps.file_name() {
            Some(n) if n == "deps" => deps.parent().unwrap_or(deps),
            _ => deps,
        };
        let tmp = bins.parent().unwrap_or(bins).join("tmp");
        Build {
            bins: bins.to_path_buf(),
            tmp,
        }
    })
}

/// The package's executable `name` of this build, as a string; a missing one fails with
/// the command that builds it.
fn package_bin(name: &str) -> String {
    let bin = build().bins.join(name);
    assert!(
        bin.is_file(),
        "{} not found beside this test's build: build it: cargo build --workspace",
        bin.display()
    );
    bin.display().to_string()
}

/// The shim under test, `gpushare-runtime`, of this build.
pub fn runtime() -> &'static str {
    static BIN: OnceLock<String> = OnceLock::new();
    BIN.get_or_init(|| package_bin("gpushare-runtime"))
}

/// The command under test, `gpushare`, of this build.
pub fn gpushare() -> &'static str {
    static BIN: OnceLock<String> = OnceLock::new();
    BIN.get_or_init(|| package_bin("gpushare"))
}

/// The MPS simulator, `gpushare-mps-sim`: a package of its own (sim/, a workspace member),
/// its binary beside `gpushare`. `cargo test --workspace --tests` (scripts/test) and `cargo
/// build` build it; a run of one test target alone (`cargo test --test integration`) does
/// not, so a missing binary, or one older than the simulator's sources, fails here with the
/// command that builds it rather than later with a stale simulator's behaviour.
pub fn sim() -> &'static str {
    static SIM: OnceLock<String> = OnceLock::new();
    SIM.get_or_init(
        || match sim_beside(Path::new(gpushare()), &repo().join("sim")) {
            Ok(bin) => bin.display().to_string(),
            Err(e) => panic!("{e}"),
        },
    )
}

/// The simulator at `dir/bin` (0755), for the daemons a test starts as other users: they
/// must reach the control binary, and a checkout under a 0700 directory (root's home,
/// `mktemp -d`) keeps them out of target/. A hard link where the file system allows one:
/// a copy is a file open for writing, and a child that another test thread forks in that
/// instant holds it until it execs, so an exec of the copy can fail with ETXTBSY.
pub fn sim_copy(dir: &Path) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
    let copy = bin.join("gpushare-mps-sim");
    if std::fs::hard_link(sim(), &copy).is_err() {
        std::fs::copy(sim(), &copy).unwrap();
        std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    copy
}

pub const GPU0: &str = "GPU-8f8bff94-112e-9541-43da-cfd453333404";
pub const GPU1: &str = "GPU-6a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9";
pub const GPU2: &str = "GPU-7b2c3d4e-5f60-4182-93a4-b5c6d7e8f901";
pub const MIG0: &str = "MIG-22f0c05f-5cf2-5ea2-8297-789695656dc0";
pub const MIG1: &str = "MIG-33a1d16a-6d03-4fb3-a3a8-8a97a6767ed1";
pub const MIG2: &str = "MIG-44b2e27b-7e14-40c4-b4b9-9ba8b7878fe2";

/// Inventory for tests: the repository's test inventory, `docs/examples/inventory.json`
/// (the one the unit tests' `device::sample()`, the fuzz targets and scripts/quickstart use;
/// src/device/preset.rs says why that file). GPU 0 an A30 (24 GiB, no MIG), GPU 1 an A100
/// 80GB in MIG mode with three 1g.10gb devices (10 GiB each, access nodes as
/// [`mig_caps_minors`] gives them), GPU 2 a second A100 80GB without MIG. Their device
/// nodes are `/dev/nvidia[GPU0_MINOR]` and so on: minor numbers that are not the indices,
/// as on machines where the driver probed the GPUs in another order than NVML enumerates.
/// Fails the test if the names here no longer match the file.
pub fn inventory_json() -> Value {
    let path = repo().join("docs/examples/inventory.json");
    let inv: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let gpus = &inv["gpus"];
    let named = [(GPU0, GPU0_MINOR), (GPU1, GPU1_MINOR), (GPU2, GPU2_MINOR)];
    for (i, (uuid, minor)) in named.into_iter().enumerate() {
        assert_eq!(
            (gpus[i]["uuid"].as_str(), gpus[i]["minor"].as_u64()),
            (Some(uuid), Some(minor.into())),
            "{}: GPU {i}",
            path.display()
        );
    }
    for (i, uuid) in [MIG0, MIG1, MIG2].into_iter().enumerate() {
        let mig = &gpus[1]["mig_devices"][i];
        let (gi, ci) = mig_caps_minors(i as u32);
        assert_eq!(
            (
                mig["uuid"].as_str(),
                mig["gi_caps_minor"].as_u64(),
                mig["ci_caps_minor"].as_u64()
            ),
            (Some(uuid), Some(gi.into()), Some(ci.into())),
            "{}: MIG device 1:{i}",
            path.display()
        );
    }
    inv
}

/// The minor numbers of MIG device `index` of GPU 1's access nodes
/// `/dev/nvidia-caps/nvidia-cap<minor>`: (GPU instance, compute instance).
pub fn mig_caps_minors(index: u32) -> (u32, u32) {
    (12 + 9 * index, 13 + 9 * index)
}

/// The minor numbers of the test inventory's GPUs (`/dev/nvidia<minor>`).
pub const GPU0_MINOR: u32 = 2;
pub const GPU1_MINOR: u32 = 0;
pub const GPU2_MINOR: u32 = 1;

/// Fails the test loudly when it cannot run here; never skips silently.
pub fn require_root_and_runc() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "integration tests drive real runc and mount tmpfs: they need root. Run the README's test command (./scripts/test) as root"
    );
    assert!(
        which("runc").is_some(),
        "runc is not installed: the README's test command (./scripts/test) installs it with apt-get"
    );
    assert!(
        busybox().is_some(),
        "busybox is not installed: the README's test command (./scripts/test) installs busybox-static with apt-get"
    );
}

pub fn busybox() -> Option<PathBuf> {
    ["/bin/busybox", "/usr/bin/busybox"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
}

/// Copies `bin` and the shared libraries it needs (per ldd) into the rootfs.
fn install_with_libs(bin: &Path, rootfs: &Path, dest: &str) {
    let target = rootfs.join(dest.trim_start_matches('/'));
    std::fs::create_dir_all(target.parent().unwrap()).unwrap();
    std::fs::copy(bin, &target).unwrap();
    let ldd = Command::new("ldd").arg(bin).output().expect("ldd");
    for line in String::from_utf8_lossy(&ldd.stdout).lines() {
        let path = line
            .split_whitespace()
            .find(|w| w.starts_with('/'))
            .map(PathBuf::from);
        if let Some(lib) = path {
            let to = rootfs.join(lib.strip_prefix("/").unwrap());
            std::fs::create_dir_all(to.parent().unwrap()).unwrap();
            if !to.exists() {
                std::fs::copy(&lib, &to).unwrap();
            }
        }
    }
}

/// The cgroups `gpushare/<id>-<pid>` of these supervisor pids, in every hierarchy (v1
/// hierarchies and the v2 root).
pub fn daemon_cgroups(supervisors: &[i32]) -> Vec<PathBuf> {
    daemon_cgroups_all()
        .into_iter()
        .filter(|p| cgroup_pid(p).is_some_and(|p| supervisors.contains(&p)))
        .collect()
}

/// The supervisor pid a daemon cgroup `gpushare/<id>-<pid>` is named after.
pub fn cgroup_pid(cgroup: &Path) -> Option<i32> {
    cgroup
        .file_name()?
        .to_str()?
        .rsplit_once('-')
        .and_then(|(_, p)| p.parse().ok())
}

/// Every cgroup `gpushare/<id>-<pid>`, in every hierarchy (v1 hierarchies and the v2 root).
pub fn daemon_cgroups_all() -> Vec<PathBuf> {
    let root = Path::new("/sys/fs/cgroup");
    let tops = std::fs::read_dir(root)
        .into_iter()
        .flatten()
        .flatten()
        .map(|h| h.path().join("gpushare"))
        .chain([root.join("gpushare")]);
    let mut out = Vec::new();
    for top in tops {
        for e in std::fs::read_dir(&top).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if e.path().is_dir() && name.rsplit_once('-').is_some() {
                out.push(e.path());
            }
        }
    }
    out
}

/// A busybox rootfs with the simulator's client at /usr/bin/gpushare-mps-sim, shared
/// read-only by every container of this test run. It lives in cargo's temp dir for tests,
/// whose path may spell "gpushare" (a clone named `gpushare/`): containers see it through
/// a bind mount in their `Env`'s own temp dir (`Env::rootfs`), so that no bundle spells it.
pub fn rootfs() -> &'static Path {
    static ROOTFS: OnceLock<PathBuf> = OnceLock::new();
    ROOTFS.get_or_init(|| {
        require_root_and_runc();
        let tmp = build().tmp.clone();
        std::fs::create_dir_all(&tmp).unwrap();
        // Rootfs dirs of earlier runs whose test process is gone.
        for e in std::fs::read_dir(&tmp).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if let Some(pid) = name.strip_prefix("rootfs-").and_then(|p| p.parse::<i32>().ok()) {
                if !alive(pid) {
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
        let dir = tmp.join(format!("rootfs-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        // var/run: where tests mount a tmpfs for /var/run/nvidia-container-devices.
        for d in ["bin", "dev/shm", "proc", "sys", "tmp/nvidia-mps", "etc", "usr/bin", "var/run"] {
            std::fs::create_dir_all(dir.join(d)).unwrap();
        }
        let bb = busybox().unwrap();
        std::fs::copy(&bb, dir.join("bin/busybox")).unwrap();
        let list = Command::new(&bb).arg("--list").output().unwrap();
        for applet in String::from_utf8_lossy(&list.stdout).lines() {
            if applet != "busybox" {
                let _ = std::os::unix::fs::symlink("busybox", dir.join("bin").join(applet));
            }
        }
        install_with_libs(Path::new(sim()), &dir, "/usr/bin/gpushare-mps-sim");
        std::fs::write(dir.join("etc/passwd"), "root:x:0:0:root:/:/bin/sh\nu1000:x:1000:1000::/:/bin/sh\nu2000:x:2000:2000::/:/bin/sh\n").unwrap();
        dir
    })
}

/// One test's world: config, state dir, runc root, containers.
pub struct Env {
    pub dir: tempfile::TempDir,
    pub config: PathBuf,
    pub state: PathBuf,
    pub runc_root: PathBuf,
    /// The shared rootfs, bound read-only into this env's temp dir.
    pub rootfs: PathBuf,
    containers: std::sync::Mutex<Vec<String>>,
    /// What every command `cmd` makes gets besides the config (`set_var`, `enter`).
    vars: Vec<(String, std::ffi::OsString)>,
    mount_ns: Option<u32>,
    /// The node's agent, where the test started one (`start_agent`).
    agent: Option<Child>,
}

impl Env {
    // It makes things on the machine (a temp dir, a namespace), which `Default` would hide.
    #[allow(clippy::new_without_default)]
    pub fn new() -> Env {
        Env::with_config("")
    }

    /// `extra` is appended to the generated config (top-level keys first, then `[mps]`
    /// keys in `extra_mps`).
    pub fn with_config(extra_mps: &str) -> Env {
        Env::with_configs("", extra_mps)
    }

    /// `top` goes before `[mps]` (top-level keys), `extra_mps` into `[mps]`.
    pub fn with_configs(top: &str, extra_mps: &str) -> Env {
        let shared = rootfs();
        let dir = tempfile::Builder::new()
            .prefix("gs")
            .tempdir_in("/tmp")
            .unwrap();
        let own_rootfs = dir.path().join("rootfs");
        std::fs::create_dir(&own_rootfs).unwrap();
        nix::mount::mount(
            Some(shared),
            &own_rootfs,
            None::<&str>,
            nix::mount::MsFlags::MS_BIND,
            None::<&str>,
        )
        .expect("bind the test rootfs into the env's temp dir");
        let state = dir.path().join("s");
        let runc_root = dir.path().join("runc");
        let inventory = dir.path().join("inventory.json");
        std::fs::write(&inventory, inventory_json().to_string()).unwrap();
        let sim = sim_copy(dir.path());
        let config = dir.path().join("runtime.toml");
        let runc = which("runc").unwrap();
        std::fs::write(
            &config,
            format!(
                "low-level-runtime = [{runc:?}]\nstate-dir = {state:?}\nlog-file = {log:?}\nlog-level = \"debug\"\ninventory = \"file:{inv}\"\n{top}\n[mps]\ncontrol-binary = {sim:?}\nstart-timeout = \"10s\"\nshm-size = \"64M\"\n{extra_mps}\n",
                runc = runc.display().to_string(),
                state = state.display().to_string(),
                log = dir.path().join("gpushare.log").display().to_string(),
                inv = inventory.display(),
                sim = sim.display().to_string(),
            ),
        )
        .unwrap();
        Env {
            dir,
            config,
            state,
            runc_root,
            rootfs: own_rootfs,
            containers: Default::default(),
            vars: Vec::new(),
            mount_ns: None,
            agent: None,
        }
    }

    /// The simulator this env's config names (`sim_copy`): reachable by every uid.
    pub fn sim(&self) -> PathBuf {
        self.dir.path().join("bin/gpushare-mps-sim")
    }

    /// Replaces the config's `inventory` (the test inventory file) with `source`, e.g.
    /// `nvml`.
    pub fn set_inventory(&self, source: &str) {
        let text = std::fs::read_to_string(&self.config).unwrap();
        let mut lines: Vec<String> = text.lines().map(str::to_owned).collect();
        let line = lines
            .iter_mut()
            .find(|l| l.starts_with("inventory = "))
            .expect("the generated config names an inventory");
        *line = format!("inventory = {source:?}");
        std::fs::write(&self.config, lines.join("\n") + "\n").unwrap();
    }

    /// Every command of this env (`cmd`: the shim, the CLI) gets `key=value` in its
    /// environment, and so does runc, which the shim execs; runc's hooks do not (they get
    /// the env their spec entry names).
    pub fn set_var(&mut self, key: &str, value: impl Into<std::ffi::OsString>) {
        self.vars.push((key.to_owned(), value.into()));
    }

    /// Every command of this env runs in `mounts`' mount namespace from now on (the env's
    /// own mounts, made before, are in it too). The cleanup in `Drop` stays on the host.
    pub fn enter(&mut self, mounts: &PrivateMounts) {
        self.mount_ns = Some(mounts.holder_pid());
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Starts `gpushare agent` for this env's state dir (stopping the one started before,
    /// if any) and waits until it answers; it is stopped when the env is dropped, after
    /// the supervisors. Its pid.
    pub fn start_agent(&mut self) -> i32 {
        if let Some(mut old) = self.agent.take() {
            stop_child(&mut old, Duration::from_secs(5));
        }
        let child = self
            .cmd(gpushare())
            .arg("agent")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let pid = child.id() as i32;
        self.agent = Some(child);
        let sock = self.state.join("agent.sock");
        assert!(
            wait_until(Duration::from_secs(10), || {
                std::os::unix::net::UnixStream::connect(&sock).is_ok()
            }),
            "the agent did not listen on {}:\n{}",
            sock.display(),
            self.gpushare_log()
        );
        pid
    }

    /// The pid of the agent `start_agent` started.
    pub fn agent_pid(&self) -> Option<i32> {
        self.agent.as_ref().map(|c| c.id() as i32)
    }

    /// A command for one of our binaries, configured for this env.
    pub fn cmd(&self, bin: &str) -> Command {
        let mut c = match self.mount_ns {
            Some(holder) => {
                let mut c = Command::new(need("nsenter", "util-linux"));
                c.arg(format!("--mount=/proc/{holder}/ns/mnt"))
                    .arg("--")
                    .arg(bin);
                c
            }
            None => Command::new(bin),
        };
        c.env("GPUSHARE_CONFIG", &self.config);
        c.envs(self.vars.iter().map(|(k, v)| (k, v)));
        c
    }

    /// Runs the shim with runc's global flags for this env.
    pub fn runtime(&self, args: &[&str], log: &Path) -> Output {
        self.cmd(runtime())
            .arg("--root")
            .arg(&self.runc_root)
            .arg("--log")
            .arg(log)
            .args(["--log-format", "json"])
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    }

    pub fn container(&self, id: &str) -> ContainerBuilder<'_> {
        ContainerBuilder {
            env: self,
            id: id.to_owned(),
            uid: 0,
            args: vec!["true".into()],
            annotations: BTreeMap::new(),
            envs: Vec::new(),
            userns: None,
        }
    }

    /// Container `id` of user `uid` that asks for `device` (the request annotation
    /// `gpushare.io/device`).
    pub fn request(&self, id: &str, uid: u32, device: &str) -> ContainerBuilder<'_> {
        self.container(id).uid(uid).device(device)
    }

    /// Container `id` of user `uid` on GPU 0 at `percentage` % of its threads
    /// (`gpushare.io/active-thread-percentage`), running the simulator's client; created.
    pub fn client(&self, id: &str, uid: u32, percentage: &str) -> Container<'_> {
        self.request(id, uid, "0")
            .annotation("gpushare.io/active-thread-percentage", percentage)
            .sh(crate::node::CLIENT)
            .create()
    }

    /// Two users' containers on GPU 0, both created (not started): `names[0]` of UID 1000
    /// and `names[1]` of UID 2000, each running `script`.
    pub fn two_users(&self, names: [&str; 2], script: &str) -> [Container<'_>; 2] {
        [(names[0], 1000), (names[1], 2000)]
            .map(|(name, uid)| self.request(name, uid, "0").sh(script).create())
    }

    pub fn daemon_ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = std::fs::read_dir(self.state.join("mps"))
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        ids.sort();
        ids
    }

    pub fn record(&self, id: &str) -> Value {
        let text =
            std::fs::read_to_string(self.state.join("mps").join(id).join("daemon.json")).unwrap();
        serde_json::from_str(&text).unwrap()
    }

    /// The one daemon a container was given (from its decision annotation).
    pub fn daemon_of(&self, c: &Container) -> String {
        c.config()["annotations"]["gpushare.io/daemon"]
            .as_str()
            .expect("daemon annotation")
            .to_owned()
    }

    pub fn daemon_pid(&self, id: &str) -> i32 {
        self.record(id)["daemon"]["pid"]
            .as_i64()
            .expect("daemon pid in record") as i32
    }

    /// Whether daemon `id`'s record says, within `limit`, that it is ready again with
    /// another daemon process than `killed` (its supervisor restarted it).
    pub fn daemon_restarted(&self, id: &str, killed: i32, limit: Duration) -> bool {
        wait_until(limit, || {
            let rec = self.record(id);
            rec["status"] == "ready"
                && rec["daemon"]["pid"]
                    .as_i64()
                    .is_some_and(|p| p as i32 != killed)
        })
    }

    /// SIGKILLs daemon `id`'s daemon process; its pid.
    pub fn kill_daemon(&self, id: &str) -> i32 {
        let pid = self.daemon_pid(id);
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        )
        .unwrap();
        pid
    }

    pub fn control_log(&self, id: &str) -> String {
        std::fs::read_to_string(self.state.join("mps").join(id).join("log/control.log"))
            .unwrap_or_default()
    }

    pub fn gpushare_log(&self) -> String {
        std::fs::read_to_string(self.path().join("gpushare.log")).unwrap_or_default()
    }

    /// `gpushare <args>` (the binary under test) with this env's config, run to its end.
    pub fn gpushare(&self, args: &[&str]) -> Output {
        self.cmd(gpushare()).args(args).output().unwrap()
    }

    /// `gpushare daemon start` of a daemon for user `uid` on `device` at `percentage` %
    /// of its threads, run to its end.
    pub fn start_daemon(&self, device: &str, uid: &str, percentage: &str) -> Output {
        self.gpushare(&[
            "daemon",
            "start",
            "--device",
            device,
            "--uid",
            uid,
            "--active-thread-percentage",
            percentage,
        ])
    }

    /// Whether, within `limit`, `status` lists no container on any daemon (every client
    /// container released).
    pub fn no_container_listed(&self, limit: Duration) -> bool {
        wait_until(limit, || {
            self.status()
                .as_array()
                .unwrap()
                .iter()
                .all(|d| d["containers"].as_array().unwrap().is_empty())
        })
    }

    /// `gpushare <args>` with `stdin` written to its standard input (a hook's state), run
    /// to its end.
    pub fn gpushare_with_stdin(&self, args: &[&str], stdin: &[u8]) -> Output {
        let mut child = self
            .cmd(gpushare())
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        std::io::Write::write_all(&mut child.stdin.take().unwrap(), stdin).unwrap();
        child.wait_with_output().unwrap()
    }

    /// The standard output of `gpushare status <args>`, which must succeed.
    pub fn status_text(&self, args: &[&str]) -> String {
        let out = self.gpushare(&[&["status"], args].concat());
        assert!(out.status.success(), "{}", text(&out));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `gpushare <args>` started with no stdin, stdout or stderr (`watch`, a daemon).
    pub fn spawn_gpushare(&self, args: &[&str]) -> std::process::Child {
        self.cmd(gpushare())
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    }

    /// Daemon `id`'s entry in [`Env::status`]; `Null` where it lists no such daemon.
    pub fn status_of(&self, id: &str) -> Value {
        let status = self.status();
        status
            .as_array()
            .into_iter()
            .flatten()
            .find(|d| d["id"] == id)
            .cloned()
            .unwrap_or_default()
    }

    /// `gpushare status --json`.
    pub fn status(&self) -> Value {
        let out = self
            .cmd(gpushare())
            .args(["status", "--json"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "status failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["schema"], "gpushare.status/v1");
        v["daemons"].clone()
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        // Containers first (their poststop hooks run), then supervisors, then mounts.
        let ids = self
            .containers
            .lock()
            .map(|c| c.clone())
            .unwrap_or_default();
        for id in ids {
            let _ = Command::new(which("runc").unwrap())
                .arg("--root")
                .arg(&self.runc_root)
                .args(["delete", "-f", &id])
                .stderr(Stdio::null())
                .status();
        }
        let mut supervisors = Vec::new();
        for id in self.daemon_ids() {
            let Ok(text) =
                std::fs::read_to_string(self.state.join("mps").join(&id).join("daemon.json"))
            else {
                continue;
            };
            let Ok(rec) = serde_json::from_str::<Value>(&text) else {
                continue;
            };
            let sup = rec["supervisor"]["pid"].as_i64().map(|p| p as i32);
            let dae = rec["daemon"]["pid"].as_i64().map(|p| p as i32);
            if let Some(p) = sup {
                supervisors.push(p);
                stop_process(p, rec["supervisor"]["start_time"].as_u64());
            }
            if let Some(p) = dae {
                stop_process(p, rec["daemon"]["start_time"].as_u64());
            }
        }
        // The agent after the supervisors it started (it reaps them as they go).
        if let Some(mut agent) = self.agent.take() {
            stop_child(&mut agent, Duration::from_secs(5));
        }
        // The daemons' tmpfs mounts and the rootfs bind: nothing stays mounted.
        umount_below(self.dir.path());
        // A supervisor killed here cannot remove its cgroup `gpushare/<id>-<pid>`: do it
        // for it (rmdir only takes an empty cgroup).
        for cg in daemon_cgroups(&supervisors) {
            let _ = wait_until(Duration::from_secs(2), || {
                std::fs::remove_dir(&cg).is_ok() || !cg.exists()
            });
        }
    }
}

pub struct ContainerBuilder<'a> {
    env: &'a Env,
    id: String,
    uid: u32,
    args: Vec<String>,
    annotations: BTreeMap<String, String>,
    envs: Vec<String>,
    userns: Option<(u32, u32)>,
}

impl<'a> ContainerBuilder<'a> {
    /// Runs the container in a user namespace mapping ids 0.. to host ids `base..base+size`.
    pub fn userns(mut self, base: u32, size: u32) -> Self {
        self.userns = Some((base, size));
        self
    }
    pub fn uid(mut self, uid: u32) -> Self {
        self.uid = uid;
        self
    }
    pub fn sh(mut self, script: &str) -> Self {
        self.args = vec!["sh".into(), "-c".into(), script.into()];
        self
    }
    /// The request annotation `gpushare.io/device`.
    pub fn device(self, d: &str) -> Self {
        self.annotation("gpushare.io/device", d)
    }
    pub fn annotation(mut self, k: &str, v: &str) -> Self {
        self.annotations.insert(k.into(), v.into());
        self
    }
    pub fn env(mut self, kv: &str) -> Self {
        self.envs.push(kv.into());
        self
    }

    /// Writes the bundle (config.json from `runc spec`, adjusted) without creating.
    pub fn bundle(self) -> Container<'a> {
        let bundle = self.env.path().join("bundles").join(&self.id);
        std::fs::create_dir_all(&bundle).unwrap();
        let spec = Command::new(which("runc").unwrap())
            .arg("spec")
            .current_dir(&bundle)
            .output()
            .unwrap();
        assert!(
            spec.status.success(),
            "runc spec: {}",
            String::from_utf8_lossy(&spec.stderr)
        );
        let mut c: Value =
            serde_json::from_str(&std::fs::read_to_string(bundle.join("config.json")).unwrap())
                .unwrap();
        c["process"]["terminal"] = json!(false);
        c["process"]["args"] = json!(self.args);
        c["process"]["user"] = json!({"uid": self.uid, "gid": self.uid});
        for e in &self.envs {
            c["process"]["env"].as_array_mut().unwrap().push(json!(e));
        }
        c["root"] = json!({"path": self.env.rootfs, "readonly": true});
        c["hostname"] = json!(self.id);
        if !self.annotations.is_empty() {
            c["annotations"] = json!(self.annotations);
        }
        if let Some((base, size)) = self.userns {
            c["linux"]["namespaces"]
                .as_array_mut()
                .unwrap()
                .push(json!({"type": "user"}));
            c["linux"]["uidMappings"] = json!([{"containerID": 0, "hostID": base, "size": size}]);
            c["linux"]["gidMappings"] = json!([{"containerID": 0, "hostID": base, "size": size}]);
        }
        std::fs::write(
            bundle.join("config.json"),
            serde_json::to_vec_pretty(&c).unwrap(),
        )
        .unwrap();
        Container {
            env: self.env,
            id: self.id,
            bundle,
        }
    }

    /// Bundle + `gpushare-runtime create`; panics with the runtime's error if it fails.
    pub fn create(self) -> Container<'a> {
        let c = self.bundle();
        c.must_create();
        c
    }
}

pub struct Container<'a> {
    pub env: &'a Env,
    pub id: String,
    pub bundle: PathBuf,
}

impl Container<'_> {
    pub fn log(&self) -> PathBuf {
        self.bundle.join("log.json")
    }

    pub fn config_bytes(&self) -> Vec<u8> {
        std::fs::read(self.bundle.join("config.json")).unwrap()
    }

    pub fn config(&self) -> Value {
        serde_json::from_slice(&self.config_bytes()).unwrap()
    }

    /// Deletes the container when the env is dropped (`try_create` does this itself; for
    /// a container created some other way).
    pub fn track(&self) {
        self.env.containers.lock().unwrap().push(self.id.clone());
    }

    /// `gpushare-runtime create`; the container's stdio goes to files in the bundle.
    pub fn try_create(&self) -> Output {
        self.try_create_with(runtime())
    }

    /// [`Container::try_create`] through `runtime` (another copy of the shim).
    pub fn try_create_with(&self, runtime: &str) -> Output {
        self.env.containers.lock().unwrap().push(self.id.clone());
        let stdout = std::fs::File::create(self.bundle.join("stdout")).unwrap();
        let stderr = std::fs::File::create(self.bundle.join("stderr")).unwrap();
        let status = self
            .env
            .cmd(runtime)
            .arg("--root")
            .arg(&self.env.runc_root)
            .arg("--log")
            .arg(self.log())
            .args(["--log-format", "json", "create", "--bundle"])
            .arg(&self.bundle)
            .arg(&self.id)
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr)
            .status()
            .unwrap();
        Output {
            status,
            stdout: self.stdout().into_bytes(),
            stderr: std::fs::read(self.bundle.join("stderr")).unwrap_or_default(),
        }
    }

    /// `create`, which must succeed.
    pub fn must_create(&self) {
        let out = self.try_create();
        assert!(
            out.status.success(),
            "create {} failed: {}",
            self.id,
            self.last_error()
        );
    }

    /// `create`, which must be refused (exit 1); the error line it logged.
    pub fn refuse(&self) -> String {
        let out = self.try_create();
        assert_eq!(
            out.status.code(),
            Some(1),
            "create {}: {}",
            self.id,
            text(&out)
        );
        self.last_error()
    }

    /// [`Container::refuse`], with config.json left byte for byte as it was.
    pub fn refuse_untouched(&self) -> String {
        let before = self.config_bytes();
        let line = self.refuse();
        assert_eq!(
            self.config_bytes(),
            before,
            "config.json of {} untouched",
            self.id
        );
        line
    }

    /// The last error line the runtime wrote to runc's log.
    pub fn last_error(&self) -> String {
        let text = std::fs::read_to_string(self.log()).unwrap_or_default();
        text.lines()
            .rev()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .find(|v| v["level"] == "error")
            .map(|v| v["msg"].as_str().unwrap_or_default().to_owned())
            .unwrap_or_else(|| format!("(no error line in {})", self.log().display()))
    }

    /// `gpushare-runtime start`, whatever it returns.
    pub fn try_start(&self) -> Output {
        self.env.runtime(&["start", &self.id], &self.log())
    }

    pub fn start(&self) {
        let out = self.try_start();
        assert!(
            out.status.success(),
            "start {}: {}",
            self.id,
            String::from_utf8_lossy(&out.stderr)
        );
    }

    pub fn state(&self) -> Option<Value> {
        let out = self.env.runtime(&["state", &self.id], &self.log());
        out.status
            .success()
            .then(|| serde_json::from_slice(&out.stdout).ok())
            .flatten()
    }

    /// Waits until the container's process has exited.
    pub fn wait(&self) {
        let stopped = wait_until(Duration::from_secs(30), || {
            self.state().is_some_and(|s| s["status"] == "stopped")
        });
        assert!(
            stopped,
            "container {} did not stop; stdout: {}",
            self.id,
            self.stdout()
        );
    }

    pub fn run(&self) -> String {
        self.start();
        self.wait();
        self.stdout()
    }

    /// Starts the container and waits (10 s) until its simulator client is attached (its
    /// line is printed).
    pub fn start_attached(&self) {
        self.start();
        assert!(
            self.wait_stdout("mps-client", Duration::from_secs(10)),
            "{} attached: {}",
            self.id,
            self.stderr()
        );
    }

    /// Whether the container's stdout contains `want` within `limit`.
    pub fn wait_stdout(&self, want: &str, limit: Duration) -> bool {
        wait_until(limit, || self.stdout().contains(want))
    }

    pub fn stdout(&self) -> String {
        std::fs::read_to_string(self.bundle.join("stdout")).unwrap_or_default()
    }

    pub fn stderr(&self) -> String {
        std::fs::read_to_string(self.bundle.join("stderr")).unwrap_or_default()
    }

    /// `gpushare-runtime delete -f`, whatever it returns; a container deleted here is no
    /// longer deleted again when its `Env` is dropped (a soak makes thousands).
    pub fn try_delete(&self) -> Output {
        let out = self.env.runtime(&["delete", "-f", &self.id], &self.log());
        if out.status.success() {
            self.env
                .containers
                .lock()
                .unwrap()
                .retain(|c| *c != self.id);
        }
        out
    }

    pub fn delete(&self) {
        let out = self.try_delete();
        assert!(
            out.status.success(),
            "delete {}: {}",
            self.id,
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// The directory of binaries `scripts/fetch-engines` extracted for one engine version
/// (`var`, which scripts/test exports, else the script's default cache `suite`), checked
/// to hold `bins`. A test that needs it fails without it, saying how to fetch it.
pub fn fetched(var: &str, suite: &str, bins: &[&str]) -> PathBuf {
    let dir = std::env::var_os(var).map(PathBuf::from).unwrap_or_else(|| {
        Path::new("/var/cache/gpushare-test/engines")
            .join(suite)
            .join("root/usr/bin")
    });
    for bin in bins {
        assert!(
            dir.join(bin).is_file(),
            "{} is missing: the engine is not fetched; run ./scripts/fetch-engines (the README's test command, ./scripts/test, runs it and sets {var}), or set {var} to a directory holding {}",
            dir.join(bin).display(),
            bins.join(", ")
        );
    }
    dir
}

pub fn need(bin: &str, package: &str) -> PathBuf {
    which(bin).unwrap_or_else(|| panic!("{bin} is not installed: the README's test command (./scripts/test) installs {package} with apt-get"))
}

/// A mount namespace for one engine test: a slave of the host's (the host's mounts reach
/// it, none of its own reach the host) with a tmpfs over each place engines write outside
/// the roots their flags name. Every engine process is started in it through `cmd`.
pub struct PrivateMounts {
    holder: Child,
}

impl PrivateMounts {
    const COVERED: &'static [&'static str] = &[
        "/run",
        "/etc/docker",
        "/etc/cni",
        "/var/lib",
        "/var/cache",
        "/opt",
    ];

    // It makes things on the machine (a temp dir, a namespace), which `Default` would hide.
    #[allow(clippy::new_without_default)]
    pub fn new() -> PrivateMounts {
        PrivateMounts::with_binds(&[])
    }

    /// As `new`, with each (source, target) bound first, so that a source the tmpfs
    /// covers (a cache under /var/cache) is still reached at its target in the namespace.
    pub fn with_binds(binds: &[(&Path, &Path)]) -> PrivateMounts {
        let mut setup = String::new();
        for (source, target) in binds {
            setup += &format!(
                "mkdir -p '{t}'\nmount --bind '{s}' '{t}'\n",
                s = source.display(),
                t = target.display()
            );
        }
        setup += &format!(
            "for d in {}; do if [ -d \"$d\" ]; then mount -t tmpfs -o mode=0755 gs-engine \"$d\"; fi; done",
            Self::COVERED.join(" ")
        );
        PrivateMounts::with(&setup)
    }

    /// As `new`, with each of `paths` (a fetched engine's tree under /var/cache, whose
    /// patched binaries name their loader by its absolute path) still seen at its own place:
    /// bound to a directory under `stage` before the tmpfs covers it, and back after.
    pub fn keeping(stage: &Path, paths: &[&Path]) -> PrivateMounts {
        let mut setup = String::new();
        let mut back = String::new();
        for (i, path) in paths.iter().enumerate() {
            let staged = stage.join(format!("keep{i}"));
            std::fs::create_dir_all(&staged).unwrap();
            setup += &format!(
                "mount --bind '{p}' '{s}'\n",
                p = path.display(),
                s = staged.display()
            );
            back += &format!(
                "mkdir -p '{p}'\nmount --bind '{s}' '{p}'\n",
                p = path.display(),
                s = staged.display()
            );
        }
        setup += &format!(
            "for d in {}; do if [ -d \"$d\" ]; then mount -t tmpfs -o mode=0755 gs-engine \"$d\"; fi; done\n",
            Self::COVERED.join(" ")
        );
        PrivateMounts::with(&(setup + &back))
    }

    /// A mount namespace set up by the shell commands `setup` (run with `set -e`) instead
    /// of the engines' tmpfs list.
    pub fn with(setup: &str) -> PrivateMounts {
        let script = format!("set -e\n{setup}\necho ready\nexec sleep 3600");
        let mut holder = Command::new(need("unshare", "util-linux"))
            .args(["--mount", "--propagation", "slave", "sh", "-c", &script])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(holder.stdout.take().unwrap()),
            &mut line,
        )
        .unwrap();
        assert_eq!(line.trim(), "ready", "the mount namespace was not set up");
        PrivateMounts { holder }
    }

    /// The pid of the process that holds the namespace.
    pub fn holder_pid(&self) -> u32 {
        self.holder.id()
    }

    /// `program` run inside the namespace (nsenter execs it: the pid is the program's).
    pub fn cmd(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = Command::new(need("nsenter", "util-linux"));
        c.arg(format!("--mount=/proc/{}/ns/mnt", self.holder.id()))
            .arg("--")
            .arg(program);
        c
    }
}

impl Drop for PrivateMounts {
    fn drop(&mut self) {
        let _ = self.holder.kill();
        let _ = self.holder.wait();
    }
}

/// Stops a daemon we started: SIGTERM, then SIGKILL after `grace`.
pub fn stop_child(child: &mut Child, grace: Duration) {
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
    if !wait_until(grace, || matches!(child.try_wait(), Ok(Some(_)))) {
        let _ = child.kill();
    }
    let _ = child.wait();
}

/// A tarball of the test rootfs (busybox + the simulator's client).
pub fn rootfs_tar(dir: &Path) -> PathBuf {
    let tar = dir.join("rootfs.tar");
    let st = Command::new("tar")
        .arg("-C")
        .arg(rootfs())
        .args(["-cf"])
        .arg(&tar)
        .arg(".")
        .status()
        .unwrap();
    assert!(st.success());
    tar
}

/// The config table that moves containerd's `opt` plugin into `dir`: by default it creates
/// /opt/containerd on the host, a place no namespace of ours covers.
pub fn containerd_opt_plugin(dir: &Path) -> String {
    format!(
        "[plugins.\"io.containerd.internal.v1.opt\"]\n  path = {:?}\n",
        dir.join("opt").display().to_string()
    )
}

/// Starts every one of `containers`, then waits for each (they run at once), and returns
/// each one's simulator client line, in order.
pub fn run_at_once<const N: usize>(containers: [&Container; N]) -> [BTreeMap<String, String>; N] {
    for c in containers {
        c.start();
    }
    for c in containers {
        c.wait();
    }
    containers.map(|c| client_line(&c.stdout()))
}

/// Makes `env`'s low-level runtime a stand-in for NVIDIA's shim, named as gpushare knows it
/// (`nvidia-container-runtime`), followed by `then` in `low-level-runtime`: it appends its
/// argv to `<dir>/argv`, keeps the spec of each container it creates as `<dir>/<id>.json`,
/// then runs runc. Returns `<dir>`.
pub fn nvidia_stand_in(env: &Env, then: &[&str]) -> PathBuf {
    let dir = env.path().join("nv");
    std::fs::create_dir_all(&dir).unwrap();
    let stand_in = dir.join("nvidia-container-runtime");
    let runc = need("runc", "runc");
    std::fs::write(
        &stand_in,
        format!(
            "#!/bin/sh\nprintf '%s\\n' \"$@\" >> {dir}/argv\nb=.\nprev=\nfor a in \"$@\"; do [ \"$prev\" = --bundle ] && b=$a; prev=$a; done\ncase \" $* \" in *' create '*) cp \"$b/config.json\" {dir}/\"$prev\".json;; esac\nexec {runc} \"$@\"\n",
            dir = dir.display(),
            runc = runc.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(
        &stand_in,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let list: Vec<String> = std::iter::once(stand_in.display().to_string())
        .chain(then.iter().map(|s| s.to_string()))
        .map(|s| format!("{s:?}"))
        .collect();
    let cfg = std::fs::read_to_string(&env.config).unwrap();
    let low_level = format!("low-level-runtime = [{:?}]", runc.display().to_string());
    assert!(cfg.contains(&low_level), "{cfg}");
    let cfg = cfg.replace(
        &low_level,
        &format!("low-level-runtime = [{}]", list.join(", ")),
    );
    std::fs::write(&env.config, cfg).unwrap();
    dir
}

/// The `/tmp/nvidia-mps` mounts in a container's mountinfo: one per hook that served it.
pub fn pipe_mounts(mountinfo: &str) -> usize {
    mountinfo
        .lines()
        .filter(|l| l.split(' ').nth(4) == Some("/tmp/nvidia-mps"))
        .count()
}

/// Parses the simulator client's line `mps-client pid=… server=… waited_ms=… …`.
pub fn client_line(stdout: &str) -> BTreeMap<String, String> {
    parse_client_line(stdout).unwrap_or_else(|| panic!("no mps-client line in output:\n{stdout}"))
}

/// The active thread percentage a client's line reports.
pub fn percentage(line: &BTreeMap<String, String>) -> f64 {
    line["active_thread_percentage"]
        .parse()
        .unwrap_or_else(|_| panic!("no active_thread_percentage in {line:?}"))
}

/// Device number of a path (to tell which filesystem a directory is).
pub fn dev_of(path: &Path) -> u64 {
    std::fs::metadata(path).unwrap().dev()
}

/// The `Uid:` line's real uid and the `CapEff:` mask of a process.
pub fn uid_and_capeff(pid: i32) -> (u32, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .unwrap()
            .split_whitespace()
            .nth(1)
            .unwrap()
            .to_owned()
    };
    (
        field("Uid:").parse().unwrap(),
        u64::from_str_radix(&field("CapEff:"), 16).unwrap(),
    )
}

pub fn cmdline(pid: i32) -> Vec<String> {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .unwrap()
        .split(|&b| b == 0)
        .filter(|s| !s.is_empty())
        .map(|s| String::from_utf8_lossy(s).into_owned())
        .collect()
}

pub fn environ(pid: i32) -> Vec<String> {
    std::fs::read(format!("/proc/{pid}/environ"))
        .unwrap()
        .split(|&b| b == 0)
        .filter(|s| !s.is_empty())
        .map(|s| String::from_utf8_lossy(s).into_owned())
        .collect()
}

/// The extracted tree a fetched engine's `bin` (…/root/usr/bin) belongs to.
pub fn fetched_root(bin: &Path) -> PathBuf {
    bin.ancestors().nth(2).unwrap().to_owned()
}

/// gpushare's own hooks.d files in `hooks`, pointed at the binary under test and `env`'s
/// config.
pub fn write_hooks_d(env: &Env, hooks: &Path) {
    std::fs::create_dir_all(hooks).unwrap();
    for name in ["gpushare.json", "gpushare-poststop.json"] {
        let shipped = repo().join("hooks/oci-hooks.d").join(name);
        let mut v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(shipped).unwrap()).unwrap();
        v["hook"]["path"] = gpushare().into();
        v["hook"]["env"]
            .as_array_mut()
            .unwrap()
            .push(format!("GPUSHARE_CONFIG={}", env.config.display()).into());
        std::fs::write(hooks.join(name), v.to_string()).unwrap();
    }
}

/// Podman 5, fetched by scripts/fetch-engines (trixie's, with its conmon and netavark).
pub fn fetched_podman5() -> PathBuf {
    fetched(
        "GPUSHARE_TEST_PODMAN5",
        "trixie",
        &["podman", "conmon", "../lib/podman/netavark"],
    )
}

/// A private Podman on gpushare's hooks.d files (hook-only mode): `bin`, a fetched one (its
/// tree kept visible in the private mount namespace, its conmon and helpers named in a
/// containers.conf of its own), or Debian's own (`None`). Its storage, state, temp dir and
/// hooks.d are under `<env>/p`, and the `gpushare-test` image is the shared rootfs. Every
/// command is bounded (`timeout`, `limit` seconds), so that an engine that hangs fails the
/// test instead of holding it. `Drop` removes its containers and unmounts what it left.
pub struct Podman {
    /// The mount namespace it runs in (`Env::enter` it where the agent must run there too).
    pub ns: PrivateMounts,
    /// Its storage, state (`run`), temp dir and hooks.d.
    pub dir: PathBuf,
    /// Seconds one podman command may take.
    pub limit: u32,
    bin: PathBuf,
    /// A fetched Podman's containers.conf (Debian 12's /usr/share/containers/containers.conf
    /// is Podman 4.3's).
    conf: Option<PathBuf>,
}

impl Podman {
    /// Podman `bin` (`None`: Debian's) set up under `env`, with the image imported.
    pub fn new(env: &Env, bin: Option<&Path>) -> Podman {
        let dir = env.path().join("p");
        write_hooks_d(env, &dir.join("hooks.d"));
        let (ns, bin, conf) = match bin {
            None => (PrivateMounts::new(), need("podman", "podman"), None),
            Some(bin) => {
                let conf = env.path().join("containers.conf");
                std::fs::write(
                    &conf,
                    format!(
                        "[engine]\nconmon_path = [{:?}]\nhelper_binaries_dir = [{:?}]\n",
                        bin.join("conmon").display().to_string(),
                        bin.join("../lib/podman").display().to_string()
                    ),
                )
                .unwrap();
                let ns = PrivateMounts::keeping(env.path(), &[&fetched_root(bin)]);
                (ns, bin.join("podman"), Some(conf))
            }
        };
        let p = Podman {
            ns,
            dir,
            limit: 120,
            bin,
            conf,
        };
        let tar = rootfs_tar(&p.dir);
        let out = p.run(&["import", tar.to_str().unwrap(), "gpushare-test"]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        p
    }

    /// `podman <args>` on this Podman's storage, runc and hooks, its stdin empty.
    pub fn run(&self, args: &[&str]) -> Output {
        let mut cmd = self.ns.cmd(need("timeout", "coreutils"));
        cmd.arg(self.limit.to_string()).arg(&self.bin);
        if let Some(conf) = &self.conf {
            cmd.env("CONTAINERS_CONF", conf)
                .env("PODMAN_IGNORE_CGROUPSV1_WARNING", "1");
        }
        cmd.arg("--root")
            .arg(self.dir.join("storage"))
            .arg("--runroot")
            .arg(self.runroot())
            .arg("--tmpdir")
            .arg(self.dir.join("tmp"))
            .arg("--hooks-dir")
            .arg(self.dir.join("hooks.d"))
            .args(["--storage-driver", "vfs", "--runtime"])
            .arg(need("runc", "runc"))
            .args(["--cgroup-manager", "cgroupfs", "--events-backend", "file"])
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    }

    /// `podman run --rm` of the image as `user` with `extra` options, running `sh -c script`.
    pub fn run_rm(&self, user: &str, extra: &[&str], script: &str) -> Output {
        let mut args = vec!["run", "--rm"];
        args.extend(Podman::run_args(user));
        args.extend_from_slice(extra);
        args.extend(["gpushare-test", "sh", "-c", script]);
        self.run(&args)
    }

    /// The options every test container runs with: no network, `user`, and nofile/nproc
    /// limits any machine allows (its own may be lower than Podman's defaults).
    pub fn run_args(user: &str) -> Vec<&str> {
        vec![
            "--network",
            "none",
            "--user",
            user,
            "--ulimit",
            "nofile=1024:1024",
            "--ulimit",
            "nproc=1024:1024",
        ]
    }

    /// Its state directory (`--runroot`), which its conmons' command lines name.
    pub fn runroot(&self) -> PathBuf {
        self.dir.join("run")
    }
}

impl Drop for Podman {
    fn drop(&mut self) {
        let _ = self.run(&["rm", "-af", "-t", "0"]);
        umount_below(&self.dir);
    }
}

/// The `pod_annotations` line `gpushare install containerd` writes: every request key's
/// annotation (`request::KEYS`), in order.
pub fn pod_annotations_line() -> String {
    let keys: Vec<String> = gpushare::request::KEYS
        .iter()
        .map(|k| format!("{:?}", k.annotation))
        .collect();
    format!("pod_annotations = [{}]", keys.join(", "))
}

/// The fake NVML compiled into `<dir>/nvml/libnvidia-ml.so.1`, the name nvml-wrapper
/// dlopens; returns that directory, for LD_LIBRARY_PATH.
pub fn fake_nvml(dir: &Path) -> PathBuf {
    let cc = need("cc", "gcc");
    let source = repo().join("tests/integration/fake_nvml.c");
    let lib_dir = dir.join("nvml");
    std::fs::create_dir_all(&lib_dir).unwrap();
    let out = Command::new(cc)
        // nodelete: the thread nvmlInit_v2 leaves runs the library's code after the
        // wrapper's dlclose, as a real driver's threads outlive it.
        .args([
            "-shared",
            "-fPIC",
            "-pthread",
            "-Wl,-z,nodelete",
            "-Wall",
            "-Werror",
            "-o",
        ])
        .arg(lib_dir.join("libnvidia-ml.so.1"))
        .arg(&source)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "cc {}: {}",
        source.display(),
        text(&out)
    );
    lib_dir
}
