//! The v3 CLI grammar: `<module> <verb> [positional…] [--key=value | key=value …] [--flag …]`,
//! as NVIDIA's MPS v3 interface page gives it, parsed into a [`Command`].
//!
//! Invariants: parsing is pure and total (every input is a `Command` or one [`GrammarError`]
//! line naming what was wrong and what is allowed); every name in a `Command` matches
//! `[a-z0-9_]{1,64}`; every size is at least 1 MiB; a verb takes only the keys and flags its
//! usage lists, each at most once.

use std::collections::{BTreeMap, BTreeSet};

use thiserror::Error;

use crate::limits::{parse_device, Percentage};

#[derive(Debug, Error, PartialEq, Eq)]
pub enum GrammarError {
    #[error("{0}")]
    Usage(String),
    #[error(
        "invalid {what} name {value:?}: names are 1 to 64 lowercase letters, digits or underscores"
    )]
    Name { what: &'static str, value: String },
    #[error("invalid {key} {value:?}: {why}")]
    Value {
        key: String,
        value: String,
        why: &'static str,
    },
    #[error("{module} {verb}: not simulated by gpushare-mps-sim (it simulates server, namespace and client)")]
    NotSimulated { module: String, verb: String },
}

/// `--format=<table|csv>[,noheader]`; NVIDIA's page does not say which is the default, the
/// simulator's is `table`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Format {
    pub csv: bool,
    pub header: bool,
}

impl Default for Format {
    fn default() -> Self {
        Format {
            csv: false,
            header: true,
        }
    }
}

/// The limits `server set` and `namespace set` take; `None` leaves a limit as it is.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LimitArgs {
    pub percentage: Option<Percentage>,
    /// Bytes.
    pub pinned: Option<u64>,
    pub priority: Option<u8>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Command {
    ServerCreate {
        name: String,
        uid: Option<u32>,
        allowed_devices: Option<Vec<String>>,
    },
    ServerSet {
        name: String,
        limits: LimitArgs,
    },
    ServerList {
        name: Option<String>,
        format: Format,
    },
    ServerDelete {
        name: String,
        force: bool,
    },
    ServerGet {
        name: String,
        field: String,
    },
    NamespaceCreate {
        name: String,
        server: String,
    },
    NamespaceSet {
        name: String,
        server: String,
        limits: LimitArgs,
    },
    NamespaceDelete {
        name: String,
        server: String,
        force: bool,
    },
    NamespaceList {
        name: Option<String>,
        server: Option<String>,
        format: Format,
    },
    NamespaceGet {
        name: String,
        server: String,
        field: String,
    },
    ClientList {
        server: Option<String>,
        format: Format,
    },
    ClientTerminate {
        pid: u32,
    },
    /// `<module> help`, `<module> <verb> help`: the text to print.
    Help(String),
}

impl Command {
    /// Whether the command changes the daemon (needs root or the server owner).
    pub fn mutates(&self) -> bool {
        !matches!(
            self,
            Command::ServerList { .. }
                | Command::ServerGet { .. }
                | Command::NamespaceList { .. }
                | Command::NamespaceGet { .. }
                | Command::ClientList { .. }
                | Command::Help(_)
        )
    }

    /// `'NAMESPACE SET'`, as the driver names a command in its refusal.
    pub fn title(&self) -> &'static str {
        match self {
            Command::ServerCreate { .. } => "SERVER CREATE",
            Command::ServerSet { .. } => "SERVER SET",
            Command::ServerList { .. } => "SERVER LIST",
            Command::ServerDelete { .. } => "SERVER DELETE",
            Command::ServerGet { .. } => "SERVER GET",
            Command::NamespaceCreate { .. } => "NAMESPACE CREATE",
            Command::NamespaceSet { .. } => "NAMESPACE SET",
            Command::NamespaceDelete { .. } => "NAMESPACE DELETE",
            Command::NamespaceList { .. } => "NAMESPACE LIST",
            Command::NamespaceGet { .. } => "NAMESPACE GET",
            Command::ClientList { .. } => "CLIENT LIST",
            Command::ClientTerminate { .. } => "CLIENT TERMINATE",
            Command::Help(_) => "HELP",
        }
    }
}

