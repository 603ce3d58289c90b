//! The v3 daemon's shared core ([`Core`]: its paths, its log and the one state mutex), the
//! socket a connection came in on ([`Route`]), and a socket's accept thread, one thread per
//! connection, each served by [`Core::serve`] (the daemon's connection handler, set at
//! startup). Below both the commands (`server create` and a namespace's creation bind
//! sockets here) and the daemon (the connection loop runs the commands).
//!
//! Invariant: each socket has its own connection cap, so a tenant flooding its own
//! namespace socket takes no slot of the main socket or of another namespace.

use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::daemon::serve_each;
use crate::log::ControlLog;

use super::layout;
use super::state::{Listening, State};

const MAX_LEAF_CONNECTIONS: usize = 64;

/// Which socket a connection came in on, which decides where a CUDA client lands
/// (NVIDIA's MPS v3 "Namespaces" page).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// `<pipe>/control`: a client goes to its uid's `uid_<uid>` server.
    Top,
    /// `<pipe>/<server>/control`: the server's `default` namespace.
    Server(String),
    /// `<pipe>/<server>/<ns>/control`.
    Namespace(String, String),
}

pub struct Core {
    pub log: ControlLog,
    pub log_dir: PathBuf,
    pub pipe: PathBuf,
    pub exe: PathBuf,
    pub uid: u32,
    pub multiuser: bool,
    pub top_socket: PathBuf,
    pub pid_file: PathBuf,
    /// Serves one accepted connection (the daemon's handler).
    pub serve: fn(&Arc<Core>, UnixStream, &Route),
    /// Only through [`Core::lock`].
    pub(super) state: Mutex<State>,
}

impl Core {
    pub fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Binds `<dir>/control` and starts its accept thread.
pub fn listen(
    core: &Arc<Core>,
    dir: &Path,
    route: Route,
) -> Result<Listening, layout::LayoutError> {
    let listener = Arc::new(layout::bind_in(dir)?);
    let closed = Arc::new(AtomicBool::new(false));
    let listening = Listening {
        path: layout::socket_in(dir),
        listener: Arc::clone(&listener),
        closed: Arc::clone(&closed),
    };
    let thread_core = Arc::clone(core);
    let spawned = std::thread::Builder::new()
        .name("accept".to_string())
        .spawn(move || {
            accept_loop(
                &thread_core,
                &listener,
                &closed,
                &route,
                MAX_LEAF_CONNECTIONS,
            )
        });
    if let Err(e) = spawned {
        listening.close();
        return Err(layout::LayoutError::Io {
            what: "start the accept thread of",
            path: listening.path.clone(),
            source: e,
        });
    }
    Ok(listening)
}

pub(super) fn accept_loop(
    core: &Arc<Core>,
    listener: &Arc<UnixListener>,
    closed: &Arc<AtomicBool>,
    route: &Route,
    max: usize,
) {
    let (conn_core, route) = (Arc::clone(core), route.clone());
    serve_each(listener, &core.log, max, Some(closed), move |stream| {
        (conn_core.serve)(&conn_core, stream, &route)
    });
}
