#!/bin/bash
# A throwaway single-node Ceph cluster (one monitor, one OSD, no mgr) on 127.0.0.1 for
# tests of the rbd backend. Everything lives under DIR; nothing is read from or written to
# /etc/ceph or /var/lib/ceph. Needs root and Debian's ceph-mon, ceph-osd and ceph-common
# (Ceph 16 "pacific" on bookworm).
#
#   ceph-cluster.sh start DIR      create and start a cluster, wait until an rbd image can be
#                                  created, print DIR/ceph.conf as the last line of stdout
#   ceph-cluster.sh stop DIR       stop the daemons by their recorded PIDs (DIR stays, with
#                                  the logs in DIR/log; remove it yourself)
#   ceph-cluster.sh osd-stop DIR   stop the OSD cleanly (SIGTERM)
#   ceph-cluster.sh osd-kill DIR   SIGKILL the OSD (simulates a crash)
#   ceph-cluster.sh osd-start DIR  start the OSD again on its existing data, wait for I/O
#   ceph-cluster.sh status DIR     `ceph -s` of the cluster
#
# Environment:
#   CEPH_MON_PORT     monitor port (default 36789; messenger v1 on 127.0.0.1)
#   CEPH_OBJECTSTORE  memstore (default: all data in RAM, fastest start; survives
#                     osd-stop/osd-start but not osd-kill, after which osd-start refuses)
#                     or bluestore (data in a sparse file DIR/osd/block, survives osd-kill;
#                     it opens the file with O_DIRECT, which tmpfs has only since Linux 6.6)
#   CEPH_STORE_BYTES  size of the memstore device or bluestore block file (default 2 GiB)
#   CEPH_START_TIMEOUT seconds to wait for the cluster to become usable (default 120)
#
# Clients need nothing but `-c DIR/ceph.conf` (rbd -c ..., qemu rbd:pool/img:conf=...,
# rados_conf_read_file): auth is off, so no keyring is needed. Without a conf file,
# rados_conf_set("mon_host", "v1:127.0.0.1:PORT") is enough (the monitor speaks v1 only,
# so "v2:..." does not work). There is no mgr: `ceph -s` shows no pools or PGs.
set -euo pipefail

