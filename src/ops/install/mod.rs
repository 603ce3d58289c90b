//! `gpushare install <engine>|cdi` and `gpushare uninstall <engine>`: each engine one
//! [`EngineConfig`] (`engine`, which also holds the install every engine runs; listed in
//! [`ENGINES`]) in its own module, with the pure
//! edits of its config and what only it has (its own install flags and commands); this
//! module dispatches through the trait, never branching on which engine it is: which
//! config to edit, the file's read and atomic write (`file`), the record that uninstall
//! gives back (`undo`), and what to tell the operator next. The engines' modules also
//! read a file back (their `registration`): whether it registers gpushare, and how,
//! which `doctor` reports; no other module parses an engine's config.
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

use engine::{config_path, print_lines};
pub(crate) use engine::{EngineConfig, Install, Removal};

/// Every engine gpushare installs into, in the CLI's and doctor's order: an engine is its
/// module, declared above, and its row here.
pub(crate) static ENGINES: &[&dyn EngineConfig] = &[&docker::Docker, &containerd::Containerd];
pub(crate) use file::CDI_STATIC_SPEC;

use std::path::{Path, PathBuf};

use anyhow::Context;

/// The engine called `name` on the command line.
pub(crate) fn named(name: &str) -> Option<&'static dyn EngineConfig> {
    ENGINES.iter().copied().find(|e| e.name() == name)
}

/// `gpushare uninstall <engine>`: what `install` did to the engine's config
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
        .map(|engine| plan_cdi(engine, config, dir, None))
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

/// CDI to turn on in one engine's config: the file, what it says now, and the edit.
pub(super) struct CdiPlan {
    restart: &'static str,
    path: PathBuf,
    text: String,
    edited: file::Edited,
}

