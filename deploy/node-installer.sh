#!/bin/sh
# gpushare node installer: sets up one Kubernetes node for the gpushare RuntimeClass, the
# way NVIDIA's toolkit container sets up its runtime. It runs in the privileged pod of
# deploy/node-installer.yaml, with the host's directories mounted under
# $HOST_ROOT, and
#   1. copies gpushare and gpushare-runtime into the host's $INSTALL_DIR (only when they
#      changed; a temp file renamed into place, so running daemons keep their binary);
#   2. installs the default /etc/gpushare/runtime.toml when the host has none (an existing
#      one is never touched);
#   3. runs `gpushare install containerd` on the host's containerd config (adds the
#      runtime `gpushare`; every other line of the file is kept; a second run changes
#      nothing; a node on containerd's built-in defaults keeps its default runtime);
#   4. restarts containerd when its config changed — containerd has no config reload.
#      Running containers are not affected: they belong to their shims, not to containerd;
#   5. then runs the node's agent (`gpushare agent`) in the host's mount namespace, so that
#      MPS supervisors belong to no engine (`--once`: exits instead; AGENT=none: only waits).
#
# Environment (default):
#   HOST_ROOT          where the host's / is seen (/host)
#   INSTALL_DIR        binaries, as the host sees the path (/usr/local/bin)
#   SOURCE_DIR         this image's gpushare, gpushare-runtime and runtime.toml (/opt/gpushare)
#   CONTAINERD_CONFIG  containerd's config, as the host sees the path (/etc/containerd/config.toml)
#   RUNTIME_NAME       the containerd runtime, the RuntimeClass's handler (gpushare)
#   RESTART_MODE       auto (default): systemd when the host's pid 1 is systemd, else signal
#                      systemd: `systemctl restart containerd` in the host's mount namespace
#                               (needs hostPID)
#                      signal:  SIGTERM to containerd (CONTAINERD_PID, else the one process
#                               named containerd; needs hostPID); its service manager
#                               (systemd's Restart=always, an init script) starts it again
#                      none:    only print that containerd must be restarted
#   CONTAINERD_PID     containerd's pid, for RESTART_MODE=signal
#   AGENT              run (default): step 5 runs `gpushare agent` through `nsenter -t 1 -m`
#                      (needs hostPID); none: a host service runs it (docs/install.md)
set -eu

HOST_ROOT=${HOST_ROOT:-/host}
INSTALL_DIR=${INSTALL_DIR:-/usr/local/bin}
SOURCE_DIR=${SOURCE_DIR:-/opt/gpushare}
CONTAINERD_CONFIG=${CONTAINERD_CONFIG:-/etc/containerd/config.toml}
RUNTIME_NAME=${RUNTIME_NAME:-gpushare}
RESTART_MODE=${RESTART_MODE:-auto}

once=
for arg in "$@"; do
    case $arg in
    --once) once=1 ;;
    *) echo "gpushare-node-installer: unknown argument $arg (allowed: --once)" >&2; exit 2 ;;
    esac
done

say() { echo "gpushare-node-installer: $*"; }
die() { echo "gpushare-node-installer: $*" >&2; exit 1; }

# The host runs gpushare's binaries, which are dynamic and need glibc 2.34 or later there:
# an older host is refused before anything is changed. A host root where
# `getconf GNU_LIBC_VERSION` cannot run (no shell, no getconf) cannot tell, and goes on.
check_host_glibc() {
    v=$(chroot "$HOST_ROOT" getconf GNU_LIBC_VERSION 2>/dev/null) || return 0
    case $v in
    "glibc "[0-9]*.[0-9]*) v=${v#glibc } ;;
    *) return 0 ;;
    esac
    major=${v%%.*} minor=${v#*.}
    minor=${minor%%[!0-9]*}
    case $major in *[!0-9]* | "") return 0 ;; esac
    if [ "$major" -lt 2 ] || { [ "$major" -eq 2 ] && [ "${minor:-0}" -lt 34 ]; }; then
        die "the host's glibc is $v; gpushare needs 2.34 or later (Debian 12, Ubuntu 22.04, RHEL 9 or newer): nothing was changed"
    fi
}

