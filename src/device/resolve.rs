//! The resolution of a device request against the inventory, and the mapping of the device
//! nodes a container holds to the devices they belong to.
//!
//! Invariants: [`Inventory::resolve`] never guesses (see the module doc of `device`); every
//! error is one line naming the request key, its value and what exists on this node.

use super::types::{
    DeviceError, DeviceKind, DeviceRequest, DeviceSelector, Gpu, Inventory, MigDevice,
    ResolvedDevices,
};

impl Inventory {
    /// Resolves a device request. `key` and `value` are the annotation/env name and the raw
    /// text the request was parsed from; they only appear in errors.
    ///
    /// Rules: an empty request is refused; a MIG selector must be the only entry; every GPU
    /// may appear once (whether named by index or UUID). The GPU request's memory is that of
    /// its smallest GPU.
    pub(crate) fn resolve(
        &self,
        key: &'static str,
        value: &str,
        req: &DeviceRequest,
    ) -> Result<ResolvedDevices, DeviceError> {
        let selectors = &req.0;
        if selectors.is_empty() {
            return Err(DeviceError::EmptyRequest {
                key,
                value: value.to_owned(),
            });
        }
        if selectors.len() > 1 && selectors.iter().any(DeviceSelector::is_mig) {
            return Err(DeviceError::MigInList {
                key,
                value: value.to_owned(),
            });
        }
        if let [sel] = selectors.as_slice() {
            if sel.is_mig() {
                let (gpu, mig) = self.find_mig(key, value, sel)?;
                return Ok(ResolvedDevices {
                    kind: DeviceKind::Mig,
                    uuids: vec![mig.uuid.clone()],
                    gpu_indices: vec![gpu.index],
                    memory_bytes: mig.memory_bytes,
                    mig_profile: Some(mig.profile.clone()),
                });
            }
        }
        let mut uuids = Vec::with_capacity(selectors.len());
        let mut gpu_indices: Vec<u32> = Vec::with_capacity(selectors.len());
        let mut memory_bytes = u64::MAX;
        for sel in selectors {
            let gpu = self.find_gpu(key, value, sel)?;
            if gpu_indices.contains(&gpu.index) {
                return Err(DeviceError::DuplicateGpu {
                    key,
                    value: value.to_owned(),
                    gpu: gpu.index,
                });
            }
            if !gpu.mig_devices.is_empty() {
                return Err(DeviceError::GpuInMigMode {
                    key,
                    value: value.to_owned(),
                    gpu: gpu.index,
                    migs: gpu
                        .mig_devices
                        .iter()
                        .map(|m| format!("{}:{}", gpu.index, m.index))
                        .collect(),
                });
            }
            gpu_indices.push(gpu.index);
            uuids.push(gpu.uuid.clone());
            memory_bytes = memory_bytes.min(gpu.memory_bytes);
        }
        Ok(ResolvedDevices {
            kind: DeviceKind::Gpus,
            uuids,
            gpu_indices,
            memory_bytes,
            mig_profile: None,
        })
    }

    /// The GPUs whose device nodes are `/dev/nvidia<minor>` for these minors, as a request
    /// naming them by UUID in the same order (then [`Inventory::resolve`] applies the usual
    /// rules: each GPU once, none in MIG mode). `key` and `value` only appear in errors.
    pub(crate) fn gpus_by_minor(
        &self,
        key: &'static str,
        value: &str,
        minors: &[u32],
    ) -> Result<DeviceRequest, DeviceError> {
        minors
            .iter()
            .map(|&minor| {
                self.gpus
                    .iter()
                    .find(|g| g.minor == Some(minor))
                    .map(|g| DeviceSelector::GpuUuid(g.uuid.clone()))
                    .ok_or_else(|| DeviceError::NoSuchGpuMinor {
                        key,
                        value: value.to_owned(),
                        minor,
                        existing: self.gpus.iter().filter_map(|g| g.minor).collect(),
                        unknown: self.gpus.iter().filter(|g| g.minor.is_none()).count(),
                    })
            })
            .collect::<Result<_, _>>()
            .map(DeviceRequest)
    }

