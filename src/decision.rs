//! What gpushare decides for a request, and how the shim hands that decision to its hook.
//!
//! `resolve` is the request pipeline, the one every path that serves a request runs —
//! the shim and hook-only mode through `resolve_spec`, the NRI plugin through
//! `resolve_nri`, `gpushare daemon start` with a
//! request made from its flags: inventory → the devices the request resolves to →
//! `request::check` against their memory and the operator's ceilings → IPC mode → host
//! user → tenant → daemon identity (`Identity::for_request`). It creates nothing: a
//! request is refused before any directory exists or any byte is written.
//!
//! The tenant's namespace (`mps.tenant = "namespace"`) comes from what each path can
//! trust, never from what a pod writes: the NRI runtime's `PodSandbox.namespace`; in a
//! spec, containerd's CRI annotation only in a container of containerd's `k8s.io`
//! namespace (`cri_namespace`).
//!
//! `Decision` is the shim↔hook contract: the decision gpushare-runtime writes into a
//! container's annotations at `create` (docs/requests.md lists them), and [`identity_from_annotations`]
//! the validation the `createRuntime` hook applies when it reads it back from the
//! container state on stdin.
//!
//! Five annotations are written; the hook reads two. `gpushare.io/daemon` (the daemon id)
//! and `gpushare.io/identity` (the identity as JSON) are what the hook acts on.
//! `gpushare.io/host-uid`, `gpushare.io/host-gid` and `gpushare.io/ipc-mode` are for
//! operators (docs/requests.md lists them) and no code reads them back; outside tests,
//! this module is the only one that names any of the five.
//!
//! Invariants. The annotations reach the hook through the container's state, and a
//! container's author can set annotations of these names too (`--annotation`), so the hook
//! cannot tell the shim's values from a forgery by looking at them. What makes a forged
//! decision harmless is that the shim writes all five on every container it serves,
//! replacing whatever the container carried (`SetAnnotations` is the last spec edit and
//! replaces keys), and only a container the shim served carries the `createRuntime` hook
//! that acts on them; hook-only mode never reads them. The hook still re-validates every value before it touches a path or
//! starts anything ([`identity_from_annotations`]): the daemon id must be a valid id, the
//! identity well formed (devices, limits, a multi-user daemon is root's), and its id must
//! equal the daemon annotation — which proves only that the two annotations agree, not
//! who wrote them. The ranges it checks are the request keys' own (`request::keys`).

use std::collections::HashMap;

use anyhow::Context;

use crate::bundle::SpecFile;
use crate::config::{Config, Protocol};
use crate::device::{is_well_formed_uuid, ResolvedDevices};
use crate::identity::{valid_id, Identity, Namespace, Tenant, ID_ALLOWED, NAMESPACE_NAME_ALLOWED};
use crate::request::{self, DeviceValue, IpcMode, Request};

/// A request served on this node: what the pipeline decided for it.
#[derive(Debug)]
pub(crate) struct Resolved {
    pub request: Request,
    /// The devices it resolved to, checked against it.
    pub devices: ResolvedDevices,
    pub ipc: IpcMode,
    /// The host UID and GID it is served for.
    pub host_user: (u32, u32),
    /// The daemon that serves it.
    pub identity: Identity,
    /// On a v3 daemon, the limits of the container's own namespace; `None`: legacy.
    pub namespace_limits: Option<crate::identity::LimitValues>,
}

impl Resolved {
    /// The container's v3 namespace, where its daemon is v3.
    pub(crate) fn namespace(&self, container_id: &str) -> Option<Namespace> {
        self.namespace_limits
            .clone()
            .map(|limits| Namespace::of_container(container_id, limits))
    }
}

