"""kvtier with a real vLLM (the CPU build in build/venv, the tiny model of
tests/models), each figure beside its reference from the same run.

Engines (real vLLM processes, one at a time on 2 cores):
  (a) vLLM alone with prefix caching: time to first token computing each
      prompt, and prompt throughput;
  (b) with kvtier's connector, cold (it computes and saves): beside (a);
  (c) engine B warmed only through the store (loads the prefix): beside (a);
  (d) more long requests at once than the engine's KV memory holds (vLLM
      preempts and recomputes): throughput and TTFT without and with
      kvtier, whose connector reloads what preemption dropped.
Tier (vLLM's real TieringOffloadingManager, CPU primary tier, shared
region): rows per second and per-job latency of stores and promotions
through kvtier's tier beside vLLM's own filesystem tier on the same region.

    build/venv/bin/python bench/vllm_bench.py [--prefix 4096] [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUILD = Path(os.environ.get("KVTIER_BUILD_DIR", ROOT / "build")).resolve()
sys.path[:0] = [str(BUILD / "python"), str(ROOT / "tests" / "python")]
os.environ.setdefault("UCX_TLS", "tcp,self,sm")
os.environ["KVTIER_BUILD_DIR"] = str(BUILD)

import numpy as np  # noqa: E402

from conftest import Store, engine_env  # noqa: E402


def prompt(seed: int, n: int) -> list[int]:
    return [int(x) for x in
            np.random.default_rng(seed).integers(10, 8000, size=n)]


def ttfts(engine, prompts: list[list[int]]) -> list[float]:
    """Seconds to the first token of each prompt, one request at a time."""
    out = []
    for p in prompts:
        out.append(engine.generate([p], max_tokens=1)["seconds"])
    return out


def ratio(x: float, ref: float) -> str:
    return f"{x / ref:.2f}" if ref > 0 else "-"


def engines(args: argparse.Namespace, work: Path) -> None:
    from vllm_engine import Engine
    env = engine_env()
    n = args.prompts
    sets = [prompt(1000 + i, args.prefix) + prompt(2000 + i, 32)
            for i in range(n)]
    store = Store(work, "bench-store", ram="1GiB")
    try:
        e = Engine(str(work / "a.log"), env=env)
        t_ref = ttfts(e, sets)
        e.stop()
        e = Engine(str(work / "b.log"), stores=store.address, env=env)
        t_cold = ttfts(e, sets)
        e.stop()
        e = Engine(str(work / "c.log"), stores=store.address, env=env)
        t_warm = ttfts(e, sets)
        e.stop()
        m = statistics.mean
        print(f"\n== vLLM engines: {n} prompts of {args.prefix} + 32 tokens, "
              "TTFT one at a time (s) ==")
        print(f"{'case':44s} {'mean':>8s} {'min':>8s} {'max':>8s} "
              f"{'/ (a)':>7s}")
        for name, t in (("(a) vLLM alone, prefix caching (computes)",
                         t_ref),
                        ("(b) + kvtier connector, cold (saves)", t_cold),
                        ("(c) engine B warmed only through the store",
                         t_warm)):
            print(f"{name:44s} {m(t):8.3f} {min(t):8.3f} {max(t):8.3f} "
                  f"{ratio(m(t), m(t_ref)):>7s}")
        print(f"target (c)/(a) <= 0.5 at {args.prefix} tokens: "
              f"{'met' if m(t_warm) <= 0.5 * m(t_ref) else 'NOT met'}")

        # (d) preemption: KV memory for about 1.5 of the requests at once.
        k = args.preempt_requests
        long_prompts = [prompt(3000 + i, args.prefix) for i in range(k)]
        blocks = int(1.5 * args.prefix / 32)
        res = {}
        for label, stores in (("vLLM alone", ""), ("+ kvtier", store.address)):
            e = Engine(str(work / f"d-{label[:4]}.log"), stores=stores,
                       env=env, num_blocks=blocks)
            t = time.monotonic()
            out = e.generate(long_prompts, max_tokens=args.decode)
            took = time.monotonic() - t
            e.stop()
            res[label] = (took, out)
        print(f"\n== (d) {k} requests of {args.prefix} tokens + {args.decode} "
              f"decoded, KV memory for {blocks} blocks of 32 tokens ==")
        base = res["vLLM alone"][0]
        for label, (took, out) in res.items():
            toks = k * (args.prefix + args.decode)
            print(f"{label:14s} {took:7.2f} s  {toks / took:9.0f} tokens/s  "
                  f"time / vLLM alone {ratio(took, base)}")
        same = [o["tokens"] for o in res["vLLM alone"][1]["outputs"]] == \
            [o["tokens"] for o in res["+ kvtier"][1]["outputs"]]
        print(f"outputs identical: {same}")
    finally:
        store.stop()


def tier(args: argparse.Namespace, work: Path) -> None:
    from vllm_tier_harness import (TierEngine, kvtier_tier, offload_keys)
    store = Store(work, "tier-store", ram="1GiB")
    rows = args.tier_rows
    jobs = max(1, rows // args.job_rows)
    try:
        results = {}
        for name, entry in (
                ("kvtier", kvtier_tier(store.address)),
                ("vLLM fs tier", {"type": "fs", "root_dir": str(work / "fs"),
                                  "n_read_threads": 2,
                                  "n_write_threads": 2})):
            e = TierEngine(entry, rows=args.job_rows * 2)
            warm = offload_keys(40_000, args.job_rows)  # connect, register
            e.store(warm, 0)
            e.forget()
            e.load(warm)
            e.forget()
            st, ld = [], []
            for j in range(jobs):
                keys = offload_keys(50_000 + j, args.job_rows)
                st.append(e.store(keys, j))
                e.forget()
                got, took = e.load(keys)
                assert all(g is not None for g in got), name
                ld.append(took)
                e.forget()
            e.close()
            results[name] = (st, ld)
        print(f"\n== vLLM tier: {jobs} jobs of {args.job_rows} rows of "
              f"{64} KiB, store then promote ==")
        ref_st, ref_ld = results["vLLM fs tier"]
        for name, (st, ld) in results.items():
            srate = args.job_rows * len(st) / sum(st)
            lrate = args.job_rows * len(ld) / sum(ld)
            rs = args.job_rows * len(ref_st) / sum(ref_st)
            rl = args.job_rows * len(ref_ld) / sum(ref_ld)
            print(f"{name:13s} store {srate:8.0f} rows/s (job p50 "
                  f"{statistics.median(st) * 1e3:6.1f} ms, x{srate / rs:.2f} "
                  f"of fs)   load {lrate:8.0f} rows/s (job p50 "
                  f"{statistics.median(ld) * 1e3:6.1f} ms, x{lrate / rl:.2f} "
                  "of fs)")
    finally:
        store.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prefix", type=int, default=4096)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--preempt-requests", type=int, default=6)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--tier-rows", type=int, default=2048)
    ap.add_argument("--job-rows", type=int, default=64)
    ap.add_argument("--quick", action="store_true",
                    help="the tier part only, small (the smoke test)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvtier-vllm-bench-") as d:
        work = Path(d)
        if args.quick:
            args.tier_rows, args.job_rows = 128, 32
        else:
            engines(args, work)
        tier(args, work)


if __name__ == "__main__":
    main()
