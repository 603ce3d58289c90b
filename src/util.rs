//! Small helpers: time formatting, polling with a deadline, process identity through
//! /proc, the lookup of a program on a `PATH`, and the escaping of text for one line.
//!
//! Invariant of the polling (`poll_until`): it never sleeps past its deadline, and it asks
//! once more at the deadline, so a condition met during the last pause is not missed.
//!
//! Invariant of the lookup (`find_executable`): only a regular file (after links) with
//! an exec bit is found; a directory or a non-executable file of the name is passed
//! over, as execvp passes it over.

use std::ffi::OsStr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// `<crate version> (commit <git commit>)`, for `--version`.
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("GPUSHARE_GIT_COMMIT"),
    ")"
);

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

/// The start time of a process (field 22 of `/proc/<pid>/stat`, clock ticks since boot):
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
    fn start_time_of_self_and_of_nothing() {
        let me = std::process::id() as i32;
        assert!(proc_start_time(me).is_some());
        assert_eq!(proc_start_time(me), proc_start_time(me));
        assert!(proc_start_time(i32::MAX).is_none());
    }
}
