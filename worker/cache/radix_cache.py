"""Radix KV cache: SGLang's RadixAttention tree, with an O(log n) eviction heap and an outbox.

Pure Python + numpy: imports neither asyncio, grpc, torch nor a clock (inject ``clock``).

The tree maps token prefixes to KV slots. Edges carry runs of tokens; a node boundary is a
point where two cached sequences stopped agreeing. Inserting [1,2,4,5] next to [1,2,3]:

    root ── [1,2,3]          ==>      root ── [1,2] ─┬─ [3]
                                                      └─ [4,5]

Children are keyed by (partition id, first page of the edge), so partitions never share a
node. Granularity is ``page_size``: keys are page-aligned and edges split on page boundaries.
Each match/insert reads the clock once and stamps every node on its matched path (recency);
as in SGLang, ``hit_count`` counts the inserts of finished requests through a node, and a
node's ``priority`` is the highest priority of those inserts.

Split recency (``CacheConfig.split_recency``). When a match or insert ends inside an edge,
the edge is split and only its upper part was used::

    before:  A(t=3) ── [1,2,3,4]                     access [1,2,9] at t=7
    "keep":  A ── [1,2](t=7) ── [3,4](t=3)           the unused half keeps its own time
    "stamp": A ── [1,2](t=7) ── [3,4](t=7)           SGLang: stamped before the split

"keep" (the default) is a true LRU: ``[3,4]`` was not used, so it stays as old as it was.
"stamp" is what SGLang's RadixCache does (it sets the child's access time before calling
_split_node), which makes the unused lower half look recently used.

Sizes: every cached token is either *protected* (its node's lock_ref > 0) or *evictable*.
Only unlocked leaves are eviction candidates; they live in a persistent heap keyed by the
strategy's ``priority(node)`` with version-stamped lazy invalidation (eviction_heap.py), so
evicting k nodes costs O(k log n), never a rebuild over every leaf.

With ``CacheConfig.block_size`` set, every change of the set of full blocks the tree holds is
appended to an outbox (BlockStored / BlockRemoved / AllCleared) drained by take_events();
see block_events.py for which node holds which block.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import numpy as np

from kvroute_proto.events import DEFAULT_PARTITION, KvEvent, Partition, Snapshot
from worker.cache import block_events, debug
from worker.cache.allocator import SlotAllocator
from worker.cache.base import SPLIT_RECENCY, CacheConfig, CacheReq, MatchResult, PrefixCache
from worker.cache.eviction import get_strategy
from worker.cache.eviction_heap import EvictionHeap
from worker.cache.keys import as_slots, as_tokens, check_priority
from worker.cache.node import TreeNode
from worker.cache.partitions import PartitionTable

_I64 = np.int64
_EMPTY_SLOTS = np.empty(0, dtype=_I64)
_EMPTY_SLOTS.flags.writeable = False


class RadixCache(PrefixCache):
    """Radix tree of cached token prefixes -> KV slots (see the module docstring)."""

    def __init__(
        self,
        config: CacheConfig,
        allocator: SlotAllocator,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if not isinstance(config.page_size, int) or config.page_size < 1:
            raise ValueError(f"page_size must be an int >= 1, got {config.page_size!r}")
        if config.block_size is not None and (
            not isinstance(config.block_size, int) or config.block_size < 1
        ):
            raise ValueError(f"block_size must be None or an int >= 1, got {config.block_size!r}")
        if config.split_recency not in SPLIT_RECENCY:
            raise ValueError(
                f"split_recency must be one of {SPLIT_RECENCY}, got {config.split_recency!r}"
            )
        self.config = config
        self._stamp_split = config.split_recency == "stamp"
        self.page_size = config.page_size
        self.block_size = config.block_size
        self.allocator = allocator
        self._candidates = EvictionHeap(get_strategy(config.eviction_policy))
        # Default clock: a logical counter, so recency is an order, never a wall time.
        self._clock = clock if clock is not None else itertools.count(1).__next__
        self._page_bytes = 8 * config.page_size
        self._node_ids = itertools.count(1)
        self._partitions = PartitionTable()  # Partition <-> the int kept in child keys
        self._ledger = (
            None
            if config.block_size is None
            else block_events.BlockLedger(config.block_size, config.page_size)
        )
        self._root = TreeNode(0, None, b"", _EMPTY_SLOTS, -1, 0, self._clock())
        self._evictable = 0
        self._protected = 0

    # ------------------------------------------------------------------ queries

    @property
    def root(self) -> TreeNode:
        return self._root

    def evictable_size(self) -> int:
        """Tokens eviction can reclaim (every unlocked node)."""
        return self._evictable

    def protected_size(self) -> int:
        """Tokens on locked paths."""
        return self._protected

    def parent_node(self, node: Any) -> TreeNode | None:
        """The node directly above ``node`` (None for the root or a node no longer in the
        tree); read-only."""
        return node.parent  # type: ignore[no-any-return]

    @property
    def total_size(self) -> int:
        return self._evictable + self._protected

    @property
    def num_evictable_leaves(self) -> int:
        return self._candidates.num_candidates

    @property
    def num_partitions(self) -> int:
        """Partitions with an id (those with nodes, plus not yet recycled ones)."""
        return len(self._partitions)

    # ------------------------------------------------------------------ match

    def match_prefix(self, token_ids: Any, partition: Partition = DEFAULT_PARTITION) -> MatchResult:
        """Longest cached page-aligned prefix of ``token_ids`` in ``partition``.

        Refreshes recency of every node on the matched path; splits the last node when the
        match ends inside its edge (no KV moves).
        """
        key = as_tokens(token_ids)
        pid = self._partitions.lookup(partition)  # matching registers nothing
        n = len(key)
        n -= n % self.page_size
        if n == 0 or pid is None:
            return MatchResult(_EMPTY_SLOTS, self._root)
        now = self._clock()
        key = key[:n]
        node, pieces = self._walk(key, key.tobytes(), pid, now)
        self._candidates.touched(node)
        if not pieces:
            return MatchResult(_EMPTY_SLOTS, node)
        slots = np.concatenate(pieces) if len(pieces) > 1 else pieces[0].copy()
        return MatchResult(slots, node)

    def _walk(self, key: np.ndarray, kb: bytes, pid: int, now: float) -> tuple[TreeNode, list]:
        """Descend along ``key``; returns the deepest matched node and the slot pieces."""
        pb = self._page_bytes
        n8 = len(kb)
        node = self._root
        children = node.children
        pos8 = 0
        pieces: list[np.ndarray] = []
        while pos8 < n8:
            child = children.get((pid, kb[pos8 : pos8 + pb]))
            if child is None:
                break
            ekb = child.kb
            if kb.startswith(ekb, pos8):
                child.last_access = now
                pieces.append(child.value)
                pos8 += len(ekb)
                node = child
                children = child.children
                continue
            # The match ends inside this edge: split it; the new parent is the last node.
            if self._stamp_split:
                self._stamp(child, now)
            node = self._split(child, self._common_len(key, pos8 >> 3, ekb))
            node.last_access = now
            pieces.append(node.value)
            break
        return node, pieces

    def _stamp(self, node: TreeNode, now: float) -> None:
        """split_recency="stamp": the edge about to split counts as accessed (both halves)."""
        node.last_access = now
        if not node.children:
            self._candidates.touched(node)

    def _common_len(self, key: np.ndarray, pos: int, ekb: bytes) -> int:
        """Page-aligned length of the common prefix of key[pos:] and an edge (numpy compare)."""
        num = min(len(ekb) >> 3, len(key) - pos)
        neq = np.frombuffer(ekb, dtype=_I64, count=num) != key[pos : pos + num]
        i = int(neq.argmax())
        if not neq[i]:
            i = num
        return i - i % self.page_size

    def _split(self, child: TreeNode, k: int) -> TreeNode:
        """Cut ``child``'s edge after k tokens; returns the new parent (it inherits the lock
        count, priority, hit count and times of the shared prefix)."""
        parent = child.parent
        assert parent is not None and 0 < k < child.num_tokens
        k8 = 8 * k
        kb = child.kb
        new = TreeNode(
            next(self._node_ids),
            parent,
            kb[:k8],
            child.value[:k],
            child.pid,
            child.start,
            child.creation_time,
        )
        new.last_access = child.last_access
        new.lock_ref = child.lock_ref
        new.priority = child.priority
        new.hit_count = child.hit_count
        child.kb = kb[k8:]
        child.value = child.value[k:]
        child.start += k
        child.parent = new
        pb = self._page_bytes
        new.children[(child.pid, child.kb[:pb])] = child
        parent.children[(child.pid, kb[:pb])] = new
        if self._ledger is not None:
            self._ledger.on_split(new, child)
        return new

    # ------------------------------------------------------------------ insert

    def insert(
        self,
        token_ids: Any,
        slots: np.ndarray,
        partition: Partition = DEFAULT_PARTITION,
        priority: int = 0,
    ) -> int:
        """Cache a page-aligned key with its slots; returns how many leading tokens were
        already cached. The tree takes ownership of ``slots[returned:]``; the caller frees
        its own ``slots[:returned]`` where they differ from the tree's copy."""
        key = as_tokens(token_ids)
        value = as_slots(slots, len(key), self.allocator.num_slots)
        if len(key) % self.page_size:
            raise ValueError(
                f"insert: len(token_ids)={len(key)} must be a multiple of "
                f"page_size={self.page_size}"
            )
        check_priority(priority)
        pid = self._partitions.register(partition)
        prefix_len, _, _ = self._insert(key, value, pid, priority, True)
        return prefix_len

    def _insert(
        self, key: np.ndarray, value: np.ndarray, pid: int, priority: int, count_hit: bool
    ) -> tuple[int, TreeNode, list[np.ndarray]]:
        """The insert walk: returns (already-cached length, last node, slot pieces of the
        whole key as the tree now holds them)."""
        n = len(key)
        if n == 0:
            return 0, self._root, []
        now = self._clock()
        kb = key.tobytes()
        n8 = len(kb)
        pb = self._page_bytes
        hit = 1 if count_hit else 0
        node = self._root
        children = node.children
        pos8 = 0
        pieces: list[np.ndarray] = []
        while pos8 < n8:
            child = children.get((pid, kb[pos8 : pos8 + pb]))
            if child is None:
                break
            ekb = child.kb
            split = not kb.startswith(ekb, pos8)
            if split:
                if self._stamp_split:
                    self._stamp(child, now)
                child = self._split(child, self._common_len(key, pos8 >> 3, ekb))
            child.last_access = now
            child.hit_count += hit
            if priority > child.priority:
                child.priority = priority
            pieces.append(child.value)
            pos8 += len(child.kb)
            node = child
            if split:
                break
            children = child.children
        prefix_len = pos8 >> 3
        if pos8 < n8:
            node = self._new_leaf(node, key, kb, value, prefix_len, pid, now)
            node.hit_count = hit
            node.priority = priority
            self._candidates.push(node)
            pieces.append(node.value)
        else:
            self._candidates.touched(node)
        return prefix_len, node, pieces

    def _new_leaf(
        self,
        parent: TreeNode,
        key: np.ndarray,
        kb: bytes,
        value: np.ndarray,
        pos: int,
        pid: int,
        now: float,
    ) -> TreeNode:
        """Hang key[pos:] below ``parent`` as a new unlocked leaf (not yet in the heap)."""
        self._candidates.discard(parent)  # it stops being a leaf
        pos8 = 8 * pos
        new = TreeNode(next(self._node_ids), parent, kb[pos8:], value[pos:].copy(), pid, pos, now)
        parent.children[(pid, kb[pos8 : pos8 + self._page_bytes])] = new
        if parent is self._root:
            self._partitions.add_root_child(pid)
        self._evictable += len(key) - pos
        if self._ledger is not None:
            self._ledger.on_new_leaf(new, key, self._partitions[pid])
        return new

    # ------------------------------------------------------------------ requests

    def _check_req(self, req: CacheReq) -> tuple[np.ndarray, np.ndarray, int]:
        key = as_tokens(req.token_ids)
        slots = as_slots(req.slots, len(key), self.allocator.num_slots)
        check_priority(req.priority)
        pid = self._partitions.register(req.partition)
        node = req.last_node
        self._check_node(node, "req.last_node")
        num_tree = req.num_tree_tokens
        if num_tree != node.end or num_tree > len(key):
            raise ValueError(
                f"req.num_tree_tokens={num_tree} must equal the end of req.last_node "
                f"({node.end}) and be <= len(token_ids)={len(key)}"
            )
        if node is not self._root and node.pid != pid:
            raise ValueError(
                f"req.partition={req.partition!r} differs from the partition of req.last_node "
                f"({self._partitions[node.pid]!r}); keys of different partitions cannot mix"
            )
        return key, slots, pid

    def cache_finished_req(self, req: CacheReq) -> None:
        """Insert the request's page-aligned KV, free its duplicate slots and its unaligned
        tail, drop its lock. Afterwards the request owns nothing (slots emptied)."""
        key, slots, pid = self._check_req(req)
        n = len(key)
        aligned = n - n % self.page_size
        num_tree = req.num_tree_tokens
        prefix_len, _, _ = self._insert(key[:aligned], slots[:aligned], pid, req.priority, True)
        assert prefix_len >= num_tree, "the request's locked path must still be cached"
        # [num_tree, prefix_len): the tree already had these tokens -> duplicates.
        # [aligned, n): a partial page the tree cannot hold.
        self.allocator.free(np.concatenate((slots[num_tree:prefix_len], slots[aligned:])))
        self.dec_lock_ref(req.last_node)
        req.slots = _EMPTY_SLOTS.copy()
        req.num_tree_tokens = 0
        req.last_node = self._root

    def cache_unfinished_req(self, req: CacheReq) -> None:
        """Between prefill chunks: insert the page-aligned KV computed so far, move the
        request's lock to the new deepest node and point its slots at the tree's copy.
        A partial tail page stays owned by the request."""
        key, slots, pid = self._check_req(req)
        n = len(key)
        aligned = n - n % self.page_size
        num_tree = req.num_tree_tokens
        if aligned == num_tree:
            return
        prefix_len, node, pieces = self._insert(
            key[:aligned], slots[:aligned], pid, req.priority, False
        )
        self.allocator.free(slots[num_tree:prefix_len])
        pieces.append(slots[aligned:])
        req.slots = np.concatenate(pieces)
        self.inc_lock_ref(node)
        self.dec_lock_ref(req.last_node)
        req.last_node = node
        req.num_tree_tokens = aligned

    # ------------------------------------------------------------------ locks

    def _check_node(self, node: Any, what: str) -> None:
        if not isinstance(node, TreeNode):
            raise TypeError(f"{what} must be a TreeNode of this cache, got {type(node).__name__}")
        if node is self._root:
            return
        top = node
        while top.parent is not None:
            top = top.parent
        if top is not self._root:
            raise ValueError(f"{what} is not in this cache (evicted, reset or foreign)")

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Protect the path root..node from eviction (the root itself is a no-op)."""
        self._check_node(node, "inc_lock_ref(node)")
        if node is self._root:
            return
        node.direct_locks += 1
        root = self._root
        cur: TreeNode | None = node
        while cur is not root:
            assert cur is not None  # every path ends at the root (checked above)
            if cur.lock_ref == 0:
                size = len(cur.value)
                self._evictable -= size
                self._protected += size
                self._candidates.discard(cur)
            cur.lock_ref += 1
            cur = cur.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undo one inc_lock_ref(node); ValueError (nothing changed) when none is held."""
        self._check_node(node, "dec_lock_ref(node)")
        if node is self._root:
            return
        if node.direct_locks <= 0:
            raise ValueError(f"dec_lock_ref: {node!r} holds no lock (count would go below 0)")
        node.direct_locks -= 1
        root = self._root
        cur: TreeNode | None = node
        while cur is not root:
            assert cur is not None
            cur.lock_ref -= 1
            if cur.lock_ref == 0:
                size = len(cur.value)
                self._protected -= size
                self._evictable += size
                if not cur.children:
                    self._candidates.push(cur)
            cur = cur.parent

    # ------------------------------------------------------------------ eviction

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` slots from unlocked leaves, best candidate first; a
        parent joins the candidates the moment it becomes an unlocked leaf. Returns the number
        of tokens freed (less only when nothing else is evictable)."""
        if num_tokens < 0:
            raise ValueError(f"evict: num_tokens must be >= 0, got {num_tokens}")
        candidates = self._candidates
        root = self._root
        pb = self._page_bytes
        ledger = self._ledger
        freed = 0
        pieces: list[np.ndarray] = []
        while freed < num_tokens:
            node = candidates.pop()
            if node is None:
                break
            parent = node.parent
            assert parent is not None
            del parent.children[(node.pid, node.kb[:pb])]
            if parent is root:
                self._partitions.remove_root_child(node.pid)
            node.parent = None
            pieces.append(node.value)
            freed += len(node.value)
            if ledger is not None:
                ledger.on_remove(node)
            if parent is not root and parent.lock_ref == 0 and not parent.children:
                candidates.push(parent)
        self._evictable -= freed
        if pieces:
            self.allocator.free(np.concatenate(pieces) if len(pieces) > 1 else pieces[0])
        return freed

    def reset(self) -> None:
        """Drop every unlocked node and free its slots; locked paths (requests in flight)
        stay. Emits AllCleared, then BlockStored for whatever locked blocks remain."""
        root = self._root
        pieces: list[np.ndarray] = []
        stack = [root]
        while stack:
            node = stack.pop()
            for ckey, child in list(node.children.items()):
                if child.lock_ref == 0:
                    del node.children[ckey]
                    pieces.extend(self._detach_subtree(child))
                else:
                    stack.append(child)
        self._candidates.clear()
        self._evictable = 0
        self._partitions.recount([child.pid for child in root.children.values()])
        if pieces:
            self.allocator.free(np.concatenate(pieces))
        if self._ledger is not None:
            self._ledger.on_reset(root, self._partitions)

    @staticmethod
    def _detach_subtree(top: TreeNode) -> list[np.ndarray]:
        pieces = []
        stack = [top]
        while stack:
            node = stack.pop()
            pieces.append(node.value)
            stack.extend(node.children.values())
            node.parent = None
            node.heap_ver = -1
        return pieces

    # ------------------------------------------------------------------ events

    def take_events(self) -> list[KvEvent]:
        """Drain the event outbox (always empty when block_size is None)."""
        return [] if self._ledger is None else self._ledger.take()

    def snapshot(self, worker_id: str, epoch: int, seq: int) -> Snapshot:
        """Every held block, one BlockStored run per node, parents first (empty, with
        block_size 0, when events are off)."""
        if self._ledger is None:
            return Snapshot(worker_id, epoch, seq, 0, ())
        blocks = self._ledger.held_blocks(self._root, self._partitions)
        return Snapshot(worker_id, epoch, seq, self._ledger.block_size, tuple(blocks))

    # ------------------------------------------------------------------ debugging

    def pretty_print(self) -> str:
        """The tree as indented text (edge length, first tokens, lock count, hits)."""
        return debug.format_tree(self)

    def structure(self, partition: Partition = DEFAULT_PARTITION) -> dict:
        """Nested {edge tokens tuple: {...children}} of one partition, for exact tests."""
        pid = self._partitions.lookup(partition)
        return debug.structure(self, -2 if pid is None else pid)

    def check_invariants(self) -> None:
        """Raise AssertionError on any structural inconsistency (O(tree); for tests)."""
        debug.check_invariants(self)
