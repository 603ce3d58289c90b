//! Nothing a container can write may steer a root process or another tenant — the daemon's
//! directories as a container sees them (read-only pipe directory, nosuid/nodev/noexec
//! mounts, through the shim and in hook-only mode), the 128-bit daemon id, and the
//! operator's ceilings on requests. Through real runc with the MPS simulator, whose
//! `client` stands in for a CUDA client.

use std::collections::BTreeMap;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;
use std::process::{Command, Output, Stdio};

use testkit::*;

const CLIENT: &str = "gpushare-mps-sim client";

/// What a tenant tries inside the container: reach the daemon, then replace the daemon's
/// pid file with a symlink (busybox `ln -sf` unlinks first: on a read-only mount the
/// unlink fails and the link then meets the existing file), plant a symlink where the
/// real daemon keeps `control_privileged`, remove the control socket, plant a directory
/// and a file. Each attempt prints `PLANTED <what>` if it succeeded; the container's
/// mount table follows `==mountinfo`.
fn tenant_script(pipe: &str) -> String {
    format!(
        "{CLIENT}; \
         ln -sf /etc/x {pipe}/nvidia-cuda-mps-control.pid 2>&1 && echo PLANTED ln-pid; \
         ln -s /etc/x {pipe}/control_privileged 2>&1 && echo PLANTED ln; \
         rm -f {pipe}/control 2>&1 && [ ! -e {pipe}/control ] && echo PLANTED rm; \
         mkdir {pipe}/d 2>&1 && echo PLANTED mkdir; \
         touch {pipe}/x 2>&1 && echo PLANTED touch; \
         echo ==mountinfo; cat /proc/self/mountinfo"
    )
}

/// The per-mount options (mountinfo field 6) of the topmost mount at `mount_point`.
fn mount_options(out: &str, mount_point: &str) -> Vec<String> {
    let text = out
        .split_once("==mountinfo\n")
        .unwrap_or_else(|| panic!("no mountinfo in the container's output:\n{out}"))
        .1;
    let line = text
        .lines()
        .rfind(|l| l.split(' ').nth(4) == Some(mount_point))
        .unwrap_or_else(|| panic!("nothing mounted at {mount_point}:\n{text}"));
    line.split(' ')
        .nth(5)
        .unwrap_or_default()
        .split(',')
        .map(str::to_owned)
        .collect()
}

fn assert_flags(out: &str, mount_point: &str, want: &[&str]) {
    let options = mount_options(out, mount_point);
    for flag in want {
        assert!(
            options.iter().any(|o| o == flag),
            "{mount_point} is mounted {options:?} in the container, without {flag}"
        );
    }
}

/// Name → (file type, inode) of each entry of a host directory.
fn snapshot(dir: &Path) -> BTreeMap<String, (String, u64)> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let m = std::fs::symlink_metadata(e.path()).unwrap();
            let t = m.file_type();
            let kind = if t.is_symlink() {
                "symlink"
            } else if t.is_socket() {
                "socket"
            } else if t.is_dir() {
                "dir"
            } else {
                "file"
            };
            (
                e.file_name().to_string_lossy().into_owned(),
                (kind.to_owned(), m.ino()),
            )
        })
        .collect()
}

/// The tenant's attempts all failed on a read-only file system, the client still reached
/// its daemon, and the host's pipe directory is exactly as the daemon left it.
fn assert_tenant_held_off(
    out: &str,
    uid: u32,
    host_pipe: &Path,
    before: &BTreeMap<String, (String, u64)>,
) {
    let line = client_line(out);
    assert_eq!(
        (line["shm"].as_str(), line["server_uid"].as_str()),
        ("ok", uid.to_string().as_str()),
        "the client reached its daemon through the read-only pipe directory:\n{out}"
    );
    assert!(
        !out.contains("PLANTED"),
        "uid {uid} planted into the pipe directory:\n{out}"
    );
    assert!(
        out.matches("Read-only file system").count() >= 4,
        "every attempt failed on a read-only file system:\n{out}"
    );
    assert_eq!(
        &snapshot(host_pipe),
        before,
        "the pipe directory on the host is unchanged"
    );
    assert!(std::fs::symlink_metadata(host_pipe.join("control"))
        .unwrap()
        .file_type()
        .is_socket());
}

