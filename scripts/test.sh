#!/bin/bash
# The whole test suite: installs what the tests need (from .ci/apt-packages.txt), then
# runs every test twice, once with the io_uring reactor and once with the epoll fallback
# (STORD_AIO_REACTOR tells the stord binary what `auto` means, so every daemon the
# end-to-end tests start runs on both; stord-aio's own tests name both reactors
# themselves), then QEMU's own iotests against stord. Ends with one "N passed, N failed"
# line.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
export CARGO_TERM_COLOR=never
log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
for reactor in io_uring epoll; do
    echo "=== tests with STORD_AIO_REACTOR=$reactor ==="
    STORD_AIO_REACTOR=$reactor cargo test --workspace --all-targets --no-fail-fast 2>&1 | tee -a "$log" || status=1
done
# QEMU's own iotests for qemu-storage-daemon with QSD_PROG=stord: the tests that start the
# daemon themselves, and a sample of tests over the FUSE protocol (scripts/iotests.sh).
for set in daemon fuse-sample; do
    echo "=== QEMU's iotests, $set ==="
    ./scripts/iotests.sh --set "$set" 2>&1 | tee -a "$log" || status=1
done
count() { # what: "passed" or "failed"
    { grep -Eo "^test result: .* ([0-9]+) $1" "$log" | grep -Eo "[0-9]+ $1"
      grep -Eo "^iotests \(.*\): [0-9]+ passed, [0-9]+ failed" "$log" | grep -Eo "[0-9]+ $1"
    } | awk '{s+=$1} END {print s+0}'
}
passed=$(count passed)
failed=$(count failed)
echo
echo "$passed passed, $failed failed"
exit $status
