//! The CRI pod-start benchmark's pieces, shared by `cri_pod_start_bench` (runc, the shim
//! class, the hook-only class) and `nri_pod_start_bench` (the NRI plugin): one pod start as
//! the kubelet issues it (RunPodSandbox, CreateContainer, StartContainer of `true` as
//! UID 1000), timed from the CRI client after an idle pause, the pod removed untimed; the
//! variants rotate per round; medians and paired ratios printed as BENCHMARKS.md quotes
//! them.
//!
//! Invariants: round 0 warms up (it starts the daemon) and is not counted; a paired ratio
//! is each round's time over its baseline's in the same round, so drift between rounds
//! does not move it.

use std::time::{Duration, Instant};

use crate::harness::Env;
use crate::node::{ContainerSpec, Node, Pod, PodSpec};

/// The rounds to count: `GPUSHARE_BENCH_ROUNDS`, default 15.
pub fn rounds() -> usize {
    std::env::var("GPUSHARE_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(15)
}

/// Sets the env's config to log at `info`, not the tests' `debug`: what a node runs.
pub fn at_info_level(env: &Env) {
    let cfg = std::fs::read_to_string(&env.config).unwrap();
    assert!(cfg.contains("log-level = \"debug\""));
    std::fs::write(
        &env.config,
        cfg.replace("log-level = \"debug\"", "log-level = \"info\""),
    )
    .unwrap();
}

/// One timed pod start through `handler`, asking for GPU 0 when `request`: after a 100 ms
/// idle pause, RunPodSandbox + CreateContainer + StartContainer. The milliseconds, the
/// pod and its container's id; [`remove`] takes the pod away.
pub fn start(node: &mut Node, name: &str, handler: &str, request: bool) -> (f64, Pod, String) {
    let annotations: &[(&str, &str)] = if request {
        &[("gpushare.io/device", "0")]
    } else {
        &[]
    };
    let config = node.pod_config(&PodSpec {
        name,
        annotations,
        run_as_user: Some(1000),
        ..Default::default()
    });
    std::thread::sleep(Duration::from_millis(100));
    let t = Instant::now();
    let id = node
        .cri()
        .run_pod(&config, handler)
        .unwrap_or_else(|e| panic!("RunPodSandbox {name}: {e}\n{}", node.log_text()));
    let pod = Pod { id, config };
    let container = node.run(
        &pod,
        &ContainerSpec {
            name: "c",
            script: "true",
            run_as_user: Some(1000),
            ..Default::default()
        },
    );
    (t.elapsed().as_secs_f64() * 1e3, pod, container)
}

/// Runs round 0 (the warm-up, not kept) and `rounds` counted rounds of `variants` pod
/// starts, each round in an order rotated by one, so that no variant always runs first.
/// `one(round, variant)` does one start and returns its milliseconds. The times per variant.
pub fn rotated(
    variants: usize,
    rounds: usize,
    mut one: impl FnMut(usize, usize) -> f64,
) -> Vec<Vec<f64>> {
    let mut ms = vec![Vec::new(); variants];
    for r in 0..=rounds {
        for k in 0..variants {
            let i = (k + r) % variants;
            let elapsed = one(r, i);
            if r > 0 {
                ms[i].push(elapsed);
            }
        }
    }
    ms
}

/// Stops and removes a pod [`start`] made, untimed.
pub fn remove(node: &Node, pod: &Pod) {
    let _ = node.cri().stop_pod(&pod.id);
    let _ = node.cri().remove_pod(&pod.id);
}

/// The median, p10 and p90 of `v`.
pub fn percentiles(v: &[f64]) -> (f64, f64, f64) {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    (s[s.len() / 2], s[s.len() / 10], s[s.len() * 9 / 10])
}

/// Prints `title` with the machine's load, then a line per variant: its median [p10 -
/// p90], the ratio of its median to its baseline's (`baseline(i)`) and the paired median.
pub fn report(title: &str, labels: &[&str], ms: &[Vec<f64>], baseline: impl Fn(usize) -> usize) {
    println!(
        "{title}, load {}",
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim()
    );
    let width = labels.iter().map(|l| l.len()).max().unwrap_or(0) + 2;
    for (i, label) in labels.iter().enumerate() {
        let (m, p10, p90) = percentiles(&ms[i]);
        let b = baseline(i);
        let paired: Vec<f64> = ms[i].iter().zip(&ms[b]).map(|(x, y)| x / y).collect();
        println!(
            "  {label:<width$} {m:7.1} ms [{p10:7.1} - {p90:7.1}]  x{:.3} vs {} (paired median x{:.3})",
            m / percentiles(&ms[b]).0,
            labels[b],
            percentiles(&paired).0
        );
    }
}
