"""kvtier-frontend finding its engines by DNS, as it does behind a Kubernetes
headless Service: the frontend runs in a mount namespace of its own whose
``/etc/hosts`` is a file the test rewrites (the C library's resolver reads
it at each resolution, as it reads a cluster's DNS answers). The engines
are nginx servers on 127.0.0.2-4 answering a canned completion, their
``/health`` and a ``/metrics`` in vLLM's format: what is under test is the
fleet's membership (an address that appears joins, one that goes leaves,
a failed resolution keeps the fleet) and the load read from each engine's
metrics; the real engines' side is test_frontend.py's.

Skipped, saying why, without nginx or without the right to make a mount
namespace (root, as in CI).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

from conftest import BUILD, served_port, wait_until
from vllm_server import TINY_LLAMA, free_port

FRONTEND_BIN = BUILD / "frontend" / "kvtier-frontend"
NAME = "engines.kvtier.test"
PREFILL_NAME = "prefill.kvtier.test"  # the prefill pool's Service, when there is one
NAMESPACE = "00c0ffee00c0ffee"


def _can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    r = subprocess.run(
        ["unshare", "-m", "true"], capture_output=True, timeout=10, check=False
    )
    return r.returncode == 0


pytestmark = [
    pytest.mark.skipif(shutil.which("nginx") is None, reason="nginx is not installed"),
    pytest.mark.skipif(
        not _can_unshare(), reason="cannot make a mount namespace (needs root)"
    ),
]


def _nginx_conf(tmp: Path, port: int) -> str:
    """One server per engine address; each names itself in its answers and
    in its metrics runs as many requests as its last octet; 127.0.0.5 has a
    deep queue (40 waiting), the others none."""
    servers = []
    for octet in (2, 3, 4, 5):
        completion = json.dumps(
            {
                "id": f"cmpl-{octet}",
                "object": "text_completion",
                "model": "tiny",
                "choices": [
                    {"index": 0, "text": f"engine {octet}", "finish_reason": "length"}
                ],
                "usage": {
                    "prompt_tokens": 1,
                    "completion_tokens": 1,
                    "total_tokens": 2,
                },
            }
        )
        metrics = (
            f'vllm:num_requests_running{{engine="0",model_name="tiny"}} {octet}.0\\n'
            f'vllm:num_requests_waiting{{engine="0",model_name="tiny"}} '
            f"{40 if octet == 5 else 0}.0\\n"
            f'vllm:kv_cache_usage_perc{{engine="0",model_name="tiny"}} 0.25\\n'
        )
        servers.append(
            f"""
  server {{
    listen 127.0.0.{octet}:{port};
    location = /health {{ return 200 ''; }}
    location = /metrics {{ default_type text/plain; return 200 '{metrics}'; }}
    location / {{ default_type application/json; return 200 '{completion}'; }}
  }}"""
        )
    return f"""
