//! `gpushare gc`: clean the state a crash or a reboot left behind — stale container
//! records, daemons whose supervisor is gone, half-removed directories, empty cgroups of
//! gone supervisors, the state of an NRI plugin that no longer runs.
//!
//! Invariants: what is found is detected and cleaned, never trusted; a daemon still used
//! by live containers is restarted, never removed; a daemon is removed only under its
//! identity's lock (`StateDir::remove_if_unused`), its record read again under that lock
//! (a supervisor started meanwhile keeps it); one line on stdout per action and one
//! `gpushare: gc: <what>: <reason>` line on stderr per failure, and a failure stops none
//! of the other cleanups.

use crate::config::Config;
use crate::state::StateDir;

/// `gpushare gc`: what a crash or a reboot left behind is detected and cleaned, never
/// trusted. Prints one line per action on stdout and one line per failure on stderr; a
/// daemon or directory that cannot be cleaned stops none of the others. Returns how many
/// things could not be cleaned.
pub(crate) fn run(cfg: &Config) -> usize {
    let state = StateDir::new(&cfg.state_dir);
    let mut failures = 0;
    let mut failed = |what: String, e: anyhow::Error| {
        tracing::error!("gc: {what}: {e:#}");
        eprintln!("gpushare: gc: {what}: {e:#}");
        failures += 1;
    };
    for (tomb, removed) in state.remove_tombstones() {
        match removed {
            Ok(()) => println!("removed half-removed directory {}", tomb.display()),
            Err(e) => failed(
                format!("half-removed directory {}", tomb.display()),
                e.into(),
            ),
        }
    }
    match state.daemon_ids() {
        Ok(ids) => {
            for id in ids {
                if let Err(e) = daemon(cfg, &state, &id) {
                    failed(format!("daemon {id}"), e);
                }
            }
        }
        Err(e) => failed(
            format!("state directory {}", state.root().display()),
            e.into(),
        ),
    }
    match forget_stopped_nri_plugin(&state) {
        Ok(Some(pid)) => println!(
            "removed the state of the NRI plugin that no longer runs (pid {pid}); `doctor` stops warning about it"
        ),
        Ok(None) => {}
        Err(e) => failed(
            format!("NRI plugin state {}", state.nri_state_path().display()),
            e.into(),
        ),
    }
    for top in crate::mps::supervisor::gpushare_cgroups() {
        let n = crate::mps::supervisor::sweep_stale_cgroups(&top);
        if n > 0 {
            println!(
                "removed {n} empty cgroup(s) of gone supervisors in {}",
                top.display()
            );
        }
    }
    failures
}

/// Removes `<state-dir>/nri.json` when the plugin that wrote it no longer runs: the plugin
/// was stopped or removed, so `doctor` and `status` stop warning that it ran here before.
/// Returns the gone plugin's pid (0 when the file names none). A plugin that runs keeps
/// its file; one that starts meanwhile writes it again at its next connection change.
pub(crate) fn forget_stopped_nri_plugin(state: &StateDir) -> std::io::Result<Option<i32>> {
    let Some(plugin) = crate::nri::PluginState::read(state) else {
        return Ok(None);
    };
    if plugin.process.is_some_and(|p| p.alive()) {
        return Ok(None);
    }
    match std::fs::remove_file(state.nri_state_path()) {
        Ok(()) => Ok(Some(plugin.process.map_or(0, |p| p.pid))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// `gc` for one daemon: its stale container records, then the daemon itself if its
/// supervisor is gone (restarted when containers still use it, else removed).
fn daemon(cfg: &Config, state: &StateDir, id: &str) -> anyhow::Result<()> {
    use crate::mps::ensure;
    let grace = cfg.mps.pending_grace().as_secs();
    let (live, stale) = state.sweep_containers(id, grace)?;
    if stale > 0 {
        println!("daemon {id}: removed {stale} stale container record(s)");
    }
    let rec = match state.read_record(id) {
        Ok(r) => r,
        Err(e) => {
            println!("daemon {id}: unreadable record ({e}); treating it as stale");
            None
        }
    };
    let supervised = rec
        .as_ref()
        .is_some_and(|r| r.supervisor.is_some_and(|p| p.alive()));
    if supervised {
        return Ok(());
    }
    if let Some(rec) = rec.as_ref().filter(|_| !live.is_empty()) {
        // Containers still rely on it: bring the daemon back rather than drop them.
        ensure::ensure(cfg, state, &rec.identity, None)?;
        println!(
            "daemon {id}: supervisor was gone with {} container(s) using it; restarted",
            live.len()
        );
        return Ok(());
    }
    let _lock = state.lock(id, std::time::Instant::now() + cfg.mps.start_timeout)?;
    // Looked at again under the lock: a create or `daemon start` that held it meanwhile
    // may have started a new supervisor, whose directories must stay; one that has not
    // named itself in the record yet holds the supervisor lock.
    let rec = state.read_record(id).ok().flatten();
    if rec
        .as_ref()
        .is_some_and(|r| r.supervisor.is_some_and(|p| p.alive()))
        || matches!(state.try_lock_supervisor(id), Ok(None))
    {
        return Ok(());
    }
    if let Some(rec) = &rec {
        ensure::kill_stale(rec);
    }
    if state.remove_if_unused(id, grace, |_| {})? {
        println!("daemon {id}: supervisor gone and no containers; removed");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nri::PluginState;
    use crate::state::ProcRef;

    /// The state of a plugin that no longer runs goes (a reused pid with another start
    /// time is no longer it); that of a running one stays; no file is no error.
    #[test]
    fn the_state_of_a_stopped_nri_plugin_goes_and_a_running_one_s_stays() {
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::new(dir.path());
        let write = |process: Option<ProcRef>| {
            let s = PluginState {
                process,
                socket: "/run/nri/nri.sock".into(),
                connected: true,
                runtime: None,
                since: 0,
                error: None,
                unserved: Vec::new(),
                evicted: 0,
            };
            std::fs::write(state.nri_state_path(), serde_json::to_vec(&s).unwrap()).unwrap();
        };
        assert_eq!(forget_stopped_nri_plugin(&state).unwrap(), None);
        let me = ProcRef::of(std::process::id() as i32).unwrap();
        write(Some(me));
        assert_eq!(forget_stopped_nri_plugin(&state).unwrap(), None);
        assert!(state.nri_state_path().exists(), "a running plugin keeps it");
        write(Some(ProcRef {
            start_time: me.start_time + 1,
            ..me
        }));
        assert_eq!(forget_stopped_nri_plugin(&state).unwrap(), Some(me.pid));
        assert!(!state.nri_state_path().exists());
        write(None);
        assert_eq!(forget_stopped_nri_plugin(&state).unwrap(), Some(0));
    }
}
