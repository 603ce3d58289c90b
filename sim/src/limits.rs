//! Limit values the simulator stores and hands out: the active thread percentage and the
//! pinned device memory limit, with their text forms and the "a client may only lower" rule.
//!
//! Invariants: a [`Percentage`] is finite and within 1..=100; a [`MemLimit`] is at least
//! 1 MiB and keeps the text it is printed as (`4096M`, `1G`), because the control commands
//! read back what was set; device keys never contain `=`, `,` or whitespace, so a
//! [`DeviceLimits`] list always round-trips through its `0=1G,1=512M` form.

use std::collections::BTreeMap;
use std::fmt;

use thiserror::Error;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum LimitError {
    #[error("invalid active thread percentage {value:?}: expected a number from 1 to 100")]
    Percentage { value: String },
    #[error("invalid memory limit {value:?}: expected an integer followed by M or G")]
    Memory { value: String },
    #[error("invalid device {value:?}: expected an ordinal or a UUID")]
    Device { value: String },
    #[error("invalid pinned memory limit entry {value:?}: expected <device>=<limit>")]
    Entry { value: String },
}

/// An active thread percentage, as `set_*_active_thread_percentage` and
/// CUDA_MPS_ACTIVE_THREAD_PERCENTAGE take it.
#[derive(Debug, Clone, Copy, PartialEq, PartialOrd)]
pub struct Percentage(f64);

impl Percentage {
    pub const FULL: Percentage = Percentage(100.0);

    pub fn parse(text: &str) -> Result<Self, LimitError> {
        let err = || LimitError::Percentage {
            value: text.to_string(),
        };
        // f64::from_str also takes "inf", "1e2" and "+5"; the daemon takes plain decimals only.
        let plain = !text.is_empty()
            && text.chars().all(|c| c.is_ascii_digit() || c == '.')
            && text.chars().filter(|&c| c == '.').count() <= 1
            && text.chars().any(|c| c.is_ascii_digit());
        if !plain {
            return Err(err());
        }
        let value: f64 = text.parse().map_err(|_| err())?;
        if !(1.0..=100.0).contains(&value) {
            return Err(err());
        }
        Ok(Percentage(value))
    }

    /// The number itself (v3 lists print it with two decimals).
    pub fn value(self) -> f64 {
        self.0
    }

    /// The lower of the two: a client setting can only tighten the server's.
    pub fn lowered_by(self, client: Option<Percentage>) -> Percentage {
        match client {
            Some(c) if c.0 < self.0 => c,
            _ => self,
        }
    }
}

impl fmt::Display for Percentage {
    // The real control daemon prints `25.0` after `set_default_active_thread_percentage 25`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.fract() == 0.0 {
            write!(f, "{:.1}", self.0)
        } else {
            write!(f, "{}", self.0)
        }
    }
}

/// A pinned device memory limit: "an integer followed by a qualifier, either G or M"
/// (MPS guide); the `MB`/`GB` spelling of the env example is accepted too.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemLimit {
    mib: u64,
    text: String,
}

impl MemLimit {
    pub fn parse(text: &str) -> Result<Self, LimitError> {
        let err = || LimitError::Memory {
            value: text.to_string(),
        };
        let digits_end = text.find(|c: char| !c.is_ascii_digit()).ok_or_else(err)?;
        let (digits, unit) = text.split_at(digits_end);
        let number: u64 = digits.parse().map_err(|_| err())?;
        let (factor, letter) = match unit.to_ascii_uppercase().as_str() {
            "M" | "MB" => (1, 'M'),
            "G" | "GB" => (1024, 'G'),
            _ => return Err(err()),
        };
        let mib = number.checked_mul(factor).ok_or_else(err)?;
        if mib == 0 {
            return Err(err());
        }
        Ok(MemLimit {
            mib,
            text: format!("{number}{letter}"),
        })
    }

    /// A limit of whole MiB, printed `<n>M` (v3 sizes arrive in bytes); `None` for 0.
    pub fn from_mib(mib: u64) -> Option<Self> {
        (mib > 0).then(|| MemLimit {
            mib,
            text: format!("{mib}M"),
        })
    }

    pub fn bytes(&self) -> u64 {
        self.mib.saturating_mul(1 << 20)
    }

    /// What the control daemon prints for this limit: whole GiB as `<n>G`, else `<n>M`.
    pub fn read_back(&self) -> String {
        if self.mib % 1024 == 0 {
            format!("{}G", self.mib / 1024)
        } else {
            format!("{}M", self.mib)
        }
    }
}

impl fmt::Display for MemLimit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// Checks a device key: an ordinal (`0`) or a UUID (`GPU-…`, `MIG-…`, including the old
/// `MIG-GPU-<uuid>/<gi>/<ci>` form).
pub fn parse_device(text: &str) -> Result<String, LimitError> {
    let ok = !text.is_empty()
        && text.len() <= 128
        && text
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | ':' | '/' | '.'));
    if ok {
        Ok(text.to_string())
    } else {
        Err(LimitError::Device {
            value: text.to_string(),
        })
    }
}

/// Pinned memory limits per device, ordered by device key so the printed form is stable.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceLimits(BTreeMap<String, MemLimit>);

