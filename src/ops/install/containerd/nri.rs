//! containerd's NRI in its config.toml: turning NRI on, NRI's default validator
//! requiring gpushare (node-wide or per pod) and taking that back, and the plugin that
//! containerd launches from its plugin path (the wrapper and where it goes). Pure
//! functions on the file's text.

use std::path::{Path, PathBuf};

use toml_edit::{value, Array, DocumentMut, Item, Table};

use super::super::file::{Edited, InstallError};
use super::config::{cri_table, not_a_table, parse_versioned, table, version_of};

/// containerd's NRI plugin (the same name in 1.7 and 2.x).
pub(super) const NRI_PLUGIN: &str = "io.containerd.nri.v1.nri";

/// Turns containerd's NRI on: `disable = false` in `[plugins."io.containerd.nri.v1.nri"]`,
/// which 1.7 needs (NRI is off there unless configured) and 2.x has by default (a 2.x
/// file is changed only where it says `disable = true`). The rest
/// of the file is kept byte for byte; the socket stays NRI's default.
pub(crate) fn enable_nri(
    path: &Path,
    text: &str,
    default_version: i64,
) -> Result<Edited, InstallError> {
    let (mut doc, empty, _) = parse_versioned(path, text, default_version, "1.7")?;
    let version = version_of(&doc, empty, default_version).unwrap_or(1);
    let before = doc.to_string();
    let disabled = doc
        .get("plugins")
        .and_then(|p| p.get(NRI_PLUGIN))
        .and_then(|n| n.get("disable"))
        .and_then(Item::as_bool)
        == Some(true);
    if version >= 3 && !disabled {
        return Ok(Edited {
            text: empty.then(|| doc.to_string()),
        });
    }
    let nri = cri_table(path, &mut doc, NRI_PLUGIN)?;
    nri.set_implicit(false);
    nri.insert("disable", value(false));
    let after = doc.to_string();
    Ok(Edited {
        text: (after != before || empty).then_some(after),
    })
}

/// Which containers NRI's default validator (containerd 2.2 and later) refuses while
/// gpushare's plugin is not connected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NriRequired {
    /// Every container of the node (`required_plugins`), but a pod's that tolerates the
    /// plugin's absence ([`TOLERATE_ANNOTATION`]).
    Node,
    /// The containers of pods that ask for it ([`REQUIRED_ANNOTATION`]).
    Pods,
}

/// NRI's pod annotation naming the plugins a pod's containers need, a YAML list
/// (`["gpushare"]`); `<key>/container.<name>` for one container.
pub(crate) const REQUIRED_ANNOTATION: &str = "required-plugins.noderesource.dev";

/// The pod annotation (`"true"`) whose pods the node-wide requirement lets through, which
/// `--nri-required node` names where the file names none: the node's own pods (the
/// plugin's, the installer's, a CNI's) must start while the plugin is not there.
pub(crate) const TOLERATE_ANNOTATION: &str = "tolerate-missing-plugins.gpushare.io";

/// The validator's table in NRI's.
pub(super) const VALIDATOR: &str = "default_validator";

