"""Saves behind the engine's step: a thread that copies computed blocks out
of the engine's pages after the step that computed them.

An engine's step hands each save to :meth:`SaveLane.submit` and goes on;
the lane copies it out (``copy``: the connector's save, which stages the
bytes for the store) on a thread of its own, in the order submitted. The
pages stay the request's while it runs; when it finishes, the engine keeps
them until the lane reports the request in :meth:`SaveLane.sent` (vLLM's
``delay_free_blocks`` and ``finished_sending``), or takes them back at once
and calls :meth:`SaveLane.release` before it writes them again (a
preemption, or a finish the engine did not hold for us).

What the lane never does: make a step wait, or hold pages past a budget.

- **Behind**: a save that would take the copies queued past
  ``max_queued_blocks`` is skipped (reason ``behind``).
- **Late**: a save whose copy has not started within ``budget_ms`` of its
  submission is dropped (``late``); a copy that started waits for the
  store's staging at most what is left of its budget (past it the blocks
  not yet staged are dropped, whole: ``store_behind``).
- **Released**: the queued saves of a request whose pages were taken back
  are dropped (``released``); :meth:`SaveLane.release` returns once a copy
  of its already running has ended.
- **Gap**: after one save of a request is skipped, its later saves are
  skipped too (``gap``): blocks past a missing one are never loadable,
  since loads take a chain's leading blocks. A release ends the gap: a
  preempted request's saves, once it resumes, start again from the
  blocks its next lookup finds in the store (the scheduler plans them).

Every count is by blocks; :meth:`SaveLane.stats` reads them.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from kvtier.errors import KvtierError, StatusCode

log = logging.getLogger("kvtier.saves")

#: Why a save's blocks were not copied (:meth:`SaveLane.stats`'s
#: ``skipped_<reason>`` counters).
SKIP_REASONS = ("behind", "late", "store_behind", "released", "gap", "failed")


@dataclass
class _Job:
    key: int
    blocks: int
    run: Callable[..., None]
    fence: Any
    queued: float
    close: bool = False
    name: Optional[str] = None
    budget_s: Optional[float] = None   # None: the lane's


class SaveLane:
    """One thread's queue of copies (see the module docstring). Its
    methods may be called from any thread."""

    def __init__(self, max_queued_blocks: int = 256,
                 budget_ms: float = 1000.0) -> None:
        if max_queued_blocks < 1:
            raise ValueError(f"max_queued_blocks must be >= 1, not "
                             f"{max_queued_blocks}")
        if not budget_ms > 0:
            raise ValueError(f"budget_ms must be > 0, not {budget_ms}")
        self._max_blocks = max_queued_blocks
        self._budget_s = budget_ms / 1000
        self._cv = threading.Condition()
        self._jobs: collections.deque[_Job] = collections.deque()
        self._queued_blocks = 0
        self._running: Optional[int] = None   # the key of the copy running
        self._gaps: set[int] = set()
        self._sent: set[str] = set()
        self._stop = False
        self._logged = 0.0
        self.copied_blocks = 0
        self.copies = 0
        self.copy_seconds = 0.0
        self.lag_seconds_max = 0.0   # submission to the copy's end
        self.skipped = {reason: 0 for reason in SKIP_REASONS}
        self._taken: dict[str, int] = {}
        self._taken_total = 0
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name="kvtier-save")
        self._thread.start()

    def submit(self, key: int, blocks: int, copy: Callable[[float], None],
               fence: Any = None, budget_ms: Optional[float] = None) -> bool:
        """Queues ``copy(wait_ms)`` (``wait_ms``: what is left of the
        budget when it starts) for request ``key``'s ``blocks`` blocks,
        after ``fence.synchronize()`` when given (the engine's work that
        writes the pages). ``budget_ms``: this save's budget instead of
        the lane's (a prefill's handoff, which a decode waits that long
        for). False when skipped (behind, or a gap)."""
        with self._cv:
            if key in self._gaps:
                self.skipped["gap"] += blocks
                return False
            if self._queued_blocks + blocks > self._max_blocks:
                self.skipped["behind"] += blocks
                self._gaps.add(key)
                return False
            self._queued_blocks += blocks
            self._jobs.append(_Job(key, blocks, copy, fence,
                                   time.monotonic(), budget_s=None
                                   if budget_ms is None else budget_ms / 1000))
            self._cv.notify_all()
        return True

    def finish(self, key: int, close: Callable[[], None],
               name: Optional[str] = None) -> None:
        """Request ``key`` is done: ``close()`` runs after its queued
        copies; then ``name`` (when the engine holds its pages for us) is
        reported by :meth:`sent`."""
        with self._cv:
            self._jobs.append(_Job(key, 0, lambda _=None: close(), None,
                                   time.monotonic(), close=True, name=name))
            self._cv.notify_all()

    def release(self, keys: set[int]) -> None:
        """The engine took back the pages of ``keys``: their queued copies
        are dropped; returns once none of theirs runs."""
        if not keys:
            return
        with self._cv:
            kept: collections.deque[_Job] = collections.deque()
            for job in self._jobs:
                if job.key in keys and not job.close:
                    self.skipped["released"] += job.blocks
                    self._queued_blocks -= job.blocks
                else:
                    kept.append(job)
            self._jobs = kept
            # The scheduler plans a resumed request's saves afresh from
            # what the store holds: no gap to skip past.
            self._gaps -= keys
            while self._running in keys:
                self._cv.wait()

    def sent(self) -> set[str]:
        """Names whose copies all ended since the last call (their pages
        are the engine's again)."""
        with self._cv:
            sent, self._sent = self._sent, set()
        return sent

    def idle(self, timeout_s: float) -> bool:
        """Waits until nothing is queued or running; False past
        ``timeout_s``."""
        end = time.monotonic() + timeout_s
        with self._cv:
            while self._jobs or self._running is not None:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def stats(self) -> dict[str, float]:
        """Blocks copied, copies, seconds spent copying, the longest lag from
        a save's submission to its copy's end, blocks queued now, and
        blocks skipped by reason (``skipped_<reason>``)."""
        with self._cv:
            out: dict[str, float] = {
                "save_copied_blocks": self.copied_blocks,
                "save_copies": self.copies,
                "save_copy_seconds": self.copy_seconds,
                "save_lag_seconds_max": self.lag_seconds_max,
                "save_queued_blocks": self._queued_blocks}
            for reason, n in self.skipped.items():
                out[f"save_skipped_{reason}"] = n
        return out

    def take_counts(self) -> dict[str, int]:
        """Blocks copied (``saved_blocks``) and skipped by reason
        (``save_skipped_<reason>``) since the last call; only those not 0."""
        with self._cv:
            # Most steps change nothing: answered without building a dict.
            total = self.copied_blocks + sum(self.skipped.values())
            if total == self._taken_total:
                return {}
            self._taken_total = total
            now = {"saved_blocks": self.copied_blocks}
            for reason, n in self.skipped.items():
                now[f"save_skipped_{reason}"] = n
            delta = {k: v - self._taken.get(k, 0) for k, v in now.items()}
            self._taken = now
        return {k: v for k, v in delta.items() if v}

    def close(self, timeout_s: float = 10.0) -> None:
        """Runs what is queued (at most ``timeout_s``), then ends the
        thread (idempotent)."""
        self.idle(timeout_s)
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout_s)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._jobs and not self._stop:
                    self._cv.wait()
                if not self._jobs:
                    return
                job = self._jobs.popleft()
                self._running = job.key
                gap = job.key in self._gaps and not job.close
            if job.close:
                self._run_close(job)
            else:
                self._run_copy(job, gap)
            with self._cv:
                self._running = None
                self._cv.notify_all()

    def _run_close(self, job: _Job) -> None:
        try:
            job.run()
        except Exception as e:  # a close must not end the lane
            log.warning("kvtier: closing request %d failed: %r", job.key, e)
        with self._cv:
            self._gaps.discard(job.key)
            if job.name is not None:
                self._sent.add(job.name)

    def _run_copy(self, job: _Job, gap: bool) -> None:
        reason: Optional[str] = "gap" if gap else None
        start = time.monotonic()
        budget_s = self._budget_s if job.budget_s is None else job.budget_s
        left_ms = (budget_s - (start - job.queued)) * 1000
        error: Optional[BaseException] = None
        if reason is None and left_ms <= 0:
            reason = "late"
        if reason is None:
            try:
                if job.fence is not None:
                    job.fence.synchronize()
                job.run(max(left_ms, 0.0))
            except KvtierError as e:
                reason = ("store_behind" if e.code ==
                          StatusCode.RESOURCE_EXHAUSTED else "failed")
                error = e
            except Exception as e:  # a bug costs a save, not the lane
                reason, error = "failed", e
        end = time.monotonic()
        with self._cv:
            self._queued_blocks -= job.blocks
            if reason is None:
                self.copied_blocks += job.blocks
                self.copies += 1
                self.copy_seconds += end - start
                self.lag_seconds_max = max(self.lag_seconds_max,
                                           end - job.queued)
                return
            self.skipped[reason] += job.blocks
            self._gaps.add(job.key)
            logged = reason != "gap" and end - self._logged >= 10
            if logged:
                self._logged = end
        if logged:
            log.warning("kvtier save of %d blocks not copied (%s, %.0f ms "
                        "after its step): %s", job.blocks, reason,
                        (start - job.queued) * 1000, error or
                        "the counters have every skip by reason")
