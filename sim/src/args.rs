//! Command line, shaped like `nvidia-cuda-mps-control`'s: `-d`, `-f`, `-v`, the multi-user
//! option (`-M`, or `-multiuser-server` as the MPS guide spells it), nothing for control client
//! mode; plus `client [--hold S] [--timeout S] [--gpu UUID] [--alloc SIZE]` for the stand-in
//! CUDA process,
//! `subreaper <command> [args…]` for a stand-in engine subreaper that waits (`subreaper`),
//! `hold-control <connections> [--every <s>]` for a stand-in tenant that jams the control
//! socket (`hold`), and two hidden modes this binary re-executes itself with.
//!
//! Invariant: parsing is pure; anything not recognised is a [`UsageError`], which `main`
//! reports on one line with exit code 2.

use std::time::Duration;

use thiserror::Error;

use crate::cuda_client::ClientOptions;

#[derive(Debug, Clone, PartialEq)]
pub enum Mode {
    Version,
    /// `-f` (foreground) or `-d` (background).
    Daemon {
        background: bool,
        multiuser: bool,
    },
    /// Hidden: the re-executed child that `-d` starts.
    DaemonChild {
        multiuser: bool,
    },
    /// No option: read control commands from stdin.
    Control,
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

pub fn parse(args: &[String]) -> Result<Mode, UsageError> {
    match args.first().map(String::as_str) {
        Some("client") => return parse_client(&args[1..]).map(Mode::Client),
        Some("subreaper") if args.len() > 1 => return Ok(Mode::Subreaper(args[1..].to_vec())),
        Some("hold-control") => return parse_hold(&args[1..]),
        // The server ignores its arguments; the uid after the flag shows in `ps` only.
        Some(HIDDEN_SERVER) => return Ok(Mode::Server),
        Some(HIDDEN_DAEMON) => {
            return match &args[1..] {
                [] => Ok(Mode::DaemonChild { multiuser: false }),
                [m] if m == "-M" => Ok(Mode::DaemonChild { multiuser: true }),
                [other, ..] => Err(UsageError::Unknown(other.clone())),
            }
        }
        _ => {}
    }
    let (mut d, mut f, mut v, mut m) = (false, false, false, false);
    for arg in args {
        match arg.as_str() {
            "-d" => d = true,
            "-f" => f = true,
            "-v" => v = true,
            "-M" | "-multiuser-server" | "--multiuser-server" => m = true,
            other => return Err(UsageError::Unknown(other.to_string())),
        }
    }
    match (d, f, v, m) {
        (_, _, true, _) => Ok(Mode::Version),
        (true, true, _, _) => Err(UsageError::DaemonAndForeground),
        (true, false, _, multiuser) => Ok(Mode::Daemon {
            background: true,
            multiuser,
        }),
        (false, true, _, multiuser) => Ok(Mode::Daemon {
            background: false,
            multiuser,
        }),
        (false, false, _, true) => Err(UsageError::MultiuserAlone),
        (false, false, false, false) => Ok(Mode::Control),
    }
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
            })
        };
        assert_eq!(p(&[]), Ok(Mode::Control));
        assert_eq!(p(&["-d"]), daemon(true, false));
        assert_eq!(p(&["-f"]), daemon(false, false));
        assert_eq!(p(&["-d", "-M"]), daemon(true, true));
        assert_eq!(p(&["-M", "-f"]), daemon(false, true));
        assert_eq!(p(&["-multiuser-server", "-d"]), daemon(true, true));
        assert_eq!(p(&["-v"]), Ok(Mode::Version));
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
            Ok(Mode::DaemonChild { multiuser: true })
        );
        assert!(p(&[HIDDEN_DAEMON, "-x"]).is_err());
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
