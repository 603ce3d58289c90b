//! containerd: a runc-v2 runtime whose `BinaryName` is gpushare-runtime, with a
//! `pod_annotations` allowlist naming exactly the request annotations ([`pod_annotations`];
//! CRI passes no pod annotation to the OCI spec unless allowed, docs/kubernetes.md) and `container_annotations =
//! ["cdi.k8s.io/*"]`, so that NVIDIA's device plugin's `cdi-annotations` allocation
//! reaches `gpushare.io/device: allocated`. Config version 2 (containerd 1.6/1.7,
//! CRI plugin `io.containerd.grpc.v1.cri`) and version 3 (2.x, `io.containerd.cri.v1.runtime`).
//!
//! Or, with `--hook-only` ([`Registration::HookOnly`]), no shim at all: plain runc whose
//! `base_runtime_spec` is containerd's own default spec plus gpushare's hook-only
//! `prestart` and `poststop` hooks ([`base_spec`]), the hooks.d setup of Podman and CRI-O
//! carried by the runtime class.
//!
//! `--nri` turns containerd's NRI on ([`enable_nri`]); with `--nri-launch` the plugin is
//! also registered for containerd to launch: [`launch_wrapper`] in the config's NRI
//! [`nri_plugin_dir`], never on a config of containerd 1.x ([`check_nri_launch`]); with
//! `--nri-required` NRI's default validator refuses containers that need the plugin while
//! it is not connected ([`require_nri`]; uninstall takes it back: [`unrequire_nri`]).
//!
//! One file per job: containerd as one of gpushare's engines here; `config` (the
//! runtime's tables, CDI, the hook-only base spec), `nri` (NRI on, its default validator,
//! the launched plugin), `commands` (containerd's own install flags and commands, with
//! their I/O, and what follows its uninstall), `tests`.
//!
//! Invariants: every function here is pure, on the file's text (`ops::install` and
//! `commands` do the I/O); an edit keeps the rest of the file byte for byte and changes
//! nothing the second time;
//! `registration` reads back exactly what `edit` writes (and `remove` takes out), and with
//! `cri_disabled` and `socket` is all that `doctor` learns of a containerd config.

use std::path::Path;

pub(super) mod commands;
mod config;
mod nri;
#[cfg(test)]
mod tests;

pub(crate) use config::*;
pub(crate) use nri::*;

use super::engine::{
    serving, spec_dirs_hint, About, EngineConfig, Finding, Install, Registration, Removal,
};
use super::file::{Edited, InstallError};
use crate::config::Config;

/// Containerd as data: its names, where its config and socket are, its help texts.
const CONTAINERD: About = About {
    name: "containerd",
    default_config: DEFAULT_CONFIG,
    default_socket: "/run/containerd/containerd.sock",
    config_name: "containerd's config.toml",
    install_about: "Add a runc-v2 runtime with BinaryName to containerd's config.toml (default /etc/containerd/config.toml)",
    uninstall_about: "Remove the runtime's tables from containerd's config.toml (default /etc/containerd/config.toml), the hook-only base spec of ours it named, the NRI plugin `install containerd --nri-launch` put in its plugin_path, gpushare in NRI's required_plugins (`--nri-required node`), and the state of an NRI plugin that no longer runs (`<state-dir>/nri.json`)",
    cdi_settings: "`enable_cdi`, `cdi_spec_dirs` of the CRI plugin",
    cdi_restart: "restart containerd to use it",
};

/// containerd as one of gpushare's engines, with its own install flags: `--hook-only`
/// ([`commands::hook_only`]) and `--nri` ([`commands::install_nri`]).
pub(crate) struct Containerd;

