//! CDI devices of gpushare's (`gpushare cdi generate`, `gpushare install cdi`) through the
//! engines that read CDI specs from `--device`: Podman 4.3 and 5, Docker 26 and 28.
//!
//! Podman: the spec is written by the binary under test into `/var/run/cdi` of a private
//! mount namespace (Podman 4.3 reads only `/etc/cdi` and `/var/run/cdi`; `PrivateMounts`
//! covers `/run` with an empty tmpfs, so the machine's own directories are never touched),
//! and Podman runs with gpushare's hooks.d files too, so that a container given both is
//! served once. Docker: `gpushare install cdi --enable docker` writes the spec into a
//! private directory and turns CDI on in the test dockerd's daemon.json; a CDI device is
//! served by runc running the spec's hooks (hook-only) or by the shim (`--runtime
//! gpushare`). The nodes refuse env requests (`accept-env-requests = false`): a CDI
//! request is not one.

use std::path::PathBuf;
use std::time::Duration;

use crate::engines::Dockerd;
use testkit::*;

const CLIENT: &str = "gpushare-mps-sim client";

/// `gpushare doctor --cdi-spec /var/run/cdi/gpushare.json` in `ns`, with `env`'s config.
fn doctor_cdi(env: &Env, ns: &PrivateMounts) -> std::process::Output {
    ns.cmd(gpushare())
        .args(["doctor", "--cdi-spec", "/var/run/cdi/gpushare.json"])
        .env("GPUSHARE_CONFIG", &env.config)
        .output()
        .unwrap()
}

/// Podman `bin` (`None`: Debian 12's 4.3, else a fetched one with its own conmon and
/// helpers named in a containers.conf of its own): a CDI device of gpushare's, alone or
/// beside the hooks.d hook, is served once on the GPU it names, with its profile's limit;
/// an annotation or env asking for something else beside it is refused, and no daemon
/// ever serves GPU 2. A fetched Podman (5) runs with the node's agent: its conmon waits
/// for every process it adopted, so without the agent a foreground `podman run` would
/// wait for the daemon's supervisor.
fn podman_serves_a_cdi_device(bin: Option<PathBuf>) {
    let mut env = Env::with_configs(
        "accept-env-requests = false\n[cdi.profiles.small]\nactive-thread-percentage = 25\n",
        "",
    );
    let p = Podman::new(&env, bin.as_deref());
    let ns = &p.ns;
    if bin.is_some() {
        env.enter(ns);
        env.start_agent();
    }
    // The spec, by the binary under test, where Podman reads it (in the namespace only).
    let out = ns
        .cmd(gpushare())
        .args(["cdi", "generate"])
        .env("GPUSHARE_CONFIG", &env.config)
        .output()
        .unwrap();
    assert_succeeded_saying(&out, "to /var/run/cdi/gpushare.json");
    let out = doctor_cdi(&env, ns);
    assert!(
        text(&out).contains("/var/run/cdi/gpushare.json is current: 20 devices of gpushare.io/gpu"),
        "{}",
        text(&out)
    );
    eprintln!("{}", text(&p.run(&["--version"])));
    let script = format!("{CLIENT}; cat /proc/self/mountinfo");
    let run = |extra: &[&str]| p.run_rm("1000", extra, &script);
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
    let out = doctor_cdi(&env, ns);
    assert!(
        text(&out).contains("/var/run/cdi/gpushare.json is out of date with the inventory and config: devices no longer on this node: [0-small,"),
        "{}",
        text(&out)
    );
    // The poststop hooks released every container.
    assert!(env.no_container_listed(Duration::from_secs(5)));
}

#[test]
fn podman_serves_a_cdi_device_once_and_the_container_cannot_change_its_request() {
    podman_serves_a_cdi_device(None);
}

#[test]
fn podman_5_serves_a_cdi_device_once_and_the_container_cannot_change_its_request() {
    podman_serves_a_cdi_device(Some(fetched_podman5()));
}

