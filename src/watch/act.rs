//! The watcher's actions on one listed process: SIGKILL, and `terminate_client` on its
//! daemon first for an MPS client; each reaches only the process that was listed and
//! judged, never one that took its PID since.
//!
//! Invariants:
//! - a process is pinned (`pin`) as soon as its GPU is listed: a pidfd first, then its
//!   start time and cgroup read through its PID, kept only where the pidfd says that
//!   process still runs after the reads (so they are its own); the judgement uses them;
//! - before `terminate_client` and before the SIGKILL the start time and cgroup are read
//!   again the same way and compared: a process that ended is left alone (`Gone`, nothing
//!   sent), one that changed is reported and never signalled;
//! - the SIGKILL goes through the pidfd, which names one process for good;
//! - the OS calls go through `Os`, so that each of these cases is a unit test.

use std::collections::{HashMap, HashSet};
use std::os::fd::OwnedFd;
use std::rc::Rc;

use super::scan::{cgroup_of, Proc};

/// The OS calls an action makes; `Proc` is the host's.
pub(crate) trait Os {
    type Handle;
    /// `pidfd_open(pid)`.
    fn open(&mut self, pid: i32) -> std::io::Result<Self::Handle>;
    /// Whether the pidfd's process has ended (its PID may name another process now).
    fn ended(&mut self, handle: &Self::Handle) -> bool;
    /// `/proc/<pid>/stat`'s start time; `None` for no process or a zombie.
    fn start_time(&mut self, pid: i32) -> Option<u64>;
    /// The cgroup the watcher attributes processes by (`scan::cgroup_of`).
    fn cgroup(&mut self, pid: i32) -> Option<String>;
    /// SIGKILL through the pidfd.
    fn kill(&mut self, handle: &Self::Handle) -> std::io::Result<()>;
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum ActError {
    #[error("it could not be pinned when listed (pidfd_open)")]
    Unpinned(#[source] std::io::Error),
    #[error("it was listed as a zombie or without a start time")]
    NoStartTime,
    #[error("pid {pid} now names another process (start time {was}, now {now:?})")]
    Reused {
        pid: i32,
        was: u64,
        now: Option<u64>,
    },
    #[error("it left the cgroup it was judged in ({was:?}, now {now:?})")]
    Moved {
        was: Option<String>,
        now: Option<String>,
    },
    #[error("sigkill through its pidfd failed")]
    Kill(#[source] std::io::Error),
    #[error("it has no daemon")]
    NoDaemon,
    #[error("its daemon {daemon} did not answer earlier in this scan")]
    Silent { daemon: String },
    #[error("no record of its daemon {daemon}")]
    NoRecord { daemon: String },
    #[error("cannot find the MPS control binary")]
    Binary(#[source] anyhow::Error),
    #[error("its daemon {daemon} did not answer get_server_list")]
    ServerList {
        daemon: String,
        #[source]
        error: anyhow::Error,
    },
    #[error("its daemon {daemon} runs no server")]
    NoServer { daemon: String },
    #[error("its daemon {daemon} did not answer terminate_client")]
    Terminate {
        daemon: String,
        #[source]
        error: anyhow::Error,
    },
    #[error("its daemon {daemon} answered terminate_client with {answer}")]
    Refused { daemon: String, answer: String },
}

/// A listed process as it was when judged; `handle` is `None` where it ended before it
/// could be pinned (then `error` is `None`) or could not be pinned (`error` says why).
#[derive(Debug)]
pub(crate) struct Pinned<H> {
    pub handle: Option<H>,
    pub start_time: Option<u64>,
    pub cgroup: Option<String>,
    pub error: Option<std::io::Error>,
}

/// Pins listed process `pid` (see the module's invariants).
pub(crate) fn pin<O: Os>(os: &mut O, pid: i32) -> Pinned<O::Handle> {
    let gone = |error| Pinned {
        handle: None,
        start_time: None,
        cgroup: None,
        error,
    };
    let handle = match os.open(pid) {
        Ok(h) => h,
        Err(e) if e.raw_os_error() == Some(nix::libc::ESRCH) => return gone(None),
        Err(e) => {
            // No pidfd (out of descriptors): judged on what its PID shows now, never acted on.
            return Pinned {
                handle: None,
                start_time: os.start_time(pid),
                cgroup: os.cgroup(pid),
                error: Some(e),
            };
        }
    };
    let start_time = os.start_time(pid);
    let cgroup = os.cgroup(pid);
    if os.ended(&handle) {
        return gone(None);
    }
    Pinned {
        handle: Some(handle),
        start_time,
        cgroup,
        error: None,
    }
}

/// The processes pinned at the last scans, by PID: one listed again is not pinned again
/// while its pidfd says it still runs (its start time is that pidfd's for good), and its
/// cgroup is the one read when it was pinned (a process's cgroup is set before it execs,
/// so before it has a GPU context). Each pin is read again every `REPIN` scans (a process
/// moved by the host is seen within that), and at once where an action found it moved
/// (`forget`): a process that moves within its container is judged anew at the next scan.
pub(crate) struct Pins<H> {
    by_pid: HashMap<i32, Pin<H>>,
    listed: HashSet<i32>,
    scans: u64,
}

struct Pin<H> {
    handle: H,
    start_time: Option<u64>,
    cgroup: Option<String>,
}

/// How many scans a pin's reading serves, at most.
pub(crate) const REPIN: u64 = 16;

impl<H> Default for Pins<H> {
    fn default() -> Self {
        Pins {
            by_pid: HashMap::new(),
            listed: HashSet::new(),
            scans: 0,
        }
    }
}

impl<H: Clone> Pins<H> {
    /// Listed process `pid`, pinned.
    pub(crate) fn pin<O: Os<Handle = H>>(&mut self, os: &mut O, pid: i32) -> Pinned<H> {
        self.listed.insert(pid);
        // Spread over the scans, so that a thousand processes listed since the same scan
        // are not all read again in one.
        let due = (self.scans + u64::from(pid.unsigned_abs())) % REPIN == 0;
        if let Some(pin) = self.by_pid.get(&pid) {
            if !due && !os.ended(&pin.handle) {
                return Pinned {
                    handle: Some(pin.handle.clone()),
                    start_time: pin.start_time,
                    cgroup: pin.cgroup.clone(),
                    error: None,
                };
            }
            self.by_pid.remove(&pid);
        }
        let pinned = pin(os, pid);
        if let Some(h) = &pinned.handle {
            self.by_pid.insert(
                pid,
                Pin {
                    handle: h.clone(),
                    start_time: pinned.start_time,
                    cgroup: pinned.cgroup.clone(),
                },
            );
        }
        pinned
    }

    /// `pid` is pinned anew when next listed.
    pub(crate) fn forget(&mut self, pid: i32) {
        self.by_pid.remove(&pid);
    }

    /// Ends a scan: what it did not list is let go.
    pub(crate) fn end_scan(&mut self) {
        let listed = std::mem::take(&mut self.listed);
        self.by_pid.retain(|pid, _| listed.contains(pid));
        self.scans += 1;
    }
}

/// What an action came to.
#[derive(Debug)]
pub(crate) enum Outcome {
    /// SIGKILL sent; for an MPS client, `confirmed` says whether its daemon confirmed the
    /// `terminate_client` before it (always `true` for a process outside MPS).
    Killed { confirmed: bool },
    /// It ended before the SIGKILL (on its own, or through a confirmed
    /// `terminate_client`): nothing was sent.
    Gone { confirmed: bool },
    /// Nothing more was sent: it is not what was judged, or a step failed.
    Refused(ActError),
}

/// The pinned process, as it is now: `Ok(true)` the same, `Ok(false)` ended.
fn still<O: Os>(os: &mut O, pid: i32, pinned: &Pinned<O::Handle>) -> Result<bool, ActError> {
    let Some(handle) = &pinned.handle else {
        return match &pinned.error {
            Some(e) => Err(ActError::Unpinned(std::io::Error::from(e.kind()))),
            None => Ok(false),
        };
    };
    let Some(was) = pinned.start_time else {
        return Err(ActError::NoStartTime);
    };
    let now = os.start_time(pid);
    let cgroup = os.cgroup(pid);
    // Read through the PID: they are the pinned process's only if it still runs after.
    if os.ended(handle) {
        return Ok(false);
    }
    if now != Some(was) {
        return Err(ActError::Reused { pid, was, now });
    }
    if cgroup != pinned.cgroup {
        return Err(ActError::Moved {
            was: pinned.cgroup.clone(),
            now: cgroup,
        });
    }
    Ok(true)
}

/// Stops pinned process `pid`: for an MPS client (`terminate` given), `terminate_client`
/// first; then SIGKILL. Each step only while it is still the process judged.
pub(crate) fn stop<O: Os>(
    os: &mut O,
    pid: i32,
    pinned: &Pinned<O::Handle>,
    terminate: Option<&mut dyn FnMut(i32) -> Result<(), ActError>>,
) -> Outcome {
    match still(os, pid, pinned) {
        Ok(true) => {}
        Ok(false) => return Outcome::Gone { confirmed: false },
        Err(e) => return Outcome::Refused(e),
    }
    let mut confirmed = true;
    if let Some(terminate) = terminate {
        confirmed = terminate(pid).is_ok();
        match still(os, pid, pinned) {
            Ok(true) => {}
            Ok(false) => return Outcome::Gone { confirmed },
            Err(e) => return Outcome::Refused(e),
        }
    }
    let Some(handle) = &pinned.handle else {
        return Outcome::Gone { confirmed };
    };
    match os.kill(handle) {
        Ok(()) => Outcome::Killed { confirmed },
        Err(e) if e.raw_os_error() == Some(nix::libc::ESRCH) => Outcome::Gone { confirmed },
        Err(e) => Outcome::Refused(ActError::Kill(e)),
    }
}

impl Os for Proc {
    type Handle = Rc<OwnedFd>;

    fn open(&mut self, pid: i32) -> std::io::Result<Rc<OwnedFd>> {
        Proc::pidfd(pid).map(Rc::new)
    }

    fn ended(&mut self, handle: &Rc<OwnedFd>) -> bool {
        Proc::has_ended(handle)
    }

    fn start_time(&mut self, pid: i32) -> Option<u64> {
        crate::util::proc_start_time(pid)
    }

    fn cgroup(&mut self, pid: i32) -> Option<String> {
        cgroup_of(pid)
    }

    fn kill(&mut self, handle: &Rc<OwnedFd>) -> std::io::Result<()> {
        use rustix::process::{pidfd_send_signal, Signal};
        Ok(pidfd_send_signal(handle, Signal::KILL)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One process as the fake OS shows it, and what was done to it.
    #[derive(Default)]
    struct Fake {
        /// Whether the pinned process has ended (its PID free or taken by another).
        ended: bool,
        /// What /proc/<pid> shows: the start time and cgroup.
        start_time: Option<u64>,
        cgroup: Option<String>,
        /// What /proc/<pid> shows after `terminate_client` (a PID reused meanwhile).
        after_terminate: Option<(Option<u64>, Option<String>, bool)>,
        calls: Vec<&'static str>,
    }

    impl Os for Fake {
        type Handle = ();
        fn open(&mut self, _: i32) -> std::io::Result<()> {
            self.calls.push("open");
            if self.ended {
                Err(std::io::Error::from_raw_os_error(nix::libc::ESRCH))
            } else {
                Ok(())
            }
        }
        fn ended(&mut self, _: &()) -> bool {
            self.ended
        }
        fn start_time(&mut self, _: i32) -> Option<u64> {
            self.start_time
        }
        fn cgroup(&mut self, _: i32) -> Option<String> {
            self.cgroup.clone()
        }
        fn kill(&mut self, _: &()) -> std::io::Result<()> {
            self.calls.push("kill");
            Ok(())
        }
    }

    fn pinned(start_time: u64, cgroup: &str) -> Pinned<()> {
        Pinned {
            handle: Some(()),
            start_time: Some(start_time),
            cgroup: Some(cgroup.to_owned()),
            error: None,
        }
    }

    fn now(start_time: u64, cgroup: &str, ended: bool) -> Fake {
        Fake {
            ended,
            start_time: Some(start_time),
            cgroup: Some(cgroup.to_owned()),
            ..Fake::default()
        }
    }

    /// Runs `stop` on `fake`, as an MPS client where `client`; returns the outcome's
    /// name and every call made (OS and terminate_client), in order.
    fn run(mut fake: Fake, p: &Pinned<()>, client: bool) -> (String, Vec<&'static str>) {
        let after = fake.after_terminate.take();
        let calls = std::cell::RefCell::new(Vec::new());
        let outcome = {
            let fake_ref = std::cell::RefCell::new(&mut fake);
            let mut terminate = |_pid: i32| -> Result<(), ActError> {
                calls.borrow_mut().push("terminate_client");
                if let Some((s, c, e)) = after.clone() {
                    let mut f = fake_ref.borrow_mut();
                    f.start_time = s;
                    f.cgroup = c;
                    f.ended = e;
                }
                Ok(())
            };
            // The closure and the OS share the fake: terminate_client changes what the OS shows.
            let mut os = Shared(&fake_ref);
            stop(
                &mut os,
                42,
                p,
                client.then_some(&mut terminate as &mut dyn FnMut(i32) -> Result<(), ActError>),
            )
        };
        let mut all = calls.into_inner();
        all.extend(fake.calls.iter().filter(|c| **c == "kill"));
        let name = match outcome {
            Outcome::Killed { confirmed } => format!("killed confirmed={confirmed}"),
            Outcome::Gone { confirmed } => format!("gone confirmed={confirmed}"),
            Outcome::Refused(e) => format!("refused: {e}"),
        };
        (name, all)
    }

    struct Shared<'a, 'b>(&'a std::cell::RefCell<&'b mut Fake>);

    impl Os for Shared<'_, '_> {
        type Handle = ();
        fn open(&mut self, pid: i32) -> std::io::Result<()> {
            self.0.borrow_mut().open(pid)
        }
        fn ended(&mut self, h: &()) -> bool {
            self.0.borrow_mut().ended(h)
        }
        fn start_time(&mut self, pid: i32) -> Option<u64> {
            self.0.borrow_mut().start_time(pid)
        }
        fn cgroup(&mut self, pid: i32) -> Option<String> {
            self.0.borrow_mut().cgroup(pid)
        }
        fn kill(&mut self, h: &()) -> std::io::Result<()> {
            self.0.borrow_mut().kill(h)
        }
    }

    #[test]
    fn an_action_reaches_only_the_process_that_was_listed_and_judged() {
        let judged = pinned(100, "/k/pod/a");
        let cases: Vec<(&str, Fake, bool, &str, Vec<&str>)> = vec![
            (
                "the same process",
                now(100, "/k/pod/a", false),
                false,
                "killed confirmed=true",
                vec!["kill"],
            ),
            (
                "its PID taken by another process",
                now(200, "/k/pod/a", false),
                false,
                "refused: pid 42 now names another process (start time 100, now Some(200))",
                vec![],
            ),
            (
                "moved to another cgroup",
                now(100, "/k/pod/b", false),
                false,
                "refused: it left the cgroup it was judged in (Some(\"/k/pod/a\"), now Some(\"/k/pod/b\"))",
                vec![],
            ),
            (
                "ended (its PID may be another's)",
                now(200, "/k/pod/b", true),
                false,
                "gone confirmed=false",
                vec![],
            ),
            (
                "an MPS client, the same process",
                now(100, "/k/pod/a", false),
                true,
                "killed confirmed=true",
                vec!["terminate_client", "kill"],
            ),
            (
                "an MPS client whose PID is taken before terminate_client",
                now(200, "/k/pod/b", false),
                true,
                "refused: pid 42 now names another process (start time 100, now Some(200))",
                vec![],
            ),
            (
                "an MPS client whose PID is taken after terminate_client",
                Fake {
                    after_terminate: Some((Some(300), Some("/k/pod/b".into()), false)),
                    ..now(100, "/k/pod/a", false)
                },
                true,
                "refused: pid 42 now names another process (start time 100, now Some(300))",
                vec!["terminate_client"],
            ),
            (
                "an MPS client that terminate_client ended",
                Fake {
                    after_terminate: Some((None, None, true)),
                    ..now(100, "/k/pod/a", false)
                },
                true,
                "gone confirmed=true",
                vec!["terminate_client"],
            ),
        ];
        for (what, fake, client, want, calls) in cases {
            let (got, made) = run(fake, &judged, client);
            assert_eq!((got.as_str(), made), (want, calls), "{what}");
        }
    }

    #[test]
    fn a_process_is_pinned_only_where_it_still_runs_after_its_reads() {
        // Listed and still running: pinned with what /proc shows.
        let mut fake = now(100, "/k/pod/a", false);
        let p = pin(&mut fake, 42);
        assert!(p.handle.is_some());
        assert_eq!(
            (p.start_time, p.cgroup.as_deref()),
            (Some(100), Some("/k/pod/a"))
        );
        // Ended before the pidfd: nothing pinned, nothing read.
        let mut fake = now(100, "/k/pod/a", true);
        let p = pin(&mut fake, 42);
        assert!(p.handle.is_none() && p.start_time.is_none() && p.error.is_none());
        assert_eq!(fake.calls, ["open"]);
        let (got, made) = run(now(100, "/k/pod/a", false), &p, false);
        assert_eq!((got.as_str(), made), ("gone confirmed=false", vec![]));
        // Ended after the pidfd, before its reads were confirmed: what was read may be the
        // next process's, so nothing is kept.
        struct EndsAfterOpen(Fake);
        impl Os for EndsAfterOpen {
            type Handle = ();
            fn open(&mut self, pid: i32) -> std::io::Result<()> {
                let r = self.0.open(pid);
                self.0.ended = true;
                r
            }
            fn ended(&mut self, h: &()) -> bool {
                self.0.ended(h)
            }
            fn start_time(&mut self, pid: i32) -> Option<u64> {
                self.0.start_time(pid)
            }
            fn cgroup(&mut self, pid: i32) -> Option<String> {
                self.0.cgroup(pid)
            }
            fn kill(&mut self, h: &()) -> std::io::Result<()> {
                self.0.kill(h)
            }
        }
        let p = pin(&mut EndsAfterOpen(now(200, "/k/pod/b", false)), 42);
        assert!(p.handle.is_none() && p.cgroup.is_none());
        // No pidfd to be had: judged on its PID, never acted on.
        let p: Pinned<()> = Pinned {
            handle: None,
            start_time: Some(100),
            cgroup: Some("/k/pod/a".into()),
            error: Some(std::io::Error::from_raw_os_error(nix::libc::EMFILE)),
        };
        let (got, made) = run(now(100, "/k/pod/a", false), &p, true);
        assert_eq!(
            (got.as_str(), made),
            (
                "refused: it could not be pinned when listed (pidfd_open)",
                vec![]
            )
        );
    }

    /// Counts the reads of /proc a pin makes.
    struct Counting(Fake, usize);

    impl Os for Counting {
        type Handle = ();
        fn open(&mut self, pid: i32) -> std::io::Result<()> {
            self.0.open(pid)
        }
        fn ended(&mut self, h: &()) -> bool {
            self.0.ended(h)
        }
        fn start_time(&mut self, pid: i32) -> Option<u64> {
            self.1 += 1;
            self.0.start_time(pid)
        }
        fn cgroup(&mut self, pid: i32) -> Option<String> {
            self.1 += 1;
            self.0.cgroup(pid)
        }
        fn kill(&mut self, h: &()) -> std::io::Result<()> {
            self.0.kill(h)
        }
    }

    #[test]
    fn a_pin_is_kept_while_its_process_runs_and_read_again_every_repin_scans() {
        let mut pins = Pins::default();
        let mut os = Counting(now(100, "/k/pod/a", false), 0);
        // pid 1: due when (scans + 1) % REPIN == 0.
        let first = pins.pin(&mut os, 1);
        assert_eq!((first.start_time, os.1), (Some(100), 2));
        pins.end_scan();
        // Listed again: nothing read, what was pinned is what is judged.
        os.0.cgroup = Some("/k/pod/b".into());
        let again = pins.pin(&mut os, 1);
        assert_eq!((again.cgroup.as_deref(), os.1), (Some("/k/pod/a"), 2));
        pins.end_scan();
        // Forgotten (an action found it moved): read again.
        pins.forget(1);
        let moved = pins.pin(&mut os, 1);
        assert_eq!((moved.cgroup.as_deref(), os.1), (Some("/k/pod/b"), 4));
        pins.end_scan();
        // Within REPIN scans of the last read, it is read again once.
        let reads = os.1;
        for _ in 0..REPIN {
            pins.pin(&mut os, 1);
            pins.end_scan();
        }
        assert_eq!(os.1, reads + 2);
        // Not listed in a scan: let go; listed again, pinned anew.
        pins.end_scan();
        let reads = os.1;
        pins.pin(&mut os, 1);
        assert_eq!(os.1, reads + 2);
        // Ended: pinned anew (here: gone, nothing kept).
        pins.end_scan();
        os.0.ended = true;
        let gone = pins.pin(&mut os, 1);
        assert!(gone.handle.is_none());
    }

    /// The host's pidfd: a child that runs is pinned with its start time and cgroup, and
    /// killed through the pidfd; once reaped, it is gone for `still`.
    #[test]
    fn the_hosts_pidfd_pins_and_kills_a_real_child() {
        let mut child = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        let pid = child.id() as i32;
        let p = pin(&mut Proc, pid);
        assert!(p.handle.is_some() && p.start_time.is_some(), "{p:?}");
        assert_eq!(p.cgroup, crate::watch::scan::cgroup_of(pid));
        assert!(matches!(
            stop(&mut Proc, pid, &p, None),
            Outcome::Killed { confirmed: true }
        ));
        child.wait().unwrap();
        assert!(matches!(
            stop(&mut Proc, pid, &p, None),
            Outcome::Gone { confirmed: false }
        ));
    }
}
