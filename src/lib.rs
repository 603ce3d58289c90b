//! gpushare: an MPS-aware OCI runtime shim and hook that lets containers of different
//! users share one NVIDIA GPU (or MIG slice) without blocking each other.
//!
//! Module map: a module uses only the modules on the lines below its own, never those
//! beside or above it.
//! - `cli` (the `gpushare` command: arguments, dispatch, exit codes)
//! - `ops` (the operator commands: daemon start/stop, gc, doctor, status, install and
//!   uninstall with each engine's installer)
//! - `cdi` (the CDI spec of the node's devices, `gpushare cdi generate`)
//! - `nri` (`gpushare nri`: the NRI plugin, its connection and its events;
//!   `gpushare nri-validate`: the validator that checks the plugin's adjustments)
//! - `watch` (`gpushare watch`: the GPU process watcher, its scan, its rules, its report)
//! - `runtime` (the `gpushare-runtime` shim), `hookonly` (hooks.d mode)
//! - `hook` (createRuntime / poststop)
//! - `decision` (the request pipeline; the shim↔hook contract), `mps` (control interface,
//!   supervisor, ensure, the reaper of a failed create's directories)
//! - `mounts` (what a container gets from its daemon: the pipe and log directories, the
//!   shm; planned once, rendered as spec edits, an NRI adjustment or hook-only binds)
//! - `spec` (config.json load/edit/save), `rootfs` (what the image holds where gpushare
//!   mounts), `state` (the state directory: layout, records,
//!   locks, a daemon's directories and tmpfs, the caps and what they take back, removal),
//!   `inventory_cache`
//! - `identity` (a daemon's identity and the rule that derives it), `logging`
//! - `userns` (user namespace id maps: container → host id)
//! - `config`
//! - `request` (annotations/env, or a CDI device's hook arguments → request)
//! - `device` (inventory: load and validate, NVML, resolve; the test inventory)
//! - `driver` (the NVIDIA driver's files, on the host or under `driver-root`)
//! - `fsops` (safe file I/O: reads and atomic writes that follow no planted name, tree
//!   removal), `util`, `sys` (the only `unsafe`)

// `unsafe` is refused everywhere but in `sys`, the one audited module, where every block
// carries a `// SAFETY:` comment.
#![deny(unsafe_code)]
// The public surface is what the two binaries, the fuzz targets and the integration tests
// use (the modules declared `pub` below, and in them only those items); everything else is
// `pub(crate)`, so the compiler reports code nothing uses. `unreachable_pub` keeps it so: a
// `pub` that nothing outside can reach is a warning (an error under `-D warnings`).
#![warn(unreachable_pub)]

/// `<crate version> (commit <git commit>)`, for `--version`.
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("GPUSHARE_GIT_COMMIT"),
    ")"
);

mod cdi;
pub mod cli;
pub mod config;
pub mod decision;
pub mod device;
pub mod driver;
mod fsops;
pub mod hook;
mod hookonly;
pub mod identity;
mod inventory_cache;
mod logging;
pub mod mounts;
mod mps;
mod nri;
mod ops;
pub mod request;
mod rootfs;
pub mod runtime;
pub mod spec;
pub mod state;
#[allow(unsafe_code)]
mod sys;
pub(crate) mod userns;
pub mod util;
mod watch;

/// The control daemon's replies as gpushare reads them: public for the fuzz target
/// `replies`, the rest of `mps` stays inside the crate.
pub use mps::reply as mps_reply;
/// The NRI plugin's session over bytes in memory: public for the fuzz target `nri`.
pub use nri::converse as nri_converse;
/// The NRI validator's session over bytes in memory: public for the fuzz target
/// `nri_validate`.
pub use nri::converse_validator as nri_validator_converse;
