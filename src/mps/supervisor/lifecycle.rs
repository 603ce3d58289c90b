//! The supervision loop: start the daemon and make it ready, watch it, restart it with
//! backoff when it dies, quit it on a stop signal or when it has been idle for
//! `mps.idle-timeout`.
//!
//! Invariants: the record's `daemon` is the live process or `None`; a start that does not
//! get ready is killed (the first one is the supervisor's failure, later ones a restart);
//! a per-user daemon whose limits cannot be confirmed is killed with every process of its
//! tree, without being asked, within `QUIT_GRACE` (a multi-user one never is: `limits`); a supervisor whose record is gone (its state
//! directory deleted, as a host reboot wipes /run, or by hand) quits its daemon and exits,
//! so nothing runs that no record names and that `status`, `gc` and `daemon stop` cannot
//! see; an idle daemon is removed only under the identity's lock.

use std::os::fd::AsFd;
use std::path::PathBuf;
use std::process::Child;
use std::time::{Duration, Instant};

use anyhow::bail;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::signal::{SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};

use super::cgroup::other_members;
use super::confine::{drop_child_caps, private_dev_shm};
use super::context::Supervisor;
use super::limits::{limit_commands, Unconfirmed, UNCONFIRMED_CHECKS};
use super::logs::ROTATE_EVERY;
use crate::mps::control::Control;
use crate::state::{DaemonStatus, ProcRef};
use crate::util::{poll_until, unix_now};

/// How long a quit may take before the daemon is killed.
const QUIT_GRACE: Duration = Duration::from_secs(5);
const BACKOFF_FIRST: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(10);
/// A daemon that ran this long resets the backoff.
const STABLE_AFTER: Duration = Duration::from_secs(60);

