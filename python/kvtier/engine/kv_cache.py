"""The reference engine's paged KV cache, in vLLM's layouts, and the
chunks of sequences a step feeds the model."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtier.engine.model_config import (_CACHE_DTYPES, _LAYOUTS, ModelConfig,
                                        _is_int)


class PagedKvCache:
    """Paged KV cache in vLLM's layouts, one tensor per layer.

    layout ``"kv_first"``:
    ``[2, num_pages, page_tokens, kv_heads, head_dim]``
    (vLLM FlashAttention backend);
    layout ``"blocks_first"``:
    ``[num_pages, 2, page_tokens, kv_heads, head_dim]``
    (vLLM FlashInfer-style).

    Index 0 of the K/V axis holds keys, index 1 values. A page holds the keys
    and values of ``page_tokens`` consecutive positions of one sequence; slot
    ``s`` of a page holds the position ``s`` places into its span. ``dtype``
    defaults to float16 (bfloat16 and float32 are accepted), ``device`` to the
    CPU. The tensors start zeroed.
    """

    def __init__(self, config: ModelConfig, num_pages: int, page_tokens: int,
                 dtype: torch.dtype = torch.float16, layout: str = "kv_first",
                 device: torch.device | str = "cpu") -> None:
        """Allocate ``config.layers`` zeroed tensors.

        Raises ``ValueError`` for a bad argument.
        """
        config.validate()
        if not _is_int(num_pages) or num_pages <= 0:
            raise ValueError(
                f"num_pages must be a positive int, got {num_pages!r}")
        if not _is_int(page_tokens) or page_tokens <= 0:
            raise ValueError(
                f"page_tokens must be a positive int, got {page_tokens!r}")
        if dtype not in _CACHE_DTYPES:
            raise ValueError(
                f"cache dtype must be one of {_CACHE_DTYPES}, got {dtype!r}")
        if layout not in _LAYOUTS:
            raise ValueError(
                f"layout must be one of {sorted(_LAYOUTS)}, got {layout!r}")
        self.config: ModelConfig = config
        self.num_pages: int = num_pages
        self.page_tokens: int = page_tokens
        self.dtype: torch.dtype = dtype
        self.layout: str = layout
        per_kv = (num_pages, page_tokens, config.kv_heads, config.head_dim)
        shape = (2, *per_kv) if layout == "kv_first" else (
            num_pages, 2, *per_kv[1:])
        self.tensors: list[torch.Tensor] = [
            torch.zeros(shape, dtype=dtype, device=device)
            for _ in range(config.layers)]

    @property
    def device(self) -> torch.device:
        """Device the cache tensors live on."""
        return self.tensors[0].device

    def _half(self, layer: int, which: int) -> torch.Tensor:
        """View of layer ``layer``'s keys (``which`` 0) or values (1)."""
        if not _is_int(layer) or not 0 <= layer < len(self.tensors):
            raise ValueError(
                f"layer must be in [0, {len(self.tensors)}), got {layer!r}")
        tensor = self.tensors[layer]
        return tensor[which] if self.layout == "kv_first" else tensor[:, which]

    def key(self, layer: int) -> torch.Tensor:
        """Keys of ``layer``.

        A view ``[num_pages, page_tokens, kv_heads, head_dim]``; writes go
        to the cache.
        """
        return self._half(layer, 0)

    def value(self, layer: int) -> torch.Tensor:
        """Values of ``layer``; a view shaped like :meth:`key`."""
        return self._half(layer, 1)

    def page_bytes(self) -> int:
        """Bytes of one page's K chunk (equal to its V chunk) in one layer."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return (self.page_tokens * self.config.kv_heads * self.config.head_dim
                * element)


@dataclass
class SeqChunk:
    """A run of consecutive tokens of one sequence to push through the model.

    ``tokens``: integer ``[n]``, ``n >= 1``, the token ids of positions
    ``[start, start + n)``. ``start``: the position of ``tokens[0]``; the KV of
    positions ``[0, start)`` must already be in the cache. ``page_table``:
    integer ``[>= ceil((start + n) / page_tokens)]``; entry ``j`` is the page
    holding positions ``[j * page_tokens, (j + 1) * page_tokens)``. Entries
    past the first ``ceil((start + n) / page_tokens)`` are not read (they may
    be padding such as -1).
    """

    tokens: torch.Tensor
    start: int
    page_table: torch.Tensor
