"""Prefill/decode disaggregation through the store with real engines: two
``vllm serve`` processes of vLLM's CPU build, a prefill engine
(``kv_role: kv_producer``) and a decode engine (``kv_consumer``), kvtier's
connector in both, one kvtier-store; driven over HTTP as an orchestrator
(the frontend, llm-d's sidecar) drives them. The prefill answers with
``kv_transfer_params`` naming the fence; the decode given them computes
only the prompt's tail (vLLM's own ``cached_tokens``) and answers the
tokens one engine alone answers; a handoff whose blocks never come is
waited for within the decode's budget, then computed, and counted on
vLLM's ``/metrics``.

Run with the project's environment (tests/python/run_venv_pytest.sh);
skipped, saying why, without it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from conftest import Store, engine_env
from vllm_server import VllmServer

pytest.importorskip("vllm", reason="vLLM's CPU build is in the project's environment")

BLOCK = 32  # vLLM's CPU attention takes multiples of 32
WAIT_MS = 2000  # the decode's handoff budget here


def connector(stores: str, role: str, **extra: Any) -> str:
    """kvtier as vLLM's KV connector in ``role``, as docs/disaggregation.md
    gives it."""
    return json.dumps(
        {
            "kv_connector": "KvtierConnector",
            "kv_connector_module_path": "kvtier.integrations.vllm",
            "kv_role": role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"stores": stores, **extra},
        }
    )


class PD:
    """The store, a prefill engine and a decode engine."""

    def __init__(self, tmp: Path) -> None:
        self.store = Store(tmp, "pd-store", ram="256MiB")
        env = engine_env()
        common = ("--block-size", str(BLOCK), "--enable-prefix-caching",
                  "--enable-prompt-tokens-details")  # fmt: skip
        self.prefill = VllmServer(
            tmp / "prefill.log",
            start=False,
            env=env,
            extra=(*common, "--kv-transfer-config",
                   connector(self.store.address, "kv_producer")),
        )  # fmt: skip
        self.decode = VllmServer(
            tmp / "decode.log",
            start=False,
            env=env,
            extra=(*common, "--kv-transfer-config",
                   connector(self.store.address, "kv_consumer",
                             handoff_wait_ms=WAIT_MS)),
        )  # fmt: skip
        try:
            self.prefill.start()
            self.decode.start()
            self.prefill.wait()
            self.decode.wait()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stops both engines and the store, each by its pid."""
        self.prefill.stop()
        self.decode.stop()
        self.store.stop()


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PD]:
    p = PD(tmp_path_factory.mktemp("pd"))
    try:
        yield p
    finally:
        p.stop()


def prompt(seed: int, length: int) -> list[int]:
    """Token ids of a deterministic prompt (the tiny model's vocabulary)."""
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(10, 4000, size=length)]


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
    import urllib.request

    with urllib.request.urlopen(engine.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def cached(answer: dict[str, Any]) -> int:
    """The prompt tokens the engine did not compute (vLLM's own count)."""
    details = answer["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


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
    assert cached(dec) == 31 * BLOCK, (dec["usage"], pd.decode.tail())
    alone = complete(pd.prefill, ids, 16)
    assert dec["choices"][0]["text"] == alone["choices"][0]["text"]
    deadline = time.monotonic() + 15  # vLLM's loggers publish every few s
    while metric(pd.decode, "vllm:kvtier_handoffs_total", outcome="loaded") <= before:
        assert time.monotonic() < deadline, "the handoff was not counted"
        time.sleep(0.5)
    assert metric(pd.prefill, "vllm:kvtier_handoffs_sent_total") >= 1


def test_a_handoff_whose_blocks_never_come_is_computed_after_its_budget(
    pd: PD,
) -> None:
    """The prefill died before writing (the params name 20 blocks of a
    prompt nobody computed): the decode waits its 2 s budget, computes the
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
    assert cached(dec) == 0, dec["usage"]
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
