"""Load latency through the Python API beside the C++ worker bench, in one run.

For each (block size, blocks per load) case it stores two chains through a
:class:`kvtier.Connector` over engine tensors, then loads them alternately
into another connector's tensors (lookup -> start_load -> wait_for_layer(0)
-> wait_for_load, the path an engine takes), and reports the p50 beside the
same case of ``kvtier-bench worker`` (the C++ connector, same namespace
geometry: 8 layers x 8 KV heads x 128 dims of fp16) and their ratio::

    python3 -m kvtier.bench --latency-sizes 64KiB,1MiB --latency-blocks 4,16

Each side starts its own kvtier-store on 127.0.0.1 and stops it.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("UCX_TLS", "sm,tcp")  # what kvtier-bench worker uses

import argparse  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Optional  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

import kvtier  # noqa: E402

LAYERS, HEADS, DIM = 8, 8, 128


@dataclass
class Case:
    """One case's figures, in milliseconds."""

    block_bytes: int
    blocks: int
    python_p50_ms: float
    python_first_layer_p50_ms: float
    cpp_inprocess_p50_ms: float
    cpp_p50_ms: Optional[float] = None

    @property
    def ratio(self) -> Optional[float]:
        """Python p50 / kvtier-bench worker's p50 (<= 1.15: within 15 %)."""
        if not self.cpp_p50_ms:
            return None
        return self.python_p50_ms / self.cpp_p50_ms

    @property
    def ratio_inprocess(self) -> float:
        """Python p50 / the same loop's p50 in C++ on the same connector."""
        return self.python_p50_ms / self.cpp_inprocess_p50_ms


