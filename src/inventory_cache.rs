//! The NVML inventory, cached in the state directory for the create path.
//!
//! On a real H100 (driver 580.159.04) `inventory = "nvml"` cost 28.5 ms on every create
//! with a request — NVML's init and enumeration — against 5.1 ms for the whole create with
//! a file inventory (docs/gpu-validation.md). The shim therefore keeps the last NVML
//! inventory in `<state-dir>/inventory.json`, together with a fingerprint of what the
//! driver shows in procfs, and uses it while both hold:
//! - the fingerprint is unchanged: the driver version, the boot id, the GPUs under
//!   `/proc/driver/nvidia/gpus`, and the tree under `/proc/driver/nvidia/capabilities`,
//!   where the driver adds and removes a `gpu<N>/mig/gi<G>/ci<C>` entry for every MIG GPU
//!   instance and compute instance created or destroyed;
//! - it is younger than `inventory-cache-ttl` (default 30 s; `"0"` turns the cache off).
//!   The one change the fingerprint cannot see is a MIG device destroyed and created
//!   again with the same instance ids (a new UUID, maybe another profile): the TTL bounds
//!   how long a create can see the old one.
//!
//! Invariants: the cache is read without following a link and only as a regular file of
//! at most [`MAX_CACHE_BYTES`]; what it holds is validated like any inventory; it is
//! written whole (a temporary file renamed over it), by root, into the state directory
//! only when that directory exists; a cache that cannot be read or written is never an
//! error — the create loads from NVML as before. `doctor` and `status` never use it.
//!
//! Beside it, `<state-dir>/mps-protocol.json` remembers whether the MPS control binary
//! speaks protocol 3 (`driver::control_speaks_v3`, which `mps.protocol = "auto"` asks on a
//! driver of 615 or later), so that a create does not run the binary each time. The answer
//! is the binary's, so it is keyed by the binary and no TTL: its resolved path, device,
//! inode, size, modification time, and the driver version; a changed binary, or the same
//! path replaced, is asked again. Only an answer is remembered: a binary that could not
//! be run or did not exit in time is asked again at the next create. The same rules as the
//! inventory's hold for the file (read bounded without following a link, written whole,
//! never an error).

use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::device::{self, DeviceError, Inventory, InventorySource};

/// The cache file's name in the state directory.
pub(crate) const CACHE_FILE: &str = "inventory.json";

/// A cache file larger than this is not read (an inventory of 64 GPUs with 7 MIG devices
/// each is about 60 KiB).
pub(crate) const MAX_CACHE_BYTES: u64 = 1 << 20;

/// At most this many procfs entries go into the fingerprint.
const MAX_FINGERPRINT_ENTRIES: usize = 4096;

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct CacheFile {
    fingerprint: String,
    /// When it was written, in milliseconds since the Unix epoch.
    written_ms: u64,
    inventory: Inventory,
}

