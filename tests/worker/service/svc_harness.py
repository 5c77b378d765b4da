"""Harness of the worker service tests: a real grpc.aio server on 127.0.0.1 port 0 over a
real Engine with the sim executor (zero cost and no pacing unless a test asks)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc

from edge.http_front import HttpFrontConfig
from edge.limits import RequestLimits
from kvroute_proto import kvroute_pb2 as pb
from kvroute_proto import kvroute_pb2_grpc as pb_grpc
from kvroute_proto.codec import stream_message_from_pb
from kvroute_proto.events import (
    AllCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    Partition,
    Snapshot,
)
from worker.engine.engine import Engine, EngineConfig
from worker.engine.factory import build_executor
from worker.engine.sim_executor import SimCostModel, SimExecutor, SimExecutorConfig
from worker.engine.stats import EngineStats
from worker.engine.tokenizer import ByteTokenizer
from worker.service.engine_runner import RunnerConfig
from worker.service.server import WorkerServer, WorkerServerConfig
from worker.service.zmq_events import ZmqEventsConfig

BYTE_VOCAB = ByteTokenizer().vocab_size  # 260
MAX_CONTEXT = 512


@dataclass(frozen=True, slots=True)
class WorkerSetup:
    """What a test may vary about the worker under test."""

    engine: EngineConfig = field(
        default_factory=lambda: EngineConfig(worker_id="w-test", num_kv_slots=4096, block_size=4)
    )
    sim: SimExecutorConfig = field(
        default_factory=lambda: SimExecutorConfig(
            vocab_size=BYTE_VOCAB, max_context_tokens=MAX_CONTEXT, eos_token_id=ByteTokenizer.EOS
        )
    )
    cost: SimCostModel = field(default_factory=SimCostModel.zero)
    runner: RunnerConfig = field(default_factory=lambda: RunnerConfig(load_interval_s=0))
    replay_buffer_size: int = 1024
    limits: RequestLimits = field(default_factory=RequestLimits)
    epoch: int | None = None
    tokenizer: bool = True
    executor_kind: str = "sim"  # "torch": the factory's tiny random Llama on CPU
    model_dir: str | None = None  # torch only: an HF model directory instead of the tiny one
    http: bool = False  # also serve the HTTP front (127.0.0.1, port 0)
    max_body_bytes: int = 1 << 20
    zmq_events: ZmqEventsConfig | None = None  # also publish vLLM's ZMQ wire


@dataclass
class Worker:
    """A running worker and a client channel to it."""

    server: WorkerServer
    engine: Engine
    channel: grpc.aio.Channel
    stub: pb_grpc.WorkerStub

    @property
    def http_url(self) -> str:
        assert self.server.http_port is not None, "started without WorkerSetup(http=True)"
        return f"http://127.0.0.1:{self.server.http_port}"

    async def stats(self) -> EngineStats:
        return await self.server.runner.call(self.engine.stats)

    async def generate(self, request: pb.GenerateRequest, **kwargs) -> list[pb.GenerateResponse]:
        return [msg async for msg in self.stub.Generate(request, **kwargs)]

    async def assert_no_leak(self) -> None:
        """Once idle: no request left, no slot locked, every slot free or evictable."""
        await self.server.runner.wait_until_idle()
        s = await self.stats()
        assert (s.num_running, s.num_waiting, s.num_protected_kv_tokens) == (0, 0, 0)
        assert s.num_free_kv_tokens + s.num_evictable_kv_tokens == s.num_total_kv_tokens
        assert self.server.runner.num_in_flight == 0


@contextlib.asynccontextmanager
async def running_worker(setup: WorkerSetup | None = None) -> AsyncIterator[Worker]:
    setup = setup or WorkerSetup()
    tokenizer: ByteTokenizer | None = ByteTokenizer()
    if setup.executor_kind == "torch":
        executor, tokenizer = build_executor(
            "torch", model_dir=setup.model_dir, num_kv_slots=setup.engine.num_kv_slots, device="cpu"
        )
    else:
        executor = SimExecutor(setup.cost, setup.sim)
    engine = Engine(setup.engine, executor, clock=_fake_clock())
    config = WorkerServerConfig(
        engine=setup.engine,
        executor_kind=setup.executor_kind,
        replay_buffer_size=setup.replay_buffer_size,
        runner=setup.runner,
        limits=setup.limits,
        shutdown_grace_s=2.0,
        http=HttpFrontConfig(max_body_bytes=setup.max_body_bytes) if setup.http else None,
        zmq_events=setup.zmq_events,
    )
    server = WorkerServer(engine, tokenizer if setup.tokenizer else None, config, epoch=setup.epoch)
    port = await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield Worker(server, engine, channel, pb_grpc.WorkerStub(channel))
    finally:
        await server.stop(grace_s=1.0)


def _fake_clock() -> Callable[[], float]:
    """A clock that ticks 1 ms per read: the engine's timestamps without wall time."""
    now = [0.0]

    def clock() -> float:
        now[0] += 1e-3
        return now[0]

    return clock


