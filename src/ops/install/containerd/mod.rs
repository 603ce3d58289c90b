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
//! containerd's own install flags and commands (`--hook-only`, `--nri`), with their I/O,
//! and what follows its uninstall are in `commands`.
//!
//! Invariants: every function here is pure, on the file's text (`ops::install` and
//! `commands` do the I/O); an edit keeps the rest of the file byte for byte and changes
//! nothing the second time;
//! `registration` reads back exactly what `edit` writes (and `remove` takes out), and with
//! `cri_disabled` and `socket` is all that `doctor` learns of a containerd config.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use toml_edit::{value, Array, DocumentMut, Item, Table};

pub(super) mod commands;

use super::engine::{serving, Finding, Removal};
use super::file::{Edited, InstallError};
use super::{Install, Registration};
use crate::config::Config;

/// Where containerd keeps its config on a standard install.
pub(crate) const DEFAULT_CONFIG: &str = "/etc/containerd/config.toml";

/// The hook-only base spec's file name for runtime `name`, beside containerd's config.
pub(crate) fn base_spec_name(name: &str) -> String {
    format!("{name}-base-spec.json")
}

/// The hook-only base spec: `default_spec` (containerd's default, as `ctr oci spec`
/// prints it) with gpushare's `prestart` and `poststop` hooks (`gpushare` at this path,
/// with `env`), any earlier ones of that binary replaced and every other hook kept. The
/// timeouts are those of hooks/oci-hooks.d. `path` is where it goes, for errors.
pub(crate) fn base_spec(
    path: &Path,
    default_spec: &[u8],
    gpushare: &Path,
    env: &[String],
) -> Result<String, InstallError> {
    let shape = |message: &str| InstallError::Unsupported {
        path: path.to_owned(),
        message: format!("containerd's default spec {message}"),
    };
    let mut spec: Value =
        serde_json::from_slice(default_spec).map_err(|e| InstallError::Parse {
            path: path.to_owned(),
            format: "JSON (containerd's default spec)",
            message: crate::util::one_line(&e.to_string()),
        })?;
    let hooks = spec
        .as_object_mut()
        .ok_or_else(|| shape("is not a JSON object"))?
        .entry("hooks")
        .or_insert_with(|| json!({}))
        .as_object_mut()
        .ok_or_else(|| shape("has hooks that are not an object"))?;
    let binary = gpushare.to_string_lossy();
    for (stage, timeout) in [("prestart", 20), ("poststop", 10)] {
        let list = hooks
            .entry(stage)
            .or_insert_with(|| json!([]))
            .as_array_mut()
            .ok_or_else(|| shape("has hooks that are not lists"))?;
        list.retain(|h| h.get("path").and_then(Value::as_str) != Some(binary.as_ref()));
        list.push(json!({
            "path": binary,
            "args": ["gpushare", "hook", stage],
            "env": env,
            "timeout": timeout,
        }));
    }
    let mut text = serde_json::to_string_pretty(&spec).map_err(|e| shape(&e.to_string()))?;
    text.push('\n');
    Ok(text)
}

/// The pod annotations the runtime class lets through: exactly the request keys
/// (`request::KEYS`), never a pattern: `gpushare.io/*` would also let through the decision
/// annotations gpushare writes for its own hooks (`gpushare.io/daemon`, …), which a pod
/// must not be able to set.
pub(crate) fn pod_annotations() -> Array {
    crate::request::KEYS.iter().map(|k| k.annotation).collect()
}

/// Where the runtimes table lives for each config version.
fn cri_plugin(version: i64) -> Option<&'static str> {
    match version {
        2 => Some("io.containerd.grpc.v1.cri"),
        3 => Some("io.containerd.cri.v1.runtime"),
        _ => None,
    }
}

/// `version` of a config: its `version` key; for a new (empty) file, `default_version`.
fn version_of(doc: &DocumentMut, empty: bool, default_version: i64) -> Option<i64> {
    match doc.get("version").and_then(Item::as_integer) {
        Some(v) => Some(v),
        None if empty => Some(default_version),
        None => Some(1),
    }
}

fn table<'a>(parent: &'a mut Table, key: &str) -> Option<&'a mut Table> {
    if !parent.contains_key(key) {
        let mut t = Table::new();
        t.set_implicit(true);
        parent.insert(key, Item::Table(t));
    }
    parent.get_mut(key)?.as_table_mut()
}

/// Parses a containerd config and finds its CRI plugin's table name by its `version`
/// (`default_version` for an empty file, which gets that `version` written). Returns the
/// document, whether it was empty, and the plugin's name. `v2_engines` names the
/// containerd releases that read version 2 in the refusal of another version.
fn parse_versioned(
    path: &Path,
    text: &str,
    default_version: i64,
    v2_engines: &str,
) -> Result<(DocumentMut, bool, &'static str), InstallError> {
    let mut doc: DocumentMut =
        text.parse()
            .map_err(|e: toml_edit::TomlError| InstallError::Parse {
                path: path.to_owned(),
                format: "TOML",
                message: crate::util::one_line(&e.to_string()),
            })?;
    let empty = doc.as_table().is_empty();
    let version = version_of(&doc, empty, default_version).unwrap_or(1);
    let Some(plugin) = cri_plugin(version) else {
        return Err(InstallError::Unsupported {
            path: path.to_owned(),
            message: format!(
                "config version {version} is not supported: allowed are versions 2 (containerd {v2_engines}) and 3 (2.x); run `containerd config migrate` first"
            ),
        });
    };
    if empty {
        doc.insert("version", value(version));
    }
    Ok((doc, empty, plugin))
}

