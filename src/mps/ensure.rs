//! Finds or starts the MPS daemon for one identity, for the hook (docs/design.md,
//! "Identity", "Concurrency").
//!
//! Invariants: everything happens under the identity's lock, so any number of
//! simultaneous creates start exactly one daemon (the supervisor left by a create killed
//! before it named itself and the next create's own never both run one: the supervisor
//! lock, `supervisor::claim`); every wait has the `start-timeout`
//! deadline; a record is never trusted on its word — the supervisor and the daemon must be
//! the very processes it names (pid and start time), else the state is stale and replaced.
//! The warm path is a lock, a record read, two /proc reads and a container record.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use super::job::Job;
use super::launch::{launch, Launched};
use crate::config::Config;
use crate::identity::Identity;
use crate::state::{Budget, ContainerRecord, DaemonRecord, DaemonStatus, Owner, StateDir};
use crate::util::poll_until;

/// Ownership of an identity's directories.
pub(crate) fn owner(ident: &Identity) -> Owner {
    Owner {
        uid: ident.uid,
        gid: ident.gid,
        shared: ident.multi_user,
        shm: !ident.ipc_host,
        namespaces: ident.v3,
    }
}

/// What a new daemon may take, from `[mps]`: tmpfs sizes and the daemon caps.
pub(crate) fn budget(cfg: &Config) -> Budget {
    Budget {
        shm_size: cfg.mps.shm_size.tmpfs_option(),
        shm_bytes: cfg.mps.shm_size.bytes(),
        shm_per_uid: cfg.mps.shm_size_per_uid.as_ref().map(|s| s.bytes()),
        shm_total: cfg.mps.shm_size_total.as_ref().map(|s| s.bytes()),
        log_size: cfg.mps.log_size,
        max_daemons: cfg.mps.max_daemons,
        max_daemons_per_uid: cfg.mps.max_daemons_per_uid,
        lock_wait: cfg.mps.start_timeout,
        pending_grace: cfg.mps.pending_grace().as_secs(),
        stop_grace: STOP_GRACE,
        config: cfg
            .path
            .clone()
            .unwrap_or_else(|| crate::config::DEFAULT_PATH.into()),
        clients: Some(clients_of(cfg)),
    }
}

/// How a cap asks an idle daemon for its MPS clients (`Budget::clients`): through the
/// channel the supervisor uses, within `CLIENTS_DEADLINE`.
fn clients_of(cfg: &Config) -> std::sync::Arc<crate::state::AskClients> {
    let (binary, driver_root) = (cfg.mps.control_binary.clone(), cfg.driver_root.clone());
    std::sync::Arc::new(move |state: &StateDir, id: &str, ident: &Identity| {
        let binary = super::control::resolve_binary(&binary, driver_root.as_deref()).ok()?;
        let servers = super::control::Control::of_daemon(binary, state, id, ident)
            .clients(CLIENTS_DEADLINE)
            .ok()?;
        Some(servers.iter().any(|(_, n)| *n != Some(0)))
    })
}

/// How long an idle daemon has to list its servers and their clients before a cap or its
/// supervisor stops it.
pub(crate) const CLIENTS_DEADLINE: Duration = Duration::from_secs(2);

/// How long the supervisor of an idle daemon that a cap needs the place of, or that
/// `gpushare daemon stop` stops, has to quit its daemon before it is killed.
pub(crate) const STOP_GRACE: Duration = Duration::from_secs(5);

/// Starts the reaper of a daemon directory this process has just made (`launch`: by the
/// agent, else here with `gpushare`, this very binary); a reaper that cannot start is
/// logged: the caps and `gc` still take the directory back.
pub(crate) fn start_reaper(
    gpushare: impl FnOnce() -> anyhow::Result<std::path::PathBuf>,
    cfg: &Config,
    id: &str,
) {
    if let Err(e) = launch(cfg, gpushare, Job::Reap, id) {
        tracing::warn!(daemon = %id, error = %format!("{e:#}"), "cannot start the reaper of a new daemon directory");
    }
}

