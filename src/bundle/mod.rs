//! The bundle's config.json: strict, lossless load; in-memory edits; atomic save.
//!
//! Invariants: the file is read once and parsed once into a `serde_json::Value` that keeps
//! key order and every field — including fields the oci-spec crate does not know — so a
//! round trip loses nothing. The fields gpushare reads (`ociVersion`, `annotations`,
//! `process.env`, `process.user`, `root`, `mounts`, `linux.namespaces`, `linux.*Mappings`,
//! `linux.devices`, `linux.resources.devices`) are
//! deserialised from that value into typed views built from oci-spec's own types, so a
//! malformed value in any of them is refused before any edit; the rest of the document is
//! runc's to judge (a full typed `oci_spec::runtime::Spec` parse is `check_typed`, used
//! by tests and fuzzing: on the create path it cost more than the edit itself and linked
//! a regex engine into the shim — BENCHMARKS.md). A symlink in place of config.json is
//! refused. The write is atomic (temp file in the bundle, rename) and keeps the file's
//! mode; on any error before the rename the original is untouched.

pub mod edits;

use std::collections::HashMap;
use std::io::Read;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use oci_spec::runtime::{
    LinuxDevice, LinuxDeviceCgroup, LinuxDeviceType, LinuxIdMapping, LinuxNamespace,
    LinuxNamespaceType, Mount, Root, Spec, User,
};
use serde::Deserialize;
use serde_json::{Map, Value};

use crate::userns::IdRange;

#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error("cannot read {path} (a symlink is refused)")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a valid OCI runtime spec: {message}")]
    Invalid { path: PathBuf, message: String },
    #[error("cannot write {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot serialise the spec for {path}")]
    Serialise {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("{message}")]
    User { message: String },
}

