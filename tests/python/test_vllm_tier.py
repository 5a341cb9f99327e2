"""kvtier as a secondary tier of vLLM's own offloading
(kvtier.integrations.vllm_tier.KvtierTier), loaded by vLLM's real factory
from its --kv-transfer-config entry and driven through vLLM's real
TieringOffloadingManager, CPU primary tier and shared region
(vllm_tier_harness.py; vLLM's offloading worker needs CUDA and is the one
part not run). Engine A stores in its own process; engine B, warmed only
through the store, promotes A's rows bit-exactly. A corrupted row is never
a hit; a store that is down or killed is a miss and the tier keeps serving;
a malformed tier configuration is refused with a message naming the key."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import BUILD, Store, corrupt_in_store, engine_env

_why = BUILD / "venv.unavailable"
pytest.importorskip(
    "vllm", reason=(_why.read_text().strip() if _why.exists() else
                    "vLLM is not installed (make test installs it into "
                    "build/venv: scripts/setup_venv.sh)"))

import kvtier  # noqa: E402
from kvtier.integrations.vllm_tier import key_hashes  # noqa: E402
from kvtier.integrations.vllm_tier_handoff import pd_role  # noqa: E402
from vllm_tier_harness import (TierEngine, kvtier_tier,  # noqa: E402
                               offload_keys, row_bytes)

HERE = Path(__file__).parent


def stored_once_the_store_answers(e: TierEngine, keys: list[bytes],
                                  seed: int, timeout: float = 30) -> None:
    """Stores and promotes ``keys`` until the store holds them: a client
    backs off (up to 5 s) after a store went away, then reconnects."""
    import time
    deadline = time.monotonic() + timeout
    while True:
        e.store(keys, seed)
        e.forget()
        got, _ = e.load(keys)
        if all(g == row_bytes(seed, i).tobytes() for i, g in enumerate(got)):
            return
        assert all(g is None for g in got), "a row came back wrong"
        assert time.monotonic() < deadline, "the tier never used the store"
        time.sleep(0.5)


def run_engine_a(store: Store, seed: int, keys: int) -> dict:
    """Engine A in a process of its own: stores ``keys`` rows."""
    env = engine_env()
    env["PYTHONPATH"] += ":" + str(HERE)
    out = subprocess.run(
        [sys.executable, str(HERE / "vllm_tier_harness.py"),
         f"--stores={store.address}", f"--seed={seed}", f"--keys={keys}"],
        capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_engine_b_promotes_engine_a_rows(store: Store) -> None:
    a = run_engine_a(store, seed=7, keys=12)
    # A's manager reported its stored rows in vLLM's event stream: STORAGE,
    # REMOTE (the primary tier's CPU events come first).
    assert ["STORAGE", False, "REMOTE", 12] in a["events"]
    b = TierEngine(kvtier_tier(store.address))
    try:
        assert f"{b.tier.namespace.id:016x}" == a["namespace"]
        keys = offload_keys(7, 12)
        got, _ = b.load(keys)
        assert all(g is not None for g in got)  # 100 % of A's rows hit
        for i, g in enumerate(got):
            assert g == row_bytes(7, i).tobytes()
        # Unknown keys miss.
        got, _ = b.load(offload_keys(8, 3))
        assert got == [None, None, None]
    finally:
        b.close()


def test_a_corrupted_row_is_never_a_hit(store: Store) -> None:
    run_engine_a(store, seed=11, keys=4)
    keys = offload_keys(11, 4)
    assert corrupt_in_store(store.pid, row_bytes(11, 2).tobytes()[4096:4160])
    b = TierEngine(kvtier_tier(store.address))
    try:
        got, _ = b.load(keys)
        # The promotion failed its checksum: it fails whole (vLLM's load
        # job), so no key of it is a hit and nothing corrupt was read.
        assert got == [None] * 4
        # Asked again, the rows before the corrupt one load, byte-exact;
        # the corrupt row and the rows chained after it miss.
        again, _ = b.load(keys)
        assert again == [row_bytes(11, 0).tobytes(), row_bytes(11, 1).tobytes(),
                         None, None]
        # The store dropped its corrupt copy.
        client = kvtier.StoreClient([store.address])
        assert client.lookup(b.tier.namespace, key_hashes(keys[2:3])) == 0
    finally:
        b.close()


def test_the_store_killed_and_back(tmp_path: Path) -> None:
    store = Store(tmp_path, "tier-store")
    port = int(store.address.rsplit(":", 1)[1])
    e = TierEngine(kvtier_tier(store.address, deadline_ms=2000))
    try:
        keys = offload_keys(21, 4)
        e.store(keys, 21)
        store.kill()
        e.forget()
        got, _ = e.load(keys)          # the store is gone: misses
        assert got == [None] * 4
        e.store(offload_keys(22, 4), 22)  # fails, finishes, keeps serving
        store = Store(tmp_path, "tier-store-2", port=port)
        stored_once_the_store_answers(e, offload_keys(23, 4), 23)
    finally:
        e.close()
        store.stop()


def test_a_store_down_at_start_up(tmp_path: Path) -> None:
    port_probe = Store(tmp_path, "probe")
    port = int(port_probe.address.rsplit(":", 1)[1])
    port_probe.stop()
    e = TierEngine(kvtier_tier(f"127.0.0.1:{port}", deadline_ms=2000))
    store = None
    try:
        got, _ = e.load(offload_keys(31, 2))
        assert got == [None, None]
        store = Store(tmp_path, "late", port=port)
        stored_once_the_store_answers(e, offload_keys(32, 3), 32)
    finally:
        e.close()
        if store is not None:
            store.stop()


@pytest.mark.parametrize("entry, key", [
    ({"stores": "127.0.0.1:1", "io_thread": 2}, "io_thread"),
    ({"stores": "127.0.0.1:1", "io_threads": 0}, "io_threads"),
    ({"stores": "127.0.0.1:1", "locality": "NEAR"}, "locality"),
    ({"stores": "127.0.0.1:1", "enable_kv_events": "yes"},
     "enable_kv_events"),
    ({"stores": "127.0.0.1:1", "deadline_ms": "soon"}, "deadline_ms"),
    ({"stores": "127.0.0.1:1", "handoff_wait_ms": 0}, "handoff_wait_ms"),
    ({"stores": "127.0.0.1:1", "handoff_wait_ms": 600001}, "handoff_wait_ms"),
    ({}, '"stores" names no kvtier-store'),
])
def test_a_malformed_tier_config_names_the_key(entry: dict, key: str) -> None:
    tier = {"type": "KvtierTier",
            "module_path": "kvtier.integrations.vllm_tier", **entry}
    with pytest.raises(kvtier.errors.InvalidArgument, match=key) as e:
        TierEngine(tier)
    if key.startswith('"stores"'):
        assert "deadline_ms" not in str(e.value)


def test_the_namespace_binds_the_row_layout(store: Store) -> None:
    ids = set()
    for kw in ({}, {"tp_size": 2}, {"blocks_per_chunk": 2},
               {"row": 128 * 1024}):
        e = TierEngine(kvtier_tier(store.address), **kw)
        try:
            ids.add(e.tier.namespace.id)
            assert "vllm-offload-row=" in e.tier.namespace.layout
        finally:
            e.close()
    assert len(ids) == 4


def test_a_shared_tier_refuses_block_hashes_no_other_engine_can_match(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM seeds xxhash block hashes at random per process unless
    PYTHONHASHSEED is set: a REMOTE tier (a store shared by engines) would
    then never share a row, silently. Refused at start-up, naming
    PYTHONHASHSEED; a LOCAL tier, a set PYTHONHASHSEED or sha256 is
    served."""
    from vllm.config import VllmConfig, set_current_vllm_config
    cfg = VllmConfig()
    cfg.cache_config.prefix_caching_hash_algo = "xxhash"
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with set_current_vllm_config(cfg):
        with pytest.raises(kvtier.errors.InvalidArgument,
                           match="PYTHONHASHSEED"):
            TierEngine(kvtier_tier(store.address))
        TierEngine(kvtier_tier(store.address, locality="LOCAL")).close()
        monkeypatch.setenv("PYTHONHASHSEED", "0")
        TierEngine(kvtier_tier(store.address)).close()
        monkeypatch.delenv("PYTHONHASHSEED")
        cfg.cache_config.prefix_caching_hash_algo = "sha256"
        TierEngine(kvtier_tier(store.address)).close()