const SERVER_USAGE: &[(&str, &str)] = &[
    ("create", "server create <name> [--uid=<n>] [--allowed-devices=<uuid|ordinal,...>]"),
    ("delete", "server delete <name> [--force]"),
    ("list", "server list [<name>] [--format=<table|csv>[,noheader]]"),
    ("set", "server set <name> [--pinned-memory-limit=<size>] [--active-thread-percentage=<1-100>] [--client-priority=<0|1>]"),
    ("get", "server get <name> <field>"),
];
const NAMESPACE_USAGE: &[(&str, &str)] = &[
    ("create", "namespace create <name> --server=<s>"),
    ("delete", "namespace delete <name> --server=<s> [--force]"),
    ("list", "namespace list [<name>] [--server=<s>] [--format=<table|csv>[,noheader]]"),
    ("set", "namespace set <name> --server=<s> [--pinned-memory-limit=<size>] [--active-thread-percentage=<1-100>] [--client-priority=<0|1>]"),
    ("get", "namespace get <name> <server> <field>"),
];
const CLIENT_USAGE: &[(&str, &str)] = &[
    (
        "list",
        "client list [--server=<s>] [--all] [--format=<table|csv>[,noheader]]",
    ),
    ("terminate", "client terminate <pid>"),
];

fn usages(module: &str) -> Option<&'static [(&'static str, &'static str)]> {
    match module {
        "server" => Some(SERVER_USAGE),
        "namespace" => Some(NAMESPACE_USAGE),
        "client" => Some(CLIENT_USAGE),
        _ => None,
    }
}

fn usage_of(module: &str, verb: &str) -> &'static str {
    usages(module)
        .and_then(|u| u.iter().find(|(v, _)| *v == verb))
        .map_or("", |(_, u)| u)
}

/// The words after the module and verb, sorted into kinds.
#[derive(Debug, Default)]
struct Args {
    positional: Vec<String>,
    keys: BTreeMap<String, String>,
    flags: BTreeSet<String>,
}

/// Splits the words: `--key=value` and `key=value` are keys, other `--word`s flags, the rest
/// positional (NVIDIA's page: up to 3 positional).
fn split(words: &[String], usage: &str) -> Result<Args, GrammarError> {
    let bad = |what: String| GrammarError::Usage(format!("{what}; usage: {usage}"));
    let mut args = Args::default();
    for word in words {
        if let Some(rest) = word.strip_prefix("--") {
            match rest.split_once('=') {
                Some((k, v)) => {
                    if args.keys.insert(k.to_string(), v.to_string()).is_some() {
                        return Err(bad(format!("--{k} given twice")));
                    }
                }
                None => {
                    if !args.flags.insert(rest.to_string()) {
                        return Err(bad(format!("--{rest} given twice")));
                    }
                }
            }
        } else if let Some((k, v)) = word.split_once('=') {
            if args.keys.insert(k.to_string(), v.to_string()).is_some() {
                return Err(bad(format!("{k} given twice")));
            }
        } else {
            args.positional.push(word.clone());
        }
    }
    if args.positional.len() > 3 {
        return Err(bad("more than 3 positional arguments".to_string()));
    }
    Ok(args)
}

