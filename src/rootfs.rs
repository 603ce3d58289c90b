//! What the container's image holds where the shim has runc mount the pipe directory,
//! looked at before anything is made: an image that runc cannot mount it into (a
//! `/tmp` that is a plain file; no `/tmp` in a user-namespaced container whose root may
//! not create one) fails the create with gpushare's one line, not with runc's error
//! after the daemon's directories were made.
//!
//! Invariants: every path is resolved beneath the container's root (`openat2` with
//! `RESOLVE_IN_ROOT`), as runc resolves mount targets, so a link in the image never
//! leads out of it; only `O_PATH` opens and `fstat`, nothing is written. What this
//! check cannot tell is left to runc, whose error then names it.

use std::os::fd::{AsFd, OwnedFd};
use std::path::{Component, Path};

use nix::errno::Errno;
use nix::fcntl::{OFlag, OpenHow, ResolveFlag};
use nix::sys::stat::{fstat, Mode, SFlag};

/// Who makes a missing mount point in the image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Maker {
    /// runc, as the host's root: it can make any directory.
    HostRoot,
    /// runc inside the container's user namespace, as the container's root: it can make
    /// a directory only where that root (this host uid; `None`: unmapped) owns the
    /// parent, or where the parent is writable by everyone.
    UserNs(Option<u32>),
}

/// Opens `rel` (relative to `root`) as an `O_PATH` fd with `flags` added, resolved
/// inside `root`, as runc resolves a mount target: `..` and absolute links stop at it.
pub(crate) fn open_in_root(root: &impl AsFd, rel: &str, flags: OFlag) -> nix::Result<OwnedFd> {
    let how = OpenHow::new()
        .flags(OFlag::O_PATH | OFlag::O_CLOEXEC | flags)
        .resolve(ResolveFlag::RESOLVE_IN_ROOT | ResolveFlag::RESOLVE_NO_MAGICLINKS);
    nix::fcntl::openat2(root.as_fd(), rel, how)
}

/// Why runc could not use `target` (an absolute path in the container) as a mount point
/// in the image at `rootfs`, or `None` when it can or this cannot tell.
pub(crate) fn mount_point_problem(rootfs: &Path, target: &Path, maker: Maker) -> Option<String> {
    let root = nix::fcntl::open(
        rootfs,
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .ok()?;
    let parts: Vec<&str> = target
        .components()
        .filter_map(|c| match c {
            Component::Normal(s) => s.to_str(),
            _ => None,
        })
        .collect();
    // Each prefix in turn: the first that is missing or not a directory decides.
    let mut parent = "/".to_owned();
    for i in 1..=parts.len() {
        let prefix = parts[..i].join("/");
        match open_in_root(&root, &prefix, OFlag::empty()).and_then(|fd| fstat(&fd)) {
            Ok(st) if SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT == SFlag::S_IFDIR => {
                parent = format!("/{prefix}");
            }
            Ok(_) => return Some(format!("/{prefix} is not a directory in the image")),
            Err(Errno::ENOTDIR) => {
                return Some(format!("{parent} is not a directory in the image"))
            }
            Err(Errno::ENOENT) => {
                let Maker::UserNs(root_uid) = maker else {
                    return None;
                };
                let rel = parent.trim_start_matches('/');
                let st = open_in_root(
                    &root,
                    if rel.is_empty() { "." } else { rel },
                    OFlag::empty(),
                )
                .and_then(|fd| fstat(&fd))
                .ok()?;
                let writable = st.st_mode & 0o002 != 0 || root_uid == Some(st.st_uid);
                return (!writable).then(|| {
                    format!(
                        "/{prefix} is missing from the image, and the container's root ({}) may not create it in {parent} (owner uid {}, mode {:o}) inside its user namespace",
                        root_uid.map_or("unmapped".to_owned(), |u| format!("host uid {u}")),
                        st.st_uid,
                        st.st_mode & 0o7777
                    )
                });
            }
            Err(_) => return None,
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{symlink, PermissionsExt};

    /// An image under a temp dir: `/` owned by root 0755, and whatever `make` adds.
    fn image(make: impl FnOnce(&Path)) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        make(dir.path());
        dir
    }

    fn problem(rootfs: &Path, maker: Maker) -> Option<String> {
        mount_point_problem(rootfs, Path::new("/tmp/nvidia-mps"), maker)
    }

    #[test]
    fn a_mount_point_runc_could_not_make_is_named() {
        let euid = nix::unistd::geteuid().as_raw();
        type Case = (&'static str, fn(&Path), Maker, Option<&'static str>);
        let cases: &[Case] = &[
            ("has /tmp", |r| std::fs::create_dir(r.join("tmp")).unwrap(), Maker::HostRoot, None),
            ("has /tmp 1777, userns", |r| {
                std::fs::create_dir(r.join("tmp")).unwrap();
                std::fs::set_permissions(r.join("tmp"), std::fs::Permissions::from_mode(0o1777)).unwrap();
            }, Maker::UserNs(None), None),
            ("has /tmp 0755, userns", |r| std::fs::create_dir(r.join("tmp")).unwrap(), Maker::UserNs(None), Some("/tmp/nvidia-mps is missing from the image, and the container's root (unmapped) may not create it in /tmp")),
            ("no /tmp, host root", |_| {}, Maker::HostRoot, None),
            ("/tmp a file", |r| std::fs::write(r.join("tmp"), "").unwrap(), Maker::HostRoot, Some("/tmp is not a directory in the image")),
            ("/tmp/nvidia-mps a file", |r| {
                std::fs::create_dir(r.join("tmp")).unwrap();
                std::fs::write(r.join("tmp/nvidia-mps"), "").unwrap();
            }, Maker::HostRoot, Some("/tmp/nvidia-mps is not a directory in the image")),
            ("no /tmp, userns root unmapped", |_| {}, Maker::UserNs(None), Some("/tmp is missing from the image, and the container's root (unmapped) may not create it in / (owner uid")),
            ("no /tmp, userns root maps elsewhere", |_| {}, Maker::UserNs(Some(4_000_000)), Some("(host uid 4000000) may not create it in /")),
            ("/tmp a link to /var/tmp", |r| {
                std::fs::create_dir_all(r.join("var/tmp")).unwrap();
                symlink("/var/tmp", r.join("tmp")).unwrap();
            }, Maker::HostRoot, None),
            // Resolved inside the image: a link out of it leads to the image's own /etc.
            ("/tmp a link leaving the image", |r| symlink("../../../../etc", r.join("tmp")).unwrap(), Maker::HostRoot, None),
        ];
        for (name, make, maker, want) in cases {
            let img = image(*make);
            let got = problem(img.path(), *maker);
            match want {
                None => assert_eq!(got, None, "{name}"),
                Some(w) => assert!(
                    got.as_deref().is_some_and(|g| g.contains(w)),
                    "{name}: {got:?}"
                ),
            }
        }
        // The container's root owns `/` (a remapped image) or `/` is writable by all.
        let img = image(|_| {});
        assert_eq!(problem(img.path(), Maker::UserNs(Some(euid))), None);
        std::fs::set_permissions(img.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        assert_eq!(problem(img.path(), Maker::UserNs(None)), None);
    }
}
