"""The numba index's flat tables: their layout, how a block hash maps to a row (open
addressing, linear probing), and the small kernels every other kernel module builds on
(router.core.index_nb's docstring describes the tables).

Sans-I/O: imports neither asyncio, grpc, torch nor a clock.
"""

from __future__ import annotations

from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from kvroute_proto.jit import jit

U64Array: TypeAlias = npt.NDArray[np.uint64]  # a table, its keys, scratch bitset rows
I64Array: TypeAlias = npt.NDArray[np.int64]  # counters: _meta, per-slot counts, answers
F64Array: TypeAlias = npt.NDArray[np.float64]  # deadlines

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
_AHEAD = 8  # keys whose home row is prefetched ahead of the walk


# ---- hashing of keys, rows ---------------------------------------------------------------


@jit
def _key(h: np.uint64) -> np.uint64:
    return _ZERO if h == _NIL else h


@jit
def _unkey(k: np.uint64) -> np.uint64:
    return _NIL if k == _ZERO else k


@jit
def _held(tab: U64Array, r: int, base: int) -> bool:
    """Whether row ``r`` has any bit set in its worker words (columns ``base`` ..)."""
    for c in range(base, tab.shape[1]):  # noqa: SIM110 (a loop numba compiles)
        if tab[r, c] != _NIL:
            return True
    return False


@jit
def _home(k: np.uint64, mask: int) -> int:
    return int((k * _MULT) >> _S32) & mask


@jit
def _find(tab: U64Array, k: np.uint64) -> int:
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


@jit
def _popcount(x: np.uint64) -> int:
    x = x - ((x >> np.uint64(1)) & np.uint64(0x5555555555555555))
    x = (x & np.uint64(0x3333333333333333)) + ((x >> np.uint64(2)) & np.uint64(0x3333333333333333))
    x = (x + (x >> np.uint64(4))) & np.uint64(0x0F0F0F0F0F0F0F0F)
    return int((x * np.uint64(0x0101010101010101)) >> np.uint64(56))


@jit
def _bit(slot: int) -> np.uint64:
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


# ---- a binary heap of (primary, secondary) pairs in two arrays ---------------------------


@jit
def _heap_push(
    prim: np.ndarray, sec: np.ndarray, size: int, p: np.uint64 | float, s: np.uint64
) -> int:
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


@jit
def _heap_pop(prim: np.ndarray, sec: np.ndarray, size: int) -> int:
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
