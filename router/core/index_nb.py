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

The kernels are compiled on first use of the module in a process (``warm_up``, called by
the constructor) and cached on disk (numba ``cache=True``, next to this file, in
NUMBA_CACHE_DIR or in the user's cache directory), so no route pays the JIT: the first
index of a process costs ~0.3 s loading them from the cache, ~13 s compiling them where
none is (this 2-core box; without any writable cache place, at every start).

Why: a dict lookup of a 64-bit int key costs two or three dependent cache misses, about
80 ns each at a million blocks, and numpy calls cost ~1 us each; a compiled walk of a
prompt's 512 blocks over a flat table costs a few microseconds. find_matches' kernel
(_find_dicts) keeps the GIL and goes through CPython's C API at both ends: it reads a list
query's ints as far as its walks go, and writes its answer into the dicts it returns (no
conversion of the whole list, no ``tolist`` and ``zip`` of the answer: ~1 and ~1.5 µs of a
few-µs find). The other kernels release the GIL.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any, cast, overload

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from kvroute_proto import wire_nb
from kvroute_proto.codec import PackedHashes, decode_stream_message, encode_stream_message
from kvroute_proto.events import BlockRemoved, BlockStored, EventBatch
from router.core.index import _COMPACT_MIN, ERROR_KINDS, AppliesEvents, IndexConfig

__all__ = ["NumbaPrefixIndex", "warm_up"]

_U64 = np.uint64
_U64_DTYPE = np.dtype(_U64)  # a singleton: compared with ``is``
_MULT = np.uint64(0x9E3779B97F4A7C15)
_ZERO_INT = 0x5851F42D4C957F2D  # a block hash of 0 is stored as this (0 marks an empty row)
_ZERO = np.uint64(_ZERO_INT)
_ONE = np.uint64(1)
_NIL = np.uint64(0)
_S32 = np.uint64(32)
_ALL = np.uint64(0xFFFFFFFFFFFFFFFF)

_KEY, _PAR, _STAMP, _MASK = 0, 1, 2, 3  # confirmed table columns
_PHELD, _PMARK, _PBITS = 1, 2, 3  # predicted table columns (0: key)
# _meta: confirmed rows, LRU tick; predicted rows, rows predicting someone, records' heap
# size, a mark for deduplicating within a call, records' FIFO head and tail
_M_LIVE, _M_TICK = 0, 1
_P_ROWS, _P_LIVE, _P_HEAP, _P_MARK, _P_HEAD, _P_TAIL = 2, 3, 4, 5, 6, 7
_M_USED = 8  # confirmed rows with a key: the live ones and those nobody holds any more
_MIN_CAP = 1 << 10
_MIN_RECORDS = 1 << 10
_GROW_LOAD = 0.6  # a table grows past this load
_RESIZE_LOAD = 0.45  # and is rebuilt at most this full


def _jit(fn: Any) -> Any:
    """numba.njit, cached on disk where numba finds a writable place (next to this file,
    NUMBA_CACHE_DIR or the user's cache directory); else compiled at each process's first
    index (a read-only install run by a user without a home: set NUMBA_CACHE_DIR)."""
    global CACHED
    try:
        return numba.njit(cache=True, nogil=True)(fn)
    except RuntimeError:  # numba: "cannot cache function ...: no locator available"
        CACHED = False
        return numba.njit(nogil=True)(fn)


def _jit_inline(fn: Any) -> Any:
    """A kernel body inlined into each kernel calling it (numba IR level): _walk, shared by
    _find_dicts (under the GIL) and _find_by_source (without it)."""
    return numba.njit(inline="always")(fn)


def _jit_gil(fn: Any) -> Any:
    """_jit for a kernel that keeps the GIL (it reads Python objects: _list_u64)."""
    global CACHED
    try:
        return numba.njit(cache=True)(fn)
    except RuntimeError:
        CACHED = False
        return numba.njit()(fn)


CACHED = True
"""Whether the kernels are cached on disk (see _jit)."""


# ---- hashing of keys, rows ---------------------------------------------------------------


@_jit
def _key(h: Any) -> Any:
    return _ZERO if h == _NIL else h


@_jit
def _unkey(k: Any) -> Any:
    return _NIL if k == _ZERO else k


@_jit
def _held(tab: Any, r: int, base: int) -> bool:
    """Whether row ``r`` has any bit set in its worker words (columns ``base`` ..)."""
    for c in range(base, tab.shape[1]):  # noqa: SIM110 (a loop numba compiles)
        if tab[r, c] != _NIL:
            return True
    return False


@_jit
def _home(k: Any, mask: int) -> int:
    return int((k * _MULT) >> _S32) & mask


@_jit
def _find(tab: Any, k: Any) -> int:
    """Row of key ``k`` (already mapped), or -(empty row + 1) where absent."""
    mask = tab.shape[0] - 1
    i = _home(k, mask)
    while True:
        kk = tab[i, 0]
        if kk == k:
            return i
        if kk == _NIL:
            return -(i + 1)
        i = (i + 1) & mask


@_jit
def _delete_pred(tab: Any, until: Any, i: int) -> None:
    """As _delete, moving the deadlines along."""
    mask = tab.shape[0] - 1
    ncol = tab.shape[1]
    j = i
    while True:
        j = (j + 1) & mask
        k = tab[j, 0]
        if k == _NIL:
            break
        h = _home(k, mask)
        if ((j - h) & mask) >= ((j - i) & mask):
            for c in range(ncol):
                tab[i, c] = tab[j, c]
            until[i] = until[j]
            i = j
    for c in range(ncol):
        tab[i, c] = _NIL
    until[i] = 0.0


@_jit
def _rehash_pred(old: Any, old_until: Any, new: Any, new_until: Any) -> int:
    n = 0
    wcol = min(old.shape[1], new.shape[1])
    for r in range(old.shape[0]):
        k = old[r, 0]
        if k == _NIL:
            continue
        i = -_find(new, k) - 1
        for c in range(wcol):
            new[i, c] = old[r, c]
        new_until[i] = old_until[r]
        n += 1
    return n


@_jit
def _popcount(x: Any) -> int:
    x = x - ((x >> np.uint64(1)) & np.uint64(0x5555555555555555))
    x = (x & np.uint64(0x3333333333333333)) + ((x >> np.uint64(2)) & np.uint64(0x3333333333333333))
    x = (x + (x >> np.uint64(4))) & np.uint64(0x0F0F0F0F0F0F0F0F)
    return int((x * np.uint64(0x0101010101010101)) >> np.uint64(56))


@_jit
def _bit(slot: int) -> Any:
    return _ONE << np.uint64(slot & 63)


