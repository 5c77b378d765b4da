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
per-block worker bitsets. ``find_matches`` runs no Python bytecode per block: C-level
``takewhile(map(dict.get))`` fetches the bitsets up to the first miss; when they are
non-increasing as sets (the normal case: a radix cache holds whole prefixes), they *are*
the running AND and ``list.count`` of each distinct value gives the depths; otherwise
``accumulate(and_)`` computes the running AND first. Workers are small ints (slots);
their sets are Python int bitsets.

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

Predicted entries (``router.core.predicted``): sparse, TTL-bound entries for blocks the router
expects a worker to hold because it just sent it a request. ``find_matches`` reports, per
worker, the longer of its confirmed and its predicted prefix; ``snapshot``, ``size`` and
``num_entries`` count confirmed (event-fed) entries only.

Size cap: past ``max_blocks`` confirmed blocks, the least recently matched leaves are evicted
(down to 15/16 of the cap, so the O(n) leaf scan is amortised). Recency is a tick stamped on
the deepest block of each match and on the last block of each stored event. A block that
becomes a leaf when its last child is evicted inherits the later of its own stamp and the
child's: a prefix matched often but never to its end keeps its own (recent) stamp and
outlives the cold tails below it.
"""

from __future__ import annotations

import bisect
import heapq
import sys
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from itertools import accumulate, repeat, takewhile
from operator import and_, is_not, neg
from typing import cast

from kvroute_proto.codec import PackedHashes
from kvroute_proto.events import BlockStored
from router.core.index_api import COMPACT_MIN, ERROR_KINDS, AppliesEvents, IndexConfig
from router.core.predicted import PredictedEntries, bits_of

__all__ = ["PrefixIndex"]

_INT_BYTES = 36  # sys.getsizeof of a 64-bit Python int


_is_not_none = partial(is_not, None)


def _depths(
    masks: list[int], slots_of: Callable[[int], Iterable[int]] = bits_of
) -> tuple[list[int], dict[int, int]]:
    """Per slot, how many leading ``masks`` (nonzero bitsets) contain it; and the running
    AND of ``masks`` (trimmed where it reaches 0). ``slots_of``: the slots of a bitset
    (a caching one saves the bit loop over wide sets)."""
    first = masks[0]
    n = len(masks)
    if masks.count(first) == n:  # one worker set all along: the common case
        return masks, dict.fromkeys(slots_of(first), n)
    if masks == sorted(masks, reverse=True):
        # non-increasing as ints, as every non-increasing sequence of sets is: each run of
        # equal values ends where bisect says; a slot leaves where the next value starts,
        # unless that value is not a subset (then the running AND is taken below)
        result: dict[int, int] = {}
        i = 0
        while i < n:
            value = masks[i]
            j = bisect.bisect_right(masks, -value, i, n, key=neg)
            nxt = masks[j] if j < n else 0
            if nxt & ~value:
                break
            result.update(dict.fromkeys(slots_of(value & ~nxt), j))
            i = j
        else:
            return masks, result
    # a worker holds a block without its parent: the running AND, up to where it reaches 0
    masks = list(takewhile(bool, accumulate(masks, and_)))
    return (masks, _depths(masks, slots_of)[1]) if masks else (masks, {})


class PrefixIndex(AppliesEvents):
    """Block hash -> set of worker slots, with predicted entries and a size cap.

    Worker slots are small non-negative ints (the router core maps worker ids to them and
    reuses freed slots). Not thread-safe.
    """

    takes_arrays = False  # queries as lists of Python ints (its dict lookups need them)
    prefers_wire = False  # a scanned batch's decoded events applied one by one are as fast

    def __init__(self, config: IndexConfig | None = None) -> None:
        self.config = config or IndexConfig()
        self._masks: dict[int, int] = {}  # block hash -> bitset of slots holding it
        # the event-confirmed depths of the last find_matches (before predictions lengthened
        # any): what the route decision reports as matched from events (metrics)
        self.last_confirmed: dict[int, int] = {}
        self._parents: dict[int, int] = {}  # block hash -> parent hash (non-roots)
        self._stamps: dict[int, int] = {}  # block hash -> recency tick (sparse)
        self._num_blocks: dict[int, int] = {}  # slot -> (block, slot) pairs
        self._bits: list[int] = []  # slot -> 1 << slot, shared int objects
        self._slots_cache: dict[int, tuple[int, ...]] = {}  # bitset -> its slots
        self._predicted = PredictedEntries(self.config.predict_stride)
        self._tick = 0
        self._peak = 0
        self.errors: Counter[str] = Counter(dict.fromkeys(ERROR_KINDS, 0))
        self.num_evicted = 0

    # ---- sizes ---------------------------------------------------------------------------

    def size(self) -> int:
        """Number of indexed (confirmed) blocks, whoever holds them."""
        return len(self._masks)

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
        """A rough estimate of the index's memory in bytes (metrics): the dict tables plus
        about 36 bytes per 64-bit int key or value they hold; predictions not counted."""
        n = len(self._masks) + len(self._parents) + len(self._stamps)
        tables = sys.getsizeof(self._masks) + sys.getsizeof(self._parents)
        return tables + sys.getsizeof(self._stamps) + n * 2 * _INT_BYTES

    def snapshot(self, slot: int) -> set[int]:
        """Block hashes confirmed (by events) to be held by ``slot``."""
        if not self._num_blocks.get(slot):
            return set()
        bit = self._bit(slot)
        return {h for h, m in self._masks.items() if m & bit}

    def predicted(self, slot: int) -> set[int]:
        """The (sparse) block hashes predicted for ``slot``."""
        return self._predicted.hashes_of(slot)

    # ---- matching ------------------------------------------------------------------------

    def find_matches(self, hashes: Sequence[int], touch: bool = True) -> dict[int, int]:
        """Matched prefix length in blocks per worker slot (slots matching 0 are absent).

        ``hashes`` are a query's block hashes from position 0 (Python ints; a list is
        fastest). A worker's length is the longer of its confirmed prefix and its predicted
        one (a multiple of the stride). With ``touch``, stamps the deepest confirmed match
        as recently used (for the size cap's LRU order).
        """
        masks = cast(list[int], list(takewhile(_is_not_none, map(self._masks.get, hashes))))
        uniform = True  # every worker of the walk has the same depth
        if masks:
            depth = len(masks)
            first = masks[0]
            if masks.count(first) == depth:  # one worker set all along: the common case
                result = dict.fromkeys(self._slots_of(first), depth)
            else:
                masks, result = _depths(masks, self._slots_of)  # masks: the running AND
                depth = len(masks)
                uniform = False
            if depth and touch:
                self._tick += 1
                self._stamps[hashes[depth - 1]] = self._tick
        else:
            depth = 0
            result = {}
        self.last_confirmed = result
        if len(self._predicted) and not (uniform and self._no_predicted_tail(hashes, depth)):
            predicted = self._predicted.match(hashes, masks)
            if predicted:
                result = dict(result)  # last_confirmed keeps the events' walk alone
                stride = self._predicted.stride
                get = result.get
                for slot, n in _depths(predicted)[1].items():
                    n *= stride
                    if n > get(slot, 0):
                        result[slot] = n
        return result

    def match_depth(self, slot: int, hashes: Sequence[int]) -> int:
        """One worker's matched prefix length in blocks: ``find_matches(hashes,
        touch=False).get(slot, 0)`` without walking the other workers' sets, touching
        nothing and leaving ``last_confirmed`` as it was (the router core reads a peer
        replica's pick there, on one worker)."""
        bit = self._bit(slot)
        depth = 0
        get = self._masks.get
        for h in hashes:
            if not get(h, 0) & bit:
                break
            depth += 1
        if len(self._predicted):
            depth = max(depth, self._predicted.depth_of(bit, hashes, depth))
        return depth

    def find_matches_by_source(
        self, hashes: Sequence[int]
    ) -> tuple[dict[int, int], dict[int, int]]:
        """Matched prefix length in blocks per worker slot, from each source apart:
        ``(confirmed, predicted)``. Confirmed: the walk over event-fed entries. Predicted:
        the walk over predicted entries alone (a multiple of the stride), not continuing a
        confirmed prefix. :meth:`find_matches`, which routing uses, reports per slot at
        least the larger of the two (more where a prediction continues a confirmed prefix).
        For explanations: touches nothing, and is slower than find_matches."""
        masks = cast(list[int], list(takewhile(_is_not_none, map(self._masks.get, hashes))))
        confirmed = _depths(masks, self._slots_of)[1] if masks else {}
        predicted: dict[int, int] = {}
        if len(self._predicted):
            walk = self._predicted.match(hashes, [])
            if walk:
                stride = self._predicted.stride
                predicted = {slot: n * stride for slot, n in _depths(walk)[1].items()}
        return confirmed, predicted

    def _no_predicted_tail(self, hashes: Sequence[int], depth: int) -> bool:
        """Whether no prediction can lengthen a match where every worker of the confirmed
        walk stops at ``depth``: the walkers would need the first probe past ``depth``
        predicted, any other worker the very first probe."""
        stride = self._predicted.stride
        has = self._predicted.has
        first = stride - 1
        after = depth // stride * stride + stride - 1
        n = len(hashes)
        return not (first < n and has(hashes[first])) and not (after < n and has(hashes[after]))

    def _slots_of(self, mask: int) -> tuple[int, ...]:
        cache = self._slots_cache
        slots = cache.get(mask)
        if slots is None:
            if len(cache) >= 4096:
                cache.clear()
            slots = cache[mask] = tuple(bits_of(mask))
        return slots

    # ---- predicted entries ---------------------------------------------------------------

    def predict(
        self,
        slot: int,
        hashes: Sequence[int],
        deadline: float,
        start: int = 0,
        hold: bool = False,
    ) -> Sequence[int]:
        """Predict that ``slot`` holds the prefix ``hashes`` until ``deadline``.

        ``start``: the worker's matched depth (from find_matches); the blocks before it are
        held or predicted already and are not re-entered (nor their deadlines extended).
        ``hold``: keep the entered blocks past ``deadline`` until :meth:`release_predicted`
        is called with the returned handle (router.core.predicted: holds).
        """
        return self._predicted.add(self._bit(slot), hashes, deadline, start, hold)

    def release_predicted(self, handle: Sequence[int], deadline: float) -> None:
        """End the hold :meth:`predict` returned ``handle`` for; the blocks then live until
        ``deadline``."""
        self._predicted.release(handle, deadline)

    def refresh_predicted(self, hashes: Sequence[int], deadline: float) -> None:
        """Extend the deadline of the predicted prefix ``hashes`` (approx mode's LRU)."""
        self._predicted.refresh(hashes, deadline)

    def expire(self, now: float) -> int:
        """Drop predictions whose deadline is <= ``now``; returns the blocks dropped."""
        return self._predicted.expire(now)

    # ---- events --------------------------------------------------------------------------

    def store(self, slot: int, event: BlockStored) -> None:
        """Index a stored chain for ``slot``."""
        hashes = event.block_hashes
        if type(hashes) is PackedHashes:  # decoded: its ints, for the dicts' C-level calls
            hashes = hashes.ints()
        if not hashes:
            return
        masks = self._masks
        bit = self._bit(slot)
        parent = event.parent_hash
        if parent is not None and not masks.get(parent, 0) & bit:
            self.errors["unknown_parent"] += 1
        if self.config.verify_hashes and not self._verify(event):
            return
        before = len(masks)
        if masks.keys().isdisjoint(hashes):  # all new: C-level bulk inserts
            masks.update(zip(hashes, repeat(bit)))
            added = len(masks) - before  # not len(hashes) if a hash repeats in the event
        else:
            added = self._store_slow(bit, hashes)
        self._parents.update(zip(hashes[1:], hashes, strict=False))  # (child, parent)
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

    def _store_slow(self, bit: int, hashes: Sequence[int]) -> int:
        masks = self._masks
        added = 0
        for h in hashes:
            m = masks.get(h)
            if m is None:
                masks[h] = bit
            elif not m & bit:
                masks[h] = m | bit
            else:
                continue
            added += 1
        return added

    def remove(self, slot: int, hashes: Sequence[int]) -> None:
        """Withdraw blocks from ``slot``; blocks nobody holds any more are deleted."""
        if type(hashes) is PackedHashes:
            hashes = cast(PackedHashes, hashes).ints()
        masks = self._masks
        bit = self._bit(slot)
        n = len(hashes)
        if list(map(masks.get, hashes)).count(bit) == n:  # held by this worker alone
            before = len(masks)
            deque(map(masks.pop, hashes, repeat(None)), 0)
            deque(map(self._parents.pop, hashes, repeat(None)), 0)
            deque(map(self._stamps.pop, hashes, repeat(None)), 0)
            removed = before - len(masks)
            if removed < n:  # a hash repeated within the event: the repeats are unknown
                self.errors["unknown_block"] += n - removed
        else:
            removed = self._remove_slow(bit, hashes)
        if removed:
            self._num_blocks[slot] -= removed
            self._maybe_compact()

    def _remove_slow(self, bit: int, hashes: Sequence[int]) -> int:
        masks = self._masks
        removed = 0
        for h in hashes:
            m = masks.get(h, 0)
            if not m & bit:
                self.errors["unknown_block"] += 1
                continue
            removed += 1
            m ^= bit
            if m:
                masks[h] = m
            else:
                self._delete_node(h)
        return removed

    def _delete_node(self, h: int) -> None:
        del self._masks[h]
        self._parents.pop(h, None)
        self._stamps.pop(h, None)

    def remove_worker(self, slot: int, predictions: bool = True) -> int:
        """Drop every confirmed entry of ``slot``, and its predictions unless
        ``predictions`` is False; returns the confirmed count."""
        bit = self._bit(slot)
        if predictions:
            self._predicted.remove_slot(bit)
        count = self._num_blocks.pop(slot, 0)
        if not count:
            return 0
        masks = {h: (m ^ bit if m & bit else m) for h, m in self._masks.items() if m != bit}
        self._masks = masks
        self._parents = {h: p for h, p in self._parents.items() if h in masks}
        self._stamps = {h: t for h, t in self._stamps.items() if h in masks}
        self._peak = len(masks)
        return count

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
        if (self._peak >= COMPACT_MIN and n * 4 <= self._peak) or (n == 0 and self._peak):
            self._masks = dict(self._masks)
            self._parents = dict(self._parents)
            self._stamps = dict(self._stamps)
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
            for s in bits_of(m):
                self._num_blocks[s] -= 1
            parent = parents.get(h)
            self._delete_node(h)
            self.num_evicted += 1
            if parent is not None and parent in masks:
                left = num_children[parent] - 1
                if left:
                    num_children[parent] = left
                    continue
                del num_children[parent]
                inherited = max(stamp, stamps.get(parent, 0))
                stamps[parent] = inherited  # kept for later rounds
                heapq.heappush(heap, (inherited, parent))
        self._peak = len(masks)
        self._maybe_compact()

    def check_invariants(self) -> None:
        """Assert the internal invariants (for tests; O(size))."""
        masks = self._masks
        assert all(masks.values()), "a node with no worker was kept"
        assert self._parents.keys() <= masks.keys() and self._stamps.keys() <= masks.keys()
        counts: Counter[int] = Counter()
        for m in masks.values():
            counts.update(bits_of(m))
        assert {s: c for s, c in counts.items() if c} == {
            s: c for s, c in self._num_blocks.items() if c
        }
        pred = self._predicted
        assert pred._until.keys() == pred._pred.keys()
