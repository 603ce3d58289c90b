//! The invariants checked after every kill, each a function that returns what it found
//! wrong, one line per violation: an empty list is a pass.
//!
//! - a bundle's config.json is byte-identical to the original or a complete valid edit
//!   (the same edit an undisturbed create of that identity made, container-specific
//!   fields aside);
//! - no lock under the state dir is held by a process that is gone, or by one that is
//!   not gpushare's;
//! - every daemon record names a live supervisor (and, when ready, a live daemon), and
//!   every container record a live container, once the next create and `gc` have run;
//! - no identity has two control daemons (sampled all along, `procs::supervised_daemons`);
//! - `gpushare status` succeeds on whatever it finds.

use std::path::Path;

use serde_json::Value;

use gpushare::util::proc_start_time as start_time;

/// The fields of a config.json that differ between two containers of one identity: the
/// hostname (the harness names it after the container), the cgroup path and the command.
pub fn normalise(mut v: Value) -> Value {
    if let Some(o) = v.as_object_mut() {
        o.insert("hostname".into(), Value::from("-"));
    }
    if let Some(p) = v.get_mut("process").and_then(Value::as_object_mut) {
        p.insert("args".into(), Value::from("-"));
    }
    if let Some(l) = v.get_mut("linux").and_then(Value::as_object_mut) {
        l.insert("cgroupsPath".into(), Value::from("-"));
    }
    v
}

/// A complete edit carries the decision, both hooks and the pipe directory's mount.
pub fn complete_edit(v: &Value) -> Result<(), String> {
    let daemon = v["annotations"]["gpushare.io/daemon"].as_str();
    let hook = |stage: &str, arg: &str| {
        v["hooks"][stage].as_array().is_some_and(|hs| {
            hs.iter().any(|h| {
                h["args"]
                    .as_array()
                    .is_some_and(|a| a.iter().any(|x| x == arg))
            })
        })
    };
    let env = v["process"]["env"].as_array().is_some_and(|e| {
        e.iter().any(|x| {
            x.as_str()
                .is_some_and(|s| s.starts_with("CUDA_MPS_PIPE_DIRECTORY="))
        })
    });
    match (
        daemon,
        hook("createRuntime", "create-runtime"),
        hook("poststop", "poststop"),
        env,
    ) {
        (Some(_), true, true, true) => Ok(()),
        _ => Err("the edit lacks the decision annotation, a hook or the client environment".into()),
    }
}

/// config.json of one bundle: the original bytes, or an edit equal to `reference` (the
/// normalised edit of an undisturbed create of the same identity).
pub fn config_json(bundle: &Path, original: &[u8], reference: &Value) -> Option<String> {
    let path = bundle.join("config.json");
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) => return Some(format!("{}: cannot read it: {e}", path.display())),
    };
    if bytes == original {
        return None;
    }
    match serde_json::from_slice::<Value>(&bytes) {
        Err(e) => Some(format!(
            "{}: neither the original nor valid JSON ({e}; {} bytes)",
            path.display(),
            bytes.len()
        )),
        Ok(v) if normalise(v.clone()) != *reference => Some(format!(
            "{}: an edit that differs from the reference edit: {}",
            path.display(),
            String::from_utf8_lossy(&bytes)
                .chars()
                .take(400)
                .collect::<String>()
        )),
        Ok(_) => None,
    }
}

/// The flocks held on files under `locks` (`/proc/locks`: the pid that took each), each
/// checked: its holder must run and be a gpushare process. A lock that outlives its holder
/// is one an inherited descriptor keeps.
pub fn locks(locks: &Path) -> Vec<String> {
    use std::os::unix::fs::MetadataExt;
    let mut inodes = std::collections::BTreeMap::new();
    for e in std::fs::read_dir(locks).into_iter().flatten().flatten() {
        if let Ok(md) = e.metadata() {
            inodes.insert(md.ino(), e.path());
        }
    }
    let read_table = || std::fs::read_to_string("/proc/locks").unwrap_or_default();
    let table = read_table();
    let mut out = Vec::new();
    for line in table.lines() {
        // "1: FLOCK  ADVISORY  WRITE 1234 00:1f:5678 0 EOF"; "->" lines are waiters.
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 6 || f[1] == "->" || f[1] != "FLOCK" {
            continue;
        }
        let (Ok(pid), Some(ino)) = (
            f[4].parse::<i32>(),
            f[5].rsplit(':').next().and_then(|i| i.parse::<u64>().ok()),
        ) else {
            continue;
        };
        let Some(path) = inodes.get(&ino) else {
            continue;
        };
        let exe = std::fs::read_link(format!("/proc/{pid}/exe"))
            .map(|p| p.display().to_string())
            .unwrap_or_default();
        // A holder that let go and exited between the read of /proc/locks and this look
        // is not a violation: the lock must still be there, under the same pid, a
        // moment later (a descriptor a child inherited keeps it for good).
        let still_held = || {
            read_table().lines().any(|l| {
                let g: Vec<&str> = l.split_whitespace().collect();
                g.len() >= 6 && g[1] == "FLOCK" && g[4] == f[4] && g[5] == f[5]
            })
        };
        let gone = (start_time(pid).is_none() || exe.is_empty()) && {
            std::thread::sleep(std::time::Duration::from_millis(200));
            still_held()
        };
        if gone {
            out.push(format!(
                "{} is held by pid {pid}, which is gone (an inherited descriptor keeps it)",
                path.display()
            ));
        } else if !exe.is_empty() && !exe.contains("gpushare") {
            out.push(format!(
                "{} is held by pid {pid} ({exe}), not a gpushare process",
                path.display()
            ));
        }
    }
    out
}

