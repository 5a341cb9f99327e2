"""kvtier in an engine's worker: executes the scheduler half's plans.

:class:`WorkerHalf` owns nothing but a :class:`kvtier.Connector` over the
engine's KV tensors and runs each step's :class:`StepMeta`:

- loads, either **asynchronously** (:meth:`WorkerHalf.start_loads`: vLLM's
  connector; each load pins, moves and verifies its blocks on a loader
  thread, and :meth:`WorkerHalf.finished_loads` hands back the requests
  whose load ended, with the pages that did not load: the engine schedules
  a request only then, so no byte is used before its checksum passed and a
  forward pass never waits on the store), or **synchronously, layer by
  layer** (:meth:`WorkerHalf.start_load`, :meth:`WorkerHalf.wait_for_layer`;
  the reference engine, which discards the step's output of a request
  whose load then fails);
- saves, either **behind the step** (:meth:`WorkerHalf.queue_saves`:
  vLLM's connector; a :class:`kvtier.save_lane.SaveLane` copies the bytes
  out after the step while the engine keeps the pages) or **on the step**
  (:meth:`WorkerHalf.wait_for_save`: copied out before it returns; the
  reference engine); the store writes go on in the background either way;
- finished requests (closed on a background thread, after their saves).

**Ordered against the engine's stream.** On a GPU the engine launches its
forward and returns before the pages are written; kvtier's copies run on
streams of their own. With ``stream_fence`` (a callable that marks the
engine's current stream and returns a fence with ``synchronize()``, such
as a ``torch.cuda.Event`` recorded on ``torch.cuda.current_stream()``), a
save's copy starts only after the work the engine launched before
:meth:`WorkerHalf.wait_for_save` (the forward that wrote its pages), and a
load's copy only after the work launched before
:meth:`WorkerHalf.start_loads` (vLLM's own writes to the pages it gave the
load); the load is reported ended only once its copy is done, so the
engine's first use of the pages comes after it.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import queue
import threading
import time
from typing import Any, Callable, Optional

import numpy as np

from kvtier.connector import Connector
from kvtier.errors import KvtierError
from kvtier.cpus import bind_thread
from kvtier.save_lane import SaveLane
from kvtier.step_plan import LoadSpec, SaveSpec, StepMeta

# A load that fails, or loads fewer blocks than its lookup promised, says
# why in the engine's log (the engine then computes those blocks).
log = logging.getLogger("kvtier.loads")


class _Abandoned(Exception):
    """A load whose request finished before a loader thread took it."""


class WorkerHalf:
    """The worker's side over one connector. The model runner's calls come
    from one thread; asynchronous loads run on ``load_threads`` threads of
    their own."""

    def __init__(self, connector: Connector, load_threads: int = 2,
                 stream_fence: Optional[Callable[[], Any]] = None,
                 pin_wait_ms: Optional[float] = None,
                 cpus: frozenset[int] = frozenset()) -> None:
        self.connector = connector
        # The CPUs its loader and closer threads run on (kvtier.cpus;
        # empty: their creator's).
        self._cpus = cpus
        self._stream_fence = stream_fence
        # How long a load's pin waits for the store (None: the client's
        # deadline): past it the load fails and the engine computes.
        self._pin_wait_ms = pin_wait_ms
        # Requests finished while their load waited for a loader thread:
        # the load is skipped (their pages may be vLLM's again).
        self._abandoned: set[int] = set()
        self._lock = threading.Lock()
        self._open: set[int] = set()
        self._loading: dict[int, LoadSpec] = {}       # synchronous
        self._async: dict[int, concurrent.futures.Future[None]] = {}
        self._ended: list[tuple[str, list[int]]] = []  # async: name, failed
        self._errors: set[int] = set()
        self.loaded_blocks = 0
        self.failed_loads = 0
        # Pages a load was planned for that it did not fill (the engine
        # computes their blocks), a request gone first not counted.
        self.failed_load_blocks = 0
        self.load_failures: list[str] = []
        self._load_threads = load_threads
        self._loader: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._closing: queue.Queue[Optional[int]] = queue.Queue()
        self._closer: Optional[threading.Thread] = None
        self.failed_saves = 0
        self._save_logged = 0.0  # when a failed save was last logged

    def _open_request(self, request: int, hashes: np.ndarray) -> None:
        with self._lock:
            if request in self._open:
                return
            self._open.add(request)
        # Opens the request without a pin (every block skipped).
        self.connector.lookup(request, hashes, len(hashes))

    def _pin(self, spec: LoadSpec) -> tuple[int, Optional[BaseException]]:
        """Opens (or reopens) the request and pins its blocks: how many of
        its pages the store still holds, and the store's error when it
        could not be asked (None when it answered)."""
        with self._lock:
            if spec.request in self._abandoned:
                raise _Abandoned()
            reopen = spec.request in self._open
            self._open.add(spec.request)
        if reopen:
            # Loaded or saved before (a preempted request that resumes):
            # closed first, then looked up afresh.
            self.connector.finished(spec.request)
        found = self.connector.lookup(spec.request, spec.hashes,
                                      spec.skip_blocks, self._pin_wait_ms)
        return min(found.blocks, len(spec.pages)), found.store_error

    # ------------------------------------------------- asynchronous loads

    def start_loads(self, step: StepMeta) -> None:
        """Starts the step's loads on the loader threads and returns at
        once; :meth:`finished_loads` reports each when it ends."""
        if not step.loads:
            return
        if self._loader is None:
            self._loader = concurrent.futures.ThreadPoolExecutor(
                max_workers=self._load_threads,
                thread_name_prefix="kvtier-load",
                initializer=bind_thread, initargs=(self._cpus,))
        fence = self._stream_fence() if self._stream_fence else None
        for spec in step.loads:
            with self._lock:
                self._async[spec.request] = self._loader.submit(
                    self._load_whole, spec, fence)

    def _load_whole(self, spec: LoadSpec, fence: Any = None) -> None:
        """Pins, moves and verifies one request's blocks (after ``fence``:
        the engine's work on the pages launched before the load); the
        pages that did not load (evicted since the lookup, failed their
        checksum, the store gone, the request finished before its load
        began) are its failed pages."""
        failed = list(spec.pages)
        abandoned = False
        try:
            n, store_error = self._pin(spec)
            if n > 0:
                if fence is not None:
                    fence.synchronize()
                self.connector.start_load(spec.request, spec.pages[:n])
                loaded = self.connector.wait_for_load(spec.request)
                failed = spec.pages[loaded:]
                with self._lock:
                    self.loaded_blocks += loaded
            if failed:
                log.warning("kvtier load of %s: %d of %d blocks loaded (%d "
                            "still in the store when pinned%s); the engine "
                            "computes the rest", spec.name,
                            len(spec.pages) - len(failed), len(spec.pages), n,
                            f": {store_error}" if store_error else "")
        except _Abandoned:  # finished first: nothing pinned, no page written
            abandoned = True
        except KvtierError as e:
            log.warning("kvtier load of %s failed: %s", spec.name, e)
            with self._lock:
                self.failed_loads += 1
                self.load_failures.append(str(e))
        except BaseException as e:  # a bug must not hang the request
            log.warning("kvtier load of %s failed: %r", spec.name, e)
            with self._lock:
                self.failed_loads += 1
                self.load_failures.append(repr(e))
        with self._lock:
            self._async.pop(spec.request, None)
            self._abandoned.discard(spec.request)
            self._ended.append((spec.name, failed))
            if not abandoned:
                self.failed_load_blocks += len(failed)

    def ended_loads(self) -> list[tuple[str, list[int]]]:
        """Each asynchronous load that ended since the last call (or
        :meth:`finished_loads`): the request's engine id and its pages that
        did not load."""
        with self._lock:
            ended, self._ended = self._ended, []
        return ended

    def finished_loads(self) -> tuple[set[str], set[int]]:
        """The engine ids of requests whose asynchronous load ended since
        the last call, and the pages of theirs that did not load (the
        engine recomputes those blocks; every other page holds verified
        bytes)."""
        ended = self.ended_loads()
        names = {name for name, _ in ended}
        pages = {p for _, failed in ended for p in failed}
        return names, pages

    # -------------------------------------- synchronous, layer-wise loads

    def start_load(self, step: StepMeta) -> None:
        """Pins and starts the step's loads on the caller's thread. Blocks
        the store no longer holds are reported as failed pages at once."""
        for spec in step.loads:
            try:
                n, store_error = self._pin(spec)
                self._errors.update(spec.pages[n:])
                if n == 0:
                    continue
                self.connector.start_load(spec.request, spec.pages[:n])
                self._loading[spec.request] = LoadSpec(
                    spec.request, spec.hashes, spec.skip_blocks,
                    spec.pages[:n], spec.name)
            except KvtierError as e:
                self._fail(spec, e)

    def wait_for_layer(self, layer: int) -> None:
        """Returns once ``layer`` of every synchronous load of the step is
        in its pages (unverified: :meth:`wait_for_save` takes the
        verdicts, and the engine discards what it computed from a load
        that failed)."""
        for request in list(self._loading):
            try:
                self.connector.wait_for_layer(request, layer)
            except KvtierError:
                pass  # the verdict reports it

    def wait_for_save(self, step: StepMeta) -> None:
        """The end of the step: each synchronous load's verdict (failed
        pages are reported), then the step's saves (their bytes are copied
        before this returns; the store writes continue in the background),
        then the finished requests are closed."""
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
        if step.saves and self._stream_fence is not None:
            # The forward that wrote these pages was launched, not done.
            self._stream_fence().synchronize()
        for save in step.saves:
            if save.request in failed:
                continue  # computed from KV that failed its load: never saved
            try:
                self._open_request(save.request, save.hashes)
                self.connector.save(save.request, save.first_block,
                                    save.pages)
            except KvtierError as e:
                # A save that fails costs a future hit, nothing else; said
                # in the log at most every 10 s, with the count since.
                self.failed_saves += 1
                now = time.monotonic()
                if now - self._save_logged >= 10:
                    self._save_logged = now
                    log.warning("kvtier save of %d blocks failed (%d failed "
                                "saves so far): %s", len(save.pages),
                                self.failed_saves, e)
        for request in step.finished:
            self.finished(request)

    def queue_saves(self, step: StepMeta, lane: SaveLane) -> None:
        """The step's saves, handed to ``lane`` (copied out after the step;
        on a GPU after the engine's work launched before this call, the
        forward that wrote their pages). Returns at once; a save the lane
        skips costs a future hit, nothing else."""
        if not step.saves:
            return
        fence = self._stream_fence() if self._stream_fence else None
        for save in step.saves:
            lane.submit(save.request, len(save.pages),
                        functools.partial(self._copy_out, save), fence,
                        save.budget_ms)

    def _copy_out(self, save: SaveSpec, wait_ms: float) -> None:
        """One save's copy, on the lane's thread."""
        self._open_request(save.request, save.hashes)
        self.connector.save(save.request, save.first_block, save.pages,
                            wait_ms=wait_ms)

    def _fail(self, spec: LoadSpec, e: KvtierError) -> None:
        self.failed_loads += 1
        self.failed_load_blocks += len(spec.pages)
        self.load_failures.append(str(e))
        self._errors.update(spec.pages)

    def load_error_pages(self) -> set[int]:
        """Pages whose synchronous load failed since the last call (their
        blocks must be recomputed; their bytes never used)."""
        errors, self._errors = self._errors, set()
        return errors

    # ------------------------------------------------------------ closing

    def finished(self, request: int) -> None:
        """Closes the request. Its queued saves are written first, by a
        background thread, so the engine's step never waits for the store
        (their bytes were copied out of the pages already); a load still
        running ends first."""
        if request in self._loading:
            try:
                self._loading.pop(request)
                self.connector.wait_for_load(request)
            except KvtierError:
                pass
        with self._lock:
            self._open.discard(request)
            running = self._async.get(request)
            if running is not None:
                self._abandoned.add(request)
        if self._closer is None:
            self._closer = threading.Thread(target=self._close_loop,
                                            daemon=True, name="kvtier-close")
            self._closer.start()
        if running is not None:
            running.add_done_callback(lambda _: self._closing.put(request))
        else:
            self._closing.put(request)

    def _close_loop(self) -> None:
        bind_thread(self._cpus)
        while True:
            request = self._closing.get()
            if request is None:
                return
            try:
                self.connector.finished(request)
            except KvtierError:
                pass

    def close(self) -> None:
        """Waits for running loads, closes every request still open and
        waits for their saves."""
        if self._loader is not None:
            self._loader.shutdown(wait=True)
            self._loader = None
        with self._lock:
            still_open = list(self._open)
        for request in still_open:
            self.finished(request)
        if self._closer is not None:
            self._closing.put(None)
            self._closer.join()
            self._closer = None
