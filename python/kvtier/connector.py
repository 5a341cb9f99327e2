"""The worker connector over an engine's own paged KV cache.

An engine allocates its KV cache, keeps its own prefix cache and chooses the
pages; kvtier moves blocks between those pages and the store, verifying every
block it loads against the checksum its writer stored. The calls follow
vLLM's KV-connector hooks (docs/engines.md):

    found, err = conn.lookup(req, hashes, skip_blocks)  # scheduler
    conn.start_load(req, pages[:n])                     # worker, n <= found
    conn.wait_for_layer(req, layer)                     # before each layer
    loaded = conn.wait_for_load(req)                    # the verdict
    conn.save(req, first_block, pages)                  # computed blocks
    conn.wait_for_save(req)
    conn.finished(req)

A layer reported by ``wait_for_layer`` holds the store's bytes, unverified:
``wait_for_load`` is the verdict, and if it raises (a checksum failure is
:class:`kvtier.errors.DataLoss`) the engine must recompute those blocks and
discard what it computed from them. Every call releases the GIL while it
waits. Thread-safe; one request id is used by one thread at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

from kvtier import _native
from kvtier.dtypes import storage_dtype
from kvtier.errors import InvalidArgument, KvtierError, StatusCode
from kvtier.memory import as_tensor


#: Layouts of one layer's KV cache tensor (P pages of T tokens):
#:   "kv_first"      [2, P, T, kv_heads, head_dim]   vLLM's FlashAttention
#:   "blocks_first"  [P, 2, T, kv_heads, head_dim]   vLLM's FlashInfer
#:   "split"         a (K, V) pair, each [P, T, kv_heads, head_dim] (SGLang)
LAYOUTS = ("kv_first", "blocks_first", "split")

Tensorish = Any
LayerCache = Union[Tensorish, tuple[Tensorish, Tensorish]]


def _bad(message: str) -> InvalidArgument:
    return InvalidArgument(StatusCode.INVALID_ARGUMENT, message)


@dataclass(frozen=True)
class Lookup:
    """What the store holds of a request after the engine's own prefix.

    ``blocks``: blocks pinned in the store, after the skipped ones.
    ``store_error``: why the store could not be asked (then ``blocks`` is 0;
    the engine computes instead), or None.
    """

    blocks: int
    store_error: Optional[KvtierError]


class Connector:
    """kvtier's connector over an engine's per-layer KV tensors.

    ``kv_caches``: one entry per layer of the namespace, in ``layout`` (see
    LAYOUTS), host tensors of the namespace's dtype (``torch.Tensor`` or
    anything with ``__dlpack__`` or the buffer protocol, shared, never
    copied; the connector keeps them alive). Every layer has the same page
    count, the namespace's ``block_tokens`` per page, and each page's
    [block_tokens, kv_heads, head_dim] contiguous. Every layer's tensors
    are on one device: the host's, or one CUDA device's. CUDA pages are
    reached through the connector's page copier (``libkvtier_cuda.so``,
    built on the GPU host by ``scripts/build_cuda_module.sh``): loads land
    in pinned host staging and are copied into the pages layer by layer,
    saves are copied out before :meth:`save` returns.
    ``page_copier``: for host tensors, "" (the connector reads and writes
    the pages itself; loads land in them directly) or "host" (the path CUDA
    pages take, with host copies: for tests and comparisons). CUDA tensors
    always take "cuda:N"; naming anything else for them is refused.
    ``stores``: kvtier-store addresses (HOST:PORT; blocks are sharded over
    them); empty: no store tier (lookups find nothing, saves do nothing).
    ``tls_ca`` / ``tls_cert`` / ``tls_key``: PEM files for TLS (mutual with
    a certificate) towards the stores' gRPC control plane.
    ``offload_nice``: the nice value (0..19) of the thread that writes saves
    to the store: 10 yields the CPU to the engine; 0 where another engine
    waits on these saves (a P/D prefill's decode).

    Raises :class:`kvtier.errors.InvalidArgument` for tensors that do not fit
    the namespace (dtype, shape, device, strides) and the store's or the
    library's error otherwise.
    """

    def __init__(self, namespace: _native.NamespaceSpec,
                 kv_caches: Sequence[LayerCache], *,
                 stores: Sequence[str] = (), layout: str = "kv_first",
                 staging_blocks: int = 64, deadline_ms: int = 10000,
                 shared_memory: str = "auto", tls_ca: str = "",
                 tls_cert: str = "", tls_key: str = "",
                 page_copier: str = "", offload_nice: int = 10) -> None:
        self.namespace = namespace
        self.layout = layout
        k, v, stride, pages, keep, device = _describe(namespace, kv_caches,
                                                      layout)
        if page_copier not in ("", "host"):
            raise _bad(f'page_copier "{page_copier}" is not "" or "host" '
                       "(CUDA pages choose their own)")
        if device != "cpu":
            if page_copier:
                raise _bad(f'page_copier "{page_copier}" is for host '
                           f"tensors; these are on {device}")
            page_copier = device
        self.num_pages: int = pages
        #: How the pages are reached: "" (directly), "host" or "cuda:N".
        self.page_copier = page_copier
        self._c = _native.EngineConnector(
            namespace, list(stores), k, v, stride, pages,
            staging_blocks=staging_blocks, deadline_ms=deadline_ms,
            shared_memory=shared_memory, tls_ca=tls_ca, tls_cert=tls_cert,
            tls_key=tls_key, page_copier=page_copier,
            offload_nice=offload_nice)
        # The tensors kvtier writes into stay alive until the connector is
        # closed (set after _c: released after it, see __del__).
        self._keep = keep

    @property
    def block_tokens(self) -> int:
        """Tokens per block (and per page)."""
        return int(self.namespace.block_tokens)

    def lookup(self, request_id: int, hashes: Any,
               skip_blocks: int = 0,
               budget_ms: Optional[float] = None) -> Lookup:
        """Opens the request over its chain (``hashes``: uint64 [n, 2]) and
        pins in the store the blocks after the first ``skip_blocks`` (those
        the engine has itself), waiting for the store at most ``budget_ms``
        (None: the client's deadline; past it nothing is pinned and
        ``store_error`` says why). Asking again before a load restarts
        it. InvalidArgument for a budget that is not a positive number."""
        blocks, err = self._c.lookup(request_id, hashes, skip_blocks,
                                     budget_ms)
        return Lookup(int(blocks), err)

    def start_load(self, request_id: int, pages: Sequence[int]) -> None:
        """Starts loading the first ``len(pages)`` blocks found into
        ``pages``, layer by layer (layer 0 of every block first)."""
        self._c.start_load(request_id, pages)

    def wait_for_layer(self, request_id: int, layer: int) -> None:
        """Returns once ``layer`` of every block being loaded is in its page
        (unverified); at once when no load runs. Raises the load's error if
        it failed before the layer came."""
        self._c.wait_for_layer(request_id, layer)

    def wait_for_load(self, request_id: int) -> int:
        """Blocks loaded and verified (0 without a load). Raises if the load
        failed (a checksum mismatch is DataLoss; the store gone Unavailable
        or DeadlineExceeded): then none of its blocks count and the engine
        computes them all."""
        return int(self._c.wait_for_load(request_id))

    def save(self, request_id: int, first_block: int,
             pages: Sequence[int], skip_known: bool = False,
             wait_ms: Optional[float] = None) -> None:
        """Queues blocks ``first_block + i`` of the request, computed into
        ``pages[i]``, for the store; their bytes are copied before it
        returns (a save larger than the staging waits for slots as earlier
        blocks leave for the store, at most ``wait_ms`` a block, None: the
        client's deadline; past it ResourceExhausted, with the blocks before
        that one queued whole and the rest not saved, counted in
        ``offload_no_staging``). The store takes only the blocks it lacks.
        ``skip_known``: blocks this process saw stored are not even copied
        (a hint: the store may have lost them since)."""
        self._c.save(request_id, first_block, pages, skip_known, wait_ms)

    def wait_for_save(self, request_id: int) -> None:
        """Waits for the request's queued saves; raises the first failure."""
        self._c.wait_for_save(request_id)

    def finished(self, request_id: int) -> None:
        """Closes the request (releases its pins; its saves, copied out
        already, finish on their own: call :meth:`wait_for_save` first to
        wait for them). Closing a request that is not open does nothing."""
        self._c.finished(request_id)

    def loaded_from_disk(self, request_id: int) -> int:
        """Of the blocks loaded for the request, those from the NVMe tier."""
        return int(self._c.loaded_from_disk(request_id))

    def load_times(self, request_id: int) -> dict[str, float]:
        """Where the request's load spent its time, in milliseconds."""
        return dict(self._c.load_times(request_id))

    def stats(self) -> dict[str, int]:
        """Counters: loads, loaded_blocks, load_failures, offloaded_blocks,
        offload_skipped_known, offload_dropped_full, offload_failures,
        staging_peak, offload_batches, offload_round_trips (waits on the
        store), offloaded_bytes, computed_blocks (blocks saved), ..."""
        return dict(self._c.stats())

    def offload_times(self) -> dict[str, float]:
        """Where offloading spent its time, in milliseconds summed over
        offload operations: control_ms, queue_ms (lane wait), rma_ms,
        checksum_ms, gather_ms (copying pages out)."""
        return dict(self._c.offload_times())

    def drain(self, timeout_s: Optional[float] = None) -> bool:
        """Waits until every queued save has been written (or failed); True
        then. With ``timeout_s``, at most that long (plus the store
        operation in flight): saves not yet sent are then dropped whole
        (none is half-written) and it returns False. ValueError for a
        negative timeout."""
        return bool(self._c.drain(timeout_s))

    def close(self) -> None:
        """Waits for queued saves and releases everything (idempotent)."""
        self._c.close()

    def __del__(self) -> None:
        # A load still in flight writes into the tensors: the connector goes
        # (waiting for it) before they can.
        c = getattr(self, "_c", None)
        if c is not None:
            c.close()

    def __enter__(self) -> "Connector":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _describe(ns: _native.NamespaceSpec, kv_caches: Sequence[LayerCache],
              layout: str
              ) -> tuple[list[int], list[int], int, int, list, str]:
    """(K addresses, V addresses, page stride, pages, tensors, device) of
    the caches, checked against the namespace; device is "cpu" or
    "cuda:N"."""
    import torch

    if layout not in LAYOUTS:
        raise _bad(f'layout "{layout}" is not one of {", ".join(LAYOUTS)}')
    if len(kv_caches) != ns.layers:
        raise _bad(f"{len(kv_caches)} layers of KV cache for a namespace of "
                   f"{ns.layers} layers")
    want = getattr(torch, storage_dtype(ns.dtype))
    page_shape = (ns.block_tokens, ns.kv_heads, ns.head_dim)
    ks: list[int] = []
    vs: list[int] = []
    keep: list = []
    stride = pages = -1
    device = ""
    for layer, entry in enumerate(kv_caches):
        if layout == "split":
            if not isinstance(entry, (tuple, list)) or len(entry) != 2:
                raise _bad(f"layer {layer}: layout \"split\" takes a (K, V) "
                           "pair per layer")
            kt, vt = as_tensor(entry[0]), as_tensor(entry[1])
            tensors = [kt, vt]
        else:
            t = as_tensor(entry)
            tensors = [t]
        for t in tensors:
            if t.device.type == "cpu":
                on = "cpu"
            elif t.device.type == "cuda":
                on = f"cuda:{t.device.index or 0}"
            else:
                raise _bad(f"layer {layer}: KV memory on {t.device}: the "
                           "connector reaches host and CUDA memory only")
            if device and on != device:
                raise _bad(f"layer {layer}: KV memory on {on}, layer 0's on "
                           f"{device}: every layer must be on one device")
            device = on
            if t.dtype != want:
                raise _bad(f"layer {layer}: dtype {t.dtype} does not match "
                           f"the namespace's {ns.dtype} ({want})")
        if layout == "split":
            kt, vt = tensors
            for name, t in (("K", kt), ("V", vt)):
                if t.dim() != 4 or tuple(t.shape[1:]) != page_shape:
                    raise _bad(f"layer {layer}: {name} has shape "
                               f"{tuple(t.shape)}; expected [pages, "
                               f"{', '.join(map(str, page_shape))}]")
            if kt.shape[0] != vt.shape[0] or kt.stride(0) != vt.stride(0):
                raise _bad(f"layer {layer}: K and V differ in pages or stride")
            n, s = kt.shape[0], kt.stride(0)
            k_view, v_view = kt, vt
        else:
            t = tensors[0]
            expect = ((2, "P") + page_shape if layout == "kv_first"
                      else ("P", 2) + page_shape)
            shape = tuple(t.shape)
            fits = t.dim() == 5 and all(
                e == "P" or e == d for e, d in zip(expect, shape))
            if not fits:
                raise _bad(f"layer {layer}: shape {shape} does not fit layout "
                           f"{layout} [{', '.join(map(str, expect))}] "
                           "(P: pages)")
            if layout == "kv_first":
                n, s = shape[1], t.stride(1)
                k_view, v_view = t[0], t[1]
            else:
                n, s = shape[0], t.stride(0)
                k_view, v_view = t[:, 0], t[:, 1]
        inner = k_view.stride()[1:]
        dense = (ns.kv_heads * ns.head_dim, ns.head_dim, 1)
        if tuple(inner) != dense or tuple(v_view.stride()[1:]) != dense:
            raise _bad(f"layer {layer}: a page's [tokens, heads, dim] is not "
                       "contiguous")
        if n == 0:
            raise _bad(f"layer {layer}: the cache has no pages")
        if pages not in (-1, n) or stride not in (-1, s):
            raise _bad(f"layer {layer}: every layer needs the same page count "
                       "and page stride")
        pages, stride = n, s
        ks.append(k_view.data_ptr())
        vs.append(v_view.data_ptr())
        keep.append(tensors)
    esize = torch.empty(0, dtype=want).element_size()
    return ks, vs, stride * esize, pages, keep, device
