//! CDI (Container Device Interface) as a way to ask for a share: the spec `gpushare cdi
//! generate` writes from the node's inventory (the request each device's hook carries is
//! `request::CdiAsk`, read back from a container's spec by `SpecFile::cdi_ask`).
//!
//! The spec has kind `gpushare.io/gpu` and `cdiVersion` 0.5.0, the newest that Podman 4.3
//! reads and the first that allows device names starting with a digit; Docker 25+,
//! containerd 1.7+ and Podman 5 read it too. Its devices, per GPU: the index (`0`) and
//! the UUID (`GPU-<uuid>`); per MIG device: `<gpu>-mig-<mig>` (`1-mig-0`, since CDI names
//! cannot hold `:`) and the UUID (`MIG-<uuid>`); and each of them once more per profile of
//! `[cdi.profiles.<name>]`, as `<device>-<name>`. Each device's only edits are two hooks:
//! `prestart`, `gpushare hook prestart --cdi-device <device> [--profile <name>]`, and
//! `poststop`, `gpushare hook poststop`, with the absolute path of this binary and an
//! explicit environment (`served::hook_env`).
//!
//! Invariants: the request is the hook's arguments, never env or annotations, so that the
//! container's own annotations and env, which its author writes, can neither redirect the
//! device nor raise the profile's limits (`request::from_cdi` holds them to repeating
//! it); a container's author cannot write a hook (Docker, Podman, containerd's CRI and
//! CRI-O give it no way to), so a spec carrying the `--cdi-device` hook was given it by the
//! node (`SpecFile::cdi_ask`). The spec is a pure function of the inventory, the
//! profiles, the binary, the hooks' environment and the start timeout, so `doctor` can
//! regenerate it and compare.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{json, Value};

use crate::config::CdiProfile;
use crate::device::Inventory;
use crate::request::CdiAsk;

/// The CDI version written: every engine gpushare supports reads it (see the module doc).
pub(crate) const CDI_VERSION: &str = "0.5.0";
/// Where `gpushare cdi generate` writes by default: the directory for generated specs
/// that every CDI engine reads, Podman 4.3 included (it reads only `/etc/cdi` and
/// `/var/run/cdi`).
pub(crate) const DEFAULT_OUTPUT: &str = "/var/run/cdi/gpushare.json";
/// Seconds the engine gives the poststop hook.
const POSTSTOP_TIMEOUT: u64 = 10;

/// The base device names of an inventory, in a fixed order: per GPU its index and UUID,
/// then per MIG device of it `<gpu>-mig-<mig>` and its UUID. A GPU in MIG mode (one with
/// MIG devices) gets no name of its own: CUDA runs only on its MIG devices, and a request
/// for the whole GPU is refused.
pub(crate) fn device_names(inv: &Inventory) -> Vec<String> {
    let mut names = Vec::new();
    for gpu in &inv.gpus {
        if gpu.mig_devices.is_empty() {
            names.push(gpu.index.to_string());
            names.push(gpu.uuid.clone());
        }
        for mig in &gpu.mig_devices {
            names.push(format!("{}-mig-{}", gpu.index, mig.index));
            names.push(mig.uuid.clone());
        }
    }
    names
}

/// What the spec's hooks run and with what.
pub(crate) struct HookProgram<'a> {
    /// The absolute path of `gpushare`.
    pub binary: &'a Path,
    /// The hooks' environment (`served::hook_env`).
    pub env: &'a [String],
    /// Seconds the engine gives the prestart hook (it may start a daemon).
    pub prestart_timeout: u64,
}

