//! The MPS v3 backend (`mps.protocol = "v3"`) through real runc and the simulator's v3:
//! one server for every UID, a namespace per container made and capped before its first
//! process, only its directory in the container, remade after a daemon restart, deleted
//! at the container's end, the cgroup's device memory limit through `nvidia-smi`; and what
//! keeps a legacy daemon (a host-root container, `auto` on a driver before 615).

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use testkit::*;

const CLIENT: &str = "gpushare-mps-sim client";
const V3: &str = "protocol = \"v3\"";

/// `namespace list` of daemon `id`'s server as root sees it: (name, pinned, percentage).
fn namespaces(env: &Env, id: &str) -> Vec<(String, String, String)> {
    let out = root_cli(
        env,
        id,
        &["namespace", "list", "--server=s", "--format=csv,noheader"],
    );
    assert!(out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split(',').collect();
            (f[0].to_owned(), f[3].to_owned(), f[4].to_owned())
        })
        .collect()
}

/// One v3 command against daemon `id`'s top-level `control`, as root.
fn root_cli(env: &Env, id: &str, args: &[&str]) -> std::process::Output {
    Command::new(env.sim())
        .args(args)
        .env(
            "CUDA_MPS_PIPE_DIRECTORY",
            env.state.join("mps").join(id).join("pipe"),
        )
        .output()
        .unwrap()
}

/// The name of a container's namespace, from its config.json's pipe mount.
fn namespace_of(c: &Container) -> String {
    let mounts = c.config()["mounts"].as_array().unwrap().clone();
    let pipe = mounts
        .iter()
        .find(|m| m["destination"] == "/tmp/nvidia-mps")
        .expect("the pipe mount");
    let source = PathBuf::from(pipe["source"].as_str().unwrap());
    assert_eq!(
        source.parent().unwrap().file_name().unwrap(),
        "s",
        "only the namespace's directory is bound: {source:?}"
    );
    source.file_name().unwrap().to_string_lossy().into_owned()
}

/// Container `id` of user `uid` on GPU 0 at `pct` % of its threads, running `script`;
/// created.
fn capped<'e>(env: &'e Env, id: &str, uid: u32, pct: &str, script: &str) -> Container<'e> {
    capped_as(env.request(id, uid, "0"), pct, script)
}

/// `container` at `pct` % of its threads, running `script`; created.
fn capped_as<'e>(container: ContainerBuilder<'e>, pct: &str, script: &str) -> Container<'e> {
    container
        .annotation("gpushare.io/active-thread-percentage", pct)
        .sh(script)
        .create()
}

#[test]
fn two_uids_share_one_server_each_in_its_own_capped_namespace() {
    let env = Env::with_config(V3);
    let a = capped_as(
        env.request("v3-a", 1000, "0")
            .annotation("gpushare.io/pinned-memory-limit", "1G"),
        "30",
        &format!("{CLIENT} --hold 1.5"),
    );
    let b = capped(&env, "v3-b", 2000, "60", &format!("{CLIENT} --hold 1.5"));
    let (na, nb) = (namespace_of(&a), namespace_of(&b));
    assert_ne!(na, nb);
    let ids = env.daemon_ids();
    assert_eq!(ids.len(), 1, "one daemon for both UIDs: {ids:?}");
    let id = &ids[0];
    // Made and capped before either container's first process.
    let listed = namespaces(&env, id);
    assert!(
        listed.contains(&(na.clone(), "1G".into(), "30.00".into())),
        "{listed:?}"
    );
    assert!(
        listed.contains(&(nb.clone(), "unlimited".into(), "60.00".into())),
        "{listed:?}"
    );
    assert!(
        listed
            .iter()
            .any(|(n, _, p)| n == "default" && p == "10.00"),
        "the server's default namespace is capped: {listed:?}"
    );
    let [la, lb] = run_at_once([&a, &b]);
    assert_eq!(la["server"], lb["server"], "one server for both users");
    for (l, ns, uid, pct) in [(&la, &na, "1000", "30"), (&lb, &nb, "2000", "60")] {
        assert_eq!(&l["namespace"], ns, "{l:?}");
        assert_eq!(l["server_name"], "s");
        assert_eq!(l["uid"], uid);
        assert_eq!(
            l["active_thread_percentage"].parse::<f64>().unwrap(),
            pct.parse::<f64>().unwrap(),
            "{l:?}"
        );
        assert!(l["waited_ms"].parse::<u64>().unwrap() < 1000, "{l:?}");
    }
    let pid = env.daemon_pid(id);
    assert_eq!(uid_and_capeff(pid).0, 0, "the v3 daemon is root's");
    let args = std::fs::read_to_string(format!("/proc/{pid}/cmdline")).unwrap();
    assert!(args.split('\0').any(|a| a == "-m"), "{args:?}");
    assert_eq!(env.record(id)["identity"]["v3"], true);
    // The containers' ends delete their namespaces.
    a.delete();
    b.delete();
    let left = namespaces(&env, id);
    assert!(
        !left.iter().any(|(n, _, _)| *n == na || *n == nb),
        "{left:?}"
    );
}

