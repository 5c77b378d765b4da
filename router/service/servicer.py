"""The client-facing Router service: Generate (forwarded), Abort, Explain.

Generate, step by step::

    check capacity (RESOURCE_EXHAUSTED) -> check fields (INVALID_ARGUMENT)
    -> tenancy: the partition's cache_salt from metadata (tenancy.py)
    -> deadline = min(client's remaining time, max_deadline_s)  (max_deadline_s if none)
    -> attempt 1: core.route -> worker.Generate(timeout=remaining) -> relay the stream
         worker failure before anything was relayed -> attempt 2 on the next-best worker
                                                       (route with exclude={first worker})
         worker failure after the first relayed message -> UNAVAILABLE (never duplicate)
         (a worker stream that ends with OK but no Finished is a worker failure too)
         INVALID_ARGUMENT / RESOURCE_EXHAUSTED / DEADLINE_EXCEEDED from the worker
                                                     -> passed through, not counted
    -> the Finished message carries worker_id, the worker's usage, and attempts

A client cancelling its call cancels the handler task, whose ``finally`` cancels the worker
call. Transport and internal failures count towards the worker's outlier ejection
(resilience.py); ejected workers are excluded from routing until their cooldown ends.

Text prompts are routed on their UTF-8 bytes (see validation.py) and forwarded unchanged.
"""

from __future__ import annotations

import asyncio
import logging
import math
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
from opentelemetry import propagate, trace

from kvroute_proto import codec
from kvroute_proto import kvroute_pb2 as pb
from kvroute_proto import kvroute_pb2_grpc as pb_grpc
from kvroute_proto.events import Partition
from router.core import RouteDecision, RouterCore, RouteRequest
from router.errors import InvalidRouteRequestError, NoWorkerAvailable
from router.service.pool import WorkerPool
from router.service.resilience import EjectionConfig, OutlierEjector
from router.service.tenancy import TenancyConfig, TenancyError, resolve_partition
from router.service.validation import RequestError, RequestLimits, check_request, routing_tokens

log = logging.getLogger(__name__)
tracer = trace.get_tracer("kvroute.router")

# Statuses that say the worker (or the way to it) is broken: counted, retried if possible.
WORKER_FAILURE_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DATA_LOSS,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)


@dataclass(frozen=True, slots=True)
class ServicerConfig:
    """Admission, deadline, retry and tenancy settings of the Router service."""

    max_inflight: int = 1024
    max_deadline_s: float = 600.0
    max_attempts: int = 2
    limits: RequestLimits = field(default_factory=RequestLimits)
    tenancy: TenancyConfig = field(default_factory=TenancyConfig)
    ejection: EjectionConfig = field(default_factory=EjectionConfig)

    def __post_init__(self) -> None:
        if self.max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {self.max_inflight}")
        if not self.max_deadline_s > 0:
            raise ValueError(f"max_deadline_s must be > 0, got {self.max_deadline_s}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")


@dataclass(frozen=True, slots=True)
class _Prepared:
    """A checked request: what is forwarded, and what the router routes on."""

    forward: pb.GenerateRequest
    route: RouteRequest


@dataclass(slots=True)
class _InFlight:
    worker_id: str
    cache_salt: str  # Abort only from the same tenant
    released: bool = False