/// Docker `bin` (a fetched one, ≥ 25) configured by `gpushare install docker` and then
/// `gpushare install cdi --enable docker` (CDI on, a private spec directory): a CDI
/// device is served once on GPU 0, by runc running the spec's hooks (hook-only: no
/// `CUDA_MPS_PIPE_DIRECTORY`) and by the shim (`--runtime gpushare`, which takes the
/// request from the CDI hook and sets the env); an annotation asking for GPU 2 beside it
/// is refused with gpushare's line on either path, and no daemon ever serves GPU 2.
fn docker_serves_a_cdi_device(bin: PathBuf) {
    let env = Env::with_configs("accept-env-requests = false\n", "");
    let ns = PrivateMounts::keeping(env.path(), &[&fetched_root(&bin)]);
    let cdi = env.path().join("cdi");
    let d = Dockerd::start_configured(&env, &ns, Some(&bin), &|daemon_json| {
        let out = env
            .cmd(gpushare())
            .args(["install", "cdi", "--output"])
            .arg(cdi.join("gpushare.json"))
            .args(["--enable", "docker", "--config"])
            .arg(daemon_json)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", text(&out));
        let v: serde_json::Value =
            serde_json::from_slice(&std::fs::read(daemon_json).unwrap()).unwrap();
        assert_eq!(v["features"]["cdi"], true, "{v}");
        assert!(
            v["cdi-spec-dirs"]
                .as_array()
                .unwrap()
                .contains(&cdi.display().to_string().into()),
            "{v}"
        );
    });
    let version = text(&d.docker(&["version", "--format", "{{.Server.Version}}"]));
    eprintln!("dockerd {version}");
    let script = format!("echo PIPE=$CUDA_MPS_PIPE_DIRECTORY; {CLIENT}; cat /proc/self/mountinfo");
    let run = |extra: &[&str]| {
        let mut args = vec!["run", "--rm", "-u", "1000"];
        args.extend_from_slice(extra);
        args.extend_from_slice(&["gpushare-test", "sh", "-c", &script]);
        d.docker(&args)
    };
    let devices_served = || -> Vec<serde_json::Value> {
        env.daemon_ids()
            .iter()
            .map(|id| env.record(id)["identity"]["devices"].clone())
            .collect()
    };
    for (runtime, pipe_env) in [
        (&[][..], "PIPE=\n"),
        (&["--runtime", "gpushare"][..], "PIPE=/tmp/nvidia-mps\n"),
    ] {
        let mut args = runtime.to_vec();
        args.extend(["--device", "gpushare.io/gpu=0"]);
        let out = run(&args);
        let s = text(&out);
        assert!(
            out.status.success(),
            "{args:?}: {s}\n{}",
            env.gpushare_log()
        );
        assert!(s.contains(pipe_env), "{args:?}: {s}");
        assert_eq!(
            pipe_mounts(&s),
            1,
            "{args:?}: served once, one pipe mount:\n{s}"
        );
        let line = client_line(&s);
        assert_eq!(
            (line["shm"].as_str(), line["server_uid"].as_str()),
            ("ok", "1000"),
            "{s}"
        );
        assert_eq!(
            devices_served(),
            [serde_json::json!([GPU0])],
            "one daemon, GPU 0"
        );

        args.extend(["--annotation", "gpushare.io/device=2"]);
        let out = run(&args);
        let s = text(&out);
        assert!(!out.status.success(), "{args:?} must be refused: {s}");
        assert!(
            s.contains("gpushare: CDI device gpushare.io/gpu=0: gpushare.io/device=\"2\" is refused: it asks for something other than the container's CDI device gpushare.io/gpu=0"),
            "{args:?}: {s}"
        );
        assert!(!s.contains("mps-client"), "{s}");
    }
    assert!(
        !devices_served().contains(&serde_json::json!([GPU2])),
        "{:?}",
        devices_served()
    );
    assert!(env.no_container_listed(Duration::from_secs(10)));
}

#[test]
fn docker_26_serves_a_cdi_device_once_and_the_container_cannot_change_its_request() {
    docker_serves_a_cdi_device(fetched(
        "GPUSHARE_TEST_DOCKER26",
        "trixie",
        &["dockerd", "docker", "containerd", "containerd-shim-runc-v2"],
    ));
}

#[test]
fn docker_28_serves_a_cdi_device_once_and_the_container_cannot_change_its_request() {
    docker_serves_a_cdi_device(fetched(
        "GPUSHARE_TEST_DOCKER28",
        "sid",
        &["dockerd", "docker", "containerd", "containerd-shim-runc-v2"],
    ));
}
