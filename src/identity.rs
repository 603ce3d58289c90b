//! The identity of an MPS control daemon: which containers may share it.
//!
//! A daemon is identified by its device set, its host UID, the IPC mode and the limits it
//! enforces: the request keys whose row says `identity` (`request::keys`). Under
//! `user-mode = "multi-user"` the UID is 0 for everyone (one root daemon per device set);
//! under `limits = "advisory"` no limit is part of it (`Identity::for_request` is that rule,
//! for every path that serves a request). Under `mps.tenant = "namespace"` it also holds
//! the container's [`Tenant`]: its Kubernetes namespace as the runtime told it, or "no
//! namespace" where none can be trusted (docs/design.md, "Tenants"); under the default
//! `"uid"` it holds none, so that the ids of existing daemons do not move. The id is 32
//! lowercase hex digits:
//! the first 128 bits of SHA-256 over the canonical form. Every identity a container can
//! ask for is a tenant's choice, so the id must not be collidable: with a 48-bit unkeyed
//! hash a tenant could find an identity whose id equals a victim's and, started first,
//! make every create of the victim fail (the record compares the full identity, so a
//! collision is an error, never a shared daemon — but a refused create is still a denial
//! of service). 128 bits of SHA-256 make finding one infeasible. The id keeps
//! `<state-dir>/mps/<id>/pipe/control` under the 108-byte socket limit (63 bytes with the
//! default `/run/gpushare`; longer state dirs are refused by the socket-length check).

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::config::{Config, Limits, TenantMode, UserMode};
use crate::request::{IpcMode, KeySpec, Request};

/// Length of a daemon id: 32 lowercase hex digits (128 bits).
pub(crate) const ID_LEN: usize = 32;
/// What a daemon id may be, for error messages.
pub(crate) const ID_ALLOWED: &str = "32 lowercase hex digits";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Identity {
    /// Full UUIDs (`GPU-…` or one `MIG-…`), in request order.
    pub devices: Vec<String>,
    /// Host UID the daemon and its servers run as (0 under multi-user).
    pub uid: u32,
    /// Host GID the daemon runs as. Not part of the id: containers of one UID share a
    /// daemon whatever their group, and the first one's group is used.
    pub gid: u32,
    pub multi_user: bool,
    /// The limits the daemon enforces, each under its row's field name
    /// (`active_thread_percentage`; `pinned_memory_limit`, per device, in bytes).
    #[serde(flatten)]
    pub limits: LimitValues,
    /// The daemon and its clients use the host's IPC namespace and /dev/shm
    /// (`ipc = "host"`); otherwise the daemon's own shm tmpfs is everyone's /dev/shm.
    #[serde(default)]
    pub ipc_host: bool,
    /// Whose daemon it is beside the UID, under `mps.tenant = "namespace"`; `None` under
    /// `"uid"` (and then absent from the JSON and the canonical form).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<Tenant>,
    /// An MPS v3 daemon (`mps.protocol`): root's, multi-user, one per device set; its
    /// containers' limits are their namespaces' ([`Namespace`]), not the daemon's. Absent
    /// from the JSON and the canonical form when false, so legacy ids do not move.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub v3: bool,
}

/// The tenant a container belongs to beside its host UID, under `mps.tenant =
/// "namespace"`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Tenant {
    /// The container's Kubernetes namespace, as containerd's CRI wrote it or NRI reported
    /// it (never as a pod wrote it).
    Namespace(String),
    /// No namespace gpushare can trust (an engine whose caller writes every annotation):
    /// one class of its own, never a Kubernetes namespace's.
    NoNamespace,
}

/// What a namespace may be: what Kubernetes allows (RFC 1123 label).
pub(crate) const NAMESPACE_ALLOWED: &str =
    "a Kubernetes namespace name (1 to 63 lowercase letters, digits and '-', starting and ending with a letter or digit)";

/// Whether `s` is a Kubernetes namespace name (an RFC 1123 label). Checked although the
/// runtime wrote it: it names a daemon in its canonical form, records and `status`.
pub(crate) fn valid_namespace(s: &str) -> bool {
    let alnum = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    !s.is_empty()
        && s.len() <= 63
        && s.bytes().all(|b| alnum(b) || b == b'-')
        && s.bytes().next().is_some_and(alnum)
        && s.bytes().last().is_some_and(alnum)
}

