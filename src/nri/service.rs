//! Running one NRI process's `Service` (the plugin's or the validator's) on the runtime's
//! connection: dialling the runtime's socket again with backoff whenever the connection
//! ends, or serving the one connection a runtime launched it with (`Endpoint`), and saying
//! where it stands in its state file (`PluginState`: `<state-dir>/nri.json` for the plugin,
//! `nri-validator.json` for the validator), which `doctor` and `status` read.

use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use serde::{Deserialize, Serialize};

use super::session::{session, Connected, Service};
use crate::state::{ProcRef, StateDir};

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

    pub(super) fn write(&self, path: &Path) {
        let written = serde_json::to_vec(self)
            .map_err(std::io::Error::other)
            .and_then(|data| crate::fsops::write_atomic_with(path, &data, 0o644, false));
        if let Err(e) = written {
            tracing::warn!(path = %path.display(), error = %e, "NRI: could not write the process's state");
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

/// Serves `service` on the runtime's connection, saying where it stands at `state_path`
/// (`PluginState`): until the runtime that launched it goes away (`Endpoint::Launched`),
/// or for ever, dialling again with backoff whenever the connection ends.
pub(super) fn run_service<S: Service>(
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
