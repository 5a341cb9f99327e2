"""The kvtier Python API against a real kvtier-store: namespaces and block
hashing, the sharded store client, the connector over engine-registered
tensors in every layout, and the errors bad input raises (which change
nothing stored and touch no engine tensor)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import wait_until
import kvtier
from kvtier import errors

SPEC = dict(model="py-test", dtype="fp16", layers=2, kv_heads=2, head_dim=32,
            block_tokens=16)
PAGES = 10


def ns(**kw: object) -> kvtier.Namespace:
    return kvtier.Namespace(**{**SPEC, **kw})


def caches(layout: str, seed: int = 0) -> list:
    """A layer list of KV caches in ``layout``, filled from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    page = (16, 2, 32)
    out = []
    for _ in range(2):
        if layout == "kv_first":
            out.append(torch.randn((2, PAGES) + page, generator=g).half())
        elif layout == "blocks_first":
            out.append(torch.randn((PAGES, 2) + page, generator=g).half())
        else:
            out.append((torch.randn((PAGES,) + page, generator=g).half(),
                        torch.randn((PAGES,) + page, generator=g).half()))
    return out


def kv_of(cache: list, layout: str, layer: int, page: int) -> torch.Tensor:
    """K and V of one page of one layer, stacked."""
    c = cache[layer]
    if layout == "kv_first":
        return torch.stack([c[0, page], c[1, page]])
    if layout == "blocks_first":
        return c[page].clone()
    return torch.stack([c[0][page], c[1][page]])


def test_the_package_carries_the_build_version() -> None:
    import re
    from pathlib import Path
    cmake = (Path(__file__).resolve().parents[2] / "CMakeLists.txt").read_text()
    m = re.search(r"project\(kvtier VERSION ([0-9.]+)", cmake)
    assert m and kvtier.__version__ == m.group(1)


def test_hashes_are_chained_per_namespace_and_skip_a_partial_block() -> None:
    a = ns()
    tokens = list(range(1, 41))  # 2 full blocks and 8 tokens
    h = kvtier.hash_tokens(a, tokens)
    assert h.shape == (2, 2) and h.dtype == np.uint64
    assert (kvtier.hash_tokens(a, tokens[:32]) == h).all()
    assert (kvtier.hash_tokens(a, np.array(tokens[:16]))[0] == h[0]).all()
    other = kvtier.hash_tokens(a, [7] + tokens[1:])
    assert (other[0] != h[0]).any() and (other[1] != h[1]).any(), \
        "block 1's hash depends on block 0"
    assert (kvtier.hash_tokens(ns(model="other"), tokens) != h).any()
    assert a.block_bytes == 2 * 2 * 16 * 2 * 32 * 2
    with pytest.raises(errors.InvalidArgument, match="not a uint32"):
        kvtier.hash_tokens(a, [1, -2, 3])


def test_bad_namespaces_raise_invalid_argument_with_the_reason() -> None:
    with pytest.raises(errors.InvalidArgument) as e:
        ns(dtype="fp64")
    assert e.value.code == errors.StatusCode.INVALID_ARGUMENT
    assert "fp64" in e.value.message
    with pytest.raises(ValueError):  # InvalidArgument is a ValueError
        ns(layers=0)


@pytest.mark.parametrize("kind", ["numpy", "bytearray", "torch"])
def test_store_client_puts_and_gets_blocks_zero_copy(store, kind) -> None:
    a = ns()
    c = kvtier.StoreClient([store.address])
    c.register_namespace(a)
    hashes = kvtier.hash_tokens(a, list(range(3 * 16)))
    bb = a.block_bytes
    data = np.random.default_rng(1).integers(0, 255, 3 * bb, dtype=np.uint8)
    src = {"numpy": data, "bytearray": bytearray(data.tobytes()),
           "torch": torch.from_numpy(data.copy())}[kind]
    out = {"numpy": np.zeros_like(data), "bytearray": bytearray(3 * bb),
           "torch": torch.zeros(3 * bb, dtype=torch.uint8)}[kind]
    put = c.put(a, hashes, src)
    assert put["written"] == 3
    assert c.put(a, hashes, src)["already_present"] == 3
    assert c.lookup(a, hashes) == 3
    assert c.get(a, hashes, out) == 3
    assert bytes(memoryview(np.asarray(out)).cast("B")) == data.tobytes()