/// Has NRI's default validator refuse containers that need plugin `name` while it is not
/// connected: `enable = true` in `[plugins."io.containerd.nri.v1.nri".default_validator]`,
/// and for [`NriRequired::Node`] `name` in its `required_plugins` and a
/// `tolerate_missing_plugins_annotation` (the file's own, else [`TOLERATE_ANNOTATION`]);
/// [`NriRequired::Pods`] takes `name` out of `required_plugins`. Refused on a version 2
/// config (containerd 1.x, which has no validator). The rest is kept byte for byte.
pub(crate) fn require_nri(
    path: &Path,
    text: &str,
    default_version: i64,
    required: NriRequired,
    name: &str,
) -> Result<Edited, InstallError> {
    let (mut doc, empty) = version_3(path, text, default_version, |version| {
        format!(
            "--nri-required needs containerd 2.2 or later (config version 3), this file is version {version}: NRI's default validator, which refuses the containers, came with containerd 2.2"
        )
    })?;
    let before = doc.to_string();
    let nri = cri_table(path, &mut doc, NRI_PLUGIN)?;
    let validator = table(nri, VALIDATOR)
        .ok_or_else(|| not_a_table(path, &format!("{NRI_PLUGIN}.{VALIDATOR}")))?;
    validator.set_implicit(false);
    validator.insert("enable", value(true));
    match required {
        NriRequired::Node => {
            if !validator.contains_key("tolerate_missing_plugins_annotation") {
                validator.insert(
                    "tolerate_missing_plugins_annotation",
                    value(TOLERATE_ANNOTATION),
                );
            }
            if let Some(names) = required_plugins(path, validator, true)? {
                if !names.iter().any(|n| n.as_str() == Some(name)) {
                    names.push(name);
                }
            }
        }
        NriRequired::Pods => {
            if let Some(names) = required_plugins(path, validator, false)? {
                names.retain(|n| n.as_str() != Some(name));
            }
        }
    }
    let after = doc.to_string();
    Ok(Edited {
        text: (after != before || empty).then_some(after),
    })
}

/// Takes plugin `name` out of the default validator's `required_plugins` (uninstall: no
/// container of the node may need a plugin that is gone); the rest is left as it is.
/// `None`: nothing to take out.
pub(crate) fn unrequire_nri(path: &Path, text: &str, name: &str) -> Result<Edited, InstallError> {
    let unchanged = Ok(Edited { text: None });
    let Ok(mut doc) = text.parse::<DocumentMut>() else {
        return unchanged;
    };
    let before = doc.to_string();
    let Some(validator) = doc
        .get_mut("plugins")
        .and_then(|p| p.get_mut(NRI_PLUGIN))
        .and_then(|n| n.get_mut(VALIDATOR))
        .and_then(Item::as_table_mut)
    else {
        return unchanged;
    };
    if let Some(names) = required_plugins(path, validator, false)? {
        names.retain(|n| n.as_str() != Some(name));
    }
    let after = doc.to_string();
    Ok(Edited {
        text: (after != before).then_some(after),
    })
}

/// The validator's `required_plugins`, edited in place (its layout kept); where absent,
/// a new empty one if `create`, else `None`. A value that is not a list of strings is
/// refused.
pub(super) fn required_plugins<'t>(
    path: &Path,
    validator: &'t mut Table,
    create: bool,
) -> Result<Option<&'t mut Array>, InstallError> {
    if !validator.contains_key("required_plugins") {
        if !create {
            return Ok(None);
        }
        validator.insert("required_plugins", value(Array::new()));
    }
    validator
        .get_mut("required_plugins")
        .and_then(Item::as_array_mut)
        .filter(|a| a.iter().all(|v| v.as_str().is_some()))
        .map(Some)
        .ok_or_else(|| InstallError::Unsupported {
            path: path.to_owned(),
            message: format!(
                "{NRI_PLUGIN}.{VALIDATOR}.required_plugins is not a list of plugin names"
            ),
        })
}

/// Where containerd looks for the NRI plugins it launches when `plugin_path` is not set.
pub(crate) const DEFAULT_NRI_PLUGIN_PATH: &str = "/opt/nri/plugins";

/// The launched plugin's file name: NRI launches each executable `<index>-<name>` of its
/// plugin directory (the index orders the plugins), with the name and index in
/// `NRI_PLUGIN_NAME` and `NRI_PLUGIN_IDX`.
pub(crate) fn launched_plugin_name() -> String {
    format!("{}-{}", crate::nri::DEFAULT_INDEX, crate::nri::DEFAULT_NAME)
}

/// The wrapper's second line: what `is_launch_wrapper` knows it by, so that uninstall
/// deletes only a file this installer wrote.
pub(super) const WRAPPER_MARK: &str = "# gpushare's NRI plugin, launched by containerd";

