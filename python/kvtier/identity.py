"""What makes a stored block's bytes the bytes an engine would compute: the
one table of identity fields an engine adapter fills (vLLM's connector
and offloading tier, SGLang's storage backend: docs/engines.md), and
the tag they put into the namespace's layout field.

The geometry (model id, KV dtype, layers, heads, head size, block size),
the TP rank, the engine's page layout, a request's cache salt and LoRA
adapter have fields of their own in :class:`kvtier.Namespace`. Everything
else that changes a KV byte for the same tokens is here: two engines that
differ in any of these fields never share a block, and two that differ in
nothing else (``max_model_len``, scheduling options, the number of KV
blocks) do. docs/engines.md lists the table with what each field protects
against.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Mapping, Optional

from kvtier.errors import InvalidArgument, StatusCode


@dataclass(frozen=True)
class IdentityField:
    """One field of a block's identity: its name and what a wrong one
    would let through."""

    name: str
    protects: str


#: The identity fields, in the order they are hashed.
FIELDS: tuple[IdentityField, ...] = (
    IdentityField("weights",
                  "a new revision of the same model id (a rolling upgrade "
                  "while the NVMe tier persists) reading the old weights' "
                  "KV"),
    IdentityField("config",
                  "an engine whose model config differs after overrides "
                  "(activation, norms, attention scaling, layer types) "
                  "reading KV computed under another"),
    IdentityField("quantization",
                  "fp8 or int4 weights beside bf16 ones of the same "
                  "checkpoint sharing KV"),
    IdentityField("kv_scales",
                  "KV quantized with scales from the checkpoint read as KV "
                  "quantized with scales computed at run time"),
    IdentityField("rope",
                  "RoPE theta, scaling type and factors, or the original "
                  "position limit of YaRN / NTK scaling differing: the same "
                  "tokens rotated by other angles"),
    IdentityField("sliding_window",
                  "a model run with another attention window (its layers' "
                  "inputs, and so their KV, differ past the window)"),
)

_NAMES = tuple(f.name for f in FIELDS)

#: Keys of a Hugging Face config that do not change a KV byte.
_CONFIG_NOISE = frozenset({
    "_name_or_path", "name_or_path", "transformers_version", "_commit_hash",
    "_attn_implementation", "_attn_implementation_autoset",
    "attn_implementation", "use_cache", "output_attentions",
    "output_hidden_states", "return_dict", "torchscript", "tokenizer_class",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id",
    "decoder_start_token_id", "max_length", "min_length", "id2label",
    "label2id", "task_specific_params", "architectures_auto_map",
    "auto_map", "max_model_len",
    # SGLang writes its served context length into the config it runs.
    "context_len",
})

#: Keys of a config that decide RoPE.
_ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters",
              "partial_rotary_factor", "rotary_pct", "rotary_emb_base",
              "original_max_position_embeddings")


def identity_tag(values: Mapping[str, Any]) -> str:
    """The layout-field part naming an identity: ``"ident=" + 16 hex
    digits`` of a hash over every field of :data:`FIELDS`, in order.
    InvalidArgument naming a field that is missing or not in the table
    (an adapter can neither forget a field nor add one of its own)."""
    missing = [n for n in _NAMES if n not in values]
    extra = sorted(set(values) - set(_NAMES))
    if missing or extra:
        raise InvalidArgument(
            StatusCode.INVALID_ARGUMENT,
            f"a block identity needs exactly the fields {', '.join(_NAMES)}"
            f" (missing: {', '.join(missing) or 'none'}; unknown: "
            f"{', '.join(extra) or 'none'})")
    text = "\n".join(f"{n}={canonical(values[n])}" for n in _NAMES)
    return "ident=" + hashlib.blake2b(text.encode(),
                                      digest_size=8).hexdigest()


def canonical(value: Any) -> str:
    """A value as one stable string: JSON with sorted keys, objects it
    cannot encode as their ``str``."""
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, default=_plain,
                      separators=(",", ":"))


def _plain(value: Any) -> Any:
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict):
        return to_dict()
    return str(value)


def config_fields(config: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """A model config (a Hugging Face ``PretrainedConfig`` or a dict) split
    into the keys that decide RoPE and the rest that can change a KV byte
    (without :data:`_CONFIG_NOISE`)."""
    data = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    rest = {k: v for k, v in data.items()
            if k not in _CONFIG_NOISE and k not in _ROPE_KEYS}
    rope = {k: data[k] for k in _ROPE_KEYS if data.get(k) is not None}
    if rope.get("rope_scaling") or rope.get("rope_parameters"):
        # Dynamic NTK and some YaRN variants scale by the trained limit.
        rope["max_position_embeddings"] = data.get("max_position_embeddings")
    rest.pop("max_position_embeddings", None)
    return rope, rest


def weights_fingerprint(model: str, revision: Optional[str] = None,
                        load_format: str = "auto", seed: int = 0) -> str:
    """Which weights a model id names: ``dummy:SEED`` for random weights
    from a seed, ``rev=R`` for a pinned revision, the Hugging Face cache's
    snapshot commit for a hub id, else (a local directory) a hash of its
    weight files' names, sizes, first and last MiB; a
    hub id found nowhere is ``unresolved`` (then only the id names it)."""
    if load_format == "dummy":
        return f"dummy:{seed}"
    if revision:
        return f"rev={revision}"
    if os.path.isdir(model):
        return "files=" + _directory_fingerprint(os.path.realpath(model))
    try:
        from huggingface_hub import try_to_load_from_cache
        found = try_to_load_from_cache(model, "config.json")
    except Exception:  # pragma: no cover - hub client missing or broken
        found = None
    if isinstance(found, str):
        parent = os.path.dirname(found)
        if os.path.basename(os.path.dirname(parent)) == "snapshots":
            return "rev=" + os.path.basename(parent)
    return "unresolved"


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf",
                    ".index.json")
_EDGE = 1 << 20


@lru_cache(maxsize=16)
def _directory_fingerprint(path: str) -> str:
    """Names, sizes, first and last MiB of a model directory's weight
    files (and their index): equal for copies of one checkpoint on every host, unequal
    for a retrained one (its first and last tensors differ)."""
    h = hashlib.blake2b(digest_size=8)
    for name in sorted(os.listdir(path)):
        if not name.endswith(_WEIGHT_SUFFIXES):
            continue
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            continue
        size = os.path.getsize(full)
        h.update(f"{name}\0{size}\0".encode())
        with open(full, "rb") as f:
            h.update(f.read(_EDGE))
            if size > 2 * _EDGE:
                f.seek(size - _EDGE)
                h.update(f.read(_EDGE))
    return h.hexdigest()
