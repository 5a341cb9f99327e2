"""kvtier in an engine's scheduler, engine-neutral.

An engine like vLLM splits its KV connector in two halves that live in
different processes and talk only through a per-step plan:

- :class:`SchedulerHalf` (here; no KV memory): how many tokens beyond the
  engine's own prefix the store can supply (every new request of a step in
  one batched lookup, :mod:`kvtier.step_lookups`), which engine pages those
  go to, which computed blocks to save, which requests finished;
  :meth:`SchedulerHalf.build_step` packs that into a
  :class:`kvtier.step_plan.StepMeta` (plain, picklable).
- :class:`kvtier.worker_half.WorkerHalf` and
  :class:`kvtier.worker_half.AsyncLoads` (own the KV tensors): execute it.

The reference engine (kvtier.engine) and the vLLM adapter
(kvtier.integrations.vllm) both drive the halves in vLLM's hook order:

  scheduler: num_loadable_tokens / poll_loadable_tokens -> (engine
             allocates) -> allocated -> computed (after a step) ->
             build_step -> finished

Between the scheduler's lookup and the worker's pin a block may leave the
store; the worker then loads fewer and reports the rest as failed pages,
exactly like a load that failed its checksum: either way the engine
recomputes them and never uses their bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from kvtier._native import NamespaceSpec
from kvtier.errors import InvalidArgument, KvtierError, StatusCode
from kvtier.save_policy import SavePolicy
from kvtier.step_lookups import (ANSWERED, FAILED, LATE, SKIPPED, StepLookups,
                                 lookup_ranks)
from kvtier.step_plan import LoadSpec, SaveSpec, StepMeta
from kvtier.store import StoreClient

__all__ = ["LoadSpec", "SaveSpec", "SchedulerHalf", "StepMeta"]


@dataclass
class _Tracked:
    hashes: np.ndarray
    prompt_tokens: int
    skip_blocks: int = 0
    loadable: int = 0          # blocks the store can supply after skip
    saved_blocks: int = 0      # blocks [0, saved) need no save
    # Blocks [0, stored) the store answered it holds, loaded from it, or
    # this engine saved: what a handoff's fence may promise.
    stored_blocks: int = 0
    load: Optional[LoadSpec] = None
    asked: Optional[int] = None            # skip_blocks of a lookup out
    answer: Optional[tuple[int, int]] = None  # (skip_blocks, present)
    gave_up: Optional[int] = None          # skip_blocks late: 0 from now on
    store_missed: bool = False  # a lookup failed or was not sent
    unreachable: bool = False   # the last lookup found no store to ask
    answered: bool = False      # the last lookup got the store's answer
    # save_policy "seen_twice": leading blocks an earlier prompt had too
    # (only these are saved); the whole prompt under "all".
    seen_blocks: int = 0
    unseen_to: int = 0  # blocks [seen_blocks, unseen_to) counted unsaved


#: :meth:`SchedulerHalf._ask`'s "the store said nothing in time".
_NO_ANSWER = -1


class SchedulerHalf:
    """The scheduler's side: asks the store, plans loads and saves.

    ``store``: a client of the store shards (None: no store tier; nothing is
    ever loadable or saved). ``block_tokens``: tokens per block (== the
    engine's page size). ``cpus``: where its lookup threads run (empty:
    their creator's binding). Not thread-safe (a scheduler is one thread).
    """

    def __init__(self, namespace: NamespaceSpec, store: Optional[StoreClient],
                 block_tokens: int, lookup_threads: int = 2,
                 ranks: Sequence[NamespaceSpec] = (),
                 save_policy: str = "all",
                 cpus: frozenset[int] = frozenset()) -> None:
        self.save_policy = SavePolicy(save_policy)
        #: Blocks a "seen_twice" policy did not save (first seen).
        self.saves_unseen = 0
        self.namespace = namespace
        self.ranks = tuple(ranks)
        self.store = store
        self.block_tokens = block_tokens
        self._reqs: dict[int, _Tracked] = {}
        self._step = StepMeta()
        self._lookups = (StepLookups(store, namespace, lookup_threads,
                                     self.ranks, cpus)
                         if store is not None else None)
        self.lookup_errors = 0
        self.lookups_answered = 0      # the store said what it holds
        self.lookups_skipped = 0
        self.lookups_late = 0          # past their budget
        self.lookups_not_asked = 0     # the store skipped after a late one
        self._answered: list[_Tracked] = []  # kept answers, this step

    @property
    def lookup_batches(self) -> int:
        """Batched lookups sent so far (each one round trip per shard)."""
        return self._lookups.batches if self._lookups is not None else 0

    def num_loadable_tokens(self, request: int, hashes: np.ndarray,
                            prompt_tokens: int, num_computed_tokens: int,
                            store_hint: Optional[int] = None,
                            budget_ms: Optional[float] = None) -> int:
        """Tokens after ``num_computed_tokens`` (the engine's own prefix, a
        multiple of block_tokens) that the store can supply; at least the
        prompt's last token is always left to compute. A store that cannot
        be asked supplies nothing (counted in ``lookup_errors``).
        ``store_hint``: how far, in blocks from the prompt's start, a router
        knows the stores hold the prompt (``RouteResponse.store_end_blocks``;
        None: unknown). When the engine's own prefix reaches it the store is
        not asked and nothing is loadable (counted in ``lookups_skipped``); a
        stale hint costs compute, never a wrong byte.

        ``budget_ms``: how long to wait for the store's answer (None: as long
        as the client's deadline). An answer later than that supplies
        nothing (counted in ``lookups_late``), and the client then skips
        the slow store for a while, answering at once
        (``lookups_not_asked``): a stalled store costs one request its
        budget and the next ones nothing, and a late answer is no failure.
        Raises InvalidArgument for a negative hint or a budget that is not
        a positive number."""
        n = self._loadable(request, hashes, prompt_tokens,
                           num_computed_tokens, store_hint, budget_ms,
                           block=True)
        assert n is not None
        return n

    def poll_loadable_tokens(self, request: int, hashes: np.ndarray,
                             prompt_tokens: int, num_computed_tokens: int,
                             wait_ms: float,
                             store_hint: Optional[int] = None
                             ) -> Optional[int]:
        """:meth:`num_loadable_tokens` without blocking, for a scheduler
        that asks again in a later step (vLLM's, when
        ``get_num_new_matched_tokens`` answers None): None until the
        store's answer has come, for at most ``wait_ms`` from the first
        ask (as ``budget_ms``); then 0 (``lookups_late``), and 0 from then
        on for the same own prefix. Every request asked in a step goes out
        in one batch at the step's end (:meth:`build_step`). An answer is
        kept for the same own prefix until the step's end, so asking again
        in the step costs no round trip."""
        return self._loadable(request, hashes, prompt_tokens,
                              num_computed_tokens, store_hint, wait_ms,
                              block=False)

    def _loadable(self, request: int, hashes: np.ndarray, prompt_tokens: int,
                  num_computed_tokens: int, store_hint: Optional[int],
                  budget_ms: Optional[float], block: bool) -> Optional[int]:
        if store_hint is not None and store_hint < 0:
            raise InvalidArgument(StatusCode.INVALID_ARGUMENT,
                                  f"store_hint must be >= 0, not {store_hint}")
        if budget_ms is not None and not (0 < budget_ms < math.inf):
            raise InvalidArgument(StatusCode.INVALID_ARGUMENT,
                                  f"budget_ms must be a positive number of "
                                  f"milliseconds, not {budget_ms}")
        bt = self.block_tokens
        skip = num_computed_tokens // bt
        t = self._reqs.get(request)
        if t is None:
            t = self._reqs[request] = _Tracked(hashes, prompt_tokens)
            t.seen_blocks = self.save_policy.savable_blocks(
                hashes, min(prompt_tokens // self.block_tokens, len(hashes)))
        t.skip_blocks = skip
        t.loadable = 0
        limit = min((prompt_tokens - 1) // bt, len(hashes))
        if self.store is None or skip >= limit or (
                store_hint is not None and skip >= store_hint):
            # Not asked: the engine's own prefix is taken as saved (a hint:
            # the store is asked whenever the prompt has a block to load).
            t.saved_blocks = max(t.saved_blocks, skip)
            if self.store is not None and skip < limit:
                self.lookups_skipped += 1
            return 0
        if t.answer is not None and t.answer[0] == skip:
            present = t.answer[1]
        elif t.gave_up == skip:
            t.saved_blocks = max(t.saved_blocks, skip)
            return 0
        else:
            # The whole chain from its first block: the store may have lost
            # (restarted, evicted) blocks the engine still holds, and those
            # are saved again from the engine's pages.
            got = self._ask(request, t, hashes[:limit], skip, budget_ms,
                            block)
            if got is None:
                return None
            present = got
        if present == _NO_ANSWER:
            # Late, failed or skipped: nothing learnt of the store.
            t.saved_blocks = max(t.saved_blocks, skip)
            return 0
        t.stored_blocks = max(t.stored_blocks, min(present, limit))
        t.saved_blocks = max(t.saved_blocks, min(present, skip))
        t.loadable = max(0, min(present, limit) - skip)
        return t.loadable * bt

    def _ask(self, request: int, t: _Tracked, chain: np.ndarray, skip: int,
             budget_ms: Optional[float], block: bool) -> Optional[int]:
        """How many leading blocks of ``chain`` the store holds (0 where it
        does not know the namespace: it restarted, or nothing was saved
        yet); _NO_ANSWER when it cannot say in time; None when not
        blocking and the answer is still to come."""
        assert self.store is not None and self._lookups is not None
        if budget_ms is None:
            t.unreachable = False
            try:
                found = lookup_ranks(self.store, self.namespace, self.ranks,
                                     [chain])[0]
                self.lookups_answered += 1
                return found
            except KvtierError as e:
                if e.code == StatusCode.NOT_FOUND:
                    self.lookups_answered += 1
                    return 0
                t.unreachable = e.code == StatusCode.UNAVAILABLE
                self.lookup_errors += 1
                return _NO_ANSWER
        if t.asked != skip:
            self._lookups.ask(request, chain, budget_ms)
            t.asked = skip
            if not block:
                return None
            self._lookups.flush()
        o = self._lookups.outcome(request, block=block)
        if o is None:
            return None
        t.asked = None
        t.unreachable = (o.kind == FAILED and
                         o.code == StatusCode.UNAVAILABLE)
        t.answered = o.kind == ANSWERED or (
            o.kind == FAILED and o.code == StatusCode.NOT_FOUND)
        if t.answered:
            self.lookups_answered += 1
        if o.kind == ANSWERED:
            t.answer = (skip, o.present)
            self._answered.append(t)
            return o.present
        # Failed, or not sent to a store that failed (unreachable): a miss.
        # A namespace the store has not seen yet (its first save registers
        # it) is none, nor is a slow store: late, or skipped for a while
        # after it missed a budget (SKIPPED), it still takes the saves.
        if o.kind == FAILED and o.code == StatusCode.NOT_FOUND:
            return 0  # an answer: the store holds nothing of the namespace
        if o.kind == FAILED:
            t.store_missed = True
        if o.kind == LATE:
            # Asked again for the same prefix (vLLM could not schedule it
            # yet), it is not made to wait a second budget.
            t.gave_up = skip
            self.lookups_late += 1
        elif o.kind == SKIPPED:
            self.lookups_not_asked += 1
        elif o.kind == FAILED:
            self.lookup_errors += 1
        return _NO_ANSWER

    def saved_blocks(self, request: int) -> int:
        """Blocks [0, n) of the request's prompt the store answered it
        holds, or that were loaded from it or saved by this engine (on
        their way there): never the engine's own prefix unasked. 0 for a
        request not tracked."""
        t = self._reqs.get(request)
        return t.stored_blocks if t is not None else 0

    def store_missed(self, request: int) -> bool:
        """Whether a lookup of the request's failed or was not sent (the
        client skipping a store that failed): its saves are unlikely to
        land either. A slow store is not a miss: a late answer, or a
        lookup not sent because the store missed an earlier budget (its
        saves land late, and a decode waits on the fence for them)."""
        t = self._reqs.get(request)
        return t is not None and t.store_missed

    def store_unreachable(self, request: int) -> bool:
        """Whether the request's last lookup found no store to ask
        (UNAVAILABLE: refused, or skipped by the client after such a
        failure), unlike a slow store's late answer or one skipped for a
        missed budget: blocks the request waits for will not arrive from
        it."""
        t = self._reqs.get(request)
        return t is not None and t.unreachable

    def answered(self, request: int) -> bool:
        """Whether the request's last lookup got the store's answer (not
        late, skipped or failed)."""
        t = self._reqs.get(request)
        return t is not None and t.answered

    def retry(self, request: int) -> None:
        """The next poll asks the store again for the same own prefix, even
        after a late answer (a decode waiting on a handoff's fence)."""
        t = self._reqs.get(request)
        if t is not None:
            t.answer = None
            t.gave_up = None

    def skip_blocks(self, request: int) -> int:
        """The engine's own prefix, in blocks, at the last lookup."""
        t = self._reqs.get(request)
        return t.skip_blocks if t is not None else 0

    def allocated(self, request: int, load_pages: list[int],
                  name: str = "") -> Optional[LoadSpec]:
        """The engine gave the loadable blocks these pages (fewer than
        offered if it takes fewer tokens); they load this step. The plan
        (None when there is nothing to load); ``name``: the engine's id of
        the request, carried to the worker."""
        t = self._reqs.get(request)
        if t is None or not load_pages:
            return None
        pages = list(load_pages[:t.loadable])
        t.answer = None  # a later plan asks the store afresh
        t.gave_up = None
        t.load = LoadSpec(request, t.hashes, t.skip_blocks, pages, name)
        t.saved_blocks = max(t.saved_blocks, t.skip_blocks + len(pages))
        t.stored_blocks = max(t.stored_blocks, t.skip_blocks + len(pages))
        self._step.loads.append(t.load)
        return t.load

    def computed(self, request: int, num_computed_tokens: int,
                 block_pages: list[int],
                 budget_ms: Optional[float] = None,
                 always: bool = False) -> bool:
        """After a step: the request's first ``num_computed_tokens`` tokens
        have KV in ``block_pages`` (its pages in block order); prompt blocks
        that became full since the last save are saved (within
        ``budget_ms``, else the worker's save budget). Under the
        "seen_twice" policy only the leading blocks an earlier prompt had
        too, unless ``always`` (a prefill's, which its decode waits for).
        True when a save was planned."""
        t = self._reqs.get(request)
        if t is None or self.store is None:
            return False
        full = min(num_computed_tokens, t.prompt_tokens) // self.block_tokens
        full = min(full, len(t.hashes), len(block_pages))
        if not always and full > t.seen_blocks:
            past = max(t.seen_blocks, t.unseen_to)
            if full > past:
                self.saves_unseen += full - past
                t.unseen_to = full
            full = t.seen_blocks
        if full <= t.saved_blocks:
            return False
        first = t.saved_blocks
        self._step.saves.append(SaveSpec(request, t.hashes, first,
                                         list(block_pages[first:full]),
                                         budget_ms))
        t.saved_blocks = full
        t.stored_blocks = max(t.stored_blocks, full)
        return True

    def load_failed(self, request: int, num_computed_tokens: int) -> None:
        """The worker reported the request's load failed and the engine
        rolled it back to ``num_computed_tokens``: blocks after it are
        computed (and saved) again."""
        t = self._reqs.get(request)
        if t is not None:
            t.saved_blocks = min(t.saved_blocks,
                                 num_computed_tokens // self.block_tokens)
            t.stored_blocks = min(t.stored_blocks, t.saved_blocks)
            t.loadable = 0
            t.answer = None

    def finished(self, request: int, held: Optional[str] = None) -> bool:
        """The request is done: the worker closes it after this step.
        ``held``: the engine's id of the request when the engine keeps its
        pages until the worker reports its saves copied (ignored, and False
        returned, for a request not tracked: the worker would have nothing
        to report)."""
        if self._lookups is not None:
            self._lookups.forget(request)
        if self._reqs.pop(request, None) is None:
            return False
        self._step.finished.append(request)
        if held is not None:
            self._step.held[request] = held
        return True

    def released(self, request: int) -> None:
        """The engine took the request's pages back (a preemption, or a
        finish it does not hold): saves not yet copied out are dropped. A
        preempted request, when it resumes, is saved again past the
        leading blocks its next lookup finds in the store (a dropped copy
        left a hole only the store can tell)."""
        self._step.released.append(request)
        t = self._reqs.get(request)
        if t is not None:
            t.saved_blocks = t.stored_blocks = 0

    def wait_lookups(self, timeout_s: float) -> bool:
        """Waits (at most ``timeout_s``) until every lookup sent has its
        answer or gave up (:meth:`StepLookups.wait_answers`); True at
        once without a store."""
        if self._lookups is None:
            return True
        return self._lookups.wait_answers(timeout_s)

    def build_step(self) -> StepMeta:
        """This step's plan; the lookups asked in the step go out, in one
        batch. The next step starts empty (and asks the store afresh)."""
        if self._lookups is not None:
            self._lookups.flush()
        for t in self._answered:
            t.answer = None
        self._answered.clear()
        step, self._step = self._step, StepMeta()
        return step

    def warm_up(self) -> None:
        """Opens the connection to the store off the caller's thread, so
        that the first request's lookup does not pay it; a store that
        cannot be asked is said in the log."""
        if self._lookups is not None:
            self._lookups.warm_up()

    def close(self) -> None:
        """Ends the lookup threads (a batch still out ends within its
        budget)."""
        if self._lookups is not None:
            self._lookups.close()