def token_request(
    ids: list[int], *, request_id: str = "", max_new_tokens: int = 8, **sampling
) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=pb.TokenIds(ids=ids),
        sampling=pb.SamplingParams(max_new_tokens=max_new_tokens, **sampling),
    )


def text_request(
    text: str, *, request_id: str = "", max_new_tokens: int = 8, **sampling
) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        prompt_text=text,
        sampling=pb.SamplingParams(max_new_tokens=max_new_tokens, **sampling),
    )


# ---- KV event stream helpers --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HeldBlock:
    parent_hash: int | None
    token_ids: bytes  # little-endian uint32, as in BlockStored
    partition: Partition


class HeldBlocks:
    """Reference model of a subscriber: the blocks it believes the worker holds. Applying
    is strict: seqs must follow on, a stored block must be new, a removed one held."""

    def __init__(self) -> None:
        self.blocks: dict[int, HeldBlock] = {}
        self.epoch: int | None = None
        self.seq = -1
        self.num_batches = 0

    def apply(self, item: EventBatch | Snapshot) -> None:
        match item:
            case Snapshot(epoch=epoch, seq=seq, blocks=blocks):
                self.blocks = {}
                for stored in blocks:
                    self._store(stored)
                self.epoch, self.seq = epoch, seq
            case EventBatch(epoch=epoch, seq=seq, events=events):
                assert (epoch, seq) == (self.epoch, self.seq + 1), (epoch, seq, self.seq)
                for ev in events:
                    match ev:
                        case BlockStored():
                            self._store(ev)
                        case BlockRemoved(block_hashes=hashes):
                            for h in hashes:
                                assert h in self.blocks, f"removed block {h} is not held"
                                del self.blocks[h]
                        case AllCleared():
                            self.blocks.clear()
                self.seq = seq
                self.num_batches += 1

    def _store(self, ev: BlockStored) -> None:
        parent, bs = ev.parent_hash, ev.block_size
        for i, h in enumerate(ev.block_hashes):
            assert h not in self.blocks, f"stored block {h} is already held"
            assert parent is None or parent in self.blocks, f"parent {parent} is not held"
            self.blocks[h] = HeldBlock(
                parent, ev.token_array[i * bs : (i + 1) * bs].tobytes(), ev.partition
            )
            parent = h

    @classmethod
    def of(cls, snapshot: Snapshot) -> HeldBlocks:
        model = cls()
        model.apply(snapshot)
        return model


def subscribe(w: Worker, epoch: int = 0, after_seq: int = 0, who: str = "test"):
    return w.stub.SubscribeKvEvents(
        pb.SubscribeRequest(epoch=epoch, after_seq=after_seq, subscriber_id=who)
    )


async def read_item(call) -> EventBatch | Snapshot:
    msg = await call.read()
    assert msg is not grpc.aio.EOF, "the event stream ended"
    return stream_message_from_pb(msg)


async def read_until(call, model: HeldBlocks, seq: int, *, limit: int = 10_000) -> list:
    """Apply stream messages to ``model`` until it reaches ``seq``; returns them."""
    items = []
    while model.seq < seq:
        assert len(items) < limit
        items.append(item := await read_item(call))
        model.apply(item)
    return items


async def settle(w: Worker) -> tuple[int, Snapshot]:
    """Wait for the engine to go idle; the stream's last seq and the cache's own snapshot."""
    await w.server.runner.wait_until_idle()
    pub = w.server.runner.publisher

    def job() -> tuple[int, Snapshot]:
        return pub.last_seq, w.engine.snapshot(pub.config.worker_id, pub.epoch, pub.last_seq)

    return await w.server.runner.call(job)
