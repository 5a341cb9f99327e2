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

Tier keys (beside vLLM's ``type``, ``module_path``, ``backpressure``):
``stores`` (required: comma-separated HOST:PORT or a list), ``deadline_ms``
(10000), ``shared_memory`` ("auto", "on", "off"), ``tls_ca`` /
``tls_cert`` / ``tls_key``, ``io_threads`` (2: loads go first),
``locality`` ("REMOTE": the store is shared by every engine; or "LOCAL"),
``enable_kv_events`` (true). Any other key is refused with a message that
names it.

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
  groups, vLLM's row layout (canonical or per rank, replicated MLA) and the
  parallel layout (world size, TP, PP, PCP, DCP), so rows of another layout
  or version are never read as these.
- A store that is down (at start-up too) is a miss for every lookup and a
  failed job; the tier keeps serving and uses the store once it answers.
- Events: a stored row is reported (``take_events``) with medium STORAGE
  and the tier's locality, when vLLM's KV events are on.

Engines that share rows through the store must hash blocks the same way:
vLLM's default sha256 block hash is seeded from a fixed value unless
``PYTHONHASHSEED`` is set (then set it alike on every engine).
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, ClassVar, Iterable, Optional, Sequence

import numpy as np

import kvtier
from kvtier.errors import (DataLoss, InvalidArgument, KvtierError, NotFound,
                           StatusCode)
from kvtier.hooks import store_options

from vllm import __version__ as _vllm_version
from vllm.v1.kv_offload.base import (Locality, LookupResult, Medium,
                                     OffloadingEvent, OffloadKey, ReqContext)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import (JobId, JobResult,
                                             RequestOffloadingContext,
                                             ScheduleEndContext,
                                             SecondaryTierManager,
                                             TransferJob)

# A child of vLLM's own logger, so the tier's lines appear with vLLM's.
log = logging.getLogger("vllm.kvtier")

#: The tier's own keys in its JSON entry (vLLM takes type, module_path and
#: backpressure out before it builds the tier).
TIER_KEYS = ("stores", "deadline_ms", "shared_memory", "tls_ca", "tls_cert",
             "tls_key", "io_threads", "locality", "enable_kv_events")

_DTYPES = {"float16": "fp16", "half": "fp16", "bfloat16": "bf16",
           "fp8": "fp8", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2",
           "uint8": "fp8"}

#: Rows are page multiples; the namespace sizes a row as PAGE-byte units.
_PAGE = 4096


def _bad(key: str, message: str) -> InvalidArgument:
    return InvalidArgument(StatusCode.INVALID_ARGUMENT,
                           f"kvtier tier config \"{key}\": {message}")


def tier_namespace(offloading_spec: Any, row_bytes: int) -> kvtier.Namespace:
    """The kvtier namespace of one vLLM deployment's offload rows.

    A row is opaque bytes to kvtier: the geometry fields only size it
    (1 layer, 1 head, ``row_bytes / 4096`` tokens of 4096 bytes), and the
    layout field names everything that decides what the bytes mean.
    InvalidArgument for a dtype kvtier does not store or a row size that is
    not a multiple of 4096 bytes up to 256 MiB."""
    cfg = offloading_spec.config
    dtype = str(cfg.model.dtype).replace("torch.", "")
    if dtype not in _DTYPES:
        raise InvalidArgument(
            StatusCode.INVALID_ARGUMENT,
            f"vLLM's KV dtype {dtype} is not one kvtier stores "
            f"(supported: {', '.join(sorted(_DTYPES))})")
    kv_dtype = _DTYPES[dtype]
    elem = 1 if kv_dtype.startswith("fp8") else 2
    if (row_bytes <= 0 or row_bytes % _PAGE
            or row_bytes // _PAGE > kvtier._native.MAX_BLOCK_TOKENS):
        raise InvalidArgument(
            StatusCode.INVALID_ARGUMENT,
            f"vLLM's offload rows are {row_bytes} bytes; kvtier stores rows "
            f"of a multiple of {_PAGE} bytes up to 256 MiB")
    p = cfg.parallel
    groups = hashlib.blake2b(repr(tuple(
        (g.group_id, g.tokens_per_block, tuple(g.layer_names))
        for g in cfg.groups)).encode(), digest_size=6).hexdigest()
    layout = "|".join([
        f"vllm-offload-row={_vllm_version}",
        f"bytes={row_bytes}",
        f"kv_bytes_per_block={cfg.worker_kv_bytes_per_block}",
        f"tokens_per_hash={cfg.cache.tokens_per_hash}",
        f"blocks_per_chunk={cfg.cache.blocks_per_chunk}",
        f"groups={len(cfg.groups)}:{groups}",
        f"world={p.world_size}", f"tp={p.tp_size}", f"pp={p.pp_size}",
        f"pcp={p.pcp_size}", f"dcp={p.dcp_size}",
        f"replicated={int(bool(getattr(cfg, 'replicated_layout', False)))}",
        f"canonical={int(bool(getattr(cfg, 'canonical_layout', False)))}",
    ])
    return kvtier.Namespace(str(cfg.model.name), kv_dtype, 1, 1,
                            _PAGE // (2 * elem), row_bytes // _PAGE,
                            layout=layout)


def key_hashes(keys: Sequence[OffloadKey]) -> np.ndarray:
    """kvtier block hashes (uint64 [n, 2]) of vLLM offload keys (a block
    hash and a KV group): the first 128 bits of BLAKE2b of the key."""
    out = np.empty((len(keys), 2), dtype=np.uint64)
    for i, key in enumerate(keys):
        d = hashlib.blake2b(bytes(key), digest_size=16).digest()
        out[i, 0] = int.from_bytes(d[:8], "little")
        out[i, 1] = int.from_bytes(d[8:], "little")
    return out


@dataclass
class _Job:
    job_id: JobId
    load: bool
    keys: list[OffloadKey]
    rows: list[int]


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
        for key in config:
            if key not in TIER_KEYS:
                raise _bad(key, "is not a key of the kvtier tier (its keys: "
                           f"{', '.join(TIER_KEYS)})")
        deadline = config.get("deadline_ms", 10000)
        if not isinstance(deadline, int) or deadline <= 0:
            raise _bad("deadline_ms", f"{deadline!r} is not a positive integer")
        stores, opts = store_options(config, "kvtier tier config")
        threads = config.get("io_threads", 2)
        if not isinstance(threads, int) or not 1 <= threads <= 64:
            raise _bad("io_threads", f"{threads!r} is not an integer in 1..64")
        locality = config.get("locality", "REMOTE")
        try:
            self.locality = Locality(str(locality).upper())
        except ValueError:
            raise _bad("locality", f"{locality!r} is not LOCAL or REMOTE") \
                from None
        events = config.get("enable_kv_events", True)
        if not isinstance(events, bool):
            raise _bad("enable_kv_events", f"{events!r} is not true or false")
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
        log.info("kvtier tier: stores %s, namespace %016x, rows of %d bytes",
                 ",".join(stores), self.namespace.id, self._row_bytes)

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
        """Whether the store holds each key: one round trip. The batch is a
        chain in vLLM's order, so keys after the first miss are misses. A
        store that cannot be asked holds nothing."""
        try:
            n = self._call(lambda s: s.lookup(self.namespace,
                                              key_hashes(keys)))
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
                self._idle.notify_all()

    def _submit(self, job_metadata: TransferJob, load: bool) -> None:
        job = _Job(job_metadata.job_id, load, list(job_metadata.keys),
                   [int(c) for c in job_metadata.chunk_ids])
        with self._idle:
            self._running += 1
            self._unreported += 1
        self._seq += 1
        self._queue.put((0 if load else 1, self._seq, job))

    # ------------------------------------------------- vLLM's tier interface

    def on_new_request(self, req_context: ReqContext
                       ) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext
               ) -> LookupResult:
        """HIT or MISS once this step's batch was answered; RETRY before."""
        result = self._lookups.lookup(key, req_context)
        if result is None:
            return LookupResult.RETRY
        return LookupResult.HIT if result else LookupResult.MISS

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        """Sends this step's lookups as one batch."""
        self._lookups.flush()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

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
        self._store = None
        self._region = np.empty(0, dtype=np.uint8)
