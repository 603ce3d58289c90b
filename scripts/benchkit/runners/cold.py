"""A new identity's first containers: [4] the cold start, one create until its daemon is
ready, split into its parts by gpushare's debug events, and [5] a burst of simultaneous
creates on one new identity (one daemon must start, none may fail)."""

import calendar
import json
import re
import statistics
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from ..frame import BenchError
from ..node import UID_BURST, UID_COLD
from ..stats import ms, pct
from ..world import RUNC, RUNTIME

T_COLD_MS = 100.0  # create of a new identity until its daemon is ready
T_COLD_P50_MS = 50.0  # create -> daemon ready, p50
T_BURST_SPREAD = 3.0  # p99 <= 3 x p50


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


def cold_parts(node, log_at, wall):
    """Splits one cold create (wall = its start and end, ns since the epoch) at the
    timestamps of gpushare's debug events in the log written since `log_at`."""
    # The supervisor may log "ready" just after the create returned: wait for it.
    deadline = time.monotonic() + 5
    while True:
        with open(node.log, "rb") as f:
            f.seek(log_at)
            text = f.read().decode(errors="replace")
        if all(t in text for _, t in COLD_EVENTS) or time.monotonic() > deadline:
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
    for _, text in COLD_EVENTS:
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
    for (label, _), at in zip(COLD_EVENTS, ats):
        parts[label] = ms(at - prev)
        prev = at
    parts["runc finishes the create; the create returns"] = ms(wall[1] - prev)
    parts["total (create issued to create returned)"] = ms(wall[1] - wall[0])
    return parts


def bench_cold(node, rounds):
    print("[4] cold start: create of the first container of a new identity (new uid each "
          "round) until it returns with the daemon ready; A = runc create of the same bundle", flush=True)
    a, bs, parts = [], [], []
    for r in range(-1, rounds):
        uid = UID_COLD + r + 1
        spec_bytes = node.request_spec(uid)
        for side in node.order(r):
            cid = f"c{r + 1}{side.lower()}"
            b = node.bundle(cid, spec_bytes)
            before = set(node.daemon_ids())
            log_at = node.log.stat().st_size if node.log.exists() else 0
            # B runs at log-level debug: its events mark the phases (cold_parts).
            t = node.run(side, b, ["create", "--bundle", str(b), "--pid-file", str(b / "pid"), cid],
                         env=dict(node.env, GPUSHARE_CONFIG=str(node.cfg_debug)) if side == "B" else None)
            new = [d for d in node.daemon_ids() if d not in before]
            if side == "B":
                if len(new) != 1:
                    raise BenchError(f"cold create made {len(new)} daemons: {new}")
                rec = node.record(new[0])
                if rec["status"] != "ready" or not rec.get("daemon"):
                    raise BenchError(f"create returned before the daemon was ready: {rec}")
                if r >= 0:
                    bs.append(t)
                    parts.append(cold_parts(node, log_at, node.last_wall))
            elif r >= 0:
                a.append(t)
            node.run(side, b, ["start", cid], timed=False)
            node.wait_exit(int((b / "pid").read_text()))
            node.run(side, b, ["delete", cid], timed=False)
            for d in new:
                node.stop_daemon(d)
    node.summary("cold.create", a, bs)
    med = ms(statistics.median(bs))
    ok = med <= T_COLD_MS
    node.results["cold.create"]["daemon_start_ms"] = med - ms(statistics.median(a))
    node.verdicts.append(("cold start to ready daemon (simulator)", f"{med:.1f} ms",
                          f"<= {T_COLD_MS:.0f} ms", ok))
    node.verdicts.append(("cold start p50", f"{med:.1f} ms",
                          f"<= {T_COLD_P50_MS:.0f} ms", med <= T_COLD_P50_MS))
    names = list(parts[0])
    node.results["cold.parts_ms"] = {
        k: {"median": statistics.median(p[k] for p in parts),
            "p10": pct([p[k] for p in parts], 10), "p90": pct([p[k] for p in parts], 90),
            "samples": [p[k] for p in parts]} for k in names}
    print("  cold start, part by part (ms, median [p10-p90] over rounds; from gpushare's "
          "debug log timestamps and the script's clock):")
    for k in names:
        v = node.results["cold.parts_ms"][k]
        print(f"    {k:<62} {v['median']:6.2f} [{v['p10']:5.2f}-{v['p90']:6.2f}]")
    print(f"  cold start median {med:.1f} ms (p90 {ms(pct(bs, 90)):.1f}); runc's own create "
          f"{ms(statistics.median(a)):.1f} ms; daemon start adds "
          f"{med - ms(statistics.median(a)):.1f} ms  {'PASS' if ok else 'MISS'} (<= {T_COLD_MS:.0f} ms)",
          flush=True)


