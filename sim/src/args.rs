//! Command line, shaped like `nvidia-cuda-mps-control`'s: `-d`, `-f`, `-v`, `-h`, the multi-user
//! option (`-M`, or `-multiuser-server` as the MPS guide spells it, or `-m`/`--multiuser` as
//! NVIDIA's MPS v3 interface page spells it), `-p`/`--protocol <2|3>`, nothing for control
//! client mode, `<module> <verb> …` for the v3 CLI (`v3::grammar` parses the rest); plus `client [--hold S] [--timeout S] [--gpu UUID] [--alloc SIZE]` for the stand-in
//! CUDA process,
//! `subreaper <command> [args…]` for a stand-in engine subreaper that waits (`subreaper`),
//! `hold-control <connections> [--every <s>]` for a stand-in tenant that jams the control
//! socket (`hold`), and two hidden modes this binary re-executes itself with.
//!
//! Invariant: parsing is pure (the environment's say on the protocol is applied by
//! [`resolve_protocol`], also pure); anything not recognised is a [`UsageError`], which
//! `main` reports on one line with exit code 2.

use std::time::Duration;

use thiserror::Error;

use crate::cuda_client::ClientOptions;

#[derive(Debug, Clone, PartialEq)]
pub enum Mode {
    Version,
    /// `-h`: usage; `protocol` as the flag gave it (the environment may still override).
    Help {
        protocol: Option<u8>,
    },
    /// `-f` (foreground) or `-d` (background); `protocol` as the flag gave it.
    Daemon {
        background: bool,
        multiuser: bool,
        protocol: Option<u8>,
    },
    /// Hidden: the re-executed child that `-d` starts, with the protocol its launcher chose.
    DaemonChild {
        multiuser: bool,
        protocol: u8,
    },
    /// `<module> <verb> [args…]`: a v3 CLI call (the words after any `-p <n>`).
    Cli(Vec<String>),
    /// No option: read control commands from stdin.
    Control,
    /// `-q`/`--quit`: quit the daemon found through CUDA_MPS_PIPE_DIRECTORY.
    Quit,
    Client(ClientOptions),
    /// Hidden: an MPS server process started by the daemon.
    Server,
    /// `subreaper <command> [args…]`: run the command as a waiting child subreaper.
    Subreaper(Vec<String>),
    /// `hold-control <connections> [--every <s>]`: jam `<pipe>/control`.
    HoldControl {
        connections: usize,
        every: Duration,
    },
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum UsageError {
    #[error("unknown option {0:?}; usage: gpushare-mps-sim [-d | -f] [-M] | -v | client [--hold <s>] [--timeout <s>] [--gpu <uuid>] [--alloc <size>] | subreaper <command> [args...] | hold-control <connections> [--every <s>]")]
    Unknown(String),
    #[error("options -d and -f cannot be combined")]
    DaemonAndForeground,
    #[error("option -M needs -d or -f")]
    MultiuserAlone,
    #[error("invalid protocol {0:?}: expected 2 or 3")]
    Protocol(String),
    #[error("protocol 3 is not supported by this binary (it is a protocol 2 one, as before driver 615); usage: gpushare-mps-sim [-d | -f] [-M] [-p 2] | -v | -h")]
    ProtocolUnsupported,
    #[error("option {0} needs a value")]
    MissingValue(String),
    #[error("invalid number of connections {0:?}")]
    Connections(String),
    #[error("invalid number of seconds {value:?} for {option}")]
    Seconds { option: String, value: String },
    #[error("invalid value {value:?} for {option}: {why}")]
    Value {
        option: String,
        value: String,
        why: &'static str,
    },
}

pub const HIDDEN_SERVER: &str = "--internal-server";
pub const HIDDEN_DAEMON: &str = "--internal-daemon";

/// The v3 CLI's modules, as NVIDIA's MPS v3 interface page lists them.
pub const V3_MODULES: [&str; 8] = [
    "server",
    "namespace",
    "client",
    "device",
    "sm-partition",
    "feature",
    "memacct",
    "context-share",
];

/// The verbs of the `client` module: `client list` is the v3 CLI, `client [--hold …]` the
/// stand-in CUDA process.
const CLIENT_VERBS: [&str; 4] = ["list", "get", "terminate", "help"];

pub fn parse(args: &[String]) -> Result<Mode, UsageError> {
    match args.first().map(String::as_str) {
        Some("client")
            if args
                .get(1)
                .is_some_and(|v| CLIENT_VERBS.contains(&v.as_str())) =>
        {
            return Ok(Mode::Cli(args.to_vec()))
        }
        Some("client") => return parse_client(&args[1..]).map(Mode::Client),
        Some(m) if V3_MODULES.contains(&m) => return Ok(Mode::Cli(args.to_vec())),
        Some("subreaper") if args.len() > 1 => return Ok(Mode::Subreaper(args[1..].to_vec())),
        Some("hold-control") => return parse_hold(&args[1..]),
        // The server ignores its arguments; the uid after the flag shows in `ps` only.
        Some(HIDDEN_SERVER) => return Ok(Mode::Server),
        Some(HIDDEN_DAEMON) => {
            return match &args[1..] {
                [] => Ok(Mode::DaemonChild {
                    multiuser: false,
                    protocol: 2,
                }),
                [m] if m == "-M" => Ok(Mode::DaemonChild {
                    multiuser: true,
                    protocol: 2,
                }),
                [p, v] if p == "-p" && v == "3" => Ok(Mode::DaemonChild {
                    multiuser: false,
                    protocol: 3,
                }),
                [m, p, v] if m == "-M" && p == "-p" && v == "3" => Ok(Mode::DaemonChild {
                    multiuser: true,
                    protocol: 3,
                }),
                [other, ..] => Err(UsageError::Unknown(other.clone())),
            }
        }
        _ => {}
    }
    if matches!(args, [q] if q == "-q" || q == "--quit") {
        return Ok(Mode::Quit);
    }
    let (mut d, mut f, mut v, mut m, mut h) = (false, false, false, false, false);
    let mut protocol = None;
    let mut it = args.iter().enumerate();
    while let Some((i, arg)) = it.next() {
        match arg.as_str() {
            "-d" | "--daemon" => d = true,
            "-f" | "--foreground" => f = true,
            "-v" => v = true,
            "-h" | "--help" => h = true,
            "-M" | "-multiuser-server" | "--multiuser-server" | "-m" | "--multiuser" => m = true,
            "-p" | "--protocol" => {
                let value = it
                    .next()
                    .map(|(_, v)| v)
                    .ok_or_else(|| UsageError::MissingValue(arg.clone()))?;
                protocol = Some(protocol_number(value)?);
            }
            other if other.starts_with("--protocol=") => {
                protocol = Some(protocol_number(&other["--protocol=".len()..])?);
            }
            // `-p 3 server list`: KAI's agent passes -p 3 on every CLI call.
            other
                if V3_MODULES.contains(&other)
                    && protocol.is_some()
                    && !(d || f || v || m || h) =>
            {
                return Ok(Mode::Cli(args[i..].to_vec()));
            }
            other => return Err(UsageError::Unknown(other.to_string())),
        }
    }
    match (d, f, v, m) {
        _ if h => Ok(Mode::Help { protocol }),
        (_, _, true, _) => Ok(Mode::Version),
        (true, true, _, _) => Err(UsageError::DaemonAndForeground),
        (true, false, _, multiuser) => Ok(Mode::Daemon {
            background: true,
            multiuser,
            protocol,
        }),
        (false, true, _, multiuser) => Ok(Mode::Daemon {
            background: false,
            multiuser,
            protocol,
        }),
        (false, false, _, true) => Err(UsageError::MultiuserAlone),
        (false, false, false, false) => Ok(Mode::Control),
    }
}

fn protocol_number(value: &str) -> Result<u8, UsageError> {
    match value {
        "2" => Ok(2),
        "3" => Ok(3),
        other => Err(UsageError::Protocol(other.to_string())),
    }
}

/// The protocol a daemon (or `-h`) runs: NVIDIA's MPS v3 interface page: protocol 2 is the
/// default, `-p`/`--protocol` selects, and CUDA_MPS_PROTOCOL_VERSION wins over the flag.
/// `supported` is GPUSHARE_SIM_PROTOCOLS: `2` makes this a binary from before driver 615,
/// which refuses protocol 3 (how such a binary answers is not documented; a usage error is
/// the simulator's choice).
pub fn resolve_protocol(
    flag: Option<u8>,
    env: Option<&str>,
    supported: Option<&str>,
) -> Result<u8, UsageError> {
    let chosen = match env.map(str::trim).filter(|e| !e.is_empty()) {
        Some(e) => protocol_number(e)?,
        None => flag.unwrap_or(2),
    };
    let only_legacy = supported.map(str::trim) == Some("2");
    if chosen == 3 && only_legacy {
        return Err(UsageError::ProtocolUnsupported);
    }
    Ok(chosen)
}

fn parse_client(args: &[String]) -> Result<ClientOptions, UsageError> {
    let mut opts = ClientOptions::default();
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let (name, inline) = match arg.split_once('=') {
            Some((n, v)) => (n, Some(v.to_string())),
            None => (arg.as_str(), None),
        };
        if !matches!(name, "--hold" | "--timeout" | "--gpu" | "--alloc") {
            return Err(UsageError::Unknown(arg.clone()));
        }
        let value = match inline {
            Some(v) => v,
            None => it
                .next()
                .cloned()
                .ok_or_else(|| UsageError::MissingValue(name.to_string()))?,
        };
        let bad = |why| UsageError::Value {
            option: name.to_string(),
            value: value.clone(),
            why,
        };
        match name {
            "--hold" => opts.hold = seconds(name, &value)?,
            "--timeout" => opts.timeout = seconds(name, &value)?,
            "--gpu" if crate::gpu::is_uuid(&value) => opts.gpu = Some(value),
            "--gpu" => return Err(bad("expected a GPU-… or MIG-… UUID")),
            _ => {
                opts.alloc = crate::limits::MemLimit::parse(&value)
                    .map_err(|_| bad("expected an integer followed by M or G"))?
                    .bytes()
            }
        }
    }
    Ok(opts)
}

