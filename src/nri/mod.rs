//! `gpushare nri`: gpushare as an NRI (Node Resource Interface) plugin, one long-running
//! process per node that containerd (≥ 1.7) and CRI-O call at each container's creation,
//! so that every CRI pod with a request gets its share whatever its RuntimeClass, with no
//! shim and no hook process.
//!
//! The connection: the plugin dials the runtime's NRI socket (or, launched by the runtime
//! from its plugin directory, uses the socket it was handed in `NRI_PLUGIN_SOCKET`), splits
//! it into NRI's two logical connections (`wire`), serves the plugin service on one and
//! calls `RegisterPlugin` on the other; the runtime then calls `Configure` (the plugin
//! subscribes to CreateContainer, PostCreateContainer, StartContainer, StopContainer,
//! RemoveContainer),
//! `Synchronize` (every pod and container it has: `plugin::Plugin::synchronize`), and the
//! events. Each request is answered on a thread of its own, so a slow daemon start does
//! not hold up another container's events. When the runtime goes away (a restart), the
//! plugin dials again with backoff; a plugin the runtime launched exits instead (the
//! runtime launches it again).
//!
//! What the runtime sends is checked as ttrpc's own server checks it: a request on an
//! even stream id, or on one not above the last, is refused on that stream (one log line);
//! a message of another type is dropped (one line); a request that does not decode is
//! answered with an error (one line); at most `MAX_IN_FLIGHT` requests are answered at
//! once, one more is refused. A broken frame or an oversized message ends the connection
//! (one line), and the plugin dials again. Nothing the runtime sends panics the process,
//! which serves every pod of the node: the fuzz target `nri` drives this session over
//! bytes in memory (`converse`), and the tests here over a socket pair, as the runtime.
//!
//! NRI fails open unless told otherwise: while no plugin is connected, the runtime creates
//! containers without it, so a pod with a request then runs unserved, unless a validator
//! refuses it: gpushare's own (`validator`, `gpushare nri-validate`, a process of its own
//! that the plugin keeps running: it refuses a container with a request that lacks the
//! plugin's adjustment), or NRI's default validator requiring the plugin (node-wide or per
//! pod: docs/kubernetes.md). The plugin answers within a budget, so that the runtime never
//! drops it for a late answer (`plugin`), and dials again whenever the connection ends;
//! at each connection's `Synchronize`, and at each container's `PostCreateContainer` and
//! `StartContainer`, it audits the runtime's containers for any that got through unserved
//! (`Plugin::audit`, `Plugin::audit_event`, reported in `nri.json`), re-audits them every
//! `[nri] audit-interval` and, under `[nri] unserved = "evict"`, ends them by their init
//! process (`Plugin::audit_every`, a thread of its own), and a create whose answer
//! could not be sent leaves no record (`Service::undelivered`). It says where it stands in
//! `<state-dir>/nri.json` (`PluginState`: its pid, whether it is registered with a runtime,
//! which one, since when), which `doctor` and `status` read.

pub(crate) mod api;
pub(crate) mod plugin;
pub(crate) mod validator;
pub(crate) mod wire;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use anyhow::Context;
use prost::Message;
use serde::{Deserialize, Serialize};

use crate::config::Config;
use crate::state::{ProcRef, StateDir};
use api::event;
use plugin::Plugin;
use wire::{PLUGIN_CONN, RUNTIME_CONN, TYPE_REQUEST, TYPE_RESPONSE};

/// NRI's default socket.
pub(crate) const DEFAULT_SOCKET: &str = "/var/run/nri/nri.sock";
/// The name and index the plugin registers under (plugins are called in index order).
pub(crate) const DEFAULT_NAME: &str = "gpushare";
pub(crate) const DEFAULT_INDEX: &str = "10";

const PLUGIN_SERVICE: &str = "nri.pkg.api.v1alpha1.Plugin";
const RUNTIME_SERVICE: &str = "nri.pkg.api.v1alpha1.Runtime";
/// gRPC's codes, as ttrpc carries them.
const CODE_UNKNOWN: i32 = 2;
const CODE_INVALID_ARGUMENT: i32 = 3;
const CODE_RESOURCE_EXHAUSTED: i32 = 8;
const CODE_UNIMPLEMENTED: i32 = 12;
const CODE_UNAVAILABLE: i32 = 14;

/// Requests answered at once by the process, each on a thread of its own; one more is
/// refused. NRI calls a plugin one event at a time, so more than a few in flight means
/// requests the runtime has given up on (timed out) piling up behind a stuck daemon start.
const MAX_IN_FLIGHT: usize = 64;
/// The containers one `Synchronize` may deliver over its parts (`more`), as protobuf.
const MAX_SYNC_BYTES: usize = 64 << 20;
/// How much of a string the runtime sent goes into a log line or an answer.
const QUOTED: usize = 128;

/// What `<state-dir>/nri.json` says: written by the plugin, read by `doctor` and `status`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct PluginState {
    /// The plugin's process; it speaks for the plugin only while this very process runs.
    pub process: Option<ProcRef>,
    pub socket: PathBuf,
    /// Registered with a runtime and configured by it.
    pub connected: bool,
    /// The runtime's name and version, from its `Configure`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime: Option<String>,
    /// Since when (Unix seconds) `connected` has been what it is.
    pub since: u64,
    /// Why it is not connected, when it is not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The containers with a request that the last `Synchronize` found running without
    /// the plugin's adjustment (`Plugin::audit`): `<namespace>/<pod>/<container> (<id>)`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unserved: Vec<String>,
    /// How many such containers this process ended (`[nri] unserved = "evict"`).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub evicted: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl PluginState {
    /// Reads the plugin's state; `None` when no plugin ever ran here.
    pub(crate) fn read(dirs: &StateDir) -> Option<PluginState> {
        Self::read_at(&dirs.nri_state_path())
    }

    /// The state at `path`: the plugin's, or the validator's (`validator::state_path`).
    pub(crate) fn read_at(path: &Path) -> Option<PluginState> {
        let bytes = crate::fsops::read_regular(path, 64 << 10).ok()?;
        serde_json::from_slice(&bytes).ok()
    }

    /// Whether the plugin that wrote this still runs and is connected.
    pub(crate) fn live_and_connected(&self) -> bool {
        self.connected && self.process.is_some_and(|p| p.alive())
    }

    fn write(&self, path: &Path) {
        let written = serde_json::to_vec(self)
            .map_err(std::io::Error::other)
            .and_then(|data| crate::fsops::write_atomic_with(path, &data, 0o644, false));
        if let Err(e) = written {
            tracing::warn!(path = %path.display(), error = %e, "NRI: could not write the process's state");
        }
    }
}

/// Puts what the audit found into the plugin's own state (`nri.json`), as long as that
/// state is this process's; written only when it changed.
fn record_unserved(dirs: &StateDir, unserved: Vec<String>, evicted: u64) {
    let Some(mut state) = PluginState::read(dirs) else {
        return;
    };
    if state.process.map(|p| p.pid) != Some(std::process::id() as i32)
        || (state.unserved == unserved && state.evicted == evicted)
    {
        return;
    }
    state.unserved = unserved;
    state.evicted = evicted;
    state.write(&dirs.nri_state_path());
}

/// `record_unserved` with the plugin's count of evictions.
fn record_audit(plugin: &Plugin, unserved: Vec<String>) {
    let evicted = plugin.evicted.load(Ordering::Relaxed);
    record_unserved(&plugin.dirs, unserved, evicted);
}

