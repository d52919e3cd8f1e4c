#!/bin/bash
# The Debian package as a user meets it, on Debian 12 as root: build it with cargo-deb (a
# pinned version, installed from crates.io under target/tools) from the release build,
# let lintian judge it (no error may be found), install it with dpkg, read `man stord`,
# verify stord@.service, run an instance of it (under systemd when systemd is PID 1,
# otherwise its ExecStart line as systemd would run it: %i substituted, the environment
# file read, NOTIFY_SOCKET listened on), serve a qcow2 image through it to qemu-img and
# qemu-io over NBD, stop it, and remove and purge the package, leaving nothing behind.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
CARGO_DEB_VERSION=3.8.0
instance=package-test
unit=stord@$instance.service
conf=/etc/stord/$instance.conf
rundir=/run/stord/$instance

step() { echo "package-test: $*"; }
fail() { echo "package-test: FAILED: $*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || fail "run as root (dpkg -i, /etc/stord, the unit)"

# Tools: lintian, systemd-analyze, man and QEMU's clients come from .ci/apt-packages.txt
# (a no-op when all are there); cargo-deb at the pinned version from crates.io.
./scripts/install-deps.sh
tools=$repo/target/tools
if [ "$("$tools/bin/cargo-deb" --version 2>/dev/null)" != "cargo-deb $CARGO_DEB_VERSION" ]; then
    step "installing cargo-deb $CARGO_DEB_VERSION"
    cargo install --quiet --locked --force --version "$CARGO_DEB_VERSION" --root "$tools" cargo-deb
fi

# The package, from the release build scripts/first-command.sh made (rebuilt only if the
# sources changed). --strip: the release profile keeps line tables for backtraces.
cargo build --release -p stord --quiet
rm -rf target/debian
"$tools/bin/cargo-deb" -p stord --no-build --strip --quiet
deb=$(ls target/debian/stord_*.deb)
version=$(dpkg-deb -f "$deb" Version)
changelog=$(dpkg-deb --fsys-tarfile "$deb" | tar -xOf - ./usr/share/doc/stord/changelog.Debian.gz | gzip -dc | head -1)
case "$changelog" in
    "stord ($version) "*) ;;
    *) fail "crates/stord/debian/changelog's first entry is not $version: $changelog" ;;
esac
depends=$(dpkg-deb -f "$deb" Depends)
suggests=$(dpkg-deb -f "$deb" Suggests)
step "built $deb ($version, $depends; suggests $suggests)"
# Ceph's libraries are opened at run time by the rbd driver: never a dependency.
case "$depends" in *librbd*|*librados*) fail "Depends names Ceph's libraries: $depends" ;; esac
case "$suggests" in *librbd1*) ;; *) fail "Suggests lacks librbd1: $suggests" ;; esac
lint_status=0
lint=$(lintian --fail-on error "$deb" 2>&1) || lint_status=$?
grep -v '^running with root privileges' <<<"$lint" || true
[ "$lint_status" = 0 ] || fail "lintian found an error in $deb"
step "lintian: no error"

if dpkg-query -W -f='${Status}' stord 2>/dev/null | grep -q installed; then
    fail "a stord package is installed already; this test installs and purges its own"
fi
[ ! -e "$conf" ] || fail "$conf exists already"
made_etc=
[ -d /etc/stord ] || made_etc=1
work=$(mktemp -d /var/tmp/stord-package-test.XXXXXX)
cleanup() {
    if [ -d /run/systemd/system ]; then
        systemctl stop "$unit" 2>/dev/null || true
    fi
    [ -n "${pid:-}" ] && kill "$pid" 2>/dev/null || true
    [ -n "${listener:-}" ] && kill "$listener" 2>/dev/null || true
    dpkg -P stord >/dev/null 2>&1 || true
    rm -f "$conf"
    [ -z "$made_etc" ] || rmdir /etc/stord 2>/dev/null || true
    rm -rf "$rundir" "$work"
}
trap cleanup EXIT

