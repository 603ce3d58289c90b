//! The `gpushare` command line: the arguments (clap), and the dispatch of each command to
//! the hooks (`hook`, `hookonly`), the supervisor (`mps::supervisor`), the node's agent
//! (`mps::agent`), `doctor`, and the operator commands (`ops`), mapping each result to the exit code.
//!
//! Invariants: a hook failure is one line `gpushare: …` on stderr and exit 1 (runc shows
//! it to the user); `poststop` always exits 0; `status` reads state without taking any
//! lock a create could wait on; `gc` cleans everything it can, prints one line on stderr
//! for each thing it could not (naming it and why), and exits 1 if there was any.

use clap::{Parser, Subcommand, ValueEnum};

use crate::config::Config;
use crate::ops;
use crate::request::{KeySpec, KEYS};

#[derive(Parser)]
#[command(
    name = "gpushare",
    version = crate::VERSION,
    about = "Share NVIDIA GPUs between containers through per-user CUDA MPS daemons"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run an OCI hook (called by runc; the container state comes on stdin).
    Hook {
        #[arg(value_enum)]
        stage: HookStage,
        /// The request of a CDI device (prestart only, as `gpushare cdi generate` writes
        /// it): --cdi-device <device> [--profile <name>].
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, hide = true)]
        flags: Vec<String>,
    },
    /// CDI (Container Device Interface) specs for gpushare's devices.
    Cdi {
        #[command(subcommand)]
        command: CdiCommand,
    },
    /// Show MPS daemons, their health, and the containers using them.
    Status {
        /// Same as --format json.
        #[arg(long)]
        json: bool,
        #[arg(long, value_enum, default_value_t = Format::Table)]
        format: Format,
        /// Write to this file atomically (for node-exporter's textfile collector).
        #[arg(long)]
        output: Option<std::path::PathBuf>,
    },
    /// Check this node: driver, MPS binary, compute modes, state dir, engines. Exit code
    /// 0 all ok, 1 warnings, 2 failures.
    Doctor {
        /// Docker's daemon.json to check.
        #[arg(long, default_value = crate::ops::install::DEFAULT_DOCKER_CONFIG)]
        docker_config: std::path::PathBuf,
        /// containerd's config.toml to check.
        #[arg(long, default_value = crate::ops::install::DEFAULT_CONTAINERD_CONFIG)]
        containerd_config: std::path::PathBuf,
        /// A CDI spec of gpushare's to compare with the inventory (repeatable; default:
        /// /etc/cdi/gpushare.json and /var/run/cdi/gpushare.json, where they exist).
        #[arg(long)]
        cdi_spec: Vec<std::path::PathBuf>,
    },
    /// Register gpushare-runtime with a container engine.
    Install {
        #[command(subcommand)]
        engine: Engine,
    },
    /// Undo `install docker|containerd|cdi --enable` on a container engine's config: the
    /// file as it was before the first install, byte for byte (kept beside it as
    /// <config>.gpushare-undo), or, where it changed since, the runtime's entry taken out.
    Uninstall {
        #[command(subcommand)]
        engine: UninstallEngine,
    },
    /// Clean state left by crashes and reboots: stale container records, daemons whose
    /// supervisor is gone, half-removed directories. What cannot be cleaned is one line
    /// `gpushare: gc: <daemon or directory>: <reason>` on stderr and the rest is still
    /// cleaned. Exit code 0 when everything stale was cleaned (or nothing was stale), 1 when
    /// anything could not be.
    Gc,
    /// Run the node's agent: it starts the supervisors (and reapers) the hooks ask for as
    /// its own children, outside every engine's process tree, so no conmon or containerd
    /// shim adopts or waits for them. Runs until SIGTERM; root only (docs/install.md).
    Agent,
    /// Run the node's GPU process watcher: every `watch.interval` it lists the GPUs'
    /// processes (NVML), maps each to its container and pod, writes what it found for
    /// `status`, and, with `watch.policy = "act"`, stops what escapes enforced limits.
    /// Runs until SIGTERM; root only (docs/configuration.md, `[watch]`).
    Watch,
    /// Run gpushare as an NRI plugin (containerd ≥ 1.7, CRI-O): every CRI pod with a
    /// request is served at its creation, whatever its RuntimeClass, with no shim and no
    /// hook process. Runs until killed, dialling the runtime again after it restarts;
    /// root only (docs/kubernetes.md).
    Nri {
        /// The runtime's NRI socket (ignored when the runtime launched the plugin and
        /// handed it a connection in NRI_PLUGIN_SOCKET).
        #[arg(long, default_value = crate::nri::DEFAULT_SOCKET)]
        socket: std::path::PathBuf,
        /// The name the plugin registers under (NRI_PLUGIN_NAME when launched).
        #[arg(long, default_value = crate::nri::DEFAULT_NAME)]
        name: String,
        /// Its index: plugins are called in ascending index order (NRI_PLUGIN_IDX when
        /// launched).
        #[arg(long, default_value = crate::nri::DEFAULT_INDEX)]
        index: String,
    },
    /// Manage MPS daemons directly.
    Daemon {
        #[command(subcommand)]
        command: DaemonCommand,
    },
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Format {
    Table,
    Json,
    Prometheus,
}

