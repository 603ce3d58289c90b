//! The identity of an MPS control daemon: which containers may share it.
//!
//! DESIGN §5: a daemon is identified by (device set, host UID, limit profile). Under
//! `user-mode = "multi-user"` the UID is 0 for everyone (one root daemon per device set);
//! under `limits = "advisory"` the profile is empty. The id is 32 lowercase hex digits:
//! the first 128 bits of SHA-256 over the canonical form. Every identity a container can
//! ask for is a tenant's choice, so the id must not be collidable: with a 48-bit unkeyed
//! hash a tenant could find an identity whose id equals a victim's and, started first,
//! make every create of the victim fail (the record compares the full identity, so a
//! collision is an error, never a shared daemon — but a refused create is still a denial
//! of service). 128 bits of SHA-256 make finding one infeasible. The id keeps
//! `<state-dir>/mps/<id>/pipe/control` under the 108-byte socket limit (63 bytes with the
//! default `/run/gpushare`; longer state dirs are refused by the socket-length check).

use std::fmt::Write;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Length of a daemon id: 32 lowercase hex digits (128 bits).
pub const ID_LEN: usize = 32;
/// What a daemon id may be, for error messages.
pub const ID_ALLOWED: &str = "32 lowercase hex digits";

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
    /// Enforced on the daemon (`set_default_active_thread_percentage`).
    pub active_thread_percentage: Option<u8>,
    /// Enforced on the daemon per device, in bytes (`set_default_device_pinned_mem_limit`).
    pub pinned_memory_limit: Option<u64>,
    /// The daemon and its clients use the host's IPC namespace and /dev/shm
    /// (`ipc = "host"`); otherwise the daemon's own shm tmpfs is everyone's /dev/shm.
    #[serde(default)]
    pub ipc_host: bool,
}

impl Identity {
    /// The canonical text the id hashes; stable across versions (prefix `v1`).
    pub fn canonical(&self) -> String {
        let opt = |v: Option<u64>| v.map_or_else(|| "-".to_owned(), |v| v.to_string());
        format!(
            "v1|devices={}|uid={}|multi-user={}|tp={}|mem={}|ipc={}",
            self.devices.join(","),
            self.uid,
            self.multi_user,
            opt(self.active_thread_percentage.map(u64::from)),
            opt(self.pinned_memory_limit),
            if self.ipc_host { "host" } else { "isolated" },
        )
    }

    /// [`ID_LEN`] lowercase hex digits: the first 128 bits of SHA-256 over the canonical
    /// form.
    pub fn id(&self) -> String {
        let digest = Sha256::digest(self.canonical().as_bytes());
        digest[..ID_LEN / 2]
            .iter()
            .fold(String::with_capacity(ID_LEN), |mut s, b| {
                // Writing to a String cannot fail.
                let _ = write!(s, "{b:02x}");
                s
            })
    }

    /// Whether a container of this identity may use a daemon created for `other`
    /// (everything but the GID must match).
    pub fn same_daemon(&self, other: &Identity) -> bool {
        self.canonical() == other.canonical()
    }
}

/// Whether `s` looks like a daemon id ([`ID_LEN`] lowercase hex digits). Ids reach paths,
/// so anything else is refused wherever one is read back from a record or an annotation.
pub fn valid_id(s: &str) -> bool {
    s.len() == ID_LEN
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ident(uid: u32, tp: Option<u8>) -> Identity {
        Identity {
            devices: vec!["GPU-8f8bff94-112e-9541-43da-cfd453333404".into()],
            uid,
            gid: uid,
            multi_user: false,
            active_thread_percentage: tp,
            pinned_memory_limit: None,
            ipc_host: false,
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
