//! MPS v3's namespaces, as gpushare uses them (docs/mps.md, "Two backends"): a v3 daemon
//! runs one server, `s`, on its device set; each container it serves gets a namespace of
//! its own on it, created and capped before the container's first process, and deleted
//! when the container ends. This module is the commands that do it, in the command line's
//! grammar (`<module> <verb> [positional] [--key=value]`), and the reading of their CSV
//! replies.
//!
//! Invariants: every command is root's, through the daemon's own `control` (its pipe
//! directory is root's alone), within the caller's deadline; a namespace's limits are set
//! before any client can attach, because MPS refuses to change them while one is attached
//! (so a cap cannot be lowered under a running job: it is right from the start or the
//! container is refused); creating a namespace that exists is not an error (a restarted
//! daemon's supervisor and a create may race to make the same one), but its limits must
//! then read back as wanted; the server's `default` namespace, where a client that reaches
//! the server's directory instead of its own lands, is capped at
//! [`DEFAULT_NAMESPACE_PERCENTAGE`]. Replies are the daemon's: read bounded and as text,
//! never trusted for more than the fields asked.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use super::control::{Control, ControlError};
use crate::identity::{Identity, LimitValues, Namespace, V3_SERVER};
use crate::request::{KeySpec, Number};

/// The thread percentage of the server's `default` namespace: a client given the
/// server's directory rather than its namespace's gets at most this.
pub(crate) const DEFAULT_NAMESPACE_PERCENTAGE: u32 = 10;

fn args(words: &[&str]) -> Vec<String> {
    words.iter().map(|w| (*w).to_owned()).collect()
}

/// A limit's value as the command line writes it: a percentage as is, a size in the
/// largest binary unit that holds it whole (`4G`, `512M`, `1024K`), rounded down to KiB
/// (never above what was asked).
fn limit_value(key: &KeySpec, value: u64) -> String {
    match key.number() {
        Some(Number::Size) => {
            const UNITS: [(u64, &str); 2] = [(1 << 30, "G"), (1 << 20, "M")];
            UNITS
                .iter()
                .find(|(unit, _)| value % unit == 0)
                .map_or_else(
                    || format!("{}K", value >> 10),
                    |(unit, s)| format!("{}{s}", value / unit),
                )
        }
        _ => value.to_string(),
    }
}

/// `--<limit>=<value>` for each limit that is set: the rows' `daemon start` flags, which
/// are v3's option names (`--active-thread-percentage`, `--pinned-memory-limit`).
fn limit_flags(limits: &LimitValues) -> Vec<String> {
    limits
        .iter()
        .filter_map(|(key, v)| {
            key.flag
                .map(|flag| format!("{flag}={}", limit_value(key, v)))
        })
        .collect()
}

/// What was left of `deadline`, or an error naming `what`.
fn left(deadline: Instant, what: &str) -> anyhow::Result<Duration> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        bail!("{what} did not finish in time");
    }
    Ok(left)
}

/// Whether a failed command said that what it was to make exists already.
fn exists(e: &ControlError) -> bool {
    matches!(e, ControlError::Failed { output, .. } if output.contains("already exists"))
}

/// Makes a new daemon's server, `s`, on the identity's devices (root's: a multi-user
/// daemon allows no other owner), and caps its `default` namespace. A server that exists
/// (a create raced the supervisor) is kept.
pub(crate) fn make_server(
    control: &Control,
    ident: &Identity,
    deadline: Instant,
) -> anyhow::Result<()> {
    let create = vec![
        "server".to_owned(),
        "create".to_owned(),
        V3_SERVER.to_owned(),
        "--uid=0".to_owned(),
        format!("--allowed-devices={}", ident.devices.join(",")),
    ];
    match control.cli(&create, left(deadline, "server create")?) {
        Ok(_) => {}
        Err(e) if exists(&e) => {}
        Err(e) => return Err(e).context("cannot make the v3 daemon's server"),
    }
    cap_default(control, deadline)
}

