//! Helpers shared by every test target (through the harness, and by the GPU tier,
//! tests/gpu/, directly): finding executables, polling with a deadline, processes by pid
//! and start time, mounts, the simulator's binary and its client's line.
//!
//! Invariants: nothing here knows a target's layout (the harness's `Env`, the tier's work
//! directory) or reads a compile-time path (`CARGO_BIN_EXE_*`, `CARGO_MANIFEST_DIR`): the
//! callers pass them in, so that the GPU tier's executable still works where those paths do
//! not exist. Waits poll with deadlines; nothing sleeps a fixed time to "let it start".

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::{Duration, Instant};

/// The variable the test command (`scripts/test`) sets to a file where every skipped test
/// or check is listed; it prints them at its end.
pub const SKIPS_VAR: &str = "GPUSHARE_TEST_SKIPS";

/// Lists `what` as skipped for `reason` in the file [`SKIPS_VAR`] names, one line
/// appended in one write (tests running at once do not interleave); nothing when unset.
/// A test that cannot run calls [`skip`], which also says so and fails under CI.
pub fn note_skip(what: &str, reason: &str) {
    use std::io::Write;
    let Some(file) = std::env::var_os(SKIPS_VAR) else {
        return;
    };
    let line = format!("{what}: {reason}\n");
    let written = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&file)
        .and_then(|mut f| f.write_all(line.as_bytes()));
    if let Err(e) = written {
        panic!(
            "cannot list the skip of {what} in {}: {e}",
            Path::new(&file).display()
        );
    }
}

/// The running test cannot run on this machine, for `reason`; the caller returns after.
/// Under `CI=true` it fails instead: CI has what these tests need (root, `../shared` beside
/// the clone), so a skip there is a broken setup. Elsewhere the test passes and the test
/// command's summary lists it, as `<target> <test>: <reason>`.
pub fn skip(reason: &str) {
    let test = std::thread::current()
        .name()
        .unwrap_or("<unnamed test>")
        .to_owned();
    assert!(
        std::env::var("CI").as_deref() != Ok("true"),
        "{test}: {reason}; under CI=true a test that cannot run fails"
    );
    // `<target>-<hash>`, as Cargo names a test executable.
    let target = std::env::current_exe()
        .ok()
        .and_then(|p| Some(p.file_name()?.to_string_lossy().into_owned()))
        .map(|n| n.rsplit_once('-').map_or(n.clone(), |(t, _)| t.to_owned()))
        .unwrap_or_default();
    eprintln!("skipped: {reason}");
    note_skip(&format!("{target} {test}"), reason);
}

/// `name` on PATH, or in the system directories when PATH lacks them.
pub fn which(name: &str) -> Option<PathBuf> {
    let mut path = std::env::var_os("PATH").unwrap_or_default();
    path.push(":/usr/sbin:/usr/bin:/sbin:/bin");
    gpushare::util::find_executable(name, &path)
}

/// Polls `f` until it holds or the deadline passes; returns whether it held.
pub fn wait_until(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    let mut pause = Duration::from_millis(2);
    loop {
        if f() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(50));
    }
}

pub fn start_time(pid: i32) -> Option<u64> {
    gpushare::util::proc_start_time(pid)
}

pub fn alive(pid: i32) -> bool {
    start_time(pid).is_some()
}

/// SIGTERM, wait up to 5 s, then SIGKILL — only if `pid` is still the process we started.
pub fn stop_process(pid: i32, expected_start: Option<u64>) {
    use nix::sys::signal::{kill, Signal};
    let is_ours = || {
        start_time(pid).is_some() && (expected_start.is_none() || start_time(pid) == expected_start)
    };
    if !is_ours() {
        return;
    }
    let _ = kill(nix::unistd::Pid::from_raw(pid), Signal::SIGTERM);
    if !wait_until(Duration::from_secs(5), || !is_ours()) {
        let _ = kill(nix::unistd::Pid::from_raw(pid), Signal::SIGKILL);
    }
}

