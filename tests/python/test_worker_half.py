"""kvtier.worker_half.WorkerHalf ordered against an engine's stream, and a
load whose request finishes before the load begins (issue #60).

On a GPU the engine launches work on its stream and returns before it is
done; kvtier copies on streams of its own. :class:`EngineStream` is that
on the CPU: work launched on it runs later, in order, on a thread of its
own, and its fence (what a ``torch.cuda.Event`` recorded on the engine's
current stream is on a GPU) returns from ``synchronize()`` once the work
launched before it is done. Real connectors over host tensors, a real
kvtier-store."""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import Any, Callable, Optional

import numpy as np
import pytest
import torch

import kvtier
import kvtier.cpus
from kvtier.save_lane import SaveLane
from kvtier.scheduler_half import LoadSpec, SaveSpec, StepMeta
from kvtier.worker_half import WorkerHalf
from conftest import wait_until

SPEC = dict(model="py-order", dtype="fp16", layers=2, kv_heads=2,
            head_dim=32, block_tokens=16)
PAGES = 8


class EngineStream:
    """Work in launch order on a thread of its own (module docstring)."""

    def __init__(self) -> None:
        self._work: queue.Queue[Optional[Callable[[], None]]] = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            fn = self._work.get()
            if fn is None:
                return
            fn()

    def launch(self, fn: Callable[[], None]) -> None:
        self._work.put(fn)

    def fence(self) -> threading.Event:
        """A fence after the work launched so far (``synchronize()`` waits
        for it)."""
        done = threading.Event()
        done.synchronize = done.wait  # type: ignore[attr-defined]
        self._work.put(done.set)
        return done

    def close(self) -> None:
        self._work.put(None)
        self._thread.join()


def caches(fill: float) -> list[torch.Tensor]:
    return [torch.full((2, PAGES, 16, 2, 32), fill).half() for _ in range(2)]


def write(cache: list[torch.Tensor], pages: list[int], value: float,
          after_s: float) -> Callable[[], None]:
    """Engine work: ``after_s`` of compute, then ``value`` into ``pages``."""
    def run() -> None:
        time.sleep(after_s)
        for layer in cache:
            layer[:, pages] = value
    return run


def stored_blocks(store) -> tuple[kvtier.Namespace, np.ndarray]:
    """Two blocks of 5.0s saved into the store, and their hashes."""
    ns = kvtier.Namespace(**SPEC)
    hashes = kvtier.hash_tokens(ns, list(range(2 * 16)))
    writer = kvtier.Connector(ns, caches(5.0), stores=[store.address])
    writer.lookup(1, hashes)
    writer.save(1, 0, [0, 1])
    writer.wait_for_save(1)
    writer.finished(1)
    writer.close()
    return ns, hashes


def test_a_save_copies_the_pages_the_forward_wrote(store) -> None:
    """The save is called right after the forward is launched (as vLLM
    calls wait_for_save): the store gets the forward's bytes, not the
    pages' bytes from before it."""
    ns = kvtier.Namespace(**SPEC)
    engine, stream = caches(1.0), EngineStream()
    half = WorkerHalf(kvtier.Connector(ns, engine, stores=[store.address]),
                      stream_fence=stream.fence)
    hashes = kvtier.hash_tokens(ns, list(range(2 * 16)))
    try:
        stream.launch(write(engine, [3, 4], 7.0, after_s=0.3))
        half.wait_for_save(StepMeta(saves=[SaveSpec(1, hashes, 0, [3, 4])],
                                    finished=[1]))
        half.close()
    finally:
        stream.close()
    other = caches(0.0)
    reader = kvtier.Connector(ns, other, stores=[store.address])

    def held() -> int:
        blocks = reader.lookup(2, hashes).blocks
        if blocks < 2:
            reader.finished(2)
            return 0
        return blocks

    wait_until(held, "the save reaches the store")
    reader.start_load(2, [0, 1])
    assert reader.wait_for_load(2) == 2
    reader.finished(2)
    reader.close()
    for layer in other:
        assert bool((layer[:, 0:2] == 7.0).all()), \
            "the save copied the pages before the forward wrote them"


def test_a_load_lands_after_the_engines_own_writes_to_its_pages(
        store) -> None:
    """The engine launches its own writes to the pages it gave a load
    (vLLM zeroing new blocks) and then starts the load: the loaded bytes
    are what the pages hold when the load is reported ended."""
    ns, hashes = stored_blocks(store)
    engine, stream = caches(1.0), EngineStream()
    half = WorkerHalf(kvtier.Connector(ns, engine, stores=[store.address]),
                      stream_fence=stream.fence)
    try:
        stream.launch(write(engine, [2, 3], 0.0, after_s=0.3))
        half.start_loads(StepMeta(loads=[LoadSpec(2, hashes, 0, [2, 3],
                                                  "r2")]))
        ended = wait_until(half.ended_loads, "the load ends")
        assert ended == [("r2", [])]
        for layer in engine:
            assert bool((layer[:, 2:4] == 5.0).all()), \
                "the engine's earlier writes landed over the loaded bytes"
        half.finished(2)
        half.close()
    finally:
        stream.close()


