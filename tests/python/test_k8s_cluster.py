"""kvtier's Helm chart on a real one-node Kubernetes cluster that the test
brings up and tears down itself (scripts/k8s/: the binaries built once per
version and cached, the images written from the build tree, containerd,
the control plane, the kubelet, kube-proxy and CoreDNS on this host): the
chart installed as a user would (``helm install --wait`` with
tests/k8s/values-test.yaml: two store shards on volumes, the router, the
frontend with its tokenizer from a ConfigMap, two vLLM CPU engines with
kvtier's connector), its own ``helm test``, the frontend Service
answering the ``openai`` package from outside the pods, kvctl through
``kubectl exec``, and the faults a fleet meets: both store pods deleted
(back warm from their volumes), the router pod deleted under load, a
``helm upgrade`` rolling the frontend under load, the engines scaled 2 -> 1
(deletion costs, drain), an engine pod killed mid-stream, a store shard
that hangs (NotReady, out of its Service) and, last, a prefill pool added
(prefill/decode through the store).

Needs root and the project's Python environment (the engines' vLLM);
without either it skips saying why (under CI=true, conftest fails a skip).
Run with tests/python/run_venv_pytest.sh; docs/operations.md, "Tested on a
real cluster".
"""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import statistics
import threading
import time
import urllib.request
from datetime import datetime
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
        ["store", "store", "router", "frontend", "engine", "engine"]
    ), seen


def test_the_frontend_service_answers_the_openai_package(installed: Cluster) -> None:
    client = frontend_client(installed)

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
    client = frontend_client(installed)
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


# The faults. Each leaves the fleet as it found it (two stores, a router,
# a frontend, two engines, all ready) for the next.

# Fresh prompts on every run: a cluster kept up between runs keeps its caches.
SEEDS = itertools.count(random.SystemRandom().randrange(1 << 40))


def token_prompt(blocks: int) -> list[int]:
    """A prompt of `blocks` whole 32-token blocks no other prompt shares
    (token ids inside the tiny tokenizer's vocabulary)."""
    rng = random.Random(next(SEEDS))
    return [rng.randrange(100, 4000) for _ in range(blocks * 32)]


def frontend_client(c: Cluster, timeout: float = 120) -> Any:
    """An openai client of the frontend Service (its cluster address)."""
    url = c.service_url(f"{RELEASE}-frontend")
    return openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0,
                         timeout=timeout)  # fmt: skip


def engine_client(address: str) -> Any:
    """An openai client of one engine's own API (pod address, port 8000)."""
    return openai.OpenAI(
        base_url=f"http://{address}/v1", api_key="-", max_retries=0, timeout=120
    )


def cached(answer: Any) -> int:
    """The prompt tokens vLLM did not compute (--enable-prompt-tokens-details)."""
    details = answer.usage.prompt_tokens_details
    return int(details.cached_tokens or 0) if details else 0


def store_items(c: Cluster, pod: str | None = None) -> dict[str, int] | None:
    """Blocks per tier over every shard (or shard `pod`'s alone), from
    `kvctl stats --json` run in a store pod with kubectl exec (the chart
    points it at every shard); None while a shard does not answer."""
    out = c.kubectl("exec", "kv-store-0", "--", "kvctl", "stats", "--json", check=False)
    try:
        shards = json.loads(out)["shards"]
    except (ValueError, KeyError):
        return None
    mine = [s for a, s in shards.items() if pod is None or a.startswith(pod + ".")]
    if not mine:
        return None
    return {t: sum(int(s["tiers"][t]["items"]) for s in mine) for t in ("ram", "disk")}


def kvtier_series(address: str) -> str:
    """An engine's kvtier series on its /metrics (lookups by outcome,
    blocks that failed to load, saves): what a failed load explains with."""
    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError as e:
        return f"--- {address}/metrics: {e}"
    kept = [ln for ln in text.splitlines() if ln.startswith("vllm:kvtier_")]
    return f"--- {address}/metrics\n" + "\n".join(kept)