usage() {
    echo "usage: $0 start|stop|osd-stop|osd-kill|osd-start|status DIR" >&2
    exit 2
}
[ $# -eq 2 ] || usage
cmd=$1
[ "$cmd" != start ] || mkdir -p "$2"
[ -d "$2" ] || { echo "ceph-cluster: no directory $2" >&2; exit 1; }
dir=$(cd "$2" && pwd)
conf=$dir/ceph.conf
port=${CEPH_MON_PORT:-36789}
store=${CEPH_OBJECTSTORE:-memstore}
store_bytes=${CEPH_STORE_BYTES:-$((2 << 30))}
timeout_s=${CEPH_START_TIMEOUT:-120}

log() { echo "ceph-cluster: $*" >&2; }
t0=$EPOCHREALTIME
elapsed() { awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'; }
# CEPH_CLUSTER_TRACE=1 shows how long each step of `start` takes.
step() { [ -z "${CEPH_CLUSTER_TRACE:-}" ] || log "$(elapsed)s $*"; }

# Every ceph CLI call goes through here: our conf only, and a bounded wait so that a dead
# monitor makes us fail instead of hang.
cephc() { timeout 30 ceph -c "$conf" --connect-timeout 20 "$@"; }
# A mon command whose output only matters when it fails. A monitor that has just formed
# its quorum may still refuse commands for a moment ("problem getting command descriptions
# from mon", seen once in CI): asked again, for up to 3 s, before it counts as failed.
mon_cmd() {
    local out try
    for try in $(seq 10); do
        out=$(cephc "$@" 2>&1) && return 0
        sleep 0.3
    done
    log "ceph $* failed: $out"
    diagnose
    return 1
}

# A zombie counts as dead: our daemons are reparented to PID 1, which in a container may
# not reap them.
alive() { [ -d "/proc/$1" ] && ! grep -q '^[^)]*) Z' "/proc/$1/stat" 2>/dev/null; }
pid_alive() { [ -f "$1" ] && alive "$(cat "$1")"; }

diagnose() {
    log "cluster did not become usable; status and log tails follow"
    cephc -s >&2 || true
    cephc osd tree >&2 || true
    for f in "$dir"/log/mon.a.log "$dir"/log/osd.0.log; do
        [ -f "$f" ] && { echo "--- tail $f" >&2; tail -n 40 "$f" >&2; }
    done
}

# Waits until librbd can create and remove an image in pool rbd (that needs the monitor,
# the OSD up and the pool's PGs active; without a mgr, `ceph pg stat` cannot tell us).
wait_usable() {
    local deadline=$((SECONDS + timeout_s))
    while :; do
        if timeout 15 rbd -c "$conf" create rbd/probe --size 16M 2>/dev/null; then
            timeout 15 rbd -c "$conf" rm rbd/probe >/dev/null 2>&1 ||
                { diagnose; return 1; }
            return 0
        fi
        # a leftover probe from an earlier, interrupted attempt
        timeout 15 rbd -c "$conf" rm rbd/probe >/dev/null 2>&1 || true
        if ((SECONDS >= deadline)); then
            diagnose
            return 1
        fi
        sleep 0.5
    done
}

wait_osd_up() {
    local deadline=$((SECONDS + timeout_s))
    until cephc osd dump 2>/dev/null | grep -q '^osd\.0 up'; do
        if ! pid_alive "$dir/run/osd.0.pid" || ((SECONDS >= deadline)); then
            diagnose
            return 1
        fi
        sleep 0.3
    done
}

start_osd() {
    # ceph-osd returns once the forked daemon has initialised (or with its error code);
    # the daemon writes its own pid file.
    ceph-osd -c "$conf" -i 0 || { diagnose; return 1; }
}

stop_pidfile() {
    local f=$1 pid i
    [ -f "$f" ] || return 0
    pid=$(cat "$f")
    # only signal what is still one of our daemons (the PID may have been reused)
    if grep -qx 'ceph-mon\|ceph-osd' "/proc/$pid/comm" 2>/dev/null &&
        grep -qF -- "$conf" "/proc/$pid/cmdline" 2>/dev/null &&
        kill "$pid" 2>/dev/null; then
        for ((i = 0; i < 100; i++)); do
            alive "$pid" || break
            sleep 0.1
        done
        if alive "$pid"; then
            log "pid $pid ($f) still alive after 10 s, SIGKILL"
            kill -9 "$pid" 2>/dev/null || true
            for ((i = 0; i < 50; i++)); do
                alive "$pid" || break
                sleep 0.1
            done
        fi
    fi
    rm -f "$f"
}

write_conf() {
    local fsid=$1
    cat >"$conf" <<EOF
# Generated by scripts/ceph-cluster.sh: a single-node test cluster, not for real data.
[global]
fsid = $fsid
mon host = v1:127.0.0.1:$port
public addr = 127.0.0.1
# v1 messenger only: one simple address for the monitor and the OSD.
ms bind msgr2 = false
# No authentication at all, so clients need no keyring.
auth cluster required = none
auth service required = none
auth client required = none
auth supported = none
mon warn on insecure global id reclaim allowed = false
# Commit monitor changes quickly (default: batch for 1 s); start-up is mostly mon commands.
paxos propose interval = 0.05
paxos min wait = 0.01
# Keep everything under $dir.
run dir = $dir/run
pid file = $dir/run/\$name.pid
admin socket = $dir/run/\$name.asok
log file = $dir/log/\$name.log
mon cluster log file = $dir/log/\$cluster.\$channel.log
mon data = $dir/mon
osd data = $dir/osd
keyring = $dir/keyring
crash dir = $dir/crash
# Root daemons stay root: they only switch user when given --setuser (Debian's systemd
# units pass "--setuser ceph"), which we never do; an empty match path on top.
setuser match path =
# One replica is all a one-OSD cluster can hold.
osd pool default size = 1
osd pool default min size = 1
mon allow pool size one = true
mon warn on pool no redundancy = false
osd pool default pg num = 8
osd pool default pgp num = 8
# There is no mgr to run the autoscaler; and let tests delete pools.
osd pool default pg autoscale mode = off
mon allow pool delete = true
# Place replicas across OSDs, not hosts (only one host anyway). The script puts osd.0 into
# the CRUSH map itself: the OSD's own CRUSH commands at start-up were seen to go out with
# an all-zero fsid, be refused by the monitor ("wrong fsid") and make the OSD exit.
osd crush chooseleaf type = 0
osd crush update on start = false
osd class update on start = false
# Test machines often have fuller disks than Ceph likes; the monitor shuts itself down
# below "crit" percent free.
mon data avail warn = 2
mon data avail crit = 1
# Small footprint: few threads, small caches.
ms async op threads = 1
osd op num shards = 1
osd op num threads per shard = 1
bluestore cache autotune = false
bluestore cache size = 67108864
rocksdb cache size = 16777216
mon osd full ratio = 0.97
mon osd backfillfull ratio = 0.96
mon osd nearfull ratio = 0.95
# No crash reports or journald.
log to stderr = false
err to stderr = false
log to journald = false
debug ms = 0

[osd]
osd objectstore = $store
memstore device bytes = $store_bytes
bluestore block create = true
bluestore block size = $store_bytes
bluestore block db create = false
bluestore block wal create = false
# Not a real disk: skip the fsync-heavy checks and sparse-file discards.
bluestore fsck on mount = false
bdev enable discard = false
# Pacific's OSD exits at once on SIGTERM without unmounting its store; memstore only
# saves its contents to DIR/osd on unmount, so osd-stop/osd-start would lose all data.
osd fast shutdown = false

[client]
# librbd users (qemu, our tests) log nowhere and open no admin socket by default.
log file =
admin socket =
EOF
}

case $cmd in
start)
    for b in ceph-mon ceph-osd ceph rbd monmaptool ceph-authtool; do
        command -v "$b" >/dev/null || { log "$b not found (apt-get install ceph-mon ceph-osd ceph-common)"; exit 1; }
    done
    if pid_alive "$dir/run/mon.a.pid" || pid_alive "$dir/run/osd.0.pid"; then
        log "a cluster is already running in $dir"
        exit 1
    fi
    if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
        log "port $port is in use (another cluster?); set CEPH_MON_PORT"
        exit 1
    fi
    rm -rf "$dir/mon" "$dir/osd" "$dir/run" "$dir/log" "$dir/crash" \
        "$dir/keyring" "$dir/monmap" "$conf"
    mkdir -p "$dir/mon" "$dir/osd" "$dir/run" "$dir/log" "$dir/crash"
    fsid=$(cat /proc/sys/kernel/random/uuid)
    write_conf "$fsid"

    # ceph-mon --mkfs insists on a keyring even with auth off.
    ceph-authtool --create-keyring "$dir/keyring" --gen-key -n mon. \
        --cap mon 'allow *' >/dev/null
    monmaptool --create --fsid "$fsid" --addv a "[v1:127.0.0.1:$port]" \
        "$dir/monmap" >/dev/null
    ceph-mon -c "$conf" -i a --mkfs --monmap "$dir/monmap" --keyring "$dir/keyring"
    step "mon mkfs"
    ceph-mon -c "$conf" -i a || { tail -n 20 "$dir/log/mon.a.log" >&2; exit 1; }
    step "mon started"

    # Register OSD 0 with the monitor, then format its store. A monitor just started can
    # refuse its first commands ("EPERM: problem getting command descriptions", seen on a
    # fresh machine): `osd new` with the same uuid is idempotent, so try again a while.
    osd_uuid=$(cat /proc/sys/kernel/random/uuid)
    deadline=$((SECONDS + timeout_s))
    until id=$(cephc osd new "$osd_uuid" 2>"$dir/log/osd-new.err"); do
        if ((SECONDS >= deadline)); then
            log "ceph osd new failed: $(cat "$dir/log/osd-new.err")"
            diagnose
            exit 1
        fi
        sleep 0.3
    done
    [ "$id" = 0 ] || { log "expected osd id 0, got '$id'"; diagnose; exit 1; }
    mon_cmd osd crush add osd.0 1.0 root=default host=localhost
    step "osd registered"
    ceph-osd -c "$conf" -i 0 --mkfs --osd-uuid "$osd_uuid" >"$dir/log/osd-mkfs.log" 2>&1 ||
        { cat "$dir/log/osd-mkfs.log" >&2; exit 1; }
    step "osd mkfs"
    start_osd
    step "osd started"
    wait_osd_up
    step "osd up"

    mon_cmd osd pool create rbd 8 8
    # With "mon allow pool size one" the pool is created with size 1 already; this makes
    # sure of it (pacific wants the flag for any change to size 1).
    mon_cmd osd pool set rbd size 1 --yes-i-really-mean-it
    # what `rbd pool init` does, minus its wait for the PGs (wait_usable does that)
    mon_cmd osd pool application enable rbd rbd
    step "pool created"
    wait_usable
    log "cluster usable after $(elapsed) s (objectstore $store, mon 127.0.0.1:$port)"
    echo "$conf"
    ;;
stop)
    stop_pidfile "$dir/run/osd.0.pid"
    stop_pidfile "$dir/run/mon.a.pid"
    ;;
