//! MPS control daemons: the control interface, the supervisor that runs one, the
//! hook-side `ensure` that finds or starts the daemon for an identity, and the reaper that
//! removes what a failed create left.

pub(crate) mod control;
pub(crate) mod ensure;
pub(crate) mod reaper;
pub mod reply;
pub(crate) mod supervisor;