/// What `ensure` found or did.
#[derive(Debug)]
pub(crate) struct Ensured {
    pub record: DaemonRecord,
    /// A new supervisor was started for this call.
    pub started: bool,
}

/// Polls the record until the daemon is ready, the supervisor fails, or the deadline.
fn wait_ready(
    state: &StateDir,
    id: &str,
    mut spawned: Option<&mut Launched>,
    deadline: Instant,
    timeout: Duration,
) -> anyhow::Result<DaemonRecord> {
    // One look: the ready record, an error that ends the wait, or `None` to look again.
    let mut look = || -> anyhow::Result<Option<DaemonRecord>> {
        let rec = state
            .read_record(id)?
            .context("the daemon record disappeared")?;
        if rec.live() {
            return Ok(Some(rec));
        }
        if rec.status == DaemonStatus::Failed {
            bail!(
                "MPS daemon {id} failed to start: {}",
                rec.error.as_deref().unwrap_or("no reason recorded")
            );
        }
        let supervisor_gone = match spawned.as_mut() {
            // The one started here exited: gone, unless the record names another that
            // runs (one started for a create killed before it named itself, which holds
            // the supervisor lock: the one started here left it the daemon).
            Some(child) => child.exited() && !rec.supervisor.is_some_and(|p| p.alive()),
            None => rec.supervisor.is_some_and(|p| !p.alive()),
        };
        if supervisor_gone {
            // It may have written its last word just before exiting.
            let rec = state
                .read_record(id)?
                .context("the daemon record disappeared")?;
            bail!(
                "the supervisor of MPS daemon {id} exited: {}",
                rec.error.as_deref().unwrap_or("see the gpushare log")
            );
        }
        Ok(None)
    };
    // One waiter per identity (the lock is held), so the pauses can be short: the
    // record turns ready ~11 ms after the spawn with the simulator and ~90 ms with
    // NVIDIA's daemon, and a 10 ms cap let the create notice it 5.8 ms late (median, the
    // cold start's "hook: sees ready" part, BENCHMARKS.md); with 1 ms, under 1 ms late,
    // for about one record read (~30 us) per ms of the start.
    let ready = poll_until(
        deadline,
        Duration::from_micros(250),
        Duration::from_millis(1),
        || look().transpose(),
    );
    ready.unwrap_or_else(|| {
        bail!(
            "MPS daemon {id} was not ready within mps.start-timeout ({timeout:?}); see its log {} (NVIDIA's daemon writes there when run in the foreground) and {}",
            state.daemon_dir(id).join(crate::mps::supervisor::DAEMON_OUT).display(),
            state.log_dir(id).display()
        )
    })
}

/// How long a create that failed waits for the supervisor it started to leave by itself
/// (its cgroup drain takes up to 2 s) before it kills it.
const SUPERVISOR_GRACE: Duration = Duration::from_secs(3);

/// Kills the processes a stale record names, if they are still those very processes.
pub(crate) fn kill_stale(rec: &DaemonRecord) {
    rec.kill_processes();
}

/// Ensures the daemon for `ident` is running and ready, then records `container` (if
/// any: `gpushare daemon start` has none) as using it.
pub(crate) fn ensure(
    cfg: &Config,
    state: &StateDir,
    ident: &Identity,
    container: Option<&ContainerRecord>,
) -> anyhow::Result<Ensured> {
    ensure_as(cfg, state, ident, container, || {
        std::env::current_exe().context("find the gpushare binary")
    })
}

/// [`ensure`] for a container of a v3 daemon (its record names its namespace), then its
/// namespace made and capped: after this the namespace's directory exists, for the
/// engine to bind, and no client can attach to it uncapped. `gpushare` finds the binary
/// that runs the supervisor and the reaper (the shim is another binary).
pub(crate) fn ensure_namespace(
    cfg: &Config,
    state: &StateDir,
    ident: &Identity,
    container: &ContainerRecord,
    gpushare: impl Fn() -> anyhow::Result<std::path::PathBuf>,
) -> anyhow::Result<Ensured> {
    let ns = container
        .mps_namespace
        .as_ref()
        .context("a v3 daemon's container record names no namespace")?;
    let ensured = ensure_as(cfg, state, ident, Some(container), gpushare)?;
    let deadline = Instant::now() + cfg.mps.start_timeout;
    super::v3::admit(&control_of(cfg, state, ident)?, ns, deadline)?;
    Ok(ensured)
}

