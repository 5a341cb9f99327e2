"""The reference engine's own pages: its page allocator and prefix cache,
as vLLM's block manager keeps them (full blocks cached by chain hash,
referenced while a request uses them, kept in LRU order afterwards until
evicted)."""

from __future__ import annotations

import collections
from typing import Callable, Optional

import numpy as np


class _Pages:
    """The engine's own page allocator and prefix cache (as vLLM's block
    manager): full blocks are cached by chain hash, referenced while a
    request uses them and kept in LRU order afterwards until evicted."""

    def __init__(self, num_pages: int,
                 on_stored: Callable[[np.ndarray], None],
                 on_removed: Callable[[np.ndarray], None]) -> None:
        self.free: collections.deque[int] = collections.deque(range(num_pages))
        self.refs = [0] * num_pages
        self.hash_of: dict[int, tuple[int, int]] = {}
        self.page_of: dict[tuple[int, int], int] = {}
        self.lru: collections.OrderedDict[int, None] = \
            collections.OrderedDict()
        # Prefix-cache hits of each page's block since it was cached.
        self.hits = [0] * num_pages
        self.on_stored = on_stored
        self.on_removed = on_removed

    def match(self, hashes: np.ndarray, limit: int) -> list[int]:
        """Pages of the longest cached prefix (at most ``limit`` blocks),
        each referenced."""
        pages: list[int] = []
        for hi, lo in hashes[:limit].tolist():
            page = self.page_of.get((hi, lo))
            if page is None:
                break
            pages.append(page)
        for p in pages:
            self._ref(p)
            self.hits[p] += 1
        return pages

    def _ref(self, page: int) -> None:
        self.refs[page] += 1
        self.lru.pop(page, None)

    def allocate(self, n: int) -> Optional[list[int]]:
        """``n`` referenced pages, evicting cached ones; None if there are
        not enough unreferenced pages (nothing is taken then)."""
        if len(self.free) + len(self.lru) < n:
            return None
        out: list[int] = []
        removed: list[tuple[int, int]] = []
        for _ in range(n):
            if self.free:
                page = self.free.popleft()
            else:
                page, _ = self.lru.popitem(last=False)
                h = self.hash_of.pop(page)
                del self.page_of[h]
                removed.append(h)
            self.refs[page] = 1
            out.append(page)
        if removed:
            self.on_removed(np.array(removed, dtype=np.uint64))
        return out

    def commit(self, page: int, h: tuple[int, int]) -> None:
        """The page holds the block of hash ``h``: it becomes matchable."""
        if h in self.page_of or page in self.hash_of:
            return
        self.page_of[h] = page
        self.hash_of[page] = h
        self.hits[page] = 0
        self.on_stored(np.array([h], dtype=np.uint64))

    def release(self, pages: list[int]) -> None:
        """Drops one reference of each page; cached ones stay matchable.
        Released tail first, as vLLM frees a request's blocks: a chain's
        tail is evicted before its prefix."""
        for p in reversed(pages):
            self.refs[p] -= 1
            if self.refs[p] == 0:
                if p in self.hash_of:
                    self.lru[p] = None
                else:
                    self.free.append(p)

    def by_value(self) -> list[tuple[int, tuple[int, int]]]:
        """Every cached block as (page, hash), the most valuable first:
        most hits, then most recently used (pages in use count as the most
        recent). A chain's prefix is hit whenever its tail is, so it comes
        before the tail."""
        recency = {p: i for i, p in enumerate(self.lru)}
        in_use = len(recency)
        return sorted(self.hash_of.items(),
                      key=lambda ph: (-self.hits[ph[0]],
                                      -recency.get(ph[0], in_use)))

    @property
    def free_count(self) -> int:
        """Pages that could be allocated now."""
        return len(self.free) + len(self.lru)
