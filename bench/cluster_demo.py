"""make demo-cluster: the whole fleet on a real one-node Kubernetes cluster on
this machine (tests/python/k8s_cluster.py: the binaries built once and
cached, the images from the build tree, no registry), installed with the
chart as tests/python/test_k8s_cluster.py installs it (two store shards,
the router, the frontend, two vLLM CPU engines with kvtier's connector),
then the Mooncake slice trace (../shared/traces) replayed through the
frontend Service by vLLM's own `vllm bench serve` (timed_trace), scaled to
the tiny model as bench/frontend_bench.py scales it. Prints the replay's
figures and the frontend's routes, then tears the cluster down (--keep:
leaves it up and says how to use it and take it down). Needs root.

    build/venv/bin/python bench/cluster_demo.py [--requests 60] [--keep]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "python"), str(ROOT / "bench")]

from frontend_bench import TRACES, bench_serve, scale_trace  # noqa: E402
from k8s_cluster import RELEASE, SCRIPTS, Cluster  # noqa: E402


def main() -> None:
    """Brings the fleet up, replays the trace through it, and reports."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=60, help="trace requests replayed")
    ap.add_argument("--keep", action="store_true", help="leave the cluster up")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("cluster_demo: a cluster needs root")
    src = TRACES / "mooncake_slice_trace.jsonl"
    if not src.exists():
        sys.exit(f"cluster_demo: {src} is missing (../shared/traces)")
    work = Path(tempfile.mkdtemp(prefix="kvtier-cluster-"))
    cluster = Cluster(work)
    try:
        print("== the chart: helm install --wait (two shards, router, frontend, "
              "two vLLM CPU engines)")  # fmt: skip
        cluster.install()
        print(cluster.kubectl("get", "pods", "-o", "wide"))
        url = cluster.service_url(f"{RELEASE}-frontend")
        dst = work / "mooncake-scaled.jsonl"
        chunk = scale_trace(src, dst, args.requests, 8, 16)
        print(f"== {args.requests} requests of {src.name} through the frontend "
              f"Service {url}")  # fmt: skip
        res = bench_serve(url, work, "cluster", [
            "--dataset-name", "timed_trace", "--dataset-path", str(dst),
            "--timed-trace-chunk-hash-size", str(chunk),
            "--timed-trace-sec-multiplier", "0.001"], args.requests)  # fmt: skip
        print(f"  completed {res['completed']} of {args.requests}, failed "
              f"{res.get('failed', 0)}; TTFT mean {res['mean_ttft_ms']:.1f} ms, "
              f"p99 {res['p99_ttft_ms']:.1f} ms; "
              f"{res['request_throughput']:.2f} req/s")  # fmt: skip
        frontend = cluster.get("pods", "-l", "app.kubernetes.io/component=frontend")
        ip = frontend["items"][0]["status"]["podIP"]
        with urllib.request.urlopen(f"http://{ip}:9600/metrics", timeout=10) as r:
            routes = [ln for ln in r.read().decode().splitlines()
                      if ln.startswith("kvtier_frontend_routes_total")]  # fmt: skip
        print("== the frontend's routes, by engine and reason")
        print("\n".join(f"  {ln}" for ln in routes))
    finally:
        if args.keep:
            kubeconfig = cluster.state / "admin.kubeconfig"
            print(f"== left up: export KUBECONFIG={kubeconfig}; "
                  f"kubectl is {cluster.bin / 'kubectl'}; take it down with\n"
                  f"  bash {SCRIPTS / 'cluster.sh'} down {cluster.state} {cluster.bin}")
        else:
            cluster.down()


if __name__ == "__main__":
    main()
