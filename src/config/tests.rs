//! The configuration's unit tests: the file as documented, every key's refusals, the
//! rows' keys.

use super::check::parse_duration;
use super::types::DEFAULT_NRI_SKIP_NAMESPACES;
use super::*;
use crate::request::{Number, ProfileValue};

#[test]
fn defaults_match_the_documented_file() {
    let shipped = include_str!("../../config/runtime.toml");
    let from_file = parse(shipped, None).expect("shipped config parses");
    let defaults = parse("", None).expect("empty config parses");
    assert_eq!(from_file, defaults);
}

#[test]
fn cdi_profiles_are_named_limits_within_the_ceilings() {
    let cfg = parse(
        "[mps]\nmax-active-thread-percentage = 50\n[cdi.profiles.small]\nactive-thread-percentage = 25\n[cdi.profiles.mem4]\npinned-memory-limit = \"4G\"\n",
        None,
    )
    .expect("profiles");
    assert_eq!(
        cfg.cdi_profiles.keys().collect::<Vec<_>>(),
        ["mem4", "small"]
    );
    assert_eq!(
        cfg.cdi_profiles["small"].limits(),
        [(
            &crate::request::ACTIVE_THREAD_PERCENTAGE,
            ProfileValue::Integer(25)
        )]
    );
    for (text, want) in [
        ("[cdi.profiles.Big]\nactive-thread-percentage = 5", "[cdi.profiles.Big]: the name is invalid: allowed is 1 to 32 lowercase letters"),
        ("[cdi.profiles.mig]\nactive-thread-percentage = 5", "[cdi.profiles.mig]: the name is invalid"),
        ("[cdi.profiles.a-b]\nactive-thread-percentage = 5", "[cdi.profiles.a-b]: the name is invalid"),
        ("[cdi.profiles.none]\n", "[cdi.profiles.none]: sets no limit"),
        ("[cdi.profiles.p]\nactive-thread-percentage = 0", "active-thread-percentage = 0: allowed is an integer from 1 to 100"),
        ("[cdi.profiles.p]\npinned-memory-limit = \"4\"", "pinned-memory-limit=\"4\" is invalid"),
        ("[mps]\nmax-active-thread-percentage = 50\n[cdi.profiles.p]\nactive-thread-percentage = 60", "above mps.max-active-thread-percentage = 50"),
        ("[mps]\nmax-pinned-memory-limit = \"2G\"\n[cdi.profiles.p]\npinned-memory-limit = \"4G\"", "above mps.max-pinned-memory-limit"),
        ("[cdi.profiles.p]\nthreads = 5", "threads"),
    ] {
        let err = parse(text, None).expect_err(text).to_string();
        assert!(err.contains(want), "{text}: {err}");
        assert!(!err.contains('\n'), "{err}");
    }
}

/// Every row's `default_key`, `ceiling_key` and profile key is read: set each to the
/// key's smallest value, written as the config writes it, and find it back by row. A
/// row whose config key the serde structs lack fails here, not silently at a node.
#[test]
fn every_rows_config_keys_are_read() {
    let mut mps = String::from("[mps]\n");
    let mut profile = String::from("[cdi.profiles.p]\n");
    let min = |number: Number| match number {
        Number::Integer { min, .. } => min,
        Number::Size => crate::request::parse_size("k", &number.min_text()).unwrap(),
    };
    let toml = |number: Number| match number {
        Number::Integer { .. } => number.config_text(min(number)),
        Number::Size => format!("{:?}", number.config_text(min(number))),
    };
    for (key, number) in crate::request::numeric() {
        for config_key in [key.default_key, key.ceiling_key].into_iter().flatten() {
            let name = config_key.strip_prefix("mps.").expect("an [mps] key");
            mps.push_str(&format!("{name} = {}\n", toml(number)));
        }
    }
    for key in crate::request::profile_keys() {
        let number = key.number().expect("numeric");
        profile.push_str(&format!("{} = {}\n", key.name, toml(number)));
    }
    let cfg = parse(&(mps + &profile), None).unwrap();
    for (key, number) in crate::request::numeric() {
        let want = key.default_key.map(|_| min(number));
        assert_eq!(cfg.mps.default_for(key), want, "{}", key.name);
        let ceiling = cfg.mps.ceilings().0.iter().find(|(k, _)| *k == key);
        let want = key.ceiling_key.map(|_| (key, min(number)));
        assert_eq!(ceiling.copied(), want, "{}", key.name);
    }
    let limits = cfg.cdi_profiles["p"].limits();
    let read: Vec<_> = limits.iter().map(|(k, _)| k.name).collect();
    let rows: Vec<_> = crate::request::profile_keys().map(|k| k.name).collect();
    assert_eq!(read, rows);
}