/// Deletes a v3 container's namespace once its container has ended, trying for at most
/// `RETIRE_WAIT` while a client lingers; what is left the supervisor's check deletes.
pub(crate) fn retire_namespace(
    cfg: &Config,
    state: &StateDir,
    ident: &Identity,
    name: &str,
) -> bool {
    control_of(cfg, state, ident)
        .is_ok_and(|control| super::v3::retire(&control, name, Instant::now() + RETIRE_WAIT))
}

/// How long the end of a container waits for its namespace to be deleted.
const RETIRE_WAIT: Duration = Duration::from_secs(1);

/// The root control of `ident`'s daemon.
fn control_of(
    cfg: &Config,
    state: &StateDir,
    ident: &Identity,
) -> anyhow::Result<super::control::Control> {
    let binary =
        super::control::resolve_binary(&cfg.mps.control_binary, cfg.driver_root.as_deref())?;
    Ok(super::control::Control::of_daemon(
        binary,
        state,
        &ident.id(),
        ident,
    ))
}

/// [`ensure`], the supervisor and reaper run by the binary `gpushare` finds.
fn ensure_as(
    cfg: &Config,
    state: &StateDir,
    ident: &Identity,
    container: Option<&ContainerRecord>,
    gpushare: impl Fn() -> anyhow::Result<std::path::PathBuf>,
) -> anyhow::Result<Ensured> {
    let id = ident.id();
    let timeout = cfg.mps.start_timeout;
    let deadline = Instant::now() + timeout;
    let _lock = state.lock(&id, deadline)?;
    tracing::debug!(daemon = %id, "identity lock taken");
    // Warm path: the same two-stat check the shim makes; the full build (with its
    // ownership repairs) only when something is missing.
    let new = !state.skeleton_ready(&id, !ident.ipc_host)
        && state.ensure_skeleton(&id, owner(ident), &budget(cfg))?;
    if new {
        start_reaper(&gpushare, cfg, &id);
    }
    let existing = match state.read_record(&id) {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(daemon = %id, error = %e, "replacing an unreadable daemon record");
            None
        }
    };
    if let Some(rec) = &existing {
        if !rec.identity.same_daemon(ident) {
            bail!(
                "daemon id {id} collides with another identity ({:?}); refusing to share it",
                rec.identity
            );
        }
    }
    let (record, started) = match existing {
        Some(rec) if rec.live() => (rec, false),
        Some(rec)
            if rec.supervisor.is_some_and(|p| p.alive()) && rec.status != DaemonStatus::Failed =>
        {
            // Starting or restarting: the supervisor is on it.
            (wait_ready(state, &id, None, deadline, timeout)?, false)
        }
        stale => {
            if let Some(rec) = &stale {
                tracing::info!(daemon = %id, status = ?rec.status, "replacing a stale MPS daemon");
                kill_stale(rec);
            }
            let rec = DaemonRecord {
                id: id.clone(),
                identity: ident.clone(),
                status: DaemonStatus::Starting,
                supervisor: None,
                daemon: None,
                started_at: crate::util::unix_now(),
                ready_at: None,
                restarts: stale.as_ref().map_or(0, |r| r.restarts),
                error: None,
                limits_unconfirmed_since: None,
            };
            state.write_record(&rec)?;
            let mut child = launch(cfg, &gpushare, Job::Supervise, &id)?;
            tracing::debug!(daemon = %id, pid = child.pid(), "supervisor spawned");
            match wait_ready(state, &id, Some(&mut child), deadline, timeout) {
                Ok(rec) => (rec, true),
                Err(e) => {
                    // No daemon left half-started: the supervisor takes its daemon along.
                    // It gets SIGTERM and a moment first: one that is giving up by itself
                    // (status failed) or is told to stop quits its daemon and removes its
                    // cgroup on the way out, which SIGKILL would leave behind.
                    child.stop(SUPERVISOR_GRACE);
                    if let Ok(Some(rec)) = state.read_record(&id) {
                        kill_stale(&rec);
                    }
                    return Err(e);
                }
            }
        }
    };
    if let Some(container) = container {
        state.add_container(&id, container)?;
    }
    Ok(Ensured { record, started })
}