#[test]
fn a_tenant_cannot_raise_its_namespace_s_limits_through_its_own_socket() {
    let env = Env::with_config(V3);
    let ns = identity_namespace("v3-raise");
    let c = env.request("v3-raise", 1000, "0")
        .annotation("gpushare.io/active-thread-percentage", "20")
        .sh(&format!(
            "gpushare-mps-sim namespace set {ns} --server=s --active-thread-percentage=100; echo rc=$?; {CLIENT}"
        ))
        .create();
    assert_eq!(namespace_of(&c), ns);
    let out = c.run();
    assert!(out.contains("rc=1"), "{out}\n{}", c.stderr());
    assert!(
        c.stderr().contains(
            "Insufficient privileges for UID 1000. 'NAMESPACE SET' requires server owner."
        ),
        "{}",
        c.stderr()
    );
    let line = client_line(&out);
    assert_eq!(
        line["active_thread_percentage"].parse::<f64>().unwrap(),
        20.0
    );
    c.delete();
}

/// The namespace gpushare names for container `id`: `c` and 20 hex digits of SHA-256.
fn identity_namespace(id: &str) -> String {
    use sha2::Digest;
    let d = sha2::Sha256::digest(id.as_bytes());
    format!(
        "c{}",
        d[..10]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    )
}

#[test]
fn a_restarted_daemon_gets_every_running_container_s_namespace_back() {
    let env = Env::with_config(V3);
    let holder = capped(&env, "v3-hold", 1000, "40", "sleep 60");
    holder.start();
    let ns = namespace_of(&holder);
    let id = env.daemon_of(&holder);
    let pid = env.daemon_pid(&id);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let restarted = wait_until(Duration::from_secs(10), || {
        let rec = env.record(&id);
        rec["status"] == "ready"
            && rec["daemon"]["pid"]
                .as_i64()
                .is_some_and(|p| p as i32 != pid)
    });
    assert!(restarted, "record: {}", env.record(&id));
    let listed = namespaces(&env, &id);
    assert!(
        listed.contains(&(ns.clone(), "unlimited".into(), "40.00".into())),
        "{listed:?}"
    );
    // The running container's bound directory is the one the new socket is in.
    let exec = Command::new("runc")
        .args(["--root"])
        .arg(&env.runc_root)
        .args([
            "exec",
            "--user",
            "1000:1000",
            "v3-hold",
            "gpushare-mps-sim",
            "client",
        ])
        .output()
        .unwrap();
    let line = client_line(&String::from_utf8_lossy(&exec.stdout));
    assert_eq!(line["namespace"], ns, "{exec:?}");
    assert_eq!(
        line["active_thread_percentage"].parse::<f64>().unwrap(),
        40.0
    );
    holder.delete();
}

