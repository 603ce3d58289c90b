//! `gpushare hook <stage>`: what runc runs at the hooks the shim injected.
//!
//! The hook reads the container state (runtime-spec "State") from stdin and the shim's
//! decision from its annotations; it never needs the bundle. `create-runtime` ensures the
//! daemon (and fails the create with one `gpushare: …` line on stderr if it cannot);
//! `poststop` releases the container's reference and never fails. Invariant: the decision
//! is read and re-validated by [`crate::decision`] before any path is touched; what makes
//! a forged one harmless is that the shim overwrites the decision annotations on every
//! container it serves (see that module's doc).

use std::collections::HashMap;
use std::io::Read;
use std::path::PathBuf;

use anyhow::{bail, Context};
use serde::Deserialize;

use crate::config::Config;
use crate::mps::ensure;
use crate::state::{valid_container_id, ContainerRecord, PodNames, StateDir};

/// Largest state document accepted on stdin.
const MAX_STATE: u64 = 1 << 20;

/// The container state runc passes on stdin; unknown fields (crun's `root`) are fine.
#[derive(Debug, Deserialize)]
pub struct State {
    pub id: String,
    pub pid: Option<i32>,
    pub bundle: Option<PathBuf>,
    #[serde(default)]
    pub annotations: HashMap<String, String>,
}

impl State {
    /// The record of the container this state describes, as both hooks that ensure a
    /// daemon (`create-runtime`, hook-only `prestart`) write it.
    pub(crate) fn container_record(&self) -> ContainerRecord {
        ContainerRecord {
            names: pod_names(self),
            ..ContainerRecord::new(
                self.id.clone(),
                self.pid,
                self.bundle.clone(),
                Some(engine_of(self)),
            )
        }
    }
}

/// The Kubernetes names of a container, from the annotations its CRI engine writes into
/// every container's spec (`engine::pod_names`: containerd's keys, whose values containerd
/// writes over any a pod passes through, then CRI-O's copies of the kubelet's labels).
/// Each is bounded (`PodNames::bounded`); what they say is only as true as the engine that
/// wrote them (Docker, `ctr`, Podman and runc take any annotation from the container's
/// author).
pub(crate) fn pod_names(state: &State) -> PodNames {
    let [namespace, pod, container] =
        crate::engine::pod_names(|k| state.annotations.get(k).map(String::as_str))
            .map(|n| n.map(PodNames::bounded));
    PodNames {
        namespace,
        pod,
        container,
    }
}

pub fn read_state(mut input: impl Read) -> anyhow::Result<State> {
    let mut buf = Vec::new();
    input
        .by_ref()
        .take(MAX_STATE + 1)
        .read_to_end(&mut buf)
        .context("read the container state from stdin")?;
    if buf.len() as u64 > MAX_STATE {
        bail!("container state on stdin is larger than {MAX_STATE} bytes");
    }
    let state: State =
        serde_json::from_slice(&buf).context("parse the container state from stdin")?;
    if !valid_container_id(&state.id) {
        bail!(
            "container id {:?} is invalid: allowed is letters, digits and _ + - . (runc's rule)",
            state.id.chars().take(64).collect::<String>()
        );
    }
    Ok(state)
}

/// Which engine created a container, from what engines leave in its state
/// (`engine::made_by`).
pub(crate) fn engine_of(state: &State) -> String {
    let bundle = state
        .bundle
        .as_deref()
        .map(|b| b.to_string_lossy().into_owned())
        .unwrap_or_default();
    crate::engine::made_by(|k| state.annotations.get(k).map(String::as_str), &bundle).into()
}

/// `createRuntime`: ensure the daemon, record the container.
pub(crate) fn create_runtime(cfg: &Config, state: &State) -> anyhow::Result<()> {
    tracing::debug!("createRuntime hook started");
    let ident = crate::decision::identity_from_annotations(&state.annotations)?;
    if let Some(pid) = state.pid {
        check_daemon_user(&ident, pid)?;
    }
    let namespace =
        crate::decision::namespace_from_annotations(&state.annotations, &ident, &state.id)?;
    let dirs = StateDir::new(&cfg.state_dir);
    let record = ContainerRecord {
        mps_namespace: namespace,
        ..state.container_record()
    };
    let ensured = match &record.mps_namespace {
        Some(ns) => {
            // The shim made and capped the namespace before runc ran (and a daemon that
            // restarted since gets it made again before it counts as ready): made here
            // only where its socket is missing.
            let made = dirs
                .namespace_dir(&ident.id(), &ns.name)
                .join("control")
                .exists();
            let ensured = match made {
                true => ensure::ensure(cfg, &dirs, &ident, Some(&record))?,
                false => ensure::ensure_namespace(cfg, &dirs, &ident, &record, || {
                    std::env::current_exe().context("find the gpushare binary")
                })?,
            };
            if let Some(pid) = state.pid {
                crate::mps::v3::limit_memory(cfg, pid, &ident.devices, ns)?;
            }
            ensured
        }
        None => ensure::ensure(cfg, &dirs, &ident, Some(&record))?,
    };
    tracing::info!(
        daemon = %ensured.record.id,
        started = ensured.started,
        uid = ident.uid,
        devices = %ident.devices.join(","),
        "container attached to MPS daemon"
    );
    Ok(())
}

