"""PrefixIndex: the router's global view of which worker holds which KV block.

Sans-I/O: imports neither asyncio, grpc, torch nor a clock. Times (for predicted entries)
are passed in by the caller; LRU order uses an internal tick counter.

Why a dict and not a pointer tree
---------------------------------
Block hashes chain from position 0 (``kvroute_proto.hashing``): the hash of block i names
the whole prefix [0, (i+1)B). So the "tree" needs no child pointers -- a query's i-th hash
either is in the index or not, and if it is, the same prefix is (up to 64-bit collisions)::

    query hashes      h0 ---- h1 ---- h2 ---- h3 ---- h4
    _masks[h]        0b111   0b111   0b011   0b001   (absent)
    running AND      0b111   0b111   0b011   0b001    0
    matched blocks   worker0: 4, worker1: 3, worker2: 2

A worker's matched length is the depth at which its bit leaves the running AND of the
per-block worker bitsets. ``find_matches`` computes that with C-level iterators
(``map(dict.get)`` -> ``accumulate(and_)`` -> ``takewhile``), so no Python bytecode runs
per block. Workers are small ints (slots); their sets are Python int bitsets.

Per block we keep the bitset (``_masks``) and, for non-root blocks, the parent hash
(``_parents``, only used to find leaves when the size cap evicts). Nodes whose bitset
becomes empty are deleted from every dict at once, and the dicts are compacted when they
shrink to a quarter of their peak, so memory returns to baseline after removals (Dynamo's
radix index leaked by keeping dead nodes attached).

Unknown parents: a stored block whose parent the worker is not known to hold is still
indexed (and counted under ``errors["unknown_parent"]``). It can only match a query whose
earlier blocks are indexed too, since matching starts at position 0; once its parent is
stored (by this or a later event) the chain is complete with no relinking needed, because
linkage is the hash itself.

Predicted entries: :meth:`predict` sets a worker's bit on blocks the router expects it to
create (a request was just sent there) and records them in ``_pred`` until a stored event
confirms them or their deadline passes (:meth:`expire`). A prediction's deadline is the
latest given for that block by any worker (a refresh on one worker extends the others: a
deliberate simplification). ``snapshot`` returns confirmed blocks only.

Size cap: past ``max_blocks`` indexed blocks, the least recently matched leaves are evicted
(down to 15/16 of the cap, so the O(n) leaf scan is amortised). Recency is a tick stamped on
the deepest block of each match and on the last block of each stored event; a leaf inherits
the later of its own stamp and its evicted child's, so a hot interior prefix whose cold
tails go first is not evicted after them.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import accumulate, repeat, takewhile
from operator import and_, itemgetter

import numpy as np

from kvroute_proto.events import AllCleared, BlockRemoved, BlockStored, KvEvent
from kvroute_proto.hashing import block_hashes, unfmix64

__all__ = ["ERROR_KINDS", "IndexConfig", "PrefixIndex"]

ERROR_KINDS = ("unknown_parent", "unknown_block", "wrong_partition", "hash_mismatch")
"""Kinds of apply errors counted in :attr:`PrefixIndex.errors` (never raised).

unknown_parent: a stored chain's parent is not held by that worker (still indexed).
unknown_block: a removed block the worker was not known to hold (ignored).
wrong_partition: with ``verify_hashes``, a root block whose hash is not that of its tokens
    under its partition's seed (event dropped).
hash_mismatch: with ``verify_hashes``, a non-root chain that does not follow from its
    parent hash and tokens (event dropped).