/// The directory containerd launches NRI plugins from: `plugin_path` of
/// `[plugins."io.containerd.nri.v1.nri"]`, else NRI's default (also for a file that is
/// not TOML: the caller's edit refuses that one with its reason).
pub(crate) fn nri_plugin_dir(text: &str) -> PathBuf {
    nri_path(text, "plugin_path").unwrap_or_else(|| PathBuf::from(DEFAULT_NRI_PLUGIN_PATH))
}

/// Refuses to register a launched plugin with a config of version 2 (containerd 1.x):
/// containerd 1.7 stops its CRI plugin when a plugin it launched fails to register, so a
/// broken gpushare would take every pod start of the node down with it; 2.x only logs it.
pub(crate) fn check_nri_launch(
    path: &Path,
    text: &str,
    default_version: i64,
) -> Result<(), InstallError> {
    version_3(path, text, default_version, |version| {
        format!(
            "--nri-launch needs containerd 2.x (config version 3), this file is version {version}: containerd 1.7 stops its CRI plugin when a plugin it launched fails to register; run `gpushare nri` as a service instead (containerd 2.x: `containerd config migrate` first)"
        )
    })?;
    Ok(())
}

/// The config, parsed, and whether the file was empty, when it is of version 3
/// (containerd 2.x); refused otherwise, with `needs(version)` saying what needs it.
fn version_3(
    path: &Path,
    text: &str,
    default_version: i64,
    needs: impl FnOnce(i64) -> String,
) -> Result<(DocumentMut, bool), InstallError> {
    let (doc, empty, _) = parse_versioned(path, text, default_version, "1.7")?;
    let version = version_of(&doc, empty, default_version).unwrap_or(1);
    if version < 3 {
        return Err(InstallError::Unsupported {
            path: path.to_owned(),
            message: needs(version),
        });
    }
    Ok((doc, empty))
}

/// The socket a containerd config's NRI listens on (`socket_path`), NRI's default where
/// it sets none.
pub(crate) fn nri_socket(text: &str) -> PathBuf {
    nri_path(text, "socket_path").unwrap_or_else(|| PathBuf::from(crate::nri::DEFAULT_SOCKET))
}

/// The path `key` of `[plugins."io.containerd.nri.v1.nri"]` sets, if it sets one (not
/// empty) and the file is TOML.
fn nri_path(text: &str, key: &str) -> Option<PathBuf> {
    let doc = toml::from_str::<toml::Table>(text).ok()?;
    let path = doc.get("plugins")?.get(NRI_PLUGIN)?.get(key)?;
    path.as_str().filter(|p| !p.is_empty()).map(PathBuf::from)
}

/// The launched plugin: a shell script that execs `gpushare nri --socket <socket>` (so
/// that containerd's kill reaches the plugin itself; the plugin talks to containerd on
/// the connection it was handed, and its validator, a process of its own, dials
/// `socket`) with `env` (`NAME=value`: the PATH and config that the plugin would not
/// otherwise get, as containerd launches it with NRI's three variables only).
/// Everything it names is single-quoted.
pub(crate) fn launch_wrapper(gpushare: &Path, env: &[String], socket: &Path) -> String {
    let quote = |s: &str| format!("'{}'", s.replace('\'', "'\\''"));
    let mut out = format!(
        "#!/bin/sh\n{WRAPPER_MARK} from its plugin_path; written by `gpushare install containerd --nri-launch`, removed by `gpushare uninstall containerd`.\n"
    );
    for var in env {
        if let Some((name, value)) = var.split_once('=') {
            out += &format!("{name}={}; export {name}\n", quote(value));
        }
    }
    out += &format!(
        "exec {} nri --socket {}\n",
        quote(&gpushare.to_string_lossy()),
        quote(&socket.to_string_lossy())
    );
    out
}

/// Whether `content` is a wrapper `launch_wrapper` wrote.
pub(crate) fn is_launch_wrapper(content: &str) -> bool {
    content.starts_with("#!/bin/sh\n")
        && content
            .lines()
            .nth(1)
            .is_some_and(|l| l.starts_with(WRAPPER_MARK))
}
