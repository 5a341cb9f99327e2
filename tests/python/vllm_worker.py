"""The worker process of test_vllm.py: vLLM's worker side of the connector
over real KV tensors in vLLM's FlashAttention layout. Each step it receives
the scheduler's pickled metadata and which pages the model computes, and
makes the model runner's calls in vLLM's order (bind, wait_for_layer_load /
forward / save_kv_layer per layer, start_load_kv (asynchronous loads start
after the forward), wait_for_save, get_finished,
get_block_ids_with_load_errors, clear), then, as vLLM's steps that schedule
nothing do, polls get_finished until the step's loads have ended (and the
requests named in ``await_sent`` are reported sent: their saves copied
out, and ``await_copies`` saves were copied). Each answer says where and
when the connector's saves ran. ``{"op": "stats"}`` answers the primary
connector's counters (kvtier.Connector.stats); ``{"op": "threads"}`` each
thread started since the connector was made, with its name and the CPUs it
may run on, and the main thread's CPUs. With ``KVTIER_TEST_COMPUTE_CPUS``
(a CPU list) the main thread is bound to those first, as vLLM's CPU build
binds a worker's main thread (its OpenMP master) to its compute cores."""

from __future__ import annotations

import json
import os
import pickle
import sys
import threading
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import torch  # noqa: E402

from kvtier.integrations.vllm import (  # noqa: E402
    KvtierConnector, KvtierConnectorMetadata, KVConnectorRole)
import vllm_shapes  # noqa: E402
from kvtier.cpus import parse_cpu_list  # noqa: E402

PAGES = 40


def fill(kv: torch.Tensor, page: int, seed: int) -> None:
    """What the model computes into a page: a function of the block."""
    g = torch.Generator().manual_seed(seed)
    kv[:, page].copy_(torch.randn(kv[:, page].shape, generator=g).half())


def started_threads(before: set[str]) -> dict[str, tuple[str, list[int]]]:
    """Each thread of this process not in ``before``: its name and the
    CPUs it may run on."""
    out = {}
    for tid in set(os.listdir("/proc/self/task")) - before:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            out[tid] = (name, sorted(os.sched_getaffinity(int(tid))))
        except OSError:  # it ended
            pass
    return out


def main() -> None:
    stores = sys.argv[1].split(",")
    # More kv_connector_extra_config keys, as JSON (optional).
    extra = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    cfg = vllm_shapes.config(stores, **extra)
    mc = cfg.model_config
    names = [f"model.layers.{i}.self_attn.attn" for i in range(mc.layers)]
    kv_caches = {n: torch.zeros(2, PAGES, cfg.cache_config.block_size,
                                mc.kv_heads, mc.head_size,
                                dtype=torch.float16) for n in names}
    compute = os.environ.get("KVTIER_TEST_COMPUTE_CPUS")
    if compute:
        os.sched_setaffinity(0, parse_cpu_list(compute))
    before = set(os.listdir("/proc/self/task"))
    conn = KvtierConnector(cfg, KVConnectorRole.WORKER)
    conn.register_kv_caches(kv_caches)
    # Where each save's copy ran: (thread name, when it ended).
    copies: list[tuple[str, float]] = []
    for w in conn._workers:
        def traced(*a: object, _save=w.connector.save, **kw: object) -> None:
            _save(*a, **kw)
            copies.append((threading.current_thread().name,
                           time.monotonic()))
        w.connector.save = traced  # type: ignore[method-assign]
    for line in sys.stdin.buffer:
        msg = pickle.loads(bytes.fromhex(line.decode().strip()))
        if msg["op"] == "stop":
            break
        if msg["op"] == "stats":
            out = conn._workers[0].connector.stats()
        elif msg["op"] == "threads":
            out = {"main": sorted(os.sched_getaffinity(0)),
                   "started": started_threads(before)}
        elif msg["op"] == "read":
            out = {p: [kv_caches[n][:, p].clone() for n in names]
                   for p in msg["pages"]}
        else:
            # The model runner's order: the forward (each layer computed
            # and offered to save_kv_layer), then the asynchronous loads
            # start, then wait_for_save, get_finished, the load errors.
            meta = msg["meta"]
            want = {spec.name for spec in meta.step.loads}
            t0 = time.monotonic()
            conn.bind_connector_metadata(meta)
            for name in names:
                conn.wait_for_layer_load(name)
                for page, seed in msg["compute"]:
                    fill(kv_caches[name], page, seed * 100 + names.index(name))
                conn.save_kv_layer(name, kv_caches[name], None)
            conn.start_load_kv(None)
            conn.wait_for_save()
            step_end = time.monotonic()
            step_seconds = step_end - t0
            if not msg.get("await_loads", True):
                want = set()
            want_sent = set(msg.get("await_sent", []))
            finished: set[str] = set()
            sent: set[str] = set()
            errors: set[int] = set()
            deadline = time.monotonic() + 30
            while True:
                out_sent, done = conn.get_finished(
                    set(msg.get("finished", [])))
                finished |= done or set()
                sent |= out_sent or set()
                errors |= conn.get_block_ids_with_load_errors()
                conn.clear_connector_metadata()
                # vLLM's later steps (nothing scheduled) poll the loads.
                if (want <= finished and want_sent <= sent and
                        len(copies) >= msg.get("await_copies", 0)) or \
                        time.monotonic() > deadline:
                    break
                time.sleep(0.002)
                conn.bind_connector_metadata(KvtierConnectorMetadata())
                conn.start_load_kv(None)
                conn.wait_for_save()
            failures = list(conn._worker.load_failures) if conn._worker else []
            stats = conn.get_kv_connector_stats()
            out = {"errors": sorted(errors), "finished": sorted(finished),
                   "failures": failures, "step_seconds": step_seconds,
                   "sent": sorted(sent), "sent_after": time.monotonic() -
                   step_end, "copies": [(name, t - step_end)
                                        for name, t in copies],
                   "counts": dict(stats.data) if stats else {}}
            copies.clear()
        sys.stdout.write(pickle.dumps(out).hex() + "\n")
        sys.stdout.flush()
    conn.shutdown()


if __name__ == "__main__":
    main()
