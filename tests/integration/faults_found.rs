//! What the fault tier (tests/faults/, issue 15) found, one regression test each: the
//! instant a timer's SIGKILL hit, reproduced here on purpose (a low-level runtime that
//! kills itself, a supervisor held stopped before it names itself, a zombie supervisor).

use std::path::Path;
use std::time::Duration;

use crate::harness::*;

/// Replaces the config's `low-level-runtime` line.
fn set_low_level_runtime(env: &Env, runtime: &Path) {
    let text = std::fs::read_to_string(&env.config).unwrap();
    let line = text
        .lines()
        .find(|l| l.starts_with("low-level-runtime"))
        .unwrap()
        .to_owned();
    let new = format!("low-level-runtime = [{:?}]", runtime.display().to_string());
    std::fs::write(&env.config, text.replace(&line, &new)).unwrap();
}

#[test]
fn a_shim_killed_before_runc_create_returned_leaves_no_record_that_keeps_its_daemon() {
    // Before: the shim's pending record (no pid yet) counted as a container for
    // pending-grace (2 x start-timeout + 30 s, 50 s here) whatever became of the shim, so
    // the daemon could not idle out and gc kept the record (and restarted a daemon whose
    // supervisor was gone "for" it).
    let env = Env::with_config("idle-timeout = \"1s\"");
    let holder = env
        .container("holder")
        .uid(1000)
        .device("0")
        .sh("sleep 1000")
        .create();
    holder.start();
    let id = env.daemon_of(&holder);
    // The shim execs a low-level runtime that is SIGKILLed at once: the instant between
    // the shim's pending record and the createRuntime hook's record.
    let killed_runc = env.path().join("killed-runc");
    std::fs::write(&killed_runc, "#!/bin/sh\nkill -KILL $$\n").unwrap();
    std::fs::set_permissions(
        &killed_runc,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let real_runc = which("runc").unwrap();
    set_low_level_runtime(&env, &killed_runc);
    let doomed = env.container("doomed").uid(1000).device("0").bundle();
    assert!(!doomed.try_create().status.success());
    set_low_level_runtime(&env, &real_runc);
    let pending = env
        .state
        .join("mps")
        .join(&id)
        .join("containers/doomed.json");
    assert!(pending.exists(), "the shim's pending record is there");
    holder.delete();
    // gc takes the record of a gone shim for stale at once...
    let out = env.cmd(GPUSHARE).arg("gc").output().unwrap();
    assert!(out.status.success(), "gc: {}", text(&out));
    assert!(
        !pending.exists(),
        "gc kept the dead shim's record: {}",
        text(&out)
    );
    // ...and the daemon, used by nobody, idles out (1 s) instead of living 50 s more.
    assert!(
        wait_until(Duration::from_secs(10), || !env
            .state
            .join("mps")
            .join(&id)
            .exists()),
        "daemon {id} still there: {:?}",
        env.daemon_ids()
    );
}
