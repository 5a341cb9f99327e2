"""vLLM's real scheduler-side offloading, built the way vLLM builds it and
driven the way vLLM's own tiering tests drive it (tests/v1/kv_offload/
tiering in vLLM's repository), with no GPU: ``OffloadingSpecFactory``
makes a ``TieringOffloadingSpec`` whose ``TieringOffloadingManager`` holds
the CPU primary tier over a real shared-memory region and the secondary
tiers the config names (kvtier's, or vLLM's own fs tier).

What a GPU worker would do (DMA a block's KV into the primary row vLLM
chose, or out of it) is done here by writing or reading the row: the only
part of vLLM's offloading this harness stands in for.

As a script (one engine in its own process), it stores the rows of
``--keys`` keys and prints a JSON summary:
    python vllm_tier_harness.py --stores ADDR --seed N --keys K
"""

from __future__ import annotations

import argparse
import json
import time
import uuid
from typing import Any, Optional

import numpy as np

from vllm.v1.kv_offload.base import (LookupResult, ReqContext,
                                     ScheduleEndContext, make_offload_key)
from vllm.v1.kv_offload.config import (OffloadingCacheConfig,
                                       OffloadingConfig,
                                       OffloadingGroupConfig,
                                       OffloadingModelConfig,
                                       OffloadingParallelConfig)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

#: Bytes of one GPU block of every layer on one worker (here, a row).
ROW = 64 * 1024


def kvtier_tier(stores: str, **extra: Any) -> dict[str, Any]:
    """kvtier's entry in ``secondary_tiers``, as docs/engines.md gives it."""
    return {"type": "KvtierTier",
            "module_path": "kvtier.integrations.vllm_tier",
            "stores": stores, **extra}


def offload_keys(seed: int, n: int) -> list[bytes]:
    """n offload keys of one request: 32-byte block hashes, group 0."""
    rng = np.random.default_rng(seed)
    return [make_offload_key(rng.bytes(32), 0) for _ in range(n)]


def row_bytes(seed: int, i: int) -> np.ndarray:
    """The KV a worker would have DMAed into the row of key i."""
    return np.random.default_rng((seed, i)).integers(
        0, 256, size=ROW, dtype=np.uint8)


