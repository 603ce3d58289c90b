//! A fake `nvidia-smi` with one subcommand, `memory-limits`, the driver's per-cgroup device
//! memory limits (dmem), for tests of what sets them. The binary takes this role when it is
//! run under the name `nvidia-smi` (a symlink to it), and records what a real one would set.
//!
//! Grammar, from NVIDIA's MPS "Memory partitioning" page as measured on r615 in NVIDIA
//! Dynamo's GPU-sharing docs:
//! `nvidia-smi memory-limits --set -n <cgroup dir> [--soft-limit <v>] [--hard-limit <v>] -i <gpu>`
//! and `nvidia-smi memory-limits --get -n <cgroup dir> -i <gpu>`; `memory-limits` must come
//! first; a value is whole MiB, `max` or `default` (`40G` is refused); setting needs root,
//! reading does not; `-i` is an index or a GPU UUID (MIG is unsupported).
//!
//! A successful `--set` appends one line to `memory-limits.jsonl` in the directory of
//! `argv[0]` as invoked (the symlink's, not the binary's):
//! `{"cgroup":"<dir>","gpu":"<i>","soft_mib":<v>,"hard_mib":<v>}`, where `<v>` is a number,
//! `"max"`, `"default"`, or `null` for a limit the call left alone. `--get` prints the last
//! values set for that cgroup and GPU, `hard: <n> MiB soft: <n> MiB` (`max` where unlimited;
//! never set is hard `max`, soft 0).
//!
//! Exit codes, nvidia-smi's: 0 success, 2 invalid argument, 3 not supported, 4 insufficient
//! permissions, 6 not found.
//!
//! Invariant: one `--set` is one line, written in a single append, so concurrent setters
//! never interleave; the log is only read by `--get`, which skips lines it cannot parse.

use std::io::Write;
use std::path::{Path, PathBuf};

use thiserror::Error;

pub const LOG_FILE: &str = "memory-limits.jsonl";

