//! The container records the NRI plugin writes: one per container it served, marked as its
//! own (`ENGINE`), given the container's pid at `PostCreateContainer`, dropped at
//! `StopContainer` and `RemoveContainer` or when the answer was never delivered, and
//! reconciled with the runtime's containers at `Synchronize`. Only the plugin's own
//! records are: a record of the shim's or a hook's is never the plugin's to drop.

use std::collections::{HashMap, HashSet};

use super::api::Container;
use super::plugin::{Plugin, ENGINE};
use crate::state::{valid_container_id, ContainerRecord, ProcRef};

impl Plugin {
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
                if let (Some(ns), Some(process)) =
                    (&rec.mps_namespace, rec.pid.and_then(ProcRef::of))
                {
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
            if let Err(e) = super::audit::evict_one(process) {
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
