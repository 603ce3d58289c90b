//! One container engine, as `install`, `uninstall`, `install cdi --enable`, `doctor` and
//! the CLI use it: each engine is one implementation of [`EngineConfig`] (in its own
//! module, beside the pure edits of its config), listed once in [`ENGINES`]. Nothing
//! outside an engine's module branches on which engine it is; what only one engine has
//! (containerd's hook-only runtime and NRI) stays a command of that engine's own.

use std::path::{Path, PathBuf};

use super::file::{Edited, InstallError};

/// One container engine's config: where it is, the edits gpushare makes to it and takes
/// back, how doctor reads it, and what the operator does after each.
pub(crate) trait EngineConfig: Sync {
    /// Its name on the command line and in doctor's report: `docker`.
    fn name(&self) -> &'static str;
    /// The config file the engine reads unless told otherwise.
    fn default_config(&self) -> &'static str;
    /// The socket whose presence tells doctor the engine runs here.
    fn default_socket(&self) -> &'static str;
    /// `text` with runtime `name` running the shim at `runtime`; `version` gives the
    /// config version of a new file, for an engine whose format has versions.
    fn edit(
        &self,
        path: &Path,
        text: &str,
        name: &str,
        runtime: &Path,
        version: &dyn Fn() -> i64,
    ) -> Result<Edited, InstallError>;
    /// `text` (read from `path`) without runtime `name` and what goes with it.
    fn remove(&self, path: &Path, text: &str, name: &str) -> Result<Removal, InstallError>;
    /// `text` with CDI on, reading specs from `dir`.
    fn enable_cdi(
        &self,
        path: &Path,
        text: &str,
        dir: &Path,
        version: &dyn Fn() -> i64,
    ) -> Result<Edited, InstallError>;
    /// How to ask this engine for a CDI device from the specs in `dir`: one line.
    fn cdi_usage(&self, dir: &Path) -> String;
    /// What to do for CDI turned on in the config to take effect.
    fn cdi_restart(&self) -> &'static str;
    /// What the operator does next for the engine to use runtime `name`.
    fn next_steps(&self, name: &str) -> Vec<String>;
    /// What the operator does for the engine to forget runtime `name`; `restored`: the
    /// config was given back as it was before the first install.
    fn forget_steps(&self, name: &str, restored: bool) -> Vec<String>;
    /// Doctor's finding on the config at `config` (read here) and the engine's socket.
    fn check(&self, config: &Path, socket: &Path) -> Finding;
}

/// What `uninstall` takes out of one engine's config.
pub(crate) struct Removal {
    /// The text without the runtime; `None`: it registers none.
    pub runtime: Option<String>,
    /// The text (after `runtime`) without other settings of ours that nothing needs any
    /// more, and what to say when that text is kept rather than the original restored.
    pub also: Option<(String, String)>,
    /// Files of ours that go with the runtime, each with what to say once it is deleted.
    pub files: Vec<(PathBuf, Option<String>)>,
}

/// Doctor's finding on one engine: all is well (`fix` is `None`), or what to run.
pub(crate) struct Finding {
    pub detail: String,
    pub fix: Option<&'static str>,
}

/// Every engine gpushare installs into, in doctor's order.
pub(crate) static ENGINES: &[&dyn EngineConfig] =
    &[&super::docker::Docker, &super::containerd::Containerd];

/// The engine called `name` on the command line.
pub(crate) fn named(name: &str) -> Option<&'static dyn EngineConfig> {
    ENGINES.iter().copied().find(|e| e.name() == name)
}

/// Whether an engine serves on this node: its socket exists.
pub(crate) fn serving(socket: &Path) -> bool {
    use std::os::unix::fs::FileTypeExt;
    std::fs::metadata(socket).is_ok_and(|m| m.file_type().is_socket())
}
