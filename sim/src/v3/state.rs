//! The v3 daemon's state: servers, their namespaces, and the clients attached to each
//! namespace; the list and get views of it.
//!
//! Invariants: every server has its `default` namespace; a server's name and a namespace's
//! name match the documented `[a-z0-9_]{1,64}`; an attached client is in exactly one
//! namespace's list, identified by its ticket (pids repeat across pid namespaces); nothing
//! here outlives the daemon process (NVIDIA's MPS v3 "Configuration file" page: what the
//! CLI made exists only for the daemon's lifetime).

use std::collections::BTreeMap;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::limits::{DeviceLimits, MemLimit, Percentage};
use crate::log::ControlLog;
use crate::server::ServerProcess;

use super::format::Listing;
use super::grammar::LimitArgs;
use super::layout::{self, DEFAULT_NAMESPACE};

/// A socket the daemon listens on, with its accept thread.
pub struct Listening {
    pub path: PathBuf,
    pub listener: Arc<std::os::unix::net::UnixListener>,
    pub closed: Arc<AtomicBool>,
}

impl Listening {
    /// Stops accepting (the accept thread sees `closed` and ends) and removes the socket.
    pub fn close(&self) {
        use std::os::fd::AsRawFd;
        self.closed.store(true, Ordering::SeqCst);
        // shutdown(2) on a listening socket wakes a blocked accept(2) on Linux.
        let _ =
            nix::sys::socket::shutdown(self.listener.as_raw_fd(), nix::sys::socket::Shutdown::Both);
        let _ = std::fs::remove_file(&self.path);
    }
}

/// A client attached to a namespace; pid and uid from SO_PEERCRED.
pub struct Attached {
    pub ticket: u64,
    pub pid: i32,
    pub command: String,
    pub conn: Option<Arc<UnixStream>>,
}

impl Attached {
    /// Tells the client it was terminated, as `terminate_client` does under legacy.
    pub fn terminate(&self) {
        if let Some(conn) = &self.conn {
            use std::io::Write;
            let _ = (&**conn).write_all(b"TERMINATED\n");
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct Limits {
    pub percentage: Option<Percentage>,
    pub pinned: Option<u64>,
    pub priority: Option<u8>,
}

impl Limits {
    pub fn apply(&mut self, args: &LimitArgs) {
        if args.percentage.is_some() {
            self.percentage = args.percentage;
        }
        if args.pinned.is_some() {
            self.pinned = args.pinned;
        }
        if args.priority.is_some() {
            self.priority = args.priority;
        }
    }

    /// The pinned limit as a client gets it: one value for every device the server has
    /// (ordinal 0, the simulated GPU, and each allowed device by name), whole MiB.
    pub fn device_limits(&self, allowed: Option<&[String]>) -> DeviceLimits {
        let mut out = DeviceLimits::default();
        if let Some(limit) = self.pinned.and_then(|b| MemLimit::from_mib(b >> 20)) {
            out.set("0".to_string(), limit.clone());
            for dev in allowed.unwrap_or_default() {
                out.set(dev.clone(), limit.clone());
            }
        }
        out
    }
}

pub struct Namespace {
    pub limits: Limits,
    pub clients: Vec<Attached>,
    pub listening: Listening,
}

pub struct Server {
    pub uid: u32,
    pub allowed: Option<Vec<String>>,
    pub process: Option<ServerProcess>,
    pub namespaces: BTreeMap<String, Namespace>,
    pub listening: Listening,
    pub log: ControlLog,
}

impl Server {
    pub fn pid(&self) -> Option<u32> {
        self.process.as_ref().map(ServerProcess::pid)
    }

    pub fn status(&self) -> &'static str {
        if self.process.is_some() {
            "Ready"
        } else {
            "Inactive"
        }
    }

    pub fn client_count(&self) -> usize {
        self.namespaces.values().map(|n| n.clients.len()).sum()
    }

    /// Namespace `name` of this server (named `server` in the error).
    pub fn namespace(&self, name: &str, server: &str) -> Result<&Namespace, String> {
        self.namespaces
            .get(name)
            .ok_or_else(|| no_namespace(name, server))
    }

    /// [`Server::namespace`], to change it.
    pub fn namespace_mut(&mut self, name: &str, server: &str) -> Result<&mut Namespace, String> {
        self.namespaces
            .get_mut(name)
            .ok_or_else(|| no_namespace(name, server))
    }
}

fn no_namespace(name: &str, server: &str) -> String {
    format!("namespace {name} does not exist on server {server}")
}

fn no_server(name: &str) -> String {
    format!("server {name} does not exist")
}

#[derive(Default)]
pub struct State {
    pub servers: BTreeMap<String, Server>,
    pub next_ticket: u64,
    pub quitting: bool,
}

pub const SERVER_COLUMNS: [&str; 7] = [
    "name",
    "uid",
    "pid",
    "status",
    "pipe-directory",
    "allowed-devices",
    "context-ids",
];
pub const NAMESPACE_COLUMNS: [&str; 7] = [
    "name",
    "server",
    "server-status",
    "pinned-memory-limit",
    "active-thread-percentage",
    "client-priority",
    "pipe-directory",
];
pub const CLIENT_COLUMNS: [&str; 5] = ["pid", "server", "device", "namespace", "cmd"];

/// A size as lists print it: the largest binary unit that divides it (`20G`, `512M`).
pub fn size_text(bytes: u64) -> String {
    for (shift, unit) in [(30, "G"), (20, "M"), (10, "K")] {
        if bytes % (1 << shift) == 0 {
            return format!("{}{unit}", bytes >> shift);
        }
    }
    bytes.to_string()
}

/// NVIDIA Dynamo's GPU-sharing docs, measured on r615: a percentage prints with two decimals.
pub fn percentage_text(p: Option<Percentage>) -> String {
    format!("{:.2}", p.unwrap_or(Percentage::FULL).value())
}

pub fn server_row(pipe: &Path, name: &str, s: &Server) -> Vec<String> {
    vec![
        name.to_string(),
        s.uid.to_string(),
        s.pid().map_or_else(|| "-".to_string(), |p| p.to_string()),
        s.status().to_string(),
        layout::server_dir(pipe, name).display().to_string(),
        s.allowed
            .as_ref()
            .map_or_else(|| "all".to_string(), |d| d.join(",")),
        "-".to_string(),
    ]
}

pub fn namespace_row(
    pipe: &Path,
    server: &str,
    s: &Server,
    name: &str,
    ns: &Namespace,
) -> Vec<String> {
    vec![
        name.to_string(),
        server.to_string(),
        s.status().to_string(),
        // NVIDIA's KAI agent's docs: a namespace with no pinned limit lists it as `unlimited`.
        ns.limits
            .pinned
            .map_or_else(|| "unlimited".to_string(), size_text),
        percentage_text(ns.limits.percentage),
        ns.limits.priority.unwrap_or(0).to_string(),
        layout::namespace_dir(pipe, server, name)
            .display()
            .to_string(),
    ]
}

impl State {
    /// Server `name`, or the error that it does not exist.
    pub fn server(&self, name: &str) -> Result<&Server, String> {
        self.servers.get(name).ok_or_else(|| no_server(name))
    }

    /// [`State::server`], to change it.
    pub fn server_mut(&mut self, name: &str) -> Result<&mut Server, String> {
        self.servers.get_mut(name).ok_or_else(|| no_server(name))
    }

    pub fn server_list(&self, pipe: &Path, only: Option<&str>) -> Listing<'static> {
        Listing {
            columns: &SERVER_COLUMNS,
            rows: self
                .servers
                .iter()
                .filter(|(n, _)| only.is_none_or(|o| o == n.as_str()))
                .map(|(n, s)| server_row(pipe, n, s))
                .collect(),
            pid_column: Some(2),
        }
    }

    pub fn namespace_list(
        &self,
        pipe: &Path,
        only: Option<&str>,
        server: Option<&str>,
    ) -> Listing<'static> {
        let mut rows = Vec::new();
        for (sname, s) in &self.servers {
            if server.is_some_and(|o| o != sname) {
                continue;
            }
            for (nname, ns) in &s.namespaces {
                if only.is_none_or(|o| o == nname) {
                    rows.push(namespace_row(pipe, sname, s, nname, ns));
                }
            }
        }
        Listing {
            columns: &NAMESPACE_COLUMNS,
            rows,
            pid_column: None,
        }
    }

