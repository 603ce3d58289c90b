#!/bin/bash
# Issue 15 material on a real GPU: kill -9 a gpushare supervisor, the MPS control daemon, or
# the MPS server while a CUDA client of that daemon computes. For each: what the running
# client gets, what gpushare does, and how soon the next client computes.
exec > >(tee "$OUT/faults.txt") 2>&1
export PATH=/usr/local/nvidia/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
PY=/opt/torch/.venv/bin/python3
BIN=$PWD/.gpu/bin
W=$(mktemp -d /tmp/gsf.XXXXXX); chmod 711 "$W"
mkdir -m 755 "$W/bin"; install -m 755 scripts/gpu/workload.py "$W/bin/"
for u in 1000 2000; do install -d -m 700 -o $u -g $u "$W/h$u"; done
UUID=$(nvidia-smi --query-gpu=uuid --format=csv,noheader | head -1)
DRV=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1)
cat > "$W/inventory.json" <<J
{"driver_version": "$DRV", "gpus": [{"index": 0, "uuid": "$UUID", "name": "NVIDIA H100 80GB HBM3", "memory_bytes": 85520809984, "compute_capability": "9.0", "compute_mode": "default"}]}
J
cat > "$W/rt.toml" <<T
low-level-runtime = ["/usr/bin/true"]
state-dir = "$W/s"
log-file = "$W/gs.log"
inventory = "file:$W/inventory.json"
[mps]
control-binary = "/usr/local/nvidia/bin/nvidia-cuda-mps-control"
idle-timeout = "10m"
T
gs() { GPUSHARE_CONFIG=$W/rt.toml timeout -k 5 60 "$BIN/gpushare" "$@"; }
now() { date +%s.%N; }
client() { # LABEL UID PIPE SECONDS
    local l=$1 u=$2 p=$3 s=$4
    ( t0=$(now)
      timeout -k 5 120 unshare --mount --propagation slave sh -c 'mount --bind "$0" /dev/shm && exec "$@"' "${p%/pipe}/shm" \
        setpriv --reuid "$u" --regid "$u" --clear-groups env -i PATH=/usr/bin:/bin HOME="$W/h$u" \
        CUDA_MPS_PIPE_DIRECTORY="$p" PYTHONDONTWRITEBYTECODE=1 \
        "$PY" "$W/bin/workload.py" matmul --size 4096 --seconds "$s" --batch 10 >"$W/$l.out" 2>"$W/$l.err" </dev/null
      echo "rc=$? launched=$t0 ended=$(now)" >"$W/$l.rc" ) &
}
wait_fk() { # LABEL TIMEOUT_S
    local end=$(( SECONDS + $2 ))
    until grep -q '"event": "first_kernel"' "$W/$1.out" 2>/dev/null; do
        [ -s "$W/$1.rc" ] && return 1; [ $SECONDS -lt $end ] || return 1; sleep 0.05; done
}
wait_rc() { local end=$(( SECONDS + $2 )); until [ -s "$W/$1.rc" ]; do [ $SECONDS -lt $end ] || return 1; sleep 0.1; done; }
report() { # LABEL
    local res; res=$(grep '"event": "result"' "$W/$1.out" | tail -1)
    echo "  $1: $(cat "$W/$1.rc" 2>/dev/null || echo 'still running') | ok=$(sed -n 's/.*"ok": \([a-z]*\).*/\1/p' <<<"$res") first_kernel_latency=$(python3 -c 'import json,sys; r=json.loads(sys.argv[1]); print(round(r["t_first_kernel"]-r["t_start"],2) if r.get("t_first_kernel") else None)' "$res" 2>/dev/null) error=$(sed -n 's/.*"error": \("[^"]*"\|null\).*/\1/p' <<<"$res" | cut -c1-200)"
    [ -n "$res" ] || { echo "  $1 stdout/stderr tail:"; tail -3 "$W/$1.out" "$W/$1.err" | cut -c1-200; }
}
field() { gs status --json | python3 -c "import json,sys; d=[x for x in json.load(sys.stdin)['daemons'] if x['id']=='$1']; print(d[0]['$2'] if d else '')"; }
procs() { ps -eo pid,ppid,user,comm | grep -E 'nvidia-cuda|gpushare' | grep -v grep | tr -s ' ' | tr '\n' ';'; }

