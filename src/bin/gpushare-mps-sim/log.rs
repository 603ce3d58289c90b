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
    pid: u32,
    write: Mutex<()>,
}

impl ControlLog {
    /// Opens (creating) `<dir>/control.log` once, so an unwritable log directory is a startup
    /// error rather than silence.
    pub fn open(dir: &Path, pid: u32) -> Result<Self> {
        let path = dir.join("control.log");
        open_append(&path).with_context(|| format!("open control log {}", path.display()))?;
        Ok(ControlLog {
            path,
            pid,
            write: Mutex::new(()),
        })
    }

    pub fn log(&self, message: &str) {
        let line = format_line(SystemTime::now(), self.pid, message);
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

pub fn format_line(now: SystemTime, pid: u32, message: &str) -> String {
    let since = now.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = since.as_secs();
    let millis = since.subsec_millis();
    let days = i64::try_from(secs / 86_400).unwrap_or(0);
    let rem = secs % 86_400;
    let (y, m, d) = civil_from_days(days);
    let clean: String = message
        .chars()
        .map(|c| if c.is_control() { '?' } else { c })
        .collect();
    format!(
        "[{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}.{millis:03} Control {pid}] {clean}\n",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Days since 1970-01-01 to a proleptic Gregorian date (Howard Hinnant's `civil_from_days`).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = if m <= 2 { y + 1 } else { y };
    // d is 1..=31 and m 1..=12 by construction.
    (
        y,
        u32::try_from(m).unwrap_or(1),
        u32::try_from(d).unwrap_or(1),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn dates() {
        let cases = [
            (0, (1970, 1, 1)),
            (59, (1970, 3, 1)),
            (11_016, (2000, 2, 29)),
            (15_922, (2013, 8, 5)),
            (19_782, (2024, 2, 29)),
            (-1, (1969, 12, 31)),
        ];
        for (days, want) in cases {
            assert_eq!(civil_from_days(days), want, "days {days}");
        }
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
