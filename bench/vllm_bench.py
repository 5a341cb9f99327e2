"""kvtier with a real vLLM (the CPU build in build/venv, the tiny model of
tests/models), each figure beside its reference from the same run.

Engines (real vLLM processes, one at a time on 2 cores):
  (a) vLLM alone with prefix caching: time to first token computing each
      prompt, and prompt throughput;
  (b) with kvtier's connector, cold (it computes and saves): beside (a);
  (c) engine B warmed only through the store (loads the prefix): beside (a);
  (d) more long requests at once than the engine's KV memory holds (vLLM
      preempts and recomputes): throughput and TTFT without and with
      kvtier, whose connector reloads what preemption dropped; pairs
      interleaved, each pair's ratio listed;
  (e) reuse: prompts computed, then asked again into KV memory for 1.5 of
      them: vLLM alone recomputes what it evicted, kvtier loads it back;
  burst: 64 requests at once into an engine warmed only through the
      store, beside vLLM alone; pairs interleaved.
  split (--parts split): (d)'s steps timed in in-process engines (vLLM
      alone, kvtier, kvtier saving nothing), prefill and decode apart.
Every engine computes on the same threads (VLLM_CPU_NUM_OF_RESERVED_CPU=1).
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
from typing import Any

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


def ttfts(engine, prompts: list[list[int]]) -> tuple[list[float], int]:
    """Seconds to the first token of each prompt, one request at a time,
    after one short unrelated request (the engine's first step warms up),
    and the prompt tokens vLLM did not compute (cached or loaded)."""
    engine.generate([prompt(7, 64)], max_tokens=1)
    out, cached = [], 0
    for p in prompts:
        r = engine.generate([p], max_tokens=1)
        out.append(r["seconds"])
        cached += r["outputs"][0]["cached"]
    return out, cached


def _cpu_times() -> tuple[int, int]:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return v[3] + v[4], sum(v)   # idle + iowait, all


def quiet_host(idle: float = 0.9, window_s: float = 0.5,
               timeout_s: float = 30) -> float:
    """Waits until the host's CPUs were ``idle`` (a fraction) over a
    window, at most ``timeout_s``: what the last engine left running (its
    processes exiting, the store writing its saves) finishes before the
    next engine is timed. Returns the seconds waited."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        i0, a0 = _cpu_times()
        time.sleep(window_s)
        i1, a1 = _cpu_times()
        if a1 > a0 and (i1 - i0) / (a1 - a0) >= idle:
            return time.monotonic() - t0
    print(f"(the host was not {idle:.0%} idle within {timeout_s:.0f} s: "
          "the next figure ran beside other work)")
    return time.monotonic() - t0


def ratio(x: float, ref: float) -> str:
    return f"{x / ref:.2f}" if ref > 0 else "-"


def bench_env() -> dict[str, str]:
    """Every engine's environment: the build tree's package, and the same
    compute threads whether a KV connector is configured or not (vLLM's
    CPU build reserves one more core with a connector; on a 2-core host
    that reservation fails and the connector engine would compute on both
    cores, vLLM alone on one)."""
    env = engine_env()
    env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "1"
    return env


def threads_note() -> str:
    cores = os.cpu_count() or 1
    return (f"every engine: VLLM_CPU_NUM_OF_RESERVED_CPU=1, "
            f"{max(1, cores - 1)} compute thread(s) of {cores} cores")


def engines(args: argparse.Namespace, work: Path) -> None:
    """The engine parts that args.parts names, on one store."""
    if not {"ttft", "preempt", "burst", "reuse", "itl", "split"} & set(
            args.parts.split(",")):
        return
    print(threads_note())
    store = Store(work, "bench-store", ram="2GiB")
    try:
        if "burst" in args.parts:
            burst(args, work, store)
        if "ttft" in args.parts:
            ttft_cases(args, work, store)
        if "preempt" in args.parts:
            small_kv(args, work, store, reuse=False)
        if "reuse" in args.parts:
            small_kv(args, work, store, reuse=True)
        if "itl" in args.parts:
            decode_beside_saves(args, work, store)
        if "split" in args.parts:
            step_split(args, work)
    finally:
        store.stop()


def pct(xs: list[float], q: float) -> float:
    """The q-quantile of xs (nearest rank)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(q * len(xs))) - 1))]


def burst(args: argparse.Namespace, work: Path, store: Store) -> None:
    """64 requests at once (16 prefixes of args.burst_prefix tokens x 4
    suffixes of 32) into an engine warmed only through the store, beside
    vLLM alone computing them (its prefix cache shares each prefix among
    its 4 requests); args.repeat pairs, alone and kvtier interleaved, each
    engine fresh."""
    from vllm_engine import Engine
    env = bench_env()
    heads = [prompt(6000 + i, args.burst_prefix) for i in range(16)]
    burst_prompts = [h + prompt(7000 + 10 * i + j, 32)
                     for i, h in enumerate(heads) for j in range(4)]
    # The store is warmed by an engine that computes each prefix alone.
    w = Engine(str(work / "burst-warm.log"), stores=store.address, env=env,
               max_model_len=args.burst_prefix + 128)
    for h in heads:
        w.generate([h + prompt(1, 32)], max_tokens=1)
    w.stop()
    shared = len(burst_prompts) * (args.burst_prefix // 32) * 32
    print(f"\n== burst: {len(burst_prompts)} requests at once (16 prefixes "
          f"of {args.burst_prefix} tokens x 4), engine warmed only through "
          "the store, beside vLLM alone ==")
    print(f"{'pair':>4s} {'engine':12s} {'wall s':>8s} {'TTFT p50':>9s} "
          f"{'TTFT p99':>9s} {'not computed':>13s} {'wall / alone':>13s}")
    ref_outputs = None
    for i in range(args.repeat):
        wall = {}
        for label, stores in (("vLLM alone", ""), ("kvtier", store.address)):
            e = Engine(str(work / f"burst-{label[:4]}-{i}.log"),
                       stores=stores, env=env,
                       max_model_len=args.burst_prefix + 128)
            e.generate([prompt(7, 64)], max_tokens=1)  # warm up
            r = e.generate(burst_prompts, max_tokens=1)
            e.stop()
            outs = r["outputs"]
            t = [o["ttft"] for o in outs]
            cached = sum(o["cached"] for o in outs)
            wall[label] = r["seconds"]
            tokens = [o["tokens"] for o in outs]
            if ref_outputs is None:
                ref_outputs = tokens
            same = "" if tokens == ref_outputs else "  OUTPUTS DIFFER"
            share = cached / shared if stores else float("nan")
            print(f"{i + 1:4d} {label:12s} {r['seconds']:8.2f} "
                  f"{pct(t, 0.5):9.3f} {pct(t, 0.99):9.3f} "
                  f"{share:12.1%} "
                  f"{ratio(wall[label], wall['vLLM alone']):>13s}{same}")


def ttft_cases(args: argparse.Namespace, work: Path, store: Store) -> None:
    """(a), (b), (c): each prompt's TTFT in three engines, one request at
    a time. (a) and (b) run side by side, both started first, the prompts
    alternating which goes first (a b, b a, ...), the host quiet before
    each; then (c), the prompts (b) saved."""
    from vllm_engine import Engine
    env = bench_env()
    sets = [prompt(1000 + i, args.prefix) + prompt(2000 + i, 32)
            for i in range(args.prompts)]
    ab = {name: Engine(str(work / f"{name}.log"), stores=stores, env=env,
                       max_model_len=args.prefix + 128)
          for name, stores in (("a", ""), ("b", store.address))}
    times: dict[str, list[float]] = {"a": [], "b": [], "c": []}
    cached = {"a": 0, "b": 0, "c": 0}
    try:
        for e in ab.values():
            e.generate([prompt(7, 64)], max_tokens=1)  # warm up
        for i, p in enumerate(sets):
            for name in ("ab" if i % 2 == 0 else "ba"):
                quiet_host()
                r = ab[name].generate([p], max_tokens=1)
                times[name].append(r["seconds"])
                cached[name] += r["outputs"][0]["cached"]
    finally:
        for e in ab.values():
            e.stop()
    c = Engine(str(work / "c.log"), stores=store.address, env=env,
               max_model_len=args.prefix + 128)
    try:
        times["c"], cached["c"] = ttfts(c, sets)
    finally:
        c.stop()
    pairs = [b / a for a, b in zip(times["a"], times["b"])]
    print(f"(b) / (a), prompt by prompt: "
          f"{', '.join(f'{x:.2f}' for x in pairs)}")
    rows = [times["a"], times["b"], times["c"]]
    hits = [cached["a"], cached["b"], cached["c"]]
    t_ref = rows[0]
    m = statistics.mean
    print(f"\n== vLLM engines: {len(sets)} prompts of {args.prefix} + 32 "
          "tokens, TTFT one at a time (s) ==")
    total = sum(len(p) for p in sets)
    print(f"{'case':44s} {'mean':>8s} {'min':>8s} {'max':>8s} {'/ (a)':>7s}"
          f" {'not computed':>13s}")
    for name, t, c in zip(("(a) vLLM alone, prefix caching (computes)",
                           "(b) + kvtier connector, cold (saves)",
                           "(c) engine B warmed only through the store"),
                          rows, hits):
        print(f"{name:44s} {m(t):8.3f} {min(t):8.3f} {max(t):8.3f} "
              f"{ratio(m(t), m(t_ref)):>7s} {c / total:12.1%}")
    print(f"target (c)/(a) <= 0.1 at {args.prefix} tokens: "
          f"{'met' if m(rows[2]) <= 0.1 * m(t_ref) else 'NOT met'}")


def small_kv_pair(args: argparse.Namespace, work: Path, store: Store,
                  tag: str, sets: list[list[list[int]]], first_round: bool
                  ) -> dict[str, tuple[float, dict]]:
    """vLLM alone and kvtier, both started (fresh engines with KV memory
    for 1.5 of a set's prompts) before either is timed, each given every
    set in turn, A B then B A (alone first for even sets, kvtier first for
    odd ones; the host quiet before each): the engine's (seconds summed
    over the sets, outputs of all the sets) of each set asked at once
    (after each prompt was asked alone first, with ``first_round``). An
    idle engine uses no CPU."""
    from vllm_engine import Engine
    engines = {}
    for label, stores in (("vLLM alone", ""), ("+ kvtier", store.address)):
        flags = ({"save_policy": args.save_policy}
                 if stores and args.save_policy else {})
        if stores and args.connector_extra:
            flags["connector_extra"] = args.connector_extra
        engines[label] = Engine(
            str(work / f"{tag}-{label[:4]}.log"), stores=stores,
            env=bench_env(), num_blocks=int(1.5 * args.prefix / 32),
            max_model_len=args.prefix + args.decode + 64, **flags)
    res: dict[str, tuple[float, dict]] = {
        label: (0.0, {"outputs": []}) for label in engines}
    try:
        for e in engines.values():
            e.generate([prompt(7, 64)], max_tokens=1)  # warm up
        for j, prompts in enumerate(sets):
            order = list(engines.items())
            for label, e in (order[::-1] if j % 2 else order):
                if first_round:
                    for p in prompts:
                        e.generate([p], max_tokens=1)
                quiet_host()
                t = time.monotonic()
                out = e.generate(prompts, max_tokens=args.decode)
                took, acc = res[label]
                acc["outputs"] += out["outputs"]
                res[label] = (took + time.monotonic() - t, acc)
    finally:
        for e in engines.values():
            e.stop()
    return res


def report_pair(i: int, res: dict[str, tuple[float, dict]], tokens: int,
                ratios: list[float]) -> None:
    """Each engine's line, then the pair's throughput ratio (appended to
    ``ratios``) and whether their outputs are identical."""
    for label in ("vLLM alone", "+ kvtier"):
        took, out = res[label]
        outs = out["outputs"]
        t = sorted(o["ttft"] for o in outs)
        cached = sum(o["cached"] for o in outs)
        print(f"pair {i + 1} {label:12s} {took:7.2f} s "
              f"{tokens / took:9.0f} tokens/s  TTFT mean "
              f"{statistics.mean(t):.3f} s, max {t[-1]:.3f} s  not computed "
              f"{cached / tokens:.1%}")
    same = [o["tokens"] for o in res["vLLM alone"][1]["outputs"]] == \
        [o["tokens"] for o in res["+ kvtier"][1]["outputs"]]
    ratios.append(res["vLLM alone"][0] / res["+ kvtier"][0])
    print(f"pair {i + 1}: throughput kvtier / vLLM alone {ratios[-1]:.2f}; "
          f"outputs identical: {same}")


def small_kv(args: argparse.Namespace, work: Path, store: Store,
             reuse: bool) -> None:
    """args.preempt_requests prompts of args.prefix tokens into KV memory
    for 1.5 of them, asked all at once; args.repeat pairs, vLLM alone and
    kvtier interleaved, fresh prompts each pair, each pair's ratio listed
    (this host's speed drifts within minutes).

    (d) headroom (``reuse`` False): asked once, decoding args.decode
    tokens (vLLM mostly queues them; what it preempts, kvtier can reload).
    (e) reuse, the seeds' promise: computed one after another first, then
    asked again: vLLM alone recomputes what its cache evicted, kvtier loads
    it back from the store; round 2 is timed."""
    k = args.preempt_requests
    what = ("(e) reuse: {k} prompts of {n} tokens computed, then asked again "
            "at once" if reuse else
            "(d) headroom: {k} requests of {n} tokens + {d} decoded at once")
    print("\n== " + what.format(k=k, n=args.prefix, d=args.decode) +
          f"; KV memory for {int(1.5 * args.prefix / 32)} blocks of 32 "
          f"tokens; kvtier's save_policy {args.save_policy or 'all'}; "
          "pairs interleaved ==")
    ratios: list[float] = []
    for i in range(args.repeat):
        seed = (9000 if reuse else 3000) + 100 * i
        # Two sets of fresh prompts a pair, A B then B A.
        sets = [[prompt(seed + 50 * h + j, args.prefix) for j in range(k)]
                for h in range(2)]
        res = small_kv_pair(args, work, store, f"{'e' if reuse else 'd'}-{i}",
                            sets, reuse)
        tokens = len(sets) * k * (args.prefix if reuse else
                                  args.prefix + args.decode)
        report_pair(i, res, tokens, ratios)
    print(f"throughput ratios, pair by pair: "
          f"{', '.join(f'{r:.2f}' for r in ratios)} (median "
          f"{statistics.median(ratios):.2f}"
          f"{'; target >= 1.5' if reuse else ''})")


def token_gaps(steps: list[list[float]], tokens: list[int]) -> list[float]:
    """Milliseconds between the ends of consecutive steps that computed
    something, after the first: a decoding request's inter-token latencies
    when it is in every such step (a step that computed nothing, waiting
    on a connector, is part of the next gap)."""
    assert len(steps) == len(tokens), (len(steps), len(tokens))
    ends = [t + d for (t, d), n in zip(steps, tokens) if n > 0]
    return [(b - a) * 1e3 for a, b in zip(ends, ends[1:])]


def decode_beside_saves(args: argparse.Namespace, work: Path,
                        store: Store) -> None:
    """Decode ITL of a running request while other requests' long prompts
    are computed (and, with kvtier, saved): one request decoding
    args.itl_tokens tokens, submitted with args.itl_prompts prompts of
    args.prefix tokens (one token each), in vLLM alone and with kvtier,
    both engines alive, args.repeat sets of fresh prompts in A B / B A
    order. Each engine's steps are timed by vLLM's own ``LLMEngine.step``
    (the engine core in the helper process, its worker a process of its
    own, bound as vLLM binds it): every step that computes after the first
    makes one of the decoding request's tokens (:func:`token_gaps`)."""
    from vllm_engine import Engine
    engines = {}
    for label, stores in (("vLLM alone", ""), ("+ kvtier", store.address)):
        engines[label] = Engine(str(work / f"itl-{label[:4]}.log"),
                                stores=stores, env=bench_env(), inproc=1,
                                max_model_len=args.prefix + 128)
    print(f"\n== decode ITL beside long prompts: 1 request decoding "
          f"{args.itl_tokens} tokens, sent with {args.itl_prompts} prompts "
          f"of {args.prefix} tokens; vLLM's step times (ms); A B / B A ==")
    print(f"{'set':>3s} {'engine':12s} {'ITLs':>6s} {'p50':>7s} "
          f"{'p99':>7s} {'max':>7s} {'mean':>7s}")
    p99s: dict[str, list[float]] = {label: [] for label in engines}
    try:
        for e in engines.values():
            e.generate([prompt(7, 64)], max_tokens=1)  # warm up
        for i in range(args.repeat):
            dec = prompt(8100 + i, 64)
            longs = [prompt(8200 + 10 * i + j, args.prefix)
                     for j in range(args.itl_prompts)]
            order = list(engines.items())
            outs = {}
            for label, e in (order[::-1] if i % 2 else order):
                quiet_host()
                r = e.generate([dec] + longs, max_tokens=[args.itl_tokens] +
                               [1] * len(longs))
                outs[label] = [o["tokens"] for o in r["outputs"]]
                itl = token_gaps(r["steps"], r["step_tokens"])
                p99s[label].append(pct(itl, 0.99))
                print(f"{i + 1:3d} {label:12s} {len(itl):6d} "
                      f"{pct(itl, 0.5):7.2f} {pct(itl, 0.99):7.2f} "
                      f"{max(itl):7.2f} {statistics.mean(itl):7.2f}")
            print(f"set {i + 1}: p99 kvtier / vLLM alone "
                  f"{ratio(p99s['+ kvtier'][-1], p99s['vLLM alone'][-1])};"
                  f" outputs identical: "
                  f"{outs['vLLM alone'] == outs['+ kvtier']}")
    finally:
        for e in engines.values():
            e.stop()
    rs = [k / a for k, a in zip(p99s["+ kvtier"], p99s["vLLM alone"])]
    print(f"ITL p99 kvtier / vLLM alone, set by set: "
          f"{', '.join(f'{r:.2f}' for r in rs)} (target <= 1.05)")


def step_split(args: argparse.Namespace, work: Path) -> None:
    """Where the headroom case's time goes: its workload
    (args.preempt_requests prompts of args.prefix tokens + args.decode
    decoded, at once, KV memory for 1.5 prompts) in vLLM alone, kvtier
    saving every block and kvtier with ``save_policy: seen_twice`` (which
    saves nothing here), each engine core and worker in the helper process
    (``--inproc 1 --one-process 1``), every ``LLMEngine.step()`` timed and
    split by the tokens it scheduled: prefill steps (more than 64 tokens)
    and decode steps. args.repeat sets of fresh prompts, the engines'
    order rotating; each kvtier engine has a store of its own, so neither
    loads what the other saved."""
    from vllm_engine import Engine
    k = args.preempt_requests
    blocks = int(1.5 * args.prefix / 32)
    print(f"\n== (d)'s steps split: {k} prompts of {args.prefix} tokens + "
          f"{args.decode} decoded at once, {blocks} blocks; in-process "
          f"engines, vLLM's step times ==")
    stores: list[Store] = []
    engines: dict[str, Any] = {}
    try:
        for i in range(2):
            stores.append(Store(work, f"split-store-{i}", ram="1GiB"))
        common = dict(env=bench_env(), num_blocks=blocks, inproc=1,
                      one_process=1,
                      max_model_len=args.prefix + args.decode + 64)
        engines["vLLM alone"] = Engine(str(work / "split-alone.log"),
                                       **common)
        engines["+ kvtier"] = Engine(str(work / "split-kvtier.log"),
                                     stores=stores[0].address, **common)
        engines["+ kvtier seen_twice"] = Engine(
            str(work / "split-seen.log"), stores=stores[1].address,
            save_policy="seen_twice", **common)
        for e in engines.values():
            e.generate([prompt(7, 64)], max_tokens=1)  # warm up
        print(f"{'set':>3s} {'engine':22s} {'wall':>6s} {'prefill':>8s} "
              f"{'decode':>7s} {'steps':>6s} {'ms a decode step':>17s}")
        order = list(engines.items())
        for i in range(args.repeat):
            prompts = [prompt(9500 + 100 * i + j, args.prefix)
                       for j in range(k)]
            for label, e in order[i % 3:] + order[:i % 3]:
                quiet_host()
                t = time.monotonic()
                r = e.generate(prompts, max_tokens=args.decode)
                wall = time.monotonic() - t
                split = list(zip(r["steps"], r["step_tokens"]))
                pre = [d for (_, d), n in split if n > 64]
                dec = [d for (_, d), n in split if 0 < n <= 64]
                print(f"{i + 1:3d} {label:22s} {wall:6.2f} {sum(pre):8.3f} "
                      f"{sum(dec):7.3f} {len(dec):6d} "
                      f"{sum(dec) / max(1, len(dec)) * 1e3:17.2f}")
    finally:
        for e in engines.values():
            e.stop()
        for st in stores:
            st.stop()


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
    ap.add_argument("--burst-prefix", type=int, default=2048)
    ap.add_argument("--itl-tokens", type=int, default=600,
                    help="tokens the decoding request of the itl part makes")
    ap.add_argument("--itl-prompts", type=int, default=4,
                    help="long prompts sent beside it in the itl part")
    ap.add_argument("--save-policy", default="",
                    help="the kvtier engines' save_policy in (d) and (e) "
                    "(all, seen_twice; default: the connector's)")
    ap.add_argument("--connector-extra", default="",
                    help="more kv_connector_extra_config keys of the kvtier "
                    "engines in (d) and (e), as JSON")
    ap.add_argument("--repeat", type=int, default=3,
                    help="interleaved pairs of the burst and headroom parts")
    ap.add_argument("--parts", default="burst,ttft,preempt,tier",
                    help="which parts to run (comma-separated)")
    ap.add_argument("--quick", action="store_true",
                    help="the tier part only, small (the smoke test)")
    args = ap.parse_args()
    if os.environ.get("KVTIER_FLAGS_ONLY") == "1":  # the docs' check
        return 0
    with tempfile.TemporaryDirectory(prefix="kvtier-vllm-bench-") as d:
        work = Path(d)
        if args.quick:
            args.tier_rows, args.job_rows = 128, 32
            args.parts = "tier"
        engines(args, work)
        if "tier" in args.parts:
            tier(args, work)


if __name__ == "__main__":
    main()
