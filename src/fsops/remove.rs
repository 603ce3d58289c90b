//! The removal of trees a tenant may have planted: a daemon's directories, a pipe
//! directory's contents.
//!
//! Invariants (`remove_all`, `remove_contents`): a symlink is unlinked, never followed or
//! entered; every directory is opened relative to its parent's fd with O_NOFOLLOW, never
//! by path, and never through `..`; at most `HELD_DIRS` + 2 fds are open at once whatever
//! the depth or width of the tree; the walk never leaves the file system of the top
//! directory; an entry that vanishes meanwhile is fine.

use std::ffi::{CStr, CString, OsStr};
use std::path::Path;

use nix::dir::{Dir, Type};
use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, RenameFlags};
use nix::sys::stat::{Mode, SFlag};
use nix::unistd::UnlinkatFlags;

/// Directories of a tree held open at once below its top while it is removed. A deeper
/// directory is first renamed up into the top (see `clear`), so the fds in use never
/// depend on the tree: this many, plus the top and its parent.
pub(crate) const HELD_DIRS: usize = 16;
/// Names read from one directory per pass: memory stays bounded on a huge directory.
const BATCH: usize = 256;
/// Times entries may appear under a removal (a directory refilled before its rmdir, a
/// file swapped for a directory) before it gives up rather than race a writer forever.
const MAX_RACES: u32 = 1000;

fn dir_flags() -> OFlag {
    OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC
}

/// Removes `path` and everything under it: a tree that a tenant may have made as deep,
/// wide and strange as it likes (sockets, FIFOs, symlinks, a 100,000-deep chain). Only
/// `path`'s last component and what is below it are distrusted; its parent is opened by
/// path. A symlink at `path` is removed itself. A missing `path` is fine.
pub(crate) fn remove_all(path: &Path) -> std::io::Result<()> {
    let (parent, name) = split(path)?;
    let parent = match nix::fcntl::open(
        parent,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    ) {
        Ok(fd) => fd,
        Err(Errno::ENOENT) => return Ok(()),
        Err(e) => return Err(e.into()),
    };
    let mut races = 0;
    loop {
        match Dir::openat(&parent, name, dir_flags(), Mode::empty()) {
            Ok(mut top) => {
                clear(&mut top)?;
                drop(top);
                match nix::unistd::unlinkat(&parent, name, UnlinkatFlags::RemoveDir) {
                    Ok(()) | Err(Errno::ENOENT) => return Ok(()),
                    Err(Errno::ENOTEMPTY | Errno::EEXIST) => {}
                    Err(e) => return Err(e.into()),
                }
            }
            Err(Errno::ENOENT) => return Ok(()),
            // A file, socket, FIFO or symlink: unlinked, never followed.
            Err(Errno::ENOTDIR | Errno::ELOOP) => {
                match nix::unistd::unlinkat(&parent, name, UnlinkatFlags::NoRemoveDir) {
                    Ok(()) | Err(Errno::ENOENT) => return Ok(()),
                    Err(Errno::EISDIR) => {}
                    Err(e) => return Err(e.into()),
                }
            }
            Err(e) => return Err(e.into()),
        }
        races = raced(races)?;
    }
}

/// Removes everything inside the directory `path` and keeps the directory itself (it may
/// be bind-mounted into containers). `path` itself must be a directory, not a symlink.
pub(crate) fn remove_contents(path: &Path) -> std::io::Result<()> {
    let mut top = Dir::open(path, dir_flags(), Mode::empty())?;
    clear(&mut top)
}

/// Empties directory `path` but for its entry `keep` (left as it is, with what is below
/// it): each other entry is removed as [`remove_all`] removes a tree.
pub(crate) fn remove_contents_but(path: &Path, keep: &str) -> std::io::Result<()> {
    for entry in std::fs::read_dir(path)? {
        let entry = entry?;
        if entry.file_name() != keep {
            remove_all(&entry.path())?;
        }
    }
    Ok(())
}

