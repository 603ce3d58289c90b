//! The NRI validator's connection to the runtime: bytes as the runtime would send them,
//! through the real session (the same as the plugin's: frames, ttrpc messages, dispatch)
//! and the validator's answers (Configure, Synchronize, ValidateContainerAdjustment) over
//! memory. No panic, no hang, no unbounded allocation; a request is answered with success
//! at most once per stream id.
//!
//! The validator reads no file and starts nothing: what it answers comes from the
//! request and the config alone.
#![no_main]
use std::collections::HashSet;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;

fn node() -> &'static gpushare::config::Config {
    static NODE: OnceLock<gpushare::config::Config> = OnceLock::new();
    NODE.get_or_init(|| {
        gpushare::config::parse(
            "state-dir = \"/dev/null/gpushare\"\ninventory = \"file:/dev/null/inventory.json\"\n",
            None,
        )
        .expect("the fuzz target's config parses")
    })
}

fuzz_target!(|data: &[u8]| {
    let (answers, _end) = gpushare::nri_validator_converse(node(), data);
    let mut served = HashSet::new();
    for (stream, code) in answers {
        assert!(code != 0 || served.insert(stream), "stream {stream} served twice");
    }
});
