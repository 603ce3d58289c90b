//! Processes of the GPU tier: a command under a deadline (coreutils `timeout -k`'s
//! semantics: SIGTERM at the deadline, SIGKILL after a grace, exit status 124, or 137 when
//! it had to be killed), a client run as a numeric UID in a mount namespace of its own with
//! the daemon's shm over /dev/shm, and the search for any process of this run still alive.
//!
//! Invariants: output goes to files, never to a pipe (a daemon that keeps a descriptor open
//! must not hang the tier); every wait has a deadline; a process is signalled only while
//! its parent here has not reaped it (its pid cannot have been reused), or, for the
//! leftover search, only when it still names this run's work directory.

use std::ffi::{CString, OsString};
use std::io::{Read, Seek, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use crate::calc::epoch_now;

/// The PATH of everything the tier starts with a cleared environment.
pub const SAFE_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// What a command did: its exit status (`timeout`'s 124/137 past the deadline, 127 when it
/// could not be started, 128 + n when signal n ended it) and its output, stdout and stderr
/// together.
#[derive(Debug, Clone)]
pub struct Ran {
    pub code: i32,
    pub out: String,
}

impl Ran {
    pub fn ok(&self) -> bool {
        self.code == 0
    }
}

enum Msg {
    Done,
    Abort,
}

#[derive(Default)]
struct Fate {
    timed_out: AtomicBool,
    killed: AtomicBool,
}

impl Fate {
    fn code(&self, status: std::io::Result<ExitStatus>) -> i32 {
        if self.killed.load(Ordering::SeqCst) {
            137
        } else if self.timed_out.load(Ordering::SeqCst) {
            124
        } else {
            match status {
                Ok(s) => s.code().unwrap_or_else(|| 128 + s.signal().unwrap_or(0)),
                Err(_) => 127,
            }
        }
    }
}

/// Signals `pid` at `limit` (or at once on `Msg::Abort`), kills it `grace` later, unless
/// told `Msg::Done` first. The caller reaps the child only after sending `Done` or seeing
/// the watchdog end, so the pid is still the child's whenever it is signalled.
fn watchdog(
    pid: Pid,
    limit: Duration,
    grace: Duration,
    fate: Arc<Fate>,
) -> (Sender<Msg>, JoinHandle<()>) {
    let (tx, rx) = channel::<Msg>();
    let dog = std::thread::spawn(move || {
        match rx.recv_timeout(limit) {
            Ok(Msg::Done) | Err(RecvTimeoutError::Disconnected) => return,
            Ok(Msg::Abort) | Err(RecvTimeoutError::Timeout) => {}
        }
        fate.timed_out.store(true, Ordering::SeqCst);
        let _ = kill(pid, Signal::SIGTERM);
        loop {
            match rx.recv_timeout(grace) {
                Ok(Msg::Done) | Err(RecvTimeoutError::Disconnected) => return,
                Ok(Msg::Abort) => continue,
                Err(RecvTimeoutError::Timeout) => {
                    fate.killed.store(true, Ordering::SeqCst);
                    let _ = kill(pid, Signal::SIGKILL);
                    return;
                }
            }
        }
    });
    (tx, dog)
}

/// Waits for `child` without reaping it (`waitid` with `WNOWAIT`), so that the watchdog may
/// still signal its pid; the caller reaps it after the watchdog has ended.
fn wait_unreaped(child: &Child) {
    use nix::sys::wait::{waitid, Id, WaitPidFlag};
    let pid = Pid::from_raw(child.id() as i32);
    loop {
        match waitid(Id::Pid(pid), WaitPidFlag::WEXITED | WaitPidFlag::WNOWAIT) {
            Err(nix::errno::Errno::EINTR) => continue,
            _ => return,
        }
    }
}

/// Runs `cmd` to its end or its deadline; stdin gets `input` (then EOF) or /dev/null.
/// `nvidia-smi <query> --format=csv,noheader` (30 s at the most).
pub fn nvidia_smi(query: &str) -> Ran {
    run(
        Command::new("nvidia-smi").args([query, "--format=csv,noheader"]),
        None,
        Duration::from_secs(30),
        Duration::from_secs(5),
    )
}

pub fn run(cmd: &mut Command, input: Option<&str>, limit: Duration, grace: Duration) -> Ran {
    let program = cmd.get_program().to_string_lossy().into_owned();
    let file = match tempfile::tempfile() {
        Ok(f) => f,
        Err(e) => {
            return Ran {
                code: 127,
                out: format!("no temp file for the output of {program}: {e}"),
            }
        }
    };
    let (Ok(out), Ok(err)) = (file.try_clone(), file.try_clone()) else {
        return Ran {
            code: 127,
            out: format!("cannot share the output file of {program}"),
        };
    };
    cmd.stdout(out).stderr(err).stdin(if input.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    });
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            return Ran {
                code: 127,
                out: format!("cannot run {program}: {e}"),
            }
        }
    };
    let fate = Arc::new(Fate::default());
    let (tx, dog) = watchdog(Pid::from_raw(child.id() as i32), limit, grace, fate.clone());
    if let (Some(text), Some(mut stdin)) = (input, child.stdin.take()) {
        // A command that exits without reading gets EPIPE here: not an error of ours.
        let _ = stdin.write_all(text.as_bytes());
    }
    wait_unreaped(&child);
    let _ = tx.send(Msg::Done);
    let _ = dog.join();
    let code = fate.code(child.wait());
    let mut file = file;
    let mut bytes = Vec::new();
    let _ = file.rewind();
    let _ = file.read_to_end(&mut bytes);
    Ran {
        code,
        out: String::from_utf8_lossy(&bytes).into_owned(),
    }
}