#[derive(clap::Args)]
struct InstallArgs {
    /// The engine's config file.
    #[arg(long)]
    config: Option<std::path::PathBuf>,
    /// The shim to register (default: gpushare-runtime beside this binary).
    #[arg(long)]
    runtime_path: Option<std::path::PathBuf>,
    /// Runtime name (Docker `--runtime`, containerd handler / RuntimeClass handler).
    #[arg(long, default_value = "gpushare")]
    name: String,
    /// Print the resulting file instead of writing it.
    #[arg(long)]
    dry_run: bool,
}

#[derive(Subcommand)]
enum Engine {
    /// Add `runtimes.<name>` to Docker's daemon.json (default /etc/docker/daemon.json).
    Docker(InstallArgs),
    /// Add a runc-v2 runtime with BinaryName to containerd's config.toml
    /// (default /etc/containerd/config.toml).
    Containerd {
        #[command(flatten)]
        args: InstallArgs,
        /// Config version for a new file: 2 (containerd 1.x) or 3 (2.x); default: asks
        /// `containerd --version`, else 2. An existing file's own version always wins.
        #[arg(long, value_parser = clap::value_parser!(i64).range(2..=3))]
        config_version: Option<i64>,
        /// No shim: plain runc whose base_runtime_spec (containerd's default spec, from
        /// `ctr oci spec`, plus gpushare's hooks; written beside the config as
        /// <name>-base-spec.json) runs gpushare in hook-only mode. --runtime-path is unused.
        #[arg(long)]
        hook_only: bool,
        /// Instead of registering a runtime: turn containerd's NRI on (off by default in
        /// 1.7, on in 2.x), for `gpushare nri` (docs/kubernetes.md). --name and
        /// --runtime-path are unused.
        #[arg(long, conflicts_with = "hook_only")]
        nri: bool,
        /// With --nri: also register the plugin for containerd to launch, as an
        /// executable 10-gpushare in its NRI plugin_path (default /opt/nri/plugins) that
        /// runs this `gpushare nri`; `gpushare uninstall containerd` removes it.
        /// containerd 2.x only (a version 3 config).
        #[arg(long, requires = "nri")]
        nri_launch: bool,
        /// With --nri: have NRI's default validator (containerd 2.2 and later) refuse
        /// containers that need the plugin while it is not connected (stopped, crashed,
        /// restarting): `node`, every container but those of pods annotated
        /// tolerate-missing-plugins.gpushare.io: "true"; `pods`, the containers of pods
        /// annotated required-plugins.noderesource.dev: '["gpushare"]' (docs/kubernetes.md).
        #[arg(long, value_enum, requires = "nri")]
        nri_required: Option<NriRequired>,
    },
    /// Write gpushare's CDI spec (`gpushare cdi generate`) where every CDI engine reads it
    /// across reboots (default /etc/cdi/gpushare.json), and say how each engine uses it.
    Cdi {
        /// Where to write it.
        #[arg(long, default_value = crate::ops::install::CDI_STATIC_SPEC)]
        output: std::path::PathBuf,
        /// Also turn CDI on in this engine's config, reading the spec's directory: Docker's
        /// daemon.json (`features.cdi`, `cdi-spec-dirs`) or containerd's config.toml
        /// (`enable_cdi`, `cdi_spec_dirs` of the CRI plugin).
        #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(
            ops::install::ENGINES.iter().map(|e| e.name())
        ))]
        enable: Option<String>,
        /// The engine's config file (default: /etc/docker/daemon.json or
        /// /etc/containerd/config.toml).
        #[arg(long, requires = "enable")]
        config: Option<std::path::PathBuf>,
        /// Print the spec (and with --enable the engine's resulting config) instead of
        /// writing them.
        #[arg(long)]
        dry_run: bool,
    },
}

