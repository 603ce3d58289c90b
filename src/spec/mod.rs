//! The bundle's config.json: strict, lossless load; in-memory edits; atomic save.
//!
//! Invariants: the file is read once and parsed once into a `serde_json::Value` that keeps
//! key order and every field — including fields the oci-spec crate does not know — so a
//! round trip loses nothing. The same parsed value is checked against the typed
//! `oci_spec::runtime::Spec` (strict: a malformed spec is refused before any edit). A
//! symlink in place of config.json is refused. The write is atomic (temp file in the
//! bundle, fsync, rename) and keeps the file's mode; on any error before the rename the
//! original is untouched.

pub mod edits;

use std::io::Read;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use oci_spec::runtime::Spec;
use serde::Deserialize;
use serde_json::{Map, Value};

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
    #[error("{message}")]
    User { message: String },
}

/// A loaded config.json.
pub struct SpecFile {
    path: PathBuf,
    mode: u32,
    /// The document, always a JSON object.
    pub doc: Map<String, Value>,
    /// The typed view of the same document as it was loaded.
    pub typed: Spec,
}

impl SpecFile {
    pub fn load(path: &Path) -> Result<Self, SpecError> {
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
        Self::parse(path, &bytes, md.permissions().mode() & 0o7777)
    }

    /// Parses config.json bytes (as `load` does after reading); `path` names it in errors
    /// and is where `save` would write.
    pub fn from_bytes(path: &Path, bytes: &[u8]) -> Result<Self, SpecError> {
        Self::parse(path, bytes, 0o644)
    }

    fn parse(path: &Path, bytes: &[u8], mode: u32) -> Result<Self, SpecError> {
        let invalid = |message: String| SpecError::Invalid {
            path: path.to_owned(),
            message,
        };
        let value: Value = serde_json::from_slice(bytes).map_err(|e| invalid(e.to_string()))?;
        let typed = Spec::deserialize(&value).map_err(|e| invalid(e.to_string()))?;
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

    /// Looks up an annotation.
    pub fn annotation(&self, key: &str) -> Option<&str> {
        self.typed
            .annotations()
            .as_ref()?
            .get(key)
            .map(String::as_str)
    }

    /// `process.env`, empty when absent.
    pub fn env(&self) -> &[String] {
        self.typed
            .process()
            .as_ref()
            .and_then(|p| p.env().as_deref())
            .unwrap_or(&[])
    }

    /// The container user's host UID and GID: `process.user` mapped through
    /// `linux.uidMappings` / `gidMappings` when the container has a user namespace.
    pub fn host_user(&self) -> Result<(u32, u32), SpecError> {
        let (uid, gid) = self
            .typed
            .process()
            .as_ref()
            .map(|p| (p.user().uid(), p.user().gid()))
            .unwrap_or((0, 0));
        let Some(linux) = self.typed.linux().as_ref() else {
            return Ok((uid, gid));
        };
        let userns = linux.namespaces().as_ref().is_some_and(|ns| {
            ns.iter().any(|n| {
                n.typ() == oci_spec::runtime::LinuxNamespaceType::User && n.path().is_none()
            })
        });
        if !userns {
            return Ok((uid, gid));
        }
        let map = |id: u32, maps: &Option<Vec<oci_spec::runtime::LinuxIdMapping>>, what: &str| {
            let maps = maps.as_deref().unwrap_or(&[]);
            maps.iter()
                .find(|m| id >= m.container_id() && id - m.container_id() < m.size())
                .and_then(|m| m.host_id().checked_add(id - m.container_id()))
                .ok_or_else(|| SpecError::User {
                    message: format!(
                        "process.user.{what} {id} has no mapping in linux.{what}Mappings of the container's user namespace: allowed is an id inside one of its mapped ranges"
                    ),
                })
        };
        Ok((
            map(uid, linux.uid_mappings(), "uid")?,
            map(gid, linux.gid_mappings(), "gid")?,
        ))
    }

    /// Serialises the document (compact, as engines write it).
    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(&self.doc).unwrap_or_default()
    }

    /// Writes the document back atomically, keeping the file's mode. Not fsynced: the
    /// rename is atomic, and after a crash the container is gone along with what its
    /// config.json said (two fsyncs cost 0.2-0.4 ms per create: BENCHMARKS.md).
    pub fn save(&self) -> Result<(), SpecError> {
        crate::util::write_atomic_with(&self.path, &self.to_bytes(), self.mode, false).map_err(
            |source| SpecError::Write {
                path: self.path.clone(),
                source,
            },
        )
    }
}

#[cfg(test)]
mod tests {
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
            let again: Value = serde_json::from_slice(&spec.to_bytes()).unwrap();
            assert_eq!(original, again, "{name}");
        }
    }

    #[test]
    fn unknown_fields_survive_and_keep_order() {
        let mut v: Value = serde_json::from_slice(&fixture("containerd-1.6-config.json")).unwrap();
        v["zzFuture"] = serde_json::json!({"a": [1, 2]});
        v["process"]["aNewProcessField"] = Value::Bool(true);
        let bytes = serde_json::to_vec(&v).unwrap();
        let spec = SpecFile::parse(Path::new("x"), &bytes, 0o644).unwrap();
        assert_eq!(spec.to_bytes(), bytes);
    }

    #[test]
    fn malformed_specs_are_refused() {
        for bad in [
            &b"{"[..],
            b"[]",
            b"{\"ociVersion\": 5}",
            b"{\"ociVersion\":\"1.0.2\",\"process\":{\"env\":\"x\"}}",
        ] {
            let err = SpecFile::parse(Path::new("cfg"), bad, 0o644)
                .err()
                .expect("refused");
            assert!(
                err.to_string().contains("not a valid OCI runtime spec"),
                "{err}"
            );
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

    #[test]
    fn user_namespace_maps_the_uid() {
        let mut v: Value = serde_json::from_slice(&fixture("containerd-1.6-config.json")).unwrap();
        v["process"]["user"]["uid"] = 1000.into();
        v["process"]["user"]["gid"] = 1000.into();
        v["linux"]["namespaces"]
            .as_array_mut()
            .unwrap()
            .push(serde_json::json!({"type": "user"}));
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
}
