"""The numba index's kernels on confirmed (event-fed) entries: store, remove, a scanned
batch applied in place, a worker's entries dropped, the table's rebuilds, the size cap's
eviction, a worker's rows, and the consistency check (router.core.index_nb's docstring
describes the table).

Sans-I/O: imports neither asyncio, grpc, torch nor a clock.
"""

from __future__ import annotations

import numpy as np

from kvroute_proto.jit import jit
from router.core.index_nb_table import (
    _AHEAD,
    _M_LIVE,
    _M_TICK,
    _M_USED,
    _MASK,
    _NIL,
    _ONE,
    _PAR,
    _STAMP,
    I64Array,
    U64Array,
    _bit,
    _find,
    _heap_pop,
    _heap_push,
    _held,
    _home,
    _key,
    _popcount,
    _prefetch,
    _unkey,
)


@jit
def _holds(tab: U64Array, h: np.uint64, slot: int) -> bool:
    r = _find(tab, _key(h))
    return r >= 0 and (tab[r, _MASK + (slot >> 6)] & _bit(slot)) != _NIL


_NO_ROOM = -1  # _store's answer when the table must grow first
_UNKNOWN_PARENT = 1 << 40  # _store's answer: the parent was given but not held


@jit
def _store(
    tab: U64Array, meta: I64Array, counts: I64Array, keys: U64Array, parent: np.uint64, slot: int
) -> int:
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


@jit
def _remove(tab: U64Array, meta: I64Array, counts: I64Array, keys: U64Array, slot: int) -> int:
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


@jit
def _apply_wire(
    tab: U64Array, meta: I64Array, counts: I64Array, out: U64Array, e: int, slot: int, st: I64Array
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


@jit
def _remove_slot_confirmed(tab: U64Array, meta: I64Array, slot: int) -> None:
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


@jit
def _drop_empty(old: U64Array, new: U64Array) -> int:
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


@jit
def _grow_in_place(tab: U64Array, old_cap: int) -> int:
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


@jit
def _evict(tab: U64Array, meta: I64Array, counts: I64Array, target: int) -> int:
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


@jit
def _slot_rows(tab: U64Array, col: int, bit: np.uint64) -> U64Array:
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


@jit
def _check(tab: U64Array, counts: I64Array, live: int, used: int) -> int:
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
