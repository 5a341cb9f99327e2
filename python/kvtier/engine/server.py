"""kvtier-torch-engine: the reference engine as a worker process.

Serves ``kvtier.v1.SimWorker`` (Submit, GetWorkerStats) on gRPC like
kvtier-sim-worker, so routers and ``kvtier-bench replay --engine torch`` drive
it the same way, but every prompt token is computed by a real transformer
(kvtier.engine.model) and every loaded block is a real KV block. Publishes
its prefix cache's blocks as KV events and its load as heartbeats to routers.

    python3 -m kvtier.engine.server --listen 127.0.0.1:0 \\
        --store 127.0.0.1:7400 --router 127.0.0.1:7500 --port-file /tmp/p

Submit needs the prompt's token ids (``SubmitRequest.tokens``); a request
naming only block hashes is INVALID_ARGUMENT (no tokens, nothing to compute).
SIGTERM or SIGINT stops it: with ``--drain`` (the default) it first drains
(Engine.drain: announces draining, finishes the requests it took, saves the
cached blocks the store lacks within ``--drain-timeout`` and
``--drain-bytes``); then the server, then the engine (queued saves are
written).
"""

from __future__ import annotations

import os

# OpenBLAS (Debian's libblas.so.3 with libopenblas0-pthread) starts a thread
# per core that spins between calls; an engine process uses --threads
# threads through torch, so BLAS gets one. Set before numpy or torch loads.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from typing import Any, Optional  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

import kvtier  # noqa: E402
from kvtier.engine.engine import (Engine, EngineConfig, Result,  # noqa: E402
                                  namespace_for)
from kvtier.engine.model import ModelConfig, Transformer  # noqa: E402
from kvtier.errors import InvalidArgument, StatusCode  # noqa: E402


def response_of(res: Result) -> dict[str, Any]:
    """The SubmitResponse fields of a result."""
    extra: dict[str, Any] = {}
    if res.load_times:
        extra["onboard_breakdown"] = res.load_times
    return {**extra,
        "ttft_ms": res.ttft_ms,
        "prompt_tokens": res.prompt_tokens,
        "prefill_tokens": res.computed_tokens,
        "gpu_hit_tokens": res.gpu_hit_tokens,
        "onboarded_tokens": res.loaded_tokens,
        # Every loaded block was verified against the checksum its writer
        # computed from the pages it wrote; one that failed was recomputed.
        "verified_blocks": res.loaded_blocks,
        "mismatched_blocks": 0,
        "load_status": res.load_status,
        "onboard_ms": res.onboard_ms,
        "onboarded_from_disk": res.loaded_from_disk,
        "decode_ms": res.decode_ms,
        "store_lookup_skipped": res.store_lookup_skipped,
    }


class Handler:
    """What the gRPC server calls (with the GIL; generate waits without)."""

    def __init__(self, engine: Engine, worker_id: str,
                 max_decode_tokens: int) -> None:
        self.engine = engine
        self.worker_id = worker_id
        self.max_decode_tokens = max_decode_tokens

    def submit(self, req: dict[str, Any]) -> dict[str, Any]:
        """Runs one SubmitRequest (a dict) and answers a SubmitResponse."""
        tokens = req["tokens"]
        if tokens is None:
            raise InvalidArgument(
                StatusCode.INVALID_ARGUMENT,
                "the torch engine needs the prompt's token ids "
                "(SubmitRequest.tokens), not block hashes")
        n_out = max(1, min(int(req["output_tokens"]), self.max_decode_tokens))
        hint = req.get("store_hint_blocks")
        res = self.engine.generate(
            np.asarray(tokens).tolist(), n_out,
            caller_id=int(req["request_id"]),
            store_hint=None if hint is None else int(hint))
        return response_of(res)

    def stats(self) -> dict[str, Any]:
        """GetWorkerStatsResponse fields."""
        s = self.engine.stats
        cs = self.engine.connector.stats() if self.engine.connector else {}
        pages = self.engine.pages
        return {
            "worker_id": self.worker_id,
            "requests": s["requests"],
            "pages": self.engine.config.num_pages,
            "free_pages": len(pages.free),
            "cached_pages": len(pages.page_of),
            "loaded_blocks": s["loaded_blocks"],
            "load_failures": s["load_failures"],
            "offloaded_blocks": cs.get("offloaded_blocks", 0),
            "offload_dropped": cs.get("offload_dropped_full", 0),
            "offload_failures": cs.get("offload_failures", 0),
            "staging_peak_blocks": cs.get("staging_peak", 0),
            "staging_blocks": cs.get("staging_blocks", 0),
            "verified_blocks": s["loaded_blocks"],
            "mismatched_blocks": 0,
            # What the engine's saves did (kvtier-bench replay prints it).
            "offload_breakdown": (self.engine.connector.offload_times()
                                  if self.engine.connector else {}),
            "offload_batches": cs.get("offload_batches", 0),
            "offload_round_trips": cs.get("offload_round_trips", 0),
            "offloaded_bytes": cs.get("offloaded_bytes", 0),
            "computed_blocks": cs.get("computed_blocks", 0),
        }


