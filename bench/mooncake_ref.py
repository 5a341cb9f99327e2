"""Mooncake Store as a reference for kvtier's store and data-plane benchmarks.

Starts a Mooncake Store on 127.0.0.1 the way it is deployed: ``mooncake_master``
(with its HTTP metadata server) and one ``mooncake_client`` holding the
memory (the store's RAM, as ``kvtier-store`` holds it), then ``clients``
processes that each register their buffer with Mooncake's transfer engine
and move blocks with its zero-copy batch calls (``batch_put_from``,
``batch_get_into``) over TCP, ``batch`` blocks a call, after one untimed
pass that touches the store's memory (then removed). Every client reads
back the blocks it wrote and checks them. Prints one JSON object:
``{"put": {"gib_s", "ops_s"}, "get": {...}, "blocks", ...}``, or
``{"error": "..."}`` with exit status 1 when Mooncake cannot run here.

Usage: python bench/mooncake_ref.py --block-bytes N --blocks N --batch N
       --clients N [--segment-bytes N]

Mooncake comes from PyPI (``mooncake-transfer-engine-non-cuda``, pinned in
``python/requirements-vllm.txt``); kvtier-bench runs this with the project's
Python environment (build/venv).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, proc: subprocess.Popen, what: str,
              timeout: float = 30.0) -> None:
    """Waits until 127.0.0.1:port accepts; RuntimeError if ``proc`` exits or
    the time runs out."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on port {port} in {timeout} s")


