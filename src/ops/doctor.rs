//! `gpushare doctor`: is this node ready to share GPUs? Every check prints one line, ok,
//! warn or FAIL, with its evidence and, when not ok, one line saying how to fix it. The
//! exit code is the worst result: 0 ok, 1 warn, 2 fail (a config that does not load is a
//! `FAIL config` line and exit 2). Works on a machine without a GPU and says so. Reads
//! only: it changes nothing, not even gpushare's log file. Whether an engine's config
//! registers gpushare is the installers' answer (each engine's `EngineConfig::check`):
//! doctor parses no engine config of its own.

use std::path::{Path, PathBuf};

use super::install::{EngineConfig, ENGINES};
use crate::config::{Config, UserMode};
use crate::device::{ComputeMode, Inventory, InventorySource};

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Level {
    Ok,
    Warn,
    Fail,
}

#[derive(Debug)]
pub(crate) struct Check {
    pub name: &'static str,
    pub level: Level,
    pub detail: String,
    pub fix: Option<String>,
}

fn ok(name: &'static str, detail: impl Into<String>) -> Check {
    Check {
        name,
        level: Level::Ok,
        detail: detail.into(),
        fix: None,
    }
}
fn warn(name: &'static str, detail: impl Into<String>, fix: impl Into<String>) -> Check {
    Check {
        name,
        level: Level::Warn,
        detail: detail.into(),
        fix: Some(fix.into()),
    }
}
fn fail(name: &'static str, detail: impl Into<String>, fix: impl Into<String>) -> Check {
    Check {
        name,
        level: Level::Fail,
        detail: detail.into(),
        fix: Some(fix.into()),
    }
}

/// Where the engines' configs are looked for (overridable for tests and odd layouts).
#[derive(Clone)]
pub(crate) struct Paths {
    /// Every engine's, in [`ENGINES`]' order.
    pub engines: Vec<EnginePaths>,
    /// Where gpushare's CDI spec may be: each one there is compared with the spec this
    /// node would generate now.
    pub cdi_specs: Vec<PathBuf>,
}

/// Where one engine's config is, and the socket that tells whether it runs here at all.
#[derive(Clone)]
pub(crate) struct EnginePaths {
    pub engine: &'static dyn EngineConfig,
    pub config: PathBuf,
    pub socket: PathBuf,
}

impl Paths {
    /// The paths of the engine called `name`.
    pub(crate) fn engine_mut(&mut self, name: &str) -> Option<&mut EnginePaths> {
        self.engines.iter_mut().find(|e| e.engine.name() == name)
    }
}

impl Default for Paths {
    fn default() -> Self {
        Paths {
            engines: ENGINES
                .iter()
                .map(|&engine| EnginePaths {
                    engine,
                    config: engine.default_config().into(),
                    socket: engine.default_socket().into(),
                })
                .collect(),
            cdi_specs: vec![
                super::install::CDI_STATIC_SPEC.into(),
                crate::cdi::DEFAULT_OUTPUT.into(),
            ],
        }
    }
}

fn inventory_checks(cfg: &Config, out: &mut Vec<Check>) -> Option<Inventory> {
    let nvml = crate::device::load(&InventorySource::Nvml, cfg.driver_root.as_deref());
    match (&cfg.inventory, &nvml) {
        (InventorySource::Nvml, Ok(inv)) => out.push(ok("driver", format!("NVML answers: driver {}, {} GPU(s)", inv.driver_version, inv.gpus.len()))),
        (InventorySource::Nvml, Err(e)) => out.push(fail(
            "driver",
            crate::util::error_chain(e),
            match &cfg.driver_root {
                None => "install and load the NVIDIA driver (nvidia-smi must work), or set inventory = \"file:<path>\" on a machine without a GPU".to_owned(),
                Some(root) => format!("check that the driver under driver-root {} is running (the GPU Operator's driver pod) and that its kernel module is loaded", root.display()),
            },
        )),
        (_, Ok(inv)) => out.push(ok("driver", format!("NVML answers (driver {}), but inventory = \"{}\" is used", inv.driver_version, cfg.inventory))),
        (_, Err(_)) if cfg.driver_root.is_some() => out.push(ok("driver", format!("NVML does not answer from driver-root; inventory = \"{}\" stands in for it", cfg.inventory))),
        (_, Err(_)) => out.push(ok("driver", format!("no NVIDIA driver on this machine; inventory = \"{}\" stands in for it (test mode)", cfg.inventory))),
    }
    match crate::device::load(&cfg.inventory, cfg.driver_root.as_deref()) {
        Ok(inv) => {
            let migs: usize = inv.gpus.iter().map(|g| g.mig_devices.len()).sum();
            out.push(ok(
                "inventory",
                format!(
                    "{} GPU(s), {migs} MIG device(s) from {}",
                    inv.gpus.len(),
                    cfg.inventory
                ),
            ));
            Some(inv)
        }
        Err(e) => {
            if cfg.inventory != InventorySource::Nvml {
                out.push(fail(
                    "inventory",
                    crate::util::error_chain(&e),
                    "fix the inventory file named by `inventory` in the config",
                ));
            }
            None
        }
    }
}

fn gpu_checks(cfg: &Config, inv: &Inventory, out: &mut Vec<Check>) {
    for gpu in &inv.gpus {
        let cc: f32 = gpu.compute_capability.parse().unwrap_or(0.0);
        let name = format!("GPU {} ({})", gpu.index, gpu.name);
        if cc < 7.0 {
            let msg = format!("{name} has compute capability {}: pre-Volta MPS has no per-client limits, 16 clients, and no multi-user server", gpu.compute_capability);
            if cfg.mps.user_mode == UserMode::MultiUser {
                out.push(fail(
                    "gpu-generation",
                    msg,
                    "use user-mode = \"per-user\" on this GPU, or a Volta or newer GPU",
                ));
            } else {
                out.push(warn(
                    "gpu-generation",
                    msg,
                    "expect limits to be ignored on this GPU; prefer Volta or newer",
                ));
            }
        } else {
            out.push(ok(
                "gpu-generation",
                format!(
                    "{name}: compute capability {} (Volta or newer: limits and multi-user MPS)",
                    gpu.compute_capability
                ),
            ));
        }
        match (gpu.compute_mode, cfg.mps.user_mode) {
            (ComputeMode::Default, _) => out.push(ok("compute-mode", format!("{name}: DEFAULT"))),
            (ComputeMode::ExclusiveProcess, UserMode::PerUser) => out.push(fail(
                "compute-mode",
                format!("{name} is in EXCLUSIVE_PROCESS: only one MPS server may hold it, so per-user daemons of a second user cannot start their servers"),
                format!("nvidia-smi -i {} -c DEFAULT", gpu.index),
            )),
            (ComputeMode::ExclusiveProcess, UserMode::MultiUser) => out.push(ok("compute-mode", format!("{name}: EXCLUSIVE_PROCESS (recommended for one multi-user server)"))),
            (ComputeMode::Prohibited, _) => out.push(fail(
                "compute-mode",
                format!("{name} is in PROHIBITED mode: no CUDA context can be created"),
                format!("nvidia-smi -i {} -c DEFAULT", gpu.index),
            )),
        }
    }
}