def test_store_jobs_past_the_bound_fail_at_once_and_lookups_keep_a_budget(
        store: Store) -> None:
    """With the store SIGSTOPped, store jobs beyond ``max_queued_stores``
    fail at once instead of queueing without bound (their rows stay in
    vLLM's CPU tier), and a lookup answers within ``lookup_budget_ms``
    (a miss), not the client's deadline."""
    import time
    from types import SimpleNamespace
    e = TierEngine(kvtier_tier(store.address, deadline_ms=3000,
                               io_threads=1, max_queued_stores=1,
                               lookup_budget_ms=100))
    tier = e.tier
    try:
        e.store(offload_keys(41, 1), 41)  # the namespace is registered
        store.pause()
        try:
            keys = offload_keys(42, 3)
            for i, k in enumerate(keys):
                tier.submit_store(SimpleNamespace(job_id=100 + i, keys=[k],
                                                  chunk_ids=[i]))
            failed = [r for r in tier.get_finished_jobs()]
            assert tier.stores_refused == 2
            assert sorted(r.job_id for r in failed) == [101, 102]
            assert not any(r.success for r in failed)
            t0 = time.monotonic()
            assert tier.present(offload_keys(43, 2)) == [False, False]
            assert time.monotonic() - t0 < 1.0
        finally:
            store.resume()
        tier.drain_jobs()
    finally:
        e.close()


