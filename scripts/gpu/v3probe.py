#!/usr/bin/env python3
"""Raw probes of MPS v3's control interface (`nvidia-cuda-mps-control -p 3 ...`) on a driver
>= 615, for the GPU tier's section r5-v3 (tests/gpu/round5.rs; docs/gpu-validation.md
"Round 5"). gpushare has no v3 backend: this only asks the driver the open questions that
section lists (O1-O9, O13-O15) and prints what it answered.

  v3probe.py --work DIR --driver VERSION --uuid GPU-UUID --python PY --workload WORKLOAD.py
             --jsonl FILE [--control BIN] [--budget S] [--simulate]

Run as root. Every probe prints the command (with the UID and pipe directory it ran as), its
reply, exit code and time, bounded by a timeout, and appends one JSON line to --jsonl. A
driver below 615 (or --simulate) prints one SKIP line and nothing runs. The clients are
scripts/gpu/workload.py as UIDs 1000 and 2000 (probe, alloc, matmul, fault).

Invariants: compute mode and MIG mode are never set (the EXCLUSIVE_PROCESS halves of O3 and
O7 are SKIP); every daemon, client, mount and cgroup this starts or makes lives under --work
or is named in its own records and is ended, unmounted or removed before it exits, whatever
failed; the whole run stops starting probes after --budget seconds. Exit 0 when it ran to its
end (a probe's failure is a reading, not an error), 2 on a usage or setup error, 130 when
SIGTERM or SIGINT cut it short (after its cleanup).
"""

import argparse
import ctypes
import json
import os
import signal
import subprocess
import sys
import time

