"""A scheduler's store lookups, batched by step and bounded by a budget.

An engine's scheduler asks, for every new request of a step, how much of
its prompt the store holds. :class:`StepLookups` collects those questions
and sends them together when the step ends (:meth:`StepLookups.flush`): one
``lookup_many`` call, which is one round trip per store shard, the shards in
parallel. Each batch runs on a small pool of threads, never on the
scheduler's, and each is bounded by the smallest budget left among its
requests, so a stalled store costs a batch its budget and the next batches
nothing more (the client then skips the slow shard for a while and answers
at once). A burst of 64 new requests is one batch, not 64 round trips in a
row.

Each request's outcome is one of :data:`ANSWERED`, :data:`LATE` (no answer
within its budget), :data:`SKIPPED` (the client is skipping the store after
a missed budget) or :data:`FAILED` (the store could not be asked); only an
answered request has blocks to load.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from kvtier._native import NamespaceSpec
from kvtier.cpus import bind_thread
from kvtier.errors import DeadlineExceeded, KvtierError, StatusCode
from kvtier.store import StoreClient

log = logging.getLogger("vllm.kvtier")

ANSWERED, LATE, SKIPPED, FAILED = "answered", "late", "skipped", "failed"


@dataclass
class Outcome:
    """A request's lookup: ``present`` leading blocks (0 unless
    ``kind`` is ANSWERED) and why (``error``: the store's message, ``code``:
    its status when the store answered with one)."""

    kind: str
    present: int = 0
    error: str = ""
    code: Optional[StatusCode] = None


@dataclass
class _Ask:
    key: int
    chain: np.ndarray
    asked: float      # time.monotonic() of the ask
    budget_s: float


class StepLookups:
    """Batched lookups of one namespace (see the module docstring); with
    ``ranks`` (the other TP ranks' namespaces, whose blocks a load needs
    too) a chain's answer is the prefix every rank holds. Thread-safe;
    ``threads`` batches may be out at once, on threads bound to ``cpus``
    (empty: their creator's binding)."""

    def __init__(self, store: StoreClient, namespace: NamespaceSpec,
                 threads: int = 2,
                 ranks: Sequence[NamespaceSpec] = (),
                 cpus: frozenset[int] = frozenset()) -> None:
        self.store = store
        self.namespace = namespace
        self.ranks = tuple(ranks)
        self._lock = threading.Condition()
        self._pending: list[_Ask] = []
        self._out: dict[int, _Ask] = {}          # asked, answer to come
        self._done: dict[int, Outcome] = {}
        self._inflight: dict[int, float] = {}    # batch -> its deadline
        self._next_batch = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=threads, thread_name_prefix="kvtier-lookup",
            initializer=bind_thread, initargs=(cpus,))
        self.batches = 0
        self._last_warning = 0.0
        self._last_late_warning = -10.0
        self._closed = threading.Event()
        self._warmer: Optional[threading.Thread] = None
        self.warm = threading.Event()  # the store answered the warm-up

    def ask(self, key: int, chain: np.ndarray, budget_ms: float) -> None:
        """Queues a lookup of ``chain`` for request ``key`` (its answer
        wanted within ``budget_ms`` from now); it goes out at the next
        :meth:`flush`. A request asked again replaces its earlier ask."""
        with self._lock:
            self._done.pop(key, None)
            self._pending = [a for a in self._pending if a.key != key]
            self._pending.append(_Ask(key, chain, time.monotonic(),
                                      budget_ms / 1000.0))

    def flush(self) -> None:
        """Sends every queued lookup: one batch, or two when some asks
        have budgets over twice the shortest (a decode waiting on a
        handoff), which a batch bounded by the shortest would cut short."""
        with self._lock:
            asks, self._pending = self._pending, []
            for a in asks:
                self._out[a.key] = a
        if not asks:
            return
        short = 2 * min(a.budget_s for a in asks)
        for batch in ([a for a in asks if a.budget_s <= short],
                      [a for a in asks if a.budget_s > short]):
            if batch:
                self.batches += 1
                self._pool.submit(self._run, batch)

    def outcome(self, key: int, block: bool = False) -> Optional[Outcome]:
        """The request's outcome once known (then forgotten), or LATE once
        its budget has passed without one (its answer, when it comes, is
        dropped); None while it may still come; FAILED for a request not
        asked. ``block``: wait for it until the budget ends."""
        with self._lock:
            while True:
                done = self._done.pop(key, None)
                if done is not None:
                    return done
                a = self._out.get(key) or next(
                    (p for p in self._pending if p.key == key), None)
                if a is None:  # never asked, or forgotten: none to come
                    return Outcome(FAILED, 0, "not asked")
                left = a.asked + a.budget_s - time.monotonic()
                if left <= 0:
                    self._forget_locked(key)
                    self._warn_late(a.budget_s)
                    return Outcome(LATE)
                if not block:
                    return None
                self._lock.wait(left)

    def wait_answers(self, timeout_s: float) -> bool:
        """Waits until no lookup sent is still to be answered, at most
        ``timeout_s`` (False past it). For a scheduler with nothing to
        compute: it waits here, the lookup threads free to run, instead
        of stepping empty steps that take the CPU (and the interpreter)
        from them."""
        end = time.monotonic() + timeout_s
        with self._lock:
            while self._out:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)
        return True

    def forget(self, key: int) -> None:
        """Drops the request's ask and any answer to it."""
        with self._lock:
            self._forget_locked(key)

    def _forget_locked(self, key: int) -> None:
        if self._out.pop(key, None) is not None:
            # One answer fewer to come: a wait_answers may be over.
            self._lock.notify_all()
        self._done.pop(key, None)
        self._pending = [a for a in self._pending if a.key != key]

    def _run(self, batch: list[_Ask]) -> None:
        with self._lock:
            # A batch out past its deadline is about to return (its call
            # has that deadline): wait for it (50 ms at most), so that a
            # store it found slow is skipped by the client, not asked again
            # for another budget.
            grace = time.monotonic() + 0.05
            while time.monotonic() < grace and any(
                    d < time.monotonic() for d in self._inflight.values()):
                self._lock.wait(0.005)
            now = time.monotonic()
            left_ms = min(a.asked + a.budget_s - now for a in batch) * 1000.0
            self._next_batch += 1
            batch_id = self._next_batch
            self._inflight[batch_id] = now + max(0.0, left_ms) / 1000.0
        try:
            outcomes = self._call(batch, left_ms)
        finally:
            with self._lock:
                del self._inflight[batch_id]
                for a, o in zip(batch, outcomes):
                    if self._out.get(a.key) is a:
                        del self._out[a.key]
                        self._done[a.key] = o
                self._lock.notify_all()

    def _call(self, batch: list[_Ask], left_ms: float) -> list[Outcome]:
        """The store's answer to ``batch`` within ``left_ms``."""
        outcomes: list[Outcome]
        budget_s = min(a.budget_s for a in batch)
        if left_ms < 1.0:
            # Its budget was spent before a lookup thread took it.
            outcomes = [Outcome(LATE)] * len(batch)
            self._warn_late(budget_s)
        else:
            try:
                found = lookup_ranks(self.store, self.namespace, self.ranks,
                                     [a.chain for a in batch], left_ms)
                outcomes = [Outcome(ANSWERED, n) for n in found]
            except DeadlineExceeded:
                outcomes = [Outcome(LATE)] * len(batch)
                self._warn_late(budget_s)
            except KvtierError as e:
                # The client skips a shard that missed a budget: answered
                # at once, with nothing.
                kind = SKIPPED if "budget" in str(e) else FAILED
                outcomes = [Outcome(kind, 0, str(e), e.code)] * len(batch)
                if kind == SKIPPED:
                    self._warn_late(budget_s, skipped=str(e))
                # A namespace the store has not seen yet (the engine's
                # first save registers it) holds nothing: no warning.
                if kind == FAILED and e.code != StatusCode.NOT_FOUND:
                    self._warn(e)
            except BaseException as e:  # never lose a waiter to a bug
                outcomes = [Outcome(FAILED, 0, repr(e))] * len(batch)
                self._warn(e)
        return outcomes

    def _warn(self, e: BaseException) -> None:
        """The store cannot be asked: said in the engine's log, at most
        once every 10 s."""
        now = time.monotonic()
        if now - self._last_warning >= 10.0:
            self._last_warning = now
            log.warning("kvtier: the store cannot be asked (%s); requests "
                        "compute their prompts until it answers", e)

    def _warn_late(self, budget_s: float, skipped: str = "") -> None:
        """A lookup got no answer within its budget, or was not sent
        because the store missed an earlier one (``skipped``: the client's
        words): said in the engine's log, at most once every 10 s (the
        scheduler counts every one)."""
        now = time.monotonic()
        if now - self._last_late_warning < 10.0:
            return
        self._last_late_warning = now
        if skipped:
            log.warning("kvtier: a lookup was not sent (%s); its request "
                        "computes its prompt", skipped)
        else:
            log.warning("kvtier: a lookup got no answer within its %.0f ms "
                        "budget (lookup_wait_ms); its request computes its "
                        "prompt", budget_s * 1000.0)

    def warm_up(self, retry_s: float = 1.0) -> None:
        """Opens the connection to the store on a thread of its own, so that
        the first request's lookup does not pay it: a lookup of a chain
        nobody holds, within the client's deadline, tried again every
        ``retry_s`` until the store answers or :meth:`close`. The first
        failure, and the first answer with how long it took, are said in
        the log; :attr:`warm` is set once it answered."""
        self._warmer = threading.Thread(
            target=self._warm_up, args=(retry_s,), daemon=True,
            name="kvtier-lookup-warm-up")
        self._warmer.start()

    def _warm_up(self, retry_s: float) -> None:
        start = time.monotonic()
        failed = False
        while not self._closed.is_set():
            try:
                self.store.lookup_many(self.namespace,
                                       [np.zeros((1, 2), dtype=np.uint64)])
                break
            except KvtierError as e:
                if e.code == StatusCode.NOT_FOUND:
                    break  # it answered: it does not know the namespace yet
                if not failed:
                    failed = True
                    log.warning("kvtier: the store could not be asked after "
                                "%.0f ms (%s); requests compute their "
                                "prompts until it answers",
                                (time.monotonic() - start) * 1000.0, e)
            self._closed.wait(retry_s)
        else:
            return
        # Said before it is set: whoever waits on it finds the line logged.
        log.info("kvtier: the store answered its first lookup after %.0f ms",
                 (time.monotonic() - start) * 1000.0)
        self.warm.set()

    def close(self) -> None:
        """Stops taking batches (one out ends within its budget) and the
        warm-up's tries, waiting for a try still out (within the client's
        deadline: a native call must not outlive the interpreter)."""
        self._closed.set()
        if self._warmer is not None:
            self._warmer.join()
        self._pool.shutdown(wait=False, cancel_futures=True)