def test_a_deleted_store_pod_comes_back_warm_from_its_volume(
    installed: Cluster,
) -> None:
    """Both shards deleted: the StatefulSet brings each back on its volume,
    where it wrote its RAM tier on SIGTERM (--persist-on-stop), and an
    engine that never saw a prompt loads >= 90 % of it from NVMe; kvctl,
    run in a store pod, then shows both tiers holding its blocks."""
    front = frontend_client(installed)
    before = wait_until(lambda: store_items(installed), "kvctl stats in kv-store-0", 60)
    prompt = token_prompt(63)
    raw = front.completions.with_raw_response.create(
        model="tiny", prompt=prompt, max_tokens=1
    )
    first = route_of(raw.headers)["engine"]
    other = next(
        f"{p['status']['podIP']}:8000"
        for p in installed.ready("engine")
        if f"{p['status']['podIP']}:8000" != first
    )
    wait_until(
        lambda: (store_items(installed) or before)["ram"] >= before["ram"] + 63,
        "the store holding the prompt's 63 blocks",
        60,
    )
    held = store_items(installed)
    assert held is not None
    old = {p["metadata"]["uid"] for p in installed.pods("store")}
    # Not kubectl's own wait for the deletion: the StatefulSet recreates
    # each pod under its name within seconds, and that wait once missed it
    # and ran out its 120 s. New pods (new uids), ready, are what counts.
    installed.kubectl("delete", "pod", "kv-store-0", "kv-store-1", "--wait=false")
    wait_until(
        lambda: len(
            [p for p in installed.ready("store") if p["metadata"]["uid"] not in old]
        )
        == 2,
        lambda: "the store shards back:\n" + installed.describe(),
        180,
    )
    back = wait_until(
        lambda: store_items(installed), "kvctl stats after the restart", 60
    )
    assert back["ram"] == 0 and back["disk"] >= held["ram"], (held, back)

    def reaches_the_store() -> bool:
        """The engines' clients find the restarted shards again (gRPC
        re-resolves their names): a probe one engine saved, the other
        loads."""
        probe, now = token_prompt(10), store_items(installed)
        engine_client(first).completions.create(
            model="tiny", prompt=probe, max_tokens=1
        )
        try:
            wait_until(
                lambda: (store_items(installed) or {"ram": 0})["ram"]
                >= 10 + (now or {"ram": 1 << 30})["ram"],
                "the probe saved",
                5,
            )
        except AssertionError:
            return False
        answer = engine_client(other).completions.create(
            model="tiny", prompt=probe, max_tokens=1
        )
        return cached(answer) >= 9 * 32

    wait_until(reaches_the_store, "both engines reaching the restarted shards", 90)
    answer = engine_client(other).completions.create(
        model="tiny", prompt=prompt, max_tokens=1
    )
    named = {f"{p['status']['podIP']}:8000": p["metadata"]["name"]
             for p in installed.ready("engine")}  # fmt: skip
    assert cached(answer) >= 0.9 * len(prompt), "\n".join(
        [str(answer.usage), str(store_items(installed))]
        + [installed.log_tail(p, 20) for p in ("kv-store-0", "kv-store-1")]
        + [installed.log_tail(named.get(other, other), 60, "kvtier")]
        + [kvtier_series(other)]
    )
    tiers = store_items(installed)
    assert tiers is not None and tiers["ram"] >= 62 and tiers["disk"] >= 63, tiers


