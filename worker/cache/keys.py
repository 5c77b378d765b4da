"""Validation of cache inputs: token ids and KV slot arrays.

Pure Python + numpy; imports neither asyncio, grpc, torch nor a clock. Every error names
the argument and the limit, and is raised before the cache changes anything.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvroute_proto.hashing import MAX_TOKEN_ID

_I64 = np.int64
_U64 = np.uint64


def _as_int_array(values: Any, name: str) -> np.ndarray:
    """A 1-D, C-contiguous int64 array of ``values`` (TypeError for non-integers)."""
    if isinstance(values, np.ndarray):
        arr = values
        if arr.dtype.kind not in "iu":
            raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    else:
        try:
            arr = np.asarray(values)
        except (TypeError, ValueError, OverflowError) as exc:
            raise TypeError(f"{name} must be a sequence of ints: {exc}") from None
        if arr.size == 0:
            arr = arr.astype(_I64)
        elif arr.dtype.kind not in "iu":
            raise TypeError(f"{name} must be a sequence of ints, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > np.iinfo(_I64).max:
        raise ValueError(f"{name} holds a value above the int64 range")
    if arr.dtype != _I64 or not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr, dtype=_I64)
    return arr


_I64_DTYPE = np.dtype(_I64)
_OR = np.bitwise_or.reduce


def as_tokens(token_ids: Any) -> np.ndarray:
    """Token ids as a contiguous int64 array; ValueError unless every id is in [0, 2**32)."""
    arr = token_ids
    if not (
        type(arr) is np.ndarray
        and arr.dtype is _I64_DTYPE
        and arr.ndim == 1
        and arr.flags.c_contiguous
    ):
        arr = _as_int_array(token_ids, "token_ids")
    # An id is in [0, 2**32) iff its upper 32 bits (sign included) are zero, so one OR
    # reduction checks both bounds for the whole key.
    if arr.size and int(_OR(arr)) >> 32:
        bad = int(np.flatnonzero(arr.view(_U64) > MAX_TOKEN_ID)[0])
        raise ValueError(f"token_ids[{bad}]={int(arr[bad])} is outside [0, {MAX_TOKEN_ID}]")
    return arr


def as_slots(slots: Any, num_tokens: int, num_slots: int) -> np.ndarray:
    """KV slots as a contiguous int64 array of length ``num_tokens``, each in [0, num_slots)."""
    arr = _as_int_array(slots, "slots")
    if len(arr) != num_tokens:
        raise ValueError(f"slots has length {len(arr)}, must equal len(token_ids)={num_tokens}")
    if arr.size and int(arr.view(_U64).max()) >= num_slots:
        bad = int(np.flatnonzero(arr.view(_U64) >= num_slots)[0])
        raise ValueError(f"slots[{bad}]={int(arr[bad])} is outside [0, {num_slots})")
    return arr


def check_priority(priority: Any) -> None:
    """A request priority must be a plain int (it is compared and stored on nodes)."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise TypeError(f"priority must be an int, got {type(priority).__name__}")
