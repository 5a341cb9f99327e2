"""What kvtier's vLLM connector reads from vLLM's config, in one place:
its settings (``kv_connector_extra_config``, ``kv_load_failure_policy``),
checked at start-up, and the kvtier namespace of a deployment: everything
that decides what a stored block's bytes mean (model, KV dtype, geometry,
TP rank, vLLM's page layout and CPU attention ISA, the identity fields of
:mod:`kvtier.identity`, a request's salt or LoRA adapter), with the
refusal, naming it, of what the connector cannot store."""

from __future__ import annotations

from typing import Any, Optional

import hashlib
import logging
import os
from typing import Sequence

import numpy as np

import kvtier
from kvtier.dtypes import (ELEMENT_BYTES, SPELLINGS, engine_key_hashes,
                           kvtier_dtype)
from kvtier.errors import InvalidArgument, StatusCode
from kvtier.identity import config_fields, identity_tag, weights_fingerprint
from kvtier.integrations.vllm_groups import group_kinds
from kvtier.options import CLIENT_OPTIONS, Option, read_options

#: ``kv_connector_extra_config``'s keys: the store client's and these.
CONNECTOR_OPTIONS: tuple[Option, ...] = CLIENT_OPTIONS + (
    Option("staging_blocks", "int", 64,
           "blocks of staging memory for saves", 1, 1 << 20),
    Option("lookup_wait_ms", "number", 100,
           "how long a new request waits for the store's answer before it "
           "computes its prompt", 1, 60000),
    Option("handoff_wait_ms", "number", 5000,
           "how long a decode request waits for a prefill's blocks to "
           "reach the store before it computes what is missing", 1, 600000),
    Option("lookup_threads", "int", 2,
           "batched lookups out at once", 1, 64),
    Option("load_threads", "int", 2,
           "asynchronous loads moving at once per worker", 1, 64),
    Option("pin_wait_ms", "number", 1000,
           "how long a load waits for the store to pin its blocks before "
           "vLLM computes them instead", 1, 600000),
    Option("save_queue_blocks", "int", 512,
           "blocks waiting to be copied out for saves at most; a save past "
           "it is skipped", 1, 1 << 24),
    Option("save_budget_ms", "number", 1000,
           "how long a save may keep vLLM's pages (queued and copying) "
           "before it is dropped", 1, 600000),
    Option("save_policy", "str", "all",
           "which computed prompt blocks are saved: all, or seen_twice "
           "(only the leading blocks an earlier prompt on this engine had "
           "too; a prefill's always)", choices=("all", "seen_twice")),
    Option("thread_cpus", "str", "auto",
           "the CPUs kvtier's threads in the scheduler and in a worker "
           "with CPU pages run on: "
           "auto (those vLLM keeps free of its compute threads), inherit "
           "(the worker's binding), or a CPU list such as \"3,5-7\""),
    Option("save_hold_fraction", "number", 0.25,
           "of the engine's KV blocks, the most held for saves after their "
           "requests finished; past it a finished request's blocks are "
           "freed at once and its saves not yet copied dropped", 0, 1),
)

_WHERE = "kv_connector_extra_config"


def connector_options(vllm_config: Any) -> dict[str, Any]:
    """kvtier's settings of a vLLM config, checked: every key of
    ``kv_connector_extra_config`` (CONNECTOR_OPTIONS), and
    ``kv_load_failure_policy``, which must be "recompute" (a block the
    store loses between the lookup and the load is recomputed, never a
    failed request). InvalidArgument naming the key otherwise."""
    ktc = vllm_config.kv_transfer_config
    values = read_options(getattr(ktc, "kv_connector_extra_config", None),
                          CONNECTOR_OPTIONS, _WHERE)
    policy = getattr(ktc, "kv_load_failure_policy", "recompute")
    if policy != "recompute":
        raise kvtier.errors.InvalidArgument(
            kvtier.StatusCode.INVALID_ARGUMENT,
            f"kv_transfer_config: \"kv_load_failure_policy\" is {policy!r}; "
            "kvtier's connector needs \"recompute\" (set "
            "\"kv_load_failure_policy\": \"recompute\"): a cache may lose a "
            "block between its lookup and its load, and vLLM then recomputes "
            "it instead of failing the request")
    return values




