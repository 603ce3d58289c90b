//! The agent: a long-lived root process per node (`gpushare agent`) that starts
//! supervisors and reapers as its own children, so that they belong to no engine
//! (`launch` says why), and reaps them.
//!
//! It listens on `<state-dir>/agent.sock` (0600 root, in the root-only state directory)
//! and takes one request per connection, one line: `supervise <id>`, `reap <id>` or
//! `ping`; it answers one line, `ok <pid> <start time>` or `refused <why>`. A request is
//! hostile-shaped input even though only root can connect:
//! - the peer must be uid 0 (`SO_PEERCRED`), checked before anything is read, and in the
//!   agent's own mount namespace (a supervisor must see the mounts its hook made);
//! - at most `MAX_REQUEST` bytes, and the whole exchange within `IO_DEADLINE`: a peer that
//!   stalls is dropped, and the next one is served;
//! - the id must be a daemon id (32 lowercase hex digits); `supervise` only for a daemon
//!   whose record exists and whose supervisor lock is free (`locks/<id>.sup`: no
//!   supervisor runs it), `reap` only for a daemon whose directory exists;
//! - what it starts is always `gpushare daemon <supervise|reap> --id <id>` (this binary,
//!   its own config) with stdio on /dev/null and an explicit environment (`job::command`);
//!   nothing from the request but the job and the id reaches it.
//!
//! Invariants: one agent per state directory (`locks/agent.lock`, held for its life);
//! every child is reaped as soon as it exits (SIGCHLD through a signalfd); on SIGTERM or
//! SIGINT it removes its socket and exits, and its children run on (they are in their own
//! sessions and cgroups; the one that adopts them then is the agent's own parent or PID 1,
//! never an engine, unless an engine started the agent).

use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::signal::{SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};

use super::job::{self, Job};
use crate::config::Config;
use crate::state::{ProcRef, StateDir};

/// The longest request line, newline included (`supervise ` and a 32-digit id are 43).
const MAX_REQUEST: usize = 64;
/// The longest one exchange may take, on either side.
const IO_DEADLINE: Duration = Duration::from_secs(2);

/// Why the agent did not start a process for the hook.
#[derive(Debug, thiserror::Error)]
pub(crate) enum AgentError {
    #[error("none listens on {path}")]
    Absent { path: PathBuf },
    #[error("cannot talk to the agent on {path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the agent on {path} refused: {why}")]
    Refused { path: PathBuf, why: String },
    #[error("the agent on {path} answered {answer:?}, not `ok <pid> <start time>`")]
    Garbled { path: PathBuf, answer: String },
}

/// One request, parsed.
#[derive(Debug, PartialEq, Eq)]
enum Request {
    Ping,
    Start(Job, String),
}

/// Parses one request line (without its newline); the error is the refusal.
fn parse(line: &str) -> Result<Request, String> {
    let mut words = line.split(' ');
    let (job, id, rest) = (words.next(), words.next(), words.next());
    match (job, id, rest) {
        (Some("ping"), None, None) => Ok(Request::Ping),
        (Some(word), Some(id), None) => {
            let job = Job::from_word(word).ok_or_else(|| {
                format!("unknown request {word:?}: allowed are supervise <id>, reap <id>, ping")
            })?;
            if !crate::identity::valid_id(id) {
                return Err(format!(
                    "daemon id {:?} is invalid: allowed is {}",
                    id.chars().take(40).collect::<String>(),
                    crate::identity::ID_ALLOWED
                ));
            }
            Ok(Request::Start(job, id.to_owned()))
        }
        _ => Err(format!(
            "malformed request {:?}: allowed are supervise <id>, reap <id>, ping",
            line.chars().take(40).collect::<String>()
        )),
    }
}

/// Sends `line` to the agent of `state` and returns its answer line.
fn exchange(state: &StateDir, line: &str) -> Result<String, AgentError> {
    let path = state.agent_socket();
    let io = |source| AgentError::Io {
        path: path.clone(),
        source,
    };
    let mut stream = match UnixStream::connect(&path) {
        Ok(s) => s,
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
            ) =>
        {
            return Err(AgentError::Absent { path });
        }
        Err(e) => return Err(io(e)),
    };
    let deadline = Instant::now() + IO_DEADLINE;
    stream.set_write_timeout(Some(IO_DEADLINE)).map_err(io)?;
    if let Err(e) = stream.write_all(format!("{line}\n").as_bytes()) {
        // The agent answers a peer it refuses before reading its request, and closes: the
        // write may then fail while the answer waits to be read.
        if !matches!(
            e.kind(),
            std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
        ) {
            return Err(io(e));
        }
    }
    read_line(&mut stream, deadline, 256).map_err(io)
}