#[test]
fn through_the_shim_the_pipe_dir_is_read_only_and_clients_still_reach_the_daemon() {
    let env = Env::with_config("container-log-dir = \"/var/log/nvidia-mps\"");
    for uid in [0, 1000] {
        let c = env
            .request(&format!("ro-{uid}"), uid, "0")
            .sh(&tenant_script("$CUDA_MPS_PIPE_DIRECTORY"))
            .create();
        let id = env.daemon_of(&c);
        let host_pipe = env.state.join("mps").join(&id).join("pipe");
        let before = snapshot(&host_pipe);
        assert!(before.contains_key("control"), "{before:?}");
        let out = c.run();
        assert_tenant_held_off(&out, uid, &host_pipe, &before);
        assert_flags(
            &out,
            "/tmp/nvidia-mps",
            &["ro", "nosuid", "nodev", "noexec"],
        );
        assert_flags(
            &out,
            "/var/log/nvidia-mps",
            &["ro", "nosuid", "nodev", "noexec"],
        );
        assert_flags(&out, "/dev/shm", &["rw", "nosuid", "nodev", "noexec"]);
        c.delete();
    }
}

/// Creates a container with plain runc (no shim) whose config.json carries gpushare's
/// hook-only hooks, as `hooks/oci-hooks.d` gives them to Podman and CRI-O.
pub fn hook_only_create(env: &Env, c: &Container) -> Output {
    hook_only_create_with(env, c, &[])
}

/// [`hook_only_create`], which must succeed.
pub fn must_hook_only_create(env: &Env, c: &Container) {
    let out = hook_only_create(env, c);
    assert!(
        out.status.success(),
        "hook-only create of {}: {}",
        c.id,
        String::from_utf8_lossy(&out.stderr)
    );
}

/// [`hook_only_create`], with `flags` after the prestart hook's stage (a CDI device's
/// `--cdi-device <device>`).
pub fn hook_only_create_with(env: &Env, c: &Container, flags: &[&str]) -> Output {
    let mut spec = c.config();
    let hook = |stage: &str, timeout: u64| {
        let mut args = vec!["gpushare", "hook", stage];
        if stage == "prestart" {
            args.extend_from_slice(flags);
        }
        serde_json::json!({
            "path": gpushare(),
            "args": args,
            "env": [
                "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                format!("GPUSHARE_CONFIG={}", env.config.display()),
            ],
            "timeout": timeout,
        })
    };
    spec["hooks"] = serde_json::json!({
        "prestart": [hook("prestart", 20)],
        "poststop": [hook("poststop", 10)],
    });
    std::fs::write(
        c.bundle.join("config.json"),
        serde_json::to_vec_pretty(&spec).unwrap(),
    )
    .unwrap();
    let stdout = std::fs::File::create(c.bundle.join("stdout")).unwrap();
    let stderr = std::fs::File::create(c.bundle.join("stderr")).unwrap();
    let status = Command::new(which("runc").unwrap())
        .arg("--root")
        .arg(&env.runc_root)
        .args(["create", "--bundle"])
        .arg(&c.bundle)
        .arg(&c.id)
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(stderr)
        .status()
        .unwrap();
    Output {
        status,
        stdout: c.stdout().into_bytes(),
        stderr: c.stderr().into_bytes(),
    }
}

/// Deletes the containers created with plain runc (the harness's Env deletes only those
/// it created through the shim); declared after the Env, so it runs first.
pub struct RuncDelete<'a>(pub &'a Env, pub Vec<String>);

impl Drop for RuncDelete<'_> {
    fn drop(&mut self) {
        for id in &self.1 {
            let _ = Command::new(which("runc").unwrap())
                .arg("--root")
                .arg(&self.0.runc_root)
                .args(["delete", "-f", id])
                .stderr(Stdio::null())
                .status();
        }
    }
}

#[test]
fn in_hook_only_mode_the_pipe_dir_is_read_only_and_the_shm_nosuid_nodev_noexec() {
    let env = Env::with_config("max-active-thread-percentage = 50");
    let _cleanup = RuncDelete(&env, vec!["ho-1000".into(), "ho-refused".into()]);
    let c = env
        .request("ho-1000", 1000, "0")
        .sh(&tenant_script("/tmp/nvidia-mps"))
        .bundle();
    must_hook_only_create(&env, &c);
    let id = env.daemon_ids().remove(0);
    let host_pipe = env.state.join("mps").join(&id).join("pipe");
    let before = snapshot(&host_pipe);
    let out = c.run();
    assert_tenant_held_off(&out, 1000, &host_pipe, &before);
    assert_flags(
        &out,
        "/tmp/nvidia-mps",
        &["ro", "nosuid", "nodev", "noexec"],
    );
    assert_flags(&out, "/dev/shm", &["rw", "nosuid", "nodev", "noexec"]);

    // The operator's ceiling holds in hook-only mode too, before any daemon.
    let r = env
        .request("ho-refused", 2000, "0")
        .annotation("gpushare.io/active-thread-percentage", "80")
        .bundle();
    let out = hook_only_create(&env, &r);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("gpushare.io/active-thread-percentage=\\\"80\\\" is above this node's mps.max-active-thread-percentage = 50; allowed is 1 to 50")
            || err.contains("gpushare.io/active-thread-percentage=\"80\" is above this node's mps.max-active-thread-percentage = 50; allowed is 1 to 50"),
        "{err}"
    );
    assert_eq!(
        env.daemon_ids(),
        vec![id],
        "no daemon for the refused request"
    );
}

