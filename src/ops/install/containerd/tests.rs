//! The containerd engine's unit tests: its edits, read-backs and NRI settings on real
//! config files.

use std::path::PathBuf;

use serde_json::{json, Value};

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
    let doc =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/kubernetes.md"))
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
    std::fs::set_permissions(&bin, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
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
    let v2 =
        "version = 2\n# mine\n[plugins.\"io.containerd.grpc.v1.cri\"]\n  sandbox_image = \"p\"\n";
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

/// The runtime `gpushare` of a version 2 config: a runc v2 runtime whose pod
/// annotations are exactly the request keys, whichever way it runs gpushare.
fn v2_runtime(text: &str) -> toml::Value {
    let v: toml::Table = toml::from_str(text).unwrap();
    let rt = &v["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["gpushare"];
    assert_eq!(rt["runtime_type"].as_str(), Some("io.containerd.runc.v2"));
    assert_eq!(
        rt["pod_annotations"],
        request_keys(),
        "exactly the request keys"
    );
    rt.clone()
}

#[test]
fn hook_only_registers_plain_runc_with_the_base_spec_and_back() {
    let out = hook_only(V2);
    assert!(out.starts_with(V2.trim_end()), "{out}");
    let rt = &v2_runtime(&out);
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
    let rt = &v2_runtime(&out);
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
    let v2 =
        "version = 2\n# mine\n[plugins.\"io.containerd.grpc.v1.cri\"]\n  sandbox_image = \"p\"\n";
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