start() { # UID -> sets PIPE ID
    local out; out=$(gs daemon start --device 0 --uid "$1" 2>&1); echo "  daemon start uid $1: $(tail -1 <<<"$out" | cut -c1-160)"
    PIPE=$(sed -n 's/.*CUDA_MPS_PIPE_DIRECTORY=\(.*\)$/\1/p' <<<"$out" | tail -n1)
    ID=$(sed -n 's/.*daemon \([0-9a-f]\{32\}\) .*/\1/p' <<<"$out" | tail -n1)
}

echo "== driver $DRV, $(nvidia-smi --query-gpu=compute_mode,mig.mode.current --format=csv,noheader)"
if [ "${SCEN:-ABC}" != C ]; then
echo "== A. kill -9 the gpushare supervisor while a client of its daemon computes (uid 1000)"
start 1000; A_ID=$ID; A_PIPE=$PIPE
client a1 1000 "$A_PIPE" 12
wait_fk a1 90 && echo "  a1 first kernel at $(now)" || echo "  a1 no first kernel"
echo "  before: sup=$(field $A_ID supervisor_pid) daemon=$(field $A_ID pid) procs: $(procs)"
SUP=$(field $A_ID supervisor_pid); kill -9 "$SUP"; echo "  killed supervisor $SUP at $(now)"
sleep 2; echo "  2 s after: procs: $(procs)"; gs status 2>&1 | tail -3
wait_rc a1 90; report a1
echo "  next create (daemon start again), then a client:"
T=$(now); start 1000; echo "  start took $(python3 -c "print(round($(now)-$T,2))") s; same id: $([ "$ID" = "$A_ID" ] && echo yes || echo no)"
client a2 1000 "$PIPE" 2; wait_rc a2 120; report a2
echo "  procs: $(procs)"

echo "== B. kill -9 the control daemon while a client computes (uid 1000)"
client b1 1000 "$PIPE" 12
wait_fk b1 90 && echo "  b1 first kernel at $(now)" || echo "  b1 no first kernel"
D=$(field $ID pid); echo "  before: daemon=$D restarts=$(field $ID restarts) procs: $(procs)"
kill -9 "$D"; echo "  killed control daemon $D at $(now)"
for i in 1 2 3 4 5 6; do sleep 1; echo "  +${i}s: status=$(field $ID status) daemon=$(field $ID pid) restarts=$(field $ID restarts) health=$(field $ID health) procs: $(procs)"; done
client b2 1000 "$PIPE" 2
wait_rc b1 90; report b1
wait_rc b2 120; report b2

else start 1000; A_ID=$ID; A_PIPE=$PIPE; fi
echo "== C. kill -9 the MPS server while a client computes (uid 1000), uid 2000 on its own daemon alongside"
start 2000; C2_ID=$ID; C2_PIPE=$PIPE
client c1 1000 "$A_PIPE" 12; client c2 2000 "$C2_PIPE" 12
wait_fk c1 90; wait_fk c2 90
D=$(field $A_ID pid); SRV=$(pgrep -P "$D" | head -1); echo "  control daemon $D, its child (the server): $SRV $(tr "\0" " " </proc/$SRV/cmdline)"
echo "  server of uid 1000: $SRV; procs: $(procs)"
kill -9 "$SRV"; echo "  killed server $SRV at $(now)"
wait_rc c1 90; report c1
wait_rc c2 90; report c2
client c3 1000 "$A_PIPE" 2; wait_rc c3 120; report c3
echo "  status after:"; gs status 2>&1 | cut -c1-200

echo "== cleanup"
for d in $(gs status --json | python3 -c "import json,sys; [print(x['log_dir']) for x in json.load(sys.stdin)['daemons']]"); do echo "log dir $d:"; ls -la "$d"; findmnt -T "$d" | tail -1; done
for d in $(gs status --json | python3 -c "import json,sys; [print(x['log_dir']) for x in json.load(sys.stdin)['daemons']]"); do for f in "$d"/*.log; do echo "--- $f"; tail -60 "$f"; done; done > "$OUT/faults-mps-logs.txt" 2>&1
gs daemon stop --all --force 2>&1 | tail -2
for i in 1 2 3 4 5; do [ -z "$(procs)" ] && break; sleep 1; done
echo "  procs left after ${i}s: $(procs)"; pgrep -f workload.py && echo "python left" || echo "  no workload left"
grep "$W" /proc/mounts || echo "  no mount left"
nvidia-smi --query-gpu=compute_mode,mig.mode.current --format=csv,noheader
cp "$W/gs.log" "$OUT/faults-gs.log" 2>/dev/null
umount -R "$W/s" 2>/dev/null; rm -rf --one-file-system "$W"
