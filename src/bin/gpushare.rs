//! The `gpushare` command: hooks, status, daemons. See `gpushare::cli`.
fn main() {
    std::process::exit(gpushare::cli::main());
}
