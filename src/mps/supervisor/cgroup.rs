//! The daemon's cgroups: the supervisor, its daemon and the daemon's MPS servers share one
//! `gpushare/<id>-<pid>` cgroup at the root of every hierarchy (the unified one, or each
//! v1 hierarchy), with `mps.daemon-memory-max` and `mps.daemon-pids-max` on it.
//!
//! Invariants: joining is best effort (a host that refuses keeps the daemon where it is,
//! with a warning); a cgroup with members is never removed, nor one whose supervisor runs;
//! the supervisor leaves and removes its own cgroups as its last step (`CgroupGuard`), and
//! empty ones whose supervisor was killed go with the next supervisor's join or `gc`
//! (`sweep_stale_cgroups`).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::util::poll_until;

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
pub(super) fn own_cgroup(id: &str, limits: CgroupLimits) -> Vec<PathBuf> {
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
        // started it, a subreaper) has not reaped it yet runs nothing.
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

/// Leaves and removes the daemon's cgroups when the supervisor returns, whichever way.
pub(super) struct CgroupGuard(pub(super) Vec<PathBuf>);

impl Drop for CgroupGuard {
    fn drop(&mut self) {
        leave_cgroups(&self.0);
    }
}

/// The processes in `cgroups` other than this one: what is left of a daemon's tree.
pub(super) fn other_members(cgroups: &[PathBuf]) -> Vec<i32> {
    let me = std::process::id() as i32;
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
}