/// A namespace the runtime reported that is no namespace name.
#[derive(Debug, thiserror::Error)]
#[error(
    "the Kubernetes namespace {value:?} ({source_name}) is invalid: allowed is {NAMESPACE_ALLOWED}"
)]
pub struct TenantError {
    value: String,
    source_name: &'static str,
}

impl Tenant {
    /// The tenant of a container on this node: `None` under `mps.tenant = "uid"`; under
    /// `"namespace"`, the namespace the path trusts (`trusted`, with where it came from,
    /// for the error line), else [`Tenant::NoNamespace`].
    pub(crate) fn for_node(
        cfg: &Config,
        trusted: Option<(&str, &'static str)>,
    ) -> Result<Option<Tenant>, TenantError> {
        if cfg.mps.tenant == TenantMode::Uid {
            return Ok(None);
        }
        match trusted {
            None => Ok(Some(Tenant::NoNamespace)),
            Some((ns, _)) if valid_namespace(ns) => Ok(Some(Tenant::Namespace(ns.to_owned()))),
            Some((ns, source_name)) => Err(TenantError {
                value: crate::util::escape(ns).chars().take(64).collect(),
                source_name,
            }),
        }
    }

    /// Its form in the canonical text and in `status`: `ns:<name>`, or `none`.
    pub(crate) fn label(&self) -> String {
        match self {
            Tenant::Namespace(ns) => format!("ns:{ns}"),
            Tenant::NoNamespace => "none".to_owned(),
        }
    }

    /// Whether it is well formed (a valid namespace name, where it names one).
    pub(crate) fn is_valid(&self) -> bool {
        match self {
            Tenant::Namespace(ns) => valid_namespace(ns),
            Tenant::NoNamespace => true,
        }
    }
}

impl Identity {
    /// The daemon identity for a request, from the devices it resolved to, the
    /// container user's host UID, the IPC mode decided for it and its tenant
    /// ([`Tenant::for_node`]). The daemon's group is
    /// the node's `mps.daemon-gid` (unset: the group numbered like the uid), never the
    /// container's: a container started with the `disk` or `video` group must not pass it
    /// to a process that sees the host.
    pub(crate) fn for_request(
        cfg: &Config,
        devices: &[String],
        uid: u32,
        req: &Request,
        ipc: IpcMode,
        tenant: Option<Tenant>,
        v3: bool,
    ) -> Identity {
        if v3 {
            // One root multi-user daemon per device set: the limits are each container's
            // namespace's, and every tenant shares the server (docs/mps.md, "Two backends").
            return Identity {
                devices: devices.to_vec(),
                uid: 0,
                gid: 0,
                multi_user: true,
                limits: LimitValues::default(),
                ipc_host: ipc == IpcMode::Host,
                tenant: None,
                v3: true,
            };
        }
        let multi_user = cfg.mps.user_mode == UserMode::MultiUser;
        Identity {
            devices: devices.to_vec(),
            uid: if multi_user { 0 } else { uid },
            gid: if multi_user {
                0
            } else {
                cfg.mps.daemon_gid.unwrap_or(uid)
            },
            multi_user,
            limits: enforced_limits(cfg, req),
            ipc_host: ipc == IpcMode::Host,
            tenant,
            v3: false,
        }
    }

    /// The canonical text the id hashes; stable across versions (prefix `v1`). The
    /// limits come from their rows (`request::Limit`): the first ones always, in their
    /// `v1` places; a later one only when set, at the end. The tenant is written only when
    /// there is one. So neither a new limit nor `mps.tenant = "uid"` moves an existing id.
    pub(crate) fn canonical(&self) -> String {
        self.canonical_over(crate::request::limits())
    }

