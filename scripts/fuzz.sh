#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (ASan + UBSan) and runs each for a
# bounded time over its corpus in fuzz/corpus/ (new inputs found go to a
# scratch copy). Usage: scripts/fuzz.sh [SECONDS_PER_TARGET] (default 20).
set -euo pipefail
cd "$(dirname "$0")/.."
SECS="${1:-20}"
command -v clang++ >/dev/null || { echo "fuzz: clang++ not installed"; exit 1; }
cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVTIER_ENABLE_CUDA=OFF \
  -DKVTIER_FUZZ=ON -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ >/dev/null
targets="fuzz_trace_line fuzz_config fuzz_record fuzz_store_requests fuzz_vllm_events fuzz_data_plane"
cmake --build build-fuzz --target $targets
failed=0
for t in $targets; do
  corpus="fuzz/corpus/${t#fuzz_}"
  work="$(mktemp -d)"
  cp -r "$corpus/." "$work/" 2>/dev/null || true
  echo "fuzz: $t for ${SECS}s (seed corpus: $(ls "$corpus" | wc -l) inputs)"
  if ! ./build-fuzz/fuzz/$t -max_total_time="$SECS" -rss_limit_mb=2048 -print_final_stats=1 \
       "$work" "$corpus" > "build-fuzz/$t.log" 2>&1; then
    echo "fuzz: $t FAILED (see build-fuzz/$t.log)"; tail -30 "build-fuzz/$t.log"; failed=$((failed+1))
  else
    grep -E "stat::number_of_executed_units|cov:" "build-fuzz/$t.log" | tail -2
  fi
  rm -rf "$work"
done
echo "fuzz: $(( $(echo $targets | wc -w) - failed )) passed, $failed failed"
exit $failed
