//! Every mode of the contract through real runc — multi-user, host IPC, advisory limits,
//! MIG, device lists, user namespaces, restarts.

use std::path::Path;
use std::time::Duration;

use testkit::*;

const CLIENT: &str = "gpushare-mps-sim client";

fn same_ns(pid: i64, ns: &str) -> bool {
    std::fs::read_link(format!("/proc/{pid}/ns/{ns}")).unwrap()
        == std::fs::read_link(format!("/proc/self/ns/{ns}")).unwrap()
}

#[test]
fn multi_user_serves_every_uid_from_one_root_daemon_at_once() {
    let env =
        Env::with_config("user-mode = \"multi-user\"\nmulti-user-flag = \"-multiuser-server\"");
    let [a, b] = env.two_users(["mu-a", "mu-b"], &format!("{CLIENT} --hold 1.5"));
    let [la, lb] = run_at_once([&a, &b]);
    assert_eq!(la["server"], lb["server"], "one server for both users");
    for l in [&la, &lb] {
        assert!(l["waited_ms"].parse::<u64>().unwrap() < 1000, "{l:?}");
        assert_eq!(l["server_uid"], "0");
        assert_eq!(l["shm"], "ok");
    }
    assert_eq!(la["uid"], "1000");
    assert_eq!(lb["uid"], "2000");
    let ids = env.daemon_ids();
    assert_eq!(ids.len(), 1, "{ids:?}");
    let pid = env.daemon_pid(&ids[0]);
    assert_eq!(uid_and_capeff(pid).0, 0, "the multi-user daemon is root's");
    assert!(
        cmdline(pid).contains(&"-multiuser-server".to_owned()),
        "{:?}",
        cmdline(pid)
    );
    assert_eq!(env.status()[0]["multi_user"], true);
}

#[test]
fn host_ipc_is_dockers_ipc_host_and_the_daemon_uses_the_hosts_shm() {
    let env = Env::with_config("ipc = \"host\"");
    let c = env
        .request("h1", 1000, "0")
        .sh(&format!("{CLIENT} --hold 1"))
        .create();
    c.start();
    let init = c.state().unwrap()["pid"].as_i64().unwrap();
    assert!(
        same_ns(init, "ipc"),
        "the container is in the host's IPC namespace"
    );
    assert_eq!(
        dev_of(Path::new(&format!("/proc/{init}/root/dev/shm"))),
        dev_of(Path::new("/dev/shm"))
    );
    c.wait();
    assert_eq!(
        client_line(&c.stdout())["shm"],
        "ok",
        "the daemon's server shares the host /dev/shm"
    );
    let cfg = c.config();
    assert!(!cfg["linux"]["namespaces"]
        .as_array()
        .unwrap()
        .iter()
        .any(|n| n["type"] == "ipc"));
    assert_eq!(cfg["annotations"]["gpushare.io/ipc-mode"], "host");
}

#[test]
fn ipc_override_only_where_allowed() {
    let env = Env::with_config("allow-ipc-override = true");
    let iso = env.request("o-iso", 1000, "0").sh(CLIENT).create();
    let host = env
        .request("o-host", 1000, "0")
        .annotation("gpushare.io/ipc", "host")
        .sh(&format!("{CLIENT} --hold 1"))
        .create();
    assert_eq!(client_line(&iso.run())["shm"], "ok");
    host.start();
    let init = host.state().unwrap()["pid"].as_i64().unwrap();
    assert!(same_ns(init, "ipc"));
    host.wait();
    assert_eq!(client_line(&host.stdout())["shm"], "ok");
    assert_ne!(
        env.daemon_of(&iso),
        env.daemon_of(&host),
        "host-IPC clients get a daemon on the host /dev/shm"
    );
}

