"""The reference model's configuration and the checks the model and its
cache share."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: Cache element types the engine accepts.
_CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: Cache layouts: name -> index of the K/V axis in a layer's tensor.
_LAYOUTS = {"kv_first": 0, "blocks_first": 1}
#: Most float32 attention scores materialised at once (64 MiB); queries are
#: processed in blocks small enough to stay under it.
_SCORE_BUDGET = 1 << 24


def _check_ids(ids: torch.Tensor, limit: int, what: str) -> None:
    """ValueError naming ``what`` unless every id is in [0, limit)."""
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= limit:
        bad = low if low < 0 else high
        raise ValueError(f"{what} {bad} is outside [0, {limit})")


def _is_int(value: object) -> bool:
    """Whether ``value`` is an ``int`` proper (``bool`` excluded)."""
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class ModelConfig:
    """Shape and seed of a :class:`Transformer`.

    ``heads`` is the number of query heads, ``kv_heads`` the number of key and
    value heads (grouped-query attention: each key/value head serves
    ``heads // kv_heads`` consecutive query heads), ``ffn`` the SwiGLU
    intermediate size. ``seed`` fixes every weight.
    """

    vocab_size: int = 4096
    hidden: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    ffn: int = 256
    rope_theta: float = 10000.0
    eps: float = 1e-5
    seed: int = 0

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first unusable field."""
        for name in ("vocab_size", "hidden", "layers", "heads", "kv_heads",
                     "head_dim", "ffn"):
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                raise ValueError(
                    f"ModelConfig.{name} must be a positive int, "
                    f"got {value!r}")
        if self.heads % self.kv_heads != 0:
            raise ValueError(
                f"ModelConfig.heads ({self.heads}) must be a multiple of "
                f"ModelConfig.kv_heads ({self.kv_heads})")
        if self.head_dim % 2 != 0:
            raise ValueError(
                f"ModelConfig.head_dim must be even for rotary embeddings, "
                f"got {self.head_dim}")
        for name in ("rope_theta", "eps"):
            value = getattr(self, name)
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not math.isfinite(value) or value <= 0):
                raise ValueError(
                    f"ModelConfig.{name} must be a finite number > 0, "
                    f"got {value!r}")
        if not _is_int(self.seed) or not 0 <= self.seed < 2 ** 63:
            raise ValueError(
                f"ModelConfig.seed must be an int in [0, 2**63), "
                f"got {self.seed!r}")
