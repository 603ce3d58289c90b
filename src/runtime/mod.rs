//! `gpushare-runtime`: the OCI runtime shim with runc's command line (docs/design.md,
//! "The shim").
//!
//! Invariants: for every command but `create` and `run`, the shim reads nothing but the
//! `low-level-runtime` key and execs the low-level runtime with argv untouched — no log
//! file, no inventory, no spec. For `create`/`run` it reads config.json once; a container
//! without a request is exec'd with config.json byte-for-byte untouched (and, when its
//! bytes cannot spell one, exactly as a passthrough is: nothing parsed, no log — with
//! `default-device` set, "spell one" includes an allocation, `RawSpec::may_hold_allocation`);
//! a pod's sandbox is exec'd as a passthrough is once its annotations are parsed, before
//! the full config is read or a log opened (`engine::sandbox_marker`); a request is
//! validated completely (syntax, device, memory, the operator's ceilings:
//! `decision::resolve_spec`, shared with hook-only mode and `gpushare daemon start`)
//! before any directory is created or any byte written; on failure the shim writes one
//! error line to runc's `--log`, logs to its own file, prints nothing (stdio belongs to
//! the container) and exits 1.

pub mod args;
pub(crate) mod runclog;

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use anyhow::Context;

use crate::bundle::edits::{self, SetHooks};
use crate::bundle::SpecFile;
use crate::config::Config;
use crate::decision::{self, Resolved};
use crate::request::{IpcMode, Request};
use crate::rootfs::Maker;
use crate::served::{Inside, MountPlan};
use crate::state::{valid_container_id, ContainerRecord, StateDir};

/// What `gpushare-runtime` without arguments prints.
const USAGE: &str =
    "usage: gpushare-runtime [runc's global options] <runc command> [options] [args]\n\
gpushare-runtime is the OCI runtime that Docker, containerd and Kubernetes call in place of runc:\n\
it takes runc's command line, adds the MPS share a container asks for on create, and runs the\n\
low-level runtime (runc) for everything. It is not meant to be run by hand: see `gpushare --help`\n\
and `gpushare-runtime --help` (runc's own help).";

/// Seconds runc gives the poststop hook.
const POSTSTOP_TIMEOUT: u64 = 10;

/// The shim's entry point: returns the exit code when it does not exec.
pub fn main(argv: Vec<OsString>) -> i32 {
    let rest = argv.get(1..).unwrap_or(&[]);
    if rest.is_empty() {
        // Engines always pass a command; a person typing the name gets ours, not runc's.
        eprintln!("{USAGE}");
        return 2;
    }
    let inv = args::scan(rest).unwrap_or_default();
    if inv.command.is_none() && rest.iter().any(|a| a == "--version" || a == "-v") {
        // Ours first, then the low-level runtime's own (as NVIDIA's shim does).
        println!("gpushare-runtime version {}", crate::util::VERSION);
    }
    if !inv.edits_spec() {
        return passthrough(rest, &inv);
    }
    let id = inv
        .container_id
        .as_ref()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    match create(&inv, &id) {
        Ok(runtime) => {
            let err = crate::lowlevel::exec(&runtime, rest);
            fail(&inv, &id, &anyhow::Error::new(err))
        }
        Err(e) => fail(&inv, &id, &e),
    }
}

fn fail(inv: &args::Invocation, id: &str, e: &anyhow::Error) -> i32 {
    let msg = format!("gpushare: {e:#}");
    tracing::error!(container_id = %id, "{msg}");
    if let Some(log) = &inv.log {
        runclog::error(log, inv.log_json, &msg);
    }
    1
}

/// The low-level runtime from the one config key a passthrough reads.
fn configured_runtime() -> anyhow::Result<PathBuf> {
    Ok(crate::lowlevel::resolve(
        &crate::config::low_level_runtime()?,
    )?)
}

/// Any command but create/run: resolve the runtime and exec it, nothing else.
fn passthrough(rest: &[OsString], inv: &args::Invocation) -> i32 {
    let err: anyhow::Error = match configured_runtime() {
        Ok(runtime) => crate::lowlevel::exec(&runtime, rest).into(),
        Err(e) => e,
    };
    // Not a create: stderr is runc's own channel for these commands.
    eprintln!("gpushare: {err:#}");
    if let Some(log) = &inv.log {
        runclog::error(log, inv.log_json, &format!("gpushare: {err:#}"));
    }
    1
}

