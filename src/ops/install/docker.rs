//! Docker: `runtimes.<name> = {"path": …}` in daemon.json (dockerd.md "Configure runc
//! drop-in replacements"). Docker reloads `runtimes` on SIGHUP.
//!
//! Invariants: every function is pure, on the file's text; an edit keeps every other key
//! in place and order and changes nothing the second time; `registration` reads back
//! exactly what `edit` writes (and `remove` takes out).

use std::path::Path;

use serde_json::{Map, Value};

use super::engine::{serving, spec_dirs_hint, About, EngineConfig, Finding, Registration, Removal};
use super::file::{Edited, InstallError};

/// Where Docker keeps its config on a standard install.
pub(crate) const DEFAULT_CONFIG: &str = "/etc/docker/daemon.json";

/// daemon.json's text as its top-level object (no text: an empty one).
fn load(path: &Path, text: &str) -> Result<Map<String, Value>, InstallError> {
    if text.trim().is_empty() {
        return Ok(Map::new());
    }
    match serde_json::from_str(text).map_err(|e| parse_error(path, e.to_string()))? {
        Value::Object(m) => Ok(m),
        _ => Err(parse_error(path, "the top level is not an object".into())),
    }
}

/// daemon.json at `path` is no JSON that gpushare can edit: `message` says why.
fn parse_error(path: &Path, message: String) -> InstallError {
    InstallError::Parse {
        path: path.to_owned(),
        format: "JSON",
        message,
    }
}

