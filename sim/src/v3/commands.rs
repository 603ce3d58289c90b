//! Carrying out v3 CLI commands and client attaches against the daemon's state: who may
//! (authorization by the caller's uid), and what each verb does to the state, the sockets
//! and the server processes.
//!
//! Authorization, after NVIDIA's MPS v3 pages and the measurements of NVIDIA's KAI
//! GPU-fractioning agent on r615: root may do everything; the owner of the server a command
//! changes may change it; any other uid may list and get only, and a change fails with
//! `Insufficient privileges for UID <uid>. '<MODULE> <VERB>' requires server owner.`.
//! `server create` and `quit` belong to the daemon's owner; `client terminate` to the owner
//! of the client's server (NVIDIA's docs are silent on quit and terminate by non-owners: the
//! simulator refuses them).
//!
//! Invariants: called with the state lock held; a command either completes or leaves the
//! state as it found it (sockets bound for a failed create are closed again).

use std::io::{BufRead, BufReader};
use std::sync::Arc;

use crate::limits::Percentage;
use crate::log::ControlLog;
use crate::server::{describe_exit, ServerProcess};
use crate::wire::{Hello, Ready};

use super::format::render;
use super::grammar::Command;
use super::layout::{self, LayoutError, DEFAULT_NAMESPACE};
use super::listen::{listen, Core, Route};
use super::state::{self, Attached, Limits, Namespace, Server, State};

/// The refusal a non-owner gets, as measured on r615 by NVIDIA's KAI GPU-fractioning agent.
pub fn refusal(uid: u32, title: &str) -> String {
    format!("Insufficient privileges for UID {uid}. '{title}' requires server owner.")
}

fn layout_err(e: LayoutError) -> String {
    e.to_string()
}

/// Who owns what `cmd` changes; `None` where nothing by that name exists.
fn owner(core: &Core, st: &State, cmd: &Command) -> Option<u32> {
    let of = |name: &str| st.servers.get(name).map(|s| s.uid);
    match cmd {
        Command::ServerCreate { .. } => Some(core.uid),
        Command::ServerSet { name, .. } | Command::ServerDelete { name, .. } => of(name),
        Command::NamespaceCreate { server, .. }
        | Command::NamespaceSet { server, .. }
        | Command::NamespaceDelete { server, .. } => of(server),
        Command::ClientTerminate { pid } => st.find_client(*pid).and_then(|(s, _)| of(&s)),
        _ => None,
    }
}

