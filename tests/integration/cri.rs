//! The Kubernetes path, as a kubelet drives it: the tests on the test kit's `Node` (a
//! private containerd 1.6 with its CRI plugin, configured by the real `gpushare install
//! containerd`; containerd 1.7 and 2.x where a test needs them), over the CRI gRPC API:
//! pods, containers, restarts, removal, the node installer and hook-only mode.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::Value;

use testkit::cri_api::*;
use testkit::*;

/// gpushare's line for a pod annotated `gpushare.io/active-thread-percentage=101`.
pub const BAD_PERCENTAGE_LINE: &str = "gpushare: gpushare.io/active-thread-percentage=\"101\" is invalid: allowed is an integer from 1 to 100";

#[test]
fn cri_pods_of_two_users_share_gpu_0_at_once_on_their_own_daemons() {
    let env = Env::new();
    let mut node = Node::start(&env);
    let ann = [("gpushare.io/device", "0")];

    // runAsUser on the pod (kubelet copies it to the container); bob (uid 2000) is served
    // at once, by his own, while alice's client holds her server.
    let held = hold(60);
    let [alice, bob] = node.two_users_pods(EntryPath::RuntimeClass, &ann, &held);
    let da = node.daemon_of(&alice.id);
    // The edited spec names the same daemon as the record.
    assert_eq!(
        node.bundle_spec(&alice.id)["annotations"]["gpushare.io/daemon"].as_str(),
        da.as_deref()
    );
    let pipe_env = node.bundle_spec(&bob.id)["process"]["env"].clone();
    assert!(
        pipe_env
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e == "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps"),
        "{pipe_env}"
    );

    // runAsUser only on the container: the pause runs as the image's 65535, the container
    // as 1000 — alice's identity, so alice's daemon and server.
    let carol = node.pod(&PodSpec {
        name: "carol",
        annotations: &ann,
        run_as_user: None,
        ..Default::default()
    });
    let script = hold(0);
    let c = ContainerSpec::user("cuda", 1000, &script);
    let c_id = node.run(&carol, &c);
    let lc = node.client_line(&carol, &c);
    assert_eq!(
        (lc["server_uid"].as_str(), lc["server"].as_str()),
        ("1000", alice.line["server"].as_str()),
        "{lc:?}"
    );
    assert!(lc["waited_ms"].parse::<u64>().unwrap() < 1000, "{lc:?}");
    assert_eq!(
        node.bundle_spec(&c_id)["annotations"]["gpushare.io/daemon"].as_str(),
        da.as_deref()
    );
    assert_eq!(
        node.bundle_spec(&c_id)["process"]["user"]["uid"],
        1000,
        "the container's own user"
    );
}

/// A node laid out as NVIDIA's GPU Operator lays it out (the driver's files under a root
/// of their own, reproduced with driver_root.rs's fake driver tree) and configured as
/// docs/kubernetes.md's "With NVIDIA's GPU Operator" says (`driver-root`, the control
/// binary by name, `inventory = "nvml"`): through containerd's CRI plugin two users' pods
/// on GPU 1, which only the root's NVML knows, get their share from daemons of their own
/// that run the root's control binary; doctor reports no failure on that node.
#[test]
fn cri_pods_on_a_gpu_operator_node_get_their_share() {
    let (env, root) = crate::driver_root::operator_env();
    let mut node = Node::start(&env);
    let (report, _) = crate::driver_root::doctor(&env);
    for name in ["driver-root", "driver", "inventory", "mps-control"] {
        assert!(
            report
                .lines()
                .any(|l| l.starts_with("ok") && l.split_whitespace().nth(1) == Some(name)),
            "doctor's {name} line is ok:\n{report}"
        );
    }
    assert!(!report.lines().any(|l| l.starts_with("FAIL")), "{report}");
    let ann = [
        ("gpushare.io/device", "1"),
        ("gpushare.io/active-thread-percentage", "50"),
    ];
    for (pod, uid) in [("alice", 1000), ("bob", 2000)] {
        let p = node.pod(&PodSpec::user(pod, uid, &ann));
        let c = ContainerSpec::user("cuda", uid, CLIENT);
        node.run(&p, &c);
        let line = node.client_line(&p, &c);
        assert_eq!(line["server_uid"], uid.to_string(), "{line:?}");
        assert_eq!(percentage(&line), 50.0, "{line:?}");
    }
    let control = std::fs::canonicalize(root.join("bin/nvidia-cuda-mps-control")).unwrap();
    let ids = env.daemon_ids();
    assert_eq!(ids.len(), 2, "one daemon per user: {ids:?}");
    for id in &ids {
        let pid = env.daemon_pid(id);
        let exe = std::fs::read_link(format!("/proc/{pid}/exe")).unwrap();
        assert_eq!(exe, control, "daemon {id} runs the root's control binary");
    }
}

/// `gpushare uninstall containerd` gives back the config as it was before `install
/// containerd`, byte for byte; after a restart the CRI plugin has no gpushare handler.
#[test]
fn cri_uninstall_gives_back_the_config_and_containerd_forgets_the_handler() {
    let env = Env::new();
    let mut node = Node::start(&env);
    let plain = node.pod(&PodSpec {
        name: "before",
        ..Default::default()
    });
    node.cri().stop_pod(&plain.id).unwrap();
    node.cri().remove_pod(&plain.id).unwrap();
    uninstall_containerd(&env, &node.config);
    assert_eq!(
        std::fs::read_to_string(&node.config).unwrap(),
        base_config(&node.dir),
        "the config as it was before install"
    );
    node.stop();
    node.restart();
    let err = node
        .try_pod(&PodSpec {
            name: "after",
            ..Default::default()
        })
        .expect_err("no gpushare handler after uninstall");
    assert!(err.message.contains("gpushare"), "{err}");
}

#[test]
fn cri_restarted_container_reattaches_and_removal_leaves_nothing() {
    let env = Env::new();
    let mut node = Node::start(&env);
    let pod = node.pod(&PodSpec::user(
        "restarts",
        1000,
        &[
            ("gpushare.io/device", "0"),
            ("gpushare.io/active-thread-percentage", "50"),
        ],
    ));
    let script = hold(0);
    let first = ContainerSpec {
        attempt: 0,
        ..ContainerSpec::user("cuda", 1000, &script)
    };
    let id0 = node.run(&pod, &first);
    let l0 = node.client_line(&pod, &first);
    assert_eq!(l0["active_thread_percentage"], "50.0", "{l0:?}");
    let daemon = node.daemon_of(&id0).expect("the container is attached");
    let daemon_pid = env.daemon_pid(&daemon);

    // The container dies (as an OOM kill or a failed probe would end it); the kubelet
    // starts attempt 1 in the same sandbox: a new container id, the same daemon.
    node.cri().stop_container(&id0, 0).unwrap();
    node.wait_state(&id0, CONTAINER_EXITED);
    assert!(
        wait_until(Duration::from_secs(10), || node.daemon_of(&id0).is_none()),
        "the poststop hook released {id0}"
    );
    let second = ContainerSpec {
        attempt: 1,
        ..first.clone()
    };
    let id1 = node.run(&pod, &second);
    assert_ne!(id0, id1);
    let l1 = node.client_line(&pod, &second);
    assert_eq!(node.daemon_of(&id1).as_deref(), Some(daemon.as_str()));
    assert_eq!(
        env.daemon_pid(&daemon),
        daemon_pid,
        "the same daemon process"
    );
    assert_eq!(
        (
            l1["server_uid"].as_str(),
            l1["active_thread_percentage"].as_str()
        ),
        ("1000", "50.0")
    );
    // kubelet removes the dead attempt.
    node.cri().remove_container(&id0).unwrap();

    // Removal: the container, then the pod.
    node.cri().stop_container(&id1, 0).unwrap();
    node.cri().remove_container(&id1).unwrap();
    node.cri().stop_pod(&pod.id).unwrap();
    node.cri().remove_pod(&pod.id).unwrap();
    assert_eq!(node.cri().list_containers().unwrap(), vec![]);
    assert_eq!(node.cri().list_pods().unwrap(), vec![]);
    let runc = node.runc_ids();
    for id in [&id0, &id1, &pod.id] {
        assert!(
            !runc.contains(id.as_str()),
            "runc state of {id} is left:\n{runc}"
        );
        assert!(!node.bundle(id).exists(), "the bundle of {id} is left");
    }
    assert_eq!(
        node.gpushare_records(),
        vec![],
        "no container record is left"
    );
    let status = node.status_containers();
    assert!(
        status.values().all(|cs| cs.is_empty()),
        "no daemon references a container: {status:?}"
    );
    assert!(
        status.contains_key(&daemon),
        "the daemon outlives its containers (idle-timeout)"
    );
}

