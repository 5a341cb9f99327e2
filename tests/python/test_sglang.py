"""kvtier.integrations.sglang.KvtierHiCacheStorage driven as SGLang's cache
controller drives it (SGLang main at 001067fffe33:
mem_cache/hicache_storage.py, managers/cache_controller.py), with real torch
host pools in SGLang's MHA layouts (mem_cache/memory_pool_host.py:
kv_buffer [2, layers, size, heads, dim] for layer_first, [2, pages, layers,
page, heads, dim] for page_first_direct) against a real kvtier-store."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import pytest
import torch

from conftest import corrupt_in_store
from kvtier.integrations.sglang import KvtierHiCacheStorage

L, H, D, P, SIZE = 2, 2, 32, 16, 16 * 12


@dataclass
class StorageConfig:
    """SGLang's HiCacheStorageConfig (the fields the backend reads)."""

    tp_rank: int = 0
    tp_size: int = 1
    is_mla_model: bool = False
    model_name: Optional[str] = "test-org/tiny-model"
    extra_config: Optional[dict] = field(default_factory=dict)


class HostPool:
    """An MHATokenToKVPoolHost's fields, over a real buffer."""

    def __init__(self, layout: str, seed: int) -> None:
        self.layout, self.page_size, self.size = layout, P, SIZE
        self.layer_num, self.head_num, self.head_dim = L, H, D
        self.dtype = torch.float16
        g = torch.Generator().manual_seed(seed)
        shape = ((2, L, SIZE, H, D) if layout == "layer_first" else
                 (2, SIZE // P, L, P, H, D) if layout == "page_first_direct"
                 else (2, SIZE, L, H, D))
        self.kv_buffer = torch.randn(shape, generator=g).half()

    def page(self, p: int) -> torch.Tensor:
        """K and V of page p, [layers, 2, page, heads, dim]."""
        if self.layout == "layer_first":
            t = self.kv_buffer[:, :, p * P:(p + 1) * P]
            return t.permute(1, 0, 2, 3, 4).clone()
        if self.layout == "page_first_direct":
            return self.kv_buffer[:, p].permute(1, 0, 2, 3, 4).clone()
        t = self.kv_buffer[:, p * P:(p + 1) * P]
        return t.permute(2, 0, 1, 3, 4).clone()

    def flat_page(self, p: int) -> torch.Tensor:
        """SGLang's get_data_page(flat=True): the page in layout order."""
        if self.layout == "page_first":
            return self.kv_buffer[:, p * P:(p + 1) * P].reshape(-1).clone()
        return self.page(p).permute(1, 0, 2, 3, 4).reshape(-1).clone()


def keys_of(tokens: list[int]) -> list[str]:
    """SGLang's chained page keys (get_hash_str)."""
    keys, prior = [], None
    for i in range(0, len(tokens) - len(tokens) % P, P):
        h = hashlib.sha256()
        if prior:
            h.update(bytes.fromhex(prior))
        for t in tokens[i:i + P]:
            h.update(t.to_bytes(4, "little", signed=False))
        prior = h.hexdigest()
        keys.append(prior)
    return keys


def indices(pages: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(p * P, (p + 1) * P) for p in pages])


def backend(store, pool: HostPool, model: str = "test-org/tiny-model"
            ) -> KvtierHiCacheStorage:
    b = KvtierHiCacheStorage(StorageConfig(model_name=model, extra_config={
        "backend_name": "kvtier", "module_path": "kvtier.integrations.sglang",
        "class_name": "KvtierHiCacheStorage", "interface_v1": 1,
        "stores": store.address, "deadline_ms": 3000}), {})
    b.register_mem_pool_host(pool)
    return b


@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
def test_zero_copy_pair_exists_and_legacy_pages_share_blocks(
        store, layout) -> None:
    a_pool, b_pool = HostPool(layout, 1), HostPool(layout, 2)
    a, b = backend(store, a_pool), backend(store, b_pool)
    keys = keys_of(np.random.default_rng(3).integers(0, 50000, 5 * P)
                   .tolist())
    assert a.batch_exists(keys) == 0
    assert a.batch_set_v1(keys[:4], indices([3, 5, 7, 9])) == [True] * 4
    assert b.batch_exists(keys) == 4, "leading keys, one round trip"
    assert b.exists(keys[0]) and not b.exists(keys[4])
    before = b_pool.page(6).clone()
    assert b.batch_get_v1(keys, indices([0, 1, 2, 4, 6])) == \
        [True] * 4 + [False]
    for dst, src in zip([0, 1, 2, 4], [3, 5, 7, 9]):
        assert torch.equal(b_pool.page(dst), a_pool.page(src))
    assert torch.equal(b_pool.page(6), before), "a missing page is untouched"
    # The legacy path stores flat pages in the same block format.
    assert a.set(keys[4], a_pool.flat_page(11))
    assert b.batch_get_v1(keys[4:], indices([8])) == [True]
    assert torch.equal(b_pool.page(8), a_pool.page(11))
    target = torch.empty_like(a_pool.flat_page(0))
    assert b.get(keys[0], target) is target
    assert torch.equal(target, a_pool.flat_page(3))
    assert b.batch_get(keys[3:] + ["f" * 64],
                       [torch.empty_like(target) for _ in range(3)])[2] is None
    # Same keys, another model: nothing shared.
    assert backend(store, HostPool(layout, 4), "other/model") \
        .batch_exists(keys) == 0
    for x in (a, b):
        x.close()


def test_a_corrupt_block_is_a_short_read_and_bad_input_fails_softly(
        store) -> None:
    a_pool, b_pool = HostPool("layer_first", 5), HostPool("layer_first", 6)
    a, b = backend(store, a_pool), backend(store, b_pool)
    keys = keys_of(list(range(3 * P)))
    assert a.batch_set_v1(keys, indices([0, 1, 2])) == [True] * 3
    needle = a_pool.page(1)[0, 0].numpy().tobytes()  # layer 0 K of page 1
    assert corrupt_in_store(store.pid, needle)
    # A load is verified as a whole: one bad block fails it, and SGLang
    # recomputes every page of it.
    assert b.batch_get_v1(keys, indices([4, 5, 6])) == [False] * 3
    # Bad input: False entries, no exception (SGLang's threads would die).
    assert b.batch_get_v1(keys[:1], torch.arange(3, 3 + P)) == [False]
    assert b.batch_set_v1(keys[:2], indices([0])) == [False, False]
    page_first = backend(store, HostPool("page_first", 7))
    assert page_first.batch_set_v1(keys[:1], indices([0])) == [False]
    assert page_first.set("abc", HostPool("page_first", 7).flat_page(2))
    with pytest.raises(ValueError, match="stores"):
        KvtierHiCacheStorage(StorageConfig(extra_config={}), {})
    for x in (a, b, page_first):
        x.close()


def test_an_unknown_store_finds_nothing_and_saves_nothing() -> None:
    pool = HostPool("layer_first", 8)
    b = KvtierHiCacheStorage(StorageConfig(extra_config={
        "stores": "127.0.0.1:1", "deadline_ms": 500}), {})
    b.register_mem_pool_host(pool)
    keys = keys_of(list(range(2 * P)))
    assert b.batch_exists(keys) == 0
    assert b.batch_set_v1(keys, indices([0, 1])) == [False, False]
    assert b.batch_get_v1(keys, indices([0, 1])) == [False, False]
    b.close()
