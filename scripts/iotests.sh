#!/bin/bash
# QEMU's own iotests for qemu-storage-daemon, with QSD_PROG pointing at stord (or at qsd, to
# compare): the tests that start the daemon themselves, and tests run over the FUSE
# protocol (`check -fuse`: every test image is served through the daemon's FUSE export).
# qemu, qemu-img, qemu-io and qemu-nbd stay the installed QEMU's.
#
#   scripts/iotests.sh [--daemon stord|qsd] [--set daemon|fuse-sample|fuse|tcg] [--format F]
#                      [--stord PATH] [TEST...]
#
# The tests come from Debian's source package of the installed QEMU (only
# tests/qemu-iotests, python/ and VERSION are used): its orig tarball, checked against the
# sha256 of the suite's signed Sources index, is unpacked once under target/iotests/.
# `check` takes every binary from QEMU_PROG, QEMU_IMG_PROG, QEMU_IO_PROG, QEMU_NBD_PROG and
# QSD_PROG, so no QEMU build tree is needed; Debian's qemu-system has no qtest accelerator,
# which the Python tests put on every VM, so QEMU_PROG is a wrapper that asks for TCG.
# Prints check's table and ends with "N passed, N failed"; exits non-zero if a test failed.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

daemon=stord
stord_bin=
set_name=daemon
format=
tests=()
while (($#)); do
    case $1 in
        --daemon) daemon=$2; shift 2 ;;
        --set) set_name=$2; shift 2 ;;
        --format) format=$2; shift 2 ;;
        --stord) stord_bin=$2; shift 2 ;;
        -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
        *) tests+=("$1"); shift ;;
    esac
done

# The tests that start the storage daemon themselves (QEMU 10.0's list) but 185, which
# fails with qsd too under TCG and whose outcome here depends on TCG's timing (with either
# daemon its VM now and then times out waiting for BLOCK_JOB_READY): it is run by hand
# (`scripts/iotests.sh --set tcg`), where it counts as passed when its output equals the
# expected one without JOB_STATUS_CHANGE lines (qemu's own job); stord's output was also
# found equal to qsd's byte for byte (docs/iotests.md).
DAEMON_TESTS=(108 281 graph-changes-while-io mirror-change-copy-mode qsd-jobs qsd-migrate)
TCG_JOB_EVENTS=(185)
# A sample of tests that run over FUSE, within CI's budget (the whole set takes over 20
# minutes per daemon here; it is run by hand, its table in docs/iotests.md).
FUSE_SAMPLE=(025 026 028 031 034 036 037 038 039 046 050 054 060 071 079 080 089 090 091 095 106)