class Load:
    """Completions through the frontend Service, one after another on
    `threads` threads, until stopped: what each ended with."""

    def __init__(self, url: str, threads: int = 2, max_tokens: int = 2) -> None:
        self.max_tokens = max_tokens
        self.ok = 0
        self.errors: list[str] = []
        # The errors of requests that had streamed a token when they failed
        # (a subset of errors): cut mid-stream, which only an engine killed
        # outright may do.
        self.cut: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._run, args=(url, i)) for i in range(threads)
        ]
        for t in self._threads:
            t.start()

    def _run(self, url: str, i: int) -> None:
        client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0,
                               timeout=60)  # fmt: skip
        n = 0
        while not self._stop.is_set():
            n += 1
            streamed = False
            try:
                # Streamed, so a request cut short fails here rather than
                # coming back shorter; every token asked is generated.
                stream = client.completions.create(
                    model="tiny",
                    prompt=f"Load {i} asks {n}.",
                    max_tokens=self.max_tokens,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True},
                )
                streamed = False
                usage = []
                for chunk in stream:
                    streamed = streamed or bool(chunk.choices)
                    if chunk.usage:
                        usage.append(chunk.usage)
                if not usage or usage[-1].completion_tokens != self.max_tokens:
                    raise openai.APIError(
                        f"a stream ended short: {usage}", None, body=None
                    )
                with self._lock:
                    self.ok += 1
            except openai.APIError as e:
                with self._lock:
                    self.errors.append(f"{type(e).__name__}: {e}")
                    if streamed:
                        self.cut.append(self.errors[-1])

    def more(self, n: int, what: str) -> None:
        """Waits until `n` more requests than now have completed."""
        seen = self.ok
        wait_until(lambda: self.ok > seen + n, what)

    def stop(self) -> None:
        """Stops the threads once each request in flight ended."""
        self._stop.set()
        for t in self._threads:
            t.join()


def router_sources(c: Cluster, pod: str) -> dict[str, int]:
    """The router's sources and the blocks it knows each holds (kvctl
    workers in the router pod)."""
    out = c.kubectl("exec", pod, "--", "kvctl", "workers", check=False)
    rows = [line.split() for line in out.splitlines()[1:] if line.strip()]
    return {r[0]: int(r[4]) for r in rows if len(r) > 4 and r[4].isdigit()}


def test_the_router_pod_deleted_fails_no_request_and_routing_resumes(
    installed: Cluster,
) -> None:
    """The router pod deleted under load: no request through the frontend
    fails, and the Deployment's new router hears both shards again, with
    the blocks they hold."""
    old = installed.ready("router")[0]["metadata"]["name"]
    held = wait_until(
        lambda: router_sources(installed, old).get("kv-store-0"),
        "the router knowing kv-store-0's blocks",
        60,
    )
    load = Load(installed.service_url(f"{RELEASE}-frontend"))
    try:
        installed.kubectl("delete", "pod", old)
        new = wait_until(
            lambda: [
                p["metadata"]["name"]
                for p in installed.ready("router")
                if p["metadata"]["name"] != old
            ],
            lambda: "a new router pod:\n" + installed.describe(),
            120,
        )[0]
        sources = wait_until(
            lambda: (s := router_sources(installed, new)).get("kv-store-0")
            and s.get("kv-store-1")
            and s,
            "the new router hearing both shards' blocks",
            60,
        )
        assert sources["kv-store-0"] >= held, (held, sources)
        load.more(2, "requests completing after the router came back")
    finally:
        load.stop()
    assert not load.errors, load.errors[:5]


def test_a_helm_upgrade_that_restarts_the_frontend_loses_no_request(
    installed: Cluster,
) -> None:
    """helm upgrade rolls the frontend under load: the new pod is ready
    before the old one stops, the old one leaves the Service during its
    preStop and drains what it holds, and no request fails."""
    old = installed.ready("frontend")[0]["metadata"]["name"]
    # Streams of 160 tokens (seconds each here): some are in flight when
    # the old pod gets SIGTERM. With a grace period of 1 s instead of the
    # test values' 20 they were cut (2 of 18 failed, tried once).
    load = Load(installed.service_url(f"{RELEASE}-frontend"), max_tokens=160)
    try:
        wait_until(lambda: load.ok >= 2, "the load running", 60)
        rollout = f"frontend.podAnnotations.kvtier-test/rollout={time.time_ns()}"
        installed.upgrade("--set-string", rollout)
        wait_until(
            lambda: not any(
                p["metadata"]["name"] == old for p in installed.pods("frontend")
            ),
            "the old frontend pod gone",
            60,
        )
        load.more(2, "requests completing on the new frontend")
    finally:
        load.stop()
    assert not load.errors, load.errors[:5]
    assert [p["metadata"]["name"] for p in installed.ready("frontend")] != [old]


