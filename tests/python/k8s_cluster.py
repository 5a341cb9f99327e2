"""A real one-node Kubernetes cluster on this host, with kvtier's chart
installed on it (scripts/k8s/: the binaries built once per version and
cached, the images written from the build tree, containerd, the control
plane, the kubelet, kube-proxy and CoreDNS): what
tests/python/test_k8s_cluster.py and bench/cluster_demo.py share.
docs/operations.md, "Tested on a real cluster". Needs root.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("KVTIER_BUILD_DIR", ROOT / "build")).resolve()
SCRIPTS = ROOT / "scripts" / "k8s"
HELM = ROOT / "tests" / "helm" / ".bin" / "helm"
RELEASE = "kv"


class Unavailable(Exception):
    """What a cluster needs cannot be had here (its binaries not built)."""


def down(state: Path, bin_dir: Path) -> None:
    """Tears a cluster down and restores the host (cluster.sh down); safe
    after a start that failed half-way."""
    subprocess.run(["bash", str(SCRIPTS / "cluster.sh"), "down", str(state),
                    str(bin_dir)], check=False)  # fmt: skip


class Cluster:
    """The test's cluster: its state under `tmp`, kubectl and helm on it."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.state = tmp / "state"
        out = subprocess.run(["bash", str(SCRIPTS / "build.sh")],
                             capture_output=True, text=True)  # fmt: skip
        if out.returncode != 0:
            raise Unavailable("the Kubernetes binaries could not be built "
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
            logs = "".join(
                f"\n--- {p.name}\n{p.read_text(errors='replace')[-1500:]}"
                for p in sorted((self.state / "logs").glob("*.log"))
            )
            raise AssertionError(f"the cluster did not start: {up.stderr}{logs}")

    def kubectl(self, *args: str, check: bool = True, timeout: float = 120) -> str:
        """kubectl's output; CalledProcessError (with its stderr) on failure."""
        out = subprocess.run([str(self.bin / "kubectl"), *args], env=self.env,
                             capture_output=True, text=True,
                             timeout=timeout)  # fmt: skip
        if check and out.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)}: {out.stderr}")
        return out.stdout

    def follow_log(self, pod: str, path: Path) -> subprocess.Popen[bytes]:
        """`kubectl logs -f` of a pod into `path`: what a pod that is going
        away said to its end (stop it by its pid when done)."""
        with open(path, "wb") as out:
            return subprocess.Popen([str(self.bin / "kubectl"), "logs", "-f", pod,
                                     "--all-containers"], env=self.env, stdout=out,
                                    stderr=subprocess.STDOUT)  # fmt: skip

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

    def log_tail(self, pod: str, lines: int = 40, grep: str = "") -> str:
        """The last `lines` lines of a pod's log (those holding `grep`
        when given): what a failed wait on that pod explains with."""
        out = self.kubectl("logs", pod, "--all-containers", check=False)
        kept = [ln for ln in out.splitlines() if grep in ln]
        return f"--- {pod}\n" + "\n".join(kept[-lines:])

    def get(self, *args: str) -> Any:
        """An object (or list) as JSON."""
        return json.loads(self.kubectl("get", *args, "-o", "json"))

    def pods(self, component: str) -> list[dict[str, Any]]:
        """The release's pods of a component (store, router, frontend,
        engine), those being deleted included."""
        return list(
            self.get(
                "pods",
                "-l",
                "app.kubernetes.io/instance="
                + RELEASE
                + ",app.kubernetes.io/component="
                + component,
            )["items"]
        )

    def ready(self, component: str) -> list[dict[str, Any]]:
        """The component's pods that are ready and not being deleted."""
        return [p for p in self.pods(component)
                if not p["metadata"].get("deletionTimestamp") and
                any(c["type"] == "Ready" and c["status"] == "True"
                    for c in p["status"].get("conditions", []))]  # fmt: skip

    def exec(self, pod: str, *command: str) -> str:
        """A command's output in a pod (kubectl exec)."""
        return self.kubectl("exec", pod, "--", *command)

    def service_url(self, name: str, port: str = "http") -> str:
        """http://CLUSTER-IP:PORT of a Service (reachable from the host
        through kube-proxy's rules: outside every pod)."""
        svc = self.get("service", name)
        number = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == port)
        return f"http://{svc['spec']['clusterIP']}:{number}"

    def upgrade(self, *sets: str) -> None:
        """helm upgrade of the release with its values and `sets` (each a
        --set or --set-string pair of arguments), waiting for the rollout."""
        self.helm("upgrade", RELEASE, str(ROOT / "helm" / "kvtier"), "--reuse-values",
                  *sets, "--wait", "--timeout", "5m")  # fmt: skip

    def down(self) -> None:
        """Tears the cluster down and restores the host (cluster.sh down)."""
        down(self.state, self.bin)

    def install(self, *values: Path) -> None:
        """The chart installed as a user would (release "kv", helm install
        --wait), with tests/k8s/values-test.yaml, the engines' test-only
        mounts and `values`, once its volumes and the tokenizer's ConfigMap
        exist."""
        tok = ROOT / "tests" / "models" / "tiny-llama"
        self.kubectl("create", "configmap", "tiny-tokenizer",
                     f"--from-file={tok / 'tokenizer.json'}",
                     f"--from-file={tok / 'tokenizer_config.json'}")  # fmt: skip
        # No provisioner on one node: a hostPath volume per store shard, owned
        # by the store's user (fsGroup does not apply to hostPath volumes).
        for i in range(2):
            folder = self.tmp / "pv" / str(i)
            folder.mkdir(parents=True)
            os.chown(folder, 10001, 10001)
            pv = {
                "apiVersion": "v1", "kind": "PersistentVolume",
                "metadata": {"name": f"kvtier-test-pv-{i}"},
                "spec": {"capacity": {"storage": "2Gi"},
                         "accessModes": ["ReadWriteOnce"],
                         "persistentVolumeReclaimPolicy": "Retain",
                         "hostPath": {"path": str(folder), "type": "Directory"}},
            }  # fmt: skip
            manifest = self.tmp / f"pv-{i}.json"
            manifest.write_text(json.dumps(pv))
            self.kubectl("apply", "-f", str(manifest))
        files = [ROOT / "tests" / "k8s" / "values-test.yaml", engine_mounts(self.tmp),
                 *values]  # fmt: skip
        self.helm("install", RELEASE, str(ROOT / "helm" / "kvtier"),
                  *(a for f in files for a in ("-f", str(f))),
                  "--wait", "--timeout", "12m")  # fmt: skip


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