def _flags(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="kvtier-torch-engine",
        description="The PyTorch reference engine over kvtier, serving "
                    "kvtier.v1.SimWorker Submit with real forward passes.")
    p.add_argument("--listen", default="127.0.0.1:0",
                   help="gRPC address HOST:PORT (port 0: a free one)")
    p.add_argument("--store", default="",
                   help="comma-separated kvtier-store addresses ('': none)")
    p.add_argument("--router", default="",
                   help="comma-separated kvtier-router addresses")
    p.add_argument("--worker-id", default="")
    p.add_argument("--version", action="version",
                   version=f"kvtier-torch-engine {kvtier.__version__}")
    p.add_argument("--endpoint", default="",
                   help="where routers send requests [the bound address]")
    p.add_argument("--port-file", default="",
                   help="write the bound port here once serving")
    p.add_argument("--heartbeat-ms", type=int, default=200)
    p.add_argument("--tls-cert", default="",
                   help="PEM certificate chain this engine presents (serving "
                        "TLS; also to stores and routers)")
    p.add_argument("--tls-key", default="", help="its private key")
    p.add_argument("--tls-ca", default="",
                   help="PEM CA bundle stores, routers and clients are "
                        "verified against")
    p.add_argument("--tls-require-client-cert", action="store_true",
                   help="refuse clients without a CA-signed certificate")
    p.add_argument("--deadline-ms", type=int, default=10000,
                   help="deadline of each store operation")
    p.add_argument("--lookup-wait-share", type=float,
                   default=EngineConfig.lookup_wait_share,
                   help="how long a store lookup is waited for, as a share "
                        "of computing what it could save (at least 5 ms; "
                        "0: up to the deadline)")
    p.add_argument("--pages", type=int, default=EngineConfig.num_pages)
    p.add_argument("--page-tokens", type=int,
                   default=EngineConfig.page_tokens)
    p.add_argument("--max-step-tokens", type=int,
                   default=EngineConfig.max_step_tokens)
    p.add_argument("--max-running", type=int,
                   default=EngineConfig.max_running)
    p.add_argument("--layout", choices=["kv_first", "blocks_first"],
                   default=EngineConfig.layout)
    p.add_argument("--kv-dtype", choices=["fp16", "bf16"], default="fp16")
    p.add_argument("--max-decode-tokens", type=int, default=16,
                   help="cap on a request's output tokens (TTFT is what a "
                        "replay measures)")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--drain", action=argparse.BooleanOptionalAction,
                   default=True,
                   help="on SIGTERM, leave without losing the cache: "
                        "announce draining, finish the requests taken, save "
                        "the cached blocks the store lacks (most valuable "
                        "first), then stop")
    p.add_argument("--drain-timeout", type=float, default=20.0,
                   help="the drain's budget in seconds (requests in flight "
                        "and saves together)")
    p.add_argument("--drain-bytes", type=int, default=4 << 30,
                   help="at most this many block bytes saved by the drain")
    d = ModelConfig()
    for name in ("vocab_size", "hidden", "layers", "heads", "kv_heads",
                 "head_dim", "ffn", "seed"):
        p.add_argument("--" + name.replace("_", "-"), type=int,
                       default=getattr(d, name))
    a = p.parse_args(argv)
    if not 0 <= a.drain_timeout <= 3600:
        p.error(f"--drain-timeout is {a.drain_timeout} s (allowed 0..3600)")
    if a.drain_bytes < 0:
        p.error(f"--drain-bytes is {a.drain_bytes} (must be >= 0)")
    if os.environ.get("KVTIER_FLAGS_ONLY") == "1":  # the docs' check
        sys.exit(0)
    return a


