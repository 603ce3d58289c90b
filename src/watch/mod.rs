//! The GPU process watcher (`gpushare watch`, one per node, root): every `watch.interval`
//! it lists every process with a compute context on the node's GPUs through NVML, maps
//! each to what it belongs to (an MPS server of a daemon, a container gpushare serves and
//! its pod, or nothing gpushare serves), writes that for `status` and its metrics
//! (`report`), and, where the operator's policy says act and limits are enforced, stops
//! what escapes them (`plan`): a served container's process that uses a GPU it is served
//! on outside MPS (SIGKILL), and the MPS clients of a container above its pinned limit
//! (`terminate_client`, then SIGKILL: killing a client mid-kernel without it is undefined
//! for its whole server, docs/mps.md).
//!
//! Invariants:
//! - its own process, outside every create path: no create waits for it, and NVML (which
//!   leaves threads running in the process that loads it) is loaded here, never in a hook;
//! - it runs in the host's PID namespace, where NVML's PIDs are the host's;
//! - it signals only through a pidfd opened after the process was classified and checked
//!   again (start time and cgroup unchanged), so a reused PID is never killed;
//! - it never touches an MPS server, a process of a container gpushare does not serve, or
//!   a host process;
//! - every action is one log line (pod, PID, what, why) and a counter; every control
//!   command has a deadline, so a daemon that stalls delays one scan, never the next.

mod plan;
pub(crate) mod report;
mod scan;

use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::signal::{SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nvml_wrapper::Nvml;

use crate::config::{Config, Limits};
use crate::mps::control::{resolve_binary, Control};
use crate::state::{ProcRef, StateDir};
use plan::{Action, Rules};
use report::{Counters, Report};

/// How long one control command of an action may take.
const CONTROL_TIMEOUT: Duration = Duration::from_secs(5);

/// `gpushare watch`: scans until SIGTERM or SIGINT.
pub(crate) fn run(cfg: &Config) -> anyhow::Result<()> {
    if !nix::unistd::geteuid().is_root() {
        bail!("gpushare watch must run as root (it reads every process's cgroup and may stop processes)");
    }
    let state = StateDir::new(&cfg.state_dir);
    state.ensure_root()?;
    let Some(_only) = state.try_lock_watch()? else {
        bail!(
            "another gpushare watch serves {} (it holds {})",
            cfg.state_dir.display(),
            state.watch_lock_path().display()
        );
    };
    // Blocked before NVML starts its threads, which inherit the mask: the signals reach
    // the signalfd only.
    let mut mask = SigSet::empty();
    mask.add(Signal::SIGTERM);
    mask.add(Signal::SIGINT);
    mask.thread_block().context("block the watcher's signals")?;
    let sfd = SignalFd::with_flags(&mask, SfdFlags::SFD_CLOEXEC | SfdFlags::SFD_NONBLOCK)
        .context("open the watcher's signalfd")?;
    let mut watcher = Watcher {
        cfg,
        state,
        nvml: None,
        cache: Default::default(),
        counters: Report::read(&StateDir::new(&cfg.state_dir))
            .map(|r| r.actions)
            .unwrap_or_default(),
        me: ProcRef::of(std::process::id() as i32),
        last_error: None,
    };
    tracing::info!(
        policy = ?cfg.watch.policy,
        interval = ?cfg.watch.interval,
        "watch: started"
    );
    loop {
        let started = Instant::now();
        watcher.scan_once();
        let next = started + cfg.watch.interval;
        loop {
            let left = next.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            let timeout = PollTimeout::try_from(left).unwrap_or(PollTimeout::MAX);
            let mut fds = [PollFd::new(sfd.as_fd(), PollFlags::POLLIN)];
            match poll(&mut fds, timeout) {
                Ok(0) | Err(nix::errno::Errno::EINTR) => continue,
                Ok(_) => {
                    if let Ok(Some(_)) = sfd.read_signal() {
                        tracing::info!("watch: stopped by a signal");
                        return Ok(());
                    }
                }
                Err(e) => return Err(e).context("wait for the next scan"),
            }
        }
    }
}

struct Watcher<'a> {
    cfg: &'a Config,
    state: StateDir,
    nvml: Option<Nvml>,
    cache: scan::Cache,
    counters: Counters,
    me: Option<ProcRef>,
    /// The last scan's NVML error: a change is logged once, not every interval.
    last_error: Option<String>,
}

