//! The `gpushare` command line: the arguments (clap), and the dispatch of each command to
//! the hooks (`hook`, `hookonly`), the supervisor (`mps::supervisor`), the node's agent
//! (`mps::agent`), `doctor`, and the operator commands (`ops`), mapping each result to the exit code.
//!
//! Invariants: a hook failure is one line `gpushare: …` on stderr and exit 1 (runc shows
//! it to the user); `poststop` always exits 0; `status` reads state without taking any
//! lock a create could wait on; `gc` cleans everything it can, prints one line on stderr
//! for each thing it could not (naming it and why), and exits 1 if there was any.

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::config::Config;
use crate::ops;
use crate::ops::install::{EngineConfig, ENGINES};
use crate::request::{KeySpec, KEYS};

#[derive(Parser)]
#[command(
    name = "gpushare",
    version = crate::util::VERSION,
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
        // `--<engine>-config`, one per engine.
        #[command(flatten)]
        engine_configs: EngineConfigs,
        /// A CDI spec of gpushare's to compare with the inventory (repeatable; default:
        /// /etc/cdi/gpushare.json and /var/run/cdi/gpushare.json, where they exist).
        #[arg(long)]
        cdi_spec: Vec<std::path::PathBuf>,
    },
    /// Register gpushare-runtime with a container engine.
    Install {
        #[command(subcommand)]
        target: InstallTarget,
    },
    // Its help names the engines: made from them.
    #[command(about = uninstall_about())]
    Uninstall {
        #[command(subcommand)]
        engine: EngineUninstall,
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
        /// Do not start the validator (`gpushare nri-validate` on --socket), which the
        /// plugin otherwise keeps running as a process of its own.
        #[arg(long)]
        no_validator: bool,
    },
    /// Run gpushare's NRI validator (containerd ≥ 2.2): a process of its own that rejects
    /// a container with a request whose creation gpushare's NRI plugin did not adjust (the
    /// plugin not connected, stalled or closed), so that it is retried rather than run
    /// unserved. `gpushare nri` starts it; runs until killed, one per node (a second one
    /// stands by); root only (docs/kubernetes.md).
    NriValidate {
        /// The runtime's NRI socket.
        #[arg(long, default_value = crate::nri::DEFAULT_SOCKET)]
        socket: std::path::PathBuf,
        /// The name the validator registers under.
        #[arg(long, default_value = crate::nri::validator::DEFAULT_NAME)]
        name: String,
        /// Its index among the runtime's plugins.
        #[arg(long, default_value = crate::nri::validator::DEFAULT_INDEX)]
        index: String,
        /// The name of the NRI plugin whose adjustment it looks for (in its reasons).
        #[arg(long, default_value = crate::nri::DEFAULT_NAME)]
        plugin: String,
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

/// What `gpushare install` installs: a runtime with one engine, or the CDI spec.
#[derive(Subcommand)]
enum InstallTarget {
    #[command(flatten)]
    Engine(EngineInstall),
    /// Write gpushare's CDI spec (`gpushare cdi generate`) where every CDI engine reads it
    /// across reboots (default /etc/cdi/gpushare.json), and say how each engine uses it.
    Cdi {
        /// Where to write it.
        #[arg(long, default_value = crate::ops::install::CDI_STATIC_SPEC)]
        output: std::path::PathBuf,
        // Its help names each engine's config and settings: made from the engines.
        #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(
            ENGINES.iter().map(|e| e.name())
        ), help = cdi_enable_help())]
        enable: Option<String>,
        // Its help names each engine's default config: made from the engines.
        #[arg(long, requires = "enable", help = cdi_config_help())]
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

/// `gpushare install <engine>` or `gpushare uninstall <engine>`: one subcommand per engine
/// of [`ENGINES`], in its order, with the flags every engine takes (`A`) and what the
/// engine adds ([`EngineArgs::for_engine`]); `flags` holds all of them, for the engine's
/// own ([`EngineConfig::install_flags`]).
struct EngineCommand<A> {
    engine: &'static dyn EngineConfig,
    args: A,
    flags: clap::ArgMatches,
}

type EngineInstall = EngineCommand<InstallArgs>;
type EngineUninstall = EngineCommand<UninstallArgs>;

