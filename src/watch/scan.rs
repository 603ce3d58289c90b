//! One look at the node: every process NVML lists on each GPU (`list`, GPU by GPU: one
//! that does not answer costs its own processes, never another's), and what each belongs
//! to (`Node::owner_of_cgroup`, from the cgroup its pin read): an MPS server of one of
//! gpushare's daemons, a container gpushare serves, or nothing gpushare serves (the host,
//! another container). The host's process primitives that `act` uses too are here: a
//! process's cgroup (`cgroup_of`) and its pidfd (`Proc`).
//!
//! Invariants: a process belongs to a container by its cgroup — the container's own, or
//! one below it — never by anything the process says of itself (its name, its
//! environment); a container whose cgroup cannot tell its processes from others' (the
//! root cgroup, the watcher's own, PID 1's, or one two served containers share) owns no
//! process; an MPS server is a process in a daemon's `gpushare/<id>-<pid>` cgroup, which
//! only root makes.

use std::collections::{HashMap, HashSet};
use std::os::fd::{AsFd, OwnedFd};

use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::struct_wrappers::device::ProcessInfo;
use nvml_wrapper::Nvml;

use crate::identity::Identity;
use crate::state::{ContainerRecord, ProcRef, StateDir};

/// One process as NVML lists it on one GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Listed {
    pub pid: u32,
    pub gpu: String,
    pub gpu_index: u32,
    /// In NVML's MPS list (an MPS client) as well as in the compute list.
    pub mps: bool,
    pub used: Option<u64>,
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum ScanError {
    #[error("cannot count the GPUs through NVML")]
    Count(#[source] NvmlError),
    #[error("cannot list the processes of GPU {index} through NVML ({what})")]
    Gpu {
        index: u32,
        what: &'static str,
        #[source]
        error: NvmlError,
    },
}

/// A GPU whose processes could not be listed in one scan: none of its processes gets a
/// verdict in that scan; the other GPUs' do.
#[derive(Debug)]
pub(crate) struct Unlisted {
    pub index: u32,
    /// Its UUID, where NVML gave it before the listing failed.
    pub gpu: Option<String>,
    pub error: ScanError,
}

/// What one scan found: the processes of every GPU that answered, and the GPUs that did not.
#[derive(Debug, Default)]
pub(crate) struct Listing {
    pub processes: Vec<Listed>,
    pub unlisted: Vec<Unlisted>,
}

/// How often a GPU's list is asked for when NVML answers that it grew between its two
/// calls (a process that starts in between), and how often the whole GPU is listed again
/// after any other error, before the GPU counts as not listed in this scan.
const TRIES: usize = 3;

/// Every process with a compute context on the node's GPUs, GPU by GPU: a GPU that does
/// not answer costs its own processes' verdicts, never another GPU's. An MPS client is in
/// both of NVML's lists, a server or a process outside MPS in the compute list only
/// (docs/mps.md, "The GPU process watcher"). `pin` is called on each GPU's processes as
/// soon as that GPU is listed, so that what it reads is as near the listing as can be.
pub(crate) fn list<P>(
    nvml: &Nvml,
    mut pin: impl FnMut(&Listed) -> P,
) -> Result<(Listing, Vec<P>), ScanError> {
    let count = nvml.device_count().map_err(ScanError::Count)?;
    let mut out = Listing::default();
    let mut pinned = Vec::new();
    for index in 0..count {
        let mut last = None;
        for _ in 0..TRIES {
            match list_gpu(nvml, index) {
                Ok(processes) => {
                    pinned.extend(processes.iter().map(&mut pin));
                    out.processes.extend(processes);
                    last = None;
                    break;
                }
                Err(e) => last = Some(e),
            }
        }
        if let Some((gpu, error)) = last {
            out.unlisted.push(Unlisted { index, gpu, error });
        }
    }
    Ok((out, pinned))
}

/// One GPU's processes; on failure, its UUID where NVML gave it.
fn list_gpu(nvml: &Nvml, index: u32) -> Result<Vec<Listed>, (Option<String>, ScanError)> {
    let err = |what| move |error| ScanError::Gpu { index, what, error };
    let device = nvml
        .device_by_index(index)
        .map_err(|e| (None, err("open it")(e)))?;
    let gpu = device.uuid().map_err(|e| (None, err("read its UUID")(e)))?;
    let failed = |what| {
        let gpu = gpu.clone();
        move |e| (Some(gpu), err(what)(e))
    };
    // nvml-wrapper 0.13 sizes each list's buffer to exactly the count it asked for first:
    // a process that starts in between makes it InsufficientSize. Ask again.
    let again = |call: &dyn Fn() -> Result<Vec<ProcessInfo>, NvmlError>| {
        let mut got = Err(NvmlError::InsufficientSize(None));
        for _ in 0..TRIES {
            got = call();
            if !matches!(got, Err(NvmlError::InsufficientSize(_))) {
                break;
            }
        }
        got
    };
    let compute =
        again(&|| device.running_compute_processes()).map_err(failed("compute processes"))?;
    let mps = again(&|| device.mps_running_compute_processes()).map_err(failed("MPS processes"))?;
    let clients: HashSet<u32> = mps.iter().map(|p| p.pid).collect();
    let mut seen = HashSet::new();
    let mut out = Vec::with_capacity(compute.len());
    for p in compute.iter().chain(mps.iter()) {
        if !seen.insert(p.pid) {
            continue;
        }
        out.push(Listed {
            pid: p.pid,
            gpu: gpu.clone(),
            gpu_index: index,
            mps: clients.contains(&p.pid),
            used: match p.used_gpu_memory {
                UsedGpuMemory::Used(b) => Some(b),
                UsedGpuMemory::Unavailable => None,
            },
        });
    }
    Ok(out)
}

/// A container gpushare serves, as the watcher attributes processes to it.
#[derive(Debug, Clone)]
pub(crate) struct Served {
    pub record: ContainerRecord,
    pub daemon: String,
    pub identity: std::sync::Arc<Identity>,
}

impl Served {
    /// The pinned memory limit of the container: its v3 namespace's, else its daemon's.
    pub(crate) fn pinned_memory_limit(&self) -> Option<u64> {
        let key = &crate::request::PINNED_MEMORY_LIMIT;
        match &self.record.mps_namespace {
            Some(ns) => ns.limits.get(key),
            None => self.identity.limit(key),
        }
    }
}

/// What a listed process belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Owner {
    /// The MPS server (or another process) of daemon `Node::daemons[i]`.
    Daemon(usize),
    /// The served container `Node::served[i]`.
    Container(usize),
    None,
}

