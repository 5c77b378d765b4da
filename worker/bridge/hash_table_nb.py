"""The kernels of :class:`worker.bridge.hash_table.HashCodes` (numba): an open-addressing
table of 64-bit keys to codes, linear probing, deletion by backward shift (decision 0046).

A table is two arrays of one power-of-two length: ``keys`` (uint64) and ``vals`` (uint64).
A slot is empty when its value is 0 (a code is never 0). A value holds the code in its low
63 bits and, in bit 63, whether the key was a negative int (SGLang's signed hashes): the key
``k`` is kept as ``k mod 2**64`` with that bit, so -1 and 2**64 - 1 are two keys. A key's
home slot is the top ``bits`` of ``key * GOLDEN`` (Fibonacci hashing, so sequential or
strided keys spread out); ``shift = 64 - bits``, ``mask = 2**bits - 1``.

Removal moves later entries of the probe run back into the hole (no tombstones), so a table
under steady churn, as many keys removed as entered, never needs rebuilding. Every batch
kernel takes a whole run of keys: no Python runs per key. Kernels are cached on disk where
numba finds a writable place.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvroute_proto.jit import jit

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_U63 = np.uint64(63)
_U1 = np.uint64(1)
_FLAG = np.uint64(1 << 63)


@jit
def _home(key: Any, shift: Any) -> Any:
    return np.int64((key * _GOLDEN) >> np.uint64(shift))


@jit
def _find(keys: Any, vals: Any, key: Any, flag: Any, shift: Any, mask: Any) -> Any:
    """The slot holding ``key`` (with sign bit ``flag``), or -1."""
    i = _home(key, shift)
    while True:
        v = vals[i]
        if v == 0:
            return np.int64(-1)
        if keys[i] == key and (v >> _U63) == flag:
            return i
        i = (i + 1) & mask


@jit
def _delete_at(keys: Any, vals: Any, i: Any, shift: Any, mask: Any) -> None:
    """Empty slot ``i``, moving back the entries after it whose probe run crosses it."""
    j = i
    while True:
        j = (j + 1) & mask
        v = vals[j]
        if v == 0:
            break
        h = _home(keys[j], shift)
        # the entry at j may fill the hole at i unless its home lies in (i, j], cyclically
        if (i < j and (h <= i or h > j)) or (j < i and h <= i and h > j):
            keys[i] = keys[j]
            vals[i] = v
            i = j
    vals[i] = 0


@jit
def _put(keys: Any, vals: Any, key: Any, val: Any, shift: Any, mask: Any) -> Any:
    """Enter ``key`` with ``val`` (its sign bit included); False, and nothing changed, when
    it is held already."""
    flag = val >> _U63
    i = _home(key, shift)
    while True:
        v = vals[i]
        if v == 0:
            keys[i] = key
            vals[i] = val
            return True
        if keys[i] == key and (v >> _U63) == flag:
            return False
        i = (i + 1) & mask


@jit
def put_run(keys: Any, vals: Any, run: Any, signed: Any, base: Any, shift: Any, mask: Any) -> Any:
    """Enter ``run[i]`` with code ``base + i`` for every i, when none is held and no two are
    equal (True); otherwise enter none (False). ``signed``: ``run`` holds int64 values (a
    set top bit is a negative key), else uint64 ones."""
    for n in range(len(run)):
        key = run[n]
        val = np.uint64(base + n)
        if signed:
            val |= key & _FLAG
        if not _put(keys, vals, key, val, shift, mask):
            for m in range(n):  # undo: the run goes key by key after all
                k = run[m]
                flag = (k >> _U63) if signed else np.uint64(0)
                _delete_at(keys, vals, _find(keys, vals, k, flag, shift, mask), shift, mask)
            return False
    return True


@jit
def pop_run(keys: Any, vals: Any, run: Any, signed: Any, shift: Any, mask: Any, out: Any) -> Any:
    """Remove the keys of ``run``; ``out[i]`` the code ``run[i]`` had, or 0 when it was not
    held (nor earlier in ``run``). Returns how many were held."""
    held = 0
    for n in range(len(run)):
        key = run[n]
        flag = (key >> _U63) if signed else np.uint64(0)
        i = _find(keys, vals, key, flag, shift, mask)
        if i < 0:
            out[n] = np.uint64(0)
        else:
            out[n] = vals[i] & ~_FLAG
            _delete_at(keys, vals, i, shift, mask)
            held += 1
    return held


@jit
def get_one(keys: Any, vals: Any, key: Any, flag: Any, shift: Any, mask: Any) -> Any:
    i = _find(keys, vals, key, flag, shift, mask)
    return np.uint64(0) if i < 0 else vals[i] & ~_FLAG


@jit
def pop_one(keys: Any, vals: Any, key: Any, flag: Any, shift: Any, mask: Any) -> Any:
    i = _find(keys, vals, key, flag, shift, mask)
    if i < 0:
        return np.uint64(0)
    code = vals[i] & ~_FLAG
    _delete_at(keys, vals, i, shift, mask)
    return code


@jit
def put_one(keys: Any, vals: Any, key: Any, val: Any, shift: Any, mask: Any) -> Any:
    return _put(keys, vals, key, val, shift, mask)


@jit
def rehash(keys: Any, vals: Any, new_keys: Any, new_vals: Any, shift: Any, mask: Any) -> None:
    """Enter every entry of the old table into the new (empty, larger) one."""
    for i in range(len(vals)):
        v = vals[i]
        if v != 0:
            _put(new_keys, new_vals, keys[i], v, shift, mask)
