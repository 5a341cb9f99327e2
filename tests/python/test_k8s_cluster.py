"""kvtier's Helm chart on a real one-node Kubernetes cluster that the test
brings up and tears down itself (scripts/k8s/: the binaries built once per
version and cached, the images written from the build tree, containerd,
the control plane, the kubelet, kube-proxy and CoreDNS on this host): the
chart installed as a user would (``helm install --wait`` with
tests/k8s/values-test.yaml: two store shards on volumes, the router, the
frontend with its tokenizer from a ConfigMap, two vLLM CPU engines with
kvtier's connector), its own ``helm test``, and the frontend Service
answering the ``openai`` package from outside the pods.

Needs root and the project's Python environment (the engines' vLLM);
without either it skips saying why (under CI=true, conftest fails a skip).
Run with tests/python/run_venv_pytest.sh; docs/operations.md, "Tested on a
real cluster".
"""

from __future__ import annotations

import os
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

from conftest import wait_until
from k8s_cluster import BUILD, RELEASE, Cluster, Unavailable, down

openai = pytest.importorskip("openai", reason="the openai package is in the "
                             "environment")  # fmt: skip
pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="a cluster needs root"),
    pytest.mark.skipif(not (BUILD / "venv" / "bin" / "vllm").exists(),
                       reason="the engines' vLLM is in the project's environment"),
]  # fmt: skip


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("k8s")
    c: Cluster | None = None
    try:
        try:
            c = Cluster(tmp)
        except Unavailable as e:
            pytest.skip(str(e))
        yield c
    finally:
        if c is not None:
            c.down()
        else:
            down(tmp / "state", Path("/"))


@pytest.fixture(scope="module")
def installed(cluster: Cluster) -> Cluster:
    """The chart installed as a user would (Cluster.install)."""
    started = time.monotonic()
    cluster.install()
    print(f"helm install --wait: {time.monotonic() - started:.0f} s")
    return cluster


def test_every_object_is_accepted_and_every_pod_serves(installed: Cluster) -> None:
    pods = installed.get("pods")["items"]
    by_component: dict[str, int] = {}
    for p in pods:
        component = p["metadata"]["labels"].get("app.kubernetes.io/component", "")
        ready = all(c["ready"] for c in p["status"].get("containerStatuses", []))
        assert ready, f"{p['metadata']['name']} is not ready:\n{installed.describe()}"
        by_component[component] = by_component.get(component, 0) + 1
    want = {"store": 2, "router": 1, "frontend": 1, "engine": 2}
    assert by_component == want, by_component
    claims = installed.get("pvc")["items"]
    bound = [c for c in claims if c["status"]["phase"] == "Bound"]
    assert len(claims) == 2 and len(bound) == 2, claims


def test_the_charts_own_helm_test_passes(installed: Cluster) -> None:
    out = installed.helm("test", RELEASE, "--timeout", "5m")
    assert "Phase:          Succeeded" in out, out


def test_every_pod_serves_its_metrics(installed: Cluster) -> None:
    """Prometheus can scrape every pod: each answers on its metrics port
    (the engines on their API port), reached at the pod's address."""
    ports = {"store": 9400, "router": 9500, "frontend": 9600, "engine": 8000}
    seen = {}
    for p in installed.get("pods")["items"]:
        component = p["metadata"]["labels"].get("app.kubernetes.io/component", "")
        if component not in ports:
            continue
        url = f"http://{p['status']['podIP']}:{ports[component]}/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
        assert r.status == 200 and "# TYPE" in text, (url, text[:200])
        seen[p["metadata"]["name"]] = component
    assert sorted(seen.values()) == sorted(
        ["store", "store", "router", "frontend", "engine", "engine"]), seen


def test_the_frontend_service_answers_the_openai_package(installed: Cluster) -> None:
    url = installed.service_url(f"{RELEASE}-frontend")
    client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0,
                           timeout=120)  # fmt: skip

    def answers() -> bool:
        try:
            client.completions.create(model="tiny", prompt="Hi", max_tokens=1)
            return True
        except openai.APIError:
            return False

    # The frontend is ready once an engine is; both engines have said
    # hello to its router once each has answered a health check.
    wait_until(answers, "the frontend Service answering a completion", 120)
    done = client.completions.create(model="tiny", prompt="The store tiers blocks.",
                                     max_tokens=8)  # fmt: skip
    assert done.usage is not None and done.usage.completion_tokens == 8
    pieces = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Stream it."}],
        max_tokens=6, stream=True, stream_options={"include_usage": True}))  # fmt: skip
    assert pieces[-1].usage is not None and pieces[-1].usage.completion_tokens == 6
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "What is a KV cache?"}],
        max_tokens=4)  # fmt: skip
    assert chat.choices[0].message.role == "assistant"


def route_of(headers: Any) -> dict[str, str]:
    """The x-kvtier-route header as a dict."""
    raw = headers.get("x-kvtier-route", "")
    return dict(part.strip().split("=", 1) for part in raw.split(";") if "=" in part)


def test_a_conversations_second_turn_stays_on_its_engine(installed: Cluster) -> None:
    """Routed by the engines' own KV events, as outside a cluster: the
    second turn of a conversation goes where its first turn's blocks are
    (the frontend's x-kvtier-route header, on with --route-header here)."""
    url = installed.service_url(f"{RELEASE}-frontend")
    client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0,
                           timeout=120)  # fmt: skip
    turns = [{"role": "system", "content": "You are the cache tier's historian. " * 24},
             {"role": "user", "content": "When did it start?"}]  # fmt: skip
    first = client.chat.completions.with_raw_response.create(
        model="tiny", max_tokens=4, messages=turns)  # fmt: skip
    engine = route_of(first.headers)["engine"]
    said = first.parse().choices[0].message.content or ""
    turns += [{"role": "assistant", "content": said},
              {"role": "user", "content": "And then?"}]  # fmt: skip

    def matched() -> dict[str, str] | None:
        raw = client.chat.completions.with_raw_response.create(
            model="tiny", max_tokens=4, messages=turns)  # fmt: skip
        route = route_of(raw.headers)
        return route if int(route.get("gpu_blocks", "0")) > 0 else None

    # The engine's KV events reach the frontend within moments of the
    # first answer: the second turn matches its blocks once they have.
    seen = wait_until(matched, "the second turn matching the first turn's blocks", 60)
    assert seen["engine"] == engine, (engine, seen)
