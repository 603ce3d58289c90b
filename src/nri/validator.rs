//! `gpushare nri-validate`: the second check on NRI's create path, a validation plugin
//! (NRI 0.10, containerd 2.2 and later) in a process of its own. After every plugin has
//! answered a container's `CreateContainer`, the runtime hands each validator the
//! container and the adjustment the plugins made, and creates the container only if none
//! rejects it. This one rejects a container that the plugin serves (`container::serves`: it
//! asks for a share and is not left alone) when the adjustment lacks what the plugin
//! gives every container it serves: the daemon's pipe directory bound at
//! `mps.container-pipe-dir` and `CUDA_MPS_PIPE_DIRECTORY` naming it (`Validator::served`).
//! The kubelet retries the container; the plugin, back, serves it.
//!
//! Why a second process: containerd lets a container through unadjusted when the plugin
//! is gone, stalled past the request timeout, or closed but not yet removed (its dead
//! entry answers the next create with an error that the create path does not act on);
//! docs/kubernetes.md names each window. The validator shares nothing with the plugin but
//! the config it reads: no daemon, no inventory, no lock of the plugin's, no state it
//! writes; it answers from what the request carries, in microseconds (BENCHMARKS.md).
//! Both must fail at once for a pod with a request to run unserved (SECURITY.md).
//!
//! The session is the plugin's (`serve`: the same framing, checks and in-flight bound);
//! its answers are fuzzed by the target `nri_validate` (`converse_validator`). One
//! validator per node is connected: it holds `<state-dir>/locks/nri-validator.lock` for
//! its whole life, and a second one waits for that lock (a standby), so that the plugin,
//! which starts one wherever it runs (`keep`), never makes two register. It says where it
//! stands in `<state-dir>/nri-validator.json`, as the plugin does in `nri.json`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::Context;
use prost::Message;

use super::api::{self, event};
use super::container;
use super::service::{run_service, Endpoint, PluginState};
use super::session::{quoted, Configured, Service};
use crate::config::Config;
use crate::state::StateDir;

/// The name and index the validator registers under.
pub(crate) const DEFAULT_NAME: &str = "gpushare-validator";
pub(crate) const DEFAULT_INDEX: &str = "90";

/// How often a standby tries the lock, and the plugin checks that a validator runs.
const POLL: Duration = Duration::from_millis(500);

/// The validator's state across one process: the config it reads requests with.
pub(crate) struct Validator {
    cfg: Config,
    dirs: StateDir,
    /// The plugin whose adjustment it looks for, for its reasons.
    plugin: String,
}

impl Validator {
    pub(crate) fn new(cfg: &Config, plugin: &str) -> Self {
        Validator {
            dirs: StateDir::new(&cfg.state_dir),
            cfg: cfg.clone(),
            plugin: plugin.to_owned(),
        }
    }

    /// The verdict on one container: rejected when the plugin serves it and the
    /// adjustment lacks what the plugin gives it.
    pub(crate) fn verdict(
        &self,
        req: &api::ValidateContainerAdjustmentRequest,
    ) -> api::ValidateContainerAdjustmentResponse {
        let (pod, ctr) = (
            req.pod.clone().unwrap_or_default(),
            req.container.clone().unwrap_or_default(),
        );
        // A pod of gpushare's RuntimeClass: the shim serves it when runc creates it (or
        // refuses it), after this adjustment; the plugin's absence takes nothing from it.
        if self.cfg.nri_shim_handlers.contains(&pod.runtime_handler) {
            return api::ValidateContainerAdjustmentResponse::default();
        }
        let asks = match container::serves(&self.cfg, &pod, &ctr) {
            Ok(false) => return api::ValidateContainerAdjustmentResponse::default(),
            Ok(true) => "asks for an MPS share".to_owned(),
            Err(e) => format!("has a request the plugin refuses ({e:#})"),
        };
        if self.served(req.adjust.as_ref()) {
            return api::ValidateContainerAdjustmentResponse::default();
        }
        let reason = format!(
            "gpushare: container {} of pod {}/{} {asks} but the NRI plugin {} did not adjust it (not connected, stalled or closed); refused rather than run unserved, the kubelet retries it",
            quoted(&ctr.name),
            quoted(&pod.namespace),
            quoted(&pod.name),
            self.plugin,
        );
        tracing::warn!(container_id = %quoted(&ctr.id), "NRI validator: {reason}");
        api::ValidateContainerAdjustmentResponse {
            reject: true,
            reason,
        }
    }