/// The served containers and the daemons, by cgroup.
#[derive(Debug, Default)]
pub(crate) struct Node {
    pub served: Vec<Served>,
    pub daemons: Vec<String>,
    /// Container cgroup → `served` index; `None` where two served containers share it.
    pub(super) by_cgroup: HashMap<String, Option<usize>>,
}

/// What a scan keeps for the next: the containers' init processes, each pinned by a
/// pidfd with its cgroup (a process does not move; the pidfd says when it ends, without
/// reading /proc again), each daemon's identity (an id names one identity for good), and
/// each daemon's container records with the time its `containers/` directory last changed.
#[derive(Debug, Default)]
pub(crate) struct Cache {
    inits: HashMap<ProcRef, Init>,
    daemons: HashMap<String, Daemon>,
}

#[derive(Debug)]
struct Daemon {
    identity: std::sync::Arc<Identity>,
    /// `containers/`'s mtime when `containers` were read; `None`: read them again.
    stamp: Option<std::time::SystemTime>,
    containers: Vec<ContainerRecord>,
}

/// A container's init process, as first found alive.
/// The host's processes: a pidfd pins one as soon as it is listed (`Init`, the actions
/// in `act`), and tells whether the pinned process has ended.
pub(crate) struct Proc;

impl Proc {
    /// `pidfd_open(pid)`.
    pub(crate) fn pidfd(pid: i32) -> std::io::Result<OwnedFd> {
        use rustix::process::{pidfd_open, Pid, PidfdFlags};
        let pid = Pid::from_raw(pid)
            .ok_or_else(|| std::io::Error::from_raw_os_error(nix::libc::ESRCH))?;
        Ok(pidfd_open(pid, PidfdFlags::empty())?)
    }