# --- QEMU's iotests, from the source package of the installed QEMU -----------------------
upstream=$(qemu-img --version | sed -n 's/^qemu-img version \([0-9.]*\).*/\1/p')
debver=$(dpkg-query -W -f='${Version}' qemu-utils)
cache=$root/target/iotests
src=$cache/qemu-$upstream
if [ ! -e "$src/.unpacked" ]; then
    . /etc/os-release
    case $debver in
        *~bpo12*) suite=bookworm-backports ;;
        *~bpo13*) suite=trixie-backports ;;
        *) suite=$VERSION_CODENAME ;;
    esac
    apt=$cache/apt
    mkdir -p "$apt/lists/partial" "$apt/cache/archives/partial" "$cache/download"
    echo "deb-src http://deb.debian.org/debian $suite main" > "$apt/sources.list"
    aptopts=(-o "Dir::Etc::SourceList=$apt/sources.list" -o Dir::Etc::SourceParts=/dev/null
             -o "Dir::State::Lists=$apt/lists" -o "Dir::Cache=$apt/cache")
    echo "iotests: fetching QEMU $upstream's tests (Debian source package qemu $debver, $suite)"
    apt-get "${aptopts[@]}" update -qq
    orig=qemu_$upstream+ds.orig.tar.xz
    # The .dsc may be gone from the mirror while the orig tarball stays: only that is used.
    (cd "$cache/download" && apt-get "${aptopts[@]}" source --download-only -qq "qemu=$debver" \
        >/dev/null 2>&1 || true)
    [ -f "$cache/download/$orig" ] || { echo "iotests: could not download $orig" >&2; exit 1; }
    want=$(for f in "$apt"/lists/*_Sources*; do
               case $f in *.lz4) lz4cat "$f" ;; *.xz) xzcat "$f" ;; *.gz) zcat "$f" ;; *) cat "$f" ;; esac
           done | awk -v v="$debver" '/^Package: /{p=($2=="qemu")} p&&/^Version: /{ok=($2==v)}
                 p&&ok&&/^Checksums-Sha256:/{c=1;next} c&&/^ /{print} c&&!/^ /{c=0}' |
           awk -v f="$orig" '$3==f{print $1; exit}')
    have=$(sha256sum "$cache/download/$orig" | cut -d' ' -f1)
    if [ -z "$want" ] || [ "$want" != "$have" ]; then
        echo "iotests: $orig: sha256 $have, the Sources index says '${want}'" >&2
        exit 1
    fi
    rm -rf "$src"
    mkdir -p "$src"
    tar -xJf "$cache/download/$orig" -C "$src" --strip-components=1 \
        "qemu-$upstream/tests/qemu-iotests" "qemu-$upstream/python" "qemu-$upstream/VERSION"
    touch "$src/.unpacked"
fi
# Named as the real binary: the tests' filters replace its name in messages.
real_qemu=$(command -v qemu-system-x86_64)
mkdir -p "$cache/bin"
cat > "$cache/bin/qemu-system-x86_64" <<EOF
#!/bin/sh
# QEMU's iotests put -accel qtest on every VM; Debian's qemu-system has no qtest accelerator.
for a; do shift; [ "\$a" = qtest ] && a=tcg; set -- "\$@" "\$a"; done
exec $real_qemu "\$@"
EOF
chmod +x "$cache/bin/qemu-system-x86_64"

# --- the daemon under test --------------------------------------------------------------
case $daemon in
    stord)
        if [ -n "$stord_bin" ]; then
            qsd_prog=$(realpath "$stord_bin")
        else
            # The release build, as users run it (the README's first command builds it).
            cargo build --release -p stord --quiet
            qsd_prog=$root/target/release/stord
        fi ;;
    qsd) qsd_prog=$(command -v qemu-storage-daemon) ;;
    *) echo "iotests: --daemon stord|qsd" >&2; exit 2 ;;
esac
export QEMU_PROG=$cache/bin/qemu-system-x86_64 QEMU_IMG_PROG=$(command -v qemu-img)
export QEMU_IO_PROG=$(command -v qemu-io) QEMU_NBD_PROG=$(command -v qemu-nbd) QSD_PROG=$qsd_prog

# --- run ---------------------------------------------------------------------------------
out=$cache/results/$daemon-$set_name${format:+-$format}
rm -rf "$out"
mkdir -p "$out"
export TEST_DIR=$out/scratch SOCK_DIR
SOCK_DIR=$(mktemp -d /tmp/stord-iotests.XXXXXX)
trap 'rm -rf "$SOCK_DIR"' EXIT
cd "$src/tests/qemu-iotests"
status=0
run() { # format, extra check options, tests...
    local fmt=$1 opts=$2
    shift 2
    ./check -"$fmt" $opts "$@" 2>&1 | tee -a "$out/check.log" || status=1
}
# Runs test $1 (qcow2); it passes if its output equals the expected one once the
# JOB_STATUS_CHANGE lines (qemu's own job under TCG) are left out of both.
without_tcg_job_events() {
    local t=$1 got want=$PWD/$t.out
    TEST_DIR=$out/scratch ./check -qcow2 "$t" >/dev/null 2>&1 || true
    got=$out/scratch/qcow2-file-$t/$t.out.bad
    [ -f "$got" ] || got=$want  # it passed outright
    local filter='"event": "JOB_STATUS_CHANGE"'
    if diff <(grep -vF "$filter" "$want") <(grep -vF "$filter" "$got"); then
        echo "$t   pass   (as expected but for qemu's own job events under TCG)" \
            | tee -a "$out/check.log"
    else
        echo "$t   fail   (its output differs from the expected one)" | tee -a "$out/check.log"
        status=1
    fi
}

case $set_name in
    daemon)
        if ((${#tests[@]})); then run "${format:-qcow2}" "" "${tests[@]}"
        else
            run "${format:-qcow2}" "" "${DAEMON_TESTS[@]}"
            run raw "" mirror-change-copy-mode qsd-migrate
        fi ;;
    tcg)
        for t in "${TCG_JOB_EVENTS[@]}"; do without_tcg_job_events "$t"; done ;;
    fuse-sample|fuse)
        if ((${#tests[@]} == 0)); then
            if [ "$set_name" = fuse-sample ]; then tests=("${FUSE_SAMPLE[@]}")
            else mapfile -t tests < <(grep -lE '_supported_proto.*(fuse|generic)' \
                                          [0-9][0-9][0-9] tests/* 2>/dev/null |
                                      sed 's|^tests/||' | sort -u)
            fi
        fi
        for fmt in ${format:-qcow2 raw}; do run "$fmt" -fuse "${tests[@]}"; done ;;
    *) echo "iotests: --set daemon|fuse-sample|fuse|tcg" >&2; exit 2 ;;
esac
# check rewrites each test's line after a carriage return.
results=$(tr '\r' '\n' < "$out/check.log")
passed=$(grep -Ec '^[^ ]+ +pass ' <<<"$results" || true)
failed=$(grep -Ec '^[^ ]+ +fail ' <<<"$results" || true)
echo "iotests ($daemon, $set_name): $passed passed, $failed failed (logs in $out)"
exit $status