/// Whether any user may execute `path`: o+x on the file and on every parent directory.
fn runnable_by_others(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    let ox = |p: &Path| std::fs::metadata(p).is_ok_and(|m| m.permissions().mode() & 0o001 != 0);
    ox(path) && path.ancestors().skip(1).all(ox)
}

/// `driver-root`: where NVML, the control binary and the MPS servers' libraries are
/// taken from, each by the path found (the same lookups the commands make).
fn driver_root_check(cfg: &Config) -> Check {
    use crate::driver;
    let Some(root) = &cfg.driver_root else {
        return ok(
            "driver-root",
            "not set: NVML, nvidia-cuda-mps-control and the libraries MPS servers load are the host's own",
        );
    };
    let control = &cfg.mps.control_binary;
    let mut found = Vec::new();
    let mut missing = Vec::new();
    let mut note = |what: &str, r: Result<PathBuf, driver::DriverError>| match r {
        Ok(p) => found.push(format!("{what} {}", p.display())),
        Err(e) => missing.push(e),
    };
    note(
        driver::NVML_LIBRARY,
        driver::find_library(root, driver::NVML_LIBRARY),
    );
    if !control.contains('/') {
        note(control, driver::find_binary(root, control));
    }
    match driver::server_libraries(root) {
        Ok(libs) => found.push(format!(
            "{} {} and {} more driver libraries for MPS servers",
            driver::CUDA_LIBRARY,
            libs[driver::CUDA_LIBRARY].display(),
            libs.len() - 1
        )),
        Err(e) => missing.push(e),
    }
    if let Some(first) = missing.first() {
        // A root that cannot be opened fails every lookup the same way: say it once.
        let detail = match first {
            driver::DriverError::Root { .. } => crate::util::error_chain(first),
            _ => missing
                .iter()
                .map(|e| crate::util::error_chain(e))
                .collect::<Vec<_>>()
                .join("; "),
        };
        return fail(
            "driver-root",
            detail,
            "point driver-root at the driver's root directory (the GPU Operator's is /run/nvidia/driver, while its driver pod runs), or set it to \"\" where the driver is installed on the host",
        );
    }
    if control.contains('/') {
        found.push(format!(
            "mps.control-binary {control} is an absolute path, used as it is"
        ));
    }
    ok(
        "driver-root",
        format!("{}: {}", root.display(), found.join(", ")),
    )
}

fn control_binary_check(cfg: &Config) -> Check {
    match crate::mps::control::resolve_binary(&cfg.mps.control_binary, cfg.driver_root.as_deref()) {
        Ok(path) if cfg.mps.user_mode == UserMode::PerUser && !runnable_by_others(&path) => fail(
            "mps-control",
            format!(
                "{} cannot be run by other users (it or a parent directory lacks o+x), but per-user daemons run as the containers' UIDs",
                path.display()
            ),
            "install it where every user can run it (e.g. /usr/local/bin, mode 0755), or chmod o+x the file and its parents",
        ),
        Ok(path) => {
            let version = std::process::Command::new(&path)
                .arg("-v")
                .env_clear()
                .env("PATH", crate::mps::control::SAFE_PATH)
                .output()
                .ok()
                .map(|o| String::from_utf8_lossy(&o.stdout).lines().next().unwrap_or("").trim().to_owned())
                .filter(|v| !v.is_empty());
            ok("mps-control", format!("{} ({})", path.display(), version.as_deref().unwrap_or("version not reported")))
        }
        Err(e) if cfg.driver_root.is_some() => fail("mps-control", crate::util::error_chain(&e), "the driver under driver-root must have it (NVIDIA's driver containers do), or set mps.control-binary to an absolute path"),
        Err(e) => fail("mps-control", e.to_string(), "install nvidia-cuda-mps-control (NVIDIA driver utilities) or set mps.control-binary to its absolute path"),
    }
}

/// Which MPS backend this node runs (`mps.protocol`) and why; `true` where it is v3 (for
/// containers that are neither host root nor on a MIG device). `speaks` runs the control
/// binary's `-p 3 -h` (`driver::control_speaks_v3`; `Err`: no binary to run), only where
/// the answer decides something. Doctor asks the binary itself: it reads no cache.
fn protocol_check(
    protocol: crate::config::Protocol,
    driver: Option<&str>,
    speaks: impl FnOnce() -> Result<Option<bool>, String>,
) -> (Check, bool) {
    use crate::config::Protocol;
    const KEEP: &str = "; containers on a MIG device and host-root containers keep legacy daemons";
    const ASKED: &str = "`-p 3 -h` exits 0 and lists the namespace module";
    let driver_text = driver.unwrap_or("unknown");
    match protocol {
        Protocol::Legacy => (ok("mps-protocol", "protocol = legacy"), false),
        Protocol::V3 => match speaks() {
            Ok(Some(true)) => (
                ok("mps-protocol", format!("protocol = v3 (driver {driver_text}, the control binary speaks protocol 3){KEEP}")),
                true,
            ),
            Ok(answer) => (
                fail(
                    "mps-protocol",
                    format!(
                        "protocol = v3, but the control binary {} (wanted: {ASKED}; driver {driver_text}): every create of a v3 container fails",
                        if answer.is_some() { "does not speak protocol 3" } else { "did not answer `-p 3 -h` in time" }
                    ),
                    "set mps.protocol = \"auto\" (or \"legacy\") on this node, or install a driver of 615 or later",
                ),
                true,
            ),
            Err(e) => (
                fail("mps-protocol", format!("protocol = v3, but no control binary to run: {e}"), "fix mps.control-binary (the mps-control line above)"),
                true,
            ),
        },
        Protocol::Auto => {
            let Some(driver) = driver else {
                return (ok("mps-protocol", "auto → undecided: no driver version (the inventory did not load; see above)"), false);
            };
            if !crate::driver::has_mps_v3(driver) {
                return (
                    ok("mps-protocol", format!("auto → legacy (driver {driver} is before {})", crate::driver::MPS_V3_DRIVER)),
                    false,
                );
            }
            match speaks() {
                Ok(Some(true)) => (
                    ok("mps-protocol", format!("auto → v3 (driver {driver}, the control binary speaks protocol 3){KEEP}")),
                    true,
                ),
                Ok(Some(false)) => (
                    warn(
                        "mps-protocol",
                        format!("auto → legacy (driver {driver}, but the control binary does not speak protocol 3: wanted {ASKED})"),
                        "point mps.control-binary at the driver's own nvidia-cuda-mps-control (under driver-root where the driver runs in a container), or set mps.protocol = \"legacy\"",
                    ),
                    false,
                ),
                Ok(None) => (
                    warn(
                        "mps-protocol",
                        format!("auto → legacy for now (driver {driver}, but the control binary did not answer `-p 3 -h` in time); each create asks it again until it answers"),
                        "run `<control-binary> -p 3 -h` by hand to see why it hangs",
                    ),
                    false,
                ),
                Err(e) => (
                    ok("mps-protocol", format!("auto → legacy (driver {driver}, but no control binary to ask: {e})")),
                    false,
                ),
            }
        }
    }
}