def _prefetch_typed(typingctx: Any, tab: Any, row: Any) -> Any:
    """Ask the CPU to bring row ``row`` of the 2-d table ``tab`` into cache (llvm.prefetch:
    a hint; no fault, no value, nothing waits for it)."""
    sig = types.void(tab, row)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        zero = context.get_constant(types.intp, 0)
        ptr = cgutils.get_item_pointer2(
            context,
            builder,
            ary.data,
            cgutils.unpack_tuple(builder, ary.shape),
            cgutils.unpack_tuple(builder, ary.strides),
            aryty.layout,
            [args[1], zero],
        )
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        # write intent, high locality, data cache
        builder.call(fn, [builder.bitcast(ptr, i8p), i32(1), i32(3), i32(1)])
        return context.get_dummy_value()

    return sig, codegen


_prefetch: Any = intrinsic(_prefetch_typed)  # _prefetch(tab, row) in a kernel
_AHEAD = 8  # keys whose home row is prefetched ahead of the walk


def _list_u64_typed(typingctx: Any, src: Any, i: Any) -> Any:
    """Item ``i`` of the Python list at address ``src`` as a uint64, through CPython's C
    API (PyList_GetItem, PyLong_AsUnsignedLongLong): all ones with a Python error set when
    the item is missing, not an int or out of range (see _take_error). Only in a kernel
    that holds the GIL (_jit_gil), with the list alive and unchanged for the call."""
    sig = types.uint64(types.int64, types.int64)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        pyapi = context.get_python_api(builder)
        item = pyapi.list_getitem(builder.inttoptr(args[0], pyapi.pyobj), args[1])
        out = cgutils.alloca_once_value(builder, ir.Constant(ir.IntType(64), -1))
        with builder.if_then(cgutils.is_not_null(builder, item), likely=True):
            builder.store(pyapi.long_as_ulonglong(item), out)
        return builder.load(out)

    return sig, codegen


def _take_error_typed(typingctx: Any) -> Any:
    """Whether a Python error is set; clears it (the caller reports the failure)."""
    sig = types.boolean()

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        pyapi = context.get_python_api(builder)
        has = cgutils.is_not_null(builder, pyapi.err_occurred())
        with builder.if_then(has):
            pyapi.err_clear()
        return has

    return sig, codegen


def _dict_put_typed(typingctx: Any, d: Any, key: Any, value: Any) -> Any:
    """``d[key] = value`` on the Python dict at address ``d``, both ints (PyDict_SetItem):
    0, or -1 with a Python error set (no memory). Only under the GIL (_jit_gil)."""
    sig = types.int32(types.int64, types.int64, types.int64)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        pyapi = context.get_python_api(builder)
        status = cgutils.alloca_once_value(builder, ir.Constant(ir.IntType(32), -1))
        k = pyapi.long_from_longlong(args[1])
        with builder.if_then(cgutils.is_not_null(builder, k), likely=True):
            v = pyapi.long_from_longlong(args[2])
            with builder.if_then(cgutils.is_not_null(builder, v), likely=True):
                target = builder.inttoptr(args[0], pyapi.pyobj)
                builder.store(pyapi.dict_setitem(target, k, v), status)
                pyapi.decref(v)
            pyapi.decref(k)
        return builder.load(status)

    return sig, codegen


_list_u64: Any = intrinsic(_list_u64_typed)
_take_error: Any = intrinsic(_take_error_typed)
_dict_put: Any = intrinsic(_dict_put_typed)


# ---- confirmed entries -------------------------------------------------------------------


@_jit
def _holds(tab: Any, h: Any, slot: int) -> bool:
    r = _find(tab, _key(h))
    return r >= 0 and (tab[r, _MASK + (slot >> 6)] & _bit(slot)) != _NIL


_NO_ROOM = -1  # _store's answer when the table must grow first
_UNKNOWN_PARENT = 1 << 40  # _store's answer: the parent was given but not held


@_jit
def _store(tab: Any, meta: Any, counts: Any, keys: Any, parent: Any, slot: int) -> int:
    """Index ``keys`` (raw hashes) for ``slot``: OR its bit in (new rows as needed), link
    each key to the previous one and the first to ``parent`` (0 = none), stamp the last.
    Returns the (block, slot) pairs added, plus _UNKNOWN_PARENT when ``parent`` was given
    but not held by ``slot`` before; or _NO_ROOM, changing nothing, when ``keys`` could
    take the table past its load of 0.6 (the caller grows it and calls again)."""
    if (meta[_M_USED] + keys.shape[0]) * 5 > tab.shape[0] * 3:
        return _NO_ROOM
    col = _MASK + (slot >> 6)
    bit = _bit(slot)
    unknown = False
    if parent != _NIL:
        pr = _find(tab, parent)
        unknown = pr < 0 or (tab[pr, col] & bit) == _NIL
    added = 0
    n = keys.shape[0]
    prev = _NIL
    r = 0
    first = 0
    mask = tab.shape[0] - 1
    for i in range(min(n, _AHEAD)):
        _prefetch(tab, _home(_key(keys[i]), mask))
    for i in range(n):
        if i + _AHEAD < n:
            _prefetch(tab, _home(_key(keys[i + _AHEAD]), mask))
        k = _key(keys[i])
        r = _find(tab, k)
        m = _NIL
        if r < 0:
            r = -r - 1
            tab[r, 0] = k
            meta[_M_LIVE] += 1
            meta[_M_USED] += 1
        else:
            m = tab[r, col]
            if m == _NIL and not _held(tab, r, _MASK):  # a dead row: live again, as new
                tab[r, _PAR] = _NIL
                tab[r, _STAMP] = _NIL
                meta[_M_LIVE] += 1
        if i == 0:
            first = r
        if (m & bit) == _NIL:
            tab[r, col] = m | bit
            added += 1
        if i > 0:
            tab[r, _PAR] = prev
        prev = k
    if parent != _NIL:
        tab[first, _PAR] = parent
    meta[_M_TICK] += 1
    tab[r, _STAMP] = np.uint64(meta[_M_TICK])
    counts[slot] += added
    return added | _UNKNOWN_PARENT if unknown else added


