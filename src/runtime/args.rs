//! Scans runc's command line by hand, without a parser library, in a few hundred ns.
//!
//! The shim must take runc's argv exactly (docker, containerd and CRI-O build it with
//! go-runc) and only needs four facts from it: the subcommand, the bundle, the container
//! id and where runc's `--log` goes. Invariants: a value of a flag is never taken for the
//! subcommand (`--root create`, `-b create`, a container id `create`); flags are accepted
//! with one or two dashes and with `=` or a separate value, as urfave/cli (runc's parser)
//! accepts them; the last occurrence of a flag wins. An unknown global flag is taken as a
//! boolean: runc adds flags rarely, and every value flag it has today is listed here.

use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

/// runc's global flags that take a value (runc `main.go`).
const GLOBAL_VALUE_FLAGS: &[&str] = &["log", "log-format", "root", "criu", "rootless"];
/// Flags of `create` and `run` that take a value (runc `create.go`, `run.go`).
const CREATE_VALUE_FLAGS: &[&str] = &[
    "bundle",
    "b",
    "console-socket",
    "pidfd-socket",
    "pid-file",
    "preserve-fds",
];

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ArgsError {
    #[error("option --{flag} requires an argument")]
    MissingValue { flag: String },
}

/// What the shim needs to know about one invocation.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Invocation {
    /// The runc subcommand (`create`, `state`, …), if any.
    pub command: Option<String>,
    /// `--bundle` / `-b` of `create` or `run`; runc's default is the working directory.
    pub bundle: Option<PathBuf>,
    /// The first positional argument after the subcommand.
    pub container_id: Option<OsString>,
    /// runc's global `--log` file.
    pub log: Option<PathBuf>,
    /// runc's global `--log-format` is `json`.
    pub log_json: bool,
}

impl Invocation {
    /// Whether gpushare edits the spec for this invocation: only `create` and `run`.
    pub fn edits_spec(&self) -> bool {
        matches!(self.command.as_deref(), Some("create") | Some("run"))
    }

    /// The bundle's config.json path.
    pub fn spec_path(&self) -> PathBuf {
        self.bundle
            .clone()
            .unwrap_or_else(|| PathBuf::from("."))
            .join("config.json")
    }
}

/// Splits `--name=value` / `-name` into the bare name and an inline value.
/// On Unix an OsStr is bytes, so a split at the ASCII `=` is exact for any value.
fn flag_parts(arg: &OsStr) -> Option<(&str, Option<&OsStr>)> {
    let bytes = arg.as_bytes();
    if bytes.len() < 2 || bytes[0] != b'-' {
        return None;
    }
    let body = bytes.strip_prefix(b"--").unwrap_or(&bytes[1..]);
    if body.is_empty() {
        return None;
    }
    let (name, value) = match body.iter().position(|&b| b == b'=') {
        Some(i) => (&body[..i], Some(OsStr::from_bytes(&body[i + 1..]))),
        None => (body, None),
    };
    Some((std::str::from_utf8(name).ok()?, value))
}

/// The value of a flag: inline (`--x=v`) or the next argument, which is then consumed.
fn take_value(
    args: &[OsString],
    i: &mut usize,
    name: &str,
    inline: Option<&OsStr>,
) -> Result<OsString, ArgsError> {
    if let Some(v) = inline {
        return Ok(v.to_owned());
    }
    let v = args
        .get(*i)
        .cloned()
        .ok_or_else(|| ArgsError::MissingValue {
            flag: name.to_owned(),
        })?;
    *i += 1;
    Ok(v)
}

