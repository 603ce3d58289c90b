//! The spec edits (docs/design.md, "Spec edits"), as a chain of small idempotent edits.
//!
//! Invariants: edits do no I/O and see only the JSON document, so each is unit-tested on
//! the captured engine fixtures; applying a plan twice gives the same document as applying
//! it once; an edit touches only the fields it names and keeps every other entry (other
//! hooks, mounts, env) where it was, in order.
//!
//! The mounts of the daemon's directories are planned by `crate::served`, which renders
//! them as these edits; an engine's mount at the same place is replaced.

use std::path::PathBuf;

use serde_json::{json, Map, Value};

use super::{gpushare_hook_stage, SpecError};

/// One change to a spec document.
pub trait SpecEdit: std::fmt::Debug {
    fn apply(&self, doc: &mut Map<String, Value>) -> Result<(), SpecError>;
}

fn shape_error(what: &str) -> SpecError {
    SpecError::User {
        message: format!("config.json field {what} has an unexpected type"),
    }
}

/// `doc[key]` as an object, created when absent.
fn object<'a>(
    doc: &'a mut Map<String, Value>,
    key: &str,
) -> Result<&'a mut Map<String, Value>, SpecError> {
    doc.entry(key)
        .or_insert_with(|| Value::Object(Map::new()))
        .as_object_mut()
        .ok_or_else(|| shape_error(key))
}

/// `doc[key]` as an array, created when absent or null.
fn array<'a>(doc: &'a mut Map<String, Value>, key: &str) -> Result<&'a mut Vec<Value>, SpecError> {
    let slot = doc.entry(key).or_insert_with(|| Value::Array(Vec::new()));
    if slot.is_null() {
        *slot = Value::Array(Vec::new());
    }
    slot.as_array_mut().ok_or_else(|| shape_error(key))
}

/// Sets environment variables of `process.env`, replacing every earlier entry of the same
/// names (so the container sees exactly these values) and appending them in order.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct SetEnv(pub Vec<(String, String)>);

impl SpecEdit for SetEnv {
    fn apply(&self, doc: &mut Map<String, Value>) -> Result<(), SpecError> {
        // Creating `process` would make an invalid spec (user and cwd are required); a
        // container without one has nothing to run anyway.
        let Some(process) = doc.get_mut("process").and_then(Value::as_object_mut) else {
            return Err(SpecError::User {
                message: "config.json has no process object: nothing to run, and nowhere to set CUDA_MPS_PIPE_DIRECTORY".into(),
            });
        };
        let env = array(process, "env")?;
        env.retain(|e| {
            let name = e.as_str().and_then(|s| s.split_once('=')).map(|(n, _)| n);
            !self.0.iter().any(|(k, _)| Some(k.as_str()) == name)
        });
        env.extend(
            self.0
                .iter()
                .map(|(k, v)| Value::String(format!("{k}={v}"))),
        );
        Ok(())
    }
}

/// A mount at `destination`: replaces the first mount at that destination in place (and
/// drops any later duplicates), or is appended when there is none.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct SetMount {
    pub destination: String,
    pub typ: String,
    pub source: String,
    pub options: Vec<String>,
}

impl SetMount {
    pub(crate) fn bind(
        source: impl Into<String>,
        destination: impl Into<String>,
        options: &[&str],
    ) -> Self {
        SetMount {
            destination: destination.into(),
            typ: "bind".into(),
            source: source.into(),
            options: options.iter().map(|s| s.to_string()).collect(),
        }
    }
}

fn same_destination(a: &str, b: &str) -> bool {
    a.trim_end_matches('/') == b.trim_end_matches('/')
}

impl SpecEdit for SetMount {
    fn apply(&self, doc: &mut Map<String, Value>) -> Result<(), SpecError> {
        let mounts = array(doc, "mounts")?;
        let entry = json!({
            "destination": self.destination,
            "type": self.typ,
            "source": self.source,
            "options": self.options,
        });
        let is_here = |m: &Value| {
            m.get("destination")
                .and_then(Value::as_str)
                .is_some_and(|d| same_destination(d, &self.destination))
        };
        match mounts.iter().position(is_here) {
            Some(i) => {
                mounts[i] = entry;
                let mut seen = 0;
                mounts.retain(|m| {
                    if is_here(m) {
                        seen += 1;
                        seen == 1
                    } else {
                        true
                    }
                });
            }
            None => mounts.push(entry),
        }
        Ok(())
    }
}

/// Removes every mount at `destination`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct RemoveMount(pub &'static str);

