//! Which process reads NVML: this one, or the `gpushare` binary beside it.
//!
//! NVML is a shared library of the driver that only `dlopen` can load, and the shim
//! (`gpushare-runtime`) is linked statically (static-pie: no dynamic loader on every runc
//! call an engine makes; BENCHMARKS.md, "Own cost against the floor"). A static glibc
//! program must not `dlopen` — the library would bring a second libc into the process —
//! so the shim never links NVML at all: when it needs the NVML inventory (a create with a
//! request whose inventory cache is stale) it runs `<its dir>/gpushare nvml-inventory`,
//! which loads NVML in-process and prints the validated inventory as JSON on stdout, or
//! its one error line on stderr. The `gpushare` binary (dynamic) reads NVML in-process:
//! its `main` calls [`read_nvml_in_process`] first.
//!
//! Invariants:
//! - In-process NVML is reachable only through [`read_nvml_in_process`], so that a binary
//!   that never calls it (the shim) links no NVML loader (`Nvml::init`; the package test
//!   checks the shipped shim's symbols): the NVML error types' formatting is all of
//!   nvml-wrapper that it carries.
//! - The helper is the binary the shim injects as its hooks (`gpushare` beside
//!   `gpushare-runtime`), with the shim's own environment (the engine's, which may carry
//!   the `LD_LIBRARY_PATH` that finds the driver's libraries) and stdin on /dev/null; its
//!   error is the same one line an in-process load gives; its output is parsed as JSON
//!   and validated like any inventory, never trusted blindly.
//! - Which NVML library is loaded is decided by the caller (`driver::nvml_library`: the
//!   loader's search, or a path under the config's `driver-root`); the helper gets the
//!   path as `--library <path>` and reads no config.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use super::types::{DeviceError, Inventory, MAX_NVML_JSON_BYTES, NVML_SUBCOMMAND};

/// The helper's option naming the NVML library to load.
pub const LIBRARY_FLAG: &str = "--library";

/// The in-process reader, once registered: it loads NVML from the path given, else by
/// name through the loader's search.
type Reader = fn(Option<&Path>) -> Result<Inventory, DeviceError>;
static IN_PROCESS: OnceLock<Reader> = OnceLock::new();

/// Makes this process read NVML itself (the `gpushare` binary); without it, NVML is read
/// by running `gpushare nvml-inventory` (module doc).
pub fn read_nvml_in_process() {
    let _ = IN_PROCESS.set(super::nvml::load);
}

/// The NVML inventory, not yet validated, by whichever reader this process has; NVML is
/// `library` when given.
pub(super) fn nvml(library: Option<&Path>) -> Result<Inventory, DeviceError> {
    match IN_PROCESS.get() {
        Some(load) => load(library),
        None => through_helper(library),
    }
}

fn through_helper(library: Option<&Path>) -> Result<Inventory, DeviceError> {
    // Beside this binary, as the hooks the shim injects; never looked up on PATH.
    let helper = std::env::current_exe()
        .map(|exe| exe.with_file_name("gpushare"))
        .map_err(|error| DeviceError::NvmlHelper {
            helper: PathBuf::from("gpushare"),
            error,
        })?;
    let mut cmd = Command::new(&helper);
    cmd.arg(NVML_SUBCOMMAND);
    if let Some(library) = library {
        cmd.arg(LIBRARY_FLAG).arg(library);
    }
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .map_err(|error| DeviceError::NvmlHelper {
            helper: helper.clone(),
            error,
        })?;
    if !out.status.success() {
        return Err(DeviceError::NvmlHelperFailed {
            message: error_line(&out.stderr).unwrap_or_else(|| {
                format!("{} {NVML_SUBCOMMAND} {}", helper.display(), out.status)
            }),
        });
    }
    if out.stdout.len() > MAX_NVML_JSON_BYTES {
        return Err(DeviceError::NvmlHelperOutput {
            helper,
            reason: format!("more than {MAX_NVML_JSON_BYTES} bytes"),
        });
    }
    serde_json::from_slice(&out.stdout).map_err(|e| DeviceError::NvmlHelperOutput {
        helper,
        reason: e.to_string(),
    })
}

/// The helper's error: its last non-empty stderr line without the `gpushare: ` prefix the
/// shim puts back, at most 1000 bytes.
fn error_line(stderr: &[u8]) -> Option<String> {
    let text = String::from_utf8_lossy(stderr);
    let line = text.lines().rev().map(str::trim).find(|l| !l.is_empty())?;
    let line = line.strip_prefix("gpushare: ").unwrap_or(line);
    let mut end = line.len().min(1000);
    while !line.is_char_boundary(end) {
        end -= 1;
    }
    Some(line[..end].to_owned())
}

#[cfg(test)]
mod tests {
    use super::error_line;

    #[test]
    fn the_helper_s_error_is_its_last_line_without_the_prefix() {
        let got = error_line(b"warning: x\ngpushare: cannot initialise NVML (...): gone\n\n");
        assert_eq!(got.as_deref(), Some("cannot initialise NVML (...): gone"));
        assert_eq!(error_line(b" \n"), None);
        let long = format!("gpushare: {}", "\u{e9}".repeat(800));
        assert!(error_line(long.as_bytes()).unwrap().len() <= 1000);
    }
}