/// Caps the server's `default` namespace at `DEFAULT_NAMESPACE_PERCENTAGE` (`server set`
/// sets the server's default namespace).
pub(crate) fn cap_default(control: &Control, deadline: Instant) -> anyhow::Result<()> {
    let set = vec![
        "server".to_owned(),
        "set".to_owned(),
        V3_SERVER.to_owned(),
        format!("--active-thread-percentage={DEFAULT_NAMESPACE_PERCENTAGE}"),
    ];
    control
        .cli(&set, left(deadline, "server set")?)
        .context("cannot cap the v3 server's default namespace")?;
    Ok(())
}

/// Makes container namespace `ns` and sets its limits, before any client can attach. One
/// that exists already (made again by a restarted daemon's supervisor, or by this
/// container's own earlier step) is set again; where that is refused (a client is
/// attached) its limits must read back as `ns`'s.
pub(crate) fn admit(control: &Control, ns: &Namespace, deadline: Instant) -> anyhow::Result<()> {
    let server = format!("--server={V3_SERVER}");
    let create = vec![
        "namespace".into(),
        "create".into(),
        ns.name.clone(),
        server.clone(),
    ];
    match control.cli(&create, left(deadline, "namespace create")?) {
        Ok(_) => {}
        Err(e) if exists(&e) => {}
        Err(e) => return Err(e).with_context(|| format!("cannot make MPS namespace {}", ns.name)),
    }
    let flags = limit_flags(&ns.limits);
    if flags.is_empty() {
        return Ok(());
    }
    let mut set = vec!["namespace".into(), "set".into(), ns.name.clone(), server];
    set.extend(flags);
    match control.cli(&set, left(deadline, "namespace set")?) {
        Ok(_) => Ok(()),
        Err(e) => match listed(control, deadline)?
            .iter()
            .find(|row| row.name == ns.name)
        {
            Some(row) if row.holds(&ns.limits) => Ok(()),
            _ => Err(e)
                .with_context(|| format!("cannot set the limits of MPS namespace {}", ns.name)),
        },
    }
}

/// Deletes namespace `name`, trying again until `deadline` while MPS refuses (a client of
/// the ended container has not detached yet); `false` when it is still there.
pub(crate) fn retire(control: &Control, name: &str, deadline: Instant) -> bool {
    let delete = vec![
        "namespace".into(),
        "delete".into(),
        name.to_owned(),
        format!("--server={V3_SERVER}"),
    ];
    let mut pause = Duration::from_millis(20);
    loop {
        let Ok(timeout) = left(deadline, "namespace delete") else {
            return false;
        };
        match control.cli(&delete, timeout) {
            Ok(_) => return true,
            Err(e) if matches!(&e, ControlError::Failed { output, .. } if output.contains("not found") || output.contains("does not exist")) => {
                return true
            }
            Err(e) => tracing::debug!(namespace = name, error = %e, "namespace not deleted yet"),
        }
        if Instant::now() + pause >= deadline {
            return false;
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(200));
    }
}

/// Where cgroup v2 is mounted on the host.
const CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// Whether the node has the driver's per-cgroup device memory limits: cgroup v2 with
/// the `dmem` controller offering an NVIDIA region (`dmem.capacity` lists
/// `nvidia/<pci>/vidmem`; without it the driver's own accounting, whose limits do not
/// nest, is in use: docs/mps.md, "Memory limits").
pub(crate) fn node_has_memory_limits() -> bool {
    std::fs::read_to_string(format!("{CGROUP_ROOT}/dmem.capacity"))
        .is_ok_and(|text| text.lines().any(|l| l.starts_with("nvidia/")))
}

/// The host path of the cgroup v2 of process `pid` (its `0::` line, read from the host's
/// cgroup namespace).
fn cgroup_of(pid: i32) -> anyhow::Result<std::path::PathBuf> {
    let v2 = nix::sys::statfs::statfs(CGROUP_ROOT)
        .is_ok_and(|fs| fs.filesystem_type() == nix::sys::statfs::CGROUP2_SUPER_MAGIC);
    if !v2 {
        bail!("{CGROUP_ROOT} is not cgroup v2: device memory limits need cgroup v2; set mps.cgroup-memory-limit = \"off\" or \"auto\" on this node");
    }
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
        .with_context(|| format!("read the cgroup of the container's process {pid}"))?;
    let rel = text
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .with_context(|| {
            format!("process {pid} is in no cgroup v2 (device memory limits need cgroup v2)")
        })?;
    let rel = rel.trim().trim_start_matches('/');
    if rel.is_empty() || rel.split('/').any(|c| c == ".." || c == ".") {
        bail!("process {pid}'s cgroup {rel:?} is not a container's own cgroup");
    }
    Ok(std::path::Path::new(CGROUP_ROOT).join(rel))
}

