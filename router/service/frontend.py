"""The router's one request path, under every front door (gRPC, OpenAI HTTP).

``Frontend.generate``, step by step::

    check capacity (Overloaded) -> check fields (BadRequest)
    -> tenancy: the partition's cache_salt from the caller's metadata (tenancy.py)
    -> tokenize a text prompt with the fleet's tokenizer; forward the token ids
    -> deadline = min(client's remaining time, max_deadline_s)  (max_deadline_s if none)
    -> attempt 1: core.route -> worker.Generate(timeout=remaining) -> relay the stream
         worker failure before anything was relayed -> attempt 2 on the next-best worker
                                                       (route with exclude={first worker})
         worker failure after the first relayed message -> Unavailable (never duplicate)
         (a worker stream that ends with OK but no Finished is a worker failure too)
         INVALID_ARGUMENT / RESOURCE_EXHAUSTED / DEADLINE_EXCEEDED from the worker
                                                     -> passed through, not counted
    -> the Finished message carries worker_id, the worker's usage, and attempts

It knows neither protocol's server side: it takes a ``GenerateRequest`` message (our own
request type, also what is forwarded to the worker) and a ``CallInfo``, yields the worker's
messages, and refuses by raising a ``edge.frontdoor.ServiceError``, which carries
its gRPC code and HTTP status. Closing the iterator (a cancelled gRPC call, an HTTP client
that went away) cancels the worker call, which aborts the request on the worker.

Transport and internal failures count towards the worker's outlier ejection
(resilience.py); ejected workers are excluded from routing until their cooldown ends.

Tokens: with a tokenizer (``kvroute router --model DIR``) a text prompt is encoded here and
forwarded as token ids, so the blocks the router hashes are the blocks the worker caches and
reports. Without one, a text prompt is routed on its UTF-8 bytes and forwarded as text (exact
for workers with the byte tokenizer: the tiny default model and the sim executor).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry import propagate, trace

from edge.frontdoor import (
    BadRequest,
    CallInfo,
    DeadlineExceeded,
    ModelNotFound,
    Overloaded,
    ServiceError,
    Unavailable,
    error_for_grpc_code,
)
from kvroute_proto import kvroute_pb2 as pb
from router.core.admission import Admission
from router.core.errors import InvalidRouteRequestError, NoWorkerAvailable
from router.core.pools import PoolsExplanation, RouterPools, UnknownModelError
from router.core.router_core import RouteDecision, RouterCore, RouteRequest
from router.service import spans
from router.service.explain import explain_pools
from router.service.frontend_config import DEFAULT_MODEL_NAME, FrontendConfig
from router.service.observe import NO_OBSERVER, RequestObserver
from router.service.pool import WorkerPool
from router.service.prepare import Prepared, prepare_request
from router.service.quota import OverLimit, TenantQuotas
from router.service.resilience import OutlierEjector
from router.service.tenancy import TenancyError, tenant_of
from router.service.token_cache import with_chunk_cache
from router.service.validation import TextTokenizer

__all__ = ["DEFAULT_MODEL_NAME", "Frontend", "FrontendConfig", "PoolsExplanation"]

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

REFUSAL_HOLD_S = 1.0  # the longest a tenant's over-limit refusal is held (hold_refusal)
MAX_HELD_REFUSALS = 32


@dataclass(slots=True)
class _InFlight:
    worker_id: str
    tenant: str = ""  # request ids are the tenant's own: Abort only from the same tenant
    client_id: str = ""  # the id the caller gave (the router's own id may differ)
    released: bool = False
    started: float = 0.0  # perf_counter at arrival (the observer's latencies)
    finished: bool = False  # the worker's Finished was relayed
    guard_deadline: bool = False  # the caller set a deadline: admission guards it


class Frontend:
    """Validate, tokenize, route, retry, relay, account: one object for every front door.
    Each request goes to the pool of its model (router.core.pools)."""

    def __init__(
        self,
        pools: RouterPools,
        pool: WorkerPool,
        config: FrontendConfig,
        *,
        clock: Callable[[], float],
        tokenizer: TextTokenizer | None = None,
        observer: RequestObserver = NO_OBSERVER,
        pool_tokenizers: Mapping[str, TextTokenizer] | None = None,
    ) -> None:
        self._pools = pools
        self.observer = observer  # metrics: watches the request path, never steers it
        self._pool = pool
        self.config = config
        self._clock = clock
        # text prompts repeat their long parts: tokenize each chunk once (exact; tokenizers
        # it cannot be exact for are used as they are)
        self.tokenizer = with_chunk_cache(tokenizer) if tokenizer is not None else None
        # pools with a tokenizer of their own (several --model); the others use ``tokenizer``
        self.tokenizers = {m: with_chunk_cache(t) for m, t in (pool_tokenizers or {}).items()}
        # a text prompt's tail that no cache can match is left to the worker to tokenize
        self.split_prompts = config.split_prompts
        self.ejector = OutlierEjector(config.ejection, clock)
        self.admission = Admission(config.admission)
        self.quotas = TenantQuotas(config.quotas, clock)
        self._inflight: dict[str, _InFlight] = {}  # by the router's own request id
        self._by_client: dict[tuple[str, str], str] = {}  # (tenant, caller's id) -> own id
        self._held = 0  # over-limit refusals being held (hold_refusal)
        self.num_retries = 0

    @property
    def model_name(self) -> str:
        """The model a request naming none is served by: the only served one (else the
        default pool's name; such a request is refused then)."""
        served = self._pools.served_models()
        return served[0] if len(served) == 1 else self.config.model_name

    def served_models(self) -> list[str]:
        """Every model the router serves (GET /v1/models)."""
        return self._pools.served_models()

    def tokenizer_for(self, model: str) -> TextTokenizer | None:
        """The tokenizer of ``model``'s pool."""
        return self.tokenizers.get(model, self.tokenizer)

    def resolve(self, model: str | None) -> tuple[str, RouterCore]:
        """The pool serving ``model``: 404 model_not_found, or 400 for a request naming
        none on a router serving several (each naming the served models)."""
        try:
            return self._pools.resolve(model)
        except UnknownModelError as exc:
            if exc.model:
                raise ModelNotFound(str(exc), param="model") from None
            raise BadRequest(str(exc), param="model") from None

    @property
    def num_inflight(self) -> int:
        """Generate calls admitted and not yet released (request ids are unique in flight)."""
        return len(self._inflight)

    # ---- generate ------------------------------------------------------------------------

    async def generate(
        self, request: pb.GenerateRequest, call: CallInfo
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        """Route ``request`` and relay the chosen worker's stream (raises ServiceError)."""
        started = time.perf_counter()
        try:
            if self.num_inflight >= self.config.max_inflight:
                raise Overloaded(
                    f"router has {self.num_inflight} requests in flight, "
                    f"the limit is max_inflight={self.config.max_inflight}",
                    retry_after_s=1.0,
                )
            tenant = tenant_of(self.config.tenancy, call.metadata, call.tenant_id)
            sure = self._sure_cost(request, with_output=True)
            self.quotas.precheck(tenant, sure)  # a tenant over its limits costs no tokenizing
            prepared = self.prepare(request, call)
            client_id = prepared.forward.request_id
            if (tenant, client_id) in self._by_client:
                raise BadRequest(
                    f"request_id {client_id!r} is already in flight", param="request_id"
                )
            cost = self._quota_cost(prepared, with_output=True)
            lease = self.quotas.acquire(tenant, cost, sure)
        except ServiceError as exc:
            self.observer.on_end("", self._pools.policy_name, exc.grpc_code)
            await self.hold_refusal(exc)
            raise
        prepared = self._own_id(prepared)  # unique across tenants: the core and workers see it
        rid = prepared.forward.request_id
        deadline = self._clock() + self._timeout_s(call)
        entry = _InFlight("", tenant=tenant, client_id=client_id, started=started)
        self._by_client[(tenant, client_id)] = rid
        # only a caller's own deadline is guarded by admission: one without is willing to wait
        entry.guard_deadline = call.timeout_s is not None and math.isfinite(call.timeout_s)
        self._inflight[rid] = entry
        # Continue the caller's W3C trace, and pass ours on to the worker. The span is not
        # made "current": a context attached across the yields of this generator could not
        # be detached cleanly when the call ends early.
        parent = propagate.extract(dict(call.metadata))
        span = tracer.start_span("kvroute.router.Generate", context=parent)
        span.set_attribute("kvroute.request_id", client_id)
        if span.is_recording():
            spans.record_request(span, prepared.forward, prepared.model)
        outcome = "OK"
        try:
            # closed as soon as this generator is: the worker call is cancelled at once, not
            # when the garbage collector finds the inner generator
            async with contextlib.aclosing(self._relay(prepared, entry, deadline, span)) as relay:
                async for msg in relay:
                    if rid != client_id:
                        msg.request_id = client_id
                    if msg.HasField("finished"):
                        # release before the client can see the end, so the accounting is
                        # exact the moment the client's call completes
                        self._release(rid, entry)
                        if not prepared.forward.sampling.max_new_tokens:  # not charged yet
                            self.quotas.charge_output(tenant, msg.finished.usage.completion_tokens)
                    yield msg
        except ServiceError as exc:
            outcome = exc.grpc_code
            raise
        except (asyncio.CancelledError, GeneratorExit):  # the client went away
            outcome = "CANCELLED"
            raise
        except Exception:
            outcome = "INTERNAL"
            raise
        finally:
            self._release(rid, entry)
            if not entry.worker_id and not entry.finished:  # refused before any worker saw it
                lease.refund()
            lease.release()
            span.end()
            if entry.finished:
                outcome = "OK"
            self.observer.on_end(entry.worker_id, self._pools.policy_name, outcome)

    async def hold_refusal(self, exc: ServiceError) -> None:
        """Hold a tenant's over-limit refusal until it could be admitted, at most
        ``REFUSAL_HOLD_S``: a tenant sending what it cannot afford on a few connections then
        sends no faster than it is answered, and the router's CPU (each request is received
        and parsed before any limit can refuse it) stays with the other tenants. At most
        ``MAX_HELD_REFUSALS`` are held at once (each holds its request); the rest are
        answered at once."""
        if not isinstance(exc, OverLimit) or self._held >= MAX_HELD_REFUSALS:
            return
        hint = exc.retry_after_s
        held = REFUSAL_HOLD_S if hint is None else min(hint, REFUSAL_HOLD_S)
        self._held += 1
        try:
            await asyncio.sleep(held)
        finally:
            self._held -= 1
        if hint is not None and exc.timed:
            exc.retry_after_s = hint - held  # counted from the answer

    @staticmethod
    def _quota_cost(prepared: Prepared, *, with_output: bool) -> int:
        """What a request is charged in its tenant's token bucket (quota.py)."""
        route = prepared.route
        prompt = len(route.token_ids) if route.prompt_tokens is None else route.prompt_tokens
        return prompt + (prepared.forward.sampling.max_new_tokens if with_output else 0)

    def _sure_cost(self, request: pb.GenerateRequest, *, with_output: bool) -> int:
        """What ``request`` costs at least, before it is tokenized: a text prompt holds at
        least one token per ``max_token_chars`` characters (0 for a tokenizer that does not
        say its longest token)."""
        output = request.sampling.max_new_tokens if with_output else 0
        if request.WhichOneof("prompt") == "prompt_token_ids":
            return len(request.prompt_token_ids.ids) + output
        chars = len(request.prompt_text)  # the bytes a text is routed on when untokenized
        tokenizer = self.tokenizers.get(request.model, self.tokenizer)
        per_token = 1 if tokenizer is None else getattr(tokenizer, "max_token_chars", 0)
        return (-(-chars // per_token) if per_token else 0) + output

    def _own_id(self, prepared: Prepared) -> Prepared:
        """``prepared`` under an id no other tenant's request in flight has: the caller's
        own when it is free (the common case), else the caller's with a unique suffix."""
        rid = prepared.forward.request_id
        if rid not in self._inflight:
            return prepared
        own = f"{rid}~{uuid.uuid4().hex[:12]}"
        prepared.forward.request_id = own
        return dataclasses.replace(
            prepared, route=dataclasses.replace(prepared.route, request_id=own)
        )

    def _release(self, rid: str, entry: _InFlight) -> None:
        if not entry.released:
            entry.released = True
            del self._inflight[rid]
            del self._by_client[(entry.tenant, entry.client_id)]

    async def _relay(
        self,
        prepared: Prepared,
        entry: _InFlight,
        deadline: float,
        span: trace.Span,
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        rid = prepared.forward.request_id
        core = prepared.core
        excluded: set[str] = set()
        failures: list[str] = []
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span))
        metadata = tuple(carrier.items())
        for attempt in range(1, self.config.max_attempts + 1):
            remaining = deadline - self._clock()
            if remaining <= 0:
                raise DeadlineExceeded(
                    f"deadline exceeded before attempt {attempt}; failures: {'; '.join(failures)}"
                )
            decision = self._decide(prepared, entry, excluded, failures, remaining, attempt, span)
            worker_id = decision.worker_id
            call = self._dispatch(prepared, entry, worker_id, remaining, metadata)
            if call is None:  # released between route() and here; try another
                core.on_finished(rid)
                excluded.add(worker_id)
                failures.append(f"{worker_id}: disconnected")
                continue
            admission = self.admission  # learns each worker's pace from what is relayed
            dispatched_at = self._clock()
            uncached = max(0, decision.prompt_tokens - decision.matched_tokens)
            admission.on_dispatch(rid, worker_id, dispatched_at, uncached)
            relayed = False
            reported = False
            try:
                async for msg in call:
                    if not relayed:
                        core.on_first_token(rid)
                        relayed = True
                        elapsed = time.perf_counter() - entry.started
                        self.observer.on_first_message(worker_id, elapsed)
                    if msg.HasField("finished"):
                        self._finish(prepared, msg.finished, decision, entry, attempt, span)
                        reported = True
                    else:
                        admission.on_tokens(rid, len(msg.chunk.token_ids), self._clock())
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
                    raise error_for_grpc_code(code.name, exc.details() or code.name) from None
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
                admission.on_done(rid)
                if not reported:
                    core.on_finished(rid)
            failures.append(f"{worker_id}: {code_name}: {details}")
            self._worker_failed(
                rid, worker_id, (code_name, details), dispatched_at, relayed, attempt, span
            )
            excluded.add(worker_id)
        raise Unavailable(
            f"request failed on {len(failures)} worker(s) "
            f"(max_attempts={self.config.max_attempts}): {'; '.join(failures)}"
        )

    def _decide(
        self,
        prepared: Prepared,
        entry: _InFlight,
        excluded: set[str],
        failures: list[str],
        remaining: float,
        attempt: int,
        span: trace.Span,
    ) -> RouteDecision:
        """Route one attempt, timed for the observer and recorded on the span."""
        costs = None  # the route span's top costs, before the decision (tracing only)
        if span.is_recording():
            ejected = self.ejector.ejected()
            costs = spans.top_costs(prepared.core, prepared.route, frozenset(excluded) | ejected)
        t0 = time.perf_counter()
        time_left = remaining if entry.guard_deadline else None
        decision = self._route(prepared, excluded, failures, time_left)
        elapsed = time.perf_counter() - t0
        self.observer.on_route(decision, elapsed)
        if costs is not None:
            spans.record_route(span, decision, elapsed, attempt, costs)
        span.set_attributes(
            {
                "kvroute.worker_id": decision.worker_id,
                "kvroute.attempts": attempt,
                "kvroute.prompt_tokens": decision.prompt_tokens,
                "kvroute.matched_tokens": decision.matched_tokens,
            }
        )
        return decision

    def _dispatch(
        self,
        prepared: Prepared,
        entry: _InFlight,
        worker_id: str,
        remaining: float,
        metadata: tuple[tuple[str, str], ...],
    ) -> Any:
        """The worker's Generate call (a grpc.aio stream), or None when its connection is
        gone (released after the route, or its channel closing)."""
        conn = self._pool.by_worker_id(worker_id)
        if conn is None:
            return None
        entry.worker_id = worker_id
        try:
            return conn.generate(prepared.forward, remaining, metadata)
        except grpc.aio.UsageError:  # the channel closed: the pool is removing the worker
            return None

    def _finish(
        self,
        prepared: Prepared,
        finished: pb.Finished,
        decision: RouteDecision,
        entry: _InFlight,
        attempt: int,
        span: trace.Span,
    ) -> None:
        """The worker's Finished: completed for the client, accounted, observed, traced."""
        worker_id = decision.worker_id
        finished.attempts = attempt
        if not finished.worker_id:
            finished.worker_id = worker_id
        self.ejector.record_success(worker_id)
        prepared.core.on_finished(prepared.forward.request_id, finished.usage.completion_tokens)
        entry.finished = True
        elapsed = time.perf_counter() - entry.started
        self.observer.on_finished(decision, finished, elapsed)
        if span.is_recording():
            spans.record_finish(span, finished)

    def _worker_failed(
        self,
        rid: str,
        worker_id: str,
        error: tuple[str, str],
        dispatched_at: float,
        relayed: bool,
        attempt: int,
        span: trace.Span,
    ) -> None:
        """An attempt (sent at ``dispatched_at``) failed on the worker with ``error`` (code
        name, details): count it toward ejection, trace it, and raise Unavailable when part
        of the response was already relayed (never retried, to avoid duplicate output); else
        count the retry when another attempt follows."""
        code_name, details = error
        if self.ejector.record_failure(worker_id, dispatched_at):
            log.warning(
                "worker %s ejected for %.1f s after %d consecutive failures",
                worker_id,
                self.config.ejection.cooldown_s,
                self.config.ejection.max_consecutive_failures,
            )
        span.add_event("worker_failure", {"worker_id": worker_id, "code": code_name})
        if relayed:
            raise Unavailable(
                f"worker {worker_id} failed after the response had started "
                f"(not retried, to avoid duplicate output): {code_name}: {details}"
            )
        if attempt < self.config.max_attempts:
            self.num_retries += 1
            self.observer.on_retry(worker_id, code_name)
            log.info("request %s: retrying after %s: %s: %s", rid, worker_id, code_name, details)

    def _route(
        self,
        prepared: Prepared,
        excluded: set[str],
        failures: list[str],
        time_left_s: float | None,
    ) -> RouteDecision:
        """Route, leaving out failed, ejected and (for a caller's deadline of
        ``time_left_s``) too busy workers."""
        route, core = prepared.route, prepared.core
        exclude = frozenset(excluded) | self.ejector.ejected()
        late: frozenset[str] = frozenset()
        if time_left_s is not None:
            late = self.admission.excluded(
                [w for w in core.workers() if w not in exclude],
                prepared.forward.sampling.max_new_tokens,
                time_left_s,
                self._quota_cost(prepared, with_output=False),  # its prompt, as if uncached
            )
        req = RouteRequest(route.request_id, route.token_ids, route.partition, exclude | late)
        try:
            return core.route(req)
        except NoWorkerAvailable as exc:
            if late:  # healthy workers exist, but none can finish this in time
                self.admission.on_refused()
                new_tokens = prepared.forward.sampling.max_new_tokens
                prompt = self._quota_cost(prepared, with_output=False)
                idle_s = self.admission.idle_estimate_s(sorted(late), new_tokens, prompt)
                if idle_s is not None:  # the fleet is idle: waiting would not help
                    raise Overloaded(
                        f"no worker can finish request {route.request_id!r} within its "
                        f"deadline ({time_left_s:.1f} s left): even idle, the fastest needs "
                        f"~{idle_s:.1f} s for its {prompt} prompt and "
                        f"{new_tokens or 'default'} new tokens (estimated from the workers' "
                        "recent work); give it a longer deadline, a shorter prompt or a "
                        "smaller max_new_tokens"
                    ) from None
                raise Overloaded(
                    f"no worker can finish request {route.request_id!r} within its deadline "
                    f"({time_left_s:.1f} s left): {len(late)} worker(s) are too busy; {exc}",
                    retry_after_s=1.0,
                ) from None
            detail = f"; earlier failures: {'; '.join(failures)}" if failures else ""
            raise Unavailable(f"{exc}{detail}", retry_after_s=1.0) from None
        except InvalidRouteRequestError as exc:
            raise BadRequest(str(exc), param=exc.field) from None

    # ---- abort and explain ---------------------------------------------------------------

    async def abort(self, request_id: str, call: CallInfo) -> bool:
        """Abort an in-flight request of the caller's tenant (request ids are each tenant's
        own: another tenant's request of the same id is not visible); whether it was found."""
        try:
            tenant = tenant_of(self.config.tenancy, call.metadata, call.tenant_id)
        except TenancyError as exc:
            raise BadRequest(str(exc)) from None
        rid = self._by_client.get((tenant, request_id))
        entry = None if rid is None else self._inflight.get(rid)
        if entry is None or not entry.worker_id:
            return False
        conn = self._pool.by_worker_id(entry.worker_id)
        if conn is None:
            return False
        try:
            resp = await conn.stub.Abort(
                pb.AbortRequest(request_id=rid), timeout=conn.config.rpc_timeout_s
            )
        except grpc.aio.UsageError:  # the channel closed: the pool is removing the worker
            return False
        except grpc.aio.AioRpcError as exc:
            raise Unavailable(
                f"worker {entry.worker_id} did not answer Abort: {exc.code().name}"
            ) from None
        return bool(resp.found)

    def explain(self, request: pb.GenerateRequest, call: CallInfo) -> PoolsExplanation:
        """Each worker's match, load and cost, and the pick, in the request's pool (every
        pool's for a request naming no model on a router serving several); routes nothing
        (router.service.explain)."""
        return explain_pools(self, request, call)

    # ---- helpers -------------------------------------------------------------------------

    def prepare(
        self, request: pb.GenerateRequest, call: CallInfo, *, split: bool = True
    ) -> Prepared:
        """Find the request's pool (ModelNotFound), check fields, derive the partition,
        tokenize, assign a request id (BadRequest); ``split``: see
        :func:`router.service.prepare.prepare_request`."""
        model, core = self.resolve(request.model)
        config, tok = self.config, self.tokenizers.get(model, self.tokenizer)
        split = split and self.split_prompts
        pool = (model, core)
        return prepare_request(request, call, config.limits, config.tenancy, tok, pool, split)

    def _timeout_s(self, call: CallInfo) -> float:
        remaining = call.timeout_s
        if remaining is None or not math.isfinite(remaining):
            return self.config.max_deadline_s
        return min(max(remaining, 0.0), self.config.max_deadline_s)