#[test]
fn the_container_s_cgroup_gets_its_pinned_limit_as_its_hard_device_memory_limit() {
    let mut env = Env::with_config(&format!("{V3}\ncgroup-memory-limit = \"on\""));
    // Device memory limits need cgroup v2, which this machine may not mount: runc, the
    // hooks and the daemon run in a mount namespace with cgroup v2 at /sys/fs/cgroup.
    let mounts = PrivateMounts::with("mount -t cgroup2 gs-cgroup2 /sys/fs/cgroup");
    env.enter(&mounts);
    let smi = env.path().join("bin/nvidia-smi");
    std::os::unix::fs::symlink(env.sim(), &smi).unwrap();
    let cfg = std::fs::read_to_string(&env.config).unwrap();
    std::fs::write(
        &env.config,
        cfg.replace(
            "[mps]\n",
            &format!("[mps]\nnvidia-smi = {:?}\n", smi.display().to_string()),
        ),
    )
    .unwrap();
    let c = env
        .request("v3-mem", 1000, "0")
        .annotation("gpushare.io/pinned-memory-limit", "2G")
        .sh("cat /proc/self/cgroup")
        .create();
    let log = std::fs::read_to_string(env.path().join("bin/memory-limits.jsonl")).unwrap();
    let set: serde_json::Value = serde_json::from_str(log.lines().next().unwrap()).unwrap();
    assert_eq!(set["hard_mib"], 2048, "{log}");
    assert_eq!(
        set["soft_mib"],
        serde_json::Value::Null,
        "no soft limit: {log}"
    );
    assert_eq!(set["gpu"], inventory_json()["gpus"][0]["uuid"], "{log}");
    let state = c.state().expect("created");
    let pid = state["pid"].as_i64().unwrap();
    let cgroup = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    let rel = cgroup
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .unwrap()
        .trim();
    assert_ne!(rel, "/", "runc made the container a cgroup of its own");
    assert_eq!(
        set["cgroup"],
        format!("/sys/fs/cgroup{rel}"),
        "the container's own cgroup"
    );
    c.delete();
}

#[test]
fn host_root_and_mig_keep_a_legacy_daemon_and_auto_before_615_stays_legacy() {
    let env = Env::with_config(V3);
    // Host root, and a MIG device (GPU 1's first): each a legacy daemon, no namespace.
    for (id, uid, device) in [("v3-root", 0, "0"), ("v3-mig", 1000, "1:0")] {
        let c = env.request(id, uid, device).sh(CLIENT).create();
        let line = client_line(&c.run());
        assert!(!line.contains_key("namespace"), "{id}: {line:?}");
        assert_eq!(
            env.record(&env.daemon_of(&c))["identity"].get("v3"),
            None,
            "{id}"
        );
        c.delete();
    }

    let auto = Env::with_config("protocol = \"auto\"");
    let c = auto.request("auto-580", 1000, "0").sh(CLIENT).create();
    assert_eq!(
        inventory_json()["driver_version"]
            .as_str()
            .unwrap()
            .split('.')
            .next(),
        Some("580")
    );
    let line = client_line(&c.run());
    assert!(!line.contains_key("namespace"), "{line:?}");
    assert_eq!(auto.record(&auto.daemon_of(&c))["identity"].get("v3"), None);
    c.delete();

    let mut inv = inventory_json();
    inv["driver_version"] = "615.71.09".into();
    let auto = Env::with_config("protocol = \"auto\"");
    std::fs::write(auto.path().join("inventory.json"), inv.to_string()).unwrap();
    let c = auto.request("auto-615", 1000, "0").sh(CLIENT).create();
    let line = client_line(&c.run());
    assert_eq!(line["server_name"], "s", "{line:?}");
    c.delete();
}