/// Sets the hard device memory limit of the cgroup of the container's process `pid` to
/// its namespace's pinned-memory limit on each of `devices`, through `nvidia-smi
/// memory-limits` (root's: a tenant cannot raise it). Only under
/// `mps.cgroup-memory-limit = "on"`, or `"auto"` where the node has such limits; never a
/// soft limit (which every ancestor cgroup would sum, and which must be taken back before
/// the cgroup goes). Called once the container's own cgroup exists (the engine makes a
/// new leaf whose unlimited limit would hide one set above it) and before its first
/// process runs.
pub(crate) fn limit_memory(
    cfg: &crate::config::Config,
    pid: i32,
    devices: &[String],
    ns: &Namespace,
) -> anyhow::Result<()> {
    use crate::config::CgroupMemoryLimit;
    let Some(bytes) = ns.limits.get(&crate::request::PINNED_MEMORY_LIMIT) else {
        return Ok(());
    };
    let wanted = match cfg.mps.cgroup_memory_limit {
        CgroupMemoryLimit::Off => false,
        CgroupMemoryLimit::On => true,
        CgroupMemoryLimit::Auto => node_has_memory_limits(),
    };
    if !wanted {
        return Ok(());
    }
    let cgroup = cgroup_of(pid)?;
    let smi = program(&cfg.mps.nvidia_smi, cfg.driver_root.as_deref())?;
    let mib = (bytes >> 20).max(1).to_string();
    for device in devices {
        let out = std::process::Command::new(&smi)
            .args(["memory-limits", "--set", "-n"])
            .arg(&cgroup)
            .args(["--hard-limit", &mib, "-i", device])
            .env_clear()
            .env("PATH", super::control::SAFE_PATH)
            .stdin(std::process::Stdio::null())
            .output()
            .with_context(|| format!("run {}", smi.display()))?;
        if !out.status.success() {
            let text = format!(
                "{} {}",
                String::from_utf8_lossy(&out.stdout).trim(),
                String::from_utf8_lossy(&out.stderr).trim()
            );
            bail!(
                "cannot set the device memory limit of cgroup {} on {device} to {mib} MiB ({}): {}",
                cgroup.display(),
                out.status,
                crate::util::escape(&crate::util::one_line(&text))
            );
        }
    }
    tracing::info!(cgroup = %cgroup.display(), mib = %mib, "device memory limit set");
    Ok(())
}

/// A program named in the config: an absolute path, a name under `driver-root`, or a
/// name on the safe PATH.
fn program(
    name: &str,
    driver_root: Option<&std::path::Path>,
) -> anyhow::Result<std::path::PathBuf> {
    if name.contains('/') {
        return Ok(name.into());
    }
    if let Some(root) = driver_root {
        return Ok(crate::driver::find_binary(root, name)?);
    }
    crate::util::find_executable(name, std::ffi::OsStr::new(super::control::SAFE_PATH))
        .with_context(|| {
            format!(
                "{name} not found on PATH ({}); set mps.nvidia-smi to its absolute path",
                super::control::SAFE_PATH
            )
        })
}

/// One namespace as `namespace list` shows it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Listed {
    pub name: String,
    /// Bytes; `None`: unlimited.
    pub pinned_memory_limit: Option<u64>,
    /// Percent; `None`: not shown as a number.
    pub active_thread_percentage: Option<f64>,
}

