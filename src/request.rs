//! Container annotations and environment → a validated share request.
//!
//! The values come from container authors and reach a root hook, so they are hostile input.
//! Invariants:
//! - Every value is checked before anything is built from it, by the grammars of
//!   `grammar` (its header states their rules, sizes included). Nothing here does I/O.
//! - Every error is exactly one line naming the key actually used (annotation or env name), the
//!   value (quoted and escaped by `crate::device::quote`, cut with `…` past 64 characters) and
//!   what is allowed.
//! - An annotation wins over the env var of the same key, key by key; for env, the last
//!   `NAME=` entry wins, as with execve. Env entries without `=` are ignored.
//! - A pod's sandbox ("pause") container is never a request, whatever annotations or env it
//!   carries (`engine::sandbox_marker`: containerd's `io.kubernetes.cri.container-type=sandbox`,
//!   CRI-O's `io.kubernetes.cri-o.ContainerType=sandbox`, dockershim's
//!   `io.kubernetes.docker.type=podsandbox`). [`parse`] checks this before anything else, so
//!   the pod annotations that containerd and CRI-O copy into the sandbox's spec are neither
//!   acted on nor judged there: a bad value is reported when the workload container is
//!   created. A marker can only ever turn gpushare off for a container, never on.
//! - No device key (annotation or accepted env var) means no request: the container passes
//!   through, and the other keys are not read, so gpushare can be a node's default runtime.
//!   The one exception is the node's `default-device = "allocated"`: then a container without
//!   a device key but with an allocation is a request for it, named by that config key in
//!   errors, and one without an allocation passes through.
//! - The device value `allocated` means "the devices this container was allocated": what
//!   NVIDIA's device plugin or DRA driver wrote into the spec, found by `allocation` under
//!   the rules documented there (no I/O; the sources in a fixed order, the first that names
//!   devices wins; an image's own `NVIDIA_VISIBLE_DEVICES=all` never counts). Asking for it
//!   in a container without an allocation, or in one whose allocation carries the allocator's
//!   own MPS, is refused when the request is parsed. The devices found then meet exactly the
//!   rules of named devices ([`Sourced::resolve`]: a list of full GPUs, or one MIG device).
//! - With `accept_env == false`, any `GPUSHARE_*` variable of a request key in the env is
//!   refused, even when the annotation of the same key is also present or no device is asked
//!   for: a tenant must learn that the variable is not honoured rather than be ignored silently.
//! - Unknown `gpushare.io/*` annotations and unknown `GPUSHARE_*` variables are not errors:
//!   only the keys of [`KEYS`] are ever looked up, so a newer client can add keys without breaking an
//!   older node (forward compatibility).
//! - A CDI device of gpushare's is a request source of its own (`from_cdi`): its request
//!   is its hook's arguments ([`CdiAsk`]), which the node's CDI spec wrote; beside it the
//!   container's own keys may only repeat it, and `default-device` does not apply.
//! - `check` is the one place a parsed request meets the node: the devices' memory and
//!   the operator's ceilings (`mps.max-active-thread-percentage`,
//!   `mps.max-pinned-memory-limit`). A request above a ceiling is refused, never lowered
//!   silently; a limit not given is not checked (the configured default applies, and the
//!   config refuses a default above its ceiling).

mod allocation;
mod grammar;
pub mod keys;
mod types;

use std::str::FromStr;

use crate::device::{DeviceKind, Inventory, ResolvedDevices};
pub(crate) use crate::device::{DeviceRequest, DeviceSelector};
pub(crate) use allocation::{allocation, Allocation};
use grammar::{check_raw, env_lookup, invalid, parse_index, parse_selector};
pub use grammar::{parse_device, parse_size, MAX_DEVICES};
pub(crate) use grammar::{parse_device_without_container, parse_ipc};
pub(crate) use keys::{limits, numeric, profile_keys, Number, ProfileValue};
pub use keys::{
    KeySpec, Limit, ACTIVE_THREAD_PERCENTAGE, CLIENT_PRIORITY, DEVICE, IPC, KEYS,
    PINNED_MEMORY_LIMIT,
};
pub(crate) use types::{format_mps_size, ALLOCATED, CDI_KIND};
pub use types::{Inputs, IpcMode, RequestError};

/// The config key that makes [`ALLOCATED`] every container's default; a default request's
/// errors name it.
pub(crate) const DEFAULT_DEVICE_KEY: &str = "default-device";

use crate::engine::sandbox_marker;

/// A node's default for containers without a device key (`default-device`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DefaultDevice {
    /// The devices the container was allocated, if it was allocated any.
    Allocated,
}

/// How [`parse`] reads a container: the node's settings that bear on it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Options {
    /// `accept-env-requests`.
    pub accept_env: bool,
    /// `default-device`.
    pub default_device: Option<DefaultDevice>,
    /// `accept-visible-devices-env`: whether the container's own `NVIDIA_VISIBLE_DEVICES`
    /// is a source of its allocation.
    pub accept_visible_devices_env: bool,
}

/// A device key's value: devices named by the request, or the container's allocation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceValue {
    Named(DeviceRequest),
    /// `allocated`, with what was found in the spec.
    Allocated(Allocation),
}

impl FromStr for IpcMode {
    type Err = RequestError;

    /// Exactly `isolated` or `host`; errors name the config key `ipc`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        parse_ipc("ipc", s)
    }
}

/// A parsed value with where it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sourced<T> {
    pub value: T,
    /// The annotation or env name actually used.
    pub key: &'static str,
    /// The raw text, as given.
    pub raw: String,
}