# --- vLLM's P/D keys (vLLM's orchestration-layer protocol, llm-d's sidecar)


def pd_params(side: str, rid: str = "handoff-1",
              sender: str = "llm-d") -> dict:
    """kv_transfer_params as ``sender`` sends them: llm-d's routing sidecar
    with ``--kv-connector offloading`` (remote_decoder to the prefill,
    remote_prefiller with the prefill's host and port to the decode);
    kvtier-frontend (kvtier.integrations.pd: the same keys, the decode's
    with only its kv_request_id, and kvtier's fence, which the tier does
    not need, when a connector answered one); vllm-router
    (do_remote_decode to the prefill)."""
    if side == "decode":
        if sender == "kvtier-frontend":
            return {"remote_prefiller": {"kv_request_id": rid},
                    "kvtier": {"namespace": "00c0ffee00c0ffee", "blocks": 8,
                               "prompt_tokens": 8 * 16, "block_tokens": 16}}
        return {"remote_prefiller": {"kv_request_id": rid,
                                     "remote_host": "10.0.0.9",
                                     "remote_port": 7777}}
    if sender == "vllm-router":
        return {"do_remote_decode": True}
    return {"remote_decoder": {"kv_request_id": rid}}


@pytest.mark.parametrize("sender", ["llm-d", "kvtier-frontend"])
def test_a_decode_request_waits_for_its_prefills_rows_and_loads_them(
        store: Store, sender: str) -> None:
    """Engine D's request (remote_prefiller) looks up a prompt engine P has
    not stored yet: its lookups are deferred (RETRY), not misses. P's
    request (remote_decoder, which the tier stores whole: REQUEST_LEVEL)
    stores it 0.5 s later; D then loads every row bit-exactly, and
    counts one complete handoff. Without the keys, the same lookup missed
    at once. The keys as llm-d sends them, and as kvtier-frontend does
    (the protocol kvtier's connector speaks too)."""
    import threading

    from vllm.v1.kv_offload.base import OffloadPolicy

    p = TierEngine(kvtier_tier(store.address))
    d = TierEngine(kvtier_tier(store.address, handoff_wait_ms=20000))
    try:
        keys = offload_keys(51, 8)
        got, took = d.load(keys)
        assert got == [None] * 8 and took < 5
        timer = threading.Timer(0.5, p.store, (keys, 51, pd_params(
            "prefill", sender=sender)))
        timer.start()
        got, took = d.load(keys, params=pd_params("decode", sender=sender))
        timer.join()
        assert p.policy.policy is OffloadPolicy.REQUEST_LEVEL
        assert took >= 0.45, took
        assert [g == row_bytes(51, i).tobytes() for i, g in enumerate(got)] \
            == [True] * 8
        assert d.tier.handoffs["complete"] == 1
        assert d.tier.handoffs["timed_out"] == 0
        assert p.tier.handoffs["prefill"] == 1
    finally:
        p.close()
        d.close()


