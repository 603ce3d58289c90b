//! `driver-root` end to end: a node laid out as NVIDIA's GPU Operator lays it out (the
//! driver's files under a root of their own, none on the host's paths), reproduced with a
//! fake driver tree in the test's temp dir: the simulator as its
//! `nvidia-cuda-mps-control`, the fake NVML (nvml.rs) as its `libnvidia-ml.so.1`, and
//! stand-in `libcuda.so.1` and `libc.so.6` files. Also doctor's warning for a toolkit
//! runtime that is listed first and missing.

use std::path::{Path, PathBuf};

use testkit::*;

/// The driver version fake_nvml.c reports.
const FAKE_DRIVER: &str = "550.54.15";
/// The UUID fake_nvml.c reports for its GPU 1.
const FAKE_GPU1: &str = "GPU-0fa4e000-0000-4000-8000-00000000a301";

/// A driver tree at `<dir>/driver`, as a driver container's: libraries in the multiarch
/// directory, versioned, with `.so.1` links beside them. The control binary is in `bin`;
/// `usr/bin`, searched first, holds an absolute link to `decoy` (a file on the host,
/// outside the tree), which inside the tree leads nowhere.
fn driver_tree(dir: &Path, decoy: &Path) -> PathBuf {
    use std::os::unix::fs::{symlink, PermissionsExt};
    let root = dir.join("driver");
    let lib = root.join(format!("usr/lib/{}-linux-gnu", std::env::consts::ARCH));
    std::fs::create_dir_all(&lib).unwrap();
    std::fs::create_dir_all(root.join("bin")).unwrap();
    std::fs::create_dir_all(root.join("usr/bin")).unwrap();
    let control = root.join("bin/nvidia-cuda-mps-control");
    if std::fs::hard_link(sim(), &control).is_err() {
        std::fs::copy(sim(), &control).unwrap();
        std::fs::set_permissions(&control, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    symlink(decoy, root.join("usr/bin/nvidia-cuda-mps-control")).unwrap();
    let built = crate::nvml::fake_nvml(dir).join("libnvidia-ml.so.1");
    std::fs::rename(built, lib.join(format!("libnvidia-ml.so.{FAKE_DRIVER}"))).unwrap();
    symlink(
        format!("libnvidia-ml.so.{FAKE_DRIVER}"),
        lib.join("libnvidia-ml.so.1"),
    )
    .unwrap();
    std::fs::write(
        lib.join(format!("libcuda.so.{FAKE_DRIVER}")),
        "not a library",
    )
    .unwrap();
    symlink(
        format!("libcuda.so.{FAKE_DRIVER}"),
        lib.join("libcuda.so.1"),
    )
    .unwrap();
    std::fs::write(
        lib.join("libc.so.6"),
        "the driver container's own C library",
    )
    .unwrap();
    root
}

/// Rewrites the env's config: the line starting with `prefix` becomes `line`, or, when
/// none does, `line` goes before `[mps]` (a top-level key).
fn set_line(env: &Env, prefix: &str, line: &str) {
    let text = std::fs::read_to_string(&env.config).unwrap();
    let mut lines: Vec<String> = text.lines().map(str::to_owned).collect();
    match lines.iter_mut().find(|l| l.starts_with(prefix)) {
        Some(l) => *l = line.to_owned(),
        None => {
            let at = lines.iter().position(|l| l == "[mps]").unwrap();
            lines.insert(at, line.to_owned());
        }
    }
    std::fs::write(&env.config, lines.join("\n") + "\n").unwrap();
}

/// An env whose config names only the driver root: `inventory = "nvml"`, the control
/// binary by name, and no LD_LIBRARY_PATH or PATH that would find either elsewhere.
pub(crate) fn operator_env() -> (Env, PathBuf) {
    let env = Env::new();
    let root = driver_tree(env.path(), &env.sim());
    env.set_inventory("nvml");
    set_line(
        &env,
        "control-binary = ",
        "control-binary = \"nvidia-cuda-mps-control\"",
    );
    set_line(
        &env,
        "driver-root = ",
        &format!("driver-root = {:?}", root.display().to_string()),
    );
    (env, root)
}

pub(crate) fn doctor(env: &Env) -> (String, Option<i32>) {
    let out = env.gpushare(&["doctor"]);
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        out.status.code(),
    )
}

#[test]
fn a_driver_under_a_root_serves_a_container_and_doctor_names_its_files() {
    let (env, root) = operator_env();
    let lib = root.join(format!("usr/lib/{}-linux-gnu", std::env::consts::ARCH));
    let control = root.join("bin/nvidia-cuda-mps-control");

    let (report, _) = doctor(&env);
    let want = format!(
        "ok    driver-root        {root}: libnvidia-ml.so.1 {lib}/libnvidia-ml.so.{FAKE_DRIVER}, nvidia-cuda-mps-control {control}, libcuda.so.1 {lib}/libcuda.so.{FAKE_DRIVER} and 3 more driver libraries for MPS servers",
        root = root.display(),
        lib = lib.display(),
        control = control.display(),
    );
    for line in [
        want.as_str(),
        &format!("ok    driver             NVML answers: driver {FAKE_DRIVER}, 2 GPU(s)"),
        "ok    inventory          2 GPU(s), 0 MIG device(s) from nvml",
    ] {
        assert!(report.lines().any(|l| l == line), "{line:?} in:\n{report}");
    }
    // The link in usr/bin that points at a host file is passed over: bin's is used.
    let mps = format!("ok    mps-control        {} (", control.display());
    assert!(
        report.lines().any(|l| l.starts_with(&mps)),
        "{mps:?} in:\n{report}"
    );

    // A container through runc on GPU 1, which only the root's NVML knows of, served by a
    // daemon that runs the root's control binary with the root's driver libraries.
    let c = env
        .request("dr1", 1000, "1")
        .sh("gpushare-mps-sim client")
        .create();
    let identity = c.config()["annotations"]["gpushare.io/identity"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(identity.contains(FAKE_GPU1), "{identity}");
    let out = c.run();
    let line = client_line(&out);
    assert_eq!(line["shm"], "ok", "{out}");
    assert_eq!(line["server_uid"], "1000", "{out}");

    let id = env.daemon_of(&c);
    let pid = env.daemon_pid(&id);
    assert_eq!(
        std::fs::read_link(format!("/proc/{pid}/exe")).unwrap(),
        control
    );
    let links = env.state.join("mps").join(&id).join("lib");
    let vars = environ(pid);
    assert!(
        vars.contains(&format!("LD_LIBRARY_PATH={}", links.display())),
        "{vars:?}"
    );
    assert_eq!(
        std::fs::read_link(links.join("libcuda.so.1")).unwrap(),
        lib.join(format!("libcuda.so.{FAKE_DRIVER}"))
    );
    let mut names: Vec<String> = std::fs::read_dir(&links)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "libcuda.so.1".to_owned(),
            format!("libcuda.so.{FAKE_DRIVER}"),
            "libnvidia-ml.so.1".to_owned(),
            format!("libnvidia-ml.so.{FAKE_DRIVER}"),
        ],
        "only the driver's libraries, never its container's libc"
    );
}