/// An unknown key's line lists every key its table takes, the rows' among them, once
/// each: every numeric row's default and ceiling key under `[mps]` beside `[mps]`'s own
/// keys, and every limit's name under `[cdi.profiles.<name>]`.
#[test]
fn unknown_key_lines_list_the_rows_keys() {
    let listed = |text: &str| -> Vec<String> {
        let err = parse(text, None).unwrap_err().to_string();
        let want =
            "TOML parse error at line 2, column 1 | 2 | zz = 1 | ^^ unknown field `zz`, expected ";
        let (_, list) = err.split_once(want).unwrap_or_else(|| panic!("{err}"));
        let list = list.strip_prefix("one of ").unwrap_or(list);
        list.split(", ")
            .flat_map(|item| item.split(" or "))
            .map(|k| k.trim_matches('`').to_owned())
            .collect()
    };
    let mps = listed("[mps]\nzz = 1");
    let mut rows_keys = Vec::new();
    for (key, _) in crate::request::numeric() {
        for config_key in [key.default_key, key.ceiling_key].into_iter().flatten() {
            rows_keys.push(config_key.strip_prefix("mps.").expect("an [mps] key"));
        }
    }
    assert!(rows_keys.len() >= 4, "{rows_keys:?}");
    for name in rows_keys
        .iter()
        .chain(&["control-binary", "daemon-pids-max"])
    {
        assert_eq!(
            mps.iter().filter(|k| k == name).count(),
            1,
            "{name} in {mps:?}"
        );
    }
    let mut unique = mps.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), mps.len(), "a key twice: {mps:?}");
    let profile = listed("[cdi.profiles.p]\nzz = 1");
    let names: Vec<_> = crate::request::profile_keys().map(|k| k.name).collect();
    assert_eq!(profile, names);
}

/// The config module spells no limit outside its tests: the rows are the one home of
/// their keys, which `rows` reads by row (a limit spelled here again is a second home
/// that a new row would have to find).
#[test]
fn the_config_module_spells_no_limit() {
    let sources = [
        ("src/config/mod.rs", include_str!("mod.rs")),
        ("src/config/raw.rs", include_str!("raw.rs")),
        ("src/config/check.rs", include_str!("check.rs")),
        ("src/config/rows.rs", include_str!("rows.rs")),
    ];
    for (file, text) in sources {
        let code = text.split("#[cfg(test)]").next().unwrap_or(text);
        for key in crate::request::profile_keys() {
            let snake = key.name.replace('-', "_");
            for spelled in [key.name.to_owned(), snake.to_uppercase(), snake] {
                assert!(!code.contains(&spelled), "{file} spells {spelled}");
            }
        }
    }
}

