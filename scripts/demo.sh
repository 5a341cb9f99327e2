#!/usr/bin/env bash
# The main job: a kvtier-store on loopback and the Mooncake conversation trace
# replayed against it, every byte read back verified, and a summary printed.
# Usage: scripts/demo.sh [BUILD_DIR] [extra kvtier-bench trace flags]
# Environment: LIMIT (requests to replay, default 2000; 0 = the whole trace).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR="${1:-build}"
shift || true
LIMIT="${LIMIT:-2000}"

echo "kvtier demo: kvtier-store on 127.0.0.1 + the Mooncake conversation trace (${LIMIT} requests)"
# kvtier-bench starts the store, stops it on exit and on Ctrl-C (the store is
# in the same process group, and dies with its parent in any case).
exec "$BUILD_DIR/bench/kvtier-bench" trace --limit "$LIMIT" "$@"
