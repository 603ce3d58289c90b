//! What the load tier measures about one `Env`, from the outside: its records (the state
//! dir), the processes that serve it (found in /proc by their environment), their open fds
//! and mount namespaces, its mounts on the host, the daemons' cgroups, and runc's list of
//! its containers. Nothing here asks gpushare: a leak is what is left on the node, whatever
//! gpushare believes.
//!
//! Invariants: one scan reads each file once and tolerates a process or directory that
//! vanishes while it is read (the soak runs while it samples); a process belongs to an
//! `Env` when its environment names that env's config (`GPUSHARE_CONFIG`: the shim, the
//! hooks, the supervisors) or a pipe directory under its state dir (the control daemons and
//! the simulator's servers they start), so other tests running beside it never count.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

use testkit::{other_processes, which, Env};

/// The processes of one env by role, from /proc.
#[derive(Clone, Debug, Default)]
pub struct Procs {
    /// `gpushare daemon supervise --id <id>`: daemon id → pids.
    pub supervisors: BTreeMap<String, Vec<i32>>,
    /// The control daemons (the simulator with `-f`): daemon id → pids.
    pub daemons: BTreeMap<String, Vec<i32>>,
    /// The simulator's MPS servers.
    pub servers: usize,
    /// Anything else carrying the env's config: shims, hooks, runc in flight.
    pub others: usize,
}

impl Procs {
    pub fn scan(env: &Env) -> Procs {
        let config = format!("GPUSHARE_CONFIG={}", env.config.display());
        let pipe_prefix = format!("CUDA_MPS_PIPE_DIRECTORY={}/mps/", env.state.display());
        let mut out = Procs::default();
        for (pid, _) in other_processes() {
            let Ok(environ) = std::fs::read(format!("/proc/{pid}/environ")) else {
                continue;
            };
            let vars: Vec<&[u8]> = environ.split(|&b| b == 0).collect();
            let pipe_id = vars.iter().find_map(|v| {
                let v = std::str::from_utf8(v).ok()?;
                let rest = v.strip_prefix(&pipe_prefix)?;
                Some(rest.split('/').next()?.to_owned())
            });
            let has_config = vars.contains(&config.as_bytes());
            if pipe_id.is_none() && !has_config {
                continue;
            }
            let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
                continue;
            };
            let argv: Vec<String> = cmdline
                .split(|&b| b == 0)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            let arg = |s: &str| argv.iter().any(|a| a == s);
            if arg("supervise") {
                let id = argv
                    .iter()
                    .skip_while(|a| *a != "--id")
                    .nth(1)
                    .cloned()
                    .unwrap_or_default();
                out.supervisors.entry(id).or_default().push(pid);
            } else if arg("--internal-server") {
                out.servers += 1;
            } else if let (Some(id), true) = (pipe_id, arg("-f")) {
                // A control daemon's child between fork and exec (a server being started)
                // still shows the daemon's argv and environment: not a second daemon.
                let forked = ppid(pid).is_some_and(|p| {
                    std::fs::read(format!("/proc/{p}/cmdline")).is_ok_and(|c| c == cmdline)
                });
                if !forked {
                    out.daemons.entry(id).or_default().push(pid);
                }
            } else {
                out.others += 1;
            }
        }
        out
    }

    pub fn total(&self) -> usize {
        let n = |m: &BTreeMap<String, Vec<i32>>| m.values().map(Vec::len).sum::<usize>();
        n(&self.supervisors) + n(&self.daemons) + self.servers + self.others
    }

    /// Daemon ids served by more than one control daemon process at once.
    pub fn doubled(&self) -> Vec<(String, Vec<i32>)> {
        self.daemons
            .iter()
            .filter(|(_, pids)| pids.len() > 1)
            .map(|(id, pids)| (id.clone(), pids.clone()))
            .collect()
    }
}

/// One sample of everything that must not grow.
#[derive(Clone, Debug, Default)]
pub struct Sample {
    /// Seconds since the run began.
    pub t: f64,
    /// `containers/*.json` over every daemon.
    pub container_records: usize,
    /// Daemon directories `mps/<id>` (each holds one `daemon.json`).
    pub daemon_records: usize,
    /// `mps/.<id>.removing` left behind.
    pub removing: usize,
    /// Entries of `locks/`: `<id>.lock` and `<id>.sup` per identity, `node.lock`.
    pub locks: usize,
    /// Every entry under the state dir, recursively (records, pipe files, logs, shm).
    pub state_entries: usize,
    /// Files in the daemons' shm tmpfs, together.
    pub shm_files: usize,
    /// Distinct identities among the daemon records (must equal `daemon_records`).
    pub identities: usize,
    /// Daemon id → (supervisor pid, daemon pid, restarts) from its record.
    pub records: BTreeMap<String, (i64, i64, i64)>,
    pub procs: Procs,
    /// Open fds per process, by role and daemon id ("sup:<id>", "daemon:<id>").
    pub fds: BTreeMap<String, usize>,
    /// Mounts in each supervisor's mount namespace under the env's temp dir or at
    /// /dev/shm (the daemon's shm), by daemon id.
    pub sup_mounts: BTreeMap<String, usize>,
    /// Resident memory of each supervisor in KiB, by daemon id (reported, not asserted).
    pub sup_rss_kib: BTreeMap<String, u64>,
    /// Mount points under the env's temp dir in this (the host's) mount namespace.
    pub host_mounts: usize,
    /// Daemon cgroups `gpushare/<id>-<pid>` of `ids`, in every hierarchy.
    pub cgroups: usize,
    /// Cgroups runc made for containers named `<prefix>…`, in every hierarchy.
    pub container_cgroups: usize,
    /// Containers in runc's list (its root under the env's temp dir).
    pub runc_containers: usize,
}

