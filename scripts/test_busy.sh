#!/usr/bin/env bash
# make test-busy: the test suite on a loaded host. One CPU hog a core, at
# nice 19, runs beside ctest for the whole run; the suite runs BUSY_RUNS
# times in a row (3 by default) and stops at the first failure. BUSY_TESTS
# (a ctest -R regex) narrows it to the tests a change touched, e.g.
#   make test-busy BUSY_TESTS='python_vllm|python_frontend|ScaleDown'
# Every hog is stopped by its pid when this script ends, however it ends.
set -euo pipefail

build=${1:-build}
runs=${BUSY_RUNS:-3}
tests=${BUSY_TESTS:-}
jobs=$(nproc)

hogs=()
stop_hogs() {
  for pid in "${hogs[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${hogs[@]}"; do wait "$pid" 2>/dev/null || true; done
}
trap stop_hogs EXIT
for _ in $(seq "$jobs"); do
  nice -n 19 sh -c 'while :; do :; done' &
  hogs+=("$!")
done
echo "test-busy: ${#hogs[@]} CPU hogs at nice 19 (pids ${hogs[*]})"

args=(--output-on-failure -j "$jobs" --timeout 300 -LE bench)
[ -n "$tests" ] && args+=(-R "$tests")
for i in $(seq "$runs"); do
  start=$(date +%s)
  echo "test-busy: run $i of $runs${tests:+ (tests matching $tests)}"
  (cd "$build" && ctest "${args[@]}")
  echo "test-busy: run $i of $runs passed in $(($(date +%s) - start)) s"
done
