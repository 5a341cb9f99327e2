#!/usr/bin/env bash
# The main job: a whole kvtier cluster on loopback -- one kvtier-store (RAM +
# RocksDB NVMe tier), one kvtier-router and 4 kvtier-sim-workers -- replaying
# the Mooncake conversation trace in four modes (round-robin and KV-aware
# routing, each with and without the store) beside the infinite-cache bound.
# Every onboarded block is verified byte for byte. Ctrl-C stops everything.
#
# Usage: scripts/demo.sh [BUILD_DIR] [extra kvtier-bench replay flags]
# Environment: LIMIT (requests to replay, default 2000; 0 = the whole trace).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR="${1:-build}"
shift || true
LIMIT="${LIMIT:-2000}"

echo "kvtier demo: store + router + 4 simulated workers on 127.0.0.1, Mooncake trace (${LIMIT} requests)"
# kvtier-bench starts every process, stops them on exit and on Ctrl-C (and
# each dies with its parent in any case), and removes its scratch directory.
exec "$BUILD_DIR/bench/kvtier-bench" replay --limit "$LIMIT" --plot "$BUILD_DIR/replay.svg" "$@"
