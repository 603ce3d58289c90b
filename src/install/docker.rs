//! Docker: `runtimes.<name> = {"path": …}` in daemon.json (dockerd.md "Configure runc
//! drop-in replacements"). Docker reloads `runtimes` on SIGHUP.

use std::path::Path;

use serde_json::{Map, Value};

use super::{Edited, InstallError};

/// Adds or updates the runtime entry, keeping every other key in place and order.
pub(crate) fn edit(
    path: &Path,
    text: &str,
    name: &str,
    runtime: &Path,
) -> Result<Edited, InstallError> {
    let parse = |message: String| InstallError::Parse {
        path: path.to_owned(),
        format: "JSON",
        message,
    };
    let mut doc: Map<String, Value> = if text.trim().is_empty() {
        Map::new()
    } else {
        match serde_json::from_str(text).map_err(|e| parse(e.to_string()))? {
            Value::Object(m) => m,
            _ => return Err(parse("the top level is not an object".into())),
        }
    };
    let runtimes = doc
        .entry("runtimes")
        .or_insert_with(|| Value::Object(Map::new()));
    let Value::Object(runtimes) = runtimes else {
        // Valid JSON, but not what Docker accepts there: say what is wrong, not "invalid".
        return Err(InstallError::Unsupported {
            path: path.to_owned(),
            message: format!(
                "\"runtimes\" is {}, not an object; Docker expects {{\"runtimes\": {{\"<name>\": {{\"path\": …}}}}}}: fix or remove that key",
                runtimes
            ),
        });
    };
    let wanted = runtime.to_string_lossy().into_owned();
    let entry = runtimes.get(name).and_then(Value::as_object).cloned();
    let mut new_entry = match entry {
        // Keep runtimeArgs and anything else, but a shim runtime (runtimeType) and a
        // path are mutually exclusive in Docker: the entry becomes a path entry.
        Some(mut e) if !e.contains_key("runtimeType") => {
            if e.get("path").and_then(Value::as_str) == Some(wanted.as_str()) {
                return Ok(Edited { text: None });
            }
            e.insert("path".into(), Value::String(wanted.clone()));
            e
        }
        _ => Map::new(),
    };
    new_entry.insert("path".into(), Value::String(wanted));
    runtimes.insert(name.to_owned(), Value::Object(new_entry));
    let mut out = serde_json::to_string_pretty(&doc).map_err(|e| parse(e.to_string()))?;
    out.push('\n');
    Ok(Edited { text: Some(out) })
}

#[cfg(test)]
mod tests {
    use super::*;

    const RT: &str = "/usr/local/bin/gpushare-runtime";

    fn run(text: &str) -> Option<String> {
        edit(Path::new("daemon.json"), text, "gpushare", Path::new(RT))
            .unwrap()
            .text
    }

    #[test]
    fn adds_the_runtime_and_keeps_everything_else_in_order() {
        let text = r#"{"log-driver": "journald", "runtimes": {"nvidia": {"path": "nvidia-container-runtime", "runtimeArgs": []}}, "default-runtime": "runc", "zz": [1, 2]}"#;
        let out = run(text).unwrap();
        let v: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["runtimes"]["gpushare"]["path"], RT);
        assert_eq!(v["runtimes"]["nvidia"]["path"], "nvidia-container-runtime");
        let keys: Vec<&String> = v.as_object().unwrap().keys().collect();
        assert_eq!(keys, ["log-driver", "runtimes", "default-runtime", "zz"]);
        assert!(
            out.ends_with("}\n") && out.contains("\n  \"runtimes\""),
            "pretty, two spaces:\n{out}"
        );
    }

    #[test]
    fn is_idempotent_and_handles_empty_files() {
        let first = run("").unwrap();
        assert_eq!(run(&first), None, "second run changes nothing");
        assert_eq!(run("  \n"), Some(first));
    }

    #[test]
    fn updates_a_stale_path_keeping_runtime_args_and_replaces_a_shim_entry() {
        let out = run(r#"{"runtimes": {"gpushare": {"path": "/old/gpushare-runtime", "runtimeArgs": ["--debug"]}}}"#).unwrap();
        let v: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(
            v["runtimes"]["gpushare"],
            serde_json::json!({"path": RT, "runtimeArgs": ["--debug"]})
        );
        let out =
            run(r#"{"runtimes": {"gpushare": {"runtimeType": "io.containerd.runc.v2"}}}"#).unwrap();
        let v: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["runtimes"]["gpushare"], serde_json::json!({"path": RT}));
    }

    #[test]
    fn bad_files_are_errors_naming_the_file() {
        let err = edit(
            Path::new("/etc/docker/daemon.json"),
            r#"{"runtimes": 5}"#,
            "gpushare",
            Path::new(RT),
        )
        .err()
        .unwrap()
        .to_string();
        assert_eq!(
            err,
            "/etc/docker/daemon.json: \"runtimes\" is 5, not an object; Docker expects {\"runtimes\": {\"<name>\": {\"path\": …}}}: fix or remove that key"
        );
        for bad in ["{", "[]"] {
            let err = edit(
                Path::new("/etc/docker/daemon.json"),
                bad,
                "gpushare",
                Path::new(RT),
            )
            .err()
            .unwrap()
            .to_string();
            assert!(
                err.contains("/etc/docker/daemon.json is not valid JSON"),
                "{err}"
            );
        }
    }
}
