//! One container engine, as `install`, `uninstall`, `install cdi --enable`, `doctor` and
//! the CLI use it: each engine is one implementation of [`EngineConfig`] (in its own
//! module, beside the pure edits of its config), listed once in [`super::ENGINES`].
//! Nothing outside an engine's module branches on which engine it is: the CLI makes
//! `install <engine>`, `uninstall <engine>` and doctor's `--<engine>-config` from the
//! list, and what only one engine has (its own install flags, what follows its
//! uninstall) is a method of its implementation.
//!
//! Below the engines' modules and `ops::install` alike, with what they share: the flags
//! every engine's install takes ([`Install`]), how a config runs gpushare
//! ([`Registration`]), and the install itself ([`run`]: the trait's default `install`,
//! which an engine with flags of its own calls too), so that nothing here uses the module
//! that lists the engines.

use std::path::{Path, PathBuf};

use super::file::{self, Edited, InstallError};
use super::undo;
use crate::config::Config;

/// One container engine's config: where it is, the edits gpushare makes to it and takes
/// back, how doctor reads it, and what the operator does after each.
/// What an engine is, as data: its name, where its config and socket are, and the texts
/// help and `install cdi --enable` show for it. One row per engine, in its module.
#[derive(Debug)]
pub(crate) struct About {
    /// Its name on the command line and in doctor's report: `docker`.
    pub name: &'static str,
    /// The config file the engine reads unless told otherwise.
    pub default_config: &'static str,
    /// The socket whose presence tells doctor the engine runs here.
    pub default_socket: &'static str,
    /// How help texts name its config file: `Docker's daemon.json`.
    pub config_name: &'static str,
    /// `gpushare install <name>`'s help line.
    pub install_about: &'static str,
    /// `gpushare uninstall <name>`'s help line.
    pub uninstall_about: &'static str,
    /// The settings [`EngineConfig::enable_cdi`] makes, for `install cdi --enable`'s help:
    /// `` `features.cdi`, `cdi-spec-dirs` ``.
    pub cdi_settings: &'static str,
    /// What to do for CDI turned on in the config to take effect.
    pub cdi_restart: &'static str,
}

/// One container engine's config: where it is, the edits gpushare makes to it and takes
/// back, how doctor reads it, and what the operator does after each.
pub(crate) trait EngineConfig: Sync {
    /// The engine's row.
    fn about(&self) -> &'static About;
    /// [`About::name`].
    fn name(&self) -> &'static str {
        self.about().name
    }
    /// [`About::default_config`].
    fn default_config(&self) -> &'static str {
        self.about().default_config
    }
    /// [`About::default_socket`].
    fn default_socket(&self) -> &'static str {
        self.about().default_socket
    }
    /// [`About::config_name`].
    fn config_name(&self) -> &'static str {
        self.about().config_name
    }
    /// The flags of `gpushare install <name>` beyond those every engine takes.
    fn install_flags(&self) -> Vec<clap::Arg> {
        Vec::new()
    }
    /// `gpushare install <name>`: `install` holds the flags every engine takes, `flags`
    /// the whole command line of the subcommand (for [`Self::install_flags`]).
    fn install(&self, install: Install, flags: &clap::ArgMatches) -> anyhow::Result<()> {
        let _ = flags;
        run(install)
    }
    /// After `gpushare uninstall <name>` changed the config (not a dry run): what else
    /// goes with the engine's registration outside its config.
    fn after_uninstall(&self, cfg: &Config) {
        let _ = cfg;
    }
    /// `text` with runtime `name` running the shim at `runtime`; `version`: the config
    /// version of a new file, for an engine whose format has versions (`None`: the
    /// engine's own choice).
    fn edit(
        &self,
        path: &Path,
        text: &str,
        name: &str,
        runtime: &Path,
        version: Option<i64>,
    ) -> Result<Edited, InstallError>;
    /// `text` (read from `path`) without runtime `name` and what goes with it.
    fn remove(&self, path: &Path, text: &str, name: &str) -> Result<Removal, InstallError>;
    /// `text` with CDI on, reading specs from `dir`; `version` as for [`Self::edit`].
    fn enable_cdi(
        &self,
        path: &Path,
        text: &str,
        dir: &Path,
        version: Option<i64>,
    ) -> Result<Edited, InstallError>;
    /// How to ask this engine for a CDI device from the specs in `dir`: one line.
    fn cdi_usage(&self, dir: &Path) -> String;
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

