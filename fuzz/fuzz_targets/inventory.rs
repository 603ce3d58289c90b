//! The inventory file (`inventory = "file:…"`, written by an operator or a provisioning
//! tool): no panic, every error renders as one line, and an accepted inventory has
//! well-formed GPUs and serialises back to an inventory that is accepted again, unchanged.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let path = std::path::Path::new("/etc/gpushare/inventory.json");
    match gpushare::device::parse_file(path, text) {
        Ok(inv) => {
            for gpu in &inv.gpus {
                assert!(gpu.uuid.starts_with("GPU-"));
            }
            let again = serde_json::to_string(&inv).unwrap();
            assert_eq!(gpushare::device::parse_file(path, &again).unwrap(), inv);
        }
        Err(e) => assert!(!e.to_string().contains('\n'), "{e}"),
    }
});