    /// Whether `adjust` carries what the plugin gives every container it serves: a bind
    /// of a daemon's pipe directory at `mps.container-pipe-dir`, and the client env
    /// naming that directory.
    fn served(&self, adjust: Option<&api::ContainerAdjustment>) -> bool {
        let Some(adjust) = adjust else {
            return false;
        };
        let env = adjust
            .env
            .iter()
            .map(|kv| (kv.key.as_str(), kv.value.as_str()));
        container::carries_adjustment(&self.cfg, &self.dirs, &adjust.mounts, env)
    }
}

impl Service for Validator {
    fn handle(
        &self,
        method: &str,
        payload: &[u8],
        configured: &Configured,
    ) -> anyhow::Result<Vec<u8>> {
        Ok(match method {
            "Configure" => {
                let req = api::ConfigureRequest::decode(payload).context("decode Configure")?;
                let runtime = format!(
                    "{} {}",
                    quoted(&req.runtime_name),
                    quoted(&req.runtime_version)
                );
                tracing::info!(runtime = %runtime, "NRI validator: configured by the runtime");
                configured(runtime);
                api::ConfigureResponse {
                    events: event::mask(&[event::VALIDATE_CONTAINER_ADJUSTMENT]),
                }
                .encode_to_vec()
            }
            // Nothing kept: each verdict reads its own request only.
            "Synchronize" => {
                let req = api::SynchronizeRequest::decode(payload).context("decode Synchronize")?;
                api::SynchronizeResponse { more: req.more }.encode_to_vec()
            }
            "ValidateContainerAdjustment" => {
                let req = api::ValidateContainerAdjustmentRequest::decode(payload)
                    .context("decode ValidateContainerAdjustment")?;
                self.verdict(&req).encode_to_vec()
            }
            // Shutdown, StateChange: nothing to do, an empty answer.
            _ => Vec::new(),
        })
    }
}

/// Runs the validator on `socket` for ever, registering as `name` with `index`, once it
/// holds the validator's lock (until then, a standby: one log line, no connection).
/// `plugin` is the plugin whose adjustment it looks for.
pub(crate) fn run(
    cfg: &Config,
    socket: PathBuf,
    name: &str,
    index: &str,
    plugin: &str,
) -> anyhow::Result<()> {
    let dirs = StateDir::new(&cfg.state_dir);
    dirs.ensure_root()?;
    let mut said = false;
    let _only = loop {
        if let Some(lock) = dirs.try_lock_nri_validator()? {
            break lock;
        }
        if !said {
            tracing::info!(
                lock = %dirs.nri_validator_lock_path().display(),
                "NRI validator: another validator holds the lock; standing by until it exits"
            );
            said = true;
        }
        std::thread::sleep(POLL);
    };
    let validator = std::sync::Arc::new(Validator::new(cfg, plugin));
    run_service(
        &validator,
        &dirs.nri_validator_state_path(),
        Endpoint::Socket(socket),
        name,
        index,
    )
}

/// The plugin's side: keeps a validator running on `socket` for as long as the plugin
/// runs. Every `POLL`, unless the validator's state names a live process or the one this
/// started still runs, starts `gpushare nri-validate` in a process group of its own,
/// which the plugin does not wait for and which outlives it (a crash, a restart, the
/// runtime's kill of a plugin it launched). Never returns.
pub(crate) fn keep(dirs: &StateDir, socket: &Path) {
    let mut ours: Option<Child> = None;
    let mut last_error = String::new();
    loop {
        // Reaped by the plugin's reaper, or exited: either way not running.
        let running = ours
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)));
        let live = PluginState::read_at(&dirs.nri_validator_state_path())
            .and_then(|s| s.process)
            .is_some_and(|p| p.alive());
        if !running && !live {
            match start(socket) {
                Ok(child) => {
                    tracing::info!(
                        pid = child.id(),
                        "NRI: started the validator (gpushare nri-validate)"
                    );
                    ours = Some(child);
                    last_error.clear();
                }
                Err(e) => {
                    let why = format!("{e:#}");
                    if why != last_error {
                        tracing::warn!(error = %why, "NRI: could not start the validator; trying again");
                        last_error = why;
                    }
                }
            }
        }
        std::thread::sleep(POLL);
    }
}