/// The create path: returns the low-level runtime to exec once the spec is ready.
///
/// A config.json whose bytes cannot hold a request (`RawSpec::may_request`, and with
/// `default-device` set `RawSpec::may_hold_allocation`) is exec'd as a passthrough is:
/// only the fast-path keys read, no log opened, nothing parsed. Without `default-device`
/// that is exactly the work it always was (one scan, one config read). A pod's sandbox is
/// exec'd the same way once parsed. Any other one — and one that cannot be read or
/// parsed, so that the error is logged — takes the full path.
fn create(inv: &args::Invocation, id: &str) -> anyhow::Result<PathBuf> {
    let raw = SpecFile::read(&inv.spec_path());
    if let Ok(r) = &raw {
        if !r.may_request() {
            let fast = crate::config::fast_path()?;
            if !(fast.default_device && r.may_hold_allocation()) {
                return Ok(crate::lowlevel::resolve(&fast.low_level_runtime)?);
            }
        }
    }
    let spec = raw.and_then(|r| SpecFile::from_raw(&r));
    if matches!(&spec, Ok(s) if crate::engine::sandbox_marker(|k| s.annotation(k)).is_some()) {
        return configured_runtime();
    }
    let cfg = crate::config::load()?;
    crate::logging::init(&cfg);
    let span = tracing::info_span!("create", container_id = %id);
    let _enter = span.enter();
    let runtime = crate::lowlevel::resolve(&cfg.low_level_runtime)?;
    let served = prepare(&cfg, spec?, &runtime, Some(id).filter(|s| !s.is_empty()))?;
    if let Some(missing) = served
        .then(|| crate::lowlevel::missing_nvidia(&cfg.low_level_runtime, &runtime))
        .flatten()
    {
        tracing::warn!(
            "low-level-runtime: {missing} is not found, so {} runs this container: it gets the MPS pipe directory but no GPU device nodes or driver libraries from NVIDIA's toolkit (name the toolkit's runtime by its absolute path, e.g. /usr/local/nvidia/toolkit/nvidia-container-runtime under the GPU Operator)",
            runtime.display()
        );
    }
    Ok(runtime)
}

/// Reads the request from the spec and, if there is one, edits and saves the spec.
/// Returns whether the spec was edited.
pub(crate) fn prepare(
    cfg: &Config,
    mut spec: SpecFile,
    runtime: &Path,
    container_id: Option<&str>,
) -> anyhow::Result<bool> {
    let bundle = spec.path().parent().map(Path::to_owned);
    let Some(served) = decision::resolve_spec(cfg, &spec, |req| decide_ipc(cfg, &spec, req))?
    else {
        tracing::debug!("no gpushare request: passing through");
        return Ok(false);
    };
    let ident = &served.identity;
    let id = ident.id();
    tracing::debug!(daemon = %id, "request resolved");

    check_pipe_mount_point(cfg, &spec)?;
    let container_id = container_id
        .filter(|c| valid_container_id(c))
        .ok_or_else(|| {
            anyhow::anyhow!(
            "container id {:?} is invalid: allowed is letters, digits and _ + - . (runc's rule)",
            container_id.unwrap_or_default().chars().take(64).collect::<String>()
        )
        })?;

    // Everything below acts on the host: the request is fully validated by now.
    let state = StateDir::new(&cfg.state_dir);
    // The pending record comes before the directory check: an idle daemon being removed
    // either sees it and stays, or is gone before the check (StateDir::remove_if_unused).
    // It names this process: a shim killed before runc create returns leaves a record
    // that is stale at once (ContainerRecord::live).
    let pending = ContainerRecord {
        mps_namespace: served.namespace(container_id),
        ..ContainerRecord::pending(container_id.to_owned(), bundle)
    };
    // A v3 create records the container in `ensure_namespace`, under the identity's lock.
    let recorded = !ident.v3 && state.add_container(&id, &pending).is_ok();
    if ident.v3 {
        // runc binds the namespace's directory, which MPS makes when the namespace is
        // made: so the daemon is ensured (which records the container under the
        // identity's lock, as an idle removal takes it) and the namespace made and capped
        // here, before runc runs, not by the createRuntime hook (docs/mps.md, "Two
        // backends").
        let ensured =
            crate::mps::ensure::ensure_namespace(cfg, &state, ident, &pending, gpushare_binary)?;
        tracing::debug!(daemon = %id, started = ensured.started, "v3 namespace made");
    } else if !state.skeleton_ready(&id, !ident.ipc_host) {
        // runc binds the daemon's directories before the createRuntime hook runs, so they
        // must exist now. Cold path only: the warm path is a few stat calls, no lock. A
        // new daemon is counted against the daemon caps here, before anything is made.
        let deadline = std::time::Instant::now() + cfg.mps.start_timeout;
        let _lock = state.lock(&id, deadline)?;
        tracing::debug!(daemon = %id, "identity lock taken");
        let new = state.ensure_skeleton(
            &id,
            crate::mps::ensure::owner(ident),
            &crate::mps::ensure::budget(cfg),
        )?;
        tracing::debug!(daemon = %id, "daemon directories made");
        if !recorded {
            state.add_container(&id, &pending)?;
        }
        if new {
            // If runc fails before the hook (a mount it cannot make in this image), the
            // reaper removes the directories this create made once runc has exited.
            crate::mps::ensure::start_reaper(gpushare_binary, cfg, &id);
        }
    }

    let plan = decide(cfg, &state, &served, &id, container_id, runtime)?;
    edits::apply_all(&mut spec.doc, &edits::plan(plan))?;
    spec.save()?;
    tracing::info!(
        daemon = %id,
        uid = served.host_user.0,
        devices = %served.devices.uuids.join(","),
        ipc = %served.ipc,
        "spec edited for MPS"
    );
    Ok(true)
}

