#!/bin/sh
# gpushare node installer: sets up one Kubernetes node for the gpushare RuntimeClass, and
# takes it off again. It runs in the privileged pod of deploy/node-installer.yaml, with
# the host's / mounted at $HOST_ROOT and the host's pids visible (hostPID).
#
# GPUSHARE_NODE_ACTION=install (default); every run of the pod, so an upgrade is a rollout:
#   1. copies gpushare and gpushare-runtime into the host's $INSTALL_DIR and the config
#      ($GPUSHARE_CONFIG_SOURCE: the ConfigMap's runtime.toml) to /etc/gpushare/runtime.toml,
#      each only when its content differs (SHA-256); a temp file renamed into place, so
#      running daemons keep the binary they started with;
#   2. checks that the host runs the copied gpushare (glibc 2.34 or later), then runs
#      `gpushare install containerd` on the host's containerd config (adds the runtime
#      $RUNTIME_NAME; every other line of the file is kept; a second run changes nothing);
#   3. restarts containerd only when its config changed: containerd has no config reload.
#      Running containers are not affected: they belong to their shims, not to containerd;
#   4. runs the node's agent (`gpushare agent`) and its GPU process watcher (`gpushare
#      watch`) in the host's mount namespace: the agent's MPS supervisors belong to no
#      engine; the watcher loads the host's NVML, and with hostPID sees the host's pids.
#      Both are children of this script, in the pod's cgroup: SIGTERM (the pod deleted)
#      stops both, and when either exits the other is stopped and the pod exits with its
#      status, so the kubelet restarts it (`--once`: exits instead; AGENT=none and
#      WATCH=none: only waits).
#   Before it first changes a host file, the installer keeps the file as it was (or that
#   there was none) under /etc/gpushare/node-installer, with the SHA-256 of what it wrote.
#
# GPUSHARE_NODE_ACTION=uninstall: puts back what install changed, in this order:
#   1. containerd's config as it was before the first install, byte for byte, and restarts
#      containerd; when the file changed since the installer wrote it and still registers
#      $RUNTIME_NAME, only that runtime's tables are taken out (`gpushare uninstall
#      containerd`) and the rest is kept: restoring it would undo someone else's edit;
#   2. `gpushare daemon stop --all` in the host's mount namespace, before the binary is
#      gone: idle daemons stop; while a container still uses one, the run fails (exit 1,
#      the kubelet retries) and the binaries stay, which that container's shim needs;
#   3. the binaries and /etc/gpushare/runtime.toml as they were (removed where the node had
#      none; a file changed since it was installed is kept), then the installer's records
#      and the directories it created.
#
# Environment (default):
#   GPUSHARE_NODE_ACTION    install or uninstall (install)
#   HOST_ROOT               where the host's / is seen (/host)
#   INSTALL_DIR             binaries, as the host sees the path (/usr/local/bin)
#   SOURCE_DIR              this image's gpushare, gpushare-runtime, runtime.toml (/opt/gpushare)
#   GPUSHARE_CONFIG_SOURCE  the runtime.toml to install, as the pod sees it
#                           (/etc/gpushare-config/runtime.toml where the ConfigMap is
#                           mounted, else $SOURCE_DIR/runtime.toml)
#   CONTAINERD_CONFIG       containerd's config, as the host sees the path
#                           (/etc/containerd/config.toml)
#   RUNTIME_NAME            the containerd runtime, the RuntimeClass's handler (gpushare)
#   RESTART_MODE            auto (default): systemd when the host's pid 1 is systemd, else signal
#                           systemd: `systemctl restart containerd` in the host's mount namespace
#                           signal:  SIGTERM to containerd (CONTAINERD_PID, else the one process
#                                    named containerd); its service manager (systemd's
#                                    Restart=always, an init script) starts it again
#                           none:    only print that containerd must be restarted
#   CONTAINERD_PID          containerd's pid, for RESTART_MODE=signal
#   HOST_PID                a process in the host's mount namespace, which nsenter enters
#                           to run systemctl, `gpushare daemon stop` and the agent (1)
#   AGENT                   run (default): install's step 4 runs `gpushare agent`; none: a
#                           host service runs it (docs/install.md)
#   WATCH                   run (default): install's step 4 runs `gpushare watch`; none: a
#                           host service runs it (the Debian package's
#                           gpushare-watch.service; docs/install.md)
#   READY_FILE              written when the action is done; the pod's readiness probe
#                           (/tmp/gpushare-node-installer.ready)
set -eu

