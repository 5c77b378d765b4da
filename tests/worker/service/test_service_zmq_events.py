"""``kvroute worker --kv-events-zmq``: the worker's KV events in vLLM's ZMQ wire, read the
way a consumer written for vLLM reads them (a SUB on the PUB socket, a DEALER asking the
replay socket for everything from seq 0), translated into our blocks by the bridge's
translator: they equal the worker's own snapshot, evictions and a salted partition
included."""

from __future__ import annotations

import asyncio
import random

import pytest
import zmq
import zmq.asyncio
from svc_harness import WorkerSetup, running_worker, settle, token_request

from worker.bridge.engine_wire import EngineBatch, EngineReplayEnd, decode_frames
from worker.bridge.translate import EventTranslator, TranslatorConfig
from worker.engine.engine import EngineConfig
from worker.service.zmq_events import ZmqEventsConfig

BS = 4
SETUP = WorkerSetup(
    # 96 tokens of KV: the later prompts evict the earlier ones
    engine=EngineConfig(worker_id="w-zmq", num_kv_slots=96, block_size=BS),
    zmq_events=ZmqEventsConfig("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", "kv@w-zmq@m"),
)


async def _replay(ctx: zmq.asyncio.Context, endpoint: str, start: int) -> list[EngineBatch]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        await dealer.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
        out = []
        while True:
            frames = await asyncio.wait_for(dealer.recv_multipart(), 5.0)
            decoded = decode_frames(frames[1:])  # the empty delimiter first
            if isinstance(decoded, EngineReplayEnd):
                return out
            out.append(decoded)
    finally:
        dealer.close(linger=0)


async def test_a_vllm_consumer_of_the_worker_holds_its_blocks() -> None:
    ctx = zmq.asyncio.Context()
    async with running_worker(SETUP) as w:
        publisher = w.server._zmq_events
        assert publisher is not None
        pub_at = publisher.endpoints["--kv-events-zmq"]
        replay_at = publisher.endpoints["--kv-events-zmq-replay"]
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        sub.connect(pub_at)
        rng = random.Random(3)
        for i in range(12):
            req = token_request([rng.randrange(1, 250) for _ in range(14)], max_new_tokens=3)
            if i % 3 == 0:
                req.partition.cache_salt = "tenant-a"
            await w.generate(req)
        await settle(w)
        # everything from seq 0 through the replay socket, then what is still live
        batches = await _replay(ctx, replay_at, 0)
        assert [b.seq for b in batches] == list(range(len(batches)))
        assert all(b.topic == b"kv@w-zmq@m" for b in batches)
        _, truth = await settle(w)
        translator = EventTranslator(TranslatorConfig("w", block_size=BS), random.Random(0))
        for batch in batches:
            assert translator.feed(batch) is None
        worker_blocks = {h for stored in truth.blocks for h in stored.block_hashes}
        assert worker_blocks and translator.held_blocks() == worker_blocks
        removed = [
            ev for b in batches for ev in b.events if type(ev).__name__ == "EngineBlockRemoved"
        ]
        assert removed  # evictions were published
        # the live socket carried the same frames (its first ones may precede the connect)
        live = []
        while await sub.poll(200):
            live.append(decode_frames(await sub.recv_multipart()))
        assert live
        assert {b.seq: b.events for b in live}.items() <= {b.seq: b.events for b in batches}.items()
        sub.close(linger=0)
    ctx.term()


def test_bad_endpoints_are_refused_naming_the_flag() -> None:
    with pytest.raises(ValueError, match="--kv-events-zmq must be a ZMQ endpoint"):
        ZmqEventsConfig("127.0.0.1:5557")
    with pytest.raises(ValueError, match="--kv-events-zmq-replay must be"):
        ZmqEventsConfig("tcp://*:5557", "5558")


def test_the_flags_build_the_publisher_config() -> None:
    from worker import cli

    def config(*flags: str):
        return cli.config_from_args(cli.build_parser().parse_args(["--worker-id", "w7", *flags]))

    assert config().zmq_events is None
    zmq_config = config("--kv-events-zmq", "tcp://*:5557", "--kv-events-zmq-replay", "tcp://*:5558")
    # vLLM's default topic (empty): vllm-router's --kv-event-source drops any other
    assert zmq_config.zmq_events == ZmqEventsConfig("tcp://*:5557", "tcp://*:5558", "")
    topic = config("--kv-events-zmq", "tcp://*:5557", "--kv-events-zmq-topic", "kv@w7@m")
    assert topic.zmq_events == ZmqEventsConfig("tcp://*:5557", None, "kv@w7@m")
    with pytest.raises(ValueError, match="--kv-events-zmq-replay needs --kv-events-zmq"):
        config("--kv-events-zmq-replay", "tcp://*:5558")
    with pytest.raises(ValueError, match="--kv-events-zmq-topic needs --kv-events-zmq"):
        config("--kv-events-zmq-topic", "kv@w7@m")


def test_an_endpoint_in_use_is_an_error_naming_the_flag() -> None:
    from worker.service.zmq_events import ZmqEventPublisher

    ctx = zmq.Context()
    taken = ctx.socket(zmq.PUB)
    taken.setsockopt(zmq.LINGER, 0)
    taken.bind("tcp://127.0.0.1:*")
    endpoint = taken.getsockopt_string(zmq.LAST_ENDPOINT)
    try:
        publisher = ZmqEventPublisher(None, ZmqEventsConfig(endpoint), 4)  # type: ignore[arg-type]
        with pytest.raises(OSError, match=f"--kv-events-zmq {endpoint}: cannot bind"):
            publisher.start()
        assert publisher.endpoints == {}
    finally:
        taken.close(linger=0)
        ctx.term()