fn split(path: &Path) -> std::io::Result<(&Path, &OsStr)> {
    match (path.parent(), path.file_name()) {
        (Some(parent), Some(name)) => Ok((
            if parent.as_os_str().is_empty() {
                Path::new(".")
            } else {
                parent
            },
            name,
        )),
        _ => Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "a path to remove must end in a name",
        )),
    }
}

/// Counts one race with a writer; an error once there were too many.
fn raced(races: u32) -> std::io::Result<u32> {
    if races >= MAX_RACES {
        return Err(std::io::Error::other(format!(
            "entries kept appearing while it was removed ({MAX_RACES} times): something writes into it"
        )));
    }
    Ok(races + 1)
}

/// Up to `BATCH` names in `dir` (not `.` or `..`) with their type when the file system
/// reports it; the stream is rewound for the next pass.
fn read_batch(dir: &mut Dir) -> std::io::Result<Vec<(CString, Option<Type>)>> {
    let mut out = Vec::new();
    for entry in dir.iter() {
        let entry = entry?;
        let name = entry.file_name();
        if name == c"." || name == c".." {
            continue;
        }
        out.push((name.to_owned(), entry.file_type()));
        if out.len() == BATCH {
            break;
        }
    }
    Ok(out)
}

/// Whether `name` in `dir` is a directory (not following a symlink); `None` if it is gone.
fn is_dir_at(dir: &Dir, name: &CStr, kind: Option<Type>) -> std::io::Result<Option<bool>> {
    match kind {
        Some(t) => Ok(Some(t == Type::Directory)),
        None => match nix::sys::stat::fstatat(dir, name, AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(st) => Ok(Some(
                SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits()) == SFlag::S_IFDIR,
            )),
            Err(Errno::ENOENT) => Ok(None),
            Err(e) => Err(e.into()),
        },
    }
}