COST = "controller.kubernetes.io/pod-deletion-cost"


def engines(c: Cluster) -> dict[str, dict[str, Any]]:
    """The ready engine pods by API address (pod IP:8000)."""
    return {f"{p['status']['podIP']}:8000": p for p in c.ready("engine")}


def deletion_cost(pod: dict[str, Any]) -> int:
    """The pod-deletion cost the frontend last gave the pod (0 if none)."""
    return int(pod["metadata"].get("annotations", {}).get(COST, "0"))


def when(stamp: str) -> float:
    """An API server's time stamp (RFC 3339, whole seconds, Z) as a Unix
    time."""
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def scale_engines(c: Cluster, replicas: int) -> None:
    """helm upgrade with engine.replicas, waiting for the rollout."""
    c.upgrade("--set", f"engine.replicas={replicas}")


def test_scaling_engines_down_removes_the_one_holding_less_sole_kv(
    installed: Cluster,
) -> None:
    """engine.replicas 2 -> 1 under load: the frontend's deletion costs
    (each engine's sole prompt tokens) make the ReplicaSet remove the engine
    holding less KV that nothing else holds; its preStop drain ends within
    the grace period; no request fails; its hot prompt stays in the fleet
    through the store."""
    evict = [
        "kvctl",
        "evict",
        "--all",
        "--yes",
        "--admin-token-file=/etc/kvtier/admin/token",
    ]
    pods = engines(installed)
    keep = max(pods, key=lambda a: deletion_cost(pods[a]))
    leave = next(a for a in pods if a != keep)
    # `keep` computes long prompts the store then forgets: KV only it holds.
    for _ in range(4):
        engine_client(keep).completions.create(
            model="tiny", prompt=token_prompt(120), max_tokens=1
        )
        installed.exec("kv-store-0", *evict)
        pods = engines(installed)
        if deletion_cost(pods[keep]) > deletion_cost(pods[leave]) + 32 * 60:
            break

        def costs_seen() -> bool:
            p = engines(installed)
            return deletion_cost(p[keep]) > deletion_cost(p[leave]) + 32 * 60

        try:
            wait_until(costs_seen, "the deletion costs", 10)
            break
        except AssertionError:
            continue
    pods = engines(installed)
    assert deletion_cost(pods[keep]) > deletion_cost(pods[leave]), {
        a: deletion_cost(p) for a, p in pods.items()
    }
    # `leave` computes a prompt the store keeps: its hot blocks.
    hot = token_prompt(20)
    engine_client(leave).completions.create(model="tiny", prompt=hot, max_tokens=1)
    wait_until(
        lambda: (store_items(installed) or {"ram": 0})["ram"] >= 20,
        lambda: "\n".join(
            ["the store holding the leaving engine's prompt"]
            + [installed.log_tail(p) for p in ("kv-store-0", "kv-store-1")]
            + [installed.log_tail(pods[leave]["metadata"]["name"], 30, "kvtier")]
        ),
        30,
    )
    name = pods[leave]["metadata"]["name"]
    grace = int(pods[leave]["spec"]["terminationGracePeriodSeconds"])
    # What the leaving engine says to its end (its drain: vLLM's
    # "[shutdown]" lines), for a failure to explain with.
    said = installed.tmp / f"{name}.log"
    follower = installed.follow_log(name, said)
    load = Load(installed.service_url(f"{RELEASE}-frontend"))
    # The API server stamps a deleted pod with the time its grace period
    # ends (deletionTimestamp, whole seconds): gone before it, its preStop
    # and its drain ended on their own, not by the kubelet's SIGKILL.
    deadline = time.time() + grace
    try:
        scale_engines(installed, 1)

        def gone() -> bool:
            nonlocal deadline
            for p in installed.pods("engine"):
                if p["metadata"]["name"] != name:
                    continue
                stamp = p["metadata"].get("deletionTimestamp")
                if stamp:
                    deadline = when(stamp)
                for c in p["status"].get("containerStatuses", []):
                    if "terminated" in c["state"]:
                        ended.update(c["state"]["terminated"])
                return False
            return True

        ended: dict[str, Any] = {}
        wait_until(gone, "the leaving engine's pod gone", grace + 30)
        gone_at = time.time()
    finally:
        load.stop()
        # Its pod gone, `kubectl logs -f` has ended on its own.
        follower.terminate()
        follower.wait(timeout=30)
    try:
        assert list(engines(installed)) == [keep], (keep, list(engines(installed)))
        drain = "\n".join(
            ln for ln in said.read_text(errors="replace").splitlines()
            if "shutdown" in ln or "drain" in ln
        )[-4000:]  # fmt: skip
        if ended:
            # The container's own end, as the runtime stamped it: a busy
            # node's kubelet may remove the pod object seconds later.
            assert ended["exitCode"] != 137, f"the engine was killed: {ended}\n{drain}"
            assert when(ended["finishedAt"]) < deadline + 1, (ended, deadline, drain)
        else:
            late = gone_at - deadline
            assert late < 1, f"the pod went {late:.0f} s past its grace period\n{drain}"
        assert not load.errors, load.errors[:5]
        answer = engine_client(keep).completions.create(
            model="tiny", prompt=hot, max_tokens=1
        )
        assert cached(answer) >= 19 * 32, answer.usage
    finally:
        # The tests after this one find two engines, whatever it found.
        scale_engines(installed, 2)