/// Refuses an image that runc could not mount the pipe directory into
/// (`mps.container-pipe-dir`), before anything is made for the container.
fn check_pipe_mount_point(cfg: &Config, spec: &SpecFile) -> anyhow::Result<()> {
    let Some(root) = spec.typed.root.as_ref().map(|r| r.path()) else {
        return Ok(());
    };
    let rootfs = match spec.path().parent() {
        Some(bundle) if root.is_relative() => bundle.join(root),
        _ => root.clone(),
    };
    let maker = match spec.user_maps()? {
        None => Maker::HostRoot,
        Some(maps) => Maker::UserNs(crate::userns::to_host(&maps.uids, 0)),
    };
    let target = &cfg.mps.container_pipe_dir;
    if let Some(problem) = crate::rootfs::mount_point_problem(&rootfs, target, maker) {
        anyhow::bail!(
            "the MPS pipe directory cannot be mounted at {} (mps.container-pipe-dir): {problem}; allowed is an image where that path is a directory or can be made, or another mps.container-pipe-dir in {}",
            target.display(),
            cfg.path
                .as_deref()
                .unwrap_or(Path::new(crate::config::DEFAULT_PATH))
                .display()
        );
    }
    Ok(())
}

/// The IPC mode for a request: the node's `ipc`, or the request's where
/// `allow-ipc-override` allows it — but never the host's for a container whose pod has an
/// IPC namespace of its own ([`pod_ipc_namespace`]): a pod gets the host's IPC only by
/// `hostIPC`, which admission (Pod Security) sees, never by an annotation it does not.
fn decide_ipc(cfg: &Config, spec: &SpecFile, req: &Request) -> anyhow::Result<IpcMode> {
    let configured = cfg.mps.ipc_mode();
    let ipc = match &req.ipc {
        Some(asked) if asked.value != configured && !cfg.mps.allow_ipc_override => {
            anyhow::bail!(
                "{}={:?} is refused: this node's gpushare config sets ipc = {:?} and allow-ipc-override = false; allowed is {:?} or leaving {} unset",
                asked.key, asked.raw, configured.to_string(), configured.to_string(), asked.key
            )
        }
        Some(asked) => asked.value,
        None => configured,
    };
    if ipc == IpcMode::Host {
        if let Some(why) = pod_ipc_namespace(spec) {
            let asker = match &req.ipc {
                Some(asked) => format!("{}={:?}", asked.key, asked.raw),
                None => "this node's gpushare config ipc = \"host\"".to_owned(),
            };
            anyhow::bail!(
                "{asker} is refused: the container's pod has an IPC namespace of its own ({why}), and gpushare never gives a pod the host's; allowed is isolated, or hostIPC: true on the pod (which admission sees) and then nothing from gpushare"
            );
        }
    }
    Ok(ipc)
}

