#!/bin/bash
# Builds the fuzz targets in fuzz/ with libFuzzer's coverage instrumentation on the stable
# toolchain (the same -C flags cargo-fuzz passes, without a sanitizer) and runs them.
#
#   scripts/fuzz.sh                  # every target, 60 s each, one per CPU at a time (what CI runs)
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
# Targets run side by side, one per CPU (FUZZ_JOBS to choose): each still gets its full
# time, and CI waits for the slowest group rather than the sum of all of them.
jobs=${FUZZ_JOBS:-$(nproc)}
results=$(mktemp -d)
trap 'rm -rf "$results"' EXIT
run_one() { # target: runs it, leaves its log and its summary line in $results
    local t=$1 log="$results/$1.log" result execs cov ft corpus
    mkdir -p "corpus/$t" "artifacts/$t"
    # -rss_limit_mb: a leak or runaway allocation fails the run; -timeout: a hang does.
    if "$bin/$t" "corpus/$t" -max_total_time="$seconds" -rss_limit_mb=2048 \
        -timeout=10 -artifact_prefix="artifacts/$t/" -print_final_stats=1 >"$log" 2>&1; then
        result=ok
    else
        result=FAILED
    fi
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
    cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | awk '{print $2}')
    ft=$(grep -o 'ft: [0-9]*' "$log" | tail -1 | awk '{print $2}')
    corpus=$(ls "corpus/$t" | wc -l)
    echo "fuzz $t: $result, ${seconds}s, ${execs:-0} executions, coverage ${cov:-0} edges (${ft:-0} features), corpus $corpus" >"$results/$t.line"
}
running=0
for t in $targets; do
    if [ "$running" -ge "$jobs" ]; then
        wait -n || true
        running=$((running - 1))
    fi
    run_one "$t" &
    running=$((running + 1))
done
wait
status=0
for t in $targets; do
    if grep -q "^fuzz $t: FAILED," "$results/$t.line"; then
        status=1
        tail -40 "$results/$t.log"
    fi
    cat "$results/$t.line"
done
exit $status
