//! The test inventory: one node, described in one file, that the unit tests, the integration
//! tests (`testkit/src/harness.rs` writes it as each test's inventory file), the fuzz
//! targets and `scripts/quickstart` all use.
//!
//! The file is the user-facing example, `docs/examples/inventory.json`, not a file under
//! `tests/fixtures/`: that way the example that the docs show, the package installs and
//! quickstart runs is the inventory every test resolves against, so it cannot drift from
//! what gpushare accepts, and the docs' transcripts (`MIG 1:0 1g.10gb`, the list of MIG
//! devices in an error) are the tests' too. `docs/inventory.md` shows the file verbatim
//! (checked below). It holds what the tests need, each shape once: a GPU without MIG, a GPU
//! in MIG mode with several MIG devices and their access-node minors, a second GPU without
//! MIG to list with the first, and GPU minor numbers that do not follow the indices.
//!
//! Invariant: [`PRESET_JSON`] is a valid inventory; [`sample`] is it, parsed.

use super::types::Inventory;

/// The preset, `docs/examples/inventory.json`, built into the library.
const PRESET_JSON: &str = include_str!("../../docs/examples/inventory.json");

/// The test inventory, public so that other modules' tests and the fuzz targets share it
/// (the integration tests, another crate, read the same file): GPU 0 an NVIDIA A30 (24 GiB,
/// no MIG); GPU 1 an A100 80GB in MIG mode with three `1g.10gb` MIG devices of 10 GiB
/// (indices 0–2; access nodes `nvidia-cap12`/`13`, `21`/`22`, `30`/`31`, as the driver's
/// mig-minors numbers GPU instances 1–3, compute instance 0, on GPU minor 0); GPU 2 a second
/// A100 80GB without MIG. Their device nodes are `/dev/nvidia2`, `/dev/nvidia0` and
/// `/dev/nvidia1`: minor numbers need not follow the index (the driver may probe the GPUs in
/// another order than NVML enumerates them). Not a description of any real machine.
pub fn sample() -> Inventory {
    // The text is built in and `preset_is_the_file_and_valid` parses it: this cannot fail in
    // a build whose unit tests pass.
    serde_json::from_str(PRESET_JSON).expect("docs/examples/inventory.json is an inventory")
}

/// Names of the preset's devices, and helpers, for unit tests.
#[cfg(test)]
pub(crate) mod testing {
    use super::super::{DeviceRequest, DeviceSelector, Gpu, Inventory};

    pub(crate) const GIB: u64 = 1 << 30;
    pub(crate) const KEY: &str = "gpushare.io/device";
    /// GPU 0, the A30 (minor 2).
    pub(crate) const GPU0: &str = "GPU-8f8bff94-112e-9541-43da-cfd453333404";
    /// GPU 1, the A100 in MIG mode (minor 0).
    pub(crate) const GPU1: &str = "GPU-6a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9";
    /// GPU 2, the A100 without MIG (minor 1).
    pub(crate) const GPU2: &str = "GPU-7b2c3d4e-5f60-4182-93a4-b5c6d7e8f901";
    /// MIG devices 1:0, 1:1 and 1:2.
    pub(crate) const MIG0: &str = "MIG-22f0c05f-5cf2-5ea2-8297-789695656dc0";
    pub(crate) const MIG1: &str = "MIG-33a1d16a-6d03-4fb3-a3a8-8a97a6767ed1";
    pub(crate) const MIG2: &str = "MIG-44b2e27b-7e14-40c4-b4b9-9ba8b7878fe2";

    pub(crate) fn req(sels: &[DeviceSelector]) -> DeviceRequest {
        DeviceRequest(sels.to_vec())
    }

    /// The preset with `n` GPUs, each GPU 2 under its own index and UUID.
    pub(crate) fn many_gpus(n: u32) -> Inventory {
        let mut many = super::sample();
        many.gpus = (0..n)
            .map(|i| Gpu {
                index: i,
                uuid: format!("GPU-{i:08x}"),
                ..super::sample().gpus[2].clone()
            })
            .collect();
        many
    }
}

#[cfg(test)]
mod tests {
    use super::testing::*;
    use super::*;

    #[test]
    fn preset_is_the_file_and_valid() {
        let inv = sample();
        inv.validate("preset").expect("the preset is valid");
        let uuids: Vec<&str> = inv.gpus.iter().map(|g| g.uuid.as_str()).collect();
        assert_eq!(uuids, [GPU0, GPU1, GPU2]);
        let migs: Vec<&str> = inv.gpus[1]
            .mig_devices
            .iter()
            .map(|m| m.uuid.as_str())
            .collect();
        assert_eq!(migs, [MIG0, MIG1, MIG2]);
        assert!(inv.gpus[0].mig_devices.is_empty() && inv.gpus[2].mig_devices.is_empty());
        // The docs show the file as it is.
        let doc = include_str!("../../docs/inventory.md");
        assert!(
            doc.contains(&format!("```json\n{}```", PRESET_JSON)),
            "docs/inventory.md does not show docs/examples/inventory.json verbatim"
        );
    }
}
