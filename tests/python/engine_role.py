"""One reference-engine process of test_engine.py: runs a prompt through an
Engine over kvtier and writes what the test compares (tokens, logits, the
KV of the prompt's blocks) to a torch file.

  writer: serves the prompt (its blocks go to the store).
  reader: serves the prompt (usually the writer's plus a suffix) loading what
          it can from the store, then the same prompt in a second engine with
          kvtier off (the cold run). --kill-store-pid kills the store after
          the load is pinned and before its bytes move.
"""

from __future__ import annotations

import argparse
import os
import signal

import numpy as np
import torch

from kvtier.engine.engine import Engine, EngineConfig
from kvtier.engine.model import ModelConfig, Transformer
from processes import dead_or_gone


def block_kv(engine: Engine, hashes: np.ndarray, n: int) -> list:
    """KV ([layers, 2, tokens, heads, dim]) of blocks 0..n-1 from the
    engine's prefix cache (None for a block it does not hold)."""
    out = []
    for hi, lo in hashes[:n].tolist():
        page = engine.pages.page_of.get((int(hi), int(lo)))
        if page is None:
            out.append(None)
            continue
        out.append(torch.stack([
            torch.stack([engine.cache.key(layer)[page],
                         engine.cache.value(layer)[page]])
            for layer in range(engine.model.config.layers)]).clone())
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--role", choices=["writer", "reader"], required=True)
    p.add_argument("--stores", required=True)
    p.add_argument("--prompt", required=True, help=".npy of token ids")
    p.add_argument("--out", required=True)
    p.add_argument("--decode", type=int, default=6)
    p.add_argument("--shm", default="auto")
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--kill-store-pid", type=int, default=0)
    a = p.parse_args()
    torch.set_num_threads(1)
    prompt = np.load(a.prompt).tolist()
    mc = ModelConfig()
    # The tests assert exact loads: lookups are waited for up to the
    # deadline, however loaded the host (test_engine.py tests the wait).
    ec = EngineConfig(num_pages=256, page_tokens=16, max_step_tokens=a.chunk,
                      lookup_wait_share=None)
    stores = a.stores.split(",")

    model = Transformer(mc)
    engine = Engine(model, ec, stores, connector_options={
        "shared_memory": a.shm, "deadline_ms": 3000})
    if a.kill_store_pid:
        real = engine.connector.start_load

        def kill_then_load(rid: int, pages: list) -> None:
            os.kill(a.kill_store_pid, signal.SIGKILL)
            dead_or_gone(a.kill_store_pid)
            real(rid, pages)

        engine.connector.start_load = kill_then_load  # type: ignore
    res = engine.generate(prompt, a.decode)
    hashes = engine.namespace.hash_tokens(np.asarray(prompt))
    out = {"tokens": res.tokens, "logits": res.first_logits,
           "loaded_tokens": res.loaded_tokens,
           "computed_tokens": res.computed_tokens,
           "load_status": res.load_status,
           "kv": block_kv(engine, hashes, len(hashes)),
           "stats": dict(engine.stats)}
    engine.close()
    if a.role == "reader":
        cold = Engine(model, ec)
        c = cold.generate(prompt, a.decode)
        out["cold_tokens"] = c.tokens
        out["cold_logits"] = c.first_logits
        out["cold_computed"] = c.computed_tokens
        cold.close()
    torch.save(out, a.out)


if __name__ == "__main__":
    main()