impl Sample {
    /// `ids`: the daemon ids ever seen in this env (its cgroups are named after them).
    pub fn take(env: &Env, t: f64, ids: &BTreeSet<String>, container_prefix: &str) -> Sample {
        let mps = env.state.join("mps");
        let mut s = Sample {
            t,
            ..Sample::default()
        };
        let mut identities = BTreeSet::new();
        for e in std::fs::read_dir(&mps).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') {
                s.removing += usize::from(name.ends_with(".removing"));
                continue;
            }
            s.daemon_records += 1;
            s.container_records += records_in(&e.path().join("containers"));
            s.shm_files += count_entries(&e.path().join("shm"));
            let rec = std::fs::read_to_string(e.path().join("daemon.json"))
                .ok()
                .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok());
            if let Some(rec) = rec {
                identities.insert(rec["identity"].to_string());
                let pid = |k: &str| rec[k]["pid"].as_i64().unwrap_or(-1);
                s.records.insert(
                    name,
                    (
                        pid("supervisor"),
                        pid("daemon"),
                        rec["restarts"].as_i64().unwrap_or(-1),
                    ),
                );
            }
        }
        s.identities = identities.len();
        s.locks = count_entries(&env.state.join("locks"));
        s.state_entries = count_tree(&env.state);
        s.procs = Procs::scan(env);
        for (id, pids) in &s.procs.supervisors {
            for &pid in pids {
                s.fds
                    .insert(format!("sup:{id}"), count_entries(&fd_dir(pid)));
                let mounts = mounts_below(&format!("/proc/{pid}/mountinfo"), env.path())
                    + mounts_below(&format!("/proc/{pid}/mountinfo"), Path::new("/dev/shm"));
                s.sup_mounts.insert(id.clone(), mounts);
                s.sup_rss_kib.insert(id.clone(), rss_kib(pid));
            }
        }
        for (id, pids) in &s.procs.daemons {
            for &pid in pids {
                s.fds
                    .insert(format!("daemon:{id}"), count_entries(&fd_dir(pid)));
            }
        }
        s.host_mounts = mounts_below("/proc/self/mountinfo", env.path());
        s.cgroups = cgroups_named(|name| {
            name.rsplit_once('-')
                .is_some_and(|(id, _)| ids.contains(id) || s.records.contains_key(id))
        });
        s.container_cgroups = cgroups_named(|name| name.starts_with(container_prefix));
        s.runc_containers = runc_list(env);
        s
    }

    /// The measures compared between the quiet start and the quiet end, by name.
    pub fn measures(&self) -> BTreeMap<String, usize> {
        let mut m = BTreeMap::new();
        m.insert("container records".into(), self.container_records);
        m.insert("daemon records".into(), self.daemon_records);
        m.insert("removing dirs".into(), self.removing);
        m.insert("lock files".into(), self.locks);
        m.insert("state-dir entries".into(), self.state_entries);
        m.insert("shm files".into(), self.shm_files);
        m.insert("supervisors".into(), count(&self.procs.supervisors));
        m.insert("control daemons".into(), count(&self.procs.daemons));
        m.insert("MPS servers".into(), self.procs.servers);
        m.insert("other processes".into(), self.procs.others);
        m.insert("host mounts".into(), self.host_mounts);
        m.insert("daemon cgroups".into(), self.cgroups);
        m.insert("container cgroups".into(), self.container_cgroups);
        m.insert("runc containers".into(), self.runc_containers);
        m.insert(
            "fds, all supervisors and daemons".into(),
            self.fds.values().sum(),
        );
        for (k, v) in &self.fds {
            m.insert(format!("fds {}", short(k)), *v);
        }
        for (k, v) in &self.sup_mounts {
            m.insert(format!("mounts in sup:{}", short(k)), *v);
        }
        m
    }

    /// One line for the run's log.
    pub fn line(&self) -> String {
        format!(
            "t={:.0}s records: containers {} daemons {} (identities {}) removing {} locks {} state-entries {} shm-files {} | procs: supervisors {} daemons {} servers {} others {} | fds {} | host mounts {} | cgroups: daemons {} containers {} | runc containers {} | supervisor RSS {} KiB",
            self.t,
            self.container_records,
            self.daemon_records,
            self.identities,
            self.removing,
            self.locks,
            self.state_entries,
            self.shm_files,
            count(&self.procs.supervisors),
            count(&self.procs.daemons),
            self.procs.servers,
            self.procs.others,
            self.fds.values().sum::<usize>(),
            self.host_mounts,
            self.cgroups,
            self.container_cgroups,
            self.runc_containers,
            self.sup_rss_kib.values().sum::<u64>(),
        )
    }
}

