"""Codec between the event dataclasses and their protobuf messages.

The only module of the contract that touches generated protobuf classes. Decoding validates
everything a peer could get wrong and raises :class:`ContractError` naming the field.

Block hashes travel as little-endian uint64 bytes and token ids as little-endian uint32 bytes:
numpy decodes them in one call, which keeps event ingestion cheap at the router.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, overload

import numpy as np

from kvroute_proto import kvroute_pb2 as pb
from kvroute_proto.errors import ContractError
from kvroute_proto.events import (
    DEFAULT_PARTITION,
    AllCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KvEvent,
    LoadReport,
    Partition,
    Snapshot,
)

_HASH_DT = np.dtype("<u8")
_U64_MAX = 2**64 - 1
_CLEARED = AllCleared()


# ---- encoding --------------------------------------------------------------------------


def _hash_bytes(hashes: tuple[int, ...]) -> bytes:
    return np.asarray(hashes, dtype=_HASH_DT).tobytes()


def partition_to_pb(partition: Partition) -> pb.Partition:
    return pb.Partition(cache_salt=partition.cache_salt, extra_key=partition.extra_key)


def _stored_to_pb(ev: BlockStored) -> pb.BlockStored:
    msg = pb.BlockStored(
        block_hashes=_hash_bytes(ev.block_hashes),
        token_ids=ev.token_ids,
        partition=partition_to_pb(ev.partition),
    )
    if ev.parent_hash is not None:
        msg.has_parent = True
        msg.parent_hash = ev.parent_hash
    return msg


def event_to_pb(ev: KvEvent) -> pb.KvEvent:
    match ev:
        case BlockStored():
            return pb.KvEvent(stored=_stored_to_pb(ev))
        case BlockRemoved(block_hashes=hashes):
            return pb.KvEvent(removed=pb.BlockRemoved(block_hashes=_hash_bytes(hashes)))
        case AllCleared():
            return pb.KvEvent(cleared=pb.AllCleared())
    raise TypeError(f"not a KV event: {ev!r}")


def load_to_pb(load: LoadReport) -> pb.LoadReport:
    return pb.LoadReport(
        num_running=load.num_running,
        num_waiting=load.num_waiting,
        num_queued_prefill_tokens=load.num_queued_prefill_tokens,
        num_free_kv_tokens=load.num_free_kv_tokens,
        num_evictable_kv_tokens=load.num_evictable_kv_tokens,
        num_total_kv_tokens=load.num_total_kv_tokens,
    )


def batch_to_pb(batch: EventBatch) -> pb.EventBatch:
    msg = pb.EventBatch(
        worker_id=batch.worker_id,
        epoch=batch.epoch,
        seq=batch.seq,
        block_size=batch.block_size,
        events=[event_to_pb(ev) for ev in batch.events],
    )
    if batch.load is not None:
        msg.load.CopyFrom(load_to_pb(batch.load))
    return msg


def snapshot_to_pb(snap: Snapshot) -> pb.Snapshot:
    return pb.Snapshot(
        worker_id=snap.worker_id,
        epoch=snap.epoch,
        seq=snap.seq,
        block_size=snap.block_size,
        blocks=[_stored_to_pb(b) for b in snap.blocks],
    )


def stream_message_to_pb(item: EventBatch | Snapshot) -> pb.KvStreamMessage:
    if isinstance(item, EventBatch):
        return pb.KvStreamMessage(batch=batch_to_pb(item))
    if isinstance(item, Snapshot):
        return pb.KvStreamMessage(snapshot=snapshot_to_pb(item))
    raise TypeError(f"not an EventBatch or Snapshot: {item!r}")


def encode_stream_message(item: EventBatch | Snapshot) -> bytes:
    """Wire bytes of a stream message (what the worker sends)."""
    return stream_message_to_pb(item).SerializeToString()


def run_to_pb(messages: Sequence[pb.KvStreamMessage]) -> pb.KvStreamMessage:
    """Consecutive batch messages as one ``EventBatchRun`` message (decision 0056)."""
    return pb.KvStreamMessage(run=pb.EventBatchRun(batches=[m.batch for m in messages]))


# ---- decoding --------------------------------------------------------------------------


class PackedHashes(Sequence[int]):
    """Block hashes decoded from the wire: the wire's little-endian uint64 words as a
    read-only array (:attr:`array`), read as a sequence of ints. An index that works on
    arrays (router.core.index_nb) takes the array as it is; the ints are made only when someone
    reads them (once, then kept). Equal to -- and hashes as -- the tuple of the same ints,
    so events holding it compare equal to events built with tuples."""

    __slots__ = ("_ints", "array")

    def __init__(self, array: np.ndarray) -> None:
        self.array = array
        self._ints: tuple[int, ...] | None = None

    def ints(self) -> tuple[int, ...]:
        """The hashes as a tuple of Python ints."""
        if self._ints is None:
            self._ints = tuple(self.array.tolist())
        return self._ints

    def __len__(self) -> int:
        return len(self.array)

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[int, ...]: ...
    def __getitem__(self, i: int | slice) -> int | tuple[int, ...]:
        return self.ints()[i]

    def __iter__(self) -> Iterator[int]:
        return iter(self.ints())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedHashes):
            return np.array_equal(self.array, other.array)
        if isinstance(other, tuple):
            return self.ints() == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.ints())

    def __repr__(self) -> str:
        return f"PackedHashes({self.ints()!r})"

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        array = self.array if dtype is None else self.array.astype(dtype, copy=False)
        return array.copy() if copy else array

    def __reduce__(self) -> tuple[Any, ...]:
        return (_unpickle_hashes, (self.array.tobytes(),))


def _unpickle_hashes(data: bytes) -> PackedHashes:
    return PackedHashes(np.frombuffer(data, dtype=_HASH_DT))


def _decode_hashes(data: bytes, where: str, i: int) -> PackedHashes:
    """``where.format(i)`` names the message in errors (formatted only on an error)."""
    if len(data) == 0 or len(data) % 8:
        raise ContractError(
            f"{where.format(i)}.block_hashes must be a non-empty multiple of 8 bytes, "
            f"got {len(data)}"
        )
    return PackedHashes(np.frombuffer(data, dtype=_HASH_DT))


def partition_from_pb(msg: pb.Partition) -> Partition:
    salt, extra = msg.cache_salt, msg.extra_key
    if not salt and not extra:  # the common case: one shared object, not a new one
        return DEFAULT_PARTITION
    return Partition(cache_salt=salt, extra_key=extra)


def _stored_from_pb(msg: pb.BlockStored, block_size: int, where: str, i: int) -> BlockStored:
    hashes = _decode_hashes(msg.block_hashes, where, i)
    tokens = msg.token_ids
    expected = len(hashes) * block_size * 4
    if len(tokens) != expected:
        raise ContractError(
            f"{where.format(i)}.token_ids must hold block_size={block_size} uint32 ids for "
            f"each of {len(hashes)} blocks ({expected} bytes), got {len(tokens)} bytes"
        )
    parent = msg.parent_hash if msg.has_parent else None
    return BlockStored(hashes, parent, tokens, partition_from_pb(msg.partition))


def _event_from_pb(msg: pb.KvEvent, block_size: int, i: int) -> KvEvent:
    kind = msg.WhichOneof("kind")
    if kind == "stored":
        return _stored_from_pb(msg.stored, block_size, "EventBatch.events[{}].stored", i)
    if kind == "removed":
        return BlockRemoved(
            _decode_hashes(msg.removed.block_hashes, "EventBatch.events[{}].removed", i)
        )
    if kind == "cleared":
        return _CLEARED
    raise ContractError(f"EventBatch.events[{i}] has no event kind set")


def _check_header(worker_id: str, epoch: int, seq: int, block_size: int, what: str) -> None:
    if not worker_id:
        raise ContractError(f"{what}.worker_id must not be empty")
    if epoch == 0:
        raise ContractError(f"{what}.epoch must be >= 1, got 0")
    if block_size <= 0:
        raise ContractError(f"{what}.block_size must be >= 1, got {block_size}")


def load_from_pb(msg: pb.LoadReport) -> LoadReport:
    return LoadReport(
        num_running=msg.num_running,
        num_waiting=msg.num_waiting,
        num_queued_prefill_tokens=msg.num_queued_prefill_tokens,
        num_free_kv_tokens=msg.num_free_kv_tokens,
        num_evictable_kv_tokens=msg.num_evictable_kv_tokens,
        num_total_kv_tokens=msg.num_total_kv_tokens,
    )


def batch_from_pb(msg: pb.EventBatch) -> EventBatch:
    """Decode and validate an EventBatch; raises ContractError when malformed."""
    worker_id, epoch, seq, block_size = msg.worker_id, msg.epoch, msg.seq, msg.block_size
    _check_header(worker_id, epoch, seq, block_size, "EventBatch")
    if seq == 0:
        raise ContractError("EventBatch.seq must be >= 1, got 0")
    events = tuple(_event_from_pb(ev, block_size, i) for i, ev in enumerate(msg.events))
    load = load_from_pb(msg.load) if msg.HasField("load") else None
    return EventBatch(worker_id, epoch, seq, block_size, events, load)


def snapshot_from_pb(msg: pb.Snapshot) -> Snapshot:
    """Decode and validate a Snapshot; raises ContractError when malformed."""
    _check_header(msg.worker_id, msg.epoch, msg.seq, msg.block_size, "Snapshot")
    block_size = msg.block_size
    blocks = tuple(
        _stored_from_pb(b, block_size, "Snapshot.blocks[{}]", i) for i, b in enumerate(msg.blocks)
    )
    return Snapshot(msg.worker_id, msg.epoch, msg.seq, msg.block_size, blocks)


def stream_message_from_pb(msg: pb.KvStreamMessage) -> EventBatch | Snapshot:
    """Decode and validate a parsed stream message (the router's service decodes the wire
    bytes instead: :func:`decode_stream_lazy`)."""
    kind = msg.WhichOneof("kind")
    if kind == "batch":
        return batch_from_pb(msg.batch)
    if kind == "snapshot":
        return snapshot_from_pb(msg.snapshot)
    if kind == "run":
        raise ContractError("KvStreamMessage is an EventBatchRun: split it (stream_parts) first")
    raise ContractError("KvStreamMessage has neither batch nor snapshot set")


_SCAN: Callable[[bytes], np.ndarray] | None = None  # enable_compiled_decode()


def enable_compiled_decode() -> bool:
    """Decode event batches with the compiled scan (``kvroute_proto.wire_nb``, numba) from
    now on in this process: the same events, or the same error, with fewer Python objects
    built on the way. The router calls it (its index compiles numba kernels anyway);
    False, and nothing changes, where numba cannot be imported."""
    global _SCAN
    if _SCAN is None:
        try:
            from kvroute_proto import wire_nb
        except ImportError:
            return False
        wire_nb.warm_up()
        _SCAN = wire_nb.scan_batch
    return True


# Constructors of the frozen event classes that set their slots directly: a frozen
# dataclass's __init__ sets each field through object.__setattr__, half of what building a
# decoded batch costs otherwise. Only for values __init__ would store as they are (token ids
# as bytes: BlockStored.__post_init__ has nothing to pack); tests/proto/test_codec.py
# checks they build equal objects and that the classes' fields are still these.
_new = object.__new__
_eb_set = tuple(
    getattr(EventBatch, f).__set__
    for f in ("worker_id", "epoch", "seq", "block_size", "events", "load")
)
_bs_set = tuple(
    getattr(BlockStored, f).__set__
    for f in ("block_hashes", "parent_hash", "token_ids", "partition")
)
_br_set = vars(BlockRemoved)["block_hashes"].__set__


def _event_batch(
    worker_id: str,
    epoch: int,
    seq: int,
    block_size: int,
    events: tuple[KvEvent, ...] | None,
    load: LoadReport | None,
    cls: type[EventBatch] = EventBatch,
) -> EventBatch:
    obj = _new(cls)
    w, e, s, b, v, lo = _eb_set
    w(obj, worker_id)
    e(obj, epoch)
    s(obj, seq)
    b(obj, block_size)
    v(obj, events)
    lo(obj, load)
    return obj


def _block_stored(
    hashes: PackedHashes, parent: int | None, token_ids: bytes, partition: Partition
) -> BlockStored:
    obj = _new(BlockStored)
    h, p, t, q = _bs_set
    h(obj, hashes)
    p(obj, parent)
    t(obj, token_ids)
    q(obj, partition)
    return obj


_ph_array = vars(PackedHashes)["array"].__set__
_ph_ints = vars(PackedHashes)["_ints"].__set__


def _packed(array: np.ndarray) -> PackedHashes:
    """PackedHashes(array), its two slots set directly."""
    obj = _new(PackedHashes)
    _ph_array(obj, array)
    _ph_ints(obj, None)
    return obj


def _block_removed(hashes: PackedHashes) -> BlockRemoved:
    obj = _new(BlockRemoved)
    _br_set(obj, hashes)
    return obj


def _string(data: bytes, start: int, length: int) -> str | None:
    try:
        return data[start : start + length].decode()
    except UnicodeDecodeError:
        return None


def _header(data: bytes, out: np.ndarray) -> tuple[str, int, int, int, LoadReport | None] | None:
    """A scanned batch's worker id, epoch, seq, block size and load report; None when one
    the contract requires is missing (protobuf's decode then names it)."""
    o = out[:12].tolist()
    worker_id = _string(data, o[0], o[1])
    epoch, seq, block_size = o[2], o[3], o[4]
    if not worker_id or not epoch or not seq or not block_size:
        return None
    return worker_id, epoch, seq, block_size, LoadReport(*o[6:12]) if o[5] else None


def _batch_from_layout(data: bytes, out: np.ndarray) -> EventBatch | None:
    if not len(out):
        return None
    header = _header(data, out)
    if header is None:
        return None
    worker_id, epoch, seq, block_size, load = header
    events = _events_from_layout(data, out, block_size)
    if events is None:
        return None
    return _event_batch(worker_id, epoch, seq, block_size, events, load)


def _events_from_layout(
    data: bytes, out: np.ndarray, block_size: int
) -> tuple[KvEvent, ...] | None:
    n = int(out[12])  # wire_nb.NUM_EVENTS
    o = out[: 16 + 12 * n].tolist()
    decoded: list[KvEvent] = []
    for base in range(16, 16 + 12 * n, 12):
        kind = o[base]
        if kind == 3:
            decoded.append(_CLEARED)
            continue
        start, size = o[base + 1], o[base + 2]
        hashes = _packed(out[start : start + size])
        if kind == 2:
            decoded.append(_block_removed(hashes))
            continue
        start, length = o[base + 5], o[base + 6]
        if length != size * block_size * 4:
            return None
        if o[base + 8] or o[base + 10]:
            salt = _string(data, o[base + 7], o[base + 8])
            extra = _string(data, o[base + 9], o[base + 10])
            if salt is None or extra is None:
                return None
            partition = Partition(salt, extra)
        else:
            partition = DEFAULT_PARTITION
        parent = o[base + 4] if o[base + 3] else None
        decoded.append(_block_stored(hashes, parent, data[start : start + length], partition))
    return tuple(decoded)


_eb_events = vars(EventBatch)["events"]


class WireBatch(EventBatch):
    """An EventBatch decoded lazily (:func:`decode_stream_lazy`): its header and load
    report as values, its events as the compiled scan's ``layout`` (wire_nb's layout, the
    hashes after it) of the wire bytes ``data``. A plain batch only (wire_nb.PLAIN: default
    partitions, token ids of the right length), so ``events`` always builds (on first use)
    the same events :func:`decode_stream_message` gives; router.core.index_nb applies the
    layout itself (``apply_wire``) without building them."""

    __slots__ = ("data", "layout")
    layout: np.ndarray
    data: bytes

    @property  # type: ignore[override]
    def events(self) -> tuple[KvEvent, ...]:
        events = _eb_events.__get__(self)
        if events is None:
            events = _events_from_layout(self.data, self.layout, self.block_size)
            assert events is not None  # a plain batch (checked when it was made)
            _eb_events.__set__(self, events)
        return events

    def materialize(self) -> EventBatch:
        """The same batch as a plain EventBatch."""
        return _event_batch(
            self.worker_id, self.epoch, self.seq, self.block_size, self.events, self.load
        )

    def __eq__(self, other: object) -> bool:
        if isinstance(other, EventBatch):
            return self.materialize() == (
                other.materialize() if isinstance(other, WireBatch) else other
            )
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.materialize())

    def __repr__(self) -> str:
        return f"WireBatch({self.materialize()!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_wire, (self.data,))


