//! What a served container gets, whichever entry path serves it (the shim, hook-only
//! mode, the NRI plugin, a CDI device through either hook): the daemon's directories
//! planned once as a `MountPlan` (`mounts`), the MPS client environment and the
//! environment of gpushare's hooks on it (`env`), and the IPC mode of a container whose
//! spec the engine made (`ipc`). Each entry path resolves a request, ensures its daemon,
//! plans with this module and renders the plan its own way (spec edits, an NRI
//! adjustment, binds a hook makes); no entry path takes any of these from another.

mod env;
mod ipc;
pub mod mounts;

pub(crate) use env::{client_env, hook_env, NVIDIA_HOST_PIPE_DIR};
pub(crate) use ipc::engine_ipc;
pub use mounts::{Bind, Inside, MountPlan};

/// The plans every entry path's tests render (`mounts::tests::every_plan`).
#[cfg(test)]
pub(crate) use mounts::tests;