    /// The devices whose nodes a container holds: GPU nodes `/dev/nvidia<minor>` and MIG
    /// access nodes `/dev/nvidia-caps/nvidia-cap<cap>`, as a request for [`Inventory::resolve`]
    /// (which then applies the usual rules: a MIG device stands alone, each GPU once, none
    /// in MIG mode). A compute instance's cap names its MIG device; a GPU instance's cap
    /// that comes without the cap of any of its compute instances names every MIG device of
    /// that instance. A named MIG device needs its GPU's node among `minors`, and that node
    /// then stands for the MIG device, not for the GPU. Without caps this is
    /// [`Inventory::gpus_by_minor`]. `key` and `value` only appear in errors.
    pub(crate) fn devices_by_nodes(
        &self,
        key: &'static str,
        value: &str,
        minors: &[u32],
        caps: &[u32],
    ) -> Result<DeviceRequest, DeviceError> {
        let migs = || {
            self.gpus
                .iter()
                .flat_map(|g| g.mig_devices.iter().map(move |m| (g, m)))
        };
        // (GPU, MIG device, the cap that named it), in the order of the caps.
        let mut named: Vec<(&Gpu, &MigDevice, u32)> = Vec::new();
        let mut gi_only = Vec::new();
        for &cap in caps {
            if let Some((g, m)) = migs().find(|(_, m)| m.ci_caps_minor == Some(cap)) {
                if !named.iter().any(|(_, n, _)| n.uuid == m.uuid) {
                    named.push((g, m, cap));
                }
            } else if migs().any(|(_, m)| m.gi_caps_minor == Some(cap)) {
                gi_only.push(cap);
            } else {
                let mut existing: Vec<u32> = migs()
                    .flat_map(|(_, m)| [m.gi_caps_minor, m.ci_caps_minor])
                    .flatten()
                    .collect();
                existing.sort_unstable();
                existing.dedup();
                return Err(DeviceError::NoSuchCapMinor {
                    key,
                    value: value.to_owned(),
                    cap,
                    existing,
                    unknown: migs()
                        .filter(|(_, m)| m.gi_caps_minor.is_none() || m.ci_caps_minor.is_none())
                        .count(),
                });
            }
        }
        for &cap in &gi_only {
            if named.iter().any(|(_, m, _)| m.gi_caps_minor == Some(cap)) {
                continue;
            }
            for (g, m) in migs().filter(|(_, m)| m.gi_caps_minor == Some(cap)) {
                if !named.iter().any(|(_, n, _)| n.uuid == m.uuid) {
                    named.push((g, m, cap));
                }
            }
        }
        for &(g, m, cap) in &named {
            if !g.minor.is_some_and(|minor| minors.contains(&minor)) {
                return Err(DeviceError::MigWithoutParentNode {
                    key,
                    value: value.to_owned(),
                    cap,
                    uuid: m.uuid.clone(),
                    gpu: g.index,
                    minor: g.minor,
                });
            }
        }
        let gpu_minors: Vec<u32> = minors
            .iter()
            .copied()
            .filter(|&minor| !named.iter().any(|(g, _, _)| g.minor == Some(minor)))
            .collect();
        let mut request = self.gpus_by_minor(key, value, &gpu_minors)?;
        request.0.extend(
            named
                .iter()
                .map(|(_, m, _)| DeviceSelector::MigUuid(m.uuid.clone())),
        );
        Ok(request)
    }

    fn find_gpu(
        &self,
        key: &'static str,
        value: &str,
        sel: &DeviceSelector,
    ) -> Result<&Gpu, DeviceError> {
        match sel {
            DeviceSelector::Index(index) => {
                self.gpus.iter().find(|g| g.index == *index).ok_or_else(|| {
                    DeviceError::NoSuchGpuIndex {
                        key,
                        value: value.to_owned(),
                        index: *index,
                        existing: self.gpus.iter().map(|g| g.index).collect(),
                    }
                })
            }
            DeviceSelector::GpuUuid(uuid) => self
                .gpus
                .iter()
                .find(|g| g.uuid.eq_ignore_ascii_case(uuid))
                .ok_or_else(|| DeviceError::NoSuchGpuUuid {
                    key,
                    value: value.to_owned(),
                    uuid: uuid.clone(),
                    existing: self.gpus.iter().map(|g| g.uuid.clone()).collect(),
                }),
            // Callers check `is_mig` first; answer as if it were in a list.
            DeviceSelector::MigUuid(_) | DeviceSelector::MigIndex { .. } => {
                Err(DeviceError::MigInList {
                    key,
                    value: value.to_owned(),
                })
            }
        }
    }