/// After `uninstall containerd`: a validator whose plugin no longer runs would refuse
/// every container with a request for good, so it is stopped (SIGTERM, waited for up to
/// 5 s) and its state removed. Its pid when it was; `None` while the plugin still runs
/// or no validator does.
pub(crate) fn stop_without_plugin(dirs: &StateDir) -> anyhow::Result<Option<i32>> {
    if PluginState::read(dirs)
        .and_then(|p| p.process)
        .is_some_and(|p| p.alive())
    {
        return Ok(None);
    }
    let path = dirs.nri_validator_state_path();
    let Some(state) = PluginState::read_at(&path) else {
        return Ok(None);
    };
    let live = state.process.filter(|p| p.alive());
    if let Some(p) = live {
        let pid = nix::unistd::Pid::from_raw(p.pid);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM)
            .with_context(|| format!("stop the NRI validator (pid {})", p.pid))?;
        let gone = crate::util::poll_until(
            std::time::Instant::now() + Duration::from_secs(5),
            Duration::from_millis(10),
            Duration::from_millis(100),
            || (!p.alive()).then_some(()),
        );
        if gone.is_none() {
            anyhow::bail!(
                "the NRI validator (pid {}) did not exit within 5 s of SIGTERM",
                p.pid
            );
        }
    }
    match std::fs::remove_file(&path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("remove {}", path.display())),
    }
    Ok(live.map(|p| p.pid))
}

