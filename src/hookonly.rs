//! Hook-only mode, for engines with `hooks.d` and no runtime shim (Podman, CRI-O):
//! `gpushare hook prestart`, injected by `hooks/oci-hooks.d/gpushare.json` when a container
//! has a `gpushare.io/device` annotation.
//!
//! Without the shim nothing prepared the spec, so the hook resolves the request itself,
//! ensures the daemon, and bind-mounts the daemon's pipe directory at CUDA's default
//! `/tmp/nvidia-mps` (a hook cannot set env vars) and its shm tmpfs over `/dev/shm` inside
//! the container's mount namespace, before pivot_root. Invariants: the bind sources are
//! cloned in the host's namespace (`open_tree`) and attached by fd (`move_mount`); the
//! targets are opened with `openat2(RESOLVE_IN_ROOT)` under the container's rootfs, so a
//! symlink in the image can never redirect a mount outside it; a container the shim
//! already prepared is left alone — known from its spec's `createRuntime` hooks
//! (`SpecFile::prepared_by_shim`), which a container's author cannot write, never from
//! the decision annotations, which it can — and so is a pod's sandbox, checked first on
//! the state's own annotations (`engine::sandbox_marker`).
//!
//! The clones get their flags (`mount_setattr`) before they are attached, so the container
//! never sees them otherwise, even for an instant: the pipe directory read-only, the shm
//! writable, both nosuid, nodev and noexec, as the shim's mounts are (docs/design.md,
//! "Mounts of the daemon's directories").

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use nix::fcntl::OFlag;
use nix::sys::stat::Mode;

use crate::bundle::SpecFile;
use crate::config::Config;
use crate::hook::State;
use crate::request;
use crate::served::{Inside, MountPlan};
use crate::state::StateDir;

/// `prestart` in hook-only mode: `cdi` is the request of the CDI hook
/// (`--cdi-device`), `None` for the hooks.d hook. Returns without doing anything for a
/// pod's sandbox (known from the state's annotations, before config.json is read), for
/// containers without a request, for those already prepared by gpushare-runtime, and, as
/// the hooks.d hook, for those whose spec carries gpushare's CDI hook, which serves them.
pub(crate) fn prestart(
    cfg: &Config,
    state: &State,
    cdi: Option<&crate::request::CdiAsk>,
) -> anyhow::Result<()> {
    if let Some((key, value)) =
        crate::engine::sandbox_marker(|k| state.annotations.get(k).map(String::as_str))
    {
        tracing::debug!(
            "{key}={}: a pod's sandbox is never a request",
            crate::util::escape(value)
        );
        return Ok(());
    }
    let bundle = state
        .bundle
        .as_ref()
        .filter(|b| b.is_absolute())
        .context("the container state names no absolute bundle path")?;
    let spec = SpecFile::load(&bundle.join("config.json"))?;
    // Decided by the spec's hooks, never by annotations: a container's author can write
    // `gpushare.io/daemon` (the decision annotation the shim writes) but not a hook.
    if spec.prepared_by_shim() {
        tracing::debug!("prepared by gpushare-runtime: nothing to do in hook-only mode");
        return Ok(());
    }
    // One hook serves a container: the CDI hook when the spec carries one (the engine put
    // it there from the node's CDI spec), the hooks.d hook otherwise. Both read the same
    // spec, so they agree on which one acts, whatever order they run in.
    match (spec.cdi_ask()?, cdi) {
        (Some(_), None) => {
            tracing::debug!("the spec carries gpushare's CDI hook, which serves it");
            return Ok(());
        }
        (Some(found), Some(mine)) if found != *mine => bail!(
            "the CDI hook's arguments ask for {}={} but the spec's CDI hook for {}: allowed is the hook as the engine copied it from the CDI spec",
            crate::request::CDI_KIND,
            mine.name(),
            found.name()
        ),
        (None, Some(mine)) => bail!(
            "the CDI hook for {}={} is not in the container's spec: allowed is the hook as the engine copied it from the CDI spec",
            crate::request::CDI_KIND,
            mine.name()
        ),
        _ => {}
    }
    let (ipc, honour_ipc) = crate::served::engine_ipc(
        &spec,
        "hook-only mode",
        "to ask the engine (e.g. podman --ipc=host) instead",
    );
    let Some(served) = crate::decision::resolve_spec(cfg, &spec, honour_ipc)? else {
        return Ok(());
    };
    refuse_unhonoured(cfg, &served.request)?;
    let ident = served.identity.clone();
    let pid = state.pid.context("the container state has no pid")?;
    crate::hook::check_daemon_user(&ident, pid)?;
    let dirs = StateDir::new(&cfg.state_dir);
    // The pid and the bundle checked above are the state's own, which the record names.
    let namespace = served.namespace(&state.id);
    let record = crate::state::ContainerRecord {
        mps_namespace: namespace.clone(),
        ..state.container_record()
    };
    let ensured = match &namespace {
        // v3: the namespace made and capped, and the cgroup's memory limit set, before
        // the container's first process, which runs after this hook.
        Some(ns) => {
            let ensured =
                crate::mps::ensure::ensure_namespace(cfg, &dirs, &ident, &record, || {
                    std::env::current_exe().context("find the gpushare binary")
                })?;
            crate::mps::v3::limit_memory(cfg, pid, &ident.devices, ns)?;
            ensured
        }
        None => crate::mps::ensure::ensure(cfg, &dirs, &ident, Some(&record))?,
    };
    let id = ensured.record.id;
    let root = spec
        .typed
        .root
        .as_ref()
        .map(|r| r.path().clone())
        .context("config.json has no root")?;
    let rootfs = if root.is_absolute() {
        root
    } else {
        bundle.join(root)
    };
    // The pipe directory where CUDA looks by default: a hook cannot set the environment.
    // Host IPC is the engine's own here: nothing to add for it.
    let plan = MountPlan::new(&dirs, &id, Inside::cuda_default(), ipc).in_namespace(
        &dirs,
        &id,
        namespace.as_ref(),
    );
    mount_into(pid, &rootfs, &binds(&plan))?;
    tracing::info!(daemon = %id, uid = ident.uid, "hook-only: daemon ensured and mounted into the container");
    Ok(())
}

