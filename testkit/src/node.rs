//! A Kubernetes node for the tests, driven as a kubelet drives it. A private containerd
//! with its CRI plugin (own root, state, socket and cgroup parent; no CNI, so host-network
//! pods; an offline pause image), configured by the real `gpushare install containerd` and
//! driven over the CRI gRPC API ([`crate::cri_api`]): pods, containers, restarts, removal.
//! The workload image is the test rootfs (busybox + the simulator's client); the MPS
//! control binary is the simulator, through GPUSHARE_CONFIG in containerd's environment.
//!
//! containerd and the image imports run in a mount namespace of their own
//! (`PrivateMounts`): /run, /var/lib, /var/cache, /etc/cni are empty tmpfs there, so
//! nothing reaches the host's. Everything is stopped and removed in `Drop`, even when a
//! test fails: pods through CRI, then containerd, leftover shims, the cgroup parent.
//!
//! A pod of its own user namespace (`hostUsers: false`) needs containerd 2.x, which Debian
//! 12 does not ship: `Node::start_containerd2` runs the one `scripts/fetch-engines`
//! extracted (config version 3; a pod network of its own, see `pod_network`). CDI needs
//! containerd 1.7 or later: `Node::start_containerd_1_7_with` runs the extracted 1.7 on a
//! version 2 config, as 1.6's.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::Value;

use crate::common::{text, wait_until};
use crate::cri_api::*;
use crate::harness::*;

pub const HANDLER: &str = "gpushare";
pub const PAUSE: &str = "gpushare.test/pause:1";
pub const IMAGE: &str = "gpushare.test/sim:1";
pub const CLIENT: &str = "gpushare-mps-sim client";
/// A container's script that prints its pipe directory (`PIPE=unset` where it has none),
/// then runs on.
pub const PRINT_PIPE: &str = "echo PIPE=${CUDA_MPS_PIPE_DIRECTORY:-unset}; exec sleep 3600";

/// A private containerd's own keys: root, state, socket, opt dir under `dir`; nothing for
/// the CRI plugin (its built-in defaults).
pub fn daemon_config(dir: &Path) -> String {
    let p = |name: &str| format!("{:?}", dir.join(name).display().to_string());
    format!(
        "version = 2\nroot = {}\nstate = {}\n\n[grpc]\n  address = {}\n\n{}",
        p("root"),
        p("state"),
        p("c.sock"),
        containerd_opt_plugin(dir)
    )
}

/// The CRI plugin's table for a private containerd under `dir`. No `gpushare` runtime:
/// `gpushare install containerd` adds that.
pub fn base_config(dir: &Path) -> String {
    let p = |name: &str| format!("{:?}", dir.join(name).display().to_string());
    // Without CAP_SYS_RESOURCE (a container as the test machine) root cannot raise
    // oom_score_adj: containerd must keep the sandbox's at its own.
    let restrict_oom = !caps::has_cap(
        None,
        caps::CapSet::Effective,
        caps::Capability::CAP_SYS_RESOURCE,
    )
    .unwrap_or(false);
    format!(
        r#"{daemon}
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE}"
  restrict_oom_score_adj = {restrict_oom}
  # No AppArmor profile loaded into the host's kernel, no SELinux labels.
  disable_apparmor = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    # Works on any filesystem (overlayfs does not on overlayfs).
    snapshotter = "native"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = {cni_bin}
    conf_dir = {cni_conf}
"#,
        daemon = daemon_config(dir),
        cni_bin = p("cni/bin"),
        cni_conf = p("cni/net.d"),
    )
}

/// containerd 2.x's config (version 3) for a private containerd under `dir`: its own
/// keys as in `daemon_config`, the CRI plugin split in two (images: the snapshotter and
/// the pause image; runtime: the rest of what `base_config` sets). No `gpushare` runtime.
pub fn base_config_v3(dir: &Path) -> String {
    let p = |name: &str| format!("{:?}", dir.join(name).display().to_string());
    let restrict_oom = !caps::has_cap(
        None,
        caps::CapSet::Effective,
        caps::Capability::CAP_SYS_RESOURCE,
    )
    .unwrap_or(false);
    format!(
        r#"version = 3
root = {root}
state = {state}

[grpc]
  address = {sock}

[plugins."io.containerd.internal.v1.opt"]
  path = {opt}

[plugins."io.containerd.cri.v1.images"]
  snapshotter = "native"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "{PAUSE}"

[plugins."io.containerd.cri.v1.runtime"]
  restrict_oom_score_adj = {restrict_oom}
  disable_apparmor = true
  enable_selinux = false
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = [{cni_bin}]
    conf_dir = {cni_conf}
    # The pod network's loopback without the loopback plugin (see `pod_network`).
    use_internal_loopback = true
"#,
        root = p("root"),
        state = p("state"),
        sock = p("c.sock"),
        opt = p("opt"),
        cni_bin = p("cni/bin"),
        cni_conf = p("cni/net.d"),
    )
}