#[test]
fn cri_plain_pods_pass_through_and_a_bad_request_fails_the_container_with_gpushare_s_line() {
    let env = Env::new();
    let mut node = Node::start(&env);

    // No gpushare annotation under the gpushare handler: runc gets containerd's own spec.
    let plain = node.pod(&PodSpec::user("plain", 1000, &[("example.com/other", "x")]));
    let c = ContainerSpec::user("app", 1000, PRINT_PIPE);
    let id = node.run(&plain, &c);
    node.wait_output(&plain, &c, "PIPE=unset");
    let generated = Node::generated_spec(&node.cri().container_status(&id).unwrap().info);
    assert_eq!(
        node.bundle_spec(&id),
        generated,
        "the container's spec is untouched"
    );
    let generated = Node::generated_spec(&node.cri().pod_status(&plain.id).unwrap().info);
    assert_eq!(
        node.bundle_spec(&plain.id),
        generated,
        "the sandbox's spec is untouched"
    );
    assert_eq!(env.daemon_ids(), Vec::<String>::new());

    // A bad request (by env, as an engine without annotations sends it): the container's
    // create fails with gpushare's one line in the CRI error (StartContainer is where
    // containerd runs the runtime's `create`). The annotation form: in
    // cri_sandboxes_are_never_requests, where the pod's sandbox carries it too.
    let c = ContainerSpec {
        envs: &[
            ("GPUSHARE_DEVICE", "0"),
            ("GPUSHARE_ACTIVE_THREAD_PERCENTAGE", "101"),
        ],
        ..ContainerSpec::user("bad", 1000, CLIENT)
    };
    node.refuse(
        &plain,
        &c,
        "gpushare: GPUSHARE_ACTIVE_THREAD_PERCENTAGE=\"101\" is invalid: allowed is an integer from 1 to 100",
    );
    assert_eq!(
        env.daemon_ids(),
        Vec::<String>::new(),
        "no daemon is started"
    );
}

#[test]
fn cri_sandboxes_are_never_requests() {
    let env = Env::new();
    let mut node = Node::start(&env);
    let ann = [
        ("gpushare.io/device", "0"),
        ("gpushare.io/pinned-memory-limit", "2G"),
    ];
    // A pod with a pod-level user and one without (the pause then runs as 65535).
    let mut pods = Vec::new();
    for (name, user) in [("with-user", Some(1000)), ("image-user", None)] {
        pods.push(node.pod(&PodSpec {
            name,
            annotations: &ann,
            run_as_user: user,
            ..Default::default()
        }));
    }
    for pod in &pods {
        let generated = Node::generated_spec(&node.cri().pod_status(&pod.id).unwrap().info);
        assert_eq!(
            node.bundle_spec(&pod.id),
            generated,
            "sandbox {} was edited",
            pod.config.metadata.as_ref().unwrap().name
        );
    }
    assert_eq!(
        env.daemon_ids(),
        Vec::<String>::new(),
        "no sandbox is given a daemon"
    );
    assert_eq!(node.gpushare_records(), vec![], "no sandbox is recorded");

    // Their containers are requests, and only they are recorded.
    let script = hold(30);
    let c = ContainerSpec::user("cuda", 1000, &script);
    let ids: Vec<String> = pods.iter().map(|p| node.run(p, &c)).collect();
    for pod in &pods {
        assert_eq!(node.client_line(pod, &c)["server_uid"], "1000");
    }
    let mut recorded: Vec<String> = node
        .gpushare_records()
        .into_iter()
        .map(|(_, c)| c)
        .collect();
    recorded.sort();
    let mut want = ids.clone();
    want.sort();
    assert_eq!(
        recorded, want,
        "exactly the workload containers are recorded"
    );
    for pod in &pods {
        let generated = Node::generated_spec(&node.cri().pod_status(&pod.id).unwrap().info);
        assert_eq!(node.bundle_spec(&pod.id), generated);
    }

    // A bad pod annotation: the sandbox runs (it is no request), the container's create
    // fails with gpushare's one line in the CRI error, and nothing is started for it.
    let daemons = env.daemon_ids();
    let bad = node.pod(&PodSpec::user(
        "bad",
        1000,
        &[
            ("gpushare.io/device", "0"),
            ("gpushare.io/active-thread-percentage", "101"),
        ],
    ));
    node.refuse(&bad, &c, BAD_PERCENTAGE_LINE);
    assert_eq!(env.daemon_ids(), daemons, "nor for its sandbox");
}

/// Every file and directory under `root`: its path, mode and content's SHA-256 (None: a
/// directory).
fn host_tree(root: &Path) -> std::collections::BTreeMap<String, (u32, Option<String>)> {
    use std::os::unix::fs::PermissionsExt;
    let mut tree = std::collections::BTreeMap::new();
    let mut dirs = vec![root.to_owned()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            let meta = std::fs::symlink_metadata(&p).unwrap();
            let content = if meta.is_dir() {
                dirs.push(p.clone());
                None
            } else {
                use sha2::Digest;
                Some(hex(&sha2::Sha256::digest(std::fs::read(&p).unwrap())))
            };
            let name = p.strip_prefix(root).unwrap().display().to_string();
            tree.insert(name, (meta.permissions().mode(), content));
        }
    }
    tree
}

/// The runtime.toml of deploy/node-installer.yaml's ConfigMap, as the DaemonSet's pod
/// sees it, written to `path`.
fn configmap_runtime_toml(path: &Path) {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(repo.join("deploy/node-installer.yaml")).unwrap();
    let docs = yaml_rust2::YamlLoader::load_from_str(&text).unwrap();
    let cm = docs
        .iter()
        .find(|d| d["kind"].as_str() == Some("ConfigMap"))
        .expect("the ConfigMap");
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, cm["data"]["runtime.toml"].as_str().unwrap()).unwrap();
}

/// deploy/node-installer.sh as the DaemonSet's pod runs it, on the fake host root `host`
/// (the host's mount namespace `host_pid`), from the image's files in `image` and the
/// ConfigMap's runtime.toml at `source`, gpushare's state and log this env's (a pod has
/// its own /var/log); the caller adds the action's flags and env.
fn node_installer(env: &Env, host: &Path, image: &Path, source: &Path, host_pid: u32) -> Command {
    let mut cmd = Command::new("sh");
    cmd.arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/node-installer.sh"))
        .env("HOST_ROOT", host)
        .env("SOURCE_DIR", image)
        .env("GPUSHARE_CONFIG_SOURCE", source)
        .env("HOST_PID", host_pid.to_string())
        .env("GPUSHARE_CONFIG", &env.config)
        .stdin(Stdio::null());
    cmd
}

/// deploy/node-installer.sh's install as the DaemonSet's pod runs it (no `--once`, AGENT
/// and WATCH as they default, the host's mount namespace `host_pid`), its output going to
/// `dir`'s pod.out (`pod_output`).
fn spawn_pod(
    env: &Env,
    dir: &Path,
    host: &Path,
    image: &Path,
    source: &Path,
    host_pid: u32,
) -> std::process::Child {
    let out = std::fs::File::create(dir.join("pod.out")).unwrap();
    node_installer(env, host, image, source, host_pid)
        .env("RESTART_MODE", "none")
        .env("READY_FILE", dir.join("ready"))
        .stdout(out.try_clone().unwrap())
        .stderr(out)
        .spawn()
        .unwrap()
}