/// Whether an engine serves on this node: its socket exists.
pub(crate) fn serving(socket: &Path) -> bool {
    use std::os::unix::fs::FileTypeExt;
    std::fs::metadata(socket).is_ok_and(|m| m.file_type().is_socket())
}

/// How an engine's config runs gpushare: what `install` writes, and what the installers'
/// `registration` reads back from a file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Registration {
    /// The engine runs runc through the shim at this path (Docker's `path`, containerd's
    /// `options.BinaryName`).
    Shim(PathBuf),
    /// Plain runc, starting from the base spec at this path, which carries gpushare's
    /// hooks (containerd's `base_runtime_spec`: `install containerd --hook-only`).
    HookOnly(PathBuf),
}

/// The engine's config file: `config`, else the engine's standard one.
pub(super) fn config_path(engine: &dyn EngineConfig, config: Option<PathBuf>) -> PathBuf {
    config.unwrap_or_else(|| engine.default_config().into())
}

/// `gpushare install <engine>`'s flags, as given.
#[derive(Clone)]
pub(crate) struct Install {
    pub engine: &'static dyn EngineConfig,
    /// The config version of a new file, for an engine whose format has versions (its
    /// own install flag); `None`: the engine's own choice.
    pub config_version: Option<i64>,
    /// The engine's config file; `None`: its standard location.
    pub config: Option<PathBuf>,
    /// The shim to register; `None`: gpushare-runtime beside this binary.
    pub runtime_path: Option<PathBuf>,
    /// Runtime name (Docker `--runtime`, containerd handler / RuntimeClass handler).
    pub name: String,
    pub dry_run: bool,
}

/// Registers the shim with the engine's config (or prints the result, `dry_run`).
pub(crate) fn run(args: Install) -> anyhow::Result<()> {
    let path = config_path(args.engine, args.config.clone());
    let runtime = file::runtime_path(args.runtime_path)?;
    if !runtime.is_file() {
        eprintln!(
            "gpushare: warning: {} does not exist (yet)",
            runtime.display()
        );
    }
    let text = file::read(&path)?;
    let edited = args
        .engine
        .edit(&path, &text, &args.name, &runtime, args.config_version)?;
    let Some(new) = edited.text else {
        already_registered(&path, &args.name, &format!("at {}", runtime.display()));
        return Ok(());
    };
    if args.dry_run {
        print!("{new}");
        return Ok(());
    }
    undo::write(&path, &text, &new, Some(&args.name))?;
    println!(
        "registered runtime {} ({}) in {}",
        args.name,
        runtime.display(),
        path.display()
    );
    print_lines(args.engine.next_steps(&args.name));
    Ok(())
}

/// What an engine's spec-directory list must say for it to read `dir`: nothing where
/// `dir` is one of its defaults; else the whole list, its defaults first, because setting
/// the list replaces them.
pub(super) fn spec_dirs_hint(key: &str, defaults: &[&str], dir: &Path) -> String {
    let dir = dir.to_string_lossy();
    if defaults.contains(&dir.as_ref()) {
        return String::new();
    }
    let list: Vec<String> = defaults
        .iter()
        .copied()
        .chain([dir.as_ref()])
        .map(|d| format!("{d:?}"))
        .collect();
    format!(
        " and {key}[{}] (the list replaces the defaults, so it keeps them)",
        list.join(", ")
    )
}

/// Prints what the operator does next, a line each.
pub(super) fn print_lines(lines: impl IntoIterator<Item = impl std::fmt::Display>) {
    for line in lines {
        println!("{line}");
    }
}

/// The one line of an install that finds `path` already registering runtime `name`
/// (`how`: the way it runs gpushare).
pub(super) fn already_registered(path: &Path, name: &str, how: &str) {
    println!(
        "{} already registers runtime {name} {how}; nothing to do",
        path.display()
    );
}
