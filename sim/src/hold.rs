//! `hold-control <connections> [--every <s>]`: a stand-in for a hostile tenant that jams a
//! daemon's `<pipe>/control`. It keeps that many connections open, each with a command
//! line that never ends: one byte on connecting, then one more every `--every` seconds
//! (default 1.5), so a daemon that times out a silent peer keeps waiting. A connection the
//! daemon closes (it refused it, or the daemon was restarted) is opened again at the next
//! tick. Prints `holding <n>` whenever the number held changes; runs until killed.

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

pub fn run(pipe_dir: &Path, connections: usize, every: Duration) -> anyhow::Result<u8> {
    let socket = pipe_dir.join("control");
    let mut held: Vec<UnixStream> = Vec::new();
    let mut shown = None;
    loop {
        held.retain(|mut c| c.write_all(b"e").is_ok());
        while held.len() < connections {
            let Ok(mut c) = UnixStream::connect(&socket) else {
                break;
            };
            if c.write_all(b"g").is_ok() {
                held.push(c);
            }
        }
        if shown != Some(held.len()) {
            shown = Some(held.len());
            println!("holding {}", held.len());
            std::io::stdout().flush()?;
        }
        std::thread::sleep(every);
    }
}
