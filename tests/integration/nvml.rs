//! `inventory = "nvml"` end to end on a machine without a GPU: the binaries load a fake
//! NVML (fake_nvml.c beside this file, compiled per test with `cc`) through
//! LD_LIBRARY_PATH. The tests assert only what a user sees — doctor's lines, status, the
//! create's result, the edited spec, the inventory cache, the error line — never which
//! process loads NVML.

use std::path::PathBuf;

use serde_json::Value;

use testkit::*;

/// The UUIDs fake_nvml.c reports for its GPUs 0 and 1.
const FAKE_GPU0: &str = "GPU-0fa4e000-0000-4000-8000-00000000a300";
const FAKE_GPU1: &str = "GPU-0fa4e000-0000-4000-8000-00000000a301";

pub(crate) use testkit::fake_nvml;

/// An env whose config says `inventory = "nvml"` and whose commands find the fake NVML;
/// with the fake library's directory.
fn nvml_env() -> (Env, PathBuf) {
    let mut env = Env::new();
    env.set_inventory("nvml");
    let lib = fake_nvml(env.path());
    env.set_var("LD_LIBRARY_PATH", &lib);
    (env, lib)
}

/// What the inventory cache needs to be used at all: a driver in procfs (it fingerprints
/// `/proc/driver/nvidia`; without a version file there is no cache). A tmpfs over
/// `/proc/driver` in a mount namespace of the test's own, never on the host.
const FAKE_DRIVER_PROC: &str = "mount -t tmpfs -o mode=0755 gs-nvml /proc/driver
mkdir -p /proc/driver/nvidia/gpus/0000:00:06.0 /proc/driver/nvidia/gpus/0000:00:07.0
echo 'NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  (fake, for gpushare tests)' > /proc/driver/nvidia/version";

#[test]
fn doctor_and_status_see_the_fake_gpus() {
    let (mut env, _lib) = nvml_env();
    env.start_agent();
    let out = env.gpushare(&["doctor"]);
    let report = String::from_utf8_lossy(&out.stdout);
    for line in [
        "ok    driver             NVML answers: driver 550.54.15, 2 GPU(s)",
        "ok    inventory          2 GPU(s), 0 MIG device(s) from nvml",
        "ok    gpu-generation     GPU 1 (NVIDIA A30): compute capability 8.0 (Volta or newer: limits and multi-user MPS)",
        "ok    compute-mode       GPU 1 (NVIDIA A30): DEFAULT",
    ] {
        assert!(report.lines().any(|l| l == line), "{line:?} in:\n{report}");
    }
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));

    // A daemon on GPU index 1: the CLI resolves the index through NVML, and status
    // describes the device from it.
    let out = env.gpushare(&["daemon", "start", "--device", "1", "--uid", "1000"]);
    assert!(out.status.success(), "daemon start: {}", text(&out));
    let daemons = env.status();
    assert_eq!(daemons.as_array().map(Vec::len), Some(1), "{daemons}");
    assert_eq!(
        daemons[0]["devices"],
        serde_json::json!([{"uuid": FAKE_GPU1, "name": "GPU 1", "model": "NVIDIA A30", "mig_profile": null}]),
    );
    let id = daemons[0]["id"].as_str().unwrap();
    assert!(
        environ(env.daemon_pid(id)).contains(&format!("CUDA_VISIBLE_DEVICES={FAKE_GPU1}")),
        "{:?}",
        environ(env.daemon_pid(id))
    );
}

#[test]
fn a_create_takes_its_gpu_from_nvml_and_the_next_one_from_the_cache() {
    let (mut env, lib) = nvml_env();
    // Made after the env, so that its rootfs bind is in the namespace too; dropped
    // before it.
    let mounts = PrivateMounts::with(FAKE_DRIVER_PROC);
    env.enter(&mounts);

    let first = env.request("n1", 1000, "1").create();
    let cfg = first.config();
    let identity = cfg["annotations"]["gpushare.io/identity"]
        .as_str()
        .expect("identity annotation");
    assert!(
        identity.contains(FAKE_GPU1) && !identity.contains(FAKE_GPU0),
        "{identity}"
    );
    let id = env.daemon_of(&first);
    assert!(
        environ(env.daemon_pid(&id)).contains(&format!("CUDA_VISIBLE_DEVICES={FAKE_GPU1}")),
        "{:?}",
        environ(env.daemon_pid(&id))
    );

    // The first create on a node loads the inventory before it makes the state
    // directory, and the cache is only written into one that exists: the second writes it.
    let cache_file = env.state.join("inventory.json");
    assert!(!cache_file.exists(), "no state dir, no cache");
    let second = env.request("n2", 1000, "1").create();
    assert_eq!(env.daemon_of(&second), id);
    let cache: Value = serde_json::from_slice(&std::fs::read(&cache_file).unwrap()).unwrap();
    let inventory = &cache["inventory"];
    assert_eq!(inventory["driver_version"], "550.54.15", "{cache}");
    let uuids: Vec<&str> = inventory["gpus"]
        .as_array()
        .expect("gpus in the cache")
        .iter()
        .filter_map(|g| g["uuid"].as_str())
        .collect();
    assert_eq!(uuids, [FAKE_GPU0, FAKE_GPU1], "{cache}");

    // With the library gone only the cache can name GPU 1: the third create (well
    // within the default inventory-cache-ttl of 30 s) must not need NVML.
    std::fs::rename(lib.join("libnvidia-ml.so.1"), lib.join("hidden.so")).unwrap();
    let third = env.request("n3", 1000, "1").create();
    assert_eq!(
        third.config()["annotations"]["gpushare.io/identity"],
        identity,
        "the same request from the cache: the same daemon"
    );
}

