//! Small helpers without a better home: time formatting, polling with a deadline, atomic
//! file writes, process identity through /proc, the lookup of a program on a `PATH`, and
//! the removal of trees a tenant may have planted.
//!
//! Invariant of the polling (`poll_until`): it never sleeps past its deadline, and it asks
//! once more at the deadline, so a condition met during the last pause is not missed.
//!
//! Invariant of the lookup (`find_executable`): only a regular file (after links) with
//! an exec bit is found; a directory or a non-executable file of the name is passed
//! over, as execvp passes it over.
//!
//! Invariants of the removal (`remove_all`, `remove_contents`): a symlink is unlinked,
//! never followed or entered; every directory is opened relative to its parent's fd with
//! O_NOFOLLOW, never by path, and never through `..`; at most `HELD_DIRS` + 2 fds are
//! open at once whatever the depth or width of the tree; the walk never leaves the file
//! system of the top directory; an entry that vanishes meanwhile is fine.

use std::ffi::{CStr, CString, OsStr};
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use nix::dir::{Dir, Type};
use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, RenameFlags};
use nix::sys::stat::{Mode, SFlag};
use nix::unistd::UnlinkatFlags;

/// RFC 3339 UTC time with milliseconds, e.g. `2026-11-21T21:05:16.123Z`. humantime writes
/// only years 1970 to 9999 (and panics outside them): a time before is written as the
/// first instant of 1970, one after as the last of 9999.
pub(crate) fn rfc3339(t: SystemTime) -> String {
    const LAST: Duration = Duration::from_millis(253_402_300_799_999);
    humantime::format_rfc3339_millis(t.clamp(UNIX_EPOCH, UNIX_EPOCH + LAST)).to_string()
}

pub(crate) fn rfc3339_now() -> String {
    rfc3339(SystemTime::now())
}

/// Waits up to `grace` (polling every 10 ms) for `child` to exit by itself, then kills it;
/// reaps it either way. The tail of every "ask it to stop, then make sure" in gpushare.
pub(crate) fn wait_or_kill(child: &mut std::process::Child, grace: Duration) {
    let every = Duration::from_millis(10);
    let exited = poll_until(Instant::now() + grace, every, every, || {
        matches!(child.try_wait(), Ok(Some(_))).then_some(())
    });
    if exited.is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// Calls `f` until it returns `Some`, and returns that; `None` once `deadline` has passed
/// without an answer. Between calls it sleeps `first_pause`, doubled after each call up to
/// `max_pause` (equal pauses poll at a fixed rate), and never past `deadline`: the last
/// call is made at the deadline, and a deadline already past means exactly one call.
pub(crate) fn poll_until<T>(
    deadline: Instant,
    first_pause: Duration,
    max_pause: Duration,
    f: impl FnMut() -> Option<T>,
) -> Option<T> {
    poll_with(deadline, first_pause, max_pause, f, std::thread::sleep)
}

/// `poll_until` with the sleep passed in, so a test can see the pauses it asks for.
fn poll_with<T>(
    deadline: Instant,
    first_pause: Duration,
    max_pause: Duration,
    mut f: impl FnMut() -> Option<T>,
    mut sleep: impl FnMut(Duration),
) -> Option<T> {
    let mut pause = first_pause.min(max_pause);
    loop {
        if let Some(answer) = f() {
            return Some(answer);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return None;
        }
        sleep(pause.min(left));
        pause = pause.saturating_mul(2).min(max_pause);
    }
}

/// An error and its causes on one line, as anyhow's `{:#}` prints them (`{:#}` on a plain
/// error prints only its own message).
pub(crate) fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(c) = cause {
        text.push_str(": ");
        text.push_str(&c.to_string());
        cause = c.source();
    }
    text
}

pub(crate) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs()
}

