//! Loading the inventory (a JSON file, or NVML through `reader`) and its validation.
//!
//! Invariants: [`load`] returns only an inventory that passed [`Inventory::validate`]; the
//! checks are those listed in the module doc of `device`, each failure one line naming the
//! origin, the entry and the rule.

use std::path::Path;

use super::reader;
use super::types::{
    is_safe_profile, DeviceError, Gpu, Inventory, InventorySource, MigDevice, MAX_GPUS,
};

/// Whether `s` is `prefix` (`GPU-` or `MIG-`) followed by hex digits and single dashes, starting
/// and ending with a hex digit, at most 64 characters after the prefix. NVML prints the usual
/// 8-4-4-4-12 form; the looser rule keeps us working if a driver ever prints another grouping.
pub(crate) fn is_well_formed_uuid(s: &str, prefix: &str) -> bool {
    let Some(rest) = s.strip_prefix(prefix) else {
        return false;
    };
    let bytes = rest.as_bytes();
    match (bytes.first(), bytes.last()) {
        (Some(first), Some(last)) => {
            bytes.len() <= 64
                && first.is_ascii_hexdigit()
                && last.is_ascii_hexdigit()
                && bytes.iter().all(|b| b.is_ascii_hexdigit() || *b == b'-')
                && !rest.contains("--")
        }
        _ => false,
    }
}

fn is_compute_capability(s: &str) -> bool {
    let digits = |p: &str| !p.is_empty() && p.len() <= 3 && p.bytes().all(|b| b.is_ascii_digit());
    matches!(s.split_once('.'), Some((major, minor)) if digits(major) && digits(minor))
}

/// Loads and validates the inventory; NVML is the one under `driver_root` when that is
/// set (`driver::nvml_library`).
pub(crate) fn load(
    source: &InventorySource,
    driver_root: Option<&Path>,
) -> Result<Inventory, DeviceError> {
    match source {
        InventorySource::Nvml => load_nvml(crate::driver::nvml_library(driver_root)?.as_deref()),
        InventorySource::File(path) => {
            let text = std::fs::read_to_string(path).map_err(|error| DeviceError::ReadFile {
                path: path.clone(),
                error,
            })?;
            parse_file(path, &text)
        }
    }
}

/// The NVML inventory, validated: NVML is `library`, else found by name.
pub(crate) fn load_nvml(library: Option<&Path>) -> Result<Inventory, DeviceError> {
    let inventory = reader::nvml(library)?;
    inventory.validate(&InventorySource::Nvml.to_string())?;
    Ok(inventory)
}

/// The text of the inventory file at `path` as a validated inventory: the half of `load`
/// without I/O, public for the fuzz target `inventory` (an operator or a provisioning tool
/// writes this file).
pub fn parse_file(path: &Path, text: &str) -> Result<Inventory, DeviceError> {
    let inventory: Inventory =
        serde_json::from_str(text).map_err(|error| DeviceError::ParseFile {
            path: path.to_owned(),
            error,
        })?;
    inventory.validate(&InventorySource::File(path.to_owned()).to_string())?;
    Ok(inventory)
}

impl Inventory {
    /// Checks the invariants listed in the module doc. `origin` names the inventory in errors
    /// (`nvml`, `file:/etc/…`). The first failure is reported, in the order the entries are
    /// listed: each GPU, then each of its MIG devices.
    pub(crate) fn validate(&self, origin: &str) -> Result<(), DeviceError> {
        if self.gpus.len() > MAX_GPUS {
            return Err(DeviceError::TooManyGpus {
                origin: origin.to_owned(),
                count: self.gpus.len(),
            });
        }
        let mut check = Validation {
            origin,
            gpu_indices: Vec::new(),
            minors: Vec::new(),
            uuids: Vec::new(),
            ci_caps: Vec::new(),
            gi_caps: Vec::new(),
        };
        for (pos, gpu) in self.gpus.iter().enumerate() {
            check.gpu(&format!("gpus[{pos}] (GPU {})", gpu.index), gpu)?;
            check.mig_devices(pos, gpu)?;
        }
        Ok(())
    }
}

/// One run of [`Inventory::validate`]: what the entries checked so far hold, for the checks
/// across entries (each index, minor, UUID and access node once).
struct Validation<'a> {
    origin: &'a str,
    gpu_indices: Vec<u32>,
    minors: Vec<u32>,
    /// Lowercased: GPU and MIG UUIDs share one namespace, case ignored.
    uuids: Vec<String>,
    ci_caps: Vec<u32>,
    /// (position of the GPU, minor)
    gi_caps: Vec<(usize, u32)>,
}