def namespace_of(vllm_config: Any, tp_rank: int, salt: str = "",
                 kv_cache_config: Any = None,
                 group: int = 0) -> kvtier.Namespace:
    """The kvtier namespace of a vLLM deployment's KV on one TP rank (with
    ``salt``: the namespace whose seed hashes a salted request's blocks).

    With ``kv_cache_config`` (vLLM 0.26 and later: every layer a view of one
    shared buffer, K and V packed in a page) the layout field records vLLM's
    ``KVCacheLayout`` and, on the CPU platform, the attention kernels' ISA
    (their pages are prepacked for it), so pages of another layout or ISA
    are never read as these. InvalidArgument for what kvtier cannot store:
    pipeline or context parallelism, a KV dtype it does not know, K and V
    of different head sizes, a KV cache group kind it does not store. A
    hybrid model's KV cache groups (vLLM's HMA) each have a namespace:
    ``group``'s layers, its index and kind in the layout field
    (kvtier.integrations.vllm_groups)."""
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
    if dtype not in SPELLINGS:
        raise kvtier.errors.InvalidArgument(
            kvtier.StatusCode.INVALID_ARGUMENT,
            f"KV cache dtype {dtype} is not one kvtier stores (supported: "
            f"{', '.join(sorted(SPELLINGS))}; run vLLM with --dtype bfloat16 "
            "or float16)")
    head = mc.get_head_size()
    head_v = getattr(mc, "get_head_size_v", None)
    if head_v is not None and int(head_v()) != int(head):
        raise kvtier.errors.InvalidArgument(
            kvtier.StatusCode.INVALID_ARGUMENT,
            f"K head size {head} and V head size {head_v()} differ; kvtier's "
            "connector stores pages whose K and V halves are equal")
    layout = model_identity_tag(vllm_config)
    if kv_cache_config is not None:
        layout = _page_layout(vllm_config, kv_cache_config) + "|" + layout
        kinds = group_kinds(kv_cache_config)
        if len(kinds) > 1:
            layout += f"|group={group}:{kinds[group]}"
    return kvtier.Namespace(
        str(mc.model), SPELLINGS[dtype],
        _kv_layers(mc, pc, kv_cache_config, group),
        mc.get_num_kv_heads(pc), head, cc.block_size,
        tp_rank=tp_rank, tp_size=pc.tensor_parallel_size, cache_salt=salt,
        layout=layout)


def model_identity(vllm_config: Any) -> dict[str, Any]:
    """The identity fields (:data:`kvtier.identity.FIELDS`) of a vLLM
    deployment, read from vLLM's resolved config (after ``hf_overrides``):
    which weights (revision, snapshot, fingerprint or dummy seed), the
    model config and compute dtype, the quantization method, where fp8 KV
    scales come from, RoPE and the sliding window."""
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    lc = getattr(vllm_config, "load_config", None)
    load_format = str(getattr(lc, "load_format", "auto") or "auto")
    load_format = str(getattr(load_format, "value", load_format))
    hf = getattr(mc, "hf_config", None)
    if hf is None:
        raise InvalidArgument(
            StatusCode.INVALID_ARGUMENT,
            "vLLM's model config carries no hf_config; kvtier cannot tell "
            "which model config (RoPE, sliding window, ...) computed the KV")
    rope, _ = config_fields(getattr(mc, "hf_text_config", None) or hf)
    _, rest = config_fields(hf)
    kv_dtype = str(cc.cache_dtype)
    scales = ("none" if not kv_dtype.startswith("fp8") else
              "calculated" if getattr(cc, "calculate_kv_scales", False)
              else "checkpoint")
    window = getattr(mc, "get_sliding_window", lambda: None)()
    return {
        "weights": weights_fingerprint(str(mc.model),
                                       getattr(mc, "revision", None),
                                       load_format,
                                       int(getattr(mc, "seed", 0) or 0)),
        "config": {"hf": rest, "dtype": str(mc.dtype)},
        "quantization": str(getattr(mc, "quantization", None) or "none"),
        "kv_scales": scales,
        "rope": rope,
        "sliding_window": window if window is not None else "none",
    }


def model_identity_tag(vllm_config: Any) -> str:
    """:func:`kvtier.identity.identity_tag` of :func:`model_identity`,
    computed once per config object (salted requests ask for it anew)."""
    key = id(vllm_config)
    hit = _TAGS.get(key)
    if hit is None or hit[0] is not vllm_config:
        hit = (vllm_config, identity_tag(model_identity(vllm_config)))
        _TAGS[key] = hit
    return hit[1]