/// Whether a container is served by MPS v3 (`mps.protocol`, docs/mps.md, "Two
/// backends"): the node speaks it (`v3`, or `auto` on a driver of 615 or later), and the
/// container is neither on a MIG device (v3 namespaces and memory limits are not
/// supported there) nor host root (whom a v3 server lets change any namespace's limits):
/// those keep a legacy daemon.
fn serves_v3(cfg: &Config, driver_version: &str, devices: &[String], host_uid: u32) -> bool {
    let container = host_uid != 0 && !devices.iter().any(|d| d.starts_with("MIG-"));
    container
        && match cfg.mps.protocol {
            Protocol::Legacy => false,
            Protocol::V3 => true,
            Protocol::Auto => node_speaks_v3(cfg, driver_version),
        }
}

/// `mps.protocol = "auto"` on this node: the driver is 615 or later and the control
/// binary speaks protocol 3 (`driver::control_speaks_v3`, asked once per binary:
/// `inventory_cache::control_speaks_v3`).
fn node_speaks_v3(cfg: &Config, driver_version: &str) -> bool {
    crate::driver::has_mps_v3(driver_version)
        && crate::driver::control_binary(&cfg.mps.control_binary, cfg.driver_root.as_deref())
            .is_some_and(|binary| {
                crate::inventory_cache::control_speaks_v3(
                    &binary,
                    driver_version,
                    &cfg.state_dir,
                    crate::driver::control_speaks_v3,
                )
            })
}

/// The pipeline for a container's spec (the shim, hook-only mode): the request in it under
/// this node's config, then [`resolve`] for the container's user (`SpecFile::host_user`).
/// A spec that carries a CDI device of gpushare's (`SpecFile::cdi_ask`) asks for what its
/// hook's arguments say, with the profile's limits from `[cdi.profiles]`, and the
/// container's own request keys may only repeat it ([`request::from_cdi`]); any other
/// spec is read by [`request::parse`] with `accept-env-requests` and `default-device`.
/// `Ok(None)`: no request (a sandbox, no device key and no default that applies).
pub(crate) fn resolve_spec(
    cfg: &Config,
    spec: &SpecFile,
    ipc: impl FnOnce(&Request) -> anyhow::Result<IpcMode>,
) -> anyhow::Result<Option<Resolved>> {
    let namespace = cri_namespace(spec);
    resolve_spec_as(cfg, spec, ipc, || Ok(spec.host_user()?), namespace)
}

/// The Kubernetes namespace of a container's spec where it can be trusted, and the key
/// that said it: containerd's CRI annotation of a container whose bundle is in
/// containerd's `k8s.io` namespace (`engine::cri_namespace`). containerd's CRI writes that
/// annotation itself, after any pod annotation its `pod_annotations` allowlist passes
/// through, so a pod cannot set it; a container's author on any other engine can (Docker's
/// and ctr's `--annotation`, Podman's, CRI-O copies a pod's annotations into its
/// containers), and such a container's bundle is elsewhere: containerd chooses it from its
/// own namespace, which only its clients — root — name. `None`: no namespace to trust
/// ([`Tenant::NoNamespace`]).
pub(crate) fn cri_namespace(spec: &SpecFile) -> Option<(&str, &'static str)> {
    crate::engine::cri_namespace(|k| spec.annotation(k), spec.path().parent()?)
}

/// [`resolve_spec`] for a container an NRI runtime describes (the plugin builds its spec
/// view from the runtime's message): the host user is the spec's only where the runtime
/// told the container's user (`user_known`: NRI's `Container.user`, sent by containerd
/// from 2.3.0 on). Without it a per-user request is refused with one line naming what is
/// needed (`runtime`: the runtime's name and version, for that line), never served as
/// UID 0 or a guessed one; a multi-user daemon is root's whoever the user is.
pub(crate) fn resolve_nri(
    cfg: &Config,
    spec: &SpecFile,
    user_known: bool,
    runtime: &str,
    namespace: &str,
    ipc: impl FnOnce(&Request) -> anyhow::Result<IpcMode>,
) -> anyhow::Result<Option<Resolved>> {
    let namespace = (!namespace.is_empty()).then_some((namespace, "NRI's PodSandbox.namespace"));
    let host_user = || {
        if user_known {
            return Ok(spec.host_user()?);
        }
        if cfg.mps.user_mode == crate::config::UserMode::MultiUser {
            return Ok((0, 0));
        }
        anyhow::bail!(
            "the container's user is unknown: {runtime} does not tell NRI plugins a container's user (NRI's Container.user), and a per-user daemon must run as that user; allowed is containerd 2.3.0 or later, or gpushare's RuntimeClass (gpushare-runtime) on this node"
        )
    };
    resolve_spec_as(cfg, spec, ipc, host_user, namespace)
}