/// Writes `data` to `path` atomically: a temp file in the same directory, fsync, rename,
/// fsync of the directory. The temp file is created with O_EXCL, never follows a link,
/// and gets `mode` before any byte is written.
/// The bytes of the regular file at `path`, read without following a link in its last
/// component (O_NOFOLLOW; ELOOP for a link) and without blocking on a FIFO (O_NONBLOCK),
/// refusing anything but a regular file and more than `max` bytes (EFBIG). For gpushare's
/// own records: a link or a FIFO planted in their place is an error, never followed.
pub(crate) fn read_regular(path: &Path, max: u64) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK)
        .open(path)?;
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(std::io::Error::from_raw_os_error(nix::libc::EINVAL));
    }
    if meta.len() > max {
        return Err(std::io::Error::from_raw_os_error(nix::libc::EFBIG));
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    file.take(max + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > max {
        return Err(std::io::Error::from_raw_os_error(nix::libc::EFBIG));
    }
    Ok(bytes)
}

pub(crate) fn write_atomic(path: &Path, data: &[u8], mode: u32) -> std::io::Result<()> {
    write_atomic_with(path, data, mode, true)
}

/// `write_atomic`, with the fsyncs only when `durable`: the rename is atomic either way,
/// but without fsync a crash may lose the new content.
pub(crate) fn write_atomic_with(
    path: &Path,
    data: &[u8],
    mode: u32,
    durable: bool,
) -> std::io::Result<()> {
    // A bare file name's parent is "", which names no directory to open for its fsync.
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.gpushare-{}.tmp", std::process::id()));
    // A file by this name is a leftover of a writer killed between its create and its
    // rename whose pid this process now has (pids are reused: 32768 of them by default):
    // no live process but this one writes under this pid, and O_EXCL would refuse it.
    let _ = std::fs::remove_file(&tmp);
    let result = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .custom_flags(nix::libc::O_NOFOLLOW)
            .open(&tmp)?;
        // The umask may have cut the mode: set it exactly.
        f.set_permissions(std::fs::Permissions::from_mode(mode))?;
        f.write_all(data)?;
        if durable {
            f.sync_all()?;
        }
        std::fs::rename(&tmp, path)?;
        if durable {
            std::fs::File::open(dir)?.sync_all()?;
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// The start time of a process (field 22 of /proc/<pid>/stat, clock ticks since boot):
/// with the pid, it names one process for good, so a reused pid is never mistaken for it.
pub fn proc_start_time(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may contain spaces and parens: split after the last ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    // rest starts at field 3 (state); field 22 is index 19 here.
    let mut fields = rest.split(' ');
    let state = fields.next()?;
    if state == "Z" || state == "X" {
        return None; // a zombie is dead for every purpose here
    }
    fields.nth(18)?.parse().ok()
}

/// The pids of every living descendant of `pid` (children, their children, …), from each
/// process's parent in /proc/<pid>/stat; a snapshot, so a process forked meanwhile may be
/// missing.
pub(crate) fn descendants(pid: i32) -> Vec<i32> {
    let parent_of = |p: i32| -> Option<i32> {
        let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).ok()?;
        // Field 4 (ppid), after the command name, which may hold spaces and parens.
        stat[stat.rfind(')')? + 2..].split(' ').nth(1)?.parse().ok()
    };
    let pids: Vec<(i32, i32)> = std::fs::read_dir("/proc")
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
                .filter_map(|p| Some((p, parent_of(p)?)))
                .collect()
        })
        .unwrap_or_default();
    let mut found = vec![pid];
    let mut i = 0;
    while i < found.len() {
        let parent = found[i];
        found.extend(pids.iter().filter(|(_, pp)| *pp == parent).map(|(p, _)| *p));
        i += 1;
    }
    found.remove(0);
    found
}

/// The metadata of `path` if it is a regular file (after links) with an exec bit.
pub(crate) fn executable(path: &Path) -> Option<std::fs::Metadata> {
    let md = std::fs::metadata(path).ok()?;
    (md.is_file() && md.permissions().mode() & 0o111 != 0).then_some(md)
}

/// The first `<dir>/<name>` along `path_var` (a `PATH` value) that is `executable`.
pub fn find_executable(name: &str, path_var: &OsStr) -> Option<PathBuf> {
    std::env::split_paths(path_var)
        .map(|dir| dir.join(name))
        .find(|p| executable(p).is_some())
}

/// Directories of a tree held open at once below its top while it is removed. A deeper
/// directory is first renamed up into the top (see `clear`), so the fds in use never
/// depend on the tree: this many, plus the top and its parent.
pub(crate) const HELD_DIRS: usize = 16;
/// Names read from one directory per pass: memory stays bounded on a huge directory.
const BATCH: usize = 256;
/// Times entries may appear under a removal (a directory refilled before its rmdir, a
/// file swapped for a directory) before it gives up rather than race a writer forever.
const MAX_RACES: u32 = 1000;

