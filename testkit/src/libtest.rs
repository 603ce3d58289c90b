//! The flags libtest takes, for the test targets with a main of their own (`harness = false`:
//! tests/gpu and tests/faults). `cargo test` hands its filters and flags to every test
//! executable, so these targets accept all of them and apply the filters to their one test
//! as libtest would; the other flags mean nothing to one sequential test that always prints.

use clap::Args;

/// libtest's command line, flattened into a tier's own (`#[command(flatten)]`). The tier's
/// command sets `args_override_self`, as libtest lets a flag be given twice.
#[derive(Args, Debug, Clone, Default, PartialEq)]
pub struct Libtest {
    /// Run the test only if its name contains one of these (all of it with --exact).
    #[arg(value_name = "FILTER")]
    pub filters: Vec<String>,
    #[arg(long, hide = true)]
    pub exact: bool,
    #[arg(long, hide = true)]
    pub ignored: bool,
    /// Print the test's name instead of running it.
    #[arg(long)]
    pub list: bool,
    #[arg(long, hide = true, value_name = "FILTER")]
    pub skip: Vec<String>,
    #[arg(long, hide = true)]
    nocapture: bool,
    #[arg(long = "no-capture", hide = true)]
    no_capture: bool,
    #[arg(long, hide = true)]
    show_output: bool,
    #[arg(short, long, hide = true)]
    quiet: bool,
    #[arg(long, hide = true)]
    include_ignored: bool,
    #[arg(long, hide = true)]
    test: bool,
    #[arg(long, hide = true)]
    bench: bool,
    #[arg(long, hide = true)]
    report_time: bool,
    #[arg(long, hide = true)]
    ensure_time: bool,
    #[arg(long, hide = true)]
    force_run_in_process: bool,
    #[arg(long, hide = true)]
    shuffle: bool,
    #[arg(long, hide = true)]
    shuffle_seed: Option<String>,
    #[arg(long, hide = true)]
    test_threads: Option<String>,
    #[arg(long, hide = true)]
    color: Option<String>,
    #[arg(long, hide = true)]
    format: Option<String>,
    #[arg(long, hide = true)]
    logfile: Option<String>,
    #[arg(short = 'Z', hide = true)]
    unstable: Vec<String>,
}

impl Libtest {
    /// Why the test `name` does not run under these flags (`--ignored`, a filter it does
    /// not match, a `--skip` it does); `None` when it runs.
    pub fn filtered_out(&self, name: &str) -> Option<String> {
        let matches = |f: &String| {
            if self.exact {
                f == name
            } else {
                name.contains(f.as_str())
            }
        };
        if self.ignored {
            Some(format!(
                "--ignored runs only ignored tests, and {name} is not one"
            ))
        } else if !self.filters.is_empty() && !self.filters.iter().any(matches) {
            Some(format!("filter {:?} does not match {name}", self.filters))
        } else {
            self.skip
                .iter()
                .find(|s| name.contains(s.as_str()))
                .map(|s| format!("--skip {s:?}"))
        }
    }
}
