"""KV element types: the one table of the names engines give them, from
kvtier's C++ library (``common/dtype.h``), and the one engine-key->block-hash
function (``EngineKeyHash``).

Every integration (vLLM's connector and offloading tier, SGLang's backend,
the connector over engine tensors) reads these instead of a table of its
own, so an engine's spelling means the same kvtier dtype everywhere and a
key hashes alike in every process and language.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from kvtier import _native
from kvtier.errors import InvalidArgument, StatusCode

#: Engine spelling ("bfloat16", "half", "fp8_e4m3", "float8_e4m3fn", ...)
#: -> kvtier dtype name ("bf16", "fp16", "fp8_e4m3", ...).
SPELLINGS: dict[str, str] = dict(_native.DTYPE_SPELLINGS)

#: kvtier dtype name -> bytes per element.
ELEMENT_BYTES: dict[str, int] = dict(_native.DTYPE_ELEMENT_BYTES)


def kvtier_dtype(engine_dtype: Any, what: str = "KV cache dtype") -> str:
    """The kvtier dtype an engine's dtype is stored as (a name, or a torch
    dtype such as ``torch.bfloat16``). InvalidArgument naming ``what`` and
    the accepted names otherwise."""
    name = str(engine_dtype).removeprefix("torch.")
    if name not in SPELLINGS:
        raise InvalidArgument(
            StatusCode.INVALID_ARGUMENT,
            f"{what} {name} is not one kvtier stores (supported: "
            f"{', '.join(sorted(SPELLINGS))})")
    return SPELLINGS[name]


def storage_dtype(kvtier_name: str) -> str:
    """The torch dtype name a kvtier dtype's elements are held in (fp8
    formats as ``uint8``: moved as bytes)."""
    if ELEMENT_BYTES[kvtier_name] == 1:
        return "uint8"
    return {"fp16": "float16", "bf16": "bfloat16"}[kvtier_name]


def engine_key_hashes(keys: Sequence[Any]) -> np.ndarray:
    """kvtier block hashes (uint64 [n, 2]) of the keys an engine names
    blocks by (bytes, or str as UTF-8): XXH3-128 of each key."""
    return np.asarray(_native.engine_key_hashes(list(keys)))