UA, UB = 1000, 2000
LIBC = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNS = 0x00020000
MS_REC, MS_PRIVATE = 0x4000, 0x40000
SAFE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class Probe:
    def __init__(self, a):
        self.a = a
        self.t0 = time.time()
        self.work = os.path.abspath(a.work)
        self.pipe = os.path.join(self.work, "p")
        self.log = os.path.join(self.work, "l")
        self.daemon = None
        self.clients = {}
        self.mounts = []
        self.cgroups = []
        self.out = open(a.jsonl, "a", encoding="utf-8")

    # ------------------------------------------------------------------ output

    def record(self, obj):
        obj.setdefault("t", round(time.time(), 3))
        self.out.write(json.dumps(obj, sort_keys=True) + "\n")
        self.out.flush()

    def say(self, text):
        sys.stdout.write(text + "\n")
        sys.stdout.flush()

    def reading(self, probe, status, what, evidence):
        """One verdict line: INFO (a reading), SKIP (cannot run here) or FAIL (a step failed)."""
        self.say("%-4s  %-5s %s: %s" % (status, probe, what, evidence))
        self.record({"event": "v3_reading", "probe": probe, "status": status, "what": what,
                     "evidence": evidence})

    def left(self):
        return self.a.budget - (time.time() - self.t0)

    # ------------------------------------------------------------------ commands

    def run(self, probe, argv, uid=0, env=None, timeout=15.0, stdin=None, show=None):
        """Runs argv (as uid), prints command, reply, exit code and time; returns (rc, out)."""
        e = {"PATH": SAFE_PATH}
        e.update(env or {})
        started = time.time()
        try:
            p = subprocess.run(argv, input=stdin, env=e, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, timeout=timeout, text=True,
                               preexec_fn=as_user(uid) if uid else None)
            rc, out = p.returncode, p.stdout
        except subprocess.TimeoutExpired as x:
            rc, out = 124, "(timed out after %.0f s) %s" % (timeout, to_text(x.stdout))
        except OSError as x:
            rc, out = 127, "%s: %s" % (argv[0], x)
        ms = (time.time() - started) * 1000.0
        shown = show or " ".join(argv)
        pipe = e.get("CUDA_MPS_PIPE_DIRECTORY")
        self.say("$ [uid %d%s] %s" % (uid, ", pipe " + pipe if pipe else "", shown))
        self.say("  -> rc %d in %.0f ms: %s" % (rc, ms, one_line(out, 400) or "(nothing)"))
        self.record({"event": "v3_cli", "probe": probe, "uid": uid, "pipe": pipe,
                     "argv": argv, "stdin": stdin, "rc": rc, "ms": round(ms, 1), "out": out})
        return rc, out

    def ctl(self, probe, args, uid=0, pipe=None, timeout=15.0):
        """`nvidia-cuda-mps-control -p 3 ARGS` against pipe (default: the daemon's)."""
        pipe = pipe or self.pipe
        return self.run(probe, [self.a.control, "-p", "3"] + args, uid=uid,
                        env={"CUDA_MPS_PIPE_DIRECTORY": pipe}, timeout=timeout)

    # ------------------------------------------------------------------ the daemon

    def start_daemon(self, probe):
        """`-p 3 -m -f` as root in the private pipe directory; ready once `control` exists."""
        for d in (self.pipe, self.log):
            os.makedirs(d, mode=0o755, exist_ok=True)
            os.chmod(d, 0o755)
        env = {"PATH": SAFE_PATH, "CUDA_MPS_PIPE_DIRECTORY": self.pipe,
               "CUDA_MPS_LOG_DIRECTORY": self.log}
        argv = [self.a.control, "-p", "3", "-m", "-f"]
        out = open(os.path.join(self.work, "daemon.out"), "ab")
        started = time.time()
        self.daemon = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=out,
                                       stderr=subprocess.STDOUT, env=env)
        ready = wait(15.0, lambda: os.path.exists(os.path.join(self.pipe, "control"))
                     or self.daemon.poll() is not None)
        ok = ready and self.daemon.poll() is None
        text = read(os.path.join(self.work, "daemon.out"))
        self.say("$ [uid 0, pipe %s] %s &" % (self.pipe, " ".join(argv)))
        self.say("  -> %s after %.0f ms: %s" % (
            "control socket up" if ok else "NOT up (rc %s)" % self.daemon.poll(),
            (time.time() - started) * 1000.0, one_line(text, 300) or "(nothing)"))
        self.record({"event": "v3_daemon_start", "probe": probe, "argv": argv, "ok": ok,
                     "pid": self.daemon.pid, "out": text})
        return ok

    def stop_daemon(self, probe):
        """`-q`, then `quit` on its stdin, then SIGKILL; then any server it left."""
        if self.daemon is None:
            return
        if self.daemon.poll() is None:
            self.ctl(probe, ["-q"], timeout=15.0)
        if self.daemon.poll() is None:
            try:
                self.daemon.stdin.write(b"quit\n")
                self.daemon.stdin.flush()
            except OSError:
                pass
            wait(10.0, lambda: self.daemon.poll() is not None)
        if self.daemon.poll() is None:
            self.daemon.kill()
        self.daemon.wait()
        self.record({"event": "v3_daemon_stop", "probe": probe, "rc": self.daemon.returncode})
        self.daemon = None
        self.kill_marked(["nvidia-cuda-mps-server"])

    def kill_marked(self, names=None):
        """SIGKILLs every process whose environment or argv names the work directory
        (optionally: only those whose argv[0] ends with one of names)."""
        mark = self.work.encode()
        for pid in pids_marked(mark):
            if names and not any(cmd0(pid).endswith(n) for n in names):
                continue
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

    def server_pid(self):
        for pid in pids_marked(self.work.encode()):
            if cmd0(pid).endswith("nvidia-cuda-mps-server"):
                return pid
        return None

    # ------------------------------------------------------------------ clients

    def client(self, label, uid, pipe, args, env=None, private_shm=False, cgroup=None):
        """Starts workload.py ARGS as uid, CUDA_MPS_PIPE_DIRECTORY=pipe (None: unset)."""
        home = os.path.join(self.work, "home", str(uid))
        os.makedirs(home, mode=0o700, exist_ok=True)
        os.chown(home, uid, uid)
        e = {"PATH": SAFE_PATH, "HOME": home, "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
             "GPUSHARE_V3PROBE": self.work}
        for k in ("LD_LIBRARY_PATH", "PYTHONPATH"):
            if os.environ.get(k):
                e[k] = os.environ[k]
        if pipe:
            e["CUDA_MPS_PIPE_DIRECTORY"] = pipe
        e.update(env or {})
        argv = [self.a.python, self.a.workload] + args
        out = open(os.path.join(self.work, label + ".out"), "w")
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                             env=e, cwd=home,
                             preexec_fn=as_user(uid, private_shm=private_shm, cgroup=cgroup))
        self.clients[label] = p
        self.say("$ [uid %d%s%s] %s &   (pid %d, %s)" % (
            uid, ", pipe " + pipe if pipe else ", no CUDA_MPS_PIPE_DIRECTORY",
            ", private /dev/shm" if private_shm else "", " ".join(argv[1:]), p.pid, label))
        return p

    def lines(self, label):
        res = []
        for line in read(os.path.join(self.work, label + ".out")).splitlines():
            try:
                res.append(json.loads(line))
            except ValueError:
                res.append({"event": "text", "text": line})
        return res

    def event(self, label, name):
        for obj in self.lines(label):
            if obj.get("event") == name:
                return obj
        return None

    def wait_event(self, label, name, timeout):
        p = self.clients[label]
        wait(timeout, lambda: self.event(label, name) is not None or p.poll() is not None)
        return self.event(label, name)

    def finish(self, probe, label, timeout=60.0):
        """Waits for the client (killing it past timeout) and prints its result."""
        p = self.clients[label]
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        res = self.event(label, "result") or {}
        keys = ("ok", "error", "multi_processor_count", "device_total_memory", "mem_get_info",
                "allocated", "host_pinned", "touches", "iters_per_s", "tflops", "compute_s",
                "faulted")
        brief = {k: res.get(k) for k in keys if res.get(k) is not None}
        errors = [o for o in self.lines(label) if o.get("event") == "cuda_error"]
        text = [o["text"] for o in self.lines(label) if o.get("event") == "text"][-3:]
        self.say("  %s (pid %d) exit %s: %s%s%s" % (
            label, p.pid, p.returncode, json.dumps(brief, sort_keys=True),
            " cuda_error: " + json.dumps(errors[0]) if errors else "",
            " | " + one_line(" | ".join(text), 300) if text else ""))
        self.record({"event": "v3_client", "probe": probe, "label": label, "pid": p.pid,
                     "rc": p.returncode, "result": res, "cuda_errors": errors, "text": text})
        return p.returncode, res

    def end_clients(self):
        for p in self.clients.values():
            if p.poll() is None:
                p.kill()
        for p in self.clients.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    # ------------------------------------------------------------------ mounts, cgroups

    def ro_bind(self, src, dst):
        os.makedirs(dst, mode=0o755, exist_ok=True)
        rc1, _ = self.run("O2", ["mount", "--bind", src, dst])
        if rc1 != 0:
            return False
        self.mounts.append(dst)
        rc2, _ = self.run("O2", ["mount", "-o", "remount,bind,ro", dst])
        return rc2 == 0

    def cleanup(self):
        self.end_clients()
        self.stop_daemon("cleanup")
        self.kill_marked()
        for m in reversed(self.mounts):
            subprocess.run(["umount", "-l", m], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
        self.mounts = []
        for cg in reversed(self.cgroups):
            procs = read(os.path.join(cg, "cgroup.procs")).split()
            for pid in procs:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (OSError, ValueError):
                    pass
            wait(5.0, lambda: not read(os.path.join(cg, "cgroup.procs")).split())
            try:
                os.rmdir(cg)
            except OSError as e:
                self.say("INFO  cleanup: rmdir %s: %s (left)" % (cg, e))
        self.cgroups = []


# ---------------------------------------------------------------------- small helpers

def to_text(b):
    if b is None:
        return ""
    return b.decode(errors="replace") if isinstance(b, bytes) else b


def one_line(text, n=400):
    t = " ".join(str(text).split())
    return t if len(t) <= n else t[:n] + "…"


def read(path):
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def wait(timeout, cond, every=0.05):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return True
        time.sleep(every)
    return cond()


def ancestors():
    """This process and its ancestors (a `timeout` or shell above it may name --work)."""
    out, pid = set(), os.getpid()
    while pid > 1 and pid not in out:
        out.add(pid)
        try:
            with open("/proc/%d/stat" % pid) as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return out


def pids_marked(mark):
    """Live processes whose environment or argv names mark, never this one or its ancestors."""
    skip = ancestors()
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) in skip:
            continue
        for what in ("environ", "cmdline"):
            try:
                with open("/proc/%s/%s" % (d, what), "rb") as f:
                    if mark in f.read():
                        out.append(int(d))
                        break
            except OSError:
                pass
    return out


