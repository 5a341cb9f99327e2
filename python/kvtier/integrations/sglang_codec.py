"""SGLang's host KV pools as kvtier sees them: each pool kind and layout's
page geometry (the stored page order is the same for every layout of a
kind, so engines with different ``--hicache-mem-layout`` share blocks), the
namespace of a pool from SGLang's storage config (ranks and model name
read, never guessed), and the page keys' block hashes."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import torch

import kvtier
from kvtier.dtypes import engine_key_hashes, kvtier_dtype
from kvtier.errors import InvalidArgument, StatusCode


#: (page-grid shape of N pages, the page axis, the permutation from that
#: grid to the stored page order) per pool kind and layout. ``g`` holds the
#: geometry: L layers, P tokens a page, H heads, D head dim, C MLA row.
_Grid = Callable[[dict, int], tuple]
_LAYOUTS: dict[tuple[str, str], tuple[_Grid, int, tuple[int, ...]]] = {
    # MHA, stored as [N, L, 2, P, H, D].
    ("mha", "layer_first"):        # kv_buffer [2, L, size, H, D]
        (lambda g, n: (2, g["L"], n, g["P"], g["H"], g["D"]), 2,
         (2, 1, 0, 3, 4, 5)),
    ("mha", "page_first"):         # [2, size, L, H, D]
        (lambda g, n: (2, n, g["P"], g["L"], g["H"], g["D"]), 1,
         (1, 3, 0, 2, 4, 5)),
    ("mha", "page_first_direct"):  # [2, pages, L, P, H, D]
        (lambda g, n: (2, n, g["L"], g["P"], g["H"], g["D"]), 1,
         (1, 2, 0, 3, 4, 5)),
    ("mha", "page_head"):          # [2, pages, H, P, L, D]
        (lambda g, n: (2, n, g["H"], g["P"], g["L"], g["D"]), 1,
         (1, 4, 0, 3, 2, 5)),
    # MLA, stored as [N, L, P, C].
    ("mla", "layer_first"):        # kv_buffer [L, size, 1, C]
        (lambda g, n: (g["L"], n, g["P"], g["C"]), 1, (1, 0, 2, 3)),
    ("mla", "page_first"):         # [size, L, 1, C]
        (lambda g, n: (n, g["P"], g["L"], g["C"]), 0, (0, 2, 1, 3)),
    ("mla", "page_first_direct"):  # [pages, L, P, 1, C]
        (lambda g, n: (n, g["L"], g["P"], g["C"]), 0, (0, 1, 2, 3)),
    ("mla", "page_unified"):       # [pages, L, P, C]
        (lambda g, n: (n, g["L"], g["P"], g["C"]), 0, (0, 1, 2, 3)),
}


def key_hashes(keys: Sequence[str]) -> np.ndarray:
    """kvtier block hashes (uint64 [n, 2]) of SGLang page keys (the one
    engine-key function, kvtier.dtypes.engine_key_hashes)."""
    return engine_key_hashes(keys)


def _bad(message: str) -> InvalidArgument:
    return InvalidArgument(StatusCode.INVALID_ARGUMENT, message)


#: The fields of SGLang's HiCacheStorageConfig that say whose KV a page is.
_RANKS = (("tp_rank", "tp_size"), ("pp_rank", "pp_size"),
          ("attn_cp_rank", "attn_cp_size"))


def storage_identity(config: Any) -> dict[str, Any]:
    """The model and the ranks of SGLang's storage config, read, never
    guessed: two ranks or two models of equal geometry must not share
    blocks. InvalidArgument naming the field when one is missing or not a
    rank within its size, or when the model name is empty."""
    out: dict[str, Any] = {}
    for rank, size in _RANKS:
        for name in (rank, size):
            value = getattr(config, name, None)
            if not isinstance(value, int) or isinstance(value, bool):
                raise _bad(f"SGLang's HiCacheStorageConfig.{name} is "
                           f"{value!r}; kvtier needs it (an integer) to keep "
                           "each rank's blocks apart")
            out[name] = value
        if not 0 <= out[rank] < out[size]:
            raise _bad(f"SGLang's HiCacheStorageConfig.{rank} = {out[rank]} "
                       f"is not a rank of {size} = {out[size]}")
    model = getattr(config, "model_name", None)
    if not isinstance(model, str) or not model.strip():
        raise _bad(f"SGLang's HiCacheStorageConfig.model_name is {model!r}; "
                   "kvtier needs the model's name so that two models of "
                   "equal geometry never share blocks (SGLang sets it from "
                   "--model-path / --served-model-name)")
    out["model_name"] = model
    return out


def _inverse(perm: tuple[int, ...]) -> tuple[int, ...]:
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return tuple(inv)


class PoolCodec:
    """Moves the pages of one SGLang host pool between the pool's buffer
    (in its layout) and kvtier's stored page format, and names the pool's
    kvtier namespace (its ranks, geometry and ``ident``, the deployment's
    identity tag). Raises InvalidArgument for a pool class, layout or
    dtype kvtier does not store."""

    def __init__(self, pool: Any, name: str, config: Any,
                 ident: str) -> None:
        cls = type(pool).__name__
        layout = str(getattr(pool, "layout", ""))
        if hasattr(pool, "kv_lora_rank") and hasattr(pool, "kv_cache_dim"):
            kind = "mla"
        elif hasattr(pool, "head_num") and hasattr(pool, "head_dim"):
            kind = "mha"
        else:
            raise _bad(f'SGLang host pool "{name}" ({cls}) is not one kvtier '
                       "stores: only MHATokenToKVPoolHost and "
                       "MLATokenToKVPoolHost pools are")
        if (kind, layout) not in _LAYOUTS:
            ok = ", ".join(lo for k, lo in _LAYOUTS if k == kind)
            raise _bad(f'SGLang host pool "{name}" ({cls}) has layout '
                       f'"{layout}"; kvtier stores {cls} pools in layouts '
                       f"{ok}")
        kvtier_dtype(pool.dtype, f'SGLang host pool "{name}" ({cls}) dtype')
        buf = getattr(pool, "kv_buffer", None)
        if not isinstance(buf, torch.Tensor) or not buf.is_contiguous():
            raise _bad(f'SGLang host pool "{name}" ({cls}) has no '
                       "contiguous kv_buffer")
        if int(getattr(pool, "dcp_size", 1)) != 1:
            raise _bad(f'SGLang host pool "{name}" ({cls}) is sharded by '
                       "decode context parallelism (dcp_size "
                       f"{pool.dcp_size}); kvtier does not store DCP shards")
        self.kind, self.layout, self.name = kind, layout, name
        self.pool, self.buf, self.dtype = pool, buf, pool.dtype
        self.page = int(pool.page_size)
        g = {"L": int(pool.layer_num), "P": self.page}
        if kind == "mha":
            g.update(H=int(pool.head_num), D=int(pool.head_dim))
        else:
            g.update(C=int(pool.kv_cache_dim))
        self._g = g
        self._grid, self._axis, self._perm = _LAYOUTS[(kind, layout)]
        self._inv = _inverse(self._perm)
        self._ident = ident
        self.pages = int(buf.numel()) // int(np.prod(self._grid(g, 1)))
        self.namespace = self._namespace(pool, config)
        self.block_bytes = int(self.namespace.block_bytes)
        page_bytes = int(np.prod(self._grid(g, 1))) * buf.element_size()
        if page_bytes != self.block_bytes:  # pragma: no cover - a bug here
            raise _bad(f"pool page of {page_bytes} bytes does not match the "
                       f"namespace's {self.block_bytes}")

    def _namespace(self, pool: Any, c: Any) -> kvtier.Namespace:
        g, dtype = self._g, kvtier_dtype(pool.dtype)
        ident = storage_identity(c)
        ranks = (f"pp={ident['pp_rank']}/{ident['pp_size']}"
                 f"|cp={ident['attn_cp_rank']}/{ident['attn_cp_size']}"
                 f"|{self._ident}")
        model = str(ident["model_name"]).replace("|", "/")
        if self.kind == "mha":
            layout = (f"sglang-mha|pool={self.name}|v_head_dim="
                      f"{int(getattr(pool, 'v_head_dim', g['D']))}|{ranks}")
            return kvtier.Namespace(
                model, dtype, g["L"], g["H"], g["D"], g["P"],
                tp_rank=ident["tp_rank"], tp_size=ident["tp_size"],
                layout=layout)
        # An MLA page is [L, P, C]; the namespace sizes a block as
        # 2 x layers x heads x head_dim x tokens elements, so halve C or P.
        L, P, C = g["L"], g["P"], g["C"]
        if C % 2 == 0:
            dims = (L, 1, C // 2, P)
        elif P % 2 == 0:
            dims = (L, 1, C, P // 2)
        else:
            raise _bad(f'SGLang MLA pool "{self.name}": rows of {C} elements '
                       f"in pages of {P} tokens (both odd) do not fit "
                       "kvtier's block geometry")
        layout = (f"sglang-mla|pool={self.name}|kv_lora_rank="
                  f"{int(pool.kv_lora_rank)}|rope="
                  f"{int(getattr(pool, 'qk_rope_head_dim', 0))}|c={C}|p={P}"
                  f"|{ranks}")
        return kvtier.Namespace(model, dtype, *dims, layout=layout)

    def pages_of(self, host_indices: torch.Tensor, count: int) -> torch.Tensor:
        """The page numbers of ``count`` pages' token indices; raises
        InvalidArgument for indices that are not whole pages of the pool."""
        idx = host_indices.reshape(-1).to(torch.int64).cpu()
        if idx.numel() != count * self.page:
            raise _bad(f"{idx.numel()} host indices for {count} pages of "
                       f"{self.page} tokens")
        starts = idx[::self.page]
        if bool((starts % self.page != 0).any()):
            raise _bad("host indices are not page-aligned")
        pages = starts // self.page
        if count and (int(pages.min()) < 0 or int(pages.max()) >= self.pages):
            raise _bad(f"host indices reach past the pool's {self.pages} "
                       "pages")
        return pages

    def _paged(self, t: torch.Tensor, n: int) -> torch.Tensor:
        return t.view(self._grid(self._g, n))

    def gather(self, pages: torch.Tensor, out: torch.Tensor) -> None:
        """Copies ``pages`` of the pool into ``out`` (bytes, stored format)."""
        sel = self._paged(self.buf, self.pages).index_select(self._axis,
                                                             pages)
        dst = out[:len(pages) * self.block_bytes].view(self.dtype)
        dst.view(sel.permute(self._perm).shape).copy_(sel.permute(self._perm))

    def scatter(self, pages: torch.Tensor, src: torch.Tensor) -> None:
        """Copies stored-format bytes ``src`` into ``pages`` of the pool."""
        n = len(pages)
        stored = src[:n * self.block_bytes].view(self.dtype)
        grid = self._grid(self._g, n)
        canon = [grid[p] for p in self._perm]
        self._paged(self.buf, self.pages).index_copy_(
            self._axis, pages, stored.view(canon).permute(self._inv))

    def flat_to_block(self, flat: torch.Tensor) -> torch.Tensor:
        """A flat page in the layout's order (SGLang's ``get_data_page``)
        as stored-format bytes."""
        if flat.numel() * flat.element_size() != self.block_bytes:
            raise _bad(f"a flat page of {flat.numel()} elements is not one "
                       f"{self.block_bytes}-byte page of this pool")
        t = self._paged(flat.reshape(-1), 1).permute(self._perm)
        return t.contiguous().view(torch.uint8).reshape(-1)

    def block_to_flat(self, block: torch.Tensor, out: torch.Tensor) -> None:
        """Stored-format bytes as a flat page in the layout's order."""
        shape = self._grid(self._g, 1)
        canon = [shape[p] for p in self._perm]
        t = block.view(self.dtype).view(canon).permute(self._inv)
        self._paged(out.reshape(-1), 1).copy_(t)
