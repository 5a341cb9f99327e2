"""kvtier in an engine's scheduler and worker, engine-neutral.

An engine like vLLM splits its KV-connector in two halves that live in
different processes and talk only through a per-step metadata object:

- :class:`SchedulerHalf` (no KV memory): how many tokens beyond the engine's
  own prefix the store can supply (one lookup round trip over every shard),
  which engine pages those go to, which computed blocks to save, which
  requests finished; :meth:`SchedulerHalf.build_step` packs that into a
  :class:`StepMeta` (plain, picklable).
- :class:`WorkerHalf` (owns the KV tensors, through a
  :class:`kvtier.Connector`):
  executes a StepMeta: pins and starts the loads (layer by layer), waits per
  layer, takes each load's verdict, saves, closes finished requests, and
  reports the pages whose load failed so the engine recomputes them.

The reference engine (kvtier.engine) and the vLLM adapter
(kvtier.integrations.vllm) both drive these halves in vLLM's hook order:

  scheduler: num_loadable_tokens -> (engine allocates) -> allocated
             -> computed (after a step) -> build_step -> finished
  worker:    start_load(step) -> wait_for_layer(l) for each layer
             -> wait_for_save(step) -> load_error_pages() -> finished

Between the scheduler's lookup and the worker's pin a block may leave the
store; the worker then loads fewer and reports the rest as failed pages,
exactly like a load that failed its checksum: either way the engine
recomputes them and never uses their bytes.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from kvtier._native import NamespaceSpec
from kvtier.connector import Connector
from kvtier.errors import InvalidArgument, KvtierError, StatusCode
from kvtier.store import StoreClient


def store_options(extra: dict, where: str) -> tuple[list[str], dict]:
    """The store shards and client options an engine's config names
    (``stores``: comma-separated or a list; ``deadline_ms``,
    ``shared_memory``, ``tls_ca`` / ``tls_cert`` / ``tls_key``).
    InvalidArgument naming ``where`` when no store is named."""
    stores = extra.get("stores", [])
    if isinstance(stores, str):
        stores = [s for s in stores.split(",") if s]
    if not stores:
        raise InvalidArgument(StatusCode.INVALID_ARGUMENT,
                              f"{where}: \"stores\" names no kvtier-store")
    opts = {"deadline_ms": int(extra.get("deadline_ms", 10000)),
            "shared_memory": str(extra.get("shared_memory", "auto")),
            "tls_ca": str(extra.get("tls_ca", "")),
            "tls_cert": str(extra.get("tls_cert", "")),
            "tls_key": str(extra.get("tls_key", ""))}
    return list(stores), opts


def request_key(request_id: object) -> int:
    """A kvtier request id (63-bit int) for an engine's request id (a str
    in vLLM and SGLang), the same in every process."""
    if isinstance(request_id, int) and 0 <= request_id < 1 << 63:
        return request_id
    digest = hashlib.blake2b(str(request_id).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class _LookupThread:
    """Runs store lookups one after another on a daemon thread, so that a
    scheduler can stop waiting for one (it goes on to its deadline)."""

    def __init__(self) -> None:
        self._queue: queue.Queue[Optional[tuple[
            Callable[[], int], concurrent.futures.Future[int]]]] = \
            queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="kvtier-lookup")
        self._thread.start()

    def submit(self, call: Callable[[], int]
               ) -> concurrent.futures.Future[int]:
        """The future of ``call()``."""
        future: concurrent.futures.Future[int] = concurrent.futures.Future()
        self._queue.put((call, future))
        return future

    def close(self) -> None:
        """Ends the thread once the lookups queued before are done (it is
        not waited for: one may be out until its deadline)."""
        self._queue.put(None)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            call, future = item
            try:
                future.set_result(call())
            except BaseException as e:  # handed to the waiter, whatever it is
                future.set_exception(e)


@dataclass
class LoadSpec:
    """Load blocks [skip_blocks, skip_blocks + len(pages)) of the chain
    into ``pages`` (the engine holds blocks [0, skip_blocks) itself)."""

    request: int
    hashes: np.ndarray
    skip_blocks: int
    pages: list[int]


@dataclass
class SaveSpec:
    """Save blocks [first_block, first_block + len(pages)) of the chain,
    computed into ``pages``."""

    request: int
    hashes: np.ndarray
    first_block: int
    pages: list[int]


@dataclass
class StepMeta:
    """What the scheduler half hands the worker half for one step."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)