def test_store_client_errors_name_the_problem_and_lose_nothing(store) -> None:
    a = ns()
    c = kvtier.StoreClient([store.address])
    c.register_namespace(a)
    hashes = kvtier.hash_tokens(a, list(range(2 * 16)))
    data = np.ones(2 * a.block_bytes, dtype=np.uint8)
    assert c.put(a, hashes, data)["written"] == 2
    with pytest.raises(errors.InvalidArgument, match="need"):
        c.put(a, hashes, data[:10])
    with pytest.raises(errors.InvalidArgument, match=r"\[n, 2\]"):
        c.lookup(a, np.zeros(4, dtype=np.uint64))
    with pytest.raises(errors.InvalidArgument, match="read-only"):
        c.get(a, hashes, bytes(2 * a.block_bytes))
    with pytest.raises(errors.InvalidArgument, match="HOST:PORT"):
        kvtier.StoreClient(["nowhere"])
    out = np.zeros_like(data)
    assert c.get(a, hashes, out) == 2 and (out == 1).all()


def test_tls_files_that_cannot_be_read_are_invalid_arguments(tmp_path) -> None:
    with pytest.raises(errors.InvalidArgument) as e:
        kvtier.StoreClient(["127.0.0.1:1"], tls_ca=str(tmp_path / "none.pem"))
    assert "none.pem" in e.value.message
    with pytest.raises(errors.InvalidArgument):
        kvtier.Connector(ns(), caches("kv_first"), stores=["127.0.0.1:1"],
                         tls_ca=str(tmp_path / "none.pem"))


def test_an_unknown_store_raises_unavailable_or_deadline() -> None:
    c = kvtier.StoreClient(["127.0.0.1:1"], deadline_ms=1000)
    with pytest.raises((errors.Unavailable, errors.DeadlineExceeded)) as e:
        c.register_namespace(ns())
    assert "127.0.0.1:1" in str(e.value)


def test_a_store_past_its_deadline_is_named(store) -> None:
    """A store that answers nothing (SIGSTOPped: its kernel still accepts
    the connection) fails the call at the client's deadline, and the
    error says which store: gRPC's own message is only "Deadline
    Exceeded"."""
    c = kvtier.StoreClient([store.address], deadline_ms=500)
    store.pause()
    try:
        with pytest.raises(errors.DeadlineExceeded) as e:
            c.register_namespace(ns())
    finally:
        store.resume()
    assert store.address in str(e.value), str(e.value)
    # The store serves on: the same client registers once it answers
    # (the id is the namespace's, whoever asks).
    assert c.register_namespace(ns()) == \
        kvtier.StoreClient([store.address]).register_namespace(ns())


@pytest.mark.parametrize("layout", list(kvtier.LAYOUTS))
@pytest.mark.parametrize("shm", ["on", "off"])
@pytest.mark.parametrize("copier", ["", "host"])
def test_connector_saves_from_one_engine_and_loads_into_another(
        store, layout, shm, copier) -> None:
    """Direct or through the page copier's staged path (the one CUDA pages
    take, here with host copies): the same bytes land."""
    a_cache, b_cache = caches(layout, 1), caches(layout, 2)
    before = [kv_of(b_cache, layout, layer, p).clone()
              for layer in range(2) for p in range(PAGES)]
    a = kvtier.Connector(ns(), a_cache, stores=[store.address], layout=layout,
                         shared_memory=shm, page_copier=copier)
    b = kvtier.Connector(ns(), b_cache, stores=[store.address], layout=layout,
                         shared_memory=shm, page_copier=copier)
    assert b.page_copier == copier
    hashes = kvtier.hash_tokens(a.namespace, list(range(4 * 16)))
    assert a.lookup(1, hashes).blocks == 0
    a.save(1, 0, [6, 2, 9, 4])
    a.wait_for_save(1)
    a.finished(1)
    found = b.lookup(2, hashes, skip_blocks=1)
    assert found.blocks == 3 and found.store_error is None
    b.start_load(2, [0, 1])  # two of the three
    for layer in range(2):
        b.wait_for_layer(2, layer)
    assert b.wait_for_load(2) == 2
    b.finished(2)
    for layer in range(2):
        assert torch.equal(kv_of(b_cache, layout, layer, 0),
                           kv_of(a_cache, layout, layer, 2))
        assert torch.equal(kv_of(b_cache, layout, layer, 1),
                           kv_of(a_cache, layout, layer, 9))
        for p in range(2, PAGES):
            assert torch.equal(kv_of(b_cache, layout, layer, p),
                               before[layer * PAGES + p]), "untouched pages"
    assert a.stats()["offloaded_blocks"] == 4
    assert b.stats()["loaded_blocks"] == 2
    a.close()
    b.close()


