//! The daemon's limits: the control commands and environment that put an identity's
//! limits in place, and the check that keeps them there.
//!
//! Invariants: limits are applied before the record says `ready`, again after every
//! restart (MPS forgets `set_default_*` when the daemon quits), and are in the daemon's
//! environment from its first instant. A tenant reaches the control socket through its
//! pipe directory and may raise them: every `mps.limit-check-interval` the defaults and
//! each running server's limits are read back and set again where they differ. All of a
//! check's commands share one deadline (`CHECK_DEADLINE`), so no stall of the control
//! socket holds the supervisor longer.
//!
//! A check that cannot confirm the limits: a per-user daemon fails closed — after
//! `UNCONFIRMED_CHECKS` such checks in a row it is restarted with its limits (only its own
//! UID's clients use it, and they are the ones that could have stalled it). A multi-user
//! daemon is never stopped, killed or restarted for it: its server is every tenant's, and
//! any tenant can jam `control`, so a restart would be one tenant's way to take the others'
//! server down. The supervisor asks it through root's `control_privileged` instead
//! (`mps::control`), where no tenant can connect; while even that does not confirm, it
//! checks again every interval, warns (`UNCONFIRMED_WARN_EVERY`) and records it for
//! `status`. A non-root tenant cannot change a multi-user daemon's limits (docs/mps.md),
//! so what goes unchecked meanwhile is only what root (a UID-0 container) could change.

use std::time::{Duration, Instant};

use anyhow::bail;

use super::context::Supervisor;
use crate::identity::Identity;
use crate::mps::reply;
use crate::request::{KeySpec, Limit, Number};

/// The longest one limit check may take, all its control commands together: a daemon
/// that has not answered by then has not confirmed its limits.
pub(crate) const CHECK_DEADLINE: Duration = Duration::from_secs(2);

/// Limit checks in a row that may fail to confirm the limits (no answer, an error, past
/// `CHECK_DEADLINE`) before the daemon is restarted with them: a tenant that raised them
/// and then keeps the daemon from answering (its control connections held with slow
/// partial lines) must not keep them raised.
pub(crate) const UNCONFIRMED_CHECKS: u32 = 2;

/// How often a multi-user daemon whose limits stay unconfirmed is warned about again (the
/// first unconfirmed check warns at once): a bound on the log a sustained jam writes.
const UNCONFIRMED_WARN_EVERY: Duration = Duration::from_secs(60);

/// The limit checks in a row that could not confirm the limits, and when a warning last
/// said so.
#[derive(Debug, Default)]
pub(super) struct Unconfirmed {
    checks: u32,
    warned: Option<Instant>,
}

/// The commands that put a daemon's limits in place, in order, from the limits' rows
/// (`request::Limit::mps`). A limit whose client variable is per device (pinned memory) is set per
/// device by ordinal: the daemon sees only its own devices, renumbered from 0
/// (CUDA_VISIBLE_DEVICES), and NVIDIA's device plugin found UUID-keyed limits ignored by
/// some drivers (docs/mps.md, "Limits").
pub(crate) fn limit_commands(ident: &Identity) -> Vec<String> {
    set_limits(ident, None)
}

/// The commands that put the identity's limits on the daemon's defaults (`server` none:
/// `set_default_*`) or on one running server (`set_* <server>`), the same limits in the
/// same order either way.
fn set_limits(ident: &Identity, server: Option<u32>) -> Vec<String> {
    let (scope, target) = match server {
        None => ("default_", String::new()),
        Some(s) => ("", format!("{s} ")),
    };
    let mut cmds = Vec::new();
    for (key, limit, number) in crate::request::limits() {
        let Some(value) = ident.limit(key) else {
            continue;
        };
        let text = number.mps_text(value);
        for device in ordinals(key, ident) {
            let device = device.map_or_else(String::new, |i| format!("{i} "));
            cmds.push(format!("set_{scope}{} {target}{device}{text}", limit.mps));
        }
    }
    cmds
}

/// The device ordinals a limit is set and read per (`Some(0)`, `Some(1)`, …), or once for
/// the daemon (`None`): per device where its client variable is.
fn ordinals(key: &KeySpec, ident: &Identity) -> Vec<Option<usize>> {
    if key.client_env.is_some_and(|c| c.per_device) {
        (0..ident.devices.len()).map(Some).collect()
    } else {
        vec![None]
    }
}

/// A limit's value as the control daemon prints it back (a percentage `25.0`, a size
/// `4096M`), in the unit of its row's grammar; `None` if the reply is not one.
fn read_back(number: Number, reply: &str) -> Option<f64> {
    match number {
        Number::Integer { max, .. } => reply::percentage(reply).filter(|v| *v <= max as f64),
        Number::Size => reply::pinned_mem(reply).map(|b| b as f64),
    }
}

