//! `gpushare install docker|containerd|cdi` and `gpushare uninstall docker|containerd`:
//! each engine one [`EngineConfig`] (`engine`, listed in [`ENGINES`]) that this module
//! dispatches through, never branching on which engine it is; which engine config to edit, the edit itself (`docker`, `containerd`: pure functions of
//! the file's text), the file's read and atomic write (`file`), and what to tell the
//! operator next; for containerd also the NRI plugin it launches from its plugin
//! directory (written by `install containerd --nri --nri-launch`, deleted by uninstall
//! only when it is ours). The installers also read a file back (`docker::registration`,
//! `containerd::registration`): whether it registers gpushare, and how, which `doctor`
//! reports; no other module parses an engine's config.
//!
//! Invariants: every other key of the engine's config is kept (containerd's TOML with its
//! comments and layout); running a command twice changes nothing the second time;
//! `dry_run` prints the resulting file and writes nothing; a file that already registers
//! the runtime is left untouched; a missing shim is a warning, not a refusal (the package
//! may install it after).

pub(crate) mod containerd;
pub(crate) mod docker;
mod engine;
mod file;
pub(crate) mod undo;

pub(crate) use containerd::NriRequired;
pub(crate) use engine::{named, EngineConfig, Removal, ENGINES};
pub(crate) use file::{CDI_STATIC_SPEC, DEFAULT_CONTAINERD_CONFIG, DEFAULT_DOCKER_CONFIG};

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};

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
fn config_path(engine: &dyn EngineConfig, config: Option<PathBuf>) -> PathBuf {
    config.unwrap_or_else(|| engine.default_config().into())
}

/// `gpushare install <engine>`'s flags, as given.
#[derive(Clone)]
pub(crate) struct Install {
    pub engine: &'static dyn EngineConfig,
    /// The config version of a new file, for an engine whose format has versions
    /// (containerd: 2 for 1.x, 3 for 2.x); `None`: asks the installed engine.
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
    let version = || {
        args.config_version
            .unwrap_or_else(installed_containerd_config_version)
    };
    let edited = args
        .engine
        .edit(&path, &text, &args.name, &runtime, &version)?;
    let Some(new) = edited.text else {
        println!(
            "{} already registers runtime {} at {}; nothing to do",
            path.display(),
            args.name,
            runtime.display()
        );
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

/// `gpushare install containerd --hook-only`: see [`hook_only_containerd`].
pub(crate) fn hook_only(args: Install) -> anyhow::Result<()> {
    let path = config_path(args.engine, args.config.clone());
    let version = args
        .config_version
        .unwrap_or_else(installed_containerd_config_version);
    hook_only_containerd(&args, &path, version, &default_spec()?)
}

/// `gpushare uninstall docker|containerd`: what `install` did to the engine's config
/// (`config`, else the standard one) undone. On a file nobody changed since gpushare wrote
/// it, and once no other runtime name of ours is registered there, the file as it was
/// before the first install, byte for byte (`undo`); otherwise runtime `name` taken out,
/// every other key kept, and what the engine's [`EngineConfig::remove`] says goes with
/// it. `dry_run` prints the result and writes nothing; a file without
/// anything of ours is left untouched.
pub(crate) fn uninstall(
    engine: &dyn EngineConfig,
    config: Option<PathBuf>,
    name: &str,
    dry_run: bool,
) -> anyhow::Result<()> {
    let path = config_path(engine, config);
    let text = file::read(&path)?;
    let Removal {
        runtime,
        also,
        files,
    } = engine.remove(&path, &text, name)?;
    let runtime_removed = runtime.is_some();
    let (edited, also_said) = match also {
        Some((t, said)) => (Some(t), Some(said)),
        None => (runtime, None),
    };
    let deleted: Vec<&PathBuf> = files.iter().map(|(p, _)| p).collect();
    let plan = undo::plan(&path, &text, name, edited);
    if dry_run {
        match &plan {
            undo::Undo::Restore(None) => println!("# delete {}", path.display()),
            undo::Undo::Restore(Some(t)) | undo::Undo::Remove { text: t, .. } => print!("{t}"),
            undo::Undo::Nothing { .. } => print!("{text}"),
        }
        for file in &deleted {
            println!("# and delete {}", file.display());
        }
        return Ok(());
    }
    undo::apply(&path, &plan, name)?;
    for file in &deleted {
        match std::fs::remove_file(file) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e).with_context(|| format!("cannot delete {}", file.display())),
        }
    }
    let said: Vec<&String> = files.iter().filter_map(|(_, s)| s.as_ref()).collect();
    print_lines(said.iter());
    if let Some(said) = also_said.filter(|_| !matches!(plan, undo::Undo::Restore(_))) {
        println!("{said}");
    }
    let stale = match &plan {
        undo::Undo::Restore(original) => {
            match original {
                Some(_) => println!(
                    "restored {} as it was before `gpushare install`",
                    path.display()
                ),
                None => println!(
                    "deleted {}: there was none before `gpushare install`",
                    path.display()
                ),
            }
            false
        }
        undo::Undo::Remove { stale, .. } => {
            if runtime_removed {
                println!("removed runtime {name} from {}", path.display());
            }
            *stale
        }
        undo::Undo::Nothing { stale } => {
            if said.is_empty() {
                println!(
                    "{} registers no runtime {name}; nothing to do",
                    path.display()
                );
            }
            if !stale {
                return Ok(());
            }
            true
        }
    };
    if stale {
        println!(
            "{} changed since gpushare last wrote it: only runtime {name}'s own entry was taken out; what else `gpushare install` added (a runc runtime table, NRI's disable = false, CDI settings) stays, its earlier text is in {}: compare, then delete that file",
            path.display(),
            undo::record_path(&path).display()
        );
    }
    if matches!(plan, undo::Undo::Nothing { .. }) {
        return Ok(());
    }
    let restored = matches!(plan, undo::Undo::Restore(_));
    print_lines(engine.forget_steps(name, restored));
    Ok(())
}

