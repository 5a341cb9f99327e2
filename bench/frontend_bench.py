"""kvtier-frontend beside nginx, on this machine, in the same run.

Parts (--parts, comma-separated; all by default):
  replay    two real vLLM engines (the CPU build, the tiny model, prefix
            caching and KV events on, one core each) behind nginx
            (least_conn and round-robin, upstream keepalive) and behind
            kvtier-frontend, driven by vLLM's own `vllm bench serve`:
            ../shared/traces replayed with its timed_trace dataset (scaled
            to the tiny model: see scale_trace), its prefix_repetition
            dataset, and its random dataset (no shared prefix). Each run
            starts from empty engine caches (vLLM's /reset_prefix_cache)
            and the same prompts (PYTHONHASHSEED); configurations
            interleaved, each repeated. TTFT mean/p99, ITL p99, output
            tokens/s, each engine's prefix-cache hit rate.
  latency   one engine; 1-token completions one at a time, directly and
            through the frontend, interleaved: the added latency p50/p99.
  capacity  an upstream that answers at once (nginx returning a canned
            completion); wrk driving short completions through nginx
            proxying it and through the frontend, each on one thread:
            requests/s, interleaved pairs.
  memory    1,000 streams held open through the frontend and through nginx
            (the upstream nginx trickles a long event stream): resident
            memory of each proxy.

    build/venv/bin/python bench/frontend_bench.py [--parts replay] [--runs 2]
"""

from __future__ import annotations

import argparse
import itertools
import contextlib
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parents[1]
BUILD = Path(os.environ.get("KVTIER_BUILD_DIR", ROOT / "build")).resolve()
sys.path[:0] = [str(ROOT / "tests" / "python")]

from conftest import Store, engine_env  # noqa: E402
from vllm_engine import kv_transfer_config  # noqa: E402
from vllm_server import BENCH_SERVE, TINY_LLAMA, VllmServer, free_port  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from peer_routers import PeerRouter  # noqa: E402

FRONTEND = BUILD / "frontend" / "kvtier-frontend"
TRACES = ROOT.parent / "shared" / "traces"
NAMESPACE = "00c0ffee00c0ffee"
BLOCK = 32


def pct(xs: list[float], q: float) -> float:
    """The q-quantile of xs (nearest rank)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(math.ceil(q * len(xs))) - 1))]


def ratio(x: float, ref: float) -> str:
    return f"{x / ref:.2f}" if ref > 0 else "-"


def wait_port(port: int, proc: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + 30
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start")
        time.sleep(0.05)


def stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def rss_kib(pids: list[int]) -> int:
    """Resident memory of the processes, summed (VmRSS)."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
    return total