/// Hook-only mode (hooks.d's prestart) and a CDI device's hook, in hook-only mode and
/// through the shim: each container gets its own namespace, made and capped before its
/// first process, bound at CUDA's default pipe directory (hook-only) or at
/// `container-pipe-dir` (the shim); their ends delete them.
#[test]
fn hook_only_mode_and_cdi_devices_get_a_namespace_each() {
    use crate::tenant_mounts::{hook_only_create, hook_only_create_with, RuncDelete};
    let env = Env::with_config(V3);
    let _cleanup = RuncDelete(&env, vec!["ho-v3".into(), "ho-cdi-v3".into()]);
    let ho = env
        .request("ho-v3", 1000, "0")
        .annotation("gpushare.io/active-thread-percentage", "25")
        .sh(CLIENT)
        .bundle();
    let out = hook_only_create(&env, &ho);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let cdi = env.container("ho-cdi-v3").uid(2000).sh(CLIENT).bundle();
    let out = hook_only_create_with(&env, &cdi, &["--cdi-device", "0"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The CDI device's hook through the shim: the spec carries it as the engine copied it.
    let shim = env.container("shim-cdi-v3").uid(3000).sh(CLIENT).bundle();
    let mut spec = shim.config();
    spec["hooks"] = serde_json::json!({"prestart": [{
        "path": gpushare(),
        "args": ["gpushare", "hook", "prestart", "--cdi-device", "0"],
    }]});
    std::fs::write(
        shim.bundle.join("config.json"),
        serde_json::to_vec(&spec).unwrap(),
    )
    .unwrap();
    let out = shim.try_create();
    assert!(out.status.success(), "{}", shim.last_error());
    let id = env.daemon_of(&shim);
    assert_eq!(
        env.daemon_ids(),
        std::slice::from_ref(&id),
        "one v3 daemon for the three paths"
    );
    let listed = namespaces(&env, &id);
    for (c, pct) in [(&ho, "25.00"), (&cdi, "100.00"), (&shim, "100.00")] {
        let ns = identity_namespace(&c.id);
        assert!(
            listed.iter().any(|(n, _, p)| *n == ns && p == pct),
            "{}: {listed:?}",
            c.id
        );
        let line = client_line(&c.run());
        assert_eq!(line["namespace"], ns, "{}: {line:?}", c.id);
    }
    for c in [&ho, &cdi] {
        let out = Command::new("runc")
            .arg("--root")
            .arg(&env.runc_root)
            .args(["delete", &c.id])
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
    }
    shim.delete();
    let left = namespaces(&env, &id);
    assert!(
        left.iter().all(|(n, _, _)| n == "default"),
        "every end deleted its namespace: {left:?}"
    );
}

/// Points env's `mps.control-binary` at `<env>/bin/control`, a wrapper that runs the
/// simulator after `lines` (gpushare runs the control binary with a cleared environment,
/// so the wrapper is where the simulator's own variables can be set).
fn control_wrapper(env: &Env, lines: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let wrapper = env.path().join("bin/control");
    std::fs::write(
        &wrapper,
        format!("#!/bin/sh\n{lines}exec {:?} \"$@\"\n", env.sim()),
    )
    .unwrap();
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).unwrap();
    let text = std::fs::read_to_string(&env.config).unwrap();
    let named = format!("control-binary = {:?}", env.sim().display().to_string());
    let renamed = text.replace(
        &named,
        &format!("control-binary = {:?}", wrapper.display().to_string()),
    );
    std::fs::write(&env.config, renamed).unwrap();
    wrapper
}

#[test]
fn auto_on_615_asks_the_control_binary_and_one_that_refuses_protocol_3_keeps_legacy() {
    let mut inv = inventory_json();
    inv["driver_version"] = "615.71.09".into();
    let auto = Env::with_config("protocol = \"auto\"");
    std::fs::write(auto.path().join("inventory.json"), inv.to_string()).unwrap();
    control_wrapper(&auto, "export GPUSHARE_SIM_PROTOCOLS=2\n");
    assert!(std::fs::read_to_string(&auto.config)
        .unwrap()
        .contains("bin/control\""));
    let cache = auto.state.join("mps-protocol.json");
    let remembered = || -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(&cache).expect("the probe's answer is cached"))
            .unwrap()
    };

    for name in ["auto-615-p2", "auto-615-p2-again"] {
        let c = auto
            .container(name)
            .uid(1000)
            .device("0")
            .sh(CLIENT)
            .create();
        let line = client_line(&c.run());
        assert!(!line.contains_key("namespace"), "{line:?}");
        assert_eq!(auto.record(&auto.daemon_of(&c))["identity"].get("v3"), None);
        c.delete();
    }
    assert_eq!(remembered()["speaks_v3"], false);
    let wrapper = auto.path().join("bin/control");
    assert_eq!(
        remembered()["binary"]["path"],
        wrapper.display().to_string()
    );
    assert_eq!(remembered()["binary"]["driver_version"], "615.71.09");

    // The binary changes (a driver upgrade): asked again, and this one speaks v3.
    control_wrapper(&auto, "");
    let c = auto
        .container("auto-615-p3")
        .uid(1000)
        .device("0")
        .sh(CLIENT)
        .create();
    let line = client_line(&c.run());
    assert_eq!(line["server_name"], "s", "{line:?}");
    assert_eq!(remembered()["speaks_v3"], true);
    c.delete();
}

