"""One step of the reference engine (kvtier.engine.engine): a forward
over the running batch with kvtier's connector hooks around it, in the
order vLLM's model runner calls them (build_connector_meta, start_load_kv,
wait_for_layer_load before each layer, wait_for_save), then the loads'
verdicts, first tokens and completions. A load's verdict comes before the
step's results are kept: a failed load rolls its request back to its own
prefix and the next step computes the tokens instead."""

from __future__ import annotations

import collections
import time
from typing import Callable, Optional

import torch

from kvtier import Connector
from kvtier.engine.model import PagedKvCache, SeqChunk, Transformer, greedy
from kvtier.engine.pages import _Pages
from kvtier.engine.requests import ComputeEstimate, EngineConfig, _Request
from kvtier.hooks import SchedulerHalf, WorkerHalf


class Steps:
    """The engine's steps over its model, KV cache, pages and kvtier's two
    halves; ``finish`` completes a request (under the engine's lock).
    Called from the engine's thread only."""

    def __init__(self, model: Transformer, cache: PagedKvCache,
                 config: EngineConfig, scheduler: SchedulerHalf,
                 worker: Optional[WorkerHalf],
                 connector: Optional[Connector], pages: _Pages,
                 compute: ComputeEstimate,
                 stats: "collections.Counter[str]",
                 finish: Callable[[_Request], None]) -> None:
        self.model, self.cache, self.config = model, cache, config
        self.scheduler, self.worker = scheduler, worker
        self.connector, self.pages = connector, pages
        self.compute, self.stats = compute, stats
        self._finish = finish

    def run(self, batch: list[_Request]) -> None:
        """One forward over the batch: a prefill chunk per prefilling
        request, one token per decoding one; the connector's hooks around
        it; then verdicts, first tokens and completions."""
        budget = self.config.max_step_tokens
        chunks: list[SeqChunk] = []
        members: list[tuple[_Request, int]] = []  # (request, tokens fed)
        for r in batch:
            if r.computed < len(r.prompt):
                if budget <= 0 and not r.load_blocks:
                    continue  # prefills next step; decodes still run
                # A request whose load starts this step always runs in it:
                # its verdict belongs to this step.
                n = min(len(r.prompt) - r.computed, max(budget, 1))
                budget -= n
                toks = r.prompt[r.computed:r.computed + n]
                start = r.computed
                # build_connector_meta: blocks this step fills are saved.
                self.scheduler.computed(r.rid, r.computed + n, r.pages)
            else:
                n = 1
                budget -= 1
                toks = [r.out[-1]]
                start = r.length - 1  # its pages were taken at admission
            chunks.append(SeqChunk(torch.tensor(toks, dtype=torch.long),
                                   start,
                                   torch.tensor(r.pages, dtype=torch.long)))
            members.append((r, n))
        step = self.scheduler.build_step()
        errors: set[int] = set()
        logits: Optional[torch.Tensor] = None
        if self.worker is not None:
            t0 = time.monotonic()
            self.worker.start_load(step)
            pinned_ms = (time.monotonic() - t0) * 1000.0
            loading = [r for r, _ in members if r.load_blocks > 0]
            for r in loading:
                r.onboard_ms += pinned_ms
            worker = self.worker
            waited = [0.0]

            def before_layer(layer: int) -> None:
                t = time.monotonic()
                worker.wait_for_layer(layer)  # wait_for_layer_load
                ms = (time.monotonic() - t) * 1000.0
                waited[0] += ms
                for r in loading:
                    r.onboard_ms += ms

            if chunks:
                t0 = time.monotonic()
                logits = self.model.forward(chunks, self.cache,
                                            before_layer=before_layer)
                self.compute.timed(sum(n for _, n in members),
                            (time.monotonic() - t0) * 1000.0 - waited[0])
            t0 = time.monotonic()
            worker.wait_for_save(step)
            for r in loading:
                r.onboard_ms += (time.monotonic() - t0) * 1000.0
            errors = worker.load_error_pages()
        elif chunks:
            logits = self.model.forward(chunks, self.cache)
        if logits is None:
            return
        now = time.monotonic()
        for i, (r, n) in enumerate(members):
            if r.load_blocks > 0 and not self._verdict(r, errors):
                continue  # rolled back: this step's output is not used
            if r.computed < len(r.prompt):
                r.computed += n
                r.computed_tokens += n
                self._cache_full_blocks(r)
                if r.computed < len(r.prompt):
                    continue
                r.first_token_at = now
                r.first_logits = logits[i].clone()
                r.out.append(int(greedy(logits[i])))
            else:
                r.out.append(int(greedy(logits[i])))
            if len(r.out) >= r.max_new:
                self._finish(r)

    def _verdict(self, r: _Request, errors: set[int]) -> bool:
        """The load's verdict (get_block_ids_with_load_errors): verified
        blocks enter the prefix cache; a failure rolls the request back to
        its own prefix."""
        bt = self.config.page_tokens
        n = r.load_blocks
        r.load_blocks = 0
        first = r.gpu_blocks
        load_pages = r.pages[first:first + n]
        self.stats["loads"] += 1
        if not errors.intersection(load_pages):
            assert self.connector is not None
            r.loaded_blocks = n
            r.loaded_from_disk = self.connector.loaded_from_disk(r.rid)
            r.load_times = self.connector.load_times(r.rid)
            for b in range(first, first + n):
                self.pages.commit(r.pages[b], self._key(r, b))
            r.saved_blocks = first + n
            self.stats["loaded_blocks"] += n
            return True
        self.stats["load_failures"] += 1
        failures = self.worker.load_failures if self.worker else []
        r.load_status = ("load failed, computed instead: " +
                         (failures[-1] if failures else
                          "blocks left the store before they were pinned"))
        r.computed = r.gpu_blocks * bt  # recompute from the engine's prefix
        self.scheduler.load_failed(r.rid, r.computed)
        return False

    @staticmethod
    def _key(r: _Request, block: int) -> tuple[int, int]:
        hi, lo = r.hashes[block].tolist()
        return int(hi), int(lo)

    def _cache_full_blocks(self, r: _Request) -> None:
        """Prompt blocks that became full enter the prefix cache."""
        full = min(r.computed, len(r.prompt)) // self.config.page_tokens
        for b in range(r.saved_blocks, full):
            self.pages.commit(r.pages[b], self._key(r, b))
        r.saved_blocks = max(r.saved_blocks, full)
