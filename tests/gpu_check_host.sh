#!/usr/bin/env bash
# The CPU half of the device check (scripts/gpu_check.sh): kvtier-gpu-check
# over host pages through the page copier's staged path ("host"), a real
# kvtier-store on 127.0.0.1, small prompts; every byte must match.
#   tests/gpu_check_host.sh BUILD_DIR
set -uo pipefail
build=${1:?usage: gpu_check_host.sh BUILD_DIR}
scratch=$(mktemp -d)
export UCX_TLS=tcp
"$build/cachestore/kvtier-store" --listen=127.0.0.1:0 --data-listen=127.0.0.1:0 \
  --data-dir="$scratch/db" --hugepages=false --ram-bytes=256MiB \
  --port-file="$scratch/port" >"$scratch/store.log" 2>&1 &
store=$!
for _ in $(seq 300); do [[ -s $scratch/port ]] && break; sleep 0.1; done
rc=0
if [[ -s $scratch/port ]]; then
  timeout 120 "$build/bench/kvtier-gpu-check" --store="127.0.0.1:$(cat "$scratch/port")" \
    --device=host --layers=4 --tokens=256,2048 --staging-blocks=16 || rc=$?
else
  echo "the store did not start:" >&2
  cat "$scratch/store.log" >&2
  rc=2
fi
kill "$store" 2>/dev/null
wait "$store" 2>/dev/null
rm -rf "$scratch"
exit $rc