impl Listed {
    /// Whether it holds exactly `limits` (an unset limit: none shown).
    pub(crate) fn holds(&self, limits: &LimitValues) -> bool {
        use crate::request::{ACTIVE_THREAD_PERCENTAGE, PINNED_MEMORY_LIMIT};
        let pct = limits
            .get(&ACTIVE_THREAD_PERCENTAGE)
            .map_or(100.0, |v| v as f64);
        let pct_ok = self
            .active_thread_percentage
            .is_some_and(|got| (got - pct).abs() < 0.5);
        let mem = limits.get(&PINNED_MEMORY_LIMIT).map(|v| v >> 10 << 10);
        pct_ok && self.pinned_memory_limit == mem
    }
}

/// Reads a size as `namespace list` prints it: `unlimited`, bytes, or a number with a
/// binary unit (`20G`, `512M`, `1024K`).
fn listed_size(text: &str) -> Option<Option<u64>> {
    if text == "unlimited" || text == "-" {
        return Some(None);
    }
    let (digits, unit) = match text
        .char_indices()
        .find(|(_, c)| !c.is_ascii_digit() && *c != '.')
    {
        Some((i, _)) => text.split_at(i),
        None => (text, ""),
    };
    let shift = match unit {
        "" | "B" => 0,
        "K" | "KB" | "KiB" => 10,
        "M" | "MB" | "MiB" => 20,
        "G" | "GB" | "GiB" => 30,
        _ => return None,
    };
    let n: f64 = digits.parse().ok()?;
    Some(Some((n * (1u64 << shift) as f64) as u64))
}

/// The server's namespaces, from `namespace list --server=s --format=csv,noheader`
/// (columns: name, server, server status, pinned limit, thread percentage, priority,
/// pipe directory). Rows that cannot be read are left out.
pub(crate) fn listed(control: &Control, deadline: Instant) -> anyhow::Result<Vec<Listed>> {
    let list = args(&[
        "namespace",
        "list",
        &format!("--server={V3_SERVER}"),
        "--format=csv,noheader",
    ]);
    let reply = control.cli(&list, left(deadline, "namespace list")?)?;
    Ok(parse_listed(&reply))
}

/// The rows of a `namespace list` reply that can be read.
fn parse_listed(reply: &str) -> Vec<Listed> {
    super::reply::csv_rows(reply)
        .filter_map(|row| {
            Some(Listed {
                name: (*row.first()?).to_owned(),
                pinned_memory_limit: listed_size(row.get(3)?)?,
                active_thread_percentage: row.get(4)?.parse().ok(),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::test_limits;
    use crate::request::{ACTIVE_THREAD_PERCENTAGE, PINNED_MEMORY_LIMIT};

    #[test]
    fn limits_are_written_as_the_command_line_reads_them() {
        assert_eq!(limit_value(&PINNED_MEMORY_LIMIT, 4 << 30), "4G");
        assert_eq!(limit_value(&PINNED_MEMORY_LIMIT, 512 << 20), "512M");
        assert_eq!(limit_value(&PINNED_MEMORY_LIMIT, (1 << 20) + 1536), "1025K");
        assert_eq!(limit_value(&ACTIVE_THREAD_PERCENTAGE, 25), "25");
        assert_eq!(
            limit_flags(&test_limits(Some(25), Some(2 << 30))),
            ["--active-thread-percentage=25", "--pinned-memory-limit=2G"]
        );
        assert!(limit_flags(&test_limits(None, None)).is_empty());
    }

    #[test]
    fn a_listed_namespace_is_read_and_compared() {
        let reply = "c0123456789abcdef0123,s,Ready,2G,25.00,0,/run/x/s/c0123456789abcdef0123\n\
                     default,s,Ready,unlimited,10.00,0,/run/x/s/default\n\
                     garbage\n";
        let rows = parse_listed(reply);
        assert_eq!(rows.len(), 2);
        assert!(rows[0].holds(&test_limits(Some(25), Some(2 << 30))));
        assert!(!rows[0].holds(&test_limits(Some(50), Some(2 << 30))));
        assert!(!rows[0].holds(&test_limits(Some(25), None)));
        assert!(rows[1].holds(&test_limits(Some(10), None)));
        assert_eq!(listed_size("1024K"), Some(Some(1 << 20)));
        assert_eq!(listed_size("12Q"), None);
    }
}
