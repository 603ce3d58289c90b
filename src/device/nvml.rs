//! The NVML reader: the inventory as the driver reports it, through NVML and the driver's
//! `/proc/driver/nvidia-caps/mig-minors`. Kept apart so the rest of `device` is plain data.
//!
//! Invariants: an NVML error is an error, never a panic, and names what was being read;
//! data NVML may lack on a platform (a minor number, MIG support, cap minors) is left out,
//! which is no error.

use nvml_wrapper::enum_wrappers::device::ComputeMode as NvmlComputeMode;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, Nvml};

use super::types::{
    is_safe_profile, ComputeMode, DeviceError, Gpu, Inventory, MigDevice, UNKNOWN_MIG_PROFILE,
};

/// `NVML_DEVICE_MIG_ENABLE` from nvml.h.
const MIG_ENABLED: u32 = 1;

fn op(operation: String) -> impl FnOnce(NvmlError) -> DeviceError {
    move |error| DeviceError::Nvml { operation, error }
}

/// The inventory through NVML: the library at `library`, else `libnvidia-ml.so.1` by
/// name (the loader's search).
pub(super) fn load(library: Option<&std::path::Path>) -> Result<Inventory, DeviceError> {
    let nvml = match library {
        Some(path) => Nvml::builder().lib_path(path.as_os_str()).init(),
        None => Nvml::init(),
    }
    .map_err(|error| DeviceError::NvmlInit { error })?;
    let driver_version = nvml
        .sys_driver_version()
        .map_err(op("read the driver version".to_owned()))?;
    let count = nvml
        .device_count()
        .map_err(op("count the GPUs".to_owned()))?;
    // Without the file (no MIG support, another platform) MIG devices get no cap minors.
    let mig_minors = std::fs::read_to_string(MIG_MINORS).unwrap_or_default();
    let mut gpus = Vec::new();
    for index in 0..count {
        let device = nvml
            .device_by_index(index)
            .map_err(op(format!("open GPU {index}")))?;
        gpus.push(gpu(index, &device, &mig_minors)?);
    }
    Ok(Inventory {
        driver_version,
        gpus,
    })
}

fn gpu(index: u32, device: &Device<'_>, mig_minors: &str) -> Result<Gpu, DeviceError> {
    let what = |field: &str| format!("read the {field} of GPU {index}");
    let capability = device
        .cuda_compute_capability()
        .map_err(op(what("compute capability")))?;
    let compute_mode = match device.compute_mode().map_err(op(what("compute mode")))? {
        NvmlComputeMode::Default => ComputeMode::Default,
        NvmlComputeMode::ExclusiveThread | NvmlComputeMode::ExclusiveProcess => {
            ComputeMode::ExclusiveProcess
        }
        NvmlComputeMode::Prohibited => ComputeMode::Prohibited,
    };
    let minor = match device.minor_number() {
        Ok(minor) => Some(minor),
        // Not on every platform (NVML documents it for Linux only): the GPU stays
        // usable by every request but one that names its device node.
        Err(NvmlError::NotSupported) => None,
        Err(error) => return Err(op(what("minor number"))(error)),
    };
    Ok(Gpu {
        index,
        uuid: device.uuid().map_err(op(what("UUID")))?,
        name: device.name().map_err(op(what("name")))?,
        memory_bytes: device.memory_info().map_err(op(what("memory")))?.total,
        compute_capability: format!("{}.{}", capability.major, capability.minor),
        compute_mode,
        minor,
        mig_devices: mig_devices(index, device, minor, mig_minors)?,
    })
}

fn mig_devices(
    index: u32,
    device: &Device<'_>,
    minor: Option<u32>,
    mig_minors: &str,
) -> Result<Vec<MigDevice>, DeviceError> {
    match device.mig_mode() {
        Ok(mode) if mode.current == MIG_ENABLED => {}
        // GPUs without MIG support answer NotSupported: no MIG devices.
        Ok(_) | Err(NvmlError::NotSupported) => return Ok(Vec::new()),
        Err(error) => return Err(op(format!("read the MIG mode of GPU {index}"))(error)),
    }
    let slots = device
        .mig_device_count()
        .map_err(op(format!("count the MIG devices of GPU {index}")))?;
    let mut out = Vec::new();
    for slot in 0..slots {
        // Slots without a created instance answer NotFound (or InvalidArg on some drivers).
        let mig = match device.mig_device_by_index(slot) {
            Ok(mig) => mig,
            Err(NvmlError::NotFound | NvmlError::InvalidArg) => continue,
            Err(error) => return Err(op(format!("open MIG device {slot} of GPU {index}"))(error)),
        };
        let what = |field: &str| format!("read the {field} of GPU {index} MIG device {slot}");
        // A MIG device's name is "<GPU name> MIG <profile>", e.g. "NVIDIA A30 MIG 1g.6gb".
        let name = mig.name().map_err(op(what("name")))?;
        // The cap minors are optional data: a driver without the instance-id calls, or
        // a mig-minors without the entry, leaves the device usable by name only.
        let (gi_caps_minor, ci_caps_minor) = match (minor, crate::sys::nvml_mig_instance_ids(&mig))
        {
            (Some(minor), Some((gi, ci))) => (
                mig_cap_minor(mig_minors, &format!("gpu{minor}/gi{gi}/access")),
                mig_cap_minor(mig_minors, &format!("gpu{minor}/gi{gi}/ci{ci}/access")),
            ),
            _ => (None, None),
        };
        out.push(MigDevice {
            gi_caps_minor,
            ci_caps_minor,
            index: slot,
            uuid: mig.uuid().map_err(op(what("UUID")))?,
            profile: profile_from_name(&name),
            memory_bytes: mig.memory_info().map_err(op(what("memory")))?.total,
        });
    }
    Ok(out)
}