#[test]
fn status_shows_a_v3_daemon_s_namespaces_their_limits_and_clients() {
    // The supervisor's check (which deletes a namespace no record names) stays away for
    // the test's length.
    let env = Env::with_config(&format!("{V3}\nlimit-check-interval = \"60s\""));
    let c = env
        .container("v3-status")
        .uid(1000)
        .device("0")
        .annotation("gpushare.io/active-thread-percentage", "30")
        .annotation("gpushare.io/pinned-memory-limit", "1G")
        .sh(&format!("{CLIENT} --hold 30"))
        .create();
    let ns = namespace_of(&c);
    let id = env.daemon_of(&c);
    let made = root_cli(&env, &id, &["namespace", "create", "orphan", "--server=s"]);
    assert!(made.status.success(), "{made:?}");
    c.start();
    // The client attaches once the container's process runs.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let daemon = loop {
        let daemons = env.status();
        let d = daemons
            .as_array()
            .unwrap()
            .iter()
            .find(|d| d["id"] == id.as_str())
            .cloned()
            .expect("the daemon in status");
        let mine = d["namespaces"]
            .as_array()
            .and_then(|a| a.iter().find(|n| n["name"] == ns.as_str()).cloned());
        if mine.as_ref().is_some_and(|n| n["clients"] == 1) {
            break d;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no client in the namespace: {d:#}"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(daemon["protocol"], "v3");
    assert_eq!(daemon["clients"], 1);
    let namespaces = daemon["namespaces"].as_array().unwrap();
    let find = |name: &str| namespaces.iter().find(|n| n["name"] == name).cloned();
    let mine = find(&ns).unwrap();
    assert_eq!(mine["kind"], "container");
    assert_eq!(mine["container_id"], "v3-status");
    assert_eq!(mine["active_thread_percentage"], 30);
    assert_eq!(mine["pinned_memory_limit_bytes"], 1u64 << 30);
    assert_eq!(mine["listed"], true);
    let orphan = find("orphan").unwrap_or_else(|| panic!("{namespaces:?}"));
    assert_eq!(orphan["kind"], "unrecorded");
    assert_eq!(orphan["container_id"], serde_json::Value::Null);
    assert_eq!(orphan["clients"], 0);
    assert_eq!(find("default").unwrap()["kind"], "default");

    let table = env.status_text(&[]);
    let prom = env.status_text(&["--format", "prometheus"]);
    for (text, want) in [
        (&table, "  └ container v3-status  ".to_owned()),
        (&table, format!("  ns={ns}  threads=30%  mem=1024M  clients=1\n")),
        (&table, "  └ ns=orphan  threads=100%  clients=0  (no container record names it)\n".to_owned()),
        (&prom, format!("gpushare_namespace_clients{{daemon=\"{id}\",device=\"{GPU0}\",uid=\"multi\",mps_namespace=\"{ns}\",container_id=\"v3-status\"}} 1\n")),
        (&prom, format!("gpushare_namespace_info{{daemon=\"{id}\",device=\"{GPU0}\",uid=\"multi\",mps_namespace=\"orphan\",container_id=\"\",kind=\"unrecorded\"}} 1\n")),
    ] {
        assert!(text.contains(&want), "{want:?} in\n{text}");
    }
    c.delete();
}

/// A tenant that holds every connection its namespace's socket takes (the only socket in
/// its container) jams only that socket: the daemon's own `control`, which gpushare's
/// commands use, is root's alone and not in any container, so another tenant's container
/// still gets its namespace made and capped, and its client is served.
#[test]
fn a_tenant_holding_its_namespace_socket_jams_no_other_tenant_and_not_gpushare() {
    let env = Env::with_config(V3);
    let jam = capped(
        &env,
        "v3-jam",
        1000,
        "20",
        "gpushare-mps-sim hold-control 80",
    );
    jam.start();
    let id = env.daemon_of(&jam);
    let leaf = env
        .state
        .join("mps")
        .join(&id)
        .join("pipe/s")
        .join(namespace_of(&jam));
    // The jam is real: its namespace's socket answers nobody, not even root.
    let jammed = || {
        !Command::new(env.sim())
            .args(["namespace", "list", "--format=csv,noheader"])
            .env("CUDA_MPS_PIPE_DIRECTORY", &leaf)
            .output()
            .unwrap()
            .status
            .success()
    };
    assert!(
        wait_until(Duration::from_secs(20), jammed),
        "the namespace's socket was never jammed: {}",
        jam.stdout()
    );
    let other = capped(&env, "v3-other", 2000, "30", CLIENT);
    let ns = namespace_of(&other);
    let line = client_line(&other.run());
    assert_eq!(line["namespace"], ns, "{line:?}");
    assert_eq!(
        line["active_thread_percentage"].parse::<f64>().unwrap(),
        30.0
    );
    assert!(jammed(), "still jammed while the other tenant was served");
    other.delete();
    assert!(
        !namespaces(&env, &id).iter().any(|(n, _, _)| *n == ns),
        "the other tenant's end deleted its namespace through control"
    );
    jam.delete();
}
