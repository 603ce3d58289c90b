//! The v3 CLI call (`gpushare-mps-sim <module> <verb> …`): sends the words to
//! `$CUDA_MPS_PIPE_DIRECTORY/control` (the main socket, a server's or a namespace's: each
//! answers CLI calls) and prints the answer.
//!
//! Output: the answer on stdout and exit 0; an error as one line on stderr and exit 1
//! (NVIDIA's docs leave exit codes and error formats open; NVIDIA's KAI agent treats a
//! non-zero exit as the error). `Cannot find MPS control daemon process` where nothing
//! answers. A legacy daemon does not know the grammar: NVIDIA's MPS v3 interface page says a
//! CLI call follows the running daemon's protocol, so the call fails and says so.
//!
//! Invariant: a word with a control character is refused here, so the tab-separated wire
//! line always splits back into the same words.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use crate::control_client::NO_DAEMON;
use crate::wire;

use super::daemon::CLI_WORD;
use super::grammar::{self, Command};

const REPLY_TIMEOUT: Duration = Duration::from_secs(60);
const MAX_REPLY: u64 = 1 << 20;

fn fail(msg: &str) -> u8 {
    eprintln!("{}", msg.trim_end());
    1
}

pub fn run(pipe_dir: &Path, words: &[String]) -> u8 {
    if let Some(w) = words.iter().find(|w| w.chars().any(char::is_control)) {
        return fail(&format!("argument {w:?} holds a control character"));
    }
    match grammar::parse(words) {
        Ok(Command::Help(text)) => {
            print!("{text}");
            return 0;
        }
        Ok(_) => {}
        Err(e) => return fail(&e.to_string()),
    }
    let socket = pipe_dir.join("control");
    let Ok(mut stream) = UnixStream::connect(&socket) else {
        return fail(NO_DAEMON);
    };
    let mut line = CLI_WORD.to_string();
    for w in words {
        line.push('\t');
        line.push_str(w);
    }
    line.push('\n');
    if let Err(e) = stream.write_all(line.as_bytes()) {
        return fail(&format!(
            "cannot send the command to the MPS control daemon: {e}"
        ));
    }
    let _ = stream.set_read_timeout(Some(REPLY_TIMEOUT));
    let mut reply = Vec::new();
    if let Err(e) = (&mut stream).take(MAX_REPLY).read_to_end(&mut reply) {
        return fail(&format!("no answer from the MPS control daemon: {e}"));
    }
    let text = String::from_utf8_lossy(&reply);
    match wire::parse_control_reply(&text) {
        Ok(Ok(body)) => {
            let mut out = std::io::stdout().lock();
            let _ = out.write_all(body.as_bytes());
            let _ = out.flush();
            0
        }
        Ok(Err(body)) if body.starts_with(&format!("unrecognized command \"{CLI_WORD}")) => fail(
            &format!(
                "the MPS control daemon at {} runs protocol 2 (legacy); '{}' needs a protocol 3 daemon",
                pipe_dir.display(),
                words.iter().take(2).cloned().collect::<Vec<_>>().join(" ")
            ),
        ),
        Ok(Err(body)) => fail(&body),
        Err(e) => fail(&format!("malformed answer from the MPS control daemon: {e}")),
    }
}
