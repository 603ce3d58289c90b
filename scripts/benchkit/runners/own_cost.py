"""What gpushare's binaries cost on their own: [7] the time of the shim and the hooks
against `true` with the same argv and stdin (with --old, another build in the same rotation;
with --instructions, callgrind's count of user-space instructions), and [6] their peak RSS."""

import json
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from ..frame import BenchError
from ..node import UID_RSS, UID_WARM
from ..stats import ms
from ..world import GPUSHARE, REL, RUNC, RUNTIME, TRUE, installed_copy

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


def bench_overhead(node, reps):
    """The shim's and the hook's own cost in absolute terms: B = gpushare-runtime with
    low-level-runtime = `true` (so B - A is everything the shim does before its exec),
    A = `true` with the same argv; the hooks against `true` fed the same stdin.

    With --old DIR a third side C runs the binaries in DIR (another build's
    target/release) in the same rotation, so two builds are compared in one run and the
    machine's load falls on both alike. With --instructions each command of B (and C) is
    also run under callgrind once: user-space instructions, which load does not change."""
    print("[7] own cost (informational): B = gpushare's binary, A = `true` with the same argv/stdin"
          + (f", C = the build in {node.args.old}" if node.args.old else ""), flush=True)
    env_t = dict(node.env, GPUSHARE_CONFIG=str(node.cfg_rss))
    builds = {"B": REL}
    if node.args.old:
        # Copies, as scripts/bench makes of this build's binaries (installed_copy).
        old = node.work / "old-bin"
        old.mkdir(exist_ok=True)
        for name in ("gpushare", "gpushare-runtime"):
            installed_copy(Path(node.args.old) / name, old / name)
        builds["C"] = old

    def timed(argv, env, data=None):
        node.pre()
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
        out = Path(tempfile.mkdtemp(prefix="cg.", dir=node.work))
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
        node.summary(name, s["A"], s["B"])
        row = node.results[name]
        base = statistics.median(s["A"])
        row["own_cost_us"] = (statistics.median(s["B"]) - base) / 1e3
        if "C" in s:
            row["C"] = {"median_ms": ms(statistics.median(s["C"])), "n": len(s["C"])}
            row["old_own_cost_us"] = (statistics.median(s["C"]) - base) / 1e3
            print(f"  {'':<34} C {ms(statistics.median(s['C'])):7.2f} ms: own cost "
                  f"new {row['own_cost_us']:.0f} us, old {row['old_own_cost_us']:.0f} us", flush=True)
        if node.args.instructions:
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

    g = ["--root", str(node.runc_root), "--log", str(node.work / "ov.json"), "--log-format", "json"]
    cost = {}
    # The floor of any exec-through shim: a static C program that only execs `true`.
    floor = node.static_c("floor", 'int main(int c, char **v, char **e) '
                          '{ (void)c; execve("%s", v, e); return 127; }' % TRUE)
    if floor:
        cost["floor"] = ab("own.floor: static C exec-through", [TRUE] + g + ["state", "pt"],
                           lambda d, _: [str(floor)] + g + ["state", "pt"], env_t)
    else:
        print("  (no C compiler: the exec-through floor row is skipped)")
    # The floor of the shim's kind: a Rust program linked as the shim is (static-pie,
    # panic=abort, opt-level 3) whose main only execs, std's runtime start included.
    rust_floor = node.work / "floor-rust.ld"
    (node.work / "floor-rust.rs").write_text(
        "use std::os::unix::process::CommandExt;\n"
        "fn main() {\n"
        "    let _ = std::process::Command::new(%s).args(std::env::args_os().skip(1)).exec();\n"
        "    std::process::exit(127);\n}\n" % json.dumps(str(TRUE)))
    if subprocess.run(["rustc", "--edition", "2021", "-C", "opt-level=3", "-C", "panic=abort",
                       "-C", "target-feature=+crt-static", "-o", str(rust_floor),
                       str(node.work / "floor-rust.rs")], stderr=subprocess.DEVNULL).returncode == 0:
        rust_floor = installed_copy(rust_floor, node.work / "floor-rust")
        cost["floor_rust"] = ab("own.floor: Rust static-pie exec-through", [TRUE] + g + ["state", "pt"],
                                lambda d, _: [str(rust_floor)] + g + ["state", "pt"], env_t)
    else:
        print("  (rustc could not build the Rust floor: its row is skipped)")
    cost["passthrough"] = ab("own.shim passthrough (state)", [TRUE] + g + ["state", "pt"],
                             lambda d, _: [str(d / "gpushare-runtime")] + g + ["state", "pt"], env_t)
    b0 = node.bundle("ov0", node.spec(["true"]))
    create0 = g + ["create", "--bundle", str(b0), "ov0"]
    cost["create"] = ab("own.shim create, no request", [TRUE] + create0,
                        lambda d, _: [str(d / "gpushare-runtime")] + create0, env_t)
    req = node.request_spec(UID_WARM)
    n = iter(range(100_000))

    def prep():
        cid = f"ovw{next(n)}"
        return node.bundle(cid, req), cid

    def release(ctx):
        b, cid = ctx
        subprocess.run([str(GPUSHARE), "hook", "poststop"], env=node.env,
                       input=node.state_of(b, cid), check=True)

    cost["create_warm"] = ab("own.shim create, request (warm)", [TRUE] + create0,
                             lambda d, ctx: [str(d / "gpushare-runtime")] + g
                             + ["create", "--bundle", str(ctx[0]), ctx[1]],
                             env_t, prep=prep, after=release)
    b1, cid1 = prep()
    node.run("B", b1, ["create", "--bundle", str(b1), cid1], env=env_t, timed=False)  # edits, execs true
    st = node.state_of(b1, cid1)
    cost["hook_create_runtime"] = ab("own.hook create-runtime (warm)", [TRUE],
                                     lambda d, _: [str(d / "gpushare"), "hook", "create-runtime"],
                                     node.env, data=st)
    cost["hook_poststop"] = ab("own.hook poststop", [TRUE],
                               lambda d, _: [str(d / "gpushare"), "hook", "poststop"],
                               node.env, data=st)
    node.results["own_cost_us"] = cost
    print("  own cost (median B - median A): " +
          ", ".join(f"{k} {v:.0f} us" for k, v in cost.items()), flush=True)
    if "floor" in cost:
        print("  own cost as a multiple of the floor: " + ", ".join(
            f"{k} {v / cost['floor']:.2f}x" for k, v in cost.items() if k not in ("floor", "floor_rust"))
            + ("; old build: " + ", ".join(
                f"{k} {node.results[name]['old_own_cost_us'] / cost['floor']:.2f}x"
                for k, name in OWN_ROWS.items()) if node.args.old else ""), flush=True)
    if "floor_rust" in cost:
        print("  own cost as a multiple of the Rust static-pie floor: " + ", ".join(
            f"{k} {v / cost['floor_rust']:.2f}x" for k, v in cost.items()
            if k not in ("floor", "floor_rust")), flush=True)
    pt = node.results.get("passthrough.state")
    if pt:
        runc_ms = pt["A"]["median_ms"]
        print(f"  implied passthrough ratio 1 + cost/runc state ({runc_ms:.2f} ms): shim "
              f"{1 + cost['passthrough'] / 1e3 / runc_ms:.3f}"
              + (f", floor {1 + cost['floor'] / 1e3 / runc_ms:.3f}" if "floor" in cost else ""),
              flush=True)


