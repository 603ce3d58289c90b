//! The request parser and the size/device/percentage parsers: lines `KEY=VALUE` become
//! annotations (keys with '/') and env entries; the second byte's low bit turns on
//! `default-device = "allocated"`. No panic; every error is one line; an accepted request
//! resolves or fails cleanly against a sample inventory.
#![no_main]
use std::collections::HashMap;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let accept_env = data.first().is_some_and(|b| b & 1 == 1);
    let mut ann = HashMap::new();
    let mut env = Vec::new();
    for line in text.split('\n') {
        if let Some((k, v)) = line.split_once('=') {
            if k.contains('/') {
                ann.insert(k.to_owned(), v.to_owned());
            } else {
                env.push(line.to_owned());
            }
        }
    }
    let inputs = gpushare::request::Inputs {
        annotations: Some(&ann),
        env: &env,
        ..Default::default()
    };
    let opts = gpushare::request::Options {
        accept_env,
        default_device: data
            .get(1)
            .is_some_and(|b| b & 1 == 1)
            .then_some(gpushare::request::DefaultDevice::Allocated),
        accept_visible_devices_env: data.get(1).is_some_and(|b| b & 2 == 2),
    };
    match gpushare::request::parse(&inputs, &opts) {
        Ok(Some(req)) => {
            let inv = gpushare::device::sample();
            if let Ok(devices) = req.device.resolve(&inv) {
                let _ = gpushare::request::check_against(&req, &devices);
            }
        }
        Ok(None) => {}
        Err(e) => {
            // The whole chain, as the shim prints it.
            let mut err: Option<&dyn std::error::Error> = Some(&e);
            while let Some(e) = err {
                assert!(!e.to_string().contains('\n'));
                err = e.source();
            }
        }
    }
    if let Err(e) = gpushare::request::parse_size("k", &text) {
        assert!(!e.to_string().contains('\n'));
    }
    if let Err(e) = gpushare::request::parse_percentage("k", &text) {
        assert!(!e.to_string().contains('\n'));
    }
    if let Ok(d) = gpushare::request::parse_device("k", &text) {
        assert!(!d.0.is_empty() && d.0.len() <= gpushare::request::MAX_DEVICES);
    }
});
