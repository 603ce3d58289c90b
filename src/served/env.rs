//! The environment a served container and gpushare's hooks on it get, whichever entry
//! path serves it: the MPS client variables (`client_env`) and the hooks' own
//! (`hook_env`).

use std::path::Path;

use crate::config::Config;
use crate::decision::Resolved;
use crate::mps::control::SAFE_PATH;
use crate::request;

use super::mounts::CUDA_DEFAULT_PIPE_DIR;

/// The pipe directory NVIDIA's container toolkit mounts from the host when present
/// (docs/mps.md, "What NVIDIA's container toolkit mounts"): CUDA's default.
pub(crate) const NVIDIA_HOST_PIPE_DIR: &str = CUDA_DEFAULT_PIPE_DIR;

/// The container's MPS client environment: where the pipe (and log) directory is, and the
/// client variable of every request key whose row has one (its value, else the node's
/// default); for NVIDIA's runtime (`nvidia`: the low-level runtime that will create the
/// container is NVIDIA's), the devices too.
pub(crate) fn client_env(cfg: &Config, served: &Resolved, nvidia: bool) -> Vec<(String, String)> {
    let (req, uuids) = (&served.request, &served.devices.uuids);
    let mut env = vec![(
        "CUDA_MPS_PIPE_DIRECTORY".to_owned(),
        cfg.mps.container_pipe_dir.to_string_lossy().into_owned(),
    )];
    if let Some(dir) = &cfg.mps.container_log_dir {
        env.push((
            "CUDA_MPS_LOG_DIRECTORY".into(),
            dir.to_string_lossy().into_owned(),
        ));
    }
    // Each key's client variable. A limit's repeats what the daemon applies under
    // "enforced" (a tenant can only lower it) and is the only limit under "advisory"; a
    // key outside the identity (the priority) is the client's alone.
    for key in request::KEYS {
        let (Some(client), Some(number)) = (key.client_env, key.number()) else {
            continue;
        };
        let Some(value) = crate::identity::requested(cfg, req, key) else {
            continue;
        };
        env.push((
            client.var.to_owned(),
            client.value(number, value, uuids.len()),
        ));
    }
    if nvidia {
        env.push(("NVIDIA_VISIBLE_DEVICES".into(), uuids.join(",")));
        // libnvidia-container binds a host /tmp/nvidia-mps into every GPU container when
        // it exists (docs/mps.md, "What NVIDIA's container toolkit mounts"), which would
        // cover our pipe directory there.
        if Path::new(NVIDIA_HOST_PIPE_DIR).exists()
            && cfg.mps.container_pipe_dir == Path::new(NVIDIA_HOST_PIPE_DIR)
        {
            tracing::warn!(
                "the host has {NVIDIA_HOST_PIPE_DIR}, which NVIDIA's container toolkit mounts into GPU containers over gpushare's pipe directory; remove it (stop the host-wide MPS daemon) or set mps.container-pipe-dir elsewhere"
            );
        }
    }
    env
}

/// The environment of a hook gpushare puts on a container (the shim's, and the hook-only
/// base spec's of `gpushare install containerd --hook-only`): a fixed PATH, and
/// `GPUSHARE_CONFIG` naming `config` when one is given, so that the hook reads the config
/// of the process that wrote it, whatever runc's environment.
pub(crate) fn hook_env(config: Option<&Path>) -> Vec<String> {
    let mut env = vec![format!("PATH={SAFE_PATH}")];
    if let Some(path) = config {
        let abs = std::path::absolute(path).unwrap_or_else(|_| path.to_owned());
        env.push(format!("{}={}", crate::config::ENV_VAR, abs.display()));
    }
    env
}
