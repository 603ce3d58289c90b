"""Engine-level benchmark: what a user feels, `docker run --rm`,
`ctr run --rm` through gpushare-runtime and `podman run --rm` with gpushare's hooks.d (no
shim), against the same engine with plain runc, with a request (warm daemon) and without.
Driven by `scripts/bench --engines`. The CRI pod start is the ignored test
`cri_pod_start_bench` (tests/integration/cri.rs), which has the CRI client.

Each engine is private, as in the integration tests: a mount namespace of its own
(`unshare --mount`, tmpfs over /run, /etc/docker, /etc/cni, /var/lib, /var/cache and /opt),
sockets, roots and state under one temp dir; dockerd with `--bridge none --iptables=false`,
configured by `gpushare install docker`; containerd without its CRI plugin. Every round
runs each variant once, in an order rotated per round, after an idle pause of --settle ms;
reported are the median, p10 and p90 of each variant and the ratio of medians against the
same engine with runc. The container is busybox running `true`, so the figure is the
engine's start path, not a workload.

Standard library only. Needs root, runc, busybox, dockerd (docker.io) and containerd.
Everything is removed at the end, also on Ctrl-C (engines stopped, mounts gone).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

# The world (rootfs, inventory, configuration, temp dir) is the suite's: world.py.
from .frame import BenchError, drive
from .stats import pct
from .world import GPUSHARE, REPO, RUNTIME, World

COVERED = ["/run", "/etc/docker", "/etc/cni", "/var/lib", "/var/cache", "/opt"]
T_ENGINE = 1.02  # <= 1.02 x the median at each engine level


def which(name):
    found = shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/usr/bin:/sbin:/bin")
    if not found:
        raise BenchError(f"{name} not found")
    return found


class Engines:
    def __init__(self, args):
        self.args = args
        self.world = World("gsbe.")
        self.work = self.world.work
        self.cfg = self.work / "runtime.toml"
        self.env = dict(os.environ, GPUSHARE_CONFIG=str(self.cfg))
        self.holder = None
        self.daemons = []  # (name, Popen)
        self.results = {}

    # ------------------------------------------------------------------ set-up

    def setup(self):
        self.world.build()
        self.rootfs = self.world.rootfs
        self.world.config(self.cfg, which("runc"))
        script = ("for d in %s; do if [ -d \"$d\" ]; then mount -t tmpfs -o mode=0755 gs-engine "
                  "\"$d\" || exit 1; fi; done; echo ready; exec sleep 36000") % " ".join(COVERED)
        self.holder = subprocess.Popen([which("unshare"), "--mount", "--propagation", "slave",
                                        "sh", "-c", script], stdin=subprocess.DEVNULL,
                                       stdout=subprocess.PIPE)
        if self.holder.stdout.readline().strip() != b"ready":
            raise BenchError("the engines' mount namespace was not set up")

    def ns(self, argv):
        return [which("nsenter"), f"--mount=/proc/{self.holder.pid}/ns/mnt", "--"] + argv

    def spawn(self, name, argv):
        log = open(self.work / f"{name}.log", "ab")
        p = subprocess.Popen(self.ns(argv), env=self.env, stdin=subprocess.DEVNULL,
                             stdout=log, stderr=log)
        self.daemons.append((name, p))
        return p

    def wait_for(self, what, check, limit=60):
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            if check():
                return
            time.sleep(0.1)
        raise BenchError(f"{what} did not come up (log in {self.work})")

    def ok(self, argv):
        return subprocess.run(argv, env=self.env, stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0

    def must(self, argv):
        p = subprocess.run(argv, env=self.env, stdin=subprocess.DEVNULL, capture_output=True)
        if p.returncode != 0:
            raise BenchError(f"{' '.join(map(str, argv))} exited {p.returncode}: "
                             f"{p.stderr.decode(errors='replace').strip()[-400:]}")
        return p.stdout

    def start_dockerd(self):
        d = self.work / "d"
        d.mkdir()
        self.must([str(GPUSHARE), "install", "docker", "--config", str(d / "daemon.json")])
        self.docker_sock = f"unix://{d / 'docker.sock'}"
        self.spawn("dockerd", [which("dockerd"), "--data-root", str(d / "data"), "--exec-root",
                               str(d / "exec"), "--pidfile", str(d / "docker.pid"), "--host",
                               self.docker_sock, "--config-file", str(d / "daemon.json"),
                               "--bridge", "none", "--iptables=false", "--ip-masq=false",
                               "--ip-forward=false", "--storage-driver", "vfs"])
        self.wait_for("dockerd", lambda: self.ok(self.docker(["version"])))
        tar = self.work / "rootfs.tar"
        self.must(["tar", "-C", str(self.rootfs), "-cf", str(tar), "."])
        self.must(self.docker(["import", str(tar), "gsbench:latest"]))

    def docker(self, args):
        return [which("docker"), "--host", self.docker_sock] + args

    def start_containerd(self):
        c = self.work / "c"
        c.mkdir()
        self.ctr_sock = c / "c.sock"
        (c / "daemon.toml").write_text(
            f'version = 2\nroot = "{c / "root"}"\nstate = "{c / "state"}"\n'
            'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n'
            f'[grpc]\n  address = "{self.ctr_sock}"\n'
            f'[plugins."io.containerd.internal.v1.opt"]\n  path = "{c / "opt"}"\n')
        self.spawn("containerd", [which("containerd"), "--config", str(c / "daemon.toml")])
        self.wait_for("containerd", lambda: self.ok(self.ctr(["version"])))

    def ctr(self, args):
        return self.ns([which("ctr"), "--address", str(self.ctr_sock)] + args)

    # ------------------------------------------------------------------ measuring

    def rounds(self, name, variants, base):
        """variants: {label: argv(i)}; runs each once per round, rotated; `base` maps a
        gpushare label to the runc label it is compared with."""
        samples = {k: [] for k in variants}
        labels = list(variants)
        for r in range(-2, self.args.rounds):  # two warm-up rounds, not counted
            k = r % len(labels)
            for label in labels[k:] + labels[:k]:
                argv = variants[label](r)
                time.sleep(self.args.settle / 1000.0)
                t0 = time.perf_counter_ns()
                p = subprocess.run(argv, env=self.env, stdin=subprocess.DEVNULL,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                t = (time.perf_counter_ns() - t0) / 1e6
                if p.returncode != 0:
                    raise BenchError(f"{name} {label} exited {p.returncode}: "
                                     f"{p.stderr.decode(errors='replace').strip()[-400:]}")
                if r >= 0:
                    samples[label].append(t)
        print(f"[{name}] {self.args.rounds} rounds, settle {self.args.settle:g} ms", flush=True)
        for label, s in samples.items():
            m = statistics.median(s)
            row = {"median_ms": m, "p10_ms": pct(s, 10), "p90_ms": pct(s, 90), "samples_ms": s}
            line = f"  {label:<28} {m:8.1f} ms [{pct(s, 10):7.1f} - {pct(s, 90):7.1f}]"
            if label in base:
                ratio = m / statistics.median(samples[base[label]])
                paired = statistics.median(x / y for x, y in zip(s, samples[base[label]]))
                row.update(ratio=ratio, paired_ratio_median=paired, vs=base[label])
                line += (f"  x{ratio:.3f} vs {base[label]} (paired median x{paired:.3f})  "
                         f"{'PASS' if ratio <= T_ENGINE else 'MISS'} (<= {T_ENGINE})")
            self.results[f"{name}.{label}"] = row
            print(line, flush=True)

    def bench_docker(self):
        self.start_dockerd()
        run = ["run", "--rm", "--network", "none"]
        req = ["-u", "1000", "-e", "GPUSHARE_DEVICE=0"]
        # The warm daemon, started untimed.
        self.must(self.docker(run + ["--runtime", "gpushare"] + req + ["gsbench", "true"]))
        self.rounds("docker run --rm", {
            "runc": lambda r: self.docker(run + ["--runtime", "runc"] + ["gsbench", "true"]),
            "gpushare, no request": lambda r: self.docker(run + ["--runtime", "gpushare", "gsbench", "true"]),
            "runc, -u 1000": lambda r: self.docker(run + ["--runtime", "runc"] + req + ["gsbench", "true"]),
            "gpushare, request (warm)": lambda r: self.docker(run + ["--runtime", "gpushare"] + req
                                                              + ["gsbench", "true"]),
        }, {"gpushare, no request": "runc", "gpushare, request (warm)": "runc, -u 1000"})

    def bench_ctr(self):
        self.start_containerd()
        rootfs = str(self.rootfs)
        n = iter(range(1_000_000))

        def ctr_run(runtime, request):
            def argv(_r):
                extra = ["--annotation", "gpushare.io/device=0"] if request else []
                return self.ctr(["run", "--rm", "--rootfs", "--runc-binary", runtime,
                                 "--env", "PATH=/bin"] + extra + [rootfs, f"b{next(n)}", "true"])
            return argv

        runc = which("runc")
        self.must(ctr_run(str(RUNTIME), True)(0))  # the warm daemon
        self.rounds("ctr run --rm", {
            "runc": ctr_run(runc, False),
            "gpushare, no request": ctr_run(str(RUNTIME), False),
            "runc, annotated": ctr_run(runc, True),
            "gpushare, request (warm)": ctr_run(str(RUNTIME), True),
        }, {"gpushare, no request": "runc", "gpushare, request (warm)": "runc, annotated"})

    def podman(self, hooks, args):
        p = self.work / "p"
        return self.ns([which("podman"), "--root", str(p / "storage"), "--runroot", str(p / "run"),
                        "--tmpdir", str(p / "tmp"), "--hooks-dir", str(hooks),
                        "--storage-driver", "vfs", "--cgroup-manager", "cgroupfs",
                        "--events-backend", "file"] + args)

    def bench_podman(self):
        """Podman: plain runc against gpushare's hooks.d (hook-only mode, the setup the
        README gives for Podman), with and without a request. The shim is not a Podman
        setup, and as Podman 4.3's `--runtime` it does not work here: a create with a
        request fails with conmon's "readObjectStart" error before the shim logs anything,
        and a run without one waits out conmon's 20 s exit timeout (not investigated)."""
        p = self.work / "p"
        hooks, none = p / "hooks.d", p / "no-hooks.d"
        hooks.mkdir(parents=True)
        none.mkdir()
        for name in ("gpushare.json", "gpushare-poststop.json"):
            v = json.loads((REPO / "hooks" / "oci-hooks.d" / name).read_text())
            v["hook"]["path"] = str(GPUSHARE)
            v["hook"]["env"].append(f"GPUSHARE_CONFIG={self.cfg}")
            (hooks / name).write_text(json.dumps(v))
        tar = self.work / "rootfs.tar"
        if not tar.exists():
            self.must(["tar", "-C", str(self.rootfs), "-cf", str(tar), "."])
        self.must(self.podman(none, ["import", str(tar), "gsbench"]))
        run = ["run", "--rm", "--network", "none", "--ulimit", "nofile=1024:1024",
               "--ulimit", "nproc=1024:1024"]
        req = ["--user", "1000", "--annotation", "gpushare.io/device=0"]
        runc = which("runc")

        def variant(hooks_dir, runtime, request):
            return lambda r: self.podman(hooks_dir, run + ["--runtime", runtime]
                                         + (req if request else []) + ["gsbench", "true"])

        self.must(variant(hooks, runc, True)(0))  # the warm daemon
        self.rounds("podman run --rm", {
            "runc": variant(none, runc, False),
            "gpushare hooks.d, no request": variant(hooks, runc, False),
            "runc, annotated": variant(none, runc, True),
            "gpushare hooks.d, request": variant(hooks, runc, True),
        }, {"gpushare hooks.d, no request": "runc", "gpushare hooks.d, request": "runc, annotated"})

    # ------------------------------------------------------------------ clean-up

    def cleanup(self):
        if self.daemons and any(n == "dockerd" for n, _ in self.daemons):
            out = subprocess.run(self.docker(["ps", "-aq"]), capture_output=True, text=True).stdout
            for cid in out.split():
                subprocess.run(self.docker(["rm", "-f", cid]), capture_output=True)
        for _name, p in reversed(self.daemons):
            p.terminate()
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if (self.work / "p" / "storage").exists():
            subprocess.run(self.podman(self.work / "p" / "no-hooks.d", ["rm", "-af"]),
                           capture_output=True)
        self.world.stop_daemons(self.env)
        if self.holder:
            self.holder.kill()
            self.holder.wait()
        self.world.remove(self.args.keep, "bench-engines")


def main():
    ap = argparse.ArgumentParser(prog="scripts/bench --engines", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=30, help="rounds per engine (default 30)")
    ap.add_argument("--settle", type=float, default=200.0, help="idle pause before each run, ms (default 200)")
    ap.add_argument("--only", default="docker,ctr,podman", help="comma-separated: docker,ctr,podman (default all)")
    ap.add_argument("--json", help="also write every sample to this file")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir for inspection")
    args = ap.parse_args()
    suite = Engines(args)

    def run():
        print(f"bench-engines: {time.strftime('%Y-%m-%d %H:%M:%S %z')} nproc={os.cpu_count()} "
              f"load={' '.join(open('/proc/loadavg').read().split()[:3])} work dir {suite.work}",
              flush=True)
        suite.setup()
        only = set(args.only.split(","))
        if "docker" in only:
            suite.bench_docker()
        if "ctr" in only:
            suite.bench_ctr()
        if "podman" in only:
            suite.bench_podman()
        print(f"bench-engines: load at end {' '.join(open('/proc/loadavg').read().split()[:3])}")
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), "results": suite.results}, indent=1))

    return drive("bench-engines", suite, run)


if __name__ == "__main__":
    sys.exit(main())