fn count(m: &BTreeMap<String, Vec<i32>>) -> usize {
    m.values().map(Vec::len).sum()
}

/// "sup:0123…cdef" → "sup:01234567" (ids are 32 hex digits; 8 tell them apart here).
fn short(key: &str) -> String {
    match key.split_once(':') {
        Some((role, id)) => format!("{role}:{}", &id[..id.len().min(8)]),
        None => key[..key.len().min(8)].to_owned(),
    }
}

fn fd_dir(pid: i32) -> std::path::PathBuf {
    format!("/proc/{pid}/fd").into()
}

/// Container records in a daemon's `containers/`: `<id>.json`, not the `.<id>.json.*.tmp`
/// of a record being written (atomically: a temporary file, then a rename).
pub fn records_in(dir: &Path) -> usize {
    std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .filter(|e| {
                    let n = e.file_name();
                    let n = n.to_string_lossy();
                    !n.starts_with('.') && n.ends_with(".json")
                })
                .count()
        })
        .unwrap_or(0)
}

fn count_entries(dir: &Path) -> usize {
    std::fs::read_dir(dir).map(|d| d.count()).unwrap_or(0)
}

/// Entries below `dir`, recursively, not following links.
fn count_tree(dir: &Path) -> usize {
    let mut n = 0;
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        n += 1;
        if e.file_type().is_ok_and(|t| t.is_dir()) {
            n += count_tree(&e.path());
        }
    }
    n
}

/// The parent of `pid` (field 4 of /proc/<pid>/stat, after the command's parentheses).
fn ppid(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?
        .1
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

fn rss_kib(pid: i32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

/// Mount points at or below `dir` in a mount namespace's `mountinfo` (its fifth field; one
/// line per mount, so a mount stacked twice counts twice). Only those: a namespace copied
/// from the host's also holds, and later loses, whatever other tests had mounted then.
pub fn mounts_below(mountinfo: &str, dir: &Path) -> usize {
    let prefix = dir.display().to_string();
    std::fs::read_to_string(mountinfo)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .filter(|m| *m == prefix || m.starts_with(&format!("{prefix}/")))
        .count()
}

/// Cgroup directories whose name `keep` accepts: `gpushare/<name>` and `<name>` at the
/// root of every hierarchy (v1 controllers, the v2 root or `unified`).
fn cgroups_named(keep: impl Fn(&str) -> bool) -> usize {
    let root = Path::new("/sys/fs/cgroup");
    let mut tops: Vec<std::path::PathBuf> = vec![root.to_path_buf(), root.join("gpushare")];
    for h in std::fs::read_dir(root).into_iter().flatten().flatten() {
        if h.file_type().is_ok_and(|t| t.is_dir()) {
            tops.push(h.path());
            tops.push(h.path().join("gpushare"));
        }
    }
    let mut n = 0;
    for top in tops {
        for e in std::fs::read_dir(&top).into_iter().flatten().flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) && keep(&e.file_name().to_string_lossy()) {
                n += 1;
            }
        }
    }
    n
}

fn runc_list(env: &Env) -> usize {
    let Some(runc) = which("runc") else {
        return 0;
    };
    Command::new(runc)
        .arg("--root")
        .arg(&env.runc_root)
        .args(["list", "-q"])
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .filter(|l| !l.trim().is_empty())
                .count()
        })
        .unwrap_or(0)
}

/// The `p`th percentile (nearest rank) of `xs` in milliseconds; 0 for none.
pub fn percentile_ms(xs: &[std::time::Duration], p: f64) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    let mut v: Vec<f64> = xs.iter().map(|d| d.as_secs_f64() * 1000.0).collect();
    v.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
    v[rank.clamp(1, v.len()) - 1]
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn percentiles_are_nearest_rank() {
        let ms = |v: &[u64]| {
            v.iter()
                .map(|&m| Duration::from_millis(m))
                .collect::<Vec<_>>()
        };
        let xs = ms(&(1..=100).collect::<Vec<_>>());
        assert_eq!(percentile_ms(&xs, 50.0), 50.0);
        assert_eq!(percentile_ms(&xs, 99.0), 99.0);
        assert_eq!(percentile_ms(&ms(&[7]), 99.0), 7.0);
        assert_eq!(percentile_ms(&ms(&[3, 1, 2]), 50.0), 2.0);
        assert_eq!(percentile_ms(&[], 50.0), 0.0);
    }
}
