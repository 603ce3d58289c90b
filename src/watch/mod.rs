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
//! - it lists and judges GPU by GPU: a GPU whose processes cannot be listed (after
//!   retries) costs that GPU's verdicts for that scan, counted and shown, never another's;
//! - a kill or `terminate_client` reaches only the process that was listed and judged: it
//!   is pinned by a pidfd as soon as its GPU is listed, its start time and cgroup are read
//!   through that pin, and checked again before each step (`act`); a mismatch is reported,
//!   never acted on;
//! - it never touches an MPS server, a process of a container gpushare does not serve, or
//!   a host process;
//! - every action is one log line (pod, PID, what, why) and a counter; every control
//!   command has a deadline, so a daemon that stalls delays one scan, never the next.

mod act;
mod plan;
pub(crate) mod report;
mod scan;

use std::collections::HashSet;
use std::os::fd::{AsFd, OwnedFd};
use std::rc::Rc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::signal::{SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nvml_wrapper::Nvml;

use crate::config::{Config, Limits};
use crate::mps::control::{resolve_binary, Control};
use crate::state::{ProcRef, StateDir};
use act::{ActError, Outcome, Pins};
use plan::{Action, Rules};
use report::{Counters, Report};
use scan::Proc;

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
    // The counters go on from the last watcher's.
    let last = Report::read(&StateDir::new(&cfg.state_dir));
    raise_descriptor_limit();
    let mut watcher = Watcher {
        cfg,
        state,
        nvml: None,
        cache: Default::default(),
        pins: Pins::default(),
        counters: last.as_ref().map(|r| r.actions).unwrap_or_default(),
        gpu_list_failures: last.as_ref().map_or(0, |r| r.gpu_list_failures),
        me: ProcRef::of(std::process::id() as i32),
        last_error: None,
        last_unlisted: Vec::new(),
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
    pins: Pins<Rc<OwnedFd>>,
    counters: Counters,
    gpu_list_failures: u64,
    me: Option<ProcRef>,
    /// The last scan's NVML error and the GPUs it could not list: a change is logged once,
    /// not every interval.
    last_error: Option<String>,
    last_unlisted: Vec<report::Unlisted>,
}

/// NVML, loaded on first use and kept while it answers.
fn nvml<'n>(slot: &'n mut Option<Nvml>, cfg: &Config) -> Result<&'n Nvml, String> {
    if slot.is_none() {
        let library =
            crate::driver::nvml_library(cfg.driver_root.as_deref()).map_err(|e| e.to_string())?;
        let loaded = match library {
            Some(path) => Nvml::builder().lib_path(path.as_os_str()).init(),
            None => Nvml::init(),
        }
        .map_err(|e| format!("cannot initialise NVML: {e}"))?;
        *slot = Some(loaded);
    }
    slot.as_ref().ok_or_else(|| "NVML is not loaded".to_owned())
}

