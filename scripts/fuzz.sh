#!/bin/bash
# Builds the fuzz targets in fuzz/ with libFuzzer's coverage instrumentation on the stable
# toolchain (the same -C flags cargo-fuzz passes, without a sanitizer) and runs them.
#
#   scripts/fuzz.sh                  # every target, 60 s each (what CI runs)
#   scripts/fuzz.sh nbd_handshake 600
#   scripts/fuzz.sh all 600
#
# Corpora live in fuzz/corpus/<target>/ (seeds committed; new finds stay local unless
# committed), crashes in fuzz/artifacts/<target>/. Exit status: non-zero if any target
# crashed, leaked or hung. A summary line per target (executions, coverage) goes to stdout.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
target=${1:-all}
seconds=${2:-60}
flags="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4"
flags+=" -Cllvm-args=-sanitizer-coverage-inline-8bit-counters"
flags+=" -Cllvm-args=-sanitizer-coverage-pc-table"
flags+=" -Cllvm-args=-sanitizer-coverage-trace-compares"
flags+=" --cfg fuzzing -Cdebug-assertions -Coverflow-checks -Cforce-frame-pointers"
export RUSTFLAGS="$flags"
# FUZZ_TARGET_DIR: build elsewhere (e.g. while a long run uses the default one).
export CARGO_TARGET_DIR="${FUZZ_TARGET_DIR:-$PWD/target}"
# An explicit --target keeps RUSTFLAGS off build scripts, which must not be instrumented.
triple=$(rustc -vV | sed -n 's/^host: //p')
cargo build --release --quiet --bins --target "$triple"
bin="$CARGO_TARGET_DIR/$triple/release"
if [ "$target" = all ]; then
    targets=$(sed -n 's/^name = "\(.*\)"$/\1/p' Cargo.toml | grep -v '^stord-fuzz$')
else
    targets=$target
fi
status=0
for t in $targets; do
    mkdir -p "corpus/$t" "artifacts/$t"
    log=$(mktemp)
    # -rss_limit_mb: a leak or runaway allocation fails the run; -timeout: a hang does.
    if "$bin/$t" "corpus/$t" -max_total_time="$seconds" -rss_limit_mb=2048 \
        -timeout=10 -artifact_prefix="artifacts/$t/" -print_final_stats=1 >"$log" 2>&1; then
        result=ok
    else
        result=FAILED
        status=1
        tail -40 "$log"
    fi
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
    cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | awk '{print $2}')
    ft=$(grep -o 'ft: [0-9]*' "$log" | tail -1 | awk '{print $2}')
    corpus=$(ls "corpus/$t" | wc -l)
    echo "fuzz $t: $result, ${seconds}s, ${execs:-0} executions, coverage ${cov:-0} edges (${ft:-0} features), corpus $corpus"
    rm -f "$log"
done
exit $status
