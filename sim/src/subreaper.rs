//! `subreaper <command> [args…]`: a stand-in for an engine that is a child subreaper and
//! waits for what it adopted before it exits, as conmon 2.1.12 does (`do_wait`). It marks
//! itself a child subreaper (`PR_SET_CHILD_SUBREAPER`), runs the command, then reaps until
//! it has no child left — every process an orphan left to it included — and exits with
//! the command's status. A test that runs a container's create and start under it learns
//! whether anything a hook left behind would keep such an engine waiting.

use std::process::Command;

use anyhow::Context;
use nix::errno::Errno;
use nix::sys::wait::waitpid;

pub fn run(command: &[String]) -> anyhow::Result<u8> {
    let (program, args) = command
        .split_first()
        .context("subreaper needs a command to run")?;
    nix::sys::prctl::set_child_subreaper(true).context("become a child subreaper")?;
    let status = Command::new(program)
        .args(args)
        .status()
        .with_context(|| format!("run {program}"))?;
    loop {
        match waitpid(None, None) {
            Ok(_) | Err(Errno::EINTR) => continue,
            Err(Errno::ECHILD) => break,
            Err(e) => return Err(e).context("wait for adopted processes"),
        }
    }
    Ok(status.code().map_or(1, |c| c as u8))
}