/// How a client runs: as `uid` (gid the same, no supplementary groups) with only `env`, in
/// `cwd`, its stdout and stderr to files; with `shm`, in a mount namespace of its own (a
/// slave of the host's) with `shm` bound over /dev/shm — what gpushare-runtime gives a
/// container in `ipc = "isolated"`. Round 4 (E1) adds a private /dev/shm and hidden
/// device nodes.
pub struct ClientSpec {
    pub uid: u32,
    pub shm: Option<PathBuf>,
    /// Also in a mount namespace of its own: a fresh tmpfs on /dev/shm (over `shm`'s bind,
    /// if any) and /dev/null bound over each of these files (the GPU's device nodes).
    pub private_shm: bool,
    pub hide: Vec<PathBuf>,
    pub env: Vec<(String, String)>,
    pub argv: Vec<OsString>,
    pub cwd: PathBuf,
    pub out: PathBuf,
    pub err: PathBuf,
    pub limit: Duration,
}

/// A client started by [`launch`]: a thread waits for it and notes its exit.
pub struct Running {
    pub pid: Option<i32>,
    pub t_launch: f64,
    done: Arc<Mutex<Option<(i32, f64)>>>,
    abort: Option<Sender<Msg>>,
    thread: Option<JoinHandle<()>>,
}