fn dir_flags() -> OFlag {
    OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC
}

/// Removes `path` and everything under it: a tree that a tenant may have made as deep,
/// wide and strange as it likes (sockets, FIFOs, symlinks, a 100,000-deep chain). Only
/// `path`'s last component and what is below it are distrusted; its parent is opened by
/// path. A symlink at `path` is removed itself. A missing `path` is fine.
pub(crate) fn remove_all(path: &Path) -> std::io::Result<()> {
    let (parent, name) = split(path)?;
    let parent = match nix::fcntl::open(
        parent,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    ) {
        Ok(fd) => fd,
        Err(Errno::ENOENT) => return Ok(()),
        Err(e) => return Err(e.into()),
    };
    let mut races = 0;
    loop {
        match Dir::openat(&parent, name, dir_flags(), Mode::empty()) {
            Ok(mut top) => {
                clear(&mut top)?;
                drop(top);
                match nix::unistd::unlinkat(&parent, name, UnlinkatFlags::RemoveDir) {
                    Ok(()) | Err(Errno::ENOENT) => return Ok(()),
                    Err(Errno::ENOTEMPTY | Errno::EEXIST) => {}
                    Err(e) => return Err(e.into()),
                }
            }
            Err(Errno::ENOENT) => return Ok(()),
            // A file, socket, FIFO or symlink: unlinked, never followed.
            Err(Errno::ENOTDIR | Errno::ELOOP) => {
                match nix::unistd::unlinkat(&parent, name, UnlinkatFlags::NoRemoveDir) {
                    Ok(()) | Err(Errno::ENOENT) => return Ok(()),
                    Err(Errno::EISDIR) => {}
                    Err(e) => return Err(e.into()),
                }
            }
            Err(e) => return Err(e.into()),
        }
        races = raced(races)?;
    }
}

/// Removes everything inside the directory `path` and keeps the directory itself (it may
/// be bind-mounted into containers). `path` itself must be a directory, not a symlink.
pub(crate) fn remove_contents(path: &Path) -> std::io::Result<()> {
    let mut top = Dir::open(path, dir_flags(), Mode::empty())?;
    clear(&mut top)
}

fn split(path: &Path) -> std::io::Result<(&Path, &OsStr)> {
    match (path.parent(), path.file_name()) {
        (Some(parent), Some(name)) => Ok((
            if parent.as_os_str().is_empty() {
                Path::new(".")
            } else {
                parent
            },
            name,
        )),
        _ => Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "a path to remove must end in a name",
        )),
    }
}

/// Counts one race with a writer; an error once there were too many.
fn raced(races: u32) -> std::io::Result<u32> {
    if races >= MAX_RACES {
        return Err(std::io::Error::other(format!(
            "entries kept appearing while it was removed ({MAX_RACES} times): something writes into it"
        )));
    }
    Ok(races + 1)
}

/// Up to `BATCH` names in `dir` (not `.` or `..`) with their type when the file system
/// reports it; the stream is rewound for the next pass.
fn read_batch(dir: &mut Dir) -> std::io::Result<Vec<(CString, Option<Type>)>> {
    let mut out = Vec::new();
    for entry in dir.iter() {
        let entry = entry?;
        let name = entry.file_name();
        if name == c"." || name == c".." {
            continue;
        }
        out.push((name.to_owned(), entry.file_type()));
        if out.len() == BATCH {
            break;
        }
    }
    Ok(out)
}

/// Whether `name` in `dir` is a directory (not following a symlink); `None` if it is gone.
fn is_dir_at(dir: &Dir, name: &CStr, kind: Option<Type>) -> std::io::Result<Option<bool>> {
    match kind {
        Some(t) => Ok(Some(t == Type::Directory)),
        None => match nix::sys::stat::fstatat(dir, name, AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(st) => Ok(Some(
                SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits()) == SFlag::S_IFDIR,
            )),
            Err(Errno::ENOENT) => Ok(None),
            Err(e) => Err(e.into()),
        },
    }
}

