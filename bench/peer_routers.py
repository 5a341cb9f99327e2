"""The routers vLLM and SGLang users put in front of their engines, started
as this benchmark's peers: `vllm-router` (PyPI 0.1.17) with `kv_aware` on
the engines' own KV events or `cache_aware`, and `sglang-router` (PyPI
0.3.2) with `cache_aware`. Each runs from its own pinned environment under
BUILD/routers (scripts/peer_routers.sh makes them).

What `kv_aware` needs, read in vllm-router 0.1.17's source (and why a first
try matched nothing): its subscriber keeps only messages whose topic frame
is empty (the engines must publish with topic ""); it hashes each
BlockStored's token ids in blocks of the event's size, and a request's in
blocks of `--kv-event-block-size` (default 16: it must equal the engines'
block size); token ids come from a token-id prompt, or from the engine's
`/v1/completions/render`, which vLLM 0.32 serves only with
`--enable-scale-out` (without it a text prompt gets no prefix credit).
"""

from __future__ import annotations

import os
import re
import subprocess
import urllib.request
from pathlib import Path

from vllm_server import free_port

PEERS = ("vllm-router-kv_aware", "vllm-router-cache_aware", "sglang-router")


class PeerRouter:
    """One peer router over `workers` (http://HOST:PORT each); `events`
    and `replays`: each worker's ZeroMQ endpoints (kv_aware only)."""

    def __init__(
        self,
        build: Path,
        name: str,
        work: Path,
        workers: list[str],
        events: list[str],
        replays: list[str],
        block: int,
        model: str,
    ) -> None:
        self.name = name
        self.port = free_port()
        self.metrics_port = free_port()
        envs = build / "routers"
        if name.startswith("vllm-router"):
            policy = name.split("-")[-1]
            cmd = [
                str(envs / "vllm-router" / "bin" / "vllm-router"),
                "--host", "127.0.0.1", "--port", str(self.port),
                "--policy", policy, "--worker-urls", *workers,
                "--prometheus-host", "127.0.0.1",
                "--prometheus-port", str(self.metrics_port),
                "--log-level", os.environ.get("KVTIER_PEER_LOG", "warning"),
            ]  # fmt: skip
            if policy == "kv_aware":
                for w, e, r in zip(workers, events, replays):
                    cmd += [
                        "--kv-event-source",
                        f"{w}={e}",
                        "--kv-event-replay-source",
                        f"{w}={r}",
                    ]
                cmd += ["--kv-event-block-size", str(block), "--kv-event-model", model]
        elif name == "sglang-router":
            cmd = [
                str(envs / "sglang-router" / "bin" / "python"), "-m",
                "sglang_router.launch_router",
                "--host", "127.0.0.1", "--port", str(self.port),
                "--policy", "cache_aware", "--worker-urls", *workers,
                "--prometheus-host", "127.0.0.1",
                "--prometheus-port", str(self.metrics_port),
                "--log-level", "warn",
            ]  # fmt: skip
        else:
            raise ValueError(
                f"unknown peer router {name!r} (one of {', '.join(PEERS)})"
            )
        if not Path(cmd[0]).exists():
            raise FileNotFoundError(
                f"{cmd[0]} is missing: run scripts/peer_routers.sh {build}"
            )
        self.log = work / f"{name}-{self.port}.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"

    def metric(self, name: str) -> dict[str, float]:
        """Every series of one Prometheus metric, by its label text."""
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5
            ) as r:
                text = r.read().decode()
        except OSError:
            return {}
        out: dict[str, float] = {}
        for line in text.splitlines():
            m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})?\s+(\S+)$", line)
            if m:
                out[m.group(1) or ""] = float(m.group(2))
        return out
