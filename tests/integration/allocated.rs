//! A pod's sandbox passes through whatever it carries, and `gpushare.io/device=allocated`
//! (or the node's `default-device = "allocated"`) takes the devices NVIDIA's device plugin
//! or DRA driver wrote into the spec, through the real shim, runc and the simulator. The
//! spec shapes are those docs/kubernetes.md, "Let the scheduler pick the GPU", describes.

use serde_json::{json, Value};

use crate::tenant_mounts::{must_hook_only_create, RuncDelete};
use testkit::*;

const CLIENT: &str = "gpushare-mps-sim client";
/// The device plugin's cdi-annotations key: its suffix is a fresh UUID per response.
const CDI_KEY: &str = "cdi.k8s.io/nvidia-device-plugin_4b0c2d7e-9a51-4f39-8e3a-55d1f0c2a6b7";
const CONTAINERD_TYPE: &str = "io.kubernetes.cri.container-type";
const CRIO_TYPE: &str = "io.kubernetes.cri-o.ContainerType";

/// Edits a bundle's config.json as an engine or allocator would have written it.
fn edit(c: &Container, f: impl FnOnce(&mut Value)) {
    let mut v = c.config();
    f(&mut v);
    std::fs::write(
        c.bundle.join("config.json"),
        serde_json::to_vec_pretty(&v).unwrap(),
    )
    .unwrap();
}

fn push_env(v: &mut Value, entry: &str) {
    v["process"]["env"]
        .as_array_mut()
        .unwrap()
        .push(json!(entry));
}

fn push_mount(v: &mut Value, m: Value) {
    v["mounts"].as_array_mut().unwrap().push(m);
}

/// A CDI-injected device node with its device cgroup rule, as containerd and CRI-O apply
/// nvcdi's edits.
fn push_node(v: &mut Value, path: &str, major: u32, minor: u32) {
    let linux = v["linux"].as_object_mut().unwrap();
    linux
        .entry("devices")
        .or_insert_with(|| json!([]))
        .as_array_mut()
        .unwrap()
        .push(json!({"path": path, "type": "c", "major": major, "minor": minor, "fileMode": 438, "uid": 0, "gid": 0}));
    v["linux"]["resources"]["devices"]
        .as_array_mut()
        .unwrap()
        .push(json!({"allow": true, "type": "c", "major": major, "minor": minor, "access": "rwm"}));
}

/// How an allocator put one device into the spec.
#[derive(Clone, Copy, Debug)]
enum Strategy {
    /// `NVIDIA_VISIBLE_DEVICES=<id>`.
    Envvar,
    /// `/dev/null` bound at `/var/run/nvidia-container-devices/<id>`.
    VolumeMounts,
    /// `cdi.k8s.io/nvidia-device-plugin_<uuid>: k8s.device-plugin.nvidia.com/gpu=<id>`.
    CdiAnnotations,
    /// cdi-cri and the DRA driver: nvcdi's device nodes, nothing named.
    DeviceNodes,
}

/// Writes the allocation of `id` (a device-plugin id; for device nodes, a minor number)
/// the way `strategy` does, with the image's own `NVIDIA_VISIBLE_DEVICES=all` where the
/// strategy leaves it in place (CDI only).
fn allocate(v: &mut Value, strategy: Strategy, id: &str) {
    match strategy {
        Strategy::Envvar => push_env(v, &format!("NVIDIA_VISIBLE_DEVICES={id}")),
        Strategy::VolumeMounts => {
            push_env(
                v,
                "NVIDIA_VISIBLE_DEVICES=/var/run/nvidia-container-devices",
            );
            push_mount(
                v,
                json!({"destination": "/var/run", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "nodev", "mode=755"]}),
            );
            push_mount(
                v,
                json!({"destination": format!("/var/run/nvidia-container-devices/{id}"), "type": "bind", "source": "/dev/null", "options": ["rbind", "ro"]}),
            );
        }
        Strategy::CdiAnnotations => {
            push_env(v, "NVIDIA_VISIBLE_DEVICES=all");
            v["annotations"][CDI_KEY] = json!(format!("k8s.device-plugin.nvidia.com/gpu={id}"));
        }
        Strategy::DeviceNodes => {
            push_env(v, "NVIDIA_VISIBLE_DEVICES=all");
            push_env(v, "NVIDIA_CTK_LIBCUDA_DIR=/usr/lib/x86_64-linux-gnu");
            push_node(v, "/dev/nvidiactl", 195, 255);
            push_node(v, &format!("/dev/nvidia{id}"), 195, id.parse().unwrap());
        }
    }
}

