"""SGLang's real host pools on CPU for the kvtier HiCache tests, built the
way SGLang's pool assembler builds them (a device buffer description, then
the host pool), and an oracle that reads a token's K/V straight from each
layout's buffer dims (``init_kv_buffer`` in ``pool_host/mha.py`` and
``pool_host/mla.py``), independent of kvtier's own layout tables.

Run as a script it is the writer process of the two-process round trip:
``python sglang_pools.py STORE_ADDRESS SEED`` writes, for every case in
``CASES``, pages ``WRITE_PAGES`` of a pool filled from ``SEED`` under that
case's keys, and prints ``ok``.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

import torch
from sglang.srt.mem_cache.device_pool_info import (KVBufferLayout,
                                                   KVBuffers, MHABufferInfo,
                                                   MLABufferInfo)
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_hash_str
from sglang.srt.runtime_context import publish
from sglang.srt.server_args import ServerArgs

from vllm_engine import TINY_MODEL

L, H, D, P = 2, 2, 32, 16
LORA, ROPE = 32, 16
DEVICE_TOKENS = P * 8

#: (pool kind, layout) of every layout kvtier stores.
CASES = [("mha", "layer_first"), ("mha", "page_first"),
         ("mha", "page_first_direct"), ("mha", "page_head"),
         ("mla", "layer_first"), ("mla", "page_first"),
         ("mla", "page_first_direct"), ("mla", "page_unified")]
WRITE_PAGES = [3, 5, 7, 9]


def _ptrs(ts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)


def mha_pool(layout: str, seed: int, dtype: torch.dtype = torch.float16,
             v_head_dim: int = D, layers: int = L) -> MHATokenToKVPoolHost:
    """An MHATokenToKVPoolHost on CPU, its buffer filled from ``seed``."""
    k = tuple(torch.zeros(DEVICE_TOKENS, H, D, dtype=dtype)
              for _ in range(layers))
    v = tuple(torch.zeros(DEVICE_TOKENS, H, v_head_dim, dtype=dtype)
              for _ in range(layers))
    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=_ptrs(k),
                          v_data_ptrs=_ptrs(v), layout=KVBufferLayout.NHD),
        page_size=P, head_num=H, head_dim=D, v_head_dim=v_head_dim,
        dtype=dtype, device=torch.device("cpu"))
    pool = MHATokenToKVPoolHost(
        info, 2.0, 0, P, layout, pin_memory=False, device="cpu",
        device_capacity_tokens=DEVICE_TOKENS, start_layer=0,
        end_layer=layers)
    _fill(pool, seed)
    return pool


def mla_pool(layout: str, seed: int,
             dtype: torch.dtype = torch.bfloat16) -> MLATokenToKVPoolHost:
    """An MLATokenToKVPoolHost on CPU, its buffer filled from ``seed``."""
    c = LORA + ROPE
    bufs = tuple(torch.zeros(DEVICE_TOKENS, 1, c, dtype=dtype)
                 for _ in range(L))
    info = MLABufferInfo(
        buffers=bufs, data_ptrs=_ptrs(bufs), layer_indices=tuple(range(L)),
        device_layer_num=L, page_size=P, kv_lora_rank=LORA,
        qk_rope_head_dim=ROPE, kv_cache_dim=c, dtype=dtype,
        device=torch.device("cpu"))
    pool = MLATokenToKVPoolHost(
        info, 2.0, 0, P, layout, pin_memory=False, device="cpu",
        device_capacity_tokens=DEVICE_TOKENS, start_layer=0, end_layer=L,
        target_layer_num=L)
    _fill(pool, seed)
    return pool


def make_pool(kind: str, layout: str, seed: int) -> Any:
    """The pool of one case of ``CASES``."""
    return mha_pool(layout, seed) if kind == "mha" else mla_pool(layout, seed)


def _fill(pool: Any, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=g)
                         .to(pool.kv_buffer.dtype))


def rows(pool: Any, page: int) -> list[torch.Tensor]:
    """Page ``page`` of the pool read from its buffer by the layout's own
    dims: for MHA each layer's K then V ``[P, H, D]``, for MLA each layer's
    ``[P, C]``."""
    b, t = pool.kv_buffer, slice(page * P, (page + 1) * P)
    out = []
    for layer in range(pool.layer_num):
        if isinstance(pool, MHATokenToKVPoolHost):
            for kv in (0, 1):
                if pool.layout == "layer_first":      # [2, L, size, H, D]
                    x = b[kv, layer, t]
                elif pool.layout == "page_first":     # [2, size, L, H, D]
                    x = b[kv, t, layer]
                elif pool.layout == "page_first_direct":  # [2, pg, L, P, H, D]
                    x = b[kv, page, layer]
                else:                                 # [2, pg, H, P, L, D]
                    x = b[kv, page, :, :, layer].transpose(0, 1)
                out.append(x.clone())
        else:
            if pool.layout == "layer_first":          # [L, size, 1, C]
                x = b[layer, t, 0]
            elif pool.layout == "page_first":         # [size, L, 1, C]
                x = b[t, layer, 0]
            elif pool.layout == "page_first_direct":  # [pg, L, P, 1, C]
                x = b[page, layer, :, 0]
            else:                                     # [pg, L, P, C]
                x = b[page, layer]
            out.append(x.clone())
    return out


def same_page(a: Any, pa: int, b: Any, pb: int) -> bool:
    """Whether page ``pa`` of pool ``a`` holds the bytes of page ``pb`` of
    pool ``b`` (bit for bit, whatever their layouts)."""
    ra, rb = rows(a, pa), rows(b, pb)
    return len(ra) == len(rb) and all(
        torch.equal(x.view(torch.uint8), y.view(torch.uint8))
        for x, y in zip(ra, rb))


def host_indices(pages: list[int]) -> torch.Tensor:
    """The token indices of ``pages`` (what SGLang passes)."""
    return torch.cat([torch.arange(p * P, (p + 1) * P) for p in pages])


def page_keys(tokens: list[int], prior: Optional[str] = None) -> list[str]:
    """SGLang's own chained page keys of ``tokens``."""
    keys = get_hash_str(tokens, prior, page_size=P)
    assert isinstance(keys, list)
    return keys


