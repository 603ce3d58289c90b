//! The daemon's output and logs, kept bounded: `daemon.out` (its stdout and stderr) in the
//! root-owned daemon directory, and MPS's `control.log` and `server.log` in its log tmpfs.
//!
//! Invariants: the supervisor (root) never writes through a name a tenant could have
//! planted: `daemon.out` is opened with `O_NOFOLLOW` and only as a regular file, and the
//! log directory, which the daemon's user can write, is touched only through a directory
//! fd, every open relative to it with `O_NOFOLLOW` and `O_NONBLOCK`. A log past its bound
//! (a quarter of `mps.log-size`; `DAEMON_OUT_MAX` for `daemon.out`) keeps its last half in
//! `<name>.1` and is emptied in place.

use std::io::Read;
use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context};

use super::context::Supervisor;

/// The daemon's stdout and stderr, in its root-owned directory.
pub(crate) const DAEMON_OUT: &str = "daemon.out";

/// The largest `daemon.out` kept (it lives on the state dir's file system, not in the
/// daemon's sized log tmpfs).
const DAEMON_OUT_MAX: u64 = 1 << 20;

/// How often the supervisor looks at the daemon's log sizes.
pub(super) const ROTATE_EVERY: Duration = Duration::from_secs(1);

/// Opens `<daemon dir>/daemon.out`, the daemon's stdout and stderr. It lives in the
/// root-owned daemon directory, not in the log directory the daemon's user can write, and
/// is opened without following a link and only if it is a regular file: a root process
/// never writes through a name a tenant could have planted.
pub(super) fn open_daemon_out(daemon_dir: &Path) -> anyhow::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    let path = daemon_dir.join(DAEMON_OUT);
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o640)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK)
        .open(&path)
        .with_context(|| format!("open the daemon's output file {}", path.display()))?;
    if !file.metadata()?.is_file() {
        bail!(
            "{} is not a regular file; refusing to write to it",
            path.display()
        );
    }
    Ok(file)
}

/// Keeps one log file under `max` bytes: past it, its content moves to `<name>.1` and the
/// file is emptied in place (the daemon keeps its descriptor, opened for appending, and
/// goes on at the new end). Every open is relative to `dir`, refuses links
/// (`O_NOFOLLOW`) and anything but a regular file, and never blocks (`O_NONBLOCK`): the
/// log directory is writable by the daemon's user, so a planted name is never followed.
fn rotate(dir: &std::os::fd::OwnedFd, name: &str, max: u64) -> anyhow::Result<bool> {
    use nix::fcntl::{openat, OFlag};
    use nix::sys::stat::{fstat, Mode, SFlag};
    let nofollow = OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC;
    let log = match openat(dir, name, OFlag::O_RDWR | nofollow, Mode::empty()) {
        Ok(fd) => std::fs::File::from(fd),
        Err(nix::errno::Errno::ENOENT) => return Ok(false),
        Err(e) => return Err(e).with_context(|| format!("open {name}")),
    };
    let st = fstat(&log)?;
    if SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT != SFlag::S_IFREG
        || (st.st_size as u64) <= max
    {
        return Ok(false);
    }
    let old = format!("{name}.1");
    let _ = nix::unistd::unlinkat(dir, old.as_str(), nix::unistd::UnlinkatFlags::NoRemoveDir);
    let to = openat(
        dir,
        old.as_str(),
        OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | nofollow,
        Mode::from_bits_truncate(0o640),
    )
    .with_context(|| format!("create {old}"))?;
    let mut to = std::fs::File::from(to);
    let mut from = &log;
    // Only the last `max / 2` bytes are kept: what the daemon said most recently.
    std::io::Seek::seek(
        &mut from,
        std::io::SeekFrom::Start(st.st_size as u64 - max / 2),
    )?;
    std::io::copy(&mut (&log).take(max / 2), &mut to)?;
    log.set_len(0)?;
    Ok(true)
}

impl Supervisor {
    /// Keeps the daemon's logs bounded: `control.log` and `server.log` in its log tmpfs
    /// (a quarter of `mps.log-size` each, plus the kept half in `.1`), and `daemon.out`.
    pub(super) fn rotate_logs(&self) {
        let dirs = [
            (
                self.state.log_dir(&self.id),
                &["control.log", "server.log"][..],
                self.log_size / 4,
            ),
            (
                self.state.daemon_dir(&self.id),
                &[DAEMON_OUT][..],
                DAEMON_OUT_MAX,
            ),
        ];
        for (dir, names, max) in dirs {
            let Ok(fd) = nix::fcntl::open(
                &dir,
                nix::fcntl::OFlag::O_DIRECTORY
                    | nix::fcntl::OFlag::O_NOFOLLOW
                    | nix::fcntl::OFlag::O_CLOEXEC,
                nix::sys::stat::Mode::empty(),
            ) else {
                continue;
            };
            for name in names {
                match rotate(&fd, name, max) {
                    Ok(true) => tracing::info!(daemon = %self.id, file = %name, "log rotated"),
                    Ok(false) => {}
                    Err(e) => {
                        tracing::warn!(daemon = %self.id, file = %name, error = %format!("{e:#}"), "cannot rotate a log")
                    }
                }
            }
        }
    }
}
