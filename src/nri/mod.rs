//! `gpushare nri`: gpushare as an NRI (Node Resource Interface) plugin, one long-running
//! process per node that containerd (≥ 1.7) and CRI-O call at each container's creation,
//! so that every CRI pod with a request gets its share whatever its RuntimeClass, with no
//! shim and no hook process.
//!
//! The connection: the plugin dials the runtime's NRI socket (or, launched by the runtime
//! from its plugin directory, uses the socket it was handed in `NRI_PLUGIN_SOCKET`), splits
//! it into NRI's two logical connections (`wire`), serves the plugin service on one and
//! calls `RegisterPlugin` on the other; the runtime then calls `Configure` (the plugin
//! subscribes to CreateContainer, PostCreateContainer, StopContainer, RemoveContainer),
//! `Synchronize` (every pod and container it has: `plugin::Plugin::synchronize`), and the
//! events. Each request is answered on a thread of its own, so a slow daemon start does
//! not hold up another container's events. When the runtime goes away (a restart), the
//! plugin dials again with backoff; a plugin the runtime launched exits instead (the
//! runtime launches it again).
//!
//! NRI fails open unless told otherwise: while no plugin is connected, the runtime creates
//! containers without it, so a pod with a request then runs unserved, unless NRI's default
//! validator requires the plugin (node-wide or per pod: docs/kubernetes.md). The plugin
//! answers within a budget, so that the runtime never drops it for a late answer
//! (`plugin`), and dials again whenever the connection ends. It says where it stands in
//! `<state-dir>/nri.json` (`PluginState`: its pid, whether it is registered with a runtime,
//! which one, since when), which `doctor` and `status` read.

pub(crate) mod api;
pub(crate) mod plugin;
pub(crate) mod wire;

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
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
const CODE_UNIMPLEMENTED: i32 = 12;

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
}

impl PluginState {
    /// Reads the plugin's state; `None` when no plugin ever ran here.
    pub(crate) fn read(dirs: &StateDir) -> Option<PluginState> {
        let bytes = crate::fsops::read_regular(&dirs.nri_state_path(), 64 << 10).ok()?;
        serde_json::from_slice(&bytes).ok()
    }

    /// Whether the plugin that wrote this still runs and is connected.
    pub(crate) fn live_and_connected(&self) -> bool {
        self.connected && self.process.is_some_and(|p| p.alive())
    }

    fn write(&self, dirs: &StateDir) {
        let path = dirs.nri_state_path();
        let written = serde_json::to_vec(self)
            .map_err(std::io::Error::other)
            .and_then(|data| crate::fsops::write_atomic_with(&path, &data, 0o644, false));
        if let Err(e) = written {
            tracing::warn!(path = %path.display(), error = %e, "NRI: could not write the plugin's state");
        }
    }
}

/// How the plugin reaches its runtime.
pub(crate) enum Endpoint {
    /// Dial this socket, again whenever the connection ends.
    Socket(PathBuf),
    /// The connection the runtime handed a plugin it launched (`NRI_PLUGIN_SOCKET`).
    Launched(UnixStream),
}