/// Asks the agent to start `job` for daemon `id`: the process it started.
pub(crate) fn ask(state: &StateDir, job: Job, id: &str) -> Result<ProcRef, AgentError> {
    let answer = exchange(state, &format!("{} {id}", job.word()))?;
    started(&answer).map_err(|()| answer_error(state, answer))
}

/// Whether an agent answers on `state`'s socket: its pid.
pub(crate) fn ping(state: &StateDir) -> Result<i32, AgentError> {
    let answer = exchange(state, "ping")?;
    started(&answer)
        .map(|p| p.pid)
        .map_err(|()| answer_error(state, answer))
}

fn answer_error(state: &StateDir, answer: String) -> AgentError {
    let path = state.agent_socket();
    match answer.strip_prefix("refused ") {
        Some(why) => AgentError::Refused {
            path,
            why: why.to_owned(),
        },
        None => AgentError::Garbled { path, answer },
    }
}

/// `ok <pid> <start time>` → the process.
fn started(answer: &str) -> Result<ProcRef, ()> {
    let mut words = answer.split(' ');
    match (words.next(), words.next(), words.next(), words.next()) {
        (Some("ok"), Some(pid), Some(start), None) => Ok(ProcRef {
            pid: pid.parse().map_err(|_| ())?,
            start_time: start.parse().map_err(|_| ())?,
        }),
        _ => Err(()),
    }
}

/// Reads one line of at most `max` bytes (newline included) before `deadline`.
fn read_line(stream: &mut UnixStream, deadline: Instant, max: usize) -> std::io::Result<String> {
    let mut buf = Vec::with_capacity(max);
    let mut chunk = [0u8; 64];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::ErrorKind::TimedOut.into());
        }
        stream.set_read_timeout(Some(left))?;
        let n = match stream.read(&mut chunk) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(end) = buf.iter().position(|&b| b == b'\n') {
            buf.truncate(end);
            return String::from_utf8(buf).map_err(|_| std::io::ErrorKind::InvalidData.into());
        }
        if buf.len() >= max {
            return Err(std::io::ErrorKind::InvalidData.into());
        }
    }
}

/// The agent's own state: where it is, what it runs.
struct Agent<'a> {
    cfg: &'a Config,
    state: StateDir,
    /// This binary, resolved once: an upgrade that replaces it starts the new one.
    exe: PathBuf,
}