def test_a_block_corrupted_in_the_store_fails_once_then_is_dropped(
        store) -> None:
    from conftest import corrupt_in_store, wait_until

    a_cache, b_cache = caches("kv_first", 8), caches("kv_first", 9)
    a = kvtier.Connector(ns(), a_cache, stores=[store.address])
    b = kvtier.Connector(ns(), b_cache, stores=[store.address])
    hashes = kvtier.hash_tokens(a.namespace, list(range(4 * 16)))
    a.lookup(1, hashes)
    a.save(1, 0, [0, 1, 2, 3])
    a.wait_for_save(1)
    a.finished(1)
    assert corrupt_in_store(store.pid, kv_of(a_cache, "kv_first", 0, 2)[0]
                            .numpy().tobytes())
    assert b.lookup(2, hashes).blocks == 4
    b.start_load(2, [0, 1, 2, 3])
    with pytest.raises(errors.DataLoss):
        b.wait_for_load(2)
    b.finished(2)
    # The connector reported the failed blocks; the store checked its copies
    # and dropped the corrupt one: later loads stop before it.
    wait_until(lambda: b.stats()["corrupt_dropped"] >= 1,
               "the store to drop the corrupt block", timeout=10)
    assert b.stats()["corrupt_dropped"] == 1
    assert b.lookup(3, hashes).blocks == 2
    b.start_load(3, [4, 5])
    assert b.wait_for_load(3) == 2
    b.finished(3)
    for page in (4, 5):
        assert torch.equal(kv_of(b_cache, "kv_first", 0, page),
                           kv_of(a_cache, "kv_first", 0, page - 4))
    a.close()
    b.close()


def test_request_id_zero_saves_and_closes_like_any_other(store) -> None:
    c = kvtier.Connector(ns(), caches("kv_first"), stores=[store.address])
    hashes = kvtier.hash_tokens(c.namespace, list(range(2 * 16)))
    c.lookup(0, hashes)
    c.save(0, 0, [0, 1])
    c.wait_for_save(0)  # hung once: 0 meant "no request waits" internally
    c.finished(0)
    assert c.stats()["offloaded_blocks"] == 2
    c.close()


def nice_of_threads() -> dict[int, int]:
    """This process's threads' nice values, by thread id."""
    out = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended
            continue
        out[int(task.name)] = int(stat.rsplit(")", 1)[1].split()[16])
    return out


def test_the_offload_thread_runs_at_the_nice_it_is_given(store) -> None:
    """A connector's offloading thread yields the CPU (nice 10) unless told
    otherwise: a P/D prefill's runs at 0, its decode waits on it. A value
    outside 0..19 is an error naming it. The saves land either way."""
    before = set(nice_of_threads())
    low = kvtier.Connector(ns(), caches("kv_first"), stores=[store.address])
    wait_until(lambda: 10 in {n for t, n in nice_of_threads().items()
                              if t not in before}, "a thread at nice 10")
    before = set(nice_of_threads())
    high = kvtier.Connector(ns(), caches("kv_first", 1), stores=[store.address],
                            offload_nice=0)
    for c, rid in ((low, 1), (high, 2)):
        hashes = kvtier.hash_tokens(c.namespace, list(range(rid, rid + 32)))
        c.lookup(rid, hashes)
        c.save(rid, 0, [0, 1])
        c.wait_for_save(rid)
        c.finished(rid)
        assert c.stats()["offloaded_blocks"] == 2
    # high's offloader has run (its saves landed): none of its threads
    # yields.
    assert 10 not in {n for t, n in nice_of_threads().items()
                      if t not in before}
    for c in (low, high):
        c.close()
    for bad in (-1, 20):
        with pytest.raises(errors.InvalidArgument, match="offload_nice"):
            kvtier.Connector(ns(), caches("kv_first"), offload_nice=bad)