/// Refuses a per-user daemon whose UID the container's user namespace does not map: the
/// container could never be that user, so the decision was made for another namespace
/// (a spec whose mappings are not the namespace it joins). Read from the container's init
/// process, which runc has put into its namespaces before any hook runs; in the host's
/// user namespace every UID passes. A multi-user daemon is root's by design.
pub(crate) fn check_daemon_user(ident: &crate::identity::Identity, pid: i32) -> anyhow::Result<()> {
    if ident.multi_user {
        return Ok(());
    }
    let pid = u32::try_from(pid)
        .ok()
        .filter(|p| *p > 0)
        .with_context(|| format!("the container state's pid {pid} is not a process id"))?;
    let (uids, _) = crate::userns::read_proc(pid).map_err(anyhow::Error::msg)?;
    if crate::userns::is_identity(&uids) || crate::userns::maps_host(&uids, ident.uid) {
        return Ok(());
    }
    let ranges: Vec<String> = uids
        .iter()
        .map(|r| format!("{}-{}", r.host, u64::from(r.host) + u64::from(r.size) - 1))
        .collect();
    bail!(
        "the daemon's host uid {} is no user of the container's user namespace, which maps host uids {}: the decision was made for another namespace; allowed is a spec whose linux.uidMappings are those of the user namespace it joins",
        ident.uid,
        ranges.join(", ")
    )
}

/// `poststop`: forget the container. Logs, never fails.
pub(crate) fn poststop(cfg: &Config, state: &State) {
    let dirs = StateDir::new(&cfg.state_dir);
    let daemon = crate::decision::daemon_annotation(&state.annotations);
    if !ensure::end(cfg, &dirs, daemon, &state.id) {
        tracing::debug!("no record of the container to release");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_from_podman_fixture() {
        let bytes = std::fs::read(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/podman-4.3-hook-state.json"
        ))
        .unwrap();
        let state = read_state(&bytes[..]).unwrap();
        assert_eq!(state.pid, Some(13530));
        assert_eq!(state.annotations["gpushare.io/device"], "0");
    }

    #[test]
    fn pod_names_come_from_containerd_s_keys_then_cri_o_s_and_are_bounded() {
        let state = |pairs: &[(&str, &str)]| State {
            id: "c".into(),
            pid: None,
            bundle: None,
            annotations: pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        };
        let containerd = state(&[
            ("io.kubernetes.cri.container-type", "container"),
            ("io.kubernetes.cri.sandbox-namespace", "team-a"),
            ("io.kubernetes.cri.sandbox-name", "trainer-0"),
            ("io.kubernetes.cri.container-name", "cuda"),
            ("io.kubernetes.pod.name", "not-this-one"),
        ]);
        let names = pod_names(&containerd);
        assert_eq!(
            (
                names.namespace.as_deref(),
                names.pod.as_deref(),
                names.container.as_deref()
            ),
            (Some("team-a"), Some("trainer-0"), Some("cuda"))
        );
        assert_eq!(engine_of(&containerd), "kubernetes");
        let crio = state(&[
            ("io.container.manager", "cri-o"),
            ("io.kubernetes.pod.namespace", "team-b"),
            ("io.kubernetes.pod.name", "infer-1"),
            ("io.kubernetes.container.name", "server"),
        ]);
        let names = pod_names(&crio);
        assert_eq!(
            (
                names.namespace.as_deref(),
                names.pod.as_deref(),
                names.container.as_deref()
            ),
            (Some("team-b"), Some("infer-1"), Some("server"))
        );
        assert_eq!(engine_of(&crio), "kubernetes");
        assert_eq!(pod_names(&state(&[])), PodNames::default());
        let long = state(&[("io.kubernetes.cri.sandbox-name", &"p".repeat(5000))]);
        assert_eq!(
            pod_names(&long).pod.map(|p| p.len()),
            Some(PodNames::MAX_BYTES)
        );
        assert_eq!(
            state(&[("io.kubernetes.cri.sandbox-name", "x")])
                .container_record()
                .names
                .pod
                .as_deref(),
            Some("x")
        );
    }

    #[test]
    fn hostile_state_is_refused() {
        for bad in [
            r#"{"id":"../../etc","pid":1}"#,
            r#"{"id":"a/b"}"#,
            r#"{"pid":1}"#,
            "not json",
        ] {
            assert!(read_state(bad.as_bytes()).is_err(), "{bad}");
        }
        let huge = format!(
            r#"{{"id":"x","annotations":{{"a":"{}"}}}}"#,
            "x".repeat(2 << 20)
        );
        assert!(read_state(huge.as_bytes()).is_err());
    }
}
