"""Prefill/decode handoff through the store for kvtier's vLLM offloading
tier (:mod:`kvtier.integrations.vllm_tier`), in the protocol of
:mod:`kvtier.integrations.pd` (shared with the connector): a
``remote_decoder`` or ``do_remote_decode`` (prefill) request stores every
row of its prompt; a
``remote_prefiller`` (decode) request's lookups answer RETRY until the
store holds the rows it asked for, or ``handoff_wait_ms`` has passed (then
ordinary lookups: what is missing is computed). A row is seen only once
committed, so no row the prefill is still writing is ever loaded.
docs/disaggregation.md, "vLLM's own P/D keys"."""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from kvtier.errors import KvtierError
from kvtier.integrations.pd import pd_role

# A child of vLLM's own logger, so the tier's lines appear with vLLM's.
log = logging.getLogger("vllm.kvtier")

#: The shortest time between two probes of one handoff's keys.
HANDOFF_PROBE_INTERVAL_S = 0.005


@dataclass
class _Handoff:
    """A decode request's wait for a prefill's rows (vLLM's
    ``remote_prefiller``): which keys it asked for and which the store was
    seen to hold. Touched on vLLM's scheduler thread only; probes report
    through a queue."""

    kv_request_id: str
    deadline: float = 0.0             # set at the first lookup
    start: float = 0.0
    asked: dict[Any, None] = field(default_factory=dict)  # in order
    present: set[Any] = field(default_factory=set)  # committed there
    failed: set[Any] = field(default_factory=set)   # loads that failed
    probing: bool = False
    next_probe: float = 0.0
    # None: waiting; "complete", "timed_out", "partial" (scheduled with
    # some asked rows missing), "gone" (finished before it asked).
    outcome: Optional[str] = None


#: One handoff's keys to look for in the store.
_Probe = tuple[_Handoff, list[Any]]


