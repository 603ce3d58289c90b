//! `gpushare install docker|containerd`: which engine config to edit, the edit itself
//! (`crate::install`, lossless and idempotent), and what to tell the operator next.
//!
//! Invariants: `dry_run` prints the resulting file and writes nothing; a file that already
//! registers the runtime is left untouched; a missing shim is a warning, not a refusal
//! (the package may install it after).

use std::path::PathBuf;

use crate::install::{self, containerd, docker};

/// The engine to register the runtime with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Engine {
    Docker,
    /// `config_version` for a new file: 2 (containerd 1.x) or 3 (2.x); `None`: asks
    /// `containerd --version`.
    Containerd {
        config_version: Option<i64>,
    },
}

/// `gpushare install <engine>`'s flags, as given.
#[derive(Debug, Clone)]
pub(crate) struct Install {
    pub engine: Engine,
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
    let is_docker = args.engine == Engine::Docker;
    let version = match args.engine {
        Engine::Docker => 2,
        Engine::Containerd { config_version } => {
            config_version.unwrap_or_else(installed_containerd_config_version)
        }
    };
    let path = args.config.clone().unwrap_or_else(|| {
        if is_docker {
            install::DEFAULT_DOCKER_CONFIG.into()
        } else {
            install::DEFAULT_CONTAINERD_CONFIG.into()
        }
    });
    let runtime = install::runtime_path(args.runtime_path)?;
    if !runtime.is_file() {
        eprintln!(
            "gpushare: warning: {} does not exist (yet)",
            runtime.display()
        );
    }
    let text = install::read(&path)?;
    let edited = if is_docker {
        docker::edit(&path, &text, &args.name, &runtime)?
    } else {
        containerd::edit(&path, &text, &args.name, &runtime, version)?
    };
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
    install::write(&path, &new)?;
    println!(
        "registered runtime {} ({}) in {}",
        args.name,
        runtime.display(),
        path.display()
    );
    print_next_steps(is_docker, &args.name);
    Ok(())
}

/// What the operator does next for the engine to use the new runtime.
fn print_next_steps(is_docker: bool, name: &str) {
    if is_docker {
        println!(
            "reload Docker to use it: `kill -HUP $(pidof dockerd)` or `systemctl reload docker`;"
        );
        println!("then: docker run --runtime {name} -e GPUSHARE_DEVICE=0 …  (Docker ≥ 24: --annotation gpushare.io/device=0)");
    } else {
        println!("restart containerd to use it: `systemctl restart containerd`;");
        println!("Kubernetes: a RuntimeClass with handler: {name} (see deploy/)");
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
