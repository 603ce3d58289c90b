//! What the NRI plugin does at each event: the container the runtime describes becomes an
//! OCI spec view (`spec_of`), which the one request pipeline reads as it reads the shim's
//! and the hooks' (`decision::resolve_nri`); the daemon is ensured in this process with
//! the same locks, records, caps and supervisor (`mps::ensure`); the answer is the
//! adjustment the shim would have written: the pipe directory read-only, the daemon's shm
//! over /dev/shm, the client env.
//!
//! Every `CreateContainer` is answered within its budget, half the runtime's NRI request
//! timeout (`Plugin::budget`): containerd drops a plugin that times out and then creates
//! containers without it, so a daemon that is not ready in time means a refused
//! container (one line; the kubelet retries it), never a late answer. `ensure` runs on a
//! thread of its own, which the answer stops waiting for at the budget (`Handoff`); one
//! identity has at most one such thread, and a create of an identity whose daemon is
//! still being waited for is refused at once, so one tenant's slow daemon costs the
//! runtime's serialized NRI calls one budget per start, not one per container. No lock
//! that another create or the reaper waits for is held across `ensure`.
//!
//! Invariants. A container that another gpushare path serves is left alone: one whose
//! spec already carries one of gpushare's OCI hooks (a CDI device of gpushare's, the
//! hook-only base spec) — hooks that no pod author can write through the CRI, whatever its
//! annotations say. A pod's annotations give only the request keys (`annotations`): the
//! runtime hands NRI all of them, and the allocation (`cdi.k8s.io/*`, the devices and
//! mounts) and the sandbox marker must come from what the runtime wrote; NRI's
//! `CreateContainer` is a container's, never a sandbox's, so no marker is read. A
//! per-user request without the container's user (NRI before containerd 2.3) is refused,
//! never served as UID 0. The records the plugin writes are marked as its own
//! (`ENGINE`), and only those are reconciled with the runtime's containers at
//! `Synchronize`: a record of the shim's or a hook's is never the plugin's to drop.
//!
//! The audit (`audit`, `audit_event`, `audit_every`) names a container with a request
//! that runs without the plugin's adjustment and, under `[nri] unserved = "evict"`, kills
//! its init process. It knows a container only by the id the runtime gave and the pid the
//! runtime reported for it, pinned by start time and checked again through a pidfd before
//! the signal: never by a name a pod's author writes, never a container without a request
//! or one carrying the adjustment. It adds no work to `CreateContainer`.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde_json::{json, Map, Value};

use super::api::{self, Container, ContainerAdjustment, PodSandbox};
use crate::bundle::SpecFile;
use crate::config::Config;
use crate::config::NriUnserved;
use crate::served::{Inside, MountPlan};
use crate::state::{valid_container_id, ContainerRecord, PodNames, ProcRef, StateDir};

/// The `engine` of the container records the plugin writes: how `Synchronize` tells its
/// own records from the shim's and the hooks'.
pub(crate) const ENGINE: &str = "kubernetes-nri";

/// containerd's default NRI request timeout (`plugin_request_timeout`), for a runtime
/// whose `Configure` does not say its own.
const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(2);

/// The plugin's state across one process: the config, and what the runtime said of itself.
pub(crate) struct Plugin {
    pub cfg: Arc<Config>,
    pub dirs: StateDir,
    /// The runtime's name and version, from `Configure`.
    pub runtime: Mutex<String>,
    /// The runtime's NRI request timeout, from `Configure` (`None`: not said).
    pub request_timeout: Mutex<Option<Duration>>,
    /// Held (shared) while a program this process started is waited for (the pipeline's
    /// inventory, `ensure`'s supervisor), (exclusive) while exited children are reaped: a
    /// child is never reaped under its own waiter. The reaper only ever tries for it
    /// (`try_write`): a writer that queued would hold up every later create.
    pub reaping: Arc<RwLock<()>>,
    /// A `Synchronize` that comes in parts (`more`): the containers so far.
    pub sync: Mutex<Vec<Container>>,
    /// And their pods so far (taken after `sync`, never before).
    pub sync_pods: Mutex<Vec<PodSandbox>>,
    /// What the audits found (`Unserved`): at each `Synchronize`, and at each
    /// `PostCreateContainer` and `StartContainer`; an entry goes when its container stops,
    /// is removed, or its process is gone.
    pub unserved: Mutex<Vec<Unserved>>,
    /// How many unserved containers this process ended (`[nri] unserved = "evict"`).
    pub evicted: std::sync::atomic::AtomicU64,
    /// Set when an audit found a new unserved container, so that the periodic re-audit
    /// (`audit_every`) runs at once rather than at its next interval.
    audit_now: (Mutex<bool>, Condvar),
    /// The identities (daemon ids) whose `ensure` thread still runs: a create of one of
    /// them is refused at once.
    starting: Arc<Mutex<HashSet<String>>>,
}

/// Where an `ensure` thread leaves its result for the answer that waits for it, or finds
/// that the answer gave up (and then drops the container record it made).
#[derive(Default)]
struct Handoff {
    slot: Mutex<Slot>,
    done: Condvar,
}

/// An identity's place in `Plugin::starting`, given back when its `ensure` thread is done
/// (or unwinds: the identity is never left refused for good).
struct Starting(Arc<Mutex<HashSet<String>>>, String);

impl Drop for Starting {
    fn drop(&mut self) {
        if let Ok(mut s) = self.0.lock() {
            s.remove(&self.1);
        }
    }
}

/// A container with a request that runs without the plugin's adjustment, as an audit
/// found it. It is known by the container id the runtime gave and by the init process the
/// runtime reported for that id, pinned by its start time when the audit first saw it;
/// never by a name, which the pod's author writes.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Unserved {
    pub id: String,
    /// `<namespace>/<pod>/<container> (<id>)`, for `status` and the log.
    pub named: String,
    /// Its init process; `None` when the runtime reported none (or it was already gone).
    pub process: Option<ProcRef>,
    /// Whether this process killed it (`evict`).
    pub evicted: bool,
}

#[derive(Default)]
enum Slot {
    #[default]
    Waiting,
    Abandoned,
    Done(Box<anyhow::Result<crate::mps::ensure::Ensured>>),
}

impl Plugin {
    pub(crate) fn new(cfg: Config) -> Self {
        Plugin {
            dirs: StateDir::new(&cfg.state_dir),
            cfg: Arc::new(cfg),
            runtime: Mutex::new("the runtime".into()),
            request_timeout: Mutex::new(None),
            reaping: Arc::new(RwLock::new(())),
            sync: Mutex::new(Vec::new()),
            sync_pods: Mutex::new(Vec::new()),
            unserved: Mutex::new(Vec::new()),
            evicted: std::sync::atomic::AtomicU64::new(0),
            audit_now: (Mutex::new(false), Condvar::new()),
            starting: Arc::new(Mutex::new(HashSet::new())),
        }
    }