/// The flags every engine takes in one command, and what each engine adds to its
/// subcommand there (its help, its own flags).
trait EngineArgs: Args {
    fn for_engine(engine: &dyn EngineConfig, cmd: clap::Command) -> clap::Command;
}

impl EngineArgs for InstallArgs {
    fn for_engine(engine: &dyn EngineConfig, cmd: clap::Command) -> clap::Command {
        cmd.args(engine.install_flags())
            .about(engine.about().install_about)
    }
}

impl EngineArgs for UninstallArgs {
    fn for_engine(engine: &dyn EngineConfig, cmd: clap::Command) -> clap::Command {
        cmd.about(engine.about().uninstall_about)
    }
}

impl<A: EngineArgs> clap::FromArgMatches for EngineCommand<A> {
    fn from_arg_matches(m: &clap::ArgMatches) -> Result<Self, clap::Error> {
        use clap::error::ErrorKind;
        let Some((name, sub)) = m.subcommand() else {
            return Err(clap::Error::raw(
                ErrorKind::MissingSubcommand,
                "a subcommand is required but one was not provided",
            ));
        };
        let engine = ops::install::named(name).ok_or_else(|| {
            clap::Error::raw(
                ErrorKind::InvalidSubcommand,
                format!("the subcommand '{name}' wasn't recognized"),
            )
        })?;
        Ok(EngineCommand {
            engine,
            args: A::from_arg_matches(sub)?,
            flags: sub.clone(),
        })
    }

    fn update_from_arg_matches(&mut self, m: &clap::ArgMatches) -> Result<(), clap::Error> {
        *self = Self::from_arg_matches(m)?;
        Ok(())
    }
}

impl<A: EngineArgs> Subcommand for EngineCommand<A> {
    fn augment_subcommands(cmd: clap::Command) -> clap::Command {
        ENGINES.iter().fold(cmd, |cmd, &engine| {
            let sub = A::augment_args(clap::Command::new(engine.name()));
            cmd.subcommand(A::for_engine(engine, sub))
        })
    }

    fn augment_subcommands_for_update(cmd: clap::Command) -> clap::Command {
        Self::augment_subcommands(cmd)
    }

    fn has_subcommand(name: &str) -> bool {
        ops::install::named(name).is_some()
    }
}