/// A field of a device entry, with whether its value is well formed and what is allowed.
struct Field<'a> {
    name: &'static str,
    value: &'a str,
    valid: bool,
    allowed: &'static str,
}

impl Validation<'_> {
    fn invalid(
        &self,
        entry: &str,
        field: &'static str,
        value: &str,
        allowed: &'static str,
    ) -> DeviceError {
        DeviceError::InvalidEntry {
            origin: self.origin.to_owned(),
            entry: entry.to_owned(),
            field,
            value: value.to_owned(),
            allowed,
        }
    }

    fn duplicate(&self, entry: String, field: &'static str, value: String) -> DeviceError {
        DeviceError::DuplicateEntry {
            origin: self.origin.to_owned(),
            entry,
            field,
            value,
        }
    }

    /// A GPU's own fields, and its index, minor and UUID against the GPUs before it.
    fn gpu(&mut self, entry: &str, gpu: &Gpu) -> Result<(), DeviceError> {
        if self.gpu_indices.contains(&gpu.index) {
            return Err(self.duplicate(entry.to_owned(), "index", gpu.index.to_string()));
        }
        self.gpu_indices.push(gpu.index);
        if let Some(minor) = gpu.minor {
            if self.minors.contains(&minor) {
                return Err(self.duplicate(entry.to_owned(), "minor", minor.to_string()));
            }
            self.minors.push(minor);
        }
        self.device(
            entry,
            (&gpu.uuid, "GPU-", "GPU- followed by hex digits and dashes"),
            gpu.memory_bytes,
            Field {
                name: "compute_capability",
                value: &gpu.compute_capability,
                valid: is_compute_capability(&gpu.compute_capability),
                allowed: "major.minor, like 8.0",
            },
        )
    }

    /// The MIG devices of the GPU at position `pos`, each in turn: its access nodes, its
    /// index against the GPU's MIG devices before it, its own fields.
    fn mig_devices(&mut self, pos: usize, gpu: &Gpu) -> Result<(), DeviceError> {
        let mut mig_indices = Vec::new();
        for (mpos, mig) in gpu.mig_devices.iter().enumerate() {
            let entry = format!(
                "gpus[{pos}].mig_devices[{mpos}] (GPU {} MIG device {})",
                gpu.index, mig.index
            );
            self.access_nodes(&entry, pos, mig)?;
            if mig_indices.contains(&mig.index) {
                return Err(self.duplicate(entry, "index", mig.index.to_string()));
            }
            mig_indices.push(mig.index);
            self.mig_device(&entry, mig)?;
        }
        Ok(())
    }

    /// A MIG device's own fields, and its UUID against every UUID before it.
    fn mig_device(&mut self, entry: &str, mig: &MigDevice) -> Result<(), DeviceError> {
        self.device(
            entry,
            (&mig.uuid, "MIG-", "MIG- followed by hex digits and dashes"),
            mig.memory_bytes,
            Field {
                name: "profile",
                value: &mig.profile,
                valid: is_safe_profile(&mig.profile),
                allowed: "letters, digits, '.', '+', '-' and '_', like 1g.6gb",
            },
        )
    }

    /// What a GPU and a MIG device both have, in this order: a well-formed UUID that no
    /// entry before used (`uuid`: the value, its prefix, what is allowed), memory, and
    /// the one descriptive field of its kind.
    fn device(
        &mut self,
        entry: &str,
        (uuid, prefix, allowed): (&str, &str, &'static str),
        memory_bytes: u64,
        field: Field<'_>,
    ) -> Result<(), DeviceError> {
        self.uuid(entry, uuid, prefix, allowed)?;
        if memory_bytes == 0 {
            return Err(self.invalid(entry, "memory_bytes", "0", "more than 0 bytes"));
        }
        if !field.valid {
            return Err(self.invalid(entry, field.name, field.value, field.allowed));
        }
        Ok(())
    }

    /// A well-formed UUID that no entry before used.
    fn uuid(
        &mut self,
        entry: &str,
        uuid: &str,
        prefix: &str,
        allowed: &'static str,
    ) -> Result<(), DeviceError> {
        if !is_well_formed_uuid(uuid, prefix) {
            return Err(self.invalid(entry, "uuid", uuid, allowed));
        }
        let lower = uuid.to_ascii_lowercase();
        if self.uuids.contains(&lower) {
            return Err(self.duplicate(entry.to_owned(), "uuid", uuid.to_owned()));
        }
        self.uuids.push(lower);
        Ok(())
    }

    /// The access-node minors of MIG device `mig` of the GPU at position `pos`: a compute
    /// instance's node is one MIG device's; a GPU instance's node is shared only by the MIG
    /// devices of that instance, so of one GPU; no node is both.
    fn access_nodes(
        &mut self,
        entry: &str,
        pos: usize,
        mig: &MigDevice,
    ) -> Result<(), DeviceError> {
        if let Some(ci) = mig.ci_caps_minor {
            if self.ci_caps.contains(&ci) {
                return Err(self.duplicate(entry.to_owned(), "ci_caps_minor", ci.to_string()));
            }
            if self.gi_caps.iter().any(|&(_, gi)| gi == ci) {
                return Err(self.invalid(
                    entry,
                    "ci_caps_minor",
                    &ci.to_string(),
                    "a minor that no gi_caps_minor uses",
                ));
            }
            self.ci_caps.push(ci);
        }
        if let Some(gi) = mig.gi_caps_minor {
            if self.ci_caps.contains(&gi)
                || self
                    .gi_caps
                    .iter()
                    .any(|&(g, other)| other == gi && g != pos)
            {
                return Err(self.invalid(
                    entry,
                    "gi_caps_minor",
                    &gi.to_string(),
                    "a minor that no ci_caps_minor and no other GPU's MIG device uses",
                ));
            }
            self.gi_caps.push((pos, gi));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{many_gpus, GIB, GPU0, MIG0};
    use super::super::*;
    use crate::util::error_chain as chain;
    use std::io::Write;

    /// One A30 with one MIG device, in the format of docs/inventory.md.
    const A30_JSON: &str = r#"{"driver_version": "580.159.04",
 "gpus": [{"index": 0, "uuid": "GPU-8f8bff94-112e-9541-43da-cfd453333404",
           "name": "NVIDIA A30", "memory_bytes": 25769803776,
           "compute_capability": "8.0", "compute_mode": "default",
           "mig_devices": [{"index": 0, "uuid": "MIG-22f0c05f-5cf2-5ea2-8297-789695656dc0",
                            "profile": "1g.6gb", "memory_bytes": 6442450944}]}]}"#;

    fn write_temp(text: &str) -> tempfile::NamedTempFile {
        let mut file = tempfile::NamedTempFile::new().expect("temp file");
        file.write_all(text.as_bytes()).expect("write");
        file
    }

    fn load_text(text: &str) -> (tempfile::NamedTempFile, Result<Inventory, DeviceError>) {
        let file = write_temp(text);
        let result = load(&InventorySource::File(file.path().to_path_buf()), None);
        (file, result)
    }

    #[test]
    fn uuid_shapes() {
        let cases: &[(&str, &str, bool)] = &[
            (GPU0, "GPU-", true),
            ("GPU-8F8BFF94-112E-9541-43DA-CFD453333404", "GPU-", true),
            (MIG0, "MIG-", true),
            ("GPU-abc", "GPU-", true),
            (MIG0, "GPU-", false),
            ("GPU-", "GPU-", false),
            ("GPU--abc", "GPU-", false),
            ("GPU-abc-", "GPU-", false),
            ("GPU-ab--c", "GPU-", false),
            ("GPU-xyz", "GPU-", false),
            ("gpu-abc", "GPU-", false),
            ("GPU-abc/0", "GPU-", false),
            (
                "MIG-GPU-8f8bff94-112e-9541-43da-cfd453333404/1/0",
                "MIG-",
                false,
            ),
        ];
        for (s, prefix, want) in cases {
            assert_eq!(is_well_formed_uuid(s, prefix), *want, "{s}");
        }
        assert!(!is_well_formed_uuid(
            &format!("GPU-{}", "a".repeat(65)),
            "GPU-"
        ));
    }

    #[test]
    fn load_design_json() {
        let (_file, result) = load_text(A30_JSON);
        let inv = result.expect("design json loads");
        assert_eq!(inv.driver_version, "580.159.04");
        assert_eq!(inv.gpus.len(), 1);
        let gpu = &inv.gpus[0];
        assert_eq!(gpu.uuid, GPU0);
        assert_eq!(gpu.memory_bytes, 24 * GIB);
        assert_eq!(gpu.compute_mode, ComputeMode::Default);
        assert_eq!(gpu.mig_devices[0].profile, "1g.6gb");
        assert_eq!(gpu.mig_devices[0].memory_bytes, 6 * GIB);
        // Written before `minor` existed: still valid, the minor unknown.
        assert_eq!(gpu.minor, None);
    }

    #[test]
    fn minor_numbers_load_and_validate() {
        let with_minor = A30_JSON.replace(
            "\"compute_mode\": \"default\"",
            "\"compute_mode\": \"default\", \"minor\": 7",
        );
        let (_file, result) = load_text(&with_minor);
        assert_eq!(result.expect("loads").gpus[0].minor, Some(7));
        let (_file, result) = load_text(&A30_JSON.replace(
            "\"compute_mode\": \"default\"",
            "\"compute_mode\": \"default\", \"minor\": -1",
        ));
        assert!(chain(&result.expect_err("negative")).contains("cannot parse inventory file"));

        let mut dup = sample();
        dup.gpus[2].minor = Some(0);
        let msg = dup.validate("t").expect_err("dup minor").to_string();
        assert_eq!(
            msg,
            "inventory t: gpus[2] (GPU 2) repeats minor \"0\": allowed is each minor once"
        );
    }

    #[test]
    fn load_without_mig_devices_field() {
        let text = r#"{"driver_version":"1","gpus":[{"index":0,"uuid":"GPU-ab","name":"x",
            "memory_bytes":1,"compute_capability":"9.0","compute_mode":"exclusive_process"}]}"#;
        let (_file, result) = load_text(text);
        let inv = result.expect("loads");
        assert!(inv.gpus[0].mig_devices.is_empty());
        assert_eq!(inv.gpus[0].compute_mode, ComputeMode::ExclusiveProcess);
    }

    #[test]
    fn sample_round_trips_and_validates() {
        let inv = sample();
        inv.validate("sample").expect("sample is valid");
        let text = serde_json::to_string(&inv).expect("serialize");
        let (_file, result) = load_text(&text);
        assert_eq!(result.expect("loads"), inv);
    }

    #[test]
    fn load_bad_files() {
        // (json, substrings of the full error chain)
        let cases: &[(&str, &[&str])] = &[
            (
                r#"{"driver_version":"1","gpus":[],"extra":1}"#,
                &["cannot parse inventory file", "unknown field `extra`"],
            ),
            (
                &A30_JSON.replace("\"name\"", "\"nom\""),
                &["cannot parse inventory file", "unknown field `nom`"],
            ),
            (
                &A30_JSON.replace("\"profile\"", "\"profile_id\": 1, \"profile\""),
                &["cannot parse inventory file", "unknown field `profile_id`"],
            ),
            (
                &A30_JSON.replace("\"default\"", "\"shared\""),
                &["cannot parse inventory file", "unknown variant `shared`"],
            ),
            ("{not json", &["cannot parse inventory file"]),
            (
                &A30_JSON.replace(GPU0, "GPU-8f8bff94/../x"),
                &["gpus[0] (GPU 0) has uuid \"GPU-8f8bff94/../x\", which is invalid: allowed is GPU- followed by hex digits and dashes"],
            ),
            (
                &A30_JSON.replace(MIG0, "GPU-22f0c05f"),
                &["gpus[0].mig_devices[0] (GPU 0 MIG device 0) has uuid \"GPU-22f0c05f\", which is invalid: allowed is MIG-"],
            ),
            (
                &A30_JSON.replace("\"8.0\"", "\"eight\""),
                &["has compute_capability \"eight\", which is invalid: allowed is major.minor"],
            ),
            (
                &A30_JSON.replace("\"1g.6gb\"", "\"1g 6gb\""),
                &["has profile \"1g 6gb\", which is invalid"],
            ),
            (
                &A30_JSON.replace("25769803776", "0"),
                &["has memory_bytes \"0\", which is invalid: allowed is more than 0 bytes"],
            ),
        ];
        for (text, wants) in cases {
            let (file, result) = load_text(text);
            let err = result.expect_err(text);
            let msg = chain(&err);
            for want in *wants {
                assert!(msg.contains(want), "{msg:?} lacks {want:?}");
            }
            if msg.starts_with("cannot parse") {
                assert!(msg.contains(&file.path().display().to_string()), "{msg}");
            } else {
                assert!(
                    msg.contains(&format!("inventory file:{}", file.path().display())),
                    "{msg}"
                );
            }
        }
    }

    #[test]
    fn validate_duplicates_and_count() {
        let mut dup_index = sample();
        dup_index.gpus[1].index = 0;
        let mut dup_uuid = sample();
        dup_uuid.gpus[1].uuid = GPU0.to_uppercase();
        let mut dup_mig_index = sample();
        dup_mig_index.gpus[1].mig_devices[2].index = 1;
        let mut dup_mig_uuid = sample();
        dup_mig_uuid.gpus[1].mig_devices[2].uuid = MIG0.to_owned();
        let too_many = many_gpus(65);
        let dup_mig_uuid_msg = format!("repeats uuid \"{MIG0}\": allowed is each uuid once");
        let cases: Vec<(Inventory, &str)> = vec![
            (dup_index, "inventory t: gpus[1] (GPU 0) repeats index \"0\": allowed is each index once"),
            (dup_uuid, "inventory t: gpus[1] (GPU 1) repeats uuid \"GPU-8F8BFF94-112E-9541-43DA-CFD453333404\": allowed is each uuid once"),
            (dup_mig_index, "gpus[1].mig_devices[2] (GPU 1 MIG device 1) repeats index \"1\""),
            (dup_mig_uuid, &dup_mig_uuid_msg),
            (too_many, "inventory t lists 65 GPUs: allowed is at most 64"),
        ];
        for (inv, want) in cases {
            let msg = inv.validate("t").expect_err(want).to_string();
            assert!(msg.contains(want), "{msg:?} lacks {want:?}");
        }
    }

    #[test]
    fn missing_file_names_path() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("absent.json");
        let err = load(&InventorySource::File(path.clone()), None).expect_err("missing");
        assert!(matches!(err, DeviceError::ReadFile { .. }));
        let msg = chain(&err);
        assert!(
            msg.starts_with(&format!("cannot read inventory file {}: ", path.display())),
            "{msg}"
        );
        // A directory is unreadable as a file.
        let err = load(&InventorySource::File(dir.path().to_path_buf()), None).expect_err("dir");
        assert!(err.to_string().contains(&dir.path().display().to_string()));
    }

    #[test]
    fn caps_minors_in_files() {
        // Old inventories (no caps) still load; the fields round-trip.
        let (_f, inv) = load_text(A30_JSON);
        assert_eq!(
            inv.expect("old inventory").gpus[0].mig_devices[0].ci_caps_minor,
            None
        );
        let with = A30_JSON.replace(
            r#""memory_bytes": 6442450944}"#,
            r#""memory_bytes": 6442450944, "gi_caps_minor": 12, "ci_caps_minor": 13}"#,
        );
        assert_ne!(with, A30_JSON);
        let (_f, inv) = load_text(&with);
        let inv = inv.expect("with caps");
        let mig = &inv.gpus[0].mig_devices[0];
        assert_eq!((mig.gi_caps_minor, mig.ci_caps_minor), (Some(12), Some(13)));
        let text = serde_json::to_string(&inv).expect("ser");
        assert!(
            text.contains(r#""gi_caps_minor":12,"ci_caps_minor":13"#),
            "{text}"
        );
        sample().validate("t").expect("the sample is valid");

        // Two MIG devices of one GPU instance share its node; a compute instance's is one
        // device's; no node is both; a GPU instance's node is one GPU's.
        let mut shared_gi = sample();
        shared_gi.gpus[1].mig_devices[1].gi_caps_minor = Some(12);
        shared_gi
            .validate("t")
            .expect("one GPU instance, two compute instances");
        let mut dup_ci = sample();
        dup_ci.gpus[1].mig_devices[1].ci_caps_minor = Some(13);
        let mut ci_is_gi = sample();
        ci_is_gi.gpus[1].mig_devices[1].ci_caps_minor = Some(12);
        let mut gi_is_ci = sample();
        gi_is_ci.gpus[1].mig_devices[1].gi_caps_minor = Some(13);
        let mut gi_two_gpus = sample();
        gi_two_gpus.gpus[2].mig_devices = vec![MigDevice {
            index: 0,
            uuid: "MIG-6e8f4cab-3a7d-5d3b-af94-5c4b1a0e9d34".to_owned(),
            profile: "1g.10gb".to_owned(),
            memory_bytes: 10 * GIB,
            gi_caps_minor: Some(12),
            ci_caps_minor: Some(148),
        }];
        let cases: Vec<(Inventory, &str)> = vec![
            (dup_ci, "inventory t: gpus[1].mig_devices[1] (GPU 1 MIG device 1) repeats ci_caps_minor \"13\": allowed is each ci_caps_minor once"),
            (ci_is_gi, "inventory t: gpus[1].mig_devices[1] (GPU 1 MIG device 1) has ci_caps_minor \"12\""),
            (gi_is_ci, "inventory t: gpus[1].mig_devices[1] (GPU 1 MIG device 1) has gi_caps_minor \"13\""),
            (gi_two_gpus, "inventory t: gpus[2].mig_devices[0] (GPU 2 MIG device 0) has gi_caps_minor \"12\""),
        ];
        for (inv, want) in cases {
            let msg = inv.validate("t").expect_err(want).to_string();
            assert!(msg.contains(want), "{msg:?} lacks {want:?}");
        }
    }
}
