"""A model directory of the tiny Llama's shape with weights drawn from a
fixed seed, written as a checkpoint vLLM loads (``load_format="auto"``).

vLLM's dummy weights are so small that attention is nearly uniform: KV
computed under another RoPE barely changes the tokens. These weights are
scaled so that queries and keys meet at logits of several units, so
attention depends on position, and KV of the wrong bytes shows in the
tokens."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from vllm_engine import TINY_MODEL


def write_seeded_model(where: Path, seed: int = 7,
                       config: dict[str, Any] | None = None) -> Path:
    """Writes (once) and returns ``where``: the tiny Llama's config, with
    ``config``'s keys replaced, and a ``model.safetensors`` of seeded
    weights."""
    if (where / "model.safetensors").exists():
        return where
    import torch
    from safetensors.torch import save_file
    where.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((Path(TINY_MODEL) / "config.json").read_text())
    cfg.update(config or {})
    (where / "config.json").write_text(json.dumps(cfg, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(TINY_MODEL) / name, where / name)
    g = torch.Generator().manual_seed(seed)
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv_heads, dim = (cfg["num_attention_heads"],
                            cfg["num_key_value_heads"], cfg["head_dim"])
    vocab = cfg["vocab_size"]

    def w(rows: int, cols: int, std: float) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=g) * std).to(torch.bfloat16)

    t: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": w(vocab, hidden, 1.0),
        "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        "lm_head.weight": w(vocab, hidden, 0.1),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t.update({
            p + "input_layernorm.weight": torch.ones(hidden,
                                                     dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight":
                torch.ones(hidden, dtype=torch.bfloat16),
            # Queries and keys large enough that attention is peaked.
            p + "self_attn.q_proj.weight": w(heads * dim, hidden, 0.1),
            p + "self_attn.k_proj.weight": w(kv_heads * dim, hidden, 0.1),
            p + "self_attn.v_proj.weight": w(kv_heads * dim, hidden, 0.06),
            p + "self_attn.o_proj.weight": w(hidden, heads * dim, 0.06),
            p + "mlp.gate_proj.weight": w(inter, hidden, 0.06),
            p + "mlp.up_proj.weight": w(inter, hidden, 0.06),
            p + "mlp.down_proj.weight": w(hidden, inter, 0.04),
        })
    save_file(t, str(where / "model.safetensors"))
    return where
