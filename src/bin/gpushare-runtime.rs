//! The OCI runtime shim: takes runc's argv exactly. See `gpushare::runtime`.
#![forbid(unsafe_code)]
fn main() {
    std::process::exit(gpushare::runtime::main(std::env::args_os().collect()));
}