/// Scans runc's argv (without `argv[0]`).
pub fn scan(args: &[OsString]) -> Result<Invocation, ArgsError> {
    let mut inv = Invocation::default();
    let mut i = 0;
    // Global flags, up to the subcommand.
    while i < args.len() {
        let arg = &args[i];
        if arg == "--" {
            i += 1;
            break;
        }
        let Some((name, inline)) = flag_parts(arg) else {
            break;
        };
        i += 1;
        if GLOBAL_VALUE_FLAGS.contains(&name) {
            let value = take_value(args, &mut i, name, inline)?;
            match name {
                "log" => inv.log = Some(PathBuf::from(value)),
                "log-format" => inv.log_json = value == "json",
                _ => {}
            }
        }
    }
    let Some(command) = args.get(i) else {
        return Ok(inv);
    };
    inv.command = Some(command.to_string_lossy().into_owned());
    i += 1;
    if !inv.edits_spec() {
        // Only create/run need their arguments read; everything else goes to runc as is.
        inv.container_id = args.get(i).filter(|a| flag_parts(a).is_none()).cloned();
        return Ok(inv);
    }
    while i < args.len() {
        let arg = &args[i];
        i += 1;
        if arg == "--" {
            break;
        }
        let Some((name, inline)) = flag_parts(arg) else {
            inv.container_id = Some(arg.clone());
            return Ok(inv);
        };
        if CREATE_VALUE_FLAGS.contains(&name) {
            let value = take_value(args, &mut i, name, inline)?;
            if name == "bundle" || name == "b" {
                inv.bundle = Some(PathBuf::from(value));
            }
        }
    }
    inv.container_id = args.get(i).cloned();
    Ok(inv)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inv(line: &str) -> Invocation {
        let args: Vec<OsString> = line.split_whitespace().map(OsString::from).collect();
        scan(&args).unwrap()
    }

    #[test]
    fn table() {
        // (argv, command, bundle, container id, log, json)
        type Case<'a> = (
            &'a str,
            Option<&'a str>,
            Option<&'a str>,
            Option<&'a str>,
            Option<&'a str>,
            bool,
        );
        let cases: &[Case] = &[
            ("create --bundle /b c1", Some("create"), Some("/b"), Some("c1"), None, false),
            ("create --bundle=/b c1", Some("create"), Some("/b"), Some("c1"), None, false),
            ("create -bundle /b c1", Some("create"), Some("/b"), Some("c1"), None, false),
            ("create -b /b c1", Some("create"), Some("/b"), Some("c1"), None, false),
            ("create -b=/b c1", Some("create"), Some("/b"), Some("c1"), None, false),
            ("create -b /a --bundle /b c1", Some("create"), Some("/b"), Some("c1"), None, false),
            ("create c1", Some("create"), None, Some("c1"), None, false),
            // A bundle, a container id or a global flag value literally named create.
            ("create -b create create", Some("create"), Some("create"), Some("create"), None, false),
            ("create --bundle=create c1", Some("create"), Some("create"), Some("c1"), None, false),
            ("delete create", Some("delete"), None, Some("create"), None, false),
            ("start create", Some("start"), None, Some("create"), None, false),
            ("--root create state c1", Some("state"), None, Some("c1"), None, false),
            ("--log create kill c1 9", Some("kill"), None, Some("c1"), Some("create"), false),
            ("--root=/r --log-format=json create -b /b c", Some("create"), Some("/b"), Some("c"), None, true),
            // go-runc's exact shape, as containerd and Docker call us.
            ("--root /run/containerd/runc/default --log /b/log.json --log-format json --systemd-cgroup create --bundle /b --pid-file /b/init.pid --console-socket /s.sock c9",
             Some("create"), Some("/b"), Some("c9"), Some("/b/log.json"), true),
            ("--debug --rootless false run --detach --preserve-fds 2 -b /b c2", Some("run"), Some("/b"), Some("c2"), None, false),
            ("create --no-pivot --no-new-keyring --pidfd-socket /p -b /b c3", Some("create"), Some("/b"), Some("c3"), None, false),
            ("--version", None, None, None, None, false),
            ("features", Some("features"), None, None, None, false),
            ("", None, None, None, None, false),
            ("create -- c4", Some("create"), None, Some("c4"), None, false),
        ];
        for (line, cmd, bundle, id, log, json) in cases {
            let got = inv(line);
            assert_eq!(got.command.as_deref(), *cmd, "{line}");
            assert_eq!(got.bundle, bundle.map(PathBuf::from), "{line}");
            assert_eq!(got.container_id, id.map(OsString::from), "{line}");
            assert_eq!(got.log, log.map(PathBuf::from), "{line}");
            assert_eq!(got.log_json, *json, "{line}");
        }
    }

    #[test]
    fn only_create_and_run_edit_the_spec() {
        for (line, edits) in [
            ("create c", true),
            ("run c", true),
            ("exec c ls", false),
            ("delete create", false),
            ("--root create state c", false),
        ] {
            assert_eq!(inv(line).edits_spec(), edits, "{line}");
        }
    }

    #[test]
    fn bundle_flag_without_value_is_an_error() {
        let args: Vec<OsString> = ["create", "--bundle"].iter().map(OsString::from).collect();
        assert_eq!(
            scan(&args),
            Err(ArgsError::MissingValue {
                flag: "bundle".into()
            })
        );
        let args: Vec<OsString> = ["--log"].iter().map(OsString::from).collect();
        assert!(scan(&args).is_err());
    }

    #[test]
    fn spec_path_defaults_to_working_directory() {
        assert_eq!(inv("create c").spec_path(), PathBuf::from("./config.json"));
        assert_eq!(
            inv("create -b /x c").spec_path(),
            PathBuf::from("/x/config.json")
        );
    }

    #[test]
    fn non_utf8_values_survive() {
        use std::os::unix::ffi::OsStringExt;
        let weird = OsString::from_vec(vec![b'/', 0xff, b'b']);
        let args = vec![
            OsString::from("create"),
            OsString::from("-b"),
            weird.clone(),
            OsString::from("c"),
        ];
        assert_eq!(scan(&args).unwrap().bundle, Some(PathBuf::from(weird)));
    }
}
