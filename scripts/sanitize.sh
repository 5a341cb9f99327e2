#!/usr/bin/env bash
# Builds kvtier with a sanitizer and runs the test suite under it.
# Usage: scripts/sanitize.sh address|thread [ctest -R regex]
set -euo pipefail
cd "$(dirname "$0")/.."
KIND="${1:?address or thread}"
FILTER="${2:-.}"
DIR="build-$KIND"
cmake -S . -B "$DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVTIER_ENABLE_CUDA=OFF \
  -DKVTIER_SANITIZE="$KIND" >/dev/null
cmake --build "$DIR"
# Leaks are reported at exit; gRPC keeps a few process-lifetime singletons.
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:halt_on_error=1"
export LSAN_OPTIONS="suppressions=$PWD/scripts/lsan.supp"
# ignore_noninstrumented_modules: accesses made inside Debian's uninstrumented
# libraries (gRPC, protobuf, OpenSSL, RocksDB, UCX) are not tracked.
export TSAN_OPTIONS="halt_on_error=1:ignore_noninstrumented_modules=1:suppressions=$PWD/scripts/tsan.supp"
# UCX's memory hooks (libucm's madvise/mmap) run in new threads before TSan
# has set them up and crash there; kvtier registers its memory explicitly.
[ "$KIND" = thread ] && export UCX_MEM_MMAP_HOOK_MODE=none
cd "$DIR" && ctest --output-on-failure -j 2 --timeout 600 -LE "bench|gpu" -R "$FILTER"