def test_bad_tensors_and_pages_raise_and_touch_nothing(store) -> None:
    good = caches("kv_first")
    with pytest.raises(errors.InvalidArgument, match="dtype"):
        kvtier.Connector(ns(), [t.float() for t in good])
    with pytest.raises(errors.InvalidArgument, match="does not fit"):
        kvtier.Connector(ns(), [t[:, :, :8] for t in good])  # too small
    with pytest.raises(errors.InvalidArgument, match="2 layers"):
        kvtier.Connector(ns(), good[:1])
    with pytest.raises(errors.InvalidArgument, match="contiguous"):
        kvtier.Connector(ns(), [torch.zeros(2, PAGES, 16, 32, 2).half()
                                .transpose(3, 4) for _ in good])
    with pytest.raises(errors.InvalidArgument, match="layout"):
        kvtier.Connector(ns(), good, layout="heads_first")
    with pytest.raises(errors.InvalidArgument, match="pair"):
        kvtier.Connector(ns(), good, layout="split")
    with pytest.raises(errors.InvalidArgument, match="CUDA pages choose"):
        kvtier.Connector(ns(), good, page_copier="cuda:0")
    with pytest.raises(errors.InvalidArgument, match="host and CUDA memory"):
        kvtier.Connector(ns(), [t.to("meta") for t in good])
    snapshot = [t.clone() for t in good]
    c = kvtier.Connector(ns(), good, stores=[store.address])
    hashes = kvtier.hash_tokens(c.namespace, list(range(3 * 16)))
    c.lookup(1, hashes)
    with pytest.raises(errors.InvalidArgument, match="out of range"):
        c.save(1, 0, [0, PAGES])
    with pytest.raises(errors.InvalidArgument, match="beyond"):
        c.save(1, 2, [0, 1])
    with pytest.raises(errors.InvalidArgument, match="negative"):
        c.save(1, 0, [-1])
    with pytest.raises(errors.NotFound):
        c.save(77, 0, [0])
    with pytest.raises(errors.InvalidArgument):
        c.wait_for_layer(1, 5)
    c.save(1, 0, [0, 1, 2])
    c.wait_for_save(1)
    c.finished(1)
    other = caches("kv_first", 5)
    other_snapshot = [t.clone() for t in other]
    d = kvtier.Connector(ns(), other, stores=[store.address])
    assert d.lookup(2, hashes).blocks == 3
    with pytest.raises(errors.InvalidArgument, match="pages for 3 blocks"):
        d.start_load(2, [0, 1, 2, 3])
    with pytest.raises(errors.InvalidArgument, match="twice"):
        d.start_load(2, [4, 4])
    with pytest.raises(errors.InvalidArgument, match="out of range"):
        d.start_load(2, [PAGES + 1])
    d.finished(2)
    for t, s in zip(other, other_snapshot):
        assert torch.equal(t, s), "a refused load wrote the engine's tensors"
    for t, s in zip(good, snapshot):
        assert torch.equal(t, s), "saving changed the engine's tensors"
    c.close()
    d.close()


def test_a_connector_to_an_unknown_store_computes_instead() -> None:
    c = kvtier.Connector(ns(), caches("kv_first"), stores=["127.0.0.1:1"],
                         deadline_ms=500)
    hashes = kvtier.hash_tokens(c.namespace, list(range(2 * 16)))
    found = c.lookup(1, hashes)
    assert found.blocks == 0
    assert isinstance(found.store_error, (errors.Unavailable,
                                          errors.DeadlineExceeded))
    c.finished(1)
    c.close()


