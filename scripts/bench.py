#!/usr/bin/env python3
"""gpushare's benchmark suite, driven by scripts/bench (which builds the release binaries).

Every A/B benchmark runs A = runc directly and B = gpushare-runtime (the shim, which execs
the same runc) on bundles of the same shape with fresh container ids, alternating per round
(A then B on even rounds, B then A on odd ones, so neither side always runs on a warmer
machine). Reported: median, p10 and p90 (linear interpolation) of each side and the ratio of
the medians B/A, plus PASS/MISS against the per-call targets below. Absolute times only matter
for the cold start; everything else is a ratio against runc measured in the same run.

Standard library only. Needs root, runc, busybox and GNU time. See BENCHMARKS.md.
"""

import argparse
import calendar
import json
import os
import random
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# GPUSHARE_BENCH_BIN: another build's binaries (an old-against-new comparison).
REL = Path(os.environ.get("GPUSHARE_BENCH_BIN") or REPO / "target" / "release")
RUNTIME = REL / "gpushare-runtime"
GPUSHARE = REL / "gpushare"
SIM = REL / "gpushare-mps-sim"
GPU0 = "GPU-8f8bff94-112e-9541-43da-cfd453333404"
GPU1 = "GPU-5a1c3f0e-7d2b-4e8a-9c61-0b4e2d7f9a13"
MIB = 1024 * 1024

# Per-call targets (BENCHMARKS.md, "Where things stand").
T_NOREQ = 1.03  # create without request, median ratio
T_PASS = 1.03  # passthrough commands, median ratio
T_WARM = 1.15  # create with a warm daemon (shim + hook), median ratio
T_COLD_MS = 100.0  # create of a new identity until its daemon is ready
T_BURST_SPREAD = 3.0  # p99 <= 3 x p50
T_SHIM_RSS = 8 * 1024  # KiB
T_HOOK_RSS = 16 * 1024  # KiB

# The own-cost rows of [7] by their key in results["own_cost_us"].
OWN_ROWS = {
    "passthrough": "own.shim passthrough (state)",
    "create": "own.shim create, no request",
    "create_warm": "own.shim create, request (warm)",
    "hook_create_runtime": "own.hook create-runtime (warm)",
    "hook_poststop": "own.hook poststop",
}

# Host uids used per benchmark (each cold round / burst round gets a new identity).
UID_WARM = 1000
UID_COLD = 20000
UID_BURST = 30000
UID_RSS = 40000
UID_SCALE = 50000
T_SCALE_MS = 100.0  # each node-scale command at 1,000 containers
T_COLD_P50_MS = 50.0  # create -> daemon ready, p50


def which(name):
    found = shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/usr/bin:/sbin:/bin")
    if not found:
        sys.exit(f"scripts/bench: {name} not found")
    return found


RUNC = which("runc")
BUSYBOX = next(p for p in ("/bin/busybox", "/usr/bin/busybox") if os.path.exists(p))
TRUE = which("true")


def installed_copy(linked, path):
    """`linked` copied to `path` as a package manager writes a file, and the copy's path.
    Every program a benchmark execs is such a copy (scripts/bench copies gpushare's
    binaries too): on this machine's kernel a file just written by the linker takes ~10
    more page faults per exec than a copy of it (ext4 page-cache folios), ~250 us, which
    would count against whichever side was linked last (BENCHMARKS.md, "Method")."""
    shutil.copyfile(linked, path)
    os.chmod(path, 0o755)
    return path


def drop_bin_copies():
    """Removes the binaries' copies scripts/bench made for this run (it execs the driver,
    so the driver removes them: GPUSHARE_BENCH_BIN_TEMP names that directory)."""
    temp = os.environ.get("GPUSHARE_BENCH_BIN_TEMP")
    if temp and Path(temp) == REL and REL.name.startswith("gsbin."):
        shutil.rmtree(REL, ignore_errors=True)


def drive(name, suite, run):
    """The frame of a benchmark driver (this one and bench_engines.py): SIGINT, SIGTERM
    and SIGHUP interrupt `run()`, and whatever happens `suite.cleanup()` runs and the
    binaries' copies go. Exit code: 0, 2 when a benchmark failed, 130 when interrupted."""
    def on_signal(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, on_signal)
    code = 0
    try:
        run()
    except BenchError as e:
        print(f"{name}: FAILED: {e}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt as e:
        print(f"{name}: interrupted ({e}); cleaning up", file=sys.stderr)
        code = 130
    finally:
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, signal.SIG_IGN)
        suite.cleanup()
        drop_bin_copies()
    return code


