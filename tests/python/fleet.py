"""One fleet for the tests that need real ``vllm serve`` engines behind
kvtier-frontend: optionally a kvtier-store, N engines (vLLM's CPU build, the
tiny model, prefix caching and KV events on), each with kvtier's connector
in a role or none, and the frontend in front of them. Each test module
builds the fleet it needs once (a module-scoped fixture) and stops it by
its pids; test_frontend.py, test_disaggregation.py and test_scale_down.py
use it.
"""

from __future__ import annotations

import re
import signal
import subprocess
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conftest import BUILD, Store, engine_env, served_port
from vllm_server import TINY_LLAMA, KvEvents, VllmServer, free_port, kvtier_connector

FRONTEND_BIN = BUILD / "frontend" / "kvtier-frontend"
BLOCK = 32  # vLLM's CPU attention takes multiples of 32
NAMESPACE = "00c0ffee00c0ffee"  # the router's, for engines without kvtier


@dataclass
class EngineSpec:
    """One engine of a fleet.

    ``connector``: kvtier's connector in this vLLM role (kv_producer,
    kv_consumer, kv_both), or None for vLLM without kvtier.
    ``connector_extra``: more keys of the connector's extra config.
    ``role``: the frontend's role for it (prefill, decode), or None.
    ``core``: the core its threads are bound to (VLLM_CPU_OMP_THREADS_BIND),
    or None for vLLM's default."""

    name: str
    connector: str | None = None
    connector_extra: dict[str, Any] = field(default_factory=dict)
    role: str | None = None
    core: str | None = None


def metric_sum(text: str, metric: str, **labels: str) -> float:
    """A Prometheus metric's value in ``text``, summed over its label sets
    that carry every label of ``labels`` (0 when there is none)."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    total = 0.0
    for line in text.splitlines():
        name, brace, rest = line.partition("{")
        if brace:
            label_set, _, value = rest.rpartition("} ")
            if name == metric and all(w in label_set.split(",") for w in want):
                total += float(value)
        elif not want and line.startswith(metric + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def get_text(url: str) -> str:
    """GET ``url``'s body as text."""
    with urllib.request.urlopen(url, timeout=10) as r:
        return str(r.read().decode())


class Fleet:
    """A store (when ``store_ram`` is set), the engines and the frontend.

    ``store_router``: the store tells the frontend's router what it holds.
    ``frontend_flags``: the frontend's flags beyond listen, model and
    engines. Every process is stopped by its pid in :meth:`stop` (also
    when starting fails)."""

    def __init__(
        self,
        tmp: Path,
        engines: list[EngineSpec],
        store_ram: str | None = None,
        store_router: bool = False,
        frontend_flags: tuple[str, ...] = (),
    ) -> None:
        self.tmp = tmp
        self.store: Store | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.engines: dict[str, VllmServer] = {}
        self.specs: list[str] = []  # the frontend's --engines
        try:
            self._start(engines, store_ram, store_router, frontend_flags)
        except BaseException:
            self.stop()
            raise

    def _start(
        self,
        engines: list[EngineSpec],
        store_ram: str | None,
        store_router: bool,
        frontend_flags: tuple[str, ...],
    ) -> None:
        if not FRONTEND_BIN.exists():
            raise RuntimeError(f"{FRONTEND_BIN} is not built (cmake --build build)")
        router_port = free_port()
        if store_ram is not None:
            flags = (f"--router=127.0.0.1:{router_port}",) if store_router else ()
            self.store = Store(self.tmp, "fleet-store", ram=store_ram, flags=flags)
        env = engine_env()
        specs = []
        for e in engines:
            events = KvEvents(self.tmp, e.name)
            extra: tuple[str, ...] = (
                "--block-size", str(BLOCK), "--enable-prefix-caching",
                "--enable-prompt-tokens-details", *events.flags(),
            )  # fmt: skip
            if e.connector is not None:
                assert self.store is not None, "a kvtier engine needs the store"
                extra += ("--kv-transfer-config",
                          kvtier_connector(self.store.address, e.connector,
                                           **e.connector_extra))
            self.engines[e.name] = VllmServer(
                self.tmp / f"{e.name}.log",
                start=False,
                env={**env, "VLLM_CPU_OMP_THREADS_BIND": e.core} if e.core else env,
                extra=extra,
            )
            more = {"role": e.role} if e.role else {}
            # A kvtier engine's namespace is its connector's: filled in
            # once it logs it.
            ns = "{ns}" if e.connector is not None else NAMESPACE
            specs.append(events.spec(self.engines[e.name].port, ns, BLOCK, **more))
        for server in self.engines.values():
            server.start()
        for server in self.engines.values():
            server.wait()
        if any(e.connector is not None for e in engines):
            # The store keys blocks by the connector's namespace: the
            # frontend prices them in it (the chart's frontend.namespace).
            first = next(e.name for e in engines if e.connector is not None)
            log = self.engines[first].log.read_text()
            found = re.search(r"kvtier connector: namespace ([0-9a-f]{16})", log)
            assert found, log[-3000:]
            specs = [s.replace("{ns}", found.group(1)) for s in specs]
        self.specs = specs
        self.log = self.tmp / "frontend.log"
        router = (f"--router-listen=127.0.0.1:{router_port}",) if store_router else ()
        self.proc, port = self.start_frontend("frontend", 0, (*router, *frontend_flags))
        self.url = f"http://127.0.0.1:{port}"
        import openai

        # The frontend's OpenAI client (no retries: a test sees each answer).
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none",
                                    max_retries=0)

    def start_frontend(
        self, name: str, port: int, flags: tuple[str, ...]
    ) -> tuple[subprocess.Popen[bytes], int]:
        """A frontend in front of the fleet's engines on 127.0.0.1:``port``
        (0: any free one), logging to TMP/NAME.log, with ``flags`` besides;
        returns it and its port once it listens."""
        port_file = self.tmp / f"{name}.port"
        port_file.unlink(missing_ok=True)
        log = self.tmp / f"{name}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [str(FRONTEND_BIN), f"--listen=127.0.0.1:{port}",
                 f"--port-file={port_file}",
                 f"--model={TINY_LLAMA}", "--served-model-name=tiny",
                 "--route-header", "--engines=" + ";".join(self.specs), *flags],
                stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        return proc, served_port(proc, port_file, log)

    def metrics(self) -> str:
        """The frontend's /metrics text."""
        return get_text(self.url + "/metrics")

    def frontend_metric(self, metric: str, **labels: str) -> float:
        """One of the frontend's metrics (see :func:`metric_sum`)."""
        return metric_sum(self.metrics(), metric, **labels)

    def engine_metric(self, name: str, metric: str, **labels: str) -> float:
        """One of engine ``name``'s own vLLM metrics (see :func:`metric_sum`)."""
        text = get_text(self.engines[name].url + "/metrics")
        return metric_sum(text, metric, **labels)

    def stop(self) -> None:
        """Stops the frontend, the engines and the store, each by its pid."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for server in self.engines.values():
            server.stop()
        if self.store is not None:
            self.store.stop()