ACTION=${GPUSHARE_NODE_ACTION:-install}
HOST_ROOT=${HOST_ROOT:-/host}
INSTALL_DIR=${INSTALL_DIR:-/usr/local/bin}
SOURCE_DIR=${SOURCE_DIR:-/opt/gpushare}
CONTAINERD_CONFIG=${CONTAINERD_CONFIG:-/etc/containerd/config.toml}
RUNTIME_NAME=${RUNTIME_NAME:-gpushare}
RESTART_MODE=${RESTART_MODE:-auto}
HOST_PID=${HOST_PID:-1}
READY_FILE=${READY_FILE:-/tmp/gpushare-node-installer.ready}
if [ -n "${GPUSHARE_CONFIG_SOURCE:-}" ]; then
    config_source=$GPUSHARE_CONFIG_SOURCE
elif [ -e /etc/gpushare-config/runtime.toml ]; then
    config_source=/etc/gpushare-config/runtime.toml
else
    config_source=$SOURCE_DIR/runtime.toml
fi

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

case $ACTION in
install | uninstall) ;;
*) die "GPUSHARE_NODE_ACTION=$ACTION is invalid: allowed are install, uninstall" ;;
esac
case $RESTART_MODE in
auto | systemd | signal | none) ;;
*) die "RESTART_MODE=$RESTART_MODE is invalid: allowed are auto, systemd, signal, none" ;;
esac
AGENT=${AGENT:-run}
WATCH=${WATCH:-run}
for v in "AGENT=$AGENT" "WATCH=$WATCH"; do
    case ${v#*=} in
    run | none) ;;
    *) die "$v is invalid: allowed are run, none" ;;
    esac