fn pod_output(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("pod.out")).unwrap_or_default()
}

/// `spawn_pod` until it is Ready with its agent and watcher running in the host's mount
/// namespace (the watcher has written `watch.json`; no NVML here, which it reports and
/// runs on); then the pod's SIGTERM: the script exits and neither process is left. Its
/// success and output.
fn pod_run(
    env: &Env,
    dir: &Path,
    host: &Path,
    image: &Path,
    source: &Path,
    host_pid: u32,
) -> (bool, String) {
    let ready = dir.join("ready");
    let _ = std::fs::remove_file(env.state.join("watch.json"));
    let mut child = spawn_pod(env, dir, host, image, source, host_pid);
    // The script's children, by what they run once nsenter has exec'd gpushare.
    let script = child.id() as i32;
    let running = |what: &str| -> Option<i32> {
        std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
            let pid: i32 = e.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
            let ppid: i32 = stat.rsplit_once(") ")?.1.split(' ').nth(1)?.parse().ok()?;
            let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
            let want = format!("/usr/local/bin/gpushare\0{what}\0");
            (ppid == script && cmdline == want.as_bytes()).then_some(pid)
        })
    };
    let mut pids = None;
    let up = wait_until(Duration::from_secs(20), || {
        pids = running("agent").zip(running("watch"));
        ready.exists() && pids.is_some() && env.state.join("watch.json").exists()
    });
    let (agent, watch) = pids.unwrap_or_default();
    let left = |pid: i32| pid > 0 && alive(pid);
    if !up {
        stop_child(&mut child, Duration::from_secs(5));
        for pid in [agent, watch] {
            if left(pid) {
                stop_process(pid, None);
            }
        }
        panic!(
            "the pod is not Ready with its agent and watcher running:\n{}",
            pod_output(dir)
        );
    }
    let _ = std::fs::remove_file(&ready);
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(script),
        nix::sys::signal::Signal::SIGTERM,
    );
    let exited = wait_until(Duration::from_secs(5), || {
        matches!(child.try_wait(), Ok(Some(_)))
    });
    let stayed: Vec<i32> = [agent, watch]
        .into_iter()
        .filter(|&p| !wait_until(Duration::from_secs(2), || !left(p)))
        .collect();
    for &pid in &stayed {
        stop_process(pid, None);
    }
    if !exited {
        stop_child(&mut child, Duration::from_secs(5));
    }
    let out = pod_output(dir);
    assert!(exited, "the pod's SIGTERM ended the script:\n{out}");
    assert!(
        stayed.is_empty(),
        "the pod's SIGTERM left gpushare running (agent {agent}, watch {watch}): {stayed:?}\n{out}"
    );
    let success = child.wait().is_ok_and(|s| s.success());
    (success, out)
}

