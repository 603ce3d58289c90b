//! The co-location experiment of round 5 (round5.rs, `r5-coloc`) as plain data: its setups,
//! what each measured, and the markdown table that sets each setup against its tenants
//! alone. Pure (no I/O), so that gpu-unit tests it.

use serde_json::Value;

use crate::calc::{self, f2};

/// The inference tenant's requests per second.
pub const RATE: f64 = 200.0;

#[derive(Clone, Copy, PartialEq)]
pub enum How {
    /// Plain processes, no MPS (an empty pipe directory): the driver time-slices them.
    Plain,
    /// gpushare containers, user-mode = "per-user".
    PerUser,
    /// gpushare containers, user-mode = "multi-user"; `enforced: false` is `limits =
    /// "advisory"` (a cap is the client's environment, one server for both).
    MultiUser { enforced: bool },
}

pub struct Setup {
    pub name: &'static str,
    pub how: How,
    pub infer: bool,
    pub train: bool,
    /// The training tenant's active-thread-percentage annotation.
    pub cap: Option<&'static str>,
    /// The gpushare daemons the setup must have (`status --json`): a capped tenant under
    /// enforced limits has a daemon of its own, even in multi-user mode.
    pub daemons: usize,
}

pub const SETUPS: &[Setup] = &[
    Setup {
        name: "inference alone",
        how: How::Plain,
        infer: true,
        train: false,
        cap: None,
        daemons: 0,
    },
    Setup {
        name: "training alone",
        how: How::Plain,
        infer: false,
        train: true,
        cap: None,
        daemons: 0,
    },
    Setup {
        name: "both, time-sliced (no MPS)",
        how: How::Plain,
        infer: true,
        train: true,
        cap: None,
        daemons: 0,
    },
    Setup {
        name: "gpushare per-user (2 daemons)",
        how: How::PerUser,
        infer: true,
        train: true,
        cap: None,
        daemons: 2,
    },
    Setup {
        name: "gpushare multi-user (1 server)",
        how: How::MultiUser { enforced: true },
        infer: true,
        train: true,
        cap: None,
        daemons: 1,
    },
    Setup {
        name: "multi-user, training at 50 % (1 server, advisory)",
        how: How::MultiUser { enforced: false },
        infer: true,
        train: true,
        cap: Some("50"),
        daemons: 1,
    },
    Setup {
        name: "multi-user, training at 25 % (1 server, advisory)",
        how: How::MultiUser { enforced: false },
        infer: true,
        train: true,
        cap: Some("25"),
        daemons: 1,
    },
    Setup {
        name: "multi-user, training at 25 % (enforced: its own daemon)",
        how: How::MultiUser { enforced: true },
        infer: true,
        train: true,
        cap: Some("25"),
        daemons: 2,
    },
];

/// What a setup measured.
pub struct Row {
    pub name: &'static str,
    pub infer: Option<Value>,
    pub train: Option<Value>,
    pub errors: Vec<String>,
    /// The gpushare daemons `status --json` listed while the tenants ran (none: no MPS).
    pub daemons: Vec<String>,
}

fn ms(v: &Option<Value>, which: &str, k: &str) -> Option<f64> {
    v.as_ref().and_then(|v| v[which][k].as_f64())
}

fn its(v: &Option<Value>) -> Option<f64> {
    v.as_ref().and_then(|v| v["iters_per_s"].as_f64())
}

pub fn summary(r: &Row) -> String {
    let mut parts = Vec::new();
    if let Some(v) = &r.infer {
        parts.push(format!(
            "inference p50 {} ms, p99 {} ms, max {} ms ({} requests, {} late)",
            f2(ms(&r.infer, "latency_ms", "p50")),
            f2(ms(&r.infer, "latency_ms", "p99")),
            f2(ms(&r.infer, "latency_ms", "max")),
            v["requests"],
            v["late_starts"]
        ));
    }
    if r.train.is_some() {
        parts.push(format!("training {} it/s", f2(its(&r.train))));
    }
    if !r.daemons.is_empty() {
        parts.push(format!("daemons: {}", r.daemons.join(", ")));
    }
    parts.extend(r.errors.iter().cloned());
    parts.join("; ")
}

