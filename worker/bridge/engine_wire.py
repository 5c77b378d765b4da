"""Decode the KV events vLLM and SGLang publish over ZMQ into engine-neutral values.

Sans-I/O: bytes in, frozen values out. Imports neither asyncio, zmq, grpc, torch nor a
clock; msgspec only decodes msgpack.

The wire (both engines, every version this module knows)::

    PUB multipart   [topic, seq, payload]
        topic       bytes, e.g. b"kv@<pod>@<model>" (may be empty)
        seq         8 bytes, big-endian; 0, 1, 2, ... per publishing process (no epoch:
                    a restarted engine counts from 0 again). The replay ROUTER ends its
                    answer with seq -1 (8 bytes 0xff) and an empty payload.
        payload     msgpack array [ts, events, dp_rank]  (dp_rank may be absent)

    an event, tagged map (vLLM >= 0.24, SGLang >= 0.5.20):
        {"type": "BlockStored", "block_hashes": [...], "parent_block_hash": h | nil,
         "token_ids": [...], "block_size": n, "lora_id": ..., "medium": "GPU", ...}
    an event, positional array (vLLM <= 0.23, older SGLang):
        ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
         lora_id, medium, ...]                  (trailing default fields may be omitted)
        SGLang (0.5.18) then has, for a salted store only, a map {"cache_salt": s} where
        vLLM has lora_name

Fields absent from a map, or past the end of an array, take their defaults. An event whose
type this module does not know decodes to :class:`EngineUnknown` (the translator counts
it); bytes that are not this wire raise :class:`EngineWireError` naming what was wrong.

:func:`encode_vllm_batch` goes the other way: kvroute's own events as vLLM >= 0.24
publishes them (tagged maps, unsigned 64-bit int hashes, the salt as the chain's first extra
key), so consumers written for vLLM can follow a kvroute worker (``kvroute worker
--kv-events-zmq``).

Engine block hashes are kept as the engine sent them -- ints (vLLM's low 64 bits, SGLang's
signed int64) or bytes (vLLM with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``) -- and never
recomputed: their seeds depend on the engine's version, hash function and PYTHONHASHSEED.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

import msgspec
import numpy as np

from kvroute_proto.events import AllCleared, BlockRemoved, BlockStored, KvEvent

__all__ = [
    "REPLAY_END_SEQ",
    "EngineAllCleared",
    "EngineBatch",
    "EngineBlockRemoved",
    "EngineBlockStored",
    "EngineEvent",
    "EngineHash",
    "EngineReplayEnd",
    "EngineUnknown",
    "EngineWireError",
    "PackedTokenIds",
    "decode_frames",
    "enable_compiled",
    "encode_vllm_batch",
]

EngineHash = int | bytes
"""An engine's block hash as it sent it: an opaque name, never recomputed here."""

REPLAY_END_SEQ = -1
"""The seq of the frame that ends a replay answer."""


class EngineWireError(ValueError):
    """A frame that is not an engine's KV-event wire; the message says what was wrong."""