/// Whether the driver's per-cgroup device memory limits are there for a v3 node's
/// `mps.cgroup-memory-limit`: `/sys/fs/cgroup` is cgroup v2 (`cgroup2`) and its
/// `dmem.capacity` lists an NVIDIA region (`nvidia` below, `mps::v3::node_has_memory_limits`).
fn memory_limit_check(
    setting: crate::config::CgroupMemoryLimit,
    cgroup2: bool,
    nvidia: bool,
) -> Check {
    use crate::config::CgroupMemoryLimit;
    let missing = if !cgroup2 {
        Some("/sys/fs/cgroup is not cgroup v2")
    } else if !nvidia {
        Some("/sys/fs/cgroup/dmem.capacity lists no nvidia/ region")
    } else {
        None
    };
    let name = "cgroup-memory-limit";
    match (setting, missing) {
        (CgroupMemoryLimit::Off, _) => ok(name, "off: a v3 container's pinned-memory-limit is its MPS namespace's alone"),
        (s, None) => ok(
            name,
            format!(
                "{}: the driver's per-cgroup memory limits are available (cgroup v2, dmem.capacity lists an NVIDIA region): a v3 container's pinned-memory-limit is also its cgroup's hard device memory limit",
                if s == CgroupMemoryLimit::On { "on" } else { "auto" }
            ),
        ),
        (CgroupMemoryLimit::Auto, Some(why)) => warn(
            name,
            format!("auto: the driver's per-cgroup memory limits are not available ({why}): a v3 container's pinned-memory-limit is its MPS namespace's alone, which a client can escape (docs/mps.md, \"Memory limits\")"),
            "run the node on cgroup v2 with a driver whose dmem controller offers its GPUs, or accept the namespace's limit",
        ),
        (CgroupMemoryLimit::On, Some(why)) => fail(
            name,
            format!("on, but the driver's per-cgroup memory limits are not available ({why}): every v3 create with a pinned-memory-limit fails"),
            "set mps.cgroup-memory-limit = \"auto\" or \"off\", or run the node on cgroup v2 with a driver whose dmem controller offers its GPUs",
        ),
    }
}

/// The longest MPS socket path under `dir` against the 108 bytes of a Unix socket path:
/// a daemon's `control` (every daemon id has the same length, so one stands for all),
/// and on a v3 node a namespace's `<pipe>/s/c<20 hex>/control`.
fn socket_path_check(dir: &Path, v3: bool) -> Check {
    let pipe = dir
        .join("mps")
        .join("0".repeat(crate::identity::ID_LEN))
        .join("pipe");
    let len = pipe.join("control").as_os_str().len();
    let namespace = crate::identity::Namespace::name_for("");
    let len_v3 = pipe
        .join(crate::identity::V3_SERVER)
        .join(&namespace)
        .join("control")
        .as_os_str()
        .len();
    let fix = |len: usize| {
        format!(
            "set state-dir to a path of at most {} bytes, like /run/gpushare",
            dir.as_os_str().len().saturating_sub(len - 107)
        )
    };
    if len >= 108 {
        fail(
            "socket-path",
            format!("{}/mps/<id>/pipe/control is {len} bytes; a Unix socket path must be shorter than 108", dir.display()),
            fix(len),
        )
    } else if v3 && len_v3 >= 108 {
        fail(
            "socket-path",
            format!(
                "{}/mps/<id>/pipe/{}/c<{} hex>/control (a v3 namespace's) is {len_v3} bytes; a Unix socket path must be shorter than 108",
                dir.display(),
                crate::identity::V3_SERVER,
                namespace.len() - 1
            ),
            fix(len_v3),
        )
    } else if v3 {
        ok(
            "socket-path",
            format!("MPS control socket paths are {len} bytes, a v3 namespace's {len_v3} (< 108)"),
        )
    } else {
        ok(
            "socket-path",
            format!("MPS control socket paths are {len} bytes (< 108)"),
        )
    }
}

fn state_dir_checks(cfg: &Config, v3: bool, out: &mut Vec<Check>) {
    use std::os::unix::fs::MetadataExt;
    let dir = &cfg.state_dir;
    out.push(socket_path_check(dir, v3));
    match std::fs::symlink_metadata(dir) {
        Err(_) => out.push(ok(
            "state-dir",
            format!(
                "{} does not exist yet; it will be created 0711 root",
                dir.display()
            ),
        )),
        Ok(md) if !md.is_dir() => out.push(fail(
            "state-dir",
            format!(
                "{} is not a directory (a symlink is refused)",
                dir.display()
            ),
            format!("remove it: rm {}", dir.display()),
        )),
        Ok(md) if md.uid() != 0 => out.push(fail(
            "state-dir",
            format!("{} is owned by uid {}", dir.display(), md.uid()),
            format!("chown root:root {}", dir.display()),
        )),
        Ok(md) if md.mode() & 0o022 != 0 => out.push(fail(
            "state-dir",
            format!(
                "{} has mode {:04o}: writable by group or others",
                dir.display(),
                md.mode() & 0o7777
            ),
            format!("chmod 0711 {}", dir.display()),
        )),
        Ok(md) => out.push(ok(
            "state-dir",
            format!(
                "{} is root's, mode {:04o}",
                dir.display(),
                md.mode() & 0o7777
            ),
        )),
    }
    if let Ok(fs) = nix::sys::statvfs::statvfs(dir) {
        let free = Space {
            read_only: fs.flags().contains(nix::sys::statvfs::FsFlags::ST_RDONLY),
            bytes_free: fs.blocks_available().saturating_mul(fs.fragment_size()),
            files_total: fs.files(),
            files_free: fs.files_available(),
        };
        out.push(match free.problem() {
            None => ok(
                "state-dir-space",
                format!(
                    "{} is writable, {} MiB free",
                    dir.display(),
                    free.bytes_free >> 20
                ),
            ),
            Some(why) => fail(
                "state-dir-space",
                format!(
                    "{} {why}: no new container can get a daemon (running ones keep theirs)",
                    dir.display()
                ),
                "free space on it or remount it read-write; nothing needs restarting after",
            ),
        });
    }
    if cfg.mps.user_mode == UserMode::PerUser {
        match crate::state::StateDir::new(dir).check_traversable() {
            Ok(()) => out.push(ok(
                "state-dir-parents",
                "every parent is searchable by per-user daemons",
            )),
            Err(e) => out.push(fail(
                "state-dir-parents",
                e.to_string(),
                "chmod o+x on the parent named, or choose another state-dir",
            )),
        }
    }
}

