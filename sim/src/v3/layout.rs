//! The v3 pipe layout, after NVIDIA's MPS v3 "Namespaces" page: `<pipe>/control` (the main
//! socket), `<pipe>/<server>/control` (the server's default namespace),
//! `<pipe>/<server>/default/control` and `<pipe>/<server>/<ns>/control`; making and removing
//! those directories and binding their sockets.
//!
//! Invariants:
//! - every socket path is checked against `sun_path` before anything is made for it; one that
//!   does not fit fails with the bare [`BARE_FAILURE`] line, as measured on r615 by NVIDIA's
//!   KAI GPU-fractioning agent for the daemon (for a namespace or server socket NVIDIA's docs
//!   say nothing: the same bare line is the simulator's choice);
//! - an existing directory is reused, never replaced: a bind mount of `<pipe>/<s>/<ns>` in a
//!   running container holds that inode, and sees the socket a restarted daemon binds in it
//!   (NVIDIA's KAI agent recreates namespaces at the same names after every restart);
//! - only a socket is replaced (a dead daemon's: the caller holds the daemon lock); a symlink
//!   or any other file where a directory or socket belongs is refused.

use std::fs::DirBuilder;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, PermissionsExt};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};

use thiserror::Error;

/// `sun_path` is 108 bytes including the terminating NUL.
pub const SUN_PATH_MAX: usize = 107;
/// What the daemon prints, and all it prints, when a socket path does not fit.
pub const BARE_FAILURE: &str = "Failed to initialize MPS control daemon";
/// The namespace every server has, which `server set` configures.
pub const DEFAULT_NAMESPACE: &str = "default";

#[derive(Debug, Error)]
pub enum LayoutError {
    #[error("{BARE_FAILURE}")]
    TooLong { path: PathBuf },
    #[error("{path} exists and is not a directory; not replacing it")]
    NotDirectory { path: PathBuf },
    #[error("{path} exists and is not a socket; not replacing it")]
    NotSocket { path: PathBuf },
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> LayoutError {
    let path = path.to_path_buf();
    move |source| LayoutError::Io { what, path, source }
}

pub fn server_dir(pipe: &Path, server: &str) -> PathBuf {
    pipe.join(server)
}

pub fn namespace_dir(pipe: &Path, server: &str, ns: &str) -> PathBuf {
    pipe.join(server).join(ns)
}

pub fn socket_in(dir: &Path) -> PathBuf {
    dir.join("control")
}

pub fn check_fits(socket: &Path) -> Result<(), LayoutError> {
    if socket.as_os_str().len() > SUN_PATH_MAX {
        return Err(LayoutError::TooLong {
            path: socket.to_path_buf(),
        });
    }
    Ok(())
}

/// Makes `dir` (mode 0755, its parent must exist) or reuses the directory already there.
pub fn ensure_dir(dir: &Path) -> Result<(), LayoutError> {
    match std::fs::symlink_metadata(dir) {
        Ok(meta) if meta.is_dir() => return Ok(()),
        Ok(_) => {
            return Err(LayoutError::NotDirectory {
                path: dir.to_path_buf(),
            })
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io("inspect", dir)(e)),
    }
    DirBuilder::new()
        .mode(0o755)
        .create(dir)
        .map_err(io("create directory", dir))?;
    // Clients of every uid reach their leaf; the umask must not take that away.
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))
        .map_err(io("chmod 0755", dir))
}

/// Binds `<dir>/control`, mode 0666, in a directory made or reused by [`ensure_dir`].
pub fn bind_in(dir: &Path) -> Result<UnixListener, LayoutError> {
    let socket = socket_in(dir);
    check_fits(&socket)?;
    ensure_dir(dir)?;
    match std::fs::symlink_metadata(&socket) {
        Ok(meta) if meta.file_type().is_socket() => {
            std::fs::remove_file(&socket).map_err(io("remove stale socket", &socket))?
        }
        Ok(_) => return Err(LayoutError::NotSocket { path: socket }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io("inspect", &socket)(e)),
    }
    let listener = UnixListener::bind(&socket).map_err(io("listen on", &socket))?;
    std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o666))
        .map_err(io("chmod 0666", &socket))?;
    Ok(listener)
}

/// Removes a namespace's or server's directory once its socket is gone; a directory that
/// cannot go (a mount point, or not empty) stays, and the next create reuses it.
pub fn remove_dir(dir: &Path) -> Result<(), LayoutError> {
    match std::fs::remove_dir(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io("remove directory", dir)(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn a_rebind_keeps_the_directory_inode_and_replaces_the_socket() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = namespace_dir(tmp.path(), "s", "a");
        ensure_dir(&tmp.path().join("s")).unwrap();
        let first = bind_in(&dir).unwrap();
        let inode = std::fs::metadata(&dir).unwrap().ino();
        drop(first);
        // The listener is gone, its socket file stays: a stale socket, replaced.
        let _second = bind_in(&dir).unwrap();
        assert_eq!(std::fs::metadata(&dir).unwrap().ino(), inode);
        assert!(std::os::unix::net::UnixStream::connect(socket_in(&dir)).is_ok());
    }

    #[test]
    fn refuses_what_is_not_a_directory_or_socket_and_a_path_too_long() {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("f");
        std::fs::write(&file, "").unwrap();
        assert!(matches!(
            bind_in(&file),
            Err(LayoutError::NotDirectory { .. })
        ));
        let dir = tmp.path().join("d");
        std::fs::create_dir(&dir).unwrap();
        std::fs::write(socket_in(&dir), "").unwrap();
        assert!(matches!(bind_in(&dir), Err(LayoutError::NotSocket { .. })));
        let long = tmp.path().join("x".repeat(120));
        let err = bind_in(&long).unwrap_err();
        assert_eq!(err.to_string(), BARE_FAILURE);
        assert!(!long.exists());
    }
}
