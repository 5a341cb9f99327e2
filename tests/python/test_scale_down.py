"""Scaling a real vLLM fleet down without losing its cache: two ``vllm
serve`` processes of vLLM's CPU build with kvtier's connector (``kv_both``:
each computed block is saved to the store), one kvtier-store that tells the
frontend's router what it holds, and kvtier-frontend in front of them. A
prompt is served by one engine; that engine is stopped as a scale-down
stops a pod (SIGTERM); the frontend forgets it, and the same prompt is
routed to the engine that stays, which loads the prompt's blocks from the
store (vLLM's own ``cached_tokens``) instead of computing them, and answers
what the first engine answered.

Run with the project's environment (tests/python/run_venv_pytest.sh);
skipped, saying why, without it.
"""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

from conftest import wait_until
from fleet import BLOCK, EngineSpec, Fleet
from vllm_server import cached_tokens
from vllm_server import prompt_ids as prompt

pytest.importorskip("vllm", reason="vLLM's CPU build is in the project's environment")


class ScaledFleet(Fleet):
    """The store (it tells the frontend's router what it holds), two
    kv_both engines, each on a core of its own, and the frontend."""

    def __init__(self, tmp: Path) -> None:
        super().__init__(
            tmp,
            [EngineSpec("e0", "kv_both", core="0"),
             EngineSpec("e1", "kv_both", core="1")],
            store_ram="256MiB",
            store_router=True,
            frontend_flags=("--health-interval=500ms", "--heartbeat-deadline=2s"),
        )  # fmt: skip

    def complete(self, ids: list[int]) -> tuple[dict[str, Any], dict[str, str]]:
        """A greedy completion through the frontend, and its route header."""
        body = {"model": "tiny", "prompt": ids, "max_tokens": 8,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        req = urllib.request.Request(
            self.url + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            raw = r.headers.get("x-kvtier-route", "")
            route = dict(p.strip().split("=", 1) for p in raw.split(";") if "=" in p)
            return json.loads(r.read()), route


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ScaledFleet]:
    f = ScaledFleet(tmp_path_factory.mktemp("scale"))
    try:
        yield f
    finally:
        f.stop()


def test_an_engine_scaled_down_leaves_its_prompt_in_the_fleet(
    fleet: ScaledFleet,
) -> None:
    ids = prompt(21, 8 * BLOCK + 5)  # 8 full blocks
    first, route = fleet.complete(ids)
    holder = route["engine"]
    stays = "e1" if holder == "e0" else "e0"
    # Its connector saved the prompt's blocks; the store told the frontend's
    # router, which now prices them as the store's for either engine. (The
    # store's source registers with its first blocks; until then the sole
    # tokens can read 0 only because the engine's own events are not in.)
    def log_tail() -> str:
        return "the frontend's log:\n" + fleet.log.read_text()[-3000:]

    wait_until(
        lambda: re.search(r"source kvtier-store@\S+ \(store.*registered",
                          fleet.log.read_text()),
        lambda: f"the store's source registered; {log_tail()}",
    )  # fmt: skip
    # Nothing is the holder's alone any more.
    line = f'kvtier_frontend_engine_sole_tokens{{engine="{holder}"}} 0'
    wait_until(lambda: line in fleet.metrics().splitlines(),
               lambda: f"{line}; the metrics:\n{fleet.metrics()[-3000:]}")
    # The scale-down: SIGTERM, as the kubelet sends it after preStop.
    fleet.engines[holder].stop()
    wait_until(
        lambda: f"source {holder} missed its heartbeat deadline"
        in fleet.log.read_text(),
        lambda: f"the router dropping {holder}; {log_tail()}",
        timeout=15,
    )
    second, route = fleet.complete(ids)
    assert route["engine"] == stays, route
    assert int(route["store_blocks"]) == 8, route
    # The engine that stays never saw the prompt: it loaded the 8 blocks
    # from the store (vLLM counts them as cached) and answers the same.
    assert cached_tokens(second) == 8 * BLOCK, second["usage"]
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