/// The config's lines about the limits' defaults, ceilings and CDI profiles, pinned
/// whole: they are built from the request-key rows, and must read as they always have.
#[test]
fn limit_lines_are_pinned() {
    for (text, want) in [
        (
            "[mps]\ndefault-active-thread-percentage = 0",
            "invalid config <defaults>: mps.default-active-thread-percentage = \"0\": an integer from 1 to 100",
        ),
        (
            "[mps]\ndefault-active-thread-percentage = 300",
            "invalid config <defaults>: mps.default-active-thread-percentage = \"300\": an integer from 1 to 100",
        ),
        (
            "[mps]\ndefault-active-thread-percentage = \"5\"",
            "invalid config <defaults>: TOML parse error at line 2, column 36 | 2 | default-active-thread-percentage = \"5\" | ^^^ invalid type: string \"5\", expected an integer from 1 to 100",
        ),
        (
            "[mps]\ndefault-active-thread-percentage = -1",
            "invalid config <defaults>: TOML parse error at line 2, column 36 | 2 | default-active-thread-percentage = -1 | ^^ invalid value: integer `-1`, expected an integer from 1 to 100",
        ),
        (
            "[mps]\nmax-active-thread-percentage = 1.5",
            "invalid config <defaults>: TOML parse error at line 2, column 32 | 2 | max-active-thread-percentage = 1.5 | ^^^ invalid type: floating point `1.5`, expected an integer from 1 to 100",
        ),
        (
            "[mps]\nmax-pinned-memory-limit = 4",
            "invalid config <defaults>: TOML parse error at line 2, column 27 | 2 | max-pinned-memory-limit = 4 | ^ invalid type: integer `4`, expected a string with a size and a unit, like \"512M\" or \"4G\"",
        ),
        (
            "[mps]\nmax-active-thread-percentage = 101",
            "invalid config <defaults>: mps.max-active-thread-percentage = \"101\": an integer from 1 to 100",
        ),
        (
            "[mps]\ndefault-pinned-memory-limit = \"4\"",
            "invalid config <defaults>: mps.default-pinned-memory-limit = \"4\": a size with a unit, like 512M or 4G",
        ),
        (
            "[mps]\nmax-pinned-memory-limit = \"lots\"",
            "invalid config <defaults>: mps.max-pinned-memory-limit = \"lots\": a size with a unit, like 512M or 4G",
        ),
        (
            "[mps]\ndefault-pinned-memory-limit = \"1K\"\nmax-active-thread-percentage = 0",
            "invalid config <defaults>: mps.default-pinned-memory-limit = \"1K\": a size with a unit, like 512M or 4G",
        ),
        (
            "[mps]\ndefault-pinned-memory-limit = \"bad\"\nmax-active-thread-percentage = 0",
            "invalid config <defaults>: mps.default-pinned-memory-limit = \"bad\": a size with a unit, like 512M or 4G",
        ),
        (
            "[mps]\ndefault-active-thread-percentage = 60\nmax-active-thread-percentage = 50",
            "invalid config <defaults>: mps.default-active-thread-percentage = \"60\": at most mps.max-active-thread-percentage",
        ),
        (
            "[mps]\ndefault-pinned-memory-limit = \"4G\"\nmax-pinned-memory-limit = \"2G\"",
            "invalid config <defaults>: mps.default-pinned-memory-limit = \"4294967296\": at most mps.max-pinned-memory-limit",
        ),
        (
            "[mps]\ndefault-pinned-memory-limit = \"4G\"\nmax-pinned-memory-limit = \"2G\"\ndefault-active-thread-percentage = 60\nmax-active-thread-percentage = 50",
            "invalid config <defaults>: mps.default-active-thread-percentage = \"60\": at most mps.max-active-thread-percentage",
        ),
        (
            "[mps]\nmax-threads = 5",
            "invalid config <defaults>: TOML parse error at line 2, column 1 | 2 | max-threads = 5 | ^^^^^^^^^^^ unknown field `max-threads`, expected one of `control-binary`, `protocol`, `cgroup-memory-limit`, `nvidia-smi`, `user-mode`, `tenant`, `multi-user-flag`, `limits`, `ipc`, `allow-ipc-override`, `container-pipe-dir`, `container-log-dir`, `shm-size`, `shm-size-per-uid`, `shm-size-total`, `start-timeout`, `idle-timeout`, `daemon-gid`, `max-daemons`, `max-daemons-per-uid`, `log-size`, `limit-check-interval`, `daemon-memory-max`, `daemon-pids-max`, `default-active-thread-percentage`, `default-pinned-memory-limit`, `max-active-thread-percentage`, `max-pinned-memory-limit`",
        ),
        (
            "[cdi.profiles.none]\n",
            "invalid config <defaults>: [cdi.profiles.none]: sets no limit: allowed is active-thread-percentage, pinned-memory-limit or both",
        ),
        (
            "[cdi.profiles.p]\nactive-thread-percentage = 0",
            "invalid config <defaults>: [cdi.profiles.p]: active-thread-percentage = 0: allowed is an integer from 1 to 100",
        ),
        (
            "[cdi.profiles.p]\nactive-thread-percentage = 300",
            "invalid config <defaults>: [cdi.profiles.p]: active-thread-percentage = 300: allowed is an integer from 1 to 100",
        ),
        (
            "[cdi.profiles.p]\nactive-thread-percentage = \"25\"",
            "invalid config <defaults>: TOML parse error at line 2, column 28 | 2 | active-thread-percentage = \"25\" | ^^^^ invalid type: string \"25\", expected an integer from 1 to 100",
        ),
        (
            "[cdi.profiles.p]\npinned-memory-limit = \"4\"",
            "invalid config <defaults>: [cdi.profiles.p]: pinned-memory-limit=\"4\" is invalid: it has no unit, which is ambiguous; allowed is a size with a unit, like 512M, 4G, 4GiB or 1536MiB (K, M, G, T; every unit is 1024-based, so 4GB is 4GiB)",
        ),
        (
            "[cdi.profiles.p]\npinned-memory-limit = 4",
            "invalid config <defaults>: TOML parse error at line 2, column 23 | 2 | pinned-memory-limit = 4 | ^ invalid type: integer `4`, expected a string with a size and a unit, like \"512M\" or \"4G\"",
        ),
        (
            "[mps]\nmax-active-thread-percentage = 50\n[cdi.profiles.p]\nactive-thread-percentage = 60",
            "invalid config <defaults>: [cdi.profiles.p]: active-thread-percentage = 60 is above mps.max-active-thread-percentage = 50",
        ),
        (
            "[mps]\nmax-pinned-memory-limit = \"2G\"\n[cdi.profiles.p]\npinned-memory-limit = \"4G\"",
            "invalid config <defaults>: [cdi.profiles.p]: pinned-memory-limit = \"4G\" is above mps.max-pinned-memory-limit (2048 MiB)",
        ),
        (
            "[mps]\nmax-pinned-memory-limit = \"2G\"\nmax-active-thread-percentage = 50\n[cdi.profiles.p]\npinned-memory-limit = \"4G\"\nactive-thread-percentage = 60",
            "invalid config <defaults>: [cdi.profiles.p]: active-thread-percentage = 60 is above mps.max-active-thread-percentage = 50",
        ),
        (
            "[cdi.profiles.p]\nthreads = 5",
            "invalid config <defaults>: TOML parse error at line 2, column 1 | 2 | threads = 5 | ^^^^^^^ unknown field `threads`, expected `active-thread-percentage` or `pinned-memory-limit`",
        ),
    ] {
        let err = parse(text, None).expect_err(text).to_string();
        assert_eq!(err, want, "{text}");
    }
    let limits = |text| {
        let c = parse(text, None).expect(text);
        let d = |k| c.mps.default_for(k);
        let ceilings = c
            .mps
            .ceilings()
            .0
            .iter()
            .map(|(k, v)| (k.name, *v))
            .collect::<Vec<_>>();
        (
            d(&crate::request::ACTIVE_THREAD_PERCENTAGE),
            d(&crate::request::PINNED_MEMORY_LIMIT),
            ceilings,
        )
    };
    assert_eq!(
        limits("[mps]\ndefault-active-thread-percentage = 30\ndefault-pinned-memory-limit = \"1536M\"\nmax-active-thread-percentage = 50\nmax-pinned-memory-limit = \"8G\""),
        (Some(30), Some(1536 << 20), vec![("active-thread-percentage", 50), ("pinned-memory-limit", 8 << 30)])
    );
    assert_eq!(
        limits("[mps]\nmax-pinned-memory-limit = \"8G\""),
        (None, None, vec![("pinned-memory-limit", 8 << 30)])
    );
    assert_eq!(limits(""), (None, None, vec![]));
}

