//! The processes of one fault run, found in /proc: which of gpushare's processes (and the
//! control daemons it supervises) belong to this run's state directory, what each is
//! doing, and the SIGKILL that checks it is still the process it found.
//!
//! Invariants: only processes of this run are ever named (their environment carries this
//! run's `GPUSHARE_CONFIG`, or their pipe directory is under this run's state dir); a
//! process is killed only if its pid still has the start time it was found with, so a
//! reused pid is never hit.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use gpushare::util::proc_start_time as start_time;
use testkit::other_processes;

/// What a process of the run is: the kill targets, by the part of gpushare they are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    /// `gpushare-runtime create`, before it execs the low-level runtime.
    Shim,
    /// The shim's process after its exec: `runc create` (the createRuntime hook runs in it).
    ShimRuncCreate,
    CreateRuntimeHook,
    PoststopHook,
    Supervisor,
    ControlDaemon,
    DaemonStart,
    DaemonStop,
    Gc,
}

impl Kind {
    pub const ALL: [Kind; 9] = [
        Kind::Shim,
        Kind::ShimRuncCreate,
        Kind::CreateRuntimeHook,
        Kind::PoststopHook,
        Kind::Supervisor,
        Kind::ControlDaemon,
        Kind::DaemonStart,
        Kind::DaemonStop,
        Kind::Gc,
    ];

    /// Lives for one operation (not the supervisor or its daemon, which stay).
    pub fn brief(self) -> bool {
        !matches!(self, Kind::Supervisor | Kind::ControlDaemon)
    }

    pub fn name(self) -> &'static str {
        match self {
            Kind::Shim => "shim (gpushare-runtime create)",
            Kind::ShimRuncCreate => "shim exec'd as runc create",
            Kind::CreateRuntimeHook => "createRuntime hook",
            Kind::PoststopHook => "poststop hook",
            Kind::Supervisor => "supervisor",
            Kind::ControlDaemon => "control daemon",
            Kind::DaemonStart => "gpushare daemon start",
            Kind::DaemonStop => "gpushare daemon stop",
            Kind::Gc => "gpushare gc",
        }
    }
}

/// One process of the run, as found.
#[derive(Debug, Clone)]
pub struct Proc {
    pub pid: i32,
    pub start: u64,
    pub ppid: i32,
    pub kind: Kind,
    /// The daemon id it works for, when its command line or environment says.
    pub daemon: Option<String>,
    /// Its working directory (the tier runs the shim, and so runc and its hooks, in the
    /// container's bundle).
    pub cwd: Option<PathBuf>,
    pub args: Vec<String>,
}

fn read_nul(path: &Path) -> Vec<String> {
    std::fs::read(path)
        .unwrap_or_default()
        .split(|&b| b == 0)
        .filter(|s| !s.is_empty())
        .map(|s| String::from_utf8_lossy(s).into_owned())
        .collect()
}

/// The parent pid and the state letter of `pid` (field 4 and 3 of /proc/<pid>/stat).
pub fn ppid_state(pid: i32) -> Option<(i32, char)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 2..];
    let mut f = rest.split(' ');
    let state = f.next()?.chars().next()?;
    let ppid = f.next()?.parse().ok()?;
    Some((ppid, state))
}

/// Every live process of the run (zombies excluded): `config` is the run's
/// `GPUSHARE_CONFIG`, `state` its state dir.
pub fn scan(config: &Path, state: &Path) -> Vec<Proc> {
    let want_cfg = format!("GPUSHARE_CONFIG={}", config.display());
    let mps = state.join("mps");
    let mut out = Vec::new();
    for (pid, dir) in other_processes() {
        let args = read_nul(&dir.join("cmdline"));
        let Some(argv0) = args.first() else { continue };
        let base = Path::new(argv0)
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if !matches!(
            base.as_str(),
            "gpushare" | "gpushare-runtime" | "runc" | "gpushare-mps-sim"
        ) {
            continue;
        }
        let environ = read_nul(&dir.join("environ"));
        let ours = environ.contains(&want_cfg);
        let pipe = environ
            .iter()
            .find_map(|v| v.strip_prefix("CUDA_MPS_PIPE_DIRECTORY="))
            .map(PathBuf::from);
        let has = |a: &str| args.iter().any(|x| x == a);
        let (kind, daemon) = match base.as_str() {
            "gpushare-runtime" if ours && has("create") => (Kind::Shim, None),
            "runc" if ours && has("create") => (Kind::ShimRuncCreate, None),
            "gpushare" if ours && has("hook") && has("create-runtime") => {
                (Kind::CreateRuntimeHook, None)
            }
            "gpushare" if ours && has("hook") && has("poststop") => (Kind::PoststopHook, None),
            "gpushare" if ours && has("supervise") => (Kind::Supervisor, arg_after(&args, "--id")),
            "gpushare" if ours && has("daemon") && has("start") => (Kind::DaemonStart, None),
            "gpushare" if ours && has("daemon") && has("stop") => {
                (Kind::DaemonStop, arg_after(&args, "--id"))
            }
            "gpushare" if ours && has("gc") => (Kind::Gc, None),
            // The control daemon (`-f`), not the short-lived control clients the
            // supervisor runs, nor the servers it forks.
            "gpushare-mps-sim" if has("-f") => match pipe.as_deref().and_then(|p| {
                p.strip_prefix(&mps)
                    .ok()
                    .and_then(|r| r.components().next())
                    .map(|c| c.as_os_str().to_string_lossy().into_owned())
            }) {
                Some(id) => (Kind::ControlDaemon, Some(id)),
                None => continue,
            },
            _ => continue,
        };
        let Some((ppid, st)) = ppid_state(pid) else {
            continue;
        };
        if st == 'Z' || st == 'X' {
            continue;
        }
        let Some(start) = start_time(pid) else {
            continue;
        };
        out.push(Proc {
            pid,
            start,
            ppid,
            kind,
            daemon,
            cwd: std::fs::read_link(dir.join("cwd")).ok(),
            args,
        });
    }
    out
}

fn arg_after(args: &[String], flag: &str) -> Option<String> {
    let i = args.iter().position(|a| a == flag)?;
    args.get(i + 1).cloned()
}

/// SIGKILL to `p` if its pid still names it; whether the signal went.
pub fn kill(p: &Proc) -> bool {
    if start_time(p.pid) != Some(p.start) {
        return false;
    }
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(p.pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .is_ok()
}

/// The control daemons that run under a live supervisor, by daemon id: two under one id
/// is two daemons for one identity. A daemon whose supervisor is gone or exiting is
/// dying (its parent-death signal is SIGKILL) and is not counted.
pub fn supervised_daemons(procs: &[Proc]) -> BTreeMap<String, Vec<i32>> {
    let mut out: BTreeMap<String, Vec<i32>> = BTreeMap::new();
    for d in procs.iter().filter(|p| p.kind == Kind::ControlDaemon) {
        let parent_runs = procs
            .iter()
            .any(|s| s.kind == Kind::Supervisor && s.pid == d.ppid)
            && ppid_state(d.ppid).is_some_and(|(_, st)| st != 'Z' && st != 'X');
        if let (true, Some(id)) = (parent_runs, &d.daemon) {
            out.entry(id.clone()).or_default().push(d.pid);
        }
    }
    out.retain(|_, pids| pids.len() > 1);
    out
}
