//! The OCI runtime shim: takes runc's argv exactly. See `gpushare::runtime`.
//!
//! The entry point is C's `main`, not Rust's: std's start-up work (probing the stack guard
//! through /proc/self/maps, an alternate signal stack, ignoring SIGPIPE) is a measurable
//! share of a process that only reads one config key and execs runc, and none of it is
//! needed here — the shim writes only to regular files, and SIGPIPE must reach runc at its
//! default anyway. std itself works as usual (it takes argv from glibc's init hooks).
#![deny(unsafe_code)]
#![no_main]

/// The process entry point glibc calls.
#[allow(unsafe_code)] // an exported symbol: its only risk is a clash, and `main` is ours
#[no_mangle]
pub extern "C" fn main(_argc: i32, _argv: *const *const u8) -> i32 {
    gpushare::runtime::main(std::env::args_os().collect())
}