osd-stop)
    # a clean stop: memstore writes its contents to DIR/osd on the way down
    stop_pidfile "$dir/run/osd.0.pid"
    ;;
osd-kill)
    [ -f "$dir/run/osd.0.pid" ] || { log "no OSD pid file in $dir/run"; exit 1; }
    pid=$(cat "$dir/run/osd.0.pid")
    kill -9 "$pid" 2>/dev/null || true
    while alive "$pid"; do sleep 0.1; done
    rm -f "$dir/run/osd.0.pid"
    touch "$dir/run/osd-killed"
    ;;
osd-start)
    if pid_alive "$dir/run/osd.0.pid"; then
        log "the OSD is already running"
        exit 1
    fi
    # memstore only saves itself on a clean stop; after a SIGKILL it comes back with the
    # state of its last clean stop, without the PGs created since, and I/O would hang.
    if [ -f "$dir/run/osd-killed" ] && grep -q '^osd objectstore = memstore' "$conf"; then
        log "memstore lost its data when the OSD was killed; use CEPH_OBJECTSTORE=bluestore"
        exit 1
    fi
    rm -f "$dir/run/osd-killed"
    start_osd
    wait_osd_up
    wait_usable
    ;;
status)
    cephc -s
    ;;
*)
    usage
    ;;
esac
