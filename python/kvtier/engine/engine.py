"""The reference engine: continuous batching over a paged KV cache, with
kvtier driven exactly as vLLM's scheduler and worker drive a KV connector.

One engine thread runs steps. The scheduler half
(kvtier.scheduler_half.SchedulerHalf, no KV memory) and the worker half
(kvtier.worker_half.WorkerHalf, over the KV tensors) talk only through each
step's StepMeta, as vLLM's two processes do; docs/engines.md maps each of
vLLM's connector hooks to the call made here. kvtier saves whole blocks
once a step has computed them (a block is the store's unit and its checksum
covers every layer). Its own pages and prefix cache are
kvtier.engine.pages, its requests and results kvtier.engine.requests.

A slow or stalled store costs a request little beyond computing its
prompt: the scheduler waits for the store's lookup at most
``EngineConfig.lookup_wait_share`` of the time the engine would take to
compute what the store could supply (from its measured compute per token;
a profile run at start-up gives the first figure), and not less than
``MIN_LOOKUP_WAIT_MS``; a later answer is not used, and the client then
skips the slow store for a while (200 ms, doubling to 1 s while it stays
slow), so a stalled store costs one request in each such window that wait
and the others nothing. Saves never wait for a store that has stopped
taking them (the connector drops the oldest queued ones). The worker's pin
after a lookup that answered still waits up to the client's deadline.

Silent wrong KV is never used: a load's verdict comes before the step's
results are kept. A failed load (store gone, checksum mismatch, a block
evicted between the scheduler's lookup and the worker's pin) rolls the
request back to its own prefix and the next step computes the tokens
instead; the output is what a cold run gives.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from kvtier import Connector, StoreClient
from kvtier.errors import KvtierError, StatusCode, Unavailable
from kvtier.hooks import SchedulerHalf, WorkerHalf
from kvtier.engine.model import PagedKvCache, SeqChunk, Transformer
from kvtier.engine.pages import _Pages
from kvtier.engine.steps import Steps
from kvtier.engine.requests import (ARRIVALS_LISTED_S, ComputeEstimate,
                                    DrainReport, EngineConfig, LoadReport,
                                    Result, _Request, namespace_for,
                                    queued_tokens)

__all__ = ["DrainReport", "Engine", "EngineConfig", "LoadReport", "Result",
           "namespace_for"]

# The drain's own connector request (the engine's ids start at 1 << 40).
_DRAIN_REQUEST = (1 << 63) - 1
# Blocks copied out per SaveFrom call while draining (each call copies its
# blocks before it returns; the deadline is checked between calls).
_DRAIN_CHUNK = 64


log = logging.getLogger("kvtier.engine")


class Engine:
    """A PyTorch reference engine over kvtier's store shards ``stores``
    (empty: no store tier). ``connector_options`` go to the worker half's
    :class:`kvtier.Connector` (shared_memory, deadline_ms, ...).
    ``on_stored`` / ``on_removed`` receive the chain hashes of blocks
    entering or leaving the engine's prefix cache (a router's KV events).
    Thread-safe: :meth:`generate` may be called from any thread."""

    def __init__(self, model: Transformer, config: EngineConfig,
                 stores: Sequence[str] = (),
                 on_stored: Callable[[np.ndarray], None] = lambda h: None,
                 on_removed: Callable[[np.ndarray], None] = lambda h: None,
                 connector_options: Optional[dict[str, Any]] = None
                 ) -> None:
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}
        if config.kv_dtype not in dtype:
            raise ValueError(
                f'kv_dtype "{config.kv_dtype}" is not fp16 or bf16')
        share = config.lookup_wait_share
        if share is not None and not 0 < share < float("inf"):
            raise ValueError(f"lookup_wait_share must be a positive number "
                             f"or None, not {share}")
        self.model = model
        self.config = config
        self.namespace = namespace_for(model.config, config)
        self.cache = PagedKvCache(model.config, config.num_pages,
                                  config.page_tokens, dtype[config.kv_dtype],
                                  config.layout)
        opts = dict(connector_options or {})
        self.connector: Optional[Connector] = None
        store: Optional[StoreClient] = None
        if stores:
            store = StoreClient(
                stores, deadline_ms=opts.get("deadline_ms", 10000),
                shared_memory=opts.get("shared_memory", "auto"))
            self.connector = Connector(self.namespace, self.cache.tensors,
                                       stores=stores, layout=config.layout,
                                       **opts)
        self.scheduler = SchedulerHalf(self.namespace, store,
                                       config.page_tokens)
        if config.lookup_wait_share is not None:
            self.scheduler.warm_up()
        self.worker = (WorkerHalf(self.connector)
                       if self.connector is not None else None)
        self.pages = _Pages(config.num_pages, on_stored, on_removed)
        self._mu = threading.Condition()
        self._waiting: collections.deque[_Request] = collections.deque()
        self._running: list[_Request] = []
        self._stop = False
        self._draining = False
        self._broken: Optional[BaseException] = None
        self._next_id = 1 << 40
        # (arrival, caller's id) of recent requests, for routers.
        self._arrivals: collections.deque[tuple[float, int]] = \
            collections.deque(maxlen=4096)
        self.stats: collections.Counter[str] = collections.Counter()
        self.compute = ComputeEstimate(config.lookup_wait_share)
        self._steps = Steps(model, self.cache, config, self.scheduler,
                            self.worker, self.connector, self.pages,
                            self.compute, self.stats, self._finish)
        if store is not None:
            self._profile_run()
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name="kvtier-engine")
        self._thread.start()

    # ------------------------------------------------------------ public

    def generate(self, prompt: list[int], max_new_tokens: int = 1,
                 request_id: Optional[int] = None,
                 timeout: Optional[float] = None,
                 caller_id: int = 0,
                 store_hint: Optional[int] = None) -> Result:
        """Runs a request to completion: greedy decoding of
        ``max_new_tokens`` tokens (>= 1) after ``prompt``. Raises ValueError
        for an empty prompt, a token outside the vocabulary, a prompt
        larger than the whole KV cache or a negative ``store_hint``;
        TimeoutError after ``timeout``; RuntimeError naming the error that
        stopped the engine's loop, if one did; :class:`kvtier.errors.Unavailable`
        once :meth:`drain` was called. ``caller_id`` (non-zero) is the id a
        router knows the request by: ``load_report`` lists it once the
        request counts in the load. ``store_hint``: how many of the
        prompt's blocks a router knows the stores hold from its start
        (``RouteResponse.store_end_blocks``; None: unknown); the store is
        not asked when this engine's own prefix reaches it."""
        vocab = self.model.config.vocab_size
        if not prompt:
            raise ValueError("the prompt is empty")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        if store_hint is not None and store_hint < 0:
            raise ValueError(f"store_hint must be >= 0, not {store_hint}")
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token {bad[0]} is outside the vocabulary "
                             f"(0..{vocab - 1})")
        bt = self.config.page_tokens
        need = -(-(len(prompt) + max_new_tokens) // bt)
        if need > self.config.num_pages:
            raise ValueError(f"the request needs {need} pages; the KV cache "
                             f"has {self.config.num_pages}")
        with self._mu:
            if self._broken is not None:
                raise RuntimeError(f"the engine stopped on an error: "
                                   f"{self._broken!r}") from self._broken
            if self._draining:
                raise Unavailable(StatusCode.UNAVAILABLE,
                                  "the engine is draining (it is leaving the "
                                  "fleet): send the request to another one")
            if request_id is None:
                request_id = self._next_id
                self._next_id += 1
            r = _Request(request_id, list(prompt), max_new_tokens,
                         time.monotonic())
            r.hashes = self.namespace.hash_tokens(np.asarray(prompt))
            r.caller_id = caller_id
            r.store_hint = store_hint
            self._waiting.append(r)
            if caller_id:
                self._arrivals.append((r.arrival, caller_id))
            self._mu.notify_all()
        if not r.done.wait(timeout):
            raise TimeoutError(f"request {request_id} did not finish in "
                               f"{timeout} s")
        if r.error is not None:
            raise r.error
        assert r.result is not None
        return r.result

    def load(self) -> tuple[int, int, int]:
        """(running requests, prompt tokens still to compute, free pages)
        now (``load_report`` without the arrivals)."""
        r = self.load_report()
        return r.running, r.queued_tokens, r.free_pages

    def load_report(self, listed_s: float = ARRIVALS_LISTED_S
                    ) -> "LoadReport":
        """The load a router weighs a new request against, now: what the
        running requests have left to compute and what each waiting one
        will compute, in order, past what the cache holds or the requests
        before it will have computed (a waiting request matches the cache
        again when it is scheduled, and computes at least its last page);
        and the callers' ids of the requests that arrived in the last
        ``listed_s`` seconds (each counted; a server heartbeating every
        ``p`` seconds passes at least ``3 p``)."""
        with self._mu:
            queued = queued_tokens(self._running, self._waiting,
                                   self.pages.page_of,
                                   self.config.page_tokens)
            cutoff = time.monotonic() - max(listed_s, ARRIVALS_LISTED_S)
            arrived = [rid for at, rid in self._arrivals if at >= cutoff]
            return LoadReport(len(self._running), queued,
                              self.pages.free_count, arrived)

    def drain(self, timeout_s: float, max_bytes: int) -> DrainReport:
        """Leaves without losing the cache (docs/operations.md, "Scaling
        without losing the cache"): from now on :meth:`generate` raises
        RuntimeError; the requests already taken finish (until
        ``timeout_s`` seconds from now); then the prefix cache's blocks the
        store is not known to hold are copied out for it, most valuable
        first (:meth:`_Pages.by_value`), at most ``max_bytes`` of block
        bytes, and waited for until the deadline, when what is still queued
        is dropped whole (a put commits whole blocks or none). Returns by
        the deadline plus one store operation's. The engine still serves
        nothing new afterwards; call :meth:`close` next. ValueError for a
        negative timeout or byte budget."""
        if not timeout_s >= 0 or max_bytes < 0:
            raise ValueError(f"drain needs timeout_s >= 0 and max_bytes >= 0"
                             f", not {timeout_s} and {max_bytes}")
        start = time.monotonic()
        deadline = start + timeout_s
        out = DrainReport()
        with self._mu:
            self._draining = True
            while (self._waiting or self._running) and \
                    self._broken is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._mu.wait(min(left, 0.05))
            out.unfinished = len(self._waiting) + len(self._running)
            ranked = self.pages.by_value()
        out.cached = len(ranked)
        conn = self.connector
        if conn is None:
            out.stopped = "no store"
            out.ms = (time.monotonic() - start) * 1000.0
            return out
        block_bytes = max(1, int(self.namespace.block_bytes))
        budget = max_bytes // block_bytes  # blocks the store lacks, at most
        before = conn.stats()

        def grew(name: str) -> int:
            return int(conn.stats().get(name, 0)) - int(before.get(name, 0))

        if ranked:
            hashes = np.array([h for _, h in ranked], dtype=np.uint64)
            conn.lookup(_DRAIN_REQUEST, hashes, skip_blocks=len(ranked))
            i = 0
            try:
                while i < len(ranked):
                    # A known block is skipped for free: a call of n blocks
                    # queues at most n, so the budget is never overrun.
                    n = min(_DRAIN_CHUNK, len(ranked) - i,
                            budget - (i - grew("offload_skipped_known")))
                    if n <= 0:
                        out.stopped = "bytes"
                        break
                    if time.monotonic() >= deadline:
                        out.stopped = "time"
                        break
                    conn.save(_DRAIN_REQUEST, i,
                              [p for p, _ in ranked[i:i + n]],
                              skip_known=True)
                    i += n
            except KvtierError as e:
                log.warning("drain: saving stopped: %s", e)
                out.stopped = "store"
            if not conn.drain(max(0.0, deadline - time.monotonic())):
                out.stopped = "time"
            conn.finished(_DRAIN_REQUEST)
            out.known = grew("offload_skipped_known")
            out.queued = i - out.known
        out.bytes = out.queued * block_bytes
        out.saved = grew("offloaded_blocks")
        if not out.stopped and (grew("offload_failures") or
                                grew("offload_dropped_full")):
            out.stopped = "store"
        out.ms = (time.monotonic() - start) * 1000.0
        return out

    def close(self) -> None:
        """Stops the engine thread (requests still waiting fail), closes
        every request (waiting for queued saves) and the connector."""
        with self._mu:
            self._stop = True
            self._mu.notify_all()
        self._thread.join()
        for r in list(self._waiting) + self._running:
            r.error = RuntimeError("the engine stopped")
            r.done.set()
        if self.worker is not None:
            self.worker.wait_for_save(self.scheduler.build_step())
            self.worker.close()
        self.scheduler.close()
        if self.connector is not None:
            self.connector.close()

    def lookup_wait_ms(self, tokens: int) -> Optional[float]:
        """How long to wait for the store to say what it holds of ``tokens``
        tokens this engine would otherwise compute
        (:meth:`ComputeEstimate.lookup_wait_ms`)."""
        return self.compute.lookup_wait_ms(tokens)

    @property
    def ms_per_token(self) -> Optional[float]:
        """Milliseconds of forward per prompt token (a moving average)."""
        return self.compute.ms_per_token

    # ----------------------------------------------------------- the loop

    def _profile_run(self) -> None:
        """Times one prefill chunk into free pages, as vLLM's profile run
        at start-up: the first compute estimate (the second of two runs;
        the first warms the model up)."""
        bt = self.config.page_tokens
        n = min(self.config.max_step_tokens, 256, self.config.num_pages * bt)
        chunk = SeqChunk(torch.zeros(n, dtype=torch.long), 0,
                         torch.arange(-(-n // bt), dtype=torch.long))
        for _ in range(2):
            t0 = time.monotonic()
            self.model.forward([chunk], self.cache)
            ms = (time.monotonic() - t0) * 1000.0
        self.compute.ms_per_token = ms / n

    def _loop(self) -> None:
        """Runs the steps; an error it cannot handle stops the engine, and
        every request waiting or running (and every later one) fails with
        it instead of waiting forever."""
        try:
            self._serve()
        except BaseException as e:
            with self._mu:
                self._broken = e
                failed = list(self._waiting) + self._running
                self._waiting.clear()
                self._running.clear()
            for r in failed:
                r.error = RuntimeError(f"the engine stopped on an error: "
                                       f"{e!r}")
                r.error.__cause__ = e
                r.done.set()
            log.exception("the engine stopped on an error")

    def _serve(self) -> None:
        while True:
            with self._mu:
                while not self._stop and not self._waiting and \
                        not self._running:
                    self._mu.wait()
                if self._stop:
                    return
                self._admit()
                batch = list(self._running)
            if batch:
                self._steps.run(batch)
            else:
                time.sleep(0.002)  # every page is held: wait for a finish

    def _admit(self) -> None:
        """Scheduler: moves waiting requests into the running set while
        pages and the step's limits allow (called under the lock)."""
        bt = self.config.page_tokens
        while self._waiting and len(self._running) < self.config.max_running:
            r = self._waiting[0]
            # At least the last prompt token is computed (it gives the logits).
            limit = (len(r.prompt) - 1) // bt
            gpu = self.pages.match(r.hashes, limit)
            t0 = time.monotonic()
            skipped_before = self.scheduler.lookups_skipped
            late_before = self.scheduler.lookups_late
            spared_before = self.scheduler.lookups_not_asked
            wait_ms = self.lookup_wait_ms(len(r.prompt) - len(gpu) * bt)
            found = self.scheduler.num_loadable_tokens(
                r.rid, r.hashes, len(r.prompt), len(gpu) * bt,
                store_hint=r.store_hint, budget_ms=wait_ms) // bt
            r.lookup_skipped = self.scheduler.lookups_skipped > skipped_before
            r.load_status = ""  # admission may be tried again
            late = self.scheduler.lookups_late > late_before
            if late:
                r.load_status = (f"the store did not answer the lookup within "
                                 f"{wait_ms:.1f} ms (a share of computing "
                                 f"the prompt): computed instead")
            elif self.scheduler.lookups_not_asked > spared_before:
                r.load_status = ("the store was not asked: it missed an "
                                 "earlier lookup's budget and is skipped "
                                 "for a while; computed instead")
            # What the lookup added to the request's path (the wait, too).
            r.onboard_ms = ((time.monotonic() - t0) * 1000.0
                            if found or late else 0.0)
            # Pages for the prompt and every token it decodes, taken now: a
            # running request never waits for a page (there is no preemption).
            total = -(-(len(r.prompt) + r.max_new) // bt)
            fresh = self.pages.allocate(total - len(gpu))
            if fresh is None:
                self.pages.release(gpu)
                return  # no room yet: asked again after a request finishes
            self._waiting.popleft()
            r.pages = gpu + fresh
            r.gpu_blocks = len(gpu)
            r.saved_blocks = len(gpu)
            self.scheduler.allocated(r.rid, fresh[:found])
            r.load_blocks = found
            r.computed = (len(gpu) + found) * bt
            self._running.append(r)

    def _finish(self, r: _Request) -> None:
        now = time.monotonic()
        self.scheduler.finished(r.rid)  # request_finished; closed next step
        with self._mu:
            self._running.remove(r)
            self.pages.release(r.pages)
            self._mu.notify_all()
        bt = self.config.page_tokens
        assert r.first_logits is not None
        r.result = Result(
            tokens=list(r.out),
            ttft_ms=(r.first_token_at - r.arrival) * 1000.0,
            prompt_tokens=len(r.prompt),
            computed_tokens=r.computed_tokens,
            gpu_hit_tokens=r.gpu_blocks * bt,
            loaded_tokens=r.loaded_blocks * bt,
            loaded_blocks=r.loaded_blocks,
            loaded_from_disk=r.loaded_from_disk,
            load_status=r.load_status,
            onboard_ms=r.onboard_ms,
            decode_ms=(now - r.first_token_at) * 1000.0,
            first_logits=r.first_logits,
            load_times=r.load_times,
            store_lookup_skipped=r.lookup_skipped)
        self.stats["requests"] += 1
        self.stats["computed_tokens"] += r.computed_tokens
        r.done.set()
