"""Which computed prompt blocks a scheduler saves (``save_policy``).

- ``all``: every full block of every computed prompt.
- ``seen_twice``: only the leading blocks some earlier prompt on the same
  engine had too (a shared system prompt, a conversation's earlier turns, a
  prompt asked again), as vLLM's offloading reuse thresholds and LMCache's
  save switches do. docs/benchmarks.md ("Save only prefixes seen twice?")
  has what it trades.
"""

from __future__ import annotations

import collections

import numpy as np

from kvtier.errors import InvalidArgument, StatusCode

#: The policies, by name.
SAVE_POLICIES = ("all", "seen_twice")

#: Block hashes a "seen_twice" policy remembers (least recently seen
#: forgotten first): 131,072 blocks, 4M tokens at 32 a block, ~18 MB.
SEEN_CAPACITY = 1 << 17


class SavePolicy:
    """One engine's ``save_policy`` (InvalidArgument naming it for an
    unknown one). Not thread-safe (a scheduler is one thread)."""

    def __init__(self, name: str = "all", capacity: int = SEEN_CAPACITY
                 ) -> None:
        if name not in SAVE_POLICIES:
            raise InvalidArgument(StatusCode.INVALID_ARGUMENT,
                                  f"save_policy must be one of "
                                  f"{', '.join(SAVE_POLICIES)}, not {name!r}")
        self.name = name
        self._seen: collections.OrderedDict[bytes, None] = (
            collections.OrderedDict())
        self._capacity = capacity

    def savable_blocks(self, hashes: np.ndarray, full: int) -> int:
        """A new prompt whose chain is ``hashes`` and has ``full`` full
        blocks: how many leading ones may be saved (all of them under
        "all"; under "seen_twice", those an earlier prompt had too, and the
        prompt's blocks are remembered)."""
        if self.name == "all":
            return full
        rows = [hashes[i].tobytes() for i in range(full)]
        seen = 0
        while seen < full and rows[seen] in self._seen:
            seen += 1
        for row in rows:
            self._seen[row] = None
            self._seen.move_to_end(row)
        while len(self._seen) > self._capacity:
            self._seen.popitem(last=False)
        return seen