_TAGS: dict[int, tuple[Any, str]] = {}


def _kv_layers(mc: Any, pc: Any, kv_cache_config: Any, group: int) -> int:
    """Layers that hold KV (in ``group``): from the KV cache config where
    vLLM gives one (it knows which layers attend), else the model's hidden
    layers."""
    if kv_cache_config is not None:
        groups = list(getattr(kv_cache_config, "kv_cache_groups", []) or [])
        if groups:
            return len(groups[group].layer_names)
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
    if current_platform.is_cuda():
        # CUDA pages, reached through libkvtier_cuda (docs/engines.md, "CUDA
        # pages"): the layout name says how a page's bytes are ordered.
        return f"vllm-page={name}|cuda"
    if not current_platform.is_cpu():
        raise kvtier.errors.InvalidArgument(
            kvtier.StatusCode.INVALID_ARGUMENT,
            "kvtier's connector moves host and CUDA memory; on this "
            "platform use vLLM's OffloadingConnector with "
            "kvtier.integrations.vllm_tier (docs/engines.md)")
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


# ------------------------------------------- vLLM's offloading tier

#: Rows are page multiples; the namespace sizes a row as PAGE-byte units.
_PAGE = 4096


def tier_namespace(offloading_spec: Any, row_bytes: int) -> kvtier.Namespace:
    """The kvtier namespace of one vLLM deployment's offload rows.

    A row is opaque bytes to kvtier: the geometry fields only size it
    (1 layer, 1 head, ``row_bytes / 4096`` tokens of 4096 bytes), and the
    layout field names everything that decides what the bytes mean.
    InvalidArgument for a dtype kvtier does not store or a row size that is
    not a multiple of 4096 bytes up to 256 MiB."""
    cfg = offloading_spec.config
    dtype = str(cfg.model.dtype).replace("torch.", "")
    kv_dtype = kvtier_dtype(dtype, "vLLM's KV dtype")
    elem = ELEMENT_BYTES[kv_dtype]
    if (row_bytes <= 0 or row_bytes % _PAGE
            or row_bytes // _PAGE > kvtier._native.MAX_BLOCK_TOKENS):
        raise InvalidArgument(
            StatusCode.INVALID_ARGUMENT,
            f"vLLM's offload rows are {row_bytes} bytes; kvtier stores rows "
            f"of a multiple of {_PAGE} bytes up to 256 MiB")
    from vllm import __version__ as _vllm_version
    p = cfg.parallel
    groups = hashlib.blake2b(repr(tuple(
        (g.group_id, g.tokens_per_block, tuple(g.layer_names))
        for g in cfg.groups)).encode(), digest_size=6).hexdigest()
    layout = "|".join([
        f"vllm-offload-row={_vllm_version}",
        # The KV cache dtype as vLLM spells it: two fp8 formats (or fp8 and
        # uint8 rows) of equal geometry never share rows.
        f"kv_cache_dtype={dtype}",
        f"bytes={row_bytes}",
        f"kv_bytes_per_block={cfg.worker_kv_bytes_per_block}",
        f"tokens_per_hash={cfg.cache.tokens_per_hash}",
        f"blocks_per_chunk={cfg.cache.blocks_per_chunk}",
        f"groups={len(cfg.groups)}:{groups}",
        f"world={p.world_size}", f"tp={p.tp_size}", f"pp={p.pp_size}",
        f"pcp={p.pcp_size}", f"dcp={p.dcp_size}",
        f"replicated={int(bool(getattr(cfg, 'replicated_layout', False)))}",
        f"canonical={int(bool(getattr(cfg, 'canonical_layout', False)))}",
        tier_identity_tag(str(cfg.model.name)),
    ])
    return kvtier.Namespace(str(cfg.model.name), kv_dtype, 1, 1,
                            _PAGE // (2 * elem), row_bytes // _PAGE,
                            layout=layout)


def tier_identity_tag(model: str) -> str:
    """The identity tag (:mod:`kvtier.identity`) of the engine building an
    offloading tier of ``model``. vLLM hands a tier only its
    ``OffloadingConfig`` (the model's id and dtype), so the engine's own
    ``VllmConfig`` is read from the caller that holds it (vLLM's
    ``OffloadingConnectorScheduler.__init__``), only when it names the same
    model; ``"ident=unresolved"`` (logged) when none does: then rows bind
    the model id, dtype and layouts, not its revision, RoPE or overrides."""
    import inspect
    frame = inspect.currentframe()
    try:
        f = frame.f_back if frame is not None else None
        for _ in range(16):
            if f is None:
                break
            found = f.f_locals.get("vllm_config")
            mc = getattr(found, "model_config", None)
            if mc is not None and str(getattr(mc, "model", "")) == model:
                return model_identity_tag(found)
            f = f.f_back
    finally:
        del frame
    logging.getLogger("vllm.kvtier").warning(
        "kvtier tier: vLLM's config of model %s was not found; its rows bind "
        "the model id, dtype and layouts, not its revision, RoPE or "
        "hf_overrides", model)
    return "ident=unresolved"


def check_block_hashes_shareable(locality: Any) -> None:
    """Refuses (InvalidArgument naming PYTHONHASHSEED) a tier shared by
    several engines (REMOTE) when vLLM's block hashes cannot match across
    processes: a non-cryptographic ``prefix_caching_hash_algo`` (xxhash,
    xxhash_cbor) without PYTHONHASHSEED seeds them at random per process,
    so no two engines, nor one engine after a restart, would ever share a
    row. Read from vLLM's current config where vLLM has set one; vLLM's
    engine core sets none while it builds its scheduler, so there
    :meth:`KvtierTier._check_seed` checks vLLM's resolved seed at the
    first lookup instead."""
    if str(getattr(locality, "value", locality)) != "REMOTE" or \
            os.environ.get("PYTHONHASHSEED") is not None:
        return
    try:
        from vllm.config import get_current_vllm_config_or_none
        cfg = get_current_vllm_config_or_none()
    except ImportError:  # pragma: no cover - older vLLM
        cfg = None
    algo = str(getattr(getattr(cfg, "cache_config", None),
                       "prefix_caching_hash_algo", "sha256"))
    if algo.startswith("xxhash"):
        raise InvalidArgument(
            StatusCode.INVALID_ARGUMENT,
            "kvtier tier config \"locality\" " + SEED_MESSAGE.format(algo=algo))


def warn_if_seeded_at_random(locality: Any) -> None:
    """Once vLLM has seeded its block hashes (before its first request): a
    random per-process seed under a shared (REMOTE) tier is said in the
    log, as an error naming PYTHONHASHSEED (rows this engine writes are
    found by this process only)."""
    if str(getattr(locality, "value", locality)) != "REMOTE" or \
            os.environ.get("PYTHONHASHSEED") is not None:
        return
    try:
        from vllm.v1.core import kv_cache_utils as kcu
    except ImportError:  # pragma: no cover - older vLLM
        return
    seed = getattr(kcu, "_NONE_HASH_SEED", None)
    if seed is not None and seed != getattr(kcu, "DEFAULT_NONE_HASH_SEED",
                                            seed):
        logging.getLogger("vllm.kvtier").error(
            "kvtier tier: locality %s",
            SEED_MESSAGE.format(algo="(a non-cryptographic one)"))


SEED_MESSAGE = (
    "is REMOTE (a store shared by engines) but vLLM's block hashes are "
    "not reproducible across processes: prefix_caching_hash_algo {algo} "
    "without PYTHONHASHSEED seeds them at random per process, so no two "
    "engines would ever share a row. Set PYTHONHASHSEED to one value on "
    "every engine, or use --prefix-caching-hash-algo sha256")


def key_hashes(keys: Sequence[Any]) -> np.ndarray:
    """kvtier block hashes (uint64 [n, 2]) of vLLM offload keys (a block
    hash and a KV group; the one engine-key function,
    kvtier.dtypes.engine_key_hashes)."""
    return engine_key_hashes([bytes(k) for k in keys])


def log_with_vllm() -> None:
    """kvtier's engine-neutral loggers (``kvtier.*``: a load that failed,
    say) write where vLLM's own lines go, in vLLM's format, in every
    process that makes a connector (vLLM configures only ``vllm``)."""
    ours, theirs = logging.getLogger("kvtier"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for h in theirs.handlers:
        ours.addHandler(h)
    if ours.level == logging.NOTSET:
        ours.setLevel(logging.INFO)
    ours.propagate = False
