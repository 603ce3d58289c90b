//! The supervisor: one detached process per MPS control daemon.
//!
//! Started by the hook as `gpushare daemon supervise --id <id>` with stdio on /dev/null and
//! an explicit environment. It leaves the hook's session and cgroup, closes every inherited
//! fd, enters a private mount namespace in which the daemon's shm tmpfs is `/dev/shm`, and
//! runs `<control-binary> -f` as the daemon's UID/GID with no capabilities (per-user) or as
//! root with the multi-user flag. Limits are applied with control commands before the
//! record says `ready`, and again after every restart (MPS forgets `set_default_*` when the
//! daemon quits). A daemon that dies is restarted with exponential backoff; SIGTERM quits
//! it cleanly. Invariant: the record's `daemon` is the live process or `None`.

use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::signal::{SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};

use super::control::{resolve_binary, Control, SAFE_PATH};
use crate::config::Config;
use crate::identity::Identity;
use crate::state::{DaemonStatus, ProcRef, StateDir};
use crate::util::unix_now;

/// How long a quit may take before the daemon is killed.
const QUIT_GRACE: Duration = Duration::from_secs(5);
const BACKOFF_FIRST: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(10);
/// A daemon that ran this long resets the backoff.
const STABLE_AFTER: Duration = Duration::from_secs(60);

/// The commands that put a daemon's limits in place, in order (DESIGN §5, mps-facts §1.2).
/// Pinned memory is set per device by ordinal: the daemon sees only its own devices,
/// renumbered from 0 (CUDA_VISIBLE_DEVICES), and NVIDIA's device plugin found UUID-keyed
/// limits ignored by some drivers.
pub fn limit_commands(ident: &Identity) -> Vec<String> {
    let mut cmds = Vec::new();
    if let Some(p) = ident.active_thread_percentage {
        cmds.push(format!("set_default_active_thread_percentage {p}"));
    }
    if let Some(bytes) = ident.pinned_memory_limit {
        for i in 0..ident.devices.len() {
            cmds.push(format!(
                "set_default_device_pinned_mem_limit {i} {}",
                crate::request::format_mps_size(bytes)
            ));
        }
    }
    cmds
}

