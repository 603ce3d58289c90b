//! The GPU tier's arithmetic and text helpers: medians, overlaps of two clients' compute
//! intervals, the KubeCon experiment's totals, fixed-point formatting, one-line evidence.
//!
//! Invariants: pure functions of their arguments; a figure that cannot be computed (a client
//! that never reached its first kernel) is `None`, never a made-up 0, so that a check says
//! "unknown" rather than passing on it.

/// The median; `None` of nothing.
pub fn median(xs: &[f64]) -> Option<f64> {
    let mut v: Vec<f64> = xs.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

/// `x` with `places` decimals, as printf's `%.Nf`; `?` for an unknown figure.
pub fn fixed(x: Option<f64>, places: usize) -> String {
    match x {
        Some(x) => format!("{x:.places$}"),
        None => "?".to_owned(),
    }
}

/// Two decimals: the evidence lines' seconds and rates.
pub fn f2(x: Option<f64>) -> String {
    fixed(x, 2)
}

/// `x` rounded to `places` decimals, for the JSON lines.
pub fn round(x: f64, places: i32) -> f64 {
    let k = 10f64.powi(places);
    (x * k).round() / k
}

/// One client's times (seconds since the epoch) and whether it succeeded.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Times {
    pub ok: bool,
    pub t_launch: Option<f64>,
    pub t_first_kernel: Option<f64>,
    pub t_end: Option<f64>,
}

/// Seconds both clients computed at once: from the later first kernel to the earlier end
/// (negative when one ended before the other started).
pub fn overlap(a: &Times, b: &Times) -> Option<f64> {
    let end = a.t_end?.min(b.t_end?);
    let start = a.t_first_kernel?.max(b.t_first_kernel?);
    Some(end - start)
}

/// How the KubeCon experiment totals a configuration: the sum of the processes' wall
/// times (run one after another), or first launch to last end (run at once).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Total {
    Sequential,
    Parallel,
}