done
for p in "$INSTALL_DIR" "$CONTAINERD_CONFIG"; do
    case $p in
    /*) ;;
    *) die "$p must be an absolute path (as the host sees it): INSTALL_DIR and CONTAINERD_CONFIG" ;;
    esac
done
[ -d "$HOST_ROOT" ] || die "HOST_ROOT=$HOST_ROOT is not a directory: mount the host's / there"
check_host_glibc

# What the installer changed, on the host: for each file it manages (KEY below), KEY.orig
# (the file as it was) or KEY.absent (there was none), and KEY.sha256 (what it wrote);
# `dirs`: the directories it created. The records go before the change they describe.
STATE=/etc/gpushare/node-installer
state=$HOST_ROOT$STATE
config=$HOST_ROOT$CONTAINERD_CONFIG
pending=$state/containerd-restart-pending

sha() { # the SHA-256 of a file, empty when there is none
    if [ -f "$1" ]; then sha256sum <"$1" | cut -d' ' -f1; fi
}
put() { # put FILE TEXT: FILE holds TEXT, written atomically
    printf '%s\n' "$2" >"$1.new"
    mv -f "$1.new" "$1"
}
missing() { # the components of HOSTPATH that do not exist, deepest first
    d=$1
    while [ ! -e "$HOST_ROOT$d" ] && [ "$d" != / ]; do
        echo "$d"
        d=$(dirname "$d")
    done
}
ensure_state() { # the records' directory, itself removed by uninstall
    [ ! -d "$state" ] || return 0
    made=$(missing "$STATE")
    mkdir -p "$state"
    for d in $made; do
        if [ "$d" != "$STATE" ]; then echo "$d" >>"$state/dirs"; fi
    done
}
make_dir() { # make_dir HOSTPATH: created where missing, each created component recorded
    ensure_state
    made=$(missing "$1")
    mkdir -p "$HOST_ROOT$1"
    for d in $made; do echo "$d" >>"$state/dirs"; done
}
remember() { # remember KEY HOSTPATH: keep the file as it was, once
    [ ! -e "$state/$1.orig" ] && [ ! -e "$state/$1.absent" ] || return 0
    if [ -e "$HOST_ROOT$2" ]; then
        cp -p "$HOST_ROOT$2" "$state/$1.orig.new"
        mv -f "$state/$1.orig.new" "$state/$1.orig"
    else
        : >"$state/$1.absent"
    fi
}
install_file() { # install_file KEY SOURCE HOSTPATH MODE
    want=$(sha "$2")
    if [ "$want" = "$(sha "$HOST_ROOT$3")" ]; then
        say "$3 is up to date"
        # Recorded only where the installer wrote it once (else it is not the installer's).
        if [ -e "$state/$1.sha256" ]; then put "$state/$1.sha256" "$want"; fi
        return 0
    fi
    make_dir "$(dirname "$3")"
    remember "$1" "$3"
    tmp="$HOST_ROOT$3.gpushare-new.$$"
    cp "$2" "$tmp"
    chmod "$4" "$tmp"
    mv -f "$tmp" "$HOST_ROOT$3"
    put "$state/$1.sha256" "$want"
    say "installed $3"
}
restore_file() { # restore_file KEY HOSTPATH: back as it was, where it is still the installer's
    [ -e "$state/$1.sha256" ] || return 0
    if [ "$(sha "$HOST_ROOT$2")" != "$(cat "$state/$1.sha256")" ]; then
        say "$2 changed since it was installed: kept as it is"
    elif [ -e "$state/$1.orig" ]; then
        cp -p "$state/$1.orig" "$HOST_ROOT$2.gpushare-new.$$"
        mv -f "$HOST_ROOT$2.gpushare-new.$$" "$HOST_ROOT$2"
        say "restored $2 as it was before the install"
    else
        rm -f "$HOST_ROOT$2"
        say "removed $2"
    fi
    rm -f "$state/$1.sha256" "$state/$1.orig" "$state/$1.absent"
}
on_host() { # a command in the host's mount namespace
    nsenter --target "$HOST_PID" --mount -- "$@"
}

alive() { # a pid that has not exited (a zombie has)
    [ -r "/proc/$1/stat" ] || return 1
    st=$(sed 's/^.*) //' "/proc/$1/stat" | cut -d' ' -f1)
    [ "$st" != Z ] && [ "$st" != X ]
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
# A changed config is marked ($pending) until containerd has been restarted, so that a pod
# killed in between restarts it on its next run.
restart_containerd() {
    if [ ! -e "$pending" ]; then
        say "$CONTAINERD_CONFIG is unchanged: containerd is not restarted"
        return 0
    fi
    mode=$RESTART_MODE
    if [ "$mode" = auto ]; then
        if [ "$(cat "/proc/$HOST_PID/comm" 2>/dev/null)" = systemd ]; then mode=systemd; else mode=signal; fi
    fi
    case $mode in
    systemd)
        say "restarting containerd: systemctl restart containerd (in the host's mount namespace)"
        on_host systemctl restart containerd ||
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
        say "restart containerd on this node to use the change (e.g. systemctl restart containerd)"
        ;;
    esac
    rm -f "$pending"
}

do_install() {
    for f in gpushare gpushare-runtime; do
        [ -x "$SOURCE_DIR/$f" ] || die "$SOURCE_DIR/$f is missing"
    done
    [ -f "$config_source" ] || die "GPUSHARE_CONFIG_SOURCE=$config_source is not a file"
    # The config first: the binaries must never run on a config they do not know.
    install_file runtime.toml "$config_source" /etc/gpushare/runtime.toml 644
    for f in gpushare gpushare-runtime; do
        install_file "$f" "$SOURCE_DIR/$f" "$INSTALL_DIR/$f" 755
    done

    # The host must run what containerd and runc will run: gpushare links the host's C
    # library (glibc 2.34 or later), which this image's does not prove.
    if ! out=$(on_host "$INSTALL_DIR/gpushare" --version 2>&1); then
        printf '%s\n' "$out" >&2
        die "$INSTALL_DIR/gpushare does not run on this node (it needs glibc 2.34 or later): the runtime is not registered with containerd"
    fi

    # The runtime path is the host's; the installer's warning that it does not exist
    # refers to this container's view and is dropped.
    make_dir "$(dirname "$CONTAINERD_CONFIG")"
    # Changed since the last install by someone else (another runtime's installer, an
    # admin): the file as it was before gpushare no longer describes the node.
    if [ -e "$state/containerd.toml.sha256" ] &&
        [ "$(sha "$config")" != "$(cat "$state/containerd.toml.sha256")" ]; then
        say "$CONTAINERD_CONFIG changed since the last install: the uninstall will not restore it, it will take only the $RUNTIME_NAME runtime out of it"
        rm -f "$state/containerd.toml.orig" "$state/containerd.toml.absent" \
            "$state/containerd.toml.sha256"
        : >"$state/containerd.toml.no-restore"
    fi
    [ -e "$state/containerd.toml.no-restore" ] || remember containerd.toml "$CONTAINERD_CONFIG"
    before=$(sha "$config")
    had_undo=; [ ! -e "$config.gpushare-undo" ] || had_undo=1
    if ! out=$("$SOURCE_DIR/gpushare" install containerd --config "$config" \
        --runtime-path "$INSTALL_DIR/gpushare-runtime" --name "$RUNTIME_NAME" 2>&1); then
        printf '%s\n' "$out" >&2
        die "gpushare install containerd failed on $CONTAINERD_CONFIG"
    fi
    # This installer's own records above put the file back; gpushare's record of it
    # beside the config would be left on the node.
    [ -n "$had_undo" ] || rm -f "$config.gpushare-undo"
    printf '%s\n' "$out" | grep -v 'does not exist (yet)' || true
    after=$(sha "$config")
    [ -n "$after" ] || die "gpushare install containerd wrote no $CONTAINERD_CONFIG"
    [ -e "$state/containerd.toml.no-restore" ] || put "$state/containerd.toml.sha256" "$after"
    if [ "$before" != "$after" ]; then : >"$pending"; fi
    restart_containerd
    say "done: RuntimeClass handler $RUNTIME_NAME, runtime $INSTALL_DIR/gpushare-runtime"
}

registered() { # containerd's config names the runtime
    grep -Eq "runtimes\.\"?$RUNTIME_NAME\"?\]" "$config" 2>/dev/null
}
refuse_restore() {
    die "$CONTAINERD_CONFIG changed since the installer registered $RUNTIME_NAME, so it is not put back as it was (that would undo the other change): delete the tables [plugins.\"…\".containerd.runtimes.$RUNTIME_NAME] and [….options] from it yourself, restart containerd, and run the uninstall again"
}
# The config changed since the install (another runtime's installer, an admin) and still
# registers the runtime: take out only the runtime's tables (this image's gpushare, on the
# file as the host root shows it, as the install edits it) and keep the rest; the file is
# then the node's own.
remove_runtime_only() {
    if ! out=$("$SOURCE_DIR/gpushare" uninstall containerd --config "$config" --name "$RUNTIME_NAME" 2>&1); then
        printf '%s\n' "$out" >&2
        refuse_restore
    fi
    registered && refuse_restore
    say "$CONTAINERD_CONFIG changed since the install: only the $RUNTIME_NAME runtime was taken out of it, the rest is kept"
    : >"$pending"
    rm -f "$state/containerd.toml.sha256" "$state/containerd.toml.orig" "$state/containerd.toml.absent"
}
do_uninstall() {
    if [ ! -d "$state" ]; then
        say "no $STATE on this node: nothing to undo"
        return 0
    fi
    # 1. containerd first: no new container reaches gpushare after its restart.
    if [ -e "$state/containerd.toml.sha256" ]; then
        if [ "$(sha "$config")" != "$(cat "$state/containerd.toml.sha256")" ] && registered; then
            remove_runtime_only
        else
            before=$(sha "$config")
            restore_file containerd.toml "$CONTAINERD_CONFIG"
            if [ "$before" != "$(sha "$config")" ]; then : >"$pending"; fi
        fi
    fi
    if [ -e "$state/containerd.toml.no-restore" ]; then
        if registered; then remove_runtime_only; fi
        rm -f "$state/containerd.toml.no-restore"
    fi
    restart_containerd
    # 2. Idle daemons, while their binary is still there.
    if [ -x "$HOST_ROOT$INSTALL_DIR/gpushare" ] && [ -e "$state/gpushare.sha256" ]; then
        if ! out=$(on_host "$INSTALL_DIR/gpushare" daemon stop --all 2>&1); then
            printf '%s\n' "$out" >&2
            case $out in
            *"is used by"*) die "MPS daemons are still in use: $INSTALL_DIR/gpushare and gpushare-runtime stay until their containers are gone (delete those pods; this pod retries)" ;;
            esac
            die "gpushare daemon stop --all failed in the host's mount namespace (pid $HOST_PID): nothing more is removed"
        fi
        if [ -n "$out" ]; then printf '%s\n' "$out"; fi
    fi
    # 3. The files, then the records and the directories the installer made.
    restore_file gpushare-runtime "$INSTALL_DIR/gpushare-runtime"
    restore_file gpushare "$INSTALL_DIR/gpushare"
    restore_file runtime.toml /etc/gpushare/runtime.toml
    dirs=
    if [ -e "$state/dirs" ]; then dirs=$(sort -ru "$state/dirs"); fi
    rm -f "$state/dirs" "$pending"
    rmdir "$state" 2>/dev/null || say "$STATE keeps files the installer did not write: kept"
    for d in $dirs; do
        rmdir "$HOST_ROOT$d" 2>/dev/null || say "$d is not empty: kept"
    done
    say "done: gpushare removed from this node"
}

"do_$ACTION"

if [ -n "$once" ]; then
    exit 0
fi
: >"$READY_FILE"
# install: the agent and the watcher in the host's mount namespace (where runc runs the
# hooks, and the host's NVML), until the pod is deleted. They are this shell's children,
# not exec'd: the runtime sends a pod's SIGTERM to the container's first process only,
# this shell, which passes it on and waits, so neither outlives the pod. The supervisors
# the agent started run on. nsenter with --mount only execs, so each pid is gpushare's.
if [ "$ACTION" != install ] || { [ "$AGENT" = none ] && [ "$WATCH" = none ]; }; then
    trap 'exit 0' TERM INT
    sleep 2147483647 &
    wait
    exit 0
fi
pids=
stop() {
    # shellcheck disable=SC2086
    if [ -n "$pids" ]; then kill -TERM $pids 2>/dev/null || true; fi
    wait
}
trap 'stop; exit 0' TERM INT
for what in agent watch; do
    if [ "$what" = agent ]; then want=$AGENT; else want=$WATCH; fi
    [ "$want" = run ] || continue
    say "running the $what: $INSTALL_DIR/gpushare $what"
    nsenter --target "$HOST_PID" --mount -- "$INSTALL_DIR/gpushare" "$what" &
    pids="$pids $!"
done
# Until one of them exits (POSIX sh has no `wait -n`): the other is stopped, and the
# pod's exit and the kubelet's restart show it.
while :; do
    for pid in $pids; do
        alive "$pid" && continue
        status=0
        wait "$pid" || status=$?
        say "gpushare (pid $pid) exited with status $status: stopping the rest"
        # shellcheck disable=SC2086
        pids=$(printf '%s\n' $pids | grep -vx "$pid" | tr '\n' ' ')
        stop
        exit "$status"
    done
    sleep 1 &
    wait $! || true
done
