//! Talks to an MPS control daemon the documented way: `echo <command> | nvidia-cuda-mps-control`
//! with the daemon's `CUDA_MPS_PIPE_DIRECTORY` (docs/mps.md, "Control commands").
//!
//! Invariants: the client runs with an explicit environment (no inherited LD_PRELOAD or
//! CUDA variables), as the daemon's user, and is killed when it outlives its deadline.
//! Its output is the daemon's, which a tenant can influence (a host account with the
//! daemon's UID can even put its own listener at `control`): it is read bounded, and an
//! error carries it escaped (`util::escape`), so it reaches no terminal or log raw.
//!
//! Two channels. Every client of a daemon can connect to its `control` socket, and so can
//! hold all of its connections (a tenant did, to keep the supervisor from checking the
//! limits). A multi-user daemon (root's) also makes `control_privileged`, a socket only
//! root can connect to (docs/mps.md, "The privileged channel"). A `Control` with a
//! privileged view sends each command there first — the client runs with
//! `CUDA_MPS_PIPE_DIRECTORY` set to a root-only directory whose `control` and
//! `control_privileged` both lead to it, so the client reaches that socket whichever name
//! it opens — and falls back to `control` only when that attempt fails, within the same
//! deadline.

use std::io::{Read, Write};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::util::poll_until;

pub(crate) use crate::driver::SAFE_PATH;

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

/// The longest a command waits on the privileged channel before it falls back to
/// `control`, when its deadline is longer: a daemon that serves control commands there
/// answers at once, and one that does not (unverified on NVIDIA's daemon) must still
/// leave the fallback time to answer.
const PRIVILEGED_WAIT: Duration = Duration::from_secs(1);

/// How much of a command's `timeout` the privileged channel gets: `PRIVILEGED_WAIT`, or
/// half of a shorter one, so that `control` always has time left.
fn privileged_share(timeout: Duration) -> Duration {
    if timeout > 2 * PRIVILEGED_WAIT {
        PRIVILEGED_WAIT
    } else {
        timeout / 2
    }
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
    /// The privileged view (`StateDir::privileged_view`) of a multi-user daemon: commands
    /// go there first. `None`: `control` only.
    pub privileged: Option<PathBuf>,
    /// An MPS v3 daemon: commands are the command line's modules and verbs (`cli`), its
    /// clients are listed by `client list`, and it quits with `-q`.
    pub v3: bool,
}

/// `client list --all --format=csv,noheader`: one line per client (pid, server, device,
/// namespace, command); the table format cuts long pids.
fn list_clients() -> Vec<String> {
    ["client", "list", "--all", "--format=csv,noheader"]
        .map(str::to_owned)
        .to_vec()
}

