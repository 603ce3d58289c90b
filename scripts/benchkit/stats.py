"""Statistics of the samples: percentiles (numpy's default interpolation), the bootstrap
interval of a ratio of medians, and the A/B row every ratio benchmark reports."""

import random
import statistics


def ms(ns):
    return ns / 1e6


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


def ab_row(a, b):
    """The row of one A/B benchmark (samples in ns, the row in ms), as the JSON file has it."""
    ma, mb = statistics.median(a), statistics.median(b)
    lo, hi = ratio_ci(a, b)
    return {
        "ratio_ci95": [lo, hi],
        "A": {"median_ms": ms(ma), "p10_ms": ms(pct(a, 10)), "p90_ms": ms(pct(a, 90)), "n": len(a)},
        "B": {"median_ms": ms(mb), "p10_ms": ms(pct(b, 10)), "p90_ms": ms(pct(b, 90)), "n": len(b)},
        "ratio": mb / ma,
        "paired_ratio_p10_p50_p90": [pct([y / x for x, y in zip(a, b)], p) for p in (10, 50, 90)],
        "samples_ms": {"A": [ms(x) for x in a], "B": [ms(x) for x in b]},
    }
