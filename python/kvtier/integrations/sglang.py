"""kvtier as an SGLang HiCache storage backend (``HiCacheStorage``).

Follows ``python/sglang/srt/mem_cache/hicache_storage.py`` and
``storage/backend_factory.py`` of SGLang's main branch (read at commit
001067fffe33; the dynamic loader is the same back to aaf8ab0e). SGLang
cannot be installed here, so this was not run inside SGLang. Load it with::

    python -m sglang.launch_server --model-path MODEL --page-size 64 \\
        --enable-hierarchical-cache --hicache-mem-layout layer_first \\
        --hicache-write-policy write_through \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
            "module_path": "kvtier.integrations.sglang",
            "class_name": "KvtierHiCacheStorage", "interface_v1": 1,
            "stores": "10.0.0.5:7400,10.0.0.6:7400"}'

Extra config keys besides SGLang's: ``stores`` (required), ``deadline_ms``
(10000), ``shared_memory`` ("auto", "on", "off"), ``tls_ca`` /
``tls_cert`` / ``tls_key`` (PEM files: TLS, mutual with a certificate).

Keys. SGLang names each page by a chained SHA-256 hex digest of its tokens
(``get_hash_str``); a key's first 128 bits are its kvtier block hash (other
strings are hashed with SHA-256 first). Blocks live in a kvtier namespace
of the model name, the KV geometry and the TP rank, so equal keys of
different models, dtypes or shards never meet.

Data. With ``interface_v1`` the zero-copy pair moves pages between the host
pool's ``kv_buffer`` and the store through a :class:`kvtier.Connector` over
that buffer (layouts ``layer_first`` and ``page_first_direct``; a page's K or
V of one layer must be one contiguous range, which ``page_first`` does not
have: use the legacy path there). The legacy ``get``/``set`` path takes
SGLang's flat pages and stores them in the same block format, so both paths
share blocks. Every block read is checked against the checksum its writer
stored; a failure is a short result, and SGLang recomputes the rest.
The ``batch_*_v1`` methods never raise (SGLang's prefetch and backup threads
would die): failures are ``False`` entries.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from typing import Any, List, Optional

import numpy as np
import torch

import kvtier
from kvtier.errors import InvalidArgument, KvtierError, StatusCode
from kvtier.hooks import store_options

try:  # SGLang's base class when SGLang is installed.
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
except ImportError:  # pragma: no cover - exercised where SGLang is absent
    import abc

    class HiCacheStorage(abc.ABC):  # type: ignore[no-redef]
        """The base class's default hook (SGLang's is used when present)."""

        def register_mem_pool_host(self, mem_pool_host: Any) -> None:
            self.mem_pool_host = mem_pool_host

log = logging.getLogger("kvtier.sglang")

_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}


def key_hashes(keys: List[str]) -> np.ndarray:
    """kvtier block hashes (uint64 [n, 2]) of SGLang page keys."""
    out = np.empty((len(keys), 2), dtype=np.uint64)
    for i, key in enumerate(keys):
        try:
            raw = bytes.fromhex(key)
        except ValueError:
            raw = b""
        if len(raw) < 16:
            raw = hashlib.sha256(key.encode()).digest()
        out[i, 0] = int.from_bytes(raw[:8], "big")
        out[i, 1] = int.from_bytes(raw[8:16], "big")
    return out


def _bad(message: str) -> InvalidArgument:
    return InvalidArgument(StatusCode.INVALID_ARGUMENT, message)


class KvtierHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    """SGLang's HiCache L3 over kvtier-store shards (module docstring)."""

    def __init__(self, storage_config: Any,
                 kwargs: Optional[dict] = None) -> None:
        self.config = storage_config
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        self._stores, self._opts = store_options(
            extra, "hicache storage backend extra config")
        self._store = kvtier.StoreClient(self._stores, **self._opts)
        self._ids = itertools.count(1)
        self.namespace: Optional[kvtier.Namespace] = None
        self._conn: Optional[kvtier.Connector] = None
        self._v1_error = "register_mem_pool_host was not called"
        self.mem_pool_host: Any = None
        self._layer_num = self._page = self._heads = self._dim = 0
        self._layout = ""

    # --------------------------------------------------------------- setup

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Takes the host KV pool's geometry (the namespace) and, for the
        zero-copy path, its kv_buffer. INVALID_ARGUMENT for an MLA pool or
        a dtype kvtier does not store."""
        super().register_mem_pool_host(mem_pool_host)
        pool = mem_pool_host
        if not hasattr(pool, "head_num"):
            raise _bad("only MHA host pools are supported (MLA is not)")
        if pool.dtype not in _DTYPES:
            raise _bad(f"host pool dtype {pool.dtype} is not fp16 or bf16")
        self._layer_num, self._page = int(pool.layer_num), int(pool.page_size)
        self._heads, self._dim = int(pool.head_num), int(pool.head_dim)
        self._layout = str(pool.layout)
        c = self.config
        self.namespace = kvtier.Namespace(
            str(getattr(c, "model_name", None) or "sglang-model"),
            _DTYPES[pool.dtype], self._layer_num, self._heads, self._dim,
            self._page, tp_rank=int(getattr(c, "tp_rank", 0)),
            tp_size=int(getattr(c, "tp_size", 1)))
        buf = pool.kv_buffer
        p, h, d = self._page, self._heads, self._dim
        if self._layout == "layer_first":    # [2, L, size, H, D]
            pages = buf.shape[2] // p
            caches = [(buf[0, i].view(pages, p, h, d),
                       buf[1, i].view(pages, p, h, d))
                      for i in range(self._layer_num)]
        elif self._layout == "page_first_direct":  # [2, pages, L, P, H, D]
            caches = [(buf[0][:, i], buf[1][:, i])
                      for i in range(self._layer_num)]
        else:
            self._v1_error = (f'layout "{self._layout}" keeps no page of one '
                              "layer contiguous: use layer_first or "
                              "page_first_direct for interface_v1")
            return
        self._conn = kvtier.Connector(self.namespace, caches,
                                      stores=self._stores, layout="split",
                                      **self._opts)
        self._v1_error = ""

    # ------------------------------------------------------ zero-copy (v1)

    def _pages(self, keys: List[str], host_indices: torch.Tensor
               ) -> list[int]:
        idx = host_indices.reshape(-1).to(torch.int64)
        if idx.numel() != len(keys) * self._page:
            raise _bad(f"{idx.numel()} host indices for {len(keys)} pages of "
                       f"{self._page} tokens")
        starts = idx[::self._page]
        if bool((starts % self._page != 0).any()):
            raise _bad("host indices are not page-aligned")
        return (starts // self._page).tolist()

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> List[bool]:
        """Writes the pages at ``host_indices`` under ``keys``; all True,
        or all False on a failure (logged)."""
        if not keys:
            return []
        try:
            if self._conn is None:
                raise _bad(self._v1_error)
            pages = self._pages(keys, host_indices)
            rid = next(self._ids)
            hashes = key_hashes(keys)
            self._conn.lookup(rid, hashes, len(keys))  # opens, pins nothing
            try:
                self._conn.save(rid, 0, pages)
                self._conn.wait_for_save(rid)
            finally:
                self._conn.finished(rid)
            return [True] * len(keys)
        except KvtierError as e:
            log.warning("kvtier batch_set_v1 of %d pages failed: %s",
                        len(keys), e)
            return [False] * len(keys)

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> List[bool]:
        """Reads the leading stored pages of ``keys`` into ``host_indices``;
        True for those, False from the first missing one. The load is
        verified as a whole: if any block fails its checksum (or the store
        goes away) every entry is False and SGLang recomputes them all."""
        if not keys:
            return []
        loaded = 0
        try:
            if self._conn is None:
                raise _bad(self._v1_error)
            pages = self._pages(keys, host_indices)
            rid = next(self._ids)
            try:
                found = self._conn.lookup(rid, key_hashes(keys), 0).blocks
                if found:
                    self._conn.start_load(rid, pages[:found])
                    loaded = self._conn.wait_for_load(rid)
            finally:
                self._conn.finished(rid)
        except KvtierError as e:
            log.warning("kvtier batch_get_v1 of %d pages failed: %s",
                        len(keys), e)
            loaded = 0
        return [True] * loaded + [False] * (len(keys) - loaded)

    # ------------------------------------------------------------- lookups

    def batch_exists(self, keys: List[str], extra_info: Any = None) -> int:
        """How many leading keys the store holds: one round trip over every
        shard. 0 if the store cannot be asked."""
        if not keys or self.namespace is None:
            return 0
        try:
            return self._store.lookup(self.namespace, key_hashes(keys))
        except KvtierError as e:
            log.warning("kvtier batch_exists failed: %s", e)
            return 0

    def exists(self, key: str) -> bool:
        """Whether the store holds the page."""
        return self.batch_exists([key]) == 1

    # ----------------------------------------------- legacy (flat pages)

    def _to_block(self, flat: torch.Tensor) -> torch.Tensor:
        """SGLang's flat page (layout order) as kvtier's block bytes
        ([layers, 2, page, heads, dim])."""
        L, p, h, d = self._layer_num, self._page, self._heads, self._dim
        if self._layout == "page_first":
            t = flat.reshape(2, p, L, h, d).permute(2, 0, 1, 3, 4)
        else:
            t = flat.reshape(2, L, p, h, d).permute(1, 0, 2, 3, 4)
        return t.contiguous().view(torch.uint8).reshape(-1)

    def _from_block(self, block: torch.Tensor, out: torch.Tensor) -> None:
        L, p, h, d = self._layer_num, self._page, self._heads, self._dim
        t = block.view(out.dtype).reshape(L, 2, p, h, d)
        if self._layout == "page_first":
            out.view(2, p, L, h, d).copy_(t.permute(1, 2, 0, 3, 4))
        else:
            out.view(2, L, p, h, d).copy_(t.permute(1, 0, 2, 3, 4))

    def batch_set(self, keys: List[str], values: Optional[Any] = None,
                  target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        """Writes flat pages; True iff every one is stored."""
        if not keys:
            return True
        if self.namespace is None or values is None:
            return False
        try:
            data = torch.cat([self._to_block(v) for v in values])
            out = self._store.put(self.namespace, key_hashes(keys), data)
            return out["written"] + out["already_present"] == len(keys)
        except KvtierError as e:
            log.warning("kvtier batch_set failed: %s", e)
            return False

    def set(self, key: str, value: Optional[Any] = None,
            target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        """Writes one flat page."""
        return self.batch_set([key], [value])

    def batch_get(self, keys: List[str],
                  target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None
                  ) -> List[Optional[torch.Tensor]]:
        """Reads the leading stored pages into the flat ``target_locations``
        (one round trip); None from the first missing or failed one."""
        if not keys or self.namespace is None or target_locations is None:
            return [None] * len(keys)
        bb = self.namespace.block_bytes
        tmp = torch.empty(len(keys) * bb, dtype=torch.uint8)
        try:
            n = self._store.get(self.namespace, key_hashes(keys), tmp)
        except KvtierError as e:
            log.warning("kvtier batch_get failed: %s", e)
            n = 0
        out: List[Optional[torch.Tensor]] = []
        for i, target in enumerate(target_locations):
            if i >= n:
                out.append(None)
                continue
            self._from_block(tmp[i * bb:(i + 1) * bb], target)
            out.append(target)
        return out

    def get(self, key: str, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> Optional[torch.Tensor]:
        """Reads one flat page into ``target_location``; None if absent."""
        return self.batch_get([key], [target_location])[0]

    # ---------------------------------------------------------------- rest

    def clear(self) -> None:
        """Nothing: the store's eviction policy decides what leaves it, and
        other engines may share these blocks."""

    def get_stats(self) -> Optional[dict[str, int]]:
        """The connector's counters (loads, offloads, failures)."""
        return self._conn.stats() if self._conn is not None else None

    def close(self) -> None:
        """Waits for queued writes and releases the connector."""
        if self._conn is not None:
            self._conn.close()
