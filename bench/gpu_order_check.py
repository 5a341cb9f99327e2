"""The device check of issue #60: kvtier's copies of CUDA pages are ordered
against the engine's stream (kvtier.worker_half, "Ordered against the
engine's stream"), as vLLM's connector sets it up.

- Save: a long kernel (``torch.cuda._sleep``) and then a fill of known
  bytes into pages are launched on the current stream, and the save is
  called at once, as vLLM calls ``wait_for_save`` right after it launches
  the forward. After ``torch.cuda.synchronize()`` the stored bytes must
  equal the pages'.
- Load: a long kernel and a zeroing of the pages a load was given are
  launched on the current stream, then the load starts at once (vLLM's
  own writes to new blocks). When the load is reported ended, the pages
  must hold the stored bytes.
- Control: the same save with the fence turned off must see stale bytes
  in at least one pass, or the case proves nothing on this GPU.

Needs a CUDA GPU, PyTorch with CUDA, kvtier's Python package (the build's
``python/`` directory on PYTHONPATH, its libraries on LD_LIBRARY_PATH) and
a kvtier-store. One JSON line on stdout; exit 0 when every pass matched.

    python bench/gpu_order_check.py --store 127.0.0.1:PORT [--passes 20]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Optional

import torch

import kvtier
from kvtier.integrations.vllm_pages import cuda_stream_fence
from kvtier.scheduler_half import LoadSpec, SaveSpec, StepMeta
from kvtier.worker_half import WorkerHalf

LAYERS, HEADS, DIM, TOKENS, PAGES = 8, 8, 128, 16, 64
SPIN = 200_000_000  # GPU clock cycles of the long kernel (~0.1 s)


def caches(device: str) -> list[torch.Tensor]:
    return [torch.zeros((2, PAGES, TOKENS, HEADS, DIM), dtype=torch.float16,
                        device=device) for _ in range(LAYERS)]


def launch_fill(cache: list[torch.Tensor], pages: list[int],
                value: float) -> None:
    """The engine's forward: long work, then ``value`` into ``pages``, all
    on the current stream, not waited for."""
    torch.cuda._sleep(SPIN)
    idx = torch.tensor(pages, device=cache[0].device)
    for layer in cache:
        layer.index_fill_(1, idx, value)


def wait_held(reader: kvtier.Connector, request: int, hashes: Any,
              blocks: int) -> None:
    deadline = time.monotonic() + 30
    while reader.lookup(request, hashes).blocks < blocks:
        reader.finished(request)
        if time.monotonic() > deadline:
            raise RuntimeError("the save never reached the store")
        time.sleep(0.01)


def save_pass(store: str, n: int, fenced: bool) -> bool:
    """One save: True when the stored bytes equal the pages'."""
    ns = kvtier.Namespace(f"order-check-{n}-{int(fenced)}", "fp16", LAYERS,
                          HEADS, DIM, TOKENS)
    engine = caches("cuda:0")
    half = WorkerHalf(kvtier.Connector(ns, engine, stores=[store]),
                      stream_fence=cuda_stream_fence if fenced else None)
    pages = list(range(8, 40))
    hashes = kvtier.hash_tokens(ns, list(range(len(pages) * TOKENS)))
    launch_fill(engine, pages, float(n % 50 + 1))
    half.wait_for_save(StepMeta(saves=[SaveSpec(1, hashes, 0, pages)],
                                finished=[1]))
    half.close()
    torch.cuda.synchronize()
    reader_cache = caches("cuda:0")
    reader = kvtier.Connector(ns, reader_cache, stores=[store])
    wait_held(reader, 2, hashes, len(pages))
    reader.start_load(2, list(range(len(pages))))
    reader.wait_for_load(2)
    reader.finished(2)
    torch.cuda.synchronize()
    return all(torch.equal(r[:, :len(pages)], e[:, pages])
               for r, e in zip(reader_cache, engine))


def load_pass(store: str, n: int) -> bool:
    """One load after the engine's own writes: True when the pages hold the
    stored bytes once the load is reported ended."""
    ns = kvtier.Namespace(f"order-load-{n}", "fp16", LAYERS, HEADS, DIM,
                          TOKENS)
    source = caches("cuda:0")
    for i, layer in enumerate(source):
        layer.fill_(float(i + 2))
    pages = list(range(len(source[0][0]) // 2))
    hashes = kvtier.hash_tokens(ns, list(range(len(pages) * TOKENS)))
    writer = kvtier.Connector(ns, source, stores=[store])
    writer.lookup(1, hashes)
    writer.save(1, 0, pages)
    writer.wait_for_save(1)
    writer.finished(1)
    engine = caches("cuda:0")
    for layer in engine:
        layer.fill_(9.0)
    half = WorkerHalf(kvtier.Connector(ns, engine, stores=[store]),
                      stream_fence=cuda_stream_fence)
    target = [p + PAGES // 2 for p in pages]
    launch_fill(engine, target, 0.0)  # vLLM zeroing the new blocks
    half.start_loads(StepMeta(loads=[LoadSpec(2, hashes, 0, target, "r")]))
    deadline = time.monotonic() + 30
    names: set[str] = set()
    failed: set[int] = set()
    while not names:
        names, failed = half.finished_loads()
        if time.monotonic() > deadline:
            raise RuntimeError("the load never ended")
        time.sleep(0.001)
    ok = not failed and all(torch.equal(e[:, target], s[:, pages])
                            for e, s in zip(engine, source))
    half.finished(2)
    half.close()
    return ok


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", required=True)
    ap.add_argument("--passes", type=int, default=20)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(json.dumps({"check": "gpu_order", "skipped": "no CUDA GPU"}))
        return 2
    saves = [save_pass(args.store, n, True) for n in range(args.passes)]
    loads = [load_pass(args.store, n) for n in range(args.passes)]
    control = [save_pass(args.store, 1000 + n, False)
               for n in range(min(args.passes, 5))]
    out = {"check": "gpu_order", "device": torch.cuda.get_device_name(0),
           "save_passes_matched": sum(saves), "load_passes_matched":
           sum(loads), "passes": args.passes,
           "unfenced_saves_stale": control.count(False),
           "unfenced_passes": len(control)}
    print(json.dumps(out), flush=True)
    return 0 if all(saves) and all(loads) and not all(control) else 1


if __name__ == "__main__":
    sys.exit(main())
