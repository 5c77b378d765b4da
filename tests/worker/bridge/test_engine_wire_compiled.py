"""The compiled decode (typed structs, token ids scanned into arrays; decision 0042) gives
the same values as the generic decode for every payload, recorded or made up, and the
translator the same batches."""

from __future__ import annotations

import random
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.worker.bridge.recorded import FRAMES, B, load, raw_frames
from worker.bridge import engine_wire
from worker.bridge.engine_wire import (
    EngineBatch,
    EngineBlockStored,
    EngineReplayEnd,
    EngineWireError,
    PackedTokenIds,
    decode_frames,
)
from worker.bridge.translate import EventTranslator, TranslatorConfig

RECORDED = sorted(p.stem for p in FRAMES.glob("*.json"))


@pytest.fixture
def compiled(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The compiled decode on for one test (the generic one is back after it); returns
    a function decoding frames the generic way."""
    monkeypatch.setattr(engine_wire, "_token_ids", None)
    assert engine_wire.enable_compiled()
    scan = engine_wire._token_ids

    def generic(frames: list[bytes]) -> Any:
        engine_wire._token_ids = None
        try:
            return decode_frames(frames)
        finally:
            engine_wire._token_ids = scan

    return generic


def outcome(decode: Any, frames: list[bytes]) -> Any:
    try:
        return decode(frames)
    except EngineWireError as exc:
        return ("error", str(exc))


@pytest.mark.parametrize("name", RECORDED)
def test_recorded_frames_decode_alike_and_translate_alike(compiled: Any, name: str) -> None:
    doc = load(name)
    fast_tr = EventTranslator(TranslatorConfig("w0", block_size=B), random.Random(0))
    slow_tr = EventTranslator(TranslatorConfig("w0", block_size=B), random.Random(0))
    for channel in ("live", "replay"):
        for frames in raw_frames(doc, channel):
            fast, slow = outcome(decode_frames, frames), outcome(compiled, frames)
            assert fast == slow
            if isinstance(fast, EngineBatch) and channel == "live":
                fast_tr.feed(fast)
                slow_tr.feed(slow)
                assert fast_tr.take_batches() == slow_tr.take_batches()
    assert fast_tr.held_blocks() == slow_tr.held_blocks()


def test_the_map_generation_takes_the_compiled_path(compiled: Any) -> None:
    stores = [
        ev
        for frames in raw_frames(load("vllm-0.32.0_b16"), "live")
        if isinstance(batch := decode_frames(frames), EngineBatch)
        for ev in batch.events
        if isinstance(ev, EngineBlockStored)
    ]
    assert stores and all(isinstance(ev.token_ids, PackedTokenIds) for ev in stores)
    assert stores[0].token_ids == tuple(stores[0].token_ids.array.tolist())


# Each field from what engines send (GOOD) and, in an event drawn as a bad one, also
# from what they must not send.
GOOD_TOKEN = st.one_of(
    st.integers(0, 127),
    st.integers(128, 255),
    st.integers(256, 65535),
    st.integers(65536, 2**32 - 1),
)
BAD_TOKEN = st.sampled_from([-1, -200, 2**32, 2**64 - 1, True, 1.5, "7"])
GOOD_HASH = st.one_of(st.integers(-(2**63), 2**64 - 1), st.binary(max_size=8))
GOOD_INT = st.one_of(st.none(), st.integers(0, 3))
BAD_INT = st.sampled_from([-2, True, "x"])
GOOD_EXTRA = st.one_of(
    st.none(),
    st.lists(
        st.one_of(
            st.none(),
            st.lists(st.one_of(st.text(max_size=3), st.lists(st.integers(0, 9), max_size=2))),
        ),
        max_size=3,
    ),
)


@st.composite
def stored(draw: st.DrawFn) -> Any:
    bad = draw(st.integers(0, 3)) == 0

    def either(good: Any, wrong: Any) -> Any:
        return st.one_of(good, wrong) if bad else good

    def pick(good: Any, wrong: Any) -> Any:
        return draw(either(good, wrong))

    n = draw(st.integers(0, 3))
    ev: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": draw(st.lists(either(GOOD_HASH, st.just("h")), min_size=n, max_size=n)),
        "parent_block_hash": draw(st.one_of(st.none(), GOOD_HASH)),
        "token_ids": draw(st.lists(either(GOOD_TOKEN, BAD_TOKEN), max_size=40)),
        "block_size": pick(st.integers(1, 32), st.sampled_from([0, -1, True, None])),
        "lora_id": pick(GOOD_INT, BAD_INT),
        "medium": pick(st.sampled_from([None, "GPU", "CPU"]), st.just(4)),
        "extra_keys": pick(GOOD_EXTRA, st.just([3])),
        "group_idx": pick(GOOD_INT, BAD_INT),
    }
    if draw(st.booleans()):
        ev["cache_salt"] = pick(st.one_of(st.none(), st.text(max_size=3)), st.just(5))
    if bad:
        for key in draw(st.lists(st.sampled_from(sorted(ev)), max_size=2, unique=True)):
            del ev[key]
    return ev


EVENT = st.one_of(
    stored(),
    stored(),
    stored(),
    st.fixed_dictionaries(
        {"type": st.just("BlockRemoved"), "block_hashes": st.lists(GOOD_HASH, max_size=3)},
        optional={"medium": st.sampled_from([None, "GPU", 2]), "group_idx": GOOD_INT},
    ),
    st.just({"type": "AllBlocksCleared"}),
    st.sampled_from([{"type": "BlockPinned", "x": 1}, ["BlockRemoved", [1, 2]], {"kind": "x"}]),
)
BATCH = st.one_of(
    st.tuples(st.one_of(st.floats(0, 1e9), st.integers(0, 10)), st.lists(EVENT, max_size=4)).map(
        list
    ),
    st.tuples(st.floats(0, 1e9), st.lists(EVENT, max_size=4), GOOD_INT | BAD_INT).map(list),
    st.just([1.0]),
    st.just({"ts": 1.0}),
)


@settings(
    max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(body=BATCH, seq=st.integers(0, 2**40))
def test_any_payload_decodes_alike(compiled: Any, body: Any, seq: int) -> None:
    frames = [b"t", seq.to_bytes(8, "big"), msgspec.msgpack.encode(body)]
    fast = outcome(decode_frames, frames)
    assert fast == outcome(compiled, frames)
    assert not isinstance(fast, EngineReplayEnd)
    if isinstance(fast, EngineBatch):
        stores = [ev for ev in fast.events if isinstance(ev, EngineBlockStored)]
        packed = [isinstance(ev.token_ids, PackedTokenIds) for ev in stores]
        event(f"stores decoded compiled: {all(packed) if packed else None}")
    else:
        event("an error")
