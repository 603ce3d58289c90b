//! CDI devices of gpushare's (`gpushare cdi generate`) through Podman: the spec is written
//! by the binary under test into `/var/run/cdi` of a private mount namespace (Podman 4.3
//! reads only `/etc/cdi` and `/var/run/cdi`; `PrivateMounts` covers `/run` with an empty
//! tmpfs, so the machine's own directories are never touched), and Podman runs with
//! gpushare's hooks.d files too, so that a container given both is served once. The node
//! refuses env requests (`accept-env-requests = false`): a CDI request is not one.

use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::Duration;

use crate::harness::*;

const CLIENT: &str = "gpushare-mps-sim client";

/// The `/tmp/nvidia-mps` mounts in a container's mountinfo: one per hook that served it.
fn pipe_mounts(mountinfo: &str) -> usize {
    mountinfo
        .lines()
        .filter(|l| l.split(' ').nth(4) == Some("/tmp/nvidia-mps"))
        .count()
}

#[test]
fn podman_serves_a_cdi_device_once_and_the_container_cannot_change_its_request() {
    let env = Env::with_configs(
        "accept-env-requests = false\n[cdi.profiles.small]\nactive-thread-percentage = 25\n",
        "",
    );
    let podman = need("podman", "podman");
    let ns = PrivateMounts::new();
    let dir = env.path().join("p");
    let hooks = dir.join("hooks.d");
    std::fs::create_dir_all(&hooks).unwrap();
    for name in ["gpushare.json", "gpushare-poststop.json"] {
        let shipped = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("hooks/oci-hooks.d")
            .join(name);
        let mut v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(shipped).unwrap()).unwrap();
        v["hook"]["path"] = GPUSHARE.into();
        v["hook"]["env"]
            .as_array_mut()
            .unwrap()
            .push(format!("GPUSHARE_CONFIG={}", env.config.display()).into());
        std::fs::write(hooks.join(name), v.to_string()).unwrap();
    }
    // The spec, by the binary under test, where Podman reads it (in the namespace only).
    let out = ns
        .cmd(GPUSHARE)
        .args(["cdi", "generate"])
        .env("GPUSHARE_CONFIG", &env.config)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("to /var/run/cdi/gpushare.json"),
        "{}",
        text(&out)
    );
    let out = ns
        .cmd(GPUSHARE)
        .args(["doctor", "--cdi-spec", "/var/run/cdi/gpushare.json"])
        .env("GPUSHARE_CONFIG", &env.config)
        .output()
        .unwrap();
    assert!(
        text(&out).contains("/var/run/cdi/gpushare.json is current: 24 devices of gpushare.io/gpu"),
        "{}",
        text(&out)
    );
    let pm = |args: &[&str]| {
        ns.cmd(&podman)
            .arg("--root")
            .arg(dir.join("storage"))
            .arg("--runroot")
            .arg(dir.join("run"))
            .arg("--tmpdir")
            .arg(dir.join("tmp"))
            .arg("--hooks-dir")
            .arg(&hooks)
            .args([
                "--storage-driver",
                "vfs",
                "--runtime",
                "runc",
                "--cgroup-manager",
                "cgroupfs",
                "--events-backend",
                "file",
            ])
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    };
    struct Cleanup<'a>(&'a dyn Fn(&[&str]) -> Output, PathBuf);
    impl Drop for Cleanup<'_> {
        fn drop(&mut self) {
            let _ = (self.0)(&["rm", "-af"]);
            umount_below(&self.1);
        }
    }
    let _cleanup = Cleanup(&pm, dir.clone());
    let tar = rootfs_tar(&dir);
    let out = pm(&["import", tar.to_str().unwrap(), "gpushare-test"]);
    assert!(out.status.success(), "{}", text(&out));
    let run = |extra: &[&str]| {
        let mut args = vec![
            "run",
            "--rm",
            "--network",
            "none",
            "--user",
            "1000",
            "--ulimit",
            "nofile=1024:1024",
            "--ulimit",
            "nproc=1024:1024",
        ];
        let script = format!("{CLIENT}; cat /proc/self/mountinfo");
        args.extend_from_slice(extra);
        args.extend_from_slice(&["gpushare-test", "sh", "-c", &script]);
        pm(&args)
    };
    // Every daemon ever started here, with the devices it serves.
    let devices_served = || -> Vec<serde_json::Value> {
        env.daemon_ids()
            .iter()
            .map(|id| env.record(id)["identity"]["devices"].clone())
            .collect()
    };
    let served = |extra: &[&str]| {
        let out = run(extra);
        let s = text(&out);
        assert!(
            out.status.success(),
            "{extra:?}: {s}\n{}",
            env.gpushare_log()
        );
        assert_eq!(
            pipe_mounts(&s),
            1,
            "{extra:?}: served once, one pipe mount:\n{s}"
        );
        let line = client_line(&s);
        assert_eq!(line["server_uid"], "1000", "{s}");
        line
    };
    let refused = |extra: &[&str], want: &str| {
        let out = run(extra);
        assert!(!out.status.success(), "{extra:?} must be refused");
        assert!(
            text(&out).contains(want),
            "want {want:?} in: {}",
            text(&out)
        );
    };

    // The CDI device alone: the hooks.d hook does not run (no annotation), the CDI hook
    // serves GPU 0 on a node that takes no env requests.
    let line = served(&["--device", "gpushare.io/gpu=0"]);
    assert_eq!(line["shm"], "ok");
    assert_eq!(devices_served(), [serde_json::json!([GPU0])]);
    // By UUID: the same daemon.
    served(&["--device", &format!("gpushare.io/gpu={GPU0}")]);
    assert_eq!(env.daemon_ids().len(), 1);

    // The hooks.d hook runs too (the annotation asks for it) and stands down: one mount,
    // one daemon.
    served(&[
        "--device",
        "gpushare.io/gpu=0",
        "--annotation",
        "gpushare.io/device=0",
    ]);
    assert_eq!(env.daemon_ids().len(), 1);

    // An annotation asking for GPU 2 beside the CDI device is refused: never GPU 2.
    refused(
        &[
            "--device",
            "gpushare.io/gpu=0",
            "--annotation",
            "gpushare.io/device=2",
        ],
        "gpushare.io/device=\"2\" is refused: it asks for something other than the container's CDI device gpushare.io/gpu=0",
    );
    // The env cannot either: this node refuses env requests outright.
    refused(
        &[
            "--device",
            "gpushare.io/gpu=0",
            "--env",
            "GPUSHARE_DEVICE=2",
        ],
        "GPUSHARE_DEVICE=\"2\" is refused: env requests are disabled",
    );
    assert!(
        !devices_served().contains(&serde_json::json!([GPU2])),
        "{:?}",
        devices_served()
    );

    // A profile's device: its limit, which an annotation cannot raise.
    let line = served(&["--device", "gpushare.io/gpu=0-small"]);
    assert_eq!(line["active_thread_percentage"], "25.0", "{line:?}");
    refused(
        &[
            "--device",
            "gpushare.io/gpu=0-small",
            "--annotation",
            "gpushare.io/active-thread-percentage=100",
        ],
        "gpushare.io/active-thread-percentage=\"100\" is refused: it asks for something other than the container's CDI device gpushare.io/gpu=0 (whose profile sets 25)",
    );
    assert_eq!(env.daemon_ids().len(), 2, "GPU 0, and GPU 0 at 25 %");

    // The profile leaves the config: its devices are refused, and doctor says the spec
    // is out of date.
    let text_before = std::fs::read_to_string(&env.config).unwrap();
    let profile = "[cdi.profiles.small]\nactive-thread-percentage = 25\n";
    assert!(text_before.contains(profile));
    std::fs::write(&env.config, text_before.replace(profile, "")).unwrap();
    refused(
        &["--device", "gpushare.io/gpu=0-small"],
        "CDI device gpushare.io/gpu=0-small: profile small is not in this node's config",
    );
    let out = ns
        .cmd(GPUSHARE)
        .args(["doctor", "--cdi-spec", "/var/run/cdi/gpushare.json"])
        .env("GPUSHARE_CONFIG", &env.config)
        .output()
        .unwrap();
    assert!(
        text(&out).contains("/var/run/cdi/gpushare.json is out of date with the inventory and config: devices no longer on this node: [0-small,"),
        "{}",
        text(&out)
    );
    // The poststop hooks released every container.
    assert!(wait_until(Duration::from_secs(5), || env
        .status()
        .as_array()
        .unwrap()
        .iter()
        .all(|d| d["containers"].as_array().unwrap().is_empty())));
}
