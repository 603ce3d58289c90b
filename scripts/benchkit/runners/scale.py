"""[9] Node scale: 50 daemons (or each of --scale-shapes' counts, e.g. 4: 250 containers a
daemon at 1,000) and up to 1,000 live containers created through the shim;
at each point the operator's commands (status, daemon list, gc), a warm create and the two
hooks, each under GNU time (wall, CPU, peak RSS), with the GPU process watcher running and
listing one GPU process per container (its CPU per scan measured at each point); then gc
over stale records."""

import json
import os
import re
import shutil
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

from ..frame import BenchError
from ..node import UID_SCALE
from ..stats import ms
from ..world import GPUSHARE, REPO, RUNC, RUNTIME, SCALE_DEVICES, TRUE

T_SCALE_MS = 100.0  # each node-scale command at 1,000 containers
T_WATCH_CPU_MS = 50.0  # the watcher's CPU per scan at 1,000 containers: 1 % of a CPU at 5 s


class ScaleWatch:
    """`gpushare watch` on the node-scale state, every second, over the tests' fake NVML
    (tests/integration/fake_nvml.c, compiled here) in its table mode: the processes it
    lists are the lines of a file, one per live container (its init process, as an MPS
    client with 1 GiB on the container's GPU), so that what is measured is the watcher
    (records, cgroups, rules, report), not the fake's walk through /proc."""

    def __init__(self, node, env):
        cc = shutil.which("cc") or shutil.which("gcc")
        if not cc:
            raise BenchError("the watcher's figures need a C compiler (apt-get install gcc)")
        lib = node.work / "nvml"
        lib.mkdir(exist_ok=True)
        subprocess.run([cc, "-shared", "-fPIC", "-pthread", "-O2", "-Wl,-z,nodelete", "-o",
                        str(lib / "libnvidia-ml.so.1"),
                        str(REPO / "tests" / "integration" / "fake_nvml.c")], check=True)
        self.table = node.work / "gpu-processes"
        self.table.write_text("")
        cfg = node.work / "scale-watch.toml"
        cfg.write_text(node.cfg_scale.read_text() + '\n[watch]\ninterval = "1s"\n')
        self.report = node.state / "watch.json"
        self.proc = subprocess.Popen(
            [str(GPUSHARE), "watch"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=dict(env, GPUSHARE_CONFIG=str(cfg), LD_LIBRARY_PATH=str(lib),
                     FAKE_NVML_GPUS=",".join(uuid for _, uuid in SCALE_DEVICES),
                     FAKE_NVML_TABLE=str(self.table)))

    def list_containers(self, pids, daemons):
        """One GPU process per container: its init pid on its identity's GPU."""
        lines = []
        for i, pid in sorted(pids.items()):
            _, dev = scale_identity(i % daemons)
            uuid = dict(SCALE_DEVICES)[dev]
            lines.append(f"{pid} {uuid} mps {1 << 30}\n")
        tmp = self.table.with_suffix(".tmp")
        tmp.write_text("".join(lines))
        os.replace(tmp, self.table)

    def _read(self):
        try:
            return json.loads(self.report.read_text()), self.report.stat().st_mtime_ns
        except (OSError, ValueError):
            return None, None

    def _cpu_s(self):
        fields = open(f"/proc/{self.proc.pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def _next_scan(self, after, limit=30.0):
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            r, m = self._read()
            if r is not None and m != after:
                return r, m
            time.sleep(0.05)
        raise BenchError("the watcher wrote no report for 30 s")

    def measure(self, n, scans):
        """Waits until a scan lists the n processes, each in its container; then its CPU
        over `scans` more scans. Returns (CPU ms per scan, median scan wall ms)."""
        deadline = time.monotonic() + 60
        m = None
        while True:
            r, m = self._next_scan(m)
            procs = r["processes"]
            if len(procs) == n and all(p["container_id"] for p in procs):
                break
            if time.monotonic() > deadline:
                raise BenchError(f"the watcher lists {len(procs)} processes, "
                                 f"{sum(1 for p in procs if p['container_id'])} in a container, "
                                 f"not {n}: {r.get('error')}")
        cpu0 = self._cpu_s()
        walls = []
        for _ in range(scans):
            r, m = self._next_scan(m)
            walls.append(r["scan_seconds"])
        cpu1 = self._cpu_s()
        return (cpu1 - cpu0) * 1000 / scans, statistics.median(walls) * 1000

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def scale_identity(k):
    """The k-th of the 50 node-scale identities: 25 uids x the inventory's two GPUs that
    take a whole-GPU request (world.SCALE_DEVICES)."""
    return UID_SCALE + k // 2, SCALE_DEVICES[k % 2][0]


def scale_create(node, i, env):
    """Container i of the node-scale set, on identity i % daemons: a busybox `sleep`
    created through the shim (its createRuntime hook writes the container record) and
    started with runc. Returns its pid."""
    uid, dev = scale_identity(i % node.args.scale_daemons)
    cid = f"s{i}"
    b = node.bundle(cid, node.spec(["sleep", "1000000"], uid, {"gpushare.io/device": dev}))
    node.run("B", b, ["create", "--bundle", str(b), "--pid-file", str(b / "pid"), cid],
             env=env, timed=False)
    node.run("A", b, ["start", cid], env=env, timed=False)
    return int((b / "pid").read_text())


def scale_state(node, cid, pid, annotations):
    return json.dumps({"ociVersion": "1.0.2", "id": cid, "status": "creating", "pid": pid,
                       "bundle": str(node.bundles / cid), "annotations": annotations}).encode()


def bench_scale(node, reps):
    n_daemons = node.args.scale_daemons
    points = [int(x) for x in node.args.scale_points.split(",")]
    print(f"[9] node scale: {n_daemons} daemons ({(n_daemons + 1) // 2} uids x 2 GPUs), live busybox containers "
          f"created through the shim at {points}; {reps} runs per command; stale records "
          f"for gc: {node.args.scale_stale}", flush=True)
    env = dict(node.env, GPUSHARE_CONFIG=str(node.cfg_scale))
    g = str(GPUSHARE)
    # The daemons first, through the operator's path (ensure writes their records).
    t0 = time.perf_counter()
    for k in range(n_daemons):
        uid, dev = scale_identity(k)
        subprocess.run([g, "daemon", "start", "--device", dev, "--uid", str(uid)], env=env,
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, check=True)
    print(f"  {n_daemons} daemons started in {time.perf_counter() - t0:.1f} s", flush=True)
    daemons = node.daemon_ids()
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
    floor = [node.measure([TRUE], env) for _ in range(reps)]
    node.results["scale_floor"] = {"median_ms": ms(statistics.median(x[0] for x in floor)),
                                   "cpu_median_ms": ms(statistics.median(x[2] for x in floor)),
                                   "peak_rss_kib": max(x[1] for x in floor)}
    print(f"  floor: GNU time running `true` {ms(statistics.median(x[0] for x in floor)):.2f} ms, "
          f"peak RSS {max(x[1] for x in floor) / 1024:.2f} MiB", flush=True)
    made = 0
    pids = {}
    out = node.work / "scale.out"
    results = {}
    watch = ScaleWatch(node, env)
    watched = {}
    try:
        measure_points(node, env, points, reps, commands, n_daemons, made, pids, out,
                       results, watch, watched)
    finally:
        watch.stop()
    node.results["scale_watch"] = {str(n): {"cpu_ms_per_scan": round(c, 2),
                                            "scan_wall_ms_median": round(w, 2)}
                                   for n, (c, w) in watched.items()}
    cpu, _ = watched[points[-1]]
    node.verdicts.append((f"{points[-1]} containers ({n_daemons} daemons): gpushare watch CPU per scan",
                          f"{cpu:.1f} ms", f"<= {T_WATCH_CPU_MS:.0f} ms", cpu <= T_WATCH_CPU_MS))
    finish_scale(node, env, points, results, daemons, pids)


def measure_points(node, env, points, reps, commands, n_daemons, made, pids, out, results,
                   watch, watched):
    """The node-scale points: containers up to each, the watcher's cost, the commands."""
    g = str(GPUSHARE)
    for n in points:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(node.args.scale_jobs) as ex:
            for i, pid in zip(range(made, n), ex.map(lambda i: scale_create(node, i, env),
                                                      range(made, n))):
                pids[i] = pid
        print(f"  {n - made} containers created and started in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
        made = n
        watch.list_containers(pids, n_daemons)
        cpu, wall = watch.measure(n, 10)
        watched[n] = (cpu, wall)
        print(f"  {n:>5} containers  gpushare watch, one GPU process per container: CPU "
              f"{cpu:.2f} ms per scan, scan {wall:.2f} ms (median of 10)", flush=True)
        row = {}
        for name, argv in commands.items():
            samples, old = [], []
            for _ in range(reps):
                samples.append(node.measure(argv, env, out=out))
                if node.args.scale_old:
                    old.append(node.measure([node.args.scale_old + "/gpushare"] + argv[1:], env,
                                            out=node.work / "scale-old.out"))
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
            uid, dev = scale_identity(r % n_daemons)
            b = node.bundle(cid, node.spec(["sleep", "1000000"], uid, {"gpushare.io/device": dev}))
            runc_create.append(node.measure(node.argv("A", b, ["create", "--bundle", str(b), cid]), env))
            subprocess.run([RUNC, "--root", str(node.runc_root), "delete", "-f", cid], env=env,
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, check=True)
            i = 100_000 + n * 100 + r
            uid, dev = scale_identity(r % n_daemons)
            cid = f"s{i}"
            b = node.bundle(cid, node.spec(["sleep", "1000000"], uid, {"gpushare.io/device": dev}))
            create.append(node.measure(node.argv("B", b, ["create", "--bundle", str(b), cid]), env))
            ann = json.loads((b / "config.json").read_bytes())["annotations"]
            subprocess.run([RUNC, "--root", str(node.runc_root), "delete", "-f", cid], env=env,
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, check=True)
            st = scale_state(node, cid + "h", pids[r % n], ann)
            hook_cr.append(node.measure([g, "hook", "create-runtime"], env, stdin=st))
            hook_ps.append(node.measure([g, "hook", "poststop"], env, stdin=st))
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


def finish_scale(node, env, points, results, daemons, pids):
    node.results["scale"] = {
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
        node.verdicts.append((f"{points[-1]} containers ({len(daemons)} daemons): {name}", f"{med:.1f} ms",
                              f"<= {T_SCALE_MS:.0f} ms", med <= T_SCALE_MS))
    if node.args.scale_stale:
        scale_gc_stale(node, env, daemons, pids)


def scale_gc_stale(node, env, daemons, pids):
    """gc over --scale-stale stale container records beside the live ones. The records
    are written by the createRuntime hook (the code a real create runs) for a `sleep`
    that is then killed, spread over the daemons; their bytes are kept and put back
    before each further gc run."""
    n = node.args.scale_stale
    g = str(GPUSHARE)
    victim = subprocess.Popen(["sleep", "1000000"])
    anns = {}
    for d in daemons:
        rec = node.record(d)
        uid = rec["identity"]["uid"]
        dev = next(d for d, uuid in SCALE_DEVICES if rec["identity"]["devices"] == [uuid])
        b = node.bundles / f"ann-{d}"
        b.mkdir(parents=True)
        (b / "config.json").write_bytes(node.spec(["true"], uid, {"gpushare.io/device": dev}))
        subprocess.run([str(RUNTIME), "--root", str(node.runc_root), "create", "--bundle",
                        str(b), f"ann-{d}"], check=True,
                       env=dict(env, GPUSHARE_CONFIG=str(node.cfg_rss)))
        anns[d] = json.loads((b / "config.json").read_bytes())["annotations"]
        # The shim wrote a pending record for ann-<d>: the poststop drops it.
        subprocess.run([g, "hook", "poststop"], env=env, check=True,
                       input=scale_state(node, f"ann-{d}", victim.pid, anns[d]))
    t0 = time.perf_counter()

    def one(j):
        d = daemons[j % len(daemons)]
        subprocess.run([g, "hook", "create-runtime"], env=env, check=True,
                       input=scale_state(node, f"st{j}", victim.pid, anns[d]))

    with ThreadPoolExecutor(node.args.scale_jobs) as ex:
        list(ex.map(one, range(n)))
    victim.kill()
    victim.wait()
    print(f"  {n} stale records written by the createRuntime hook in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    keep = node.work / "stale"
    for d in daemons:
        src = node.state / "mps" / d / "containers"
        dst = keep / d
        dst.mkdir(parents=True)
        for f in src.iterdir():
            if f.name.startswith("st"):
                shutil.copy2(f, dst / f.name)
    runs, old_runs = [], []
    out = node.work / "gc.out"
    for r in range(node.args.scale_gc_runs):
        if r:
            for d in daemons:
                for f in (keep / d).iterdir():
                    shutil.copy2(f, node.state / "mps" / d / "containers" / f.name)
        # Writeback of the records just written is not gc's work: flushed first.
        os.sync()
        # With --scale-old the old build's gc runs first on the same records, every run.
        if node.args.scale_old:
            old_runs.append(node.measure([node.args.scale_old + "/gpushare", "gc"], env, out=out))
            for d in daemons:
                for f in (keep / d).iterdir():
                    shutil.copy2(f, node.state / "mps" / d / "containers" / f.name)
            os.sync()
        runs.append(node.measure([g, "gc"], env, out=out))
        removed = sum(int(m) for m in re.findall(r"removed (\d+) stale container record",
                                                 out.read_text()))
        left = sum(1 for d in daemons for f in (node.state / "mps" / d / "containers").iterdir()
                   if f.name.startswith("st"))
        if removed != n or left:
            raise BenchError(f"gc removed {removed} of {n} stale records, {left} left")
    # Container records only: each daemon's containers/ also holds its records lock.
    live = sum(1 for d in daemons for f in (node.state / "mps" / d / "containers").iterdir()
               if f.suffix == ".json")
    if live != len(pids):
        raise BenchError(f"after gc {live} records left, {len(pids)} containers live")
    # The floor: unlinking the same files, and nothing else (find -delete).
    floor = []
    for _ in range(node.args.scale_gc_runs):
        for d in daemons:
            for f in (keep / d).iterdir():
                shutil.copy2(f, node.state / "mps" / d / "containers" / f.name)
        os.sync()
        floor.append(node.measure(["find", str(node.state / "mps"), "-path", "*/containers/st*",
                                   "-delete"], env))
    ts = [x[0] for x in runs]
    fl = [x[0] for x in floor]
    node.results["scale_gc_stale"] = {"stale": n, "live": len(pids),
                                      "median_ms": ms(statistics.median(ts)),
                                      "samples_ms": [ms(t) for t in ts],
                                      "cpu_median_ms": ms(statistics.median(x[2] for x in runs)),
                                      "peak_rss_kib": max(x[1] for x in runs),
                                      "floor_cpu_median_ms": ms(statistics.median(x[2] for x in floor)),
                                      "floor_find_delete_median_ms": ms(statistics.median(fl)),
                                      "floor_samples_ms": [ms(t) for t in fl]}
    if old_runs:
        node.results["scale_gc_stale"]["old_build_samples_ms"] = [ms(x[0]) for x in old_runs]
        node.results["scale_gc_stale"]["old_build_cpu_samples_ms"] = [ms(x[2]) for x in old_runs]
        print(f"  old build's gc over the same records: "
              f"{ms(statistics.median(x[0] for x in old_runs)):.1f} ms", flush=True)
    print(f"  gc over {n} stale + {len(pids)} live records: {ms(statistics.median(ts)):.1f} ms "
          f"[{ms(min(ts)):.1f}-{ms(max(ts)):.1f}] CPU {ms(statistics.median(x[2] for x in runs)):.1f} ms, "
          f"peak RSS {max(x[1] for x in runs) / 1024:.2f} MiB; floor (find -delete of the same "
          f"{n} files) {ms(statistics.median(fl)):.1f} ms, CPU {ms(statistics.median(x[2] for x in floor)):.1f} ms",
          flush=True)
    med = ms(statistics.median(ts))
    node.verdicts.append((f"gc over {n} stale records", f"{med:.1f} ms",
                          f"<= {T_SCALE_MS:.0f} ms", med <= T_SCALE_MS))


def scale_teardown(node, stop_daemons=False):
    """Kills the node-scale containers, then deletes them (runc runs their poststop); with
    `stop_daemons`, then stops every daemon, so that the next shape starts from none."""
    if not node.runc_root.exists():
        return
    ids = subprocess.run([RUNC, "--root", str(node.runc_root), "list", "-q"],
                         capture_output=True, text=True).stdout.split()
    # With `stop_daemons`, also the containers the gc run's shim creates left (ann-<daemon>).
    ids = [c for c in ids if c.startswith("s") or (stop_daemons and c.startswith("ann-"))]

    def kill_delete(c):
        subprocess.run([RUNC, "--root", str(node.runc_root), "kill", c, "KILL"],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=node.env)
        subprocess.run([RUNC, "--root", str(node.runc_root), "delete", "-f", c],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=node.env)

    with ThreadPoolExecutor(8) as ex:
        list(ex.map(kill_delete, ids))
    if stop_daemons:
        env = dict(node.env, GPUSHARE_CONFIG=str(node.cfg_scale))
        subprocess.run([str(GPUSHARE), "daemon", "stop", "--all", "--force"], env=env,
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, check=True)
        # Records of containers deleted meanwhile, and directories: what gc removes.
        subprocess.run([str(GPUSHARE), "gc"], env=env, stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, check=True)
        left = node.daemon_ids()
        if left:
            raise BenchError(f"{len(left)} daemons left after the node-scale shape's teardown")
        # The next shape makes its bundles, and keeps its stale records, under the same
        # names.
        for b in node.bundles.iterdir():
            if b.name.startswith(("s", "ann-")):
                shutil.rmtree(b)
        shutil.rmtree(node.work / "stale", ignore_errors=True)
