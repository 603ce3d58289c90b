//! Control client mode (no option): read commands line by line from stdin, send each to
//! `<pipe>/control` on its own connection, print each answer on stdout.
//!
//! Exit codes, as tools expect from `nvidia-cuda-mps-control`: 1 with the exact line
//! `Cannot find MPS control daemon process` when the daemon cannot be reached (wrappers key on
//! that string); 1 at the end when any command was answered with an error; 0 otherwise.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use crate::wire;

pub const NO_DAEMON: &str = "Cannot find MPS control daemon process";
/// Longest a command may take to answer; `quit` waits for the server to stop (a few seconds).
const REPLY_TIMEOUT: Duration = Duration::from_secs(60);
/// Answers are small; this bounds memory if something else listens on the socket.
const MAX_REPLY: u64 = 1 << 20;

enum SendError {
    Unreachable,
    Broken(String),
}

pub fn run(pipe_dir: &Path) -> u8 {
    run_from(pipe_dir, &mut std::io::stdin().lock())
}

/// `-q`/`--quit`: "Quit and stop the control daemon and all running servers" (NVIDIA's MPS
/// v3 interface page, options): the `quit` command, sent as control client mode sends it.
pub fn quit(pipe_dir: &Path) -> u8 {
    run_from(pipe_dir, &mut &b"quit\n"[..])
}

/// Sends each line of `input` as a command.
fn run_from(pipe_dir: &Path, input: &mut impl std::io::BufRead) -> u8 {
    let socket = pipe_dir.join("control");
    let mut failed = false;
    loop {
        let line = match wire::read_line(input) {
            Ok(Some(line)) => line,
            Ok(None) => break,
            Err(e) => {
                eprintln!("gpushare-mps-sim: read command from stdin: {e}");
                return 1;
            }
        };
        let command = line.trim();
        if command.is_empty() {
            continue;
        }
        match send(&socket, command) {
            Ok(Ok(body)) => print(&body),
            Ok(Err(body)) => {
                print(&body);
                failed = true;
            }
            Err(SendError::Unreachable) => {
                print(&format!("{NO_DAEMON}\n"));
                return 1;
            }
            Err(SendError::Broken(msg)) => {
                eprintln!("gpushare-mps-sim: command {command:?}: {msg}");
                return 1;
            }
        }
    }
    u8::from(failed)
}

fn print(text: &str) {
    let mut out = std::io::stdout().lock();
    // A closed stdout (`… | head`) is the reader's choice, not an error to report.
    let _ = out.write_all(text.as_bytes());
    let _ = out.flush();
}

fn send(socket: &Path, command: &str) -> Result<Result<String, String>, SendError> {
    let mut stream = UnixStream::connect(socket).map_err(|_| SendError::Unreachable)?;
    stream
        .write_all(format!("{command}\n").as_bytes())
        .map_err(|e| SendError::Broken(format!("send failed: {e}")))?;
    stream
        .set_read_timeout(Some(REPLY_TIMEOUT))
        .map_err(|e| SendError::Broken(format!("set timeout: {e}")))?;
    let mut reply = Vec::new();
    (&mut stream)
        .take(MAX_REPLY)
        .read_to_end(&mut reply)
        .map_err(|e| SendError::Broken(format!("no answer from the control daemon: {e}")))?;
    let text = String::from_utf8_lossy(&reply);
    wire::parse_control_reply(&text).map_err(|e| SendError::Broken(e.to_string()))
}