/// Empties the open directory `top`. Walks down, holding at most `HELD_DIRS` directories
/// below `top`: everything but directories is unlinked where it is found, a directory is
/// entered (opened by name relative to its parent's fd, O_NOFOLLOW), and an emptied one is
/// removed from its parent's fd. A directory found below the deepest held one is renamed
/// up into `top` under a fresh name and emptied from there later, so the walk needs
/// neither more fds nor a path from the top, and each directory is entered about once.
fn clear(top: &mut Dir) -> std::io::Result<()> {
    let dev = nix::sys::stat::fstat(&*top)?.st_dev;
    let mut stack: Vec<(Dir, CString)> = Vec::new();
    let mut hoisted: u64 = 0;
    let mut races = 0;
    loop {
        let batch = match stack.last_mut() {
            Some((dir, _)) => read_batch(dir)?,
            None => read_batch(top)?,
        };
        if batch.is_empty() {
            // The current directory is empty: remove it from its parent.
            let Some((done, name)) = stack.pop() else {
                return Ok(());
            };
            drop(done);
            let parent = stack.last().map_or(&*top, |(d, _)| d);
            match nix::unistd::unlinkat(parent, name.as_c_str(), UnlinkatFlags::RemoveDir) {
                Ok(()) | Err(Errno::ENOENT) => {}
                // Refilled meanwhile: its parent's next pass finds it again.
                Err(Errno::ENOTEMPTY | Errno::EEXIST) => races = raced(races)?,
                Err(e) => return Err(e.into()),
            }
            continue;
        }
        let cur = stack.last().map_or(&*top, |(d, _)| d);
        let mut descend = None;
        for (name, kind) in batch {
            let Some(is_dir) = is_dir_at(cur, &name, kind)? else {
                continue;
            };
            if !is_dir {
                match nix::unistd::unlinkat(cur, name.as_c_str(), UnlinkatFlags::NoRemoveDir) {
                    Ok(()) | Err(Errno::ENOENT) => continue,
                    // Swapped for a directory meanwhile: enter it.
                    Err(Errno::EISDIR) => {}
                    Err(e) => return Err(e.into()),
                }
            }
            descend = Some(name);
            break;
        }
        let Some(name) = descend else { continue };
        if stack.len() >= HELD_DIRS {
            loop {
                let fresh = CString::new(format!(".gpushare-rm-{hoisted}"))
                    .map_err(std::io::Error::other)?;
                hoisted += 1;
                match nix::fcntl::renameat2(
                    cur,
                    name.as_c_str(),
                    &*top,
                    fresh.as_c_str(),
                    RenameFlags::RENAME_NOREPLACE,
                ) {
                    Ok(()) | Err(Errno::ENOENT) => break,
                    Err(Errno::EEXIST) => {}
                    Err(e) => return Err(e.into()),
                }
            }
            continue;
        }
        match Dir::openat(cur, name.as_c_str(), dir_flags(), Mode::empty()) {
            Ok(child) => {
                if nix::sys::stat::fstat(&child)?.st_dev != dev {
                    return Err(std::io::Error::other(format!(
                        "{} is a mount point: a removal never crosses into another file system",
                        name.to_string_lossy()
                    )));
                }
                stack.push((child, name));
            }
            Err(Errno::ENOENT) => {}
            // Swapped for a file or a symlink meanwhile: the next pass unlinks it.
            Err(Errno::ENOTDIR | Errno::ELOOP) => races = raced(races)?,
            Err(e) => return Err(e.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Makes a chain of `depth` directories named `d` under `top` (which it creates), a
    /// file in every 100th and a symlink to `link_to` at depth 1400, holding two fds at most
    /// and never building a long path.
    fn deep_chain(top: &Path, depth: usize, link_to: &Path) {
        use nix::fcntl::openat;
        std::fs::create_dir(top).unwrap();
        let mut cur = nix::fcntl::open(top, dir_flags(), Mode::empty()).unwrap();
        for i in 0..depth {
            nix::sys::stat::mkdirat(&cur, "d", Mode::from_bits_truncate(0o700)).unwrap();
            if i % 100 == 0 {
                openat(
                    &cur,
                    "f",
                    OFlag::O_CREAT | OFlag::O_WRONLY | OFlag::O_CLOEXEC,
                    Mode::from_bits_truncate(0o600),
                )
                .unwrap();
            }
            if i == 1400 {
                nix::unistd::symlinkat(link_to, &cur, "out").unwrap();
            }
            cur = openat(&cur, "d", dir_flags(), Mode::empty()).unwrap();
        }
    }

    /// A tree with one of everything a tenant can plant, and a directory outside it that
    /// symlinks point to; returns (tree, outside file that must survive).
    fn hostile_tree(dir: &Path) -> (std::path::PathBuf, std::path::PathBuf) {
        let outside = dir.join("outside");
        std::fs::create_dir(&outside).unwrap();
        let keep = outside.join("keep.txt");
        std::fs::write(&keep, "keep").unwrap();
        let tree = dir.join("tree");
        deep_chain(&tree, 1500, &outside);
        std::os::unix::fs::symlink(&outside, tree.join("link-to-dir")).unwrap();
        std::os::unix::fs::symlink(&keep, tree.join("link-to-file")).unwrap();
        nix::unistd::mkfifo(&tree.join("fifo"), Mode::from_bits_truncate(0o600)).unwrap();
        drop(std::os::unix::net::UnixListener::bind(tree.join("sock")).unwrap());
        std::fs::create_dir_all(tree.join("control/inner")).unwrap();
        std::fs::write(tree.join("control/inner/x"), "x").unwrap();
        let wide = tree.join("wide");
        std::fs::create_dir(&wide).unwrap();
        for i in 0..(BATCH * 3 + 7) {
            std::fs::write(wide.join(i.to_string()), "").unwrap();
        }
        (tree, keep)
    }

    #[test]
    fn remove_all_takes_a_deep_hostile_tree_and_follows_no_link() {
        let dir = tempfile::tempdir().unwrap();
        let (tree, keep) = hostile_tree(dir.path());
        remove_all(&tree).unwrap();
        assert!(std::fs::symlink_metadata(&tree).is_err(), "tree removed");
        assert_eq!(std::fs::read_to_string(&keep).unwrap(), "keep");
        assert_eq!(
            std::fs::read_dir(keep.parent().unwrap()).unwrap().count(),
            1
        );
        // Missing is fine; a symlink at the top is removed, its target kept.
        remove_all(&tree).unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(keep.parent().unwrap(), &link).unwrap();
        remove_all(&link).unwrap();
        assert!(std::fs::symlink_metadata(&link).is_err());
        assert!(keep.exists());
    }

    #[test]
    fn remove_contents_keeps_the_directory_and_takes_a_planted_control_dir() {
        let dir = tempfile::tempdir().unwrap();
        let (tree, keep) = hostile_tree(dir.path());
        use std::os::unix::fs::MetadataExt;
        let ino = std::fs::metadata(&tree).unwrap().ino();
        remove_contents(&tree).unwrap();
        assert_eq!(
            std::fs::symlink_metadata(&tree).unwrap().ino(),
            ino,
            "the very directory stays"
        );
        assert_eq!(std::fs::read_dir(&tree).unwrap().count(), 0, "emptied");
        assert!(keep.exists());
        // A symlink in place of the directory is refused, its target untouched.
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(keep.parent().unwrap(), &link).unwrap();
        assert!(remove_contents(&link).is_err());
        assert!(keep.exists());
    }

    #[test]
    fn entries_vanishing_meanwhile_are_fine() {
        let dir = tempfile::tempdir().unwrap();
        let tree = dir.path().join("t");
        for d in 0..20 {
            let sub = tree.join(d.to_string());
            std::fs::create_dir_all(&sub).unwrap();
            for f in 0..200 {
                std::fs::write(sub.join(f.to_string()), "").unwrap();
            }
        }
        let other = tree.clone();
        let racer = std::thread::spawn(move || {
            for d in (0..20).rev() {
                let sub = other.join(d.to_string());
                for f in 0..200 {
                    let _ = std::fs::remove_file(sub.join(f.to_string()));
                }
                let _ = std::fs::remove_dir(&sub);
            }
        });
        remove_all(&tree).unwrap();
        racer.join().unwrap();
        assert!(!tree.exists());
    }

    const CHILD_ENV: &str = "GPUSHARE_TEST_REMOVE";

    /// Runs `remove_all_in_a_child` in a new process of this test binary whose
    /// RLIMIT_NOFILE is `limit`, with `how` (ours or std's) removing `tree`.
    fn remove_in_child(tree: &Path, how: &str, limit: u32) -> std::process::Output {
        std::process::Command::new("/bin/sh")
            .args(["-c", &format!("ulimit -n {limit} && exec \"$0\" \"$@\"")])
            .arg(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "fsops::remove::tests::remove_all_in_a_child",
                "--ignored",
                "--test-threads=1",
                "--nocapture",
            ])
            .env(CHILD_ENV, format!("{how}:{}", tree.display()))
            .output()
            .unwrap()
    }

    #[test]
    #[ignore = "run by removal_needs_a_fixed_number_of_fds, under a low RLIMIT_NOFILE"]
    fn remove_all_in_a_child() {
        let Some(arg) = std::env::var(CHILD_ENV).ok() else {
            return;
        };
        let (how, tree) = arg.split_once(':').unwrap();
        let result = match how {
            "std" => std::fs::remove_dir_all(tree),
            _ => remove_all(Path::new(tree)),
        };
        result.unwrap();
        println!("removed with {how}");
    }

    #[test]
    fn removal_needs_a_fixed_number_of_fds() {
        // Enough for stdio, the test harness and HELD_DIRS + 2, far below the depth.
        let limit = HELD_DIRS as u32 + 16;
        let dir = tempfile::tempdir().unwrap();
        let (tree, keep) = hostile_tree(dir.path());
        // The control: std's removal holds an fd per level and fails under this limit.
        let out = remove_in_child(&tree, "std", limit);
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned()
            + &String::from_utf8_lossy(&out.stdout);
        assert!(
            !out.status.success() && stderr.contains("Too many open files"),
            "std::fs::remove_dir_all under ulimit -n {limit}: {stderr}"
        );
        assert!(tree.exists());
        let out = remove_in_child(&tree, "ours", limit);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("removed with ours"),
            "{stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(std::fs::symlink_metadata(&tree).is_err());
        assert!(keep.exists());
    }
}