pub fn execute(
    core: &Arc<Core>,
    st: &mut State,
    cmd: Command,
    caller: u32,
) -> Result<String, String> {
    if cmd.mutates() && caller != 0 && owner(core, st, &cmd) != Some(caller) {
        return Err(refusal(caller, cmd.title()));
    }
    match cmd {
        Command::Help(text) => Ok(text),
        Command::ServerCreate {
            name,
            uid,
            allowed_devices,
        } => {
            // NVIDIA's MPS v3 interface page: in multiuser mode only --uid=0 is allowed
            // (measured on r615 by NVIDIA's KAI agent: every server is root-owned).
            if core.multiuser {
                if let Some(u) = uid.filter(|&u| u != 0) {
                    return Err(format!(
                        "server create: --uid={u} is not allowed in multiuser mode; every server is owned by root"
                    ));
                }
            }
            if st.servers.contains_key(&name) {
                return Err(format!("server {name} already exists"));
            }
            // NVIDIA's MPS v3 interface page: without --uid the server is the connecting user's.
            let owner = if core.multiuser {
                0
            } else {
                uid.unwrap_or(caller)
            };
            create_server(core, st, &name, owner, allowed_devices)?;
            Ok(String::new())
        }
        Command::ServerSet { name, limits } => {
            let server = st.server_mut(&name)?;
            let ns = server
                .namespaces
                .get_mut(DEFAULT_NAMESPACE)
                .ok_or_else(|| format!("server {name} has no default namespace"))?;
            // NVIDIA's MPS v3 interface page: server set applies to the default namespace;
            // the refusal with a client attached is measured for namespace set (KAI, r615).
            refuse_with_clients(ns, "server set", DEFAULT_NAMESPACE, &name)?;
            ns.limits.apply(&limits);
            log_limits(core, server, &name, DEFAULT_NAMESPACE);
            Ok(String::new())
        }
        Command::ServerList { name, format } => {
            Ok(render(&st.server_list(&core.pipe, name.as_deref()), format))
        }
        Command::ServerGet { name, field } => {
            let s = st.server(&name)?;
            field_of(
                &state::SERVER_COLUMNS,
                &state::server_row(&core.pipe, &name, s),
                &field,
            )
        }
        Command::ServerDelete { name, force } => {
            let server = st.server(&name)?;
            let n = server.client_count();
            // NVIDIA's MPS v3 interface page: delete refuses while clients are active;
            // --force terminates them first.
            if n > 0 && !force {
                return Err(format!(
                    "server delete: server {name} has {n} active client(s); use --force to terminate them"
                ));
            }
            if let Some(server) = st.servers.remove(&name) {
                remove_server(core, &name, server);
            }
            Ok(String::new())
        }
        Command::NamespaceCreate { name, server } => {
            let s = st.server(&server)?;
            if s.namespaces.contains_key(&name) {
                return Err(format!(
                    "namespace {name} already exists on server {server}"
                ));
            }
            let dir = layout::namespace_dir(&core.pipe, &server, &name);
            let listening = listen(core, &dir, Route::Namespace(server.clone(), name.clone()))
                .map_err(layout_err)?;
            let s = st.server_mut(&server)?;
            s.namespaces.insert(
                name.clone(),
                Namespace {
                    limits: Limits::default(),
                    clients: Vec::new(),
                    listening,
                },
            );
            s.log.log(&format!("Namespace {name} created"));
            core.log
                .log(&format!("Namespace {name} created on server {server}"));
            Ok(String::new())
        }
        Command::NamespaceSet {
            name,
            server,
            limits,
        } => {
            let s = st.server_mut(&server)?;
            let ns = s.namespace_mut(&name, &server)?;
            // Measured on r615 by NVIDIA's KAI GPU-fractioning agent: namespace set fails
            // while a client is attached.
            refuse_with_clients(ns, "namespace set", &name, &server)?;
            ns.limits.apply(&limits);
            log_limits(core, s, &server, &name);
            Ok(String::new())
        }
        Command::NamespaceDelete {
            name,
            server,
            force,
        } => {
            if state::is_default(&name) {
                return Err(format!(
                    "namespace delete: the default namespace of server {server} cannot be deleted (delete the server)"
                ));
            }
            let s = st.server_mut(&server)?;
            let ns = s.namespace(&name, &server)?;
            let n = ns.clients.len();
            // NVIDIA's MPS v3 interface page: --force deletes a namespace with active clients
            // (measured on r615 by NVIDIA's KAI agent: refused without it).
            if n > 0 && !force {
                return Err(format!(
                    "namespace delete: namespace {name} on server {server} has {n} attached client(s); use --force to terminate them"
                ));
            }
            if let Some(ns) = s.namespaces.remove(&name) {
                terminate_all(core, &ns);
                ns.listening.close();
                let dir = layout::namespace_dir(&core.pipe, &server, &name);
                if let Err(e) = layout::remove_dir(&dir) {
                    core.log.log(&format!("{e}"));
                }
                s.log.log(&format!("Namespace {name} deleted"));
            }
            core.log
                .log(&format!("Namespace {name} deleted from server {server}"));
            Ok(String::new())
        }
        Command::NamespaceList {
            name,
            server,
            format,
        } => Ok(render(
            &st.namespace_list(&core.pipe, name.as_deref(), server.as_deref()),
            format,
        )),
        Command::NamespaceGet {
            name,
            server,
            field,
        } => {
            let s = st.server(&server)?;
            let ns = s.namespace(&name, &server)?;
            field_of(
                &state::NAMESPACE_COLUMNS,
                &state::namespace_row(&core.pipe, &server, s, &name, ns),
                &field,
            )
        }
        Command::ClientList { server, format } => {
            Ok(render(&st.client_list(server.as_deref()), format))
        }
        Command::ClientTerminate { pid } => {
            let (sname, nname) = st
                .find_client(pid)
                .ok_or_else(|| format!("client terminate: no MPS client with pid {pid}"))?;
            if let Some(ns) = st
                .servers
                .get_mut(&sname)
                .and_then(|s| s.namespaces.get_mut(&nname))
            {
                ns.clients.retain(|c| {
                    let hit = u32::try_from(c.pid).ok() == Some(pid);
                    if hit {
                        c.terminate();
                    }
                    !hit
                });
            }
            core.log.log(&format!(
                "Client {pid} terminated (server {sname}, namespace {nname})"
            ));
            Ok(String::new())
        }
    }
}

fn refuse_with_clients(ns: &Namespace, verb: &str, name: &str, server: &str) -> Result<(), String> {
    match ns.clients.len() {
        0 => Ok(()),
        n => Err(format!(
            "{verb}: namespace {name} on server {server} has {n} attached client(s); its limits cannot change while a client is attached"
        )),
    }
}

fn field_of(columns: &[&str], row: &[String], field: &str) -> Result<String, String> {
    columns
        .iter()
        .position(|c| *c == field)
        .and_then(|i| row.get(i))
        .map(|v| format!("{v}\n"))
        .ok_or_else(|| format!("unknown field {field:?}; fields: {}", columns.join(", ")))
}