def test_a_do_remote_decode_prefill_stores_its_whole_prompt(
        store: Store) -> None:
    """vllm-router's prefill key (``do_remote_decode``, which kvtier's
    connector also takes) makes a tier prefill as remote_decoder does: the
    whole prompt stored (REQUEST_LEVEL), counted as a prefill."""
    from vllm.v1.kv_offload.base import OffloadPolicy

    p = TierEngine(kvtier_tier(store.address))
    try:
        p.store(offload_keys(53, 2), 53, pd_params("prefill",
                                                   sender="vllm-router"))
        assert p.policy.policy is OffloadPolicy.REQUEST_LEVEL
        assert p.tier.handoffs["prefill"] == 1
    finally:
        p.close()


def test_a_decode_whose_prefill_stored_part_waits_its_budget_then_computes(
        store: Store) -> None:
    """P stored the first 2 of 4 rows (the rest never come): D waits
    handoff_wait_ms (0.4 s), no longer, loads the 2 rows bit-exactly and
    misses the others (vLLM computes them); one timed-out handoff."""
    p = TierEngine(kvtier_tier(store.address))
    d = TierEngine(kvtier_tier(store.address, handoff_wait_ms=400))
    try:
        keys = offload_keys(52, 4)
        p.store(keys[:2], 52, pd_params("prefill", "h2"))
        got, took = d.load(keys, params=pd_params("decode", "h2"))
        assert 0.4 <= took < 5, took
        assert got[0] == row_bytes(52, 0).tobytes()
        assert got[1] == row_bytes(52, 1).tobytes()
        assert got[2:] == [None, None]
        assert d.tier.handoffs == {"complete": 0, "timed_out": 1, "partial": 0,
                                   "ignored": 0, "prefill": 0}
        assert d.tier.handoff_wait_seconds >= 0.4
        assert not d.manager.has_pending_work()
    finally:
        p.close()
        d.close()


@pytest.mark.parametrize("params, why", [
    ({**pd_params("decode"), **pd_params("prefill")},
     "remote_prefiller goes alone"),
    ({**pd_params("decode"), "remote_kv_source": {"kv_request_id": "s"}},
     "remote_prefiller goes alone"),
    ({"remote_prefiller": {"remote_host": "10.0.0.9", "remote_port": 7777}},
     "remote_prefiller needs a non-empty string kv_request_id"),
    ({"remote_decoder": {"kv_request_id": 7}},
     "remote_decoder needs a non-empty string kv_request_id"),
    ({"remote_decoder": "h1"},
     "remote_decoder needs a non-empty string kv_request_id"),
])
def test_p_d_keys_the_protocol_forbids_run_an_ordinary_request(
        store: Store, params: dict, why: str) -> None:
    """Keys vLLM's protocol forbids, or malformed ones: the request runs as
    an ordinary one (no wait, the default store policy), counted as
    ignored, and the reason names the key."""
    from vllm.v1.kv_offload.base import OffloadPolicy

    assert why in pd_role(params)[2]
    d = TierEngine(kvtier_tier(store.address, handoff_wait_ms=20000))
    try:
        got, took = d.load(offload_keys(53, 2), params=params)
        assert got == [None, None] and took < 5
        assert d.policy.policy is OffloadPolicy.CHUNK_LEVEL
        assert d.tier.handoffs["ignored"] == 1
    finally:
        d.close()


