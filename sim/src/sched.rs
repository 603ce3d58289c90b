//! The control daemon's shared state and its server scheduling policy, after the MPS guide's
//! Architecture section: at most one server at a time; a client attaches to a server of its
//! own uid (in multi-user mode every client counts as the daemon's uid); a client of another
//! uid waits in a FIFO queue; once the current server has no clients and a client of another
//! uid waits, the server is shut down and one is started for that uid; a server with no
//! clients and nobody waiting lingers.
//!
//! Invariants:
//! - every state change happens under the one mutex, and [`Core::schedule`] runs after each
//!   change that can unblock a waiting client, then wakes all waiters;
//! - a waiting client is identified by its ticket, never by pid (pids repeat across pid
//!   namespaces); a ticket is in at most one of: the queue, the admitted map, a server's
//!   client list;
//! - while anyone is queued, new clients queue behind them even if their uid matches the
//!   running server, so a steady stream of one user cannot starve another (the real daemon
//!   also stops serving a server it has asked to shut down);
//! - a server is only started with the settings current at that moment; later changes to the
//!   defaults affect only later servers.

use std::collections::{HashMap, VecDeque};
use std::io::{BufReader, Read};
use std::path::PathBuf;
use std::process::ChildStdout;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::limits::{DeviceLimits, Percentage};
use crate::log::ControlLog;
use crate::server::{describe_exit, ServerProcess};

/// Limits a server is started with and hands to its clients.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    pub percentage: Percentage,
    pub mem: DeviceLimits,
}

/// A CUDA client as the daemon knows it; pid, uid and gid come from SO_PEERCRED.
#[derive(Debug, Clone)]
pub struct ClientInfo {
    pub pid: i32,
    pub uid: u32,
    pub gid: u32,
    /// Inode of the client's pid namespace, 0 when unreadable (the `ps` NAMESPACE column).
    pub namespace: u64,
    pub command: String,
    /// Its connection, where `terminate_client` tells it (`None` where it cannot be shared).
    pub conn: Option<Arc<std::os::unix::net::UnixStream>>,
}

struct Pending {
    ticket: u64,
    client: ClientInfo,
    server_uid: u32,
    server_gid: u32,
    arrived: Instant,
}

pub struct Attached {
    ticket: u64,
    /// Per-server client number, the `ps` ID column.
    pub id: u32,
    pub client: ClientInfo,
}

pub struct Server {
    pub pid: u32,
    pub uid: u32,
    pub settings: Settings,
    pub clients: Vec<Attached>,
    next_id: u32,
    process: ServerProcess,
}

/// What a client gets once it is attached: its server and the server's current settings.
#[derive(Debug, Clone)]
pub struct Admission {
    pub server_pid: u32,
    pub server_uid: u32,
    pub settings: Settings,
    pub waited: Duration,
}

pub struct State {
    pub defaults: Settings,
    pub server: Option<Server>,
    pending: VecDeque<Pending>,
    admitted: HashMap<u64, Result<Admission, String>>,
    next_ticket: u64,
    pub quitting: bool,
}

/// Files the daemon removes on `quit`.
pub struct DaemonFiles {
    pub socket: PathBuf,
    pub pid_file: PathBuf,
    /// `control_privileged`, in multi-user mode.
    pub privileged: Option<PathBuf>,
}

pub struct Core {
    pub log: ControlLog,
    /// This binary, re-executed for servers.
    pub exe: PathBuf,
    pub uid: u32,
    pub gid: u32,
    pub multiuser: bool,
    pub files: DaemonFiles,
    state: Mutex<State>,
    wake: Condvar,
}

impl Core {
    pub fn new(
        log: ControlLog,
        exe: PathBuf,
        (uid, gid): (u32, u32),
        multiuser: bool,
        files: DaemonFiles,
        defaults: Settings,
    ) -> Arc<Self> {
        Arc::new(Core {
            log,
            exe,
            uid,
            gid,
            multiuser,
            files,
            state: Mutex::new(State {
                defaults,
                server: None,
                pending: VecDeque::new(),
                admitted: HashMap::new(),
                next_ticket: 0,
                quitting: false,
            }),
            wake: Condvar::new(),
        })
    }

