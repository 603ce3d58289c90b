//! The configuration file: no panic; an accepted config has absolute paths.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(cfg) = gpushare::config::parse(text, None) {
        assert!(cfg.state_dir.is_absolute());
        assert!(cfg.mps.container_pipe_dir.is_absolute());
    }
});
