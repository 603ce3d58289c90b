//! The NVIDIA driver's user-space files: where NVML (`libnvidia-ml.so.1`), the MPS control
//! binary and the libraries an MPS server loads (`libcuda.so.1`, `libnvidia-*.so*`) are —
//! on the host's own paths, or under the config's `driver-root` (NVIDIA's GPU Operator
//! runs the driver in a container and puts its files under `/run/nvidia/driver`).
//!
//! Invariants:
//! - `driver-root` is the node operator's (root's config file), never a tenant's: nothing
//!   a container writes names a file here. A file is looked for only at the fixed places
//!   [`BIN_DIRS`] and [`lib_dirs`] under the root, in that order, by a fixed name.
//! - Every lookup resolves beneath the root (`openat2` with `RESOLVE_IN_ROOT`, as the
//!   driver container itself sees its tree): an absolute link in the driver's tree, or one
//!   with `..`, stays inside it and never reaches the host's own driver files (a second
//!   driver version: NVML then fails with a version mismatch) or anything else of the
//!   host. Only a regular file counts, and what is returned is the path where it really is
//!   (`/proc/self/fd`), so that the exec or `dlopen` by that path opens the same file.
//! - An MPS server gets the root's driver libraries through a directory of links that
//!   holds only those ([`link_server_libraries`]), never the root's library directories
//!   themselves: those also hold the driver container's own C library, which the host's
//!   dynamic loader must not load.

use std::collections::BTreeMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use nix::fcntl::{OFlag, OpenHow, ResolveFlag};
use nix::sys::stat::{fstat, Mode, SFlag};

/// NVML, as nvml-wrapper loads it.
pub const NVML_LIBRARY: &str = "libnvidia-ml.so.1";
/// The CUDA driver library an MPS server loads.
pub const CUDA_LIBRARY: &str = "libcuda.so.1";
/// Where executables are looked for under a driver root, first found wins.
pub const BIN_DIRS: [&str; 3] = ["usr/bin", "bin", "usr/local/bin"];
/// At most this many driver libraries are linked for an MPS server (a driver ships about
/// 40 files that match [`is_server_library`]).
const MAX_SERVER_LIBRARIES: usize = 512;

/// Where libraries are looked for under a driver root, first found wins: the multiarch
/// directory of Debian and Ubuntu (`usr/lib/x86_64-linux-gnu`), then Red Hat's `usr/lib64`,
/// then `usr/lib`, and the same under `lib`.
pub fn lib_dirs() -> [String; 6] {
    let multiarch = format!("{}-linux-gnu", std::env::consts::ARCH);
    [
        format!("usr/lib/{multiarch}"),
        "usr/lib64".to_owned(),
        "usr/lib".to_owned(),
        format!("lib/{multiarch}"),
        "lib64".to_owned(),
        "lib".to_owned(),
    ]
}

#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    #[error("cannot open driver-root {} (is the driver installed there, or the GPU Operator's driver container running?)", .root.display())]
    Root {
        root: PathBuf,
        #[source]
        error: nix::Error,
    },
    #[error("no {name} under driver-root {} (looked in {searched})", .root.display())]
    NotFound {
        root: PathBuf,
        name: String,
        searched: String,
    },
    #[error("cannot make the directory of driver library links {}", .dir.display())]
    Links {
        dir: PathBuf,
        #[source]
        error: std::io::Error,
    },
}

/// The root, opened to resolve beneath.
fn open_root(root: &Path) -> Result<OwnedFd, DriverError> {
    nix::fcntl::open(
        root,
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|error| DriverError::Root {
        root: root.to_owned(),
        error,
    })
}

/// Opens `rel` beneath `root` with `flags` (links, absolute or with `..`, stay inside it).
fn open_beneath(root: &OwnedFd, rel: &str, flags: OFlag) -> nix::Result<OwnedFd> {
    let how = OpenHow::new()
        .flags(OFlag::O_CLOEXEC | flags)
        .resolve(ResolveFlag::RESOLVE_IN_ROOT | ResolveFlag::RESOLVE_NO_MAGICLINKS);
    nix::fcntl::openat2(root, rel, how)
}

/// Where the regular file `rel` beneath `root` really is, or `None` when there is none.
fn regular_file(root: &OwnedFd, rel: &str) -> Option<PathBuf> {
    let fd = open_beneath(root, rel, OFlag::O_PATH).ok()?;
    let st = fstat(&fd).ok()?;
    if SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT != SFlag::S_IFREG {
        return None;
    }
    std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())).ok()
}

