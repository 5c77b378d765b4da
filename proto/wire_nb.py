"""A compiled scan of a ``KvStreamMessage`` holding an ``EventBatch`` (numba): where each
field of the batch and of its events lies in the wire bytes, so ``codec`` builds the events
from byte slices instead of through the protobuf runtime's per-field accessors.

Only what ``codec.encode_stream_message`` writes is taken: each field number and wire type
the contract defines, once for singular fields, varints that fit their field. Anything else
-- a snapshot, an unknown or repeated singular field, a second event kind, a truncated or
overlong length, a varint past its type -- makes the scan answer ``IRREGULAR`` and the codec
decodes the message with the protobuf runtime instead (which then accepts it, merging as
protobuf does, or raises the contract's error). Kept beside the runtime for a measured need:
decision 0002. The router imports it (``codec.
enable_compiled_decode``); a worker never does.

Layout of ``out`` (uint64) after a scan that returned ``n`` >= 0 events::

    out[0], out[1]   worker_id: offset, length     out[2] epoch   out[3] seq
    out[4]           block_size                     out[5] 1 when a LoadReport is present
    out[6:12]        the LoadReport's six fields
    out[12]          (scan_batch) the number of events
    out[13]          (scan_batch) 1 when the batch is plain: every stored event's token ids
                     are block_size uint32 ids per block and its partition is the default
                     (no cache_salt, no extra_key) -- what router.core.index_nb.apply_wire takes
    out[16 + 12 * e + k], event e:
        k = 0  kind (1 stored, 2 removed, 3 cleared)
            1, 2  block_hashes: offset, length      3 has_parent   4 parent_hash
            5, 6  token_ids: offset, length
            7, 8  partition.cache_salt: offset, length
            9, 10 partition.extra_key: offset, length
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvroute_proto.jit import jit

__all__ = ["HEADER", "NUM_EVENTS", "PER_EVENT", "PLAIN", "scan_batch", "warm_up"]

HEADER = 16
PER_EVENT = 12
NUM_EVENTS = 12  # where scan_batch's answer says how many events follow the header
PLAIN = 13  # where it says whether the batch is plain (see the layout)
IRREGULAR = -1  # not what the encoder writes: decode with the protobuf runtime
NO_ROOM = -2  # more events than ``out`` holds: call again with a larger one

_LEN = 2
_VARINT = 0
_U32_LIMIT = np.uint64(1 << 32)


@jit
def _varint(buf: Any, pos: int, end: int) -> tuple[Any, int]:
    """The varint at ``pos`` and the position after it; position -1 when it is truncated
    or does not fit 64 bits."""
    result = np.uint64(0)
    shift = 0
    while pos < end:
        b = buf[pos]
        pos += 1
        if shift == 63 and b > 1:
            return np.uint64(0), -1
        result |= np.uint64(b & 0x7F) << np.uint64(shift)
        if b < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            return np.uint64(0), -1
    return np.uint64(0), -1


@jit
def _span(buf: Any, pos: int, end: int) -> tuple[int, int]:
    """A length-delimited field's (start, end) after its tag; (-1, -1) when it overruns."""
    n, pos = _varint(buf, pos, end)
    if pos < 0 or n > np.uint64(end - pos):
        return -1, -1
    return pos, pos + int(n)


@jit
def _partition(buf: Any, pos: int, end: int, out: Any, base: int) -> int:
    seen = 0
    while pos < end:
        tag, pos = _varint(buf, pos, end)
        if pos < 0:
            return IRREGULAR
        field = int(tag >> np.uint64(3))
        if int(tag & np.uint64(7)) != _LEN or field < 1 or field > 2 or seen & (1 << field):
            return IRREGULAR
        seen |= 1 << field
        a, b = _span(buf, pos, end)
        if a < 0:
            return IRREGULAR
        out[base + 5 + 2 * field] = a  # salt at 7, 8; extra key at 9, 10
        out[base + 6 + 2 * field] = b - a
        pos = b
    return 0


@jit
def _stored(buf: Any, pos: int, end: int, out: Any, base: int) -> int:
    seen = 0
    while pos < end:
        tag, pos = _varint(buf, pos, end)
        if pos < 0:
            return IRREGULAR
        field = int(tag >> np.uint64(3))
        wire = int(tag & np.uint64(7))
        if field < 1 or field > 5 or seen & (1 << field):
            return IRREGULAR
        seen |= 1 << field
        if field == 2 or field == 3:
            if wire != _VARINT:
                return IRREGULAR
            v, pos = _varint(buf, pos, end)
            if pos < 0:
                return IRREGULAR
            if field == 2:
                out[base + 3] = 1 if v != np.uint64(0) else 0
            else:
                out[base + 4] = v
            continue
        if wire != _LEN:
            return IRREGULAR
        a, b = _span(buf, pos, end)
        if a < 0:
            return IRREGULAR
        if field == 1:
            out[base + 1] = a
            out[base + 2] = b - a
        elif field == 4:
            out[base + 5] = a
            out[base + 6] = b - a
        elif _partition(buf, a, b, out, base) < 0:
            return IRREGULAR
        pos = b
    return 0


