//! The Kubernetes scenarios that hold on more than one entry path: one scenario, one
//! table of the ways its pods reach gpushare (gpushare's runtime class, the shim; the
//! NRI plugin, pods of containerd's default runtime) on the containerd each needs. Every
//! row is a `#[test]` of its own, named as its path's test was, so that a path fails, and
//! is filtered, on its own.

use std::path::Path;

use serde_json::Value;
use testkit::*;

use crate::nri::{containerd23_bin, enable_nri, has_gpushare_hook, record_engines, Plugin};

/// The containerd a row's node runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Containerd {
    /// Debian's 1.6 (config version 2).
    V1_6,
    /// 1.7, fetched (config version 2).
    V1_7,
    /// 2.1, Debian sid's, fetched (config version 3).
    V2_1,
    /// 2.3.4, built by `scripts/fetch-engines` (config version 3): the first that tells
    /// an NRI plugin the container's user.
    V2_3,
}

/// A row's entry path: how its pods reach gpushare, on which containerd.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Through {
    /// gpushare's runtime class: the shim.
    Shim(Containerd),
    /// `gpushare nri` on the node's NRI socket (`enable_nri`), pods of containerd's
    /// default runtime.
    Nri(Containerd),
}

impl Through {
    fn path(self) -> EntryPath {
        match self {
            Through::Shim(_) => EntryPath::RuntimeClass,
            Through::Nri(_) => EntryPath::Nri,
        }
    }

    fn containerd(self) -> Containerd {
        match self {
            Through::Shim(c) | Through::Nri(c) => c,
        }
    }

    /// The version of the node's containerd config (2 or 3).
    fn config_version(self) -> u32 {
        match self.containerd() {
            Containerd::V1_6 | Containerd::V1_7 => 2,
            Containerd::V2_1 | Containerd::V2_3 => 3,
        }
    }
}

/// A row's node: `gpushare install containerd` run on its config, then `configure`, then
/// (NRI) NRI turned on; started, and the plugin on it. The plugin is stopped before the
/// node (fields drop in order).
pub struct Kube<'e> {
    _plugin: Option<Plugin>,
    pub node: Node<'e>,
    pub through: Through,
}

impl<'e> Kube<'e> {
    /// `None` where the row's containerd (2.3.4) is not built and cannot be: the test
    /// skips, with the reason `containerd23_bin` gives.
    pub fn start(env: &'e Env, through: Through, configure: &dyn Fn(&Path)) -> Option<Self> {
        let nri = matches!(through, Through::Nri(_));
        let configure = |config: &Path| {
            configure(config);
            if nri {
                enable_nri(config);
            }
        };
        let node = match through.containerd() {
            Containerd::V1_6 => Node::installed(env, &|config| {
                install_shim(env, config);
                configure(config);
            }),
            Containerd::V1_7 => Node::start_containerd_1_7_with(env, &configure),
            Containerd::V2_1 => Node::start_containerd2_with(env, &configure),
            Containerd::V2_3 => Node::start_fetched_with(env, containerd23_bin()?, 3, &configure),
        };
        Some(Kube {
            _plugin: nri.then(|| Plugin::start(env, &node)),
            node,
            through,
        })
    }

    /// A pod through this row's entry path.
    pub fn pod(&mut self, spec: &PodSpec) -> Pod {
        self.node.pod_through(self.through.path(), spec)
    }
}

/// One `#[test]` a row, each running the scenario through the row's entry path (a
/// [`Through`]): `entry_path_test!(scenario: fn test_name() = Through::...; ...)`.
macro_rules! entry_path_test {
    ($scenario:ident: $(fn $name:ident() = $through:expr;)+) => {
        $(
            #[test]
            fn $name() {
                $scenario($through)
            }
        )+
    };
}

use Containerd::*;
use Through::*;

