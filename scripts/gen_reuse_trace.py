#!/usr/bin/env python3
"""Writes a high-reuse request trace in the Mooncake JSONL format.

Multi-turn sessions: every session starts from a system prompt shared by all
sessions and grows by a few blocks per turn, each turn resending the whole
conversation so far (as chat clients do). Turns of one session are spread
far apart, so by the next turn a worker's GPU cache has usually moved on and
a prefix cache that spans workers (the store) is what can still serve it.

Contract: prints one JSON object per line with "timestamp" (ms, rising),
"input_length" (tokens, 512 per block), "output_length" and "hash_ids"
(block ids; equal ids are equal blocks, and a request's ids are a chain).
Deterministic for a given --seed.
"""
import argparse
import json
import random


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=int, default=300)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--system-blocks", type=int, default=4,
                   help="shared by every session")
    p.add_argument("--first-blocks", type=int, default=4, help="first user turn")
    p.add_argument("--turn-blocks", type=int, default=4, help="added per later turn")
    p.add_argument("--interval-ms", type=int, default=1000, help="between requests")
    p.add_argument("--seed", type=int, default=7)
    a = p.parse_args()
    rng = random.Random(a.seed)
    next_id = a.system_blocks
    system = list(range(a.system_blocks))
    sessions = []
    for _ in range(a.sessions):
        sessions.append(list(system))
    # Turn t of every session, sessions shuffled within a turn: the same
    # session comes back once every `sessions` requests.
    t_ms = 0
    for turn in range(a.turns):
        order = list(range(a.sessions))
        rng.shuffle(order)
        for s in order:
            grow = a.first_blocks if turn == 0 else a.turn_blocks
            sessions[s].extend(range(next_id, next_id + grow))
            next_id += grow
            ids = list(sessions[s])
            print(json.dumps({
                "timestamp": t_ms,
                "input_length": 512 * len(ids) - rng.randrange(256),
                "output_length": 200 + rng.randrange(400),
                "hash_ids": ids}))
            t_ms += a.interval_ms


if __name__ == "__main__":
    main()