def case_keys(kind: str, layout: str) -> list[str]:
    """Five pages of keys of one case."""
    base = 1000 * (CASES.index((kind, layout)) + 1)
    return page_keys(list(range(base, base + 5 * P)))


def storage_config(store: str, *, model: str = "test-org/tiny-model",
                   mla: bool = False, tp: tuple[int, int] = (0, 1),
                   pp: tuple[int, int] = (0, 1), cp: tuple[int, int] = (0, 1),
                   **extra: Any) -> HiCacheStorageConfig:
    """SGLang's HiCacheStorageConfig for the dynamic kvtier backend."""
    return HiCacheStorageConfig(
        tp_rank=tp[0], tp_size=tp[1], pp_rank=pp[0], pp_size=pp[1],
        attn_cp_rank=cp[0], attn_cp_size=cp[1], is_mla_model=mla,
        enable_storage_metrics=False, is_page_first_layout=False,
        model_name=model,
        extra_config={"backend_name": "kvtier",
                      "module_path": "kvtier.integrations.sglang",
                      "class_name": "KvtierHiCacheStorage", "interface_v1": 1,
                      "stores": store, "deadline_ms": 3000, **extra})


def publish_server_args(**args: Any) -> ServerArgs:
    """Publishes, as SGLang's scheduler does before it makes the storage
    backend, server args for the tiny Llama on CPU with ``args`` set (the
    backend reads a block's identity from them)."""
    server_args = ServerArgs(model_path=TINY_MODEL, device="cpu", **args)
    publish(server_args, role="scheduler")
    return server_args


def attach(config: HiCacheStorageConfig, pool: Any) -> Any:
    """The backend as SGLang's cache controller attaches it: made by
    SGLang's own factory from the extra config, then given the host pool."""
    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    backend.register_mem_pool_host(pool)
    return backend


def main(argv: list[str]) -> int:
    store, seed = argv[1], int(argv[2])
    publish_server_args()
    for kind, layout in CASES:
        pool = make_pool(kind, layout, seed)
        b = attach(storage_config(store, mla=kind == "mla"), pool)
        keys = case_keys(kind, layout)[:len(WRITE_PAGES)]
        if b.batch_set_v1(keys, host_indices(WRITE_PAGES)) != \
                [True] * len(keys):
            print(f"write of {kind} {layout} failed")
            return 1
        b.close()
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
