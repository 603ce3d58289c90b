//! One client run of the GPU tier, normalized into the JSON line `"event": "client"`: its
//! launch and exit times (taken by the tier), its first kernel and end (from the workload's
//! JSON lines, or from the simulator client's `mps-client … waited_ms=…` line), `ok`, and an
//! error on one line. Also the table of every client printed with the summary.
//!
//! Invariants: the record's keys and meanings are those of `workload.py result`, which wrote
//! them before this port (docs/gpu-validation.md "Raw output"; the JSON lines of the H100
//! run in docs/gpu-runs/ read the same); a record is built from what the run left, never
//! fails, and says what is missing in `error`.

use std::collections::BTreeMap;

use serde_json::{json, Value};

use crate::calc::{self, Times};

/// Real: `scripts/gpu/workload.py` with PyTorch. Sim: `gpushare-mps-sim client`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Kind {
    Real,
    Sim,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Real => "real",
            Kind::Sim => "sim",
        }
    }
}

/// What one client left: its output and the tier's own observations.
#[derive(Debug, Clone, Default)]
pub struct Raw {
    pub label: String,
    pub uid: u32,
    pub rc: Option<i32>,
    pub t_launch: Option<f64>,
    pub t_exit: Option<f64>,
    pub out: String,
    pub err: String,
}

/// The normalized record; keys sorted, as the JSON line writes them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Record(pub BTreeMap<String, Value>);

impl Record {
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.0.get(key).filter(|v| !v.is_null())
    }

    pub fn ok(&self) -> bool {
        self.get("ok").and_then(Value::as_bool).unwrap_or(false)
    }

    pub fn num(&self, key: &str) -> Option<f64> {
        self.get(key).and_then(Value::as_f64)
    }

    /// A field as evidence text, the way the bash tier printed it (`workload.py field`):
    /// nothing for a missing one, `1`/`0` for a boolean, six decimals for a float.
    pub fn text(&self, key: &str) -> String {
        match self.get(key) {
            None => String::new(),
            Some(Value::Bool(b)) => if *b { "1" } else { "0" }.to_owned(),
            Some(Value::String(s)) => s.clone(),
            Some(Value::Number(n)) if n.is_f64() => format!("{:.6}", n.as_f64().unwrap_or(0.0)),
            Some(v) => v.to_string(),
        }
    }

    pub fn error(&self) -> String {
        self.text("error")
    }

    pub fn times(&self) -> Times {
        Times {
            ok: self.ok(),
            t_launch: self.num("t_launch"),
            t_first_kernel: self.num("t_first_kernel"),
            t_end: self.num("t_end"),
        }
    }

    /// The JSON line, with the run's fields added.
    pub fn line(&self, run: &str, section: &str, simulate: bool) -> String {
        let mut m = self.0.clone();
        m.insert("run".into(), json!(run));
        m.insert("section".into(), json!(section));
        m.insert("simulate".into(), json!(simulate));
        serde_json::to_string(&m).unwrap_or_default()
    }
}

fn one_line(text: &str) -> String {
    calc::cut(&text.split_whitespace().collect::<Vec<_>>().join(" "), 600)
}