/// A pod network of nothing but the pod's own network namespace, for the pods containerd
/// 2.x cannot run on the host's network (a `hostUsers: false` pod: its CRI plugin pins the
/// pod's user namespace through the pod's network namespace). The CNI plugin is a script
/// under `dir`/cni that claims a loopback-range address and touches nothing (no interface,
/// no route, no rule on the host); containerd brings up the namespace's loopback itself.
pub fn pod_network(dir: &Path) {
    let bin = dir.join("cni/bin");
    let conf = dir.join("cni/net.d");
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::create_dir_all(&conf).unwrap();
    let plugin = bin.join("gs-none");
    std::fs::write(
        &plugin,
        r#"#!/bin/sh
cat >/dev/null
case "$CNI_COMMAND" in
ADD) echo '{"cniVersion":"1.0.0","interfaces":[{"name":"eth0","sandbox":"'"$CNI_NETNS"'"}],"ips":[{"address":"127.0.0.2/8","interface":0}]}' ;;
VERSION) echo '{"cniVersion":"1.0.0","supportedVersions":["0.4.0","1.0.0"]}' ;;
esac
"#,
    )
    .unwrap();
    std::fs::set_permissions(&plugin, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    std::fs::write(
        conf.join("10-gs-none.conflist"),
        r#"{"cniVersion":"1.0.0","name":"gs-none","plugins":[{"type":"gs-none"}]}"#,
    )
    .unwrap();
}

/// Where `scripts/fetch-engines` put containerd 2.x (containerd, containerd-shim-runc-v2,
/// ctr): `GPUSHARE_TEST_CONTAINERD2` (scripts/test sets it), else the script's default
/// cache. A test that needs it fails without it, saying how to fetch it.
pub fn containerd2_bin() -> PathBuf {
    let dir = std::env::var_os("GPUSHARE_TEST_CONTAINERD2")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/gpushare-test/engines/sid/root/usr/bin"));
    for bin in ["containerd", "containerd-shim-runc-v2", "ctr"] {
        assert!(
            dir.join(bin).is_file(),
            "containerd 2.x is not fetched ({} is missing): run ./scripts/fetch-engines (the README's test command, ./scripts/test, runs it), or set GPUSHARE_TEST_CONTAINERD2 to a directory holding containerd, containerd-shim-runc-v2 and ctr",
            dir.join(bin).display()
        );
    }
    dir
}

/// A docker-archive (`docker save` format) of one image: `layer` as its only layer.
pub fn image_tar(dir: &Path, name: &str, layer: &Path, config: Value) -> PathBuf {
    use sha2::Digest;
    let stem = format!("img-{}", name.replace(['/', ':', '.'], "_"));
    let work = dir.join(&stem);
    std::fs::create_dir_all(&work).unwrap();
    std::fs::copy(layer, work.join("layer.tar")).unwrap();
    let digest = hex(&sha2::Sha256::digest(std::fs::read(layer).unwrap()));
    let arch = match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    };
    let config = serde_json::json!({
        "architecture": arch, "os": "linux", "config": config,
        "rootfs": {"type": "layers", "diff_ids": [format!("sha256:{digest}")]},
    });
    std::fs::write(work.join("config.json"), config.to_string()).unwrap();
    let manifest = serde_json::json!([
        {"Config": "config.json", "RepoTags": [name], "Layers": ["layer.tar"]}
    ]);
    std::fs::write(work.join("manifest.json"), manifest.to_string()).unwrap();
    let tar = dir.join(format!("{stem}.tar"));
    let st = Command::new("tar")
        .arg("-C")
        .arg(&work)
        .arg("-cf")
        .arg(&tar)
        .args(["manifest.json", "config.json", "layer.tar"])
        .status()
        .unwrap();
    assert!(st.success());
    let _ = std::fs::remove_dir_all(&work);
    tar
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The pause image, built offline: a static busybox whose shell waits until SIGTERM/SIGINT
/// (what registry.k8s.io/pause does), as uid 65535 like pause ≥ 3.5.
pub fn pause_tar(dir: &Path) -> PathBuf {
    let root = dir.join("pause-rootfs");
    std::fs::create_dir_all(root.join("bin")).unwrap();
    let bb = ["/bin/busybox", "/usr/bin/busybox"]
        .into_iter()
        .find(|p| Path::new(p).is_file())
        .expect("busybox");
    std::fs::copy(bb, root.join("bin/busybox")).unwrap();
    for applet in ["sh", "sleep"] {
        std::os::unix::fs::symlink("busybox", root.join("bin").join(applet)).unwrap();
    }
    let layer = dir.join("pause-layer.tar");
    let st = Command::new("tar")
        .arg("-C")
        .arg(&root)
        .arg("-cf")
        .arg(&layer)
        .arg(".")
        .status()
        .unwrap();
    assert!(st.success());
    image_tar(
        dir,
        PAUSE,
        &layer,
        serde_json::json!({
            "User": "65535:65535",
            "Entrypoint": ["/bin/sh", "-c", "trap 'exit 0' TERM INT; sleep 2147483647 & wait"],
        }),
    )
}

