//! The v3 control daemon process (`-p 3 -f`/`-d`): startup, its sockets and their accept
//! threads, one connection per thread (a CLI call, a stand-in CUDA client, or the legacy
//! `quit`), `quit` on stdin under `-f`, and the server processes.
//!
//! Startup as the legacy daemon's (the lock, the stale socket, the pid file, 0666), except
//! that a `<pipe>/control` that does not fit `sun_path` makes it print only
//! `Failed to initialize MPS control daemon` and write no log, as measured on r615 by
//! NVIDIA's KAI GPU-fractioning agent.
//!
//! Invariants:
//! - every state change happens under the one mutex ([`Core::lock`]);
//! - each socket has its own connection cap, so a tenant flooding its own namespace socket
//!   takes no slot of the main socket or of another namespace;
//! - a peer's uid and pid come from SO_PEERCRED only; the words of a CLI call are parsed by
//!   the daemon again (the CLI's own parse is a courtesy);
//! - a v3 server is one process that serves every namespace and uid at once, with no queue
//!   between uids (NVIDIA's MPS v3 interface page; concurrent UIDs measured on r615 by
//!   NVIDIA's KAI agent);
//! - `quit` removes every socket and the pid file and leaves the directories, so a daemon
//!   started again binds its sockets in the same directory inodes.

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use anyhow::{Context, Result};
use nix::sys::socket::{getsockopt, sockopt};

use crate::daemon::{self as legacy, DaemonOptions, Launch};
use crate::log::ControlLog;
use crate::session::{command_of, first_line, wait_for_close};
use crate::wire::{self, Hello, HELLO_WORD};

use super::commands;
use super::layout::{self, BARE_FAILURE};
use super::listen::accept_loop;
pub use super::listen::{Core, Route};
use super::state::State;

/// The first word of a CLI call on the wire; the call's words follow, tab-separated.
pub const CLI_WORD: &str = "V3CLI";
const MAX_TOP_CONNECTIONS: usize = 512;

pub fn run(opts: &DaemonOptions, launch: Launch) -> Result<u8> {
    let signals = legacy::block_signals()?;
    if launch == Launch::Background {
        nix::unistd::setsid().context("start a new session")?;
    }
    let socket = layout::socket_in(&opts.pipe_dir);
    if layout::check_fits(&socket).is_err() {
        eprintln!("{BARE_FAILURE}");
        return Ok(1);
    }
    legacy::create_dir_if_missing(&opts.pipe_dir)?;
    legacy::create_dir_if_missing(&opts.log_dir)?;
    let pid = std::process::id();
    let log = ControlLog::open(&opts.log_dir, pid)?;
    let pid_file = opts.pipe_dir.join("nvidia-cuda-mps-control.pid");
    let (listener, _lock) = match legacy::listen(&opts.pipe_dir, &socket, &pid_file, pid) {
        Ok(l) => l,
        Err(e) => {
            log.log(&format!("{e:#}"));
            return Err(e);
        }
    };
    legacy::log_started(&log, &socket, opts, 3);
    let core = Arc::new(Core {
        log,
        log_dir: opts.log_dir.clone(),
        pipe: opts.pipe_dir.clone(),
        exe: std::env::current_exe().context("find own executable")?,
        uid: nix::unistd::getuid().as_raw(),
        multiuser: opts.multiuser,
        top_socket: socket,
        pid_file,
        serve: handle,
        state: Mutex::new(State::default()),
    });
    if launch == Launch::Background {
        legacy::report_ready_and_detach()?;
    }
    spawn_signal_thread(Arc::clone(&core), signals)?;
    if launch == Launch::Foreground {
        spawn_stdin_thread(Arc::clone(&core))?;
    }
    accept_loop(
        &core,
        &Arc::new(listener),
        &Arc::new(AtomicBool::new(false)),
        &Route::Top,
        MAX_TOP_CONNECTIONS,
    );
    Ok(0)
}

fn spawn_signal_thread(core: Arc<Core>, signals: nix::sys::signal::SigSet) -> Result<()> {
    legacy::on_stop_signal(signals, move |sig| {
        core.log.log(&format!("Received {sig}, quitting"));
        let mut st = core.lock();
        quit(&core, &mut st);
    })
}

/// NVIDIA's KAI agent runs `-p 3 -m -f` and stops it by writing `quit` to its stdin. The end
/// of stdin is not a quit (a daemon started with stdin on /dev/null runs on).
fn spawn_stdin_thread(core: Arc<Core>) -> Result<()> {
    std::thread::Builder::new()
        .name("stdin".to_string())
        .spawn(move || {
            let mut input = std::io::stdin().lock();
            while let Ok(Some(line)) = wire::read_line(&mut input) {
                if is_quit(line.trim()) {
                    core.log.log("Cmd:quit (stdin)");
                    let mut st = core.lock();
                    quit(&core, &mut st);
                    std::process::exit(0);
                }
                core.log.log(&format!(
                    "ignoring {:?} on stdin: only quit is read there",
                    line.trim()
                ));
            }
        })
        .context("start stdin thread")?;
    Ok(())
}

