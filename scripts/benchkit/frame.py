"""The frame every benchmark driver runs in (the suite and the engines): SIGINT, SIGTERM and
SIGHUP interrupt the run, and whatever happens the world is cleaned up and the binaries'
copies go. Exit code: 0, 2 when a benchmark failed, 130 when interrupted."""

import signal
import sys

from .world import drop_bin_copies


class BenchError(Exception):
    """A benchmark itself failed: a create failed, two daemons for one identity, ..."""


def drive(name, suite, run):
    """Runs `run()`; `suite.cleanup()` runs whatever happens. Returns the exit code."""
    def on_signal(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, on_signal)
    code = 0
    try:
        run()
    except BenchError as e:
        print(f"{name}: FAILED: {e}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt as e:
        print(f"{name}: interrupted ({e}); cleaning up", file=sys.stderr)
        code = 130
    finally:
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, signal.SIG_IGN)
        suite.cleanup()
        drop_bin_copies()
    return code
