"""kvtier.integrations.vllm.KvtierConnector with its scheduler half here and
its worker half in another process (as in vLLM: they share only the pickled
metadata), real KV tensors in vLLM's layout and a real kvtier-store. The
argument shapes are vLLM v0.15's (tests/python/vllm_shapes.py). A block
corrupted behind the store's back is reported through
get_block_ids_with_load_errors and recomputed."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import BUILD, corrupt_in_store, engine_env, wait_until
import kvtier
import vllm_shapes as v
from kvtier.integrations.vllm import (KvtierConnector, KvtierConnectorMetadata,
                                      KVConnectorRole)
from kvtier.hooks import request_key
from kvtier.integrations.pd import producer_params

HERE = Path(__file__).parent
BS = 16


class Worker:
    """The worker process."""

    def __init__(self, stores: list[str], compute_cpus: str = "",
                 **extra: Any) -> None:
        env = engine_env()
        env["PYTHONPATH"] += ":" + str(HERE)
        if compute_cpus:  # its main thread bound there, as vLLM's CPU build
            env["KVTIER_TEST_COMPUTE_CPUS"] = compute_cpus
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "vllm_worker.py"), ",".join(stores),
             json.dumps(extra)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)

    def call(self, **msg: Any) -> Any:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(pickle.dumps(msg).hex().encode() + b"\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, "the worker process died"
        return pickle.loads(bytes.fromhex(line.decode().strip()))

    def step(self, meta: Any, compute: list[tuple[int, int]],
             await_loads: bool = True, await_sent: tuple[str, ...] = (),
             await_copies: int = 0) -> Any:
        return self.call(op="step", meta=meta, compute=compute,
                         await_loads=await_loads, await_sent=list(await_sent),
                         await_copies=await_copies)

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
        # The step ends (its lookups go out in one batch); the next asks.
        sched.build_connector_meta(v.SchedulerOutput())
        time.sleep(0.001)


def run_new(sched: KvtierConnector, w: Worker, rid: str, prompt: list[int],
            pages: list[int], seeds: dict[int, int], await_copies: int = 0
            ) -> tuple[int, Any, Any]:
    """One request through the hooks as vLLM drives an asynchronous load:
    the lookup; if the store holds blocks, a step that only loads them
    (the request waits for its KV; the worker reports the load ended, and
    the pages that did not load); then the step that computes the rest of
    the prompt, from the first page that did not load. Returns the tokens
    the store offered, the worker's answers (load errors and failures
    merged) and the computing step's plan."""
    req = v.Request(rid, prompt)
    n, load_async = matched(sched, req, 0)
    assert load_async is (n > 0)
    sched.update_state_after_alloc(req, v.KVCacheBlocks(pages), n)
    loaded = {"errors": [], "failures": [], "finished": []}
    computed = n
    if n:
        meta = sched.build_connector_meta(v.SchedulerOutput())
        assert [s.name for s in meta.step.loads] == [rid]
        loaded = w.step(pickle.loads(pickle.dumps(meta)), [])
        assert loaded["finished"] == [rid], loaded
        sched.update_connector_output(
            v.KVConnectorOutput(finished_recving=set(loaded["finished"])))
        if loaded["errors"]:  # vLLM cuts back to the first failed block
            computed = min(pages.index(p) for p in loaded["errors"]) * BS
    req.num_computed_tokens = computed
    out = v.SchedulerOutput(
        scheduled_new_reqs=[v.NewRequestData(rid, prompt, (pages,), computed)],
        num_scheduled_tokens={rid: len(prompt) - computed})
    meta = sched.build_connector_meta(out)
    meta = pickle.loads(pickle.dumps(meta))  # what vLLM ships
    compute = [(pages[b], seeds[b]) for b in range(computed // BS, len(pages))]
    r = w.step(meta, compute, await_copies=await_copies)
    r["errors"] = sorted(set(r["errors"]) | set(loaded["errors"]))
    r["failures"] = loaded["failures"] + r["failures"]
    return n, r, meta


def test_two_processes_save_load_and_recompute_a_corrupt_block(
        store, worker) -> None:
    sched = KvtierConnector(v.config([store.address]),
                            KVConnectorRole.SCHEDULER)
    rng = np.random.default_rng(11)
    prompt = rng.integers(0, 4096, 100).tolist()
    seeds = {b: 1000 + b for b in range(9)}  # block b's content

    # A: nothing in the store; its 6 full blocks are saved after the step.
    n, r, _ = run_new(sched, worker, "A", prompt, list(range(0, 7)), seeds)
    assert n == 0 and r["errors"] == []
    # vLLM keeps A's pages until the worker says its saves were copied out.
    assert sched.request_finished(v.Request("A", prompt), list(range(7))) \
        == (True, None)
    r = worker.step(sched.build_connector_meta(v.SchedulerOutput()), [],
                    await_sent=("A",))
    assert r["sent"] == ["A"], r
    probe = kvtier.StoreClient([store.address])
    ns = sched._scheduler.namespace
    hashes = kvtier.hash_tokens(ns, prompt)
    wait_until(lambda: probe.lookup(ns, hashes) >= 6,
               "A's blocks to be stored", timeout=10)

    # B: A's prompt and more: 6 blocks load into B's pages 10..15, in a
    # step of their own (asynchronously), before B computes the rest.
    longer = prompt + rng.integers(0, 4096, 30).tolist()
    n, r, _ = run_new(sched, worker, "B", longer, list(range(10, 19)), seeds)
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
    # page of it as failed (with the load's end, before vLLM could schedule
    # C); the connector has the store check its copies (the corrupt one is
    # dropped), and vLLM's recompute, from block 0, saves it again.
    needle = pages[2][0][0].numpy().tobytes()  # block 2, layer 0, K
    assert corrupt_in_store(store.pid, needle)
    n, r, meta = run_new(sched, worker, "C", prompt, list(range(20, 27)),
                         seeds)
    assert n == 6 * BS
    assert set(r["errors"]) == set(range(20, 26)), r
    assert any("DATA_LOSS" in f for f in r["failures"]), r["failures"]
    assert [(s.first_block, len(s.pages)) for s in meta.step.saves] \
        == [(0, 6)], "the recomputed blocks are saved again"
    again = worker.call(op="read", pages=[2, 22])
    assert (again[22][0] == again[2][0]).all(), "block 2 was recomputed"
    sched.request_finished(v.Request("C", prompt), list(range(20, 27)))
    # The recompute's blocks reached the store: D loads all six, intact.
    wait_until(lambda: probe.lookup(ns, hashes) >= 6,
               "block 2 to be saved again", timeout=10)
    n, r, _ = run_new(sched, worker, "D", prompt, list(range(30, 37)), seeds)
    assert n == 6 * BS and r["errors"] == [], r
    d = worker.call(op="read", pages=[2, 32])
    assert all((d[32][layer] == d[2][layer]).all() for layer in range(2))


def test_imports_without_vllm_and_refuses_a_config_without_stores() -> None:
    import kvtier.integrations.vllm as mod

    assert "KVConnectorBase_V1" in [c.__name__ for c in
                                     mod.KvtierConnector.__mro__]
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
    wait_until(lambda: probe.lookup(ns, kvtier.hash_tokens(ns, prompt)) >= 4,
               "the plain request's blocks to be stored", timeout=10)
    again = v.Request("again", prompt)
    assert matched(sched, again, 0) == (4 * BS, True)
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
    ``lookup_wait_ms`` has passed with the store SIGSTOPped; the client
    then skips the slow store for a while, so the next request's lookup
    answers 0 within a step instead of costing it the budget again. After
    the store answers again, hits come back."""
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
    assert first == (None, False), "asked in this step, sent at its end"
    assert matched(sched, v.Request("a", prompt), 0) == (4 * BS, True)

    def poll(rid: str) -> tuple[int, int, float]:
        """Steps until the request's answer: (tokens, steps, seconds)."""
        t0, steps = time.monotonic(), 0
        while True:
            n, _ = sched.get_num_new_matched_tokens(v.Request(rid, prompt), 0)
            steps += 1
            if n is not None:
                return n, steps, time.monotonic() - t0
            sched.build_connector_meta(v.SchedulerOutput())
            time.sleep(0.005)

    store.pause()
    try:
        n, steps, waited = poll("b")
        spared, _, spared_s = poll("c")
    finally:
        store.resume()
    assert n == 0 and steps > 1
    assert 0.2 <= waited < 1.0, waited
    assert spared == 0 and spared_s < 0.15, spared_s
    assert sched._scheduler.lookups_late == 1
    assert sched._scheduler.lookups_not_asked == 1
    # Counted for vLLM's /metrics (vllm:kvtier_lookups_total{outcome}),
    # each once.
    counts = taken(sched)
    assert (counts.get("lookups_answered"), counts.get("lookups_late"),
            counts.get("lookups_not_asked")) == (1, 1, 1), counts
    wait_until(lambda: matched(sched, v.Request("d", prompt), 0)[0] == 4 * BS,
               "hits to come back", timeout=10)
    counts = taken(sched)
    assert counts.get("lookups_answered", 0) >= 1, counts
    assert "lookups_late" not in counts, counts


def test_a_store_down_at_start_is_connected_when_it_comes(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The scheduler opens its store connection before requests come (a
    lookup nobody needs): a store down at start-up is said once in the log
    and tried every second until it answers; then the log says so, and a
    request's lookup pays no connection."""
    import logging

    from conftest import Store
    from vllm_server import free_port
    port = free_port()
    caplog.set_level(logging.INFO, logger="vllm.kvtier")
    sched = KvtierConnector(v.config([f"127.0.0.1:{port}"]),
                            KVConnectorRole.SCHEDULER)
    lookups = sched._scheduler._lookups
    assert lookups is not None
    wait_until(lambda: "could not be asked" in caplog.text,
               "the first failure said")
    assert not lookups.warm.is_set()
    store = Store(tmp_path, "late", port=port)
    try:
        assert lookups.warm.wait(30), caplog.text
        assert "the store answered its first lookup" in caplog.text
        assert caplog.text.count("could not be asked") == 1
    finally:
        sched.shutdown()
        store.stop()


LOG_CHILD = """
import logging, sys
# vLLM's logging, as an engine process has it configured before it makes
# its connector (here a handler with a mark of its own).
h = logging.StreamHandler(sys.stdout)
h.setFormatter(logging.Formatter("VLLM-HANDLER %(levelname)s %(message)s"))
logging.getLogger("vllm").addHandler(h)
sys.path.insert(0, sys.argv[2])
import vllm_shapes as v
from kvtier.integrations.vllm import KvtierConnector, KVConnectorRole
c = KvtierConnector(v.config([sys.argv[1]]), KVConnectorRole.SCHEDULER)
ours, theirs = logging.getLogger("kvtier"), logging.getLogger("vllm")
assert theirs.handlers, "vLLM configured no handler"
print("shared:", ours.handlers == theirs.handlers, flush=True)
logging.getLogger("kvtier.loads").warning("kvtier load of r: 0 of 4 loaded")
c.shutdown()
"""


def test_kvtiers_own_log_lines_reach_vllms_log(store) -> None:
    """A load that failed is said by an engine-neutral logger
    (``kvtier.loads``); in a process where vLLM configured its logging,
    the connector hands kvtier's loggers vLLM's handlers, so the line is
    in the engine's log with vLLM's (before, vLLM's worker processes
    dropped it: a TP engine's failed loads were nowhere in its log)."""
    r = subprocess.run([sys.executable, "-c", LOG_CHILD, store.address,
                        str(Path(__file__).parent)], env=engine_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout + r.stderr
    assert "shared: True" in r.stdout, out[-2000:]
    assert ("VLLM-HANDLER WARNING kvtier load of r: 0 of 4 loaded"
            in r.stdout), out[-2000:]


def test_a_burst_is_one_lookup_per_step_and_every_request_hits(
        two_stores) -> None:
    """64 new requests in one scheduler step (16 stored prefixes x 4
    suffixes) over two store shards: one batched lookup, and every request
    is offered its whole stored prefix in the next step; a request that
    arrives in a later step is a batch of its own."""
    stores = [s.address for s in two_stores]
    probe = kvtier.StoreClient(stores)
    sched = KvtierConnector(v.config(stores, lookup_wait_ms=5000),
                            KVConnectorRole.SCHEDULER)
    ns = sched._scheduler.namespace
    probe.register_namespace(ns)
    rng = np.random.default_rng(14)
    heads = [rng.integers(0, 4096, 8 * BS).tolist() for _ in range(16)]
    for h in heads:
        chain = kvtier.hash_tokens(ns, h)
        probe.put(ns, chain, np.ones(len(chain) * ns.block_bytes, np.uint8))
    reqs = [v.Request(f"r{i}-{j}", h + rng.integers(0, 4096, 20).tolist())
            for i, h in enumerate(heads) for j in range(4)]
    before = sched._scheduler.lookup_batches
    assert all(sched.get_num_new_matched_tokens(r, 0) == (None, False)
               for r in reqs)
    sched.build_connector_meta(v.SchedulerOutput())
    assert sched._scheduler.lookup_batches == before + 1
    got = [matched(sched, r, 0) for r in reqs]
    assert got == [(8 * BS, True)] * len(reqs)
    assert sched._scheduler.lookup_batches == before + 1
    late = v.Request("late", heads[0] + [1, 2, 3])
    assert matched(sched, late, 0) == (8 * BS, True)
    assert sched._scheduler.lookup_batches == before + 2


@pytest.mark.parametrize("extra, says", [
    ({"lookup_wait": 50}, '"lookup_wait" is not a kvtier setting'),
    ({"deadline_ms": "10s"}, '"deadline_ms" takes an integer'),
    ({"deadline_ms": 2.5}, '"deadline_ms" takes an integer'),
    ({"stores": 7400}, '"stores" takes kvtier-store addresses'),
    ({"stores": "localhost"}, "not HOST:PORT"),
    ({"lookup_wait_ms": -1}, '"lookup_wait_ms" takes a number'),
    ({"lookup_wait_ms": True}, '"lookup_wait_ms" takes a number'),
    ({"shared_memory": "yes"}, "'auto', 'on', 'off'"),
    ({"load_threads": 0}, '"load_threads" takes an integer from 1'),
    ({"handoff_wait_ms": 0}, '"handoff_wait_ms" takes a number'),
    ({"handoff_wait_ms": 700000}, '"handoff_wait_ms" takes a number'),
    ({"thread_cpus": "0;1"}, '"thread_cpus": \'0;1\' is not a CPU'),
    ({"thread_cpus": "0-65535"}, '"thread_cpus": CPUs .* are not this'),
    ({"thread_cpus": 3}, '"thread_cpus" takes a string'),
])
def test_a_bad_setting_is_refused_at_start_up_naming_its_key(
        extra: dict, says: str) -> None:
    """Every kvtier key of ``kv_connector_extra_config`` is checked when the
    connector is built (in vLLM, before the engine loads its model), with
    a message that names the key and what it takes; nothing is coerced."""
    cfg = v.config(["127.0.0.1:1"])
    cfg.kv_transfer_config.kv_connector_extra_config.update(extra)
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(kvtier.errors.InvalidArgument, match=says):
            KvtierConnector(cfg, role)


def test_a_failure_policy_it_cannot_serve_is_refused() -> None:
    """vLLM's default ``kv_load_failure_policy`` ("fail") would abort a
    request whose block the store lost between lookup and load: refused,
    naming the key and the value to set."""
    cfg = v.config(["127.0.0.1:1"])
    cfg.kv_transfer_config.kv_load_failure_policy = "fail"
    with pytest.raises(kvtier.errors.InvalidArgument,
                       match='"kv_load_failure_policy": "recompute"'):
        KvtierConnector(cfg, KVConnectorRole.SCHEDULER)


def planned_load(sched: KvtierConnector, store: Any, rid: str,
                 pages: list[int]) -> tuple[list[int], Any]:
    """A stored 4-block prompt looked up and given ``pages``: the step's
    plan, which loads it (AssertionError when the lookup did not offer
    it)."""
    probe = kvtier.StoreClient([store.address])
    ns = sched._scheduler.namespace
    prompt = np.random.default_rng(hash(rid) % 1000).integers(
        0, 4096, 70).tolist()
    hashes = kvtier.hash_tokens(ns, prompt)
    probe.register_namespace(ns)
    probe.put(ns, hashes, np.ones(len(hashes) * ns.block_bytes, np.uint8))
    req = v.Request(rid, prompt)
    assert matched(sched, req, 0) == (4 * BS, True)
    sched.update_state_after_alloc(req, v.KVCacheBlocks(pages), 4 * BS)
    return prompt, sched.build_connector_meta(v.SchedulerOutput())


def test_a_block_evicted_between_lookup_and_load_is_recomputed(
        store, worker) -> None:
    """The store answered the lookup, then lost the blocks (an operator's
    evict here; a writer filling it does the same): the load ends, and
    every page it could not fill is reported for vLLM to recompute; no
    request fails."""
    sched = KvtierConnector(v.config([store.address]),
                            KVConnectorRole.SCHEDULER)
    _, meta = planned_load(sched, store, "evicted", list(range(0, 5)))
    r = subprocess.run([str(BUILD / "cli" / "kvctl"), "evict", "--all",
                        "--yes", f"--store={store.address}"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr
    got = worker.step(pickle.loads(pickle.dumps(meta)), [])
    assert got["finished"] == ["evicted"], got
    assert got["errors"] == [0, 1, 2, 3], got
    # Counted for vLLM's /metrics (vllm:kvtier_load_failed_blocks_total).
    steps = [got]

    def failed_blocks() -> int:
        steps.append(worker.step(KvtierConnectorMetadata(), []))
        return sum(x["counts"].get("load_failed_blocks", 0) for x in steps)

    wait_until(lambda: failed_blocks() >= 4, "4 blocks counted not loaded",
               timeout=10)
    assert failed_blocks() == 4


def test_a_stalled_store_never_holds_a_step(store) -> None:
    """The store SIGSTOPped after the lookup answered, with the load
    planned: the step's hooks return at once (the load runs on a loader
    thread), and when the load's pin gives up at ``pin_wait_ms`` (500 ms
    here; issue #60: not the client's 10 s deadline) its pages are
    reported for recompute and the request is released; once the store
    answers again, loads succeed. The worker has loaded once before, as a
    serving engine has: its connections are up, so the stalled store holds
    the call (a first connection to a stopped store can instead fail at
    once, the handshake unanswered)."""
    worker = Worker([store.address], deadline_ms=10000, pin_wait_ms=500)
    try:
        stalled_store_holds_no_step(store, worker)
    finally:
        worker.stop()


def stalled_store_holds_no_step(store: Any, worker: Worker) -> None:
    sched = KvtierConnector(v.config([store.address]),
                            KVConnectorRole.SCHEDULER)
    _, meta = planned_load(sched, store, "warm", list(range(20, 25)))
    got = worker.step(pickle.loads(pickle.dumps(meta)), [])
    assert got["finished"] == ["warm"] and got["errors"] == [], got
    _, meta = planned_load(sched, store, "stalled", list(range(0, 5)))
    store.pause()
    try:
        got = worker.step(pickle.loads(pickle.dumps(meta)), [],
                          await_loads=False)
        assert got["step_seconds"] < 0.5, got
        assert got["finished"] == []
        t0 = time.monotonic()
        while "stalled" not in got["finished"]:
            assert time.monotonic() - t0 < 5, \
                "the load waited past pin_wait_ms (for the client's deadline)"
            got = worker.step(KvtierConnectorMetadata(), [],
                              await_loads=False)
            assert got["step_seconds"] < 0.5, got
            time.sleep(0.05)
    finally:
        store.resume()
    assert got["errors"] == [0, 1, 2, 3], got
    deadline = time.monotonic() + 20
    while True:
        # Until the clients probe the stalled shard again (shard skip), a
        # lookup may offer nothing, or a load fail: both are asked again.
        try:
            _, meta = planned_load(sched, store, f"back-{time.monotonic()}",
                                   list(range(10, 15)))
            got = worker.step(pickle.loads(pickle.dumps(meta)), [])
        except AssertionError as e:
            got = {"errors": [str(e)]}
        if got["errors"] == []:
            break
        assert time.monotonic() < deadline, got
        time.sleep(0.2)



def test_requests_sharing_a_prefix_load_it_once(store) -> None:
    """Two requests of one step share a stored prefix: the first loads it;
    the second waits (None) while that load runs, instead of moving the
    same blocks again, and is looked up afresh once the load ended (vLLM's
    prefix cache then holds the blocks). Without vLLM's prefix caching
    each request loads its own."""
    probe = kvtier.StoreClient([store.address])
    cfg = v.config([store.address])
    cfg.cache_config.enable_prefix_caching = True  # type: ignore[attr-defined]
    sched = KvtierConnector(cfg, KVConnectorRole.SCHEDULER)
    ns = sched._scheduler.namespace
    head = np.random.default_rng(15).integers(0, 4096, 64).tolist()
    probe.register_namespace(ns)
    chain = kvtier.hash_tokens(ns, head)
    probe.put(ns, chain, np.ones(len(chain) * ns.block_bytes, np.uint8))
    first = v.Request("first", head + [1, 2, 3])
    second = v.Request("second", head + [4, 5, 6])
    assert matched(sched, first, 0) == (4 * BS, True)
    sched.update_state_after_alloc(first, v.KVCacheBlocks([0, 1, 2, 3, 4]),
                                   4 * BS)
    for _ in range(3):  # steps while the first request's load runs
        assert sched.get_num_new_matched_tokens(second, 0) == (None, False)
        sched.build_connector_meta(v.SchedulerOutput())
    sched.update_connector_output(
        v.KVConnectorOutput(finished_recving={"first"}))
    # vLLM's prefix cache now holds the 4 blocks: nothing left to load.
    assert matched(sched, second, 4 * BS) == (0, False)
    # Without prefix caching there is nothing to wait for.
    plain = KvtierConnector(v.config([store.address]),
                            KVConnectorRole.SCHEDULER)
    a, b = v.Request("a", head + [7]), v.Request("b", head + [8])
    assert matched(plain, a, 0) == (4 * BS, True)
    plain.update_state_after_alloc(a, v.KVCacheBlocks([0, 1, 2, 3, 4]),
                                   4 * BS)
    assert matched(plain, b, 0) == (4 * BS, True)


# ------------------------------------------------ hybrid models (HMA)

def test_a_hybrid_models_plan_reaches_every_group() -> None:
    """The primary (full-attention) group's plan carried to a window
    group: its load covers only the non-null pages (the window's), its
    saves skip null pages; a group whose pages are not one run ending at
    the load's last block fails the request's load."""
    from kvtier.integrations.vllm_groups import GroupPlans, non_null_runs
    from kvtier.scheduler_half import LoadSpec, SaveSpec, StepMeta
    assert non_null_runs(4, [0, 0, 7, 8, 0, 9]) == [(6, [7, 8]), (9, [9])]
    plans = GroupPlans(groups=2, primary=1)
    hashes = np.zeros((10, 2), dtype=np.uint64)
    # Blocks 0-7 loaded: group 1 (full) pages 10-17, group 0 (window of 2
    # blocks) null but for the last two.
    plans.planned_load("r", 5, ([0] * 6 + [30, 31], list(range(10, 18))),
                       0, 8)
    plans.track("r", 5, ([0] * 6 + [30, 31, 32], list(range(10, 19))))
    step = StepMeta(loads=[LoadSpec(5, hashes, 0, list(range(10, 18)), "r")],
                    saves=[SaveSpec(5, hashes, 6, [16, 17, 18])],
                    finished=[9])
    groups, failed = plans.steps(step)
    assert failed == [] and groups[1] is step
    window = groups[0]
    assert [(s.skip_blocks, s.pages, s.name) for s in window.loads] == \
        [(6, [30, 31], "r")]
    assert [(s.first_block, s.pages) for s in window.saves] == \
        [(6, [30, 31, 32])]
    assert window.finished == [9]
    # Null pages inside the window group's range: never planned.
    plans.planned_load("q", 6, ([40, 0, 41], [50, 51, 52]), 0, 3)
    groups, failed = plans.steps(StepMeta(loads=[
        LoadSpec(6, hashes, 0, [50, 51, 52], "q")]))
    assert failed == ["q"] and groups[0].loads == []


def test_a_hybrid_requests_load_ends_with_its_last_group() -> None:
    from kvtier.integrations.vllm_groups import GroupLoads
    loads = GroupLoads()
    loads.expect("a", 2)
    loads.expect("b", 1)
    loads.expect("c", 0, failed=True)
    loads.ended("a", False)
    loads.ended("b", False)
    assert loads.done() == ({"b", "c"}, {"c"})
    loads.ended("a", True)
    assert loads.done() == ({"a"}, {"a"})
    assert loads.done() == (set(), set())


def test_group_kinds_kvtier_cannot_store_are_refused_by_name() -> None:
    from types import SimpleNamespace
    from kvtier.integrations.vllm_groups import group_kinds, primary_group
    window = type("SlidingWindowSpec", (), {"sliding_window": 4096})()
    full = type("FullAttentionSpec", (), {})()
    kc = SimpleNamespace(kv_cache_groups=[
        SimpleNamespace(kv_cache_spec=window),
        SimpleNamespace(kv_cache_spec=full)])
    kinds = group_kinds(kc)
    assert kinds == ["window=4096", "full"] and primary_group(kinds) == 1
    for name in ("MambaSpec", "ChunkedLocalAttentionSpec",
                 "CrossAttentionSpec"):
        kc.kv_cache_groups[1].kv_cache_spec = type(name, (), {})()
        with pytest.raises(kvtier.errors.InvalidArgument,
                           match=f"group 1 is a {name}"):
            group_kinds(kc)


# ------------------------------------------------ prefill/decode handoff

def decode_connector(store: Any, wait_ms: float = 5000) -> KvtierConnector:
    """A decode engine's scheduler-side connector (``kv_consumer``)."""
    cfg = v.config([store.address], handoff_wait_ms=wait_ms)
    cfg.kv_transfer_config.kv_role = "kv_consumer"
    return KvtierConnector(cfg, KVConnectorRole.SCHEDULER)


def stored(store: Any, ns: kvtier.Namespace, tokens: list[int],
           blocks: int) -> None:
    """Waits until the store holds the first ``blocks`` blocks of
    ``tokens``: saves are written behind the step."""
    probe = kvtier.StoreClient([store.address])
    hashes = kvtier.hash_tokens(ns, tokens)

    def held() -> int:
        try:
            have = probe.lookup(ns, hashes)
        except kvtier.errors.NotFound:
            have = 0
        return have if have >= blocks else 0

    wait_until(held, f"the store holds {blocks} blocks", timeout=10)


def test_a_prompt_logprobs_request_never_reads_the_store(store,
                                                        worker) -> None:
    """Issue #60: vLLM computes every prompt position of a request that
    asks for prompt logprobs (``skip_reading_prefix_cache``); the
    connector offers it nothing, though the store holds its prompt (an
    ordinary request of the same prompt is offered all of it)."""
    sched = KvtierConnector(v.config([store.address]),
                            KVConnectorRole.SCHEDULER)
    prompt = np.random.default_rng(41).integers(0, 4096, 100).tolist()
    run_new(sched, worker, "A", prompt, list(range(7)),
            {b: 700 + b for b in range(7)})
    sched.request_finished(v.Request("A", prompt), list(range(7)))
    stored(store, sched._scheduler.namespace, prompt, 6)
    plain = v.Request("plain", prompt)
    assert matched(sched, plain, 0) == (6 * BS, True)
    sched.request_finished(plain, [])
    scored = v.Request("scored", prompt, skip_reading_prefix_cache=True)
    assert sched.get_num_new_matched_tokens(scored, 0) == (0, False)
    sched.request_finished(scored, [])


def test_a_store_that_lost_an_engines_prefix_gets_it_back(store,
                                                          worker) -> None:
    """Issue #60: A computes and saves 6 blocks; the store loses them
    (``kvctl evict --all``, as after a restart). P, A's prompt and a tail
    whose first 6 blocks vLLM holds itself (A's pages), is looked up from
    its first block: the store holds none, so P's plan saves blocks 0..7
    from its pages (A's among them), its fence promises those 8 and no
    block it did not save, and the store holds all 8 again. A request
    whose whole prompt vLLM holds is not looked up: its fence promises
    nothing (nothing of it is on its way to the store)."""
    sched = KvtierConnector(v.config([store.address]),
                            KVConnectorRole.SCHEDULER)
    ns = sched._scheduler.namespace
    rng = np.random.default_rng(42)
    prompt = rng.integers(0, 4096, 100).tolist()
    seeds = {b: 800 + b for b in range(9)}
    run_new(sched, worker, "A", prompt, list(range(7)), seeds)
    sched.request_finished(v.Request("A", prompt), list(range(7)))
    stored(store, ns, prompt, 6)
    r = subprocess.run([str(BUILD / "cli" / "kvctl"), "evict", "--all",
                        "--yes", f"--store={store.address}"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr
    probe = kvtier.StoreClient([store.address])
    assert probe.lookup(ns, kvtier.hash_tokens(ns, prompt)) == 0

    longer = prompt[:6 * BS] + rng.integers(0, 4096, 34).tolist()
    req = v.Request("P", longer, kv_transfer_params={"do_remote_decode": True})
    assert matched(sched, req, 6 * BS) == (0, False)
    pages = list(range(6)) + [10, 11, 12]
    meta = sched.build_connector_meta(v.SchedulerOutput(
        scheduled_new_reqs=[v.NewRequestData("P", longer, (pages,), 6 * BS)],
        num_scheduled_tokens={"P": len(longer) - 6 * BS}))
    assert [(s.first_block, len(s.pages)) for s in meta.step.saves] \
        == [(0, 8)], "the blocks the store lost are saved again"
    worker.step(pickle.loads(pickle.dumps(meta)),
                [(10, seeds[6]), (11, seeds[7]), (12, seeds[8])])
    _, params = sched.request_finished(req, pages)
    assert params is not None and params["kvtier"]["blocks"] == 8
    stored(store, ns, longer, 8)

    # Whole prompt held by vLLM: no lookup, so no promise.
    again = v.Request("Q", prompt, kv_transfer_params={"do_remote_decode": True})
    assert sched.get_num_new_matched_tokens(again, 6 * BS) == (0, False)
    _, params = sched.request_finished(again, list(range(7)))
    assert params is not None and params["kvtier"]["blocks"] == 0


def taken(sched: KvtierConnector) -> dict[str, float]:
    """Every counter the connector gives vLLM now (since the last take)."""
    stats = sched.get_kv_connector_stats()
    return dict(stats.data) if stats is not None else {}


def counted(sched: KvtierConnector) -> dict[str, float]:
    """The handoff and save counters the connector gives vLLM now (its
    lookups by outcome, ``lookups_<outcome>``, taken and left out)."""
    return {k: v for k, v in taken(sched).items()
            if not k.startswith("lookups_")}


def test_a_prefill_hands_every_block_to_a_decode_through_the_store(
        store, worker) -> None:
    """A prefill asked with vLLM's ``remote_decoder`` (as kvtier-frontend
    asks, kvtier.integrations.pd) computes and saves its prompt, and
    ``request_finished`` returns the decode's keys (``remote_prefiller``,
    its kv_request_id) and the fence (its namespace and 6 blocks); a
    ``kv_consumer`` given those params loads all 6 (the prompt's last
    partial block is computed), counted ``loaded``, and plans no save of
    its own."""
    prefill = KvtierConnector(v.config([store.address]),
                              KVConnectorRole.SCHEDULER)
    prompt = np.random.default_rng(31).integers(0, 4096, 100).tolist()
    n, r, _ = run_new(prefill, worker, "P", prompt, list(range(7)),
                      {b: 500 + b for b in range(7)})
    assert n == 0 and r["errors"] == []
    req = v.Request("P", prompt, kv_transfer_params={
        "remote_decoder": {"kv_request_id": "kvtier-7"}})
    delay, params = prefill.request_finished(req, list(range(7)))
    ns = prefill._scheduler.namespace
    assert delay is True  # its pages held until its saves are copied out
    assert params == {"remote_prefiller": {"kv_request_id": "kvtier-7"},
                      "kvtier": {"namespace": f"{ns.id:016x}", "blocks": 6,
                                 "prompt_tokens": 100, "block_tokens": BS}}
    assert counted(prefill) == {"sent": 1}

    decode = decode_connector(store)
    got = matched(decode, v.Request("D", prompt, kv_transfer_params=params), 0)
    assert got == (6 * BS, True)
    c = counted(decode)
    assert c["loaded"] == 1 and "computed_blocks" not in c, c
    # A consumer computes the tail and saves nothing: the prefill pool does.
    out = v.SchedulerOutput(
        scheduled_new_reqs=[v.NewRequestData("E", prompt, (list(range(7)),), 0)],
        num_scheduled_tokens={"E": len(prompt)})
    assert decode.build_connector_meta(out).step.saves == []


def test_a_prefills_saves_get_the_handoff_budget_not_the_save_budget(
        store) -> None:
    """A prefill's saves are what its decode waits ``handoff_wait_ms``
    for: they are planned with that budget (the save lane drops a copy not
    started within its budget, and a first copy on a busy engine can start
    past ``save_budget_ms``), an ordinary request's with the worker's."""
    sched = KvtierConnector(v.config([store.address], handoff_wait_ms=7000),
                            KVConnectorRole.SCHEDULER)
    rng = np.random.default_rng(38)
    reqs = [v.Request("P", rng.integers(0, 4096, 100).tolist(),
                      kv_transfer_params={
                          "remote_decoder": {"kv_request_id": "kvtier-8"}}),
            v.Request("O", rng.integers(0, 4096, 100).tolist())]
    for i, req in enumerate(reqs):
        assert matched(sched, req, 0) == (0, False)
        sched.update_state_after_alloc(
            req, v.KVCacheBlocks(list(range(7 * i, 7 * i + 7))), 0)
    out = v.SchedulerOutput(
        scheduled_new_reqs=[
            v.NewRequestData(r.request_id, r.prompt_token_ids,
                             (list(range(7 * i, 7 * i + 7)),), 0)
            for i, r in enumerate(reqs)],
        num_scheduled_tokens={r.request_id: 100 for r in reqs})
    saves = {s.request: s.budget_ms
             for s in sched.build_connector_meta(out).step.saves}
    assert saves == {request_key("P"): 7000, request_key("O"): None}


def test_save_policy_seen_twice_saves_only_prefixes_an_earlier_prompt_had(
        store) -> None:
    """``save_policy: seen_twice``: a prompt no earlier one shared is not
    saved (its 6 full blocks counted ``unseen``); a later prompt sharing its
    first 4 blocks saves those 4 and not its own last 2; a prefill's prompt
    (its decode waits for it) is saved whole though new. The default saves
    every block; an unknown policy is refused naming the key."""
    sched = KvtierConnector(v.config([store.address], handoff_wait_ms=7000,
                                     save_policy="seen_twice"),
                            KVConnectorRole.SCHEDULER)
    rng = np.random.default_rng(39)
    first = rng.integers(0, 4096, 100).tolist()  # 6 full blocks
    later = first[:4 * BS] + rng.integers(0, 4096, 100 - 4 * BS).tolist()
    reqs = [v.Request("A", first), v.Request("B", later),
            v.Request("P", rng.integers(0, 4096, 100).tolist(),
                      kv_transfer_params={
                          "remote_decoder": {"kv_request_id": "kvtier-9"}})]
    planned = {}
    for i, req in enumerate(reqs):
        assert matched(sched, req, 0) == (0, False)
        pages = list(range(7 * i, 7 * i + 7))
        sched.update_state_after_alloc(req, v.KVCacheBlocks(pages), 0)
        out = v.SchedulerOutput(
            scheduled_new_reqs=[v.NewRequestData(req.request_id,
                                                 req.prompt_token_ids,
                                                 (pages,), 0)],
            num_scheduled_tokens={req.request_id: 100})
        planned.update({s.request: s.pages for s in
                        sched.build_connector_meta(out).step.saves})
    assert planned == {request_key("B"): [7, 8, 9, 10],
                       request_key("P"): list(range(14, 20))}, planned
    assert counted(sched)["save_skipped_unseen"] == 6 + 2
    assert KvtierConnector(v.config([store.address]),
                           KVConnectorRole.SCHEDULER
                           )._scheduler.save_policy.name == "all"
    with pytest.raises(kvtier.errors.InvalidArgument, match="save_policy"):
        KvtierConnector(v.config([store.address], save_policy="twice"),
                        KVConnectorRole.SCHEDULER)


def test_a_decode_waits_on_the_fence_for_writes_still_on_their_way(
        store) -> None:
    """The decode asks before the prefill's blocks are in the store (the
    writes race the decode's lookup): it answers None (vLLM asks again a
    step later) until all 6 are there, 0.4 s later here, then loads them
    all; it never loads a partial prefix while the fence is unmet."""
    decode = decode_connector(store)
    ns = decode._scheduler.namespace
    prompt = np.random.default_rng(32).integers(0, 4096, 100).tolist()
    hashes = kvtier.hash_tokens(ns, prompt)
    params = producer_params(ns.id, 6, 100, BS, "h1")  # a prefill's fence
    probe = kvtier.StoreClient([store.address])
    probe.register_namespace(ns)
    # The first three land at once, the rest 0.4 s later.
    probe.put(ns, hashes[:3], np.ones(3 * ns.block_bytes, np.uint8))
    req = v.Request("D", prompt, kv_transfer_params=params)
    t0 = time.monotonic()
    wrote = None
    while True:
        got = decode.get_num_new_matched_tokens(req, 0)
        if got[0] is not None:
            break
        if wrote is None and time.monotonic() - t0 > 0.4:
            probe.put(ns, hashes[3:6], np.ones(3 * ns.block_bytes, np.uint8))
            wrote = time.monotonic() - t0
        assert time.monotonic() - t0 < 10, "the fence was never met"
        decode.build_connector_meta(v.SchedulerOutput())
        time.sleep(0.001)
    assert wrote is not None and got == (6 * BS, True)
    c = counted(decode)
    assert c["loaded"] == 1 and c["wait_seconds"] >= 0.4, c


def test_a_decode_given_only_vllms_keys_waits_for_the_whole_prompt(
        store) -> None:
    """A prefill that answered no params (vLLM's offloading connector with
    kvtier's tier: kvtier.integrations.pd): the frontend sends the decode
    vLLM's ``remote_prefiller`` keys alone. The connector waits until the
    store holds the prompt's whole blocks in its own namespace (not a
    prefix of them: 3 of 6 are there at first), then loads all 6."""
    decode = decode_connector(store)
    ns = decode._scheduler.namespace
    prompt = np.random.default_rng(36).integers(0, 4096, 100).tolist()
    hashes = kvtier.hash_tokens(ns, prompt)
    probe = kvtier.StoreClient([store.address])
    probe.register_namespace(ns)
    probe.put(ns, hashes[:3], np.ones(3 * ns.block_bytes, np.uint8))
    req = v.Request("D", prompt, kv_transfer_params={
        "remote_prefiller": {"kv_request_id": "kvtier-9"}})
    def ask() -> tuple:
        got = decode.get_num_new_matched_tokens(req, 0)
        decode.build_connector_meta(v.SchedulerOutput())
        return got

    # Five lookups answered "3 of 6": each leaves the request waiting.
    first = decode._scheduler.lookup_batches

    def five_lookups_waited() -> bool:
        assert ask() == (None, False), "loaded a prefix of the prompt"
        return decode._scheduler.lookup_batches >= first + 5

    wait_until(five_lookups_waited, "five lookups of the half-stored prompt")
    probe.put(ns, hashes[3:6], np.ones(3 * ns.block_bytes, np.uint8))
    got = wait_until(lambda: (lambda g: g if g[0] is not None else None)(
        ask()), "the prompt's blocks to be met", timeout=10)
    assert got == (6 * BS, True)
    assert counted(decode)["loaded"] == 1


def test_a_decode_on_a_fence_asks_the_store_for_its_budget_not_lookup_wait(
        store) -> None:
    """On a busy host a first lookup can miss ``lookup_wait_ms``, and the
    client then skips the shard for longer at each miss: a decode waiting
    on a fence (the cluster saw "0 of 37 blocks after 5004 ms") gives its
    lookups the rest of its handoff budget instead, in a batch of their
    own. The store stalled for 0.4 s (8x lookup_wait_ms): the decode's one
    lookup is answered and it loads all 6 blocks; an ordinary request
    asked in the same step is late, as its 50 ms budget says."""
    cfg = v.config([store.address], handoff_wait_ms=5000, lookup_wait_ms=50)
    cfg.kv_transfer_config.kv_role = "kv_consumer"
    decode = KvtierConnector(cfg, KVConnectorRole.SCHEDULER)
    ns = decode._scheduler.namespace
    rng = np.random.default_rng(37)
    prompt, other = (rng.integers(0, 4096, 100).tolist() for _ in range(2))
    probe = kvtier.StoreClient([store.address])
    probe.register_namespace(ns)
    for tokens in (prompt, other):
        hashes = kvtier.hash_tokens(ns, tokens)
        probe.put(ns, hashes[:6], np.ones(6 * ns.block_bytes, np.uint8))
    req = v.Request("D", prompt, kv_transfer_params=producer_params(
        ns.id, 6, 100, BS, "h2"))
    plain = v.Request("P", other)
    first = decode._scheduler.lookup_batches
    store.pause()
    try:
        assert decode.get_num_new_matched_tokens(req, 0) == (None, False)
        assert decode.get_num_new_matched_tokens(plain, 0) == (None, False)
        decode.build_connector_meta(v.SchedulerOutput())
        assert decode._scheduler.lookup_batches == first + 2
        resume = time.monotonic() + 0.4
        wait_until(lambda: time.monotonic() >= resume, "the stall", 5)
    finally:
        store.resume()
    assert matched(decode, plain, 0) == (0, False)
    assert matched(decode, req, 0) == (6 * BS, True)
    assert decode._scheduler.lookup_batches == first + 2, "asked again"
    assert decode._scheduler.lookups_late == 1
    assert counted(decode)["loaded"] == 1


def test_a_fence_never_met_is_waited_for_its_budget_then_computed(
        store) -> None:
    """A handoff whose blocks never reach the store (the prefill died):
    the decode waits its budget (300 ms), then computes the prompt, and
    says so: ``computed``, 6 blocks computed, the wait counted."""
    decode = decode_connector(store, wait_ms=300)
    ns = decode._scheduler.namespace
    prompt = np.random.default_rng(33).integers(0, 4096, 100).tolist()
    params = producer_params(ns.id, 6, 100, BS, "h1")  # a prefill's fence
    t0 = time.monotonic()
    got = matched(decode, v.Request("D", prompt, kv_transfer_params=params), 0)
    took = time.monotonic() - t0
    assert got == (0, False)
    assert 0.3 <= took < 2.0, took
    c = counted(decode)
    assert c["computed"] == 1 and c["computed_blocks"] == 6, c
    assert 0.3 <= c["wait_seconds"] < 2.0, c


def test_a_fence_on_a_store_that_cannot_be_reached_is_computed_at_once(
        store) -> None:
    """The store stopped (its port refuses): the prefill's writes cannot
    land there, so a decode waiting on a fence computes the prompt at its
    first refused lookup instead of waiting out its 5 s budget; it says
    why, and counts ``computed`` and the 6 blocks."""
    decode = decode_connector(store, wait_ms=5000)
    ns = decode._scheduler.namespace
    prompt = np.random.default_rng(38).integers(0, 4096, 100).tolist()
    params = producer_params(ns.id, 6, 100, BS, "h3")
    store.stop()
    t0 = time.monotonic()
    got = matched(decode, v.Request("D", prompt, kv_transfer_params=params), 0)
    took = time.monotonic() - t0
    assert got == (0, False)
    assert took < 2.0, took
    c = counted(decode)
    assert c["computed"] == 1 and c["computed_blocks"] == 6, c
    assert decode._scheduler.store_unreachable(request_key("D"))


@pytest.mark.parametrize("entry, outcome", [
    ({"namespace": "not-hex", "blocks": 6}, "invalid"),
    ({"namespace": "00", "blocks": -1}, "invalid"),
    ({"namespace": "00", "blocks": 6, "block_tokens": 32}, "invalid"),
    ({"namespace": "00", "blocks": 6, "prompt_tokens": 99}, "invalid"),
    ({"namespace": "00", "blocks": 9}, "invalid"),
    ({"namespace": "0123456789abcdef", "blocks": 6}, "other_namespace"),
])
def test_handoff_params_that_cannot_be_used_serve_the_request_as_usual(
        store, entry: dict, outcome: str) -> None:
    """Malformed params, or another deployment's namespace: the request is
    looked up as any other (it waits for no fence), and the reason is
    counted."""
    decode = decode_connector(store)
    prompt = np.random.default_rng(34).integers(0, 4096, 100).tolist()
    full = {"prompt_tokens": 100, "block_tokens": BS, **entry}
    req = v.Request("D", prompt, kv_transfer_params={"kvtier": full})
    t0 = time.monotonic()
    assert matched(decode, req, 0) == (0, False)
    assert time.monotonic() - t0 < 1.0
    assert counted(decode) == {outcome: 1}


def test_a_prefill_whose_store_did_not_answer_hands_nothing_on() -> None:
    """The store is unreachable (nothing listens): the prefill's lookup
    fails, so its saves would not land either; ``request_finished``
    returns no fence (a decode would wait its budget for nothing) but says
    so, for the frontend to serve the request colocated, and counts
    ``not_sent``."""
    prefill = KvtierConnector(v.config(["127.0.0.1:1"], deadline_ms=500),
                              KVConnectorRole.SCHEDULER)
    prompt = np.random.default_rng(35).integers(0, 4096, 100).tolist()
    req = v.Request("P", prompt, kv_transfer_params={"do_remote_decode": True})
    assert matched(prefill, req, 0) == (0, False)
    assert prefill.request_finished(req, list(range(7))) == (False, {
        "kvtier": {"not_sent": "the prefill's store did not answer its "
                               "lookup"}})
    assert counted(prefill) == {"not_sent": 1}


def test_a_prefill_whose_store_is_slow_still_hands_on(store) -> None:
    """The store SIGSTOPped: one prefill's lookup misses its budget (late)
    and the next one's is not sent (the client skips the slow store for a
    while). A slow store is not a down one: it still takes the saves, and
    a decode waits on the fence for them, so both prefills return their
    fence and count ``sent``, none ``not_sent`` (seen under CI's load: a
    busy host's store missed a 100 ms budget, and the frontend's prefill
    engine then handed nothing on and was skipped for 10 s)."""
    prefill = KvtierConnector(v.config([store.address], lookup_wait_ms=200),
                              KVConnectorRole.SCHEDULER)
    ns = prefill._scheduler.namespace
    kvtier.StoreClient([store.address]).register_namespace(ns)
    rng = np.random.default_rng(36)
    assert matched(prefill, v.Request("warm", rng.integers(0, 4096, 64).tolist()),
                   0) == (0, False)
    reqs = [v.Request(rid, rng.integers(0, 4096, 100).tolist(),
                      kv_transfer_params={"do_remote_decode": True})
            for rid in ("late", "skipped")]
    store.pause()
    try:
        for r in reqs:
            assert matched(prefill, r, 0) == (0, False)
    finally:
        store.resume()
    assert prefill._scheduler.lookups_late == 1
    assert prefill._scheduler.lookups_not_asked == 1
    for r in reqs:
        delay, params = prefill.request_finished(r, list(range(4)))
        assert params is not None and "kvtier" in params, (r.request_id, params)
    assert counted(prefill) == {"sent": 2}


def test_saves_are_copied_behind_the_step_and_a_finish_waits_for_them(
        store, worker) -> None:
    """Issue #64. The step hands its saves to the connector's save lane
    and returns: every copy of a block out of the pages runs on the lane's
    thread and ends after ``wait_for_save`` returned. ``request_finished``
    asks vLLM to keep the request's pages (``delay_free_blocks``); the next
    step's plan names it held, the worker reports it in
    ``finished_sending`` once its copies ended, and the scheduler lets go
    of it. The blocks reach the store, and the worker counts them written
    (``store_written_blocks``, none ``store_refused_blocks``)."""
    sched = KvtierConnector(v.config([store.address]),
                            KVConnectorRole.SCHEDULER)
    prompt = np.random.default_rng(41).integers(0, 4096, 100).tolist()
    n, r, _ = run_new(sched, worker, "A", prompt, list(range(7)),
                      {b: 700 + b for b in range(7)}, await_copies=1)
    steps = [r]
    assert n == 0 and r["errors"] == []
    assert len(r["copies"]) == 1, r["copies"]
    for thread, after_step in r["copies"]:
        assert thread == "kvtier-save", r["copies"]
        assert after_step >= 0, "a copy ended before the step did"
    assert sched.request_finished(v.Request("A", prompt), list(range(7))) \
        == (True, None)
    meta = sched.build_connector_meta(v.SchedulerOutput())
    assert list(meta.step.held.values()) == ["A"]
    r = worker.step(pickle.loads(pickle.dumps(meta)), [], await_sent=("A",))
    steps.append(r)
    assert r["sent"] == ["A"], r
    assert sched._held == {"A": 7}
    sched.update_connector_output(v.KVConnectorOutput(finished_sending={"A"}))
    assert sched._held == {}
    ns = sched._scheduler.namespace
    probe = kvtier.StoreClient([store.address])
    wait_until(lambda: probe.lookup(ns, kvtier.hash_tokens(ns, prompt)) >= 6,
               "A's blocks to be stored", timeout=10)

    def written() -> int:
        steps.append(worker.step(pickle.loads(pickle.dumps(
            sched.build_connector_meta(v.SchedulerOutput()))), []))
        return sum(x["counts"].get("store_written_blocks", 0) for x in steps)

    wait_until(lambda: written() >= 6, "6 blocks counted written", timeout=10)
    assert written() == 6
    assert not any("store_refused_blocks" in x["counts"] for x in steps)


def test_a_stalled_store_costs_saves_never_steps_and_pages_come_back(
        store) -> None:
    """Issue #64. The store SIGSTOPped, 2 blocks of staging, a 1.5 s save
    budget and 12 blocks of copy queue: A's step returns at once (its copy
    waits for staging on the lane, not on the step); B's save, queued
    behind it, is dropped when vLLM preempts B (``released``, before the
    next forward); C's 12 blocks are more than the queue takes
    (``behind``); A's copy gives up within its budget (``store_behind``)
    and A, finished, is reported sent: its pages come back. B, resumed
    once the store answers again, is copied out whole."""
    w = Worker([store.address], staging_blocks=2, save_budget_ms=1500,
               save_queue_blocks=12, deadline_ms=20000)
    try:
        sched = KvtierConnector(
            v.config([store.address], save_budget_ms=1500,
                     save_queue_blocks=12, staging_blocks=2),
            KVConnectorRole.SCHEDULER)
        rng = np.random.default_rng(43)
        a, b, c = (rng.integers(0, 4096, n).tolist() for n in (100, 100, 200))
        reqs = {rid: v.Request(rid, p) for rid, p in
                (("A", a), ("B", b), ("C", c))}
        pages = {"A": list(range(0, 7)), "B": list(range(7, 14)),
                 "C": list(range(14, 27))}
        for rid, req in reqs.items():
            assert matched(sched, req, 0) == (0, False)
            sched.update_state_after_alloc(req, v.KVCacheBlocks(pages[rid]),
                                           0)
        # The worker process up (it answers only once its connector has
        # registered with the store): on a busy host it could otherwise
        # connect after the pause, and its puts fail instead of stalling.
        w.step(KvtierConnectorMetadata(), [])
        store.pause()
        try:
            out = v.SchedulerOutput(
                scheduled_new_reqs=[v.NewRequestData(rid, req.prompt_token_ids,
                                                     (pages[rid],), 0)
                                    for rid, req in reqs.items()],
                num_scheduled_tokens={rid: len(req.prompt_token_ids)
                                      for rid, req in reqs.items()})
            compute = [(p, 900 + p) for rid in reqs for p in pages[rid]]
            r = w.step(pickle.loads(pickle.dumps(
                sched.build_connector_meta(out))), compute)
            assert r["step_seconds"] < 0.5, r["step_seconds"]
            assert r["counts"].get("save_skipped_behind") == 12, r["counts"]
            # The next step preempts B, and A finishes.
            assert sched.request_finished(reqs["A"], pages["A"]) \
                == (True, None)
            meta = sched.build_connector_meta(
                v.SchedulerOutput(preempted_req_ids={"B"}))
            r = w.step(pickle.loads(pickle.dumps(meta)), [],
                       await_sent=("A",))
            assert r["sent"] == ["A"], r
            assert r["sent_after"] < 3, r["sent_after"]
            assert r["step_seconds"] < 0.5, r["step_seconds"]
            counts = r["counts"]
            assert counts.get("save_skipped_released") == 6, counts
            # A's copy: staged whole (the offloader's sends to the stopped
            # store failed, freeing staging) or given up waiting for it.
            assert counts.get("saved_blocks", 0) + counts.get(
                "save_skipped_store_behind", 0) == 6, counts
        finally:
            store.resume()
        # B resumes on new pages: asked afresh, the store holds none of
        # it, so its 6 blocks are copied out of them (not skipped as a gap
        # behind the copies its preemption dropped).
        assert matched(sched, reqs["B"], 0) == (0, False)
        # The worker's puts held by the stop end first (they free the
        # staging B's copy needs; on a busy host that can take seconds).
        wait_until(lambda: w.call(op="stats")["offload_blocks_in_flight"]
                   == 0, "the puts to the stopped store to end", 30)
        moved = list(range(30, 37))
        sched.update_state_after_alloc(reqs["B"], v.KVCacheBlocks(moved), 0)
        meta = sched.build_connector_meta(v.SchedulerOutput(
            scheduled_cached_reqs=v.CachedRequestData(
                req_ids=["B"], resumed_req_ids={"B"},
                new_block_ids=[(moved,)], num_computed_tokens=[0]),
            num_scheduled_tokens={"B": 100}))
        r = w.step(pickle.loads(pickle.dumps(meta)),
                   [(p, 950 + p) for p in moved], await_copies=1)
        # (Whether the store then takes them is the client's shard skip:
        # it probes a shard that failed again within shard_skip_max_ms.)
        assert r["counts"].get("saved_blocks") == 6, r["counts"]
    finally:
        w.stop()


@pytest.mark.parametrize("setting", ["other", "inherit"])
def test_kvtiers_threads_keep_off_the_cores_vllm_computes_on(
        store, setting: str) -> None:
    """Issue #64. vLLM's CPU build binds a worker's main thread, its
    OpenMP master, to the worker's compute cores, and a thread starts with
    its creator's binding. With ``thread_cpus`` naming another core (what
    "auto" takes from vLLM's reserved list) every thread kvtier's
    connector starts in the worker (the C++ offloaders, committers and
    data plane, the save lane, the closer, the loaders) runs there,
    through a save, a finish and a load; the main thread keeps its own.
    So do the scheduler's lookup threads (vLLM's scheduler process binds
    nothing, so they would otherwise wake on any core, the compute cores
    among them). With "inherit" they all keep their creator's binding."""
    from kvtier.cpus import process_cpus
    cpus = process_cpus()
    if len(cpus) < 2:
        pytest.skip(f"one CPU ({sorted(cpus)}): nothing could be spare")
    compute = min(cpus)
    if setting == "other":
        setting = str(max(cpus))
    w = Worker([store.address], compute_cpus=str(compute),
               thread_cpus=setting)
    sched = None
    try:
        sched = KvtierConnector(v.config([store.address],
                                         thread_cpus=setting),
                                KVConnectorRole.SCHEDULER)
        prompt = np.random.default_rng(47).integers(0, 4096, 100).tolist()
        seeds = {b: 300 + b for b in range(7)}
        n, r, _ = run_new(sched, w, "A", prompt, list(range(7)), seeds,
                          await_copies=1)
        assert n == 0 and len(r["copies"]) == 1, r
        assert sched.request_finished(v.Request("A", prompt),
                                      list(range(7))) == (True, None)
        meta = sched.build_connector_meta(v.SchedulerOutput())
        assert w.step(pickle.loads(pickle.dumps(meta)), [],
                      await_sent=("A",))["sent"] == ["A"]
        probe = kvtier.StoreClient([store.address])
        ns = sched._scheduler.namespace
        wait_until(lambda: probe.lookup(ns, kvtier.hash_tokens(ns, prompt))
                   >= 6, "A's blocks to be stored", timeout=10)
        n, r, _ = run_new(sched, w, "B", prompt, list(range(7, 14)), seeds)
        assert n == 6 * BS and r["errors"] == [], r
        threads = w.call(op="threads")
        lookups = {t.name: sorted(os.sched_getaffinity(t.native_id))
                   for t in sched._scheduler._lookups._pool._threads
                   if t.is_alive() and t.native_id is not None}
    finally:
        w.stop()
        if sched is not None:  # its bound threads end (bound_cpus counts)
            sched.shutdown()
    assert lookups, "the scheduler's lookups ran on no thread of kvtier's"
    here = sorted(os.sched_getaffinity(0))
    assert set(map(tuple, lookups.values())) == {
        tuple(here) if setting == "inherit" else (max(cpus),)}, lookups
    assert threads["main"] == [compute]
    started = threads["started"].values()
    assert len(started) >= 4, threads  # lane, offloader, committer, loader
    want = [compute] if setting == "inherit" else [max(cpus)]
    assert {name: on for name, on in started if on != want} == {}, threads


def test_a_step_with_nothing_to_compute_waits_for_its_lookups(store) -> None:
    """A step that schedules nothing (its new request waits on its
    lookup) waits at its end, in ``build_connector_meta``, for the lookup
    it sent, ``IDLE_LOOKUP_WAIT_S`` at most: the next step has the answer,
    where vLLM used to step empty steps as fast as it could (they kept the
    lookup's threads from the interpreter; a cold request's first step
    came 12 ms late). With the store SIGSTOPped it waits that bound, not
    the lookup's budget."""
    from kvtier.integrations.vllm import IDLE_LOOKUP_WAIT_S
    sched = KvtierConnector(v.config([store.address], lookup_wait_ms=5000),
                            KVConnectorRole.SCHEDULER)
    rng = np.random.default_rng(53)
    ask = [v.Request(f"r{i}", rng.integers(0, 4096, 100).tolist())
           for i in range(3)]
    assert matched(sched, ask[0], 0) == (0, False)  # connected
    assert sched.get_num_new_matched_tokens(ask[1], 0) == (None, False)
    t = time.monotonic()
    sched.build_connector_meta(v.SchedulerOutput())
    took = time.monotonic() - t
    answer = sched.get_num_new_matched_tokens(ask[1], 0)
    assert answer == (0, False) or took >= IDLE_LOOKUP_WAIT_S, (answer, took)
    store.pause()
    try:
        assert sched.get_num_new_matched_tokens(ask[2], 0) == (None, False)
        t = time.monotonic()
        sched.build_connector_meta(v.SchedulerOutput())
        took = time.monotonic() - t
    finally:
        store.resume()
    assert IDLE_LOOKUP_WAIT_S <= took < IDLE_LOOKUP_WAIT_S + 0.5, took