/// deploy/node-installer.sh, as the DaemonSet runs it, against a fake host root whose
/// containerd is this test's, through install, install again, upgrade and uninstall.
/// Install: the binaries land in the host's /usr/local/bin and the ConfigMap's
/// runtime.toml in /etc/gpushare, the host's config.toml gets the runtime, containerd is
/// restarted and then serves the `gpushare` handler through the installed shim. Again, as
/// the pod runs it: nothing is copied, containerd is not restarted, the agent and the GPU
/// process watcher run in the host's mount namespace and the pod's SIGTERM leaves neither
/// running; where a host service already runs the watcher, the pod stops its agent and
/// exits 1. Upgrade (a new binary and config):
/// those two are copied, containerd is not restarted. Uninstall: containerd's config is
/// put back byte for byte and containerd restarted; while a pod's daemon is in use the
/// binaries stay and the run fails; once the pod is gone, the idle daemon is stopped and
/// the host's tree is exactly what it was before the install.
#[test]
fn node_installer_installs_upgrades_and_uninstalls_against_the_host_s_containerd() {
    let env = Env::new();
    let dir = env.path().join("n");
    let host = dir.join("host");
    let host_bin = host.join("usr/local/bin");
    std::fs::create_dir_all(&host_bin).unwrap();
    std::fs::write(host_bin.join("someone-else-s"), "#!/bin/sh\n").unwrap();
    std::fs::create_dir_all(host.join("etc/containerd")).unwrap();
    let config = host.join("etc/containerd/config.toml");
    // A node whose CRI runtimes are containerd's built-in ones (no runtimes table).
    let runc = r#"    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
"#;
    let host_config = base_config(&dir);
    assert!(host_config.contains(runc));
    std::fs::write(&config, host_config.replace(runc, "")).unwrap();
    let original = std::fs::read(&config).unwrap();
    let host_before = host_tree(&host);
    // The image's /opt/gpushare (the binaries under test) and the ConfigMap's mount.
    let image = dir.join("image");
    std::fs::create_dir_all(&image).unwrap();
    for (from, name) in [(gpushare(), "gpushare"), (runtime(), "gpushare-runtime")] {
        std::fs::copy(from, image.join(name)).unwrap();
    }
    let source = dir.join("configmap/runtime.toml");
    configmap_runtime_toml(&source);
    // containerd sees the fake host's /usr/local/bin at /usr/local/bin (in its namespace
    // only), as the real host sees what the installer copied there.
    let bin = host_bin.display().to_string();
    let mut node = Node::start_with(
        &env,
        dir.clone(),
        config.clone(),
        &[&["mount", "--bind", &bin, "/usr/local/bin"]],
    );
    node.import_images();
    let spec = PodSpec::user("before", 1000, &[("gpushare.io/device", "0")]);
    let err = node.try_pod(&spec).expect_err("no gpushare runtime yet");
    assert!(
        err.message
            .contains("no runtime for \"gpushare\" is configured"),
        "{err}"
    );

    // The host's mount namespace is the node's (its holder outlives containerd).
    let host_pid = node.ns().holder_pid();
    let installer = |action: &str, containerd: u32| {
        let out = node_installer(&env, &host, &image, &source, host_pid)
            .arg("--once")
            .env("GPUSHARE_NODE_ACTION", action)
            .env("RESTART_MODE", "signal")
            .env("CONTAINERD_PID", containerd.to_string())
            .output()
            .unwrap();
        (out.status.success(), text(&out))
    };
    // The service manager: containerd starts again when the installer has stopped it.
    let run = |node: &mut Node, action: &str| {
        let (ok, s) = installer(action, node.pid());
        if s.contains("SIGTERM to pid") {
            let exit = node.wait_exit(Duration::from_secs(10));
            assert!(
                exit.success(),
                "containerd shut down cleanly on SIGTERM: {exit:?}"
            );
            node.restart();
        }
        (ok, s)
    };
    // Should the uninstall take the binaries away under a running pod, they come back for
    // its removal (its shim runs gpushare-runtime to stop it); dropped before `node`.
    struct Binaries<'a>(&'a Path, &'a Path);
    impl Drop for Binaries<'_> {
        fn drop(&mut self) {
            for name in ["gpushare", "gpushare-runtime"] {
                if !self.1.join(name).exists() {
                    let _ = std::fs::copy(self.0.join(name), self.1.join(name));
                }
            }
        }
    }
    let _binaries = Binaries(&image, &host_bin);
    let installed = |name: &str| host.join(name.trim_start_matches('/'));
    let inode = |p: &Path| {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(p).unwrap().ino()
    };

    // Install.
    let (ok, s) = run(&mut node, "install");
    assert!(ok, "{s}");
    assert!(s.contains("SIGTERM to pid"), "{s}");
    assert!(
        !s.contains("does not exist"),
        "the container-view warning is dropped: {s}"
    );
    for name in ["gpushare", "gpushare-runtime"] {
        let p = host_bin.join(name);
        assert_eq!(
            std::fs::read(&p).unwrap(),
            std::fs::read(image.join(name)).unwrap()
        );
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            std::fs::metadata(&p).unwrap().permissions().mode() & 0o7777,
            0o755
        );
    }
    assert_eq!(
        std::fs::read(installed("/etc/gpushare/runtime.toml")).unwrap(),
        std::fs::read(&source).unwrap(),
        "the ConfigMap's runtime.toml"
    );
    let after = std::fs::read_to_string(&config).unwrap();
    let mut rest = after.lines();
    for line in String::from_utf8(original.clone()).unwrap().lines() {
        assert!(
            rest.any(|l| l == line),
            "line {line:?} of the host's config was lost:\n{after}"
        );
    }
    let v: toml::Table = toml::from_str(&after).unwrap();
    assert_eq!(
        v["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["gpushare"]["options"]
            ["BinaryName"]
            .as_str(),
        Some("/usr/local/bin/gpushare-runtime"),
        "the host's path, not the pod's view of it"
    );

    // containerd, started again, runs pods of the handler through the installed shim (its
    // hooks are the gpushare beside it).
    let pod = node.pod(&PodSpec {
        name: "after",
        ..spec.clone()
    });
    let script = hold(120);
    let c = ContainerSpec::user("cuda", 1000, &script);
    let id = node.run(&pod, &c);
    assert_eq!(node.client_line(&pod, &c)["server_uid"], "1000");
    assert_eq!(
        node.bundle_spec(&id)["hooks"]["createRuntime"][0]["path"],
        "/usr/local/bin/gpushare"
    );
    let daemons = env.daemon_ids();
    assert_eq!(daemons.len(), 1, "{daemons:?}");

    // Again (a restarted pod, as the DaemonSet runs it, without --once): nothing is
    // copied, containerd keeps running; the pod runs the agent and the watcher in the
    // host's mount namespace, and its SIGTERM leaves neither running.
    let inodes: Vec<u64> = ["gpushare", "gpushare-runtime"]
        .iter()
        .map(|n| inode(&host_bin.join(n)))
        .collect();
    let config_inode = inode(&installed("/etc/gpushare/runtime.toml"));
    let (ok, s) = pod_run(&env, &dir, &host, &image, &source, host_pid);
    assert!(ok, "{s}");
    assert!(!s.contains("SIGTERM to pid"), "{s}");
    assert_eq!(s.matches("is up to date").count(), 3, "{s}");
    assert!(s.contains("containerd is not restarted"), "{s}");
    assert_eq!(std::fs::read_to_string(&config).unwrap(), after);
    assert!(node.cri().version().is_ok(), "containerd still serves");
    for (n, was) in ["gpushare", "gpushare-runtime"].iter().zip(&inodes) {
        assert_eq!(inode(&host_bin.join(n)), *was, "{n} was not copied again");
    }
    assert_eq!(
        inode(&installed("/etc/gpushare/runtime.toml")),
        config_inode
    );
    // WATCH=run where a host service runs the watcher: the pod's watcher refuses to start,
    // and the script stops the agent and exits with that status (the kubelet restarts the
    // pod and counts it).
    let mut host_watch = env.spawn_gpushare(&["watch"]);
    let _ = std::fs::remove_file(env.state.join("watch.json"));
    let watching = wait_until(Duration::from_secs(10), || {
        env.state.join("watch.json").exists()
    });
    let mut second = spawn_pod(&env, &dir, &host, &image, &source, host_pid);
    let exited = wait_until(Duration::from_secs(20), || {
        matches!(second.try_wait(), Ok(Some(_)))
    });
    if !exited {
        stop_child(&mut second, Duration::from_secs(5));
    }
    stop_child(&mut host_watch, Duration::from_secs(5));
    let status = second.wait().unwrap();
    let s = pod_output(&dir);
    assert!(watching, "the host's watcher runs");
    assert!(exited && status.code() == Some(1), "{status:?}: {s}");
    assert!(s.contains("another gpushare watch serves"), "{s}");
    let agent_lock = std::fs::File::open(env.state.join("locks/agent.lock")).unwrap();
    assert!(
        nix::fcntl::Flock::lock(agent_lock, nix::fcntl::FlockArg::LockExclusiveNonblock).is_ok(),
        "no agent is left: {s}"
    );

    // Upgrade: a new image's shim and a changed ConfigMap are copied; the rest stays.
    let old_shim = std::fs::read(image.join("gpushare-runtime")).unwrap();
    let old_cm = std::fs::read(&source).unwrap();
    let mut shim = old_shim.clone();
    shim.extend_from_slice(b"\0a rebuilt shim");
    std::fs::write(image.join("gpushare-runtime"), &shim).unwrap();
    let mut cm = std::fs::read(&source).unwrap();
    cm.extend_from_slice(b"log-level = \"debug\"\n");
    std::fs::write(&source, &cm).unwrap();
    let (ok, s) = run(&mut node, "install");
    assert!(ok, "{s}");
    assert!(
        s.contains("installed /usr/local/bin/gpushare-runtime")
            && s.contains("installed /etc/gpushare/runtime.toml")
            && s.contains("/usr/local/bin/gpushare is up to date"),
        "{s}"
    );
    assert!(s.contains("containerd is not restarted"), "{s}");
    assert_eq!(
        std::fs::read(host_bin.join("gpushare-runtime")).unwrap(),
        shim
    );
    assert_eq!(
        std::fs::read(installed("/etc/gpushare/runtime.toml")).unwrap(),
        cm
    );
    assert_eq!(inode(&host_bin.join("gpushare")), inodes[0]);

    // Rollback (`kubectl rollout undo`: the previous image and ConfigMap run the same
    // install): the old shim and config are copied back, containerd's config stays.
    std::fs::write(image.join("gpushare-runtime"), &old_shim).unwrap();
    std::fs::write(&source, &old_cm).unwrap();
    let (ok, s) = run(&mut node, "install");
    assert!(ok, "{s}");
    assert!(
        s.contains("installed /usr/local/bin/gpushare-runtime")
            && s.contains("installed /etc/gpushare/runtime.toml"),
        "{s}"
    );
    assert_eq!(
        std::fs::read(host_bin.join("gpushare-runtime")).unwrap(),
        old_shim
    );
    assert_eq!(
        std::fs::read(installed("/etc/gpushare/runtime.toml")).unwrap(),
        old_cm
    );
    assert_eq!(std::fs::read_to_string(&config).unwrap(), after);

    // Uninstall while the pod runs: containerd's config is put back and containerd
    // restarted; the daemon is in use, so the binaries stay and the run fails.
    let (ok, s) = run(&mut node, "uninstall");
    assert!(!ok, "{s}");
    assert!(s.contains("restored /etc/containerd/config.toml"), "{s}");
    assert!(s.contains("SIGTERM to pid"), "{s}");
    assert!(s.contains("MPS daemons are still in use"), "{s}");
    assert_eq!(std::fs::read(&config).unwrap(), original, "byte for byte");
    assert!(host_bin.join("gpushare-runtime").exists());
    assert!(host_bin.join("gpushare").exists());
    assert_eq!(env.daemon_ids(), daemons);

    // The pod goes (its shim still runs the installed gpushare-runtime); the daemon stays
    // until its idle-timeout, and the next run of the uninstall stops it.
    node.cri().stop_container(&id, 0).unwrap();
    node.cri().remove_container(&id).unwrap();
    node.cri().stop_pod(&pod.id).unwrap();
    node.cri().remove_pod(&pod.id).unwrap();
    assert_eq!(env.daemon_ids(), daemons, "an idle daemon");
    let (ok, s) = run(&mut node, "uninstall");
    assert!(ok, "{s}");
    assert!(s.contains(&format!("stopped daemon {}", daemons[0])), "{s}");
    assert!(s.contains("containerd is not restarted"), "{s}");
    assert!(node.cri().version().is_ok(), "containerd still serves");
    assert_eq!(env.daemon_ids(), Vec::<String>::new());
    assert_eq!(std::fs::read(&config).unwrap(), original, "byte for byte");
    assert_eq!(host_tree(&host), host_before, "the host as it was");
    // Nothing is left to undo.
    let (ok, s) = run(&mut node, "uninstall");
    assert!(ok && s.contains("nothing to undo"), "{s}");

    // A node without a containerd config at all (containerd on its built-in defaults) and
    // no directories of its own: install writes the config with containerd's runc kept,
    // and uninstall takes away every file and directory it made.
    let bare = dir.join("bare-host");
    std::fs::create_dir_all(&bare).unwrap();
    std::fs::create_dir_all(dir.join("empty")).unwrap();
    // Its host namespace: /usr/local/bin leads to the bare host's, made by the install.
    let bare_ns = PrivateMounts::with(&format!(
        "mount -t tmpfs gs-bare /usr/local\nln -s '{}/usr/local/bin' /usr/local/bin",
        bare.display()
    ));
    let bare_run = |action: &str| {
        let out = node_installer(&env, &bare, &image, &source, bare_ns.holder_pid())
            .arg("--once")
            .env("GPUSHARE_NODE_ACTION", action)
            .env("RESTART_MODE", "none")
            .output()
            .unwrap();
        (out.status.success(), text(&out))
    };
    // A host that cannot run the copied gpushare (here: it does not see it; an old glibc
    // alike): the runtime is not registered, nor containerd's config written.
    let blind_ns = PrivateMounts::with("mount -t tmpfs gs-blind /usr/local");
    let blind = node_installer(&env, &bare, &image, &source, blind_ns.holder_pid())
        .arg("--once")
        .env("RESTART_MODE", "none")
        .output()
        .unwrap();
    assert!(
        !blind.status.success() && text(&blind).contains("does not run on this node"),
        "{}",
        text(&blind)
    );
    assert!(!bare.join("etc/containerd").exists());
    drop(blind_ns);
    let (ok, s) = bare_run("install");
    assert!(ok && s.contains("restart containerd on this node"), "{s}");
    let v: toml::Table =
        toml::from_str(&std::fs::read_to_string(bare.join("etc/containerd/config.toml")).unwrap())
            .unwrap();
    let runtimes = &v["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"];
    assert!(
        runtimes.get("runc").is_some() && runtimes.get("gpushare").is_some(),
        "{v}"
    );
    assert!(bare.join("usr/local/bin/gpushare-runtime").is_file());
    // Someone else edits containerd's config after the install: uninstall does not
    // undo their edit by putting the file back; it takes out only gpushare's runtime (with
    // `gpushare uninstall containerd`, while the binary is there) and keeps the rest.
    let bare_config = bare.join("etc/containerd/config.toml");
    let mut edited = std::fs::read(&bare_config).unwrap();
    edited.extend_from_slice(b"# another installer's edit\n");
    std::fs::write(&bare_config, &edited).unwrap();
    let (ok, s) = bare_run("uninstall");
    assert!(
        ok && s.contains("only the gpushare runtime was taken out of it"),
        "{s}"
    );
    let left = std::fs::read_to_string(&bare_config).unwrap();
    let v: toml::Table = toml::from_str(&left).unwrap();
    let runtimes = &v["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"];
    assert!(
        runtimes.get("gpushare").is_none() && runtimes.get("runc").is_some(),
        "{left}"
    );
    assert!(left.contains("# another installer's edit"), "{left}");
    let mut expected = host_tree(&dir.join("empty"));
    for d in ["etc", "etc/containerd"] {
        expected.insert(d.into(), host_tree(&bare)[d].clone());
    }
    expected.insert(
        "etc/containerd/config.toml".into(),
        host_tree(&bare)["etc/containerd/config.toml"].clone(),
    );
    assert_eq!(
        host_tree(&bare),
        expected,
        "only the edited config is left, as the node's own"
    );
}