#[test]
fn advisory_limits_are_client_env_only_with_one_daemon_per_user() {
    let env = Env::with_config("limits = \"advisory\"");
    let run = |name: &str, tp: &str| {
        let c = env
            .request(name, 1000, "0")
            .annotation("gpushare.io/active-thread-percentage", tp)
            .sh(&format!(
                "echo ENV=$CUDA_MPS_ACTIVE_THREAD_PERCENTAGE; {CLIENT}"
            ))
            .create();
        let out = c.run();
        assert!(out.contains(&format!("ENV={tp}")), "{out}");
        client_line(&out)["active_thread_percentage"]
            .parse::<f64>()
            .unwrap()
    };
    assert_eq!(run("adv25", "25"), 25.0);
    assert_eq!(run("adv50", "50"), 50.0);
    let ids = env.daemon_ids();
    assert_eq!(ids.len(), 1, "one daemon per (device, uid): {ids:?}");
    let log = env.control_log(&ids[0]);
    assert!(
        !log.contains("Cmd:set_default"),
        "no daemon-side limits under advisory:\n{log}"
    );
    assert_eq!(
        env.status()[0]["active_thread_percentage"],
        serde_json::Value::Null
    );
}

/// gpushare.io/client-priority only sets the client's CUDA_MPS_CLIENT_PRIORITY: the shim
/// passes it (and it splits no daemon: it is not part of the identity); hook-only mode,
/// which cannot set env, refuses it with one line, as it refuses a limit that only the
/// client variable carries (limits = "advisory"), before any daemon.
#[test]
fn client_priority_reaches_the_shims_clients_and_hook_only_mode_refuses_it() {
    use crate::tenant_mounts::{hook_only_create, RuncDelete};
    let env = Env::with_config("limits = \"advisory\"");
    let _cleanup = RuncDelete(&env, vec!["ho-prio".into(), "ho-adv".into()]);
    let low = env
        .request("prio-low", 1000, "0")
        .annotation("gpushare.io/client-priority", "1")
        .annotation("gpushare.io/active-thread-percentage", "25")
        .sh(CLIENT)
        .create();
    let line = client_line(&low.run());
    assert_eq!(line["client_priority"], "1");
    assert_eq!(percentage(&line), 25.0);
    let normal = env.request("prio-normal", 1000, "0").sh(CLIENT).create();
    assert_eq!(client_line(&normal.run())["client_priority"], "-");
    let ids = env.daemon_ids();
    assert_eq!(ids.len(), 1, "the priority splits no daemon: {ids:?}");

    for (id, key, value, var) in [
        (
            "ho-prio",
            "gpushare.io/client-priority",
            "1",
            "CUDA_MPS_CLIENT_PRIORITY",
        ),
        (
            "ho-adv",
            "gpushare.io/active-thread-percentage",
            "25",
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
        ),
    ] {
        let c = env
            .request(id, 2000, "0")
            .annotation(key, value)
            .sh(CLIENT)
            .bundle();
        let out = hook_only_create(&env, &c);
        assert!(
            !out.status.success(),
            "{id}: hook-only mode must refuse {key}"
        );
        let err = String::from_utf8_lossy(&out.stderr).replace("\\\"", "\"");
        let why = if key.ends_with("priority") {
            "only"
        } else {
            "under limits = \"advisory\" only"
        };
        assert!(
            err.contains(&format!(
                "{key}=\"{value}\" cannot be honoured in hook-only mode: {why} the client variable {var} carries it, and a hook cannot set the container's environment; allowed is gpushare-runtime (the shim: docker --runtime gpushare, RuntimeClass gpushare), which sets it, or no {key} here"
            )),
            "{id}: {err}"
        );
        assert_eq!(
            env.daemon_ids(),
            ids,
            "{id}: no daemon for a refused request"
        );
    }
}

#[test]
fn mig_devices_get_one_daemon_each_with_their_own_memory_limit() {
    let env = Env::new();
    let a = env
        .request("mig-a", 1000, "1:0")
        .annotation("gpushare.io/pinned-memory-limit", "8G")
        .sh(CLIENT)
        .create();
    let b = env.request("mig-b", 1000, MIG1).sh(CLIENT).create();
    assert_eq!(client_line(&a.run())["shm"], "ok");
    assert_eq!(client_line(&b.run())["shm"], "ok");
    let (da, db) = (env.daemon_of(&a), env.daemon_of(&b));
    assert_ne!(da, db, "one daemon per MIG device");
    assert!(environ(env.daemon_pid(&da)).contains(&format!("CUDA_VISIBLE_DEVICES={MIG0}")));
    assert!(environ(env.daemon_pid(&db)).contains(&format!("CUDA_VISIBLE_DEVICES={MIG1}")));
    assert!(env
        .control_log(&da)
        .contains("Cmd:set_default_device_pinned_mem_limit 0 8192M"));

    // The limit is checked against the MIG device's 10 GiB, not the GPU's 80 GiB.
    let big = env
        .request("mig-big", 1000, "1:2")
        .annotation("gpushare.io/pinned-memory-limit", "12G")
        .bundle();
    let msg = big.refuse();
    assert_names(&msg, &[MIG2, "allowed is 1M up to 10G"]);
}