/// The markdown table: each setup's inference p50/p99 and training throughput, and each
/// against its tenant alone.
pub fn table(rows: &[Row], simulate: bool, seconds: f64) -> String {
    let alone_inf = rows
        .iter()
        .find(|r| r.infer.is_some() && r.train.is_none() && r.errors.is_empty());
    let alone_trn = rows
        .iter()
        .find(|r| r.train.is_some() && r.infer.is_none() && r.errors.is_empty());
    let p = |r: Option<&Row>, k: &str| r.and_then(|r| ms(&r.infer, "latency_ms", k));
    let ratio = |a: Option<f64>, b: Option<f64>| match a.zip(b) {
        Some((a, b)) if b > 0.0 => format!("{:.2}×", a / b),
        _ => "-".to_owned(),
    };
    let mut out = String::new();
    out.push_str(&format!(
        "round 5, co-location: inference at {RATE} requests/s (UID 1000) beside training (UID 2000), {seconds} s per setup{}\n\n",
        if simulate {
            "; SIMULATED: CPU stand-ins of both tenants, no figure below is a GPU's"
        } else {
            ""
        }
    ));
    out.push_str("| setup | inference p50 ms | p99 ms | p50 vs alone | p99 vs alone | training it/s | vs alone | note |\n");
    out.push_str("|---|---|---|---|---|---|---|---|\n");
    for r in rows {
        let cell = |has: bool, v: Option<f64>| {
            if has {
                f2(v)
            } else {
                "-".to_owned()
            }
        };
        let mut note = if simulate {
            "simulated".to_owned()
        } else {
            String::new()
        };
        if !r.errors.is_empty() {
            if !note.is_empty() {
                note.push_str("; ");
            }
            note.push_str(&format!("FAILED: {}", calc::cut(&r.errors.join(" | "), 80)));
        }
        let (p50, p99) = (p(Some(r), "p50"), p(Some(r), "p99"));
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} |\n",
            r.name,
            cell(r.infer.is_some(), p50),
            cell(r.infer.is_some(), p99),
            ratio(p50, p(alone_inf, "p50")),
            ratio(p99, p(alone_inf, "p99")),
            cell(r.train.is_some(), its(&r.train)),
            ratio(its(&r.train), alone_trn.and_then(|a| its(&a.train))),
            note.replace('|', "/")
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn row(name: &'static str, infer: Option<(f64, f64)>, train: Option<f64>) -> Row {
        Row {
            name,
            infer: infer.map(|(p50, p99)| {
                json!({"ok": true, "latency_ms": {"p50": p50, "p99": p99, "max": p99},
                    "requests": 10, "late_starts": 0})
            }),
            train: train.map(|i| json!({"ok": true, "iters_per_s": i})),
            errors: Vec::new(),
            daemons: Vec::new(),
        }
    }

    #[test]
    fn the_table_sets_each_setup_against_its_tenant_alone() {
        let mut failed = row("both, failed", None, None);
        failed.errors.push("infer: torch | broke".into());
        let rows = [
            row("inference alone", Some((0.5, 1.0)), None),
            row("training alone", None, Some(100.0)),
            row("both", Some((1.0, 4.0)), Some(50.0)),
            failed,
        ];
        let t = table(&rows, false, 6.0);
        assert!(
            t.contains("| inference alone | 0.50 | 1.00 | 1.00× | 1.00× | - | - |  |"),
            "{t}"
        );
        assert!(
            t.contains("| both | 1.00 | 4.00 | 2.00× | 4.00× | 50.00 | 0.50× |  |"),
            "{t}"
        );
        assert!(t.contains("FAILED: infer: torch / broke |"), "{t}");
        let sim = table(&rows, true, 0.5);
        assert!(
            sim.contains("SIMULATED") && sim.contains("| simulated |"),
            "{sim}"
        );
    }

    #[test]
    fn every_setup_has_a_tenant_and_only_training_is_capped() {
        for s in SETUPS {
            assert!(s.infer || s.train, "{}", s.name);
            assert!(
                s.cap.is_none() || (s.train && s.how != How::Plain),
                "{}",
                s.name
            );
            assert_eq!(s.how == How::Plain, s.daemons == 0, "{}", s.name);
        }
        assert!(SETUPS.iter().any(|s| s.infer && !s.train));
        assert!(SETUPS.iter().any(|s| s.train && !s.infer));
    }
}
