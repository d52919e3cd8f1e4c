#!/bin/bash
# The README's first command as a new user runs it: `cargo run --release -p stord` builds
# (without Ceph's libraries: the release binary must link neither librbd nor librados,
# which the rbd driver opens at run time) and serves the built-in default image over NBD,
# which qemu-img and qemu-io (installed by install-deps.sh) read and write; SIGTERM stops it
# with status 0.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -p stord --quiet
bin=target/release/stord
if ldd "$bin" | grep -E 'librbd|librados'; then
    echo "first-command: $bin links a Ceph library" >&2
    exit 1
fi
data=$(mktemp -d)
trap 'kill "$pid" 2>/dev/null || true; rm -rf "$data"' EXIT
STORD_DATA_DIR="$data" "$bin" >"$data/out" 2>"$data/err" &
pid=$!
uri="nbd+unix:///default?socket=$data/stord.sock"
for _ in $(seq 100); do
    [ -S "$data/stord.sock" ] && break
    sleep 0.1
done
grep -qF "$uri" "$data/out" || { echo "first-command: no banner naming $uri" >&2; cat "$data/out" "$data/err" >&2; exit 1; }
qemu-img info -f raw "$uri" | grep -q 'virtual size: 1 GiB'
qemu-io -f raw -c 'write -P 0x5a 1M 64k' "$uri" >/dev/null
qemu-io -f raw -c 'read -P 0x5a 1M 64k' "$uri" | grep -q 'read 65536/65536'
kill -TERM "$pid"
wait "$pid"
echo "first-command: built without Ceph libraries, served $uri, stopped cleanly"
