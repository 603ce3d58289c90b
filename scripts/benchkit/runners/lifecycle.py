"""The container lifecycle against runc, A/B alternating per round: [1] create + start +
delete without a request, [2] with a request on a warm daemon, [3] the passthrough commands on
a running container, and [8] where the warm request's extra time goes."""

import json
import statistics
import subprocess
from pathlib import Path

from ..frame import BenchError
from ..node import UID_WARM
from ..stats import ms, pct
from ..world import GPUSHARE

# Per-call targets (BENCHMARKS.md, "Where things stand").
T_NOREQ = 1.03  # create without request, median ratio
T_PASS = 1.03  # passthrough commands, median ratio
T_WARM = 1.15  # create with a warm daemon (shim + hook), median ratio


def lifecycle(node, name, spec_bytes, rounds, check_b):
    """create + start + delete of a `true` container, A/B alternating. The container's
    exit is awaited (untimed) before delete, so delete never hits runc's 100 ms kill
    poll; the figure is the sum of the three commands' wall times."""
    phases = ("create", "start", "delete", "total")
    s = {side: {p: [] for p in phases} for side in "AB"}
    warmup = 1
    for r in range(-warmup, rounds):
        for side in node.order(r):
            cid = f"{name}{r + warmup}{side.lower()}"
            b = node.bundle(cid, spec_bytes)
            tc = node.run(side, b, ["create", "--bundle", str(b), "--pid-file", str(b / "pid"), cid])
            pid = int((b / "pid").read_text())
            ts = node.run(side, b, ["start", cid])
            node.wait_exit(pid)
            td = node.run(side, b, ["delete", cid])
            if side == "B":
                check_b(b, spec_bytes)
            if r >= 0:
                for p, v in zip(phases, (tc, ts, td, tc + ts + td)):
                    s[side][p].append(v)
    return s


def bench_noreq(node, rounds):
    print("[1] create + start + delete, no request: runc vs gpushare-runtime", flush=True)
    spec_bytes = node.spec(["true"])

    def untouched(b, original):
        if (b / "config.json").read_bytes() != original:
            raise BenchError(f"{b}/config.json was edited for a container without request")

    s = lifecycle(node, "n", spec_bytes, rounds, untouched)
    node.summary("noreq.create", s["A"]["create"], s["B"]["create"], T_NOREQ, "create, no request")
    node.summary("noreq.start", s["A"]["start"], s["B"]["start"])
    node.summary("noreq.delete", s["A"]["delete"], s["B"]["delete"])
    node.summary("noreq.create+start+delete", s["A"]["total"], s["B"]["total"], T_NOREQ,
                 "create+start+delete, no request")


def bench_warm(node, rounds):
    print("[2] create + start + delete with gpushare.io/device=0, daemon already running "
          "(shim + createRuntime/poststop hooks) vs runc on the same bundle", flush=True)
    spec_bytes = node.request_spec(UID_WARM)
    node.ensure_warm_daemon()

    def edited(b, _original):
        ann = json.loads((b / "config.json").read_bytes()).get("annotations", {})
        if ann.get("gpushare.io/daemon") != node.warm_daemon:
            raise BenchError(f"{b}: not attached to the warm daemon: {ann}")

    s = lifecycle(node, "w", spec_bytes, rounds, edited)
    if node.daemon_ids() != [node.warm_daemon]:
        raise BenchError(f"warm benchmark started extra daemons: {node.daemon_ids()}")
    rec = node.record(node.warm_daemon)
    if rec["status"] != "ready" or rec.get("restarts", 0):
        raise BenchError(f"warm daemon not steady: {rec}")
    node.summary("warm.create", s["A"]["create"], s["B"]["create"], T_WARM,
                 "create, warm daemon (shim + hook)")
    node.summary("warm.start", s["A"]["start"], s["B"]["start"])
    node.summary("warm.delete", s["A"]["delete"], s["B"]["delete"])
    node.summary("warm.create+start+delete", s["A"]["total"], s["B"]["total"], T_WARM,
                 "create+start+delete, warm daemon")


def bench_passthrough(node, rounds):
    print("[3] passthrough commands on a running container: runc vs gpushare-runtime", flush=True)
    node.start_pt_container()
    cid, b = node.pt_container, node.bundles / node.pt_container
    cmds = {"state": ["state", cid], "kill": ["kill", cid, "WINCH"]}  # WINCH: ignored by sleep
    s = {k: {"A": [], "B": []} for k in cmds}
    for r in range(-3, rounds * 3):  # cheap commands: 3x the rounds, 3 warm-up rounds
        for k, rest in cmds.items():
            for side in node.order(r):
                t = node.run(side, b, rest)
                if r >= 0:
                    s[k][side].append(t)
    node.summary("passthrough.state", s["state"]["A"], s["state"]["B"], T_PASS, "passthrough `state`")
    node.summary("passthrough.kill", s["kill"]["A"], s["kill"]["B"], T_PASS, "passthrough `kill`")


def bench_decompose(node, rounds):
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
    noop = node.static_c("noop-hook", "int main(void) { return 0; }")
    if noop is None:
        raise BenchError("[8] needs a C compiler (cc) for its no-op hook: apt-get install gcc")
    plain = node.request_spec(UID_WARM)
    # The shim's edit of this bundle, captured once (the shim execs `true` here).
    b = node.bundle("dz-edit", plain)
    node.run("B", b, ["create", "--bundle", str(b), "dz-edit"],
             env=dict(node.env, GPUSHARE_CONFIG=str(node.cfg_rss)), timed=False)
    edited = json.loads((b / "config.json").read_bytes())
    subprocess.run([str(GPUSHARE), "hook", "poststop"], env=node.env, check=True,
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
            b = node.bundle(cid, spec_bytes)
            tc = node.run(side, b, ["create", "--bundle", str(b), "--pid-file", str(b / "pid"), cid])
            node.run(side, b, ["start", cid], timed=False)
            node.wait_exit(int((b / "pid").read_text()))
            td = node.run(side, b, ["delete", cid])
            if r >= 0:
                for p, v in (("create", tc), ("delete", td), ("both", tc + td)):
                    s[k][p].append(v)
    med = {k: {p: statistics.median(v) for p, v in d.items()} for k, d in s.items()}
    node.results["decompose"] = {
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
