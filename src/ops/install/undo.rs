//! What the installers did to one engine config, kept beside it as
//! `<config>.gpushare-undo` (JSON, 0600: an engine config may hold registry credentials):
//! the file's text before the first `gpushare install` that changed it (`None`: there was
//! no file), the text the last one wrote, and the runtime names registered since.
//!
//! `gpushare uninstall` of the last of those names, on a file nobody changed since
//! gpushare wrote it, puts the original back byte for byte: every key any install added
//! (the runtime, the `runc` table spelt out for it, NRI's `disable = false`, CDI's
//! `enable_cdi`/`features.cdi` and spec directories) goes, and any value it changed comes
//! back, comments and layout included. A file changed since (by hand, or by another tool)
//! is never overwritten with an old copy: uninstall then takes out only the runtime's
//! own entry (`docker::remove`, `containerd::remove`) and says what may be left.
//!
//! Invariants: the record is written before the config, so a crash between the two
//! leaves a record whose `written` is not the file's text, which counts as no record; a
//! record that is not ours to trust (unreadable, not JSON, a link) is replaced by the
//! next install and ignored by uninstall.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::file::{self, InstallError};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Record {
    /// The file before gpushare's first change; `None`: it did not exist.
    original: Option<String>,
    /// What gpushare last wrote there.
    written: String,
    /// The runtime names the installs registered and no uninstall took out yet.
    runtimes: Vec<String>,
}

/// Where the record of `config` lives: beside it, under a name no engine reads
/// (containerd's `imports` globs end in `.toml`).
pub(crate) fn record_path(config: &Path) -> PathBuf {
    let mut name = config.file_name().unwrap_or_default().to_owned();
    name.push(".gpushare-undo");
    config.with_file_name(name)
}

/// The record of `config`, when it speaks for the file's current `text`.
fn current(config: &Path, text: &str) -> Option<Record> {
    let bytes = crate::fsops::read_regular(&record_path(config), 16 << 20).ok()?;
    let record: Record = serde_json::from_slice(&bytes).ok()?;
    (record.written == text).then_some(record)
}

fn store(config: &Path, record: &Record) -> Result<(), InstallError> {
    let at = record_path(config);
    let err = |source| InstallError::Write {
        path: at.clone(),
        source,
    };
    let data = serde_json::to_vec_pretty(record).map_err(|e| err(std::io::Error::other(e)))?;
    if let Some(dir) = at.parent() {
        std::fs::create_dir_all(dir).map_err(err)?;
    }
    crate::fsops::write_atomic(&at, &data, 0o600).map_err(err)
}

fn forget(config: &Path) -> Result<(), InstallError> {
    let at = record_path(config);
    match std::fs::remove_file(&at) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(InstallError::Write { path: at, source }),
    }
}

/// An install's write of `new` over `config`, whose text was `before`: the record keeps
/// the original (the first install's `before`, or this one's when the record is stale)
/// and adds `runtime`, then the config is written.
pub(crate) fn write(
    config: &Path,
    before: &str,
    new: &str,
    runtime: Option<&str>,
) -> Result<(), InstallError> {
    let mut record = current(config, before).unwrap_or_else(|| Record {
        original: config.exists().then(|| before.to_owned()),
        written: String::new(),
        runtimes: Vec::new(),
    });
    record.written = new.to_owned();
    if let Some(name) = runtime {
        if !record.runtimes.iter().any(|r| r == name) {
            record.runtimes.push(name.to_owned());
        }
    }
    store(config, &record)?;
    file::write(config, new)
}

/// What uninstall does to a config.
#[derive(Debug, PartialEq)]
pub(crate) enum Undo {
    /// Put back the text before gpushare's first install (`None`: delete the file).
    Restore(Option<String>),
    /// Write `text`: the file with only the runtime's own entry taken out. `stale`: a
    /// record is there that no longer speaks for the file (it changed since gpushare
    /// wrote it), so whatever else the installs added stays.
    Remove { text: String, stale: bool },
    /// No entry of that runtime to take out (`stale` as for `Remove`).
    Nothing { stale: bool },
}

/// What uninstall of runtime `name` does to `config`, whose text is `text`: `removed` is
/// the text with only that runtime's entry taken out (`None`: it has none).
pub(crate) fn plan(config: &Path, text: &str, name: &str, removed: Option<String>) -> Undo {
    let stale = record_path(config).exists();
    let Some(record) = current(config, text) else {
        return match removed {
            Some(text) => Undo::Remove { text, stale },
            None => Undo::Nothing { stale },
        };
    };
    if record.runtimes.iter().all(|r| r == name) {
        return Undo::Restore(record.original);
    }
    match removed {
        Some(text) => Undo::Remove { text, stale: false },
        None => Undo::Nothing { stale: false },
    }
}