fn log_limits(core: &Core, server: &Server, sname: &str, nname: &str) {
    if let Some(ns) = server.namespaces.get(nname) {
        let line = format!(
            "Namespace {nname} limits: active_thread_percentage={} pinned_memory_limit={} client_priority={}",
            state::percentage_text(ns.limits.percentage),
            ns.limits.pinned.map_or_else(|| "unlimited".to_string(), state::size_text),
            ns.limits.priority.unwrap_or(0)
        );
        server.log.log(&line);
        core.log.log(&format!("Server {sname}: {line}"));
    }
}

fn terminate_all(core: &Core, ns: &Namespace) {
    for c in &ns.clients {
        c.terminate();
        core.log.log(&format!("Client {} terminated", c.pid));
    }
}

pub fn log_stopped(
    core: &Core,
    name: &str,
    pid: u32,
    how: std::io::Result<std::process::ExitStatus>,
) {
    match how {
        Ok(status) => core
            .log
            .log(&format!("Server {name} ({pid}) {}", describe_exit(&status))),
        Err(e) => core
            .log
            .log(&format!("Server {name} ({pid}) could not be reaped: {e}")),
    }
}

/// Makes a server: its directory and socket, its default namespace, its log, its process.
fn create_server(
    core: &Arc<Core>,
    st: &mut State,
    name: &str,
    owner: u32,
    allowed: Option<Vec<String>>,
) -> Result<(), String> {
    if core.uid != 0 && owner != core.uid {
        return Err(format!(
            "server create: the control daemon runs as user {} and cannot run a server as user {owner}",
            core.uid
        ));
    }
    let dir = layout::server_dir(&core.pipe, name);
    let default_dir = layout::namespace_dir(&core.pipe, name, DEFAULT_NAMESPACE);
    // Both sockets must fit before anything is made.
    layout::check_fits(&layout::socket_in(&default_dir)).map_err(layout_err)?;
    let server_log_dir = core.log_dir.join(name);
    crate::daemon::create_dir_if_missing(&server_log_dir).map_err(|e| format!("{e:#}"))?;
    let log = ControlLog::open_file(
        server_log_dir.join("server.log"),
        "Server",
        std::process::id(),
    )
    .map_err(|e| format!("{e:#}"))?;
    let listening = listen(core, &dir, Route::Server(name.to_string())).map_err(layout_err)?;
    let default = match listen(
        core,
        &default_dir,
        Route::Namespace(name.to_string(), DEFAULT_NAMESPACE.to_string()),
    ) {
        Ok(l) => l,
        Err(e) => {
            listening.close();
            return Err(layout_err(e));
        }
    };
    let mut server = Server {
        uid: owner,
        allowed,
        process: None,
        namespaces: Default::default(),
        listening,
        log,
    };
    server.namespaces.insert(
        DEFAULT_NAMESPACE.to_string(),
        Namespace {
            limits: Limits::default(),
            clients: Vec::new(),
            listening: default,
        },
    );
    if let Err(e) = start_process(core, name, &mut server) {
        for ns in server.namespaces.values() {
            ns.listening.close();
        }
        server.listening.close();
        return Err(e);
    }
    core.log.log(&format!(
        "Server {name} created for user {owner} (pid {})",
        server.pid().unwrap_or(0)
    ));
    st.servers.insert(name.to_string(), server);
    Ok(())
}

fn start_process(core: &Arc<Core>, name: &str, server: &mut Server) -> Result<(), String> {
    let uid = server.uid;
    let gid = nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid))
        .ok()
        .flatten()
        .map_or(uid, |u| u.gid.as_raw());
    let switch_to = (core.uid == 0 && uid != core.uid).then_some((uid, gid));
    let (process, stdout) = ServerProcess::spawn(&core.exe, uid, switch_to).map_err(|e| {
        let msg = format!("{:#}", anyhow::Error::new(e));
        core.log.log(&format!(
            "Server {name} failed to start for user {uid}: {msg}"
        ));
        msg
    })?;
    let pid = process.pid();
    server
        .log
        .log(&format!("Server {pid} started for user {uid}"));
    server.process = Some(process);
    let (watch_core, watch_name) = (Arc::clone(core), name.to_string());
    let spawned = std::thread::Builder::new()
        .name(format!("server-{pid}"))
        .spawn(move || watch_server(watch_core, watch_name, pid, stdout));
    if let Err(e) = spawned {
        core.log.log(&format!("cannot watch server {pid}: {e}"));
    }
    Ok(())
}

