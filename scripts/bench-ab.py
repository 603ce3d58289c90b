#!/usr/bin/env python3
"""Interleaved A/B of whole commands, for comparing two builds of one binary in one run.

usage: scripts/bench-ab.py ROUNDS SETTLE_MS NAME=COMMAND [NAME=COMMAND ...]

Each round runs every command once, in an order rotated per round, sleeping SETTLE_MS
before each (50 reproduces scripts/bench's idle regime, 0 the back-to-back one), stdout
and stderr to /dev/null. Prints per command the median wall time, p10/p90 and the
difference and ratio against the first command. Commands are split on whitespace.

Example (BENCHMARKS.md, old shim against new against runc on one running container):
  scripts/bench-ab.py 200 50 runc="runc --root R state C" \
      old="/tmp/old/release/gpushare-runtime --root R state C" \
      new="target/release/gpushare-runtime --root R state C"
"""
import os
import statistics
import sys
import time


def main():
    if len(sys.argv) < 4 or any("=" not in a for a in sys.argv[3:]):
        sys.exit(__doc__)
    rounds, settle = int(sys.argv[1]), float(sys.argv[2]) / 1000
    variants = [a.split("=", 1) for a in sys.argv[3:]]
    samples = {name: [] for name, _ in variants}
    null = os.open("/dev/null", os.O_RDWR)
    actions = [(os.POSIX_SPAWN_DUP2, null, 1), (os.POSIX_SPAWN_DUP2, null, 2)]
    for i in range(rounds):
        k = i % len(variants)
        for name, command in variants[k:] + variants[:k]:
            argv = command.split()
            time.sleep(settle)
            t = time.perf_counter_ns()
            pid = os.posix_spawnp(argv[0], argv, dict(os.environ), file_actions=actions)
            os.waitpid(pid, 0)
            samples[name].append((time.perf_counter_ns() - t) / 1000)
    base = statistics.median(samples[variants[0][0]])
    for name, _ in variants:
        s = sorted(samples[name])
        m = statistics.median(s)
        print(f"{name:12s} median {m:8.0f} us  [p10 {s[len(s) // 10]:7.0f}  p90 "
              f"{s[9 * len(s) // 10]:7.0f}]  {m - base:+7.0f} us  x{m / base:.3f}")


if __name__ == "__main__":
    main()