def _write_port_file(path: str, port: int) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="ascii") as f:
        f.write(f"{port}\n")
    os.replace(tmp, path)


def main(argv: Optional[list[str]] = None) -> int:
    """Runs the engine until SIGTERM / SIGINT. Exit status 2 for bad flags
    or configuration, 1 if it cannot serve."""
    a = _flags(argv)
    torch.set_num_threads(max(1, a.threads))
    try:
        mc = ModelConfig(vocab_size=a.vocab_size, hidden=a.hidden,
                         layers=a.layers, heads=a.heads, kv_heads=a.kv_heads,
                         head_dim=a.head_dim, ffn=a.ffn, seed=a.seed)
        mc.validate()
        ec = EngineConfig(num_pages=a.pages, page_tokens=a.page_tokens,
                          max_step_tokens=a.max_step_tokens,
                          max_running=a.max_running, kv_dtype=a.kv_dtype,
                          layout=a.layout,
                          lookup_wait_share=a.lookup_wait_share or None)
    except ValueError as e:
        print(f"kvtier-torch-engine: {e}", file=sys.stderr)
        return 2
    stores = [s for s in a.store.split(",") if s]
    routers = [r for r in a.router.split(",") if r]
    server: list[kvtier.WorkerServer] = []

    def stored(h: np.ndarray) -> None:
        if server:
            server[0].publish_stored(h)

    def removed(h: np.ndarray) -> None:
        if server:
            server[0].publish_removed(h)

    ns = namespace_for(mc, ec)


    try:
        engine = Engine(Transformer(mc), ec, stores, stored, removed,
                        {"deadline_ms": a.deadline_ms, "tls_ca": a.tls_ca,
                         "tls_cert": a.tls_cert, "tls_key": a.tls_key})
    except kvtier.KvtierError as e:
        print(f"kvtier-torch-engine: {e}", file=sys.stderr)
        return 1
    handler = Handler(engine, a.worker_id, a.max_decode_tokens)
    try:
        srv = kvtier.WorkerServer(
            handler, a.listen, routers, a.worker_id, a.endpoint, ns,
            a.heartbeat_ms, tls_cert=a.tls_cert, tls_key=a.tls_key,
            tls_ca=a.tls_ca,
            tls_require_client_cert=a.tls_require_client_cert)
    except kvtier.KvtierError as e:
        print(f"kvtier-torch-engine: {e}", file=sys.stderr)
        engine.close()
        return 1
    server.append(srv)
    handler.worker_id = srv.worker_id
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"kvtier-torch-engine listening on {srv.address} (namespace "
          f"{ns.id:016x}, {ec.num_pages} pages of {ns.block_bytes} bytes, "
          f"{len(stores)} store(s), {len(routers)} router(s))", flush=True)
    if a.port_file:
        _write_port_file(a.port_file, srv.port)
    while not stop.wait(a.heartbeat_ms / 1000.0):
        rep = engine.load_report(listed_s=3 * a.heartbeat_ms / 1000.0)
        srv.set_load(rep.running, rep.queued_tokens, rep.free_pages,
                     rep.arrived)
    if a.drain:
        # Routers hear it with the next heartbeat; a Submit from now on is
        # UNAVAILABLE (the replay and frontends send it elsewhere).
        srv.set_draining()
        print(f"kvtier-torch-engine draining: no new requests; "
              f"{a.drain_timeout:g} s budget", flush=True)
        d = engine.drain(a.drain_timeout, a.drain_bytes)
        print(f"kvtier-torch-engine drained in {d.ms:.0f} ms: "
              f"{d.unfinished} requests unfinished, {d.cached} blocks cached, "
              f"{d.known} known stored, {d.queued} saved ({d.bytes} bytes), "
              f"{d.saved} written"
              + (f", stopped by {d.stopped}" if d.stopped else ""),
              flush=True)
    srv.stop()
    engine.close()
    print("kvtier-torch-engine stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