/// `mps.tenant`: `uid` by default, `namespace` only with per-user daemons (one
/// multi-user server serves every tenant of a device by design).
#[test]
fn tenant_is_uid_by_default_and_namespace_needs_per_user_daemons() {
    assert_eq!(parse("", None).unwrap().mps.tenant, TenantMode::Uid);
    let ns = parse("[mps]\ntenant = \"namespace\"", None).unwrap();
    assert_eq!(ns.mps.tenant, TenantMode::Namespace);
    let err = parse(
        "[mps]\ntenant = \"namespace\"\nuser-mode = \"multi-user\"",
        None,
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("mps.tenant = \"namespace\"")
            && err.contains("needs user-mode = \"per-user\"")
            && !err.contains('\n'),
        "{err}"
    );
    let err = parse("[mps]\ntenant = \"pod\"", None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("pod") && err.contains("namespace"), "{err}");
}

#[test]
fn unknown_key_is_named() {
    let err = parse("stat-dir = \"/run/x\"\n", None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("stat-dir"), "{err}");
    let err = parse("[mps]\nshm = \"1G\"\n", None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("shm"), "{err}");
}

#[test]
fn bad_values_name_key_value_and_allowed() {
    let cases = [
        ("state-dir = \"run/x\"", "state-dir", "absolute"),
        ("state-dir = \"/run/../x\"", "state-dir", "absolute"),
        ("log-level = \"loud\"", "log-level", "one of"),
        (
            "inventory-cache-ttl = \"2h\"",
            "inventory-cache-ttl",
            "a duration up to 1h",
        ),
        (
            "inventory = \"file:rel\"",
            "inventory",
            "file:<absolute path>",
        ),
        ("low-level-runtime = []", "low-level-runtime", "non-empty"),
        ("[mps]\nshm-size = \"lots\"", "mps.shm-size", "percentage"),
        ("[watch]\ninterval = \"100ms\"", "watch.interval", "500ms to 5m"),
        ("[watch]\nmemory-margin = \"lots\"", "watch.memory-margin", "a size"),
        ("[mps]\nshm-size = \"0%\"", "mps.shm-size", "percentage"),
        (
            "[mps]\nshm-size-per-uid = \"lots\"",
            "mps.shm-size-per-uid",
            "\"0\" for no bound",
        ),
        (
            "[mps]\nshm-size-total = \"101%\"",
            "mps.shm-size-total",
            "percentage",
        ),
        (
            "[mps]\nstart-timeout = \"0\"",
            "mps.start-timeout",
            "duration",
        ),
        (
            "[mps]\nstart-timeout = \"10\"",
            "mps.start-timeout",
            "duration",
        ),
        (
            "[mps]\nidle-timeout = \"soon\"",
            "mps.idle-timeout",
            "duration",
        ),
        (
            "[mps]\ndefault-active-thread-percentage = 0",
            "mps.default-active-thread-percentage",
            "1 to 100",
        ),
        (
            "[mps]\nmulti-user-flag = \"M\"",
            "mps.multi-user-flag",
            "single option",
        ),
        ("[mps]\nuser-mode = \"shared\"", "user-mode", "per-user"),
        (
            "default-device = \"0\"",
            "default-device = \"0\"",
            "\"allocated\" (the devices a device plugin or DRA driver allocated to the container), or unset",
        ),
        ("default-device = \"Allocated\"", "default-device", "\"allocated\""),
        ("default-device = \"\"", "default-device", "or unset"),
        ("driver-root = \"run/nvidia/driver\"", "driver-root", "an absolute path"),
        (
            "driver-root = \"/run/nvidia/../driver\"",
            "driver-root = \"/run/nvidia/../driver\"",
            "without '..'",
        ),
        ("driver-root = \"/\"", "driver-root", "other than \"/\""),
    ];
    for (text, key, allowed) in cases {
        let err = parse(text, None).unwrap_err().to_string();
        assert!(err.contains(key) && err.contains(allowed), "{text}: {err}");
    }
}

