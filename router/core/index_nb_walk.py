"""The numba index's walks of a query: find_matches (both paths: the C-API one,
router.core.index_capi, and the plain one), find_matches_by_source and match_depth
(router.core.index_nb's docstring describes the tables).

Sans-I/O: imports neither asyncio, grpc, torch nor a clock.
"""

from __future__ import annotations

import numpy as np

from kvroute_proto.jit import jit, jit_gil, jit_inline
from router.core.index_capi import _dict_put, _list_u64, _take_error
from router.core.index_nb_table import (
    _AHEAD,
    _ALL,
    _M_TICK,
    _MASK,
    _NIL,
    _ONE,
    _P_LIVE,
    _PBITS,
    _STAMP,
    I64Array,
    U64Array,
    _bit,
    _find,
    _home,
    _key,
    _popcount,
    _prefetch,
)

_SAME = 1 << 42  # _walk's answer: the result is the confirmed walk's
_COUNT = (1 << 21) - 1  # _walk's answer: the confirmed count in bits 0-20, the other's in 21-41
_BAD_ITEM = -1  # _walk's answer: a key it needs is missing (not a uint64 int in the query)
_NO_MEMORY = -2  # _find_dicts' answer: Python could not allocate an answer's int or entry


@jit
def _depths_of(run: U64Array, off: int, n: int, out: I64Array, row: int) -> int:
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


@jit
def _fill_keys(keys: U64Array, src: int, have: int, upto: int) -> int:
    """Convert items ``have .. upto - 1`` of the Python list at address ``src`` into
    ``keys`` (index_capi: only under the GIL); returns ``upto``, or _BAD_ITEM (the Python
    error cleared) at an item that is not an int in [0, 2**64). ``src`` 0: no list to read
    (``keys[:have]`` is all the query there is): _BAD_ITEM."""
    if not src:
        return _BAD_ITEM
    for j in range(have, upto):
        v = _list_u64(src, j)
        if v == _ALL and _take_error():
            return _BAD_ITEM
        keys[j] = v
    return upto


@jit_inline
def _confirmed_walk(
    tab: U64Array, keys: U64Array, n: int, src: int, have: int, run: U64Array
) -> tuple[int, int, int]:
    """The running AND of the confirmed bitsets of ``keys[:n]`` into ``run`` (a row per
    block, up to where it reaches 0 or a key is missing), prefetching the rows ``_AHEAD``
    keys ahead and reading those keys (``_fill_keys``) as it goes. Returns (the depth, the
    deepest row, how many keys are read), the last _BAD_ITEM when a key could not be."""
    words = tab.shape[1] - _MASK
    if have < min(n, _AHEAD):
        have = _fill_keys(keys, src, have, min(n, _AHEAD))
        if have < 0:
            return 0, -1, _BAD_ITEM
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
                    return 0, -1, _BAD_ITEM
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
    return depth, last_row, have