#[test]
fn daemon_ids_are_128_bits_and_a_record_planted_under_another_id_is_not_trusted() {
    use gpushare::identity::Identity;
    let env = Env::new();
    let a = env.request("id-a", 1000, "0").sh(CLIENT).create();
    assert_eq!(client_line(&a.run())["server_uid"], "1000");
    let id_a = env.daemon_of(&a);
    assert_eq!(id_a.len(), 32, "{id_a}");
    assert!(
        id_a.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)),
        "{id_a}"
    );
    let ident_a: Identity = serde_json::from_str(
        a.config()["annotations"]["gpushare.io/identity"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(ident_a.id(), id_a);
    assert_eq!(
        env.daemon_ids(),
        vec![id_a.clone()],
        "directory named by the id"
    );

    // A victim's id is known in advance; a tenant plants a record there before the victim
    // comes: A's own record (it says it is daemon A), or one forged to carry the victim's
    // id with A's identity — both naming A's live supervisor and daemon.
    let record_a = env.record(&id_a);
    for (uid, forge_id) in [(2000, false), (3000, true)] {
        let victim = Identity {
            uid,
            gid: uid,
            ..ident_a.clone()
        };
        let id_v = victim.id();
        let mut forged = record_a.clone();
        if forge_id {
            forged["id"] = id_v.clone().into();
        }
        let dir = env.state.join("mps").join(&id_v);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("daemon.json"), forged.to_string()).unwrap();
        let v = env
            .request(&format!("id-v{uid}"), uid, "0")
            .sh(CLIENT)
            .create();
        assert_eq!(env.daemon_of(&v), id_v);
        let line = client_line(&v.run());
        assert_eq!(
            line["server_uid"],
            uid.to_string(),
            "the victim got a daemon of its own, not A's: {line:?}"
        );
        let rec = env.record(&id_v);
        assert_eq!(rec["id"], id_v.as_str());
        assert_eq!(rec["identity"]["uid"], uid);
        assert_ne!(rec["daemon"]["pid"], record_a["daemon"]["pid"]);
        assert_eq!(uid_and_capeff(env.daemon_pid(&id_v)).0, uid);
    }
    assert!(
        alive(env.daemon_pid(&id_a)),
        "A's daemon was left alone by the victims' creates"
    );
}

#[test]
fn a_request_above_an_operator_ceiling_is_refused_before_anything_is_created() {
    let env = Env::with_config(
        "default-active-thread-percentage = 25\nmax-active-thread-percentage = 50\nmax-pinned-memory-limit = \"4G\"",
    );
    for (key, value, line) in [
        (
            "gpushare.io/active-thread-percentage",
            "80",
            "gpushare: gpushare.io/active-thread-percentage=\"80\" is above this node's mps.max-active-thread-percentage = 50; allowed is 1 to 50",
        ),
        (
            "gpushare.io/pinned-memory-limit",
            "8G",
            "gpushare: gpushare.io/pinned-memory-limit=\"8G\" is above this node's mps.max-pinned-memory-limit = 4G; allowed is 1M to 4G",
        ),
    ] {
        let c = env
            .request(&format!("over-{}", &key[12..]), 1000, "0")
            .annotation(key, value)
            .bundle();
        let before = c.config_bytes();
        assert_eq!(
            c.refuse(), line);
        assert_eq!(c.config_bytes(), before, "config.json byte-identical");
        assert!(
            !env.state.join("mps").exists(),
            "no daemon directory: {:?}",
            env.daemon_ids()
        );
    }
    // Without a value the default applies, as before.
    let ok = env.request("under", 1000, "0").sh(CLIENT).create();
    let line = client_line(&ok.run());
    assert_eq!(percentage(&line), 25.0, "{line:?}");
}