#[test]
fn a_missing_or_malformed_driver_root_is_one_line() {
    let (env, root) = operator_env();
    let absent = env.path().join("absent");
    for (n, (value, want)) in [
        (
            absent.display().to_string(),
            format!(
                "gpushare: cannot open driver-root {} (is the driver installed there, or the GPU Operator's driver container running?): ENOENT: No such file or directory",
                absent.display()
            ),
        ),
        (
            "run/nvidia/driver".to_owned(),
            "driver-root = \"run/nvidia/driver\": \"\" (the host's own paths) or an absolute path without '..' other than \"/\"".to_owned(),
        ),
        (
            format!("{}/../driver", root.display()),
            "without '..'".to_owned(),
        ),
    ]
    .into_iter()
    .enumerate()
    {
        set_line(&env, "driver-root = ", &format!("driver-root = {value:?}"));
        let c = env
            .request(&format!("dr-bad{n}"), 1000, "1")
            .bundle();
        let before = c.config_bytes();
        let out = c.try_create();
        assert_eq!(out.status.code(), Some(1), "{value}: {}", c.last_error());
        let log = std::fs::read_to_string(c.log()).unwrap_or_default();
        let errors: Vec<&str> = log.lines().filter(|l| l.contains("\"error\"")).collect();
        assert_eq!(errors.len(), 1, "{value}: one error line in:\n{log}");
        let msg = c.last_error();
        assert!(
            msg.contains(&want) && !msg.contains('\n'),
            "{value}: want {want:?} in {msg:?}"
        );
        assert_eq!(c.config_bytes(), before, "config.json byte-identical");
        assert!(env.daemon_ids().is_empty(), "{:?}", env.daemon_ids());
    }

    // doctor: a missing root is its own FAIL line, a malformed one a config failure.
    set_line(
        &env,
        "driver-root = ",
        &format!("driver-root = {:?}", absent.display().to_string()),
    );
    let (report, code) = doctor(&env);
    assert!(
        report.lines().any(|l| l.starts_with(&format!(
            "FAIL  driver-root        cannot open driver-root {}",
            absent.display()
        ))),
        "{report}"
    );
    assert_eq!(code, Some(2), "{report}");
    set_line(
        &env,
        "driver-root = ",
        "driver-root = \"run/nvidia/driver\"",
    );
    let (report, code) = doctor(&env);
    assert!(
        report
            .lines()
            .any(|l| l.starts_with("FAIL  config ") && l.contains("driver-root")),
        "{report}"
    );
    assert_eq!(code, Some(2), "{report}");
}