def test_a_negative_store_hint_is_an_error_naming_it() -> None:
    """``SchedulerHalf.num_loadable_tokens`` refuses a negative hint (a
    router's ``store_end_blocks`` is never below 0) instead of treating it as
    "nothing stored", and the engine refuses it before queueing."""
    from kvtier.hooks import SchedulerHalf

    a = ns()
    s = SchedulerHalf(a, None, 16)
    hashes = kvtier.hash_tokens(a, list(range(4 * 16)))
    with pytest.raises(errors.InvalidArgument, match="store_hint"):
        s.num_loadable_tokens(1, hashes, 64, 0, store_hint=-1)
    assert s.lookups_skipped == 0
    assert s.num_loadable_tokens(1, hashes, 64, 0, store_hint=0) == 0



def test_a_lookup_budget_bounds_the_wait_and_a_late_lookup_spares_the_next(
        store) -> None:
    """``SchedulerHalf.num_loadable_tokens(budget_ms=)`` (issue #30: a
    stalled store costs a request no more than the compute it could save):
    with the store SIGSTOPped the wait ends at the budget, not at the
    client's 5 s deadline, and supplies nothing (``lookups_late``); the
    client then skips the slow store for a while, so the next lookup is
    not asked (``lookups_not_asked``, at once); once the store answers and
    the skip ends, lookups find
    the blocks again. A budget that is not a positive number is
    InvalidArgument."""
    import time

    from conftest import wait_until
    from kvtier.hooks import SchedulerHalf

    a = ns()
    c = kvtier.StoreClient([store.address], deadline_ms=5000)
    c.register_namespace(a)
    hashes = kvtier.hash_tokens(a, list(range(4 * 16)))
    c.put(a, hashes, np.ones(4 * a.block_bytes, dtype=np.uint8))
    s = SchedulerHalf(a, c, 16)
    prompt = 4 * 16 + 1
    assert s.num_loadable_tokens(1, hashes, prompt, 0, budget_ms=1000) == 64
    for bad in (0, -5, float("nan"), float("inf")):
        with pytest.raises(errors.InvalidArgument, match="budget_ms"):
            s.num_loadable_tokens(2, hashes, prompt, 0, budget_ms=bad)
    store.pause()
    try:
        t0 = time.monotonic()
        assert s.num_loadable_tokens(3, hashes, prompt, 0, budget_ms=50) == 0
        late_ms = (time.monotonic() - t0) * 1000.0
        t0 = time.monotonic()
        assert s.num_loadable_tokens(4, hashes, prompt, 0,
                                     budget_ms=1000) == 0
        spared_ms = (time.monotonic() - t0) * 1000.0
    finally:
        store.resume()
    assert (s.lookups_late, s.lookups_not_asked, s.lookup_errors) == (1, 1, 0)
    # The late answer is the store call's own deadline (gRPC's clock, which
    # may fire a fraction of a millisecond before this one's 50 ms).
    assert 49 <= late_ms < 1000, late_ms
    assert spared_ms < 200, spared_ms  # not the 5 s deadline
    wait_until(lambda: s.num_loadable_tokens(5, hashes, prompt, 0,
                                             budget_ms=1000) != 0,
               "the store to be asked again", timeout=10)


def test_a_forgotten_lookup_ends_the_wait_for_answers(store) -> None:
    """``StepLookups.wait_answers`` (a scheduler with nothing to compute
    waits there for its lookups) ends once no lookup sent is still to be
    answered: a request forgotten while its lookup is out (it finished or
    was aborted; the store SIGSTOPped, so no answer comes) ends the wait
    when it is forgotten, not when the lookup's budget runs out."""
    import threading
    import time

    from kvtier.step_lookups import StepLookups

    a = ns()
    c = kvtier.StoreClient([store.address], deadline_ms=20000)
    c.register_namespace(a)
    hashes = kvtier.hash_tokens(a, list(range(900, 900 + 4 * 16)))
    lookups = StepLookups(c, a)
    store.pause()
    try:
        lookups.ask(1, hashes, budget_ms=15000)
        lookups.flush()
        forget = threading.Timer(0.2, lookups.forget, args=(1,))
        forget.start()
        t0 = time.monotonic()
        over = lookups.wait_answers(30.0)
        took = time.monotonic() - t0
        forget.join()
    finally:
        store.resume()
        lookups.close()
    assert over, "the wait ran out"
    assert took < 10.0, took  # the lookup's own budget is 15 s


