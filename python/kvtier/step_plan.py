"""The plan a scheduler half hands its worker halves for one step
(:class:`StepMeta`): the loads it starts, the saves it asks for, the
requests that finished or whose pages the engine took back. Plain and
picklable: vLLM carries it between its scheduler and worker processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np


@dataclass
class LoadSpec:
    """Load blocks [skip_blocks, skip_blocks + len(pages)) of the chain
    into ``pages`` (the engine holds blocks [0, skip_blocks) itself).
    ``name``: the engine's own id of the request (vLLM's, reported back
    when an asynchronous load ends)."""

    request: int
    hashes: np.ndarray
    skip_blocks: int
    pages: list[int]
    name: str = ""


@dataclass
class SaveSpec:
    """Save blocks [first_block, first_block + len(pages)) of the chain,
    computed into ``pages``."""

    request: int
    hashes: np.ndarray
    first_block: int
    pages: list[int]
    budget_ms: Optional[float] = None  # None: the worker's save budget


@dataclass
class StepMeta:
    """What the scheduler half hands the worker half for one step."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)
    # Finished requests whose pages the engine holds until their saves are
    # copied out (key -> the engine's id, reported back when they are).
    held: dict[int, str] = field(default_factory=dict)
    # Requests whose pages the engine took back (preempted, or finished
    # and not held): their saves not yet copied are dropped.
    released: list[int] = field(default_factory=list)
