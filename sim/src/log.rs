//! `<log dir>/control.log`, in the real daemon's line format:
//! `[YYYY-MM-DD HH:MM:SS.mmm Control <pid>] <message>` (UTC here).
//!
//! Invariants: one message is one line (control characters in a message are replaced, so a
//! peer cannot forge log lines); each line goes out in a single append write under a mutex, so
//! lines of concurrent connections never interleave; the file is reopened per line so a log
//! rotated or removed under the daemon does not stop logging.

use std::fs::OpenOptions;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};

pub struct ControlLog {
    path: PathBuf,
    /// `Control`, or `Server` in a v3 server's `server.log`.
    tag: &'static str,
    pid: u32,
    write: Mutex<()>,
}

impl ControlLog {
    /// Opens (creating) `<dir>/control.log` once, so an unwritable log directory is a startup
    /// error rather than silence.
    pub fn open(dir: &Path, pid: u32) -> Result<Self> {
        Self::open_file(dir.join("control.log"), "Control", pid)
    }

    /// Opens (creating) any log file with lines tagged `tag`; v3's `<server>/server.log`.
    pub fn open_file(path: PathBuf, tag: &'static str, pid: u32) -> Result<Self> {
        open_append(&path).with_context(|| format!("open log {}", path.display()))?;
        Ok(ControlLog {
            path,
            tag,
            pid,
            write: Mutex::new(()),
        })
    }

    pub fn log(&self, message: &str) {
        let line = format_tagged(SystemTime::now(), self.tag, self.pid, message);
        let _serialized = self.write.lock().unwrap_or_else(|e| e.into_inner());
        // A failed log write must not take the daemon down; the control socket still works and
        // the caller has nowhere better to report it.
        if let Ok(mut file) = open_append(&self.path) {
            let _ = file.write_all(line.as_bytes());
        }
    }
}

fn open_append(path: &Path) -> std::io::Result<std::fs::File> {
    OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o644)
        .open(path)
}

#[cfg(test)]
pub fn format_line(now: SystemTime, pid: u32, message: &str) -> String {
    format_tagged(now, "Control", pid, message)
}

fn format_tagged(now: SystemTime, tag: &str, pid: u32, message: &str) -> String {
    // RFC 3339 (`2013-08-05T12:50:23.347Z`) less its `T` and `Z`. humantime writes no time
    // before 1970 (the clock reads none past 9999, humantime's last year).
    let stamp = humantime::format_rfc3339_millis(now.max(UNIX_EPOCH)).to_string();
    let stamp = stamp.trim_end_matches('Z').replacen('T', " ", 1);
    let clean: String = message
        .chars()
        .map(|c| if c.is_control() { '?' } else { c })
        .collect();
    format!("[{stamp} {tag} {pid}] {clean}\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn dates() {
        let cases = [
            (0, "1970-01-01"),
            (59, "1970-03-01"),
            (11_016, "2000-02-29"),
            (15_922, "2013-08-05"),
            (19_782, "2024-02-29"),
        ];
        for (days, want) in cases {
            let t = UNIX_EPOCH + Duration::from_secs(days * 86_400);
            assert_eq!(
                format_line(t, 1, "m"),
                format!("[{want} 00:00:00.000 Control 1] m\n"),
                "days {days}"
            );
        }
        // Before 1970: the epoch, as before.
        let before = UNIX_EPOCH - Duration::from_secs(86_400);
        assert_eq!(
            format_line(before, 1, "m"),
            "[1970-01-01 00:00:00.000 Control 1] m\n"
        );
    }

    #[test]
    fn line_format() {
        // 2013-08-05 12:50:23.347 UTC, the timestamp of the MPS guide's example line.
        let t = UNIX_EPOCH + Duration::from_millis(1_375_707_023_347);
        assert_eq!(
            format_line(t, 13894, "Starting new server 13929 for user 500"),
            "[2013-08-05 12:50:23.347 Control 13894] Starting new server 13929 for user 500\n"
        );
        assert_eq!(
            format_line(t, 1, "Cmd:a\rb\nc"),
            "[2013-08-05 12:50:23.347 Control 1] Cmd:a?b?c\n"
        );
    }

    #[test]
    fn appends_lines() {
        let dir = tempfile::tempdir().unwrap();
        let log = ControlLog::open(dir.path(), 7).unwrap();
        log.log("one");
        log.log("two");
        let text = std::fs::read_to_string(dir.path().join("control.log")).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2);
        assert!(lines[0].ends_with(" Control 7] one"), "{}", lines[0]);
        assert!(lines[1].ends_with(" Control 7] two"), "{}", lines[1]);
    }
}