/// One pod as the tests ask for it.
#[derive(Default, Clone)]
pub struct PodSpec<'a> {
    pub name: &'a str,
    /// The pod's namespace; empty: `default`.
    pub namespace: &'a str,
    pub annotations: &'a [(&'a str, &'a str)],
    /// The pod's `securityContext.runAsUser` (the sandbox's user; kubelet also copies it
    /// to every container that sets none, which the tests do by hand in `ContainerSpec::run_as_user`).
    pub run_as_user: Option<i64>,
    /// `hostIPC: true` (the CRI's NODE ipc namespace mode); else the pod's own (POD).
    pub host_ipc: bool,
    /// `hostUsers: false`: the pod's own user namespace, container ids 0..size mapped to
    /// host ids from this (host id, size), as kubelet allocates them.
    pub userns: Option<(u32, u32)>,
}

impl<'a> PodSpec<'a> {
    /// Pod `name` of user `uid` (its `runAsUser`), annotated `annotations`.
    pub fn user(name: &'a str, uid: i64, annotations: &'a [(&'a str, &'a str)]) -> Self {
        PodSpec {
            name,
            annotations,
            run_as_user: Some(uid),
            ..Default::default()
        }
    }
}

#[derive(Debug)]
pub struct Pod {
    pub id: String,
    pub config: PodSandboxConfig,
}

#[derive(Default, Clone)]
pub struct ContainerSpec<'a> {
    pub name: &'a str,
    pub attempt: u32,
    pub script: &'a str,
    pub run_as_user: Option<i64>,
    pub envs: &'a [(&'a str, &'a str)],
    /// Device nodes: a path, or `host:container` for a node at another path in the
    /// container (a device plugin's `/dev/nvidia<N>` from a node the test made).
    pub devices: &'a [&'a str],
    /// (host path, container path): the pod's volumes, a device plugin's mounts.
    pub mounts: &'a [(&'a str, &'a str)],
    /// The container's own annotations (a device plugin's `cdi.k8s.io/*`).
    pub annotations: &'a [(&'a str, &'a str)],
    /// CRI `CDI_devices` (a device plugin's `CDIDevices`, a DRA driver's).
    pub cdi_devices: &'a [&'a str],
}

impl<'a> ContainerSpec<'a> {
    /// Container `name` running `script` as user `uid` (as kubelet copies the pod's
    /// `runAsUser`).
    pub fn user(name: &'a str, uid: i64, script: &'a str) -> Self {
        ContainerSpec {
            name,
            script,
            run_as_user: Some(uid),
            ..Default::default()
        }
    }
}

/// How a pod reaches gpushare on a node: by gpushare's runtime class (the shim serves
/// it), or on containerd's default runtime, where only the NRI plugin can serve it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EntryPath {
    RuntimeClass,
    Nri,
}

/// One user's pod of [`Node::two_users_pods`]: the pod, its container, the container's
/// id and its client's line.
pub struct UserPod<'a> {
    pub pod: Pod,
    pub container: ContainerSpec<'a>,
    pub id: String,
    pub line: std::collections::BTreeMap<String, String>,
}

/// A private containerd with the CRI plugin, in its own mount namespace.
pub struct Node<'e> {
    pub env: &'e Env,
    pub dir: PathBuf,
    pub config: PathBuf,
    pub sock: PathBuf,
    pub log: PathBuf,
    pub cgroup: String,
    child: Option<Child>,
    cri: Option<Cri>,
    ns: Option<PrivateMounts>,
    pods: usize,
    /// The directory (as seen in the namespace) of the containerd, shim and ctr this node
    /// runs; None: Debian's, on PATH.
    pub bin: Option<PathBuf>,
}

