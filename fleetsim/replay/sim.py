"""Discrete-event fleet simulation: the real router core and real engines, a virtual clock.

Sans-I/O: imports neither asyncio nor grpc, and never reads the wall clock for results (only
the progress line does). Time is ``FleetSim.now``, advanced by a heap of events::

    ARRIVE(i)        RouterCore.route -> Engine.add_request on the chosen worker;
                     an idle worker starts a step now
    STEP_DONE(w)     the step that began at t finishes at t + engine.last_step_cost_s:
                     its outputs stamp TTFT / e2e and call on_first_token / on_finished,
                     engine.take_events() is published (EventPublisher: epoch, seq) and the
                     batch is sent; if the engine still has work, the next step starts now
    DELIVER(w, msg)  the batch reaches the router event_delay_s after it was sent:
                     RouterCore.on_stream_message (Resubscribe -> a snapshot follows)
    LOAD_TICK(w)     every load_interval_s a batch with the worker's LoadReport (as the
                     real worker service does; there the report is a job on the engine
                     thread, behind the step in flight, so one due during a step goes out
                     when that step ends, here too); with step_reports (kvroute worker
                     --step-reports) also as a step starts and after it, when
                     worker/engine/load_reports.py says so
    FLUSH            every flush_interval_s the next worker in turn drops its cache
                     (RadixCache.reset: AllCleared, then what running requests still lock,
                     as /flush_cache or a restarted cache would): routers that read events
                     learn it; one that routes on its own history does not
    ROUTER_FREE(k)   with a decision time (route_decision_s, or measured): router k is
                     done with one decision (or, with replica_apply_s, with applying a
                     peer's event); the next job queued at it starts now
    ADMIT(w, req)    with a decision time or a network delay (network_delay_s): the routed
                     request reaches its worker that much after the router picked it

The stricter settings (fleetsim/replay/strict.py, all off by default): the cost model's
weight-read floor, the decision time (a router decides one request at a time, so a burst
queues at it; TTFT counts from arrival at the router), the router -> worker delay, the
model's context (requests over it are rejected by the engine and counted as errors) and
event loss: each EventBatch (live, or replayed after a Resubscribe) is lost on its way to
each router with probability event_loss, seeded; snapshots are not. The router then sees
a gap at the next batch and recovers through the real sequencer (router/core/sync.py): a
Resubscribe, which the worker answers from its replay buffer or with a snapshot.

Everything is ordered by (time, insertion number), so a run is a pure function of the trace,
the policy and the seed (unless the routing time is measured: ``measure_route_time``). What
the simulation bypasses is only gRPC: the router sees the same EventBatch / Snapshot
sequence, with the same numbering, a fixed delay later -- so the staleness of its index is
part of the result.

Granularity: trace hash ids (512 tokens for Mooncake) only decide token *content*; the
engines run with page_size 16 and announce 16-token blocks (both configurable), as a real
fleet would.

Several routers (``SimConfig.num_routers`` R > 1): R independent :class:`RouterCore`
objects (own index, predictions, in-flight counts, seeded tie-breaks), each told there are R
replicas; request i goes to router ``i % R`` (a conversation's turns land on different
routers, the worst case for history). Every worker's batches and load reports reach every
router through its own sequencer; a Resubscribe replays to the router that asked only. First
token and finish are reported to the router that routed the request. With replica sync
(``replica_sync_delay_s``) each router's picks, first tokens and finishes also reach the
others that much later (``RouterCore.apply_replica``, as ``kvroute router --replica-sync``
does through Redis); with a decision time and ``replica_apply_s`` applying a peer's event is
a job of the receiving router too, done before its next queued decision.

The references (pooled, infinite) run it on one big engine: :mod:`fleetsim.replay.references`.
"""

from __future__ import annotations

import enum
import heapq
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import TextIO