impl EngineConfig for Containerd {
    fn about(&self) -> &'static About {
        &CONTAINERD
    }
    fn install_flags(&self) -> Vec<clap::Arg> {
        commands::flags()
    }
    fn install(&self, install: Install, flags: &clap::ArgMatches) -> anyhow::Result<()> {
        commands::install(install, flags)
    }
    fn after_uninstall(&self, cfg: &Config) {
        commands::forget_nri_plugin(cfg);
    }
    fn edit(
        &self,
        path: &Path,
        text: &str,
        name: &str,
        runtime: &Path,
        version: Option<i64>,
    ) -> Result<Edited, InstallError> {
        let shim = Registration::Shim(runtime.to_owned());
        let version = version.unwrap_or_else(commands::installed_config_version);
        edit(path, text, name, &shim, version)
    }
    /// Also the hook-only base spec of ours that the runtime named, the launched NRI
    /// plugin of ours, and gpushare in NRI's `required_plugins`: no container may need a
    /// plugin that is going away, NRI's validator would refuse them all.
    fn remove(&self, path: &Path, text: &str, name: &str) -> Result<Removal, InstallError> {
        let (edited, base_spec) = remove(path, text, name)?;
        let on = edited.text.as_deref().unwrap_or(text);
        let also = unrequire_nri(path, on, crate::nri::DEFAULT_NAME)?.text.map(|t| {
            let said = format!(
                "removed {} from NRI's required_plugins in {}; restart containerd (`systemctl restart containerd`)",
                crate::nri::DEFAULT_NAME,
                path.display()
            );
            (t, said)
        });
        let wrapper = commands::our_launch_wrapper(text).map(|at| {
            let said = format!(
                "removed gpushare's NRI plugin {}; containerd stops it when it restarts",
                at.display()
            );
            (at, Some(said))
        });
        Ok(Removal {
            runtime: edited.text,
            also,
            files: base_spec
                .map(|p| (p, None))
                .into_iter()
                .chain(wrapper)
                .collect(),
        })
    }
    fn enable_cdi(
        &self,
        path: &Path,
        text: &str,
        dir: &Path,
        version: Option<i64>,
    ) -> Result<Edited, InstallError> {
        let version = version.unwrap_or_else(commands::installed_config_version);
        enable_cdi(path, text, dir, version)
    }
    fn cdi_usage(&self, dir: &Path) -> String {
        format!(
            "containerd 1.7+ (CRI): enable_cdi = true (the default in 2.x){} in the CRI runtime plugin's table (or: gpushare install cdi --enable containerd); kubelet passes CDI devices from device plugins and DRA drivers",
            spec_dirs_hint("cdi_spec_dirs = ", &CONTAINERD_CDI_DIRS, dir)
        )
    }
    fn next_steps(&self, name: &str) -> Vec<String> {
        vec![
            "restart containerd to use it: `systemctl restart containerd`;".to_owned(),
            format!("Kubernetes: a RuntimeClass with handler: {name} (see deploy/)"),
        ]
    }
    fn forget_steps(&self, name: &str, _restored: bool) -> Vec<String> {
        vec![
            "restart containerd for it to forget the runtime: `systemctl restart containerd`;"
                .to_owned(),
            format!(
                "Kubernetes: delete the RuntimeClass whose handler is {name} once no pod uses it"
            ),
        ]
    }
    /// A `gpushare` runtime in its CRI plugin's config, where containerd serves
    /// Kubernetes.
    fn check(&self, config: &Path, socket: &Path) -> Finding {
        const FIX: Option<&str> = Some("gpushare install containerd, then restart containerd");
        let text = std::fs::read_to_string(config);
        // The containerd that reads this file listens where its `[grpc] address` says.
        let socket = text
            .as_ref()
            .ok()
            .and_then(|t| self::socket(t))
            .unwrap_or_else(|| socket.to_owned());
        match text {
            Err(_) if !serving(&socket) => Finding {
                detail: format!(
                    "containerd does not run here (no {}, no {}): nothing to configure",
                    config.display(),
                    socket.display()
                ),
                fix: None,
            },
            Err(_) => Finding {
                detail: format!(
                    "containerd serves {} but {} does not exist",
                    socket.display(),
                    config.display()
                ),
                fix: FIX,
            },
            Ok(text) => {
                // Docker's own containerd (Debian's docker.io installs the package) serves no
                // Kubernetes: without a running containerd with its CRI plugin there is
                // nothing for gpushare to configure.
                let cri_disabled = cri_disabled(&text);
                let found = registration(&text, "gpushare").map(|r| match r {
                    Registration::Shim(bin) => format!("BinaryName {}", bin.display()),
                    Registration::HookOnly(spec) => {
                        format!("hook-only, base_runtime_spec {}", spec.display())
                    }
                });
                match found {
                    Some(how) => Finding {
                        detail: format!("{} has runtime gpushare ({how})", config.display()),
                        fix: None,
                    },
                    None if cri_disabled || !serving(&socket) => Finding {
                        detail: format!(
                            "{} has no gpushare runtime, and {}: nothing for Kubernetes to use here",
                            config.display(),
                            if cri_disabled {
                                "its CRI plugin is disabled (Docker's containerd)".to_owned()
                            } else {
                                format!("containerd does not run (no {})", socket.display())
                            }
                        ),
                        fix: None,
                    },
                    None => Finding {
                        detail: format!("{} has no gpushare runtime", config.display()),
                        fix: FIX,
                    },
                }
            }
        }
    }
}