    /// Whether the pidfd's process has ended: its pidfd is readable from then on. An
    /// error counts as ended (never acted on).
    pub(crate) fn has_ended(fd: &OwnedFd) -> bool {
        use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
        let mut fds = [PollFd::new(fd.as_fd(), PollFlags::POLLIN)];
        !matches!(poll(&mut fds, PollTimeout::ZERO), Ok(0))
    }
}

#[derive(Debug)]
struct Init {
    /// `None` where no pidfd could be had (out of descriptors): its start time is read
    /// again each scan instead.
    pidfd: Option<std::os::fd::OwnedFd>,
    cgroup: Option<String>,
}

impl Init {
    /// `init` pinned, where it runs: its start time is read after the pidfd is open and
    /// trusted only if the pidfd's process still runs after the reads.
    fn open(init: ProcRef) -> Option<Init> {
        let pidfd = match Proc::pidfd(init.pid) {
            Ok(fd) => Some(fd),
            Err(e) if e.raw_os_error() == Some(nix::libc::ESRCH) => return None,
            Err(_) => None,
        };
        if crate::util::proc_start_time(init.pid) != Some(init.start_time) {
            return None;
        }
        let cgroup = cgroup_of(init.pid);
        match &pidfd {
            Some(fd) if Proc::has_ended(fd) => None,
            _ => Some(Init { pidfd, cgroup }),
        }
    }

    fn runs(&self, init: ProcRef) -> bool {
        match &self.pidfd {
            Some(fd) => !Proc::has_ended(fd),
            None => init.alive(),
        }
    }
}

/// A directory changed within this long of a read may change again in the same tick of
/// its mtime: its records are read again rather than trusted.
const SETTLED: std::time::Duration = std::time::Duration::from_secs(1);

impl Node {
    /// Reads every daemon's record and containers, from `cache` where nothing changed.
    pub(crate) fn read(state: &StateDir, cache: &mut Cache) -> Node {
        let mut node = Node::default();
        let mut seen = HashMap::new();
        // Cgroups that hold more than one container's worth of processes.
        let shared: HashSet<String> = [Some(std::process::id() as i32), Some(1)]
            .into_iter()
            .flatten()
            .filter_map(cgroup_of)
            .chain(std::iter::once("/".to_owned()))
            .collect();
        let ids = state.daemon_ids().unwrap_or_default();
        cache.daemons.retain(|id, _| ids.contains(id));
        for id in ids {
            let daemon = match cache.daemons.remove(&id) {
                Some(d) => d,
                None => {
                    let Ok(Some(rec)) = state.read_record(&id) else {
                        continue;
                    };
                    Daemon {
                        identity: std::sync::Arc::new(rec.identity),
                        stamp: None,
                        containers: Vec::new(),
                    }
                }
            };
            let mut daemon = daemon;
            let now = std::time::SystemTime::now();
            let mtime = std::fs::metadata(state.containers_dir(&id))
                .and_then(|m| m.modified())
                .ok();
            let settled =
                mtime.is_some_and(|m| now.duration_since(m).is_ok_and(|age| age >= SETTLED));
            if daemon.stamp.is_none() || daemon.stamp != mtime || !settled {
                daemon.containers = state.containers(&id).unwrap_or_default();
                daemon.stamp = mtime.filter(|_| settled);
            }
            for record in &daemon.containers {
                let (Some(pid), Some(start_time)) = (record.pid, record.start_time) else {
                    continue;
                };
                let init = ProcRef { pid, start_time };
                let found = match cache.inits.remove(&init) {
                    Some(i) if i.runs(init) => Some(i),
                    Some(_) => None,
                    None => Init::open(init),
                };
                let Some(found) = found else {
                    continue;
                };
                let cgroup = found.cgroup.clone();
                seen.insert(init, found);
                let Some(cgroup) = cgroup.filter(|c| !shared.contains(c)) else {
                    continue;
                };
                let index = node.served.len();
                node.by_cgroup
                    .entry(cgroup)
                    .and_modify(|e| *e = None)
                    .or_insert(Some(index));
                node.served.push(Served {
                    record: record.clone(),
                    daemon: id.clone(),
                    identity: daemon.identity.clone(),
                });
            }
            node.daemons.push(id.clone());
            cache.daemons.insert(id, daemon);
        }
        cache.inits = seen;
        node
    }

