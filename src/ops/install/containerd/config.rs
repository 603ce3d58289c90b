//! containerd's config.toml and the runtime gpushare registers in it: the CRI plugin's
//! tables by config version, the runtime's edit, its removal and what reading it back
//! says, CDI, and the hook-only base spec. Pure functions on the file's text.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use toml_edit::{value, Array, DocumentMut, Item, Table};

use super::super::engine::Registration;
use super::super::file::{Edited, InstallError};

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
pub(super) fn cri_plugin(version: i64) -> Option<&'static str> {
    match version {
        2 => Some("io.containerd.grpc.v1.cri"),
        3 => Some("io.containerd.cri.v1.runtime"),
        _ => None,
    }
}

/// `version` of a config: its `version` key; for a new (empty) file, `default_version`.
pub(super) fn version_of(doc: &DocumentMut, empty: bool, default_version: i64) -> Option<i64> {
    match doc.get("version").and_then(Item::as_integer) {
        Some(v) => Some(v),
        None if empty => Some(default_version),
        None => Some(1),
    }
}

pub(super) fn table<'a>(parent: &'a mut Table, key: &str) -> Option<&'a mut Table> {
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
pub(super) fn parse_versioned(
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
pub(super) fn cri_table<'d>(
    path: &Path,
    doc: &'d mut DocumentMut,
    plugin: &str,
) -> Result<&'d mut Table, InstallError> {
    let plugins =
        table(doc.as_table_mut(), "plugins").ok_or_else(|| not_a_table(path, "plugins"))?;
    table(plugins, plugin).ok_or_else(|| not_a_table(path, plugin))
}

/// The refusal of a config whose `what` is there but not a table.
pub(super) fn not_a_table(path: &Path, what: &str) -> InstallError {
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