/// `gpushare install containerd --hook-only`: containerd's default spec (`ctr oci spec`)
/// with gpushare's hooks, written beside its config as `<name>-base-spec.json`, and the
/// runtime class pointed at it. The hooks run this binary, with the config this process
/// reads when `GPUSHARE_CONFIG` names one. The spec is written before the config names it.
fn hook_only_containerd(
    args: &Install,
    path: &Path,
    version: i64,
    default_spec: &[u8],
) -> anyhow::Result<()> {
    if args.name.is_empty()
        || !args
            .name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    {
        bail!(
            "runtime name {:?} cannot name a base spec file: allowed are letters, digits, - and _",
            args.name
        );
    }
    let spec_path = path.with_file_name(containerd::base_spec_name(&args.name));
    let gpushare = std::env::current_exe().context("find gpushare's own path")?;
    let (config, named) = crate::config::location();
    let env = crate::runtime::hook_env(named.then_some(config.as_path()));
    let spec = containerd::base_spec(&spec_path, default_spec, &gpushare, &env)?;
    let spec_changed = file::read(&spec_path)? != spec;
    let text = file::read(path)?;
    let hook_only = Registration::HookOnly(spec_path.clone());
    let edited = containerd::edit(path, &text, &args.name, &hook_only, version)?;
    if !spec_changed && edited.text.is_none() {
        println!(
            "{} already registers runtime {} hook-only with {}; nothing to do",
            path.display(),
            args.name,
            spec_path.display()
        );
        return Ok(());
    }
    if args.dry_run {
        print!("{}", edited.text.unwrap_or(text));
        print!("# {}:\n{spec}", spec_path.display());
        return Ok(());
    }
    if spec_changed {
        file::write(&spec_path, &spec)?;
    }
    if let Some(new) = edited.text {
        undo::write(path, &text, &new, Some(&args.name))?;
    }
    println!(
        "registered runtime {} hook-only (plain runc, gpushare's hooks in {}) in {}",
        args.name,
        spec_path.display(),
        path.display()
    );
    println!("write the base spec again after a containerd upgrade: run this command again");
    print_lines(args.engine.next_steps(&args.name));
    Ok(())
}

/// containerd's default spec, as `ctr oci spec` prints it.
fn default_spec() -> anyhow::Result<Vec<u8>> {
    let path = std::env::var_os("PATH").unwrap_or_else(|| crate::mps::control::SAFE_PATH.into());
    let ctr = crate::util::find_executable("ctr", &path).context(
        "--hook-only needs containerd's ctr (its `ctr oci spec` is containerd's default spec): not found on PATH",
    )?;
    let out = std::process::Command::new(&ctr)
        .args(["oci", "spec"])
        .stdin(std::process::Stdio::null())
        .output()
        .with_context(|| format!("run {} oci spec", ctr.display()))?;
    if !out.status.success() {
        bail!(
            "{} oci spec failed: {}",
            ctr.display(),
            crate::util::one_line(&String::from_utf8_lossy(&out.stderr))
        );
    }
    Ok(out.stdout)
}