#[test]
fn a_create_fails_with_one_line_when_nvml_does_not_initialise() {
    let (mut env, _lib) = nvml_env();
    env.set_var("FAKE_NVML_FAIL_INIT", "1");
    let c = env.request("n1", 1000, "1").bundle();
    let before = c.config_bytes();
    let out = c.try_create();
    assert_eq!(out.status.code(), Some(1), "{}", c.last_error());
    // During create the shim's channel is runc's --log (runtime/runclog.rs): its stdout
    // and stderr are the container's.
    assert!(
        out.stdout.is_empty() && out.stderr.is_empty(),
        "the shim printed nothing: {out:?}"
    );
    let log = std::fs::read_to_string(c.log()).unwrap_or_default();
    let errors: Vec<String> = log
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["level"] == "error")
        .map(|v| v["msg"].as_str().unwrap_or_default().to_owned())
        .collect();
    assert_eq!(
        errors.len(),
        1,
        "one error line in {}:\n{log}",
        c.log().display()
    );
    let msg = &errors[0];
    assert!(
        msg.starts_with("gpushare: ")
            && msg.contains("cannot initialise NVML")
            && !msg.contains('\n'),
        "{msg}"
    );
    assert_eq!(c.config_bytes(), before, "config.json byte-identical");
    assert!(c.state().is_none(), "no container was created");
    assert!(env.daemon_ids().is_empty(), "{:?}", env.daemon_ids());
    assert!(!env.state.join("inventory.json").exists(), "nothing cached");

    // doctor says the same, as its driver check.
    let out = env.gpushare(&["doctor"]);
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(
        report
            .lines()
            .any(|l| l.starts_with("FAIL  driver ") && l.contains("cannot initialise NVML")),
        "{report}"
    );
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
}

/// The shim never loads NVML itself (it is static: src/device/reader.rs): it runs the
/// `gpushare` beside it. A shim alone in a directory says which binary it could not run,
/// on the create's one line, and leaves config.json untouched.
#[test]
fn the_shim_reads_nvml_through_the_gpushare_beside_it() {
    let (env, _lib) = nvml_env();
    let alone = env.path().join("alone");
    std::fs::create_dir(&alone).unwrap();
    let shim = alone.join("gpushare-runtime");
    std::fs::copy(runtime(), &shim).unwrap();
    let c = env.request("n2", 1000, "1").bundle();
    let before = c.config_bytes();
    let status = c.try_create_with(shim.to_str().unwrap());
    assert_eq!(status.status.code(), Some(1), "{}", text(&status));
    let log = std::fs::read_to_string(c.log()).unwrap();
    let want = format!(
        "gpushare: cannot run {} to read the NVML inventory (it must be beside gpushare-runtime)",
        alone.join("gpushare").display()
    );
    assert!(
        log.lines().filter(|l| l.contains("\"error\"")).count() == 1 && log.contains(&want),
        "want {want:?} in:\n{log}"
    );
    assert_eq!(c.config_bytes(), before, "config.json byte-identical");
    assert!(env.daemon_ids().is_empty(), "{:?}", env.daemon_ids());
}

/// `mps.protocol = "auto"` reads the driver version NVML reports: 550 keeps the legacy
/// daemons; 615 (whose control binary, the simulator here, speaks protocol 3) is v3.
#[test]
fn auto_takes_the_backend_from_the_driver_version_nvml_reports() {
    for (driver, v3) in [(None, false), (Some("615.71.09"), true)] {
        let (mut env, _lib) = nvml_env();
        let cfg = std::fs::read_to_string(&env.config).unwrap();
        std::fs::write(
            &env.config,
            cfg.replace("[mps]\n", "[mps]\nprotocol = \"auto\"\n"),
        )
        .unwrap();
        if let Some(d) = driver {
            env.set_var("FAKE_NVML_DRIVER_VERSION", d);
        }
        let c = env
            .request("auto", 1000, "0")
            .sh("gpushare-mps-sim client")
            .create();
        let line = client_line(&c.run());
        assert_eq!(line.contains_key("namespace"), v3, "{driver:?}: {line:?}");
        assert_eq!(
            env.record(&env.daemon_of(&c))["identity"]["v3"]
                .as_bool()
                .unwrap_or(false),
            v3,
            "{driver:?}"
        );
        c.delete();
    }
}
