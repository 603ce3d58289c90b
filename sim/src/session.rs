//! One connection to `<pipe>/control`, on its own thread: read the first line, then either
//! answer a control command or serve a stand-in CUDA client (wire protocol in `wire`). A
//! connection to `<pipe>/control_privileged` (multi-user mode) answers control commands only.
//!
//! Who may change what, as NVIDIA's multi-user daemon answered a UID-1000 client on driver
//! 580.159.04 (docs/gpu-validation.md): through `control`, a peer that is neither root nor
//! the daemon's user is refused `set_*`, `shutdown_server` and `quit` in multi-user mode and
//! may still read; a per-user daemon refuses nothing (its clients are its own user).
//!
//! Invariants: a peer that sends nothing is dropped after [`FIRST_LINE_TIMEOUT`]; a connect
//! and close with no line (a liveness probe, or a second daemon checking for a live one) is
//! not logged; a CUDA client's identity is taken from SO_PEERCRED only; a queued client that
//! hangs up leaves the queue within [`QUEUE_POLL`], so it cannot block the users behind it;
//! a client is detached exactly when its connection closes.

use std::io::{BufReader, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::Duration;

use nix::errno::Errno;
use nix::sys::socket::{getsockopt, recv, sockopt, MsgFlags};

use crate::control::{self, Command};
use crate::sched::{ClientInfo, Core};
use crate::wire::{self, Hello, Ready, WireError, HELLO_WORD};

pub const FIRST_LINE_TIMEOUT: Duration = Duration::from_secs(5);
const QUEUE_POLL: Duration = Duration::from_millis(200);

/// Which socket a connection came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Channel {
    /// `control`: every uid's CUDA clients and control clients.
    Ordinary,
    /// `control_privileged`: the daemon's own user's (root's) control clients only.
    Privileged,
}

/// The first line a peer sends, waited for `FIRST_LINE_TIMEOUT` at most: `Ok(None)` when
/// it closed first, else the error to answer it with (both protocols' sessions).
pub fn first_line(stream: &UnixStream) -> Result<Option<String>, String> {
    let _ = stream.set_read_timeout(Some(FIRST_LINE_TIMEOUT));
    let mut reader = BufReader::new(stream);
    match wire::read_line(&mut reader) {
        Ok(line) => Ok(line),
        Err(WireError::Io(e))
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            Err(format!(
                "no command received within {} s",
                FIRST_LINE_TIMEOUT.as_secs()
            ))
        }
        Err(e) => Err(e.to_string()),
    }
}

pub fn handle(core: Arc<Core>, stream: UnixStream, channel: Channel) {
    let peer = getsockopt(&stream, sockopt::PeerCredentials).map(|c| c.uid());
    let own = |uid: u32| uid == 0 || uid == core.uid;
    if channel == Channel::Privileged && !peer.is_ok_and(own) {
        // The socket's mode already keeps others out; this holds even if it did not.
        let msg = "control_privileged serves only the daemon's own user".to_string();
        let _ = (&stream).write_all(wire::control_reply(&Err(msg)).as_bytes());
        return;
    }
    let line = match first_line(&stream) {
        Ok(Some(line)) => line,
        Ok(None) => return,
        Err(msg) => {
            let _ = (&stream).write_all(wire::control_reply(&Err(msg)).as_bytes());
            return;
        }
    };
    let is_hello = line.split_whitespace().next() == Some(HELLO_WORD);
    match (is_hello, channel) {
        (true, Channel::Ordinary) => cuda_client(&core, &stream, &line),
        (true, Channel::Privileged) => {
            let msg = "CUDA clients connect to control, not control_privileged".to_string();
            let _ = (&stream).write_all(wire::control_reply(&Err(msg)).as_bytes());
        }
        (false, _) => {
            let trusted = channel == Channel::Privileged || !core.multiuser;
            control_command(
                &core,
                &stream,
                &line,
                peer.ok().filter(|&u| !trusted && !own(u)),
            );
        }
    }
}

/// The driver's refusal of a command that changes the daemon, for a peer of `uid` that is
/// neither root nor the daemon's user (multi-user mode); `None` for a command anyone may send.
fn refusal(cmd: &Command, uid: u32) -> Option<String> {
    match cmd {
        Command::Quit => Some("Not enough privilege to execute quit command".to_string()),
        Command::SetDefaultPercentage(_)
        | Command::SetPercentage { .. }
        | Command::SetDefaultMem { .. }
        | Command::SetMem { .. }
        | Command::ShutdownServer { .. } => Some(format!(
            "Insufficient privileges for UID {uid}. Control deamon settings can only be modified by the user who started it or by the root user."
        )),
        _ => None,
    }
}