def test_a_handed_off_row_that_fails_its_load_is_computed_not_promised_again(
        store: Store) -> None:
    """P stored 4 rows, then one was corrupted in the store: D's handoff
    finds all 4 committed, but the promotion fails its checksum. The rows
    that failed are misses from then on (vLLM computes them), not HITs
    promised again step after step; nothing corrupt is read."""
    p = TierEngine(kvtier_tier(store.address))
    d = TierEngine(kvtier_tier(store.address, handoff_wait_ms=20000))
    try:
        keys = offload_keys(54, 4)
        p.store(keys, 54, pd_params("prefill", "h4"))
        assert corrupt_in_store(store.pid, row_bytes(54, 2).tobytes()[4096:4160])
        got, took = d.load(keys, timeout=15, params=pd_params("decode", "h4"))
        # The promotion fails whole: nothing of it is a hit.
        assert got == [None] * 4
        assert took < 10, took
        assert d.tier.handoffs["complete"] == 1
    finally:
        p.close()
        d.close()


def test_a_handoff_ends_when_vllm_schedules_its_request(store: Store) -> None:
    """vLLM scheduled the decode request before every row it asked for was
    found (sliding-window lookups ask rows a prefill never stores): the
    handoff ends there, counted partial, and no longer keeps vLLM stepping
    or the store probed."""
    from vllm.v1.kv_offload.base import (LookupResult, ReqContext,
                                         ScheduleEndContext)

    d = TierEngine(kvtier_tier(store.address, handoff_wait_ms=20000))
    try:
        ctx = ReqContext(req_id="r-sched",
                         kv_transfer_params=pd_params("decode", "h5"))
        d.manager.on_new_request(ctx)
        assert [d.manager.lookup(k, ctx) for k in offload_keys(55, 2)] == \
            [LookupResult.RETRY] * 2
        assert d.manager.has_pending_work()
        d.manager.on_schedule_end(ScheduleEndContext(
            new_req_ids=["r-sched"], preempted_req_ids=()))
        assert d.tier.handoffs["partial"] == 1
        assert not d.manager.has_pending_work()
        d.manager.on_request_finished(ctx)
    finally:
        d.close()


def test_the_tier_namespace_binds_the_engines_model_identity() -> None:
    """Issue #60: vLLM hands the tier an OffloadingConfig naming only the
    model and dtype; the tier reads the engine's VllmConfig from the vLLM
    frame that builds it (here a function holding ``vllm_config``, as
    vLLM's OffloadingConnectorScheduler does), so engines differing in RoPE
    (an ``hf_overrides``) never share rows and identical ones do. Without
    such a frame the rows bind the model id alone, said in the log."""
    from types import SimpleNamespace

    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.kv_offload.config import (OffloadingCacheConfig,
                                           OffloadingConfig,
                                           OffloadingGroupConfig,
                                           OffloadingModelConfig,
                                           OffloadingParallelConfig)

    from kvtier.integrations.vllm_config import tier_namespace
    from vllm_engine import TINY_MODEL

    def offloading_config() -> OffloadingConfig:
        return OffloadingConfig(
            groups=(OffloadingGroupConfig(
                tokens_per_block=16, layer_names=("model.layers.0.attn",),
                group_id=0),),
            worker_kv_bytes_per_block=64 * 1024, enable_kv_cache_events=False,
            extra_config={}, engine_id="identity-test",
            model=OffloadingModelConfig(name=TINY_MODEL, dtype="bfloat16"),
            cache=OffloadingCacheConfig(tokens_per_hash=16,
                                        blocks_per_chunk=1),
            parallel=OffloadingParallelConfig(
                rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1,
                dcp_size=1, data_parallel_index=0, data_parallel_size=1,
                data_parallel_rank_local=None, is_parallelism_agnostic=True))

    def built_by_an_engine(**kw: object) -> int:
        vllm_config = EngineArgs(  # noqa: F841 - read by tier_namespace
            model=TINY_MODEL, load_format="dummy", skip_tokenizer_init=True,
            dtype="bfloat16", block_size=16, enforce_eager=True,
            **kw).create_engine_config()  # type: ignore[arg-type]
        spec = SimpleNamespace(config=offloading_config())
        return tier_namespace(spec, 64 * 1024).id

    base = built_by_an_engine()
    assert built_by_an_engine(max_model_len=2048) == base
    assert built_by_an_engine(hf_overrides={"rope_parameters": {
        "rope_type": "default", "rope_theta": 1000000.0}}) != base
    alone = tier_namespace(SimpleNamespace(config=offloading_config()),
                           64 * 1024)
    assert "ident=unresolved" in alone.layout and alone.id != base
