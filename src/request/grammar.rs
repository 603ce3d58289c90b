//! The grammars of request values: what every value passes first, then each key's own
//! grammar (devices, bounded integers, sizes, IPC modes), and how sizes are written back.
//!
//! Invariants:
//! - Every value is checked before anything is built from it, in this order: length (at most
//!   [`MAX_VALUE_LEN`] bytes), then empty, NUL, other control characters, whitespace anywhere,
//!   `/` and `..`, then the key's own grammar. Nothing here does I/O.
//! - Every error is exactly one line naming the key, the value and what is allowed.
//! - Sizes are binary: `K`, `M`, `G`, `T` (case-insensitive), each optionally followed by `i`,
//!   `iB` or `B`, all meaning powers of 1024 as MPS does. A size without a unit is refused as
//!   ambiguous; the minimum is 1M; a size that is not a whole MiB is rounded down by
//!   [`super::types::format_mps_size`].

use super::types::{IpcMode, RequestError, ALLOCATED, MAX_VALUE_LEN, MIB, NAMED_DEVICE_ALLOWED};
use crate::device::{is_well_formed_uuid, quote, DeviceRequest, DeviceSelector};

/// Most entries in a device list.
pub const MAX_DEVICES: usize = 16;
/// Smallest pinned memory limit, in bytes (MPS takes whole MiB).
pub(crate) const MIN_PINNED_MEMORY_LIMIT: u64 = MIB;

const DEVICE_ALLOWED: &str = "a GPU index like 0, GPU-<uuid>, MIG-<uuid>, <gpu>:<mig> like 0:1, a comma-separated list of GPU indices and GPU-<uuid>s, or allocated (the devices the scheduler allocated to the container)";
/// Every unit is binary (1024-based), whatever its spelling — `4G`, `4GiB` and `4GB` are
/// all 4 GiB — because MPS itself reads `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=4GB` that way
/// (documented in docs/requests.md).
pub(super) const SIZE_ALLOWED: &str =
    "a size with a unit, like 512M, 4G, 4GiB or 1536MiB (K, M, G, T; every unit is 1024-based, so 4GB is 4GiB)";
const IPC_ALLOWED: &str = "isolated or host";

/// The checks every value passes first, before its grammar: see the module doc.
pub(super) fn check_raw(
    key: &'static str,
    raw: &str,
    allowed: &'static str,
) -> Result<(), RequestError> {
    if raw.len() > MAX_VALUE_LEN {
        return Err(RequestError::TooLong {
            key,
            value: raw.to_owned(),
            len: raw.len(),
        });
    }
    let problem = if raw.is_empty() {
        "it is empty"
    } else if raw.contains('\0') {
        "it contains a NUL byte"
    } else if raw.chars().any(char::is_control) {
        "it contains a control character"
    } else if raw.chars().any(char::is_whitespace) {
        "it contains whitespace"
    } else if raw.contains('/') {
        "it contains '/'"
    } else if raw.contains("..") {
        "it contains '..'"
    } else {
        return Ok(());
    };
    Err(RequestError::Rejected {
        key,
        value: raw.to_owned(),
        problem: problem.to_owned(),
        allowed,
    })
}

pub(super) fn invalid(key: &'static str, raw: &str, allowed: &'static str) -> RequestError {
    RequestError::Invalid {
        key,
        value: raw.to_owned(),
        allowed,
    }
}

pub(super) fn rejected(
    key: &'static str,
    raw: &str,
    problem: String,
    allowed: &'static str,
) -> RequestError {
    RequestError::Rejected {
        key,
        value: raw.to_owned(),
        problem,
        allowed,
    }
}