#[test]
fn a_list_of_full_gpus_gets_one_daemon_for_the_set() {
    let env = Env::new();
    let c = env
        .request("list", 1000, "0,2")
        .annotation("gpushare.io/pinned-memory-limit", "2G")
        .sh(&format!(
            "echo MEM=$CUDA_MPS_PINNED_DEVICE_MEM_LIMIT; {CLIENT}"
        ))
        .create();
    let out = c.run();
    assert!(out.contains("MEM=0=2048M,1=2048M"), "{out}");
    assert_eq!(client_line(&out)["shm"], "ok");
    let ids = env.daemon_ids();
    assert_eq!(ids.len(), 1);
    assert!(
        environ(env.daemon_pid(&ids[0])).contains(&format!("CUDA_VISIBLE_DEVICES={GPU0},{GPU2}"))
    );
    let log = env.control_log(&ids[0]);
    for i in 0..2 {
        assert!(
            log.contains(&format!(
                "Cmd:set_default_device_pinned_mem_limit {i} 2048M"
            )),
            "{log}"
        );
    }
}

#[test]
fn user_namespaces_map_the_daemon_to_the_host_uid() {
    let env = Env::new();
    let c = env
        .container("userns")
        .uid(1000)
        .userns(100000, 65536)
        .device("0")
        .sh(&format!("id -u; {CLIENT}"))
        .create();
    let out = c.run();
    assert!(out.starts_with("1000\n"), "{out}");
    let line = client_line(&out);
    assert_eq!(line["shm"], "ok");
    assert_eq!(
        line["server_uid"], "101000",
        "the server runs as the container user's host uid"
    );
    let id = env.daemon_of(&c);
    assert_eq!(uid_and_capeff(env.daemon_pid(&id)).0, 101000);
    assert_eq!(c.config()["annotations"]["gpushare.io/host-uid"], "101000");

    let unmapped = env
        .container("unmapped")
        .uid(70000)
        .userns(100000, 65536)
        .device("0")
        .bundle();
    let msg = unmapped.refuse_untouched();
    assert_names(&msg, &["70000", "uidMappings"]);
}

#[test]
fn a_killed_daemon_is_restarted_with_its_limits_while_containers_use_it() {
    let env = Env::new();
    let holder = env
        .request("hold", 1000, "0")
        .annotation("gpushare.io/active-thread-percentage", "30")
        .sh("sleep 60")
        .create();
    holder.start();
    let id = env.daemon_of(&holder);
    let pid = env.kill_daemon(&id);
    // The supervisor restarts it on its own, within the start timeout.
    let restarted = env.daemon_restarted(&id, pid, Duration::from_secs(10));
    assert!(restarted, "record: {}", env.record(&id));
    assert_eq!(env.record(&id)["restarts"], 1);
    let log = env.control_log(&id);
    assert_eq!(
        log.matches("Cmd:set_default_active_thread_percentage 30")
            .count(),
        2,
        "limits re-applied:\n{log}"
    );
    let next = env.client("after", 1000, "30");
    let line = client_line(&next.run());
    assert_eq!(percentage(&line), 30.0);
    assert_eq!(env.daemon_of(&next), id);
    holder.delete();
}

fn gone(env: &Env, id: &str) -> bool {
    !env.state.join("mps").join(id).exists()
}

