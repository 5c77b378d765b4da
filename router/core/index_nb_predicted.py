"""The numba index's kernels on predicted entries (router.core.predicted's semantics in a
table of their own, with expiry records: router.core.index_nb's docstring describes them).

Sans-I/O: imports neither asyncio, grpc, torch nor a clock.
"""

from __future__ import annotations

import numpy as np

from kvroute_proto.jit import jit
from router.core.index_nb_table import (
    _NIL,
    _ONE,
    _P_HEAD,
    _P_HEAP,
    _P_LIVE,
    _P_MARK,
    _P_ROWS,
    _P_TAIL,
    _PBITS,
    _PHELD,
    _PMARK,
    F64Array,
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
    _unkey,
)


@jit
def _delete_pred(tab: U64Array, until: F64Array, i: int) -> None:
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


@jit
def _rehash_pred(old: U64Array, old_until: F64Array, new: U64Array, new_until: F64Array) -> int:
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


@jit
def _record(rd: F64Array, rk: U64Array, pmeta: I64Array, deadline: float, k: np.uint64) -> None:
    """Queue the expiry record (deadline, k): at the FIFO's tail (row 1) when no earlier
    than its last (a monotonic clock: always), else in the heap (row 0)."""
    tail = pmeta[_P_TAIL]
    if tail == pmeta[_P_HEAD] or deadline >= rd[1, tail - 1]:
        rd[1, tail] = deadline
        rk[1, tail] = k
        pmeta[_P_TAIL] = tail + 1
    else:
        pmeta[_P_HEAP] = _heap_push(rd[0], rk[0], pmeta[_P_HEAP], deadline, k)


@jit
def _pred_add(
    ptab: U64Array,
    until: F64Array,
    pmeta: I64Array,
    rd: F64Array,
    rk: U64Array,
    keys: U64Array,
    stride: int,
    start: int,
    slot: int,
    deadline: float,
    hold: bool,
) -> U64Array:
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


@jit
def _pred_release(
    ptab: U64Array,
    until: F64Array,
    pmeta: I64Array,
    rd: F64Array,
    rk: U64Array,
    probes: U64Array,
    deadline: float,
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


@jit
def _pred_refresh(
    ptab: U64Array,
    until: F64Array,
    pmeta: I64Array,
    rd: F64Array,
    rk: U64Array,
    keys: U64Array,
    stride: int,
    deadline: float,
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


@jit
def _pred_expire(
    ptab: U64Array, until: F64Array, pmeta: I64Array, rd: F64Array, rk: U64Array, now: float
) -> int:
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


@jit
def _pred_remove_slot(ptab: U64Array, until: F64Array, pmeta: I64Array, slot: int) -> None:
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


@jit
def _pred_rows(ptab: U64Array, slot: int) -> U64Array:
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