impl<'e> Node<'e> {
    /// containerd on `config` (already written), in a new namespace; `prepare` runs in it
    /// before containerd starts (extra mounts).
    pub fn start_with(
        env: &'e Env,
        dir: PathBuf,
        config: PathBuf,
        prepare: &[&[&str]],
    ) -> Node<'e> {
        need("containerd", "containerd");
        need("ctr", "containerd");
        std::fs::create_dir_all(&dir).unwrap();
        Node::start_in(env, dir, config, PrivateMounts::new(), None, prepare)
    }

    /// containerd (the one in `bin`, as seen in `ns`, else Debian's) on `config`, in `ns`.
    pub fn start_in(
        env: &'e Env,
        dir: PathBuf,
        config: PathBuf,
        ns: PrivateMounts,
        bin: Option<PathBuf>,
        prepare: &[&[&str]],
    ) -> Node<'e> {
        for args in prepare {
            let st = ns.cmd(args[0]).args(&args[1..]).status().unwrap();
            assert!(st.success(), "{args:?}");
        }
        let mut node = Node {
            env,
            sock: dir.join("c.sock"),
            log: dir.join("containerd.log"),
            cgroup: format!(
                "/gs-cri-{}-{}",
                std::process::id(),
                dir.file_name().unwrap().to_string_lossy()
            ),
            dir,
            config,
            child: None,
            cri: None,
            ns: Some(ns),
            pods: 0,
            bin,
        };
        node.restart();
        node
    }

    /// A node of containerd 2.x (fetched by scripts/fetch-engines; its CRI plugin gives
    /// pods user namespaces), configured like a fresh one: `base_config_v3`, then `gpushare
    /// install containerd`. The fetched binaries are bound into the namespace (its tmpfs
    /// covers /var/cache).
    pub fn start_containerd2(env: &'e Env) -> Node<'e> {
        Node::start_containerd2_with(env, &|_| {})
    }

    /// [`Node::start_containerd2`], with `configure` run on the config file after
    /// `gpushare install containerd`, before containerd starts.
    pub fn start_containerd2_with(env: &'e Env, configure: &dyn Fn(&Path)) -> Node<'e> {
        Node::start_fetched_with(env, containerd2_bin(), 3, configure)
    }

    /// A node of containerd 1.7 (fetched by scripts/fetch-engines), configured like a
    /// fresh one: `base_config` (version 2, which 1.7 reads as 1.6 does), then `gpushare
    /// install containerd`, then `configure`.
    pub fn start_containerd_1_7_with(env: &'e Env, configure: &dyn Fn(&Path)) -> Node<'e> {
        let fetched = fetched(
            "GPUSHARE_TEST_CONTAINERD17",
            "trixie",
            &["containerd", "containerd-shim-runc-v2", "ctr"],
        );
        Node::start_fetched_with(env, fetched, 2, configure)
    }

    /// A node of the containerd in `fetched` on a config of `version` (2: `base_config`,
    /// 3: `base_config_v3`), then `gpushare install containerd`, then `configure`; the
    /// fetched binaries are bound into the namespace (its tmpfs covers /var/cache) and
    /// first on containerd's PATH.
    pub fn start_fetched_with(
        env: &'e Env,
        fetched: PathBuf,
        version: u32,
        configure: &dyn Fn(&Path),
    ) -> Node<'e> {
        let dir = env.path().join("k");
        std::fs::create_dir_all(&dir).unwrap();
        let config = dir.join("config.toml");
        let base = match version {
            2 => base_config(&dir),
            _ => base_config_v3(&dir),
        };
        std::fs::write(&config, base).unwrap();
        pod_network(&dir);
        install_shim(env, &config);
        configure(&config);
        let bin = dir.join("bin");
        let ns = PrivateMounts::with_binds(&[(&fetched, &bin)]);
        let node = Node::start_in(env, dir, config, ns, Some(bin), &[]);
        node.import_images();
        node
    }

    /// `name` (containerd, ctr) of the containerd this node runs.
    pub fn program(&self, name: &str) -> PathBuf {
        match &self.bin {
            Some(bin) => bin.join(name),
            None => need(name, "containerd"),
        }
    }

    /// A node configured like a fresh one: the base config, then `gpushare install
    /// containerd` (the binary under test) adds the runtime, pointed at the shim under test.
    pub fn start(env: &'e Env) -> Node<'e> {
        Node::installed(env, &|config| install_shim(env, config))
    }

    /// A node of Debian's containerd 1.6 on `base_config` at `<env>/k/config.toml`, on which
    /// `install` has run (the installs a test wants, and edits), with the images imported.
    pub fn installed(env: &'e Env, install: &dyn Fn(&Path)) -> Node<'e> {
        let dir = env.path().join("k");
        std::fs::create_dir_all(&dir).unwrap();
        let config = dir.join("config.toml");
        std::fs::write(&config, base_config(&dir)).unwrap();
        install(&config);
        let node = Node::start_with(env, dir, config, &[]);
        node.import_images();
        node
    }

    pub fn ns(&self) -> &PrivateMounts {
        self.ns.as_ref().unwrap()
    }

    pub fn cri(&self) -> &Cri {
        self.cri.as_ref().expect("containerd is running")
    }

    /// Stops containerd as a service manager does (SIGTERM; its shims and their containers
    /// stay), so that `restart` can start it again.
    pub fn stop(&mut self) {
        self.cri = None;
        if let Some(mut child) = self.child.take() {
            stop_child(&mut child, Duration::from_secs(20));
        }
    }

    /// (Re)starts containerd on its config, as a service manager would, and waits for CRI.
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "containerd is still running");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let mut cmd = self.ns().cmd(self.program("containerd"));
        if let Some(bin) = &self.bin {
            // containerd finds its shim on PATH before beside itself.
            let path = std::env::var_os("PATH").unwrap_or_default();
            let mut dirs = vec![bin.clone()];
            dirs.extend(std::env::split_paths(&path));
            cmd.env("PATH", std::env::join_paths(dirs).unwrap());
        }
        let child = cmd
            .env("GPUSHARE_CONFIG", &self.env.config)
            .arg("--config")
            .arg(&self.config)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        self.child = Some(child);
        let mut last = String::new();
        let up = wait_until(Duration::from_secs(60), || {
            match Cri::connect(&self.sock).and_then(|c| c.version().map(|v| (c, v))) {
                Ok((c, v)) => {
                    assert_eq!(v.runtime_name, "containerd");
                    self.cri = Some(c);
                    true
                }
                Err(e) => {
                    last = e.to_string();
                    assert!(
                        !self
                            .log_text()
                            .contains("failed to load plugin io.containerd.grpc.v1.cri"),
                        "containerd's CRI plugin did not load:\n{}",
                        self.log_text()
                    );
                    false
                }
            }
        });
        assert!(
            up,
            "containerd's CRI did not come up ({last}):\n{}",
            self.log_text()
        );
    }

    /// The pid of the running containerd (nsenter execs it: the child is containerd).
    pub fn pid(&self) -> u32 {
        self.child.as_ref().unwrap().id()
    }

    /// Waits for containerd to exit (after someone else signalled it); its exit status.
    pub fn wait_exit(&mut self, limit: Duration) -> std::process::ExitStatus {
        let mut child = self.child.take().expect("containerd was running");
        self.cri = None;
        let mut status = None;
        let gone = wait_until(limit, || {
            status = child.try_wait().unwrap();
            status.is_some()
        });
        if !gone {
            stop_child(&mut child, Duration::from_secs(5));
            panic!("containerd did not exit:\n{}", self.log_text());
        }
        status.unwrap()
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn import_images(&self) {
        let tars = [rootfs_image(&self.dir), pause_tar(&self.dir)];
        for tar in &tars {
            let out = self
                .ns()
                .cmd(self.program("ctr"))
                .arg("--address")
                .arg(&self.sock)
                .args([
                    "-n",
                    "k8s.io",
                    "images",
                    "import",
                    "--snapshotter",
                    "native",
                ])
                // ctr 2.x imports through containerd's transfer service, which unpacks
                // only for the snapshotters its own config lists: the client does it.
                .args(self.bin.as_ref().map(|_| "--local"))
                .arg(tar)
                .stdin(Stdio::null())
                .output()
                .unwrap();
            assert!(out.status.success(), "ctr images import: {}", text(&out));
            let _ = std::fs::remove_file(tar);
        }
        // CRI learns about imported images from containerd's events.
        for image in [IMAGE, PAUSE] {
            let known = wait_until(Duration::from_secs(20), || {
                matches!(self.cri().image_status(image), Ok(Some(_)))
            });
            assert!(known, "CRI does not see the imported image {image}");
        }
    }

    pub fn bundle(&self, id: &str) -> PathBuf {
        self.dir
            .join("state/io.containerd.runtime.v2.task/k8s.io")
            .join(id)
    }

    /// The config.json the runtime was given (and the shim may have edited).
    pub fn bundle_spec(&self, id: &str) -> Value {
        let path = self.bundle(id).join("config.json");
        serde_json::from_slice(
            &std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
        )
        .unwrap()
    }

    pub fn pod_config(&mut self, spec: &PodSpec) -> PodSandboxConfig {
        self.pods += 1;
        let logs = self.dir.join("logs").join(spec.name);
        std::fs::create_dir_all(&logs).unwrap();
        PodSandboxConfig {
            metadata: Some(PodSandboxMetadata {
                name: spec.name.into(),
                uid: format!("uid-{}-{}", spec.name, self.pods),
                namespace: if spec.namespace.is_empty() {
                    "default".into()
                } else {
                    spec.namespace.into()
                },
                attempt: 0,
            }),
            // None for a host-network pod (kubelet sets it only with a pod network).
            log_directory: logs.display().to_string(),
            annotations: spec
                .annotations
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            linux: Some(LinuxPodSandboxConfig {
                cgroup_parent: self.cgroup.clone(),
                security_context: Some(LinuxSandboxSecurityContext {
                    // hostNetwork: true (no CNI here), but for a pod of its own user
                    // namespace (`pod_network`).
                    namespace_options: Some(NamespaceOption {
                        network: if spec.userns.is_some() {
                            0
                        } else {
                            NAMESPACE_NODE
                        },
                        pid: 1,
                        ipc: if spec.host_ipc { NAMESPACE_NODE } else { 0 },
                        userns_options: spec.userns.map(|(host_id, length)| {
                            let ids = vec![IdMapping {
                                host_id,
                                container_id: 0,
                                length,
                            }];
                            UserNamespace {
                                mode: 0,
                                uids: ids.clone(),
                                gids: ids,
                            }
                        }),
                    }),
                    run_as_user: spec.run_as_user.map(|value| Int64Value { value }),
                    run_as_group: spec.run_as_user.map(|value| Int64Value { value }),
                }),
            }),
            ..Default::default()
        }
    }

    pub fn try_pod(&mut self, spec: &PodSpec) -> Result<Pod, Status> {
        self.try_pod_on(spec, HANDLER)
    }

    fn try_pod_on(&mut self, spec: &PodSpec, handler: &str) -> Result<Pod, Status> {
        let config = self.pod_config(spec);
        let id = self.cri().run_pod(&config, handler)?;
        Ok(Pod { id, config })
    }

    /// A pod of gpushare's runtime class (`HANDLER`).
    pub fn pod(&mut self, spec: &PodSpec) -> Pod {
        self.try_pod(spec)
            .unwrap_or_else(|e| panic!("RunPodSandbox {}: {e}\n{}", spec.name, self.log_text()))
    }

    /// A pod of containerd's default runtime (no runtime class: where the NRI plugin, not
    /// the shim, serves it).
    pub fn plain_pod(&mut self, spec: &PodSpec) -> Pod {
        self.try_pod_on(spec, "")
            .unwrap_or_else(|e| panic!("RunPodSandbox {}: {e}\n{}", spec.name, self.log_text()))
    }

    /// A pod through `path`: [`Node::pod`] or [`Node::plain_pod`].
    pub fn pod_through(&mut self, path: EntryPath, spec: &PodSpec) -> Pod {
        match path {
            EntryPath::RuntimeClass => self.pod(spec),
            EntryPath::Nri => self.plain_pod(spec),
        }
    }

    /// Pod `name` of user `uid` annotated `annotations` through `path`, with a container
    /// `cuda` running `script` (a simulator client's) as that user: run, and its client's
    /// line read.
    pub fn user_pod<'a>(
        &mut self,
        path: EntryPath,
        name: &str,
        uid: i64,
        annotations: &[(&str, &str)],
        script: &'a str,
    ) -> UserPod<'a> {
        let pod = self.pod_through(path, &PodSpec::user(name, uid, annotations));
        let container = ContainerSpec::user("cuda", uid, script);
        let id = self.run(&pod, &container);
        let line = self.client_line(&pod, &container);
        UserPod {
            pod,
            container,
            id,
            line,
        }
    }

    /// The two-user pod setup: alice (UID 1000), then bob (UID 2000), each a pod annotated
    /// `annotations` through `path` with a container `cuda` running `script` as its user,
    /// run and its client's line read; alice's client still runs when bob's starts where
    /// `script` holds it. Both clients are served by their own user's server, bob's at
    /// once (it waited for no other server), each on a daemon of its own.
    pub fn two_users_pods<'a>(
        &mut self,
        path: EntryPath,
        annotations: &[(&str, &str)],
        script: &'a str,
    ) -> [UserPod<'a>; 2] {
        let served = [("alice", 1000), ("bob", 2000)].map(|(name, uid)| {
            let served = self.user_pod(path, name, uid, annotations, script);
            let line = &served.line;
            assert_eq!(line["server_uid"], uid.to_string(), "{name}: {line:?}");
            assert!(
                line["waited_ms"].parse::<u64>().unwrap() < 1000,
                "{name} waited for another's server: {line:?}"
            );
            served
        });
        let [alice, bob] = &served;
        assert_ne!(alice.line["server"], bob.line["server"]);
        let (da, db) = (self.daemon_of(&alice.id), self.daemon_of(&bob.id));
        assert!(
            da.is_some() && db.is_some() && da != db,
            "each user has a daemon of its own: {da:?} {db:?}"
        );
        served
    }

    pub fn create(&self, pod: &Pod, c: &ContainerSpec) -> Result<String, Status> {
        let userns = pod
            .config
            .linux
            .as_ref()
            .and_then(|l| l.security_context.as_ref())
            .and_then(|s| s.namespace_options.as_ref())
            .and_then(|n| n.userns_options.clone());
        let mut mounts: Vec<CriMount> = c
            .mounts
            .iter()
            .map(|(host, container)| CriMount {
                container_path: container.to_string(),
                host_path: host.to_string(),
                readonly: false,
            })
            .collect();
        if userns.is_some() {
            // In a pod of its own user namespace, containerd 2.x mounts its own
            // /etc/hostname, /etc/hosts and /etc/resolv.conf idmapped, which runc < 1.2
            // cannot do ("idmap mounts not supported"); a CRI mount of the same path, as
            // kubelet gives for /etc/hosts, replaces containerd's. Plain binds of the
            // node's files: the container reads them as the overflow owner.
            let etc = self.dir.join("pod-etc");
            std::fs::create_dir_all(&etc).unwrap();
            for (name, content) in [
                ("hostname", "gs-pod\n"),
                ("hosts", "127.0.0.1 localhost\n"),
                ("resolv.conf", ""),
            ] {
                std::fs::write(etc.join(name), content).unwrap();
                mounts.push(CriMount {
                    container_path: format!("/etc/{name}"),
                    host_path: etc.join(name).display().to_string(),
                    readonly: true,
                });
            }
        }
        let config = ContainerConfig {
            metadata: Some(ContainerMetadata {
                name: c.name.into(),
                attempt: c.attempt,
            }),
            image: Some(ImageSpec {
                image: IMAGE.into(),
            }),
            command: vec!["sh".into(), "-c".into(), c.script.into()],
            envs: c
                .envs
                .iter()
                .map(|(k, v)| KeyValue {
                    key: k.to_string(),
                    value: v.to_string(),
                })
                .collect(),
            mounts,
            devices: c
                .devices
                .iter()
                .map(|d| {
                    let (host, container) = d.split_once(':').unwrap_or((d, d));
                    Device {
                        container_path: container.to_string(),
                        host_path: host.to_string(),
                        permissions: "rw".into(),
                    }
                })
                .collect(),
            annotations: c
                .annotations
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            cdi_devices: c
                .cdi_devices
                .iter()
                .map(|name| CdiDevice {
                    name: name.to_string(),
                })
                .collect(),
            log_path: format!("{}_{}.log", c.name, c.attempt),
            linux: Some(LinuxContainerConfig {
                security_context: Some(LinuxContainerSecurityContext {
                    // The pod's user namespace, as kubelet gives it to each container
                    // (the other modes left as POD: the pod's namespaces).
                    namespace_options: userns.map(|userns| NamespaceOption {
                        userns_options: Some(userns),
                        ..Default::default()
                    }),
                    run_as_user: c.run_as_user.map(|value| Int64Value { value }),
                    run_as_group: c.run_as_user.map(|value| Int64Value { value }),
                }),
            }),
            ..Default::default()
        };
        self.cri().create_container(&pod.id, &config, &pod.config)
    }

    /// CreateContainer + StartContainer (where the runtime's `create` runs).
    pub fn try_run(&self, pod: &Pod, c: &ContainerSpec) -> Result<String, Status> {
        let id = self.create(pod, c)?;
        self.cri().start_container(&id)?;
        Ok(id)
    }

    pub fn run(&self, pod: &Pod, c: &ContainerSpec) -> String {
        self.try_run(pod, c)
            .unwrap_or_else(|e| panic!("container {}: {e}\n{}", c.name, self.log_text()))
    }

    /// A container whose request is bad: its start fails with gpushare's one `line` in
    /// the CRI error, and no daemon appears for it.
    pub fn refuse(&self, pod: &Pod, c: &ContainerSpec, line: &str) {
        let daemons = self.env.daemon_ids();
        let err = self.try_run(pod, c).expect_err("a bad request must fail");
        assert!(err.message.contains(line), "want {line:?} in: {err}");
        assert_eq!(self.env.daemon_ids(), daemons, "no daemon is started");
    }

    /// The container's output so far (CRI log lines `<time> <stream> <tag> <text>`).
    pub fn output(&self, pod: &Pod, c: &ContainerSpec) -> String {
        let path =
            Path::new(&pod.config.log_directory).join(format!("{}_{}.log", c.name, c.attempt));
        std::fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.splitn(4, ' ').nth(3))
            .map(|l| format!("{l}\n"))
            .collect()
    }

    /// Waits (20 s) until the container's output contains `want`; the output.
    pub fn wait_output(&self, pod: &Pod, c: &ContainerSpec, want: &str) -> String {
        let seen = wait_until(Duration::from_secs(20), || {
            self.output(pod, c).contains(want)
        });
        let out = self.output(pod, c);
        assert!(seen, "no {want:?} from {}:\n{out}", c.name);
        out
    }

    /// The container's output once it holds its mountinfo (the `/dev/shm` line), for a
    /// script that prints the client's line, then `cat /proc/self/mountinfo`.
    pub fn mountinfo(&self, pod: &Pod, c: &ContainerSpec) -> String {
        let ok = wait_until(Duration::from_secs(10), || {
            self.output(pod, c).contains("/dev/shm")
        });
        assert!(ok, "no mountinfo from {}: {}", c.name, self.output(pod, c));
        self.output(pod, c)
    }

    /// Waits for the simulator client's line in the container's output.
    pub fn client_line(
        &self,
        pod: &Pod,
        c: &ContainerSpec,
    ) -> std::collections::BTreeMap<String, String> {
        let ok = wait_until(Duration::from_secs(30), || {
            self.output(pod, c).contains("mps-client ")
        });
        assert!(
            ok,
            "no client line from {}: {}\n{}",
            c.name,
            self.output(pod, c),
            self.env.gpushare_log()
        );
        client_line(&self.output(pod, c))
    }

    pub fn wait_state(&self, id: &str, state: i32) {
        let ok = wait_until(Duration::from_secs(30), || {
            self.cri()
                .container_status(id)
                .ok()
                .and_then(|s| s.status)
                .is_some_and(|s| s.state == state)
        });
        assert!(ok, "container {id} did not reach state {state}");
    }

    /// The spec containerd generated (CRI verbose info), before any runtime saw it.
    pub fn generated_spec(info: &HashMap<String, String>) -> Value {
        let info: Value = serde_json::from_str(info.get("info").expect("verbose info")).unwrap();
        info["runtimeSpec"].clone()
    }

    /// The container ids with runc state under the `--root` containerd's shim gives runc
    /// (`/run/containerd/runc/k8s.io`, in the namespace's /run).
    pub fn runc_ids(&self) -> String {
        let out = self
            .ns()
            .cmd("sh")
            .args(["-c", "ls /run/containerd/runc/k8s.io 2>/dev/null; true"])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Every container record gpushare keeps, as (daemon, container id).
    pub fn gpushare_records(&self) -> Vec<(String, String)> {
        let mut out = Vec::new();
        for d in self.env.daemon_ids() {
            let dir = self.env.state.join("mps").join(&d).join("containers");
            for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                // Records only: not the records lock, nor a record being written.
                if let Some(id) = name
                    .strip_suffix(".json")
                    .filter(|_| !name.starts_with('.'))
                {
                    out.push((d.clone(), id.to_owned()));
                }
            }
        }
        out
    }

    /// Daemon id → the container ids `gpushare status` lists for it.
    pub fn status_containers(&self) -> HashMap<String, Vec<String>> {
        self.env
            .status()
            .as_array()
            .unwrap()
            .iter()
            .map(|d| {
                (
                    d["id"].as_str().unwrap().to_owned(),
                    d["containers"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|c| c["id"].as_str().unwrap().to_owned())
                        .collect(),
                )
            })
            .collect()
    }

    pub fn daemon_of(&self, container: &str) -> Option<String> {
        self.status_containers()
            .into_iter()
            .find(|(_, cs)| cs.iter().any(|c| c == container))
            .map(|(d, _)| d)
    }

    /// Stops and removes every pod (and so every container), best effort.
    pub fn remove_all(&self) {
        let Some(cri) = self.cri.as_ref() else { return };
        for c in cri.list_containers().unwrap_or_default() {
            let _ = cri.stop_container(&c.id, 0);
            let _ = cri.remove_container(&c.id);
        }
        for p in cri.list_pods().unwrap_or_default() {
            let _ = cri.stop_pod(&p.id);
            let _ = cri.remove_pod(&p.id);
        }
    }
}

