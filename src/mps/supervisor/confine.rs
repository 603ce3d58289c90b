//! The daemon's process: how it is started and what it may touch.
//!
//! Invariants: the daemon starts with an explicit environment (its PATH is the control
//! binary's directory then `SAFE_PATH`, never the caller's), stdin on /dev/null and its
//! output in the root-owned `daemon.out`; it runs as the daemon's UID and gpushare's GID
//! with no supplementary groups and no capabilities (a multi-user daemon runs as root by
//! design), in a mount namespace of its own where the whole host is read-only, nosuid and
//! nodev except its pipe and log directories, its /dev/shm (the daemon's shm tmpfs,
//! unless the identity shares the host's IPC), the GPU's device nodes and /proc (the real
//! MPS server writes there at start; /proc/sys and the other host-wide parts stay
//! read-only, `sys::PROC_READONLY`): a link planted where it writes cannot make it write a
//! host file or open a host device.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use anyhow::Context;

use super::context::Supervisor;
use super::limits::limit_env;
use super::logs::open_daemon_out;
use crate::mps::control::SAFE_PATH;

/// A private mount namespace, slave to the host (host unmounts still reach it, so it
/// pins nothing), where the daemon's shm tmpfs is mounted over /dev/shm.
pub(super) fn private_dev_shm(shm: &Path) -> anyhow::Result<()> {
    use nix::mount::{mount, MsFlags};
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS)
        .context("unshare the mount namespace")?;
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_SLAVE,
        None::<&str>,
    )
    .context("make / a slave mount")?;
    mount(
        Some(shm),
        "/dev/shm",
        None::<&str>,
        MsFlags::MS_BIND,
        None::<&str>,
    )
    .with_context(|| format!("bind {} over /dev/shm", shm.display()))?;
    Ok(())
}

/// Drops the capabilities a child could get. Per-user daemons then run with none — even
/// the daemon of a root container: setuid to a non-root UID clears the effective and
/// permitted sets, but `setuid(0)` clears nothing and exec gives root the bounding set, so
/// the bounding set is emptied too (the supervisor keeps its own effective set for its
/// own work). no_new_privs (sys::confine_child) keeps exec from granting any. Multi-user
/// daemons are root's by design and keep theirs.
pub(super) fn drop_child_caps(multi_user: bool) -> anyhow::Result<()> {
    caps::clear(None, caps::CapSet::Ambient).context("clear ambient capabilities")?;
    caps::clear(None, caps::CapSet::Inheritable).context("clear inheritable capabilities")?;
    if !multi_user {
        caps::clear(None, caps::CapSet::Bounding).context("clear the capability bounding set")?;
    }
    Ok(())
}

/// The device nodes a daemon and its servers may open: the NVIDIA nodes
/// (`/dev/nvidia*`, `/dev/nvidia-caps/*`) and the harmless character devices every
/// process expects. Only character devices that exist are listed.
fn gpu_device_nodes() -> Vec<PathBuf> {
    use std::os::unix::fs::FileTypeExt;
    let is_char =
        |p: &Path| std::fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_char_device());
    let mut nodes: Vec<PathBuf> = ["null", "zero", "full", "random", "urandom"]
        .iter()
        .map(|n| Path::new("/dev").join(n))
        .collect();
    for dir in ["/dev", "/dev/nvidia-caps"] {
        if let Ok(entries) = std::fs::read_dir(dir) {
            nodes.extend(
                entries
                    .flatten()
                    .filter(|e| {
                        dir != "/dev" || e.file_name().to_string_lossy().starts_with("nvidia")
                    })
                    .map(|e| e.path()),
            );
        }
    }
    nodes.retain(|p| is_char(p));
    nodes.sort();
    nodes
}

/// The daemon's PATH: the control binary's own directory first, then [`SAFE_PATH`]. The
/// control daemon starts `nvidia-cuda-mps-server` by name, and drivers install the two side
/// by side, often outside SAFE_PATH (`/usr/local/nvidia/bin` in GPU images, the toolkit's
/// injected binaries); an operator who names the control binary by its absolute path gets
/// the server beside it.
fn daemon_path(binary: &Path) -> String {
    match binary.parent().and_then(Path::to_str) {
        Some(dir)
            if dir.starts_with('/')
                && !dir.contains(':')
                && !SAFE_PATH.split(':').any(|d| d == dir) =>
        {
            format!("{dir}:{SAFE_PATH}")
        }
        _ => SAFE_PATH.to_string(),
    }
}