fn parse_hold(args: &[String]) -> Result<Mode, UsageError> {
    let (n, every) = match args {
        [n] => (n, Duration::from_millis(1500)),
        [n, opt, value] if opt == "--every" => (n, seconds(opt, value)?),
        [] => return Err(UsageError::MissingValue("hold-control".into())),
        [_, other, ..] => return Err(UsageError::Unknown(other.clone())),
    };
    let connections = n
        .parse()
        .ok()
        .filter(|&c: &usize| c > 0)
        .ok_or_else(|| UsageError::Connections(n.clone()))?;
    Ok(Mode::HoldControl { connections, every })
}

fn seconds(option: &str, value: &str) -> Result<Duration, UsageError> {
    let bad = || UsageError::Seconds {
        option: option.to_string(),
        value: value.to_string(),
    };
    let plain = !value.is_empty()
        && value.chars().all(|c| c.is_ascii_digit() || c == '.')
        && value.chars().any(|c| c.is_ascii_digit());
    if !plain {
        return Err(bad());
    }
    let secs: f64 = value.parse().map_err(|_| bad())?;
    Duration::try_from_secs_f64(secs).map_err(|_| bad())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(args: &[&str]) -> Result<Mode, UsageError> {
        parse(&args.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    }

    #[test]
    fn daemon_options() {
        let daemon = |background, multiuser| {
            Ok(Mode::Daemon {
                background,
                multiuser,
                protocol: None,
            })
        };
        assert_eq!(p(&[]), Ok(Mode::Control));
        assert_eq!(p(&["-d"]), daemon(true, false));
        assert_eq!(p(&["-f"]), daemon(false, false));
        assert_eq!(p(&["-d", "-M"]), daemon(true, true));
        assert_eq!(p(&["-M", "-f"]), daemon(false, true));
        assert_eq!(p(&["-multiuser-server", "-d"]), daemon(true, true));
        assert_eq!(p(&["-v"]), Ok(Mode::Version));
        assert_eq!(p(&["-q"]), Ok(Mode::Quit));
        assert_eq!(p(&["--quit"]), Ok(Mode::Quit));
        assert_eq!(p(&["-d", "-f"]), Err(UsageError::DaemonAndForeground));
        assert_eq!(p(&["-M"]), Err(UsageError::MultiuserAlone));
        assert_eq!(p(&["-x"]), Err(UsageError::Unknown("-x".into())));
        assert_eq!(
            p(&["-d", "extra"]),
            Err(UsageError::Unknown("extra".into()))
        );
        assert_eq!(p(&[HIDDEN_SERVER, "1000"]), Ok(Mode::Server));
        assert_eq!(
            p(&[HIDDEN_DAEMON, "-M"]),
            Ok(Mode::DaemonChild {
                multiuser: true,
                protocol: 2
            })
        );
        assert!(p(&[HIDDEN_DAEMON, "-x"]).is_err());
    }

    #[test]
    fn protocol_and_v3_options() {
        let v3 = |background, multiuser| {
            Ok(Mode::Daemon {
                background,
                multiuser,
                protocol: Some(3),
            })
        };
        assert_eq!(p(&["-p", "3", "-f"]), v3(false, false));
        assert_eq!(p(&["--protocol", "3", "-d", "-m"]), v3(true, true));
        assert_eq!(p(&["-f", "--protocol=3", "--multiuser"]), v3(false, true));
        assert_eq!(p(&["-p", "3", "-h"]), Ok(Mode::Help { protocol: Some(3) }));
        assert_eq!(p(&["--help"]), Ok(Mode::Help { protocol: None }));
        assert_eq!(p(&["-p", "4", "-f"]), Err(UsageError::Protocol("4".into())));
        assert_eq!(p(&["-p"]), Err(UsageError::MissingValue("-p".into())));
        assert_eq!(
            p(&[HIDDEN_DAEMON, "-M", "-p", "3"]),
            Ok(Mode::DaemonChild {
                multiuser: true,
                protocol: 3
            })
        );
        let words = |w: &[&str]| w.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            p(&["namespace", "list", "--format=csv"]),
            Ok(Mode::Cli(words(&["namespace", "list", "--format=csv"])))
        );
        assert_eq!(
            p(&["-p", "3", "server", "list"]),
            Ok(Mode::Cli(words(&["server", "list"])))
        );
        assert_eq!(
            p(&["client", "terminate", "12"]),
            Ok(Mode::Cli(words(&["client", "terminate", "12"])))
        );
        assert!(matches!(p(&["client", "--hold", "1"]), Ok(Mode::Client(_))));
        assert!(matches!(p(&["client"]), Ok(Mode::Client(_))));
    }

    #[test]
    fn the_environment_wins_over_the_flag_and_a_legacy_binary_refuses_3() {
        assert_eq!(resolve_protocol(None, None, None), Ok(2));
        assert_eq!(resolve_protocol(Some(3), None, None), Ok(3));
        assert_eq!(resolve_protocol(Some(3), Some("2"), None), Ok(2));
        assert_eq!(resolve_protocol(Some(2), Some("3"), None), Ok(3));
        assert_eq!(resolve_protocol(None, Some(""), None), Ok(2));
        assert_eq!(
            resolve_protocol(None, Some("7"), None),
            Err(UsageError::Protocol("7".into()))
        );
        assert_eq!(
            resolve_protocol(Some(3), None, Some("2")),
            Err(UsageError::ProtocolUnsupported)
        );
        assert_eq!(resolve_protocol(Some(2), None, Some("2")), Ok(2));
        assert_eq!(resolve_protocol(Some(3), None, Some("2,3")), Ok(3));
    }

    #[test]
    fn client_options() {
        let client = |hold: f64, timeout: f64| {
            Ok(Mode::Client(ClientOptions {
                hold: Duration::from_secs_f64(hold),
                timeout: Duration::from_secs_f64(timeout),
                ..ClientOptions::default()
            }))
        };
        assert_eq!(
            p(&["client", "--gpu", "GPU-1234-ab", "--alloc=3G"]),
            Ok(Mode::Client(ClientOptions {
                gpu: Some("GPU-1234-ab".into()),
                alloc: 3 << 30,
                ..ClientOptions::default()
            }))
        );
        for bad in [["--gpu", "0"], ["--gpu", "GPU-a/b"], ["--alloc", "3T"]] {
            assert!(
                matches!(
                    p(&["client", bad[0], bad[1]]),
                    Err(UsageError::Value { .. })
                ),
                "{bad:?}"
            );
        }
        assert_eq!(p(&["client"]), client(0.0, 30.0));
        assert_eq!(p(&["client", "--hold", "1.5"]), client(1.5, 30.0));
        assert_eq!(
            p(&["client", "--timeout=2", "--hold", "0.25"]),
            client(0.25, 2.0)
        );
        assert!(matches!(
            p(&["client", "--hold"]),
            Err(UsageError::MissingValue(_))
        ));
        for bad in ["-1", "abc", "1e3", "", "inf", "."] {
            assert!(
                matches!(
                    p(&["client", "--hold", bad]),
                    Err(UsageError::Seconds { .. })
                ),
                "{bad:?}"
            );
        }
        assert!(matches!(
            p(&["client", "--bogus"]),
            Err(UsageError::Unknown(_))
        ));
    }

    #[test]
    fn hold_control_options() {
        let hold = |connections, ms| {
            Ok(Mode::HoldControl {
                connections,
                every: Duration::from_millis(ms),
            })
        };
        assert_eq!(p(&["hold-control", "520"]), hold(520, 1500));
        assert_eq!(p(&["hold-control", "3", "--every", "0.5"]), hold(3, 500));
        for bad in [
            &["hold-control"][..],
            &["hold-control", "0"],
            &["hold-control", "x"],
        ] {
            assert!(p(bad).is_err(), "{bad:?}");
        }
        assert!(p(&["hold-control", "3", "--every"]).is_err());
        assert!(p(&["hold-control", "3", "--bogus", "1"]).is_err());
    }
}