/// Two pods in two namespaces, three client containers: `gpushare status` names the
/// namespace, pod and container of each (table, `--json`, Prometheus with DCGM exporter's
/// label names), and lists no sandbox.
fn every_client_container_is_named_by_its_pod(through: Through) {
    let env = Env::new();
    let mut kube = Kube::start(&env, through, &|_| {}).expect("a node");
    let ann = [("gpushare.io/device", "0")];
    let mut want = Vec::new();
    for (namespace, pod, uid, containers) in [
        ("team-a", "trainer-0", 1000, &["trainer", "eval"][..]),
        ("team-b", "infer-1", 2000, &["server"][..]),
    ] {
        let p = kube.pod(&PodSpec {
            namespace,
            ..PodSpec::user(pod, uid, &ann)
        });
        for name in containers {
            let script = hold(60);
            let c = ContainerSpec::user(name, uid, &script);
            let id = kube.node.run(&p, &c);
            kube.node.client_line(&p, &c);
            want.push((id, namespace, pod, *name));
        }
    }
    let daemons = env.status();
    let listed: Vec<&Value> = daemons
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|d| d["containers"].as_array().unwrap())
        .collect();
    assert_eq!(
        listed.len(),
        want.len(),
        "only the clients, no sandbox: {daemons:#}"
    );
    for (id, namespace, pod, name) in &want {
        let c = listed
            .iter()
            .find(|c| c["id"] == id.as_str())
            .unwrap_or_else(|| panic!("{id} not in status: {daemons:#}"));
        assert_eq!(
            (&c["namespace"], &c["pod"], &c["container"], &c["engine"]),
            (
                &Value::from(*namespace),
                &Value::from(*pod),
                &Value::from(*name),
                &Value::from("kubernetes")
            ),
            "{c}"
        );
    }
    let table = text(&env.gpushare(&["status"]));
    for (id, namespace, pod, name) in &want {
        let line = format!("  └ container {}  engine=kubernetes  pid=", &id[..12]);
        let row = table
            .lines()
            .find(|l| l.starts_with(&line))
            .unwrap_or_else(|| panic!("{line:?} in:\n{table}"));
        assert!(
            row.ends_with(&format!("  pod={namespace}/{pod}  container={name}")),
            "{row}"
        );
    }
    let prom = text(&env.gpushare(&["status", "--format", "prometheus"]));
    for (id, namespace, pod, name) in &want {
        let labels =
            format!(",container_id=\"{id}\",namespace=\"{namespace}\",pod=\"{pod}\",container=\"{name}\"}} 1");
        assert_eq!(
            prom.lines()
                .filter(
                    |l| l.starts_with("gpushare_container_info{daemon=\"") && l.ends_with(&labels)
                )
                .count(),
            1,
            "{labels} in:\n{prom}"
        );
    }
}

entry_path_test! { every_client_container_is_named_by_its_pod:
    fn cri_status_names_the_pod_of_every_client_container() = Shim(V1_6);
    fn cri_containerd_1_7_status_names_the_pod_of_every_client_container() = Shim(V1_7);
    fn cri_containerd2_status_names_the_pod_of_every_client_container() = Shim(V2_1);
}

