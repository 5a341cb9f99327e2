"""kvtier as an SGLang HiCache storage backend (``HiCacheStorage``).

Written against SGLang 0.5.23 (``python/requirements-vllm.txt`` pins it;
``sglang/srt/mem_cache/hicache_storage.py``, ``storage/backend_factory.py``,
``pool_host/mha.py``, ``pool_host/mla.py``), and tested against those
classes. Load it with::

    python -m sglang.launch_server --model-path MODEL --page-size 64 \\
        --enable-hierarchical-cache --hicache-mem-layout page_head \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
            "module_path": "kvtier.integrations.sglang",
            "class_name": "KvtierHiCacheStorage", "interface_v1": 1,
            "stores": "10.0.0.5:7400,10.0.0.6:7400"}'

Extra config keys besides SGLang's: ``stores`` (required), ``deadline_ms``
(10000), ``shared_memory`` ("auto", "on", "off"), ``tls_ca`` /
``tls_cert`` / ``tls_key`` (PEM files: TLS, mutual with a certificate).

Pools. The host pools of SGLang's ``MHATokenToKVPoolHost`` (layouts
``layer_first``, ``page_first``, ``page_first_direct``, ``page_head``) and
``MLATokenToKVPoolHost`` (``layer_first``, ``page_first``,
``page_first_direct``, ``page_unified``) are stored; any other pool class
or layout is refused at registration (``InvalidArgument``, naming it), which
fails SGLang's attach. Every page is stored in one format whatever the host layout, so
engines with different ``--hicache-mem-layout`` share blocks: an MHA page as
``[layers, 2 (K, V), page, heads, head_dim]``, an MLA page as
``[layers, page, kv_cache_dim]``.

Namespaces. Blocks live in a kvtier namespace of the model name, the pool's
geometry and dtype, the pool's name (``kv``, or a hybrid pool registered
through ``register_mem_host_pool_v2``: ``draft``, ``swa``, ...), and every
rank that changes the bytes: the TP rank (MHA only: MLA pages are the same
on every TP rank and are stored once for all of them), the pipeline stage and
the attention context-parallel rank; and the identity fields every kvtier
adapter fills (``kvtier.identity``: weights, model config after overrides,
quantization, KV scales, RoPE, sliding window), read from the server args
SGLang's scheduler publishes (``kvtier.integrations.sglang_identity``; a
backend made where none are published is refused). Data-parallel replicas
share blocks.
Keys SGLang seeds with a request's ``extra_key`` / ``cache_salt``
(``get_storage_hash_str``) differ per tenant, so tenants never meet.

Keys. SGLang names each page by a chained SHA-256 hex digest of its tokens;
a key's kvtier block hash is the XXH3-128 of the string
(kvtier.dtypes.engine_key_hashes, the library's one engine-key function).

Data. Pages are gathered from the host pool into a per-thread staging buffer
(registered with the store client for RMA) in the stored format and written
in one call per batch; loads read into staging, every block checked against
the checksum its writer stored, and scatter into the pool. A block that
fails its checksum, or a store that cannot be reached, is a miss: SGLang
recomputes. The legacy ``get``/``set`` path takes SGLang's flat pages (a
page in its layout's order) and stores the same bytes. No ``batch_*``
method raises (SGLang's prefetch and backup threads would die): failures
are ``False`` entries, ``None`` pages or a zero count.

Not run here: SGLang serving a model. Its CPU path needs ``sgl-kernel``
built for CPU from source (PyPI's ``sgl-kernel`` and the ``sglang-kernel``
that ``sglang`` requires are CUDA builds); docs/engines.md says what was run.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, List, Optional, Sequence

import torch

import kvtier
from kvtier.errors import KvtierError
from kvtier.integrations.sglang_codec import (PoolCodec, _bad, key_hashes)
from kvtier.integrations.sglang_identity import published_identity_tag
from kvtier.options import store_options

try:  # SGLang's classes when SGLang is installed.
    from sglang.srt.mem_cache.hicache_storage import (
        HiCacheStorage, PoolHitPolicy, PoolTransferResult)
except ImportError:  # pragma: no cover - exercised where SGLang is absent
    import abc

    class HiCacheStorage(abc.ABC):  # type: ignore[no-redef]
        """The base class's default hook (SGLang's is used when present)."""

        def register_mem_pool_host(self, mem_pool_host: Any) -> None:
            self.mem_pool_host = mem_pool_host

    PoolHitPolicy = None  # type: ignore[assignment,misc]
    PoolTransferResult = None  # type: ignore[assignment,misc]

log = logging.getLogger("kvtier.sglang")

#: Staging per thread is at most this many bytes (at least one page).
STAGING_BYTES = 32 << 20

class KvtierHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    """SGLang's HiCache L3 over kvtier-store shards (module docstring)."""

    def __init__(self, storage_config: Any,
                 kwargs: Optional[dict] = None) -> None:
        self.config = storage_config
        if bool(getattr(storage_config, "should_split_heads", False)):
            raise _bad("SGLang's should_split_heads (a page_head pool shared "
                       "by ranks of different TP sizes) is not supported by "
                       "kvtier")
        self._ident = published_identity_tag()
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        self._stores, self._opts = store_options(
            extra, "hicache storage backend extra config")
        self._store = kvtier.StoreClient(self._stores, **self._opts)
        self._pools: dict[str, PoolCodec] = {}
        self._registered: set[int] = set()
        self._local = threading.local()
        self.namespace: Optional[kvtier.Namespace] = None
        self.mem_pool_host: Any = None
        self._stats = {"pages_read": 0, "pages_written": 0,
                       "read_failures": 0, "write_failures": 0}
        self._stats_mu = threading.Lock()

    # --------------------------------------------------------------- setup

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Registers the anchor KV host pool (SGLang's ``kv``): its geometry
        names the namespace. InvalidArgument for a pool kvtier does not
        store (module docstring)."""
        super().register_mem_pool_host(mem_pool_host)
        codec = PoolCodec(mem_pool_host, "kv", self.config, self._ident)
        self._pools["kv"] = codec
        self.namespace = codec.namespace

    def register_mem_host_pool_v2(self, host_pool: Any,
                                  host_pool_name: Any) -> None:
        """Registers a hybrid model's host pool (draft KV, sliding window,
        indexer, ...) under its own namespace. InvalidArgument for a pool
        kvtier does not store (Mamba states and the DeepSeek V4 pools are
        not): SGLang's attach fails, naming it."""
        name = str(getattr(host_pool_name, "value", host_pool_name))
        codec = PoolCodec(host_pool, name, self.config, self._ident)
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self._pools[name] = codec

    def _codec(self, name: Any = "kv") -> PoolCodec:
        key = str(getattr(name, "value", name))
        codec = self._pools.get(key)
        if codec is None:
            raise _bad(f'no SGLang host pool "{key}" is registered with '
                       "kvtier")
        return codec

    def _ready(self, codec: PoolCodec) -> kvtier.Namespace:
        """The pool's namespace, registered with the stores on first use
        (again after a failure: a store that was down may be back)."""
        ns = codec.namespace
        if ns.id not in self._registered:
            self._store.register_namespace(ns)
            self._registered.add(ns.id)
        return ns

    def _staging(self, block_bytes: int) -> tuple[torch.Tensor, int]:
        """This thread's staging buffer and how many pages it holds."""
        pages = max(1, STAGING_BYTES // block_bytes)
        st = getattr(self._local, "buf", None)
        if st is None or st.numel() < pages * block_bytes:
            st = torch.empty(max(STAGING_BYTES, block_bytes),
                             dtype=torch.uint8)
            self._store.register(st)
            self._local.buf = st
        return st, st.numel() // block_bytes

    def _count(self, key: str, n: int) -> None:
        with self._stats_mu:
            self._stats[key] += n

    # --------------------------------------------------------- page moves

    def _set_pages(self, codec: PoolCodec, keys: Sequence[str],
                   host_indices: torch.Tensor) -> bool:
        """Writes the pool's pages at ``host_indices`` under ``keys``."""
        pages = codec.pages_of(host_indices, len(keys))
        hashes = key_hashes(keys)
        st, per = self._staging(codec.block_bytes)
        for s in range(0, len(keys), per):
            n = min(per, len(keys) - s)
            codec.gather(pages[s:s + n], st)
            out = self._store.put(self._ready(codec), hashes[s:s + n],
                                  st[:n * codec.block_bytes])
            if out["written"] + out["already_present"] != n:
                return False
        return True

    def _get_pages(self, codec: PoolCodec, keys: Sequence[str],
                   host_indices: torch.Tensor) -> int:
        """Reads the leading stored pages of ``keys`` into the pool at
        ``host_indices``; returns how many."""
        pages = codec.pages_of(host_indices, len(keys))
        hashes = key_hashes(keys)
        st, per = self._staging(codec.block_bytes)
        done = 0
        while done < len(keys):
            n = min(per, len(keys) - done)
            got = self._store.get(self._ready(codec), hashes[done:done + n],
                                  st[:n * codec.block_bytes])
            if got:
                codec.scatter(pages[done:done + got], st)
            done += got
            if got < n:
                break
        return done

    def _safe_set(self, name: Any, keys: Sequence[str],
                  host_indices: torch.Tensor) -> List[bool]:
        if not keys:
            return []
        try:
            ok = self._set_pages(self._codec(name), keys, host_indices)
        except KvtierError as e:
            log.warning("kvtier: writing %d pages of pool %s failed: %s",
                        len(keys), name, e)
            ok = False
        self._count("pages_written" if ok else "write_failures", len(keys))
        return [ok] * len(keys)

    def _safe_get(self, name: Any, keys: Sequence[str],
                  host_indices: torch.Tensor) -> List[bool]:
        if not keys:
            return []
        try:
            n = self._get_pages(self._codec(name), keys, host_indices)
        except KvtierError as e:
            log.warning("kvtier: reading %d pages of pool %s failed: %s",
                        len(keys), name, e)
            n = 0
            self._count("read_failures", 1)
        self._count("pages_read", n)
        return [True] * n + [False] * (len(keys) - n)

    # ------------------------------------------------------ zero-copy (v1)

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> List[bool]:
        """Writes the KV pool's pages at ``host_indices`` under ``keys``;
        all True, or all False on a failure (logged)."""
        return self._safe_set("kv", keys, host_indices)

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> List[bool]:
        """Reads the leading stored pages of ``keys`` into the KV pool at
        ``host_indices``: True for those, False from the first missing (or
        failed) one; SGLang recomputes the rest."""
        return self._safe_get("kv", keys, host_indices)

    # ------------------------------------------------------------- lookups

    def _lookup(self, codec: PoolCodec, keys: Sequence[str]) -> int:
        if not keys:
            return 0
        try:
            return self._store.lookup(self._ready(codec), key_hashes(keys))
        except KvtierError as e:
            log.warning("kvtier lookup of pool %s failed: %s", codec.name, e)
            return 0

    def batch_exists(self, keys: List[str], extra_info: Any = None) -> int:
        """How many leading keys the store holds for the KV pool: one round
        trip over every shard; 0 if the store cannot be asked."""
        codec = self._pools.get("kv")
        return self._lookup(codec, keys) if codec is not None else 0

    def exists(self, key: str) -> bool:
        """Whether the store holds the KV page."""
        return self.batch_exists([key]) == 1

    # ------------------------------------------------- hybrid pools (v2)

    def batch_exists_v2(self, keys: List[str],
                        pool_transfers: Optional[List[Any]] = None,
                        extra_info: Any = None) -> Any:
        """SGLang's longest usable prefix over the KV pool and each
        transfer's pool, by its hit policy (``all_pages``: every page of the
        prefix; ``trailing_pages``: the last ``len(transfer.keys)`` pages).
        A pool that is not registered, or a store that cannot be asked,
        counts as holding nothing."""
        kv = self.batch_exists(keys)
        hits: dict[str, int] = {"kv": kv} if kv else {}
        restorable = set(range(1, kv + 1))
        for t in pool_transfers or []:
            if not restorable:
                break
            name = str(getattr(t.name, "value", t.name))
            codec = self._pools.get(name)
            if codec is None:
                restorable = set()
                break
            if t.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                need = max(1, len(t.keys) if t.keys else 1)
                have = [self._lookup(codec, [keys[i]]) == 1
                        for i in range(kv)]
                ok = {p for p in range(1, kv + 1)
                      if all(have[max(0, p - need):p])}
            else:
                n = self._lookup(codec, keys[:kv])
                ok = set(range(1, n + 1))
            if ok:
                hits[name] = max(ok)
            restorable &= ok
        final = max(restorable) if restorable else 0
        return PoolTransferResult(final, hits, sorted(restorable))

    def batch_get_v2(self, transfers: List[Any],
                     extra_info: Any = None) -> dict[str, List[bool]]:
        """Reads each transfer's pages into its pool; per pool, True for
        each page read (a leading run)."""
        return {str(getattr(t.name, "value", t.name)):
                self._safe_get(t.name, list(t.keys or []), t.host_indices)
                for t in transfers}

    def batch_set_v2(self, transfers: List[Any],
                     extra_info: Any = None) -> dict[str, List[bool]]:
        """Writes each transfer's pages from its pool; per pool, all True or
        all False."""
        return {str(getattr(t.name, "value", t.name)):
                self._safe_set(t.name, list(t.keys or []), t.host_indices)
                for t in transfers}

    # ----------------------------------------------- legacy (flat pages)

    def batch_set(self, keys: List[str], values: Optional[Any] = None,
                  target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        """Writes flat KV pages (``get_data_page`` order); True iff every
        one is stored."""
        if not keys:
            return True
        codec = self._pools.get("kv")
        if codec is None or values is None or len(values) != len(keys):
            return False
        try:
            data = torch.cat([codec.flat_to_block(v) for v in values])
            out = self._store.put(self._ready(codec), key_hashes(keys), data)
            ok = out["written"] + out["already_present"] == len(keys)
        except KvtierError as e:
            log.warning("kvtier batch_set failed: %s", e)
            ok = False
        self._count("pages_written" if ok else "write_failures", len(keys))
        return ok

    def set(self, key: str, value: Optional[Any] = None,
            target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        """Writes one flat KV page."""
        return self.batch_set([key], [value])

    def batch_get(self, keys: List[str],
                  target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None
                  ) -> List[Optional[torch.Tensor]]:
        """Reads the leading stored pages into the flat ``target_locations``
        (one round trip); None from the first missing or failed one."""
        codec = self._pools.get("kv")
        if not keys or codec is None or target_locations is None:
            return [None] * len(keys)
        bb = codec.block_bytes
        tmp = torch.empty(len(keys) * bb, dtype=torch.uint8)
        try:
            n = self._store.get(self._ready(codec), key_hashes(keys), tmp)
        except KvtierError as e:
            log.warning("kvtier batch_get failed: %s", e)
            n = 0
        out: List[Optional[torch.Tensor]] = []
        for i, target in enumerate(target_locations):
            if i >= n:
                out.append(None)
                continue
            codec.block_to_flat(tmp[i * bb:(i + 1) * bb], target)
            out.append(target)
        self._count("pages_read", n)
        return out

    def get(self, key: str, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> Optional[torch.Tensor]:
        """Reads one flat KV page into ``target_location``; None if absent."""
        return self.batch_get([key], [target_location])[0]

    # ---------------------------------------------------------------- rest

    def clear(self) -> None:
        """Nothing: the store's eviction policy decides what leaves it, and
        other engines may share these blocks."""

    def get_stats(self) -> dict[str, int]:
        """Pages read and written, and failed reads and writes, since
        start."""
        with self._stats_mu:
            return dict(self._stats)

    def close(self) -> None:
        """Releases the store client (its calls are synchronous: nothing is
        queued)."""
        self._pools.clear()
