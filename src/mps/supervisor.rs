//! The supervisor: one detached process per MPS control daemon.
//!
//! Started by the hook as `gpushare daemon supervise --id <id>` with stdio on /dev/null and
//! an explicit environment. It leaves the hook's session, closes every inherited fd, joins
//! its own cgroup `gpushare/<id>-<pid>` (memory and pids limits for itself, its daemon and the
//! daemon's servers), enters a private mount namespace in which the daemon's shm tmpfs is
//! `/dev/shm`, and runs `<control-binary> -f` as the daemon's UID and gpushare's GID (no
//! supplementary groups, no capabilities) — or as root with the multi-user flag.
//!
//! Everything a tenant can write is hostile here (issue 18):
//! - the daemon runs in a mount namespace of its own where the whole host is read-only,
//!   nosuid and nodev, except its pipe and log directories, its /dev/shm, the GPU's
//!   device nodes and /proc (the real MPS server writes there at start; /proc/sys and
//!   the other host-wide parts stay read-only, `sys::PROC_READONLY`): a link planted where
//!   it writes cannot make it write a host file or open a host device;
//! - the supervisor (root) writes the daemon's output to `daemon.out` in the root-owned
//!   daemon directory, and touches the log directory only through a directory fd, with
//!   `O_NOFOLLOW`, to rotate logs past a quarter of `mps.log-size`;
//! - limits are applied with control commands before the record says `ready`, again
//!   after every restart (MPS forgets `set_default_*` when the daemon quits), and checked
//!   every `mps.limit-check-interval`: a tenant that raised them through its control
//!   socket finds them set back, the defaults and each running server's. The check fails
//!   closed: each check has one deadline (`CHECK_DEADLINE`) for all its commands, and a
//!   daemon that cannot confirm its limits in `UNCONFIRMED_CHECKS` checks in a row is
//!   killed with its servers, without being asked, and restarted with its limits (in its
//!   environment from its first instant): no stall of the control socket holds the
//!   supervisor or keeps a raised limit.
//!
//! A daemon that dies is restarted with exponential backoff; SIGTERM quits it cleanly.
//! A supervisor whose record is gone (its state directory deleted, as a host reboot
//! wipes /run, or by hand) quits its daemon and exits: nothing runs that no record names
//! and that `status`, `gc` and `daemon stop` cannot see (issue 15).
//! Invariants: the record's `daemon` is the live process or `None`; one supervisor per
//! identity: each holds `locks/<id>.sup` from before it names itself in the record until
//! it exits (`claim`), so one started for a create killed before its supervisor named
//! itself never runs a daemon beside the next create's (issue 15).

use std::io::Read;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::signal::{SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};

use super::control::{resolve_binary, Control, SAFE_PATH};
use super::reply::{self, percentage as parse_percentage, pinned_mem as parse_mps_mem};
use crate::config::Config;
use crate::identity::Identity;
use crate::state::{DaemonStatus, ProcRef, StateDir};
use crate::util::{poll_until, unix_now};

/// How long a quit may take before the daemon is killed.
const QUIT_GRACE: Duration = Duration::from_secs(5);
const BACKOFF_FIRST: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(10);
/// A daemon that ran this long resets the backoff.
const STABLE_AFTER: Duration = Duration::from_secs(60);
/// The longest one limit check may take, all its control commands together: a daemon
/// that has not answered by then has not confirmed its limits.
pub(crate) const CHECK_DEADLINE: Duration = Duration::from_secs(2);
/// Limit checks in a row that may fail to confirm the limits (no answer, an error, past
/// `CHECK_DEADLINE`) before the daemon is restarted with them: a tenant that raised them
/// and then keeps the daemon from answering (its control connections held with slow
/// partial lines) must not keep them raised.
pub(crate) const UNCONFIRMED_CHECKS: u32 = 2;

/// The commands that put a daemon's limits in place, in order (DESIGN §5, mps-facts §1.2).
/// Pinned memory is set per device by ordinal: the daemon sees only its own devices,
/// renumbered from 0 (CUDA_VISIBLE_DEVICES), and NVIDIA's device plugin found UUID-keyed
/// limits ignored by some drivers.
pub(crate) fn limit_commands(ident: &Identity) -> Vec<String> {
    set_limits(ident, None)
}

/// The commands that put the identity's limits on the daemon's defaults (`server` none:
/// `set_default_*`) or on one running server (`set_* <server>`), the same limits in the
/// same order either way.
fn set_limits(ident: &Identity, server: Option<u32>) -> Vec<String> {
    let (scope, target) = match server {
        None => ("default_", String::new()),
        Some(s) => ("", format!("{s} ")),
    };
    let mut cmds = Vec::new();
    if let Some(p) = ident.active_thread_percentage {
        cmds.push(format!("set_{scope}active_thread_percentage {target}{p}"));
    }
    if let Some(bytes) = ident.pinned_memory_limit {
        let size = crate::request::format_mps_size(bytes);
        for i in 0..ident.devices.len() {
            cmds.push(format!(
                "set_{scope}device_pinned_mem_limit {target}{i} {size}"
            ));
        }
    }
    cmds
}

/// The limits in the daemon's own environment, so that it has them from its first instant:
/// the control daemon takes `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` and
/// `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` (`<ordinal>=<size>,…`) as its defaults at start (MPS
/// guide, "Environment variables"), before any client can connect; the `set_default_*`
/// commands of `limit_commands` then set the same values again and are what the limit
/// check reads back.
fn limit_env(ident: &Identity) -> Vec<(&'static str, String)> {
    let mut env = Vec::new();
    if let Some(p) = ident.active_thread_percentage {
        env.push(("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", p.to_string()));
    }
    if let Some(bytes) = ident.pinned_memory_limit {
        let size = crate::request::format_mps_size(bytes);
        let each: Vec<String> = (0..ident.devices.len())
            .map(|i| format!("{i}={size}"))
            .collect();
        env.push(("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", each.join(",")));
    }
    env
}

/// Leaves the caller's session; closes every fd above stderr. Must run before the
/// supervisor opens anything of its own (its log file included).
pub(crate) fn detach() {
    let _ = nix::unistd::setsid();
    let fds: Vec<i32> = std::fs::read_dir("/proc/self/fd")
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    for fd in fds.into_iter().filter(|&fd| fd > 2) {
        let _ = nix::unistd::close(fd);
    }
}

/// The cgroup limits of one daemon's group (`mps.daemon-memory-max`, `mps.daemon-pids-max`;
/// 0: none).
#[derive(Debug, Clone, Copy)]
pub(crate) struct CgroupLimits {
    pub memory: u64,
    pub pids: u32,
}