def cmd0(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            return f.read().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return ""


def as_user(uid, private_shm=False, cgroup=None):
    """A preexec_fn: into cgroup, a private tmpfs on /dev/shm (own mount namespace), then uid."""
    def f():
        if cgroup:
            with open(os.path.join(cgroup, "cgroup.procs"), "w") as c:
                c.write(str(os.getpid()))
        if private_shm:
            if LIBC.unshare(CLONE_NEWNS) != 0:
                raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
            if LIBC.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
                raise OSError(ctypes.get_errno(), "mount --make-rprivate /")
            if LIBC.mount(b"tmpfs", b"/dev/shm", b"tmpfs", 0, b"mode=1777,size=256m") != 0:
                raise OSError(ctypes.get_errno(), "mount tmpfs /dev/shm")
        if uid:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
    return f


def driver_major(version):
    head = version.strip().split(".")[0]
    return int(head) if head.isdigit() else None


def csv_rows(out):
    return [[c.strip() for c in line.split(",")] for line in out.splitlines() if "," in line]


# ---------------------------------------------------------------------- the probes

def o1(p):
    p.say("\n-- O1: driver and probe facts")
    p.run("O1", ["nvidia-smi", "--query-gpu=driver_version,name,compute_mode,mig.mode.current",
                 "--format=csv,noheader"])
    p.run("O1", [p.a.control, "-v"])
    p.run("O1", [p.a.control, "-p", "3", "-h"])
    p.run("O1", [p.a.control, "-p", "3", "namespace", "help"])
    p.run("O1", ["stat", "-fc", "%T", "/sys/fs/cgroup"])
    p.run("O1", ["cat", "/sys/fs/cgroup/dmem.capacity"])
    p.run("O1", ["cat", "/sys/fs/cgroup/cgroup.subtree_control"])
    p.run("O1", ["nvidia-smi", "memory-limits", "--help"])


def setup(p):
    p.say("\n-- setup: a multi-user v3 daemon, server s, namespaces a (25 %%) and b")
    if not p.start_daemon("setup"):
        p.reading("setup", "FAIL", "the v3 daemon", "did not come up; the probes that need it SKIP")
        return False
    u = p.a.uuid
    p.ctl("setup", ["server", "create", "s", "--uid=0", "--allowed-devices=" + u])
    p.ctl("setup", ["namespace", "create", "a", "--server=s"])
    p.ctl("setup", ["namespace", "set", "a", "--server=s", "--active-thread-percentage=25"])
    p.ctl("setup", ["namespace", "create", "b", "--server=s"])
    p.ctl("setup", ["server", "list", "--format=csv"])
    p.ctl("setup", ["namespace", "list", "--format=csv"])
    p.run("setup", ["ls", "-laR", p.pipe])
    return True


def full_sms(p):
    p.say("\n-- baseline: a client without MPS (SM count, memory)")
    nomps = os.path.join(p.work, "nomps")
    os.makedirs(nomps, mode=0o755, exist_ok=True)
    p.client("base", UA, nomps, ["probe"])
    _, res = p.finish("base", "base", 120)
    return res.get("multi_processor_count")


def o2(p, full):
    p.say("\n-- O2: only the leaf namespace directory, bound read-only")
    ro = os.path.join(p.work, "ro")
    leaf = os.path.join(p.pipe, "s", "a")
    if not os.path.isdir(leaf):
        p.reading("O2", "FAIL", "leaf directory", "%s does not exist" % leaf)
        return
    if not p.ro_bind(leaf, ro):
        p.reading("O2", "FAIL", "read-only bind", "mount failed (above)")
        return
    p.client("o2", UA, ro, ["probe"])
    rc, res = p.finish("O2", "o2", 120)
    sms = res.get("multi_processor_count")
    p.reading("O2", "INFO", "a client through a read-only bind of s/a (25 %)",
              "rc %s, %s of %s SMs%s" % (rc, sms, full,
                                         "" if res.get("ok") else ", error: %s" % res.get("error")))
    subprocess.run(["umount", ro], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if ro in p.mounts:
        p.mounts.remove(ro)


def o3(p, full):
    p.say("\n-- O3: a client with no CUDA_MPS_PIPE_DIRECTORY while the daemon runs")
    _, mode = p.run("O3", ["nvidia-smi", "--query-gpu=compute_mode", "--format=csv,noheader"])
    p.client("o3", UA, None, ["probe"])
    rc, res = p.finish("O3", "o3", 120)
    default = "/tmp/nvidia-mps/control exists" if os.path.exists("/tmp/nvidia-mps/control") \
        else "nothing at /tmp/nvidia-mps"
    p.reading("O3", "INFO", "compute mode %s: no pipe env" % one_line(mode),
              "rc %s, %s of %s SMs (%s)" % (rc, res.get("multi_processor_count"), full, default))
    p.reading("O3", "SKIP", "EXCLUSIVE_PROCESS", "this run never sets the compute mode")


def o15(p):
    p.say("\n-- O15: a client of namespace a with a private /dev/shm, pinned host memory")
    p.client("o15", UA, os.path.join(p.pipe, "s", "a"),
             ["alloc", "--bytes", str(64 << 20), "--host-pinned", str(64 << 20), "--hold", "1"],
             private_shm=True)
    rc, res = p.finish("O15", "o15", 120)
    p.reading("O15", "INFO", "private /dev/shm under v3",
              "rc %s, ok %s, host_pinned %s%s" % (rc, res.get("ok"), res.get("host_pinned"),
                                                   "" if res.get("ok") else ", error: %s" % res.get("error")))


def o8_o9(p):
    p.say("\n-- O8, O9: dmem (which cgroup pays; does a hard-only limit touch ancestors)")
    cap = read("/sys/fs/cgroup/dmem.capacity")
    fs = p.run("O8", ["stat", "-fc", "%T", "/sys/fs/cgroup"])[1].strip()
    if fs != "cgroup2fs" or "vidmem" not in cap:
        p.reading("O8", "SKIP", "dmem", "cgroup fs %r, dmem.capacity %r: no dmem backend" % (fs, one_line(cap, 120)))
        return
    if "dmem" not in read("/sys/fs/cgroup/cgroup.subtree_control").split():
        p.reading("O8", "SKIP", "dmem", "the root cgroup does not enable dmem for its children; this probe never enables controllers at the root")
        return
    parent = "/sys/fs/cgroup/gpushare-v3probe-%d" % os.getpid()
    leaf = os.path.join(parent, "leaf")
    try:
        os.mkdir(parent)
        p.cgroups.append(parent)
        with open(os.path.join(parent, "cgroup.subtree_control"), "w") as f:
            f.write("+dmem")
        os.mkdir(leaf)
        p.cgroups.append(leaf)
    except OSError as e:
        p.reading("O8", "FAIL", "cgroups", "%s: %s" % (parent, e))
        return
    before = read(os.path.join(parent, "dmem.min")).strip()
    p.run("O9", ["nvidia-smi", "memory-limits", "--set", "-n", leaf, "--hard-limit", "3000", "-i", "0"])
    p.run("O9", ["nvidia-smi", "memory-limits", "--get", "-n", leaf, "-i", "0"])
    p.run("O9", ["cat", os.path.join(leaf, "dmem.max"), os.path.join(leaf, "dmem.min"),
                 os.path.join(parent, "dmem.min")])
    p.client("o8", UA, os.path.join(p.pipe, "s", "b"),
             ["alloc", "--bytes", str(2 << 30), "--hold", "4"], cgroup=leaf)
    held = p.wait_event("o8", "allocated", 90)
    server = p.server_pid()
    server_cg = ""
    if server:
        server_cg = "/sys/fs/cgroup" + read("/proc/%d/cgroup" % server).strip().split("::")[-1]
    leaf_cur = read(os.path.join(leaf, "dmem.current")).strip()
    server_cur = read(os.path.join(server_cg, "dmem.current")).strip() if server_cg else "(no server found)"
    p.reading("O8", "INFO", "2 GiB allocated by a client in a leaf with a 3000 MiB hard limit",
              "allocated %s; leaf dmem.current %r; the MPS server (pid %s, %s) dmem.current %r"
              % (bool(held), one_line(leaf_cur, 160), server, server_cg or "?", one_line(server_cur, 160)))
    p.finish("O8", "o8", 30)
    p.client("o8b", UA, os.path.join(p.pipe, "s", "b"),
             ["alloc", "--bytes", str(4 << 30), "--hold", "0.5"], cgroup=leaf)
    rc, res = p.finish("O8", "o8b", 90)
    p.reading("O8", "INFO", "4 GiB in the same leaf (above its hard limit)",
              "rc %s, ok %s, error %s" % (rc, res.get("ok"), one_line(res.get("error") or "", 160)))
    mid = read(os.path.join(parent, "dmem.min")).strip()
    try:
        os.rmdir(leaf)
        p.cgroups.remove(leaf)
    except OSError as e:
        p.say("  rmdir %s: %s" % (leaf, e))
    after = read(os.path.join(parent, "dmem.min")).strip()
    p.reading("O9", "INFO", "parent dmem.min with a hard-only leaf limit",
              "before %r, with the leaf %r, after rmdir without a reset %r" % (
                  one_line(before, 120), one_line(mid, 120), one_line(after, 120)))


def o7(p):
    p.say("\n-- O7: two servers on one GPU (Default mode): concurrent or time-sliced?")
    u = p.a.uuid
    for s in ("s1", "s2"):
        p.ctl("O7", ["server", "create", s, "--uid=0", "--allowed-devices=" + u])
    p.ctl("O7", ["server", "list", "--format=csv"])
    sums = {}
    for run, (pa, pb) in (("one server", ("s1", "s1")), ("two servers", ("s1", "s2"))):
        go = os.path.join(p.work, "go-o7-%s" % pa + pb)
        args = ["matmul", "--size", "1024", "--seconds", "4", "--batch", "20", "--go", go]
        la, lb = "o7-%s-a" % (pa + pb), "o7-%s-b" % (pa + pb)
        p.client(la, UA, os.path.join(p.pipe, pa), args)
        p.client(lb, UB, os.path.join(p.pipe, pb), args)
        p.wait_event(la, "ready", 120)
        p.wait_event(lb, "ready", 120)
        open(go, "w").close()
        os.chmod(go, 0o644)
        ta = p.finish("O7", la, 60)[1].get("tflops")
        tb = p.finish("O7", lb, 60)[1].get("tflops")
        sums[run] = (ta or 0.0) + (tb or 0.0) if ta and tb else None
        p.reading("O7", "INFO", "1024² matmuls, UIDs %d and %d, %s" % (UA, UB, run),
                  "TFLOP/s %s + %s = %s" % (fmt(ta), fmt(tb), fmt(sums[run])))
    one, two = sums.get("one server"), sums.get("two servers")
    p.reading("O7", "INFO", "two servers against one",
              "%s of the one-server sum (about 1: concurrent; about 0.5 or less: time-sliced)"
              % (fmt(two / one) if one and two else "?"))
    p.reading("O7", "SKIP", "EXCLUSIVE_PROCESS", "this run never sets the compute mode")
    for s in ("s1", "s2"):
        p.ctl("O7", ["server", "delete", s, "--force"])


def o5(p):
    p.say("\n-- O5: what a non-owner (UID %d, through its namespace's socket) can do" % UA)
    p.client("o5-b", UB, os.path.join(p.pipe, "s", "b"), ["alloc", "--bytes", str(1 << 30), "--hold", "20"])
    if not p.wait_event("o5-b", "allocated", 120):
        p.finish("O5", "o5-b", 5)
        p.reading("O5", "FAIL", "a client in namespace b", "did not allocate; O5 not run")
        return
    p.ctl("O5", ["client", "list", "--all", "--format=csv"])
    leaf = os.path.join(p.pipe, "s", "a")
    other = str(p.clients["o5-b"].pid)
    for args in (["server", "list", "--format=csv"],
                 ["namespace", "list", "--format=csv"],
                 ["namespace", "set", "a", "--server=s", "--active-thread-percentage=100"],
                 ["client", "terminate", other],
                 ["namespace", "delete", "b", "--server=s"],
                 ["server", "delete", "s"],
                 ["-q"]):
        p.ctl("O5", args, uid=UA, pipe=leaf, timeout=20)
    alive_d = p.daemon is not None and p.daemon.poll() is None
    alive_c = p.clients["o5-b"].poll() is None
    p.ctl("O5", ["namespace", "list", "--format=csv"])
    p.reading("O5", "INFO", "after UID %d's terminate, deletes and -q" % UA,
              "daemon %s; UID %d's client in b %s" % ("running" if alive_d else "GONE",
                                                      UB, "running" if alive_c else "GONE"))
    p.clients["o5-b"].kill()
    p.finish("O5", "o5-b", 10)


def recreate(p, probe):
    u = p.a.uuid
    p.ctl(probe, ["server", "create", "s", "--uid=0", "--allowed-devices=" + u])
    p.ctl(probe, ["namespace", "create", "a", "--server=s"])
    p.ctl(probe, ["namespace", "set", "a", "--server=s", "--active-thread-percentage=25"])
    p.ctl(probe, ["namespace", "create", "b", "--server=s"])


def o6(p):
    p.say("\n-- O6: does a client survive a kill -9 of the control daemon and a restart?")
    if p.daemon is None or p.daemon.poll() is not None:
        p.say("  (the daemon is gone after O5: restarting it first)")
        p.stop_daemon("O6")
        if not p.start_daemon("O6"):
            p.reading("O6", "FAIL", "restart", "the daemon did not come back")
            return False
        recreate(p, "O6")
    p.client("o6", UA, os.path.join(p.pipe, "s", "a"), ["alloc", "--bytes", str(1 << 30), "--hold", "12"])
    if not p.wait_event("o6", "allocated", 120):
        p.finish("O6", "o6", 5)
        p.reading("O6", "FAIL", "a client in namespace a", "did not allocate; O6 not run")
        return True
    killed = time.time()
    p.daemon.kill()
    p.daemon.wait()
    p.say("  kill -9 of the control daemon (pid %d)" % p.daemon.pid)
    p.daemon = None
    alive_server = p.server_pid()
    ok = p.start_daemon("O6")
    if ok:
        recreate(p, "O6")
        p.ctl("O6", ["client", "list", "--all", "--format=csv"])
    time.sleep(2.0)
    rc, res = p.finish("O6", "o6", 20)
    errs = [o for o in p.lines("o6") if o.get("event") == "cuda_error"]
    p.reading("O6", "INFO", "a client of namespace a across kill -9 and restart",
              "server process after the kill: %s; restart %s; the client %s (rc %s, touches %s)%s"
              % (alive_server or "gone", "ok" if ok else "FAILED",
                 "ran to its end" if res.get("ok") else "failed", rc, res.get("touches"),
                 ", first cuda_error %+.1f s after the kill: %s" % (errs[0]["t"] - killed, one_line(errs[0].get("error"), 160)) if errs else ""))
    return ok


def o13(p):
    p.say("\n-- O13: a fault in namespace a while a client of namespace b computes")
    go = os.path.join(p.work, "go-o13")
    p.client("o13-b", UB, os.path.join(p.pipe, "s", "b"),
             ["matmul", "--size", "2048", "--seconds", "6", "--batch", "10", "--go", go])
    p.wait_event("o13-b", "ready", 120)
    open(go, "w").close()
    os.chmod(go, 0o644)
    p.client("o13-a", UA, os.path.join(p.pipe, "s", "a"), ["fault"])
    rc_a, res_a = p.finish("O13", "o13-a", 120)
    rc_b, res_b = p.finish("O13", "o13-b", 60)
    p.reading("O13", "INFO", "the faulting client (a) and its neighbour (b)",
              "a: rc %s, faulted %s (%s); b: rc %s, ok %s%s" % (
                  rc_a, res_a.get("faulted"), one_line(res_a.get("error") or "", 120), rc_b,
                  res_b.get("ok"), "" if res_b.get("ok") else ", error: " + one_line(res_b.get("error") or "", 160)))
    p.ctl("O13", ["server", "list", "--format=csv"])


def o14(p):
    p.say("\n-- O14: namespace delete --force under a running client")
    p.client("o14", UA, os.path.join(p.pipe, "s", "a"), ["alloc", "--bytes", str(1 << 30), "--hold", "8"])
    if not p.wait_event("o14", "allocated", 120):
        p.finish("O14", "o14", 5)
        p.reading("O14", "FAIL", "a client in namespace a", "did not allocate; O14 not run")
        return
    p.ctl("O14", ["namespace", "delete", "a", "--server=s"])
    t = time.time()
    p.ctl("O14", ["namespace", "delete", "a", "--server=s", "--force"], timeout=20)
    rc, res = p.finish("O14", "o14", 30)
    errs = [o for o in p.lines("o14") if o.get("event") == "cuda_error"]
    p.reading("O14", "INFO", "the client of a deleted namespace",
              "rc %s, ok %s%s" % (rc, res.get("ok"),
                                  ", cuda_error %+.1f s after the delete: %s" % (errs[0]["t"] - t, one_line(errs[0].get("error"), 160)) if errs else ""))


def o4(p):
    p.say("\n-- O4: the malformed pinned-limit variable on a LEGACY daemon (2G default limit)")
    pipe = os.path.join(p.work, "legacy", "p")
    log = os.path.join(p.work, "legacy", "l")
    for d in (pipe, log):
        os.makedirs(d, mode=0o755, exist_ok=True)
    env = {"CUDA_MPS_PIPE_DIRECTORY": pipe, "CUDA_MPS_LOG_DIRECTORY": log}
    rc, _ = p.run("O4", [p.a.control, "-d"], env=env, timeout=30)
    if rc != 0 or not wait(15.0, lambda: os.path.exists(os.path.join(pipe, "control"))):
        p.reading("O4", "FAIL", "legacy daemon", "did not start (rc %s)" % rc)
        return
    try:
        p.run("O4", [p.a.control], env=env, stdin="set_default_device_pinned_mem_limit 0 2G\n",
              show="echo 'set_default_device_pinned_mem_limit 0 2G' | nvidia-cuda-mps-control")
        vis = {"CUDA_VISIBLE_DEVICES": p.a.uuid}
        p.client("o4-plain", 0, pipe, ["alloc", "--bytes", str(4 << 30)], env=vis)
        rc1, r1 = p.finish("O4", "o4-plain", 120)
        bad = dict(vis, CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="1=4G")
        p.client("o4-escape", 0, pipe, ["alloc", "--bytes", str(4 << 30)], env=bad)
        rc2, r2 = p.finish("O4", "o4-escape", 120)
        p.reading("O4", "INFO", "4 GiB under a 2G legacy default",
                  "without the variable: rc %s ok %s; with CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=1=4G: rc %s ok %s (ok = the limit was lifted)"
                  % (rc1, r1.get("ok"), rc2, r2.get("ok")))
    finally:
        p.run("O4", [p.a.control], env=env, stdin="quit\n", show="echo quit | nvidia-cuda-mps-control")
        pid_file = os.path.join(pipe, "nvidia-cuda-mps-control.pid")
        pid = read(pid_file).strip()
        if pid.isdigit():
            wait(10.0, lambda: not os.path.exists("/proc/" + pid))


def fmt(v):
    return "?" if v is None else "%.2f" % v


def main(argv):
    ap = argparse.ArgumentParser(description="MPS v3 raw probes (root; driver >= 615)")
    ap.add_argument("--work", required=True)
    ap.add_argument("--driver", required=True)
    ap.add_argument("--uuid", required=True)
    ap.add_argument("--python", required=True)
    ap.add_argument("--workload", required=True)
    ap.add_argument("--jsonl", required=True)
    ap.add_argument("--control", default="nvidia-cuda-mps-control")
    ap.add_argument("--budget", type=float, default=150.0)
    ap.add_argument("--simulate", action="store_true")
    try:
        a = ap.parse_args(argv)
    except SystemExit as e:
        return 2 if e.code else 0
    major = driver_major(a.driver)
    sys.stdout.write("v3probe: driver %s\n" % a.driver)
    if a.simulate or major is None or major < 615:
        why = "simulated: no driver" if a.simulate else \
            "MPS v3 needs driver >= 615; this one is %s" % a.driver
        sys.stdout.write("SKIP  v3    MPS v3 probes (O1-O9, O13-O15): %s\n" % why)
        with open(a.jsonl, "a", encoding="utf-8") as f:
            f.write(json.dumps({"event": "v3_skip", "driver": a.driver, "why": why}) + "\n")
        return 0
    if os.geteuid() != 0:
        sys.stderr.write("v3probe: run as root (it starts a multi-user daemon and clients as UIDs 1000 and 2000)\n")
        return 2
    os.makedirs(a.work, mode=0o711, exist_ok=True)
    os.chmod(a.work, 0o711)
    os.makedirs(os.path.join(a.work, "home"), mode=0o711, exist_ok=True)
    p = Probe(a)
    stop = {"why": None}

    def on_term(signum, _frame):
        stop["why"] = "signal %d" % signum
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        o1(p)
        if setup(p):
            full = full_sms(p)
            steps = [("O2", lambda: o2(p, full)), ("O3", lambda: o3(p, full)),
                     ("O15", lambda: o15(p)), ("O8", lambda: o8_o9(p)), ("O7", lambda: o7(p)),
                     ("O5", lambda: o5(p)), ("O6", lambda: o6(p)), ("O13", lambda: o13(p)),
                     ("O14", lambda: o14(p))]
            for name, step in steps:
                if p.left() <= 0:
                    p.reading(name, "SKIP", "budget", "the %.0f s budget is spent" % a.budget)
                    continue
                if name in ("O13", "O14") and (p.daemon is None or p.daemon.poll() is not None):
                    p.reading(name, "SKIP", "daemon", "the v3 daemon is not running")
                    continue
                try:
                    step()
                except KeyboardInterrupt:
                    raise
                except Exception as e:  # one probe's failure is not the others'
                    p.reading(name, "FAIL", "ran to its end", "%s: %s" % (type(e).__name__, one_line(e)))
                p.end_clients()
        p.stop_daemon("stop")
        if p.left() > 0:
            o4(p)
        else:
            p.reading("O4", "SKIP", "budget", "the %.0f s budget is spent" % a.budget)
    except KeyboardInterrupt:
        p.say("v3probe: interrupted (%s): cleaning up" % (stop["why"] or "SIGINT"))
        stop["why"] = stop["why"] or "SIGINT"
    finally:
        p.cleanup()
        p.record({"event": "v3_end", "elapsed_s": round(time.time() - p.t0, 1)})
        p.say("v3probe: done in %.0f s; daemons, clients, mounts and cgroups ended" % (time.time() - p.t0))
    return 130 if stop["why"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