#[derive(clap::Args)]
struct UninstallArgs {
    /// The engine's config file.
    #[arg(long)]
    config: Option<std::path::PathBuf>,
    /// Runtime name, as given to install.
    #[arg(long, default_value = "gpushare")]
    name: String,
    /// Print the resulting file instead of writing it.
    #[arg(long)]
    dry_run: bool,
}

#[derive(Subcommand)]
enum UninstallEngine {
    /// Docker's daemon.json (default /etc/docker/daemon.json).
    Docker(UninstallArgs),
    /// Remove the runtime's tables from containerd's config.toml (default
    /// /etc/containerd/config.toml), the hook-only base spec of ours it named, the
    /// NRI plugin `install containerd --nri-launch` put in its plugin_path, gpushare
    /// in NRI's required_plugins (`--nri-required node`), and the state of an NRI plugin
    /// that no longer runs (`<state-dir>/nri.json`).
    Containerd(UninstallArgs),
}

impl Engine {
    /// The engine a runtime is registered with, by its [`ops::install::EngineConfig`]
    /// name, and the flags every engine takes; `None` for `install cdi`.
    fn runtime_args(&self) -> Option<(&'static str, &InstallArgs)> {
        match self {
            Engine::Docker(args) => Some(("docker", args)),
            Engine::Containerd { args, .. } => Some(("containerd", args)),
            Engine::Cdi { .. } => None,
        }
    }
}

