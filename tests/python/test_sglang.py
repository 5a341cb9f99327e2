"""kvtier.integrations.sglang.KvtierHiCacheStorage against SGLang's own
classes (the pinned sglang in build/venv): made by SGLang's dynamic backend
factory, moving pages of SGLang's real host pools (MHATokenToKVPoolHost,
MLATokenToKVPoolHost) built on CPU in every layout they offer, driven with
SGLang's own keys, configs and v2 transfer objects, against a real
kvtier-store. SGLang's scheduler and model runner are not run here
(docs/engines.md says why)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import BUILD, corrupt_in_store, engine_env

_why = BUILD / "venv.unavailable"
pytest.importorskip(
    "sglang.srt.mem_cache.hicache_storage",
    reason=(_why.read_text().strip() if _why.exists() else
            "SGLang is not installed (the project's Python environment is "
            "build/venv: scripts/setup_venv.sh)"))

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheStorage, PoolHitPolicy, PoolName, PoolTransfer)
from sglang.srt.mem_cache.utils import storage_namespace_seed  # noqa: E402

import sglang_pools as sp  # noqa: E402
from kvtier.errors import InvalidArgument  # noqa: E402
from kvtier.integrations.sglang import KvtierHiCacheStorage  # noqa: E402


@pytest.fixture(autouse=True)
def _server_args() -> None:
    """SGLang's scheduler publishes its server args before it makes the
    storage backend; so does every test here (the tiny Llama's)."""
    sp.publish_server_args()


def test_every_layout_round_trips_between_processes(store) -> None:
    """Another process writes pages of every pool kind and layout; this one
    reads them into pools of the same layout and of another, bit for bit,
    and through SGLang's legacy flat-page path too."""
    here = Path(__file__).parent
    env = engine_env()
    env["PYTHONPATH"] = f"{here}:{env['PYTHONPATH']}"
    out = subprocess.run([sys.executable, str(here / "sglang_pools.py"),
                          store.address, "11"], env=env, timeout=240,
                         capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), \
        out.stdout + out.stderr[-3000:]
    for i, (kind, layout) in enumerate(sp.CASES):
        src = sp.make_pool(kind, layout, 11)  # what the writer held
        others = [lo for k, lo in sp.CASES if k == kind]
        other = others[(others.index(layout) + 1) % len(others)]
        keys = sp.case_keys(kind, layout)
        for lo in (layout, other):
            dst = sp.make_pool(kind, lo, 20 + i)
            b = sp.attach(sp.storage_config(store.address,
                                            mla=kind == "mla"), dst)
            assert isinstance(b, HiCacheStorage)
            assert b.batch_exists(keys) == 4, (kind, layout)
            untouched = sp.rows(dst, 6)
            got = b.batch_get_v1(keys, sp.host_indices([0, 1, 2, 4, 6]))
            assert got == [True] * 4 + [False], (kind, layout, lo)
            for d, s in zip([0, 1, 2, 4], sp.WRITE_PAGES):
                assert sp.same_page(dst, d, src, s), (kind, layout, lo, d)
            assert all(torch.equal(a, c) for a, c in
                       zip(sp.rows(dst, 6), untouched)), "a miss is untouched"
            # SGLang's generic path: a flat page in the layout's order
            # (SGLang's MLA page_unified pool has no flat pages).
            if (kind, lo) != ("mla", "page_unified"):
                flat = dst.get_dummy_flat_data_page()
                assert b.get(keys[1], flat) is flat
                dst.set_from_flat_data_page(8 * sp.P, flat)
                assert sp.same_page(dst, 8, src, sp.WRITE_PAGES[1])
            b.close()


def test_legacy_flat_pages_and_zero_copy_share_blocks(store) -> None:
    """A page set through SGLang's flat-page path (``get_data_page``) reads
    back through the zero-copy path into a pool of another layout."""
    a_pool = sp.mha_pool("page_head", 1)
    b_pool = sp.mha_pool("page_first", 2)
    a = sp.attach(sp.storage_config(store.address), a_pool)
    b = sp.attach(sp.storage_config(store.address), b_pool)
    keys = sp.page_keys(list(range(3 * sp.P)))
    assert a.batch_set(keys, [a_pool.get_data_page(p * sp.P)
                              for p in (4, 2, 9)])
    assert b.batch_get_v1(keys, sp.host_indices([0, 1, 2])) == [True] * 3
    for d, s in zip([0, 1, 2], [4, 2, 9]):
        assert sp.same_page(b_pool, d, a_pool, s)
    a.close()
    b.close()


def test_mla_is_stored_once_for_every_tp_rank(store) -> None:
    """MLA pages are the same on every TP rank: rank 0 writes, rank 1 reads.
    MHA pages are a rank's own heads: rank 1 finds none of rank 0's."""
    keys = sp.page_keys(list(range(7, 7 + 2 * sp.P)))
    w = sp.attach(sp.storage_config(store.address, mla=True, tp=(0, 2)),
                  sp.mla_pool("page_first", 3))
    r = sp.attach(sp.storage_config(store.address, mla=True, tp=(1, 2)),
                  sp.mla_pool("layer_first", 4))
    assert w.batch_set_v1(keys, sp.host_indices([1, 2])) == [True, True]
    assert r.batch_exists(keys) == 2
    mw = sp.attach(sp.storage_config(store.address, tp=(0, 2)),
                   sp.mha_pool("layer_first", 5))
    mr = sp.attach(sp.storage_config(store.address, tp=(1, 2)),
                   sp.mha_pool("layer_first", 6))
    assert mw.batch_set_v1(keys, sp.host_indices([1, 2])) == [True, True]
    assert mr.batch_exists(keys) == 0
    for x in (w, r, mw, mr):
        x.close()


def test_the_namespace_follows_every_rank_and_shape_that_changes_the_bytes(
        store) -> None:
    keys = sp.page_keys(list(range(50, 50 + 2 * sp.P)))
    base = sp.attach(sp.storage_config(store.address),
                     sp.mha_pool("layer_first", 7))
    assert base.batch_set_v1(keys, sp.host_indices([0, 1])) == [True] * 2
    same = sp.attach(sp.storage_config(store.address),
                     sp.mha_pool("page_head", 8))
    assert same.batch_exists(keys) == 2, "the host layout is not a rank"
    dp = sp.attach(sp.storage_config(store.address), sp.mha_pool(
        "layer_first", 8))
    dp.config.dp_rank = 3
    assert dp.batch_exists(keys) == 2, "data-parallel replicas share"
    others = {
        "pipeline stage": sp.storage_config(store.address, pp=(1, 2)),
        "attention CP rank": sp.storage_config(store.address, cp=(1, 2)),
        "model": sp.storage_config(store.address, model="other/model"),
    }
    for what, cfg in others.items():
        b = sp.attach(cfg, sp.mha_pool("layer_first", 9))
        assert b.batch_exists(keys) == 0, what
        b.close()
    for what, pool in {
            "V head size": sp.mha_pool("layer_first", 9, v_head_dim=16),
            "dtype": sp.mha_pool("layer_first", 9, dtype=torch.bfloat16),
            "layers (packed draft layers)": sp.mha_pool("layer_first", 9,
                                                        layers=3)}.items():
        b = sp.attach(sp.storage_config(store.address), pool)
        assert b.batch_exists(keys) == 0, what
        b.close()
    for x in (base, same, dp):
        x.close()


@pytest.mark.parametrize("field, args", [
    ("weights (a pinned revision)", {"revision": "0123abcd"}),
    ("weights (dummy weights from another seed)",
     {"load_format": "dummy", "random_seed": 3}),
    ("model config (RoPE theta)",
     {"json_model_override_args": '{"rope_theta": 1000000}'}),
    ("RoPE scaling", {"json_model_override_args":
                      '{"rope_scaling": {"rope_type": "linear", '
                      '"factor": 2.0}}'}),
    ("sliding window", {"json_model_override_args":
                        '{"sliding_window": 32, "use_sliding_window": true}'}),
    ("quantization", {"quantization": "fp8"}),
    ("KV dtype and its scales", {"kv_cache_dtype": "fp8_e4m3"}),
    ("compute dtype", {"dtype": "float16"}),
])
def test_an_identity_field_keeps_sglang_deployments_apart(
        store, field: str, args: dict) -> None:
    """The identity table every kvtier adapter fills (kvtier.identity),
    read from the server args SGLang's scheduler publishes: a deployment
    that differs in one field finds nothing another stored, though the
    model name, ranks and pool are the same."""
    keys = sp.page_keys(list(range(700, 700 + 2 * sp.P)))
    sp.publish_server_args()
    base = sp.attach(sp.storage_config(store.address),
                     sp.mha_pool("layer_first", 1))
    assert base.batch_set_v1(keys, sp.host_indices([0, 1])) == [True] * 2
    sp.publish_server_args(**args)
    other = sp.attach(sp.storage_config(store.address),
                      sp.mha_pool("layer_first", 2))
    assert other.batch_exists(keys) == 0, field
    base.close()
    other.close()


def test_what_changes_no_kv_byte_keeps_sglang_deployments_sharing(
        store) -> None:
    """Context length and scheduling options change no KV byte: such
    deployments share every block. Without published server args the
    backend is refused, naming what it needs, not keyed on a guess."""
    keys = sp.page_keys(list(range(800, 800 + 2 * sp.P)))
    sp.publish_server_args()
    base = sp.attach(sp.storage_config(store.address),
                     sp.mha_pool("layer_first", 1))
    assert base.batch_set_v1(keys, sp.host_indices([0, 1])) == [True] * 2
    sp.publish_server_args(context_length=64, chunked_prefill_size=128,
                           max_running_requests=7)
    other = sp.attach(sp.storage_config(store.address),
                      sp.mha_pool("page_head", 2))
    assert other.batch_exists(keys) == 2
    assert other.batch_get_v1(keys, sp.host_indices([4, 5])) == [True] * 2
    assert sp.same_page(other.mem_pool_host, 4, base.mem_pool_host, 0)
    base.close()
    other.close()
    here = Path(__file__).parent
    env = engine_env()
    env["PYTHONPATH"] = f"{here}:{env['PYTHONPATH']}"
    code = ("import sglang_pools as sp\n"
            "from kvtier.errors import InvalidArgument\n"
            "try:\n"
            f"    sp.attach(sp.storage_config({store.address!r}),\n"
            "              sp.mha_pool('layer_first', 3))\n"
            "except InvalidArgument as e:\n"
            "    print('refused:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, timeout=240,
                         capture_output=True, text=True)
    assert "refused: " in out.stdout and "no server args" in out.stdout, \
        out.stdout + out.stderr[-3000:]


def test_asymmetric_kv_head_sizes_round_trip(store) -> None:
    a_pool = sp.mha_pool("page_first_direct", 1, v_head_dim=16)
    b_pool = sp.mha_pool("layer_first", 2, v_head_dim=16)
    a = sp.attach(sp.storage_config(store.address), a_pool)
    b = sp.attach(sp.storage_config(store.address), b_pool)
    keys = sp.page_keys(list(range(90, 90 + 2 * sp.P)))
    assert a.batch_set_v1(keys, sp.host_indices([5, 6])) == [True] * 2
    assert b.batch_get_v1(keys, sp.host_indices([1, 0])) == [True] * 2
    assert sp.same_page(b_pool, 1, a_pool, 5)
    assert sp.same_page(b_pool, 0, a_pool, 6)
    a.close()
    b.close()


def test_tenant_salts_keep_tenants_apart(store) -> None:
    """SGLang seeds a request's chain with its extra_key / cache_salt; the
    same tokens of another tenant are other keys, a miss."""
    tokens = list(range(300, 300 + 2 * sp.P))
    a_keys = sp.page_keys(tokens, storage_namespace_seed(None, "tenant-a"))
    b_keys = sp.page_keys(tokens, storage_namespace_seed(None, "tenant-b"))
    b = sp.attach(sp.storage_config(store.address),
                  sp.mha_pool("layer_first", 1))
    assert b.batch_set_v1(a_keys, sp.host_indices([0, 1])) == [True] * 2
    assert b.batch_exists(a_keys) == 2
    assert b.batch_exists(b_keys) == 0
    assert b.batch_exists(sp.page_keys(tokens)) == 0
    b.close()


def test_hybrid_pools_through_the_v2_hooks(store) -> None:
    """Draft and sliding-window pools registered through
    register_mem_host_pool_v2 live in namespaces of their own; SGLang's
    PoolTransfer objects move their pages, and batch_exists_v2 applies
    each pool's hit policy."""
    kv, draft, swa = (sp.mha_pool("layer_first", 1),
                      sp.mha_pool("page_first", 2, layers=1),
                      sp.mha_pool("page_head", 3))
    a = sp.attach(sp.storage_config(store.address), kv)
    a.register_mem_host_pool_v2(draft, PoolName.DRAFT)
    a.register_mem_host_pool_v2(swa, PoolName.SWA)
    keys = sp.page_keys(list(range(500, 500 + 4 * sp.P)))
    idx = sp.host_indices([0, 1, 2, 3])
    assert a.batch_set_v1(keys, idx) == [True] * 4
    out = a.batch_set_v2([
        PoolTransfer(name=PoolName.DRAFT, host_indices=idx[:3 * sp.P],
                     keys=keys[:3]),
        PoolTransfer(name=PoolName.SWA, host_indices=sp.host_indices([2, 3]),
                     keys=keys[2:])])
    assert out == {"draft": [True] * 3, "swa": [True] * 2}
    assert a.batch_exists(keys) == 4

    def exists(*transfers: PoolTransfer) -> tuple[int, dict]:
        r = a.batch_exists_v2(keys, list(transfers))
        return r.kv_hit_pages, dict(r.extra_pool_hit_pages)

    assert exists() == (4, {"kv": 4})
    # Every page needs its draft page: the prefix stops at the draft's 3.
    assert exists(PoolTransfer(name=PoolName.DRAFT, keys=keys)) == \
        (3, {"kv": 4, "draft": 3})
    # The window needs only the trailing pages: 4 pages hit with 2.
    assert exists(PoolTransfer(name=PoolName.SWA, keys=keys[:2],
                               hit_policy=PoolHitPolicy.TRAILING_PAGES)) == \
        (4, {"kv": 4, "swa": 4})
    # A pool nobody registered holds nothing.
    assert exists(PoolTransfer(name=PoolName.INDEXER, keys=keys))[0] == 0

    b_kv, b_draft = sp.mha_pool("layer_first", 4), sp.mha_pool(
        "page_head", 5, layers=1)
    b = sp.attach(sp.storage_config(store.address), b_kv)
    b.register_mem_host_pool_v2(b_draft, PoolName.DRAFT)
    got = b.batch_get_v2([PoolTransfer(
        name=PoolName.DRAFT, host_indices=sp.host_indices([7, 8, 9, 10]),
        keys=keys)])
    assert got == {"draft": [True] * 3 + [False]}
    for d, s in zip([7, 8, 9], [0, 1, 2]):
        assert sp.same_page(b_draft, d, draft, s)
    assert b.batch_get_v2([PoolTransfer(
        name=PoolName.SWA, host_indices=sp.host_indices([1]),
        keys=keys[:1])]) == {"swa": [False]}, "not registered here"
    a.close()
    b.close()


def test_unsupported_pools_and_hooks_are_refused_at_registration(
        store) -> None:
    cfg = sp.storage_config(store.address)
    with pytest.raises(InvalidArgument, match='layout "page_unified"'):
        sp.attach(cfg, sp.mha_pool("page_unified", 1))
    b = sp.attach(cfg, sp.mha_pool("layer_first", 1))
    with pytest.raises(InvalidArgument, match="mamba.*not one kvtier"):
        b.register_mem_host_pool_v2(object(), PoolName.MAMBA)
    split = sp.storage_config(store.address)
    split.should_split_heads = True
    with pytest.raises(InvalidArgument, match="should_split_heads"):
        KvtierHiCacheStorage(split, {})
    with pytest.raises(ValueError, match="stores"):
        KvtierHiCacheStorage(sp.storage_config(""), {})
    b.close()


@pytest.mark.parametrize("field, value, says", [
    ("model_name", None, "model_name"),
    ("model_name", "  ", "model_name"),
    ("tp_rank", None, "tp_rank"),
    ("tp_rank", 2, "tp_rank = 2 is not a rank of tp_size = 2"),
    ("pp_size", "1", "pp_size"),
    ("attn_cp_rank", True, "attn_cp_rank"),
])
def test_an_identity_sglang_does_not_give_is_refused_not_guessed(
        store, field: str, value: object, says: str) -> None:
    """Two ranks or two models of equal geometry must never share blocks:
    a rank or model name the backend cannot read is refused at
    registration, naming the field, instead of defaulting to rank 0 or a
    constant model name."""
    cfg = sp.storage_config(store.address, tp=(0, 2))
    setattr(cfg, field, value)
    with pytest.raises(InvalidArgument, match=says):
        sp.attach(cfg, sp.mha_pool("layer_first", 1))


def test_a_corrupt_block_is_a_miss_and_bad_input_fails_softly(store) -> None:
    a_pool, b_pool = sp.mha_pool("layer_first", 5), sp.mha_pool(
        "layer_first", 6)
    a = sp.attach(sp.storage_config(store.address), a_pool)
    b = sp.attach(sp.storage_config(store.address), b_pool)
    keys = sp.page_keys(list(range(700, 700 + 3 * sp.P)))
    assert a.batch_set_v1(keys, sp.host_indices([0, 1, 2])) == [True] * 3
    needle = sp.rows(a_pool, 1)[0].numpy().tobytes()  # layer 0 K of page 1
    assert corrupt_in_store(store.pid, needle)
    # A load is verified as a whole: one bad block fails it, and SGLang
    # recomputes every page of it.
    assert b.batch_get_v1(keys, sp.host_indices([4, 5, 6])) == [False] * 3
    target = b_pool.get_dummy_flat_data_page()
    assert b.batch_get(keys, [target] * 3)[1] is None
    # Bad input: False entries, no exception (SGLang's threads would die).
    assert b.batch_get_v1(keys[:1], torch.arange(3, 3 + sp.P)) == [False]
    assert b.batch_set_v1(keys[:2], sp.host_indices([0])) == [False, False]
    assert b.batch_set_v1(keys[:1], sp.host_indices([10_000])) == [False]
    assert not b.set("abc", torch.zeros(3, dtype=torch.float16))
    assert b.get_stats()["write_failures"] == 4
    for x in (a, b):
        x.close()


def test_an_unknown_store_finds_nothing_and_saves_nothing() -> None:
    b = sp.attach(sp.storage_config("127.0.0.1:1", deadline_ms=500),
                  sp.mha_pool("layer_first", 8))
    keys = sp.page_keys(list(range(2 * sp.P)))
    assert b.batch_exists(keys) == 0
    assert b.batch_set_v1(keys, sp.host_indices([0, 1])) == [False, False]
    assert b.batch_get_v1(keys, sp.host_indices([0, 1])) == [False, False]
    b.close()