/// The CDI spec for an inventory and the configured profiles (see the module doc).
pub(crate) fn spec(
    inv: &Inventory,
    profiles: &BTreeMap<String, CdiProfile>,
    hooks: &HookProgram<'_>,
) -> Value {
    let mut asks = Vec::new();
    for device in device_names(inv) {
        asks.push(CdiAsk {
            device: device.clone(),
            profile: None,
        });
        for name in profiles.keys() {
            asks.push(CdiAsk {
                device: device.clone(),
                profile: Some(name.clone()),
            });
        }
    }
    let devices: Vec<Value> = asks
        .iter()
        .map(|ask| {
            let mut prestart = vec!["gpushare".to_owned(), "hook".into(), "prestart".into()];
            prestart.extend(ask.flags());
            json!({
                "name": ask.name(),
                "containerEdits": {
                    "hooks": [
                        {
                            "hookName": "prestart",
                            "path": hooks.binary,
                            "args": prestart,
                            "env": hooks.env,
                            "timeout": hooks.prestart_timeout,
                        },
                        {
                            "hookName": "poststop",
                            "path": hooks.binary,
                            "args": ["gpushare", "hook", "poststop"],
                            "env": hooks.env,
                            "timeout": POSTSTOP_TIMEOUT,
                        },
                    ],
                },
            })
        })
        .collect();
    json!({
        "cdiVersion": CDI_VERSION,
        "kind": crate::request::CDI_KIND,
        "devices": devices,
    })
}

/// The spec's bytes as written: pretty JSON and a final newline.
pub(crate) fn to_bytes(spec: &Value) -> Vec<u8> {
    let mut bytes = serde_json::to_vec_pretty(spec).unwrap_or_default();
    bytes.push(b'\n');
    bytes
}

/// The spec this node would generate now: the inventory, the configured profiles, this
/// binary and the hook environment of the config this process read.
pub(crate) fn current(cfg: &crate::config::Config) -> anyhow::Result<Value> {
    for_node(
        cfg,
        &crate::device::load(&cfg.inventory, cfg.driver_root.as_deref())?,
    )
}

/// [`current`] for an inventory already loaded.
pub(crate) fn for_node(cfg: &crate::config::Config, inv: &Inventory) -> anyhow::Result<Value> {
    use anyhow::Context;
    let binary = std::env::current_exe().context("find gpushare's own path")?;
    let (config, named) = crate::config::location();
    let env = crate::served::hook_env(named.then_some(config.as_path()));
    Ok(spec(
        inv,
        &cfg.cdi_profiles,
        &HookProgram {
            binary: &binary,
            env: &env,
            prestart_timeout: cfg.mps.start_timeout.as_secs() + 5,
        },
    ))
}