/// `[plugins."<plugin>"]` of `doc`, made where missing; a non-table on the way is refused.
fn cri_table<'d>(
    path: &Path,
    doc: &'d mut DocumentMut,
    plugin: &str,
) -> Result<&'d mut Table, InstallError> {
    let plugins =
        table(doc.as_table_mut(), "plugins").ok_or_else(|| not_a_table(path, "plugins"))?;
    table(plugins, plugin).ok_or_else(|| not_a_table(path, plugin))
}

/// The refusal of a config whose `what` is there but not a table.
fn not_a_table(path: &Path, what: &str) -> InstallError {
    InstallError::Unsupported {
        path: path.to_owned(),
        message: format!("{what} is not a table"),
    }
}

/// Adds or updates `[plugins."<cri>".containerd.runtimes.<name>]`, keeping the rest of
/// the file byte for byte. `default_version` applies to an empty or missing file.
pub(crate) fn edit(
    path: &Path,
    text: &str,
    name: &str,
    registration: &Registration,
    default_version: i64,
) -> Result<Edited, InstallError> {
    let (mut doc, empty, plugin) = parse_versioned(path, text, default_version, "1.6/1.7")?;
    let before = doc.to_string();
    let cri = cri_table(path, &mut doc, plugin)?;
    let shape = |what: &str| not_a_table(path, what);
    let ctrd = table(cri, "containerd").ok_or_else(|| shape("containerd"))?;
    let default_runtime = ctrd
        .get("default_runtime_name")
        .and_then(Item::as_str)
        .unwrap_or("runc")
        .to_owned();
    let runtimes = table(ctrd, "runtimes").ok_or_else(|| shape("runtimes"))?;
    // A config that names no runtimes runs on containerd's built-in `runc`; once the file
    // has a runtimes table, that built-in entry is gone and the CRI plugin cannot find its
    // default runtime (it does not load). Keep it, as containerd's own default spells it.
    if default_runtime == "runc" && !runtimes.contains_key("runc") {
        let runc = table(runtimes, "runc").ok_or_else(|| shape("runc"))?;
        runc.set_implicit(false);
        runc.insert("runtime_type", value("io.containerd.runc.v2"));
    }
    // The cgroup driver must match the node's: copy runc's SystemdCgroup if it is set.
    let systemd = runtimes
        .get("runc")
        .and_then(|r| r.get("options"))
        .and_then(|o| o.get("SystemdCgroup"))
        .and_then(Item::as_bool);
    let rt = table(runtimes, name).ok_or_else(|| shape(name))?;
    rt.set_implicit(false);
    rt.insert("runtime_type", value("io.containerd.runc.v2"));
    rt.insert("pod_annotations", value(pod_annotations()));
    let mut cdi = Array::new();
    cdi.push("cdi.k8s.io/*");
    rt.insert("container_annotations", value(cdi));
    match registration {
        Registration::Shim(runtime) => {
            // A hook-only base spec of ours goes: the shim injects its own hooks.
            let ours = Some(base_spec_name(name));
            if rt
                .get("base_runtime_spec")
                .and_then(Item::as_str)
                .is_some_and(|p| {
                    Path::new(p).file_name().and_then(|f| f.to_str()) == ours.as_deref()
                })
            {
                rt.remove("base_runtime_spec");
            }
            let opts = table(rt, "options").ok_or_else(|| shape("options"))?;
            opts.set_implicit(false);
            opts.insert("BinaryName", value(runtime.to_string_lossy().as_ref()));
        }
        Registration::HookOnly(base) => {
            rt.insert("base_runtime_spec", value(base.to_string_lossy().as_ref()));
            if let Some(opts) = rt.get_mut("options").and_then(Item::as_table_mut) {
                opts.remove("BinaryName");
            }
        }
    }
    if let Some(systemd) = systemd {
        let opts = table(rt, "options").ok_or_else(|| shape("options"))?;
        opts.set_implicit(false);
        opts.insert("SystemdCgroup", value(systemd));
    }
    let after = doc.to_string();
    Ok(Edited {
        text: (after != before || empty).then_some(after),
    })
}

/// Removes `[plugins."<cri>".containerd.runtimes.<name>]` and the tables below it, keeping
/// the rest of the file byte for byte (the `runc` runtime `edit` may have spelt out stays:
/// it is containerd's own default). Also returns the hook-only base spec the removed table
/// named, when it is ours (`base_spec_name`), for the caller to delete.
pub(crate) fn remove(
    path: &Path,
    text: &str,
    name: &str,
) -> Result<(Edited, Option<std::path::PathBuf>), InstallError> {
    let unchanged = || Ok((Edited { text: None }, None));
    if text.trim().is_empty() {
        return unchanged();
    }
    let (mut doc, _, plugin) = parse_versioned(path, text, 2, "1.6/1.7")?;
    let before = doc.to_string();
    let runtimes = doc
        .get_mut("plugins")
        .and_then(|p| p.get_mut(plugin))
        .and_then(|c| c.get_mut("containerd"))
        .and_then(|c| c.get_mut("runtimes"))
        .and_then(Item::as_table_like_mut);
    let Some(removed) = runtimes.and_then(|r| r.remove(name)) else {
        return unchanged();
    };
    let ours = Some(base_spec_name(name));
    let base_spec = removed
        .get("base_runtime_spec")
        .and_then(Item::as_str)
        .map(std::path::PathBuf::from)
        .filter(|p| p.file_name().and_then(|f| f.to_str()) == ours.as_deref());
    let after = doc.to_string();
    Ok((
        Edited {
            text: (after != before).then_some(after),
        },
        base_spec,
    ))
}