/// The hierarchies to join: the unified one (cgroup v2) or every v1 hierarchy.
fn cgroup_hierarchies() -> Vec<PathBuf> {
    let root = Path::new("/sys/fs/cgroup");
    if root.join("cgroup.procs").exists() {
        return vec![root.to_owned()];
    }
    std::fs::read_dir(root)
        .map(|entries| {
            entries
                .flatten()
                .map(|e| e.path())
                .filter(|p| p.join("cgroup.procs").exists() && !p.is_symlink())
                .collect()
        })
        .unwrap_or_default()
}

/// Creates `dir` (a child of `parent`) as a cgroup ready for members. A new cgroup-v1
/// cpuset is empty and refuses members (ENOSPC): it gets its parent's CPUs and memory
/// nodes first. A v2 cpuset's empty `cpuset.cpus` means "the parent's", and the v2 root
/// has no `cpuset.cpus` to copy: on a host whose root enables the cpuset controller (the
/// GPU machine of docs/gpu-validation.md) copying failed with ENOENT and the daemon ran
/// without its cgroup.
fn make_cgroup(parent: &Path, dir: &Path, v2: bool) -> std::io::Result<()> {
    match std::fs::create_dir(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => return Err(e),
        _ => {}
    }
    if v2 {
        return Ok(());
    }
    for file in ["cpuset.cpus", "cpuset.mems"] {
        let own = dir.join(file);
        if own.exists() && std::fs::read_to_string(&own).is_ok_and(|v| v.trim().is_empty()) {
            std::fs::write(&own, std::fs::read_to_string(parent.join(file))?)?;
        }
    }
    Ok(())
}

/// Moves this process into `gpushare/<id>-<pid>` at the root of every hierarchy, so that
/// stopping the engine's or the shim's cgroup does not take the daemon with it, and so
/// that the supervisor, its daemon and the daemon's MPS servers share one memory and pids
/// limit outside any tenant's. Best effort: a host that refuses keeps the daemon where it
/// is, with a warning naming the hierarchy. Returns the cgroups joined.
fn own_cgroup(id: &str, limits: CgroupLimits) -> Vec<PathBuf> {
    let pid = std::process::id().to_string();
    let mut joined = Vec::new();
    for h in cgroup_hierarchies() {
        let top = h.join("gpushare");
        // Named by the supervisor too: two state dirs on one host (a node install beside
        // a test run) may hold daemons of one identity, and each needs its own cgroup.
        let dir = top.join(format!("{id}-{pid}"));
        let v2 = h.join("cgroup.controllers").exists();
        let moved = (|| -> std::io::Result<()> {
            make_cgroup(&h, &top, v2)?;
            sweep_stale_cgroups(&top);
            if v2 {
                // Controllers must be enabled top-down for the limit files to exist.
                for (cg, ctl) in [(&h, "+memory +pids"), (&top, "+memory +pids")] {
                    let _ = std::fs::write(cg.join("cgroup.subtree_control"), ctl);
                }
            }
            make_cgroup(&top, &dir, v2)?;
            let (mem_file, pids_file) = if v2 {
                ("memory.max", "pids.max")
            } else {
                ("memory.limit_in_bytes", "pids.max")
            };
            if limits.memory > 0 && dir.join(mem_file).exists() {
                std::fs::write(dir.join(mem_file), limits.memory.to_string())?;
            }
            if limits.pids > 0 && dir.join(pids_file).exists() {
                std::fs::write(dir.join(pids_file), limits.pids.to_string())?;
            }
            std::fs::write(dir.join("cgroup.procs"), &pid)
        })();
        match moved {
            Ok(()) => joined.push(dir),
            Err(e) => {
                tracing::warn!(cgroup = %dir.display(), error = %e, "cannot move the supervisor into its own cgroup")
            }
        }
    }
    if joined.is_empty() {
        tracing::warn!(daemon = %id, "the supervisor joined no cgroup of its own: its daemon shares the cgroup of whoever started it");
    }
    joined
}

/// Removes the empty cgroups `<top>/<id>-<pid>` whose supervisor is gone: a supervisor
/// killed with SIGKILL (the OOM killer, an engine tearing its namespace down, an
/// operator) never removes its own. Runs when a supervisor joins its cgroup and in
/// `gpushare gc`. A cgroup with members is never removed (the kernel refuses), nor one
/// whose pid runs (a reused pid only delays the removal; a zombie does not run). Returns
/// how many went.
pub(crate) fn sweep_stale_cgroups(top: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(top) else {
        return 0;
    };
    let mut removed = 0;
    for e in entries.flatten() {
        let name = e.file_name();
        let Some((id, pid)) = name.to_str().and_then(|n| n.rsplit_once('-')) else {
            continue;
        };
        let Ok(pid) = pid.parse::<u32>() else {
            continue;
        };
        // A zombie is gone: a supervisor SIGKILLed while its parent (the hook that
        // started it, a subreaper) has not reaped it yet runs nothing (issue 15).
        let running = i32::try_from(pid).is_ok_and(|p| crate::util::proc_start_time(p).is_some());
        if !crate::identity::valid_id(id) || running {
            continue;
        }
        if std::fs::remove_dir(e.path()).is_ok() {
            removed += 1;
        }
    }
    removed
}

/// Every hierarchy's `gpushare` cgroup directory (for `gc`).
pub(crate) fn gpushare_cgroups() -> Vec<PathBuf> {
    cgroup_hierarchies()
        .into_iter()
        .map(|h| h.join("gpushare"))
        .filter(|p| p.is_dir())
        .collect()
}

/// How long the supervisor's last step waits for the daemon's MPS servers (forked by the
/// daemon, in its cgroup) to be gone before it gives up removing the cgroup.
const CGROUP_DRAIN: Duration = Duration::from_secs(2);

/// Leaves the daemon's own cgroups (for `gpushare/`) and removes them; the supervisor's
/// last step. A cgroup is removable only once empty: servers still exiting are waited for
/// up to `CGROUP_DRAIN`; past it the cgroup is kept (an empty one goes with the next
/// supervisor of the identity, or at reboot).
fn leave_cgroups(joined: &[PathBuf]) {
    let pid = std::process::id().to_string();
    let deadline = Instant::now() + CGROUP_DRAIN;
    for dir in joined {
        if let Some(top) = dir.parent() {
            let _ = std::fs::write(top.join("cgroup.procs"), &pid);
            let every = Duration::from_millis(20);
            poll_until(deadline, every, every, || {
                (std::fs::remove_dir(dir).is_ok() || !dir.exists()).then_some(())
            });
        }
    }
}

