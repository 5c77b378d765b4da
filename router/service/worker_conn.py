"""One worker connection: a gRPC channel, the worker's identity, its KV event subscription.

Lifecycle of the background task (``_run``)::

        +--> GetLoad (identity, block size) --fail--> unhealthy, sleep(backoff) --+
        |        | ok: claim worker_id in the core, healthy, backoff reset         |
        |        v                                                                 |
        |    SubscribeKvEvents(core.expected_subscription(worker_id))              |
        |        | each message -> codec -> core.on_stream_message -> actions      |
        |        | Resubscribe -> cancel the stream, subscribe again at once ------+-+
        |        v stream broken / ended / malformed                               |
        +------- unhealthy, sleep(backoff) <---------------------------------------+

Backoff is exponential with jitter and bounded (``BackoffConfig``); gRPC's own channel
reconnect backoff is capped to the same bound so a restarted worker is found quickly. The
channel uses HTTP/2 keepalive pings, so a worker that vanishes without closing its socket
(a network partition) is detected within keepalive_time + keepalive_timeout.

While the worker is unreachable it keeps its index entries (a blip costs nothing); once it has
been unreachable for ``purge_after_s`` they are dropped (the worker stays registered,
unhealthy, and resyncs from a snapshot when it comes back). A new epoch -- a restarted
worker -- is detected by the core from the stream and purges the old state there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from edge.auth import bearer_interceptors
from edge.tls import ClientTls
from edge.tls import channel as make_channel
from kvroute_proto import codec
from kvroute_proto import kvroute_pb2 as pb
from kvroute_proto import kvroute_pb2_grpc as pb_grpc
from kvroute_proto.errors import ContractError
from router.core.errors import RouterError
from router.core.pools import RouterPools, UnservedModelError
from router.core.router_core import Resubscribe
from router.core.step_profile import DEFAULT_STEP_PROFILE, StepProfile
from router.service.relay_mux import MAX_START_BYTES, RelayMux
from router.service.resilience import Backoff, BackoffConfig

log = logging.getLogger(__name__)


# Largest event-stream message accepted from a worker (a Snapshot of ~40M blocks)
MAX_SNAPSHOT_BYTES = 1 << 30
# On the relay channel (Generate only) each stream from a worker may run this far ahead of
# what the router has read (HTTP/2 flow control; grpc's default is 64 KiB, grown further by
# its BDP probe, which is off there). A router that falls behind then holds the worker's
# writes, and the worker sends everything its engine made meanwhile in one message: tokens
# coalesce exactly when the router is the limit, and cost it per message, not per token
# (decision 0030). The event stream has the same window on the control channel (its own
# connection: a worker's events never wait on the router's relays): what the worker
# publishes while the router has not read the last message goes out as one run (decision
# 0056). A message larger than the window (a snapshot) still flows: grpc opens the window
# for the whole of a message being read.
STREAM_WINDOW_BYTES = 1024

# The Worker service's event stream (kvroute.proto), called with raw response bytes
SUBSCRIBE_METHOD = "/kvroute.v1.Worker/SubscribeKvEvents"


@dataclass(frozen=True, slots=True)
class ConnectionConfig:
    """Channel, keepalive, reconnect and purge settings of every worker connection."""

    # a stalled worker (SIGSTOP, a partition) is out within ~3 s; a ping every 2 s per
    # worker is one 17-byte frame each way
    keepalive_time_s: float = 2.0
    keepalive_timeout_s: float = 1.0
    rpc_timeout_s: float = 5.0  # GetLoad and Abort
    purge_after_s: float = 10.0
    backoff: BackoffConfig = field(default_factory=BackoffConfig)
    subscriber_id: str = "kvroute-router"
    # the router's tokenizer fingerprint (edge.tokenizer); a worker reporting
    # another one in GetLoad is left out of routing. None: no check (in-process tests).
    tokenizer_fingerprint: str | None = None
    # a pool's own fingerprint, where it has its own tokenizer (several --model): (model,
    # fingerprint) pairs; the pools not named here expect ``tokenizer_fingerprint``
    pool_fingerprints: tuple[tuple[str, str], ...] = ()
    # a worker reporting no fingerprint at all (an engine bridge: kvroute bridge) is routed
    # to, with one WARNING, when True (a router without --model: token-id prompts), else
    # refused with a hint
    accept_no_fingerprint: bool = False
    # security (edge.tls / auth): TLS to the workers (a client certificate for
    # mTLS), the token workers require (--router-token there), and the fingerprint of the
    # block-hashing key; a worker reporting another fingerprint is left out of routing
    tls: ClientTls | None = None
    token: str | None = None
    hash_key_fingerprint: str | None = None

    def __post_init__(self) -> None:
        for name in ("keepalive_time_s", "keepalive_timeout_s", "rpc_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.purge_after_s < 0:
            raise ValueError(f"purge_after_s must be >= 0, got {self.purge_after_s}")

    def channel_options(self) -> list[tuple[str, int]]:
        """The worker channels' options (a small stream window, see ``STREAM_WINDOW_BYTES``)."""
        max_backoff_ms = int(self.backoff.max_s * 1000)
        return [
            ("grpc.http2.lookahead_bytes", STREAM_WINDOW_BYTES),
            ("grpc.http2.bdp_probe", 0),
            ("grpc.keepalive_time_ms", int(self.keepalive_time_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(self.keepalive_timeout_s * 1000)),
            # without it grpc-core (1.85) waits for a ping ack far longer than the keepalive
            # timeout: a stalled worker (SIGSTOP, a partition) was never detected (issue 12)
            ("grpc.http2.ping_timeout_ms", int(self.keepalive_timeout_s * 1000)),
            # a snapshot is one message of ~24 bytes per cached block: 4 MB (grpc's default)
            # is 170k blocks, and past it the router could never sync with the worker
            ("grpc.max_receive_message_length", MAX_SNAPSHOT_BYTES),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.initial_reconnect_backoff_ms", int(self.backoff.initial_s * 1000)),
            ("grpc.min_reconnect_backoff_ms", int(self.backoff.initial_s * 1000)),
            ("grpc.max_reconnect_backoff_ms", max_backoff_ms),
            ("grpc.enable_retries", 0),
        ]


# claim(conn, worker_id, block_size, pool) -> True when this connection may own worker_id
ClaimFn = Callable[["WorkerConnection", str, int, str], bool]
# release(conn, worker_id): the connection no longer speaks for worker_id
ReleaseFn = Callable[["WorkerConnection", str], None]
HealthFn = Callable[["WorkerConnection", bool], None]


@dataclass(frozen=True, slots=True)
class ConnectionHooks:
    """How a connection reports to its owner (the WorkerPool). ``changed`` is notified
    after every state change and every applied message (tests and tools await it)."""

    claim: ClaimFn
    release: ReleaseFn
    on_health: HealthFn
    changed: asyncio.Condition


def _step_profile(info: pb.WorkerInfo) -> StepProfile:
    """The step profile the worker states (the default where it states none, or a bad one,
    which is logged: a profile steers the cost, it never refuses a worker; decision 0031)."""
    try:
        return StepProfile.stated(
            info.step_decode_base_s,
            info.step_decode_s_per_seq,
            info.step_decode_s_per_context_token,
            info.step_prefill_s_per_token,
        )
    except ValueError as exc:
        log.warning("worker %s: %s; using the default step profile", info.worker_id, exc)
        return DEFAULT_STEP_PROFILE


class WorkerConnection:
    """Channel + stub + event subscription for the worker at ``address``."""

    def __init__(
        self,
        address: str,
        core: RouterPools,
        config: ConnectionConfig,
        hooks: ConnectionHooks,
        *,
        rng: random.Random,
        clock: Callable[[], float],
    ) -> None:
        self.address = address
        self.config = config
        self._core = core
        self._hooks = hooks
        self._clock = clock
        self._backoff = Backoff(config.backoff, rng)
        self.channel = make_channel(
            address,
            config.tls,
            options=config.channel_options(),
            interceptors=bearer_interceptors(config.token) if config.token else None,
        )
        self.stub = pb_grpc.WorkerStub(self.channel)
        # Generate's own channel (connection): its streams' small window holds the worker's
        # writes while the router lags, which the event stream must never wait on
        self.relay_channel = make_channel(
            address,
            config.tls,
            options=config.channel_options(),
            interceptors=bearer_interceptors(config.token) if config.token else None,
        )
        self.relay_stub = pb_grpc.WorkerStub(self.relay_channel)
        # the worker's relay stream, when it offers one: every request's tokens on one stream
        # (decision 0033); followed while the worker is connected
        self.relay = RelayMux(self.relay_channel, address, self._notify)
        # the event stream without gRPC's deserializer: each message arrives as its wire
        # bytes and goes to codec.decode_stream_message as they are (the router's compiled
        # scan reads them directly; anything it declines is parsed by protobuf, as before)
        # instead of being parsed into a KvStreamMessage and serialised again to be scanned
        self._subscribe = self.channel.unary_stream(
            SUBSCRIBE_METHOD,
            request_serializer=pb.SubscribeRequest.SerializeToString,
            response_deserializer=None,
        )
        self.worker_id: str | None = None
        self.model = ""  # the pool the worker is in (router.core.pools), once claimed
        self.info: pb.WorkerInfo | None = None
        self.healthy = False
        self._down_since: float | None = clock()
        self._purged = False
        self._task: asyncio.Task[None] | None = None
        self._call: grpc.aio.UnaryStreamCall | None = None
        # counters (tests, logs, metrics)
        self.num_connects = 0
        self.num_failures = 0
        self.num_messages = 0
        self.num_runs = 0  # messages that carried a run of batches: read behind the worker
        self.num_resubscribes = 0
        self.num_purges = 0
        self.last_error = ""
        self.refused = False  # the worker answered and a check refused it (see the log)
        self._tokenizer_refusal: tuple[str, str] | None = None  # logged (worker, fingerprint)
        self._hash_key_refusal: tuple[str, str] | None = None  # logged (worker, fingerprint)
        self._model_refusal: tuple[str, str] | None = None  # logged (worker, model)
        self._no_fingerprint_warned: str | None = None  # the worker id warned about

    # ---- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"worker-conn-{self.address}")

    async def close(self) -> None:
        """Stop the subscription, close the channel, and release the worker id."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self.relay.close(None)
        await self.channel.close()
        await self.relay_channel.close()
        if self.worker_id is not None:
            self._hooks.release(self, self.worker_id)
            self.worker_id = None
        self._set_health(False)

    async def _notify(self) -> None:
        async with self._hooks.changed:
            self._hooks.changed.notify_all()

    # ---- the subscription loop -----------------------------------------------------------

    async def _run(self) -> None:
        while True:
            try:
                await self._session()
                reason = "the event stream ended"
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as exc:
                reason = f"{exc.code().name}: {exc.details()}"
            except (ContractError, RouterError) as exc:
                reason = f"{type(exc).__name__}: {exc}"
            except Exception as exc:  # a bug must not end this worker's subscription for good
                log.exception("worker at %s: unexpected error; reconnecting", self.address)
                reason = f"{type(exc).__name__}: {exc}"
            self._on_failure(reason)
            await self._notify()
            await asyncio.sleep(self.next_retry_delay())
            if self._maybe_purge():
                await self._notify()

    async def _session(self) -> None:
        """Identify the worker, then follow its event stream until it breaks."""
        info = await self.stub.GetLoad(pb.GetLoadRequest(), timeout=self.config.rpc_timeout_s)
        if not self._claim(info):
            self.refused = True
            raise RouterError(f"worker at {self.address} refused (see the log)")
        assert self.worker_id is not None
        self.refused = False
        log.info(
            "worker %s at %s connected (model %r, pool %r, block size %d, %d KV tokens)",
            self.worker_id,
            self.address,
            info.model_name,
            self.model,
            info.block_size,
            info.kv_capacity_tokens,
        )
        self._core.set_max_running(self.worker_id, info.max_running_requests)
        self._core.set_step_profile(self.worker_id, _step_profile(info))
        self.num_connects += 1
        self._backoff.reset()
        self._down_since = None
        self._purged = False
        self._set_health(True)
        await self._notify()
        relay = asyncio.create_task(self.relay.run(), name=f"worker-relay-{self.address}")
        try:
            while True:
                resubscribe = await self._follow(self.worker_id)
                if not resubscribe:
                    return
                self.num_resubscribes += 1
        finally:
            await self.relay.close(relay)

    def generate(
        self, request: pb.GenerateRequest, timeout_s: float, metadata: tuple[tuple[str, str], ...]
    ) -> Any:
        """Start ``request`` on the worker: on its relay stream when it has one open (a
        call shaped like grpc's, decision 0034), else a Generate call of its own."""
        if self.relay.ready:
            size = request.ByteSize()
            if size <= MAX_START_BYTES:
                return self.relay.start(request, timeout_s, metadata, size)
        return self.relay_stub.Generate(request, timeout=timeout_s, metadata=metadata)

    async def _follow(self, worker_id: str) -> bool:
        """One subscription; True when the core asked to resubscribe, False when it ended."""
        epoch, after_seq = self._core.expected_subscription(worker_id)
        req = pb.SubscribeRequest(
            epoch=epoch,
            after_seq=after_seq,
            subscriber_id=self.config.subscriber_id,
            accepts_runs=True,
        )
        call = self._subscribe(req)
        self._call = call
        try:
            async for data in call:
                reason = self._apply(worker_id, data)
                await self._notify()
                if reason is not None:
                    log.info("worker %s: resubscribing (%s)", worker_id, reason)
                    return True
            return False
        finally:
            call.cancel()
            self._call = None

    def _apply(self, worker_id: str, data: bytes) -> str | None:
        """Apply one stream message (each batch of a run in turn: what queued on the worker
        while this stream's window was full, decision 0056); why the core asks to
        resubscribe, when it does (the rest of the message is dropped: it comes again)."""
        parts = codec.stream_parts(data)
        if len(parts) > 1:
            self.num_runs += 1
        for part in parts:
            decoded = codec.decode_stream_lazy(part)  # a plain batch's events unbuilt
            if decoded.worker_id != worker_id:
                raise ContractError(
                    f"stream message worker_id={decoded.worker_id!r} but the worker at "
                    f"{self.address} is {worker_id!r}"
                )
            self.num_messages += 1
            for action in self._core.on_stream_message(worker_id, decoded):
                match action:
                    case Resubscribe(reason=reason):
                        return reason
        return None

    @property
    def state(self) -> str:
        """healthy; unhealthy (known, now down); refused (answered, failed a check: the log
        says which); unreachable (never answered)."""
        if self.healthy:
            return "healthy"
        if self.refused:
            return "refused"
        return "unhealthy" if self.num_connects else "unreachable"

    # ---- identity, health, purge ---------------------------------------------------------

    def _claim(self, info: pb.WorkerInfo) -> bool:
        if not info.worker_id:
            log.error("worker at %s reports an empty worker_id; not routing to it", self.address)
            return False
        pool = self._pool_of(info)
        if pool is None or not self._same_tokenizer(info, pool) or not self._same_hash_key(info):
            if self.worker_id is not None:  # restarted with another model: let go of it
                self._hooks.release(self, self.worker_id)
                self.worker_id = None
            return False
        if self.worker_id is not None and self.model != pool:
            log.warning(
                "worker %s at %s moved from model %r to %r",
                self.worker_id,
                self.address,
                self.model,
                pool,
            )
            self._hooks.release(self, self.worker_id)
            self.worker_id = None
        if self.worker_id is not None and self.worker_id != info.worker_id:
            log.warning(
                "worker at %s changed identity %s -> %s",
                self.address,
                self.worker_id,
                info.worker_id,
            )
            self._hooks.release(self, self.worker_id)
            self.worker_id = None
        if self.worker_id is None:
            if not self._hooks.claim(self, info.worker_id, info.block_size, pool):
                return False
            self.worker_id = info.worker_id
        self.model = pool
        self.info = info
        return True

    def _pool_of(self, info: pb.WorkerInfo) -> str | None:
        """The pool the worker's announced model puts it in (router.core.pools); None, logged
        once per worker and model, when the router does not serve that model."""
        try:
            pool = self._core.pool_for_worker(info.model_name)
        except UnservedModelError as exc:
            seen = (info.worker_id, info.model_name)
            if self._model_refusal != seen:
                self._model_refusal = seen
                log.warning("not routing to worker %s at %s: %s", info.worker_id, self.address, exc)
            return None
        self._model_refusal = None
        return pool

    def _same_hash_key(self, info: pb.WorkerInfo) -> bool:
        """Whether the worker hashes blocks with the router's key (--hash-key): under
        another key none of its KV events would match a prompt. Logged once per worker."""
        expected = self.config.hash_key_fingerprint
        if expected is None or info.hash_key_fingerprint == expected:
            return True
        seen = (info.worker_id, info.hash_key_fingerprint)
        if self._hash_key_refusal != seen:
            self._hash_key_refusal = seen
            log.warning(
                "not routing to worker %s at %s: its block-hashing key fingerprint %s differs "
                "from the router's %s; give router and workers the same --hash-key",
                info.worker_id,
                self.address,
                info.hash_key_fingerprint or "(unkeyed)",
                expected or "(unkeyed)",
            )
        return False

    def _same_tokenizer(self, info: pb.WorkerInfo, pool: str) -> bool:
        """Whether the worker tokenizes as the router does: token ids the router computes
        from text, and the block hashes of its index, mean nothing to a worker whose
        tokenizer differs. A mismatch is logged once per worker and fingerprint. A worker
        with no fingerprint (an engine bridge) is accepted only by a router configured to
        (no --model: ``accept_no_fingerprint``), with one WARNING. ``pool``: the pool it
        joins, whose tokenizer it must share."""
        expected = dict(self.config.pool_fingerprints).get(pool, self.config.tokenizer_fingerprint)
        if expected is None or info.tokenizer_fingerprint == expected:
            self._tokenizer_refusal = None
            return True
        if not info.tokenizer_fingerprint and self.config.accept_no_fingerprint:
            self._tokenizer_refusal = None
            if self._no_fingerprint_warned != info.worker_id:
                self._no_fingerprint_warned = info.worker_id
                log.warning(
                    "worker %s at %s (model %r) reports no tokenizer fingerprint (an engine "
                    "bridge): routing to it unchecked; send prompts as token ids of its "
                    "model's vocabulary",
                    info.worker_id,
                    self.address,
                    info.model_name,
                )
            return True
        seen = (info.worker_id, info.tokenizer_fingerprint)
        if self._tokenizer_refusal != seen:
            self._tokenizer_refusal = seen
            hint = "serve the same --model on router and workers"
            if not info.tokenizer_fingerprint:
                hint = (
                    "an engine bridge reports none: start the router without --model to "
                    "route to it (token-id prompts)"
                )
            log.warning(
                "not routing to worker %s at %s (model %r): its tokenizer fingerprint %s "
                "differs from the router's %s; %s",
                info.worker_id,
                self.address,
                info.model_name,
                info.tokenizer_fingerprint or "(none reported)",
                expected,
                hint,
            )
        return False

    def _set_health(self, healthy: bool) -> None:
        if healthy == self.healthy:
            return
        self.healthy = healthy
        if self.worker_id is not None and self._core.has_worker(self.worker_id):
            self._core.set_health(self.worker_id, healthy)
        self._hooks.on_health(self, healthy)

    def _on_failure(self, reason: str) -> None:
        self.num_failures += 1
        self.last_error = reason
        if self.healthy:
            log.warning("worker %s at %s unhealthy: %s", self.worker_id, self.address, reason)
        elif self.num_failures == 1 and self.num_connects == 0 and not self.refused:
            log.warning(
                "worker at %s unreachable: %s; retrying with backoff (logged again when it "
                "connects)",
                self.address,
                reason,
            )
        else:
            log.debug("worker at %s still unreachable: %s", self.address, reason)
        if self._down_since is None:
            self._down_since = self._clock()
        self._set_health(False)

    def next_retry_delay(self) -> float:
        """Seconds until the next reconnect: the jittered backoff, shortened (never below
        zero) to wake up when a down worker's purge falls due. Counts one failure."""
        delay = self._backoff.next_delay()
        if self._purge_pending():
            assert self._down_since is not None
            until_purge = self._down_since + self.config.purge_after_s - self._clock()
            delay = min(delay, max(until_purge, 0.0))
        return delay

    def _purge_pending(self) -> bool:
        """A known worker is down and its index entries are not dropped yet."""
        return not self._purged and self._down_since is not None and self.worker_id is not None

    def _maybe_purge(self) -> bool:
        """Drop the index entries of a worker unreachable for ``purge_after_s``."""
        if not self._purge_pending():
            return False
        assert self._down_since is not None and self.worker_id is not None
        if self._clock() - self._down_since < self.config.purge_after_s:
            return False
        wid = self.worker_id
        if self._core.has_worker(wid):
            block_size = self.info.block_size if self.info is not None else None
            self._core.remove_worker(wid)
            self._core.add_worker(wid, self.address, block_size or None, model=self.model)
            self._core.set_health(wid, False)
        self._purged = True
        self.num_purges += 1
        log.warning(
            "worker %s at %s unreachable for %.1f s: dropped its index entries",
            wid,
            self.address,
            self.config.purge_after_s,
        )
        return True
