"""Cheap prefix bookkeeping for the scheduler: which waiting requests' cached-prefix
estimates may be stale (incremental LPM), and which share a prefix with a request being
prefilled right now (in-batch dedup).

Pure: imports neither asyncio, grpc, torch nor a clock.

Both work on *block keys*: ``(partition seed, block index, the block's token bytes)``.
Two contexts that share their first k blocks have equal keys for block k-1 -- the converse
does not hold (a key says nothing about earlier blocks), so a key hit is a filter that a
chained block hash then confirms (dedup), or a reason to re-match against the tree (LPM).
Growth inside one block (page_size < block_size) is below this resolution: an LPM estimate
may lag the tree by less than one block until the request is matched at admission, which
is always exact.
"""

from __future__ import annotations

import numpy as np

from worker.engine.request import Req

BlockKey = tuple[int, int, bytes]


def block_keys(r: Req, start_block: int, end_block: int, block_size: int) -> list[BlockKey]:
    """Keys of ``r``'s context blocks ``[start_block, end_block)`` (full blocks only)."""
    if end_block <= start_block:
        return []
    blocks = r.token_buf[start_block * block_size : end_block * block_size]
    as_bytes = blocks.view(np.dtype((np.void, block_size * 8))).tolist()
    seed = r.partition_seed
    return [(seed, i, b) for i, b in zip(range(start_block, end_block), as_bytes, strict=True)]


def block_key(r: Req, index: int, block_size: int) -> BlockKey:
    lo = index * block_size
    return (r.partition_seed, index, r.token_buf[lo : lo + block_size].tobytes())


class TreeChangeLog:
    """Versions of tree changes, so a waiting request is re-matched only when the tree may
    have grown under its *frontier* (the block right after its cached prefix) or shrunk
    (any eviction, for a request with a non-empty match)."""

    MAX_KEYS = 1 << 16

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.version = 0
        self._evict_version = -1
        self._floor = 0  # estimates older than this are stale (the key log was dropped)
        self._inserted: dict[BlockKey, int] = {}

    def on_insert(self, r: Req, start_token: int, end_token: int) -> None:
        """``r``'s context tokens [start_token, end_token) were (or are being) inserted."""
        bs = self.block_size
        keys = block_keys(r, start_token // bs, end_token // bs, bs)
        if not keys:
            return
        self.version += 1
        if len(self._inserted) + len(keys) > self.MAX_KEYS:
            self._inserted.clear()
            self._floor = self.version
        v = self.version
        inserted = self._inserted
        for k in keys:
            inserted[k] = v

    def on_evict(self) -> None:
        self.version += 1
        self._evict_version = self.version

    def on_reset(self) -> None:
        self.version += 1
        self._inserted.clear()
        self._floor = self.version

    def may_have_changed(self, r: Req) -> bool:
        """Whether r's estimate (taken at r.match_version) may differ from the tree now."""
        seen = r.match_version
        if seen < self._floor:
            return True
        if r.est_match and self._evict_version > seen:
            return True
        bs = self.block_size
        index = r.est_match // bs
        if (index + 1) * bs > r.num_tokens - 1:  # no full block left to grow into
            return False
        return self._inserted.get(block_key(r, index, bs), -1) > seen


class InflightPrefixes:
    """Requests being prefilled this step, for in-batch prefix dedup."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._keys: set[BlockKey] = set()
        self._reqs: list[Req] = []

    def __bool__(self) -> bool:
        return bool(self._reqs)

    def add(self, r: Req) -> None:
        bs = self.block_size
        self._keys.update(block_keys(r, 0, r.num_tokens // bs, bs))
        self._reqs.append(r)

    def shares(self, r: Req, matched: int, min_tokens: int) -> bool:
        """Whether some in-flight request shares at least ``matched + min_tokens`` tokens
        (rounded up to whole blocks) with ``r``'s context."""
        bs = self.block_size
        k = -(-(matched + min_tokens) // bs)  # blocks that must be shared
        if k == 0 or k * bs > r.num_tokens:
            return False
        if block_key(r, k - 1, bs) not in self._keys:
            return False
        target = r.context_hashes(bs)[k - 1]
        for other in self._reqs:
            hashes = other.context_hashes(bs)
            if len(hashes) >= k and hashes[k - 1] == target:
                return True
        return False