impl Control {
    /// The control of daemon `id` as root sends to it: as the daemon's user for a per-user
    /// daemon (whose sockets are its own), as root through the privileged view for a
    /// multi-user one.
    pub(crate) fn of_daemon(
        binary: PathBuf,
        state: &crate::state::StateDir,
        id: &str,
        ident: &crate::identity::Identity,
    ) -> Control {
        Control {
            binary,
            pipe_dir: state.pipe_dir(id),
            user: (!ident.multi_user).then_some((ident.uid, ident.gid)),
            // A v3 daemon's pipe directory is root's alone (0700): no tenant reaches its
            // `control`, so it needs no other channel.
            privileged: (ident.multi_user && !ident.v3).then(|| state.privileged_view(id)),
            v3: ident.v3,
        }
    }
    /// The same daemon after its directory was renamed to `dir` (a tombstone).
    pub(crate) fn moved_to(&self, dir: &std::path::Path) -> Control {
        Control {
            pipe_dir: dir.join("pipe"),
            privileged: self.privileged.as_ref().map(|_| dir.join("priv")),
            ..self.clone()
        }
    }
    /// Sends one command; returns the daemon's reply (stdout) when the client exits 0.
    /// Through the privileged view first where there is one (at most `PRIVILEGED_WAIT`
    /// of `timeout` when the rest leaves `control` time), then through `control` with
    /// what is left of `timeout` when that failed.
    pub(crate) fn command(&self, command: &str, timeout: Duration) -> Result<String, ControlError> {
        let Some(view) = &self.privileged else {
            return self.command_in(&self.pipe_dir, command, timeout);
        };
        let start = Instant::now();
        let first = privileged_share(timeout);
        match self.command_in(view, command, first) {
            Ok(out) => Ok(out),
            Err(privileged) => {
                let left = timeout.saturating_sub(start.elapsed());
                if left.is_zero() {
                    return Err(privileged);
                }
                tracing::debug!(command, error = %privileged, "no answer through control_privileged; trying control");
                self.command_in(&self.pipe_dir, command, left)
            }
        }
    }
    /// The daemon's servers and how many clients each has (`None` where a server's list
    /// did not come), all within `timeout`; `Err` when the daemon did not list its
    /// servers. What `status` shows, and what decides whether an idle daemon may quit.
    pub(crate) fn clients(
        &self,
        timeout: Duration,
    ) -> Result<Vec<(u32, Option<usize>)>, ControlError> {
        if self.v3 {
            // One server; every client of every namespace in one CSV list.
            let listed = self.client_list(timeout)?;
            return Ok(vec![(0, Some(super::reply::csv_rows(&listed).count()))]);
        }
        let deadline = Instant::now() + timeout;
        let left = || deadline.saturating_duration_since(Instant::now());
        let servers = super::reply::pids(&self.command("get_server_list", timeout)?);
        Ok(servers
            .into_iter()
            .map(|s| {
                let listed = (!left().is_zero())
                    .then(|| self.command(&format!("get_client_list {s}"), left()).ok())
                    .flatten();
                (s, listed.map(|out| super::reply::pids(&out).len()))
            })
            .collect())
    }
    /// A v3 daemon's clients, one CSV line each (`list_clients`), within `timeout`.
    pub(crate) fn client_list(&self, timeout: Duration) -> Result<String, ControlError> {
        self.cli(&list_clients(), timeout)
    }
    /// Quits the daemon: `quit` on a legacy daemon's stdin interface, `-q` on a v3 one.
    pub(crate) fn quit(&self, timeout: Duration) -> Result<String, ControlError> {
        match self.v3 {
            true => self.cli(&["-q".to_owned()], timeout),
            false => self.command("quit", timeout),
        }
    }
    /// One command of MPS v3's command line (`<module> <verb> [args]`, docs/mps.md, "Two
    /// backends") through `control` in the pipe directory; the daemon's reply (stdout)
    /// when the client exits 0.
    pub(crate) fn cli(&self, args: &[String], timeout: Duration) -> Result<String, ControlError> {
        self.run_in(&self.pipe_dir, args, None, &args.join(" "), timeout)
    }
    /// One command through the sockets in `pipe_dir`.
    fn command_in(
        &self,
        pipe_dir: &std::path::Path,
        command: &str,
        timeout: Duration,
    ) -> Result<String, ControlError> {
        self.run_in(pipe_dir, &[], Some(command), command, timeout)
    }
    /// Runs the control client in `pipe_dir` with `args`, `stdin` (a command line) written
    /// to it; `shown` names the command in errors.
    fn run_in(
        &self,
        pipe_dir: &std::path::Path,
        args: &[String],
        stdin: Option<&str>,
        shown: &str,
        timeout: Duration,
    ) -> Result<String, ControlError> {
        let mut cmd = Command::new(&self.binary);
        cmd.args(args)
            .env_clear()
            .env("PATH", SAFE_PATH)
            .env("CUDA_MPS_PIPE_DIRECTORY", pipe_dir)
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
        if let Some(mut pipe) = child.stdin.take() {
            if let Some(line) = stdin {
                let _ = pipe.write_all(format!("{line}\n").as_bytes());
            }
        }
        let exited = wait_exit(&mut child, Instant::now() + timeout);
        // A failed wait counts as no answer: the client is killed either way.
        let Some(Ok(status)) = exited else {
            let _ = child.kill();
            let _ = child.wait();
            return Err(ControlError::Timeout {
                command: shown.to_owned(),
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
                command: shown.to_owned(),
                status: status.to_string(),
                output: crate::util::escape(&crate::util::one_line(&text)),
            })
        }
    }
}

