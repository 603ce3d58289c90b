//! config.json load -> edit -> save: no panic on any input; bytes the shim's scan passes
//! over hold no request (with `default-device = "allocated"`, nor an allocation); for an
//! accepted spec the edit chain applies, applying it twice changes nothing, and the result
//! loads again.
#![no_main]
use std::path::Path;

use gpushare::served::{Inside, MountPlan};
use gpushare::request::IpcMode;
use gpushare::bundle::edits::{apply_all, plan, ContainerPlan, SetHooks};
use gpushare::state::StateDir;
use gpushare::bundle::{RawSpec, SpecFile};
use libfuzzer_sys::fuzz_target;

fn decision(host: bool) -> ContainerPlan {
    ContainerPlan {
        env: vec![("CUDA_MPS_PIPE_DIRECTORY".into(), "/tmp/nvidia-mps".into())],
        mounts: MountPlan::new(
            &StateDir::new("/run/gpushare"),
            "0123456789abcdef0123456789abcdef",
            Inside { pipe: "/tmp/nvidia-mps".into(), log: None },
            if host { IpcMode::Host } else { IpcMode::Isolated },
        )
        .spec_edits(),
        hooks: SetHooks {
            binary: "/usr/local/bin/gpushare".into(),
            env: vec!["PATH=/usr/bin:/bin".into()],
            stages: vec![("createRuntime", "create-runtime", 15), ("poststop", "poststop", 10)],
        },
        annotations: vec![("gpushare.io/daemon".into(), "0123456789abcdef0123456789abcdef".into())],
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(mut spec) = SpecFile::from_bytes(Path::new("config.json"), data) else { return };
    // The shim's fast path: bytes that cannot spell a request hold none.
    let raw = RawSpec { path: "config.json".into(), mode: 0o644, bytes: data.to_vec() };
    let parse = |default_device| {
        let opts = gpushare::request::Options {
            accept_env: true,
            default_device,
            accept_visible_devices_env: true,
        };
        gpushare::request::parse(&spec.request_inputs(), &opts)
    };
    if !raw.may_request() {
        assert!(matches!(parse(None), Ok(None)), "a request the byte scan missed");
        if !raw.may_hold_allocation() {
            let with_default = parse(Some(gpushare::request::DefaultDevice::Allocated));
            assert!(matches!(with_default, Ok(None)), "an allocation the byte scan missed");
        }
    }
    // The strict typed check is not on the create path; an edit must keep it passing.
    let typed_ok = spec.check_typed().is_ok();
    let _ = spec.host_user();
    let _ = spec.env();
    let edits = plan(decision(data.len() % 2 == 0));
    if apply_all(&mut spec.doc, &edits).is_err() {
        return;
    }
    let once = spec.doc.clone();
    apply_all(&mut spec.doc, &edits).expect("a chain that applied once applies again");
    assert_eq!(once, spec.doc, "applying twice changes nothing");
    let bytes = spec.to_bytes().expect("an edited spec serialises");
    let again = SpecFile::from_bytes(Path::new("config.json"), &bytes).expect("an edited spec is still a spec");
    if typed_ok {
        again.check_typed().expect("an edited valid spec is still a valid spec");
    }
});