class Cluster:
    """mooncake_master and one mooncake_client (the memory) on 127.0.0.1;
    stopped by their pids."""

    def __init__(self, segment_bytes: int, workdir: Path) -> None:
        import mooncake
        pkg = Path(mooncake.__file__).parent
        self.master_port, self.meta_port = free_port(), free_port()
        self.client_port = free_port()
        self.procs: list[subprocess.Popen] = []
        log = open(workdir / "mooncake.log", "wb")
        master = subprocess.Popen(
            [str(pkg / "mooncake_master"),
             f"--rpc_port={self.master_port}", "--rpc_address=127.0.0.1",
             "--enable_http_metadata_server=true",
             "--http_metadata_server_host=127.0.0.1",
             f"--http_metadata_server_port={self.meta_port}",
             f"--log_dir={workdir}"],
            stdout=log, stderr=subprocess.STDOUT, cwd=workdir)
        self.procs.append(master)
        wait_port(self.master_port, master, "mooncake_master")
        wait_port(self.meta_port, master, "mooncake_master's metadata server")
        server = subprocess.Popen(
            [str(pkg / "mooncake_client"), "--host=127.0.0.1",
             f"--port={self.client_port}",
             f"--global_segment_size={segment_bytes}",
             "--local_buffer_size=0", "--protocol=tcp",
             f"--master_server_address={self.master_address}",
             f"--metadata_server={self.metadata}", f"--log_dir={workdir}"],
            stdout=log, stderr=subprocess.STDOUT, cwd=workdir)
        self.procs.append(server)
        wait_port(self.client_port, server, "mooncake_client")

    @property
    def master_address(self) -> str:
        return f"127.0.0.1:{self.master_port}"

    @property
    def metadata(self) -> str:
        return f"http://127.0.0.1:{self.meta_port}/metadata"

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                os.kill(p.pid, signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(p.pid, signal.SIGKILL)
                p.wait(timeout=10)


def fill(buf: Any, client: int, block: int, size: int, base: int) -> None:
    """Block ``block`` of ``client``: a recognisable pattern."""
    stamp = (client * 1_000_003 + block).to_bytes(8, "little")
    ctypes.memmove(base, stamp * (size // 8), size)


def run_client(args: Any, cluster: dict, client: int, start: Any,
               out: Any) -> None:
    """One client process: put its blocks, then get them back, timed
    between barriers; puts a dict (or an error) on ``out``."""
    try:
        from mooncake.store import MooncakeDistributedStore
        store = MooncakeDistributedStore()
        rc = store.setup(f"127.0.0.1:{free_port()}", cluster["metadata"], 0,
                         16 << 20, "tcp", "", cluster["master"])
        if rc != 0:
            raise RuntimeError(f"setup returned {rc}")
        n, size, batch = args.blocks // args.clients, args.block_bytes, \
            args.batch
        span = batch * size
        buf = (ctypes.c_char * span)()
        base = ctypes.addressof(buf)
        if store.register_buffer(base, span) != 0:
            raise RuntimeError("register_buffer failed")
        keys = [f"c{client}-b{i}" for i in range(n)]
        put_s = get_s = 0.0

        def put_all(prefix: str) -> float:
            spent = 0.0
            for first in range(0, n, batch):
                ks = [prefix + k for k in keys[first:first + batch]]
                for j in range(len(ks)):
                    fill(buf, client, first + j, size, base + j * size)
                t = time.perf_counter()
                res = store.batch_put_from(ks, [base + j * size
                                                for j in range(len(ks))],
                                           [size] * len(ks))
                spent += time.perf_counter() - t
                if any(r != 0 for r in res):
                    raise RuntimeError(f"batch_put_from returned {res[:4]}")
            return spent

        # A warm-up pass, removed again: the store's memory is touched once
        # (kvtier-store prefaults its arena at start), as in a store that
        # has been serving for a while.
        start.wait()
        put_all("warm-")
        res = store.batch_remove([f"warm-{k}" for k in keys], True)
        if any(r != 0 for r in res):
            raise RuntimeError(f"batch_remove returned {res[:4]}")
        start.wait()
        put_s = put_all("")
        start.wait()
        for first in range(0, n, batch):
            ks = keys[first:first + batch]
            ctypes.memset(base, 0, span)
            t = time.perf_counter()
            res = store.batch_get_into(ks, [base + j * size
                                            for j in range(len(ks))],
                                       [size] * len(ks))
            get_s += time.perf_counter() - t
            if any(r != size for r in res):
                raise RuntimeError(f"batch_get_into returned {res[:4]}")
            for j in range(len(ks)):
                stamp = (client * 1_000_003 + first + j).to_bytes(8, "little")
                got = ctypes.string_at(base + j * size, 8)
                if got != stamp:
                    raise RuntimeError(f"block {first + j} came back wrong")
        store.close()
        out.put({"client": client, "put_s": put_s, "get_s": get_s,
                 "blocks": n})
    except Exception as e:  # reported by the parent
        out.put({"client": client, "error": f"{type(e).__name__}: {e}"})


def measure(args: Any) -> dict:
    """Runs the clients against a fresh cluster; the figures."""
    work = Path(tempfile.mkdtemp(prefix="mooncake-ref-"))
    cluster: Optional[Cluster] = None
    procs: list[Any] = []
    try:
        cluster = Cluster(args.segment_bytes, work)
        ctx = mp.get_context("spawn")
        start, out = ctx.Barrier(args.clients), ctx.Queue()
        info = {"metadata": cluster.metadata,
                "master": cluster.master_address}
        procs = [ctx.Process(target=run_client,
                             args=(args, info, c, start, out))
                 for c in range(args.clients)]
        for p in procs:
            p.start()
        results = [out.get(timeout=600) for _ in procs]
        for p in procs:
            p.join(timeout=30)
        errors = [r["error"] for r in results if "error" in r]
        if errors:
            raise RuntimeError(errors[0])
        blocks = sum(r["blocks"] for r in results)
        nbytes = blocks * args.block_bytes
        # Clients run at once: the wall time is the slowest one's.
        put_s = max(r["put_s"] for r in results)
        get_s = max(r["get_s"] for r in results)
        return {"blocks": blocks, "block_bytes": args.block_bytes,
                "batch": args.batch, "clients": args.clients,
                "transport": "tcp",
                "put": {"gib_s": nbytes / put_s / (1 << 30),
                        "ops_s": blocks / put_s},
                "get": {"gib_s": nbytes / get_s / (1 << 30),
                        "ops_s": blocks / get_s}}
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        if cluster is not None:
            cluster.stop()
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--block-bytes", type=int, required=True)
    ap.add_argument("--blocks", type=int, required=True)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--clients", type=int, default=1)
    ap.add_argument("--segment-bytes", type=int, default=0,
                    help="memory the store holds (default: every block "
                         "plus a quarter)")
    args = ap.parse_args()
    if args.segment_bytes <= 0:
        args.segment_bytes = args.blocks * args.block_bytes * 5 // 4 + (
            64 << 20)
    try:
        print(json.dumps(measure(args)))
        return 0
    except Exception as e:
        print(json.dumps({"error": f"Mooncake Store did not run: "
                                   f"{type(e).__name__}: {e}"}))
        return 1


if __name__ == "__main__":
    sys.exit(main())