impl Total {
    pub fn what(self) -> &'static str {
        match self {
            Total::Sequential => "sum of the 4 process wall times",
            Total::Parallel => "first launch to last end",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Span {
    pub total_s: Option<f64>,
    /// First kernel to end, summed over the processes: the time without torch's import and
    /// the CUDA context.
    pub sum_first_kernel_to_end_s: Option<f64>,
    pub all_ok: bool,
}

pub fn span(how: Total, runs: &[Times]) -> Span {
    let all_ok = !runs.is_empty() && runs.iter().all(|r| r.ok);
    let walls: Option<Vec<f64>> = runs.iter().map(|r| Some(r.t_end? - r.t_launch?)).collect();
    let total_s = match how {
        Total::Sequential => walls.map(|w| w.iter().sum()),
        Total::Parallel => {
            let lo = runs
                .iter()
                .map(|r| r.t_launch)
                .collect::<Option<Vec<f64>>>()
                .and_then(|v| v.into_iter().reduce(f64::min));
            let hi = runs
                .iter()
                .map(|r| r.t_end)
                .collect::<Option<Vec<f64>>>()
                .and_then(|v| v.into_iter().reduce(f64::max));
            lo.zip(hi).map(|(lo, hi)| hi - lo)
        }
    };
    let sum_first_kernel_to_end_s = runs
        .iter()
        .map(|r| Some(r.t_end? - r.t_first_kernel?))
        .sum::<Option<f64>>();
    Span {
        total_s,
        sum_first_kernel_to_end_s,
        all_ok,
    }
}

/// Text on one line: newlines become spaces, at most `max` characters (`cut -c`).
pub fn first_line(text: &str, max: usize) -> String {
    text.replace(['\n', '\r'], " ").chars().take(max).collect()
}

/// Text on one line, trimmed: a control command's reply.
pub fn one_line(text: &str) -> String {
    text.replace(['\n', '\r'], " ").trim().to_owned()
}

/// At most `max` characters of `text`.
pub fn cut(text: &str, max: usize) -> String {
    text.chars().take(max).collect()
}

/// A thread percentage read back or reported as 25 (`25`, `25.0`, `25.00` as the driver
/// writes it).
pub fn is_25(text: &str) -> bool {
    match text.strip_prefix("25") {
        Some("") => true,
        Some(rest) => rest
            .strip_prefix('.')
            .is_some_and(|z| z.chars().all(|c| c == '0')),
        None => false,
    }
}

/// `control.log`'s "from user N" lines, counted as `uniq -c` would: `4 from user 0`.
pub fn from_user_counts(log: &str) -> String {
    let mut seen: std::collections::BTreeMap<String, usize> = Default::default();
    for line in log.lines() {
        let lower = line.to_ascii_lowercase();
        let mut from = 0;
        while let Some(at) = lower[from..].find("from user ") {
            let start = from + at;
            let digits = lower[start + 10..]
                .bytes()
                .take_while(u8::is_ascii_digit)
                .count();
            let end = start + 10 + digits;
            *seen.entry(line[start..end].to_owned()).or_default() += 1;
            from = end;
        }
    }
    seen.iter()
        .map(|(what, n)| format!("{n} {what}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// A RUN_ID's timestamp: `20261122T235043Z` (UTC, to the second).
pub fn compact_utc(t: std::time::SystemTime) -> String {
    humantime::format_rfc3339_seconds(t)
        .to_string()
        .replace(['-', ':'], "")
}

/// Seconds since the epoch, as Python's `time.time()` (the workload's clock).
pub fn epoch_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
}

/// Whether a 64-bit little-endian ELF file has a PT_INTERP program header (a dynamically
/// linked executable does, a static or static-pie one does not); `None` if it is not one.
pub fn elf_has_interpreter(b: &[u8]) -> Option<bool> {
    if b.get(..6)? != b"\x7fELF\x02\x01" {
        return None;
    }
    let u16_at = |o: usize| Some(u16::from_le_bytes(b.get(o..o + 2)?.try_into().ok()?));
    let phoff = u64::from_le_bytes(b.get(0x20..0x28)?.try_into().ok()?) as usize;
    let (size, num) = (u16_at(0x36)? as usize, u16_at(0x38)? as usize);
    let mut interp = false;
    for i in 0..num {
        let o = phoff + i * size;
        interp |= u32::from_le_bytes(b.get(o..o + 4)?.try_into().ok()?) == 3;
    }
    Some(interp)
}

/// A size as MPS v3's CLI lists it: a number and a binary unit (`2G`, `2048M`, `2GiB`), or
/// bytes; `None` for anything else (`unlimited`).
pub fn mps_size(text: &str) -> Option<u64> {
    let t = text.trim().trim_end_matches('B').trim_end_matches('i');
    let shift = match t.chars().last()? {
        'K' | 'k' => 10,
        'M' | 'm' => 20,
        'G' | 'g' => 30,
        'T' | 't' => 40,
        _ => 0,
    };
    let num = if shift == 0 { t } else { &t[..t.len() - 1] };
    num.trim().parse::<u64>().ok()?.checked_mul(1 << shift)
}

/// The driver's major version (`615` of `615.71.09`), where it reads as one.
pub fn driver_major(driver: &str) -> Option<u32> {
    driver.trim().split('.').next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(ok: bool, launch: f64, first: f64, end: f64) -> Times {
        Times {
            ok,
            t_launch: Some(launch),
            t_first_kernel: Some(first),
            t_end: Some(end),
        }
    }

    #[test]
    fn medians_of_odd_even_and_no_samples() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), Some(2.5));
        assert_eq!(median(&[7.5]), Some(7.5));
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[f64::NAN, 1.0]), Some(1.0));
    }

    #[test]
    fn fixed_point_as_printf() {
        assert_eq!(fixed(Some(1.23456), 3), "1.235");
        assert_eq!(f2(Some(-0.001)), "-0.00");
        assert_eq!(f2(Some(6.0)), "6.00");
        assert_eq!(f2(None), "?");
        assert_eq!(fixed(Some(1.5), 0), "2");
        assert_eq!(round(33.64149, 3), 33.641);
    }

    #[test]
    fn overlap_is_the_later_start_to_the_earlier_end() {
        let a = t(true, 0.0, 1.0, 7.0);
        let b = t(true, 0.0, 2.0, 8.0);
        assert_eq!(overlap(&a, &b), Some(5.0));
        assert_eq!(overlap(&b, &a), Some(5.0));
        // One after the other: negative.
        let c = t(true, 0.0, 9.0, 10.0);
        assert_eq!(overlap(&a, &c), Some(-2.0));
        let unknown = Times {
            t_first_kernel: None,
            ..a
        };
        assert_eq!(overlap(&unknown, &b), None);
    }

    #[test]
    fn kubecon_totals_sequential_and_parallel() {
        let runs = [t(true, 0.0, 1.0, 3.0), t(true, 5.0, 6.0, 9.0)];
        let seq = span(Total::Sequential, &runs);
        assert_eq!(seq.total_s, Some(7.0));
        assert_eq!(seq.sum_first_kernel_to_end_s, Some(5.0));
        assert!(seq.all_ok);
        let par = span(Total::Parallel, &runs);
        assert_eq!(par.total_s, Some(9.0));
        let failed = [runs[0], Times::default()];
        let s = span(Total::Parallel, &failed);
        assert!(!s.all_ok);
        assert_eq!((s.total_s, s.sum_first_kernel_to_end_s), (None, None));
        assert!(!span(Total::Parallel, &[]).all_ok);
    }

    #[test]
    fn text_on_one_line() {
        assert_eq!(first_line("a\nb\n", 220), "a b ");
        assert_eq!(first_line("abcdef", 3), "abc");
        assert_eq!(one_line("  25.0\n"), "25.0");
        assert_eq!(cut("héllo", 2), "hé");
    }

    #[test]
    fn read_back_percentages() {
        for yes in ["25", "25.", "25.0", "25.00"] {
            assert!(is_25(yes), "{yes}");
        }
        for no in ["", "250", "25.5", "2", "x25", "25.0 "] {
            assert!(!is_25(no), "{no}");
        }
    }

    #[test]
    fn control_log_users_counted() {
        let log = "[x] NEW CLIENT 1 from user 0: ok\n[x] client from user 1000\n[y] from user 0 again\nnothing\n";
        assert_eq!(from_user_counts(log), "2 from user 0 1 from user 1000");
        assert_eq!(from_user_counts(""), "");
    }

    #[test]
    fn run_ids_are_compact_utc() {
        let t = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_795_391_443);
        assert_eq!(compact_utc(t), "20261122T235043Z");
    }

    #[test]
    fn a_dynamic_executable_names_an_interpreter_and_text_is_no_elf() {
        let me = std::fs::read("/proc/self/exe").expect("read /proc/self/exe");
        assert_eq!(elf_has_interpreter(&me), Some(true));
        assert_eq!(elf_has_interpreter(b"#!/bin/sh\n"), None);
        assert_eq!(elf_has_interpreter(&me[..40]), None, "cut short");
    }

    #[test]
    fn mps_sizes_and_driver_majors() {
        assert_eq!(mps_size("2G"), Some(2 << 30));
        assert_eq!(mps_size("2048M"), Some(2 << 30));
        assert_eq!(mps_size("4GiB"), Some(4 << 30));
        assert_eq!(mps_size(" 1024K "), Some(1 << 20));
        assert_eq!(mps_size("512"), Some(512));
        assert_eq!(mps_size("unlimited"), None);
        assert_eq!(mps_size(""), None);
        assert_eq!(mps_size("99999999999T"), None);
        assert_eq!(driver_major("615.71.09"), Some(615));
        assert_eq!(driver_major("580.95.05"), Some(580));
        assert_eq!(driver_major("simulated"), None);
    }
}