    pub fn client_list(&self, server: Option<&str>) -> Listing<'static> {
        let mut rows = Vec::new();
        for (sname, s) in &self.servers {
            if server.is_some_and(|o| o != sname) {
                continue;
            }
            for (nname, ns) in &s.namespaces {
                for c in &ns.clients {
                    rows.push(vec![
                        c.pid.to_string(),
                        sname.clone(),
                        "0".to_string(),
                        nname.clone(),
                        c.command.clone(),
                    ]);
                }
            }
        }
        Listing {
            columns: &CLIENT_COLUMNS,
            rows,
            pid_column: Some(0),
        }
    }

    /// The server and namespace a client pid is attached to.
    pub fn find_client(&self, pid: u32) -> Option<(String, String)> {
        self.servers.iter().find_map(|(sname, s)| {
            s.namespaces.iter().find_map(|(nname, ns)| {
                ns.clients
                    .iter()
                    .any(|c| u32::try_from(c.pid).ok() == Some(pid))
                    .then(|| (sname.clone(), nname.clone()))
            })
        })
    }

    /// Removes a client by ticket wherever it is; whether it was still there.
    pub fn detach(&mut self, ticket: u64) -> bool {
        for s in self.servers.values_mut() {
            for ns in s.namespaces.values_mut() {
                let before = ns.clients.len();
                ns.clients.retain(|c| c.ticket != ticket);
                if ns.clients.len() != before {
                    return true;
                }
            }
        }
        false
    }
}

/// Whether `name` is the namespace `server set` configures.
pub fn is_default(name: &str) -> bool {
    name == DEFAULT_NAMESPACE
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_percentages_print_as_measured() {
        assert_eq!(size_text(20 << 30), "20G");
        assert_eq!(size_text(512 << 20), "512M");
        assert_eq!(size_text(1536 << 20), "1536M");
        assert_eq!(size_text((1 << 20) + 1024), "1025K");
        assert_eq!(percentage_text(Percentage::parse("30").ok()), "30.00");
        assert_eq!(percentage_text(Percentage::parse("12.5").ok()), "12.50");
        assert_eq!(percentage_text(None), "100.00");
    }

    #[test]
    fn a_pinned_limit_reaches_every_device_of_the_server_in_whole_mib() {
        let limits = Limits {
            pinned: Some((1 << 30) + 5),
            ..Limits::default()
        };
        assert_eq!(
            limits
                .device_limits(Some(&["GPU-a".to_string()]))
                .to_string(),
            "0=1024M,GPU-a=1024M"
        );
        assert_eq!(Limits::default().device_limits(None).to_string(), "none");
    }
}
