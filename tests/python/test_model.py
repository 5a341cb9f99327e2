"""Tests of kvtier's reference engine model (kvtier.engine.model).

Run: PYTHONPATH=python python3 -m pytest tests/python/test_model.py -q
(a Python with torch). Small configurations only; the whole file takes seconds.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch

from kvtier.engine.model import (
    ModelConfig,
    PagedKvCache,
    SeqChunk,
    Transformer,
    greedy,
)

CONFIG = ModelConfig(vocab_size=512, hidden=64, layers=2, heads=4, kv_heads=2,
                     head_dim=16, ffn=128, seed=0)
PAGE_TOKENS = 16
NUM_PAGES = 32


@pytest.fixture(scope="module")
def model() -> Transformer:
    """One model shared by the tests that do not build their own."""
    torch.set_num_threads(2)
    return Transformer(CONFIG)


def prompt(length: int, seed: int = 1) -> torch.Tensor:
    """Deterministic random token ids."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, CONFIG.vocab_size, (length,), generator=generator)


def scattered_pages(count: int, seed: int = 2) -> torch.Tensor:
    """``count`` distinct page ids in a shuffled (non-contiguous) order."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(NUM_PAGES, generator=generator)[:count]


def make_cache(layout: str = "kv_first",
               dtype: torch.dtype = torch.float16) -> PagedKvCache:
    """A zeroed cache matching CONFIG."""
    return PagedKvCache(CONFIG, NUM_PAGES, PAGE_TOKENS, dtype=dtype,
                        layout=layout)


def prefill(model: Transformer, cache: PagedKvCache, tokens: torch.Tensor,
            table: torch.Tensor, chunk: int, start: int = 0) -> torch.Tensor:
    """Feed ``tokens`` (from position ``start``) in chunks; last logits."""
    logits = torch.empty(0)
    for offset in range(0, tokens.numel(), chunk):
        piece = tokens[offset:offset + chunk]
        logits = model([SeqChunk(piece, start + offset, table)], cache)[0]
    return logits


def test_cache_layouts_and_views() -> None:
    for layout, shape in (("kv_first", (2, 4, 8, 2, 16)),
                          ("blocks_first", (4, 2, 8, 2, 16))):
        cache = PagedKvCache(CONFIG, 4, 8, layout=layout)
        assert len(cache.tensors) == CONFIG.layers
        assert all(t.shape == shape and t.dtype == torch.float16
                   and not t.any() for t in cache.tensors)
        assert cache.key(1).shape == (4, 8, 2, 16)
        cache.key(1)[3, 5] = 1.0
        cache.value(1)[2, 7] = 2.0
        tensor = cache.tensors[1]
        k_page = tensor[0, 3] if layout == "kv_first" else tensor[3, 0]
        v_page = tensor[1, 2] if layout == "kv_first" else tensor[2, 1]
        assert (k_page[5] == 1).all() and (v_page[7] == 2).all()
        assert cache.page_bytes() == 8 * 2 * 16 * 2
    assert PagedKvCache(CONFIG, 4, 8, dtype=torch.bfloat16).page_bytes() == 512
    with pytest.raises(ValueError, match="layout"):
        PagedKvCache(CONFIG, 4, 8, layout="heads_first")
    with pytest.raises(ValueError, match="dtype"):
        PagedKvCache(CONFIG, 4, 8, dtype=torch.int8)


def test_config_validation() -> None:
    ModelConfig().validate()
    with pytest.raises(ValueError, match="kv_heads"):
        ModelConfig(heads=4, kv_heads=3).validate()
    with pytest.raises(ValueError, match="head_dim"):
        ModelConfig(head_dim=31).validate()
    with pytest.raises(ValueError, match="hidden"):
        Transformer(ModelConfig(hidden=0))
    with pytest.raises(ValueError, match="eps"):
        ModelConfig(eps=0.0).validate()


def reference_logits(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    """Last-token logits written out directly from the documented contract.

    No cache (float32 keys and values), whole-sequence attention with an
    explicit causal mask, query head h reading kv head h // group, rotate-half
    RoPE with pair (i, i + head_dim / 2) rotated by pos * theta^(-2i/head_dim).
    """
    config = model.config
    n, dim, half = tokens.numel(), config.head_dim, config.head_dim // 2
    group = config.heads // config.kv_heads

    def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        rms = torch.sqrt((x * x).mean(-1, keepdim=True) + config.eps)
        return x / rms * weight

    def rope(x: torch.Tensor) -> torch.Tensor:
        out = x.clone()
        for i in range(half):
            angle = torch.arange(n, dtype=torch.float64) * (
                config.rope_theta ** (-2.0 * i / dim))
            cos = angle.cos().float()[:, None]
            sin = angle.sin().float()[:, None]
            a, b = x[:, :, i], x[:, :, i + half]
            out[:, :, i] = a * cos - b * sin
            out[:, :, i + half] = b * cos + a * sin
        return out

    x = model.embedding[tokens]
    allowed = torch.ones(n, n, dtype=torch.bool).tril()
    for layer in model.layers:
        h = norm(x, layer.attn_norm)
        q = rope((h @ layer.wq).view(n, config.heads, dim))
        k = rope((h @ layer.wk).view(n, config.kv_heads, dim))
        v = (h @ layer.wv).view(n, config.kv_heads, dim)
        heads = []
        for head in range(config.heads):
            kv = head // group
            scores = q[:, head] @ k[:, kv].T / dim ** 0.5
            scores = scores.masked_fill(~allowed, float("-inf"))
            heads.append(torch.softmax(scores, -1) @ v[:, kv])
        x = x + torch.cat(heads, dim=-1) @ layer.wo
        h = norm(x, layer.ffn_norm)
        x = x + (torch.nn.functional.silu(h @ layer.w_gate) * (h @ layer.w_up)
                 ) @ layer.w_down
    return norm(x[-1], model.final_norm) @ model.lm_head


def test_matches_direct_reference(model: Transformer) -> None:
    tokens = prompt(50)
    cache = make_cache(dtype=torch.float32)
    logits = prefill(model, cache, tokens, scattered_pages(4), chunk=20)
    torch.testing.assert_close(logits, reference_logits(model, tokens),
                               atol=1e-4, rtol=1e-4)
    # A float16 cache rounds K and V, which moves the logits only a little.
    half = prefill(model, make_cache(), tokens, scattered_pages(4), chunk=50)
    torch.testing.assert_close(half, logits, atol=5e-2, rtol=0)


@pytest.mark.parametrize("chunk", [7, 30, 63])
def test_chunked_prefill_matches_single_chunk(model: Transformer,
                                              chunk: int) -> None:
    tokens = prompt(100)
    table = scattered_pages(7)
    whole_cache = make_cache()
    whole = prefill(model, whole_cache, tokens, table, chunk=100)
    chunked_cache = make_cache()
    chunked = prefill(model, chunked_cache, tokens, table, chunk=chunk)
    assert whole.shape == (CONFIG.vocab_size,) and whole.dtype == torch.float32
    assert torch.isfinite(whole).all()
    torch.testing.assert_close(chunked, whole, atol=1e-4, rtol=1e-4)
    for ours, theirs in zip(chunked_cache.tensors, whole_cache.tensors):
        # One float16 ulp at |x| in [2, 4) is 2e-3, hence the rtol.
        torch.testing.assert_close(ours.float(), theirs.float(),
                                   atol=1e-3, rtol=1e-3)
    # Only the table's pages were written; every position of them is filled.
    unused = torch.ones(NUM_PAGES, dtype=torch.bool)
    unused[table] = False
    assert not whole_cache.tensors[0][:, unused].any()
    assert whole_cache.key(0)[table[6], 100 - 6 * PAGE_TOKENS - 1].any()


def test_prefix_loaded_from_elsewhere_computes_the_same(
        model: Transformer) -> None:
    tokens = prompt(80)
    table = scattered_pages(5)
    source = make_cache()
    expected = prefill(model, source, tokens, table, chunk=80)

    # Copy the first 3 pages (48 positions) into other pages of another cache,
    # then compute only the rest: the logits must not change.
    other_table = scattered_pages(5, seed=9)
    target = make_cache()
    for layer in range(CONFIG.layers):
        target.key(layer)[other_table[:3]] = source.key(layer)[table[:3]]
        target.value(layer)[other_table[:3]] = source.value(layer)[table[:3]]
    resumed = prefill(model, target, tokens[48:], other_table, chunk=32,
                      start=48)
    # Other chunk sizes round fp32 matmuls differently (BLAS kernels).
    torch.testing.assert_close(resumed, expected, atol=1e-4, rtol=1e-4)

    # Attention reads the prefix from the cache: damaging it shows.
    target.value(1)[other_table[0]] += 1.0
    damaged = prefill(model, target, tokens[48:], other_table, chunk=32,
                      start=48)
    assert not torch.allclose(damaged, expected, atol=1e-3)


def test_query_blocks_do_not_change_the_result(
        model: Transformer, monkeypatch: pytest.MonkeyPatch) -> None:
    import kvtier.engine.model as module

    tokens = prompt(100)
    table = scattered_pages(7)
    expected = prefill(model, make_cache(), tokens, table, chunk=60)
    # A budget this small splits each chunk's queries into blocks of 1-3 rows.
    monkeypatch.setattr(module, "_SCORE_BUDGET", 4 * 100 * 3)
    blocked = prefill(model, make_cache(), tokens, table, chunk=60)
    torch.testing.assert_close(blocked, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_layouts_give_identical_logits(model: Transformer,
                                       dtype: torch.dtype) -> None:
    tokens = prompt(70)
    table = scattered_pages(5)
    first = make_cache("kv_first", dtype)
    blocks = make_cache("blocks_first", dtype)
    a = prefill(model, first, tokens, table, chunk=40)
    b = prefill(model, blocks, tokens, table, chunk=40)
    assert torch.equal(a, b)
    for layer in range(CONFIG.layers):
        assert torch.equal(first.key(layer), blocks.key(layer))
        assert torch.equal(first.value(layer), blocks.value(layer))


def test_batching_matches_running_alone(model: Transformer) -> None:
    tokens_a, tokens_b = prompt(45, seed=3), prompt(90, seed=4)
    pages = scattered_pages(9)
    table_a, table_b = pages[:3], pages[3:]

    # Sequence b has its first 40 positions in the cache already.
    alone_cache = make_cache()
    prefill(model, alone_cache, tokens_b[:40], table_b, chunk=40)
    batch_cache = make_cache()
    batch_cache.tensors = [t.clone() for t in alone_cache.tensors]

    alone_a = model([SeqChunk(tokens_a, 0, table_a)], alone_cache)
    alone_b = model([SeqChunk(tokens_b[40:], 40, table_b)], alone_cache)
    together = model([SeqChunk(tokens_a, 0, table_a),
                      SeqChunk(tokens_b[40:], 40, table_b)], batch_cache)
    assert together.shape == (2, CONFIG.vocab_size)
    torch.testing.assert_close(together[0], alone_a[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(together[1], alone_b[0], atol=1e-5, rtol=1e-5)
    for ours, theirs in zip(batch_cache.tensors, alone_cache.tensors):
        torch.testing.assert_close(ours.float(), theirs.float(),
                                   atol=1e-3, rtol=1e-3)


def decode(model: Transformer, steps: int) -> tuple[list[int], torch.Tensor]:
    """Prefill a 20-token prompt, then greedily decode ``steps`` tokens."""
    tokens = prompt(20)
    table = scattered_pages(3)
    cache = make_cache()
    logits = model([SeqChunk(tokens, 0, table)], cache)
    produced: list[int] = []
    history = [logits]
    for step in range(steps):
        token = greedy(logits)
        assert token.dtype == torch.int64 and token.shape == (1,)
        produced.append(int(token))
        logits = model([SeqChunk(token, 20 + step, table)], cache)
        history.append(logits)
    return produced, torch.cat(history)


def test_greedy_decode_is_deterministic_and_seeded() -> None:
    first = Transformer(CONFIG)
    second = Transformer(CONFIG)
    tokens_1, logits_1 = decode(first, 5)
    tokens_2, logits_2 = decode(second, 5)
    assert len(tokens_1) == 5
    assert tokens_1 == tokens_2
    assert torch.equal(logits_1, logits_2)

    reseeded = Transformer(ModelConfig(**{**CONFIG.__dict__, "seed": 1}))
    assert not torch.equal(reseeded.embedding, first.embedding)
    assert not torch.equal(reseeded.layers[0].wq, first.layers[0].wq)
    _, logits_3 = decode(reseeded, 5)
    assert not torch.allclose(logits_3, logits_1)

    assert torch.equal(greedy(torch.tensor([[0.0, 3.0, 3.0, 1.0]])),
                       torch.tensor([1]))


def test_invalid_inputs_raise_before_touching_the_cache(
        model: Transformer) -> None:
    cache = make_cache()
    calls: list[int] = []
    tokens = prompt(20)

    def run(chunks: list[SeqChunk]) -> None:
        model(chunks, cache, before_layer=calls.append)

    with pytest.raises(ValueError, match="page id 32"):
        run([SeqChunk(tokens, 0, torch.tensor([0, NUM_PAGES]))])
    with pytest.raises(ValueError, match="page id -1"):
        run([SeqChunk(tokens, 0, torch.tensor([-1, 1]))])
    with pytest.raises(ValueError, match="page_table has 1 entries"):
        run([SeqChunk(tokens, 0, torch.tensor([0]))])
    with pytest.raises(ValueError, match="page_table has 2 entries"):
        run([SeqChunk(tokens, 20, torch.tensor([0, 1]))])
    with pytest.raises(ValueError, match="token id 512"):
        bad = tokens.clone()
        bad[7] = CONFIG.vocab_size
        run([SeqChunk(bad, 0, torch.tensor([0, 1]))])
    with pytest.raises(ValueError, match="token id -3"):
        bad = tokens.clone()
        bad[0] = -3
        run([SeqChunk(bad, 0, torch.tensor([0, 1]))])
    with pytest.raises(ValueError, match="empty"):
        run([SeqChunk(tokens[:0], 0, torch.tensor([0]))])
    with pytest.raises(ValueError, match="more than once"):
        run([SeqChunk(tokens, 0, torch.tensor([4, 4]))])
    with pytest.raises(ValueError, match="same cache slot"):
        run([SeqChunk(tokens, 0, torch.tensor([0, 1])),
             SeqChunk(tokens, 0, torch.tensor([1, 2]))])
    with pytest.raises(ValueError, match="at least one chunk"):
        run([])
    assert calls == []
    assert not any(t.any() for t in cache.tensors)

    # Unread padding past the needed entries is allowed.
    model([SeqChunk(tokens, 0, torch.tensor([0, 1, -1, -1]))], cache)


def test_layer_hooks_called_once_per_layer_in_order() -> None:
    config = ModelConfig(vocab_size=64, hidden=32, layers=3, heads=2,
                         kv_heads=1, head_dim=16, ffn=64)
    model = Transformer(config)
    cache = PagedKvCache(config, 4, 8)
    events: list[tuple[str, int, bool]] = []

    def hook(name: str) -> Callable[[int], None]:
        def record(layer: int) -> None:
            events.append((name, layer, bool(cache.tensors[layer].any())))
        return record

    model([SeqChunk(torch.arange(10), 0, torch.tensor([2, 0]))], cache,
          before_layer=hook("before"), after_layer=hook("after"))
    # Layer l's KV is not written yet at before_layer(l); it is at
    # after_layer(l).
    assert events == [("before", 0, False), ("after", 0, True),
                      ("before", 1, False), ("after", 1, True),
                      ("before", 2, False), ("after", 2, True)]
