"""runc and gpushare-runtime on the suite's world: the configurations each benchmark runs
under, bundles, one timed runtime command (A = runc, B = the shim, on the same argv), the
long-lived containers some benchmarks share, and the MPS daemons' records."""

import json
import os
import re
import resource
import shutil
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from .frame import BenchError
from .report import Report
from .world import GPUSHARE, RUNC, RUNTIME, TRUE, World, installed_copy

# Host uids used per benchmark (each cold round / burst round gets a new identity).
UID_WARM = 1000
UID_COLD = 20000
UID_BURST = 30000
UID_RSS = 40000
UID_SCALE = 50000


class Node:
    def __init__(self, args):
        self.args = args
        self.world = World("gsb.")
        self.work = self.world.work
        self.state = self.world.state
        self.log = self.world.log
        self.rootfs = self.world.rootfs
        self.runc_root = self.work / "r"
        self.cfg = self.work / "runtime.toml"
        self.cfg_rss = self.work / "rss.toml"
        self.cfg_debug = self.work / "debug.toml"
        self.cfg_scale = self.work / "scale.toml"
        self.bundles = self.work / "b"
        self.env = {
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "GPUSHARE_CONFIG": str(self.cfg),
        }
        self.report = Report()
        self.results = self.report.results
        self.summary = self.report.summary
        self.verdicts = self.report.verdicts
        self._base_spec = None
        self.pt_container = None
        self.pt_pid = None
        self.warm_daemon = None

    # ---------------------------------------------------------------- set-up / clean-up

    def setup(self):
        self.world.build()
        w = self.world
        # `--protocol v3`: every container through the MPS v3 backend (BENCHMARKS.md).
        protocol = f'protocol = "{self.args.protocol}"\n'
        w.config(self.cfg, RUNC, mps_extra=protocol)
        # For peak RSS and own cost: the shim execs `true` instead of runc, so the
        # process's peak RSS (which survives exec) is the shim's own, not runc's, and its
        # time is everything it does before the exec. See BENCHMARKS.md.
        w.config(self.cfg_rss, TRUE)
        # Cold start's B side: debug events mark its phases (BENCHMARKS.md, "Cold start").
        w.config(self.cfg_debug, RUNC, log_level="debug", mps_extra=protocol)
        # Node scale: daemons never stop idle (the 10-container point has 50 daemons, most
        # without a container), so what gc and status read is what the creates wrote.
        w.config(self.cfg_scale, RUNC, mps_extra='idle-timeout = "0"\n')
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
        self.world.stop_daemons(self.env)
        self.world.remove(self.args.keep, "scripts/bench")

    # ---------------------------------------------------------------- bundles and commands

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

    def state_of(self, b, cid, pid=None):
        """The OCI state runc feeds a hook of container `cid` (bundle `b`, as the shim
        edited it), its pid the passthrough container's unless given."""
        ann = json.loads((b / "config.json").read_bytes())["annotations"]
        return json.dumps({"ociVersion": "1.0.2", "id": cid, "status": "creating",
                           "pid": self.pt_pid if pid is None else pid, "bundle": str(b),
                           "annotations": ann}).encode()

    def argv(self, side, b, rest):
        exe = RUNC if side == "A" else str(RUNTIME)
        return [exe, "--root", str(self.runc_root), "--log", str(b / "log.json"),
                "--log-format", "json"] + rest

    @staticmethod
    def order(r):
        return ("A", "B") if r % 2 == 0 else ("B", "A")

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

    def static_c(self, name, body):
        """A static C program compiled into the work dir (the floors of [7] and [8]), or
        None without a C compiler."""
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

    # ---------------------------------------------------------------- shared containers, daemons

    def ensure_warm_daemon(self):
        """Starts the daemon of uid 1000 (untimed) through a first container, once."""
        if self.warm_daemon:
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