/// A private mount namespace, slave to the host (host unmounts still reach it, so it
/// pins nothing), where the daemon's shm tmpfs is mounted over /dev/shm.
fn private_dev_shm(shm: &Path) -> anyhow::Result<()> {
    use nix::mount::{mount, MsFlags};
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS)
        .context("unshare the mount namespace")?;
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_SLAVE,
        None::<&str>,
    )
    .context("make / a slave mount")?;
    mount(
        Some(shm),
        "/dev/shm",
        None::<&str>,
        MsFlags::MS_BIND,
        None::<&str>,
    )
    .with_context(|| format!("bind {} over /dev/shm", shm.display()))?;
    Ok(())
}

/// Drops the capabilities a child could get. Per-user daemons then run with none — even
/// the daemon of a root container: setuid to a non-root UID clears the effective and
/// permitted sets, but `setuid(0)` clears nothing and exec gives root the bounding set, so
/// the bounding set is emptied too (the supervisor keeps its own effective set for its
/// own work). no_new_privs (sys::confine_child) keeps exec from granting any. Multi-user
/// daemons are root's by design and keep theirs.
fn drop_child_caps(multi_user: bool) -> anyhow::Result<()> {
    caps::clear(None, caps::CapSet::Ambient).context("clear ambient capabilities")?;
    caps::clear(None, caps::CapSet::Inheritable).context("clear inheritable capabilities")?;
    if !multi_user {
        caps::clear(None, caps::CapSet::Bounding).context("clear the capability bounding set")?;
    }
    Ok(())
}

/// The device nodes a daemon and its servers may open: the NVIDIA nodes
/// (`/dev/nvidia*`, `/dev/nvidia-caps/*`) and the harmless character devices every
/// process expects. Only character devices that exist are listed.
fn gpu_device_nodes() -> Vec<PathBuf> {
    use std::os::unix::fs::FileTypeExt;
    let is_char =
        |p: &Path| std::fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_char_device());
    let mut nodes: Vec<PathBuf> = ["null", "zero", "full", "random", "urandom"]
        .iter()
        .map(|n| Path::new("/dev").join(n))
        .collect();
    for dir in ["/dev", "/dev/nvidia-caps"] {
        if let Ok(entries) = std::fs::read_dir(dir) {
            nodes.extend(
                entries
                    .flatten()
                    .filter(|e| {
                        dir != "/dev" || e.file_name().to_string_lossy().starts_with("nvidia")
                    })
                    .map(|e| e.path()),
            );
        }
    }
    nodes.retain(|p| is_char(p));
    nodes.sort();
    nodes
}

/// The daemon's PATH: the control binary's own directory first, then [`SAFE_PATH`]. The
/// control daemon starts `nvidia-cuda-mps-server` by name, and drivers install the two side
/// by side, often outside SAFE_PATH (`/usr/local/nvidia/bin` in GPU images, the toolkit's
/// injected binaries); an operator who names the control binary by its absolute path gets
/// the server beside it.
fn daemon_path(binary: &Path) -> String {
    match binary.parent().and_then(Path::to_str) {
        Some(dir)
            if dir.starts_with('/')
                && !dir.contains(':')
                && !SAFE_PATH.split(':').any(|d| d == dir) =>
        {
            format!("{dir}:{SAFE_PATH}")
        }
        _ => SAFE_PATH.to_string(),
    }
}

/// Opens `<daemon dir>/daemon.out`, the daemon's stdout and stderr. It lives in the
/// root-owned daemon directory, not in the log directory the daemon's user can write, and
/// is opened without following a link and only if it is a regular file: a root process
/// never writes through a name a tenant could have planted.
fn open_daemon_out(daemon_dir: &Path) -> anyhow::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    let path = daemon_dir.join(DAEMON_OUT);
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o640)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK)
        .open(&path)
        .with_context(|| format!("open the daemon's output file {}", path.display()))?;
    if !file.metadata()?.is_file() {
        bail!(
            "{} is not a regular file; refusing to write to it",
            path.display()
        );
    }
    Ok(file)
}

/// The daemon's stdout and stderr, in its root-owned directory.
pub(crate) const DAEMON_OUT: &str = "daemon.out";

/// Keeps one log file under `max` bytes: past it, its content moves to `<name>.1` and the
/// file is emptied in place (the daemon keeps its descriptor, opened for appending, and
/// goes on at the new end). Every open is relative to `dir`, refuses links
/// (`O_NOFOLLOW`) and anything but a regular file, and never blocks (`O_NONBLOCK`): the
/// log directory is writable by the daemon's user, so a planted name is never followed.
fn rotate(dir: &std::os::fd::OwnedFd, name: &str, max: u64) -> anyhow::Result<bool> {
    use nix::fcntl::{openat, OFlag};
    use nix::sys::stat::{fstat, Mode, SFlag};
    let nofollow = OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC;
    let log = match openat(dir, name, OFlag::O_RDWR | nofollow, Mode::empty()) {
        Ok(fd) => std::fs::File::from(fd),
        Err(nix::errno::Errno::ENOENT) => return Ok(false),
        Err(e) => return Err(e).with_context(|| format!("open {name}")),
    };
    let st = fstat(&log)?;
    if SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT != SFlag::S_IFREG
        || (st.st_size as u64) <= max
    {
        return Ok(false);
    }
    let old = format!("{name}.1");
    let _ = nix::unistd::unlinkat(dir, old.as_str(), nix::unistd::UnlinkatFlags::NoRemoveDir);
    let to = openat(
        dir,
        old.as_str(),
        OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | nofollow,
        Mode::from_bits_truncate(0o640),
    )
    .with_context(|| format!("create {old}"))?;
    let mut to = std::fs::File::from(to);
    let mut from = &log;
    // Only the last `max / 2` bytes are kept: what the daemon said most recently.
    std::io::Seek::seek(
        &mut from,
        std::io::SeekFrom::Start(st.st_size as u64 - max / 2),
    )?;
    std::io::copy(&mut (&log).take(max / 2), &mut to)?;
    log.set_len(0)?;
    Ok(true)
}

struct Supervisor {
    state: StateDir,
    id: String,
    ident: Identity,
    binary: PathBuf,
    multi_user_flag: String,
    start_timeout: Duration,
    control: Control,
    log_size: u64,
    /// How often limits are checked; `None` when there is nothing to enforce.
    limit_check: Option<Duration>,
    /// This process: every record update names it (see `update`).
    me: Option<ProcRef>,
    /// `driver-root`: the daemon's servers load the driver libraries under it.
    driver_root: Option<PathBuf>,
}