/// The device names of a spec, in its order (what `doctor` compares first).
pub(crate) fn names(spec: &Value) -> Vec<&str> {
    spec["devices"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or(&[])
        .iter()
        .filter_map(|d| d["name"].as_str())
        .collect()
}

/// `gpushare cdi generate`: writes [`current`] to `output` atomically (mode 0644, its
/// directory created), or prints it for `-`.
pub(crate) fn generate(cfg: &crate::config::Config, output: &Path) -> anyhow::Result<()> {
    use anyhow::Context;
    let spec = current(cfg)?;
    let bytes = to_bytes(&spec);
    if output == Path::new("-") {
        use std::io::Write;
        std::io::stdout()
            .write_all(&bytes)
            .context("write the spec to stdout")?;
        return Ok(());
    }
    if let Some(dir) = output.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    }
    crate::fsops::write_atomic(output, &bytes, 0o644)
        .with_context(|| format!("write {}", output.display()))?;
    let count = spec["devices"].as_array().map_or(0, Vec::len);
    println!(
        "wrote {count} CDI devices of {} to {}",
        crate::request::CDI_KIND,
        output.display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::testing::{GPU0, GPU2, MIG0, MIG1, MIG2};

    fn profiles() -> BTreeMap<String, CdiProfile> {
        let cfg = crate::config::parse(
            "[cdi.profiles.small]\nactive-thread-percentage = 25\npinned-memory-limit = \"4G\"\n",
            None,
        )
        .expect("config");
        cfg.cdi_profiles
    }

    fn sample_spec(profiles: &BTreeMap<String, CdiProfile>) -> Value {
        let env = vec![
            "PATH=/usr/bin".to_owned(),
            "GPUSHARE_CONFIG=/etc/g.toml".into(),
        ];
        spec(
            &crate::device::sample(),
            profiles,
            &HookProgram {
                binary: Path::new("/usr/local/bin/gpushare"),
                env: &env,
                prestart_timeout: 15,
            },
        )
    }

    fn names(spec: &Value) -> Vec<String> {
        super::names(spec).into_iter().map(str::to_owned).collect()
    }

    #[test]
    fn one_device_per_index_uuid_and_mig_device_and_per_profile() {
        let plain = sample_spec(&BTreeMap::new());
        assert_eq!(plain["cdiVersion"], "0.5.0");
        assert_eq!(plain["kind"], "gpushare.io/gpu");
        let expected = [
            "0".to_owned(),
            GPU0.into(),
            "1-mig-0".into(),
            MIG0.into(),
            "1-mig-1".into(),
            MIG1.into(),
            "1-mig-2".into(),
            MIG2.into(),
            "2".into(),
            GPU2.into(),
        ];
        assert_eq!(names(&plain), expected);
        let with = sample_spec(&profiles());
        let mut both = Vec::new();
        for n in &expected {
            both.push(n.clone());
            both.push(format!("{n}-small"));
        }
        assert_eq!(names(&with), both);
        // Every name is one CDI 0.5.0 allows: letters, digits, `-`, `_`, `.`, first a
        // letter or digit; never the request syntax's `0:1`.
        for n in names(&with) {
            assert!(
                n.starts_with(|c: char| c.is_ascii_alphanumeric())
                    && n.chars()
                        .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)),
                "{n}"
            );
        }
    }

    #[test]
    fn each_device_carries_its_request_as_hook_arguments_only() {
        let spec = sample_spec(&profiles());
        let dev = |name: &str| {
            spec["devices"]
                .as_array()
                .expect("devices")
                .iter()
                .find(|d| d["name"] == name)
                .expect("device")
                .clone()
        };
        let d = dev("1-mig-2-small");
        let edits = d["containerEdits"].as_object().expect("edits");
        // No env, no mounts, no device nodes: only the hooks.
        assert_eq!(edits.keys().collect::<Vec<_>>(), ["hooks"]);
        assert_eq!(
            d["containerEdits"]["hooks"],
            json!([
                {"hookName": "prestart", "path": "/usr/local/bin/gpushare",
                 "args": ["gpushare", "hook", "prestart", "--cdi-device", "1-mig-2", "--profile", "small"],
                 "env": ["PATH=/usr/bin", "GPUSHARE_CONFIG=/etc/g.toml"], "timeout": 15},
                {"hookName": "poststop", "path": "/usr/local/bin/gpushare",
                 "args": ["gpushare", "hook", "poststop"],
                 "env": ["PATH=/usr/bin", "GPUSHARE_CONFIG=/etc/g.toml"], "timeout": 10},
            ])
        );
        // The hooks read back as the request they carry, and every device's base name
        // parses as one device.
        let hooks = d["containerEdits"]["hooks"].as_array().expect("hooks");
        assert_eq!(
            crate::bundle::SpecFile::cdi_asks_in(hooks).expect("asks"),
            [CdiAsk {
                device: "1-mig-2".into(),
                profile: Some("small".into())
            }]
        );
        for name in device_names(&crate::device::sample()) {
            crate::request::parse_cdi_device(&name).expect(&name);
        }
        // Generating twice gives the same bytes (doctor compares them).
        assert_eq!(to_bytes(&spec), to_bytes(&sample_spec(&profiles())));
    }

    #[test]
    fn hook_flags_parse_exactly() {
        let ok = |f: &[&str]| CdiAsk::from_flags(f).expect("ok");
        assert_eq!(ok(&[]), None);
        assert_eq!(
            ok(&["--cdi-device", "0"]),
            Some(CdiAsk {
                device: "0".into(),
                profile: None
            })
        );
        for bad in [
            &["--cdi-device"][..],
            &["--profile", "p", "--cdi-device", "0"],
            &["--cdi-device", "0", "--profile"],
            &["--cdi-device", "0", "extra"],
            &["--device", "0"],
        ] {
            let err = CdiAsk::from_flags(bad).expect_err("bad").to_string();
            assert!(
                err.contains("allowed is gpushare hook prestart --cdi-device"),
                "{err}"
            );
        }
    }
}