    pub fn lock(&self) -> MutexGuard<'_, State> {
        // A panic elsewhere must not wedge every later connection; the state stays usable.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits for a state change or the timeout, whichever comes first.
    pub fn wait<'a>(
        &self,
        guard: MutexGuard<'a, State>,
        timeout: Duration,
    ) -> MutexGuard<'a, State> {
        match self.wake.wait_timeout(guard, timeout) {
            Ok((g, _)) => g,
            Err(e) => e.into_inner().0,
        }
    }

    /// The uid and gid a server for this client runs as.
    pub fn server_identity(&self, uid: u32, gid: u32) -> (u32, u32) {
        if self.multiuser {
            (self.uid, self.gid)
        } else {
            (uid, gid)
        }
    }

    /// Whether this daemon can ever start a server for `uid`: a non-root daemon can only
    /// run servers as itself, the real daemon fails the same way on the setuid.
    pub fn check_can_serve(&self, server_uid: u32) -> Result<(), String> {
        if self.uid == 0 || server_uid == self.uid {
            return Ok(());
        }
        let msg = format!("control daemon runs as user {}", self.uid);
        self.log.log(&format!(
            "Server failed to start for user {server_uid}: {msg}"
        ));
        Err(msg)
    }

    /// Queues a client and lets the scheduler run; returns its ticket.
    pub fn enqueue(self: &Arc<Self>, st: &mut State, client: ClientInfo) -> u64 {
        let (server_uid, server_gid) = self.server_identity(client.uid, client.gid);
        let queue_empty = st.pending.is_empty();
        match &st.server {
            Some(s) if queue_empty && s.uid == server_uid => self.log.log(&format!(
                "NEW CLIENT {} from user {server_uid}: Server already exists",
                client.pid
            )),
            None if queue_empty => {}
            _ => self.log.log(&format!(
                "NEW CLIENT {} from user {server_uid}: Server is not ready, push client to pending list",
                client.pid
            )),
        }
        let ticket = st.next_ticket;
        st.next_ticket += 1;
        st.pending.push_back(Pending {
            ticket,
            client,
            server_uid,
            server_gid,
            arrived: Instant::now(),
        });
        self.schedule(st);
        ticket
    }

    /// The outcome for a ticket once the scheduler decided it; `None` while still queued.
    pub fn take_admission(&self, st: &mut State, ticket: u64) -> Option<Result<Admission, String>> {
        st.admitted.remove(&ticket)
    }

    /// Forgets a client wherever it is (it disconnected), and reschedules.
    pub fn forget(self: &Arc<Self>, st: &mut State, ticket: u64) {
        st.pending.retain(|p| p.ticket != ticket);
        st.admitted.remove(&ticket);
        if let Some(server) = st.server.as_mut() {
            server.clients.retain(|c| c.ticket != ticket);
        }
        self.schedule(st);
    }

    /// Serves the queue head as far as the one-server rule allows.
    pub fn schedule(self: &Arc<Self>, st: &mut State) {
        if st.quitting {
            return;
        }
        while let Some(head) = st.pending.front() {
            let (uid, gid) = (head.server_uid, head.server_gid);
            match st.server.as_mut() {
                Some(server) if server.uid == uid => {
                    if let Some(p) = st.pending.pop_front() {
                        let ticket = p.ticket;
                        let admission = attach(server, p);
                        st.admitted.insert(ticket, Ok(admission));
                    }
                }
                Some(server) if server.clients.is_empty() => self.stop_server(st),
                Some(_) => break,
                None => {
                    if let Err(msg) = self.start_server(st, uid, gid) {
                        if let Some(p) = st.pending.pop_front() {
                            st.admitted.insert(p.ticket, Err(msg));
                        }
                    }
                }
            }
        }
        self.wake.notify_all();
    }

    /// Starts a server for `uid` with the current defaults. The caller makes sure none runs.
    pub fn start_server(
        self: &Arc<Self>,
        st: &mut State,
        uid: u32,
        gid: u32,
    ) -> Result<u32, String> {
        self.check_can_serve(uid)?;
        let switch_to = (self.uid == 0 && (uid, gid) != (self.uid, self.gid)).then_some((uid, gid));
        let (process, stdout) = match ServerProcess::spawn(&self.exe, uid, switch_to) {
            Ok(started) => started,
            Err(e) => {
                let msg = format!("{:#}", anyhow::Error::new(e));
                self.log
                    .log(&format!("Server failed to start for user {uid}: {msg}"));
                return Err(msg);
            }
        };
        let pid = process.pid();
        let settings = st.defaults.clone();
        self.log
            .log(&format!("Starting new server {pid} for user {uid}"));
        self.log.log(&format!(
            "NEW SERVER {pid}: Ready active_thread_percentage={} pinned_mem_limit={}",
            settings.percentage, settings.mem
        ));
        st.server = Some(Server {
            pid,
            uid,
            settings,
            clients: Vec::new(),
            next_id: 0,
            process,
        });
        let core = Arc::clone(self);
        let watcher = std::thread::Builder::new()
            .name(format!("server-{pid}"))
            .spawn(move || core.watch_server(pid, stdout));
        if let Err(e) = watcher {
            // Without a watcher only a server that dies on its own goes unnoticed; planned
            // stops still reap it.
            self.log.log(&format!("cannot watch server {pid}: {e}"));
        }
        Ok(pid)
    }

    /// Stops the current server, if any, and logs how it ended.
    fn log_reaped(&self, pid: u32, reaped: std::io::Result<std::process::ExitStatus>) {
        match reaped {
            Ok(status) => self
                .log
                .log(&format!("Server {pid} {}", describe_exit(&status))),
            Err(e) => self
                .log
                .log(&format!("Server {pid} could not be reaped: {e}")),
        }
    }

    pub fn stop_server(&self, st: &mut State) {
        if let Some(server) = st.server.take() {
            let pid = server.pid;
            self.log_reaped(pid, server.process.stop());
        }
    }

    /// Runs on its own thread for each server: the server's stdout ends when it exits, so a
    /// server that dies by itself is noticed, logged and replaced for whoever waits.
    fn watch_server(self: Arc<Self>, pid: u32, mut stdout: BufReader<ChildStdout>) {
        let mut sink = [0u8; 256];
        loop {
            match stdout.read(&mut sink) {
                Ok(0) => break,
                Ok(_) => continue,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(_) => break,
            }
        }
        let mut st = self.lock();
        let current = st.server.as_ref().is_some_and(|s| s.pid == pid);
        if !current {
            // Stopped on purpose; stop_server already reaped and logged it.
            return;
        }
        if let Some(server) = st.server.take() {
            self.log_reaped(pid, server.process.reap());
        }
        self.schedule(&mut st);
    }

    /// The state side of `quit`: stop serving, stop the server, turn away whoever waits.
    pub fn shut_down(&self, st: &mut State) {
        st.quitting = true;
        self.stop_server(st);
        while let Some(p) = st.pending.pop_front() {
            st.admitted
                .insert(p.ticket, Err("control daemon is shutting down".to_string()));
        }
        self.wake.notify_all();
    }
}

fn attach(server: &mut Server, p: Pending) -> Admission {
    let id = server.next_id;
    server.next_id = server.next_id.wrapping_add(1);
    server.clients.push(Attached {
        ticket: p.ticket,
        id,
        client: p.client,
    });
    Admission {
        server_pid: server.pid,
        server_uid: server.uid,
        settings: server.settings.clone(),
        waited: p.arrived.elapsed(),
    }
}
