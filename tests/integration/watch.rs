//! The GPU process watcher (`gpushare watch`) end to end through runc: the simulator's
//! processes hold contexts that the fake NVML (fake_nvml.c) lists, each test on GPUs of
//! its own UUIDs, so that no test sees another's processes. What is asserted is what an
//! operator sees: which processes live or die, `status` (JSON, table, Prometheus), the
//! watcher's log line, the daemon's control log.

use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use serde_json::Value;

use testkit::*;

/// GPU UUIDs no other test (or run) uses.
fn unique_gpus() -> [String; 2] {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let base = (u64::from(std::process::id()) << 8) | u64::from(n);
    [0, 1].map(|i| format!("GPU-0fa4e000-0000-4000-9000-{:012x}", (base << 1) | i))
}

/// A child process that is stopped when the test ends, however it ends.
struct Stopped(Child);

impl Drop for Stopped {
    fn drop(&mut self) {
        stop_child(&mut self.0, Duration::from_secs(5));
    }
}

/// An env whose inventory is the fake NVML with `gpus`, and whose `[watch]` is `watch`.
fn watch_env(gpus: &[String; 2], watch: &str) -> Env {
    let mut env = Env::new();
    env.set_inventory("nvml");
    let mut config = std::fs::read_to_string(&env.config).unwrap();
    config.push_str(&format!("\n[watch]\ninterval = \"1s\"\n{watch}\n"));
    std::fs::write(&env.config, config).unwrap();
    let lib = crate::nvml::fake_nvml(env.path());
    env.set_var("LD_LIBRARY_PATH", &lib);
    env.set_var("FAKE_NVML_GPUS", gpus.join(","));
    env
}

fn start_watch(env: &Env) -> Stopped {
    Stopped(env.spawn_gpushare(&["watch"]))
}

/// The watcher's last report (`<state>/watch.json`), once there is one.
fn report(env: &Env) -> Option<Value> {
    let bytes = std::fs::read(env.state.join("watch.json")).ok()?;
    serde_json::from_slice(&bytes).ok()
}

/// The pid of the simulator client whose `--hold` is `marker` and whose `--gpu` is `gpu`.
fn client_pid(gpu: &str, marker: &str) -> Option<i32> {
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: i32 = e.file_name().to_str()?.parse().ok()?;
        // Read here, not with `cmdline`: a process may end between the listing and the read.
        let raw = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
        let args: Vec<String> = raw
            .split(|&b| b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        let has = |flag: &str, value: &str| args.windows(2).any(|w| w[0] == flag && w[1] == value);
        (args.first()?.ends_with("gpushare-mps-sim")
            && args.get(1).map(String::as_str) == Some("client")
            && has("--hold", marker)
            && has("--gpu", gpu)
            && alive(pid))
        .then_some(pid)
    })
}

fn wait_pid(gpu: &str, marker: &str) -> i32 {
    let mut pid = None;
    assert!(
        wait_until(Duration::from_secs(20), || {
            pid = client_pid(gpu, marker);
            pid.is_some()
        }),
        "no client --hold {marker} --gpu {gpu} appeared"
    );
    pid.unwrap()
}

/// The report's entry for `pid`, once a scan lists it.
fn listed(env: &Env, pid: i32, limit: Duration) -> Value {
    let mut found = None;
    assert!(
        wait_until(limit, || {
            found = report(env).and_then(|r| {
                r["processes"]
                    .as_array()?
                    .iter()
                    .find(|p| p["pid"] == pid)
                    .cloned()
            });
            found.is_some()
        }),
        "pid {pid} never listed: {:?}",
        report(env)
    );
    found.unwrap()
}

/// The first report's entry for container `id`'s process of `kind` with `gib` GiB: what
/// the first scan that listed it said of it (a process the watcher stops may be gone
/// before a test could find it in /proc).
fn first_listed(env: &Env, id: &str, kind: &str, gib: u64) -> Value {
    let mut found = None;
    assert!(
        wait_until(Duration::from_secs(20), || {
            found = report(env).and_then(|r| {
                r["processes"]
                    .as_array()?
                    .iter()
                    .find(|p| {
                        p["container_id"] == id
                            && p["kind"] == kind
                            && p["used_memory_bytes"] == gib << 30
                    })
                    .cloned()
            });
            found.is_some()
        }),
        "no {kind} process of {id} with {gib} GiB listed: {:?}",
        report(env)
    );
    found.unwrap()
}