    /// The canonical text with `rows` as the limits' rows (a test adds one).
    fn canonical_over(
        &self,
        rows: impl Iterator<
            Item = (
                &'static KeySpec,
                crate::request::Limit,
                crate::request::Number,
            ),
        >,
    ) -> String {
        use std::fmt::Write;
        let mut text = format!(
            "v1|devices={}|uid={}|multi-user={}",
            self.devices.join(","),
            self.uid,
            self.multi_user
        );
        let mut later = String::new();
        for (key, limit, _) in rows {
            match (self.limits.get(key), limit.in_v1) {
                (Some(v), true) => write!(text, "|{}={v}", limit.canonical),
                (None, true) => write!(text, "|{}=-", limit.canonical),
                (Some(v), false) => write!(later, "|{}={v}", limit.canonical),
                (None, false) => Ok(()),
            }
            .unwrap_or_default();
        }
        text.push_str(if self.ipc_host {
            "|ipc=host"
        } else {
            "|ipc=isolated"
        });
        if let Some(t) = &self.tenant {
            text.push_str("|tenant=");
            text.push_str(&t.label());
        }
        text.push_str(&later);
        if self.v3 {
            text.push_str("|protocol=v3");
        }
        text
    }

    /// The value this identity holds for a request key: a limit the daemon enforces,
    /// `None` for any other key.
    pub(crate) fn limit(&self, key: &KeySpec) -> Option<u64> {
        self.limits.get(key)
    }

    /// `ID_LEN` lowercase hex digits: the first 128 bits of SHA-256 over the canonical
    /// form.
    ///
    /// On every create with a request (shim and hook): the hex digits come from a table,
    /// not `write!`, whose formatting machinery cost more than the hash itself.
    pub fn id(&self) -> String {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let digest = Sha256::digest(self.canonical().as_bytes());
        digest[..ID_LEN / 2]
            .iter()
            .flat_map(|b| [HEX[usize::from(b >> 4)], HEX[usize::from(b & 0xf)]])
            .map(char::from)
            .collect()
    }

    /// Whether a container of this identity may use a daemon created for `other`
    /// (everything but the GID must match).
    pub(crate) fn same_daemon(&self, other: &Identity) -> bool {
        self.canonical() == other.canonical()
    }
}

/// The limits a daemon enforces, by row (`request::limits`): the value of each that is
/// set, in the rows' order. In JSON (a record, the shim's annotation) each is its row's
/// `field`: the `v1` limits always (`null` when unset, as they were written before they
/// were rows), a later one only when set.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LimitValues(Vec<(&'static KeySpec, u64)>);

impl LimitValues {
    /// The value of limit `key`, if set.
    pub(crate) fn get(&self, key: &KeySpec) -> Option<u64> {
        self.0.iter().find(|(k, _)| *k == key).map(|&(_, v)| v)
    }

    /// Each limit that is set, in the rows' order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&'static KeySpec, u64)> + '_ {
        self.0.iter().copied()
    }
}

impl FromIterator<(&'static KeySpec, u64)> for LimitValues {
    /// The values given for limits, in the rows' order; any other key is dropped.
    fn from_iter<I: IntoIterator<Item = (&'static KeySpec, u64)>>(iter: I) -> Self {
        let given: Vec<_> = iter.into_iter().collect();
        LimitValues(
            crate::request::limits()
                .filter_map(|(key, _, _)| {
                    given
                        .iter()
                        .rev()
                        .find(|(k, _)| *k == key)
                        .map(|&(_, v)| (key, v))
                })
                .collect(),
        )
    }
}

impl Serialize for LimitValues {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = s.serialize_map(None)?;
        for (key, limit, _) in crate::request::limits() {
            match self.get(key) {
                Some(v) => map.serialize_entry(limit.field, &v)?,
                None if limit.in_v1 => map.serialize_entry(limit.field, &None::<u64>)?,
                None => {}
            }
        }
        map.end()
    }
}

impl<'de> Deserialize<'de> for LimitValues {
    /// The rows' fields of the identity's JSON; every other field is the identity's own.
    /// A limit twice is refused, as serde refuses any field twice.
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Fields;
        impl<'de> serde::de::Visitor<'de> for Fields {
            type Value = LimitValues;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a daemon identity's limits")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<LimitValues, A::Error> {
                let mut values = Vec::new();
                let mut seen = Vec::new();
                while let Some(name) = map.next_key::<std::borrow::Cow<'de, str>>()? {
                    let Some((key, limit, _)) =
                        crate::request::limits().find(|(_, l, _)| l.field == name)
                    else {
                        map.next_value::<serde::de::IgnoredAny>()?;
                        continue;
                    };
                    if seen.contains(&limit.field) {
                        return Err(serde::de::Error::duplicate_field(limit.field));
                    }
                    seen.push(limit.field);
                    if let Some(v) = map.next_value::<Option<u64>>()? {
                        values.push((key, v));
                    }
                }
                Ok(values.into_iter().collect())
            }
        }
        d.deserialize_map(Fields)
    }
}

