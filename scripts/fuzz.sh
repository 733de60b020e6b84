#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz in BUILD (configured by `make fuzz` with
# -DLLMEM_FUZZ=ON) and runs each for SECONDS from a copy of its seed corpus, JOBS targets at a
# time: `scripts/fuzz.sh BUILD SECONDS JOBS`. What a run finds stays in BUILD/corpus/<target>, not
# in the tree; its output is in BUILD/<target>.log and a crash's reproducer in BUILD/artifacts/.
# Exit status 1 when any target found a crash, a leak, a timeout or a sanitizer report (all of
# them run to the end first; the failing ones' reports are printed), 0 otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."

build=$1
seconds=$2
jobs=${3:-2}
targets=$(cd tests/fuzz && ls fuzz-*.c | sed 's/\.c$//')

# shellcheck disable=SC2086 # one word a target
cmake --build "$build" -j "$jobs" --target $targets
mkdir -p "$build/artifacts"

run_one() {
    local build=$1 seconds=$2 t=$3
    rm -rf "$build/corpus/$t" "$build/$t.rc"
    mkdir -p "$build/corpus/$t"
    cp tests/fuzz/corpus/"$t"/* "$build/corpus/$t/"
    local rc=0
    "./$build/tests/$t" -max_total_time="$seconds" -max_len=8192 -timeout=10 \
        -print_final_stats=1 -artifact_prefix="$build/artifacts/$t-" \
        "$build/corpus/$t" >"$build/$t.log" 2>&1 || rc=$?
    echo "$rc" >"$build/$t.rc"
}
export -f run_one

echo "fuzz: $(echo "$targets" | wc -w) targets, $seconds s each, $jobs at a time"
# shellcheck disable=SC2086
printf '%s\n' $targets | xargs -P "$jobs" -I{} bash -c 'run_one "$@"' _ "$build" "$seconds" {} || true

failed=0
for t in $targets; do
    rc=$(cat "$build/$t.rc" 2>/dev/null || echo missing)
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$build/$t.log" | tail -1 || true)
    cov=$(grep -oE 'cov: [0-9]+' "$build/$t.log" | tail -1 | cut -d' ' -f2 || true)
    if [ "$rc" = 0 ]; then
        echo "== $t: ${runs:-?} runs, cov ${cov:-?}"
    else
        failed=1
        echo "== $t FAILED (exit $rc), full output in $build/$t.log:"
        # the report: from the first sanitizer/libFuzzer error line on
        awk '/^==[0-9]+==|runtime error:|^ERROR: libFuzzer|^SUMMARY|deadly signal|Test unit written/ {p=1} p' \
            "$build/$t.log" | head -80
    fi
done
exit $failed
