//! Hostile input and confinement, through real runc. Every test here fails when the
//! protection it names is removed; SECURITY.md maps each claim to its test.

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};

use testkit::*;

const CLIENT: &str = "gpushare-mps-sim client";

/// Writes a bundle whose config.json is `bytes`, returns the container.
fn raw_bundle<'a>(env: &'a Env, id: &str, edit: impl FnOnce(&mut Vec<u8>)) -> Container<'a> {
    let c = env.container(id).uid(1000).bundle();
    let mut bytes = c.config_bytes();
    edit(&mut bytes);
    std::fs::write(c.bundle.join("config.json"), &bytes).unwrap();
    c
}

fn set_annotation(bytes: &mut Vec<u8>, key: &str, raw_json_value: &str) {
    let text = String::from_utf8(bytes.clone()).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["annotations"] = serde_json::json!({});
    let placeholder = "\"@@VALUE@@\"";
    v["annotations"][key] = serde_json::Value::String("@@VALUE@@".into());
    *bytes = serde_json::to_string(&v)
        .unwrap()
        .replace(placeholder, raw_json_value)
        .into_bytes();
}

#[test]
fn hostile_values_are_rejected_before_any_path_mount_or_command() {
    let env = Env::new();
    let huge = format!("\"{}\"", "0".repeat(1 << 20));
    // Raw JSON string literals, as a hostile container author would write them.
    let cases: Vec<(&str, String)> = vec![
        ("gpushare.io/device", r#""0\u0000""#.into()),
        ("gpushare.io/device", r#""0\n1""#.into()),
        ("gpushare.io/device", r#""../../etc""#.into()),
        ("gpushare.io/device", r#""/dev/nvidia0""#.into()),
        ("gpushare.io/device", r#""0;touch /tmp/pwned""#.into()),
        (
            "gpushare.io/device",
            r#""GPU-8f8bff94-112e-9541-43da-cfd453333404/../x""#.into(),
        ),
        ("gpushare.io/device", huge),
        ("gpushare.io/pinned-memory-limit", r#""1G\u0000""#.into()),
        ("gpushare.io/active-thread-percentage", r#""50\r""#.into()),
    ];
    for (i, (key, raw)) in cases.iter().enumerate() {
        let c = raw_bundle(&env, &format!("h{i}"), |b| {
            set_annotation(b, key, raw);
            if *key != "gpushare.io/device" {
                // Also ask for a device so the bad key is the one that fails.
                let s = String::from_utf8(b.clone()).unwrap().replacen(
                    "\"annotations\":{",
                    "\"annotations\":{\"gpushare.io/device\":\"0\",",
                    1,
                );
                *b = s.into_bytes();
            }
        });
        let before = c.config_bytes();
        let out = c.try_create();
        assert_eq!(out.status.code(), Some(1), "{key}={raw:.40}");
        let msg = c.last_error();
        assert!(
            msg.contains(key) && msg.contains("allowed"),
            "{key}: {msg:.300}"
        );
        assert!(
            !msg.contains('\n') && !msg.contains('\0'),
            "one escaped line: {msg:?}"
        );
        assert!(
            msg.len() < 600,
            "a huge value is cut in the message ({} bytes)",
            msg.len()
        );
        assert_eq!(c.config_bytes(), before);
    }
    // The same through the environment.
    let c = env
        .container("henv")
        .uid(1000)
        .env("GPUSHARE_DEVICE=0\n1")
        .bundle();
    assert_eq!(c.try_create().status.code(), Some(1));
    assert!(
        c.last_error().contains("GPUSHARE_DEVICE=\"0\\n1\""),
        "{}",
        c.last_error()
    );
    // Non-UTF-8 bytes inside an annotation: not JSON text at all, refused as such.
    let c = raw_bundle(&env, "h-utf8", |b| {
        set_annotation(b, "gpushare.io/device", "\"0@\"");
        let at = b.iter().position(|&x| x == b'@').unwrap();
        b[at] = 0xff;
    });
    let before = c.config_bytes();
    assert_eq!(c.try_create().status.code(), Some(1));
    assert!(
        c.last_error().contains("not a valid OCI runtime spec"),
        "{}",
        c.last_error()
    );
    assert_eq!(c.config_bytes(), before);
    assert!(
        !env.state.exists(),
        "nothing was created on the host for any of them"
    );
    assert!(!Path::new("/tmp/pwned").exists());
}

#[test]
fn a_request_spelled_with_json_escapes_is_still_seen() {
    // The shim skips parsing a config.json whose bytes cannot hold a request; JSON can
    // spell "gpushare" without those letters, through \u escapes. Such a request must not
    // slip past (it would run a GPU container without its MPS daemon).
    let env = Env::new();
    let c = raw_bundle(&env, "esc-u", |b| {
        set_annotation(b, "gpushare.io/device", "\"0\"");
        let text = String::from_utf8(b.clone()).unwrap();
        let escaped = text.replace("\"gpushare.io/device\"", r#""\u0067pushare.io/device""#);
        assert_ne!(escaped, text);
        *b = escaped.into_bytes();
    });
    let bytes = c.config_bytes();
    assert!(
        !bytes
            .to_ascii_lowercase()
            .windows(8)
            .any(|w| w == b"gpushare"),
        "the bundle spells gpushare only through the escape: {}",
        String::from_utf8_lossy(&bytes)
    );
    let out = c.try_create();
    assert!(out.status.success(), "{}", c.last_error());
    assert!(
        c.config()["annotations"]["gpushare.io/daemon"].is_string(),
        "the escaped request was served: {}",
        c.config()
    );
    assert_eq!(env.daemon_ids().len(), 1);
}

#[test]
fn escaping_ids_and_planted_symlinks_are_refused() {
    let env = Env::new();
    // A container id built to escape the state directory.
    let c = env.request("esc", 1000, "0").bundle();
    let log = c.log();
    let out = env
        .cmd(runtime())
        .arg("--root")
        .arg(&env.runc_root)
        .arg("--log")
        .arg(&log)
        .args(["--log-format", "json", "create", "--bundle"])
        .arg(&c.bundle)
        .arg("../../gs-escape")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        c.last_error()
            .contains("container id \"../../gs-escape\" is invalid"),
        "{}",
        c.last_error()
    );
    assert!(!env.state.exists() && !env.path().join("gs-escape.json").exists());

    // config.json planted as a symlink to a file outside the bundle: refused, target untouched.
    let outside = env.path().join("outside.json");
    std::fs::copy(c.bundle.join("config.json"), &outside).unwrap();
    let before = std::fs::read(&outside).unwrap();
    std::fs::remove_file(c.bundle.join("config.json")).unwrap();
    std::os::unix::fs::symlink(&outside, c.bundle.join("config.json")).unwrap();
    assert_eq!(c.try_create().status.code(), Some(1));
    assert!(
        c.last_error().contains("a symlink is refused"),
        "{}",
        c.last_error()
    );
    assert_eq!(std::fs::read(&outside).unwrap(), before);

    // A symlink planted inside the state directory: refused, nothing written through it.
    let elsewhere = env.path().join("elsewhere");
    std::fs::create_dir_all(&elsewhere).unwrap();
    std::fs::create_dir_all(&env.state).unwrap();
    std::fs::set_permissions(
        &env.state,
        std::os::unix::fs::PermissionsExt::from_mode(0o711),
    )
    .unwrap();
    std::os::unix::fs::symlink(&elsewhere, env.state.join("mps")).unwrap();
    let d = env.request("sym", 1000, "0").bundle();
    assert_eq!(d.try_create().status.code(), Some(1));
    assert!(
        d.last_error().contains("unusable") && d.last_error().contains("symlink"),
        "{}",
        d.last_error()
    );
    assert_eq!(
        std::fs::read_dir(&elsewhere).unwrap().count(),
        0,
        "nothing written through the link"
    );

    // A state dir that others can write: refused.
    std::fs::remove_file(env.state.join("mps")).unwrap();
    std::fs::set_permissions(
        &env.state,
        std::os::unix::fs::PermissionsExt::from_mode(0o777),
    )
    .unwrap();
    let e = env.request("open", 1000, "0").bundle();
    assert_eq!(e.try_create().status.code(), Some(1));
    assert!(
        e.last_error()
            .contains("must not be writable by group or others"),
        "{}",
        e.last_error()
    );
}

#[test]
fn a_preload_library_in_the_container_env_never_reaches_hook_supervisor_or_daemon() {
    let env = Env::new();
    let marker = env.path().join("owned");
    let src = env.path().join("evil.c");
    let lib = env.path().join("evil.so");
    std::fs::write(
        &src,
        format!(
            "#include <stdio.h>\n#include <unistd.h>\n__attribute__((constructor)) static void owned(void) {{ FILE *f = fopen(\"{}\", \"a\"); if (f) {{ fprintf(f, \"%d\\n\", getpid()); fclose(f); }} }}\n",
            marker.display()
        ),
    )
    .unwrap();
    let cc = Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(&lib)
        .arg(&src)
        .output()
        .expect("a C compiler (gcc) builds the planted library");
    assert!(
        cc.status.success(),
        "{}",
        String::from_utf8_lossy(&cc.stderr)
    );
    // Control: the library does announce itself when a process loads it.
    assert!(Command::new("true")
        .env("LD_PRELOAD", &lib)
        .status()
        .unwrap()
        .success());
    assert!(marker.exists(), "the planted library works when loaded");
    std::fs::remove_file(&marker).unwrap();

    let preload = format!("LD_PRELOAD={}", lib.display());
    let libpath = format!("LD_LIBRARY_PATH={}", env.path().display());
    let c = env
        .request("preload", 1000, "0")
        .env(&preload)
        .env(&libpath)
        .sh("true") // busybox is static: the container itself never loads it either
        .create();
    c.run();
    c.delete();
    let id = env.daemon_of(&c);
    assert!(
        !environ(env.daemon_pid(&id))
            .iter()
            .any(|e| e.starts_with("LD_")),
        "{:?}",
        environ(env.daemon_pid(&id))
    );
    for hook in c.config()["hooks"]["createRuntime"].as_array().unwrap() {
        assert!(hook["env"]
            .as_array()
            .unwrap()
            .iter()
            .all(|e| !e.as_str().unwrap().starts_with("LD_")));
    }
    assert!(
        !marker.exists(),
        "loaded by pid(s) {}",
        std::fs::read_to_string(&marker).unwrap_or_default()
    );
}

#[test]
fn a_per_user_daemon_is_confined_to_its_own_directories() {
    let env = Env::new();
    let [a, b] = env.two_users(["ua", "ub"], CLIENT);
    a.run();
    b.run();
    let (ida, idb) = (env.daemon_of(&a), env.daemon_of(&b));
    let mps = env.state.join("mps");
    let as_uid = |uid: u32, script: &str| {
        Command::new("/bin/sh")
            .args(["-c", script])
            .uid(uid)
            .gid(uid)
            .stderr(Stdio::null())
            .status()
            .unwrap()
            .success()
    };
    // uid 1000 may write only its own daemon's directories.
    for dir in [
        env.state.clone(),
        mps.clone(),
        mps.join(&ida),
        mps.join(&ida).join("containers"),
        env.state.join("locks"),
        mps.join(&idb).join("pipe"),
        mps.join(&idb).join("shm"),
    ] {
        assert!(
            !as_uid(1000, &format!("touch {}/x", dir.display())),
            "uid 1000 wrote into {}",
            dir.display()
        );
    }
    for dir in [mps.join(&ida).join("pipe"), mps.join(&ida).join("shm")] {
        assert!(
            as_uid(
                1000,
                &format!("touch {}/x && rm {}/x", dir.display(), dir.display())
            ),
            "its own {}",
            dir.display()
        );
    }
    // Another uid cannot even reach the daemon's control socket.
    let out = Command::new(env.sim())
        .arg("client")
        .env("CUDA_MPS_PIPE_DIRECTORY", mps.join(&ida).join("pipe"))
        .uid(2000)
        .gid(2000)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("Permission denied"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let pid = env.daemon_pid(&ida);
    let (uid, capeff) = uid_and_capeff(pid);
    assert_eq!((uid, capeff), (1000, 0));
}

#[test]
fn env_requests_are_refused_when_disabled() {
    let env = Env::with_configs("accept-env-requests = false", "");
    let c = env
        .container("noenv")
        .uid(1000)
        .env("GPUSHARE_DEVICE=0")
        .bundle();
    let msg = c.refuse_untouched();
    assert_names(
        &msg,
        &[
            "GPUSHARE_DEVICE=\"0\" is refused",
            "accept-env-requests = false",
            "gpushare.io/device",
        ],
    );
    // The annotation still works.
    let ok = env.request("ann", 1000, "0").sh(CLIENT).create();
    assert_eq!(client_line(&ok.run())["shm"], "ok");
}

#[test]
fn a_tenant_cannot_raise_enforced_limits_from_inside() {
    let env = Env::new();
    let c = env
        .request("greedy", 1000, "0")
        .annotation("gpushare.io/active-thread-percentage", "25")
        .annotation("gpushare.io/pinned-memory-limit", "1G")
        .sh(&format!(
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100 CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=20G {CLIENT}"
        ))
        .create();
    let line = client_line(&c.run());
    assert_eq!(percentage(&line), 25.0, "{line:?}");
    assert_eq!(line["pinned_mem_limit"], "0=1024M", "{line:?}");
    let log = env.control_log(&env.daemon_of(&c));
    assert!(
        log.contains("active_thread_percentage=25"),
        "the server was started with the enforced value:\n{log}"
    );
}

/// A container whose own env sets `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` beside an enforced
/// pinned limit is refused, through the shim and in hook-only mode (where nothing would
/// overwrite it): on NVIDIA's driver an entry naming a device the client cannot see
/// (`1=64G`) lifts the daemon's limit for that client. Without a pinned limit the variable
/// is the container's own business.
#[test]
fn a_client_memory_limit_in_the_container_env_is_refused_beside_an_enforced_one() {
    let env = Env::new();
    let _cleanup = crate::tenant_mounts::RuncDelete(&env, vec!["lift-ho".into()]);
    let lifted = |id: &str| {
        env.request(id, 1000, "0")
            .annotation("gpushare.io/pinned-memory-limit", "2G")
            .env("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=1=64G")
            .sh(CLIENT)
            .bundle()
    };
    let c = lifted("lift-shim");
    let msg = c.refuse_untouched();
    assert_names(
        &msg,
        &[
            "process.env sets CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=1=64G",
            "lifts its daemon's limit (2048M here)",
            "gpushare.io/pinned-memory-limit",
        ],
    );
    assert!(
        env.daemon_ids().is_empty(),
        "no daemon for a refused create"
    );

    let h = lifted("lift-ho");
    let out = crate::tenant_mounts::hook_only_create(&env, &h);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "hook-only create succeeded");
    assert!(
        err.contains("process.env sets CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"),
        "{err}"
    );
    assert!(env.daemon_ids().is_empty(), "no daemon for a refused hook");

    // No pinned limit: the variable stays the container's own.
    let free = env
        .request("own-limit", 1000, "0")
        .env("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=1G")
        .sh(CLIENT)
        .create();
    assert_eq!(client_line(&free.run())["pinned_mem_limit"], "0=1G");
}

/// A process holding namespaces of its own (`unshare <flags> sleep`), as a pod's sandbox
/// does; killed and reaped on drop.
struct Holder(std::process::Child);

impl Holder {
    /// `flags` for unshare(1); with `--user`, the namespace maps container ids 0.. to host
    /// ids `200000..` (65536), written here as runc writes a new namespace's maps.
    fn new(flags: &[&str]) -> Holder {
        let child = Command::new(need("unshare", "util-linux"))
            .args(flags)
            .args(["sleep", "600"])
            .stdin(Stdio::null())
            .spawn()
            .unwrap();
        let holder = Holder(child);
        let pid = holder.pid();
        let ours = |ns: &str| std::fs::read_link(format!("/proc/self/ns/{ns}")).ok();
        let theirs = |ns: &str| std::fs::read_link(format!("/proc/{pid}/ns/{ns}")).ok();
        let ns = if flags.contains(&"--user") {
            "user"
        } else {
            "ipc"
        };
        assert!(
            wait_until(std::time::Duration::from_secs(10), || theirs(ns).is_some()
                && theirs(ns) != ours(ns)),
            "unshare {flags:?} made no namespace"
        );
        if ns == "user" {
            for map in ["uid_map", "gid_map"] {
                std::fs::write(format!("/proc/{pid}/{map}"), "0 200000 65536\n").unwrap();
            }
        }
        holder
    }

    fn pid(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Item 4 of the security issue: a container that joins a user namespace by path — the
/// spec containerd's CRI gives the containers of a `hostUsers: false` pod, the sandbox's
/// namespace with its mappings — is served as its host UID (uid 1000 → host 201000), never
/// as its unmapped UID (the real uid 1000's daemons, which it cannot use, and whose
/// per-UID cap it filled); one joined without mappings is mapped through the namespace's
/// own maps, or refused when they cannot be read; and the createRuntime hook refuses a
/// daemon UID the container's namespace does not map.
#[test]
fn a_joined_user_namespace_is_served_as_the_container_s_host_uid() {
    let env = Env::new();
    let holder = Holder::new(&["--user"]);
    let ns = format!("/proc/{}/ns/user", holder.pid());
    let joined = |id: &str, ns_path: &str, mappings: bool| {
        let c = env.request(id, 1000, "0").sh(CLIENT).bundle();
        let mut v = c.config();
        v["linux"]["namespaces"]
            .as_array_mut()
            .unwrap()
            .push(serde_json::json!({"type": "user", "path": ns_path}));
        if mappings {
            let m = serde_json::json!([{"containerID": 0, "hostID": 200000, "size": 65536}]);
            v["linux"]["uidMappings"] = m.clone();
            v["linux"]["gidMappings"] = m;
        }
        std::fs::write(c.bundle.join("config.json"), v.to_string()).unwrap();
        c
    };

    // containerd's shape: joined by path, with the mappings.
    let c = joined("joined", &ns, true);
    let out = c.try_create();
    assert!(out.status.success(), "{}", c.last_error());
    assert_eq!(c.config()["annotations"]["gpushare.io/host-uid"], "201000");
    let line = client_line(&c.run());
    assert_eq!(line["server_uid"], "201000", "{line:?}");
    assert_eq!(line["shm"], "ok");
    let id = env.daemon_of(&c);
    assert_eq!(env.record(&id)["identity"]["uid"], 201000);
    assert_eq!(uid_and_capeff(env.daemon_pid(&id)).0, 201000);

    // Joined by /proc/<pid>/ns/user without mappings: that namespace's own maps. (runc
    // itself may not run such a spec; gpushare's decision is what is checked.)
    let c = joined("joined-nomap", &ns, false);
    let _ = c.try_create();
    let v = c.config();
    assert_eq!(
        v["annotations"]["gpushare.io/host-uid"],
        "201000",
        "{}",
        c.last_error()
    );

    // Joined by a path whose maps gpushare cannot read, without mappings: one line.
    let c = joined("joined-elsewhere", "/run/gs-userns-test/pod", false);
    let before = c.config_bytes();
    assert_eq!(
        c.refuse(), "gpushare: linux.namespaces joins the user namespace \"/run/gs-userns-test/pod\" without linux.uidMappings, and gpushare cannot read that namespace's maps to find the container user's host uid; allowed is a user namespace joined as /proc/<pid>/ns/user, or one given with linux.uidMappings and gidMappings");
    assert_eq!(c.config_bytes(), before);

    // The hook's own check: a decision for host uid 1000 (a container without a user
    // namespace) handed to the hook for a process in the 200000 namespace is refused.
    let plain = env.request("plain", 1000, "0").sh("true").create();
    let ann = plain.config()["annotations"].clone();
    assert_eq!(ann["gpushare.io/host-uid"], "1000");
    let state = serde_json::json!({
        "ociVersion": "1.0.2", "id": "forged-userns", "status": "creating",
        "pid": holder.pid(), "bundle": plain.bundle, "annotations": ann,
    });
    let out = env.gpushare_with_stdin(&["hook", "create-runtime"], state.to_string().as_bytes());
    assert!(!out.status.success());
    assert_eq!(
        String::from_utf8_lossy(&out.stderr).trim(),
        "gpushare: the daemon's host uid 1000 is no user of the container's user namespace, which maps host uids 200000-265535: the decision was made for another namespace; allowed is a spec whose linux.uidMappings are those of the user namespace it joins"
    );
}

/// Item 7 of the security issue: where `mps.allow-ipc-override = true`, a pod's container
/// (here: one that joins its sandbox's IPC namespace by path, as containerd's CRI and
/// Podman pods make them) that asks `gpushare.io/ipc: host` is refused in one line, never
/// given the host's IPC namespace and `/dev/shm` (a host secret there stays unread); a
/// container of its own IPC namespace (Docker's, ctr's) still gets the override.
#[test]
fn a_pod_s_container_never_gets_the_host_s_ipc_by_annotation() {
    let env = Env::with_config("allow-ipc-override = true");
    let sandbox = Holder::new(&["--ipc"]);
    let secret = format!("/dev/shm/gs-ipc-secret-{}", std::process::id());
    std::fs::write(&secret, "host-secret\n").unwrap();
    struct Rm(String);
    impl Drop for Rm {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
    let _rm = Rm(secret.clone());
    let c = env
        .request("pod-member", 1000, "0")
        .annotation("gpushare.io/ipc", "host")
        .sh(&format!("cat {secret}"))
        .bundle();
    let mut v = c.config();
    for n in v["linux"]["namespaces"].as_array_mut().unwrap() {
        if n["type"] == "ipc" {
            n["path"] = format!("/proc/{}/ns/ipc", sandbox.pid()).into();
        }
    }
    std::fs::write(c.bundle.join("config.json"), v.to_string()).unwrap();
    let before = c.config_bytes();
    assert_eq!(c.try_create().status.code(), Some(1), "{}", c.stdout());
    assert_eq!(
        c.last_error(),
        format!("gpushare: gpushare.io/ipc=\"host\" is refused: the container's pod has an IPC namespace of its own (linux.namespaces joins \"/proc/{}/ns/ipc\"), and gpushare never gives a pod the host's; allowed is isolated, or hostIPC: true on the pod (which admission sees) and then nothing from gpushare", sandbox.pid())
    );
    assert_eq!(c.config_bytes(), before);
    assert!(env.daemon_ids().is_empty());

    // A container with a new IPC namespace of its own: the operator's override stands.
    let own = env
        .request("own-ipc", 1000, "0")
        .annotation("gpushare.io/ipc", "host")
        .sh(&format!("cat {secret}"))
        .create();
    assert_eq!(own.run(), "host-secret\n");
}

/// The decision annotations (`gpushare.io/daemon`, `gpushare.io/identity`) are what
/// gpushare-runtime writes for its own hooks; a container's author can write them too.
/// Through the shim they decide nothing: a container without a request passes through
/// with no gpushare hook and no daemon, and one with a request gets the shim's decision,
/// which replaces the forged one (a uid-0, 100 % identity that hashes to its own id).
#[test]
fn forged_decision_annotations_decide_nothing_through_the_shim() {
    forged_decisions(&Env::new());
}

fn forged_decisions<'a>(env: &'a Env) {
    use gpushare::identity::Identity;
    let forged = Identity {
        devices: vec![inventory_json()["gpus"][0]["uuid"].as_str().unwrap().into()],
        uid: 0,
        gid: 0,
        multi_user: false,
        limits: [(&gpushare::request::ACTIVE_THREAD_PERCENTAGE, 100)]
            .into_iter()
            .collect(),
        ipc_host: true,
        tenant: None,
        v3: false,
    };
    let (forged_id, forged_json) = (forged.id(), serde_json::to_string(&forged).unwrap());
    let forge = |b: ContainerBuilder<'a>| -> Container<'a> {
        b.annotation("gpushare.io/daemon", &forged_id)
            .annotation("gpushare.io/identity", &forged_json)
            .create()
    };
    let plain = forge(env.container("forged-plain").uid(1000).sh("echo plain"));
    assert!(
        plain
            .config()
            .get("hooks")
            .is_none_or(|h| !h.to_string().contains("gpushare")),
        "no gpushare hook on a container without a request: {}",
        plain.config()["hooks"]
    );
    assert_eq!(plain.run().trim(), "plain");
    assert!(
        env.daemon_ids().is_empty(),
        "no daemon: {:?}",
        env.daemon_ids()
    );

    let served = forge(
        env.request("forged-served", 1000, "0")
            .annotation("gpushare.io/active-thread-percentage", "25")
            .sh(CLIENT),
    );
    let line = client_line(&served.run());
    assert_eq!(line["server_uid"], "1000", "{line:?}");
    assert_eq!(percentage(&line), 25.0, "{line:?}");
    let id = env.daemon_of(&served);
    assert_ne!(id, forged.id());
    assert_eq!(env.daemon_ids(), vec![id.clone()]);
    assert_eq!(served.config()["annotations"]["gpushare.io/daemon"], id);
}
