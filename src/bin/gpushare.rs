//! The `gpushare` command: hooks, status, daemons. See `gpushare::cli`.
#![forbid(unsafe_code)]
fn main() {
    std::process::exit(gpushare::cli::main());
}
