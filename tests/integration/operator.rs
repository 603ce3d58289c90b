//! What an operator sees — status in three formats, doctor on a broken setup, versions.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use testkit::*;

#[test]
fn status_shows_daemons_health_and_containers_in_three_formats() {
    let env = Env::new();
    let hold = "gpushare-mps-sim client --hold 30";
    let cs = [
        env.request("st-a", 1000, "0")
            .annotation("gpushare.io/active-thread-percentage", "50")
            .sh(hold)
            .create(),
        env.request("st-b", 2000, "0").sh(hold).create(),
        env.request("st-m", 1000, "1:0").sh(hold).create(),
    ];
    for c in &cs {
        c.start();
    }
    for c in &cs {
        assert!(
            c.wait_stdout("mps-client", Duration::from_secs(10)),
            "{} attached",
            c.id
        );
    }

    let daemons = env.status();
    assert_eq!(daemons.as_array().unwrap().len(), 3);
    for d in daemons.as_array().unwrap() {
        assert_eq!(d["health"], "ok", "{d}");
        assert_eq!(
            (d["servers"].as_u64(), d["clients"].as_u64()),
            (Some(1), Some(1)),
            "{d}"
        );
        assert!(d["uptime_seconds"].is_u64() && d["pid"].is_i64() && d["pipe_dir"].is_string());
        assert_eq!(d["containers"][0]["engine"], "runc");
    }
    let mig = daemons
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["devices"][0]["uuid"] == MIG0)
        .expect("the MIG daemon");
    assert_eq!(mig["devices"][0]["name"], "MIG 1:0");
    assert_eq!(mig["devices"][0]["mig_profile"], "1g.10gb");

    let table = String::from_utf8(env.gpushare(&["status"]).stdout).unwrap();
    for needle in [
        "DAEMON",
        "HEALTH",
        "GPU 0",
        "MIG 1:0 1g.10gb",
        "threads=50%",
        "1000",
        "2000",
        "container st-a  engine=runc",
    ] {
        assert!(table.contains(needle), "{needle:?} in:\n{table}");
    }
    assert_eq!(table.matches("  ok  ").count(), 3, "{table}");
    // The daemon caps, counted over these daemons (uid 1000 has two).
    assert!(table.contains("(3 now; bound by "), "{table}");
    assert!(
        table
            .lines()
            .any(|l| l.starts_with("mps.max-daemons-per-uid")
                && l.contains(" 2 ")
                && l.contains("uid 1000")),
        "{table}"
    );

    // Without the control binary the health is unknown, with the reason beside it.
    let no_binary = env.path().join("no-binary.toml");
    std::fs::write(
        &no_binary,
        std::fs::read_to_string(&env.config).unwrap().replace(
            &format!("control-binary = {:?}", env.sim().display().to_string()),
            "control-binary = \"/nonexistent/nvidia-cuda-mps-control\"",
        ),
    )
    .unwrap();
    let table = String::from_utf8(
        env.cmd(gpushare())
            .env("GPUSHARE_CONFIG", &no_binary)
            .arg("status")
            .output()
            .unwrap()
            .stdout,
    )
    .unwrap();
    assert_eq!(table.matches("  unknown  ").count(), 3, "{table}");
    assert!(
        table.contains(
            "└ unknown: cannot ask the daemon: MPS control binary /nonexistent/nvidia-cuda-mps-control does not exist"
        ),
        "{table}"
    );

    let prom_file = env.path().join("gpushare.prom");
    let out = env
        .cmd(gpushare())
        .args(["status", "--format", "prometheus", "--output"])
        .arg(&prom_file)
        .output()
        .unwrap();
    assert!(out.status.success() && out.stdout.is_empty());
    let prom = std::fs::read_to_string(&prom_file).unwrap();
    assert!(
        prom.contains("# TYPE gpushare_daemons gauge\ngpushare_daemons 3\n"),
        "{prom}"
    );
    assert!(
        prom.contains("gpushare_cap_used{cap=\"mps.max-daemons\",unit=\"daemons\"} 3\n")
            && prom.contains("gpushare_capacity_daemons{binding=\"mps."),
        "{prom}"
    );
    assert_eq!(
        prom.lines()
            .filter(|l| l.starts_with("gpushare_daemon_up{") && l.ends_with(" 1"))
            .count(),
        3,
        "{prom}"
    );
    assert!(
        prom.contains(&format!("device=\"{MIG0}\",uid=\"1000\"")),
        "{prom}"
    );
    assert!(prom
        .lines()
        .any(|l| l.starts_with("gpushare_daemon_restarts_total{") && l.ends_with(" 0")));
    assert_eq!(
        prom.lines()
            .filter(|l| l.starts_with("gpushare_containers{") && l.ends_with(" 1"))
            .count(),
        3
    );

    // A killed daemon shows as restarting/down, then ok with a restart counted.
    let a = env.daemon_of(&cs[0]);
    let pid = env.daemon_pid(&a);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    assert!(wait_until(Duration::from_secs(10), || {
        env.status()
            .as_array()
            .unwrap()
            .iter()
            .any(|d| d["id"] == a.as_str() && d["restarts"] == 1 && d["health"] == "ok")
    }));
    for c in &cs {
        c.delete();
    }
}