/// No record, no daemon: the state directory was never made.
fn assert_no_state(env: &Env, what: &str) {
    assert!(
        !env.state.exists(),
        "{what}: gpushare created state: {:?}",
        env.daemon_ids()
    );
}

/// config.json is byte-for-byte what it was (shown as text when it is not).
fn assert_untouched(c: &Container, before: &[u8], what: &str) {
    let now = c.config_bytes();
    assert!(
        now == before,
        "{what}: config.json changed:\n{}",
        String::from_utf8_lossy(&now)
    );
}

fn log_len(env: &Env) -> u64 {
    std::fs::metadata(env.path().join("gpushare.log"))
        .map(|m| m.len())
        .unwrap_or(0)
}

#[test]
fn a_sandbox_with_pod_annotations_is_left_untouched() {
    let env = Env::new();
    // containerd (pod_annotations) and CRI-O copy the pod's annotations into the pause
    // container's spec; the kubernetes pause image runs as 65535.
    let cases = [
        ("pause-containerd", CONTAINERD_TYPE, "0"),
        ("pause-crio", CRIO_TYPE, "0"),
        // A bad value is not judged on the sandbox: the workload will report it.
        ("pause-bad", CONTAINERD_TYPE, "bogus"),
    ];
    for (id, marker, device) in cases {
        let c = env
            .container(id)
            .uid(65535)
            .annotation(marker, "sandbox")
            .device(device)
            .annotation("gpushare.io/active-thread-percentage", "50")
            .env("GPUSHARE_PINNED_MEMORY_LIMIT=1G")
            .sh("echo paused")
            .bundle();
        let before = c.config_bytes();
        let logged = log_len(&env);
        let out = c.try_create();
        assert!(out.status.success(), "{id}: {}", c.last_error());
        assert_untouched(&c, &before, id);
        assert_eq!(
            log_len(&env),
            logged,
            "{id}: a sandbox is exec'd like a passthrough, nothing logged"
        );
        assert_eq!(c.run(), "paused\n");
        assert_no_state(&env, id);
    }
    // The workload container with the same pod annotations: the bad value is reported now.
    let w = env
        .container("workload-bad")
        .uid(1000)
        .annotation(CONTAINERD_TYPE, "container")
        .device("bogus")
        .bundle();
    let before = w.config_bytes();
    assert_eq!(w.try_create().status.code(), Some(1));
    assert!(
        w.last_error()
            .starts_with("gpushare: gpushare.io/device=\"bogus\" is invalid"),
        "{}",
        w.last_error()
    );
    assert_untouched(&w, &before, "workload-bad");
    assert_no_state(&env, "workload-bad");
}

