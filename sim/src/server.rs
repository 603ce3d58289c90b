//! The simulated MPS server: a real child process (this binary re-executed with
//! `--internal-server <uid>`), so `get_server_list` shows real pids and the uid switch is real.
//!
//! The server's whole life: create `/dev/shm/cuda.shm.sim.<own pid>` holding its pid (the
//! stand-in for the real server's `cuda.shm.*` segments, which clients must be able to see),
//! write `ready` on stdout, then block on stdin; at end of stdin remove the file and exit 0.
//!
//! Invariants: the daemon owns the write end of the server's stdin, so the server outlives
//! neither a `quit` nor a daemon crash (either closes the pipe); the shm file exists from
//! before `ready` until just before a clean exit; servers sit in their own process group, so a
//! Ctrl-C meant for a foreground daemon cannot kill them before they clean up.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::AsFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use thiserror::Error;

/// Where the shared-memory marker of server `pid` lives; hard-coded like the real
/// `/dev/shm/cuda.shm.*` files.
pub fn shm_path(pid: u32) -> PathBuf {
    PathBuf::from(format!("/dev/shm/cuda.shm.sim.{pid}"))
}

const READY_WORD: &str = "ready";
const START_TIMEOUT: Duration = Duration::from_secs(10);
const STOP_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, Error)]
pub enum ServerError {
    #[error("spawn server process {exe}")]
    Spawn {
        exe: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("server {pid} did not report ready within {secs} s", secs = START_TIMEOUT.as_secs())]
    NotReady { pid: u32 },
    #[error("server {pid} exited before it was ready")]
    DiedEarly { pid: u32 },
}

/// A running server as the daemon holds it.
pub struct ServerProcess {
    pid: u32,
    child: Child,
    stdin: Option<ChildStdin>,
}

impl ServerProcess {
    /// Starts a server and waits until it has created its shm file. `switch_to` is the
    /// uid/gid to run it as, `None` to keep the daemon's own. Returns the server and its
    /// stdout, which reaches end of file when the server exits.
    pub fn spawn(
        exe: &Path,
        uid: u32,
        switch_to: Option<(u32, u32)>,
    ) -> Result<(Self, BufReader<ChildStdout>), ServerError> {
        let mut cmd = Command::new(exe);
        cmd.arg("--internal-server")
            .arg(uid.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .current_dir("/")
            .process_group(0);
        if let Some((u, g)) = switch_to {
            cmd.uid(u).gid(g);
        }
        let mut child = cmd.spawn().map_err(|source| ServerError::Spawn {
            exe: exe.to_path_buf(),
            source,
        })?;
        let pid = child.id();
        let stdin = child.stdin.take();
        let Some(stdout) = child.stdout.take() else {
            // Stdio::piped() always yields a handle; treat its absence like an early death.
            let mut server = ServerProcess { pid, child, stdin };
            server.kill();
            return Err(ServerError::DiedEarly { pid });
        };
        let mut server = ServerProcess { pid, child, stdin };
        let mut reader = BufReader::new(stdout);
        match wait_ready(&mut reader) {
            Ok(()) => Ok((server, reader)),
            Err(e) => {
                server.kill();
                Err(match e {
                    ReadyWait::TimedOut => ServerError::NotReady { pid },
                    ReadyWait::Closed => ServerError::DiedEarly { pid },
                })
            }
        }
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Asks the server to exit (end of its stdin) and reaps it; kills it if it does not go
    /// within a few seconds. Returns how it ended.
    pub fn stop(mut self) -> std::io::Result<ExitStatus> {
        drop(self.stdin.take());
        let deadline = Instant::now() + STOP_TIMEOUT;
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status);
            }
            if Instant::now() >= deadline {
                let _ = self.child.kill();
                return self.child.wait();
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Reaps a server that already ended by itself.
    pub fn reap(mut self) -> std::io::Result<ExitStatus> {
        drop(self.stdin.take());
        self.child.wait()
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

enum ReadyWait {
    TimedOut,
    Closed,
}

fn wait_ready(reader: &mut BufReader<ChildStdout>) -> Result<(), ReadyWait> {
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(ReadyWait::TimedOut);
        }
        let timeout = PollTimeout::try_from(left).unwrap_or(PollTimeout::MAX);
        let mut fds = [PollFd::new(reader.get_ref().as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, timeout) {
            Ok(0) => return Err(ReadyWait::TimedOut),
            Ok(_) => break,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(_) => return Err(ReadyWait::Closed),
        }
    }
    // The server writes the word and its newline in one write, so once the pipe is readable
    // this read does not block for long.
    let mut line = String::new();
    match reader.read_line(&mut line) {
        Ok(_) if line.trim_end() == READY_WORD => Ok(()),
        _ => Err(ReadyWait::Closed),
    }
}

/// Describes how a server ended, for `Server <pid> exited with status <n>`.
pub fn describe_exit(status: &ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with status {code}"),
        (None, Some(sig)) => format!("was killed by signal {sig}"),
        (None, None) => "exited".to_string(),
    }
}

/// Main of the server child process.
pub fn run_server() -> Result<()> {
    let pid = std::process::id();
    let path = shm_path(pid);
    std::fs::write(&path, format!("{pid}\n"))
        .with_context(|| format!("create server shared memory {}", path.display()))?;
    let served = serve(&path);
    // Remove the file whatever happened: a leftover would claim a server that is gone.
    let removed = std::fs::remove_file(&path)
        .with_context(|| format!("remove server shared memory {}", path.display()));
    served.and(removed)
}

fn serve(path: &Path) -> Result<()> {
    // The real server holds a context of its own (its ~28 MiB row in NVML) on the device
    // its daemon serves; gpushare starts a daemon with one UUID as CUDA_VISIBLE_DEVICES.
    let _context = std::env::var("CUDA_VISIBLE_DEVICES")
        .ok()
        .filter(|d| crate::gpu::is_uuid(d))
        .map(|d| crate::gpu::Context::hold(&d, crate::gpu::Kind::Compute, 28 << 20))
        .transpose()
        .context("hold the server's context")?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{READY_WORD}").context("report ready to the control daemon")?;
    out.flush().context("report ready to the control daemon")?;
    // Block until the daemon closes our stdin; anything it writes is ignored.
    let mut sink = [0u8; 256];
    let mut stdin = std::io::stdin().lock();
    loop {
        match stdin.read(&mut sink) {
            Ok(0) => return Ok(()),
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                return Err(e).with_context(|| {
                    format!(
                        "wait for the control daemon (server file {})",
                        path.display()
                    )
                })
            }
        }
    }
}
