"""Prefill/decode handoff through the store, for kvtier's vLLM connector
(docs/disaggregation.md).

A prefill engine (``kv_role`` ``kv_producer``, or any engine asked with
vLLM's ``kv_transfer_params: {"do_remote_decode": true}``) saves a
prompt's blocks as it computes them and answers with
``kv_transfer_params: {"kvtier": {...}}`` (:func:`producer_params`):
the namespace, and the fence: the number of the prompt's leading blocks
that are in the store or on their way there. A decode engine given those
params waits, within its budget (``handoff_wait_ms``), until the store
shows that many blocks (a block is visible to a lookup only once its write
committed), then loads them; past the budget it loads what is there and
computes the rest. Each outcome is counted (:class:`HandoffCounts`) and
exported through vLLM's own Prometheus endpoint
(:class:`KvtierPromMetrics`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

#: The key of kvtier's entry in vLLM's ``kv_transfer_params``.
HANDOFF_KEY = "kvtier"
#: A decode waiting on a fence asks the store again at most this often.
RETRY_S = 0.005
#: Outcomes of a decode's handoff (the ``outcome`` label).
OUTCOMES = ("loaded", "partial", "computed", "invalid", "other_namespace")


def producer_params(namespace_id: int, blocks: int, prompt_tokens: int,
                    block_tokens: int) -> dict[str, Any]:
    """The ``kv_transfer_params`` a prefill returns: its namespace (hex),
    the fence (``blocks``: the prompt's leading blocks in the store or
    being written), the prompt's length and the block size."""
    return {HANDOFF_KEY: {"namespace": f"{namespace_id:016x}",
                          "blocks": int(blocks),
                          "prompt_tokens": int(prompt_tokens),
                          "block_tokens": int(block_tokens)}}


def wants_handoff(params: Any) -> bool:
    """Whether a request's ``kv_transfer_params`` ask this engine to hand
    its prompt's KV to a decode engine (vLLM's ``do_remote_decode``)."""
    return isinstance(params, dict) and params.get("do_remote_decode") is True


@dataclass
class Fence:
    """What a decode waits for: ``blocks`` leading blocks of the prompt in
    namespace ``namespace``."""

    namespace: int
    blocks: int


def read_fence(params: Any, prompt_tokens: int,
               block_tokens: int) -> tuple[Optional[Fence], str]:
    """The fence named by a request's ``kv_transfer_params`` (None when
    they name none), and what was wrong with them ("" when nothing was: a
    request whose kvtier entry is malformed is served as an ordinary one,
    and counted ``invalid``)."""
    if not isinstance(params, dict) or HANDOFF_KEY not in params:
        return None, ""
    entry = params[HANDOFF_KEY]
    if not isinstance(entry, dict):
        return None, f"kv_transfer_params.{HANDOFF_KEY} is not an object"
    ns, blocks = entry.get("namespace"), entry.get("blocks")
    bt, n = entry.get("block_tokens"), entry.get("prompt_tokens")
    try:
        ns_id = int(ns, 16) if isinstance(ns, str) else -1
    except ValueError:
        ns_id = -1
    if not 0 <= ns_id < 1 << 64:
        return None, f"namespace {ns!r} is not 16 hex digits"
    if not isinstance(blocks, int) or isinstance(blocks, bool) or blocks < 0:
        return None, f"blocks {blocks!r} is not a count"
    if bt != block_tokens:
        return None, (f"block_tokens {bt!r} differs from this engine's "
                      f"{block_tokens}")
    if n != prompt_tokens:
        return None, (f"prompt_tokens {n!r} differs from this request's "
                      f"{prompt_tokens} (another prompt's handoff)")
    if blocks * block_tokens > prompt_tokens:
        return None, f"blocks {blocks} exceed the prompt's {prompt_tokens} tokens"
    return Fence(ns_id, blocks), ""


@dataclass
class Waiting:
    """A decode request waiting on its fence."""

    fence: Fence
    since: float = field(default_factory=time.monotonic)
    next_ask: float = 0.0


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


class KvtierPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc,valid-type]
    """kvtier's handoff counters on vLLM's ``/metrics``:
    ``vllm:kvtier_handoffs_sent_total`` (prefills that returned a fence),
    ``vllm:kvtier_handoffs_not_sent_total`` (prefills whose store did not
    answer: no fence),
    ``vllm:kvtier_handoffs_total{outcome}`` (decodes by outcome: loaded,
    partial, computed, invalid, other_namespace),
    ``vllm:kvtier_handoff_computed_blocks_total`` (blocks a fence named
    that a decode computed) and ``vllm:kvtier_handoff_wait_seconds_total``."""

    def __init__(self, vllm_config: Any, metric_types: dict[Any, Any],
                 labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames,
                         per_engine_labelvalues)
        counter: Any = self._counter_cls
        self._sent: Any = counter(name=SENT, labelnames=self._labelnames,
                             documentation="Prefills whose KV kvtier handed "
                             "to a decode engine (a fence returned).")
        self._not_sent: Any = counter(
            name=NOT_SENT, labelnames=self._labelnames,
            documentation="Prefills asked for a handoff that returned none: "
            "the store did not answer their lookup.")
        self._decoded: Any = counter(
            name=DECODED, labelnames=self._labelnames + ["outcome"],
            documentation="Decode requests given a kvtier handoff, by "
            "outcome: loaded (every fenced block), partial (the budget "
            "ran out with some), computed (with none), invalid (malformed "
            "params), other_namespace (another model or layout).")
        self._missing: Any = counter(
            name=MISSING, labelnames=self._labelnames,
            documentation="Blocks a handoff's fence named that the decode "
            "computed itself.")
        self._waited: Any = counter(
            name=WAITED, labelnames=self._labelnames,
            documentation="Seconds decode requests waited on fences.")

    def observe(self, transfer_stats_data: dict[str, Any],
                engine_idx: int = 0) -> None:
        """Adds one interval's counters to the engine's series."""
        labels = self.per_engine_labelvalues[engine_idx]
        plain = {"sent": self._sent, "not_sent": self._not_sent,
                 "computed_blocks": self._missing,
                 "wait_seconds": self._waited}
        for name, value in transfer_stats_data.items():
            if not value:
                continue
            if name in OUTCOMES:
                self._decoded.labels(*labels, name).inc(value)
            elif name in plain:
                plain[name].labels(*labels).inc(value)