class RouterServicer(pb_grpc.RouterServicer):
    """Thin shell: decode, call RouterCore and the chosen worker, encode."""

    def __init__(
        self,
        core: RouterCore,
        pool: WorkerPool,
        config: ServicerConfig,
        *,
        clock: Callable[[], float],
    ) -> None:
        self._core = core
        self._pool = pool
        self._config = config
        self._clock = clock
        self.ejector = OutlierEjector(config.ejection, clock)
        self._inflight: dict[str, _InFlight] = {}
        self.num_retries = 0

    @property
    def num_inflight(self) -> int:
        """Generate calls admitted and not yet released (request ids are unique in flight)."""
        return len(self._inflight)

    # ---- Generate ------------------------------------------------------------------------

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        if self.num_inflight >= self._config.max_inflight:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"router has {self.num_inflight} requests in flight, "
                f"the limit is max_inflight={self._config.max_inflight}",
            )
        prepared = await self._prepare(request, context)
        rid = prepared.forward.request_id
        if rid in self._inflight:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"request_id {rid!r} is already in flight"
            )
        deadline = self._clock() + self._timeout_s(context)
        entry = _InFlight("", prepared.forward.partition.cache_salt)
        self._inflight[rid] = entry
        # Continue the caller's W3C trace, and pass ours on to the worker. The span is not
        # made "current": a context attached across the yields of this generator could not
        # be detached cleanly when the call ends early.
        parent = propagate.extract(dict(context.invocation_metadata() or ()))
        span = tracer.start_span("kvroute.router.Generate", context=parent)
        span.set_attribute("kvroute.request_id", rid)
        try:
            async for msg in self._relay(prepared, entry, deadline, context, span):
                if msg.HasField("finished"):
                    # release before the client can see the end, so the accounting is exact
                    # the moment the client's call completes
                    self._release(rid, entry)
                yield msg
        finally:
            self._release(rid, entry)
            span.end()

    def _release(self, rid: str, entry: _InFlight) -> None:
        if not entry.released:
            entry.released = True
            del self._inflight[rid]

    async def _relay(
        self,
        prepared: _Prepared,
        entry: _InFlight,
        deadline: float,
        context: grpc.aio.ServicerContext,
        span: trace.Span,
    ) -> AsyncIterator[pb.GenerateResponse]:
        rid = prepared.forward.request_id
        excluded: set[str] = set()
        failures: list[str] = []
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span))
        metadata = tuple(carrier.items())
        for attempt in range(1, self._config.max_attempts + 1):
            remaining = deadline - self._clock()
            if remaining <= 0:
                await context.abort(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"deadline exceeded before attempt {attempt}; failures: {'; '.join(failures)}",
                )
            decision = await self._route(prepared.route, excluded, failures, context)
            worker_id = decision.worker_id
            span.set_attributes(
                {
                    "kvroute.worker_id": worker_id,
                    "kvroute.attempts": attempt,
                    "kvroute.prompt_tokens": decision.prompt_tokens,
                    "kvroute.matched_tokens": decision.matched_tokens,
                }
            )
            conn = self._pool.by_worker_id(worker_id)
            if conn is None:  # released between route() and here; try another
                self._core.on_finished(rid)
                excluded.add(worker_id)
                failures.append(f"{worker_id}: disconnected")
                continue
            entry.worker_id = worker_id
            try:
                call = conn.stub.Generate(prepared.forward, timeout=remaining, metadata=metadata)
            except grpc.aio.UsageError:  # the channel closed: the pool is removing the worker
                self._core.on_finished(rid)
                excluded.add(worker_id)
                failures.append(f"{worker_id}: disconnected")
                continue
            relayed = False
            reported = False
            try:
                async for msg in call:
                    if not relayed:
                        self._core.on_first_token(rid)
                        relayed = True
                    if msg.HasField("finished"):
                        msg.finished.attempts = attempt
                        if not msg.finished.worker_id:
                            msg.finished.worker_id = worker_id
                        self.ejector.record_success(worker_id)
                        self._core.on_finished(rid, msg.finished.usage.completion_tokens)
                        reported = True
                    yield msg
                if reported:
                    self.ejector.record_success(worker_id)
                    return
                # ended with OK but no Finished: a broken worker, not an answer to relay
                code_name, details = "INTERNAL", "the stream ended without a Finished message"
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                if code not in WORKER_FAILURE_CODES:
                    # the worker's answer about this request: the client's to see
                    await context.abort(code, exc.details() or code.name)
                code_name, details = code.name, exc.details()
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is None or task.cancelling():  # the client's cancel or a shutdown
                    raise
                # not our cancellation: the pool closed the worker's channel under the call
                # (the worker left the registry); grpc.aio raises CancelledError for that
                code_name, details = "UNAVAILABLE", "the connection to the worker was closed"
            finally:
                call.cancel()
                if not reported:
                    self._core.on_finished(rid)
            if self.ejector.record_failure(worker_id):
                log.warning(
                    "worker %s ejected for %.1f s after %d consecutive failures",
                    worker_id,
                    self._config.ejection.cooldown_s,
                    self._config.ejection.max_consecutive_failures,
                )
            failures.append(f"{worker_id}: {code_name}: {details}")
            span.add_event("worker_failure", {"worker_id": worker_id, "code": code_name})
            if relayed:
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    f"worker {worker_id} failed after the response had started "
                    f"(not retried, to avoid duplicate output): {code_name}: {details}",
                )
            excluded.add(worker_id)
            if attempt < self._config.max_attempts:
                self.num_retries += 1
                log.info("request %s: retrying after %s", rid, failures[-1])
        await context.abort(
            grpc.StatusCode.UNAVAILABLE,
            f"request failed on {len(failures)} worker(s) "
            f"(max_attempts={self._config.max_attempts}): {'; '.join(failures)}",
        )

    async def _route(
        self,
        route: RouteRequest,
        excluded: set[str],
        failures: list[str],
        context: grpc.aio.ServicerContext,
    ) -> RouteDecision:
        req = RouteRequest(
            route.request_id,
            route.token_ids,
            route.partition,
            exclude=frozenset(excluded) | self.ejector.ejected(),
        )
        try:
            return self._core.route(req)
        except NoWorkerAvailable as exc:
            detail = f"; earlier failures: {'; '.join(failures)}" if failures else ""
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{exc}{detail}")
        except InvalidRouteRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        raise AssertionError("unreachable: context.abort raises")

    # ---- Abort and Explain ---------------------------------------------------------------

    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        entry = self._inflight.get(request.request_id)
        if entry is None or not entry.worker_id:
            return pb.AbortResponse(found=False)
        try:
            salt = resolve_partition(
                self._config.tenancy, context.invocation_metadata(), Partition()
            ).cache_salt
        except TenancyError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if salt != entry.cache_salt and not self._config.tenancy.trust_client_salt:
            return pb.AbortResponse(found=False)  # another tenant's request: not visible
        conn = self._pool.by_worker_id(entry.worker_id)
        if conn is None:
            return pb.AbortResponse(found=False)
        try:
            return await conn.stub.Abort(request, timeout=conn.config.rpc_timeout_s)
        except grpc.aio.UsageError:  # the channel closed: the pool is removing the worker
            return pb.AbortResponse(found=False)
        except grpc.aio.AioRpcError as exc:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"worker {entry.worker_id} did not answer Abort: {exc.code().name}",
            )
        raise AssertionError("unreachable")

    async def Explain(
        self, request: pb.ExplainRequest, context: grpc.aio.ServicerContext
    ) -> pb.ExplainResponse:
        prepared = await self._prepare(request.request, context)
        ejected = self.ejector.ejected()
        route = RouteRequest(
            prepared.route.request_id,
            prepared.route.token_ids,
            prepared.route.partition,
            exclude=ejected,
        )
        try:
            expl = self._core.explain(route)
        except InvalidRouteRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        resp = pb.ExplainResponse(
            policy=expl.policy,
            prompt_tokens=expl.prompt_tokens,
            chosen_worker_id=expl.chosen_worker_id or "",
        )
        for w in expl.workers:
            score = resp.workers.add(
                worker_id=w.worker_id,
                address=w.address or self._pool.address_of(w.worker_id),
                healthy=w.healthy and w.worker_id not in ejected,
                matched_tokens=w.matched_tokens,
                inflight_prefill_tokens=w.inflight_prefill_tokens,
                cost=math.nan if w.cost is None else w.cost,
                recent_prefill_tokens=w.recent_prefill_tokens,
            )
            if w.load is not None:
                score.load.CopyFrom(codec.load_to_pb(w.load))
        return resp

    # ---- helpers -------------------------------------------------------------------------

    async def _prepare(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> _Prepared:
        """Check fields, derive the partition, assign a request id (INVALID_ARGUMENT)."""
        try:
            check_request(request, self._config.limits)
            partition = resolve_partition(
                self._config.tenancy,
                context.invocation_metadata(),
                codec.partition_from_pb(request.partition),
            )
        except (RequestError, TenancyError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        forward = pb.GenerateRequest()
        forward.CopyFrom(request)
        if not forward.request_id:
            forward.request_id = f"r-{uuid.uuid4().hex}"
        forward.partition.CopyFrom(codec.partition_to_pb(partition))
        route = RouteRequest(forward.request_id, routing_tokens(forward), partition)
        return _Prepared(forward, route)

    def _timeout_s(self, context: grpc.aio.ServicerContext) -> float:
        remaining = context.time_remaining()
        if remaining is None or not math.isfinite(remaining):
            return self._config.max_deadline_s
        return min(max(remaining, 0.0), self._config.max_deadline_s)
