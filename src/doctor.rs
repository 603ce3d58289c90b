//! `gpushare doctor`: is this node ready to share GPUs? Each check says ok, warn or fail,
//! with one line of evidence and, when not ok, one line saying how to fix it. The exit
//! code is the worst result: 0 ok, 1 warn, 2 fail. Works on a machine without a GPU and
//! says so. Reads only: it changes nothing.

use std::path::{Path, PathBuf};

use crate::config::{Config, UserMode};
use crate::device::{ComputeMode, Inventory, InventorySource};

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Ok,
    Warn,
    Fail,
}

#[derive(Debug)]
pub struct Check {
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
pub struct Paths {
    pub docker: PathBuf,
    pub containerd: PathBuf,
}

impl Default for Paths {
    fn default() -> Self {
        Paths {
            docker: "/etc/docker/daemon.json".into(),
            containerd: "/etc/containerd/config.toml".into(),
        }
    }
}

fn inventory_checks(cfg: &Config, out: &mut Vec<Check>) -> Option<Inventory> {
    let nvml = crate::device::load(&InventorySource::Nvml);
    match (&cfg.inventory[..], &nvml) {
        ("nvml", Ok(inv)) => out.push(ok("driver", format!("NVML answers: driver {}, {} GPU(s)", inv.driver_version, inv.gpus.len()))),
        ("nvml", Err(e)) => out.push(fail(
            "driver",
            format!("{e:#}"),
            "install and load the NVIDIA driver (nvidia-smi must work), or set inventory = \"file:<path>\" on a machine without a GPU",
        )),
        (_, Ok(inv)) => out.push(ok("driver", format!("NVML answers (driver {}), but inventory = {:?} is used", inv.driver_version, cfg.inventory))),
        (_, Err(_)) => out.push(ok("driver", format!("no NVIDIA driver on this machine; inventory = {:?} stands in for it (test mode)", cfg.inventory))),
    }
    match InventorySource::parse(&cfg.inventory).and_then(|s| crate::device::load(&s)) {
        Ok(inv) => Some(inv),
        Err(e) => {
            if cfg.inventory != "nvml" {
                out.push(fail(
                    "inventory",
                    format!("{e:#}"),
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

fn control_binary_check(cfg: &Config) -> Check {
    match crate::mps::control::resolve_binary(&cfg.mps.control_binary) {
        Ok(path) if path.is_file() => {
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
        Ok(path) => fail(
            "mps-control",
            format!("{} does not exist", path.display()),
            "install the NVIDIA driver's nvidia-cuda-mps-control, or point mps.control-binary at it",
        ),
        Err(e) => fail("mps-control", e.to_string(), "install nvidia-cuda-mps-control (NVIDIA driver utilities) or set mps.control-binary to its absolute path"),
    }
}

fn state_dir_checks(cfg: &Config, out: &mut Vec<Check>) {
    use std::os::unix::fs::MetadataExt;
    let dir = &cfg.state_dir;
    // Every daemon id has the same length, so one stands for all.
    let socket = dir
        .join("mps")
        .join("0".repeat(crate::identity::ID_LEN))
        .join("pipe/control");
    let len = socket.as_os_str().len();
    if len >= 108 {
        out.push(fail(
            "socket-path",
            format!("{}/mps/<id>/pipe/control is {len} bytes; a Unix socket path must be shorter than 108", dir.display()),
            format!("set state-dir to a path of at most {} bytes, like /run/gpushare", dir.as_os_str().len() - (len - 107)),
        ));
    } else {
        out.push(ok(
            "socket-path",
            format!("MPS control socket paths are {len} bytes (< 108)"),
        ));
    }
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

fn host_pipe_check() -> Check {
    let p = Path::new(crate::runtime::NVIDIA_HOST_PIPE_DIR);
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

fn engine_checks(paths: &Paths, out: &mut Vec<Check>) {
    match std::fs::read_to_string(&paths.docker) {
        Err(_) => out.push(warn(
            "docker",
            format!("{} not found", paths.docker.display()),
            "if Docker runs here: sudo gpushare install docker",
        )),
        Ok(text) => {
            let has = serde_json::from_str::<serde_json::Value>(&text)
                .ok()
                .and_then(|v| {
                    v["runtimes"]["gpushare"]["path"]
                        .as_str()
                        .map(str::to_owned)
                });
            match has {
                Some(path) => out.push(ok(
                    "docker",
                    format!(
                        "{} registers runtime gpushare at {path}",
                        paths.docker.display()
                    ),
                )),
                None => out.push(warn(
                    "docker",
                    format!(
                        "{} does not register runtime gpushare",
                        paths.docker.display()
                    ),
                    "sudo gpushare install docker, then reload dockerd (SIGHUP)",
                )),
            }
        }
    }
    match std::fs::read_to_string(&paths.containerd) {
        Err(_) => out.push(warn(
            "containerd",
            format!("{} not found", paths.containerd.display()),
            "if containerd runs here: sudo gpushare install containerd",
        )),
        Ok(text) => {
            let v: Option<toml::Table> = toml::from_str(&text).ok();
            let found = v.as_ref().and_then(|v| {
                ["io.containerd.grpc.v1.cri", "io.containerd.cri.v1.runtime"]
                    .iter()
                    .find_map(|p| {
                        v.get("plugins")?
                            .get(p)?
                            .get("containerd")?
                            .get("runtimes")?
                            .get("gpushare")?
                            .get("options")?
                            .get("BinaryName")?
                            .as_str()
                            .map(str::to_owned)
                    })
            });
            match found {
                Some(bin) => out.push(ok(
                    "containerd",
                    format!(
                        "{} has runtime gpushare (BinaryName {bin})",
                        paths.containerd.display()
                    ),
                )),
                None => out.push(warn(
                    "containerd",
                    format!("{} has no gpushare runtime", paths.containerd.display()),
                    "sudo gpushare install containerd, then restart containerd",
                )),
            }
        }
    }
}

/// Runs every check.
pub fn run(cfg: &Config, paths: &Paths) -> Vec<Check> {
    let mut out = vec![ok(
        "config",
        cfg.path.as_ref().map_or_else(
            || "no config file: built-in defaults".to_owned(),
            |p| format!("{} parses", p.display()),
        ),
    )];
    if let Some(inv) = inventory_checks(cfg, &mut out) {
        gpu_checks(cfg, &inv, &mut out);
    }
    out.push(control_binary_check(cfg));
    state_dir_checks(cfg, &mut out);
    out.push(host_pipe_check());
    engine_checks(paths, &mut out);
    out.push(
        match crate::runtime::lowlevel::resolve(&cfg.low_level_runtime) {
            Ok(p) => ok("low-level-runtime", format!("{}", p.display())),
            Err(e) => fail(
                "low-level-runtime",
                e.to_string(),
                "install runc (apt-get install runc) or fix low-level-runtime",
            ),
        },
    );
    out
}

/// Prints the checks; returns the exit code (0 ok, 1 warn, 2 fail).
pub fn report(checks: &[Check]) -> (String, i32) {
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