impl Agent<'_> {
    /// Serves one connection: one request, one answer. Errors are the peer's problem (it
    /// is dropped); nothing here stops the agent.
    fn serve(&self, mut stream: UnixStream) {
        let deadline = Instant::now() + IO_DEADLINE;
        let answer = match self.answer(&mut stream, deadline) {
            Ok(answer) => answer,
            // A peer that connects and closes (a liveness probe) is no news.
            Err(e)
                if e.downcast_ref::<std::io::Error>()
                    .is_some_and(|e| e.kind() == std::io::ErrorKind::UnexpectedEof) =>
            {
                tracing::debug!("agent: a peer closed without a request");
                return;
            }
            Err(e) => {
                tracing::warn!(error = %format!("{e:#}"), "agent: dropped a connection");
                return;
            }
        };
        if answer.starts_with("refused") {
            tracing::warn!(answer = %answer, "agent: refused a request");
        }
        let _ = stream.set_write_timeout(Some(
            deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1)),
        ));
        let _ = stream.write_all(format!("{answer}\n").as_bytes());
    }

    fn answer(&self, stream: &mut UnixStream, deadline: Instant) -> anyhow::Result<String> {
        stream.set_nonblocking(false)?;
        let cred = nix::sys::socket::getsockopt(
            &stream.as_fd(),
            nix::sys::socket::sockopt::PeerCredentials,
        )
        .context("read the peer's credentials")?;
        if cred.uid() != 0 {
            return Ok(format!(
                "refused peer uid {} (pid {}): only root may ask the agent",
                cred.uid(),
                cred.pid()
            ));
        }
        // The supervisor works on the mounts the hook made (the daemon's tmpfs): it must
        // see the hook's mounts, which it does only in the same mount namespace.
        let ns = |pid: &str| std::fs::read_link(format!("/proc/{pid}/ns/mnt")).ok();
        let (own, peer) = (ns("self"), ns(&cred.pid().to_string()));
        if own.is_none() || own != peer {
            return Ok(format!(
                "refused peer pid {} is in another mount namespace ({:?}, the agent's {:?}): run the agent in the mount namespace the hooks run in",
                cred.pid(),
                peer,
                own
            ));
        }
        let line = read_line(stream, deadline, MAX_REQUEST).context("read the request")?;
        let (job, id) = match parse(&line) {
            Ok(Request::Ping) => return Ok(format!("ok {} 0", std::process::id())),
            Ok(Request::Start(job, id)) => (job, id),
            Err(why) => return Ok(format!("refused {why}")),
        };
        if let Err(why) = self.startable(job, &id) {
            return Ok(format!("refused {why}"));
        }
        let child = job::command(&self.exe, self.cfg.path.as_deref(), job, &id).spawn();
        match child {
            Ok(child) => {
                let pid = child.id() as i32;
                // Not yet reaped (that is this process's job), so its start time is there
                // unless it is a zombie already: 0 then, which names no live process.
                let start = ProcRef::of(pid).map_or(0, |p| p.start_time);
                tracing::info!(daemon = %id, pid, job = job.word(), "agent started");
                Ok(format!("ok {pid} {start}"))
            }
            Err(e) => Ok(format!("refused cannot start {}: {e}", self.exe.display())),
        }
    }

    /// Whether `job` may be started for daemon `id` (a valid id): the refusal if not.
    fn startable(&self, job: Job, id: &str) -> Result<(), String> {
        match job {
            Job::Supervise => {
                match self.state.read_record(id) {
                    Ok(Some(_)) => {}
                    Ok(None) => return Err(format!("daemon {id} has no record")),
                    Err(e) => return Err(format!("daemon {id}: {e}")),
                }
                match self.state.try_lock_supervisor(id) {
                    // Free: released at once; the supervisor takes it itself (`claim`).
                    Ok(Some(_free)) => Ok(()),
                    Ok(None) => Err(format!(
                        "a supervisor of daemon {id} runs already (it holds {})",
                        self.state.supervisor_lock_path(id).display()
                    )),
                    Err(e) => Err(format!("daemon {id}: {e}")),
                }
            }
            Job::Reap => match std::fs::symlink_metadata(self.state.daemon_dir(id)) {
                Ok(md) if md.is_dir() => Ok(()),
                _ => Err(format!("daemon {id} has no directory")),
            },
        }
    }
}

/// Reaps every child that has exited.
fn reap_children() {
    use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
    while let Ok(status) = waitpid(None, Some(WaitPidFlag::WNOHANG)) {
        if status == WaitStatus::StillAlive {
            break;
        }
    }
}

/// Removes a socket file left by an agent that is gone; refuses anything else there.
fn clear_stale_socket(path: &Path) -> anyhow::Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(md) if md.file_type().is_socket() => std::fs::remove_file(path)
            .with_context(|| format!("remove the stale socket {}", path.display())),
        Ok(_) => bail!(
            "{} exists and is not a socket: remove it (only the agent's socket belongs there)",
            path.display()
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e).with_context(|| format!("inspect {}", path.display())),
    }
}