    /// What `Configure` said: the runtime's NRI request timeout in milliseconds (0: not
    /// said).
    pub(crate) fn configured(&self, request_timeout_ms: i64) {
        let timeout = u64::try_from(request_timeout_ms)
            .ok()
            .filter(|ms| *ms > 0)
            .map(Duration::from_millis);
        if let Ok(mut t) = self.request_timeout.lock() {
            *t = timeout;
        }
    }

    /// How long a `CreateContainer` may take: half the runtime's request timeout, so that
    /// the answer, its transfer and a loaded node's scheduling still fit in it.
    pub(crate) fn budget(&self) -> Duration {
        let timeout = self
            .request_timeout
            .lock()
            .ok()
            .and_then(|t| *t)
            .unwrap_or(DEFAULT_REQUEST_TIMEOUT);
        timeout / 2
    }

    fn runtime(&self) -> String {
        self.runtime
            .lock()
            .map(|r| r.clone())
            .unwrap_or_else(|_| "the runtime".into())
    }

    /// `CreateContainer`: the adjustment for a container with a request, an empty one for
    /// any other; an error fails the container with its one line.
    pub(crate) fn create(
        &self,
        pod: &PodSandbox,
        ctr: &Container,
    ) -> anyhow::Result<ContainerAdjustment> {
        let began = Instant::now();
        let budget = self.budget();
        // Held while the pipeline runs: it may run a program (the inventory) and wait for
        // it. Never across `ensure` (its own thread takes it).
        let no_reaping = self.reaping.read();
        let spec = spec_of(pod, ctr)?;
        if let Some(why) = left_alone(&self.cfg, pod, ctr) {
            tracing::debug!(
                container_id = %crate::util::escape(&ctr.id),
                "{why}: left alone"
            );
            return Ok(ContainerAdjustment::default());
        }
        let (ipc, honour_ipc) = crate::served::engine_ipc(
            &spec,
            "an NRI plugin",
            "hostIPC: true on the pod for the host's, or no gpushare.io/ipc",
        );
        let runtime = self.runtime();
        let Some(served) = crate::decision::resolve_nri(
            &self.cfg,
            &spec,
            ctr.user.is_some(),
            &runtime,
            &pod.namespace,
            honour_ipc,
        )?
        else {
            return Ok(ContainerAdjustment::default());
        };
        if !valid_container_id(&ctr.id) {
            bail!(
                "container id {:?} is invalid: allowed is letters, digits and _ + - . (runc's rule)",
                ctr.id.chars().take(64).collect::<String>()
            );
        }
        drop(no_reaping);
        let namespace = served.namespace(&ctr.id);
        let record = ContainerRecord {
            names: pod_names(pod, ctr),
            mps_namespace: namespace.clone(),
            ..ContainerRecord::new(ctr.id.clone(), None, None, Some(ENGINE.into()))
        };
        let ensured = self.ensure_within(&served.identity, record, began + budget, budget)?;
        let id = ensured.record.id;
        // Host IPC is the engine's own here (the pod's hostIPC): nothing to add for it.
        let mounts = adjustment_mounts(
            &MountPlan::new(&self.dirs, &id, Inside::configured(&self.cfg), ipc).in_namespace(
                &self.dirs,
                &id,
                namespace.as_ref(),
            ),
        );
        // The plugin does not know the low-level runtime: NVIDIA's devices reach the
        // container through the engine's own CDI or NVIDIA's plugin, not through this env.
        let env = crate::served::client_env(&self.cfg, &served, false)
            .into_iter()
            .map(|(key, value)| api::KeyValue { key, value })
            .collect();
        tracing::info!(
            daemon = %id,
            started = ensured.started,
            uid = served.host_user.0,
            devices = %served.devices.uuids.join(","),
            container_id = %ctr.id,
            elapsed_us = began.elapsed().as_micros() as u64,
            "NRI: daemon ensured, container adjusted"
        );
        Ok(ContainerAdjustment { mounts, env })
    }

    /// `ensure` for `ident` on a thread of its own, waited for until `deadline`; past it,
    /// or while an earlier container's `ensure` of the same identity still runs, the
    /// container is refused with one line. A thread whose answer gave up drops the
    /// container record it made (that container was never created) and goes on only to
    /// finish its start, so that the kubelet's retry finds the daemon ready.
    fn ensure_within(
        &self,
        ident: &crate::identity::Identity,
        record: ContainerRecord,
        deadline: Instant,
        budget: Duration,
    ) -> anyhow::Result<crate::mps::ensure::Ensured> {
        let id = ident.id();
        // A v3 daemon serves every tenant: one container's wait must not refuse another's,
        // so its creates are told apart by container.
        let key = match &record.mps_namespace {
            Some(ns) => format!("{id}/{}", ns.name),
            None => id.clone(),
        };
        let refuse = |why: &str| {
            anyhow::anyhow!(
                "MPS daemon {id} is not ready yet ({why}); the container is refused rather than run unserved, and the kubelet retries it (see `gpushare status`)"
            )
        };
        let inserted = self
            .starting
            .lock()
            .map_err(|_| anyhow::anyhow!("the plugin's start list is poisoned"))?
            .insert(key.clone());
        if !inserted {
            return Err(refuse(
                "an earlier container is still waiting for its start",
            ));
        }
        let starting = Starting(Arc::clone(&self.starting), key);
        let handoff = Arc::new(Handoff::default());
        let (cfg, dirs, reaping) = (
            Arc::clone(&self.cfg),
            self.dirs.clone(),
            Arc::clone(&self.reaping),
        );
        let (theirs, ident) = (Arc::clone(&handoff), ident.clone());
        let spawned = std::thread::Builder::new()
            .name("nri-ensure".into())
            .spawn(move || {
                let result = {
                    let _no_reaping = reaping.read();
                    match record.mps_namespace.is_some() {
                        true => crate::mps::ensure::ensure_namespace(&cfg, &dirs, &ident, &record, || {
                            std::env::current_exe().context("find the gpushare binary")
                        }),
                        false => crate::mps::ensure::ensure(&cfg, &dirs, &ident, Some(&record)),
                    }
                };
                // Before the answer can go out: the runtime's next create of this
                // identity must find it done, not still starting.
                drop(starting);
                let id = ident.id();
                let Ok(mut slot) = theirs.slot.lock() else {
                    return;
                };
                if matches!(*slot, Slot::Abandoned) {
                    match result {
                        Ok(_) => {
                            let _ = dirs.remove_container(&id, &record.id);
                            tracing::info!(daemon = %id, container_id = %record.id, "NRI: the daemon is ready now, after its container was refused; the container's record is dropped");
                        }
                        Err(e) => {
                            tracing::warn!(daemon = %id, container_id = %record.id, error = %format!("{e:#}"), "NRI: the daemon of a refused container did not start")
                        }
                    }
                    return;
                }
                *slot = Slot::Done(Box::new(result));
                theirs.done.notify_all();
            });
        // A thread that cannot start drops its closure, and `starting` with it.
        spawned.context("start a thread to ensure the daemon")?;
        let slot = handoff
            .slot
            .lock()
            .map_err(|_| anyhow::anyhow!("the daemon's handoff is poisoned"))?;
        let wait = deadline.saturating_duration_since(Instant::now());
        let (mut slot, _) = handoff
            .done
            .wait_timeout_while(slot, wait, |s| matches!(s, Slot::Waiting))
            .map_err(|_| anyhow::anyhow!("the daemon's handoff is poisoned"))?;
        match std::mem::replace(&mut *slot, Slot::Abandoned) {
            Slot::Done(result) => *result,
            _ => Err(refuse(&format!(
                "not within {budget:?}, half of the runtime's NRI request timeout; it is still starting or restarting"
            ))),
        }
    }

