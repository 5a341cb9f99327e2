#!/usr/bin/env bash
# The routers kvtier-frontend is measured against, each from PyPI in an
# environment of its own under BUILD/routers, pinned (docs/benchmarks.md).
# Idempotent: an environment whose pin is installed is kept.
set -euo pipefail
build="${1:-build}"
declare -A pins=([vllm-router]="vllm-router==0.1.17" [sglang-router]="sglang-router==0.3.2")
for name in "${!pins[@]}"; do
  env="$build/routers/$name"
  pin="${pins[$name]}"
  if [ -f "$env/.pinned" ] && [ "$(cat "$env/.pinned")" = "$pin" ]; then continue; fi
  rm -rf "$env"
  python3 -m venv "$env"
  "$env/bin/pip" install --quiet --disable-pip-version-check "$pin"
  echo "$pin" > "$env/.pinned"
done
