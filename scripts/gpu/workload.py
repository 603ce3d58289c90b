#!/usr/bin/env python3
"""The CUDA workload of the real-GPU tier (scripts/gpu-check), plus the small helpers the
script runs as root to read results back. Standard library only; torch is imported lazily,
so this file imports cleanly on a machine without torch or CUDA.

Workload modes (run as the test UIDs, one JSON object per line on stdout):

  probe                                  torch/CUDA available? device name, memory
  matmul --size S (--iterations N | --seconds T) [--batch B] [--go FILE]
                                         S x S fp32 matrix products; with --seconds it runs
                                         batches of B products until T s after the first kernel
                                         (with --go: after FILE exists, as infer and train)
  fault                                  a fatal GPU fault (an out-of-bounds gather trips a
                                         device-side assert): "faulted" and the error; exit 1
  alloc --bytes N [--hold T] [--host-pinned M]
                                         allocate N bytes on the GPU and touch them (and M
                                         bytes of pinned host memory); print an "allocated"
                                         line; keep them T s, touching them every 0.5 s (a
                                         failing touch prints a "cuda_error" line)

  infer --seconds T --rate R [--go FILE] [--stand-in]
                                         a small MLP's forward passes (batch 8, 1024-4096-4096-1024,
                                         fp32, random weights) at R requests/s for T s; each
                                         request's latency (from its scheduled time to the end of
                                         its torch.cuda.synchronize()) is recorded: p50/p90/p99/max
                                         in ms and every latency, rounded to 10 us
  train --seconds T [--go FILE] [--stand-in]
                                         a saturating training loop (an MLP, batch 512, width
                                         4096, SGD) for T s: iterations and iterations/s
  (infer and train print a "ready" line once their model is built and warmed up, then wait
  for FILE to exist (at most 300 s) before their T s start, so that co-located tenants
  measure the same window; --stand-in replaces CUDA by a CPU loop with the same lines, for
  the simulated run)

  Each prints, as soon as the first kernel has completed, a line
  {"event": "first_kernel", "t_first_kernel": …} (so the caller can tell the process holds an
  MPS server), then one final line with "event": "result": pid, uid, t_start (time.time() at
  process start, before torch is imported), t_first_kernel, t_end, ok, error, and the mode's
  figures. Exit code: 0 ok, 1 the CUDA work failed (an allocation refused included), 2 torch or
  CUDA unavailable, 64 bad arguments.

Helper modes (run by gpu-check as root, never as a test UID):

  result --dir D --label L --kind real|sim --uid U
         normalizes one client run (the files D/L.{t0,t1,rc,out,err} the script wrote) into one
         JSON line: t_launch, t_first_kernel, t_end, latencies, ok, error
  field FILE KEY...                      prints KEY=value lines (shell-quoted) of a JSON file
  table FILE                             prints the client-run table of a JSONL run file
"""

import time

T_START = time.time()

# The rest of the imports come after the timestamp on purpose.
import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_UNAVAILABLE = 2
EXIT_USAGE = 64


def emit(obj):
    sys.stdout.write(json.dumps(obj, sort_keys=True) + "\n")
    sys.stdout.flush()


def base(mode):
    return {
        "event": "result",
        "mode": mode,
        "pid": os.getpid(),
        "uid": os.getuid(),
        "gid": os.getgid(),
        "t_start": T_START,
        "t_first_kernel": None,
        "t_end": None,
        "ok": False,
        "error": None,
        "env": {
            k: os.environ.get(k)
            for k in (
                "CUDA_MPS_PIPE_DIRECTORY",
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
                "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
                "CUDA_VISIBLE_DEVICES",
            )
            if os.environ.get(k) is not None
        },
    }


def one_line(text):
    return " ".join(str(text).split())[:600]