    /// `PostCreateContainer`: the record of a container the plugin served gets its pid,
    /// which keeps its daemon alive for as long as the process runs.
    pub(crate) fn created(&self, ctr: &Container) {
        if ctr.pid == 0 {
            return;
        }
        for (daemon, mut rec) in self.own_records() {
            if rec.id == ctr.id && rec.pid.is_none() {
                rec.pid = i32::try_from(ctr.pid).ok();
                rec.start_time = rec.pid.and_then(crate::util::proc_start_time);
                if let Err(e) = self.dirs.add_container(&daemon, &rec) {
                    tracing::warn!(daemon = %daemon, error = %e, "NRI: could not record the container's pid");
                }
                if let (Some(ns), Some(process)) = (&rec.mps_namespace, rec.pid.and_then(ProcRef::of)) {
                    self.limit_memory(&daemon, ns, process);
                }
            }
        }
    }

    /// A v3 container's cgroup memory limit (`mps::v3::limit_memory`), set once its cgroup
    /// exists (`PostCreateContainer`, before the runtime starts its first process). A
    /// container whose limit cannot be set does not run: its init process is killed
    /// through a pidfd, as `unserved = "evict"` does.
    fn limit_memory(&self, daemon: &str, ns: &crate::identity::Namespace, process: ProcRef) {
        let Some(devices) = self
            .dirs
            .read_record(daemon)
            .ok()
            .flatten()
            .map(|r| r.identity.devices)
        else {
            return;
        };
        if let Err(e) = crate::mps::v3::limit_memory(&self.cfg, process.pid, &devices, ns) {
            tracing::error!(daemon = %daemon, namespace = %ns.name, error = %format!("{e:#}"), "NRI: the container's device memory limit cannot be set; its init process is killed");
            if let Err(e) = evict_one(process) {
                tracing::warn!(namespace = %ns.name, error = %e, "NRI: could not kill the container");
            }
        }
    }

    /// `StopContainer`, `RemoveContainer`: forget the container (as the poststop hook
    /// does). Never fails.
    pub(crate) fn release(&self, ctr: &Container) {
        if !valid_container_id(&ctr.id) {
            return;
        }
        if self.own_records().iter().any(|(_, r)| r.id == ctr.id)
            && crate::mps::ensure::end(&self.cfg, &self.dirs, None, &ctr.id)
        {
            tracing::info!(container_id = %ctr.id, "NRI: container released");
        }
    }

    /// Drops the plugin's record of a container whose `CreateContainer` answer was never
    /// delivered; whether there was one. Only a record without a pid: one that
    /// `PostCreateContainer` or `Synchronize` gave a pid is of a container that runs.
    pub(crate) fn forget_unanswered(&self, ctr: &Container) -> bool {
        if !valid_container_id(&ctr.id) {
            return false;
        }
        self.own_records()
            .into_iter()
            .filter(|(_, r)| r.id == ctr.id && r.pid.is_none())
            .any(|(daemon, r)| self.dirs.remove_container(&daemon, &r.id).unwrap_or(false))
    }

    /// `Synchronize`: the plugin's records against the runtime's containers. A record of a
    /// container the runtime no longer has (removed while the plugin was away) is dropped;
    /// one of a running container gets its pid if it had none.
    pub(crate) fn synchronize(&self, containers: &[Container]) {
        let known: HashMap<&str, &Container> =
            containers.iter().map(|c| (c.id.as_str(), c)).collect();
        let mut dropped = HashSet::new();
        for (daemon, rec) in self.own_records() {
            match known.get(rec.id.as_str()) {
                Some(c) if rec.pid.is_none() => self.created(c),
                Some(_) => {}
                None => {
                    if self
                        .dirs
                        .remove_container(&daemon, &rec.id)
                        .unwrap_or(false)
                    {
                        dropped.insert(rec.id);
                    }
                }
            }
        }
        tracing::info!(
            containers = containers.len(),
            dropped = dropped.len(),
            "NRI: records synchronized with the runtime"
        );
    }

    /// The audit at each `Synchronize` (each connection): the containers the runtime has
    /// created or runs that the plugin serves (a request, not left alone) but that carry
    /// no adjustment of its own (`unserved_one`): created while the plugin was not
    /// connected, stalled or closed, with no validator to refuse them. Each is logged (one
    /// line) and the list replaces the last; returns how `status` names them. A container
    /// without a request is never named.
    pub(crate) fn audit(&self, pods: &[PodSandbox], containers: &[Container]) -> Vec<String> {
        const CREATED: i32 = 1;
        const RUNNING: i32 = 3;
        let pods: HashMap<&str, &PodSandbox> = pods.iter().map(|p| (p.id.as_str(), p)).collect();
        let mut unserved: Vec<Unserved> = containers
            .iter()
            .filter(|ctr| matches!(ctr.state, CREATED | RUNNING))
            .filter_map(|ctr| {
                let pod = pods
                    .get(ctr.pod_sandbox_id.as_str())
                    .copied()
                    .cloned()
                    .unwrap_or_default();
                self.unserved_one(&pod, ctr)
            })
            .collect();
        unserved.sort_by(|a, b| a.named.cmp(&b.named));
        tracing::info!(unserved = unserved.len(), "NRI audit: done");
        let found = !unserved.is_empty();
        let named = unserved.iter().map(|u| u.named.clone()).collect();
        if let Ok(mut u) = self.unserved.lock() {
            // What this process already ended stays ended: an entry keeps its mark.
            for new in &mut unserved {
                new.evicted = u
                    .iter()
                    .any(|old| old.id == new.id && old.evicted && old.process == new.process);
            }
            *u = unserved;
        }
        if found {
            self.wake_audit();
        }
        named
    }