/// The state dir's file system, as statvfs sees it: what a create needs to write a
/// daemon's record, lock and directories (a full or read-only state dir fails every
/// create, and nothing else would say so).
struct Space {
    read_only: bool,
    bytes_free: u64,
    /// 0 on a file system without an inode limit (tmpfs with nr_inodes=0).
    files_total: u64,
    files_free: u64,
}

/// Less than this free and a create may fail half-way through its records.
const STATE_DIR_MIN_FREE: u64 = 1 << 20;

impl Space {
    fn problem(&self) -> Option<&'static str> {
        if self.read_only {
            Some("is on a read-only file system")
        } else if self.bytes_free < STATE_DIR_MIN_FREE {
            Some("has less than 1 MiB free")
        } else if self.files_total > 0 && self.files_free == 0 {
            Some("has no free inodes")
        } else {
            None
        }
    }
}

fn host_pipe_check() -> Check {
    let p = Path::new(crate::served::NVIDIA_HOST_PIPE_DIR);
    if p.exists() {
        warn(
            "host-mps-pipe",
            format!("{} exists on the host: NVIDIA's container toolkit mounts it into every GPU container, over gpushare's pipe directory", p.display()),
            "stop the host-wide MPS daemon and remove it, or set mps.container-pipe-dir elsewhere",
        )
    } else {
        ok("host-mps-pipe", format!("no {} on the host", p.display()))
    }
}

/// Is gpushare registered with the engines that run here: one check each.
fn engine_checks(paths: &Paths, out: &mut Vec<Check>) {
    out.extend(paths.engines.iter().map(engine_check));
}

fn engine_check(at: &EnginePaths) -> Check {
    let name = at.engine.name();
    let found = at.engine.check(&at.config, &at.socket);
    match found.fix {
        None => ok(name, found.detail),
        Some(fix) => warn(name, found.detail, fix),
    }
}

/// Runs every check.
pub(crate) fn run(cfg: &Config, paths: &Paths) -> Vec<Check> {
    let mut out = vec![ok(
        "config",
        cfg.path.as_ref().map_or_else(
            || "no config file: built-in defaults".to_owned(),
            |p| format!("{} parses", p.display()),
        ),
    )];
    out.push(driver_root_check(cfg));
    let inv = inventory_checks(cfg, &mut out);
    if let Some(inv) = &inv {
        gpu_checks(cfg, inv, &mut out);
    }
    out.push(control_binary_check(cfg));
    let (protocol, v3) = protocol_check(
        cfg.mps.protocol,
        inv.as_ref().map(|i| i.driver_version.as_str()),
        || {
            crate::mps::control::resolve_binary(&cfg.mps.control_binary, cfg.driver_root.as_deref())
                .map(|b| crate::driver::control_speaks_v3(&b))
                .map_err(|e| e.to_string())
        },
    );
    out.push(protocol);
    if v3 {
        out.push(memory_limit_check(
            cfg.mps.cgroup_memory_limit,
            nix::sys::statfs::statfs("/sys/fs/cgroup")
                .is_ok_and(|fs| fs.filesystem_type() == nix::sys::statfs::CGROUP2_SUPER_MAGIC),
            crate::mps::v3::node_has_memory_limits(),
        ));
    }
    state_dir_checks(cfg, v3, &mut out);
    out.push(capacity_check(cfg));
    out.push(agent_check(cfg));
    out.push(replaced_binary_check(&replaced_binaries()));
    out.extend(nri_check(cfg));
    out.extend(watch_check(cfg));
    out.push(host_pipe_check());
    engine_checks(paths, &mut out);
    out.push(low_level_runtime_check(cfg));
    cdi_checks(cfg, inv.as_ref(), &paths.cdi_specs, &mut out);
    out
}

/// The daemon caps, their use and the one that binds: `mps.max-daemons` is rarely the
/// one (with the defaults, `mps.shm-size-total` over `mps.shm-size` admits fewer). A
/// warning when every place is taken.
fn capacity_check(cfg: &Config) -> Check {
    let state = crate::state::StateDir::new(&cfg.state_dir);
    match super::status::collect_capacity(cfg, &state) {
        Some(c) if c.daemons >= c.effective_daemons => warn(
            "capacity",
            format!("{}: every place is taken; {}", super::status::capacity_line(&c), super::status::caps_summary(&c)),
            format!("a new user's create now takes the place of an idle daemon or is refused naming {}; size the caps for the node (docs/configuration.md, \"Sizing the daemon caps\")", c.binding),
        ),
        Some(c) => ok(
            "capacity",
            format!("{}; {}", super::status::capacity_line(&c), super::status::caps_summary(&c)),
        ),
        None => warn(
            "capacity",
            format!("cannot count the daemons under {}", cfg.state_dir.display()),
            "check state-dir (the state-dir line above)",
        ),
    }
}

/// A gpushare process of this host whose binary was replaced since it started (an upgrade
/// or a downgrade): its pid and arguments.
#[derive(Debug, Clone, PartialEq)]
struct Replaced {
    pid: i32,
    argv: Vec<String>,
}

/// The processes of this host's root (not a container's) whose `/proc/<pid>/exe` is a
/// deleted binary at this very `gpushare`'s path: the one an upgrade replaced.
fn replaced_binaries() -> Vec<Replaced> {
    use std::os::unix::fs::MetadataExt;
    let Ok(me) = std::env::current_exe() else {
        return Vec::new();
    };
    let key = |m: std::fs::Metadata| (m.dev(), m.ino());
    let Ok(root) = std::fs::metadata("/").map(key) else {
        return Vec::new();
    };
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in entries.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|p| p.parse::<i32>().ok()) else {
            continue;
        };
        let proc = e.path();
        let Ok(exe) = std::fs::read_link(proc.join("exe")) else {
            continue;
        };
        let exe = exe.to_string_lossy();
        let Some(path) = exe.strip_suffix(" (deleted)") else {
            continue;
        };
        if Path::new(path) != me || std::fs::metadata(proc.join("root")).map(key).ok() != Some(root)
        {
            continue;
        }
        let argv = std::fs::read(proc.join("cmdline"))
            .map(|c| {
                c.split(|b| *b == 0)
                    .filter(|a| !a.is_empty())
                    .map(|a| crate::util::escape(&String::from_utf8_lossy(a)))
                    .collect()
            })
            .unwrap_or_default();
        out.push(Replaced { pid, argv });
    }
    out.sort_by_key(|r| r.pid);
    out
}

