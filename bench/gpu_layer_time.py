"""The engine's step time a KV load must hide behind: one Llama-3-8B
decoder layer's prefill (hidden 4096, 32 query heads, 8 KV heads of 128,
MLP 14336, bf16) over a prompt, timed with PyTorch on the GPU (CUDA
events, the median of 10 after 3 warm-ups), printed as one JSON line.

    python3 bench/gpu_layer_time.py [TOKENS ...]

Random weights and activations: the arithmetic, not the model's output,
is what is timed. Needs torch with CUDA; exit 2 without a GPU."""

from __future__ import annotations

import json
import statistics
import sys


def layer_ms(tokens: int) -> float:
    """Milliseconds of one layer's prefill over ``tokens`` tokens."""
    import torch
    import torch.nn.functional as F

    dev, dt = "cuda", torch.bfloat16
    hidden, heads, kv_heads, dim, inter = 4096, 32, 8, 128, 14336
    g = torch.Generator(device=dev).manual_seed(0)

    def w(o: int, i: int) -> torch.Tensor:
        return torch.randn(o, i, device=dev, dtype=dt, generator=g) * 0.02

    qkv = w((heads + 2 * kv_heads) * dim, hidden)
    o_proj = w(hidden, heads * dim)
    gate_up = w(2 * inter, hidden)
    down = w(hidden, inter)
    norm = torch.ones(hidden, device=dev, dtype=dt)
    x = torch.randn(tokens, hidden, device=dev, dtype=dt, generator=g)

    def step() -> torch.Tensor:
        h = F.rms_norm(x, (hidden,), norm)
        q, k, v = (h @ qkv.T).split(
            [heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        q = q.view(tokens, heads, dim).transpose(0, 1)
        k = k.view(tokens, kv_heads, dim).transpose(0, 1)
        v = v.view(tokens, kv_heads, dim).transpose(0, 1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=True)
        h = x + a.transpose(0, 1).reshape(tokens, heads * dim) @ o_proj.T
        m = F.rms_norm(h, (hidden,), norm) @ gate_up.T
        gate, up = m.chunk(2, dim=-1)
        return h + (F.silu(gate) * up) @ down.T

    for _ in range(3):
        step()
    times = []
    for _ in range(10):
        a, b = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        a.record()
        step()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> None:
    import torch
    if not torch.cuda.is_available():
        print("gpu_layer_time: no CUDA device", file=sys.stderr)
        sys.exit(2)
    for tokens in [int(t) for t in sys.argv[1:]] or [4096]:
        ms = layer_ms(tokens)
        print(json.dumps({"check": "layer_compute", "tokens": tokens,
                          "device": torch.cuda.get_device_name(),
                          "layer_ms": ms, "model_32_layers_ms": 32 * ms}),
              flush=True)


if __name__ == "__main__":
    main()