def load_torch(res):
    """Returns torch with a usable CUDA device, or None after filling res['error']."""
    try:
        import torch  # noqa: WPS433 (lazy on purpose)
    except Exception as e:  # ImportError, or a broken install
        res["error"] = "torch not importable: %s: %s" % (type(e).__name__, one_line(e))
        return None
    res["torch"] = getattr(torch, "__version__", "?")
    res["torch_cuda"] = getattr(torch.version, "cuda", None)
    try:
        available = torch.cuda.is_available()
    except Exception as e:
        res["error"] = "torch.cuda.is_available() raised %s: %s" % (type(e).__name__, one_line(e))
        return None
    if not available:
        res["error"] = "torch %s sees no CUDA device (torch.cuda.is_available() is False)" % res["torch"]
        return None
    return torch


def first_kernel(torch, res):
    """Creates the CUDA context with one tiny kernel: under MPS this is where a client of another
    UID queues."""
    x = torch.ones(1, device="cuda")
    x += 1
    torch.cuda.synchronize()
    res["t_first_kernel"] = time.time()
    props = torch.cuda.get_device_properties(0)
    res["device"] = props.name
    res["device_total_memory"] = int(props.total_memory)
    res["multi_processor_count"] = int(props.multi_processor_count)
    emit({"event": "first_kernel", "pid": os.getpid(), "uid": os.getuid(),
          "t_start": T_START, "t_first_kernel": res["t_first_kernel"]})


def cmd_probe(args):
    res = base("probe")
    res["python"] = sys.executable
    torch = load_torch(res)
    if torch is None:
        res["t_end"] = time.time()
        emit(res)
        return EXIT_UNAVAILABLE
    try:
        first_kernel(torch, res)
        free, total = torch.cuda.mem_get_info()
        res["mem_get_info"] = {"free": int(free), "total": int(total)}
        res["ok"] = True
    except Exception as e:
        res["error"] = "%s: %s" % (type(e).__name__, one_line(e))
    res["t_end"] = time.time()
    emit(res)
    return EXIT_OK if res["ok"] else EXIT_FAILED


def cmd_fault(args):
    """A fatal GPU fault: an out-of-bounds gather, which trips a device-side assert."""
    res = base("fault")
    torch = load_torch(res)
    if torch is None:
        res["t_end"] = time.time()
        emit(res)
        return EXIT_UNAVAILABLE
    res["faulted"] = False
    try:
        first_kernel(torch, res)
        x = torch.zeros(16, device="cuda")
        idx = torch.tensor([1 << 30], device="cuda")
        y = x[idx]
        torch.cuda.synchronize()
        res["error"] = "no fault: the gather returned %s" % one_line(y.cpu())
    except Exception as e:
        res["faulted"] = True
        res["error"] = "%s: %s" % (type(e).__name__, one_line(e))
    res["t_end"] = time.time()
    emit(res)
    return EXIT_FAILED


def cmd_matmul(args):
    res = base("matmul")
    res.update(size=args.size, dtype="float32")
    torch = load_torch(res)
    if torch is None:
        res["t_end"] = time.time()
        emit(res)
        return EXIT_UNAVAILABLE
    done = 0
    try:
        # Plain fp32: no TF32, so the figures do not depend on torch's default of the day.
        torch.backends.cuda.matmul.allow_tf32 = False
        first_kernel(torch, res)
        a = torch.randn(args.size, args.size, device="cuda", dtype=torch.float32)
        b = torch.randn(args.size, args.size, device="cuda", dtype=torch.float32)
        c = torch.empty(args.size, args.size, device="cuda", dtype=torch.float32)
        torch.cuda.synchronize()
        if args.go:
            torch.matmul(a, b, out=c)
            torch.cuda.synchronize()
            if not wait_go(args, res):
                raise RuntimeError(res["error"])
        t0 = time.time()
        if args.seconds is not None:
            until = t0 + args.seconds
            while True:
                for _ in range(args.batch):
                    torch.matmul(a, b, out=c)
                done += args.batch
                torch.cuda.synchronize()
                if time.time() >= until:
                    break
        else:
            for _ in range(args.iterations):
                torch.matmul(a, b, out=c)
            done = args.iterations
            torch.cuda.synchronize()
        t1 = time.time()
        res["compute_s"] = t1 - t0
        res["iterations"] = done
        res["iters_per_s"] = done / (t1 - t0) if t1 > t0 else None
        res["tflops"] = (2.0 * args.size ** 3 * done / (t1 - t0) / 1e12) if t1 > t0 else None
        res["ok"] = True
    except Exception as e:
        res["iterations"] = done
        res["error"] = "%s: %s" % (type(e).__name__, one_line(e))
    res["t_end"] = time.time()
    emit(res)
    return EXIT_OK if res["ok"] else EXIT_FAILED