/// The name of a v3 daemon's one server, in whose namespaces its containers run.
pub(crate) const V3_SERVER: &str = "s";
/// Hex digits of a namespace name after its `c`: 80 bits of SHA-256 over the container id,
/// so the socket path `<pipe>/s/c<20 hex>/control` stays 24 bytes longer than legacy's.
const NAMESPACE_HEX: usize = 20;
/// What a namespace name may be, for error messages.
pub(crate) const NAMESPACE_NAME_ALLOWED: &str = "\"c\" and 20 lowercase hex digits";

/// A container's MPS v3 namespace: its name on the daemon's server and the limits it is
/// capped at before its first process (docs/mps.md, "Two backends").
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Namespace {
    /// `c` and `NAMESPACE_HEX` hex digits of SHA-256 over the container id: within MPS's
    /// name rule (lowercase letters, digits, underscores, at most 64), derived, never
    /// chosen by a tenant.
    pub name: String,
    #[serde(flatten)]
    pub limits: LimitValues,
}

impl Namespace {
    /// The namespace of container `container_id` with `limits`.
    pub(crate) fn of_container(container_id: &str, limits: LimitValues) -> Namespace {
        Namespace {
            name: Self::name_for(container_id),
            limits,
        }
    }

    /// The namespace name of container `container_id`.
    pub(crate) fn name_for(container_id: &str) -> String {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let digest = Sha256::digest(container_id.as_bytes());
        std::iter::once('c')
            .chain(
                digest[..NAMESPACE_HEX / 2]
                    .iter()
                    .flat_map(|b| [HEX[usize::from(b >> 4)], HEX[usize::from(b & 0xf)]])
                    .map(char::from),
            )
            .collect()
    }

    /// Whether `s` is a namespace name gpushare makes (`NAMESPACE_NAME_ALLOWED`).
    pub(crate) fn valid_name(s: &str) -> bool {
        s.len() == 1 + NAMESPACE_HEX
            && s.starts_with('c')
            && s[1..]
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    }

    /// Whether every limit is within its row's range.
    pub(crate) fn limits_valid(&self) -> bool {
        crate::request::limits().all(|(key, _, _)| {
            self.limits
                .get(key)
                .is_none_or(|v| key.number().is_some_and(|n| n.allows(v)))
        })
    }
}

/// The limits a request's daemon (legacy) or namespace (v3) enforces: each limit row's
/// value the request asks for or the node's default, under `limits = "enforced"`; none
/// under `"advisory"`.
pub(crate) fn enforced_limits(cfg: &Config, req: &Request) -> LimitValues {
    crate::request::limits()
        .filter(|(key, _, _)| key.identity && cfg.mps.limits == Limits::Enforced)
        .filter_map(|(key, _, _)| requested(cfg, req, key).map(|v| (key, v)))
        .collect()
}

/// The value a request asks for a numeric key, or the node's default for it (the row's
/// `default_key`): for a limit, what the daemon enforces under `limits = "enforced"`
/// ([`Identity::for_request`]); for a key with a client variable, what the container's
/// client environment carries.
pub(crate) fn requested(cfg: &Config, req: &Request, key: &KeySpec) -> Option<u64> {
    req.settings.value(key).or_else(|| cfg.mps.default_for(key))
}

