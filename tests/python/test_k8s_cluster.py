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

import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

from conftest import wait_until

ROOT = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("KVTIER_BUILD_DIR", ROOT / "build")).resolve()
SCRIPTS = ROOT / "scripts" / "k8s"
HELM = ROOT / "tests" / "helm" / ".bin" / "helm"
RELEASE = "kv"

openai = pytest.importorskip("openai", reason="the openai package is in the "
                             "environment")  # fmt: skip
pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="a cluster needs root"),
    pytest.mark.skipif(not (BUILD / "venv" / "bin" / "vllm").exists(),
                       reason="the engines' vLLM is in the project's environment"),
]  # fmt: skip


class Cluster:
    """The test's cluster: its state under `tmp`, kubectl and helm on it."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.state = tmp / "state"
        out = subprocess.run(["bash", str(SCRIPTS / "build.sh")],
                             capture_output=True, text=True)  # fmt: skip
        if out.returncode != 0:
            pytest.skip("the Kubernetes binaries could not be built "
                        "(scripts/k8s/build.sh, from the Go module proxy): "
                        f"{out.stderr[-500:]}")  # fmt: skip
        self.bin = Path(out.stdout.strip().splitlines()[-1])
        images = tmp / "images"
        subprocess.run(["bash", str(SCRIPTS / "images.sh"), str(images), str(BUILD),
                        str(self.bin)], check=True)  # fmt: skip
        self.env = dict(os.environ, KUBECONFIG=str(self.state / "admin.kubeconfig"))
        up = subprocess.run(["bash", str(SCRIPTS / "cluster.sh"), "up", str(self.state),
                             str(self.bin), *map(str, sorted(images.glob("*.tar")))],
                            capture_output=True, text=True)  # fmt: skip
        if up.returncode != 0:
            logs = "".join(f"\n--- {p.name}\n{p.read_text(errors='replace')[-1500:]}"
                           for p in sorted((self.state / "logs").glob("*.log")))
            raise AssertionError(f"the cluster did not start: {up.stderr}{logs}")

    def kubectl(self, *args: str, check: bool = True, timeout: float = 120) -> str:
        """kubectl's output; CalledProcessError (with its stderr) on failure."""
        out = subprocess.run([str(self.bin / "kubectl"), *args], env=self.env,
                             capture_output=True, text=True,
                             timeout=timeout)  # fmt: skip
        if check and out.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)}: {out.stderr}")
        return out.stdout

    def helm(self, *args: str, timeout: float = 900) -> str:
        """helm's output; AssertionError with its output on failure."""
        out = subprocess.run([str(HELM), *args], env=self.env, capture_output=True,
                             text=True, timeout=timeout)  # fmt: skip
        if out.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)}:\n{out.stdout}\n{out.stderr}"
                                 f"\n{self.describe()}")  # fmt: skip
        return out.stdout

    def describe(self) -> str:
        """The pods and the last events: what a failed wait explains with."""
        pods = self.kubectl("get", "pods", "-o", "wide", check=False)
        events = self.kubectl("get", "events", "--sort-by=.lastTimestamp", check=False)
        return f"{pods}\n{events[-4000:]}"

    def get(self, *args: str) -> Any:
        """An object (or list) as JSON."""
        return json.loads(self.kubectl("get", *args, "-o", "json"))

    def service_url(self, name: str, port: str = "http") -> str:
        """http://CLUSTER-IP:PORT of a Service (reachable from the host
        through kube-proxy's rules: outside every pod)."""
        svc = self.get("service", name)
        number = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == port)
        return f"http://{svc['spec']['clusterIP']}:{number}"

    def down(self) -> None:
        """Tears the cluster down and restores the host (cluster.sh down)."""
        subprocess.run(["bash", str(SCRIPTS / "cluster.sh"), "down", str(self.state),
                        str(self.bin)], check=False)  # fmt: skip


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("k8s")
    c: Cluster | None = None
    try:
        c = Cluster(tmp)
        yield c
    finally:
        if c is not None:
            c.down()
        else:
            subprocess.run(["bash", str(SCRIPTS / "cluster.sh"), "down",
                            str(tmp / "state"), "/"], check=False)  # fmt: skip


def engine_mounts(tmp: Path) -> Path:
    """A values file mounting the build's vLLM environment, kvtier package
    and the tiny model read-only into the engine pods (test-only)."""
    venv, package, model = BUILD / "venv", BUILD / "python", ROOT / "tests" / "models"

    def host(name: str, path: Path) -> dict[str, Any]:
        return {"name": name, "hostPath": {"path": str(path), "type": "Directory"}}

    values = {
        "engine": {
            "extraEnv": [
                {"name": "PATH", "value": f"{venv}/bin:/usr/local/bin:/usr/bin:/bin"},
                {"name": "PYTHONPATH", "value": str(package)},
                {"name": "VLLM_CPU_KVCACHE_SPACE", "value": "1"},
                {"name": "HOME", "value": "/tmp"},
            ],
            "extraVolumes": [
                host("venv", venv),
                host("kvtier", package),
                host("models", model),
            ],
            "extraVolumeMounts": [
                {"name": "venv", "mountPath": str(venv), "readOnly": True},
                {"name": "kvtier", "mountPath": str(package), "readOnly": True},
                {"name": "models", "mountPath": "/models", "readOnly": True},
            ],
        }
    }
    path = tmp / "values-mounts.json"
    path.write_text(json.dumps(values))
    return path


@pytest.fixture(scope="module")
def installed(cluster: Cluster) -> Cluster:
    """The chart installed as a user would, once its volumes and the
    tokenizer's ConfigMap exist."""
    tok = ROOT / "tests" / "models" / "tiny-llama"
    cluster.kubectl("create", "configmap", "tiny-tokenizer",
                    f"--from-file={tok / 'tokenizer.json'}",
                    f"--from-file={tok / 'tokenizer_config.json'}")  # fmt: skip
    # No provisioner on one node: a hostPath volume per store shard, owned
    # by the store's user (fsGroup does not apply to hostPath volumes).
    for i in range(2):
        folder = cluster.tmp / "pv" / str(i)
        folder.mkdir(parents=True)
        os.chown(folder, 10001, 10001)
        pv = {
            "apiVersion": "v1", "kind": "PersistentVolume",
            "metadata": {"name": f"kvtier-test-pv-{i}"},
            "spec": {"capacity": {"storage": "2Gi"}, "accessModes": ["ReadWriteOnce"],
                     "persistentVolumeReclaimPolicy": "Retain",
                     "hostPath": {"path": str(folder), "type": "Directory"}},
        }  # fmt: skip
        manifest = cluster.tmp / f"pv-{i}.json"
        manifest.write_text(json.dumps(pv))
        cluster.kubectl("apply", "-f", str(manifest))
    started = time.monotonic()
    cluster.helm("install", RELEASE, str(ROOT / "helm" / "kvtier"),
                 "-f", str(ROOT / "tests" / "k8s" / "values-test.yaml"),
                 "-f", str(engine_mounts(cluster.tmp)),
                 "--wait", "--timeout", "12m")  # fmt: skip
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