#[test]
fn an_idle_daemon_is_stopped_and_removed_and_comes_back_on_demand() {
    let env = Env::with_config("idle-timeout = \"1s\"");
    let c = env.request("idle1", 1000, "0").sh(CLIENT).create();
    assert_eq!(client_line(&c.run())["shm"], "ok");
    let id = env.daemon_of(&c);
    let rec = env.record(&id);
    let (sup, daemon) = (
        rec["supervisor"]["pid"].as_i64().unwrap() as i32,
        env.daemon_pid(&id),
    );
    c.delete();
    assert!(
        wait_until(Duration::from_secs(10), || gone(&env, &id)),
        "idle daemon removed"
    );
    assert!(
        wait_until(Duration::from_secs(5), || !alive(sup) && !alive(daemon)),
        "its processes ended"
    );
    let log = env.gpushare_log();
    assert!(
        log.contains("without containers; directories removed"),
        "{log}"
    );
    let again = env.request("idle2", 1000, "0").sh(CLIENT).create();
    assert_eq!(
        client_line(&again.run())["shm"],
        "ok",
        "a fresh daemon on the next create"
    );
}

#[test]
fn a_daemon_with_a_running_container_is_not_idle_but_a_stopped_one_does_not_count() {
    let env = Env::with_config("idle-timeout = \"1s\"");
    let holder = env.request("busy", 1000, "0").sh("sleep 60").create();
    holder.start();
    let id = env.daemon_of(&holder);
    // Several idle periods pass while the container runs: the daemon stays.
    assert!(
        !wait_until(Duration::from_secs(3), || gone(&env, &id)),
        "removed under a running container"
    );
    // Killed but not deleted (no poststop ran): its record is stale, the daemon goes idle.
    let out = env.runtime(&["kill", "busy", "KILL"], &holder.log());
    assert!(out.status.success(), "{out:?}");
    assert!(
        wait_until(Duration::from_secs(10), || gone(&env, &id)),
        "a stopped container does not hold the daemon"
    );
}

/// No daemon idles out under an MPS client, whatever the records say: a running client
/// whose container record is gone (deleted here by hand, as the sweep's race once did at
/// scale) keeps its daemon, with one warning, until it detaches.
#[test]
fn an_idle_daemon_with_a_client_but_no_record_keeps_running_until_the_client_ends() {
    let env = Env::with_config("idle-timeout = \"1s\"");
    let c = env
        .request("unrecorded", 1000, "0")
        .sh(&format!("{CLIENT} --hold 6"))
        .create();
    let id = env.daemon_of(&c);
    c.start();
    assert!(
        c.wait_stdout("server=", Duration::from_secs(10)),
        "the client attached: {}",
        c.stdout()
    );
    let daemon = env.daemon_pid(&id);
    let records = env.state.join("mps").join(&id).join("containers");
    std::fs::remove_file(records.join("unrecorded.json")).unwrap();
    // Several idle periods pass while the client runs: the daemon and its server stay.
    assert!(
        !wait_until(Duration::from_secs(4), || gone(&env, &id) || !alive(daemon)),
        "the daemon was stopped under a running client"
    );
    let log = env.gpushare_log();
    assert_eq!(
        log.matches("a client without a record").count(),
        1,
        "one warning: {log}"
    );
    c.wait();
    assert!(
        !c.stdout().contains("terminated"),
        "the client ran to its end: {}",
        c.stdout()
    );
    // Its client gone, the daemon idles out.
    assert!(
        wait_until(Duration::from_secs(10), || gone(&env, &id)),
        "the daemon idled out once its client ended"
    );
}