/// The parts of config.json gpushare reads, typed (unknown fields are ignored here and
/// kept in `SpecFile::doc`).
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SpecView {
    pub oci_version: String,
    #[serde(default)]
    pub annotations: Option<HashMap<String, String>>,
    #[serde(default)]
    pub process: Option<ProcessView>,
    #[serde(default)]
    pub root: Option<Root>,
    #[serde(default)]
    pub mounts: Option<Vec<Mount>>,
    #[serde(default)]
    pub linux: Option<LinuxView>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct ProcessView {
    pub env: Option<Vec<String>>,
    pub user: User,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct LinuxView {
    pub namespaces: Option<Vec<LinuxNamespace>>,
    pub uid_mappings: Option<Vec<LinuxIdMapping>>,
    pub gid_mappings: Option<Vec<LinuxIdMapping>>,
    pub devices: Option<Vec<LinuxDevice>>,
    pub resources: Option<ResourcesView>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct ResourcesView {
    pub devices: Option<Vec<LinuxDeviceCgroup>>,
}

impl LinuxView {
    /// Whether `linux.namespaces` lists this type at all (new or joined).
    pub(crate) fn has_namespace(
        &self,
        typ: LinuxNamespaceType,
        also: impl Fn(&LinuxNamespace) -> bool,
    ) -> bool {
        self.namespaces
            .as_deref()
            .unwrap_or(&[])
            .iter()
            .any(|n| n.typ() == typ && also(n))
    }
}

/// config.json as read from disk, before parsing.
pub struct RawSpec {
    pub path: PathBuf,
    pub mode: u32,
    pub bytes: Vec<u8>,
}

impl RawSpec {
    /// Whether the document may hold a gpushare request: it spells `gpushare` in some
    /// case (the annotations' prefix and the `GPUSHARE_*` env vars), or holds a `\u`
    /// escape, the only way JSON can spell those letters otherwise. False means it
    /// certainly holds none, without parsing it.
    pub fn may_request(&self) -> bool {
        self.spells(b"gpushare")
    }

    /// Whether the document may hold an allocation (`request::allocation`): it spells
    /// `nvidia` in some case, as every allocation source does, or holds a `\u` escape.
    /// Only asked when the node's `default-device` makes an allocation a request.
    pub fn may_hold_allocation(&self) -> bool {
        self.spells(b"nvidia")
    }

    /// One pass, touching each byte once (a config.json is a few KB; this runs for every
    /// container without a request): `word` (lowercase ASCII) in any case, or `\u`.
    fn spells(&self, word: &[u8]) -> bool {
        let b = &self.bytes;
        (0..b.len()).any(|i| match b[i] {
            b'\\' => b.get(i + 1) == Some(&b'u'),
            c if c | 0x20 == word[0] => b
                .get(i..i + word.len())
                .is_some_and(|w| w.eq_ignore_ascii_case(word)),
            _ => false,
        })
    }
}

/// A loaded config.json.
pub struct SpecFile {
    path: PathBuf,
    mode: u32,
    /// The document, always a JSON object.
    pub doc: Map<String, Value>,
    /// The typed view of the fields gpushare reads, as loaded.
    pub typed: SpecView,
}

impl SpecFile {
    pub(crate) fn load(path: &Path) -> Result<Self, SpecError> {
        let raw = Self::read(path)?;
        Self::parse(path, &raw.bytes, raw.mode)
    }

    /// Parses what `read` returned.
    pub(crate) fn from_raw(raw: &RawSpec) -> Result<Self, SpecError> {
        Self::parse(&raw.path, &raw.bytes, raw.mode)
    }

    /// Reads config.json (a symlink or a non-regular file is refused).
    pub(crate) fn read(path: &Path) -> Result<RawSpec, SpecError> {
        let read_err = |source| SpecError::Read {
            path: path.to_owned(),
            source,
        };
        let mut f = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(nix::libc::O_NOFOLLOW)
            .open(path)
            .map_err(read_err)?;
        let md = f.metadata().map_err(read_err)?;
        if !md.is_file() {
            return Err(SpecError::Invalid {
                path: path.to_owned(),
                message: "not a regular file".into(),
            });
        }
        let mut bytes = Vec::with_capacity(md.len() as usize + 1);
        f.read_to_end(&mut bytes).map_err(read_err)?;
        Ok(RawSpec {
            path: path.to_owned(),
            mode: md.permissions().mode() & 0o7777,
            bytes,
        })
    }

    /// Parses config.json bytes (as `load` does after reading); `path` names it in errors
    /// and is where `save` would write.
    pub fn from_bytes(path: &Path, bytes: &[u8]) -> Result<Self, SpecError> {
        Self::parse(path, bytes, 0o644)
    }

    pub(crate) fn parse(path: &Path, bytes: &[u8], mode: u32) -> Result<Self, SpecError> {
        let invalid = |message: String| SpecError::Invalid {
            path: path.to_owned(),
            message,
        };
        let value: Value = serde_json::from_slice(bytes).map_err(|e| invalid(e.to_string()))?;
        let typed = SpecView::deserialize(&value).map_err(|e| invalid(e.to_string()))?;
        let Value::Object(doc) = value else {
            return Err(invalid("not a JSON object".into()));
        };
        Ok(SpecFile {
            path: path.to_owned(),
            mode,
            doc,
            typed,
        })
    }

    /// The whole document checked against oci-spec's typed `Spec` (strict): what runc
    /// will accept. Not on the create path (see the module doc).
    pub fn check_typed(&self) -> Result<Spec, SpecError> {
        Spec::deserialize(&Value::Object(self.doc.clone())).map_err(|e| SpecError::Invalid {
            path: self.path.clone(),
            message: e.to_string(),
        })
    }

    /// Where it was read from (and `save` writes).
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Looks up an annotation.
    pub(crate) fn annotation(&self, key: &str) -> Option<&str> {
        self.typed
            .annotations
            .as_ref()?
            .get(key)
            .map(String::as_str)
    }

    /// Whether gpushare-runtime prepared this spec: its `createRuntime` hooks hold
    /// gpushare's `hook create-runtime`, which only the shim puts there. Hooks are the
    /// engine's and the operator's to write (Docker, containerd's CRI plugin, Podman and
    /// CRI-O give a container's author no way to add one), unlike annotations, which the
    /// author writes: what a container carries never decides this.
    pub(crate) fn prepared_by_shim(&self) -> bool {
        self.doc
            .get("hooks")
            .and_then(|h| h.get("createRuntime"))
            .and_then(Value::as_array)
            .is_some_and(|list| {
                list.iter()
                    .any(|h| gpushare_hook_stage(h) == Some("create-runtime"))
            })
    }

    /// The `--cdi-device` requests among a spec's hooks of one stage: each of gpushare's
    /// `hook prestart` hooks that carries arguments after the stage. A hook with
    /// unreadable ones is an error.
    pub(crate) fn cdi_asks_in(
        list: &[Value],
    ) -> Result<Vec<crate::request::CdiAsk>, crate::request::BadHookArgs> {
        list.iter()
            .filter(|h| gpushare_hook_stage(h) == Some("prestart"))
            .filter_map(|h| {
                let args: Vec<&str> = h
                    .get("args")
                    .and_then(Value::as_array)?
                    .iter()
                    .map(|a| a.as_str().unwrap_or(""))
                    .collect();
                crate::request::CdiAsk::from_flags(args.get(3..).unwrap_or(&[])).transpose()
            })
            .collect()
    }

    /// The request of the CDI device of gpushare's this spec carries, if any: the
    /// `--cdi-device` arguments of its gpushare `prestart` hook, which only a CDI spec (the
    /// node's: see `cdi`) puts there, never a container's author. More than one such hook
    /// (two devices, or one twice) is refused: each would serve the container.
    pub(crate) fn cdi_ask(&self) -> anyhow::Result<Option<crate::request::CdiAsk>> {
        let list = self
            .doc
            .get("hooks")
            .and_then(|h| h.get("prestart"))
            .and_then(Value::as_array)
            .map(Vec::as_slice)
            .unwrap_or(&[]);
        let mut asks = Self::cdi_asks_in(list)?;
        match asks.len() {
            0 | 1 => Ok(asks.pop()),
            n => {
                let names: Vec<String> = asks
                    .iter()
                    .map(|a| format!("{}={}", crate::request::CDI_KIND, a.name()))
                    .collect();
                anyhow::bail!(
                    "the container has {n} CDI devices of gpushare ({}): allowed is one; ask for several GPUs with one gpushare.io/device list instead",
                    names.join(", ")
                )
            }
        }
    }

    /// `process.env`, empty when absent.
    pub fn env(&self) -> &[String] {
        self.typed
            .process
            .as_ref()
            .and_then(|p| p.env.as_deref())
            .unwrap_or(&[])
    }

    /// What the request pipeline reads (`request::parse`), borrowed from the typed view.
    pub fn request_inputs(&self) -> crate::request::Inputs<'_> {
        let linux = self.typed.linux.as_ref();
        crate::request::Inputs {
            annotations: self.typed.annotations.as_ref(),
            env: self.env(),
            mounts: self.typed.mounts.as_deref().unwrap_or(&[]),
            devices: linux.and_then(|l| l.devices.as_deref()).unwrap_or(&[]),
            all_devices_allowed: linux
                .and_then(|l| l.resources.as_ref())
                .and_then(|r| r.devices.as_deref())
                .unwrap_or(&[])
                .iter()
                .any(allows_every_device),
        }
    }

    /// The container user's host UID and GID: `process.user` mapped through the container's
    /// user namespace when it has one, new or joined by path (containerd's CRI gives the
    /// containers of a `hostUsers: false` pod the sandbox's namespace by path, with the
    /// mappings): through `linux.uidMappings`/`gidMappings` when the spec has them, else,
    /// for a namespace joined as `/proc/<pid>/ns/user`, through that process's
    /// `uid_map`/`gid_map`. Anything else is refused: a user namespace gpushare cannot map
    /// would get a daemon of the wrong host user.
    pub fn host_user(&self) -> Result<(u32, u32), SpecError> {
        self.host_user_with(crate::userns::read_proc)
    }

    /// [`SpecFile::host_user`], reading a joined namespace's maps with `read_proc(pid)`.
    pub(crate) fn host_user_with(
        &self,
        read_proc: impl FnOnce(u32) -> Result<(Vec<IdRange>, Vec<IdRange>), String>,
    ) -> Result<(u32, u32), SpecError> {
        let (uid, gid) = self
            .typed
            .process
            .as_ref()
            .map(|p| (p.user.uid(), p.user.gid()))
            .unwrap_or((0, 0));
        let Some(maps) = self.user_maps_with(read_proc)? else {
            return Ok((uid, gid));
        };
        let whose = &maps.whose;
        let map = |id: u32, ranges: &[IdRange], what: &str| {
            crate::userns::to_host(ranges, id).ok_or_else(|| SpecError::User {
                message: format!(
                    "process.user.{what} {id} has no mapping in {whose}{what}{} of the container's user namespace: allowed is an id inside one of its mapped ranges",
                    if whose.starts_with("linux.") { "Mappings" } else { "_map" }
                ),
            })
        };
        Ok((map(uid, &maps.uids, "uid")?, map(gid, &maps.gids, "gid")?))
    }

    /// The id maps of the container's user namespace, `None` without one: the spec's
    /// `linux.uidMappings`/`gidMappings`, whether the namespace is new or joined by path,
    /// or, for one joined as `/proc/<pid>/ns/user` without them, that process's maps.
    pub(crate) fn user_maps(&self) -> Result<Option<UserMaps>, SpecError> {
        self.user_maps_with(crate::userns::read_proc)
    }

    fn user_maps_with(
        &self,
        read_proc: impl FnOnce(u32) -> Result<(Vec<IdRange>, Vec<IdRange>), String>,
    ) -> Result<Option<UserMaps>, SpecError> {
        let Some(linux) = self.typed.linux.as_ref() else {
            return Ok(None);
        };
        let Some(ns) = linux
            .namespaces
            .as_deref()
            .unwrap_or(&[])
            .iter()
            .find(|n| n.typ() == LinuxNamespaceType::User)
        else {
            return Ok(None);
        };
        let ranges = |maps: &Option<Vec<LinuxIdMapping>>| -> Vec<IdRange> {
            maps.as_deref()
                .unwrap_or(&[])
                .iter()
                .map(|m| IdRange {
                    container: m.container_id(),
                    host: m.host_id(),
                    size: m.size(),
                })
                .collect()
        };
        let (uids, gids) = (ranges(&linux.uid_mappings), ranges(&linux.gid_mappings));
        let (uids, gids, whose) = match ns.path() {
            Some(path) if uids.is_empty() && gids.is_empty() => {
                let shown = path.display().to_string();
                let pid = crate::userns::proc_pid(path).ok_or_else(|| SpecError::User {
                    message: format!(
                        "linux.namespaces joins the user namespace {} without linux.uidMappings, and gpushare cannot read that namespace's maps to find the container user's host uid; allowed is a user namespace joined as /proc/<pid>/ns/user, or one given with linux.uidMappings and gidMappings",
                        crate::device::quote(&shown)
                    ),
                })?;
                let (uids, gids) = read_proc(pid).map_err(|e| SpecError::User {
                    message: format!(
                        "linux.namespaces joins the user namespace {} without linux.uidMappings, and its maps cannot be read: {e}",
                        crate::device::quote(&shown)
                    ),
                })?;
                (uids, gids, format!("/proc/{pid}/"))
            }
            _ => (uids, gids, "linux.".to_owned()),
        };
        Ok(Some(UserMaps { uids, gids, whose }))
    }

    /// Serialises the document (compact, as engines write it). A JSON object does not
    /// fail to serialise today, but if it did, the error comes back rather than empty
    /// bytes that `save` would write over config.json.
    pub fn to_bytes(&self) -> Result<Vec<u8>, SpecError> {
        serde_json::to_vec(&self.doc).map_err(|source| SpecError::Serialise {
            path: self.path.clone(),
            source,
        })
    }

    /// Writes the document back atomically, keeping the file's mode; writes nothing if it
    /// does not serialise. Not fsynced: the rename is atomic, and after a crash the
    /// container is gone along with what its config.json said (two fsyncs cost 0.2-0.4 ms
    /// per create: BENCHMARKS.md).
    pub(crate) fn save(&self) -> Result<(), SpecError> {
        crate::fsops::write_atomic_with(&self.path, &self.to_bytes()?, self.mode, false).map_err(
            |source| SpecError::Write {
                path: self.path.clone(),
                source,
            },
        )
    }
}

/// The `gpushare hook <stage>` argument of hook `h` when it is one of gpushare's (a
/// `gpushare` binary, any directory, whose args are `gpushare hook …`).
pub(crate) fn gpushare_hook_stage(h: &Value) -> Option<&str> {
    let args: Vec<&str> = h
        .get("args")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let path = h.get("path").and_then(Value::as_str).unwrap_or("");
    let named = |s: &str| s.rsplit('/').next() == Some("gpushare");
    (named(path) && args.get(1) == Some(&"hook")).then(|| args.get(2).copied().unwrap_or(""))
}

/// A container's user namespace id maps (`SpecFile::user_maps`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct UserMaps {
    pub uids: Vec<IdRange>,
    pub gids: Vec<IdRange>,
    /// Where they were read, for messages: `linux.` or `/proc/<pid>/`.
    whose: String,
}

/// A device cgroup rule that allows every device, as engines write for a privileged
/// container (`{"allow": true, "access": "rwm"}`).
fn allows_every_device(rule: &LinuxDeviceCgroup) -> bool {
    rule.allow()
        && matches!(rule.typ(), None | Some(LinuxDeviceType::A))
        && rule.major().is_none_or(|m| m < 0)
        && rule.minor().is_none_or(|m| m < 0)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) const FIXTURES: &[&str] = &[
        "docker-20.10-config.json",
        "docker-20.10-ipc-host-config.json",
        "containerd-1.6-config.json",
        "podman-4.3-config.json",
    ];

    pub(crate) fn fixture(name: &str) -> Vec<u8> {
        std::fs::read(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tests/fixtures")
                .join(name),
        )
        .unwrap()
    }

    #[test]
    fn fixtures_round_trip_without_loss() {
        for name in FIXTURES {
            let bytes = fixture(name);
            let spec = SpecFile::parse(Path::new(name), &bytes, 0o644).unwrap();
            let original: Value = serde_json::from_slice(&bytes).unwrap();
            let again: Value = serde_json::from_slice(&spec.to_bytes().unwrap()).unwrap();
            assert_eq!(original, again, "{name}");
        }
    }

    #[test]
    fn only_the_shims_create_runtime_hook_marks_a_spec_prepared() {
        use edits::SpecEdit;
        for name in FIXTURES {
            let bytes = fixture(name);
            let mut spec = SpecFile::parse(Path::new(name), &bytes, 0o644).unwrap();
            assert!(!spec.prepared_by_shim(), "{name}");
            // What a container's author can write: the decision annotations, and gpushare's
            // prestart (hook-only) and poststop hooks come from the operator's base spec.
            let ann = spec
                .doc
                .entry("annotations")
                .or_insert_with(|| serde_json::json!({}));
            ann["gpushare.io/daemon"] = "0".repeat(32).into();
            let hook_only = edits::SetHooks {
                binary: "/usr/bin/gpushare".into(),
                env: vec![],
                stages: vec![("prestart", "prestart", 20), ("poststop", "poststop", 10)],
            };
            hook_only.apply(&mut spec.doc).unwrap();
            assert!(!spec.prepared_by_shim(), "{name}");
            let shim = edits::SetHooks {
                stages: vec![("createRuntime", "create-runtime", 15)],
                ..hook_only
            };
            shim.apply(&mut spec.doc).unwrap();
            assert!(spec.prepared_by_shim(), "{name}");
        }
    }

    #[test]
    fn unknown_fields_survive_and_keep_order() {
        let mut v: Value = serde_json::from_slice(&fixture("containerd-1.6-config.json")).unwrap();
        v["zzFuture"] = serde_json::json!({"a": [1, 2]});
        v["process"]["aNewProcessField"] = Value::Bool(true);
        let bytes = serde_json::to_vec(&v).unwrap();
        let spec = SpecFile::parse(Path::new("x"), &bytes, 0o644).unwrap();
        assert_eq!(spec.to_bytes().unwrap(), bytes);
    }

    /// `bytes` are refused as no valid OCI runtime spec (`why`: why they must be).
    fn refused_as_invalid(bytes: &[u8], why: &str) {
        let err = SpecFile::parse(Path::new("cfg"), bytes, 0o644)
            .err()
            .expect(why);
        assert_invalid(&err);
    }

    fn assert_invalid(err: &impl std::fmt::Display) {
        assert!(
            err.to_string().contains("not a valid OCI runtime spec"),
            "{err}"
        );
    }

    #[test]
    fn malformed_specs_are_refused() {
        for bad in [
            &b"{"[..],
            b"[]",
            b"{\"ociVersion\": 5}",
            b"{\"ociVersion\":\"1.0.2\",\"process\":{\"env\":\"x\"}}",
        ] {
            refused_as_invalid(bad, "refused");
        }
    }

    #[test]
    fn one_cdi_device_of_gpushare_is_the_request_two_are_refused() {
        let hook = |args: &[&str]| serde_json::json!({"path": "/usr/bin/gpushare", "args": args});
        let mut v: Value = serde_json::from_slice(&fixture("podman-4.3-config.json")).unwrap();
        let spec = |v: &Value| {
            SpecFile::parse(Path::new("c"), &serde_json::to_vec(v).unwrap(), 0o644).unwrap()
        };
        assert!(spec(&v).cdi_ask().unwrap().is_none());
        // The hooks.d hook (no arguments) and other programs' hooks are no CDI request.
        v["hooks"] = serde_json::json!({"prestart": [
            hook(&["gpushare", "hook", "prestart"]),
            {"path": "/usr/bin/other", "args": ["other", "hook", "prestart", "--cdi-device", "1"]},
        ]});
        assert!(spec(&v).cdi_ask().unwrap().is_none());
        v["hooks"]["prestart"].as_array_mut().unwrap().push(hook(&[
            "gpushare",
            "hook",
            "prestart",
            "--cdi-device",
            "0",
            "--profile",
            "small",
        ]));
        let ask = spec(&v).cdi_ask().unwrap().unwrap();
        assert_eq!(ask.name(), "0-small");
        // A CDI hook in another stage asks for nothing.
        v["hooks"]["poststart"] =
            serde_json::json!([hook(&["gpushare", "hook", "prestart", "--cdi-device", "2"])]);
        assert_eq!(spec(&v).cdi_ask().unwrap().unwrap().name(), "0-small");
        for second in ["0", "2"] {
            let mut two = v.clone();
            two["hooks"]["prestart"]
                .as_array_mut()
                .unwrap()
                .push(hook(&[
                    "gpushare",
                    "hook",
                    "prestart",
                    "--cdi-device",
                    second,
                ]));
            let err = spec(&two).cdi_ask().unwrap_err().to_string();
            assert!(err.starts_with("the container has 2 CDI devices of gpushare (gpushare.io/gpu=0-small, gpushare.io/gpu="), "{err}");
        }
        let mut bad = v.clone();
        bad["hooks"]["prestart"][2] = hook(&["gpushare", "hook", "prestart", "--cdi-device"]);
        assert!(spec(&bad).cdi_ask().is_err());
    }

    /// `bytes` as an engine's config.json, not yet parsed.
    fn raw(bytes: &[u8]) -> RawSpec {
        RawSpec {
            path: "config.json".into(),
            mode: 0o644,
            bytes: bytes.to_vec(),
        }
    }

    #[test]
    fn may_request_sees_every_spelling_and_only_those() {
        for name in FIXTURES {
            // Real engines' specs: the fast path exactly for those without a request.
            let bytes = fixture(name);
            let spec = SpecFile::parse(Path::new(name), &bytes, 0o644).unwrap();
            let asks = spec.annotation("gpushare.io/device").is_some()
                || spec.env().iter().any(|e| e.starts_with("GPUSHARE_"));
            assert_eq!(raw(&bytes).may_request(), asks, "{name}");
        }
        assert!(!raw(&fixture("docker-20.10-ipc-host-config.json")).may_request());
        assert!(!raw(br#"{"ociVersion":"1.0.2","annotations":{"other.io/x":"1"}}"#).may_request());
        for yes in [
            &br#"{"annotations":{"gpushare.io/device":"0"}}"#[..],
            br#"{"process":{"env":["GPUSHARE_DEVICE=0"]}}"#,
            br#"{"annotations":{"GpuShare.io/device":"0"}}"#,
            br#"{"annotations":{"\u0067pushare.io/device":"0"}}"#,
        ] {
            assert!(raw(yes).may_request(), "{}", String::from_utf8_lossy(yes));
        }
    }

    #[test]
    fn may_hold_allocation_sees_nvidia_in_any_case_and_escapes() {
        for name in FIXTURES {
            // None of the captured engines' specs mentions an NVIDIA device.
            assert!(!raw(&fixture(name)).may_hold_allocation(), "{name}");
        }
        for yes in [
            &br#"{"process":{"env":["NVIDIA_VISIBLE_DEVICES=0"]}}"#[..],
            br#"{"mounts":[{"destination":"/var/run/nvidia-container-devices/0"}]}"#,
            br#"{"linux":{"devices":[{"path":"\/dev\/nvidia0","type":"c"}]}}"#,
            br#"{"annotations":{"cdi.k8s.io/x":"nvidia.com/gpu=0"}}"#,
            br#"{"process":{"env":["NVIDIA_VISIBLE_DEVICES=0"]}}"#,
        ] {
            assert!(
                raw(yes).may_hold_allocation(),
                "{}",
                String::from_utf8_lossy(yes)
            );
        }
        assert!(!raw(br#"{"process":{"env":["NVIDI_VISIBLE=0"]}}"#).may_hold_allocation());
    }

    #[test]
    fn request_inputs_read_mounts_devices_and_privilege() {
        let mut v: Value = serde_json::from_slice(&fixture("containerd-1.6-config.json")).unwrap();
        let spec = |v: &Value| {
            SpecFile::parse(Path::new("c"), &serde_json::to_vec(v).unwrap(), 0o644).unwrap()
        };
        let s = spec(&v);
        let inputs = s.request_inputs();
        assert_eq!(inputs.mounts.len(), 7);
        assert_eq!(inputs.mounts[3].destination(), Path::new("/dev/shm"));
        assert!(inputs.devices.is_empty());
        assert_eq!(inputs.annotation("gpushare.io/device"), Some("0"));
        // Its device rules allow some devices, not every one.
        assert!(!inputs.all_devices_allowed);
        v["linux"]["devices"] =
            serde_json::json!([{"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0}]);
        for (rules, all) in [
            (serde_json::json!([{"allow": true, "access": "rwm"}]), true),
            (
                serde_json::json!([{"allow": true, "type": "a", "access": "rwm"}]),
                true,
            ),
            (
                serde_json::json!([{"allow": false, "access": "rwm"}, {"allow": true, "access": "rwm"}]),
                true,
            ),
            (
                serde_json::json!([{"allow": false, "access": "rwm"}]),
                false,
            ),
            (
                serde_json::json!([{"allow": true, "type": "c", "access": "rwm"}]),
                false,
            ),
            (
                serde_json::json!([{"allow": true, "major": 195, "access": "rwm"}]),
                false,
            ),
        ] {
            v["linux"]["resources"]["devices"] = rules.clone();
            let s = spec(&v);
            assert_eq!(s.request_inputs().all_devices_allowed, all, "{rules}");
            assert_eq!(s.request_inputs().devices[0].minor(), 0);
        }
        // A malformed field the request reads is refused before any edit.
        v["linux"]["devices"] = serde_json::json!([{"path": "/dev/nvidia0"}]);
        refused_as_invalid(&serde_json::to_vec(&v).unwrap(), "a device without a type");
    }

    #[test]
    fn the_view_leaves_other_fields_to_runc_and_check_typed_does_not() {
        let bytes = br#"{"ociVersion":"1.0.2","hostname":5,"process":{"user":{"uid":7,"gid":8}}}"#;
        let spec = SpecFile::parse(Path::new("cfg"), bytes, 0o644).unwrap();
        assert_eq!(spec.host_user().unwrap(), (7, 8));
        let err = spec.check_typed().expect_err("hostname: 5 is not a spec");
        assert_invalid(&err);
        for name in FIXTURES {
            let spec = SpecFile::parse(Path::new(name), &fixture(name), 0o644).unwrap();
            spec.check_typed().unwrap();
        }
    }

    #[test]
    fn symlinked_config_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("real.json");
        std::fs::write(&real, fixture("containerd-1.6-config.json")).unwrap();
        let link = dir.path().join("config.json");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        assert!(matches!(SpecFile::load(&link), Err(SpecError::Read { .. })));
    }

    #[test]
    fn reads_request_inputs_from_fixtures() {
        let docker =
            SpecFile::parse(Path::new("d"), &fixture("docker-20.10-config.json"), 0o644).unwrap();
        assert!(docker.env().iter().any(|e| e == "GPUSHARE_DEVICE=0"));
        assert_eq!(docker.host_user().unwrap(), (1000, 1000));
        let ctr = SpecFile::parse(
            Path::new("c"),
            &fixture("containerd-1.6-config.json"),
            0o644,
        )
        .unwrap();
        assert_eq!(ctr.annotation("gpushare.io/device"), Some("0"));
        assert_eq!(ctr.annotation("gpushare.io/nope"), None);
    }

    /// The captured containerd spec, its process user 1000:1000, in the user namespace
    /// `userns` (a `linux.namespaces` entry).
    fn user_1000_in(userns: Value) -> Value {
        let mut v: Value = serde_json::from_slice(&fixture("containerd-1.6-config.json")).unwrap();
        v["process"]["user"]["uid"] = 1000.into();
        v["process"]["user"]["gid"] = 1000.into();
        v["linux"]["namespaces"]
            .as_array_mut()
            .unwrap()
            .push(userns);
        v
    }

    #[test]
    fn user_namespace_maps_the_uid() {
        let mut v = user_1000_in(serde_json::json!({"type": "user"}));
        v["linux"]["uidMappings"] =
            serde_json::json!([{"containerID": 0, "hostID": 100000, "size": 65536}]);
        v["linux"]["gidMappings"] =
            serde_json::json!([{"containerID": 0, "hostID": 200000, "size": 65536}]);
        let spec =
            SpecFile::parse(Path::new("u"), &serde_json::to_vec(&v).unwrap(), 0o644).unwrap();
        assert_eq!(spec.host_user().unwrap(), (101000, 201000));
        v["linux"]["uidMappings"] =
            serde_json::json!([{"containerID": 0, "hostID": 100000, "size": 10}]);
        let spec =
            SpecFile::parse(Path::new("u"), &serde_json::to_vec(&v).unwrap(), 0o644).unwrap();
        let err = spec.host_user().unwrap_err().to_string();
        assert!(
            err.contains("uid 1000") && err.contains("uidMappings"),
            "{err}"
        );
    }

    /// containerd's CRI container of a `hostUsers: false` pod: the sandbox's user namespace
    /// joined by path, with the mappings (the captured containerd spec, reshaped so).
    fn joined_userns(path: &str, mappings: bool) -> SpecFile {
        let mut v = user_1000_in(serde_json::json!({"type": "user", "path": path}));
        if mappings {
            v["linux"]["uidMappings"] =
                serde_json::json!([{"containerID": 0, "hostID": 200000, "size": 65536}]);
            v["linux"]["gidMappings"] =
                serde_json::json!([{"containerID": 0, "hostID": 200000, "size": 65536}]);
        }
        SpecFile::parse(Path::new("u"), &serde_json::to_vec(&v).unwrap(), 0o644).unwrap()
    }

    #[test]
    fn a_joined_user_namespace_maps_the_uid_too() {
        let no_proc = |_| -> Result<(Vec<IdRange>, Vec<IdRange>), String> {
            panic!("the spec's mappings are used")
        };
        // Joined by path with the spec's mappings: uid 1000 is host 201000, never 1000.
        let spec = joined_userns("/proc/4242/ns/user", true);
        assert_eq!(spec.host_user_with(no_proc).unwrap(), (201000, 201000));
        // Joined by path without mappings: that process's maps.
        let spec = joined_userns("/proc/4242/ns/user", false);
        let maps = |pid| {
            assert_eq!(pid, 4242);
            let m = crate::userns::parse("0 300000 65536\n").unwrap();
            Ok((m.clone(), m))
        };
        assert_eq!(spec.host_user_with(maps).unwrap(), (301000, 301000));
        let err = spec
            .host_user_with(|_| Err("cannot read /proc/4242/uid_map: gone".into()))
            .unwrap_err()
            .to_string();
        assert_eq!(err, "linux.namespaces joins the user namespace \"/proc/4242/ns/user\" without linux.uidMappings, and its maps cannot be read: cannot read /proc/4242/uid_map: gone");
        let small = |_| {
            let m = crate::userns::parse("0 300000 10\n").unwrap();
            Ok((m.clone(), m))
        };
        let err = spec.host_user_with(small).unwrap_err().to_string();
        assert_eq!(err, "process.user.uid 1000 has no mapping in /proc/4242/uid_map of the container's user namespace: allowed is an id inside one of its mapped ranges");
        // Any other path, without mappings: refused in one line.
        let spec = joined_userns("/run/userns/pod-a", false);
        let err = spec.host_user_with(no_proc).unwrap_err().to_string();
        assert_eq!(err, "linux.namespaces joins the user namespace \"/run/userns/pod-a\" without linux.uidMappings, and gpushare cannot read that namespace's maps to find the container user's host uid; allowed is a user namespace joined as /proc/<pid>/ns/user, or one given with linux.uidMappings and gidMappings");
    }
}