/// A node whose containerd runs on the CRI plugin's built-in defaults (no CRI table in its
/// config, or no config file at all): `gpushare install containerd` must leave its CRI
/// plugin loading. A runtimes table with `gpushare` only would replace containerd's
/// built-in one, `runc` (default_runtime_name) would be gone and the CRI plugin would
/// refuse to load ("no corresponding runtime configured in `containerd.runtimes` for
/// `containerd` `default_runtime_name = \"runc\"`"): every pod of the node would fail.
#[test]
fn cri_install_on_a_config_without_cri_tables_keeps_the_plugin_loading() {
    let env = Env::new();
    let dir = env.path().join("d");
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("config.toml");
    std::fs::write(&config, daemon_config(&dir)).unwrap();
    install_shim(&env, &config);
    // Panics unless containerd's CRI plugin loads and answers.
    let _node = Node::start_with(&env, dir, config, &[]);
}

/// Through CRI: on a node whose config says `default-device =
/// "allocated"`, a pod without gpushare annotations is served the GPU NVIDIA's device
/// plugin allocated to it — here as the plugin's volume-mounts strategy has the kubelet
/// write it, `/dev/null` mounted at `/var/run/nvidia-container-devices/<uuid>` — with the
/// pod's limit annotations; a container without an allocation, in the same pod, passes
/// through untouched. And the security issue's item 3: what the pod's author writes — its
/// env's `NVIDIA_VISIBLE_DEVICES`, an `emptyDir` where the plugin's mounts go — neither
/// makes an allocation nor moves one.
#[test]
fn cri_an_allocation_by_nvidia_s_device_plugin_is_served_on_a_node_that_defaults_to_it() {
    let env = Env::with_configs("default-device = \"allocated\"\n", "");
    let mut node = Node::start(&env);
    let pod = node.pod(&PodSpec::user(
        "allocated",
        1000,
        &[("gpushare.io/active-thread-percentage", "25")],
    ));
    let allocated = format!("/var/run/nvidia-container-devices/{GPU2}");
    let forged = format!("/var/run/nvidia-container-devices/{GPU0}");
    let empty_dir = node.dir.join("empty-dir");
    std::fs::create_dir_all(&empty_dir).unwrap();
    let empty_dir = empty_dir.display().to_string();
    let c = ContainerSpec {
        name: "cuda",
        script: &hold(30),
        run_as_user: Some(1000),
        // The plugin's env, then the pod's own naming GPU 0, which replaces it; and the
        // pod's emptyDir naming GPU 0 too.
        envs: &[
            (
                "NVIDIA_VISIBLE_DEVICES",
                "/var/run/nvidia-container-devices",
            ),
            ("NVIDIA_VISIBLE_DEVICES", GPU0),
        ],
        mounts: &[("/dev/null", &allocated), (&empty_dir, &forged)],
        ..Default::default()
    };
    let id = node.run(&pod, &c);
    let l = node.client_line(&pod, &c);
    assert_eq!(
        (
            l["server_uid"].as_str(),
            l["active_thread_percentage"].as_str()
        ),
        ("1000", "25.0"),
        "{l:?}"
    );
    let daemon = node.daemon_of(&id).expect("the container is attached");
    assert_eq!(
        env.record(&daemon)["identity"]["devices"],
        serde_json::json!([GPU2]),
        "the allocated GPU, not GPU 0"
    );
    let generated = Node::generated_spec(&node.cri().pod_status(&pod.id).unwrap().info);
    assert_eq!(
        node.bundle_spec(&pod.id),
        generated,
        "the sandbox is untouched"
    );

    // No allocation: no request, whatever the node's default, and whatever the pod's
    // author forged (GPU 0 by env, by emptyDir).
    for (name, envs, mounts) in [
        ("sidecar", &[][..], &[][..]),
        (
            "forged-env",
            &[("NVIDIA_VISIBLE_DEVICES", GPU0)][..],
            &[][..],
        ),
        (
            "forged-volume",
            &[][..],
            &[(empty_dir.as_str(), forged.as_str())][..],
        ),
    ] {
        let plain = ContainerSpec {
            name,
            script: PRINT_PIPE,
            run_as_user: Some(1000),
            envs,
            mounts,
            ..Default::default()
        };
        let plain_id = node.run(&pod, &plain);
        node.wait_output(&pod, &plain, "PIPE=unset");
        let generated = Node::generated_spec(&node.cri().container_status(&plain_id).unwrap().info);
        assert_eq!(node.bundle_spec(&plain_id), generated, "{name}");
    }
    assert_eq!(env.daemon_ids(), vec![daemon]);
}

