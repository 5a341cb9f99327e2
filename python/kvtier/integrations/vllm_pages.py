"""vLLM's KV tensors as kvtier's connector moves them: a page of a layer is
one contiguous range in every layout kvtier accepts, moved whole, as
opaque bytes (the namespace records the layout)."""

from __future__ import annotations

import re
from typing import Any

import kvtier


def page_view(t: Any, ns: Any, layout: str = "?") -> Any:
    """A 4-D layer view [P, H, T, C] (vLLM 0.26 and later) as
    [P, 2, T, H, D] over the same bytes: each page's first and second
    halves as "K" and "V", so the connector moves every page whole.
    InvalidArgument unless the view has ``ns``'s geometry and a page of
    the layer is contiguous (C = 2 x head size; the block stride may carry
    padding); ``layout``: vLLM's KV cache layout, for the message."""
    import torch
    p, h, tok, c = (int(x) for x in t.shape)
    d = int(ns.head_dim)
    # The page's dims, innermost first, must tile it densely (in whichever
    # order the layout puts heads and tokens).
    dims = sorted(zip(t.stride()[1:], t.shape[1:]))
    dense = all(stride == (1 if i == 0 else dims[i - 1][0] * dims[i - 1][1])
                for i, (stride, _) in enumerate(dims))
    if (h, tok, c) != (int(ns.kv_heads), int(ns.block_tokens), 2 * d) \
            or not dense or t.stride()[0] < h * tok * c:
        raise kvtier.errors.InvalidArgument(
            kvtier.StatusCode.INVALID_ARGUMENT,
            f"vLLM's KV view of shape {tuple(t.shape)} and strides "
            f"{tuple(t.stride())} is not [blocks, {ns.kv_heads} heads, "
            f"{ns.block_tokens} tokens, K|V of {2 * d}] with each page "
            f"contiguous (layout {layout})")
    half = tok * h * d
    return torch.as_strided(t, (p, 2, tok, h, d),
                            (t.stride()[0], half, h * d, d, 1),
                            t.storage_offset())


def cuda_stream_fence() -> Any:
    """A ``torch.cuda.Event`` recorded on the caller's current CUDA stream
    (the engine's): its ``synchronize()`` returns once the work launched
    there before it is done."""
    import torch
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream())
    return event


def engine_tensors(kv_caches: dict[str, Any], kv_cache_config: Any,
                   group: int, ns: Any) -> tuple[list[Any], str]:
    """The KV tensors of KV cache group ``group``, in layer order, as
    kvtier's connector takes them, and their layout.

    vLLM 0.26 and later (``kv_cache_config`` with a layout): each layer is
    a 4-D view ``[blocks, heads, tokens, K|V]`` of one buffer shared by the
    layers, given as :func:`page_view`s (``"blocks_first"``). Older vLLM
    (``kv_cache_config`` None): 5-D ``[2, blocks, ...]`` (``"kv_first"``)
    or ``[blocks, 2, ...]`` tensors. InvalidArgument for other ranks and
    for a layer the group names that vLLM registered no tensor for."""
    names = layer_order(kv_caches, kv_cache_config, group)
    tensors = [kv_caches[n] for n in names]
    if tensors[0].dim() == 4:
        layout_name = str(getattr(kv_cache_config, "kv_cache_layout", "?"))
        return [page_view(t, ns, layout_name) for t in tensors], \
            "blocks_first"
    if tensors[0].dim() == 5:
        first = tensors[0]
        return tensors, ("kv_first" if first.shape[0] == 2 and
                         first.shape[1] != 2 else "blocks_first")
    raise kvtier.errors.InvalidArgument(
        kvtier.StatusCode.INVALID_ARGUMENT,
        f"vLLM handed kvtier a {tensors[0].dim()}-D KV tensor of shape "
        f"{tuple(tensors[0].shape)}; kvtier's connector takes 4-D [blocks, "
        "heads, tokens, K|V] views (vLLM 0.26 and later) or 5-D [2, blocks, "
        "...] / [blocks, 2, ...] tensors")


def layer_order(kv_caches: dict[str, Any], kv_cache_config: Any,
                group: int = 0) -> list[str]:
    """The KV layers in order: the KV cache group's own list when vLLM
    gives one (the dict may also hold aliases of shared layers), else the
    layer names sorted by their index."""
    kc = kv_cache_config
    if kc is not None and getattr(kc, "kv_cache_groups", None):
        names = list(kc.kv_cache_groups[group].layer_names)
        missing = [n for n in names if n not in kv_caches]
        if missing:
            raise kvtier.errors.InvalidArgument(
                kvtier.StatusCode.INVALID_ARGUMENT,
                f"vLLM registered no KV tensor for layers {missing}")
        return names

    def index(name: str) -> int:
        m = re.search(r"\.(\d+)\.", name)
        return int(m.group(1)) if m else 0
    return sorted(kv_caches, key=index)
