"""The worker side of kvtier's vLLM connector: the hooks vLLM calls in
each GPU worker process (register the KV memory, start the step's loads,
copy the step's saves out, report ended loads and failed pages, shut down)
and the metadata the scheduler side sends them.

:class:`WorkerHooks` is a mixin of :class:`kvtier.integrations.vllm.KvtierConnector`;
it relies on the attributes the connector's ``__init__`` sets (``_stores``,
``_opts``, ``_staging``, ``_load_threads``, ``_pin_wait_ms``,
``_namespaces``, ``_primary``, ``_workers``, ``_group_loads``,
``_load_errors``, ``_scheduler``, ``_thread_cpus``) and on vLLM's base
class for the bound metadata. Every decision is in kvtier.worker_half.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import kvtier
from kvtier.cpus import bound_cpus, process_cpus, resolve, threads_on
from kvtier.hooks import SchedulerHalf, StepMeta, WorkerHalf
from kvtier.integrations.vllm_base import (KVConnectorBase_V1,
                                           KVConnectorMetadata)
from kvtier.integrations.vllm_groups import GroupLoads
from kvtier.integrations.vllm_handoff import moved_since
from kvtier.integrations.vllm_pages import cuda_stream_fence, engine_tensors
from kvtier.save_lane import SaveLane

log = logging.getLogger("vllm.kvtier")

#: How often a worker reads its connectors' store counters at most.
STORE_COUNTS_EVERY_S = 0.25


@dataclass
class KvtierConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One step's plan, from the scheduler process to the workers."""

    step: StepMeta = field(default_factory=StepMeta)
    # A hybrid model's plan per KV cache group (the primary's is ``step``),
    # and the requests whose load fails in some group; empty otherwise.
    groups: list[StepMeta] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)



def vllm_reserved_cpus(vllm_config: Any) -> frozenset[int]:
    """The CPUs vLLM's CPU build keeps free of compute when it binds its
    OpenMP threads itself (``VLLM_CPU_OMP_THREADS_BIND`` "auto", its
    default): those this process may use less every local rank's compute
    CPUs (its ``OMPProcessManager``'s lists, from the same config and
    environment). Empty where the binding was given by hand (the other
    cores may be another engine's), where vLLM binds nothing (a GPU
    platform; the ``uni`` executor, whose worker computes in the engine
    core's process, unbound: vLLM binds only the worker processes it
    starts), or without such a class."""
    try:
        from vllm.platforms import current_platform
        from vllm.utils.ompmultiprocessing import OMPProcessManager
        backend = getattr(getattr(vllm_config, "parallel_config", None),
                          "distributed_executor_backend", None)
        if not current_platform.is_cpu() or backend == "uni":
            return frozenset()
        m = OMPProcessManager(vllm_config)
        if not getattr(m, "auto_setup", False):
            return frozenset()
        compute = {int(c) for cpus in m.cpu_lists for c in cpus}
        return process_cpus() - compute
    except Exception:  # another vLLM, or none
        return frozenset()


def _run_all(calls: list[Any]) -> None:
    for call in calls:
        call()


