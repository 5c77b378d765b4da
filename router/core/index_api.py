"""The prefix index's interface (:class:`PrefixIndexAPI`) and what its implementations share:
their configuration, error kinds, the compaction threshold and the application of KV events.

Two implementations answer alike (tests/router/core/index_agreement.py drives both and
compares them after every step): router.core.index_nb (flat tables walked by numba kernels,
the router's default) and router.core.index (dicts, the pure-Python reference). The router
core, the shells and the tools type against :class:`PrefixIndexAPI`; router.core.index_factory
builds the one :attr:`IndexConfig.backend` names. Neither implementation imports the other.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvroute_proto.events import AllCleared, BlockRemoved, BlockStored, KvEvent
from kvroute_proto.hashing import block_hashes, unfmix64

__all__ = [
    "COMPACT_MIN",
    "ERROR_KINDS",
    "INDEX_BACKENDS",
    "AppliesEvents",
    "IndexConfig",
    "PrefixIndexAPI",
]

INDEX_BACKENDS = ("dict", "numba")
"""``IndexConfig.backend``: dict (router.core.index, the reference implementation) or numba
(router.core.index_nb: flat tables walked by compiled kernels, same answers)."""

ERROR_KINDS = ("unknown_parent", "unknown_block", "wrong_partition", "hash_mismatch")
"""Kinds of apply errors counted in :attr:`PrefixIndexAPI.errors` (never raised).

unknown_parent: a stored chain's parent is not held by that worker (still indexed).
unknown_block: a removed block the worker was not known to hold (ignored).
wrong_partition: with ``verify_hashes``, a root block whose hash is not that of its tokens
    under its partition's seed (event dropped).
hash_mismatch: with ``verify_hashes``, a non-root chain that does not follow from its
    parent hash and tokens (event dropped).
"""

COMPACT_MIN = 4096
"""The compaction rule's floor: an index whose largest size since it last compacted (its
peak) is under this is not compacted when it shrinks to a quarter of it (only when empty).
The peak is also the size-cap eviction's trigger, so both implementations keep it alike."""


@dataclass(frozen=True, slots=True)
class IndexConfig:
    """``max_blocks``: cap on indexed (confirmed) blocks; predictions are bounded by their TTL.

    ``predict_stride``: keep every stride-th block of a prediction (see router.core.predicted).

    ``verify_hashes``: recompute each stored chain from its tokens (about 1 us per block;
    off by default -- workers share the hashing code, and a bad hash can only misroute).

    ``backend``: which implementation router.core.index_factory.make_index builds
    (``INDEX_BACKENDS``).
    """

    max_blocks: int = 4_000_000
    verify_hashes: bool = False
    predict_stride: int = 4
    backend: str = "dict"

    def __post_init__(self) -> None:
        if self.backend not in INDEX_BACKENDS:
            raise ValueError(f"index backend must be one of {INDEX_BACKENDS}, got {self.backend!r}")
        if self.max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {self.max_blocks}")
        if self.predict_stride < 1:
            raise ValueError(f"predict_stride must be >= 1, got {self.predict_stride}")


class PrefixIndexAPI(Protocol):
    """Block hash -> set of worker slots (small non-negative ints), with predicted entries
    (router.core.predicted's semantics) and a size cap. Not thread-safe.

    ``hashes`` arguments are a query's block hashes from position 0: a list of ints, or a
    uint64 array where :attr:`takes_arrays` says the implementation takes it unconverted.
    """

    config: IndexConfig
    errors: Counter[str]
    """The rejected or inconsistent events, by ERROR_KINDS."""
    num_evicted: int
    """Blocks evicted by the size cap."""
    last_confirmed: dict[int, int]
    """The event-confirmed depths of the last find_matches (before predictions lengthened
    any): what the route decision reports as matched from events (metrics)."""

    @property
    def takes_arrays(self) -> bool:
        """Whether queries are best given as uint64 arrays (as block_hashes returns them);
        else as lists of Python ints."""
        ...

    @property
    def prefers_wire(self) -> bool:
        """Whether :meth:`apply_wire` is the faster way to apply a plain scanned batch
        (else applying its decoded events one by one is)."""
        ...

    # ---- sizes ---------------------------------------------------------------------------

    def size(self) -> int:
        """Number of indexed (confirmed) blocks, whoever holds them."""
        ...

    @property
    def num_entries(self) -> int:
        """Number of confirmed (block, worker) pairs."""
        ...

    @property
    def num_predicted(self) -> int:
        """Number of predicted (sparse block, worker) pairs."""
        ...

    def num_worker_blocks(self, slot: int) -> int:
        """Confirmed blocks of one worker."""
        ...

    def approx_bytes(self) -> int:
        """An estimate of the index's memory in bytes (metrics)."""
        ...

    def snapshot(self, slot: int) -> set[int]:
        """Block hashes confirmed (by events) to be held by ``slot``."""
        ...

    def predicted(self, slot: int) -> set[int]:
        """The (sparse) block hashes predicted for ``slot``."""
        ...

    # ---- matching ------------------------------------------------------------------------

    def find_matches(self, hashes: Sequence[int], touch: bool = True) -> dict[int, int]:
        """Matched prefix length in blocks per worker slot (slots matching 0 are absent):
        per slot the longer of its confirmed prefix and its predicted one (a multiple of
        the stride). With ``touch``, stamps the deepest confirmed match as recently used
        (the size cap's LRU order). Sets :attr:`last_confirmed`."""
        ...

    def match_depth(self, slot: int, hashes: Sequence[int]) -> int:
        """``find_matches(hashes, touch=False).get(slot, 0)``, touching nothing and leaving
        :attr:`last_confirmed` as it was."""
        ...

    def find_matches_by_source(
        self, hashes: Sequence[int]
    ) -> tuple[dict[int, int], dict[int, int]]:
        """``(confirmed, predicted)`` matched lengths apart (explanations; touches nothing)."""
        ...

    # ---- predicted entries ---------------------------------------------------------------

    def predict(
        self,
        slot: int,
        hashes: Sequence[int],
        deadline: float,
        start: int = 0,
        hold: bool = False,
    ) -> Sequence[int]:
        """Predict that ``slot`` holds the prefix ``hashes`` until ``deadline`` (the blocks
        before ``start`` are not re-entered); with ``hold``, kept past it until
        :meth:`release_predicted` is called with the returned handle."""
        ...

    def release_predicted(self, handle: Sequence[int], deadline: float) -> None:
        """End the hold ``handle`` names; its blocks then live until ``deadline``."""
        ...

    def refresh_predicted(self, hashes: Sequence[int], deadline: float) -> None:
        """Extend the deadline of the predicted prefix ``hashes``."""
        ...

    def expire(self, now: float) -> int:
        """Drop predictions whose deadline is <= ``now``; returns the blocks dropped."""
        ...

    # ---- events --------------------------------------------------------------------------

    def apply(self, slot: int, event: KvEvent) -> None:
        """Apply one KV event of worker ``slot``. Errors are counted, never raised."""
        ...

    def apply_wire(self, slot: int, layout: np.ndarray) -> None:
        """Apply a plain scanned batch's events (kvroute_proto.codec.WireBatch.layout) as
        :meth:`apply` applies its decoded events. Not with ``verify_hashes``."""
        ...

    def store(self, slot: int, event: BlockStored) -> None:
        """Index a stored chain for ``slot``."""
        ...

    def remove(self, slot: int, hashes: Sequence[int]) -> None:
        """Withdraw blocks from ``slot``; blocks nobody holds any more are deleted."""
        ...

    def remove_worker(self, slot: int, predictions: bool = True) -> int:
        """Drop every confirmed entry of ``slot``, and its predictions unless
        ``predictions`` is False; returns the confirmed count."""
        ...

    def check_invariants(self) -> None:
        """Assert the internal invariants (for tests; O(size))."""
        ...