/// `gpushare agent`: serves until SIGTERM or SIGINT.
pub(crate) fn run(cfg: &Config) -> anyhow::Result<()> {
    let state = StateDir::new(&cfg.state_dir);
    state.ensure_root()?;
    let path = state.agent_socket();
    let Some(_only) = state.try_lock_agent()? else {
        bail!(
            "another gpushare agent serves {} (it holds {})",
            cfg.state_dir.display(),
            state.agent_lock_path().display()
        );
    };
    clear_stale_socket(&path)?;
    // Signals first: a child that exits before the loop is still reaped, and a SIGTERM
    // between the bind and the loop still removes the socket.
    let mut mask = SigSet::empty();
    for s in [Signal::SIGCHLD, Signal::SIGTERM, Signal::SIGINT] {
        mask.add(s);
    }
    mask.thread_block().context("block the agent's signals")?;
    let sfd = SignalFd::with_flags(&mask, SfdFlags::SFD_CLOEXEC | SfdFlags::SFD_NONBLOCK)
        .context("open the agent's signalfd")?;
    let old = nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o177));
    let bound = UnixListener::bind(&path);
    nix::sys::stat::umask(old);
    let listener = bound.with_context(|| format!("listen on {}", path.display()))?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("chmod 0600 {}", path.display()))?;
    listener.set_nonblocking(true)?;
    let agent = Agent {
        cfg,
        state,
        exe: std::env::current_exe().context("find the gpushare binary")?,
    };
    tracing::info!(socket = %path.display(), "agent listening");
    let result = agent.serve_until_signalled(&listener, &sfd);
    let _ = std::fs::remove_file(&path);
    tracing::info!("agent stopped");
    result
}

impl Agent<'_> {
    fn serve_until_signalled(&self, listener: &UnixListener, sfd: &SignalFd) -> anyhow::Result<()> {
        loop {
            let mut fds = [
                PollFd::new(listener.as_fd(), PollFlags::POLLIN),
                PollFd::new(sfd.as_fd(), PollFlags::POLLIN),
            ];
            match poll(&mut fds, PollTimeout::NONE) {
                Ok(_) => {}
                Err(nix::errno::Errno::EINTR) => continue,
                Err(e) => return Err(e).context("poll the agent's socket"),
            }
            let signalled = fds[1].revents().is_some_and(|r| !r.is_empty());
            let connected = fds[0].revents().is_some_and(|r| !r.is_empty());
            if signalled {
                while let Ok(Some(info)) = sfd.read_signal() {
                    if info.ssi_signo != Signal::SIGCHLD as u32 {
                        return Ok(());
                    }
                }
                reap_children();
            }
            if connected {
                loop {
                    match listener.accept() {
                        Ok((stream, _)) => self.serve(stream),
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                        Err(e) => {
                            tracing::warn!(error = %e, "agent: accept failed");
                            break;
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "0123456789abcdef0123456789abcdef";

    /// An agent that answers and closes before it reads (as it does for a peer it refuses)
    /// still has its answer read, though the request's write fails with EPIPE.
    #[test]
    fn an_answer_sent_before_the_request_was_read_is_still_read() {
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::new(dir.path());
        let listener = std::os::unix::net::UnixListener::bind(state.agent_socket()).unwrap();
        let agent = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            s.write_all(b"refused not root\n").unwrap();
            // Unread data in the receive queue makes close send a reset: shut down first.
            s.shutdown(std::net::Shutdown::Both).unwrap();
        });
        // A request larger than the socket buffers, so that its write meets the closed end.
        let long = "x".repeat(4 << 20);
        let answer = exchange(&state, &long);
        agent.join().unwrap();
        assert_eq!(answer.unwrap(), "refused not root");
    }

    #[test]
    fn requests_parse_strictly() {
        assert_eq!(parse("ping"), Ok(Request::Ping));
        assert_eq!(
            parse(&format!("supervise {ID}")),
            Ok(Request::Start(Job::Supervise, ID.into()))
        );
        assert_eq!(
            parse(&format!("reap {ID}")),
            Ok(Request::Start(Job::Reap, ID.into()))
        );
        for bad in [
            "",
            "ping x",
            "supervise",
            &format!("supervise {ID} extra"),
            &format!("supervise  {ID}"),
            &format!("run {ID}"),
            "supervise 0123456789ABCDEF0123456789ABCDEF",
            "supervise ../../etc",
            &format!("supervise {ID}0"),
            &format!("reap --id={ID}"),
        ] {
            assert!(parse(bad).is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn answers_parse_strictly() {
        assert_eq!(
            started("ok 12 345"),
            Ok(ProcRef {
                pid: 12,
                start_time: 345
            })
        );
        for bad in [
            "ok",
            "ok 12",
            "ok 12 x",
            "ok x 1",
            "ok 1 2 3",
            "refused no",
            "",
        ] {
            assert!(started(bad).is_err(), "{bad:?}");
        }
    }
}