/// Adds or updates the runtime entry, keeping every other key in place and order.
pub(crate) fn edit(
    path: &Path,
    text: &str,
    name: &str,
    runtime: &Path,
) -> Result<Edited, InstallError> {
    let parse = |message: String| parse_error(path, message);
    let mut doc = load(path, text)?;
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

/// Removes the runtime entry `name`, keeping every other key in place and order. An
/// emptied `runtimes` stays, as `{}`: Docker 20.10 keeps the runtimes it loaded when a
/// reload (SIGHUP) finds no `runtimes` key at all, and drops them for an empty object.
pub(crate) fn remove(path: &Path, text: &str, name: &str) -> Result<Edited, InstallError> {
    if text.trim().is_empty() {
        return Ok(Edited { text: None });
    }
    let parse = |message: String| parse_error(path, message);
    let mut doc = load(path, text)?;
    match doc.get_mut("runtimes") {
        None => return Ok(Edited { text: None }),
        Some(Value::Object(runtimes)) => {
            if runtimes.shift_remove(name).is_none() {
                return Ok(Edited { text: None });
            }
        }
        Some(other) => {
            return Err(InstallError::Unsupported {
                path: path.to_owned(),
                message: format!("\"runtimes\" is {other}, not an object: fix or remove that key"),
            })
        }
    }
    let mut out = serde_json::to_string_pretty(&doc).map_err(|e| parse(e.to_string()))?;
    out.push('\n');
    Ok(Edited { text: Some(out) })
}

/// How daemon.json registers runtime `name`: through the shim at its `path`, or not at
/// all (no such entry, an entry without a `path` such as a `runtimeType` one, or a file
/// that is not JSON). Docker has no hook-only registration.
pub(crate) fn registration(text: &str, name: &str) -> Option<Registration> {
    let doc: Value = serde_json::from_str(text).ok()?;
    let path = doc.get("runtimes")?.get(name)?.get("path")?.as_str()?;
    Some(Registration::Shim(path.into()))
}

/// The CDI spec directories Docker reads when `cdi-spec-dirs` is not set.
pub(crate) const DOCKER_CDI_DIRS: [&str; 2] = ["/etc/cdi", "/var/run/cdi"];

/// Turns CDI on (`"features": {"cdi": true}`) and makes `dir` one of the CDI spec
/// directories Docker reads: added to `cdi-spec-dirs` when the file lists them, or when
/// `dir` is not one of Docker's defaults (the defaults are then listed too, so that
/// nothing Docker read before is lost). Every other key is kept in place and order.
pub(crate) fn enable_cdi(path: &Path, text: &str, dir: &Path) -> Result<Edited, InstallError> {
    let parse = |message: String| parse_error(path, message);
    let shape = |key: &str, is: &Value, want: &str| InstallError::Unsupported {
        path: path.to_owned(),
        message: format!("\"{key}\" is {is}, not {want}: fix or remove that key"),
    };
    let mut doc = load(path, text)?;
    let before = doc.clone();
    let features = doc
        .entry("features")
        .or_insert_with(|| Value::Object(Map::new()));
    let Value::Object(features) = features else {
        return Err(shape("features", features, "an object"));
    };
    features.insert("cdi".into(), Value::Bool(true));
    let dir = dir.to_string_lossy().into_owned();
    match doc.get_mut("cdi-spec-dirs") {
        Some(Value::Array(dirs)) => {
            if !dirs.iter().any(|d| d.as_str() == Some(dir.as_str())) {
                dirs.push(Value::String(dir));
            }
        }
        Some(other) => return Err(shape("cdi-spec-dirs", other, "a list of directories")),
        None if DOCKER_CDI_DIRS.contains(&dir.as_str()) => {}
        None => {
            let mut dirs: Vec<Value> = DOCKER_CDI_DIRS.iter().map(|d| Value::from(*d)).collect();
            dirs.push(Value::String(dir));
            doc.insert("cdi-spec-dirs".into(), Value::Array(dirs));
        }
    }
    if doc == before && !text.trim().is_empty() {
        return Ok(Edited { text: None });
    }
    let mut out = serde_json::to_string_pretty(&doc).map_err(|e| parse(e.to_string()))?;
    out.push('\n');
    Ok(Edited { text: Some(out) })
}

/// Docker as data: its names, where its config and socket are, its help texts.
const DOCKER: About = About {
    name: "docker",
    default_config: DEFAULT_CONFIG,
    default_socket: "/run/docker.sock",
    config_name: "Docker's daemon.json",
    install_about:
        "Add `runtimes.<name>` to Docker's daemon.json (default /etc/docker/daemon.json)",
    uninstall_about: "Docker's daemon.json (default /etc/docker/daemon.json)",
    cdi_settings: "`features.cdi`, `cdi-spec-dirs`",
    cdi_restart: "restart dockerd to use it",
};

/// Docker as one of gpushare's engines.
pub(crate) struct Docker;

impl EngineConfig for Docker {
    fn about(&self) -> &'static About {
        &DOCKER
    }
    fn edit(
        &self,
        path: &Path,
        text: &str,
        name: &str,
        runtime: &Path,
        _version: Option<i64>,
    ) -> Result<Edited, InstallError> {
        edit(path, text, name, runtime)
    }
    fn remove(&self, path: &Path, text: &str, name: &str) -> Result<Removal, InstallError> {
        Ok(Removal {
            runtime: remove(path, text, name)?.text,
            also: None,
            files: vec![],
        })
    }
    fn enable_cdi(
        &self,
        path: &Path,
        text: &str,
        dir: &Path,
        _version: Option<i64>,
    ) -> Result<Edited, InstallError> {
        enable_cdi(path, text, dir)
    }
    fn cdi_usage(&self, dir: &Path) -> String {
        format!(
            "Docker 25+: \"features\": {{\"cdi\": true}}{} in daemon.json (or: gpushare install cdi --enable docker), then docker run --device gpushare.io/gpu=0 …",
            spec_dirs_hint("\"cdi-spec-dirs\": ", &DOCKER_CDI_DIRS, dir)
        )
    }
    fn next_steps(&self, name: &str) -> Vec<String> {
        vec![
            "reload Docker to use it: `kill -HUP $(pidof dockerd)` or `systemctl reload docker`;".to_owned(),
            format!("then: docker run --runtime {name} -e GPUSHARE_DEVICE=0 …  (Docker ≥ 24: --annotation gpushare.io/device=0)"),
        ]
    }
    fn forget_steps(&self, _name: &str, restored: bool) -> Vec<String> {
        vec![if restored {
            // Docker 20.10's reload keeps the runtimes it has when the key is gone.
            "restart Docker for it to forget the runtime: `systemctl restart docker`"
        } else {
            "reload Docker for it to forget the runtime: `kill -HUP $(pidof dockerd)` or `systemctl reload docker`"
        }
        .to_owned()]
    }
    /// `runtimes.gpushare` in daemon.json, where dockerd runs.
    fn check(&self, config: &Path, socket: &Path) -> Finding {
        const FIX: Option<&str> = Some("gpushare install docker, then reload dockerd (SIGHUP)");
        match std::fs::read_to_string(config) {
            Err(_) if !serving(socket) => Finding {
                detail: format!(
                    "Docker does not run here (no {}, no {}): nothing to configure",
                    config.display(),
                    socket.display()
                ),
                fix: None,
            },
            Err(_) => Finding {
                detail: format!(
                    "dockerd serves {} but {} does not exist",
                    socket.display(),
                    config.display()
                ),
                fix: FIX,
            },
            Ok(text) => match registration(&text, "gpushare") {
                Some(Registration::Shim(path)) => Finding {
                    detail: format!(
                        "{} registers runtime gpushare at {}",
                        config.display(),
                        path.display()
                    ),
                    fix: None,
                },
                Some(Registration::HookOnly(_)) | None => Finding {
                    detail: format!("{} does not register runtime gpushare", config.display()),
                    fix: FIX,
                },
            },
        }
    }
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
    fn registration_reads_back_what_edit_writes_and_nothing_else() {
        let read = |text: &str| registration(text, "gpushare");
        let installed = run(r#"{"runtimes": {"nvidia": {"path": "n"}}}"#).unwrap();
        assert_eq!(read(&installed), Some(Registration::Shim(RT.into())));
        assert_eq!(
            registration(&installed, "nvidia"),
            Some(Registration::Shim("n".into()))
        );
        for unregistered in [
            "",
            "{",
            "[]",
            r#"{"runtimes": 5}"#,
            r#"{"runtimes": {"nvidia": {"path": "n"}}}"#,
            r#"{"runtimes": {"gpushare": {"runtimeType": "io.containerd.runc.v2"}}}"#,
            r#"{"runtimes": {"gpushare": {"path": 7}}}"#,
        ] {
            assert_eq!(read(unregistered), None, "{unregistered}");
        }
        let removed = remove(Path::new("daemon.json"), &installed, "gpushare")
            .unwrap()
            .text
            .unwrap();
        assert_eq!(read(&removed), None);
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

    #[test]
    fn remove_takes_out_only_the_runtime_and_keeps_an_empty_runtimes_object() {
        let remove = |text: &str| {
            remove(Path::new("daemon.json"), text, "gpushare")
                .unwrap()
                .text
        };
        let installed =
            run(r#"{"log-driver": "journald", "runtimes": {"nvidia": {"path": "n"}}, "zz": 1}"#)
                .unwrap();
        let out = remove(&installed).unwrap();
        let v: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"log-driver": "journald", "runtimes": {"nvidia": {"path": "n"}}, "zz": 1})
        );
        let keys: Vec<&String> = v.as_object().unwrap().keys().collect();
        assert_eq!(keys, ["log-driver", "runtimes", "zz"]);
        // The last runtime gone: `"runtimes": {}` stays (Docker 20.10 unregisters only so).
        let out = remove(&run("").unwrap()).unwrap();
        assert_eq!(out, "{\n  \"runtimes\": {}\n}\n");
        assert_eq!(remove(&out), None, "twice changes nothing");
        assert_eq!(remove(""), None);
        assert_eq!(remove(r#"{"debug": true}"#), None);
        assert!(super::remove(Path::new("d"), r#"{"runtimes": 5}"#, "gpushare").is_err());
    }

    #[test]
    fn enable_cdi_turns_the_feature_on_and_adds_the_directory_once() {
        let enable = |text: &str, dir: &str| {
            enable_cdi(Path::new("daemon.json"), text, Path::new(dir))
                .unwrap()
                .text
        };
        let out = enable(
            r#"{"runtimes": {"x": {"path": "y"}}, "features": {"buildkit": true}}"#,
            "/etc/cdi",
        )
        .unwrap();
        let v: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(
            v["features"],
            serde_json::json!({"buildkit": true, "cdi": true})
        );
        assert!(
            v.get("cdi-spec-dirs").is_none(),
            "a default directory needs no list"
        );
        assert_eq!(enable(&out, "/etc/cdi"), None, "twice changes nothing");
        let out = enable("", "/opt/cdi").unwrap();
        let v: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(
            v["cdi-spec-dirs"],
            serde_json::json!(["/etc/cdi", "/var/run/cdi", "/opt/cdi"])
        );
        assert_eq!(enable(&out, "/opt/cdi"), None);
        let out = enable(r#"{"cdi-spec-dirs": ["/mine"]}"#, "/etc/cdi").unwrap();
        let v: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["cdi-spec-dirs"], serde_json::json!(["/mine", "/etc/cdi"]));
        for bad in [
            r#"{"features": true}"#,
            r#"{"cdi-spec-dirs": "/etc/cdi"}"#,
            "[1]",
        ] {
            assert!(
                enable_cdi(Path::new("d"), bad, Path::new("/etc/cdi")).is_err(),
                "{bad}"
            );
        }
    }
}