/// How a containerd config registers runtime `name` with its CRI plugin, under either
/// config version's plugin name: through the shim (`options.BinaryName`), hook-only (no
/// `BinaryName`, a `base_runtime_spec`), or not at all (no such runtime, a `BinaryName`
/// that is not a string, or a file that is not TOML).
pub(crate) fn registration(text: &str, name: &str) -> Option<Registration> {
    let doc: toml::Table = toml::from_str(text).ok()?;
    ["io.containerd.grpc.v1.cri", "io.containerd.cri.v1.runtime"]
        .iter()
        .find_map(|plugin| {
            let rt = doc
                .get("plugins")?
                .get(plugin)?
                .get("containerd")?
                .get("runtimes")?
                .get(name)?;
            match rt.get("options").and_then(|o| o.get("BinaryName")) {
                Some(bin) => bin.as_str().map(|b| Registration::Shim(b.into())),
                None => rt
                    .get("base_runtime_spec")
                    .and_then(toml::Value::as_str)
                    .map(|s| Registration::HookOnly(s.into())),
            }
        })
}

/// Whether a containerd config disables its CRI plugin (`disabled_plugins`), as Docker's
/// own containerd does: that containerd serves no Kubernetes. A file that is not TOML
/// disables nothing.
pub(crate) fn cri_disabled(text: &str) -> bool {
    toml::from_str::<toml::Table>(text)
        .ok()
        .and_then(|doc| doc.get("disabled_plugins")?.as_array().cloned())
        .is_some_and(|d| {
            d.iter()
                .any(|p| matches!(p.as_str(), Some("cri" | "io.containerd.grpc.v1.cri")))
        })
}

/// The socket a containerd config makes it listen on (`[grpc] address`, a `unix://`
/// prefix naming the same path), if it sets one.
pub(crate) fn socket(text: &str) -> Option<PathBuf> {
    let doc: toml::Table = toml::from_str(text).ok()?;
    let address = doc.get("grpc")?.get("address")?.as_str()?;
    let path = address.strip_prefix("unix://").unwrap_or(address);
    (!path.is_empty()).then(|| PathBuf::from(path))
}

/// The CDI spec directories containerd's CRI plugin reads when `cdi_spec_dirs` is not set.
pub(crate) const CONTAINERD_CDI_DIRS: [&str; 2] = ["/etc/cdi", "/var/run/cdi"];

/// Turns CDI on in the CRI plugin (`enable_cdi = true`) and makes `dir` one of its CDI
/// spec directories (`cdi_spec_dirs`, which lists containerd's defaults too when it must
/// be written), keeping the rest of the file byte for byte. containerd 1.6 ignores both.
pub(crate) fn enable_cdi(
    path: &Path,
    text: &str,
    dir: &Path,
    default_version: i64,
) -> Result<Edited, InstallError> {
    let (mut doc, empty, plugin) = parse_versioned(path, text, default_version, "1.7")?;
    let before = doc.to_string();
    let cri = cri_table(path, &mut doc, plugin)?;
    cri.set_implicit(false);
    cri.insert("enable_cdi", value(true));
    let dir = dir.to_string_lossy().into_owned();
    match cri.get_mut("cdi_spec_dirs") {
        Some(item) => {
            let dirs = item
                .as_array_mut()
                .ok_or_else(|| InstallError::Unsupported {
                    path: path.to_owned(),
                    message: "cdi_spec_dirs is not a list of directories".into(),
                })?;
            if !dirs.iter().any(|d| d.as_str() == Some(dir.as_str())) {
                dirs.push(dir.as_str());
            }
        }
        None if CONTAINERD_CDI_DIRS.contains(&dir.as_str()) => {}
        None => {
            let mut dirs: Array = CONTAINERD_CDI_DIRS.iter().copied().collect();
            dirs.push(dir.as_str());
            cri.insert("cdi_spec_dirs", value(dirs));
        }
    }
    let after = doc.to_string();
    Ok(Edited {
        text: (after != before || empty).then_some(after),
    })
}

/// containerd's NRI plugin (the same name in 1.7 and 2.x).
const NRI_PLUGIN: &str = "io.containerd.nri.v1.nri";

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
const VALIDATOR: &str = "default_validator";

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
    let (mut doc, empty, _) = parse_versioned(path, text, default_version, "1.7")?;
    let version = version_of(&doc, empty, default_version).unwrap_or(1);
    if version < 3 {
        return Err(InstallError::Unsupported {
            path: path.to_owned(),
            message: format!(
                "--nri-required needs containerd 2.2 or later (config version 3), this file is version {version}: NRI's default validator, which refuses the containers, came with containerd 2.2"
            ),
        });
    }
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
fn required_plugins<'t>(
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
const WRAPPER_MARK: &str = "# gpushare's NRI plugin, launched by containerd";

/// The directory containerd launches NRI plugins from: `plugin_path` of
/// `[plugins."io.containerd.nri.v1.nri"]`, else NRI's default (also for a file that is
/// not TOML: the caller's edit refuses that one with its reason).
pub(crate) fn nri_plugin_dir(text: &str) -> PathBuf {
    toml::from_str::<toml::Table>(text)
        .ok()
        .and_then(|doc| {
            let dir = doc.get("plugins")?.get(NRI_PLUGIN)?.get("plugin_path")?;
            dir.as_str().filter(|d| !d.is_empty()).map(PathBuf::from)
        })
        .unwrap_or_else(|| PathBuf::from(DEFAULT_NRI_PLUGIN_PATH))
}

