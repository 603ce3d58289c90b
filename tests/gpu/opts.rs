//! The GPU tier's options: the command line after `cargo test --test gpu --` (or the test
//! executable's own), each with an environment variable where that is simpler (scripts/test
//! passes no options). A command-line option wins over its variable.
//!
//! Invariants: parsing is pure (the environment comes in as a function); libtest's own
//! flags, which `cargo test` may pass to any test executable, are accepted and ignored, and
//! its filters select or skip the one test this target holds, `gpu_tier`, as libtest would
//! (testkit's `Libtest`).

use std::path::PathBuf;

use clap::Parser;
use testkit::libtest::Libtest;

/// The name under which `--list` and filters see the tier.
pub const TEST_NAME: &str = "gpu_tier";

/// The sections `--only` can name, in the order they run.
pub const SECTIONS: &[&str] = &[
    "per-user",
    "shared",
    "flags",
    "multi-user",
    "tenant-control",
    "limits",
    "uuid-limit",
    "small-batch",
    "create-path",
    "driver-root",
    "r5-v3",
    "r5-v3-backend",
    "r5-coloc",
    "r4-nodes",
    "r4-nvml",
    "r4-terminate",
    "r4-threads",
    "r4-watch",
    "r4-privileged",
    "containers",
    "skip-mps",
    "cdi",
];
/// `--only round4`: every round-4 section (round4.rs), in the order they run.
pub const ROUND4: &str = "round4";
pub const ROUND4_SECTIONS: &[&str] = &[
    "r4-nodes",
    "r4-nvml",
    "r4-terminate",
    "r4-threads",
    "r4-watch",
    "r4-privileged",
];
/// `--only round5`: every round-5 section (round5.rs), in the order they run (before
/// round 4's).
pub const ROUND5: &str = "round5";
pub const ROUND5_SECTIONS: &[&str] = &["r5-v3", "r5-v3-backend", "r5-coloc"];
/// The sections that run real containers (`--containers`).
pub const CONTAINER_SECTIONS: &[&str] = &["containers", "skip-mps", "cdi"];

/// The options. Each field's variable fills it where the command line leaves it unset.
#[derive(Parser, Debug, Clone, PartialEq)]
#[command(
    bin_name = "cargo test --test gpu --",
    about = "The GPU tier: as root, from the repository root (or the test executable itself).",
    after_help = ENV_HELP,
    args_override_self = true,
    disable_version_flag = true
)]
pub struct Options {
    /// Run against gpushare-mps-sim instead of a GPU (also what runs when no GPU is found)
    /// [GPUSHARE_GPU_SIMULATE=1]
    #[arg(long)]
    pub simulate: bool,
    /// Where gpushare, gpushare-runtime and gpushare-mps-sim are (default: this build's
    /// target dir if it exists, else target/release) [GPUSHARE_BIN_DIR]
    #[arg(long, value_name = "DIR")]
    pub bin_dir: Option<PathBuf>,
    /// Append raw JSON lines here (default docs/gpu-validation-raw.jsonl; simulated
    /// target/tmp/gpu-simulate.jsonl) [GPUSHARE_GPU_OUT]
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
    /// Matrix products per process in the KubeCon experiment (default 100000)
    /// [GPUSHARE_GPU_ITERATIONS]
    #[arg(long = "iterations", value_name = "N", value_parser = positive::<u64>)]
    iterations_arg: Option<u64>,
    #[arg(skip = 100_000u64)]
    pub iterations: u64,
    /// Seconds each concurrent client computes (default 6; 1.5 simulated) [GPUSHARE_GPU_HOLD]
    #[arg(long = "hold", value_name = "S", value_parser = hold_seconds)]
    hold: Option<f64>,
    /// Python with torch, runnable by UIDs 1000-4000 (default: python3's executable)
    /// [GPUSHARE_GPU_PYTHON]
    #[arg(long, value_name = "PATH")]
    pub python: Option<PathBuf>,
    /// Keep the work directory under /tmp (every daemon's and client's log)
    /// [GPUSHARE_GPU_KEEP=1]
    #[arg(long)]
    pub keep: bool,
    /// Then two users' PyTorch containers through gpushare-runtime and runc (real GPU only)
    /// [GPUSHARE_GPU_CONTAINERS=1]
    #[arg(long)]
    pub containers: bool,
    /// runc for --containers (default: runc on PATH) [GPUSHARE_GPU_RUNC]
    #[arg(long, value_name = "PATH")]
    pub runc: Option<PathBuf>,
    /// Run only these sections (comma-separated; the header, the preflight and the restore
    /// always run): per-user, shared, flags, multi-user, tenant-control, limits, uuid-limit,
    /// small-batch, create-path, driver-root, round 5's r5-v3, r5-v3-backend, r5-coloc (`round5`: all three),
    /// round 4's r4-nodes, r4-nvml, r4-terminate, r4-threads, r4-watch, r4-privileged
    /// (`round4`: all six), the container sections containers, skip-mps, cdi (real GPU
    /// only; naming one implies --containers) [GPUSHARE_GPU_ONLY]
    #[arg(long = "only", value_name = "LIST", value_parser = sections)]
    only_arg: Option<Sections>,
    /// `--only`: the sections to run; `None` runs every section.
    #[arg(skip)]
    pub only: Option<Vec<String>>,
    /// Round 4: seconds its clients compute or hold an allocation (default 5; 1
    /// simulated) [GPUSHARE_GPU_R4_HOLD]
    #[arg(long = "r4-hold", value_name = "S", value_parser = hold_seconds)]
    r4_hold: Option<f64>,
    /// Round 5: seconds each co-location setup measures (default 6; 0.25 simulated)
    /// [GPUSHARE_GPU_R5_SECONDS]
    #[arg(long = "r5-seconds", value_name = "S", value_parser = hold_seconds)]
    r5_seconds: Option<f64>,
    #[arg(skip = 30u32)]
    pub create_rounds: u32,
    #[arg(skip)]
    pub inventory_override: Option<String>,
    #[command(flatten)]
    pub libtest: Libtest,
}