#[test]
fn doctor_reports_each_problem_of_a_broken_setup_with_its_fix() {
    let mut env = Env::new();
    // A state dir too long for MPS's socket paths, writable by everyone, and no MPS binary.
    let long = env.path().join("x".repeat(90)).join("state");
    std::fs::create_dir_all(&long).unwrap();
    std::fs::set_permissions(&long, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    let broken = env.path().join("broken.toml");
    let text = std::fs::read_to_string(&env.config).unwrap();
    let text = text
        .replace(
            &format!("state-dir = {:?}", env.state.display().to_string()),
            &format!("state-dir = {:?}", long.display().to_string()),
        )
        .replace(
            &format!("control-binary = {:?}", env.sim().display().to_string()),
            "control-binary = \"/nonexistent/nvidia-cuda-mps-control\"",
        );
    std::fs::write(&broken, text).unwrap();
    let out = std::process::Command::new(gpushare())
        .env("GPUSHARE_CONFIG", &broken)
        .arg("doctor")
        .output()
        .unwrap();
    let report = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(out.status.code(), Some(2), "{report}");
    let fail_with_fix = |check: &str, fix: &str| {
        let at = report
            .find(&format!("FAIL  {check}"))
            .unwrap_or_else(|| panic!("no FAIL for {check}:\n{report}"));
        let next = &report[at..];
        assert!(
            next.lines()
                .nth(1)
                .is_some_and(|l| l.contains("fix:") && l.contains(fix)),
            "{check}: {report}"
        );
    };
    fail_with_fix("socket-path", "set state-dir to a path of at most");
    fail_with_fix("state-dir", "chmod 0711");
    fail_with_fix("mps-control", "mps.control-binary");
    assert!(
        report.contains("no NVIDIA driver on this machine"),
        "says it runs without a GPU:\n{report}"
    );

    // The test setup itself: every check printed and ok (no engine runs here: nothing to
    // configure; the node's agent runs), and doctor writes nothing, not even the log file.
    env.start_agent();
    let log = env.path().join("gpushare.log");
    let _ = std::fs::remove_file(&log);
    let out = env.gpushare(&[
        "doctor",
        "--docker-config",
        "/nonexistent",
        "--containerd-config",
        "/nonexistent",
    ]);
    let report = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(out.status.code(), Some(0), "{report}");
    for check in [
        "config",
        "driver",
        "inventory",
        "gpu-generation",
        "compute-mode",
        "mps-control",
        "socket-path",
        "state-dir",
        "agent",
        "host-mps-pipe",
        "docker",
        "containerd",
        "low-level-runtime",
    ] {
        assert!(
            report.contains(&format!("ok    {check} ")),
            "{check}:\n{report}"
        );
    }
    let out = env.gpushare(&["status"]);
    assert!(out.status.success());
    assert!(!log.exists(), "doctor and status wrote {}", log.display());

    // A config that does not load is a FAIL line and exit 2, not an error and exit 1.
    let bad = env.path().join("bad.toml");
    std::fs::write(&bad, "no-such-key = 1\n").unwrap();
    let report = failing_doctor(&env, &bad, &[]);
    assert!(
        report.starts_with("FAIL  config") && report.contains("no-such-key"),
        "{report}"
    );

    // A low-level runtime that is gpushare-runtime itself would fail every create.
    let looping = env.path().join("looping.toml");
    let text = std::fs::read_to_string(&env.config).unwrap();
    let first = text.lines().next().unwrap().to_owned();
    assert!(first.starts_with("low-level-runtime"), "{first}");
    std::fs::write(
        &looping,
        text.replacen(&first, &format!("low-level-runtime = [{:?}]", runtime()), 1),
    )
    .unwrap();
    let report = failing_doctor(
        &env,
        &looping,
        &[
            "--docker-config",
            "/nonexistent",
            "--containerd-config",
            "/nonexistent",
        ],
    );
    assert!(
        report.contains("FAIL  low-level-runtime") && report.contains("gpushare-runtime itself"),
        "{report}"
    );
}

/// The report of `gpushare doctor <args>` on the config at `config`, which must exit 2
/// (a FAIL line).
fn failing_doctor(env: &Env, config: &Path, args: &[&str]) -> String {
    let out = env
        .cmd(gpushare())
        .env("GPUSHARE_CONFIG", config)
        .arg("doctor")
        .args(args)
        .output()
        .unwrap();
    let report = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(out.status.code(), Some(2), "{report}");
    report
}

#[test]
fn both_binaries_report_their_version_and_the_shim_passes_runcs_through() {
    let out = std::process::Command::new(runtime())
        .arg("--version")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(
        text.starts_with(&format!(
            "gpushare-runtime version {} (commit ",
            env!("CARGO_PKG_VERSION")
        )),
        "{text}"
    );
    assert!(
        text.contains("runc version"),
        "runc's own version follows:\n{text}"
    );
    let out = std::process::Command::new(gpushare())
        .arg("--version")
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stdout)
        .starts_with(&format!("gpushare {} (commit ", env!("CARGO_PKG_VERSION"))));
}