/// Waits until the watcher has scanned three more times (within 10 s).
fn three_more_scans(env: &Env) {
    let scanned = |env: &Env| report(env).unwrap()["scanned_at"].as_u64().unwrap();
    let before = scanned(env);
    assert!(
        wait_until(Duration::from_secs(10), || scanned(env) >= before + 3),
        "the watcher did not scan three more times within 10 s"
    );
}

fn pid_of(entry: &Value) -> i32 {
    i32::try_from(entry["pid"].as_i64().unwrap()).unwrap()
}

/// A process on the host that uses `gpu` directly (no MPS daemon at its pipe directory).
fn host_direct(env: &Env, gpu: &str, marker: &str) -> Stopped {
    let empty = env.path().join("no-mps");
    std::fs::create_dir_all(&empty).unwrap();
    Stopped(
        Command::new(sim())
            .args(["client", "--gpu", gpu, "--alloc", "1G", "--hold", marker])
            .env("CUDA_MPS_PIPE_DIRECTORY", &empty)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

/// Container `id` served on GPU 0 with a 2G pinned limit, named as containerd's CRI
/// names a pod's container, running three processes: an MPS client with 1G (`.1`), one
/// that skips MPS (`.2`), and an MPS client that lifts its own limit and takes 3G (`.3`).
fn tenant<'a>(env: &'a Env, id: &str, gpu: &str) -> Container<'a> {
    let script = tenant_script(gpu);
    let c = env
        .request(id, 1000, "0")
        .annotation("gpushare.io/pinned-memory-limit", "2G")
        .annotation("io.kubernetes.cri.sandbox-namespace", "team-a")
        .annotation("io.kubernetes.cri.sandbox-name", "trainer")
        .annotation("io.kubernetes.cri.container-name", "main")
        .sh(&script)
        .create();
    c.start();
    c
}

fn tenant_script(gpu: &str) -> String {
    format!(
        "gpushare-mps-sim client --gpu {gpu} --alloc 1G --hold 300.1 &
         CUDA_MPS_PIPE_DIRECTORY=/nonexistent gpushare-mps-sim client --gpu {gpu} --alloc 1G --hold 300.2 &
         CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=1=64G gpushare-mps-sim client --gpu {gpu} --alloc 3G --hold 300.3 &
         wait"
    )
}

/// A container gpushare does not serve (no request), with a process that uses `gpu`
/// directly.
fn unserved<'a>(env: &'a Env, id: &str, gpu: &str) -> Container<'a> {
    let c = env
        .container(id)
        .uid(2000)
        .sh(&format!(
            "gpushare-mps-sim client --gpu {gpu} --alloc 2G --hold 300.5"
        ))
        .create();
    c.start();
    c
}

