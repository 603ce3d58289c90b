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
//! One file per job: running the plugin (the connection's life, its state file) here;
//! `session` (the session on a connection, for the plugin and the validator alike), `wire`
//! and `api` (the framing and the messages), `plugin` (its state and the answer to
//! `CreateContainer`), `records` (the container records it writes, reconciled at
//! `Synchronize`), `audit` (the audit and eviction of unserved containers), `container`
//! (what it reads of a container: the spec view, whether it serves it, whether it carries
//! the adjustment), `validator`, `tests`.

pub(crate) mod api;
mod audit;
mod container;
pub(crate) mod plugin;
mod records;
mod session;
#[cfg(test)]
mod tests;
pub(crate) mod validator;
pub(crate) mod wire;

use session::*;
pub use session::{converse, converse_validator};

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