dpkg -i "$deb" >/dev/null
[ -x /usr/bin/stord ] || fail "/usr/bin/stord is not installed"
shape=$(/usr/bin/stord --version | head -1)
[[ $shape =~ ^stord\ version\ ([0-9]+\.[0-9]+\.[0-9]+)\ \((stord [0-9.]+)\)$ ]] \
    || fail "stord --version: $shape"
interface=${BASH_REMATCH[1]}
package=${BASH_REMATCH[2]}
step "installed: $shape"

# man stord: from the installed page (dpkg configurations that drop /usr/share/man, as
# some container images have, leave it out: then the package's own copy is read), with
# no warning from groff.
page=/usr/share/man/man1/stord.1.gz
if [ ! -e "$page" ]; then
    step "dpkg left out $page (path-exclude); reading the package's copy"
    dpkg-deb -x "$deb" "$work/deb"
    page=$work/deb/usr/share/man/man1/stord.1.gz
fi
warnings=$(LC_ALL=C.UTF-8 MANWIDTH=80 man --warnings -E UTF-8 -l -Tutf8 -Z "$page" 2>&1 >/dev/null)
[ -z "$warnings" ] || fail "man stord: $warnings"
rendered=$(MANPAGER=cat MANWIDTH=80 man -l "$page")
for want in "stord - storage daemon" "QMP COMMANDS" "query-version" "--export type=vhost-user-blk" \
    "stord@.service"; do
    grep -qF -- "$want" <<<"$rendered" || fail "man stord lacks '$want'"
done
if [ "$page" = /usr/share/man/man1/stord.1.gz ]; then
    MANPAGER=cat man stord | grep -qF "QMP COMMANDS" || fail "man stord does not find the page"
fi
step "man stord renders ($(wc -l <<<"$rendered") lines)"

verify=$(systemd-analyze verify "/lib/systemd/system/$unit" 2>&1) || fail "systemd-analyze verify $unit: $verify"
[ -z "$verify" ] || fail "systemd-analyze verify $unit: $verify"
step "systemd-analyze verify $unit: clean"

# An instance: a qcow2 image with data QEMU wrote, exported over NBD, with a monitor.
img=$work/disk.qcow2
qemu-img create -q -f qcow2 "$img" 64M
qemu-io -f qcow2 -c 'write -P 0xa5 0 1M' "$img" >/dev/null
mkdir -p /etc/stord
cat >"$conf" <<EOF
# written by scripts/package-test.sh
STORD_ARGS="--blockdev driver=file,node-name=file0,filename=$img \\
  --blockdev driver=qcow2,node-name=disk,file=file0 \\
  --nbd-server addr.type=unix,addr.path=$rundir/nbd.sock \\
  --export type=nbd,id=exp0,node-name=disk,name=disk,writable=on \\
  --chardev socket,id=qmp,path=$rundir/qmp.sock,server=on,wait=off --monitor chardev=qmp"
EOF

unit_file=/lib/systemd/system/stord@.service
unit_value() { # KEY: its value in the unit, with %i substituted
    sed -n "s/^$1=//p" "$unit_file" | sed "s/%i/$instance/g"
}

# Runs the unit's ExecStart line as systemd would for the instance, where systemd is not
# PID 1 (a container): a clean environment with the EnvironmentFile's variables
# (`$STORD_ARGS` split into words), RuntimeDirectory made, working directory /, and a
# NOTIFY_SOCKET whose READY=1 ends the start (Type=notify).
start_without_systemd() {
    local envfile exec_start runtime notify
    envfile=$(unit_value EnvironmentFile)
    exec_start=$(unit_value ExecStart)
    runtime=/run/$(unit_value RuntimeDirectory)
    [ "$envfile" = "$conf" ] && [ "$runtime" = "$rundir" ] || fail "unit: $envfile, $runtime"
    mkdir -p "$runtime"
    notify=$work/notify.sock
    python3 - "$notify" >"$work/notify.out" <<'EOF' &
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.bind(sys.argv[1])
s.settimeout(60)
print(s.recv(4096).decode())
EOF
    listener=$!
    for _ in $(seq 100); do [ -S "$notify" ] && break; sleep 0.05; done
    (
        set -a -f
        # shellcheck disable=SC1090
        . "$envfile"
        set +a
        eval "set -- $exec_start"
        cd /
        exec env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin RUNTIME_DIRECTORY="$runtime" \
            NOTIFY_SOCKET="$notify" "$@" </dev/null >"$work/stdout" 2>"$work/stderr"
    ) &
    pid=$!
    wait "$listener" || fail "no word from stord on NOTIFY_SOCKET: $(cat "$work/stderr")"
    listener=
    grep -qx "READY=1" "$work/notify.out" || fail "NOTIFY_SOCKET got: $(cat "$work/notify.out")"
}