impl Watcher<'_> {
    fn scan_once(&mut self) {
        let started = Instant::now();
        // Each GPU's processes are pinned as soon as that GPU is listed.
        let pins = &mut self.pins;
        let listed = nvml(&mut self.nvml, self.cfg).and_then(|n| {
            scan::list(n, |p| {
                pins.pin(&mut Proc, i32::try_from(p.pid).unwrap_or(0))
            })
            .map_err(|e| crate::util::error_chain(&e))
        });
        self.pins.end_scan();
        let (listing, pinned, error) = match listed {
            Ok((l, p)) => (l, p, None),
            Err(e) => {
                // A driver that went away (or was reloaded) gets a fresh NVML next time.
                self.nvml = None;
                (scan::Listing::default(), Vec::new(), Some(e))
            }
        };
        if error != self.last_error {
            match &error {
                Some(e) => tracing::warn!("watch: no GPU process can be listed: {e}"),
                None => tracing::info!("watch: NVML answers"),
            }
            self.last_error = error.clone();
        }
        let unlisted: Vec<report::Unlisted> = listing
            .unlisted
            .iter()
            .map(|u| report::Unlisted {
                gpu_index: u.index,
                gpu: u.gpu.clone(),
                error: crate::util::error_chain(&u.error),
            })
            .collect();
        self.gpu_list_failures += unlisted.len() as u64;
        if unlisted != self.last_unlisted {
            for u in &unlisted {
                tracing::warn!(
                    gpu_index = u.gpu_index,
                    "watch: the processes of GPU {} are not listed (this scan judges none of them; the other GPUs' are): {}",
                    u.gpu_index,
                    u.error
                );
            }
            if unlisted.is_empty() {
                tracing::info!("watch: every GPU's processes are listed again");
            }
            self.last_unlisted = unlisted.clone();
        }
        let node = scan::Node::read(&self.state, &mut self.cache);
        let owned: Vec<_> = listing
            .processes
            .into_iter()
            .zip(&pinned)
            .map(|(p, pin)| {
                let owner = pin
                    .cgroup
                    .as_deref()
                    .map_or(scan::Owner::None, |c| node.owner_of_cgroup(c));
                (p, owner)
            })
            .collect();
        let rules = Rules {
            policy: self.cfg.watch.policy,
            enforced: self.cfg.mps.limits == Limits::Enforced,
            margin: self.cfg.watch.memory_margin,
        };
        let mut plan = plan::plan(&owned, &node, &rules);
        // Daemons that did not answer in this scan are not asked again in it: a daemon
        // kept from answering delays one termination, not one per client of its tenant.
        let mut silent = HashSet::new();
        for action in std::mem::take(&mut plan.actions) {
            let index = match action {
                Action::StopDirect(i) | Action::EndClient(i) => i,
            };
            let p = &plan.processes[index];
            let mut terminate = |pid: i32| self.terminate_client(p, pid, &node, &mut silent);
            let terminate: Option<&mut dyn FnMut(i32) -> Result<(), ActError>> = match action {
                Action::StopDirect(_) => None,
                Action::EndClient(_) => Some(&mut terminate),
            };
            let outcome = act::stop(&mut Proc, p.pid, &pinned[index], terminate);
            if let Outcome::Refused(ActError::Moved { .. }) = outcome {
                self.pins.forget(p.pid);
            }
            let note = self.record(action, p, &outcome);
            if let (Some(note), Some(v)) = (note, &mut plan.processes[index].verdict) {
                v.push_str(&note);
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
            unlisted,
            gpu_list_failures: self.gpu_list_failures,
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

    /// Counts and logs what an action came to; what its verdict gets added, if anything.
    fn record(&mut self, action: Action, p: &report::Process, outcome: &Outcome) -> Option<String> {
        let names = p.names.escaped();
        let pod = match (&names.namespace, &names.pod, &names.container) {
            (Some(ns), Some(pod), Some(c)) => format!("pod {ns}/{pod} container {c}"),
            _ => "no pod".to_owned(),
        };
        let container = p.container_id.as_deref().unwrap_or("-");
        let daemon = p.daemon.as_deref().unwrap_or("-");
        let why = p.verdict.as_deref().unwrap_or_default();
        let client = matches!(action, Action::EndClient(_));
        let of = format!(
            "pid {} of {pod} (container {container}) on {}",
            p.pid, p.gpu
        );
        let (warn, line, added) = match outcome {
            Outcome::Killed { confirmed } => {
                let what = match (client, confirmed) {
                    (false, _) => "killed",
                    (true, true) => "terminate_client, then killed",
                    (true, false) => {
                        "killed without a confirmed terminate_client (the daemon did not confirm it)"
                    }
                };
                if client {
                    self.counters.ended_clients += 1;
                    if !confirmed {
                        self.counters.unconfirmed_terminations += 1;
                    }
                } else {
                    self.counters.stopped_direct += 1;
                }
                (true, format!("watch: {what} {of}: {why}"), None)
            }
            Outcome::Gone { confirmed: true } if client => {
                self.counters.ended_clients += 1;
                (
                    true,
                    format!("watch: terminate_client ended {of}: {why}"),
                    None,
                )
            }
            Outcome::Gone { .. } => (
                false,
                format!("watch: {of} ended before it was stopped; it was to be {why}"),
                Some(" (it ended before it was stopped)".to_owned()),
            ),
            Outcome::Refused(e) => {
                self.counters.failed += 1;
                let e = crate::util::error_chain(e);
                (
                    true,
                    format!("watch: did not stop {of}: {e}; it was to be {why}"),
                    Some(format!(" (not done: {e})")),
                )
            }
        };
        if warn {
            tracing::warn!(pid = p.pid, container_id = container, daemon, "{line}");
        } else {
            tracing::info!(pid = p.pid, container_id = container, daemon, "{line}");
        }
        added
    }

    /// `terminate_client <server> <pid>` on the client's daemon, trying its servers (one,
    /// but for a daemon switching users); `Ok` once one answers `0` (CUDA_SUCCESS).
    fn terminate_client(
        &self,
        p: &report::Process,
        pid: i32,
        node: &scan::Node,
        silent: &mut HashSet<String>,
    ) -> Result<(), ActError> {
        let daemon = p.daemon.as_deref().ok_or(ActError::NoDaemon)?;
        let owned = || daemon.to_owned();
        if silent.contains(daemon) {
            return Err(ActError::Silent { daemon: owned() });
        }
        let identity = node
            .served
            .iter()
            .find(|s| s.daemon == daemon)
            .map(|s| s.identity.clone())
            .ok_or_else(|| ActError::NoRecord { daemon: owned() })?;
        let binary = resolve_binary(
            &self.cfg.mps.control_binary,
            self.cfg.driver_root.as_deref(),
        )
        .map_err(|e| ActError::Binary(e.into()))?;
        let control = Control::of_daemon(binary, &self.state, daemon, &identity);
        if identity.v3 {
            // One server: `client terminate <pid>` (docs/mps.md, "Two backends").
            let args = ["client".to_owned(), "terminate".to_owned(), pid.to_string()];
            return control
                .cli(&args, CONTROL_TIMEOUT)
                .map(|_| ())
                .map_err(|e| {
                    silent.insert(owned());
                    let e = ActError::Terminate {
                        daemon: owned(),
                        error: e.into(),
                    };
                    tracing::warn!(
                        pid,
                        daemon,
                        "watch: client terminate failed: {}",
                        crate::util::error_chain(&e)
                    );
                    e
                });
        }
        let servers = control
            .command("get_server_list", CONTROL_TIMEOUT)
            .map_err(|e| {
                silent.insert(owned());
                ActError::ServerList {
                    daemon: owned(),
                    error: e.into(),
                }
            })?;
        let mut last = ActError::NoServer { daemon: owned() };
        for server in crate::mps::reply::pids(&servers) {
            match control.command(&format!("terminate_client {server} {pid}"), CONTROL_TIMEOUT) {
                Ok(out) if out.trim() == "0" => return Ok(()),
                Ok(out) => {
                    last = ActError::Refused {
                        daemon: owned(),
                        answer: crate::util::escape(&crate::util::one_line(&out)),
                    }
                }
                Err(e) => {
                    silent.insert(owned());
                    last = ActError::Terminate {
                        daemon: owned(),
                        error: e.into(),
                    };
                    break;
                }
            }
        }
        tracing::warn!(
            pid,
            daemon,
            "watch: terminate_client failed: {}",
            crate::util::error_chain(&last)
        );
        Err(last)
    }
}

/// The soft limit on open descriptors raised to the hard one: the watcher holds a pidfd
/// per container init and per listed process (two thousand at a thousand containers). A
/// process it could not pin for want of one is judged, never acted on.
fn raise_descriptor_limit() {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let now = getrlimit(Resource::Nofile);
    if now.current < now.maximum {
        let raised = Rlimit {
            current: now.maximum,
            maximum: now.maximum,
        };
        if let Err(e) = setrlimit(Resource::Nofile, raised) {
            tracing::warn!("watch: cannot raise its descriptor limit: {e}");
        }
    }
}