/// One process reference of a record (`{"pid":…,"start_time":…}`): whether it runs.
fn runs(v: &Value) -> bool {
    match (v["pid"].as_i64(), v["start_time"].as_u64()) {
        (Some(pid), Some(st)) => start_time(pid as i32) == Some(st),
        _ => false,
    }
}

/// Every daemon record under `state` names a live supervisor (and a live daemon when
/// ready), and every container record a live container (`pid` running) — what is left
/// once the next create and `gc` have run. A record that cannot be parsed is a violation.
/// `supervised`: the daemon ids whose supervisor runs now; a half-removed directory of
/// one of them is an idle stop under way, not a leftover.
pub fn records(state: &Path, supervised: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    let mps = state.join("mps");
    for e in std::fs::read_dir(&mps).into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let removing = name
            .strip_prefix('.')
            .and_then(|n| n.strip_suffix(".removing"));
        if removing.is_some_and(|id| supervised.iter().any(|s| s == id)) {
            continue;
        }
        if name.starts_with('.') {
            out.push(format!(
                "{}: a half-removed directory gc left",
                e.path().display()
            ));
            continue;
        }
        let rec_path = e.path().join("daemon.json");
        // An idle stop renames the directory away before its last look and back when a
        // create came meanwhile: a read that falls in between is looked at again.
        let mut read = std::fs::read(&rec_path);
        for _ in 0..10 {
            if read.is_ok() || !e.path().exists() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
            read = std::fs::read(&rec_path);
        }
        if read.is_err() && !e.path().exists() {
            continue;
        }
        match read {
            Err(err) => out.push(format!(
                "{}: no readable record ({err})",
                e.path().display()
            )),
            Ok(bytes) => match serde_json::from_slice::<Value>(&bytes) {
                Err(err) => out.push(format!("{}: corrupt ({err})", rec_path.display())),
                Ok(rec) => {
                    if !runs(&rec["supervisor"]) {
                        out.push(format!(
                            "daemon {name}: its record ({}) names no live supervisor after gc",
                            rec["status"]
                        ));
                    } else if rec["status"] == "ready" && !runs(&rec["daemon"]) {
                        out.push(format!("daemon {name}: ready, but its daemon is gone"));
                    }
                }
            },
        }
        for c in std::fs::read_dir(e.path().join("containers"))
            .into_iter()
            .flatten()
            .flatten()
        {
            let cname = c.file_name().to_string_lossy().into_owned();
            if cname.starts_with('.') || !cname.ends_with(".json") {
                continue; // a temp file a killed writer left, the records lock: not records
            }
            let live = std::fs::read(c.path())
                .ok()
                .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
                .is_some_and(|r| {
                    r["pid"]
                        .as_i64()
                        .is_some_and(|p| start_time(p as i32) == r["start_time"].as_u64())
                });
            if !live {
                out.push(format!(
                    "daemon {name}: container record {cname} names no live container after the next create and gc"
                ));
            }
        }
    }
    out
}

/// `gpushare status --json` on what is there now: exit 0 and the schema's JSON.
pub fn status(env: &testkit::Env) -> Option<String> {
    let out = env
        .cmd(testkit::gpushare())
        .args(["status", "--json"])
        .output()
        .ok()?;
    let parsed = serde_json::from_slice::<Value>(&out.stdout).ok();
    if out.status.success() && parsed.is_some_and(|v| v["schema"] == "gpushare.status/v1") {
        None
    } else {
        Some(format!(
            "gpushare status failed ({}): {}",
            out.status,
            testkit::text(&out).trim()
        ))
    }
}