/// CDI to turn on in `engine`'s config (`config`, else the standard one), reading `dir`,
/// read and made but not written; `version`: the config version of a new file, as for
/// [`EngineConfig::edit`].
pub(super) fn plan_cdi(
    engine: &dyn EngineConfig,
    config: Option<PathBuf>,
    dir: &Path,
    version: Option<i64>,
) -> anyhow::Result<CdiPlan> {
    let path = config_path(engine, config);
    let text = file::read(&path)?;
    let edited = engine.enable_cdi(&path, &text, dir, version)?;
    Ok(CdiPlan {
        restart: engine.about().cdi_restart,
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

#[cfg(test)]
mod tests {
    use super::engine::spec_dirs_hint;
    use super::*;

    /// The files that dispatch to the engines (outside the engines' own modules).
    const DISPATCH: &[&str] = &[
        "src/cli.rs",
        "src/ops/doctor.rs",
        "src/ops/install/mod.rs",
        "src/ops/install/engine.rs",
        "src/ops/install/file.rs",
        "src/ops/install/undo.rs",
    ];

    /// The identifiers and string literals of Rust `source` up to its `#[cfg(test)]`
    /// module, without comments (which may name an engine: they are not code).
    fn code_tokens(source: &str) -> (Vec<String>, Vec<String>) {
        let code = source.split("#[cfg(test)]").next().unwrap_or_default();
        let c: Vec<char> = code.chars().collect();
        let (mut idents, mut strings, mut i) = (Vec::new(), Vec::new(), 0);
        // Just past the next `end` from `from`, else the end.
        let until = |from: usize, end: &str| -> usize {
            let end: Vec<char> = end.chars().collect();
            (from..c.len())
                .find(|&k| c[k..].starts_with(&end))
                .map_or(c.len(), |k| k + end.len())
        };
        while i < c.len() {
            match c[i] {
                '/' if c.get(i + 1) == Some(&'/') => i = until(i, "\n"),
                '/' if c.get(i + 1) == Some(&'*') => i = until(i + 2, "*/"),
                '"' => {
                    let mut j = i + 1;
                    while j < c.len() && c[j] != '"' {
                        j += if c[j] == '\\' { 2 } else { 1 };
                    }
                    strings.push(c[i + 1..j.min(c.len())].iter().collect());
                    i = j + 1;
                }
                // A char literal ('x', '\n'); else a lifetime's quote.
                '\'' if c.get(i + 1) == Some(&'\\') => i = until(i + 3, "'"),
                '\'' if c.get(i + 2) == Some(&'\'') => i += 3,
                ch if ch.is_alphabetic() || ch == '_' => {
                    let mut j = i;
                    while j < c.len() && (c[j].is_alphanumeric() || c[j] == '_') {
                        j += 1;
                    }
                    let ident: String = c[i..j].iter().collect();
                    let hashes = c[j..].iter().take_while(|&&h| h == '#').count();
                    if matches!(ident.as_str(), "r" | "br") && c.get(j + hashes) == Some(&'"') {
                        // A raw string: up to its quote and as many #.
                        let end = format!("\"{}", "#".repeat(hashes));
                        let from = j + hashes + 1;
                        let to = until(from, &end);
                        strings.push(c[from..to.saturating_sub(end.len())].iter().collect());
                        i = to;
                    } else {
                        idents.push(ident);
                        i = j;
                    }
                }
                _ => i += 1,
            }
        }
        (idents, strings)
    }

    /// Where code in `source` names `engine`: an identifier that contains its name (its
    /// module, its type, a constant of its own) or a string that is its name (a branch
    /// on it).
    fn naming(source: &str, engine: &str) -> Vec<String> {
        let ident = engine.replace('-', "_");
        let (idents, strings) = code_tokens(source);
        let idents = idents
            .into_iter()
            .filter(|i| i.to_lowercase().contains(&ident));
        let strings = strings.into_iter().filter(|s| s == engine);
        idents.chain(strings.map(|s| format!("{s:?}"))).collect()
    }

    /// A new engine is its module, declared in this one, and its row in [`ENGINES`]: the
    /// CLI, doctor and the installers' dispatch name no engine, so none of them changes.
    /// Fails on a per-engine branch (`"containerd"`, `Containerd`, `docker::…`,
    /// `DEFAULT_DOCKER_CONFIG`) anywhere in their code.
    #[test]
    fn no_code_outside_an_engine_s_module_names_it() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut found = Vec::new();
        for file in DISPATCH {
            let source = std::fs::read_to_string(root.join(file)).unwrap();
            // What adding an engine does change: its `mod` line and its row in ENGINES.
            let declares = *file == "src/ops/install/mod.rs";
            let source: String = source
                .lines()
                .filter(|l| {
                    !(declares && (l.starts_with("pub(crate) mod ") || l.starts_with("mod ")))
                })
                .collect::<Vec<_>>()
                .join("\n");
            let source = match source.split_once("static ENGINES") {
                Some((before, after)) => {
                    format!("{before}{}", after.split_once(';').unwrap().1)
                }
                None => source,
            };
            assert!(code_tokens(&source).0.len() > 30, "{file}: no code read");
            for engine in ENGINES {
                for name in naming(&source, engine.name()) {
                    found.push(format!("{file}: {name}"));
                }
            }
        }
        assert!(
            found.is_empty(),
            "engines named outside their modules: {found:#?}"
        );
        // The check sees an engine's name where code has it: in its own module.
        let own = std::fs::read_to_string(root.join("src/ops/install/docker.rs")).unwrap();
        assert!(naming(&own, "docker").contains(&"Docker".to_owned()));
        assert!(naming("// docker\nlet s = \"docker\";", "docker") == ["\"docker\""]);
        assert!(naming("let s = r#\"docker\"#; let c = '\"';", "docker") == ["\"docker\""]);
    }

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
        let install = |dry_run: bool| {
            cdi(
                &cfg,
                &spec,
                Some(&docker::Docker),
                Some(daemon_json.clone()),
                dry_run,
            )
            .unwrap()
        };
        install(true);
        assert!(!spec.exists() && !spec.parent().unwrap().exists());
        assert_eq!(std::fs::read_to_string(&daemon_json).unwrap(), "{}\n");
        // Without it, both are written.
        install(false);
        assert!(spec.is_file());
        assert!(std::fs::read_to_string(&daemon_json)
            .unwrap()
            .contains("\"cdi\": true"));
    }
}
