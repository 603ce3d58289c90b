//! The NRI plugin's connection to the runtime: bytes as the runtime would send them, through
//! the real session (the multiplexer's frames, ttrpc's messages, the dispatch, protobuf
//! decoding and each method's handler) over memory. No panic, no hang, no unbounded
//! allocation; a request is answered with success at most once per stream id.
//!
//! The node it serves has an inventory that cannot load and a state directory that cannot
//! exist (under /dev/null): a request gets as far as the inventory, and no input makes the
//! target start a daemon or write a file.
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
    let (answers, _end) = gpushare::nri_converse(node(), data);
    let mut served = HashSet::new();
    for (stream, code) in answers {
        assert!(code != 0 || served.insert(stream), "stream {stream} served twice");
    }
});
