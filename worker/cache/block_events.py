"""Which full B-token blocks a radix node holds, their chained hashes, and the events for them.

Pure Python + numpy; imports neither asyncio, grpc, torch nor a clock.

Block i covers absolute positions [iB, (i+1)B) of a root path. A node covering [start, end)
*holds* block i when the block's last token is in the node, i.e. start < (i+1)B <= end, so
it holds blocks [start // B, end // B). A block spanning a parent/child boundary is held by
the child; a split only re-partitions the hash array, so it emits nothing.

    tokens:  | parent ......... | child ....................... |
    blocks:  [ b0 ][ b1 ][ b2  ][ b3 ][ b4 ][ b5 ]...   (b2 spans the boundary -> child)

Hashes chain: a node's blocks are hashed from the state after its parent's ``last_hash``
(``unfmix64`` inverts the final mix), so each token is hashed once, on insert.

Shared blocks: siblings differ somewhere in their first page. When block_size is a multiple
of page_size every block a child holds covers its whole first page, so no two nodes hold the
same block. Otherwise a block ending inside a child's first page can be held by several
siblings at once: at page 4, block 3, the children [7,1,0,0] and [7,1,2,2] of a node covering
[0,4) both hold block 1 = positions [3,6) = (t3, 7, 1). Then the ledger reference-counts
hashes and announces a block only when its count leaves or returns to zero. Shared blocks are
always a leading run of a node's hashes (a later block covers the whole first page).
"""

from __future__ import annotations

import numpy as np

from kvroute_proto.events import (
    TOKEN_DTYPE,
    AllCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    Partition,
)
from kvroute_proto.hashing import block_hashes, unfmix64
from worker.cache.node import _EMPTY_HASHES, TreeNode
from worker.cache.partitions import PartitionTable

_U64 = np.uint64


class BlockLedger:
    """Per-node block hashes plus the event outbox of one radix cache."""

    __slots__ = ("block_size", "events", "refs")

    def __init__(self, block_size: int, page_size: int) -> None:
        self.block_size = block_size
        self.events: list[KvEvent] = []
        # hash -> number of nodes holding it; only needed when blocks can be shared.
        self.refs: dict[int, int] | None = None if block_size % page_size == 0 else {}

    def take(self) -> list[KvEvent]:
        events, self.events = self.events, []
        return events

    def on_new_leaf(self, node: TreeNode, path_tokens: np.ndarray, partition: Partition) -> None:
        """Hash a new leaf (parent already set) and announce the blocks that became held.

        ``path_tokens`` are the int64 tokens of the root path up to at least ``node.end``.
        """
        parent = node.parent
        assert parent is not None
        bs = self.block_size
        first, stop = node.start // bs, node.end // bs
        if stop == first:
            node.hashes = _EMPTY_HASHES
            node.last_hash = parent.last_hash
            return
        toks = path_tokens[first * bs : stop * bs]
        state = partition.seed if parent.last_hash is None else unfmix64(parent.last_hash)
        hashes = block_hashes(toks.view(_U64), bs, state, validate=False)
        node.hashes = hashes
        node.last_hash = int(hashes[-1])
        hash_list = hashes.tolist()
        parent_hash = parent.last_hash
        refs = self.refs
        if refs is not None:
            # Blocks a sibling already holds form a leading run (see module docstring).
            skip = 0
            for i, h in enumerate(hash_list):
                count = refs.get(h, 0)
                refs[h] = count + 1
                if count:
                    assert skip == i, "a shared block after a fresh one"
                    skip += 1
            if skip:
                parent_hash = hash_list[skip - 1]
                hash_list = hash_list[skip:]
                toks = toks[skip * bs :]
            if not hash_list:
                return
        self.events.append(
            BlockStored(
                tuple(hash_list), parent_hash, toks.astype(TOKEN_DTYPE).tobytes(), partition
            )
        )

    def on_remove(self, node: TreeNode) -> None:
        """``node`` left the tree: announce the blocks no other node holds."""
        if not len(node.hashes):
            return
        hash_list = node.hashes.tolist()
        refs = self.refs
        if refs is not None:
            gone = []
            for h in hash_list:
                count = refs[h] - 1
                if count:
                    refs[h] = count
                else:
                    del refs[h]
                    gone.append(h)
            hash_list = gone
            if not hash_list:
                return
        self.events.append(BlockRemoved(tuple(hash_list)))

    def on_split(self, new_parent: TreeNode, child: TreeNode) -> None:
        """Re-partition ``child``'s hashes after a split put ``new_parent`` above it.

        ``new_parent`` covers [start, p) and ``child`` now covers [p, end); the child's
        ``last_hash`` is unchanged (its end did not move). Emits nothing.
        """
        bs = self.block_size
        num_parent = new_parent.end // bs - new_parent.start // bs
        hashes = child.hashes
        if num_parent:
            new_parent.hashes = hashes[:num_parent]
            child.hashes = hashes[num_parent:]
            new_parent.last_hash = int(hashes[num_parent - 1])
        else:
            new_parent.hashes = _EMPTY_HASHES
            grand = new_parent.parent
            assert grand is not None
            new_parent.last_hash = grand.last_hash

    def on_reset(self, root: TreeNode, partitions: PartitionTable) -> None:
        """The tree dropped its unlocked nodes: AllCleared, then re-announce what is left."""
        self.events.append(AllCleared())
        blocks = self.held_blocks(root, partitions)
        self.events.extend(blocks)
        if self.refs is not None:
            self.refs = {}
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                for h in node.hashes.tolist():
                    self.refs[h] = self.refs.get(h, 0) + 1
                stack.extend(node.children.values())

    def held_blocks(self, root: TreeNode, partitions: PartitionTable) -> list[BlockStored]:
        """Every block the tree holds, once each, as BlockStored runs (one per node),
        parents first."""
        bs = self.block_size
        out: list[BlockStored] = []
        seen: set[int] = set()
        # Each stack entry carries the tokens of the parent's trailing partial block: the
        # only tokens above a node that its own blocks need.
        empty = np.empty(0, dtype=np.int64)
        stack: list[tuple[TreeNode, np.ndarray]] = [
            (child, empty) for child in reversed(root.children.values())
        ]
        while stack:
            node, carry = stack.pop()
            toks = np.concatenate((carry, node.tokens)) if len(carry) else node.tokens
            hash_list = node.hashes.tolist()
            parent = node.parent
            assert parent is not None
            parent_hash = parent.last_hash
            skip = 0
            while skip < len(hash_list) and hash_list[skip] in seen:  # held by a sibling
                parent_hash = hash_list[skip]
                skip += 1
            if skip < len(hash_list):
                seen.update(hash_list[skip:])
                run = toks[skip * bs : len(hash_list) * bs]
                out.append(
                    BlockStored(
                        tuple(hash_list[skip:]),
                        parent_hash,
                        run.astype(TOKEN_DTYPE).tobytes(),
                        partitions[node.pid],
                    )
                )
            rem = node.end % bs
            tail = toks[len(toks) - rem :] if rem else empty
            stack.extend((child, tail) for child in reversed(node.children.values()))
        return out