# wire_nb's layout (kvroute_proto.wire_nb): the event count, each event's fields
_W_COUNT, _W_HEADER, _W_PER_EVENT = 12, 16, 12
_W_STORED, _W_CLEARED = 1, 3


class AppliesEvents:
    """``apply``: one KV event to ``store`` / ``remove`` / ``remove_worker``; ``apply_wire``
    (the plain way: the layout's events one by one) and ``_verify`` (a stored chain against
    its tokens, ``IndexConfig.verify_hashes``), for every index implementation."""

    config: IndexConfig
    errors: Counter[str]  # the rejected events, by ERROR_KINDS

    def store(self, slot: int, event: BlockStored) -> None:
        raise NotImplementedError

    def remove(self, slot: int, hashes: Sequence[int]) -> None:
        raise NotImplementedError

    def remove_worker(self, slot: int, predictions: bool = True) -> int:
        raise NotImplementedError

    def apply(self, slot: int, event: KvEvent) -> None:
        """Apply one KV event of worker ``slot``. Errors are counted, never raised."""
        kind = type(event)  # the two common kinds first, without the match's checks
        if kind is BlockStored:
            self.store(slot, event)
            return
        if kind is BlockRemoved:
            self.remove(slot, event.block_hashes)
            return
        match event:
            case BlockStored():
                self.store(slot, event)
            case BlockRemoved(block_hashes=hashes):
                self.remove(slot, hashes)
            case AllCleared():
                self.remove_worker(slot)
            case _:
                raise TypeError(f"not a KV event: {event!r}")

    def apply_wire(self, slot: int, layout: np.ndarray) -> None:
        """Apply a plain scanned batch's events (kvroute_proto.codec.WireBatch.layout:
        default partitions, token ids of the right length) for ``slot``, in order, as
        ``apply`` applies its decoded events -- the same entries, the same errors -- from
        the hashes the layout holds (no token ids: not with ``verify_hashes``)."""
        if self.config.verify_hashes:
            raise ValueError("apply_wire does not verify hashes: apply the events")
        for e in range(int(layout[_W_COUNT])):
            base = _W_HEADER + _W_PER_EVENT * e
            kind, start, size, has_parent, parent = layout[base : base + 5].tolist()
            if kind == _W_CLEARED:
                self.remove_worker(slot)
                continue
            hashes = layout[start : start + size].tolist()
            if kind == _W_STORED:
                self.store(slot, BlockStored(tuple(hashes), parent if has_parent else None, ()))
            else:
                self.remove(slot, hashes)

    def _verify(self, event: BlockStored) -> bool:
        """Recompute the chain's hashes from its tokens; count and reject a mismatch."""
        hashes = event.block_hashes
        tokens = event.token_array.astype(np.uint64)
        if len(tokens) % len(hashes):
            self.errors["hash_mismatch"] += 1
            return False
        block_size = len(tokens) // len(hashes)
        parent = event.parent_hash
        start = event.partition.seed if parent is None else unfmix64(parent)
        expect = block_hashes(tokens, block_size, start, validate=False)
        if np.array_equal(expect, np.asarray(hashes, dtype=np.uint64)):
            return True
        self.errors["wrong_partition" if parent is None else "hash_mismatch"] += 1
        return False