def children(pid: int) -> list[int]:
    out = subprocess.run(
        ["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False
    ).stdout
    return [int(x) for x in out.split()]


class Nginx:
    """nginx from Debian, one worker, daemon off, everything under `work`."""

    def __init__(self, work: Path, name: str, http_body: str) -> None:
        self.dir = work / name
        self.dir.mkdir(parents=True, exist_ok=True)
        conf = self.dir / "nginx.conf"
        conf.write_text(
            f"daemon off;\nworker_processes 1;\npid {self.dir}/nginx.pid;\n"
            f"error_log {self.dir}/error.log;\nworker_rlimit_nofile 8192;\n"
            "events { worker_connections 4096; }\n"
            f"http {{\n access_log off;\n client_body_temp_path {self.dir};\n"
            # Prompts are bodies of tens of KiB: kept in memory, as an LLM
            # API's proxy is set up (the default 1 MiB cap refuses long ones).
            " client_body_buffer_size 4m;\n client_max_body_size 16m;\n"
            f" proxy_temp_path {self.dir};\n{http_body}\n}}\n"
        )
        self.proc = subprocess.Popen(
            ["nginx", "-p", str(self.dir), "-c", str(conf)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )

    def stop(self) -> None:
        stop(self.proc)


def proxy_block(port: int, upstream: str, servers: list[str], balance: str) -> str:
    """A reverse proxy as its docs set it up for an API behind it:
    HTTP/1.1 upstream keepalive, no buffering (server-sent events)."""
    lines = "".join(f"  server {s};\n" for s in servers)
    return (
        f" upstream {upstream} {{\n  {balance}\n{lines}  keepalive 64;\n }}\n"
        f" server {{\n  listen 127.0.0.1:{port};\n  location / {{\n"
        f"   proxy_pass http://{upstream};\n   proxy_http_version 1.1;\n"
        '   proxy_set_header Connection "";\n   proxy_buffering off;\n'
        "   proxy_read_timeout 600s;\n  }\n }\n"
    )


class Frontend:
    def __init__(
        self,
        work: Path,
        engines: list[str],
        threads: int = 1,
        router_port: int = 0,
        flags: tuple[str, ...] = (),
        binary: Path = FRONTEND,
    ) -> None:
        self.port = free_port()
        self.log = work / f"frontend-{self.port}.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [
                    str(binary),
                    f"--listen=127.0.0.1:{self.port}",
                    f"--model={TINY_LLAMA}",
                    "--served-model-name=tiny",
                    "--route-header",
                    "--engines=" + ";".join(engines),
                    f"--threads={threads}",
                    "--max-prompt-tokens=8192",
                    "--health-interval=1s",
                    f"--router-listen=127.0.0.1:{router_port}",
                    *flags,
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        wait_port(self.port, self.proc, "kvtier-frontend")
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        stop(self.proc)


# --- replay -----------------------------------------------------------------


def scale_trace(src: Path, dst: Path, n: int, div: int, out_div: int) -> int:
    """The first n requests of a Mooncake trace, scaled to the tiny model:
    prompt lengths divided by div (each hash id then stands for 512 / div
    tokens, so shared prefixes stay shared block for block), capped at
    3,968 tokens (the engines' context is 4,096); output lengths divided by
    out_div, 1..64. Timestamps as they are. Returns the tokens per id."""
    chunk = 512 // div
    with open(src) as f, open(dst, "w") as out:
        for i, line in enumerate(f):
            if i >= n:
                break
            r = json.loads(line)
            ids = r["hash_ids"]
            inp = min(math.ceil(r["input_length"] / div), 3968)
            keep = math.ceil(inp / chunk)
            r["input_length"] = inp
            r["hash_ids"] = ids[:keep]
            r["output_length"] = max(1, min(64, r["output_length"] // out_div))
            out.write(json.dumps(r) + "\n")
    return chunk


def reachable_hits(path: Path, engines: int = 2) -> tuple[float, float]:
    """The share of a trace's prompt blocks (hash ids) that would be prefix
    hits on engines with unbounded caches: (requests sent round-robin,
    each request sent to the engine holding its longest prefix). Their gap
    bounds what prefix-aware routing can save on that trace, whatever the
    router; finite caches only narrow it for round-robin's duplicates."""

    def replay(aware: bool) -> float:
        held: list[set[int]] = [set() for _ in range(engines)]
        total = hits = 0
        with open(path) as f:
            for i, line in enumerate(f):
                ids = json.loads(line)["hash_ids"]

                def matched(e: int) -> int:
                    n = 0
                    while n < len(ids) and ids[n] in held[e]:
                        n += 1
                    return n

                e = i % engines
                if aware:
                    e = max(
                        range(engines), key=lambda x: (matched(x), x == i % engines)
                    )
                total += len(ids)
                hits += matched(e)
                held[e].update(ids)
        return hits / total if total else 0.0

    return replay(False), replay(True)


def engine_counter(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


def reset_caches(engines: dict[str, VllmServer]) -> None:
    """Empties every engine's prefix cache, and has each say so in its KV
    events: vLLM publishes events (AllBlocksCleared too) at its next step,
    so an idle engine would leave the next frontend's index, replayed from
    the engine's events, holding the last run's blocks until its first
    request. A one-token completion (no whole block) is that step."""
    for e in engines.values():
        req = urllib.request.Request(e.url + "/reset_prefix_cache", method="POST")
        urllib.request.urlopen(req, timeout=60).read()
        step = urllib.request.Request(
            e.url + "/v1/completions",
            data=json.dumps({"model": "tiny", "prompt": [1], "max_tokens": 1}).encode(),
            headers={"Content-Type": "application/json"},
        )
        urllib.request.urlopen(step, timeout=60).read()


def bench_serve(
    url: str, work: Path, tag: str, dataset: list[str], n: int, keep: Path | None = None
) -> dict[str, Any]:
    """One `vllm bench serve` run (vLLM's own client) against url.

    Returns its result JSON; with keep, a copy of it (with every request's
    TTFT and ITLs, in the order sent) goes there as TAG.json.
    """
    result = work / f"{tag}.json"
    env = dict(os.environ, PYTHONHASHSEED="0")
    args = [
        sys.executable, "-c", BENCH_SERVE,
        "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
        "--model", "tiny", "--tokenizer", str(TINY_LLAMA),
        "--num-prompts", str(n), "--seed", "0",
        "--percentile-metrics", "ttft,itl", "--metric-percentiles", "50,99",
        "--save-result", "--result-dir", str(work), "--result-filename", result.name,
        "--disable-tqdm", *(("--save-detailed",) if keep else ()), *dataset,
    ]  # fmt: skip
    with open(work / f"{tag}.log", "wb") as log:
        r = subprocess.run(args, stdout=log, stderr=subprocess.STDOUT, env=env)
    if r.returncode != 0 or not result.exists():
        tail = (work / f"{tag}.log").read_text()[-3000:]
        raise RuntimeError(f"vllm bench serve failed ({tag}):\n{tail}")
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        shutil.copy(result, keep / result.name)
    return dict(json.loads(result.read_text()))


def replay(args: argparse.Namespace, work: Path) -> None:
    print("== replay: two vLLM engines (one core each) behind nginx and kvtier"
          + (", kvtier's store under both" if args.store else ""))  # fmt: skip
    engines: dict[str, VllmServer] = {}
    specs = []
    # The store (--store): every engine saves to and loads from it through
    # kvtier's connector, under nginx as under the frontend; it publishes
    # what it holds to the frontend's router. A fresh one each run, at the
    # same address, so no run starts with another's blocks.
    store_port, router_port = free_port(), free_port()
    store: Store | None = None

    def fresh_store(run: str) -> Store | None:
        if not args.store:
            return None
        d = work / f"store-{run}"
        d.mkdir()
        flags = (f"--router=127.0.0.1:{router_port}", "--router-refresh=1s")
        return Store(d, ram="1GiB", port=store_port, flags=flags)

    peers = [p for p in args.peers.split(",") if p]
    events_at: list[str] = []
    replays_at: list[str] = []
    for i, name in enumerate(("e0", "e1")):
        # TCP and topic "": what vllm-router's kv_aware subscribes to (it
        # drops every message with another topic); kvtier reads the same.
        # The engine binds only a wildcard address (vLLM 0.32 connects its
        # PUB socket to any other tcp:// endpoint); subscribers connect to
        # it on loopback.
        ev_port, rep = free_port(), free_port()
        events = f"tcp://127.0.0.1:{ev_port}"
        events_at.append(events)
        replays_at.append(f"tcp://127.0.0.1:{rep}")
        events_cfg = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{ev_port}",
            "replay_endpoint": f"tcp://127.0.0.1:{rep}",
            "topic": "",
        }
        env = dict(engine_env(), VLLM_SERVER_DEV_MODE="1")
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(i % (os.cpu_count() or 1))
        engines[name] = VllmServer(
            work / f"{name}.log",
            start=False,
            env=env,
            extra=(
                "--block-size", str(BLOCK), "--enable-prefix-caching",
                "--kv-events-config", json.dumps(events_cfg),
                "--max-num-seqs", "32",
                # vllm-router tokenizes text prompts through the engine's
                # render endpoint, which vLLM serves only with this.
                *(("--enable-scale-out",) if peers else ()),
                "--num-gpu-blocks-override", str(args.kv_blocks),
                *(("--hf-overrides", args.hf_overrides)
                  if args.hf_overrides else ()),
                *(("--kv-transfer-config",
                   json.dumps(kv_transfer_config(f"127.0.0.1:{store_port}")))
                  if args.store else ()),
            ),
        )  # fmt: skip
        specs.append(
            f"id={name},endpoint=127.0.0.1:{engines[name].port},events={events},"
            f"replay=tcp://127.0.0.1:{rep},"
            f"namespace={NAMESPACE},block-tokens={BLOCK}"
        )
    upstreams = [f"127.0.0.1:{e.port}" for e in engines.values()]
    lc_port, rr_port = free_port(), free_port()
    nginx = Nginx(
        work,
        "nginx-proxy",
        proxy_block(lc_port, "lc", upstreams, "least_conn;")
        + proxy_block(rr_port, "rr", upstreams, ""),
    )
    try:
        store = fresh_store("start")
        for e in engines.values():
            e.start()
        for e in engines.values():
            e.wait()
        wait_port(lc_port, nginx.proc, "nginx")
        datasets: dict[str, list[str]] = {}
        for trace in ("conversation_trace", "mooncake_slice_trace"):
            src = TRACES / f"{trace}.jsonl"
            if not src.exists():
                print(f"  {src} is missing: skipped")
                continue
            dst = work / f"{trace}-scaled.jsonl"
            chunk = scale_trace(src, dst, args.requests, args.div, args.out_div)
            rr, aware = reachable_hits(dst)
            print(
                f"  {trace}: prefix hits reachable with unbounded caches, "
                f"round-robin {rr:.1%}, prefix-aware {aware:.1%} of prompt blocks"
            )
            datasets[trace] = [
                "--dataset-name", "timed_trace", "--dataset-path", str(dst),
                "--timed-trace-chunk-hash-size", str(chunk),
                "--timed-trace-sec-multiplier", str(0.001 / args.speed),
            ]  # fmt: skip
        datasets["prefix_repetition"] = [
            "--dataset-name", "prefix_repetition",
            "--prefix-repetition-prefix-len", "1024",
            "--prefix-repetition-suffix-len", "64",
            "--prefix-repetition-num-prefixes", "16",
            "--prefix-repetition-output-len", "16",
            "--request-rate", str(args.rate), "--ignore-eos",
        ]  # fmt: skip
        datasets["random"] = [
            "--dataset-name", "random", "--random-input-len", "512",
            "--random-output-len", "16", "--request-rate", str(args.rate),
            "--ignore-eos",
        ]  # fmt: skip
        chosen = [d for d in args.datasets.split(",") if d in datasets]
        # --variant NAME=FLAGS: the frontend again with other flags, beside
        # (a first word @PATH: that frontend binary, an earlier build).
        variants: dict[str, tuple[Path, tuple[str, ...]]] = {"kvtier": (FRONTEND, ())}
        for v in args.variant:
            name, _, rest = v.partition("=")
            words = rest.split()
            binary = FRONTEND
            if words and words[0].startswith("@"):
                binary = Path(words.pop(0)[1:]).resolve()
            variants[name] = (binary, tuple(words))
        configs = ["nginx-least_conn", "nginx-round_robin", *peers, *variants]
        workers = [f"http://127.0.0.1:{e.port}" for e in engines.values()]
        rows: dict[tuple[str, str], list[dict[str, float]]] = {}
        for run in range(args.runs):
            for ds in chosen:
                order = configs if run % 2 == 0 else list(reversed(configs))
                for cfg in order:
                    reset_caches(engines)
                    if store is not None:
                        store.stop()
                        store = fresh_store(f"{ds}-{cfg}-{run}")
                    time.sleep(1)
                    before = {
                        n: (
                            engine_counter(e.url, "vllm:prefix_cache_hits_total"),
                            engine_counter(e.url, "vllm:prefix_cache_queries_total"),
                        )
                        for n, e in engines.items()
                    }
                    fe = None
                    peer: PeerRouter | None = None
                    if cfg in peers:
                        peer = PeerRouter(BUILD, cfg, work, workers,
                                          events_at, replays_at,
                                          BLOCK, "tiny")  # fmt: skip
                        wait_port(peer.port, peer.proc, cfg)
                        time.sleep(1.5)  # its subscriptions and health checks are up
                        url = peer.url
                    elif cfg in variants:
                        fe = Frontend(work, specs, threads=1, router_port=router_port,
                                      flags=variants[cfg][1]
                                      + (("--log-routes",) if args.keep else ()),
                                      binary=variants[cfg][0])  # fmt: skip
                        time.sleep(1.5)  # its subscriptions are up
                        url = fe.url
                    else:
                        port = lc_port if "least" in cfg else rr_port
                        url = f"http://127.0.0.1:{port}"
                    try:
                        res = bench_serve(url, work, f"{ds}-{cfg}-{run}", datasets[ds],
                                          args.num_prompts if not ds.endswith("trace")
                                          else args.requests, args.keep)  # fmt: skip
                    except RuntimeError as e:
                        if peer is None:
                            raise
                        # A peer that cannot serve this set: said, not fatal.
                        print(f"  run {run + 1} {ds:20s} {cfg:18s} FAILED: "
                              + str(e).strip().splitlines()[-1][:300],
                              flush=True)  # fmt: skip
                        continue
                    finally:
                        if peer is not None:
                            lookups = peer.metric(
                                "vllm_router_kv_placement_lookups_total"
                            )
                            if lookups:
                                print(f"  {cfg} KV lookups: {lookups}")
                            stop(peer.proc)
                            if args.keep is not None:
                                shutil.copy(
                                    peer.log, args.keep / f"{ds}-{cfg}-{run}.log"
                                )
                        if fe is not None:
                            stop(fe.proc)
                            if args.keep is not None:
                                kept = f"{ds}-{cfg}-{run}-frontend.log"
                                shutil.copy(fe.log, args.keep / kept)
                    hit = {}
                    for n, e in engines.items():
                        h = engine_counter(e.url, "vllm:prefix_cache_hits_total")
                        q = engine_counter(e.url, "vllm:prefix_cache_queries_total")
                        dq = q - before[n][1]
                        hit[n] = (h - before[n][0]) / dq if dq > 0 else 0.0
                    row = {
                        "ttft_mean": res["mean_ttft_ms"],
                        "ttft_p99": res["p99_ttft_ms"],
                        "itl_p99": res["p99_itl_ms"],
                        "tok_s": res["output_throughput"],
                        "failed": float(res.get("failed", 0)),
                        "hit_e0": hit["e0"],
                        "hit_e1": hit["e1"],
                    }
                    rows.setdefault((ds, cfg), []).append(row)
                    print(
                        f"  run {run + 1} {ds:20s} {cfg:18s} TTFT mean "
                        f"{row['ttft_mean']:8.1f} ms p99 {row['ttft_p99']:8.1f} ms "
                        f"ITL p99 {row['itl_p99']:7.1f} ms {row['tok_s']:7.1f} tok/s "
                        f"hits e0 {hit['e0']:.1%} e1 {hit['e1']:.1%} "
                        f"failed {int(row['failed'])}",
                        flush=True,
                    )
        print(
            "  kvtier / each reference, and / the best of them"
            " (lower TTFT is better), per run:"
        )
        for ds in chosen:
            for run, name in itertools.product(range(args.runs), variants):
                k = rows[(ds, name)][run]
                # A reference that failed requests (sglang-router refuses
                # token-id prompts) is no reference: said above, left out.
                refs = {c: rows[(ds, c)][run] for c in configs
                        if c not in variants
                        and len(rows.get((ds, c), [])) > run
                        and rows[(ds, c)][run]["failed"] == 0}  # fmt: skip
                best = min(refs, key=lambda c: refs[c]["ttft_mean"])
                each = ", ".join(
                    f"{c} {ratio(k['ttft_mean'], r['ttft_mean'])}x/"
                    f"{ratio(k['ttft_p99'], r['ttft_p99'])}x"
                    for c, r in refs.items()
                )
                b = refs[best]
                print(
                    f"  {ds:20s} {name} run {run + 1}: best ({best}) TTFT mean "
                    f"{ratio(k['ttft_mean'], b['ttft_mean'])}x, "
                    f"p99 {ratio(k['ttft_p99'], b['ttft_p99'])}x, "
                    f"ITL p99 {ratio(k['itl_p99'], b['itl_p99'])}x, "
                    f"tok/s {ratio(k['tok_s'], b['tok_s'])}x; mean/p99 against {each}"
                )
    finally:
        nginx.stop()
        for e in engines.values():
            e.stop()
        if store is not None:
            store.stop()


# --- latency ----------------------------------------------------------------


def timed_post(conn: Any, path: str, body: bytes) -> float:
    t = time.perf_counter()
    conn.request("POST", path, body, {"Content-Type": "application/json"})
    r = conn.getresponse()
    r.read()
    if r.status != 200:
        raise RuntimeError(f"{path}: {r.status}")
    return time.perf_counter() - t


def latency(args: argparse.Namespace, work: Path) -> None:
    import http.client

    print("== latency: 1-token completions, directly and through the frontend"
          " (and through --peers' vllm-router)")  # fmt: skip
    env = dict(os.environ)
    engine = VllmServer(work / "lat-engine.log", env=env, extra=("--block-size", "32"))
    fe = Frontend(work, one_engine(engine.port, work))
    name = peer_of(args)
    peer: PeerRouter | None = None
    try:
        if name:
            peer = PeerRouter(BUILD, name, work, [f"http://127.0.0.1:{engine.port}"],
                              [], [], BLOCK, "tiny")  # fmt: skip
            wait_port(peer.port, peer.proc, name)
        direct = http.client.HTTPConnection("127.0.0.1", engine.port)
        front = http.client.HTTPConnection("127.0.0.1", fe.port)
        other = http.client.HTTPConnection("127.0.0.1", peer.port) if peer else None
        for kind, prompt in (
            ("token ids", list(range(100, 164))),
            ("text", "Hi " * 60),
        ):
            body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 1})
            for c in (direct, front, other):
                for _ in range(20 if c is not None else 0):
                    timed_post(c, "/v1/completions", body.encode())
            d, f, v = [], [], []
            for _ in range(args.pairs):
                d.append(timed_post(direct, "/v1/completions", body.encode()))
                f.append(timed_post(front, "/v1/completions", body.encode()))
                if other is not None:
                    v.append(timed_post(other, "/v1/completions", body.encode()))
            for q in (0.5, 0.99):
                line = (f"  {kind:9s} p{int(q * 100):<2d} "
                        f"direct {pct(d, q) * 1e3:7.3f} ms, "
                        f"frontend {pct(f, q) * 1e3:7.3f} ms, added "
                        f"{(pct(f, q) - pct(d, q)) * 1e3:+.3f} ms")  # fmt: skip
                if v:
                    line += (f"; {name} {pct(v, q) * 1e3:7.3f} ms, added "
                             f"{(pct(v, q) - pct(d, q)) * 1e3:+.3f} ms")  # fmt: skip
                print(line)
    finally:
        if peer is not None:
            stop(peer.proc)
        fe.stop()
        engine.stop()


# --- capacity ---------------------------------------------------------------

CANNED = json.dumps(
    {
        "id": "cmpl-0",
        "object": "text_completion",
        "created": 0,
        "model": "tiny",
        "choices": [{"index": 0, "text": " ok", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9},
    }
)


def wrk(url: str, work: Path, seconds: int, conns: int) -> float:
    """Requests/s wrk (one thread) reaches POSTing a short completion."""
    script = work / "post.lua"
    script.write_text(
        'wrk.method = "POST"\n'
        'wrk.headers["Content-Type"] = "application/json"\n'
        'wrk.body = \'{"model": "tiny", "prompt": "Say hello to the world", '
        '"max_tokens": 1}\'\n'
    )
    out = subprocess.run(
        [
            "wrk",
            "-t1",
            f"-c{conns}",
            f"-d{seconds}s",
            "-s",
            str(script),
            url + "/v1/completions",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    errors = [ln for ln in out.splitlines() if "Non-2xx" in ln or "Socket errors" in ln]
    if errors:
        raise RuntimeError(f"wrk saw errors: {errors}")
    return float(
        next(ln for ln in out.splitlines() if ln.startswith("Requests/sec")).split()[1]
    )


def one_engine(port: int, work: Path) -> list[str]:
    """The frontend's --engines for one engine at port (no KV events)."""
    return [
        f"id=e0,endpoint=127.0.0.1:{port},events=ipc://{work}/none,"
        f"namespace={NAMESPACE},block-tokens={BLOCK}"
    ]


@contextlib.contextmanager
def behind_each(
    work: Path, name: str, server: str, peer: str = ""
) -> Iterator[tuple[int, Frontend, Nginx, PeerRouter | None]]:
    """An nginx upstream with `server`'s locations, and in front of it nginx
    proxying, kvtier-frontend and (`peer`, a name of bench/peer_routers.py)
    a peer router: (nginx's port, the frontend, nginx, the peer or None)."""
    up_port, px_port = free_port(), free_port()
    upstream = Nginx(
        work, name, f" server {{\n  listen 127.0.0.1:{up_port};\n{server} }}\n"
    )
    proxy = Nginx(
        work, "nginx-front", proxy_block(px_port, "up", [f"127.0.0.1:{up_port}"], "")
    )
    fe: Frontend | None = None
    other: PeerRouter | None = None
    try:
        wait_port(up_port, upstream.proc, "nginx")
        wait_port(px_port, proxy.proc, "nginx")
        fe = Frontend(work, one_engine(up_port, work))
        if peer:
            other = PeerRouter(BUILD, peer, work, [f"http://127.0.0.1:{up_port}"],
                               [], [], BLOCK, "tiny")  # fmt: skip
            wait_port(other.port, other.proc, peer)
        yield px_port, fe, proxy, other
    finally:
        if other is not None:
            stop(other.proc)
        if fe is not None:
            fe.stop()
        proxy.stop()
        upstream.stop()


def peer_of(args: argparse.Namespace) -> str:
    """The vllm-router config of --peers that capacity and memory measure
    beside nginx ("" for none): their upstream is one canned nginx, so the
    policy does not matter; cache_aware is vllm-router's default."""
    return "vllm-router-cache_aware" if "vllm-router" in args.peers else ""


def capacity(args: argparse.Namespace, work: Path) -> None:
    print("== capacity: short completions, an upstream answering at once (nginx)")
    if shutil.which("wrk") is None:
        print("  wrk is not installed: skipped")
        return
    server = (
        "  location = /health { return 200 ''; }\n"
        "  location / { default_type application/json; "
        f"return 200 '{CANNED}'; }}\n"
    )
    with behind_each(work, "nginx-canned", server, peer_of(args)) as (
        px_port, fe, _, peer,
    ):  # fmt: skip
        ratios, peer_ratios = [], []
        for i in range(args.runs * 2):
            n = wrk(f"http://127.0.0.1:{px_port}", work, args.seconds, 32)
            k = wrk(fe.url, work, args.seconds, 32)
            ratios.append(k / n)
            line = (f"  pair {i + 1}: nginx {n:9.0f} req/s, "
                    f"kvtier-frontend {k:9.0f} req/s, ratio {k / n:.2f}")  # fmt: skip
            if peer is not None:
                v = wrk(peer.url, work, args.seconds, 32)
                peer_ratios.append(k / v)
                line += f"; {peer.name} {v:9.0f} req/s, kvtier / it {k / v:.2f}"
            print(line)
        print(f"  ratio to nginx median {statistics.median(ratios):.2f} "
              f"(range {min(ratios):.2f}-{max(ratios):.2f})")  # fmt: skip
        if peer_ratios:
            print(f"  ratio to {peer.name} median {statistics.median(peer_ratios):.2f} "
                  f"(range {min(peer_ratios):.2f}-{max(peer_ratios):.2f})")  # fmt: skip


# --- memory -----------------------------------------------------------------


def hold_streams(port: int, n: int) -> list[socket.socket]:
    """n streaming completions open on port, each past its first bytes."""
    body = json.dumps({"model": "tiny", "prompt": "Tell a story", "max_tokens": 4000,
                       "stream": True}).encode()  # fmt: skip
    req = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(req)
        socks.append(s)
    for s in socks:
        s.settimeout(30)
        if not s.recv(256):
            raise RuntimeError("a stream closed at once")
    return socks


def memory(args: argparse.Namespace, work: Path) -> None:
    import resource

    print(f"== memory: {args.streams} streams held open")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    events = "".join(
        'data: {"id":"cmpl-0","object":"text_completion","choices":[{"index":0,'
        '"text":" word","finish_reason":null}]}\\n\\n'
        for _ in range(25)  # nginx takes a 4 KiB parameter at most
    )
    server = (
        # Health checks answered at once (a peer router waits for them).
        "  limit_rate 16;\n  location = /health { limit_rate 0; return 200 ''; }\n"
        "  location / { default_type text/event-stream; "
        f"return 200 '{events}'; }}\n"
    )
    with behind_each(work, "nginx-trickle", server, peer_of(args)) as (
        px_port, fe, proxy, peer,
    ):  # fmt: skip
        measured = [
            ("kvtier-frontend", fe.port, [fe.proc.pid]),
            ("nginx", px_port, [proxy.proc.pid, *children(proxy.proc.pid)]),
        ]
        if peer is not None:
            measured.append(
                (peer.name, peer.port, [peer.proc.pid, *children(peer.proc.pid)])
            )
        for name, port, pids in measured:
            idle = rss_kib(pids)
            socks = hold_streams(port, args.streams)
            time.sleep(1)
            held = rss_kib(pids)
            for s in socks:
                s.close()
            print(f"  {name:16s} idle {idle / 1024:7.1f} MiB, {args.streams} streams "
                  f"{held / 1024:7.1f} MiB "
                  f"({(held - idle) / args.streams:.1f} KiB a stream)")  # fmt: skip
            time.sleep(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="latency,capacity,memory,replay")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--datasets",
                    default="conversation_trace,mooncake_slice_trace,"
                    "prefix_repetition,random")  # fmt: skip
    ap.add_argument("--requests", type=int, default=120, help="trace requests replayed")
    ap.add_argument("--div", type=int, default=8, help="trace prompt lengths / this")
    ap.add_argument(
        "--out-div", type=int, default=16, help="trace output lengths / this"
    )
    ap.add_argument("--speed", type=float, default=1.0, help="trace time compression")
    ap.add_argument(
        "--rate", type=float, default=4.0, help="req/s of the synthetic sets"
    )
    ap.add_argument("--num-prompts", type=int, default=80, help="synthetic requests")
    ap.add_argument(
        "--kv-blocks",
        type=int,
        default=256,
        help="each engine's KV memory, in 32-token blocks",
    )
    ap.add_argument(
        "--hf-overrides",
        default="",
        help="replay: vLLM's --hf-overrides (JSON) for every engine: the tiny "
        "model in another shape (dummy weights), e.g. one whose prefill costs more",
    )
    ap.add_argument(
        "--store",
        action="store_true",
        help="replay: the engines with kvtier's connector and a store",
    )
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        help="replay: NAME=FLAGS, the frontend with FLAGS as one more config "
        "(FLAGS starting @PATH: the frontend binary at PATH, e.g. an earlier build)",
    )
    ap.add_argument(
        "--keep",
        type=Path,
        default=None,
        help="replay: copy every run's result (per-request TTFT and ITLs) and "
        "frontend log (with --log-routes) here",
    )
    ap.add_argument(
        "--peers",
        default="",
        help="replay: peer routers as more configs, ','-separated: "
        "vllm-router-kv_aware, vllm-router-cache_aware, sglang-router "
        "(scripts/peer_routers.sh installs them); latency, capacity and memory: "
        "vllm-router beside the frontend when one is named",
    )
    ap.add_argument("--pairs", type=int, default=300)
    ap.add_argument("--seconds", type=int, default=5)
    ap.add_argument("--streams", type=int, default=1000)
    args = ap.parse_args()
    if not FRONTEND.exists():
        sys.exit(f"{FRONTEND} is not built (make build)")
    if shutil.which("nginx") is None:
        sys.exit("nginx is not installed (scripts/setup.sh installs nginx-light)")
    with tempfile.TemporaryDirectory(prefix="kvtier-frontend-bench-") as tmp:
        work = Path(tmp)
        parts = args.parts.split(",")
        for name, fn in (("latency", latency), ("capacity", capacity),
                         ("memory", memory), ("replay", replay)):  # fmt: skip
            if name in parts:
                fn(args, work)


if __name__ == "__main__":
    main()