impl Running {
    /// Exit status and exit time, once it has exited.
    pub fn done(&self) -> Option<(i32, f64)> {
        *self.done.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Ends it now as its deadline would: SIGTERM, SIGKILL 5 s later.
    pub fn abort(&self) {
        if let Some(tx) = &self.abort {
            let _ = tx.send(Msg::Abort);
        }
    }

    pub fn join(&mut self) {
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

pub fn launch(spec: ClientSpec) -> Running {
    let t_launch = epoch_now();
    let done = Arc::new(Mutex::new(None));
    let failed = |why: String| {
        let _ = std::fs::write(&spec.err, format!("{why}\n"));
        *done.lock().unwrap_or_else(|e| e.into_inner()) = Some((127, epoch_now()));
        Running {
            pid: None,
            t_launch,
            done: done.clone(),
            abort: None,
            thread: None,
        }
    };
    let (Ok(out), Ok(err)) = (
        std::fs::File::create(&spec.out),
        std::fs::File::create(&spec.err),
    ) else {
        return failed(format!("cannot create {}", spec.out.display()));
    };
    let Some((program, args)) = spec.argv.split_first() else {
        return failed("no command".to_owned());
    };
    let shm = match spec
        .shm
        .as_deref()
        .map(|p| CString::new(p.as_os_str().as_bytes()))
    {
        Some(Ok(c)) => Some(c),
        Some(Err(_)) => return failed("shm path with a NUL byte".to_owned()),
        None => None,
    };
    let Ok(hide) = spec
        .hide
        .iter()
        .map(|p| CString::new(p.as_os_str().as_bytes()))
        .collect::<Result<Vec<CString>, _>>()
    else {
        return failed("a hidden path with a NUL byte".to_owned());
    };
    let private_shm = spec.private_shm;
    let own_ns = shm.is_some() || private_shm || !hide.is_empty();
    let mut cmd = Command::new(program);
    cmd.args(args)
        .env_clear()
        .envs(spec.env.iter().map(|(k, v)| (k, v)))
        .current_dir(&spec.cwd)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err);
    let (uid, gid) = (
        nix::unistd::Uid::from_raw(spec.uid),
        nix::unistd::Gid::from_raw(spec.uid),
    );
    // SAFETY: only system calls between fork and exec (the paths were made C strings
    // before the fork), as pre_exec requires of a multi-threaded parent.
    unsafe {
        cmd.pre_exec(move || {
            use nix::mount::{mount, MsFlags};
            if own_ns {
                nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS)?;
                mount(
                    None::<&std::ffi::CStr>,
                    c"/",
                    None::<&std::ffi::CStr>,
                    MsFlags::MS_REC | MsFlags::MS_SLAVE,
                    None::<&std::ffi::CStr>,
                )?;
            }
            if let Some(shm) = &shm {
                mount(
                    Some(shm.as_c_str()),
                    c"/dev/shm",
                    None::<&std::ffi::CStr>,
                    MsFlags::MS_BIND,
                    None::<&std::ffi::CStr>,
                )?;
            }
            if private_shm {
                mount(
                    Some(c"tmpfs"),
                    c"/dev/shm",
                    Some(c"tmpfs"),
                    MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
                    Some(c"mode=1777,size=256m"),
                )?;
            }
            for node in &hide {
                mount(
                    Some(c"/dev/null"),
                    node.as_c_str(),
                    None::<&std::ffi::CStr>,
                    MsFlags::MS_BIND,
                    None::<&std::ffi::CStr>,
                )?;
            }
            nix::unistd::setgroups(&[])?;
            nix::unistd::setresgid(gid, gid, gid)?;
            nix::unistd::setresuid(uid, uid, uid)?;
            Ok(())
        });
    }
    let child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => return failed(format!("cannot run {}: {e}", program.to_string_lossy())),
    };
    let pid = child.id() as i32;
    let fate = Arc::new(Fate::default());
    let (tx, dog) = watchdog(
        Pid::from_raw(pid),
        spec.limit,
        Duration::from_secs(5),
        fate.clone(),
    );
    let abort = tx.clone();
    let noted = done.clone();
    let thread = std::thread::spawn(move || {
        let mut child = child;
        wait_unreaped(&child);
        let t_exit = epoch_now();
        let _ = tx.send(Msg::Done);
        let _ = dog.join();
        let code = fate.code(child.wait());
        *noted.lock().unwrap_or_else(|e| e.into_inner()) = Some((code, t_exit));
    });
    Running {
        pid: Some(pid),
        t_launch,
        done,
        abort: Some(abort),
        thread: Some(thread),
    }
}

/// `pid` is alive (not a zombie) and names `marker` (this run's work directory) in its
/// environment or its command line: a process of this run.
pub fn alive_ours(pid: i32, marker: &str) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    let state = stat.rsplit_once(") ").map(|(_, rest)| rest.chars().next());
    if state == Some(Some('Z')) {
        return false;
    }
    let names = |what: &str| {
        std::fs::read(format!("/proc/{pid}/{what}"))
            .is_ok_and(|b| b.windows(marker.len()).any(|w| w == marker.as_bytes()))
    };
    !marker.is_empty() && (names("environ") || names("cmdline"))
}

/// Processes of this run still alive (found by `marker` in their environment or argv).
pub fn leftover_pids(marker: &str) -> Vec<i32> {
    let me = std::process::id() as i32;
    let mut pids: Vec<i32> = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&p| p != me && alive_ours(p, marker))
        .collect();
    pids.sort_unstable();
    pids
}

/// A process's command line, spaces between the arguments.
pub fn cmdline(pid: i32) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
        .unwrap_or_default()
}

pub fn signal(pid: i32, sig: Signal) {
    let _ = kill(Pid::from_raw(pid), sig);
}

/// Makes `dir` (and its parents) with `mode`.
pub fn mkdir(dir: &Path, mode: u32) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(mode)
        .create(dir)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode))
}
