//! What starts for a daemon outside the create: its supervisor or its reaper, as one exact
//! command. The node's agent (`agent`) and the hook's own fallback (`launch`) both start
//! it from here, so the two cannot drift apart, and neither module needs the other for it.
//!
//! Invariants: the process is `gpushare daemon <supervise|reap> --id <id>` with stdio on
//! /dev/null, an explicit environment (PATH, the config's path, GPUSHARE_LOG), `/` as its
//! directory and no inherited fds (it closes them: `supervisor::detach`); nothing of the
//! caller's but the job, the id and the config's path reaches it.

use std::path::Path;
use std::process::{Command, Stdio};

use super::control::SAFE_PATH;

/// What a started process does: `gpushare daemon supervise` or `gpushare daemon reap`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Job {
    Supervise,
    Reap,
}

impl Job {
    pub(crate) fn word(self) -> &'static str {
        match self {
            Job::Supervise => "supervise",
            Job::Reap => "reap",
        }
    }

    pub(crate) fn from_word(word: &str) -> Option<Job> {
        match word {
            "supervise" => Some(Job::Supervise),
            "reap" => Some(Job::Reap),
            _ => None,
        }
    }
}

/// The command that runs `job` for daemon `id` with `gpushare` (the binary at `exe`),
/// reading the config at `config` (`None`: the default place).
pub(crate) fn command(exe: &Path, config: Option<&Path>, job: Job, id: &str) -> Command {
    let mut cmd = Command::new(exe);
    cmd.args(["daemon", job.word(), "--id", id])
        .env_clear()
        .env("PATH", SAFE_PATH)
        .current_dir("/")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    if let Some(path) = config {
        cmd.env(crate::config::ENV_VAR, path);
    }
    if let Some(level) = std::env::var_os("GPUSHARE_LOG") {
        cmd.env("GPUSHARE_LOG", level);
    }
    cmd
}
