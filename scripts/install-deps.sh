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

# Python packages for the QMP tests (the qemu.qmp client library).
if ! python3 -c "import qemu.qmp" 2>/dev/null; then
    echo "install-deps: installing crates/stord/tests/qmp/requirements.txt"
    python3 -m pip install --quiet -r crates/stord/tests/qmp/requirements.txt \
        || python3 -m pip install --quiet --break-system-packages -r crates/stord/tests/qmp/requirements.txt
fi
