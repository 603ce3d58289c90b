//! What the hook and the supervisor read back: daemon and container records, the hook's
//! state on stdin and the decision annotations in it. No panic; an accepted identity is
//! well formed.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(rec) = serde_json::from_slice::<gpushare::state::DaemonRecord>(data) {
        let _ = rec.identity.id();
    }
    let _ = serde_json::from_slice::<gpushare::state::ContainerRecord>(data);
    if let Ok(state) = gpushare::hook::read_state(data) {
        assert!(gpushare::state::valid_container_id(&state.id));
        if let Ok(ident) = gpushare::decision::identity_from_annotations(&state.annotations) {
            assert!(gpushare::identity::valid_id(&ident.id()));
            assert!(!ident.devices.is_empty());
        }
    }
});
