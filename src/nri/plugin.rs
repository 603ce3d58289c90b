//! What the NRI plugin does at each event: the container the runtime describes becomes an
//! OCI spec view (`spec_of`), which the one request pipeline reads as it reads the shim's
//! and the hooks' (`decision::resolve_nri`); the daemon is ensured in this process with
//! the same locks, records, caps and supervisor (`mps::ensure`); the answer is the
//! adjustment the shim would have written: the pipe directory read-only, the daemon's shm
//! over /dev/shm, the client env.
//!
//! Invariants. A container that another gpushare path serves is left alone: one whose
//! spec already carries one of gpushare's OCI hooks (a CDI device of gpushare's, the
//! hook-only base spec) — hooks that no pod author can write through the CRI, whatever its
//! annotations say. A pod's sandbox never gets `CreateContainer`, and is checked anyway. A
//! per-user request without the container's user (NRI before containerd 2.3) is refused,
//! never served as UID 0. The records the plugin writes are marked as its own
//! (`ENGINE`), and only those are reconciled with the runtime's containers at
//! `Synchronize`: a record of the shim's or a hook's is never the plugin's to drop.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, RwLock};

use anyhow::{bail, Context};
use serde_json::{json, Map, Value};

use super::api::{self, Container, ContainerAdjustment, PodSandbox};
use crate::config::Config;
use crate::request::IpcMode;
use crate::spec::SpecFile;
use crate::state::{valid_container_id, ContainerRecord, PodNames, StateDir};

/// The `engine` of the container records the plugin writes: how `Synchronize` tells its
/// own records from the shim's and the hooks'.
pub(crate) const ENGINE: &str = "kubernetes-nri";

/// The plugin's state across one process: the config, and what the runtime said of itself.
pub(crate) struct Plugin {
    pub cfg: Config,
    pub dirs: StateDir,
    /// The runtime's name and version, from `Configure`.
    pub runtime: Mutex<String>,
    /// Held (shared) while a daemon is ensured, (exclusive) while exited children are
    /// reaped: a supervisor this process started is never reaped under `ensure`'s own
    /// wait for it.
    pub reaping: RwLock<()>,
    /// A `Synchronize` that comes in parts (`more`): the containers so far.
    pub sync: Mutex<Vec<Container>>,
}

impl Plugin {
    pub(crate) fn new(cfg: Config) -> Self {
        Plugin {
            dirs: StateDir::new(&cfg.state_dir),
            cfg,
            runtime: Mutex::new("the runtime".into()),
            reaping: RwLock::new(()),
            sync: Mutex::new(Vec::new()),
        }
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
        let began = std::time::Instant::now();
        // Held from the start: the pipeline may run a program (the inventory) and wait
        // for it, as `ensure` waits for the supervisor it starts.
        let _no_reaping = self.reaping.read();
        let spec = spec_of(pod, ctr)?;
        if let Some((key, value)) = crate::request::sandbox_marker(|k| spec.annotation(k)) {
            tracing::debug!(
                "{key}={}: a pod's sandbox is never a request",
                crate::util::escape(value)
            );
            return Ok(ContainerAdjustment::default());
        }
        if let Some(stage) = gpushare_hook(ctr) {
            tracing::debug!(
                container_id = %crate::util::escape(&ctr.id),
                "the spec carries gpushare's {stage} hook, which serves it: left alone"
            );
            return Ok(ContainerAdjustment::default());
        }
        // The runtime's own record of the pod's namespace, which no pod author writes.
        if self.cfg.nri_skip_namespaces.contains(&pod.namespace) {
            tracing::debug!(
                namespace = %crate::util::escape(&pod.namespace),
                "[nri] skip-namespaces: left alone"
            );
            return Ok(ContainerAdjustment::default());
        }
        let (ipc, honour_ipc) = crate::hookonly::engine_ipc(
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
        let record = ContainerRecord {
            names: pod_names(pod, ctr),
            ..ContainerRecord::new(ctr.id.clone(), None, None, Some(ENGINE.into()))
        };
        let ident = &served.identity;
        let ensured = crate::mps::ensure::ensure(&self.cfg, &self.dirs, ident, Some(&record))?;
        let id = ensured.record.id;
        let ro = |s: &Path, d: &Path| mount(s, d, crate::spec::edits::READ_ONLY_DIR_OPTIONS);
        let mut mounts = vec![ro(
            &self.dirs.pipe_dir(&id),
            &self.cfg.mps.container_pipe_dir,
        )];
        if let Some(dir) = &self.cfg.mps.container_log_dir {
            mounts.push(ro(&self.dirs.log_dir(&id), dir));
        }
        if ipc == IpcMode::Isolated {
            mounts.push(mount(
                &self.dirs.shm_dir(&id),
                Path::new("/dev/shm"),
                crate::spec::edits::SHM_OPTIONS,
            ));
        }
        // The plugin does not know the low-level runtime: NVIDIA's devices reach the
        // container through the engine's own CDI or NVIDIA's plugin, not through this env.
        let env = crate::runtime::client_env(&self.cfg, &served, Path::new(""))
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
            && crate::mps::ensure::release(&self.dirs, None, &ctr.id)
        {
            tracing::info!(container_id = %ctr.id, "NRI: container released");
        }
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

fn mount(source: &Path, destination: &Path, options: &[&str]) -> api::Mount {
    api::Mount {
        destination: destination.to_string_lossy().into_owned(),
        r#type: "bind".into(),
        source: source.to_string_lossy().into_owned(),
        options: options.iter().map(|o| o.to_string()).collect(),
    }
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
        crate::spec::edits::gpushare_hook_stage(&v).map(str::to_owned)
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

/// The annotations the request is read from: the pod's (where a Kubernetes pod carries
/// gpushare's keys), then the container's own, which win.
fn annotations(pod: &PodSandbox, ctr: &Container) -> Map<String, Value> {
    let mut out = Map::new();
    for (k, v) in pod.annotations.iter().chain(&ctr.annotations) {
        out.insert(k.clone(), Value::String(v.clone()));
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
