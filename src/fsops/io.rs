//! gpushare's own files, read and written so that a name planted in their place is never
//! followed.
//!
//! Invariants: `read_regular` opens with O_NOFOLLOW and O_NONBLOCK and reads only a
//! regular file of at most `max` bytes; `write_atomic` writes a temp file in the same
//! directory (created with O_EXCL and O_NOFOLLOW, its mode set before any byte is
//! written) and renames it over the target, so a reader sees the old content or the new,
//! never a part.

use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;

/// The bytes of the regular file at `path`, read without following a link in its last
/// component (O_NOFOLLOW; ELOOP for a link) and without blocking on a FIFO (O_NONBLOCK),
/// refusing anything but a regular file and more than `max` bytes (EFBIG). For gpushare's
/// own records: a link or a FIFO planted in their place is an error, never followed.
pub(crate) fn read_regular(path: &Path, max: u64) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK)
        .open(path)?;
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(std::io::Error::from_raw_os_error(nix::libc::EINVAL));
    }
    if meta.len() > max {
        return Err(std::io::Error::from_raw_os_error(nix::libc::EFBIG));
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    file.take(max + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > max {
        return Err(std::io::Error::from_raw_os_error(nix::libc::EFBIG));
    }
    Ok(bytes)
}

/// Writes `data` to `path` atomically: a temp file in the same directory, fsync, rename,
/// fsync of the directory. The temp file is created with O_EXCL, never follows a link,
/// and gets `mode` before any byte is written.
pub(crate) fn write_atomic(path: &Path, data: &[u8], mode: u32) -> std::io::Result<()> {
    write_atomic_with(path, data, mode, true)
}

/// `write_atomic`, with the fsyncs only when `durable`: the rename is atomic either way,
/// but without fsync a crash may lose the new content.
pub(crate) fn write_atomic_with(
    path: &Path,
    data: &[u8],
    mode: u32,
    durable: bool,
) -> std::io::Result<()> {
    // A bare file name's parent is "", which names no directory to open for its fsync.
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.gpushare-{}.tmp", std::process::id()));
    // A file by this name is a leftover of a writer killed between its create and its
    // rename whose pid this process now has (pids are reused: 32768 of them by default):
    // no live process but this one writes under this pid, and O_EXCL would refuse it.
    let _ = std::fs::remove_file(&tmp);
    let result = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .custom_flags(nix::libc::O_NOFOLLOW)
            .open(&tmp)?;
        // The umask may have cut the mode: set it exactly.
        f.set_permissions(std::fs::Permissions::from_mode(mode))?;
        f.write_all(data)?;
        if durable {
            f.sync_all()?;
        }
        std::fs::rename(&tmp, path)?;
        if durable {
            std::fs::File::open(dir)?.sync_all()?;
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::sys::stat::Mode;

    #[test]
    fn read_regular_reads_files_and_refuses_links_fifos_and_oversize() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("r.json");
        std::fs::write(&file, b"{}").unwrap();
        assert_eq!(read_regular(&file, 2).unwrap(), b"{}");
        assert_eq!(
            read_regular(&file, 1).unwrap_err().raw_os_error(),
            Some(nix::libc::EFBIG)
        );
        let link = dir.path().join("l.json");
        std::os::unix::fs::symlink(&file, &link).unwrap();
        assert_eq!(
            read_regular(&link, 64).unwrap_err().raw_os_error(),
            Some(nix::libc::ELOOP),
            "a link is never followed"
        );
        let fifo = dir.path().join("f.json");
        nix::unistd::mkfifo(&fifo, Mode::from_bits_truncate(0o600)).unwrap();
        assert_eq!(
            read_regular(&fifo, 64).unwrap_err().raw_os_error(),
            Some(nix::libc::EINVAL),
            "a FIFO is refused without blocking"
        );
        assert!(read_regular(&dir.path().join("absent"), 64)
            .is_err_and(|e| e.kind() == std::io::ErrorKind::NotFound));
    }

    #[test]
    fn atomic_write_takes_the_place_of_a_killed_writers_temp_file_with_its_pid() {
        // A writer SIGKILLed before its rename left its temp file; its pid is reused by
        // this process (the fault tier, tests/faults, kills writers at any instant).
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("daemon.json");
        let left = dir
            .path()
            .join(format!(".daemon.json.gpushare-{}.tmp", std::process::id()));
        std::fs::write(&left, "half a reco").unwrap();
        write_atomic(&p, b"{}", 0o644).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"{}");
        assert!(!left.exists());
    }

    #[test]
    fn atomic_write_keeps_mode_and_replaces() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f.json");
        std::fs::write(&p, "old").unwrap();
        write_atomic(&p, b"new", 0o640).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"new");
        assert_eq!(
            std::fs::metadata(&p).unwrap().permissions().mode() & 0o777,
            0o640
        );
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            1,
            "no temp file left"
        );
    }
}