impl<T> Sourced<T> {
    /// `raw` parsed by `parse` (one of this module's grammars), remembered with the key it
    /// came under, which `parse` names in its errors.
    pub(crate) fn parse(
        key: &'static str,
        raw: &str,
        parse: impl FnOnce(&'static str, &str) -> Result<T, RequestError>,
    ) -> Result<Self, RequestError> {
        Ok(Sourced {
            value: parse(key, raw)?,
            key,
            raw: raw.to_owned(),
        })
    }
}

impl Sourced<DeviceValue> {
    /// Resolves the device value against the inventory, under the same rules whether the
    /// devices were named or allocated. Errors about named devices name this key and value;
    /// about an allocation, this key and value and then the source and what it said.
    pub fn resolve(&self, inventory: &Inventory) -> Result<ResolvedDevices, RequestError> {
        match &self.value {
            DeviceValue::Named(req) => inventory
                .resolve(self.key, &self.raw, req)
                .map_err(|e| RequestError::Device(Box::new(e))),
            DeviceValue::Allocated(found) => found.resolve(self.key, &self.raw, inventory),
        }
    }
}

/// A validated share request. Keys not given are absent (the config's defaults apply).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub device: Sourced<DeviceValue>,
    pub ipc: Option<Sourced<IpcMode>>,
    /// The numeric keys given.
    pub settings: Settings,
}

/// The values of a request's numeric keys ([`keys::Grammar::Number`]), each checked by its
/// row's grammar, in [`KEYS`] order, at most one per key.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Settings(Vec<(&'static KeySpec, Sourced<u64>)>);

impl Settings {
    /// The value given for `key`, with where it came from.
    pub fn get(&self, key: &KeySpec) -> Option<&Sourced<u64>> {
        self.0.iter().find(|(k, _)| *k == key).map(|(_, v)| v)
    }

    /// The value given for `key`.
    pub fn value(&self, key: &KeySpec) -> Option<u64> {
        self.get(key).map(|s| s.value)
    }

    /// Every value given, in [`KEYS`] order.
    pub fn iter(&self) -> impl Iterator<Item = (&'static KeySpec, &Sourced<u64>)> {
        self.0.iter().map(|(k, v)| (*k, v))
    }

    /// These settings with `key` set to `value` (replacing any value it had), in [`KEYS`]
    /// order. The caller has parsed `value` with the key's grammar.
    pub(crate) fn with(mut self, key: &'static KeySpec, value: Sourced<u64>) -> Self {
        self.0.retain(|(k, _)| *k != key);
        self.0.push((key, value));
        let rank = |k: &KeySpec| KEYS.iter().position(|r| *r == k);
        self.0.sort_by_key(|(k, _)| rank(k));
        self
    }

    /// Each numeric key found by `lookup` (its value and the name it was found under),
    /// parsed by its grammar.
    fn read<'a>(
        lookup: impl Fn(&'static KeySpec) -> Option<(&'static str, &'a str)>,
    ) -> Result<Self, RequestError> {
        let mut found = Vec::new();
        for (key, number) in keys::numeric() {
            if let Some((name, raw)) = lookup(key) {
                let value = number.parse(name, raw)?;
                found.push((
                    key,
                    Sourced {
                        value,
                        key: name,
                        raw: raw.to_owned(),
                    },
                ));
            }
        }
        Ok(Settings(found))
    }
}

/// Parses an active thread percentage ([`keys::PERCENTAGE`]).
pub fn parse_percentage(key: &'static str, raw: &str) -> Result<u64, RequestError> {
    keys::PERCENTAGE.parse(key, raw)
}

/// The operator's ceilings on what a request may ask for (the config keys of the rows'
/// `ceiling_key`): a numeric key and the most it may ask; a key not listed has none.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Ceilings(pub Vec<(&'static KeySpec, u64)>);

/// Reads the request from a container's spec: its annotations and `process.env`, and, for
/// `ALLOCATED`, what the allocator wrote (`allocation`).
///
/// Returns `Ok(None)` for a pod's sandbox (`sandbox_marker`, checked first), and when
/// neither `gpushare.io/device` nor an accepted `GPUSHARE_DEVICE` is present and the node's
/// default does not apply: the container passes through. In `process.env` the last
/// occurrence of a name wins, as with execve. An annotation wins over the env var of the same
/// key. With `accept_env == false`, any `GPUSHARE_*` request variable is refused.
pub fn parse(c: &Inputs<'_>, opts: &Options) -> Result<Option<Request>, RequestError> {
    if sandbox_marker(|k| c.annotation(k)).is_some() {
        return Ok(None);
    }
    refuse_env(c, opts)?;
    let lookup = |key| lookup(c, opts, key);
    let allocated = |key: &'static str, raw: &str| {
        allocation(c, key, raw, opts.accept_visible_devices_env).map(|found| {
            found.map(|found| Sourced {
                value: DeviceValue::Allocated(found),
                key,
                raw: raw.to_owned(),
            })
        })
    };
    let device = match lookup(&DEVICE) {
        Some((key, raw)) => device_value(c, opts, key, raw)?,
        None => match opts.default_device {
            Some(DefaultDevice::Allocated) => match allocated(DEFAULT_DEVICE_KEY, ALLOCATED)? {
                Some(device) => device,
                None => return Ok(None),
            },
            None => return Ok(None),
        },
    };
    let settings = Settings::read(lookup)?;
    Ok(Some(Request {
        device,
        ipc: sourced(lookup(&IPC), parse_ipc)?,
        settings,
    }))
}

/// With `accept_env == false`, refuses the first `GPUSHARE_*` request variable in the env.
fn refuse_env(c: &Inputs<'_>, opts: &Options) -> Result<(), RequestError> {
    if opts.accept_env {
        return Ok(());
    }
    for key in KEYS {
        if let Some(value) = env_lookup(c.env, key.env) {
            return Err(RequestError::EnvDisabled {
                key: key.env,
                value: value.to_owned(),
                annotation: key.annotation,
            });
        }
    }
    Ok(())
}

/// A key's value and the name it was found under: the annotation, else the env var when
/// env requests are accepted.
fn lookup<'a>(c: &Inputs<'a>, opts: &Options, key: &KeySpec) -> Option<(&'static str, &'a str)> {
    match c.annotation(key.annotation) {
        Some(raw) => Some((key.annotation, raw)),
        None if opts.accept_env => env_lookup(c.env, key.env).map(|raw| (key.env, raw)),
        None => None,
    }
}