/// A container's record that [`release`] removed.
#[derive(Debug)]
pub(crate) struct Released {
    /// The daemon it was recorded on.
    pub daemon: String,
    /// Its v3 namespace, where its daemon is v3.
    pub namespace: Option<crate::identity::Namespace>,
}

/// Removes a container's record from whichever daemon it used. Never fails the caller.
/// `daemon_id` (the decision annotation) is only where to look first: a container the shim
/// did not prepare (hook-only mode) may carry a forged one, so a record not found there is
/// looked for under every daemon.
pub(crate) fn release(
    state: &StateDir,
    daemon_id: Option<&str>,
    container_id: &str,
) -> Option<Released> {
    let named = daemon_id.filter(|id| crate::identity::valid_id(id));
    let take = |id: &str| {
        let namespace = state
            .read_container(id, container_id)
            .and_then(|r| r.mps_namespace);
        state
            .remove_container(id, container_id)
            .unwrap_or(false)
            .then(|| Released {
                daemon: id.to_owned(),
                namespace,
            })
    };
    if let Some(released) = named.and_then(take) {
        return Some(released);
    }
    state
        .daemon_ids()
        .unwrap_or_default()
        .iter()
        .filter(|id| Some(id.as_str()) != named)
        .find_map(|id| take(id))
}

/// The end of a container: its record released ([`release`]) and, on a v3 daemon, its
/// namespace deleted (`retire_namespace`). Never fails the caller; `false` when no record
/// of the container was found.
pub(crate) fn end(
    cfg: &Config,
    state: &StateDir,
    daemon_id: Option<&str>,
    container_id: &str,
) -> bool {
    let Some(released) = release(state, daemon_id, container_id) else {
        return false;
    };
    tracing::info!(daemon = %released.daemon, "container released");
    let Some(ns) = released.namespace else {
        return true;
    };
    let ident = state
        .read_record(&released.daemon)
        .ok()
        .flatten()
        .map(|r| r.identity);
    let deleted = ident.is_some_and(|ident| retire_namespace(cfg, state, &ident, &ns.name));
    if !deleted {
        tracing::info!(namespace = %ns.name, "MPS namespace not deleted yet; the supervisor deletes it");
    }
    true
}