/// The security issue's item 7 through CRI: on a node with `mps.allow-ipc-override =
/// true`, a pod that did not ask for `hostIPC` (its containers join the sandbox's IPC
/// namespace by path) and asks `gpushare.io/ipc: host` fails with gpushare's line and no
/// daemon; a `hostIPC: true` pod may ask.
#[test]
fn cri_a_pod_without_host_ipc_never_gets_it_by_annotation() {
    let env = Env::with_config("allow-ipc-override = true");
    let mut node = Node::start(&env);
    let ann = [("gpushare.io/device", "0"), ("gpushare.io/ipc", "host")];
    let script = hold(30);
    let c = ContainerSpec::user("cuda", 1000, &script);
    let pod = node.pod(&PodSpec::user("own-ipc", 1000, &ann));
    node.refuse(
        &pod,
        &c,
        "gpushare: gpushare.io/ipc=\"host\" is refused: the container's pod has an IPC namespace of its own (linux.namespaces joins \"/proc/",
    );
    let host_pod = node.pod(&PodSpec {
        host_ipc: true,
        ..PodSpec::user("host-ipc", 1000, &ann)
    });
    let id = node.run(&host_pod, &c);
    assert_eq!(
        node.bundle_spec(&id)["annotations"]["gpushare.io/ipc-mode"],
        "host"
    );
    assert_eq!(node.client_line(&host_pod, &c)["server_uid"], "1000");
}

/// containerd without the shim. A runtime class whose `base_runtime_spec`
/// (containerd's own default spec plus gpushare's hook-only `prestart`/`poststop` hooks,
/// as `gpushare install containerd --hook-only` writes them) runs plain runc: the hook resolves the request itself and binds the daemon's pipe
/// directory at CUDA's default path and its shm over /dev/shm, as under Podman's hooks.d.
/// A pod without a request on that class runs with the hook doing nothing.
#[test]
fn cri_base_runtime_spec_serves_a_pod_in_hook_only_mode_without_the_shim() {
    let env = Env::new();
    let mut node = Node::installed(&env, &|config| {
        let base = install_hook_only(&env, config, HANDLER);
        assert_eq!(
            base["hooks"]["prestart"][0]["env"][1],
            format!("GPUSHARE_CONFIG={}", env.config.display()),
            "the hooks read the installer's config"
        );
    });

    let pod = node.pod(&PodSpec::user(
        "hookonly",
        1000,
        &[("gpushare.io/device", "0")],
    ));
    let script = format!(
        "echo PIPE=${{CUDA_MPS_PIPE_DIRECTORY:-unset}}; ls /tmp/nvidia-mps; {CLIENT}; exec sleep 3600"
    );
    let c = ContainerSpec::user("work", 1000, &script);
    let id = node.run(&pod, &c);
    let line = node.client_line(&pod, &c);
    assert_eq!(
        (
            line["uid"].as_str(),
            line["server_uid"].as_str(),
            line["shm"].as_str()
        ),
        ("1000", "1000", "ok"),
        "{line:?}"
    );
    let out = node.output(&pod, &c);
    assert!(out.contains("PIPE=unset"), "no env from a shim:\n{out}");
    assert!(
        out.lines().any(|l| l == "control"),
        "the pipe dir is at CUDA's default path:\n{out}"
    );
    // runc got containerd's spec with our hooks and no decision: no shim ran.
    let spec = node.bundle_spec(&id);
    assert!(
        spec["annotations"].get("gpushare.io/daemon").is_none(),
        "{}",
        spec["annotations"]
    );
    assert_eq!(spec["hooks"]["prestart"][0]["path"], gpushare());
    let ids = env.daemon_ids();
    assert_eq!(ids.len(), 1, "{ids:?}");
    assert_eq!(env.record(&ids[0])["identity"]["uid"], 1000);
    assert_eq!(
        node.daemon_of(&id).as_deref(),
        Some(ids[0].as_str()),
        "the container is recorded on its daemon"
    );

    // A pod without a request on the same class: the hook runs and does nothing.
    let plain = node.pod(&PodSpec::user("plain", 2000, &[]));
    let c = ContainerSpec::user("app", 2000, "echo PIPE=${CUDA_MPS_PIPE_DIRECTORY:-unset} LS=$(ls /tmp/nvidia-mps 2>/dev/null)END; exec sleep 3600");
    node.run(&plain, &c);
    node.wait_output(&plain, &c, "END");
    assert!(
        node.output(&plain, &c).contains("PIPE=unset LS=END"),
        "no pipe directory in a pod without a request:\n{}",
        node.output(&plain, &c)
    );
    assert_eq!(env.daemon_ids(), ids, "no daemon for the plain pod");

    // A bad request fails the container in its prestart hook, with gpushare's line.
    let bad = node.pod(&PodSpec::user(
        "bad",
        3000,
        &[
            ("gpushare.io/device", "0"),
            ("gpushare.io/active-thread-percentage", "101"),
        ],
    ));
    let c = ContainerSpec::user("bad", 3000, CLIENT);
    node.refuse(&bad, &c, BAD_PERCENTAGE_LINE);
    assert_eq!(env.daemon_ids(), ids, "no daemon for the bad request");
}

/// A pod start as the kubelet issues it (RunPodSandbox, CreateContainer,
/// StartContainer of a container running `true`), timed from the CRI client, on one
/// containerd with three runtime classes: `runc`, `gpushare` (the shim, as `gpushare
/// install containerd` registers it) and `gpushare-hooks` (`--hook-only`: runc with the
/// hook-only `base_runtime_spec`, no shim); each without a request and with one (the pod annotated
/// `gpushare.io/device=0`, UID 1000, its daemon warm after the first round). The six
/// variants rotate per round after a 100 ms idle pause; the pod is removed untimed. A
/// measurement, not a check (it asserts only that every start succeeds): run it on a quiet
/// machine against release binaries, as BENCHMARKS.md says:
/// `cargo build --release && cargo test --release --test integration cri_pod_start_bench
/// -- --ignored --nocapture` (GPUSHARE_BENCH_ROUNDS, default 15).
#[test]
#[ignore = "a benchmark: run it by name on a quiet machine (BENCHMARKS.md)"]
fn cri_pod_start_bench() {
    let env = Env::new();
    podbench::at_info_level(&env);
    let mut node = Node::installed(&env, &|config| {
        install_shim(&env, config);
        install_hook_only(&env, config, "gpushare-hooks");
    });

    let variants = [
        ("runc", "runc", false),
        ("gpushare shim", HANDLER, false),
        ("gpushare hooks", "gpushare-hooks", false),
        ("runc, annotated", "runc", true),
        ("gpushare shim, request", HANDLER, true),
        ("gpushare hooks, request", "gpushare-hooks", true),
    ];
    let rounds = podbench::rounds();
    let ms = podbench::rotated(variants.len(), rounds, |r, i| {
        let (_, handler, request) = variants[i];
        let (elapsed, pod, _) = podbench::start(&mut node, &format!("b{r}v{i}"), handler, request);
        podbench::remove(&node, &pod);
        elapsed
    });
    let labels: Vec<&str> = variants.iter().map(|v| v.0).collect();
    podbench::report(
        &format!(
            "CRI pod start (RunPodSandbox + CreateContainer + StartContainer), {rounds} rounds"
        ),
        &labels,
        &ms,
        |i| if variants[i].2 { 3 } else { 0 },
    );
    assert_eq!(env.daemon_ids().len(), 1, "one daemon served every request");
}