fn sourced<T>(
    found: Option<(&'static str, &str)>,
    parse: fn(&'static str, &str) -> Result<T, RequestError>,
) -> Result<Option<Sourced<T>>, RequestError> {
    found
        .map(|(key, raw)| Sourced::parse(key, raw, parse))
        .transpose()
}

/// A device key's value: [`ALLOCATED`] (what the container was allocated) or named devices.
fn device_value(
    c: &Inputs<'_>,
    opts: &Options,
    key: &'static str,
    raw: &str,
) -> Result<Sourced<DeviceValue>, RequestError> {
    let value = if raw == ALLOCATED {
        let found = allocation(c, key, raw, opts.accept_visible_devices_env)?.ok_or_else(|| {
            RequestError::NoAllocation {
                key,
                value: raw.to_owned(),
                env_read: opts.accept_visible_devices_env,
            }
        })?;
        DeviceValue::Allocated(found)
    } else {
        DeviceValue::Named(parse_device(key, raw)?)
    };
    Ok(Sourced {
        value,
        key,
        raw: raw.to_owned(),
    })
}

/// The hook argument naming the CDI device's base name.
pub(crate) const CDI_DEVICE_FLAG: &str = "--cdi-device";
/// The hook argument naming the device's profile.
pub(crate) const CDI_PROFILE_FLAG: &str = "--profile";
/// What a CDI device of gpushare's asks for: its hook's arguments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CdiAsk {
    /// The base device name (`0`, `GPU-<uuid>`, `1-mig-0`, `MIG-<uuid>`).
    pub device: String,
    /// The profile of `[cdi.profiles]`, if any.
    pub profile: Option<String>,
}

/// A hook's arguments that are not a `--cdi-device` request gpushare writes.
#[derive(Debug, thiserror::Error)]
#[error("the hook's arguments {args:?} are invalid: allowed is gpushare hook prestart {CDI_DEVICE_FLAG} <device> [{CDI_PROFILE_FLAG} <name>], as gpushare cdi generate writes them")]
pub struct BadHookArgs {
    args: Vec<String>,
}

impl CdiAsk {
    /// The CDI device name: `<device>` or `<device>-<profile>`.
    pub(crate) fn name(&self) -> String {
        match &self.profile {
            Some(p) => format!("{}-{p}", self.device),
            None => self.device.clone(),
        }
    }

    /// The arguments after `gpushare hook prestart`.
    pub(crate) fn flags(&self) -> Vec<String> {
        let mut args = vec![CDI_DEVICE_FLAG.to_owned(), self.device.clone()];
        if let Some(p) = &self.profile {
            args.extend([CDI_PROFILE_FLAG.to_owned(), p.clone()]);
        }
        args
    }

    /// Parses the arguments after `gpushare hook prestart`: `None` when there are none
    /// (the hooks.d hook), the request for exactly `--cdi-device <d> [--profile <p>]`.
    /// The values are checked later, by the request pipeline and the config.
    pub(crate) fn from_flags<S: AsRef<str>>(flags: &[S]) -> Result<Option<Self>, BadHookArgs> {
        let f: Vec<&str> = flags.iter().map(AsRef::as_ref).collect();
        let bad = || BadHookArgs {
            args: f.iter().map(|s| (*s).to_owned()).collect(),
        };
        let ask = |device: &str, profile: Option<&str>| CdiAsk {
            device: device.to_owned(),
            profile: profile.map(str::to_owned),
        };
        match f.as_slice() {
            [] => Ok(None),
            [CDI_DEVICE_FLAG, d] => Ok(Some(ask(d, None))),
            [CDI_DEVICE_FLAG, d, CDI_PROFILE_FLAG, p] => Ok(Some(ask(d, Some(p)))),
            _ => Err(bad()),
        }
    }
}

const CDI_DEVICE_ALLOWED: &str = "a device of gpushare's CDI spec: a GPU index like 0, GPU-<uuid>, MIG-<uuid>, or <gpu>-mig-<mig> like 1-mig-0";

/// A profile's limits as the config holds them (`[cdi.profiles.<name>]`): each limit's row
/// ([`profile_keys`]) and its value as written.
pub(crate) type ProfileLimits<'a> = Vec<(&'static KeySpec, ProfileValue<'a>)>;

/// The request a CDI device of gpushare's carries, and the container's own device key
/// beside it, which [`check_same_devices`] compares once both are resolved.
#[derive(Debug)]
pub(crate) struct CdiRequest {
    pub request: Request,
    pub own_device: Option<Sourced<DeviceValue>>,
}

/// Parses a CDI device's base name (the `--cdi-device` of its hook): `0`, `GPU-<uuid>`,
/// `MIG-<uuid>` or `<gpu>-mig-<mig>` (CDI names cannot hold `:`). One device, never a list.
pub(crate) fn parse_cdi_device(raw: &str) -> Result<DeviceRequest, RequestError> {
    check_raw(CDI_KIND, raw, CDI_DEVICE_ALLOWED)?;
    let selector = match raw.split_once("-mig-") {
        Some((gpu, mig)) => parse_index(gpu)
            .zip(parse_index(mig))
            .map(|(gpu, mig)| DeviceSelector::MigIndex { gpu, mig }),
        None if raw.contains([',', ':']) => None,
        None => parse_selector(raw),
    };
    selector
        .map(|s| DeviceRequest(vec![s]))
        .ok_or_else(|| invalid(CDI_KIND, raw, CDI_DEVICE_ALLOWED))
}

/// The request of a CDI device (its hook's arguments: `device`, and the limits of its
/// profile), with what the container's own request keys say beside it.
///
/// The CDI device is the node's: its CDI spec, written by root, put the hook there, and a
/// container's author cannot write a hook. The container's own keys (annotations, and
/// `GPUSHARE_*` variables where `accept-env-requests` takes them) may only repeat it: a
/// key that is part of the daemon identity (a limit) must equal the profile's (a profile
/// that sets no such limit allows none), a device key is returned in
/// [`CdiRequest::own_device`] to be compared once resolved; the others
/// (`gpushare.io/ipc`, keys that only set a client variable) are carried into the
/// request, under the node's rules for them as for any request. `default-device` never applies: the CDI device is the container's device.
/// `Ok(None)` for a pod's sandbox, as [`parse`].
pub(crate) fn from_cdi(
    c: &Inputs<'_>,
    opts: &Options,
    device: &str,
    profile: Option<ProfileLimits<'_>>,
) -> Result<Option<CdiRequest>, RequestError> {
    if sandbox_marker(|k| c.annotation(k)).is_some() {
        return Ok(None);
    }
    let cdi_device = Sourced {
        value: DeviceValue::Named(parse_cdi_device(device)?),
        key: CDI_KIND,
        raw: device.to_owned(),
    };
    let profile = profile.unwrap_or_default();
    let mut settings = Settings::default();
    for (key, raw) in profile {
        let Some(number) = key.number() else {
            continue;
        };
        // Errors name the profile's key (`[cdi.profiles.<name>] <key>`); the config's
        // load already parsed the same text with the same grammar.
        let value = Sourced::parse(key.name, &raw.text(), |k, r| number.parse(k, r))?;
        settings = settings.with(key, value);
    }
    refuse_env(c, opts)?;
    let lookup = |key| lookup(c, opts, key);
    let own = Settings::read(lookup)?;
    for (key, asked) in own.iter() {
        if !key.identity {
            settings = settings.with(key, asked.clone());
            continue;
        }
        let what = match settings.get(key) {
            Some(p) if p.value == asked.value => continue,
            Some(p) => format!("whose profile sets {}", p.raw),
            None => "which sets none".into(),
        };
        return Err(RequestError::BesideCdi {
            key: asked.key,
            value: asked.raw.clone(),
            device: device.to_owned(),
            what,
        });
    }
    let own_device = lookup(&DEVICE)
        .map(|(key, raw)| device_value(c, opts, key, raw))
        .transpose()?;
    Ok(Some(CdiRequest {
        request: Request {
            device: cdi_device,
            ipc: sourced(lookup(&IPC), parse_ipc)?,
            settings,
        },
        own_device,
    }))
}

/// Refuses a container's device key that resolved to other devices than its CDI device.
pub(crate) fn check_same_devices(
    cdi: &Sourced<DeviceValue>,
    cdi_devices: &ResolvedDevices,
    own: &Sourced<DeviceValue>,
    own_devices: &ResolvedDevices,
) -> Result<(), RequestError> {
    let mut a = cdi_devices.uuids.clone();
    let mut b = own_devices.uuids.clone();
    a.sort();
    b.sort();
    if a == b {
        return Ok(());
    }
    Err(RequestError::BesideCdi {
        key: own.key,
        value: own.raw.clone(),
        device: cdi.raw.clone(),
        what: format!("which is {}", cdi_devices.uuids.join(",")),
    })
}

/// Checks a parsed request against this node, for every path that serves one (the shim,
/// hook-only mode, `gpushare daemon start`), before anything is created: the devices'
/// memory ([`check_against`]) and the operator's ceilings ([`check_ceilings`]). Of two
/// bounds on the pinned memory limit the tighter one is checked first, so that the
/// refusal's "allowed" range is one that passes.
pub(crate) fn check(
    req: &Request,
    devices: &ResolvedDevices,
    ceilings: &Ceilings,
) -> Result<(), RequestError> {
    let ceiling_is_tighter = ceilings
        .0
        .iter()
        .any(|(k, c)| **k == PINNED_MEMORY_LIMIT && *c < devices.memory_bytes);
    if ceiling_is_tighter {
        check_ceilings(req, ceilings)?;
        check_against(req, devices)
    } else {
        check_against(req, devices)?;
        check_ceilings(req, ceilings)
    }
}

/// Refuses a value above the operator's ceiling for its key; a key not given is not
/// checked.
pub(crate) fn check_ceilings(req: &Request, ceilings: &Ceilings) -> Result<(), RequestError> {
    for (key, asked) in req.settings.iter() {
        let Some(number) = key.number() else {
            continue;
        };
        let ceiling = ceilings.0.iter().find(|(k, _)| *k == key);
        if let Some((_, max)) = ceiling.filter(|(_, max)| asked.value > *max) {
            return Err(RequestError::AboveCeiling {
                key: asked.key,
                value: asked.raw.clone(),
                ceiling_key: key.ceiling_key.unwrap_or(key.name),
                ceiling: number.config_text(*max),
                min: number.min_text(),
            });
        }
    }
    Ok(())
}

/// Checks the request against the devices it resolved to: the pinned memory limit must be at
/// most the device memory (for a MIG device its own memory; for a GPU list the smallest GPU's,
/// since MPS applies the limit to each device). Part of `check`.
pub fn check_against(req: &Request, devices: &ResolvedDevices) -> Result<(), RequestError> {
    if let Some(limit) = req.settings.get(&PINNED_MEMORY_LIMIT) {
        if limit.value > devices.memory_bytes {
            let device = match (devices.kind, devices.uuids.as_slice()) {
                (DeviceKind::Gpus, [_, _, ..]) => {
                    format!("the smallest of {}", devices.uuids.join(", "))
                }
                _ => devices.uuids.join(", "),
            };
            return Err(RequestError::ExceedsMemory {
                key: limit.key,
                value: limit.raw.clone(),
                device,
                memory_bytes: devices.memory_bytes,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::grammar::tests::assert_msg;
    use super::types::{GIB, MIB};
    use super::*;
    use crate::device::quote;
    use crate::device::sample;
    use crate::device::testing::{GPU0, GPU1, GPU2, MIG0, MIG1};
    use std::collections::HashMap;

    fn env(entries: &[&str]) -> Vec<String> {
        entries.iter().map(|s| s.to_string()).collect()
    }

    fn run(
        annotations: &[(&str, &str)],
        env: &[String],
        accept_env: bool,
    ) -> Result<Option<Request>, RequestError> {
        let map: HashMap<String, String> = annotations
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let inputs = Inputs {
            annotations: Some(&map),
            env,
            ..Inputs::default()
        };
        parse(
            &inputs,
            &Options {
                accept_env,
                default_device: None,
                accept_visible_devices_env: false,
            },
        )
    }

    /// The settings of the two limits.
    fn limits(tp: Option<Sourced<u64>>, mem: Option<Sourced<u64>>) -> Settings {
        let mut s = Settings::default();
        if let Some(tp) = tp {
            s = s.with(&ACTIVE_THREAD_PERCENTAGE, tp);
        }
        if let Some(mem) = mem {
            s = s.with(&PINNED_MEMORY_LIMIT, mem);
        }
        s
    }

    fn src<T>(value: T, key: &'static str, raw: &str) -> Sourced<T> {
        Sourced {
            value,
            key,
            raw: raw.to_owned(),
        }
    }

    #[test]
    fn parse_sources() {
        use DeviceSelector::*;
        let dev = |v: Vec<DeviceSelector>, key, raw: &str| {
            src(DeviceValue::Named(DeviceRequest(v)), key, raw)
        };
        struct Case {
            name: &'static str,
            annotations: &'static [(&'static str, &'static str)],
            env: &'static [&'static str],
            accept_env: bool,
            want: Option<Request>,
        }
        let cases = vec![
            Case {
                name: "nothing passes through",
                annotations: &[],
                env: &["PATH=/bin", "HOME=/root"],
                accept_env: true,
                want: None,
            },
            Case {
                name: "limits without device pass through unread",
                annotations: &[("gpushare.io/active-thread-percentage", "bogus")],
                env: &["GPUSHARE_IPC=bogus"],
                accept_env: true,
                want: None,
            },
            Case {
                name: "unknown gpushare annotations and env are ignored",
                annotations: &[
                    ("gpushare.io/device", "0"),
                    ("gpushare.io/future-key", "x\0y"),
                ],
                env: &["GPUSHARE_FUTURE=1", "GPUSHARE_DEVICE_EXTRA=2"],
                accept_env: false,
                want: Some(Request {
                    device: dev(vec![Index(0)], "gpushare.io/device", "0"),
                    ipc: None,
                    settings: limits(None, None),
                }),
            },
            Case {
                name: "all from annotations",
                annotations: &[
                    ("gpushare.io/device", "0:1"),
                    ("gpushare.io/active-thread-percentage", "25"),
                    ("gpushare.io/pinned-memory-limit", "2G"),
                    ("gpushare.io/ipc", "host"),
                ],
                env: &[],
                accept_env: true,
                want: Some(Request {
                    device: dev(
                        vec![MigIndex { gpu: 0, mig: 1 }],
                        "gpushare.io/device",
                        "0:1",
                    ),
                    ipc: Some(src(IpcMode::Host, "gpushare.io/ipc", "host")),
                    settings: limits(
                        Some(src(25, "gpushare.io/active-thread-percentage", "25")),
                        Some(src(2 * GIB, "gpushare.io/pinned-memory-limit", "2G")),
                    ),
                }),
            },
            Case {
                name: "all from env, last occurrence wins",
                annotations: &[],
                env: &[
                    "GPUSHARE_DEVICE=1",
                    "GPUSHARE_DEVICE=0,1",
                    "GPUSHARE_ACTIVE_THREAD_PERCENTAGE=bogus",
                    "GPUSHARE_ACTIVE_THREAD_PERCENTAGE=30",
                    "GPUSHARE_PINNED_MEMORY_LIMIT=512M",
                    "GPUSHARE_IPC=isolated",
                    "GPUSHARE_IPC",
                ],
                accept_env: true,
                want: Some(Request {
                    device: dev(vec![Index(0), Index(1)], "GPUSHARE_DEVICE", "0,1"),
                    ipc: Some(src(IpcMode::Isolated, "GPUSHARE_IPC", "isolated")),
                    settings: limits(
                        Some(src(30, "GPUSHARE_ACTIVE_THREAD_PERCENTAGE", "30")),
                        Some(src(512 * MIB, "GPUSHARE_PINNED_MEMORY_LIMIT", "512M")),
                    ),
                }),
            },
            Case {
                name: "annotation wins over env, key by key",
                annotations: &[
                    ("gpushare.io/device", "1"),
                    ("gpushare.io/pinned-memory-limit", "1G"),
                ],
                env: &[
                    "GPUSHARE_DEVICE=bogus",
                    "GPUSHARE_PINNED_MEMORY_LIMIT=bogus",
                    "GPUSHARE_ACTIVE_THREAD_PERCENTAGE=10",
                ],
                accept_env: true,
                want: Some(Request {
                    device: dev(vec![Index(1)], "gpushare.io/device", "1"),
                    ipc: None,
                    settings: limits(
                        Some(src(10, "GPUSHARE_ACTIVE_THREAD_PERCENTAGE", "10")),
                        Some(src(GIB, "gpushare.io/pinned-memory-limit", "1G")),
                    ),
                }),
            },
            Case {
                name: "env value may contain '='",
                annotations: &[],
                env: &["GPUSHARE_DEVICE=0", "OTHER=GPUSHARE_DEVICE=1"],
                accept_env: true,
                want: Some(Request {
                    device: dev(vec![Index(0)], "GPUSHARE_DEVICE", "0"),
                    ipc: None,
                    settings: limits(None, None),
                }),
            },
            Case {
                name: "annotations only when env is refused",
                annotations: &[("gpushare.io/device", GPU1)],
                env: &["PATH=/bin"],
                accept_env: false,
                want: Some(Request {
                    device: dev(vec![GpuUuid(GPU1.into())], "gpushare.io/device", GPU1),
                    ipc: None,
                    settings: limits(None, None),
                }),
            },
        ];
        for case in cases {
            let got = run(case.annotations, &env(case.env), case.accept_env).expect(case.name);
            assert_eq!(got, case.want, "{}", case.name);
        }
    }

    #[test]
    fn parse_errors() {
        // (annotations, env, accept_env, key named, value named, message part)
        type Case = (
            &'static [(&'static str, &'static str)],
            &'static [&'static str],
            bool,
            &'static str,
            &'static str,
            &'static str,
        );
        let cases: &[Case] = &[
            (
                &[],
                &["GPUSHARE_DEVICE=0"],
                false,
                "GPUSHARE_DEVICE",
                "0",
                "is refused: env requests are disabled by accept-env-requests = false; use the annotation gpushare.io/device instead",
            ),
            (
                &[("gpushare.io/device", "0")],
                &["GPUSHARE_PINNED_MEMORY_LIMIT=1G"],
                false,
                "GPUSHARE_PINNED_MEMORY_LIMIT",
                "1G",
                "accept-env-requests = false; use the annotation gpushare.io/pinned-memory-limit instead",
            ),
            (
                &[("gpushare.io/device", "0")],
                &["GPUSHARE_DEVICE=0"],
                false,
                "GPUSHARE_DEVICE",
                "0",
                "env requests are disabled",
            ),
            (&[], &["GPUSHARE_IPC="], false, "GPUSHARE_IPC", "", "env requests are disabled"),
            (&[], &["GPUSHARE_DEVICE="], true, "GPUSHARE_DEVICE", "", "it is empty; allowed is a GPU index"),
            (
                &[("gpushare.io/device", "0")],
                &["GPUSHARE_ACTIVE_THREAD_PERCENTAGE=101"],
                true,
                "GPUSHARE_ACTIVE_THREAD_PERCENTAGE",
                "101",
                "allowed is an integer from 1 to 100",
            ),
            (
                &[("gpushare.io/device", "0"), ("gpushare.io/pinned-memory-limit", "0M")],
                &[],
                true,
                "gpushare.io/pinned-memory-limit",
                "0M",
                "it is zero; allowed is at least 1M",
            ),
            (
                &[("gpushare.io/device", "0"), ("gpushare.io/ipc", "none")],
                &["GPUSHARE_IPC=host"],
                true,
                "gpushare.io/ipc",
                "none",
                "allowed is isolated or host",
            ),
            (
                &[("gpushare.io/device", "")],
                &["GPUSHARE_DEVICE=0"],
                true,
                "gpushare.io/device",
                "",
                "it is empty",
            ),
        ];
        for (annotations, env_entries, accept_env, key, raw, want) in cases {
            let err = run(annotations, &env(env_entries), *accept_env).expect_err(want);
            assert_msg(&err, key, raw, want);
        }
    }

    fn request_with_limit(key: &'static str, raw: &str) -> Request {
        Request {
            device: src(
                DeviceValue::Named(DeviceRequest(vec![])),
                "gpushare.io/device",
                "",
            ),
            ipc: None,
            settings: limits(None, Some(src(parse_size(key, raw).expect(raw), key, raw))),
        }
    }

    #[test]
    fn against_devices() {
        let inv = sample();
        let resolve = |raw: &str| {
            src(
                DeviceValue::Named(parse_device("gpushare.io/device", raw).expect(raw)),
                "gpushare.io/device",
                raw,
            )
            .resolve(&inv)
            .expect(raw)
        };
        let key = "gpushare.io/pinned-memory-limit";
        // (device, limit, Ok or the error's tail)
        let cases: &[(&str, &str, Result<(), String>)] = &[
            ("0", "24G", Ok(())),
            ("0", "24576M", Ok(())),
            ("2", "64G", Ok(())),
            ("0,2", "24G", Ok(())),
            ("1:1", "10G", Ok(())),
            ("1:1", "10240MiB", Ok(())),
            ("0", "64G", Err(format!("exceeds the memory of {GPU0} (24 GiB): allowed is 1M up to 24G"))),
            ("0", "24577M", Err(format!("exceeds the memory of {GPU0} (24 GiB): allowed is 1M up to 24G"))),
            // MIG: the MIG device's own memory, not its GPU's 80 GiB.
            ("1:1", "12G", Err(format!("exceeds the memory of {MIG1} (10 GiB): allowed is 1M up to 10G"))),
            (MIG0, "11G", Err(format!("exceeds the memory of {MIG0} (10 GiB): allowed is 1M up to 10G"))),
            ("2,0", "32G", Err(format!("exceeds the memory of the smallest of {GPU2}, {GPU0} (24 GiB): allowed is 1M up to 24G"))),
        ];
        for (device, limit, want) in cases {
            let req = request_with_limit(key, limit);
            let got = check_against(&req, &resolve(device));
            match (got, want) {
                (Ok(()), Ok(())) => {}
                (Err(err), Err(tail)) => {
                    assert_msg(&err, key, limit, tail);
                    assert_eq!(err.to_string(), format!("{key}={} {tail}", quote(limit)));
                }
                (got, want) => panic!("{device} {limit}: got {got:?}, want {want:?}"),
            }
        }
        // Sizes that are not a whole GiB are shown in MiB.
        let odd = ResolvedDevices {
            kind: DeviceKind::Mig,
            uuids: vec![MIG0.into()],
            gpu_indices: vec![0],
            memory_bytes: 5952 * MIB,
            mig_profile: Some("1g.6gb".into()),
        };
        let err = check_against(
            &request_with_limit("GPUSHARE_PINNED_MEMORY_LIMIT", "6G"),
            &odd,
        )
        .expect_err("6G > 5952M");
        assert_eq!(
            err.to_string(),
            format!("GPUSHARE_PINNED_MEMORY_LIMIT=\"6G\" exceeds the memory of {MIG0} (5952 MiB): allowed is 1M up to 5952M")
        );
        // No limit: nothing to check.
        let mut none = request_with_limit(key, "1M");
        none.settings = Settings::default();
        check_against(&none, &odd).expect("no limit");
    }

    /// The operator's ceilings refuse a request above them with one line naming
    /// the key, the value and the ceiling; a limit not given, or at the ceiling, passes.
    #[test]
    fn ceilings_refuse_requests_above_them() {
        let inv = sample();
        let gpu0 = src(
            DeviceValue::Named(parse_device("gpushare.io/device", "0").expect("0")),
            "gpushare.io/device",
            "0",
        )
        .resolve(&inv)
        .expect("GPU 0, 24 GiB");
        let req = |tp: Option<(&'static str, &str)>, mem: Option<(&'static str, &str)>| Request {
            device: src(
                DeviceValue::Named(DeviceRequest(vec![])),
                "gpushare.io/device",
                "0",
            ),
            ipc: None,
            settings: limits(
                tp.map(|(k, raw)| src(parse_percentage(k, raw).expect(raw), k, raw)),
                mem.map(|(k, raw)| src(parse_size(k, raw).expect(raw), k, raw)),
            ),
        };
        let ceil = |tp: Option<u64>, mem: Option<u64>| {
            let tp = tp.map(|max| (&ACTIVE_THREAD_PERCENTAGE, max));
            let mem = mem.map(|max| (&PINNED_MEMORY_LIMIT, max));
            Ceilings(tp.into_iter().chain(mem).collect())
        };
        let tp_key = ACTIVE_THREAD_PERCENTAGE.annotation;
        let mem_key = PINNED_MEMORY_LIMIT.annotation;
        #[rustfmt::skip]
        let cases: Vec<(Request, Ceilings, Result<(), String>)> = vec![
            // Threads.
            (req(Some((tp_key, "80")), None), ceil(Some(50), None),
             Err("gpushare.io/active-thread-percentage=\"80\" is above this node's mps.max-active-thread-percentage = 50; allowed is 1 to 50".into())),
            (req(Some(("GPUSHARE_ACTIVE_THREAD_PERCENTAGE", "51")), None), ceil(Some(50), None),
             Err("GPUSHARE_ACTIVE_THREAD_PERCENTAGE=\"51\" is above this node's mps.max-active-thread-percentage = 50; allowed is 1 to 50".into())),
            (req(Some((tp_key, "50")), None), ceil(Some(50), None), Ok(())),
            (req(None, None), ceil(Some(50), Some(GIB)), Ok(())),
            (req(Some((tp_key, "100")), None), ceil(None, Some(GIB)), Ok(())),
            // Memory: the ceiling in the config's syntax.
            (req(None, Some((mem_key, "8G"))), ceil(None, Some(4 * GIB)),
             Err("gpushare.io/pinned-memory-limit=\"8G\" is above this node's mps.max-pinned-memory-limit = 4G; allowed is 1M to 4G".into())),
            (req(None, Some((mem_key, "4097M"))), ceil(None, Some(4 * GIB)),
             Err("gpushare.io/pinned-memory-limit=\"4097M\" is above this node's mps.max-pinned-memory-limit = 4G; allowed is 1M to 4G".into())),
            (req(None, Some((mem_key, "2G"))), ceil(None, Some(1536 * MIB)),
             Err("gpushare.io/pinned-memory-limit=\"2G\" is above this node's mps.max-pinned-memory-limit = 1536M; allowed is 1M to 1536M".into())),
            (req(None, Some((mem_key, "4GiB"))), ceil(None, Some(4 * GIB)), Ok(())),
            // Both asked, the threads refused first.
            (req(Some((tp_key, "90")), Some((mem_key, "8G"))), ceil(Some(50), Some(4 * GIB)),
             Err("gpushare.io/active-thread-percentage=\"90\" is above this node's mps.max-active-thread-percentage = 50; allowed is 1 to 50".into())),
            // Of the ceiling and the device's 24 GiB, the tighter bound speaks.
            (req(None, Some((mem_key, "30G"))), ceil(None, Some(16 * GIB)),
             Err("gpushare.io/pinned-memory-limit=\"30G\" is above this node's mps.max-pinned-memory-limit = 16G; allowed is 1M to 16G".into())),
            (req(None, Some((mem_key, "30G"))), ceil(None, Some(32 * GIB)),
             Err(format!("gpushare.io/pinned-memory-limit=\"30G\" exceeds the memory of {GPU0} (24 GiB): allowed is 1M up to 24G"))),
            (req(None, Some((mem_key, "40G"))), ceil(None, Some(32 * GIB)),
             Err(format!("gpushare.io/pinned-memory-limit=\"40G\" exceeds the memory of {GPU0} (24 GiB): allowed is 1M up to 24G"))),
            (req(None, Some((mem_key, "24G"))), ceil(None, Some(32 * GIB)), Ok(())),
            // No ceilings: the device check alone.
            (req(Some((tp_key, "100")), Some((mem_key, "24G"))), Ceilings::default(), Ok(())),
        ];
        for (r, c, want) in cases {
            let got = check(&r, &gpu0, &c).map_err(|e| e.to_string());
            assert_eq!(got, want, "{r:?} {c:?}");
            if let Err(msg) = got {
                assert!(!msg.contains('\n'), "{msg:?}");
            }
        }
    }

    #[test]
    fn sourced_resolve_names_key() {
        let inv = sample();
        let req = src(
            DeviceValue::Named(parse_device("GPUSHARE_DEVICE", "5").expect("5")),
            "GPUSHARE_DEVICE",
            "5",
        );
        assert_eq!(
            req.resolve(&inv).expect_err("5").to_string(),
            "GPUSHARE_DEVICE=\"5\" names GPU 5, which does not exist: this node has GPUs 0, 1, 2"
        );
    }

    #[test]
    fn allocated_needs_a_container() {
        let err = parse_device_without_container("--device", "allocated", "gpushare daemon start")
            .expect_err("no container")
            .to_string();
        assert_eq!(
            err,
            "--device=\"allocated\" is refused: allocated means the devices allocated to a container, and gpushare daemon start has no container; allowed is a GPU index like 0, GPU-<uuid>, MIG-<uuid>, <gpu>:<mig> like 0:1, or a comma-separated list of GPU indices and GPU-<uuid>s"
        );
        // Other values parse as named devices, and errors do not offer allocated.
        assert_eq!(
            parse_device_without_container("--device", "0:1", "x").expect("0:1"),
            DeviceRequest(vec![DeviceSelector::MigIndex { gpu: 0, mig: 1 }])
        );
        let err = parse_device_without_container("--device", "x", "x")
            .expect_err("x")
            .to_string();
        assert!(
            err.ends_with("or a comma-separated list of GPU indices and GPU-<uuid>s"),
            "{err}"
        );
        // Where a container is at hand, the allowed text names allocated.
        let err = run(&[("gpushare.io/device", "alocated")], &[], true)
            .expect_err("typo")
            .to_string();
        assert!(
            err.ends_with("or allocated (the devices the scheduler allocated to the container)"),
            "{err}"
        );
    }

    #[test]
    fn sandbox_markers() {
        let map = |pairs: &[(&str, &str)]| -> HashMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        for (key, value) in crate::engine::sandbox_markers() {
            let m = map(&[(key, value), ("gpushare.io/device", "0")]);
            assert_eq!(
                sandbox_marker(|k| m.get(k).map(String::as_str)),
                Some((key, value))
            );
            assert_eq!(
                run(&[(key, value), ("gpushare.io/device", "bogus")], &[], true).expect(key),
                None
            );
        }
        for other in ["container", "Sandbox", "sandbox ", ""] {
            let m = map(&[("io.kubernetes.cri.container-type", other)]);
            assert_eq!(
                sandbox_marker(|k| m.get(k).map(String::as_str)),
                None,
                "{other:?}"
            );
        }
    }

    #[test]
    fn keys_are_consistent() {
        for key in KEYS {
            assert!(key.annotation.starts_with("gpushare.io/"));
            assert!(key.env.starts_with("GPUSHARE_"));
            let suffix = key.annotation.trim_start_matches("gpushare.io/");
            assert_eq!(
                suffix.replace('-', "_").to_uppercase(),
                key.env.trim_start_matches("GPUSHARE_")
            );
        }
    }

    #[test]
    fn cdi_device_names_parse_as_one_device() {
        use DeviceSelector::*;
        for (raw, want) in [
            ("0", Index(0)),
            (GPU0, GpuUuid(GPU0.into())),
            (MIG1, MigUuid(MIG1.into())),
            ("1-mig-1", MigIndex { gpu: 1, mig: 1 }),
        ] {
            assert_eq!(parse_cdi_device(raw).expect(raw), DeviceRequest(vec![want]));
        }
        for bad in [
            "0:1",
            "0,1",
            "1-mig-",
            "-mig-1",
            "x",
            "",
            "0-small",
            "allocated",
        ] {
            let err = parse_cdi_device(bad).expect_err(bad);
            assert!(err.to_string().starts_with("gpushare.io/gpu="), "{err}");
        }
    }

    #[test]
    fn beside_a_cdi_device_the_container_may_only_repeat_it() {
        let opts = |accept_env| Options {
            accept_env,
            default_device: Some(DefaultDevice::Allocated),
            accept_visible_devices_env: false,
        };
        let small: ProfileLimits = vec![
            (&ACTIVE_THREAD_PERCENTAGE, ProfileValue::Integer(25)),
            (&PINNED_MEMORY_LIMIT, ProfileValue::Text("4G")),
        ];
        let ask = |ann: &[(&str, &str)], env: &[&str], accept_env: bool, profile| {
            let ann: HashMap<String, String> = ann
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            let env: Vec<String> = env.iter().map(|e| e.to_string()).collect();
            let c = Inputs {
                annotations: Some(&ann),
                env: &env,
                ..Default::default()
            };
            from_cdi(&c, &opts(accept_env), "0", profile)
        };
        // The CDI device alone: its device and its profile's limits, env refused or not.
        let r = ask(&[], &[], false, Some(small.clone())).unwrap().unwrap();
        assert_eq!(r.request.device.key, CDI_KIND);
        let settings = &r.request.settings;
        assert_eq!(settings.value(&ACTIVE_THREAD_PERCENTAGE), Some(25));
        assert_eq!(settings.value(&PINNED_MEMORY_LIMIT), Some(4 << 30));
        assert!(r.own_device.is_none());
        // Repeats are fine; the device key is compared once resolved.
        let r = ask(
            &[
                ("gpushare.io/device", "2"),
                ("gpushare.io/active-thread-percentage", "25"),
                ("gpushare.io/pinned-memory-limit", "4096M"),
                ("gpushare.io/ipc", "host"),
            ],
            &[],
            true,
            Some(small.clone()),
        )
        .unwrap()
        .unwrap();
        assert_eq!(r.own_device.unwrap().raw, "2");
        assert_eq!(r.request.ipc.unwrap().value, IpcMode::Host);
        // A limit that differs, or one the device's profile does not set, is refused;
        // so is an env request where the node takes none.
        for (ann, env, accept_env, profile, key, raw, want) in [
            (
                &[("gpushare.io/active-thread-percentage", "100")][..],
                &[][..],
                true,
                Some(small.clone()),
                "gpushare.io/active-thread-percentage",
                "100",
                "(whose profile sets 25)",
            ),
            (
                &[],
                &["GPUSHARE_PINNED_MEMORY_LIMIT=8G"],
                true,
                Some(small.clone()),
                "GPUSHARE_PINNED_MEMORY_LIMIT",
                "8G",
                "(whose profile sets 4G)",
            ),
            (
                &[("gpushare.io/pinned-memory-limit", "8G")],
                &[],
                true,
                None,
                "gpushare.io/pinned-memory-limit",
                "8G",
                "(which sets none)",
            ),
            (
                &[],
                &["GPUSHARE_DEVICE=0"],
                false,
                None,
                "GPUSHARE_DEVICE",
                "0",
                "env requests are disabled",
            ),
        ] {
            let err = ask(ann, env, accept_env, profile).expect_err(raw);
            assert_msg(&err, key, raw, want);
        }
        // Resolved: the same GPU by another name passes, another GPU is refused.
        let inv = sample();
        let cdi = Sourced {
            value: DeviceValue::Named(parse_cdi_device("0").unwrap()),
            key: CDI_KIND,
            raw: "0".into(),
        };
        let own = |raw: &str| Sourced {
            value: DeviceValue::Named(parse_device(DEVICE.annotation, raw).unwrap()),
            key: DEVICE.annotation,
            raw: raw.into(),
        };
        let cdi_devices = cdi.resolve(&inv).unwrap();
        let same = own(GPU0);
        check_same_devices(&cdi, &cdi_devices, &same, &same.resolve(&inv).unwrap()).unwrap();
        let other = own("2");
        let err = check_same_devices(&cdi, &cdi_devices, &other, &other.resolve(&inv).unwrap())
            .unwrap_err();
        assert_msg(
            &err,
            "gpushare.io/device",
            "2",
            &format!("other than the container's CDI device gpushare.io/gpu=0 (which is {GPU0})"),
        );
    }
}