/// Answers one control command; `outsider` is the uid of a peer whose changes are refused.
fn control_command(core: &Arc<Core>, mut stream: &UnixStream, line: &str, outsider: Option<u32>) {
    core.log.log("NEW UI");
    core.log.log(&format!("Cmd:{line}"));
    let allowed = control::parse(line)
        .map_err(|e| e.to_string())
        .and_then(|cmd| match outsider.and_then(|uid| refusal(&cmd, uid)) {
            Some(msg) => Err(msg),
            None => Ok(cmd),
        });
    let result = match allowed {
        Err(e) => Err(e),
        Ok(Command::Quit) => {
            let mut st = core.lock();
            quit(core, &mut st);
            // Answer only after the socket and pid file are gone, so `echo quit | …`
            // returning means the daemon is done; the lock stays held until exit so no
            // other connection can start a server meanwhile.
            let _ = stream.write_all(wire::control_reply(&Ok(String::new())).as_bytes());
            let _ = stream.shutdown(std::net::Shutdown::Both);
            std::process::exit(0);
        }
        Ok(cmd) => {
            let mut st = core.lock();
            control::execute(core, &mut st, cmd)
        }
    };
    let _ = stream.write_all(wire::control_reply(&result).as_bytes());
    core.log.log("UI closed");
}

/// What `quit` and SIGTERM do: stop the server, remove the socket and pid file, log `Exit`.
/// The caller exits the process afterwards.
pub fn quit(core: &Core, st: &mut crate::sched::State) {
    core.shut_down(st);
    let _ = std::fs::remove_file(&core.files.socket);
    if let Some(privileged) = &core.files.privileged {
        let _ = std::fs::remove_file(privileged);
    }
    let _ = std::fs::remove_file(&core.files.pid_file);
    core.log.log("Exit");
}

fn send(mut stream: &UnixStream, line: &str) -> bool {
    stream.write_all(format!("{line}\n").as_bytes()).is_ok()
}

fn cuda_client(core: &Arc<Core>, stream: &UnixStream, line: &str) {
    let creds = match getsockopt(stream, sockopt::PeerCredentials) {
        Ok(c) => c,
        Err(e) => {
            send(stream, &format!("ERROR cannot read peer credentials: {e}"));
            return;
        }
    };
    let hello = match Hello::parse(line) {
        Ok(h) => h,
        Err(e) => {
            send(stream, &format!("ERROR {e}"));
            return;
        }
    };
    let client = ClientInfo {
        pid: creds.pid(),
        uid: creds.uid(),
        gid: creds.gid(),
        namespace: pid_namespace(creds.pid()),
        command: command_of(creds.pid()),
        conn: stream.try_clone().ok().map(Arc::new),
    };
    let (server_uid, _) = core.server_identity(client.uid, client.gid);
    if let Err(msg) = core.check_can_serve(server_uid) {
        send(stream, &format!("ERROR {msg}"));
        return;
    }

    let mut st = core.lock();
    if st.quitting {
        drop(st);
        send(stream, "ERROR control daemon is shutting down");
        return;
    }
    let ticket = core.enqueue(&mut st, client);
    let mut told_queued = false;
    let admission = loop {
        if let Some(outcome) = core.take_admission(&mut st, ticket) {
            break outcome;
        }
        if !told_queued {
            told_queued = true;
            send(stream, "QUEUED");
        }
        st = core.wait(st, QUEUE_POLL);
        if peer_gone(stream) {
            core.forget(&mut st, ticket);
            return;
        }
    };
    drop(st);

    let admission = match admission {
        Ok(a) => a,
        Err(msg) => {
            send(stream, &format!("ERROR {msg}"));
            return;
        }
    };
    let ready = Ready {
        server_pid: admission.server_pid,
        server_uid: admission.server_uid,
        waited_ms: u64::try_from(admission.waited.as_millis()).unwrap_or(u64::MAX),
        percentage: admission.settings.percentage.lowered_by(hello.percentage),
        mem: admission.settings.mem.lowered_by(&hello.mem),
        names: None,
    };
    if send(stream, &ready.to_line()) {
        wait_for_close(stream);
    }
    let mut st = core.lock();
    core.forget(&mut st, ticket);
}

/// Whether a queued client hung up; it sends nothing after its first line, so readable data
/// is ignored and only end of stream or an error counts.
fn peer_gone(stream: &UnixStream) -> bool {
    let mut byte = [0u8; 1];
    match recv(
        stream.as_raw_fd(),
        &mut byte,
        MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT,
    ) {
        Ok(0) => true,
        Ok(_) => false,
        Err(Errno::EAGAIN) | Err(Errno::EINTR) => false,
        Err(_) => true,
    }
}

pub(crate) fn wait_for_close(mut stream: &UnixStream) {
    let _ = stream.set_read_timeout(None);
    let mut sink = [0u8; 256];
    loop {
        match stream.read(&mut sink) {
            Ok(0) => return,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => return,
        }
    }
}

fn pid_namespace(pid: i32) -> u64 {
    std::fs::metadata(format!("/proc/{pid}/ns/pid")).map_or(0, |m| m.ino())
}

pub(crate) fn command_of(pid: i32) -> String {
    let from_cmdline = std::fs::read(format!("/proc/{pid}/cmdline"))
        .ok()
        .and_then(|raw| {
            raw.split(|&b| b == 0)
                .next()
                .filter(|arg0| !arg0.is_empty())
                .map(|arg0| String::from_utf8_lossy(arg0).into_owned())
        });
    let name = from_cmdline
        .or_else(|| {
            std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .ok()
                .map(|c| c.trim_end().to_string())
        })
        .unwrap_or_else(|| "?".to_string());
    name.chars()
        .map(|c| if c.is_control() { '?' } else { c })
        .collect()
}