/// Parts failing under live jobs, the CRI path: containerd (and so its CRI plugin) restarted while a pod's
/// container holds an MPS client. The container keeps running (its shim is not
/// containerd's child), its daemon keeps the same supervisor and daemon processes, and the
/// next pod of the same user is served by that daemon; `status` reports it healthy.
#[test]
fn cri_a_containerd_restart_keeps_a_pod_s_job_and_its_daemon() {
    let env = Env::new();
    let mut node = Node::start(&env);
    let ann = [("gpushare.io/device", "0")];
    let script = hold(120);
    let held = node.user_pod(EntryPath::RuntimeClass, "held", 1000, &ann, &script);
    assert_eq!(held.line["server_uid"], "1000");
    let held = held.id;
    let ids = env.daemon_ids();
    assert_eq!(ids.len(), 1, "{ids:?}");
    let id = ids[0].clone();
    let pid_of = |key: &str| env.record(&id)[key]["pid"].as_i64().expect("pid in record");
    let (sup, daemon) = (pid_of("supervisor"), pid_of("daemon"));

    node.stop();
    node.restart();

    node.wait_state(&held, 1); // CONTAINER_RUNNING: the job lives on
    assert!(
        alive(sup as i32) && alive(daemon as i32),
        "the daemon survived the engine"
    );
    assert_eq!((pid_of("supervisor"), pid_of("daemon")), (sup, daemon));
    assert_eq!(env.record(&id)["restarts"], 0, "{}", env.record(&id));
    let script = hold(0);
    let next = node.user_pod(EntryPath::RuntimeClass, "next", 1000, &ann, &script);
    assert_eq!(next.line["shm"], "ok");
    let next_id = next.id;
    assert_eq!(env.daemon_ids(), vec![id.clone()], "the same daemon");
    assert_eq!(node.daemon_of(&next_id).as_deref(), Some(id.as_str()));
    let ours = env.status_of(&id);
    assert_eq!(ours["health"], "ok", "status after the restart: {ours}");
    assert!(
        node.status_containers()
            .get(&id)
            .is_some_and(|cs| cs.contains(&held)),
        "the held container is still listed: {ours}"
    );
}

