//! What the NRI plugin does at each `CreateContainer`: the container the runtime describes
//! becomes an OCI spec view (`container::spec_of`), which the one request pipeline reads as
//! it reads the shim's and the hooks' (`decision::resolve_nri`); the daemon is ensured in
//! this process with the same locks, records, caps and supervisor (`mps::ensure`); the
//! answer is the adjustment the shim would have written: the pipe directory read-only, the
//! daemon's shm over /dev/shm, the client env.
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
//! The plugin's state (`Plugin`) is one across the process; its other answers are in
//! `records` (the container records it writes, reconciled at `Synchronize`) and `audit`
//! (the containers that got through unserved), and what it reads of a container in
//! `container`.

use std::collections::HashSet;
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use super::api::{self, Container, ContainerAdjustment, PodSandbox};
use super::container::{left_alone, pod_names, spec_of};
use crate::config::Config;
use crate::served::{Inside, MountPlan};
use crate::state::{valid_container_id, ContainerRecord, ProcRef, StateDir};

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
    pub(super) audit_now: (Mutex<bool>, Condvar),
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
