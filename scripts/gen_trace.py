#!/usr/bin/env python3
"""Writes a request trace in the Mooncake JSONL format, in one of four shapes.

Shapes (--shape):
  reuse     multi-turn chat sessions: every session starts from a system
            prompt shared by all and grows by a few blocks per turn, each
            turn resending the whole conversation; turns of one session are
            far apart, so by the next turn a worker's GPU cache has usually
            moved on and the store is what can still serve it.
  bursts    bursts of requests that share a long prefix (a document, a
            few-shot prompt) arriving within tens of milliseconds, each with
            a short suffix of its own; some documents come back in later
            bursts; single requests in between.
  tool-use  agent sessions: a system prompt and tool definitions shared by
            every agent of a kind, then turn after turn in quick succession
            (a tool call's latency apart), each appending the tool's output
            and the model's reply to the whole context.
  mix       all three at once, interleaved in time (block ids apart).

Contract: prints one JSON object per line with "timestamp" (ms, rising),
"input_length" (tokens, 512 per block, the last block partial),
"output_length" and "hash_ids" (block ids; equal ids are equal blocks, and a
request's ids are a chain: a request shares a prefix of blocks with another
exactly when their id lists share that prefix). Deterministic for a given
--seed. --requests bounds the requests written (the first N by time).

Example: python3 scripts/gen_trace.py --shape bursts > /tmp/bursts.jsonl
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
from typing import Iterator

Request = dict[str, object]


class Ids:
    """Hands out fresh block ids."""

    def __init__(self) -> None:
        self.next = 0

    def take(self, n: int) -> list[int]:
        """n ids never handed out before."""
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def request(t_ms: float, ids: list[int], rng: random.Random,
            out_lo: int = 100, out_hi: int = 600) -> Request:
    """One trace line: the last block is partial (up to 255 tokens short)."""
    return {"timestamp": int(t_ms),
            "input_length": 512 * len(ids) - rng.randrange(256),
            "output_length": out_lo + rng.randrange(out_hi - out_lo),
            "hash_ids": list(ids)}


def reuse(a: argparse.Namespace, rng: random.Random, ids: Ids,
          start_ms: float = 0) -> Iterator[Request]:
    """Multi-turn sessions, turn t of every session before turn t + 1
    (scripts' former gen_reuse_trace.py, the same requests for a seed)."""
    system = ids.take(a.system_blocks)
    sessions = [list(system) for _ in range(a.sessions)]
    t_ms = start_ms
    for turn in range(a.turns):
        order = list(range(a.sessions))
        rng.shuffle(order)
        for s in order:
            sessions[s].extend(
                ids.take(a.first_blocks if turn == 0 else a.turn_blocks))
            yield request(t_ms, sessions[s], rng, 200, 600)
            t_ms += a.interval_ms


def bursts(a: argparse.Namespace, rng: random.Random, ids: Ids,
           start_ms: float = 0) -> Iterator[Request]:
    """Bursts sharing a long prefix, singles between them."""
    docs: list[list[int]] = []
    t_ms = start_ms
    for _ in range(a.bursts):
        # A third of the bursts reuse an earlier document.
        if docs and rng.random() < 1 / 3:
            doc = rng.choice(docs)
        else:
            doc = ids.take(rng.randint(a.doc_blocks // 2, a.doc_blocks))
            docs.append(doc)
        size = rng.randint(a.burst_size // 2, a.burst_size)
        at = t_ms
        for _ in range(size):
            at += rng.uniform(0, a.burst_spread_ms / size)
            yield request(at, doc + ids.take(rng.randint(1, 2)), rng)
        # Singles until the next burst: a short unique prompt each.
        gap = rng.expovariate(1 / a.burst_gap_ms)
        for _ in range(rng.randint(0, 4)):
            yield request(t_ms + rng.uniform(0, gap),
                          ids.take(rng.randint(2, 12)), rng)
        t_ms += a.burst_spread_ms + gap


def tool_use(a: argparse.Namespace, rng: random.Random, ids: Ids,
             start_ms: float = 0) -> Iterator[Request]:
    """Agent sessions: turns a tool call apart, the context growing."""
    kinds = [ids.take(a.system_blocks + a.tool_blocks) for _ in range(3)]
    t_ms = start_ms
    for _ in range(a.agents):
        context = list(rng.choice(kinds)) + ids.take(rng.randint(1, 3))
        at = t_ms
        for _ in range(rng.randint(a.agent_turns // 2, a.agent_turns)):
            yield request(at, context, rng, 20, 200)
            context = context + ids.take(rng.randint(1, 3))
            at += rng.uniform(a.tool_ms / 2, a.tool_ms * 2)
        t_ms += rng.expovariate(1 / a.agent_gap_ms)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=["reuse", "bursts", "tool-use", "mix"],
                   default="reuse")
    p.add_argument("--requests", type=int, default=0,
                   help="write the first N requests by time (0: all)")
    p.add_argument("--seed", type=int, default=7)
    g = p.add_argument_group("reuse")
    g.add_argument("--sessions", type=int, default=300)
    g.add_argument("--turns", type=int, default=5)
    g.add_argument("--system-blocks", type=int, default=4,
                   help="shared by every session (reuse, tool-use)")
    g.add_argument("--first-blocks", type=int, default=4,
                   help="first user turn")
    g.add_argument("--turn-blocks", type=int, default=4,
                   help="added per later turn")
    g.add_argument("--interval-ms", type=int, default=1000,
                   help="between requests")
    g = p.add_argument_group("bursts")
    g.add_argument("--bursts", type=int, default=150)
    g.add_argument("--burst-size", type=int, default=24,
                   help="requests in a burst, at most (half at least)")
    g.add_argument("--doc-blocks", type=int, default=48,
                   help="blocks of a burst's shared prefix, at most")
    g.add_argument("--burst-spread-ms", type=float, default=200,
                   help="a burst arrives within this")
    g.add_argument("--burst-gap-ms", type=float, default=3000,
                   help="mean time between bursts")
    g = p.add_argument_group("tool-use")
    g.add_argument("--agents", type=int, default=120)
    g.add_argument("--agent-turns", type=int, default=12,
                   help="turns of an agent, at most (half at least)")
    g.add_argument("--tool-blocks", type=int, default=6,
                   help="tool definitions, shared by agents of a kind")
    g.add_argument("--tool-ms", type=float, default=2000,
                   help="typical time between an agent's turns")
    g.add_argument("--agent-gap-ms", type=float, default=1500,
                   help="mean time between agents starting")
    a = p.parse_args()
    if os.environ.get("KVTIER_FLAGS_ONLY") == "1":  # the docs' check
        return
    rng = random.Random(a.seed)
    ids = Ids()
    if a.shape == "reuse":
        # Already in time order: written as made, as the former script did.
        reqs = list(reuse(a, rng, ids))
    elif a.shape == "bursts":
        reqs = list(bursts(a, rng, ids))
    elif a.shape == "tool-use":
        reqs = list(tool_use(a, rng, ids))
    else:
        # A third of each, over the same stretch of time.
        mix = argparse.Namespace(**vars(a))
        mix.sessions, mix.bursts = a.sessions // 3, a.bursts // 3
        mix.agents = a.agents // 3
        mix.agent_gap_ms = a.agent_gap_ms * 3
        mix.burst_gap_ms = a.burst_gap_ms * 3
        # The sessions over the same ~200 s as the rest.
        mix.interval_ms = a.interval_ms * 2 // 5
        reqs = (list(reuse(mix, rng, ids)) + list(bursts(mix, rng, ids)) +
                list(tool_use(mix, rng, ids)))
    reqs.sort(key=lambda r: r["timestamp"])  # stable: equal times keep order
    if a.requests > 0:
        reqs = reqs[:a.requests]
    for r in reqs:
        sys.stdout.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
