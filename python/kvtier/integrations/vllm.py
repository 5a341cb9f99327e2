"""kvtier as a vLLM KV connector (``KVConnectorBase_V1``).

Follows the interface of vLLM's ``vllm/distributed/kv_transfer/kv_connector/
v1/base.py`` as of the v0.15 series (read in vLLM's source; vLLM cannot be
installed here, so this was not run inside vLLM). Load it with::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvtierConnector",
        "kv_connector_module_path": "kvtier.integrations.vllm",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config":
            {"stores": "10.0.0.5:7400,10.0.0.6:7400"}}'

Extra config keys: ``stores`` (comma-separated or a list; required),
``deadline_ms`` (10000), ``shared_memory`` ("auto", "on", "off"),
``staging_blocks`` (64), ``tls_ca`` / ``tls_cert`` / ``tls_key`` (PEM
files: TLS, mutual with a certificate, towards the stores).

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
  layer by layer).
- ``update_state_after_alloc(request, blocks, num_external_tokens)``: the
  pages for those tokens (``blocks.get_block_ids()[0]`` after the local hit).
- ``build_connector_meta(scheduler_output)``: this step's loads, the prompt
  blocks this step fills (saved after the forward), finished requests.
- ``register_kv_caches(kv_caches)``: a :class:`kvtier.Connector` over the
  layer tensors (``[2, num_blocks, block_size, heads, dim]`` FlashAttention
  or ``[num_blocks, 2, ...]`` FlashInfer, detected per shape).
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


@dataclass
class KvtierConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One step's plan, from the scheduler process to the workers."""

    step: StepMeta = field(default_factory=StepMeta)


_DTYPES = {"float16": "fp16", "half": "fp16", "bfloat16": "bf16",
           "fp8": "fp8", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}


def namespace_of(vllm_config: Any, tp_rank: int,
                 salt: str = "") -> kvtier.Namespace:
    """The kvtier namespace of a vLLM deployment's KV on one TP rank (with
    ``salt``: the namespace whose seed hashes a salted request's blocks)."""
    mc, cc, pc = (vllm_config.model_config, vllm_config.cache_config,
                  vllm_config.parallel_config)
    if int(getattr(pc, "pipeline_parallel_size", 1)) > 1:
        raise kvtier.errors.InvalidArgument(
            kvtier.StatusCode.INVALID_ARGUMENT,
            "pipeline parallelism is not supported yet: a stage's blocks "
            "would need the stage in their namespace")
    dtype = str(cc.cache_dtype)
    if dtype == "auto":
        dtype = str(mc.dtype).replace("torch.", "")
    if dtype not in _DTYPES:
        raise kvtier.errors.InvalidArgument(
            kvtier.StatusCode.INVALID_ARGUMENT,
            f"KV cache dtype {dtype} is not one kvtier stores")
    return kvtier.Namespace(
        str(mc.model), _DTYPES[dtype], mc.get_num_layers(pc),
        mc.get_num_kv_heads(pc), mc.get_head_size(), cc.block_size,
        tp_rank=tp_rank, tp_size=pc.tensor_parallel_size, cache_salt=salt)


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


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import \
            get_tensor_model_parallel_rank
        return int(get_tensor_model_parallel_rank())
    except Exception:  # no vLLM, or no model-parallel group (tests)
        return 0


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
        self._block_size = int(vllm_config.cache_config.block_size)
        self._scheduler: Optional[SchedulerHalf] = None
        self._worker: Optional[WorkerHalf] = None
        self._layers: dict[str, int] = {}
        if role == KVConnectorRole.SCHEDULER:
            # The scheduler asks in the namespace of TP rank 0 (every rank
            # saves the same blocks of its own shard).
            ns = namespace_of(vllm_config, 0)
            self._scheduler = SchedulerHalf(
                ns, kvtier.StoreClient(self._stores, **self._opts),
                self._block_size)
        else:
            self._namespace = namespace_of(vllm_config, _tp_rank())
        self._hashes: dict[str, np.ndarray] = {}
        self._planned: dict[str, int] = {}
        self._blocks: dict[str, list[int]] = {}

    # ------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        """Tokens after vLLM's own prefix the store can supply; loaded in
        the same step (False: not asynchronous)."""
        assert self._scheduler is not None
        rid = request.request_id
        prompt = list(request.prompt_token_ids)
        if rid not in self._hashes:
            salt = request_salt(request)
            if salt is None:
                return 0, False  # multimodal: neither loaded nor saved
            # A salted request's blocks hash from another seed: equal tokens
            # under another salt or adapter never share blocks.
            seed = (self._scheduler.namespace if not salt else
                    namespace_of(self._vllm_config, 0, salt))
            self._hashes[rid] = kvtier.hash_tokens(seed, prompt)
        n = self._scheduler.num_loadable_tokens(
            request_key(rid), self._hashes[rid], len(prompt),
            num_computed_tokens)
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
        """A kvtier.Connector over vLLM's per-layer KV tensors."""
        def index(name: str) -> int:
            m = re.search(r"\.(\d+)\.", name)
            return int(m.group(1)) if m else 0

        names = sorted(kv_caches, key=index)
        self._layers = {name: i for i, name in enumerate(names)}
        first = kv_caches[names[0]]
        layout = ("kv_first" if first.shape[0] == 2 and
                  first.shape[1] != 2 else "blocks_first")
        conn = kvtier.Connector(self._namespace,
                                [kv_caches[n] for n in names],
                                stores=self._stores, layout=layout,
                                staging_blocks=self._staging, **self._opts)
        self._worker = WorkerHalf(conn)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Pins and starts this step's loads."""
        assert self._worker is not None
        self._worker.start_load(self._get_connector_metadata().step)

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
        self._worker.wait_for_save(self._get_connector_metadata().step)

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
        connector."""
        if self._worker is not None:
            self._worker.close()
            self._worker.connector.close()