class WorkerHooks(KVConnectorBase_V1):  # type: ignore[misc]
    """vLLM's worker-side connector hooks over kvtier's WorkerHalf (see the
    module docstring)."""

    _stores: list[str]
    _opts: dict[str, Any]
    _staging: int
    _load_threads: int
    _pin_wait_ms: float
    _primary: int
    _scheduler: Optional[SchedulerHalf]
    _workers: list[WorkerHalf]
    _worker: Optional[WorkerHalf]
    _namespaces: list[Any]
    _group_loads: GroupLoads
    _load_errors: set[int]
    _lane: Optional[SaveLane]
    _save_queue_blocks: int
    _save_budget_ms: float
    _offload_nice: int
    _thread_cpus: str
    _store_taken: dict[str, int]
    _store_read_at: float


    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """A kvtier.Connector over vLLM's KV memory.

        vLLM 0.26 and later: each layer is a 4-D view ``[blocks, heads,
        tokens, K|V]`` of one buffer shared by the layers (``kv_cache_config``
        says which layers, in which order). A block's page of a layer is one
        contiguous range in every layout kvtier accepts, so kvtier moves it
        whole, as opaque bytes (the namespace records the layout). Older
        vLLM: 5-D ``[2, blocks, ...]`` or ``[blocks, 2, ...]`` tensors."""
        kc = self._kv_config()
        cpus = frozenset[int]()
        computes = bound_cpus()   # before kvtier binds threads of its own
        for g, ns in enumerate(self._namespaces):
            tensors, layout = engine_tensors(kv_caches, kc, g, ns)
            # CPU pages: kvtier's threads off the cores vLLM computes on.
            cpus = (frozenset() if tensors[0].is_cuda else
                    resolve(self._thread_cpus, 'kv_connector_extra_config: '
                            '"thread_cpus"', vllm_reserved_cpus(
                                getattr(self, "_vllm_config", None))))
            with threads_on(cpus):
                conn = kvtier.Connector(ns, tensors, stores=self._stores,
                                        layout=layout,
                                        staging_blocks=self._staging,
                                        offload_nice=self._offload_nice,
                                        **self._opts)
            # CUDA pages: every copy ordered after the engine's stream work
            # (kvtier.worker_half, "Ordered against the engine's stream").
            fence = cuda_stream_fence if tensors[0].is_cuda else None
            self._workers.append(WorkerHalf(
                conn, load_threads=self._load_threads, stream_fence=fence,
                pin_wait_ms=self._pin_wait_ms, cpus=cpus))
            log.info("kvtier connector: namespace %016x (%s), %d layers of "
                     "%d pages, stores %s", ns.id,
                     ns.layout or "kvtier's layout", len(tensors),
                     conn.num_pages, ",".join(self._stores))
        self._worker = self._workers[self._primary]
        with threads_on(cpus):
            self._lane = SaveLane(self._save_queue_blocks,
                                  self._save_budget_ms)
        if cpus:
            log.info("kvtier connector: its threads on CPUs %s (vLLM "
                     "computes on %s)", ",".join(map(str, sorted(cpus))),
                     ",".join(map(str, sorted(computes))))

    def store_counts(self) -> dict[str, int]:
        """Of this worker's saves, the blocks the store wrote
        (``store_written_blocks``) and those it did not
        (``store_refused_blocks``: a failed put, no room, or busy under
        another writer), and the blocks loads were planned for that did
        not load (``load_failed_blocks``), since the last call; only those
        not 0. Copied (``saved_blocks``) is not stored: this says whether
        saves land.
        The connectors are read every ``STORE_COUNTS_EVERY_S`` at most
        (vLLM asks every step; reading them costs the step)."""
        t = time.monotonic()
        if t - self._store_read_at < STORE_COUNTS_EVERY_S:
            return {}
        self._store_read_at = t
        now = {"store_written_blocks": 0, "store_refused_blocks": 0,
               "load_failed_blocks": 0}
        for w in self._workers:
            now["load_failed_blocks"] += w.failed_load_blocks
            s = w.connector.stats()
            now["store_written_blocks"] += s["offloaded_blocks"]
            now["store_refused_blocks"] += (s["offload_failures"] +
                                            s["offload_no_space"] +
                                            s["offload_busy"])
        taken, self._store_taken = self._store_taken, now
        return moved_since(now, taken)

    def _kv_config(self) -> Any:
        """vLLM's KVCacheConfig when it carries a layout (vLLM 0.26 and
        later), else None (the older per-layer tensors)."""
        kc = getattr(self, "_kv_cache_config", None)
        if kc is None or not hasattr(kc, "kv_cache_layout"):
            return None
        return kc

    def _metadata(self) -> KvtierConnectorMetadata:
        """This step's metadata, as our scheduler half built it."""
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvtierConnectorMetadata):
            raise TypeError(f"kvtier's connector got {type(meta).__name__} "
                            "metadata, not its own")
        return meta

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        """The step's plan, before its forward: pages vLLM took back since
        the last step (preempted requests, finishes it did not hold) get
        no copy from here on; returns once none of theirs runs."""
        super().bind_connector_metadata(connector_metadata)
        if self._lane is not None and isinstance(connector_metadata,
                                                 KvtierConnectorMetadata):
            self._lane.release(set(connector_metadata.step.released))

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Starts this step's loads on the loader threads (pin, move,
        verify), in every KV cache group; returns at once."""
        assert self._worker is not None
        meta = self._metadata()
        if not meta.groups:
            self._worker.start_loads(meta.step)
            return
        # Counted before any starts: a group's load may end at once.
        self._group_loads.expect_step(meta.groups, meta.failed)
        for worker, step in zip(self._workers, meta.groups):
            worker.start_loads(step)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: a request's KV is loaded, and verified,
        before vLLM schedules it."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any,
                      attn_metadata: Any, **kwargs: Any) -> None:
        """Nothing per layer: whole blocks are saved in wait_for_save."""

    def wait_for_save(self) -> None:
        """This step's saves, in every KV cache group, handed to the save
        lane (copied out after the step; vLLM keeps a finished request's
        pages until :meth:`get_finished` reports it sent), and its
        finished requests, closed after their copies. Returns at once."""
        assert self._worker is not None and self._lane is not None
        meta = self._metadata()
        steps = meta.groups or [meta.step]
        for worker, step in zip(self._workers, steps):
            worker.queue_saves(step, self._lane)
        for key in meta.step.finished:
            closes = [functools.partial(w.finished, key)
                      for w, step in zip(self._workers, steps)
                      if key in step.finished]
            self._lane.finish(key, functools.partial(_run_all, closes),
                              meta.step.held.get(key))

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[Optional[set[str]], Optional[set[str]]]:
        """Finished requests whose saves were all copied out since the last
        call (vLLM held their pages for them), and requests whose load
        ended (loaded and verified, or failed: their failed pages are
        reported by :meth:`get_block_ids_with_load_errors` in the same
        pass)."""
        if self._worker is None or self._lane is None:
            return None, None
        names, failed = self._worker.finished_loads()
        self._load_errors |= failed
        return (self._lane.sent() or None), (names or None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """vLLM 0.32's report of ended loads. A hybrid model's request has
        loaded when every group's load ended; one that failed in any group
        is in ``failed_recving`` (vLLM recomputes it whole: it takes no
        per-block errors from a model with several groups)."""
        if len(self._workers) <= 1:
            return super().get_transfer_results(finished_req_ids)
        from vllm.distributed.kv_transfer.kv_connector.v1.base import \
            KVConnectorTransferResults
        for worker in self._workers:
            for name, failed in worker.ended_loads():
                self._group_loads.ended(name, bool(failed))
        names, failed_names = self._group_loads.done()
        sent = self._lane.sent() if self._lane is not None else set()
        return KVConnectorTransferResults(finished_sending=sent,
                                          finished_recving=names,
                                          failed_recving=failed_names)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Pages whose load failed (evicted since the lookup, a checksum
        mismatch, the store gone): vLLM recomputes their blocks. None for
        a hybrid model (its failures are whole requests)."""
        if self._worker is None or len(self._workers) > 1:
            return set()
        errors, self._load_errors = self._load_errors, set()
        return errors | self._worker.load_error_pages()

    def shutdown(self) -> None:
        """Copies out queued saves (within their budget), closes open
        requests (their saves are written) and the connectors; the
        scheduler's lookup thread ends."""
        if self._scheduler is not None:
            self._scheduler.close()
        if self._lane is not None:
            self._lane.close()
        for worker in self._workers:
            worker.close()
            worker.connector.close()