def pct(xs, p):
    """Percentile with linear interpolation between closest ranks (numpy's default)."""
    s = sorted(xs)
    if not s:
        return float("nan")
    k = (len(s) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def ratio_ci(a, b, n=2000, seed=6):
    """95% bootstrap interval of median(b)/median(a), resampling rounds (pairs) together."""
    rng = random.Random(seed)
    k = len(a)
    rs = []
    for _ in range(n):
        idx = [rng.randrange(k) for _ in range(k)]
        rs.append(statistics.median(b[i] for i in idx) / statistics.median(a[i] for i in idx))
    return pct(rs, 2.5), pct(rs, 97.5)


def ms(ns):
    return ns / 1e6


class BenchError(Exception):
    pass


class Suite:
    def __init__(self, args):
        self.args = args
        self.work = Path(tempfile.mkdtemp(prefix="gsb.", dir="/tmp"))
        # Per-user daemons run as their uid and must traverse to their pipe directory.
        os.chmod(self.work, 0o711)
        self.state = self.work / "s"
        self.runc_root = self.work / "r"
        self.cfg = self.work / "runtime.toml"
        self.cfg_rss = self.work / "rss.toml"
        self.cfg_debug = self.work / "debug.toml"
        self.cfg_scale = self.work / "scale.toml"
        self.log = self.work / "gpushare.log"
        self.rootfs = self.work / "rootfs"
        self.bundles = self.work / "b"
        self.env = {
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "GPUSHARE_CONFIG": str(self.cfg),
        }
        self.results = {}
        self.verdicts = []  # (name, value text, target text, ok)
        self._base_spec = None
        self.pt_container = None

    # ---------------------------------------------------------------- set-up / clean-up

    def setup(self):
        for d in ("bin", "dev/shm", "proc", "sys", "tmp/nvidia-mps", "etc", "usr/bin"):
            (self.rootfs / d).mkdir(parents=True, exist_ok=True)
        shutil.copy2(BUSYBOX, self.rootfs / "bin" / "busybox")
        applets = subprocess.run([BUSYBOX, "--list"], capture_output=True, text=True).stdout.split()
        for a in applets:
            if a != "busybox":
                try:
                    os.symlink("busybox", self.rootfs / "bin" / a)
                except FileExistsError:
                    pass
        (self.rootfs / "etc" / "passwd").write_text("root:x:0:0:root:/:/bin/sh\n")
        inv = self.work / "inventory.json"
        inv.write_text(json.dumps({
            "driver_version": "580.159.04",
            "gpus": [{"index": 0, "uuid": GPU0, "name": "NVIDIA A30",
                      "memory_bytes": 25769803776, "compute_capability": "8.0",
                      "compute_mode": "default"},
                     # Only the node-scale benchmark uses GPU 1 (its 50 identities).
                     {"index": 1, "uuid": GPU1, "name": "NVIDIA A30",
                      "memory_bytes": 25769803776, "compute_capability": "8.0",
                      "compute_mode": "default"}]}))
        common = (
            f'state-dir = "{self.state}"\n'
            f'log-file = "{self.log}"\n'
            'log-level = "info"\n'
            f'inventory = "file:{inv}"\n'
            "[mps]\n"
            f'control-binary = "{SIM}"\n'
            'shm-size = "64M"\n'
            'start-timeout = "10s"\n'
        )
        self.cfg.write_text(f'low-level-runtime = ["{RUNC}"]\n' + common)
        # For peak RSS only: the shim execs `true` instead of runc, so the process's peak
        # RSS (which survives exec) is the shim's own, not runc's. See BENCHMARKS.md.
        self.cfg_rss.write_text(f'low-level-runtime = ["{TRUE}"]\n' + common)
        # Cold start's B side: debug events mark its phases (BENCHMARKS.md, "Cold start").
        self.cfg_debug.write_text(f'low-level-runtime = ["{RUNC}"]\n'
                                  + common.replace('log-level = "info"', 'log-level = "debug"'))
        # Node scale: daemons never stop idle (the 10-container point has 50 daemons, most
        # without a container), so what gc and status read is what the creates wrote.
        self.cfg_scale.write_text(f'low-level-runtime = ["{RUNC}"]\n' + common
                                  + 'idle-timeout = "0"\n')
        spec_dir = self.work / "spec"
        spec_dir.mkdir()
        subprocess.run([RUNC, "spec"], cwd=spec_dir, check=True)
        self._base_spec = json.loads((spec_dir / "config.json").read_text())

    def cleanup(self):
        # Creates still in flight (an interrupted burst) finish first, so none is missed.
        for t in threading.enumerate():
            if t is not threading.current_thread() and not t.daemon:
                t.join(timeout=30)
        # Containers first (their poststop hooks release daemons), then daemons, mounts, dir.
        ids = set()
        if self.runc_root.exists():
            out = subprocess.run([RUNC, "--root", str(self.runc_root), "list", "-q"],
                                 capture_output=True, text=True)
            ids.update(out.stdout.split())
        if ids:
            with ThreadPoolExecutor(8) as ex:
                list(ex.map(lambda c: subprocess.run(
                    [RUNC, "--root", str(self.runc_root), "delete", "-f", c],
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL, env=self.env), sorted(ids)))
        if self.cfg.exists() and GPUSHARE.exists():
            subprocess.run([str(GPUSHARE), "daemon", "stop", "--all", "--force"],
                           env=self.env, stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # Whatever is still mounted under the work dir (deepest first).
        mounts = []
        with open("/proc/self/mountinfo") as f:
            for line in f:
                mp = line.split()[4].replace("\\040", " ")
                if mp == str(self.work) or mp.startswith(str(self.work) + "/"):
                    mounts.append(mp)
        for mp in sorted(mounts, key=len, reverse=True):
            subprocess.run(["umount", "-l", mp], stderr=subprocess.DEVNULL)
        if self.args.keep:
            print(f"scripts/bench: kept {self.work}")
        else:
            shutil.rmtree(self.work, ignore_errors=True)

    # ---------------------------------------------------------------- helpers

    def spec(self, args, uid=0, annotations=None):
        c = json.loads(json.dumps(self._base_spec))
        c["process"]["terminal"] = False
        c["process"]["args"] = args
        c["process"]["user"] = {"uid": uid, "gid": uid}
        c["root"] = {"path": str(self.rootfs), "readonly": True}
        c["hostname"] = "bench"
        if annotations:
            c["annotations"] = annotations
        return json.dumps(c, indent="\t").encode()

    def request_spec(self, uid, args=("true",)):
        return self.spec(list(args), uid, {"gpushare.io/device": "0"})

    def bundle(self, cid, spec_bytes):
        b = self.bundles / cid
        b.mkdir(parents=True)
        (b / "config.json").write_bytes(spec_bytes)
        return b

    def argv(self, side, b, rest):
        exe = RUNC if side == "A" else str(RUNTIME)
        return [exe, "--root", str(self.runc_root), "--log", str(b / "log.json"),
                "--log-format", "json"] + rest

    def pre(self):
        """Puts the machine in the same state before every timed command (see BENCHMARKS.md,
        "Method, and the noise on this machine"): an idle pause of --settle ms, then --primer
        execs of `true`."""
        if self.args.settle:
            time.sleep(self.args.settle / 1000.0)
        for _ in range(self.args.primer):
            subprocess.call([TRUE])

    def run(self, side, b, rest, env=None, check=True, timed=True):
        """Runs one runtime command; returns its wall time in ns. Container stdio -> files.
        A timed command is preceded by `pre()`."""
        argv = self.argv(side, b, rest)
        if timed:
            self.pre()
        with open(b / "out", "ab") as out:
            w0 = time.time_ns()
            t0 = time.perf_counter_ns()
            rc = subprocess.call(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                 env=env or self.env)
            t1 = time.perf_counter_ns()
            # Wall clock at the start and the end, for matching gpushare's log timestamps.
            self.last_wall = (w0, w0 + (t1 - t0))
        if check and rc != 0:
            raise BenchError(f"{' '.join(argv)} exited {rc}: {self.last_error(b)}")
        return t1 - t0 if rc == 0 else None

    @staticmethod
    def last_error(b):
        try:
            lines = (b / "log.json").read_text().splitlines()
        except OSError:
            lines = []
        for line in reversed(lines):
            try:
                v = json.loads(line)
            except ValueError:
                continue
            if v.get("level") == "error":
                return v.get("msg", "")
        out = (b / "out").read_text(errors="replace") if (b / "out").exists() else ""
        return out.strip()[-500:] or "(no error line)"

    @staticmethod
    def wait_exit(pid, limit=10.0):
        """Waits until a container's init has exited (gone or zombie), untimed."""
        deadline = time.monotonic() + limit
        path = f"/proc/{pid}/stat"
        while time.monotonic() < deadline:
            try:
                with open(path) as f:
                    st = f.read()
                if st[st.rindex(")") + 2] in "ZX":
                    return
            except (OSError, ValueError):
                return
            time.sleep(0.0005)
        raise BenchError(f"container init {pid} did not exit within {limit}s")

    def daemon_ids(self):
        d = self.state / "mps"
        if not d.is_dir():
            return []
        return sorted(e.name for e in d.iterdir() if re.fullmatch(r"[0-9a-f]{32}", e.name))

    def record(self, did):
        return json.loads((self.state / "mps" / did / "daemon.json").read_text())

    def stop_daemon(self, did):
        subprocess.run([str(GPUSHARE), "daemon", "stop", "--id", did, "--force"],
                       env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, check=True)

    def stop_all_daemons(self):
        subprocess.run([str(GPUSHARE), "daemon", "stop", "--all", "--force"],
                       env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, check=True)

    @staticmethod
    def order(r):
        return ("A", "B") if r % 2 == 0 else ("B", "A")

    def summary(self, name, a, b, target=None, label=None):
        """Stores and prints one A/B row; returns the ratio of medians."""
        ma, mb = statistics.median(a), statistics.median(b)
        ratio = mb / ma
        lo, hi = ratio_ci(a, b)
        row = {
            "ratio_ci95": [lo, hi],
            "A": {"median_ms": ms(ma), "p10_ms": ms(pct(a, 10)), "p90_ms": ms(pct(a, 90)), "n": len(a)},
            "B": {"median_ms": ms(mb), "p10_ms": ms(pct(b, 10)), "p90_ms": ms(pct(b, 90)), "n": len(b)},
            "ratio": ratio,
            "paired_ratio_p10_p50_p90": [pct([y / x for x, y in zip(a, b)], p) for p in (10, 50, 90)],
            "samples_ms": {"A": [ms(x) for x in a], "B": [ms(x) for x in b]},
        }
        self.results[name] = row
        verdict = ""
        if target is not None:
            ok = ratio <= target
            verdict = f"{'PASS' if ok else 'MISS'} (<= {target:.2f})"
            if lo <= target <= hi:
                verdict += " [CI straddles the target]"
            self.verdicts.append((label or name, f"{ratio:.3f} x runc (CI {lo:.2f}-{hi:.2f})",
                                  f"<= {target:.2f} x", ok))
        print(f"  {name:<34} A {ms(ma):7.2f} [{ms(pct(a, 10)):6.2f}-{ms(pct(a, 90)):6.2f}]"
              f"  B {ms(mb):7.2f} [{ms(pct(b, 10)):6.2f}-{ms(pct(b, 90)):6.2f}] ms"
              f"  B/A {ratio:.3f} (95% CI {lo:.3f}-{hi:.3f})  {verdict}", flush=True)
        return ratio

    # ---------------------------------------------------------------- benchmarks

    def lifecycle(self, name, spec_bytes, rounds, check_b):
        """create + start + delete of a `true` container, A/B alternating. The container's
        exit is awaited (untimed) before delete, so delete never hits runc's 100 ms kill
        poll; the figure is the sum of the three commands' wall times."""
        phases = ("create", "start", "delete", "total")
        s = {side: {p: [] for p in phases} for side in "AB"}
        warmup = 1
        for r in range(-warmup, rounds):
            for side in self.order(r):
                cid = f"{name}{r + warmup}{side.lower()}"
                b = self.bundle(cid, spec_bytes)
                tc = self.run(side, b, ["create", "--bundle", str(b), "--pid-file", str(b / "pid"), cid])
                pid = int((b / "pid").read_text())
                ts = self.run(side, b, ["start", cid])
                self.wait_exit(pid)
                td = self.run(side, b, ["delete", cid])
                if side == "B":
                    check_b(b, spec_bytes)
                if r >= 0:
                    for p, v in zip(phases, (tc, ts, td, tc + ts + td)):
                        s[side][p].append(v)
        return s

    def bench_noreq(self, rounds):
        print("[1] create + start + delete, no request: runc vs gpushare-runtime", flush=True)
        spec_bytes = self.spec(["true"])

        def untouched(b, original):
            if (b / "config.json").read_bytes() != original:
                raise BenchError(f"{b}/config.json was edited for a container without request")

        s = self.lifecycle("n", spec_bytes, rounds, untouched)
        self.summary("noreq.create", s["A"]["create"], s["B"]["create"], T_NOREQ, "create, no request")
        self.summary("noreq.start", s["A"]["start"], s["B"]["start"])
        self.summary("noreq.delete", s["A"]["delete"], s["B"]["delete"])
        self.summary("noreq.create+start+delete", s["A"]["total"], s["B"]["total"], T_NOREQ,
                     "create+start+delete, no request")

    def ensure_warm_daemon(self):
        """Starts the daemon of uid 1000 (untimed) through a first container, once."""
        if getattr(self, "warm_daemon", None):
            return
        b = self.bundle("warmup", self.request_spec(UID_WARM))
        self.run("B", b, ["create", "--bundle", str(b), "--pid-file", str(b / "pid"), "warmup"], timed=False)
        self.run("B", b, ["start", "warmup"], timed=False)
        self.wait_exit(int((b / "pid").read_text()))
        self.run("B", b, ["delete", "warmup"], timed=False)
        daemons = self.daemon_ids()
        if len(daemons) != 1 or self.record(daemons[0])["status"] != "ready":
            raise BenchError(f"warm-up did not leave one ready daemon: {daemons}")
        self.warm_daemon = daemons[0]

    def bench_warm(self, rounds):
        print("[2] create + start + delete with gpushare.io/device=0, daemon already running "
              "(shim + createRuntime/poststop hooks) vs runc on the same bundle", flush=True)
        spec_bytes = self.request_spec(UID_WARM)
        self.ensure_warm_daemon()

        def edited(b, _original):
            ann = json.loads((b / "config.json").read_bytes()).get("annotations", {})
            if ann.get("gpushare.io/daemon") != self.warm_daemon:
                raise BenchError(f"{b}: not attached to the warm daemon: {ann}")

        s = self.lifecycle("w", spec_bytes, rounds, edited)
        if self.daemon_ids() != [self.warm_daemon]:
            raise BenchError(f"warm benchmark started extra daemons: {self.daemon_ids()}")
        rec = self.record(self.warm_daemon)
        if rec["status"] != "ready" or rec.get("restarts", 0):
            raise BenchError(f"warm daemon not steady: {rec}")
        self.summary("warm.create", s["A"]["create"], s["B"]["create"], T_WARM,
                     "create, warm daemon (shim + hook)")
        self.summary("warm.start", s["A"]["start"], s["B"]["start"])
        self.summary("warm.delete", s["A"]["delete"], s["B"]["delete"])
        self.summary("warm.create+start+delete", s["A"]["total"], s["B"]["total"], T_WARM,
                     "create+start+delete, warm daemon")

    def start_pt_container(self):
        """One long-running container (busybox sleep) for passthrough commands."""
        if self.pt_container:
            return
        cid = "pt"
        b = self.bundle(cid, self.spec(["sleep", "1000000"]))
        self.run("A", b, ["create", "--bundle", str(b), "--pid-file", str(b / "pid"), cid], timed=False)
        self.run("A", b, ["start", cid], timed=False)
        self.pt_container = cid
        self.pt_pid = int((b / "pid").read_text())

    def static_c(self, name, body):
        """A static C program compiled into the work dir (the floors below), or None
        without a C compiler."""
        path = self.work / name
        if path.exists():
            return path
        cc = shutil.which("cc") or shutil.which("gcc")
        if not cc:
            return None
        src = self.work / f"{name}.c"
        src.write_text("#include <unistd.h>\n" + body + "\n")
        linked = self.work / f"{name}.ld"
        if subprocess.run([cc, "-O2", "-static", "-o", str(linked), str(src)],
                          stderr=subprocess.DEVNULL).returncode != 0:
            return None
        return installed_copy(linked, path)

    def bench_decompose(self, rounds):
        """Where the warm request's extra time goes: five variants of one container, rotated
        per round, each timed at create and at delete (where runc runs the poststop hook).
        A = runc, plain bundle; H = runc on the bundle as gpushare-runtime edited it (so
        runc runs the createRuntime and poststop hooks and does the extra mounts); M = the
        same edited bundle without its hooks (mounts and env only); T = the edited bundle
        with both hooks running a static C program that exits at once (the floor of any
        two hooks: runc's fork, exec, state on stdin and wait); B = the shim."""
        print("[8] warm request decomposition (informational): A runc plain | M runc + gpushare's "
              "mounts/env | T M + two no-op static hooks | H runc + mounts + gpushare's hooks "
              "| B shim + mounts + hooks", flush=True)
        noop = self.static_c("noop-hook", "int main(void) { return 0; }")
        if noop is None:
            raise BenchError("[8] needs a C compiler (cc) for its no-op hook: apt-get install gcc")
        plain = self.request_spec(UID_WARM)
        # The shim's edit of this bundle, captured once (the shim execs `true` here).
        b = self.bundle("dz-edit", plain)
        self.run("B", b, ["create", "--bundle", str(b), "dz-edit"],
                 env=dict(self.env, GPUSHARE_CONFIG=str(self.cfg_rss)), timed=False)
        edited = json.loads((b / "config.json").read_bytes())
        subprocess.run([str(GPUSHARE), "hook", "poststop"], env=self.env, check=True,
                       input=json.dumps({"id": "dz-edit", "annotations": edited["annotations"]}).encode())
        no_hooks = dict(edited)
        no_hooks.pop("hooks", None)
        noop_hooks = json.loads(json.dumps(edited))
        for stage in noop_hooks.get("hooks", {}).values():
            for h in stage:
                if Path(h["path"]).name == "gpushare":
                    h["path"], h["args"] = str(noop), ["noop-hook"]
        variants = {"A": ("A", plain), "M": ("A", json.dumps(no_hooks).encode()),
                    "T": ("A", json.dumps(noop_hooks).encode()),
                    "H": ("A", json.dumps(edited).encode()), "B": ("B", plain)}
        keys = list(variants)
        s = {k: {"create": [], "delete": [], "both": []} for k in keys}
        for r in range(-1, rounds):
            rot = keys[r % len(keys):] + keys[:r % len(keys)]
            for k in rot:
                side, spec_bytes = variants[k]
                cid = f"d{r + 1}{k.lower()}"
                b = self.bundle(cid, spec_bytes)
                tc = self.run(side, b, ["create", "--bundle", str(b), "--pid-file", str(b / "pid"), cid])
                self.run(side, b, ["start", cid], timed=False)
                self.wait_exit(int((b / "pid").read_text()))
                td = self.run(side, b, ["delete", cid])
                if r >= 0:
                    for p, v in (("create", tc), ("delete", td), ("both", tc + td)):
                        s[k][p].append(v)
        med = {k: {p: statistics.median(v) for p, v in d.items()} for k, d in s.items()}
        self.results["decompose"] = {
            k: {p: {"median_ms": ms(med[k][p]), "p10_ms": ms(pct(v, 10)), "p90_ms": ms(pct(v, 90)),
                    "samples_ms": [ms(x) for x in v]} for p, v in d.items()}
            for k, d in s.items()}
        for k in keys:
            print(f"  {k}: create {ms(med[k]['create']):7.2f} ms [{ms(pct(s[k]['create'], 10)):6.2f}-"
                  f"{ms(pct(s[k]['create'], 90)):6.2f}]  delete {ms(med[k]['delete']):6.2f} ms "
                  f"[{ms(pct(s[k]['delete'], 10)):6.2f}-{ms(pct(s[k]['delete'], 90)):6.2f}]  "
                  f"create + delete {ms(med[k]['both']):7.2f} ms")
        for p in ("create", "delete", "both"):
            m = {k: med[k][p] for k in keys}
            print(f"  {p:<6}: mounts/env (M-A) {ms(m['M'] - m['A']):+.2f} ms, two no-op hooks as runc "
                  f"runs them (T-M) {ms(m['T'] - m['M']):+.2f} ms, gpushare's hooks beyond that (H-T) "
                  f"{ms(m['H'] - m['T']):+.2f} ms, shim (B-H) {ms(m['B'] - m['H']):+.2f} ms, total (B-A) "
                  f"{ms(m['B'] - m['A']):+.2f} ms", flush=True)

    def bench_passthrough(self, rounds):
        print("[3] passthrough commands on a running container: runc vs gpushare-runtime", flush=True)
        self.start_pt_container()
        cid, b = self.pt_container, self.bundles / self.pt_container
        cmds = {"state": ["state", cid], "kill": ["kill", cid, "WINCH"]}  # WINCH: ignored by sleep
        s = {k: {"A": [], "B": []} for k in cmds}
        for r in range(-3, rounds * 3):  # cheap commands: 3x the rounds, 3 warm-up rounds
            for k, rest in cmds.items():
                for side in self.order(r):
                    t = self.run(side, b, rest)
                    if r >= 0:
                        s[k][side].append(t)
        self.summary("passthrough.state", s["state"]["A"], s["state"]["B"], T_PASS, "passthrough `state`")
        self.summary("passthrough.kill", s["kill"]["A"], s["kill"]["B"], T_PASS, "passthrough `kill`")

    # The cold create's phases: (label, event that ends it). Each event is the first line
    # of the round's log (after the create was issued) containing the text.
    COLD_EVENTS = [
        ("shim start: exec, config, request resolved", "request resolved"),
        ("shim: identity lock", "identity lock taken"),
        ("shim: daemon directories and tmpfs mounts (skeleton)", "daemon directories made"),
        ("shim: spec edited and saved", "spec edited for MPS"),
        ("runc create until the createRuntime hook runs", "createRuntime hook started"),
        ("hook: lock, daemon record, supervisor spawned", "supervisor spawned"),
        ("supervisor process start", "supervisor started"),
        ("supervisor: record, cgroup, private /dev/shm, daemon spawned", "MPS control daemon spawned"),
        ("control daemon start until it answers a command", "MPS control daemon answered"),
        ("limits applied, record ready", "MPS control daemon ready"),
        ("hook: sees ready, writes the container record", "container attached to MPS daemon"),
    ]

    def cold_parts(self, log_at, wall):
        """Splits one cold create (wall = its start and end, ns since the epoch) at the
        timestamps of gpushare's debug events in the log written since `log_at`."""
        # The supervisor may log "ready" just after the create returned: wait for it.
        deadline = time.monotonic() + 5
        while True:
            with open(self.log, "rb") as f:
                f.seek(log_at)
                text = f.read().decode(errors="replace")
            if all(t in text for _, t in self.COLD_EVENTS) or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        lines = text.splitlines()
        stamps = []
        for line in lines:
            m = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?Z", line)
            if m:
                sec = calendar.timegm(time.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S"))
                stamps.append((int(sec) * 10**9 + int(float(m.group(2) or 0) * 1e9), line))
        ats = []
        for _, text in self.COLD_EVENTS:
            at = next((t for t, line in stamps if text in line), None)
            if at is None:
                raise BenchError(f"cold start: no log event {text!r}")
            ats.append(at)
        # Processes log concurrently: the supervisor may log its start before the hook
        # logs the spawn, and the hook may see the ready record before the supervisor logs
        # it. A phase ends at its event or at any later phase's, whichever came first.
        for i in range(len(ats) - 2, -1, -1):
            ats[i] = min(ats[i], ats[i + 1])
        parts, prev = {}, wall[0]
        for (label, _), at in zip(self.COLD_EVENTS, ats):
            parts[label] = ms(at - prev)
            prev = at
        parts["runc finishes the create; the create returns"] = ms(wall[1] - prev)
        parts["total (create issued to create returned)"] = ms(wall[1] - wall[0])
        return parts

    def bench_cold(self, rounds):
        print("[4] cold start: create of the first container of a new identity (new uid each "
              "round) until it returns with the daemon ready; A = runc create of the same bundle", flush=True)
        a, bs, parts = [], [], []
        for r in range(-1, rounds):
            uid = UID_COLD + r + 1
            spec_bytes = self.request_spec(uid)
            for side in self.order(r):
                cid = f"c{r + 1}{side.lower()}"
                b = self.bundle(cid, spec_bytes)
                before = set(self.daemon_ids())
                log_at = self.log.stat().st_size if self.log.exists() else 0
                # B runs at log-level debug: its events mark the phases (cold_parts).
                t = self.run(side, b, ["create", "--bundle", str(b), "--pid-file", str(b / "pid"), cid],
                             env=dict(self.env, GPUSHARE_CONFIG=str(self.cfg_debug)) if side == "B" else None)
                new = [d for d in self.daemon_ids() if d not in before]
                if side == "B":
                    if len(new) != 1:
                        raise BenchError(f"cold create made {len(new)} daemons: {new}")
                    rec = self.record(new[0])
                    if rec["status"] != "ready" or not rec.get("daemon"):
                        raise BenchError(f"create returned before the daemon was ready: {rec}")
                    if r >= 0:
                        bs.append(t)
                        parts.append(self.cold_parts(log_at, self.last_wall))
                elif r >= 0:
                    a.append(t)
                self.run(side, b, ["start", cid], timed=False)
                self.wait_exit(int((b / "pid").read_text()))
                self.run(side, b, ["delete", cid], timed=False)
                for d in new:
                    self.stop_daemon(d)
        self.summary("cold.create", a, bs)
        med = ms(statistics.median(bs))
        ok = med <= T_COLD_MS
        self.results["cold.create"]["daemon_start_ms"] = med - ms(statistics.median(a))
        self.verdicts.append(("cold start to ready daemon (simulator)", f"{med:.1f} ms",
                              f"<= {T_COLD_MS:.0f} ms", ok))
        self.verdicts.append(("cold start p50", f"{med:.1f} ms",
                              f"<= {T_COLD_P50_MS:.0f} ms", med <= T_COLD_P50_MS))
        names = list(parts[0])
        self.results["cold.parts_ms"] = {
            k: {"median": statistics.median(p[k] for p in parts),
                "p10": pct([p[k] for p in parts], 10), "p90": pct([p[k] for p in parts], 90),
                "samples": [p[k] for p in parts]} for k in names}
        print("  cold start, part by part (ms, median [p10-p90] over rounds; from gpushare's "
              "debug log timestamps and the script's clock):")
        for k in names:
            v = self.results["cold.parts_ms"][k]
            print(f"    {k:<62} {v['median']:6.2f} [{v['p10']:5.2f}-{v['p90']:6.2f}]")
        print(f"  cold start median {med:.1f} ms (p90 {ms(pct(bs, 90)):.1f}); runc's own create "
              f"{ms(statistics.median(a)):.1f} ms; daemon start adds "
              f"{med - ms(statistics.median(a)):.1f} ms  {'PASS' if ok else 'MISS'} (<= {T_COLD_MS:.0f} ms)",
              flush=True)

    def burst_once(self, side, r, n):
        uid = UID_BURST + r
        spec_bytes = self.request_spec(uid)
        bundles = [self.bundle(f"x{r}{side.lower()}{i}", spec_bytes) for i in range(n)]
        before_log = self.log.stat().st_size if self.log.exists() else 0
        before = set(self.daemon_ids())
        lat = [None] * n
        rcs = [None] * n
        barrier = threading.Barrier(n)
        exe = RUNC if side == "A" else str(RUNTIME)

        def one(i):
            b = bundles[i]
            argv = [exe, "--root", str(self.runc_root), "--log", str(b / "log.json"),
                    "--log-format", "json", "create", "--bundle", str(b), b.name]
            with open(b / "out", "ab") as out:
                barrier.wait()
                t0 = time.perf_counter_ns()
                rcs[i] = subprocess.call(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                         env=self.env)
                lat[i] = time.perf_counter_ns() - t0

        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        t0 = time.perf_counter_ns()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter_ns() - t0
        failures = [bundles[i].name + ": " + self.last_error(bundles[i]) for i in range(n) if rcs[i] != 0]
        new = [d for d in self.daemon_ids() if d not in before]
        started = None
        if side == "B":
            with open(self.log, "rb") as f:
                f.seek(before_log)
                text = f.read().decode(errors="replace")
            started = len(re.findall(r"started[=\":]+true", text))
            attached = set()
            for b in bundles:
                ann = json.loads((b / "config.json").read_bytes()).get("annotations", {})
                attached.add(ann.get("gpushare.io/daemon"))
            if attached != set(new):
                failures.append(f"containers attached to {attached}, new daemon dirs {new}")
        # Clean up (untimed): delete the created containers, stop the daemon.
        with ThreadPoolExecutor(8) as ex:
            list(ex.map(lambda b: self.run(side, b, ["delete", "-f", b.name], check=False, timed=False),
                        bundles))
        for d in new:
            self.stop_daemon(d)
        return {"latencies_ms": [ms(x) for x in lat], "failures": failures, "daemons": len(new),
                "started_in_log": started, "wall_ms": ms(wall),
                "p50_ms": ms(pct(lat, 50)), "p99_ms": ms(pct(lat, 99)), "max_ms": ms(max(lat))}

    def bench_burst(self, rounds, n=64):
        print(f"[5] {n} simultaneous creates on one new identity (cold daemon), A = {n} runc creates", flush=True)
        out = {"A": [], "B": []}
        for r in range(rounds):
            for side in self.order(r):
                res = self.burst_once(side, r, n)
                out[side].append(res)
                extra = "" if side == "A" else (f"  daemons={res['daemons']} started(log)="
                                                f"{res['started_in_log']}")
                print(f"  round {r} {side}: p50 {res['p50_ms']:7.1f} ms  p99 {res['p99_ms']:7.1f} ms"
                      f"  p99/p50 {res['p99_ms'] / res['p50_ms']:.2f}  wall {res['wall_ms']:7.1f} ms"
                      f"  failures={len(res['failures'])}{extra}", flush=True)
                for f in res["failures"][:5]:
                    print(f"    failure: {f}")
        self.results["burst"] = out
        b = out["B"]
        daemons_ok = all(x["daemons"] == 1 and x["started_in_log"] == 1 for x in b)
        fail_ok = all(not x["failures"] for x in out["B"])
        spread_b = statistics.median(x["p99_ms"] / x["p50_ms"] for x in b)
        spread_a = statistics.median(x["p99_ms"] / x["p50_ms"] for x in out["A"])
        p50_ratio = statistics.median(x["p50_ms"] for x in b) / statistics.median(x["p50_ms"] for x in out["A"])
        p99_ratio = statistics.median(x["p99_ms"] for x in b) / statistics.median(x["p99_ms"] for x in out["A"])
        self.results["burst_summary"] = {"spread_B": spread_b, "spread_A": spread_a,
                                         "p50_ratio": p50_ratio, "p99_ratio": p99_ratio}
        print(f"  B p99/p50 (median over rounds) {spread_b:.2f}, runc alone {spread_a:.2f}; "
              f"B/A p50 {p50_ratio:.2f}, p99 {p99_ratio:.2f}", flush=True)
        self.verdicts.append((f"{n} simultaneous creates: daemons started",
                              ", ".join(str(x["daemons"]) for x in b), "1 per round", daemons_ok))
        self.verdicts.append((f"{n} simultaneous creates: failures",
                              ", ".join(str(len(x["failures"])) for x in b), "0", fail_ok))
        self.verdicts.append((f"{n} simultaneous creates: p99/p50",
                              f"{spread_b:.2f} (runc alone {spread_a:.2f})", "<= 3", spread_b <= T_BURST_SPREAD))

    def bench_overhead(self, reps):
        """The shim's and the hook's own cost in absolute terms: B = gpushare-runtime with
        low-level-runtime = `true` (so B - A is everything the shim does before its exec),
        A = `true` with the same argv; the hooks against `true` fed the same stdin.

        With --old DIR a third side C runs the binaries in DIR (another build's
        target/release) in the same rotation, so two builds are compared in one run and the
        machine's load falls on both alike. With --instructions each command of B (and C) is
        also run under callgrind once: user-space instructions, which load does not change."""
        print("[7] own cost (informational): B = gpushare's binary, A = `true` with the same argv/stdin"
              + (f", C = the build in {self.args.old}" if self.args.old else ""), flush=True)
        env_t = dict(self.env, GPUSHARE_CONFIG=str(self.cfg_rss))
        builds = {"B": REL}
        if self.args.old:
            # Copies, as scripts/bench makes of this build's binaries (installed_copy).
            old = self.work / "old-bin"
            old.mkdir(exist_ok=True)
            for name in ("gpushare", "gpushare-runtime"):
                installed_copy(Path(self.args.old) / name, old / name)
            builds["C"] = old

        def timed(argv, env, data=None):
            self.pre()
            t0 = time.perf_counter_ns()
            p = subprocess.run(argv, env=env, input=data, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
            t = time.perf_counter_ns() - t0
            if p.returncode != 0:
                raise BenchError(f"{argv} exited {p.returncode}")
            return t

        def instructions(argv, env, data=None):
            """User-space instructions of one run up to its exit or its execve (callgrind
            dumps before an execve: what the exec'd program does is not ours)."""
            out = Path(tempfile.mkdtemp(prefix="cg.", dir=self.work))
            p = subprocess.run(["valgrind", "--tool=callgrind", "--dump-before=*execve*",
                                f"--callgrind-out-file={out}/cg.%p"] + argv,
                               env=env, input=data, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            counts = [int(m.group(1)) for f in out.iterdir()
                      for m in re.finditer(rb"^summary: (\d+)", f.read_bytes(), re.M)]
            shutil.rmtree(out)
            if p.returncode != 0 or not counts:
                raise BenchError(f"callgrind of {argv} exited {p.returncode}: {p.stderr[-300:]!r}")
            return sum(counts)

        def ab(name, a_argv, b_argv, env, prep=None, after=None, data=None):
            """b_argv(bin_dir, ctx) gives the argv of a build's side."""
            s = {side: [] for side in ["A"] + list(builds)}
            sides = list(s)
            for r in range(-5, reps):
                k = r % len(sides)
                for side in sides[k:] + sides[:k]:
                    if side == "A":
                        t = timed(a_argv, env, data)
                    else:
                        ctx = prep() if prep else None
                        t = timed(b_argv(builds[side], ctx), env, data)
                        if after:
                            after(ctx)
                    if r >= 0:
                        s[side].append(t)
            self.summary(name, s["A"], s["B"])
            row = self.results[name]
            base = statistics.median(s["A"])
            row["own_cost_us"] = (statistics.median(s["B"]) - base) / 1e3
            if "C" in s:
                row["C"] = {"median_ms": ms(statistics.median(s["C"])), "n": len(s["C"])}
                row["old_own_cost_us"] = (statistics.median(s["C"]) - base) / 1e3
                print(f"  {'':<34} C {ms(statistics.median(s['C'])):7.2f} ms: own cost "
                      f"new {row['own_cost_us']:.0f} us, old {row['old_own_cost_us']:.0f} us", flush=True)
            if self.args.instructions:
                # Twice per side, alternating, the least kept: a hook's first run can find
                # work its later runs do not (a poststop releasing its record), and the
                # second pass sees both builds on the same state.
                counts = {side: [] for side in builds}
                for _ in range(2):
                    for side, d in builds.items():
                        ctx = prep() if prep else None
                        counts[side].append(instructions(b_argv(d, ctx), env, data))
                        if after:
                            after(ctx)
                row["instructions"] = {side: min(n) for side, n in counts.items()}
                print(f"  {'':<34} instructions: " + ", ".join(
                    f"{side} {n:,}" for side, n in row["instructions"].items()), flush=True)
            return row["own_cost_us"]

        g = ["--root", str(self.runc_root), "--log", str(self.work / "ov.json"), "--log-format", "json"]
        cost = {}
        # The floor of any exec-through shim: a static C program that only execs `true`.
        floor = self.static_c("floor", 'int main(int c, char **v, char **e) '
                              '{ (void)c; execve("%s", v, e); return 127; }' % TRUE)
        if floor:
            cost["floor"] = ab("own.floor: static C exec-through", [TRUE] + g + ["state", "pt"],
                               lambda d, _: [str(floor)] + g + ["state", "pt"], env_t)
        else:
            print("  (no C compiler: the exec-through floor row is skipped)")
        # The floor of the shim's kind: a Rust program linked as the shim is (static-pie,
        # panic=abort, opt-level 3) whose main only execs, std's runtime start included.
        rust_floor = self.work / "floor-rust.ld"
        (self.work / "floor-rust.rs").write_text(
            "use std::os::unix::process::CommandExt;\n"
            "fn main() {\n"
            "    let _ = std::process::Command::new(%s).args(std::env::args_os().skip(1)).exec();\n"
            "    std::process::exit(127);\n}\n" % json.dumps(str(TRUE)))
        if subprocess.run(["rustc", "--edition", "2021", "-C", "opt-level=3", "-C", "panic=abort",
                           "-C", "target-feature=+crt-static", "-o", str(rust_floor),
                           str(self.work / "floor-rust.rs")], stderr=subprocess.DEVNULL).returncode == 0:
            rust_floor = installed_copy(rust_floor, self.work / "floor-rust")
            cost["floor_rust"] = ab("own.floor: Rust static-pie exec-through", [TRUE] + g + ["state", "pt"],
                                    lambda d, _: [str(rust_floor)] + g + ["state", "pt"], env_t)
        else:
            print("  (rustc could not build the Rust floor: its row is skipped)")
        cost["passthrough"] = ab("own.shim passthrough (state)", [TRUE] + g + ["state", "pt"],
                                 lambda d, _: [str(d / "gpushare-runtime")] + g + ["state", "pt"], env_t)
        b0 = self.bundle("ov0", self.spec(["true"]))
        create0 = g + ["create", "--bundle", str(b0), "ov0"]
        cost["create"] = ab("own.shim create, no request", [TRUE] + create0,
                            lambda d, _: [str(d / "gpushare-runtime")] + create0, env_t)
        req = self.request_spec(UID_WARM)
        n = iter(range(100_000))

        def state_of(b, cid):
            ann = json.loads((b / "config.json").read_bytes())["annotations"]
            return json.dumps({"ociVersion": "1.0.2", "id": cid, "status": "creating",
                               "pid": self.pt_pid, "bundle": str(b), "annotations": ann}).encode()

        def prep():
            cid = f"ovw{next(n)}"
            return self.bundle(cid, req), cid

        def release(ctx):
            b, cid = ctx
            subprocess.run([str(GPUSHARE), "hook", "poststop"], env=self.env,
                           input=state_of(b, cid), check=True)

        cost["create_warm"] = ab("own.shim create, request (warm)", [TRUE] + create0,
                                 lambda d, ctx: [str(d / "gpushare-runtime")] + g
                                 + ["create", "--bundle", str(ctx[0]), ctx[1]],
                                 env_t, prep=prep, after=release)
        b1, cid1 = prep()
        self.run("B", b1, ["create", "--bundle", str(b1), cid1], env=env_t, timed=False)  # edits, execs true
        st = state_of(b1, cid1)
        cost["hook_create_runtime"] = ab("own.hook create-runtime (warm)", [TRUE],
                                         lambda d, _: [str(d / "gpushare"), "hook", "create-runtime"],
                                         self.env, data=st)
        cost["hook_poststop"] = ab("own.hook poststop", [TRUE],
                                   lambda d, _: [str(d / "gpushare"), "hook", "poststop"],
                                   self.env, data=st)
        self.results["own_cost_us"] = cost
        print("  own cost (median B - median A): " +
              ", ".join(f"{k} {v:.0f} us" for k, v in cost.items()), flush=True)
        if "floor" in cost:
            print("  own cost as a multiple of the floor: " + ", ".join(
                f"{k} {v / cost['floor']:.2f}x" for k, v in cost.items() if k not in ("floor", "floor_rust"))
                + ("; old build: " + ", ".join(
                    f"{k} {self.results[name]['old_own_cost_us'] / cost['floor']:.2f}x"
                    for k, name in OWN_ROWS.items()) if self.args.old else ""), flush=True)
        if "floor_rust" in cost:
            print("  own cost as a multiple of the Rust static-pie floor: " + ", ".join(
                f"{k} {v / cost['floor_rust']:.2f}x" for k, v in cost.items()
                if k not in ("floor", "floor_rust")), flush=True)
        pt = self.results.get("passthrough.state")
        if pt:
            runc_ms = pt["A"]["median_ms"]
            print(f"  implied passthrough ratio 1 + cost/runc state ({runc_ms:.2f} ms): shim "
                  f"{1 + cost['passthrough'] / 1e3 / runc_ms:.3f}"
                  + (f", floor {1 + cost['floor'] / 1e3 / runc_ms:.3f}" if "floor" in cost else ""),
                  flush=True)

    def maxrss(self, argv, env, stdin=None, reps=5):
        """Peak RSS in KiB (GNU time's %M, wait4's ru_maxrss) of `argv`, max over reps."""
        vals = []
        for i in range(reps):
            out = self.work / "time.out"
            data = stdin(i) if callable(stdin) else stdin
            p = subprocess.run(["/usr/bin/time", "-f", "%M", "-o", str(out)] + argv, env=env,
                               input=data, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            if p.returncode != 0:
                raise BenchError(f"{argv} exited {p.returncode}: {p.stderr.decode(errors='replace')}")
            vals.append(int(out.read_text().split()[-1]))
        return vals

    def bench_rss(self, reps):
        print("[6] peak RSS (GNU time %M = ru_maxrss; the shim measured execing `true`, not runc)", flush=True)
        env_rss = dict(self.env, GPUSHARE_CONFIG=str(self.cfg_rss))
        rows = {}
        rows["true (floor of any exec)"] = self.maxrss([TRUE], self.env, reps=reps)
        rows["runc state (context)"] = self.maxrss(
            [RUNC, "--root", str(self.runc_root), "state", self.pt_container], self.env, reps=reps)

        plain = self.spec(["true"])
        k = iter(range(10_000))

        def shim_create(spec_bytes, prefix, n=reps):
            vals, made = [], []
            for _ in range(n):
                cid = f"{prefix}{next(k)}"
                b = self.bundle(cid, spec_bytes)
                made.append((b, cid))
                vals += self.maxrss([str(RUNTIME), "--root", str(self.runc_root), "--log",
                                     str(b / "log.json"), "--log-format", "json", "create",
                                     "--bundle", str(b), cid], env_rss, reps=1)
            return vals, made

        rows["shim create, no request"], _ = shim_create(plain, "m")
        warm_vals, warm_made = shim_create(self.request_spec(UID_WARM), "mw")
        rows["shim create, request (warm daemon)"] = warm_vals
        rows["shim passthrough (state)"] = self.maxrss(
            [str(RUNTIME), "--root", str(self.runc_root), "state", self.pt_container], env_rss, reps=reps)

        def state_of(b, cid):
            ann = json.loads((b / "config.json").read_bytes())["annotations"]
            return json.dumps({"ociVersion": "1.0.2", "id": cid, "status": "creating",
                               "pid": self.pt_pid, "bundle": str(b), "annotations": ann}).encode()

        hook = [str(GPUSHARE), "hook"]
        rows["hook create-runtime (warm daemon)"] = [
            self.maxrss(hook + ["create-runtime"], self.env, stdin=state_of(b, cid), reps=1)[0]
            for b, cid in warm_made]
        rows["hook poststop"] = [
            self.maxrss(hook + ["poststop"], self.env, stdin=state_of(b, cid), reps=1)[0]
            for b, cid in warm_made]
        # Cold: a new identity per rep; the hook starts the supervisor and waits for ready.
        cold = []
        for i in range(reps):
            before = set(self.daemon_ids())
            _, made = shim_create(self.request_spec(UID_RSS + i), "mc", 1)
            (b, cid), = made
            cold += self.maxrss(hook + ["create-runtime"], self.env, stdin=state_of(b, cid), reps=1)
            self.maxrss(hook + ["poststop"], self.env, stdin=state_of(b, cid), reps=1)
            for d in set(self.daemon_ids()) - before:
                self.stop_daemon(d)
        rows["hook create-runtime (cold: starts the daemon)"] = cold

        self.results["rss_kib"] = rows
        for name, v in rows.items():
            print(f"  {name:<46} max {max(v) / 1024:6.2f} MiB  median {statistics.median(v) / 1024:6.2f} MiB")
        shim = max(max(rows[k]) for k in rows if k.startswith("shim"))
        hookv = max(max(rows[k]) for k in rows if k.startswith("hook"))
        self.verdicts.append(("peak RSS, shim (max over create/passthrough)", f"{shim / 1024:.2f} MiB",
                              "<= 8 MiB", shim <= T_SHIM_RSS))
        self.verdicts.append(("peak RSS, hook (max over create-runtime/poststop)", f"{hookv / 1024:.2f} MiB",
                              "<= 16 MiB", hookv <= T_HOOK_RSS))

    # ---------------------------------------------------------------- node scale

    def measure(self, argv, env, stdin=None, out=None):
        """Runs `argv` once under GNU time after `pre()`; returns (wall ns, peak RSS KiB).
        The peak RSS is GNU time's %M (wait4's ru_maxrss: the process and the children it
        waited for). GNU time forks from a small process; Python's fork would carry the
        script's own ~20 MiB into ru_maxrss. The wall time includes GNU time's own start
        (`floor` in the results)."""
        self.pre()
        # stderr to a file, never a pipe: a created container's init holds it open.
        errf, rss = self.work / "measure.err", self.work / "measure.rss"
        with open(out or os.devnull, "wb") as sink, open(errf, "wb") as err:
            ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.perf_counter_ns()
            p = subprocess.run(["/usr/bin/time", "-f", "%M", "-o", str(rss)] + [str(a) for a in argv],
                               env=env, input=stdin, stdout=sink, stderr=err)
            t = time.perf_counter_ns() - t0
            ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        if p.returncode != 0:
            raise BenchError(f"{' '.join(map(str, argv))} exited {p.returncode}: "
                             f"{errf.read_text(errors='replace')[-500:]}")
        # CPU time (user + system) of GNU time and everything it waited for: on a loaded
        # machine the wall time says how long it waited for a CPU, this what it asked of one.
        cpu = (ru1.ru_utime - ru0.ru_utime + ru1.ru_stime - ru0.ru_stime) * 1e9
        return t, int(rss.read_text().split()[-1]), cpu

    def scale_identity(self, k):
        """The k-th of the 50 node-scale identities: 25 uids x GPUs 0 and 1."""
        return UID_SCALE + k // 2, str(k % 2)

    def scale_create(self, i, env):
        """Container i of the node-scale set, on identity i % daemons: a busybox `sleep`
        created through the shim (its createRuntime hook writes the container record) and
        started with runc. Returns its pid."""
        uid, dev = self.scale_identity(i % self.args.scale_daemons)
        cid = f"s{i}"
        b = self.bundle(cid, self.spec(["sleep", "1000000"], uid, {"gpushare.io/device": dev}))
        self.run("B", b, ["create", "--bundle", str(b), "--pid-file", str(b / "pid"), cid],
                 env=env, timed=False)
        self.run("A", b, ["start", cid], env=env, timed=False)
        return int((b / "pid").read_text())

    def scale_state(self, cid, pid, annotations):
        return json.dumps({"ociVersion": "1.0.2", "id": cid, "status": "creating", "pid": pid,
                           "bundle": str(self.bundles / cid), "annotations": annotations}).encode()

    def bench_scale(self, reps):
        n_daemons = self.args.scale_daemons
        points = [int(x) for x in self.args.scale_points.split(",")]
        print(f"[9] node scale: {n_daemons} daemons (25 uids x 2 GPUs), live busybox containers "
              f"created through the shim at {points}; {reps} runs per command; stale records "
              f"for gc: {self.args.scale_stale}", flush=True)
        env = dict(self.env, GPUSHARE_CONFIG=str(self.cfg_scale))
        g = str(GPUSHARE)
        # The daemons first, through the operator's path (ensure writes their records).
        t0 = time.perf_counter()
        for k in range(n_daemons):
            uid, dev = self.scale_identity(k)
            subprocess.run([g, "daemon", "start", "--device", dev, "--uid", str(uid)], env=env,
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, check=True)
        print(f"  {n_daemons} daemons started in {time.perf_counter() - t0:.1f} s", flush=True)
        daemons = self.daemon_ids()
        if len(daemons) != n_daemons:
            raise BenchError(f"expected {n_daemons} daemons, found {len(daemons)}")
        commands = {
            "status": [g, "status"],
            "status --json": [g, "status", "--json"],
            "status --format prometheus": [g, "status", "--format", "prometheus"],
            "daemon list": [g, "daemon", "list"],
            "gc (nothing stale)": [g, "gc"],
        }
        # The floor: GNU time running `true` (every figure below includes it).
        floor = [self.measure([TRUE], env) for _ in range(reps)]
        self.results["scale_floor"] = {"median_ms": ms(statistics.median(x[0] for x in floor)),
                                       "cpu_median_ms": ms(statistics.median(x[2] for x in floor)),
                                       "peak_rss_kib": max(x[1] for x in floor)}
        print(f"  floor: GNU time running `true` {ms(statistics.median(x[0] for x in floor)):.2f} ms, "
              f"peak RSS {max(x[1] for x in floor) / 1024:.2f} MiB", flush=True)
        made = 0
        pids = {}
        out = self.work / "scale.out"
        results = {}
        for n in points:
            t0 = time.perf_counter()
            with ThreadPoolExecutor(self.args.scale_jobs) as ex:
                for i, pid in zip(range(made, n), ex.map(lambda i: self.scale_create(i, env),
                                                          range(made, n))):
                    pids[i] = pid
            print(f"  {n - made} containers created and started in "
                  f"{time.perf_counter() - t0:.1f} s", flush=True)
            made = n
            row = {}
            for name, argv in commands.items():
                samples, old = [], []
                for _ in range(reps):
                    samples.append(self.measure(argv, env, out=out))
                    if self.args.scale_old:
                        old.append(self.measure([self.args.scale_old + "/gpushare"] + argv[1:], env,
                                                out=self.work / "scale-old.out"))
                row[name] = samples
                if old:
                    row[name + " [old build]"] = old
                if name == "status --json":
                    v = json.loads(out.read_text())
                    cs = sum(len(d["containers"]) for d in v["daemons"])
                    bad = [d["id"] for d in v["daemons"] if d["health"] != "ok"]
                    if len(v["daemons"]) != n_daemons or cs != n or bad:
                        raise BenchError(f"status at {n}: {len(v['daemons'])} daemons, {cs} "
                                         f"containers, not ok: {bad}")
                if name.startswith("gc") and out.read_text().strip():
                    raise BenchError(f"gc acted on live state: {out.read_text()[:500]}")
            # A create with a request on a warm daemon (shim + runc create + createRuntime
            # hook), then the two hooks on their own as runc runs them, then the poststop.
            create, hook_cr, hook_ps, runc_create = [], [], [], []
            for r in range(reps):
                # Context: runc's own create of the same kind of bundle (the floor of a create).
                cid = f"s{200_000 + n * 100 + r}"
                uid, dev = self.scale_identity(r % n_daemons)
                b = self.bundle(cid, self.spec(["sleep", "1000000"], uid, {"gpushare.io/device": dev}))
                runc_create.append(self.measure(self.argv("A", b, ["create", "--bundle", str(b), cid]), env))
                subprocess.run([RUNC, "--root", str(self.runc_root), "delete", "-f", cid], env=env,
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, check=True)
                i = 100_000 + n * 100 + r
                uid, dev = self.scale_identity(r % n_daemons)
                cid = f"s{i}"
                b = self.bundle(cid, self.spec(["sleep", "1000000"], uid, {"gpushare.io/device": dev}))
                create.append(self.measure(self.argv("B", b, ["create", "--bundle", str(b), cid]), env))
                ann = json.loads((b / "config.json").read_bytes())["annotations"]
                subprocess.run([RUNC, "--root", str(self.runc_root), "delete", "-f", cid], env=env,
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, check=True)
                st = self.scale_state(cid + "h", pids[r % n], ann)
                hook_cr.append(self.measure([g, "hook", "create-runtime"], env, stdin=st))
                hook_ps.append(self.measure([g, "hook", "poststop"], env, stdin=st))
            row["runc create alone (context, no gpushare)"] = runc_create
            row["create, request, warm daemon (shim + runc + hook)"] = create
            row["hook create-runtime (warm)"] = hook_cr
            row["hook poststop"] = hook_ps
            results[n] = row
            for name, samples in row.items():
                ts = [x[0] for x in samples]
                print(f"  {n:>5} containers  {name:<50} {ms(statistics.median(ts)):8.2f} ms "
                      f"[{ms(min(ts)):7.2f}-{ms(max(ts)):7.2f}]  CPU "
                      f"{ms(statistics.median(x[2] for x in samples)):7.2f} ms  peak RSS "
                      f"{max(x[1] for x in samples) / 1024:6.2f} MiB", flush=True)
        self.results["scale"] = {
            str(n): {name: {"median_ms": ms(statistics.median(x[0] for x in s)),
                            "cpu_median_ms": ms(statistics.median(x[2] for x in s)),
                            "min_ms": ms(min(x[0] for x in s)), "max_ms": ms(max(x[0] for x in s)),
                            "peak_rss_kib": max(x[1] for x in s),
                            "samples_ms": [ms(x[0]) for x in s]}
                     for name, s in row.items()}
            for n, row in results.items()}
        last = results[points[-1]]
        for name, s in last.items():
            if name.startswith("runc") or name.endswith("[old build]"):
                continue
            med = ms(statistics.median(x[0] for x in s))
            self.verdicts.append((f"{points[-1]} containers: {name}", f"{med:.1f} ms",
                                  f"<= {T_SCALE_MS:.0f} ms", med <= T_SCALE_MS))
        if self.args.scale_stale:
            self.scale_gc_stale(env, daemons, pids)

    def scale_gc_stale(self, env, daemons, pids):
        """gc over --scale-stale stale container records beside the live ones. The records
        are written by the createRuntime hook (the code a real create runs) for a `sleep`
        that is then killed, spread over the daemons; their bytes are kept and put back
        before each further gc run."""
        n = self.args.scale_stale
        g = str(GPUSHARE)
        victim = subprocess.Popen(["sleep", "1000000"])
        anns = {}
        for d in daemons:
            rec = self.record(d)
            uid, dev = rec["identity"]["uid"], "0" if rec["identity"]["devices"] == [GPU0] else "1"
            b = self.bundles / f"ann-{d}"
            b.mkdir(parents=True)
            (b / "config.json").write_bytes(self.spec(["true"], uid, {"gpushare.io/device": dev}))
            subprocess.run([str(RUNTIME), "--root", str(self.runc_root), "create", "--bundle",
                            str(b), f"ann-{d}"], check=True,
                           env=dict(env, GPUSHARE_CONFIG=str(self.cfg_rss)))
            anns[d] = json.loads((b / "config.json").read_bytes())["annotations"]
            # The shim wrote a pending record for ann-<d>: the poststop drops it.
            subprocess.run([g, "hook", "poststop"], env=env, check=True,
                           input=self.scale_state(f"ann-{d}", victim.pid, anns[d]))
        t0 = time.perf_counter()

        def one(j):
            d = daemons[j % len(daemons)]
            subprocess.run([g, "hook", "create-runtime"], env=env, check=True,
                           input=self.scale_state(f"st{j}", victim.pid, anns[d]))

        with ThreadPoolExecutor(self.args.scale_jobs) as ex:
            list(ex.map(one, range(n)))
        victim.kill()
        victim.wait()
        print(f"  {n} stale records written by the createRuntime hook in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
        keep = self.work / "stale"
        for d in daemons:
            src = self.state / "mps" / d / "containers"
            dst = keep / d
            dst.mkdir(parents=True)
            for f in src.iterdir():
                if f.name.startswith("st"):
                    shutil.copy2(f, dst / f.name)
        runs, old_runs = [], []
        out = self.work / "gc.out"
        for r in range(self.args.scale_gc_runs):
            if r:
                for d in daemons:
                    for f in (keep / d).iterdir():
                        shutil.copy2(f, self.state / "mps" / d / "containers" / f.name)
            # Writeback of the records just written is not gc's work: flushed first.
            os.sync()
            # With --scale-old the old build's gc runs first on the same records, every run.
            if self.args.scale_old:
                old_runs.append(self.measure([self.args.scale_old + "/gpushare", "gc"], env, out=out))
                for d in daemons:
                    for f in (keep / d).iterdir():
                        shutil.copy2(f, self.state / "mps" / d / "containers" / f.name)
                os.sync()
            runs.append(self.measure([g, "gc"], env, out=out))
            removed = sum(int(m) for m in re.findall(r"removed (\d+) stale container record",
                                                     out.read_text()))
            left = sum(1 for d in daemons for f in (self.state / "mps" / d / "containers").iterdir()
                       if f.name.startswith("st"))
            if removed != n or left:
                raise BenchError(f"gc removed {removed} of {n} stale records, {left} left")
        live = sum(1 for d in daemons for f in (self.state / "mps" / d / "containers").iterdir())
        if live != len(pids):
            raise BenchError(f"after gc {live} records left, {len(pids)} containers live")
        # The floor: unlinking the same files, and nothing else (find -delete).
        floor = []
        for _ in range(self.args.scale_gc_runs):
            for d in daemons:
                for f in (keep / d).iterdir():
                    shutil.copy2(f, self.state / "mps" / d / "containers" / f.name)
            os.sync()
            floor.append(self.measure(["find", str(self.state / "mps"), "-path", "*/containers/st*",
                                       "-delete"], env))
        ts = [x[0] for x in runs]
        fl = [x[0] for x in floor]
        self.results["scale_gc_stale"] = {"stale": n, "live": len(pids),
                                          "median_ms": ms(statistics.median(ts)),
                                          "samples_ms": [ms(t) for t in ts],
                                          "cpu_median_ms": ms(statistics.median(x[2] for x in runs)),
                                          "peak_rss_kib": max(x[1] for x in runs),
                                          "floor_cpu_median_ms": ms(statistics.median(x[2] for x in floor)),
                                          "floor_find_delete_median_ms": ms(statistics.median(fl)),
                                          "floor_samples_ms": [ms(t) for t in fl]}
        if old_runs:
            self.results["scale_gc_stale"]["old_build_samples_ms"] = [ms(x[0]) for x in old_runs]
            self.results["scale_gc_stale"]["old_build_cpu_samples_ms"] = [ms(x[2]) for x in old_runs]
            print(f"  old build's gc over the same records: "
                  f"{ms(statistics.median(x[0] for x in old_runs)):.1f} ms", flush=True)
        print(f"  gc over {n} stale + {len(pids)} live records: {ms(statistics.median(ts)):.1f} ms "
              f"[{ms(min(ts)):.1f}-{ms(max(ts)):.1f}] CPU {ms(statistics.median(x[2] for x in runs)):.1f} ms, "
              f"peak RSS {max(x[1] for x in runs) / 1024:.2f} MiB; floor (find -delete of the same "
              f"{n} files) {ms(statistics.median(fl)):.1f} ms, CPU {ms(statistics.median(x[2] for x in floor)):.1f} ms",
              flush=True)
        med = ms(statistics.median(ts))
        self.verdicts.append((f"gc over {n} stale records", f"{med:.1f} ms",
                              f"<= {T_SCALE_MS:.0f} ms", med <= T_SCALE_MS))

    def scale_teardown(self):
        """Kills the node-scale containers, then deletes them (runc runs their poststop)."""
        if not self.runc_root.exists():
            return
        ids = subprocess.run([RUNC, "--root", str(self.runc_root), "list", "-q"],
                             capture_output=True, text=True).stdout.split()
        ids = [c for c in ids if c.startswith("s")]

        def kill_delete(c):
            subprocess.run([RUNC, "--root", str(self.runc_root), "kill", c, "KILL"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=self.env)
            subprocess.run([RUNC, "--root", str(self.runc_root), "delete", "-f", c],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=self.env)

        with ThreadPoolExecutor(8) as ex:
            list(ex.map(kill_delete, ids))


    # ---------------------------------------------------------------- report

    def machine(self):
        def sh(cmd):
            try:
                return subprocess.run(cmd, capture_output=True, text=True, shell=True).stdout.strip()
            except OSError:
                return "?"
        cpu = "?"
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
        return {
            "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
            "nproc": os.cpu_count(),
            "cpu": cpu,
            "kernel": os.uname().release,
            "runc": sh(f"{RUNC} --version | head -1"),
            "rustc": sh("rustc -V"),
            "loadavg": open("/proc/loadavg").read().split()[:3],
            "mem_total": sh("grep MemTotal /proc/meminfo"),
        }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=40, help="A/B rounds per benchmark (default 40)")
    ap.add_argument("--burst-rounds", type=int, default=3, help="rounds of the 64-create burst (default 3)")
    ap.add_argument("--burst", type=int, default=64, help="simultaneous creates (default 64)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 5 rounds, 1 burst round")
    ap.add_argument("--settle", type=float, default=50.0,
                    help="idle pause in ms before every timed command (default 50; see BENCHMARKS.md)")
    ap.add_argument("--primer", type=int, default=0,
                    help="execs of `true` right before every timed command (a busy-node regime; default 0)")
    ap.add_argument("--only", default="", help="comma-separated subset: noreq,warm,passthrough,cold,burst,rss,overhead,decompose,scale (scale runs only when named)")
    ap.add_argument("--scale-points", default="10,100,1000", help="live containers at which node scale is measured")
    ap.add_argument("--scale-daemons", type=int, default=50, help="daemons of the node-scale benchmark (at most 50)")
    ap.add_argument("--scale-stale", type=int, default=10000, help="stale container records for the gc run (0: none)")
    ap.add_argument("--scale-gc-runs", type=int, default=3, help="gc runs over the stale records")
    ap.add_argument("--scale-reps", type=int, default=7, help="runs per node-scale command")
    ap.add_argument("--scale-old", help="a directory with an older build's gpushare: status, daemon list "
                    "and gc are also measured with it, interleaved, on the same state")
    ap.add_argument("--scale-jobs", type=int, default=4, help="parallel creates while building the node-scale set")
    ap.add_argument("--json", help="also write every sample and result to this file")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (logs, bundles) for inspection")
    ap.add_argument("--old", metavar="DIR",
                    help="[7] also times the binaries in DIR (another build's target/release) in the same rotation")
    ap.add_argument("--instructions", action="store_true",
                    help="[7] also counts each binary's user-space instructions under callgrind (needs valgrind)")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.burst_rounds = 5, 1
    only = set(filter(None, args.only.split(","))) or {"noreq", "warm", "passthrough", "cold", "burst", "rss", "overhead", "decompose"}

    suite = Suite(args)

    def run():
        info = suite.machine()
        print(f"scripts/bench: {info['date']}  nproc={info['nproc']}  cpu={info['cpu']}  "
              f"kernel={info['kernel']}  {info['runc']}  {info['rustc']}  load={' '.join(info['loadavg'])}")
        print(f"scripts/bench: rounds={args.rounds} burst={args.burst}x{args.burst_rounds} "
              f"settle={args.settle:g}ms primer={args.primer}  "
              f"work dir {suite.work}  (times in ms: median [p10-p90])", flush=True)
        suite.setup()
        if "noreq" in only:
            suite.bench_noreq(args.rounds)
        if "warm" in only:
            suite.bench_warm(args.rounds)
        if "passthrough" in only:
            suite.bench_passthrough(args.rounds)
        if "cold" in only:
            suite.bench_cold(args.rounds)
        if "burst" in only:
            suite.bench_burst(args.burst_rounds, args.burst)
        if "rss" in only:
            suite.ensure_warm_daemon()
            suite.start_pt_container()
            suite.bench_rss(5)
        if "overhead" in only:
            suite.ensure_warm_daemon()
            suite.start_pt_container()
            suite.bench_overhead(args.rounds * 3)
        if "decompose" in only:
            suite.ensure_warm_daemon()
            suite.bench_decompose(args.rounds)
        if "scale" in only:
            try:
                suite.bench_scale(args.scale_reps)
            finally:
                suite.scale_teardown()
        info["loadavg_end"] = open("/proc/loadavg").read().split()[:3]
        print("\nscripts/bench: targets")
        w = max(len(v[0]) for v in suite.verdicts) if suite.verdicts else 10
        for name, value, target, ok in suite.verdicts:
            print(f"  {'PASS' if ok else 'MISS'}  {name:<{w}}  {value:<28} target {target}")
        missed = [v for v in suite.verdicts if not v[3]]
        print(f"scripts/bench: {len(suite.verdicts) - len(missed)} PASS, {len(missed)} MISS; "
              f"load at end {' '.join(info['loadavg_end'])}")
        if args.json:
            Path(args.json).write_text(json.dumps({
                "machine": info, "args": vars(args), "results": suite.results,
                "verdicts": [{"name": n, "value": v, "target": t, "pass": ok}
                             for n, v, t, ok in suite.verdicts]}, indent=1))
            print(f"scripts/bench: wrote {args.json}")

    return drive("scripts/bench", suite, run)


if __name__ == "__main__":
    sys.exit(main())