/// Whether the spec asks for a share, as the request pipeline reads it (`Ok(false)`: it
/// would pass through unserved), without the inventory or anything past the request's
/// own grammar: for the NRI validator, which must answer in microseconds. An error is a
/// request the pipeline would refuse.
pub(crate) fn asks(cfg: &Config, spec: &SpecFile) -> anyhow::Result<bool> {
    let (options, inputs) = (request_options(cfg), spec.request_inputs());
    Ok(if let Some(ask) = spec.cdi_ask()? {
        let named = format!("CDI device {}={}", request::CDI_KIND, ask.name());
        let profile = cdi_profile(cfg, &ask, &named)?;
        request::from_cdi(&inputs, &options, &ask.device, profile)
            .with_context(|| named.clone())?
            .is_some()
    } else {
        request::parse(&inputs, &options)?.is_some()
    })
}

fn request_options(cfg: &Config) -> request::Options {
    request::Options {
        accept_env: cfg.accept_env_requests,
        default_device: cfg.default_device,
        accept_visible_devices_env: cfg.accept_visible_devices_env,
    }
}

/// The limits of the config's profile that a CDI device of gpushare's names, if any.
fn cdi_profile<'c>(
    cfg: &'c Config,
    ask: &request::CdiAsk,
    named: &str,
) -> anyhow::Result<Option<request::ProfileLimits<'c>>> {
    let Some(name) = &ask.profile else {
        return Ok(None);
    };
    Ok(Some(cfg.cdi_profiles.get(name).map(|p| p.limits()).with_context(|| {
        format!(
            "{named}: profile {} is not in this node's config (no [cdi.profiles.{}]); allowed is a profile the config has: regenerate the CDI spec (gpushare cdi generate) after changing [cdi.profiles]",
            crate::util::escape(name),
            crate::util::escape(name)
        )
    })?))
}

