"""A map of block hashes to the held maps' int codes, compiled (decision 0046).

:class:`HashCodes` is what :class:`worker.bridge.held.HeldBlocks` keeps its two maps in
(engine hash -> code, our hash -> code). A dict of that size, under a full cache's steady
churn (as many keys removed as entered), takes a fresh slot for every insert and rebuilds
its whole table in one call whenever they run out; this table does not:

- Keys that are ints in ``[-2**63, 2**64)`` (vLLM's 64-bit hashes, SGLang's signed int64,
  kvroute's own BlockHash) live in an open-addressing table (:mod:`.hash_table_nb`): linear
  probing, deletion by backward shift, so removals leave no tombstones and churn never
  rebuilds it. It doubles only when the live count passes half its slots, which happens
  while the cache first fills; :meth:`HashCodes.clear` keeps its size.
- Any other key -- bytes (vLLM's sha256 hashes, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``),
  an int outside those bounds -- is kept exactly in a plain dict beside the table.
  Correctness first: such keys are not folded to 64 bits, and pay a dict's costs.

A whole run of keys goes in and out with one call (:meth:`HashCodes.put_run`,
:meth:`HashCodes.pop_run`; arrays in, arrays out), so no Python code runs per key. Codes
are ints in ``[1, 2**63)``; 0 means "not held" in the arrays returned.

Sans-I/O; numba is imported with this module.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from typing import Final, Generic, TypeVar

import numpy as np

from worker.bridge import hash_table_nb as nb

MIN_CAPACITY: Final = 1024
U64: Final = 1 << 64
_I64_MIN: Final = -(1 << 63)
_FLAG: Final = np.uint64(1 << 63)
_INT_ONLY: Final = frozenset({int})
K = TypeVar("K", bound=Hashable)


def _split(key: Hashable) -> tuple[int, int] | None:
    """``key`` as the table holds it (its value mod 2**64, whether it was negative), or
    None when the table cannot hold it exactly."""
    if isinstance(key, int | np.integer):
        k = int(key)
        if 0 <= k < U64:
            return k, 0
        if _I64_MIN <= k < 0:
            return k + U64, 1
    return None


class HashCodes(Generic[K]):
    """Block hash -> code (an int in ``[1, 2**63)``), for ints and any other hashable
    keys; see the module's docstring."""

    __slots__ = ("_count", "_grow_at", "_keys", "_mask", "_other", "_shift", "_signed", "_vals")

    def __init__(self, capacity: int = MIN_CAPACITY) -> None:
        self._other: dict[K, int] = {}  # keys the table cannot hold exactly
        self._count = 0  # live entries in the table
        self._signed = False  # the last run of keys was int64 (try that first)
        self._allocate(max(8, 1 << (capacity - 1).bit_length()))

    def _allocate(self, capacity: int) -> None:
        self._keys = np.zeros(capacity, dtype=np.uint64)
        self._vals = np.zeros(capacity, dtype=np.uint64)  # 0: empty
        self._shift = 64 - (capacity.bit_length() - 1)
        self._mask = capacity - 1
        self._grow_at = capacity // 2

    def _reserve(self, n: int) -> None:
        """Room for ``n`` more keys in the table, doubling it while it would be more than
        half full."""
        need = self._count + n
        if need <= self._grow_at:
            return
        capacity = len(self._vals)
        while need > capacity // 2:
            capacity *= 2
        keys, vals = self._keys, self._vals
        self._allocate(capacity)
        nb.rehash(keys, vals, self._keys, self._vals, self._shift, self._mask)

    def _array(self, keys: Sequence[K] | np.ndarray) -> tuple[np.ndarray, bool] | None:
        """``keys`` as one uint64 array, and whether it holds int64 values (negative keys
        with the top bit set); None when they are not all ints of one of those ranges."""
        if isinstance(keys, np.ndarray):
            if keys.dtype == np.uint64:
                return keys, False
            if keys.dtype == np.int64:
                return keys.view(np.uint64), True
            return None
        if set(map(type, keys)) != _INT_ONLY:  # numpy would parse bytes as digits
            return None
        signed = self._signed
        for _ in range(2):
            try:
                if signed:
                    return np.array(keys, dtype=np.int64).view(np.uint64), True
                return np.array(keys, dtype=np.uint64), False
            except OverflowError:
                signed = self._signed = not signed
        return None  # both signs beyond int64: key by key

    # ---- one key --------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._count + len(self._other)

    def __contains__(self, key: object) -> bool:
        return self.get(key) is not None  # type: ignore[arg-type]

    def get(self, key: K) -> int | None:
        """``key``'s code, or None."""
        split = _split(key)
        if split is None:
            return self._other.get(key)
        u, flag = split
        code = nb.get_one(
            self._keys, self._vals, np.uint64(u), np.uint64(flag), self._shift, self._mask
        )
        return int(code) or None

    def __getitem__(self, key: K) -> int:
        code = self.get(key)
        if code is None:
            raise KeyError(key)
        return code

    def pop(self, key: K) -> int | None:
        """Remove ``key``; its code, or None when it was not held."""
        split = _split(key)
        if split is None:
            return self._other.pop(key, None)
        u, flag = split
        code = int(
            nb.pop_one(
                self._keys, self._vals, np.uint64(u), np.uint64(flag), self._shift, self._mask
            )
        )
        if not code:
            return None
        self._count -= 1
        return code

    def put(self, key: K, code: int) -> bool:
        """Enter ``key`` with ``code``; False, and nothing changed, when it is held."""
        split = _split(key)
        if split is None:
            if key in self._other:
                return False
            self._other[key] = code
            return True
        u, flag = split
        self._reserve(1)
        val = np.uint64(code | (flag << 63))
        if not nb.put_one(self._keys, self._vals, np.uint64(u), val, self._shift, self._mask):
            return False
        self._count += 1
        return True

    # ---- runs of keys ---------------------------------------------------------------------

    def put_run(self, keys: Sequence[K] | np.ndarray, base: int) -> bool:
        """Enter ``keys[i]`` with code ``base + i`` for every i when none is held and no two
        are equal (True); otherwise change nothing (False)."""
        n = len(keys)
        if not n:
            return True
        as_array = self._array(keys)
        if as_array is None:
            if len(set(keys)) != n or any(k in self for k in keys):
                return False
            for i, k in enumerate(keys):
                self.put(k, base + i)
            return True
        run, signed = as_array
        self._reserve(n)
        if not nb.put_run(self._keys, self._vals, run, signed, base, self._shift, self._mask):
            return False
        self._count += n
        return True

    def pop_run(self, keys: Sequence[K] | np.ndarray) -> np.ndarray:
        """Remove ``keys``: the codes they had (uint64), 0 where one was not held (nor
        earlier in ``keys``)."""
        n = len(keys)
        out = np.empty(n, dtype=np.uint64)
        if not n:
            return out
        as_array = self._array(keys)
        if as_array is None:
            for i, k in enumerate(keys):
                out[i] = self.pop(k) or 0
            return out
        run, signed = as_array
        held = nb.pop_run(self._keys, self._vals, run, signed, self._shift, self._mask, out)
        self._count -= int(held)
        return out

    # ---- the whole map --------------------------------------------------------------------

    def items(self) -> list[tuple[K, int]]:
        """Every (key, code), the table's in slot order, then the others'."""
        live = np.flatnonzero(self._vals)
        vals = self._vals[live]
        keys: list[K] = self._keys[live].tolist()
        for i in np.flatnonzero(vals & _FLAG).tolist():
            keys[i] -= U64  # type: ignore[operator, assignment]
        codes: list[int] = (vals & ~_FLAG).tolist()
        return [*zip(keys, codes, strict=True), *self._other.items()]

    def __iter__(self) -> Iterator[K]:
        return (k for k, _ in self.items())

    def clear(self) -> None:
        """Forget every key (the table keeps its size)."""
        self._vals.fill(0)
        self._count = 0
        self._other.clear()


def warm_up() -> None:
    """Compile (or load) the kernels."""
    table: HashCodes[int] = HashCodes(8)
    table.put_run([1, 2, 3, 2**64 - 1], 1)
    table.put_run([-5, -6], 10)
    table.put_run(np.array([7, 8], dtype=np.uint64), 20)
    table.put(9, 30)
    table.get(9)
    table.pop(9)
    table.pop_run([1, 2, 3, 2**64 - 1])
    table.pop_run([-5, -6])
    table.put_run(list(range(100, 140)), 40)  # grows