def burst_once(node, side, r, n):
    uid = UID_BURST + r
    spec_bytes = node.request_spec(uid)
    bundles = [node.bundle(f"x{r}{side.lower()}{i}", spec_bytes) for i in range(n)]
    before_log = node.log.stat().st_size if node.log.exists() else 0
    before = set(node.daemon_ids())
    lat = [None] * n
    rcs = [None] * n
    barrier = threading.Barrier(n)
    exe = RUNC if side == "A" else str(RUNTIME)

    def one(i):
        b = bundles[i]
        argv = [exe, "--root", str(node.runc_root), "--log", str(b / "log.json"),
                "--log-format", "json", "create", "--bundle", str(b), b.name]
        with open(b / "out", "ab") as out:
            barrier.wait()
            t0 = time.perf_counter_ns()
            rcs[i] = subprocess.call(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                     env=node.env)
            lat[i] = time.perf_counter_ns() - t0

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    t0 = time.perf_counter_ns()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter_ns() - t0
    failures = [bundles[i].name + ": " + node.last_error(bundles[i]) for i in range(n) if rcs[i] != 0]
    new = [d for d in node.daemon_ids() if d not in before]
    started = None
    if side == "B":
        with open(node.log, "rb") as f:
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
        list(ex.map(lambda b: node.run(side, b, ["delete", "-f", b.name], check=False, timed=False),
                    bundles))
    for d in new:
        node.stop_daemon(d)
    return {"latencies_ms": [ms(x) for x in lat], "failures": failures, "daemons": len(new),
            "started_in_log": started, "wall_ms": ms(wall),
            "p50_ms": ms(pct(lat, 50)), "p99_ms": ms(pct(lat, 99)), "max_ms": ms(max(lat))}


def bench_burst(node, rounds, n=64):
    print(f"[5] {n} simultaneous creates on one new identity (cold daemon), A = {n} runc creates", flush=True)
    out = {"A": [], "B": []}
    for r in range(rounds):
        for side in node.order(r):
            res = burst_once(node, side, r, n)
            out[side].append(res)
            extra = "" if side == "A" else (f"  daemons={res['daemons']} started(log)="
                                            f"{res['started_in_log']}")
            print(f"  round {r} {side}: p50 {res['p50_ms']:7.1f} ms  p99 {res['p99_ms']:7.1f} ms"
                  f"  p99/p50 {res['p99_ms'] / res['p50_ms']:.2f}  wall {res['wall_ms']:7.1f} ms"
                  f"  failures={len(res['failures'])}{extra}", flush=True)
            for f in res["failures"][:5]:
                print(f"    failure: {f}")
    node.results["burst"] = out
    b = out["B"]
    daemons_ok = all(x["daemons"] == 1 and x["started_in_log"] == 1 for x in b)
    fail_ok = all(not x["failures"] for x in out["B"])
    spread_b = statistics.median(x["p99_ms"] / x["p50_ms"] for x in b)
    spread_a = statistics.median(x["p99_ms"] / x["p50_ms"] for x in out["A"])
    p50_ratio = statistics.median(x["p50_ms"] for x in b) / statistics.median(x["p50_ms"] for x in out["A"])
    p99_ratio = statistics.median(x["p99_ms"] for x in b) / statistics.median(x["p99_ms"] for x in out["A"])
    node.results["burst_summary"] = {"spread_B": spread_b, "spread_A": spread_a,
                                     "p50_ratio": p50_ratio, "p99_ratio": p99_ratio}
    print(f"  B p99/p50 (median over rounds) {spread_b:.2f}, runc alone {spread_a:.2f}; "
          f"B/A p50 {p50_ratio:.2f}, p99 {p99_ratio:.2f}", flush=True)
    node.verdicts.append((f"{n} simultaneous creates: daemons started",
                          ", ".join(str(x["daemons"]) for x in b), "1 per round", daemons_ok))
    node.verdicts.append((f"{n} simultaneous creates: failures",
                          ", ".join(str(len(x["failures"])) for x in b), "0", fail_ok))
    node.verdicts.append((f"{n} simultaneous creates: p99/p50",
                          f"{spread_b:.2f} (runc alone {spread_a:.2f})", "<= 3", spread_b <= T_BURST_SPREAD))