/// The file where the NVIDIA driver lists the minor numbers of `/dev/nvidia-caps/nvidia-cap*`.
const MIG_MINORS: &str = "/proc/driver/nvidia-caps/mig-minors";

/// `"NVIDIA A30 MIG 1g.6gb"` → `"1g.6gb"`; anything else → [`UNKNOWN_MIG_PROFILE`].
fn profile_from_name(name: &str) -> String {
    name.rsplit_once("MIG ")
        .map(|(_, profile)| profile.trim())
        .filter(|p| is_safe_profile(p))
        .unwrap_or(UNKNOWN_MIG_PROFILE)
        .to_owned()
}
/// The minor number that the driver's `/proc/driver/nvidia-caps/mig-minors` text gives for
/// `name` (`gpu<gpu minor>/gi<gpu instance id>/access` or
/// `gpu<gpu minor>/gi<id>/ci<compute instance id>/access`): its lines are `<name> <minor>`.
/// `None` when no line names it (or its number is not one).
pub(crate) fn mig_cap_minor(text: &str, name: &str) -> Option<u32> {
    text.lines().find_map(|line| {
        let mut fields = line.split_whitespace();
        match (fields.next(), fields.next(), fields.next()) {
            (Some(n), Some(minor), None) if n == name => minor.parse().ok(),
            _ => None,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{load, InventorySource};
    use crate::util::error_chain as chain;

    /// What a driver publishes for GPU minor 0 with GPU instances 1 and 2, one compute
    /// instance each, and GPU minor 1 with GPU instance 1 (the shape of
    /// `/proc/driver/nvidia-caps/mig-minors`).
    const MIG_MINORS: &str = "config 1\nmonitor 2\ngpu0/gi0/access 3\ngpu0/gi0/ci0/access 4\ngpu0/gi1/access 12\ngpu0/gi1/ci0/access 13\ngpu0/gi1/ci1/access 14\ngpu0/gi2/access 21\ngpu0/gi2/ci0/access 22\ngpu1/gi1/access 147\ngpu1/gi1/ci0/access 148\n";

    #[test]
    fn nvml_without_driver_is_an_error_not_a_panic() {
        crate::device::read_nvml_in_process();
        match load(&InventorySource::Nvml, None) {
            // A GPU machine: whatever NVML reports must be a valid inventory.
            Ok(inv) => inv.validate("nvml").expect("nvml inventory valid"),
            Err(err) => {
                let msg = chain(&err);
                assert!(
                    msg.starts_with(
                        "cannot initialise NVML (is the NVIDIA driver installed and loaded?): "
                    ) || msg.contains("through NVML"),
                    "{msg}"
                );
                assert!(!msg.contains('\n'), "{msg}");
            }
        }
    }

    #[test]
    fn nvml_profile_from_name() {
        let cases = [
            ("NVIDIA A30 MIG 1g.6gb", "1g.6gb"),
            ("NVIDIA A100-SXM4-40GB MIG 1g.5gb+me", "1g.5gb+me"),
            ("NVIDIA H100 80GB HBM3 MIG 3g.40gb", "3g.40gb"),
            ("NVIDIA A30", UNKNOWN_MIG_PROFILE),
            ("NVIDIA A30 MIG ", UNKNOWN_MIG_PROFILE),
            ("NVIDIA A30 MIG 1g 6gb", UNKNOWN_MIG_PROFILE),
        ];
        for (name, want) in cases {
            assert_eq!(profile_from_name(name), want, "{name}");
        }
    }

    #[test]
    fn mig_minors_parse() {
        let cases: &[(&str, Option<u32>)] = &[
            ("gpu0/gi1/access", Some(12)),
            ("gpu0/gi1/ci0/access", Some(13)),
            ("gpu0/gi1/ci1/access", Some(14)),
            ("gpu0/gi2/ci0/access", Some(22)),
            ("gpu1/gi1/access", Some(147)),
            ("gpu1/gi1/ci0/access", Some(148)),
            ("config", Some(1)),
            // Absent entries, and no prefix match.
            ("gpu0/gi3/access", None),
            ("gpu1/gi1/ci1/access", None),
            ("gpu0/gi1", None),
            ("gpu0/gi1/ci0/acces", None),
            ("gpu10/gi1/access", None),
        ];
        for (name, want) in cases {
            assert_eq!(mig_cap_minor(MIG_MINORS, name), *want, "{name}");
        }
        // A missing file reads as empty text; odd lines are skipped, not errors.
        assert_eq!(mig_cap_minor("", "gpu0/gi1/access"), None);
        let odd =
            "gpu0/gi1/access\ngpu0/gi1/access x\ngpu0/gi1/access 12 13\n  gpu0/gi1/access   12  \n";
        assert_eq!(mig_cap_minor(odd, "gpu0/gi1/access"), Some(12));
        assert_eq!(mig_cap_minor("gpu0/gi1/access -1", "gpu0/gi1/access"), None);
    }
}