    /// The audit of one container the runtime just created or is starting
    /// (`PostCreateContainer`, `StartContainer`): one with a request and without the
    /// plugin's adjustment is logged and added; the list, when it changed. No work on
    /// `CreateContainer`'s path.
    pub(crate) fn audit_event(&self, pod: &PodSandbox, ctr: &Container) -> Option<Vec<String>> {
        // Found at its creation already (or at a Synchronize): one line per container.
        if self.unserved.lock().ok()?.iter().any(|e| e.id == ctr.id) {
            return None;
        }
        let found = self.unserved_one(pod, ctr)?;
        let mut u = self.unserved.lock().ok()?;
        u.retain(|old| old.id != found.id);
        u.push(found);
        u.sort_by(|a, b| a.named.cmp(&b.named));
        let named = u.iter().map(|e| e.named.clone()).collect();
        drop(u);
        self.wake_audit();
        Some(named)
    }

    /// The container, if it has a request the plugin serves (or would refuse: no
    /// container with one gets through it either) and carries none of its adjustment;
    /// logged (one line).
    fn unserved_one(&self, pod: &PodSandbox, ctr: &Container) -> Option<Unserved> {
        if matches!(serves(&self.cfg, pod, ctr), Ok(false)) {
            return None;
        }
        let env = ctr.env.iter().filter_map(|e| e.split_once('='));
        if carries_adjustment(&self.cfg, &self.dirs, &ctr.mounts, env) {
            return None;
        }
        // Served by the shim (a pod of its RuntimeClass) or a hook: its edits are in the
        // bundle, which NRI never sees. Read only for a container that looks unserved.
        if self.served_elsewhere(&ctr.id) {
            return None;
        }
        let named = format!(
            "{}/{}/{} ({})",
            crate::util::escape(&pod.namespace),
            crate::util::escape(&pod.name),
            crate::util::escape(&ctr.name),
            super::quoted(&ctr.id)
        );
        tracing::warn!(
            container = %named,
            "NRI audit: a container with a request runs without gpushare's adjustment (created while the plugin was not connected, stalled or closed); it is unserved until it is recreated"
        );
        let process = i32::try_from(ctr.pid)
            .ok()
            .filter(|pid| *pid > 0)
            .and_then(ProcRef::of);
        Some(Unserved {
            id: ctr.id.clone(),
            named,
            process,
            evicted: false,
        })
    }

    /// Whether another gpushare path (the shim, a hook) keeps a container record of this
    /// container id: a record the plugin did not write, which only those paths write.
    fn served_elsewhere(&self, id: &str) -> bool {
        if !valid_container_id(id) {
            return false;
        }
        self.dirs
            .daemon_ids()
            .unwrap_or_default()
            .iter()
            .any(|daemon| {
                let path = self.dirs.containers_dir(daemon).join(format!("{id}.json"));
                crate::fsops::read_regular(&path, 64 << 10)
                    .ok()
                    .and_then(|b| serde_json::from_slice::<ContainerRecord>(&b).ok())
                    .is_some_and(|rec| rec.id == id && rec.engine.as_deref() != Some(ENGINE))
            })
    }

    fn wake_audit(&self) {
        if let Ok(mut now) = self.audit_now.0.lock() {
            *now = true;
            self.audit_now.1.notify_all();
        }
    }

    /// The periodic re-audit, for as long as the process runs: every `[nri]
    /// audit-interval`, or at once when an audit found a new unserved container. An
    /// entry whose process is gone goes (the container ended; its recreation is audited
    /// anew); under `[nri] unserved = "evict"` each one not yet ended is (`evict`).
    /// What is left and the count of evictions go to `nri.json` (`publish`).
    pub(crate) fn audit_every(&self, publish: &dyn Fn(Vec<String>, u64)) {
        loop {
            if let Ok(now) = self.audit_now.0.lock() {
                if let Ok((mut now, _)) =
                    self.audit_now
                        .1
                        .wait_timeout_while(now, self.cfg.nri_audit_interval, |now| !*now)
                {
                    *now = false;
                }
            } else {
                std::thread::sleep(self.cfg.nri_audit_interval);
            }
            let (named, evicted) = self.reaudit();
            publish(named, evicted);
        }
    }

    /// One pass of the periodic re-audit; what is left and how many were ended so far.
    pub(crate) fn reaudit(&self) -> (Vec<String>, u64) {
        use std::sync::atomic::Ordering;
        let evict = self.cfg.nri_unserved == NriUnserved::Evict;
        let mut named = Vec::new();
        if let Ok(mut u) = self.unserved.lock() {
            u.retain_mut(|e| {
                let Some(process) = e.process else {
                    // Nothing to pin: named until it stops or is removed.
                    return true;
                };
                if !process.alive() {
                    tracing::info!(container = %e.named, "NRI audit: the unserved container's process is gone");
                    return false;
                }
                if evict && !e.evicted {
                    match evict_one(process) {
                        Ok(()) => {
                            e.evicted = true;
                            self.evicted.fetch_add(1, Ordering::Relaxed);
                            tracing::warn!(
                                container = %e.named,
                                pid = process.pid,
                                "NRI audit: evicted an unserved container with a request ([nri] unserved = \"evict\"): its init process is killed; the kubelet recreates it through the plugin"
                            );
                        }
                        Err(EvictError::Gone) => return false,
                        Err(e2) => tracing::warn!(
                            container = %e.named,
                            error = %e2,
                            "NRI audit: could not evict the unserved container; tried again at the next audit"
                        ),
                    }
                }
                true
            });
            named = u.iter().map(|e| e.named.clone()).collect();
        }
        (named, self.evicted.load(Ordering::Relaxed))
    }

    /// A container that stopped or went is no longer unserved: its audit entry goes.
    /// What is left, when that changed.
    pub(crate) fn no_longer_unserved(&self, ctr: &Container) -> Option<Vec<String>> {
        let mut u = self.unserved.lock().ok()?;
        let before = u.len();
        u.retain(|e| e.id != ctr.id);
        (u.len() != before).then(|| u.iter().map(|e| e.named.clone()).collect())
    }

    /// Every container record the plugin wrote, with its daemon's id.
    fn own_records(&self) -> Vec<(String, ContainerRecord)> {
        let mut out = Vec::new();
        for daemon in self.dirs.daemon_ids().unwrap_or_default() {
            for rec in self.dirs.containers(&daemon).unwrap_or_default() {
                if rec.engine.as_deref() == Some(ENGINE) {
                    out.push((daemon.clone(), rec));
                }
            }
        }
        out
    }
}

