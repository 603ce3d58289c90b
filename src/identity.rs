//! The identity of an MPS control daemon: which containers may share it.
//!
//! DESIGN §5: a daemon is identified by (device set, host UID, limit profile). Under
//! `user-mode = "multi-user"` the UID is 0 for everyone (one root daemon per device set);
//! under `limits = "advisory"` the profile is empty. The id is a short hash of the
//! canonical form so `<state-dir>/mps/<id>/pipe/control` stays far below the 108-byte
//! socket limit; the full identity is stored in the daemon's record and compared, so a
//! hash collision is an error, never a shared daemon.

use serde::{Deserialize, Serialize};

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

    /// 12 hex digits of FNV-1a 64 over the canonical form.
    pub fn id(&self) -> String {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in self.canonical().bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        format!("{:012x}", h >> 16)
    }

    /// Whether a container of this identity may use a daemon created for `other`
    /// (everything but the GID must match).
    pub fn same_daemon(&self, other: &Identity) -> bool {
        self.canonical() == other.canonical()
    }
}

/// Whether `s` looks like a daemon id (12 lowercase hex digits). Ids reach paths, so
/// anything else is refused wherever one is read back from a record or an annotation.
pub fn valid_id(s: &str) -> bool {
    s.len() == 12
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
    fn id_validation() {
        assert!(valid_id("0123456789ab"));
        for bad in [
            "",
            "0123456789AB",
            "0123456789a",
            "../../etc/x",
            "0123456789abc",
        ] {
            assert!(!valid_id(bad), "{bad}");
        }
    }
}