#[test]
fn driver_root_is_unset_or_an_absolute_path() {
    assert_eq!(parse("", None).unwrap().driver_root, None);
    assert_eq!(
        parse("driver-root = \"\"\n", None).unwrap().driver_root,
        None
    );
    assert_eq!(
        parse("driver-root = \"/run/nvidia/driver\"\n", None)
            .unwrap()
            .driver_root,
        Some(PathBuf::from("/run/nvidia/driver"))
    );
    // Whether it exists is not the config's to say (`driver`).
    assert!(parse("driver-root = \"/nonexistent/driver\"\n", None).is_ok());
    for bad in ["run/nvidia/driver", "/run/nvidia/../../etc", "/", "/x\u{0}"] {
        let err = parse(&format!("driver-root = {bad:?}\n"), None)
            .expect_err(bad)
            .to_string();
        assert!(err.contains("driver-root") && !err.contains('\n'), "{err}");
    }
}

#[test]
fn visible_devices_env_is_off_unless_the_node_says_so() {
    assert!(!parse("", None).unwrap().accept_visible_devices_env);
    assert!(
        parse("accept-visible-devices-env = true\n", None)
            .unwrap()
            .accept_visible_devices_env
    );
    let err = parse("accept-visible-devices-env = \"yes\"\n", None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("accept-visible-devices-env"), "{err}");
}

