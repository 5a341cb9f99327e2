"""vLLM's KV tensors as kvtier's connector moves them: a page of a layer is
one contiguous range in every layout kvtier accepts, moved whole, as
opaque bytes (the namespace records the layout)."""

from __future__ import annotations

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
