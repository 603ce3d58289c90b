//! The session both NRI processes run on their connection (the plugin and the validator
//! are each a `Service`): NRI's two logical connections over one socket, the runtime's
//! requests read and checked as ttrpc's own server checks them, each answered on a thread
//! of its own within the in-flight bound, and the registration. It knows nothing of what
//! either process answers: `Plugin`'s answers are in `nri` (mod.rs), the validator's in
//! `validator`; the same session over bytes in memory for the fuzz targets (`converse`,
//! `converse_validator`) is in mod.rs too.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use anyhow::Context;
use prost::Message;

use super::api;
use super::wire::{self, PLUGIN_CONN, RUNTIME_CONN, TYPE_REQUEST, TYPE_RESPONSE};

pub(super) const PLUGIN_SERVICE: &str = "nri.pkg.api.v1alpha1.Plugin";
pub(super) const RUNTIME_SERVICE: &str = "nri.pkg.api.v1alpha1.Runtime";
/// How much of a string the runtime sent goes into a log line or an answer.
const QUOTED: usize = 128;
/// gRPC's codes, as ttrpc carries them.
pub(super) const CODE_UNKNOWN: i32 = 2;
pub(super) const CODE_INVALID_ARGUMENT: i32 = 3;
pub(super) const CODE_RESOURCE_EXHAUSTED: i32 = 8;
pub(super) const CODE_UNIMPLEMENTED: i32 = 12;
const CODE_UNAVAILABLE: i32 = 14;

/// Requests answered at once by the process, each on a thread of its own; one more is
/// refused. NRI calls a plugin one event at a time, so more than a few in flight means
/// requests the runtime has given up on (timed out) piling up behind a stuck daemon start.
pub(super) const MAX_IN_FLIGHT: usize = 64;

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
        configured: &Configured,
    ) -> anyhow::Result<Vec<u8>>;
    /// The successful answer to `method` could not be sent (the runtime gave up on it:
    /// timed out, closed the connection): what it left behind for an answer that was
    /// never delivered is taken back.
    fn undelivered(&self, _method: &str, _payload: &[u8]) {}
}

/// Called once the runtime has configured the plugin, with the runtime's name and version.
pub(super) type Configured = dyn Fn(String) + Send + Sync;
/// The same, shared by the threads that answer.
pub(super) type Connected = Arc<Configured>;

/// The write half of a connection, shared by the threads that answer.
pub(super) struct Sender {
    stream: Mutex<Box<dyn Write + Send>>,
    next_stream: AtomicU32,
}

impl Sender {
    pub(super) fn send(&self, conn: u32, stream: u32, typ: u8, body: &[u8]) -> anyhow::Result<()> {
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
    pub(super) fn refuse(&self, stream: u32, code: i32, why: &str) {
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
pub(super) struct InFlight {
    count: Mutex<usize>,
    idle: Condvar,
}

pub(super) struct Ticket(Arc<InFlight>);

impl InFlight {
    /// A ticket for one more request, unless `MAX_IN_FLIGHT` are being answered.
    pub(super) fn enter(self: &Arc<Self>) -> Option<Ticket> {
        let mut n = self.count.lock().unwrap_or_else(|e| e.into_inner());
        if *n >= MAX_IN_FLIGHT {
            return None;
        }
        *n += 1;
        Some(Ticket(Arc::clone(self)))
    }

    /// Waits until no request is being answered, or `limit` has passed.
    pub(super) fn wait_idle(&self, limit: Duration) {
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
pub(super) fn quoted(s: &str) -> String {
    let mut out = crate::util::escape(&s.chars().take(QUOTED).collect::<String>());
    if s.chars().nth(QUOTED).is_some() {
        out.push('…');
    }
    out
}

/// One connection to the runtime, until it ends. `Ok(true)` when the plugin had
/// registered and the runtime then closed the connection; `Ok(false)` when it closed it
/// before that. `connected` runs once the runtime has configured the plugin.
pub(super) fn session<S: Service>(
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
pub(super) fn serve<S: Service>(
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
pub(super) fn answer<S: Service>(
    plugin: &S,
    body: &[u8],
    configured: &Configured,
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
pub(super) fn undelivered<S: Service>(service: &S, body: &[u8]) {
    if let Ok(req) = api::Request::decode(body) {
        if req.service == PLUGIN_SERVICE {
            service.undelivered(&req.method, &req.payload);
        }
    }
}