/// Carries out `undo` on `config` (and its record), for runtime `name`.
pub(crate) fn apply(config: &Path, undo: &Undo, name: &str) -> Result<(), InstallError> {
    match undo {
        Undo::Restore(original) => {
            match original {
                Some(text) => file::write(config, text)?,
                None => match std::fs::remove_file(config) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(source) => {
                        return Err(InstallError::Write {
                            path: config.to_owned(),
                            source,
                        })
                    }
                },
            }
            forget(config)
        }
        Undo::Remove { text, stale } => {
            let before = file::read(config)?;
            if !stale {
                if let Some(mut record) = current(config, &before) {
                    record.runtimes.retain(|r| r != name);
                    record.written = text.clone();
                    store(config, &record)?;
                }
            }
            file::write(config, text)
        }
        Undo::Nothing { .. } => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::super::{
        containerd::{
            commands::{install_nri, write_hook_only},
            Containerd, NriRequired,
        },
        docker::Docker,
        engine::run,
        plan_cdi, uninstall, write_cdi, EngineConfig, Install,
    };
    use std::path::{Path, PathBuf};

    /// Where one install step runs: the engine's config, the config version of a new
    /// file, and the runtime name.
    struct At<'a> {
        config: &'a Path,
        version: i64,
        name: &'a str,
    }

    type Step = fn(&At) -> anyhow::Result<()>;

    fn args(at: &At, engine: &'static dyn EngineConfig) -> Install {
        Install {
            engine,
            config_version: Some(at.version),
            config: Some(at.config.to_owned()),
            runtime_path: Some("/usr/bin/gpushare-runtime".into()),
            name: at.name.to_owned(),
            dry_run: false,
        }
    }

    /// What `ctr oci spec` prints, trimmed.
    const DEFAULT_SPEC: &[u8] = br#"{"ociVersion":"1.1.0","process":{"args":["sh"]}}"#;

    // Each install option, as the CLI runs it.
    fn docker(at: &At) -> anyhow::Result<()> {
        run(args(at, &Docker))
    }
    fn docker_cdi(at: &At) -> anyhow::Result<()> {
        enable_cdi(
            &Docker,
            Some(at.config.into()),
            Path::new("/opt/cdi"),
            Some(2),
        )
    }
    fn shim(at: &At) -> anyhow::Result<()> {
        run(args(at, &Containerd))
    }
    fn hook_only(at: &At) -> anyhow::Result<()> {
        write_hook_only(&args(at, &Containerd), at.config, at.version, DEFAULT_SPEC)
    }
    /// `install containerd --nri` with `--nri-launch` (`launch`) and `--nri-required`.
    fn nri_with(at: &At, launch: bool, required: Option<NriRequired>) -> anyhow::Result<()> {
        install_nri(
            Some(at.config.into()),
            Some(at.version),
            false,
            launch,
            required,
        )
    }
    fn nri(at: &At) -> anyhow::Result<()> {
        nri_with(at, false, None)
    }
    fn nri_launch(at: &At) -> anyhow::Result<()> {
        nri_with(at, true, None)
    }
    fn nri_required_node(at: &At) -> anyhow::Result<()> {
        nri_with(at, false, Some(NriRequired::Node))
    }
    fn nri_required_pods(at: &At) -> anyhow::Result<()> {
        nri_with(at, false, Some(NriRequired::Pods))
    }
    /// `install cdi --enable <engine>` as the CLI runs it (its plan, then its write).
    fn enable_cdi(
        engine: &dyn EngineConfig,
        config: Option<PathBuf>,
        dir: &Path,
        version: Option<i64>,
    ) -> anyhow::Result<()> {
        write_cdi(plan_cdi(engine, config, dir, version)?, dir)
    }
    fn containerd_cdi(at: &At) -> anyhow::Result<()> {
        enable_cdi(
            &Containerd,
            Some(at.config.into()),
            Path::new("/opt/cdi"),
            Some(at.version),
        )
    }

    /// Configs as nodes have them (`None`: no file), with the version a new file gets;
    /// `@PLUGINS@` is a private NRI plugin directory.
    const CONTAINERD_CONFIGS: &[(&str, i64, Option<&str>)] = &[
        ("no file, 1.x", 2, None),
        ("no file, 2.x", 3, None),
        ("empty", 2, Some("")),
        (
            "kubeadm 1.7",
            2,
            Some(
                r#"# containerd 1.7, kubeadm
version = 2
root = "/var/lib/containerd"

[plugins]
  [plugins."io.containerd.grpc.v1.cri"]
    sandbox_image = "registry.k8s.io/pause:3.9"   # pinned
    [plugins."io.containerd.grpc.v1.cri".containerd]
      default_runtime_name = "runc"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"
        [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
          SystemdCgroup = true
"#,
            ),
        ),
        (
            "1.7, no runtimes, NRI off",
            2,
            Some(
                "version = 2\nroot = \"/var/lib/containerd\"\n\n[plugins.\"io.containerd.nri.v1.nri\"]\n  disable = true   # not yet\n  socket_path = \"/var/run/nri/nri.sock\"\n",
            ),
        ),
        ("2.x bare", 3, Some("version = 3\n")),
        (
            "2.x, NRI off, CDI dirs",
            3,
            Some(
                "version = 3\n\n[plugins.'io.containerd.cri.v1.runtime']\n  enable_cdi = false\n  cdi_spec_dirs = ['/etc/cdi']\n\n[plugins.'io.containerd.nri.v1.nri']\n  disable = true\n  plugin_path = '@PLUGINS@'\n",
            ),
        ),
    ];

    const DOCKER_CONFIGS: &[(&str, i64, Option<&str>)] = &[
        ("no file", 2, None),
        ("empty", 2, Some("")),
        ("{}", 2, Some("{}")),
        (
            "compact",
            2,
            Some(r#"{"log-driver":"journald","runtimes":{"nvidia":{"path":"nvidia-container-runtime"}}}"#),
        ),
        (
            "CDI half on",
            2,
            Some("{\n    \"features\": {\"cdi\": false},\n    \"cdi-spec-dirs\": [\"/etc/cdi\"]\n}\n"),
        ),
    ];

    /// One install option (or a sequence of them) and the uninstalls that undo it. Add a
    /// row for a new option.
    struct Row {
        what: &'static str,
        docker: bool,
        steps: &'static [(Step, &'static str)],
        uninstall: &'static [&'static str],
        /// Only on configs whose label contains this (`""`: every config).
        only: &'static str,
    }

    const ROWS: &[Row] = &[
        Row {
            what: "docker",
            docker: true,
            steps: &[(docker, "gpushare")],
            uninstall: &["gpushare"],
            only: "",
        },
        Row {
            what: "docker twice",
            docker: true,
            steps: &[(docker, "gpushare"), (docker, "gpushare")],
            uninstall: &["gpushare"],
            only: "",
        },
        Row {
            what: "docker --name",
            docker: true,
            steps: &[(docker, "gs")],
            uninstall: &["gs"],
            only: "",
        },
        Row {
            what: "cdi --enable docker",
            docker: true,
            steps: &[(docker_cdi, "")],
            uninstall: &["gpushare"],
            only: "",
        },
        Row {
            what: "docker + cdi",
            docker: true,
            steps: &[(docker, "gpushare"), (docker_cdi, "")],
            uninstall: &["gpushare"],
            only: "",
        },
        Row {
            what: "two docker names",
            docker: true,
            steps: &[(docker, "gpushare"), (docker, "b")],
            uninstall: &["b", "gpushare"],
            only: "",
        },
        Row {
            what: "containerd",
            docker: false,
            steps: &[(shim, "gpushare")],
            uninstall: &["gpushare"],
            only: "",
        },
        Row {
            what: "containerd --name",
            docker: false,
            steps: &[(shim, "gs")],
            uninstall: &["gs"],
            only: "",
        },
        Row {
            what: "containerd --hook-only",
            docker: false,
            steps: &[(hook_only, "gpushare")],
            uninstall: &["gpushare"],
            only: "",
        },
        Row {
            what: "shim then hook-only",
            docker: false,
            steps: &[(shim, "gpushare"), (hook_only, "gpushare")],
            uninstall: &["gpushare"],
            only: "",
        },
        Row {
            what: "containerd --nri",
            docker: false,
            steps: &[(nri, "")],
            uninstall: &["gpushare"],
            only: "",
        },
        Row {
            what: "containerd --nri --nri-launch",
            docker: false,
            steps: &[(nri_launch, "")],
            uninstall: &["gpushare"],
            only: "2.x, NRI off",
        },
        Row {
            what: "containerd --nri --nri-required node",
            docker: false,
            steps: &[(nri_required_node, "")],
            uninstall: &["gpushare"],
            only: "2.x",
        },
        Row {
            what: "containerd --nri --nri-required pods",
            docker: false,
            steps: &[(nri_required_pods, "")],
            uninstall: &["gpushare"],
            only: "2.x",
        },
        Row {
            what: "cdi --enable containerd",
            docker: false,
            steps: &[(containerd_cdi, "")],
            uninstall: &["gpushare"],
            only: "",
        },
        Row {
            what: "all of containerd's",
            docker: false,
            steps: &[(shim, "gpushare"), (nri, ""), (containerd_cdi, "")],
            uninstall: &["gpushare"],
            only: "",
        },
        Row {
            what: "two containerd names",
            docker: false,
            steps: &[(shim, "gpushare"), (hook_only, "b")],
            uninstall: &["gpushare", "b"],
            only: "",
        },
    ];

    /// Every install option on every kind of config, then uninstall: the config comes
    /// back byte for byte (or is gone where there was none), and nothing of gpushare's
    /// is left beside it (record, base spec, launched plugin).
    #[test]
    fn install_then_uninstall_gives_back_every_config_byte_for_byte() {
        let (mut cases, mut changed) = (0, 0);
        for row in ROWS {
            let configs = if row.docker {
                DOCKER_CONFIGS
            } else {
                CONTAINERD_CONFIGS
            };
            for (label, version, text) in configs.iter().filter(|c| c.0.contains(row.only)) {
                let case = format!("{} on {label}", row.what);
                let dir = tempfile::tempdir().unwrap();
                let plugins = dir.path().join("nri-plugins");
                let config = dir.path().join("etc/config");
                let original = text.map(|t| t.replace("@PLUGINS@", &plugins.display().to_string()));
                if let Some(t) = &original {
                    std::fs::create_dir_all(config.parent().unwrap()).unwrap();
                    std::fs::write(&config, t).unwrap();
                }
                let before = tree(dir.path());
                for (step, name) in row.steps {
                    let at = At {
                        config: &config,
                        version: *version,
                        name: if name.is_empty() { "gpushare" } else { name },
                    };
                    step(&at).unwrap_or_else(|e| panic!("{case}: {e:#}"));
                }
                changed += usize::from(tree(dir.path()) != before);
                let engine: &dyn EngineConfig = if row.docker { &Docker } else { &Containerd };
                for name in row.uninstall {
                    uninstall(engine, Some(config.clone()), name, false)
                        .unwrap_or_else(|e| panic!("{case}: {e:#}"));
                }
                assert_eq!(
                    std::fs::read_to_string(&config).ok(),
                    original,
                    "{case}: the config as it was"
                );
                assert_eq!(tree(dir.path()), before, "{case}: nothing left beside it");
                cases += 1;
            }
        }
        assert!(
            cases > 60 && changed > 55,
            "{cases} cases, {changed} changed"
        );
    }

    /// The files under `dir` and their content (not the directories install made).
    fn tree(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
        let mut out = Vec::new();
        let mut todo = vec![dir.to_owned()];
        while let Some(d) = todo.pop() {
            for e in std::fs::read_dir(&d).unwrap() {
                let p = e.unwrap().path();
                if p.is_dir() {
                    todo.push(p);
                } else {
                    out.push((p.clone(), std::fs::read(&p).unwrap()));
                }
            }
        }
        out.sort();
        out
    }

    /// A config changed by hand since gpushare wrote it is never replaced by its old
    /// copy: only the runtime's entry goes, the record stays for the operator to compare,
    /// and a later install starts a new record from the file as it then is.
    #[test]
    fn a_config_changed_since_install_loses_only_the_runtime() {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("config.toml");
        std::fs::write(&config, "version = 2\n").unwrap();
        let at = At {
            config: &config,
            version: 2,
            name: "gpushare",
        };
        shim(&at).unwrap();
        nri(&at).unwrap();
        // A dry run writes nothing, the record included.
        let installed = std::fs::read_to_string(&config).unwrap();
        let record = std::fs::read(super::record_path(&config)).unwrap();
        uninstall(&Containerd, Some(config.clone()), "gpushare", true).unwrap();
        assert_eq!(std::fs::read_to_string(&config).unwrap(), installed);
        assert_eq!(std::fs::read(super::record_path(&config)).unwrap(), record);
        let edited = std::fs::read_to_string(&config).unwrap() + "# mine\n";
        std::fs::write(&config, &edited).unwrap();
        uninstall(&Containerd, Some(config.clone()), "gpushare", false).unwrap();
        let left = std::fs::read_to_string(&config).unwrap();
        assert!(
            !left.contains("gpushare") && left.contains("# mine"),
            "{left}"
        );
        assert!(left.contains("disable = false"), "NRI stays: {left}");
        assert!(super::record_path(&config).exists());
        // A new install and its uninstall give back the file as it was then.
        shim(&at).unwrap();
        uninstall(&Containerd, Some(config.clone()), "gpushare", false).unwrap();
        assert_eq!(std::fs::read_to_string(&config).unwrap(), left);
        assert!(!super::record_path(&config).exists());
    }
}