impl Supervisor {
    /// What the supervisor sets up once, before its first start: the daemon's shm as
    /// `/dev/shm` (isolated IPC), no capabilities for its children, and the signals it
    /// waits for, blocked and read from the returned signal fd.
    pub(super) fn setup(&self) -> anyhow::Result<SignalFd> {
        if !self.ident.ipc_host {
            private_dev_shm(&self.state.shm_dir(&self.id))?;
        }
        drop_child_caps(self.ident.multi_user)?;
        if self.ident.multi_user && !self.ident.v3 {
            // Without it, commands go through `control` only (`Control::command`): no
            // worse than before, so a daemon is not refused for it.
            if let Err(e) = self.state.make_privileged_view(&self.id) {
                tracing::warn!(daemon = %self.id, error = %e, "cannot make the privileged view; the limit check goes through control, which any tenant can hold");
            }
        }
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
    pub(super) fn supervise(
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
                    r.limits_unconfirmed_since = None;
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
            r.limits_unconfirmed_since = None;
        });
        tracing::info!(daemon = %self.id, "MPS control daemon stopped");
    }
    /// Waits for the control socket, then applies the limits; the last command doubles as
    /// the readiness check (a stale socket never passes for a live daemon). A v3 daemon
    /// gets its server and namespaces instead (`make_v3_ready`).
    fn make_ready(&self, child: &mut Child) -> anyhow::Result<()> {
        let deadline = Instant::now() + self.start_timeout;
        let socket = self.state.control_socket(&self.id);
        if self.ident.v3 {
            return self.wait_ready(child, &socket, deadline, || {
                self.make_v3_ready(deadline).map(|()| true)
            });
        }
        let mut cmds = limit_commands(&self.ident);
        cmds.push("get_default_active_thread_percentage".into());
        let mut next = 0;
        self.wait_ready(child, &socket, deadline, || {
            let left = deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(100));
            self.control.command(&cmds[next], left)?;
            if next == 0 {
                tracing::debug!(daemon = %self.id, "MPS control daemon answered");
            }
            next += 1;
            Ok(next == cmds.len())
        })
    }
    /// Until `deadline`: once `socket` exists, `step` (`Ok(true)`: ready; `Ok(false)`: the
    /// next step at once; an error: tried again after a pause, and the error at the
    /// deadline); a daemon that exits, or a deadline without a socket, is the error.
    fn wait_ready(
        &self,
        child: &mut Child,
        socket: &std::path::Path,
        deadline: Instant,
        mut step: impl FnMut() -> anyhow::Result<bool>,
    ) -> anyhow::Result<()> {
        let mut pause = Duration::from_micros(500);
        loop {
            if let Some(status) = child.try_wait()? {
                bail!(
                    "the MPS control daemon exited during start-up ({status}); see {}",
                    self.state.log_dir(&self.id).display()
                );
            }
            if socket.exists() {
                match step() {
                    Ok(true) => return Ok(()),
                    Ok(false) => continue,
                    Err(e) if Instant::now() >= deadline => return Err(e),
                    Err(e) => {
                        tracing::debug!(daemon = %self.id, error = %format!("{e:#}"), "MPS control daemon not ready yet")
                    }
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
    /// Ends the daemon without asking it (it may not answer): SIGKILL to every process of
    /// its tree — its MPS servers, which the real control daemon leaves running when it
    /// dies, and anything else they started — found both as the daemon's descendants and
    /// as the other members of the supervisor's own cgroups, then reaps it. Bounded: past
    /// `QUIT_GRACE` it gives up on members that will not go (the restart goes on).
    fn kill_daemon_tree(&self, child: &mut Child, cgroups: &[PathBuf]) {
        use nix::sys::signal::{kill, Signal};
        let descendants = crate::util::descendants(child.id() as i32);
        for pid in descendants {
            let _ = kill(nix::unistd::Pid::from_raw(pid), Signal::SIGKILL);
        }
        let _ = child.kill();
        let _ = child.wait();
        let members = || other_members(cgroups);
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
    /// Whether the daemon, idle by its records, still has MPS clients, or did not say
    /// (asked through the channel the limit checks use, within `CLIENTS_DEADLINE`): then
    /// it is kept running, whatever the records say, and one warning says so until the
    /// daemon has a live record again. A client without a record is a container gpushare
    /// lost track of, or a process that reached the pipe directory another way; quitting
    /// the daemon would end its job mid-kernel.
    fn clients_without_records(&self, warned: &mut Unrecorded) -> bool {
        let attached = self
            .control
            .clients(crate::mps::ensure::CLIENTS_DEADLINE)
            .map(|servers| {
                let unknown = servers.iter().any(|(_, n)| n.is_none());
                (
                    servers.iter().map(|(_, n)| n.unwrap_or(0)).sum::<usize>(),
                    unknown,
                )
            });
        match attached {
            Ok((0, false)) => false,
            Ok((clients, unknown)) => {
                if !warned.clients {
                    warned.clients = true;
                    tracing::warn!(daemon = %self.id, clients, unknown_servers = unknown, "the daemon has MPS clients but no live container record (a client without a record): kept running while they are attached");
                }
                true
            }
            Err(e) => {
                if !warned.silent {
                    warned.silent = true;
                    tracing::warn!(daemon = %self.id, error = %e, "the idle daemon did not list its servers and clients: kept running, asked again after the next idle period");
                }
                true
            }
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
                self.quit_via(&self.control.moved_to(tomb), child);
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
        let _ = control.quit(Duration::from_secs(2));
        crate::util::wait_or_kill(child, QUIT_GRACE);
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
    let mut unconfirmed = Unconfirmed::default();
    let mut unrecorded = Unrecorded::default();
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
            unrecorded = Unrecorded::default();
            continue;
        }
        if idle_since.get_or_insert_with(Instant::now).elapsed() < idle {
            continue;
        }
        if sup.clients_without_records(&mut unrecorded) {
            idle_since = None;
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

/// The warnings an idle daemon that is kept for its clients has given (one each).
#[derive(Default)]
struct Unrecorded {
    clients: bool,
    silent: bool,
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

#[cfg(test)]
mod tests {
    use super::*;
    // `raise` sends to the calling thread (tgkill), in a threaded process too.
    use nix::sys::signal::raise;

    /// A signal fd for SIGTERM and SIGHUP, blocked in this test's thread only, and the
    /// signals sent to this thread alone: no other thread of the test process sees them.
    fn signals() -> SignalFd {
        let mut mask = SigSet::empty();
        mask.add(Signal::SIGTERM);
        mask.add(Signal::SIGHUP);
        mask.thread_block().unwrap();
        SignalFd::with_flags(&mask, SfdFlags::SFD_CLOEXEC).unwrap()
    }

    fn event(e: Event) -> &'static str {
        match e {
            Event::Stop => "stop",
            Event::ChildExited => "child exited",
            Event::Timeout => "timeout",
        }
    }

    #[test]
    fn a_wait_ends_at_sigterm_the_childs_exit_or_the_timeout_not_at_another_signal() {
        let mut sfd = signals();
        let short = Some(Duration::from_millis(50));
        assert_eq!(event(wait_event(&mut sfd, None, short)), "timeout");
        // SIGHUP (the log rotation's nudge) is read and the wait goes on.
        raise(Signal::SIGHUP).unwrap();
        assert_eq!(event(wait_event(&mut sfd, None, short)), "timeout");
        raise(Signal::SIGTERM).unwrap();
        assert_eq!(event(wait_event(&mut sfd, None, None)), "stop");
        // A child that has exited (a zombie, not yet reaped): seen before any wait.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let stat = format!("/proc/{}/stat", child.id());
        let zombie = poll_until(
            Instant::now() + Duration::from_secs(10),
            Duration::from_millis(5),
            Duration::from_millis(5),
            || {
                std::fs::read_to_string(&stat)
                    .ok()?
                    .contains(") Z ")
                    .then_some(())
            },
        );
        assert!(zombie.is_some());
        assert_eq!(
            event(wait_event(
                &mut sfd,
                Some(&mut child),
                Some(Duration::from_secs(30))
            )),
            "child exited"
        );
    }

    #[test]
    fn the_backoff_doubles_and_a_stop_ends_it_at_once() {
        let mut sfd = signals();
        let mut b = Backoff(Duration::from_millis(1));
        assert!(b.wait(&mut sfd));
        assert_eq!(b.0, Duration::from_millis(2));
        assert!(b.wait(&mut sfd));
        assert_eq!(b.0, Duration::from_millis(4));
        // A stop during the longest pause: `false` at once, not after BACKOFF_MAX, and
        // the pause unchanged.
        let mut b = Backoff(BACKOFF_MAX);
        raise(Signal::SIGTERM).unwrap();
        let began = Instant::now();
        assert!(!b.wait(&mut sfd));
        assert!(began.elapsed() < Duration::from_secs(1));
        assert_eq!(b.0, BACKOFF_MAX);
    }
}