fn resolve_spec_as(
    cfg: &Config,
    spec: &SpecFile,
    ipc: impl FnOnce(&Request) -> anyhow::Result<IpcMode>,
    host_user: impl FnOnce() -> anyhow::Result<(u32, u32)>,
    namespace: Option<(&str, &'static str)>,
) -> anyhow::Result<Option<Resolved>> {
    let options = request_options(cfg);
    let inputs = spec.request_inputs();
    let resolved = if let Some(ask) = spec.cdi_ask()? {
        let named = format!("CDI device {}={}", request::CDI_KIND, ask.name());
        let profile = cdi_profile(cfg, &ask, &named)?;
        let cdi = request::from_cdi(&inputs, &options, &ask.device, profile)
            .with_context(|| named.clone())?;
        let Some(cdi) = cdi else {
            return Ok(None);
        };
        resolve_with(
            cfg,
            cdi.request,
            cdi.own_device.as_ref(),
            ipc,
            host_user,
            namespace,
        )
        .with_context(|| named)?
    } else {
        let Some(req) = request::parse(&inputs, &options)? else {
            return Ok(None);
        };
        resolve_with(cfg, req, None, ipc, host_user, namespace)?
    };
    refuse_client_memory_limit(inputs.env, &resolved)?;
    Ok(Some(resolved))
}

/// Refuses a container whose own `process.env` sets the client's pinned memory limit
/// when its daemon enforces one. MPS reads the variable in the client, and an entry that
/// names a device the client cannot see makes the server drop the daemon's limit for that
/// client altogether (docs/gpu-validation.md, the 2026-11-26 run); gpushare writes the
/// variable itself where it can (the shim), so a request never needs it. This closes the
/// route through the spec (a pod's or `docker run -e` env, which the hook-only and CDI
/// paths cannot overwrite); a process that sets it for itself at run time is beyond any
/// runtime's reach (SECURITY.md, "What the limits bind").
fn refuse_client_memory_limit(env: &[String], resolved: &Resolved) -> anyhow::Result<()> {
    let Some(limit) = resolved.identity.limit(&request::PINNED_MEMORY_LIMIT) else {
        return Ok(());
    };
    // The client variable that sets an MPS client's own pinned memory limits: the row's.
    let Some(var) = request::PINNED_MEMORY_LIMIT.client_env.map(|c| c.var) else {
        return Ok(());
    };
    let prefix = format!("{var}=");
    if let Some(set) = env.iter().find(|e| e.starts_with(&prefix)) {
        anyhow::bail!(
            "process.env sets {}: an MPS client's own pinned memory limit that names a device it cannot see lifts its daemon's limit ({} here); allowed: no {var} in the container's environment (gpushare gives the client its limit; ask for a lower one with gpushare.io/pinned-memory-limit)",
            crate::util::escape(set),
            request::format_mps_size(limit)
        );
    }
    Ok(())
}

/// The pipeline's node half for a parsed request, in this order, the first fault stopping
/// it: the inventory, the devices the request resolves to, [`request::check`] against
/// their memory and the operator's ceilings, the IPC mode (`ipc`: the shim, hook-only mode
/// and `daemon start` each have their own rule), the host user, the tenant (`namespace`:
/// the trusted one and where it came from, [`Tenant::for_node`]), the daemon identity.
/// Creates nothing.
pub(crate) fn resolve(
    cfg: &Config,
    req: Request,
    ipc: impl FnOnce(&Request) -> anyhow::Result<IpcMode>,
    host_user: impl FnOnce() -> anyhow::Result<(u32, u32)>,
    namespace: Option<(&str, &'static str)>,
) -> anyhow::Result<Resolved> {
    resolve_with(cfg, req, None, ipc, host_user, namespace)
}

/// [`resolve`], and for a CDI device's request the container's own device key beside it
/// (`own_device`), which must resolve to the same devices.
fn resolve_with(
    cfg: &Config,
    req: Request,
    own_device: Option<&request::Sourced<DeviceValue>>,
    ipc: impl FnOnce(&Request) -> anyhow::Result<IpcMode>,
    host_user: impl FnOnce() -> anyhow::Result<(u32, u32)>,
    namespace: Option<(&str, &'static str)>,
) -> anyhow::Result<Resolved> {
    let inventory = crate::inventory_cache::load(
        &cfg.inventory,
        cfg.driver_root.as_deref(),
        &cfg.state_dir,
        cfg.inventory_cache_ttl,
    )?;
    let devices = req.device.resolve(&inventory)?;
    if let Some(own) = own_device {
        let own_devices = own.resolve(&inventory)?;
        request::check_same_devices(&req.device, &devices, own, &own_devices)?;
    }
    if let DeviceValue::Allocated(found) = &req.device.value {
        let sources: Vec<String> = found
            .sources()
            .map(|s| format!("{}={}", s.source, s.found))
            .collect();
        tracing::debug!(
            sources = %sources.join(" "),
            devices = %devices.uuids.join(","),
            "{}={} resolved from the container's allocation",
            req.device.key,
            req.device.raw
        );
    }
    request::check(&req, &devices, cfg.mps.ceilings())?;
    let ipc = ipc(&req)?;
    let host_user = host_user()?;
    let tenant = Tenant::for_node(cfg, namespace)?;
    let v3 = serves_v3(cfg, &inventory.driver_version, &devices.uuids, host_user.0);
    let identity = Identity::for_request(cfg, &devices.uuids, host_user.0, &req, ipc, tenant, v3);
    let namespace_limits = v3.then(|| crate::identity::enforced_limits(cfg, &req));
    Ok(Resolved {
        request: req,
        devices,
        ipc,
        host_user,
        identity,
        namespace_limits,
    })
}

/// The daemon id, [`ID_ALLOWED`]. Read by the hook.
const ANN_DAEMON: &str = "gpushare.io/daemon";
/// The daemon identity as JSON. Read by the hook.
const ANN_IDENTITY: &str = "gpushare.io/identity";
/// The container user's host UID. For operators only.
const ANN_HOST_UID: &str = "gpushare.io/host-uid";
/// The container user's host GID. For operators only.
const ANN_HOST_GID: &str = "gpushare.io/host-gid";
/// `isolated` or `host`. For operators only (the identity carries it for the hook).
const ANN_IPC_MODE: &str = "gpushare.io/ipc-mode";
/// On a v3 daemon, the container's namespace and its limits as JSON. Read by the hook.
const ANN_NAMESPACE: &str = "gpushare.io/mps-namespace";

/// What the shim decided for a container and hands the hook.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Decision {
    /// The daemon the container uses.
    pub identity: Identity,
    /// The container user's host UID and GID (`SpecFile::host_user`): informational, the
    /// daemon's own are in the identity.
    pub host_user: (u32, u32),
    /// On a v3 daemon, the container's namespace.
    pub namespace: Option<Namespace>,
}

impl Decision {
    /// The decision annotations, in the order the shim writes them.
    pub(crate) fn to_annotations(&self) -> Result<Vec<(String, String)>, serde_json::Error> {
        let ipc = if self.identity.ipc_host {
            IpcMode::Host
        } else {
            IpcMode::Isolated
        };
        let mut annotations = vec![
            (ANN_DAEMON.into(), self.identity.id()),
            (ANN_IDENTITY.into(), serde_json::to_string(&self.identity)?),
            (ANN_HOST_UID.into(), self.host_user.0.to_string()),
            (ANN_HOST_GID.into(), self.host_user.1.to_string()),
            (ANN_IPC_MODE.into(), ipc.to_string()),
        ];
        if let Some(ns) = &self.namespace {
            annotations.push((ANN_NAMESPACE.into(), serde_json::to_string(ns)?));
        }
        Ok(annotations)
    }
}

/// A decision the hook refuses.
#[derive(Debug, thiserror::Error)]
pub enum DecisionError {
    #[error(
        "annotation {ANN_DAEMON} is missing: the container was not prepared by gpushare-runtime"
    )]
    NotPrepared,
    #[error("annotation {ANN_DAEMON}={value:?} is invalid: allowed is {ID_ALLOWED}")]
    InvalidDaemonId { value: String },
    #[error("annotation {ANN_IDENTITY} is missing")]
    NoIdentity,
    #[error("annotation {ANN_IDENTITY} is not a valid identity")]
    UnparsableIdentity {
        #[source]
        source: serde_json::Error,
    },
    #[error("annotation {ANN_IDENTITY} holds an invalid identity: {raw:?}")]
    InvalidIdentity { raw: String },
    #[error("annotation {ANN_DAEMON}={daemon} does not match the identity in {ANN_IDENTITY}")]
    Mismatch { daemon: String },
    #[error("annotation {ANN_NAMESPACE} is missing: a v3 daemon's container needs its namespace")]
    NoNamespace,
    #[error("annotation {ANN_NAMESPACE} is only for a v3 daemon's container")]
    NamespaceOnLegacy,
    #[error("annotation {ANN_NAMESPACE} holds an invalid namespace: {raw:?}; allowed is the container's own ({NAMESPACE_NAME_ALLOWED}, from its id) with limits in their ranges")]
    InvalidNamespace { raw: String },
}

