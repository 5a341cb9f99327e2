"""A real ``vllm serve`` (the OpenAI API server of vLLM's CPU build) on
127.0.0.1, for tests that talk HTTP to an engine. Stopped by its process
group (vLLM's engine core runs in a child process)."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TINY_LLAMA = ROOT / "tests" / "models" / "tiny-llama"
# `vllm bench serve` (vLLM's own client) as `python -c BENCH_SERVE ARGS...`,
# without the `vllm` CLI's startup.
BENCH_SERVE = (
    "import sys\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "p = FlexibleArgumentParser()\n"
    "add_cli_args(p)\n"
    "main(p.parse_args(sys.argv[1:]))\n"
)


def kvtier_connector(stores: str, role: str, **extra: Any) -> str:
    """``--kv-transfer-config``: kvtier's connector in vLLM ``role``
    (kv_producer, kv_consumer, kv_both) with its stores and extra keys, as
    docs/disaggregation.md gives it."""
    return json.dumps(
        {
            "kv_connector": "KvtierConnector",
            "kv_connector_module_path": "kvtier.integrations.vllm",
            "kv_role": role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"stores": stores, **extra},
        }
    )


def prompt_ids(seed: int, length: int) -> list[int]:
    """Token ids of a deterministic prompt in the tiny model's vocabulary."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(10, 4000, size=length)]


def cached_tokens(answer: dict[str, Any]) -> int:
    """The prompt tokens vLLM did not compute for a completion (its usage's
    ``prompt_tokens_details.cached_tokens``; --enable-prompt-tokens-details)."""
    details = answer["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


_GIVEN: set[int] = set()


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on now, below the kernel's
    ephemeral range, and not one this process was given before.
    - Below the range: a client that keeps connecting to the port before its
      server starts (a store to its router) is never given it as its own
      source port; a TCP self-connect would hold it and the server could
      not listen (seen in CI, twice).
    - Not given before: two ports given out before either server binds would
      otherwise collide (seen in CI: an engine's API port equal to its
      replay socket's, so /health reached the ZMQ socket for 600 s)."""
    lowest = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, lowest - 10000), lowest)
        if port in _GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _GIVEN.add(port)
        return port
    raise RuntimeError("no free port below the ephemeral range")


class KvEvents:
    """vLLM's ZeroMQ KV-event publisher for one engine: the flags that
    turn it on, and the frontend's ``--engines`` spec that subscribes to it.
    vLLM's publisher binds an ipc:// endpoint (it connects to a plain
    tcp://HOST:PORT); its replay socket binds either way."""

    def __init__(self, tmp: Path, name: str) -> None:
        self.name = name
        self.endpoint = f"ipc://{tmp}/{name}-kv-events"
        self.replay = f"tcp://127.0.0.1:{free_port()}"

    def flags(self) -> tuple[str, str]:
        """``--kv-events-config`` and its JSON."""
        cfg = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay,
            "topic": "kv-events",
        }
        return "--kv-events-config", json.dumps(cfg)

    def spec(self, port: int, namespace: str, block: int, **more: str) -> str:
        """The frontend's spec of the engine serving on ``port``
        (``more``: further keys, e.g. ``role``)."""
        extra = "".join(f",{k}={v}" for k, v in more.items())
        return (
            f"id={self.name},endpoint=127.0.0.1:{port},events={self.endpoint},"
            f"replay={self.replay},topic=kv-events,namespace={namespace},"
            f"block-tokens={block}{extra}"
        )


class VllmServer:
    """``python -m vllm.entrypoints.openai.api_server`` with the tiny model
    (dummy weights, its own tokenizer) unless ``model`` says otherwise.
    With ``start`` (the default) it is started and waited for; else call
    ``start()`` then ``wait()`` (to start several at once). ``url`` serves
    once ``wait()`` returned; ``stop()`` ends the whole group."""

    def __init__(
        self,
        log: Path,
        model: Path = TINY_LLAMA,
        name: str = "tiny",
        extra: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        timeout: float = 600,
        start: bool = True,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.name = name
        self.timeout = timeout
        self.env = dict(env if env is not None else os.environ)
        # 1 GiB of KV memory, not vLLM's default share of the machine's.
        self.env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        self.args = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model), "--served-model-name", name,
            "--load-format", "dummy", "--dtype", "bfloat16",
            "--max-model-len", "4096", "--host", "127.0.0.1",
            "--port", str(self.port), *extra,
        ]  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None
        if start:
            self.start()
            self.wait()

    def start(self) -> None:
        """Starts the server's process (in a session of its own)."""
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                self.args,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )

    def wait(self) -> None:
        """Returns once /health answers 200; RuntimeError, with the log's
        tail, if the server exits or does not answer within the timeout."""
        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vllm serve exited {self.proc.returncode}:\n{self.tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(
            f"vllm serve did not answer /health in {self.timeout:.0f} s:\n{self.tail()}"
        )

    def tail(self, lines: int = 30) -> str:
        """The last lines of the server's log."""
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def post(self, path: str, body: dict[str, Any], timeout: float = 60) -> Any:
        """POSTs JSON; the decoded JSON answer (HTTPError on a non-2xx)."""
        req = urllib.request.Request(
            self.url + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        """SIGTERM to the group, SIGKILL after 20 s; waits for the server."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        except ProcessLookupError:
            pass