impl Args {
    /// Checks the counts and names against a verb's usage.
    fn expect(
        &self,
        usage: &str,
        positional: std::ops::RangeInclusive<usize>,
        keys: &[&str],
        flags: &[&str],
    ) -> Result<(), GrammarError> {
        let bad = |what: String| GrammarError::Usage(format!("{what}; usage: {usage}"));
        if !positional.contains(&self.positional.len()) {
            return Err(bad(format!(
                "{} positional argument(s) given",
                self.positional.len()
            )));
        }
        if let Some(k) = self.keys.keys().find(|k| !keys.contains(&k.as_str())) {
            return Err(bad(format!("unknown option --{k}")));
        }
        if let Some(f) = self.flags.iter().find(|f| !flags.contains(&f.as_str())) {
            let what = if keys.contains(&f.as_str()) {
                format!("--{f} needs a value (--{f}=<value>)")
            } else {
                format!("unknown flag --{f}")
            };
            return Err(bad(what));
        }
        Ok(())
    }

    fn name(&self, at: usize, what: &'static str) -> Result<String, GrammarError> {
        name(&self.positional[at], what)
    }

    fn key_name(&self, key: &str, what: &'static str) -> Result<Option<String>, GrammarError> {
        self.keys.get(key).map(|v| name(v, what)).transpose()
    }

    fn format(&self) -> Result<Format, GrammarError> {
        self.keys
            .get("format")
            .map_or(Ok(Format::default()), |v| parse_format(v))
    }

    fn limits(&self) -> Result<LimitArgs, GrammarError> {
        let percentage = self
            .keys
            .get("active-thread-percentage")
            .map(|v| {
                Percentage::parse(v).map_err(|_| GrammarError::Value {
                    key: "active-thread-percentage".into(),
                    value: v.clone(),
                    why: "expected a number from 1 to 100",
                })
            })
            .transpose()?;
        let pinned = self
            .keys
            .get("pinned-memory-limit")
            .map(|v| parse_size(v))
            .transpose()?;
        let priority = self
            .keys
            .get("client-priority")
            .map(|v| match v.as_str() {
                "0" => Ok(0),
                "1" => Ok(1),
                _ => Err(GrammarError::Value {
                    key: "client-priority".into(),
                    value: v.clone(),
                    why: "expected 0 (normal) or 1 (below normal)",
                }),
            })
            .transpose()?;
        Ok(LimitArgs {
            percentage,
            pinned,
            priority,
        })
    }
}

/// NVIDIA's MPS v3 interface page: server and namespace names are lowercase letters,
/// digits and underscores, up to 64 characters.
pub fn name(value: &str, what: &'static str) -> Result<String, GrammarError> {
    let ok = (1..=64).contains(&value.len())
        && value
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
    if ok {
        Ok(value.to_string())
    } else {
        Err(GrammarError::Name {
            what,
            value: value.to_string(),
        })
    }
}

/// NVIDIA's MPS v3 interface page: memory values take the suffixes `4G`, `512M`, `1024K`;
/// binary units, as measured on r615 in NVIDIA Dynamo's GPU-sharing docs. A plain number is
/// bytes. The simulator keeps whole MiB and refuses less than 1 MiB.
pub fn parse_size(value: &str) -> Result<u64, GrammarError> {
    let bad = |why| GrammarError::Value {
        key: "pinned-memory-limit".into(),
        value: value.to_string(),
        why,
    };
    let why = "expected bytes, or an integer followed by K, M or G (binary units), at least 1M";
    let split = value
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(value.len());
    let (digits, unit) = value.split_at(split);
    let number: u64 = digits.parse().map_err(|_| bad(why))?;
    let shift = match unit {
        "" => 0,
        "K" | "k" => 10,
        "M" | "m" => 20,
        "G" | "g" => 30,
        _ => return Err(bad(why)),
    };
    let bytes = number.checked_mul(1 << shift).ok_or_else(|| bad(why))?;
    if bytes < 1 << 20 {
        return Err(bad(why));
    }
    Ok(bytes)
}

pub fn parse_format(value: &str) -> Result<Format, GrammarError> {
    let (kind, header) = match value.split_once(',') {
        None => (value, true),
        Some((kind, "noheader")) => (kind, false),
        Some(_) => ("", true),
    };
    let csv = match kind {
        "csv" => true,
        "table" => false,
        _ => {
            return Err(GrammarError::Value {
                key: "format".into(),
                value: value.to_string(),
                why: "expected table or csv, optionally followed by ,noheader",
            })
        }
    };
    Ok(Format { csv, header })
}

