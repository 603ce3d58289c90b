//! The request keys, one row each: a key's names, grammar, range, client variable, whether
//! it is part of the daemon identity, whether hook-only mode can honour it, and the text
//! of its documentation.
//!
//! Every consumer reads the rows: the parser ([`super::parse`]) and the env refusal, the
//! node's checks (ceilings), the daemon identity and the hook's re-validation of it, the
//! shim's client environment, hook-only mode's refusal of what it cannot honour,
//! `gpushare daemon start`'s flags, containerd's `pod_annotations` list, and the docs
//! tables in docs/requests.md and the README (a test renders them from the rows and fails
//! when they differ).
//!
//! Invariants: every key's annotation is `gpushare.io/<name>` and its env var
//! `GPUSHARE_<NAME>` (upper case, `-` as `_`); [`KEYS`] lists every row once, in the order
//! keys are read and checked; a numeric key's values are `u64`s its [`Number`] grammar
//! accepted, and nothing else ever reaches a client variable, a control command or the
//! identity.

use std::fmt;

use super::grammar::{parse_integer, parse_size, MIN_PINNED_MEMORY_LIMIT, SIZE_ALLOWED};
use super::types::{format_mps_size, short_size, RequestError};

/// One request key.
pub struct KeySpec {
    /// The key's name: the annotation without `gpushare.io/`.
    pub name: &'static str,
    /// `gpushare.io/<name>`.
    pub annotation: &'static str,
    /// `GPUSHARE_<NAME>`.
    pub env: &'static str,
    pub grammar: Grammar,
    /// The values, for the docs tables (markdown).
    pub values: &'static str,
    /// What the key does, for the docs table of docs/requests.md (markdown).
    pub doc: &'static str,
    /// The MPS client variable the shim (and the NRI plugin) set from the value, or the
    /// node's default when the request gives none.
    pub client_env: Option<ClientEnv>,
    /// Part of the daemon identity: containers that differ in it never share a daemon.
    /// For a limit, only under `limits = "enforced"`, where the daemon applies it.
    pub identity: bool,
    pub hook_only: HookOnly,
    /// The config key of the node's default for it, if the node has one.
    pub default_key: Option<&'static str>,
    /// The config key of the operator's ceiling on it, if there is one.
    pub ceiling_key: Option<&'static str>,
    /// `gpushare daemon start`'s flag for it: the keys a daemon enforces.
    pub flag: Option<&'static str>,
    /// What the daemon, its record, its id and `status` call it: exactly the limits (the
    /// numeric keys with `identity`) have one.
    pub limit: Option<Limit>,
}

/// A limit as the daemon enforces it and gpushare records and shows it: everything about
/// it beyond the request key, so that the identity, the daemon's commands, its check and
/// `status` read the row instead of naming the limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limit {
    /// Its field in the identity's JSON (a daemon's record): `active_thread_percentage`.
    pub field: &'static str,
    /// Its name in the identity's canonical form, which daemon ids hash: `tp`.
    pub canonical: &'static str,
    /// Written by the first canonical form (`v1`): always, `-` when unset, between
    /// `multi-user` and `ipc`. A later limit is written only when set, after everything
    /// else, so that every daemon that existed before it keeps its id.
    pub in_v1: bool,
    /// The control daemon's name for it: `set_default_<mps>`, `get_default_<mps>` on the
    /// daemon, `set_<mps> <server>`, `get_<mps> <server>` on one server, each once per
    /// device ordinal (before the value) when the client variable is per device.
    pub mps: &'static str,
    /// Its field in `gpushare status --json`'s daemons: `pinned_memory_limit_bytes`.
    pub status_field: &'static str,
    /// Its label in `status`'s table (`threads=25%`) and the unit after the value there.
    pub label: &'static str,
    pub unit: &'static str,
}

impl fmt::Debug for KeySpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.annotation)
    }
}

impl PartialEq for KeySpec {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name
    }
}

impl Eq for KeySpec {}

/// How a key's value is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Grammar {
    /// Devices, or `allocated` ([`super::parse_device`]).
    Device,
    /// `isolated` or `host` (`super::parse_ipc`).
    Ipc,
    /// A number: the values of [`super::Settings`].
    Number(Number),
}