/// Why an unserved container could not be ended.
#[derive(Debug, thiserror::Error)]
pub(crate) enum EvictError {
    /// Its init process is gone, or the pid is another process's now.
    #[error("its process is gone")]
    Gone,
    #[error("pidfd_open: {0}")]
    Open(std::io::Error),
    #[error("pidfd_send_signal: {0}")]
    Signal(std::io::Error),
}

/// Kills the init process `process` names through a pidfd, after checking that the pid
/// opened is that very process (its start time, read once the pidfd pins it): a pid
/// reused since the runtime reported it is never signalled.
fn evict_one(process: ProcRef) -> Result<(), EvictError> {
    use rustix::process::{pidfd_open, pidfd_send_signal, Pid, PidfdFlags, Signal};
    let pid = Pid::from_raw(process.pid).ok_or(EvictError::Gone)?;
    let pinned = pidfd_open(pid, PidfdFlags::empty()).map_err(|e| {
        if e == rustix::io::Errno::SRCH {
            EvictError::Gone
        } else {
            EvictError::Open(e.into())
        }
    })?;
    if !process.alive() {
        return Err(EvictError::Gone);
    }
    match pidfd_send_signal(&pinned, Signal::KILL) {
        Ok(()) => Ok(()),
        Err(e) if e == rustix::io::Errno::SRCH => Err(EvictError::Gone),
        Err(e) => Err(EvictError::Signal(e.into())),
    }
}

/// A container's mount plan as the NRI adjustment's mounts.
fn adjustment_mounts(plan: &MountPlan) -> Vec<api::Mount> {
    plan.binds
        .iter()
        .map(|b| api::Mount {
            destination: b.destination.to_string_lossy().into_owned(),
            r#type: "bind".into(),
            source: b.source.to_string_lossy().into_owned(),
            options: b.options.iter().map(|o| o.to_string()).collect(),
        })
        .collect()
}

#[cfg(test)]
mod audit_tests {
    use super::*;

    #[test]
    fn the_audit_names_running_containers_with_a_request_and_no_adjustment_only() {
        let cfg = crate::config::parse(
            "state-dir = \"/run/gpushare\"\n[nri]\nskip-namespaces = [\"kube-system\"]\n",
            None,
        )
        .unwrap();
        let plugin = Plugin::new(cfg);
        let pod = |id: &str, ns: &str, asks: bool| PodSandbox {
            id: id.into(),
            name: format!("pod-{id}"),
            namespace: ns.into(),
            annotations: if asks {
                HashMap::from([("gpushare.io/device".into(), "0".into())])
            } else {
                HashMap::new()
            },
            ..Default::default()
        };
        let daemon = "0123456789abcdef0123456789abcdef";
        let adjusted = |c: Container| Container {
            env: vec!["CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps".into()],
            mounts: vec![api::Mount {
                destination: "/tmp/nvidia-mps".into(),
                r#type: "bind".into(),
                source: format!("/run/gpushare/mps/{daemon}/pipe"),
                options: vec!["ro".into()],
            }],
            ..c
        };
        let ctr = |id: &str, pod: &str, state: i32| Container {
            id: id.into(),
            pod_sandbox_id: pod.into(),
            name: format!("c-{id}"),
            state,
            ..Default::default()
        };
        let pods = [
            pod("p1", "team-a", true),
            pod("p2", "team-a", false),
            pod("p3", "kube-system", true),
        ];
        let containers = [
            ctr("unserved", "p1", 3),
            ctr("created", "p1", 1),
            adjusted(ctr("served", "p1", 3)),
            ctr("stopped", "p1", 4),
            ctr("plain", "p2", 3),
            ctr("skipped", "p3", 3),
        ];
        assert_eq!(
            plugin.audit(&pods, &containers),
            [
                "team-a/pod-p1/c-created (created)",
                "team-a/pod-p1/c-unserved (unserved)"
            ]
        );
        // Stopped or removed: named no more; another container changes nothing.
        assert_eq!(plugin.no_longer_unserved(&containers[4]), None);
        assert_eq!(
            plugin.no_longer_unserved(&containers[0]),
            Some(vec!["team-a/pod-p1/c-created (created)".to_owned()])
        );
        assert_eq!(plugin.no_longer_unserved(&containers[0]), None);
    }
}

#[cfg(test)]
mod evict_tests {
    use super::*;

    fn plugin(unserved: &str) -> Plugin {
        Plugin::new(
            crate::config::parse(
                &format!("state-dir = \"/run/gpushare\"\n[nri]\nunserved = \"{unserved}\"\n"),
                None,
            )
            .unwrap(),
        )
    }

    fn asks() -> PodSandbox {
        PodSandbox {
            id: "p1".into(),
            name: "trainer".into(),
            namespace: "team-a".into(),
            annotations: HashMap::from([("gpushare.io/device".into(), "0".into())]),
            ..Default::default()
        }
    }

    fn ctr(id: &str, pid: u32) -> Container {
        Container {
            id: id.into(),
            pod_sandbox_id: "p1".into(),
            name: "cuda".into(),
            state: 3,
            pid,
            ..Default::default()
        }
    }

