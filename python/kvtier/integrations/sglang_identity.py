"""The identity fields (:data:`kvtier.identity.FIELDS`) of an SGLang
deployment, the same table vLLM's connector and tier fill.

SGLang's ``HiCacheStorageConfig`` names the model and the ranks only. The
rest of a block's identity (which weights, the model config after
``--json-model-override-args``, quantization, KV scales, RoPE, sliding
window) is read from the server args SGLang's scheduler publishes in its
process (``sglang.srt.runtime_context.publish``), through SGLang's own
``ModelConfig.from_server_args``: the config SGLang itself runs."""

from __future__ import annotations

from typing import Any

from kvtier.errors import InvalidArgument, StatusCode
from kvtier.identity import config_fields, identity_tag, weights_fingerprint


def model_identity(server_args: Any) -> dict[str, Any]:
    """The identity fields of an SGLang ``ServerArgs``: its weights
    (revision, snapshot, fingerprint or dummy seed), the model config
    SGLang resolves from it and the compute dtype, the quantization method,
    where fp8 KV scales come from, RoPE and the sliding window.
    InvalidArgument when SGLang cannot resolve the model config."""
    from sglang.srt.configs.model_config import ModelConfig
    try:
        mc = ModelConfig.from_server_args(server_args)
    except Exception as e:  # SGLang's own error, whatever its class
        raise InvalidArgument(
            StatusCode.INVALID_ARGUMENT,
            f"SGLang could not resolve the model config of "
            f"{server_args.model_path!r} ({e}); kvtier cannot tell which "
            "model config (RoPE, sliding window, ...) computes the KV") from e
    hf = mc.hf_config
    rope, _ = config_fields(getattr(mc, "hf_text_config", None) or hf)
    _, rest = config_fields(hf)
    kv_dtype = str(getattr(server_args, "kv_cache_dtype", "auto"))
    scales_file = getattr(server_args, "quantization_param_path", None)
    scales = ("none" if not kv_dtype.startswith("fp8") else
              f"file:{scales_file}" if scales_file else "checkpoint")
    window = getattr(mc, "sliding_window_size", None)
    load_format = str(getattr(server_args, "load_format", "auto") or "auto")
    return {
        "weights": weights_fingerprint(
            str(server_args.model_path), getattr(server_args, "revision",
                                                 None),
            load_format, int(getattr(server_args, "random_seed", 0) or 0)),
        "config": {"hf": rest, "dtype": str(mc.dtype), "kv_dtype": kv_dtype},
        "quantization": str(getattr(mc, "quantization", None) or "none"),
        "kv_scales": scales,
        "rope": rope,
        "sliding_window": window if window is not None else "none",
    }


def published_identity_tag() -> str:
    """:func:`kvtier.identity.identity_tag` of the server args SGLang
    published in this process, computed once per published object.
    InvalidArgument when none are published (the backend is made outside
    SGLang's scheduler) or the model config cannot be resolved."""
    try:
        from sglang.srt.runtime_context import get_server_args
        args = get_server_args()
    except (ImportError, ValueError) as e:
        raise InvalidArgument(
            StatusCode.INVALID_ARGUMENT,
            f"SGLang has published no server args in this process ({e}); "
            "kvtier reads the weights, model config, quantization and RoPE "
            "that decide a block's bytes from them (the backend is made by "
            "SGLang's scheduler, which publishes them)") from e
    hit = _TAGS.get(id(args))
    if hit is None or hit[0] is not args:
        hit = (args, identity_tag(model_identity(args)))
        _TAGS[id(args)] = hit
    return hit[1]


_TAGS: dict[int, tuple[Any, str]] = {}
