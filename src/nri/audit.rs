//! The audit (`audit`, `audit_event`, `audit_every`) names a container with a request
//! that runs without the plugin's adjustment and, under `[nri] unserved = "evict"`, kills
//! its init process. It knows a container only by the id the runtime gave and the pid the
//! runtime reported for it, pinned by start time and checked again through a pidfd before
//! the signal: never by a name a pod's author writes, never a container without a request
//! or one carrying the adjustment. It adds no work to `CreateContainer`.

use std::collections::HashMap;

use super::api::{Container, PodSandbox};
use super::container::{carries_adjustment, serves};
use super::plugin::{Plugin, Unserved, ENGINE};
use crate::config::NriUnserved;
use crate::state::{valid_container_id, ContainerRecord, ProcRef};

impl Plugin {
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
            super::session::quoted(&ctr.id)
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
pub(super) fn evict_one(process: ProcRef) -> Result<(), EvictError> {
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

#[cfg(test)]
mod audit_tests {
    use super::super::api;
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
    use std::time::{Duration, Instant};

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

    /// A process that stands for a container's init process.
    fn sleeper() -> std::process::Child {
        std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap()
    }

    fn stop(child: &mut std::process::Child) {
        child.kill().unwrap();
        child.wait().unwrap();
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
        let mut unserved = sleeper();
        let mut plain = sleeper();
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
        stop(&mut plain);
    }

    /// `report` names and keeps it, touching nothing.
    #[test]
    fn report_touches_nothing() {
        let plugin = plugin("report");
        let mut child = sleeper();
        plugin.audit_event(&asks(), &ctr("c1", child.id()));
        assert_eq!(plugin.reaudit().1, 0);
        assert!(matches!(child.try_wait(), Ok(None)));
        assert_eq!(plugin.reaudit().0.len(), 1);
        stop(&mut child);
    }

    /// A pid that is another process's now (its start time differs from the one the
    /// audit pinned) is never signalled: the entry goes.
    #[test]
    fn a_reused_pid_is_never_signalled() {
        let plugin = plugin("evict");
        let mut child = sleeper();
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
        stop(&mut child);
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
        let mut child = sleeper();
        let c = ctr("c1", child.id());
        plugin.audit_event(&asks(), &c);
        assert_eq!(plugin.reaudit().1, 1);
        assert!(ended(&mut child));
        // Reaped: its pid is free, so the Synchronize that still lists it pins nothing.
        plugin.audit(&[asks()], &[c]);
        assert_eq!(plugin.reaudit().1, 1);
    }
}