/// A pod's forged decision annotation in the hook-only class. `gpushare.io/daemon` is
/// what gpushare-runtime writes for its own hook; the hook-only prestart used to take it
/// as "prepared by the shim" and skip the container: no daemon, no node default limit, no
/// validation (`active-thread-percentage: "101"` ran). Two classes: `gpushare-hooks` as
/// `gpushare install containerd --hook-only` writes it now (the allowlist names only the
/// request keys, so containerd drops the forged annotation), and `gpushare-old` with the
/// `gpushare.io/*` allowlist an older install wrote (the annotation reaches the spec, and
/// the prestart hook must ignore it: it decides from the spec's hooks).
#[test]
fn cri_a_forged_decision_annotation_never_makes_the_hook_only_class_skip_a_pod() {
    let env = Env::with_config("default-active-thread-percentage = 25");
    let mut node = Node::installed(&env, &|config| {
        install_hook_only(&env, config, "gpushare-hooks");
        install_hook_only(&env, config, "gpushare-old");
        let toml = std::fs::read_to_string(config).unwrap();
        let keys = &pod_annotations_line();
        assert_eq!(toml.matches(keys).count(), 2, "{toml}");
        let old = toml
            .replacen(keys, r#"pod_annotations = ["gpushare.io/*"]"#, 2)
            .replacen(r#"pod_annotations = ["gpushare.io/*"]"#, keys, 1);
        assert!(old.contains("gpushare.io/*"), "{old}");
        std::fs::write(config, old).unwrap();
    });

    let forged = "0".repeat(32);
    for (n, handler) in ["gpushare-hooks", "gpushare-old"].into_iter().enumerate() {
        let uid = 1000 + n as u32;
        let mut pod = |name: &str, extra: &[(&str, &str)]| {
            let mut annotations = vec![
                ("gpushare.io/device", "0"),
                ("gpushare.io/daemon", forged.as_str()),
            ];
            annotations.extend_from_slice(extra);
            let config = node.pod_config(&PodSpec {
                name: &format!("{name}-{n}"),
                annotations: &annotations,
                run_as_user: Some(i64::from(uid)),
                host_ipc: false,
                userns: None,
                namespace: "",
            });
            (config, handler)
        };
        let bad = pod(
            "forged-bad",
            &[("gpushare.io/active-thread-percentage", "101")],
        );
        let good = pod("forged", &[]);
        let start = |(config, handler): (PodSandboxConfig, &str)| Pod {
            id: node.cri().run_pod(&config, handler).unwrap(),
            config,
        };
        // A bad request with the forged decision: still validated and refused.
        let c = ContainerSpec::user("bad", i64::from(uid), CLIENT);
        node.refuse(&start(bad), &c, BAD_PERCENTAGE_LINE);

        // A request with the forged decision: served, with the node's default limit.
        let pod = start(good);
        let script = format!("{CLIENT}; exec sleep 3600");
        let c = ContainerSpec::user("work", i64::from(uid), &script);
        let cid = node.run(&pod, &c);
        let spec = node.bundle_spec(&cid);
        assert_eq!(
            spec["annotations"].get("gpushare.io/daemon").is_some(),
            handler == "gpushare-old",
            "{handler}: only the old allowlist passes the forged annotation: {}",
            spec["annotations"]
        );
        let line = node.client_line(&pod, &c);
        assert_eq!(line["server_uid"], uid.to_string(), "{handler}: {line:?}");
        assert_eq!(
            percentage(&line),
            25.0,
            "{handler}: the node's default limit: {line:?}"
        );
        let daemon = node.daemon_of(&cid).expect("the container is on a daemon");
        assert_ne!(daemon, forged);
        assert_eq!(
            env.record(&daemon)["identity"]["active_thread_percentage"],
            25
        );
    }
}

/// A `hostUsers: false` pod, on containerd 2.x: its CRI plugin gives the pause a new user
/// namespace with the pod's mappings and each container *joins it by path, with the same
/// `uidMappings`*. uid 1000 in the pod is host uid 201000: the container must be served
/// by a daemon of 201000 (one of host uid 1000 could not be used by it, and would count
/// against the real uid 1000's daemons).
#[test]
fn cri_host_users_false_pod_is_served_as_its_host_uid() {
    let env = Env::new();
    let mut node = Node::start_containerd2(&env);
    let pod = node.pod(&PodSpec {
        userns: Some((200000, 65536)),
        ..PodSpec::user("userns", 1000, &[("gpushare.io/device", "0")])
    });
    let script = hold(0);
    let c = ContainerSpec::user("cuda", 1000, &script);
    let id = node.run(&pod, &c);

    // containerd's shape, as the runtime got it: the pod's user namespace joined by
    // path, with the mappings; the process user 1000 of that namespace.
    let spec = node.bundle_spec(&id);
    let user_ns = spec["linux"]["namespaces"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["type"] == "user")
        .cloned()
        .unwrap_or_default();
    assert!(user_ns["path"].is_string(), "{}", spec["linux"]);
    assert_eq!(spec["linux"]["uidMappings"][0]["hostID"], 200000);
    assert_eq!(spec["process"]["user"]["uid"], 1000);
    assert_eq!(spec["annotations"]["gpushare.io/host-uid"], "201000");

    let line = node.client_line(&pod, &c);
    assert_eq!(line["server_uid"], "201000", "{line:?}");
    assert_eq!(line["shm"], "ok", "{line:?}");
    let daemon = node
        .daemon_of(&id)
        .expect("gpushare status lists the container");
    assert_eq!(env.record(&daemon)["identity"]["uid"], 201000);
    assert_eq!(uid_and_capeff(env.daemon_pid(&daemon)).0, 201000);
    let listed = env.status_of(&daemon);
    assert_eq!(listed["uid"], 201000, "{listed}");
}

/// `mps.tenant`, through containerd's CRI plugin with the shim's class (`gpushare`) and
/// the hook-only class (`gpushare-hooks`), both with a `pod_annotations` allowlist widened
/// to pass containerd's namespace annotation (a misconfigured node): pods of UID 0 (as
/// many images run) in
/// namespaces `team-a` and `team-b`, one of them annotated
/// `io.kubernetes.cri.sandbox-namespace: team-a`, and a container of UID 0 outside the
/// CRI (`ctr run --runc-binary gpushare-runtime` on the same containerd, in its `default`
/// namespace) annotated the same. Returns the
/// daemon of each: (team-a, team-a again, team-b, the forger in team-b, hook-only in
/// team-a, hook-only in team-b, outside the CRI).
fn pods_of_one_uid_in_two_namespaces(env: &Env) -> [String; 7] {
    const HOOKS: &str = "gpushare-hooks";
    const FORGED: (&str, &str) = ("io.kubernetes.cri.sandbox-namespace", "team-a");
    let mut node = Node::installed(env, &|config| {
        install_shim(env, config);
        install_hook_only(env, config, HOOKS);
        let toml = std::fs::read_to_string(config).unwrap();
        let keys = pod_annotations_line();
        assert_eq!(toml.matches(&keys).count(), 2, "{toml}");
        let widened = keys.replace(
            "pod_annotations = [",
            "pod_annotations = [\"io.kubernetes.cri.*\", ",
        );
        std::fs::write(config, toml.replace(&keys, &widened)).unwrap();
    });
    let mut daemon = |name: &str, namespace: &str, handler: &str, extra: &[(&str, &str)]| {
        let mut annotations = vec![("gpushare.io/device", "0")];
        annotations.extend_from_slice(extra);
        let config = node.pod_config(&PodSpec {
            namespace,
            ..PodSpec::user(name, 0, &annotations)
        });
        let pod = Pod {
            id: node
                .cri()
                .run_pod(&config, handler)
                .unwrap_or_else(|e| panic!("RunPodSandbox {name}: {e}")),
            config,
        };
        let c = ContainerSpec::user("cuda", 0, "exec sleep 3600");
        let id = node.run(&pod, &c);
        // containerd's own value, whatever the pod wrote.
        assert_eq!(
            node.bundle_spec(&id)["annotations"][FORGED.0],
            namespace,
            "{name}"
        );
        node.daemon_of(&id)
            .unwrap_or_else(|| panic!("{name} is on no daemon: {}", env.gpushare_log()))
    };
    let a = daemon("a", "team-a", HANDLER, &[]);
    let a2 = daemon("a2", "team-a", HANDLER, &[]);
    let b = daemon("b", "team-b", HANDLER, &[]);
    let forger = daemon("forger", "team-b", HANDLER, &[FORGED]);
    let hooks_a = daemon("ha", "team-a", HOOKS, &[]);
    let hooks_b = daemon("hb", "team-b", HOOKS, &[FORGED]);
    // ctr, whose caller writes every annotation, in containerd's `default` namespace.
    let ctr = |args: &[&str]| {
        node.ns()
            .cmd(node.program("ctr"))
            .arg("-a")
            .arg(&node.sock)
            .args(["-n", "default"])
            .args(args)
            .output()
            .unwrap()
    };
    struct Removed<F: Fn(&[&str]) -> std::process::Output>(F);
    impl<F: Fn(&[&str]) -> std::process::Output> Drop for Removed<F> {
        fn drop(&mut self) {
            let _ = (self.0)(&["task", "kill", "-s", "KILL", "outside"]);
            let _ = wait_until(Duration::from_secs(10), || {
                (self.0)(&["task", "rm", "outside"]).status.success()
                    || !(self.0)(&["task", "ls", "-q"])
                        .stdout
                        .starts_with(b"outside")
            });
            let _ = (self.0)(&["container", "rm", "outside"]);
        }
    }
    let _removed = Removed(ctr);
    let cgroup = format!("{}/outside", node.cgroup);
    let out = (_removed.0)(&[
        "run",
        "-d",
        "--cgroup",
        &cgroup,
        "--runc-binary",
        runtime(),
        "--annotation",
        "gpushare.io/device=0",
        "--annotation",
        &format!("{}={}", FORGED.0, FORGED.1),
        "--env",
        "PATH=/usr/bin:/bin",
        "--rootfs",
        env.rootfs.to_str().unwrap(),
        "outside",
        "sh",
        "-c",
        "exec sleep 3600",
    ]);
    assert!(out.status.success(), "ctr run: {}", text(&out));
    let spec: Value = serde_json::from_slice(
        &std::fs::read(
            node.dir
                .join("state/io.containerd.runtime.v2.task/default/outside/config.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let outside = spec["annotations"]["gpushare.io/daemon"]
        .as_str()
        .unwrap_or_else(|| panic!("ctr's container was not served: {spec}"))
        .to_owned();
    [a, a2, b, forger, hooks_a, hooks_b, outside]
}

/// `mps.tenant = "namespace"`: each namespace's pods of UID 0 get a daemon of their
/// own through the shim and through the hook-only class (the same daemon on both, as the
/// same identity); a pod that writes containerd's namespace annotation stays in its own
/// namespace (containerd writes its own after the pass-through); a container outside
/// containerd's CRI that writes it gets the "no namespace" daemon, never team-a's.
#[test]
fn cri_namespace_tenants_get_a_daemon_each_and_no_pod_picks_its_namespace() {
    let env = Env::with_config("tenant = \"namespace\"");
    let [a, a2, b, forger, hooks_a, hooks_b, outside] = pods_of_one_uid_in_two_namespaces(&env);
    assert_eq!(a, a2, "one namespace, one daemon");
    assert_ne!(a, b, "two namespaces, two daemons");
    assert_eq!(forger, b, "the forged annotation changed the pod's tenant");
    assert_eq!(
        (hooks_a.as_str(), hooks_b.as_str()),
        (a.as_str(), b.as_str())
    );
    assert!(
        outside != a && outside != b,
        "a container outside the CRI joined a namespace's daemon: {outside}"
    );
    for (daemon, tenant) in [
        (&a, serde_json::json!({"namespace": "team-a"})),
        (&b, serde_json::json!({"namespace": "team-b"})),
        (&outside, serde_json::json!("no-namespace")),
    ] {
        assert_eq!(env.record(daemon)["identity"]["tenant"], tenant);
        assert_eq!(env.record(daemon)["identity"]["uid"], 0);
        let listed = env.status_of(daemon);
        assert_eq!(listed["tenant"], tenant, "{listed}");
    }
    assert_eq!(env.daemon_ids().len(), 3, "{:?}", env.daemon_ids());
    let table = env.gpushare(&["status"]);
    let table = text(&table);
    for (daemon, shown) in [
        (&a, "ns=team-a"),
        (&b, "ns=team-b"),
        (&outside, "ns=(none)"),
    ] {
        assert!(
            table
                .lines()
                .any(|l| l.starts_with(daemon.as_str()) && l.contains(shown)),
            "{shown}:\n{table}"
        );
    }
}

/// `mps.tenant = "uid"` (the default): every container of UID 0 shares one daemon,
/// whatever its namespace or annotations, with the id it always had.
#[test]
fn cri_uid_tenants_share_one_daemon_across_namespaces() {
    let env = Env::new();
    let daemons = pods_of_one_uid_in_two_namespaces(&env);
    assert!(daemons.iter().all(|d| d == &daemons[0]), "{daemons:?}");
    let record = env.record(&daemons[0]);
    assert!(record["identity"].get("tenant").is_none(), "{record}");
    assert_eq!(env.daemon_ids().len(), 1);
}

/// Two `hostUsers: false` pods of one namespace, both running as UID 1000 inside: the
/// kubelet gives each pod its own range of host UIDs (here by hand, as it allocates them),
/// so each gets a daemon of its own under the default `mps.tenant = "uid"`
/// (docs/kubernetes.md, "Tenants: UID or namespace").
#[test]
fn cri_host_users_false_pods_get_a_daemon_each() {
    let env = Env::new();
    let mut node = Node::start_containerd2(&env);
    let mut served = Vec::new();
    for (name, base) in [("first", 200000), ("second", 300000)] {
        let pod = node.pod(&PodSpec {
            name,
            annotations: &[("gpushare.io/device", "0")],
            run_as_user: Some(1000),
            userns: Some((base, 65536)),
            ..Default::default()
        });
        let c = ContainerSpec::user("cuda", 1000, "exec sleep 3600");
        let id = node.run(&pod, &c);
        let daemon = node.daemon_of(&id).expect("the container is on a daemon");
        assert_eq!(env.record(&daemon)["identity"]["uid"], base + 1000);
        served.push(daemon);
    }
    assert_ne!(
        served[0], served[1],
        "one namespace, two pods, two host UIDs"
    );
}
