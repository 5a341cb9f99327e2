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
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

from conftest import BUILD, Store, engine_env, served_port
from vllm_server import (
    TINY_LLAMA,
    KvEvents,
    VllmServer,
    cached_tokens,
    free_port,
    kvtier_connector,
)
from vllm_server import prompt_ids as prompt

pytest.importorskip("vllm", reason="vLLM's CPU build is in the project's environment")

FRONTEND_BIN = BUILD / "frontend" / "kvtier-frontend"
BLOCK = 32  # vLLM's CPU attention takes multiples of 32


class ScaledFleet:
    """The store, two kv_both engines and the frontend."""

    def __init__(self, tmp: Path) -> None:
        self.frontend: subprocess.Popen[bytes] | None = None
        router_port = free_port()
        # The store publishes its holdings to the frontend's router (it
        # connects once the frontend listens).
        self.store = Store(tmp, "scale-store", ram="256MiB",
                           flags=(f"--router=127.0.0.1:{router_port}",))  # fmt: skip
        env = engine_env()
        self.engines: dict[str, VllmServer] = {}
        specs = []
        for name, core in (("e0", "0"), ("e1", "1")):
            events = KvEvents(tmp, name)
            self.engines[name] = VllmServer(
                tmp / f"{name}.log",
                start=False,
                env={**env, "VLLM_CPU_OMP_THREADS_BIND": core},
                extra=("--block-size", str(BLOCK), "--enable-prefix-caching",
                       "--enable-prompt-tokens-details", *events.flags(),
                       "--kv-transfer-config",
                       kvtier_connector(self.store.address, "kv_both")),
            )  # fmt: skip
            # The namespace is the connector's: filled in once it logs it.
            specs.append(events.spec(self.engines[name].port, "{ns}", BLOCK))
        try:
            for e in self.engines.values():
                e.start()
            for e in self.engines.values():
                e.wait()
            # The store keys the blocks by the connector's namespace: the
            # frontend must price them in it (the chart's frontend.namespace).
            found = re.search(r"kvtier connector: namespace ([0-9a-f]{16})",
                              self.engines["e0"].log.read_text())
            assert found, self.engines["e0"].log.read_text()[-3000:]
            specs = [spec.format(ns=found.group(1)) for spec in specs]
            port_file = tmp / "frontend.port"
            self.log = tmp / "frontend.log"
            with open(self.log, "wb") as out:
                self.frontend = subprocess.Popen(
                    [str(FRONTEND_BIN), "--listen=127.0.0.1:0",
                     f"--port-file={port_file}", f"--model={TINY_LLAMA}",
                     "--served-model-name=tiny", "--engines=" + ";".join(specs),
                     f"--router-listen=127.0.0.1:{router_port}",
                     "--health-interval=500ms", "--heartbeat-deadline=2s"],
                    stdout=out, stderr=subprocess.STDOUT,
                )  # fmt: skip
            port = served_port(self.frontend, port_file, self.log)
            self.url = f"http://127.0.0.1:{port}"
        except BaseException:
            self.stop()
            raise

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

    def metrics(self) -> str:
        """The frontend's /metrics."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            return str(r.read().decode())

    def stop(self) -> None:
        """Stops the frontend, the engines and the store, each by its pid."""
        if self.frontend is not None and self.frontend.poll() is None:
            self.frontend.send_signal(signal.SIGTERM)
            try:
                self.frontend.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.frontend.kill()
                self.frontend.wait()
        for e in self.engines.values():
            e.stop()
        self.store.stop()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ScaledFleet]:
    if not FRONTEND_BIN.exists():
        pytest.fail(f"{FRONTEND_BIN} is not built (cmake --build build)")
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
    deadline = time.monotonic() + 30
    while not re.search(r"source kvtier-store@\S+ \(store.*registered",
                        fleet.log.read_text()):
        assert time.monotonic() < deadline, fleet.log.read_text()[-3000:]
        time.sleep(0.2)
    while True:
        text = fleet.metrics()
        line = f'kvtier_frontend_engine_sole_tokens{{engine="{holder}"}} 0'
        if line in text:
            break  # nothing is the holder's alone any more
        assert time.monotonic() < deadline, text[-3000:]
        time.sleep(0.2)
    # The scale-down: SIGTERM, as the kubelet sends it after preStop.
    fleet.engines[holder].stop()
    deadline = time.monotonic() + 15
    while f"source {holder} missed its heartbeat deadline" not in fleet.log.read_text():
        assert time.monotonic() < deadline, fleet.log.read_text()[-3000:]
        time.sleep(0.2)
    second, route = fleet.complete(ids)
    assert route["engine"] == stays, route
    assert int(route["store_blocks"]) == 8, route
    # The engine that stays never saw the prompt: it loaded the 8 blocks
    # from the store (vLLM counts them as cached) and answers the same.
    assert cached_tokens(second) == 8 * BLOCK, second["usage"]
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
