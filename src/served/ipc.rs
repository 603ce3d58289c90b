//! The IPC mode of a container whose spec the engine made (hook-only mode, the NRI
//! plugin): what its namespaces say, and what a request may ask of it.

use anyhow::bail;

use crate::bundle::SpecFile;
use crate::request::{self, IpcMode};

/// The IPC mode of a container whose spec the engine made and gpushare cannot change
/// (hook-only mode, the NRI plugin): isolated when the spec has an `ipc` namespace (the
/// daemon's shm goes over its /dev/shm), else the host's; and the check a request's
/// `gpushare.io/ipc` must pass: it can only agree. `who` and `instead` complete the
/// refusal's line.
pub(crate) fn engine_ipc<'a>(
    spec: &SpecFile,
    who: &'a str,
    instead: &'a str,
) -> (
    IpcMode,
    impl FnOnce(&request::Request) -> anyhow::Result<IpcMode> + 'a,
) {
    let has_ipc_ns = spec
        .typed
        .linux
        .as_ref()
        .is_some_and(|l| l.has_namespace(oci_spec::runtime::LinuxNamespaceType::Ipc, |_| true));
    let ipc = if has_ipc_ns {
        IpcMode::Isolated
    } else {
        IpcMode::Host
    };
    let honour = move |req: &request::Request| {
        if let Some(asked) = req.ipc.as_ref().filter(|a| a.value != ipc) {
            bail!(
                "{}={:?} cannot be honoured in {who}: the container's IPC namespace is already {}; allowed is {instead}",
                asked.key,
                asked.raw,
                if has_ipc_ns { "private" } else { "the host's" }
            );
        }
        Ok(ipc)
    };
    (ipc, honour)
}