def _rebuild_wire(data: bytes) -> EventBatch | Snapshot:
    return decode_stream_lazy(data)


_wb_layout = vars(WireBatch)["layout"].__set__
_wb_data = vars(WireBatch)["data"].__set__


def decode_stream_lazy(data: bytes) -> EventBatch | Snapshot:
    """As :func:`decode_stream_message` (the same answer, the same errors), but a plain
    batch that the compiled scan reads is returned as a :class:`WireBatch`, its events
    left in the scan's layout (built only when something reads them)."""
    scan = _SCAN
    if scan is None or type(data) is not bytes:
        return decode_with_protobuf(data)
    out = scan(data)
    if len(out) and out[13]:  # wire_nb.PLAIN
        header = _header(data, out)
        if header is None:
            return decode_with_protobuf(data)
        worker_id, epoch, seq, block_size, load = header
        obj = _event_batch(worker_id, epoch, seq, block_size, None, load, WireBatch)
        _wb_layout(obj, out)
        _wb_data(obj, data)
        return obj
    batch = _batch_from_layout(data, out)
    if batch is not None:
        return batch
    return decode_with_protobuf(data)


def decode_stream_message(data: bytes) -> EventBatch | Snapshot:
    """Parse and validate wire bytes of a stream message (a batch with the compiled scan
    when enabled, :func:`enable_compiled_decode`: the same answer or the same error as
    :func:`decode_with_protobuf`)."""
    scan = _SCAN
    if scan is not None and type(data) is bytes:
        # the scan's layout (wire_nb), then every event's hashes in one uint64 array; None
        # when the scan or a check here declines: protobuf's decode then names the field
        batch = _batch_from_layout(data, scan(data))
        if batch is not None:
            return batch
    return decode_with_protobuf(data)


