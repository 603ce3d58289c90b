//! A v3 daemon's server and its containers' namespaces, kept as the records say
//! (docs/mps.md, "Two backends"): at every start the server is made and its `default`
//! namespace capped, then every live container's namespace is made again at its name and
//! capped (a restart loses every namespace while the containers bound to their
//! directories keep running); at every check a namespace that is missing or whose limits
//! differ from its record's is made or set again, the `default` namespace is capped again,
//! and a namespace no live record names is deleted.
//!
//! Invariants: the records are the truth (a create writes its record before it makes its
//! namespace, so a namespace listed here without a record is an ended container's, never
//! one being made); a namespace is deleted only when MPS agrees that no client is attached
//! (no `--force`), so a job never loses its namespace under it; every command shares the
//! step's deadline.

use std::time::Instant;

use super::context::Supervisor;
use crate::identity::Namespace;
use crate::mps::v3;

impl Supervisor {
    /// Makes the started daemon's server and caps its `default` namespace (the readiness
    /// check: a stale socket never passes for a live daemon), then the namespaces of the
    /// live records.
    pub(super) fn make_v3_ready(&self, deadline: Instant) -> anyhow::Result<()> {
        v3::make_server(&self.control, &self.ident, deadline)?;
        for ns in self.recorded_namespaces()? {
            v3::admit(&self.control, &ns, deadline)?;
        }
        Ok(())
    }

    /// The check of a v3 daemon: the `default` namespace capped, each live record's
    /// namespace present with its limits, no namespace without a record. Returns how many
    /// it had to correct.
    pub(super) fn reconcile_namespaces(&self, deadline: Instant) -> anyhow::Result<u32> {
        let listed = v3::listed(&self.control, deadline)?;
        let wanted = self.recorded_namespaces()?;
        let mut corrected = 0;
        let default_capped = listed.iter().any(|l| {
            l.name == "default"
                && l.active_thread_percentage
                    .is_some_and(|p| p <= f64::from(v3::DEFAULT_NAMESPACE_PERCENTAGE) + 0.5)
        });
        if !default_capped {
            corrected += 1;
            tracing::warn!(daemon = %self.id, "the v3 server's default namespace was not capped; capping it again");
            v3::cap_default(&self.control, deadline)?;
        }
        for ns in &wanted {
            match listed.iter().find(|l| l.name == ns.name) {
                Some(l) if l.holds(&ns.limits) => continue,
                Some(_) => {
                    tracing::warn!(daemon = %self.id, namespace = %ns.name, "an MPS namespace's limits differ from its container's; setting them again")
                }
                None => {
                    tracing::warn!(daemon = %self.id, namespace = %ns.name, "a running container's MPS namespace is missing; making it again")
                }
            }
            corrected += 1;
            v3::admit(&self.control, ns, deadline)?;
        }
        for l in &listed {
            let ended =
                Namespace::valid_name(&l.name) && !wanted.iter().any(|ns| ns.name == l.name);
            // One try each: a namespace whose client lingers is tried at the next check.
            let once = deadline.min(Instant::now() + std::time::Duration::from_millis(100));
            if ended && v3::retire(&self.control, &l.name, once) {
                tracing::info!(daemon = %self.id, namespace = %l.name, "deleted the MPS namespace of an ended container");
            }
        }
        Ok(corrected)
    }

    /// The namespaces the daemon's live container records name; an error when they
    /// cannot be read (then nothing is deleted).
    fn recorded_namespaces(&self) -> anyhow::Result<Vec<Namespace>> {
        Ok(self
            .state
            .live_containers(&self.id, self.pending_grace)?
            .into_iter()
            .filter_map(|r| r.mps_namespace)
            .collect())
    }
}