#[test]
fn json_logs_carry_the_container_id_and_passthrough_commands_log_nothing() {
    let env = Env::with_configs("log-format = \"json\"", "");
    let c = env.request("lg1", 1000, "0").sh("sleep 30").create();
    c.start();
    let log = env.gpushare_log();
    let lines: Vec<serde_json::Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    let ours: Vec<&serde_json::Value> = lines
        .iter()
        .filter(|v| v["span"]["name"] == "create" || v["span"]["name"] == "hook")
        .collect();
    assert!(ours.len() >= 2, "{log}");
    for v in &ours {
        assert_eq!(v["span"]["container_id"], "lg1", "{v}");
    }
    assert!(
        lines
            .iter()
            .any(|v| v["fields"]["message"] == "spec edited for MPS"),
        "{log}"
    );
    // Probes (state, exec, ps, kill 0) go straight to runc: the log does not grow.
    let before = std::fs::metadata(env.path().join("gpushare.log"))
        .unwrap()
        .len();
    for _ in 0..5 {
        assert!(env.runtime(&["state", "lg1"], &c.log()).status.success());
        assert!(env
            .runtime(&["exec", "lg1", "true"], &c.log())
            .status
            .success());
    }
    assert_eq!(
        std::fs::metadata(env.path().join("gpushare.log"))
            .unwrap()
            .len(),
        before
    );
    c.delete();
}