class TierEngine:
    """One engine's scheduler-side offloading with ``tier`` as its
    secondary tier over ``rows`` primary rows."""

    def __init__(self, tier: dict[str, Any], rows: int = 64,
                 tp_size: int = 1, blocks_per_chunk: int = 1,
                 events: bool = True, row: int = ROW) -> None:
        cfg = OffloadingConfig(
            groups=(OffloadingGroupConfig(
                tokens_per_block=16, layer_names=("model.layers.0.attn",),
                group_id=0),),
            worker_kv_bytes_per_block=row // tp_size // blocks_per_chunk,
            enable_kv_cache_events=events,
            extra_config={"spec_name": "TieringOffloadingSpec",
                          "cpu_bytes_to_use": rows * row,
                          "secondary_tiers": [tier]},
            engine_id=f"kvtier-test-{uuid.uuid4().hex[:12]}",
            model=OffloadingModelConfig(name="tiny-llama", dtype="bfloat16"),
            cache=OffloadingCacheConfig(tokens_per_hash=16,
                                        blocks_per_chunk=blocks_per_chunk),
            parallel=OffloadingParallelConfig(
                rank=0, world_size=tp_size, tp_size=tp_size, pp_size=1,
                pcp_size=1, dcp_size=1, data_parallel_index=0,
                data_parallel_size=1, data_parallel_rank_local=None,
                is_parallelism_agnostic=True))
        self.spec = OffloadingSpecFactory.create_spec(cfg)
        self.manager = self.spec.get_manager()
        self.tier = self.manager.secondary_tiers[0]
        view = self.manager.primary_tier.get_kv_memoryview()
        self._rows: Optional[np.ndarray] = np.frombuffer(
            view, dtype=np.uint8).reshape(view.shape[0], -1)
        self.events: list[Any] = []
        self._n = 0

    @property
    def rows(self) -> np.ndarray:
        assert self._rows is not None
        return self._rows

    def step(self) -> None:
        """One scheduler step: flushes lookups, collects finished jobs."""
        self.manager.on_schedule_end(ScheduleEndContext(
            new_req_ids=[], preempted_req_ids=()))
        self.events += list(self.manager.take_events())

    def settle(self, timeout: float = 30) -> None:
        """Steps until no job is in flight."""
        deadline = time.monotonic() + timeout
        self.step()
        while self.manager.has_pending_work():
            assert time.monotonic() < deadline, "offload jobs never finished"
            time.sleep(0.005)
            self.step()

    def store(self, keys: list[bytes], seed: int,
              params: Optional[dict[str, Any]] = None) -> float:
        """A request's blocks offloaded from the "GPU" (written into the
        rows vLLM chose), then cascaded to the secondary tier. Returns the
        seconds until every job finished. ``params``: the request's
        kv_transfer_params."""
        ctx = self._request(params)
        out = self.manager.prepare_store(keys, ctx)
        for i, row in enumerate(out.store_spec.chunk_ids):
            self.rows[int(row)] = row_bytes(seed, i)
        self.manager.complete_store(keys, ctx, success=True)
        start = time.monotonic()
        self.settle()
        took = time.monotonic() - start
        self.manager.on_request_finished(ctx)
        return took

    def load(self, keys: list[bytes], timeout: float = 30,
             params: Optional[dict[str, Any]] = None
             ) -> tuple[list[Optional[bytes]], float]:
        """A request looks its blocks up: a secondary hit is promoted into
        the primary tier (a load job), then read as a GPU worker would.
        Returns each key's row bytes (None for a miss) and the seconds the
        lookups and promotions took. As vLLM's scheduler does, it asks
        again each step while any lookup is deferred."""
        ctx = self._request(params)
        start = time.monotonic()
        deadline = start + timeout
        while True:
            res = [self.manager.lookup(k, ctx) for k in keys]
            if all(r in (LookupResult.HIT, LookupResult.MISS) for r in res):
                break
            assert time.monotonic() < deadline, f"lookups stuck at {res}"
            self.step()
            time.sleep(0.002)
        took = time.monotonic() - start
        hits = [k for k, r in zip(keys, res) if r is LookupResult.HIT]
        out: list[Optional[bytes]] = [None] * len(keys)
        if hits:
            spec = self.manager.prepare_load(hits, ctx)
            got = {k: bytes(self.rows[int(c)])
                   for k, c in zip(hits, spec.chunk_ids)}
            self.manager.complete_load(hits, ctx)
            out = [got.get(k) for k in keys]
        self.manager.on_request_finished(ctx)
        self.step()
        return out, took

    def forget(self) -> None:
        """Empties the primary tier (its rows zeroed): what is found next
        comes from the secondary tier."""
        self.manager.reset_cache()
        self.rows[:] = 0

    def close(self) -> None:
        self._rows = None
        self.manager.shutdown()

    def _request(self, params: Optional[dict[str, Any]] = None
                 ) -> ReqContext:
        self._n += 1
        ctx = ReqContext(req_id=f"req-{self._n}", kv_transfer_params=params)
        self.policy = self.manager.on_new_request(ctx)
        return ctx


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stores", required=True)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--keys", type=int, default=8)
    args = ap.parse_args()
    e = TierEngine(kvtier_tier(args.stores))
    took = e.store(offload_keys(args.seed, args.keys), args.seed)
    summary = {"stored": args.keys, "seconds": took,
               "namespace": f"{e.tier.namespace.id:016x}",
               "events": [[ev.medium.value, ev.removed,
                           getattr(ev.locality, "value", None), len(ev.keys)]
                          for ev in e.events]}
    e.close()
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