from fleetsim.replay.progress import Progress
from fleetsim.replay.report import PolicyReport, RequestResult, summarize
from fleetsim.replay.sim_config import SimConfig
from fleetsim.replay.trace import TokenExpander, TraceRecord
from kvroute_proto.events import EventBatch, LoadReport, Snapshot
from router.core.core_types import ReplicaEvent, ReplicaRouted
from router.core.router_core import NoWorkerAvailable, Resubscribe, RouterCore, RouteRequest
from router.core.step_profile import StepProfile
from worker.engine.engine import Engine, EngineConfig
from worker.engine.load_reports import StepReports
from worker.engine.sim_executor import SimExecutor, SimExecutorConfig
from worker.engine.types import EngineRequest, ForwardItem, RequestOutput, SamplingParams
from worker.errors import WorkerError
from worker.service.publisher import EventPublisher, PublisherConfig


class _Kind(enum.IntEnum):
    """Event kinds, in tie-break order at equal times: deliveries before steps before
    arrivals, so the router sees what the fleet knew "at" an instant before routing then."""

    DELIVER = 0
    REPLICA = 1  # replica sync: another router's pick / first token / finish reaches a router
    LOAD_TICK = 2
    STEP_DONE = 3
    ADMIT = 4  # a routed request reaches its worker (after decision time + network delay)
    ROUTER_FREE = 5  # a router finished a decision; the next one queued at it starts
    FLUSH = 6  # the next worker in turn drops its cache
    ARRIVE = 7


class SimulationStuckError(RuntimeError):
    """A worker had work but made no progress for too many steps (an engine bug)."""


class _ScaledExecutor:
    """A SimExecutor whose steps run ``speed`` times faster (one engine standing in for N)."""

    def __init__(self, inner: SimExecutor, speed: float) -> None:
        self._inner = inner
        self._scale = 1.0 / speed
        self.vocab_size = inner.vocab_size
        self.max_context_tokens = inner.max_context_tokens
        self.eos_token_id = inner.eos_token_id
        self.eos_token_ids = inner.eos_token_ids

    def forward(self, prefill: list[ForwardItem], decode: list[ForwardItem]) -> list[int]:
        return self._inner.forward(prefill, decode)

    def step_cost_s(self, prefill: list[ForwardItem], decode: list[ForwardItem]) -> float:
        return self._inner.step_cost_s(prefill, decode) * self._scale

    @property
    def num_steps(self) -> int:
        return self._inner.num_steps

    @property
    def num_floor_steps(self) -> int:
        return self._inner.num_floor_steps


@dataclass(slots=True)
class _Worker:
    worker_id: str
    engine: Engine
    publisher: EventPublisher
    busy: bool = False  # a step is in flight (STEP_DONE scheduled)
    num_idle_steps: int = 0
    busy_s: float = 0.0  # modelled time spent in steps (prefill + decode work)
    step_reports: StepReports | None = None  # SimConfig.step_reports
    report_after_step: bool = False  # a load report fell due during the step in flight


def _executor(worker: _Worker) -> SimExecutor | _ScaledExecutor:
    return worker.engine.executor  # type: ignore[return-value]  # the sim builds only these


def max_context_for(records: Sequence[TraceRecord]) -> int:
    """A context length that fits every request of the trace (prompt + output)."""
    return max(r.input_length + r.output_length for r in records) + 1


