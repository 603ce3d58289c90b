//! The supervisor: one detached process per MPS control daemon.
//!
//! Started as `gpushare daemon supervise --id <id>` (by the node's agent, or by the hook)
//! with stdio on /dev/null and an explicit environment. It leaves its starter's session,
//! closes every inherited fd (`detach`), claims the identity, joins its own cgroup
//! (`cgroup`), sets up its confinement and runs `<control-binary> -f` confined
//! (`confine`), applies and checks the limits (`limits`), keeps the daemon's output and
//! logs bounded (`logs`), and watches, restarts and quits the daemon (`lifecycle`).
//!
//! Everything a tenant can write is hostile here: the pipe and log directories, the shm,
//! the control socket. Each part's header states what it guarantees against it.
//!
//! Invariants: the record's `daemon` is the live process or `None`, and every record
//! write names this supervisor (`update`); one supervisor per identity: each holds
//! `locks/<id>.sup` from before it names itself in the record until it exits (`claim`),
//! so one started for a create killed before its supervisor named itself never runs a
//! daemon beside the next create's.

mod cgroup;
mod confine;
mod context;
mod lifecycle;
mod limits;
mod logs;
mod namespaces;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use crate::config::Config;
use crate::identity::Identity;
use crate::mps::control::{resolve_binary, Control};
use crate::state::{DaemonStatus, ProcRef, StateDir};
use crate::util::{poll_until, unix_now};
use cgroup::{own_cgroup, CgroupGuard, CgroupLimits};
use context::Supervisor;
use limits::limit_commands;

pub(crate) use cgroup::{gpushare_cgroups, sweep_stale_cgroups};
pub(crate) use logs::DAEMON_OUT;

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
            control: Control::of_daemon(binary.clone(), &state, id, &ident),
            binary,
            state,
            id: id.to_owned(),
            multi_user_flag: cfg.mps.multi_user_flag.clone(),
            start_timeout: cfg.mps.start_timeout,
            log_size: cfg.mps.log_size,
            // A v3 daemon's namespaces are checked against the records as often.
            limit_check: (ident.v3 || !limit_commands(&ident).is_empty())
                .then_some(cfg.mps.limit_check_interval),
            ident,
            me,
            driver_root: cfg.driver_root.clone(),
            pending_grace: cfg.mps.pending_grace().as_secs(),
        }
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