/// The limits in the daemon's own environment, so that it has them from its first instant:
/// the control daemon takes each limit's client variable (the row's `client_env`:
/// `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`, `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` as
/// `<ordinal>=<size>,…`) as its default at start (MPS guide, "Environment variables"),
/// before any client can connect; the `set_default_*` commands of `limit_commands` then
/// set the same values again and are what the limit check reads back.
pub(super) fn limit_env(ident: &Identity) -> Vec<(&'static str, String)> {
    let mut env = Vec::new();
    for key in crate::request::profile_keys() {
        let (Some(value), Some(number), Some(client)) =
            (ident.limit(key), key.number(), key.client_env)
        else {
            continue;
        };
        env.push((client.var, client.value(number, value, ident.devices.len())));
    }
    env
}

/// One limit the limit check compares with, as the control daemon prints it back: its
/// value rounded as `set_*` sends it, and the devices it is read per.
struct Wanted {
    limit: Limit,
    number: Number,
    value: f64,
    devices: Vec<Option<usize>>,
}

impl Wanted {
    /// Every limit the identity sets. A limit read back within `TOLERANCE` of the wanted
    /// value is that value (the daemon prints percentages as decimals).
    fn of(ident: &Identity) -> Vec<Wanted> {
        crate::request::limits()
            .filter_map(|(key, limit, number)| {
                let value = read_back(number, &number.mps_text(ident.limit(key)?))?;
                Some(Wanted {
                    limit,
                    number,
                    value,
                    devices: ordinals(key, ident),
                })
            })
            .collect()
    }

    /// The `get_*` command that reads it back for `device` (`<server> ` first for a
    /// server's, `scope` empty; `default_` for the daemon's defaults).
    fn get(&self, scope: &str, server: Option<u32>, device: Option<usize>) -> String {
        let mut cmd = format!("get_{scope}{}", self.limit.mps);
        for n in [server.map(u64::from), device.map(|i| i as u64)]
            .into_iter()
            .flatten()
        {
            cmd.push_str(&format!(" {n}"));
        }
        cmd
    }
}

/// How far a value read back may be from the one set and still be it.
const TOLERANCE: f64 = 0.01;

