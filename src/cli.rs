//! The `gpushare` command line: `hook`, `status`, `daemon`.
//!
//! Invariants: a hook failure is one line `gpushare: …` on stderr and exit 1 (runc shows
//! it to the user); `poststop` always exits 0; `status` reads state without taking any
//! lock a create could wait on; `gc` cleans everything it can, prints one line on stderr
//! for each thing it could not (naming it and why), and exits 1 if there was any.

use std::io::Write;

use clap::{Parser, Subcommand, ValueEnum};

use crate::config::Config;
use crate::state::StateDir;

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
        #[arg(long, default_value = crate::install::DEFAULT_DOCKER_CONFIG)]
        docker_config: std::path::PathBuf,
        /// containerd's config.toml to check.
        #[arg(long, default_value = crate::install::DEFAULT_CONTAINERD_CONFIG)]
        containerd_config: std::path::PathBuf,
    },
    /// Register gpushare-runtime with a container engine.
    Install {
        #[command(subcommand)]
        engine: Engine,
    },
    /// Clean state left by crashes and reboots: stale container records, daemons whose
    /// supervisor is gone, half-removed directories. What cannot be cleaned is one line
    /// `gpushare: gc: <daemon or directory>: <reason>` on stderr and the rest is still
    /// cleaned. Exit code 0 when everything stale was cleaned (or nothing was stale), 1 when
    /// anything could not be.
    Gc,
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
    },
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
        /// Share of the GPU's threads each client may use, 1-100 (as
        /// gpushare.io/active-thread-percentage); default: mps.default-active-thread-percentage.
        #[arg(long)]
        active_thread_percentage: Option<String>,
        /// Pinned device memory per client and device, like 4G or 1536MiB (as
        /// gpushare.io/pinned-memory-limit); default: mps.default-pinned-memory-limit.
        #[arg(long)]
        pinned_memory_limit: Option<String>,
    },
    /// Stop daemons and remove their directories: one with --id <ID>, or every one with --all.
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
}

fn load_config() -> Result<Config, i32> {
    crate::config::load().map_err(|e| {
        eprintln!("gpushare: {:#}", anyhow::Error::new(e));
        1
    })
}