/// The usage text `-h` prints, listing the modules of NVIDIA's MPS v3 interface page.
pub fn general_usage(v3: bool) -> String {
    let mut out = String::from(
        "Usage: gpushare-mps-sim [-d | -f] [-m | -M] [-p <2|3>] | -v | -h | (stdin commands)\n",
    );
    if v3 {
        out.push_str("       gpushare-mps-sim <module> <verb> [positional-args] [--key=value ...] [--flag ...]\n");
        out.push_str(
            "Modules: server namespace client device sm-partition feature memacct context-share\n",
        );
        out.push_str("(simulated: server namespace client)\n");
    }
    out
}

fn module_help(module: &str) -> String {
    match usages(module) {
        Some(list) => list.iter().map(|(_, u)| format!("{u}\n")).collect(),
        None => format!("{module}: not simulated by gpushare-mps-sim\n"),
    }
}

/// Parses the words of a CLI call, module first.
pub fn parse(words: &[String]) -> Result<Command, GrammarError> {
    let module = words.first().map_or("", String::as_str);
    let verb = words.get(1).map_or("", String::as_str);
    if !crate::args::V3_MODULES.contains(&module) {
        return Err(GrammarError::Usage(format!(
            "unknown module {module:?}; modules: {}",
            crate::args::V3_MODULES.join(" ")
        )));
    }
    if matches!(verb, "" | "help" | "--help" | "-h") {
        return Ok(Command::Help(module_help(module)));
    }
    if words.get(2).is_some_and(|w| w == "help" || w == "--help") {
        let usage = usage_of(module, verb);
        if !usage.is_empty() {
            return Ok(Command::Help(format!("{usage}\n")));
        }
    }
    let Some(list) = usages(module) else {
        return Err(GrammarError::NotSimulated {
            module: module.to_string(),
            verb: verb.to_string(),
        });
    };
    let usage = usage_of(module, verb);
    if usage.is_empty() {
        let verbs: Vec<&str> = list.iter().map(|(v, _)| *v).collect();
        return Err(GrammarError::Usage(format!(
            "unknown verb {module} {verb:?}; verbs: {}",
            verbs.join(" ")
        )));
    }
    let a = split(&words[2..], usage)?;
    let cmd = match (module, verb) {
        ("server", "create") => {
            a.expect(usage, 1..=1, &["uid", "allowed-devices"], &[])?;
            let uid = a
                .keys
                .get("uid")
                .map(|v| {
                    v.parse().map_err(|_| GrammarError::Value {
                        key: "uid".into(),
                        value: v.clone(),
                        why: "expected a numeric user id",
                    })
                })
                .transpose()?;
            let allowed_devices = a
                .keys
                .get("allowed-devices")
                .map(|v| {
                    v.split(',')
                        .map(|d| {
                            parse_device(d.trim()).map_err(|_| GrammarError::Value {
                                key: "allowed-devices".into(),
                                value: v.clone(),
                                why: "expected GPU ordinals or UUIDs, comma-separated",
                            })
                        })
                        .collect::<Result<Vec<_>, _>>()
                })
                .transpose()?;
            Command::ServerCreate {
                name: a.name(0, "server")?,
                uid,
                allowed_devices,
            }
        }
        ("server", "set") => {
            let keys = [
                "active-thread-percentage",
                "pinned-memory-limit",
                "client-priority",
            ];
            a.expect(usage, 1..=1, &keys, &[])?;
            if a.keys.is_empty() {
                return Err(GrammarError::Usage(format!(
                    "server set needs at least one option; usage: {usage}"
                )));
            }
            Command::ServerSet {
                name: a.name(0, "server")?,
                limits: a.limits()?,
            }
        }
        ("server", "list") => {
            a.expect(usage, 0..=1, &["format"], &[])?;
            Command::ServerList {
                name: a
                    .positional
                    .first()
                    .map(|n| name(n, "server"))
                    .transpose()?,
                format: a.format()?,
            }
        }
        ("server", "delete") => {
            a.expect(usage, 1..=1, &[], &["force"])?;
            Command::ServerDelete {
                name: a.name(0, "server")?,
                force: a.flags.contains("force"),
            }
        }
        ("server", "get") => {
            a.expect(usage, 2..=2, &[], &[])?;
            Command::ServerGet {
                name: a.name(0, "server")?,
                field: a.positional[1].clone(),
            }
        }
        ("namespace", "create") => {
            a.expect(usage, 1..=1, &["server"], &[])?;
            Command::NamespaceCreate {
                name: a.name(0, "namespace")?,
                server: required_server(&a, usage)?,
            }
        }
        ("namespace", "set") => {
            let keys = [
                "server",
                "active-thread-percentage",
                "pinned-memory-limit",
                "client-priority",
            ];
            a.expect(usage, 1..=1, &keys, &[])?;
            if a.keys.len() < 2 {
                return Err(GrammarError::Usage(format!(
                    "namespace set needs at least one limit; usage: {usage}"
                )));
            }
            Command::NamespaceSet {
                name: a.name(0, "namespace")?,
                server: required_server(&a, usage)?,
                limits: a.limits()?,
            }
        }
        ("namespace", "delete") => {
            a.expect(usage, 1..=1, &["server"], &["force"])?;
            Command::NamespaceDelete {
                name: a.name(0, "namespace")?,
                server: required_server(&a, usage)?,
                force: a.flags.contains("force"),
            }
        }
        ("namespace", "list") => {
            a.expect(usage, 0..=1, &["server", "format"], &[])?;
            Command::NamespaceList {
                name: a
                    .positional
                    .first()
                    .map(|n| name(n, "namespace"))
                    .transpose()?,
                server: a.key_name("server", "server")?,
                format: a.format()?,
            }
        }
        ("namespace", "get") => {
            // NVIDIA's MPS v3 interface page: the server is positional here, unlike the other verbs.
            a.expect(usage, 3..=3, &[], &[])?;
            Command::NamespaceGet {
                name: a.name(0, "namespace")?,
                server: a.name(1, "server")?,
                field: a.positional[2].clone(),
            }
        }
        ("client", "list") => {
            a.expect(usage, 0..=0, &["server", "format"], &["all"])?;
            Command::ClientList {
                server: a.key_name("server", "server")?,
                format: a.format()?,
            }
        }
        ("client", "terminate") => {
            a.expect(usage, 1..=1, &[], &[])?;
            let pid = &a.positional[0];
            Command::ClientTerminate {
                pid: pid.parse().ok().filter(|&p: &u32| p > 0).ok_or_else(|| {
                    GrammarError::Value {
                        key: "pid".into(),
                        value: pid.clone(),
                        why: "expected a process id",
                    }
                })?,
            }
        }
        _ => {
            return Err(GrammarError::NotSimulated {
                module: module.to_string(),
                verb: verb.to_string(),
            })
        }
    };
    Ok(cmd)
}