@_jit
def _remove(tab: Any, meta: Any, counts: Any, keys: Any, slot: int) -> int:
    """Withdraw ``keys`` from ``slot``; rows nobody holds any more stay as dead rows (their
    key, all-zero words) until a rebuild drops them -- deleting in place (a backward shift
    of the probe run) cost as much again as the lookups. Returns the pairs removed (the
    rest of ``keys`` were unknown)."""
    col = _MASK + (slot >> 6)
    bit = _bit(slot)
    removed = 0
    n = keys.shape[0]
    mask = tab.shape[0] - 1
    for i in range(min(n, _AHEAD)):
        _prefetch(tab, _home(_key(keys[i]), mask))
    for i in range(n):
        if i + _AHEAD < n:
            _prefetch(tab, _home(_key(keys[i + _AHEAD]), mask))
        r = _find(tab, _key(keys[i]))
        if r < 0:
            continue
        m = tab[r, col]
        if (m & bit) == _NIL:
            continue
        removed += 1
        m ^= bit
        tab[r, col] = m
        if m == _NIL and not _held(tab, r, _MASK):
            meta[_M_LIVE] -= 1
    counts[slot] -= removed
    return removed


_W_DONE, _W_GROW, _W_CLEAR, _W_EVICT, _W_COMPACT = 0, 1, 2, 3, 4  # _apply_wire's stops
_W_ERRORS = 8  # or'ed into any of them: errors were counted (in its state's [2], [3])


@_jit
def _apply_wire(
    tab: Any, meta: Any, counts: Any, out: Any, e: int, slot: int, st: Any
) -> tuple[int, int]:
    """Apply events ``e``, ``e + 1``, ... of a scanned batch (kvroute_proto.wire_nb's layout
    in ``out``) for ``slot`` as PrefixIndexNB.store / remove would, one by one, until one
    needs the Python side: returns (the event to go on with, why it stopped). ``st``
    (int64): [0] the peak size (the index's own: updated as store does), [1] max_blocks,
    [2] / [3] unknown_parent / unknown_block errors counted here (added to; the caller
    takes them when the answer has _W_ERRORS), [4] the keys a store that found no room
    wanted (_W_GROW: the same event again after the table grew). _W_CLEAR: event ``e`` is
    a clear (remove_worker, then ``e + 1``); _W_EVICT / _W_COMPACT: the event before the
    one returned needs the eviction / the compaction check. Any stop has _W_ERRORS set
    when this call counted an error."""
    n = int(out[12])
    err = 0
    while e < n:
        base = 16 + 12 * e
        kind = out[base]
        if kind == np.uint64(3):
            return e, _W_CLEAR | err
        start = int(out[base + 1])
        size = int(out[base + 2])
        keys = out[start : start + size]
        if kind == np.uint64(1):
            parent = _NIL
            if out[base + 3] != _NIL:
                parent = _key(out[base + 4])
            code = _store(tab, meta, counts, keys, parent, slot)
            if code == _NO_ROOM:
                st[4] = size
                return e, _W_GROW | err
            if code >= _UNKNOWN_PARENT:
                code -= _UNKNOWN_PARENT
                st[2] += 1
                err = _W_ERRORS
            e += 1
            if code:
                live = meta[_M_LIVE]
                if live > st[0]:
                    st[0] = live
                    if live > st[1]:
                        return e, _W_EVICT | err
        else:
            removed = _remove(tab, meta, counts, keys, slot)
            if removed < size:
                st[3] += size - removed
                err = _W_ERRORS
            e += 1
            if removed:
                live = meta[_M_LIVE]
                if live * 4 <= st[0] or live * 16 < tab.shape[0]:
                    return e, _W_COMPACT | err
    return e, _W_DONE | err


@_jit
def _remove_slot_confirmed(tab: Any, meta: Any, slot: int) -> None:
    """Clear ``slot``'s bit everywhere; emptied rows keep their key with all-zero words
    until the caller's rebuild drops them."""
    col = _MASK + (slot >> 6)
    bit = _bit(slot)
    for r in range(tab.shape[0]):
        if tab[r, 0] == _NIL or (tab[r, col] & bit) == _NIL:
            continue
        tab[r, col] ^= bit
        if not _held(tab, r, _MASK):
            meta[_M_LIVE] -= 1


_CHUNK = 2048  # rows _drop_empty sorts out at a time


@_jit
def _drop_empty(old: Any, new: Any) -> int:
    """Copy the rows of ``old`` with some worker bit into ``new``. Chunk by chunk: first
    the rows to copy are listed without a branch (whether a row is empty, dead or live is
    random: a branch on it mispredicts about as often as not, which cost more than the
    copying), then copied."""
    cap = old.shape[0]
    cols = old.shape[1]
    rows = np.empty(_CHUNK, dtype=np.int64)
    n = 0
    for start in range(0, cap, _CHUNK):
        m = 0
        for r in range(start, min(start + _CHUNK, cap)):
            bits = old[r, _MASK]
            for c in range(_MASK + 1, cols):
                bits |= old[r, c]
            rows[m] = r
            m += int(bits != _NIL)  # a row with a worker bit has a key
        for j in range(m):
            r = rows[j]
            i = -_find(new, old[r, 0]) - 1
            for c in range(cols):
                new[i, c] = old[r, c]
        n += m
    return n


@_jit
def _grow_in_place(tab: Any, old_cap: int) -> int:
    """Re-place the rows of a table grown in place: its first ``old_cap`` rows hold a table
    of that size, the rows after them are zero. Rows without a worker bit are dropped.
    Returns the rows kept.

    A row's home in the larger table is its old home plus a multiple of ``old_cap`` (the
    same low bits), so rows either stay in the old part, at or before where they were, or
    move to the new part, which holds only rows already placed. Taking the old rows in
    order from just after an empty one (each probe run from its start), a row never lands
    past a row still to be taken, so no lookup finds a gap later -- except a probe that
    wraps past the table's end into the old part: those rows wait and are placed last."""
    cap = tab.shape[0]
    cols = tab.shape[1]
    e = 0
    while tab[e, 0] != _NIL:  # an empty row (the table is at most 0.6 full)
        e += 1
    rows = np.empty(_CHUNK, dtype=np.int64)
    row = np.empty(cols, dtype=np.uint64)
    side = np.empty((16, cols), dtype=np.uint64)
    nside = 0
    kept = 0
    for start in range(1, old_cap + 1, _CHUNK):
        m = 0
        for j in range(start, min(start + _CHUNK, old_cap + 1)):  # listed without a branch
            p = e + j
            if p >= old_cap:
                p -= old_cap
            rows[m] = p
            m += int(tab[p, 0] != _NIL)
        for j in range(m):
            p = rows[j]
            k = tab[p, 0]
            bits = _NIL
            for c in range(cols):
                row[c] = tab[p, c]
                tab[p, c] = _NIL
                if c >= _MASK:
                    bits |= row[c]
            if bits == _NIL:  # nobody holds it: dropped
                continue
            kept += 1
            i = _home(k, cap - 1)
            while i < cap and tab[i, 0] != _NIL:
                i += 1
            if i == cap:  # would wrap into rows still to be taken: placed last
                if nside == side.shape[0]:
                    more = np.empty((2 * nside, cols), dtype=np.uint64)
                    more[:nside] = side
                    side = more
                side[nside] = row
                nside += 1
                continue
            for c in range(cols):
                tab[i, c] = row[c]
    for j in range(nside):
        i = -_find(tab, side[j, 0]) - 1
        for c in range(cols):
            tab[i, c] = side[j, c]
    return kept


