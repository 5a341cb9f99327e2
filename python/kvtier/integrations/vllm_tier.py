"""kvtier as a secondary tier of vLLM's own KV offloading.

vLLM (v0.22 and later) offloads KV itself: its ``OffloadingConnector`` with
``TieringOffloadingSpec`` copies blocks from the GPU into a pinned CPU
primary tier (one shared-memory region of rows) and cascades rows to
secondary tiers, which it loads by class name and module path. As such a
tier, kvtier moves rows between that region and the store: vLLM moves
GPU<->host, kvtier moves host<->store, with no CUDA code of kvtier's. The
interface is vLLM 0.32's ``SecondaryTierManager``
(``vllm/v1/kv_offload/tiering/base.py``); load it with::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "OffloadingConnector",
      "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 8589934592,
        "secondary_tiers": [{"type": "KvtierTier",
          "module_path": "kvtier.integrations.vllm_tier",
          "stores": "kv-store-0:7400,kv-store-1:7400"}]}}'

Its keys (beside vLLM's ``type``, ``module_path``, ``backpressure``) are
:data:`TIER_OPTIONS` (``stores`` required); any other key, a wrong type or
a value out of range is refused with a message that names the key. A
REMOTE tier whose vLLM seeds block hashes at random per process
(``prefix_caching_hash_algo`` xxhash without ``PYTHONHASHSEED``) is refused
where vLLM's config is at hand, and said in the log at the first lookup
otherwise.

What it promises:

- vLLM's whole region is registered with UCX once; a job moves its rows
  between the region and the store by RMA (or a copy from a same-host
  store's mapped arena), with no staging copy.
- Lookups are answered from one store round trip per batch (vLLM's
  ``AsyncLookupManager`` batches one step's keys; RETRY until it answers).
  A batch is asked as a chain, in the order vLLM lists it, so a key after
  the first missing one reads as a miss: never a false hit.
- ``submit_store`` / ``submit_load`` only queue; ``io_threads`` threads move
  the rows, loads before stores. ``get_finished_jobs`` reports each job once
  with per-key results: a load that fails its checksum keeps none of its
  keys, has the store drop its corrupt copies, and turns their lookups into
  misses, so a corrupt block is never a hit. ``drain_jobs`` waits for every
  queued and running job.
- The namespace binds everything that decides a row's bytes: model, dtype,
  vLLM's version, tokens per hash, blocks per chunk, bytes per row, the KV
  groups, vLLM's row layout (canonical or per rank, replicated MLA), the
  parallel layout (world size, TP, PP, PCP, DCP) and the identity fields
  of :mod:`kvtier.identity`, so rows of another layout, version or model
  are never read as these.
- A store that is down (at start-up too) is a miss for every lookup and a
  failed job; the tier keeps serving and uses the store once it answers.
- Events: a stored row is reported (``take_events``) with medium STORAGE
  and the tier's locality, when vLLM's KV events are on.
- Prefill/decode through the store, driven by vLLM's own P/D keys
  (``remote_decoder`` / ``remote_prefiller``; the store is the medium):
  :mod:`kvtier.integrations.vllm_tier_handoff`.

Engines that share rows through the store must hash blocks the same way:
vLLM's default sha256 block hash is seeded from a fixed value unless
``PYTHONHASHSEED`` is set (then set it alike on every engine).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, ClassVar, Iterable, Optional

import numpy as np

import kvtier
from kvtier.errors import (DataLoss, KvtierError, NotFound,
                           StatusCode)
from kvtier.integrations.vllm_config import (
    check_block_hashes_shareable, key_hashes, tier_namespace,
    warn_if_seeded_at_random)
from kvtier.integrations.vllm_tier_handoff import TierHandoffs
from kvtier.options import (CLIENT_OPTIONS, Option, client_options,
                            read_options)

from vllm.v1.kv_offload.base import (Locality, LookupResult, Medium,
                                     OffloadingEvent, OffloadKey,
                                     OffloadPolicy, ReqContext)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import (JobId, JobResult,
                                             RequestOffloadingContext,
                                             ScheduleEndContext,
                                             SecondaryTierManager,
                                             TransferJob)

# A child of vLLM's own logger, so the tier's lines appear with vLLM's.
log = logging.getLogger("vllm.kvtier")

#: The tier's own keys in its JSON entry (vLLM takes type, module_path and
#: backpressure out before it builds the tier): the store client's and these.
TIER_OPTIONS: tuple[Option, ...] = CLIENT_OPTIONS + (
    Option("io_threads", "int", 2, "threads moving rows", 1, 64),
    Option("locality", "str", "REMOTE",
           "REMOTE: the store is shared by every engine",
           choices=("LOCAL", "REMOTE")),
    Option("enable_kv_events", "bool", True, "report stored rows"),
    Option("lookup_budget_ms", "number", 100,
           "how long one step's lookup may take before its keys miss",
           1, 60000),
    Option("max_queued_stores", "int", 256,
           "store jobs queued at most; more fail at once (the rows stay in "
           "vLLM's CPU tier)", 1, 1 << 20),
    Option("handoff_wait_ms", "number", 5000,
           "how long a decode request (remote_prefiller) waits for the "
           "prefill's rows before it computes what is missing", 1, 600000),
)

TIER_KEYS = tuple(o.name for o in TIER_OPTIONS)


@dataclass
class _Job:
    job_id: JobId
    load: bool
    keys: list[OffloadKey]
    rows: list[int]
    req_id: Optional[str] = None


class _Lookups(AsyncLookupManager):
    """vLLM's per-step lookup batching; each batch is one store round
    trip, on vLLM's lookup thread."""

    def __init__(self, tier: "KvtierTier") -> None:
        super().__init__(tier_type=tier.tier_type)
        self._tier = tier

    def batch_lookup(self, keys: list[OffloadKey],
                     req_context: ReqContext) -> Iterable[bool]:
        return self._tier.present(keys)