daemon off;
worker_processes 1;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log;
events {{ worker_connections 256; }}
http {{
  access_log off;
  client_body_temp_path {tmp};
  {''.join(servers)}
}}
"""


class DnsFleet:
    """nginx as three engines and the frontend resolving them by name. With
    ``prefill`` the frontend also resolves PREFILL_NAME, a second pool of
    role prefill (the decode pool is NAME's, role decode), with
    --pd-threshold 4."""

    def __init__(self, tmp: Path, prefill: list[int] | None = None) -> None:
        self.tmp = tmp
        self.hosts = tmp / "hosts"
        self.prefill = prefill
        self.set_addresses([2, 3])
        self.port = free_port()
        conf = tmp / "nginx.conf"
        conf.write_text(_nginx_conf(tmp, self.port))
        self.nginx = subprocess.Popen(
            ["nginx", "-p", str(tmp), "-c", str(conf)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        port_file = tmp / "frontend.port"
        self.log = tmp / "frontend.log"
        dns = (
            f"name={NAME}:{self.port},events-port={free_port()},"
            f"namespace={NAMESPACE},block-tokens=32"
        )
        pd = []
        if prefill is not None:
            dns += (
                f",role=decode;name={PREFILL_NAME}:{self.port},"
                f"events-port={free_port()},namespace={NAMESPACE},block-tokens=32,"
                "role=prefill"
            )
            pd = ["--pd-threshold=4"]
        frontend = " ".join(
            [
                str(FRONTEND_BIN),
                "--listen=127.0.0.1:0",
                "--route-header",
                f"--port-file={port_file}",
                f"--model={TINY_LLAMA}",
                "--served-model-name=tiny",
                f"'--engines-dns={dns}'",
                "--dns-interval=200ms",
                "--health-interval=200ms",
                *pd,
            ]
        )
        # exec: the frontend keeps the shell's pid, which the test stops.
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [
                    "unshare",
                    "-m",
                    "sh",
                    "-c",
                    f"mount --bind {self.hosts} /etc/hosts && exec {frontend}",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        port = served_port(self.proc, port_file, self.log)
        self.url = f"http://127.0.0.1:{port}"

    def set_addresses(self, octets: list[int]) -> None:
        """What the name resolves to from now on (the file is rewritten in
        place: the bind mount shows the same inode)."""
        with open(self.hosts, "w") as f:
            f.write("127.0.0.1 localhost\n")
            for o in octets:
                f.write(f"127.0.0.{o} {NAME}\n")
            for o in self.prefill or []:
                f.write(f"127.0.0.{o} {PREFILL_NAME}\n")

    def complete(self, prompt: str = "hello there") -> tuple[int, str, str]:
        """One completion: (status, the engine that answered, the route header)."""
        req = urllib.request.Request(
            self.url + "/v1/completions",
            data=json.dumps(
                {"model": "tiny", "prompt": prompt, "max_tokens": 1}
            ).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                body = json.loads(r.read())
                return r.status, body["choices"][0]["text"], r.headers["x-kvtier-route"]
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(), ""

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            return str(r.read().decode())

    def metric(self, line_start: str) -> float:
        """The value of the frontend's metric line that starts with
        ``line_start`` (its name and labels), 0 when there is none."""
        for line in self.metrics().splitlines():
            if line.startswith(line_start + " "):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def engines(self) -> set[str]:
        """The engines the frontend serves now, from its metrics."""
        out = set()
        for line in self.metrics().splitlines():
            if line.startswith("kvtier_frontend_engine_up{"):
                out.add(line.split('engine="', 1)[1].split('"', 1)[0])
        return out

    def wait_engines(self, octets: list[int], timeout: float = 10) -> None:
        want = {f"127.0.0.{o}:{self.port}" for o in octets}
        deadline = time.monotonic() + timeout
        while self.engines() != want:
            assert time.monotonic() < deadline, (self.engines(), want)
            time.sleep(0.05)

    def served_by(self, n: int) -> set[str]:
        """The engines that answered n different prompts (the router breaks
        ties by the prompt's hash: one prompt would always go one way)."""
        seen = set()
        for i in range(n):
            status, text, route = self.complete(f"question {i} of {n}: how are you?")
            assert status == 200, text
            assert route.startswith("engine=127.0.0."), route
            seen.add(text)
        return seen

    def stop(self) -> None:
        for p in (self.proc, self.nginx):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[DnsFleet]:
    f = DnsFleet(tmp_path)
    try:
        yield f
    finally:
        f.stop()


def test_engines_join_and_leave_as_the_name_resolves(fleet: DnsFleet) -> None:
    fleet.wait_engines([2, 3])
    # The router spreads requests by load: both engines answer.
    assert fleet.served_by(12) == {"engine 2", "engine 3"}

    fleet.set_addresses([3, 4])
    fleet.wait_engines([3, 4])
    assert fleet.served_by(12) == {"engine 3", "engine 4"}
    log = fleet.log.read_text()
    assert f"engine 127.0.0.2:{fleet.port} left the fleet (gone from DNS" in log
    assert f"engine 127.0.0.4:{fleet.port} joined the fleet" in log
    # The engine that left leaves the metrics too (pod IPs come and go:
    # series kept for each would grow without end).
    gone = f'engine="127.0.0.2:{fleet.port}"'
    assert gone not in fleet.metrics(), "series of an engine gone from DNS"


def test_a_prefill_pool_and_a_decode_pool_each_keep_their_role(
    tmp_path: Path,
) -> None:
    """Two names, two pools (as the chart's prefill and decode Services):
    engines join with their pool's role. A long prompt goes to the prefill
    pool's engine first; its answer carries no kv_transfer_params (as
    vLLM's offloading connector with kvtier's tier answers), so the decode
    pool's engine is sent vLLM's remote_prefiller keys alone
    (``handoff_blocks=prompt``) and answers; no request is ever answered by
    the prefill engine."""
    fleet = DnsFleet(tmp_path, prefill=[4])
    try:
        fleet.wait_engines([2, 3, 4])
        log = fleet.log.read_text()
        assert f"127.0.0.4:{fleet.port} joined the fleet (DNS {PREFILL_NAME}" in log
        assert "role prefill)" in log and "role decode)" in log
        status, text, route = fleet.complete("a prompt long enough for a prefill")
        assert status == 200, text
        assert text in ("engine 2", "engine 3"), route
        assert f"prefill=127.0.0.4:{fleet.port}; handoff_blocks=prompt" in route, route
        assert fleet.served_by(8) <= {"engine 2", "engine 3"}
    finally:
        fleet.stop()


def test_a_failed_resolution_keeps_the_fleet(fleet: DnsFleet) -> None:
    fleet.wait_engines([2, 3])
    failed = (
        "kvtier_frontend_dns_resolutions_total"
        f'{{name="{NAME}:{fleet.port}",outcome="failed"}}'
    )
    fleet.set_addresses([])  # the name no longer resolves
    wait_until(lambda: fleet.metric(failed) >= 5, "five failed resolutions")
    assert fleet.engines() == {f"127.0.0.{o}:{fleet.port}" for o in (2, 3)}
    assert fleet.served_by(6) <= {"engine 2", "engine 3"}
    assert f"cannot resolve {NAME}" in fleet.log.read_text()


def test_each_engines_own_metrics_feed_its_load(fleet: DnsFleet) -> None:
    fleet.set_addresses([2, 5])
    fleet.wait_engines([2, 5])
    want = {
        f'kvtier_frontend_engine_load{{engine="127.0.0.{o}:{fleet.port}",'
        f'gauge="running"}} {o}'
        for o in (2, 5)
    } | {
        f'kvtier_frontend_engine_load{{engine="127.0.0.5:{fleet.port}",'
        'gauge="waiting"} 40'
    }
    deadline = time.monotonic() + 10
    while not want <= set(fleet.metrics().splitlines()):
        assert time.monotonic() < deadline, fleet.metrics()
        time.sleep(0.1)
    assert (
        f'kvtier_frontend_engine_load{{engine="127.0.0.2:{fleet.port}",'
        'gauge="kv_usage"} 0.25'
    ) in fleet.metrics().splitlines()
    # The queue 127.0.0.5 reports (other frontends' requests) is priced at
    # the mean of the tokens routes here expected engines to compute (these
    # engines hold nothing: whole prompts): once one is seen, nothing goes
    # there.
    fleet.complete()
    # Two scrapes: the load is told to the router again.
    checked = (
        "kvtier_frontend_engine_health_checks_total"
        f'{{engine="127.0.0.5:{fleet.port}"}}'
    )
    checks = fleet.metric(checked)
    wait_until(
        lambda: fleet.metric(checked) >= checks + 2, "two health checks of 127.0.0.5"
    )
    assert fleet.served_by(10) == {"engine 2"}


@pytest.mark.parametrize(
    "spec, error",
    [
        (
            "name=engines:8000,namespace=00c0ffee00c0ffee,block-tokens=32",
            "events-port is missing",
        ),
        (
            "name=engines,events-port=5557,namespace=00c0ffee00c0ffee,block-tokens=32",
            "name=HOST:PORT is missing",
        ),
        (
            "name=engines:8000,events-port=5557,namespace=12,block-tokens=32",
            "must be 16 hex digits",
        ),
        (
            "name=engines:8000,events-port=99999,namespace=00c0ffee00c0ffee,"
            "block-tokens=32",
            "is not a port",
        ),
        (
            "name=engines:8000,events-port=5557,namespace=00c0ffee00c0ffee,"
            "block-tokens=32,colour=red",
            'unknown key "colour"',
        ),
        (
            "name=p:8000,events-port=5557,namespace=00c0ffee00c0ffee,"
            "block-tokens=32,role=prefill",
            "has role=prefill but no engine decodes",
        ),
        (
            "name=p:8000,events-port=5557,namespace=00c0ffee00c0ffee,"
            "block-tokens=32,role=primary",
            'role "primary" must be prefill, decode or both',
        ),
        (
            "name=d:8000,events-port=5557,namespace=00c0ffee00c0ffee,block-tokens=32;"
            "name=p:8000,events-port=5557,namespace=00c0ffee00c0ffee,block-tokens=64",
            "of one model (namespace) have one block-tokens",
        ),
    ],
)
def test_a_bad_dns_spec_is_refused_saying_what_is_wrong(spec: str, error: str) -> None:
    r = subprocess.run(
        [
            str(FRONTEND_BIN),
            f"--model={TINY_LLAMA}",
            "--served-model-name=tiny",
            f"--engines-dns={spec}",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ},
        check=False,
    )
    assert r.returncode == 2, r.stderr
    assert error in r.stderr, r.stderr


ENGINE = (
    "endpoint=127.0.0.1:1,events=tcp://127.0.0.1:2,"
    "namespace=00c0ffee00c0ffee,block-tokens=32"
)


@pytest.mark.parametrize(
    "engines, error",
    [
        (
            f"id=p0,{ENGINE},role=prefill",
            "engine p0 has role=prefill but no engine decodes",
        ),
        (
            f"id=p0,{ENGINE},role=primary",
            'role "primary" must be prefill, decode or both',
        ),
    ],
)
def test_engine_roles_that_do_not_pair_are_refused_naming_them(
    engines: str, error: str
) -> None:
    """Prefill engines with nothing to decode their requests, or a role the
    frontend does not know: refused at start-up, naming the engine or the
    role; a prefill and a decode engine pair."""
    base = [str(FRONTEND_BIN), f"--model={TINY_LLAMA}", "--served-model-name=tiny"]
    r = subprocess.run(
        [*base, f"--engines={engines}", "--check-config"],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert error in r.stderr, r.stderr
    paired = f"id=p0,{ENGINE},role=prefill;id=d0,{ENGINE},role=decode"
    r = subprocess.run(
        [*base, f"--engines={paired}", "--check-config"],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr


def test_every_front_door_panel_queries_a_metric_the_frontend_exports(
    fleet: DnsFleet,
) -> None:
    fleet.wait_engines([2, 3])
    fleet.served_by(2)
    dash = json.loads(
        (
            Path(__file__).resolve().parents[2] / "helm/kvtier/dashboards/kvtier.json"
        ).read_text()
    )
    queried = {
        m
        for panel in dash["panels"]
        for t in panel.get("targets", [])
        for m in re.findall(r"kvtier_frontend_[a-z0-9_]+", t["expr"])
    }
    assert len(queried) >= 5, queried
    exported = fleet.metrics()
    for metric in queried:
        assert f"\n{metric}{{" in exported or f"\n{metric} " in exported, metric


def test_a_body_over_the_limit_is_refused_with_413_and_the_frontend_serves_on(
    fleet: DnsFleet,
) -> None:
    """A request declaring more than --max-body-bytes (8 MiB by default) is
    answered 413 in OpenAI's error JSON before its body is read, and the
    next request is served."""
    import socket

    fleet.wait_engines([2, 3])
    port = int(fleet.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\n"
            b"Content-Length: 9000000\r\n\r\n"
        )
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            piece = s.recv(4096)
            if not piece:
                break
            answer += piece
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), answer
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error", error
    assert "8388608 bytes" in error["message"], error
    status, _, _ = fleet.complete()
    assert status == 200