/// The first of `dirs` under `root` that holds `name` as a regular file: its real path.
fn find(root: &Path, dirs: &[&str], name: &str) -> Result<PathBuf, DriverError> {
    let fd = open_root(root)?;
    dirs.iter()
        .find_map(|dir| regular_file(&fd, &format!("{dir}/{name}")))
        .ok_or_else(|| DriverError::NotFound {
            root: root.to_owned(),
            name: name.to_owned(),
            searched: dirs.join(", "),
        })
}

/// The first driver branch whose MPS speaks protocol 3 (namespaces, docs/mps.md, "Two
/// backends").
pub(crate) const MPS_V3_DRIVER: u32 = 615;

/// Whether a driver version (`580.159.04`, as NVML reports it) is of a branch whose MPS
/// speaks protocol 3; an unreadable version is not.
pub(crate) fn has_mps_v3(driver_version: &str) -> bool {
    driver_version
        .split('.')
        .next()
        .and_then(|major| major.parse::<u32>().ok())
        .is_some_and(|major| major >= MPS_V3_DRIVER)
}

/// PATH given to every process gpushare starts.
pub(crate) const SAFE_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// How long the control binary gets to answer [`control_speaks_v3`]'s `-p 3 -h`.
const PROBE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// The most of the probe's output read: a help text is a few lines.
const MAX_PROBE_OUTPUT: u64 = 64 << 10;

/// `mps.control-binary` as the commands run it: an absolute path as it is; a name under
/// `driver_root` when that is set ([`find_binary`]); else a name on [`SAFE_PATH`].
/// `None` where there is none.
pub(crate) fn control_binary(binary: &str, driver_root: Option<&Path>) -> Option<PathBuf> {
    match (binary.contains('/'), driver_root) {
        (true, _) => Some(PathBuf::from(binary)).filter(|p| p.is_file()),
        (false, Some(root)) => find_binary(root, binary).ok(),
        (false, None) => crate::util::find_executable(binary, std::ffi::OsStr::new(SAFE_PATH)),
    }
}

/// Whether the MPS control binary at `binary` speaks protocol 3: `<binary> -p 3 -h`
/// exits 0 and its help lists the `namespace` module (a binary from before driver 615
/// refuses `-p 3`). Run as the caller with a cleared environment, its stdin empty, killed
/// after [`PROBE_TIMEOUT`]. `None`: no answer (it could not be run, or did not exit in
/// time), which is not an answer to remember.
pub(crate) fn control_speaks_v3(binary: &Path) -> Option<bool> {
    use std::io::Read;
    let mut child = std::process::Command::new(binary)
        .args(["-p", "3", "-h"])
        .env_clear()
        .env("PATH", SAFE_PATH)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .ok()?;
    let every = std::time::Duration::from_millis(5);
    let deadline = std::time::Instant::now() + PROBE_TIMEOUT;
    let status = crate::util::poll_until(deadline, every, every * 4, || {
        child.try_wait().ok().flatten()
    });
    let Some(status) = status else {
        let _ = child.kill();
        let _ = child.wait();
        return None;
    };
    let mut out = Vec::new();
    if let Some(stdout) = child.stdout.take() {
        let _ = stdout.take(MAX_PROBE_OUTPUT).read_to_end(&mut out);
    }
    Some(status.success() && lists_namespace_module(&String::from_utf8_lossy(&out)))
}

/// Whether a help text names the `namespace` module as a word of its own.
fn lists_namespace_module(help: &str) -> bool {
    help.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '-'))
        .any(|w| w == "namespace")
}

/// The executable `name` under `root` ([`BIN_DIRS`]).
pub fn find_binary(root: &Path, name: &str) -> Result<PathBuf, DriverError> {
    find(root, &BIN_DIRS, name)
}

/// The library `name` under `root` ([`lib_dirs`]).
pub fn find_library(root: &Path, name: &str) -> Result<PathBuf, DriverError> {
    let dirs = lib_dirs();
    let dirs: Vec<&str> = dirs.iter().map(String::as_str).collect();
    find(root, &dirs, name)
}

/// NVML's library: `None` for the host's own (nvml-wrapper's `dlopen` by name, through
/// the loader's search), else the one under `driver_root`.
pub fn nvml_library(driver_root: Option<&Path>) -> Result<Option<PathBuf>, DriverError> {
    driver_root
        .map(|root| find_library(root, NVML_LIBRARY))
        .transpose()
}

/// Whether an MPS server may need the library file `name`: the CUDA driver and the
/// driver's own `libnvidia-*` (libcuda loads several of them), never anything else a
/// library directory holds.
fn is_server_library(name: &str) -> bool {
    let exactly = |prefix: &str| {
        name.strip_prefix(prefix)
            .is_some_and(|rest| rest.starts_with(".so"))
    };
    let family = name.strip_prefix("libnvidia-").is_some_and(|rest| {
        rest.split_once(".so")
            .is_some_and(|(stem, _)| !stem.is_empty())
    });
    exactly("libcuda") || exactly("libcudadebugger") || family
}