/// A listed process as it was when classified: what a later signal must still find.
struct Seen {
    start_time: Option<u64>,
    cgroup: Option<String>,
}

impl Watcher<'_> {
    fn nvml(&mut self) -> Result<&Nvml, String> {
        if self.nvml.is_none() {
            let library = crate::driver::nvml_library(self.cfg.driver_root.as_deref())
                .map_err(|e| e.to_string())?;
            let nvml = match library {
                Some(path) => Nvml::builder().lib_path(path.as_os_str()).init(),
                None => Nvml::init(),
            }
            .map_err(|e| format!("cannot initialise NVML: {e}"))?;
            self.nvml = Some(nvml);
        }
        self.nvml
            .as_ref()
            .ok_or_else(|| "NVML is not loaded".to_owned())
    }

    fn scan_once(&mut self) {
        let started = Instant::now();
        let listed = self
            .nvml()
            .and_then(|nvml| scan::list(nvml).map_err(|e| crate::util::error_chain(&e)));
        let (listed, error) = match listed {
            Ok(l) => (l, None),
            Err(e) => {
                // A driver that went away (or was reloaded) gets a fresh NVML next time.
                self.nvml = None;
                (Vec::new(), Some(e))
            }
        };
        if error != self.last_error {
            match &error {
                Some(e) => tracing::warn!("watch: no GPU process can be listed: {e}"),
                None => tracing::info!("watch: NVML answers"),
            }
            self.last_error = error.clone();
        }
        let node = scan::Node::read(&self.state, &mut self.cache);
        let mut owned = Vec::with_capacity(listed.len());
        let mut seen = Vec::with_capacity(listed.len());
        for p in listed {
            let pid = i32::try_from(p.pid).unwrap_or(0);
            let (owner, cgroup) = node.owner(pid);
            seen.push(Seen {
                start_time: crate::util::proc_start_time(pid),
                cgroup,
            });
            owned.push((p, owner));
        }
        let rules = Rules {
            policy: self.cfg.watch.policy,
            enforced: self.cfg.mps.limits == Limits::Enforced,
            margin: self.cfg.watch.memory_margin,
        };
        let mut plan = plan::plan(&owned, &node, &rules);
        // Daemons that did not answer in this scan are not asked again in it: a daemon
        // kept from answering delays one termination, not one per client of its tenant.
        let mut silent = std::collections::HashSet::new();
        for action in std::mem::take(&mut plan.actions) {
            let index = match action {
                Action::StopDirect(i) | Action::EndClient(i) => i,
            };
            let outcome = self.act(
                action,
                &plan.processes[index],
                &seen[index],
                &node,
                &mut silent,
            );
            if let Err(why) = outcome {
                self.counters.failed += 1;
                let p = &mut plan.processes[index];
                if let Some(v) = &mut p.verdict {
                    v.push_str(&format!(" (failed: {why})"));
                }
            }
        }
        let report = Report {
            schema: report::SCHEMA.to_owned(),
            watcher: self.me,
            policy: self.cfg.watch.policy,
            enforced: rules.enforced,
            interval_seconds: self.cfg.watch.interval.as_secs_f64(),
            scanned_at: crate::util::unix_now(),
            scan_seconds: started.elapsed().as_secs_f64(),
            error,
            processes: plan.processes,
            actions: self.counters,
        };
        if let Err(e) = report.write(&self.state) {
            tracing::warn!(
                "watch: cannot write {}: {e}",
                self.state.watch_report_path().display()
            );
        }
    }

    /// Carries out one action, with its log line; the error says why it failed.
    fn act(
        &mut self,
        action: Action,
        p: &report::Process,
        seen: &Seen,
        node: &scan::Node,
        silent: &mut std::collections::HashSet<String>,
    ) -> Result<(), String> {
        let names = p.names.escaped();
        let pod = match (&names.namespace, &names.pod, &names.container) {
            (Some(ns), Some(pod), Some(c)) => format!("pod {ns}/{pod} container {c}"),
            _ => "no pod".to_owned(),
        };
        let container = p.container_id.as_deref().unwrap_or("-");
        let daemon = p.daemon.as_deref().unwrap_or("-");
        let why = p.verdict.as_deref().unwrap_or_default();
        let mut confirmed = true;
        if let Action::EndClient(_) = action {
            confirmed = self.terminate_client(p, node, silent).is_ok();
        }
        let killed = kill_checked(p.pid, seen);
        let what = match (action, confirmed) {
            (Action::StopDirect(_), _) => "killed",
            (Action::EndClient(_), true) => "terminate_client, then killed",
            (Action::EndClient(_), false) => {
                "killed without a confirmed terminate_client (the daemon did not confirm it)"
            }
        };
        match &killed {
            Ok(()) => {
                match action {
                    Action::StopDirect(_) => self.counters.stopped_direct += 1,
                    Action::EndClient(_) => {
                        self.counters.ended_clients += 1;
                        if !confirmed {
                            self.counters.unconfirmed_terminations += 1;
                        }
                    }
                }
                tracing::warn!(
                    pid = p.pid,
                    container_id = container,
                    daemon,
                    "watch: {what} pid {} of {pod} (container {container}) on {}: {why}",
                    p.pid,
                    p.gpu
                );
            }
            Err(e) => tracing::warn!(
                pid = p.pid,
                container_id = container,
                daemon,
                "watch: could not stop pid {} of {pod} (container {container}) on {}: {e}; it was to be {why}",
                p.pid,
                p.gpu
            ),
        }
        killed
    }

    /// `terminate_client <server> <pid>` on the client's daemon, trying its servers (one,
    /// but for a daemon switching users); `Ok` once one answers `0` (CUDA_SUCCESS).
    fn terminate_client(
        &self,
        p: &report::Process,
        node: &scan::Node,
        silent: &mut std::collections::HashSet<String>,
    ) -> Result<(), String> {
        let daemon = p.daemon.as_deref().ok_or("no daemon")?;
        if silent.contains(daemon) {
            return Err("its daemon did not answer earlier in this scan".to_owned());
        }
        let identity = node
            .served
            .iter()
            .find(|s| s.daemon == daemon)
            .map(|s| s.identity.clone())
            .ok_or("no record of its daemon")?;
        let binary = resolve_binary(
            &self.cfg.mps.control_binary,
            self.cfg.driver_root.as_deref(),
        )
        .map_err(|e| e.to_string())?;
        let control = Control::of_daemon(binary, &self.state, daemon, &identity);
        let servers = control
            .command("get_server_list", CONTROL_TIMEOUT)
            .map_err(|e| {
                silent.insert(daemon.to_owned());
                e.to_string()
            })?;
        let mut last = "the daemon runs no server".to_owned();
        for server in crate::mps::reply::pids(&servers) {
            match control.command(
                &format!("terminate_client {server} {}", p.pid),
                CONTROL_TIMEOUT,
            ) {
                Ok(out) if out.trim() == "0" => return Ok(()),
                Ok(out) => last = crate::util::escape(&crate::util::one_line(&out)),
                Err(e) => {
                    silent.insert(daemon.to_owned());
                    last = e.to_string();
                    break;
                }
            }
        }
        tracing::warn!(
            pid = p.pid,
            daemon,
            "watch: terminate_client failed: {last}"
        );
        Err(last)
    }
}

/// SIGKILL to `pid` through a pidfd, where it is still the process that was classified
/// (same start time, same cgroup).
fn kill_checked(pid: i32, seen: &Seen) -> Result<(), String> {
    use rustix::process::{pidfd_open, pidfd_send_signal, Pid, PidfdFlags, Signal as RSignal};
    let raw = Pid::from_raw(pid).ok_or("no such pid")?;
    let fd = pidfd_open(raw, PidfdFlags::empty()).map_err(|e| format!("it is gone ({e})"))?;
    // The pidfd names one process for good; checked after it is open, a PID reused
    // between the scan and now is seen here and left alone.
    let same = seen.start_time.is_some()
        && crate::util::proc_start_time(pid) == seen.start_time
        && scan::cgroup_of(pid) == seen.cgroup;
    if !same {
        return Err("the PID now names another process, or it left its cgroup".to_owned());
    }
    pidfd_send_signal(&fd, RSignal::KILL).map_err(|e| format!("SIGKILL failed: {e}"))
}