@_jit
def _heap_push(prim: Any, sec: Any, size: int, p: Any, s: Any) -> int:
    i = size
    prim[i] = p
    sec[i] = s
    while i > 0:
        up = (i - 1) >> 1
        if prim[up] < prim[i] or (prim[up] == prim[i] and sec[up] <= sec[i]):
            break
        prim[up], prim[i] = prim[i], prim[up]
        sec[up], sec[i] = sec[i], sec[up]
        i = up
    return size + 1


@_jit
def _heap_pop(prim: Any, sec: Any, size: int) -> int:
    """Remove the smallest (prim, sec) (read it at [0] first); returns the new size."""
    size -= 1
    prim[0] = prim[size]
    sec[0] = sec[size]
    i = 0
    while True:
        a = 2 * i + 1
        if a >= size:
            break
        b = a + 1
        c = a
        if b < size and (prim[b] < prim[a] or (prim[b] == prim[a] and sec[b] < sec[a])):
            c = b
        if prim[i] < prim[c] or (prim[i] == prim[c] and sec[i] <= sec[c]):
            break
        prim[c], prim[i] = prim[i], prim[c]
        sec[c], sec[i] = sec[i], sec[c]
        i = c
    return size


@_jit
def _evict(tab: Any, meta: Any, counts: Any, target: int) -> int:
    """Evict least recently stamped leaves (a parent becoming a leaf inherits the later of
    its own and its last child's stamp) until ``target`` rows are live; the dict index's
    order: (stamp, hash) ascending. Evicted rows keep their key with all-zero words (the
    caller rebuilds the table). Returns the rows evicted."""
    cap = tab.shape[0]
    words = tab.shape[1] - _MASK
    children = np.zeros(cap, dtype=np.int64)
    for r in range(cap):  # dead rows (no holder) are neither children nor leaves
        if tab[r, 0] != _NIL and tab[r, _PAR] != _NIL and _held(tab, r, _MASK):
            pr = _find(tab, tab[r, _PAR])
            if pr >= 0:
                children[pr] += 1
    live = meta[_M_LIVE]
    stamps = np.empty(live + 1, dtype=np.uint64)
    hashes = np.empty(live + 1, dtype=np.uint64)
    size = 0
    for r in range(cap):
        if tab[r, 0] != _NIL and children[r] == 0 and _held(tab, r, _MASK):
            size = _heap_push(stamps, hashes, size, tab[r, _STAMP], _unkey(tab[r, 0]))
    evicted = 0
    while live > target and size > 0:
        stamp = stamps[0]
        r = _find(tab, _key(hashes[0]))
        size = _heap_pop(stamps, hashes, size)
        if r < 0:
            continue
        dead = True
        for w in range(words):
            m = tab[r, _MASK + w]
            if m != _NIL:
                dead = False
            while m != _NIL:
                low = m & (~m + _ONE)
                counts[64 * w + _popcount(low - _ONE)] -= 1
                m ^= low
        if dead:
            continue
        for w in range(words):
            tab[r, _MASK + w] = _NIL
        live -= 1
        evicted += 1
        parent = tab[r, _PAR]
        if parent == _NIL:
            continue
        pr = _find(tab, parent)
        if pr < 0:
            continue
        if not _held(tab, pr, _MASK):
            continue
        children[pr] -= 1
        if children[pr]:
            continue
        inherited = max(stamp, tab[pr, _STAMP])
        tab[pr, _STAMP] = inherited
        size = _heap_push(stamps, hashes, size, inherited, _unkey(parent))
    meta[_M_LIVE] = live
    return evicted


@_jit
def _depths_of(run: Any, off: int, n: int, out: Any, row: int) -> int:
    """Per slot of the running AND ``run[off:off + n]`` (rows non-increasing as sets), the
    depth at which it leaves: slots to ``out[row]``, depths to ``out[row + 1]``; returns
    how many slots were written."""
    words = run.shape[1]
    k = 0
    for i in range(n):
        last = i == n - 1
        change = last
        if not last:
            for w in range(words):
                if run[off + i, w] != run[off + i + 1, w]:
                    change = True
                    break
        if not change:
            continue
        for w in range(words):
            m = run[off + i, w] if last else run[off + i, w] & ~run[off + i + 1, w]
            while m != _NIL:
                low = m & (~m + _ONE)
                out[row, k] = 64 * w + _popcount(low - _ONE)
                out[row + 1, k] = i + 1
                k += 1
                m ^= low
    return k


_SAME = 1 << 42  # _walk's answer: the result is the confirmed walk's
_COUNT = (1 << 21) - 1
_BAD_ITEM = -1  # _find_dicts' answer: an item it read is not a uint64 int
_NO_MEMORY = -2  # _find_dicts' answer: Python could not allocate an answer's int or entry


@_jit
def _fill_keys(keys: Any, src: int, have: int, upto: int) -> int:
    """Convert items ``have .. upto - 1`` of the Python list at ``src`` into ``keys``;
    returns ``upto``, or _BAD_ITEM (the Python error cleared) at an item that is not an
    int in [0, 2**64)."""
    for j in range(have, upto):
        v = _list_u64(src, j)
        if v == _ALL and _take_error():
            return _BAD_ITEM
        keys[j] = v
    return upto