def test_a_request_finished_before_its_load_began_is_not_loaded(
        store) -> None:
    """One loader thread, held by a first load; the second request is
    finished (vLLM aborted it) while its load waits: the load is reported
    ended with every page failed, writes none of them, and leaves the
    request closed."""
    ns, hashes = stored_blocks(store)
    engine = caches(1.0)
    gate = threading.Event()

    class Held:
        """A fence that holds the loader thread until the gate opens."""

        def synchronize(self) -> None:
            gate.wait(10)

    half = WorkerHalf(kvtier.Connector(ns, engine, stores=[store.address]),
                      load_threads=1, stream_fence=Held)
    half.start_loads(StepMeta(loads=[LoadSpec(2, hashes, 0, [0, 1], "r2")]))
    half.start_loads(StepMeta(loads=[LoadSpec(3, hashes, 0, [4, 5], "r3")]))
    half.finished(3)
    gate.set()
    ended: dict[str, list[int]] = {}

    def both() -> dict[str, list[int]]:
        ended.update(dict(half.ended_loads()))
        return ended if len(ended) == 2 else {}

    assert wait_until(both, "both loads end") == {"r2": [], "r3": [4, 5]}
    for layer in engine:
        assert bool((layer[:, 4:6] == 1.0).all()), "an aborted load wrote"
    half.finished(2)
    half.close()
    assert half._open == set()


# ------------------------------------------------------------ the save lane


def test_the_save_lane_copies_in_order_and_closes_a_request_after_them(
        ) -> None:
    """Copies run on the lane's thread in submission order, with what is
    left of their budget; a finish's close runs after the request's copies,
    and only then is its name reported sent (once)."""
    lane = SaveLane(max_queued_blocks=16, budget_ms=5000)
    gate = threading.Event()
    done: list[tuple[str, str]] = []

    def copy(tag: str) -> Callable[[float], None]:
        def run(wait_ms: float) -> None:
            gate.wait(10)
            assert 0 < wait_ms <= 5000
            done.append((tag, threading.current_thread().name))
        return run

    try:
        assert lane.submit(1, 4, copy("a1"))
        assert lane.submit(2, 4, copy("b"))
        assert lane.submit(1, 4, copy("a2"))
        lane.finish(1, lambda: done.append(("close 1", "")), name="req-1")
        assert lane.sent() == set()  # held: the copies wait on the gate
        gate.set()
        assert lane.idle(10)
        assert [d[0] for d in done] == ["a1", "b", "a2", "close 1"]
        assert {d[1] for d in done[:3]} == {"kvtier-save"}
        assert lane.sent() == {"req-1"} and lane.sent() == set()
        assert lane.take_counts() == {"saved_blocks": 12}
        assert lane.take_counts() == {}
    finally:
        lane.close()


def test_the_save_lane_skips_what_it_cannot_copy_in_time_and_counts_it(
        ) -> None:
    """Past the queue's blocks a save is skipped (``behind``) and so are
    the request's later ones (``gap``); a save not started within its
    budget is dropped (``late``); a copy that raises costs its blocks
    (``failed``), not the lane. A save given a budget of its own (a
    prefill's) is held to that one."""
    lane = SaveLane(max_queued_blocks=9, budget_ms=100)
    gate = threading.Event()
    try:
        assert lane.submit(1, 6, lambda _ms: gate.wait(10))
        queued = time.monotonic()
        assert lane.submit(2, 2, lambda _ms: None)   # waits behind 1: late
        assert lane.submit(6, 1, lambda _ms: None, budget_ms=10_000)
        assert not lane.submit(3, 4, lambda _ms: None)           # behind
        assert not lane.submit(3, 1, lambda _ms: None)           # gap
        wait_until(lambda: time.monotonic() - queued > 0.15,
                   "request 2's budget to pass while 1 copies")
        gate.set()
        assert lane.idle(10)

        def broken(_ms: float) -> None:
            raise RuntimeError("a bug in a copy")
        assert lane.submit(4, 3, broken)
        assert lane.submit(5, 1, lambda _ms: None)
        assert lane.idle(10)
        assert lane.take_counts() == {
            "saved_blocks": 8, "save_skipped_behind": 4,
            "save_skipped_gap": 1, "save_skipped_late": 2,
            "save_skipped_failed": 3}
    finally:
        lane.close()