/// The mount points at or below `dir` in /proc/self/mounts.
pub fn mounts_below(dir: &Path) -> Vec<String> {
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    let prefix = dir.display().to_string();
    mounts
        .lines()
        .filter_map(|l| l.split(' ').nth(1))
        .filter(|m| m.starts_with(&prefix))
        .map(str::to_owned)
        .collect()
}

/// Unmounts every mount at or below `dir`, deepest first (lazily: a busy one goes when
/// its last user does).
pub fn umount_below(dir: &Path) {
    let mut points = mounts_below(dir);
    points.sort_by_key(|p| std::cmp::Reverse(p.len()));
    for p in points {
        let _ = nix::mount::umount2(p.as_str(), nix::mount::MntFlags::MNT_DETACH);
    }
}

/// The pid and `/proc` directory of every process but this one.
pub fn other_processes() -> Vec<(i32, PathBuf)> {
    let me = std::process::id() as i32;
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let pid = e.file_name().to_str()?.parse::<i32>().ok()?;
            (pid != me).then(|| (pid, e.path()))
        })
        .collect()
}

/// Asserts that the command succeeded and that its output (stdout, then stderr) contains
/// `want`.
pub fn assert_succeeded_saying(out: &Output, want: &str) {
    assert!(out.status.success(), "{}", text(out));
    assert!(text(out).contains(want), "{}", text(out));
}

/// Asserts that `line` names every one of `parts`.
pub fn assert_names(line: &str, parts: &[&str]) {
    let missing: Vec<&&str> = parts.iter().filter(|p| !line.contains(**p)).collect();
    assert!(missing.is_empty(), "{line:?} does not name {missing:?}");
}

/// A command's stdout then stderr, as text.
pub fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The MPS simulator, `gpushare-mps-sim`, beside `gpushare` (`bin`'s directory): a package
/// of its own (sim/, a workspace member), so Cargo gives the tests no `CARGO_BIN_EXE_` for it.
/// `cargo test --tests` and `cargo build` build it, a run of one test target alone does
/// not: a missing binary, or one older than the simulator's sources under `sources`
/// (`<repository>/sim`; not compared where they are not there), is an error that names the
/// command that builds it, rather than a stale simulator's behaviour later.
pub fn sim_beside(gpushare: &Path, sources: &Path) -> Result<PathBuf, String> {
    let bin = gpushare.with_file_name("gpushare-mps-sim");
    let profile = gpushare
        .parent()
        .and_then(Path::file_name)
        .and_then(|p| p.to_str())
        .unwrap_or("debug");
    let build = match profile {
        "debug" => "cargo build -p gpushare-mps-sim".to_owned(),
        "release" => "cargo build --release -p gpushare-mps-sim".to_owned(),
        other => format!("cargo build --profile {other} -p gpushare-mps-sim"),
    };
    let built = std::fs::metadata(&bin)
        .and_then(|m| m.modified())
        .map_err(|e| format!("{}: {e}: build it: {build}", bin.display()))?;
    let mut newest = vec![sources.join("Cargo.toml")];
    if let Ok(dir) = std::fs::read_dir(sources.join("src")) {
        newest.extend(dir.flatten().map(|e| e.path()));
    }
    for source in newest {
        let changed = std::fs::metadata(&source).and_then(|m| m.modified());
        if changed.is_ok_and(|t| t > built) {
            return Err(format!(
                "{} is older than {}: rebuild it: {build}",
                bin.display(),
                source.display()
            ));
        }
    }
    Ok(bin)
}

/// The simulator client's line `mps-client pid=… server=… waited_ms=… …` (it prints one)
/// as key/value pairs; `None` when it printed none.
pub fn parse_client_line(stdout: &str) -> Option<BTreeMap<String, String>> {
    let line = stdout
        .lines()
        .map(str::trim)
        .find(|l| l.starts_with("mps-client "))?;
    Some(
        line.split_whitespace()
            .skip(1)
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect(),
    )
}