/// Reads a server process's stdout to its end (the process exited), then forgets it if it
/// is still the server's, so the next client starts a new one.
pub fn watch_server(
    core: Arc<Core>,
    name: String,
    pid: u32,
    mut reader: BufReader<std::process::ChildStdout>,
) {
    let mut sink = String::new();
    while matches!(reader.read_line(&mut sink), Ok(n) if n > 0) {
        sink.clear();
    }
    let mut st = core.lock();
    let Some(server) = st.servers.get_mut(&name) else {
        return;
    };
    if server.pid() != Some(pid) {
        return;
    }
    if let Some(process) = server.process.take() {
        log_stopped(&core, &name, pid, process.reap());
    }
}

fn remove_server(core: &Core, name: &str, server: Server) {
    for (nname, ns) in &server.namespaces {
        terminate_all(core, ns);
        ns.listening.close();
        if let Err(e) = layout::remove_dir(&layout::namespace_dir(&core.pipe, name, nname)) {
            core.log.log(&format!("{e}"));
        }
    }
    server.listening.close();
    if let Some(process) = server.process {
        log_stopped(core, name, process.pid(), process.stop());
    }
    if let Err(e) = layout::remove_dir(&layout::server_dir(&core.pipe, name)) {
        core.log.log(&format!("{e}"));
    }
    core.log.log(&format!("Server {name} deleted"));
}

/// A CUDA client as the connection knows it; pid and uid from SO_PEERCRED.
pub struct NewClient {
    pub pid: i32,
    pub uid: u32,
    pub command: String,
    pub conn: Option<Arc<std::os::unix::net::UnixStream>>,
}

/// Attaches a client to the namespace its socket routes to; its ticket and READY line.
pub fn attach(
    core: &Arc<Core>,
    st: &mut State,
    route: &Route,
    client: NewClient,
    hello: &Hello,
) -> Result<(u64, Ready), String> {
    if st.quitting {
        return Err("control daemon is shutting down".to_string());
    }
    let (sname, nname) = match route {
        Route::Namespace(s, n) => (s.clone(), n.clone()),
        Route::Server(s) => (s.clone(), DEFAULT_NAMESPACE.to_string()),
        Route::Top => {
            // NVIDIA's MPS v3 "Common tasks" page: each connecting UID is served by a
            // `uid_<uid>` server (the main socket's backward-compatible UID routing).
            let name = format!("uid_{}", client.uid);
            if !st.servers.contains_key(&name) {
                let owner = if core.multiuser { 0 } else { client.uid };
                create_server(core, st, &name, owner, None)?;
            }
            (name, DEFAULT_NAMESPACE.to_string())
        }
    };
    let server = st
        .servers
        .get_mut(&sname)
        .ok_or_else(|| format!("server {sname} no longer exists"))?;
    // Measured on r615 in NVIDIA Dynamo's GPU-sharing docs: a client whose uid is not the
    // owner of a non-multiuser server (root included) is not permitted.
    if !core.multiuser && client.uid != server.uid {
        return Err(format!(
            "client of user {} is not permitted on server {sname} of user {} (the daemon is not multi-user; CUDA error 800)",
            client.uid, server.uid
        ));
    }
    if server.process.is_none() {
        start_process(core, &sname, server)?;
    }
    let server_pid = server.pid().unwrap_or(0);
    let server_uid = server.uid;
    let allowed = server.allowed.clone();
    let ns = server
        .namespaces
        .get_mut(&nname)
        .ok_or_else(|| format!("namespace {nname} of server {sname} no longer exists"))?;
    // Measured on r615 by NVIDIA's KAI agent and in NVIDIA Dynamo's GPU-sharing docs: the
    // effective percentage is the lower of the client's and the namespace's; a named
    // namespace does not inherit the server's limits (unset is 100 and unlimited).
    let percentage = ns
        .limits
        .percentage
        .unwrap_or(Percentage::FULL)
        .lowered_by(hello.percentage);
    // NVIDIA's MPS v3 environment appendix: the client's pinned limit further constrains.
    let mem = ns
        .limits
        .device_limits(allowed.as_deref())
        .lowered_by(&hello.mem);
    let ticket = st.next_ticket;
    st.next_ticket += 1;
    let line = format!(
        "NEW CLIENT {} from user {} attached to namespace {nname} active_thread_percentage={percentage} pinned_mem_limit={mem}",
        client.pid, client.uid
    );
    ns.clients.push(Attached {
        ticket,
        pid: client.pid,
        command: client.command,
        conn: client.conn,
    });
    core.log.log(&format!("{line} (server {sname})"));
    if let Some(s) = st.servers.get(&sname) {
        s.log.log(&line);
    }
    Ok((
        ticket,
        Ready {
            server_pid,
            server_uid,
            waited_ms: 0,
            percentage,
            mem,
            names: Some((nname, sname)),
        },
    ))
}
