//! Helper modes of the tier's own executable, for round 4 (round4.rs), run as child
//! processes so that the tier itself never loads NVML (whose threads would outlive the
//! call) and so that a helper can run in another PID namespace or as another UID:
//!
//! ```text
//! gpu-<hash> --r4-nvml SAMPLES EVERY_MS    NVML's process lists of every GPU, SAMPLES times
//! gpu-<hash> --r4-connect SOCKET           connect(2) to a Unix socket, stream and seqpacket
//! ```
//!
//! `--r4-nvml` prints one JSON line per sample: `t` (epoch seconds), and per GPU its
//! `compute` and `mps` lists (nvml-wrapper's `running_compute_processes` and
//! `mps_running_compute_processes`, the calls `gpushare watch` makes) as `[pid, bytes or
//! null]`, and `util` (`process_utilization_stats`: pid and SM %), or the error of each
//! call. `--r4-connect` prints what each socket type got.
//!
//! Invariants: a helper never fails before printing: every error is in its output.

use std::time::Duration;

use serde_json::{json, Value};

/// Runs the helper `args` names (`args[0]` is its flag); `None` when it is no helper's.
pub fn run(args: &[String]) -> Option<u8> {
    match args.first().map(String::as_str) {
        Some("--r4-nvml") => {
            let n = args.get(1).and_then(|n| n.parse().ok()).unwrap_or(1u32);
            let every = args.get(2).and_then(|n| n.parse().ok()).unwrap_or(100u64);
            Some(nvml(n, Duration::from_millis(every)))
        }
        Some("--r4-connect") => Some(connect(args.get(1).map(String::as_str).unwrap_or(""))),
        _ => None,
    }
}

fn nvml(samples: u32, every: Duration) -> u8 {
    use nvml_wrapper::enums::device::UsedGpuMemory;
    use nvml_wrapper::Nvml;
    let nvml = match Nvml::init() {
        Ok(n) => n,
        Err(e) => {
            println!(
                "{}",
                json!({"t": crate::calc::epoch_now(), "error": format!("nvmlInit: {e}")})
            );
            return 0;
        }
    };
    let mut last_util: u64 = 0;
    for i in 0..samples {
        if i > 0 {
            std::thread::sleep(every);
        }
        let mut gpus = Vec::new();
        let count = nvml.device_count().unwrap_or(0);
        for index in 0..count {
            let Ok(d) = nvml.device_by_index(index) else {
                continue;
            };
            let list = |r: Result<
                Vec<nvml_wrapper::struct_wrappers::device::ProcessInfo>,
                nvml_wrapper::error::NvmlError,
            >|
             -> Value {
                match r {
                    Ok(v) => json!(v
                        .iter()
                        .map(|p| json!([
                            p.pid,
                            match p.used_gpu_memory {
                                UsedGpuMemory::Used(b) => json!(b),
                                UsedGpuMemory::Unavailable => Value::Null,
                            }
                        ]))
                        .collect::<Vec<_>>()),
                    Err(e) => json!({"error": e.to_string()}),
                }
            };
            let util = match d.process_utilization_stats(last_util) {
                Ok(v) => {
                    last_util = v.iter().map(|s| s.timestamp).max().unwrap_or(last_util);
                    json!(v
                        .iter()
                        .map(|s| json!([s.pid, s.sm_util, s.mem_util]))
                        .collect::<Vec<_>>())
                }
                Err(e) => json!({"error": e.to_string()}),
            };
            gpus.push(json!({"index": index, "uuid": d.uuid().unwrap_or_default(),
                "compute": list(d.running_compute_processes()),
                "mps": list(d.mps_running_compute_processes()),
                "util": util}));
        }
        println!(
            "{}",
            json!({"t": crate::calc::epoch_now(), "pid_ns_self": std::process::id(), "gpus": gpus})
        );
        use std::io::Write;
        let _ = std::io::stdout().flush();
    }
    0
}

fn connect(path: &str) -> u8 {
    use nix::sys::socket::{connect, socket, AddressFamily, SockFlag, SockType, UnixAddr};
    let mut out = Vec::new();
    for (name, ty) in [
        ("stream", SockType::Stream),
        ("seqpacket", SockType::SeqPacket),
    ] {
        let r = UnixAddr::new(path).and_then(|addr| {
            let fd = socket(AddressFamily::Unix, ty, SockFlag::SOCK_CLOEXEC, None)?;
            connect(std::os::fd::AsRawFd::as_raw_fd(&fd), &addr)
        });
        out.push(match r {
            Ok(()) => format!("{name}: connected"),
            Err(e) => format!("{name}: {e}"),
        });
    }
    println!("uid {}: {}", nix::unistd::getuid(), out.join("; "));
    0
}
