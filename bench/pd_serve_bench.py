"""Colocated beside disaggregated serving, driven by vLLM's own client
(docs/disaggregation.md, docs/benchmarks.md "Prefill/decode handoff").

Two vLLM CPU engines (the tiny model of tests/models, prefix caching and
KV events on, kvtier's connector with ``kv_role: kv_both``), each
computing on a core of its own, one kvtier-store, and kvtier-frontend in
front, in two configurations that differ only in the frontend's engine
roles:

  colocated      both engines ``role=both``: the frontend routes each
                 request by prefix and load; each engine prefills and
                 decodes its own requests;
  disaggregated  e0 ``role=prefill``, e1 ``role=decode``: prompts of more
                 than --pd-threshold uncached tokens are prefilled on e0
                 (through the store) and decoded on e1.

`vllm bench serve` (random dataset: prompts of --input-len tokens,
--output-len tokens each with ignore_eos, Poisson arrivals at --rate)
drives each run; configurations alternate, each run starts with empty
engine caches and a fresh store, and a pair's two runs send the same
prompts. Prints ITL p99 (the decode streams' token gaps), TTFT mean and
p99 and output tokens/s of each run, and per pair the ratio
disaggregated / colocated (target: ITL p99 <= 0.5).

    build/venv/bin/python bench/pd_serve_bench.py [--runs 2] [--prompts 24]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(Path(__file__).resolve().parent)]

from frontend_bench import (BLOCK, NAMESPACE, Frontend,  # noqa: E402
                            bench_serve, reset_caches)
from conftest import Store, engine_env  # noqa: E402
from vllm_server import VllmServer, free_port, kvtier_connector  # noqa: E402


HANDED_OFF = 'kvtier_frontend_handoffs_total{outcome="handed_off"}'


def frontend_counter(url: str, prefix: str) -> float:
    """The sum of the frontend's metric lines that start with prefix."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(prefix))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=2, help="pairs of runs")
    ap.add_argument("--prompts", type=int, default=24, help="requests a run")
    ap.add_argument("--rate", type=float, default=1.0, help="requests/s")
    ap.add_argument("--input-len", type=int, default=4096)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--pd-threshold", type=int, default=512)
    args = ap.parse_args()
    if os.environ.get("KVTIER_FLAGS_ONLY") == "1":  # the docs' check
        return
    cores = os.cpu_count() or 1
    print(f"== two vLLM engines (e0 on core 0, e1 on core {1 % cores}), one "
          f"store, kvtier-frontend; {args.prompts} prompts of {args.input_len} "
          f"tokens, {args.output_len} out, {args.rate}/s")
    with tempfile.TemporaryDirectory(prefix="kvtier-pd-serve-") as tmp:
        work = Path(tmp)
        store_port, router_port = free_port(), free_port()
        engines: dict[str, VllmServer] = {}
        base: dict[str, str] = {}
        for i, name in enumerate(("e0", "e1")):
            events, rep = f"ipc://{work}/{name}-events", free_port()
            events_cfg = {
                "enable_kv_cache_events": True, "publisher": "zmq",
                "endpoint": events, "replay_endpoint": f"tcp://127.0.0.1:{rep}",
                "topic": "kv-events",
            }  # fmt: skip
            env = dict(engine_env(), VLLM_SERVER_DEV_MODE="1")
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "1"
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(i % cores)
            engines[name] = VllmServer(
                work / f"{name}.log", start=False, env=env,
                extra=(
                    "--block-size", str(BLOCK), "--enable-prefix-caching",
                    "--max-model-len", str(args.input_len + args.output_len + 64),
                    "--kv-events-config", json.dumps(events_cfg),
                    "--kv-transfer-config",
                    kvtier_connector(f"127.0.0.1:{store_port}", "kv_both"),
                ),
            )  # fmt: skip
            base[name] = (
                f"id={name},endpoint=127.0.0.1:{engines[name].port},"
                f"events={events},replay=tcp://127.0.0.1:{rep},topic=kv-events,"
                f"namespace={NAMESPACE},block-tokens={BLOCK}"
            )
        roles = {
            "colocated": {"e0": "both", "e1": "both"},
            "disaggregated": {"e0": "prefill", "e1": "decode"},
        }
        store: Store | None = None
        rows: list[dict[str, dict[str, float]]] = []
        try:
            for e in engines.values():
                e.start()
            for e in engines.values():
                e.wait()
            for run in range(args.runs + 1):  # run 0 warms up, untimed
                order = list(roles) if run % 2 == 0 else list(reversed(roles))
                pair: dict[str, dict[str, float]] = {}
                for mode in order:
                    if store is not None:
                        store.stop()
                    d = work / f"store-{run}-{mode}"
                    d.mkdir()
                    store = Store(d, ram="4GiB", port=store_port,
                                  flags=(f"--router=127.0.0.1:{router_port}",
                                         "--router-refresh=1s"))
                    reset_caches(engines)
                    specs = [f"{base[n]},role={r}" for n, r in roles[mode].items()]
                    fe = Frontend(work, specs, router_port=router_port, flags=(
                        f"--pd-threshold={args.pd_threshold}",
                        "--max-prompt-tokens=16384"))
                    try:
                        n = 4 if run == 0 else args.prompts
                        res = bench_serve(fe.url, work, f"{mode}-{run}", [
                            "--dataset-name", "random",
                            "--random-input-len", str(args.input_len),
                            "--random-output-len", str(args.output_len),
                            "--random-range-ratio", "0", "--ignore-eos",
                            "--request-rate", str(args.rate),
                            "--seed", str(run)], n)  # fmt: skip
                        handed = frontend_counter(fe.url, HANDED_OFF)
                    finally:
                        fe.stop()
                    pair[mode] = {
                        "itl_p99": res["p99_itl_ms"], "itl_p50": res["median_itl_ms"],
                        "ttft_mean": res["mean_ttft_ms"],
                        "ttft_p99": res["p99_ttft_ms"],
                        "tok_s": res["output_throughput"],
                        "ok": res["completed"], "handoffs": handed,
                    }  # fmt: skip
                    if run:
                        r = pair[mode]
                        print(f"run {run} {mode:>13}: ITL p99 {r['itl_p99']:.1f} ms "
                              f"(p50 {r['itl_p50']:.1f}), "
                              f"TTFT mean {r['ttft_mean']:.0f} ms p99 "
                              f"{r['ttft_p99']:.0f} ms, {r['tok_s']:.1f} output "
                              f"tokens/s, {r['ok']:.0f} completed, "
                              f"{r['handoffs']:.0f} handoffs")
                if run:
                    rows.append(pair)
                    c, g = pair["colocated"], pair["disaggregated"]
                    print(f"run {run} disaggregated/colocated: ITL p99 "
                          f"{g['itl_p99'] / c['itl_p99']:.2f}, TTFT mean "
                          f"{g['ttft_mean'] / c['ttft_mean']:.2f}, TTFT p99 "
                          f"{g['ttft_p99'] / c['ttft_p99']:.2f}, output tokens/s "
                          f"{g['tok_s'] / c['tok_s']:.2f}")
            ratios = [p["disaggregated"]["itl_p99"] / p["colocated"]["itl_p99"]
                      for p in rows]
            print(f"ITL p99 disaggregated/colocated per pair: "
                  f"{', '.join(f'{q:.2f}' for q in ratios)} (median "
                  f"{statistics.median(ratios):.2f}; target <= 0.5)")
        finally:
            for e in engines.values():
                e.stop()
            if store is not None:
                store.stop()


if __name__ == "__main__":
    main()
