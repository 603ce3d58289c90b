//! What the "driver" knows of a simulated CUDA process: that it holds a context on a GPU,
//! what kind, and how much memory. A process that holds one keeps a memfd named
//! `gpushare-fake-nvml` open whose text is `<GPU UUID> <compute|mps> <bytes>`; the fake
//! NVML of the tests (tests/integration/fake_nvml.c) lists exactly the live processes that
//! hold one, from /proc, with their PIDs in the caller's namespace, as the real driver
//! lists processes with a context.
//!
//! Invariant: the context lasts as long as the process (the fd closes when it exits or is
//! killed), like the device memory a real process holds until it is gone.

use std::io::Write;
use std::os::fd::OwnedFd;

use nix::sys::memfd::{memfd_create, MFdFlags};

/// How NVML lists the process: `Compute` in the compute list only (an MPS server, or a
/// process that uses the GPU directly), `Mps` in both lists (an MPS client).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Compute,
    Mps,
}

/// A held context.
pub struct Context {
    _fd: OwnedFd,
}

impl Context {
    pub fn hold(gpu: &str, kind: Kind, bytes: u64) -> std::io::Result<Context> {
        let fd = memfd_create("gpushare-fake-nvml", MFdFlags::MFD_CLOEXEC)?;
        let kind = match kind {
            Kind::Compute => "compute",
            Kind::Mps => "mps",
        };
        std::fs::File::from(fd.try_clone()?)
            .write_all(format!("{gpu} {kind} {bytes}\n").as_bytes())?;
        Ok(Context { _fd: fd })
    }
}

/// Whether `text` names one GPU or MIG device by UUID (what a server's
/// CUDA_VISIBLE_DEVICES holds when gpushare starts it).
pub fn is_uuid(text: &str) -> bool {
    (text.starts_with("GPU-") || text.starts_with("MIG-"))
        && text.len() <= 90
        && text.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
}