class PackedTokenIds(Sequence[int]):
    """A stored event's token ids as the compiled decode reads them: a uint32 array
    (:attr:`array`, every id a valid token id), read as a sequence of ints. Equal to -- and
    hashes as -- the tuple of the same ints, so decoded events compare equal whichever way
    they were decoded."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def __len__(self) -> int:
        return len(self.array)

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[int, ...]: ...
    def __getitem__(self, i: int | slice) -> int | tuple[int, ...]:
        if isinstance(i, slice):
            return tuple(self.array[i].tolist())
        return int(self.array[i])

    def __iter__(self) -> Iterator[int]:
        return iter(self.array.tolist())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedTokenIds):
            return bool(np.array_equal(self.array, other.array))
        if isinstance(other, tuple):
            return tuple(self.array.tolist()) == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self.array.tolist()))

    def __repr__(self) -> str:
        return f"PackedTokenIds({self.array.tolist()!r})"


@dataclass(frozen=True, slots=True)
class EngineBlockStored:
    """Consecutive blocks of one chain became cached, parent first (engine's vocabulary).

    ``extra_keys``: one entry per block (None or a tuple), vLLM's untagged form: a LoRA
    name, ``(mm_identifier, offset)`` pairs, a cache salt (first block only), prompt
    embedding digests. ``cache_salt``: SGLang's field (vLLM puts the salt in extra_keys).
    ``token_ids``: a tuple, or :class:`PackedTokenIds` from the compiled decode.
    """

    block_hashes: tuple[EngineHash, ...]
    parent_block_hash: EngineHash | None
    token_ids: tuple[int, ...] | PackedTokenIds
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None
    group_idx: int | None = None
    cache_salt: str | None = None


@dataclass(frozen=True, slots=True)
class EngineBlockRemoved:
    """These blocks were evicted (one copy each: the engine may hold duplicates)."""

    block_hashes: tuple[EngineHash, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class EngineAllCleared:
    """The engine dropped its whole prefix cache."""


@dataclass(frozen=True, slots=True)
class EngineUnknown:
    """An event of a type this decoder does not know (counted, never fatal)."""

    kind: str


EngineEvent = EngineBlockStored | EngineBlockRemoved | EngineAllCleared | EngineUnknown


@dataclass(frozen=True, slots=True)
class EngineBatch:
    """One published message: the engine's ``seq``, its timestamp and events."""

    seq: int
    ts: float
    events: tuple[EngineEvent, ...]
    dp_rank: int | None = None
    topic: bytes = b""


@dataclass(frozen=True, slots=True)
class EngineReplayEnd:
    """The frame that ends a replay answer (seq -1, empty payload)."""

    topic: bytes = b""


# Positional layouts of the array generation: the field order of each event struct after
# its tag (vLLM <= 0.23; SGLang's structs started as a copy of vLLM's with the same
# leading fields). Fields past the end take their defaults.
_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
# SGLang's array generation puts a salted store's ``metadata`` map ({"cache_salt": s}, its
# BlockStoredWithMetadata) after ``medium``, where vLLM has ``lora_name``.
_METADATA_AT = 1 + _STORED_FIELDS.index("lora_name")

_decoder = msgspec.msgpack.Decoder()
_encoder = msgspec.msgpack.Encoder()


def encode_vllm_batch(
    events: Sequence[KvEvent], block_size: int, ts: float, dp_rank: int = 0
) -> bytes:
    """The msgpack payload ``[ts, events, dp_rank]`` of vLLM's ``KVEventBatch`` for our
    ``events`` (``block_size`` tokens a block). A partition's cache salt goes where vLLM
    puts it, the first extra key of a chain's first block; its extra key, which vLLM has no
    name for, follows the salt there (vLLM consumers drop such blocks, as they should)."""
    out: list[dict[str, Any]] = []
    for ev in events:
        match ev:
            case BlockStored():
                n = len(ev.block_hashes)
                keys: list[list[str] | None] = [None] * n
                salt, extra = ev.partition.cache_salt, ev.partition.extra_key
                if ev.parent_hash is None and n and (salt or extra):
                    keys[0] = [salt, extra] if extra else [salt]
                out.append(
                    {
                        "type": "BlockStored",
                        "block_hashes": [int(h) for h in ev.block_hashes],
                        "parent_block_hash": ev.parent_hash,
                        "token_ids": ev.token_array.tolist(),
                        "block_size": block_size,
                        "lora_id": None,
                        "medium": "GPU",
                        "lora_name": None,
                        "extra_keys": keys,
                        "group_idx": 0,
                    }
                )
            case BlockRemoved():
                out.append(
                    {
                        "type": "BlockRemoved",
                        "block_hashes": [int(h) for h in ev.block_hashes],
                        "medium": "GPU",
                        "group_idx": 0,
                    }
                )
            case AllCleared():
                out.append({"type": "AllBlocksCleared"})
    return _encoder.encode([ts, out, dp_rank])


def decode_frames(frames: Sequence[bytes]) -> EngineBatch | EngineReplayEnd:
    """Decode one ``[topic, seq, payload]`` frame triple (live PUB, or a replay answer
    with its empty delimiter already stripped; vLLM before 0.26 replays ``[seq, payload]``).

    Raises :class:`EngineWireError` when the frames are not the engine KV-event wire.
    """
    if len(frames) == 2:  # a replay answer of vLLM < 0.26: no topic
        frames = [b"", *frames]
    if len(frames) != 3:
        raise EngineWireError(f"expected 3 frames [topic, seq, payload], got {len(frames)}")
    topic, raw_seq, payload = (bytes(f) for f in frames)
    if len(raw_seq) != 8:
        raise EngineWireError(f"seq frame must be 8 bytes (big-endian), got {len(raw_seq)}")
    seq = int.from_bytes(raw_seq, "big", signed=True)
    if seq == REPLAY_END_SEQ:
        return EngineReplayEnd(topic)
    if seq < 0:
        raise EngineWireError(f"seq {seq} is negative (only -1, the replay end, may be)")
    if _token_ids is not None and (batch := _decode_typed(payload, seq, topic)) is not None:
        return batch
    try:
        body = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise EngineWireError(f"payload of seq {seq} is not msgpack: {exc}") from None
    if not isinstance(body, list) or not 2 <= len(body) <= 3:
        raise EngineWireError(
            f"payload of seq {seq} must be an array [ts, events, dp_rank], got "
            f"{type(body).__name__}{'' if not isinstance(body, list) else f' of {len(body)}'}"
        )
    ts, events = body[0], body[1]
    dp_rank = body[2] if len(body) == 3 else None
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        raise EngineWireError(f"ts of seq {seq} must be a number, got {type(ts).__name__}")
    if not isinstance(events, list):
        raise EngineWireError(f"events of seq {seq} must be an array, got {type(events).__name__}")
    if dp_rank is not None and not isinstance(dp_rank, int):
        raise EngineWireError(f"dp_rank of seq {seq} must be an int or nil, got {dp_rank!r}")
    decoded = tuple(_decode_event(ev, seq, i) for i, ev in enumerate(events))
    return EngineBatch(seq, float(ts), decoded, dp_rank, topic)


def _decode_event(ev: Any, seq: int, index: int) -> EngineEvent:
    where = f"event {index} of seq {seq}"
    fields: dict[str, Any]
    if isinstance(ev, dict) and isinstance(ev.get("type"), str):
        kind = ev["type"]
        fields = ev
    elif isinstance(ev, list) and ev and isinstance(ev[0], str):
        kind = ev[0]
        layout = {"BlockStored": _STORED_FIELDS, "BlockRemoved": _REMOVED_FIELDS}.get(kind, ())
        fields = dict(zip(layout, ev[1:], strict=False))  # newer trailing fields: ignored
        if kind == "BlockStored" and len(ev) > _METADATA_AT and isinstance(ev[_METADATA_AT], dict):
            fields = _sglang_metadata(fields, ev[_METADATA_AT], where)
    else:
        raise EngineWireError(
            f"{where} must be a tagged map or an array led by its type, got {ev!r:.80}"
        )
    match kind:
        case "BlockStored":
            return _stored(fields, where)
        case "BlockRemoved":
            return EngineBlockRemoved(
                _hashes(fields.get("block_hashes"), where),
                _opt(fields, "medium", str, where),
                _opt(fields, "group_idx", int, where),
            )
        case "AllBlocksCleared":
            return EngineAllCleared()
        case _:
            return EngineUnknown(kind)


def _sglang_metadata(fields: dict[str, Any], meta: dict[Any, Any], where: str) -> dict[str, Any]:
    """The fields of an SGLang array-generation store that carries ``metadata``: its salt
    becomes ``cache_salt``; nothing of vLLM's layout follows it."""
    fields = {k: v for k, v in fields.items() if k in _STORED_FIELDS[: _METADATA_AT - 1]}
    salt = meta.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise EngineWireError(f"{where}: metadata.cache_salt must be str or nil, got {salt!r:.40}")
    fields["cache_salt"] = salt
    return fields


def _stored(fields: dict[str, Any], where: str) -> EngineBlockStored:
    hashes = _hashes(fields.get("block_hashes"), where)
    parent = fields.get("parent_block_hash")
    if parent is not None and not _is_hash(parent):
        raise EngineWireError(f"{where}: parent_block_hash must be an int, bytes or nil")
    tokens = fields.get("token_ids")
    # each element's type at C speed (a bool's type is bool, not int): events carry
    # thousands of token ids, and the bridge decodes 100k blocks a second
    if not isinstance(tokens, list) or not set(map(type, tokens)) <= _INT:
        raise EngineWireError(f"{where}: token_ids must be an array of ints")
    block_size = fields.get("block_size")
    if not isinstance(block_size, int) or block_size <= 0:
        raise EngineWireError(f"{where}: block_size must be a positive int, got {block_size!r}")
    extra = fields.get("extra_keys")
    if extra is not None:
        if not isinstance(extra, list) or not all(e is None or isinstance(e, list) for e in extra):
            raise EngineWireError(f"{where}: extra_keys must be an array of arrays or nils")
        extra = tuple(_frozen_entry(e) for e in extra)
    return EngineBlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tuple(tokens),
        block_size=block_size,
        lora_id=_opt(fields, "lora_id", int, where),
        medium=_opt(fields, "medium", str, where),
        lora_name=_opt(fields, "lora_name", str, where),
        extra_keys=extra,
        group_idx=_opt(fields, "group_idx", int, where),
        cache_salt=_opt(fields, "cache_salt", str, where),
    )