/// Empties the open directory `top`. Walks down, holding at most `HELD_DIRS` directories
/// below `top`: everything but directories is unlinked where it is found, a directory is
/// entered (opened by name relative to its parent's fd, O_NOFOLLOW), and an emptied one is
/// removed from its parent's fd. A directory found below the deepest held one is renamed
/// up into `top` under a fresh name and emptied from there later, so the walk needs
/// neither more fds nor a path from the top, and each directory is entered about once.
fn clear(top: &mut Dir) -> std::io::Result<()> {
    let dev = nix::sys::stat::fstat(&*top)?.st_dev;
    let mut stack: Vec<(Dir, CString)> = Vec::new();
    let mut hoisted: u64 = 0;
    let mut races = 0;
    loop {
        let batch = match stack.last_mut() {
            Some((dir, _)) => read_batch(dir)?,
            None => read_batch(top)?,
        };
        if batch.is_empty() {
            // The current directory is empty: remove it from its parent.
            let Some((done, name)) = stack.pop() else {
                return Ok(());
            };
            drop(done);
            let parent = stack.last().map_or(&*top, |(d, _)| d);
            match nix::unistd::unlinkat(parent, name.as_c_str(), UnlinkatFlags::RemoveDir) {
                Ok(()) | Err(Errno::ENOENT) => {}
                // Refilled meanwhile: its parent's next pass finds it again.
                Err(Errno::ENOTEMPTY | Errno::EEXIST) => races = raced(races)?,
                Err(e) => return Err(e.into()),
            }
            continue;
        }
        let cur = stack.last().map_or(&*top, |(d, _)| d);
        let mut descend = None;
        for (name, kind) in batch {
            let Some(is_dir) = is_dir_at(cur, &name, kind)? else {
                continue;
            };
            if !is_dir {
                match nix::unistd::unlinkat(cur, name.as_c_str(), UnlinkatFlags::NoRemoveDir) {
                    Ok(()) | Err(Errno::ENOENT) => continue,
                    // Swapped for a directory meanwhile: enter it.
                    Err(Errno::EISDIR) => {}
                    Err(e) => return Err(e.into()),
                }
            }
            descend = Some(name);
            break;
        }
        let Some(name) = descend else { continue };
        if stack.len() >= HELD_DIRS {
            loop {
                let fresh = CString::new(format!(".gpushare-rm-{hoisted}"))
                    .map_err(std::io::Error::other)?;
                hoisted += 1;
                match nix::fcntl::renameat2(
                    cur,
                    name.as_c_str(),
                    &*top,
                    fresh.as_c_str(),
                    RenameFlags::RENAME_NOREPLACE,
                ) {
                    Ok(()) | Err(Errno::ENOENT) => break,
                    Err(Errno::EEXIST) => {}
                    Err(e) => return Err(e.into()),
                }
            }
            continue;
        }
        match Dir::openat(cur, name.as_c_str(), dir_flags(), Mode::empty()) {
            Ok(child) => {
                if nix::sys::stat::fstat(&child)?.st_dev != dev {
                    return Err(std::io::Error::other(format!(
                        "{} is a mount point: a removal never crosses into another file system",
                        name.to_string_lossy()
                    )));
                }
                stack.push((child, name));
            }
            Err(Errno::ENOENT) => {}
            // Swapped for a file or a symlink meanwhile: the next pass unlinks it.
            Err(Errno::ENOTDIR | Errno::ELOOP) => races = raced(races)?,
            Err(e) => return Err(e.into()),
        }
    }
}

/// `raw` safe to show on a terminal, in a JSON document read by people, in a Prometheus
/// label or in the log: every control character (C0 with ESC and BEL, DEL, C1), every
/// other character Rust does not print as itself (format characters such as bidi
/// overrides, unassigned ones) and `\` written as a Rust escape (`\n`, `\u{1b}`, `\\`);
/// quotes and everything printable kept. The one rule for text a tenant or a daemon
/// writes (a control reply, an annotation's value); `device::quote` quotes with it.
/// Bytes that are not UTF-8 arrive here already replaced (`String::from_utf8_lossy`).
pub(crate) fn escape(raw: &str) -> String {
    let mut out = String::with_capacity(raw.len());
    for c in raw.chars() {
        escape_char(c, &mut out);
    }
    out
}