/// After an upgrade or a downgrade, the gpushare processes still on the old binary. The
/// agent and the NRI plugin serve new containers: a warning until they are restarted. A
/// daemon's supervisor (and reaper) keeps its old binary until the daemon idles out: by
/// design, as restarting it would cut its clients off.
fn replaced_binary_check(procs: &[Replaced]) -> Check {
    let role = |r: &Replaced| match r.argv.get(1).map(String::as_str) {
        Some("agent") => "agent",
        Some("nri") => "nri",
        _ => "daemon",
    };
    let pids = |want: &str| {
        procs
            .iter()
            .filter(|r| role(r) == want)
            .map(|r| r.pid.to_string())
            .collect::<Vec<_>>()
    };
    let (agent, nri, daemons) = (pids("agent"), pids("nri"), pids("daemon"));
    let kept = if daemons.is_empty() {
        String::new()
    } else {
        format!(
            "; {} supervisor/reaper process(es) (pid {}) keep the old binary until their daemon idles out (mps.idle-timeout) or is stopped (`gpushare daemon stop <id>` once its containers are gone)",
            daemons.len(),
            daemons.join(", ")
        )
    };
    if agent.is_empty() && nri.is_empty() {
        return ok(
            "binaries",
            if daemons.is_empty() {
                "no gpushare process runs a replaced binary".to_owned()
            } else {
                format!("the agent and the NRI plugin run the installed binary{kept}")
            },
        );
    }
    let mut old = Vec::new();
    if !agent.is_empty() {
        old.push(format!("the agent (pid {})", agent.join(", ")));
    }
    if !nri.is_empty() {
        old.push(format!("the NRI plugin (pid {})", nri.join(", ")));
    }
    warn(
        "binaries",
        format!(
            "{} still run(s) the binary replaced by an upgrade or a downgrade{kept}",
            old.join(" and ")
        ),
        "restart them: `systemctl restart gpushare-agent gpushare-nri` (Debian package), the node installer's pods (`kubectl rollout restart`), or the process you started by hand; containerd restarts a plugin it launched when containerd restarts",
    )
}

/// Whether the node's agent answers: without it a hook starts supervisors itself, and an
/// engine that is a subreaper adopts them (Podman 5's and CRI-O's conmon wait for them).
fn agent_check(cfg: &Config) -> Check {
    let state = crate::state::StateDir::new(&cfg.state_dir);
    match crate::mps::agent::ping(&state) {
        Ok(pid) => ok(
            "agent",
            format!(
                "gpushare agent (pid {pid}) answers on {}: supervisors belong to no engine",
                state.agent_socket().display()
            ),
        ),
        Err(e) => warn(
            "agent",
            format!(
                "the hooks cannot use the agent: {e:#}; they start supervisors themselves, the engine's subreaper adopts them, and `podman run` on Podman 5 (conmon 2.1.12 and later) and CRI-O's conmon wait for them until the daemon idles out",
                e = anyhow::Error::new(e)
            ),
            "start it as root: `systemctl enable --now gpushare-agent` (Debian package), the node installer DaemonSet (Kubernetes), or `gpushare agent` in the background (docs/install.md)",
        ),
    }
}

/// Whether the GPU process watcher runs and sees the GPUs, where one ever ran here (none:
/// it is not in use; `status` then shows no GPU processes).
fn watch_check(cfg: &Config) -> Option<Check> {
    let state = crate::state::StateDir::new(&cfg.state_dir);
    let w = super::status::WatchView::read(&state)?;
    let policy = match w.policy {
        crate::config::WatchPolicy::Report => "report",
        crate::config::WatchPolicy::Act => "act",
    };
    Some(match (w.fresh, &w.error) {
        (true, None) => ok(
            "watch",
            format!(
                "gpushare watch scans every {}s, policy {policy}{}: {} GPU process(es) at its last scan",
                w.interval_seconds,
                if w.enforced { "" } else { " (limits advisory: report only)" },
                w.processes.len()
            ),
        ),
        (true, Some(e)) => warn(
            "watch",
            format!("gpushare watch runs but lists no GPU process: {e}"),
            "see the driver line above; the watcher tries NVML again at every scan",
        ),
        (false, _) => warn(
            "watch",
            "gpushare watch is not running or its last scan is stale (it ran here before): status shows what it last saw, and nothing beyond MPS itself is enforced".to_owned(),
            "start it as root: `systemctl enable --now gpushare-watch` (Debian package) or `gpushare watch` in the background (docs/configuration.md, `[watch]`)",
        ),
    })
}

/// Whether the NRI plugin is connected, where one ever ran here (none: NRI is not in use).
/// NRI fails open: while the plugin is away the runtime creates pods without it.
fn nri_check(cfg: &Config) -> Option<Check> {
    let state = crate::state::StateDir::new(&cfg.state_dir);
    let nri = super::status::NriView::read(&state)?;
    Some(if nri.connected {
        ok("nri", nri.line())
    } else {
        warn(
            "nri",
            nri.line(),
            "start it: `systemctl enable --now gpushare-nri` (Debian package) or `gpushare nri` as root; `gpushare status` shows when it connects (docs/kubernetes.md)",
        )
    })
}