    fn ended(child: &mut std::process::Child) -> bool {
        let until = Instant::now() + Duration::from_secs(5);
        while Instant::now() < until {
            if matches!(child.try_wait(), Ok(Some(_))) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        false
    }

    /// `PostCreateContainer` or `StartContainer` of a container with a request and no
    /// adjustment adds it (once); under `evict`, the re-audit kills its init process
    /// through a pidfd, counts it once, and drops it when the process is gone. A
    /// container without a request beside it is never named nor touched.
    #[test]
    fn evict_ends_an_unserved_container_s_process_and_only_it() {
        let plugin = plugin("evict");
        let mut unserved = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        let mut plain = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        let c = ctr("c1", unserved.id());
        assert_eq!(
            plugin.audit_event(&asks(), &c),
            Some(vec!["team-a/trainer/cuda (c1)".to_owned()])
        );
        assert_eq!(plugin.audit_event(&asks(), &c), None, "already known");
        let no_request = PodSandbox {
            annotations: HashMap::new(),
            ..asks()
        };
        assert_eq!(
            plugin.audit_event(&no_request, &ctr("c2", plain.id())),
            None
        );
        let (named, evicted) = plugin.reaudit();
        assert_eq!((named.len(), evicted), (1, 1));
        assert!(
            ended(&mut unserved),
            "the unserved container's process is killed"
        );
        assert!(matches!(plain.try_wait(), Ok(None)), "the plain one runs");
        // Gone now: dropped, counted once.
        assert_eq!(plugin.reaudit(), (vec![], 1));
        plain.kill().unwrap();
        plain.wait().unwrap();
    }

    /// `report` names and keeps it, touching nothing.
    #[test]
    fn report_touches_nothing() {
        let plugin = plugin("report");
        let mut child = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        plugin.audit_event(&asks(), &ctr("c1", child.id()));
        assert_eq!(plugin.reaudit().1, 0);
        assert!(matches!(child.try_wait(), Ok(None)));
        assert_eq!(plugin.reaudit().0.len(), 1);
        child.kill().unwrap();
        child.wait().unwrap();
    }

    /// A pid that is another process's now (its start time differs from the one the
    /// audit pinned) is never signalled: the entry goes.
    #[test]
    fn a_reused_pid_is_never_signalled() {
        let plugin = plugin("evict");
        let mut child = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        plugin.audit_event(&asks(), &ctr("c1", child.id()));
        if let Ok(mut u) = plugin.unserved.lock() {
            let p = u[0].process.as_mut().unwrap();
            p.start_time += 1;
        }
        assert_eq!(plugin.reaudit(), (vec![], 0));
        assert!(matches!(child.try_wait(), Ok(None)), "not signalled");
        assert_eq!(
            evict_one(ProcRef {
                pid: child.id() as i32,
                start_time: 1
            })
            .map_err(|e| e.to_string()),
            Err("its process is gone".to_owned())
        );
        child.kill().unwrap();
        child.wait().unwrap();
    }

    /// A container the shim or a hook serves (a record of theirs under its id: the
    /// edits are in the bundle, which NRI does not show) is not unserved; the plugin's own
    /// record does not count.
    #[test]
    fn a_container_another_gpushare_path_serves_is_not_unserved() {
        let dir = tempfile::tempdir().unwrap();
        let plugin = Plugin::new(
            crate::config::parse(
                &format!("state-dir = {:?}\n", dir.path().display().to_string()),
                None,
            )
            .unwrap(),
        );
        let daemon = "0".repeat(crate::identity::ID_LEN);
        std::fs::create_dir_all(plugin.dirs.containers_dir(&daemon)).unwrap();
        for (id, engine) in [("shim", None), ("mine", Some(ENGINE.into()))] {
            let rec = ContainerRecord::new(id.into(), None, None, engine);
            plugin.dirs.add_container(&daemon, &rec).unwrap();
        }
        assert_eq!(plugin.audit_event(&asks(), &ctr("shim", 0)), None);
        assert_eq!(
            plugin.audit_event(&asks(), &ctr("mine", 0)),
            Some(vec!["team-a/trainer/cuda (mine)".to_owned()])
        );
    }

    /// A `Synchronize` audit keeps the mark of a container already ended (not counted
    /// twice), and replaces the list.
    #[test]
    fn synchronize_keeps_what_was_evicted() {
        let plugin = plugin("evict");
        let mut child = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        let c = ctr("c1", child.id());
        plugin.audit_event(&asks(), &c);
        assert_eq!(plugin.reaudit().1, 1);
        assert!(ended(&mut child));
        // Reaped: its pid is free, so the Synchronize that still lists it pins nothing.
        plugin.audit(&[asks()], &[c]);
        assert_eq!(plugin.reaudit().1, 1);
    }
}

/// The three renderings of one mount plan (the shim's spec edits, this adjustment,
/// hook-only mode's binds) give the same sources, destinations and options.
#[cfg(test)]
mod the_renderings_agree {
    use super::adjustment_mounts;
    use crate::request::IpcMode;
    use crate::served::tests::every_plan;
    use serde_json::{json, Map, Value};

    #[test]
    fn on_every_plan() {
        for plan in every_plan() {
            let nri: Vec<Value> = adjustment_mounts(&plan)
                .iter()
                .map(|m| {
                    json!({"destination": m.destination, "type": m.r#type,
                           "source": m.source, "options": m.options})
                })
                .collect();
            // The spec edits on a spec without mounts: the daemon's binds, then (host
            // IPC) the host's /dev/shm, which an engine's own host IPC brings elsewhere.
            let mut doc: Map<String, Value> = Map::new();
            crate::bundle::edits::apply_all(&mut doc, &plan.spec_edits()).unwrap();
            let mut spec = doc["mounts"].as_array().unwrap().clone();
            if plan.ipc == IpcMode::Host {
                let host = spec.pop().unwrap();
                assert_eq!(host["source"], "/dev/shm");
                assert_eq!(host["destination"], "/dev/shm");
            }
            assert_eq!(nri, spec, "{plan:?}");
            // Hook-only mode: each bind at the same place (relative to the root), with
            // the flags its options name.
            let hook = crate::hookonly::binds(&plan);
            assert_eq!(hook.len(), nri.len());
            for (h, n) in hook.iter().zip(&nri) {
                assert_eq!(h.source.to_str(), n["source"].as_str());
                assert_eq!(format!("/{}", h.target), n["destination"].as_str().unwrap());
                let options: Vec<&str> = n["options"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|o| o.as_str().unwrap())
                    .collect();
                use crate::sys::{
                    MOUNT_ATTR_NODEV, MOUNT_ATTR_NOEXEC, MOUNT_ATTR_NOSUID, MOUNT_ATTR_RDONLY,
                };
                for (option, flag) in [
                    ("ro", MOUNT_ATTR_RDONLY),
                    ("nosuid", MOUNT_ATTR_NOSUID),
                    ("nodev", MOUNT_ATTR_NODEV),
                    ("noexec", MOUNT_ATTR_NOEXEC),
                ] {
                    assert_eq!(
                        options.contains(&option),
                        h.attrs & flag != 0,
                        "{option} on {}",
                        h.target
                    );
                }
            }
        }
    }
}

/// Why the plugin leaves a container alone whatever it asks, if it does: gpushare's own
/// OCI hook serves it, or its pod's namespace (the runtime's own record of it, which no
/// pod author writes) is in `[nri] skip-namespaces`.
fn left_alone(cfg: &Config, pod: &PodSandbox, ctr: &Container) -> Option<String> {
    if let Some(stage) = gpushare_hook(ctr) {
        return Some(format!(
            "the spec carries gpushare's {stage} hook, which serves it"
        ));
    }
    cfg.nri_skip_namespaces.contains(&pod.namespace).then(|| {
        format!(
            "[nri] skip-namespaces has its namespace {}",
            crate::util::escape(&pod.namespace)
        )
    })
}

/// Whether the plugin serves this container, read as `create` reads it up to the request
/// (no inventory, no daemon): `Ok(false)` for one it leaves alone or that asks for
/// nothing; an error for a request `create` refuses. For the validator.
pub(crate) fn serves(cfg: &Config, pod: &PodSandbox, ctr: &Container) -> anyhow::Result<bool> {
    let spec = spec_of(pod, ctr)?;
    if left_alone(cfg, pod, ctr).is_some() {
        return Ok(false);
    }
    crate::decision::asks(cfg, &spec)
}

/// Whether `mounts` and `env` carry what the plugin gives every container it serves: a
/// bind of a daemon's pipe directory at `mps.container-pipe-dir`, and
/// `CUDA_MPS_PIPE_DIRECTORY` naming it. Read by the validator (on the adjustment) and the
/// audit (on a container as created).
pub(crate) fn carries_adjustment<'a>(
    cfg: &Config,
    dirs: &StateDir,
    mounts: &[api::Mount],
    mut env: impl Iterator<Item = (&'a str, &'a str)>,
) -> bool {
    let inside = cfg.mps.container_pipe_dir.to_string_lossy();
    let named = env.any(|(k, v)| k == "CUDA_MPS_PIPE_DIRECTORY" && v == inside);
    named
        && mounts.iter().any(|m| {
            let source = Path::new(&m.source);
            m.destination == inside
                && m.r#type == "bind"
                && source
                    .parent()
                    .and_then(Path::file_name)
                    .and_then(|id| id.to_str())
                    .is_some_and(|id| crate::identity::valid_id(id) && dirs.pipe_dir(id) == source)
        })
}