/// The inventory of `source` for a create: from the cache in `state_dir` when `source` is
/// NVML, `ttl` is not zero, and the cache is fresh (module doc); else loaded, and then
/// cached. NVML is the one under `driver_root` when that is set.
pub(crate) fn load(
    source: &InventorySource,
    driver_root: Option<&Path>,
    state_dir: &Path,
    ttl: Duration,
) -> Result<Inventory, DeviceError> {
    if *source != InventorySource::Nvml || ttl.is_zero() {
        return device::load(source, driver_root);
    }
    let Some(fingerprint) = fingerprint(Path::new("/proc")) else {
        return device::load(source, driver_root);
    };
    cached(
        &state_dir.join(CACHE_FILE),
        &fingerprint,
        ttl,
        now_ms(),
        || device::load(source, driver_root),
    )
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The cache logic, apart from where the fingerprint and the inventory come from.
fn cached(
    path: &Path,
    fingerprint: &str,
    ttl: Duration,
    now_ms: u64,
    load: impl FnOnce() -> Result<Inventory, DeviceError>,
) -> Result<Inventory, DeviceError> {
    if let Some(c) = read(path) {
        let age = now_ms.checked_sub(c.written_ms);
        if c.fingerprint == fingerprint
            && age.is_some_and(|a| u128::from(a) < ttl.as_millis())
            && c.inventory.validate("nvml (cached)").is_ok()
        {
            return Ok(c.inventory);
        }
    }
    let inventory = load()?;
    if let Err(e) = write(path, fingerprint, now_ms, &inventory) {
        tracing::debug!(path = %path.display(), error = %e, "inventory cache not written");
    }
    Ok(inventory)
}

fn read(path: &Path) -> Option<CacheFile> {
    let bytes = crate::fsops::read_regular(path, MAX_CACHE_BYTES).ok()?;
    serde_json::from_slice(&bytes).ok()
}

/// Replaces the cache whole (`fsops::write_atomic_with`, no fsync: a cache lost in a crash
/// is only reloaded). A state directory that does not exist yet is not created here: the
/// state layout owns its modes.
fn write(path: &Path, fingerprint: &str, now_ms: u64, inventory: &Inventory) -> anyhow::Result<()> {
    let text = serde_json::to_vec(&CacheFile {
        fingerprint: fingerprint.to_owned(),
        written_ms: now_ms,
        inventory: inventory.clone(),
    })?;
    crate::fsops::write_atomic_with(path, &text, 0o644, false)?;
    Ok(())
}

/// The v3 probe's cache file's name in the state directory (module doc).
pub(crate) const PROTOCOL_CACHE_FILE: &str = "mps-protocol.json";

/// What a remembered v3 probe answer was about: the binary as it was when asked.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct BinaryKey {
    path: String,
    dev: u64,
    ino: u64,
    size: u64,
    mtime_ns: i128,
    driver_version: String,
}