def cmd_alloc(args):
    res = base("alloc")
    res["bytes"] = args.bytes
    torch = load_torch(res)
    if torch is None:
        res["t_end"] = time.time()
        emit(res)
        return EXIT_UNAVAILABLE
    try:
        first_kernel(torch, res)
        try:
            free, total = torch.cuda.mem_get_info()
            res["mem_get_info"] = {"free": int(free), "total": int(total)}
        except Exception as e:  # informative only
            res["mem_get_info"] = "unavailable: %s" % one_line(e)
        buf = torch.empty(args.bytes, dtype=torch.uint8, device="cuda")
        buf.fill_(1)
        torch.cuda.synchronize()
        res["allocated"] = int(buf.numel())
        if args.host_pinned:
            host = torch.empty(args.host_pinned, dtype=torch.uint8, pin_memory=True)
            host.fill_(1)
            res["host_pinned"] = int(host.numel())
        emit({"event": "allocated", "pid": os.getpid(), "t": time.time(),
              "bytes": res["allocated"], "host_pinned": res.get("host_pinned"),
              "multi_processor_count": res.get("multi_processor_count"),
              "mem_get_info": res.get("mem_get_info")})
        # --hold: keep the allocation, touching it twice a second, so that the caller can
        # look at the process (its fds, NVML) and see when a CUDA call starts failing.
        until = time.time() + args.hold
        touches = 0
        while time.time() < until:
            time.sleep(0.5)
            try:
                buf[0:1].add_(1)
                torch.cuda.synchronize()
                touches += 1
            except Exception as e:
                emit({"event": "cuda_error", "t": time.time(), "after_touches": touches,
                      "error": "%s: %s" % (type(e).__name__, one_line(e))})
                raise
        res["touches"] = touches
        res["ok"] = True
        del buf
    except Exception as e:
        res["error"] = "%s: %s" % (type(e).__name__, one_line(e))
    res["t_end"] = time.time()
    emit(res)
    return EXIT_OK if res["ok"] else EXIT_FAILED


def wait_go(args, res):
    """Prints "ready", then waits for --go (at most 300 s); False after filling res['error']."""
    emit({"event": "ready", "pid": os.getpid(), "uid": os.getuid(), "t": time.time()})
    if not args.go:
        return True
    deadline = time.time() + 300.0
    while not os.path.exists(args.go):
        if time.time() > deadline:
            res["error"] = "no go file %s within 300 s" % args.go
            return False
        time.sleep(0.005)
    return True