def _size(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for u, m in units.items():
        if text.endswith(u):
            return int(text[:-len(u)]) * m
    return int(text)


def _start_store(binary: Path, tmp: Path, ram: int) -> tuple[subprocess.Popen,
                                                              str]:
    port_file = tmp / "store.port"
    log = open(tmp / "store.log", "wb")
    proc = subprocess.Popen(
        [str(binary), "--listen=127.0.0.1:0", "--data-listen=127.0.0.1:0",
         f"--data-dir={tmp / 'db'}", "--hugepages=false",
         f"--ram-bytes={ram}", f"--port-file={port_file}"],
        stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("kvtier-store did not start; see "
                               f"{tmp / 'store.log'}")
        time.sleep(0.02)
    return proc, f"127.0.0.1:{port_file.read_text().strip()}"


def measure(store: str, size: int, n: int, reps: int) -> Case:
    """The Python API's load latency for n blocks of ``size`` bytes."""
    tokens = size // (4096 * LAYERS)
    ns = kvtier.Namespace(f"py-latency-{size}-{n}", "fp16", LAYERS, HEADS,
                          DIM, tokens)
    g = torch.Generator().manual_seed(n)
    # vLLM's [pages, 2, ...] layout: a page's K and V are adjacent, one
    # byte range per layer as in the C++ connector's own pool.
    src = [torch.randn(2 * n, 2, tokens, HEADS, DIM, generator=g).half()
           for _ in range(LAYERS)]
    dst = [torch.zeros(n, 2, tokens, HEADS, DIM, dtype=torch.float16)
           for _ in range(LAYERS)]
    chains = [np.array([[size * 1000 + n, 2 * i + k] for i in range(n)],
                       dtype=np.uint64) for k in (1, 2)]
    with kvtier.Connector(ns, src, stores=[store], layout="blocks_first",
                          deadline_ms=60000) as a:
        for k, chain in enumerate(chains):
            a.lookup(k + 1, chain)
            a.save(k + 1, 0, list(range(k * n, (k + 1) * n)))
            a.wait_for_save(k + 1)
            a.finished(k + 1)
    pages = list(range(n))
    # As the C++ bench: one control round trip (a one-block lookup on a
    # client of its own) before each Python load, not counted in it.
    control = kvtier.StoreClient([store])
    all_ms: list[float] = []
    first_ms: list[float] = []
    cpp_ms: list[float] = []
    with kvtier.Connector(ns, dst, stores=[store], layout="blocks_first",
                          deadline_ms=60000) as b:
        rid = 10
        # Batches of Python loads and of the same loop in C++ on the same
        # connector take turns, so drift on a busy machine hits both alike.
        batch, measured = 10, 0
        for r in range(reps + 2):  # two warm-up loads
            rid += 1
            control.lookup(ns, chains[0][:1])
            t = time.perf_counter()
            found = b.lookup(rid, chains[r % 2])
            if found.blocks != n:
                raise RuntimeError(f"the store holds {found.blocks} of {n}")
            b.start_load(rid, pages)
            b.wait_for_layer(rid, 0)
            first = time.perf_counter()
            loaded = b.wait_for_load(rid)
            done = time.perf_counter()
            b.finished(rid)
            if loaded != n:
                raise RuntimeError(f"loaded {loaded} of {n}")
            if r < 2:
                continue
            all_ms.append((done - t) * 1000)
            first_ms.append((first - t) * 1000)
            measured += 1
            if measured % batch == 0 or measured == reps:
                k = batch if measured % batch == 0 else measured % batch
                cpp_ms += b._c._load_loop(chains, pages, k,
                                          (1 << 40) + rid * 1000, store)
        # One more load of chain 0 from Python: its bytes must be the ones
        # stored from the writer's pages 0..n-1.
        rid += 1
        b.lookup(rid, chains[0])
        b.start_load(rid, pages)
        b.wait_for_load(rid)
        b.finished(rid)
    if not all(torch.equal(d[:n], s[:n]) for d, s in zip(dst, src)):
        raise RuntimeError("the last load's bytes differ from the stored ones")
    return Case(size, n, float(np.median(all_ms)), float(np.median(first_ms)),
                cpp_inprocess_p50_ms=float(np.median(cpp_ms)))


def cpp_cases(bench: Path, sizes: str, blocks: str, reps: int
              ) -> dict[tuple[int, int], float]:
    """p50 of the same cases from ``kvtier-bench worker`` (C++)."""
    out = subprocess.run(
        [str(bench), "worker", "--working-set", "16MiB", "--sizes", "1MiB",
         "--layerwise-layers", str(LAYERS), "--latency-sizes", sizes,
         "--latency-blocks", blocks, "--reps", str(reps),
         "--latency-layers", str(LAYERS), "--json"],
        capture_output=True, text=True, timeout=600, check=True).stdout
    j = json.loads(out)
    return {(c["block_bytes"], c["blocks"]): c["load_p50_ms"]
            for c in j["latency"]}


def main(argv: Optional[list[str]] = None) -> int:
    """Runs both sides and prints the table (or JSON); 0 on success."""
    build = Path(__file__).resolve().parents[2]
    p = argparse.ArgumentParser(prog="python3 -m kvtier.bench",
                                description=__doc__.split("\n")[0])
    p.add_argument("--latency-sizes", default="64KiB,1MiB")
    p.add_argument("--latency-blocks", default="4,16,64")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--store-bin", default=str(build / "cachestore" /
                                              "kvtier-store"))
    p.add_argument("--bench-bin", default=str(build / "bench" /
                                              "kvtier-bench"))
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if os.environ.get("KVTIER_FLAGS_ONLY") == "1":  # the docs' check
        return 0
    torch.set_num_threads(1)
    sizes = [_size(s) for s in a.latency_sizes.split(",")]
    blocks = [int(b) for b in a.latency_blocks.split(",")]
    for s in sizes:
        if s % (4096 * LAYERS) != 0:
            p.error(f"block size {s} is not a multiple of {4096 * LAYERS}")
    ram = sum(2 * s * n for s in sizes for n in blocks) + (64 << 20)
    cases: list[Case] = []
    with tempfile.TemporaryDirectory(prefix="kvtier-pybench-") as tmp:
        proc, store = _start_store(Path(a.store_bin), Path(tmp), ram)
        try:
            for s in sizes:
                for n in blocks:
                    cases.append(measure(store, s, n, a.reps))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
    cpp = cpp_cases(Path(a.bench_bin), a.latency_sizes, a.latency_blocks,
                    a.reps)
    for c in cases:
        c.cpp_p50_ms = cpp.get((c.block_bytes, c.blocks))
    if a.json:
        print(json.dumps({"latency": [
            {**c.__dict__, "ratio_vs_cpp": c.ratio,
             "ratio_vs_cpp_inprocess": c.ratio_inprocess} for c in cases]},
            indent=2))
        return 0
    print("load latency through the Python API (p50 ms of "
          f"{a.reps} loads) beside the same loop in C++ on the same "
          "connector, taking turns, and kvtier-bench worker's case "
          "(ratio <= 1.15: within 15 %)")
    print(f"{'block':>9} {'blocks':>6} | {'python':>8} {'C++ same':>8} "
          f"{'ratio':>6} | {'worker':>8} {'ratio':>6} | {'layer 0':>8}")
    for c in cases:
        ratio = f"{c.ratio:6.2f}" if c.ratio else "     -"
        cpp_ms = f"{c.cpp_p50_ms:8.3f}" if c.cpp_p50_ms else "       -"
        print(f"{c.block_bytes >> 10:>6}KiB {c.blocks:>6} | "
              f"{c.python_p50_ms:8.3f} {c.cpp_inprocess_p50_ms:8.3f} "
              f"{c.ratio_inprocess:6.2f} | {cpp_ms} {ratio} | "
              f"{c.python_first_layer_p50_ms:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
