"""A small decoder-only transformer over a paged KV cache (reference engine).

The model has the structure of current decoder-only LLMs -- token embedding,
pre-norm residual blocks of RMSNorm, grouped-query attention with rotary
position embeddings and a SwiGLU feed-forward, a final RMSNorm and an LM head
-- at a size that runs on a CPU. Its weights are drawn from a fixed seed, so
two instances built from equal configurations are identical and nothing has to
be downloaded.

All arithmetic is real and in float32, except that keys and values live in a
:class:`PagedKvCache` in float16 or bfloat16 (float32 is accepted too), laid
out as vLLM lays out its per-layer KV tensors. Attention always reads keys and
values back from the cache, never from the freshly computed float32 values, so
a run whose prefix KV was copied into the cache from elsewhere (a KV store)
computes exactly what a run that computed that prefix itself computes.

Rotary convention: "rotate half" (GPT-NeoX / Llama as in Hugging Face). Within
each head the dimensions ``[0, head_dim / 2)`` pair with
``[head_dim / 2, head_dim)``; pair ``i`` rotates by the angle
``position * rope_theta ** (-2 i / head_dim)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, cast

import torch
from torch import nn

from kvtier.engine.kv_cache import PagedKvCache, SeqChunk
from kvtier.engine.model_config import (_SCORE_BUDGET, ModelConfig,
                                        _check_ids, _is_int)

__all__ = [
    "ModelConfig",
    "PagedKvCache",
    "SeqChunk",
    "Transformer",
    "greedy",
]
# The cache and the step's chunks live in kvtier.engine.kv_cache, the
# configuration in kvtier.engine.model_config; re-exported here.

@dataclass
class _Plan:
    """A validated chunk: its tokens and where its keys and values go."""

    tokens: torch.Tensor      # int64 [n] on the model's device
    start: int
    pages: torch.Tensor       # int64 [ceil((start + n) / page_tokens)]
    write_pages: torch.Tensor  # int64 [n]: page of each new position
    write_slots: torch.Tensor  # int64 [n]: slot of each new position


class _Layer(nn.Module):
    """Weights of one decoder block (the arithmetic lives in Transformer)."""

    def __init__(self, config: ModelConfig,
                 generator: torch.Generator) -> None:
        """Draw the block's weights from ``generator`` in declaration order."""
        super().__init__()
        q_width = config.heads * config.head_dim
        kv_width = config.kv_heads * config.head_dim
        self.attn_norm = _norm_weight(config.hidden, generator)
        self.wq = _dense(config.hidden, q_width, generator)
        self.wk = _dense(config.hidden, kv_width, generator)
        self.wv = _dense(config.hidden, kv_width, generator)
        self.wo = _dense(q_width, config.hidden, generator)
        self.ffn_norm = _norm_weight(config.hidden, generator)
        self.w_gate = _dense(config.hidden, config.ffn, generator)
        self.w_up = _dense(config.hidden, config.ffn, generator)
        self.w_down = _dense(config.ffn, config.hidden, generator)


def _dense(fan_in: int, fan_out: int,
           generator: torch.Generator) -> nn.Parameter:
    """A frozen ``[fan_in, fan_out]`` matrix, normal / sqrt(fan_in)."""
    weight = torch.randn(fan_in, fan_out, generator=generator)
    return nn.Parameter(weight / math.sqrt(fan_in), requires_grad=False)


def _norm_weight(width: int, generator: torch.Generator) -> nn.Parameter:
    """A frozen RMSNorm gain: 1 + 0.05 * standard normal."""
    weight = 1.0 + 0.05 * torch.randn(width, generator=generator)
    return nn.Parameter(weight, requires_grad=False)