def frontend_engines(c: Cluster) -> set[str]:
    """The engines the frontend's index lists now (its /metrics, one
    kvtier_frontend_engine_sole_tokens series an engine)."""
    pod = c.ready("frontend")[0]
    with urllib.request.urlopen(
        f"http://{pod['status']['podIP']}:9600/metrics", timeout=10
    ) as r:
        text = r.read().decode()
    return {
        line.split('engine="', 1)[1].split('"', 1)[0]
        for line in text.splitlines()
        if line.startswith("kvtier_frontend_engine_sole_tokens{")
    }


def test_an_engine_pod_killed_mid_stream_fails_no_request_not_yet_streaming(
    installed: Cluster,
) -> None:
    """An engine pod killed (no grace period) while it streams: the stream
    it was sending ends, every request not yet streaming succeeds on the
    other engine (the frontend retries it), and the dead engine leaves the
    frontend's index; the Deployment then brings the fleet back to two."""
    front = frontend_client(installed)
    wait_until(
        lambda: len(frontend_engines(installed)) == 2, "both engines indexed", 60
    )
    with front.completions.with_streaming_response.create(
        model="tiny",
        prompt="Tell a long story.",
        max_tokens=3000,
        stream=True,
        extra_body={"ignore_eos": True},
    ) as streaming:
        dying = route_of(streaming.headers)["engine"]
        name = engines(installed)[dying]["metadata"]["name"]
        lines = streaming.iter_lines()
        wait_until(
            lambda: next(lines).startswith("data: {"), "the stream's first token"
        )
        load = Load(installed.service_url(f"{RELEASE}-frontend"))
        try:
            wait_until(lambda: load.ok >= 4, "the load running", 60)
            installed.kubectl("delete", "pod", name, "--grace-period=0", "--force")
            ended = False
            try:
                for line in lines:
                    ended = line.strip() == "data: [DONE]"
            except Exception:  # noqa: BLE001 -- the connection cut is the point
                pass
            assert not ended, "a stream of 3,000 tokens outlived its engine"
            wait_until(
                lambda: dying not in frontend_engines(installed),
                "the killed engine leaving the frontend's index",
                60,
            )
            load.more(4, "requests completing on the other engine")
        finally:
            load.stop()
    # A load request streaming on the engine when it was killed ends short
    # (as the long stream above does); every other one succeeded.
    assert len(load.errors) == len(load.cut), (load.errors[:5], load.cut)
    assert len(load.cut) <= 2, load.cut  # one per load thread at most
    wait_until(
        lambda: len(engines(installed)) == 2,
        lambda: "the Deployment's new engine:\n" + installed.describe(),
        180,
    )