#[test]
fn nri_skip_namespaces_are_namespace_names_with_defaults() {
    assert_eq!(
        parse("", None).unwrap().nri_skip_namespaces,
        DEFAULT_NRI_SKIP_NAMESPACES
    );
    let got = |text: &str| parse(text, None).map(|c| c.nri_skip_namespaces);
    assert_eq!(
        got("[nri]\nskip-namespaces = []\n").unwrap(),
        Vec::<String>::new()
    );
    assert_eq!(
        got("[nri]\nskip-namespaces = [\"ops\", \"a-1\"]\n").unwrap(),
        ["ops", "a-1"]
    );
    for bad in ["Ops", "-a", "a-", "", "a.b", &"a".repeat(64)] {
        let err = got(&format!("[nri]\nskip-namespaces = [{bad:?}]\n"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("nri.skip-namespaces")
                && err.contains("Kubernetes namespace names")
                && !err.contains('\n'),
            "{err}"
        );
    }
    assert!(got("[nri]\nnamespaces = []\n").is_err(), "an unknown key");
}

#[test]
fn nri_audit_interval_and_unserved_have_defaults_and_one_line_errors() {
    let cfg = parse("", None).unwrap();
    assert_eq!(cfg.nri_audit_interval, Duration::from_secs(10));
    assert_eq!(cfg.nri_unserved, super::NriUnserved::Report);
    let cfg = parse(
        "[nri]\naudit-interval = \"2s\"\nunserved = \"evict\"\n",
        None,
    )
    .unwrap();
    assert_eq!(cfg.nri_audit_interval, Duration::from_secs(2));
    assert_eq!(cfg.nri_unserved, super::NriUnserved::Evict);
    for bad in ["0", "500ms", "11m", "ten"] {
        let err = parse(&format!("[nri]\naudit-interval = {bad:?}\n"), None)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("nri.audit-interval") && err.contains("1s to 10m") && !err.contains('\n'),
            "{err}"
        );
    }
    let err = parse("[nri]\nunserved = \"kill\"\n", None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("report") && err.contains("evict"), "{err}");
}

#[test]
fn default_device_is_unset_or_allocated() {
    assert_eq!(parse("", None).unwrap().default_device, None);
    assert_eq!(
        parse("default-device = \"allocated\"\n", None)
            .unwrap()
            .default_device,
        Some(crate::request::DefaultDevice::Allocated)
    );
    // A top-level key: under [mps] it is unknown.
    let err = parse("[mps]\ndefault-device = \"allocated\"\n", None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("default-device"), "{err}");
    // Not a string: the parser names the key.
    let err = parse("default-device = 0\n", None).unwrap_err().to_string();
    assert!(err.contains("default-device"), "{err}");
}

#[test]
fn fast_path_reads_the_runtime_and_whether_default_device_is_set() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("runtime.toml");
    let shipped = include_str!("../../config/runtime.toml");
    for (text, want) in [
        (shipped.to_owned(), false),
        (format!("default-device = \"allocated\"\n{shipped}"), true),
        // Its value is judged where it is used, not on the fast path.
        (format!("default-device = \"bogus\"\n{shipped}"), true),
    ] {
        std::fs::write(&path, &text).unwrap();
        let got = fast_path_from(&path, true).unwrap();
        assert_eq!(got.default_device, want, "{text}");
        assert_eq!(got.low_level_runtime, vec!["runc", "crun"]);
    }
    let absent = dir.path().join("absent.toml");
    assert!(!fast_path_from(&absent, false).unwrap().default_device);
    assert!(fast_path_from(&absent, true).is_err());
}

#[test]
fn durations() {
    assert_eq!(parse_duration("0"), Some(Duration::ZERO));
    assert_eq!(parse_duration("250ms"), Some(Duration::from_millis(250)));
    assert_eq!(parse_duration("10s"), Some(Duration::from_secs(10)));
    assert_eq!(parse_duration("2m"), Some(Duration::from_secs(120)));
    assert_eq!(parse_duration("s"), None);
    assert_eq!(parse_duration("10"), None);
    assert_eq!(parse_duration("-1s"), None);
}

#[test]
fn missing_default_file_means_defaults_but_named_file_must_exist() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.toml");
    assert!(load_from(&missing, false).is_ok());
    let err = load_from(&missing, true).unwrap_err().to_string();
    assert!(err.contains("nope.toml"), "{err}");
}
