//! `gpushare-mps-sim client`: a stand-in CUDA process. It does what the CUDA driver does at
//! init under MPS, as far as a container runtime can observe: connect to the control daemon
//! through CUDA_MPS_PIPE_DIRECTORY, wait for a server, check that the server's shared memory
//! is visible in its own /dev/shm, then "run" for `--hold` seconds. Its line reports the
//! limits it runs under and the CUDA_MPS_CLIENT_PRIORITY it was given.
//!
//! With `--gpu <uuid>` it has that GPU's device nodes, as a container given the GPU has:
//! it holds a context there (`gpu::Context`, what the fake NVML lists) with `--alloc`
//! bytes, as an MPS client, or, where no control daemon answers at
//! CUDA_MPS_PIPE_DIRECTORY, directly, as CUDA falls back to the GPU without MPS. Through
//! MPS an allocation above its pinned limit is refused, as the client's CUDA library
//! refuses it, except where its own CUDA_MPS_PINNED_DEVICE_MEM_LIMIT names a device it
//! cannot see (neither `0` nor its `--gpu`): that drops every pinned limit, as measured on
//! driver 580 (docs/mps.md). When the daemon ends it with `terminate_client` it prints a
//! second line and holds on (a real process keeps running with a sticky error until it
//! is killed).
//!
//! Exit codes: 0 attached and ran; 1 could not connect, bad environment or refused by the
//! daemon; 2 allocation above the pinned limit; 3 still queued when `--timeout` ran out; 4
//! the server's shm file is not visible, i.e. this process does not share /dev/shm with the
//! daemon; 5 terminated by the daemon. CUDA error numbers in messages are the runtime's: 2
//! cudaErrorMemoryAllocation, 805 cudaErrorMpsConnectionFailed, 807
//! cudaErrorMpsServerNotReady, 810 cudaErrorMpsClientTerminated.
//!
//! Invariant: on success exactly one line goes to stdout, flushed before the hold starts, so
//! a test can read it while the client still holds its server; a termination adds one.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::gpu::{Context, Kind};
use crate::limits::{DeviceLimits, Percentage};
use crate::server::shm_path;
use crate::wire::{self, Hello, Ready, WireError};

const ME: &str = "gpushare-mps-sim client";

#[derive(Debug, Clone, PartialEq)]
pub struct ClientOptions {
    pub hold: Duration,
    pub timeout: Duration,
    /// The GPU whose device nodes it has (`--gpu`).
    pub gpu: Option<String>,
    /// Bytes of device memory it allocates (`--alloc`).
    pub alloc: u64,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            hold: Duration::ZERO,
            timeout: Duration::from_secs(30),
            gpu: None,
            alloc: 0,
        }
    }
}

pub fn run(pipe_dir: &Path, opts: &ClientOptions) -> u8 {
    let hello = match hello_from_env() {
        Ok(h) => h,
        Err(msg) => {
            eprintln!("{ME}: {msg}");
            return 1;
        }
    };
    let socket = pipe_dir.join("control");
    let stream = match UnixStream::connect(&socket) {
        Ok(s) => s,
        Err(_) if opts.gpu.is_some() => return direct(opts),
        Err(e) => {
            eprintln!(
                "{ME}: cannot connect to MPS control daemon at {}: {e} (CUDA error 805)",
                socket.display()
            );
            return 1;
        }
    };
    if let Err(e) = (&stream).write_all(format!("{}\n", hello.to_line()).as_bytes()) {
        eprintln!("{ME}: cannot talk to MPS control daemon: {e} (CUDA error 805)");
        return 1;
    }
    let ready = match wait_ready(&stream, opts.timeout) {
        Ok(r) => r,
        Err(Waited::TimedOut) => {
            eprintln!(
                "{ME}: still queued for an MPS server after {} s (CUDA error 807)",
                secs(opts.timeout)
            );
            return 3;
        }
        Err(Waited::Refused(msg)) => {
            eprintln!("{ME}: MPS control daemon refused the client: {msg} (CUDA error 805)");
            return 1;
        }
        Err(Waited::Broken(msg)) => {
            eprintln!("{ME}: {msg} (CUDA error 805)");
            return 1;
        }
    };
    let shm = shm_path(ready.server_pid);
    if std::fs::symlink_metadata(&shm).is_err() {
        eprintln!(
            "{ME}: MPS server {} shared memory {} not visible: /dev/shm is not shared with the MPS daemon (CUDA error 805)",
            ready.server_pid,
            shm.display()
        );
        return 4;
    }
    let lifted = hello
        .mem
        .devices()
        .any(|d| d != "0" && Some(d) != opts.gpu.as_deref());
    let limit = [Some("0"), opts.gpu.as_deref()]
        .into_iter()
        .flatten()
        .filter_map(|d| ready.mem.get(d))
        .map(|m| m.bytes())
        .min()
        .filter(|_| !lifted);
    if let Some(limit) = limit.filter(|&l| opts.alloc > l) {
        eprintln!(
            "{ME}: cannot allocate {} bytes: above the pinned device memory limit of {limit} bytes (CUDA error 2)",
            opts.alloc
        );
        return 2;
    }
    let _context = match opts
        .gpu
        .as_deref()
        .map(|g| Context::hold(g, Kind::Mps, opts.alloc))
    {
        Some(Err(e)) => {
            eprintln!("{ME}: cannot hold a context: {e}");
            return 1;
        }
        held => held,
    };
    // A v3 daemon names the namespace and server at the end; a legacy line is unchanged.
    let names = ready
        .names
        .as_ref()
        .map(|(ns, s)| format!(" namespace={ns} server_name={s}"))
        .unwrap_or_default();
    let line = format!(
        "mps-client pid={} uid={} server={} server_uid={} waited_ms={} active_thread_percentage={} pinned_mem_limit={} client_priority={} allocated={} shm=ok{names}\n",
        std::process::id(),
        nix::unistd::getuid(),
        ready.server_pid,
        ready.server_uid,
        ready.waited_ms,
        ready.percentage,
        ready.mem,
        // Reported as the client got it (`-`: unset); the server does not act on it.
        non_empty_env("CUDA_MPS_CLIENT_PRIORITY").unwrap_or_else(|| "-".into()),
        opts.alloc
    );
    print_line(&line);
    let code = hold_attached(&stream, opts.hold);
    drop(stream);
    code
}

