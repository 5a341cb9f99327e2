"""Prefill/decode handoff through the store, for kvtier's vLLM connector
(docs/disaggregation.md), in the protocol of :mod:`kvtier.integrations.pd`
(shared with the offloading tier).

A prefill engine (``kv_role`` ``kv_producer``, or any engine asked with
``remote_decoder`` or ``do_remote_decode``) saves a prompt's blocks as it
computes them and answers with the decode's keys and kvtier's fence
(:func:`kvtier.integrations.pd.producer_params`): the namespace and the
number of the prompt's leading blocks that are in the store or on their
way there. A decode engine given those params (or ``remote_prefiller``
alone: then the prompt's whole blocks) waits, within its budget
(``handoff_wait_ms``), until the store shows that many blocks (a block is
visible to a lookup only once its write committed, on every TP rank), then
loads them; past the budget it loads what is there and computes the rest.
Each outcome is counted (:class:`HandoffCounts`) and exported through
vLLM's own Prometheus endpoint (:class:`KvtierPromMetrics`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from kvtier.integrations.pd import (Fence, HandoffAsk, not_sent_params,
                                    producer_params, read_handoff)

# A child of vLLM's own logger, so the lines appear with vLLM's.
log = logging.getLogger("vllm.kvtier")

#: A decode waiting on a fence asks the store again at most this often.
RETRY_S = 0.005
#: Outcomes of a decode's handoff (the ``outcome`` label).
OUTCOMES = ("loaded", "partial", "computed", "invalid", "other_namespace")


@dataclass
class Waiting:
    """A decode request waiting on its fence."""

    fence: Fence
    since: float = field(default_factory=time.monotonic)
    next_ask: float = 0.0
    asks: int = 0        # lookups settled so far
    unanswered: int = 0  # of them, late, skipped or failed
    most: int = 0        # the most leading blocks one found


class HandoffCounts:
    """The connector's handoff counters since they were last taken: sent
    (prefills that returned a fence), each decode outcome, the blocks a
    fence named that the decode computed, and the seconds decodes waited."""

    def __init__(self) -> None:
        self.values: dict[str, float] = {}

    def add(self, name: str, value: float = 1) -> None:
        """Adds ``value`` to counter ``name``."""
        self.values[name] = self.values.get(name, 0) + value

    def take(self) -> dict[str, float]:
        """The counts since the last take (empty when none)."""
        out, self.values = self.values, {}
        return out


class Handoffs:
    """kvtier's handoff on a connector's scheduler side: the fence a prefill
    returns (:meth:`params`) and a decode's wait on one (:meth:`waiting`,
    :meth:`settle`), with their counters (``counts``). ``role``: vLLM's
    ``kv_role`` (a ``kv_producer`` hands every prompt on; a
    ``kv_consumer`` saves nothing); ``wait_s``: a decode's budget
    (``handoff_wait_ms``). Not thread-safe (vLLM's scheduler thread)."""

    def __init__(self, role: str, wait_s: float, namespace_id: int,
                 block_tokens: int) -> None:
        self.role = role
        self.saves = role != "kv_consumer"
        self.wait_s = wait_s
        self.namespace_id = namespace_id
        self.block_tokens = block_tokens
        self.counts = HandoffCounts()
        self._fences: dict[str, Optional[Waiting]] = {}

    def waiting(self, rid: str, params: Any,
                prompt_tokens: int) -> Optional[Waiting]:
        """The fence request ``rid`` waits on (None: none, or settled).
        Malformed params or another namespace's are logged, counted and
        ignored: the request is served as an ordinary one."""
        if rid in self._fences:
            return self._fences[rid]
        ask = read_handoff(params, prompt_tokens, self.block_tokens)
        fence = ask.fence
        wait = None
        if ask.problem:
            self.counts.add("invalid")
            log.warning("kvtier handoff of request %s ignored: %s", rid,
                        ask.problem)
        elif fence is not None and fence.namespace is None:
            wait = Waiting(Fence(self.namespace_id, fence.blocks))
        elif fence is not None and fence.namespace != self.namespace_id:
            self.counts.add("other_namespace")
            log.warning("kvtier handoff of request %s ignored: its prefill "
                        "wrote namespace %016x, this engine reads %016x "
                        "(another model, dtype, layout or TP size)", rid,
                        fence.namespace, self.namespace_id)
        elif fence is not None:
            wait = Waiting(fence)
        self._fences[rid] = wait
        return wait

    def settle(self, rid: str, wait: Waiting, have: int, loads: bool,
               prompt_tokens: int, now: float,
               unreachable: bool = False, answered: bool = True) -> bool:
        """A decode holds ``have`` leading blocks (its own and the store's;
        ``loads``: any of them from the store): True to ask again later
        (the fence unmet within the budget, and the store reachable), else
        the handoff is settled (counted, and the rest computed).
        ``unreachable``: the lookup found no store to ask (refused): the
        prefill's writes cannot land there either, so the decode computes
        at once instead of waiting out its budget. ``answered``: the lookup
        got the store's answer (counted for the log line of a miss)."""
        need = min(wait.fence.blocks, (prompt_tokens - 1) // self.block_tokens)
        waited = now - wait.since
        wait.asks += 1
        wait.unanswered += not answered
        wait.most = max(wait.most, have)
        if have < need and waited < self.wait_s and not unreachable:
            wait.next_ask = now + RETRY_S
            return True
        self._fences[rid] = None  # settled: a preempted request asks afresh
        self.counts.add("loaded" if have >= need else
                        "partial" if loads else "computed")
        self.counts.add("wait_seconds", waited)
        if have < need:
            self.counts.add("computed_blocks", need - have)
            log.warning("kvtier handoff of request %s: %d of the %d blocks "
                        "the prefill wrote were in the store after %.0f ms%s "
                        "(%d lookups, %d unanswered, at most %d blocks "
                        "found); computing the rest", rid, have, need,
                        waited * 1e3,
                        " (the store could not be reached)" if unreachable
                        else "", wait.asks, wait.unanswered, wait.most)
        return False

    def hands_on(self, request_params: Any, prompt_tokens: int) -> bool:
        """Whether a request's prompt goes on to a decode engine through
        the store (a ``kv_producer``'s, or one asked as a prefill): its
        saves are what that decode waits ``wait_s`` for."""
        return self._hands_on(read_handoff(request_params, prompt_tokens,
                                           self.block_tokens))

    def _hands_on(self, ask: HandoffAsk) -> bool:
        return self.saves and (self.role == "kv_producer" or
                               ask.role == "prefill")

    def params(self, rid: str, request_params: Any, store_missed: bool,
               stored_blocks: int, prompt_tokens: int
               ) -> Optional[dict[str, Any]]:
        """The ``kv_transfer_params`` a finished prefill returns (None when
        it hands nothing on): a ``kv_producer``'s or a prefill request's
        decode keys and fence, the blocks the store holds or this engine
        saved; "not sent" when its store did not answer (its saves would not
        land, and a decode would wait its budget for them)."""
        ask = read_handoff(request_params, prompt_tokens, self.block_tokens)
        if not self._hands_on(ask):
            return None
        if store_missed:
            self.counts.add("not_sent")
            log.warning("kvtier handoff of request %s not sent: the store "
                        "did not answer its lookup", rid)
            return not_sent_params("the prefill's store did not answer its "
                                   "lookup")
        self.counts.add("sent")
        return producer_params(self.namespace_id, stored_blocks,
                               prompt_tokens, self.block_tokens,
                               ask.kv_request_id or rid)

    def forget(self, rid: str) -> None:
        """Request ``rid`` ended."""
        self._fences.pop(rid, None)

    @staticmethod
    def idle_pause(seconds: float, running: bool) -> None:
        """While requests wait on fences and none runs, vLLM's engine loop
        would step empty steps as fast as it can, taking a core from the
        prefill engine's background writes (they run at low priority) that
        the fences wait for: with nothing ``running``, the scheduler sleeps
        until the next ask instead."""
        if not running and seconds > 0:
            time.sleep(min(seconds, RETRY_S))


try:  # vLLM's stats classes; kvtier imports without vLLM.
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics, KVConnectorStats)
except ImportError:  # pragma: no cover - exercised where vLLM is absent
    KVConnectorStats = object  # type: ignore[assignment,misc]
    KVConnectorPromMetrics = object  # type: ignore[assignment,misc]


@dataclass
class KvtierStats(KVConnectorStats):  # type: ignore[misc,valid-type]
    """kvtier's counters as vLLM carries connector stats from the engine
    core to its loggers: a flat ``{name: number}``, summed on aggregation."""

    data: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        """Empties the counters."""
        self.data = {}

    def aggregate(self, other: Any) -> "KvtierStats":
        """Adds another interval's counters to these."""
        for k, v in getattr(other, "data", {}).items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        """The counters, for vLLM's periodic log line."""
        return dict(self.data)

    def is_empty(self) -> bool:
        """Whether nothing was counted."""
        return not self.data


#: Prometheus names of the counters (vLLM's ``vllm:`` prefix).
SENT = "vllm:kvtier_handoffs_sent_total"
NOT_SENT = "vllm:kvtier_handoffs_not_sent_total"
DECODED = "vllm:kvtier_handoffs_total"
MISSING = "vllm:kvtier_handoff_computed_blocks_total"
WAITED = "vllm:kvtier_handoff_wait_seconds_total"
SAVED = "vllm:kvtier_saved_blocks_total"
SKIPPED = "vllm:kvtier_save_skipped_blocks_total"
WRITTEN = "vllm:kvtier_store_written_blocks_total"
REFUSED = "vllm:kvtier_store_refused_blocks_total"
LOOKUPS = "vllm:kvtier_lookups_total"
LOAD_FAILED = "vllm:kvtier_load_failed_blocks_total"

#: A lookup's outcome (the ``outcome`` label of LOOKUPS, counted as stats
#: key ``lookups_<outcome>``) and the scheduler's counter of it
#: (:class:`kvtier.scheduler_half.SchedulerHalf`).
LOOKUP_OUTCOMES: dict[str, str] = {
    "answered": "lookups_answered",
    "late": "lookups_late",
    "not_asked": "lookups_not_asked",
    "failed": "lookup_errors",
    "not_needed": "lookups_skipped",
}

#: The counters with a label: a stats key ``<prefix><value>`` counts
#: ``value`` of the label (the prefix's Prometheus name, label and help).
LABELLED: dict[str, tuple[str, str, str]] = {
    "save_skipped_": (
        SKIPPED, "reason", "Blocks computed and not saved, by reason: "
        "behind (the copies queued were full), late (past save_budget_ms), "
        "store_behind (no staging in time), released (vLLM took the pages "
        "back), gap (an earlier block of the request was not saved), "
        "failed, unseen (save_policy seen_twice: no earlier prompt had the "
        "prefix)."),
    "lookups_": (
        LOOKUPS, "outcome", "Store lookups, by outcome (a decode waiting on "
        "a handoff's fence asks again until its blocks are there): "
        "answered, late (no answer within lookup_wait_ms: the request "
        "computed its prompt), not_asked (the client skipped a store that "
        "missed a budget), failed, not_needed (a router's hint said the "
        "store holds nothing past the engine's own prefix)."),
}


def moved_since(now: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """Each counter of ``now`` less its value in ``before`` (0 when
    absent), only those that moved."""
    return {k: v - before.get(k, 0) for k, v in now.items()
            if v != before.get(k, 0)}


#: The counters without labels of their own: the stats key each counts,
#: its Prometheus name and its help.
PLAIN: dict[str, tuple[str, str]] = {
    "sent": (SENT, "Prefills whose KV kvtier handed to a decode engine (a "
             "fence returned)."),
    "not_sent": (NOT_SENT, "Prefills asked for a handoff that returned "
                 "none: the store did not answer their lookup."),
    "computed_blocks": (MISSING, "Blocks a handoff's fence named that the "
                        "decode computed itself."),
    "wait_seconds": (WAITED, "Seconds decode requests waited on fences."),
    "saved_blocks": (SAVED, "Blocks copied out of the engine's pages for "
                     "the store, behind the step."),
    "store_written_blocks": (WRITTEN, "Blocks copied out for the store "
                             "that the store wrote."),
    "store_refused_blocks": (REFUSED, "Blocks copied out for the store that "
                             "it did not write: the put failed, it had no "
                             "room, or they were busy under another "
                             "writer's reservation."),
    "load_failed_blocks": (LOAD_FAILED, "Blocks a lookup found that did not "
                           "load (evicted since, the store slow or gone): "
                           "the engine computed them."),
}


class KvtierPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc,valid-type]
    """kvtier's handoff counters on vLLM's ``/metrics``:
    ``vllm:kvtier_handoffs_sent_total`` (prefills that returned a fence),
    ``vllm:kvtier_handoffs_not_sent_total`` (prefills whose store did not
    answer: no fence),
    ``vllm:kvtier_handoffs_total{outcome}`` (decodes by outcome: loaded,
    partial, computed, invalid, other_namespace),
    ``vllm:kvtier_handoff_computed_blocks_total`` (blocks a fence named
    that a decode computed), ``vllm:kvtier_handoff_wait_seconds_total``,
    ``vllm:kvtier_saved_blocks_total`` (blocks copied out for the store,
    behind the step), ``vllm:kvtier_store_written_blocks_total`` and
    ``vllm:kvtier_store_refused_blocks_total`` (of those, the blocks the
    store wrote, and those it did not: a failed put, no room, busy under
    another writer) and ``vllm:kvtier_save_skipped_blocks_total{reason}``
    (blocks not saved: :data:`kvtier.save_lane.SKIP_REASONS`, and
    ``unseen``: under ``save_policy`` "seen_twice", blocks of a prefix no
    earlier prompt had), ``vllm:kvtier_lookups_total{outcome}`` (store
    lookups: :data:`LOOKUP_OUTCOMES`) and
    ``vllm:kvtier_load_failed_blocks_total``."""

    def __init__(self, vllm_config: Any, metric_types: dict[Any, Any],
                 labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames,
                         per_engine_labelvalues)
        counter: Any = self._counter_cls
        self._plain: dict[str, Any] = {
            key: counter(name=name, labelnames=self._labelnames,
                         documentation=doc)
            for key, (name, doc) in PLAIN.items()}
        self._decoded: Any = counter(
            name=DECODED, labelnames=self._labelnames + ["outcome"],
            documentation="Decode requests given a kvtier handoff, by "
            "outcome: loaded (every fenced block), partial (the budget "
            "ran out with some), computed (with none), invalid (malformed "
            "params), other_namespace (another model or layout).")
        self._labelled: dict[str, Any] = {
            prefix: counter(name=name, labelnames=self._labelnames + [label],
                            documentation=doc)
            for prefix, (name, label, doc) in LABELLED.items()}

    def observe(self, transfer_stats_data: dict[str, Any],
                engine_idx: int = 0) -> None:
        """Adds one interval's counters to the engine's series."""
        labels = self.per_engine_labelvalues[engine_idx]
        for name, value in transfer_stats_data.items():
            if not value:
                continue
            prefix = next((p for p in LABELLED if name.startswith(p)), None)
            if prefix is not None:
                self._labelled[prefix].labels(
                    *labels, name[len(prefix):]).inc(value)
            elif name in OUTCOMES:
                self._decoded.labels(*labels, name).inc(value)
            elif name in self._plain:
                self._plain[name].labels(*labels).inc(value)


class HandoffStatsHooks:
    """vLLM's connector hooks for kvtier's handoff counters (a mixin of
    :class:`kvtier.integrations.vllm.KvtierConnector`, whose scheduler
    side holds a :class:`Handoffs` as ``_handoffs``)."""

    _handoffs: Handoffs  # set on the scheduler side only

    def get_kv_connector_stats(self) -> Optional[KvtierStats]:
        """The scheduler's handoff counters, or a worker's save counters
        (:meth:`kvtier.save_lane.SaveLane.take_counts`), since the last call
        (vLLM carries them to its loggers and to ``/metrics``)."""
        handoffs: Optional[Handoffs] = getattr(self, "_handoffs", None)
        data: dict[str, float] = (dict(handoffs.counts.take())
                                  if handoffs is not None else {})
        data.update(self._lookup_counts())
        lane = getattr(self, "_lane", None)
        if lane is not None:
            data.update(lane.take_counts())
            data.update(self.store_counts())  # type: ignore[attr-defined]
        return KvtierStats(data=data) if data else None

    def _lookup_counts(self) -> dict[str, float]:
        """The scheduler's lookups by outcome since the last call, as
        ``lookups_<outcome>`` (only those not 0; none on a worker)."""
        scheduler = getattr(self, "_scheduler", None)
        if scheduler is None:
            return {}
        now = {f"lookups_{outcome}": getattr(scheduler, attr)
               for outcome, attr in LOOKUP_OUTCOMES.items()}
        taken: dict[str, float] = getattr(self, "_lookups_taken", {})
        self._lookups_taken = now
        return moved_since(now, taken)

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[dict[str, Any]] = None
                                 ) -> KvtierStats:
        """kvtier's stats from their wire form."""
        return KvtierStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any,
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]
                           ) -> KvtierPromMetrics:
        """kvtier's counters on vLLM's ``/metrics``
        (:class:`KvtierPromMetrics`)."""
        return KvtierPromMetrics(vllm_config, metric_types, labelnames,
                                 per_engine_labelvalues)