/// The driver libraries an MPS server may load under `root`: file name → real path, the
/// first of [`lib_dirs`] that holds a name wins. It must hold [`CUDA_LIBRARY`].
pub fn server_libraries(root: &Path) -> Result<BTreeMap<String, PathBuf>, DriverError> {
    let fd = open_root(root)?;
    let mut found = BTreeMap::new();
    for dir in lib_dirs() {
        let Ok(dir_fd) = open_beneath(&fd, &dir, OFlag::O_RDONLY | OFlag::O_DIRECTORY) else {
            continue;
        };
        let Ok(mut entries) = nix::dir::Dir::from_fd(dir_fd) else {
            continue;
        };
        for entry in entries.iter().flatten() {
            let Ok(name) = entry.file_name().to_str() else {
                continue;
            };
            if found.len() >= MAX_SERVER_LIBRARIES
                || !is_server_library(name)
                || found.contains_key(name)
            {
                continue;
            }
            if let Some(real) = regular_file(&fd, &format!("{dir}/{name}")) {
                found.insert(name.to_owned(), real);
            }
        }
    }
    if !found.contains_key(CUDA_LIBRARY) {
        let dirs = lib_dirs();
        return Err(DriverError::NotFound {
            root: root.to_owned(),
            name: CUDA_LIBRARY.to_owned(),
            searched: dirs.join(", "),
        });
    }
    Ok(found)
}

