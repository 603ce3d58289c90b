//! The control daemon's replies as gpushare reads them: server and client lists, the
//! limits `get_*` prints back, and the rows of a v3 command's CSV reply. A reply is
//! another program's output (NVIDIA's daemon, or a daemon a tenant's clients talk to): a
//! reply that is not what these expect reads as nothing (`None`, no pids), never as a
//! panic. Public for the fuzz target `replies`.

/// The pids in a `get_server_list` or `get_client_list` reply: its words that are
/// numbers; anything else in it is skipped.
pub fn pids(reply: &str) -> Vec<u32> {
    reply
        .split_whitespace()
        .filter_map(|w| w.parse::<u32>().ok())
        .collect()
}

/// The non-empty lines of a CSV reply, split on commas.
pub(crate) fn csv_rows(reply: &str) -> impl Iterator<Item = Vec<&str>> {
    reply
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(|l| l.split(',').map(str::trim).collect())
}

/// A percentage as the control daemon prints it (`25.0`); `None` if it is not one.
pub fn percentage(reply: &str) -> Option<f64> {
    reply
        .trim()
        .parse::<f64>()
        .ok()
        .filter(|p| (0.0..=100.0).contains(p))
}

/// A pinned memory limit as the control daemon prints it (`4096M`, `4G`; `none` or
/// anything else: `None`), in bytes.
pub fn pinned_mem(reply: &str) -> Option<u64> {
    let r = reply.trim();
    let split = r.find(|c: char| !c.is_ascii_digit())?;
    let (n, unit) = r.split_at(split);
    let n: u64 = n.parse().ok()?;
    let mib = match unit.to_ascii_uppercase().as_str() {
        "M" | "MB" => n,
        "G" | "GB" => n.checked_mul(1024)?,
        _ => return None,
    };
    mib.checked_mul(1 << 20)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_read_as_the_daemon_prints_them_and_anything_else_as_nothing() {
        assert_eq!(pids("123\n456\n"), vec![123, 456]);
        assert_eq!(pids("Server 12 ready\n-1 4294967296 7"), vec![12, 7]);
        assert!(pids("").is_empty());
        for (reply, want) in [
            ("25.0\n", Some(25.0)),
            ("100", Some(100.0)),
            ("0", Some(0.0)),
        ] {
            assert_eq!(percentage(reply), want, "{reply:?}");
        }
        for reply in ["", "NaN", "inf", "-1", "100.5", "25%"] {
            assert_eq!(percentage(reply), None, "{reply:?}");
        }
        for (reply, want) in [
            ("4096M\n", Some(4096u64 << 20)),
            ("4G", Some(4u64 << 30)),
            ("2gb", Some(2u64 << 30)),
        ] {
            assert_eq!(pinned_mem(reply), want, "{reply:?}");
        }
        for reply in ["", "none", "M", "4", "4T", "4Ǵ", "18446744073709551615G"] {
            assert_eq!(pinned_mem(reply), None, "{reply:?}");
        }
    }
}