/// Leaves the caller's session; closes every fd above stderr. Must run before the
/// supervisor opens anything of its own (its log file included).
pub fn detach() {
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

/// Moves this process into a `gpushare` cgroup at the root of every hierarchy, so that
/// stopping the engine's or the shim's cgroup does not take the daemon with it. Best
/// effort: a host that refuses keeps the daemon where it is, with a warning.
fn own_cgroup() {
    let pid = std::process::id().to_string();
    let root = Path::new("/sys/fs/cgroup");
    let mut hierarchies: Vec<PathBuf> = Vec::new();
    if root.join("cgroup.procs").exists() {
        hierarchies.push(root.to_owned()); // cgroup v2
    } else if let Ok(entries) = std::fs::read_dir(root) {
        hierarchies.extend(
            entries
                .flatten()
                .map(|e| e.path())
                .filter(|p| p.join("cgroup.procs").exists() && !p.is_symlink()),
        );
    }
    for h in hierarchies {
        let dir = h.join("gpushare");
        let moved = std::fs::create_dir_all(&dir)
            .and_then(|()| {
                // A new cgroup-v1 cpuset is empty and refuses members (ENOSPC): give it its
                // parent's CPUs and memory nodes first.
                for file in ["cpuset.cpus", "cpuset.mems"] {
                    let own = dir.join(file);
                    if own.exists()
                        && std::fs::read_to_string(&own).is_ok_and(|v| v.trim().is_empty())
                    {
                        std::fs::write(&own, std::fs::read_to_string(h.join(file))?)?;
                    }
                }
                Ok(())
            })
            .and_then(|()| std::fs::write(dir.join("cgroup.procs"), &pid));
        if let Err(e) = moved {
            tracing::warn!(cgroup = %dir.display(), error = %e, "cannot move the supervisor into its own cgroup");
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
/// own work). no_new_privs (sys::harden_child) keeps exec from granting any. Multi-user
/// daemons are root's by design and keep theirs.
fn drop_child_caps(multi_user: bool) -> anyhow::Result<()> {
    caps::clear(None, caps::CapSet::Ambient).context("clear ambient capabilities")?;
    caps::clear(None, caps::CapSet::Inheritable).context("clear inheritable capabilities")?;
    if !multi_user {
        caps::clear(None, caps::CapSet::Bounding).context("clear the capability bounding set")?;
    }
    Ok(())
}

struct Supervisor {
    state: StateDir,
    id: String,
    ident: Identity,
    binary: PathBuf,
    multi_user_flag: String,
    start_timeout: Duration,
    control: Control,
}

impl Supervisor {
    fn update(&self, f: impl FnOnce(&mut crate::state::DaemonRecord)) -> anyhow::Result<()> {
        let mut rec = self
            .state
            .read_record(&self.id)?
            .with_context(|| format!("record of daemon {} disappeared", self.id))?;
        f(&mut rec);
        self.state.write_record(&rec)?;
        Ok(())
    }

    /// Empties the pipe directory: a socket or pid file left by a dead daemon is stale.
    fn clean_pipe_dir(&self) {
        let pipe = self.state.pipe_dir(&self.id);
        if let Ok(entries) = std::fs::read_dir(&pipe) {
            for e in entries.flatten() {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }

    fn spawn_daemon(&self) -> anyhow::Result<Child> {
        let log_dir = self.state.log_dir(&self.id);
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log_dir.join("daemon.out"))
            .context("open the daemon's output file")?;
        let mut cmd = Command::new(&self.binary);
        cmd.arg("-f");
        if self.ident.multi_user {
            cmd.arg(&self.multi_user_flag);
        }
        cmd.env_clear()
            .env("PATH", SAFE_PATH)
            .env("CUDA_MPS_PIPE_DIRECTORY", self.state.pipe_dir(&self.id))
            .env("CUDA_MPS_LOG_DIRECTORY", &log_dir)
            .env("CUDA_VISIBLE_DEVICES", self.ident.devices.join(","))
            .current_dir("/")
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out);
        if !self.ident.multi_user {
            use std::os::unix::process::CommandExt;
            // std also clears supplementary groups when root changes uid.
            cmd.uid(self.ident.uid).gid(self.ident.gid);
        }
        crate::sys::harden_child(&mut cmd, nix::unistd::getpid());
        cmd.spawn()
            .with_context(|| format!("start {}", self.binary.display()))
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

    /// Quits the daemon through `control` (its pipe dir may have been renamed), killing it
    /// past the grace period.
    fn quit_via(&self, control: &Control, child: &mut Child) {
        let _ = control.command("quit", Duration::from_secs(2));
        let deadline = Instant::now() + QUIT_GRACE;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}

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
}

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
    let tick = (!idle.is_zero())
        .then(|| (idle / 4).clamp(Duration::from_millis(100), Duration::from_secs(5)));
    let mut idle_since: Option<Instant> = None;
    loop {
        match wait_event(sfd, Some(&mut *child), tick) {
            Event::Stop => return Watch::Stop,
            Event::ChildExited => return Watch::ChildExited,
            Event::Timeout => {}
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
        // A create holding the lock is about to use the daemon: try again next tick.
        let Ok(_lock) = sup
            .state
            .lock(&sup.id, Instant::now() + Duration::from_millis(200))
        else {
            continue;
        };
        let removed = sup.state.remove_if_unused(&sup.id, pending_grace, |tomb| {
            let control = Control {
                pipe_dir: tomb.join("pipe"),
                ..sup.control.clone()
            };
            sup.quit_via(&control, child);
        });
        match removed {
            Ok(true) => return Watch::Removed,
            Ok(false) => idle_since = None,
            Err(e) => {
                tracing::warn!(daemon = %sup.id, error = %e, "cannot remove an idle daemon");
                idle_since = None;
            }
        }
    }
}

/// Runs the supervisor for daemon `id` until it is told to stop or gives up.
/// The caller has already called `detach`.
pub fn run(cfg: &Config, id: &str) -> anyhow::Result<()> {
    let state = StateDir::new(&cfg.state_dir);
    let rec = state
        .read_record(id)?
        .with_context(|| format!("no record for daemon {id}"))?;
    let me = ProcRef::of(std::process::id() as i32);
    let ident = rec.identity.clone();
    let binary = resolve_binary(&cfg.mps.control_binary);
    let sup = Supervisor {
        control: Control {
            binary: binary.as_ref().cloned().unwrap_or_default(),
            pipe_dir: state.pipe_dir(id),
            user: (!ident.multi_user).then_some((ident.uid, ident.gid)),
        },
        binary: binary.as_ref().cloned().unwrap_or_default(),
        state,
        id: id.to_owned(),
        ident,
        multi_user_flag: cfg.mps.multi_user_flag.clone(),
        start_timeout: cfg.mps.start_timeout,
    };
    sup.update(|r| {
        r.supervisor = me;
        r.status = DaemonStatus::Starting;
        r.started_at = unix_now();
        r.error = None;
    })?;
    let setup = (|| -> anyhow::Result<SignalFd> {
        binary?;
        own_cgroup();
        if !sup.ident.ipc_host {
            private_dev_shm(&sup.state.shm_dir(id))?;
        }
        drop_child_caps(sup.ident.multi_user)?;
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
    })();
    let mut sfd = match setup {
        Ok(s) => s,
        Err(e) => {
            let msg = format!("{e:#}");
            let _ = sup.update(|r| {
                r.status = DaemonStatus::Failed;
                r.error = Some(msg.clone());
            });
            return Err(e);
        }
    };

    let mut backoff = BACKOFF_FIRST;
    let mut first = true;
    let idle_timeout = cfg.mps.idle_timeout;
    let pending_grace = cfg.mps.pending_grace().as_secs();
    loop {
        sup.clean_pipe_dir();
        let started = Instant::now();
        let mut child = match sup.spawn_daemon() {
            Ok(c) => c,
            Err(e) => {
                let msg = format!("{e:#}");
                let _ = sup.update(|r| {
                    r.status = DaemonStatus::Failed;
                    r.error = Some(msg.clone());
                    r.daemon = None;
                });
                return Err(e);
            }
        };
        let daemon = ProcRef::of(child.id() as i32);
        match sup.make_ready(&mut child) {
            Ok(()) => {
                sup.update(|r| {
                    r.status = DaemonStatus::Ready;
                    r.daemon = daemon;
                    r.ready_at = Some(unix_now());
                    r.error = None;
                })?;
                tracing::info!(daemon = %sup.id, pid = child.id(), "MPS control daemon ready");
            }
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                let msg = format!("{e:#}");
                tracing::error!(daemon = %sup.id, error = %msg, "MPS control daemon failed to start");
                if first {
                    // The hook waiting on this start reports the error to the user.
                    let _ = sup.update(|r| {
                        r.status = DaemonStatus::Failed;
                        r.error = Some(msg.clone());
                        r.daemon = None;
                    });
                    return Err(e);
                }
                let _ = sup.update(|r| {
                    r.status = DaemonStatus::Restarting;
                    r.error = Some(msg.clone());
                    r.daemon = None;
                });
                if let Event::Stop = wait_event(&mut sfd, None, Some(backoff)) {
                    break;
                }
                backoff = (backoff * 2).min(BACKOFF_MAX);
                continue;
            }
        }
        first = false;
        match watch(&sup, &mut sfd, &mut child, idle_timeout, pending_grace) {
            Watch::Stop => {
                sup.quit(&mut child);
                break;
            }
            Watch::Removed => {
                tracing::info!(daemon = %sup.id, "MPS control daemon stopped after {idle_timeout:?} without containers; directories removed");
                return Ok(());
            }
            Watch::ChildExited => {
                let status = child.try_wait().ok().flatten();
                tracing::warn!(daemon = %sup.id, ?status, "MPS control daemon exited; restarting");
                if started.elapsed() > STABLE_AFTER {
                    backoff = BACKOFF_FIRST;
                }
                sup.update(|r| {
                    r.status = DaemonStatus::Restarting;
                    r.daemon = None;
                    r.restarts += 1;
                })?;
                if let Event::Stop = wait_event(&mut sfd, None, Some(backoff)) {
                    break;
                }
                backoff = (backoff * 2).min(BACKOFF_MAX);
            }
        }
    }
    sup.clean_pipe_dir();
    let _ = sup.update(|r| {
        r.status = DaemonStatus::Stopped;
        r.daemon = None;
    });
    tracing::info!(daemon = %sup.id, "MPS control daemon stopped");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let none = Identity {
            active_thread_percentage: None,
            pinned_memory_limit: None,
            ..ident
        };
        assert!(limit_commands(&none).is_empty());
    }
}