impl Supervisor {
    fn new(
        cfg: &Config,
        state: StateDir,
        id: &str,
        ident: Identity,
        binary: PathBuf,
        me: Option<ProcRef>,
    ) -> Self {
        Supervisor {
            control: Control {
                binary: binary.clone(),
                pipe_dir: state.pipe_dir(id),
                user: (!ident.multi_user).then_some((ident.uid, ident.gid)),
            },
            binary,
            state,
            id: id.to_owned(),
            multi_user_flag: cfg.mps.multi_user_flag.clone(),
            start_timeout: cfg.mps.start_timeout,
            log_size: cfg.mps.log_size,
            limit_check: (!limit_commands(&ident).is_empty())
                .then_some(cfg.mps.limit_check_interval),
            ident,
            me,
            driver_root: cfg.driver_root.clone(),
        }
    }

    /// What the supervisor sets up once, before its first start: the daemon's shm as
    /// `/dev/shm` (isolated IPC), no capabilities for its children, and the signals it
    /// waits for, blocked and read from the returned signal fd.
    fn setup(&self) -> anyhow::Result<SignalFd> {
        if !self.ident.ipc_host {
            private_dev_shm(&self.state.shm_dir(&self.id))?;
        }
        drop_child_caps(self.ident.multi_user)?;
        let mut mask = SigSet::empty();
        for s in [
            Signal::SIGTERM,
            Signal::SIGINT,
            Signal::SIGCHLD,
            Signal::SIGHUP,
        ] {
            mask.add(s);
        }
        mask.thread_block()?;
        Ok(SignalFd::with_flags(&mask, SfdFlags::SFD_CLOEXEC)?)
    }

    /// The supervision loop: start the daemon, watch it, restart it with backoff when it
    /// dies, until a stop signal (daemon quit, record `stopped`), the idle timeout
    /// (directories removed) or a first start that fails (the error).
    fn supervise(
        &self,
        sfd: &mut SignalFd,
        idle_timeout: Duration,
        pending_grace: u64,
        cgroups: &[PathBuf],
    ) -> anyhow::Result<()> {
        let mut backoff = Backoff(BACKOFF_FIRST);
        let mut first = true;
        loop {
            self.clean_pipe_dir();
            let started = Instant::now();
            let Some(mut child) = self.start_ready(first)? else {
                if !backoff.wait(sfd) {
                    break;
                }
                continue;
            };
            first = false;
            match watch(self, sfd, &mut child, idle_timeout, pending_grace) {
                Watch::Stop => {
                    self.quit(&mut child);
                    break;
                }
                Watch::Removed => {
                    tracing::info!(daemon = %self.id, "MPS control daemon stopped after {idle_timeout:?} without containers; directories removed");
                    return Ok(());
                }
                Watch::Orphaned => {
                    self.quit(&mut child);
                    tracing::warn!(daemon = %self.id, record = %self.state.record_path(&self.id).display(), "the daemon's record is gone (state directory deleted?); MPS control daemon stopped");
                    return Ok(());
                }
                Watch::Unconfirmed => {
                    tracing::warn!(daemon = %self.id, checks = UNCONFIRMED_CHECKS, "the daemon did not confirm its limits in {UNCONFIRMED_CHECKS} checks in a row; killing it with its MPS servers and restarting it with its limits");
                    self.kill_daemon_tree(&mut child, cgroups);
                    self.update(|r| {
                        r.status = DaemonStatus::Restarting;
                        r.daemon = None;
                        r.restarts += 1;
                    })?;
                    if !backoff.wait(sfd) {
                        break;
                    }
                }
                Watch::ChildExited => {
                    if started.elapsed() > STABLE_AFTER {
                        backoff = Backoff(BACKOFF_FIRST);
                    }
                    self.record_exit(&mut child)?;
                    if !backoff.wait(sfd) {
                        break;
                    }
                }
            }
        }
        self.stopped();
        Ok(())
    }