/// A decimal `u32` without sign, at most 10 digits.
pub(super) fn parse_index(s: &str) -> Option<u32> {
    if s.is_empty() || s.len() > 10 || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

pub(super) fn parse_selector(entry: &str) -> Option<DeviceSelector> {
    if entry.starts_with("GPU-") {
        is_well_formed_uuid(entry, "GPU-").then(|| DeviceSelector::GpuUuid(entry.to_owned()))
    } else if entry.starts_with("MIG-") {
        is_well_formed_uuid(entry, "MIG-").then(|| DeviceSelector::MigUuid(entry.to_owned()))
    } else if let Some((gpu, mig)) = entry.split_once(':') {
        Some(DeviceSelector::MigIndex {
            gpu: parse_index(gpu)?,
            mig: parse_index(mig)?,
        })
    } else {
        parse_index(entry).map(DeviceSelector::Index)
    }
}

/// Parses named devices: `0`, `GPU-<uuid>`, `MIG-<uuid>`, `0:1`, or a comma-separated list of
/// at most [`MAX_DEVICES`] full GPUs. The `GPU-`/`MIG-` prefixes are case-sensitive, the hex is
/// kept as written (resolution matches it case-insensitively). Duplicates are found by
/// resolution, which knows that `0` and `GPU-…` may be the same GPU. `ALLOCATED` is not
/// a device here: [`super::parse`] reads it before, with the container at hand.
pub fn parse_device(key: &'static str, raw: &str) -> Result<DeviceRequest, RequestError> {
    parse_device_with(key, raw, DEVICE_ALLOWED)
}

/// [`parse_device`] where no container is at hand (`gpushare daemon start --device`, named
/// `what` in the refusal): [`ALLOCATED`] is refused with a line of its own, and errors
/// do not offer it.
pub(crate) fn parse_device_without_container(
    key: &'static str,
    raw: &str,
    what: &'static str,
) -> Result<DeviceRequest, RequestError> {
    if raw == ALLOCATED {
        return Err(RequestError::AllocatedWithoutContainer {
            key,
            value: raw.to_owned(),
            what,
        });
    }
    parse_device_with(key, raw, NAMED_DEVICE_ALLOWED)
}

fn parse_device_with(
    key: &'static str,
    raw: &str,
    allowed: &'static str,
) -> Result<DeviceRequest, RequestError> {
    check_raw(key, raw, allowed)?;
    let count = raw.split(',').count();
    if count > MAX_DEVICES {
        return Err(rejected(
            key,
            raw,
            format!("it lists {count} devices"),
            "at most 16 devices in a list",
        ));
    }
    let mut selectors = Vec::with_capacity(count);
    for (n, entry) in raw.split(',').enumerate() {
        let selector = match parse_selector(entry) {
            Some(selector) => selector,
            None if count == 1 => return Err(invalid(key, raw, allowed)),
            None if entry.is_empty() => {
                return Err(rejected(
                    key,
                    raw,
                    format!("entry {} is empty", n + 1),
                    allowed,
                ))
            }
            None => {
                return Err(rejected(
                    key,
                    raw,
                    format!("entry {} ({}) is not a device", n + 1, quote(entry)),
                    allowed,
                ))
            }
        };
        selectors.push(selector);
    }
    if selectors.len() > 1 && selectors.iter().any(DeviceSelector::is_mig) {
        return Err(RequestError::MigInList {
            key,
            value: raw.to_owned(),
        });
    }
    Ok(DeviceRequest(selectors))
}

/// Parses an integer from `min` to `max`: decimal digits only (no sign, no decimals),
/// leading zeros allowed, no more digits than `max` has. Errors say `allowed`.
pub(crate) fn parse_integer(
    key: &'static str,
    raw: &str,
    min: u64,
    max: u64,
    allowed: &'static str,
) -> Result<u64, RequestError> {
    check_raw(key, raw, allowed)?;
    if raw.len() > max.to_string().len() || !raw.bytes().all(|b| b.is_ascii_digit()) {
        return Err(invalid(key, raw, allowed));
    }
    match raw.parse::<u64>() {
        Ok(n) if (min..=max).contains(&n) => Ok(n),
        _ => Err(invalid(key, raw, allowed)),
    }
}

/// Parses a size in bytes: decimal digits then a binary unit (see the module doc). Refuses no
/// unit (ambiguous), fractions, zero, less than 1M, and more than fits in 64 bits.
pub fn parse_size(key: &'static str, raw: &str) -> Result<u64, RequestError> {
    check_raw(key, raw, SIZE_ALLOWED)?;
    let split = raw
        .bytes()
        .position(|b| !b.is_ascii_digit())
        .unwrap_or(raw.len());
    let (digits, unit) = raw.split_at(split);
    if digits.is_empty() {
        return Err(invalid(key, raw, SIZE_ALLOWED));
    }
    if unit.is_empty() {
        return Err(rejected(
            key,
            raw,
            "it has no unit, which is ambiguous".to_owned(),
            SIZE_ALLOWED,
        ));
    }
    let lower = unit.to_ascii_lowercase();
    // By char, not byte: the unit may start with a multibyte character.
    let mut chars = lower.chars();
    let (shift, suffix) = match (chars.next(), chars.as_str()) {
        (Some('k'), s) => (10, s),
        (Some('m'), s) => (20, s),
        (Some('g'), s) => (30, s),
        (Some('t'), s) => (40, s),
        _ => return Err(invalid(key, raw, SIZE_ALLOWED)),
    };
    if !matches!(suffix, "" | "i" | "ib" | "b") {
        return Err(invalid(key, raw, SIZE_ALLOWED));
    }
    let too_large = || {
        rejected(
            key,
            raw,
            "it does not fit in 64 bits".to_owned(),
            "at most 16777215T",
        )
    };
    let n: u64 = digits.parse().map_err(|_| too_large())?;
    let bytes = n.checked_mul(1 << shift).ok_or_else(too_large)?;
    if bytes < MIN_PINNED_MEMORY_LIMIT {
        let problem = if n == 0 {
            "it is zero"
        } else {
            "it is less than 1M"
        };
        return Err(rejected(key, raw, problem.to_owned(), "at least 1M"));
    }
    Ok(bytes)
}

/// Parses an IPC mode: exactly `isolated` or `host`.
pub(crate) fn parse_ipc(key: &'static str, raw: &str) -> Result<IpcMode, RequestError> {
    check_raw(key, raw, IPC_ALLOWED)?;
    match raw {
        "isolated" => Ok(IpcMode::Isolated),
        "host" => Ok(IpcMode::Host),
        _ => Err(invalid(key, raw, IPC_ALLOWED)),
    }
}

/// The value of the last `name=` entry of `env`, as execve would see it.
pub(super) fn env_lookup<'a>(env: &'a [String], name: &str) -> Option<&'a str> {
    env.iter()
        .rev()
        .find_map(|entry| entry.split_once('=').filter(|(k, _)| *k == name))
        .map(|(_, v)| v)
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::device::testing::{GPU0, GPU1, MIG0};
    use crate::request::parse_percentage;
    use crate::request::types::{format_mps_size, GIB};

    #[test]
    fn multibyte_units_are_errors_not_panics() {
        // Found by the `request` fuzz target: a unit starting with a multibyte character.
        for raw in ["4\u{fffd}", "1é", "2Ｇ", "3💥B"] {
            let err = parse_size("gpushare.io/pinned-memory-limit", raw)
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("allowed is a size with a unit"),
                "{raw}: {err}"
            );
        }
    }

    /// Asserts a one-line message naming the key, the quoted value and `want`.
    pub(in crate::request) fn assert_msg(err: &RequestError, key: &str, raw: &str, want: &str) {
        let msg = err.to_string();
        assert!(!msg.contains('\n'), "{msg:?}");
        assert!(
            msg.starts_with(&format!("{key}={} ", quote(raw))),
            "{msg:?} lacks {key}={raw:?}"
        );
        assert!(msg.contains(want), "{msg:?} lacks {want:?}");
    }

    #[test]
    fn device_good() {
        use DeviceSelector::*;
        let gpu1_list = format!("0,{GPU1}");
        let cases: Vec<(&str, Vec<DeviceSelector>)> = vec![
            ("0", vec![Index(0)]),
            ("7", vec![Index(7)]),
            ("4294967295", vec![Index(u32::MAX)]),
            (GPU0, vec![GpuUuid(GPU0.into())]),
            (
                "GPU-8F8BFF94-112E-9541-43DA-CFD453333404",
                vec![GpuUuid("GPU-8F8BFF94-112E-9541-43DA-CFD453333404".into())],
            ),
            (MIG0, vec![MigUuid(MIG0.into())]),
            ("0:1", vec![MigIndex { gpu: 0, mig: 1 }]),
            ("0,1", vec![Index(0), Index(1)]),
            ("1,0", vec![Index(1), Index(0)]),
            ("0,0", vec![Index(0), Index(0)]),
            (&gpu1_list, vec![Index(0), GpuUuid(GPU1.into())]),
            (
                "0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15",
                (0..16).map(Index).collect(),
            ),
        ];
        for (raw, want) in cases {
            assert_eq!(
                parse_device("gpushare.io/device", raw).expect(raw),
                DeviceRequest(want),
                "{raw}"
            );
        }
        let sixteen_uuids = vec![GPU0; 16].join(",");
        assert_eq!(
            parse_device("k", &sixteen_uuids).expect("16 uuids").0.len(),
            16
        );
    }

    #[test]
    fn device_bad() {
        let key = "gpushare.io/device";
        let cases: Vec<(String, &str)> = vec![
            ("".into(), "it is empty; allowed is a GPU index like 0, GPU-<uuid>, MIG-<uuid>, <gpu>:<mig> like 0:1, a comma-separated list of GPU indices and GPU-<uuid>s, or allocated (the devices the scheduler allocated to the container)"),
            ("x".into(), "is invalid: allowed is a GPU index like 0"),
            ("-1".into(), "allowed is a GPU index"),
            ("+1".into(), "allowed is a GPU index"),
            ("1.0".into(), "allowed is a GPU index"),
            ("4294967296".into(), "allowed is a GPU index"),
            ("gpu-8f8bff94".into(), "allowed is a GPU index"),
            ("GPU-".into(), "allowed is a GPU index"),
            ("GPU-xyz".into(), "allowed is a GPU index"),
            ("MIG-GPU-8f8bff94-112e-9541-43da-cfd453333404/1/0".into(), "it contains '/'; allowed is a GPU index"),
            ("0:".into(), "allowed is a GPU index"),
            (":1".into(), "allowed is a GPU index"),
            ("0:1:2".into(), "allowed is a GPU index"),
            ("0,".into(), "is invalid: entry 2 is empty; allowed is a GPU index"),
            (",0".into(), "entry 1 is empty; allowed is a GPU index"),
            ("0,,1".into(), "entry 2 is empty; allowed is"),
            ("0,x".into(), "entry 2 (\"x\") is not a device; allowed is a GPU index"),
            ("0, 1".into(), "it contains whitespace; allowed is a GPU index"),
            (" 0".into(), "it contains whitespace"),
            ("0\n".into(), "it contains a control character"),
            ("0\0".into(), "it contains a NUL byte"),
            ("0\u{7f}".into(), "it contains a control character"),
            ("0\u{a0}".into(), "it contains whitespace"),
            ("..".into(), "it contains '..'"),
            ("../../etc".into(), "it contains '/'"),
            (format!("0,{MIG0}"), "is invalid: a MIG device must stand alone, not in a list"),
            ("0:1,1".into(), "is invalid: a MIG device must stand alone, not in a list"),
            ("0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16".into(), "is invalid: it lists 17 devices; allowed is at most 16 devices in a list"),
            (",".repeat(20), "it lists 21 devices; allowed is at most 16"),
            ("1".repeat(1025), "is invalid: it is 1025 bytes long; allowed is at most 1024 bytes"),
            (format!("{}\n", "1".repeat(2000)), "it is 2001 bytes long"),
        ];
        for (raw, want) in &cases {
            let err = parse_device(key, raw).expect_err(raw);
            assert_msg(&err, key, raw, want);
        }
    }

    #[test]
    fn percentage() {
        let good = [("1", 1), ("50", 50), ("100", 100), ("050", 50), ("007", 7)];
        for (raw, want) in good {
            assert_eq!(parse_percentage("k", raw).expect(raw), want);
        }
        let key = "gpushare.io/active-thread-percentage";
        let bad: &[(&str, &str)] = &[
            ("0", "is invalid: allowed is an integer from 1 to 100"),
            ("101", "is invalid: allowed is an integer from 1 to 100"),
            ("255", "allowed is an integer from 1 to 100"),
            ("256", "allowed is an integer from 1 to 100"),
            ("0100", "allowed is an integer from 1 to 100"),
            ("+50", "allowed is an integer from 1 to 100"),
            ("-5", "allowed is an integer from 1 to 100"),
            ("50.0", "allowed is an integer from 1 to 100"),
            ("50%", "allowed is an integer from 1 to 100"),
            ("1e2", "allowed is an integer from 1 to 100"),
            ("", "it is empty; allowed is an integer from 1 to 100"),
            (
                " 50",
                "it contains whitespace; allowed is an integer from 1 to 100",
            ),
            (
                "5\u{0}0",
                "it contains a NUL byte; allowed is an integer from 1 to 100",
            ),
        ];
        for (raw, want) in bad {
            let err = parse_percentage(key, raw).expect_err(raw);
            assert_msg(&err, key, raw, want);
        }
        let err = parse_percentage(key, "101").expect_err("101");
        assert_eq!(
            err.to_string(),
            "gpushare.io/active-thread-percentage=\"101\" is invalid: allowed is an integer from 1 to 100"
        );
    }

    #[test]
    fn size() {
        const K: u64 = 1 << 10;
        let good: &[(&str, u64)] = &[
            ("512M", 512 * MIB),
            ("4G", 4 * GIB),
            ("4GiB", 4 * GIB),
            ("4Gi", 4 * GIB),
            ("4GB", 4 * GIB),
            ("4gb", 4 * GIB),
            ("4g", 4 * GIB),
            ("1536MiB", 1536 * MIB),
            ("1024K", MIB),
            ("1024KiB", MIB),
            ("1536K", 1536 * K),
            ("1M", MIB),
            ("1T", 1 << 40),
            ("16777215T", 16_777_215 << 40),
        ];
        for (raw, want) in good {
            assert_eq!(parse_size("k", raw).expect(raw), *want, "{raw}");
        }
        let key = "GPUSHARE_PINNED_MEMORY_LIMIT";
        let bad: &[(&str, &str)] = &[
            ("abc", "is invalid: allowed is a size with a unit, like 512M, 4G, 4GiB or 1536MiB"),
            ("512", "is invalid: it has no unit, which is ambiguous; allowed is a size with a unit, like 512M"),
            ("512B", "allowed is a size with a unit"),
            ("512P", "allowed is a size with a unit"),
            ("512Mb2", "allowed is a size with a unit"),
            ("512MiBs", "allowed is a size with a unit"),
            ("512iB", "allowed is a size with a unit"),
            ("1.5G", "allowed is a size with a unit"),
            ("-1G", "allowed is a size with a unit"),
            ("+1G", "allowed is a size with a unit"),
            ("G", "allowed is a size with a unit"),
            ("0M", "is invalid: it is zero; allowed is at least 1M"),
            ("0G", "it is zero; allowed is at least 1M"),
            ("1023K", "is invalid: it is less than 1M; allowed is at least 1M"),
            ("16777216T", "is invalid: it does not fit in 64 bits; allowed is at most 16777215T"),
            ("99999999999999999999999G", "it does not fit in 64 bits"),
            ("4 G", "it contains whitespace; allowed is a size with a unit"),
            ("4G\n", "it contains a control character"),
            ("", "it is empty; allowed is a size with a unit"),
        ];
        for (raw, want) in bad {
            let err = parse_size(key, raw).expect_err(raw);
            assert_msg(&err, key, raw, want);
        }
        assert_eq!(
            parse_size(key, "abc").expect_err("abc").to_string(),
            "GPUSHARE_PINNED_MEMORY_LIMIT=\"abc\" is invalid: allowed is a size with a unit, like 512M, 4G, 4GiB or 1536MiB (K, M, G, T; every unit is 1024-based, so 4GB is 4GiB)"
        );
        assert_eq!(
            parse_size(key, "4GB").ok(),
            Some(4 << 30),
            "4GB is binary, as MPS reads it"
        );
    }

    #[test]
    fn mps_size() {
        let cases: &[(u64, &str)] = &[
            (MIB, "1M"),
            (512 * MIB, "512M"),
            (4 * GIB, "4096M"),
            (1536 * 1024, "1M"),
            (2 * MIB - 1, "1M"),
            (24 * GIB + 1, "24576M"),
        ];
        for (bytes, want) in cases {
            assert_eq!(&format_mps_size(*bytes), want, "{bytes}");
        }
    }

    #[test]
    fn ipc() {
        for (raw, want) in [("isolated", IpcMode::Isolated), ("host", IpcMode::Host)] {
            assert_eq!(parse_ipc("k", raw).expect(raw), want);
            assert_eq!(raw.parse::<IpcMode>().expect(raw), want);
            assert_eq!(want.to_string(), raw);
            assert_eq!(
                serde_json::to_string(&want).expect("ser"),
                format!("\"{raw}\"")
            );
        }
        assert_eq!(IpcMode::default(), IpcMode::Isolated);
        let key = "gpushare.io/ipc";
        for raw in [
            "Host",
            "HOST",
            "none",
            "private",
            "shareable",
            "host,isolated",
        ] {
            let err = parse_ipc(key, raw).expect_err(raw);
            assert_msg(&err, key, raw, "is invalid: allowed is isolated or host");
        }
        assert_msg(
            &parse_ipc(key, "host ").expect_err("sp"),
            key,
            "host ",
            "it contains whitespace; allowed is isolated or host",
        );
        assert_msg(
            &"container:x".parse::<IpcMode>().expect_err("x"),
            "ipc",
            "container:x",
            "allowed is isolated or host",
        );
    }

    #[test]
    fn quoting_in_messages() {
        let key = "gpushare.io/ipc";
        let raw = format!("host\0\n\"{}", "y".repeat(100));
        let msg = parse_ipc(key, &raw).expect_err("nul").to_string();
        assert!(
            msg.starts_with("gpushare.io/ipc=\"host\\0\\n\\\"yyy"),
            "{msg}"
        );
        assert!(
            msg.contains("y…\" is invalid: it contains a NUL byte; allowed is isolated or host"),
            "{msg}"
        );
        assert!(!msg.contains('\n') && !msg.contains('\0'));
    }
}