/// `gpushare hook <stage>`: the container state on stdin, one `gpushare: …` line on
/// stderr and exit 1 on failure (poststop: the line, and exit 0 — DESIGN §8).
fn hook(stage: HookStage) -> i32 {
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
        HookStage::Prestart => match crate::hookonly::prestart(&cfg, &state) {
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
    // runc runs `gpushare hook <stage>` for every container: that exact argv skips clap,
    // which builds the parser of every subcommand before it looks at argv (the hook
    // without it: 1040 -> 623 us own cost with the spec change, BENCHMARKS.md).
    let argv: Vec<std::ffi::OsString> = std::env::args_os().take(4).collect();
    if let [_, word, stage] = &argv[..] {
        if let Some(stage) = (word == "hook")
            .then(|| stage.to_str())
            .flatten()
            .and_then(|s| HookStage::from_str(s, false).ok())
        {
            return hook(stage);
        }
    }
    let cli = Cli::parse();
    if let Command::Hook { stage } = cli.command {
        return hook(stage);
    }
    if let Command::Daemon {
        command: DaemonCommand::Supervise { .. },
    } = &cli.command
    {
        // Nothing inherited may stay open in a long-lived daemon; detach before opening
        // the config or the log.
        crate::mps::supervisor::detach();
    }
    let cfg = match crate::config::load() {
        Ok(c) => c,
        Err(e) if matches!(cli.command, Command::Doctor { .. }) => {
            let check = crate::doctor::config_failure(&format!("{:#}", anyhow::Error::new(e)));
            let (text, code) = crate::doctor::report(&[check]);
            print!("{text}");
            return code;
        }
        Err(e) => {
            eprintln!("gpushare: {:#}", anyhow::Error::new(e));
            return 1;
        }
    };
    // Only commands that change something log; status, doctor and daemon list only read
    // (and must not even create the log file).
    let reads_only = matches!(
        cli.command,
        Command::Status { .. }
            | Command::Doctor { .. }
            | Command::Daemon {
                command: DaemonCommand::List { .. }
            }
    );
    if !reads_only {
        crate::logging::init(&cfg);
    }
    match cli.command {
        Command::Hook { .. } => unreachable!("handled above"),
        Command::Status {
            json,
            format,
            output,
        } => status(
            &cfg,
            if json { Format::Json } else { format },
            output.as_deref(),
        ),
        Command::Gc => gc(&cfg),
        Command::Doctor {
            docker_config,
            containerd_config,
        } => {
            let checks = crate::doctor::run(
                &cfg,
                &crate::doctor::Paths {
                    docker: docker_config,
                    containerd: containerd_config,
                    ..Default::default()
                },
            );
            let (text, code) = crate::doctor::report(&checks);
            print!("{text}");
            code
        }
        Command::Install { engine } => report(install(engine)),
        Command::Daemon { command } => match command {
            DaemonCommand::Start {
                device,
                uid,
                gid,
                multi_user,
                json,
                active_thread_percentage,
                pinned_memory_limit,
            } => {
                let mut cfg = cfg.clone();
                if multi_user {
                    cfg.mps.user_mode = crate::config::UserMode::MultiUser;
                }
                let multi = cfg.mps.user_mode == crate::config::UserMode::MultiUser;
                let Some(uid) = uid.or(multi.then_some(0)) else {
                    eprintln!("gpushare: --uid is required for a per-user daemon (or pass --multi-user for one root daemon serving every uid)");
                    return 2;
                };
                report(daemon_start(
                    &cfg,
                    &device,
                    uid,
                    gid,
                    active_thread_percentage,
                    pinned_memory_limit,
                    json,
                ))
            }
            DaemonCommand::Stop { id, all, force } => report(daemon_stop(&cfg, id, all, force)),
            DaemonCommand::List { json } => {
                status(&cfg, if json { Format::Json } else { Format::Table }, None)
            }
            DaemonCommand::Supervise { id } => {
                if !crate::identity::valid_id(&id) {
                    eprintln!(
                        "gpushare: daemon id {id:?} is invalid: allowed is {}",
                        crate::identity::ID_ALLOWED
                    );
                    return 2;
                }
                let span = tracing::info_span!("supervisor", daemon = %id);
                let _enter = span.enter();
                match crate::mps::supervisor::run(&cfg, &id) {
                    Ok(()) => 0,
                    Err(e) => {
                        tracing::error!("supervisor: {e:#}");
                        1
                    }
                }
            }
        },
    }
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

/// `gpushare daemon start`: the same validation and identity as a container's request.
fn daemon_start(
    cfg: &Config,
    device: &str,
    uid: u32,
    gid: Option<u32>,
    tp: Option<String>,
    mem: Option<String>,
    json: bool,
) -> anyhow::Result<()> {
    use crate::request::{self, DeviceValue, Request, RequestError, Sourced};
    fn sourced<T>(
        key: &'static str,
        raw: String,
        parse: fn(&'static str, &str) -> Result<T, RequestError>,
    ) -> Result<Sourced<T>, RequestError> {
        Ok(Sourced {
            value: parse(key, &raw)?,
            key,
            raw,
        })
    }
    let req = Request {
        // `allocated` needs a container to take the allocation from: refused here.
        device: sourced("--device", device.to_owned(), |key, raw| {
            request::parse_device_without_container(key, raw, "gpushare daemon start")
                .map(DeviceValue::Named)
        })?,
        active_thread_percentage: tp
            .map(|raw| sourced("--active-thread-percentage", raw, request::parse_percentage))
            .transpose()?,
        pinned_memory_limit: mem
            .map(|raw| sourced("--pinned-memory-limit", raw, request::parse_size))
            .transpose()?,
        ipc: None,
    };
    let mut ident = crate::decision::resolve(
        cfg,
        req,
        |_| Ok(cfg.mps.ipc_mode()),
        || Ok((uid, gid.unwrap_or(uid))),
    )?
    .identity;
    // The operator's --gid wins over mps.daemon-gid (multi-user daemons stay root's).
    if let Some(gid) = gid.filter(|_| !ident.multi_user) {
        ident.gid = gid;
    }
    let state = StateDir::new(&cfg.state_dir);
    let ensured = crate::mps::ensure::ensure(cfg, &state, &ident, None)?;
    let id = &ensured.record.id;
    if json {
        let v = serde_json::json!({
            "id": id,
            "started": ensured.started,
            "pid": ensured.record.daemon.map(|p| p.pid),
            "uid": ident.uid,
            "multi_user": ident.multi_user,
            "devices": ident.devices,
            "pipe_dir": state.pipe_dir(id),
            "shm_dir": (!ident.ipc_host).then(|| state.shm_dir(id)),
            "log_dir": state.log_dir(id),
        });
        println!("{v}");
        return Ok(());
    }
    println!(
        "{} daemon {} (pid {}) for {} on {}: CUDA_MPS_PIPE_DIRECTORY={}",
        if ensured.started { "started" } else { "found" },
        id,
        ensured.record.daemon.map_or(0, |p| p.pid),
        if ident.multi_user {
            "every uid".to_owned()
        } else {
            format!("uid {}", ident.uid)
        },
        ident.devices.join(","),
        state.pipe_dir(id).display()
    );
    if !ident.ipc_host {
        println!(
            "a client outside a container also needs {} as its /dev/shm",
            state.shm_dir(id).display()
        );
    }
    Ok(())
}

fn daemon_stop(cfg: &Config, id: Option<String>, all: bool, force: bool) -> anyhow::Result<()> {
    let state = StateDir::new(&cfg.state_dir);
    let ids = match (id, all) {
        (_, true) => state.daemon_ids()?,
        (Some(id), false) => vec![id],
        (None, false) => anyhow::bail!(
            "daemon stop needs --id <ID> (one daemon; see gpushare daemon list) or --all (every daemon)"
        ),
    };
    for id in &ids {
        if !crate::identity::valid_id(id) {
            anyhow::bail!(
                "daemon id {id:?} is invalid: allowed is {} (see gpushare daemon list)",
                crate::identity::ID_ALLOWED
            );
        }
        if !state.daemon_dir(id).exists() {
            anyhow::bail!(
                "no daemon {id} under {} (see gpushare daemon list)",
                state.root().display()
            );
        }
        let users = state.containers(id)?;
        if !users.is_empty() && !force {
            anyhow::bail!(
                "daemon {id} is used by {} container(s) ({}); stop them first or pass --force",
                users.len(),
                users
                    .iter()
                    .map(|c| c.id.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        crate::mps::ensure::stop(cfg, &state, id, std::time::Duration::from_secs(5))?;
        println!("stopped daemon {id}");
    }
    Ok(())
}

fn install(engine: Engine) -> anyhow::Result<()> {
    use crate::install::{self, containerd, docker};
    let (args, is_docker, version) = match engine {
        Engine::Docker(a) => (a, true, 2),
        Engine::Containerd {
            args,
            config_version,
        } => {
            let v = config_version.unwrap_or_else(installed_containerd_config_version);
            (args, false, v)
        }
    };
    let path = args.config.clone().unwrap_or_else(|| {
        if is_docker {
            crate::install::DEFAULT_DOCKER_CONFIG.into()
        } else {
            crate::install::DEFAULT_CONTAINERD_CONFIG.into()
        }
    });
    let runtime = install::runtime_path(args.runtime_path)?;
    if !runtime.is_file() {
        eprintln!(
            "gpushare: warning: {} does not exist (yet)",
            runtime.display()
        );
    }
    let text = install::read(&path)?;
    let edited = if is_docker {
        docker::edit(&path, &text, &args.name, &runtime)?
    } else {
        containerd::edit(&path, &text, &args.name, &runtime, version)?
    };
    let Some(new) = edited.text else {
        println!(
            "{} already registers runtime {} at {}; nothing to do",
            path.display(),
            args.name,
            runtime.display()
        );
        return Ok(());
    };
    if args.dry_run {
        print!("{new}");
        return Ok(());
    }
    install::write(&path, &new)?;
    println!(
        "registered runtime {} ({}) in {}",
        args.name,
        runtime.display(),
        path.display()
    );
    if is_docker {
        println!(
            "reload Docker to use it: `kill -HUP $(pidof dockerd)` or `systemctl reload docker`;"
        );
        println!("then: docker run --runtime {} -e GPUSHARE_DEVICE=0 …  (Docker ≥ 24: --annotation gpushare.io/device=0)", args.name);
    } else {
        println!("restart containerd to use it: `systemctl restart containerd`;");
        println!(
            "Kubernetes: a RuntimeClass with handler: {} (see deploy/)",
            args.name
        );
    }
    Ok(())
}

/// The config version the installed containerd expects: 3 for 2.x, else 2.
fn installed_containerd_config_version() -> i64 {
    let out = std::process::Command::new("containerd")
        .arg("--version")
        .output();
    let text = out
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    // "containerd github.com/containerd/containerd 1.6.20 <commit>" or "... v2.0.0 ..."
    let major = text.split_whitespace().find_map(|w| {
        w.trim_start_matches('v')
            .split('.')
            .next()?
            .parse::<u32>()
            .ok()
            .filter(|_| w.contains('.'))
    });
    if major.is_some_and(|m| m >= 2) {
        3
    } else {
        2
    }
}

/// `gpushare gc`: what a crash or a reboot left behind is detected and cleaned, never
/// trusted. Prints one line per action on stdout and one line per failure on stderr; a
/// daemon or directory that cannot be cleaned stops none of the others. Returns the exit
/// code: 1 if anything could not be cleaned, else 0.
fn gc(cfg: &Config) -> i32 {
    let state = StateDir::new(&cfg.state_dir);
    let mut failures = 0;
    let mut failed = |what: String, e: anyhow::Error| {
        tracing::error!("gc: {what}: {e:#}");
        eprintln!("gpushare: gc: {what}: {e:#}");
        failures += 1;
    };
    for (tomb, removed) in state.remove_tombstones() {
        match removed {
            Ok(()) => println!("removed half-removed directory {}", tomb.display()),
            Err(e) => failed(
                format!("half-removed directory {}", tomb.display()),
                e.into(),
            ),
        }
    }
    match state.daemon_ids() {
        Ok(ids) => {
            for id in ids {
                if let Err(e) = gc_daemon(cfg, &state, &id) {
                    failed(format!("daemon {id}"), e);
                }
            }
        }
        Err(e) => failed(
            format!("state directory {}", state.root().display()),
            e.into(),
        ),
    }
    for top in crate::mps::supervisor::gpushare_cgroups() {
        let n = crate::mps::supervisor::sweep_stale_cgroups(&top);
        if n > 0 {
            println!(
                "removed {n} empty cgroup(s) of gone supervisors in {}",
                top.display()
            );
        }
    }
    i32::from(failures > 0)
}

/// `gc` for one daemon: its stale container records, then the daemon itself if its
/// supervisor is gone (restarted when containers still use it, else removed).
fn gc_daemon(cfg: &Config, state: &StateDir, id: &str) -> anyhow::Result<()> {
    use crate::mps::ensure;
    let grace = cfg.mps.pending_grace().as_secs();
    let before = state.containers(id)?.len();
    let live = state.live_containers(id, grace)?;
    if before > live.len() {
        println!(
            "daemon {id}: removed {} stale container record(s)",
            before - live.len()
        );
    }
    let rec = match state.read_record(id) {
        Ok(r) => r,
        Err(e) => {
            println!("daemon {id}: unreadable record ({e}); treating it as stale");
            None
        }
    };
    let supervised = rec
        .as_ref()
        .is_some_and(|r| r.supervisor.is_some_and(|p| p.alive()));
    if supervised {
        return Ok(());
    }
    if let Some(rec) = rec.as_ref().filter(|_| !live.is_empty()) {
        // Containers still rely on it: bring the daemon back rather than drop them.
        ensure::ensure(cfg, state, &rec.identity, None)?;
        println!(
            "daemon {id}: supervisor was gone with {} container(s) using it; restarted",
            live.len()
        );
        return Ok(());
    }
    let _lock = state.lock(id, std::time::Instant::now() + cfg.mps.start_timeout)?;
    if let Some(rec) = &rec {
        ensure::kill_stale(rec);
    }
    if state.remove_if_unused(id, grace, |_| {})? {
        println!("daemon {id}: supervisor gone and no containers; removed");
    }
    Ok(())
}

fn status(cfg: &Config, format: Format, output: Option<&std::path::Path>) -> i32 {
    let view = crate::status::collect(cfg);
    let text = match format {
        Format::Table => crate::status::table(&view),
        Format::Json => serde_json::to_string_pretty(&view).unwrap_or_default() + "\n",
        Format::Prometheus => crate::status::prometheus(&view),
    };
    match output {
        Some(path) => match crate::util::write_atomic(path, text.as_bytes(), 0o644) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("gpushare: cannot write {}: {e}", path.display());
                1
            }
        },
        None => {
            let _ = std::io::stdout().lock().write_all(text.as_bytes());
            0
        }
    }
}
