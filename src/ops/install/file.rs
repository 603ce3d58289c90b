//! An engine's configuration file as the installers read and write it: a missing file
//! reads as empty; a write is atomic and keeps the file's mode (0644 for a new one); every
//! failure names the file (`InstallError`).

/// Where `gpushare install cdi` writes gpushare's CDI spec: the static CDI directory,
/// which survives a reboot (`/var/run/cdi` does not).
pub(crate) const CDI_STATIC_SPEC: &str = "/etc/cdi/gpushare.json";

use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub(crate) enum InstallError {
    #[error("cannot read {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not valid {format}: {message}")]
    Parse {
        path: PathBuf,
        format: &'static str,
        message: String,
    },
    #[error("{path}: {message}")]
    Unsupported { path: PathBuf, message: String },
    #[error("cannot write {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("runtime path {path} must be absolute")]
    RelativeRuntime { path: PathBuf },
}

/// The outcome of an edit: the new text, or `None` when the file already says it.
pub(crate) struct Edited {
    pub text: Option<String>,
}

/// Reads an engine config; a missing file reads as empty.
pub(crate) fn read(path: &Path) -> Result<String, InstallError> {
    match std::fs::read_to_string(path) {
        Ok(t) => Ok(t),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(String::new()),
        Err(source) => Err(InstallError::Read {
            path: path.to_owned(),
            source,
        }),
    }
}

/// Writes `text` atomically, keeping an existing file's mode (0644 for a new one).
pub(crate) fn write(path: &Path, text: &str) -> Result<(), InstallError> {
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(path)
        .map(|m| m.permissions().mode() & 0o7777)
        .unwrap_or(0o644);
    let err = |source| InstallError::Write {
        path: path.to_owned(),
        source,
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(err)?;
    }
    crate::fsops::write_atomic(path, text.as_bytes(), mode).map_err(|source| InstallError::Write {
        path: path.to_owned(),
        source,
    })
}

/// The shim to register: `--runtime-path`, else gpushare-runtime beside this binary.
pub(crate) fn runtime_path(given: Option<PathBuf>) -> Result<PathBuf, InstallError> {
    let path = match given {
        Some(p) => p,
        None => std::env::current_exe()
            .map(|p| p.with_file_name("gpushare-runtime"))
            .unwrap_or_else(|_| PathBuf::from("/usr/local/bin/gpushare-runtime")),
    };
    if !path.is_absolute() {
        return Err(InstallError::RelativeRuntime { path });
    }
    Ok(path)
}
