//! `gpushare daemon start` and `gpushare daemon stop`: MPS daemons outside any container.
//!
//! Invariants: `start` validates its flags with the same grammar, the same pipeline and
//! the same identity as a container's request (`decision::resolve`), so the daemon it
//! starts is the one a container with that request would use; `stop` refuses a daemon
//! that containers still use unless forced, and checks every id before it names a path.

use crate::config::Config;
use crate::identity::Identity;
use crate::mps::ensure::Ensured;
use crate::request::{self, DeviceValue, KeySpec, Request, RequestError, Settings, Sourced};
use crate::state::StateDir;

/// `gpushare daemon start`'s flags, with the UID settled (`cli` requires one unless the
/// daemon is multi-user, and passes 0 then).
#[derive(Debug, Clone)]
pub(crate) struct Start {
    pub device: String,
    pub uid: u32,
    pub gid: Option<u32>,
    /// The request keys given as flags (the rows' `flag`), with their raw values.
    pub settings: Vec<(&'static KeySpec, String)>,
    /// `--namespace`: the Kubernetes namespace whose daemon it is, under `mps.tenant =
    /// "namespace"` (unset: the "no namespace" tenant's).
    pub namespace: Option<String>,
    /// Print what was started as JSON.
    pub json: bool,
}

/// `gpushare daemon start`: the same validation and identity as a container's request.
pub(crate) fn start(cfg: &Config, args: &Start) -> anyhow::Result<()> {
    let req = request_from_flags(args)?;
    if args.namespace.is_some() && cfg.mps.tenant == crate::config::TenantMode::Uid {
        anyhow::bail!(
            "--namespace names a tenant, and this node's tenants are host UIDs (mps.tenant = \"uid\"{}); allowed is no --namespace here, or mps.tenant = \"namespace\" with per-user daemons",
            if cfg.mps.user_mode == crate::config::UserMode::MultiUser {
                ", as for every multi-user daemon"
            } else {
                ""
            }
        );
    }
    let (uid, gid) = (args.uid, args.gid);
    let mut ident = crate::decision::resolve(
        cfg,
        req,
        |_| Ok(cfg.mps.ipc_mode()),
        || Ok((uid, gid.unwrap_or(uid))),
        args.namespace.as_deref().map(|ns| (ns, "--namespace")),
    )?
    .identity;
    // The operator's --gid wins over mps.daemon-gid (multi-user daemons stay root's).
    if let Some(gid) = gid.filter(|_| !ident.multi_user) {
        ident.gid = gid;
    }
    let state = StateDir::new(&cfg.state_dir);
    let ensured = crate::mps::ensure::ensure(cfg, &state, &ident, None)?;
    if args.json {
        print_json(&state, &ident, &ensured);
    } else {
        print_text(&state, &ident, &ensured);
    }
    Ok(())
}

/// The request the flags spell, each value parsed by the request's own grammar and named
/// by its flag in errors.
fn request_from_flags(args: &Start) -> Result<Request, RequestError> {
    let mut settings = Settings::default();
    for (key, raw) in &args.settings {
        let (Some(flag), Some(number)) = (key.flag, key.number()) else {
            continue;
        };
        settings = settings.with(key, Sourced::parse(flag, raw, |k, r| number.parse(k, r))?);
    }
    Ok(Request {
        // `allocated` needs a container to take the allocation from: refused here.
        device: Sourced::parse("--device", &args.device, |key, raw| {
            request::parse_device_without_container(key, raw, "gpushare daemon start")
                .map(DeviceValue::Named)
        })?,
        ipc: None,
        settings,
    })
}

/// `--json`: the id, the pids and the directories a client needs.
fn print_json(state: &StateDir, ident: &Identity, ensured: &Ensured) {
    let id = &ensured.record.id;
    let v = serde_json::json!({
        "id": id,
        "started": ensured.started,
        "pid": ensured.record.daemon.map(|p| p.pid),
        "uid": ident.uid,
        "multi_user": ident.multi_user,
        "devices": ident.devices,
        "pipe_dir": state.pipe_dir(id),
        "shm_dir": (!ident.ipc_host).then(|| state.shm_dir(id)),
        "log_dir": state.log_dir(id),
    });
    println!("{v}");
}

/// The daemon and what a client outside a container needs to reach it.
fn print_text(state: &StateDir, ident: &Identity, ensured: &Ensured) {
    let id = &ensured.record.id;
    println!(
        "{} daemon {} (pid {}) for {} on {}: CUDA_MPS_PIPE_DIRECTORY={}",
        if ensured.started { "started" } else { "found" },
        id,
        ensured.record.daemon.map_or(0, |p| p.pid),
        if ident.multi_user {
            "every uid".to_owned()
        } else {
            format!("uid {}", ident.uid)
        },
        ident.devices.join(","),
        state.pipe_dir(id).display()
    );
    if !ident.ipc_host {
        println!(
            "a client outside a container also needs {} as its /dev/shm",
            state.shm_dir(id).display()
        );
    }
}

/// `gpushare daemon stop`: daemon `id`, or every daemon (`all`); one that containers
/// still use only with `force`. With `all`, every daemon that can be stopped is: each one
/// left running (in use, or its stop failed) gets one line on stderr, and their number is
/// returned. A single `id` that cannot be stopped is an error.
pub(crate) fn stop(
    cfg: &Config,
    id: Option<String>,
    all: bool,
    force: bool,
) -> anyhow::Result<usize> {
    let state = StateDir::new(&cfg.state_dir);
    let one = |id: &str| -> anyhow::Result<()> {
        if !crate::identity::valid_id(id) {
            anyhow::bail!(
                "daemon id {id:?} is invalid: allowed is {} (see gpushare daemon list)",
                crate::identity::ID_ALLOWED
            );
        }
        if !state.daemon_dir(id).exists() {
            anyhow::bail!(
                "no daemon {id} under {} (see gpushare daemon list)",
                state.root().display()
            );
        }
        let users = state.containers(id)?;
        if !users.is_empty() && !force {
            anyhow::bail!(
                "daemon {id} is used by {} container(s) ({}); stop them first or pass --force",
                users.len(),
                users
                    .iter()
                    .map(|c| c.id.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        crate::mps::ensure::stop(cfg, &state, id, std::time::Duration::from_secs(5))?;
        println!("stopped daemon {id}");
        Ok(())
    };
    match (id, all) {
        (_, true) => {
            let mut left = 0;
            for id in state.daemon_ids()? {
                if let Err(e) = one(&id) {
                    eprintln!("gpushare: {e:#}");
                    left += 1;
                }
            }
            Ok(left)
        }
        (Some(id), false) => one(&id).map(|()| 0),
        (None, false) => anyhow::bail!(
            "daemon stop needs --id <ID> (one daemon; see gpushare daemon list) or --all (every daemon)"
        ),
    }
}
