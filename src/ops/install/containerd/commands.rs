//! containerd's own part of `gpushare install containerd` and `uninstall containerd`,
//! with its I/O: the flags only it takes (`--config-version`, `--hook-only`, `--nri`,
//! `--nri-launch`, `--nri-required`), the hook-only runtime ([`hook_only`]), NRI turned
//! on and the plugin it launches ([`install_nri`]), and the NRI plugin's state forgotten
//! after uninstall ([`forget_nri_plugin`]).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::{Arg, ArgAction, ArgMatches};

use super::super::engine::{
    already_registered, config_path, print_lines, run, Install, Registration,
};
use super::super::file;
use super::super::undo;
use super::config::{base_spec, base_spec_name, edit, DEFAULT_CONFIG};
use super::nri::{
    check_nri_launch, enable_nri, is_launch_wrapper, launch_wrapper, launched_plugin_name,
    nri_plugin_dir, nri_socket, require_nri, NriRequired, REQUIRED_ANNOTATION, TOLERATE_ANNOTATION,
};
use crate::config::Config;

/// `install containerd`'s own flags, after those every engine takes.
pub(super) fn flags() -> Vec<Arg> {
    vec![
        Arg::new("config_version")
            .long("config-version")
            .value_name("CONFIG_VERSION")
            .value_parser(clap::value_parser!(i64).range(2..=3))
            .action(ArgAction::Set)
            .help("Config version for a new file: 2 (containerd 1.x) or 3 (2.x); default: asks `containerd --version`, else 2. An existing file's own version always wins"),
        Arg::new("hook_only")
            .long("hook-only")
            .action(ArgAction::SetTrue)
            .help("No shim: plain runc whose base_runtime_spec (containerd's default spec, from `ctr oci spec`, plus gpushare's hooks; written beside the config as <name>-base-spec.json) runs gpushare in hook-only mode. --runtime-path is unused"),
        Arg::new("nri")
            .long("nri")
            .action(ArgAction::SetTrue)
            .conflicts_with("hook_only")
            .help("Instead of registering a runtime: turn containerd's NRI on (off by default in 1.7, on in 2.x), for `gpushare nri` (docs/kubernetes.md). --name and --runtime-path are unused"),
        Arg::new("nri_launch")
            .long("nri-launch")
            .action(ArgAction::SetTrue)
            .requires("nri")
            .help("With --nri: also register the plugin for containerd to launch, as an executable 10-gpushare in its NRI plugin_path (default /opt/nri/plugins) that runs this `gpushare nri`; `gpushare uninstall containerd` removes it. containerd 2.x only (a version 3 config)"),
        Arg::new("nri_required")
            .long("nri-required")
            .value_name("NRI_REQUIRED")
            .value_parser(clap::builder::PossibleValuesParser::new(["node", "pods"]))
            .action(ArgAction::Set)
            .requires("nri")
            .help("With --nri: have NRI's default validator (containerd 2.2 and later) refuse containers that need the plugin while it is not connected (stopped, crashed, restarting): `node`, every container but those of pods annotated tolerate-missing-plugins.gpushare.io: \"true\"; `pods`, the containers of pods annotated required-plugins.noderesource.dev: '[\"gpushare\"]' (docs/kubernetes.md)"),
    ]
}

/// `gpushare install containerd`: the runtime with the shim, the hook-only runtime
/// (`--hook-only`), or NRI on (`--nri`).
pub(super) fn install(mut install: Install, flags: &ArgMatches) -> anyhow::Result<()> {
    install.config_version = flags.get_one::<i64>("config_version").copied();
    if flags.get_flag("nri") {
        let required = match flags.get_one::<String>("nri_required").map(String::as_str) {
            Some("node") => Some(NriRequired::Node),
            Some("pods") => Some(NriRequired::Pods),
            _ => None,
        };
        return install_nri(
            install.config,
            install.config_version,
            install.dry_run,
            flags.get_flag("nri_launch"),
            required,
        );
    }
    if flags.get_flag("hook_only") {
        hook_only(install)
    } else {
        run(install)
    }
}

/// After `uninstall containerd`: the state of an NRI plugin that no longer runs goes with
/// it, so that `doctor` stops warning about a plugin removed on purpose; one that still
/// runs (launched by containerd until it restarts, or a service) is named. With no plugin
/// running, its validator is stopped too (`nri::validator::stop_without_plugin`).
pub(super) fn forget_nri_plugin(cfg: &Config) {
    let state = crate::state::StateDir::new(&cfg.state_dir);
    match crate::ops::gc::forget_stopped_nri_plugin(&state) {
        Ok(Some(_)) => println!(
            "removed {}: the NRI plugin no longer runs",
            state.nri_state_path().display()
        ),
        Ok(None) => {
            if let Some(pid) = crate::nri::PluginState::read(&state)
                .and_then(|p| p.process)
                .filter(|p| p.alive())
                .map(|p| p.pid)
            {
                println!("gpushare's NRI plugin still runs (pid {pid}): stop it (`systemctl disable --now gpushare-nri`, or restart containerd for a launched one), then `gpushare gc` forgets it");
            }
        }
        Err(e) => eprintln!(
            "gpushare: warning: cannot remove {}: {e}",
            state.nri_state_path().display()
        ),
    }
    match crate::nri::validator::stop_without_plugin(&state) {
        Ok(Some(pid)) => println!(
            "stopped gpushare's NRI validator (pid {pid}): no gpushare NRI plugin runs to serve what it would wait for"
        ),
        Ok(None) => {}
        Err(e) => eprintln!("gpushare: warning: {e:#}"),
    }
}