def bench_rss(node, reps):
    print("[6] peak RSS (GNU time %M = ru_maxrss; the shim measured execing `true`, not runc)", flush=True)
    env_rss = dict(node.env, GPUSHARE_CONFIG=str(node.cfg_rss))
    rows = {}
    rows["true (floor of any exec)"] = node.maxrss([TRUE], node.env, reps=reps)
    rows["runc state (context)"] = node.maxrss(
        [RUNC, "--root", str(node.runc_root), "state", node.pt_container], node.env, reps=reps)

    plain = node.spec(["true"])
    k = iter(range(10_000))

    def shim_create(spec_bytes, prefix, n=reps):
        vals, made = [], []
        for _ in range(n):
            cid = f"{prefix}{next(k)}"
            b = node.bundle(cid, spec_bytes)
            made.append((b, cid))
            vals += node.maxrss([str(RUNTIME), "--root", str(node.runc_root), "--log",
                                 str(b / "log.json"), "--log-format", "json", "create",
                                 "--bundle", str(b), cid], env_rss, reps=1)
        return vals, made

    rows["shim create, no request"], _ = shim_create(plain, "m")
    warm_vals, warm_made = shim_create(node.request_spec(UID_WARM), "mw")
    rows["shim create, request (warm daemon)"] = warm_vals
    rows["shim passthrough (state)"] = node.maxrss(
        [str(RUNTIME), "--root", str(node.runc_root), "state", node.pt_container], env_rss, reps=reps)

    hook = [str(GPUSHARE), "hook"]
    rows["hook create-runtime (warm daemon)"] = [
        node.maxrss(hook + ["create-runtime"], node.env, stdin=node.state_of(b, cid), reps=1)[0]
        for b, cid in warm_made]
    rows["hook poststop"] = [
        node.maxrss(hook + ["poststop"], node.env, stdin=node.state_of(b, cid), reps=1)[0]
        for b, cid in warm_made]
    # Cold: a new identity per rep; the hook starts the supervisor and waits for ready.
    cold = []
    for i in range(reps):
        before = set(node.daemon_ids())
        _, made = shim_create(node.request_spec(UID_RSS + i), "mc", 1)
        (b, cid), = made
        cold += node.maxrss(hook + ["create-runtime"], node.env, stdin=node.state_of(b, cid), reps=1)
        node.maxrss(hook + ["poststop"], node.env, stdin=node.state_of(b, cid), reps=1)
        for d in set(node.daemon_ids()) - before:
            node.stop_daemon(d)
    rows["hook create-runtime (cold: starts the daemon)"] = cold

    node.results["rss_kib"] = rows
    for name, v in rows.items():
        print(f"  {name:<46} max {max(v) / 1024:6.2f} MiB  median {statistics.median(v) / 1024:6.2f} MiB")
    shim = max(max(rows[k]) for k in rows if k.startswith("shim"))
    hookv = max(max(rows[k]) for k in rows if k.startswith("hook"))
    node.verdicts.append(("peak RSS, shim (max over create/passthrough)", f"{shim / 1024:.2f} MiB",
                          "<= 8 MiB", shim <= T_SHIM_RSS))
    node.verdicts.append(("peak RSS, hook (max over create-runtime/poststop)", f"{hookv / 1024:.2f} MiB",
                          "<= 16 MiB", hookv <= T_HOOK_RSS))