case $RESTART_MODE in
auto | systemd | signal | none) ;;
*) die "RESTART_MODE=$RESTART_MODE is invalid: allowed are auto, systemd, signal, none" ;;
esac
case $INSTALL_DIR$CONTAINERD_CONFIG in
/*) ;;
*) die "INSTALL_DIR and CONTAINERD_CONFIG must be absolute paths (as the host sees them)" ;;
esac
[ -d "$HOST_ROOT" ] || die "HOST_ROOT=$HOST_ROOT is not a directory: mount the host there"
for f in gpushare gpushare-runtime; do
    [ -x "$SOURCE_DIR/$f" ] || die "$SOURCE_DIR/$f is missing"
done
check_host_glibc

config="$HOST_ROOT$CONTAINERD_CONFIG"
# 1. Binaries: a temp file in the target directory, renamed over the old one.
copy() { # copy SRC DST MODE: only when DST differs
    if cmp -s "$1" "$2"; then
        return 1
    fi
    tmp="$2.gpushare-new.$$"
    cp "$1" "$tmp"
    chmod "$3" "$tmp"
    mv -f "$tmp" "$2"
}
mkdir -p "$HOST_ROOT$INSTALL_DIR"
for f in gpushare gpushare-runtime; do
    if copy "$SOURCE_DIR/$f" "$HOST_ROOT$INSTALL_DIR/$f" 755; then
        say "installed $INSTALL_DIR/$f"
    else
        say "$INSTALL_DIR/$f is up to date"
    fi
done

# 2. The default config, only where the host has none.
config_source=${GPUSHARE_CONFIG_SOURCE:-$SOURCE_DIR/runtime.toml}
if [ -e "$HOST_ROOT/etc/gpushare/runtime.toml" ]; then
    say "/etc/gpushare/runtime.toml exists: kept as it is"
elif [ -f "$config_source" ]; then
    mkdir -p "$HOST_ROOT/etc/gpushare"
    copy "$config_source" "$HOST_ROOT/etc/gpushare/runtime.toml" 644 || true
    say "installed the default /etc/gpushare/runtime.toml"
fi

# 3. The containerd runtime. The runtime path is the host's; the installer's warning that
# it does not exist refers to this container's view and can be ignored.
before=$(cksum "$config" 2>/dev/null || echo none)
set -- install containerd --config "$config" --runtime-path "$INSTALL_DIR/gpushare-runtime" \
    --name "$RUNTIME_NAME"
if ! out=$("$SOURCE_DIR/gpushare" "$@" 2>&1); then
    printf '%s\n' "$out" >&2
    die "gpushare install containerd failed on $CONTAINERD_CONFIG"
fi
printf '%s\n' "$out" | grep -v 'does not exist (yet)' || true
after=$(cksum "$config" 2>/dev/null || echo none)
[ "$after" != none ] || die "gpushare install containerd wrote no $CONTAINERD_CONFIG"
# A changed config is marked until containerd has been restarted, so that a pod killed in
# between restarts it on its next run.
pending="$HOST_ROOT/etc/gpushare/.containerd-restart-pending"
if [ "$before" != "$after" ]; then
    mkdir -p "$HOST_ROOT/etc/gpushare"
    : >"$pending"
fi

# 4. Restart containerd, only when its config changed.
alive() { # a pid that has not exited (a zombie has)
    [ -r "/proc/$1/stat" ] || return 1
    state=$(sed 's/^.*) //' "/proc/$1/stat" | cut -d' ' -f1)
    [ "$state" != Z ] && [ "$state" != X ]
}
find_containerd() {
    if [ -n "${CONTAINERD_PID:-}" ]; then
        echo "$CONTAINERD_PID"
        return
    fi
    found=
    for d in /proc/[0-9]*; do
        if [ "$(cat "$d/comm" 2>/dev/null)" = containerd ]; then
            found="$found ${d#/proc/}"
        fi
    done
    # shellcheck disable=SC2086
    set -- $found
    [ $# -eq 1 ] || die "found $# processes named containerd (${found# }): set CONTAINERD_PID (the pod needs hostPID: true)"
    echo "$1"
}
if [ ! -e "$pending" ]; then
    say "$CONTAINERD_CONFIG already registers $RUNTIME_NAME: containerd is not restarted"
else
    mode=$RESTART_MODE
    if [ "$mode" = auto ]; then
        if [ "$(cat /proc/1/comm 2>/dev/null)" = systemd ]; then mode=systemd; else mode=signal; fi
    fi
    case $mode in
    systemd)
        say "restarting containerd: systemctl restart containerd (in the host's mount namespace)"
        nsenter --target 1 --mount -- systemctl restart containerd ||
            die "systemctl restart containerd failed: restart it on the node yourself"
        ;;
    signal)
        pid=$(find_containerd)
        alive "$pid" || die "CONTAINERD_PID=$pid is not a running process"
        say "restarting containerd: SIGTERM to pid $pid; its service manager starts it again"
        kill -TERM "$pid"
        waited=0
        while alive "$pid"; do
            [ $waited -lt 300 ] || die "containerd (pid $pid) did not exit within 30 s of SIGTERM"
            sleep 0.1
            waited=$((waited + 1))
        done
        say "containerd (pid $pid) has exited"
        ;;
    none)
        say "restart containerd on this node to use the runtime (e.g. systemctl restart containerd)"
        ;;
    esac
    rm -f "$pending"
fi
say "done: RuntimeClass handler $RUNTIME_NAME, runtime $INSTALL_DIR/gpushare-runtime"

# 5. The agent in the host's mount namespace (where runc runs the hooks), until the pod is
# deleted: SIGTERM stops it; the supervisors it started run on.
if [ -z "$once" ] && [ "${AGENT:-run}" = run ]; then
    say "running the agent: $INSTALL_DIR/gpushare agent"
    exec nsenter --target 1 --mount -- "$INSTALL_DIR/gpushare" agent
fi
if [ -z "$once" ]; then
    trap 'exit 0' TERM INT
    sleep 2147483647 &
    wait
fi
