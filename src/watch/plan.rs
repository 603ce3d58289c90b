//! What the watcher does about one scan, decided without I/O: which processes it stops,
//! which MPS clients it ends, and the verdict each process is reported with.
//!
//! The rules (docs/mps.md, "The GPU process watcher"):
//! - a process of a served container with a context of its own (not an MPS client) on a
//!   GPU the container is served on is stopped;
//! - a served container's MPS clients on one GPU together may use its pinned limit plus
//!   `memory-margin` per client (NVML counts each client's own context, which the limit
//!   does not): MPS applies the limit to each client process, so k clients would get k
//!   times it; counted per container, the largest clients are ended until the rest fit;
//! - only where the policy is `act` and limits are enforced; otherwise the same verdicts
//!   are reported and nothing is done;
//! - an MPS server, a process of a container gpushare does not serve, and a host process
//!   are never acted on.

use std::collections::BTreeMap;

use super::report::{Kind, Process};
use super::scan::{Listed, Node, Owner};
use crate::config::WatchPolicy;
use crate::state::PodNames;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Rules {
    pub policy: WatchPolicy,
    /// `mps.limits = "enforced"`.
    pub enforced: bool,
    pub margin: u64,
}

impl Rules {
    fn acts(&self) -> bool {
        self.policy == WatchPolicy::Act && self.enforced
    }

