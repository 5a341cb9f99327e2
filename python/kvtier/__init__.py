"""kvtier: a distributed KV-cache tier for LLM inference, from Python.

- :class:`Namespace`: a model's KV geometry; ``hash_tokens`` gives a prompt's
  chained block hashes (the same as kvtier's C++ side and routers compute).
- :class:`StoreClient`: put / get / lookup of blocks in kvtier-store shards.
- :class:`Connector`: the worker connector over an engine's own KV tensors
  (kvtier.connector), in the hook order of vLLM's KV-connector API.
- :mod:`kvtier.errors`: every failure is a :class:`KvtierError` with its gRPC
  status code and message.
- :mod:`kvtier.engine`: a PyTorch reference engine that uses all of these.

See docs/engines.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier import _native, errors
from kvtier._native import NamespaceSpec as Namespace
from kvtier._native import WorkerServer
from kvtier.connector import LAYOUTS, Connector, Lookup
from kvtier.errors import KvtierError, StatusCode
from kvtier.store import StoreClient

#: This build's kvtier version (the same as every binary's --version).
__version__: str = _native.__version__

if TYPE_CHECKING:  # numpy loads with the first hash: engines set up BLAS first
    import numpy as np

__all__ = [
    "Connector", "KvtierError", "LAYOUTS", "Lookup", "Namespace",
    "StatusCode", "StoreClient", "WorkerServer", "errors", "hash_tokens",
]


def hash_tokens(namespace: Namespace, tokens: object) -> "np.ndarray":
    """Chained hashes of the prompt's full blocks: uint64 array [n, 2].

    ``tokens``: a 1-D sequence of token ids (each a uint32). A trailing
    partial block has no hash. Raises InvalidArgument for ids outside uint32.
    """
    return namespace.hash_tokens(tokens)