/// Each of gpushare's CDI specs on disk is the one this node would generate now (`gpushare
/// cdi generate`): the same devices (the inventory and the profiles), the same hooks (this
/// binary, the config). None at all is fine: CDI is not in use.
fn cdi_checks(cfg: &Config, inv: Option<&Inventory>, specs: &[PathBuf], out: &mut Vec<Check>) {
    let found: Vec<&PathBuf> = specs.iter().filter(|p| p.exists()).collect();
    if found.is_empty() {
        out.push(ok(
            "cdi",
            "no CDI spec of gpushare's (CDI devices are not offered)",
        ));
        return;
    }
    let Some(inv) = inv else {
        out.push(warn(
            "cdi",
            "cannot compare the CDI spec: the inventory does not load",
            "fix the inventory first",
        ));
        return;
    };
    let want = match crate::cdi::for_node(cfg, inv) {
        Ok(w) => w,
        Err(e) => {
            out.push(warn(
                "cdi",
                format!("cannot generate the CDI spec: {e:#}"),
                "see `gpushare cdi generate`",
            ));
            return;
        }
    };
    for path in found {
        let regenerate = format!("run `gpushare cdi generate --output {}`", path.display());
        let on_disk = std::fs::read(path)
            .map_err(|e| e.to_string())
            .and_then(|b| {
                serde_json::from_slice::<serde_json::Value>(&b).map_err(|e| e.to_string())
            });
        let check = match on_disk {
            Err(e) => warn(
                "cdi",
                format!("{} cannot be read as JSON: {e}", path.display()),
                regenerate,
            ),
            Ok(have) if have == want => ok(
                "cdi",
                format!(
                    "{} is current: {} devices of {}",
                    path.display(),
                    crate::cdi::names(&want).len(),
                    crate::request::CDI_KIND
                ),
            ),
            Ok(have) => {
                let (h, w) = (crate::cdi::names(&have), crate::cdi::names(&want));
                let gone: Vec<&str> = h.iter().filter(|n| !w.contains(n)).copied().collect();
                let new: Vec<&str> = w.iter().filter(|n| !h.contains(n)).copied().collect();
                let why = if gone.is_empty() && new.is_empty() {
                    "the same devices, but other hooks, version or order (another gpushare binary or config?)".to_owned()
                } else {
                    format!(
                        "devices no longer on this node: [{}]; devices missing from it: [{}]",
                        gone.join(", "),
                        new.join(", ")
                    )
                };
                warn(
                    "cdi",
                    format!(
                        "{} is out of date with the inventory and config: {why}",
                        path.display()
                    ),
                    regenerate,
                )
            }
        };
        out.push(check);
    }
}

/// The low-level runtime resolves, and not to gpushare-runtime: the shim would exec
/// itself and every create would fail (the shim refuses to; here it is caught before).
fn low_level_runtime_check(cfg: &Config) -> Check {
    use std::os::unix::fs::MetadataExt;
    let shim = std::env::current_exe()
        .ok()
        .map(|p| p.with_file_name("gpushare-runtime"))
        .and_then(|p| std::fs::metadata(p).ok());
    match crate::lowlevel::resolve(&cfg.low_level_runtime) {
        Ok(p) => {
            let is_shim = p.file_name().is_some_and(|n| n == "gpushare-runtime")
                || std::fs::metadata(&p)
                    .ok()
                    .zip(shim)
                    .is_some_and(|(a, b)| a.dev() == b.dev() && a.ino() == b.ino());
            if is_shim {
                fail(
                    "low-level-runtime",
                    format!(
                        "{} is gpushare-runtime itself: every create would fail",
                        p.display()
                    ),
                    "point low-level-runtime at runc, crun or nvidia-container-runtime",
                )
            } else if let Some(missing) =
                crate::lowlevel::missing_nvidia(&cfg.low_level_runtime, &p)
            {
                warn(
                    "low-level-runtime",
                    format!(
                        "{missing}, the first choice, is not found (on PATH or at that path): {} runs the containers, which get gpushare's MPS pipe directory but no GPU device nodes or driver libraries from NVIDIA's toolkit",
                        p.display()
                    ),
                    "name NVIDIA's runtime by its absolute path in low-level-runtime (the GPU Operator's: /usr/local/nvidia/toolkit/nvidia-container-runtime), or install the NVIDIA Container Toolkit",
                )
            } else {
                ok("low-level-runtime", format!("{}", p.display()))
            }
        }
        Err(e) => fail(
            "low-level-runtime",
            e.to_string(),
            "install runc (apt-get install runc) or fix low-level-runtime",
        ),
    }
}

/// The report for a config that does not load: one FAIL line (exit 2).
pub(crate) fn config_failure(error: &str) -> Check {
    fail(
        "config",
        error.to_owned(),
        format!(
            "fix the file (config/runtime.toml documents every key), or unset {}",
            crate::config::ENV_VAR
        ),
    )
}

/// Prints the checks; returns the exit code (0 ok, 1 warn, 2 fail).
pub(crate) fn report(checks: &[Check]) -> (String, i32) {
    let mut text = String::new();
    for c in checks {
        let tag = match c.level {
            Level::Ok => "ok  ",
            Level::Warn => "warn",
            Level::Fail => "FAIL",
        };
        text.push_str(&format!("{tag}  {:<18} {}\n", c.name, c.detail));
        if let Some(fix) = &c.fix {
            text.push_str(&format!("      {:<18} fix: {fix}\n", ""));
        }
    }
    let worst = checks.iter().map(|c| c.level).max().unwrap_or(Level::Ok);
    (text, worst as i32)
}

#[cfg(test)]
mod tests {
    /// The agent or the NRI plugin on a replaced binary is a warning naming it; a
    /// supervisor on one is told, not warned: it keeps its binary until its daemon idles.
    #[test]
    fn processes_on_a_replaced_binary_are_named_by_role() {
        use super::{replaced_binary_check, Level, Replaced};
        let p = |pid, args: &[&str]| Replaced {
            pid,
            argv: args.iter().map(|a| a.to_string()).collect(),
        };
        let check = replaced_binary_check(&[]);
        assert!(matches!(check.level, Level::Ok), "{check:?}");
        let supervisor = p(7, &["gpushare", "daemon", "supervise", "abc"]);
        let check = replaced_binary_check(std::slice::from_ref(&supervisor));
        assert!(matches!(check.level, Level::Ok), "{check:?}");
        assert!(check.detail.contains("pid 7") && check.detail.contains("idles out"));
        let check = replaced_binary_check(&[
            p(3, &["/usr/bin/gpushare", "agent"]),
            p(4, &["gpushare", "nri"]),
            supervisor,
        ]);
        assert!(matches!(check.level, Level::Warn), "{check:?}");
        assert!(
            check
                .detail
                .starts_with("the agent (pid 3) and the NRI plugin (pid 4) still run")
                && check.detail.contains("pid 7"),
            "{check:?}"
        );
    }

    use super::*;

    /// The engines' configs and sockets under `dir`.
    struct At {
        docker: PathBuf,
        containerd: PathBuf,
        paths: Paths,
    }

    /// Paths under `dir`; a socket is "served" when `bind` made it a real socket.
    fn paths(dir: &Path, docker_served: bool, containerd_served: bool) -> At {
        let mut paths = Paths {
            cdi_specs: vec![],
            ..Paths::default()
        };
        for (name, config, served) in [
            ("docker", "daemon.json", docker_served),
            ("containerd", "config.toml", containerd_served),
        ] {
            let at = paths.engine_mut(name).unwrap();
            at.config = dir.join(config);
            at.socket = dir.join(format!("{name}.sock"));
            if served {
                std::os::unix::net::UnixListener::bind(&at.socket).unwrap();
            }
        }
        At {
            docker: dir.join("daemon.json"),
            containerd: dir.join("config.toml"),
            paths,
        }
    }

