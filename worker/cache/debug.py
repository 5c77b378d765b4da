"""Debugging views of a RadixCache: text dump, nested structure, invariant check.

Pure Python + numpy; imports neither asyncio, grpc, torch nor a clock. Reads the cache's
private fields on purpose (it is the cache's own test oracle); O(tree size), test use only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvroute_proto.events import DEFAULT_PARTITION
from kvroute_proto.hashing import block_hashes

if TYPE_CHECKING:
    from worker.cache.node import TreeNode
    from worker.cache.radix_cache import RadixCache


def format_tree(cache: RadixCache) -> str:
    """One line per node: edge length, first ten tokens, lock count, hit count."""
    lines = [f"root evictable={cache.evictable_size()} protected={cache.protected_size()}"]
    stack: list[tuple[TreeNode, int]] = [(c, 1) for c in reversed(cache.root.children.values())]
    while stack:
        node, depth = stack.pop()
        toks = node.tokens[:10].tolist()
        more = " ..." if node.num_tokens > 10 else ""
        part = cache._partitions[node.pid]
        ptxt = "" if part == DEFAULT_PARTITION else f" partition={part.cache_salt}/{part.extra_key}"
        lines.append(
            f"{'  ' * depth}[{node.num_tokens}] {toks}{more} r={node.lock_ref} "
            f"h={node.hit_count}{ptxt}"
        )
        stack.extend((c, depth + 1) for c in reversed(node.children.values()))
    return "\n".join(lines)


def structure(cache: RadixCache, pid: int) -> dict:
    """{edge tokens: {...}} for the root children of partition ``pid``."""

    def sub(node: TreeNode) -> dict:
        return {tuple(c.tokens.tolist()): sub(c) for c in node.children.values()}

    return {tuple(c.tokens.tolist()): sub(c) for c in cache.root.children.values() if c.pid == pid}


def check_invariants(cache: RadixCache) -> None:
    """Assert every structural invariant of the tree, sizes, heap and hashes."""
    root = cache.root
    page = cache.page_size
    pb = 8 * page
    bs = cache.block_size
    assert root.parent is None and root.lock_ref == 0 and root.heap_ver == -1 and not root.kb
    cache._partitions.check([child.pid for child in root.children.values()])
    live = {}
    heap = cache._candidates
    for prio, node_id, ver, node in heap.entries:
        if node.heap_ver == ver:
            assert ver not in live, "two live heap entries with one version"
            live[ver] = node
            assert node_id == node.node_id
            current = heap.priority(node)
            if heap.rekey_on_touch:
                assert prio == current, f"stale key for live entry of {node!r}"
            else:
                assert prio <= current, f"key above current for live entry of {node!r}"
    evictable = protected = candidates = 0
    slot_pieces = []
    # (node, full path tokens up to node.end) -- path kept only when hashes are checked
    stack: list[tuple[TreeNode, np.ndarray | None]] = [
        (root, np.empty(0, dtype=np.int64) if bs else None)
    ]
    while stack:
        node, path = stack.pop()
        child_locks = 0
        for ckey, child in node.children.items():
            assert child.parent is node, f"{child!r}: parent pointer"
            assert ckey == (child.pid, child.kb[:pb]), f"{child!r}: child key"
            assert node is root or child.pid == node.pid, f"{child!r}: partition differs"
            assert child.start == node.end, f"{child!r}: start {child.start} != {node.end}"
            child_locks += child.lock_ref
            sub = None if path is None else np.concatenate((path, child.tokens))
            stack.append((child, sub))
        if node is root:
            continue
        n = node.num_tokens
        assert n > 0 and n % page == 0, f"{node!r}: edge length {n} vs page_size {page}"
        assert node.value.dtype == np.int64 and len(node.value) == n, f"{node!r}: value"
        assert node.direct_locks >= 0
        assert node.lock_ref == node.direct_locks + child_locks, f"{node!r}: lock_ref"
        if node.lock_ref:
            protected += n
        else:
            evictable += n
        is_candidate = node.lock_ref == 0 and not node.children
        assert (node.heap_ver >= 0) == is_candidate, f"{node!r}: heap membership"
        if is_candidate:
            candidates += 1
            assert live.get(node.heap_ver) is node, f"{node!r}: no live heap entry"
        slot_pieces.append(node.value)
        if bs and path is not None:
            expect = block_hashes(path, bs, cache._partitions[node.pid].seed)
            assert np.array_equal(node.hashes, expect[node.start // bs : node.end // bs]), (
                f"{node!r}: block hashes"
            )
            last = int(expect[-1]) if len(expect) else None
            assert node.last_hash == last, f"{node!r}: last_hash"
    assert evictable == cache.evictable_size(), (evictable, cache.evictable_size())
    assert protected == cache.protected_size(), (protected, cache.protected_size())
    assert candidates == cache.num_evictable_leaves == len(live), "candidate count"
    if slot_pieces:
        slots = np.concatenate(slot_pieces)
        assert len(np.unique(slots)) == len(slots), "a slot is held by two tree positions"
        assert cache.allocator.is_allocated(slots).all(), "tree holds a free slot"