/// The v3 namespace the shim decided for container `container_id`, read back from its
/// annotations and checked: present exactly when the identity is v3, named from this
/// container's id, its limits in their rows' ranges.
pub(crate) fn namespace_from_annotations(
    ann: &HashMap<String, String>,
    ident: &Identity,
    container_id: &str,
) -> Result<Option<Namespace>, DecisionError> {
    let Some(raw) = ann.get(ANN_NAMESPACE) else {
        return match ident.v3 {
            true => Err(DecisionError::NoNamespace),
            false => Ok(None),
        };
    };
    if !ident.v3 {
        return Err(DecisionError::NamespaceOnLegacy);
    }
    let invalid = || DecisionError::InvalidNamespace {
        raw: crate::util::escape(raw).chars().take(256).collect(),
    };
    let ns: Namespace = serde_json::from_str(raw).map_err(|_| invalid())?;
    if ns.name != Namespace::name_for(container_id) || !ns.limits_valid() {
        return Err(invalid());
    }
    Ok(Some(ns))
}

/// The daemon id as the annotation holds it, unvalidated: `poststop` hands it to
/// `ensure::release` (which validates it and only looks there first). Nothing takes its
/// presence for "prepared by gpushare-runtime": a container's author can write it
/// (hook-only mode asks the spec's hooks, `SpecFile::prepared_by_shim`).
pub(crate) fn daemon_annotation(ann: &HashMap<String, String>) -> Option<&str> {
    ann.get(ANN_DAEMON).map(String::as_str)
}