    /// Why a verdict was not carried out.
    fn held_back(&self) -> &'static str {
        if !self.enforced {
            "not acted on: mps.limits = \"advisory\""
        } else {
            "not acted on: watch.policy = \"report\""
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Action {
    /// Kill `processes[index]`: it uses a served GPU outside MPS.
    StopDirect(usize),
    /// `terminate_client`, then kill, `processes[index]`: its container is above its limit.
    EndClient(usize),
}

#[derive(Debug, Default)]
pub(crate) struct Plan {
    pub processes: Vec<Process>,
    pub actions: Vec<Action>,
}

pub(crate) fn plan(listed: &[(Listed, Owner)], node: &Node, rules: &Rules) -> Plan {
    let mut out = Plan::default();
    // (served container, GPU) → the indexes of its MPS clients there.
    let mut clients: BTreeMap<(usize, &str), Vec<usize>> = BTreeMap::new();
    for (p, owner) in listed {
        let index = out.processes.len();
        let (kind, container, daemon, names) = match *owner {
            Owner::Daemon(d) => (
                if p.mps {
                    Kind::MpsClient
                } else {
                    Kind::MpsServer
                },
                None,
                node.daemons.get(d).cloned(),
                PodNames::default(),
            ),
            Owner::Container(c) => {
                let s = &node.served[c];
                let kind = if p.mps { Kind::MpsClient } else { Kind::Direct };
                (
                    kind,
                    Some(s.record.id.clone()),
                    Some(s.daemon.clone()),
                    s.record.names.clone(),
                )
            }
            Owner::None => (
                if p.mps { Kind::MpsClient } else { Kind::Direct },
                None,
                None,
                PodNames::default(),
            ),
        };
        let mut verdict = None;
        if let Owner::Container(c) = *owner {
            let s = &node.served[c];
            let served_here = s
                .identity
                .devices
                .iter()
                .any(|d| d.eq_ignore_ascii_case(&p.gpu));
            match kind {
                Kind::Direct if served_here => {
                    let why = format!(
                        "a context of its own on {}, which its container is served on through MPS (daemon {})",
                        p.gpu, s.daemon
                    );
                    if rules.acts() {
                        verdict = Some(format!("stopped: {why}"));
                        out.actions.push(Action::StopDirect(index));
                    } else {
                        verdict = Some(format!("{why}; {}", rules.held_back()));
                    }
                }
                Kind::MpsClient => clients.entry((c, p.gpu.as_str())).or_default().push(index),
                _ => {}
            }
        }
        out.processes.push(Process {
            pid: i32::try_from(p.pid).unwrap_or(i32::MAX),
            kind,
            gpu: p.gpu.clone(),
            gpu_index: p.gpu_index,
            used_memory_bytes: p.used,
            container_id: container,
            daemon,
            names,
            verdict,
        });
    }
    for ((c, gpu), mut group) in clients {
        let Some(limit) = node.served[c].pinned_memory_limit() else {
            continue;
        };
        let used = |procs: &[Process], i: usize| procs[i].used_memory_bytes.unwrap_or(0);
        let total: u64 = group.iter().map(|&i| used(&out.processes, i)).sum();
        let n = group.len() as u64;
        let allowed = limit.saturating_add(n.saturating_mul(rules.margin));
        if total <= allowed {
            continue;
        }
        let why = format!(
            "its container's {n} MPS client(s) on {gpu} use {total} bytes, above its pinned limit of {limit} bytes + {n} x {} bytes of margin",
            rules.margin
        );
        // The largest first, until what is left fits.
        group.sort_by_key(|&i| {
            (
                std::cmp::Reverse(used(&out.processes, i)),
                out.processes[i].pid,
            )
        });
        let mut left = total;
        for i in group {
            if left <= allowed {
                break;
            }
            left -= used(&out.processes, i);
            out.processes[i].verdict = Some(if rules.acts() {
                out.actions.push(Action::EndClient(i));
                format!("ended: {why}")
            } else {
                format!("{why}; {}", rules.held_back())
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::Identity;
    use crate::state::ContainerRecord;
    use crate::watch::scan::Served;

    const GPU0: &str = "GPU-00000000-0000-4000-8000-000000000000";
    const GPU1: &str = "GPU-00000000-0000-4000-8000-000000000001";

    fn node() -> Node {
        let identity = |limit| {
            std::sync::Arc::new(Identity {
                devices: vec![GPU0.to_owned()],
                uid: 1000,
                gid: 1000,
                multi_user: false,
                limits: crate::identity::test_limits(Some(25), limit),
                ipc_host: false,
                tenant: None,
                v3: false,
            })
        };
        let served = |id: &str, limit| Served {
            record: ContainerRecord::new(id.to_owned(), Some(1), None, None),
            daemon: "d".repeat(32),
            identity: identity(limit),
        };
        Node {
            served: vec![served("a", Some(2 << 30)), served("b", None)],
            daemons: vec!["d".repeat(32)],
            ..Node::default()
        }
    }

    fn p(pid: u32, gpu: &str, mps: bool, gib: u64) -> Listed {
        Listed {
            pid,
            gpu: gpu.to_owned(),
            gpu_index: 0,
            mps,
            used: Some(gib << 30),
        }
    }

    const ACT: Rules = Rules {
        policy: WatchPolicy::Act,
        enforced: true,
        margin: 0,
    };

    #[test]
    fn direct_processes_of_served_containers_on_their_gpu_are_stopped_and_nothing_else() {
        let listed = [
            (p(10, GPU0, false, 1), Owner::Container(0)),
            // Its container is not served on GPU1.
            (p(11, GPU1, false, 1), Owner::Container(0)),
            (p(12, GPU0, false, 1), Owner::None),
            (p(13, GPU0, false, 0), Owner::Daemon(0)),
            (p(14, GPU0, true, 1), Owner::Container(0)),
        ];
        let plan = plan(&listed, &node(), &ACT);
        assert_eq!(plan.actions, [Action::StopDirect(0)]);
        let kinds: Vec<Kind> = plan.processes.iter().map(|p| p.kind).collect();
        assert_eq!(
            kinds,
            [
                Kind::Direct,
                Kind::Direct,
                Kind::Direct,
                Kind::MpsServer,
                Kind::MpsClient
            ]
        );
        assert!(plan.processes[0]
            .verdict
            .as_deref()
            .unwrap()
            .starts_with("stopped: "));
        assert!(plan.processes[1..].iter().all(|p| p.verdict.is_none()));
        assert_eq!(plan.processes[0].container_id.as_deref(), Some("a"));
        assert_eq!(plan.processes[3].daemon.as_deref(), Some(&*"d".repeat(32)));
    }

    #[test]
    fn a_containers_clients_share_its_limit_and_the_largest_are_ended_first() {
        let listed = [
            (p(20, GPU0, true, 1), Owner::Container(0)),
            (p(21, GPU0, true, 3), Owner::Container(0)),
            (p(22, GPU0, true, 1), Owner::Container(0)),
            // No limit: never over it.
            (p(23, GPU0, true, 30), Owner::Container(1)),
            (p(24, GPU0, true, 30), Owner::None),
        ];
        // 5 GiB against 2 GiB: ending the 3 GiB client leaves 2 GiB, which fits.
        let plan = plan(&listed, &node(), &ACT);
        assert_eq!(plan.actions, [Action::EndClient(1)]);
        // Within limit + 3 x 1 GiB of margin: nothing.
        let margin = Rules {
            margin: 1 << 30,
            ..ACT
        };
        assert!(super::plan(&listed, &node(), &margin).actions.is_empty());
        // 1 GiB each, three clients: 3 GiB over 2 GiB, one (the lowest pid of equals) goes.
        let even = [
            (p(30, GPU0, true, 1), Owner::Container(0)),
            (p(31, GPU0, true, 1), Owner::Container(0)),
            (p(32, GPU0, true, 1), Owner::Container(0)),
        ];
        assert_eq!(
            super::plan(&even, &node(), &ACT).actions,
            [Action::EndClient(0)]
        );
    }

    #[test]
    fn a_v3_containers_clients_are_judged_against_its_namespace_s_limit() {
        // One v3 daemon (no limits of its own); container a's namespace pins 2 GiB, b's
        // nothing.
        let mut node = node();
        let v3 = std::sync::Arc::new(Identity {
            uid: 0,
            gid: 0,
            multi_user: true,
            limits: Default::default(),
            v3: true,
            ..(*node.served[0].identity).clone()
        });
        for (s, pinned) in node.served.iter_mut().zip([Some(2u64 << 30), None]) {
            s.identity = v3.clone();
            s.record.mps_namespace = Some(crate::identity::Namespace::of_container(
                &s.record.id,
                crate::identity::test_limits(Some(25), pinned),
            ));
        }
        let listed = [
            (p(40, GPU0, true, 1), Owner::Container(0)),
            (p(41, GPU0, true, 3), Owner::Container(0)),
            (p(42, GPU0, true, 30), Owner::Container(1)),
        ];
        assert_eq!(plan(&listed, &node, &ACT).actions, [Action::EndClient(1)]);
    }

    #[test]
    fn report_policy_and_advisory_limits_act_on_nothing_and_say_why() {
        let listed = [
            (p(10, GPU0, false, 1), Owner::Container(0)),
            (p(21, GPU0, true, 3), Owner::Container(0)),
        ];
        for (rules, why) in [
            (
                Rules {
                    policy: WatchPolicy::Report,
                    ..ACT
                },
                "watch.policy = \"report\"",
            ),
            (
                Rules {
                    enforced: false,
                    ..ACT
                },
                "mps.limits = \"advisory\"",
            ),
        ] {
            let plan = plan(&listed, &node(), &rules);
            assert!(plan.actions.is_empty());
            for p in &plan.processes {
                let v = p.verdict.as_deref().unwrap();
                assert!(
                    v.ends_with(why) && !v.starts_with("stopped") && !v.starts_with("ended"),
                    "{v}"
                );
            }
        }
    }
}