class FleetSim:
    """One simulated replay of a trace under one policy (use :func:`simulate`)."""

    def __init__(
        self,
        records: Sequence[TraceRecord],
        policy: str,
        config: SimConfig,
        expander: TokenExpander,
        *,
        engine_config: Callable[[str], EngineConfig] | None = None,
        speed: float = 1.0,
    ) -> None:
        self.records = records
        self.policy = policy
        self.config = config
        self.expander = expander
        self.now = 0.0
        self._heap: list[tuple[float, _Kind, int, object]] = []
        self._counter = 0
        clock = self._clock
        router_config = config.router_config(policy)
        # router k's tie-breaks: seed for the first (the single-router run is unchanged)
        self.routers = [
            RouterCore(router_config, clock=clock, rng=random.Random(config.seed + 7919 * k))
            for k in range(config.num_routers)
        ]
        self.router = self.routers[0]
        self.num_replica_events = 0
        if config.num_routers > 1 and config.replica_sync_delay_s is not None:
            for k, router in enumerate(self.routers):
                router.set_replica_listener(partial(self._tell_replicas, k))
        self._owner: dict[str, RouterCore] = {}  # request id -> the router that routed it
        # a router decides one request at a time: with a decision time, arrivals queue
        self._charge_routing = config.route_decision_s > 0 or config.measure_route_time
        # what each router has to do, one job at a time: requests to route (their index),
        # and with replica_apply_s the peers' events to apply ((sender, event)), which go
        # first: a router's event loop reads its subscription between two of a burst's calls
        self._route_queue: list[deque[int]] = [deque() for _ in self.routers]
        self._apply_queue: list[deque[tuple[int, ReplicaEvent]]] = [deque() for _ in self.routers]
        self._router_busy = [False] * len(self.routers)
        self._charge_apply = self._charge_routing and config.replica_apply_s > 0
        self.route_decision_s_total = 0.0
        self.replica_apply_s_total = 0.0
        self._loss_rng = random.Random(config.seed + 15_485_863)
        self.num_lost_batches = 0
        exec_config = SimExecutorConfig(
            vocab_size=config.vocab_size,
            max_context_tokens=config.max_context_tokens or max_context_for(records),
        )
        make_config = engine_config or self._worker_engine_config
        self.workers: dict[str, _Worker] = {}
        profile = config.cost_model.step_profile_s()  # as GetLoad states it
        for i in range(config.num_workers):
            wid = f"worker-{i}"
            base = SimExecutor(config.cost_model, exec_config)
            executor = base if speed == 1.0 else _ScaledExecutor(base, speed)
            engine = Engine(make_config(wid), executor, clock)
            publisher = EventPublisher(
                PublisherConfig(worker_id=wid, epoch=1 + i, block_size=config.block_size)
            )
            reports = StepReports(engine) if config.step_reports else None
            self.workers[wid] = _Worker(wid, engine, publisher, step_reports=reports)
            for router in self.routers:
                router.add_worker(wid, address=f"sim://{wid}", block_size=config.block_size)
                # as GetLoad states it to a real router
                router.set_max_running(wid, engine.config.max_running_requests)
                router.set_step_profile(wid, StepProfile.stated(*profile))
        self.results = [
            RequestResult(index=i, arrival_s=r.arrival_s, prompt_tokens=r.input_length)
            for i, r in enumerate(records)
        ]
        self._by_request_id: dict[str, RequestResult] = {}
        self.num_batches = 0
        self.num_snapshots = 0
        self.num_resubscribes = 0
        self.num_flushes = 0
        self.num_predicted_tokens = 0
        self.num_finished = 0

    def _clock(self) -> float:
        return self.now

    def _worker_engine_config(self, worker_id: str) -> EngineConfig:
        c = self.config
        return replace(
            c.engine,
            worker_id=worker_id,
            num_kv_slots=c.kv_capacity_tokens,
            page_size=c.page_size,
            block_size=c.block_size,
            seed=c.seed,
        )

    def _push(self, at: float, kind: _Kind, payload: object) -> None:
        self._counter += 1
        heapq.heappush(self._heap, (at, kind, self._counter, payload))

    # ---- the loop ------------------------------------------------------------------------

    def run(self, progress: Progress | None = None) -> None:
        """Play every record; returns when all requests are done (or failed)."""
        for i, r in enumerate(self.records):
            self._push(r.arrival_s, _Kind.ARRIVE, i)
        for w in self.workers.values():
            # The router subscribes with nothing known: the worker answers with a snapshot.
            self._send(w, w.engine.snapshot(w.worker_id, w.publisher.epoch, 0))
            if self.config.load_interval_s > 0:
                self._push(self.config.load_interval_s, _Kind.LOAD_TICK, w)
        if self.config.flush_interval_s > 0:
            self._push(self.config.flush_interval_s, _Kind.FLUSH, None)
        total = len(self.records)
        heap = self._heap
        while heap and self.num_finished < total:
            self._dispatch()
            if progress is not None:
                progress.update(self.num_finished, self.now)
        if progress is not None:
            progress.update(self.num_finished, self.now, force=True)

    def settle(self, duration_s: float) -> None:
        """Go on for ``duration_s`` of simulated time after :meth:`run` (load ticks, late
        deliveries, resubscriptions): tests use it to check what the routers end up with."""
        end = self.now + duration_s
        while self._heap and self._heap[0][0] <= end:
            self._dispatch()

    def _dispatch(self) -> None:
        """Pop the next event, advance the clock to it and handle it."""
        at, kind, _, payload = heapq.heappop(self._heap)
        self.now = at
        match kind:
            case _Kind.DELIVER:
                self._deliver(*payload)  # type: ignore[misc]
            case _Kind.LOAD_TICK:
                self._load_tick(payload)  # type: ignore[arg-type]
            case _Kind.STEP_DONE:
                self._step_done(*payload)  # type: ignore[misc]
            case _Kind.ARRIVE:
                self._arrive(payload)  # type: ignore[arg-type]
            case _Kind.ADMIT:
                self._admit(*payload)  # type: ignore[misc]
            case _Kind.ROUTER_FREE:
                self._router_free(payload)  # type: ignore[arg-type]
            case _Kind.FLUSH:
                self._flush()
            case _Kind.REPLICA:
                self._replica(payload)  # type: ignore[arg-type]

    def _arrive(self, index: int) -> None:
        k = index % len(self.routers)  # a load balancer taking the routers in turn
        if not self._charge_routing:
            self._route(index, k)  # no decision time: route and admit at once
            return
        self._route_queue[k].append(index)
        if not self._router_busy[k]:  # the router is idle: decide now
            self._next_job(k)

    def _router_free(self, k: int) -> None:
        """Router k finished a job: the next one queued at it starts now."""
        self._router_busy[k] = False
        self._next_job(k)

    def _next_job(self, k: int) -> None:
        """Router k starts its next job: a peer's event that has arrived, else the next
        request to route; it is busy until the job's ROUTER_FREE."""
        if self._apply_queue[k]:  # a peer's event: applied now, busy for its cost
            self._router_busy[k] = True
            sender, event = self._apply_queue[k].popleft()
            self._apply_replica(k, sender, event)
            cost = self.config.replica_apply_s
            took = cost if isinstance(event, ReplicaRouted) else cost / 4
            self.replica_apply_s_total += took
            self._push(self.now + took, _Kind.ROUTER_FREE, k)
        elif self._route_queue[k]:  # _route pushes the ROUTER_FREE
            self._router_busy[k] = True
            self._route(self._route_queue[k].popleft(), k)

    def _route(self, index: int, k: int) -> None:
        """Router k decides for request ``index`` now; the request reaches its worker after
        the decision time and the network delay (at once when both are 0)."""
        record = self.records[index]
        result = self.results[index]
        result.router = k
        request_id = f"r{index}"
        tokens = self.expander.expand_record(record)
        router = self.routers[k]
        config = self.config
        started = time.perf_counter() if config.measure_route_time else 0.0
        try:
            decision = router.route(RouteRequest(request_id, tokens))
        except NoWorkerAvailable as exc:
            decision = None
            self._fail(result, f"route: {exc}")
        took = (
            time.perf_counter() - started if config.measure_route_time else config.route_decision_s
        )
        self.route_decision_s_total += took
        if self._charge_routing:
            self._push(self.now + took, _Kind.ROUTER_FREE, k)
        if decision is None:
            return
        self._owner[request_id] = router
        self.num_predicted_tokens += decision.matched_tokens
        worker = self.workers[decision.worker_id]
        result.worker_id = worker.worker_id
        delay = took + config.network_delay_s if self._charge_routing else config.network_delay_s
        request = EngineRequest(
            request_id=request_id,
            prompt_token_ids=tokens,
            sampling=SamplingParams(max_new_tokens=record.output_length, ignore_eos=True),
            arrival_time=self.now + delay,  # when the worker receives it
        )
        if delay > 0:
            self._push(self.now + delay, _Kind.ADMIT, (worker, request))
        else:
            self._admit(worker, request)

    def _admit(self, worker: _Worker, request: EngineRequest) -> None:
        """The request reaches its worker."""
        request_id = request.request_id
        result = self.results[int(request_id[1:])]
        try:
            worker.engine.add_request(request)
        except WorkerError as exc:
            self._owner.pop(request_id).on_finished(request_id)
            self._fail(result, f"{type(exc).__name__}: {exc}")
            return
        self._by_request_id[request_id] = result
        if not worker.busy:
            self._start_step(worker)

    def _fail(self, result: RequestResult, error: str) -> None:
        result.error = error
        self.num_finished += 1

    def _start_step(self, worker: _Worker) -> None:
        if worker.step_reports is None:
            outputs = worker.engine.step()
        else:
            outputs = worker.engine.step(partial(self._step_start_report, worker))
        cost = worker.engine.last_step_cost_s
        if outputs or cost > 0:
            worker.num_idle_steps = 0
        else:
            worker.num_idle_steps += 1
            if worker.num_idle_steps > 10_000:
                raise SimulationStuckError(
                    f"{worker.worker_id} has work but made no progress in 10,000 steps "
                    f"at t={self.now:.3f}s"
                )
        worker.busy = True
        worker.busy_s += cost
        self._push(self.now + cost, _Kind.STEP_DONE, (worker, outputs))

    def _step_done(self, worker: _Worker, outputs: list[RequestOutput]) -> None:
        worker.busy = False
        for out in outputs:
            self._on_output(worker, out)
        if worker.report_after_step:
            worker.report_after_step = False
            self._report_load(worker)
        else:
            load = None if worker.step_reports is None else worker.step_reports.after_step()
            self._publish(worker, load)
        if worker.engine.has_work():
            self._start_step(worker)

    def _on_output(self, worker: _Worker, out: RequestOutput) -> None:
        result = self._by_request_id.get(out.request_id)
        if result is None:
            return
        if out.new_token_ids and result.first_token_s is None:
            result.first_token_s = self.now
            self._owner[out.request_id].on_first_token(out.request_id)
        if out.finish_reason is not None:
            result.finish_s = self.now
            if out.usage is not None:
                result.cached_tokens = out.usage.cached_prompt_tokens
                result.completion_tokens = out.usage.completion_tokens
            if result.first_token_s is None:  # finished without a token (abort)
                result.error = f"finished without output: {out.finish_reason.value}"
            generated = out.usage.completion_tokens if out.usage is not None else 0
            self._owner.pop(out.request_id).on_finished(out.request_id, generated)
            del self._by_request_id[out.request_id]
            self.num_finished += 1

    def _send(
        self, worker: _Worker, msg: EventBatch | Snapshot, to: RouterCore | None = None
    ) -> None:
        """Send ``msg`` on the worker's stream to router ``to`` (None: every router)."""
        self._push(self.now + self.config.event_delay_s, _Kind.DELIVER, (worker, msg, to))

    def _deliver(self, worker: _Worker, msg: EventBatch | Snapshot, to: RouterCore | None) -> None:
        lossy = False
        if isinstance(msg, Snapshot):
            self.num_snapshots += 1
        else:
            self.num_batches += 1
            lossy = self.config.event_loss > 0
        for router in self.routers if to is None else (to,):
            if lossy and self._loss_rng.random() < self.config.event_loss:
                self.num_lost_batches += 1  # this router never sees it: a gap to recover
                continue
            for action in router.on_stream_message(worker.worker_id, msg):
                match action:
                    case Resubscribe(epoch=epoch, after_seq=after_seq):
                        self.num_resubscribes += 1
                        self._resubscribe(worker, router, epoch, after_seq)

    def _resubscribe(self, worker: _Worker, router: RouterCore, epoch: int, after_seq: int) -> None:
        pending = worker.publisher.publish(worker.engine.take_events())
        if pending is not None:
            self._send(worker, pending)
        replay = worker.publisher.resume(epoch, after_seq)
        if replay is None:
            pub = worker.publisher
            snapshot = worker.engine.snapshot(worker.worker_id, pub.epoch, pub.last_seq)
            self._send(worker, snapshot, router)
        else:
            for batch in replay:
                self._send(worker, batch, router)

    def _flush(self) -> None:
        """The next worker in turn drops its cache; its events (AllCleared, then the blocks
        running requests still lock) go out at once, as the worker service publishes them."""
        workers = list(self.workers.values())
        worker = workers[self.num_flushes % len(workers)]
        self.num_flushes += 1
        worker.engine.cache.reset()
        batch = worker.publisher.publish(worker.engine.take_events(), None)
        if batch is not None:
            self._send(worker, batch)
        if self.num_finished < len(self.records):
            self._push(self.now + self.config.flush_interval_s, _Kind.FLUSH, None)

    def _tell_replicas(self, sender: int, event: ReplicaEvent) -> None:
        """Router ``sender``'s pick, first token or finish, on its way to the others."""
        at = self.now + (self.config.replica_sync_delay_s or 0.0)
        for k in range(len(self.routers)):
            if k != sender:
                self._push(at, _Kind.REPLICA, (k, sender, event))

    def _replica(self, payload: tuple[int, int, ReplicaEvent]) -> None:
        """A peer's event reaches router ``to``: applied now, or with an apply cost once the
        router is done with its job in hand (before any request still queued at it)."""
        to, sender, event = payload
        if not self._charge_apply:
            self._apply_replica(to, sender, event)
            return
        self._apply_queue[to].append((sender, event))
        if not self._router_busy[to]:
            self._next_job(to)

    def _apply_replica(self, to: int, sender: int, event: ReplicaEvent) -> None:
        self.num_replica_events += 1
        self.routers[to].apply_replica(f"router-{sender}", event)

    def _report_load(self, worker: _Worker) -> None:
        """A batch with the worker's pending events and its load report -- at the end of the
        step in flight, if there is one (the engine thread runs one job at a time)."""
        if worker.busy:
            worker.report_after_step = True
            return
        self._publish(worker, worker.engine.load_report())

    def _step_start_report(self, worker: _Worker) -> None:
        """Inside Engine.step, the batch scheduled: the step report, if one is due."""
        load = worker.step_reports.at_step_start()  # type: ignore[union-attr]
        if load is not None:
            self._publish(worker, load)

    def _publish(self, worker: _Worker, load: LoadReport | None) -> None:
        """The worker's pending events (and ``load``) as its next batch, if not empty."""
        if load is not None and worker.step_reports is not None:
            worker.step_reports.published(load)
        batch = worker.publisher.publish(worker.engine.take_events(), load)
        if batch is not None:
            self._send(worker, batch)

    def _load_tick(self, worker: _Worker) -> None:
        self._report_load(worker)
        self._push(self.now + self.config.load_interval_s, _Kind.LOAD_TICK, worker)

    # ---- results -------------------------------------------------------------------------

    def report(self, label: str, wall_s: float = 0.0) -> PolicyReport:
        prompt = sum(r.prompt_tokens for r in self.results if r.worker_id is not None)
        extra: dict[str, float | int] = {
            "sim_duration_s": round(self.now, 6),
            "event_batches": self.num_batches,
            "snapshots": self.num_snapshots,
            "resubscribes": self.num_resubscribes,
            "cache_flushes": self.num_flushes,
            "routers": len(self.routers),
            "load_interval_s": self.config.load_interval_s,
            "route_decision_s_total": round(self.route_decision_s_total, 6),
            "replica_apply_s_total": round(self.replica_apply_s_total, 6),
            "event_batches_lost": self.num_lost_batches,
            "replica_events": self.num_replica_events,
            # steps that ran something, and those the weight-read floor made longer
            "steps": sum(_executor(w).num_steps for w in self.workers.values()),
            "steps_at_weight_floor": sum(
                _executor(w).num_floor_steps for w in self.workers.values()
            ),
            # what the router believed would hit, vs what did (staleness, eviction)
            "router_predicted_hit_rate": round(self.num_predicted_tokens / prompt, 6)
            if prompt
            else 0.0,
        }
        # modelled busy time per worker (prefill and decode steps): the busy imbalance
        busy = {w.worker_id: w.busy_s for w in self.workers.values()}
        return summarize(
            label,
            self.results,
            list(self.workers),
            extra=extra,
            wall_s=wall_s,
            busy_s_per_worker=busy,
        )


def simulate(
    records: Sequence[TraceRecord],
    policy: str,
    config: SimConfig,
    expander: TokenExpander | None = None,
    *,
    progress_stream: TextIO | None = None,
) -> PolicyReport:
    """Replay ``records`` on ``config.num_workers`` simulated workers under ``policy``."""
    expander = expander or TokenExpander(vocab_size=config.vocab_size, seed=config.seed)
    config = config.for_policy(policy)
    start = time.monotonic()
    sim = FleetSim(records, policy, config, expander)
    progress = Progress(policy, len(records), progress_stream) if progress_stream else None
    sim.run(progress)
    if progress is not None:
        progress.close()
    return sim.report(policy, wall_s=time.monotonic() - start)
