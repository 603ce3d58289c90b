//! MPS control daemons: the control interface, the supervisor that runs one, the
//! hook-side `ensure` that finds or starts the daemon for an identity, and the reaper that
//! removes what a failed create left; the one command that starts those two (`job`), how
//! a hook has them started (`launch`), and the node's agent that starts them outside every
//! engine's process tree (`agent`); a v3 daemon's namespaces, one per container (`v3`).
//! Inside: `launch` asks `agent`, both use `job`.

pub(crate) mod agent;
pub(crate) mod control;
pub(crate) mod ensure;
pub(crate) mod job;
pub(crate) mod launch;
pub(crate) mod reaper;
pub mod reply;
pub(crate) mod supervisor;
pub(crate) mod v3;
