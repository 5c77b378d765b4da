"""Persistent heap of eviction candidates (unlocked leaves) with lazy invalidation.

Pure Python; imports neither asyncio, grpc, torch nor a clock.

SGLang rebuilds a heap over every evictable leaf on each evict() call: O(n) per call. Here
the heap lives as long as the cache. Each candidate carries ``heap_ver``, the version stamp
of its one live entry (-1: not a candidate). Leaving the candidate set just clears the stamp;
the orphaned entry is skipped when popped, and all orphans are purged once they outnumber
live entries (amortised O(1) per push). Evicting k nodes costs O(k log n).

Entries are (key, node_id, version, node): ties on the strategy key break by node age.
When the strategy's key only grows on touch (LRU, LFU, ...), touched leaves are not
re-pushed; pop() notices the stale key, re-pushes with the current one and carries on.
The popped entry is still the true minimum, since stored <= current for every candidate.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any

from worker.cache.eviction import EvictionStrategy
from worker.cache.node import TreeNode

_SLACK = 64  # orphaned entries tolerated beyond the live count before a purge


class EvictionHeap:
    """The set of eviction candidates, cheapest-to-lose first."""

    __slots__ = ("_priority_of", "_versions", "entries", "num_candidates", "rekey_on_touch")

    def __init__(self, strategy: EvictionStrategy) -> None:
        self._priority_of = strategy.priority
        self.rekey_on_touch = not strategy.grows_on_touch
        self._versions = itertools.count(1)
        self.entries: list[tuple[Any, int, int, TreeNode]] = []
        self.num_candidates = 0

    def priority(self, node: TreeNode) -> Any:
        return self._priority_of(node)

    def push(self, node: TreeNode) -> None:
        """Make ``node`` a candidate (or re-key it) with its current key."""
        if node.heap_ver < 0:
            self.num_candidates += 1
        ver = next(self._versions)
        node.heap_ver = ver
        entries = self.entries
        heapq.heappush(entries, (self._priority_of(node), node.node_id, ver, node))
        if len(entries) > 2 * self.num_candidates + _SLACK:
            live = [e for e in entries if e[3].heap_ver == e[2]]
            heapq.heapify(live)
            self.entries = live

    def discard(self, node: TreeNode) -> None:
        """``node`` stops being a candidate (locked, or got a child)."""
        if node.heap_ver >= 0:
            node.heap_ver = -1
            self.num_candidates -= 1

    def touched(self, node: TreeNode) -> None:
        """A field the key reads changed on ``node`` (accessed, hit, priority bumped)."""
        if node.heap_ver >= 0 and self.rekey_on_touch:
            self.push(node)

    def pop(self) -> TreeNode | None:
        """Remove and return the best candidate; None when there is none."""
        entries = self.entries
        lazy = not self.rekey_on_touch
        while entries:
            key, node_id, ver, node = heapq.heappop(entries)
            if node.heap_ver != ver:
                continue  # orphaned entry
            if lazy:
                current = self._priority_of(node)
                if current != key:  # touched since pushed (its key only grew)
                    heapq.heappush(entries, (current, node_id, ver, node))
                    continue
            node.heap_ver = -1
            self.num_candidates -= 1
            return node
        return None

    def clear(self) -> None:
        """Forget every candidate (their nodes must already be out of the tree)."""
        self.entries = []
        self.num_candidates = 0