impl SpecEdit for RemoveMount {
    fn apply(&self, doc: &mut Map<String, Value>) -> Result<(), SpecError> {
        if let Some(mounts) = doc.get_mut("mounts").and_then(Value::as_array_mut) {
            mounts.retain(|m| {
                !m.get("destination")
                    .and_then(Value::as_str)
                    .is_some_and(|d| same_destination(d, self.0))
            });
        }
        Ok(())
    }
}

/// Removes the namespace entries of one type from `linux.namespaces` (the container then
/// inherits the runtime's namespace of that type: config-linux.md).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct RemoveNamespace(pub &'static str);

impl SpecEdit for RemoveNamespace {
    fn apply(&self, doc: &mut Map<String, Value>) -> Result<(), SpecError> {
        if let Some(ns) = doc
            .get_mut("linux")
            .and_then(|l| l.get_mut("namespaces"))
            .and_then(Value::as_array_mut)
        {
            ns.retain(|n| n.get("type").and_then(Value::as_str) != Some(self.0));
        }
        Ok(())
    }
}

/// gpushare's hooks: removes every earlier gpushare hook (any path whose args are
/// `gpushare hook …`), then appends ours, keeping every other hook in place and order.
#[derive(Debug, Clone, PartialEq)]
pub struct SetHooks {
    pub binary: PathBuf,
    pub env: Vec<String>,
    /// (OCI hook stage, `gpushare hook` argument, timeout in seconds)
    pub stages: Vec<(&'static str, &'static str, u64)>,
}

/// Stages gpushare may have injected into in any version; all are cleaned.
const OUR_STAGES: &[&str] = &[
    "prestart",
    "createRuntime",
    "createContainer",
    "startContainer",
    "poststart",
    "poststop",
];

fn is_gpushare_hook(h: &Value) -> bool {
    gpushare_hook_stage(h).is_some()
}

impl SpecEdit for SetHooks {
    fn apply(&self, doc: &mut Map<String, Value>) -> Result<(), SpecError> {
        let hooks = object(doc, "hooks")?;
        for stage in OUR_STAGES {
            if let Some(list) = hooks.get_mut(*stage).and_then(Value::as_array_mut) {
                list.retain(|h| !is_gpushare_hook(h));
            }
        }
        for (stage, arg, timeout) in &self.stages {
            array(hooks, stage)?.push(json!({
                "path": self.binary,
                "args": ["gpushare", "hook", arg],
                "env": self.env,
                "timeout": timeout,
            }));
        }
        // Leave no empty list behind that the original did not have.
        hooks.retain(|_, v| !v.as_array().is_some_and(Vec::is_empty));
        Ok(())
    }
}

/// Sets annotations (the shim's decisions, read by the hook).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct SetAnnotations(pub Vec<(String, String)>);

impl SpecEdit for SetAnnotations {
    fn apply(&self, doc: &mut Map<String, Value>) -> Result<(), SpecError> {
        let ann = object(doc, "annotations")?;
        for (k, v) in &self.0 {
            ann.insert(k.clone(), Value::String(v.clone()));
        }
        Ok(())
    }
}

/// Everything the shim puts into one container's spec; built by the runtime module; its
/// mounts are the container's mount plan rendered as edits (`crate::served`), its
/// annotations carry the shim↔hook decision (`decision::Decision`).
#[derive(Debug)]
pub struct ContainerPlan {
    pub env: Vec<(String, String)>,
    pub mounts: Vec<Box<dyn SpecEdit>>,
    pub hooks: SetHooks,
    pub annotations: Vec<(String, String)>,
}

/// The edit chain for one container plan, in the order they apply: the env, the mounts,
/// the hooks, the annotations.
pub fn plan(d: ContainerPlan) -> Vec<Box<dyn SpecEdit>> {
    let mut edits: Vec<Box<dyn SpecEdit>> = vec![Box::new(SetEnv(d.env))];
    edits.extend(d.mounts);
    edits.push(Box::new(d.hooks));
    edits.push(Box::new(SetAnnotations(d.annotations)));
    edits
}