def lookup_ranks(store: StoreClient, namespace: NamespaceSpec,
                 ranks: Sequence[NamespaceSpec], chains: Sequence[np.ndarray],
                 budget_ms: float = 0.0) -> list[int]:
    """How many leading blocks of each chain ``namespace`` and every one of
    ``ranks`` hold (a TP engine loads a block only when each rank's shard
    of it is stored), the ranks asked only for what the ones before hold,
    all within ``budget_ms`` (0: the client's deadline). A namespace the
    store does not know holds nothing; other errors raise as
    :meth:`StoreClient.lookup_many`'s."""
    deadline = time.monotonic() + budget_ms / 1000.0
    found = store.lookup_many(namespace, chains, budget_ms=budget_ms)
    for ns in ranks:
        asked = [i for i, n in enumerate(found) if n > 0]
        if not asked:
            break
        left = 0.0
        if budget_ms > 0:
            left = (deadline - time.monotonic()) * 1000.0
            if left < 1.0:
                raise DeadlineExceeded(StatusCode.DEADLINE_EXCEEDED,
                                       "the TP ranks' lookups ran past "
                                       "their budget")
        try:
            more = store.lookup_many(
                ns, [chains[i][:found[i]] for i in asked], budget_ms=left)
        except KvtierError as e:
            if e.code != StatusCode.NOT_FOUND:
                raise
            more = [0] * len(asked)
        for i, n in zip(asked, more):
            found[i] = min(found[i], n)
    return found
