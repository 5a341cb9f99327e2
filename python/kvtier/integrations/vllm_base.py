"""vLLM's KV connector base classes when vLLM is installed, and stand-ins
with the parts kvtier's connector relies on where it is not (kvtier
imports, and its tests of the connector's logic run, without vLLM)."""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["KVConnectorBase_V1", "KVConnectorMetadata", "KVConnectorRole",
           "SupportsHMA"]

try:  # vLLM's classes when vLLM is installed; kvtier imports without it.
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole,
        SupportsHMA)
except ImportError:  # pragma: no cover - exercised where vLLM is absent
    import enum

    class SupportsHMA:  # type: ignore[no-redef]
        """vLLM's marker of a connector that serves hybrid models."""

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