/// Stops one daemon: SIGTERM to its supervisor (which quits the daemon cleanly), SIGKILL
/// past the grace period, then removes its directories and unmounts its tmpfs mounts, all
/// under the identity's lock so no create races the removal.
pub(crate) fn stop(
    cfg: &Config,
    state: &StateDir,
    id: &str,
    grace: Duration,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + cfg.mps.start_timeout + grace;
    let _lock = state.lock(id, deadline)?;
    if let Ok(Some(rec)) = state.read_record(id) {
        rec.stop_processes(grace);
    }
    state.remove_daemon_dir(id)?;
    tracing::info!(daemon = %id, "MPS daemon stopped and removed");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::ProcRef;

    fn ident() -> Identity {
        crate::identity::test_identity(1000, Some(25))
    }

    /// A state directory with `daemons` daemon directories (ids `0…0`, `1…1`, …).
    fn state(dir: &std::path::Path, daemons: usize) -> (StateDir, Vec<String>) {
        let state = StateDir::new(dir);
        let ids: Vec<String> = (0..daemons)
            .map(|i| i.to_string().repeat(crate::identity::ID_LEN))
            .collect();
        for id in &ids {
            std::fs::create_dir_all(state.containers_dir(id)).unwrap();
        }
        (state, ids)
    }

    fn container(id: &str) -> ContainerRecord {
        ContainerRecord::new(id.into(), Some(std::process::id() as i32), None, None)
    }

    #[test]
    fn release_finds_the_record_whatever_daemon_the_annotation_names() {
        let dir = tempfile::tempdir().unwrap();
        let (state, ids) = state(dir.path(), 2);
        let (a, b) = (&ids[0], &ids[1]);
        state.add_container(b, &container("c1")).unwrap();
        // The daemon the annotation names: found there.
        assert_eq!(
            release(&state, Some(b), "c1").map(|r| r.daemon).as_ref(),
            Some(b)
        );
        assert!(state.containers(b).unwrap().is_empty());
        // A forged annotation naming another daemon, or one that is no daemon id at
        // all: the record is looked for under every daemon, and only it goes.
        for forged in [Some(a.as_str()), Some("../../etc"), None] {
            state.add_container(b, &container("c1")).unwrap();
            state.add_container(b, &container("c2")).unwrap();
            assert!(release(&state, forged, "c1").is_some(), "{forged:?}");
            let left: Vec<String> = state
                .containers(b)
                .unwrap()
                .into_iter()
                .map(|r| r.id)
                .collect();
            assert_eq!(left, ["c2"]);
            state.remove_container(b, "c2").unwrap();
        }
        // Nowhere: false, nothing else touched.
        assert!(release(&state, Some(a), "c9").is_none());
    }

    fn record(id: &str, status: DaemonStatus, supervisor: Option<ProcRef>) -> DaemonRecord {
        DaemonRecord {
            id: id.into(),
            identity: ident(),
            status,
            supervisor,
            daemon: supervisor,
            started_at: 0,
            ready_at: None,
            restarts: 0,
            error: None,
            limits_unconfirmed_since: None,
        }
    }

    #[test]
    fn wait_ready_ends_at_ready_failed_a_gone_supervisor_or_the_deadline() {
        let dir = tempfile::tempdir().unwrap();
        let (state, _) = state(dir.path(), 0);
        // A record is read only under its identity's id.
        let id = &ident().id();
        std::fs::create_dir_all(state.daemon_dir(id)).unwrap();
        let me = ProcRef::of(std::process::id() as i32);
        // Not this process: the pid is, the start time is not.
        let gone = me.map(|p| ProcRef {
            start_time: p.start_time + 1,
            ..p
        });
        let wait = |timeout: Duration| {
            wait_ready(&state, id, None, Instant::now() + timeout, timeout)
                .map_err(|e| format!("{e:#}"))
        };
        state
            .write_record(&record(id, DaemonStatus::Ready, me))
            .unwrap();
        assert_eq!(
            wait(Duration::from_secs(5)).unwrap().status,
            DaemonStatus::Ready
        );

        let mut failed = record(id, DaemonStatus::Failed, me);
        failed.error = Some("nvidia-cuda-mps-control: no such device".into());
        state.write_record(&failed).unwrap();
        assert_eq!(
            wait(Duration::from_secs(5)).unwrap_err(),
            format!("MPS daemon {id} failed to start: nvidia-cuda-mps-control: no such device")
        );

        state
            .write_record(&record(id, DaemonStatus::Starting, gone))
            .unwrap();
        assert_eq!(
            wait(Duration::from_secs(5)).unwrap_err(),
            format!("the supervisor of MPS daemon {id} exited: see the gpushare log")
        );

        // Starting, its supervisor alive, never ready: the deadline, with where to look.
        state
            .write_record(&record(id, DaemonStatus::Starting, me))
            .unwrap();
        let err = wait(Duration::from_millis(50)).unwrap_err();
        assert!(
            err.starts_with(&format!(
                "MPS daemon {id} was not ready within mps.start-timeout (50ms)"
            )),
            "{err}"
        );

        std::fs::remove_file(state.record_path(id)).unwrap();
        assert_eq!(
            wait(Duration::from_secs(5)).unwrap_err(),
            "the daemon record disappeared"
        );
    }
}