#[test]
fn doctor_and_the_shim_warn_when_nvidia_s_runtime_listed_first_is_missing() {
    let env = Env::new();
    let runc = which("runc").unwrap();
    let missing = env
        .path()
        .join("toolkit/nvidia-container-runtime")
        .display()
        .to_string();
    set_line(
        &env,
        "low-level-runtime = ",
        &format!(
            "low-level-runtime = [{missing:?}, {:?}]",
            runc.display().to_string()
        ),
    );
    let (report, code) = doctor(&env);
    let want = format!(
        "warn  low-level-runtime  {missing}, the first choice, is not found (on PATH or at that path): {} runs the containers, which get gpushare's MPS pipe directory but no GPU device nodes or driver libraries from NVIDIA's toolkit",
        runc.display()
    );
    assert!(report.lines().any(|l| l == want), "{want:?} in:\n{report}");
    assert!(code >= Some(1), "{report}");

    // The shim serves the container through runc and says the same in its log.
    let c = env.request("llr1", 1000, "0").sh("true").create();
    c.run();
    let log = env.gpushare_log();
    assert!(
        log.lines().any(|l| l.contains("WARN")
            && l.contains(&format!("low-level-runtime: {missing} is not found"))),
        "{log}"
    );

    // With the toolkit's runtime there (any executable under that name), no warning.
    let toolkit = Path::new(&missing);
    std::fs::create_dir_all(toolkit.parent().unwrap()).unwrap();
    std::os::unix::fs::symlink(&runc, toolkit).unwrap();
    let (report, _) = doctor(&env);
    assert!(
        report
            .lines()
            .any(|l| l == format!("ok    low-level-runtime  {missing}")),
        "{report}"
    );
}

/// deploy/node-installer.sh refuses a host whose glibc is older than gpushare's binaries
/// need, in one line, before it changes anything; it asks the host's own
/// `getconf GNU_LIBC_VERSION` (here a script in a fake host root with busybox's sh).
#[test]
fn the_node_installer_refuses_a_host_glibc_older_than_2_34() {
    use std::os::unix::fs::PermissionsExt;
    let busybox = busybox().expect("busybox-static");
    let dir = tempfile::tempdir().unwrap();
    let host = dir.path().join("host");
    let image = dir.path().join("image");
    for d in [host.join("bin"), host.join("usr/bin"), image.clone()] {
        std::fs::create_dir_all(d).unwrap();
    }
    std::fs::copy(&busybox, host.join("bin/sh")).unwrap();
    for f in ["gpushare", "gpushare-runtime"] {
        std::fs::write(image.join(f), "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(image.join(f), std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let getconf = host.join("usr/bin/getconf");
    let run = |version: &str| {
        std::fs::write(&getconf, format!("#!/bin/sh\necho 'glibc {version}'\n")).unwrap();
        std::fs::set_permissions(&getconf, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::process::Command::new("sh")
            .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/node-installer.sh"))
            .arg("--once")
            .env("HOST_ROOT", &host)
            .env("SOURCE_DIR", &image)
            .env("RESTART_MODE", "none")
            .env("AGENT", "none")
            .output()
            .unwrap()
    };
    let out = run("2.31");
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        "gpushare-node-installer: the host's glibc is 2.31; gpushare needs 2.34 or later (Debian 12, Ubuntu 22.04, RHEL 9 or newer): nothing was changed\n"
    );
    assert!(out.stdout.is_empty(), "{}", text(&out));
    assert!(!host.join("usr/local").exists() && !host.join("etc").exists());
    // 2.34 passes the check (the run then stops later, at this fake image's binaries).
    for version in ["2.34", "2.36", "3.0"] {
        let out = run(version);
        assert!(
            !String::from_utf8_lossy(&out.stderr).contains("glibc"),
            "{version}: {}",
            text(&out)
        );
    }
}

/// Hook-only mode with a cold inventory cache reads NVML and then enters the container's
/// mount namespace to mount the daemon's directories, which setns(2) refuses a
/// multithreaded process (EINVAL), and loading NVML leaves a thread running (the fake
/// NVML's as the real one's). So the hooks read NVML through `gpushare nvml-inventory`,
/// never in process: the container is served, on GPU 1, which only NVML knows, by the
/// hooks.d hook and by a CDI device's hook (found with a CDI device on an H200).
#[test]
fn hook_only_mode_reads_nvml_in_a_helper_and_still_enters_the_container() {
    let (env, _root) = operator_env();
    let _cleanup = crate::tenant_mounts::RuncDelete(&env, vec!["ho-nvml".into(), "ho-cdi".into()]);
    for (id, annotated, flags) in [
        ("ho-nvml", true, &[][..]),
        ("ho-cdi", false, &["--cdi-device", "1"][..]),
    ] {
        // Cold: the previous container's inventory cache is gone.
        let _ = std::fs::remove_file(env.state.join("inventory.json"));
        let mut b = env.container(id).uid(1000);
        if annotated {
            b = b.device("1");
        }
        let c = b.sh("gpushare-mps-sim client").bundle();
        let out = crate::tenant_mounts::hook_only_create_with(&env, &c, flags);
        assert!(
            out.status.success(),
            "{id}: hook-only create with NVML read cold: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let line = client_line(&c.run());
        assert_eq!(line["server_uid"], "1000", "{id}: {line:?}");
    }
    let ids = env.daemon_ids();
    assert_eq!(ids.len(), 1, "one daemon for both: {ids:?}");
    assert!(
        env.record(&ids[0])["identity"]["devices"][0] == FAKE_GPU1,
        "{}",
        env.record(&ids[0])
    );
}