fn start(socket: &Path) -> anyhow::Result<Child> {
    let me = std::env::current_exe().context("find gpushare's own path")?;
    use std::os::unix::process::CommandExt;
    Command::new(me)
        .arg("nri-validate")
        .arg("--socket")
        .arg(socket)
        // NRI's variables are the plugin's: the validator dials the socket.
        .env_remove("NRI_PLUGIN_SOCKET")
        .env_remove("NRI_PLUGIN_NAME")
        .env_remove("NRI_PLUGIN_IDX")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()
        .context("start gpushare nri-validate")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn cfg() -> Config {
        crate::config::parse(
            "state-dir = \"/run/gpushare\"\n[nri]\nskip-namespaces = [\"kube-system\"]\n",
            None,
        )
        .unwrap()
    }

    fn request(
        annotations: &[(&str, &str)],
        namespace: &str,
        adjust: Option<api::ContainerAdjustment>,
    ) -> api::ValidateContainerAdjustmentRequest {
        let annotations: HashMap<String, String> = annotations
            .iter()
            .map(|(k, v)| ((*k).into(), (*v).into()))
            .collect();
        api::ValidateContainerAdjustmentRequest {
            pod: Some(api::PodSandbox {
                id: "pod1".into(),
                name: "trainer".into(),
                namespace: namespace.into(),
                annotations: annotations.clone(),
                ..Default::default()
            }),
            container: Some(api::Container {
                id: "c1".into(),
                pod_sandbox_id: "pod1".into(),
                name: "main".into(),
                annotations,
                ..Default::default()
            }),
            adjust,
            plugins: vec![],
        }
    }

    /// What the plugin gives a container it serves, on daemon `id`.
    fn served(id: &str) -> api::ContainerAdjustment {
        api::ContainerAdjustment {
            mounts: vec![api::Mount {
                destination: "/tmp/nvidia-mps".into(),
                r#type: "bind".into(),
                source: format!("/run/gpushare/mps/{id}/pipe"),
                options: vec!["rbind".into(), "ro".into()],
            }],
            env: vec![api::KeyValue {
                key: "CUDA_MPS_PIPE_DIRECTORY".into(),
                value: "/tmp/nvidia-mps".into(),
            }],
        }
    }

    #[test]
    fn rejects_a_request_without_the_plugin_s_adjustment_and_nothing_else() {
        let v = Validator::new(&cfg(), "gpushare");
        let id = "0123456789abcdef0123456789abcdef";
        let asks = [("gpushare.io/device", "0")];
        let only_env = api::ContainerAdjustment {
            mounts: vec![],
            ..served(id)
        };
        let only_mount = api::ContainerAdjustment {
            env: vec![],
            ..served(id)
        };
        // A bind at the right place whose source is not a daemon's pipe directory.
        let elsewhere = {
            let mut a = served(id);
            a.mounts[0].source = "/tmp/x/pipe".into();
            a
        };
        let bad_id = {
            let mut a = served(id);
            a.mounts[0].source = "/run/gpushare/mps/../pipe".into();
            a
        };
        // A v3 daemon's container: its namespace's directory under the server's.
        let namespace = |server: &str, name: &str| {
            let mut a = served(id);
            a.mounts[0].source = format!("/run/gpushare/mps/{id}/pipe/{server}/{name}");
            a
        };
        let rows: Vec<(&str, api::ValidateContainerAdjustmentRequest, bool)> = vec![
            (
                "a request, served",
                request(&asks, "team-a", Some(served(id))),
                false,
            ),
            (
                "a request, no adjustment",
                request(&asks, "team-a", None),
                true,
            ),
            (
                "a request, an empty adjustment",
                request(&asks, "team-a", Some(Default::default())),
                true,
            ),
            (
                "a request, env only",
                request(&asks, "team-a", Some(only_env)),
                true,
            ),
            (
                "a request, mount only",
                request(&asks, "team-a", Some(only_mount)),
                true,
            ),
            (
                "a request, served a v3 namespace",
                request(
                    &asks,
                    "team-a",
                    Some(namespace("s", "c0123456789abcdef0123")),
                ),
                false,
            ),
            (
                "a request, the v3 server's default namespace",
                request(&asks, "team-a", Some(namespace("s", "default"))),
                true,
            ),
            (
                "a request, a namespace of another server",
                request(
                    &asks,
                    "team-a",
                    Some(namespace("t", "c0123456789abcdef0123")),
                ),
                true,
            ),
            (
                "a request, another source",
                request(&asks, "team-a", Some(elsewhere)),
                true,
            ),
            (
                "a request, a source that is no daemon's",
                request(&asks, "team-a", Some(bad_id)),
                true,
            ),
            (
                "a bad request, unadjusted",
                request(&[("gpushare.io/device", "x")], "team-a", None),
                true,
            ),
            ("no request", request(&[], "team-a", None), false),
            (
                "a request in a skipped namespace",
                request(&asks, "kube-system", None),
                false,
            ),
        ];
        for (what, req, rejected) in rows {
            let verdict = v.verdict(&req);
            assert_eq!(verdict.reject, rejected, "{what}: {}", verdict.reason);
            if rejected {
                assert!(
                    verdict
                        .reason
                        .starts_with("gpushare: container main of pod team-a/trainer "),
                    "{what}: {}",
                    verdict.reason
                );
            }
        }
    }

    /// A pod of the shim's RuntimeClass (its runtime handler in `[nri] shim-handlers`) is
    /// the shim's to serve: let through unadjusted; a pod of any other handler is not.
    #[test]
    fn a_pod_of_the_shim_s_runtime_class_is_let_through() {
        let v = Validator::new(&cfg(), "gpushare");
        let on = |handler: &str| {
            let mut req = request(&[("gpushare.io/device", "0")], "team-a", None);
            req.pod.as_mut().unwrap().runtime_handler = handler.into();
            v.verdict(&req).reject
        };
        assert!(!on("gpushare"), "the shim's class");
        for other in ["", "runc", "gpushare-hooks", "nvidia"] {
            assert!(on(other), "{other:?}");
        }
    }

    #[test]
    fn a_container_that_gpushare_s_hook_serves_is_let_through() {
        let v = Validator::new(&cfg(), "gpushare");
        let mut req = request(&[("gpushare.io/device", "0")], "team-a", None);
        req.container.as_mut().unwrap().hooks = Some(api::Hooks {
            prestart: vec![api::Hook {
                path: "/usr/bin/gpushare".into(),
                args: vec!["gpushare".into(), "hook".into(), "prestart".into()],
            }],
            ..Default::default()
        });
        assert!(!v.verdict(&req).reject);
    }

    /// The validator's session: it subscribes to validation only, synchronizes without
    /// keeping anything, and answers a validation with its verdict. The conversation is
    /// the seed of the fuzz target `nri_validate`.
    #[test]
    fn a_validator_session_subscribes_to_validation_and_answers_verdicts() {
        use crate::nri::tests::{call, configure, registered};
        let cfg = cfg();
        let unadjusted = request(&[("gpushare.io/device", "0")], "team-a", None);
        let id = "0123456789abcdef0123456789abcdef";
        let adjusted = request(&[("gpushare.io/device", "0")], "team-a", Some(served(id)));
        let input = [
            registered(),
            configure(1),
            call(3, "Synchronize", &api::SynchronizeRequest::default()),
            call(5, "ValidateContainerAdjustment", &unadjusted),
            call(
                7,
                "ValidateContainerAdjustment",
                &request(&[], "team-a", None),
            ),
            call(9, "ValidateContainerAdjustment", &adjusted),
            call(11, "Shutdown", &api::Response::default()),
        ]
        .concat();
        let (out, end) = crate::nri::converse_validator_payloads(&cfg, &input);
        assert_eq!(end, Ok(true));
        let by_stream: HashMap<u32, Vec<u8>> = out.into_iter().collect();
        assert_eq!(by_stream.len(), 6);
        assert_eq!(
            api::ConfigureResponse::decode(by_stream[&1].as_slice()).unwrap(),
            api::ConfigureResponse { events: 1 << 13 }
        );
        let verdict = |s: u32| {
            api::ValidateContainerAdjustmentResponse::decode(by_stream[&s].as_slice()).unwrap()
        };
        assert!(verdict(5).reject);
        assert!(!verdict(7).reject);
        assert!(!verdict(9).reject);
        super::super::tests::check_seed("nri_validate", &input);
    }

    /// The validator's own cost per create: decoding containerd's request and the
    /// verdict, for a container with a request (served) and one without, each with a
    /// pod's usual annotations, env and mounts. `cargo test --release --lib
    /// validator_cost -- --ignored --nocapture` (BENCHMARKS.md).
    #[test]
    #[ignore = "a measurement: run it by name with --release"]
    fn validator_cost() {
        let v = Validator::new(&cfg(), "gpushare");
        let configured = |_: String| {};
        let kube: Vec<(String, String)> = [
            ("io.kubernetes.cri.container-type", "container"),
            ("io.kubernetes.cri.sandbox-name", "trainer"),
            ("io.kubernetes.cri.sandbox-namespace", "team-a"),
            ("io.kubernetes.cri.image-name", "docker.io/library/cuda:12"),
            ("io.kubernetes.pod.terminationGracePeriod", "30"),
            ("kubernetes.io/config.seen", "2026-12-05T00:00:00Z"),
        ]
        .iter()
        .map(|(k, v)| ((*k).into(), (*v).into()))
        .collect();
        let make = |asks: bool| {
            let mut annotations: HashMap<String, String> = kube.iter().cloned().collect();
            if asks {
                annotations.insert("gpushare.io/device".into(), "0".into());
                annotations.insert("gpushare.io/sm-percentage".into(), "25".into());
            }
            let mut req = request(
                &[],
                "team-a",
                asks.then(|| served("0123456789abcdef0123456789abcdef")),
            );
            let ctr = req.container.as_mut().unwrap();
            ctr.annotations = annotations.clone();
            ctr.env = (0..20).map(|i| format!("VAR_{i}=value-{i}")).collect();
            ctr.mounts = (0..10)
                .map(|i| api::Mount {
                    destination: format!("/mnt/{i}"),
                    r#type: "bind".into(),
                    source: format!("/var/lib/kubelet/pods/x/volumes/{i}"),
                    options: vec!["rbind".into(), "rprivate".into()],
                })
                .collect();
            ctr.user = Some(api::User {
                uid: 1000,
                gid: 1000,
                additional_gids: vec![],
            });
            req.pod.as_mut().unwrap().annotations = annotations;
            req.encode_to_vec()
        };
        for (what, payload) in [("request, served", make(true)), ("no request", make(false))] {
            let mut us = Vec::new();
            for _ in 0..200 {
                let began = std::time::Instant::now();
                for _ in 0..100 {
                    let out = v
                        .handle("ValidateContainerAdjustment", &payload, &configured)
                        .unwrap();
                    assert!(
                        !api::ValidateContainerAdjustmentResponse::decode(out.as_slice())
                            .unwrap()
                            .reject
                    );
                }
                us.push(began.elapsed().as_secs_f64() * 1e6 / 100.0);
            }
            us.sort_by(f64::total_cmp);
            println!(
                "validator, {what}: median {:.1} µs [p10 {:.1}, p90 {:.1}] per ValidateContainerAdjustment ({} bytes)",
                us[us.len() / 2],
                us[us.len() / 10],
                us[us.len() * 9 / 10],
                payload.len()
            );
        }
    }
}