/// One character of [`escape`].
pub(crate) fn escape_char(c: char, out: &mut String) {
    match c {
        '"' | '\'' => out.push(c),
        _ => out.extend(c.escape_debug()),
    }
}

/// `s` on one line: every run of whitespace (newlines included) becomes one space, and
/// none leads or trails. For another program's text quoted in one error line.
pub(crate) fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_regular_reads_files_and_refuses_links_fifos_and_oversize() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("r.json");
        std::fs::write(&file, b"{}").unwrap();
        assert_eq!(read_regular(&file, 2).unwrap(), b"{}");
        assert_eq!(
            read_regular(&file, 1).unwrap_err().raw_os_error(),
            Some(nix::libc::EFBIG)
        );
        let link = dir.path().join("l.json");
        std::os::unix::fs::symlink(&file, &link).unwrap();
        assert_eq!(
            read_regular(&link, 64).unwrap_err().raw_os_error(),
            Some(nix::libc::ELOOP),
            "a link is never followed"
        );
        let fifo = dir.path().join("f.json");
        nix::unistd::mkfifo(&fifo, Mode::from_bits_truncate(0o600)).unwrap();
        assert_eq!(
            read_regular(&fifo, 64).unwrap_err().raw_os_error(),
            Some(nix::libc::EINVAL),
            "a FIFO is refused without blocking"
        );
        assert!(read_regular(&dir.path().join("absent"), 64)
            .is_err_and(|e| e.kind() == std::io::ErrorKind::NotFound));
    }

    #[test]
    fn escape_leaves_no_terminal_control() {
        let raw = "ok \"q\" \\ \x1b]0;t\x07\x1b[2J\u{9b}31m\x7f\n\t\u{202e}é";
        let out = escape(raw);
        assert_eq!(
            out,
            "ok \"q\" \\\\ \\u{1b}]0;t\\u{7}\\u{1b}[2J\\u{9b}31m\\u{7f}\\n\\t\\u{202e}é"
        );
        assert!(!out.chars().any(|c| c.is_control()));
        assert_eq!(escape(&String::from_utf8_lossy(b"a\xffb")), "a\u{fffd}b");
    }

    #[test]
    fn descendants_finds_grandchildren() {
        let mut sh = std::process::Command::new("sh")
            .args(["-c", "sleep 30 & sleep 30 & wait"])
            .spawn()
            .unwrap();
        let ok = poll_until(
            Instant::now() + Duration::from_secs(5),
            Duration::from_millis(10),
            Duration::from_millis(10),
            || (descendants(sh.id() as i32).len() == 2).then_some(()),
        );
        let found = descendants(std::process::id() as i32);
        let sleeps = descendants(sh.id() as i32);
        let _ = sh.kill();
        for p in sleeps {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(p),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        let _ = sh.wait();
        assert!(ok.is_some());
        assert!(
            found.contains(&(sh.id() as i32)) && found.len() >= 3,
            "{found:?}"
        );
    }

    #[test]
    fn wait_or_kill_waits_for_an_exit_and_kills_past_the_grace() {
        let mut quick = std::process::Command::new("true").spawn().unwrap();
        let t = Instant::now();
        wait_or_kill(&mut quick, Duration::from_secs(5));
        assert!(
            t.elapsed() < Duration::from_secs(4),
            "waited the whole grace"
        );
        assert!(
            quick.try_wait().unwrap().unwrap().success(),
            "it exited by itself"
        );
        let mut slow = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let t = Instant::now();
        wait_or_kill(&mut slow, Duration::from_millis(100));
        assert!(t.elapsed() < Duration::from_secs(5));
        let status = slow.try_wait().unwrap().expect("reaped");
        assert!(!status.success(), "killed: {status:?}");
    }

    #[test]
    fn poll_until_answers_at_once_when_ready() {
        let start = Instant::now();
        let mut calls = 0;
        let got = poll_until(
            start + Duration::from_secs(10),
            Duration::from_secs(1),
            Duration::from_secs(1),
            || {
                calls += 1;
                Some(7)
            },
        );
        assert_eq!((got, calls), (Some(7), 1));
        assert!(
            start.elapsed() < Duration::from_millis(500),
            "no pause taken"
        );
        // An answer after a few calls is returned too.
        let mut calls = 0;
        let got = poll_until(
            Instant::now() + Duration::from_secs(10),
            Duration::from_millis(1),
            Duration::from_millis(1),
            || {
                calls += 1;
                (calls == 3).then_some("third")
            },
        );
        assert_eq!(got, Some("third"));
    }

    #[test]
    fn poll_until_gives_up_at_the_deadline_after_a_last_call() {
        let wait = Duration::from_millis(60);
        let start = Instant::now();
        let deadline = start + wait;
        let mut last_call = start;
        let got: Option<()> = poll_until(
            deadline,
            Duration::from_millis(1),
            Duration::from_millis(25),
            || {
                last_call = Instant::now();
                None
            },
        );
        assert_eq!(got, None);
        assert!(last_call >= deadline, "the last call is at the deadline");
        // Never a whole pause past it (a generous bound: the machine may be busy).
        assert!(start.elapsed() < wait + Duration::from_millis(500));
        // A deadline already past: exactly one call, no pause.
        let mut calls = 0;
        let got: Option<()> = poll_until(
            Instant::now(),
            Duration::from_secs(1),
            Duration::from_secs(1),
            || {
                calls += 1;
                None
            },
        );
        assert_eq!((got, calls), (None, 1));
    }

    #[test]
    fn poll_pauses_double_up_to_the_cap_and_never_pass_the_deadline() {
        let ms = Duration::from_millis;
        let mut pauses = Vec::new();
        let mut calls = 0;
        let got = poll_with(
            Instant::now() + Duration::from_secs(3600),
            ms(1),
            ms(8),
            || {
                calls += 1;
                (calls == 7).then_some(())
            },
            |p| pauses.push(p),
        );
        assert_eq!(got, Some(()));
        assert_eq!(pauses, [ms(1), ms(2), ms(4), ms(8), ms(8), ms(8)]);
        // Each pause is the schedule's or, the last one only, what is left to the deadline.
        let mut pauses = Vec::new();
        let got: Option<()> = poll_with(
            Instant::now() + ms(30),
            ms(4),
            ms(16),
            || None,
            |p| {
                pauses.push(p);
                std::thread::sleep(p);
            },
        );
        assert_eq!(got, None);
        let (last, rest) = pauses.split_last().expect("it paused");
        let schedule = [ms(4), ms(8), ms(16), ms(16)];
        assert_eq!(rest, &schedule[..rest.len()], "{pauses:?}");
        assert!(*last <= schedule[rest.len()], "{pauses:?}");
    }

    #[test]
    fn find_executable_passes_over_what_cannot_run() {
        let tmp = tempfile::tempdir().unwrap();
        let [plain, dir, good] = ["plain", "dir", "good"].map(|d| tmp.path().join(d));
        for d in [&plain, &dir, &good] {
            std::fs::create_dir(d).unwrap();
        }
        // Earlier on PATH: a file without an exec bit, and a directory (mode 0755) of the name.
        std::fs::write(plain.join("tool"), "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(plain.join("tool"), std::fs::Permissions::from_mode(0o644))
            .unwrap();
        std::fs::create_dir(dir.join("tool")).unwrap();
        std::fs::write(good.join("tool"), "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(good.join("tool"), std::fs::Permissions::from_mode(0o755))
            .unwrap();
        let path =
            std::env::join_paths([&plain, &dir, &tmp.path().join("missing"), &good]).unwrap();
        assert_eq!(find_executable("tool", &path), Some(good.join("tool")));
        let without_good = std::env::join_paths([&plain, &dir]).unwrap();
        assert_eq!(find_executable("tool", &without_good), None);
        assert_eq!(find_executable("other", &path), None);
    }

    #[test]
    fn rfc3339_known_instants() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
        let t = UNIX_EPOCH + Duration::from_millis(1_795_813_516_123);
        assert_eq!(rfc3339(t), "2026-11-27T21:05:16.123Z");
        let leap = UNIX_EPOCH + Duration::from_secs(951_782_400); // 2000-02-29
        assert_eq!(rfc3339(leap), "2000-02-29T00:00:00.000Z");
        // Outside humantime's years: clamped, never a panic.
        let before = UNIX_EPOCH - Duration::from_secs(86_400);
        assert_eq!(rfc3339(before), "1970-01-01T00:00:00.000Z");
        let after = UNIX_EPOCH + Duration::from_secs(300_000_000_000);
        assert_eq!(rfc3339(after), "9999-12-31T23:59:59.999Z");
    }

    #[test]
    fn atomic_write_takes_the_place_of_a_killed_writers_temp_file_with_its_pid() {
        // A writer SIGKILLed before its rename left its temp file; its pid is reused by
        // this process (issue 15's fault tier kills writers at any instant).
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("daemon.json");
        let left = dir
            .path()
            .join(format!(".daemon.json.gpushare-{}.tmp", std::process::id()));
        std::fs::write(&left, "half a reco").unwrap();
        write_atomic(&p, b"{}", 0o644).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"{}");
        assert!(!left.exists());
    }

    #[test]
    fn atomic_write_keeps_mode_and_replaces() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f.json");
        std::fs::write(&p, "old").unwrap();
        write_atomic(&p, b"new", 0o640).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"new");
        assert_eq!(
            std::fs::metadata(&p).unwrap().permissions().mode() & 0o777,
            0o640
        );
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            1,
            "no temp file left"
        );
    }

    /// Makes a chain of `depth` directories named `d` under `top` (which it creates), a
    /// file in every 100th and a symlink to `link_to` at depth 1400, holding two fds at most
    /// and never building a long path.
    fn deep_chain(top: &Path, depth: usize, link_to: &Path) {
        use nix::fcntl::openat;
        std::fs::create_dir(top).unwrap();
        let mut cur = nix::fcntl::open(top, dir_flags(), Mode::empty()).unwrap();
        for i in 0..depth {
            nix::sys::stat::mkdirat(&cur, "d", Mode::from_bits_truncate(0o700)).unwrap();
            if i % 100 == 0 {
                openat(
                    &cur,
                    "f",
                    OFlag::O_CREAT | OFlag::O_WRONLY | OFlag::O_CLOEXEC,
                    Mode::from_bits_truncate(0o600),
                )
                .unwrap();
            }
            if i == 1400 {
                nix::unistd::symlinkat(link_to, &cur, "out").unwrap();
            }
            cur = openat(&cur, "d", dir_flags(), Mode::empty()).unwrap();
        }
    }

    /// A tree with one of everything a tenant can plant, and a directory outside it that
    /// symlinks point to; returns (tree, outside file that must survive).
    fn hostile_tree(dir: &Path) -> (std::path::PathBuf, std::path::PathBuf) {
        let outside = dir.join("outside");
        std::fs::create_dir(&outside).unwrap();
        let keep = outside.join("keep.txt");
        std::fs::write(&keep, "keep").unwrap();
        let tree = dir.join("tree");
        deep_chain(&tree, 1500, &outside);
        std::os::unix::fs::symlink(&outside, tree.join("link-to-dir")).unwrap();
        std::os::unix::fs::symlink(&keep, tree.join("link-to-file")).unwrap();
        nix::unistd::mkfifo(&tree.join("fifo"), Mode::from_bits_truncate(0o600)).unwrap();
        drop(std::os::unix::net::UnixListener::bind(tree.join("sock")).unwrap());
        std::fs::create_dir_all(tree.join("control/inner")).unwrap();
        std::fs::write(tree.join("control/inner/x"), "x").unwrap();
        let wide = tree.join("wide");
        std::fs::create_dir(&wide).unwrap();
        for i in 0..(BATCH * 3 + 7) {
            std::fs::write(wide.join(i.to_string()), "").unwrap();
        }
        (tree, keep)
    }

    #[test]
    fn remove_all_takes_a_deep_hostile_tree_and_follows_no_link() {
        let dir = tempfile::tempdir().unwrap();
        let (tree, keep) = hostile_tree(dir.path());
        remove_all(&tree).unwrap();
        assert!(std::fs::symlink_metadata(&tree).is_err(), "tree removed");
        assert_eq!(std::fs::read_to_string(&keep).unwrap(), "keep");
        assert_eq!(
            std::fs::read_dir(keep.parent().unwrap()).unwrap().count(),
            1
        );
        // Missing is fine; a symlink at the top is removed, its target kept.
        remove_all(&tree).unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(keep.parent().unwrap(), &link).unwrap();
        remove_all(&link).unwrap();
        assert!(std::fs::symlink_metadata(&link).is_err());
        assert!(keep.exists());
    }

    #[test]
    fn remove_contents_keeps_the_directory_and_takes_a_planted_control_dir() {
        let dir = tempfile::tempdir().unwrap();
        let (tree, keep) = hostile_tree(dir.path());
        use std::os::unix::fs::MetadataExt;
        let ino = std::fs::metadata(&tree).unwrap().ino();
        remove_contents(&tree).unwrap();
        assert_eq!(
            std::fs::symlink_metadata(&tree).unwrap().ino(),
            ino,
            "the very directory stays"
        );
        assert_eq!(std::fs::read_dir(&tree).unwrap().count(), 0, "emptied");
        assert!(keep.exists());
        // A symlink in place of the directory is refused, its target untouched.
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(keep.parent().unwrap(), &link).unwrap();
        assert!(remove_contents(&link).is_err());
        assert!(keep.exists());
    }

    #[test]
    fn entries_vanishing_meanwhile_are_fine() {
        let dir = tempfile::tempdir().unwrap();
        let tree = dir.path().join("t");
        for d in 0..20 {
            let sub = tree.join(d.to_string());
            std::fs::create_dir_all(&sub).unwrap();
            for f in 0..200 {
                std::fs::write(sub.join(f.to_string()), "").unwrap();
            }
        }
        let other = tree.clone();
        let racer = std::thread::spawn(move || {
            for d in (0..20).rev() {
                let sub = other.join(d.to_string());
                for f in 0..200 {
                    let _ = std::fs::remove_file(sub.join(f.to_string()));
                }
                let _ = std::fs::remove_dir(&sub);
            }
        });
        remove_all(&tree).unwrap();
        racer.join().unwrap();
        assert!(!tree.exists());
    }

    const CHILD_ENV: &str = "GPUSHARE_TEST_REMOVE";

    /// Runs `remove_all_in_a_child` in a new process of this test binary whose
    /// RLIMIT_NOFILE is `limit`, with `how` (ours or std's) removing `tree`.
    fn remove_in_child(tree: &Path, how: &str, limit: u32) -> std::process::Output {
        std::process::Command::new("/bin/sh")
            .args(["-c", &format!("ulimit -n {limit} && exec \"$0\" \"$@\"")])
            .arg(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "util::tests::remove_all_in_a_child",
                "--ignored",
                "--test-threads=1",
                "--nocapture",
            ])
            .env(CHILD_ENV, format!("{how}:{}", tree.display()))
            .output()
            .unwrap()
    }

    #[test]
    #[ignore = "run by removal_needs_a_fixed_number_of_fds, under a low RLIMIT_NOFILE"]
    fn remove_all_in_a_child() {
        let Some(arg) = std::env::var(CHILD_ENV).ok() else {
            return;
        };
        let (how, tree) = arg.split_once(':').unwrap();
        let result = match how {
            "std" => std::fs::remove_dir_all(tree),
            _ => remove_all(Path::new(tree)),
        };
        result.unwrap();
        println!("removed with {how}");
    }

    #[test]
    fn removal_needs_a_fixed_number_of_fds() {
        // Enough for stdio, the test harness and HELD_DIRS + 2, far below the depth.
        let limit = HELD_DIRS as u32 + 16;
        let dir = tempfile::tempdir().unwrap();
        let (tree, keep) = hostile_tree(dir.path());
        // The control: std's removal holds an fd per level and fails under this limit.
        let out = remove_in_child(&tree, "std", limit);
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned()
            + &String::from_utf8_lossy(&out.stdout);
        assert!(
            !out.status.success() && stderr.contains("Too many open files"),
            "std::fs::remove_dir_all under ulimit -n {limit}: {stderr}"
        );
        assert!(tree.exists());
        let out = remove_in_child(&tree, "ours", limit);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("removed with ours"),
            "{stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(std::fs::symlink_metadata(&tree).is_err());
        assert!(keep.exists());
    }

    #[test]
    fn start_time_of_self_and_of_nothing() {
        let me = std::process::id() as i32;
        assert!(proc_start_time(me).is_some());
        assert_eq!(proc_start_time(me), proc_start_time(me));
        assert!(proc_start_time(i32::MAX).is_none());
    }
}
