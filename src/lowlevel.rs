//! Finds the low-level OCI runtime and replaces this process with it.
//!
//! Invariants: the first candidate that resolves to an executable file wins; a candidate
//! that is gpushare-runtime itself (same inode as /proc/self/exe) is refused, so a
//! misconfiguration cannot loop; argv is forwarded verbatim but for argv[0], and the
//! environment unchanged, through execve — never fork+wait, which would break runc's
//! pid-file, console-socket, preserve-fds and parent-death semantics.

use std::ffi::OsString;
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub(crate) enum LowLevelError {
    #[error("no low-level runtime found: tried {tried}; set low-level-runtime in the config to a runtime on PATH or an absolute path")]
    NotFound { tried: String },
    #[error("low-level runtime {path} is gpushare-runtime itself; point low-level-runtime at runc, crun or nvidia-container-runtime")]
    IsSelf { path: PathBuf },
    #[error("cannot exec low-level runtime {path}")]
    Exec {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Resolves the first usable candidate, by absolute path or on `PATH`.
pub(crate) fn resolve(candidates: &[String]) -> Result<PathBuf, LowLevelError> {
    let me = std::fs::metadata("/proc/self/exe").ok();
    let path_var =
        std::env::var_os("PATH").unwrap_or_else(|| crate::mps::control::SAFE_PATH.into());
    for cand in candidates {
        let found = if cand.contains('/') {
            Some(PathBuf::from(cand))
        } else {
            crate::util::find_executable(cand, &path_var)
        };
        // The metadata serves the check against this very binary below.
        let found = found.and_then(|p| crate::util::executable(&p).map(|md| (p, md)));
        if let Some((path, md)) = found {
            if let Some(me) = &me {
                if me.dev() == md.dev() && me.ino() == md.ino() {
                    return Err(LowLevelError::IsSelf { path });
                }
            }
            return Ok(path);
        }
    }
    Err(LowLevelError::NotFound {
        tried: candidates.join(", "),
    })
}

/// Whether `path` is NVIDIA's runtime shim, which needs `NVIDIA_VISIBLE_DEVICES`.
pub(crate) fn is_nvidia(path: &Path) -> bool {
    path.file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.starts_with("nvidia-container-runtime"))
}

/// The NVIDIA runtime among `candidates` that was passed over because it is not there,
/// when `used` (what [`resolve`] chose) is not NVIDIA's: every candidate listed before
/// the one used was not found. Containers then get no device nodes or driver libraries
/// from NVIDIA's toolkit, only what gpushare adds (the MPS pipe directory).
pub(crate) fn missing_nvidia<'a>(candidates: &'a [String], used: &Path) -> Option<&'a str> {
    if is_nvidia(used) {
        return None;
    }
    let is_used = |c: &String| {
        Path::new(c) == used || (!c.contains('/') && used.file_name() == Some(c.as_ref()))
    };
    let before = candidates.iter().position(is_used)?;
    candidates[..before]
        .iter()
        .find(|c| is_nvidia(Path::new(c.as_str())))
        .map(String::as_str)
}

/// Replaces this process with `runtime`, passing `args` (without argv[0]) verbatim.
/// Only returns on failure.
pub(crate) fn exec(runtime: &Path, args: &[OsString]) -> LowLevelError {
    let source = std::process::Command::new(runtime).args(args).exec();
    LowLevelError::Exec {
        path: runtime.to_owned(),
        source,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn first_found_wins_and_missing_are_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("fake-runc");
        std::fs::write(&a, "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(&a, std::fs::Permissions::from_mode(0o755)).unwrap();
        let got = resolve(&["/nonexistent/runc".into(), a.display().to_string()]).unwrap();
        assert_eq!(got, a);
    }

    #[test]
    fn non_executable_is_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("runc");
        std::fs::write(&a, "").unwrap();
        let err = resolve(&[a.display().to_string()]).unwrap_err().to_string();
        assert!(err.contains("no low-level runtime found"), "{err}");
    }

    #[test]
    fn itself_is_refused() {
        let me = std::fs::read_link("/proc/self/exe").unwrap();
        let err = resolve(&[me.display().to_string()]).unwrap_err();
        assert!(matches!(err, LowLevelError::IsSelf { .. }), "{err}");
    }

    #[test]
    fn a_missing_nvidia_runtime_passed_over_is_named() {
        let list = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let toolkit = "/usr/local/nvidia/toolkit/nvidia-container-runtime";
        for (candidates, used, want) in [
            (
                list(&["nvidia-container-runtime", "runc"]),
                "/usr/bin/runc",
                Some("nvidia-container-runtime"),
            ),
            (
                list(&[toolkit, "/usr/sbin/runc"]),
                "/usr/sbin/runc",
                Some(toolkit),
            ),
            (
                list(&["nvidia-container-runtime", "runc"]),
                "/usr/bin/nvidia-container-runtime",
                None,
            ),
            // Listed after the one used: not passed over.
            (
                list(&["runc", "nvidia-container-runtime"]),
                "/usr/bin/runc",
                None,
            ),
            (list(&["runc", "crun"]), "/usr/bin/crun", None),
        ] {
            assert_eq!(
                missing_nvidia(&candidates, Path::new(used)),
                want,
                "{candidates:?} {used}"
            );
        }
    }

    #[test]
    fn nvidia_is_recognised() {
        assert!(is_nvidia(Path::new("/usr/bin/nvidia-container-runtime")));
        assert!(is_nvidia(Path::new("nvidia-container-runtime.cdi")));
        assert!(!is_nvidia(Path::new("/usr/bin/runc")));
    }
}