impl UninstallEngine {
    /// The engine, by its [`ops::install::EngineConfig`] name, and the flags.
    fn parts(&self) -> (&'static str, &UninstallArgs) {
        match self {
            UninstallEngine::Docker(args) => ("docker", args),
            UninstallEngine::Containerd(args) => ("containerd", args),
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum NriRequired {
    Node,
    Pods,
}

#[derive(Clone, Copy, ValueEnum)]
enum HookStage {
    /// Injected by gpushare-runtime: ensure the daemon the shim decided.
    CreateRuntime,
    /// Injected by gpushare-runtime or hooks.d: release the container.
    Poststop,
    /// Hook-only mode (hooks.d, no shim): resolve, ensure, and mount into the container.
    Prestart,
}

#[derive(Subcommand)]
enum CdiCommand {
    /// Write the CDI spec of this node's devices (kind gpushare.io/gpu): one device per
    /// GPU index and UUID and per MIG device (<gpu>-mig-<mig>, MIG-<uuid>), and each once
    /// more per [cdi.profiles.<name>] as <device>-<name>. Written atomically.
    Generate {
        /// Where to write it; `-` prints it.
        #[arg(long, default_value = crate::cdi::DEFAULT_OUTPUT)]
        output: std::path::PathBuf,
    },
}

/// `gpushare daemon start`'s flag for each request key whose row has one (the keys a daemon
/// enforces), made from the rows: `--<name> <VALUE>`, the value as given, parsed later by
/// the key's own grammar.
#[derive(Debug, Clone, Default)]
struct KeyFlags(Vec<(&'static KeySpec, String)>);

impl KeyFlags {
    fn flagged() -> impl Iterator<Item = (&'static KeySpec, &'static str)> {
        KEYS.into_iter()
            .filter_map(|key| key.flag.map(|flag| (key, flag.trim_start_matches("--"))))
    }
}

impl clap::FromArgMatches for KeyFlags {
    fn from_arg_matches(m: &clap::ArgMatches) -> Result<Self, clap::Error> {
        let mut flags = KeyFlags::default();
        flags.update_from_arg_matches(m)?;
        Ok(flags)
    }

    fn update_from_arg_matches(&mut self, m: &clap::ArgMatches) -> Result<(), clap::Error> {
        for (key, long) in Self::flagged() {
            if let Some(raw) = m.get_one::<String>(long) {
                self.0.retain(|(k, _)| *k != key);
                self.0.push((key, raw.clone()));
            }
        }
        Ok(())
    }
}

impl clap::Args for KeyFlags {
    fn augment_args(cmd: clap::Command) -> clap::Command {
        Self::flagged().fold(cmd, |cmd, (key, long)| {
            let default = key
                .default_key
                .map_or_else(String::new, |d| format!("; default: {d}"));
            cmd.arg(
                clap::Arg::new(long)
                    .long(long)
                    .value_name(key.env.trim_start_matches("GPUSHARE_"))
                    .help(format!(
                        "As {}: {}; {}{default}",
                        key.annotation,
                        key.number().map_or(key.values, |n| n.allowed()),
                        key.doc
                    )),
            )
        })
    }

    fn augment_args_for_update(cmd: clap::Command) -> clap::Command {
        Self::augment_args(cmd)
    }
}

#[derive(Subcommand)]
enum DaemonCommand {
    /// Start (or find) the daemon for an identity, outside any container.
    Start {
        /// Device, as in gpushare.io/device: 0, GPU-<uuid>, MIG-<uuid>, 0:1, 0,1 (not
        /// `allocated`: there is no container here).
        #[arg(long)]
        device: String,
        /// Host UID the daemon serves (required unless the daemon is multi-user, by
        /// --multi-user or the config's user-mode).
        #[arg(long)]
        uid: Option<u32>,
        /// One root daemon for every UID (as user-mode = "multi-user"), whatever the config says.
        #[arg(long)]
        multi_user: bool,
        /// Print what was started as JSON (id, pids, the directories a client needs).
        #[arg(long)]
        json: bool,
        /// Host GID the daemon runs as (default: mps.daemon-gid, else the UID).
        #[arg(long)]
        gid: Option<u32>,
        /// The Kubernetes namespace whose daemon it is, under mps.tenant = "namespace"
        /// (unset: the daemon of containers without a trusted namespace).
        #[arg(long)]
        namespace: Option<String>,
        /// One flag per request key a daemon enforces (`request::keys`).
        #[command(flatten)]
        keys: KeyFlags,
    },
    /// Stop daemons and remove their directories: one with --id <ID>, or every one with
    /// --all (every idle one is stopped; each one in use is named on stderr, and the exit
    /// code is 1 if any was left running).
    Stop {
        /// The daemon to stop (see `gpushare daemon list`).
        #[arg(long, conflicts_with = "all")]
        id: Option<String>,
        /// Stop every daemon.
        #[arg(long)]
        all: bool,
        /// Stop even while containers still use it.
        #[arg(long)]
        force: bool,
    },
    /// List daemons (same as `gpushare status`).
    List {
        #[arg(long)]
        json: bool,
    },
    /// Supervise one daemon (started by the hook; not for interactive use).
    #[command(hide = true)]
    Supervise {
        #[arg(long)]
        id: String,
    },
    /// Remove a new daemon's directory if its create fails (started by whoever made it;
    /// not for interactive use).
    #[command(hide = true)]
    Reap {
        #[arg(long)]
        id: String,
    },
}

fn load_config() -> Result<Config, i32> {
    crate::config::load().map_err(|e| {
        eprintln!("gpushare: {:#}", anyhow::Error::new(e));
        1
    })
}

/// `gpushare hook <stage> [flags]`: the container state on stdin, one `gpushare: …` line
/// on stderr and exit 1 on failure (poststop: the line, and exit 0; docs/design.md,
/// "Errors and logs"). Flags are the request of a CDI device, for `prestart` only.
fn hook(stage: HookStage, flags: &[String]) -> i32 {
    let cdi = match (stage, crate::request::CdiAsk::from_flags(flags)) {
        (_, Ok(None)) => None,
        (HookStage::Prestart, Ok(Some(ask))) => Some(ask),
        (HookStage::Poststop, _) => None,
        (_, Ok(Some(_))) => {
            eprintln!(
                "gpushare: {} is only an argument of gpushare hook prestart",
                crate::request::CDI_DEVICE_FLAG
            );
            return 1;
        }
        (_, Err(e)) => {
            eprintln!("gpushare: {e}");
            return 1;
        }
    };
    let cfg = match load_config() {
        Ok(c) => c,
        Err(_) if matches!(stage, HookStage::Poststop) => return 0,
        Err(code) => return code,
    };
    crate::logging::init(&cfg);
    let state = match crate::hook::read_state(std::io::stdin().lock()) {
        Ok(s) => s,
        Err(e) if matches!(stage, HookStage::Poststop) => {
            tracing::warn!("poststop: {e:#}");
            return 0;
        }
        Err(e) => {
            eprintln!("gpushare: {e:#}");
            return 1;
        }
    };
    let span = tracing::info_span!("hook", container_id = %state.id);
    let _enter = span.enter();
    match stage {
        HookStage::CreateRuntime => match crate::hook::create_runtime(&cfg, &state) {
            Ok(()) => 0,
            Err(e) => {
                tracing::error!("create-runtime: {e:#}");
                eprintln!("gpushare: {e:#}");
                1
            }
        },
        HookStage::Poststop => {
            crate::hook::poststop(&cfg, &state);
            0
        }
        HookStage::Prestart => match crate::hookonly::prestart(&cfg, &state, cdi.as_ref()) {
            Ok(()) => 0,
            Err(e) => {
                tracing::error!("prestart: {e:#}");
                eprintln!("gpushare: {e:#}");
                1
            }
        },
    }
}

/// Entry point of the `gpushare` binary; returns the exit code.
pub fn main() -> i32 {
    // The hooks read NVML through `gpushare nvml-inventory`, never in this process: NVML
    // leaves threads running, and hook-only mode's prestart then enters the container's
    // mount namespace, which setns(2) refuses a multithreaded process (EINVAL).
    if let Some(stage) = hook_argv() {
        return hook(stage, &[]);
    }
    if let Some(library) = nvml_argv() {
        crate::device::read_nvml_in_process();
        return nvml_inventory(library.as_deref());
    }
    let cli = Cli::parse();
    if let Command::Hook { stage, flags } = &cli.command {
        return hook(*stage, flags);
    }
    crate::device::read_nvml_in_process();
    if let Command::Daemon {
        command: DaemonCommand::Supervise { .. } | DaemonCommand::Reap { .. },
    } = &cli.command
    {
        // Nothing inherited may stay open in a long-lived daemon; detach before opening
        // the config or the log.
        crate::mps::supervisor::detach();
    }
    let cfg = match crate::config::load() {
        Ok(c) => c,
        Err(e) if matches!(cli.command, Command::Doctor { .. }) => {
            let check = ops::doctor::config_failure(&format!("{:#}", anyhow::Error::new(e)));
            let (text, code) = ops::doctor::report(&[check]);
            print!("{text}");
            return code;
        }
        Err(e) => {
            eprintln!("gpushare: {:#}", anyhow::Error::new(e));
            return 1;
        }
    };
    if !cli.command.reads_only() {
        crate::logging::init(&cfg);
    }
    run(&cfg, cli.command)
}

/// `gpushare nvml-inventory [--library <absolute path>]`, run by the static shim
/// (`device::reader`): the NVML inventory, validated, as one line of JSON on stdout; else
/// one `gpushare: …` line on stderr and exit 1. NVML is the library named (the shim
/// resolved it under `driver-root`), else the loader finds it by name. Internal (not in
/// `--help`); reads no config, writes no log.
fn nvml_inventory(library: Option<&std::path::Path>) -> i32 {
    let json = crate::device::load_nvml(library)
        .map_err(anyhow::Error::new)
        .and_then(|inv| Ok(serde_json::to_string(&inv)?));
    match json {
        Ok(json) => {
            println!("{json}");
            0
        }
        Err(e) => {
            eprintln!("gpushare: {e:#}");
            1
        }
    }
}

/// `Some` when argv is `nvml-inventory`, with the library when it is followed by
/// `--library <absolute path>`.
fn nvml_argv() -> Option<Option<std::path::PathBuf>> {
    let args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).take(4).collect();
    match &args[..] {
        [word] if word == crate::device::NVML_SUBCOMMAND => Some(None),
        [word, flag, path]
            if word == crate::device::NVML_SUBCOMMAND
                && flag == crate::device::LIBRARY_FLAG
                && std::path::Path::new(path).is_absolute() =>
        {
            Some(Some(path.into()))
        }
        _ => None,
    }
}

/// The stage of `gpushare hook <stage>` when that is the exact argv: runc runs it for
/// every container, and it skips clap, which builds the parser of every subcommand before
/// it looks at argv (the hook without it: 1040 -> 623 us own cost with the spec change,
/// BENCHMARKS.md).
fn hook_argv() -> Option<HookStage> {
    let argv: Vec<std::ffi::OsString> = std::env::args_os().take(4).collect();
    let [_, word, stage] = &argv[..] else {
        return None;
    };
    (word == "hook")
        .then(|| stage.to_str())
        .flatten()
        .and_then(|s| HookStage::from_str(s, false).ok())
}

impl Command {
    /// Only commands that change something log; status, doctor, daemon list and a dry
    /// run of install only read (and must not even create the log file).
    fn reads_only(&self) -> bool {
        matches!(
            self,
            Command::Status { .. }
                | Command::Doctor { .. }
                | Command::Daemon {
                    command: DaemonCommand::List { .. }
                }
        ) || match self {
            Command::Install { engine } => engine.runtime_args().is_some_and(|(_, a)| a.dry_run),
            Command::Uninstall { engine } => engine.parts().1.dry_run,
            _ => false,
        }
    }
}

/// Runs one command with the loaded config; returns the exit code.
fn run(cfg: &Config, command: Command) -> i32 {
    match command {
        // `main` runs a hook before the config is loaded: not reached from there.
        Command::Hook { stage, flags } => hook(stage, &flags),
        Command::Cdi {
            command: CdiCommand::Generate { output },
        } => report(crate::cdi::generate(cfg, &output)),
        Command::Status {
            json,
            format,
            output,
        } => report(ops::status::print(
            cfg,
            if json { Format::Json } else { format }.into(),
            output.as_deref(),
        )),
        Command::Gc => i32::from(ops::gc::run(cfg) > 0),
        Command::Doctor {
            docker_config,
            containerd_config,
            cdi_spec,
        } => doctor(cfg, docker_config, containerd_config, cdi_spec),
        Command::Install { engine } => report(install(cfg, engine)),
        Command::Uninstall { engine } => {
            let (name, args) = engine.parts();
            let done = match ops::install::named(name) {
                Some(e) => {
                    ops::install::uninstall(e, args.config.clone(), &args.name, args.dry_run)
                }
                None => Err(anyhow::anyhow!("no engine {name}")),
            };
            // The NRI plugin is containerd's own: its state goes with `uninstall containerd`.
            if done.is_ok() && matches!(engine, UninstallEngine::Containerd(_)) && !args.dry_run {
                forget_nri_plugin(cfg);
            }
            report(done)
        }
        Command::Daemon { command } => daemon(cfg, command),
        Command::Agent => report(crate::mps::agent::run(cfg)),
        Command::Watch => report(crate::watch::run(cfg)),
        Command::Nri {
            socket,
            name,
            index,
        } => report(nri(cfg, socket, name, index)),
    }
}

/// After `uninstall containerd`: the state of an NRI plugin that no longer runs goes with
/// it, so that `doctor` stops warning about a plugin removed on purpose; one that still
/// runs (launched by containerd until it restarts, or a service) is named.
fn forget_nri_plugin(cfg: &Config) {
    let state = crate::state::StateDir::new(&cfg.state_dir);
    match ops::gc::forget_stopped_nri_plugin(&state) {
        Ok(Some(_)) => println!(
            "removed {}: the NRI plugin no longer runs",
            state.nri_state_path().display()
        ),
        Ok(None) => {
            if let Some(pid) = crate::nri::PluginState::read(&state)
                .and_then(|p| p.process)
                .filter(|p| p.alive())
                .map(|p| p.pid)
            {
                println!("gpushare's NRI plugin still runs (pid {pid}): stop it (`systemctl disable --now gpushare-nri`, or restart containerd for a launched one), then `gpushare gc` forgets it");
            }
        }
        Err(e) => eprintln!(
            "gpushare: warning: cannot remove {}: {e}",
            state.nri_state_path().display()
        ),
    }
}

/// `gpushare nri`: the runtime's connection when it launched the plugin (its
/// `NRI_PLUGIN_SOCKET`, `NRI_PLUGIN_NAME`, `NRI_PLUGIN_IDX`), else `socket`.
fn nri(
    cfg: &Config,
    socket: std::path::PathBuf,
    name: String,
    index: String,
) -> anyhow::Result<()> {
    let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let endpoint = match var("NRI_PLUGIN_SOCKET") {
        Some(fd) => {
            let fd: i32 = fd.parse().ok().filter(|fd| *fd > 2).ok_or_else(|| {
                anyhow::anyhow!(
                    "NRI_PLUGIN_SOCKET={:?} is invalid: allowed is the number of the socket the runtime handed the plugin",
                    crate::util::escape(&fd)
                )
            })?;
            crate::nri::Endpoint::Launched(crate::sys::adopt_unix_stream(fd)?)
        }
        None => crate::nri::Endpoint::Socket(socket),
    };
    let name = var("NRI_PLUGIN_NAME").unwrap_or(name);
    let index = var("NRI_PLUGIN_IDX").unwrap_or(index);
    crate::nri::run(cfg, endpoint, &name, &index)
}

fn daemon(cfg: &Config, command: DaemonCommand) -> i32 {
    match command {
        DaemonCommand::Start {
            device,
            uid,
            gid,
            multi_user,
            json,
            namespace,
            keys,
        } => {
            let mut cfg = cfg.clone();
            if multi_user {
                // One server for every tenant of the device: no namespace in its identity.
                cfg.mps.user_mode = crate::config::UserMode::MultiUser;
                cfg.mps.tenant = crate::config::TenantMode::Uid;
            }
            let multi = cfg.mps.user_mode == crate::config::UserMode::MultiUser;
            let Some(uid) = uid.or(multi.then_some(0)) else {
                eprintln!("gpushare: --uid is required for a per-user daemon (or pass --multi-user for one root daemon serving every uid)");
                return 2;
            };
            report(ops::daemon::start(
                &cfg,
                &ops::daemon::Start {
                    device,
                    uid,
                    gid,
                    settings: keys.0,
                    namespace,
                    json,
                },
            ))
        }
        DaemonCommand::Stop { id, all, force } => match ops::daemon::stop(cfg, id, all, force) {
            Ok(0) => 0,
            // Each daemon left running has had its line on stderr.
            Ok(_) => 1,
            Err(e) => {
                eprintln!("gpushare: {e:#}");
                1
            }
        },
        DaemonCommand::List { json } => report(ops::status::print(
            cfg,
            if json { Format::Json } else { Format::Table }.into(),
            None,
        )),
        DaemonCommand::Supervise { id } => supervise(cfg, &id),
        DaemonCommand::Reap { id } => reap(cfg, &id),
    }
}

/// `gpushare daemon reap --id`: the reaper, already detached; errors go to the log only.
fn reap(cfg: &Config, id: &str) -> i32 {
    if !crate::identity::valid_id(id) {
        return 2;
    }
    let span = tracing::info_span!("reaper", daemon = %id);
    let _enter = span.enter();
    match crate::mps::reaper::run(cfg, id) {
        Ok(_) => 0,
        Err(e) => {
            tracing::error!("reaper: {e:#}");
            1
        }
    }
}

/// `gpushare daemon supervise --id`: the supervisor, already detached; errors go to the
/// log only (its stdio is /dev/null).
fn supervise(cfg: &Config, id: &str) -> i32 {
    if !crate::identity::valid_id(id) {
        eprintln!(
            "gpushare: daemon id {id:?} is invalid: allowed is {}",
            crate::identity::ID_ALLOWED
        );
        return 2;
    }
    let span = tracing::info_span!("supervisor", daemon = %id);
    let _enter = span.enter();
    match crate::mps::supervisor::run(cfg, id) {
        Ok(()) => 0,
        Err(e) => {
            tracing::error!("supervisor: {e:#}");
            1
        }
    }
}

fn doctor(
    cfg: &Config,
    docker: std::path::PathBuf,
    containerd: std::path::PathBuf,
    cdi_specs: Vec<std::path::PathBuf>,
) -> i32 {
    let mut paths = ops::doctor::Paths::default();
    for (name, config) in [("docker", docker), ("containerd", containerd)] {
        if let Some(at) = paths.engine_mut(name) {
            at.config = config;
        }
    }
    if !cdi_specs.is_empty() {
        paths.cdi_specs = cdi_specs;
    }
    let checks = ops::doctor::run(cfg, &paths);
    let (text, code) = ops::doctor::report(&checks);
    print!("{text}");
    code
}

fn report(r: anyhow::Result<()>) -> i32 {
    match r {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("gpushare: {e:#}");
            1
        }
    }
}

impl From<Format> for ops::status::Format {
    fn from(f: Format) -> Self {
        match f {
            Format::Table => ops::status::Format::Table,
            Format::Json => ops::status::Format::Json,
            Format::Prometheus => ops::status::Format::Prometheus,
        }
    }
}

/// `gpushare install <engine>`: the CDI spec, or a runtime registered with an engine.
fn install(cfg: &Config, engine: Engine) -> anyhow::Result<()> {
    let engine_named =
        |name: &str| ops::install::named(name).ok_or_else(|| anyhow::anyhow!("no engine {name}"));
    let (name, config_version, hook_only, args) = match engine {
        Engine::Cdi {
            output,
            enable,
            config,
            dry_run,
        } => {
            let enable = enable.as_deref().map(engine_named).transpose()?;
            return ops::install::cdi(cfg, &output, enable, config, dry_run);
        }
        Engine::Docker(args) => ("docker", None, false, args),
        Engine::Containerd {
            args,
            config_version,
            nri: true,
            nri_launch,
            nri_required,
            ..
        } => {
            let required = nri_required.map(|r| match r {
                NriRequired::Node => ops::install::NriRequired::Node,
                NriRequired::Pods => ops::install::NriRequired::Pods,
            });
            return ops::install::enable_nri(
                args.config,
                config_version,
                args.dry_run,
                nri_launch,
                required,
            );
        }
        Engine::Containerd {
            args,
            config_version,
            hook_only,
            nri: false,
            ..
        } => ("containerd", config_version, hook_only, args),
    };
    let install = ops::install::Install {
        engine: engine_named(name)?,
        config_version,
        config: args.config,
        runtime_path: args.runtime_path,
        name: args.name,
        dry_run: args.dry_run,
    };
    if hook_only {
        ops::install::hook_only(install)
    } else {
        ops::install::run(install)
    }
}