    /// Starts the daemon and makes it ready (`make_ready`); the record says `ready` with
    /// its pid. A daemon that does not get ready is killed: on the first start that is
    /// the supervisor's failure (`Err`, recorded), later the record says `restarting`
    /// and `None` asks for another try after the backoff.
    fn start_ready(&self, first: bool) -> anyhow::Result<Option<Child>> {
        let mut child = self.spawn_daemon().map_err(|e| self.failed(e))?;
        tracing::debug!(daemon = %self.id, pid = child.id(), "MPS control daemon spawned");
        let daemon = ProcRef::of(child.id() as i32);
        match self.make_ready(&mut child) {
            Ok(()) => {
                self.update(|r| {
                    r.status = DaemonStatus::Ready;
                    r.daemon = daemon;
                    r.ready_at = Some(unix_now());
                    r.error = None;
                })?;
                tracing::info!(daemon = %self.id, pid = child.id(), "MPS control daemon ready");
                Ok(Some(child))
            }
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                let msg = format!("{e:#}");
                tracing::error!(daemon = %self.id, error = %msg, "MPS control daemon failed to start");
                if first {
                    return Err(self.failed(e));
                }
                let _ = self.update(|r| {
                    r.status = DaemonStatus::Restarting;
                    r.error = Some(msg.clone());
                    r.daemon = None;
                });
                Ok(None)
            }
        }
    }

    /// Logs and records that a ready daemon exited: `restarting`, one restart more.
    fn record_exit(&self, child: &mut Child) -> anyhow::Result<()> {
        let status = child
            .try_wait()
            .ok()
            .flatten()
            .map_or_else(|| "unknown status".to_owned(), |s| s.to_string());
        tracing::warn!(daemon = %self.id, %status, "MPS control daemon exited; restarting");
        self.update(|r| {
            r.status = DaemonStatus::Restarting;
            r.daemon = None;
            r.restarts += 1;
        })
    }

    /// The last step after a stop: the pipe directory emptied, the record `stopped`.
    fn stopped(&self) {
        self.clean_pipe_dir();
        let _ = self.update(|r| {
            r.status = DaemonStatus::Stopped;
            r.daemon = None;
        });
        tracing::info!(daemon = %self.id, "MPS control daemon stopped");
    }

    /// Changes the record with `f`. Every write names this supervisor: it holds the
    /// supervisor lock, so it is the daemon's one supervisor, and a create that replaced
    /// the record meanwhile (its own supervisor waits for the lock) learns so.
    fn update(&self, f: impl FnOnce(&mut crate::state::DaemonRecord)) -> anyhow::Result<()> {
        let mut rec = self
            .state
            .read_record(&self.id)?
            .with_context(|| format!("record of daemon {} disappeared", self.id))?;
        f(&mut rec);
        rec.supervisor = self.me;
        self.state.write_record(&rec)?;
        Ok(())
    }

    /// Records that the supervisor gives up with `e` (status failed, no daemon): the hook
    /// waiting on a start reports it to the user. Returns `e` for the caller to return.
    fn failed(&self, e: anyhow::Error) -> anyhow::Error {
        let msg = format!("{e:#}");
        let _ = self.update(|r| {
            r.status = DaemonStatus::Failed;
            r.error = Some(msg);
            r.daemon = None;
        });
        e
    }

    /// Empties the pipe directory: a socket or pid file left by a dead daemon is stale,
    /// and anything a tenant planted (a directory named `control`) goes too.
    fn clean_pipe_dir(&self) {
        if let Err(e) = self.state.clean_pipe_dir(&self.id) {
            tracing::warn!(daemon = %self.id, error = %e, "cannot empty the pipe directory");
        }
    }

    /// What stays writable and usable in the daemon's mount namespace: its own pipe and
    /// log directories, its /dev/shm, and the device nodes a CUDA process opens. The rest
    /// of the host is read-only, nosuid and nodev there, so a link planted in a directory
    /// the daemon writes cannot make it write a host file or open a host device.
    fn confinement(&self) -> crate::sys::Confinement {
        let mut conf = crate::sys::Confinement::default();
        conf.writable(&self.state.pipe_dir(&self.id))
            .writable(&self.state.log_dir(&self.id))
            .writable(Path::new("/dev/shm"));
        for dev in gpu_device_nodes() {
            conf.device(&dev);
        }
        conf
    }

    /// With `driver-root`, the daemon's `LD_LIBRARY_PATH`: a directory of links to the
    /// driver libraries under the root, made again before each start (a driver container
    /// upgraded while the daemon ran has other files). Never the root's library
    /// directories themselves, which hold the driver container's own C library too.
    fn driver_libraries(&self) -> anyhow::Result<Option<(&'static str, PathBuf)>> {
        let Some(root) = &self.driver_root else {
            return Ok(None);
        };
        let dir = self.state.driver_lib_dir(&self.id);
        crate::driver::link_server_libraries(root, &dir)?;
        Ok(Some(("LD_LIBRARY_PATH", dir)))
    }

    fn spawn_daemon(&self) -> anyhow::Result<Child> {
        let log_dir = self.state.log_dir(&self.id);
        let out = open_daemon_out(&self.state.daemon_dir(&self.id))?;
        let mut cmd = Command::new(&self.binary);
        cmd.arg("-f");
        if self.ident.multi_user {
            cmd.arg(&self.multi_user_flag);
        }
        cmd.env_clear()
            .env("PATH", daemon_path(&self.binary))
            .env("CUDA_MPS_PIPE_DIRECTORY", self.state.pipe_dir(&self.id))
            .env("CUDA_MPS_LOG_DIRECTORY", &log_dir)
            .env("CUDA_VISIBLE_DEVICES", self.ident.devices.join(","))
            .envs(limit_env(&self.ident))
            .envs(self.driver_libraries()?)
            .current_dir("/")
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out);
        // The daemon's group is gpushare's choice (mps.daemon-gid), never the container's,
        // and it has no supplementary groups.
        let user = (!self.ident.multi_user).then_some((self.ident.uid, self.ident.gid));
        crate::sys::confine_child(&mut cmd, self.confinement(), user, nix::unistd::getpid());
        cmd.spawn().with_context(|| {
            format!(
                "start {} as uid {} (the binary must be executable by that uid; the mount namespace it runs in needs Linux 5.12 or later)",
                self.binary.display(),
                self.ident.uid
            )
        })
    }

    /// Waits for the control socket, then applies the limits; the last command doubles as
    /// the readiness check (a stale socket never passes for a live daemon).
    fn make_ready(&self, child: &mut Child) -> anyhow::Result<()> {
        let deadline = Instant::now() + self.start_timeout;
        let socket = self.state.control_socket(&self.id);
        let mut cmds = limit_commands(&self.ident);
        cmds.push("get_default_active_thread_percentage".into());
        let mut pause = Duration::from_micros(500);
        let mut next = 0;
        loop {
            if let Some(status) = child.try_wait()? {
                bail!(
                    "the MPS control daemon exited during start-up ({status}); see {}",
                    self.state.log_dir(&self.id).display()
                );
            }
            if socket.exists() {
                let left = deadline
                    .saturating_duration_since(Instant::now())
                    .max(Duration::from_millis(100));
                match self.control.command(&cmds[next], left) {
                    Ok(_) => {
                        if next == 0 {
                            tracing::debug!(daemon = %self.id, "MPS control daemon answered");
                        }
                        next += 1;
                        if next == cmds.len() {
                            return Ok(());
                        }
                        continue;
                    }
                    Err(e) if Instant::now() >= deadline => return Err(e.into()),
                    Err(_) => {}
                }
            }
            if Instant::now() >= deadline {
                bail!(
                    "the MPS control daemon did not answer within {:?}; see {}",
                    self.start_timeout,
                    self.state.log_dir(&self.id).display()
                );
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(10));
        }
    }

    fn quit(&self, child: &mut Child) {
        self.quit_via(&self.control, child);
    }

    /// Keeps the daemon's logs bounded: `control.log` and `server.log` in its log tmpfs
    /// (a quarter of `mps.log-size` each, plus the kept half in `.1`), and `daemon.out`.
    fn rotate_logs(&self) {
        let dirs = [
            (
                self.state.log_dir(&self.id),
                &["control.log", "server.log"][..],
                self.log_size / 4,
            ),
            (
                self.state.daemon_dir(&self.id),
                &[DAEMON_OUT][..],
                DAEMON_OUT_MAX,
            ),
        ];
        for (dir, names, max) in dirs {
            let Ok(fd) = nix::fcntl::open(
                &dir,
                nix::fcntl::OFlag::O_DIRECTORY
                    | nix::fcntl::OFlag::O_NOFOLLOW
                    | nix::fcntl::OFlag::O_CLOEXEC,
                nix::sys::stat::Mode::empty(),
            ) else {
                continue;
            };
            for name in names {
                match rotate(&fd, name, max) {
                    Ok(true) => tracing::info!(daemon = %self.id, file = %name, "log rotated"),
                    Ok(false) => {}
                    Err(e) => {
                        tracing::warn!(daemon = %self.id, file = %name, error = %format!("{e:#}"), "cannot rotate a log")
                    }
                }
            }
        }
    }

    /// Checks that the daemon still enforces the identity's limits. A tenant reaches the
    /// control socket through its pipe directory and may send `set_*` commands: the real
    /// daemon accepts them from its own user (driver 580, docs/gpu-validation.md).
    /// Defaults that differ are set again; a server whose limits were raised gets them set
    /// back. A server's limits apply to the clients it creates afterwards, so only clients
    /// that connected between the raise and this check (at most `limit-check-interval`)
    /// keep the raised limits, until they exit. Shutting such a server down
    /// (`shutdown_server -f`) was tried and is worse on the real driver: the server kept
    /// its clients, stopped answering, and the identity's next client waited behind it.
    /// Returns how many violations were found.
    /// Every control command of one check shares `deadline`: an error, or a command that
    /// has not answered by then, ends the check unconfirmed (`Err`).
    fn enforce_limits(&self, deadline: Instant) -> anyhow::Result<u32> {
        let want = Wanted::of(&self.ident);
        let ask = |cmd: &str| self.ask(cmd, deadline);
        let mut violations = 0;
        if self.defaults_changed(&want, &ask)? {
            violations += 1;
            tracing::warn!(daemon = %self.id, "the daemon's default limits were changed through its control socket; setting them again");
            for cmd in limit_commands(&self.ident) {
                ask(&cmd)?;
            }
        }
        for server in reply::pids(&ask("get_server_list")?) {
            if self.server_raised(server, &want, &ask)? {
                violations += 1;
                tracing::warn!(daemon = %self.id, server, "an MPS server's limits were raised through the control socket; setting them back");
                for cmd in set_limits(&self.ident, Some(server)) {
                    ask(&cmd)?;
                }
            }
        }
        Ok(violations)
    }

    /// One control command of a limit check, answered by `deadline` or an error.
    fn ask(&self, cmd: &str, deadline: Instant) -> anyhow::Result<String> {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            bail!("the limit check did not finish within {CHECK_DEADLINE:?}");
        }
        Ok(self.control.command(cmd, left)?)
    }

    /// Whether the daemon's default limits differ from the identity's.
    fn defaults_changed(
        &self,
        want: &Wanted,
        ask: &dyn Fn(&str) -> anyhow::Result<String>,
    ) -> anyhow::Result<bool> {
        let mut changed = false;
        if let Some(p) = want.tp {
            changed |= parse_percentage(&ask("get_default_active_thread_percentage")?)
                .is_none_or(|got| (got - p).abs() > 0.01);
        }
        if let Some(m) = want.mem {
            for i in 0..want.devices {
                changed |=
                    parse_mps_mem(&ask(&format!("get_default_device_pinned_mem_limit {i}"))?)
                        != Some(m);
            }
        }
        Ok(changed)
    }

    /// Whether running server `server` has limits above the identity's. A reply that
    /// cannot be read is reported, not taken for a violation: shutting servers down on a
    /// driver whose format differs would stop every job.
    fn server_raised(
        &self,
        server: u32,
        want: &Wanted,
        ask: &dyn Fn(&str) -> anyhow::Result<String>,
    ) -> anyhow::Result<bool> {
        let unreadable = |cmd: &str, reply: &str| {
            tracing::error!(daemon = %self.id, command = cmd, reply = %crate::util::escape(reply.trim()), "cannot read a server's limit back; it is not checked");
            false
        };
        let mut over = false;
        if let Some(p) = want.tp {
            let cmd = format!("get_active_thread_percentage {server}");
            let g = ask(&cmd)?;
            over |= parse_percentage(&g).map_or_else(|| unreadable(&cmd, &g), |g| g > p + 0.01);
        }
        if let Some(m) = want.mem {
            for i in 0..want.devices {
                let cmd = format!("get_device_pinned_mem_limit {server} {i}");
                let g = ask(&cmd)?;
                over |= parse_mps_mem(&g).map_or_else(|| unreadable(&cmd, &g), |g| g > m);
            }
        }
        Ok(over)
    }

    /// How often `watch` wakes: for the log rotation, and often enough for the idle
    /// timeout and the limit check.
    fn watch_tick(&self, idle: Duration) -> Duration {
        let mut tick = ROTATE_EVERY;
        if !idle.is_zero() {
            tick = tick.min((idle / 4).clamp(Duration::from_millis(100), Duration::from_secs(5)));
        }
        if let Some(every) = self.limit_check {
            tick = tick.min(every);
        }
        tick
    }

    /// Checks the limits (`enforce_limits`) once `next_check` has come, and sets the next.
    /// Counts the checks in a row that could not confirm them in `unconfirmed`; `true` when
    /// that reaches `UNCONFIRMED_CHECKS`: the daemon must be restarted.
    fn check_limits_when_due(
        &self,
        next_check: &mut Option<Instant>,
        unconfirmed: &mut u32,
    ) -> bool {
        if let (Some(at), Some(every)) = (*next_check, self.limit_check) {
            if Instant::now() >= at {
                *next_check = Some(Instant::now() + every);
                match self.enforce_limits(Instant::now() + CHECK_DEADLINE) {
                    Ok(_) => *unconfirmed = 0,
                    Err(e) => {
                        *unconfirmed += 1;
                        tracing::warn!(daemon = %self.id, error = %format!("{e:#}"), "cannot check the daemon's limits");
                    }
                }
            }
        }
        *unconfirmed >= UNCONFIRMED_CHECKS
    }

    /// Ends the daemon without asking it (it may not answer): SIGKILL to every process of
    /// its tree — its MPS servers, which the real control daemon leaves running when it
    /// dies, and anything else they started — found both as the daemon's descendants and
    /// as the other members of the supervisor's own cgroups, then reaps it. Bounded: past
    /// `QUIT_GRACE` it gives up on members that will not go (the restart goes on).
    fn kill_daemon_tree(&self, child: &mut Child, cgroups: &[PathBuf]) {
        use nix::sys::signal::{kill, Signal};
        let me = std::process::id() as i32;
        let descendants = crate::util::descendants(child.id() as i32);
        for pid in descendants {
            let _ = kill(nix::unistd::Pid::from_raw(pid), Signal::SIGKILL);
        }
        let _ = child.kill();
        let _ = child.wait();
        let members = || -> Vec<i32> {
            cgroups
                .iter()
                .filter_map(|cg| std::fs::read_to_string(cg.join("cgroup.procs")).ok())
                .flat_map(|procs| {
                    procs
                        .split_whitespace()
                        .filter_map(|p| p.parse::<i32>().ok())
                        .collect::<Vec<_>>()
                })
                .filter(|&p| p != me)
                .collect()
        };
        let every = Duration::from_millis(10);
        let left = poll_until(Instant::now() + QUIT_GRACE, every, every, || {
            let others = members();
            for &pid in &others {
                let _ = kill(nix::unistd::Pid::from_raw(pid), Signal::SIGKILL);
            }
            others.is_empty().then_some(())
        });
        if left.is_none() {
            tracing::warn!(daemon = %self.id, members = ?members(), "processes of the daemon's cgroup outlived SIGKILL");
        }
    }

    /// Quits an idle daemon and removes its directories under the identity's lock
    /// (`StateDir::remove_if_unused`); `Some(removed)`, or `None` when a create holds the
    /// lock.
    fn remove_idle(&self, child: &mut Child, pending_grace: u64) -> Option<bool> {
        let _lock = self
            .state
            .lock(&self.id, Instant::now() + Duration::from_millis(200))
            .ok()?;
        let removed = self
            .state
            .remove_if_unused(&self.id, pending_grace, |tomb| {
                let control = Control {
                    pipe_dir: tomb.join("pipe"),
                    ..self.control.clone()
                };
                self.quit_via(&control, child);
            });
        match removed {
            Ok(removed) => Some(removed),
            Err(e) => {
                tracing::warn!(daemon = %self.id, error = %e, "cannot remove an idle daemon");
                Some(false)
            }
        }
    }

    /// Quits the daemon through `control` (its pipe dir may have been renamed), killing it
    /// past the grace period.
    fn quit_via(&self, control: &Control, child: &mut Child) {
        let _ = control.command("quit", Duration::from_secs(2));
        crate::util::wait_or_kill(child, QUIT_GRACE);
    }
}

