//! `StateDir`, the one type that owns every host path gpushare uses, laid out as the
//! module's header shows, and `StateError`, the error of every state operation.
//!
//! Invariant: every path under the state directory is built here; the other files of the
//! module (records, locks, a daemon's directories, reclaim, removal) add their methods to
//! `StateDir` and take it, `StateError` and `io` from here, never from the module root, so
//! the module's files depend one way.

use std::fs::DirBuilder;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::identity::valid_id;

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("cannot {op} {path}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("state directory {path} is unusable: {why}")]
    Unsafe { path: PathBuf, why: String },
    #[error(
        "timed out after {waited:?} waiting for the lock {path}: another gpushare process holds it"
    )]
    LockTimeout { path: PathBuf, waited: Duration },
    #[error("cannot mount the {what} tmpfs on {path}")]
    Mount {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: nix::Error,
    },
    #[error("invalid {what} {value:?}: {allowed}")]
    Name {
        what: &'static str,
        value: String,
        allowed: &'static str,
    },
    #[error("MPS pipe path {path} is {len} bytes: a Unix socket path must be shorter than 108; use a shorter state-dir")]
    SocketPathTooLong { path: PathBuf, len: usize },
    #[error("corrupt record {path}: {message}")]
    Corrupt { path: PathBuf, message: String },
    #[error("cannot serialise the record {path}")]
    Serialise {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("cannot start another MPS daemon {scope}: {key} = {cap} {why}; their containers free their place when they end (gpushare status), or raise it in {config}")]
    DaemonCap {
        /// `for uid 1000`, `on this node`.
        scope: String,
        key: &'static str,
        /// The cap as configured: `64`, `8 GiB`.
        cap: String,
        /// `reached (64 daemons, none idle)`.
        why: String,
        config: PathBuf,
    },
}

pub(super) fn io<'a>(
    op: &'static str,
    path: &'a Path,
) -> impl FnOnce(std::io::Error) -> StateError + 'a {
    move |source| StateError::Io {
        op,
        path: path.to_owned(),
        source,
    }
}

#[derive(Debug, Clone)]
pub struct StateDir {
    root: PathBuf,
}

