"""Adapters of kvtier to inference engines: ``kvtier.integrations.vllm``
(a vLLM KV connector) and ``kvtier.integrations.sglang`` (an SGLang HiCache
storage backend). Each imports without its engine installed; all logic is
in kvtier.hooks and kvtier.connector (docs/engines.md)."""
