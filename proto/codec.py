"""Codec between the event dataclasses and their protobuf messages.

The only module of the contract that touches generated protobuf classes. Decoding validates
everything a peer could get wrong and raises :class:`ContractError` naming the field.

Block hashes travel as little-endian uint64 bytes and token ids as little-endian uint32 bytes:
numpy decodes them in one call, which keeps event ingestion cheap at the router.
"""

from __future__ import annotations

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


# ---- decoding --------------------------------------------------------------------------


class PackedHashes(tuple[int, ...]):
    """Block hashes decoded from the wire: a tuple of ints, as the event types hold them,
    that also keeps the wire's little-endian uint64 words as a read-only array
    (:attr:`array`, a view of the received bytes), so an index that works on arrays
    (router.index_nb) takes them without converting the ints back. Equal to (and hashes
    as) the plain tuple of the same ints."""

    array: np.ndarray


def _decode_hashes(data: bytes, where: str, i: int) -> PackedHashes:
    """``where.format(i)`` names the message in errors (formatted only on an error)."""
    if len(data) == 0 or len(data) % 8:
        raise ContractError(
            f"{where.format(i)}.block_hashes must be a non-empty multiple of 8 bytes, "
            f"got {len(data)}"
        )
    array = np.frombuffer(data, dtype=_HASH_DT)
    hashes = PackedHashes(array.tolist())
    hashes.array = array
    return hashes


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
    kind = msg.WhichOneof("kind")
    if kind == "batch":
        return batch_from_pb(msg.batch)
    if kind == "snapshot":
        return snapshot_from_pb(msg.snapshot)
    raise ContractError("KvStreamMessage has neither batch nor snapshot set")


def decode_stream_message(data: bytes) -> EventBatch | Snapshot:
    """Parse and validate wire bytes of a stream message."""
    msg = pb.KvStreamMessage()
    try:
        msg.ParseFromString(data)
    except Exception as exc:  # protobuf raises DecodeError, a private subclass
        raise ContractError(f"KvStreamMessage does not parse: {exc}") from None
    return stream_message_from_pb(msg)