pub fn normalize(raw: &Raw, kind: Kind) -> Record {
    let mut r: BTreeMap<String, Value> = BTreeMap::new();
    r.insert("event".into(), json!("client"));
    r.insert("label".into(), json!(raw.label));
    r.insert("kind".into(), json!(kind.name()));
    r.insert("uid".into(), json!(raw.uid));
    r.insert("rc".into(), json!(raw.rc));
    r.insert("t_launch".into(), json!(raw.t_launch));
    r.insert("t_exit".into(), json!(raw.t_exit));
    r.insert("ok".into(), json!(false));
    r.insert("error".into(), Value::Null);
    match kind {
        Kind::Sim => {
            let kv = testkit::common::parse_client_line(&raw.out);
            if let Some(kv) = &kv {
                let get = |k: &str| kv.get(k).cloned();
                r.insert("sim".into(), json!(kv));
                let uid = get("uid").and_then(|u| u.parse::<i64>().ok()).unwrap_or(-1);
                r.insert("client_uid".into(), json!(uid));
                r.insert("server_pid".into(), json!(get("server")));
                r.insert("server_uid".into(), json!(get("server_uid")));
                let waited = get("waited_ms")
                    .and_then(|w| w.parse::<i64>().ok())
                    .unwrap_or(0);
                r.insert("waited_ms".into(), json!(waited));
                r.insert(
                    "active_thread_percentage".into(),
                    json!(get("active_thread_percentage")),
                );
                r.insert("pinned_mem_limit".into(), json!(get("pinned_mem_limit")));
                if let Some(t0) = raw.t_launch {
                    // The simulated "first kernel": the moment the daemon attached it to a
                    // server.
                    r.insert("t_first_kernel".into(), json!(t0 + waited as f64 / 1000.0));
                }
            }
            r.insert("t_start".into(), json!(raw.t_launch));
            r.insert("t_end".into(), json!(raw.t_exit));
            r.insert("ok".into(), json!(raw.rc == Some(0) && kv.is_some()));
        }
        Kind::Real => {
            let mut last: Option<serde_json::Map<String, Value>> = None;
            for line in raw.out.lines() {
                let Ok(Value::Object(obj)) = serde_json::from_str::<Value>(line) else {
                    continue;
                };
                match obj.get("event").and_then(Value::as_str) {
                    Some("result") => last = Some(obj),
                    Some("first_kernel") if last.is_none() => {
                        if let Some(t) = obj.get("t_first_kernel") {
                            r.insert("t_first_kernel".into(), t.clone());
                        }
                    }
                    _ => {}
                }
            }
            if let Some(fin) = last {
                r.insert(
                    "client_uid".into(),
                    fin.get("uid").cloned().unwrap_or(Value::Null),
                );
                for k in [
                    "t_start",
                    "t_first_kernel",
                    "t_end",
                    "iterations",
                    "iters_per_s",
                    "tflops",
                    "compute_s",
                    "device",
                    "allocated",
                    "mem_get_info",
                ] {
                    if let Some(v) = fin.get(k).filter(|v| !v.is_null()) {
                        r.insert(k.into(), v.clone());
                    }
                }
                let ok = fin.get("ok").and_then(Value::as_bool).unwrap_or(false);
                r.insert("ok".into(), json!(ok && raw.rc == Some(0)));
                r.insert(
                    "error".into(),
                    fin.get("error").cloned().unwrap_or(Value::Null),
                );
                r.insert("payload".into(), Value::Object(fin));
            }
            if r.get("t_end").is_none_or(Value::is_null) {
                r.insert("t_end".into(), json!(raw.t_exit));
            }
        }
    }
    let ok = r.get("ok").and_then(Value::as_bool).unwrap_or(false);
    let has_error = r
        .get("error")
        .and_then(Value::as_str)
        .is_some_and(|e| !e.is_empty());
    if !ok && !has_error {
        let lines: Vec<&str> = raw.err.lines().filter(|l| !l.trim().is_empty()).collect();
        let tail = one_line(&lines[lines.len().saturating_sub(3)..].join(" | "));
        let rc = raw.rc.map_or("none".to_owned(), |c| c.to_string());
        let error = if matches!(raw.rc, Some(124 | 137)) {
            format!("killed by the tier's deadline (rc {rc}); {tail}")
        } else if tail.is_empty() {
            format!("no output (rc {rc})")
        } else {
            tail
        };
        r.insert("error".into(), json!(error));
    }
    let num = |k: &str| r.get(k).and_then(Value::as_f64);
    let (t0, tf, te) = (num("t_launch"), num("t_first_kernel"), num("t_end"));
    let latency = tf.zip(t0).map(|(tf, t0)| tf - t0);
    let wall = te.zip(t0).map(|(te, t0)| te - t0);
    r.insert("first_kernel_latency_s".into(), json!(latency));
    r.insert("wall_s".into(), json!(wall));
    Record(r)
}

