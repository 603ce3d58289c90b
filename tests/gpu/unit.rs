//! The unit tests of the GPU tier's pure helpers (options, arithmetic, client records). The
//! tier itself, `gpu` (tests/gpu/main.rs), runs without libtest (`harness = false`), so
//! their `#[cfg(test)]` modules run here.

#![allow(dead_code)]

mod calc;
mod client;
mod coloc;
mod opts;
