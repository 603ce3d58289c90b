//! The GPU inventory: which GPUs and MIG devices this node has, read from NVML or from a JSON
//! file (docs/inventory.md), and the resolution of a device request against it.
//!
//! Invariants:
//! - Everything here is plain data. Nothing edits a spec or talks to MPS; the only I/O is
//!   `load` (one file read, or NVML queries).
//! - An [`Inventory`] returned by `load` has passed `Inventory::validate`: at most
//!   `MAX_GPUS` GPUs, unique GPU indices, unique MIG indices per GPU, unique and well-formed
//!   `GPU-`/`MIG-` UUIDs, non-zero memory, a `major.minor` compute capability and MIG profile
//!   names that are safe to put in identifiers.
//! - `Inventory::resolve` never guesses: a request names exactly the devices it gets, in the
//!   order it names them, or the resolution fails with one line naming the request key, its
//!   value and what exists on this node.
//! - The device selectors ([`DeviceSelector`], [`DeviceRequest`]) live here, not in `request`,
//!   so that dependencies flow one way (`request` → `device`); `request` re-exports them and
//!   owns their parsing and validation.
//! - A GPU's `minor` is the minor number of its device node `/dev/nvidia<minor>` (NVML's
//!   `nvmlDeviceGetMinorNumber`). It is optional, so that inventory files written before it
//!   existed stay valid; when given, it is unique among the GPUs. Only a request for the
//!   devices a container was allocated through CDI-injected device nodes needs it
//!   (`Inventory::gpus_by_minor`): without it such a request is refused, nothing else is.
//!
//! Layout: the types (and the error) in `types`, which the other files take them from,
//! and this file re-exports with the entry points; `load` and `Inventory::validate` in
//! `inventory`; the NVML reader (and `mig_cap_minor`, which reads the driver's MIG
//! access-node numbers) in `nvml`, and which process runs it (this one, or `gpushare
//! nvml-inventory` for the static shim) in `reader`; `Inventory::resolve` and the
//! device-node mappings in `resolve`; the quoting of values and lists in error messages in
//! `quote`; the test inventory [`sample`] in `preset`.

mod inventory;
mod nvml;
mod preset;
mod quote;
mod reader;
mod resolve;
mod types;

pub use inventory::parse_file;
pub(crate) use inventory::{is_well_formed_uuid, load, load_nvml};
pub use preset::sample;
#[cfg(test)]
pub(crate) use preset::testing;
pub(crate) use quote::quote;
pub use reader::{read_nvml_in_process, LIBRARY_FLAG};
pub use types::{
    ComputeMode, DeviceError, DeviceKind, DeviceRequest, DeviceSelector, Gpu, Inventory,
    InventorySource, MigDevice, ResolvedDevices, NVML_SUBCOMMAND,
};

#[cfg(test)]
mod tests {
    use super::testing::{req, GPU1, MIG0};
    use super::*;

    #[test]
    fn source_parse() {
        let ok: &[(&str, InventorySource)] = &[
            ("nvml", InventorySource::Nvml),
            (
                "file:/etc/gpushare/inventory.json",
                InventorySource::File("/etc/gpushare/inventory.json".into()),
            ),
        ];
        for (text, want) in ok {
            assert_eq!(&InventorySource::parse(text).expect(text), want, "{text}");
            assert_eq!(&want.to_string(), text);
        }
        for bad in [
            "",
            "NVML",
            "nvml ",
            "file:",
            "file:relative.json",
            "file",
            "/abs.json",
            "file:/a\nb",
        ] {
            let msg = InventorySource::parse(bad).expect_err(bad).to_string();
            assert!(msg.starts_with("inventory=\""), "{msg}");
            assert!(msg.contains(&quote(bad)), "{msg}");
            assert!(
                msg.ends_with("allowed is nvml or file:<absolute path>"),
                "{msg}"
            );
            assert!(!msg.contains('\n'), "{msg}");
        }
    }

    #[test]
    fn selector_display() {
        use DeviceSelector::*;
        let cases: &[(DeviceRequest, &str)] = &[
            (req(&[Index(3)]), "3"),
            (req(&[MigIndex { gpu: 0, mig: 1 }]), "0:1"),
            (
                req(&[Index(0), GpuUuid(GPU1.into())]),
                "0,GPU-6a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9",
            ),
            (req(&[MigUuid(MIG0.into())]), MIG0),
        ];
        for (request, want) in cases {
            assert_eq!(&request.to_string(), want);
        }
    }

    #[test]
    fn serde_names() {
        let cases: &[(ComputeMode, &str)] = &[
            (ComputeMode::Default, "\"default\""),
            (ComputeMode::ExclusiveProcess, "\"exclusive_process\""),
            (ComputeMode::Prohibited, "\"prohibited\""),
        ];
        for (mode, want) in cases {
            assert_eq!(&serde_json::to_string(mode).expect("ser"), want);
        }
        assert_eq!(
            serde_json::to_string(&DeviceKind::Gpus).expect("ser"),
            "\"gpus\""
        );
        assert_eq!(
            serde_json::to_string(&DeviceKind::Mig).expect("ser"),
            "\"mig\""
        );
    }
}