class KvtierTier(SecondaryTierManager):  # type: ignore[misc]
    """vLLM's secondary tier over kvtier-store shards (module docstring).

    Every method runs on vLLM's scheduler thread and returns at once; rows
    move on the tier's own I/O threads, which never call into vLLM's
    manager."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview,
                 tier_type: str, backpressure_detector: Any = None,
                 **config: Any) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type,
                         backpressure_detector)
        if isinstance(config.get("locality"), str):
            config = {**config, "locality": config["locality"].upper()}
        values = read_options(config, TIER_OPTIONS, "kvtier tier config")
        stores, opts = list(values["stores"]), client_options(values)
        threads = int(values["io_threads"])
        self.locality = Locality(values["locality"])
        events = bool(values["enable_kv_events"])
        self._lookup_budget_ms = float(values["lookup_budget_ms"])
        self._max_queued_stores = int(values["max_queued_stores"])
        self._queued_stores = 0   # store jobs queued or moving (under _idle)
        self.stores_refused = 0
        self._last_refusal_log = 0.0
        check_block_hashes_shareable(self.locality)
        self._seed_checked = False
        self._events: Optional[list[OffloadingEvent]] = (
            [] if events and offloading_spec.kv_events_config
            .enable_kv_cache_events else None)

        self._row_bytes = int(self.block_size_bytes)
        self.namespace = tier_namespace(offloading_spec, self._row_bytes)
        self._region = np.frombuffer(primary_kv_view.cast("B"),
                                     dtype=np.uint8)
        self._store: Optional[kvtier.StoreClient] = kvtier.StoreClient(
            stores, **opts)
        # Registration is local (UCX); the store may still be down.
        self._store.register(self._region)
        self._registered = False
        self._register_lock = threading.Lock()

        self._queue: "queue.PriorityQueue[tuple[int, int, Optional[_Job]]]" \
            = queue.PriorityQueue()
        self._seq = 0
        self._done: "queue.SimpleQueue[tuple[_Job, Optional[int], float]]" \
            = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._running = 0     # jobs queued or moving (under _idle)
        self._unreported = 0  # jobs not yet returned by get_finished_jobs
        self._threads = [threading.Thread(target=self._serve, daemon=True,
                                          name=f"kvtier-tier-io-{i}")
                         for i in range(threads)]
        for t in self._threads:
            t.start()
        self._lookups = _Lookups(self)
        # P/D (vLLM's remote_prefiller / remote_decoder keys).
        self._pd = TierHandoffs(
            float(values["handoff_wait_ms"]) / 1000.0,
            lambda keys: self._call(lambda st: st.lookup_many(
                self.namespace, [key_hashes([k]) for k in keys],
                budget_ms=self._lookup_budget_ms)))
        log.info("kvtier tier: stores %s, namespace %016x, rows of %d bytes",
                 ",".join(stores), self.namespace.id, self._row_bytes)

    @property
    def handoffs(self) -> dict[str, int]:
        """P/D handoffs by outcome (:class:`TierHandoffs`)."""
        return self._pd.counts

    @property
    def handoff_wait_seconds(self) -> float:
        """Seconds decode requests waited for their prefills' rows."""
        return self._pd.wait_seconds

    # ------------------------------------------------------- the store side

    def _ensure_namespace(self) -> kvtier.StoreClient:
        """The store client with the namespace registered on every shard
        (again after a store restart forgot it)."""
        store = self._store
        if store is None:
            raise KvtierError(StatusCode.FAILED_PRECONDITION,
                              "the kvtier tier is shut down")
        with self._register_lock:
            if not self._registered:
                store.register_namespace(self.namespace)
                self._registered = True
        return store

    def _call(self, fn: Any) -> Any:
        """fn(store), registering the namespace first; NotFound (a store
        that restarted without it) registers again and retries once."""
        try:
            return fn(self._ensure_namespace())
        except NotFound:
            self._registered = False
            return fn(self._ensure_namespace())

    def present(self, keys: list[OffloadKey]) -> list[bool]:
        """Whether the store holds each key: one round trip, within
        ``lookup_budget_ms``. The batch is a chain in vLLM's order, so keys
        after the first miss are misses. A store that cannot be asked in
        time holds nothing (the client then skips a slow shard for a
        while, answering at once)."""
        try:
            n = self._call(lambda s: s.lookup_many(
                self.namespace, [key_hashes(keys)],
                budget_ms=self._lookup_budget_ms)[0])
        except KvtierError as e:
            log.debug("kvtier tier: lookup failed: %s", e)
            n = 0
        return [i < n for i in range(len(keys))]

    def _serve(self) -> None:
        while True:
            _, _, job = self._queue.get()
            if job is None:
                return
            loaded: Optional[int] = None
            start = time.monotonic()
            try:
                hashes = key_hashes(job.keys)
                if job.load:
                    loaded = self._call(lambda s: s.get_rows(
                        self.namespace, hashes, self._region, job.rows))
                else:
                    out = self._call(lambda s: s.put_rows(
                        self.namespace, hashes, self._region, job.rows))
                    loaded = out["written"] + out["already_present"]
            except DataLoss as e:
                log.warning("kvtier tier: load job %s failed its checksum "
                            "(%s); its blocks are dropped and recomputed",
                            job.job_id, e)
                try:
                    self._call(lambda s: s.verify(self.namespace, hashes))
                except KvtierError as e2:
                    log.warning("kvtier tier: could not have the store "
                                "check its copies: %s", e2)
            except KvtierError as e:
                log.debug("kvtier tier: job %s failed: %s", job.job_id, e)
            except Exception:  # a bug: the job still reports, as failed
                log.exception("kvtier tier: job %s failed", job.job_id)
            self._done.put((job, loaded, time.monotonic() - start))
            with self._idle:
                self._running -= 1
                if not job.load:
                    self._queued_stores -= 1
                self._idle.notify_all()

    def _submit(self, job_metadata: TransferJob, load: bool) -> None:
        ctx = getattr(job_metadata, "req_context", None)
        job = _Job(job_metadata.job_id, load, list(job_metadata.keys),
                   [int(c) for c in job_metadata.chunk_ids],
                   getattr(ctx, "req_id", None))
        with self._idle:
            self._unreported += 1
            if not load and self._queued_stores >= self._max_queued_stores:
                # The store is behind: the job fails at once (its rows stay
                # in vLLM's CPU tier) instead of queueing without bound.
                self.stores_refused += 1
                self._done.put((job, None, 0.0))
                now = time.monotonic()
                if now - self._last_refusal_log >= 10.0:
                    self._last_refusal_log = now
                    log.warning("kvtier tier: %d store jobs queued (the "
                                "max_queued_stores bound); store jobs fail "
                                "until the store catches up (%d so far)",
                                self._queued_stores, self.stores_refused)
                return
            self._running += 1
            if not load:
                self._queued_stores += 1
        self._seq += 1
        self._queue.put((0 if load else 1, self._seq, job))

    # ------------------------------------------------- vLLM's tier interface

    def on_new_request(self, req_context: ReqContext
                       ) -> RequestOffloadingContext:
        """vLLM's P/D keys: a ``remote_decoder`` (prefill) request stores
        every row of its prompt, prefix hits too (REQUEST_LEVEL), so a
        decode engine finds the whole prompt in the store; a
        ``remote_prefiller`` (decode) request waits for its rows (lookup).
        The handoff's medium is the store: ``remote_host`` /
        ``remote_port`` are not used."""
        role = self._pd.start(req_context.req_id,
                              req_context.kv_transfer_params)
        if role == "prefill":
            return RequestOffloadingContext(policy=OffloadPolicy.REQUEST_LEVEL)
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext
               ) -> LookupResult:
        """HIT or MISS once this step's batch was answered; RETRY before.
        A decode request (``remote_prefiller``) gets RETRY for each key
        the store does not hold yet, until its rows are found or
        ``handoff_wait_ms`` has passed (then ordinary lookups: what is
        missing is computed); a row is seen only once committed, so no
        row the prefill is still writing is ever loaded."""
        if not self._seed_checked:
            self._seed_checked = True
            warn_if_seeded_at_random(self.locality)
        seen = self._pd.lookup(req_context.req_id, key)
        if seen is not None:
            return LookupResult.HIT if seen else LookupResult.MISS
        if self._pd.waiting(req_context.req_id):
            return LookupResult.RETRY
        result = self._lookups.lookup(key, req_context)
        if result is None:
            return LookupResult.RETRY
        return LookupResult.HIT if result else LookupResult.MISS

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        """Sends this step's lookups as one batch, and one probe for the
        waiting handoffs' keys (each handoff at most once in flight and at
        most every HANDOFF_PROBE_INTERVAL_S). A handoff whose request vLLM
        scheduled this step, or whose wait has run out, ends here: its
        lookups are over."""
        self._lookups.flush()
        self._pd.schedule_end(context.new_req_ids)

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)
        self._pd.finished(req_context.req_id)

    def submit_store(self, job_metadata: TransferJob) -> None:
        """Queues rows ``chunk_ids`` for the store (keys it holds are not
        sent again)."""
        self._submit(job_metadata, load=False)

    def submit_load(self, job_metadata: TransferJob) -> None:
        """Queues a promotion: the keys' blocks into rows ``chunk_ids``."""
        self._submit(job_metadata, load=True)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        """Each finished job once: success, or the keys that made it (a
        load keeps the leading blocks it verified; the rest are misses
        from now on)."""
        results = []
        while True:
            try:
                job, moved, took = self._done.get_nowait()
            except queue.Empty:
                break
            with self._idle:
                self._unreported -= 1
            ok = moved is not None and moved == len(job.keys)
            kept = job.keys[:moved] if moved else []
            if job.load and not ok:
                self._lookups.mark_miss(job.keys[len(kept):])
                self._pd.load_failed(job.req_id or "", job.keys[len(kept):])
            if not job.load and ok and self._events is not None:
                self._events.append(OffloadingEvent(
                    keys=list(job.keys), medium=self.medium, removed=False,
                    locality=self.locality, ownership=self.tier_type))
            results.append(JobResult(
                job_id=job.job_id, success=ok,
                successful_keys=(tuple(kept) if job.load and not ok and kept
                                 else None),
                transfer_time=took,
                transfer_bytes=(moved or 0) * self._row_bytes or None))
        return results

    def drain_jobs(self) -> None:
        """Waits until no job is queued or moving rows; their results stay
        for get_finished_jobs."""
        with self._idle:
            self._idle.wait_for(lambda: self._running == 0)

    def has_pending_work(self) -> bool:
        """Jobs not yet reported, or a handoff still waiting (vLLM keeps
        stepping, so its lookups are asked again)."""
        if self._pd.pending():
            return True  # on_schedule_end ends it at its deadline
        with self._idle:
            return self._unreported > 0

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self._events:
            events, self._events = self._events, []
            yield from events

    def shutdown(self) -> None:
        """Finishes queued jobs, stops the threads and releases the store
        client and the region (vLLM unmaps it next)."""
        self.drain_jobs()
        for _ in self._threads:
            self._queue.put((2, 0, None))
        for t in self._threads:
            t.join(timeout=30)
        self._lookups.shutdown()
        self._pd.close()
        self._store = None
        self._region = np.empty(0, dtype=np.uint8)