fn is_quit(line: &str) -> bool {
    let words: Vec<&str> = line.split_whitespace().collect();
    match words.as_slice() {
        ["quit"] => true,
        ["quit", "-t", t] => t.parse::<u32>().is_ok(),
        _ => false,
    }
}

fn reply(mut stream: &UnixStream, result: &Result<String, String>) {
    let _ = stream.write_all(wire::control_reply(result).as_bytes());
}

fn handle(core: &Arc<Core>, stream: UnixStream, route: &Route) {
    let creds = getsockopt(&stream, sockopt::PeerCredentials);
    let line = match first_line(&stream) {
        Ok(Some(line)) => line,
        Ok(None) => return,
        Err(msg) => {
            reply(&stream, &Err(msg));
            return;
        }
    };

    let Ok(creds) = creds else {
        reply(&stream, &Err("cannot read peer credentials".to_string()));
        return;
    };
    let first = line.split_whitespace().next().unwrap_or("");
    if first == HELLO_WORD {
        cuda_client(core, &stream, &line, route, creds);
        return;
    }
    core.log.log("NEW UI");
    let result = if let Some(rest) = line.strip_prefix(CLI_WORD) {
        let words: Vec<String> = rest.split('\t').skip(1).map(String::from).collect();
        core.log.log(&format!("Cmd:{}", words.join(" ")));
        match super::grammar::parse(&words) {
            Err(e) => Err(e.to_string()),
            Ok(cmd) => {
                let mut st = core.lock();
                commands::execute(core, &mut st, cmd, creds.uid())
            }
        }
    } else if is_quit(line.trim()) {
        core.log.log(&format!("Cmd:{line}"));
        let uid = creds.uid();
        if uid != 0 && uid != core.uid {
            // NVIDIA's docs do not say whether a non-owner may quit a v3 daemon: the
            // simulator refuses it, like every other change from a non-owner.
            Err(commands::refusal(uid, "QUIT"))
        } else {
            let mut st = core.lock();
            quit(core, &mut st);
            reply(&stream, &Ok(String::new()));
            let _ = stream.shutdown(std::net::Shutdown::Both);
            std::process::exit(0);
        }
    } else {
        core.log.log(&format!("Cmd:{line}"));
        Err(format!(
            "{first}: this control daemon runs protocol 3, which takes <module> <verb> commands (and quit), not legacy commands"
        ))
    };
    reply(&stream, &result);
    core.log.log("UI closed");
}

fn send(mut stream: &UnixStream, line: &str) -> bool {
    stream.write_all(format!("{line}\n").as_bytes()).is_ok()
}

fn cuda_client(
    core: &Arc<Core>,
    stream: &UnixStream,
    line: &str,
    route: &Route,
    creds: nix::sys::socket::UnixCredentials,
) {
    let hello = match Hello::parse(line) {
        Ok(h) => h,
        Err(e) => {
            send(stream, &format!("ERROR {e}"));
            return;
        }
    };
    let client = commands::NewClient {
        pid: creds.pid(),
        uid: creds.uid(),
        command: command_of(creds.pid()),
        conn: stream.try_clone().ok().map(Arc::new),
    };
    let attached = {
        let mut st = core.lock();
        commands::attach(core, &mut st, route, client, &hello)
    };
    let (ticket, ready) = match attached {
        Ok(a) => a,
        Err(msg) => {
            send(stream, &format!("ERROR {msg}"));
            return;
        }
    };
    if send(stream, &ready.to_line()) {
        wait_for_close(stream);
    }
    let mut st = core.lock();
    if st.detach(ticket) {
        core.log
            .log(&format!("Client {} disconnected", creds.pid()));
    }
}

/// What `quit` and SIGTERM do: stop every server, remove every socket and the pid file,
/// log `Exit`. The caller exits the process afterwards.
pub fn quit(core: &Core, st: &mut State) {
    st.quitting = true;
    for (name, server) in std::mem::take(&mut st.servers) {
        for ns in server.namespaces.values() {
            ns.listening.close();
        }
        server.listening.close();
        if let Some(process) = server.process {
            commands::log_stopped(core, &name, process.pid(), process.stop());
        }
    }
    let _ = std::fs::remove_file(&core.top_socket);
    let _ = std::fs::remove_file(&core.pid_file);
    core.log.log("Exit");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quit_lines() {
        assert!(is_quit("quit"));
        assert!(is_quit("quit -t 5"));
        assert!(!is_quit("quit now"));
        assert!(!is_quit("get_server_list"));
    }
}