impl DeviceLimits {
    /// Parses the CUDA_MPS_PINNED_DEVICE_MEM_LIMIT form, `0=1G,1=512MB`; `none` and the
    /// empty string mean no limit.
    pub fn parse(text: &str) -> Result<Self, LimitError> {
        let mut limits = DeviceLimits::default();
        if text == "none" {
            return Ok(limits);
        }
        for entry in text.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            let (dev, value) = entry.split_once('=').ok_or_else(|| LimitError::Entry {
                value: entry.to_string(),
            })?;
            limits.set(parse_device(dev.trim())?, MemLimit::parse(value.trim())?);
        }
        Ok(limits)
    }

    pub fn set(&mut self, device: String, limit: MemLimit) {
        self.0.insert(device, limit);
    }

    pub fn get(&self, device: &str) -> Option<&MemLimit> {
        self.0.get(device)
    }

    /// The devices the list names.
    pub fn devices(&self) -> impl Iterator<Item = &str> {
        self.0.keys().map(String::as_str)
    }

    /// Per device, the lower of the two limits; a device only one side limits keeps that limit
    /// (no limit counts as unlimited, so a client can add a limit but never lift one).
    pub fn lowered_by(&self, client: &DeviceLimits) -> DeviceLimits {
        let mut out = self.clone();
        for (dev, limit) in &client.0 {
            let lower = match out.0.get(dev) {
                Some(current) => limit.mib < current.mib,
                None => true,
            };
            if lower {
                out.0.insert(dev.clone(), limit.clone());
            }
        }
        out
    }
}

impl fmt::Display for DeviceLimits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return f.write_str("none");
        }
        for (i, (dev, limit)) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{dev}={limit}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentage_parse_and_print() {
        let cases = [
            ("25", Some("25.0")),
            ("25.5", Some("25.5")),
            ("100", Some("100.0")),
            ("1", Some("1.0")),
            ("0", None),
            ("0.5", None),
            ("100.1", None),
            ("", None),
            (".", None),
            ("inf", None),
            ("1e2", None),
            ("-5", None),
            ("+5", None),
            ("1.2.3", None),
        ];
        for (input, want) in cases {
            let got = Percentage::parse(input).ok().map(|p| p.to_string());
            assert_eq!(got.as_deref(), want, "input {input:?}");
        }
    }

    #[test]
    fn percentage_client_only_lowers() {
        let server = Percentage::parse("50").unwrap();
        let low = Percentage::parse("20").unwrap();
        let high = Percentage::parse("80").unwrap();
        assert_eq!(server.lowered_by(Some(low)), low);
        assert_eq!(server.lowered_by(Some(high)), server);
        assert_eq!(server.lowered_by(None), server);
    }

    #[test]
    fn mem_limit_parse() {
        let cases = [
            ("4096M", Some(("4096M", 4096))),
            ("1G", Some(("1G", 1024))),
            ("512MB", Some(("512M", 512))),
            ("2GB", Some(("2G", 2048))),
            ("10g", Some(("10G", 10240))),
            ("0M", None),
            ("M", None),
            ("12", None),
            ("12K", None),
            ("1.5G", None),
            ("-1G", None),
            ("99999999999999999999G", None),
            ("18446744073709551615G", None),
        ];
        for (input, want) in cases {
            let got = MemLimit::parse(input).ok().map(|m| (m.to_string(), m.mib));
            assert_eq!(
                got,
                want.map(|(t, m)| (t.to_string(), m)),
                "input {input:?}"
            );
        }
    }

    #[test]
    fn device_keys() {
        for ok in ["0", "12", "GPU-cb1213a3-d6a4-be7f", "MIG-GPU-abc/1/0"] {
            assert!(parse_device(ok).is_ok(), "{ok}");
        }
        for bad in ["", "0=1", "a,b", "a b", "gpu\n"] {
            assert!(parse_device(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn device_limits_parse_and_print() {
        let cases = [
            ("0=1G,1=512MB", Some("0=1G,1=512M")),
            ("1=512M, 0=1G", Some("0=1G,1=512M")),
            ("", Some("none")),
            ("none", Some("none")),
            ("GPU-abc=2G", Some("GPU-abc=2G")),
            ("0", None),
            ("0=", None),
            ("=1G", None),
            ("0=1X", None),
        ];
        for (input, want) in cases {
            let got = DeviceLimits::parse(input).ok().map(|l| l.to_string());
            assert_eq!(got.as_deref(), want, "input {input:?}");
        }
    }

    #[test]
    fn device_limits_client_only_lowers() {
        let server = DeviceLimits::parse("0=2G,1=1G").unwrap();
        let client = DeviceLimits::parse("0=512M,1=4G,2=100M").unwrap();
        assert_eq!(server.lowered_by(&client).to_string(), "0=512M,1=1G,2=100M");
        assert_eq!(
            DeviceLimits::default().lowered_by(&client).to_string(),
            "0=512M,1=4G,2=100M"
        );
        assert_eq!(
            server.lowered_by(&DeviceLimits::default()).to_string(),
            "0=2G,1=1G"
        );
    }
}