fn status_json(env: &Env) -> Value {
    let out = env.gpushare(&["status", "--json"]);
    assert!(out.status.success(), "{}", text(&out));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn watch_stops_a_served_process_outside_mps_and_ends_a_client_above_its_containers_limit() {
    let gpus = unique_gpus();
    let env = watch_env(&gpus, "policy = \"act\"\nmemory-margin = \"0\"");
    let _watch = start_watch(&env);
    let gpu = &gpus[0];
    let _host = host_direct(&env, gpu, "300.4");
    let host = wait_pid(gpu, "300.4");
    let other = unserved(&env, &format!("wu{}", std::process::id()), gpu);
    let outside = wait_pid(gpu, "300.5");
    let c = tenant(&env, &format!("wa{}", std::process::id()), gpu);
    let within = wait_pid(gpu, "300.1");

    // The process that skips MPS is stopped by the first scan that lists it.
    let seen = first_listed(&env, &c.id, "direct", 1);
    let direct = pid_of(&seen);
    assert_eq!(seen["container_id"].as_str(), Some(c.id.as_str()), "{seen}");
    let verdict = seen["verdict"].as_str().unwrap_or_default();
    assert!(verdict.starts_with("stopped: "), "{seen}");
    assert!(
        wait_until(Duration::from_secs(3), || !alive(direct)),
        "pid {direct} outlived its verdict: {seen}"
    );

    // The container's clients use 1G + 3G against 2G: the 3G one is ended, through its
    // daemon's terminate_client first, then killed; the 1G one stays.
    let seen = first_listed(&env, &c.id, "mps-client", 3);
    let over = pid_of(&seen);
    assert!(
        seen["verdict"]
            .as_str()
            .unwrap_or_default()
            .starts_with("ended: "),
        "{seen}"
    );
    assert!(
        wait_until(Duration::from_secs(3), || !alive(over)),
        "pid {over} outlived its verdict: {seen}"
    );
    let daemon = env.daemon_of(&c);
    let control = env.control_log(&daemon);
    assert!(
        control.contains(&format!("Client {over} terminated")),
        "{control}"
    );
    let log = env.gpushare_log();
    for line in [
        format!("watch: killed pid {direct} of pod team-a/trainer container main (container {})", c.id),
        format!("watch: terminate_client, then killed pid {over} of pod team-a/trainer container main (container {})", c.id),
    ] {
        assert!(log.contains(&line), "{line:?} in:\n{log}");
    }

    // Three more scans: nothing else is touched.
    three_more_scans(&env);
    for (pid, what) in [
        (within, "the client within the limit"),
        (host, "the host's process"),
        (outside, "the unserved container's process"),
    ] {
        assert!(alive(pid), "{what} (pid {pid}) was touched");
    }
    let r = report(&env).unwrap();
    assert_eq!(
        r["actions"],
        serde_json::json!({"stopped_direct": 1, "ended_clients": 1, "unconfirmed_terminations": 0, "failed": 0}),
        "{r}"
    );

    // status and the metrics name each pod's processes and memory.
    let status = status_json(&env);
    let procs = status["watch"]["processes"].as_array().unwrap().clone();
    let entry = |pid: i32| {
        procs
            .iter()
            .find(|p| p["pid"] == pid)
            .cloned()
            .unwrap_or_default()
    };
    let mine = entry(within);
    assert_eq!(
        mine["container_id"].as_str(),
        Some(c.id.as_str()),
        "{status}"
    );
    assert_eq!(
        (
            mine["namespace"].as_str(),
            mine["pod"].as_str(),
            mine["container"].as_str()
        ),
        (Some("team-a"), Some("trainer"), Some("main")),
        "{mine}"
    );
    assert_eq!(mine["used_memory_bytes"], 1u64 << 30, "{mine}");
    for pid in [host, outside] {
        let p = entry(pid);
        assert!(
            p["container_id"].is_null() && p["daemon"].is_null() && p["verdict"].is_null(),
            "{p}"
        );
        assert_eq!(p["kind"], "direct", "{p}");
    }
    assert!(
        procs
            .iter()
            .any(|p| p["kind"] == "mps-server" && p["daemon"] == daemon.as_str()),
        "{status}"
    );
    let table = env.status_text(&[]);
    assert!(
        table.contains(&format!(
            "gpu pid {within}  mps-client  GPU 0 {gpu}  1024MiB"
        )),
        "{table}"
    );
    assert!(
        table.contains(&format!("gpu pid {host}  direct  GPU 0 {gpu}  1024MiB")),
        "{table}"
    );
    assert!(
        table.contains("GPU processes of no container gpushare serves"),
        "{table}"
    );
    let metrics = env.status_text(&["--format", "prometheus"]);
    let series = format!(
        "gpushare_container_gpu_memory_used_bytes{{gpu=\"0\",UUID=\"{gpu}\",namespace=\"team-a\",pod=\"trainer\",container=\"main\",container_id=\"{}\",daemon=\"{daemon}\"}} 1073741824\n",
        c.id
    );
    assert!(metrics.contains(&series), "{series} in:\n{metrics}");
    assert!(
        metrics.contains(&format!(
            "gpushare_unserved_gpu_memory_used_bytes{{gpu=\"0\",UUID=\"{gpu}\"}} 3221225472\n"
        )),
        "{metrics}"
    );
    assert!(
        metrics.contains("gpushare_watch_actions_total{action=\"stop-direct\"} 1\n"),
        "{metrics}"
    );
    assert!(metrics.contains("gpushare_watch_up 1\n"), "{metrics}");
    // doctor says the watcher runs and with which policy.
    let out = env.gpushare(&["doctor"]);
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(
        report.lines().any(|l| l.starts_with("ok    watch ")
            && l.contains("gpushare watch scans every 1s, policy act:")),
        "{report}"
    );
    drop(other);
}

#[test]
fn watch_with_policy_report_touches_nothing_and_reports_everything() {
    let gpus = unique_gpus();
    let env = watch_env(&gpus, "policy = \"report\"\nmemory-margin = \"0\"");
    let _watch = start_watch(&env);
    let gpu = &gpus[0];
    let c = tenant(&env, &format!("wr{}", std::process::id()), gpu);
    let pids = ["300.1", "300.2", "300.3"].map(|m| wait_pid(gpu, m));
    for pid in pids {
        listed(&env, pid, Duration::from_secs(10));
    }
    three_more_scans(&env);
    for pid in pids {
        assert!(alive(pid), "pid {pid} was touched under policy report");
    }
    let r = report(&env).unwrap();
    assert_eq!(r["actions"]["stopped_direct"], 0, "{r}");
    assert_eq!(r["actions"]["ended_clients"], 0, "{r}");
    let verdict = |pid: i32| {
        r["processes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["pid"] == pid)
            .and_then(|p| p["verdict"].as_str())
            .unwrap_or_default()
            .to_owned()
    };
    assert!(verdict(pids[0]).is_empty(), "{r}");
    for pid in [pids[1], pids[2]] {
        let v = verdict(pid);
        assert!(
            v.ends_with("not acted on: watch.policy = \"report\""),
            "{v}"
        );
    }
    assert!(!env.gpushare_log().contains("watch: killed"));
    let daemon = env.daemon_of(&c);
    assert!(!env.control_log(&daemon).contains("terminate_client"));
}

/// The same through containerd's CRI plugin (a pod with the request annotations, as the
/// installer's `pod_annotations` passes them; a plain pod beside it), on the test
/// inventory with this test's own GPU UUIDs (the shim reads the file, the watcher NVML).
#[test]
fn watch_through_the_cri_plugin_stops_what_escapes_and_names_each_pod() {
    let gpus = unique_gpus();
    let env = watch_env(&gpus, "policy = \"act\"\nmemory-margin = \"0\"");
    env.set_inventory(&format!(
        "file:{}",
        env.path().join("inventory.json").display()
    ));
    let mut inventory = inventory_json();
    inventory["gpus"][0]["uuid"] = Value::from(gpus[0].clone());
    std::fs::write(env.path().join("inventory.json"), inventory.to_string()).unwrap();
    let _watch = start_watch(&env);
    let gpu = &gpus[0];
    let _host = host_direct(&env, gpu, "300.4");
    let host = wait_pid(gpu, "300.4");

    let mut node = Node::start(&env);
    let trainer = node.pod(&PodSpec {
        name: "trainer",
        namespace: "team-a",
        annotations: &[
            ("gpushare.io/device", "0"),
            ("gpushare.io/pinned-memory-limit", "2G"),
        ],
        run_as_user: Some(1000),
        ..Default::default()
    });
    let script = tenant_script(gpu);
    let main = ContainerSpec {
        name: "main",
        script: &script,
        run_as_user: Some(1000),
        ..Default::default()
    };
    let id = node.run(&trainer, &main);
    let plain = node.pod(&PodSpec {
        name: "plain",
        namespace: "team-b",
        run_as_user: Some(2000),
        ..Default::default()
    });
    let other_script = format!("gpushare-mps-sim client --gpu {gpu} --alloc 2G --hold 300.5");
    let other = ContainerSpec {
        name: "other",
        script: &other_script,
        run_as_user: Some(2000),
        ..Default::default()
    };
    node.run(&plain, &other);
    let (within, outside) = (wait_pid(gpu, "300.1"), wait_pid(gpu, "300.5"));

    let seen = first_listed(&env, &id, "direct", 1);
    let direct = pid_of(&seen);
    assert!(
        seen["verdict"]
            .as_str()
            .unwrap_or_default()
            .starts_with("stopped: "),
        "{seen}"
    );
    let seen_over = first_listed(&env, &id, "mps-client", 3);
    let over = pid_of(&seen_over);
    assert!(
        seen_over["verdict"]
            .as_str()
            .unwrap_or_default()
            .starts_with("ended: "),
        "{seen_over}"
    );
    assert!(
        wait_until(Duration::from_secs(3), || !alive(direct) && !alive(over)),
        "{seen} {seen_over}"
    );
    let daemon = node.daemon_of(&id).expect("the pod's daemon");
    // The daemon's log tmpfs is mounted in the node's namespace.
    let control = node
        .ns()
        .cmd("cat")
        .arg(env.state.join("mps").join(&daemon).join("log/control.log"))
        .output()
        .unwrap();
    let control = String::from_utf8_lossy(&control.stdout);
    assert!(
        control.contains(&format!("Client {over} terminated")),
        "{control}"
    );
    let log = env.gpushare_log();
    assert!(
        log.contains(&format!(
            "watch: killed pid {direct} of pod team-a/trainer container main (container {id})"
        )),
        "{log}"
    );
    three_more_scans(&env);
    for (pid, what) in [
        (within, "the client within the limit"),
        (host, "the host's process"),
        (outside, "the unserved pod's process"),
    ] {
        assert!(alive(pid), "{what} (pid {pid}) was touched");
    }
    let status = status_json(&env);
    assert_eq!(
        status["watch"]["actions"],
        serde_json::json!({"stopped_direct": 1, "ended_clients": 1, "unconfirmed_terminations": 0, "failed": 0}),
        "{status}"
    );
    let procs = status["watch"]["processes"].as_array().unwrap().clone();
    let mine = procs
        .iter()
        .find(|p| p["pid"] == within)
        .cloned()
        .unwrap_or_default();
    assert_eq!(
        (
            mine["namespace"].as_str(),
            mine["pod"].as_str(),
            mine["container"].as_str(),
            mine["container_id"].as_str()
        ),
        (
            Some("team-a"),
            Some("trainer"),
            Some("main"),
            Some(id.as_str())
        ),
        "{status}"
    );
    let theirs = procs
        .iter()
        .find(|p| p["pid"] == outside)
        .cloned()
        .unwrap_or_default();
    assert!(
        theirs["container_id"].is_null() && theirs["verdict"].is_null(),
        "{theirs}"
    );
    let metrics = env.status_text(&["--format", "prometheus"]);
    let series = format!(
        "gpushare_container_gpu_memory_used_bytes{{gpu=\"0\",UUID=\"{gpu}\",namespace=\"team-a\",pod=\"trainer\",container=\"main\",container_id=\"{id}\",daemon=\"{daemon}\"}} 1073741824\n"
    );
    assert!(metrics.contains(&series), "{series} in:\n{metrics}");
    node.remove_all();
}

/// A GPU whose processes NVML cannot list (the fake's FAKE_NVML_FAIL_LIST: a lost GPU)
/// costs that GPU's verdicts, never the other's: a served process outside MPS on GPU 0 is
/// still stopped by the first scan that lists it, while GPU 1 is shown as not listed in
/// the report, `status` and the metrics. With the whole-scan abort back, GPU 0's process
/// lives and this test fails.
#[test]
fn watch_with_one_gpu_unlistable_still_judges_and_stops_on_the_others() {
    let gpus = unique_gpus();
    let mut env = watch_env(&gpus, "policy = \"act\"\nmemory-margin = \"0\"");
    env.set_var("FAKE_NVML_FAIL_LIST", &gpus[1]);
    let _watch = start_watch(&env);
    let _lost = host_direct(&env, &gpus[1], "300.6");
    let c = tenant(&env, &format!("wl{}", std::process::id()), &gpus[0]);
    let seen = first_listed(&env, &c.id, "direct", 1);
    let direct = pid_of(&seen);
    assert!(
        seen["verdict"]
            .as_str()
            .unwrap_or_default()
            .starts_with("stopped: "),
        "{seen}"
    );
    assert!(
        wait_until(Duration::from_secs(3), || !alive(direct)),
        "pid {direct} outlived its verdict: {seen}"
    );
    three_more_scans(&env);
    let r = report(&env).unwrap();
    assert_eq!(r["error"], Value::Null, "{r}");
    let unlisted = r["unlisted"].as_array().cloned().unwrap_or_default();
    assert_eq!(unlisted.len(), 1, "{r}");
    assert_eq!(unlisted[0]["gpu_index"], 1, "{r}");
    assert_eq!(unlisted[0]["gpu"].as_str(), Some(gpus[1].as_str()), "{r}");
    assert!(
        unlisted[0]["error"]
            .as_str()
            .unwrap_or_default()
            .starts_with("cannot list the processes of GPU 1 through NVML (compute processes)"),
        "{r}"
    );
    assert!(r["gpu_list_failures"].as_u64().unwrap_or(0) >= 3, "{r}");
    let procs = r["processes"].as_array().unwrap();
    assert!(procs.iter().all(|p| p["gpu"] == gpus[0].as_str()), "{r}");
    assert!(
        procs.iter().any(|p| p["container_id"] == c.id.as_str()),
        "{r}"
    );
    assert_eq!(r["actions"]["stopped_direct"], 1, "{r}");

    let status = status_json(&env);
    assert_eq!(status["watch"]["unlisted"][0]["gpu_index"], 1, "{status}");
    let table = env.status_text(&[]);
    assert!(
        table.contains(&format!(
            "  └ GPU 1 {}: not listed in the last scan, none of its processes judged",
            gpus[1]
        )),
        "{table}"
    );
    let metrics = env.status_text(&["--format", "prometheus"]);
    assert!(
        metrics.contains(&format!(
            "gpushare_watch_gpu_unlisted{{gpu=\"1\",UUID=\"{}\"}} 1\n",
            gpus[1]
        )),
        "{metrics}"
    );
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("gpushare_watch_gpu_list_failures_total ")
                && l != "gpushare_watch_gpu_list_failures_total 0"),
        "{metrics}"
    );
    let log = env.gpushare_log();
    assert!(
        log.contains("watch: the processes of GPU 1 are not listed"),
        "{log}"
    );
}