/// Waits until `child` exits or `deadline` passes: woken by its pidfd the moment it
/// exits (a control client answers in a few milliseconds, and `status` asks two per
/// daemon), else, where no pidfd can be had, by polling with a growing pause.
fn wait_exit(
    child: &mut std::process::Child,
    deadline: Instant,
) -> Option<std::io::Result<std::process::ExitStatus>> {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    use rustix::process::{pidfd_open, Pid, PidfdFlags};
    use std::os::fd::AsFd;
    let pidfd =
        Pid::from_raw(child.id() as i32).and_then(|pid| pidfd_open(pid, PidfdFlags::empty()).ok());
    let Some(pidfd) = pidfd else {
        return poll_until(
            deadline,
            Duration::from_micros(200),
            Duration::from_millis(10),
            || child.try_wait().transpose(),
        );
    };
    loop {
        if let Some(done) = child.try_wait().transpose() {
            return Some(done);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return None;
        }
        // Rounded up: a wait never ends before the deadline it was given.
        let ms = u32::try_from(left.as_millis() + 1)
            .unwrap_or(u32::MAX)
            .min(60_000);
        let mut fds = [PollFd::new(pidfd.as_fd(), PollFlags::POLLIN)];
        let _ = poll(
            &mut fds,
            PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// A control client that answers with the name of the directory it was pointed at,
    /// except that `priv` does what `on_priv` says.
    fn client(dir: &std::path::Path, on_priv: &str) -> PathBuf {
        let bin = dir.join("control");
        std::fs::write(
            &bin,
            format!(
                "#!/bin/sh\nread cmd\ncase \"$CUDA_MPS_PIPE_DIRECTORY\" in */priv) {on_priv};; esac\necho \"${{CUDA_MPS_PIPE_DIRECTORY##*/}}\"\n"
            ),
        )
        .unwrap();
        std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
        bin
    }

    fn control(bin: PathBuf, dir: &std::path::Path) -> Control {
        Control {
            binary: bin,
            pipe_dir: dir.join("pipe"),
            user: None,
            privileged: Some(dir.join("priv")),
            v3: false,
        }
    }

    #[test]
    fn the_privileged_channel_comes_first_and_control_answers_when_it_does_not() {
        let dir = tempfile::tempdir().unwrap();
        let answers = control(client(dir.path(), ":"), dir.path());
        assert_eq!(
            answers.command("x", Duration::from_secs(2)).unwrap(),
            "priv\n"
        );
        let refuses = control(client(dir.path(), "exit 1"), dir.path());
        assert_eq!(
            refuses.command("x", Duration::from_secs(2)).unwrap(),
            "pipe\n"
        );
        // One that never answers gets its share of the deadline, and control the rest.
        let hangs = control(client(dir.path(), "exec sleep 60"), dir.path());
        let start = Instant::now();
        assert_eq!(
            hangs.command("x", Duration::from_secs(3)).unwrap(),
            "pipe\n"
        );
        assert!(
            start.elapsed() < Duration::from_secs(3),
            "{:?}",
            start.elapsed()
        );
        let per_user = Control {
            privileged: None,
            ..control(client(dir.path(), "exit 1"), dir.path())
        };
        assert_eq!(
            per_user.command("x", Duration::from_secs(2)).unwrap(),
            "pipe\n"
        );
        assert_eq!(
            privileged_share(Duration::from_secs(2)),
            Duration::from_secs(1)
        );
        assert_eq!(privileged_share(Duration::from_secs(10)), PRIVILEGED_WAIT);
        assert_eq!(
            privileged_share(Duration::from_millis(600)),
            Duration::from_millis(300)
        );
    }
}