@dataclass
class _Tracked:
    hashes: np.ndarray
    prompt_tokens: int
    skip_blocks: int = 0
    loadable: int = 0          # blocks the store can supply after skip
    saved_blocks: int = 0      # blocks [0, saved) are in the store or saved
    load: Optional[LoadSpec] = None
    # A lookup under way: (skip_blocks it asked from, its answer to come),
    # when the request was first asked for, and an answer not yet planned.
    asked: Optional[tuple[int, concurrent.futures.Future[int]]] = None
    first_ask: Optional[float] = None
    answer: Optional[tuple[int, int]] = None  # (skip_blocks, present)


class SchedulerHalf:
    """The scheduler's side: asks the store, plans loads and saves.

    ``store``: a client of the store shards (None: no store tier; nothing is
    ever loadable or saved). ``block_tokens``: tokens per block (== the
    engine's page size). Not thread-safe (a scheduler is one thread).
    """

    def __init__(self, namespace: NamespaceSpec, store: Optional[StoreClient],
                 block_tokens: int) -> None:
        self.namespace = namespace
        self.store = store
        self.block_tokens = block_tokens
        self._reqs: dict[int, _Tracked] = {}
        self._step = StepMeta()
        self.lookup_errors = 0
        self.lookups_skipped = 0
        self.lookups_late = 0          # past their budget
        self.lookups_not_asked = 0     # a late one was still out
        self._lookups: Optional[_LookupThread] = None
        self._late: Optional[concurrent.futures.Future[int]] = None
        self._answered: list[_Tracked] = []  # kept answers, this step

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
        nothing (counted in ``lookups_late``); the lookup goes on to its
        deadline meanwhile, and until it ends the store is not asked again
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
        that can ask again later (vLLM's, when
        ``get_num_new_matched_tokens`` answers None): None while the
        store's answer has not come, for at most ``wait_ms`` from the
        request's first ask (as ``budget_ms``); then 0 (``lookups_late``).
        An answer is kept for the same own prefix until the step's end
        (:meth:`build_step`), so asking again in the step costs no round
        trip."""
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
        t.skip_blocks = skip
        t.saved_blocks = max(t.saved_blocks, skip)
        t.loadable = 0
        limit = min((prompt_tokens - 1) // bt, len(hashes))
        if self.store is None or skip >= limit:
            return 0
        if store_hint is not None and skip >= store_hint:
            self.lookups_skipped += 1
            return 0
        if not block and t.answer is not None and t.answer[0] == skip:
            present = t.answer[1]
        else:
            got = self._ask(t, hashes[skip:limit], skip, budget_ms, block)
            if got is None:
                return None
            present = got
        t.loadable = min(present, limit - skip)
        return t.loadable * bt

    def _ask(self, t: _Tracked, chain: np.ndarray, skip: int,
             budget_ms: Optional[float], block: bool) -> Optional[int]:
        """What the store holds of ``chain`` (0 when it cannot say in
        time); None when not blocking and the answer is still to come."""
        assert self.store is not None
        store, namespace = self.store, self.namespace

        def lookup() -> int:
            # From the engine's prefix on: the store may have lost blocks the
            # engine still holds.
            return store.lookup(namespace, chain)

        try:
            if budget_ms is None:
                return lookup()
            now = time.monotonic()
            if t.asked is None or t.asked[0] != skip:
                if self._late is not None and not self._late.done():
                    self.lookups_not_asked += 1
                    return 0
                if self._lookups is None:
                    self._lookups = _LookupThread()
                if t.first_ask is None:
                    t.first_ask = now
                t.asked = (skip, self._lookups.submit(lookup))
            future = t.asked[1]
            assert t.first_ask is not None
            left = budget_ms / 1000.0 - (now - t.first_ask)
            done = future.done()
            if not block and not done and left > 0:
                return None
            t.asked = t.first_ask = None
            try:
                present = future.result(timeout=max(0.0, left) if block
                                        else 0.0)
            except concurrent.futures.TimeoutError:
                self.lookups_late += 1
                self._late = future
                return 0
            if not block:
                t.answer = (skip, present)
                self._answered.append(t)
            return present
        except KvtierError:
            self.lookup_errors += 1
            return 0

    def skip_blocks(self, request: int) -> int:
        """The engine's own prefix, in blocks, at the last lookup."""
        t = self._reqs.get(request)
        return t.skip_blocks if t is not None else 0

    def allocated(self, request: int, load_pages: list[int]) -> None:
        """The engine gave the loadable blocks these pages (fewer than
        offered if it takes fewer tokens); they load this step."""
        t = self._reqs.get(request)
        if t is None or not load_pages:
            return
        pages = list(load_pages[:t.loadable])
        t.answer = None  # a later plan asks the store afresh
        t.load = LoadSpec(request, t.hashes, t.skip_blocks, pages)
        t.saved_blocks = max(t.saved_blocks, t.skip_blocks + len(pages))
        self._step.loads.append(t.load)

    def computed(self, request: int, num_computed_tokens: int,
                 block_pages: list[int]) -> None:
        """After a step: the request's first ``num_computed_tokens`` tokens
        have KV in ``block_pages`` (its pages in block order); prompt blocks
        that became full since the last save are saved."""
        t = self._reqs.get(request)
        if t is None or self.store is None:
            return
        full = min(num_computed_tokens, t.prompt_tokens) // self.block_tokens
        full = min(full, len(t.hashes), len(block_pages))
        if full > t.saved_blocks:
            first = t.saved_blocks
            self._step.saves.append(SaveSpec(request, t.hashes, first,
                                             list(block_pages[first:full])))
            t.saved_blocks = full

    def load_failed(self, request: int, num_computed_tokens: int) -> None:
        """The worker reported the request's load failed and the engine
        rolled it back to ``num_computed_tokens``: blocks after it are
        computed (and saved) again."""
        t = self._reqs.get(request)
        if t is not None:
            t.saved_blocks = min(t.saved_blocks,
                                 num_computed_tokens // self.block_tokens)
            t.loadable = 0
            t.answer = None

    def finished(self, request: int) -> None:
        """The request is done: the worker closes it after this step."""
        if self._reqs.pop(request, None) is not None:
            self._step.finished.append(request)

    def build_step(self) -> StepMeta:
        """This step's metadata; the next step starts empty (and asks the
        store afresh)."""
        for t in self._answered:
            t.answer = None
        self._answered.clear()
        step, self._step = self._step, StepMeta()
        return step

    def warm_up(self) -> None:
        """Opens the connection to the store off the caller's thread, so
        that the first request's lookup does not pay it (a store down now
        only delays the lookups queued behind this one)."""
        if self.store is None:
            return
        if self._lookups is None:
            self._lookups = _LookupThread()
        store, namespace = self.store, self.namespace
        self._lookups.submit(lambda: store.lookup(
            namespace, np.zeros((1, 2), dtype=np.uint64)))

    def close(self) -> None:
        """Ends the lookup thread (a lookup still out ends at its
        deadline)."""
        if self._lookups is not None:
            self._lookups.close()
            self._lookups = None


class WorkerHalf:
    """The worker's side: executes each step's metadata on a connector
    over the engine's KV tensors. Not thread-safe (one model runner)."""

    def __init__(self, connector: Connector) -> None:
        self.connector = connector
        self._open: set[int] = set()
        self._loading: dict[int, LoadSpec] = {}
        self._errors: set[int] = set()
        self.loaded_blocks = 0
        self.failed_loads = 0
        self.load_failures: list[str] = []
        self._closing: queue.Queue[Optional[int]] = queue.Queue()
        self._closer: Optional[threading.Thread] = None

    def _open_request(self, request: int, hashes: np.ndarray) -> None:
        if request not in self._open:
            # Opens the request without a pin (every block skipped).
            self.connector.lookup(request, hashes, len(hashes))
            self._open.add(request)

    def start_load(self, step: StepMeta) -> None:
        """Pins and starts the step's loads. Blocks the store no longer
        holds are reported as failed pages at once."""
        for spec in step.loads:
            try:
                if spec.request in self._open:
                    # Loaded or saved before (a preempted request that
                    # resumes): closed first, then looked up afresh.
                    self._open.discard(spec.request)
                    self.connector.finished(spec.request)
                found = self.connector.lookup(spec.request, spec.hashes,
                                              spec.skip_blocks)
                self._open.add(spec.request)
                n = min(found.blocks, len(spec.pages))
                self._errors.update(spec.pages[n:])
                if n == 0:
                    continue
                self.connector.start_load(spec.request, spec.pages[:n])
                self._loading[spec.request] = LoadSpec(
                    spec.request, spec.hashes, spec.skip_blocks,
                    spec.pages[:n])
            except KvtierError as e:
                self._fail(spec, e)

    def wait_for_layer(self, layer: int) -> None:
        """Returns once ``layer`` of every load of the step is in its pages
        (unverified: :meth:`wait_for_save` takes the verdicts)."""
        for request in list(self._loading):
            try:
                self.connector.wait_for_layer(request, layer)
            except KvtierError:
                pass  # the verdict reports it

    def wait_for_save(self, step: StepMeta) -> None:
        """The end of the step: each load's verdict (failed pages are
        reported), then the step's saves (their bytes are copied before
        this returns; the store writes continue in the background), then
        the finished requests are closed."""
        failed: set[int] = set()
        for request, spec in list(self._loading.items()):
            del self._loading[request]
            try:
                loaded = self.connector.wait_for_load(request)
            except KvtierError as e:
                self._fail(spec, e)
                failed.add(request)
                continue
            self.loaded_blocks += loaded
            if loaded < len(spec.pages):
                self._errors.update(spec.pages[loaded:])
                failed.add(request)
        for spec in step.loads:
            if set(spec.pages) & self._errors:
                failed.add(spec.request)
        for save in step.saves:
            if save.request in failed:
                continue  # computed from KV that failed its load: never saved
            try:
                self._open_request(save.request, save.hashes)
                self.connector.save(save.request, save.first_block,
                                    save.pages)
            except KvtierError:
                pass  # a save that fails costs a future hit, nothing else
        for request in step.finished:
            self.finished(request)

    def _fail(self, spec: LoadSpec, e: KvtierError) -> None:
        self.failed_loads += 1
        self.load_failures.append(str(e))
        self._errors.update(spec.pages)

    def load_error_pages(self) -> set[int]:
        """Pages whose load failed since the last call (their blocks must be
        recomputed; their bytes never used)."""
        errors, self._errors = self._errors, set()
        return errors

    def finished(self, request: int) -> None:
        """Closes the request. Its queued saves are written first, by a
        background thread, so the engine's step never waits for the store
        (their bytes were copied out of the pages already)."""
        if request in self._loading:
            try:
                self._loading.pop(request)
                self.connector.wait_for_load(request)
            except KvtierError:
                pass
        self._open.discard(request)
        if self._closer is None:
            self._closer = threading.Thread(target=self._close_loop,
                                            daemon=True, name="kvtier-close")
            self._closer.start()
        self._closing.put(request)

    def _close_loop(self) -> None:
        while True:
            request = self._closing.get()
            if request is None:
                return
            try:
                self.connector.finished(request)
            except KvtierError:
                pass

    def close(self) -> None:
        """Closes every request still open and waits for their saves."""
        for request in list(self._open):
            self.finished(request)
        if self._closer is not None:
            self._closing.put(None)
            self._closer.join()
            self._closer = None