/// The stage of the first gpushare OCI hook in the container's spec, if any.
fn gpushare_hook(ctr: &Container) -> Option<String> {
    let hooks = ctr.hooks.as_ref()?;
    [
        &hooks.prestart,
        &hooks.create_runtime,
        &hooks.create_container,
        &hooks.start_container,
        &hooks.poststart,
        &hooks.poststop,
    ]
    .into_iter()
    .flatten()
    .find_map(|h| {
        let v = json!({"path": h.path, "args": h.args});
        crate::bundle::edits::gpushare_hook_stage(&v).map(str::to_owned)
    })
}

/// The Kubernetes names of a container, from what the runtime says of its pod.
fn pod_names(pod: &PodSandbox, ctr: &Container) -> PodNames {
    let some = |s: &str| (!s.is_empty()).then(|| PodNames::bounded(s));
    PodNames {
        namespace: some(&pod.namespace),
        pod: some(&pod.name),
        container: some(&ctr.name),
    }
}

/// The annotations the request is read from: the pod's request keys (where a Kubernetes
/// pod carries them; the runtime hands NRI every annotation of the pod, which its author
/// writes, so nothing else of the pod's is read), then the container's own, which win
/// (the runtime's and the kubelet's: the allocation's `cdi.k8s.io/*`, the CRI's own
/// keys). No sandbox marker is kept: NRI says this is a container.
fn annotations(pod: &PodSandbox, ctr: &Container) -> Map<String, Value> {
    let request_key = |k: &str| crate::request::KEYS.iter().any(|key| key.annotation == k);
    let mut out = Map::new();
    let pods = pod.annotations.iter().filter(|(k, _)| request_key(k));
    for (k, v) in pods.chain(&ctr.annotations) {
        out.insert(k.clone(), Value::String(v.clone()));
    }
    for (key, _) in crate::engine::sandbox_markers() {
        out.remove(key);
    }
    out
}