/// The limits the limit check compares with, as the control daemon prints them back.
struct Wanted {
    /// Active thread percentage.
    tp: Option<f64>,
    /// Pinned memory per device, in bytes, rounded as `set_*` sends it.
    mem: Option<u64>,
    devices: usize,
}

impl Wanted {
    fn of(ident: &Identity) -> Self {
        Wanted {
            tp: ident.active_thread_percentage.map(f64::from),
            mem: ident
                .pinned_memory_limit
                .and_then(|b| parse_mps_mem(&crate::request::format_mps_size(b))),
            devices: ident.devices.len(),
        }
    }
}

/// The largest `daemon.out` kept (it lives on the state dir's file system, not in the
/// daemon's sized log tmpfs).
const DAEMON_OUT_MAX: u64 = 1 << 20;
/// How often the supervisor looks at the daemon's log sizes.
const ROTATE_EVERY: Duration = Duration::from_secs(1);

/// What ended a wait on the signal fd.
enum Event {
    Stop,
    ChildExited,
    Timeout,
}

/// Waits for a stop signal, the exit of `child` (when given) or the timeout.
fn wait_event(
    sfd: &mut SignalFd,
    mut child: Option<&mut Child>,
    timeout: Option<Duration>,
) -> Event {
    let deadline = timeout.map(|t| Instant::now() + t);
    loop {
        if let Some(c) = child.as_mut() {
            if let Ok(Some(_)) = c.try_wait() {
                return Event::ChildExited;
            }
        }
        let left = match deadline {
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Event::Timeout;
                }
                PollTimeout::try_from(left.as_millis().min(60_000) as u32)
                    .unwrap_or(PollTimeout::MAX)
            }
            None => PollTimeout::NONE,
        };
        let mut fds = [PollFd::new(sfd.as_fd(), PollFlags::POLLIN)];
        if let Ok(n) = poll(&mut fds, left) {
            if n > 0 {
                if let Ok(Some(info)) = sfd.read_signal() {
                    let sig = info.ssi_signo as i32;
                    if sig == Signal::SIGTERM as i32 || sig == Signal::SIGINT as i32 {
                        return Event::Stop;
                    }
                }
            }
        }
    }
}