/// A stopped watcher's last scan is not exported as the present: its per-process series
/// end, `gpushare_watch_up` says 0, the time of its last scan stays.
#[test]
fn a_stopped_watchers_processes_are_not_exported() {
    let gpus = unique_gpus();
    let env = watch_env(&gpus, "policy = \"report\"");
    let watch = start_watch(&env);
    let c = tenant(&env, &format!("ws{}", std::process::id()), &gpus[0]);
    first_listed(&env, &c.id, "mps-client", 1);
    let metrics = env.status_text(&["--format", "prometheus"]);
    assert!(
        metrics.contains("gpushare_container_gpu_memory_used_bytes{"),
        "{metrics}"
    );
    drop(watch);
    let metrics = env.status_text(&["--format", "prometheus"]);
    assert!(metrics.contains("gpushare_watch_up 0\n"), "{metrics}");
    for gone in [
        "gpushare_container_gpu_memory_used_bytes{",
        "gpushare_container_gpu_processes{",
        "gpushare_mps_server_gpu_memory_used_bytes{",
    ] {
        assert!(!metrics.contains(gone), "{gone} in:\n{metrics}");
    }
    assert!(
        metrics.lines().any(
            |l| l.starts_with("gpushare_watch_last_scan_timestamp_seconds ")
                && l != "gpushare_watch_last_scan_timestamp_seconds 0"
        ),
        "{metrics}"
    );
    drop(c);
}