/// Why the container's IPC namespace is its pod's, if it is: joined by path (containerd's
/// CRI and Podman pods give every container the sandbox's namespace that way, Docker's
/// `--ipc=container:`) unless that namespace is the one this process runs in, the host's
/// (containerd gives a `hostIPC` pod's containers the sandbox's namespace by path, and the
/// sandbox has the host's); or a new `ipc` entry in a CRI container. Docker's and ctr's
/// containers have a new one and no CRI marker. A path that cannot be looked at counts as
/// the pod's own.
fn pod_ipc_namespace(spec: &SpecFile) -> Option<String> {
    let ns = spec
        .typed
        .linux
        .as_ref()?
        .namespaces
        .as_deref()?
        .iter()
        .find(|n| n.typ() == oci_spec::runtime::LinuxNamespaceType::Ipc)?;
    if let Some(path) = ns.path() {
        let id = |p: &Path| {
            use std::os::unix::fs::MetadataExt;
            std::fs::metadata(p).ok().map(|m| (m.dev(), m.ino()))
        };
        let joined = id(path);
        if joined.is_some() && joined == id(Path::new("/proc/self/ns/ipc")) {
            return None;
        }
        return Some(format!(
            "linux.namespaces joins {}",
            crate::device::quote(&path.display().to_string())
        ));
    }
    crate::engine::pod_container_marker(|k| spec.annotation(k))
        .map(|key| format!("a CRI container ({key}) with an ipc namespace"))
}

/// The spec edits for a request the pipeline served (docs/design.md, "Spec edits"). `id`
/// is the served identity's daemon id, which the caller has already computed (a SHA-256
/// per call).
fn decide(
    cfg: &Config,
    state: &StateDir,
    served: &Resolved,
    id: &str,
    container_id: &str,
    runtime: &Path,
) -> anyhow::Result<edits::ContainerPlan> {
    let namespace = served.namespace(container_id);
    let mounts = MountPlan::new(state, id, Inside::configured(cfg), served.ipc).in_namespace(
        state,
        id,
        namespace.as_ref(),
    );
    Ok(edits::ContainerPlan {
        env: crate::served::client_env(cfg, served, crate::lowlevel::is_nvidia(runtime)),
        mounts: mounts.spec_edits(),
        hooks: hooks(cfg)?,
        annotations: decision::Decision {
            identity: served.identity.clone(),
            host_user: served.host_user,
            namespace,
        }
        .to_annotations()?,
    })
}

/// `gpushare` beside this binary: the hooks' and the reaper's program.
fn gpushare_binary() -> anyhow::Result<PathBuf> {
    Ok(std::env::current_exe()
        .context("find gpushare-runtime's own path")?
        .with_file_name("gpushare"))
}