/// `gpushare install cdi`: the CDI spec written where the engines read it, CDI turned on
/// in one engine's config when asked (`enable`, its file `config` or the standard one),
/// and what each engine needs to read it.
pub(crate) fn cdi(
    cfg: &crate::config::Config,
    output: &Path,
    enable: Option<&dyn EngineConfig>,
    config: Option<PathBuf>,
    dry_run: bool,
) -> anyhow::Result<()> {
    let dir = output.parent().unwrap_or(Path::new("/"));
    // Everything is read and edited before anything is written: a bad engine config
    // leaves no spec behind either.
    let engine = enable
        .map(|engine| plan_cdi(engine, config, dir, installed_containerd_config_version))
        .transpose()?;
    if dry_run {
        let spec = crate::cdi::to_bytes(&crate::cdi::current(cfg)?);
        println!("# {}:", output.display());
        print!("{}", String::from_utf8_lossy(&spec));
        if let Some(planned) = &engine {
            println!("# {}:", planned.path.display());
            print!(
                "{}",
                planned.edited.text.as_deref().unwrap_or(&planned.text)
            );
        }
        return Ok(());
    }
    crate::cdi::generate(cfg, output)?;
    if let Some(planned) = engine {
        write_cdi(planned, dir)?;
    }
    println!("then ask for a share with a CDI device, e.g. gpushare.io/gpu=0 (docs/requests.md):");
    println!("  Podman 4.1+: podman run --device gpushare.io/gpu=0 … (Podman 4.x reads only /etc/cdi and /var/run/cdi)");
    for engine in ENGINES {
        println!("  {}", engine.cdi_usage(dir));
    }
    println!("run this command again after the GPUs, MIG devices or [cdi.profiles] change (gpushare doctor says when)");
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

/// CDI to turn on in one engine's config: the file, what it says now, and the edit.
pub(super) struct CdiPlan {
    restart: &'static str,
    path: PathBuf,
    text: String,
    edited: file::Edited,
}

/// CDI to turn on in `engine`'s config (`config`, else the standard one), reading `dir`,
/// read and made but not written; `containerd_version` gives the config version of a new
/// containerd file.
pub(super) fn plan_cdi(
    engine: &dyn EngineConfig,
    config: Option<PathBuf>,
    dir: &Path,
    version: impl Fn() -> i64,
) -> anyhow::Result<CdiPlan> {
    let path = config_path(engine, config);
    let text = file::read(&path)?;
    let edited = engine.enable_cdi(&path, &text, dir, &version)?;
    Ok(CdiPlan {
        restart: engine.cdi_restart(),
        path,
        text,
        edited,
    })
}

/// Writes a [`CdiPlan`] (through the undo record) and says what to restart.
pub(super) fn write_cdi(plan: CdiPlan, dir: &Path) -> anyhow::Result<()> {
    let CdiPlan {
        restart,
        path,
        text,
        edited,
    } = plan;
    match edited.text {
        None => println!(
            "{} already reads CDI specs from {}",
            path.display(),
            dir.display()
        ),
        Some(new) => {
            undo::write(&path, &text, &new, None)?;
            println!(
                "turned CDI on in {}, reading {}; {}",
                path.display(),
                dir.display(),
                restart
            );
        }
    }
    Ok(())
}

/// `gpushare install containerd --nri`: NRI on in containerd's config (`config`, else
/// the standard one), or the resulting file printed (`dry_run`). With `launch`, also the
/// launched plugin: `containerd::launch_wrapper` as `<plugin_path>/10-gpushare`, 0755,
/// running this binary with the config this process reads when `GPUSHARE_CONFIG` names
/// one (refused on a config of containerd 1.x: `containerd::check_nri_launch`, before
/// anything is written). The wrapper is written after the config.
pub(crate) fn enable_nri(
    config: Option<PathBuf>,
    config_version: Option<i64>,
    dry_run: bool,
    launch: bool,
    required: Option<containerd::NriRequired>,
) -> anyhow::Result<()> {
    let path = config.unwrap_or_else(|| DEFAULT_CONTAINERD_CONFIG.into());
    let version = config_version.unwrap_or_else(installed_containerd_config_version);
    let text = file::read(&path)?;
    if let Some(required) = required {
        // Refused before anything is written.
        containerd::require_nri(&path, &text, version, required, crate::nri::DEFAULT_NAME)?;
    }
    let wrapper = if launch {
        containerd::check_nri_launch(&path, &text, version)?;
        let at = containerd::nri_plugin_dir(&text).join(containerd::launched_plugin_name());
        let gpushare = std::env::current_exe().context("find gpushare's own path")?;
        let (config, named) = crate::config::location();
        let env = crate::runtime::hook_env(named.then_some(config.as_path()));
        Some((at, containerd::launch_wrapper(&gpushare, &env)))
    } else {
        None
    };
    let mut edited = containerd::enable_nri(&path, &text, version)?;
    let turned_on = edited.text.is_some();
    if let Some(required) = required {
        let on = edited.text.as_deref().unwrap_or(&text);
        let name = crate::nri::DEFAULT_NAME;
        if let Some(new) = containerd::require_nri(&path, on, version, required, name)?.text {
            edited.text = Some(new);
        }
    }
    if dry_run {
        print!("{}", edited.text.as_deref().unwrap_or(&text));
        if let Some((at, script)) = &wrapper {
            print!("# {} (0755):\n{script}", at.display());
        }
        return Ok(());
    }
    let what = match (turned_on, edited.text.is_some()) {
        (true, _) => "turned NRI on",
        (false, true) => "set NRI's default validator",
        (false, false) => "",
    };
    match edited.text {
        None => println!("NRI is already on in {}", path.display()),
        Some(new) => {
            undo::write(&path, &text, &new, None)?;
            println!(
                "{what} in {}; restart containerd to use it (`systemctl restart containerd`)",
                path.display()
            );
        }
    }
    match required {
        Some(containerd::NriRequired::Node) => println!(
            "while the plugin {} is not connected, containerd refuses every container but those of pods annotated {}: \"true\" (the node's own pods: deploy/ carries it)",
            crate::nri::DEFAULT_NAME,
            containerd::TOLERATE_ANNOTATION
        ),
        Some(containerd::NriRequired::Pods) => println!(
            "while the plugin {} is not connected, containerd refuses the containers of pods annotated {}: '[\"{}\"]'",
            crate::nri::DEFAULT_NAME,
            containerd::REQUIRED_ANNOTATION,
            crate::nri::DEFAULT_NAME
        ),
        None => {}
    }
    let Some((at, script)) = wrapper else {
        println!("then run the plugin as root: `systemctl enable --now gpushare-nri` (Debian package) or `gpushare nri`; pods need no RuntimeClass (docs/kubernetes.md)");
        return Ok(());
    };
    if write_launch_wrapper(&at, &script)? {
        println!(
            "registered the plugin {} in containerd's NRI plugin directory; containerd launches it when it starts (`systemctl restart containerd`)",
            at.display()
        );
    } else {
        println!(
            "{} is already gpushare's NRI plugin; nothing to do",
            at.display()
        );
    }
    println!("do not also run `gpushare nri` as a service; pods need no RuntimeClass (docs/kubernetes.md)");
    Ok(())
}

/// Writes the launched plugin's wrapper at `at` (its directory made 0755 where missing),
/// 0755, atomically; `false` when it is already there with that content and mode.
fn write_launch_wrapper(at: &Path, script: &str) -> anyhow::Result<bool> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    let current = std::fs::symlink_metadata(at).ok().filter(|m| m.is_file());
    if current.is_some_and(|m| m.permissions().mode() & 0o7777 == 0o755)
        && file::read(at)? == script
    {
        return Ok(false);
    }
    if let Some(dir) = at.parent() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(dir)
            .with_context(|| format!("cannot create {}", dir.display()))?;
    }
    crate::fsops::write_atomic(at, script.as_bytes(), 0o755)
        .with_context(|| format!("cannot write {}", at.display()))?;
    Ok(true)
}