def test_a_tp_engine_loads_only_what_every_rank_holds(store) -> None:
    """A TP engine's scheduler asks in rank 0's namespace; a block is
    loadable (and a P/D handoff's fence met) only once every rank's shard
    of it is in the store (issue #60: with rank 1's saves behind rank 0's,
    rank 0's answer alone promised blocks rank 1 could not load). A rank
    whose namespace the store has not seen yet holds nothing."""
    from kvtier.hooks import SchedulerHalf

    r0, r1 = ns(tp_rank=0, tp_size=2), ns(tp_rank=1, tp_size=2)
    c = kvtier.StoreClient([store.address], deadline_ms=5000)
    chain = kvtier.hash_tokens(r0, list(range(700, 700 + 4 * 16)))
    prompt = 4 * 16 + 1
    c.register_namespace(r0)
    c.put(r0, chain, np.ones(4 * r0.block_bytes, dtype=np.uint8))
    for budget in (None, 1000):
        s = SchedulerHalf(r0, c, 16, ranks=[r1])
        assert s.num_loadable_tokens(1, chain, prompt, 0,
                                     budget_ms=budget) == 0, budget
    c.register_namespace(r1)
    c.put(r1, chain[:2], np.ones(2 * r1.block_bytes, dtype=np.uint8))
    for budget in (None, 1000):
        s = SchedulerHalf(r0, c, 16, ranks=[r1])
        assert s.num_loadable_tokens(1, chain, prompt, 0,
                                     budget_ms=budget) == 2 * 16, budget
        assert SchedulerHalf(r0, c, 16).num_loadable_tokens(
            1, chain, prompt, 0, budget_ms=budget) == 4 * 16, "rank 0 alone"
    c.put(r1, chain, np.ones(4 * r1.block_bytes, dtype=np.uint8))
    s = SchedulerHalf(r0, c, 16, ranks=[r1])
    assert s.num_loadable_tokens(1, chain, prompt, 0, budget_ms=1000) == 64


def test_one_dtype_table_and_one_engine_key_hash_from_the_extension() -> None:
    """Every engine spelling of a KV dtype maps, through the one table the
    C++ library holds, to a dtype a namespace accepts (an fp8 format keeps
    its own name); an unknown one is refused by name. Engine keys hash with
    the library's one function, alike from bytes and str, and both vLLM
    integrations use it."""
    from kvtier import dtypes
    from kvtier.integrations.vllm_config import key_hashes
    assert dtypes.kvtier_dtype("torch.bfloat16") == "bf16"
    assert dtypes.kvtier_dtype("half") == "fp16"
    assert dtypes.kvtier_dtype("float8_e4m3fn") == "fp8_e4m3"
    assert dtypes.kvtier_dtype("fp8_e5m2") == "fp8_e5m2"
    for name in set(dtypes.SPELLINGS.values()):
        kvtier.Namespace("m", name, 1, 1, 64, 16)  # the C++ parser takes it
        assert dtypes.ELEMENT_BYTES[name] in (1, 2)
    with pytest.raises(errors.InvalidArgument, match="float32"):
        dtypes.kvtier_dtype("float32")
    h = dtypes.engine_key_hashes([b"abc", "abc", b"abd"])
    assert h.shape == (3, 2) and h.dtype == np.uint64
    assert (h[0] == h[1]).all() and not (h[0] == h[2]).all()
    assert (key_hashes([b"abc"]) == h[:1]).all()
    with pytest.raises(TypeError, match="bytes or str"):
        dtypes.engine_key_hashes([3])