/// How the plugin reaches its runtime.
pub(crate) enum Endpoint {
    /// Dial this socket, again whenever the connection ends.
    Socket(PathBuf),
    /// The connection the runtime handed a plugin it launched (`NRI_PLUGIN_SOCKET`).
    Launched(UnixStream),
}

/// Runs the plugin until the runtime that launched it goes away (`Endpoint::Launched`),
/// or for ever (`Endpoint::Socket`), registering as `name` with `index`. With
/// `validator`, the socket the validator dials, the plugin keeps a validator running
/// (`validator::keep`): a process of its own, which outlives this one.
pub(crate) fn run(
    cfg: &Config,
    endpoint: Endpoint,
    name: &str,
    index: &str,
    validator: Option<PathBuf>,
) -> anyhow::Result<()> {
    let dirs = StateDir::new(&cfg.state_dir);
    dirs.ensure_root()?;
    let plugin = Arc::new(Plugin::new(cfg.clone()));
    let reaper = Arc::clone(&plugin);
    std::thread::spawn(move || reap_children(&reaper));
    let auditor = Arc::clone(&plugin);
    std::thread::spawn(move || {
        let dirs = auditor.dirs.clone();
        auditor.audit_every(&|unserved, evicted| record_unserved(&dirs, unserved, evicted));
    });
    if let Some(socket) = validator {
        let dirs = dirs.clone();
        std::thread::spawn(move || validator::keep(&dirs, &socket));
    }
    run_service(&plugin, &dirs.nri_state_path(), endpoint, name, index)
}