/// The workload image: the test rootfs (busybox + the simulator's client).
pub fn rootfs_image(dir: &Path) -> PathBuf {
    let layer = rootfs_tar(dir);
    let tar = image_tar(
        dir,
        IMAGE,
        &layer,
        serde_json::json!({"Env": ["PATH=/usr/bin:/bin"], "Cmd": ["sh"]}),
    );
    let _ = std::fs::remove_file(layer);
    tar
}

impl Drop for Node<'_> {
    fn drop(&mut self) {
        self.remove_all();
        self.cri = None;
        if let Some(mut child) = self.child.take() {
            stop_child(&mut child, Duration::from_secs(20));
        }
        // Shims and containers that outlived a failed removal: every process of the
        // namespace but its holder and gpushare's own (Env stops those by their records).
        if let Some(ns) = self.ns.as_ref() {
            let ours = std::fs::read_link(format!("/proc/{}/ns/mnt", ns.holder_pid())).ok();
            for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
                let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
                    continue;
                };
                if pid as u32 == ns.holder_pid()
                    || std::fs::read_link(format!("/proc/{pid}/ns/mnt")).ok() != ours
                {
                    continue;
                }
                // gpushare's supervisors and daemons, wherever the binary was run from.
                let exe = std::fs::read_link(format!("/proc/{pid}/exe")).unwrap_or_default();
                let name = exe.file_name().unwrap_or_default();
                if name == "gpushare" || name == "gpushare-mps-sim" {
                    continue;
                }
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
        remove_cgroup(&self.cgroup);
        // The namespace goes with its last process (gpushare's daemons: Env stops them).
        self.ns = None;
    }
}

