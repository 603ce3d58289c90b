//! The control daemon process: `-f` (foreground), `-d` (background), startup checks, the
//! listening socket and the accept loop.
//!
//! Startup order, each step a hard error (one line on stderr, exit 1):
//! 1. `<pipe>/control` must fit in `sun_path` (107 bytes): the real daemon fails obscurely
//!    here, the simulator names the path and the limit;
//! 2. missing pipe and log directories are created 0700, existing ones are left as they are;
//! 3. `<pipe>/control_lock` is flock'ed for the daemon's lifetime (like the real daemon's
//!    lock file), so two daemons on one pipe directory cannot both start;
//! 4. an existing `<pipe>/control` that answers belongs to a live daemon (refuse); one that
//!    does not is stale, left by a daemon that died, and is replaced;
//! 5. bind, chmod 0666 (clients of every uid connect), write `nvidia-cuda-mps-control.pid`;
//! 6. with `-M`, bind `<pipe>/control_privileged` too, chmod 0755: as NVIDIA's multi-user
//!    daemon does (`srwxr-xr-x` root, docs/mps.md), only the daemon's own user can connect.
//!    It serves control commands only, from peers of that user or root (SO_PEERCRED), with
//!    connection slots of its own, so a flood of `control` never takes them.
//!
//! Invariants: SIGTERM and SIGINT are blocked in every thread and taken by one thread with
//! sigwait, so a signal always runs the same path as `quit`; that needs the mask set before
//! any thread exists, hence first thing in [`run`]. `-d` re-executes this binary instead of
//! forking (fork in a Rust program needs `unsafe`, re-exec does not); the launcher returns
//! only once the socket listens, with the daemon's exit code if it failed to start.

use std::fs::{DirBuilder, File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use nix::fcntl::{Flock, FlockArg};
use nix::sys::signal::{SigSet, Signal};

use crate::limits::{DeviceLimits, Percentage};
use crate::log::ControlLog;
use crate::sched::{Core, DaemonFiles, Settings};
use crate::session::{self, Channel};

/// `sun_path` is 108 bytes including the terminating NUL.
const SUN_PATH_MAX: usize = 107;
/// More simultaneous connections than this are refused, so a flood cannot exhaust threads.
const MAX_CONNECTIONS: usize = 512;
/// The same bound on `control_privileged`, which only the daemon's own user reaches.
const MAX_PRIVILEGED_CONNECTIONS: usize = 16;
const READY_WORD: &str = "ready";

/// What the daemon reads from its environment at start.
#[derive(Debug, Clone)]
pub struct DaemonOptions {
    pub pipe_dir: PathBuf,
    pub log_dir: PathBuf,
    pub multiuser: bool,
    pub visible_devices: Option<String>,
    /// CUDA_MPS_ACTIVE_THREAD_PERCENTAGE: the initial default, later changes have no effect.
    pub initial_percentage: Option<String>,
    /// CUDA_MPS_PINNED_DEVICE_MEM_LIMIT: the initial default limits ("daemon level" in the guide).
    pub initial_mem: Option<String>,
}

/// How the daemon was started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launch {
    Foreground,
    /// The re-executed child of `-d`: detach from the session, report readiness on stdout.
    Background,
}

/// `-d`: start the daemon as a detached child and return once it listens.
pub fn launch_background(multiuser: bool, protocol: u8) -> Result<u8> {
    let exe = std::env::current_exe().context("find own executable")?;
    let mut cmd = Command::new(&exe);
    cmd.arg("--internal-daemon");
    if multiuser {
        cmd.arg("-M");
    }
    if protocol == 3 {
        cmd.args(["-p", "3"]);
    }
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("start background daemon {}", exe.display()))?;
    let mut line = String::new();
    if let Some(out) = child.stdout.take() {
        // An error reads as "not ready"; the exit status below says what happened.
        let _ = BufReader::new(out).read_line(&mut line);
    }
    if line.trim_end() == READY_WORD {
        return Ok(0);
    }
    let status = child.wait().context("wait for background daemon")?;
    // The child already printed its error on the shared stderr.
    Ok(status
        .code()
        .and_then(|c| u8::try_from(c).ok())
        .filter(|&c| c != 0)
        .unwrap_or(1))
}