/// Refuses a request key that hook-only mode cannot honour (the row's `hook_only`): a
/// hook cannot set the container's environment, so a key that only a client variable
/// carries would be dropped. One line names the key, why, and the shim as what to use.
fn refuse_unhonoured(cfg: &Config, req: &request::Request) -> anyhow::Result<()> {
    use request::keys::HookOnly;
    let enforced = cfg.mps.limits == crate::config::Limits::Enforced;
    for (key, asked) in req.settings.iter() {
        let why = match key.hook_only {
            HookOnly::Honoured => continue,
            HookOnly::WhenEnforced if enforced => continue,
            HookOnly::WhenEnforced => "under limits = \"advisory\" only",
            HookOnly::Refused => "only",
        };
        let var = key.client_env.map_or("a client variable", |c| c.var);
        bail!(
            "{}={} cannot be honoured in hook-only mode: {why} the client variable {var} carries it, and a hook cannot set the container's environment; allowed is gpushare-runtime (the shim: docker --runtime gpushare, RuntimeClass gpushare), which sets it, or no {} here",
            asked.key,
            crate::device::quote(&asked.raw),
            key.annotation
        );
    }
    Ok(())
}

fn open_dir(root: &OwnedFd, rel: &str) -> nix::Result<OwnedFd> {
    crate::rootfs::open_in_root(root, rel, OFlag::O_DIRECTORY)
}

/// Opens `rel` (a directory under the container's root), creating its last component
/// if missing; every component is resolved inside the root.
fn target_dir(root: &OwnedFd, rel: &str) -> anyhow::Result<OwnedFd> {
    match open_dir(root, rel) {
        Ok(fd) => return Ok(fd),
        Err(nix::errno::Errno::ENOENT) => {}
        Err(e) => return Err(e).with_context(|| format!("open /{rel} in the container")),
    }
    let (parent, name) = rel.rsplit_once('/').unwrap_or(("", rel));
    let parent_fd = open_dir(root, if parent.is_empty() { "." } else { parent })
        .with_context(|| format!("open /{parent} in the container"))?;
    match nix::sys::stat::mkdirat(&parent_fd, name, Mode::from_bits_truncate(0o755)) {
        Ok(()) | Err(nix::errno::Errno::EEXIST) => {}
        Err(e) => return Err(e).with_context(|| format!("create /{rel} in the container")),
    }
    open_dir(root, rel).with_context(|| format!("open /{rel} in the container"))
}

/// One host directory to bind into the container.
pub(crate) struct Bind {
    pub(crate) source: PathBuf,
    /// Relative to the container's root.
    pub(crate) target: String,
    /// The `MOUNT_ATTR_*` flags the clone gets before it is attached.
    pub(crate) attrs: u64,
}

/// A container's mount plan as binds a hook makes: each at its destination under the
/// container's root, with the flags its options name.
pub(crate) fn binds(plan: &MountPlan) -> Vec<Bind> {
    use crate::sys::{MOUNT_ATTR_NODEV, MOUNT_ATTR_NOEXEC, MOUNT_ATTR_NOSUID, MOUNT_ATTR_RDONLY};
    let flags = [
        ("ro", MOUNT_ATTR_RDONLY),
        ("nosuid", MOUNT_ATTR_NOSUID),
        ("nodev", MOUNT_ATTR_NODEV),
        ("noexec", MOUNT_ATTR_NOEXEC),
    ];
    plan.binds
        .iter()
        .map(|b| Bind {
            source: b.source.clone(),
            target: b
                .destination
                .to_string_lossy()
                .trim_start_matches('/')
                .to_owned(),
            attrs: flags
                .iter()
                .filter(|(option, _)| b.has(option))
                .fold(0, |attrs, (_, flag)| attrs | flag),
        })
        .collect()
}