/// What ended the watch over a ready daemon.
enum Watch {
    Stop,
    ChildExited,
    /// Idle for `idle-timeout`: daemon quit and its directories removed.
    Removed,
    /// The record is gone: someone deleted the state directory (or the daemon's).
    Orphaned,
    /// `UNCONFIRMED_CHECKS` limit checks in a row could not confirm the daemon's limits.
    Unconfirmed,
}

/// Ticks in a row the record must be missing before the supervisor believes it gone (the
/// record is replaced by rename, so it never is missing while it exists).
const ORPHAN_TICKS: u32 = 2;

/// Watches a ready daemon: until a stop signal, its exit, or — with an idle timeout —
/// until it has had no live container for that long, when it is quit and its
/// directories removed under the identity's lock (`StateDir::remove_if_unused`).
fn watch(
    sup: &Supervisor,
    sfd: &mut SignalFd,
    child: &mut Child,
    idle: Duration,
    pending_grace: u64,
) -> Watch {
    let tick = sup.watch_tick(idle);
    let mut next_check = sup.limit_check.map(|every| Instant::now() + every);
    let mut idle_since: Option<Instant> = None;
    let mut missing = 0;
    let mut unconfirmed = 0;
    loop {
        match wait_event(sfd, Some(&mut *child), Some(tick)) {
            Event::Stop => return Watch::Stop,
            Event::ChildExited => return Watch::ChildExited,
            Event::Timeout => {}
        }
        let record = std::fs::symlink_metadata(sup.state.record_path(&sup.id));
        missing = match record {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => missing + 1,
            _ => 0,
        };
        if missing >= ORPHAN_TICKS {
            return Watch::Orphaned;
        }
        sup.rotate_logs();
        if sup.check_limits_when_due(&mut next_check, &mut unconfirmed) {
            return Watch::Unconfirmed;
        }
        if idle.is_zero() {
            continue;
        }
        let busy = sup
            .state
            .live_containers(&sup.id, pending_grace)
            .map_or(true, |c| !c.is_empty());
        if busy {
            idle_since = None;
            continue;
        }
        if idle_since.get_or_insert_with(Instant::now).elapsed() < idle {
            continue;
        }
        match sup.remove_idle(child, pending_grace) {
            Some(true) => return Watch::Removed,
            Some(false) => idle_since = None,
            // A create holding the lock is about to use the daemon: try again next tick.
            None => {}
        }
    }
}

/// Leaves and removes the daemon's cgroups when the supervisor returns, whichever way.
struct CgroupGuard(Vec<PathBuf>);

impl Drop for CgroupGuard {
    fn drop(&mut self) {
        leave_cgroups(&self.0);
    }
}

/// The pause before a restart: `BACKOFF_FIRST`, doubling up to `BACKOFF_MAX`.
struct Backoff(Duration);

impl Backoff {
    /// Waits out the pause and doubles it; `false` when a stop signal ended the wait.
    fn wait(&mut self, sfd: &mut SignalFd) -> bool {
        if let Event::Stop = wait_event(sfd, None, Some(self.0)) {
            return false;
        }
        self.0 = (self.0 * 2).min(BACKOFF_MAX);
        true
    }
}