/// The identity the shim decided, read back from a container's annotations, validated and
/// checked against the daemon id (see the module doc for what that does and does not
/// prove).
pub fn identity_from_annotations(ann: &HashMap<String, String>) -> Result<Identity, DecisionError> {
    let id = ann.get(ANN_DAEMON).ok_or(DecisionError::NotPrepared)?;
    if !valid_id(id) {
        return Err(DecisionError::InvalidDaemonId { value: id.clone() });
    }
    let raw = ann.get(ANN_IDENTITY).ok_or(DecisionError::NoIdentity)?;
    let ident: Identity =
        serde_json::from_str(raw).map_err(|source| DecisionError::UnparsableIdentity { source })?;
    let devices_ok = !ident.devices.is_empty()
        && ident.devices.len() <= crate::request::MAX_DEVICES
        && ident.devices.iter().all(|d| {
            is_well_formed_uuid(d, "GPU-")
                || (is_well_formed_uuid(d, "MIG-") && ident.devices.len() == 1)
        });
    let in_range = |key: &request::KeySpec, value: Option<u64>| {
        value.is_none_or(|v| key.number().is_some_and(|n| n.allows(v)))
    };
    let limits_ok = request::KEYS
        .into_iter()
        .all(|key| in_range(key, ident.limit(key)));
    let tenant_ok = ident
        .tenant
        .as_ref()
        .is_none_or(|t| t.is_valid() && !ident.multi_user);
    // A v3 daemon is root's, multi-user, of whole GPUs, and holds no limit or tenant.
    let v3_ok = !ident.v3
        || (ident.multi_user
            && ident.limits == crate::identity::LimitValues::default()
            && ident.tenant.is_none()
            && ident.devices.iter().all(|d| d.starts_with("GPU-")));
    if !devices_ok || !limits_ok || !tenant_ok || !v3_ok || (ident.multi_user && ident.uid != 0) {
        return Err(DecisionError::InvalidIdentity { raw: raw.clone() });
    }
    if ident.id() != *id {
        return Err(DecisionError::Mismatch { daemon: id.clone() });
    }
    Ok(ident)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ident() -> Identity {
        crate::identity::test_identity(1000, Some(25))
    }

    fn ann(i: &Identity) -> HashMap<String, String> {
        HashMap::from([
            (ANN_DAEMON.to_owned(), i.id()),
            (ANN_IDENTITY.to_owned(), serde_json::to_string(i).unwrap()),
        ])
    }

    #[test]
    fn annotations_round_trip_and_name_every_key() {
        for ipc_host in [false, true] {
            let d = Decision {
                identity: Identity {
                    ipc_host,
                    ..ident()
                },
                host_user: (101000, 101001),
                namespace: None,
            };
            let written: HashMap<String, String> =
                d.to_annotations().unwrap().into_iter().collect();
            assert_eq!(
                written,
                HashMap::from([
                    (ANN_DAEMON.to_owned(), d.identity.id()),
                    (
                        ANN_IDENTITY.to_owned(),
                        serde_json::to_string(&d.identity).unwrap()
                    ),
                    (ANN_HOST_UID.to_owned(), "101000".to_owned()),
                    (ANN_HOST_GID.to_owned(), "101001".to_owned()),
                    (
                        ANN_IPC_MODE.to_owned(),
                        if ipc_host { "host" } else { "isolated" }.to_owned()
                    ),
                ])
            );
            assert_eq!(identity_from_annotations(&written).unwrap(), d.identity);
            assert_eq!(daemon_annotation(&written), Some(d.identity.id().as_str()));
        }
    }

    #[test]
    fn decided_identity_is_checked() {
        let good = ident();
        assert_eq!(identity_from_annotations(&ann(&good)).unwrap(), good);

        let mut forged = ann(&good);
        let mut other = good.clone();
        other.uid = 0;
        forged.insert(ANN_IDENTITY.into(), serde_json::to_string(&other).unwrap());
        let err = identity_from_annotations(&forged).unwrap_err().to_string();
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
                limits: crate::identity::test_limits(Some(0), None),
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
            let err = identity_from_annotations(&ann(&bad))
                .unwrap_err()
                .to_string();
            assert!(err.contains("invalid identity"), "{bad:?}: {err}");
        }
        let mut no_id = ann(&good);
        no_id.remove(ANN_DAEMON);
        assert!(identity_from_annotations(&no_id)
            .unwrap_err()
            .to_string()
            .contains("missing"));
    }

    /// A spec's namespace is trusted only in a container of containerd's `k8s.io`
    /// namespace (where containerd's CRI wrote it); anywhere else its author did.
    #[test]
    fn only_a_cri_bundle_s_namespace_annotation_is_trusted() {
        let spec = |path: &str, ns: Option<&str>| {
            let mut doc = serde_json::json!({"ociVersion": "1.0.2", "process": {"user": {"uid": 1000, "gid": 1000}, "cwd": "/"}});
            if let Some(ns) = ns {
                doc["annotations"] =
                    serde_json::json!({ "io.kubernetes.cri.sandbox-namespace": ns });
            }
            SpecFile::from_bytes(
                std::path::Path::new(path),
                &serde_json::to_vec(&doc).unwrap(),
            )
            .unwrap()
        };
        let cri = "/run/containerd/io.containerd.runtime.v2.task/k8s.io/abc/config.json";
        assert_eq!(
            cri_namespace(&spec(cri, Some("team-a"))).map(|(ns, _)| ns),
            Some("team-a")
        );
        assert_eq!(cri_namespace(&spec(cri, None)), None);
        for elsewhere in [
            // Docker's containers, ctr's default namespace, Podman, CRI-O, runc by hand.
            "/run/containerd/io.containerd.runtime.v2.task/moby/abc/config.json",
            "/run/containerd/io.containerd.runtime.v2.task/default/abc/config.json",
            "/var/lib/containers/storage/overlay-containers/abc/userdata/config.json",
            "/tmp/bundle/k8s.io/abc/config.json",
            "io.containerd.runtime.v2.task/k8s.io/abc/config.json",
            "config.json",
        ] {
            assert_eq!(
                cri_namespace(&spec(elsewhere, Some("team-a"))),
                None,
                "{elsewhere}"
            );
        }
    }

    #[test]
    fn a_tenant_read_back_is_checked() {
        let ns = |t: Tenant| Identity {
            tenant: Some(t),
            ..ident()
        };
        for good in [
            ns(Tenant::Namespace("team-a".into())),
            ns(Tenant::NoNamespace),
        ] {
            assert_eq!(identity_from_annotations(&ann(&good)).unwrap(), good);
        }
        for bad in [
            ns(Tenant::Namespace("../x".into())),
            ns(Tenant::Namespace(String::new())),
            Identity {
                multi_user: true,
                uid: 0,
                ..ns(Tenant::Namespace("team-a".into()))
            },
        ] {
            let err = identity_from_annotations(&ann(&bad))
                .unwrap_err()
                .to_string();
            assert!(err.contains("invalid identity"), "{bad:?}: {err}");
        }
    }

    #[test]
    fn a_namespace_read_back_is_checked() {
        use crate::identity::test_limits;
        let v3 = Identity {
            uid: 0,
            gid: 0,
            multi_user: true,
            limits: Default::default(),
            v3: true,
            ..ident()
        };
        let ns = Namespace::of_container("c1", test_limits(Some(25), Some(1 << 30)));
        let with = |i: &Identity, ns: Option<&Namespace>| {
            let d = Decision {
                identity: i.clone(),
                host_user: (1000, 1000),
                namespace: ns.cloned(),
            };
            d.to_annotations()
                .unwrap()
                .into_iter()
                .collect::<HashMap<_, _>>()
        };
        let read = |a: &HashMap<String, String>, cid: &str| {
            namespace_from_annotations(a, &identity_from_annotations(a).unwrap(), cid)
                .map_err(|e| e.to_string())
        };
        assert_eq!(
            identity_from_annotations(&with(&v3, Some(&ns))).unwrap(),
            v3
        );
        assert_eq!(read(&with(&v3, Some(&ns)), "c1"), Ok(Some(ns.clone())));
        assert_eq!(read(&with(&ident(), None), "c1"), Ok(None));
        // Another container's namespace, none on a v3 daemon, one on a legacy daemon.
        assert!(read(&with(&v3, Some(&ns)), "c2")
            .unwrap_err()
            .contains("invalid namespace"));
        assert!(read(&with(&v3, None), "c1")
            .unwrap_err()
            .contains("is missing"));
        assert!(read(&with(&ident(), Some(&ns)), "c1")
            .unwrap_err()
            .contains("only for a v3"));
        // Limits out of their rows' ranges.
        let wide = Namespace {
            limits: test_limits(Some(101), None),
            ..ns.clone()
        };
        assert!(read(&with(&v3, Some(&wide)), "c1")
            .unwrap_err()
            .contains("invalid namespace"));
        // A v3 identity is root's, multi-user, limitless, of whole GPUs.
        for bad in [
            Identity {
                limits: test_limits(Some(50), None),
                ..v3.clone()
            },
            Identity {
                multi_user: false,
                ..v3.clone()
            },
            Identity {
                tenant: Some(Tenant::NoNamespace),
                ..v3.clone()
            },
        ] {
            let err = identity_from_annotations(&with(&bad, Some(&ns)))
                .unwrap_err()
                .to_string();
            assert!(err.contains("invalid identity"), "{bad:?}: {err}");
        }
    }

    /// The messages are the hook's one line on a refused create: pinned, as the hook wrote
    /// them before they had a home here.
    #[test]
    fn refusals_name_the_annotation() {
        let good = ident();
        let with = |k: &str, v: &str| {
            let mut a = ann(&good);
            a.insert(k.to_owned(), v.to_owned());
            a
        };
        let without = |k: &str| {
            let mut a = ann(&good);
            a.remove(k);
            a
        };
        let msg = |a: &HashMap<String, String>| {
            format!(
                "{:#}",
                anyhow::Error::from(identity_from_annotations(a).unwrap_err())
            )
        };
        assert_eq!(
            msg(&without(ANN_DAEMON)),
            "annotation gpushare.io/daemon is missing: the container was not prepared by gpushare-runtime"
        );
        assert_eq!(
            msg(&with(ANN_DAEMON, "../../etc")),
            "annotation gpushare.io/daemon=\"../../etc\" is invalid: allowed is 32 lowercase hex digits"
        );
        assert_eq!(
            msg(&without(ANN_IDENTITY)),
            "annotation gpushare.io/identity is missing"
        );
        assert!(msg(&with(ANN_IDENTITY, "{")).starts_with(
            "annotation gpushare.io/identity is not a valid identity: EOF while parsing"
        ));
        let other = "0123456789abcdef0123456789abcdef";
        assert_eq!(
            msg(&with(ANN_DAEMON, other)),
            format!("annotation gpushare.io/daemon={other} does not match the identity in gpushare.io/identity")
        );
    }
}
