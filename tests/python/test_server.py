"""kvtier-torch-engine as a process: Submit over gRPC (real forward
passes), clear errors for bad requests, its prefix cache's blocks published
to a real kvtier-router (which then routes the prompt to it), its stats, and
a clean stop on SIGTERM."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Iterator

import grpc
import numpy as np
import pytest
import torch

from conftest import BUILD, engine_env, wait_until
from kvtier.v1 import router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc


def _serve(args: list[str], tmp: Path, name: str) -> tuple[subprocess.Popen,
                                                            str]:
    port_file = tmp / f"{name}.port"
    log = open(tmp / f"{name}.log", "wb")
    proc = subprocess.Popen(args + [f"--port-file={port_file}"],
                            stdout=log, stderr=subprocess.STDOUT,
                            env=engine_env())
    deadline = time.monotonic() + 60
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError((tmp / f"{name}.log").read_text()[-3000:])
        time.sleep(0.05)
    return proc, f"127.0.0.1:{port_file.read_text().strip()}"


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[str, str, subprocess.Popen]]:
    """A kvtier-router and a kvtier-torch-engine publishing to it."""
    router, raddr = _serve([str(BUILD / "router" / "kvtier-router"),
                            "--listen=127.0.0.1:0",
                            "--heartbeat-deadline=3s"], tmp_path, "router")
    engine, eaddr = _serve([str(BUILD / "python" / "kvtier-torch-engine"),
                            "--listen=127.0.0.1:0", f"--router={raddr}",
                            "--pages=256", "--heartbeat-ms=100",
                            "--worker-id=torch-0"], tmp_path, "engine")
    yield raddr, eaddr, engine
    for p in (engine, router):
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
            p.wait(timeout=10)


def test_submit_route_stats_and_stop(cluster) -> None:
    raddr, eaddr, engine = cluster
    worker = worker_pb2_grpc.SimWorkerStub(grpc.insecure_channel(eaddr))
    router = router_pb2_grpc.RouterStub(grpc.insecure_channel(raddr))
    tokens = np.random.default_rng(7).integers(0, 4096, 100).tolist()
    req = worker_pb2.SubmitRequest(request_id=1, output_tokens=3)
    req.tokens.ids.extend(tokens)
    r = worker.Submit(req, timeout=60)
    assert r.prompt_tokens == 100 and r.prefill_tokens == 100
    assert r.gpu_hit_tokens == 0 and r.ttft_ms > 0 and r.load_status == ""

    # The engine's prefix cache reached the router: it routes there.
    deadline = time.monotonic() + 10
    while True:
        workers = router.ListWorkers(router_pb2.ListWorkersRequest(),
                                     timeout=5).sources
        route = None
        if workers:
            rr = router_pb2.RouteRequest(namespace_id=workers[0].namespace_id)
            rr.tokens.ids.extend(tokens)
            route = router.Route(rr, timeout=5)
            if route.gpu_hit_blocks == 100 // 16:
                break
        assert time.monotonic() < deadline, (workers, route)
        time.sleep(0.1)
    assert route.endpoint == eaddr and route.worker_id == "torch-0"

    # A second run of the prompt hits the engine's own prefix cache.
    again = worker.Submit(req, timeout=60)
    assert again.gpu_hit_tokens == 96 and again.prefill_tokens == 4

    stats = worker.GetWorkerStats(worker_pb2.GetWorkerStatsRequest(),
                                  timeout=10)
    assert stats.requests == 2 and stats.worker_id == "torch-0"
    assert stats.cached_pages >= 6

    # Bad requests: clear errors, and the engine keeps serving.
    only_hashes = worker_pb2.SubmitRequest(request_id=2)
    only_hashes.hashes.hashes.add(hi=1, lo=2)
    with pytest.raises(grpc.RpcError) as e:
        worker.Submit(only_hashes, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "token ids" in e.value.details()
    bad = worker_pb2.SubmitRequest(request_id=3)
    bad.tokens.ids.extend([1, 2, 99999])
    with pytest.raises(grpc.RpcError) as e:
        worker.Submit(bad, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "vocabulary" in e.value.details()
    assert worker.Submit(req, timeout=60).prompt_tokens == 100

    os.kill(engine.pid, signal.SIGTERM)
    assert engine.wait(timeout=30) == 0


def test_a_route_counts_until_the_engine_lists_its_request(
        tmp_path: Path) -> None:
    """A route naming its request stays in the engine's load at the router
    (ten minutes of --inflight would keep it anyway) until the engine's
    heartbeat lists the request as arrived; then its own queue counts it."""
    router, raddr = _serve([str(BUILD / "router" / "kvtier-router"),
                            "--listen=127.0.0.1:0", "--inflight=10m",
                            "--pending=0", "--heartbeat-deadline=3s"],
                           tmp_path, "router")
    procs = [router]
    try:
        engine, eaddr = _serve([str(BUILD / "python" / "kvtier-torch-engine"),
                                "--listen=127.0.0.1:0", f"--router={raddr}",
                                "--pages=256", "--heartbeat-ms=50",
                                "--worker-id=torch-ids"], tmp_path, "engine")
        procs.insert(0, engine)
        router_stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(raddr))
        worker = worker_pb2_grpc.SimWorkerStub(grpc.insecure_channel(eaddr))

        def source() -> router_pb2.SourceInfo:
            return wait_until(
                lambda: router_stub.ListWorkers(
                    router_pb2.ListWorkersRequest(), timeout=5).sources,
                "the engine to join the router", timeout=10)[0]

        req = _submit(77, tokens=64)
        rr = router_pb2.RouteRequest(namespace_id=source().namespace_id,
                                     request_id=77)
        rr.tokens.ids.extend(req.tokens.ids)
        assert router_stub.Route(rr, timeout=5).prefill_tokens == 64

        def heard_since(t: float) -> bool:
            """The router heard from the engine after ``t``."""
            elapsed_ms = (time.monotonic() - t) * 1000
            return source().last_seen_ms + 1 < elapsed_ms

        # Two heartbeats that do not list it.
        routed_at = time.monotonic()
        wait_until(lambda: heard_since(routed_at), "a heartbeat after the route")
        first = time.monotonic()
        wait_until(lambda: heard_since(first), "a second heartbeat")
        assert source().routed_tokens_since_heartbeat == 64
        assert worker.Submit(req, timeout=60).prefill_tokens == 64
        wait_until(lambda: source().routed_tokens_since_heartbeat == 0,
                   "the route to arrive", timeout=10)
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
                p.wait(timeout=10)


def _submit(request_id: int, tokens: int = 40) -> worker_pb2.SubmitRequest:
    """A Submit of ``tokens`` token ids."""
    req = worker_pb2.SubmitRequest(request_id=request_id, output_tokens=1)
    req.tokens.ids.extend(range(1, tokens + 1))
    return req


class _WrongTypes:
    """A handler whose answers carry values of the wrong type."""

    def submit(self, req: dict) -> dict:
        return {"ttft_ms": "fast"}

    def stats(self) -> dict:
        return {"requests": [1, 2]}


def test_a_handler_answer_of_the_wrong_type_is_an_error_not_a_crash() -> None:
    """A value the message's field cannot take (py::cast_error inside the
    native handler) comes back as INVALID_ARGUMENT naming the field, and
    the server keeps serving; it used to escape the gRPC handler."""
    import kvtier

    ns = kvtier.Namespace("wrong-types", "fp16", 1, 1, 8, 16)
    srv = kvtier.WorkerServer(_WrongTypes(), "127.0.0.1:0", [], "wrong-0",
                              "", ns, 1000)
    try:
        stub = worker_pb2_grpc.SimWorkerStub(
            grpc.insecure_channel(srv.address))
        for call, req, field in (
                (stub.Submit, _submit(1), "ttft_ms"),
                (stub.GetWorkerStats, worker_pb2.GetWorkerStatsRequest(),
                 "requests"),
                (stub.Submit, _submit(2), "ttft_ms")):
            with pytest.raises(grpc.RpcError) as err:
                call(req, timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert field in err.value.details()
    finally:
        srv.stop()


class _MalformedError:
    """A handler raising a KvtierError whose ``code`` it replaced with a
    string, and one raising an exception whose ``str`` itself raises."""

    def submit(self, req: dict) -> dict:
        import kvtier.errors

        err = kvtier.errors.NotFound(5, "no such request")
        err.code = "five"  # type: ignore[assignment]
        raise err

    def stats(self) -> dict:
        class _Unprintable(Exception):
            def __str__(self) -> str:
                raise RuntimeError("cannot print")

        raise _Unprintable()


def test_a_malformed_handler_error_is_internal_not_a_crash() -> None:
    """Converting a handler's exception must not throw out of the native
    gRPC handler (a py::cast_error there ended the process): it comes back
    as INTERNAL, and the server keeps serving."""
    import kvtier

    ns = kvtier.Namespace("malformed-error", "fp16", 1, 1, 8, 16)
    srv = kvtier.WorkerServer(_MalformedError(), "127.0.0.1:0", [],
                              "malformed-0", "", ns, 1000)
    try:
        stub = worker_pb2_grpc.SimWorkerStub(
            grpc.insecure_channel(srv.address))
        for call, req in ((stub.Submit, _submit(1)),
                          (stub.GetWorkerStats,
                           worker_pb2.GetWorkerStatsRequest()),
                          (stub.Submit, _submit(2))):
            with pytest.raises(grpc.RpcError) as err:
                call(req, timeout=10)
            assert err.value.code() == grpc.StatusCode.INTERNAL
            assert "handler" in err.value.details()
    finally:
        srv.stop()


class _Recorder:
    """A handler that records what it was given and answers a TTFT."""

    def __init__(self) -> None:
        self.seen: list[dict] = []

    def submit(self, req: dict) -> dict:
        self.seen.append(req)
        return {"ttft_ms": 1.0, "prompt_tokens": int(req["prompt_tokens"])}

    def stats(self) -> dict:
        return {"requests": len(self.seen)}


def test_prompts_are_checked_before_the_handler_sees_them() -> None:
    """The Python server takes kvtier-sim-worker's path: a prompt over the
    prompt limit, an empty one, or a chain with a prompt_tokens that does
    not fit is INVALID_ARGUMENT and never reaches the handler; a good one
    arrives with its length counted and its hashes, if given, as an array
    of the chain (it used to be decoded by hand, unchecked)."""
    import kvtier

    ns = kvtier.Namespace("checked-prompts", "fp16", 1, 1, 8, 16)
    rec = _Recorder()
    srv = kvtier.WorkerServer(rec, "127.0.0.1:0", [], "checked-0", "", ns,
                              1000)
    try:
        stub = worker_pb2_grpc.SimWorkerStub(
            grpc.insecure_channel(srv.address,
                                  options=[("grpc.max_send_message_length",
                                            64 << 20)]))
        too_long = _submit(1, tokens=kvtier._native.MAX_PROMPT_TOKENS + 1)
        hashed = worker_pb2.SubmitRequest(request_id=3, prompt_tokens=10)
        for i in range(2):
            h = hashed.hashes.hashes.add()
            h.hi, h.lo = i + 1, 7
        for req, needle in ((too_long, "limit"),
                            (worker_pb2.SubmitRequest(request_id=2), "empty"),
                            (hashed, "prompt_tokens")):
            with pytest.raises(grpc.RpcError) as err:
                stub.Submit(req, timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert needle in err.value.details(), err.value.details()
        assert rec.seen == []
        assert stub.Submit(_submit(4, tokens=40), timeout=10).prompt_tokens == 40
        hashed.prompt_tokens = 20
        assert stub.Submit(hashed, timeout=10).prompt_tokens == 20
        assert len(rec.seen) == 2
        assert list(rec.seen[0]["tokens"]) == list(range(1, 41))
        assert rec.seen[0]["hashes"] is None
        assert rec.seen[1]["tokens"] is None
        assert np.asarray(rec.seen[1]["hashes"]).tolist() == [[1, 7], [2, 7]]
    finally:
        srv.stop()


def _certs(d: Path) -> None:
    """A CA and a certificate for 127.0.0.1 it signs, in ``d``."""
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True,
                       capture_output=True, timeout=60)
    run("req", "-x509", "-newkey", "ec", "-pkeyopt",
        "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", "ca.key",
        "-out", "ca.crt", "-days", "1", "-subj", "/CN=kvtier-test-ca")
    run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
        "-nodes", "-keyout", "tls.key", "-out", "tls.csr", "-subj",
        "/CN=127.0.0.1")
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-set_serial", "1", "-days", "1", "-extfile", "ext.cnf",
        "-out", "tls.crt")


def test_the_python_server_serves_tls(tmp_path: Path) -> None:
    """With a certificate the Python server serves TLS, as
    kvtier-sim-worker does with --tls-cert (it used to serve plaintext
    only): a client that trusts the CA is answered, a plaintext one is
    not; a certificate file that cannot be read is InvalidArgument."""
    import kvtier

    _certs(tmp_path)
    ns = kvtier.Namespace("tls-server", "fp16", 1, 1, 8, 16)
    with pytest.raises(kvtier.errors.InvalidArgument):
        kvtier.WorkerServer(_Recorder(), "127.0.0.1:0", [], "tls-1", "", ns,
                            1000, tls_cert=str(tmp_path / "none.crt"),
                            tls_key=str(tmp_path / "tls.key"))
    srv = kvtier.WorkerServer(_Recorder(), "127.0.0.1:0", [], "tls-0", "",
                              ns, 1000, tls_cert=str(tmp_path / "tls.crt"),
                              tls_key=str(tmp_path / "tls.key"))
    try:
        creds = grpc.ssl_channel_credentials(
            root_certificates=(tmp_path / "ca.crt").read_bytes())
        secure = worker_pb2_grpc.SimWorkerStub(
            grpc.secure_channel(srv.address, creds))
        assert secure.Submit(_submit(1), timeout=10).prompt_tokens == 40
        plain = worker_pb2_grpc.SimWorkerStub(
            grpc.insecure_channel(srv.address))
        with pytest.raises(grpc.RpcError) as err:
            plain.Submit(_submit(2), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        srv.stop()


def test_a_store_hint_spares_the_lookup_only_when_the_pages_reach_it(
        store, tmp_path: Path) -> None:
    """``SubmitRequest.store_hint_blocks`` (a router's ``store_end_blocks``)
    reaches the torch engine: at or below its own prefix the store is not
    asked, so blocks the store does hold are not loaded (a stale hint costs
    compute); past it, or without one, they are."""
    import kvtier
    from kvtier.engine.engine import EngineConfig, namespace_for
    from kvtier.engine.model import ModelConfig

    engine, eaddr = _serve([str(BUILD / "python" / "kvtier-torch-engine"),
                            "--listen=127.0.0.1:0", f"--store={store.address}",
                            "--pages=256", "--worker-id=torch-hint",
                            # Loads asserted exactly: the lookup is waited
                            # for up to the deadline, however loaded the host.
                            "--lookup-wait-share=0"],
                           tmp_path, "engine")
    try:
        worker = worker_pb2_grpc.SimWorkerStub(grpc.insecure_channel(eaddr))
        ns = namespace_for(ModelConfig(), EngineConfig(page_tokens=16))
        rng = np.random.default_rng(11)

        def prompt_in_store() -> list[int]:
            """160 tokens whose 10 blocks the store holds (zeros)."""
            tokens = rng.integers(0, 4096, 160).tolist()
            hashes = kvtier.hash_tokens(ns, tokens)
            c = kvtier.StoreClient([store.address])
            c.register_namespace(ns)
            data = np.zeros(len(hashes) * ns.block_bytes, dtype=np.uint8)
            assert c.put(ns, hashes, data)["written"] == 10
            return tokens

        def submit(tokens: list[int], rid: int,
                   hint: int | None) -> worker_pb2.SubmitResponse:
            req = worker_pb2.SubmitRequest(request_id=rid, output_tokens=1)
            req.tokens.ids.extend(tokens)
            if hint is not None:
                req.store_hint_blocks = hint
            return worker.Submit(req, timeout=60)

        # Hint 0, no pages: the store is not asked; all 160 computed.
        r = submit(prompt_in_store(), 1, 0)
        assert r.store_lookup_skipped
        assert r.onboarded_tokens == 0 and r.prefill_tokens == 160
        # Hint 1 reaches past the (empty) pages: asked, 9 blocks loaded (the
        # last token is always computed).
        r = submit(prompt_in_store(), 2, 1)
        assert not r.store_lookup_skipped
        assert r.onboarded_tokens == 144 and r.prefill_tokens == 16
        # No hint: asked as before.
        r = submit(prompt_in_store(), 3, None)
        assert not r.store_lookup_skipped and r.onboarded_tokens == 144
    finally:
        os.kill(engine.pid, signal.SIGTERM)
        assert engine.wait(timeout=30) == 0


def test_a_draining_engine_saves_what_the_store_lacks(
        tmp_path: Path) -> None:
    """SIGTERM with --drain (issue #48): the router hears "draining", a new
    Submit is UNAVAILABLE, the request in flight finishes, and the cached
    blocks whose saves failed while the store was down reach the restarted
    store, where another engine loads them and continues like a cold run."""
    from conftest import Store
    from kvtier.engine.engine import EngineConfig, namespace_for
    from kvtier.engine.model import ModelConfig
    from test_engine import BT, prompts, run

    store = Store(tmp_path, "store-a")
    port = int(store.address.rsplit(":", 1)[1])
    router, raddr = _serve([str(BUILD / "router" / "kvtier-router"),
                            "--listen=127.0.0.1:0",
                            "--heartbeat-deadline=3s"], tmp_path, "router")
    procs = [router]
    restarted: list[Store] = []
    try:
        engine, eaddr = _serve(
            [str(BUILD / "python" / "kvtier-torch-engine"),
             "--listen=127.0.0.1:0", f"--router={raddr}",
             f"--store={store.address}", "--pages=256", "--heartbeat-ms=100",
             "--deadline-ms=2000", "--max-decode-tokens=1500",
             "--worker-id=torch-drain", "--drain-timeout=30"],
            tmp_path, "engine")
        procs.insert(0, engine)
        worker = worker_pb2_grpc.SimWorkerStub(grpc.insecure_channel(eaddr))
        router_stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(raddr))

        # The store goes; the prompt is computed and its saves fail.
        store.kill()
        prompt, longer = prompts()
        req = worker_pb2.SubmitRequest(request_id=1, output_tokens=1)
        req.tokens.ids.extend(prompt)
        assert worker.Submit(req, timeout=60).prefill_tokens == len(prompt)
        wait_until(lambda: worker.GetWorkerStats(
            worker_pb2.GetWorkerStatsRequest(),
            timeout=10).offload_failures != 0,
            "the saves to fail", timeout=20)
        restarted.append(Store(tmp_path, "store-b", port=port))

        # A long decode is in flight when SIGTERM comes.
        long_req = _submit(2, tokens=40)
        long_req.output_tokens = 1500
        answers: dict[str, object] = {}

        def serve_long() -> None:
            try:
                answers["long"] = worker.Submit(long_req, timeout=120)
            except grpc.RpcError as e:
                answers["long"] = e

        t = threading.Thread(target=serve_long)
        t.start()
        # The engine runs it (its heartbeat says so to the router).
        wait_until(lambda: any(
            s.load.running_requests >= 1 for s in router_stub.ListWorkers(
                router_pb2.ListWorkersRequest(), timeout=5).sources),
            "the long request running on the engine", timeout=20)
        assert t.is_alive(), "the long request ended before SIGTERM"
        os.kill(engine.pid, signal.SIGTERM)

        # New requests are refused, saying why; the router sees draining.
        deadline = time.monotonic() + 10
        while True:
            try:
                worker.Submit(_submit(3, tokens=20), timeout=30)
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE, e
                assert "draining" in e.details()
                break
            assert time.monotonic() < deadline, "never refused"
            time.sleep(0.05)
        wait_until(lambda: any(s.load.draining for s in router_stub.ListWorkers(
            router_pb2.ListWorkersRequest(), timeout=5).sources),
            "the router to hear the engine is draining", timeout=10)

        t.join(timeout=120)
        long_answer = answers["long"]
        assert isinstance(long_answer, worker_pb2.SubmitResponse), long_answer
        assert engine.wait(timeout=60) == 0
        log = (tmp_path / "engine.log").read_text()
        drained = re.search(r"drained in \d+ ms: 0 requests unfinished, "
                            r"(\d+) blocks cached, (\d+) known stored, "
                            r"(\d+) saved \((\d+) bytes\), (\d+) written", log)
        assert drained, log[-3000:]
        full = len(prompt) // BT
        # The prompt's blocks (the first save failed) and the long
        # request's, saved before; nothing stopped the drain.
        cached, known, queued, size, written = map(int, drained.groups())
        block = namespace_for(ModelConfig(), EngineConfig()).block_bytes
        assert known + queued == cached and size == queued * block, log
        assert queued >= full and written >= full, log
        line = next(x for x in log.splitlines() if "drained in" in x)
        assert "stopped by" not in line, line

        # Another engine loads the prompt from the restarted store.
        b = run("reader", restarted, longer, tmp_path)
        assert b["load_status"] == ""
        assert b["loaded_tokens"] == full * BT
        assert b["tokens"] == b["cold_tokens"]
        torch.testing.assert_close(b["logits"], b["cold_logits"], atol=1e-4,
                                   rtol=1e-4)
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
        for s in [store, *restarted]:
            s.stop()