/// `gpushare doctor --<engine>-config <path>`: each engine's config to check, in
/// [`ENGINES`]' order (default: the engine's standard one).
#[derive(Default)]
struct EngineConfigs(Vec<(&'static dyn EngineConfig, std::path::PathBuf)>);

impl EngineConfigs {
    /// The flag of `engine`: its id, long name and value name.
    fn flag(engine: &dyn EngineConfig) -> (String, String, String) {
        let name = engine.name();
        (
            format!("{}_config", name.replace('-', "_")),
            format!("{name}-config"),
            format!("{}_CONFIG", name.replace('-', "_").to_uppercase()),
        )
    }
}

/// A flag set read from `m` as its update reads it, over its default: for the flag sets
/// whose flags are all optional.
fn updated_default<T: Default + clap::FromArgMatches>(
    m: &clap::ArgMatches,
) -> Result<T, clap::Error> {
    let mut flags = T::default();
    flags.update_from_arg_matches(m)?;
    Ok(flags)
}

impl clap::FromArgMatches for EngineConfigs {
    fn from_arg_matches(m: &clap::ArgMatches) -> Result<Self, clap::Error> {
        updated_default(m)
    }

    fn update_from_arg_matches(&mut self, m: &clap::ArgMatches) -> Result<(), clap::Error> {
        for &engine in ENGINES {
            if let Some(path) = m.get_one::<std::path::PathBuf>(&Self::flag(engine).0) {
                self.0.retain(|(e, _)| e.name() != engine.name());
                self.0.push((engine, path.clone()));
            }
        }
        Ok(())
    }
}

impl clap::Args for EngineConfigs {
    fn augment_args(cmd: clap::Command) -> clap::Command {
        ENGINES.iter().fold(cmd, |cmd, &engine| {
            let (id, long, value_name) = Self::flag(engine);
            cmd.arg(
                clap::Arg::new(id)
                    .long(long)
                    .value_name(value_name)
                    .value_parser(clap::value_parser!(std::path::PathBuf))
                    .default_value(engine.default_config())
                    .help(format!("{} to check", engine.config_name())),
            )
        })
    }

    fn augment_args_for_update(cmd: clap::Command) -> clap::Command {
        Self::augment_args(cmd)
    }
}

/// `gpushare uninstall`'s help, naming the commands it undoes.
fn uninstall_about() -> String {
    let engines: Vec<&str> = ENGINES.iter().map(|e| e.name()).collect();
    format!(
        "Undo `install {}|cdi --enable` on a container engine's config: the file as it was before the first install, byte for byte (kept beside it as <config>.gpushare-undo), or, where it changed since, the runtime's entry taken out",
        engines.join("|")
    )
}

/// `gpushare install cdi --enable`'s help: what it changes in each engine's config.
fn cdi_enable_help() -> String {
    let each: Vec<String> = ENGINES
        .iter()
        .map(|e| format!("{} ({})", e.config_name(), e.about().cdi_settings))
        .collect();
    format!(
        "Also turn CDI on in this engine's config, reading the spec's directory: {}",
        alternatives(&each)
    )
}

/// `gpushare install cdi --config`'s help: each engine's default config.
fn cdi_config_help() -> String {
    let each: Vec<&str> = ENGINES.iter().map(|e| e.default_config()).collect();
    format!(
        "The engine's config file (default: {})",
        alternatives(&each)
    )
}

/// `a`, `a or b`, `a, b or c`.
fn alternatives(items: &[impl AsRef<str>]) -> String {
    match items {
        [] => String::new(),
        [one] => one.as_ref().to_owned(),
        [rest @ .., last] => {
            let rest: Vec<&str> = rest.iter().map(AsRef::as_ref).collect();
            format!("{} or {}", rest.join(", "), last.as_ref())
        }
    }
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
        updated_default(m)
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
            Command::Install {
                target: InstallTarget::Engine(engine),
            } => engine.args.dry_run,
            Command::Install {
                target: InstallTarget::Cdi { dry_run, .. },
            } => *dry_run,
            Command::Uninstall { engine } => engine.args.dry_run,
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
            engine_configs,
            cdi_spec,
        } => doctor(cfg, engine_configs, cdi_spec),
        Command::Install { target } => report(install(cfg, target)),
        Command::Uninstall {
            engine: EngineCommand { engine, args, .. },
        } => {
            let done = ops::install::uninstall(engine, args.config, &args.name, args.dry_run);
            if done.is_ok() && !args.dry_run {
                engine.after_uninstall(cfg);
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
            no_validator,
        } => report(nri(cfg, socket, name, index, !no_validator)),
        Command::NriValidate {
            socket,
            name,
            index,
            plugin,
        } => report(crate::nri::validator::run(
            cfg, socket, &name, &index, &plugin,
        )),
    }
}

/// `gpushare nri`: the runtime's connection when it launched the plugin (its
/// `NRI_PLUGIN_SOCKET`, `NRI_PLUGIN_NAME`, `NRI_PLUGIN_IDX`), else `socket`; with
/// `validator`, the validator kept running on `socket`.
fn nri(
    cfg: &Config,
    socket: std::path::PathBuf,
    name: String,
    index: String,
    validator: bool,
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
        None => crate::nri::Endpoint::Socket(socket.clone()),
    };
    let name = var("NRI_PLUGIN_NAME").unwrap_or(name);
    let index = var("NRI_PLUGIN_IDX").unwrap_or(index);
    crate::nri::run(cfg, endpoint, &name, &index, validator.then_some(socket))
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

fn doctor(cfg: &Config, configs: EngineConfigs, cdi_specs: Vec<std::path::PathBuf>) -> i32 {
    let mut paths = ops::doctor::Paths::default();
    for (engine, config) in configs.0 {
        if let Some(at) = paths.engine_mut(engine.name()) {
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
fn install(cfg: &Config, target: InstallTarget) -> anyhow::Result<()> {
    match target {
        InstallTarget::Cdi {
            output,
            enable,
            config,
            dry_run,
        } => {
            let enable = match enable.as_deref() {
                Some(name) => Some(
                    ops::install::named(name).ok_or_else(|| anyhow::anyhow!("no engine {name}"))?,
                ),
                None => None,
            };
            ops::install::cdi(cfg, &output, enable, config, dry_run)
        }
        InstallTarget::Engine(EngineCommand {
            engine,
            args,
            flags,
        }) => {
            let install = ops::install::Install {
                engine,
                config_version: None,
                config: args.config,
                runtime_path: args.runtime_path,
                name: args.name,
                dry_run: args.dry_run,
            };
            engine.install(install, &flags)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    fn names() -> Vec<String> {
        ENGINES.iter().map(|e| e.name().to_owned()).collect()
    }

    /// `install <engine>`, `uninstall <engine>` and doctor's `--<engine>-config` are made
    /// from `ENGINES`: exactly its engines, in its order (`install cdi` after them).
    #[test]
    fn install_uninstall_and_doctor_offer_exactly_the_engines() {
        let cli = Cli::command();
        cli.clone().debug_assert();
        let subcommands = |of: &str| -> Vec<String> {
            let of = cli.find_subcommand(of).unwrap();
            of.get_subcommands()
                .map(|c| c.get_name().to_owned())
                .filter(|n| n != "help")
                .collect()
        };
        let mut install = names();
        install.push("cdi".to_owned());
        assert_eq!(subcommands("install"), install);
        assert_eq!(subcommands("uninstall"), names());
        let doctor = cli.find_subcommand("doctor").unwrap();
        let configs: Vec<String> = doctor
            .get_arguments()
            .filter_map(|a| a.get_long())
            .filter(|l| l.ends_with("-config"))
            .map(str::to_owned)
            .collect();
        let want: Vec<String> = names().iter().map(|n| format!("{n}-config")).collect();
        assert_eq!(configs, want);
        for engine in ENGINES {
            // Each help line names the config it changes.
            assert!(engine
                .about()
                .install_about
                .contains(engine.default_config()));
            assert!(engine
                .about()
                .uninstall_about
                .contains(engine.default_config()));
        }
    }

    /// An engine's own flags reach its `install` (containerd's); `dry_run` keeps the
    /// log closed for every engine; doctor's flags set each engine's config.
    #[test]
    fn the_engines_flags_are_read_back() {
        let parse = |argv: &[&str]| Cli::try_parse_from([&["gpushare"], argv].concat()).unwrap();
        let cli = parse(&["install", "containerd", "--nri", "--nri-required", "pods"]);
        let Command::Install {
            target: InstallTarget::Engine(install),
        } = &cli.command
        else {
            panic!("not install <engine>");
        };
        assert_eq!(install.engine.name(), "containerd");
        assert_eq!(
            install
                .flags
                .get_one::<String>("nri_required")
                .map(String::as_str),
            Some("pods")
        );
        assert!(install.flags.get_flag("nri") && !install.args.dry_run);
        assert!(!cli.command.reads_only());
        for engine in names() {
            assert!(parse(&["install", &engine, "--dry-run"])
                .command
                .reads_only());
            assert!(parse(&["uninstall", &engine, "--dry-run"])
                .command
                .reads_only());
            assert!(!parse(&["uninstall", &engine]).command.reads_only());
        }
        // `install cdi --dry-run` prints the spec (and the engine's config) and writes
        // nothing either.
        assert!(parse(&["install", "cdi", "--dry-run"]).command.reads_only());
        assert!(!parse(&["install", "cdi"]).command.reads_only());
        let cli = parse(&["doctor", "--containerd-config", "/x/config.toml"]);
        let Command::Doctor { engine_configs, .. } = cli.command else {
            panic!("not doctor");
        };
        let given: Vec<(&str, &std::path::Path)> = engine_configs
            .0
            .iter()
            .map(|(e, p)| (e.name(), p.as_path()))
            .collect();
        assert_eq!(
            given,
            [
                ("docker", std::path::Path::new("/etc/docker/daemon.json")),
                ("containerd", std::path::Path::new("/x/config.toml"))
            ]
        );
    }
}