def percentiles(values):
    """p50, p90, p99 and max (nearest rank) of values, or Nones."""
    if not values:
        return {"p50": None, "p90": None, "p99": None, "max": None}
    v = sorted(values)
    rank = lambda q: v[min(len(v) - 1, max(0, int(-(-q * len(v) // 1)) - 1))]  # noqa: E731
    return {"p50": rank(0.50), "p90": rank(0.90), "p99": rank(0.99), "max": v[-1]}


def stand_in_work(n):
    """The CPU stand-in of one request or one training step."""
    acc = 0
    for i in range(n):
        acc += i * i
    return acc


def cmd_infer(args):
    res = base("infer")
    res.update(rate=args.rate, seconds=args.seconds, stand_in=args.stand_in)
    if args.stand_in:
        forward = lambda: stand_in_work(2000)  # noqa: E731
        sync = lambda: None  # noqa: E731
        res["t_first_kernel"] = time.time()
        emit({"event": "first_kernel", "pid": os.getpid(), "uid": os.getuid(),
              "t_start": T_START, "t_first_kernel": res["t_first_kernel"]})
    else:
        torch = load_torch(res)
        if torch is None:
            res["t_end"] = time.time()
            emit(res)
            return EXIT_UNAVAILABLE
    try:
        if not args.stand_in:
            torch.backends.cuda.matmul.allow_tf32 = False
            first_kernel(torch, res)
            model = torch.nn.Sequential(
                torch.nn.Linear(1024, 4096), torch.nn.GELU(),
                torch.nn.Linear(4096, 4096), torch.nn.GELU(),
                torch.nn.Linear(4096, 1024)).cuda().eval()
            x = torch.randn(8, 1024, device="cuda")

            def forward():
                with torch.no_grad():
                    return model(x)

            sync = torch.cuda.synchronize
        for _ in range(20):
            forward()
        sync()
        if not wait_go(args, res):
            raise RuntimeError(res["error"])
        period = 1.0 / args.rate
        t0 = time.time()
        res["t_measure"] = t0
        lat, service, late = [], [], 0
        i = 0
        while True:
            due = t0 + i * period
            if due >= t0 + args.seconds:
                break
            now = time.time()
            if now < due:
                time.sleep(due - now)
            else:
                late += 1
            begin = time.time()
            forward()
            sync()
            end = time.time()
            lat.append(end - due)
            service.append(end - begin)
            i += 1
        ms = lambda v: None if v is None else round(v * 1000.0, 3)  # noqa: E731
        res["requests"] = len(lat)
        res["late_starts"] = late
        res["latency_ms"] = {k: ms(v) for k, v in percentiles(lat).items()}
        res["service_ms"] = {k: ms(v) for k, v in percentiles(service).items()}
        res["latencies_ms"] = [round(v * 1000.0, 2) for v in lat]
        res["ok"] = len(lat) > 0
    except Exception as e:
        res["error"] = res["error"] or "%s: %s" % (type(e).__name__, one_line(e))
    res["t_end"] = time.time()
    emit(res)
    return EXIT_OK if res["ok"] else EXIT_FAILED


def cmd_train(args):
    res = base("train")
    res.update(seconds=args.seconds, stand_in=args.stand_in)
    if args.stand_in:
        res["t_first_kernel"] = time.time()
        emit({"event": "first_kernel", "pid": os.getpid(), "uid": os.getuid(),
              "t_start": T_START, "t_first_kernel": res["t_first_kernel"]})
    else:
        torch = load_torch(res)
        if torch is None:
            res["t_end"] = time.time()
            emit(res)
            return EXIT_UNAVAILABLE
    done = 0
    try:
        if args.stand_in:
            step = lambda: stand_in_work(20000)  # noqa: E731
            sync = lambda: None  # noqa: E731
        else:
            torch.backends.cuda.matmul.allow_tf32 = False
            first_kernel(torch, res)
            model = torch.nn.Sequential(
                torch.nn.Linear(4096, 4096), torch.nn.ReLU(),
                torch.nn.Linear(4096, 4096), torch.nn.ReLU(),
                torch.nn.Linear(4096, 4096)).cuda()
            opt = torch.optim.SGD(model.parameters(), lr=1e-4)
            x = torch.randn(512, 4096, device="cuda")
            y = torch.randn(512, 4096, device="cuda")

            def step():
                opt.zero_grad(set_to_none=True)
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                opt.step()

            sync = torch.cuda.synchronize
        for _ in range(5):
            step()
        sync()
        if not wait_go(args, res):
            raise RuntimeError(res["error"])
        t0 = time.time()
        res["t_measure"] = t0
        until = t0 + args.seconds
        # Synchronized every 5 steps: the queue stays full (saturating) and the count exact.
        while True:
            for _ in range(5):
                step()
            sync()
            done += 5
            if time.time() >= until:
                break
        t1 = time.time()
        res["compute_s"] = t1 - t0
        res["iterations"] = done
        res["iters_per_s"] = done / (t1 - t0) if t1 > t0 else None
        res["ok"] = True
    except Exception as e:
        res["iterations"] = done
        res["error"] = res["error"] or "%s: %s" % (type(e).__name__, one_line(e))
    res["t_end"] = time.time()
    emit(res)
    return EXIT_OK if res["ok"] else EXIT_FAILED


# ---------------------------------------------------------------- helpers (root side)

SIM_LINE = re.compile(r"^mps-client (.*)$")


def read(path, default=None):
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return default


def num(text):
    try:
        return float(text.strip())
    except (AttributeError, ValueError):
        return None


def cmd_result(args):
    p = os.path.join(args.dir, args.label)
    out = read(p + ".out", "")
    err = read(p + ".err", "")
    rc_text = read(p + ".rc")
    rc = int(rc_text) if rc_text and rc_text.strip().lstrip("-").isdigit() else None
    r = {
        "event": "client",
        "label": args.label,
        "kind": args.kind,
        "uid": args.uid,
        "rc": rc,
        "t_launch": num(read(p + ".t0")),
        "t_exit": num(read(p + ".t1")),
        "ok": False,
        "error": None,
    }
    if args.kind == "sim":
        m = None
        for line in out.splitlines():
            m = SIM_LINE.match(line.strip()) or m
        if m:
            kv = dict(item.split("=", 1) for item in m.group(1).split() if "=" in item)
            r["sim"] = kv
            r["client_uid"] = int(kv.get("uid", -1))
            r["server_pid"] = kv.get("server")
            r["server_uid"] = kv.get("server_uid")
            r["waited_ms"] = int(kv.get("waited_ms", 0))
            r["active_thread_percentage"] = kv.get("active_thread_percentage")
            r["pinned_mem_limit"] = kv.get("pinned_mem_limit")
            if r["t_launch"] is not None:
                # The simulated "first kernel": the moment the daemon attached it to a server.
                r["t_first_kernel"] = r["t_launch"] + r["waited_ms"] / 1000.0
        r["t_start"] = r["t_launch"]
        r["t_end"] = r["t_exit"]
        r["ok"] = rc == 0 and m is not None
    else:
        final = None
        for line in out.splitlines():
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if obj.get("event") == "result":
                final = obj
            elif obj.get("event") == "first_kernel" and final is None:
                r["t_first_kernel"] = obj.get("t_first_kernel")
        if final:
            r["payload"] = final
            r["client_uid"] = final.get("uid")
            for k in ("t_start", "t_first_kernel", "t_end", "iterations", "iters_per_s",
                      "tflops", "compute_s", "device", "allocated", "mem_get_info"):
                if final.get(k) is not None:
                    r[k] = final.get(k)
            r["ok"] = bool(final.get("ok")) and rc == 0
            r["error"] = final.get("error")
        r.setdefault("t_end", r["t_exit"])
    if not r["ok"] and not r["error"]:
        tail = [l for l in err.splitlines() if l.strip()][-3:]
        if rc in (124, 137):
            r["error"] = "killed by the script's deadline (rc %d); %s" % (rc, one_line(" | ".join(tail)))
        else:
            r["error"] = one_line(" | ".join(tail)) or "no output (rc %s)" % rc
    t0, tf, te = r.get("t_launch"), r.get("t_first_kernel"), r.get("t_end")
    r["first_kernel_latency_s"] = (tf - t0) if (tf is not None and t0 is not None) else None
    r["wall_s"] = (te - t0) if (te is not None and t0 is not None) else None
    print(json.dumps(r, sort_keys=True))
    return 0


def cmd_field(args):
    with open(args.file, encoding="utf-8") as f:
        obj = json.load(f)
    for key in args.keys:
        v = obj
        for part in key.split("."):
            v = v.get(part) if isinstance(v, dict) else None
        if v is None:
            v = ""
        elif isinstance(v, bool):
            v = "1" if v else "0"
        elif isinstance(v, float):
            v = "%.6f" % v
        elif not isinstance(v, str):
            v = json.dumps(v)
        print("%s=%s" % (key.replace(".", "_"), shlex.quote(v)))
    return 0


def fmt(v, spec="%.2f"):
    return "-" if v is None else spec % v


def cmd_table(args):
    rows = []
    with open(args.file, encoding="utf-8") as f:
        for line in f:
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if obj.get("event") == "client":
                rows.append(obj)
    if not rows:
        return 0
    t_ref = min(r["t_launch"] for r in rows if r.get("t_launch") is not None)
    head = "%-24s %5s %3s %7s %7s %7s %8s  %s" % (
        "client", "uid", "rc", "launch", "kernel1", "end", "latency", "detail")
    print(head)
    print("-" * len(head))
    for r in rows:
        rel = lambda k: None if r.get(k) is None else r[k] - t_ref  # noqa: E731
        if not r.get("ok"):
            detail = ""
        elif r.get("kind") == "sim":
            detail = "server=%s(uid %s) threads=%s mem=%s" % (
                r.get("server_pid"), r.get("server_uid"),
                r.get("active_thread_percentage"), r.get("pinned_mem_limit"))
        else:
            bits = []
            if r.get("iters_per_s") is not None:
                bits.append("%.1f it/s" % r["iters_per_s"])
            if r.get("tflops") is not None:
                bits.append("%.2f TFLOP/s" % r["tflops"])
            if r.get("allocated") is not None:
                bits.append("allocated %d B" % r["allocated"])
            detail = " ".join(bits)
        if not r.get("ok"):
            detail = ("ERROR: " + str(r.get("error")))[:120]
        print("%-24s %5s %3s %7s %7s %7s %8s  %s" % (
            r.get("label", "?")[:24], r.get("uid"), r.get("rc"),
            fmt(rel("t_launch")), fmt(rel("t_first_kernel")), fmt(rel("t_end")),
            fmt(r.get("first_kernel_latency_s")), detail))
    return 0


def main(argv):
    ap = argparse.ArgumentParser(description="gpushare GPU-tier workload and helpers")
    sub = ap.add_subparsers(dest="cmd")
    sub.add_parser("probe")
    mm = sub.add_parser("matmul")
    mm.add_argument("--size", type=int, default=256)
    g = mm.add_mutually_exclusive_group()
    g.add_argument("--iterations", type=int, default=None)
    g.add_argument("--seconds", type=float, default=None)
    mm.add_argument("--batch", type=int, default=10)
    mm.add_argument("--go", default=None)
    sub.add_parser("fault")
    al = sub.add_parser("alloc")
    al.add_argument("--bytes", type=int, required=True)
    al.add_argument("--hold", type=float, default=0.0)
    al.add_argument("--host-pinned", type=int, default=0)
    inf = sub.add_parser("infer")
    inf.add_argument("--seconds", type=float, required=True)
    inf.add_argument("--rate", type=float, default=100.0)
    inf.add_argument("--go", default=None)
    inf.add_argument("--stand-in", action="store_true")
    tr = sub.add_parser("train")
    tr.add_argument("--seconds", type=float, required=True)
    tr.add_argument("--go", default=None)
    tr.add_argument("--stand-in", action="store_true")
    rs = sub.add_parser("result")
    rs.add_argument("--dir", required=True)
    rs.add_argument("--label", required=True)
    rs.add_argument("--kind", choices=["real", "sim"], required=True)
    rs.add_argument("--uid", type=int, default=None)
    fd = sub.add_parser("field")
    fd.add_argument("file")
    fd.add_argument("keys", nargs="+")
    tb = sub.add_parser("table")
    tb.add_argument("file")
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:
        return EXIT_USAGE if e.code else 0
    if args.cmd is None:
        ap.print_usage(sys.stderr)
        return EXIT_USAGE
    if args.cmd == "matmul":
        if args.iterations is None and args.seconds is None:
            args.iterations = 100000
        if args.size < 1 or args.batch < 1 or (args.iterations is not None and args.iterations < 1):
            sys.stderr.write("workload.py: --size, --batch and --iterations must be positive\n")
            return EXIT_USAGE
    if args.cmd in ("infer", "train"):
        if not 0 < args.seconds <= 600 or (args.cmd == "infer" and not 0 < args.rate <= 10000):
            sys.stderr.write("workload.py: --seconds must be in (0, 600] and --rate in (0, 10000]\n")
            return EXIT_USAGE
    handlers = {
        "probe": cmd_probe, "matmul": cmd_matmul, "alloc": cmd_alloc,
        "infer": cmd_infer, "train": cmd_train, "fault": cmd_fault,
        "result": cmd_result, "field": cmd_field, "table": cmd_table,
    }
    return handlers[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
