//! `gpushare status` and `gpushare daemon list`: what runs where (`collect`), as a table
//! for people, JSON with a stable schema, or Prometheus text for node-exporter's textfile
//! collector (`render`), on stdout or written atomically to a file.
//!
//! Invariant: reads state without taking any lock a create could wait on
//! (`collect::collect`).

mod collect;
mod render;

pub(crate) use collect::capacity as collect_capacity;
pub(crate) use collect::{NriView, WatchView};
pub(crate) use render::{capacity_line, caps_summary};

use std::io::Write;
use std::path::Path;

use anyhow::Context;

use crate::config::Config;

/// How the status is printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Format {
    Table,
    Json,
    Prometheus,
}

/// Prints the status in `format` on stdout, or writes it to `output` atomically (for
/// node-exporter's textfile collector).
pub(crate) fn print(cfg: &Config, format: Format, output: Option<&Path>) -> anyhow::Result<()> {
    let view = collect::collect(cfg);
    let text = match format {
        Format::Table => render::table(&view),
        Format::Json => serde_json::to_string_pretty(&view).unwrap_or_default() + "\n",
        Format::Prometheus => render::prometheus(&view),
    };
    match output {
        Some(path) => crate::fsops::write_atomic(path, text.as_bytes(), 0o644)
            .with_context(|| format!("cannot write {}", path.display())),
        None => {
            let _ = std::io::stdout().lock().write_all(text.as_bytes());
            Ok(())
        }
    }
}