    fn check(at: &At, name: &str) -> Check {
        let engine = at.paths.engines.iter().find(|e| e.engine.name() == name);
        engine_check(engine.unwrap())
    }
    fn docker_check(at: &At) -> Check {
        check(at, "docker")
    }
    fn containerd_check(at: &At) -> Check {
        check(at, "containerd")
    }

    #[test]
    fn a_cdi_spec_on_disk_is_compared_with_the_one_generated_now() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = crate::config::parse(
            "[cdi.profiles.small]\nactive-thread-percentage = 25\n",
            None,
        )
        .unwrap();
        let inv = crate::device::sample();
        let path = dir.path().join("gpushare.json");
        let check = |specs: &[PathBuf]| {
            let mut out = Vec::new();
            cdi_checks(&cfg, Some(&inv), specs, &mut out);
            assert_eq!(out.len(), 1);
            out.remove(0)
        };
        let none = check(std::slice::from_ref(&path));
        assert_eq!(
            (none.level, none.detail.as_str()),
            (
                Level::Ok,
                "no CDI spec of gpushare's (CDI devices are not offered)"
            )
        );
        let spec = crate::cdi::for_node(&cfg, &inv).unwrap();
        std::fs::write(&path, crate::cdi::to_bytes(&spec)).unwrap();
        let current = check(std::slice::from_ref(&path));
        assert_eq!(current.level, Level::Ok, "{}", current.detail);
        assert!(
            current
                .detail
                .ends_with("is current: 20 devices of gpushare.io/gpu"),
            "{}",
            current.detail
        );
        // GPU 2 gone from the node (a spec written before), a profile removed since.
        let mut fewer = inv.clone();
        fewer.gpus.pop();
        let old = crate::cdi::for_node(&cfg, &fewer).unwrap();
        std::fs::write(&path, crate::cdi::to_bytes(&old)).unwrap();
        let stale = check(std::slice::from_ref(&path));
        assert_eq!(stale.level, Level::Warn);
        assert!(stale.detail.contains("devices no longer on this node: []; devices missing from it: [2, 2-small, GPU-7b2c3d4e-5f60-4182-93a4-b5c6d7e8f901, GPU-7b2c3d4e-5f60-4182-93a4-b5c6d7e8f901-small]"), "{}", stale.detail);
        assert_eq!(
            stale.fix.unwrap(),
            format!("run `gpushare cdi generate --output {}`", path.display())
        );
        let mut other_hooks = spec.clone();
        other_hooks["devices"][0]["containerEdits"]["hooks"][0]["path"] = "/opt/gpushare".into();
        std::fs::write(&path, crate::cdi::to_bytes(&other_hooks)).unwrap();
        assert!(check(std::slice::from_ref(&path))
            .detail
            .contains("the same devices, but other hooks"));
    }

    #[test]
    fn docker_is_ok_when_absent_or_registered_and_a_warning_when_it_runs_without_us() {
        let dir = tempfile::tempdir().unwrap();
        let absent = docker_check(&paths(dir.path(), false, false));
        assert_eq!(absent.level, Level::Ok, "{}", absent.detail);
        assert!(
            absent.detail.contains("does not run here"),
            "{}",
            absent.detail
        );

        let dir = tempfile::tempdir().unwrap();
        let p = paths(dir.path(), true, false);
        let missing = docker_check(&p);
        assert_eq!(missing.level, Level::Warn, "{}", missing.detail);
        std::fs::write(&p.docker, r#"{"runtimes": {"nvidia": {"path": "x"}}}"#).unwrap();
        let other = docker_check(&p);
        assert_eq!(other.level, Level::Warn);
        assert!(other.detail.contains("does not register runtime gpushare"));
        std::fs::write(
            &p.docker,
            r#"{"runtimes": {"gpushare": {"path": "/usr/bin/gpushare-runtime"}}}"#,
        )
        .unwrap();
        let ours = docker_check(&p);
        assert_eq!(ours.level, Level::Ok);
        assert!(
            ours.detail.ends_with("at /usr/bin/gpushare-runtime"),
            "{}",
            ours.detail
        );
    }

    #[test]
    fn containerd_is_a_warning_only_where_it_serves_kubernetes_without_us() {
        let dir = tempfile::tempdir().unwrap();
        let p = paths(dir.path(), false, true);
        std::fs::write(&p.containerd, "version = 2\n").unwrap();
        let unconfigured = containerd_check(&p);
        assert_eq!(unconfigured.level, Level::Warn, "{}", unconfigured.detail);
        // Docker's own containerd: the CRI plugin is disabled, nothing for Kubernetes.
        std::fs::write(&p.containerd, "disabled_plugins = [\"cri\"]\n").unwrap();
        let dockers = containerd_check(&p);
        assert_eq!(dockers.level, Level::Ok, "{}", dockers.detail);
        assert!(dockers.detail.contains("CRI plugin is disabled"));
        for plugin in ["io.containerd.grpc.v1.cri", "io.containerd.cri.v1.runtime"] {
            std::fs::write(
                &p.containerd,
                format!(
                    "[plugins.\"{plugin}\".containerd.runtimes.gpushare.options]\nBinaryName = \"/usr/bin/gpushare-runtime\"\n"
                ),
            )
            .unwrap();
            let ours = containerd_check(&p);
            assert_eq!(ours.level, Level::Ok, "{plugin}: {}", ours.detail);
            assert!(ours.detail.contains("BinaryName /usr/bin/gpushare-runtime"));
            std::fs::write(
                &p.containerd,
                format!(
                    "[plugins.\"{plugin}\".containerd.runtimes.gpushare]\nbase_runtime_spec = \"/etc/containerd/gpushare-base-spec.json\"\n"
                ),
            )
            .unwrap();
            let hooks = containerd_check(&p);
            assert_eq!(hooks.level, Level::Ok, "{plugin}: {}", hooks.detail);
            assert!(
                hooks.detail.contains(
                    "hook-only, base_runtime_spec /etc/containerd/gpushare-base-spec.json"
                ),
                "{}",
                hooks.detail
            );
        }
    }

    #[test]
    fn containerd_is_looked_for_at_the_socket_its_config_names() {
        let dir = tempfile::tempdir().unwrap();
        // Nothing at the default socket; the file's containerd listens elsewhere.
        let p = paths(dir.path(), false, false);
        let other = dir.path().join("private").join("c.sock");
        std::fs::create_dir_all(other.parent().unwrap()).unwrap();
        let _listener = std::os::unix::net::UnixListener::bind(&other).unwrap();
        std::fs::write(
            &p.containerd,
            format!(
                "version = 2\n[grpc]\n  address = {:?}\n",
                other.display().to_string()
            ),
        )
        .unwrap();
        let check = containerd_check(&p);
        assert_eq!(check.level, Level::Warn, "{}", check.detail);
        assert_eq!(
            check.detail,
            format!("{} has no gpushare runtime", p.containerd.display())
        );
        // The same file with the address's containerd gone: nothing runs it.
        std::fs::write(
            &p.containerd,
            format!(
                "version = 2\n[grpc]\n  address = \"unix://{}\"\n",
                dir.path().join("gone.sock").display()
            ),
        )
        .unwrap();
        let check = containerd_check(&p);
        assert_eq!(check.level, Level::Ok, "{}", check.detail);
        assert!(
            check.detail.contains(&format!(
                "containerd does not run (no {})",
                dir.path().join("gone.sock").display()
            )),
            "{}",
            check.detail
        );
    }

    /// The backend line: what `mps.protocol` decides on this node and why; the control
    /// binary is asked only where its answer decides.
    #[test]
    fn the_protocol_line_says_which_backend_and_why() {
        use super::{protocol_check, Level};
        use crate::config::Protocol;
        let never = || -> Result<Option<bool>, String> { panic!("not asked") };
        let line = |c: super::Check| (c.level, c.detail);
        let (c, v3) = protocol_check(Protocol::Legacy, Some("615.71.09"), never);
        assert_eq!(
            (line(c), v3),
            ((Level::Ok, "protocol = legacy".into()), false)
        );
        let (c, v3) = protocol_check(Protocol::Auto, Some("580.159.04"), never);
        assert_eq!(
            (line(c), v3),
            (
                (
                    Level::Ok,
                    "auto → legacy (driver 580.159.04 is before 615)".into()
                ),
                false
            )
        );
        let (c, v3) = protocol_check(Protocol::Auto, Some("615.71.09"), || Ok(Some(true)));
        assert!(v3);
        assert_eq!(c.level, Level::Ok);
        assert!(
            c.detail
                .starts_with("auto → v3 (driver 615.71.09, the control binary speaks protocol 3)"),
            "{}",
            c.detail
        );
        let (c, v3) = protocol_check(Protocol::Auto, Some("615.71.09"), || Ok(Some(false)));
        assert!(!v3);
        assert_eq!(c.level, Level::Warn);
        assert!(
            c.detail.starts_with(
                "auto → legacy (driver 615.71.09, but the control binary does not speak protocol 3"
            ),
            "{}",
            c.detail
        );
        let (c, v3) = protocol_check(Protocol::Auto, Some("615.71.09"), || Ok(None));
        assert_eq!((c.level, v3), (Level::Warn, false));
        let (c, v3) = protocol_check(Protocol::V3, Some("580.159.04"), || Ok(Some(true)));
        assert_eq!((c.level, v3), (Level::Ok, true));
        assert!(
            c.detail.starts_with("protocol = v3 (driver 580.159.04"),
            "{}",
            c.detail
        );
        let (c, v3) = protocol_check(Protocol::V3, Some("615.71.09"), || Ok(Some(false)));
        assert_eq!((c.level, v3), (Level::Fail, true));
        let (c, _) = protocol_check(Protocol::V3, None, || Err("no binary".into()));
        assert_eq!(c.level, Level::Fail);
        assert!(c.detail.contains("no binary"), "{}", c.detail);
    }

    /// `cgroup-memory-limit` on a v3 node: available only with cgroup v2 and an NVIDIA
    /// region in dmem.capacity; `on` without them fails every create, `auto` warns.
    #[test]
    fn the_memory_limit_line_names_what_is_missing() {
        use super::{memory_limit_check, Level};
        use crate::config::CgroupMemoryLimit::{Auto, Off, On};
        assert_eq!(memory_limit_check(Auto, true, true).level, Level::Ok);
        assert_eq!(memory_limit_check(On, true, true).level, Level::Ok);
        assert_eq!(memory_limit_check(Off, false, false).level, Level::Ok);
        let c = memory_limit_check(Auto, false, true);
        assert_eq!(c.level, Level::Warn);
        assert!(
            c.detail.contains("/sys/fs/cgroup is not cgroup v2"),
            "{}",
            c.detail
        );
        let c = memory_limit_check(On, true, false);
        assert_eq!(c.level, Level::Fail);
        assert!(
            c.detail.contains("dmem.capacity lists no nvidia/ region"),
            "{}",
            c.detail
        );
    }

    /// The socket-path budget: a v3 namespace's socket is 24 bytes longer than a daemon's
    /// `control`, so a state-dir that fits legacy can be too long for v3.
    #[test]
    fn the_socket_path_budget_counts_a_v3_namespace_s_socket() {
        use super::{socket_path_check, Level};
        use std::path::Path;
        let short = socket_path_check(Path::new("/run/gpushare"), true);
        assert_eq!(short.level, Level::Ok);
        assert_eq!(
            short.detail,
            "MPS control socket paths are 63 bytes, a v3 namespace's 87 (< 108)"
        );
        assert_eq!(
            socket_path_check(Path::new("/run/gpushare"), false).detail,
            "MPS control socket paths are 63 bytes (< 108)"
        );
        // 33 bytes: the longest state-dir a v3 namespace's socket fits under.
        let edge = format!("/{}", "d".repeat(32));
        assert_eq!(socket_path_check(Path::new(&edge), true).level, Level::Ok);
        let long = format!("/{}", "d".repeat(33));
        assert_eq!(socket_path_check(Path::new(&long), false).level, Level::Ok);
        let c = socket_path_check(Path::new(&long), true);
        assert_eq!(c.level, Level::Fail);
        assert!(
            c.detail
                .contains("/pipe/s/c<20 hex>/control (a v3 namespace's) is 108 bytes"),
            "{}",
            c.detail
        );
        assert_eq!(
            c.fix.as_deref(),
            Some("set state-dir to a path of at most 33 bytes, like /run/gpushare")
        );
    }

    #[test]
    fn the_state_dir_space_check_names_what_stops_a_create() {
        let space = |read_only, bytes_free, files_total, files_free| Space {
            read_only,
            bytes_free,
            files_total,
            files_free,
        };
        let cases = [
            (space(false, 64 << 20, 1000, 10), None),
            (space(false, 64 << 20, 0, 0), None),
            (
                space(true, 64 << 20, 1000, 10),
                Some("is on a read-only file system"),
            ),
            (
                space(false, 4096, 1000, 10),
                Some("has less than 1 MiB free"),
            ),
            (space(false, 64 << 20, 1000, 0), Some("has no free inodes")),
        ];
        for (s, want) in cases {
            assert_eq!(s.problem(), want);
        }
    }
}
