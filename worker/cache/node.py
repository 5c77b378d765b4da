"""TreeNode: one edge of the radix tree (a run of tokens) and the KV slots of those tokens.

Pure Python + numpy; imports neither asyncio, grpc, torch nor a clock.

Tokens are stored packed as int64 bytes (``kb``): ``bytes.startswith`` then compares a whole
edge against a query at C speed without copying, and a node costs one small object instead
of a numpy header. Slots are an int64 numpy array (``value``), one per token.

    parent ──(pid, first page of kb)──► node ──► children ...
              └ child key                 kb:    t_start .. t_end-1   (absolute positions)
                                          value: slot per token

``start`` is the absolute position of the node's first token on its root path. With the
event outbox on, ``hashes`` are the chained hashes of the blocks this node *holds* -- blocks
whose last token lies in [start, end) -- and ``last_hash`` is the hash of the last full block
ending at or before ``end`` (None when end < block_size).
"""

from __future__ import annotations

import numpy as np

_EMPTY_HASHES = np.empty(0, dtype=np.uint64)
_EMPTY_HASHES.flags.writeable = False


class TreeNode:
    """A radix tree node. Fields are owned by RadixCache; treat them as read-only."""

    __slots__ = (
        "children",
        "creation_time",
        "direct_locks",
        "hashes",
        "heap_ver",
        "hit_count",
        "kb",
        "last_access",
        "last_hash",
        "lock_ref",
        "node_id",
        "parent",
        "pid",
        "priority",
        "start",
        "value",
    )

    def __init__(
        self,
        node_id: int,
        parent: TreeNode | None,
        kb: bytes,
        value: np.ndarray,
        pid: int,
        start: int,
        now: float,
    ) -> None:
        self.node_id = node_id
        self.parent = parent
        self.children: dict[tuple[int, bytes], TreeNode] = {}
        self.kb = kb
        self.value = value
        self.pid = pid
        self.start = start
        self.lock_ref = 0  # locks taken on this node or any descendant
        self.direct_locks = 0  # inc_lock_ref calls that named this node
        self.last_access = now
        self.creation_time = now
        self.hit_count = 0
        self.priority = 0
        self.heap_ver = -1  # version of this node's live eviction-heap entry; -1 = none
        self.hashes: np.ndarray = _EMPTY_HASHES
        self.last_hash: int | None = None

    @property
    def tokens(self) -> np.ndarray:
        """The edge's token ids (read-only int64 view)."""
        return np.frombuffer(self.kb, dtype=np.int64)

    @property
    def num_tokens(self) -> int:
        return len(self.kb) >> 3

    @property
    def end(self) -> int:
        """Absolute position just past this node's last token."""
        return self.start + (len(self.kb) >> 3)

    @property
    def evicted(self) -> bool:
        """True once the node left the tree (evicted or reset); the root is never evicted."""
        return self.parent is None and self.node_id != 0

    def __repr__(self) -> str:
        toks = self.tokens[:8].tolist()
        more = "..." if self.num_tokens > 8 else ""
        return (
            f"TreeNode(id={self.node_id}, start={self.start}, tokens={toks}{more}, "
            f"r={self.lock_ref})"
        )