#[test]
fn a_pod_gets_one_daemon_for_its_workload_and_none_for_its_pause_container() {
    let env = Env::new();
    let pod = |id: &str, kind: &str, uid: u32| {
        env.container(id)
            .uid(uid)
            .annotation(CONTAINERD_TYPE, kind)
            .annotation("io.kubernetes.cri.sandbox-name", "trainer")
            .device("0")
            .annotation("gpushare.io/active-thread-percentage", "40")
    };
    let pause = pod("pod-pause", "sandbox", 65535).sh("sleep 30").create();
    pause.start();
    let work = pod("pod-work", "container", 1000).sh(CLIENT).create();
    let line = client_line(&work.run());
    assert_eq!(line["server_uid"], "1000");
    assert_eq!(line["shm"], "ok");
    let ids = env.daemon_ids();
    assert_eq!(ids.len(), 1, "exactly one daemon: {ids:?}");
    let record = env.record(&ids[0]);
    assert_eq!(record["identity"]["uid"], 1000);
    assert_eq!(record["identity"]["devices"], json!([GPU0]));
    assert_eq!(uid_and_capeff(env.daemon_pid(&ids[0])).0, 1000);
    assert!(
        pause.config()["annotations"]
            .get("gpushare.io/daemon")
            .is_none(),
        "the pause container was not edited"
    );
    let status = env.status();
    let users: Vec<&str> = status[0]["containers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_str().unwrap())
        .collect();
    assert_eq!(users, ["pod-work"], "the pause container is no client");
}

#[test]
fn each_strategy_brings_its_gpu_and_mig_device_to_their_daemon() {
    // The envvar strategy is read only where the node accepts the variable.
    let env = Env::with_configs("accept-visible-devices-env = true", "");
    // (strategy, the GPU's id in the spec, its UUID, the MIG device's id, its UUID)
    let cases: [(Strategy, String, &str, Option<&str>, &str); 4] = [
        (Strategy::Envvar, GPU0.into(), GPU0, Some(MIG0), MIG0),
        (Strategy::VolumeMounts, "2".into(), GPU2, Some("1:1"), MIG1),
        (
            Strategy::CdiAnnotations,
            GPU2.into(),
            GPU2,
            Some(MIG2),
            MIG2,
        ),
        // By minor number, which is not the index in this inventory.
        (
            Strategy::DeviceNodes,
            GPU0_MINOR.to_string(),
            GPU0,
            None,
            "",
        ),
    ];
    for (n, (strategy, gpu_id, gpu_uuid, mig_id, mig_uuid)) in cases.iter().enumerate() {
        let mut wanted = vec![(format!("gpu{n}"), gpu_id.clone(), *gpu_uuid)];
        if let Some(mig) = mig_id {
            wanted.push((format!("mig{n}"), mig.to_string(), *mig_uuid));
        }
        for (id, alloc, uuid) in wanted {
            let c = env.request(&id, 1000, "allocated").sh(CLIENT).bundle();
            edit(&c, |v| allocate(v, *strategy, &alloc));
            let out = c.try_create();
            assert!(
                out.status.success(),
                "{strategy:?} {id}: {}",
                c.last_error()
            );
            let stdout = c.run();
            let line = client_line(&stdout);
            assert_eq!(line["shm"], "ok", "{strategy:?} {id}: {stdout}");
            assert_eq!(line["server_uid"], "1000");
            let daemon = env.daemon_of(&c);
            assert_eq!(
                env.record(&daemon)["identity"]["devices"],
                json!([uuid]),
                "{strategy:?} {id}"
            );
            assert!(
                environ(env.daemon_pid(&daemon)).contains(&format!("CUDA_VISIBLE_DEVICES={uuid}")),
                "{strategy:?} {id}"
            );
        }
    }
    // GPU 0 and GPU 2 twice each, three MIG devices: five daemons.
    assert_eq!(env.daemon_ids().len(), 5);

    // A MIG device injected by CDI (cdi-cri, the DRA driver) is its parent's node and the
    // access nodes of its GPU and compute instances, which the inventory's cap minors map
    // to MIG device 1:1: it reaches that MIG device's daemon, the one the volume-mounts
    // container above started.
    let c = env
        .request("mig-nodes", 1000, "allocated")
        .sh(CLIENT)
        .bundle();
    let (gi, ci) = mig_caps_minors(1);
    edit(&c, |v| {
        allocate(v, Strategy::DeviceNodes, &GPU1_MINOR.to_string());
        push_node(v, &format!("/dev/nvidia-caps/nvidia-cap{gi}"), 511, gi);
        push_node(v, &format!("/dev/nvidia-caps/nvidia-cap{ci}"), 511, ci);
    });
    let out = c.try_create();
    assert!(out.status.success(), "mig-nodes: {}", c.last_error());
    let stdout = c.run();
    let line = client_line(&stdout);
    assert_eq!(line["shm"], "ok", "mig-nodes: {stdout}");
    assert_eq!(line["server_uid"], "1000");
    let daemon = env.daemon_of(&c);
    assert_eq!(env.record(&daemon)["identity"]["devices"], json!([MIG1]));
    assert!(environ(env.daemon_pid(&daemon)).contains(&format!("CUDA_VISIBLE_DEVICES={MIG1}")));
    assert_eq!(env.daemon_ids().len(), 5, "MIG device 1:1's daemon, shared");

    // Two MIG devices by their nodes: refused as a list of them is, config.json untouched,
    // no daemon.
    let c = env.request("migs-nodes", 1000, "allocated").bundle();
    edit(&c, |v| {
        allocate(v, Strategy::DeviceNodes, &GPU1_MINOR.to_string());
        for index in [0, 2] {
            let (gi, ci) = mig_caps_minors(index);
            push_node(v, &format!("/dev/nvidia-caps/nvidia-cap{gi}"), 511, gi);
            push_node(v, &format!("/dev/nvidia-caps/nvidia-cap{ci}"), 511, ci);
        }
    });
    let before = c.config_bytes();
    let daemons = env.daemon_ids();
    assert_eq!(
        c.refuse(),
        format!("gpushare: gpushare.io/device=\"allocated\" takes the devices allocated to the container: linux.devices=\"/dev/nvidia{GPU1_MINOR},/dev/nvidia-caps/nvidia-cap12,/dev/nvidia-caps/nvid…\" is invalid: a MIG device must stand alone, not in a list")
    );
    assert_untouched(&c, &before, "migs-nodes");
    assert_eq!(env.daemon_ids(), daemons);
}

#[test]
fn no_allocation_is_refused_naming_what_was_looked_at() {
    let env = Env::new();
    // The image's own NVIDIA_VISIBLE_DEVICES=all is no allocation.
    let c = env
        .request("none", 1000, "allocated")
        .env("NVIDIA_VISIBLE_DEVICES=all")
        .bundle();
    let before = c.config_bytes();
    assert_eq!(
        c.refuse(),
        "gpushare: gpushare.io/device=\"allocated\" found no devices allocated to the container: no cdi.k8s.io/* annotation names an NVIDIA GPU, no mount from /dev/null is under /var/run/nvidia-container-devices/, and linux.devices holds no /dev/nvidia<N> (not read in a privileged container); NVIDIA_VISIBLE_DEVICES is not read on this node (accept-visible-devices-env = false); allowed is allocated in a container given GPUs by a device plugin or DRA driver, or devices named explicitly (0, GPU-<uuid>, MIG-<uuid>, 0:1)"
    );
    assert_untouched(&c, &before, "none");
    assert_no_state(&env, "none");
}

#[test]
fn the_allocators_own_mps_is_refused_and_nothing_is_touched() {
    let env = Env::new();
    // The device plugin with sharing.mps: env, pipe and shm mounts of its own; and the
    // same with the pod's own CUDA_MPS_PIPE_DIRECTORY in place of the plugin's (a pod's
    // env replaces the allocator's value of the same name), which must not hide it.
    for (id, pipe_env, why) in [
        (
            "plugin-mps",
            "/mps/nvidia.com/gpu/pipe",
            "where the container's CUDA_MPS_PIPE_DIRECTORY points",
        ),
        (
            "plugin-mps-pod-env",
            "/pod/elsewhere",
            "where the device plugin's sharing.mps puts its pipe directory",
        ),
    ] {
        let c = env.request(id, 1000, "allocated").bundle();
        edit(&c, |v| {
            allocate(v, Strategy::VolumeMounts, GPU2);
            push_env(v, &format!("CUDA_MPS_PIPE_DIRECTORY={pipe_env}"));
            push_mount(
                v,
                json!({"destination": "/mps/nvidia.com/gpu/pipe", "type": "bind", "source": "/run/nvidia/mps/nvidia.com/gpu/pipe", "options": ["rbind"]}),
            );
            push_mount(
                v,
                json!({"destination": "/dev/shm", "type": "bind", "source": "/run/nvidia/mps/shm", "options": ["rbind"]}),
            );
        });
        let before = c.config_bytes();
        assert_eq!(c.try_create().status.code(), Some(1), "{id}");
        assert_eq!(
            c.last_error(),
            format!("gpushare: gpushare.io/device=\"allocated\" is refused: the container's allocation already carries its allocator's MPS (a mount at \"/mps/nvidia.com/gpu/pipe\" from \"/run/nvidia/mps/nvidia.com/gpu/pipe\", {why}), and gpushare never stacks a second MPS on it; allowed is an allocation without the allocator's MPS sharing (device plugin sharing.mps, DRA driver MPS)")
        );
        assert_untouched(&c, &before, id);
        assert_no_state(&env, id);
    }
}

/// A pod's own `emptyDir` where the device plugin's volume mounts go (and the tmpfs the
/// read-only test rootfs needs under it).
fn push_pod_volume(env: &Env, v: &mut Value, id: &str) {
    let empty_dir = env.path().join("empty-dir");
    std::fs::create_dir_all(&empty_dir).unwrap();
    push_mount(
        v,
        json!({"destination": "/var/run", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "nodev", "mode=755"]}),
    );
    push_mount(
        v,
        json!({"destination": format!("/var/run/nvidia-container-devices/{id}"), "type": "bind", "source": empty_dir, "options": ["rbind", "rw"]}),
    );
}