/// Serves `service` on the runtime's connection, saying where it stands at `state_path`
/// (`PluginState`): until the runtime that launched it goes away (`Endpoint::Launched`),
/// or for ever, dialling again with backoff whenever the connection ends.
fn run_service<S: Service>(
    service: &Arc<S>,
    state_path: &Path,
    endpoint: Endpoint,
    name: &str,
    index: &str,
) -> anyhow::Result<()> {
    let me = ProcRef::of(std::process::id() as i32);
    let state_path = state_path.to_owned();
    let state =
        move |socket: &Path, connected: bool, runtime: Option<String>, error: Option<String>| {
            PluginState {
                process: me,
                socket: socket.to_owned(),
                connected,
                runtime,
                since: crate::util::unix_now(),
                error,
                unserved: Vec::new(),
                evicted: 0,
            }
            .write(&state_path)
        };
    let state = Arc::new(state);
    // What a session says once the runtime has configured the plugin (from the thread
    // that answered Configure).
    let on_configured = |socket: PathBuf| -> Connected {
        let state = Arc::clone(&state);
        Arc::new(move |runtime: String| state(&socket, true, Some(runtime), None))
    };
    match endpoint {
        Endpoint::Launched(stream) => {
            let socket = PathBuf::from("(the connection the runtime launched the plugin with)");
            let end = session(service, stream, name, index, on_configured(socket.clone()));
            state(
                &socket,
                false,
                None,
                end.as_ref().err().map(|e| format!("{e:#}")),
            );
            end
        }
        Endpoint::Socket(socket) => {
            let mut backoff = Duration::from_millis(250);
            let mut last_error = String::new();
            loop {
                let end = UnixStream::connect(&socket)
                    .with_context(|| format!("connect to the NRI socket {}", socket.display()))
                    .and_then(|stream| {
                        session(service, stream, name, index, on_configured(socket.clone()))
                    });
                let why = match end {
                    Ok(registered) => {
                        if registered {
                            backoff = Duration::from_millis(250);
                            // Connected since: this end is news, say it again.
                            last_error.clear();
                        }
                        "the runtime closed the connection".to_owned()
                    }
                    Err(e) => format!("{e:#}"),
                };
                if why != last_error {
                    tracing::warn!(name, error = %why, "NRI: not connected; trying again with backoff");
                    state(&socket, false, None, Some(why.clone()));
                    last_error = why;
                }
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
    }
    .map(|_| ())
}

/// Reaps the supervisors and reapers this process started (`mps::launch` starts them
/// here where no agent runs), never while a daemon is being ensured: `ensure` waits on
/// its own child.
fn reap_children(plugin: &Plugin) {
    use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
    loop {
        std::thread::sleep(Duration::from_secs(1));
        // Tried, never waited for: a waiting writer would hold up every later create
        // behind the creates in flight. Zombies wait for a moment without creates.
        let _quiet = match plugin.reaping.try_write() {
            Ok(quiet) => quiet,
            Err(std::sync::TryLockError::WouldBlock) => continue,
            Err(std::sync::TryLockError::Poisoned(_)) => return,
        };
        while let Ok(status) = waitpid(None, Some(WaitPidFlag::WNOHANG)) {
            if status == WaitStatus::StillAlive {
                break;
            }
        }
    }
}

/// What one NRI process serves on its connection: the plugin (`Plugin`) or the validator
/// (`validator::Validator`). The session (framing, stream ids, the in-flight bound, the
/// registration) is the same for both; only the methods' answers differ.
pub(crate) trait Service: Send + Sync + 'static {
    /// A new connection begins: whatever an earlier one left half done is dropped.
    fn begin(&self) {}
    /// The payload of the answer to `method`, whose request payload is `payload`;
    /// `configured` runs once the runtime has configured the process.
    fn handle(
        &self,
        method: &str,
        payload: &[u8],
        configured: &(dyn Fn(String) + Send + Sync),
    ) -> anyhow::Result<Vec<u8>>;
    /// The successful answer to `method` could not be sent (the runtime gave up on it:
    /// timed out, closed the connection): what it left behind for an answer that was
    /// never delivered is taken back.
    fn undelivered(&self, _method: &str, _payload: &[u8]) {}
}

/// Called once the runtime has configured the plugin, with the runtime's name and version.
type Connected = Arc<dyn Fn(String) + Send + Sync>;

/// The write half of a connection, shared by the threads that answer.
struct Sender {
    stream: Mutex<Box<dyn Write + Send>>,
    next_stream: AtomicU32,
}

impl Sender {
    fn send(&self, conn: u32, stream: u32, typ: u8, body: &[u8]) -> anyhow::Result<()> {
        let msg = wire::ttrpc_message(stream, typ, body)?;
        let mut s = self
            .stream
            .lock()
            .map_err(|_| anyhow::anyhow!("the connection's writer is poisoned"))?;
        wire::write_frame(&mut *s, conn, &msg)?;
        s.flush().context("flush the runtime's connection")?;
        Ok(())
    }

    /// Refuses the request on `stream` with `code`: one log line, one answer.
    fn refuse(&self, stream: u32, code: i32, why: &str) {
        tracing::warn!(stream, "NRI: {why}");
        let resp = api::Response {
            status: Some(api::Status {
                code,
                message: format!("gpushare: {why}"),
            }),
            payload: Vec::new(),
        };
        if let Err(e) = self.send(PLUGIN_CONN, stream, TYPE_RESPONSE, &resp.encode_to_vec()) {
            tracing::warn!(error = %format!("{e:#}"), "NRI: could not answer the runtime");
        }
    }
}

/// The requests being answered; each holds a `Ticket`.
#[derive(Default)]
struct InFlight {
    count: Mutex<usize>,
    idle: Condvar,
}

struct Ticket(Arc<InFlight>);

impl InFlight {
    /// A ticket for one more request, unless `MAX_IN_FLIGHT` are being answered.
    fn enter(self: &Arc<Self>) -> Option<Ticket> {
        let mut n = self.count.lock().unwrap_or_else(|e| e.into_inner());
        if *n >= MAX_IN_FLIGHT {
            return None;
        }
        *n += 1;
        Some(Ticket(Arc::clone(self)))
    }

    /// Waits until no request is being answered, or `limit` has passed.
    fn wait_idle(&self, limit: Duration) {
        let n = self.count.lock().unwrap_or_else(|e| e.into_inner());
        let _ = self.idle.wait_timeout_while(n, limit, |n| *n > 0);
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut n = self.0.count.lock().unwrap_or_else(|e| e.into_inner());
        *n = n.saturating_sub(1);
        if *n == 0 {
            self.0.idle.notify_all();
        }
    }
}

/// At most `QUOTED` characters of what the runtime sent, escaped for one line.
fn quoted(s: &str) -> String {
    let mut out = crate::util::escape(&s.chars().take(QUOTED).collect::<String>());
    if s.chars().nth(QUOTED).is_some() {
        out.push('…');
    }
    out
}

/// One connection to the runtime, until it ends. `Ok(true)` when the plugin had
/// registered and the runtime then closed the connection; `Ok(false)` when it closed it
/// before that. `connected` runs once the runtime has configured the plugin.
fn session<S: Service>(
    plugin: &Arc<S>,
    stream: UnixStream,
    name: &str,
    index: &str,
    connected: Connected,
) -> anyhow::Result<bool> {
    // One bound for the process: requests still running when a connection ended (the
    // runtime gave up on them) count against the next connection's.
    static IN_FLIGHT: std::sync::OnceLock<Arc<InFlight>> = std::sync::OnceLock::new();
    let reader = stream
        .try_clone()
        .context("clone the runtime's connection")?;
    serve(
        plugin,
        reader,
        Box::new(stream),
        name,
        index,
        connected,
        IN_FLIGHT.get_or_init(Arc::default),
    )
}

/// `session` over any byte stream: the socket, or bytes in memory (`converse`).
fn serve<S: Service>(
    plugin: &Arc<S>,
    mut reader: impl Read,
    writer: Box<dyn Write + Send>,
    name: &str,
    index: &str,
    connected: Connected,
    in_flight: &Arc<InFlight>,
) -> anyhow::Result<bool> {
    plugin.begin();
    let sender = Arc::new(Sender {
        stream: Mutex::new(writer),
        next_stream: AtomicU32::new(1),
    });
    let register = api::RegisterPluginRequest {
        plugin_name: name.to_owned(),
        plugin_idx: index.to_owned(),
    };
    let register_stream = sender.next_stream.fetch_add(2, Ordering::Relaxed);
    let req = api::Request {
        service: RUNTIME_SERVICE.into(),
        method: "RegisterPlugin".into(),
        payload: register.encode_to_vec(),
        timeout_nano: 0,
    };
    sender.send(
        RUNTIME_CONN,
        register_stream,
        TYPE_REQUEST,
        &req.encode_to_vec(),
    )?;
    let mut plugin_conn = wire::Stream::default();
    let mut runtime_conn = wire::Stream::default();
    let mut registered = false;
    // The highest stream id a request came on: ttrpc's ids only increase.
    let mut last_stream = 0;
    loop {
        let Some((conn, payload)) = wire::read_frame(&mut reader)? else {
            if plugin_conn.pending() + runtime_conn.pending() > 0 {
                tracing::warn!(
                    "NRI: the runtime closed the connection inside a ttrpc message; its {} bytes are dropped",
                    plugin_conn.pending() + runtime_conn.pending()
                );
            }
            return Ok(registered);
        };
        match conn {
            PLUGIN_CONN => {
                plugin_conn.push(&payload);
                while let Some(msg) = plugin_conn.next_message()? {
                    if msg.typ != TYPE_REQUEST {
                        tracing::warn!(
                            stream = msg.stream,
                            "NRI: dropped a ttrpc message of type {} on the plugin's service: it serves requests (type {TYPE_REQUEST}) only",
                            msg.typ
                        );
                        continue;
                    }
                    if msg.stream % 2 == 0 {
                        sender.refuse(
                            msg.stream,
                            CODE_INVALID_ARGUMENT,
                            &format!("the runtime's request came on stream {}: allowed are odd stream ids (ttrpc's client streams)", msg.stream),
                        );
                        continue;
                    }
                    if msg.stream <= last_stream {
                        sender.refuse(
                            msg.stream,
                            CODE_INVALID_ARGUMENT,
                            &format!("the runtime's request came on stream {}, not above {last_stream}: a stream id is used once, and each is above the last", msg.stream),
                        );
                        continue;
                    }
                    last_stream = msg.stream;
                    let Some(ticket) = in_flight.enter() else {
                        sender.refuse(
                            msg.stream,
                            CODE_RESOURCE_EXHAUSTED,
                            &format!("{MAX_IN_FLIGHT} of the runtime's requests are being answered: allowed is no more at once"),
                        );
                        continue;
                    };
                    let (plugin, answers, connected) = (
                        Arc::clone(plugin),
                        Arc::clone(&sender),
                        Arc::clone(&connected),
                    );
                    let spawned = std::thread::Builder::new()
                        .name("nri-request".into())
                        .spawn(move || {
                            let _ticket = ticket;
                            let response = answer(&*plugin, &msg.body, &*connected);
                            if let Err(e) = answers.send(
                                PLUGIN_CONN,
                                msg.stream,
                                TYPE_RESPONSE,
                                &response.encode_to_vec(),
                            ) {
                                tracing::warn!(error = %format!("{e:#}"), "NRI: could not answer the runtime");
                                if response.status.is_none() {
                                    undelivered(&*plugin, &msg.body);
                                }
                            }
                        });
                    if let Err(e) = spawned {
                        sender.refuse(
                            msg.stream,
                            CODE_UNAVAILABLE,
                            &format!("could not start a thread to answer the request: {e}"),
                        );
                    }
                }
            }
            RUNTIME_CONN => {
                runtime_conn.push(&payload);
                while let Some(msg) = runtime_conn.next_message()? {
                    if msg.typ != TYPE_RESPONSE || msg.stream != register_stream || registered {
                        continue;
                    }
                    let resp = api::Response::decode(msg.body.as_slice())
                        .context("decode the runtime's answer to RegisterPlugin")?;
                    if let Some(status) = resp.status.filter(|s| s.code != 0) {
                        anyhow::bail!(
                            "the runtime refused to register the plugin {name} (index {index}): {}",
                            crate::util::escape(&status.message)
                        );
                    }
                    registered = true;
                    tracing::info!(name, index, "NRI: plugin registered");
                }
            }
            _ => {}
        }
    }
}

/// The answer to one request of the runtime on the plugin's service.
fn answer<S: Service>(
    plugin: &S,
    body: &[u8],
    configured: &(dyn Fn(String) + Send + Sync),
) -> api::Response {
    let fail = |code: i32, message: String| api::Response {
        status: Some(api::Status { code, message }),
        payload: Vec::new(),
    };
    let req = match api::Request::decode(body) {
        Ok(r) => r,
        Err(e) => {
            let line = format!("gpushare: the runtime's request is not a ttrpc request: {e}");
            tracing::warn!("NRI: {line}");
            return fail(CODE_INVALID_ARGUMENT, line);
        }
    };
    if req.service != PLUGIN_SERVICE {
        let line = format!("gpushare: no service {}", quoted(&req.service));
        tracing::warn!("NRI: {line}");
        return fail(CODE_UNIMPLEMENTED, line);
    }
    match plugin.handle(&req.method, &req.payload, configured) {
        Ok(payload) => api::Response {
            status: None,
            payload,
        },
        Err(e) => {
            let line = format!("gpushare: {e:#}");
            tracing::error!(method = %quoted(&req.method), "{line}");
            fail(CODE_UNKNOWN, line)
        }
    }
}

/// `Service::undelivered` for the request `body`, a successful answer to which could not
/// be sent.
fn undelivered<S: Service>(service: &S, body: &[u8]) {
    if let Ok(req) = api::Request::decode(body) {
        if req.service == PLUGIN_SERVICE {
            service.undelivered(&req.method, &req.payload);
        }
    }
}

impl Service for Plugin {
    /// A Synchronize that an earlier connection's end cut short is not this one's.
    fn begin(&self) {
        if let Ok(mut so_far) = self.sync.lock() {
            so_far.clear();
        }
        if let Ok(mut pods) = self.sync_pods.lock() {
            pods.clear();
        }
    }

    fn handle(
        &self,
        method: &str,
        payload: &[u8],
        configured: &(dyn Fn(String) + Send + Sync),
    ) -> anyhow::Result<Vec<u8>> {
        handle(self, method, payload, configured)
    }

    /// A `CreateContainer` whose adjustment never reached the runtime: the runtime created
    /// that container without it (NRI fails open) or not at all (a validator refused it),
    /// so the record the create made is dropped, and with it the container's reference on
    /// its daemon: an unserved container is no client of the daemon.
    fn undelivered(&self, method: &str, payload: &[u8]) {
        if method != "CreateContainer" {
            return;
        }
        let Ok(ev) = api::ContainerEvent::decode(payload) else {
            return;
        };
        let ctr = ev.container.unwrap_or_default();
        if self.forget_unanswered(&ctr) {
            tracing::warn!(
                container_id = %quoted(&ctr.id),
                "NRI: the runtime did not get the container's adjustment; its record is dropped"
            );
        }
    }
}

fn handle(
    plugin: &Plugin,
    method: &str,
    payload: &[u8],
    configured: &(dyn Fn(String) + Send + Sync),
) -> anyhow::Result<Vec<u8>> {
    let event = || api::ContainerEvent::decode(payload).context("decode the runtime's event");
    Ok(match method {
        "Configure" => {
            let req = api::ConfigureRequest::decode(payload).context("decode Configure")?;
            let runtime = format!(
                "{} {}",
                quoted(&req.runtime_name),
                quoted(&req.runtime_version)
            );
            tracing::info!(runtime = %runtime, "NRI: configured by the runtime");
            if let Ok(mut r) = plugin.runtime.lock() {
                *r = runtime.clone();
            }
            plugin.configured(req.request_timeout);
            configured(runtime);
            api::ConfigureResponse {
                events: event::mask(&[
                    event::CREATE_CONTAINER,
                    event::POST_CREATE_CONTAINER,
                    event::START_CONTAINER,
                    event::STOP_CONTAINER,
                    event::REMOVE_CONTAINER,
                ]),
            }
            .encode_to_vec()
        }
        "Synchronize" => {
            let req = api::SynchronizeRequest::decode(payload).context("decode Synchronize")?;
            let mut so_far = plugin
                .sync
                .lock()
                .map_err(|_| anyhow::anyhow!("the synchronization is poisoned"))?;
            let mut pods = plugin
                .sync_pods
                .lock()
                .map_err(|_| anyhow::anyhow!("the synchronization is poisoned"))?;
            let bytes = |cs: &[api::Container]| cs.iter().map(|c| c.encoded_len()).sum::<usize>();
            let pod_bytes =
                |ps: &[api::PodSandbox]| ps.iter().map(|p| p.encoded_len()).sum::<usize>();
            if bytes(&so_far) + bytes(&req.containers) + pod_bytes(&pods) + pod_bytes(&req.pods)
                > MAX_SYNC_BYTES
            {
                so_far.clear();
                pods.clear();
                anyhow::bail!(
                    "the runtime's Synchronize described more than {MAX_SYNC_BYTES} bytes of containers: allowed is at most that"
                );
            }
            so_far.extend(req.containers);
            pods.extend(req.pods);
            if !req.more {
                let all = std::mem::take(&mut *so_far);
                let all_pods = std::mem::take(&mut *pods);
                drop((so_far, pods));
                plugin.synchronize(&all);
                record_audit(plugin, plugin.audit(&all_pods, &all));
            }
            api::SynchronizeResponse { more: req.more }.encode_to_vec()
        }
        "CreateContainer" => {
            let ev = event()?;
            let (pod, ctr) = (ev.pod.unwrap_or_default(), ev.container.unwrap_or_default());
            let adjust = plugin.create(&pod, &ctr)?;
            api::CreateContainerResponse {
                adjust: Some(adjust),
            }
            .encode_to_vec()
        }
        "PostCreateContainer" | "StartContainer" => {
            let ev = event()?;
            let (pod, ctr) = (ev.pod.unwrap_or_default(), ev.container.unwrap_or_default());
            if method == "PostCreateContainer" {
                plugin.created(&ctr);
            }
            if let Some(unserved) = plugin.audit_event(&pod, &ctr) {
                record_audit(plugin, unserved);
            }
            Vec::new()
        }
        "StopContainer" | "RemoveContainer" => {
            let ctr = event()?.container.unwrap_or_default();
            plugin.release(&ctr);
            if let Some(left) = plugin.no_longer_unserved(&ctr) {
                record_audit(plugin, left);
            }
            Vec::new()
        }
        // Shutdown, StateChange and the events the plugin did not subscribe to: nothing to
        // do, an empty answer.
        _ => Vec::new(),
    })
}

/// The validator's side of one connection held in memory, for the fuzz target
/// `nri_validate`, as `converse` is the plugin's.
pub fn converse_validator(cfg: &Config, input: &[u8]) -> (Vec<(u32, i32)>, Result<bool, String>) {
    let validator = Arc::new(validator::Validator::new(cfg, DEFAULT_NAME));
    let out = Arc::new(Mutex::new(Vec::new()));
    let in_flight = Arc::new(InFlight::default());
    let end = serve_memory(&validator, input, &out, &in_flight);
    in_flight.wait_idle(Duration::from_secs(60));
    let written = std::mem::take(&mut *out.lock().unwrap_or_else(|e| e.into_inner()));
    (answers(&written), end)
}

/// The plugin's side of one connection held in memory, for the fuzz target `nri`:
/// `input` is what the runtime sent. Returns each answer on the plugin's service as
/// (stream id, gRPC status code, 0 for success), once every request is answered, and how
/// the session ended (its error line).
pub fn converse(cfg: &Config, input: &[u8]) -> (Vec<(u32, i32)>, Result<bool, String>) {
    let plugin = Arc::new(Plugin::new(cfg.clone()));
    let out = Arc::new(Mutex::new(Vec::new()));
    let in_flight = Arc::new(InFlight::default());
    let end = serve_memory(&plugin, input, &out, &in_flight);
    in_flight.wait_idle(Duration::from_secs(60));
    let written = std::mem::take(&mut *out.lock().unwrap_or_else(|e| e.into_inner()));
    (answers(&written), end)
}

fn serve_memory<S: Service>(
    plugin: &Arc<S>,
    input: &[u8],
    out: &Arc<Mutex<Vec<u8>>>,
    in_flight: &Arc<InFlight>,
) -> Result<bool, String> {
    serve(
        plugin,
        input,
        Box::new(Memory(Arc::clone(out))),
        DEFAULT_NAME,
        DEFAULT_INDEX,
        Arc::new(|_| {}),
        in_flight,
    )
    .map_err(|e| format!("{e:#}"))
}

/// A writer into memory that the answering threads share.
struct Memory(Arc<Mutex<Vec<u8>>>);

impl Write for Memory {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .map_err(|_| std::io::Error::other("poisoned"))?
            .extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Each successful answer's (stream id, payload).
#[cfg(test)]
type Payloads = Vec<(u32, Vec<u8>)>;

/// `converse_validator`, with each successful answer's payload.
#[cfg(test)]
pub(crate) fn converse_validator_payloads(
    cfg: &Config,
    input: &[u8],
) -> (Payloads, Result<bool, String>) {
    let validator = Arc::new(validator::Validator::new(cfg, DEFAULT_NAME));
    let out = Arc::new(Mutex::new(Vec::new()));
    let in_flight = Arc::new(InFlight::default());
    let end = serve_memory(&validator, input, &out, &in_flight);
    in_flight.wait_idle(Duration::from_secs(60));
    let written = std::mem::take(&mut *out.lock().unwrap_or_else(|e| e.into_inner()));
    let mut payloads = Vec::new();
    let mut conn = wire::Stream::default();
    let mut bytes = written.as_slice();
    while let Ok(Some((c, payload))) = wire::read_frame(&mut bytes) {
        if c != PLUGIN_CONN {
            continue;
        }
        conn.push(&payload);
        while let Ok(Some(msg)) = conn.next_message() {
            if let Ok(r) = api::Response::decode(msg.body.as_slice()) {
                if r.status.is_none() {
                    payloads.push((msg.stream, r.payload));
                }
            }
        }
    }
    (payloads, end)
}

/// The answers the plugin wrote on its service: (stream id, status code).
fn answers(mut written: &[u8]) -> Vec<(u32, i32)> {
    let mut out = Vec::new();
    let mut conn = wire::Stream::default();
    while let Ok(Some((c, payload))) = wire::read_frame(&mut written) {
        if c != PLUGIN_CONN {
            continue;
        }
        conn.push(&payload);
        while let Ok(Some(msg)) = conn.next_message() {
            let code = api::Response::decode(msg.body.as_slice())
                .ok()
                .and_then(|r| r.status)
                .map_or(0, |s| s.code);
            out.push((msg.stream, code));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// A node whose inventory cannot load and whose state directory cannot exist: a
    /// request gets as far as the inventory and fails there, nothing is written.
    fn cfg() -> Config {
        crate::config::parse(
            "state-dir = \"/dev/null/gpushare\"\ninventory = \"file:/dev/null/inventory.json\"\n",
            None,
        )
        .unwrap()
    }

    pub(crate) fn frame(conn: u32, stream: u32, typ: u8, body: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        let msg = wire::ttrpc_message(stream, typ, body).unwrap();
        wire::write_frame(&mut out, conn, &msg).unwrap();
        out
    }

    pub(crate) fn call(stream: u32, method: &str, payload: &impl Message) -> Vec<u8> {
        let req = api::Request {
            service: PLUGIN_SERVICE.into(),
            method: method.into(),
            payload: payload.encode_to_vec(),
            timeout_nano: 0,
        };
        frame(PLUGIN_CONN, stream, TYPE_REQUEST, &req.encode_to_vec())
    }

    /// The runtime's answer to the plugin's RegisterPlugin (the plugin's stream 1).
    pub(crate) fn registered() -> Vec<u8> {
        frame(
            RUNTIME_CONN,
            1,
            TYPE_RESPONSE,
            &api::Response::default().encode_to_vec(),
        )
    }

    pub(crate) fn configure(stream: u32) -> Vec<u8> {
        let req = api::ConfigureRequest {
            runtime_name: "containerd".into(),
            runtime_version: "v2.3.4".into(),
            ..Default::default()
        };
        call(stream, "Configure", &req)
    }

    fn sorted(mut answers: Vec<(u32, i32)>) -> Vec<(u32, i32)> {
        answers.sort();
        answers
    }

    /// A whole conversation as containerd holds it: registration, Configure, Synchronize,
    /// a container without a request, one with a request (which fails at this node's
    /// inventory), the events after them and Shutdown. The seed of the fuzz target `nri`.
    fn conversation() -> Vec<u8> {
        // One annotation per map: protobuf writes a map in its (random) iteration order.
        let pod = api::PodSandbox {
            id: "pod1".into(),
            name: "trainer".into(),
            namespace: "team-a".into(),
            ..Default::default()
        };
        let plain = api::Container {
            id: "c1".into(),
            pod_sandbox_id: "pod1".into(),
            name: "sidecar".into(),
            env: vec!["PATH=/bin".into()],
            user: Some(api::User {
                uid: 1000,
                gid: 1000,
                additional_gids: vec![],
            }),
            ..Default::default()
        };
        let asks = api::Container {
            id: "c2".into(),
            name: "cuda".into(),
            annotations: HashMap::from([("gpushare.io/device".into(), "0".into())]),
            pid: 4242,
            ..plain.clone()
        };
        let event = |ctr: &api::Container| api::ContainerEvent {
            pod: Some(pod.clone()),
            container: Some(ctr.clone()),
        };
        let sync = api::SynchronizeRequest {
            pods: vec![pod.clone()],
            containers: vec![plain.clone()],
            more: false,
        };
        [
            registered(),
            configure(1),
            call(3, "Synchronize", &sync),
            call(5, "CreateContainer", &event(&plain)),
            call(7, "CreateContainer", &event(&asks)),
            call(9, "PostCreateContainer", &event(&asks)),
            call(11, "StopContainer", &event(&asks)),
            call(13, "RemoveContainer", &event(&asks)),
            call(15, "Shutdown", &api::Response::default()),
        ]
        .concat()
    }

    #[test]
    fn a_conversation_is_answered_request_by_request_and_seeds_the_fuzz_target() {
        let input = conversation();
        let (answers, end) = converse(&cfg(), &input);
        assert_eq!(end, Ok(true));
        assert_eq!(
            sorted(answers),
            [
                (1, 0),
                (3, 0),
                (5, 0),
                (7, CODE_UNKNOWN),
                (9, 0),
                (11, 0),
                (13, 0),
                (15, 0)
            ]
        );
        // The seed the fuzz target starts from is this conversation (written afresh with
        // GPUSHARE_WRITE_SEEDS=1 when the conversation changes).
        let seed = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds/nri/conversation");
        if std::env::var_os("GPUSHARE_WRITE_SEEDS").is_some() {
            std::fs::write(&seed, &input).unwrap();
        }
        assert!(
            std::fs::read(&seed).unwrap() == input,
            "{} is not the conversation: write it with GPUSHARE_WRITE_SEEDS=1",
            seed.display()
        );
    }

    #[test]
    fn a_malformed_request_ends_that_request_and_the_connection_goes_on() {
        let not_protobuf = b"\xff\xff\xff";
        let configure_garbage = api::Request {
            service: PLUGIN_SERVICE.into(),
            method: "Configure".into(),
            payload: not_protobuf.to_vec(),
            timeout_nano: 0,
        };
        let no_such_service = api::Request {
            service: "x".repeat(1 << 20),
            method: "Configure".into(),
            payload: Vec::new(),
            timeout_nano: 0,
        };
        let input = [
            registered(),
            // A ttrpc envelope that does not decode.
            frame(PLUGIN_CONN, 1, TYPE_REQUEST, not_protobuf),
            // A method whose payload does not decode.
            frame(
                PLUGIN_CONN,
                3,
                TYPE_REQUEST,
                &configure_garbage.encode_to_vec(),
            ),
            // Another service, named at length: the answer quotes a bounded part of it.
            frame(
                PLUGIN_CONN,
                5,
                TYPE_REQUEST,
                &no_such_service.encode_to_vec(),
            ),
            // A message type the plugin's service does not take (a response, ttrpc's
            // data, an unknown one): dropped, no answer.
            frame(PLUGIN_CONN, 7, TYPE_RESPONSE, b""),
            frame(PLUGIN_CONN, 9, 3, b""),
            frame(PLUGIN_CONN, 11, 0xff, b"junk"),
            configure(13),
            // A stream id used before, one below the last, an even one.
            configure(13),
            configure(9),
            configure(16),
            // A frame for a conn the multiplexer does not have: dropped.
            frame(7, 17, TYPE_REQUEST, b""),
            configure(17),
        ]
        .concat();
        let (answers, end) = converse(&cfg(), &input);
        assert_eq!(end, Ok(true));
        assert_eq!(
            sorted(answers),
            [
                (1, CODE_INVALID_ARGUMENT),
                (3, CODE_UNKNOWN),
                (5, CODE_UNIMPLEMENTED),
                (9, CODE_INVALID_ARGUMENT),
                (13, 0),
                (13, CODE_INVALID_ARGUMENT),
                (16, CODE_INVALID_ARGUMENT),
                (17, 0),
            ]
        );
    }

    #[test]
    fn a_broken_frame_ends_the_connection_with_one_error() {
        let mut past_frame_bound = PLUGIN_CONN.to_be_bytes().to_vec();
        past_frame_bound.extend_from_slice(&u32::MAX.to_be_bytes());
        // A frame within bounds whose ttrpc header claims more than ttrpc allows.
        let mut past_message_bound = Vec::new();
        let mut header = ((wire::MAX_MESSAGE + 1) as u32).to_be_bytes().to_vec();
        header.extend_from_slice(&[0, 0, 0, 21, TYPE_REQUEST, 0]);
        wire::write_frame(&mut past_message_bound, PLUGIN_CONN, &header).unwrap();
        for (cut, why) in [
            (
                configure(19)[..5].to_vec(),
                "the runtime's connection ended inside a frame header: 5 of its 8 bytes came",
            ),
            (
                configure(19)[..20].to_vec(),
                "the runtime's connection ended inside a frame: 12 of its",
            ),
            (
                past_frame_bound,
                "the runtime sent a frame of 4294967295 bytes on conn 1",
            ),
            (
                past_message_bound,
                "the runtime sent a ttrpc message of 4194305 bytes",
            ),
        ] {
            let input = [registered(), configure(1), cut].concat();
            let (answers, end) = converse(&cfg(), &input);
            // What came before the break is answered.
            assert_eq!(answers, [(1, 0)]);
            let err = end.unwrap_err();
            assert!(err.starts_with(why), "{err}");
        }
        // A ttrpc message cut at the end of the connection is dropped, with a line.
        let cut = configure(3);
        let mut last = Vec::new();
        wire::write_frame(&mut last, PLUGIN_CONN, &cut[8..cut.len() - 1]).unwrap();
        let (answers, end) = converse(&cfg(), &[registered(), configure(1), last].concat());
        assert_eq!((answers, end), (vec![(1, 0)], Ok(true)));
    }

    #[test]
    fn requests_past_the_in_flight_bound_are_refused_not_given_threads() {
        let plugin = Arc::new(Plugin::new(cfg()));
        let streams: Vec<u32> = (0..=MAX_IN_FLIGHT as u32).map(|i| 2 * i + 1).collect();
        let input: Vec<u8> = streams.iter().flat_map(|&s| configure(s)).collect();
        let (out, in_flight) = (
            Arc::new(Mutex::new(Vec::new())),
            Arc::new(InFlight::default()),
        );
        // Every Configure waits for this lock: the first MAX_IN_FLIGHT stay in flight.
        let held = plugin.runtime.lock().unwrap();
        assert_eq!(serve_memory(&plugin, &input, &out, &in_flight), Ok(false));
        let last = *streams.last().unwrap();
        assert_eq!(
            answers(&out.lock().unwrap()),
            [(last, CODE_RESOURCE_EXHAUSTED)]
        );
        drop(held);
        in_flight.wait_idle(Duration::from_secs(60));
        let all = answers(&out.lock().unwrap());
        assert_eq!(all.len(), streams.len());
        assert_eq!(
            all.iter().filter(|(_, code)| *code == 0).count(),
            MAX_IN_FLIGHT
        );
    }

    /// The runtime's end of a socket pair whose other end a session serves: it reads the
    /// plugin's frames back into ttrpc messages, each conn on its own.
    struct Runtime {
        sock: UnixStream,
        plugin_conn: wire::Stream,
        runtime_conn: wire::Stream,
    }

    impl Runtime {
        /// A session of `plugin` on a fresh socket pair, on a thread of its own; what
        /// `connected` was called with goes into `configured`.
        fn start(
            plugin: &Arc<Plugin>,
            configured: &Arc<Mutex<Vec<String>>>,
        ) -> (Self, std::thread::JoinHandle<anyhow::Result<bool>>) {
            let (ours, theirs) = UnixStream::pair().unwrap();
            // A session that stops answering fails the test instead of hanging it.
            ours.set_read_timeout(Some(Duration::from_secs(30)))
                .unwrap();
            let (plugin, configured) = (Arc::clone(plugin), Arc::clone(configured));
            let session = std::thread::spawn(move || {
                let connected: Connected =
                    Arc::new(move |runtime| configured.lock().unwrap().push(runtime));
                let reader = theirs.try_clone().unwrap();
                serve(
                    &plugin,
                    reader,
                    Box::new(theirs),
                    DEFAULT_NAME,
                    DEFAULT_INDEX,
                    connected,
                    &Arc::new(InFlight::default()),
                )
            });
            let runtime = Runtime {
                sock: ours,
                plugin_conn: wire::Stream::default(),
                runtime_conn: wire::Stream::default(),
            };
            (runtime, session)
        }

        fn send(&mut self, bytes: &[u8]) {
            self.sock.write_all(bytes).unwrap();
        }

        /// The plugin's next whole message: (conn, message).
        fn recv(&mut self) -> (u32, wire::Message) {
            loop {
                for (conn, stream) in [
                    (PLUGIN_CONN, &mut self.plugin_conn),
                    (RUNTIME_CONN, &mut self.runtime_conn),
                ] {
                    if let Some(msg) = stream.next_message().unwrap() {
                        return (conn, msg);
                    }
                }
                let (conn, payload) = wire::read_frame(&mut self.sock)
                    .unwrap()
                    .expect("the plugin closed the connection");
                match conn {
                    PLUGIN_CONN => self.plugin_conn.push(&payload),
                    RUNTIME_CONN => self.runtime_conn.push(&payload),
                    other => panic!("the plugin wrote on conn {other}"),
                }
            }
        }

        /// Reads the plugin's RegisterPlugin and answers it.
        fn register(&mut self) {
            let (conn, msg) = self.recv();
            assert_eq!((conn, msg.stream, msg.typ), (RUNTIME_CONN, 1, TYPE_REQUEST));
            let req = api::Request::decode(msg.body.as_slice()).unwrap();
            assert_eq!(
                (req.service.as_str(), req.method.as_str()),
                (RUNTIME_SERVICE, "RegisterPlugin")
            );
            assert_eq!(
                api::RegisterPluginRequest::decode(req.payload.as_slice()).unwrap(),
                api::RegisterPluginRequest {
                    plugin_name: DEFAULT_NAME.into(),
                    plugin_idx: DEFAULT_INDEX.into(),
                }
            );
            self.send(&registered());
        }

        /// Sends a request on the plugin's service and reads its answer.
        fn call(&mut self, stream: u32, method: &str, payload: &impl Message) -> api::Response {
            self.send(&call(stream, method, payload));
            let (conn, msg) = self.recv();
            assert_eq!(
                (conn, msg.stream, msg.typ),
                (PLUGIN_CONN, stream, TYPE_RESPONSE)
            );
            api::Response::decode(msg.body.as_slice()).unwrap()
        }

        /// Closes the connection and returns how the session ended.
        fn close(
            self,
            session: std::thread::JoinHandle<anyhow::Result<bool>>,
        ) -> Result<bool, String> {
            drop(self.sock);
            session
                .join()
                .expect("the session panicked")
                .map_err(|e| format!("{e:#}"))
        }
    }

    /// A node whose state directory is `dir` and whose inventory cannot load, with records
    /// the plugin wrote for the containers `ids` under one daemon.
    fn node_with_records(dir: &Path, ids: &[&str]) -> (Config, StateDir, String) {
        let cfg = crate::config::parse(
            &format!(
                "state-dir = \"{}\"\ninventory = \"file:/dev/null/inventory.json\"\n",
                dir.display()
            ),
            None,
        )
        .unwrap();
        let dirs = StateDir::new(&cfg.state_dir);
        let daemon = "0".repeat(crate::identity::ID_LEN);
        std::fs::create_dir_all(dirs.containers_dir(&daemon)).unwrap();
        for id in ids {
            let rec = crate::state::ContainerRecord::new(
                (*id).to_owned(),
                Some(std::process::id() as i32),
                None,
                Some(plugin::ENGINE.into()),
            );
            dirs.add_container(&daemon, &rec).unwrap();
        }
        (cfg, dirs, daemon)
    }

    fn record_ids(dirs: &StateDir, daemon: &str) -> Vec<String> {
        let mut ids: Vec<String> = dirs
            .containers(daemon)
            .unwrap()
            .into_iter()
            .map(|r| r.id)
            .collect();
        ids.sort();
        ids
    }

    fn ctr(id: &str) -> api::Container {
        api::Container {
            id: id.into(),
            pod_sandbox_id: "pod1".into(),
            name: id.into(),
            ..Default::default()
        }
    }

    fn sync_part(ids: &[&str], more: bool) -> api::SynchronizeRequest {
        api::SynchronizeRequest {
            pods: vec![],
            containers: ids.iter().map(|id| ctr(id)).collect(),
            more,
        }
    }

    #[test]
    fn a_session_over_a_socket_registers_configures_synchronizes_in_parts_and_creates() {
        let dir = tempfile::tempdir().unwrap();
        let (cfg, dirs, daemon) = node_with_records(dir.path(), &["c1", "c2", "gone"]);
        let plugin = Arc::new(Plugin::new(cfg));
        let configured = Arc::new(Mutex::new(Vec::new()));
        let (mut rt, session) = Runtime::start(&plugin, &configured);
        rt.register();

        let resp = rt.call(
            1,
            "Configure",
            &api::ConfigureRequest {
                runtime_name: "containerd".into(),
                runtime_version: "v2.3.4".into(),
                request_timeout: 2000,
                ..Default::default()
            },
        );
        assert_eq!(resp.status, None);
        assert_eq!(
            api::ConfigureResponse::decode(resp.payload.as_slice()).unwrap(),
            api::ConfigureResponse {
                events: event::mask(&[
                    event::CREATE_CONTAINER,
                    event::POST_CREATE_CONTAINER,
                    event::START_CONTAINER,
                    event::STOP_CONTAINER,
                    event::REMOVE_CONTAINER,
                ]),
            }
        );
        assert_eq!(*configured.lock().unwrap(), ["containerd v2.3.4"]);

        // A Synchronize in two parts: nothing is dropped until the last part, then the
        // record of the container the runtime no longer has is.
        let resp = rt.call(3, "Synchronize", &sync_part(&["c1"], true));
        assert_eq!(resp.status, None);
        assert!(
            api::SynchronizeResponse::decode(resp.payload.as_slice())
                .unwrap()
                .more
        );
        assert_eq!(record_ids(&dirs, &daemon), ["c1", "c2", "gone"]);
        let resp = rt.call(5, "Synchronize", &sync_part(&["c2"], false));
        assert_eq!(resp.status, None);
        assert!(
            !api::SynchronizeResponse::decode(resp.payload.as_slice())
                .unwrap()
                .more
        );
        assert_eq!(record_ids(&dirs, &daemon), ["c1", "c2"]);
        assert!(plugin.sync.lock().unwrap().is_empty());

        // A container without a request: an empty adjustment.
        let pod = api::PodSandbox {
            id: "pod1".into(),
            name: "trainer".into(),
            namespace: "team-a".into(),
            ..Default::default()
        };
        let event = |c: api::Container| api::ContainerEvent {
            pod: Some(pod.clone()),
            container: Some(c),
        };
        let resp = rt.call(7, "CreateContainer", &event(ctr("c3")));
        assert_eq!(resp.status, None);
        assert_eq!(
            api::CreateContainerResponse::decode(resp.payload.as_slice()).unwrap(),
            api::CreateContainerResponse {
                adjust: Some(api::ContainerAdjustment::default())
            }
        );
        // One with a request, on a node whose inventory does not load: refused, with the
        // reason, and the session goes on.
        let asks = api::Container {
            annotations: HashMap::from([("gpushare.io/device".into(), "0".into())]),
            ..ctr("c4")
        };
        let resp = rt.call(9, "CreateContainer", &event(asks));
        let status = resp.status.unwrap();
        assert_eq!(status.code, CODE_UNKNOWN);
        assert!(
            status.message.starts_with("gpushare: "),
            "{}",
            status.message
        );
        // RemoveContainer forgets the container's record.
        assert_eq!(
            rt.call(11, "RemoveContainer", &event(ctr("c1"))).status,
            None
        );
        assert_eq!(record_ids(&dirs, &daemon), ["c2"]);
        // Started without the plugin's adjustment (created while it was away): the audit
        // at StartContainer names it, while the session goes on; PostCreateContainer of
        // one without a request names nothing; StopContainer takes it out.
        let asks = |id: &str| api::Container {
            annotations: HashMap::from([("gpushare.io/device".into(), "0".into())]),
            ..ctr(id)
        };
        let unserved = |p: &Plugin| -> Vec<String> {
            p.unserved
                .lock()
                .unwrap()
                .iter()
                .map(|u| u.id.clone())
                .collect()
        };
        assert_eq!(
            rt.call(13, "StartContainer", &event(asks("c5"))).status,
            None
        );
        assert_eq!(
            rt.call(15, "PostCreateContainer", &event(ctr("c6"))).status,
            None
        );
        assert_eq!(unserved(&plugin), ["c5"]);
        assert_eq!(
            rt.call(17, "StopContainer", &event(asks("c5"))).status,
            None
        );
        assert!(unserved(&plugin).is_empty());

        // The runtime closes the connection: the session ends, registered, no panic.
        assert_eq!(rt.close(session), Ok(true));
    }

    #[test]
    fn a_session_closed_before_or_refused_at_registration_ends_with_its_reason() {
        let plugin = Arc::new(Plugin::new(cfg()));
        let configured = Arc::new(Mutex::new(Vec::new()));
        // Closed before the runtime answered RegisterPlugin: not registered.
        let (mut rt, session) = Runtime::start(&plugin, &configured);
        let (conn, _) = rt.recv();
        assert_eq!(conn, RUNTIME_CONN);
        assert_eq!(rt.close(session), Ok(false));
        // Refused: the runtime's reason, escaped, in the session's one error line.
        let (mut rt, session) = Runtime::start(&plugin, &configured);
        rt.recv();
        let refusal = api::Response {
            status: Some(api::Status {
                code: 6,
                message: "plugin \"gpushare\" already registered\n".into(),
            }),
            payload: Vec::new(),
        };
        rt.send(&frame(
            RUNTIME_CONN,
            1,
            TYPE_RESPONSE,
            &refusal.encode_to_vec(),
        ));
        let err = session.join().unwrap().unwrap_err().to_string();
        assert_eq!(
            err,
            "the runtime refused to register the plugin gpushare (index 10): plugin \"gpushare\" already registered\\n"
        );
        assert!(configured.lock().unwrap().is_empty());
    }

    /// A service that answers CreateContainer and fails "Fail", and notes what it was
    /// told went undelivered.
    #[derive(Default)]
    struct Probe {
        undelivered: Mutex<Vec<String>>,
    }

    impl Service for Probe {
        fn handle(
            &self,
            method: &str,
            _payload: &[u8],
            _configured: &(dyn Fn(String) + Send + Sync),
        ) -> anyhow::Result<Vec<u8>> {
            match method {
                "Fail" => anyhow::bail!("refused"),
                _ => Ok(Vec::new()),
            }
        }

        fn undelivered(&self, method: &str, _payload: &[u8]) {
            self.undelivered.lock().unwrap().push(method.to_owned());
        }
    }

    /// A writer whose first flushed frame (the plugin's RegisterPlugin) goes through and
    /// every write after it fails, as a connection the runtime closed.
    struct ClosedAfterRegistering(bool);

    impl Write for ClosedAfterRegistering {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            if self.0 {
                return Err(std::io::ErrorKind::BrokenPipe.into());
            }
            Ok(bytes.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            self.0 = true;
            Ok(())
        }
    }

    #[test]
    fn an_answer_that_cannot_be_sent_is_taken_back_only_when_it_was_a_success() {
        let probe = Arc::new(Probe::default());
        let input = [
            registered(),
            call(1, "CreateContainer", &api::ContainerEvent::default()),
            call(3, "Fail", &api::ContainerEvent::default()),
        ]
        .concat();
        let in_flight = Arc::new(InFlight::default());
        let end = serve(
            &probe,
            input.as_slice(),
            Box::new(ClosedAfterRegistering(false)),
            DEFAULT_NAME,
            DEFAULT_INDEX,
            Arc::new(|_| {}),
            &in_flight,
        );
        in_flight.wait_idle(Duration::from_secs(60));
        assert!(end.is_ok());
        assert_eq!(*probe.undelivered.lock().unwrap(), ["CreateContainer"]);
    }

    #[test]
    fn an_undelivered_create_drops_the_plugin_s_record_of_a_container_that_never_ran() {
        let dir = tempfile::tempdir().unwrap();
        // `ran` has its pid (PostCreateContainer): a container that runs keeps its record.
        let (cfg, dirs, daemon) = node_with_records(dir.path(), &["ran"]);
        // `never`: the record a create made before its answer went out.
        let rec = crate::state::ContainerRecord::new(
            "never".into(),
            None,
            None,
            Some(plugin::ENGINE.into()),
        );
        dirs.add_container(&daemon, &rec).unwrap();
        let plugin = Plugin::new(cfg);
        let event = |id: &str| {
            api::ContainerEvent {
                pod: None,
                container: Some(ctr(id)),
            }
            .encode_to_vec()
        };
        for id in ["ran", "never"] {
            plugin.undelivered("CreateContainer", &event(id));
        }
        // Another method's undelivered answer leaves records alone.
        plugin.undelivered("RemoveContainer", &event("ran"));
        assert_eq!(record_ids(&dirs, &daemon), ["ran"]);
    }

    #[test]
    fn a_session_that_drops_mid_synchronize_leaves_no_list_for_the_next() {
        let dir = tempfile::tempdir().unwrap();
        let (cfg, dirs, daemon) = node_with_records(dir.path(), &["fresh", "stale"]);
        let plugin = Arc::new(Plugin::new(cfg));
        let configured = Arc::new(Mutex::new(Vec::new()));
        // The first session: the first part of a Synchronize, then the runtime goes away
        // (a restart). Its part is left in the plugin's list.
        let (mut rt, session) = Runtime::start(&plugin, &configured);
        rt.register();
        assert_eq!(
            rt.call(1, "Synchronize", &sync_part(&["stale"], true))
                .status,
            None
        );
        assert_eq!(rt.close(session), Ok(true));
        assert_eq!(plugin.sync.lock().unwrap().len(), 1);
        // The restarted runtime no longer has `stale`: its whole list is `fresh`, so the
        // record of `stale` goes. Had the first session's part been kept, the list would
        // name `stale` too and its record would stay, keeping its daemon alive.
        let (mut rt, session) = Runtime::start(&plugin, &configured);
        rt.register();
        assert_eq!(
            rt.call(1, "Synchronize", &sync_part(&["fresh"], false))
                .status,
            None
        );
        assert_eq!(record_ids(&dirs, &daemon), ["fresh"]);
        assert_eq!(rt.close(session), Ok(true));
    }

    #[test]
    fn a_synchronize_past_its_bound_is_refused() {
        // Parts of about 4 MiB each (a container with one long annotation), until their
        // sum passes the bound.
        let part = api::SynchronizeRequest {
            containers: vec![api::Container {
                id: "c1".into(),
                annotations: HashMap::from([("a".into(), "x".repeat(wire::MAX_MESSAGE - 1024))]),
                ..Default::default()
            }],
            more: true,
            ..Default::default()
        };
        let parts = MAX_SYNC_BYTES / part.containers[0].encoded_len() + 1;
        let input: Vec<u8> = (0..parts as u32)
            .flat_map(|i| call(2 * i + 1, "Synchronize", &part))
            .collect();
        let (answers, end) = converse(&cfg(), &input);
        assert_eq!(end, Ok(false));
        assert_eq!(answers.len(), parts);
        // The part that passed the bound, whichever it was of those answered at once.
        assert_eq!(
            answers
                .iter()
                .filter(|(_, code)| *code == CODE_UNKNOWN)
                .count(),
            1
        );
    }
}
