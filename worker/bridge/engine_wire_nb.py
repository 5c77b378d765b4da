"""An engine event's token ids, read straight from their msgpack bytes (numba).

Imported only through :func:`worker.bridge.engine_wire.enable_compiled` (``kvroute bridge``
calls it): msgspec would make a Python int of every id and numpy convert them again; this
loop writes them into a uint32 array from the bytes msgspec hands over as ``msgspec.Raw``.
Kernels are cached on disk where numba finds a writable place.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvroute_proto.jit import jit


@jit
def _scan(buf: Any, out: Any) -> Any:
    """Write the msgpack array of unsigned ints (at most 32 bits) in ``buf`` to ``out``
    (of ``len(buf)``, which no array of n ids is shorter than); its length, or -1 when
    ``buf`` is anything else (a signed or 64-bit encoding, another type, trailing bytes)."""
    n = len(buf)
    if n == 0:
        return -1
    head = np.int64(buf[0])  # int64 throughout: numba makes mixed uint64/int64 a float
    if head & 0xF0 == 0x90:
        count, i = head & 0x0F, np.int64(1)
    elif head == 0xDC and n >= 3:
        count, i = (np.int64(buf[1]) << 8) | np.int64(buf[2]), np.int64(3)
    elif head == 0xDD and n >= 5:
        count = (
            (np.int64(buf[1]) << 24)
            | (np.int64(buf[2]) << 16)
            | (np.int64(buf[3]) << 8)
            | np.int64(buf[4])
        )
        i = np.int64(5)
    else:
        return -1
    if count > n:
        return -1
    for k in range(count):
        if i >= n:
            return -1
        b = buf[i]
        if b < 0x80:  # positive fixint
            out[k] = b
            i += 1
        elif b == 0xCC and i + 1 < n:
            out[k] = buf[i + 1]
            i += 2
        elif b == 0xCD and i + 2 < n:
            out[k] = (np.uint32(buf[i + 1]) << 8) | buf[i + 2]
            i += 3
        elif b == 0xCE and i + 4 < n:
            out[k] = (
                (np.uint32(buf[i + 1]) << 24)
                | (np.uint32(buf[i + 2]) << 16)
                | (np.uint32(buf[i + 3]) << 8)
                | buf[i + 4]
            )
            i += 5
        else:
            return -1
    return count if i == n else -1


def token_ids(raw: bytes | memoryview) -> np.ndarray | None:
    """The uint32 ids of the msgpack array ``raw``, or None when it is not an array of
    unsigned ints of at most 32 bits."""
    buf = np.frombuffer(raw, dtype=np.uint8)
    out = np.empty(len(buf), dtype=np.uint32)
    count = int(_scan(buf, out))
    return None if count < 0 else out[:count]


def warm_up() -> None:
    """Compile (or load) the kernel."""
    token_ids(b"\x94\x01\xcc\x80\xcd\x01\x00\xce\x00\x01\x00\x00")
