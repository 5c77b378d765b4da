"""The unkeyed block-hash chain as one compiled loop (numba): the same hashes as
:func:`kvroute_proto.hashing.block_hashes`' numpy closed form, several times faster on a
long prompt (one multiply-add per token in registers, no temporary arrays).

Imported only through :func:`kvroute_proto.hashing.enable_compiled`, which the router calls
(its index already compiles numba kernels); the worker keeps the numpy form and never
imports numba. Kernels are cached on disk where numba finds a writable place.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvroute_proto.hash_constants import _A, _F1, _F2, _MASK, _TOKEN_MUL, _TOKEN_XOR
from kvroute_proto.jit import jit

_UA = np.uint64(_A)
_UXOR = np.uint64(_TOKEN_XOR)
_UMUL = np.uint64(_TOKEN_MUL)
_UF1 = np.uint64(_F1)
_UF2 = np.uint64(_F2)
_U33 = np.uint64(33)


@jit
def _chain(tokens: Any, block_size: int, num_blocks: int, seed: Any, out: Any) -> None:
    """The chain s <- s * A + (token ^ XOR) * MUL, hashed (fmix64) at each block's end, in
    two passes (the same values mod 2**64): each block's own polynomial first,
    t_b = sum_j (t_j ^ XOR) * MUL * A**(B-1-j) -- a dot product with fixed weights, no
    multiply waiting on another, which the compiler turns into SIMD multiplies --, then
    s_b = s_(b-1) * A**B + t_b, one dependent step per block."""
    weights = np.empty(block_size, dtype=np.uint64)
    w = _UMUL
    for j in range(block_size - 1, -1, -1):
        weights[j] = w
        w *= _UA
    a_block = np.uint64(1)
    for _ in range(block_size):
        a_block *= _UA
    for b in range(num_blocks):
        base = b * block_size
        t = np.uint64(0)
        for j in range(block_size):
            t += (np.uint64(tokens[base + j]) ^ _UXOR) * weights[j]
        out[b] = t
    s = seed
    for b in range(num_blocks):
        s = s * a_block + out[b]
        h = s ^ (s >> _U33)
        h = h * _UF1
        h = h ^ (h >> _U33)
        h = h * _UF2
        out[b] = h ^ (h >> _U33)


def chain_hashes(tokens: np.ndarray, block_size: int, seed: int) -> np.ndarray:
    """Hashes of every full block of ``tokens`` (a uint32 or uint64 array of valid ids)."""
    num_blocks = len(tokens) // block_size
    out = np.empty(num_blocks, dtype=np.uint64)
    if num_blocks:
        _chain(tokens, block_size, num_blocks, np.uint64(seed & _MASK), out)
    return out


def warm_up() -> None:
    """Compile (or load) the kernel for the token dtypes callers pass."""
    for dtype in (np.uint32, np.uint64):
        chain_hashes(np.arange(32, dtype=dtype), 16, 1)
