"""What a run reports: each A/B row as it is measured, the targets' PASS/MISS at the end,
the machine it ran on, and with --json every sample in one file
({"machine", "args", "results", "verdicts"}; BENCHMARKS.md and docs/bench-runs read it)."""

import json
import os
import subprocess
import time
from pathlib import Path

from .stats import ab_row, ms, pct
from .world import RUNC


class Report:
    def __init__(self):
        self.results = {}
        self.verdicts = []  # (name, value text, target text, ok)

    def verdict(self, name, value, target, ok):
        self.verdicts.append((name, value, target, ok))

    def summary(self, name, a, b, target=None, label=None):
        """Stores and prints one A/B row; returns the ratio of medians."""
        row = ab_row(a, b)
        self.results[name] = row
        ratio, (lo, hi) = row["ratio"], row["ratio_ci95"]
        verdict = ""
        if target is not None:
            ok = ratio <= target
            verdict = f"{'PASS' if ok else 'MISS'} (<= {target:.2f})"
            if lo <= target <= hi:
                verdict += " [CI straddles the target]"
            self.verdict(label or name, f"{ratio:.3f} x runc (CI {lo:.2f}-{hi:.2f})",
                         f"<= {target:.2f} x", ok)
        print(f"  {name:<34} A {row['A']['median_ms']:7.2f} [{ms(pct(a, 10)):6.2f}-{ms(pct(a, 90)):6.2f}]"
              f"  B {row['B']['median_ms']:7.2f} [{ms(pct(b, 10)):6.2f}-{ms(pct(b, 90)):6.2f}] ms"
              f"  B/A {ratio:.3f} (95% CI {lo:.3f}-{hi:.3f})  {verdict}", flush=True)
        return ratio

    def targets(self, info):
        """Prints the targets' PASS/MISS and the closing line."""
        print("\nscripts/bench: targets")
        w = max(len(v[0]) for v in self.verdicts) if self.verdicts else 10
        for name, value, target, ok in self.verdicts:
            print(f"  {'PASS' if ok else 'MISS'}  {name:<{w}}  {value:<28} target {target}")
        missed = [v for v in self.verdicts if not v[3]]
        print(f"scripts/bench: {len(self.verdicts) - len(missed)} PASS, {len(missed)} MISS; "
              f"load at end {' '.join(info['loadavg_end'])}")

    def write_json(self, path, info, args):
        Path(path).write_text(json.dumps({
            "machine": info, "args": vars(args), "results": self.results,
            "verdicts": [{"name": n, "value": v, "target": t, "pass": ok}
                         for n, v, t, ok in self.verdicts]}, indent=1))
        print(f"scripts/bench: wrote {path}")


def loadavg():
    with open("/proc/loadavg") as f:
        return f.read().split()[:3]


def machine():
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
        "loadavg": loadavg(),
        "mem_total": sh("grep MemTotal /proc/meminfo"),
    }