fn hooks(cfg: &Config) -> anyhow::Result<SetHooks> {
    let binary = gpushare_binary()?;
    let env = crate::served::hook_env(cfg.path.as_deref());
    let create_timeout = cfg.mps.start_timeout.as_secs() + 5;
    Ok(SetHooks {
        binary,
        env,
        stages: vec![
            ("createRuntime", "create-runtime", create_timeout),
            ("poststop", "poststop", POSTSTOP_TIMEOUT),
        ],
    })
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use crate::request;

    use serde_json::{json, Value};

    use super::*;

    fn fixture(name: &str) -> Value {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures")
            .join(name);
        serde_json::from_slice(&std::fs::read(path).expect("fixture")).expect("fixture json")
    }

    fn spec(v: &Value) -> SpecFile {
        SpecFile::from_bytes(
            Path::new("config.json"),
            &serde_json::to_vec(v).expect("json"),
        )
        .expect("spec")
    }

    /// `v` as a CRI container of containerd: its marker, and the sandbox's ipc namespace
    /// joined by path when `joined` (a pod without hostIPC; a pid above any pid_max, so
    /// that no process on the test machine has it), none at all when `ipc` is false.
    fn cri_container(mut v: Value, ipc: bool, joined: bool) -> Value {
        v["annotations"] = json!({"io.kubernetes.cri.container-type": "container"});
        let ns = v["linux"]["namespaces"].as_array_mut().expect("namespaces");
        ns.retain(|n| n["type"] != "ipc");
        if ipc {
            ns.push(if joined {
                json!({"type": "ipc", "path": "/proc/4194305/ns/ipc"})
            } else {
                json!({"type": "ipc"})
            });
        }
        v
    }

    #[test]
    fn a_pods_own_ipc_namespace_never_becomes_the_hosts() {
        let request = |ipc: Option<IpcMode>| Request {
            device: request::Sourced {
                value: request::DeviceValue::Named(request::parse_device("d", "0").expect("0")),
                key: "gpushare.io/device",
                raw: "0".into(),
            },
            settings: Default::default(),
            ipc: ipc.map(|value| request::Sourced {
                value,
                key: "gpushare.io/ipc",
                raw: value.to_string(),
            }),
        };
        let node = |text: &str| crate::config::parse(text, None).expect("config");
        let overridable = node("[mps]\nallow-ipc-override = true\n");
        let host_node = node("[mps]\nipc = \"host\"\n");
        let containerd = fixture("containerd-1.6-config.json");

        // Pods without hostIPC: the sandbox's namespace by path, or a CRI container with an
        // ipc entry; the request and the node's default are both refused, in one line.
        let joined = cri_container(containerd.clone(), true, true);
        let mut podman_pod = fixture("podman-4.3-config.json");
        for n in podman_pod["linux"]["namespaces"]
            .as_array_mut()
            .expect("ns")
        {
            if n["type"] == "ipc" {
                n["path"] = json!("/proc/4194306/ns/ipc");
            }
        }
        let cases = [
            (&joined, "linux.namespaces joins \"/proc/4194305/ns/ipc\""),
            (
                &podman_pod,
                "linux.namespaces joins \"/proc/4194306/ns/ipc\"",
            ),
            (
                &cri_container(containerd.clone(), true, false),
                "a CRI container (io.kubernetes.cri.container-type) with an ipc namespace",
            ),
        ];
        for (v, why) in cases {
            let s = spec(v);
            let err = decide_ipc(&overridable, &s, &request(Some(IpcMode::Host)))
                .expect_err("refused")
                .to_string();
            assert_eq!(err, format!("gpushare.io/ipc=\"host\" is refused: the container's pod has an IPC namespace of its own ({why}), and gpushare never gives a pod the host's; allowed is isolated, or hostIPC: true on the pod (which admission sees) and then nothing from gpushare"));
            let err = decide_ipc(&host_node, &s, &request(None))
                .expect_err("refused")
                .to_string();
            assert!(err.starts_with("this node's gpushare config ipc = \"host\" is refused: the container's pod has an IPC namespace of its own"), "{err}");
            // Isolated is what they get otherwise.
            assert_eq!(
                decide_ipc(&overridable, &s, &request(None)).expect("isolated"),
                IpcMode::Isolated
            );
        }

        // A hostIPC pod's container (no ipc entry, or the host's namespace by path as
        // containerd gives it), and Docker's, ctr's and Podman's own new namespaces: the
        // override stands where the node allows it.
        let mut host_by_path = cri_container(containerd.clone(), true, true);
        for n in host_by_path["linux"]["namespaces"]
            .as_array_mut()
            .expect("ns")
        {
            if n["type"] == "ipc" {
                n["path"] = json!("/proc/self/ns/ipc");
            }
        }
        for v in [
            host_by_path,
            cri_container(containerd.clone(), false, false),
            containerd,
            fixture("docker-20.10-config.json"),
            fixture("docker-20.10-ipc-host-config.json"),
            fixture("podman-4.3-config.json"),
        ] {
            let s = spec(&v);
            assert_eq!(
                decide_ipc(&overridable, &s, &request(Some(IpcMode::Host))).expect("host"),
                IpcMode::Host
            );
            assert_eq!(
                decide_ipc(&host_node, &s, &request(None)).expect("host"),
                IpcMode::Host
            );
        }
    }
}
