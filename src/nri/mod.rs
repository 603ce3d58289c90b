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
//! `Synchronize` (every pod and container it has: `Plugin::synchronize`, in `records`), and the
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
//!
//! One file per job: running the plugin (its threads, its answers to the runtime's methods,
//! the session over bytes in memory) here; `service` (a process's connection's life and
//! its state file) and `session` (the session on a connection), for the plugin and the
//! validator alike; `wire` and `api` (the framing and the messages), `plugin` (its state
//! and the answer to `CreateContainer`), `records` (the container records it writes,
//! reconciled at `Synchronize`), `audit` (the audit and eviction of unserved containers),
//! `container` (what it reads of a container: the spec view, whether it serves it, whether
//! it carries the adjustment), `validator`, `tests`.

pub(crate) mod api;
mod audit;
mod container;
pub(crate) mod plugin;
mod records;
mod service;
mod session;
#[cfg(test)]
mod tests;
pub(crate) mod validator;
pub(crate) mod wire;

use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use prost::Message;

use crate::config::Config;
use crate::state::StateDir;
use api::event;
use plugin::Plugin;
use service::run_service;
pub(crate) use service::{Endpoint, PluginState};
use session::{quoted, serve, Configured, InFlight, Service};
use wire::PLUGIN_CONN;

/// NRI's default socket.
pub(crate) const DEFAULT_SOCKET: &str = "/var/run/nri/nri.sock";
/// The name and index the plugin registers under (plugins are called in index order).
pub(crate) const DEFAULT_NAME: &str = "gpushare";
pub(crate) const DEFAULT_INDEX: &str = "10";

/// The containers one `Synchronize` may deliver over its parts (`more`), as protobuf.
const MAX_SYNC_BYTES: usize = 64 << 20;
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

fn handle(
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
fn answers(written: &[u8]) -> Vec<(u32, i32)> {
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