# KvStreamMessage.run, and EventBatchRun.batches / KvStreamMessage.batch: a field number and
# wire type 2 (length-delimited) in one tag byte
_RUN_TAG = 3 << 3 | 2
_BATCH_TAG = 1 << 3 | 2


def _varint(data: bytes, i: int, end: int) -> tuple[int, int] | None:
    value = shift = 0
    while i < end and shift < 64:
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i
        shift += 7
    return None


def stream_parts(data: bytes) -> list[bytes]:
    """The stream messages ``data`` carries, in order: ``[data]``, or for an
    ``EventBatchRun`` (decision 0056) one ``KvStreamMessage{batch}``'s bytes per batch, cut
    from it without decoding (the run's bytes are exactly those, back to back). Each part
    then decodes as any stream message (:func:`decode_stream_lazy`). A run in a layout this
    cut does not expect is split by protobuf; one that does not parse is a ContractError."""
    if not data or data[0] != _RUN_TAG:
        return [data]
    end = len(data)
    head = _varint(data, 1, end)
    if head is None or head[0] + head[1] != end:
        return _parts_with_protobuf(data)
    i = head[1]
    parts = []
    while i < end:
        if data[i] != _BATCH_TAG:
            return _parts_with_protobuf(data)
        item = _varint(data, i + 1, end)
        if item is None or item[0] + item[1] > end:
            return _parts_with_protobuf(data)
        stop = item[0] + item[1]
        parts.append(data[i:stop])
        i = stop
    return parts


def _parts_with_protobuf(data: bytes) -> list[bytes]:
    msg = _parse(data)
    if msg.WhichOneof("kind") != "run":
        return [data]
    return [pb.KvStreamMessage(batch=b).SerializeToString() for b in msg.run.batches]


def decode_with_protobuf(data: bytes) -> EventBatch | Snapshot:
    """Parse and validate wire bytes of a stream message with the protobuf runtime (the
    reference decode; the compiled scan hands it whatever it declines)."""
    return stream_message_from_pb(_parse(data))


def _parse(data: bytes) -> pb.KvStreamMessage:
    msg = pb.KvStreamMessage()
    try:
        msg.ParseFromString(data)
    except Exception as exc:  # protobuf raises DecodeError, a private subclass
        raise ContractError(f"KvStreamMessage does not parse: {exc}") from None
    return msg