#[derive(Debug, Error, PartialEq, Eq)]
pub enum SmiError {
    #[error("Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.")]
    Usage,
    #[error("Invalid value {0:?}: expected an integer number of MiB, max or default")]
    Value(String),
    #[error("Insufficient Permissions")]
    Permissions,
    #[error("Unable to {0} memory limit: Not Found")]
    NotFound(&'static str),
    #[error("Unable to {0} memory limit: Not Supported")]
    NotSupported(&'static str),
}

impl SmiError {
    fn code(&self) -> u8 {
        match self {
            SmiError::Usage | SmiError::Value(_) => 2,
            SmiError::NotSupported(_) => 3,
            SmiError::Permissions => 4,
            SmiError::NotFound(_) => 6,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    Mib(u64),
    Max,
    Default,
}

impl Value {
    fn parse(text: &str) -> Result<Self, SmiError> {
        match text {
            "max" => Ok(Value::Max),
            "default" => Ok(Value::Default),
            t if !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit()) => t
                .parse()
                .map(Value::Mib)
                .map_err(|_| SmiError::Value(t.to_string())),
            t => Err(SmiError::Value(t.to_string())),
        }
    }

    fn json(v: Option<&Value>) -> String {
        match v {
            None => "null".to_string(),
            Some(Value::Mib(n)) => n.to_string(),
            Some(Value::Max) => "\"max\"".to_string(),
            Some(Value::Default) => "\"default\"".to_string(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    Help,
    Set {
        cgroup: String,
        gpu: String,
        soft: Option<Value>,
        hard: Option<Value>,
    },
    Get {
        cgroup: String,
        gpu: String,
    },
}

pub fn parse(args: &[String]) -> Result<Request, SmiError> {
    if args.first().map(String::as_str) != Some("memory-limits") {
        return Err(SmiError::Usage);
    }
    let (mut set, mut get) = (false, false);
    let (mut cgroup, mut gpu, mut soft, mut hard) = (None, None, None, None);
    let mut it = args[1..].iter();
    while let Some(arg) = it.next() {
        let mut value = || it.next().cloned().ok_or(SmiError::Usage);
        match arg.as_str() {
            "-h" | "--help" => return Ok(Request::Help),
            "--set" if !set => set = true,
            "--get" if !get => get = true,
            "-n" if cgroup.is_none() => cgroup = Some(value()?),
            "-i" if gpu.is_none() => gpu = Some(value()?),
            "--soft-limit" if soft.is_none() => soft = Some(Value::parse(&value()?)?),
            "--hard-limit" if hard.is_none() => hard = Some(Value::parse(&value()?)?),
            _ => return Err(SmiError::Usage),
        }
    }
    let (Some(cgroup), Some(gpu)) = (cgroup, gpu) else {
        return Err(SmiError::Usage);
    };
    let gpu_ok =
        (!gpu.is_empty() && gpu.bytes().all(|b| b.is_ascii_digit())) || crate::gpu::is_uuid(&gpu);
    if !gpu_ok {
        return Err(SmiError::Usage);
    }
    match (set, get) {
        (true, false) if soft.is_some() || hard.is_some() => Ok(Request::Set {
            cgroup,
            gpu,
            soft,
            hard,
        }),
        (false, true) if soft.is_none() && hard.is_none() => Ok(Request::Get { cgroup, gpu }),
        _ => Err(SmiError::Usage),
    }
}

/// Main of `nvidia-smi`: `argv0` as invoked, `args` after it.
pub fn run(argv0: &str, args: &[String]) -> u8 {
    let log = Path::new(argv0)
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .map_or_else(|| PathBuf::from("."), Path::to_path_buf)
        .join(LOG_FILE);
    match parse(args).and_then(|req| carry_out(&req, &log)) {
        Ok(text) => {
            print!("{text}");
            0
        }
        Err(e) => {
            eprintln!("{e}");
            e.code()
        }
    }
}

fn check_cgroup(cgroup: &str, verb: &'static str) -> Result<(), SmiError> {
    let path = Path::new(cgroup);
    if !path.is_absolute() || !path.is_dir() {
        return Err(SmiError::NotFound(verb));
    }
    Ok(())
}

fn carry_out(req: &Request, log: &Path) -> Result<String, SmiError> {
    match req {
        Request::Help => Ok(
            "nvidia-smi memory-limits --set -n <cgroup dir> [--soft-limit <MiB|max|default>] [--hard-limit <MiB|max|default>] -i <gpu>\nnvidia-smi memory-limits --get -n <cgroup dir> -i <gpu>\n"
                .to_string(),
        ),
        Request::Set {
            cgroup,
            gpu,
            soft,
            hard,
        } => {
            // NVIDIA's MPS "Memory partitioning" page: setting needs root, reading does not.
            if !nix::unistd::geteuid().is_root() {
                return Err(SmiError::Permissions);
            }
            if gpu.starts_with("MIG-") {
                return Err(SmiError::NotSupported("set"));
            }
            check_cgroup(cgroup, "set")?;
            let line = format!(
                "{{\"cgroup\":{},\"gpu\":{},\"soft_mib\":{},\"hard_mib\":{}}}\n",
                json_string(cgroup),
                json_string(gpu),
                Value::json(soft.as_ref()),
                Value::json(hard.as_ref())
            );
            let mut file = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(log)
                .map_err(|_| SmiError::NotFound("set"))?;
            file.write_all(line.as_bytes())
                .map_err(|_| SmiError::NotFound("set"))?;
            Ok(format!(
                "Memory limits set for {cgroup} on GPU {gpu}.\n"
            ))
        }
        Request::Get { cgroup, gpu } => {
            if gpu.starts_with("MIG-") {
                return Err(SmiError::NotSupported("get"));
            }
            check_cgroup(cgroup, "get")?;
            let text = std::fs::read_to_string(log).unwrap_or_default();
            let (mut soft, mut hard) = (Value::Mib(0), Value::Max);
            for rec in text.lines().filter_map(parse_line) {
                if rec.cgroup != *cgroup || rec.gpu != *gpu {
                    continue;
                }
                match rec.soft {
                    Some(Value::Default) => soft = Value::Mib(0),
                    Some(v) => soft = v,
                    None => {}
                }
                match rec.hard {
                    Some(Value::Default) => hard = Value::Max,
                    Some(v) => hard = v,
                    None => {}
                }
            }
            let show = |v: &Value| match v {
                Value::Mib(n) => format!("{n} MiB"),
                _ => "max".to_string(),
            };
            Ok(format!("hard: {} soft: {}\n", show(&hard), show(&soft)))
        }
    }
}

fn json_string(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// One record of the log, as this module writes it.
#[derive(Debug, PartialEq, Eq)]
struct Record {
    cgroup: String,
    gpu: String,
    soft: Option<Value>,
    hard: Option<Value>,
}

/// Reads a JSON string at the start of `s`; the string and the rest.
fn read_string(s: &str) -> Option<(String, &str)> {
    let mut chars = s.strip_prefix('"')?.char_indices();
    let mut out = String::new();
    while let Some((i, c)) = chars.next() {
        match c {
            '"' => return Some((out, &s[i + 2..])),
            '\\' => match chars.next()?.1 {
                '"' => out.push('"'),
                '\\' => out.push('\\'),
                'u' => {
                    let hex: String = (0..4)
                        .filter_map(|_| chars.next().map(|(_, c)| c))
                        .collect();
                    out.push(char::from_u32(u32::from_str_radix(&hex, 16).ok()?)?);
                }
                _ => return None,
            },
            c => out.push(c),
        }
    }
    None
}

fn read_value(s: &str) -> Option<(Option<Value>, &str)> {
    if let Some(rest) = s.strip_prefix("null") {
        return Some((None, rest));
    }
    if s.starts_with('"') {
        let (text, rest) = read_string(s)?;
        return match text.as_str() {
            "max" => Some((Some(Value::Max), rest)),
            "default" => Some((Some(Value::Default), rest)),
            _ => None,
        };
    }
    let end = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let n = s[..end].parse().ok()?;
    Some((Some(Value::Mib(n)), &s[end..]))
}

fn parse_line(line: &str) -> Option<Record> {
    let s = line.strip_prefix("{\"cgroup\":")?;
    let (cgroup, s) = read_string(s)?;
    let (gpu, s) = read_string(s.strip_prefix(",\"gpu\":")?)?;
    let (soft, s) = read_value(s.strip_prefix(",\"soft_mib\":")?)?;
    let (hard, s) = read_value(s.strip_prefix(",\"hard_mib\":")?)?;
    (s == "}").then_some(Record {
        cgroup,
        gpu,
        soft,
        hard,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(args: &str) -> Result<Request, SmiError> {
        parse(
            &args
                .split_whitespace()
                .map(String::from)
                .collect::<Vec<_>>(),
        )
    }

    #[test]
    fn grammar_as_measured() {
        assert_eq!(
            p("memory-limits --set -n /sys/fs/cgroup/x --soft-limit 0 --hard-limit 3000 -i 0"),
            Ok(Request::Set {
                cgroup: "/sys/fs/cgroup/x".into(),
                gpu: "0".into(),
                soft: Some(Value::Mib(0)),
                hard: Some(Value::Mib(3000)),
            })
        );
        assert_eq!(
            p("memory-limits --get -n /c -i GPU-ab12"),
            Ok(Request::Get {
                cgroup: "/c".into(),
                gpu: "GPU-ab12".into()
            })
        );
        assert!(p("memory-limits --set -n /c --hard-limit max -i 0").is_ok());
        assert!(p("memory-limits --set -n /c --soft-limit default -i 0").is_ok());
        for bad in [
            "-i 0 memory-limits --get -n /c",
            "memory-limits --set -n /c -i 0",
            "memory-limits --get -n /c -i 0 --hard-limit 1",
            "memory-limits --set --get -n /c --hard-limit 1 -i 0",
            "memory-limits --set -n /c --hard-limit 1",
            "memory-limits --set -i 0 --hard-limit 1",
            "memory-limits --set -n /c --hard-limit 1 -i x",
            "memory-limits --set -n /c --hard-limit 1 --hard-limit 2 -i 0",
            "",
        ] {
            assert!(p(bad).is_err(), "{bad}");
        }
        assert_eq!(
            p("memory-limits --set -n /c --hard-limit 40G -i 0"),
            Err(SmiError::Value("40G".into()))
        );
    }

    #[test]
    fn log_lines_round_trip() {
        let line = format!(
            "{{\"cgroup\":{},\"gpu\":\"0\",\"soft_mib\":null,\"hard_mib\":\"max\"}}",
            json_string("/a\"b\\c\u{1}")
        );
        assert_eq!(
            parse_line(&line),
            Some(Record {
                cgroup: "/a\"b\\c\u{1}".into(),
                gpu: "0".into(),
                soft: None,
                hard: Some(Value::Max),
            })
        );
        assert_eq!(parse_line("{\"cgroup\":\"/a\"}"), None);
    }
}
