//! What the NRI plugin reads of a container as the runtime describes it: the OCI spec view
//! (`spec_of`) that the request pipeline reads, whether the plugin serves it (`serves`,
//! for the validator and the audit), and whether it carries the plugin's adjustment
//! (`carries_adjustment`).
//!
//! Invariants. A container that another gpushare path serves is left alone: one whose
//! spec already carries one of gpushare's OCI hooks (a CDI device of gpushare's, the
//! hook-only base spec) — hooks that no pod author can write through the CRI, whatever its
//! annotations say. A pod's annotations give only the request keys (`annotations`): the
//! runtime hands NRI all of them, and the allocation (`cdi.k8s.io/*`, the devices and
//! mounts) and the sandbox marker must come from what the runtime wrote; NRI's
//! `CreateContainer` is a container's, never a sandbox's, so no marker is read. A
//! per-user request without the container's user (NRI before containerd 2.3) is refused,
//! never served as UID 0.

use std::path::{Path, PathBuf};

use anyhow::Context;
use serde_json::{json, Map, Value};

use super::api::{self, Container, PodSandbox};
use crate::bundle::SpecFile;
use crate::config::Config;
use crate::state::{PodNames, StateDir};

/// Why the plugin leaves a container alone whatever it asks, if it does: gpushare's own
/// OCI hook serves it, or its pod's namespace (the runtime's own record of it, which no
/// pod author writes) is in `[nri] skip-namespaces`.
pub(super) fn left_alone(cfg: &Config, pod: &PodSandbox, ctr: &Container) -> Option<String> {
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
                && (daemon_pipe(dirs, source) || namespace_dir(dirs, source))
        })
}

/// Whether `source` is a daemon's pipe directory, `<state-dir>/mps/<id>/pipe`.
fn daemon_pipe(dirs: &StateDir, source: &Path) -> bool {
    source
        .parent()
        .and_then(Path::file_name)
        .and_then(|id| id.to_str())
        .is_some_and(|id| crate::identity::valid_id(id) && dirs.pipe_dir(id) == source)
}

/// Whether `source` is a v3 daemon's namespace directory, `<pipe>/s/<name>`, `<name>` one
/// gpushare makes.
fn namespace_dir(dirs: &StateDir, source: &Path) -> bool {
    let name = source.file_name().and_then(|n| n.to_str());
    let server = source.parent();
    let pipe = server.and_then(Path::parent);
    name.is_some_and(crate::identity::Namespace::valid_name)
        && server
            .and_then(Path::file_name)
            .is_some_and(|s| s == crate::identity::V3_SERVER)
        && pipe.is_some_and(|p| daemon_pipe(dirs, p))
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
        crate::bundle::gpushare_hook_stage(&v).map(str::to_owned)
    })
}

/// The Kubernetes names of a container, from what the runtime says of its pod.
pub(super) fn pod_names(pod: &PodSandbox, ctr: &Container) -> PodNames {
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
    use super::super::plugin::Plugin;
    use super::*;
    use std::collections::HashMap;

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