/// `gpushare install containerd --hook-only`: see [`write_hook_only`].
fn hook_only(args: Install) -> anyhow::Result<()> {
    let path = config_path(args.engine, args.config.clone());
    let version = args.config_version.unwrap_or_else(installed_config_version);
    write_hook_only(&args, &path, version, &default_spec()?)
}

/// `gpushare install containerd --hook-only`: containerd's default spec (`ctr oci spec`)
/// with gpushare's hooks, written beside its config as `<name>-base-spec.json`, and the
/// runtime class pointed at it. The hooks run this binary, with the config this process
/// reads when `GPUSHARE_CONFIG` names one. The spec is written before the config names it.
pub(crate) fn write_hook_only(
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
    let spec_path = path.with_file_name(base_spec_name(&args.name));
    let gpushare = std::env::current_exe().context("find gpushare's own path")?;
    let (config, named) = crate::config::location();
    let env = crate::served::hook_env(named.then_some(config.as_path()));
    let spec = base_spec(&spec_path, default_spec, &gpushare, &env)?;
    let spec_changed = file::read(&spec_path)? != spec;
    let text = file::read(path)?;
    let hook_only = Registration::HookOnly(spec_path.clone());
    let edited = edit(path, &text, &args.name, &hook_only, version)?;
    if !spec_changed && edited.text.is_none() {
        already_registered(
            path,
            &args.name,
            &format!("hook-only with {}", spec_path.display()),
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

/// `gpushare install containerd --nri`: NRI on in containerd's config (`config`, else
/// the standard one), or the resulting file printed (`dry_run`). With `launch`, also the
/// launched plugin: `containerd::launch_wrapper` as `<plugin_path>/10-gpushare`, 0755,
/// running this binary with the config this process reads when `GPUSHARE_CONFIG` names
/// one (refused on a config of containerd 1.x: `containerd::check_nri_launch`, before
/// anything is written). The wrapper is written after the config.
pub(crate) fn install_nri(
    config: Option<PathBuf>,
    config_version: Option<i64>,
    dry_run: bool,
    launch: bool,
    required: Option<NriRequired>,
) -> anyhow::Result<()> {
    let path = config.unwrap_or_else(|| DEFAULT_CONFIG.into());
    let version = config_version.unwrap_or_else(installed_config_version);
    let text = file::read(&path)?;
    if let Some(required) = required {
        // Refused before anything is written.
        require_nri(&path, &text, version, required, crate::nri::DEFAULT_NAME)?;
    }
    let wrapper = if launch {
        check_nri_launch(&path, &text, version)?;
        let at = nri_plugin_dir(&text).join(launched_plugin_name());
        let gpushare = std::env::current_exe().context("find gpushare's own path")?;
        let (config, named) = crate::config::location();
        let env = crate::served::hook_env(named.then_some(config.as_path()));
        let socket = nri_socket(&text);
        Some((at, launch_wrapper(&gpushare, &env, &socket)))
    } else {
        None
    };
    let mut edited = enable_nri(&path, &text, version)?;
    let turned_on = edited.text.is_some();
    if let Some(required) = required {
        let on = edited.text.as_deref().unwrap_or(&text);
        let name = crate::nri::DEFAULT_NAME;
        if let Some(new) = require_nri(&path, on, version, required, name)?.text {
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
        Some(NriRequired::Node) => println!(
            "while the plugin {} is not connected, containerd refuses every container but those of pods annotated {}: \"true\" (the node's own pods: deploy/ carries it)",
            crate::nri::DEFAULT_NAME,
            TOLERATE_ANNOTATION
        ),
        Some(NriRequired::Pods) => println!(
            "while the plugin {} is not connected, containerd refuses the containers of pods annotated {}: '[\"{}\"]'",
            crate::nri::DEFAULT_NAME,
            REQUIRED_ANNOTATION,
            crate::nri::DEFAULT_NAME
        ),
        None => {}
    }
    println!(
        "on containerd 2.2 and later, the plugin's validator (`gpushare nri-validate`, which every way of running the plugin runs beside it) refuses a container with a request that the plugin did not adjust, whatever its pod's annotations"
    );
    let Some((at, script)) = wrapper else {
        println!("then run the plugin as root: `systemctl enable --now gpushare-nri` (Debian package; it pulls in gpushare-nri-validator) or `gpushare nri`; pods need no RuntimeClass (docs/kubernetes.md)");
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
    let at = nri_plugin_dir(text).join(launched_plugin_name());
    // A regular file only: read_regular refuses a link.
    let content = crate::fsops::read_regular(&at, 64 << 10).ok()?;
    is_launch_wrapper(&String::from_utf8_lossy(&content)).then_some(at)
}

/// The config version the installed containerd expects: 3 for 2.x, else 2.
pub(super) fn installed_config_version() -> i64 {
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
        let at = super::super::nri_plugin_dir(&config).join(super::super::launched_plugin_name());
        assert_eq!(at, plugins.join("10-gpushare"));
        let script = super::super::launch_wrapper(
            Path::new("/usr/bin/gpushare"),
            &[],
            Path::new(crate::nri::DEFAULT_SOCKET),
        );
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