/// The clients' table: times relative to the first launch, latency = launch to first kernel.
pub fn table(records: &[&Record]) -> String {
    let Some(t_ref) = records
        .iter()
        .filter_map(|r| r.num("t_launch"))
        .reduce(f64::min)
    else {
        return String::new();
    };
    let fmt = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.2}"));
    let row = |c: [&str; 8]| {
        format!(
            "{:<24} {:>5} {:>3} {:>7} {:>7} {:>7} {:>8}  {}",
            c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]
        )
    };
    let head = row([
        "client", "uid", "rc", "launch", "kernel1", "end", "latency", "detail",
    ]);
    let mut out = format!("{head}\n{}\n", "-".repeat(head.len()));
    for r in records {
        let rel = |k: &str| r.num(k).map(|t| t - t_ref);
        let detail = if !r.ok() {
            calc::cut(&format!("ERROR: {}", r.error()), 120)
        } else if r.text("kind") == "sim" {
            format!(
                "server={}(uid {}) threads={} mem={}",
                r.text("server_pid"),
                r.text("server_uid"),
                r.text("active_thread_percentage"),
                r.text("pinned_mem_limit")
            )
        } else {
            let mut bits = Vec::new();
            if let Some(i) = r.num("iters_per_s") {
                bits.push(format!("{i:.1} it/s"));
            }
            if let Some(t) = r.num("tflops") {
                bits.push(format!("{t:.2} TFLOP/s"));
            }
            if let Some(a) = r.get("allocated").and_then(Value::as_i64) {
                bits.push(format!("allocated {a} B"));
            }
            bits.join(" ")
        };
        let label = calc::cut(&r.text("label"), 24);
        let line = row([
            &label,
            &r.text("uid"),
            &r.text("rc"),
            &fmt(rel("t_launch")),
            &fmt(rel("t_first_kernel")),
            &fmt(rel("t_end")),
            &fmt(r.num("first_kernel_latency_s")),
            &detail,
        ]);
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(out: &str, err: &str, rc: Option<i32>) -> Raw {
        Raw {
            label: "pu-1000".into(),
            uid: 1000,
            rc,
            t_launch: Some(100.0),
            t_exit: Some(102.5),
            out: out.into(),
            err: err.into(),
        }
    }

    #[test]
    fn a_simulated_client_is_read_from_its_mps_client_line() {
        let out = "mps-client pid=7 uid=1000 server=42 server_uid=1000 waited_ms=1468 active_thread_percentage=25.0 pinned_mem_limit=0=2048M shm=ok\n";
        let r = normalize(&raw(out, "", Some(0)), Kind::Sim);
        assert!(r.ok());
        assert_eq!(r.text("server_pid"), "42");
        assert_eq!(r.text("active_thread_percentage"), "25.0");
        assert_eq!(r.text("pinned_mem_limit"), "0=2048M");
        assert_eq!(r.num("waited_ms"), Some(1468.0));
        assert_eq!(r.num("t_first_kernel"), Some(101.468));
        assert_eq!(r.num("t_end"), Some(102.5));
        assert!((r.num("first_kernel_latency_s").unwrap() - 1.468).abs() < 1e-9);
        assert_eq!(r.num("wall_s"), Some(2.5));
        assert_eq!(r.get("error"), None);
        let line: Value = serde_json::from_str(&r.line("RID", "per-user", true)).unwrap();
        assert_eq!(line["run"], "RID");
        assert_eq!(line["section"], "per-user");
        assert_eq!(line["simulate"], true);
        assert_eq!(line["sim"]["shm"], "ok");
    }

    #[test]
    fn a_failed_simulated_client_says_why() {
        let err =
            "gpushare-mps-sim client: MPS server 9 shared memory not visible (CUDA error 805)\n";
        let r = normalize(&raw("", err, Some(4)), Kind::Sim);
        assert!(!r.ok());
        assert_eq!(r.text("rc"), "4");
        assert!(
            r.error()
                .starts_with("gpushare-mps-sim client: MPS server 9"),
            "{r:?}"
        );
        assert_eq!(r.num("t_first_kernel"), None);
        let killed = normalize(&raw("", "a\nb\nc\nd\n", Some(124)), Kind::Sim);
        assert_eq!(
            killed.error(),
            "killed by the tier's deadline (rc 124); b | c | d"
        );
        let silent = normalize(&raw("", "", None), Kind::Sim);
        assert_eq!(silent.error(), "no output (rc none)");
    }

    #[test]
    fn a_real_client_is_read_from_the_workloads_json_lines() {
        let out = concat!(
            "{\"event\": \"first_kernel\", \"t_first_kernel\": 101.0}\n",
            "not json\n",
            "{\"event\": \"result\", \"ok\": true, \"error\": null, \"uid\": 1000, \"t_start\": 100.1,",
            " \"t_first_kernel\": 101.0, \"t_end\": 107.0, \"iters_per_s\": 45.97, \"tflops\": 50.5,",
            " \"device\": \"NVIDIA H100 80GB HBM3\"}\n"
        );
        let r = normalize(&raw(out, "", Some(0)), Kind::Real);
        assert!(r.ok());
        assert_eq!(r.num("t_end"), Some(107.0));
        assert_eq!(r.num("first_kernel_latency_s"), Some(1.0));
        assert_eq!(r.text("device"), "NVIDIA H100 80GB HBM3");
        assert_eq!(r.text("iters_per_s"), "45.970000");
        assert_eq!(r.0["payload"]["tflops"], 50.5);
        // The workload said ok, its exit status did not: not ok.
        assert!(!normalize(&raw(out, "", Some(1)), Kind::Real).ok());
    }

    #[test]
    fn a_refused_allocation_keeps_the_workloads_error() {
        let out = "{\"event\": \"first_kernel\", \"t_first_kernel\": 101.0}\n{\"event\": \"result\", \"ok\": false, \"error\": \"OutOfMemoryError: CUDA out of memory.\", \"t_first_kernel\": 101.0, \"t_end\": 101.2}\n";
        let r = normalize(&raw(out, "Traceback\n", Some(1)), Kind::Real);
        assert!(!r.ok());
        assert_eq!(r.error(), "OutOfMemoryError: CUDA out of memory.");
        assert_eq!(r.text("ok"), "0");
        // Killed before any line: t_end is the exit the tier saw.
        let r = normalize(&raw("", "", Some(137)), Kind::Real);
        assert_eq!(r.num("t_end"), Some(102.5));
        assert!(r
            .error()
            .starts_with("killed by the tier's deadline (rc 137)"));
    }

    #[test]
    fn the_table_has_a_row_per_client_relative_to_the_first_launch() {
        let a = normalize(
            &raw("mps-client uid=1000 server=42 server_uid=1000 waited_ms=0 active_thread_percentage=100.0 pinned_mem_limit=none\n", "", Some(0)),
            Kind::Sim,
        );
        let mut b_raw = raw("", "boom\n", Some(1));
        b_raw.label = "a-label-longer-than-twenty-four".into();
        b_raw.t_launch = Some(101.0);
        let b = normalize(&b_raw, Kind::Sim);
        let t = table(&[&a, &b]);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 4, "{t}");
        assert!(lines[0].starts_with("client") && lines[0].ends_with("detail"));
        assert!(lines[2].starts_with("pu-1000                   1000   0    0.00    0.00    2.50     0.00  server=42(uid 1000) threads=100.0 mem=none"), "{t}");
        assert!(lines[3].starts_with("a-label-longer-than-twen"), "{t}");
        assert!(lines[3].ends_with("ERROR: boom"), "{t}");
        assert_eq!(table(&[]), "");
    }
}