const ENV_HELP: &str = "\
Also read: GPUSHARE_GPU_CREATE_ROUNDS (creates per inventory in section 7, default 30),
GPUSHARE_GPU_INVENTORY (replaces inventory = \"nvml\", a test hook: file:/path) and
GPUSHARE_GPU_DRIVER_ROOT (section 8's driver root; default: one made of read-only binds of
the driver's own directories). An option wins over its variable.";

/// `--only`'s list, checked.
#[derive(Debug, Clone, PartialEq)]
struct Sections(Vec<String>);

fn positive<N: std::str::FromStr + Default + PartialOrd>(v: &str) -> Result<N, String> {
    v.parse()
        .ok()
        .filter(|n| *n > N::default())
        .ok_or_else(|| format!("must be a positive integer, not {v:?}"))
}

fn hold_seconds(v: &str) -> Result<f64, String> {
    v.parse()
        .ok()
        .filter(|s: &f64| (0.5..=120.0).contains(s))
        .ok_or_else(|| format!("must be a number of seconds from 0.5 to 120, not {v:?}"))
}

fn sections(list: &str) -> Result<Sections, String> {
    let names: Vec<String> = list
        .split(',')
        .map(|n| n.trim().to_owned())
        .filter(|n| !n.is_empty())
        .flat_map(|n| {
            if n == ROUND4 {
                ROUND4_SECTIONS.iter().map(|s| s.to_string()).collect()
            } else if n == ROUND5 {
                ROUND5_SECTIONS.iter().map(|s| s.to_string()).collect()
            } else {
                vec![n]
            }
        })
        .collect();
    if let Some(bad) = names.iter().find(|n| !SECTIONS.contains(&n.as_str())) {
        return Err(format!(
            "no section {bad:?}; the sections are {}",
            SECTIONS.join(", ")
        ));
    }
    if names.is_empty() {
        return Err(format!("needs at least one of {}", SECTIONS.join(", ")));
    }
    Ok(Sections(names))
}

impl Options {
    /// Whether section `name` runs: every one without `--only`, else those it names
    /// (the container sections only with `--containers`).
    pub fn wants(&self, name: &str) -> bool {
        if CONTAINER_SECTIONS.contains(&name) && !self.containers {
            return false;
        }
        self.only
            .as_ref()
            .is_none_or(|o| o.iter().any(|n| n == name))
    }

    /// `--r4-hold`, else the default of the mode (round 4's clients).
    pub fn r4_hold(&self, simulate: bool) -> f64 {
        self.r4_hold.unwrap_or(if simulate { 1.0 } else { 5.0 })
    }

    /// `--r5-seconds`, else the default of the mode (round 5's co-location window).
    pub fn r5_seconds(&self, simulate: bool) -> f64 {
        self.r5_seconds.unwrap_or(if simulate { 0.25 } else { 6.0 })
    }

    /// `--hold`, else the default of the mode the run ended up in (no GPU: simulated).
    pub fn hold(&self, simulate: bool) -> f64 {
        self.hold.unwrap_or(if simulate { 1.5 } else { 6.0 })
    }
}

fn flag_env(env: &dyn Fn(&str) -> Option<String>, name: &str) -> bool {
    env(name).is_some_and(|v| !v.is_empty() && v != "0")
}

/// The options from the command line (`args` without the program's name), each unset one
/// from its variable. `Err` is clap's: it prints itself (usage errors exit 2, `--help` 0).
pub fn parse(
    args: &[String],
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Options, clap::Error> {
    let mut o =
        Options::try_parse_from(std::iter::once("gpu").chain(args.iter().map(String::as_str)))?;
    let env = |k: &str| env(k).filter(|v| !v.is_empty());
    let invalid = |k: &str, e: String| {
        clap::Error::raw(clap::error::ErrorKind::InvalidValue, format!("{k}: {e}\n"))
    };
    o.simulate |= flag_env(&env, "GPUSHARE_GPU_SIMULATE");
    o.keep |= flag_env(&env, "GPUSHARE_GPU_KEEP");
    o.containers |= flag_env(&env, "GPUSHARE_GPU_CONTAINERS");
    o.bin_dir = o
        .bin_dir
        .or_else(|| env("GPUSHARE_BIN_DIR").map(PathBuf::from));
    o.out = o.out.or_else(|| env("GPUSHARE_GPU_OUT").map(PathBuf::from));
    o.python = o
        .python
        .or_else(|| env("GPUSHARE_GPU_PYTHON").map(PathBuf::from));
    o.runc = o
        .runc
        .or_else(|| env("GPUSHARE_GPU_RUNC").map(PathBuf::from));
    o.inventory_override = env("GPUSHARE_GPU_INVENTORY");
    if let Some(r) = env("GPUSHARE_GPU_CREATE_ROUNDS") {
        o.create_rounds = positive(&r).map_err(|e| invalid("GPUSHARE_GPU_CREATE_ROUNDS", e))?;
    }
    o.iterations = match (o.iterations_arg, env("GPUSHARE_GPU_ITERATIONS")) {
        (Some(n), _) => n,
        (None, Some(n)) => positive(&n).map_err(|e| invalid("GPUSHARE_GPU_ITERATIONS", e))?,
        (None, None) => o.iterations,
    };
    if o.r4_hold.is_none() {
        if let Some(h) = env("GPUSHARE_GPU_R4_HOLD") {
            o.r4_hold = Some(hold_seconds(&h).map_err(|e| invalid("GPUSHARE_GPU_R4_HOLD", e))?);
        }
    }
    if o.r5_seconds.is_none() {
        if let Some(h) = env("GPUSHARE_GPU_R5_SECONDS") {
            o.r5_seconds =
                Some(hold_seconds(&h).map_err(|e| invalid("GPUSHARE_GPU_R5_SECONDS", e))?);
        }
    }
    if o.hold.is_none() {
        if let Some(h) = env("GPUSHARE_GPU_HOLD") {
            o.hold = Some(hold_seconds(&h).map_err(|e| invalid("GPUSHARE_GPU_HOLD", e))?);
        }
    }
    let only = match o.only_arg.take() {
        Some(s) => Some(s),
        None => env("GPUSHARE_GPU_ONLY")
            .map(|l| sections(&l).map_err(|e| invalid("GPUSHARE_GPU_ONLY", e)))
            .transpose()?,
    };
    if let Some(Sections(names)) = only {
        o.containers |= names
            .iter()
            .any(|n| CONTAINER_SECTIONS.contains(&n.as_str()));
        o.only = Some(names);
    }
    Ok(o)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| s.to_string()).collect()
    }

    fn no_env(_: &str) -> Option<String> {
        None
    }

    #[test]
    fn defaults_follow_the_mode() {
        let o = parse(&[], &no_env).unwrap();
        assert_eq!(o.libtest.filtered_out(TEST_NAME), None);
        assert!(!o.simulate && !o.keep && !o.containers);
        assert_eq!(
            (o.iterations, o.hold(o.simulate), o.create_rounds),
            (100_000, 6.0, 30)
        );
        let o = parse(&args(&["--simulate"]), &no_env).unwrap();
        assert!(o.simulate);
        assert_eq!(o.hold(true), 1.5);
    }

    #[test]
    fn options_take_values_both_ways_and_win_over_the_environment() {
        let env = |k: &str| match k {
            "GPUSHARE_BIN_DIR" => Some("/env/bin".to_owned()),
            "GPUSHARE_GPU_HOLD" => Some("2".to_owned()),
            "GPUSHARE_GPU_KEEP" => Some("1".to_owned()),
            "GPUSHARE_GPU_SIMULATE" => Some("0".to_owned()),
            "GPUSHARE_GPU_CREATE_ROUNDS" => Some("4".to_owned()),
            _ => None,
        };
        let o = parse(&[], &env).unwrap();
        assert_eq!(o.bin_dir, Some("/env/bin".into()));
        assert_eq!(
            (o.hold(true), o.keep, o.simulate, o.create_rounds),
            (2.0, true, false, 4)
        );
        let o = parse(
            &args(&[
                "--bin-dir=/cli",
                "--hold",
                "0.5",
                "--iterations",
                "7",
                "--out",
                "x.jsonl",
            ]),
            &env,
        )
        .unwrap();
        assert_eq!(o.bin_dir, Some("/cli".into()));
        assert_eq!((o.hold(false), o.iterations), (0.5, 7));
        assert_eq!(o.out, Some("x.jsonl".into()));
    }

    #[test]
    fn bad_values_are_refused_with_the_option_named() {
        for (a, needle) in [
            (
                &["--hold", "0.1"][..],
                "'--hold <S>': must be a number of seconds",
            ),
            (
                &["--hold", "abc"][..],
                "'--hold <S>': must be a number of seconds",
            ),
            (
                &["--iterations", "0"][..],
                "'--iterations <N>': must be a positive",
            ),
            (
                &["--iterations=-3"][..],
                "'--iterations <N>': must be a positive",
            ),
            (&["--out"][..], "a value is required for '--out <FILE>'"),
            (&["--frobnicate"][..], "unexpected argument '--frobnicate'"),
        ] {
            let e = parse(&args(a), &no_env).unwrap_err().to_string();
            assert!(e.contains(needle), "{a:?}: {e}");
        }
        let env = |k: &str| (k == "GPUSHARE_GPU_HOLD").then(|| "200".to_owned());
        let e = parse(&[], &env).unwrap_err().to_string();
        assert!(
            e.contains("GPUSHARE_GPU_HOLD: must be a number of seconds"),
            "{e}"
        );
    }

    #[test]
    fn only_selects_sections_and_names_the_known_ones() {
        let o = parse(&[], &no_env).unwrap();
        assert!(o.wants("per-user") && o.wants("small-batch") && !o.wants("skip-mps"));
        let o = parse(&args(&["--only", "small-batch,skip-mps"]), &no_env).unwrap();
        assert!(o.containers, "a container section implies --containers");
        assert!(o.wants("small-batch") && o.wants("skip-mps"));
        assert!(!o.wants("per-user") && !o.wants("containers") && !o.wants("cdi"));
        let env = |k: &str| (k == "GPUSHARE_GPU_ONLY").then(|| "tenant-control".to_owned());
        let o = parse(&[], &env).unwrap();
        assert!(o.wants("tenant-control") && !o.wants("limits") && !o.containers);
        let e = parse(&args(&["--only=small,cdi"]), &no_env)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("no section \"small\"") && e.contains("tenant-control"),
            "{e}"
        );
        let o = parse(&args(&["--only", "round4,limits"]), &no_env).unwrap();
        assert!(o.wants("r4-nodes") && o.wants("r4-privileged") && o.wants("limits"));
        assert!(!o.containers && !o.wants("per-user"));
        assert_eq!(o.r4_hold(false), 5.0);
        let o = parse(
            &args(&["--only", "round5,round4", "--r5-seconds", "8"]),
            &no_env,
        )
        .unwrap();
        assert!(o.wants("r5-v3") && o.wants("r5-coloc") && o.wants("r4-watch"));
        assert!(!o.containers && !o.wants("limits"));
        assert_eq!((o.r5_seconds(false), o.r5_seconds(true)), (8.0, 8.0));
        let o = parse(&[], &no_env).unwrap();
        assert_eq!((o.r5_seconds(false), o.r5_seconds(true)), (6.0, 0.25));
        let e = parse(&args(&["--r5-seconds", "0.1"]), &no_env)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("'--r5-seconds <S>': must be a number of seconds"),
            "{e}"
        );
        let e = parse(&args(&["--only", ","]), &no_env)
            .unwrap_err()
            .to_string();
        assert!(e.contains("at least one"), "{e}");
    }

    #[test]
    fn libtest_flags_are_accepted_and_filters_select_the_tier() {
        let runs = |a: &[&str]| {
            let o = parse(&args(a), &no_env).unwrap();
            o.libtest.filtered_out(TEST_NAME).is_none()
        };
        assert!(runs(&["--nocapture", "--test-threads", "1", "-q", "-q"]));
        assert!(runs(&["--test-threads=2", "--color=never", "gpu"]));
        assert!(runs(&[
            "-Z",
            "unstable-options",
            "--format",
            "json",
            "--show-output"
        ]));
        assert!(runs(&["tier"]));
        assert!(parse(&args(&["--list"]), &no_env).unwrap().libtest.list);
        let help = parse(&args(&["-h"]), &no_env).unwrap_err();
        assert_eq!(help.kind(), clap::error::ErrorKind::DisplayHelp);
        assert!(help.to_string().contains("GPUSHARE_GPU_ONLY"), "{help}");
        assert!(!runs(&["core_path"]));
        assert!(!runs(&["--exact", "gpu"]));
        assert!(runs(&["--exact", "gpu_tier"]));
        assert!(!runs(&["--skip", "gpu"]));
        assert!(!runs(&["--ignored"]));
        assert!(runs(&["--include-ignored"]));
    }
}
