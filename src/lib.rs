//! gpushare: an MPS-aware OCI runtime shim and hook that lets containers of different
//! users share one NVIDIA GPU (or MIG slice) without blocking each other.
//!
//! The modules and the layers they keep (a module uses only those listed below its own
//! line) are ARCHITECTURE.md's module map, which a test checks against every `crate::`
//! path.

// `unsafe` is refused everywhere but in `sys`, the one audited module, where every block
// carries a `// SAFETY:` comment.
#![deny(unsafe_code)]
// The public surface is what the two binaries, the fuzz targets and the integration tests
// use (the modules declared `pub` below, and in them only those items); everything else is
// `pub(crate)`, so the compiler reports code nothing uses. `unreachable_pub` keeps it so: a
// `pub` that nothing outside can reach is a warning (an error under `-D warnings`).
#![warn(unreachable_pub)]

pub mod bundle;
mod cdi;
pub mod cli;
pub mod config;
pub mod decision;
pub mod device;
pub mod driver;
mod engine;
mod fsops;
pub mod hook;
mod hookonly;
pub mod identity;
mod inventory_cache;
mod logging;
mod lowlevel;
mod mps;
mod nri;
mod ops;
pub mod request;
mod rootfs;
pub mod runtime;
pub mod served;
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
