"""NumbaPrefixIndex: the router's prefix index in flat numpy tables walked by numba kernels.

Sans-I/O: imports neither asyncio, grpc, torch nor a clock. Same public interface and the
same answers as :class:`router.core.index.PrefixIndex` (the dict index, the reference
implementation: tests/router/test_index_nb.py drives both with Hypothesis-generated
histories and asserts they agree after every step). Only the storage differs::

    row = home(hash) = ((hash * ODD) >> 32) & (capacity - 1), then linear probing
    _tab[row, 0]      uint64  block hash (0 = empty row; a hash of 0 is stored as _ZERO)
    _tab[row, 1]      uint64  parent hash (0 = a root / not known)
    _tab[row, 2]      uint64  recency tick (LRU of the size cap; 0 = never stamped)
    _tab[row, 3 + w]  uint64  bit s % 64 of word w = s // 64: worker slot s holds the block

One row holds a block's key, parent, stamp and worker bitset words side by side, so a find
step touches one cache line. A row nobody holds any more keeps its key with all-zero words
(a dead row: a walk stops there as at a missing key; a store of that key makes it live again
with no parent or stamp, as a new row); rebuilds drop dead rows. The table is rebuilt when
its rows with a key, dead ones included, pass a load of 0.6 (growing, unless dropping the
dead rows makes room) and when its live rows fall under 1/16 (shrinking, so memory returns
after removals). Worker slots past 63 widen every row by a word (a 1,024-worker fleet pays 16
words a row).

Predicted entries (``router.core.predicted``'s semantics, in a table of their own)::

    _ptab[row] = [sparse block hash, holds, mark, bitset words...]   _until[row] float64

and expiry records (deadline, hash): in a FIFO while deadlines come in order (the core's
clock is monotonic), in a heap otherwise. Every deadline a prediction nobody holds gets
comes with a record (a release records what it frees at its latest deadline); a record due
at ``now`` drops its hash if that hash's latest deadline is <= now and no request holds it,
and is skipped otherwise (a later record or a release will come). That is the dict
version's rule: a prediction lapses once its latest deadline has passed and no hold keeps
it.

Where the code lives: router.core.index_nb_table (the layout, probing, the heap),
router.core.index_nb_confirmed and router.core.index_nb_predicted (the kernels on each
table), router.core.index_nb_walk (the walks of a query), router.core.index_capi (the
CPython C-API intrinsics of find_matches' fast path), router.core.index_nb_tables (the
arrays and their growth) and this module (the index on them).

The kernels are compiled on first use of the module in a process (``warm_up``, called by
the constructor) and cached on disk (numba ``cache=True``, next to their files, in
NUMBA_CACHE_DIR or in the user's cache directory: kvroute_proto.jit), so no route pays the
JIT; where no writable cache place exists, they are compiled at every start.

Why: a dict lookup of a 64-bit int key costs two or three dependent cache misses at a
million blocks, and each numpy call has a fixed cost of its own; a compiled walk of a
prompt's blocks over a flat table costs a few microseconds. find_matches' kernel keeps the
GIL and goes through CPython's C API at both ends (router.core.index_capi): it reads a list
query's ints as far as its walks go, and writes its answer into the dicts it returns (no
conversion of the whole list, no ``tolist`` and ``zip`` of the answer); ``capi=False``
takes the plain path instead, with the same answers. The other kernels release the GIL.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import cast

import numpy as np

from kvroute_proto import wire_nb
from kvroute_proto.codec import PackedHashes, decode_stream_message, encode_stream_message
from kvroute_proto.events import BlockRemoved, BlockStored, EventBatch
from router.core.index_api import COMPACT_MIN, ERROR_KINDS, AppliesEvents, IndexConfig
from router.core.index_nb_confirmed import (
    _NO_ROOM,
    _UNKNOWN_PARENT,
    _W_CLEAR,
    _W_DONE,
    _W_ERRORS,
    _W_EVICT,
    _W_GROW,
    _apply_wire,
    _drop_empty,
    _evict,
    _grow_in_place,
    _holds,
    _remove,
    _remove_slot_confirmed,
    _slot_rows,
    _store,
)
from router.core.index_nb_predicted import (
    _pred_add,
    _pred_expire,
    _pred_refresh,
    _pred_release,
    _pred_remove_slot,
    _pred_rows,
    _rehash_pred,
)
from router.core.index_nb_table import (
    _M_LIVE,
    _MASK,
    _NIL,
    _P_HEAD,
    _P_HEAP,
    _P_LIVE,
    _P_TAIL,
    _U64,
    _ZERO_INT,
)
from router.core.index_nb_tables import (
    _EMPTY_PROBES,
    _WIRE_NATIVE,
    NumbaTables,
    Probes,
    _as_keys,
    _is_u64,
)
from router.core.index_nb_walk import (
    _BAD_ITEM,
    _COUNT,
    _SAME,
    _find_arrays,
    _find_by_source,
    _find_dicts,
    _slot_depth,
)

__all__ = ["NumbaPrefixIndex", "Probes", "warm_up"]

_U64_DTYPE = np.dtype(_U64)  # a singleton: compared with ``is``

CAPI_DEFAULT = True
"""``NumbaPrefixIndex(capi=None)``'s path: find_matches through CPython's C API
(router.core.index_capi) or, False, the plain path (bench_index --no-capi sets it for an A/B
of the two)."""

# ---- Python side -------------------------------------------------------------------------


_warm = False


def warm_up() -> bool:
    """Compile (or load from numba's disk cache) every kernel with the argument types the
    index passes, and the router's compiled event decoding (kvroute_proto.wire_nb), once
    per process; True when this call did it."""
    global _warm
    if _warm:
        return False
    index = NumbaPrefixIndex(IndexConfig(max_blocks=3, predict_stride=2), _warm_up=False)
    for slot in (0, 1):
        index.store(slot, BlockStored((1, 2, 3), None, ()))
        index.store(slot, BlockStored((4, 5), 3, ()))
    index.find_matches([1, 2, 3, 4])
    index.find_matches(np.array([1, 2, 3, 4], dtype=_U64))
    index.find_matches(np.array([1, 2, 3, 4], dtype=_U64)[::2])  # a strided view
    index.find_matches_by_source([1, 2, 3])
    index._capi = False  # find_matches' plain path (router.core.index_capi's docstring)
    index.find_matches([1, 2, 3, 4])
    index.find_matches(np.array([1, 2, 3, 4], dtype=_U64)[::2])
    index._capi = True
    index.match_depth(0, np.array([1, 2, 3], dtype=_U64))  # a peer's pick (a copy)
    handle = index.predict(0, [1, 2, 3, 4], 1.0, 0, True)
    index.release_predicted(handle, 2.0)
    index.predict(1, [1, 2, 3, 4], 1.0)
    index.refresh_predicted([1, 2], 3.0)
    index.expire(5.0)
    index.remove(0, [1, 2, 3])
    index.snapshot(1)
    index.predicted(0)
    _ = index.num_predicted
    # decoded events' hashes (kvroute_proto.codec.PackedHashes): read-only arrays
    wire = decode_stream_message(
        encode_stream_message(
            EventBatch("w", 1, 1, 1, (BlockStored((5, 6), 4, (1, 2)), BlockRemoved((5, 6))))
        )
    )
    assert isinstance(wire, EventBatch)
    for event in wire.events:
        index.apply(1, event)
    index.store(2, BlockStored((7, 8), None, ()))  # past the cap: evicts
    # a plain batch applied from its scanned layout (kvroute_proto.codec.WireBatch)
    batch = EventBatch("w", 1, 1, 1, (BlockStored((9,), 8, (1,)), BlockRemoved((9,))))
    index.apply_wire(2, wire_nb.scan_batch(encode_stream_message(batch)))
    index.remove_worker(1)
    index.check_invariants()
    # the rebuilds a growing table runs
    _drop_empty(index._tab, np.zeros_like(index._tab))
    grown = np.zeros((2 * len(index._tab), index._tab.shape[1]), dtype=_U64)
    grown[: len(index._tab)] = index._tab
    _grow_in_place(grown, len(index._tab))
    wire_nb.warm_up()  # the router's compiled event decoding (codec.enable_compiled_decode)
    _rehash_pred(index._ptab, index._until, np.zeros_like(index._ptab), np.zeros_like(index._until))
    _warm = True
    return True


class NumbaPrefixIndex(NumbaTables, AppliesEvents):
    """Block hash -> set of worker slots in flat tables walked by numba kernels, with
    predicted entries and a size cap. Same interface and answers as
    :class:`router.core.index.PrefixIndex`; hashes may also be given as uint64 arrays (no
    conversion: fastest). Not thread-safe.

    Construction compiles the kernels once per process (or loads them from numba's disk
    cache): see :func:`warm_up`.
    """

    takes_arrays = True  # queries as uint64 arrays (the router core passes them unconverted)
    prefers_wire = True  # a plain scanned batch applied by a kernel, without event objects

    def __init__(
        self,
        config: IndexConfig | None = None,
        *,
        capi: bool | None = None,
        _warm_up: bool = True,
    ) -> None:
        """``capi``: find_matches through CPython's C API (router.core.index_capi: lists read
        as far as the walks go, the answer's dicts filled by the kernel); False: the plain
        path (the query converted by numpy, the dicts built from the kernel's answer rows).
        Same answers. None: :data:`CAPI_DEFAULT`."""
        if _warm_up:
            warm_up()
        self.config = config or IndexConfig()
        super().__init__(self.config.predict_stride, self.config.max_blocks)
        self._verify_on = self.config.verify_hashes
        self._capi = CAPI_DEFAULT if capi is None else capi
        # the event-confirmed depths of the last find_matches (before predictions lengthened
        # any), as router.core.index.PrefixIndex.last_confirmed
        self.last_confirmed: dict[int, int] = {}
        self.errors: Counter[str] = Counter(dict.fromkeys(ERROR_KINDS, 0))
        self.num_evicted = 0

    # ---- sizes ---------------------------------------------------------------------------

    def size(self) -> int:
        """Number of indexed (confirmed) blocks, whoever holds them."""
        return int(self._meta[_M_LIVE])

    @property
    def num_entries(self) -> int:
        """Number of confirmed (block, worker) pairs."""
        return int(self._counts.sum())

    @property
    def num_predicted(self) -> int:
        """Number of predicted (sparse block, worker) pairs."""
        return int(_pred_rows(self._ptab, -1)[0])

    def num_worker_blocks(self, slot: int) -> int:
        """Confirmed blocks of one worker."""
        return int(self._counts[slot]) if 0 <= slot < len(self._counts) else 0

    def approx_bytes(self) -> int:
        """Memory of the index's tables in bytes (metrics), predictions included."""
        arrays = (self._tab, self._counts, self._ptab, self._until, self._rd, self._rk)
        return sum(a.nbytes for a in arrays)

    def snapshot(self, slot: int) -> set[int]:
        """Block hashes confirmed (by events) to be held by ``slot``."""
        if not self.num_worker_blocks(slot):
            return set()
        bit = _U64(1 << (slot & 63))
        return self._out(_slot_rows(self._tab, _MASK + (slot >> 6), bit))

    def predicted(self, slot: int) -> set[int]:
        """The (sparse) block hashes predicted for ``slot``."""
        if slot < 0:
            raise ValueError(f"worker slot must be >= 0, got {slot}")
        return self._out(_pred_rows(self._ptab, slot))

    # ---- matching ------------------------------------------------------------------------

    def find_matches(
        self, hashes: Sequence[int] | np.ndarray, touch: bool = True
    ) -> dict[int, int]:
        """Matched prefix length in blocks per worker slot (slots matching 0 are absent),
        as :meth:`router.core.index.PrefixIndex.find_matches`. ``hashes``: a uint64 array is
        fastest; of a list the kernel reads the ints as far as the walks go (a few past
        where they stop: what lies beyond is never read, as in the dict index), and an
        item it reads that is no int in [0, 2**64) goes through numpy's conversion, which
        raises (OverflowError, TypeError, ValueError) or takes it (numpy ints)."""
        if not self._capi:
            return self._find_matches_plain(hashes, touch)
        src = 0
        if type(hashes) is np.ndarray and hashes.dtype is _U64_DTYPE and hashes.ndim == 1:
            keys = hashes  # the route's case: block_hashes' array (any stride: the kernel
            # takes a strided view as it is)
            n = len(keys)
        elif type(hashes) is list:  # Dynamo's convention: the kernel reads the ints as far
            # as the walks go (no conversion of the whole list first)
            n = len(hashes)
            src = id(hashes)  # CPython: the list's address; alive and unchanged for the call
        else:
            keys = _as_keys(hashes)
            n = len(keys)
        if n > self._run_fits:
            self._grow_run(n)
        if src:
            keys = self._keybuf
        confirmed: dict[int, int] = {}
        result: dict[int, int] = {}
        code = _find_dicts(
            self._tab,
            self._ptab,
            self._meta,
            keys,
            src,
            n,
            self._run,
            self._outbuf,
            self._stride,
            touch,
            id(confirmed),  # filled by the kernel (CPython: the address)
            id(result),
        )
        if code < 0:
            if code == _BAD_ITEM:  # an item it read is no uint64 int: numpy's conversion
                # raises (or takes numpy ints)
                return self.find_matches(np.array(hashes, dtype=_U64), touch)
            raise MemoryError("find_matches: no memory for the answer's dict")
        self.last_confirmed = confirmed
        return confirmed if code & _SAME else result

    def _find_matches_plain(
        self, hashes: Sequence[int] | np.ndarray, touch: bool
    ) -> dict[int, int]:
        """find_matches without the C API: the query converted by numpy first, the answer's
        dicts built from the kernel's answer rows. Same answers, errors and stamps: a
        list's items past where the walks stop are never read, and one the C-API path
        would take for no uint64 int goes through numpy's conversion of the whole list."""
        have = n = len(hashes)
        error: Exception | None = None
        if type(hashes) is np.ndarray and hashes.dtype is _U64_DTYPE and hashes.ndim == 1:
            keys = hashes
        elif type(hashes) is list:
            try:
                keys = _as_keys(hashes)
            except (OverflowError, TypeError, ValueError) as e:
                # the walks read the ints up to the first item that is none (as the C-API
                # path does); needing more, they raise numpy's error
                error = e
                have = next((i for i, h in enumerate(hashes) if not _is_u64(h)), n)
                keys = np.zeros(n, dtype=_U64)
                keys[:have] = hashes[:have]
        else:
            keys = _as_keys(hashes)
        if n > self._run_fits:
            self._grow_run(n)
        out = self._outbuf
        code = _find_arrays(
            self._tab, self._ptab, self._meta, keys, n, have, self._run, out, self._stride, touch
        )
        if code == _BAD_ITEM:
            assert error is not None
            raise error
        c = out[:2, : code & _COUNT].tolist()
        confirmed = dict(zip(c[0], c[1], strict=True))
        self.last_confirmed = confirmed
        if code & _SAME:
            return confirmed
        p = out[2:, : code >> 21 & _COUNT].tolist()
        return dict(zip(p[0], p[1], strict=True))

    def match_depth(self, slot: int, hashes: Sequence[int] | np.ndarray) -> int:
        """One worker's matched prefix length in blocks, as
        :meth:`router.core.index.PrefixIndex.match_depth`: ``find_matches(hashes,
        touch=False).get(slot, 0)``, reading one bit of each row it walks (no other slot's
        depth, no dict), touching nothing and leaving ``last_confirmed`` as it was."""
        if slot < 0:
            raise ValueError(f"worker slot must be >= 0, got {slot}")
        keys = _as_keys(hashes)
        if not len(keys):
            return 0
        return int(_slot_depth(self._tab, self._ptab, self._meta, keys, slot, self._stride))

    def find_matches_by_source(
        self, hashes: Sequence[int] | np.ndarray
    ) -> tuple[dict[int, int], dict[int, int]]:
        """``(confirmed, predicted)`` matched lengths, as
        :meth:`router.core.index.PrefixIndex.find_matches_by_source`. Touches nothing."""
        keys = _as_keys(hashes)
        run = self._run
        if len(keys) > self._run_fits:
            run = self._grow_run(len(keys))
        out = self._outbuf
        code = _find_by_source(self._tab, self._ptab, self._meta, keys, run, out, self._stride)
        c = out[:2, : code & _COUNT].tolist()
        p = out[2:, : code >> 21 & _COUNT].tolist()
        return dict(zip(c[0], c[1], strict=True)), dict(zip(p[0], p[1], strict=True))

    # ---- predicted entries ---------------------------------------------------------------

    def predict(
        self,
        slot: int,
        hashes: Sequence[int] | np.ndarray,
        deadline: float,
        start: int = 0,
        hold: bool = False,
    ) -> Sequence[int]:
        """Predict that ``slot`` holds the prefix ``hashes`` until ``deadline``, as
        :meth:`router.core.index.PrefixIndex.predict`. Returns the probes entered (a
        :class:`Probes`, the handle for :meth:`release_predicted`)."""
        stride = self._stride
        n = len(hashes) // stride
        if n <= start // stride:
            return _EMPTY_PROBES
        if isinstance(hashes, np.ndarray | Probes):
            keys = _as_keys(hashes)
        else:  # a list or another sequence: convert only the probes
            keys = _as_keys(hashes[stride - 1 :: stride][start // stride :])
            stride, start = 1, 0
        if not 0 <= slot < self._nslots:  # widen, or refuse a negative slot
            self._words_for(slot)
        self._pred_room(n)
        probes = _pred_add(
            self._ptab,
            self._until,
            self._meta,
            self._rd,
            self._rk,
            keys,
            stride,
            start,
            slot,
            float(deadline),
            hold,
        )
        return Probes(probes)

    def release_predicted(self, handle: Sequence[int], deadline: float) -> None:
        """End the hold :meth:`predict` returned ``handle`` for; the probes then live until
        ``deadline``."""
        if not len(handle):
            return
        keys = _as_keys(handle)
        self._pred_room(len(keys))
        _pred_release(
            self._ptab, self._until, self._meta, self._rd, self._rk, keys, float(deadline)
        )

    def refresh_predicted(self, hashes: Sequence[int] | np.ndarray, deadline: float) -> None:
        """Extend the deadline of the predicted prefix ``hashes`` (approx mode's LRU)."""
        if not self._meta[_P_LIVE]:
            return
        keys = _as_keys(hashes)
        self._pred_room(len(keys) // self._stride)
        _pred_refresh(
            self._ptab,
            self._until,
            self._meta,
            self._rd,
            self._rk,
            keys,
            self._stride,
            float(deadline),
        )

    def expire(self, now: float) -> int:
        """Drop predictions whose deadline is <= ``now``; returns the blocks dropped."""
        meta = self._meta
        if not meta[_P_HEAP] and meta[_P_HEAD] == meta[_P_TAIL]:
            return 0
        return int(
            _pred_expire(self._ptab, self._until, self._meta, self._rd, self._rk, float(now))
        )

    # ---- events --------------------------------------------------------------------------

    def store(self, slot: int, event: BlockStored) -> None:
        """Index a stored chain for ``slot``."""
        hashes = event.block_hashes
        keys: np.ndarray | None = None
        if type(hashes) is PackedHashes and _WIRE_NATIVE:  # decoded events: the array
            keys = cast(PackedHashes, hashes).array
            if not len(keys):
                return
        elif not hashes:
            return
        if not 0 <= slot < self._nslots:  # widen, or refuse a negative slot
            self._words_for(slot)
        parent = event.parent_hash
        verify = self._verify_on
        if verify:  # counted before the chain is checked, as the dict index counts it
            if parent is not None and not _holds(self._tab, _U64(parent), slot):
                self.errors["unknown_parent"] += 1
            if not self._verify(event):
                return
        if keys is None:
            keys = _as_keys(hashes)
        # the parent as stored (0: none; a hash of 0 maps as the kernels map it)
        stored_parent = _NIL if parent is None else _U64(parent or _ZERO_INT)
        code = _store(self._tab, self._meta, self._counts, keys, stored_parent, slot)
        if code == _NO_ROOM:
            self._room(len(keys))
            code = _store(self._tab, self._meta, self._counts, keys, stored_parent, slot)
        if code >= _UNKNOWN_PARENT:
            code -= _UNKNOWN_PARENT
            if not verify:
                self.errors["unknown_parent"] += 1
        if code:
            live = self._meta.item(_M_LIVE)
            if live > self._peak:
                self._peak = live
                if live > self.config.max_blocks:
                    self._evict()

    def remove(self, slot: int, hashes: Sequence[int] | np.ndarray) -> None:
        """Withdraw blocks from ``slot``; blocks nobody holds any more are deleted."""
        if slot < 0:
            raise ValueError(f"worker slot must be >= 0, got {slot}")
        keys: np.ndarray | None = None
        if type(hashes) is PackedHashes and _WIRE_NATIVE:  # decoded events: the array
            keys = cast(PackedHashes, hashes).array
            n = len(keys)
        else:
            n = len(hashes)
        if not n:
            return
        if slot >= len(self._counts):
            self.errors["unknown_block"] += n
            return
        if keys is None:
            keys = _as_keys(hashes)
        removed = _remove(self._tab, self._meta, self._counts, keys, slot)
        if removed < n:
            self.errors["unknown_block"] += n - removed
        if removed:
            # what _maybe_compact acts on implies one of these (checked here first: it
            # is called after every removal)
            live = self._meta.item(_M_LIVE)
            if live * 4 <= self._peak or live * 16 < self._tab.shape[0]:
                self._maybe_compact()

    def apply_wire(self, slot: int, layout: np.ndarray) -> None:
        """Apply a plain scanned batch's events (kvroute_proto.codec.WireBatch.layout:
        default partitions, token ids of the right length) for ``slot``, in order, as
        ``apply`` applies its decoded events one by one -- the same entries, the same
        errors -- without building them. Not with ``verify_hashes`` (the chain is then
        checked against the tokens: apply the events)."""
        if self._verify_on:
            raise ValueError("apply_wire does not verify hashes: apply the events")
        if not 0 <= slot < self._nslots:  # widen, or refuse a negative slot
            self._words_for(slot)
        st = self._wire_state  # the peak and max_blocks live there (see _apply_wire)
        e, why = _apply_wire(self._tab, self._meta, self._counts, layout, 0, slot, st)
        while why:  # the common batch is one call that stops at _W_DONE
            if why & _W_ERRORS:
                self.errors["unknown_parent"] += int(st[2])
                self.errors["unknown_block"] += int(st[3])
                st[2] = st[3] = 0
                why ^= _W_ERRORS
                if why == _W_DONE:
                    break
            if why == _W_GROW:
                self._room(int(st[4]))
            elif why == _W_CLEAR:
                self.remove_worker(slot)
                e += 1
            elif why == _W_EVICT:
                self._evict()
            else:
                self._maybe_compact()
            e, why = _apply_wire(self._tab, self._meta, self._counts, layout, e, slot, st)

    def remove_worker(self, slot: int, predictions: bool = True) -> int:
        """Drop every confirmed entry of ``slot``, and its predictions unless
        ``predictions`` is False; returns the confirmed count."""
        if slot < 0:
            raise ValueError(f"worker slot must be >= 0, got {slot}")
        if predictions:
            _pred_remove_slot(self._ptab, self._until, self._meta, slot)
        count = self.num_worker_blocks(slot)
        if not count:
            return 0
        _remove_slot_confirmed(self._tab, self._meta, slot)
        self._counts[slot] = 0
        self._rebuild()
        self._peak = self.size()
        return count

    def _maybe_compact(self) -> None:
        """The dict index's compaction rule (its peak resets; it is the eviction trigger),
        and the table shrinks once a sixteenth full."""
        n = self.size()
        if (self._peak >= COMPACT_MIN and n * 4 <= self._peak) or (n == 0 and self._peak):
            self._peak = n
        self._maybe_shrink()

    def _evict(self) -> None:
        """Evict least recently matched leaves down to 15/16 of ``max_blocks``."""
        target = self.config.max_blocks - self.config.max_blocks // 16
        self.num_evicted += int(_evict(self._tab, self._meta, self._counts, target))
        self._rebuild()
        self._peak = self.size()
        self._maybe_compact()

    def check_invariants(self) -> None:
        """Assert the internal invariants (for tests; O(size))."""
        self._check_tables()