/// Takes daemon `id`'s supervisor lock (`StateDir::try_lock_supervisor`), for the
/// supervisor's whole life. While another process holds it, that is a supervisor started
/// for a create that was killed before its supervisor named itself in the record: once
/// the record names a live supervisor other than this one, `None` (this one leaves, its
/// create is served by that one); a holder that dies frees it. Waits up to `timeout`.
fn claim(
    state: &StateDir,
    id: &str,
    me: Option<ProcRef>,
    timeout: Duration,
) -> anyhow::Result<Option<nix::fcntl::Flock<std::fs::File>>> {
    let other_named = || {
        state
            .read_record(id)
            .ok()
            .flatten()
            .is_some_and(|r| r.supervisor.is_some_and(|p| Some(p) != me && p.alive()))
    };
    let claimed = poll_until(
        Instant::now() + timeout,
        Duration::from_millis(1),
        Duration::from_millis(20),
        || match state.try_lock_supervisor(id) {
            Ok(Some(lock)) => Some(Ok(Some(lock))),
            Ok(None) if other_named() => Some(Ok(None)),
            Ok(None) => None,
            Err(e) => Some(Err(e)),
        },
    );
    match claimed {
        Some(result) => Ok(result?),
        None => bail!(
            "another process held {} for {timeout:?} without naming itself as the supervisor of daemon {id}",
            state.supervisor_lock_path(id).display()
        ),
    }
}

/// Runs the supervisor for daemon `id` until it is told to stop or gives up.
/// The caller has already called `detach`.
pub(crate) fn run(cfg: &Config, id: &str) -> anyhow::Result<()> {
    tracing::debug!("supervisor started");
    let state = StateDir::new(&cfg.state_dir);
    let rec = state
        .read_record(id)?
        .with_context(|| format!("no record for daemon {id}"))?;
    let me = ProcRef::of(std::process::id() as i32);
    let Some(_only) = claim(&state, id, me, cfg.mps.start_timeout)? else {
        tracing::info!(daemon = %id, "another supervisor runs this daemon; leaving it to that one");
        return Ok(());
    };
    let binary = resolve_binary(&cfg.mps.control_binary, cfg.driver_root.as_deref());
    let sup = Supervisor::new(
        cfg,
        state,
        id,
        rec.identity,
        binary.as_ref().cloned().unwrap_or_default(),
        me,
    );
    sup.update(|r| {
        r.status = DaemonStatus::Starting;
        r.started_at = unix_now();
        r.error = None;
    })?;
    let setup = binary
        .map_err(anyhow::Error::from)
        .and_then(|_| sup.setup());
    let cgroups = CgroupGuard(own_cgroup(
        id,
        CgroupLimits {
            memory: cfg.mps.daemon_memory_max,
            pids: cfg.mps.daemon_pids_max,
        },
    ));
    // The record has no daemon yet (ensure wrote it so): `failed` clearing it changes nothing.
    let mut sfd = setup.map_err(|e| sup.failed(e))?;
    sup.supervise(
        &mut sfd,
        cfg.mps.idle_timeout,
        cfg.mps.pending_grace().as_secs(),
        &cgroups.0,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sweep_removes_only_empty_cgroups_of_gone_supervisors() {
        let top = tempfile::tempdir().unwrap();
        let id = "0123456789abcdef0123456789abcdef";
        let gone = top.path().join(format!("{id}-4294967295"));
        let live = top.path().join(format!("{id}-{}", std::process::id()));
        let busy = top.path().join(format!("{id}-4294967294"));
        let foreign = top.path().join("not-an-id-4294967295");
        for d in [&gone, &live, &busy, &foreign] {
            std::fs::create_dir(d).unwrap();
        }
        // rmdir refuses a directory with an entry, as the kernel refuses a cgroup with members.
        std::fs::write(busy.join("cgroup.procs"), "1\n").unwrap();
        assert_eq!(sweep_stale_cgroups(top.path()), 1);
        assert!(!gone.exists());
        assert!(live.exists() && busy.exists() && foreign.exists());
        assert_eq!(sweep_stale_cgroups(&top.path().join("missing")), 0);
    }

    #[test]
    fn a_v2_cgroup_never_copies_its_parents_cpuset() {
        // The v2 root enables cpuset for its children but has no cpuset.cpus of its own.
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("child");
        std::fs::create_dir(&dir).unwrap();
        std::fs::write(dir.join("cpuset.cpus"), "").unwrap();
        make_cgroup(tmp.path(), &dir, true).unwrap();
        assert_eq!(
            std::fs::read_to_string(dir.join("cpuset.cpus")).unwrap(),
            ""
        );
        // v1: an empty cpuset gets the parent's, and a parent without one is an error.
        assert!(make_cgroup(tmp.path(), &dir, false).is_err());
        std::fs::write(tmp.path().join("cpuset.cpus"), "0-3\n").unwrap();
        std::fs::write(tmp.path().join("cpuset.mems"), "0\n").unwrap();
        make_cgroup(tmp.path(), &dir, false).unwrap();
        assert_eq!(
            std::fs::read_to_string(dir.join("cpuset.cpus")).unwrap(),
            "0-3\n"
        );
    }

    #[test]
    fn daemon_path_puts_the_control_binarys_directory_first() {
        assert_eq!(
            daemon_path(Path::new("/usr/local/nvidia/bin/nvidia-cuda-mps-control")),
            format!("/usr/local/nvidia/bin:{SAFE_PATH}")
        );
        assert_eq!(
            daemon_path(Path::new("/usr/bin/nvidia-cuda-mps-control")),
            SAFE_PATH
        );
        assert_eq!(
            daemon_path(Path::new("/a:b/nvidia-cuda-mps-control")),
            SAFE_PATH
        );
        assert_eq!(daemon_path(Path::new("nvidia-cuda-mps-control")), SAFE_PATH);
    }

    #[test]
    fn limit_commands_per_device_by_ordinal() {
        let ident = Identity {
            devices: vec!["GPU-a".into(), "GPU-b".into()],
            uid: 1000,
            gid: 1000,
            multi_user: false,
            active_thread_percentage: Some(25),
            pinned_memory_limit: Some(4 << 30),
            ipc_host: false,
        };
        assert_eq!(
            limit_commands(&ident),
            vec![
                "set_default_active_thread_percentage 25",
                "set_default_device_pinned_mem_limit 0 4096M",
                "set_default_device_pinned_mem_limit 1 4096M",
            ]
        );
        assert_eq!(
            set_limits(&ident, Some(42)),
            vec![
                "set_active_thread_percentage 42 25",
                "set_device_pinned_mem_limit 42 0 4096M",
                "set_device_pinned_mem_limit 42 1 4096M",
            ]
        );
        let none = Identity {
            active_thread_percentage: None,
            pinned_memory_limit: None,
            ..ident
        };
        assert!(limit_commands(&none).is_empty());
    }
}