/// Item 3 of the security issue, through runc: on a node that serves allocations by
/// default, what the pod's author writes (its env's `NVIDIA_VISIBLE_DEVICES`, an
/// `emptyDir` at `/var/run/nvidia-container-devices/<uuid>`) neither makes an allocation
/// nor moves one, and NVIDIA's runtime is handed the allocated GPU, not the forged one;
/// where the node reads the env, a disagreeing env is refused, never merged.
#[test]
fn a_pod_s_own_env_and_volumes_neither_make_nor_move_its_allocation() {
    let env = Env::with_configs("default-device = \"allocated\"", "");
    let handed = nvidia_stand_in(&env, &[]);
    // Allocated nothing: another tenant's GPU 2 by env, or by emptyDir.
    for (id, forge) in [("forged-env", true), ("forged-volume", false)] {
        let c = env.container(id).uid(1000).sh("echo plain").bundle();
        edit(&c, |v| {
            if forge {
                push_env(v, &format!("NVIDIA_VISIBLE_DEVICES={GPU2}"));
            } else {
                push_pod_volume(&env, v, GPU2);
            }
        });
        let before = c.config_bytes();
        let out = c.try_create();
        assert!(out.status.success(), "{id}: {}", c.last_error());
        assert_untouched(&c, &before, id);
        assert_no_state(&env, id);
        assert_eq!(c.run(), "plain\n");
    }
    // Allocated GPU 0 by CDI-injected device nodes, plus both forgeries naming GPU 2:
    // served GPU 0 alone, and NVIDIA's runtime sees GPU 0 only.
    let c = env
        .container("allocated-and-forged")
        .uid(1000)
        .sh(CLIENT)
        .bundle();
    edit(&c, |v| {
        allocate(v, Strategy::DeviceNodes, &GPU0_MINOR.to_string());
        push_pod_volume(&env, v, GPU2);
        push_env(v, &format!("NVIDIA_VISIBLE_DEVICES={GPU2}"));
    });
    let out = c.try_create();
    assert!(out.status.success(), "{}", c.last_error());
    assert_eq!(client_line(&c.run())["shm"], "ok");
    let daemons = env.daemon_ids();
    assert_eq!(daemons.len(), 1);
    assert_eq!(
        env.record(&daemons[0])["identity"]["devices"],
        json!([GPU0])
    );
    let spec: Value =
        serde_json::from_slice(&std::fs::read(handed.join("allocated-and-forged.json")).unwrap())
            .unwrap();
    let visible: Vec<&str> = spec["process"]["env"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e.as_str()?.strip_prefix("NVIDIA_VISIBLE_DEVICES="))
        .collect();
    assert_eq!(visible, [GPU0], "what NVIDIA's runtime is handed");

    // A node that reads the env: GPU 0 by device nodes, GPU 2 by env: refused naming both.
    let env = Env::with_configs(
        "default-device = \"allocated\"\naccept-visible-devices-env = true",
        "",
    );
    let c = env.container("disagree").uid(1000).sh(CLIENT).bundle();
    edit(&c, |v| {
        allocate(v, Strategy::DeviceNodes, &GPU0_MINOR.to_string());
        push_env(v, &format!("NVIDIA_VISIBLE_DEVICES={GPU2}"));
    });
    let before = c.config_bytes();
    assert_eq!(
        c.refuse(),
        format!("gpushare: default-device=\"allocated\" is refused: the sources of the container's allocation disagree (linux.devices=\"/dev/nvidia{GPU0_MINOR}\" names {GPU0}, but NVIDIA_VISIBLE_DEVICES=\"{GPU2}\" names {GPU2}), and gpushare never merges them; allowed is an allocation whose sources all name the same devices")
    );
    assert_untouched(&c, &before, "disagree");
    assert_no_state(&env, "disagree");
}