impl BinaryKey {
    /// The key of the file at `binary` now (following links: the file that would run).
    fn of(binary: &Path, driver_version: &str) -> Option<BinaryKey> {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(binary).ok()?;
        Some(BinaryKey {
            path: binary.display().to_string(),
            dev: m.dev(),
            ino: m.ino(),
            size: m.size(),
            mtime_ns: i128::from(m.mtime()) * 1_000_000_000 + i128::from(m.mtime_nsec()),
            driver_version: driver_version.to_owned(),
        })
    }
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct ProtocolFile {
    binary: BinaryKey,
    speaks_v3: bool,
}

/// Whether the control binary at `binary` speaks MPS protocol 3, from the cache in
/// `state_dir` when it was asked as it is now, else by `probe` (`driver::control_speaks_v3`),
/// whose answer is then cached (module doc). No answer: `false`, not cached.
pub(crate) fn control_speaks_v3(
    binary: &Path,
    driver_version: &str,
    state_dir: &Path,
    probe: impl FnOnce(&Path) -> Option<bool>,
) -> bool {
    let Some(key) = BinaryKey::of(binary, driver_version) else {
        return false;
    };
    let path = state_dir.join(PROTOCOL_CACHE_FILE);
    let cached = crate::fsops::read_regular(&path, MAX_CACHE_BYTES)
        .ok()
        .and_then(|b| serde_json::from_slice::<ProtocolFile>(&b).ok());
    if let Some(c) = cached.filter(|c| c.binary == key) {
        return c.speaks_v3;
    }
    let Some(speaks_v3) = probe(binary) else {
        return false;
    };
    let written = serde_json::to_vec(&ProtocolFile {
        binary: key,
        speaks_v3,
    })
    .map_err(anyhow::Error::from)
    .and_then(|text| Ok(crate::fsops::write_atomic_with(&path, &text, 0o644, false)?));
    if let Err(e) = written {
        tracing::debug!(path = %path.display(), error = %e, "mps protocol cache not written");
    }
    speaks_v3
}

/// What the driver shows of the node's devices, hashed (module doc); `None` without an
/// NVIDIA driver (no `<proc>/driver/nvidia/version`).
pub(crate) fn fingerprint(proc: &Path) -> Option<String> {
    let nvidia = proc.join("driver/nvidia");
    let mut h = Sha256::new();
    h.update(std::fs::read(nvidia.join("version")).ok()?);
    h.update(b"\0boot\0");
    h.update(std::fs::read(proc.join("sys/kernel/random/boot_id")).unwrap_or_default());
    let mut entries = Vec::new();
    for top in ["gpus", "capabilities"] {
        walk(&nvidia.join(top), top, 0, &mut entries);
    }
    entries.sort();
    for e in &entries {
        h.update(b"\0");
        h.update(e.as_bytes());
    }
    Some(
        h.finalize()
            .iter()
            .fold(String::with_capacity(64), |mut s, b| {
                // Writing to a String cannot fail.
                let _ = std::fmt::Write::write_fmt(&mut s, format_args!("{b:02x}"));
                s
            }),
    )
}

/// Collects the relative paths under `dir` (names only, no link followed), at most six
/// levels deep (`capabilities/gpu0/mig/gi1/ci0/access`) and [`MAX_FINGERPRINT_ENTRIES`].
fn walk(dir: &Path, rel: &str, depth: usize, out: &mut Vec<String>) {
    if depth > 6 || out.len() >= MAX_FINGERPRINT_ENTRIES {
        return;
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        if out.len() >= MAX_FINGERPRINT_ENTRIES {
            return;
        }
        let name = e.file_name();
        let rel = format!("{rel}/{}", name.to_string_lossy());
        out.push(rel.clone());
        if e.file_type().is_ok_and(|t| t.is_dir()) {
            walk(&e.path(), &rel, depth + 1, out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    fn proc_tree(root: &Path, migs: &[&str]) {
        let nv = root.join("driver/nvidia");
        std::fs::create_dir_all(nv.join("gpus/0000:00:06.0")).unwrap();
        std::fs::write(nv.join("version"), "NVRM version: 580.159.04\n").unwrap();
        std::fs::create_dir_all(root.join("sys/kernel/random")).unwrap();
        std::fs::write(root.join("sys/kernel/random/boot_id"), "b00t\n").unwrap();
        std::fs::create_dir_all(nv.join("capabilities/gpu0/mig")).unwrap();
        for m in migs {
            let d = nv.join("capabilities/gpu0/mig").join(m);
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("access"), "DeviceFileMinor: 1\n").unwrap();
        }
    }

    #[test]
    fn the_fingerprint_follows_mig_instances_and_needs_a_driver() {
        let tmp = tempfile::tempdir().unwrap();
        assert_eq!(fingerprint(tmp.path()), None, "no driver");
        proc_tree(tmp.path(), &[]);
        let plain = fingerprint(tmp.path()).unwrap();
        assert_eq!(fingerprint(tmp.path()).unwrap(), plain, "stable");
        proc_tree(tmp.path(), &["gi1", "gi1/ci0"]);
        let one = fingerprint(tmp.path()).unwrap();
        assert_ne!(one, plain, "a MIG device created");
        std::fs::remove_dir_all(tmp.path().join("driver/nvidia/capabilities/gpu0/mig/gi1"))
            .unwrap();
        assert_eq!(fingerprint(tmp.path()).unwrap(), plain, "and destroyed");
        std::fs::write(tmp.path().join("sys/kernel/random/boot_id"), "other\n").unwrap();
        assert_ne!(fingerprint(tmp.path()).unwrap(), plain, "a reboot");
    }

    fn loads(calls: &Cell<u32>, inv: &Inventory) -> Result<Inventory, DeviceError> {
        calls.set(calls.get() + 1);
        Ok(inv.clone())
    }

    #[test]
    fn a_fresh_cache_spares_the_load_and_anything_else_reloads() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join(CACHE_FILE);
        let inv = device::sample();
        let calls = Cell::new(0);
        let ttl = Duration::from_secs(30);
        let get = |fp: &str, now: u64| cached(&path, fp, ttl, now, || loads(&calls, &inv));

        assert_eq!(get("a", 1_000).unwrap(), inv);
        assert_eq!(calls.get(), 1, "first create loads");
        let mode = std::os::unix::fs::PermissionsExt::mode(
            &std::fs::metadata(&path).unwrap().permissions(),
        );
        assert_eq!(mode & 0o777, 0o644);
        assert_eq!(get("a", 20_000).unwrap(), inv);
        assert_eq!(calls.get(), 1, "fresh and same fingerprint: cached");
        get("b", 20_000).unwrap();
        assert_eq!(calls.get(), 2, "fingerprint changed: loaded again");
        get("b", 20_000 + 30_000).unwrap();
        assert_eq!(calls.get(), 3, "older than the TTL: loaded again");
        get("b", 40_000).unwrap();
        assert_eq!(
            calls.get(),
            4,
            "written in the future (clock stepped back): loaded"
        );
        // Not used when it is anything but a regular file of valid JSON.
        std::fs::write(&path, "{not json").unwrap();
        get("b", 40_001).unwrap();
        assert_eq!(calls.get(), 5, "corrupt: loaded");
        get("b", 40_002).unwrap();
        assert_eq!(calls.get(), 5, "and rewritten");
        let elsewhere = tmp.path().join("elsewhere.json");
        std::fs::rename(&path, &elsewhere).unwrap();
        std::os::unix::fs::symlink(&elsewhere, &path).unwrap();
        get("b", 40_003).unwrap();
        assert_eq!(calls.get(), 6, "a link is not followed");
        assert!(
            !std::fs::symlink_metadata(&path).unwrap().is_symlink(),
            "replaced"
        );
    }

    #[test]
    fn the_v3_probe_is_remembered_per_binary_and_asked_again_when_it_changes() {
        let tmp = tempfile::tempdir().unwrap();
        let bin = tmp.path().join("control");
        std::fs::write(&bin, "one").unwrap();
        let calls = Cell::new(0);
        let ask = |answer: Option<bool>, driver: &str| {
            control_speaks_v3(&bin, driver, tmp.path(), |p| {
                assert_eq!(p, bin);
                calls.set(calls.get() + 1);
                answer
            })
        };
        assert!(ask(Some(true), "615.71.09"));
        assert_eq!(calls.get(), 1, "first create asks");
        assert!(ask(Some(false), "615.71.09"), "the cached answer");
        assert_eq!(calls.get(), 1, "the same binary is not asked again");
        assert!(!ask(Some(false), "620.1"), "another driver: asked again");
        assert_eq!(calls.get(), 2);
        std::fs::write(&bin, "a longer one").unwrap();
        assert!(ask(Some(true), "620.1"), "another size: asked again");
        assert_eq!(calls.get(), 3);
        // Same size, new modification time.
        std::fs::write(&bin, "a longer two").unwrap();
        let old = std::time::SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        std::fs::File::options()
            .write(true)
            .open(&bin)
            .unwrap()
            .set_modified(old)
            .unwrap();
        assert!(!ask(Some(false), "620.1"), "another mtime: asked again");
        assert_eq!(calls.get(), 4);
        // Replaced by another file of the same size and time (a new inode).
        let other = tmp.path().join("other");
        std::fs::write(&other, "a longer two").unwrap();
        std::fs::File::options()
            .write(true)
            .open(&other)
            .unwrap()
            .set_modified(old)
            .unwrap();
        std::fs::rename(&other, &bin).unwrap();
        assert!(ask(Some(true), "620.1"), "replaced: asked again");
        assert_eq!(calls.get(), 5);
        // Another path to the same file is another key.
        let link = tmp.path().join("link");
        std::os::unix::fs::symlink(&bin, &link).unwrap();
        let via_link = control_speaks_v3(&link, "620.1", tmp.path(), |_| Some(false));
        assert!(!via_link, "another path: asked again");
        // No answer: false, and nothing remembered.
        std::fs::remove_file(tmp.path().join(PROTOCOL_CACHE_FILE)).unwrap();
        assert!(!ask(None, "620.1"));
        assert!(!tmp.path().join(PROTOCOL_CACHE_FILE).exists());
        assert!(ask(Some(true), "620.1"));
        assert_eq!(calls.get(), 7);
        // A missing binary is not asked.
        std::fs::remove_file(&bin).unwrap();
        assert!(!ask(Some(true), "620.1"));
        assert_eq!(calls.get(), 7);
    }

    #[test]
    fn a_cache_that_cannot_be_written_is_no_error_and_a_failed_load_is() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("missing-dir").join(CACHE_FILE);
        let inv = device::sample();
        let calls = Cell::new(0);
        let ttl = Duration::from_secs(30);
        assert!(cached(&path, "a", ttl, 1, || loads(&calls, &inv)).is_ok());
        assert!(!path.exists());
        let failed = cached(&tmp.path().join(CACHE_FILE), "a", ttl, 1, || {
            Err(DeviceError::InvalidSource { value: "x".into() })
        });
        assert!(failed.is_err());
        assert!(!tmp.path().join(CACHE_FILE).exists(), "nothing cached");
    }
}
