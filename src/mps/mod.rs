//! MPS control daemons: the control interface, the supervisor that runs one, and the
//! hook-side `ensure` that finds or starts the daemon for an identity.

pub(crate) mod control;
pub(crate) mod ensure;
pub mod reply;
pub(crate) mod supervisor;