/// A container's Kubernetes names are text its author wrote (any annotation through runc,
/// `ctr` or Docker; a pod's name through CRI): `status` shows them escaped in the table,
/// in `--json` and in Prometheus labels, where a newline or a quote would otherwise end
/// the line or the label and forge another metric, and an escape sequence would reach
/// root's terminal.
#[test]
fn a_pod_named_with_control_characters_and_quotes_is_escaped_everywhere() {
    let env = Env::new();
    let evil_pod = "p\"} 1\ngpushare_daemons 99\n\u{1b}]0;owned\u{7}\u{1b}[2J\\x";
    let evil_ns = "ns\r\u{202e}";
    let long_container = "c".repeat(4000);
    let c = env
        .request("named", 1000, "0")
        .annotation("io.kubernetes.cri.container-type", "container")
        .annotation("io.kubernetes.cri.sandbox-namespace", evil_ns)
        .annotation("io.kubernetes.cri.sandbox-name", evil_pod)
        .annotation("io.kubernetes.cri.container-name", &long_container)
        .sh("gpushare-mps-sim client --hold 30")
        .create();
    c.start_attached();
    let escaped_pod = "p\"} 1\\ngpushare_daemons 99\\n\\u{1b}]0;owned\\u{7}\\u{1b}[2J\\\\x";
    let escaped_ns = "ns\\r\\u{202e}";

    let json = env.status();
    let rec = &json[0]["containers"][0];
    assert_eq!(rec["pod"], escaped_pod, "{rec}");
    assert_eq!(rec["namespace"], escaped_ns, "{rec}");
    assert_eq!(rec["container"], "c".repeat(253), "bounded");
    assert_eq!(rec["engine"], "kubernetes");
    // Stored bounded too: the record holds 253 bytes of the 4000.
    let stored: serde_json::Value = serde_json::from_slice(
        &std::fs::read(
            env.state
                .join("mps")
                .join(env.daemon_of(&c))
                .join("containers/named.json"),
        )
        .unwrap(),
    )
    .unwrap();
    assert_eq!(stored["container"], "c".repeat(253));
    assert_eq!(
        stored["pod"], evil_pod,
        "stored as written, escaped when shown"
    );

    let out = env.gpushare(&["status"]);
    let table = String::from_utf8(out.stdout).unwrap();
    assert!(
        table.contains(&format!(
            "  pod={escaped_ns}/{escaped_pod}  container={}\n",
            "c".repeat(253)
        )),
        "{table}"
    );
    let prom =
        String::from_utf8(env.gpushare(&["status", "--format", "prometheus"]).stdout).unwrap();
    let label = escaped_pod.replace('\\', "\\\\").replace('"', "\\\"");
    assert!(
        prom.contains(&format!(",pod=\"{label}\",")),
        "{label} in:\n{prom}"
    );
    // Every line is a comment or one sample of gpushare's; the forged one is not there.
    assert!(
        prom.lines()
            .all(|l| l.starts_with("# ") || l.starts_with("gpushare_")),
        "{prom}"
    );
    assert!(
        !prom.lines().any(|l| l.starts_with("gpushare_daemons 99")),
        "{prom}"
    );
    for (what, text) in [("table", &table), ("prometheus", &prom)] {
        assert!(
            !text
                .chars()
                .any(|ch| ch.is_control() && ch != '\n' || ch == '\u{202e}'),
            "{what} holds a control character: {text:?}"
        );
    }
    c.delete();
}

/// `gpushare install docker|containerd --config <bare file name>` writes the file in the
/// current directory (its parent is "", which named no directory to sync), and a dry run
/// creates nothing, not even the log file.
#[test]
fn install_takes_a_bare_file_name_and_a_dry_run_creates_nothing() {
    let env = Env::new();
    let log = env.path().join("gpushare.log");
    let cwd = env.path().join("cwd");
    std::fs::create_dir(&cwd).unwrap();
    let install = |args: &[&str]| {
        env.cmd(gpushare())
            .arg("install")
            .args(args)
            .args(["--runtime-path", runtime()])
            .current_dir(&cwd)
            .output()
            .unwrap()
    };
    for (engine, file) in [("docker", "probe2.json"), ("containerd", "probe2.toml")] {
        let mut args = vec![engine, "--config", file, "--dry-run"];
        if engine == "containerd" {
            args.extend(["--config-version", "2"]);
        }
        let before = std::fs::read_dir(&cwd).unwrap().count();
        let out = install(&args);
        assert!(out.status.success(), "{}", text(&out));
        assert!(
            String::from_utf8_lossy(&out.stdout).contains(runtime()),
            "{}",
            text(&out)
        );
        assert_eq!(
            std::fs::read_dir(&cwd).unwrap().count(),
            before,
            "a dry run writes nothing"
        );
        assert!(
            !log.exists(),
            "a dry run of install {engine} created the log"
        );
        args.retain(|a| *a != "--dry-run");
        let out = install(&args);
        assert!(out.status.success(), "{}", text(&out));
        assert!(
            std::fs::read_to_string(cwd.join(file))
                .unwrap()
                .contains(runtime()),
            "{engine}"
        );
        // No temp file is left beside it.
        let names: Vec<_> = std::fs::read_dir(&cwd)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert!(
            names.iter().all(|n| !n.to_string_lossy().ends_with(".tmp")),
            "{names:?}"
        );
        // A real install logs; the next engine's dry run starts without a log again.
        let _ = std::fs::remove_file(&log);
    }
}

