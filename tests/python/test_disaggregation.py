"""Prefill/decode disaggregation through the store with real engines: two
``vllm serve`` processes of vLLM's CPU build, a prefill engine
(``kv_role: kv_producer``) and a decode engine (``kv_consumer``), kvtier's
connector in both, one kvtier-store, and kvtier-frontend in front of them
(``role=prefill`` and ``role=decode``). Driven over HTTP as an
orchestrator drives them: the prefill answers with ``kv_transfer_params``
naming the fence; the decode given them computes only the prompt's tail
(vLLM's own ``cached_tokens``) and answers the tokens one engine alone
answers; a handoff whose blocks never come is waited for within the
decode's budget, then computed, and counted on vLLM's ``/metrics``.
Through the frontend (the ``openai`` package as the client): a long
prompt is prefilled, then streamed from the decode engine; a short one
goes straight to it; a prefill engine killed mid-prefill costs the
request nothing but time (the decode engine computes it).

Run with the project's environment (tests/python/run_venv_pytest.sh);
skipped, saying why, without it.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from conftest import Store, wait_until
from fleet import BLOCK, EngineSpec, Fleet, get_text, metric_sum
from vllm_server import VllmServer, cached_tokens
from vllm_server import prompt_ids as prompt

pytest.importorskip("vllm", reason="vLLM's CPU build is in the project's environment")
openai = pytest.importorskip(
    "openai", reason="the openai package is in the environment"
)

THRESHOLD = 256  # --pd-threshold: prompt tokens past which a prefill runs first

WAIT_MS = 5000  # the decode's handoff budget here
DOWN_S = 10  # --down: how long an engine that failed is skipped


class PD(Fleet):
    """The store, a prefill engine and a decode engine, each computing on a
    core of its own, as in a P/D deployment: on a shared core the other
    engine's OpenMP threads, spinning after their step, hold the prefill
    engine's background writes (the decode's fence waits on) for ~1 s."""

    def __init__(self, tmp: Path) -> None:
        super().__init__(
            tmp,
            # The prefill's lookups get 1 s: on a busy host a 100 ms one
            # can come back late even from a store whose port refuses, and
            # a late lookup is a slow store, which is handed on (the
            # store-down test asks for a refused one).
            [EngineSpec("prefill", "kv_producer", {"lookup_wait_ms": 1000},
                        role="prefill", core="0"),
             EngineSpec("decode", "kv_consumer", {"handoff_wait_ms": WAIT_MS},
                        role="decode", core="1")],
            store_ram="256MiB",
            frontend_flags=(f"--pd-threshold={THRESHOLD}", "--health-interval=500ms",
                            f"--down={DOWN_S}s"),
        )  # fmt: skip
        self.prefill, self.decode = self.engines["prefill"], self.engines["decode"]


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PD]:
    p = PD(tmp_path_factory.mktemp("pd"))
    try:
        yield p
    finally:
        p.stop()


def complete(
    engine: VllmServer,
    ids: list[int],
    max_tokens: int,
    params: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A greedy completion of token ids, with ``kv_transfer_params``."""
    body: dict[str, Any] = {"model": "tiny", "prompt": ids,
                            "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True}  # fmt: skip
    if params is not None:
        body["kv_transfer_params"] = params
    return engine.post("/v1/completions", body, timeout=120)  # type: ignore[no-any-return]


def metric(engine: VllmServer, name: str, **labels: str) -> float:
    """A metric of vLLM's ``/metrics``, summed over the series whose labels
    include ``labels``."""
    return metric_sum(get_text(engine.url + "/metrics"), name, **labels)


def test_a_decode_computes_only_the_tail_of_what_the_prefill_wrote(pd: PD) -> None:
    """1,000 prompt tokens: the prefill (max_tokens 1, ``do_remote_decode``)
    returns the fence, 31 blocks; the decode sent the same prompt with
    those params right away (its lookups race the prefill's writes: the
    fence holds it) computes only the last 8 tokens: vLLM's
    ``cached_tokens`` is 992, and its 16 tokens are the prefill engine's
    own answer to the whole request."""
    ids = prompt(1, 1000)
    pre = complete(pd.prefill, ids, 1, {"do_remote_decode": True})
    params = pre.get("kv_transfer_params")
    assert params is not None and params["kvtier"]["blocks"] == 31, pre
    assert params["kvtier"]["prompt_tokens"] == 1000
    before = metric(pd.decode, "vllm:kvtier_handoffs_total", outcome="loaded")
    dec = complete(pd.decode, ids, 16, params)
    assert cached_tokens(dec) == 31 * BLOCK, (dec["usage"], pd.decode.tail())
    alone = complete(pd.prefill, ids, 16)
    assert dec["choices"][0]["text"] == alone["choices"][0]["text"]
    deadline = time.monotonic() + 15  # vLLM's loggers publish every few s
    while metric(pd.decode, "vllm:kvtier_handoffs_total", outcome="loaded") <= before:
        assert time.monotonic() < deadline, "the handoff was not counted"
        time.sleep(0.5)
    assert metric(pd.prefill, "vllm:kvtier_handoffs_sent_total") >= 1
    # The prefill's lookup of the prompt answered (nothing held yet).
    lookups = "vllm:kvtier_lookups_total"
    wait_until(
        lambda: metric(pd.prefill, lookups, outcome="answered") >= 1,
        "the prefill's lookup counted",
        15,
    )


def test_a_handoff_whose_blocks_never_come_is_computed_after_its_budget(
    pd: PD,
) -> None:
    """The prefill died before writing (the params name 20 blocks of a
    prompt nobody computed): the decode waits its 5 s budget, computes the
    prompt and answers 200 with one engine's tokens; ``computed`` and the
    20 blocks are counted."""
    ids = prompt(2, 700)
    pre = complete(pd.prefill, prompt(3, 64), 1, {"do_remote_decode": True})
    ns = pre["kv_transfer_params"]["kvtier"]["namespace"]
    params = {"kvtier": {"namespace": ns, "blocks": 20, "prompt_tokens": 700,
                         "block_tokens": BLOCK}}  # fmt: skip
    blocks_before = metric(pd.decode, "vllm:kvtier_handoff_computed_blocks_total")
    t0 = time.monotonic()
    dec = complete(pd.decode, ids, 8, params)
    took = time.monotonic() - t0
    assert took >= WAIT_MS / 1000, took
    assert cached_tokens(dec) == 0, dec["usage"]
    alone = complete(pd.prefill, ids, 8)
    assert dec["choices"][0]["text"] == alone["choices"][0]["text"]
    deadline = time.monotonic() + 15
    while (
        metric(pd.decode, "vllm:kvtier_handoff_computed_blocks_total")
        < blocks_before + 20
    ):
        assert time.monotonic() < deadline, "the computed blocks were not counted"
        time.sleep(0.5)
    assert metric(pd.decode, "vllm:kvtier_handoffs_total", outcome="computed") >= 1


def route_of(headers: Any) -> dict[str, str]:
    """The frontend's x-kvtier-route header as a dict."""
    raw = headers.get("x-kvtier-route", "")
    return dict(part.strip().split("=", 1) for part in raw.split(";") if "=" in part)


def wait_usable(pd: PD, *engines: str) -> None:
    """Waits until the frontend counts each engine usable
    (``kvtier_frontend_engine_up`` 1), so a test does not inherit an
    earlier one's ``--down`` (a prefill that handed nothing on skips its
    engine for 10 s)."""
    deadline = time.monotonic() + DOWN_S + 10
    while True:
        text = frontend_metrics(pd)
        if all(f'kvtier_frontend_engine_up{{engine="{e}"}} 1' in text for e in engines):
            return
        assert time.monotonic() < deadline, f"engines {engines} not usable: {text}"
        time.sleep(0.2)


def test_the_frontend_prefills_a_long_prompt_and_streams_the_decodes_answer(
    pd: PD,
) -> None:
    """A 1,200-token prompt through the frontend: prefilled on the prefill
    engine (its route header names it and the 37 blocks handed off), then
    answered by the decode engine, which computed only the tail and whose
    tokens are one engine's; streamed, it comes chunk by chunk from the
    decode engine. A 100-token prompt goes straight to the decode engine."""
    wait_usable(pd, "prefill", "decode")
    ids = prompt(10, 1200)
    raw = pd.client.completions.with_raw_response.create(
        model="tiny", prompt=ids, max_tokens=12, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    route = route_of(raw.headers)
    assert route["engine"] == "decode" and route.get("prefill") == "prefill", route
    assert route["handoff_blocks"] == "37", route
    answer = raw.parse()
    details = answer.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens == 37 * BLOCK, answer.usage
    alone = complete(pd.prefill, ids, 12)
    assert answer.choices[0].text == alone["choices"][0]["text"]

    streamed = pd.client.completions.with_raw_response.create(
        model="tiny", prompt=prompt(11, 1200), max_tokens=12, temperature=0,
        stream=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert route_of(streamed.headers).get("prefill") == "prefill"
    pieces = [c for c in streamed.parse() if c.choices]
    assert len(pieces) >= 3, pieces
    assert (
        "".join(c.choices[0].text for c in pieces)
        == complete(pd.prefill, prompt(11, 1200), 12)["choices"][0]["text"]
    )

    short = pd.client.completions.with_raw_response.create(
        model="tiny", prompt=prompt(12, 100), max_tokens=4, temperature=0
    )
    route = route_of(short.headers)
    assert route["engine"] == "decode" and "prefill" not in route, route
    metrics = frontend_metrics(pd)
    assert 'kvtier_frontend_handoffs_total{outcome="handed_off"} 2' in metrics, metrics


def frontend_metrics(pd: PD) -> str:
    """The frontend's ``/metrics`` text."""
    return pd.metrics()


def handoffs(pd: PD, outcome: str) -> int:
    """kvtier_frontend_handoffs_total{outcome} (0: not counted yet)."""
    for line in frontend_metrics(pd).splitlines():
        if line.startswith(f'kvtier_frontend_handoffs_total{{outcome="{outcome}"}}'):
            return int(line.rsplit(" ", 1)[1])
    return 0


def test_a_client_that_leaves_during_the_prefill_leaves_nothing_behind(
    pd: PD,
) -> None:
    """The prefill engine held (SIGSTOP); two clients send a streamed
    request each and close their connections: one at once (its close
    reaches the frontend before the request is routed), one once the
    frontend has sent its request to the prefill engine (which holds it).
    For each the frontend closes the prefill's connection, counts
    ``client_gone``, and sends nothing to the decode engine; once the
    prefill engine runs again it has no request left. The frontend's part
    is seen while the prefill engine is still stopped."""
    import socket

    assert pd.prefill.proc is not None
    wait_usable(pd, "prefill", "decode")
    decoded = metric(pd.decode, "vllm:request_success_total")
    gone = handoffs(pd, "client_gone")
    port = int(pd.url.rsplit(":", 1)[1])
    os.killpg(pd.prefill.proc.pid, signal.SIGSTOP)
    try:
        for seed, stay in ((40, False), (41, True)):
            body = json.dumps(
                {"model": "tiny", "prompt": prompt(seed, 1000), "max_tokens": 8,
                 "stream": True}
            ).encode()  # fmt: skip
            with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
                c.sendall(
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                    b"Content-Type: application/json\r\n"
                    + f"Content-Length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                if stay:
                    wait_until(
                        lambda: 'kvtier_frontend_in_flight{engine="prefill"} 1'
                        in frontend_metrics(pd).splitlines(),
                        "the request in flight at the stopped prefill engine",
                    )
        wait_until(
            lambda: handoffs(pd, "client_gone") >= gone + 2,
            "client_gone counted for both clients",
        )
    finally:
        os.killpg(pd.prefill.proc.pid, signal.SIGCONT)
    deadline = time.monotonic() + 20
    while metric(pd.prefill, "vllm:num_requests_running") > 0:
        assert time.monotonic() < deadline, "the prefill engine kept the request"
        time.sleep(0.2)
    assert metric(pd.decode, "vllm:request_success_total") == decoded


def test_with_the_store_down_requests_are_served_colocated(pd: PD) -> None:
    """The store stopped: the prefill engine's lookup fails, so it hands
    nothing on; the frontend sends the request to the decode engine, which
    computes it, well inside the decode's budget (it waits on no fence),
    and the next long request goes straight there (the prefill engine is
    skipped for --down). No request fails; tokens are one engine's. The
    store is started again on its port afterwards."""
    address = pd.store.address
    t0 = time.monotonic()
    answered: float | None = None
    pd.store.stop()
    try:
        ids = prompt(30, 1000)
        raw = pd.client.completions.with_raw_response.create(
            model="tiny", prompt=ids, max_tokens=8, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        answered = time.monotonic()  # the prefill engine was marked down before
        took = answered - t0
        route = route_of(raw.headers)
        assert route["engine"] == "decode", route
        assert route["prefill"].startswith("prefill (failed"), (
            route, pd.prefill.tail(40))
        assert took < WAIT_MS / 1000, took
        # Inside the prefill engine's --down (it began after t0).
        assert time.monotonic() - t0 < DOWN_S - 1, "too slow to judge"
        again = pd.client.completions.with_raw_response.create(
            model="tiny", prompt=prompt(31, 1000), max_tokens=4, temperature=0
        )
        route = route_of(again.headers)
        assert route["engine"] == "decode" and route["prefill"] == "none", route
        alone = complete(pd.decode, ids, 8)
        assert raw.parse().choices[0].text == alone["choices"][0]["text"]
    finally:
        port = int(address.rsplit(":", 1)[1])
        pd.store = Store(pd.tmp, "pd-store-again", ram="256MiB", port=port)
        # The prefill engine's --down passes.
        wait_usable(pd, "prefill", "decode")


def test_a_prefill_engine_killed_mid_prefill_costs_the_request_nothing(
    pd: PD,
) -> None:
    """The prefill engine stopped (SIGSTOP) with the request on its socket,
    then SIGKILLed: the frontend's prefill fails, and the decode engine
    computes the whole prompt: the client gets 200 and one engine's tokens.
    (Kills the prefill engine: the module's last test.)"""
    assert pd.prefill.proc is not None
    ids = prompt(20, 900)
    reference = complete(pd.decode, prompt(21, 64), 1)  # the decode serves
    failed = handoffs(pd, "prefill_failed")
    assert reference["choices"]
    got: dict[str, Any] = {}

    def send() -> None:
        got["raw"] = pd.client.completions.with_raw_response.create(
            model="tiny", prompt=ids, max_tokens=8, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip

    os.killpg(pd.prefill.proc.pid, signal.SIGSTOP)
    t = threading.Thread(target=send)
    t.start()
    # The request sent to the stopped prefill engine.
    wait_until(
        lambda: 'kvtier_frontend_in_flight{engine="prefill"} 1'
        in frontend_metrics(pd).splitlines(),
        "the request in flight at the prefill engine",
    )
    os.killpg(pd.prefill.proc.pid, signal.SIGKILL)
    t.join(timeout=120)
    assert not t.is_alive(), "the request never ended"
    raw = got["raw"]
    route = route_of(raw.headers)
    assert route["engine"] == "decode" and route["prefill"].startswith(
        "prefill (failed"
    ), route
    answer = raw.parse()
    alone = complete(pd.decode, ids, 8)
    assert answer.choices[0].text == alone["choices"][0]["text"]
    assert handoffs(pd, "prefill_failed") == failed + 1
