//! The one module with `unsafe`: code that must run in a forked child before exec.
//!
//! Everything here runs between fork and exec of a child of a (single-threaded)
//! supervisor, where only async-signal-safe calls are allowed: plain syscalls through nix,
//! no allocation, no locks.

use std::os::unix::process::CommandExt;
use std::process::Command;

use nix::sys::signal::Signal;

/// Makes the child die with its parent (so a killed supervisor never leaves an orphaned
/// daemon holding the socket) and unable to gain privileges through exec
/// (`no_new_privs`: setuid binaries and file capabilities are inert).
pub fn harden_child(cmd: &mut Command, parent: nix::unistd::Pid) {
    // SAFETY: the closure runs in the forked child before exec and only makes
    // async-signal-safe syscalls (prctl, getppid); it allocates nothing but the
    // error for the parent-gone case, after which the child only reports and exits.
    unsafe {
        cmd.pre_exec(move || {
            nix::sys::prctl::set_pdeathsig(Signal::SIGKILL)?;
            // The parent may have died before prctl took effect: then die now.
            if nix::unistd::getppid() != parent {
                return Err(std::io::Error::other("parent exited before exec"));
            }
            nix::sys::prctl::set_no_new_privs()?;
            Ok(())
        });
    }
}
