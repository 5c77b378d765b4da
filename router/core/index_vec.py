"""VecPrefixIndex: the router's prefix index as numpy arrays (open addressing).

Sans-I/O: imports neither asyncio, grpc, torch nor a clock. Same public interface and the
same answers as :class:`router.core.index.PrefixIndex` (the dict index, the reference
implementation: tests/router/test_index_vec.py runs both on Hypothesis-generated histories
and asserts they agree); only the storage of confirmed entries differs::

    slot = (hash * ODD) >> (64 - log2(capacity)), then linear probing
    _keys[slot]      uint64   block hash (0 = never used; a hash of 0 is stored as _ZERO)
    _masks[slot, w]  uint64   bit s % 64 of word s // 64: worker slot s holds the block
    _parents[slot]   uint64   parent hash (0 = a root, or not known)
    _stamps[slot]    uint64   recency tick (LRU of the size cap)

Why: a dict lookup of a 64-bit int key costs two or three dependent cache misses (the hash
table, the entry, the key object), about 80 ns each at a million blocks, and the walk of a
prompt's blocks does them one after another. A numpy gather of a prompt's 512 slots issues
its loads together (the CPU keeps many misses in flight), and a stored event's blocks are
inserted with a handful of array operations instead of three dict updates.

Removal leaves a tombstone (the key stays, its mask row becomes 0): a later store of the
same hash finds its old slot, and a find treats an all-zero row as a miss. The table is
rebuilt (rehashed) when keys, live or dead, pass half the capacity, or when the live blocks
fall below a sixteenth of it (memory returns after removals).

Predicted entries are the dict index's :class:`router.core.predicted.PredictedEntries`
(sparse and TTL-bound, far fewer than confirmed entries). The size cap evicts in the same
order as the dict index (least recently matched leaves first, a parent inheriting its last
child's stamp); eviction is rare and O(n), so it runs on dicts built from the arrays.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Sequence
from typing import Any, cast

import numpy as np

from kvroute_proto.events import BlockStored
from router.core.index import (
    _COMPACT_MIN,
    ERROR_KINDS,
    AppliesEvents,
    IndexConfig,
    PrefixIndex,
    _depths,
)
from router.core.predicted import PredictedEntries, bits_of

__all__ = ["VecPrefixIndex"]

_U64 = np.uint64
_MULT = _U64(0x9E3779B97F4A7C15)  # odd: slot = (h * MULT) >> shift spreads any keys
_ZERO = 0x5851F42D4C957F2D  # a block hash of 0 is stored as this (0 marks an empty slot)
_MIN_CAPACITY = 1 << 10
_EMPTY_SLOTS = np.empty(0, dtype=np.intp)
_WINDOW = 8  # slots a lookup gathers at once from a key's home (a 64-byte cache line)
_OFFSETS = np.arange(_WINDOW, dtype=np.intp)


def _first_byte(x: np.ndarray) -> np.ndarray:
    """Index of the lowest nonzero byte of each nonzero uint64 (8 bools viewed as one)."""
    low = (x & (~x + _U64(1))).astype(np.float64)  # lowest set bit, exact in a double
    return cast(np.ndarray, (np.frexp(low)[1] - 1) >> 3)


def _as_keys(hashes: Sequence[int] | np.ndarray) -> np.ndarray:
    """Block hashes as a uint64 key array (0 -> _ZERO)."""
    if isinstance(hashes, np.ndarray) and hashes.dtype == _U64:
        keys = hashes
    else:
        keys = np.array(hashes, dtype=_U64)
    if not keys.all():
        keys = np.where(keys == 0, _U64(_ZERO), keys)
    return keys


class VecPrefixIndex(AppliesEvents):
    """Block hash -> set of worker slots in numpy arrays, with predicted entries and a size
    cap. Same interface as :class:`router.core.index.PrefixIndex`. Not thread-safe.

    ``capacity``: initial table slots (a power of two is used); the table grows as needed.
    """

    def __init__(self, config: IndexConfig | None = None, capacity: int = _MIN_CAPACITY) -> None:
        self.config = config or IndexConfig()
        cap = _MIN_CAPACITY
        while cap < capacity:
            cap *= 2
        self._alloc(cap, 1)
        self._live = 0  # rows with a nonzero mask
        # the dict index's eviction trigger, kept alike: its largest size since it last
        # compacted or evicted (an eviction that finds no leaf to drop leaves the size over
        # the cap; the next one waits until the size passes this peak)
        self._peak = 0
        # the event-confirmed depths of the last find_matches (before predictions lengthened
        # any), as router.core.index.PrefixIndex.last_confirmed
        self.last_confirmed: dict[int, int] = {}
        self._used = 0  # keys written (live + tombstones)
        self._num_blocks: dict[int, int] = {}  # slot -> (block, slot) pairs
        self._predicted = PredictedEntries(self.config.predict_stride)
        self._tick = 0
        self.errors: Counter[str] = Counter(dict.fromkeys(ERROR_KINDS, 0))
        self.num_evicted = 0

    def _alloc(self, cap: int, words: int) -> None:
        self._cap = cap
        self._shift = _U64(64 - (cap.bit_length() - 1))
        self._words = words
        self._keys = np.zeros(cap, dtype=_U64)
        self._masks = np.zeros((cap, words), dtype=_U64)
        self._parents = np.zeros(cap, dtype=_U64)
        self._stamps = np.zeros(cap, dtype=_U64)

    # ---- table ---------------------------------------------------------------------------

    def _home(self, keys: np.ndarray) -> np.ndarray:
        return cast(np.ndarray, (keys * _MULT) >> self._shift).astype(np.intp)

    def _lookup(self, keys: np.ndarray) -> np.ndarray:
        """Table slot of each key, -1 where absent: the home slots in one gather, then
        slot by slot for the keys that met another key there (few at load <= 0.4)."""
        n = len(keys)
        if not n:
            return _EMPTY_SLOTS
        pos = self._home(keys)
        found = self._keys[pos]
        hit = found == keys
        out = np.where(hit, pos, -1)
        go = ~hit & (found != 0)
        if go.any():
            idx = np.flatnonzero(go)
            self._probe(keys[idx], pos[idx], idx, out)
        return out

    def _search(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(slot of each key or -1 where absent, first empty slot of its window or -1).

        Keys never leave the table between rebuilds, so a key is stored before the first
        empty slot of its probe sequence: one gather of the _WINDOW slots from each key's
        home settles almost every key (found, or an empty slot seen first); the rest
        continue slot by slot."""
        n = len(keys)
        if not n:
            return _EMPTY_SLOTS, _EMPTY_SLOTS
        mask = self._cap - 1
        pos = self._home(keys)
        win = self._keys[(pos[:, None] + _OFFSETS) & mask]
        # a row of 8 bools viewed as one uint64: nonzero = any, lowest set byte = argmax
        eq = (win == keys[:, None]).view(_U64).ravel()
        hit = eq != 0
        out = np.where(hit, (pos + _first_byte(eq)) & mask, -1)
        if hit.all():
            return out, out
        free = (win == 0).view(_U64).ravel()
        empty = np.where(free != 0, (pos + _first_byte(free)) & mask, -1)
        todo = ~hit & (free == 0)  # no empty slot in the window: look further
        if todo.any():
            idx = np.flatnonzero(todo)
            self._probe(keys[idx], pos[idx] + (_WINDOW - 1), idx, out)
        return out, empty

    def _probe(self, want: np.ndarray, p: np.ndarray, idx: np.ndarray, out: np.ndarray) -> None:
        """Slot by slot after ``p``: out[idx] = the slot of ``want``, if present."""
        table = self._keys
        mask = self._cap - 1
        while len(idx):
            p = (p + 1) & mask
            found = table[p]
            hit = found == want
            out[idx[hit]] = p[hit]
            go = ~hit & (found != 0)
            idx, want, p = idx[go], want[go], p[go]

    def _insert(self, keys: np.ndarray) -> np.ndarray:
        """Table slot of each key, claiming an empty slot for those absent."""
        if self._used + len(keys) > self._cap * 2 // 5:
            self._rehash(self._used + len(keys))
        out, empty = self._search(keys)
        table = self._keys
        while True:
            idx = np.flatnonzero(out < 0)
            if not len(idx):
                return out
            cand = empty[idx]
            near = cand >= 0
            far = idx[~near]
            idx, cand = idx[near], cand[near]
            # claim: of keys racing for one slot the last write wins; the others (or a
            # repeat of the same key, which then finds it) search again
            want = keys[idx]
            table[cand] = want
            won = table[cand] == want
            out[idx[won]] = cand[won]
            self._used += int(np.count_nonzero(won))  # an upper bound (repeats count twice)
            # no empty slot in the window (rare): slot by slot, after the claims above (which
            # took slots that were empty when searched)
            for i in far.tolist():
                out[i] = self._claim_one(keys[i])
            if won.all():
                return out
            lost = idx[~won]
            out[lost], empty[lost] = self._search(keys[lost])

    def _claim_one(self, key: Any) -> int:
        mask = self._cap - 1
        p = int(self._home(np.array([key], dtype=_U64))[0])
        table = self._keys
        while True:
            k = table[p]
            if k == key:
                return p
            if k == 0:
                table[p] = key
                self._used += 1
                return p
            p = (p + 1) & mask

    def _rehash(self, need: int) -> None:
        """Rebuild the table with room for ``need`` keys at most a third full (tombstones
        dropped)."""
        live = np.flatnonzero(self._masks.any(axis=1))
        cap = _MIN_CAPACITY
        while cap < 3 * max(need - (self._used - len(live)), len(live)):
            cap *= 2
        keys = self._keys[live]
        masks = self._masks[live]
        parents = self._parents[live]
        stamps = self._stamps[live]
        self._alloc(cap, self._words)
        self._used = 0
        slots = self._insert(keys) if len(keys) else _EMPTY_SLOTS
        self._masks[slots] = masks
        self._parents[slots] = parents
        self._stamps[slots] = stamps

    def _word_bit(self, slot: int) -> tuple[int, Any]:
        if slot < 0:
            raise ValueError(f"worker slot must be >= 0, got {slot}")
        word = slot >> 6
        if word >= self._words:
            grown = np.zeros((self._cap, word + 1), dtype=_U64)
            grown[:, : self._words] = self._masks
            self._masks = grown
            self._words = word + 1
        return word, _U64(1 << (slot & 63))

    def _row_int(self, row: np.ndarray) -> int:
        """A mask row as a Python int bitset."""
        value = 0
        for w, x in enumerate(row.tolist()):
            value |= x << (64 * w)
        return value

    def _live_slots(self) -> np.ndarray:
        return np.flatnonzero(self._masks.any(axis=1))

    def _hash_out(self, keys: np.ndarray) -> list[int]:
        out = keys.tolist()
        if _ZERO in out:
            out = [0 if h == _ZERO else h for h in out]
        return out

    # ---- sizes ---------------------------------------------------------------------------

    def size(self) -> int:
        """Number of indexed (confirmed) blocks, whoever holds them."""
        return self._live

    @property
    def num_entries(self) -> int:
        """Number of confirmed (block, worker) pairs."""
        return sum(self._num_blocks.values())

    @property
    def num_predicted(self) -> int:
        """Number of predicted (sparse block, worker) pairs."""
        return self._predicted.num_pairs

    def num_worker_blocks(self, slot: int) -> int:
        """Confirmed blocks of one worker."""
        return self._num_blocks.get(slot, 0)

    def approx_bytes(self) -> int:
        """Memory of the index's arrays in bytes (metrics); predictions not counted."""
        arrays = (self._keys, self._masks, self._parents, self._stamps)
        return sum(a.nbytes for a in arrays)

    def snapshot(self, slot: int) -> set[int]:
        """Block hashes confirmed (by events) to be held by ``slot``."""
        if not self._num_blocks.get(slot):
            return set()
        word, bit = self._word_bit(slot)
        rows = np.flatnonzero(self._masks[:, word] & bit)
        return set(self._hash_out(self._keys[rows]))

    def predicted(self, slot: int) -> set[int]:
        """The (sparse) block hashes predicted for ``slot``."""
        return self._predicted.hashes_of(slot)

    # ---- matching ------------------------------------------------------------------------

    def _walk(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(table slots, mask rows) of the leading blocks of ``keys`` that somebody holds."""
        slots = self._lookup(keys)
        rows = self._masks[slots]  # -1 reads the last row: masked out below
        present = (slots >= 0) & rows.any(axis=1)
        if not present.all():
            n = int(present.argmin())
            slots, rows = slots[:n], rows[:n]
        return slots, rows

    def _running(self, rows: np.ndarray) -> tuple[np.ndarray, dict[int, int]]:
        """The running AND of ``rows`` (trimmed where it reaches 0), and per worker slot the
        depth at which its bit leaves it."""
        run = np.bitwise_and.accumulate(rows, axis=0)
        alive = cast(np.ndarray, run.any(axis=1))
        if not alive[-1]:
            run = run[: int(alive.argmin())]
        depths: dict[int, int] = {}
        if not len(run):
            return run, depths
        change = np.flatnonzero((run[1:] != run[:-1]).any(axis=1))
        ends = [*(change + 1).tolist(), len(run)]
        after = run[change + 1] if len(change) else run[:0]
        for k, end in enumerate(ends):
            row = run[end - 1]
            gone = row & ~after[k] if k < len(change) else row
            for w, x in enumerate(gone.tolist()):
                for b in bits_of(x):
                    depths[64 * w + b] = end
        return run, depths

    def _running_ints(self, run: np.ndarray) -> list[int]:
        if self._words == 1:
            return cast(list[int], run[:, 0].tolist())
        return [self._row_int(r) for r in run]

    def find_matches(
        self, hashes: Sequence[int] | np.ndarray, touch: bool = True
    ) -> dict[int, int]:
        """Matched prefix length in blocks per worker slot (slots matching 0 are absent).

        ``hashes``: a query's block hashes from position 0 (a uint64 array is fastest). As
        :meth:`router.core.index.PrefixIndex.find_matches`.
        """
        if not len(hashes):
            self.last_confirmed = {}
            return {}
        keys = _as_keys(hashes)
        slots, rows = self._walk(keys)
        uniform = True
        result: dict[int, int] = {}
        run = rows
        depth = len(rows)
        if depth:
            first = rows[0]
            if (rows == first).all():  # one worker set all along: the common case
                result = dict.fromkeys(self._slots_of_row(first), depth)
            else:
                run, result = self._running(rows)
                depth = len(run)
                uniform = False
            if depth and touch:
                self._tick += 1
                self._stamps[slots[depth - 1]] = self._tick
        self.last_confirmed = result
        predicted = self._predicted
        if len(predicted):
            hlist = hashes.tolist() if isinstance(hashes, np.ndarray) else hashes
            if not (uniform and self._no_predicted_tail(hlist, depth)):
                if uniform:
                    confirmed = [self._row_int(rows[0])] * depth if depth else []
                else:
                    confirmed = self._running_ints(run)
                walk = predicted.match(hlist, confirmed)
                if walk:
                    result = dict(result)  # last_confirmed keeps the events' walk alone
                    stride = predicted.stride
                    get = result.get
                    for slot, n in _depths(walk)[1].items():
                        n *= stride
                        if n > get(slot, 0):
                            result[slot] = n
        return result

    def match_depth(self, slot: int, hashes: Sequence[int] | np.ndarray) -> int:
        """One worker's matched prefix length in blocks, as
        :meth:`router.core.index.PrefixIndex.match_depth` (here by way of find_matches)."""
        if slot < 0:
            raise ValueError(f"worker slot must be >= 0, got {slot}")
        saved = self.last_confirmed
        try:
            return self.find_matches(hashes, touch=False).get(slot, 0)
        finally:
            self.last_confirmed = saved

    def _slots_of_row(self, row: np.ndarray) -> list[int]:
        out: list[int] = []
        for w, x in enumerate(row.tolist()):
            out.extend(64 * w + b for b in bits_of(x))
        return out

    def find_matches_by_source(
        self, hashes: Sequence[int] | np.ndarray
    ) -> tuple[dict[int, int], dict[int, int]]:
        """``(confirmed, predicted)`` matched lengths per worker slot, each source apart;
        as :meth:`router.core.index.PrefixIndex.find_matches_by_source` (touches nothing)."""
        if not len(hashes):
            return {}, {}
        _, rows = self._walk(_as_keys(hashes))
        confirmed = self._running(rows)[1] if len(rows) else {}
        predicted: dict[int, int] = {}
        if len(self._predicted):
            hlist = hashes.tolist() if isinstance(hashes, np.ndarray) else hashes
            walk = self._predicted.match(hlist, [])
            if walk:
                stride = self._predicted.stride
                predicted = {slot: n * stride for slot, n in _depths(walk)[1].items()}
        return confirmed, predicted

    def _no_predicted_tail(self, hashes: Sequence[int], depth: int) -> bool:
        stride = self._predicted.stride
        has = self._predicted.has
        first = stride - 1
        after = depth // stride * stride + stride - 1
        n = len(hashes)
        return not (first < n and has(hashes[first])) and not (after < n and has(hashes[after]))

    # ---- predicted entries ---------------------------------------------------------------

    def predict(
        self,
        slot: int,
        hashes: Sequence[int],
        deadline: float,
        start: int = 0,
        hold: bool = False,
    ) -> Sequence[int]:
        """As :meth:`router.core.index.PrefixIndex.predict`."""
        if slot < 0:
            raise ValueError(f"worker slot must be >= 0, got {slot}")
        if isinstance(hashes, np.ndarray):
            hashes = hashes.tolist()
        return self._predicted.add(1 << slot, hashes, deadline, start, hold)

    def release_predicted(self, handle: Sequence[int], deadline: float) -> None:
        """As :meth:`router.core.index.PrefixIndex.release_predicted`."""
        self._predicted.release(handle, deadline)

    def refresh_predicted(self, hashes: Sequence[int], deadline: float) -> None:
        """As :meth:`router.core.index.PrefixIndex.refresh_predicted`."""
        if isinstance(hashes, np.ndarray):
            hashes = hashes.tolist()
        self._predicted.refresh(hashes, deadline)

    def expire(self, now: float) -> int:
        """Drop predictions whose deadline is <= ``now``; returns the blocks dropped."""
        return self._predicted.expire(now)

    # ---- events --------------------------------------------------------------------------

    def _holds(self, key: int, word: int, bit: Any) -> bool:
        slots = self._lookup(np.array([key], dtype=_U64))
        s = int(slots[0])
        return s >= 0 and bool(self._masks[s, word] & bit)

    def store(self, slot: int, event: BlockStored) -> None:
        """Index a stored chain for ``slot``."""
        hashes = event.block_hashes
        if not hashes:
            return
        word, bit = self._word_bit(slot)
        parent = event.parent_hash
        pkey = (parent or _ZERO) if parent is not None else 0
        if parent is not None and not self._holds(pkey, word, bit):
            self.errors["unknown_parent"] += 1
        if self.config.verify_hashes and not PrefixIndex._verify(cast(Any, self), event):
            return
        keys = _as_keys(hashes)
        slots = self._insert(keys)
        masks = self._masks
        old = masks[slots, word]
        fresh = (old & bit) == 0
        new_slots = slots[fresh]
        if len(set(hashes)) < len(hashes):  # a hash repeated in the event
            new_slots = np.unique(new_slots)
        added = len(new_slots)
        if added:
            if self._words == 1:
                self._live += int(np.count_nonzero(masks[new_slots, 0] == 0))
            else:
                self._live += int(np.count_nonzero(~masks[new_slots].any(axis=1)))
            masks[new_slots, word] |= bit
        parents = self._parents
        parents[slots[1:]] = keys[:-1]
        if parent is not None:
            parents[slots[0]] = pkey
        self._tick += 1
        self._stamps[slots[-1]] = self._tick
        if added:
            self._num_blocks[slot] = self._num_blocks.get(slot, 0) + added
            if self._live > self._peak:
                self._peak = self._live
                if self._peak > self.config.max_blocks:
                    self._evict()

    def remove(self, slot: int, hashes: Sequence[int]) -> None:
        """Withdraw blocks from ``slot``; blocks nobody holds any more are deleted."""
        if not len(hashes):
            return
        word, bit = self._word_bit(slot)
        slots = self._lookup(_as_keys(hashes))
        masks = self._masks
        held = slots >= 0
        held[held] = (masks[slots[held], word] & bit) != 0
        gone = slots[held]
        if len(set(hashes)) < len(hashes):  # repeats: the later ones are unknown
            gone = np.unique(gone)
        removed = len(gone)
        unknown = len(hashes) - removed
        if unknown:
            self.errors["unknown_block"] += unknown
        if not removed:
            return
        masks[gone, word] &= ~bit
        empty = masks[gone, 0] == 0 if self._words == 1 else ~masks[gone].any(axis=1)
        dead = gone[empty]
        if len(dead):
            self._parents[dead] = 0
            self._stamps[dead] = 0
            self._live -= len(dead)
        self._num_blocks[slot] -= removed
        self._compacted()
        self._maybe_shrink()

    def remove_worker(self, slot: int, predictions: bool = True) -> int:
        """Drop every confirmed entry of ``slot``, and its predictions unless
        ``predictions`` is False; returns the confirmed count."""
        word, bit = self._word_bit(slot)
        if predictions:
            self._predicted.remove_slot(1 << slot)
        count = self._num_blocks.pop(slot, 0)
        if not count:
            return 0
        col = self._masks[:, word]
        had = np.flatnonzero(col & bit)
        col[had] &= ~bit
        dead = had[~self._masks[had].any(axis=1)]
        self._parents[dead] = 0
        self._stamps[dead] = 0
        self._live -= len(dead)
        self._peak = self._live
        self._maybe_shrink()
        return count

    def _compacted(self) -> None:
        """Where the dict index compacts its dicts it also resets its peak: alike here."""
        n, peak = self._live, self._peak
        if (peak >= _COMPACT_MIN and n * 4 <= peak) or (n == 0 and peak):
            self._peak = n

    def _maybe_shrink(self) -> None:
        if self._cap > _MIN_CAPACITY and self._live * 16 < self._cap:
            self._rehash(self._live)

    def _evict(self) -> None:
        """Evict least recently matched leaves down to 15/16 of ``max_blocks``: the dict
        index's order, on dicts built from the live rows (rare, O(n) like its leaf scan)."""
        live = self._live_slots()
        keys = self._keys[live].tolist()
        slot_of = dict(zip(keys, live.tolist(), strict=True))
        parents = {h: p for h, p in zip(keys, self._parents[live].tolist(), strict=True) if p != 0}
        stamps = dict(zip(keys, self._stamps[live].tolist(), strict=True))
        target = self.config.max_blocks - self.config.max_blocks // 16
        num_children = Counter(p for p in parents.values() if p in slot_of)
        # the heap orders by (stamp, hash) as the dict index does: hashes as they were given
        heap = [(stamps[h], 0 if h == _ZERO else h, h) for h in keys if h not in num_children]
        heapq.heapify(heap)
        alive = len(keys)
        evicted: list[int] = []
        inherit: dict[int, int] = {}
        gone: set[int] = set()
        while alive > target and heap:
            stamp, _, h = heapq.heappop(heap)
            if h in gone:
                continue
            gone.add(h)
            evicted.append(slot_of[h])
            alive -= 1
            self.num_evicted += 1
            parent = parents.get(h)
            if parent is not None and parent in slot_of and parent not in gone:
                left = num_children[parent] - 1
                if left:
                    num_children[parent] = left
                    continue
                del num_children[parent]
                stamps[parent] = inherited = max(stamp, stamps[parent])
                inherit[slot_of[parent]] = inherited
                heapq.heappush(heap, (inherited, 0 if parent == _ZERO else parent, parent))
        if inherit:
            self._stamps[list(inherit)] = list(inherit.values())
        rows = np.array(evicted, dtype=np.intp)
        for w, counts in enumerate(self._bit_counts(self._masks[rows])):
            for b, c in enumerate(counts):
                if c:
                    self._num_blocks[64 * w + b] -= c
        self._masks[rows] = 0
        self._parents[rows] = 0
        self._stamps[rows] = 0
        self._live -= len(rows)
        self._peak = self._live
        self._compacted()
        self._maybe_shrink()

    @staticmethod
    def _bit_counts(rows: np.ndarray) -> list[list[int]]:
        """Per word, how many of ``rows`` have each of its 64 bits set."""
        if not len(rows):
            return [[0] * 64 for _ in range(rows.shape[1])]
        as_bytes = rows.astype("<u8").view(np.uint8).reshape(len(rows), -1, 8)
        bits = np.unpackbits(as_bytes, axis=2, bitorder="little").reshape(len(rows), -1, 64)
        return cast(list[list[int]], bits.sum(axis=0).tolist())

    def check_invariants(self) -> None:
        """Assert the internal invariants (for tests; O(size))."""
        live = self._live_slots()
        assert len(live) == self._live, (len(live), self._live)
        assert np.count_nonzero(self._keys) <= self._used <= self._cap // 2
        dead = np.flatnonzero(~self._masks.any(axis=1))
        assert not self._parents[dead].any() and not self._stamps[dead].any()
        assert len(set(self._keys[live].tolist())) == len(live), "a key stored twice"
        counts = {
            64 * w + b: c
            for w, per in enumerate(self._bit_counts(self._masks[live]))
            for b, c in enumerate(per)
            if c
        }
        assert counts == {s: c for s, c in self._num_blocks.items() if c}
        pred = self._predicted
        assert pred._until.keys() == pred._pred.keys()