impl StateDir {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        StateDir { root: root.into() }
    }

    pub(crate) fn root(&self) -> &Path {
        &self.root
    }
    pub(crate) fn mps_dir(&self) -> PathBuf {
        self.root.join("mps")
    }
    pub(crate) fn daemon_dir(&self, id: &str) -> PathBuf {
        self.mps_dir().join(id)
    }
    pub(crate) fn pipe_dir(&self, id: &str) -> PathBuf {
        self.daemon_dir(id).join("pipe")
    }
    /// A v3 daemon's namespace `name`'s directory: `<pipe>/s/<name>`, which MPS makes.
    pub(crate) fn namespace_dir(&self, id: &str, name: &str) -> PathBuf {
        self.pipe_dir(id)
            .join(crate::identity::V3_SERVER)
            .join(name)
    }
    pub(crate) fn log_dir(&self, id: &str) -> PathBuf {
        self.daemon_dir(id).join("log")
    }
    pub(crate) fn shm_dir(&self, id: &str) -> PathBuf {
        self.daemon_dir(id).join("shm")
    }
    /// Links to the driver libraries under `driver-root`, the daemon's `LD_LIBRARY_PATH`
    /// (root's, 0755; made by the supervisor before each start of the daemon).
    pub(crate) fn driver_lib_dir(&self, id: &str) -> PathBuf {
        self.daemon_dir(id).join("lib")
    }
    /// A multi-user daemon's privileged view: a root-only (0700) directory whose
    /// `control` and `control_privileged` are links to the daemon's `control_privileged`,
    /// so that a control client pointed at it reaches that socket whichever name it opens
    /// (`mps::control`). Relative links: they still lead there in a tombstone.
    pub(crate) fn privileged_view(&self, id: &str) -> PathBuf {
        self.daemon_dir(id).join("priv")
    }
    /// Makes the privileged view of daemon `id` (its directory is root's and exists).
    pub(crate) fn make_privileged_view(&self, id: &str) -> Result<(), StateError> {
        Self::check_id(id)?;
        let view = self.privileged_view(id);
        Self::ensure_dir(&view, 0o700, 0, 0)?;
        let target = Path::new("../pipe/control_privileged");
        for name in ["control", "control_privileged"] {
            let link = view.join(name);
            match std::fs::read_link(&link) {
                Ok(to) if to == target => continue,
                Ok(_) => std::fs::remove_file(&link).map_err(io("remove", &link))?,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                // Not a link: only root writes here; replace whatever it is.
                Err(_) => crate::fsops::remove_all(&link).map_err(io("remove", &link))?,
            }
            std::os::unix::fs::symlink(target, &link).map_err(io("link", &link))?;
        }
        Ok(())
    }
    pub(crate) fn containers_dir(&self, id: &str) -> PathBuf {
        self.daemon_dir(id).join("containers")
    }
    /// The lock of daemon `id`'s container records (`lock::Hold`): in `containers/`, so it
    /// goes with the daemon's directory and no record can outlive its lock.
    pub(crate) fn records_lock_path(&self, id: &str) -> PathBuf {
        self.containers_dir(id).join("records.lock")
    }
    pub(crate) fn record_path(&self, id: &str) -> PathBuf {
        self.daemon_dir(id).join("daemon.json")
    }
    pub(crate) fn lock_path(&self, id: &str) -> PathBuf {
        self.root.join("locks").join(format!("{id}.lock"))
    }
    pub(crate) fn supervisor_lock_path(&self, id: &str) -> PathBuf {
        self.root.join("locks").join(format!("{id}.sup"))
    }
    /// The node lock: not a daemon id, so no identity's lock can be it.
    pub(crate) fn node_lock_path(&self) -> PathBuf {
        self.root.join("locks").join("node.lock")
    }
    /// The agent's lock: not a daemon id either.
    pub(crate) fn agent_lock_path(&self) -> PathBuf {
        self.root.join("locks").join("agent.lock")
    }
    /// The GPU process watcher's lock (`watch`): not a daemon id either.
    pub(crate) fn watch_lock_path(&self) -> PathBuf {
        self.root.join("locks").join("watch.lock")
    }
    /// Where the node's agent listens (`mps::agent`).
    pub(crate) fn agent_socket(&self) -> PathBuf {
        self.root.join("agent.sock")
    }
    /// What the NRI plugin says of itself (`nri::PluginState`): root's, 0644, read by
    /// `doctor` and `status`.
    pub(crate) fn nri_state_path(&self) -> PathBuf {
        self.root.join("nri.json")
    }
    /// What the NRI validator says of itself (`nri::validator`), as `nri_state_path`.
    pub(crate) fn nri_validator_state_path(&self) -> PathBuf {
        self.root.join("nri-validator.json")
    }
    /// The NRI validator's lock, held by the node's one connected validator for its
    /// whole life: not a daemon id either.
    pub(crate) fn nri_validator_lock_path(&self) -> PathBuf {
        self.root.join("locks").join("nri-validator.lock")
    }
    /// What the GPU process watcher found at its last scan (`watch::report`): root's,
    /// 0600, read by `status`.
    pub(crate) fn watch_report_path(&self) -> PathBuf {
        self.root.join("watch.json")
    }
    pub(crate) fn control_socket(&self, id: &str) -> PathBuf {
        self.pipe_dir(id).join("control")
    }

    pub(super) fn check_id(id: &str) -> Result<(), StateError> {
        if valid_id(id) {
            Ok(())
        } else {
            Err(StateError::Name {
                what: "daemon id",
                value: id.chars().take(64).collect(),
                allowed: crate::identity::ID_ALLOWED,
            })
        }
    }

    /// Makes `path` a directory with exactly `mode` and owner, refusing a symlink or a
    /// non-directory in its place.
    pub(super) fn ensure_dir(path: &Path, mode: u32, uid: u32, gid: u32) -> Result<(), StateError> {
        match DirBuilder::new().mode(mode).create(path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(io("create directory", path)(e)),
        }
        let md = std::fs::symlink_metadata(path).map_err(io("inspect", path))?;
        if !md.is_dir() {
            return Err(StateError::Unsafe {
                path: path.to_owned(),
                why: "it is not a directory (a symlink is refused)".into(),
            });
        }
        if md.uid() != uid || md.gid() != gid {
            nix::unistd::chown(path, Some(uid.into()), Some(gid.into()))
                .map_err(|e| io("chown", path)(std::io::Error::from_raw_os_error(e as i32)))?;
        }
        if md.mode() & 0o7777 != mode {
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
                .map_err(io("chmod", path))?;
        }
        Ok(())
    }

    /// Creates the state root (0711 root) or checks an existing one is safe.
    pub(crate) fn ensure_root(&self) -> Result<(), StateError> {
        if let Some(parent) = self.root.parent() {
            std::fs::create_dir_all(parent).map_err(io("create directory", parent))?;
        }
        match DirBuilder::new().mode(0o711).create(&self.root) {
            Ok(()) => {
                std::fs::set_permissions(&self.root, std::fs::Permissions::from_mode(0o711))
                    .map_err(io("chmod", &self.root))?;
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(io("create directory", &self.root)(e)),
        }
        let md = std::fs::symlink_metadata(&self.root).map_err(io("inspect", &self.root))?;
        let euid = nix::unistd::geteuid().as_raw();
        let why = if !md.is_dir() {
            Some("it is not a directory; it must be a root-owned directory".to_owned())
        } else if md.uid() != euid {
            Some(format!(
                "it is owned by uid {}; it must be owned by root",
                md.uid()
            ))
        } else if md.mode() & 0o022 != 0 {
            Some(format!(
                "its mode is {:04o}; it must not be writable by group or others",
                md.mode() & 0o7777
            ))
        } else {
            None
        };
        if let Some(why) = why {
            return Err(StateError::Unsafe {
                path: self.root.clone(),
                why,
            });
        }
        Self::ensure_dir(&self.mps_dir(), 0o711, euid, 0)?;
        Self::ensure_dir(&self.root.join("locks"), 0o700, euid, 0)
    }

    /// Per-user daemons run as the container's UID and must reach their pipe directory
    /// through every ancestor of the state dir: each must be searchable by others.
    pub(crate) fn check_traversable(&self) -> Result<(), StateError> {
        for dir in self.root.ancestors().skip(1) {
            let Ok(md) = std::fs::metadata(dir) else {
                continue;
            };
            if md.mode() & 0o001 == 0 {
                return Err(StateError::Unsafe {
                    path: self.root.clone(),
                    why: format!(
                        "its parent {} has mode {:04o}, so per-user MPS daemons cannot reach their pipe directory (make it searchable: chmod o+x)",
                        dir.display(),
                        md.mode() & 0o7777
                    ),
                });
            }
        }
        Ok(())
    }

    /// Ids of every daemon directory, sorted; names that are not ids are ignored.
    pub(crate) fn daemon_ids(&self) -> Result<Vec<String>, StateError> {
        let dir = self.mps_dir();
        let entries = match std::fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(io("list", &dir)(e)),
        };
        let mut ids: Vec<String> = entries
            .flatten()
            .filter_map(|e| e.file_name().to_str().map(str::to_owned))
            .filter(|n| valid_id(n))
            .collect();
        ids.sort();
        Ok(ids)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// docs/state.md's layout names every path this type owns, each on a line of its own
    /// at the depth of its parent.
    #[test]
    fn docs_state_md_lays_out_every_path() {
        let doc =
            std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/state.md"))
                .unwrap();
        let layout: Vec<&str> = doc
            .lines()
            .skip_while(|l| !l.starts_with("<state-dir>/"))
            .take_while(|l| !l.starts_with("```"))
            .collect();
        let root = StateDir::new(Path::new("/s"));
        let id = "0123456789abcdef0123456789abcdef";
        for path in [
            root.agent_lock_path(),
            root.node_lock_path(),
            root.lock_path(id),
            root.supervisor_lock_path(id),
            root.agent_socket(),
            root.nri_state_path(),
            root.nri_validator_state_path(),
            root.nri_validator_lock_path(),
            root.record_path(id),
            root.pipe_dir(id),
            root.log_dir(id),
            root.shm_dir(id),
            root.driver_lib_dir(id),
            root.containers_dir(id),
            root.records_lock_path(id),
            root.root().join(crate::inventory_cache::CACHE_FILE),
            root.root()
                .join(crate::inventory_cache::PROTOCOL_CACHE_FILE),
        ] {
            let rel = path.strip_prefix("/s").unwrap();
            let depth = rel.components().count();
            let name = rel
                .file_name()
                .unwrap()
                .to_string_lossy()
                .replace(id, "<id>");
            let name = if path.extension().is_some() {
                name
            } else {
                format!("{name}/")
            };
            let wanted = format!("{}{name} ", "  ".repeat(depth));
            assert!(
                layout.iter().any(|l| l.starts_with(&wanted)),
                "docs/state.md's layout has no line {wanted:?}"
            );
        }
    }

    #[test]
    fn the_privileged_view_leads_to_control_privileged_and_is_remade() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipped: the view is root's");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::new(dir.path());
        let id = "0123456789abcdef0123456789abcdef";
        std::fs::create_dir_all(state.pipe_dir(id)).unwrap();
        let view = state.privileged_view(id);
        std::fs::create_dir(&view).unwrap();
        // Whatever stands under the names is replaced; a second call changes nothing.
        std::fs::write(view.join("control"), "x").unwrap();
        std::os::unix::fs::symlink("/etc/passwd", view.join("control_privileged")).unwrap();
        for _ in 0..2 {
            state.make_privileged_view(id).unwrap();
            let md = std::fs::symlink_metadata(&view).unwrap();
            assert_eq!((md.mode() & 0o7777, md.uid()), (0o700, 0));
            for name in ["control", "control_privileged"] {
                assert_eq!(
                    std::fs::read_link(view.join(name)).unwrap(),
                    Path::new("../pipe/control_privileged")
                );
            }
        }
        std::fs::write(state.pipe_dir(id).join("control_privileged"), "p").unwrap();
        assert_eq!(std::fs::read(view.join("control")).unwrap(), b"p");
    }

    #[test]
    fn unsafe_root_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("state");
        std::fs::create_dir(&root).unwrap();
        std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o777)).unwrap();
        let err = StateDir::new(&root).ensure_root().unwrap_err();
        assert!(matches!(err, StateError::Unsafe { .. }), "{err}");
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(dir.path(), &link).unwrap();
        assert!(StateDir::new(&link).ensure_root().is_err());
    }

    #[test]
    fn unsearchable_parent_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let parent = dir.path().join("private");
        std::fs::create_dir(&parent).unwrap();
        std::fs::set_permissions(&parent, std::fs::Permissions::from_mode(0o700)).unwrap();
        let state = StateDir::new(parent.join("state"));
        let err = state.check_traversable().unwrap_err().to_string();
        assert!(
            err.contains("private") && err.contains("0700") && err.contains("chmod o+x"),
            "{err}"
        );
        std::fs::set_permissions(&parent, std::fs::Permissions::from_mode(0o711)).unwrap();
        assert!(state.check_traversable().is_ok());
    }
}
