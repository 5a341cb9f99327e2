"""kvtier in an engine's scheduler and worker, engine-neutral: the names
the integrations use, from the modules that hold them.

- :mod:`kvtier.scheduler_half`: :class:`SchedulerHalf` and the plan it
  builds each step (:class:`StepMeta`, :class:`LoadSpec`,
  :class:`SaveSpec`); its lookups are batched per step
  (:mod:`kvtier.step_lookups`).
- :mod:`kvtier.worker_half`: :class:`WorkerHalf`, which executes a plan
  (asynchronous or layer-wise loads, saves, closes).
"""

from __future__ import annotations

import functools
import hashlib

from kvtier.scheduler_half import LoadSpec, SaveSpec, SchedulerHalf, StepMeta
from kvtier.worker_half import WorkerHalf

__all__ = ["LoadSpec", "SaveSpec", "SchedulerHalf", "StepMeta", "WorkerHalf",
           "request_key"]


@functools.lru_cache(maxsize=1 << 16, typed=True)
def request_key(request_id: object) -> int:
    """A kvtier request id (63-bit int) for an engine's request id (a str
    in vLLM and SGLang), the same in every process."""
    if isinstance(request_id, int) and 0 <= request_id < 1 << 63:
        return request_id
    digest = hashlib.blake2b(str(request_id).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)
