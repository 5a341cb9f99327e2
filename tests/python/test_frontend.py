"""kvtier-frontend in front of two real ``vllm serve`` processes (vLLM's CPU
build, the tiny model with its own tokenizer, prefix caching and KV events
on), driven by the ``openai`` package: completions and chats, streamed and
not; a conversation's second turn goes to the engine that holds its first
(from vLLM's own KV events, seen in the explanation header and in that
engine's prefix-cache hits); a client that disconnects mid-stream aborts
its request in vLLM; bad input gets OpenAI's error shape and status and the
frontend keeps serving; an engine killed mid-run: requests succeed on the
other and the dead engine leaves the router's index.

Run with the project's environment (tests/python/run_venv_pytest.sh);
skipped, saying why, without it. Two engines take both cores for ~2 min to
start.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

import fleet as fleet_module
from conftest import wait_until
from fleet import BLOCK, EngineSpec
from processes import sigstop
from vllm_server import BENCH_SERVE, TINY_LLAMA, VllmServer, prompt_ids

pytest.importorskip("vllm", reason="vLLM's CPU build is in the project's environment")
openai = pytest.importorskip(
    "openai", reason="the openai package is in the environment"
)
transformers = pytest.importorskip(
    "transformers", reason="in the project's environment"
)
h11 = pytest.importorskip("h11", reason="in the project's environment")


class Fleet(fleet_module.Fleet):
    """Two engines (vLLM without kvtier) and the frontend in front of them."""

    def __init__(self, tmp: Path) -> None:
        super().__init__(
            tmp,
            [EngineSpec("e0"), EngineSpec("e1")],
            frontend_flags=("--max-prompt-tokens=2048", "--health-interval=500ms",
                            "--heartbeat-deadline=2s"),
        )  # fmt: skip

    def stored_blocks(self, engine: str) -> float:
        """The blocks the router was told ``engine`` stored (its KV event
        stream's BlockStored hashes, as the frontend counts them)."""
        return self.frontend_metric(
            "kvtier_frontend_vllm_events_total", engine=engine,
            counter="blocks_stored")

    def health_checks(self, engine: str) -> float:
        """The frontend's health checks of ``engine`` that have ended."""
        return self.frontend_metric(
            "kvtier_frontend_engine_health_checks_total", engine=engine)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(tmp_path_factory.mktemp("fleet"))
    try:
        yield f
    finally:
        f.stop()


def route_of(headers: Any) -> dict[str, str]:
    """The x-kvtier-route header as a dict."""
    raw = headers.get("x-kvtier-route", "")
    return dict(part.strip().split("=", 1) for part in raw.split(";") if "=" in part)


def test_completions_and_chats_streamed_or_not(fleet: Fleet) -> None:
    c = fleet.client
    prompt = "The store tiers blocks across RAM and NVMe."
    raw = c.completions.with_raw_response.create(
        model="tiny", prompt=prompt, max_tokens=8
    )
    done = raw.parse()
    assert route_of(raw.headers)["engine"] in fleet.engines
    assert done.usage is not None and done.usage.completion_tokens == 8
    # The ids the frontend sent: the model's tokenizer's, <s> first.
    want = transformers.AutoTokenizer.from_pretrained(str(TINY_LLAMA))(prompt)[
        "input_ids"
    ]
    assert done.usage.prompt_tokens == len(want)
    assert done.choices[0].text
    chat = c.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "What is a KV cache?"}],
        max_tokens=6,
    )
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage is not None and chat.usage.completion_tokens == 6
    pieces = list(
        c.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Stream it."}],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    # Passed through as they came, not as one buffered answer (vLLM merges
    # tokens into one chunk when its reader lags, so not one per token).
    assert len(pieces) >= 3, pieces
    assert pieces[-1].usage is not None and pieces[-1].usage.completion_tokens == 6
    streamed = list(
        c.completions.create(
            model="tiny",
            prompt=[1, 200, 300, 400],
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert sum(1 for p in streamed if p.choices) >= 2, streamed
    assert streamed[-1].usage is not None and streamed[-1].usage.completion_tokens == 5
    listed = c.models.list()
    assert [m.id for m in listed.data] == ["tiny"]


def test_a_conversations_second_turn_goes_to_the_engine_holding_its_first(
    fleet: Fleet,
) -> None:
    c = fleet.client
    systems = [
        f"You are assistant number {i}. " + "Answer about caches and tiers. " * 40
        for i in range(4)
    ]
    first: dict[int, str] = {}
    first_routes: dict[int, dict[str, str]] = {}
    stored_before = {n: fleet.stored_blocks(n) for n in fleet.engines}
    new_blocks = dict.fromkeys(fleet.engines, 0)
    for i, system in enumerate(systems):
        raw = c.chat.completions.with_raw_response.create(
            model="tiny",
            max_tokens=4,
            messages=[
                {"role": "system", "content": system},
                {"role": "user", "content": "First question?"},
            ],
        )
        first_routes[i] = route_of(raw.headers)
        first[i] = first_routes[i]["engine"]
        usage = raw.parse().usage
        assert usage is not None
        new_blocks[first[i]] += usage.prompt_tokens // BLOCK
        # With every engine up, the first attempt goes where the router chose
        # (and counted the route and its pending blocks): never "failover".
        assert first_routes[i]["reason"] != "failover", first_routes[i]
    # Where the first turns go is the load and occupancy terms' choice (new
    # prompts go to the emptier engine); what matters is the second turns.
    # vLLM's events of the first turns' prompt blocks reach the router.
    wait_until(
        lambda: all(
            fleet.stored_blocks(n) - stored_before[n] >= new_blocks[n]
            for n in fleet.engines
        ),
        f"the router told of the blocks each engine stored ({new_blocks})",
    )
    hits_before = {
        n: fleet.engine_metric(n, "vllm:prefix_cache_hits_total") for n in fleet.engines
    }
    for i, system in enumerate(systems):
        raw = c.chat.completions.with_raw_response.create(
            model="tiny",
            max_tokens=4,
            messages=[
                {"role": "system", "content": system},
                {"role": "user", "content": "First question?"},
                {"role": "assistant", "content": "An answer."},
                {"role": "user", "content": "Second question?"},
            ],
        )
        route = route_of(raw.headers)
        # A string, not a tuple: pytest prints it whole (a tuple's repr is cut).
        assert route["engine"] == first[i], (
            f"conversation {i}: second turn {json.dumps(route)}; first turns "
            f"{json.dumps(first_routes)}; frontend log:\n"
            + fleet.log.read_text()[-3000:]
        )
        assert int(route["gpu_blocks"]) >= 10, route  # the system prompt's blocks
    for name in fleet.engines:
        gained = (
            fleet.engine_metric(name, "vllm:prefix_cache_hits_total")
            - hits_before[name]
        )
        turns = sum(1 for e in first.values() if e == name)
        assert gained >= turns * 10 * BLOCK, (name, gained)


def leave_mid_stream(fleet: Fleet, asked: int) -> float:
    """Streams a long completion, leaves after three token events, waits
    until its engine runs nothing, and returns the tokens the engine made
    meanwhile."""

    # Every engine idle first: what the engine generates from here on is
    # this request's alone (an earlier test's request ending meanwhile
    # would count as a success of its own).
    def busy() -> float:
        return sum(fleet.engine_metric(e, "vllm:num_requests_running")
                   + fleet.engine_metric(e, "vllm:num_requests_waiting")
                   for e in fleet.engines)

    wait_until(lambda: busy() == 0, "the engines to be idle", 60)
    req = urllib.request.Request(
        fleet.url + "/v1/completions",
        data=json.dumps(
            {
                "model": "tiny",
                "prompt": "Tell a long story.",
                "max_tokens": asked,
                "ignore_eos": True,
                "stream": True,
            }
        ).encode(),
        headers={"Content-Type": "application/json"},
    )
    r = urllib.request.urlopen(req, timeout=30)
    engine = route_of(r.headers)["engine"]

    def generated() -> float:
        return fleet.engine_metric(engine, "vllm:generation_tokens_total")

    generated_before = generated()
    # Three token events arrived: vLLM runs the request.
    events = 0
    while events < 3:
        line = r.readline()
        assert line, "the stream ended before three events"
        events += line.startswith(b"data: {")
    r.close()
    wait_until(
        lambda: fleet.engine_metric(engine, "vllm:num_requests_running") == 0,
        "vLLM to stop the request its client left",
        20,
    )
    return generated() - generated_before


def test_a_client_that_leaves_mid_stream_aborts_its_request(fleet: Fleet) -> None:
    # The frontend closes the engine's connection when its client leaves,
    # and vLLM aborts the request: it never makes all its tokens (vLLM's
    # success counter is no witness: an earlier test's request can be
    # counted finished after the engine reported itself idle). On a busy
    # host vLLM's engine core can run ahead of its API server, which sees
    # the closed connection only at its next send: the request may then
    # end before the abort reaches the core. So a few tries; one that
    # stops short shows it, and a frontend that never closed the engine's
    # connection fails every one.
    asked = 4000
    disconnects = fleet.frontend_metric("kvtier_frontend_client_disconnects_total")
    made: list[float] = []
    for _ in range(4):
        made.append(leave_mid_stream(fleet, asked))
        if made[-1] < asked:
            break
    assert made[-1] < asked, f"every try ran to its end: {made} tokens"
    assert (fleet.frontend_metric("kvtier_frontend_client_disconnects_total")
            - disconnects) >= len(made), "each client that left is counted"


def test_bad_input_gets_openais_errors_and_the_frontend_keeps_serving(
    fleet: Fleet,
) -> None:
    c = fleet.client
    with pytest.raises(openai.NotFoundError) as nf:
        c.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    assert nf.value.status_code == 404
    with pytest.raises(openai.BadRequestError) as long:
        c.completions.create(model="tiny", prompt=list(range(5, 2100)), max_tokens=1)
    assert "at most 2048" in str(long.value)
    with pytest.raises(openai.BadRequestError) as unknown:
        c.completions.create(
            model="tiny", prompt="x", max_tokens=1, extra_body={"frobnicate": True}
        )
    assert "frobnicate" in str(unknown.value)
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(
            model="tiny", max_tokens=1, messages=[{"role": "wizard", "content": "hi"}]
        )
    for body in (b'{"model": "tiny", "prompt": ', b"[1, 2]", b'{"prompt": {"a": 1}}'):
        req = urllib.request.Request(
            fleet.url + "/v1/completions",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as bad:
            urllib.request.urlopen(req, timeout=10)
        assert bad.value.code == 400
        err = json.loads(bad.value.read())["error"]
        assert err["type"] == "invalid_request_error" and err["message"], err
    assert c.completions.create(model="tiny", prompt="still here", max_tokens=2).choices


def engine_core_pid(server: VllmServer) -> int:
    """The pid of the engine's EngineCore process (in its API server's
    process group: the process that computes): stopping it leaves the API
    server answering /health and /metrics and holding every request it is
    sent."""
    assert server.proc is not None
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            # Its title (setproctitle) is in cmdline: stat's name is cut
            # at 15 characters.
            title = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()
        if int(fields[2]) == server.proc.pid and b"EngineCore" in title:
            return int(stat.parent.name)
    raise AssertionError(f"no EngineCore in process group {server.proc.pid}")


def open_stream(fleet: Fleet, prompt: list[int]) -> Any:
    """A streamed completion sent through the frontend, its header read."""
    req = urllib.request.Request(
        fleet.url + "/v1/completions",
        data=json.dumps(
            {"model": "tiny", "prompt": prompt, "max_tokens": 4, "stream": True}
        ).encode(),
        headers={"Content-Type": "application/json"},
    )
    return urllib.request.urlopen(req, timeout=60)


def test_a_request_waiting_for_its_first_token_weighs_its_uncached_tokens(
    fleet: Fleet,
) -> None:
    """vLLM answers a stream's header at once and its first event with the
    first token: the request waits in the engine's prefill queue until that
    event, and what waits is the part of its prompt the engine computes
    (past the prefix it holds), not its whole prompt. Seen in the next
    route's load, with the holder's EngineCore stopped so the first request
    waits as long as the test needs."""
    system = prompt_ids(71, 20 * BLOCK)
    stored_before = {n: fleet.stored_blocks(n) for n in fleet.engines}
    first = fleet.client.completions.with_raw_response.create(
        model="tiny", prompt=system, max_tokens=2
    )
    holder = route_of(first.headers)["engine"]
    wait_until(
        lambda: fleet.stored_blocks(holder) - stored_before[holder] >= 20,
        f"the router told of the 20 blocks {holder} stored",
    )
    core = engine_core_pid(fleet.engines[holder])
    tail = 200
    streams = []
    sigstop(core)
    try:
        streams.append(open_stream(fleet, system + prompt_ids(72, tail)))
        waiting = route_of(streams[0].headers)
        assert waiting["engine"] == holder, waiting
        assert int(waiting["gpu_blocks"]) == 20, waiting
        # Two health checks: the router has been told the engine's load,
        # and no longer counts the first route as its own.
        checks = fleet.health_checks(holder)
        wait_until(
            lambda: fleet.health_checks(holder) >= checks + 2,
            f"two health checks of {holder}",
        )
        streams.append(open_stream(fleet, system + prompt_ids(73, tail)))
        second = route_of(streams[1].headers)
    finally:
        os.kill(core, signal.SIGCONT)
    # Still the holder: its queue (the first request's 200 uncached tokens)
    # costs less than computing all 840 tokens elsewhere.
    assert second["engine"] == holder, second
    load = float(second["load_tokens"])
    assert tail <= load < len(system) + tail, second
    for r in streams:
        body = r.read().decode()
        assert "data: [DONE]" in body, body[-500:]
        r.close()


def test_a_stream_reaches_its_client_in_whole_events(fleet: Fleet) -> None:
    """A stream the frontend fell behind on is read from the engine in
    pieces that end mid-event; each HTTP chunk the client gets still holds
    whole events (vLLM's own ``vllm bench serve`` strips every read before
    splitting it into events, and misparses an event cut after "data:").
    The frontend is stopped while vLLM streams 100 tokens with logprobs
    (tens of KiB), so it then reads that backlog 4 KiB at a time."""
    port = int(fleet.url.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    conn = h11.Connection(h11.CLIENT)
    received = [0]  # bytes read from the socket by next_event

    def next_event() -> Any:
        while True:
            ev = conn.next_event()
            if ev is not h11.NEED_DATA:
                return ev
            data = sock.recv(65536)
            received[0] += len(data)
            conn.receive_data(data)

    def finished() -> float:
        return sum(
            fleet.engine_metric(n, "vllm:request_success_total") for n in fleet.engines
        )

    finished_before = finished()
    body = json.dumps(
        {
            "model": "tiny",
            "prompt": prompt_ids(74, 40),
            "max_tokens": 100,
            "logprobs": 5,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    try:
        head = h11.Request(
            method="POST",
            target="/v1/completions",
            headers=[
                ("Host", "127.0.0.1"),
                ("Content-Type", "application/json"),
                ("Content-Length", str(len(body))),
            ],
        )
        sock.sendall(conn.send(head) + conn.send(h11.Data(data=body)))
        sock.sendall(conn.send(h11.EndOfMessage()))
        res = next_event()
        assert isinstance(res, h11.Response) and res.status_code == 200, res
        sigstop(fleet.proc.pid)
        try:
            # vLLM streams the whole answer into the stopped frontend's
            # socket.
            wait_until(
                lambda: finished() > finished_before,
                "vLLM done with the request streaming to the stopped frontend",
            )
            # What the frontend relayed before it stopped is not backlog.
            sock.setblocking(False)
            try:
                while data := sock.recv(65536):
                    conn.receive_data(data)
            except BlockingIOError:
                pass
            sock.settimeout(60)
        finally:
            os.kill(fleet.proc.pid, signal.SIGCONT)
        received[0] = 0
        chunks: list[bytes] = []
        piece = b""
        while True:
            ev = next_event()
            if isinstance(ev, h11.Data):
                piece += ev.data
                if ev.chunk_end:
                    chunks.append(piece)
                    piece = b""
            elif isinstance(ev, h11.EndOfMessage):
                break
    finally:
        sock.close()
    text = b"".join(chunks)
    assert text.endswith(b"data: [DONE]\n\n"), text[-200:]
    backlog = received[0]
    assert backlog > 4 * 4096, f"a backlog of {backlog} bytes is no test"
    cut = [c[-40:] for c in chunks if not c.endswith(b"\n\n")]
    assert not cut, f"{len(cut)} of {len(chunks)} chunks end mid-event: {cut[:3]}"
    tokens = sum(
        len(json.loads(ev[len(b"data: ") :])["choices"][0]["logprobs"]["tokens"])
        for ev in text.split(b"\n\n")
        if ev.startswith(b"data: {") and b'"choices":[{' in ev
    )
    assert tokens == 100


MIGRATE = Path("/proc/sys/net/ipv4/tcp_migrate_req")


def test_a_rolling_restart_under_load_loses_no_request(
    fleet: Fleet, tmp_path: Path
) -> None:
    """Two frontends on one address (``--reuse-port``): under vLLM's own
    ``vllm bench serve``, a new frontend starts beside the old one and the
    old one drains on SIGTERM (its listener closed, its queued connections
    handed to the new one by the kernel, each keep-alive connection closed
    after its next answer, its requests in flight answered whole). Every
    request of the run is answered, and both frontends answered some."""
    try:
        was = MIGRATE.read_text().strip()
        MIGRATE.write_text("1")
    except OSError as e:
        pytest.skip(f"net.ipv4.tcp_migrate_req cannot be set here ({e})")
    old: subprocess.Popen[bytes] | None = None
    new: subprocess.Popen[bytes] | None = None
    bench: subprocess.Popen[bytes] | None = None
    try:
        flags = ("--reuse-port", "--drain-timeout=30s")
        old, port = fleet.start_frontend("rollout-old", 0, flags)
        url = f"http://127.0.0.1:{port}"
        result = tmp_path / "bench.json"
        n = 48
        with open(tmp_path / "bench.log", "wb") as out:
            bench = subprocess.Popen(
                [sys.executable, "-c", BENCH_SERVE, "--backend", "openai",
                 "--base-url", url, "--endpoint", "/v1/completions",
                 "--model", "tiny", "--tokenizer", str(TINY_LLAMA),
                 "--dataset-name", "random", "--random-input-len", "64",
                 "--random-output-len", "24", "--ignore-eos",
                 "--num-prompts", str(n), "--request-rate", "4", "--seed", "0",
                 "--save-result", "--result-dir", str(tmp_path),
                 "--result-filename", result.name, "--disable-tqdm"],
                stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip

        def answered(u: str) -> float:
            return fleet_module.metric_sum(
                fleet_module.get_text(u + "/metrics"),
                "kvtier_frontend_requests_total", endpoint="completions")

        wait_until(lambda: answered(url) >= 8, "the old frontend answering the load",
                   120)  # fmt: skip
        new, _ = fleet.start_frontend("rollout-new", port, flags)
        old.send_signal(signal.SIGTERM)
        assert old.wait(timeout=40) == 0
        log = (fleet.tmp / "rollout-old.log").read_text()
        assert "drained: every request in flight ended" in log, log[-2000:]
        bench_log = tmp_path / "bench.log"
        assert bench.wait(timeout=120) == 0, bench_log.read_text()[-3000:]
        res = json.loads(result.read_text())
        assert (res["completed"], res.get("failed", 0)) == (n, 0), res
        assert answered(url) > 0, "the new frontend answered none"
    finally:
        for p in (bench, old, new):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(timeout=40)
        MIGRATE.write_text(was)


def test_keys_rates_and_vllms_own_endpoints_through_the_openai_package(
    fleet: Fleet, tmp_path: Path
) -> None:
    """A frontend asking for API keys (their SHA-256 in a file), with a
    token rate per key, in front of the real engines: the ``openai``
    package's key is taken, another is refused (AuthenticationError), a
    key past its rate gets RateLimitError; vLLM's /tokenize and
    /detokenize pass through and answer as the engine itself does."""
    keys = tmp_path / "keys"
    digest = hashlib.sha256(b"sk-kvtier-test").hexdigest()
    keys.write_text(f"# sha256 name tokens-per-minute\n{digest} tester 200\n")
    proc, port = fleet.start_frontend("keys", 0, (f"--api-keys-file={keys}",))
    try:
        url = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=url + "/v1", api_key="sk-kvtier-test",
                               max_retries=0)  # fmt: skip
        done = client.completions.create(model="tiny", prompt="Keys", max_tokens=4)
        assert done.usage is not None and done.usage.completion_tokens == 4
        wrong = openai.OpenAI(base_url=url + "/v1", api_key="sk-other", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.completions.create(model="tiny", prompt="Keys", max_tokens=4)
        with pytest.raises(openai.RateLimitError) as over:
            for _ in range(8):  # 200 tokens a minute: a few of ~50 each
                client.completions.create(model="tiny", prompt="Keys", max_tokens=48)
        assert int(over.value.response.headers["retry-after"]) >= 1

        def post(base: str, path: str, body: dict[str, Any], key: str = "") -> Any:
            headers = {"content-type": "application/json"}
            if key:
                headers["authorization"] = "Bearer " + key
            req = urllib.request.Request(base + path, json.dumps(body).encode(),
                                         headers)  # fmt: skip
            with urllib.request.urlopen(req, timeout=30) as r:
                return json.loads(r.read())

        text = {"model": "tiny", "prompt": "The store tiers blocks."}
        engine = next(iter(fleet.engines.values())).url
        through = post(url, "/tokenize", text, "sk-kvtier-test")
        assert through == post(engine, "/tokenize", text)
        back = post(url, "/detokenize", {"model": "tiny", "tokens": through["tokens"]},
                    "sk-kvtier-test")  # fmt: skip
        assert "The store tiers blocks." in back["prompt"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=40)


def test_a_killed_engine_is_skipped_and_leaves_the_index(fleet: Fleet) -> None:
    c = fleet.client
    victim = fleet.engines["e1"]
    assert victim.proc is not None
    os.killpg(victim.proc.pid, signal.SIGKILL)
    assert victim.proc is not None
    victim.proc.wait()
    served = []
    for i in range(6):
        raw = c.completions.with_raw_response.create(
            model="tiny", prompt=f"Prompt number {i} after a crash.", max_tokens=2
        )
        served.append(route_of(raw.headers)["engine"])
        assert raw.parse().choices
    assert set(served) == {"e0"}, served
    # Two failed health checks mark it down; the router drops its blocks
    # at its heartbeat deadline. The two are not ordered: each is awaited.

    def engines_up() -> int:
        with urllib.request.urlopen(fleet.url + "/health", timeout=10) as r:
            return int(json.loads(r.read())["engines_up"])

    wait_until(lambda: engines_up() == 1, "/health counting one engine up", 10)
    wait_until(
        lambda: "source e1 missed its heartbeat deadline" in fleet.log.read_text(),
        "the router dropping e1 at its heartbeat deadline",
        10,
    )
