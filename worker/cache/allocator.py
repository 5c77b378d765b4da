"""KV slot allocator: a free list of slot indices the radix cache and the scheduler share.

Pure Python + numpy; imports neither asyncio, grpc, torch nor a clock.

A slot is one token's KV row in the pool. Free slots are ``_stack[_head:]``: alloc takes
the first n (a contiguous copy) and free writes slots back just below the head, so the most
recently freed slots are reused first. A bool ``allocated`` mask makes misuse detectable in
O(k) per call: freeing a slot that is not allocated (double free, or never handed out)
raises ValueError and changes nothing.
"""

from __future__ import annotations

import numpy as np

_EMPTY = np.empty(0, dtype=np.int64)
_EMPTY.flags.writeable = False


class SlotAllocator:
    """Hands out and takes back int64 KV slot indices in ``[0, num_slots)``."""

    __slots__ = ("_allocated", "_head", "_mark", "_stack", "num_slots")

    def __init__(self, num_slots: int) -> None:
        if not isinstance(num_slots, int) or isinstance(num_slots, bool) or num_slots < 0:
            raise ValueError(f"num_slots must be a non-negative int, got {num_slots!r}")
        self.num_slots = num_slots
        # Free slots live in _stack[_head:]; a fresh allocator hands out 0, 1, 2, ...
        self._stack = np.arange(num_slots, dtype=np.int64)
        self._head = 0
        self._allocated = np.zeros(num_slots, dtype=bool)
        self._mark = np.zeros(num_slots, dtype=np.int64)  # scratch for duplicate detection

    @property
    def num_free(self) -> int:
        """Slots that alloc can hand out right now."""
        return self.num_slots - self._head

    @property
    def num_allocated(self) -> int:
        return self._head

    def alloc(self, n: int) -> np.ndarray | None:
        """Take ``n`` free slots (a new int64 array); None when fewer than ``n`` are free."""
        if n < 0:
            raise ValueError(f"alloc(n): n must be >= 0, got {n}")
        head = self._head
        if n > self.num_slots - head:
            return None
        if n == 0:
            return _EMPTY.copy()
        slots = self._stack[head : head + n].copy()
        self._head = head + n
        self._allocated[slots] = True
        return slots

    def free(self, slots: np.ndarray) -> None:
        """Give slots back. Raises ValueError (and frees nothing) if any slot is out of range,
        not currently allocated, or listed twice."""
        arr = np.asarray(slots)
        k = arr.size
        if k == 0:
            return
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise TypeError(f"free(slots): expected a 1-D int array, got {arr.dtype} {arr.shape}")
        arr = arr.astype(np.int64, copy=False)
        # One unsigned compare catches negatives and values >= num_slots alike.
        if int(arr.view(np.uint64).max()) >= self.num_slots:
            bad = arr[(arr < 0) | (arr >= self.num_slots)][0]
            raise ValueError(f"free(slots): slot {int(bad)} is outside [0, {self.num_slots})")
        allocated = self._allocated
        if not allocated[arr].all():
            bad = arr[~allocated[arr]][0]
            raise ValueError(f"free(slots): slot {int(bad)} is not allocated (double free?)")
        if k > 1:
            # Duplicate detection in O(k): write each position's index at its slot; a slot
            # listed twice cannot read back both positions' indices.
            positions = np.arange(k, dtype=np.int64)
            mark = self._mark
            mark[arr] = positions
            if (mark[arr] != positions).any():
                raise ValueError("free(slots): a slot is listed more than once (double free)")
        allocated[arr] = False
        head = self._head - k
        self._stack[head : head + k] = arr
        self._head = head

    def is_allocated(self, slots: np.ndarray) -> np.ndarray:
        """Bool per slot: currently handed out (for leak checks in tests)."""
        return self._allocated[np.asarray(slots, dtype=np.int64)]

    def allocated_slots(self) -> np.ndarray:
        """Every currently allocated slot, ascending (O(num_slots); for tests)."""
        return np.flatnonzero(self._allocated).astype(np.int64)