/// `gpushare daemon stop --all` stops every idle daemon, whatever order the ids sort in,
/// names each one in use on stderr, one line each, and exits 1 when any was left.
#[test]
fn daemon_stop_all_stops_every_idle_daemon_and_names_each_one_in_use() {
    let env = Env::new();
    let c = env
        .request("busy", 1000, "0")
        .sh("gpushare-mps-sim client --hold 30")
        .create();
    c.start_attached();
    let busy = env.daemon_of(&c);
    // Idle daemons until at least one sorts before and one after the busy one (ids are
    // hashes of the identity; each percentage is another identity).
    let mut idle = Vec::new();
    for pct in 10..60 {
        let out = env
            .cmd(gpushare())
            .args([
                "daemon", "start", "--device", "0", "--uid", "2000", "--json",
            ])
            .arg(format!("--active-thread-percentage={pct}"))
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", text(&out));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        idle.push(v["id"].as_str().unwrap().to_owned());
        if idle.iter().any(|i| *i < busy) && idle.iter().any(|i| *i > busy) {
            break;
        }
    }
    assert!(
        idle.iter().any(|i| *i > busy),
        "an idle daemon sorts after {busy}"
    );
    let out = env.gpushare(&["daemon", "stop", "--all"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        stderr,
        format!("gpushare: daemon {busy} is used by 1 container(s) (busy); stop them first or pass --force\n")
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    for id in &idle {
        assert!(
            stdout.contains(&format!("stopped daemon {id}\n")),
            "{stdout}"
        );
    }
    assert_eq!(
        env.daemon_ids(),
        vec![busy.clone()],
        "only the busy daemon is left"
    );
    // Nothing in use: --all stops everything and exits 0.
    c.delete();
    let out = env.gpushare(&["daemon", "stop", "--all"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(env.daemon_ids().is_empty());
}

/// `gpushare daemon start --namespace`: under `mps.tenant = "namespace"` it starts that
/// namespace's daemon ahead of its pods, and without it the "no namespace" tenant's, which
/// a container outside Kubernetes (runc through the shim) then uses; a name that is no
/// Kubernetes namespace, or `--namespace` where tenants are UIDs, is refused in one line.
#[test]
fn daemon_start_takes_a_namespace_only_where_tenants_are_namespaces() {
    let start = |env: &Env, extra: &[&str]| {
        env.cmd(gpushare())
            .args([
                "daemon", "start", "--device", "0", "--uid", "1000", "--json",
            ])
            .args(extra)
            .output()
            .unwrap()
    };
    let id = |out: &std::process::Output| {
        assert!(out.status.success(), "{}", text(out));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v["id"].as_str().unwrap().to_owned()
    };
    let env = Env::with_config("tenant = \"namespace\"");
    let team_a = id(&start(&env, &["--namespace", "team-a"]));
    let none = id(&start(&env, &[]));
    assert_ne!(team_a, none);
    assert_eq!(
        env.record(&team_a)["identity"]["tenant"],
        serde_json::json!({"namespace": "team-a"})
    );
    assert_eq!(env.record(&none)["identity"]["tenant"], "no-namespace");
    let c = env
        .request("outside", 1000, "0")
        .annotation("io.kubernetes.cri.sandbox-namespace", "team-a")
        .sh("true")
        .create();
    assert_eq!(env.daemon_of(&c), none);
    let out = start(&env, &["--namespace", "Team_A"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        "gpushare: the Kubernetes namespace \"Team_A\" (--namespace) is invalid: allowed is a Kubernetes namespace name (1 to 63 lowercase letters, digits and '-', starting and ending with a letter or digit)\n"
    );
    assert_eq!(
        env.daemon_ids().len(),
        2,
        "nothing made for a refused start"
    );

    let by_uid = Env::new();
    let out = start(&by_uid, &["--namespace", "team-a"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.starts_with("gpushare: --namespace names a tenant, and this node's tenants are host UIDs (mps.tenant = \"uid\")")
            && err.lines().count() == 1,
        "{err}"
    );
    assert!(by_uid.daemon_ids().is_empty());
}

/// The body of the heredoc `opening` (`cat > … <<EOF`) in `doc`, with `$T` as `t`.
fn heredoc(doc: &str, opening: &str, t: &Path) -> String {
    let start = doc
        .find(opening)
        .unwrap_or_else(|| panic!("the doc no longer shows `{opening}`"));
    let body = &doc[start + opening.len()..].trim_start_matches('\n');
    let body = &body[..body.find("\nEOF\n").expect("an EOF line") + 1];
    body.replace("$T", t.to_str().unwrap())
}

/// The docs' gpushare commands, each as the doc shows it (tests/fixtures/doc-commands.txt
/// names this test for them): the README's "Try it without a GPU" on its own
/// configuration (taken from the README) with its agent, then install.md's and
/// kubernetes.md's install and CDI commands. Where a command would write the host's
/// engine config or CDI spec, a private `--config`/`--output` is the only flag added.
#[test]
fn the_docs_gpushare_commands_behave_as_the_docs_say() {
    use std::os::unix::fs::PermissionsExt;
    let env = Env::new();
    let readme = std::fs::read_to_string(repo().join("README.md")).unwrap();
    // Step 1: a temp dir with the inventory, the simulator and the README's configuration.
    let t = env.path().join("try");
    std::fs::create_dir(&t).unwrap();
    std::fs::set_permissions(&t, std::fs::Permissions::from_mode(0o711)).unwrap();
    std::fs::copy(
        repo().join("docs/examples/inventory.json"),
        t.join("inventory.json"),
    )
    .unwrap();
    std::os::unix::fs::symlink(sim(), t.join("gpushare-mps-sim")).unwrap();
    std::os::unix::fs::symlink(runtime(), t.join("gpushare-runtime")).unwrap();
    let config = t.join("runtime.toml");
    std::fs::write(&config, heredoc(&readme, "cat > $T/runtime.toml <<EOF", &t)).unwrap();
    // The doc's command line with `$T/gpushare` (or `gpushare`) as the built binary.
    let run = |doc_line: &str, private: &[&str]| {
        let line = doc_line.replace("$T", t.to_str().unwrap());
        let mut words = line.split_whitespace();
        let bin = words.next().unwrap();
        assert!(bin.ends_with("gpushare"), "{doc_line}");
        let out = Command::new(gpushare())
            .args(words)
            .args(private)
            .env("GPUSHARE_CONFIG", &config)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        (out.status.code(), text(&out))
    };
    // `$T/gpushare agent </dev/null >/dev/null 2>&1 &`
    let mut agent = Command::new(gpushare())
        .arg("agent")
        .env("GPUSHARE_CONFIG", &config)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let sock = t.join("state/agent.sock");
    assert!(
        wait_until(Duration::from_secs(10), || {
            std::os::unix::net::UnixStream::connect(&sock).is_ok()
        }),
        "the README's agent did not listen on {}",
        sock.display()
    );
    // "one ok line per check … ok agent once the agent answers … Where Docker or
    // containerd runs, a warn line (and exit code 1)".
    let (code, out) = run("$T/gpushare doctor", &[]);
    let inventory = format!("inventory = \"file:{}/inventory.json\"", t.display());
    for wanted in [
        "ok    driver             no NVIDIA driver on this machine; ",
        inventory.as_str(),
        "(test mode)",
        "ok    inventory          3 GPU(s), 3 MIG device(s) from file:",
        "ok    agent ",
    ] {
        assert!(
            out.contains(wanted),
            "doctor does not say {wanted:?}:\n{out}"
        );
    }
    // The checks of what the README sets up are ok; the others look at the machine (a
    // running engine, the host's MPS pipe, other gpushare processes) and may warn there.
    let warns: Vec<&str> = out.lines().filter(|l| !l.starts_with("ok ")).collect();
    for line in &warns {
        let mut words = line.split_whitespace();
        let (level, check) = (words.next(), words.next().unwrap_or(""));
        assert_eq!(
            level,
            Some("warn"),
            "the README's trial fails a check:\n{out}"
        );
        assert!(
            !matches!(
                check,
                "config"
                    | "driver"
                    | "inventory"
                    | "mps-control"
                    | "socket-path"
                    | "state-dir"
                    | "state-dir-parents"
                    | "agent"
            ),
            "the README's trial warns on its own setup:\n{out}"
        );
    }
    assert_eq!(code, Some(if warns.is_empty() { 0 } else { 1 }), "{out}");
    // Step 2: the wrapper, and step 4a's runtime entry (in a private daemon.json that
    // holds a setting of its own, which install keeps and uninstall gives back).
    let wrapper = t.join("runtime");
    std::fs::write(
        &wrapper,
        heredoc(&readme, "cat > $T/runtime <<EOF", &t).replace("\\$@", "$@"),
    )
    .unwrap();
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).unwrap();
    let version = Command::new(&wrapper).arg("--version").output().unwrap();
    assert!(
        text(&version).contains("gpushare-runtime"),
        "the README's wrapper does not run gpushare-runtime: {}",
        text(&version)
    );
    let daemon_json = t.join("daemon.json");
    let before = "{\n  \"log-level\": \"warn\"\n}\n";
    std::fs::write(&daemon_json, before).unwrap();
    let private = ["--config", daemon_json.to_str().unwrap()];
    let (code, out) = run(
        "$T/gpushare install docker --name gpushare-try --runtime-path $T/runtime",
        &private,
    );
    assert_eq!(code, Some(0), "{out}");
    let installed: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&daemon_json).unwrap()).unwrap();
    assert_eq!(
        installed["runtimes"]["gpushare-try"]["path"],
        wrapper.to_str().unwrap(),
        "{installed}"
    );
    assert_eq!(installed["log-level"], "warn", "{installed}");
    // `$T/gpushare status`: the table's header, here with no daemon yet.
    let (code, out) = run("$T/gpushare status", &[]);
    assert_eq!(code, Some(0), "{out}");
    assert!(out.starts_with("DAEMON "), "{out}");
    // Step 5.
    let (code, out) = run("$T/gpushare daemon stop --all --force", &[]);
    assert_eq!(code, Some(0), "{out}");
    // `kill $AGENT`: the agent ends on SIGTERM, with status 0.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(agent.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let status = agent.wait().unwrap();
    assert!(status.success(), "the agent ended with {status} on kill");
    let (code, out) = run("$T/gpushare uninstall docker --name gpushare-try", &private);
    assert_eq!(code, Some(0), "{out}");
    assert_eq!(std::fs::read_to_string(&daemon_json).unwrap(), before);

    // install.md and kubernetes.md: each engine's install into a private config.
    let engine = |doc_line: &str, file: &str, wanted: &str| {
        let path = t.join(file);
        let (code, out) = run(doc_line, &["--config", path.to_str().unwrap()]);
        assert_eq!(code, Some(0), "{doc_line}: {out}");
        let written = std::fs::read_to_string(&path).unwrap();
        assert!(written.contains(wanted), "{doc_line} wrote:\n{written}");
    };
    engine("gpushare install docker", "docker.json", "\"gpushare\"");
    engine(
        "gpushare install containerd",
        "containerd.toml",
        "containerd.runtimes.gpushare.options]\nBinaryName = ",
    );
    engine(
        "gpushare install containerd --hook-only",
        "hooks.toml",
        "base_runtime_spec",
    );
    engine(
        "gpushare install containerd --nri",
        "nri.toml",
        "disable = false",
    );
    // `gpushare install cdi` and `# or: gpushare cdi generate`: the same spec.
    let (cdi, generated) = (t.join("cdi.json"), t.join("generated.json"));
    let (code, out) = run("gpushare install cdi", &["--output", cdi.to_str().unwrap()]);
    assert_eq!(code, Some(0), "{out}");
    let (code, out) = run(
        "gpushare cdi generate",
        &["--output", generated.to_str().unwrap()],
    );
    assert_eq!(code, Some(0), "{out}");
    let spec = std::fs::read_to_string(&cdi).unwrap();
    assert!(spec.contains("\"cdiVersion\": \"0.5.0\""), "{spec}");
    assert_eq!(spec, std::fs::read_to_string(&generated).unwrap());
    // install.md's `scripts/install --dry-run`: every step printed, nothing changed (the
    // real runs, into a temp prefix, are scripts/test-package's).
    let out = Command::new(repo().join("scripts/install"))
        .arg("--dry-run")
        .current_dir(repo())
        .output()
        .unwrap();
    // Where the Debian package is installed, scripts/install refuses with one line (what
    // scripts/test-package checks); the test command runs this before installing it.
    let packaged = text(&out).contains("the gpushare Debian package is installed");
    assert!(out.status.success() || packaged, "{}", text(&out));
    for wanted in [
        "would run: scripts/build-release\n",
        "/usr/local/bin/gpushare-runtime\n",
        "Next steps (as root):",
    ] {
        assert!(
            packaged || text(&out).contains(wanted),
            "{wanted:?}:\n{}",
            text(&out)
        );
    }
    // kubernetes.md's k3s/RKE2 template: the doc's line, with `$d` a temp dir and the
    // package's deploy file the repository's: k3s's base template, then the gpushare
    // table without the file's `version` line (k3s writes its own).
    let k3s = std::fs::read_to_string(repo().join("docs/kubernetes.md")).unwrap();
    let line = k3s
        .lines()
        .find(|l| l.starts_with("{ echo '{{ template \"base\" . }}'; sed 1,/^version/d "))
        .expect("kubernetes.md's k3s template line");
    let line = line.replace(
        "/usr/share/gpushare/deploy/",
        &format!("{}/deploy/", repo().display()),
    );
    let out = Command::new("bash")
        .args(["-c", &line])
        .env("d", &t)
        .output()
        .unwrap();
    assert!(out.status.success(), "{line}: {}", text(&out));
    let template = std::fs::read_to_string(t.join("config.toml.tmpl")).unwrap();
    let (first, rest) = template.split_once('\n').unwrap();
    assert_eq!(first, "{{ template \"base\" . }}");
    assert!(!rest.contains("version ="), "{template}");
    let table: toml::Table = toml::from_str(rest).unwrap_or_else(|e| panic!("{e}:\n{rest}"));
    assert!(
        table["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]
            .get("gpushare")
            .is_some(),
        "{template}"
    );
    // Nothing was written beside the private files (the host's are the scripts/test's
    // before/after listing's to check).
    let mut names: Vec<String> = std::fs::read_dir(&t)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert!(names.iter().all(|n| !n.ends_with(".tmp")), "{names:?}");
}

/// The README's first command, `./scripts/quickstart`, with the test's binaries for its
/// build step (QUICKSTART_BIN_DIR): it exits 0, and without a driver prints what the
/// README shows: each user's client on a server of its own, then on one shared daemon
/// bob's client waiting for alice's 2-second job.
#[test]
fn the_quickstart_runs_two_users_at_once_as_the_readme_shows() {
    require_root_and_runc();
    let bins = Path::new(gpushare()).parent().unwrap();
    assert_eq!(Path::new(sim()).parent(), Some(bins), "{}", sim());
    let out = Command::new(repo().join("scripts/quickstart"))
        .env("QUICKSTART_BIN_DIR", bins)
        .env_remove("GPUSHARE_CONFIG")
        .env_remove("KEEP")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let said = text(&out);
    assert!(out.status.success(), "{said}");
    if !said.contains("no NVIDIA driver here") {
        return; // a real driver: real MPS daemons, whose lines are the driver's
    }
    for uid in [1000, 2000] {
        let own = format!("mps-client pid=1 uid={uid} server=");
        let served = said
            .lines()
            .find(|l| l.contains(&own))
            .unwrap_or_else(|| panic!("no client of uid {uid}:\n{said}"));
        assert!(
            served.contains(&format!(" server_uid={uid} ")) && served.contains("shm=ok"),
            "{said}"
        );
    }
    let bob = said
        .lines()
        .find(|l| l.starts_with("bob (uid 2000):"))
        .unwrap_or_else(|| panic!("no shared-daemon comparison:\n{said}"));
    let waited: u64 = bob
        .split_whitespace()
        .find_map(|w| w.strip_prefix("waited_ms="))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{bob}"));
    assert!(waited >= 1000, "bob did not wait for alice's job: {bob}");
}
