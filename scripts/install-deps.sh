#!/bin/bash
# Installs what the tests and benchmarks need, from the project's own lists:
# Debian packages from .ci/apt-packages.txt and Python packages from
# crates/stord/tests/qmp/requirements.txt. Idempotent: does nothing when all are there.
set -euo pipefail
cd "$(dirname "$0")/.."

mapfile -t pkgs < <(sed -e 's/#.*//' -e '/^\s*$/d' .ci/apt-packages.txt)
missing=()
for p in "${pkgs[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$p")
    fi
done
if ((${#missing[@]})); then
    echo "install-deps: installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# The peer we compare with is qemu-storage-daemon 10.0 (qemu-utils) and the guest tests run
# QEMU 10.0 (qemu-system-x86), both from bookworm-backports: bookworm's 7.2 qsd aborts when
# an NBD client leaves an export on an IoThread, and mixing 7.2's qemu-system with 10.0's
# qemu-utils is impossible (both ship qemu-storage-daemon). Debian 13 has 10.0 already.
mapfile -t bpo < <(sed -e 's/#.*//' -e '/^\s*$/d' .ci/apt-backports.txt)
qsd_major=$(qemu-storage-daemon --version 2>/dev/null | sed -n 's/.*version \([0-9]*\)\..*/\1/p' | head -1)
bpo_missing=0
for p in "${bpo[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || bpo_missing=1
done
if [ "${qsd_major:-0}" -lt 10 ] || ! command -v qemu-system-x86_64 >/dev/null || [ "$bpo_missing" = 1 ]; then
    . /etc/os-release
    if [ "${VERSION_CODENAME:-}" = bookworm ]; then
        echo "install-deps: installing ${bpo[*]} from bookworm-backports"
        echo "deb http://deb.debian.org/debian bookworm-backports main" \
            > /etc/apt/sources.list.d/stord-bookworm-backports.list
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends -t bookworm-backports "${bpo[@]}"
    else
        apt-get install -y -qq --no-install-recommends "${bpo[@]}"
    fi
fi

# Python packages for the QMP tests (the qemu.qmp client library, and prometheus_client's
# OpenMetrics parser for the metrics listener).
if ! python3 -c "import qemu.qmp, prometheus_client" 2>/dev/null; then
    echo "install-deps: installing crates/stord/tests/qmp/requirements.txt"
    python3 -m pip install --quiet -r crates/stord/tests/qmp/requirements.txt \
        || python3 -m pip install --quiet --break-system-packages -r crates/stord/tests/qmp/requirements.txt
fi
