"""The prefill/decode handoff through the store with real vLLM (the CPU build
in build/venv, the tiny model of tests/models), beside its reference in the
same run (docs/disaggregation.md, docs/benchmarks.md "Prefill/decode").

Two engines on one kvtier-store: P (``kv_role: kv_producer``) and D
(``kv_consumer``), both with prefix caching and the same compute threads
(VLLM_CPU_NUM_OF_RESERVED_CPU=1). Each round, on fresh prompts of
``--tokens`` tokens, interleaved (the order alternates):
  (a) D computes a prompt itself (one output token): its time to first
      token, the reference;
  (b) P prefills another (one token, ``do_remote_decode``), then D is sent
      it with P's ``kv_transfer_params``: D's time to first token, and the
      prompt tokens D did not compute (vLLM's ``cached_tokens``).
Prints each pair and its ratio (b)/(a); the target is <= 0.2 at 4,096
tokens with only the prompt's partial last block computed.

``--connector nixl`` runs the same rounds with vLLM's NixlConnector (the
reference: P's KV pulled by D over NIXL's UCX backend, no store) instead of
kvtier's connector. NIXL is not in build/venv; install it beside it:

    build/venv/bin/pip install --no-deps --target build/nixl \
        nixl==1.5.1 nixl-cu12==1.5.1 nixl-cu13==1.5.1

    build/venv/bin/python bench/pd_bench.py [--tokens 4096] [--rounds 4]
        [--connector kvtier|nixl]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BUILD = Path(os.environ.get("KVTIER_BUILD_DIR", ROOT / "build")).resolve()
sys.path[:0] = [str(BUILD / "python"), str(ROOT / "tests" / "python")]
os.environ["KVTIER_BUILD_DIR"] = str(BUILD)

from conftest import Store, engine_env  # noqa: E402
from vllm_server import (VllmServer, cached_tokens,  # noqa: E402
                         free_port, kvtier_connector, prompt_ids)

NIXL_DIR = BUILD / "nixl"  # where --connector nixl finds the nixl packages

BLOCK = 32


def timed(engine: VllmServer, ids: list[int],
          params: dict[str, Any] | None = None) -> tuple[float, dict[str, Any]]:
    """One greedy one-token completion: seconds and the answer."""
    body: dict[str, Any] = {"model": "tiny", "prompt": ids, "max_tokens": 1,
                            "temperature": 0}
    if params is not None:
        body["kv_transfer_params"] = params
    t0 = time.perf_counter()
    answer = engine.post("/v1/completions", body, timeout=300)
    return time.perf_counter() - t0, answer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--bind", default="0,1",
                    help="P's and D's compute cores (VLLM_CPU_OMP_THREADS_BIND; "
                    "'' : vLLM's own choice for both)")
    ap.add_argument("--connector", choices=("kvtier", "nixl"), default="kvtier",
                    help="kvtier: kvtier's connector through the store; nixl: "
                    "vLLM's NixlConnector (the reference; needs build/nixl)")
    args = ap.parse_args()
    if os.environ.get("KVTIER_FLAGS_ONLY") == "1":  # the docs' check
        return
    env = engine_env()
    if args.connector == "nixl":
        if not (NIXL_DIR / "nixl").is_dir():
            sys.exit(f"--connector nixl: no nixl package in {NIXL_DIR} (see "
                     "this script's docstring for the pip command)")
        env["PYTHONPATH"] = f"{NIXL_DIR}:{env.get('PYTHONPATH', '')}"
    env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "1"
    cores = os.cpu_count() or 1
    where = (f"P computes on core {args.bind.split(',')[0]}, D on core "
             f"{args.bind.split(',')[1]}" if args.bind else
             f"{max(1, cores - 1)} compute thread(s) each")
    print(f"{args.connector}: every engine: VLLM_CPU_NUM_OF_RESERVED_CPU=1, "
          f"{where} of {cores} cores; prompts of {args.tokens} tokens, "
          f"{BLOCK}-token blocks")
    with tempfile.TemporaryDirectory(prefix="kvtier-pd-") as tmp:
        work = Path(tmp)
        store = Store(work, "pd-store", ram="2GiB")
        common = ("--block-size", str(BLOCK), "--enable-prefix-caching",
                  "--enable-prompt-tokens-details",
                  "--max-model-len", str(args.tokens + 256))
        p_env, d_env = dict(env), dict(env)
        if args.bind:
            # Each engine's compute thread on a core of its own: one
            # engine's prefill does not share a core with the other.
            p_env["VLLM_CPU_OMP_THREADS_BIND"], d_env["VLLM_CPU_OMP_THREADS_BIND"] = (
                args.bind.split(","))
        if args.connector == "nixl":
            # vLLM's NixlConnector: both engines kv_both (as vLLM's own P/D
            # examples run it), KV in CPU memory, each its side channel.
            nixl = json.dumps({"kv_connector": "NixlConnector",
                               "kv_role": "kv_both", "kv_buffer_device": "cpu"})
            p_cfg = d_cfg = nixl
            p_env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_port())
            d_env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_port())
        else:
            p_cfg = kvtier_connector(store.address, "kv_producer")
            d_cfg = kvtier_connector(store.address, "kv_consumer")
        p = VllmServer(work / "p.log", env=p_env, start=False,
                       extra=(*common, "--kv-transfer-config", p_cfg))
        d = VllmServer(work / "d.log", env=d_env, start=False,
                       extra=(*common, "--kv-transfer-config", d_cfg))
        try:
            p.start()
            d.start()
            p.wait()
            d.wait()
            # First requests pay one-time costs (compilation, the data
            # plane's connections): a colocated request on each engine and
            # one handoff, untimed.
            for e in (p, d):
                timed(e, prompt_ids(999, args.tokens // 2))
            _, warm = timed(p, prompt_ids(998, args.tokens // 2),
                            {"do_remote_decode": True})
            timed(d, prompt_ids(998, args.tokens // 2), warm["kv_transfer_params"])
            rows = []
            for r in range(args.rounds):
                a_ids = prompt_ids(1000 + r, args.tokens)
                b_ids = prompt_ids(2000 + r, args.tokens)
                result: dict[str, Any] = {}
                order = ("a", "b") if r % 2 == 0 else ("b", "a")
                for which in order:
                    if which == "a":
                        result["a"], answer = timed(d, a_ids)
                        result["a_cached"] = cached_tokens(answer)
                    else:
                        result["p"], pre = timed(p, b_ids,
                                                 {"do_remote_decode": True})
                        params = pre["kv_transfer_params"]
                        result["b"], answer = timed(d, b_ids, params)
                        result["b_cached"] = cached_tokens(answer)
                        result["fence"] = (params["kvtier"]["blocks"]
                                           if "kvtier" in params else
                                           len(params["remote_block_ids"][0]))
                rows.append(result)
                print(f"round {r + 1}: (a) D computes: {result['a']:.3f} s "
                      f"(cached {result['a_cached']}); (b) P prefills "
                      f"{result['p']:.3f} s, D after the handoff "
                      f"{result['b']:.3f} s (cached {result['b_cached']} of "
                      f"{args.tokens}, fence {result['fence']} blocks); "
                      f"(b)/(a) = {result['b'] / result['a']:.3f}")
            ratios = [x["b"] / x["a"] for x in rows]
            a_median = statistics.median(x["a"] for x in rows)
            print(f"(a) D computing: median {a_median:.3f} s; "
                  f"(b) D after the handoff: median "
                  f"{statistics.median(x['b'] for x in rows):.3f} s; "
                  f"(b)/(a) per pair: {', '.join(f'{q:.3f}' for q in ratios)}; "
                  + (f"D computed {args.tokens - min(x['b_cached'] for x in rows)} "
                     "prompt tokens at most" if args.connector == "kvtier" else
                     "vLLM reports no cached tokens for NIXL's transfers")
                  + " (target: <= 0.2, the tail only)")
        finally:
            p.stop()
            d.stop()
            store.stop()


if __name__ == "__main__":
    main()