/// Applies a chain in order; the first error stops it.
pub fn apply_all(
    doc: &mut Map<String, Value>,
    edits: &[Box<dyn SpecEdit>],
) -> Result<(), SpecError> {
    edits.iter().try_for_each(|e| e.apply(doc))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::bundle::tests::{fixture, FIXTURES};

    fn doc(name: &str) -> Map<String, Value> {
        serde_json::from_slice(&fixture(name)).unwrap()
    }

    fn decision() -> ContainerPlan {
        ContainerPlan {
            env: vec![
                ("CUDA_MPS_PIPE_DIRECTORY".into(), "/tmp/nvidia-mps".into()),
                ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE".into(), "25".into()),
            ],
            mounts: vec![],
            hooks: SetHooks {
                binary: "/usr/local/bin/gpushare".into(),
                env: vec!["PATH=/usr/bin:/bin".into()],
                stages: vec![
                    ("createRuntime", "create-runtime", 15),
                    ("poststop", "poststop", 10),
                ],
            },
            annotations: vec![(
                "gpushare.io/daemon".into(),
                "0123456789abcdef0123456789abcdef".into(),
            )],
        }
    }

    /// Applying `edits` twice gives the same document as applying them once, on every
    /// captured fixture.
    pub(crate) fn assert_twice_is_once(edits: &[Box<dyn SpecEdit>]) {
        for name in FIXTURES {
            let mut once = doc(name);
            apply_all(&mut once, edits).unwrap();
            let mut twice = once.clone();
            apply_all(&mut twice, edits).unwrap();
            assert_eq!(once, twice, "{name}: {edits:?}");
        }
    }

    #[test]
    fn applying_twice_changes_nothing_on_every_fixture() {
        assert_twice_is_once(&plan(decision()));
    }

    #[test]
    fn env_is_set_once_and_replaces_earlier_values() {
        let mut d = doc("docker-20.10-config.json");
        d["process"]["env"]
            .as_array_mut()
            .unwrap()
            .push("CUDA_MPS_PIPE_DIRECTORY=/evil".into());
        apply_all(&mut d, &plan(decision())).unwrap();
        let env: Vec<&str> = d["process"]["env"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        assert_eq!(
            env.iter()
                .filter(|e| e.starts_with("CUDA_MPS_PIPE_DIRECTORY="))
                .count(),
            1
        );
        assert!(env.contains(&"CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps"));
        assert!(env.contains(&"GPUSHARE_DEVICE=0"), "other env kept");
        assert_eq!(
            env[0],
            "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        );
    }

    #[test]
    fn hooks_keep_others_in_order_and_replace_stale_gpushare_hooks() {
        let mut d = doc("docker-20.10-config.json");
        // A stale hook from an older install at another path.
        d["hooks"]["createRuntime"] = json!([
            {"path": "/opt/old/gpushare", "args": ["gpushare", "hook", "create-runtime"]},
            {"path": "/usr/bin/other-hook", "args": ["other-hook"]}
        ]);
        apply_all(&mut d, &plan(decision())).unwrap();
        let prestart = d["hooks"]["prestart"].as_array().unwrap();
        assert_eq!(prestart.len(), 1);
        assert_eq!(
            prestart[0]["args"][0], "libnetwork-setkey",
            "Docker's own hook untouched"
        );
        let cr = d["hooks"]["createRuntime"].as_array().unwrap();
        assert_eq!(cr.len(), 2);
        assert_eq!(cr[0]["path"], "/usr/bin/other-hook");
        assert_eq!(cr[1]["path"], "/usr/local/bin/gpushare");
        assert_eq!(cr[1]["args"], json!(["gpushare", "hook", "create-runtime"]));
        assert_eq!(cr[1]["env"], json!(["PATH=/usr/bin:/bin"]));
        assert_eq!(cr[1]["timeout"], 15);
        assert_eq!(d["hooks"]["poststop"][0]["args"][2], "poststop");
    }

    #[test]
    fn annotations_are_created_when_absent() {
        let mut d = doc("docker-20.10-config.json");
        assert!(!d.contains_key("annotations"));
        apply_all(&mut d, &plan(decision())).unwrap();
        assert_eq!(
            d["annotations"]["gpushare.io/daemon"],
            "0123456789abcdef0123456789abcdef"
        );
    }

    #[test]
    fn a_spec_without_process_is_refused_not_made_invalid() {
        let mut d = doc("containerd-1.6-config.json");
        d.remove("process");
        let err = apply_all(&mut d, &plan(decision()))
            .unwrap_err()
            .to_string();
        assert!(err.contains("no process object"), "{err}");
    }

    #[test]
    fn wrong_shapes_are_errors_not_panics() {
        let mut d = Map::new();
        d.insert("process".into(), json!({"env": 5}));
        assert!(SetEnv(vec![("A".into(), "b".into())])
            .apply(&mut d)
            .is_err());
        let mut d = Map::new();
        d.insert("process".into(), json!(null));
        assert!(SetEnv(vec![("A".into(), "b".into())])
            .apply(&mut d)
            .is_err());
        let mut d = Map::new();
        d.insert("mounts".into(), json!("x"));
        assert!(SetMount::bind("/a", "/b", &[]).apply(&mut d).is_err());
    }
}
