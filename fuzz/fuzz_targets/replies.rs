//! The control daemon's replies (`get_server_list`, `get_client_list`, the `get_*` limit
//! read-backs) as status and the supervisor's limit check read them: no panic, and what
//! is read is in range.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The control client reads a reply as text (a reply that is not UTF-8 reads as empty).
    let Ok(reply) = std::str::from_utf8(data) else { return };
    let pids = gpushare::mps_reply::pids(reply);
    assert!(pids.len() <= reply.len());
    if let Some(p) = gpushare::mps_reply::percentage(reply) {
        assert!((0.0..=100.0).contains(&p));
    }
    if let Some(bytes) = gpushare::mps_reply::pinned_mem(reply) {
        assert_eq!(bytes % (1 << 20), 0);
    }
});