#[test]
fn default_device_allocated_shares_allocated_containers_and_passes_the_rest_through() {
    let env = Env::with_configs("default-device = \"allocated\"", "");
    // No gpushare annotation at all: the allocation (cdi-cri nodes) is the request.
    let shared = env
        .container("allocated")
        .uid(1000)
        // The client by a glob: these bytes must not spell gpushare.
        .sh("echo PIPE=$CUDA_MPS_PIPE_DIRECTORY; /usr/bin/g*-mps-sim client")
        .bundle();
    edit(&shared, |v| {
        allocate(v, Strategy::DeviceNodes, &GPU2_MINOR.to_string())
    });
    assert!(
        !shared
            .config_bytes()
            .to_ascii_lowercase()
            .windows(8)
            .any(|w| w == b"gpushare"),
        "the bundle must not spell gpushare for this test to mean anything"
    );
    let out = shared.try_create();
    assert!(out.status.success(), "{}", shared.last_error());
    let stdout = shared.run();
    assert!(stdout.contains("PIPE=/tmp/nvidia-mps"), "{stdout}");
    assert_eq!(client_line(&stdout)["shm"], "ok");
    let daemon = env.daemon_of(&shared);
    assert_eq!(env.record(&daemon)["identity"]["devices"], json!([GPU2]));

    // No allocation, though the bytes spell nvidia (a CUDA image's own env): parsed,
    // and passed through byte-identical.
    let cuda = env
        .container("cuda-image")
        .uid(1000)
        .env("NVIDIA_VISIBLE_DEVICES=all")
        .env("NVIDIA_DRIVER_CAPABILITIES=compute,utility")
        .sh("echo plain")
        .bundle();
    // No allocation and nothing that could spell one: the fast path, nothing logged.
    let plain = env.container("plain").uid(1000).sh("echo plain").bundle();
    for c in [&cuda, &plain] {
        let before = c.config_bytes();
        let logged = log_len(&env);
        let out = c.try_create();
        assert!(out.status.success(), "{}: {}", c.id, c.last_error());
        assert_untouched(c, &before, &c.id);
        if c.id == "plain" {
            assert_eq!(log_len(&env), logged, "plain: exec'd unparsed");
        }
        assert_eq!(c.run(), "plain\n");
    }
    assert_eq!(env.daemon_ids(), vec![daemon], "no daemon for the others");
}

