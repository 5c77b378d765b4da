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
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvroute_proto.events import BlockRemoved, BlockStored, Partition
from kvroute_proto.hashing import block_hashes, unfmix64
from worker.cache.node import _EMPTY_HASHES, TreeNode

_U64 = np.uint64


def hash_new_node(
    node: TreeNode, path_tokens: np.ndarray, seed: int, block_size: int
) -> np.ndarray | None:
    """Fill ``node.hashes`` / ``node.last_hash`` for a new leaf whose parent is already set.

    ``path_tokens`` are the int64 tokens of the whole root path up to at least ``node.end``.
    Returns the tokens of the node's blocks (None when it holds none).
    """
    parent = node.parent
    assert parent is not None
    start, end = node.start, node.end
    first, stop = start // block_size, end // block_size
    if stop == first:
        node.hashes = _EMPTY_HASHES
        node.last_hash = parent.last_hash
        return None
    toks = path_tokens[first * block_size : stop * block_size]
    state = seed if parent.last_hash is None else unfmix64(parent.last_hash)
    hashes = block_hashes(toks.view(_U64), block_size, state, validate=False)
    node.hashes = hashes
    node.last_hash = int(hashes[-1])
    return toks


def stored_event(node: TreeNode, block_tokens: np.ndarray, partition: Partition) -> BlockStored:
    """BlockStored for the blocks ``node`` holds (block_tokens from :func:`hash_new_node`)."""
    parent = node.parent
    assert parent is not None
    return BlockStored(
        block_hashes=tuple(node.hashes.tolist()),
        parent_hash=parent.last_hash,
        token_ids=tuple(block_tokens.tolist()),
        partition=partition,
    )


def removed_event(node: TreeNode) -> BlockRemoved:
    return BlockRemoved(block_hashes=tuple(node.hashes.tolist()))


def split_hashes(new_parent: TreeNode, child: TreeNode, block_size: int) -> None:
    """Re-partition ``child``'s hashes after a split that put ``new_parent`` above it.

    ``new_parent`` covers [start, p) and ``child`` now covers [p, end); the child's
    ``last_hash`` is unchanged (its end did not move).
    """
    num_parent = new_parent.end // block_size - new_parent.start // block_size
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


def held_blocks(
    root: TreeNode, block_size: int, partitions: Sequence[Partition]
) -> list[BlockStored]:
    """Every block the tree holds as BlockStored runs, one per node, parents first."""
    out: list[BlockStored] = []
    # Each stack entry carries the tokens of the parent's trailing partial block, the only
    # tokens above a node that its own blocks can need.
    stack: list[tuple[TreeNode, np.ndarray]] = [
        (child, np.empty(0, dtype=np.int64)) for child in reversed(root.children.values())
    ]
    while stack:
        node, carry = stack.pop()
        toks = np.concatenate((carry, node.tokens)) if len(carry) else node.tokens
        num_block_tokens = len(node.hashes) * block_size
        if num_block_tokens:
            out.append(stored_event(node, toks[:num_block_tokens], partitions[node.pid]))
        tail = toks[len(toks) - node.end % block_size :] if node.end % block_size else toks[:0]
        for child in reversed(node.children.values()):
            stack.append((child, tail))
    return out
