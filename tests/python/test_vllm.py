"""kvtier.integrations.vllm.KvtierConnector with its scheduler half here and
its worker half in another process (as in vLLM: they share only the pickled
metadata), real KV tensors in vLLM's layout and a real kvtier-store. The
argument shapes are vLLM v0.15's (tests/python/vllm_shapes.py). A block
corrupted behind the store's back is reported through
get_block_ids_with_load_errors and recomputed."""

from __future__ import annotations

import pickle
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import corrupt_in_store, engine_env
import kvtier
import vllm_shapes as v
from kvtier.integrations.vllm import KvtierConnector, KVConnectorRole

HERE = Path(__file__).parent
BS = 16


class Worker:
    """The worker process."""

    def __init__(self, stores: list[str]) -> None:
        env = engine_env()
        env["PYTHONPATH"] += ":" + str(HERE)
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "vllm_worker.py"), ",".join(stores)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)

    def call(self, **msg: Any) -> Any:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(pickle.dumps(msg).hex().encode() + b"\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, "the worker process died"
        return pickle.loads(bytes.fromhex(line.decode().strip()))

    def step(self, meta: Any, compute: list[tuple[int, int]]) -> Any:
        return self.call(op="step", meta=meta, compute=compute)

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin
            self.proc.stdin.write(pickle.dumps({"op": "stop"}).hex().encode()
                                  + b"\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=60)


@pytest.fixture
def worker(store):
    w = Worker([store.address])
    yield w
    w.stop()


def matched(sched: KvtierConnector, req: Any,
            computed: int) -> tuple[int, bool]:
    """``get_num_new_matched_tokens`` as vLLM's scheduler calls it: again
    in a later step while it answers None (the lookup is still out)."""
    deadline = time.monotonic() + 10
    while True:
        n, load_async = sched.get_num_new_matched_tokens(req, computed)
        if n is not None:
            return n, load_async
        assert time.monotonic() < deadline, "the lookup never answered"
        time.sleep(0.001)


def run_new(sched: KvtierConnector, w: Worker, rid: str, prompt: list[int],
            pages: list[int], seeds: dict[int, int]) -> tuple[int, Any]:
    """One request through the hooks for its first step (its whole
    prompt): returns the tokens loaded and the worker's answer."""
    req = v.Request(rid, prompt)
    n, load_async = matched(sched, req, 0)
    assert load_async is False
    sched.update_state_after_alloc(req, v.KVCacheBlocks(pages), n)
    req.num_computed_tokens = n
    out = v.SchedulerOutput(
        scheduled_new_reqs=[v.NewRequestData(rid, prompt, (pages,), n)],
        num_scheduled_tokens={rid: len(prompt) - n})
    meta = sched.build_connector_meta(out)
    meta = pickle.loads(pickle.dumps(meta))  # what vLLM ships
    first = n // BS
    compute = [(pages[b], seeds[b]) for b in range(first, len(pages))]
    return n, w.step(meta, compute)


def test_two_processes_save_load_and_recompute_a_corrupt_block(
        store, worker) -> None:
    sched = KvtierConnector(v.config([store.address]),
                            KVConnectorRole.SCHEDULER)
    rng = np.random.default_rng(11)
    prompt = rng.integers(0, 4096, 100).tolist()
    seeds = {b: 1000 + b for b in range(9)}  # block b's content

    # A: nothing in the store; its 6 full blocks are saved after the step.
    n, r = run_new(sched, worker, "A", prompt, list(range(0, 7)), seeds)
    assert n == 0 and r["errors"] == []
    assert sched.request_finished(v.Request("A", prompt), list(range(7))) \
        == (False, None)
    # The saves' bytes were copied in wait_for_save; the store writes them
    # in the background.
    probe = kvtier.StoreClient([store.address])
    ns = sched._scheduler.namespace
    hashes = kvtier.hash_tokens(ns, prompt)
    deadline = time.monotonic() + 10
    while probe.lookup(ns, hashes) < 6:
        assert time.monotonic() < deadline, "A's blocks never got stored"
        time.sleep(0.02)

    # B: A's prompt and more: 6 blocks load into B's pages 10..15.
    longer = prompt + rng.integers(0, 4096, 30).tolist()
    n, r = run_new(sched, worker, "B", longer, list(range(10, 19)), seeds)
    assert n == 6 * BS
    assert r["errors"] == [], r
    pages = worker.call(op="read", pages=list(range(0, 6)) +
                        list(range(10, 16)))
    for b in range(6):
        for layer in range(2):
            assert (pages[10 + b][layer] == pages[b][layer]).all(), \
                f"block {b} layer {layer}"
    sched.request_finished(v.Request("B", longer), list(range(10, 19)))

    # A block corrupted behind the store's back: C's load reports every
    # page of it as failed; the connector has the store check its copies
    # (the corrupt one is dropped), and vLLM's recompute saves it again.
    needle = pages[2][0][0].numpy().tobytes()  # block 2, layer 0, K
    assert corrupt_in_store(store.pid, needle)
    n, r = run_new(sched, worker, "C", prompt, list(range(20, 27)), seeds)
    assert n == 6 * BS
    assert set(r["errors"]) == set(range(20, 26)), r
    assert any("DATA_LOSS" in f for f in r["failures"]), r["failures"]
    deadline = time.monotonic() + 10
    while probe.lookup(ns, hashes) != 2:  # blocks 0-1 remain, 2 was dropped
        assert time.monotonic() < deadline, "the corrupt block stayed"
        time.sleep(0.02)
    # vLLM cuts C back to its first failed block (0) and recomputes.
    out = v.SchedulerOutput(
        scheduled_cached_reqs=v.CachedRequestData(
            req_ids=["C"], new_block_ids=[None], num_computed_tokens=[0]),
        num_scheduled_tokens={"C": len(prompt)})
    meta = sched.build_connector_meta(out)
    assert [(s.first_block, len(s.pages)) for s in meta.step.saves] \
        == [(0, 6)], "the recomputed blocks are saved again"
    r = worker.step(meta, [(20 + b, seeds[b]) for b in range(7)])
    assert r["errors"] == []
    again = worker.call(op="read", pages=[2, 22])
    assert (again[22][0] == again[2][0]).all(), "block 2 was recomputed"
    sched.request_finished(v.Request("C", prompt), list(range(20, 27)))
    # The recompute's blocks reached the store: D loads all six, intact.
    deadline = time.monotonic() + 10
    while probe.lookup(ns, hashes) < 6:
        assert time.monotonic() < deadline, "block 2 was never saved again"
        time.sleep(0.02)
    n, r = run_new(sched, worker, "D", prompt, list(range(30, 37)), seeds)
    assert n == 6 * BS and r["errors"] == [], r
    d = worker.call(op="read", pages=[2, 32])
    assert all((d[32][layer] == d[2][layer]).all() for layer in range(2))


def test_imports_without_vllm_and_refuses_a_config_without_stores() -> None:
    import kvtier.integrations.vllm as mod

    assert mod.KvtierConnector.__mro__[1].__name__ == "KVConnectorBase_V1"
    cfg = v.config([])
    cfg.kv_transfer_config.kv_connector_extra_config = {}
    with pytest.raises(ValueError, match="stores"):
        KvtierConnector(cfg, KVConnectorRole.SCHEDULER)
    cfg = v.config(["127.0.0.1:1"])
    cfg.parallel_config.pipeline_parallel_size = 2
    with pytest.raises(ValueError, match="pipeline"):
        KvtierConnector(cfg, KVConnectorRole.SCHEDULER)


def test_salted_lora_and_multimodal_requests_never_share_blocks(
        store, worker) -> None:
    sched = KvtierConnector(v.config([store.address]),
                            KVConnectorRole.SCHEDULER)
    prompt = np.random.default_rng(12).integers(0, 4096, 70).tolist()
    seeds = {b: 2000 + b for b in range(9)}
    run_new(sched, worker, "plain", prompt, list(range(0, 5)), seeds)
    probe = kvtier.StoreClient([store.address])
    ns = sched._scheduler.namespace
    deadline = time.monotonic() + 10
    while probe.lookup(ns, kvtier.hash_tokens(ns, prompt)) < 4:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    again = v.Request("again", prompt)
    assert matched(sched, again, 0) == (4 * BS, False)
    salted = v.Request("salted", prompt)
    salted.cache_salt = "tenant-b"  # type: ignore[attr-defined]
    assert matched(sched, salted, 0) == (0, False)
    lora = v.Request("lora", prompt)
    lora.lora_request = type("LoRARequest", (), {  # type: ignore
        "lora_name": "sql", "lora_int_id": 1})()
    assert matched(sched, lora, 0) == (0, False)
    mm = v.Request("mm", prompt)
    mm.mm_features = [object()]  # type: ignore[attr-defined]
    assert matched(sched, mm, 0) == (0, False)
    # A salt that holds the canonical string's separator (even one ending
    # as the kv_wire field would) is a namespace of its own, not an error.
    odd = v.Request("odd", prompt)
    odd.cache_salt = "x|int8"  # type: ignore[attr-defined]
    assert matched(sched, odd, 0) == (0, False)


def test_a_lookup_is_never_waited_for_on_the_scheduler_thread(store) -> None:
    """``get_num_new_matched_tokens`` does not block vLLM's scheduler: it
    answers None (ask again later) until the store answers, and 0 once
    ``lookup_wait_ms`` has passed with the store SIGSTOPped; while that
    lookup is out the store is not asked again (0 at once). After the
    store answers again, hits come back. ``lookup_wait_ms`` 0 asks
    synchronously; a negative one is refused at start-up."""
    probe = kvtier.StoreClient([store.address])
    sched = KvtierConnector(v.config([store.address],
                                     lookup_wait_ms=200),
                            KVConnectorRole.SCHEDULER)
    ns = sched._scheduler.namespace
    prompt = np.random.default_rng(13).integers(0, 4096, 70).tolist()
    hashes = kvtier.hash_tokens(ns, prompt)
    probe.register_namespace(ns)
    probe.put(ns, hashes, np.ones(len(hashes) * ns.block_bytes, np.uint8))
    first = sched.get_num_new_matched_tokens(v.Request("a", prompt), 0)
    assert first in ((None, False), (4 * BS, False))
    assert matched(sched, v.Request("a", prompt), 0) == (4 * BS, False)

    store.pause()
    try:
        t0 = time.monotonic()
        asks = 0
        while True:
            n, _ = sched.get_num_new_matched_tokens(v.Request("b", prompt), 0)
            asks += 1
            if n is not None:
                break
            time.sleep(0.005)
        waited = time.monotonic() - t0
        t0 = time.monotonic()
        spared = sched.get_num_new_matched_tokens(v.Request("c", prompt), 0)
        spared_s = time.monotonic() - t0
    finally:
        store.resume()
    assert n == 0 and asks > 1
    assert 0.2 <= waited < 1.0, waited
    assert spared == (0, False) and spared_s < 0.05, spared_s
    assert sched._scheduler.lookups_late == 1
    assert sched._scheduler.lookups_not_asked == 1
    deadline = time.monotonic() + 10
    while matched(sched, v.Request("d", prompt), 0)[0] != 4 * BS:
        assert time.monotonic() < deadline, "hits never came back"
        time.sleep(0.05)

    sync = KvtierConnector(v.config([store.address], lookup_wait_ms=0),
                           KVConnectorRole.SCHEDULER)
    assert sync.get_num_new_matched_tokens(v.Request("e", prompt), 0) == \
        (4 * BS, False)
    with pytest.raises(kvtier.errors.InvalidArgument, match="lookup_wait_ms"):
        KvtierConnector(v.config([store.address], lookup_wait_ms=-1),
                        KVConnectorRole.SCHEDULER)
