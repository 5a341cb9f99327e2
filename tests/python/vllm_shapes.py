"""The objects vLLM hands a KV connector, in the shapes of vLLM's v0.15
series (vllm/v1/core/sched/output.py: NewRequestData, CachedRequestData,
SchedulerOutput; vllm/v1/request.py: Request; vllm/v1/core/kv_cache_manager.py:
KVCacheBlocks.get_block_ids; vllm/config: the fields the adapter reads).
Plain data containers: vLLM cannot be installed here, and the adapter only
reads these fields."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch


@dataclass
class ModelConfig:
    model: str = "test-org/tiny-model"
    dtype: torch.dtype = torch.float16
    layers: int = 2
    kv_heads: int = 2
    head_size: int = 32
    # The model's Hugging Face config after overrides (what vLLM reads).
    hf_config: dict = field(default_factory=lambda: {
        "model_type": "llama", "rope_theta": 10000.0,
        "max_position_embeddings": 4096})

    @property
    def hf_text_config(self) -> dict:
        return self.hf_config

    def get_num_layers(self, parallel_config: Any) -> int:
        return self.layers

    def get_num_kv_heads(self, parallel_config: Any) -> int:
        return self.kv_heads

    def get_head_size(self) -> int:
        return self.head_size


@dataclass
class CacheConfig:
    block_size: int = 16
    cache_dtype: str = "auto"


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1


@dataclass
class KVTransferConfig:
    kv_connector: str = "KvtierConnector"
    kv_connector_module_path: str = "kvtier.integrations.vllm"
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict = field(default_factory=dict)
    kv_load_failure_policy: str = "recompute"


@dataclass
class VllmConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    parallel_config: ParallelConfig
    kv_transfer_config: KVTransferConfig


def config(stores: list[str], **extra: Any) -> VllmConfig:
    return VllmConfig(ModelConfig(), CacheConfig(), ParallelConfig(),
                      KVTransferConfig(kv_connector_extra_config={
                          "stores": ",".join(stores), "deadline_ms": 3000,
                          **extra}))


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    num_computed_tokens: int = 0
    kv_transfer_params: Optional[dict[str, Any]] = None
    # vLLM sets it for prompt_logprobs requests (every position computed).
    skip_reading_prefix_cache: bool = False


@dataclass
class KVCacheBlocks:
    ids: list[int]

    def get_block_ids(self, allow_none: bool = False) -> tuple[list[int], ...]:
        return (list(self.ids),)


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: Optional[list[int]]
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    req_ids: list[str] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    new_block_ids: list[Optional[tuple[list[int], ...]]] = field(
        default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class KVConnectorOutput:
    finished_sending: Optional[set[str]] = None
    finished_recving: Optional[set[str]] = None


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(
        default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: Optional[set[str]] = None