/// The launched plugin's wrapper in the plugin directory of containerd's config `text`,
/// when it is there and this installer wrote it (an operator's file by that name stays).
pub(super) fn our_launch_wrapper(text: &str) -> Option<PathBuf> {
    let at = containerd::nri_plugin_dir(text).join(containerd::launched_plugin_name());
    // A regular file only: read_regular refuses a link.
    let content = crate::fsops::read_regular(&at, 64 << 10).ok()?;
    containerd::is_launch_wrapper(&String::from_utf8_lossy(&content)).then_some(at)
}

/// Prints what the operator does next, a line each.
fn print_lines(lines: impl IntoIterator<Item = impl std::fmt::Display>) {
    for line in lines {
        println!("{line}");
    }
}

/// The config version the installed containerd expects: 3 for 2.x, else 2.
fn installed_containerd_config_version() -> i64 {
    let out = std::process::Command::new("containerd")
        .arg("--version")
        .output();
    let text = out
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    // "containerd github.com/containerd/containerd 1.6.20 <commit>" or "... v2.0.0 ..."
    let major = text.split_whitespace().find_map(|w| {
        w.trim_start_matches('v')
            .split('.')
            .next()?
            .parse::<u32>()
            .ok()
            .filter(|_| w.contains('.'))
    });
    if major.is_some_and(|m| m >= 2) {
        3
    } else {
        2
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cdi_hint_keeps_an_engine_s_default_spec_dirs() {
        let defaults = ["/etc/cdi", "/var/run/cdi"];
        assert_eq!(
            spec_dirs_hint("\"cdi-spec-dirs\": ", &defaults, Path::new("/etc/cdi")),
            ""
        );
        assert_eq!(
            spec_dirs_hint("\"cdi-spec-dirs\": ", &defaults, Path::new("/opt/cdi")),
            " and \"cdi-spec-dirs\": [\"/etc/cdi\", \"/var/run/cdi\", \"/opt/cdi\"] (the list replaces the defaults, so it keeps them)"
        );
    }

    #[test]
    fn install_cdi_dry_run_writes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let inventory = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/examples/inventory.json");
        let cfg = crate::config::parse(
            &format!("inventory = \"file:{}\"\n", inventory.display()),
            None,
        )
        .unwrap();
        let (spec, daemon_json) = (
            dir.path().join("cdi/gpushare.json"),
            dir.path().join("daemon.json"),
        );
        std::fs::write(&daemon_json, "{}\n").unwrap();
        cdi(
            &cfg,
            &spec,
            Some(&docker::Docker),
            Some(daemon_json.clone()),
            true,
        )
        .unwrap();
        assert!(!spec.exists() && !spec.parent().unwrap().exists());
        assert_eq!(std::fs::read_to_string(&daemon_json).unwrap(), "{}\n");
        // Without it, both are written.
        cdi(
            &cfg,
            &spec,
            Some(&docker::Docker),
            Some(daemon_json.clone()),
            false,
        )
        .unwrap();
        assert!(spec.is_file());
        assert!(std::fs::read_to_string(&daemon_json)
            .unwrap()
            .contains("\"cdi\": true"));
    }
    use std::os::unix::fs::PermissionsExt;

    /// The launched plugin's wrapper: written 0755 into the config's plugin_path (made
    /// where missing), the second time changes nothing, found again for removal; an
    /// operator's file or link by the same name is never taken for ours.
    #[test]
    fn the_launched_plugin_is_written_once_and_only_ours_is_found_for_removal() {
        let dir = tempfile::tempdir().unwrap();
        let plugins = dir.path().join("opt/nri/plugins");
        let config = format!(
            "version = 3\n[plugins.\"io.containerd.nri.v1.nri\"]\n  plugin_path = {:?}\n",
            plugins.display().to_string()
        );
        let at = containerd::nri_plugin_dir(&config).join(containerd::launched_plugin_name());
        assert_eq!(at, plugins.join("10-gpushare"));
        let script = containerd::launch_wrapper(Path::new("/usr/bin/gpushare"), &[]);
        assert!(write_launch_wrapper(&at, &script).unwrap());
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode(&at), 0o755);
        assert_eq!(mode(&plugins), 0o755);
        assert_eq!(std::fs::read_to_string(&at).unwrap(), script);
        assert!(!write_launch_wrapper(&at, &script).unwrap(), "idempotent");
        // A mode changed behind its back is put right.
        std::fs::set_permissions(&at, std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(write_launch_wrapper(&at, &script).unwrap());
        assert_eq!(mode(&at), 0o755);
        assert_eq!(our_launch_wrapper(&config), Some(at.clone()));

        // An operator's plugin by that name, or a link to ours, is not ours to delete.
        std::fs::write(&at, "#!/bin/sh\nexec /usr/local/bin/theirs\n").unwrap();
        assert_eq!(our_launch_wrapper(&config), None);
        let elsewhere = dir.path().join("ours");
        std::fs::write(&elsewhere, &script).unwrap();
        std::fs::remove_file(&at).unwrap();
        std::os::unix::fs::symlink(&elsewhere, &at).unwrap();
        assert_eq!(our_launch_wrapper(&config), None);
        std::fs::remove_file(&at).unwrap();
        assert_eq!(our_launch_wrapper(&config), None, "nothing there");
    }
}