_INT = frozenset({int})
_HASH_TYPES = frozenset({int, bytes})


def _is_hash(h: Any) -> bool:
    return isinstance(h, bytes) or (isinstance(h, int) and not isinstance(h, bool))


def _hashes(value: Any, where: str) -> tuple[EngineHash, ...]:
    if not isinstance(value, list) or not set(map(type, value)) <= _HASH_TYPES:
        raise EngineWireError(f"{where}: block_hashes must be an array of ints or bytes")
    return tuple(value)


def _opt(fields: dict[str, Any], name: str, kind: type, where: str) -> Any:
    value = fields.get(name)
    if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
        raise EngineWireError(f"{where}: {name} must be {kind.__name__} or nil, got {value!r:.40}")
    return value


def _frozen(key: Any) -> Any:
    """An extra key, hashable (msgpack arrays decode as lists)."""
    return tuple(_frozen(k) for k in key) if isinstance(key, list) else key


# ---- the compiled decode ------------------------------------------------------------------
# The tagged-map generation (what current vLLM and SGLang publish) through typed structs,
# each stored event's token ids read from their msgpack bytes into an array: no Python int
# per token. Anything these structs do not take -- the array generation, an unknown event
# type, a value of the wrong type, a token id that is not a valid one -- goes to the
# generic decode above, which decides (and names what is wrong), so both give the same
# values for every payload.


