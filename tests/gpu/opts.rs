//! The GPU tier's options: the command line after `cargo test --test gpu --` (or the test
//! executable's own), each with an environment variable where that is simpler (scripts/test
//! passes no options). A command-line option wins over its variable.
//!
//! Invariants: parsing is pure (the environment comes in as a function); libtest's own
//! flags, which `cargo test` may pass to any test executable, are accepted and ignored, and
//! its filters select or skip the one test this target holds, `gpu_tier`, as libtest would.

use std::path::PathBuf;

/// The name under which `--list` and filters see the tier.
pub const TEST_NAME: &str = "gpu_tier";

pub const USAGE: &str = "\
usage: cargo test --test gpu -- [OPTIONS]      (or the test executable itself, as root,
                                               from the repository root)
  --simulate       run against gpushare-mps-sim instead of a GPU      GPUSHARE_GPU_SIMULATE=1
                   (also what runs when no GPU is found)
  --bin-dir DIR    where gpushare, gpushare-runtime and gpushare-mps-sim are    GPUSHARE_BIN_DIR
                   (default: this build's target dir if it exists, else target/release)
  --out FILE       append raw JSON lines here                                   GPUSHARE_GPU_OUT
                   (default docs/gpu-validation-raw.jsonl; simulated target/tmp/gpu-simulate.jsonl)
  --iterations N   matrix products per process in the KubeCon experiment (default 100000)
                                                                         GPUSHARE_GPU_ITERATIONS
  --hold S         seconds each concurrent client computes (default 6; 1.5 simulated)
                                                                               GPUSHARE_GPU_HOLD
  --python PATH    Python with torch, runnable by UIDs 1000-4000 (default: python3's executable)
                                                                             GPUSHARE_GPU_PYTHON
  --keep           keep the work directory under /tmp (every daemon's and client's log)
                                                                             GPUSHARE_GPU_KEEP=1
  --containers     then two users' PyTorch containers through gpushare-runtime and runc
                   (real GPU only)                                     GPUSHARE_GPU_CONTAINERS=1
  --runc PATH      runc for --containers (default: runc on PATH)                GPUSHARE_GPU_RUNC
  --only LIST      run only these sections (comma-separated; the header, the preflight and the
                   restore always run): per-user, shared, flags, multi-user, tenant-control,
                   limits, uuid-limit, small-batch, create-path, driver-root, and the container sections
                   containers, skip-mps, cdi (real GPU only; naming one implies --containers)
                                                                               GPUSHARE_GPU_ONLY
  -h, --help       this text
also read: GPUSHARE_GPU_CREATE_ROUNDS (creates per inventory in section 7, default 30),
GPUSHARE_GPU_INVENTORY (replaces inventory = \"nvml\", a test hook: file:/path) and
GPUSHARE_GPU_DRIVER_ROOT (section 8's driver root; default: one made of read-only binds of
the driver's own directories)";

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
    "containers",
    "skip-mps",
    "cdi",
];
/// The sections that run real containers (`--containers`).
pub const CONTAINER_SECTIONS: &[&str] = &["containers", "skip-mps", "cdi"];

#[derive(Debug, Clone, PartialEq)]
pub struct Options {
    pub simulate: bool,
    pub bin_dir: Option<PathBuf>,
    pub out: Option<PathBuf>,
    pub iterations: u64,
    /// `None`: the mode's default (6 s, or 1.5 s simulated).
    pub hold: Option<f64>,
    pub python: Option<PathBuf>,
    pub keep: bool,
    pub containers: bool,
    pub runc: Option<PathBuf>,
    /// `--only`: the sections to run; `None` runs every section.
    pub only: Option<Vec<String>>,
    pub create_rounds: u32,
    pub inventory_override: Option<String>,
    /// What to do instead of running: print usage, list the test, or nothing (filtered out).
    pub action: Action,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    Run,
    Help,
    List,
    /// A libtest filter (or `--skip`, `--ignored`) leaves nothing to run; the reason.
    FilteredOut(String),
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

    /// `--hold`, else the default of the mode the run ended up in (no GPU: simulated).
    pub fn hold(&self, simulate: bool) -> f64 {
        self.hold.unwrap_or(if simulate { 1.5 } else { 6.0 })
    }
}

fn flag_env(env: &dyn Fn(&str) -> Option<String>, name: &str) -> bool {
    env(name).is_some_and(|v| !v.is_empty() && v != "0")
}

pub fn parse(args: &[String], env: &dyn Fn(&str) -> Option<String>) -> Result<Options, String> {
    let mut o = Options {
        simulate: flag_env(env, "GPUSHARE_GPU_SIMULATE"),
        bin_dir: env("GPUSHARE_BIN_DIR")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from),
        out: env("GPUSHARE_GPU_OUT")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from),
        iterations: 100_000,
        hold: None,
        python: env("GPUSHARE_GPU_PYTHON")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from),
        keep: flag_env(env, "GPUSHARE_GPU_KEEP"),
        containers: flag_env(env, "GPUSHARE_GPU_CONTAINERS"),
        runc: env("GPUSHARE_GPU_RUNC")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from),
        only: None,
        create_rounds: 30,
        inventory_override: env("GPUSHARE_GPU_INVENTORY").filter(|v| !v.is_empty()),
        action: Action::Run,
    };
    let mut iterations = env("GPUSHARE_GPU_ITERATIONS").filter(|v| !v.is_empty());
    let mut hold = env("GPUSHARE_GPU_HOLD").filter(|v| !v.is_empty());
    let mut only = env("GPUSHARE_GPU_ONLY").filter(|v| !v.is_empty());
    if let Some(r) = env("GPUSHARE_GPU_CREATE_ROUNDS").filter(|v| !v.is_empty()) {
        o.create_rounds = r.parse().ok().filter(|n| *n > 0).ok_or_else(|| {
            format!("GPUSHARE_GPU_CREATE_ROUNDS must be a positive integer, not {r:?}")
        })?;
    }
    let (mut filters, mut skips, mut exact, mut ignored_only) =
        (Vec::new(), Vec::new(), false, false);
    let mut i = 0;
    while i < args.len() {
        let arg = args[i].as_str();
        let (name, inline) = match arg.split_once('=') {
            Some((n, v)) if n.starts_with("--") => (n, Some(v.to_owned())),
            _ => (arg, None),
        };
        let mut value = |what: &str| -> Result<String, String> {
            if let Some(v) = &inline {
                return Ok(v.clone());
            }
            i += 1;
            args.get(i)
                .cloned()
                .ok_or_else(|| format!("{what} needs a value"))
        };
        match name {
            "--simulate" => o.simulate = true,
            "--keep" => o.keep = true,
            "--containers" => o.containers = true,
            "--runc" => o.runc = Some(value("--runc")?.into()),
            "--bin-dir" => o.bin_dir = Some(value("--bin-dir")?.into()),
            "--out" => o.out = Some(value("--out")?.into()),
            "--python" => o.python = Some(value("--python")?.into()),
            "--iterations" => iterations = Some(value("--iterations")?),
            "--hold" => hold = Some(value("--hold")?),
            "--only" => only = Some(value("--only")?),
            "-h" | "--help" => o.action = Action::Help,
            "--list" => o.action = Action::List,
            // libtest's flags (cargo test passes some to every test executable): no meaning
            // for one sequential test that always prints.
            "--nocapture" | "--show-output" | "-q" | "--quiet" | "--include-ignored" | "--test"
            | "--bench" | "--no-capture" => {}
            "--exact" => exact = true,
            "--ignored" => ignored_only = true,
            "--report-time" | "--ensure-time" | "--force-run-in-process" | "--shuffle" => {}
            "--test-threads" | "--color" | "--format" | "--logfile" | "-Z" | "--shuffle-seed" => {
                value(name)?;
            }
            "--skip" => skips.push(value("--skip")?),
            other if other.starts_with('-') => {
                return Err(format!("unknown option {other:?} (see --help)"))
            }
            filter => filters.push(filter.to_owned()),
        }
        i += 1;
    }
    if let Some(n) = iterations {
        o.iterations = n
            .parse()
            .ok()
            .filter(|n| *n > 0)
            .ok_or_else(|| format!("--iterations must be a positive integer, not {n:?}"))?;
    }
    if let Some(h) = hold {
        let s: f64 = h
            .parse()
            .ok()
            .filter(|s: &f64| (0.5..=120.0).contains(s))
            .ok_or_else(|| {
                format!("--hold must be a number of seconds from 0.5 to 120, not {h:?}")
            })?;
        o.hold = Some(s);
    }
    if let Some(list) = only {
        let names: Vec<String> = list
            .split(',')
            .map(|n| n.trim().to_owned())
            .filter(|n| !n.is_empty())
            .collect();
        if let Some(bad) = names.iter().find(|n| !SECTIONS.contains(&n.as_str())) {
            return Err(format!(
                "--only: no section {bad:?}; the sections are {}",
                SECTIONS.join(", ")
            ));
        }
        if names.is_empty() {
            return Err(format!(
                "--only needs at least one of {}",
                SECTIONS.join(", ")
            ));
        }
        if names
            .iter()
            .any(|n| CONTAINER_SECTIONS.contains(&n.as_str()))
        {
            o.containers = true;
        }
        o.only = Some(names);
    }
    let matches = |f: &String| {
        if exact {
            f == TEST_NAME
        } else {
            TEST_NAME.contains(f.as_str())
        }
    };
    if o.action == Action::Run {
        if ignored_only {
            o.action = Action::FilteredOut(format!(
                "--ignored runs only ignored tests, and {TEST_NAME} is not one"
            ));
        } else if !filters.is_empty() && !filters.iter().any(matches) {
            o.action =
                Action::FilteredOut(format!("filter {filters:?} does not match {TEST_NAME}"));
        } else if let Some(s) = skips.iter().find(|s| TEST_NAME.contains(s.as_str())) {
            o.action = Action::FilteredOut(format!("--skip {s:?}"));
        }
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
        assert_eq!(o.action, Action::Run);
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
            (&["--hold", "0.1"][..], "--hold must be"),
            (&["--hold", "abc"][..], "--hold must be"),
            (&["--iterations", "0"][..], "--iterations must be"),
            (&["--iterations", "-3"][..], "--iterations must be"),
            (&["--out"][..], "--out needs a value"),
            (&["--frobnicate"][..], "unknown option \"--frobnicate\""),
        ] {
            let e = parse(&args(a), &no_env).unwrap_err();
            assert!(e.contains(needle), "{a:?}: {e}");
        }
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
        let e = parse(&args(&["--only=small,cdi"]), &no_env).unwrap_err();
        assert!(
            e.contains("no section \"small\"") && e.contains("tenant-control"),
            "{e}"
        );
        let e = parse(&args(&["--only", ","]), &no_env).unwrap_err();
        assert!(e.contains("at least one"), "{e}");
    }

    #[test]
    fn libtest_flags_are_accepted_and_filters_select_the_tier() {
        let run = |a: &[&str]| parse(&args(a), &no_env).unwrap().action;
        assert_eq!(
            run(&["--nocapture", "--test-threads", "1", "-q"]),
            Action::Run
        );
        assert_eq!(
            run(&["--test-threads=2", "--color=never", "gpu"]),
            Action::Run
        );
        assert_eq!(run(&["tier"]), Action::Run);
        assert_eq!(run(&["--list"]), Action::List);
        assert_eq!(run(&["-h"]), Action::Help);
        assert!(matches!(run(&["core_path"]), Action::FilteredOut(_)));
        assert!(matches!(run(&["--exact", "gpu"]), Action::FilteredOut(_)));
        assert_eq!(run(&["--exact", "gpu_tier"]), Action::Run);
        assert!(matches!(run(&["--skip", "gpu"]), Action::FilteredOut(_)));
        assert!(matches!(run(&["--ignored"]), Action::FilteredOut(_)));
        assert_eq!(run(&["--include-ignored"]), Action::Run);
    }
}
