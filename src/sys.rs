//! The one module with `unsafe`: code that must run in a forked child before exec (the
//! daemon's confinement and credential drop), `mount_setattr` (which neither std, nix nor
//! rustix wraps yet; `open_tree` and `move_mount` are rustix's), and the two NVML calls
//! nvml-wrapper does not wrap (a MIG device's instance ids).
//!
//! `confine_child` runs between fork and exec of a child of a (single-threaded) supervisor,
//! where only async-signal-safe calls are allowed: plain syscalls, no allocation, no locks.

use std::ffi::{CStr, CString};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;

use nix::sys::signal::Signal;

// linux/mount.h, stable since Linux 5.12 (mount_setattr).
pub(crate) const MOUNT_ATTR_RDONLY: u64 = 0x0000_0001;
pub(crate) const MOUNT_ATTR_NOSUID: u64 = 0x0000_0002;
pub(crate) const MOUNT_ATTR_NODEV: u64 = 0x0000_0004;
pub(crate) const MOUNT_ATTR_NOEXEC: u64 = 0x0000_0008;
const AT_RECURSIVE: u32 = 0x8000;

/// `struct mount_attr` (linux/mount.h, MOUNT_ATTR_SIZE_VER0).
#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

/// The raw call, allocation-free so that a forked child may make it before exec.
fn mount_setattr(dirfd: i32, path: &CStr, flags: u32, set: u64, clr: u64) -> nix::Result<()> {
    let attr = MountAttr {
        attr_set: set,
        attr_clr: clr,
        propagation: 0,
        userns_fd: 0,
    };
    // SAFETY: `path` is a valid NUL-terminated string and `attr` a properly laid out
    // `struct mount_attr`; both outlive the call, whose size argument matches `attr`.
    let rc = unsafe {
        nix::libc::syscall(
            nix::libc::SYS_mount_setattr,
            dirfd,
            path.as_ptr(),
            flags,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    if rc < 0 {
        return Err(nix::errno::Errno::last());
    }
    Ok(())
}

/// `mount_setattr(2)`: sets the `set` and clears the `clr` `MOUNT_ATTR_*` flags of the
/// mount (attached or detached) `fd` refers to, or of the whole tree below it with
/// `recursive`. The one call that makes a mount
/// tree read-only, nodev and nosuid at once, including a detached `open_tree` clone
/// before it is attached.
pub(crate) fn set_mount_attr(fd: &OwnedFd, recursive: bool, set: u64, clr: u64) -> nix::Result<()> {
    let mut flags = nix::libc::AT_SYMLINK_NOFOLLOW as u32;
    if recursive {
        flags |= AT_RECURSIVE;
    }
    mount_setattr(
        fd.as_raw_fd(),
        c"",
        flags | nix::libc::AT_EMPTY_PATH as u32,
        set,
        clr,
    )
}

/// The parts of /proc that stay read-only in a confined child although /proc itself is
/// writable: the host-wide ones Docker keeps read-only in every container.
pub(crate) const PROC_READONLY: [&str; 5] = [
    "/proc/sys",
    "/proc/sysrq-trigger",
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
];

/// The mount namespace a per-daemon child runs in (see `confine_child`): the whole host
/// read-only, nosuid and nodev, except what is listed here and /proc (writable but for
/// [`PROC_READONLY`]).
#[derive(Debug, Default)]
pub(crate) struct Confinement {
    /// Directories that stay writable (the daemon's pipe and log directories, /dev/shm).
    pub writable: Vec<CString>,
    /// Device nodes that stay usable (the GPU's, /dev/null and friends).
    pub devices: Vec<CString>,
}

impl Confinement {
    pub(crate) fn writable(&mut self, path: &Path) -> &mut Self {
        if let Ok(c) = CString::new(path.as_os_str().as_bytes()) {
            self.writable.push(c);
        }
        self
    }
    pub(crate) fn device(&mut self, path: &Path) -> &mut Self {
        if let Ok(c) = CString::new(path.as_os_str().as_bytes()) {
            self.devices.push(c);
        }
        self
    }
}

/// Runs `cmd`'s child in a mount namespace of its own where the host is read-only, nosuid
/// and nodev but for `conf`, then drops to `user` (uid, gid; no supplementary groups)
/// when given, then sets the parent-death signal (SIGKILL: a killed supervisor never leaves
/// an orphaned daemon holding the socket) and `no_new_privs` (setuid binaries and file
/// capabilities are inert).
///
/// Everything happens in the child between fork and exec, in this order because each
/// step needs the privileges the next one drops: mounts need CAP_SYS_ADMIN, and a change
/// of credentials clears the parent-death signal (commit_creds), so that comes last.
/// Do not also set `cmd.uid`/`cmd.gid`: std would switch users before these steps run.
pub(crate) fn confine_child(
    cmd: &mut Command,
    conf: Confinement,
    user: Option<(u32, u32)>,
    parent: nix::unistd::Pid,
) {
    use nix::mount::MsFlags;
    // /proc stays writable (the kernel checks each file against the process), but for the
    // host-wide paths Docker also keeps read-only: a root daemon without capabilities may
    // still write /proc/sys and /proc/sysrq-trigger by DAC alone.
    let proc_ro: Vec<CString> = PROC_READONLY
        .iter()
        .filter(|p| Path::new(p).exists())
        .filter_map(|p| CString::new(*p).ok())
        .collect();
    // SAFETY: the closure runs in the forked child of a single-threaded supervisor before
    // exec and only makes plain syscalls on data prepared before the fork (`conf` owns
    // its C strings): unshare, mount, mount_setattr, setgroups, setres[ug]id, prctl,
    // getppid. It allocates nothing except the error for the parent-gone case.
    unsafe {
        cmd.pre_exec(move || {
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS)?;
            // Each exception is bound onto itself, so that it is a mount of its own whose
            // flags can differ from the tree's.
            for p in conf.writable.iter().chain(&conf.devices).chain(&proc_ro) {
                nix::mount::mount(
                    Some(p.as_c_str()),
                    p.as_c_str(),
                    None::<&CStr>,
                    MsFlags::MS_BIND,
                    None::<&CStr>,
                )?;
            }
            let nofollow = nix::libc::AT_SYMLINK_NOFOLLOW as u32;
            mount_setattr(
                nix::libc::AT_FDCWD,
                c"/",
                nofollow | AT_RECURSIVE,
                MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV,
                0,
            )?;
            for p in &conf.writable {
                mount_setattr(nix::libc::AT_FDCWD, p, nofollow, 0, MOUNT_ATTR_RDONLY)?;
            }
            // The real MPS server writes into /proc while the driver initialises: with a
            // read-only /proc it exits with "Driver initialization failed with: OS call
            // failed or operation not supported on this OS" (seen on driver 580.159.04,
            // docs/gpu-validation.md). Only the /proc mount itself: the binds of
            // PROC_READONLY below it keep the tree's read-only flag.
            mount_setattr(
                nix::libc::AT_FDCWD,
                c"/proc",
                nofollow,
                0,
                MOUNT_ATTR_RDONLY,
            )?;
            for p in &conf.devices {
                mount_setattr(nix::libc::AT_FDCWD, p, nofollow, 0, MOUNT_ATTR_NODEV)?;
            }
            if let Some((uid, gid)) = user {
                let (uid, gid) = (
                    nix::unistd::Uid::from_raw(uid),
                    nix::unistd::Gid::from_raw(gid),
                );
                nix::unistd::setgroups(&[])?;
                nix::unistd::setresgid(gid, gid, gid)?;
                nix::unistd::setresuid(uid, uid, uid)?;
            }
            nix::sys::prctl::set_pdeathsig(Signal::SIGKILL)?;
            if nix::unistd::getppid() != parent {
                return Err(std::io::Error::other("parent exited before exec"));
            }
            nix::sys::prctl::set_no_new_privs()?;
            Ok(())
        });
    }
}

/// A MIG device's GPU instance id and compute instance id (`nvmlDeviceGetGpuInstanceId`,
/// `nvmlDeviceGetComputeInstanceId`, which nvml-wrapper 0.13 does not wrap). `mig` must be a
/// MIG device handle; `None` when the driver lacks either call or answers an error.
pub(crate) fn nvml_mig_instance_ids(mig: &nvml_wrapper::Device<'_>) -> Option<(u32, u32)> {
    let lib = mig.nvml().lib();
    let gi_fn = lib.nvmlDeviceGetGpuInstanceId.as_ref().ok()?;
    let ci_fn = lib.nvmlDeviceGetComputeInstanceId.as_ref().ok()?;
    let (mut gi, mut ci) = (0u32, 0u32);
    // SAFETY: the handle comes from a live `Device` borrowed for the whole call (its NVML is
    // initialised for as long as it lives); both symbols were resolved from that library;
    // each writes one `unsigned int` through a pointer to a local that outlives the call.
    let (gi_rc, ci_rc) = unsafe {
        let handle = mig.handle();
        (gi_fn(handle, &mut gi), ci_fn(handle, &mut ci))
    };
    nvml_wrapper::error::nvml_try(gi_rc).ok()?;
    nvml_wrapper::error::nvml_try(ci_rc).ok()?;
    Some((gi, ci))
}

/// The Unix socket at file descriptor `fd` that the process was started with (an NRI
/// runtime hands a plugin it launches its connection that way), as a stream this process
/// owns. Refused unless `fd` is open and a socket, so that no other file is taken over.
pub(crate) fn adopt_unix_stream(fd: i32) -> anyhow::Result<std::os::unix::net::UnixStream> {
    use std::os::fd::{BorrowedFd, FromRawFd};
    // SAFETY: the descriptor is only borrowed for the fstat, which fails cleanly (EBADF)
    // on a closed one; it is owned below only once it is known to be an open socket.
    let st = nix::sys::stat::fstat(unsafe { BorrowedFd::borrow_raw(fd) })
        .map_err(|e| anyhow::anyhow!("file descriptor {fd} (NRI_PLUGIN_SOCKET): {e}"))?;
    if st.st_mode & nix::libc::S_IFMT != nix::libc::S_IFSOCK {
        anyhow::bail!("file descriptor {fd} (NRI_PLUGIN_SOCKET) is not a socket");
    }
    // SAFETY: an open socket that nothing else in this process owns: it was inherited,
    // and this is the one place that takes it.
    Ok(unsafe { std::os::unix::net::UnixStream::from_raw_fd(fd) })
}
