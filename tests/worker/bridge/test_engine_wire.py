"""The engine-wire decoder on frames vLLM and SGLang made (tests/worker/bridge/frames) and
on malformed bytes."""

from __future__ import annotations

import msgspec
import pytest

from tests.worker.bridge.recorded import FRAMES, batches, load, raw_frames
from worker.bridge.engine_wire import (
    EngineAllCleared,
    EngineBatch,
    EngineBlockRemoved,
    EngineBlockStored,
    EngineReplayEnd,
    EngineUnknown,
    EngineWireError,
    decode_frames,
)

SESSIONS = sorted(p.stem for p in FRAMES.glob("*.json"))


def test_sessions_are_there() -> None:
    assert {
        "vllm-0.32.0_b16",
        "vllm-0.23.0_b16",
        "sglang-0.5.23_page1",
        "sglang-0.5.18_page1",
    } <= set(SESSIONS)


@pytest.mark.parametrize("name", SESSIONS)
def test_every_recorded_frame_decodes(name: str) -> None:
    doc = load(name)
    live = batches(doc)
    assert len(live) == len(doc["held_after"])
    for b in live:
        assert isinstance(b, EngineBatch)
        assert b.events and not any(isinstance(e, EngineUnknown) for e in b.events)
    replay = raw_frames(doc, "replay")
    if replay:  # a replay answer ends with seq -1
        assert isinstance(decode_frames(replay[-1]), EngineReplayEnd)


@pytest.mark.parametrize("version", ["0.32.0", "0.23.0"])
def test_vllm_maps_and_arrays_decode_alike(version: str) -> None:
    """0.32 sends tagged maps, 0.23 positional arrays: the same scenario decodes to the
    same shapes (the hashes differ: each version seeds its own)."""
    live = batches(load(f"vllm-{version}_b16"))
    assert [b.seq for b in live] == list(range(7))
    first = live[0].events[0]
    assert isinstance(first, EngineBlockStored)
    assert first.parent_block_hash is None and first.block_size == 16
    assert len(first.block_hashes) == 3 and len(first.token_ids) == 48
    assert first.medium == "GPU" and first.lora_id is None and first.group_idx == 0
    dup_a, dup_b = live[1].events[:2]  # two requests stored the same prefix in one step
    assert isinstance(dup_a, EngineBlockStored) and dup_a.block_hashes == dup_b.block_hashes
    salted = live[2].events[0]
    assert isinstance(salted, EngineBlockStored) and salted.extra_keys == (("tenant-a",), None)
    assert all(isinstance(e, EngineBlockRemoved) for e in live[3].events[:3])
    assert live[5].events == (EngineAllCleared(),)


@pytest.mark.parametrize("version", ["0.5.23", "0.5.18"])
def test_sglang_one_token_pages_and_salt(version: str) -> None:
    """0.5.23 sends tagged maps; 0.5.18 positional arrays, a salted store's salt in a
    trailing metadata map: the same scenario decodes alike."""
    live = batches(load(f"sglang-{version}_page1"))
    assert live[0].events[0] == EngineAllCleared()  # RadixCache announces its reset at start
    stored = live[0].events[1]
    assert isinstance(stored, EngineBlockStored)
    assert stored.block_size == 1 and len(stored.block_hashes) == len(stored.token_ids) == 49
    salted = live[2].events[0]
    assert isinstance(salted, EngineBlockStored) and salted.cache_salt == "tenant-a"
    assert any(h < 0 for e in live[0].events[1:] for h in e.block_hashes)  # signed int64


def test_old_replay_frames_have_no_topic() -> None:
    """vLLM before 0.26 answers a replay with [seq, payload]."""
    frames = raw_frames(load("vllm-0.23.0_b16"), "replay")
    assert len(frames[0]) == 2
    batch = decode_frames(frames[0])
    assert isinstance(batch, EngineBatch) and batch.seq == 2 and batch.topic == b""


def _frames(payload: object, seq: int = 0) -> list[bytes]:
    return [b"kv", seq.to_bytes(8, "big"), msgspec.msgpack.encode(payload)]


def test_unknown_event_type_is_a_value() -> None:
    batch = decode_frames(_frames([1.0, [{"type": "BlockPinned", "x": 1}, ["Moved", 3]], 0]))
    assert isinstance(batch, EngineBatch)
    assert batch.events == (EngineUnknown("BlockPinned"), EngineUnknown("Moved"))


def test_extra_trailing_fields_are_ignored() -> None:
    stored = ["BlockStored", [1], None, [5, 6], 2, None, "GPU", None, None, 0, "new", "x"]
    batch = decode_frames(_frames([1.0, [stored, ["BlockRemoved", [1]]]]))
    assert isinstance(batch, EngineBatch) and batch.dp_rank is None
    assert batch.events[0] == EngineBlockStored((1,), None, (5, 6), 2, medium="GPU", group_idx=0)
    assert batch.events[1] == EngineBlockRemoved((1,))


def test_sglang_array_store_metadata() -> None:
    """SGLang's array generation: a salted store carries {"cache_salt": s} after medium; an
    unsalted one stops at medium."""
    salted = ["BlockStored", [7], None, [5], 1, None, "GPU", {"cache_salt": "t"}]
    plain = ["BlockStored", [8], 7, [6], 1, None, "GPU"]
    batch = decode_frames(_frames([1.0, [salted, plain], 0]))
    assert isinstance(batch, EngineBatch)
    assert batch.events[0] == EngineBlockStored((7,), None, (5,), 1, medium="GPU", cache_salt="t")
    assert batch.events[1] == EngineBlockStored((8,), 7, (6,), 1, medium="GPU")
    bad = ["BlockStored", [7], None, [5], 1, None, "GPU", {"cache_salt": 3}]
    with pytest.raises(EngineWireError, match=r"metadata\.cache_salt must be str"):
        decode_frames(_frames([1.0, [bad]]))


@pytest.mark.parametrize(
    ("frames", "message"),
    [
        ([b"kv", b"\x00" * 8], "seq frame must be 8 bytes"),  # read as [seq, payload]
        ([b"a", b"b", b"c", b"d"], "expected 3 frames"),
        ([b"kv", b"\x00" * 4, b"\x90"], "seq frame must be 8 bytes"),
        ([b"kv", (-5).to_bytes(8, "big", signed=True), b"\x90"], "negative"),
        ([b"kv", b"\x00" * 8, b"\xc1"], "is not msgpack"),
        (_frames({"ts": 1}), "must be an array [ts, events, dp_rank]"),
        (_frames([1.0, {}]), "events of seq 0 must be an array"),
        (_frames(["x", []]), "ts of seq 0 must be a number"),
        (_frames([1.0, [7]]), "event 0 of seq 0 must be a tagged map"),
        (_frames([1.0, [{"type": "BlockRemoved", "block_hashes": "x"}]]), "block_hashes"),
        (_frames([1.0, [["BlockStored", [1], None, ["a"], 1]]]), "token_ids"),
        (_frames([1.0, [["BlockStored", [1], None, [1], 0]]]), "block_size"),
        (_frames([1.0, [["BlockStored", [1], None, [1], 1, None, 3]]]), "medium"),
    ],
)
def test_malformed_frames_raise_a_clear_error(frames: list[bytes], message: str) -> None:
    with pytest.raises(EngineWireError, match=message.replace("[", r"\[").replace("]", r"\]")):
        decode_frames(frames)
