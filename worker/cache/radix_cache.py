"""Radix KV cache (SGLang RadixAttention behaviour). SKELETON: implementation in progress.

Pure Python + numpy: imports neither asyncio, grpc, torch nor a clock (inject ``clock``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import numpy as np

from kvroute_proto.events import DEFAULT_PARTITION, KvEvent, Partition, Snapshot
from worker.cache.allocator import SlotAllocator
from worker.cache.base import CacheConfig, CacheReq, MatchResult, PrefixCache
from worker.cache.eviction import get_strategy


class RadixCache(PrefixCache):
    """Radix tree of cached token prefixes -> KV slots (see module docstring)."""

    def __init__(
        self,
        config: CacheConfig,
        allocator: SlotAllocator,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.config = config
        self.page_size = config.page_size
        self.allocator = allocator
        self._clock = clock if clock is not None else itertools.count(1).__next__
        self._priority = get_strategy(config.eviction_policy)

    def match_prefix(self, token_ids: Any, partition: Partition = DEFAULT_PARTITION) -> MatchResult:
        raise NotImplementedError

    def insert(
        self,
        token_ids: Any,
        slots: np.ndarray,
        partition: Partition = DEFAULT_PARTITION,
        priority: int = 0,
    ) -> int:
        raise NotImplementedError

    def cache_finished_req(self, req: CacheReq) -> None:
        raise NotImplementedError

    def cache_unfinished_req(self, req: CacheReq) -> None:
        raise NotImplementedError

    def evict(self, num_tokens: int) -> int:
        raise NotImplementedError

    def inc_lock_ref(self, node: Any) -> None:
        raise NotImplementedError

    def dec_lock_ref(self, node: Any) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        raise NotImplementedError

    def evictable_size(self) -> int:
        raise NotImplementedError

    def protected_size(self) -> int:
        raise NotImplementedError

    def take_events(self) -> list[KvEvent]:
        raise NotImplementedError

    def snapshot(self, worker_id: str, epoch: int, seq: int) -> Snapshot:
        raise NotImplementedError

    @property
    def root(self) -> Any:
        raise NotImplementedError