    fn find_mig(
        &self,
        key: &'static str,
        value: &str,
        sel: &DeviceSelector,
    ) -> Result<(&Gpu, &MigDevice), DeviceError> {
        match sel {
            DeviceSelector::MigUuid(uuid) => self
                .gpus
                .iter()
                .flat_map(|g| g.mig_devices.iter().map(move |m| (g, m)))
                .find(|(_, m)| m.uuid.eq_ignore_ascii_case(uuid))
                .ok_or_else(|| DeviceError::NoSuchMigUuid {
                    key,
                    value: value.to_owned(),
                    uuid: uuid.clone(),
                    existing: self
                        .gpus
                        .iter()
                        .flat_map(|g| g.mig_devices.iter().map(|m| m.uuid.clone()))
                        .collect(),
                }),
            DeviceSelector::MigIndex { gpu, mig } => {
                let parent = self.find_gpu(key, value, &DeviceSelector::Index(*gpu))?;
                parent
                    .mig_devices
                    .iter()
                    .find(|m| m.index == *mig)
                    .map(|m| (parent, m))
                    .ok_or_else(|| DeviceError::NoSuchMigIndex {
                        key,
                        value: value.to_owned(),
                        gpu: *gpu,
                        mig: *mig,
                        existing: parent.mig_devices.iter().map(|m| m.index).collect(),
                    })
            }
            DeviceSelector::Index(_) | DeviceSelector::GpuUuid(_) => {
                // Unreachable through `resolve`; fail closed rather than panic.
                Err(DeviceError::EmptyRequest {
                    key,
                    value: value.to_owned(),
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{many_gpus, req, GIB, GPU0, GPU1, GPU2, KEY, MIG0, MIG1, MIG2};
    use super::super::*;

    #[test]
    fn resolve_ok() {
        use DeviceSelector::*;
        let inv = sample();
        let gpus = |uuids: &[&str], idx: &[u32], mem: u64| ResolvedDevices {
            kind: DeviceKind::Gpus,
            uuids: uuids.iter().map(|s| s.to_string()).collect(),
            gpu_indices: idx.to_vec(),
            memory_bytes: mem,
            mig_profile: None,
        };
        let mig = |uuid: &str| ResolvedDevices {
            kind: DeviceKind::Mig,
            uuids: vec![uuid.to_owned()],
            gpu_indices: vec![1],
            memory_bytes: 10 * GIB,
            mig_profile: Some("1g.10gb".to_owned()),
        };
        let cases: Vec<(DeviceRequest, ResolvedDevices)> = vec![
            (req(&[Index(0)]), gpus(&[GPU0], &[0], 24 * GIB)),
            (req(&[Index(2)]), gpus(&[GPU2], &[2], 80 * GIB)),
            (
                req(&[GpuUuid(GPU2.to_owned())]),
                gpus(&[GPU2], &[2], 80 * GIB),
            ),
            (
                req(&[GpuUuid(GPU2.to_uppercase())]),
                gpus(&[GPU2], &[2], 80 * GIB),
            ),
            (
                req(&[Index(2), Index(0)]),
                gpus(&[GPU2, GPU0], &[2, 0], 24 * GIB),
            ),
            (
                req(&[GpuUuid(GPU0.to_owned()), Index(2)]),
                gpus(&[GPU0, GPU2], &[0, 2], 24 * GIB),
            ),
            (req(&[MigUuid(MIG2.to_owned())]), mig(MIG2)),
            (req(&[MigUuid(MIG2.to_uppercase())]), mig(MIG2)),
            (req(&[MigIndex { gpu: 1, mig: 2 }]), mig(MIG2)),
            (req(&[MigIndex { gpu: 1, mig: 0 }]), mig(MIG0)),
        ];
        for (request, want) in cases {
            assert_eq!(
                inv.resolve(KEY, &request.to_string(), &request)
                    .expect("resolves"),
                want,
                "{request}"
            );
        }
    }

    #[test]
    fn resolve_errors() {
        use DeviceSelector::*;
        let inv = sample();
        let cases: Vec<(DeviceRequest, &str, String)> = vec![
            (req(&[]), "", "gpushare.io/device=\"\" is invalid: allowed is at least one device".into()),
            (req(&[Index(3)]), "3", "gpushare.io/device=\"3\" names GPU 3, which does not exist: this node has GPUs 0, 1, 2".into()),
            (req(&[Index(1)]), "1", "gpushare.io/device=\"1\" names GPU 1, which is in MIG mode: allowed is one of its MIG devices (1:0, 1:1, 1:2)".into()),
            (req(&[Index(2), GpuUuid(GPU1.into())]), "2,GPU-6a1b", "gpushare.io/device=\"2,GPU-6a1b\" names GPU 1, which is in MIG mode".into()),
            (
                req(&[GpuUuid("GPU-8f8bff94".into())]),
                "GPU-8f8bff94",
                format!("gpushare.io/device=\"GPU-8f8bff94\" names GPU-8f8bff94, which does not exist: this node has GPUs {GPU0}, {GPU1}, {GPU2}"),
            ),
            (
                req(&[MigUuid("MIG-abc".into())]),
                "MIG-abc",
                format!("gpushare.io/device=\"MIG-abc\" names MIG-abc, which does not exist: this node has MIG devices {MIG0}, "),
            ),
            (
                req(&[MigIndex { gpu: 1, mig: 3 }]),
                "1:3",
                "gpushare.io/device=\"1:3\" names MIG device 3 of GPU 1, which does not exist: GPU 1 has MIG devices 0, 1, 2".into(),
            ),
            (
                req(&[MigIndex { gpu: 2, mig: 0 }]),
                "2:0",
                "gpushare.io/device=\"2:0\" names MIG device 0 of GPU 2, which does not exist: GPU 2 has no MIG devices (MIG is not enabled or no instance is created)".into(),
            ),
            (
                req(&[MigIndex { gpu: 7, mig: 0 }]),
                "7:0",
                "gpushare.io/device=\"7:0\" names GPU 7, which does not exist: this node has GPUs 0, 1, 2".into(),
            ),
            (req(&[Index(2), Index(2)]), "2,2", "gpushare.io/device=\"2,2\" lists GPU 2 twice: allowed is each GPU at most once".into()),
            (
                req(&[Index(2), GpuUuid(GPU2.into())]),
                "2,GPU-7b2c",
                "gpushare.io/device=\"2,GPU-7b2c\" lists GPU 2 twice: allowed is each GPU at most once".into(),
            ),
            (
                req(&[Index(0), MigUuid(MIG0.into())]),
                "0,MIG-22f0",
                "gpushare.io/device=\"0,MIG-22f0\" is invalid: a MIG device must stand alone, not in a list".into(),
            ),
            (
                req(&[MigIndex { gpu: 1, mig: 0 }, MigIndex { gpu: 1, mig: 1 }]),
                "1:0,1:1",
                "gpushare.io/device=\"1:0,1:1\" is invalid: a MIG device must stand alone, not in a list".into(),
            ),
        ];
        for (request, raw, want) in cases {
            let msg = inv.resolve(KEY, raw, &request).expect_err(raw).to_string();
            assert!(msg.starts_with(&want), "{msg:?}\n  !starts_with {want:?}");
            assert!(!msg.contains('\n'));
        }
    }

    #[test]
    fn resolve_on_empty_inventory_and_long_lists() {
        let empty = Inventory {
            driver_version: "1".into(),
            gpus: Vec::new(),
        };
        let msg = empty
            .resolve("GPUSHARE_DEVICE", "0", &req(&[DeviceSelector::Index(0)]))
            .expect_err("no gpus")
            .to_string();
        assert_eq!(
            msg,
            "GPUSHARE_DEVICE=\"0\" names GPU 0, which does not exist: this node has no GPUs"
        );

        let many = many_gpus(10);
        let msg = many
            .resolve(KEY, "10", &req(&[DeviceSelector::Index(10)]))
            .expect_err("absent")
            .to_string();
        assert!(
            msg.ends_with("this node has GPUs 0, 1, 2, 3, 4, 5, 6, 7 and 2 more"),
            "{msg}"
        );
    }

    #[test]
    fn gpus_by_minor_maps_device_nodes() {
        let inv = sample();
        let key = "linux.devices";
        use DeviceSelector::GpuUuid;
        assert_eq!(
            inv.gpus_by_minor(key, "/dev/nvidia2,/dev/nvidia1", &[2, 1])
                .expect("2, 1"),
            req(&[GpuUuid(GPU0.into()), GpuUuid(GPU2.into())])
        );
        let err = |inv: &Inventory, minors: &[u32]| {
            inv.gpus_by_minor(key, "/dev/nvidia9", minors)
                .expect_err("absent")
                .to_string()
        };
        assert_eq!(
            err(&inv, &[1, 9]),
            "linux.devices=\"/dev/nvidia9\" names the GPU with minor number 9 (/dev/nvidia9), which does not exist: this node's GPUs have minor numbers 2, 0, 1"
        );
        let mut partial = sample();
        partial.gpus[1].minor = None;
        assert!(err(&partial, &[9]).ends_with("this node's GPUs have minor numbers 2, 1, and 1 give none (an inventory file needs \"minor\" on each GPU)"));
        let mut none = sample();
        for g in &mut none.gpus {
            g.minor = None;
        }
        assert!(err(&none, &[0]).ends_with("which does not exist: this node's inventory gives no minor numbers (an inventory file needs \"minor\" on each GPU)"));
        // The mapped GPUs then meet the usual rules: GPU 1 is in MIG mode.
        let gpu1 = inv.gpus_by_minor(key, "/dev/nvidia0", &[0]).expect("0");
        assert!(matches!(
            inv.resolve(key, "/dev/nvidia0", &gpu1),
            Err(DeviceError::GpuInMigMode { gpu: 1, .. })
        ));
    }

    #[test]
    fn devices_by_nodes_maps_caps() {
        let inv = sample();
        let key = "linux.devices";
        let mig = |uuid: &str| DeviceRequest(vec![DeviceSelector::MigUuid(uuid.to_owned())]);
        // Without caps: the GPUs.
        assert_eq!(
            inv.devices_by_nodes(key, "v", &[2, 1], &[]).expect("gpus"),
            inv.gpus_by_minor(key, "v", &[2, 1]).expect("gpus")
        );
        // gi + ci, ci alone, gi alone (one compute instance): the MIG device; the parent's
        // node stands for it.
        for caps in [&[12, 13][..], &[13], &[12], &[13, 12]] {
            assert_eq!(
                inv.devices_by_nodes(key, "v", &[0], caps).expect("mig"),
                mig(MIG0),
                "{caps:?}"
            );
        }
        // Two compute instances of one GPU instance: its node alone names both.
        let mut two_ci = sample();
        two_ci.gpus[1].mig_devices[1].gi_caps_minor = Some(12);
        assert_eq!(
            two_ci
                .devices_by_nodes(key, "v", &[0], &[12])
                .expect("both")
                .0
                .len(),
            2
        );
        assert_eq!(
            two_ci
                .devices_by_nodes(key, "v", &[0], &[12, 22])
                .expect("one"),
            mig(MIG1)
        );
        // Another GPU's node with it: a list, refused by `resolve`.
        let req = inv
            .devices_by_nodes(key, "v", &[1, 0], &[12, 13])
            .expect("list");
        assert!(matches!(
            inv.resolve(key, "v", &req),
            Err(DeviceError::MigInList { .. })
        ));
        // Unknown cap, parent missing.
        assert!(matches!(
            inv.devices_by_nodes(key, "v", &[0], &[2]),
            Err(DeviceError::NoSuchCapMinor {
                cap: 2,
                unknown: 0,
                ..
            })
        ));
        assert!(matches!(
            inv.devices_by_nodes(key, "v", &[1], &[13]),
            Err(DeviceError::MigWithoutParentNode {
                cap: 13,
                gpu: 1,
                minor: Some(0),
                ..
            })
        ));
    }
}