/// A numeric grammar.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Number {
    /// Decimal digits only, no more than `max` has, from `min` to `max`; `allowed` is what
    /// errors say is allowed.
    Integer {
        min: u64,
        max: u64,
        allowed: &'static str,
    },
    /// A size with a binary unit, in bytes, at least 1M (the grammar module's rules).
    Size,
}

impl Number {
    /// `raw` under this grammar; errors name `key`.
    pub(crate) fn parse(&self, key: &'static str, raw: &str) -> Result<u64, RequestError> {
        match *self {
            Number::Integer { min, max, allowed } => parse_integer(key, raw, min, max, allowed),
            Number::Size => parse_size(key, raw),
        }
    }

    /// Whether a value read back from elsewhere (a config, an identity) is in range.
    pub(crate) fn allows(&self, value: u64) -> bool {
        match *self {
            Number::Integer { min, max, .. } => (min..=max).contains(&value),
            Number::Size => value >= MIN_PINNED_MEMORY_LIMIT,
        }
    }

    /// What errors say is allowed.
    pub(crate) fn allowed(&self) -> &'static str {
        match *self {
            Number::Integer { allowed, .. } => allowed,
            Number::Size => SIZE_ALLOWED,
        }
    }

    /// What a config's refusal of a value says is allowed.
    pub(crate) fn config_allowed(&self) -> &'static str {
        match self {
            Number::Integer { allowed, .. } => allowed,
            Number::Size => "a size with a unit, like 512M or 4G",
        }
    }

    /// The smallest value, as errors write it (`1`, `1M`).
    pub(crate) fn min_text(&self) -> String {
        match *self {
            Number::Integer { min, .. } => min.to_string(),
            Number::Size => format_mps_size(MIN_PINNED_MEMORY_LIMIT),
        }
    }

    /// A value as the config writes it (`50`, `4G`, `1536M`).
    pub(crate) fn config_text(&self, value: u64) -> String {
        match self {
            Number::Integer { .. } => value.to_string(),
            Number::Size => short_size(value),
        }
    }

    /// A value as MPS reads it (`50`, `4096M`).
    pub(crate) fn mps_text(&self, value: u64) -> String {
        match self {
            Number::Integer { .. } => value.to_string(),
            Number::Size => format_mps_size(value),
        }
    }
}

/// An MPS client variable set from a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientEnv {
    pub var: &'static str,
    /// The value once per device, `0=<v>,1=<v>` (as `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`
    /// takes it), rather than once.
    pub per_device: bool,
}

impl ClientEnv {
    /// The variable's value for `value` under `number` (as MPS reads it), once or once per
    /// device of `devices` (`0=<v>,1=<v>`).
    pub fn value(&self, number: Number, value: u64, devices: usize) -> String {
        let text = number.mps_text(value);
        if !self.per_device {
            return text;
        }
        (0..devices)
            .map(|i| format!("{i}={text}"))
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// Whether hook-only mode, which cannot set the container's environment, can honour a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HookOnly {
    /// Always (the hook acts on it itself).
    Honoured,
    /// Under `limits = "enforced"`, where the daemon applies it; refused under
    /// `"advisory"`, where only the client variable would carry it.
    WhenEnforced,
    /// Never: only a client variable carries it. Refused with one line.
    Refused,
}

impl HookOnly {
    /// The documentation's words for it.
    pub fn doc(&self) -> &'static str {
        match self {
            HookOnly::Honoured => "honoured",
            HookOnly::WhenEnforced => {
                "honoured under `limits = \"enforced\"`, refused under `\"advisory\"`"
            }
            HookOnly::Refused => "refused",
        }
    }
}

const PERCENTAGE_ALLOWED: &str = "an integer from 1 to 100";
/// A share of a GPU's threads: the grammar of [`ACTIVE_THREAD_PERCENTAGE`], and of the
/// config keys of its default and ceiling.
pub const PERCENTAGE: Number = Number::Integer {
    min: 1,
    max: 100,
    allowed: PERCENTAGE_ALLOWED,
};

pub static DEVICE: KeySpec = KeySpec {
    name: "device",
    annotation: "gpushare.io/device",
    env: "GPUSHARE_DEVICE",
    grammar: Grammar::Device,
    values: "`0` (GPU index), `GPU-<uuid>`, `MIG-<uuid>`, `1:0` (MIG device 0 of GPU 1), a list of full GPUs `0,2`, or `allocated`",
    doc: "the device(s) the container shares: see [Devices](#devices). **This key makes a container a request**; without it the other keys are not read",
    client_env: None,
    identity: true,
    hook_only: HookOnly::Honoured,
    default_key: Some("default-device"),
    ceiling_key: None,
    flag: None,
    limit: None,
};

