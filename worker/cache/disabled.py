"""DisabledCache: the prefix-cache interface with nothing cached (SGLang's ChunkCache).

Pure Python + numpy; imports neither asyncio, grpc, torch nor a clock.

Every match is empty; inserted and finished KV is freed at once; there is nothing to evict,
lock or announce. Use it as the control when measuring what the radix cache buys.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from kvroute_proto.events import DEFAULT_PARTITION, KvEvent, Partition, Snapshot
from worker.cache.allocator import SlotAllocator
from worker.cache.base import CacheConfig, CacheReq, MatchResult, PrefixCache
from worker.cache.keys import as_slots, as_tokens


class _Root:
    """The only node a disabled cache has (a request's ``last_node`` when it holds no lock)."""

    __slots__ = ()
    node_id = 0  # as a radix cache's root: node ids are stable keys (never id())

    def __repr__(self) -> str:
        return "DisabledRoot"


class DisabledCache(PrefixCache):
    """Caches nothing; same constructor and interface as RadixCache."""

    def __init__(
        self,
        config: CacheConfig,
        allocator: SlotAllocator,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if config.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {config.page_size}")
        self.config = config
        self.page_size = config.page_size
        self.allocator = allocator
        self._root = _Root()

    @property
    def root(self) -> Any:
        return self._root

    def match_prefix(self, token_ids: Any, partition: Partition = DEFAULT_PARTITION) -> MatchResult:
        as_tokens(token_ids)
        return MatchResult(slots=np.empty(0, dtype=np.int64), last_node=self._root)

    def insert(
        self,
        token_ids: Any,
        slots: np.ndarray,
        partition: Partition = DEFAULT_PARTITION,
        priority: int = 0,
    ) -> int:
        """Takes ownership of ``slots`` and frees them at once; returns 0 (nothing cached)."""
        key = as_tokens(token_ids)
        value = as_slots(slots, len(key), self.allocator.num_slots)
        self.allocator.free(value)
        return 0

    def cache_finished_req(self, req: CacheReq) -> None:
        """Frees every slot the request owns."""
        self._check_req(req)
        self.allocator.free(req.slots[req.num_tree_tokens :])
        req.slots = np.empty(0, dtype=np.int64)
        req.num_tree_tokens = 0
        req.last_node = self._root

    def cache_unfinished_req(self, req: CacheReq) -> None:
        """Nothing to cache: the request keeps owning its slots."""
        self._check_req(req)

    def _check_req(self, req: CacheReq) -> None:
        key = as_tokens(req.token_ids)
        as_slots(req.slots, len(key), self.allocator.num_slots)
        if req.last_node is not self._root or req.num_tree_tokens != 0:
            raise ValueError("req.last_node/num_tree_tokens: a disabled cache owns no tokens")

    def evict(self, num_tokens: int) -> int:
        return 0

    def inc_lock_ref(self, node: Any) -> None:
        if node is not self._root:
            raise ValueError("inc_lock_ref: node is not this cache's root")

    def dec_lock_ref(self, node: Any) -> None:
        if node is not self._root:
            raise ValueError("dec_lock_ref: node is not this cache's root")

    def reset(self) -> None:
        return None

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def take_events(self) -> list[KvEvent]:
        return []

    def snapshot(self, worker_id: str, epoch: int, seq: int) -> Snapshot:
        return Snapshot(worker_id, epoch, seq, self.config.block_size or 0, ())

    def pretty_print(self) -> str:
        return "DisabledCache (caches nothing)"

    def check_invariants(self) -> None:
        return None