@_jit_inline
def _walk(
    tab: Any,
    ptab: Any,
    meta: Any,
    keys: Any,
    n: int,
    src: int,
    run: Any,
    out: Any,
    stride: int,
    touch: bool,
    combine: bool,
) -> int:
    """The confirmed walk of ``keys[:n]`` and the predicted one.

    ``src``: 0 when ``keys`` holds the query; else the address of the Python list that
    does, converted into ``keys`` as far as the walks read it (a few keys past where they
    stop: items beyond are never read), returning _BAD_ITEM, with nothing changed, at an
    item that is not a uint64 int (only under the GIL: _find_dicts).

    ``run``: scratch rows (at least n + n // stride, a row per bitset word); ``out``: four
    rows of one column per worker slot, where it writes the confirmed depths (slots in row
    0, depths in row 1) and the others (rows 2 and 3): with ``combine`` (find_matches) the
    result -- per slot the longer of its confirmed prefix and stride x its predicted
    probes, a probe counting when predicted or covered by the confirmed prefix --, without
    (find_matches_by_source) the walk over predicted probes alone. Returns the two counts
    (bits 0-20 and 21-41) and, with ``combine``, _SAME when the result is the confirmed
    depths (rows 2 and 3 then unused)."""
    words = tab.shape[1] - _MASK
    have = n
    if src:
        have = _fill_keys(keys, src, 0, min(n, _AHEAD))
        if have < 0:
            return _BAD_ITEM
    depth = 0
    last_row = -1
    mask = tab.shape[0] - 1
    for i in range(min(n, _AHEAD)):
        _prefetch(tab, _home(_key(keys[i]), mask))
    for i in range(n):
        if i + _AHEAD < n:
            if i + _AHEAD >= have:
                have = _fill_keys(keys, src, have, i + _AHEAD + 1)
                if have < 0:
                    return _BAD_ITEM
            _prefetch(tab, _home(_key(keys[i + _AHEAD]), mask))
        r = _find(tab, _key(keys[i]))
        if r < 0:
            break
        alive = False
        for w in range(words):
            m = tab[r, _MASK + w]
            if i:
                m &= run[i - 1, w]
            run[i, w] = m
            if m != _NIL:
                alive = True
        if not alive:
            break
        depth = i + 1
        last_row = r
    nc = _depths_of(run, 0, depth, out, 0)
    npred = 0
    pwords = ptab.shape[1] - _PBITS
    if meta[_P_LIVE] > 0:  # somebody is predicted somewhere
        nprobe = n // stride
        pdepth = 0
        for i in range(nprobe):
            pos = stride - 1 + i * stride
            if pos >= have:
                have = _fill_keys(keys, src, have, pos + 1)
                if have < 0:
                    return _BAD_ITEM
            pr = _find(ptab, _key(keys[pos]))
            alive = False
            for w in range(words):
                m = _NIL
                if pr >= 0 and w < pwords:
                    m = ptab[pr, _PBITS + w]
                if combine and pos < depth:
                    m |= run[pos, w]
                if i:
                    m &= run[n + i - 1, w]
                run[n + i, w] = m
                if m != _NIL:
                    alive = True
            if not alive:
                break
            pdepth = i + 1
        npred = _depths_of(run, n, pdepth, out, 2)
        for j in range(npred):
            out[3, j] *= stride
    if depth and touch:  # every key read: nothing can fail past here
        meta[_M_TICK] += 1
        tab[last_row, _STAMP] = np.uint64(meta[_M_TICK])
    if not combine:
        return nc | (npred << 21)
    if npred == 0:
        return nc | _SAME
    # merge, in slot order: per slot the larger depth
    best = np.zeros(out.shape[1], dtype=np.int64)
    for j in range(nc):
        best[out[0, j]] = out[1, j]
    same = True
    for j in range(npred):
        if out[3, j] > best[out[2, j]]:
            best[out[2, j]] = out[3, j]
            same = False
    if same:
        return nc | _SAME
    k = 0
    for s in range(best.shape[0]):
        if best[s]:
            out[2, k] = s
            out[3, k] = best[s]
            k += 1
    return nc | (k << 21)


@_jit
def _find_by_source(
    tab: Any, ptab: Any, meta: Any, keys: Any, run: Any, out: Any, stride: int
) -> int:
    """find_matches_by_source: _walk of the uint64 array ``keys``, the confirmed and the
    predicted walks apart, touching nothing (without the GIL)."""
    return _walk(tab, ptab, meta, keys, keys.shape[0], 0, run, out, stride, False, False)


@_jit_gil
def _find_dicts(
    tab: Any,
    ptab: Any,
    meta: Any,
    keys: Any,
    src: int,
    n: int,
    run: Any,
    out: Any,
    stride: int,
    touch: bool,
    confirmed: int,
    result: int,
) -> int:
    """find_matches: _walk (of the array ``keys``, or of the Python list of ``n`` ints at
    address ``src`` read into the scratch ``keys``), then its answers written into the
    empty Python dicts at addresses ``confirmed`` (the confirmed depths) and ``result``
    (unless the answer is _SAME: the result is the confirmed depths). Returns _walk's
    answer, or _BAD_ITEM or _NO_MEMORY (the Python error cleared)."""
    code = _walk(tab, ptab, meta, keys, n, src, run, out, stride, touch, True)
    if code < 0:
        return code
    for j in range(code & _COUNT):
        if _dict_put(confirmed, out[0, j], out[1, j]):
            _take_error()
            return _NO_MEMORY
    if not code & _SAME:
        for j in range(code >> 21 & _COUNT):
            if _dict_put(result, out[2, j], out[3, j]):
                _take_error()
                return _NO_MEMORY
    return code


