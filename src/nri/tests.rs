//! The NRI session's tests over a socket pair, as the runtime: registration,
//! configuration, multi-part synchronize, create, close, and what a peer's bytes cannot do.

use super::session::{
    serve, Connected, InFlight, CODE_INVALID_ARGUMENT, CODE_RESOURCE_EXHAUSTED, CODE_UNIMPLEMENTED,
    CODE_UNKNOWN, MAX_IN_FLIGHT, PLUGIN_SERVICE, RUNTIME_SERVICE,
};
use super::wire::{RUNTIME_CONN, TYPE_REQUEST, TYPE_RESPONSE};
use super::*;
use std::collections::HashMap;
use std::os::unix::net::UnixStream;
use std::path::Path;

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
    check_seed("nri", &input);
}

/// The seed the fuzz target `target` starts from is this conversation (written afresh
/// with GPUSHARE_WRITE_SEEDS=1 when the conversation changes).
pub(super) fn check_seed(target: &str, input: &[u8]) {
    let seed = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/seeds")
        .join(target)
        .join("conversation");
    if std::env::var_os("GPUSHARE_WRITE_SEEDS").is_some() {
        std::fs::create_dir_all(seed.parent().unwrap()).unwrap();
        std::fs::write(&seed, input).unwrap();
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
    fn close(self, session: std::thread::JoinHandle<anyhow::Result<bool>>) -> Result<bool, String> {
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
        // NRI's events 4, 5, 6, 10 and 11 (CreateContainer, PostCreateContainer,
        // StartContainer, StopContainer, RemoveContainer), bit `event - 1` each.
        api::ConfigureResponse {
            events: 0b110_0011_1000,
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
        _configured: &Configured,
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
    let rec =
        crate::state::ContainerRecord::new("never".into(), None, None, Some(plugin::ENGINE.into()));
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
    // A session that registers and sends one part of a Synchronize.
    let synchronizing = |ids: &[&str], more: bool| {
        let (mut rt, session) = Runtime::start(&plugin, &configured);
        rt.register();
        assert_eq!(
            rt.call(1, "Synchronize", &sync_part(ids, more)).status,
            None
        );
        (rt, session)
    };
    // The first session: the first part of a Synchronize, then the runtime goes away
    // (a restart). Its part is left in the plugin's list.
    let (rt, session) = synchronizing(&["stale"], true);
    assert_eq!(rt.close(session), Ok(true));
    assert_eq!(plugin.sync.lock().unwrap().len(), 1);
    // The restarted runtime no longer has `stale`: its whole list is `fresh`, so the
    // record of `stale` goes. Had the first session's part been kept, the list would
    // name `stale` too and its record would stay, keeping its daemon alive.
    let (rt, session) = synchronizing(&["fresh"], false);
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
