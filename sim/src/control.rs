//! Control commands, the stdin interface of `nvidia-cuda-mps-control` (MPS guide, "Control
//! daemon" commands): parsing a command line, and carrying it out against the daemon state.
//!
//! Invariants: parsing is pure and total (any line gives a command or an error, never a
//! panic); `set_default_*` change only the defaults, which servers copy when they start, and
//! `set_*` on a server change only what clients attaching later get, as documented; `quit` is
//! parsed here but carried out by the connection handler, which has to answer before the
//! process exits.

use std::fmt::Write as _;
use std::sync::Arc;

use thiserror::Error;

use crate::limits::{parse_device, LimitError, MemLimit, Percentage};
use crate::sched::{Core, Server, State};

#[derive(Debug, Clone, PartialEq)]
pub enum Command {
    GetServerList,
    StartServer {
        uid: u32,
    },
    GetClientList {
        server: u32,
    },
    GetServerStatus {
        server: u32,
    },
    /// `shutdown_server <pid> [-f]`: the simulated server always stops at once, so `-f`
    /// (forced, the only form gpushare's supervisor sends) and the graceful form behave alike.
    ShutdownServer {
        server: u32,
    },
    Quit,
    SetDefaultPercentage(Percentage),
    GetDefaultPercentage,
    SetPercentage {
        server: u32,
        pct: Percentage,
    },
    GetPercentage {
        server: u32,
    },
    SetDefaultMem {
        device: String,
        limit: MemLimit,
    },
    GetDefaultMem {
        device: String,
    },
    SetMem {
        server: u32,
        device: String,
        limit: MemLimit,
    },
    GetMem {
        server: u32,
        device: String,
    },
    Ps {
        pid: Option<i32>,
    },
    /// `terminate_client <server pid> <client pid>`: ends that client's contexts without
    /// touching the server's other clients; the client is told and detached, and the
    /// process runs on until someone kills it (the server does not).
    TerminateClient {
        server: u32,
        client: u32,
    },
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum CommandError {
    #[error("empty command")]
    Empty,
    #[error("unrecognized command {name:?}")]
    Unknown { name: String },
    #[error("usage: {usage}")]
    Usage { usage: &'static str },
    #[error("invalid pid {value:?}")]
    Pid { value: String },
    #[error("invalid user id {value:?}")]
    Uid { value: String },
    #[error(transparent)]
    Limit(#[from] LimitError),
}

fn pid(value: &str) -> Result<u32, CommandError> {
    value
        .parse()
        .ok()
        .filter(|&p| p > 0)
        .ok_or_else(|| CommandError::Pid {
            value: value.to_string(),
        })
}

pub fn parse(line: &str) -> Result<Command, CommandError> {
    let words: Vec<&str> = line.split_whitespace().collect();
    let Some((&name, args)) = words.split_first() else {
        return Err(CommandError::Empty);
    };
    let usage = |usage| CommandError::Usage { usage };
    let cmd = match (name, args) {
        ("get_server_list", []) => Command::GetServerList,
        ("get_server_list", _) => return Err(usage("get_server_list")),
        ("start_server", ["-uid", uid]) => Command::StartServer {
            uid: uid.parse().map_err(|_| CommandError::Uid {
                value: uid.to_string(),
            })?,
        },
        ("start_server", _) => return Err(usage("start_server -uid <user id>")),
        ("get_client_list", [p]) => Command::GetClientList { server: pid(p)? },
        ("get_client_list", _) => return Err(usage("get_client_list <server pid>")),
        ("get_server_status", [p]) => Command::GetServerStatus { server: pid(p)? },
        ("get_server_status", _) => return Err(usage("get_server_status <server pid>")),
        ("shutdown_server", [p]) | ("shutdown_server", [p, "-f"]) => {
            Command::ShutdownServer { server: pid(p)? }
        }
        ("shutdown_server", _) => return Err(usage("shutdown_server <server pid> [-f]")),
        // `quit -t <seconds>` forces servers down after a timeout on the real daemon; the
        // simulated servers always stop at once, so the timeout is accepted and unused.
        ("quit", []) => Command::Quit,
        ("quit", ["-t", t]) if t.parse::<u32>().is_ok() => Command::Quit,
        ("quit", _) => return Err(usage("quit [-t <seconds>]")),
        ("set_default_active_thread_percentage", [p]) => {
            Command::SetDefaultPercentage(Percentage::parse(p)?)
        }
        ("set_default_active_thread_percentage", _) => {
            return Err(usage("set_default_active_thread_percentage <percentage>"))
        }
        ("get_default_active_thread_percentage", []) => Command::GetDefaultPercentage,
        ("get_default_active_thread_percentage", _) => {
            return Err(usage("get_default_active_thread_percentage"))
        }
        ("set_active_thread_percentage", [s, p]) => Command::SetPercentage {
            server: pid(s)?,
            pct: Percentage::parse(p)?,
        },
        ("set_active_thread_percentage", _) => {
            return Err(usage(
                "set_active_thread_percentage <server pid> <percentage>",
            ))
        }
        ("get_active_thread_percentage", [s]) => Command::GetPercentage { server: pid(s)? },
        ("get_active_thread_percentage", _) => {
            return Err(usage("get_active_thread_percentage <server pid>"))
        }
        ("set_default_device_pinned_mem_limit", [d, v]) => Command::SetDefaultMem {
            device: parse_device(d)?,
            limit: MemLimit::parse(v)?,
        },
        ("set_default_device_pinned_mem_limit", _) => {
            return Err(usage("set_default_device_pinned_mem_limit <dev> <value>"))
        }
        ("get_default_device_pinned_mem_limit", [d]) => Command::GetDefaultMem {
            device: parse_device(d)?,
        },
        ("get_default_device_pinned_mem_limit", _) => {
            return Err(usage("get_default_device_pinned_mem_limit <dev>"))
        }
        ("set_device_pinned_mem_limit", [s, d, v]) => Command::SetMem {
            server: pid(s)?,
            device: parse_device(d)?,
            limit: MemLimit::parse(v)?,
        },
        ("set_device_pinned_mem_limit", _) => {
            return Err(usage(
                "set_device_pinned_mem_limit <server pid> <dev> <value>",
            ))
        }
        ("get_device_pinned_mem_limit", [s, d]) => Command::GetMem {
            server: pid(s)?,
            device: parse_device(d)?,
        },
        ("get_device_pinned_mem_limit", _) => {
            return Err(usage("get_device_pinned_mem_limit <server pid> <dev>"))
        }
        ("ps", []) => Command::Ps { pid: None },
        ("ps", ["-p", p]) => Command::Ps {
            pid: Some(p.parse().ok().filter(|&p: &i32| p > 0).ok_or_else(|| {
                CommandError::Pid {
                    value: p.to_string(),
                }
            })?),
        },
        ("ps", _) => return Err(usage("ps [-p <pid>]")),
        ("terminate_client", [s, c]) => Command::TerminateClient {
            server: pid(s)?,
            client: pid(c)?,
        },
        ("terminate_client", _) => return Err(usage("terminate_client <server pid> <client pid>")),
        (other, _) => {
            return Err(CommandError::Unknown {
                name: other.to_string(),
            })
        }
    };
    Ok(cmd)
}

fn server_mut(st: &mut State, pid: u32) -> Result<&mut Server, String> {
    match st.server.as_mut() {
        Some(s) if s.pid == pid => Ok(s),
        _ => Err(format!("no MPS server with pid {pid}")),
    }
}

fn line(text: impl std::fmt::Display) -> String {
    format!("{text}\n")
}

/// Carries out every command but `quit`; `Ok` is the text to print, `Err` an error text.
pub fn execute(core: &Arc<Core>, st: &mut State, cmd: Command) -> Result<String, String> {
    match cmd {
        Command::GetServerList => Ok(st.server.as_ref().map(|s| line(s.pid)).unwrap_or_default()),
        Command::StartServer { uid } => start_server(core, st, uid),
        Command::GetClientList { server } => {
            let s = server_mut(st, server)?;
            Ok(s.clients.iter().map(|c| line(c.client.pid)).collect())
        }
        Command::GetServerStatus { server } => server_mut(st, server).map(|_| line("ACTIVE")),
        Command::ShutdownServer { server } => {
            server_mut(st, server)?;
            core.stop_server(st);
            // Clients queued for another user can have their server now.
            core.schedule(st);
            Ok(String::new())
        }
        Command::Quit => Err("quit is handled by the connection".to_string()),
        Command::SetDefaultPercentage(p) => {
            st.defaults.percentage = p;
            Ok(String::new())
        }
        Command::GetDefaultPercentage => Ok(line(st.defaults.percentage)),
        Command::SetPercentage { server, pct } => {
            server_mut(st, server)?.settings.percentage = pct;
            Ok(String::new())
        }
        Command::GetPercentage { server } => Ok(line(server_mut(st, server)?.settings.percentage)),
        Command::SetDefaultMem { device, limit } => {
            st.defaults.mem.set(device, limit);
            Ok(String::new())
        }
        Command::GetDefaultMem { device } => Ok(mem_line(st.defaults.mem.get(&device))),
        Command::SetMem {
            server,
            device,
            limit,
        } => {
            server_mut(st, server)?.settings.mem.set(device, limit);
            Ok(String::new())
        }
        Command::GetMem { server, device } => {
            Ok(mem_line(server_mut(st, server)?.settings.mem.get(&device)))
        }
        Command::Ps { pid } => Ok(ps(st, pid)),
        Command::TerminateClient { server, client } => {
            let s = server_mut(st, server)?;
            let at = s
                .clients
                .iter()
                .position(|c| u32::try_from(c.client.pid).ok() == Some(client))
                .ok_or_else(|| format!("no MPS client with pid {client} on server {server}"))?;
            let ended = s.clients.remove(at);
            if let Some(conn) = &ended.client.conn {
                use std::io::Write;
                let _ = (&**conn).write_all(b"TERMINATED\n");
            }
            core.log.log(&format!("Client {client} terminated"));
            // A user queued behind this server may have its turn now.
            core.schedule(st);
            // CUDA_SUCCESS, what the real command prints once the server is done.
            Ok(line(0))
        }
    }
}

/// A pinned-memory read-back as driver 580.159.04 prints it (docs/gpu-validation.md): a
/// whole number of GiB as `<n>G` whatever unit set it (`2048M` reads back `2G`), and an
/// empty line where no limit is set.
fn mem_line(limit: Option<&MemLimit>) -> String {
    limit.map_or_else(|| line(""), |m| line(m.read_back()))
}

fn start_server(core: &Arc<Core>, st: &mut State, uid: u32) -> Result<String, String> {
    let gid = nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid))
        .ok()
        .flatten()
        .map_or(uid, |u| u.gid.as_raw());
    let (server_uid, server_gid) = core.server_identity(uid, gid);
    if let Some(s) = &st.server {
        return if s.uid == server_uid {
            Ok(String::new())
        } else {
            Err(format!(
                "a server for user {} is already running (pid {})",
                s.uid, s.pid
            ))
        };
    }
    core.start_server(st, server_uid, server_gid)?;
    // Clients that waited for this uid can use the new server right away.
    core.schedule(st);
    Ok(String::new())
}

/// `ps`: `PID ID SERVER DEVICE NAMESPACE COMMAND`, one row per client. DEVICE is `sim`; there
/// is no GPU to name.
fn ps(st: &State, only: Option<i32>) -> String {
    let mut out = line("PID ID SERVER DEVICE NAMESPACE COMMAND");
    if let Some(server) = &st.server {
        for c in server
            .clients
            .iter()
            .filter(|c| only.is_none_or(|p| p == c.client.pid))
        {
            let _ = writeln!(
                out,
                "{} {} {} sim {} {}",
                c.client.pid, c.id, server.pid, c.client.namespace, c.client.command
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_documented_syntax() {
        let p = |s| Percentage::parse(s).unwrap();
        let m = |s| MemLimit::parse(s).unwrap();
        let cases = [
            ("get_server_list", Command::GetServerList),
            ("  get_server_list  ", Command::GetServerList),
            ("start_server -uid 1000", Command::StartServer { uid: 1000 }),
            ("get_client_list 42", Command::GetClientList { server: 42 }),
            (
                "get_server_status 42",
                Command::GetServerStatus { server: 42 },
            ),
            ("quit", Command::Quit),
            (
                "shutdown_server 42 -f",
                Command::ShutdownServer { server: 42 },
            ),
            ("shutdown_server 42", Command::ShutdownServer { server: 42 }),
            ("quit -t 5", Command::Quit),
            (
                "set_default_active_thread_percentage 25.5",
                Command::SetDefaultPercentage(p("25.5")),
            ),
            (
                "get_default_active_thread_percentage",
                Command::GetDefaultPercentage,
            ),
            (
                "set_active_thread_percentage 9 50",
                Command::SetPercentage {
                    server: 9,
                    pct: p("50"),
                },
            ),
            (
                "get_active_thread_percentage 9",
                Command::GetPercentage { server: 9 },
            ),
            (
                "set_default_device_pinned_mem_limit 0 10G",
                Command::SetDefaultMem {
                    device: "0".into(),
                    limit: m("10G"),
                },
            ),
            (
                "get_default_device_pinned_mem_limit GPU-abc",
                Command::GetDefaultMem {
                    device: "GPU-abc".into(),
                },
            ),
            (
                "set_device_pinned_mem_limit 1024 0 900M",
                Command::SetMem {
                    server: 1024,
                    device: "0".into(),
                    limit: m("900M"),
                },
            ),
            (
                "get_device_pinned_mem_limit 1024 0",
                Command::GetMem {
                    server: 1024,
                    device: "0".into(),
                },
            ),
            ("ps", Command::Ps { pid: None }),
            ("ps -p 7", Command::Ps { pid: Some(7) }),
            (
                "terminate_client 9 12",
                Command::TerminateClient {
                    server: 9,
                    client: 12,
                },
            ),
        ];
        for (input, want) in cases {
            assert_eq!(parse(input), Ok(want), "input {input:?}");
        }
    }

    #[test]
    fn rejects_bad_lines() {
        let bad = [
            "",
            "   ",
            "frobnicate",
            "GET_SERVER_LIST",
            "get_server_list extra",
            "start_server 1000",
            "start_server -uid x",
            "get_client_list",
            "get_client_list 0",
            "get_client_list -1",
            "quit now",
            "set_default_active_thread_percentage",
            "set_default_active_thread_percentage 0",
            "set_default_active_thread_percentage 101",
            "set_default_active_thread_percentage abc",
            "set_default_device_pinned_mem_limit 0",
            "set_default_device_pinned_mem_limit 0 10T",
            "set_default_device_pinned_mem_limit a=b 1G",
            "set_device_pinned_mem_limit 1 0",
            "ps -p x",
            "ps -x",
            "terminate_client 9",
            "terminate_client 9 x",
            "\u{0}\u{1}garbage",
        ];
        for input in bad {
            assert!(parse(input).is_err(), "input {input:?}");
        }
        assert_eq!(
            parse("frobnicate 1").unwrap_err().to_string(),
            "unrecognized command \"frobnicate\""
        );
    }
}