class _Stored(msgspec.Struct, tag="BlockStored", tag_field="type"):
    block_hashes: list[int | bytes]
    token_ids: msgspec.Raw
    block_size: int
    parent_block_hash: int | bytes | None = None
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[list[Any] | None] | None = None
    group_idx: int | None = None
    cache_salt: str | None = None


class _Removed(msgspec.Struct, tag="BlockRemoved", tag_field="type"):
    block_hashes: list[int | bytes]
    medium: str | None = None
    group_idx: int | None = None


class _Cleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type"):
    pass


class _Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[_Stored | _Removed | _Cleared]
    dp_rank: int | None = None


_typed_decoder = msgspec.msgpack.Decoder(_Batch)
_token_ids: Callable[[msgspec.Raw], np.ndarray | None] | None = None  # enable_compiled()


def enable_compiled() -> bool:
    """Decode the tagged-map generation with the compiled token scan
    (:mod:`worker.bridge.engine_wire_nb`, numba) from now on in this process: the same
    values, token ids as :class:`PackedTokenIds`. ``kvroute bridge`` calls it; False, and
    nothing changes, where numba cannot be imported."""
    global _token_ids
    if _token_ids is None:
        try:
            from worker.bridge import engine_wire_nb
        except ImportError:
            return False
        engine_wire_nb.warm_up()
        _token_ids = engine_wire_nb.token_ids
    return True


def _decode_typed(payload: bytes, seq: int, topic: bytes) -> EngineBatch | None:
    """The batch in ``payload`` through the typed structs, or None: the generic decode
    then decides."""
    assert _token_ids is not None
    try:
        body = _typed_decoder.decode(payload)
    except msgspec.MsgspecError:
        return None
    events: list[EngineEvent] = []
    for ev in body.events:
        if type(ev) is _Stored:
            tokens = _token_ids(ev.token_ids)
            if tokens is None or ev.block_size <= 0:
                return None
            extra = ev.extra_keys
            events.append(
                EngineBlockStored(
                    tuple(ev.block_hashes),
                    ev.parent_block_hash,
                    PackedTokenIds(tokens),
                    ev.block_size,
                    ev.lora_id,
                    ev.medium,
                    ev.lora_name,
                    None if extra is None else tuple(_frozen_entry(e) for e in extra),
                    ev.group_idx,
                    ev.cache_salt,
                )
            )
        elif type(ev) is _Removed:
            events.append(EngineBlockRemoved(tuple(ev.block_hashes), ev.medium, ev.group_idx))
        else:
            events.append(EngineAllCleared())
    return EngineBatch(seq, body.ts, tuple(events), body.dp_rank, topic)


def _frozen_entry(entry: list[Any] | None) -> tuple[Any, ...] | None:
    return None if entry is None else tuple(_frozen(k) for k in entry)