/// Makes `dir` (0755, in a directory only root writes) hold one link per driver library
/// under `root` ([`server_libraries`]), named as the library, to where it really is; what
/// `dir` held before is removed first. `dir` is then an MPS daemon's `LD_LIBRARY_PATH`.
pub fn link_server_libraries(root: &Path, dir: &Path) -> Result<(), DriverError> {
    use std::os::unix::fs::DirBuilderExt;
    let libraries = server_libraries(root)?;
    let links = |error| DriverError::Links {
        dir: dir.to_owned(),
        error,
    };
    match std::fs::remove_dir_all(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(links(e)),
    }
    std::fs::DirBuilder::new()
        .mode(0o755)
        .create(dir)
        .map_err(links)?;
    for (name, real) in &libraries {
        std::os::unix::fs::symlink(real, dir.join(name)).map_err(links)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_v3_probe_wants_exit_0_and_the_namespace_module() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let script = |name: &str, body: &str| {
            let p = dir.path().join(name);
            std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
            p
        };
        let v3 = script(
            "v3",
            "[ \"$*\" = \"-p 3 -h\" ] || exit 9\necho 'Modules: server namespace client'",
        );
        assert_eq!(control_speaks_v3(&v3), Some(true));
        let refuses = script("refuses", "echo 'Modules: server namespace client'; exit 2");
        assert_eq!(control_speaks_v3(&refuses), Some(false), "exit status");
        let plain = script("plain", "echo 'usage: control [-d] namespaces? no'");
        assert_eq!(
            control_speaks_v3(&plain),
            Some(false),
            "no namespace module"
        );
        let slow = script("slow", "exec sleep 30");
        let start = std::time::Instant::now();
        assert_eq!(control_speaks_v3(&slow), None, "no answer in time");
        assert!(start.elapsed() < std::time::Duration::from_secs(10));
        assert_eq!(control_speaks_v3(&dir.path().join("missing")), None);
        assert!(lists_namespace_module("Modules: server namespace client\n"));
        assert!(!lists_namespace_module("Modules: server namespaces"));
    }

    /// A driver tree under a temp dir: `files` are written (with their parents), `links`
    /// are (link, target) pairs.
    fn tree(files: &[&str], links: &[(&str, &str)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for f in files {
            let p = dir.path().join(f);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(&p, f).unwrap();
        }
        for (link, target) in links {
            let p = dir.path().join(link);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::os::unix::fs::symlink(target, &p).unwrap();
        }
        dir
    }

    fn multiarch(rest: &str) -> String {
        format!("usr/lib/{}-linux-gnu/{rest}", std::env::consts::ARCH)
    }

    #[test]
    fn the_first_place_that_holds_the_file_wins() {
        let t = tree(
            &[
                "bin/nvidia-cuda-mps-control",
                "usr/bin/nvidia-cuda-mps-control",
                "usr/lib64/libnvidia-ml.so.1",
            ],
            &[],
        );
        let root = t.path().canonicalize().unwrap();
        assert_eq!(
            find_binary(&root, "nvidia-cuda-mps-control").unwrap(),
            root.join("usr/bin/nvidia-cuda-mps-control")
        );
        assert_eq!(
            nvml_library(Some(&root)).unwrap(),
            Some(root.join("usr/lib64/libnvidia-ml.so.1"))
        );
        assert_eq!(nvml_library(None).unwrap(), None);
        let err = find_binary(&root, "nvidia-smi").unwrap_err().to_string();
        assert_eq!(
            err,
            format!(
                "no nvidia-smi under driver-root {} (looked in usr/bin, bin, usr/local/bin)",
                root.display()
            )
        );
    }

    #[test]
    fn links_stay_beneath_the_root_and_give_the_real_path() {
        // An absolute link, and one that climbs out with `..`: both resolve inside the
        // root, as the driver container sees its tree; a relative link to a versioned file
        // gives the versioned file.
        let outside = tree(&["libnvidia-ml.so.1"], &[]);
        let escape = outside.path().join("libnvidia-ml.so.1");
        let t = tree(
            &[
                &multiarch("libnvidia-ml.so.580.1"),
                "opt/nvidia-cuda-mps-control",
            ],
            &[
                (&multiarch("libnvidia-ml.so.1"), "libnvidia-ml.so.580.1"),
                ("usr/bin/nvidia-cuda-mps-control", escape.to_str().unwrap()),
                (
                    "bin/nvidia-cuda-mps-control",
                    "../../../../../../opt/nvidia-cuda-mps-control",
                ),
            ],
        );
        let root = t.path().canonicalize().unwrap();
        assert_eq!(
            find_library(&root, NVML_LIBRARY).unwrap(),
            root.join(multiarch("libnvidia-ml.so.580.1"))
        );
        // usr/bin's link points at a host file, which is not there beneath the root; bin's
        // climbs to the root's own /opt.
        assert_eq!(
            find_binary(&root, "nvidia-cuda-mps-control").unwrap(),
            root.join("opt/nvidia-cuda-mps-control")
        );
        // A directory is no file.
        std::fs::create_dir_all(root.join("usr/lib64/libcuda.so.1")).unwrap();
        assert!(find_library(&root, CUDA_LIBRARY).is_err());
    }

    #[test]
    fn a_missing_root_is_named() {
        let err = crate::util::error_chain(
            &find_binary(Path::new("/nonexistent/driver"), "x").unwrap_err(),
        );
        assert!(
            err.starts_with(
                "cannot open driver-root /nonexistent/driver (is the driver installed there"
            ) && err.ends_with("ENOENT: No such file or directory"),
            "{err}"
        );
    }

    #[test]
    fn server_libraries_are_the_driver_s_only() {
        let t = tree(
            &[
                &multiarch("libcuda.so.580.1"),
                &multiarch("libnvidia-ptxjitcompiler.so.580.1"),
                &multiarch("libc.so.6"),
                &multiarch("libm.so.6"),
                "usr/lib64/libcuda.so.1",
                "usr/lib64/libnvidia-nvvm.so.4",
            ],
            &[(&multiarch("libcuda.so.1"), "libcuda.so.580.1")],
        );
        let root = t.path().canonicalize().unwrap();
        let libs = server_libraries(&root).unwrap();
        assert_eq!(
            libs.keys().collect::<Vec<_>>(),
            [
                "libcuda.so.1",
                "libcuda.so.580.1",
                "libnvidia-nvvm.so.4",
                "libnvidia-ptxjitcompiler.so.580.1"
            ]
        );
        assert_eq!(
            libs["libcuda.so.1"],
            root.join(multiarch("libcuda.so.580.1"))
        );

        let links = tempfile::tempdir().unwrap();
        let dir = links.path().join("lib");
        std::fs::create_dir(&dir).unwrap();
        std::fs::write(dir.join("stale.so"), "").unwrap();
        link_server_libraries(&root, &dir).unwrap();
        let mut names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names.len(), 4, "{names:?}");
        assert_eq!(
            std::fs::read_link(dir.join("libcuda.so.1")).unwrap(),
            root.join(multiarch("libcuda.so.580.1"))
        );

        let bare = tree(&[&multiarch("libnvidia-ml.so.1")], &[]);
        let err = server_libraries(bare.path()).unwrap_err().to_string();
        assert!(
            err.starts_with("no libcuda.so.1 under driver-root"),
            "{err}"
        );
    }

    #[test]
    fn server_library_names() {
        for (name, want) in [
            ("libcuda.so.1", true),
            ("libcuda.so", true),
            ("libcudadebugger.so.1", true),
            ("libnvidia-ml.so.1", true),
            ("libnvidia-gpucomp.so.580.1", true),
            ("libc.so.6", false),
            ("libcudart.so.12", false),
            ("libnvidia-", false),
            ("nvidia-smi", false),
            ("libcuda.a", false),
        ] {
            assert_eq!(is_server_library(name), want, "{name}");
        }
    }
}