#[test]
fn hook_only_mode_skips_sandboxes_and_reads_allocations_the_same_way() {
    let env = Env::new();
    let _cleanup = RuncDelete(&env, vec!["ho-pause".into(), "ho-alloc".into()]);
    // CRI-O's pause container with the pod's annotations (CRI-O copies them all).
    let pause = env
        .container("ho-pause")
        .uid(65535)
        .annotation(CRIO_TYPE, "sandbox")
        .device("0")
        .bundle();
    must_hook_only_create(&env, &pause);
    assert_no_state(&env, "ho-pause");

    // A workload whose device plugin used cdi-annotations, as CRI-O passes them.
    let work = env
        .container("ho-alloc")
        .uid(1000)
        .annotation(CRIO_TYPE, "container")
        .device("allocated")
        .sh(CLIENT)
        .bundle();
    edit(&work, |v| allocate(v, Strategy::CdiAnnotations, "2"));
    must_hook_only_create(&env, &work);
    assert_eq!(client_line(&work.run())["shm"], "ok");
    let ids = env.daemon_ids();
    assert_eq!(ids.len(), 1, "{ids:?}");
    assert_eq!(env.record(&ids[0])["identity"]["devices"], json!([GPU2]));
    assert_eq!(env.record(&ids[0])["identity"]["uid"], 1000);
}

#[test]
fn daemon_start_refuses_allocated() {
    let env = Env::new();
    let out = env.gpushare(&["daemon", "start", "--device", "allocated", "--uid", "1000"]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        "gpushare: --device=\"allocated\" is refused: allocated means the devices allocated to a container, and gpushare daemon start has no container; allowed is a GPU index like 0, GPU-<uuid>, MIG-<uuid>, <gpu>:<mig> like 0:1, or a comma-separated list of GPU indices and GPU-<uuid>s\n"
    );
    assert_no_state(&env, "daemon start");
}
