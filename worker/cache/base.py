"""The prefix-cache interface the scheduler sees (RadixCache and DisabledCache implement it).

Pure: imports neither asyncio, grpc, torch nor a clock.

Slot ownership, in one picture (a request's ``slots`` array, one KV slot per computed token):

    [0 ........ num_tree_tokens) [num_tree_tokens ........ len(token_ids))
     owned by the tree, locked    owned by the request (freed or inserted
     through req.last_node        into the tree by cache_*_req)

After cache_unfinished_req: num_tree_tokens = the page-aligned length, last_node = the new
deepest node (locked instead of the old one), and ``slots`` is a *new* array whose tree part
holds the tree's slots (duplicates the request computed were freed); a partial tail page
stays the request's. After cache_finished_req: slots is empty, num_tree_tokens = 0 and
last_node = root -- the request owns nothing.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvroute_proto.events import DEFAULT_PARTITION, KvEvent, Partition, Snapshot


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Radix cache settings."""

    page_size: int = 1
    eviction_policy: str = "lru"  # a name from the eviction strategy registry
    block_size: int | None = None  # event block size; None = event outbox off
    # When an access splits an edge: "keep" = the unused lower half keeps its own access
    # time (true LRU); "stamp" = SGLang's rule, both halves get this access's time.
    split_recency: str = "keep"


SPLIT_RECENCY = ("keep", "stamp")


@dataclass(frozen=True, slots=True)
class MatchResult:
    """Longest cached, page-aligned prefix of a key."""

    slots: np.ndarray  # int64 KV slot per matched token
    last_node: Any  # deepest matched node (the root when nothing matched); lock it to pin

    @property
    def num_matched(self) -> int:
        return len(self.slots)


@dataclass(slots=True)
class CacheReq:
    """What the cache needs of a request to cache it (the scheduler owns the object)."""

    token_ids: np.ndarray  # int64 ids of every token whose KV has been computed
    slots: np.ndarray  # int64 KV slot of each of those tokens (same length)
    last_node: Any  # the node holding this request's lock ref (root = none)
    num_tree_tokens: int = 0  # leading slots owned by the tree
    partition: Partition = field(default=DEFAULT_PARTITION)
    priority: int = 0


class PrefixCache(abc.ABC):
    """Seven operations every cache variant answers, plus sizes and the event outbox."""

    @abc.abstractmethod
    def match_prefix(self, token_ids: Any, partition: Partition = DEFAULT_PARTITION) -> MatchResult:
        """Longest cached prefix (page-aligned); refreshes recency along the path."""

    @abc.abstractmethod
    def insert(
        self,
        token_ids: Any,
        slots: np.ndarray,
        partition: Partition = DEFAULT_PARTITION,
        priority: int = 0,
    ) -> int:
        """Insert a page-aligned key with its slots; returns how many leading tokens were
        already cached (the caller frees its own duplicate slots for those)."""

    @abc.abstractmethod
    def cache_finished_req(self, req: CacheReq) -> None:
        """Insert a finished (or retracted) request's KV, free duplicates and the unaligned
        tail, and drop its lock. The request owns no slots afterwards."""

    @abc.abstractmethod
    def cache_unfinished_req(self, req: CacheReq) -> None:
        """Insert a still-running request's KV (between prefill chunks), move its lock to the
        new deepest node and point its slots at the tree's copy."""

    @abc.abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` slots from unlocked leaves if possible; returns the
        number of tokens actually freed."""

    @abc.abstractmethod
    def inc_lock_ref(self, node: Any) -> None:
        """Protect the path root..node from eviction."""

    @abc.abstractmethod
    def dec_lock_ref(self, node: Any) -> None:
        """Undo one inc_lock_ref; raises ValueError below zero."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Drop everything (frees every unlocked slot; emits AllCleared)."""

    @abc.abstractmethod
    def evictable_size(self) -> int: ...

    @abc.abstractmethod
    def protected_size(self) -> int: ...

    @abc.abstractmethod
    def take_events(self) -> list[KvEvent]:
        """Drain the event outbox (empty when events are off)."""

    @abc.abstractmethod
    def snapshot(self, worker_id: str, epoch: int, seq: int) -> Snapshot:
        """Every held block, parents first."""

    @property
    @abc.abstractmethod
    def root(self) -> Any: ...

    def parent_node(self, node: Any) -> Any | None:
        """The node directly above ``node``: None for the root and for a node that left the
        tree (evicted or reset). Read-only -- no recency stamp, no split -- so a scheduler can
        walk a matched node up to the root (dfs-weight) without touching the cache. A cache
        without a tree has only its root."""
        return None

    def pretty_print(self) -> str:
        """The cache's contents as text, for debugging."""
        return type(self).__name__

    def check_invariants(self) -> None:
        """Raise AssertionError if the cache's internal state is inconsistent (tests)."""
        return None  # a variant without internal state has nothing to check