/// Removes the pods' cgroup parent (and what runc left below it) from every hierarchy.
pub fn remove_cgroup(parent: &str) {
    let root = Path::new("/sys/fs/cgroup");
    let mut bases = vec![root.to_path_buf()];
    for e in std::fs::read_dir(root).into_iter().flatten().flatten() {
        if e.path().join("cgroup.procs").exists() && !e.path().is_symlink() {
            bases.push(e.path());
        }
    }
    for base in bases {
        let dir = base.join(parent.trim_start_matches('/'));
        if !dir.is_dir() {
            continue;
        }
        for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            if e.path().is_dir() {
                let _ = wait_until(Duration::from_secs(5), || {
                    std::fs::remove_dir(e.path()).is_ok()
                });
            }
        }
        let _ = wait_until(Duration::from_secs(5), || std::fs::remove_dir(&dir).is_ok());
    }
}

pub fn hold(seconds: u32) -> String {
    format!("{CLIENT} --hold {seconds}; exec sleep 3600")
}

/// Registers runtime class `name` on the containerd config at `config` the way an
/// operator does for containerd without the shim: `gpushare install containerd
/// --hook-only` (the binary under test, with this env's config, which it passes on to the
/// hooks it writes into the base spec). Returns the base spec it wrote.
pub fn install_hook_only(env: &Env, config: &Path, name: &str) -> Value {
    let install = || {
        env.cmd(gpushare())
            .args([
                "install",
                "containerd",
                "--hook-only",
                "--name",
                name,
                "--config",
            ])
            .arg(config)
            .output()
            .unwrap()
    };
    let out = install();
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("hook-only"), "{}", text(&out));
    let spec = config.with_file_name(format!("{name}-base-spec.json"));
    let again = install();
    assert!(text(&again).contains("nothing to do"), "{}", text(&again));
    serde_json::from_slice(&std::fs::read(&spec).unwrap()).unwrap()
}

/// `gpushare install cdi` (the binary under test): the spec written to `spec` and CDI
/// turned on in the containerd config at `config`, with the spec's directory among its
/// `cdi_spec_dirs`.
pub fn install_cdi(env: &Env, spec: &Path, config: &Path) {
    let out = env
        .cmd(gpushare())
        .args(["install", "cdi", "--output"])
        .arg(spec)
        .args(["--enable", "containerd", "--config"])
        .arg(config)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
}

/// `gpushare uninstall containerd` (the binary under test) on the containerd config at
/// `config`, which must succeed; its output.
pub fn uninstall_containerd(env: &Env, config: &Path) -> String {
    let out = env
        .cmd(gpushare())
        .args(["uninstall", "containerd", "--config"])
        .arg(config)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    text(&out)
}

/// `gpushare install containerd` (the binary under test) on the containerd config at
/// `config`: the `gpushare` runtime, pointed at the shim under test.
pub fn install_shim(env: &Env, config: &Path) {
    let out = env
        .cmd(gpushare())
        .args(["install", "containerd", "--config"])
        .arg(config)
        .arg("--runtime-path")
        .arg(runtime())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
}