class Transformer(nn.Module):
    """Decoder-only transformer (GQA, RoPE, SwiGLU) over a paged KV cache.

    Weights are float32, drawn from ``torch.Generator().manual_seed(seed)`` in
    this order: embedding ``[vocab, hidden]`` (standard normal); per layer
    attention RMSNorm gain, ``wq [hidden, heads * head_dim]``,
    ``wk``/``wv [hidden, kv_heads * head_dim]``, ``wo [heads * head_dim,
    hidden]``, FFN RMSNorm gain, ``w_gate``/``w_up [hidden, ffn]``,
    ``w_down [ffn, hidden]``; final RMSNorm gain; ``lm_head [hidden, vocab]``.
    Matrices are standard normal / sqrt(fan_in), gains 1 + 0.05 * normal.
    Activations multiply on the left (``x @ w``). Move the model with
    ``.to(device)``; the cache must be on the same device.
    """

    def __init__(self, config: ModelConfig) -> None:
        """Build the model; ``ValueError`` if ``config`` is invalid."""
        super().__init__()
        config.validate()
        self.config: ModelConfig = config
        generator = torch.Generator().manual_seed(config.seed)
        self.embedding = nn.Parameter(
            torch.randn(config.vocab_size, config.hidden, generator=generator),
            requires_grad=False)
        self.layers = nn.ModuleList(
            [_Layer(config, generator) for _ in range(config.layers)])
        self.final_norm = _norm_weight(config.hidden, generator)
        self.lm_head = _dense(config.hidden, config.vocab_size, generator)
        half = config.head_dim // 2
        inv_freq = config.rope_theta ** (
            -torch.arange(half, dtype=torch.float64) * 2.0 / config.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    # ----------------------------------------------------------------- forward

    @torch.no_grad()
    def forward(self, chunks: list[SeqChunk], cache: PagedKvCache,
                before_layer: Callable[[int], None] | None = None,
                after_layer: Callable[[int], None] | None = None
                ) -> torch.Tensor:
        """Run ``chunks`` through the model together; return last-token logits.

        All chunks go through the embedding, projections and feed-forward as
        one batch (their tokens concatenated); attention is per chunk. For each
        layer ``l``: ``before_layer(l)`` is called first (a caller loading
        layer ``l``'s KV into the cache waits there); then the keys and values
        of every chunk's tokens are computed (RoPE at position ``start + i``),
        cast to the cache dtype and written to page ``page_table[pos //
        page_tokens]``, slot ``pos % page_tokens``; then each chunk's queries
        attend causally (query ``i`` sees positions ``<= start + i``) to keys
        and values of positions ``[0, start + n)`` read back from the cache and
        cast to float32, softmax in float32 with scale ``1 / sqrt(head_dim)``;
        then ``after_layer(l)`` is called, by which time layer ``l``'s KV of
        every chunk is in the cache.

        Returns float32 logits of each chunk's last token, ``[len(chunks),
        vocab_size]``. Deterministic. Raises ``ValueError`` -- before touching
        the cache or calling a hook -- for an empty batch or chunk, a token out
        of ``[0, vocab_size)``, a negative ``start``, a page table too short or
        with a page out of ``[0, num_pages)`` or a page used twice, two chunks
        writing the same slot, a chunk writing a slot another chunk reads as
        its prefix, or a cache whose shape, layer count or device does not
        match the model.
        """
        plans = self._plan(chunks, cache)
        config = self.config
        device = self.embedding.device
        tokens = torch.cat([plan.tokens for plan in plans])
        positions = torch.cat([
            torch.arange(plan.start, plan.start + plan.tokens.numel(),
                         device=device) for plan in plans])
        cos, sin = self._rope_tables(positions)
        write_pages = torch.cat([plan.write_pages for plan in plans])
        write_slots = torch.cat([plan.write_slots for plan in plans])
        total = tokens.numel()

        x = self.embedding[tokens]
        for index, module in enumerate(self.layers):
            layer = cast(_Layer, module)  # a ModuleList holds Modules
            if before_layer is not None:
                before_layer(index)
            h = self._rms_norm(x, layer.attn_norm)
            q = (h @ layer.wq).view(total, config.heads, config.head_dim)
            k = (h @ layer.wk).view(total, config.kv_heads, config.head_dim)
            v = (h @ layer.wv).view(total, config.kv_heads, config.head_dim)
            q = self._rotate(q, cos, sin)
            k = self._rotate(k, cos, sin)
            key_cache = cache.key(index)
            value_cache = cache.value(index)
            key_cache[write_pages, write_slots] = k.to(
                device=cache.device, dtype=cache.dtype)
            value_cache[write_pages, write_slots] = v.to(
                device=cache.device, dtype=cache.dtype)
            attended = torch.empty(total, config.heads * config.head_dim,
                                   device=device)
            offset = 0
            for plan in plans:
                n = plan.tokens.numel()
                attended[offset:offset + n] = self._attend(
                    q[offset:offset + n], plan, key_cache, value_cache,
                    cache.page_tokens)
                offset += n
            x = x + attended @ layer.wo
            h = self._rms_norm(x, layer.ffn_norm)
            gated = nn.functional.silu(h @ layer.w_gate) * (h @ layer.w_up)
            x = x + gated @ layer.w_down
            if after_layer is not None:
                after_layer(index)

        ends = torch.tensor([plan.tokens.numel() for plan in plans],
                            device=device).cumsum(0) - 1
        last = self._rms_norm(x[ends], self.final_norm)
        return last @ self.lm_head

    # ---------------------------------------------------------------- helpers

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm on the last dim: ``x / sqrt(mean(x^2) + eps) * weight``."""
        mean_square = x.pow(2).mean(dim=-1, keepdim=True)
        scale = torch.rsqrt(mean_square + self.config.eps)
        return x * scale * weight

    def _rope_tables(self, positions: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[len(positions), 1, head_dim / 2]``, float32.

        Angles are computed in float64 and rounded once.
        """
        inv_freq = cast(torch.Tensor, self.inv_freq)  # a registered buffer
        angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
        return (angles.cos().to(torch.float32)[:, None, :],
                angles.sin().to(torch.float32)[:, None, :])

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> torch.Tensor:
        """Apply rotate-half RoPE to ``x [tokens, heads, head_dim]``."""
        half = x.shape[-1] // 2
        first, second = x[..., :half], x[..., half:]
        return torch.cat((first * cos - second * sin,
                          second * cos + first * sin), dim=-1)

    def _attend(self, q: torch.Tensor, plan: _Plan, key_cache: torch.Tensor,
                value_cache: torch.Tensor, page_tokens: int) -> torch.Tensor:
        """Causal GQA of one chunk's queries ``[n, heads, head_dim]``.

        Returns ``[n, heads * head_dim]`` float32. Queries go in blocks sized
        so that at most ``_SCORE_BUDGET`` scores exist at once; block
        ``[b0, b1)`` reads keys ``[0, start + b1)`` only.
        """
        config = self.config
        device = q.device
        n = q.shape[0]
        seen = plan.start + n
        group = config.heads // config.kv_heads
        # [kv_heads, seen, head_dim], gathered once per chunk and layer.
        keys = key_cache[plan.pages].reshape(
            -1, config.kv_heads, config.head_dim)[:seen]
        values = value_cache[plan.pages].reshape(
            -1, config.kv_heads, config.head_dim)[:seen]
        keys = keys.to(device=device, dtype=torch.float32).transpose(0, 1)
        values = values.to(device=device, dtype=torch.float32).transpose(0, 1)
        keys = keys.contiguous()
        values = values.contiguous()
        # [kv_heads, group, n, head_dim]: query head h uses kv head h // group.
        queries = q.view(n, config.kv_heads, group, config.head_dim)
        queries = queries.permute(1, 2, 0, 3)
        scale = 1.0 / math.sqrt(config.head_dim)
        block = max(1, _SCORE_BUDGET // (config.heads * seen))
        # Within a block, query row r sees key column c of the block's own
        # positions iff c <= r; everything before the block is visible.
        future = torch.ones(min(block, n), min(block, n), dtype=torch.bool,
                            device=device).triu(1)
        out = torch.empty(n, config.heads * config.head_dim, device=device)
        for b0 in range(0, n, block):
            b1 = min(n, b0 + block)
            width = plan.start + b1
            rows = b1 - b0
            qb = queries[:, :, b0:b1].reshape(
                config.kv_heads, group * rows, config.head_dim) * scale
            scores = torch.bmm(qb, keys[:, :width].transpose(1, 2))
            scores = scores.view(config.kv_heads, group, rows, width)
            scores[..., width - rows:].masked_fill_(
                future[:rows, :rows], float("-inf"))
            probs = torch.softmax(scores, dim=-1).view(
                config.kv_heads, group * rows, width)
            mixed = torch.bmm(probs, values[:, :width])
            mixed = mixed.view(config.kv_heads, group, rows, config.head_dim)
            out[b0:b1] = mixed.permute(2, 0, 1, 3).reshape(
                rows, config.heads * config.head_dim)
        return out

    def _plan(self, chunks: list[SeqChunk],
              cache: PagedKvCache) -> list[_Plan]:
        """Validate the batch against model and cache; see :meth:`forward`."""
        config = self.config
        if not isinstance(cache, PagedKvCache):
            raise TypeError(
                f"cache must be a PagedKvCache, got {type(cache)!r}")
        if (cache.config.kv_heads != config.kv_heads
                or cache.config.head_dim != config.head_dim
                or len(cache.tensors) != config.layers):
            raise ValueError(
                f"cache shape (layers={len(cache.tensors)}, "
                f"kv_heads={cache.config.kv_heads}, "
                f"head_dim={cache.config.head_dim}) does not match the model "
                f"(layers={config.layers}, kv_heads={config.kv_heads}, "
                f"head_dim={config.head_dim})")
        device = self.embedding.device
        if cache.device != device:
            raise ValueError(
                f"cache is on {cache.device} but the model is on {device}")
        if len(chunks) == 0:
            raise ValueError("forward needs at least one chunk")
        page_tokens = cache.page_tokens
        plans: list[_Plan] = []
        for number, chunk in enumerate(chunks):
            if not isinstance(chunk, SeqChunk):
                raise TypeError(
                    f"chunk {number} must be a SeqChunk, got {type(chunk)!r}")
            tokens, start, table = chunk.tokens, chunk.start, chunk.page_table
            if (not isinstance(tokens, torch.Tensor) or tokens.dim() != 1
                    or tokens.dtype.is_floating_point or tokens.is_complex()
                    or tokens.dtype == torch.bool):
                raise ValueError(
                    f"chunk {number}: tokens must be a 1-D integer tensor")
            n = tokens.numel()
            if n == 0:
                raise ValueError(f"chunk {number}: tokens is empty")
            _check_ids(tokens, config.vocab_size, f"chunk {number}: token id")
            if not _is_int(start) or start < 0:
                raise ValueError(
                    f"chunk {number}: start must be an int >= 0, "
                    f"got {start!r}")
            if (not isinstance(table, torch.Tensor) or table.dim() != 1
                    or table.dtype.is_floating_point or table.is_complex()
                    or table.dtype == torch.bool):
                raise ValueError(
                    f"chunk {number}: page_table must be a 1-D integer tensor")
            spans = -(-(start + n) // page_tokens)
            if table.numel() < spans:
                raise ValueError(
                    f"chunk {number}: page_table has {table.numel()} entries "
                    f"but positions [0, {start + n}) need {spans} pages of "
                    f"{page_tokens} tokens")
            pages = table[:spans].to(device=cache.device, dtype=torch.int64)
            _check_ids(pages, cache.num_pages, f"chunk {number}: page id")
            if torch.unique(pages).numel() != spans:
                raise ValueError(
                    f"chunk {number}: page_table uses a page more than once "
                    f"in its first {spans} entries")
            new = torch.arange(start, start + n, device=cache.device)
            plans.append(_Plan(
                tokens=tokens.to(device=device, dtype=torch.int64),
                start=start, pages=pages,
                write_pages=pages[new // page_tokens],
                write_slots=new % page_tokens))
        if len(plans) > 1:
            written = torch.cat([
                plan.write_pages * page_tokens + plan.write_slots
                for plan in plans])
            if torch.unique(written).numel() != written.numel():
                raise ValueError(
                    "two chunks write the same cache slot (page, position "
                    "within page)")
            for number, plan in enumerate(plans):
                if plan.start == 0:
                    continue
                prefix = torch.arange(plan.start, device=cache.device)
                read = plan.pages[prefix // page_tokens] * page_tokens + (
                    prefix % page_tokens)
                if bool(torch.isin(read, written).any()):
                    raise ValueError(
                        f"chunk {number}: its prefix [0, {plan.start}) reads "
                        f"a cache slot another chunk of the batch writes")
        return plans


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Greedy choice: argmax over the last dimension, as int64.

    Ties go to the lowest index (``torch.argmax``'s rule).
    """
    return torch.argmax(logits, dim=-1).to(torch.int64)