def store_pid(pod: str) -> int:
    """The node's pid of store pod `pod`'s kvtier-store (its --store-id)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[0].endswith(b"kvtier-store") and f"--store-id={pod}".encode() in argv:
            return int(proc.name)
    raise AssertionError(f"no kvtier-store process of {pod} on the node")


def in_service(c: Cluster, pod: str) -> bool:
    """Whether the store Service serves `pod` (its EndpointSlice endpoint
    ready: CoreDNS answers the pod's name only then)."""
    slices = c.get("endpointslices", "-l",
                   f"kubernetes.io/service-name={RELEASE}-store-headless")  # fmt: skip
    return any(
        (e.get("targetRef") or {}).get("name") == pod
        and bool(e.get("conditions", {}).get("ready"))
        for s in slices["items"]
        for e in s.get("endpoints") or []
    )


def test_a_hung_store_leaves_its_service_and_fails_no_request(
    installed: Cluster,
) -> None:
    """A store shard that stops answering (its process stopped from the
    node, SIGSTOP: alive, its port open, silent): its gRPC readiness probe
    fails, so the pod turns NotReady and its Service stops serving it (its
    name leaves cluster DNS). Requests through the frontend meanwhile all
    succeed and do not wait on it (median latency within 3x, +1 s, of
    before: a stalled shard costs one lookup its budget, then is skipped).
    Resumed, it is served again and the engines save to it again. Last:
    the engines' clients may still skip the shard for a while after."""
    pod, front = "kv-store-1", frontend_client(installed, timeout=60)
    assert in_service(installed, pod)
    before: list[float] = []
    for _ in range(3):
        started = time.monotonic()
        front.completions.create(model="tiny", prompt=token_prompt(4), max_tokens=1)
        before.append(time.monotonic() - started)
    during: list[float] = []
    errors: list[str] = []
    done = threading.Event()

    def load() -> None:
        while not done.is_set():
            started = time.monotonic()
            try:
                front.completions.create(model="tiny", prompt=token_prompt(4),
                                         max_tokens=1)  # fmt: skip
                during.append(time.monotonic() - started)
            except openai.APIError as e:
                errors.append(f"{type(e).__name__}: {e}")

    pid = store_pid(pod)
    os.kill(pid, signal.SIGSTOP)
    thread = threading.Thread(target=load)
    thread.start()
    try:
        # Three failed probes 5 s apart; the liveness probe (3 x 10 s)
        # would restart it later.
        wait_until(
            lambda: not in_service(installed, pod),
            lambda: "the hung shard leaving its Service:\n" + installed.describe(),
            60,
        )
        state = installed.get("pod", pod)["status"]["conditions"]
        assert {"type": "Ready", "status": "False"}.items() <= next(
            c for c in state if c["type"] == "Ready"
        ).items(), state
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass  # its liveness probe restarted it first
        done.set()
        thread.join()
    assert not errors, errors[:5]
    assert during and statistics.median(during) <= 3 * statistics.median(before) + 1, (
        before,
        during,
    )
    wait_until(
        lambda: in_service(installed, pod),
        lambda: "the shard served again:\n" + installed.describe(),
        180,
    )
    held = wait_until(lambda: store_items(installed, pod), f"kvctl stats of {pod}", 60)

    def saved_to() -> bool:
        front.completions.create(model="tiny", prompt=token_prompt(8), max_tokens=1)
        return sum((store_items(installed, pod) or {}).values()) > sum(held.values())

    # The engines' clients skip a failed shard for a while (doubling):
    # their next probe of it finds it answering.
    wait_until(saved_to, f"the engines saving to {pod} again", 120)


def test_prefill_and_decode_pools_hand_a_long_prompt_over_through_the_store(
    installed: Cluster,
) -> None:
    """The chart's prefill pool (helm upgrade with engine.prefill.replicas=1;
    last, as it changes the fleet): a long prompt through the frontend is
    prefilled by the prefill engine, whose blocks the decode engine then
    loads from the store instead of computing (37 of a 1,200-token prompt's
    blocks: cached_tokens), as the route header says."""
    installed.helm(
        "upgrade",
        RELEASE,
        str(Path(__file__).resolve().parents[2] / "helm" / "kvtier"),
        "--reuse-values",
        "--set",
        "engine.prefill.replicas=1",
        # The decode's wait for the prefill's blocks: a busy node's prefill
        # took over the chart's 5 s to save 37 (32 there at 5 s, one run
        # beside a CPU hog).
        "--set",
        "engine.prefill.handoffWaitMs=20000",
        "--wait",
        "--timeout",
        "5m",
    )
    prefill = wait_until(
        lambda: installed.ready("engine-prefill"), "the prefill engine ready", 120
    )
    # The decode pool rolls (its engines gain the handoff budget): an old
    # engine still draining would load only the blocks already there.
    wait_until(
        lambda: len(installed.pods("engine")) == len(installed.ready("engine")) == 2,
        lambda: "the decode pool rolled:\n" + installed.describe(),
        180,
    )
    at = f"{prefill[0]['status']['podIP']}:8000"
    front = openai.OpenAI(
        base_url=installed.service_url(f"{RELEASE}-frontend") + "/v1",
        api_key="-",
        max_retries=0,
        timeout=120,
    )

    def handed_over() -> tuple[dict[str, str], Any] | None:
        # A prompt no engine has seen on each try: one a try sent to a
        # decode engine must not answer the next from that engine's cache.
        raw = front.completions.with_raw_response.create(
            model="tiny", prompt=token_prompt(37) + [7] * 16, max_tokens=4
        )
        route = route_of(raw.headers)
        return (route, raw.parse()) if route.get("prefill") == at else None

    # The frontend finds the new pool by DNS within its --dns-interval.
    route, answer = wait_until(
        handed_over, "a prompt prefilled by the prefill pool", 120
    )
    assert route["engine"] in engines(installed), route
    assert route["handoff_blocks"] == "37", route
    if cached(answer) != 37 * 32:
        # What the engines (a handoff's outcome is logged) and the stores
        # (their data planes' closes, a call that held a loop) said of it.
        said = [f"{route} {answer.usage}; store items {store_items(installed)}"]
        said += [
            installed.log_tail(p["metadata"]["name"], 60, "kvtier")
            for p in installed.pods("engine") + installed.pods("engine-prefill")
        ]
        said += [
            installed.log_tail(p["metadata"]["name"], 60)
            for p in installed.pods("store")
        ]
        for p in installed.pods("store"):
            url = f"http://{p['status']['podIP']}:9400/metrics"
            with urllib.request.urlopen(url, timeout=10) as r:
                said.append(
                    f"{p['metadata']['name']}: "
                    + "; ".join(
                        line
                        for line in r.read().decode().splitlines()
                        if "dataplane_closed" in line and not line.startswith("#")
                    )
                )
        raise AssertionError("\n".join(said))