fn print_line(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(line.as_bytes());
    let _ = out.flush();
}

/// Holds the server for `hold`; the daemon's `TERMINATED` (`terminate_client`) is told on
/// stdout, and the process holds on all the same. 5 when it was terminated, else 0.
fn hold_attached(stream: &UnixStream, hold: Duration) -> u8 {
    let deadline = Instant::now() + hold;
    let mut reader = BufReader::new(stream);
    let mut code = 0;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return code;
        }
        if stream.set_read_timeout(Some(left)).is_err() {
            std::thread::sleep(left);
            return code;
        }
        let mut line = String::new();
        match reader.read_line(&mut line) {
            Ok(0) => {
                // The daemon is gone; a real process runs on until it touches the GPU.
                std::thread::sleep(deadline.saturating_duration_since(Instant::now()));
                return code;
            }
            Ok(_) if line.trim_end() == "TERMINATED" => {
                print_line(&format!(
                    "mps-client terminated pid={} (CUDA error 810)\n",
                    std::process::id()
                ));
                code = 5;
            }
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => std::thread::sleep(deadline.saturating_duration_since(Instant::now())),
        }
    }
}

/// No MPS daemon answers and the process has the GPU's device nodes: CUDA uses the GPU
/// directly, with a context of its own and no MPS limit.
fn direct(opts: &ClientOptions) -> u8 {
    let Some(gpu) = opts.gpu.as_deref() else {
        return 1;
    };
    let _context = match Context::hold(gpu, Kind::Compute, opts.alloc) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{ME}: cannot hold a context: {e}");
            return 1;
        }
    };
    print_line(&format!(
        "direct-client pid={} uid={} gpu={gpu} allocated={}\n",
        std::process::id(),
        nix::unistd::getuid(),
        opts.alloc
    ));
    std::thread::sleep(opts.hold);
    0
}

fn secs(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s.fract() == 0.0 {
        format!("{s:.0}")
    } else {
        format!("{s}")
    }
}

fn hello_from_env() -> Result<Hello, String> {
    let percentage = match non_empty_env("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE") {
        None => None,
        Some(v) => Some(
            Percentage::parse(&v).map_err(|e| format!("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE: {e}"))?,
        ),
    };
    let mem = match non_empty_env("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT") {
        None => DeviceLimits::default(),
        Some(v) => {
            DeviceLimits::parse(&v).map_err(|e| format!("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT: {e}"))?
        }
    };
    Ok(Hello {
        pid: std::process::id(),
        percentage,
        mem,
    })
}

fn non_empty_env(name: &str) -> Option<String> {
    std::env::var(name)
        .ok()
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
}

enum Waited {
    TimedOut,
    Refused(String),
    Broken(String),
}

fn wait_ready(stream: &UnixStream, timeout: Duration) -> Result<Ready, Waited> {
    let deadline = Instant::now() + timeout;
    let mut reader = BufReader::new(stream);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Waited::TimedOut);
        }
        stream
            .set_read_timeout(Some(left))
            .map_err(|e| Waited::Broken(format!("set read timeout: {e}")))?;
        let line = match wire::read_line(&mut reader) {
            Ok(Some(line)) => line,
            Ok(None) => {
                return Err(Waited::Broken(
                    "MPS control daemon closed the connection".to_string(),
                ))
            }
            Err(WireError::Io(e))
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return Err(Waited::TimedOut)
            }
            Err(e) => {
                return Err(Waited::Broken(format!(
                    "reading from MPS control daemon: {e}"
                )))
            }
        };
        if line == "QUEUED" {
            continue;
        }
        if let Some(msg) = line.strip_prefix("ERROR ") {
            return Err(Waited::Refused(msg.to_string()));
        }
        return Ready::parse(&line).map_err(|e| Waited::Broken(e.to_string()));
    }
}