fn required_server(a: &Args, usage: &str) -> Result<String, GrammarError> {
    match a.key_name("server", "server")? {
        Some(s) => Ok(s),
        None => Err(GrammarError::Usage(format!(
            "--server=<s> is required; usage: {usage}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(words: &str) -> Result<Command, GrammarError> {
        parse(
            &words
                .split_whitespace()
                .map(String::from)
                .collect::<Vec<_>>(),
        )
    }

    #[test]
    fn parses_the_documented_verbs() {
        assert_eq!(
            p("server create s --uid=0 --allowed-devices=GPU-ab,1"),
            Ok(Command::ServerCreate {
                name: "s".into(),
                uid: Some(0),
                allowed_devices: Some(vec!["GPU-ab".into(), "1".into()]),
            })
        );
        assert_eq!(
            p("namespace set c_1 server=s active-thread-percentage=30 --pinned-memory-limit=4G"),
            Ok(Command::NamespaceSet {
                name: "c_1".into(),
                server: "s".into(),
                limits: LimitArgs {
                    percentage: Some(Percentage::parse("30").unwrap()),
                    pinned: Some(4 << 30),
                    priority: None,
                },
            })
        );
        assert_eq!(
            p("namespace get a s pipe-directory"),
            Ok(Command::NamespaceGet {
                name: "a".into(),
                server: "s".into(),
                field: "pipe-directory".into(),
            })
        );
        assert_eq!(
            p("client list --all --format=csv,noheader"),
            Ok(Command::ClientList {
                server: None,
                format: Format {
                    csv: true,
                    header: false
                },
            })
        );
        assert_eq!(
            p("namespace delete a --server=s --force"),
            Ok(Command::NamespaceDelete {
                name: "a".into(),
                server: "s".into(),
                force: true,
            })
        );
        assert_eq!(
            p("client terminate 31612345"),
            Ok(Command::ClientTerminate { pid: 31_612_345 })
        );
        assert!(matches!(p("namespace help"), Ok(Command::Help(_))));
        assert!(matches!(p("server create help"), Ok(Command::Help(_))));
    }

    #[test]
    fn names_follow_the_documented_rule() {
        let long = "a".repeat(64);
        assert!(p(&format!("server create {long}")).is_ok());
        for bad in ["Upper", "with-hyphen", "dot.ted", &"a".repeat(65)] {
            let err = p(&format!("server create {bad}")).unwrap_err();
            assert!(
                err.to_string()
                    .ends_with("names are 1 to 64 lowercase letters, digits or underscores"),
                "{bad}: {err}"
            );
        }
        assert!(p("namespace create a --server=S").is_err());
    }

    #[test]
    fn sizes_are_binary_and_at_least_a_mib() {
        assert_eq!(parse_size("4G"), Ok(4 << 30));
        assert_eq!(parse_size("512M"), Ok(512 << 20));
        assert_eq!(parse_size("1024K"), Ok(1 << 20));
        assert_eq!(parse_size("1048576"), Ok(1 << 20));
        for bad in [
            "1023K",
            "0",
            "4T",
            "4GB",
            "-1G",
            "",
            "G",
            "1.5G",
            "99999999999G",
        ] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn rejects_what_the_usage_does_not_list() {
        for bad in [
            "bogus list",
            "server frob",
            "server create",
            "server create a b",
            "server create a --bogus=1",
            "server create a --uid=x",
            "server set s",
            "server set s --active-thread-percentage=0",
            "server set s --active-thread-percentage=101",
            "server set s --client-priority=2",
            "namespace create a",
            "namespace create a --server",
            "namespace set a --server=s",
            "namespace set a --server=s --pinned-memory-limit=12X",
            "namespace get a pipe-directory",
            "namespace list --format=json",
            "namespace list --format=csv,header",
            "client terminate x",
            "client terminate 0",
            "server create a --uid=0 --uid=0",
            "server list a b c d",
            "device list",
            "sm-partition list",
        ] {
            let got = p(bad);
            assert!(
                got.is_err() && !matches!(got, Ok(Command::Help(_))),
                "{bad}: {got:?}"
            );
        }
        assert!(p("server").is_ok_and(|c| matches!(c, Command::Help(_))));
        assert_eq!(
            p("device list").unwrap_err().to_string(),
            "device list: not simulated by gpushare-mps-sim (it simulates server, namespace and client)"
        );
    }

    #[test]
    fn mutating_commands_and_titles() {
        let set = p("namespace set a --server=s --client-priority=1").unwrap();
        assert!(set.mutates());
        assert_eq!(set.title(), "NAMESPACE SET");
        assert!(!p("namespace list").unwrap().mutates());
        assert!(p("client terminate 5").unwrap().mutates());
    }
}