"""

_COMPACT_MIN = 4096  # don't bother compacting dicts smaller than this


@dataclass(frozen=True, slots=True)
class IndexConfig:
    """``max_blocks``: cap on indexed blocks (confirmed + predicted).

    ``verify_hashes``: recompute each stored chain from its tokens (about 1 us per block;
    off by default -- workers share the hashing code, and a bad hash can only misroute).
    """

    max_blocks: int = 4_000_000
    verify_hashes: bool = False

    def __post_init__(self) -> None:
        if self.max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {self.max_blocks}")


def _bits_of(mask: int) -> Iterable[int]:
    """Slots whose bit is set in ``mask``, lowest first."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class PrefixIndex:
    """Block hash -> set of worker slots, with predicted entries and a size cap.

    Worker slots are small non-negative ints (the router core maps worker ids to them and
    reuses freed slots). Not thread-safe.
    """

    def __init__(self, config: IndexConfig | None = None) -> None:
        self.config = config or IndexConfig()
        self._masks: dict[int, int] = {}  # block hash -> bitset of slots (confirmed | predicted)
        self._parents: dict[int, int] = {}  # block hash -> parent hash (stored non-roots)
        self._stamps: dict[int, int] = {}  # block hash -> recency tick (sparse)
        self._pred: dict[int, int] = {}  # block hash -> bitset of predicted-only slots
        self._pred_until: dict[int, float] = {}  # block hash -> latest prediction deadline
        self._pred_queue: deque[tuple[float, Sequence[int]]] = deque()  # (deadline, hashes)
        self._num_blocks: dict[int, int] = {}  # slot -> (block, slot) pairs incl. predicted
        self._bits: list[int] = []  # slot -> 1 << slot, shared int objects
        self._tick = 0
        self._peak = 0
        self.errors: Counter[str] = Counter({kind: 0 for kind in ERROR_KINDS})
        self.num_evicted = 0

    # ---- sizes ---------------------------------------------------------------------------

    def size(self) -> int:
        """Number of indexed blocks (confirmed or predicted, whoever holds them)."""
        return len(self._masks)

    @property
    def num_entries(self) -> int:
        """Number of (block, worker) pairs, predicted ones included."""
        return sum(self._num_blocks.values())

    @property
    def num_predicted(self) -> int:
        """Number of (block, worker) pairs that are predicted and not yet confirmed."""
        return sum(m.bit_count() for m in self._pred.values())

    def num_worker_blocks(self, slot: int) -> int:
        """(block, slot) pairs of one worker, predicted ones included."""
        return self._num_blocks.get(slot, 0)

    def snapshot(self, slot: int) -> set[int]:
        """Block hashes confirmed (by events) to be held by ``slot``."""
        if not self._num_blocks.get(slot):
            return set()
        bit = self._bit(slot)
        pred = self._pred
        return {h for h, m in self._masks.items() if m & bit and not pred.get(h, 0) & bit}

    def predicted(self, slot: int) -> set[int]:
        """Block hashes predicted (not confirmed) for ``slot``."""
        bit = self._bit(slot)
        return {h for h, m in self._pred.items() if m & bit}

    # ---- matching ------------------------------------------------------------------------

    def find_matches(self, hashes: Sequence[int]) -> dict[int, int]:
        """Matched prefix length in blocks per worker slot (slots matching 0 are absent).

        ``hashes`` are a query's block hashes from position 0 (Python ints; a list is
        fastest). Stamps the deepest matched block as recently used.
        """
        cum = list(takewhile(bool, accumulate(map(self._masks.get, hashes, repeat(0)), and_)))
        if not cum:
            return {}
        depth = len(cum)
        self._tick += 1
        self._stamps[hashes[depth - 1]] = self._tick
        last = cum[-1]
        first = cum[0]
        if first == last:  # the common case: nobody drops out before the end of the match
            return dict.fromkeys(_bits_of(first), depth)
        result: dict[int, int] = {}
        # cum is non-increasing as a set, hence as an int: walk its distinct values.
        pos = 0
        values = sorted(set(cum), reverse=True)
        for value, nxt in zip(values, [*values[1:], 0], strict=True):
            pos += cum.count(value)
            for slot in _bits_of(value & ~nxt):
                result[slot] = pos
        return result

    # ---- events --------------------------------------------------------------------------

    def apply(self, slot: int, event: KvEvent) -> None:
        """Apply one KV event of worker ``slot``. Errors are counted, never raised."""
        match event:
            case BlockStored():
                self.store(slot, event)
            case BlockRemoved(block_hashes=hashes):
                self.remove(slot, hashes)
            case AllCleared():
                self.remove_worker(slot)
            case _:
                raise TypeError(f"not a KV event: {event!r}")

    def store(self, slot: int, event: BlockStored) -> None:
        """Index a stored chain for ``slot`` (confirms predicted entries)."""
        hashes = event.block_hashes
        n = len(hashes)
        if n == 0:
            return
        masks = self._masks
        bit = self._bit(slot)
        parent = event.parent_hash
        if parent is not None and not masks.get(parent, 0) & bit:
            self.errors["unknown_parent"] += 1
        if self.config.verify_hashes and not self._verify(event):
            return
        got = list(map(masks.get, hashes))
        if got.count(None) == n:  # all new: C-level bulk inserts
            before = len(masks)
            masks.update(zip(hashes, repeat(bit)))
            self._parents.update(zip(hashes[1:], hashes, strict=False))  # (child, parent)
            added = len(masks) - before  # not n if a hash repeats within the event
        else:
            added = self._store_slow(bit, hashes, got)
        if parent is not None:
            self._parents[hashes[0]] = parent
        self._tick += 1
        self._stamps[hashes[-1]] = self._tick
        if added:
            self._num_blocks[slot] = self._num_blocks.get(slot, 0) + added
            if len(masks) > self._peak:
                self._peak = len(masks)
                if self._peak > self.config.max_blocks:
                    self._evict()

    def _store_slow(self, bit: int, hashes: Sequence[int], got: list[int | None]) -> int:
        masks, parents, pred = self._masks, self._parents, self._pred
        added = 0
        prev = None
        for h, m in zip(hashes, got, strict=True):
            if m is None:
                masks[h] = bit
                added += 1
            elif not m & bit:
                masks[h] = m | bit
                added += 1
            else:
                p = pred.get(h)
                if p is not None and p & bit:  # confirm a prediction
                    p ^= bit
                    if p:
                        pred[h] = p
                    else:
                        del pred[h]
                        self._pred_until.pop(h, None)
            if prev is not None:
                parents[h] = prev
            prev = h
        return added

    def _verify(self, event: BlockStored) -> bool:
        """Recompute the chain's hashes from its tokens; count and reject a mismatch."""
        hashes = event.block_hashes
        if len(event.token_ids) % len(hashes):
            self.errors["hash_mismatch"] += 1
            return False
        block_size = len(event.token_ids) // len(hashes)
        parent = event.parent_hash
        start = event.partition.seed if parent is None else unfmix64(parent)
        tokens = np.asarray(event.token_ids, dtype=np.uint64)
        expect = block_hashes(tokens, block_size, start, validate=False)
        if np.array_equal(expect, np.asarray(hashes, dtype=np.uint64)):
            return True
        self.errors["wrong_partition" if parent is None else "hash_mismatch"] += 1
        return False

    def remove(self, slot: int, hashes: Sequence[int]) -> None:
        """Withdraw blocks from ``slot``; blocks nobody holds any more are deleted."""
        masks = self._masks
        bit = self._bit(slot)
        got = list(map(masks.get, hashes))
        n = len(hashes)
        if got.count(bit) == n and not self._pred:  # only this worker held them: bulk delete
            before = len(masks)
            deque(map(masks.pop, hashes, repeat(None)), 0)
            deque(map(self._parents.pop, hashes, repeat(None)), 0)
            deque(map(self._stamps.pop, hashes, repeat(None)), 0)
            removed = before - len(masks)
            if removed < n:  # a hash repeated within the event: the repeats are unknown
                self.errors["unknown_block"] += n - removed
        else:
            removed = self._remove_slow(bit, hashes, got)
        if removed:
            self._num_blocks[slot] -= removed
            self._maybe_compact()

    def _remove_slow(self, bit: int, hashes: Sequence[int], got: list[int | None]) -> int:
        masks, pred = self._masks, self._pred
        removed = 0
        for h, m in zip(hashes, got, strict=True):
            if m is None or not m & bit:
                self.errors["unknown_block"] += 1
                continue
            m = masks.get(h, 0)  # re-read: a hash may repeat within one event
            if not m & bit:
                self.errors["unknown_block"] += 1
                continue
            removed += 1
            m ^= bit
            p = pred.get(h)
            if p is not None and p & bit:
                p ^= bit
                if p:
                    pred[h] = p
                else:
                    del pred[h]
                    self._pred_until.pop(h, None)
            if m:
                masks[h] = m
            else:
                self._delete_node(h)
        return removed

    def _delete_node(self, h: int) -> None:
        del self._masks[h]
        self._parents.pop(h, None)
        self._stamps.pop(h, None)
        if self._pred.pop(h, None) is not None:
            self._pred_until.pop(h, None)

    def remove_worker(self, slot: int) -> int:
        """Drop every entry of ``slot`` (confirmed and predicted); returns how many."""
        count = self._num_blocks.pop(slot, 0)
        if not count:
            return 0
        bit = self._bit(slot)
        masks = {h: (m ^ bit if m & bit else m) for h, m in self._masks.items() if m != bit}
        self._masks = masks
        self._parents = {h: p for h, p in self._parents.items() if h in masks}
        self._stamps = {h: t for h, t in self._stamps.items() if h in masks}
        if self._pred:
            pred = {h: (m ^ bit if m & bit else m) for h, m in self._pred.items() if m != bit}
            self._pred = pred
            self._pred_until = {h: t for h, t in self._pred_until.items() if h in pred}
        self._peak = len(masks)
        return count

    # ---- predicted entries ---------------------------------------------------------------

    def predict(self, slot: int, hashes: Sequence[int], deadline: float, start: int = 0) -> int:
        """Enter ``hashes[start:]`` as predicted for ``slot`` until ``deadline``.

        Blocks the worker already holds or is predicted to hold are left alone except that a
        prediction's deadline is extended; ``start`` (the worker's matched depth from
        :meth:`find_matches`) skips blocks already known to carry its bit. Returns the number
        of new (block, slot) pairs.
        """
        tail = hashes[start:] if start else list(hashes)
        if not tail:
            return 0
        masks, pred = self._masks, self._pred
        bit = self._bit(slot)
        got = list(map(masks.get, tail))
        n = len(tail)
        if got.count(None) == n:  # all new: C-level bulk inserts
            before = len(masks)
            masks.update(zip(tail, repeat(bit)))
            pred.update(zip(tail, repeat(bit)))
            added = len(masks) - before
            touched = tail
        else:
            added = 0
            touched = []
            for h, m in zip(tail, got, strict=True):
                if m is None:
                    masks[h] = bit
                    pred[h] = bit
                elif not m & bit:
                    masks[h] = m | bit
                    pred[h] = pred.get(h, 0) | bit
                elif pred.get(h, 0) & bit:
                    touched.append(h)  # refresh its deadline
                    continue
                else:
                    continue  # confirmed already
                added += 1
                touched.append(h)
        if touched:
            self._set_deadline(touched, deadline)
        if added:
            self._num_blocks[slot] = self._num_blocks.get(slot, 0) + added
            if len(masks) > self._peak:
                self._peak = len(masks)
                if self._peak > self.config.max_blocks:
                    self._evict()
        return added

    def refresh_predicted(self, hashes: Sequence[int], deadline: float) -> None:
        """Extend the deadline of those ``hashes`` that are predicted (approx mode's LRU)."""
        pred = self._pred
        touched = [h for h in hashes if h in pred]
        if touched:
            self._set_deadline(touched, deadline)

    def _set_deadline(self, touched: Sequence[int], deadline: float) -> None:
        """Raise the deadline of predicted ``touched`` to ``deadline`` (never lower it)."""
        queue, until = self._pred_queue, self._pred_until
        if not queue or deadline >= queue[-1][0]:
            # Deadlines arrive in order (the core's clock is monotonic): every deadline set
            # so far is <= this one, so overwriting is raising.
            until.update(zip(touched, repeat(deadline)))
            queue.append((deadline, touched))
            return
        touched = [h for h in touched if until.get(h, -math.inf) < deadline]
        until.update(zip(touched, repeat(deadline)))
        queue.insert(bisect.bisect_right(queue, deadline, key=itemgetter(0)), (deadline, touched))

    def expire(self, now: float) -> int:
        """Drop predictions whose deadline is <= ``now``; returns the pairs dropped."""
        queue = self._pred_queue
        if not queue or queue[0][0] > now:
            return 0
        masks, pred, until = self._masks, self._pred, self._pred_until
        dropped = 0
        while queue and queue[0][0] <= now:
            _, hashes = queue.popleft()
            for h in hashes:
                t = until.get(h)
                if t is None or t > now:
                    continue  # confirmed, removed, or refreshed since
                del until[h]
                p = pred.pop(h, 0)
                m = masks.get(h, 0) & ~p
                for s in _bits_of(p):
                    self._num_blocks[s] -= 1
                    dropped += 1
                if m:
                    masks[h] = m
                else:
                    del masks[h]
                    self._parents.pop(h, None)
                    self._stamps.pop(h, None)
        self._maybe_compact()
        return dropped

    # ---- memory --------------------------------------------------------------------------

    def _bit(self, slot: int) -> int:
        bits = self._bits
        if not 0 <= slot < len(bits):
            if slot < 0:
                raise ValueError(f"worker slot must be >= 0, got {slot}")
            bits.extend(1 << s for s in range(len(bits), slot + 1))
        return bits[slot]

    def _maybe_compact(self) -> None:
        """Rebuild the dicts once they hold a quarter of their peak (dicts never shrink)."""
        n = len(self._masks)
        if (self._peak >= _COMPACT_MIN and n * 4 <= self._peak) or (n == 0 and self._peak):
            self._masks = dict(self._masks)
            self._parents = dict(self._parents)
            self._stamps = dict(self._stamps)
            self._pred = dict(self._pred)
            self._pred_until = dict(self._pred_until)
            self._peak = n

    def _evict(self) -> None:
        """Evict least recently matched leaves down to 15/16 of ``max_blocks``."""
        masks, parents, stamps = self._masks, self._parents, self._stamps
        target = self.config.max_blocks - self.config.max_blocks // 16
        num_children = Counter(p for p in parents.values() if p in masks)
        heap = [(stamps.get(h, 0), h) for h in masks if h not in num_children]
        heapq.heapify(heap)
        while len(masks) > target and heap:
            stamp, h = heapq.heappop(heap)
            m = masks.get(h)
            if m is None:
                continue
            for s in _bits_of(m):
                self._num_blocks[s] -= 1
            parent = parents.get(h)
            self._delete_node(h)
            self.num_evicted += 1
            if parent is not None and parent in masks:
                left = num_children[parent] - 1
                if left:
                    num_children[parent] = left
                else:
                    del num_children[parent]
                    inherited = max(stamp, stamps.get(parent, 0))
                    stamps[parent] = inherited  # kept for later rounds
                    heapq.heappush(heap, (inherited, parent))
        self._peak = len(masks)
        self._maybe_compact()