pub static ACTIVE_THREAD_PERCENTAGE: KeySpec = KeySpec {
    name: "active-thread-percentage",
    annotation: "gpushare.io/active-thread-percentage",
    env: "GPUSHARE_ACTIVE_THREAD_PERCENTAGE",
    grammar: Grammar::Number(PERCENTAGE),
    values: PERCENTAGE_ALLOWED,
    doc: "the share of the GPU's threads each client may use",
    client_env: Some(ClientEnv {
        var: "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
        per_device: false,
    }),
    identity: true,
    hook_only: HookOnly::WhenEnforced,
    default_key: Some("mps.default-active-thread-percentage"),
    ceiling_key: Some("mps.max-active-thread-percentage"),
    flag: Some("--active-thread-percentage"),
    limit: Some(Limit {
        field: "active_thread_percentage",
        canonical: "tp",
        in_v1: true,
        mps: "active_thread_percentage",
        status_field: "active_thread_percentage",
        label: "threads",
        unit: "%",
    }),
};

pub static PINNED_MEMORY_LIMIT: KeySpec = KeySpec {
    name: "pinned-memory-limit",
    annotation: "gpushare.io/pinned-memory-limit",
    env: "GPUSHARE_PINNED_MEMORY_LIMIT",
    grammar: Grammar::Number(Number::Size),
    values: "a size with a unit: `512M`, `4G`; every unit is 1024-based, so `4GB` is `4GiB`",
    doc: "the pinned device memory each client may allocate, on each device; at most the device's memory",
    client_env: Some(ClientEnv {
        var: "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
        per_device: true,
    }),
    identity: true,
    hook_only: HookOnly::WhenEnforced,
    default_key: Some("mps.default-pinned-memory-limit"),
    ceiling_key: Some("mps.max-pinned-memory-limit"),
    flag: Some("--pinned-memory-limit"),
    limit: Some(Limit {
        field: "pinned_memory_limit",
        canonical: "mem",
        in_v1: true,
        mps: "device_pinned_mem_limit",
        status_field: "pinned_memory_limit_bytes",
        label: "mem",
        unit: "",
    }),
};

pub static IPC: KeySpec = KeySpec {
    name: "ipc",
    annotation: "gpushare.io/ipc",
    env: "GPUSHARE_IPC",
    grammar: Grammar::Ipc,
    values: "`isolated` or `host`",
    doc: "how the container reaches the MPS server's shared memory; only a different value than the node's `mps.ipc` needs `mps.allow-ipc-override = true`",
    client_env: None,
    identity: true,
    hook_only: HookOnly::Honoured,
    default_key: Some("mps.ipc"),
    ceiling_key: None,
    flag: None,
    limit: None,
};

pub static CLIENT_PRIORITY: KeySpec = KeySpec {
    name: "client-priority",
    annotation: "gpushare.io/client-priority",
    env: "GPUSHARE_CLIENT_PRIORITY",
    grammar: Grammar::Number(Number::Integer {
        min: 0,
        max: 1,
        allowed: "0 (normal) or 1 (below normal)",
    }),
    values: "`0` (normal) or `1` (below normal)",
    doc: "the MPS scheduling priority of the container's clients, passed to them as they ask for it: a client can always lower its own",
    client_env: Some(ClientEnv {
        var: "CUDA_MPS_CLIENT_PRIORITY",
        per_device: false,
    }),
    identity: false,
    hook_only: HookOnly::Refused,
    default_key: None,
    ceiling_key: None,
    flag: None,
    limit: None,
};

/// Every request key, in the order they are read and checked.
pub static KEYS: [&KeySpec; 5] = [
    &DEVICE,
    &ACTIVE_THREAD_PERCENTAGE,
    &PINNED_MEMORY_LIMIT,
    &IPC,
    &CLIENT_PRIORITY,
];

impl KeySpec {
    /// The numeric grammar of a key whose values are [`super::Settings`]; `None` for the
    /// device and IPC keys.
    pub fn number(&self) -> Option<Number> {
        match self.grammar {
            Grammar::Number(n) => Some(n),
            _ => None,
        }
    }
}