@_jit
def _slot_depth(tab: Any, ptab: Any, meta: Any, keys: Any, slot: int, stride: int) -> int:
    """match_depth: how many leading blocks of ``keys`` worker ``slot`` holds -- its
    confirmed prefix, or stride x its leading probes that are predicted for it or covered by
    that prefix, whichever is longer (_walk's answer for one slot). One bit is read per row,
    and a walk stops at the first row without it. Touches nothing."""
    n = keys.shape[0]
    word = slot >> 6
    bit = _bit(slot)
    depth = 0
    if word < tab.shape[1] - _MASK:
        mask = tab.shape[0] - 1
        for i in range(min(n, _AHEAD)):
            _prefetch(tab, _home(_key(keys[i]), mask))
        for i in range(n):
            if i + _AHEAD < n:
                _prefetch(tab, _home(_key(keys[i + _AHEAD]), mask))
            r = _find(tab, _key(keys[i]))
            if r < 0 or (tab[r, _MASK + word] & bit) == _NIL:
                break
            depth = i + 1
    # probes past the confirmed prefix need a prediction of this slot's word
    if meta[_P_LIVE] > 0 and word < ptab.shape[1] - _PBITS:
        probes = 0
        for i in range(n // stride):
            pos = stride - 1 + i * stride
            if pos >= depth:
                pr = _find(ptab, _key(keys[pos]))
                if pr < 0 or (ptab[pr, _PBITS + word] & bit) == _NIL:
                    break
            probes = i + 1
        if probes * stride > depth:
            depth = probes * stride
    return depth


@_jit
def _slot_rows(tab: Any, col: int, bit: Any) -> Any:
    """Raw hashes of the rows whose word ``col`` has ``bit``."""
    n = 0
    for r in range(tab.shape[0]):
        if tab[r, 0] != _NIL and (tab[r, col] & bit) != _NIL:
            n += 1
    out = np.empty(n, dtype=np.uint64)
    n = 0
    for r in range(tab.shape[0]):
        if tab[r, 0] != _NIL and (tab[r, col] & bit) != _NIL:
            out[n] = _unkey(tab[r, 0])
            n += 1
    return out


@_jit
def _check(tab: Any, counts: Any, live: int, used: int) -> int:
    """0 if the table is consistent (every key found from its home, ``used`` rows with a
    key, ``live`` of them held, per-slot counts right), else an error code."""
    words = tab.shape[1] - _MASK
    seen = np.zeros(counts.shape[0], dtype=np.int64)
    n = 0
    keyed = 0
    for r in range(tab.shape[0]):
        k = tab[r, 0]
        if k == _NIL:
            continue
        keyed += 1
        if _find(tab, k) != r:
            return 1
        any_bit = False
        for w in range(words):
            m = tab[r, _MASK + w]
            if m != _NIL:
                any_bit = True
            while m != _NIL:
                low = m & (~m + _ONE)
                seen[64 * w + _popcount(low - _ONE)] += 1
                m ^= low
        if any_bit:
            n += 1
    if n != live:
        return 3
    if keyed != used:
        return 5
    for s in range(counts.shape[0]):
        if seen[s] != counts[s]:
            return 4
    return 0


# ---- predicted entries -------------------------------------------------------------------


@_jit
def _record(rd: Any, rk: Any, pmeta: Any, deadline: float, k: Any) -> None:
    """Queue the expiry record (deadline, k): at the FIFO's tail (row 1) when no earlier
    than its last (a monotonic clock: always), else in the heap (row 0)."""
    tail = pmeta[_P_TAIL]
    if tail == pmeta[_P_HEAD] or deadline >= rd[1, tail - 1]:
        rd[1, tail] = deadline
        rk[1, tail] = k
        pmeta[_P_TAIL] = tail + 1
    else:
        pmeta[_P_HEAP] = _heap_push(rd[0], rk[0], pmeta[_P_HEAP], deadline, k)


@_jit
def _pred_add(
    ptab: Any,
    until: Any,
    pmeta: Any,
    rd: Any,
    rk: Any,
    keys: Any,
    stride: int,
    start: int,
    slot: int,
    deadline: float,
    hold: bool,
) -> Any:
    """Predict ``slot`` on the probes of ``keys`` (every stride-th, from block ``start``):
    OR its bit in, deadline the later of theirs and ``deadline``, a hold on each distinct
    probe with ``hold``, an expiry record without. Returns the probes (raw hashes)."""
    first = stride - 1
    if start >= stride:
        first += (start // stride) * stride
    n = keys.shape[0]
    count = 0 if first >= n else (n - first + stride - 1) // stride
    out = np.empty(count, dtype=np.uint64)
    if count == 0:
        return out
    col = _PBITS + (slot >> 6)
    bit = _bit(slot)
    pmeta[_P_MARK] += 1
    mark = np.uint64(pmeta[_P_MARK])
    for j in range(count):
        h = keys[first + j * stride]
        out[j] = h
        k = _key(h)
        r = _find(ptab, k)
        if r < 0:
            r = -r - 1
            ptab[r, 0] = k
            pmeta[_P_ROWS] += 1
        if not _held(ptab, r, _PBITS):
            until[r] = deadline
            pmeta[_P_LIVE] += 1
        elif deadline > until[r]:
            until[r] = deadline
        ptab[r, col] |= bit
        if hold:
            if ptab[r, _PMARK] != mark:
                ptab[r, _PMARK] = mark
                ptab[r, _PHELD] += _ONE
        else:
            _record(rd, rk, pmeta, deadline, k)
    return out


@_jit
def _pred_release(
    ptab: Any, until: Any, pmeta: Any, rd: Any, rk: Any, probes: Any, deadline: float
) -> None:
    """End one hold on each distinct probe; those no request holds any more live until
    the later of their deadline and ``deadline`` (an expiry record each)."""
    pmeta[_P_MARK] += 1
    mark = np.uint64(pmeta[_P_MARK])
    for j in range(probes.shape[0]):
        k = _key(probes[j])
        r = _find(ptab, k)
        if r < 0 or ptab[r, _PMARK] == mark:
            continue
        ptab[r, _PMARK] = mark
        held = ptab[r, _PHELD]
        if held == _NIL:
            continue
        held -= _ONE
        ptab[r, _PHELD] = held
        if held != _NIL:
            continue
        if not _held(ptab, r, _PBITS):  # forgotten by remove_slot while held
            _delete_pred(ptab, until, r)
            pmeta[_P_ROWS] -= 1
            continue
        if deadline > until[r]:
            until[r] = deadline
        _record(rd, rk, pmeta, until[r], k)


@_jit
def _pred_refresh(
    ptab: Any, until: Any, pmeta: Any, rd: Any, rk: Any, keys: Any, stride: int, deadline: float
) -> None:
    """Extend the deadline of the predicted probes of ``keys`` (an expiry record each)."""
    for pos in range(stride - 1, keys.shape[0], stride):
        k = _key(keys[pos])
        r = _find(ptab, k)
        if r < 0:
            continue
        if not _held(ptab, r, _PBITS):
            continue
        if deadline > until[r]:
            until[r] = deadline
        _record(rd, rk, pmeta, deadline, k)


@_jit
def _pred_expire(ptab: Any, until: Any, pmeta: Any, rd: Any, rk: Any, now: float) -> int:
    """Drop the predicted probes whose deadline is <= ``now`` and that nobody holds (the
    records due, FIFO and heap); returns how many."""
    size = pmeta[_P_HEAP]
    head = pmeta[_P_HEAD]
    tail = pmeta[_P_TAIL]
    dropped = 0
    while True:
        if head < tail and rd[1, head] <= now:
            k = rk[1, head]
            head += 1
        elif size > 0 and rd[0, 0] <= now:
            k = rk[0, 0]
            size = _heap_pop(rd[0], rk[0], size)
        else:
            break
        r = _find(ptab, k)
        if r < 0 or ptab[r, _PHELD] != _NIL:
            continue  # gone, or held: release() records it again
        if not _held(ptab, r, _PBITS):
            continue
        if until[r] > now:  # a later deadline came with its own record
            continue
        _delete_pred(ptab, until, r)
        pmeta[_P_ROWS] -= 1
        pmeta[_P_LIVE] -= 1
        dropped += 1
    pmeta[_P_HEAP] = size
    if head == tail:
        head = tail = 0
    pmeta[_P_HEAD] = head
    pmeta[_P_TAIL] = tail
    return dropped


@_jit
def _pred_remove_slot(ptab: Any, until: Any, pmeta: Any, slot: int) -> None:
    """Forget ``slot``'s predictions (rows still held stay, predicting nobody)."""
    col = _PBITS + (slot >> 6)
    if col >= ptab.shape[1]:
        return
    bit = _bit(slot)
    r = 0
    cap = ptab.shape[0]
    # deleting moves later rows back into r: revisit r; a run wrapping past the end is
    # moved into earlier rows, already visited but then holding rows seen again (harmless:
    # their bit is clear)
    while r < cap:
        if ptab[r, 0] == _NIL or (ptab[r, col] & bit) == _NIL:
            r += 1
            continue
        ptab[r, col] ^= bit
        if _held(ptab, r, _PBITS):
            r += 1
            continue
        pmeta[_P_LIVE] -= 1
        if ptab[r, _PHELD] == _NIL:
            _delete_pred(ptab, until, r)
            pmeta[_P_ROWS] -= 1
        else:
            r += 1


@_jit
def _pred_rows(ptab: Any, slot: int) -> Any:
    """Raw probe hashes predicted for ``slot`` (slot < 0: the number of (probe, slot)
    pairs, as a one-element array)."""
    if slot < 0:
        total = 0
        for r in range(ptab.shape[0]):
            if ptab[r, 0] != _NIL:
                for w in range(_PBITS, ptab.shape[1]):
                    total += _popcount(ptab[r, w])
        out = np.empty(1, dtype=np.uint64)
        out[0] = np.uint64(total)
        return out
    col = _PBITS + (slot >> 6)
    bit = _bit(slot)
    n = 0
    for r in range(ptab.shape[0]):
        if ptab[r, 0] != _NIL and col < ptab.shape[1] and (ptab[r, col] & bit) != _NIL:
            n += 1
    out = np.empty(n, dtype=np.uint64)
    n = 0
    for r in range(ptab.shape[0]):
        if ptab[r, 0] != _NIL and col < ptab.shape[1] and (ptab[r, col] & bit) != _NIL:
            out[n] = _unkey(ptab[r, 0])
            n += 1
    return out


# ---- Python side -------------------------------------------------------------------------


class Probes(Sequence[int]):
    """The probes a held prediction entered (the handle :meth:`NumbaPrefixIndex.predict`
    returns for :meth:`NumbaPrefixIndex.release_predicted`): raw hashes in a uint64 array."""

    __slots__ = ("keys",)

    def __init__(self, keys: np.ndarray) -> None:
        self.keys = keys

    def __len__(self) -> int:
        return len(self.keys)

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[int]: ...
    def __getitem__(self, i: int | slice) -> int | Sequence[int]:
        if isinstance(i, slice):
            return self.keys[i].tolist()  # type: ignore[no-any-return]
        return int(self.keys[i])

    def __iter__(self) -> Iterator[int]:
        return iter(self.keys.tolist())

    def __repr__(self) -> str:
        return f"Probes({self.keys.tolist()})"


_EMPTY_PROBES = Probes(np.empty(0, dtype=_U64))
_WIRE_NATIVE = np.dtype("<u8") == np.dtype(_U64)  # the wire's uint64 is the kernels' (x86, arm)


def _as_keys(hashes: Sequence[int] | np.ndarray) -> np.ndarray:
    """Block hashes as a C-contiguous uint64 array (raw: kernels map 0 themselves)."""
    if type(hashes) is np.ndarray and hashes.dtype == _U64 and hashes.flags.c_contiguous:
        return hashes
    if type(hashes) is PackedHashes and _WIRE_NATIVE:  # decoded events: the wire's words
        return cast(PackedHashes, hashes).array
    if isinstance(hashes, Probes):
        return hashes.keys
    return np.ascontiguousarray(np.asarray(hashes, dtype=_U64))


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


class NumbaPrefixIndex(AppliesEvents):
    """Block hash -> set of worker slots in flat tables walked by numba kernels, with
    predicted entries and a size cap. Same interface and answers as
    :class:`router.core.index.PrefixIndex`; hashes may also be given as uint64 arrays (no
    conversion: fastest). Not thread-safe.

    Construction compiles the kernels once per process (or loads them from numba's disk
    cache): see :func:`warm_up`.
    """

    takes_arrays = True  # queries as uint64 arrays (the router core passes them unconverted)

    def __init__(self, config: IndexConfig | None = None, *, _warm_up: bool = True) -> None:
        if _warm_up:
            warm_up()
        self.config = config or IndexConfig()
        self._stride = self.config.predict_stride
        self._verify_on = self.config.verify_hashes
        self._tab = np.zeros((_MIN_CAP, _MASK + 1), dtype=_U64)
        self._meta = np.zeros(9, dtype=np.int64)
        self._counts = np.zeros(64, dtype=np.int64)
        self._nslots = 64  # worker slots the tables' words hold
        # find_matches' scratch (a bitset row per walked block and probe) and answer rows
        self._run = np.zeros((1024, 1), dtype=_U64)
        self._keybuf = np.zeros(len(self._run), dtype=_U64)  # a list query's keys
        self._set_run_fits()
        self._outbuf = np.zeros((4, 64), dtype=np.int64)
        self._ptab = np.zeros((_MIN_CAP, _PBITS + 1), dtype=_U64)
        self._until = np.zeros(_MIN_CAP, dtype=np.float64)
        # expiry records (deadline, probe hash): row 0 a heap, row 1 a FIFO (see _record)
        self._rd = np.zeros((2, _MIN_RECORDS), dtype=np.float64)
        self._rk = np.zeros((2, _MIN_RECORDS), dtype=_U64)
        # the event-confirmed depths of the last find_matches (before predictions lengthened
        # any), as router.core.index.PrefixIndex.last_confirmed
        self.last_confirmed: dict[int, int] = {}
        # the dict index's eviction trigger and compaction rule, kept alike (its largest
        # size since it last compacted or evicted)
        # (its peak is kept in apply_wire's state, [0]: see _peak)
        self._wire_state = np.zeros(5, dtype=np.int64)  # apply_wire's (see _apply_wire)
        self._wire_state[1] = self.config.max_blocks
        self.errors: Counter[str] = Counter(dict.fromkeys(ERROR_KINDS, 0))
        self.num_evicted = 0

    @property
    def _peak(self) -> int:
        """The size the eviction trigger and the compaction rule compare with (the dict
        index's peak), kept where apply_wire's kernel updates it."""
        return self._wire_state.item(0)  # type: ignore[no-any-return]

    @_peak.setter
    def _peak(self, value: int) -> None:
        self._wire_state[0] = value

    # ---- tables --------------------------------------------------------------------------

    def _words_for(self, slot: int) -> None:
        """Widen the tables to hold worker ``slot``."""
        if slot < 0:
            raise ValueError(f"worker slot must be >= 0, got {slot}")
        words = (slot >> 6) + 1
        if 64 * words > self._nslots:
            self._nslots = 64 * words
            self._outbuf = np.zeros((4, self._nslots), dtype=np.int64)
            self._run = np.zeros((len(self._run), words), dtype=_U64)
        if words > self._tab.shape[1] - _MASK:
            tab = np.zeros((self._tab.shape[0], _MASK + words), dtype=_U64)
            tab[:, : self._tab.shape[1]] = self._tab
            self._tab = tab
            counts = np.zeros(64 * words, dtype=np.int64)
            counts[: len(self._counts)] = self._counts
            self._counts = counts
        if words > self._ptab.shape[1] - _PBITS:
            ptab = np.zeros((self._ptab.shape[0], _PBITS + words), dtype=_U64)
            ptab[:, : self._ptab.shape[1]] = self._ptab
            self._ptab = ptab

    def _grow_run(self, n: int) -> np.ndarray:
        rows = len(self._run)
        while rows <= n + n // self._stride:
            rows *= 2
        self._run = np.zeros((rows, self._run.shape[1]), dtype=_U64)
        self._keybuf = np.zeros(rows, dtype=_U64)
        self._set_run_fits()
        return self._run

    def _set_run_fits(self) -> None:
        """The longest query the scratch rows hold (n + n // stride < rows)."""
        rows, stride = len(self._run), self._stride
        n = rows
        while n and n + n // stride >= rows:
            n -= 1
        self._run_fits = n

    def _room(self, n: int) -> None:
        """Rebuild the confirmed table (dropping dead rows, growing as needed) so ``n``
        more keys keep its load under 0.6."""
        cap = self._tab.shape[0]
        need = int(self._meta[_M_USED]) + n
        if need > cap * _GROW_LOAD:
            self._resize(int(self._meta[_M_LIVE]) + n)

    @staticmethod
    def _capacity(live: int) -> int:
        """Rows for ``live`` keys: a power of two at most 0.45 full (a table growing at 0.6
        doubles to 0.3)."""
        cap = _MIN_CAP
        while cap * _RESIZE_LOAD < live:
            cap *= 2
        return cap

    def _resize(self, live: int) -> None:
        """Rebuild the confirmed table with rows for ``live`` keys, its dead rows dropped.
        A table that grows is grown in place (``ndarray.resize``: realloc, which moves a
        large block's pages without copying them), so only the added rows are new memory
        to fault in, and its rows are re-placed where they are (_grow_in_place)."""
        cap = self._capacity(live)
        old_cap = self._tab.shape[0]
        if cap > old_cap:
            try:
                self._tab.resize((cap, self._tab.shape[1]), refcheck=True)
            except ValueError:  # something else holds the table: into a new one instead
                pass
            else:
                self._meta[_M_USED] = _grow_in_place(self._tab, old_cap)
                return
        new = np.zeros((cap, self._tab.shape[1]), dtype=_U64)
        self._meta[_M_USED] = _drop_empty(self._tab, new)
        self._tab = new

    def _rebuild(self) -> None:
        """Drop rows left without a worker (removals, eviction, remove_worker) and resize."""
        self._resize(int(self._meta[_M_LIVE]))

    def _maybe_shrink(self) -> None:
        cap = self._tab.shape[0]
        if cap > _MIN_CAP and int(self._meta[_M_LIVE]) * 16 < cap:
            self._resize(int(self._meta[_M_LIVE]))

    def _pred_room(self, n: int) -> None:
        """Room for ``n`` more predicted rows and heap records."""
        cap = self._ptab.shape[0]
        need = int(self._meta[_P_ROWS]) + n
        if need > cap * _GROW_LOAD or (cap > _MIN_CAP and need * 16 < cap):
            size = self._capacity(need)
            ptab = np.zeros((size, self._ptab.shape[1]), dtype=_U64)
            until = np.zeros(size, dtype=np.float64)
            _rehash_pred(self._ptab, self._until, ptab, until)
            self._ptab, self._until = ptab, until
        meta = self._meta
        size = self._rd.shape[1]
        heap, head, tail = int(meta[_P_HEAP]), int(meta[_P_HEAD]), int(meta[_P_TAIL])
        if heap + n <= size and tail + n <= size:
            return
        while size < max(heap, tail - head) + n:
            size *= 2
        rd = np.zeros((2, size), dtype=np.float64)
        rk = np.zeros((2, size), dtype=_U64)
        rd[0, :heap], rk[0, :heap] = self._rd[0, :heap], self._rk[0, :heap]
        rd[1, : tail - head], rk[1, : tail - head] = self._rd[1, head:tail], self._rk[1, head:tail]
        meta[_P_HEAD], meta[_P_TAIL] = 0, tail - head
        self._rd, self._rk = rd, rk

    @staticmethod
    def _out(keys: np.ndarray) -> set[int]:
        return set(keys.tolist())

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
        if (self._peak >= _COMPACT_MIN and n * 4 <= self._peak) or (n == 0 and self._peak):
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
        used = int(self._meta[_M_USED])
        code = _check(self._tab, self._counts, self.size(), used)
        assert code == 0, f"confirmed table inconsistent (code {code})"
        assert self._tab.shape[0] * _GROW_LOAD >= used >= self.size()
        assert (self._counts >= 0).all()
        ptab = self._ptab
        rows = np.flatnonzero(ptab[:, 0])
        bits = ptab[rows, _PBITS:].any(axis=1)
        held = ptab[rows, _PHELD] != 0
        assert (bits | held).all(), "a predicted row with neither a worker nor a hold"
        assert len(rows) == self._meta[_P_ROWS]
        assert int(bits.sum()) == self._meta[_P_LIVE]
        for r in rows.tolist():
            assert _find(ptab, ptab[r, 0]) == r
        # a prediction nobody holds has an expiry record at its deadline; the FIFO's
        # records are in deadline order
        heap, head, tail = (int(self._meta[i]) for i in (_P_HEAP, _P_HEAD, _P_TAIL))
        assert 0 <= heap <= self._rd.shape[1] and 0 <= head <= tail <= self._rd.shape[1]
        fifo = self._rd[1, head:tail]
        assert (fifo[1:] >= fifo[:-1]).all()
        records = set(zip(self._rd[0, :heap].tolist(), self._rk[0, :heap].tolist(), strict=True))
        records.update(zip(fifo.tolist(), self._rk[1, head:tail].tolist(), strict=True))
        for r in rows.tolist():
            if ptab[r, _PBITS:].any() and not ptab[r, _PHELD]:
                assert (float(self._until[r]), int(ptab[r, 0])) in records, r