#[test]
fn gc_cleans_what_a_crash_left() {
    let env = Env::new();
    let c = env.request("gc1", 1000, "0").sh(CLIENT).create();
    assert_eq!(client_line(&c.run())["shm"], "ok");
    c.delete();
    let id = env.daemon_of(&c);
    let rec = env.record(&id);
    let (sup, daemon) = (
        rec["supervisor"]["pid"].as_i64().unwrap() as i32,
        env.daemon_pid(&id),
    );
    // The crash: supervisor and daemon die, a container record stays behind for a
    // container that no longer exists, and a removal was cut short.
    for p in [sup, daemon] {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(p),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    assert!(wait_until(Duration::from_secs(5), || !alive(sup) && !alive(daemon)));
    let containers = env.state.join("mps").join(&id).join("containers");
    std::fs::write(
        containers.join("ghost.json"),
        r#"{"id":"ghost","pid":2147483647,"bundle":null,"created_at":1}"#,
    )
    .unwrap();
    let tomb = env
        .state
        .join("mps")
        .join(".0123456789abcdef0123456789abcdef.removing");
    std::fs::create_dir_all(tomb.join("pipe")).unwrap();

    let out = env.gpushare(&["gc"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(text.contains("removed 1 stale container record"), "{text}");
    assert!(
        text.contains(&format!(
            "daemon {id}: supervisor gone and no containers; removed"
        )),
        "{text}"
    );
    assert!(text.contains("half-removed"), "{text}");
    assert!(gone(&env, &id) && !tomb.exists());
    assert!(
        !std::fs::read_to_string("/proc/mounts")
            .unwrap()
            .contains(&env.state.display().to_string()),
        "shm tmpfs unmounted"
    );

    // With a live container and a dead supervisor, gc brings the daemon back instead.
    let holder = env.request("gc2", 1000, "0").sh("sleep 60").create();
    holder.start();
    let id2 = env.daemon_of(&holder);
    let rec = env.record(&id2);
    for key in ["supervisor", "daemon"] {
        let p = rec[key]["pid"].as_i64().unwrap() as i32;
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(p),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    let old_sup = rec["supervisor"]["pid"].as_i64().unwrap() as i32;
    assert!(wait_until(Duration::from_secs(5), || !alive(old_sup)));
    let out = env.gpushare(&["gc"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("restarted"),
        "{text} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(env.record(&id2)["status"], "ready");
    assert!(alive(env.daemon_pid(&id2)));
    holder.delete();
}

#[test]
fn operators_start_list_and_stop_daemons_outside_containers() {
    let env = Env::new();
    let out = env.start_daemon("0", "1000", "40");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success() && text.starts_with("started daemon "),
        "{text} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let id = env.daemon_ids().remove(0);
    assert!(
        text.contains(&id) && text.contains("CUDA_MPS_PIPE_DIRECTORY="),
        "{text}"
    );
    // A container with the same identity uses the pre-started daemon.
    let c = env
        .request("pre", 1000, "0")
        .annotation("gpushare.io/active-thread-percentage", "40")
        .sh("sleep 60")
        .create();
    c.start();
    assert_eq!(env.daemon_of(&c), id);
    let list = env.gpushare(&["daemon", "list"]);
    let list = String::from_utf8_lossy(&list.stdout).into_owned();
    assert!(
        list.contains(&id) && list.contains("threads=40%") && list.contains("container pre"),
        "{list}"
    );
    // Bad input is one line naming the flag.
    let bad = env.start_daemon("0", "1000", "101");
    assert_eq!(bad.status.code(), Some(1));
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(
        err.contains("--active-thread-percentage=\"101\"") && err.contains("1 to 100"),
        "{err}"
    );
    // Without --uid (and not multi-user) it refuses rather than serve root silently.
    let no_uid = env.gpushare(&["daemon", "start", "--device", "0"]);
    assert_eq!(no_uid.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&no_uid.stderr).contains("--uid"));
    // Stopping a daemon that does not exist is an error, not a "stopped".
    let none = env.gpushare(&["daemon", "stop", "--id", "0123456789abcdef0123456789abcdef"]);
    assert_eq!(none.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&none.stderr)
        .contains("no daemon 0123456789abcdef0123456789abcdef"));
    // Stop refuses while a container uses it, then stops with --force.
    let refused = env.gpushare(&["daemon", "stop", "--id", &id]);
    assert_eq!(refused.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&refused.stderr).contains("used by 1 container(s) (pre)"));
    let pid = env.daemon_pid(&id);
    let sup = env.record(&id)["supervisor"]["pid"].as_i64().unwrap() as i32;
    assert!(
        !daemon_cgroups(&[sup]).is_empty(),
        "the supervisor has cgroups of its own"
    );
    let forced = env.gpushare(&["daemon", "stop", "--all", "--force"]);
    assert!(forced.status.success(), "{forced:?}");
    assert!(!alive(pid) || wait_until(Duration::from_secs(5), || !alive(pid)));
    assert!(gone(&env, &id));
    // The supervisor's last step removes its cgroup `gpushare/<id>-<pid>` in every
    // hierarchy, once the daemon's servers have left it.
    assert!(
        wait_until(Duration::from_secs(5), || daemon_cgroups(&[sup]).is_empty()),
        "left: {:?}",
        daemon_cgroups(&[sup])
    );
    c.delete();
}
