//! `gpushare hook <stage>`: what runc runs at the hooks the shim injected.
//!
//! The hook reads the container state (runtime-spec "State") from stdin and the shim's
//! decisions from its annotations; it never needs the bundle. `create-runtime` ensures the
//! daemon (and fails the create with one `gpushare: …` line on stderr if it cannot);
//! `poststop` releases the container's reference and never fails. Invariant: the decision
//! annotations are re-validated here as if hostile — the identity must be well formed and
//! hash to the daemon id the shim wrote — because they arrive through the container's
//! state, not from the shim directly.

use std::collections::HashMap;
use std::io::Read;
use std::path::PathBuf;

use anyhow::{bail, Context};
use serde::Deserialize;

use crate::config::Config;
use crate::device::is_well_formed_uuid;
use crate::identity::{valid_id, Identity, ID_ALLOWED};
use crate::mps::ensure;
use crate::state::{valid_container_id, ContainerRecord, StateDir};

/// Decision annotations written by the shim for the hook (DESIGN §4.5).
pub const ANN_DAEMON: &str = "gpushare.io/daemon";
pub const ANN_IDENTITY: &str = "gpushare.io/identity";
pub const ANN_HOST_UID: &str = "gpushare.io/host-uid";
pub const ANN_HOST_GID: &str = "gpushare.io/host-gid";
pub const ANN_IPC_MODE: &str = "gpushare.io/ipc-mode";

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

/// The identity the shim decided, validated and checked against its id.
pub fn decided_identity(ann: &HashMap<String, String>) -> anyhow::Result<Identity> {
    let id = ann
        .get(ANN_DAEMON)
        .with_context(|| format!("annotation {ANN_DAEMON} is missing: the container was not prepared by gpushare-runtime"))?;
    if !valid_id(id) {
        bail!("annotation {ANN_DAEMON}={id:?} is invalid: allowed is {ID_ALLOWED}");
    }
    let raw = ann
        .get(ANN_IDENTITY)
        .with_context(|| format!("annotation {ANN_IDENTITY} is missing"))?;
    let ident: Identity = serde_json::from_str(raw)
        .with_context(|| format!("annotation {ANN_IDENTITY} is not a valid identity"))?;
    let devices_ok = !ident.devices.is_empty()
        && ident.devices.len() <= crate::request::MAX_DEVICES
        && ident.devices.iter().all(|d| {
            is_well_formed_uuid(d, "GPU-")
                || (is_well_formed_uuid(d, "MIG-") && ident.devices.len() == 1)
        });
    let limits_ok = ident
        .active_thread_percentage
        .is_none_or(|p| (1..=100).contains(&p))
        && ident
            .pinned_memory_limit
            .is_none_or(|m| m >= crate::request::MIN_PINNED_MEMORY_LIMIT);
    if !devices_ok || !limits_ok || (ident.multi_user && ident.uid != 0) {
        bail!("annotation {ANN_IDENTITY} holds an invalid identity: {raw:?}");
    }
    if ident.id() != *id {
        bail!("annotation {ANN_DAEMON}={id} does not match the identity in {ANN_IDENTITY}");
    }
    Ok(ident)
}

/// Which engine created a container, from what engines leave in its state.
pub fn engine_of(state: &State) -> String {
    let ann = |k: &str| state.annotations.get(k).map(String::as_str);
    let bundle = state
        .bundle
        .as_deref()
        .map(|b| b.to_string_lossy().into_owned())
        .unwrap_or_default();
    if ann("io.kubernetes.cri.container-type").is_some() {
        "kubernetes".into()
    } else if ann("io.container.manager") == Some("libpod") {
        "podman".into()
    } else if bundle.contains("/moby/") {
        "docker".into()
    } else if bundle.contains("io.containerd.runtime.v2.task") {
        "containerd".into()
    } else {
        "runc".into()
    }
}

/// `createRuntime`: ensure the daemon, record the container.
pub fn create_runtime(cfg: &Config, state: &State) -> anyhow::Result<()> {
    let ident = decided_identity(&state.annotations)?;
    let dirs = StateDir::new(&cfg.state_dir);
    let rec = ContainerRecord {
        id: state.id.clone(),
        pid: state.pid,
        start_time: state.pid.and_then(crate::util::proc_start_time),
        bundle: state.bundle.clone(),
        created_at: crate::util::unix_now(),
        engine: Some(crate::hook::engine_of(state)),
    };
    let ensured = ensure::ensure(cfg, &dirs, &ident, Some(&rec))?;
    tracing::info!(
        daemon = %ensured.record.id,
        started = ensured.started,
        uid = ident.uid,
        devices = %ident.devices.join(","),
        "container attached to MPS daemon"
    );
    Ok(())
}

/// `poststop`: forget the container. Logs, never fails.
pub fn poststop(cfg: &Config, state: &State) {
    let dirs = StateDir::new(&cfg.state_dir);
    let daemon = state.annotations.get(ANN_DAEMON).map(String::as_str);
    if ensure::release(&dirs, daemon, &state.id) {
        tracing::info!(daemon = daemon.unwrap_or("?"), "container released");
    } else {
        tracing::debug!("no record of the container to release");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ident() -> Identity {
        Identity {
            devices: vec!["GPU-8f8bff94-112e-9541-43da-cfd453333404".into()],
            uid: 1000,
            gid: 1000,
            multi_user: false,
            active_thread_percentage: Some(25),
            pinned_memory_limit: None,
            ipc_host: false,
        }
    }

    fn ann(i: &Identity) -> HashMap<String, String> {
        HashMap::from([
            (ANN_DAEMON.to_owned(), i.id()),
            (ANN_IDENTITY.to_owned(), serde_json::to_string(i).unwrap()),
        ])
    }

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

    #[test]
    fn decided_identity_is_checked() {
        let good = ident();
        assert_eq!(decided_identity(&ann(&good)).unwrap(), good);

        let mut forged = ann(&good);
        let mut other = good.clone();
        other.uid = 0;
        forged.insert(ANN_IDENTITY.into(), serde_json::to_string(&other).unwrap());
        let err = decided_identity(&forged).unwrap_err().to_string();
        assert!(err.contains("does not match"), "{err}");

        for bad in [
            Identity {
                devices: vec!["GPU-../../x".into()],
                ..good.clone()
            },
            Identity {
                devices: vec![],
                ..good.clone()
            },
            Identity {
                active_thread_percentage: Some(0),
                ..good.clone()
            },
            Identity {
                devices: vec![
                    "MIG-22f0c05f-5cf2-5ea2-8297-789695656dc0".into(),
                    "GPU-8f8bff94-112e-9541-43da-cfd453333404".into(),
                ],
                ..good.clone()
            },
            Identity {
                multi_user: true,
                ..good.clone()
            },
        ] {
            let err = decided_identity(&ann(&bad)).unwrap_err().to_string();
            assert!(err.contains("invalid identity"), "{bad:?}: {err}");
        }
        let mut no_id = ann(&good);
        no_id.remove(ANN_DAEMON);
        assert!(decided_identity(&no_id)
            .unwrap_err()
            .to_string()
            .contains("missing"));
    }
}