/// Runs the plugin until the runtime that launched it goes away (`Endpoint::Launched`),
/// or for ever (`Endpoint::Socket`), registering as `name` with `index`.
pub(crate) fn run(cfg: &Config, endpoint: Endpoint, name: &str, index: &str) -> anyhow::Result<()> {
    let dirs = StateDir::new(&cfg.state_dir);
    dirs.ensure_root()?;
    let plugin = Arc::new(Plugin::new(cfg.clone()));
    let me = ProcRef::of(std::process::id() as i32);
    let state =
        move |socket: &Path, connected: bool, runtime: Option<String>, error: Option<String>| {
            PluginState {
                process: me,
                socket: socket.to_owned(),
                connected,
                runtime,
                since: crate::util::unix_now(),
                error,
            }
            .write(&dirs)
        };
    let state = Arc::new(state);
    // What a session says once the runtime has configured the plugin (from the thread
    // that answered Configure).
    let on_configured = |socket: PathBuf| -> Connected {
        let state = Arc::clone(&state);
        Arc::new(move |runtime: String| state(&socket, true, Some(runtime), None))
    };
    let reaper = Arc::clone(&plugin);
    std::thread::spawn(move || reap_children(&reaper));
    match endpoint {
        Endpoint::Launched(stream) => {
            let socket = PathBuf::from("(the connection the runtime launched the plugin with)");
            let end = session(&plugin, stream, name, index, on_configured(socket.clone()));
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
                        session(&plugin, stream, name, index, on_configured(socket.clone()))
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
                    tracing::warn!(error = %why, "NRI: not connected; trying again with backoff");
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

/// Called once the runtime has configured the plugin, with the runtime's name and version.
type Connected = Arc<dyn Fn(String) + Send + Sync>;

/// The write half of a connection, shared by the threads that answer.
struct Sender {
    stream: Mutex<UnixStream>,
    next_stream: AtomicU32,
}

impl Sender {
    fn send(&self, conn: u32, stream: u32, typ: u8, body: &[u8]) -> anyhow::Result<()> {
        let msg = wire::ttrpc_message(stream, typ, body);
        let mut s = self
            .stream
            .lock()
            .map_err(|_| anyhow::anyhow!("the connection's writer is poisoned"))?;
        wire::write_frame(&mut *s, conn, &msg)?;
        s.flush().context("flush the runtime's connection")?;
        Ok(())
    }
}

/// One connection to the runtime, until it ends. `Ok(true)` when the plugin had
/// registered and the runtime then closed the connection; `Ok(false)` when it closed it
/// before that. `connected` runs once the runtime has configured the plugin.
fn session(
    plugin: &Arc<Plugin>,
    stream: UnixStream,
    name: &str,
    index: &str,
    connected: Connected,
) -> anyhow::Result<bool> {
    let mut reader = stream
        .try_clone()
        .context("clone the runtime's connection")?;
    let sender = Arc::new(Sender {
        stream: Mutex::new(stream),
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
    loop {
        let Some((conn, payload)) = wire::read_frame(&mut reader)? else {
            return Ok(registered);
        };
        match conn {
            PLUGIN_CONN => {
                plugin_conn.push(&payload);
                while let Some(msg) = plugin_conn.next_message()? {
                    if msg.typ != TYPE_REQUEST {
                        continue;
                    }
                    let (plugin, sender, connected) = (
                        Arc::clone(plugin),
                        Arc::clone(&sender),
                        Arc::clone(&connected),
                    );
                    std::thread::spawn(move || {
                        let response = answer(&plugin, &msg.body, &*connected);
                        if let Err(e) = sender.send(
                            PLUGIN_CONN,
                            msg.stream,
                            TYPE_RESPONSE,
                            &response.encode_to_vec(),
                        ) {
                            tracing::warn!(error = %format!("{e:#}"), "NRI: could not answer the runtime");
                        }
                    });
                }
            }
            RUNTIME_CONN => {
                runtime_conn.push(&payload);
                while let Some(msg) = runtime_conn.next_message()? {
                    if msg.typ != TYPE_RESPONSE || msg.stream != register_stream {
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
fn answer(
    plugin: &Plugin,
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
            return fail(
                CODE_UNKNOWN,
                format!("gpushare: decode the runtime's request: {e}"),
            )
        }
    };
    if req.service != PLUGIN_SERVICE {
        return fail(
            CODE_UNIMPLEMENTED,
            format!("gpushare: no service {}", crate::util::escape(&req.service)),
        );
    }
    match handle(plugin, &req.method, &req.payload, configured) {
        Ok(payload) => api::Response {
            status: None,
            payload,
        },
        Err(e) => {
            let line = format!("gpushare: {e:#}");
            tracing::error!(method = %req.method, "{line}");
            fail(CODE_UNKNOWN, line)
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
                crate::util::escape(&req.runtime_name),
                crate::util::escape(&req.runtime_version)
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
            so_far.extend(req.containers);
            if !req.more {
                let all = std::mem::take(&mut *so_far);
                drop(so_far);
                plugin.synchronize(&all);
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
        "PostCreateContainer" => {
            plugin.created(&event()?.container.unwrap_or_default());
            Vec::new()
        }
        "StopContainer" | "RemoveContainer" => {
            plugin.release(&event()?.container.unwrap_or_default());
            Vec::new()
        }
        // Shutdown, StateChange and the events the plugin did not subscribe to: nothing to
        // do, an empty answer.
        _ => Vec::new(),
    })
}