def test_released_pages_get_no_copy_and_the_release_waits_for_a_running_one(
        ) -> None:
    """``release`` drops the released requests' queued copies (their
    close still runs) and returns only once a copy of theirs that was
    already running has ended: the engine may then write the pages. A
    released request that goes on (preempted, then resumed) has its next
    saves copied: no gap is left behind."""
    lane = SaveLane(max_queued_blocks=16, budget_ms=5000)
    started, gate = threading.Event(), threading.Event()
    ran: list[str] = []

    def slow(_ms: float) -> None:
        started.set()
        gate.wait(10)
        ran.append("running")

    try:
        assert lane.submit(1, 2, slow)
        assert lane.submit(1, 3, lambda _ms: ran.append("queued"))
        assert lane.submit(2, 1, lambda _ms: ran.append("preempted"))
        lane.finish(1, lambda: ran.append("close"))
        assert started.wait(10)
        threading.Timer(0.2, gate.set).start()
        t = time.monotonic()
        lane.release({1, 2})
        assert time.monotonic() - t >= 0.15, "returned while a copy ran"
        assert ran[0] == "running"
        assert lane.submit(2, 4, lambda _ms: ran.append("resumed"))
        assert lane.idle(10)
        assert ran == ["running", "close", "resumed"]
        assert lane.take_counts() == {"saved_blocks": 6,
                                      "save_skipped_released": 4}
    finally:
        lane.close()


# ------------------------------------------- kvtier's threads and the cores


def _on_cpus(cpus: frozenset[int], fn: Callable[[], Any]) -> Any:
    """fn's result on a thread of its own bound to ``cpus`` (as vLLM's CPU
    build binds a worker's main thread to its compute cores)."""
    out: list[Any] = []

    def run() -> None:
        kvtier.cpus.bind_thread(cpus)
        out.append(fn())
    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out[0]


def test_cpu_lists_parse_and_bad_ones_are_refused_by_name() -> None:
    from kvtier.cpus import parse_cpu_list, resolve
    assert parse_cpu_list("0-3,8, 10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpu_list("5") == {5}
    for bad, says in (("a-3", "'a-3' is not a CPU"), ("4-2", "backwards"),
                      ("0-99999999", "names a CPU past 65535")):
        with pytest.raises(ValueError, match=says):
            parse_cpu_list(bad)
    assert resolve("inherit") == frozenset() == resolve("")
    with pytest.raises(kvtier.errors.InvalidArgument,
                       match=r'thread_cpus: .*"auto", "inherit"'):
        resolve("1;2")
    with pytest.raises(kvtier.errors.InvalidArgument,
                       match=r"thread_cpus: CPUs \[4096\] are not this "
                       r"process's \(it may use "):
        resolve("0,4096")


def test_auto_takes_the_reserved_cores_no_thread_is_bound_to() -> None:
    """Issue #64. "auto" is the cores the engine reserves (vLLM's list)
    less any a thread of this process is bound to (an OpenMP runtime
    binds each compute thread to one CPU); nothing without a reserved
    list. Threads started inside ``threads_on`` run there, and the
    thread that started them keeps its own binding."""
    from kvtier.cpus import process_cpus, resolve, threads_on
    cpus = process_cpus()
    if len(cpus) < 2:
        pytest.skip(f"one CPU ({sorted(cpus)}): nothing could be reserved")
    compute = frozenset([min(cpus)])
    reserved = cpus - compute

    def start_one(res: frozenset[int]) -> tuple[frozenset[int], set[int],
                                                set[int]]:
        chosen = resolve("auto", reserved=res)
        seen: list[set[int]] = []
        with threads_on(chosen):
            t = threading.Thread(target=lambda: seen.append(
                os.sched_getaffinity(0)))
            t.start()
        t.join()
        return chosen, seen[0], os.sched_getaffinity(0)

    chosen, child, own = _on_cpus(compute, lambda: start_one(reserved))
    assert chosen == reserved and child == reserved and own == compute
    # A reserved core a thread is bound to (a compute thread) is left out;
    # with no reserved list nothing changes.
    other = frozenset([max(cpus)])
    hold, held = threading.Event(), threading.Event()

    def bound_elsewhere() -> None:
        kvtier.cpus.bind_thread(other)
        held.set()
        hold.wait(30)
    t = threading.Thread(target=bound_elsewhere)
    t.start()
    try:
        held.wait(30)
        chosen, child, own = _on_cpus(compute, lambda: start_one(reserved))
    finally:
        hold.set()
        t.join()
    assert chosen == reserved - other
    assert child == (chosen or own) and own == compute
    chosen, child, own = _on_cpus(compute, lambda: start_one(frozenset()))
    assert chosen == frozenset() and child == own == compute
    # An unbound caller (vLLM's scheduler process binds no thread) adds
    # nothing: "auto" is the reserved cores.
    assert _on_cpus(cpus, lambda: resolve("auto", reserved=reserved)) == \
        reserved