/// Binds host directories into the mount namespace of process `pid` under `rootfs`
/// (before pivot_root, the container's root is its rootfs path in its own namespace).
/// Every bind gets its flags (the plan's: nosuid, nodev and noexec, and read-only where
/// it says so) before it is attached.
fn mount_into(pid: i32, rootfs: &Path, binds: &[Bind]) -> anyhow::Result<()> {
    use rustix::fs::CWD;
    use rustix::mount::{self, MoveMountFlags, OpenTreeFlags};
    use std::os::fd::AsFd;
    // Clone the sources while we still see the host's paths.
    let trees = binds
        .iter()
        .map(|b| {
            // A detached copy of the mount tree (a bind mount attached nowhere yet), which
            // move_mount can attach in another mount namespace: the only way to bind a
            // host directory into a namespace that cannot see the host's paths.
            let tree = mount::open_tree(
                CWD,
                &b.source,
                OpenTreeFlags::OPEN_TREE_CLONE | OpenTreeFlags::OPEN_TREE_CLOEXEC,
            )
            .with_context(|| format!("clone the mount of {}", b.source.display()))?;
            crate::sys::set_mount_attr(&tree, true, b.attrs, 0).with_context(|| {
                let read_only = b.attrs & crate::sys::MOUNT_ATTR_RDONLY != 0;
                format!(
                    "make the clone of {} {}nosuid, nodev and noexec",
                    b.source.display(),
                    if read_only { "read-only, " } else { "" }
                )
            })?;
            Ok(tree)
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let ns = std::fs::File::open(format!("/proc/{pid}/ns/mnt"))
        .with_context(|| format!("open the mount namespace of container process {pid}"))?;
    nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNS)
        .context("enter the container's mount namespace")?;
    let root = nix::fcntl::open(
        rootfs,
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .with_context(|| format!("open the container's rootfs {}", rootfs.display()))?;
    for (b, tree) in binds.iter().zip(&trees) {
        let target = target_dir(&root, &b.target)?;
        // Both ends by fd: no path is resolved again after the target was checked.
        mount::move_mount(
            tree.as_fd(),
            c"",
            target.as_fd(),
            c"",
            MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH | MoveMountFlags::MOVE_MOUNT_T_EMPTY_PATH,
        )
        .with_context(|| {
            format!(
                "mount {} at /{} in the container",
                b.source.display(),
                b.target
            )
        })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open_root(rootfs: &Path) -> OwnedFd {
        nix::fcntl::open(
            rootfs,
            OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .unwrap()
    }

    /// Where an fd of this process points.
    fn path_of(fd: &OwnedFd) -> PathBuf {
        use std::os::fd::AsRawFd;
        std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())).unwrap()
    }

    #[test]
    fn a_symlink_in_the_image_cannot_move_a_bind_target_out_of_the_rootfs() {
        // The pipe directory's place, as `binds` opens it: relative to the rootfs.
        const PIPE_IN_CONTAINER: &str = "tmp/nvidia-mps";
        assert_eq!(
            crate::served::mounts::CUDA_DEFAULT_PIPE_DIR.trim_start_matches('/'),
            PIPE_IN_CONTAINER
        );
        let dir = tempfile::tempdir().unwrap();
        let host = dir.path().canonicalize().unwrap();
        let rootfs = host.join("rootfs");
        std::fs::create_dir(&rootfs).unwrap();
        // An image whose /tmp is a plain directory: the target is made under it.
        std::fs::create_dir(rootfs.join("tmp")).unwrap();
        let fd = target_dir(&open_root(&rootfs), PIPE_IN_CONTAINER).unwrap();
        assert_eq!(path_of(&fd), rootfs.join(PIPE_IN_CONTAINER));

        // /tmp a link that climbs out (to the temp directory, were it followed as the
        // host sees it): it stops at the rootfs, as in the container.
        std::fs::remove_dir_all(rootfs.join("tmp")).unwrap();
        // (relative to the link's directory, the rootfs).
        std::os::unix::fs::symlink("..", rootfs.join("tmp")).unwrap();
        let fd = target_dir(&open_root(&rootfs), PIPE_IN_CONTAINER).unwrap();
        assert_eq!(path_of(&fd), rootfs.join("nvidia-mps"));
        assert!(!host.join("nvidia-mps").exists());

        // /tmp a link to a host directory by its absolute path: read as a path in the
        // image, where it does not exist (or loops back through the link, the temp
        // directory being under /tmp); refused, nothing made on the host.
        let outside = host.join("outside");
        std::fs::create_dir(&outside).unwrap();
        std::fs::remove_file(rootfs.join("tmp")).unwrap();
        std::os::unix::fs::symlink(&outside, rootfs.join("tmp")).unwrap();
        let err = target_dir(&open_root(&rootfs), PIPE_IN_CONTAINER).unwrap_err();
        assert!(err.to_string().starts_with("open /tmp"), "{err:#}");
        assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 0);
    }
}
