"""The numba index's arrays and their upkeep: the confirmed and predicted tables, the
expiry records, the walks' scratch rows, and their growth, rebuilds and shrinking
(router.core.index_nb's docstring describes the tables; router.core.index_nb.NumbaPrefixIndex
is the index on them).

Sans-I/O: imports neither asyncio, grpc, torch nor a clock.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import cast, overload

import numpy as np

from kvroute_proto.codec import PackedHashes
from router.core.index_nb_confirmed import _check, _drop_empty, _grow_in_place
from router.core.index_nb_predicted import _rehash_pred
from router.core.index_nb_table import (
    _GROW_LOAD,
    _M_LIVE,
    _M_USED,
    _MASK,
    _MIN_CAP,
    _MIN_RECORDS,
    _P_HEAD,
    _P_HEAP,
    _P_LIVE,
    _P_ROWS,
    _P_TAIL,
    _PBITS,
    _PHELD,
    _RESIZE_LOAD,
    _U64,
    _find,
)

__all__ = ["NumbaTables", "Probes"]


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


def _is_u64(item: object) -> bool:
    """Whether CPython's PyLong_AsUnsignedLongLong takes ``item`` (router.core.index_capi)."""
    return isinstance(item, int) and 0 <= item < 1 << 64


def _as_keys(hashes: Sequence[int] | np.ndarray) -> np.ndarray:
    """Block hashes as a C-contiguous uint64 array (raw: kernels map 0 themselves)."""
    if type(hashes) is np.ndarray and hashes.dtype == _U64 and hashes.flags.c_contiguous:
        return hashes
    if type(hashes) is PackedHashes and _WIRE_NATIVE:  # decoded events: the wire's words
        return cast(PackedHashes, hashes).array
    if isinstance(hashes, Probes):
        return hashes.keys
    return np.ascontiguousarray(np.asarray(hashes, dtype=_U64))


class NumbaTables:
    """The arrays a :class:`router.core.index_nb.NumbaPrefixIndex` keeps, sized for
    ``stride`` (the prediction stride: the scratch rows a query needs) and ``max_blocks``
    (the size cap apply_wire's kernel checks)."""

    def __init__(self, stride: int, max_blocks: int) -> None:
        self._stride = stride
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
        # the dict index's eviction trigger and compaction rule, kept alike (its largest
        # size since it last compacted or evicted)
        # (its peak is kept in apply_wire's state, [0]: see _peak)
        self._wire_state = np.zeros(5, dtype=np.int64)  # apply_wire's (see _apply_wire)
        self._wire_state[1] = max_blocks

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

    def _check_tables(self) -> None:
        """Assert the tables' invariants (for tests; O(size))."""
        used = int(self._meta[_M_USED])
        code = _check(self._tab, self._counts, int(self._meta[_M_LIVE]), used)
        assert code == 0, f"confirmed table inconsistent (code {code})"
        assert self._tab.shape[0] * _GROW_LOAD >= used >= int(self._meta[_M_LIVE])
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