@jit
def _event(buf: Any, pos: int, end: int, out: Any, base: int) -> int:
    for k in range(PER_EVENT):
        out[base + k] = 0
    kind = 0
    while pos < end:
        tag, pos = _varint(buf, pos, end)
        if pos < 0 or kind:  # a second kind: protobuf keeps the last; leave it to it
            return IRREGULAR
        field = int(tag >> np.uint64(3))
        if int(tag & np.uint64(7)) != _LEN or field < 1 or field > 3:
            return IRREGULAR
        a, b = _span(buf, pos, end)
        if a < 0:
            return IRREGULAR
        kind = field
        if field == 1:
            if _stored(buf, a, b, out, base) < 0:
                return IRREGULAR
        elif field == 2:
            while a < b:  # BlockRemoved: block_hashes only
                tag, a = _varint(buf, a, b)
                if a < 0 or tag != np.uint64(1 << 3 | _LEN) or out[base + 2] or out[base + 1]:
                    return IRREGULAR
                x, y = _span(buf, a, b)
                if x < 0:
                    return IRREGULAR
                out[base + 1] = x
                out[base + 2] = y - x
                a = y
        elif b != a:  # AllCleared has no fields
            return IRREGULAR
        pos = b
    if not kind:
        return IRREGULAR
    out[base] = kind
    return 0


@jit
def _load(buf: Any, pos: int, end: int, out: Any) -> int:
    seen = 0
    while pos < end:
        tag, pos = _varint(buf, pos, end)
        if pos < 0:
            return IRREGULAR
        field = int(tag >> np.uint64(3))
        if int(tag & np.uint64(7)) != _VARINT or field < 1 or field > 6 or seen & (1 << field):
            return IRREGULAR
        seen |= 1 << field
        v, pos = _varint(buf, pos, end)
        if pos < 0 or (field <= 2 and v >= _U32_LIMIT):
            return IRREGULAR
        out[5 + field] = v
    return 0


@jit
def _scan(buf: Any, out: Any) -> int:
    """Scan the wire bytes ``buf`` of a KvStreamMessage that holds an EventBatch into
    ``out``'s layout; returns the number of events, IRREGULAR, or NO_ROOM."""
    end = len(buf)
    if end < 1 or buf[0] != np.uint8(1 << 3 | _LEN):  # field 1 (batch), length-delimited
        return IRREGULAR
    pos, stop = _span(buf, 1, end)
    if pos < 0 or stop != end:  # anything after the batch: the protobuf runtime merges it
        return IRREGULAR
    for k in range(HEADER):
        out[k] = 0
    seen = 0
    n = 0
    while pos < end:
        tag, pos = _varint(buf, pos, end)
        if pos < 0:
            return IRREGULAR
        field = int(tag >> np.uint64(3))
        wire = int(tag & np.uint64(7))
        if field < 1 or field > 6 or (field != 5 and seen & (1 << field)):
            return IRREGULAR
        seen |= 1 << field
        if 2 <= field <= 4:
            if wire != _VARINT:
                return IRREGULAR
            v, pos = _varint(buf, pos, end)
            if pos < 0 or (field == 4 and v >= _U32_LIMIT):
                return IRREGULAR
            out[field] = v
            continue
        if wire != _LEN:
            return IRREGULAR
        a, b = _span(buf, pos, end)
        if a < 0:
            return IRREGULAR
        if field == 1:
            out[0] = a
            out[1] = b - a
        elif field == 5:
            base = HEADER + PER_EVENT * n
            if base + PER_EVENT > out.shape[0]:
                return NO_ROOM
            if _event(buf, a, b, out, base) < 0:
                return IRREGULAR
            n += 1
        else:
            out[5] = 1
            if _load(buf, a, b, out) < 0:
                return IRREGULAR
        pos = b
    return n


@jit
def scan_batch(buf: Any) -> Any:
    """The layout of the EventBatch in the wire bytes ``buf`` (a KvStreamMessage; see the
    module's layout), its event count at [NUM_EVENTS], and every event's block hashes
    decoded into the array after the layout: [k + 1] and [k + 2] of a stored or removed
    event are then where its hashes lie in the array and how many. An empty array when the
    bytes are not what the encoder writes, or an event's hashes are not a non-empty whole
    number of uint64 words (the codec's error then names the field)."""
    events = 16
    while True:
        out = np.empty(HEADER + PER_EVENT * events, dtype=np.uint64)
        n = _scan(buf, out)
        if n != NO_ROOM:
            break
        events *= 4
    if n < 0:
        return np.empty(0, dtype=np.uint64)
    layout = HEADER + PER_EVENT * n
    words = 0
    for e in range(n):
        if out[HEADER + PER_EVENT * e] == np.uint64(3):  # cleared
            continue
        size = int(out[HEADER + PER_EVENT * e + 2])
        if size == 0 or size % 8:  # the codec's error names the field
            return np.empty(0, dtype=np.uint64)
        words += size // 8
    res = np.empty(layout + words, dtype=np.uint64)
    res[:layout] = out[:layout]
    res[NUM_EVENTS] = n
    block_size = res[4]
    plain = 1
    w = layout
    for e in range(n):
        base = HEADER + PER_EVENT * e
        start = int(res[base + 1])
        size = int(res[base + 2])
        if res[base] == np.uint64(3):
            continue
        if res[base] == np.uint64(1) and (
            res[base + 6] != np.uint64(size // 8) * block_size * np.uint64(4)
            or res[base + 8] != np.uint64(0)
            or res[base + 10] != np.uint64(0)
        ):
            plain = 0
        for i in range(size // 8):
            x = np.uint64(0)
            for j in range(8):
                x |= np.uint64(buf[start + 8 * i + j]) << np.uint64(8 * j)
            res[w + i] = x
        res[base + 1] = w
        res[base + 2] = size // 8
        w += size // 8
    res[PLAIN] = plain
    return res


def warm_up() -> None:
    """Compile (or load from numba's cache) the scan for the types the codec passes."""
    scan_batch(b"")
