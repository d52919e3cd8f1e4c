#!/bin/bash
# The whole test suite: installs what the tests need (from .ci/apt-packages.txt), then
# runs every test twice, once with the io_uring reactor and once with the epoll fallback
# (STORD_AIO_REACTOR selects the reactor of every context created with `auto`).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
export CARGO_TERM_COLOR=never
for reactor in io_uring epoll; do
    echo "=== tests with STORD_AIO_REACTOR=$reactor ==="
    STORD_AIO_REACTOR=$reactor cargo test --workspace --all-targets
done
