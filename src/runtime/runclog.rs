//! Error lines in runc's own `--log` file, the only channel the shim has during `create`.
//!
//! containerd-shim-runc-v2 (and so Docker) reads the last `"level":"error"` line of
//! `log.json` and shows its `msg` to the user as the reason `create` failed
//! (containerd `process/utils.go` getLastRuntimeError). The shim's stdout and stderr belong
//! to the container, so it never writes there during `create`.

use std::io::Write;
use std::path::Path;

/// Appends one error line in runc's format (`--log-format json` or text). Best effort: if
/// the log cannot be written there is nowhere else to say so.
pub(crate) fn error(log: &Path, json: bool, msg: &str) {
    let time = crate::util::rfc3339_now();
    let line = if json {
        let v = serde_json::json!({"level": "error", "msg": msg, "time": time});
        format!("{v}\n")
    } else {
        format!("time={time:?} level=error msg={msg:?}\n")
    };
    if let Some(dir) = log.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
    {
        let _ = f.write_all(line.as_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_line_is_what_containerd_parses() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("log.json");
        std::fs::write(&log, "{\"level\":\"info\",\"msg\":\"earlier\"}\n").unwrap();
        error(&log, true, "gpushare: bad \"thing\"\nsecond");
        let text = std::fs::read_to_string(&log).unwrap();
        let last: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
        assert_eq!(last["level"], "error");
        assert_eq!(last["msg"], "gpushare: bad \"thing\"\nsecond");
        assert!(last["time"].as_str().unwrap().ends_with('Z'));
        assert_eq!(text.lines().count(), 2, "one line appended, earlier kept");
    }

    #[test]
    fn text_line_is_logrus_shaped() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("log");
        error(&log, false, "gpushare: x");
        let text = std::fs::read_to_string(&log).unwrap();
        assert!(text.contains("level=error msg=\"gpushare: x\""), "{text}");
    }
}