/// A CDI device of gpushare's (`gpushare install cdi --enable containerd`: the spec
/// `gpushare cdi generate` writes, in a private directory among the node's
/// `cdi_spec_dirs`, `enable_cdi` on), by the CRI `CDI_devices` field, is served once, on
/// the GPU it names: one pipe directory mount, one daemon. Through the shim (containerd
/// 1.7 and 2.x) the shim takes the request from the CDI hook and replaces that hook by its
/// own; a profile's device by a `cdi.k8s.io/*` annotation gets the profile's limit, and a
/// pod annotation asking for another GPU beside the device is refused, and no daemon ever
/// serves that GPU. Through the NRI plugin (a pod of no runtime class) the device reaches
/// the container with gpushare's prestart hook, which serves it, and the plugin leaves the
/// container alone: no mount or env of the plugin's, the hook's record, not the plugin's.
fn a_cdi_device_of_gpushare_s_is_served_once(through: Through) {
    let env = Env::with_configs("[cdi.profiles.small]\nactive-thread-percentage = 25\n", "");
    let cdi = env.path().join("cdi");
    let configure = |config: &Path| {
        install_cdi(&env, &cdi.join("gpushare.json"), config);
        let t: toml::Table = std::fs::read_to_string(config).unwrap().parse().unwrap();
        let cri = match through.config_version() {
            2 => &t["plugins"]["io.containerd.grpc.v1.cri"],
            _ => &t["plugins"]["io.containerd.cri.v1.runtime"],
        };
        assert_eq!(cri["enable_cdi"].as_bool(), Some(true), "{t}");
        assert!(
            cri["cdi_spec_dirs"]
                .as_array()
                .unwrap()
                .contains(&toml::Value::from(cdi.display().to_string())),
            "{t}"
        );
    };
    let Some(mut kube) = Kube::start(&env, through, &configure) else {
        return;
    };
    let containerd = kube.node.program("containerd");
    let out = kube
        .node
        .ns()
        .cmd(&containerd)
        .arg("--version")
        .output()
        .unwrap();
    eprintln!("{}", text(&out));
    let script = format!("{CLIENT}; cat /proc/self/mountinfo; exec sleep 3600");
    let devices_served = |env: &Env| -> Vec<Value> {
        env.daemon_ids()
            .iter()
            .map(|id| env.record(id)["identity"]["devices"].clone())
            .collect()
    };

    // By the CDI_devices field.
    let pod = kube.pod(&PodSpec::user("cdi", 1000, &[]));
    let c = ContainerSpec {
        cdi_devices: &["gpushare.io/gpu=0"],
        ..ContainerSpec::user("field", 1000, &script)
    };
    let node = &kube.node;
    let id = node.run(&pod, &c);
    let line = node.client_line(&pod, &c);
    assert_eq!(
        (line["server_uid"].as_str(), line["shm"].as_str()),
        ("1000", "ok"),
        "{line:?}"
    );
    let out = node.mountinfo(&pod, &c);
    assert_eq!(pipe_mounts(&out), 1, "served once:\n{out}");
    assert_eq!(devices_served(&env), [serde_json::json!([GPU0])]);
    let spec = node.bundle_spec(&id);
    if through.path() == EntryPath::Nri {
        // The hook's spec: its prestart hook, none of the plugin's mounts or env.
        assert!(has_gpushare_hook(&spec), "{}", spec["hooks"]);
        let state = env.state.display().to_string();
        assert!(
            !spec["mounts"]
                .as_array()
                .unwrap()
                .iter()
                .any(|m| m["destination"] == "/tmp/nvidia-mps"
                    || m["source"].as_str().unwrap_or("").starts_with(&state)),
            "{}",
            spec["mounts"]
        );
        assert!(
            !spec["process"]["env"].to_string().contains("CUDA_MPS"),
            "{}",
            spec["process"]["env"]
        );
        let ids = env.daemon_ids();
        assert_eq!(node.gpushare_records(), [(ids[0].clone(), id.clone())]);
        assert_ne!(
            record_engines(&env),
            ["kubernetes-nri"],
            "the hook's record"
        );
        return;
    }
    // The shim served it: its createRuntime hook, and the CDI hook gone.
    let hooks = spec["hooks"].to_string();
    assert!(!hooks.contains("--cdi-device"), "{hooks}");
    assert_eq!(
        spec["hooks"]["createRuntime"].as_array().map(Vec::len),
        Some(1),
        "{hooks}"
    );

    // By the cdi.k8s.io annotation, a profile's device: its limit.
    let c = ContainerSpec {
        annotations: &[("cdi.k8s.io/gpushare", "gpushare.io/gpu=0-small")],
        ..ContainerSpec::user("annotation", 1000, &script)
    };
    node.run(&pod, &c);
    let line = node.client_line(&pod, &c);
    assert_eq!(line["active_thread_percentage"], "25.0", "{line:?}");
    assert_eq!(devices_served(&env).len(), 2);

    // A pod annotation asking for GPU 2 beside the CDI device: refused.
    let other = kube.pod(&PodSpec::user(
        "other",
        2000,
        &[("gpushare.io/device", "2")],
    ));
    let c = ContainerSpec {
        cdi_devices: &["gpushare.io/gpu=0"],
        ..ContainerSpec::user("redirect", 2000, &script)
    };
    kube.node.refuse(
        &other,
        &c,
        "gpushare.io/device=\"2\" is refused: it asks for something other than the container's CDI device gpushare.io/gpu=0",
    );
    assert!(!devices_served(&env).contains(&serde_json::json!([GPU2])));
    kube.node.remove_all();
}

entry_path_test! { a_cdi_device_of_gpushare_s_is_served_once:
    fn cri_containerd_1_7_serves_a_cdi_device_once_through_the_shim() = Shim(V1_7);
    fn cri_containerd2_serves_a_cdi_device_once_through_the_shim() = Shim(V2_1);
    fn nri_plugin_leaves_a_cdi_device_to_gpushare_s_hook() = Nri(V2_3);
}

/// A containerd before 2.3 tells NRI plugins no container user: a per-user request
/// through the plugin fails the container with one line naming what is needed, and
/// nothing is recorded or started (never served as UID 0).
fn a_per_user_request_is_refused_with_one_line(through: Through) {
    let env = Env::new();
    let mut kube = Kube::start(&env, through, &|_| {}).expect("a node");
    let pod = kube.pod(&PodSpec::user("old", 1000, &[("gpushare.io/device", "0")]));
    let node = &kube.node;
    node.refuse(
        &pod,
        &ContainerSpec::user("cuda", 1000, "true"),
        "gpushare: the container's user is unknown: containerd",
    );
    let err = node
        .try_run(&pod, &ContainerSpec::user("cuda2", 1000, "true"))
        .unwrap_err();
    assert!(
        err.message.contains("allowed is containerd 2.3.0 or later"),
        "{err}"
    );
    assert_eq!(node.gpushare_records(), vec![]);
}

entry_path_test! { a_per_user_request_is_refused_with_one_line:
    fn nri_plugin_on_containerd_2_1_refuses_a_per_user_request_with_one_line() = Nri(V2_1);
    // containerd 1.7 has NRI off unless configured: `enable_nri` turns it on.
    fn nri_plugin_on_containerd_1_7_refuses_a_per_user_request_with_one_line() = Nri(V1_7);
}
