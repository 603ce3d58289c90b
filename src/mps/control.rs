//! Talks to an MPS control daemon the documented way: `echo <command> | nvidia-cuda-mps-control`
//! with the daemon's `CUDA_MPS_PIPE_DIRECTORY` (docs/mps.md, "Control commands").
//!
//! Invariants: the client runs with an explicit environment (no inherited LD_PRELOAD or
//! CUDA variables), as the daemon's user, and is killed when it outlives its deadline.
//! Its output is the daemon's, which a tenant can influence (a host account with the
//! daemon's UID can even put its own listener at `control`): it is read bounded, and an
//! error carries it escaped (`util::escape`), so it reaches no terminal or log raw.

use std::io::{Read, Write};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::util::poll_until;

/// PATH given to every process gpushare starts.
pub(crate) const SAFE_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

#[derive(Debug, thiserror::Error)]
pub(crate) enum ControlError {
    #[error("MPS control binary {binary:?} not found on PATH ({SAFE_PATH}); set mps.control-binary to its absolute path")]
    NotFound { binary: String },
    #[error("MPS control binary {path} does not exist; set mps.control-binary to where nvidia-cuda-mps-control is")]
    Missing { path: PathBuf },
    #[error(transparent)]
    Driver(#[from] crate::driver::DriverError),
    #[error("cannot run {binary}")]
    Spawn {
        binary: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("MPS control command {command:?} failed ({status}): {output}")]
    Failed {
        command: String,
        status: String,
        output: String,
    },
    #[error("MPS control command {command:?} did not answer within {timeout:?}")]
    Timeout { command: String, timeout: Duration },
}

/// Resolves `mps.control-binary`: an absolute path that exists; a name under
/// `driver_root` when that is set (`driver::find_binary`: never the host's own, which
/// would be another driver version's); else a name on the safe PATH (an executable file
/// there, see `util::find_executable`).
pub(crate) fn resolve_binary(
    binary: &str,
    driver_root: Option<&std::path::Path>,
) -> Result<PathBuf, ControlError> {
    if let (false, Some(root)) = (binary.contains('/'), driver_root) {
        return Ok(crate::driver::find_binary(root, binary)?);
    }
    if binary.contains('/') {
        let path = PathBuf::from(binary);
        return if path.is_file() {
            Ok(path)
        } else {
            Err(ControlError::Missing { path })
        };
    }
    crate::util::find_executable(binary, std::ffi::OsStr::new(SAFE_PATH)).ok_or_else(|| {
        ControlError::NotFound {
            binary: binary.to_owned(),
        }
    })
}

/// The most of a control client's stdout or stderr read: replies are a few lines.
const MAX_OUTPUT: u64 = 64 << 10;

/// What a control client wrote, at most `MAX_OUTPUT` bytes, bytes that are not UTF-8
/// replaced. A reply is the daemon's (or whatever listens on its socket): hostile.
fn read_bounded(pipe: Option<impl Read>) -> String {
    let mut bytes = Vec::new();
    if let Some(p) = pipe {
        let _ = p.take(MAX_OUTPUT).read_to_end(&mut bytes);
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

/// A handle on one control daemon.
#[derive(Debug, Clone)]
pub(crate) struct Control {
    pub binary: PathBuf,
    pub pipe_dir: PathBuf,
    /// Run the client as this (uid, gid); `None` keeps the caller's.
    pub user: Option<(u32, u32)>,
}

impl Control {
    /// Sends one command; returns the daemon's reply (stdout) when the client exits 0.
    pub(crate) fn command(&self, command: &str, timeout: Duration) -> Result<String, ControlError> {
        let mut cmd = Command::new(&self.binary);
        cmd.env_clear()
            .env("PATH", SAFE_PATH)
            .env("CUDA_MPS_PIPE_DIRECTORY", &self.pipe_dir)
            .current_dir("/")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some((uid, gid)) = self.user {
            cmd.uid(uid).gid(gid);
        }
        let mut child = cmd.spawn().map_err(|source| ControlError::Spawn {
            binary: self.binary.clone(),
            source,
        })?;
        if let Some(mut stdin) = child.stdin.take() {
            let _ = stdin.write_all(format!("{command}\n").as_bytes());
        }
        let exited = poll_until(
            Instant::now() + timeout,
            Duration::from_micros(200),
            Duration::from_millis(10),
            || child.try_wait().transpose(),
        );
        // A failed wait counts as no answer: the client is killed either way.
        let Some(Ok(status)) = exited else {
            let _ = child.kill();
            let _ = child.wait();
            return Err(ControlError::Timeout {
                command: command.to_owned(),
                timeout,
            });
        };
        let out = read_bounded(child.stdout.take());
        if status.success() {
            Ok(out)
        } else {
            let err = read_bounded(child.stderr.take());
            let text = format!("{} {}", out.trim(), err.trim());
            Err(ControlError::Failed {
                command: command.to_owned(),
                status: status.to_string(),
                output: crate::util::escape(&crate::util::one_line(&text)),
            })
        }
    }
}