/// Refuses to register a launched plugin with a config of version 2 (containerd 1.x):
/// containerd 1.7 stops its CRI plugin when a plugin it launched fails to register, so a
/// broken gpushare would take every pod start of the node down with it; 2.x only logs it.
pub(crate) fn check_nri_launch(
    path: &Path,
    text: &str,
    default_version: i64,
) -> Result<(), InstallError> {
    let (doc, empty, _) = parse_versioned(path, text, default_version, "1.7")?;
    let version = version_of(&doc, empty, default_version).unwrap_or(1);
    if version < 3 {
        return Err(InstallError::Unsupported {
            path: path.to_owned(),
            message: format!(
                "--nri-launch needs containerd 2.x (config version 3), this file is version {version}: containerd 1.7 stops its CRI plugin when a plugin it launched fails to register; run `gpushare nri` as a service instead (containerd 2.x: `containerd config migrate` first)"
            ),
        });
    }
    Ok(())
}

/// The socket a containerd config's NRI listens on (`socket_path`), NRI's default where
/// it sets none.
pub(crate) fn nri_socket(text: &str) -> PathBuf {
    toml::from_str::<toml::Table>(text)
        .ok()
        .and_then(|doc| {
            let sock = doc.get("plugins")?.get(NRI_PLUGIN)?.get("socket_path")?;
            sock.as_str().filter(|s| !s.is_empty()).map(PathBuf::from)
        })
        .unwrap_or_else(|| PathBuf::from(crate::nri::DEFAULT_SOCKET))
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

/// Containerd as data: its names, where its config and socket are, its help texts.
const CONTAINERD: super::About = super::About {
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

impl super::EngineConfig for Containerd {
    fn about(&self) -> &'static super::About {
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
            super::spec_dirs_hint("cdi_spec_dirs = ", &CONTAINERD_CDI_DIRS, dir)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The allowlist every class must carry: the request annotations, not a pattern
    /// (`gpushare.io/*` would let a pod set `gpushare.io/daemon`, the shim's decision).
    /// Every request key's annotation (the rows of `request::keys`), and none of the
    /// decision annotations the shim writes for its hook.
    fn request_keys() -> toml::Value {
        let keys: Vec<&str> = crate::request::KEYS.iter().map(|k| k.annotation).collect();
        assert!(keys.contains(&"gpushare.io/device"), "{keys:?}");
        for decision in ["gpushare.io/daemon", "gpushare.io/identity"] {
            assert!(!keys.contains(&decision), "{keys:?}");
        }
        toml::Value::Array(keys.into_iter().map(toml::Value::from).collect())
    }

    const RT: &str = "/usr/local/bin/gpushare-runtime";

    fn run(text: &str, default_version: i64) -> Result<Option<String>, InstallError> {
        edit(
            Path::new("config.toml"),
            text,
            "gpushare",
            &Registration::Shim(RT.into()),
            default_version,
        )
        .map(|e| e.text)
    }

    const BASE: &str = "/etc/containerd/gpushare-base-spec.json";

    /// The tables docs/kubernetes.md prints are what the installer writes into a version 2
    /// config (the shim's with the Debian package's path, the hook-only class's).
    #[test]
    fn the_tables_docs_kubernetes_md_prints_are_the_written_ones() {
        let doc = std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/kubernetes.md"),
        )
        .unwrap();
        let header = "[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.gpushare]";
        for registration in [
            Registration::Shim("/usr/bin/gpushare-runtime".into()),
            Registration::HookOnly(BASE.into()),
        ] {
            let text = edit(
                Path::new("config.toml"),
                "version = 2\n",
                "gpushare",
                &registration,
                2,
            )
            .unwrap()
            .text
            .unwrap();
            let table = &text[text.find(header).unwrap()..];
            // The doc indents the shim's block by three spaces (a list item).
            let indented: String = table
                .lines()
                .map(|l| format!("   {l}\n").replace("   \n", "\n"))
                .collect();
            assert!(
                doc.contains(table.trim_end()) || doc.contains(indented.trim_end()),
                "docs/kubernetes.md does not print the table the installer writes:\n{table}"
            );
        }
    }

    #[test]
    fn the_launched_plugin_goes_to_the_configured_plugin_path_on_containerd_2_only() {
        let nri = "[plugins.\"io.containerd.nri.v1.nri\"]\n";
        for (text, dir) in [
            ("version = 3\n".to_owned(), "/opt/nri/plugins"),
            (
                format!("version = 3\n{nri}  disable = false\n"),
                "/opt/nri/plugins",
            ),
            (
                format!("version = 3\n{nri}  plugin_path = \"/srv/nri\"\n"),
                "/srv/nri",
            ),
            (
                format!("version = 3\n{nri}  plugin_path = \"\"\n"),
                "/opt/nri/plugins",
            ),
            ("{".to_owned(), "/opt/nri/plugins"),
        ] {
            assert_eq!(nri_plugin_dir(&text), Path::new(dir), "{text}");
        }
        assert_eq!(launched_plugin_name(), "10-gpushare");
        let check = |text: &str, v: i64| check_nri_launch(Path::new("config.toml"), text, v);
        assert!(check("version = 3\n", 2).is_ok());
        assert!(check("", 3).is_ok(), "a new file of containerd 2.x");
        for (text, default) in [("version = 2\n", 3), ("", 2)] {
            let err = check(text, default).unwrap_err().to_string();
            assert!(
                err.contains("--nri-launch needs containerd 2.x")
                    && err.contains("containerd 1.7 stops its CRI plugin")
                    && !err.contains('\n'),
                "{err}"
            );
        }
        assert!(check("version = 1\n", 3).is_err());
    }

    #[test]
    fn the_launch_wrapper_execs_gpushare_nri_with_its_env_quoted_and_is_known_again() {
        let env = vec![
            "PATH=/usr/sbin:/usr/bin".to_owned(),
            "GPUSHARE_CONFIG=/etc/gs/it's.toml".to_owned(),
        ];
        let sock = Path::new("/run/nri/it's.sock");
        let script = launch_wrapper(Path::new("/opt/g s/gpushare"), &env, sock);
        let lines: Vec<&str> = script.lines().collect();
        assert_eq!(lines[0], "#!/bin/sh");
        assert_eq!(
            &lines[2..],
            [
                "PATH='/usr/sbin:/usr/bin'; export PATH",
                "GPUSHARE_CONFIG='/etc/gs/it'\\''s.toml'; export GPUSHARE_CONFIG",
                "exec '/opt/g s/gpushare' nri --socket '/run/nri/it'\\''s.sock'",
            ]
        );
        assert!(is_launch_wrapper(&script));
        assert_eq!(
            launch_wrapper(Path::new("/opt/g s/gpushare"), &env, sock),
            script
        );
        for theirs in [
            "",
            "#!/bin/sh\nexec /usr/bin/other\n",
            "#!/bin/bash\n# gpushare's NRI plugin, launched by containerd\n",
        ] {
            assert!(!is_launch_wrapper(theirs), "{theirs}");
        }
        // What sh makes of it: the env as written, then gpushare with `nri --socket`.
        let dir = tempfile::tempdir().unwrap();
        let fake = dir.path().join("g s");
        std::fs::create_dir(&fake).unwrap();
        let bin = fake.join("gpushare");
        std::fs::write(&bin, "#!/bin/sh\necho \"$GPUSHARE_CONFIG|$PATH|$*\"\n").unwrap();
        std::fs::set_permissions(&bin, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        let script = launch_wrapper(&bin, &env, sock);
        let out = std::process::Command::new("/bin/sh")
            .arg("-c")
            .arg(&script)
            .env_clear()
            .output()
            .unwrap();
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "/etc/gs/it's.toml|/usr/sbin:/usr/bin|nri --socket /run/nri/it's.sock\n"
        );
    }

    #[test]
    fn nri_is_turned_on_where_it_is_off_and_left_alone_where_it_is_on() {
        let on = |text: &str, v: i64| enable_nri(Path::new("config.toml"), text, v).unwrap().text;
        // containerd 1.7 (version 2): off unless configured.
        let v2 = "version = 2\n# mine\n[plugins.\"io.containerd.grpc.v1.cri\"]\n  sandbox_image = \"p\"\n";
        let out = on(v2, 2).unwrap();
        assert!(out.starts_with(v2), "the rest kept byte for byte:\n{out}");
        let t: toml::Table = toml::from_str(&out).unwrap();
        assert_eq!(
            t["plugins"]["io.containerd.nri.v1.nri"]["disable"],
            toml::Value::Boolean(false)
        );
        assert_eq!(on(&out, 2), None, "idempotent");
        // An explicit disable = true is turned on.
        let off = format!("{v2}[plugins.\"io.containerd.nri.v1.nri\"]\n  disable = true\n");
        assert!(on(&off, 2).unwrap().contains("disable = false"));
        // containerd 2.x (version 3): on by default, nothing to write.
        assert_eq!(on("version = 3\n", 3), None);
        let off3 = "version = 3\n[plugins.\"io.containerd.nri.v1.nri\"]\n  disable = true\n";
        assert!(on(off3, 3).unwrap().contains("disable = false"));
        // A new file gets its version.
        assert!(on("", 2).unwrap().contains("version = 2"));
    }

    #[test]
    fn nri_required_sets_the_default_validator_for_either_posture_and_uninstall_takes_it_back() {
        let path = Path::new("config.toml");
        let require =
            |text: &str, r: NriRequired| require_nri(path, text, 3, r, "gpushare").unwrap().text;
        let parse = |text: &str| -> toml::Value {
            toml::from_str::<toml::Table>(text).unwrap()["plugins"]["io.containerd.nri.v1.nri"]
                ["default_validator"]
                .clone()
        };
        let mine = "version = 3\n# mine\n[plugins.\"io.containerd.nri.v1.nri\".default_validator]\n  reject_oci_hook_adjustment = true\n  required_plugins = [\"other\"]\n";
        // Node-wide: gpushare joins the list, the toleration is named, the rest is kept.
        let node = require(mine, NriRequired::Node).unwrap();
        assert!(node.starts_with("version = 3\n# mine\n"), "{node}");
        let v = parse(&node);
        assert_eq!(v["enable"], toml::Value::Boolean(true));
        assert_eq!(v["reject_oci_hook_adjustment"], toml::Value::Boolean(true));
        assert_eq!(
            v["required_plugins"],
            toml::Value::Array(vec!["other".into(), "gpushare".into()])
        );
        assert_eq!(
            v["tolerate_missing_plugins_annotation"].as_str(),
            Some(TOLERATE_ANNOTATION)
        );
        assert_eq!(require(&node, NriRequired::Node), None, "idempotent");
        assert_eq!(
            enable_nri(path, &node, 3).unwrap().text,
            None,
            "NRI stays as 2.x has it"
        );
        // An operator's own toleration key stays.
        let theirs = "version = 3\n[plugins.\"io.containerd.nri.v1.nri\".default_validator]\n  tolerate_missing_plugins_annotation = \"x.example.com\"\n";
        let v = parse(&require(theirs, NriRequired::Node).unwrap());
        assert_eq!(
            v["tolerate_missing_plugins_annotation"].as_str(),
            Some("x.example.com")
        );
        // Per pod: the validator on, gpushare off the node-wide list.
        let pods = require(&node, NriRequired::Pods).unwrap();
        let v = parse(&pods);
        assert_eq!(v["enable"], toml::Value::Boolean(true));
        assert_eq!(
            v["required_plugins"],
            toml::Value::Array(vec!["other".into()])
        );
        assert_eq!(require(&pods, NriRequired::Pods), None, "idempotent");
        let fresh = require("version = 3\n", NriRequired::Pods).unwrap();
        assert_eq!(
            parse(&fresh),
            toml::Value::Table(toml::toml! { enable = true })
        );
        // Uninstall: gpushare leaves the list, nothing else changes.
        let unrequire = |text: &str| unrequire_nri(path, text, "gpushare").unwrap().text;
        let back = unrequire(&node).unwrap();
        let fresh_node = require("version = 3\n", NriRequired::Node).unwrap();
        let emptied = unrequire(&fresh_node).unwrap();
        assert!(
            emptied.ends_with("required_plugins = []\n"),
            "edited in place, its line kept: {emptied:?}"
        );
        assert_eq!(
            parse(&back)["required_plugins"],
            toml::Value::Array(vec!["other".into()])
        );
        assert_eq!(unrequire(&back), None);
        assert_eq!(unrequire("version = 3\n"), None);
        // containerd 1.x has no validator; a list that is not one is refused.
        let err = require_nri(path, "version = 2\n", 2, NriRequired::Pods, "gpushare")
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("needs containerd 2.2 or later"), "{err}");
        let bad = "version = 3\n[plugins.\"io.containerd.nri.v1.nri\".default_validator]\n  required_plugins = \"gpushare\"\n";
        let err = require_nri(path, bad, 3, NriRequired::Node, "gpushare")
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("is not a list of plugin names"), "{err}");
    }

    fn hook_only(text: &str) -> String {
        edit(
            Path::new("config.toml"),
            text,
            "gpushare",
            &Registration::HookOnly(BASE.into()),
            2,
        )
        .unwrap()
        .text
        .unwrap()
    }

    #[test]
    fn remove_takes_out_the_runtime_s_tables_and_keeps_the_rest_byte_for_byte() {
        let remove = |text: &str| remove(Path::new("config.toml"), text, "gpushare").unwrap();
        let installed = run(V2, 2).unwrap().unwrap();
        let (edited, base) = remove(&installed);
        assert_eq!(
            edited.text.as_deref(),
            Some(V2),
            "back to the file as it was"
        );
        assert_eq!(base, None);
        assert_eq!(remove(V2).0.text, None, "nothing to remove");
        assert_eq!(remove("").0.text, None);
        // Version 3, from an empty file: only the runc table install spelt out is left.
        let v3 = run("", 3).unwrap().unwrap();
        let out = remove(&v3).0.text.unwrap();
        let v: toml::Table = toml::from_str(&out).unwrap();
        let runtimes = &v["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"];
        assert_eq!(
            runtimes.as_table().unwrap().keys().collect::<Vec<_>>(),
            ["runc"],
            "{out}"
        );
        // Hook-only: the base spec of ours is named for removal, an operator's is not.
        let (edited, base) = remove(&hook_only(V2));
        assert_eq!(edited.text.as_deref(), Some(V2));
        assert_eq!(base.as_deref(), Some(Path::new(BASE)));
        let theirs = "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.gpushare]\n  base_runtime_spec = \"/etc/containerd/mine.json\"\n";
        let (edited, base) = remove(theirs);
        assert_eq!(edited.text.as_deref(), Some("version = 2\n"));
        assert_eq!(base, None);
    }

    #[test]
    fn registration_reads_back_what_edit_writes_in_either_version() {
        let read = |text: &str| registration(text, "gpushare");
        for version in [2, 3] {
            let shim = run("", version).unwrap().unwrap();
            assert_eq!(read(&shim), Some(Registration::Shim(RT.into())), "{shim}");
            let hooks = edit(
                Path::new("config.toml"),
                &shim,
                "gpushare",
                &Registration::HookOnly(BASE.into()),
                version,
            )
            .unwrap()
            .text
            .unwrap();
            assert_eq!(
                read(&hooks),
                Some(Registration::HookOnly(BASE.into())),
                "{hooks}"
            );
            let removed = remove(Path::new("config.toml"), &hooks, "gpushare")
                .unwrap()
                .0;
            assert_eq!(read(&removed.text.unwrap()), None);
        }
        assert_eq!(registration(&run(V2, 2).unwrap().unwrap(), "runc"), None);
        for unregistered in [
            "",
            "[plugins\n",
            V2,
            "[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.gpushare.options]\nBinaryName = 5\nx = 1\n",
            "[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.gpushare]\nruntime_type = \"io.containerd.runc.v2\"\n",
        ] {
            assert_eq!(read(unregistered), None, "{unregistered}");
        }
    }

    #[test]
    fn cri_disabled_and_socket_read_what_decides_where_containerd_serves() {
        assert!(cri_disabled("disabled_plugins = [\"cri\"]\n"));
        assert!(cri_disabled(
            "disabled_plugins = [\"x\", \"io.containerd.grpc.v1.cri\"]\n"
        ));
        for enabled in [
            "",
            "version = 2\n",
            "disabled_plugins = [\"x\"]\n",
            "disabled_plugins = \"cri\"\n",
            "{",
        ] {
            assert!(!cri_disabled(enabled), "{enabled}");
        }
        let at = |address: &str| socket(&format!("version = 2\n[grpc]\n  address = {address:?}\n"));
        assert_eq!(at("/run/c.sock"), Some(PathBuf::from("/run/c.sock")));
        assert_eq!(at("unix:///run/c.sock"), Some(PathBuf::from("/run/c.sock")));
        assert_eq!(at(""), None);
        assert_eq!(at("unix://"), None);
        assert_eq!(socket("version = 2\n"), None);
        assert_eq!(socket("[grpc\n"), None);
    }

    #[test]
    fn hook_only_registers_plain_runc_with_the_base_spec_and_back() {
        let out = hook_only(V2);
        assert!(out.starts_with(V2.trim_end()), "{out}");
        let v: toml::Table = toml::from_str(&out).unwrap();
        let rt = &v["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["gpushare"];
        assert_eq!(rt["runtime_type"].as_str(), Some("io.containerd.runc.v2"));
        assert_eq!(
            rt["pod_annotations"],
            request_keys(),
            "exactly the request keys"
        );
        assert_eq!(rt["base_runtime_spec"].as_str(), Some(BASE));
        assert_eq!(rt["options"].get("BinaryName"), None, "no shim");
        assert_eq!(rt["options"]["SystemdCgroup"].as_bool(), Some(true));
        let again = edit(
            Path::new("config.toml"),
            &out,
            "gpushare",
            &Registration::HookOnly(BASE.into()),
            2,
        )
        .unwrap();
        assert_eq!(again.text, None, "second run changes nothing");
        // From the shim to hook-only and back: each drops the other's key.
        let shim = run(&out, 2).unwrap().unwrap();
        let v: toml::Table = toml::from_str(&shim).unwrap();
        let rt = &v["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["gpushare"];
        assert_eq!(rt.get("base_runtime_spec"), None, "{shim}");
        assert_eq!(rt["options"]["BinaryName"].as_str(), Some(RT));
        let v: toml::Table = toml::from_str(&hook_only(&shim)).unwrap();
        let rt = &v["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["gpushare"];
        assert_eq!(rt["options"].get("BinaryName"), None);
        // An operator's own base spec stays under the shim.
        let theirs = "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.gpushare]\n  base_runtime_spec = \"/etc/containerd/mine.json\"\n";
        assert!(run(theirs, 2).unwrap().unwrap().contains("mine.json"));
    }

    #[test]
    fn the_base_spec_is_containerds_default_with_our_hooks() {
        let default = br#"{"ociVersion":"1.0.2-dev","process":{"args":["sh"]},"hooks":{"prestart":[{"path":"/usr/bin/other"},{"path":"/usr/bin/gpushare","args":["old"]}]}}"#;
        let gs = Path::new("/usr/bin/gpushare");
        let env = vec!["PATH=/usr/bin:/bin".to_owned()];
        let text = base_spec(Path::new(BASE), default, gs, &env).unwrap();
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["process"]["args"][0], "sh", "the default spec is kept");
        let pre = v["hooks"]["prestart"].as_array().unwrap();
        assert_eq!(pre.len(), 2, "{text}");
        assert_eq!(pre[0]["path"], "/usr/bin/other", "other hooks kept, first");
        assert_eq!(
            pre[1],
            json!({"path": "/usr/bin/gpushare", "args": ["gpushare", "hook", "prestart"],
                   "env": ["PATH=/usr/bin:/bin"], "timeout": 20})
        );
        assert_eq!(v["hooks"]["poststop"][0]["args"][2], "poststop");
        // Applying it to its own output changes nothing.
        let again = base_spec(Path::new(BASE), text.as_bytes(), gs, &env).unwrap();
        assert_eq!(again, text);
        let err = base_spec(Path::new(BASE), b"[1]", gs, &env).unwrap_err();
        assert!(err.to_string().contains("is not a JSON object"), "{err}");
        let err = base_spec(Path::new(BASE), b"{", gs, &env).unwrap_err();
        assert!(err.to_string().contains("is not valid JSON"), "{err}");
    }

    const V2: &str = r#"# containerd 1.6 config, trimmed
version = 2
root = "/var/lib/containerd"

[plugins]
  [plugins."io.containerd.grpc.v1.cri"]
    sandbox_image = "registry.k8s.io/pause:3.6"   # keep this comment
    [plugins."io.containerd.grpc.v1.cri".containerd]
      default_runtime_name = "runc"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"
        [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
          SystemdCgroup = true
"#;

    #[test]
    fn version_2_keeps_the_file_and_adds_the_runtime() {
        let out = run(V2, 2).unwrap().unwrap();
        assert!(
            out.starts_with(V2.trim_end()),
            "the original text is kept:\n{out}"
        );
        assert!(out.contains("# keep this comment"));
        let v: toml::Table = toml::from_str(&out).unwrap();
        let rt = &v["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["gpushare"];
        assert_eq!(rt["runtime_type"].as_str(), Some("io.containerd.runc.v2"));
        assert_eq!(
            rt["pod_annotations"],
            request_keys(),
            "exactly the request keys"
        );
        assert_eq!(
            rt["container_annotations"][0].as_str(),
            Some("cdi.k8s.io/*")
        );
        assert_eq!(rt["options"]["BinaryName"].as_str(), Some(RT));
        assert_eq!(
            rt["options"]["SystemdCgroup"].as_bool(),
            Some(true),
            "cgroup driver copied from runc"
        );
        assert_eq!(run(&out, 2).unwrap(), None, "second run changes nothing");
    }

    #[test]
    fn containerds_default_runc_is_kept_where_the_file_named_no_runtime() {
        let runc = |out: &str, plugin: &str| {
            let v: toml::Table = toml::from_str(out).unwrap();
            v["plugins"][plugin]["containerd"]["runtimes"]
                .get("runc")
                .map(|r| r["runtime_type"].as_str().unwrap_or_default().to_owned())
        };
        // New file, and a file of non-CRI settings only: containerd was on its built-ins.
        for (text, plugin) in [
            ("", "io.containerd.grpc.v1.cri"),
            (
                "version = 2\nroot = \"/var/lib/containerd\"\n",
                "io.containerd.grpc.v1.cri",
            ),
            ("version = 3\n", "io.containerd.cri.v1.runtime"),
        ] {
            let out = run(text, 2).unwrap().unwrap();
            assert_eq!(
                runc(&out, plugin).as_deref(),
                Some("io.containerd.runc.v2"),
                "{out}"
            );
        }
        // A runc of the operator's stays as it is (V2 has SystemdCgroup on it).
        let out = run(V2, 2).unwrap().unwrap();
        assert!(out.starts_with(V2.trim_end()));
        // Another default runtime: runc is none of ours to add.
        let crun = "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\".containerd]\n  default_runtime_name = \"crun\"\n";
        let out = run(crun, 2).unwrap().unwrap();
        assert_eq!(runc(&out, "io.containerd.grpc.v1.cri"), None, "{out}");
    }

    #[test]
    fn version_3_and_new_files() {
        let v3 = "version = 3\n";
        let out = run(v3, 2).unwrap().unwrap();
        let v: toml::Table = toml::from_str(&out).unwrap();
        assert!(
            v["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]["gpushare"]
                ["options"]["BinaryName"]
                .is_str()
        );
        for (default, plugin) in [
            (2, "io.containerd.grpc.v1.cri"),
            (3, "io.containerd.cri.v1.runtime"),
        ] {
            let out = run("", default).unwrap().unwrap();
            let v: toml::Table = toml::from_str(&out).unwrap();
            assert_eq!(v["version"].as_integer(), Some(default));
            assert!(
                v["plugins"][plugin]["containerd"]["runtimes"]["gpushare"].is_table(),
                "{out}"
            );
        }
    }

    #[test]
    fn version_1_and_garbage_are_refused_with_a_reason() {
        let err = run("[plugins.cri]\nx = 1\n", 2).err().unwrap().to_string();
        assert!(
            err.contains("config version 1 is not supported")
                && err.contains("containerd config migrate"),
            "{err}"
        );
        let err = run("version = 2\n[plugins\n", 2).err().unwrap().to_string();
        assert!(err.contains("config.toml is not valid TOML"), "{err}");
    }

    #[test]
    fn enable_cdi_in_either_version_keeps_the_file_and_adds_the_directory_once() {
        let enable = |text: &str, dir: &str| {
            enable_cdi(Path::new("config.toml"), text, Path::new(dir), 3)
                .unwrap()
                .text
        };
        let v2 = "version = 2\n# mine\n[plugins.\"io.containerd.grpc.v1.cri\"]\n  sandbox_image = \"p\"\n";
        let out = enable(v2, "/etc/cdi").unwrap();
        assert!(out.starts_with("version = 2\n# mine\n"), "{out}");
        let t: toml::Table = out.parse().unwrap();
        let cri = &t["plugins"]["io.containerd.grpc.v1.cri"];
        assert_eq!(cri["enable_cdi"].as_bool(), Some(true));
        assert_eq!(cri["sandbox_image"].as_str(), Some("p"));
        assert!(cri.get("cdi_spec_dirs").is_none());
        assert_eq!(enable(&out, "/etc/cdi"), None, "twice changes nothing");
        let out = enable("", "/opt/cdi").unwrap();
        let t: toml::Table = out.parse().unwrap();
        let cri = &t["plugins"]["io.containerd.cri.v1.runtime"];
        assert_eq!(
            cri["cdi_spec_dirs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_str().unwrap())
                .collect::<Vec<_>>(),
            ["/etc/cdi", "/var/run/cdi", "/opt/cdi"]
        );
        assert_eq!(enable(&out, "/opt/cdi"), None);
        for bad in [
            "version = 1\n",
            "version = 3\n[plugins]\n\"io.containerd.cri.v1.runtime\" = 1\n",
            "version = 3\n[plugins.\"io.containerd.cri.v1.runtime\"]\ncdi_spec_dirs = 1\n",
        ] {
            assert!(
                enable_cdi(Path::new("c"), bad, Path::new("/etc/cdi"), 3).is_err(),
                "{bad}"
            );
        }
    }
}
