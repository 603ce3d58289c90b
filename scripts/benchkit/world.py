"""The world a benchmark runs in, built from the pieces the tests and the README's "Try it
without a GPU" use:

- the rootfs: scripts/sim-rootfs (busybox and the simulator's client, with the shared
  libraries each links), the script the README and scripts/quickstart run;
- the inventory: docs/examples/inventory.json, the file the integration harness reads, copied
  into the world's temp dir. GPU 0 (an A30) carries every request; the node-scale set also
  uses the first other GPU not in MIG mode (GPU 2), since a GPU in MIG mode is only
  requested through its MIG devices;
- the MPS simulator as `mps.control-binary`, `shm-size = "64M"`, `start-timeout = "10s"`, as
  in the harness's configuration.

The inventory is part of what a create with a request costs: the shim reads it to resolve
the request, and this one (3 GPUs, 3 MIG devices) takes ~31,000 more instructions to read
than the two-A30 inventory the figures before 2026-11-26 were measured with. Builds compared
with --old run in one world and are not affected.

Where it differs from the tests' world, on purpose:

- release binaries (scripts/build-release: the shim static-pie, as shipped), each run as an
  installed copy, never the linker's output file (`installed_copy`);
- `log-level = "info"`, the shipped default (the tests run at debug), except the cold
  start's B side, whose debug events mark its phases;
- one temp dir `/tmp/gsb.XXXXXXXX` (`gsbe.` for the engines), mode 0711 so per-user daemons
  reach their pipe directories, rather than cargo's temp dir: a run leaves nothing behind,
  also when interrupted (`World.cleanup`).
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
# GPUSHARE_BENCH_BIN: another build's binaries (an old-against-new comparison).
REL = Path(os.environ.get("GPUSHARE_BENCH_BIN") or REPO / "target" / "release")
RUNTIME = REL / "gpushare-runtime"
GPUSHARE = REL / "gpushare"
SIM = REL / "gpushare-mps-sim"
SIM_ROOTFS = REPO / "scripts" / "sim-rootfs"
INVENTORY = REPO / "docs" / "examples" / "inventory.json"


def which(name):
    found = shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/usr/bin:/sbin:/bin")
    if not found:
        sys.exit(f"scripts/bench: {name} not found")
    return found


RUNC = which("runc")
TRUE = which("true")


def _gpus():
    """The inventory's GPU 0 and the GPUs a whole-GPU request may name (not in MIG mode)."""
    gpus = json.loads(INVENTORY.read_text())["gpus"]
    whole = [g for g in gpus if not g.get("mig_devices")]
    if not whole or whole[0]["index"] != 0 or len(whole) < 2:
        sys.exit(f"scripts/bench: {INVENTORY} must have GPU 0 and one more GPU without MIG devices")
    return whole


GPU0 = _gpus()[0]["uuid"]
# The node-scale set's two GPUs, as `gpushare.io/device` values and their UUIDs.
SCALE_DEVICES = tuple((str(g["index"]), g["uuid"]) for g in _gpus()[:2])


def installed_copy(linked, path):
    """`linked` copied to `path` as a package manager writes a file, and the copy's path.
    Every program a benchmark execs is such a copy (scripts/bench copies gpushare's
    binaries too): on this machine's kernel a file just written by the linker takes ~10
    more page faults per exec than a copy of it (ext4 page-cache folios), ~250 us, which
    would count against whichever side was linked last (BENCHMARKS.md, "Method")."""
    shutil.copyfile(linked, path)
    os.chmod(path, 0o755)
    return path


def drop_bin_copies():
    """Removes the binaries' copies scripts/bench made for this run (it execs the driver,
    so the driver removes them: GPUSHARE_BENCH_BIN_TEMP names that directory)."""
    temp = os.environ.get("GPUSHARE_BENCH_BIN_TEMP")
    if temp and Path(temp) == REL and REL.name.startswith("gsbin."):
        shutil.rmtree(REL, ignore_errors=True)


class World:
    """One temp dir with a rootfs, the inventory, configurations and gpushare's state."""

    def __init__(self, prefix):
        self.work = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
        # Per-user daemons run as their uid and must traverse to their pipe directory.
        os.chmod(self.work, 0o711)
        self.state = self.work / "s"
        self.log = self.work / "gpushare.log"
        self.rootfs = self.work / "rootfs"
        self.inventory = self.work / "inventory.json"

    def build(self):
        """The rootfs (scripts/sim-rootfs) and the inventory's copy."""
        subprocess.run([str(SIM_ROOTFS), str(self.rootfs), str(SIM)], check=True,
                       stdout=subprocess.DEVNULL)
        shutil.copyfile(INVENTORY, self.inventory)

    def config(self, path, runtime, log_level="info", mps_extra=""):
        """Writes a configuration at `path`: `runtime` as the low-level runtime, this
        world's state, log and inventory, the simulator as the MPS control binary, and
        `mps_extra` (lines) in its [mps] table."""
        path.write_text(
            f'low-level-runtime = ["{runtime}"]\n'
            f'state-dir = "{self.state}"\n'
            f'log-file = "{self.log}"\n'
            f'log-level = "{log_level}"\n'
            f'inventory = "file:{self.inventory}"\n'
            "[mps]\n"
            f'control-binary = "{SIM}"\n'
            'shm-size = "64M"\n'
            'start-timeout = "10s"\n'
            + mps_extra)
        return path

    def stop_daemons(self, env):
        """Stops every MPS daemon of this world's state (`gpushare daemon stop --all`)."""
        cfg = env.get("GPUSHARE_CONFIG")
        if cfg and Path(cfg).exists() and GPUSHARE.exists():
            subprocess.run([str(GPUSHARE), "daemon", "stop", "--all", "--force"], env=env,
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)

    def remove(self, keep, name):
        """Unmounts whatever is still mounted under the temp dir (deepest first), then
        removes it, or keeps it for inspection."""
        mounts = []
        with open("/proc/self/mountinfo") as f:
            for line in f:
                mp = line.split()[4].replace("\\040", " ")
                if mp == str(self.work) or mp.startswith(str(self.work) + "/"):
                    mounts.append(mp)
        for mp in sorted(mounts, key=len, reverse=True):
            subprocess.run(["umount", "-l", mp], stderr=subprocess.DEVNULL)
        if keep:
            print(f"{name}: kept {self.work}")
        else:
            shutil.rmtree(self.work, ignore_errors=True)
