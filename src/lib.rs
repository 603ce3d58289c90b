//! gpushare: an MPS-aware OCI runtime shim and hook that lets containers of different
//! users share one NVIDIA GPU (or MIG slice) without blocking each other.
//!
//! Module map (dependencies flow downwards):
//! - `cli` (the `gpushare` command), `runtime` (the `gpushare-runtime` shim)
//! - `hook` (createRuntime / poststop)
//! - `mps` (control interface, supervisor, ensure)
//! - `spec` (config.json load/edit/save), `state` (the state directory)
//! - `request` (annotations/env → request), `inventory_cache`, `device` (inventory),
//!   `identity`, `config`
//! - `util`, `sys` (the only `unsafe`), `logging`

// `unsafe` is refused everywhere but in `sys`, the one audited module, where every block
// carries a `// SAFETY:` comment.
#![deny(unsafe_code)]

/// `<crate version> (commit <git commit>)`, for `--version`.
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("GPUSHARE_GIT_COMMIT"),
    ")"
);

pub mod cli;
pub mod config;
pub mod decision;
pub mod device;
pub mod doctor;
pub mod hook;
pub mod hookonly;
pub mod identity;
pub mod install;
pub mod inventory_cache;
pub mod logging;
pub mod mps;
pub mod request;
pub mod runtime;
pub mod spec;
pub mod state;
pub mod status;
#[allow(unsafe_code)]
pub mod sys;
pub mod util;
