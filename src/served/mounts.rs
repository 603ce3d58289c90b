//! What a container gets from its daemon: the pipe directory, the optional log directory
//! and the daemon's shm over `/dev/shm` (or the host's IPC). Planned once per container,
//! from the daemon's directories, where the container sees them and its IPC mode, and
//! rendered three ways: spec edits (the shim), an NRI adjustment (the plugin) and binds a
//! hook makes (hook-only mode). No entry path builds a mount of its own, so the three
//! cannot drift apart.
//!
//! The pipe directory and the log directory are bound read-only, the shm writable, all
//! three `nosuid,nodev,noexec` (docs/design.md, "Mounts of the daemon's directories").

use std::path::{Path, PathBuf};

use crate::bundle::edits::{RemoveMount, RemoveNamespace, SetMount, SpecEdit};
use crate::config::Config;
use crate::request::IpcMode;
use crate::state::StateDir;

/// Mount options for the daemon's pipe and log directories: read-only, no devices, no
/// setuid, no exec.
pub(crate) const READ_ONLY_DIR_OPTIONS: &[&str] =
    &["rbind", "rprivate", "ro", "nosuid", "nodev", "noexec"];
/// Mount options for the daemon's shm over /dev/shm: writable, no devices, no setuid, no
/// exec (as Docker's own /dev/shm).
pub(crate) const SHM_OPTIONS: &[&str] = &["rbind", "rprivate", "nosuid", "nodev", "noexec"];

/// CUDA's default pipe directory, where a client that was given no
/// `CUDA_MPS_PIPE_DIRECTORY` looks.
pub(crate) const CUDA_DEFAULT_PIPE_DIR: &str = "/tmp/nvidia-mps";

const DEV_SHM: &str = "/dev/shm";

/// Where the container sees the daemon's directories.
#[derive(Debug, Clone, PartialEq)]
pub struct Inside {
    pub pipe: PathBuf,
    pub log: Option<PathBuf>,
}

impl Inside {
    /// `mps.container-pipe-dir` and `mps.container-log-dir`: for the shim and the NRI
    /// plugin, which set the client environment that names them.
    pub fn configured(cfg: &Config) -> Self {
        Inside {
            pipe: cfg.mps.container_pipe_dir.clone(),
            log: cfg.mps.container_log_dir.clone(),
        }
    }

    /// CUDA's default pipe directory and no log directory: hook-only mode, where a hook
    /// cannot set the environment that would name others.
    pub(crate) fn cuda_default() -> Self {
        Inside {
            pipe: CUDA_DEFAULT_PIPE_DIR.into(),
            log: None,
        }
    }
}

/// One host directory bound into the container.
#[derive(Debug, Clone, PartialEq)]
pub struct Bind {
    pub source: PathBuf,
    /// Absolute, in the container.
    pub destination: PathBuf,
    /// OCI mount options (`mount(8)` names).
    pub options: &'static [&'static str],
}

impl Bind {
    pub(crate) fn has(&self, option: &str) -> bool {
        self.options.contains(&option)
    }
}

/// The mounts one container gets from its daemon.
#[derive(Debug, Clone, PartialEq)]
pub struct MountPlan {
    /// The daemon's directories, in order: the pipe directory, the log directory when
    /// asked for, the shm when the container has its own IPC namespace.
    pub binds: Vec<Bind>,
    pub ipc: IpcMode,
}

impl MountPlan {
    /// The plan for a container served by daemon `id`.
    pub fn new(dirs: &StateDir, id: &str, inside: Inside, ipc: IpcMode) -> Self {
        let mut binds = vec![Bind {
            source: dirs.pipe_dir(id),
            destination: inside.pipe,
            options: READ_ONLY_DIR_OPTIONS,
        }];
        if let Some(log) = inside.log {
            binds.push(Bind {
                source: dirs.log_dir(id),
                destination: log,
                options: READ_ONLY_DIR_OPTIONS,
            });
        }
        if ipc == IpcMode::Isolated {
            binds.push(Bind {
                source: dirs.shm_dir(id),
                destination: DEV_SHM.into(),
                options: SHM_OPTIONS,
            });
        }
        MountPlan { binds, ipc }
    }

    /// On a v3 daemon, the plan with the container's namespace's directory as its pipe
    /// directory: the container sees only its own namespace's socket, never the
    /// daemon's `control`, the server's `default` namespace or another container's.
    pub(crate) fn in_namespace(
        mut self,
        dirs: &StateDir,
        id: &str,
        namespace: Option<&crate::identity::Namespace>,
    ) -> Self {
        if let (Some(ns), Some(pipe)) = (namespace, self.binds.first_mut()) {
            pipe.source = dirs.namespace_dir(id, &ns.name);
        }
        self
    }

