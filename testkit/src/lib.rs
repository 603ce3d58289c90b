//! The test kit: what the test targets share, one crate instead of files included with
//! `#[path]`.
//!
//! - [`common`]: finding executables, polling with a deadline, processes by pid and start
//!   time, mounts, the simulator's client line. All the GPU tier (tests/gpu/) uses: it runs
//!   as an executable carried to a machine without the build tree.
//! - [`harness`]: one test's world on real runc (`Env`, containers, the shared busybox
//!   rootfs, the test inventory, private mount namespaces, fetched engines), for the
//!   `integration`, `load` and `faults` targets.
//! - [`node`]: a private containerd with its CRI plugin driven as a kubelet drives it
//!   (`Node`, pods, containers, logs), over [`cri_api`], a small CRI client.
//! - [`libtest`]: libtest's flags and filters, for the tiers with a main of their own.
//!
//! Everything is re-exported here: a test says `use testkit::*;`.
//!
//! Where the executables under test are. Cargo gives a test target `CARGO_BIN_EXE_<name>`
//! for its own package's binaries, not to a library like this one, and the simulator is a
//! package of its own. So the kit finds them from the running test executable: Cargo puts
//! it at `<target>/<profile>/deps/<test>-<hash>`, and the package's executables (built
//! before any of its test targets runs) and the simulator's (built by `cargo build` and
//! `cargo test --workspace`) at `<target>/<profile>/` — see [`harness::gpushare`]. A
//! missing one fails with the command that builds it. The repository's files the tests
//! read (the example inventory, the shipped hooks, the simulator's sources) are found from
//! this crate's directory at compile time, as Cargo built it: a clone anywhere works, and
//! nothing outside the repository is read. The GPU tier needs neither: it takes its
//! directories from its options (tests/gpu/tier.rs, `locate_bins`).
//!
//! Invariants: every `Env` and `Node` cleans up what it made in `Drop`, on failure too;
//! waits poll with deadlines; nothing sleeps a fixed time to "let it start".

pub mod common;
pub mod cri_api;
pub mod harness;
pub mod libtest;
pub mod node;
pub mod podbench;

pub use common::*;
pub use harness::*;
pub use node::*;
