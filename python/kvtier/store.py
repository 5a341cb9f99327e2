"""The store client: blocks in and out of kvtier-store shards from Python.

Blocks are named by their chained hashes (uint64 [n, 2], see
:func:`kvtier.hash_tokens`) within a namespace, and placed on the shard that
rendezvous hashing picks. Data moves zero-copy from and into the caller's
memory (tensors, DLPack producers, buffers; see kvtier.memory); registering
that memory once (:meth:`StoreClient.register`) lets UCX move it without a
bounce. Every call releases the GIL while it waits.
"""

from __future__ import annotations

from typing import Any, Sequence

from kvtier import _native
from kvtier.errors import InvalidArgument, StatusCode
from kvtier.memory import region_of


class StoreClient:
    """A client of one or more kvtier-store shards (``HOST:PORT`` each).

    ``shared_memory``: "auto" (map a same-host store's arena when it offers
    it), "on" or "off". ``deadline_ms`` bounds each operation.
    ``tls_ca`` / ``tls_cert`` / ``tls_key``: PEM files for TLS (mutual with
    a certificate) towards the stores' gRPC control plane.
    Raises :class:`kvtier.errors.InvalidArgument` for a bad address.
    """

    def __init__(self, addresses: Sequence[str], *, deadline_ms: int = 10000,
                 shared_memory: str = "auto", tls_ca: str = "",
                 tls_cert: str = "", tls_key: str = "") -> None:
        self._c = _native.StoreClient(list(addresses), deadline_ms,
                                      shared_memory, tls_ca, tls_cert,
                                      tls_key)
        self._registered: list[Any] = []

    @property
    def shards(self) -> int:
        """How many store shards the client spreads blocks over."""
        return int(self._c.shards)

    def register(self, memory: Any) -> None:
        """Registers ``memory`` (kept alive by the client) for zero-copy
        RMA."""
        r = region_of(memory)
        self._c.register_memory(r.address, r.nbytes)
        self._registered.append(r.owner)

    def register_namespace(self, namespace: _native.NamespaceSpec) -> int:
        """Registers the namespace on every shard; returns its id."""
        return int(self._c.register_namespace(namespace))

    def lookup(self, namespace: _native.NamespaceSpec, hashes: Any) -> int:
        """How many leading blocks of the chain the shards hold."""
        return int(self._c.lookup(namespace, hashes))

    def lookup_many(self, namespace: _native.NamespaceSpec,
                    chains: Sequence[Any],
                    budget_ms: float = 0.0) -> list[int]:
        """How many leading blocks of each chain the shards hold, in one
        round trip per shard (the shards asked in parallel): an engine
        scheduler's whole step at once. A shard that fails or is skipped
        holds none of any chain; raises only when every shard asked failed.
        ``budget_ms`` > 0 bounds the wait (a shard that misses it is then
        skipped by budgeted calls for a while); 0: the client's deadline.
        An empty chain answers 0."""
        return [int(n) for n in self._c.lookup_many(namespace, list(chains),
                                                     float(budget_ms))]

    def put(self, namespace: _native.NamespaceSpec, hashes: Any,
            data: Any) -> dict[str, Any]:
        """Writes block i of the chain from bytes [i * block_bytes, ...) of
        ``data``. Returns counts: written, already_present, busy, no_space,
        and where the time went."""
        r = region_of(data)
        return dict(self._c.put(namespace, hashes, r.address, r.nbytes))

    def get(self, namespace: _native.NamespaceSpec, hashes: Any,
            out: Any) -> int:
        """Reads the chain's leading present blocks into ``out`` (block i at
        byte i * block_bytes), each verified against its checksum. Returns
        how many."""
        r = region_of(out, writable=True)
        return int(self._c.get(namespace, hashes, r.address, r.nbytes))

    def put_rows(self, namespace: _native.NamespaceSpec, hashes: Any,
                 memory: Any, rows: Sequence[int]) -> dict[str, Any]:
        """Writes block i of ``hashes`` from row ``rows[i]`` of ``memory``
        (rows of ``namespace.block_bytes`` each, as an engine's tier lays
        out its buffer). Same counts as :meth:`put`. Raises
        :class:`kvtier.errors.InvalidArgument` for a row past the memory."""
        return dict(self._c.put_at(namespace, hashes,
                                   _row_addresses(namespace, memory, rows,
                                                  writable=False)))

    def get_rows(self, namespace: _native.NamespaceSpec, hashes: Any,
                 memory: Any, rows: Sequence[int]) -> int:
        """Reads the chain's leading present blocks, block i into row
        ``rows[i]`` of ``memory``, each verified against its checksum.
        Returns how many; raises :class:`kvtier.errors.DataLoss` when one
        fails its checksum (then none of them count)."""
        return int(self._c.get_at(namespace, hashes,
                                  _row_addresses(namespace, memory, rows,
                                                 writable=True)))

    def verify(self, namespace: _native.NamespaceSpec, hashes: Any) -> int:
        """Has each block's shard check its copy against the checksum its
        writer committed and drop it if corrupt. Returns how many were
        dropped."""
        return int(self._c.verify_blocks(namespace, hashes))


def _row_addresses(namespace: _native.NamespaceSpec, memory: Any,
                   rows: Sequence[int], writable: bool) -> list[int]:
    """The address of each row of ``memory``; InvalidArgument for a row
    outside it."""
    r = region_of(memory, writable=writable)
    size = int(namespace.block_bytes)
    count = r.nbytes // size
    out = []
    for row in rows:
        row = int(row)
        if not 0 <= row < count:
            raise InvalidArgument(
                StatusCode.INVALID_ARGUMENT,
                f"row {row} is outside the memory's {count} rows of "
                f"{size} bytes")
        out.append(r.address + row * size)
    return out