@jit_inline
def _predicted_walk(
    ptab: U64Array,
    keys: U64Array,
    n: int,
    src: int,
    have: int,
    run: U64Array,
    depth: int,
    stride: int,
    combine: bool,
    words: int,
) -> tuple[int, int]:
    """The running AND of the predicted bitsets of the probes of ``keys[:n]`` (every
    stride-th block) into ``run[n:]``; with ``combine`` a probe within the confirmed
    ``depth`` counts for the slots holding it (``run[:depth]``). Returns (the probes
    walked, how many keys are read), the last _BAD_ITEM when a key could not be.
    ``words``: the confirmed table's bitset words (``run``'s)."""
    pwords = ptab.shape[1] - _PBITS
    pdepth = 0
    for i in range(n // stride):
        pos = stride - 1 + i * stride
        if pos >= have:
            have = _fill_keys(keys, src, have, pos + 1)
            if have < 0:
                return 0, _BAD_ITEM
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
    return pdepth, have


@jit_inline
def _merge(out: I64Array, nc: int, npred: int) -> int:
    """find_matches' result from the confirmed depths (``out`` rows 0, 1: ``nc`` slots) and
    the predicted walk's (rows 2, 3: ``npred``): per slot the larger, in slot order, into
    rows 2 and 3. Returns _walk's answer (_SAME when no predicted depth is larger)."""
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


@jit_inline
def _walk(
    tab: U64Array,
    ptab: U64Array,
    meta: I64Array,
    keys: U64Array,
    n: int,
    src: int,
    have: int,
    run: U64Array,
    out: I64Array,
    stride: int,
    touch: bool,
    combine: bool,
) -> int:
    """The confirmed walk of a query of ``n`` blocks and the predicted one.

    ``keys[:have]`` hold the query's first keys; ``src``: 0, or the address of the Python
    list holding it, converted into ``keys`` as far as the walks read it (a few keys past
    where they stop: items beyond are never read; only under the GIL: _find_dicts).
    Returns _BAD_ITEM, with nothing changed, where a key the walks need is not there (an
    item that is not a uint64 int).

    ``run``: scratch rows (at least n + n // stride, a row per bitset word); ``out``: four
    rows of one column per worker slot, where it writes the confirmed depths (slots in row
    0, depths in row 1) and the others (rows 2 and 3): with ``combine`` (find_matches) the
    result -- per slot the longer of its confirmed prefix and stride x its predicted
    probes, a probe counting when predicted or covered by the confirmed prefix --, without
    (find_matches_by_source) the walk over predicted probes alone. Returns the two counts
    (bits 0-20 and 21-41) and, with ``combine``, _SAME when the result is the confirmed
    depths (rows 2 and 3 then unused)."""
    depth, last_row, have = _confirmed_walk(tab, keys, n, src, have, run)
    if have < 0:
        return _BAD_ITEM
    nc = _depths_of(run, 0, depth, out, 0)
    npred = 0
    if meta[_P_LIVE] > 0:  # somebody is predicted somewhere
        pdepth, have = _predicted_walk(
            ptab, keys, n, src, have, run, depth, stride, combine, tab.shape[1] - _MASK
        )
        if have < 0:
            return _BAD_ITEM
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
    return _merge(out, nc, npred)


@jit
def _find_by_source(
    tab: U64Array,
    ptab: U64Array,
    meta: I64Array,
    keys: U64Array,
    run: U64Array,
    out: I64Array,
    stride: int,
) -> int:
    """find_matches_by_source: _walk of the uint64 array ``keys``, the confirmed and the
    predicted walks apart, touching nothing (without the GIL)."""
    n = keys.shape[0]
    return _walk(tab, ptab, meta, keys, n, 0, n, run, out, stride, False, False)


@jit
def _find_arrays(
    tab: U64Array,
    ptab: U64Array,
    meta: I64Array,
    keys: U64Array,
    n: int,
    have: int,
    run: U64Array,
    out: I64Array,
    stride: int,
    touch: bool,
) -> int:
    """find_matches' plain path: _walk of a query of ``n`` blocks whose first ``have``
    are in ``keys`` (all of them but where a list's item was no uint64 int), its answer
    left in ``out`` (without the GIL). Returns _walk's answer."""
    return _walk(tab, ptab, meta, keys, n, 0, have, run, out, stride, touch, True)


@jit_gil
def _find_dicts(
    tab: U64Array,
    ptab: U64Array,
    meta: I64Array,
    keys: U64Array,
    src: int,
    n: int,
    run: U64Array,
    out: I64Array,
    stride: int,
    touch: bool,
    confirmed: int,
    result: int,
) -> int:
    """find_matches' C-API path (router.core.index_capi): _walk (of the array ``keys``, or
    of the Python list of ``n`` ints at address ``src`` read into the scratch ``keys``),
    then its answers written into the empty Python dicts at addresses ``confirmed`` (the
    confirmed depths) and ``result`` (unless the answer is _SAME: the result is the
    confirmed depths). Returns _walk's answer, or _BAD_ITEM or _NO_MEMORY (the Python error
    cleared)."""
    have = 0 if src else n
    code = _walk(tab, ptab, meta, keys, n, src, have, run, out, stride, touch, True)
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


@jit
def _slot_depth(
    tab: U64Array, ptab: U64Array, meta: I64Array, keys: U64Array, slot: int, stride: int
) -> int:
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
