//! MPS control daemons: the control interface, the supervisor that runs one, and the
//! hook-side `ensure` that finds or starts the daemon for an identity.

pub mod control;
pub mod ensure;
pub mod supervisor;
