"""The suite's command line (scripts/bench's options) and its order of benchmarks."""

import argparse

from .frame import drive
from .node import Node
from .report import loadavg, machine
from .runners import cold, lifecycle, own_cost, scale

# --help shows this, as it always has.
DESCRIPTION = """gpushare's benchmark suite, driven by scripts/bench (which builds the release binaries).

Every A/B benchmark runs A = runc directly and B = gpushare-runtime (the shim, which execs
the same runc) on bundles of the same shape with fresh container ids, alternating per round
(A then B on even rounds, B then A on odd ones, so neither side always runs on a warmer
machine). Reported: median, p10 and p90 (linear interpolation) of each side and the ratio of
the medians B/A, plus PASS/MISS against the per-call targets below. Absolute times only matter
for the cold start; everything else is a ratio against runc measured in the same run.

Standard library only. Needs root, runc, busybox and GNU time. See BENCHMARKS.md.
"""


def main():
    ap = argparse.ArgumentParser(prog="scripts/bench", description=DESCRIPTION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
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
    ap.add_argument("--scale-shapes", default="", help="comma-separated daemon counts: the node-scale benchmark once per "
                    "count, each on a fresh set of daemons and containers (e.g. 50,4: 50 x 20 and 4 x 250 at 1,000); "
                    "default: --scale-daemons")
    ap.add_argument("--scale-stale", type=int, default=10000, help="stale container records for the gc run (0: none)")
    ap.add_argument("--scale-gc-runs", type=int, default=3, help="gc runs over the stale records")
    ap.add_argument("--scale-reps", type=int, default=7, help="runs per node-scale command")
    ap.add_argument("--scale-old", help="a directory with an older build's gpushare: status, daemon list "
                    "and gc are also measured with it, interleaved, on the same state")
    ap.add_argument("--scale-jobs", type=int, default=4, help="parallel creates while building the node-scale set")
    ap.add_argument("--protocol", choices=["legacy", "v3"], default="legacy",
                    help="the MPS backend of gpushare's side (mps.protocol; BENCHMARKS.md, \"MPS v3\")")
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

    node = Node(args)

    def run():
        info = machine()
        print(f"scripts/bench: {info['date']}  nproc={info['nproc']}  cpu={info['cpu']}  "
              f"kernel={info['kernel']}  {info['runc']}  {info['rustc']}  load={' '.join(info['loadavg'])}")
        print(f"scripts/bench: rounds={args.rounds} burst={args.burst}x{args.burst_rounds} "
              f"settle={args.settle:g}ms primer={args.primer}  "
              f"work dir {node.work}  (times in ms: median [p10-p90])", flush=True)
        node.setup()
        if "noreq" in only:
            lifecycle.bench_noreq(node, args.rounds)
        if "warm" in only:
            lifecycle.bench_warm(node, args.rounds)
        if "passthrough" in only:
            lifecycle.bench_passthrough(node, args.rounds)
        if "cold" in only:
            cold.bench_cold(node, args.rounds)
        if "burst" in only:
            cold.bench_burst(node, args.burst_rounds, args.burst)
        if "rss" in only:
            node.ensure_warm_daemon()
            node.start_pt_container()
            own_cost.bench_rss(node, 5)
        if "overhead" in only:
            node.ensure_warm_daemon()
            node.start_pt_container()
            own_cost.bench_overhead(node, args.rounds * 3)
        if "decompose" in only:
            node.ensure_warm_daemon()
            lifecycle.bench_decompose(node, args.rounds)
        if "scale" in only:
            shapes = [int(x) for x in args.scale_shapes.split(",") if x] or [args.scale_daemons]
            for daemons in shapes:
                args.scale_daemons = daemons
                try:
                    scale.bench_scale(node, args.scale_reps)
                finally:
                    scale.scale_teardown(node, stop_daemons=len(shapes) > 1)
                if len(shapes) > 1:
                    # Each shape's figures under its own key.
                    node.results[f"scale_{daemons}_daemons"] = {
                        k: node.results.pop(k) for k in list(node.results) if k.startswith("scale")
                        and not k.endswith("_daemons")}
        info["loadavg_end"] = loadavg()
        node.report.targets(info)
        if args.json:
            node.report.write_json(args.json, info, args)

    return drive("scripts/bench", node, run)