if [ -d /run/systemd/system ]; then
    mode="systemd (PID 1)"
    systemctl start "$unit" || { journalctl -u "$unit" --no-pager | tail -20; fail "systemctl start $unit"; }
    systemctl is-active --quiet "$unit" || fail "$unit is not active"
else
    mode="its ExecStart line, as systemd runs it (systemd is not PID 1 here)"
    start_without_systemd
fi
step "started $unit under $mode: ready"

# The greeting names the interface and stord, as --version does.
greeting=$(python3 - "$rundir/qmp.sock" <<'EOF'
import json, socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
v = json.loads(s.makefile().readline())["QMP"]["version"]
print("{major}.{minor}.{micro}".format(**v["qemu"]), v["package"])
EOF
)
[ "$greeting" = "$interface $package" ] || fail "QMP greeting: $greeting, --version: $interface $package"

uri="nbd+unix:///disk?socket=$rundir/nbd.sock"
qemu-img info -f raw "$uri" | grep -q 'virtual size: 64 MiB' || fail "qemu-img info $uri"
qemu-io -f raw -c 'read -P 0xa5 0 1M' "$uri" | grep -q 'read 1048576/1048576' \
    || fail "qemu-io read over NBD"
qemu-io -f raw -c 'write -P 0x5a 1M 1M' "$uri" >/dev/null
qemu-io -f raw -c 'read -P 0x5a 1M 1M' "$uri" | grep -q 'read 1048576/1048576' \
    || fail "qemu-io read back over NBD"
step "served $uri: qemu-img info, qemu-io read and write"

if [ -d /run/systemd/system ]; then
    systemctl stop "$unit"
    ! systemctl is-failed --quiet "$unit" || fail "$unit failed"
else
    kill -TERM "$pid"
    status=0
    wait "$pid" || status=$?
    pid=
    [ "$status" = 0 ] || fail "stord exited with status $status: $(cat "$work/stderr")"
    [ ! -s "$work/stderr" ] || fail "stord wrote to stderr: $(cat "$work/stderr")"
    [ ! -e "$rundir/nbd.sock" ] && [ ! -e "$rundir/qmp.sock" ] || fail "sockets left in $rundir"
    rmdir "$rundir" # RuntimeDirectory, which systemd removes at the stop
fi
[ ! -e "$rundir" ] || fail "$rundir left after the stop"
qemu-img check -q "$img" || fail "qemu-img check after the stop"
qemu-io -f qcow2 -c 'read -P 0x5a 1M 1M' "$img" | grep -q 'read 1048576/1048576' \
    || fail "the write through NBD is not in the image"
step "stopped cleanly; the image checks clean and holds what was written"

rm -f "$conf"
[ -z "$made_etc" ] || rmdir /etc/stord
files=$(dpkg-deb -c "$deb" | awk '$1 !~ /^d/ {print substr($6, 2)}')
dpkg -r stord >/dev/null
for f in $files; do
    [ ! -e "$f" ] || fail "dpkg -r left $f"
done
dpkg -P stord >/dev/null
! dpkg-query -W stord >/dev/null 2>&1 || fail "dpkg still knows stord after dpkg -P"
left=$(ls -d /var/lib/dpkg/info/stord.* /usr/share/doc/stord /usr/share/lintian/overrides/stord \
    "$rundir" 2>/dev/null || true)
[ -z "$left" ] || fail "left behind: $left"
step "dpkg -r and dpkg -P removed everything ($(wc -w <<<"$files") files)"
echo "package-test: passed"