pub fn run(opts: &DaemonOptions, launch: Launch) -> Result<()> {
    let signals = block_signals()?;
    if launch == Launch::Background {
        nix::unistd::setsid().context("start a new session")?;
    }
    let socket = opts.pipe_dir.join("control");
    check_socket_path(&socket)?;
    create_dir_if_missing(&opts.pipe_dir)?;
    create_dir_if_missing(&opts.log_dir)?;
    let pid = std::process::id();
    let log = ControlLog::open(&opts.log_dir, pid)?;
    let pid_file = opts.pipe_dir.join("nvidia-cuda-mps-control.pid");
    let (listener, _lock) = match listen(&opts.pipe_dir, &socket, &pid_file, pid) {
        Ok(l) => l,
        Err(e) => {
            log.log(&format!("{e:#}"));
            return Err(e);
        }
    };
    let privileged_socket = opts.pipe_dir.join("control_privileged");
    let privileged = match opts
        .multiuser
        .then(|| listen_privileged(&privileged_socket))
        .transpose()
    {
        Ok(l) => l,
        Err(e) => {
            log.log(&format!("{e:#}"));
            return Err(e);
        }
    };

    log_started(&log, &socket, opts, 2);
    let uid = nix::unistd::getuid().as_raw();
    let gid = nix::unistd::getgid().as_raw();
    let defaults = initial_defaults(opts, &log);
    let exe = std::env::current_exe().context("find own executable")?;
    let files = DaemonFiles {
        socket,
        pid_file,
        privileged: privileged.is_some().then_some(privileged_socket),
    };
    let core = Core::new(log, exe, (uid, gid), opts.multiuser, files, defaults);

    if launch == Launch::Background {
        report_ready_and_detach()?;
    }
    spawn_signal_thread(Arc::clone(&core), signals)?;
    if let Some(privileged) = privileged {
        let privileged_core = Arc::clone(&core);
        std::thread::Builder::new()
            .name("privileged".to_string())
            .spawn(move || accept_loop(&privileged_core, &privileged, Channel::Privileged))
            .context("start the control_privileged thread")?;
    }
    accept_loop(&core, &listener, Channel::Ordinary);
    Ok(())
}

pub(crate) fn block_signals() -> Result<SigSet> {
    let mut set = SigSet::empty();
    set.add(Signal::SIGTERM);
    set.add(Signal::SIGINT);
    set.thread_block().context("block SIGTERM and SIGINT")?;
    Ok(set)
}

/// The start-up lines of `control.log`, as the real daemon writes them for `protocol` (2:
/// legacy; 3: v3, whose line says `set CUDA_MPS_PIPE_DIRECTORY` without "env"), and the
/// simulator's own line with who it runs as.
pub fn log_started(log: &ControlLog, socket: &Path, opts: &DaemonOptions, protocol: u8) {
    let (tag, env, field) = match protocol {
        3 => (" (protocol 3)", "", " protocol=3"),
        _ => ("", "env ", ""),
    };
    log.log(&format!(
        "Starting control daemon{tag} using socket {}",
        socket.display()
    ));
    log.log(&format!(
        "To connect CUDA applications to this daemon, set {env}CUDA_MPS_PIPE_DIRECTORY={}",
        opts.pipe_dir.display()
    ));
    let uid = nix::unistd::getuid().as_raw();
    let gid = nix::unistd::getgid().as_raw();
    log.log(&format!(
        "gpushare-sim: uid={uid} gid={gid} multiuser={}{field} CUDA_VISIBLE_DEVICES={}",
        opts.multiuser,
        opts.visible_devices.as_deref().unwrap_or("unset")
    ));
}

