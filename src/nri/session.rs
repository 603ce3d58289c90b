//! The session both NRI processes run on their connection (the plugin and the validator
//! are each a `Service`): NRI's two logical connections over one socket, the runtime's
//! requests read and checked as ttrpc's own server checks them, each answered on a thread
//! of its own within the in-flight bound, the registration, and the same session over
//! bytes in memory for the fuzz targets (`converse`, `converse_validator`).

use super::*;

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
        configured: &Configured,
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

pub(super) fn handle(
    plugin: &Plugin,
    method: &str,
    payload: &[u8],
    configured: &Configured,
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
    let (written, end) = serve_all(&validator, input);
    (answers(&written), end)
}

/// The plugin's side of one connection held in memory, for the fuzz target `nri`:
/// `input` is what the runtime sent. Returns each answer on the plugin's service as
/// (stream id, gRPC status code, 0 for success), once every request is answered, and how
/// the session ended (its error line).
pub fn converse(cfg: &Config, input: &[u8]) -> (Vec<(u32, i32)>, Result<bool, String>) {
    let plugin = Arc::new(Plugin::new(cfg.clone()));
    let (written, end) = serve_all(&plugin, input);
    (answers(&written), end)
}

/// One connection held in memory, `input` what the runtime sent: what `service` wrote
/// once every request is answered, and how the session ended (its error line).
fn serve_all<S: Service>(service: &Arc<S>, input: &[u8]) -> (Vec<u8>, Result<bool, String>) {
    let out = Arc::new(Mutex::new(Vec::new()));
    let in_flight = Arc::new(InFlight::default());
    let end = serve_memory(service, input, &out, &in_flight);
    in_flight.wait_idle(Duration::from_secs(60));
    let written = std::mem::take(&mut *out.lock().unwrap_or_else(|e| e.into_inner()));
    (written, end)
}

pub(super) fn serve_memory<S: Service>(
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
pub(super) struct Memory(Arc<Mutex<Vec<u8>>>);

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
pub(super) type Payloads = Vec<(u32, Vec<u8>)>;

/// `converse_validator`, with each successful answer's payload.
#[cfg(test)]
pub(crate) fn converse_validator_payloads(
    cfg: &Config,
    input: &[u8],
) -> (Payloads, Result<bool, String>) {
    let validator = Arc::new(validator::Validator::new(cfg, DEFAULT_NAME));
    let (written, end) = serve_all(&validator, input);
    let payloads = responses(&written)
        .into_iter()
        .filter_map(|(stream, r)| {
            r.filter(|r| r.status.is_none())
                .map(|r| (stream, r.payload))
        })
        .collect();
    (payloads, end)
}

/// The answers the plugin wrote on its service: (stream id, status code).
pub(super) fn answers(written: &[u8]) -> Vec<(u32, i32)> {
    responses(written)
        .into_iter()
        .map(|(stream, r)| (stream, r.and_then(|r| r.status).map_or(0, |s| s.code)))
        .collect()
}

/// Each message the plugin wrote on its service: its stream id and the response it
/// decodes to (`None`: it does not).
fn responses(mut written: &[u8]) -> Vec<(u32, Option<api::Response>)> {
    let mut out = Vec::new();
    let mut conn = wire::Stream::default();
    while let Ok(Some((c, payload))) = wire::read_frame(&mut written) {
        if c != PLUGIN_CONN {
            continue;
        }
        conn.push(&payload);
        while let Ok(Some(msg)) = conn.next_message() {
            out.push((msg.stream, api::Response::decode(msg.body.as_slice()).ok()));
        }
    }
    out
}