    /// The plan as spec edits (the shim): each bind replaces an engine's mount at the same
    /// place; host IPC is made as `docker run --ipc=host` makes it, since the shim, not the
    /// engine, decided it.
    pub fn spec_edits(&self) -> Vec<Box<dyn SpecEdit>> {
        let text = |p: &Path| p.to_string_lossy().into_owned();
        let mut edits: Vec<Box<dyn SpecEdit>> = self
            .binds
            .iter()
            .map(|b| {
                Box::new(SetMount::bind(
                    text(&b.source),
                    text(&b.destination),
                    b.options,
                )) as Box<dyn SpecEdit>
            })
            .collect();
        if self.ipc == IpcMode::Host {
            // Exactly moby's --ipc=host: no ipc namespace, the engine's own /dev/shm mount
            // dropped, and the host's /dev/shm bound last (daemon/oci_linux.go).
            edits.push(Box::new(RemoveNamespace("ipc")));
            edits.push(Box::new(RemoveMount(DEV_SHM)));
            edits.push(Box::new(SetMount::bind(
                DEV_SHM,
                DEV_SHM,
                &["rbind", "rprivate"],
            )));
        }
        edits
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::bundle::edits::apply_all;
    use crate::bundle::tests::{fixture, FIXTURES};
    use serde_json::{json, Map, Value};

    pub(crate) const ID: &str = "0123456789abcdef0123456789abcdef";

    pub(crate) fn dirs() -> StateDir {
        StateDir::new("/run/gpushare")
    }

    fn daemon(dir: &str) -> PathBuf {
        format!("/run/gpushare/mps/{ID}/{dir}").into()
    }

    /// Every shape of the plan: (container pipe dir, container log dir, IPC).
    pub(crate) fn every_plan() -> Vec<MountPlan> {
        let mut plans = Vec::new();
        for pipe in ["/tmp/nvidia-mps", "/run/mps-pipe"] {
            for log in [None, Some("/var/log/nvidia-mps")] {
                for ipc in [IpcMode::Isolated, IpcMode::Host] {
                    let inside = Inside {
                        pipe: pipe.into(),
                        log: log.map(PathBuf::from),
                    };
                    plans.push(MountPlan::new(&dirs(), ID, inside, ipc));
                }
            }
        }
        plans
    }

    #[test]
    fn the_plan_per_config() {
        let ro = READ_ONLY_DIR_OPTIONS;
        let bind = |source: PathBuf, destination: &str, options| Bind {
            source,
            destination: destination.into(),
            options,
        };
        let cases: &[(&str, Option<&str>, IpcMode, Vec<Bind>)] = &[
            (
                "/tmp/nvidia-mps",
                None,
                IpcMode::Isolated,
                vec![
                    bind(daemon("pipe"), "/tmp/nvidia-mps", ro),
                    bind(daemon("shm"), "/dev/shm", SHM_OPTIONS),
                ],
            ),
            (
                "/tmp/nvidia-mps",
                None,
                IpcMode::Host,
                vec![bind(daemon("pipe"), "/tmp/nvidia-mps", ro)],
            ),
            (
                "/run/mps-pipe",
                Some("/var/log/nvidia-mps"),
                IpcMode::Isolated,
                vec![
                    bind(daemon("pipe"), "/run/mps-pipe", ro),
                    bind(daemon("log"), "/var/log/nvidia-mps", ro),
                    bind(daemon("shm"), "/dev/shm", SHM_OPTIONS),
                ],
            ),
            (
                "/run/mps-pipe",
                Some("/var/log/nvidia-mps"),
                IpcMode::Host,
                vec![
                    bind(daemon("pipe"), "/run/mps-pipe", ro),
                    bind(daemon("log"), "/var/log/nvidia-mps", ro),
                ],
            ),
        ];
        for (pipe, log, ipc, want) in cases {
            let inside = Inside {
                pipe: pipe.into(),
                log: log.map(PathBuf::from),
            };
            let plan = MountPlan::new(&dirs(), ID, inside, *ipc);
            assert_eq!(&plan.binds, want, "{pipe} {log:?} {ipc:?}");
            assert_eq!(plan.ipc, *ipc);
        }
        // The configuration's directories, and hook-only mode's.
        let cfg = crate::config::parse(
            "[mps]\ncontainer-pipe-dir = \"/run/mps-pipe\"\ncontainer-log-dir = \"/var/log/nvidia-mps\"\n",
            None,
        )
        .unwrap();
        assert_eq!(
            Inside::configured(&cfg),
            Inside {
                pipe: "/run/mps-pipe".into(),
                log: Some("/var/log/nvidia-mps".into())
            }
        );
        assert_eq!(
            Inside::cuda_default(),
            Inside {
                pipe: "/tmp/nvidia-mps".into(),
                log: None
            }
        );
    }

    fn doc(name: &str) -> Map<String, Value> {
        serde_json::from_slice(&fixture(name)).unwrap()
    }

    fn plan(ipc: IpcMode, log: bool) -> MountPlan {
        let inside = Inside {
            pipe: "/tmp/nvidia-mps".into(),
            log: log.then(|| "/var/log/nvidia-mps".into()),
        };
        MountPlan::new(&dirs(), ID, inside, ipc)
    }

    fn mounts_at<'a>(d: &'a Map<String, Value>, dest: &str) -> Vec<&'a Value> {
        d["mounts"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|m| m["destination"] == dest)
            .collect()
    }

    #[test]
    fn applying_the_spec_edits_twice_changes_nothing_on_every_fixture() {
        for p in every_plan() {
            crate::bundle::edits::tests::assert_twice_is_once(&p.spec_edits());
        }
    }

    #[test]
    fn isolated_replaces_dev_shm_in_place_and_keeps_ipc_namespace() {
        let original = doc("docker-20.10-config.json");
        let mut d = original.clone();
        apply_all(&mut d, &plan(IpcMode::Isolated, false).spec_edits()).unwrap();
        let shm = mounts_at(&d, "/dev/shm");
        assert_eq!(shm.len(), 1);
        assert_eq!(shm[0]["source"], daemon("shm").to_str().unwrap());
        assert_eq!(shm[0]["type"], "bind");
        let pos = |m: &Map<String, Value>| {
            m["mounts"]
                .as_array()
                .unwrap()
                .iter()
                .position(|x| x["destination"] == "/dev/shm")
        };
        assert_eq!(pos(&d), pos(&original), "same place in the mount order");
        assert!(d["linux"]["namespaces"]
            .as_array()
            .unwrap()
            .iter()
            .any(|n| n["type"] == "ipc"));
        let pipe = mounts_at(&d, "/tmp/nvidia-mps");
        assert_eq!(pipe[0]["source"], daemon("pipe").to_str().unwrap());
    }

    /// The pipe and log directories are read-only, the shm writable, all three
    /// nosuid,nodev,noexec; an engine's read-write mount at the same place is replaced.
    #[test]
    fn daemon_directories_are_read_only_and_nothing_is_suid_dev_or_exec() {
        for name in FIXTURES {
            let mut d = doc(name);
            // A mount an engine or a user put at the pipe directory, read-write.
            d["mounts"].as_array_mut().unwrap().push(json!({
                "destination": "/tmp/nvidia-mps/", "type": "bind",
                "source": "/somewhere", "options": ["rbind", "rw"]
            }));
            apply_all(&mut d, &plan(IpcMode::Isolated, true).spec_edits()).unwrap();
            let options = |dest: &str| -> Vec<String> {
                let at = mounts_at(&d, dest);
                assert_eq!(at.len(), 1, "{name}: {dest}");
                serde_json::from_value(at[0]["options"].clone()).unwrap()
            };
            for dest in ["/tmp/nvidia-mps", "/var/log/nvidia-mps"] {
                let o = options(dest);
                assert!(o.iter().any(|x| x == "ro"), "{name}: {dest} {o:?}");
                assert!(!o.iter().any(|x| x == "rw"), "{name}: {dest} {o:?}");
            }
            assert!(
                !options("/dev/shm").iter().any(|x| x == "ro"),
                "{name}: clients write the server's shared memory"
            );
            for dest in ["/tmp/nvidia-mps", "/var/log/nvidia-mps", "/dev/shm"] {
                let o = options(dest);
                for flag in ["nosuid", "nodev", "noexec", "rbind"] {
                    assert!(
                        o.iter().any(|x| x == flag),
                        "{name}: {dest} lacks {flag}: {o:?}"
                    );
                }
            }
            assert!(
                mounts_at(&d, "/tmp/nvidia-mps/").is_empty(),
                "{name}: the engine's read-write mount was replaced"
            );
        }
    }

    #[test]
    fn host_ipc_removes_only_the_ipc_namespace() {
        let mut d = doc("podman-4.3-config.json");
        let before: Vec<Value> = d["linux"]["namespaces"].as_array().unwrap().clone();
        apply_all(&mut d, &plan(IpcMode::Host, false).spec_edits()).unwrap();
        let after = d["linux"]["namespaces"].as_array().unwrap();
        let expected: Vec<&Value> = before.iter().filter(|n| n["type"] != "ipc").collect();
        assert_eq!(after.iter().collect::<Vec<_>>(), expected);
        let shm = mounts_at(&d, "/dev/shm");
        assert_eq!(shm.len(), 1);
        assert_eq!(shm[0]["source"], "/dev/shm");
        assert_eq!(shm[0]["options"], json!(["rbind", "rprivate"]));
    }

    /// The golden test: on Docker's own config.json, host IPC gives exactly what
    /// `docker run --ipc=host` gave in the captured fixture, for the namespaces and every
    /// mount (destinations in order; /dev/shm entry identical).
    #[test]
    fn host_ipc_is_exactly_dockers_ipc_host() {
        let mut d = doc("docker-20.10-config.json");
        apply_all(&mut d, &plan(IpcMode::Host, false).spec_edits()).unwrap();
        let golden = doc("docker-20.10-ipc-host-config.json");
        assert_eq!(d["linux"]["namespaces"], golden["linux"]["namespaces"]);
        let dests = |m: &Map<String, Value>| -> Vec<String> {
            m["mounts"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x["destination"].as_str().unwrap().to_owned())
                .filter(|x| x != "/tmp/nvidia-mps")
                .collect()
        };
        assert_eq!(dests(&d), dests(&golden));
        assert_eq!(mounts_at(&d, "/dev/shm"), mounts_at(&golden, "/dev/shm"));
    }
}