fn check_socket_path(socket: &Path) -> Result<()> {
    let len = socket.as_os_str().len();
    if len > SUN_PATH_MAX {
        bail!(
            "control socket path {} is {len} bytes, longer than the {SUN_PATH_MAX} bytes a unix socket path may have; use a shorter CUDA_MPS_PIPE_DIRECTORY",
            socket.display()
        );
    }
    Ok(())
}

pub(crate) fn create_dir_if_missing(dir: &Path) -> Result<()> {
    if dir.is_dir() {
        return Ok(());
    }
    DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .with_context(|| format!("create directory {}", dir.display()))
}

pub(crate) fn listen(
    pipe_dir: &Path,
    socket: &Path,
    pid_file: &Path,
    pid: u32,
) -> Result<(UnixListener, Flock<File>)> {
    let lock_path = pipe_dir.join("control_lock");
    let lock_file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o644)
        .open(&lock_path)
        .with_context(|| format!("open lock file {}", lock_path.display()))?;
    let lock = match Flock::lock(lock_file, FlockArg::LockExclusiveNonblock) {
        Ok(lock) => lock,
        Err((_, nix::errno::Errno::EWOULDBLOCK)) => bail!(
            "another control daemon is running on {} (lock {} is held)",
            socket.display(),
            lock_path.display()
        ),
        Err((_, e)) => {
            return Err(e).with_context(|| format!("lock {}", lock_path.display()));
        }
    };

    match std::fs::symlink_metadata(socket) {
        Ok(meta) => {
            if UnixStream::connect(socket).is_ok() {
                bail!(
                    "another control daemon is answering on {}",
                    socket.display()
                );
            }
            if !meta.file_type().is_socket() {
                bail!(
                    "{} exists and is not a socket; not replacing it",
                    socket.display()
                );
            }
            // Nothing answers: a daemon died without cleaning up. Take the path over.
            std::fs::remove_file(socket)
                .with_context(|| format!("remove stale socket {}", socket.display()))?;
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("inspect {}", socket.display())),
    }

    let listener =
        UnixListener::bind(socket).with_context(|| format!("listen on {}", socket.display()))?;
    std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o666))
        .with_context(|| format!("chmod 0666 {}", socket.display()))?;
    std::fs::write(pid_file, format!("{pid}\n"))
        .with_context(|| format!("write pid file {}", pid_file.display()))?;
    Ok((listener, lock))
}

/// `<pipe>/control_privileged`, 0755: connecting needs write permission on the socket
/// (unix(7)), so only its owner (the daemon's user) can. We hold `control_lock`, so a
/// socket already there is a dead daemon's and is replaced; anything else is refused.
fn listen_privileged(socket: &Path) -> Result<UnixListener> {
    check_socket_path(socket)?;
    match std::fs::symlink_metadata(socket) {
        Ok(meta) if meta.file_type().is_socket() => std::fs::remove_file(socket)
            .with_context(|| format!("remove stale socket {}", socket.display()))?,
        Ok(_) => bail!(
            "{} exists and is not a socket; not replacing it",
            socket.display()
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("inspect {}", socket.display())),
    }
    let listener =
        UnixListener::bind(socket).with_context(|| format!("listen on {}", socket.display()))?;
    std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o755))
        .with_context(|| format!("chmod 0755 {}", socket.display()))?;
    Ok(listener)
}

fn initial_defaults(opts: &DaemonOptions, log: &ControlLog) -> Settings {
    let percentage = match opts.initial_percentage.as_deref() {
        None | Some("") => Percentage::FULL,
        Some(text) => Percentage::parse(text).unwrap_or_else(|e| {
            log.log(&format!("ignoring CUDA_MPS_ACTIVE_THREAD_PERCENTAGE: {e}"));
            Percentage::FULL
        }),
    };
    let mem = match opts.initial_mem.as_deref() {
        None | Some("") => DeviceLimits::default(),
        Some(text) => DeviceLimits::parse(text).unwrap_or_else(|e| {
            log.log(&format!("ignoring CUDA_MPS_PINNED_DEVICE_MEM_LIMIT: {e}"));
            DeviceLimits::default()
        }),
    };
    Settings { percentage, mem }
}

