//! The operator commands behind `gpushare`, one module each: what `daemon start` and
//! `daemon stop`, `gc`, `doctor`, `status`, `install` and `uninstall` do, on plain
//! arguments. `cli` parses the command line, calls one of these, and maps its result to
//! the exit code.
//!
//! Invariants: nothing here reads argv or exits; what the operator asked for is reported
//! on stdout, and a failure is returned (one `anyhow` chain, which `cli` prints as one
//! `gpushare: …` line) — except where a command goes on past it: `gc` prints one line on
//! stderr per thing it could not clean and returns how many there were, and `doctor`
//! returns every check, its worst result being the exit code. No command here is used by
//! the modules below `ops`; among them, `doctor` asks `status` and `install`.

pub(crate) mod daemon;
pub(crate) mod doctor;
pub(crate) mod gc;
pub(crate) mod install;
pub(crate) mod status;