impl Supervisor {
    /// Checks that the daemon still enforces the identity's limits. A tenant reaches the
    /// control socket through its pipe directory and may send `set_*` commands: the real
    /// daemon accepts them from its own user (driver 580, docs/gpu-validation.md).
    /// Defaults that differ are set again; a server whose limits were raised gets them set
    /// back. A server's limits apply to the clients it creates afterwards, so only clients
    /// that connected between the raise and this check (at most `limit-check-interval`)
    /// keep the raised limits, until they exit. Shutting such a server down
    /// (`shutdown_server -f`) was tried and is worse on the real driver: the server kept
    /// its clients, stopped answering, and the identity's next client waited behind it.
    /// Returns how many violations were found.
    /// Every control command of one check shares `deadline`: an error, or a command that
    /// has not answered by then, ends the check unconfirmed (`Err`).
    fn enforce_limits(&self, deadline: Instant) -> anyhow::Result<u32> {
        let want = Wanted::of(&self.ident);
        let ask = |cmd: &str| self.ask(cmd, deadline);
        let mut violations = 0;
        if self.defaults_changed(&want, &ask)? {
            violations += 1;
            tracing::warn!(daemon = %self.id, "the daemon's default limits were changed through its control socket; setting them again");
            for cmd in limit_commands(&self.ident) {
                ask(&cmd)?;
            }
        }
        for server in reply::pids(&ask("get_server_list")?) {
            if self.server_raised(server, &want, &ask)? {
                violations += 1;
                tracing::warn!(daemon = %self.id, server, "an MPS server's limits were raised through the control socket; setting them back");
                for cmd in set_limits(&self.ident, Some(server)) {
                    ask(&cmd)?;
                }
            }
        }
        Ok(violations)
    }
    /// One control command of a limit check, answered by `deadline` or an error.
    fn ask(&self, cmd: &str, deadline: Instant) -> anyhow::Result<String> {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            bail!("the limit check did not finish within {CHECK_DEADLINE:?}");
        }
        Ok(self.control.command(cmd, left)?)
    }
    /// Whether the daemon's default limits differ from the identity's.
    fn defaults_changed(
        &self,
        want: &[Wanted],
        ask: &dyn Fn(&str) -> anyhow::Result<String>,
    ) -> anyhow::Result<bool> {
        let mut changed = false;
        for w in want {
            for &device in &w.devices {
                changed |= read_back(w.number, &ask(&w.get("default_", None, device))?)
                    .is_none_or(|got| (got - w.value).abs() > TOLERANCE);
            }
        }
        Ok(changed)
    }
    /// Whether running server `server` has limits above the identity's. A reply that
    /// cannot be read is reported, not taken for a violation: shutting servers down on a
    /// driver whose format differs would stop every job.
    fn server_raised(
        &self,
        server: u32,
        want: &[Wanted],
        ask: &dyn Fn(&str) -> anyhow::Result<String>,
    ) -> anyhow::Result<bool> {
        let unreadable = |cmd: &str, reply: &str| {
            tracing::error!(daemon = %self.id, command = cmd, reply = %crate::util::escape(reply.trim()), "cannot read a server's limit back; it is not checked");
            false
        };
        let mut over = false;
        for w in want {
            for &device in &w.devices {
                let cmd = w.get("", Some(server), device);
                let g = ask(&cmd)?;
                over |= read_back(w.number, &g)
                    .map_or_else(|| unreadable(&cmd, &g), |g| g > w.value + TOLERANCE);
            }
        }
        Ok(over)
    }
    /// Checks the limits (`enforce_limits`) once `next_check` has come, and sets the next.
    /// Counts the checks in a row that could not confirm them in `unconfirmed`; `true` when
    /// that reaches `UNCONFIRMED_CHECKS` for a per-user daemon: it must be restarted. A
    /// multi-user daemon never is (the module's header): its record says since when its
    /// limits are unconfirmed, until a check confirms them again.
    pub(super) fn check_limits_when_due(
        &self,
        next_check: &mut Option<Instant>,
        unconfirmed: &mut Unconfirmed,
    ) -> bool {
        if let (Some(at), Some(every)) = (*next_check, self.limit_check) {
            if Instant::now() >= at {
                *next_check = Some(Instant::now() + every);
                let deadline = Instant::now() + CHECK_DEADLINE;
                let checked = match self.ident.v3 {
                    true => self.reconcile_namespaces(deadline),
                    false => self.enforce_limits(deadline),
                };
                match checked {
                    Ok(_) => self.confirmed(unconfirmed),
                    Err(e) => self.not_confirmed(unconfirmed, &format!("{e:#}")),
                }
            }
        }
        !self.ident.multi_user && unconfirmed.checks >= UNCONFIRMED_CHECKS
    }
    fn confirmed(&self, unconfirmed: &mut Unconfirmed) {
        if self.ident.multi_user && unconfirmed.checks > 0 {
            tracing::info!(daemon = %self.id, checks = unconfirmed.checks, "the multi-user daemon's limits are confirmed again");
            let _ = self.update(|r| r.limits_unconfirmed_since = None);
        }
        *unconfirmed = Unconfirmed::default();
    }
    fn not_confirmed(&self, unconfirmed: &mut Unconfirmed, error: &str) {
        unconfirmed.checks += 1;
        if !self.ident.multi_user {
            tracing::warn!(daemon = %self.id, error, "cannot check the daemon's limits");
            return;
        }
        if unconfirmed.checks == 1 {
            let since = crate::util::unix_now();
            let _ = self.update(|r| r.limits_unconfirmed_since = Some(since));
        }
        if unconfirmed
            .warned
            .is_some_and(|at| at.elapsed() < UNCONFIRMED_WARN_EVERY)
        {
            tracing::debug!(daemon = %self.id, error, checks = unconfirmed.checks, "cannot check the multi-user daemon's limits");
            return;
        }
        unconfirmed.warned = Some(Instant::now());
        tracing::warn!(daemon = %self.id, error, checks = unconfirmed.checks, "cannot check the multi-user daemon's limits (neither control_privileged nor control answered); it is not restarted, other tenants' clients use its server; checking again every interval");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limit_commands_per_device_by_ordinal() {
        let ident = Identity {
            devices: vec!["GPU-a".into(), "GPU-b".into()],
            uid: 1000,
            gid: 1000,
            multi_user: false,
            limits: crate::identity::test_limits(Some(25), Some(4 << 30)),
            ipc_host: false,
            tenant: None,
            v3: false,
        };
        assert_eq!(
            limit_commands(&ident),
            vec![
                "set_default_active_thread_percentage 25",
                "set_default_device_pinned_mem_limit 0 4096M",
                "set_default_device_pinned_mem_limit 1 4096M",
            ]
        );
        assert_eq!(
            set_limits(&ident, Some(42)),
            vec![
                "set_active_thread_percentage 42 25",
                "set_device_pinned_mem_limit 42 0 4096M",
                "set_device_pinned_mem_limit 42 1 4096M",
            ]
        );
        // The same limits in the daemon's environment, pinned: built from the rows.
        assert_eq!(
            limit_env(&ident),
            vec![
                ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "25".to_owned()),
                (
                    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
                    "0=4096M,1=4096M".to_owned()
                ),
            ]
        );
        let none = Identity {
            limits: Default::default(),
            ..ident
        };
        assert!(limit_commands(&none).is_empty());
        assert!(limit_env(&none).is_empty());
    }
}
