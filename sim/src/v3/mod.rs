//! MPS v3 (driver r615 and later), as NVIDIA's MPS guide documents it (docs.nvidia.com/deploy/mps,
//! "MPS v3 interface", "Namespaces", "Configuration file") and as NVIDIA's KAI
//! GPU-fractioning agent and NVIDIA Dynamo's GPU-sharing docs measured it on r615. None of it
//! has run against a driver here: every rule names its source where it is implemented.
//!
//! - `grammar`: the `<module> <verb> …` CLI, parsed into commands;
//! - `format`: CSV and table output;
//! - `layout`: the pipe directory's server and namespace sockets;
//! - `state`: servers, namespaces, attached clients and their listings;
//! - `listen`: the daemon's shared core and a socket's accept thread;
//! - `commands`: authorization and what each verb and a client attach do;
//! - `daemon`: the `-p 3` daemon process, its sockets and connections;
//! - `cli`: the CLI call's side.
//!
//! Not simulated: the TOML file (`-a`), `device`, `sm-partition`, `feature`, `memacct`,
//! `context-share`, `client get`, `server set --uid`/`--locality-domains`, r620's cgroup
//! routing.

pub mod cli;
pub mod commands;
pub mod daemon;
pub mod format;
pub mod grammar;
pub mod layout;
pub mod listen;
pub mod state;