    pub(crate) fn owner_of_cgroup(&self, cgroup: &str) -> Owner {
        if let Some(id) = daemon_of_cgroup(cgroup) {
            if let Some(i) = self.daemons.iter().position(|d| d == id) {
                return Owner::Daemon(i);
            }
        }
        // The container's own cgroup or one below it.
        let mut path = cgroup;
        loop {
            if let Some(found) = self.by_cgroup.get(path) {
                return found.map_or(Owner::None, Owner::Container);
            }
            match path.rsplit_once('/') {
                Some((parent, _)) if !parent.is_empty() => path = parent,
                _ => return Owner::None,
            }
        }
    }
}

/// The daemon id of a supervisor's cgroup `/gpushare/<id>-<supervisor pid>[/…]`.
fn daemon_of_cgroup(cgroup: &str) -> Option<&str> {
    let rest = cgroup.strip_prefix("/gpushare/")?;
    let leaf = rest.split('/').next()?;
    let (id, pid) = leaf.split_once('-')?;
    (crate::identity::valid_id(id) && pid.parse::<u32>().is_ok()).then_some(id)
}

/// The cgroup of process `pid`: its unified-hierarchy path where that is the only one
/// (cgroup v2), else its `memory` hierarchy's (v1, where engines and gpushare make a
/// cgroup per container and per daemon in every hierarchy).
pub(crate) fn cgroup_of(pid: i32) -> Option<String> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    cgroup_from(&text)
}

fn cgroup_from(text: &str) -> Option<String> {
    let mut unified = None;
    let mut memory = None;
    for line in text.lines() {
        let mut f = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        if controllers.is_empty() {
            unified = Some(path);
        } else if controllers.split(',').any(|c| c == "memory") {
            memory = Some(path);
        }
    }
    memory.or(unified).map(str::to_owned)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cgroup_lines() {
        assert_eq!(
            cgroup_from("0::/system.slice/runc-abc.scope\n").as_deref(),
            Some("/system.slice/runc-abc.scope")
        );
        let v1 = "12:pids:/docker/abc\n4:cpu,cpuacct:/docker/abc\n3:memory:/docker/abc\n0::/\n";
        assert_eq!(cgroup_from(v1).as_deref(), Some("/docker/abc"));
        assert_eq!(cgroup_from("garbage\n"), None);
        assert_eq!(cgroup_from(""), None);
    }

    #[test]
    fn daemon_cgroups() {
        let id = "0123456789abcdef0123456789abcdef";
        assert_eq!(daemon_of_cgroup(&format!("/gpushare/{id}-42")), Some(id));
        assert_eq!(daemon_of_cgroup(&format!("/gpushare/{id}-42/x")), Some(id));
        for bad in [
            format!("/x/gpushare/{id}-42"),
            format!("/gpushare/{id}"),
            format!("/gpushare/{id}-x"),
            "/gpushare/zz-1".to_owned(),
        ] {
            assert_eq!(daemon_of_cgroup(&bad), None, "{bad}");
        }
    }

    #[test]
    fn owners_by_cgroup() {
        let mut node = Node {
            daemons: vec!["0123456789abcdef0123456789abcdef".into()],
            ..Node::default()
        };
        node.by_cgroup.insert("/k/pod1/c1".into(), Some(0));
        node.by_cgroup.insert("/k/pod1/c2".into(), None);
        let cases = [
            ("/k/pod1/c1", Owner::Container(0)),
            ("/k/pod1/c1/sub/x", Owner::Container(0)),
            ("/k/pod1/c10", Owner::None),
            ("/k/pod1", Owner::None),
            ("/k/pod1/c2/y", Owner::None),
            ("/", Owner::None),
            (
                "/gpushare/0123456789abcdef0123456789abcdef-7",
                Owner::Daemon(0),
            ),
            ("/gpushare/ffffffffffffffffffffffffffffffff-7", Owner::None),
        ];
        for (cgroup, want) in cases {
            assert_eq!(node.owner_of_cgroup(cgroup), want, "{cgroup}");
        }
    }
}
