"""The reference engine's configuration, requests and results."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Container, Iterable, Optional

import numpy as np
import torch

from kvtier import Namespace
from kvtier.engine.model import ModelConfig


@dataclass(frozen=True)
class EngineConfig:
    """Sizes of the engine (its KV cache and its steps)."""

    num_pages: int = 2048
    page_tokens: int = 16          # tokens per page == kvtier block_tokens
    max_step_tokens: int = 1024    # prefill + decode tokens per step
    max_running: int = 8           # requests in a step at most
    kv_dtype: str = "fp16"         # "fp16" or "bf16"
    layout: str = "kv_first"       # vLLM layout of each layer's tensor
    # How long a store lookup is waited for, as a share of computing what
    # it could save (None: up to the store client's deadline).
    lookup_wait_share: Optional[float] = 0.25


def namespace_for(model: ModelConfig, engine: EngineConfig,
                  kv_wire: str = "") -> Namespace:
    """The kvtier namespace of a model's KV: engines with equal model
    configurations (weights included, via the seed) share blocks."""
    name = (f"kvtier-reference-v{model.vocab_size}-h{model.hidden}"
            f"-l{model.layers}-q{model.heads}-f{model.ffn}"
            f"-r{model.rope_theta:g}-s{model.seed}")
    return Namespace(name, engine.kv_dtype, model.layers, model.kv_heads,
                     model.head_dim, engine.page_tokens, kv_wire=kv_wire)


@dataclass
class DrainReport:
    """What :meth:`Engine.drain` did.

    ``unfinished``: requests still waiting or running at the deadline
    (they fail when the engine closes). ``cached``: blocks in the prefix
    cache; ``known``: of those, skipped as known to be in the store (saved
    or loaded earlier); ``queued``: copied out for the store, most valuable
    first; ``saved``: written to the store (of this drain's saves and any
    still queued before it); ``bytes``: block bytes queued. ``stopped``:
    why it stopped short of every block the store lacked: "" (it did not),
    "bytes" (the byte budget), "time" (the deadline: what was still queued
    was dropped), "store" (the store refused or failed some), "no store".
    ``ms``: from the call to its return.
    """

    unfinished: int = 0
    cached: int = 0
    known: int = 0
    queued: int = 0
    saved: int = 0
    bytes: int = 0
    stopped: str = ""
    ms: float = 0.0


@dataclass
class Result:
    """One request's outcome.

    ``ttft_ms``: from submission to the first output token (queueing, loads
    and real compute). ``computed_tokens``: prompt tokens this engine
    computed; ``gpu_hit_tokens``: found in its own prefix cache;
    ``loaded_tokens``: loaded from kvtier and verified. ``load_status``:
    empty, or why a load failed or the store's lookup was not waited for
    (its tokens were computed instead).
    ``onboard_ms``: what kvtier added to the request's path: the lookup's
    round trip (the pin) and the time the steps waited for layers and for
    the verdict (a load overlapped with compute costs nothing more).
    """

    tokens: list[int]
    ttft_ms: float
    prompt_tokens: int
    computed_tokens: int
    gpu_hit_tokens: int
    loaded_tokens: int
    loaded_blocks: int
    loaded_from_disk: int
    load_status: str
    onboard_ms: float
    decode_ms: float
    first_logits: torch.Tensor
    load_times: dict[str, float] = field(default_factory=dict)
    store_lookup_skipped: bool = False


# How long a request's caller id is listed in load reports after it
# arrives, at least (load_report's listed_s).
ARRIVALS_LISTED_S = 0.25

# The shortest wait for a store lookup (a loopback round trip takes
# 0.3-1 ms; a loaded host's scheduling adds a few).
MIN_LOOKUP_WAIT_MS = 5.0

# Steps feeding fewer tokens than this do not update the compute estimate
# (a decode step's cost is mostly per-step overhead).
_TIMED_STEP_TOKENS = 64


@dataclass
class LoadReport:
    """An engine's load for routers (``Engine.load_report``)."""
    running: int
    queued_tokens: int
    free_pages: int
    arrived: list[int]


@dataclass
class _Request:
    rid: int
    prompt: list[int]
    max_new: int
    arrival: float
    done: threading.Event = field(default_factory=threading.Event)
    hashes: np.ndarray = field(default_factory=lambda: np.zeros((0, 2),
                                                                np.uint64))
    pages: list[int] = field(default_factory=list)
    gpu_blocks: int = 0
    computed: int = 0             # positions whose KV is in the pages
    computed_tokens: int = 0      # of those, computed by this engine
    saved_blocks: int = 0         # blocks committed / saved so far
    load_blocks: int = 0          # blocks loading in the current step
    loaded_blocks: int = 0
    loaded_from_disk: int = 0
    load_status: str = ""
    onboard_ms: float = 0.0
    load_times: dict[str, float] = field(default_factory=dict)
    out: list[int] = field(default_factory=list)
    first_token_at: float = 0.0
    first_logits: Optional[torch.Tensor] = None
    error: Optional[BaseException] = None
    caller_id: int = 0            # the id its caller gave (0: none)
    store_hint: Optional[int] = None  # the router's store_end_blocks
    lookup_skipped: bool = False  # the hint spared the store lookup
    result: Optional[Result] = None

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.out)


def queued_tokens(running: Iterable[_Request], waiting: Iterable[_Request],
                  cached: Container[tuple[int, int]], page_tokens: int) -> int:
    """The prompt tokens a router weighs a new request against: what the
    running requests have left to compute and what each waiting one will
    compute, in order, past what the cache holds (``cached``: chain hashes)
    or the requests before it will have computed (a waiting request matches
    the cache again when it is scheduled, and computes at least its last
    page)."""
    queued = sum(max(0, len(r.prompt) - r.computed) for r in running)
    earlier: set[tuple[int, int]] = set()
    for r in running:
        earlier.update(map(tuple, r.hashes.tolist()))
    for r in waiting:
        blocks = [tuple(h) for h in r.hashes.tolist()]
        limit = (len(r.prompt) - 1) // page_tokens  # as the scheduler admits
        held = 0
        while held < min(len(blocks), limit) and (
                blocks[held] in earlier or blocks[held] in cached):
            held += 1
        queued += max(0, len(r.prompt) - held * page_tokens)
        earlier.update(blocks)
    return queued


class ComputeEstimate:
    """The engine's measured compute: milliseconds of forward per prompt
    token (a moving average; None until the profile run), and from it how
    long a store lookup is worth waiting for."""

    def __init__(self, lookup_wait_share: Optional[float]) -> None:
        self.share = lookup_wait_share
        self.ms_per_token: Optional[float] = None

    def timed(self, tokens: int, ms: float) -> None:
        """A forward of ``tokens`` tokens took ``ms`` of compute (steps of
        fewer than _TIMED_STEP_TOKENS are mostly per-step overhead: not
        counted)."""
        if tokens < _TIMED_STEP_TOKENS:
            return
        sample = ms / tokens
        self.ms_per_token = (sample if self.ms_per_token is None else
                             0.8 * self.ms_per_token + 0.2 * sample)

    def lookup_wait_ms(self, tokens: int) -> Optional[float]:
        """``lookup_wait_share`` of computing ``tokens`` tokens, at least
        MIN_LOOKUP_WAIT_MS (None: no bound but the client's deadline)."""
        if self.share is None or self.ms_per_token is None:
            return None
        return max(MIN_LOOKUP_WAIT_MS, self.share * tokens * self.ms_per_token)