/// Whether `s` looks like a daemon id (`ID_LEN` lowercase hex digits). Ids reach paths,
/// so anything else is refused wherever one is read back from a record or an annotation.
pub fn valid_id(s: &str) -> bool {
    s.len() == ID_LEN
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// A per-user identity of `uid` on the test inventory's GPU 0, for unit tests here and
/// in the modules that take identities.
#[cfg(test)]
pub(crate) fn test_identity(uid: u32, active_thread_percentage: Option<u8>) -> Identity {
    Identity {
        devices: vec!["GPU-8f8bff94-112e-9541-43da-cfd453333404".into()],
        uid,
        gid: uid,
        multi_user: false,
        limits: test_limits(active_thread_percentage, None),
        ipc_host: false,
        tenant: None,
        v3: false,
    }
}

/// The limits of unit tests' identities: a thread percentage and pinned memory in bytes.
#[cfg(test)]
pub(crate) fn test_limits(threads: Option<u8>, memory: Option<u64>) -> LimitValues {
    use crate::request::{ACTIVE_THREAD_PERCENTAGE, PINNED_MEMORY_LIMIT};
    [
        threads.map(|t| (&ACTIVE_THREAD_PERCENTAGE, u64::from(t))),
        memory.map(|m| (&PINNED_MEMORY_LIMIT, m)),
    ]
    .into_iter()
    .flatten()
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::ACTIVE_THREAD_PERCENTAGE;

    fn ident(uid: u32, tp: Option<u8>) -> Identity {
        test_identity(uid, tp)
    }

    /// A request for GPU 0 (`gpushare.io/device: 0`) with `settings`.
    fn gpu0_request(settings: crate::request::Settings) -> Request {
        use crate::request::{parse_device, DeviceValue, Sourced};
        Request {
            device: Sourced {
                value: DeviceValue::Named(parse_device("gpushare.io/device", "0").unwrap()),
                key: "gpushare.io/device",
                raw: "0".into(),
            },
            ipc: None,
            settings,
        }
    }

    #[test]
    fn id_separates_users_and_profiles_but_not_groups() {
        let a = ident(1000, None);
        assert!(valid_id(&a.id()));
        assert_ne!(a.id(), ident(2000, None).id());
        assert_ne!(a.id(), ident(1000, Some(50)).id());
        let mut other_gid = a.clone();
        other_gid.gid = 5;
        assert_eq!(a.id(), other_gid.id());
        assert!(a.same_daemon(&other_gid));
        assert_eq!(a.id(), ident(1000, None).id(), "stable");
        let host = Identity {
            ipc_host: true,
            ..a.clone()
        };
        assert_ne!(
            a.id(),
            host.id(),
            "host-IPC clients need a daemon on the host's /dev/shm"
        );
    }

    #[test]
    fn id_is_128_bits_of_sha256_over_the_canonical_form() {
        let a = ident(1000, None);
        assert_eq!(
            a.canonical(),
            "v1|devices=GPU-8f8bff94-112e-9541-43da-cfd453333404|uid=1000|multi-user=false|tp=-|mem=-|ipc=isolated",
            "the canonical form is stable across versions"
        );
        // `printf %s "<canonical>" | sha256sum | cut -c1-32`
        assert_eq!(a.id(), "2d3ff58269c1d56e621ea79962171817");
        assert_eq!(a.id().len(), ID_LEN);
        assert_eq!(ID_LEN, 32);
        // Every field of the canonical form set: pinned, so that a change to how the
        // request keys are held can never move an existing daemon's id.
        let full = Identity {
            devices: vec![
                "GPU-8f8bff94-112e-9541-43da-cfd453333404".into(),
                "GPU-22f0c05f-5cf2-5ea2-8297-789695656dc0".into(),
            ],
            uid: 0,
            gid: 0,
            multi_user: true,
            limits: test_limits(Some(25), Some(4 << 30)),
            ipc_host: true,
            tenant: None,
            v3: false,
        };
        assert_eq!(
            full.canonical(),
            "v1|devices=GPU-8f8bff94-112e-9541-43da-cfd453333404,GPU-22f0c05f-5cf2-5ea2-8297-789695656dc0|uid=0|multi-user=true|tp=25|mem=4294967296|ipc=host"
        );
        assert_eq!(full.id(), "f1d2fa8ad98d86ad1a71939e3b54a4a7");
    }

    /// A limit added after the first canonical form (`in_v1: false`) moves no existing
    /// daemon's id: unset, the text and id are the pinned ones; set, it comes last.
    #[test]
    fn a_later_limit_moves_no_existing_id() {
        use crate::request::{Limit, Number, PINNED_MEMORY_LIMIT};
        static LATER: KeySpec = KeySpec {
            name: "later-limit",
            limit: Some(Limit {
                field: "later_limit",
                canonical: "later",
                in_v1: false,
                mps: "later_limit",
                status_field: "later_limit",
                label: "later",
                unit: "",
            }),
            ..PINNED_MEMORY_LIMIT
        };
        let rows =
            || crate::request::limits().chain([(&LATER, LATER.limit.unwrap(), Number::Size)]);
        let a = Identity {
            tenant: Some(Tenant::NoNamespace),
            ..ident(1000, Some(25))
        };
        assert_eq!(a.canonical_over(rows()), a.canonical());
        let mut with = a.clone();
        with.limits.0.push((&LATER, 7 << 20));
        assert_eq!(
            with.canonical_over(rows()),
            format!("{}|later={}", a.canonical(), 7 << 20)
        );
    }

    /// The identity's JSON (every daemon's record, the shim's annotation the hook reads
    /// back) is what it was when the limits were named fields: pinned, byte for byte, both
    /// ways, so that records written before read as the same identity.
    #[test]
    fn json_is_pinned_and_reads_records_written_before() {
        let full = Identity {
            limits: test_limits(Some(25), Some(4 << 30)),
            ..test_identity(1000, None)
        };
        let json = r#"{"devices":["GPU-8f8bff94-112e-9541-43da-cfd453333404"],"uid":1000,"gid":1000,"multi_user":false,"active_thread_percentage":25,"pinned_memory_limit":4294967296,"ipc_host":false}"#;
        assert_eq!(serde_json::to_string(&full).unwrap(), json);
        assert_eq!(serde_json::from_str::<Identity>(json).unwrap(), full);
        let none = test_identity(1000, None);
        let json = r#"{"devices":["GPU-8f8bff94-112e-9541-43da-cfd453333404"],"uid":1000,"gid":1000,"multi_user":false,"active_thread_percentage":null,"pinned_memory_limit":null,"ipc_host":false}"#;
        assert_eq!(serde_json::to_string(&none).unwrap(), json);
        assert_eq!(serde_json::from_str::<Identity>(json).unwrap(), none);
        // Written before `ipc_host` existed, and a limit twice (refused, as any field).
        let old = r#"{"devices":["GPU-8f8bff94-112e-9541-43da-cfd453333404"],"uid":1000,"gid":1000,"multi_user":false,"active_thread_percentage":25,"pinned_memory_limit":null}"#;
        assert_eq!(
            serde_json::from_str::<Identity>(old).unwrap(),
            test_identity(1000, Some(25))
        );
        let twice = old.replace(r#""uid""#, r#""active_thread_percentage":50,"uid""#);
        let err = serde_json::from_str::<Identity>(&twice).unwrap_err();
        assert!(err.to_string().contains("duplicate field"), "{err}");
    }

    /// The limits reach the id from every source they have: a request's keys (pinned
    /// above, `full`), the node's defaults and a CDI profile. Each is pinned here, so that
    /// reading the defaults and profiles from the rows can never move an existing
    /// daemon's id.
    #[test]
    fn ids_from_node_defaults_and_cdi_profiles_are_pinned() {
        let devices = ["GPU-8f8bff94-112e-9541-43da-cfd453333404".to_owned()];
        let cfg = crate::config::parse(
            "[mps]\ndefault-active-thread-percentage = 50\ndefault-pinned-memory-limit = \"1G\"\n[cdi.profiles.small]\nactive-thread-percentage = 25\npinned-memory-limit = \"4G\"\n",
            None,
        )
        .unwrap();
        let plain = gpu0_request(Default::default());
        let by_default =
            Identity::for_request(&cfg, &devices, 1000, &plain, IpcMode::Isolated, None, false);
        assert_eq!(
            by_default.canonical(),
            "v1|devices=GPU-8f8bff94-112e-9541-43da-cfd453333404|uid=1000|multi-user=false|tp=50|mem=1073741824|ipc=isolated"
        );
        // `printf %s "<canonical>" | sha256sum | cut -c1-32`
        assert_eq!(by_default.id(), "9e718f7a43388f2abf5e23f129a1a163");
        let options = crate::request::Options {
            accept_env: false,
            default_device: None,
            accept_visible_devices_env: false,
        };
        let profile = cfg.cdi_profiles["small"].limits();
        let cdi = crate::request::from_cdi(&Default::default(), &options, "0", Some(profile))
            .unwrap()
            .expect("a request");
        let by_profile = Identity::for_request(
            &cfg,
            &devices,
            1000,
            &cdi.request,
            IpcMode::Isolated,
            None,
            false,
        );
        assert_eq!(
            by_profile.canonical(),
            "v1|devices=GPU-8f8bff94-112e-9541-43da-cfd453333404|uid=1000|multi-user=false|tp=25|mem=4294967296|ipc=isolated"
        );
        assert_eq!(by_profile.id(), "bf3820c1fb2bead708adb3e912f58a08");
    }

    /// A key outside the daemon identity (the client priority) never changes the
    /// identity a request gets.
    #[test]
    fn keys_outside_the_identity_leave_it_alone() {
        use crate::request::{Settings, Sourced, CLIENT_PRIORITY};
        assert!(!CLIENT_PRIORITY.identity);
        let plain = gpu0_request(Settings::default());
        let low = gpu0_request(Settings::default().with(
            &CLIENT_PRIORITY,
            Sourced {
                value: 1,
                key: CLIENT_PRIORITY.annotation,
                raw: "1".into(),
            },
        ));
        let cfg = crate::config::parse("", None).unwrap();
        let devices = ["GPU-8f8bff94-112e-9541-43da-cfd453333404".to_owned()];
        let ident = |r: &Request| {
            Identity::for_request(&cfg, &devices, 1000, r, IpcMode::Isolated, None, false)
        };
        assert_eq!(ident(&plain), ident(&low));
        assert_eq!(ident(&plain).id(), ident(&low).id());
    }

    /// The node's config shapes the identity a request gets: user mode, daemon group,
    /// enforced or advisory limits and their defaults, IPC.
    #[test]
    fn for_request_follows_the_node_config() {
        use crate::request::{parse_percentage, Settings, Sourced};
        const TP: &str = "gpushare.io/active-thread-percentage";
        let req = |tp: Option<&str>| {
            gpu0_request(match tp {
                Some(raw) => Settings::default().with(
                    &ACTIVE_THREAD_PERCENTAGE,
                    Sourced {
                        value: parse_percentage(TP, raw).unwrap(),
                        key: TP,
                        raw: raw.into(),
                    },
                ),
                None => Settings::default(),
            })
        };
        let gib = 1u64 << 30;
        // (config, requested percentage, ipc) → (uid, gid, multi-user, tp, mem, ipc_host)
        type Want = (u32, u32, bool, Option<u8>, Option<u64>, bool);
        let cases: &[(&str, Option<&str>, IpcMode, Want)] = &[
            (
                "",
                Some("25"),
                IpcMode::Isolated,
                (1000, 1000, false, Some(25), None, false),
            ),
            (
                "",
                None,
                IpcMode::Host,
                (1000, 1000, false, None, None, true),
            ),
            (
                "[mps]\ndaemon-gid = 44",
                None,
                IpcMode::Isolated,
                (1000, 44, false, None, None, false),
            ),
            (
                "[mps]\nuser-mode = \"multi-user\"\ndaemon-gid = 44",
                None,
                IpcMode::Isolated,
                (0, 0, true, None, None, false),
            ),
            (
                "[mps]\ndefault-active-thread-percentage = 50\ndefault-pinned-memory-limit = \"1G\"",
                None,
                IpcMode::Isolated,
                (1000, 1000, false, Some(50), Some(gib), false),
            ),
            (
                "[mps]\ndefault-active-thread-percentage = 50",
                Some("25"),
                IpcMode::Isolated,
                (1000, 1000, false, Some(25), None, false),
            ),
            (
                "[mps]\nlimits = \"advisory\"\ndefault-active-thread-percentage = 50",
                Some("25"),
                IpcMode::Isolated,
                (1000, 1000, false, None, None, false),
            ),
        ];
        let devices = ["GPU-8f8bff94-112e-9541-43da-cfd453333404".to_owned()];
        for (text, tp, ipc, want) in cases {
            let cfg = crate::config::parse(text, None).unwrap();
            let got = Identity::for_request(&cfg, &devices, 1000, &req(*tp), *ipc, None, false);
            assert_eq!(
                (
                    got.uid,
                    got.gid,
                    got.multi_user,
                    got.limit(&crate::request::ACTIVE_THREAD_PERCENTAGE)
                        .and_then(|v| u8::try_from(v).ok()),
                    got.limit(&crate::request::PINNED_MEMORY_LIMIT),
                    got.ipc_host
                ),
                *want,
                "{text:?} {tp:?} {ipc}"
            );
            assert_eq!(got.devices, devices);
        }
    }

    /// `mps.tenant = "uid"` (the default) puts no tenant in the identity, whatever
    /// namespace a path trusts, so every existing daemon keeps its id (the one pinned
    /// above); `"namespace"` gives each namespace, and containers without a trusted one,
    /// a daemon of their own.
    #[test]
    fn the_tenant_is_in_the_id_only_in_namespace_mode() {
        let devices = ["GPU-8f8bff94-112e-9541-43da-cfd453333404".to_owned()];
        let req = gpu0_request(Default::default());
        let id_in = |cfg: &Config, ns: Option<&str>| {
            let tenant = Tenant::for_node(cfg, ns.map(|n| (n, "test"))).unwrap();
            Identity::for_request(cfg, &devices, 1000, &req, IpcMode::Isolated, tenant, false)
        };
        let by_uid = crate::config::parse("", None).unwrap();
        for ns in [None, Some("team-a"), Some("team-b")] {
            let ident = id_in(&by_uid, ns);
            assert_eq!(ident.tenant, None);
            assert_eq!(ident.id(), "2d3ff58269c1d56e621ea79962171817", "{ns:?}");
            assert!(!serde_json::to_string(&ident).unwrap().contains("tenant"));
        }
        let by_ns = crate::config::parse("[mps]\ntenant = \"namespace\"", None).unwrap();
        let a = id_in(&by_ns, Some("team-a"));
        assert_eq!(
            a.canonical(),
            "v1|devices=GPU-8f8bff94-112e-9541-43da-cfd453333404|uid=1000|multi-user=false|tp=-|mem=-|ipc=isolated|tenant=ns:team-a"
        );
        // `printf %s "<canonical>" | sha256sum | cut -c1-32`
        assert_eq!(a.id(), "e92361fc1af4c133c1b46998bccc5dcd");
        let none = id_in(&by_ns, None);
        assert_eq!(none.tenant, Some(Tenant::NoNamespace));
        assert!(none.canonical().ends_with("|tenant=none"));
        let ids = [a.id(), id_in(&by_ns, Some("team-b")).id(), none.id()];
        assert!(ids.iter().all(|i| valid_id(i)));
        assert!(
            ids[0] != ids[1] && ids[1] != ids[2] && ids[0] != ids[2],
            "{ids:?}"
        );
        assert_ne!(a.id(), id_in(&by_uid, Some("team-a")).id());
        // The JSON the hook reads back round-trips.
        let json = serde_json::to_string(&a).unwrap();
        assert!(
            json.contains(r#""tenant":{"namespace":"team-a"}"#),
            "{json}"
        );
        assert_eq!(serde_json::from_str::<Identity>(&json).unwrap(), a);
        let json = serde_json::to_string(&none).unwrap();
        assert!(json.contains(r#""tenant":"no-namespace""#), "{json}");

        // What is no namespace name is refused with one line, even from a runtime.
        for bad in [
            "",
            "Team-A",
            "team_a",
            "-a",
            "a-",
            "a|b",
            "a\nb",
            &"a".repeat(64),
        ] {
            let err = Tenant::for_node(&by_ns, Some((bad, "NRI's PodSandbox.namespace")))
                .unwrap_err()
                .to_string();
            assert!(
                err.starts_with("the Kubernetes namespace ")
                    && err.contains("(NRI's PodSandbox.namespace) is invalid: allowed is a Kubernetes namespace name")
                    && !err.contains('\n'),
                "{bad:?}: {err}"
            );
        }
        for good in ["a", "kube-system", "0", &"a".repeat(63)] {
            assert!(valid_namespace(good), "{good}");
        }
    }

    #[test]
    fn id_validation() {
        assert!(valid_id("0123456789abcdef0123456789abcdef"));
        for bad in [
            "",
            "0123456789ab",
            "0123456789ABCDEF0123456789ABCDEF",
            "0123456789abcdef0123456789abcde",
            "0123456789abcdef0123456789abcdef0",
            "0123456789abcdef0123456789abcdeg",
            "../../etc/x",
            "0123456789abcdef/../456789abcdef",
        ] {
            assert!(!valid_id(bad), "{bad}");
        }
    }
}