/// Tells the `-d` launcher the socket listens, then points stdio at /dev/null.
pub(crate) fn report_ready_and_detach() -> Result<()> {
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "{READY_WORD}").context("report readiness to the launcher")?;
        out.flush().context("report readiness to the launcher")?;
    }
    let null = OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")
        .context("open /dev/null")?;
    nix::unistd::dup2_stdin(&null).context("redirect stdin to /dev/null")?;
    nix::unistd::dup2_stdout(&null).context("redirect stdout to /dev/null")?;
    nix::unistd::dup2_stderr(&null).context("redirect stderr to /dev/null")?;
    Ok(())
}

fn spawn_signal_thread(core: Arc<Core>, signals: SigSet) -> Result<()> {
    on_stop_signal(signals, move |sig| {
        core.log.log(&format!("Received {sig}, quitting"));
        let mut st = core.lock();
        session::quit(&core, &mut st);
    })
}

/// A thread that waits for `signals` (SIGTERM, SIGINT), runs `quit` with the one that
/// came, and ends the process, for both protocols' daemons: a signal runs the same path
/// as `quit`.
pub(crate) fn on_stop_signal(
    signals: SigSet,
    quit: impl Fn(nix::sys::signal::Signal) + Send + 'static,
) -> Result<()> {
    std::thread::Builder::new()
        .name("signals".to_string())
        .spawn(move || loop {
            if let Ok(sig) = signals.wait() {
                quit(sig);
                std::process::exit(0);
            }
        })
        .context("start signal thread")?;
    Ok(())
}

/// One connection counted against its channel's cap; released on drop, even if the
/// connection's thread panics.
struct Slot(Arc<AtomicUsize>);

impl Slot {
    fn take(active: &Arc<AtomicUsize>, max: usize) -> Option<Slot> {
        if active.fetch_add(1, Ordering::SeqCst) >= max {
            active.fetch_sub(1, Ordering::SeqCst);
            return None;
        }
        Some(Slot(Arc::clone(active)))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

fn accept_loop(core: &Arc<Core>, listener: &UnixListener, channel: Channel) {
    let max = match channel {
        Channel::Ordinary => MAX_CONNECTIONS,
        Channel::Privileged => MAX_PRIVILEGED_CONNECTIONS,
    };
    let conn_core = Arc::clone(core);
    serve_each(listener, &core.log, max, None, move |stream| {
        session::handle(Arc::clone(&conn_core), stream, channel)
    });
}

/// Accepts each connection of `listener` and serves it with `serve` on a thread of its
/// own, at most `max` at once (one more is answered "too many connections"), until
/// `closed` is set (checked at each connection), for both protocols' daemons.
pub(crate) fn serve_each(
    listener: &UnixListener,
    log: &ControlLog,
    max: usize,
    closed: Option<&std::sync::atomic::AtomicBool>,
    serve: impl Fn(UnixStream) + Send + Sync + 'static,
) {
    let active = Arc::new(AtomicUsize::new(0));
    let serve = Arc::new(serve);
    for conn in listener.incoming() {
        if closed.is_some_and(|c| c.load(Ordering::SeqCst)) {
            return;
        }
        let stream = match conn {
            Ok(s) => s,
            Err(e) => {
                log.log(&format!("accept failed: {e}"));
                // Typically EMFILE; back off instead of spinning on the same error.
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        let Some(slot) = Slot::take(&active, max) else {
            let _ = (&stream).write_all(b"ERR\ntoo many connections\n");
            continue;
        };
        let serve = Arc::clone(&serve);
        let spawned = std::thread::Builder::new()
            .name("connection".to_string())
            .spawn(move || {
                let _slot = slot;
                serve(stream);
            });
        if let Err(e) = spawned {
            log.log(&format!("cannot start connection thread: {e}"));
        }
    }
}
