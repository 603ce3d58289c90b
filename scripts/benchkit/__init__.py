"""gpushare's benchmarks, run by scripts/bench (which builds the release binaries first).

    python3 -B -m benchkit           the suite: [1]-[9] of BENCHMARKS.md (cli.py)
    python3 -B -m benchkit.engines   docker run / ctr run / podman run (engines.py)

(with scripts/ on PYTHONPATH, as scripts/bench runs them). The modules, each one job:

    world.py     the test world: the binaries, the inventory and rootfs the tests use, the
                 configurations, one temp dir and its removal
    frame.py     the driver frame: signals, clean-up, exit codes; BenchError
    node.py      runc and the shim on that world: bundles, timed commands, daemons
    stats.py     percentiles, the bootstrap interval of a ratio, A/B rows
    report.py    the printed A/B rows, the targets' PASS/MISS, the machine, the JSON file
    runners/     one module per measured path: lifecycle ([1] [2] [3] [8]), cold ([4] [5]),
                 own_cost ([6] [7]), scale ([9])

Standard library only.
"""