impl Supervisor {
    /// What stays writable and usable in the daemon's mount namespace: its own pipe and
    /// log directories, its /dev/shm, and the device nodes a CUDA process opens. The rest
    /// of the host is read-only, nosuid and nodev there, so a link planted in a directory
    /// the daemon writes cannot make it write a host file or open a host device.
    fn confinement(&self) -> crate::sys::Confinement {
        let mut conf = crate::sys::Confinement::default();
        conf.writable(&self.state.pipe_dir(&self.id))
            .writable(&self.state.log_dir(&self.id))
            .writable(Path::new("/dev/shm"));
        for dev in gpu_device_nodes() {
            conf.device(&dev);
        }
        conf
    }
    /// With `driver-root`, the daemon's `LD_LIBRARY_PATH`: a directory of links to the
    /// driver libraries under the root, made again before each start (a driver container
    /// upgraded while the daemon ran has other files). Never the root's library
    /// directories themselves, which hold the driver container's own C library too.
    fn driver_libraries(&self) -> anyhow::Result<Option<(&'static str, PathBuf)>> {
        let Some(root) = &self.driver_root else {
            return Ok(None);
        };
        let dir = self.state.driver_lib_dir(&self.id);
        crate::driver::link_server_libraries(root, &dir)?;
        Ok(Some(("LD_LIBRARY_PATH", dir)))
    }
    pub(super) fn spawn_daemon(&self) -> anyhow::Result<Child> {
        let log_dir = self.state.log_dir(&self.id);
        let out = open_daemon_out(&self.state.daemon_dir(&self.id))?;
        let mut cmd = Command::new(&self.binary);
        if self.ident.v3 {
            // Protocol 3, multi-user: one root server for every tenant (docs/mps.md, "Two
            // backends"); the variable, which wins over the option, says the same.
            cmd.args(["-p", "3", "-m", "-f"]);
        } else {
            cmd.arg("-f");
            if self.ident.multi_user {
                cmd.arg(&self.multi_user_flag);
            }
        }
        cmd.env_clear()
            .env("PATH", daemon_path(&self.binary))
            .env("CUDA_MPS_PIPE_DIRECTORY", self.state.pipe_dir(&self.id))
            .env("CUDA_MPS_LOG_DIRECTORY", &log_dir)
            .env("CUDA_VISIBLE_DEVICES", self.ident.devices.join(","))
            .envs(limit_env(&self.ident))
            .envs(self.ident.v3.then_some(("CUDA_MPS_PROTOCOL_VERSION", "3")))
            .envs(self.driver_libraries()?)
            .current_dir("/")
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out);
        // The daemon's group is gpushare's choice (mps.daemon-gid), never the container's,
        // and it has no supplementary groups.
        let user = (!self.ident.multi_user).then_some((self.ident.uid, self.ident.gid));
        crate::sys::confine_child(&mut cmd, self.confinement(), user, nix::unistd::getpid());
        cmd.spawn().with_context(|| {
            format!(
                "start {} as uid {} (the binary must be executable by that uid; the mount namespace it runs in needs Linux 5.12 or later)",
                self.binary.display(),
                self.ident.uid
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn daemon_path_puts_the_control_binarys_directory_first() {
        assert_eq!(
            daemon_path(Path::new("/usr/local/nvidia/bin/nvidia-cuda-mps-control")),
            format!("/usr/local/nvidia/bin:{SAFE_PATH}")
        );
        assert_eq!(
            daemon_path(Path::new("/usr/bin/nvidia-cuda-mps-control")),
            SAFE_PATH
        );
        assert_eq!(
            daemon_path(Path::new("/a:b/nvidia-cuda-mps-control")),
            SAFE_PATH
        );
        assert_eq!(daemon_path(Path::new("nvidia-cuda-mps-control")), SAFE_PATH);
    }
}