class TierHandoffs:
    """The tier's handoffs. ``wait_s``: a decode's budget; ``probe``: which
    of the given keys the store holds (a count per key, each its own
    chain; raises KvtierError when the store cannot answer), called on the
    prober's thread. Every other method runs on vLLM's scheduler thread.

    ``counts`` by outcome: complete (every row the decode asked for was
    found), timed_out (it computed what was missing), partial (vLLM
    scheduled it before every row it asked for was found, as
    sliding-window lookups do), ignored (keys malformed or forbidden: an
    ordinary request), prefill (remote_decoder requests, whose every row is
    stored); ``wait_seconds``: the decodes' waits."""

    def __init__(self, wait_s: float,
                 probe: Callable[[list[Any]], list[int]]) -> None:
        self.wait_s = wait_s
        self._probe = probe
        self._waits: dict[str, _Handoff] = {}   # by vLLM's req_id
        self._probes: "queue.SimpleQueue[Optional[list[_Probe]]]" = \
            queue.SimpleQueue()
        self._probed: "queue.SimpleQueue[tuple[_Handoff, list[Any]]]" = \
            queue.SimpleQueue()
        self.counts = {"complete": 0, "timed_out": 0, "partial": 0,
                       "ignored": 0, "prefill": 0}
        self.wait_seconds = 0.0
        self._last_log = 0.0
        self._prober = threading.Thread(target=self._probe_loop, daemon=True,
                                        name="kvtier-tier-handoff")
        self._prober.start()

    def start(self, req_id: str, params: Any) -> Optional[str]:
        """A new request's role: "prefill" (store every row of its
        prompt), "decode" (wait for its rows) or None (an ordinary
        request, also when its keys are malformed: logged and counted)."""
        role, rid, why = pd_role(params)
        if why:
            self.counts["ignored"] += 1
            self._log(f"request {req_id}: {why}; it runs as an ordinary "
                      "request")
            return None
        if role == "prefill":
            self.counts["prefill"] += 1
        elif role == "decode":
            assert rid is not None
            self._waits[req_id] = _Handoff(rid)
        return role

    def lookup(self, req_id: str, key: Any) -> Optional[bool]:
        """For a waiting decode: True (HIT: the store holds the row),
        False (MISS: its load failed, computed), or None after recording
        the key (RETRY while the wait lasts, then an ordinary lookup:
        :meth:`waiting` tells which)."""
        h = self._waits.get(req_id)
        if h is None:
            return None
        self._take_probes()
        if key in h.failed:
            return False
        if key in h.present:
            return True
        if h.outcome is None:
            now = time.monotonic()
            if not h.asked:  # the wait starts at the first lookup
                h.start, h.deadline = now, now + self.wait_s
            if now < h.deadline:
                h.asked[key] = None
                return None
            self._end(h, "timed_out")
        return None

    def load_failed(self, req_id: str, keys: list[Any]) -> None:
        """A waiting decode's load of ``keys`` failed: they are computed,
        never promised again."""
        h = self._waits.get(req_id)
        if h is not None:
            for k in keys:
                h.present.discard(k)
                h.failed.add(k)

    def waiting(self, req_id: str) -> bool:
        """Whether request ``req_id`` still waits for its prefill's rows
        (its lookups answer RETRY)."""
        h = self._waits.get(req_id)
        return h is not None and h.outcome is None

    def pending(self) -> bool:
        """Whether a handoff still waits (vLLM must keep stepping)."""
        return any(h.outcome is None and h.asked
                   for h in self._waits.values())

    def schedule_end(self, new_req_ids: Any) -> None:
        """One probe for the waiting handoffs' keys (each handoff at most
        once in flight and at most every HANDOFF_PROBE_INTERVAL_S). A
        handoff whose request vLLM scheduled this step, or whose wait has
        run out, ends here: its lookups are over."""
        self._take_probes()
        now = time.monotonic()
        scheduled = set(new_req_ids)
        batch = []
        for req_id, h in self._waits.items():
            if h.outcome is not None or not h.asked:
                continue
            if req_id in scheduled:
                self._end(h, "complete" if all(
                    k in h.present for k in h.asked) else "partial")
                continue
            if now >= h.deadline:
                self._end(h, "timed_out")
                continue
            if h.probing or now < h.next_probe:
                continue
            wanted = [k for k in h.asked if k not in h.present]
            if wanted:
                h.probing = True
                h.next_probe = now + HANDOFF_PROBE_INTERVAL_S
                batch.append((h, wanted))
        if batch:
            self._probes.put(batch)

    def finished(self, req_id: str) -> None:
        """The request finished (or was aborted): no longer waited for."""
        h = self._waits.pop(req_id, None)
        if h is not None and h.outcome is None:
            self._end(h, None if not h.asked else "timed_out"
                      if time.monotonic() >= h.deadline else "partial")

    def close(self) -> None:
        """Stops the prober."""
        self._probes.put(None)
        self._prober.join(timeout=30)

    def _probe_loop(self) -> None:
        """The prober's thread: which of a handoff's keys the store holds;
        a store that cannot answer holds none."""
        while True:
            batch = self._probes.get()
            if batch is None:
                return
            keys = [k for _, ks in batch for k in ks]
            try:
                counts = self._probe(keys)
            except KvtierError as e:
                log.debug("kvtier tier: handoff probe failed: %s", e)
                counts = [0] * len(keys)
            except Exception:  # a bug: the handoffs wait on, unprobed
                log.exception("kvtier tier: handoff probe failed")
                counts = [0] * len(keys)
            i = 0
            for h, ks in batch:
                self._probed.put((h, [k for k, n in zip(ks, counts[i:])
                                      if n]))
                i += len(ks)

    def _take_probes(self) -> None:
        """Applies finished probes; a handoff whose every asked key is
        present is complete."""
        while True:
            try:
                h, found = self._probed.get_nowait()
            except queue.Empty:
                return
            h.probing = False
            h.present.update(found)
            if h.outcome is None and h.asked and \
                    all(k in h.present for k in h.asked):
                self._end(h, "complete")

    def _end(self, h: _Handoff, outcome: Optional[str]) -> None:
        if outcome is None:  # left before it asked anything
            h.outcome = "gone"
            return
        h.outcome = outcome
        self.counts[outcome] += 1
        self.wait_seconds += time.monotonic() - h.start
        if outcome == "timed_out":
            self._log(f"handoff {h.kv_request_id}: {len(h.present)} of "
                      f"{len(h.asked)} rows in the store after "
                      f"{self.wait_s * 1000:.0f} ms (handoff_wait_ms); "
                      "the rest is computed")

    def _log(self, line: str) -> None:
        """A handoff problem in the log, at most every 10 s (with counts)."""
        now = time.monotonic()
        if now - self._last_log >= 10.0:
            self._last_log = now
            log.warning("kvtier tier: %s (handoffs so far: %s)", line,
                        self.counts)