/// The OCI spec view of a container as the runtime describes it to NRI plugins: what the
/// request pipeline reads (annotations, env, mounts, devices and device rules, hooks,
/// namespaces, the process user). `Container.user` absent (NRI before containerd 2.3)
/// leaves `process.user` at 0, which `decision::resolve_nri` never uses then.
pub(crate) fn spec_of(pod: &PodSandbox, ctr: &Container) -> anyhow::Result<SpecFile> {
    let user = ctr.user.clone().unwrap_or_default();
    let hook = |list: &[api::Hook]| -> Vec<Value> {
        list.iter()
            .map(|h| json!({"path": h.path, "args": h.args}))
            .collect()
    };
    let hooks = ctr.hooks.clone().unwrap_or_default();
    let linux = ctr.linux.clone().unwrap_or_default();
    let rules: Vec<Value> = linux
        .resources
        .as_ref()
        .map(|r| r.devices.as_slice())
        .unwrap_or(&[])
        .iter()
        .map(|d| {
            let mut rule = json!({"allow": d.allow, "access": d.access});
            if !d.r#type.is_empty() {
                rule["type"] = json!(d.r#type);
            }
            if let Some(m) = &d.major {
                rule["major"] = json!(m.value);
            }
            if let Some(m) = &d.minor {
                rule["minor"] = json!(m.value);
            }
            rule
        })
        .collect();
    let doc = json!({
        "ociVersion": "1.0.2",
        "process": {
            "user": {"uid": user.uid, "gid": user.gid, "additionalGids": user.additional_gids},
            "env": ctr.env,
            "cwd": "/",
        },
        "root": {"path": "rootfs"},
        "annotations": annotations(pod, ctr),
        "mounts": ctr.mounts.iter().map(|m| json!({
            "destination": m.destination, "type": m.r#type, "source": m.source, "options": m.options,
        })).collect::<Vec<_>>(),
        "hooks": {
            "prestart": hook(&hooks.prestart),
            "createRuntime": hook(&hooks.create_runtime),
            "createContainer": hook(&hooks.create_container),
            "startContainer": hook(&hooks.start_container),
            "poststart": hook(&hooks.poststart),
            "poststop": hook(&hooks.poststop),
        },
        "linux": {
            "namespaces": linux.namespaces.iter().map(|n| {
                let mut ns = json!({"type": n.r#type});
                if !n.path.is_empty() {
                    ns["path"] = json!(n.path);
                }
                ns
            }).collect::<Vec<_>>(),
            "devices": linux.devices.iter().map(|d| json!({
                "path": d.path, "type": d.r#type, "major": d.major, "minor": d.minor,
            })).collect::<Vec<_>>(),
            "resources": {"devices": rules},
        },
    });
    let bytes = serde_json::to_vec(&doc).context("describe the container as an OCI spec")?;
    let label = PathBuf::from(format!(
        "NRI container {}",
        crate::util::escape(&ctr.id.chars().take(64).collect::<String>())
    ));
    Ok(SpecFile::parse(&label, &bytes, 0o600)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn container(annotations: &[(&str, &str)], user: Option<(u32, u32)>) -> Container {
        Container {
            id: "c1".into(),
            name: "cuda".into(),
            annotations: annotations
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            env: vec!["PATH=/bin".into(), "GPUSHARE_DEVICE=1".into()],
            user: user.map(|(uid, gid)| api::User {
                uid,
                gid,
                additional_gids: vec![],
            }),
            linux: Some(api::LinuxContainer {
                namespaces: vec![api::LinuxNamespace {
                    r#type: "ipc".into(),
                    path: "/proc/1/ns/ipc".into(),
                }],
                devices: vec![api::LinuxDevice {
                    path: "/dev/nvidia0".into(),
                    r#type: "c".into(),
                    major: 195,
                    minor: 0,
                }],
                resources: Some(api::LinuxResources {
                    devices: vec![api::LinuxDeviceCgroup {
                        allow: true,
                        r#type: String::new(),
                        major: None,
                        minor: None,
                        access: "rwm".into(),
                    }],
                }),
            }),
            ..Default::default()
        }
    }

    /// A pod of a namespace in `[nri] skip-namespaces` is left alone whatever it asks
    /// for: its request is not even resolved (here it would fail on the missing
    /// inventory); one of another namespace is.
    #[test]
    fn pods_of_a_skipped_namespace_are_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = crate::config::parse(
            &format!(
                "state-dir = {:?}\ninventory = \"file:{}/none.json\"\n[nri]\nskip-namespaces = [\"gpu-operator\"]\n",
                dir.path().join("s").display().to_string(),
                dir.path().display()
            ),
            None,
        )
        .unwrap();
        let plugin = Plugin::new(cfg);
        let pod = |namespace: &str| PodSandbox {
            name: "validator".into(),
            namespace: namespace.into(),
            annotations: HashMap::from([("gpushare.io/device".into(), "0".into())]),
            ..Default::default()
        };
        let ctr = container(&[], Some((1000, 1000)));
        let adjusted = plugin.create(&pod("gpu-operator"), &ctr).unwrap();
        assert!(adjusted.mounts.is_empty() && adjusted.env.is_empty());
        assert!(
            plugin.create(&pod("team-a"), &ctr).is_err(),
            "served, so resolved"
        );
    }

    #[test]
    fn the_spec_view_carries_what_the_pipeline_reads() {
        let pod = PodSandbox {
            name: "trainer".into(),
            namespace: "team-a".into(),
            annotations: HashMap::from([
                ("gpushare.io/device".into(), "0".into()),
                ("gpushare.io/active-thread-percentage".into(), "50".into()),
            ]),
            ..Default::default()
        };
        // The container's own annotation wins over the pod's.
        let ctr = container(
            &[("gpushare.io/active-thread-percentage", "25")],
            Some((1234, 44)),
        );
        let spec = spec_of(&pod, &ctr).unwrap();
        assert_eq!(spec.annotation("gpushare.io/device"), Some("0"));
        assert_eq!(
            spec.annotation("gpushare.io/active-thread-percentage"),
            Some("25")
        );
        assert_eq!(spec.host_user().unwrap(), (1234, 44));
        let inputs = spec.request_inputs();
        assert_eq!(inputs.env, ["PATH=/bin", "GPUSHARE_DEVICE=1"]);
        assert_eq!(inputs.devices.len(), 1);
        // A rule that allows every device: a privileged container.
        assert!(inputs.all_devices_allowed);
        let names = pod_names(&pod, &ctr);
        assert_eq!(
            (
                names.namespace.as_deref(),
                names.pod.as_deref(),
                names.container.as_deref()
            ),
            (Some("team-a"), Some("trainer"), Some("cuda"))
        );
    }

    #[test]
    fn a_pod_s_annotations_give_only_the_request_keys() {
        let forged = format!("nvidia.com/gpu={}", crate::device::sample().gpus[2].uuid);
        let pod = PodSandbox {
            annotations: HashMap::from([
                ("gpushare.io/device".into(), "allocated".into()),
                ("gpushare.io/pinned-memory-limit".into(), "1G".into()),
                ("cdi.k8s.io/x".into(), forged.clone()),
                ("io.kubernetes.cri-o.ContainerType".into(), "sandbox".into()),
                ("io.kubernetes.cri.container-type".into(), "sandbox".into()),
            ]),
            ..Default::default()
        };
        // The kubelet's allocation and the runtime's own keys, on the container.
        let ctr = container(
            &[
                ("cdi.k8s.io/devplugin", "nvidia.com/gpu=0"),
                ("io.kubernetes.cri.container-type", "container"),
            ],
            Some((1000, 1000)),
        );
        let spec = spec_of(&pod, &ctr).unwrap();
        assert_eq!(spec.annotation("gpushare.io/device"), Some("allocated"));
        assert_eq!(
            spec.annotation("gpushare.io/pinned-memory-limit"),
            Some("1G")
        );
        assert_eq!(spec.annotation("cdi.k8s.io/x"), None);
        assert_eq!(
            spec.annotation("cdi.k8s.io/devplugin"),
            Some("nvidia.com/gpu=0")
        );
        for (key, _) in crate::engine::sandbox_markers() {
            assert_eq!(spec.annotation(key), None, "{key}");
        }
        // Not even a marker the container's own annotations carry: NRI says what it is.
        let marked = container(
            &[("io.kubernetes.cri-o.ContainerType", "sandbox")],
            Some((1000, 1000)),
        );
        let spec = spec_of(&PodSandbox::default(), &marked).unwrap();
        assert_eq!(spec.annotation("io.kubernetes.cri-o.ContainerType"), None);
    }

    #[test]
    fn the_budget_is_half_the_runtime_s_request_timeout() {
        let plugin = Plugin::new(crate::config::parse("", None).unwrap());
        assert_eq!(plugin.budget(), Duration::from_secs(1));
        plugin.configured(10_000);
        assert_eq!(plugin.budget(), Duration::from_secs(5));
        for unsaid in [0, -1] {
            plugin.configured(unsaid);
            assert_eq!(plugin.budget(), Duration::from_secs(1), "{unsaid}");
        }
    }

    #[test]
    fn gpushare_hooks_mark_a_container_another_path_serves() {
        let mut ctr = container(&[], None);
        assert_eq!(gpushare_hook(&ctr), None);
        ctr.hooks = Some(api::Hooks {
            prestart: vec![
                api::Hook {
                    path: "/usr/bin/nvidia-ctk".into(),
                    args: vec!["nvidia-ctk".into(), "hook".into()],
                },
                api::Hook {
                    path: "/usr/bin/gpushare".into(),
                    args: vec![
                        "gpushare".into(),
                        "hook".into(),
                        "prestart".into(),
                        "--cdi-device".into(),
                        "0".into(),
                    ],
                },
            ],
            ..Default::default()
        });
        assert_eq!(gpushare_hook(&ctr).as_deref(), Some("prestart"));
    }
}
