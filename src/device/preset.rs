//! The test inventory, [`sample`], and the names of its devices for unit tests.

use super::{ComputeMode, Gpu, Inventory, MigDevice};

/// Test data, public so that other modules' tests and the integration tests share it: one
/// NVIDIA A30 (GPU 0, 24 GiB, MIG enabled with four `1g.6gb` devices of 6 GiB, indices 0–3) and
/// one NVIDIA A100 80GB (GPU 1, 80 GiB, MIG disabled) and a second A30 (GPU 2, 24 GiB, MIG
/// disabled). GPU 0 and its MIG device 0 carry the UUIDs of DESIGN.md §6. Their device nodes
/// are `/dev/nvidia0`, `/dev/nvidia1` and `/dev/nvidia3` (minor numbers need not follow the
/// index). Not a description of any real machine.
pub fn sample() -> Inventory {
    const GIB: u64 = 1 << 30;
    let mig = |index: u32, uuid: &str| MigDevice {
        // MIG device i on GPU instance i + 1, compute instance 0, numbered as the driver's
        // mig-minors does on GPU minor 0 (`gpu0/gi1/access 12`, `gpu0/gi1/ci0/access 13`,
        // nine minors per GPU instance): 12/13, 21/22, 30/31, 39/40.
        gi_caps_minor: Some(12 + 9 * index),
        ci_caps_minor: Some(13 + 9 * index),
        index,
        uuid: uuid.to_owned(),
        profile: "1g.6gb".to_owned(),
        memory_bytes: 6 * GIB,
    };
    Inventory {
        driver_version: "580.159.04".to_owned(),
        gpus: vec![
            Gpu {
                index: 0,
                uuid: "GPU-8f8bff94-112e-9541-43da-cfd453333404".to_owned(),
                name: "NVIDIA A30".to_owned(),
                memory_bytes: 24 * GIB,
                compute_capability: "8.0".to_owned(),
                compute_mode: ComputeMode::Default,
                minor: Some(0),
                mig_devices: vec![
                    mig(0, "MIG-22f0c05f-5cf2-5ea2-8297-789695656dc0"),
                    mig(1, "MIG-3b5c1f7e-0d4a-5a0e-9c61-2f1e8d7b6a01"),
                    mig(2, "MIG-4c6d2a8f-1e5b-5b1f-8d72-3a2f9e8c7b12"),
                    mig(3, "MIG-5d7e3b9a-2f6c-5c2a-9e83-4b3a0f9d8c23"),
                ],
            },
            Gpu {
                index: 1,
                uuid: "GPU-a1b2c3d4-e5f6-4789-9abc-def012345678".to_owned(),
                name: "NVIDIA A100-SXM4-80GB".to_owned(),
                memory_bytes: 80 * GIB,
                compute_capability: "8.0".to_owned(),
                compute_mode: ComputeMode::ExclusiveProcess,
                minor: Some(1),
                mig_devices: Vec::new(),
            },
            Gpu {
                index: 2,
                uuid: "GPU-c0ffee00-1234-4abc-8def-0123456789ab".to_owned(),
                name: "NVIDIA A30".to_owned(),
                memory_bytes: 24 * GIB,
                compute_capability: "8.0".to_owned(),
                compute_mode: ComputeMode::Default,
                // Not 2: minor numbers need not follow NVML's enumeration order.
                minor: Some(3),
                mig_devices: Vec::new(),
            },
        ],
    }
}

/// Names of the preset's devices, and helpers, for the unit tests of `device`.
#[cfg(test)]
pub(crate) mod testing {
    use super::super::{DeviceRequest, DeviceSelector};

    pub const GIB: u64 = 1 << 30;
    pub const KEY: &str = "gpushare.io/device";
    pub const GPU0: &str = "GPU-8f8bff94-112e-9541-43da-cfd453333404";
    pub const GPU1: &str = "GPU-a1b2c3d4-e5f6-4789-9abc-def012345678";
    pub const GPU2: &str = "GPU-c0ffee00-1234-4abc-8def-0123456789ab";
    pub const MIG0: &str = "MIG-22f0c05f-5cf2-5ea2-8297-789695656dc0";
    pub const MIG2: &str = "MIG-4c6d2a8f-1e5b-5b1f-8d72-3a2f9e8c7b12";

    pub fn req(sels: &[DeviceSelector]) -> DeviceRequest {
        DeviceRequest(sels.to_vec())
    }
}