/// The keys whose values are numbers ([`super::Settings`]), in [`KEYS`] order.
pub(crate) fn numeric() -> impl Iterator<Item = (&'static KeySpec, Number)> {
    KEYS.into_iter().filter_map(|k| k.number().map(|n| (k, n)))
}

/// The limits: the numeric keys that are part of the daemon identity, which the daemon
/// enforces under `limits = "enforced"`, a CDI profile names, and the operator may set a
/// default and a ceiling for.
pub(crate) fn profile_keys() -> impl Iterator<Item = &'static KeySpec> {
    limits().map(|(k, _, _)| k)
}

/// The limits with what the daemon, the identity and `status` call each, in [`KEYS`]
/// order: [`profile_keys`] with their [`Limit`] and grammar.
pub(crate) fn limits() -> impl Iterator<Item = (&'static KeySpec, Limit, Number)> {
    numeric().filter_map(|(k, n)| k.limit.map(|l| (k, l, n)))
}

/// A limit's value as a config wrote it: an integer grammar's as a TOML integer (its range
/// unchecked), a size as text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ProfileValue<'a> {
    Integer(u64),
    Text(&'a str),
}

impl ProfileValue<'_> {
    /// The value as written.
    pub(crate) fn text(&self) -> String {
        match self {
            ProfileValue::Integer(v) => v.to_string(),
            ProfileValue::Text(s) => (*s).to_owned(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_key() {
        for (i, key) in KEYS.iter().enumerate() {
            assert_eq!(key.annotation, format!("gpushare.io/{}", key.name));
            assert_eq!(
                key.env,
                format!("GPUSHARE_{}", key.name.replace('-', "_").to_uppercase())
            );
            assert!(
                KEYS[..i].iter().all(|k| k.name != key.name),
                "{} twice",
                key.name
            );
        }
    }

    #[test]
    fn client_priority_is_0_or_1() {
        let number = CLIENT_PRIORITY.number().expect("numeric");
        let key = CLIENT_PRIORITY.annotation;
        assert_eq!(number.parse(key, "0").unwrap(), 0);
        assert_eq!(number.parse(key, "1").unwrap(), 1);
        for bad in ["2", "00", "-1", "+1", "1.0", "high", "10"] {
            assert_eq!(
                number.parse(key, bad).unwrap_err().to_string(),
                format!("gpushare.io/client-priority=\"{bad}\" is invalid: allowed is 0 (normal) or 1 (below normal)")
            );
        }
        assert_eq!(
            number.parse("GPUSHARE_CLIENT_PRIORITY", "").unwrap_err().to_string(),
            "GPUSHARE_CLIENT_PRIORITY=\"\" is invalid: it is empty; allowed is 0 (normal) or 1 (below normal)"
        );
    }

    /// The columns that depend on each other agree: hook-only mode can honour a key that
    /// the daemon applies, or that the hook acts on itself, never one that only a client
    /// variable carries; `daemon start` has a flag for exactly the keys a daemon enforces.
    #[test]
    fn rows_are_consistent() {
        for key in KEYS {
            let want = match (key.client_env.is_some(), key.identity) {
                (false, _) => HookOnly::Honoured,
                (true, true) => HookOnly::WhenEnforced,
                (true, false) => HookOnly::Refused,
            };
            assert_eq!(key.hook_only, want, "{}", key.name);
            let enforced = key.identity && key.number().is_some();
            assert_eq!(
                key.flag.map(str::to_owned),
                enforced.then(|| format!("--{}", key.name)),
                "{}",
                key.name
            );
            assert_eq!(key.limit.is_some(), enforced, "{}", key.name);
            if let Some(limit) = key.limit {
                assert_eq!(limit.field, key.name.replace('-', "_"), "{}", key.name);
                for (i, other) in KEYS.iter().enumerate() {
                    let Some(o) = other.limit.filter(|_| other.name != key.name) else {
                        continue;
                    };
                    assert!(
                        o.canonical != limit.canonical
                            && o.status_field != limit.status_field
                            && o.label != limit.label
                            && o.mps != limit.mps,
                        "{} and {} (row {i}) share a name",
                        key.name,
                        other.name
                    );
                }
            }
            if let Some(Number::Integer { min, max, allowed }) = key.number() {
                assert!(
                    allowed.contains(&min.to_string()) && allowed.contains(&max.to_string()),
                    "{}: {allowed}",
                    key.name
                );
            }
        }
    }
}
