"""RouterCore: the sans-I/O router facade the gRPC service and the replay simulator wrap.

Imports neither asyncio, grpc, torch nor a clock: time comes from an injected
``clock: Callable[[], float]`` and randomness from an injected ``random.Random``, so the same
object runs under a virtual clock in the simulator and reproducibly in tests.

What it owns::

    on_stream_message(worker, EventBatch|Snapshot) --> StreamSequencer (per worker, sync.py)
          |  in-order batches / snapshots                   | actions (Resubscribe)
          v                                                 v
    PrefixIndex (index.py) <-- predicted entries --- route() ---> returned to the shell
          |  matched blocks per worker
          v
    Policy (policy.py): cost per worker, pick (seeded tie-break)

The shell (service or simulator) does the I/O: it subscribes to each worker's KV event
stream with :meth:`RouterCore.expected_subscription`, feeds every message to
:meth:`RouterCore.on_stream_message` and executes the returned actions (a
:class:`Resubscribe` means: drop the current stream and subscribe again with those
numbers). For each client request it calls :meth:`RouterCore.route`, forwards the request to
the chosen worker, then reports :meth:`RouterCore.on_first_token` and
:meth:`RouterCore.on_finished` (also on error/abort) so in-flight accounting stays exact.

Threading: not thread-safe; call it from one thread (or one event loop) only.
"""

from __future__ import annotations

import copy
import heapq
import math
import random
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np

from kvroute_proto.codec import WireBatch, enable_compiled_decode
from kvroute_proto.events import EventBatch, Partition, Snapshot
from kvroute_proto.hashing import as_token_array, block_hashes, enable_compiled
from router.core.core_types import (  # the API's value types live there; re-exported here
    INITIAL_REPLICA_SYNC_WINDOW_S,
    REPLICA_SYNC_WINDOW_DECAY,
    REPLICA_WINDOW_PICKS_PERIOD_S,
    Action,
    Explanation,
    ReplicaEvent,
    ReplicaFinished,
    ReplicaFirstToken,
    ReplicaRouted,
    Resubscribe,
    RouteDecision,
    RouterConfig,
    RouteRequest,
    RouterStats,
    WorkerScore,
    WorkerStats,
)
from router.core.errors import (  # re-exported for the shells
    BlockSizeMismatchError,
    DuplicateWorkerError,
    InvalidRouteRequestError,
    NoWorkerAvailable,
    UnknownWorkerError,
)
from router.core.index_api import IndexConfig, PrefixIndexAPI
from router.core.index_factory import make_index
from router.core.policy import (
    CandidateSet,
    CostWeights,
    PolicyConfig,
    RouteQuery,
    WorkerTable,
    WorkerView,
    affinity_terms,
    make_policy,
)
from router.core.sync import StreamSequencer, SyncConfig

__all__ = [
    "Action",
    "BlockSizeMismatchError",
    "CostWeights",
    "DuplicateWorkerError",
    "Explanation",
    "InvalidRouteRequestError",
    "NoWorkerAvailable",
    "Resubscribe",
    "RouteDecision",
    "RouteRequest",
    "RouterConfig",
    "RouterCore",
    "RouterStats",
    "UnknownWorkerError",
    "WorkerScore",
    "WorkerStats",
    "WorkerView",
]

# Explain's reasons for a worker that is not a candidate (WorkerScore.not_candidate_reason)
UNHEALTHY = "unhealthy"
EXCLUDED = "excluded by the request"


@dataclass(slots=True)
class _Inflight:
    view: WorkerView
    prefill_tokens: int
    prefilling: bool = True
    held: Sequence[int] = ()  # predicted blocks held until the first token (index.predict)
    # with replica sync, what an own pick adds for the replicas' unseen picks of the same
    # moment until its sync window ends (RouterCore._account, _settle_picks): requests
    # counted active beyond this one, and recent work in the views' scaled units (with
    # the scale's origin then, so a rebase in between leaves it alone)
    extra_active: int = 0
    extra_recent: float = 0.0
    extra_recent_t0: float = 0.0


def _open_flight(view: WorkerView, prefill_tokens: int) -> _Inflight:
    """A request in flight on ``view``'s worker: its prefill queued there, one more active."""
    view.inflight_prefill_tokens += prefill_tokens
    view.num_active += 1
    view.refresh()
    return _Inflight(view, prefill_tokens)


@dataclass(slots=True)
class _Worker:
    view: WorkerView
    stream: StreamSequencer
    last_message_at: float | None = None  # router clock at its stream's last message


class RouterCore:
    """The router's brain: index + per-worker stream sequencing + policy + in-flight load.

    ``clock`` returns seconds (monotonic); ``rng`` breaks ties and drives random policies.
    """

    def __init__(
        self,
        config: RouterConfig | None = None,
        *,
        clock: Callable[[], float],
        rng: random.Random,
    ) -> None:
        self.config = config = config or RouterConfig()
        self._clock = clock
        self._rng = rng
        self._policy = make_policy(
            config.policy,
            PolicyConfig(
                config.weights,
                config.prefix_hash_blocks,
                config.backlog_tokens,
                config.spread_weight,
                config.affinity_tokens,
                config.saturated_tokens,
                config.saturated_scale_tokens,
            ),
        )
        if config.affinity_tokens:  # compile (or load) its kernel now, not on a route
            affinity_terms([1], np.zeros(2, dtype=np.intp), np.arange(2, dtype=np.uint64), 1.0)
        self._use_events = self._policy.uses_events
        self._ttl = config.predicted_ttl_s if self._use_events else config.approx_ttl_s
        self._index = make_index(
            IndexConfig(
                max_blocks=config.max_indexed_blocks,
                verify_hashes=config.verify_hashes,
                predict_stride=config.predict_stride,
                backend=config.index_backend,
            )
        )
        # batches decoded lazily (kvroute_proto.codec.WireBatch) applied from their scanned
        # layout, without event objects: the numba index, when it need not verify hashes
        self._wire_apply = self._index.prefers_wire and not config.verify_hashes
        # a query's hashes as the index takes them fastest: a uint64 array, or a list of ints
        self._hash_arrays = self._index.takes_arrays
        if self._hash_arrays:  # numba is at hand: hash prompts with its compiled chain too,
            enable_compiled()  # and decode event batches with its compiled scan
            enable_compiled_decode()
        self._sync_config = SyncConfig(max_pending_batches=config.max_pending_batches)
        self._block_size = config.block_size
        self._workers: dict[str, _Worker] = {}
        self._free_slots: list[int] = []  # heap of slots freed by remove_worker
        self._next_slot = 0
        self._healthy: list[WorkerView] = []
        # the views' cost fields by slot, for policies that score all candidates at once
        self._table = WorkerTable(weights=config.weights)
        self._healthy_set = CandidateSet.of(self._healthy, self._table)
        self._inflight: dict[str, _Inflight] = {}
        # replica sync: other routers' requests, by (router id, request id), and who hears
        # of this router's own picks (set_replica_listener)
        self._replica_inflight: dict[tuple[str, str], _Inflight] = {}
        self._replica_listener: Callable[[ReplicaEvent], None] | None = None
        # with replica sync, own picks count R times only for replica_sync_window_s (or,
        # None, the sync's measured delivery time): (when the window ends, request id, its
        # flight, the extra tokens to take off then), in the order placed; settled by the
        # next route (_settle_picks)
        self._sync_window_auto = config.replica_sync_window_s is None
        self._sync_window_measured = False
        self._sync_window_s = (
            math.inf
            if not (config.replica_sync and config.replicas > 1)
            else INITIAL_REPLICA_SYNC_WINDOW_S
            if config.replica_sync_window_s is None
            else config.replica_sync_window_s
        )
        self._unsettled: deque[tuple[float, str, _Inflight, int]] = deque()
        # with sync and the peer view, a cold pick counts R times (not capped) while the
        # most own picks inside their window at once, lately, stays under this (0: always
        # capped, or no cap to lift: R <= replica_cold_picks; nothing is tracked then;
        # RouterConfig.replica_cold_window_picks): that most in the current period of
        # REPLICA_WINDOW_PICKS_PERIOD_S and in the one before it, and when this one began
        self._cold_window_picks = (
            config.replica_cold_window_picks
            if config.replica_peer_view
            and self._sync_window_s != math.inf
            and config.replicas > config.replica_cold_picks
            else 0
        )
        self._window_picks_now = 0
        self._window_picks_before = 0
        self._window_picks_since = clock()
        self._num_routed = 0
        # recent prefill per worker decays as exp(-t / window); views hold it scaled by
        # exp((t - t0) / window) so that a route touches one view, not all (see _recent_scale)
        self._recent_window_s = config.recent_window_s
        self._recent_decode_ratio = config.recent_decode_ratio
        self._recent_t0 = clock()
        self._sync_counters: Counter[str] = Counter()

    # ---- fleet membership ----------------------------------------------------------------

    @property
    def block_size(self) -> int | None:
        """The fleet block size (None until the first worker announced one)."""
        return self._block_size

    @property
    def policy_name(self) -> str:
        return self._policy.name

    @property
    def index(self) -> PrefixIndexAPI:
        """The prefix index (read-only use: metrics, tests)."""
        return self._index

    def _check_block_size(self, worker_id: str, block_size: int | None) -> None:
        if block_size is None:
            return
        if block_size <= 0:
            raise InvalidRouteRequestError("block_size", f"must be >= 1, got {block_size}")
        if self._block_size is None:
            self._block_size = block_size
        elif block_size != self._block_size:
            raise BlockSizeMismatchError(worker_id, block_size, self._block_size)

    def add_worker(self, worker_id: str, address: str = "", block_size: int | None = None) -> None:
        """Register a worker (healthy, nothing indexed, not yet subscribed).

        Raises DuplicateWorkerError if known, BlockSizeMismatchError if ``block_size``
        differs from the fleet's.
        """
        if not worker_id:
            raise InvalidRouteRequestError("worker_id", "must not be empty")
        if worker_id in self._workers:
            raise DuplicateWorkerError(worker_id)
        self._check_block_size(worker_id, block_size)
        if self._free_slots:
            slot = heapq.heappop(self._free_slots)
        else:
            slot = self._next_slot
            self._next_slot += 1
        view = WorkerView(worker_id, slot, address)
        self._table.attach(view)
        self._workers[worker_id] = _Worker(view, StreamSequencer(worker_id, self._sync_config))
        self._refresh_healthy()

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker: its index entries, stream state and in-flight accounting."""
        worker = self._get(worker_id)
        del self._workers[worker_id]
        self._table.detach(worker.view)
        self._index.remove_worker(worker.view.slot)
        heapq.heappush(self._free_slots, worker.view.slot)
        now = self._clock()
        for request_id in [r for r, f in self._inflight.items() if f.view is worker.view]:
            self._release(self._inflight.pop(request_id), now)
        for key in [k for k, f in self._replica_inflight.items() if f.view is worker.view]:
            self._release(self._replica_inflight.pop(key), now)
        self._refresh_healthy()

    def set_max_running(self, worker_id: str, max_running: int) -> None:
        """The worker's stated cap on running requests (GetLoad's ``max_running_requests``;
        0: none stated): past it the cost charges each request a new one would wait behind
        for a running slot (``CostWeights.slot_wait``)."""
        if max_running < 0:
            raise InvalidRouteRequestError(
                "max_running_requests", f"must be >= 0, got {max_running}"
            )
        self._get(worker_id).view.max_running = max_running

    def set_health(self, worker_id: str, healthy: bool) -> None:
        """Unhealthy workers keep their index entries but are never routed to."""
        self._get(worker_id).view.healthy = healthy
        self._refresh_healthy()

    def workers(self) -> list[str]:
        """Registered worker ids, in registration order."""
        return list(self._workers)

    def has_worker(self, worker_id: str) -> bool:
        return worker_id in self._workers

    def worker_view(self, worker_id: str) -> WorkerView:
        """The live per-worker state policies see (health, in-flight counts, last load)."""
        return self._get(worker_id).view

    def _get(self, worker_id: str) -> _Worker:
        worker = self._workers.get(worker_id)
        if worker is None:
            raise UnknownWorkerError(worker_id)
        return worker

    def _refresh_healthy(self) -> None:
        self._healthy = [w.view for w in self._workers.values() if w.view.healthy]
        self._healthy_set = CandidateSet.of(self._healthy, self._table)

    # ---- KV event streams ----------------------------------------------------------------

    def expected_subscription(self, worker_id: str) -> tuple[int, int]:
        """(epoch, after_seq) to (re)subscribe with; (0, 0) when nothing was synced yet.

        Call it whenever a stream (re)starts, whatever the reason.
        """
        return self._get(worker_id).stream.expected_subscription()

    def stream_position(self, worker_id: str) -> tuple[int, int]:
        """(epoch, seq) of the last applied batch or snapshot; read-only, unlike
        :meth:`expected_subscription`, which also records the subscription as asked."""
        stream = self._get(worker_id).stream
        return stream.epoch, stream.last_seq

    def on_stream_message(self, worker_id: str, msg: EventBatch | Snapshot) -> list[Action]:
        """Feed one message of a worker's event stream; returns actions for the shell.

        Duplicates are dropped, gaps buffered until filled (a Resubscribe is returned), a new
        epoch purges the worker, a Snapshot replaces its state. A batch decoded lazily
        (``codec.decode_stream_lazy``, what the service decodes) is applied by the numba
        index from its scanned layout, without event objects, with the same outcome. Bad
        events are counted (``stats().apply_errors``), never raised. Raises
        BlockSizeMismatchError when the message's block_size is not the fleet's and
        UnknownWorkerError for an unknown worker.
        """
        worker = self._get(worker_id)
        self._check_block_size(worker_id, msg.block_size)
        step = worker.stream.receive(msg)
        worker.last_message_at = self._clock()
        view = worker.view
        index = self._index
        slot = view.slot
        if step.new_epoch:  # a restart: nothing we knew or predicted about it holds
            index.remove_worker(slot)
        for item in step.apply:
            if isinstance(item, EventBatch):
                if self._use_events:
                    if type(item) is WireBatch and self._wire_apply:
                        index.apply_wire(slot, item.layout)
                    else:
                        for event in item.events:
                            index.apply(slot, event)
                if item.load is not None:
                    view.load = item.load
                    view.refresh()
            elif self._use_events:  # Snapshot: replaces the confirmed entries; a resync
                # keeps the predictions for requests in flight
                index.remove_worker(slot, predictions=False)
                for stored in item.blocks:
                    index.store(slot, stored)
        if step.resubscribe is None:
            return []
        epoch, after_seq = step.resubscribe
        return [Resubscribe(worker_id, epoch, after_seq, step.reason)]

    # ---- routing -------------------------------------------------------------------------

    def _recent_scale(self, now: float) -> float:
        """exp((now - t0) / window): a view's ``recent_prefill`` divided by it is the decayed
        sum of prefill tokens routed there. Rebased (t0 = now) before it passes e**230, so
        neither it nor the stored sums overflow, however long the router runs or idles."""
        x = (now - self._recent_t0) / self._recent_window_s
        if x <= 230.0:
            return math.exp(x)
        decay = math.exp(-x)  # underflows to 0.0 after a long idle: everything has decayed
        for worker in self._workers.values():
            worker.view.recent_prefill *= decay
        self._recent_t0 = now
        return 1.0

    def _query(self, req: RouteRequest, recent_scale: float = 1.0) -> RouteQuery:
        tokens = req.token_ids
        if not (isinstance(tokens, np.ndarray) and tokens.dtype == np.uint32 and tokens.ndim == 1):
            try:  # uint32 arrays (what the service decodes) are valid as they are
                tokens = as_token_array(tokens)
            except (TypeError, ValueError) as exc:
                raise InvalidRouteRequestError("token_ids", str(exc)) from None
        block_size = self._block_size
        hashes: Sequence[int]
        if block_size is None:
            hashes = []
            block_size = 1
        else:
            seed = req.partition.seed
            array = block_hashes(tokens, block_size, seed, validate=False)
            hashes = array if self._hash_arrays else array.tolist()
        prompt_tokens = len(tokens)
        if req.prompt_tokens is not None:
            if req.prompt_tokens < prompt_tokens:
                raise InvalidRouteRequestError(
                    "prompt_tokens",
                    f"must be >= len(token_ids) = {prompt_tokens}, got {req.prompt_tokens}",
                )
            prompt_tokens = req.prompt_tokens
        return RouteQuery(req.request_id, prompt_tokens, block_size, hashes, recent_scale)

    def _candidates(self, req: RouteRequest) -> list[WorkerView]:
        if req.exclude:
            return [v for v in self._healthy if v.worker_id not in req.exclude]
        return self._healthy

    def _candidate_set(self, req: RouteRequest) -> CandidateSet:
        if req.exclude:
            return CandidateSet.of(self._candidates(req), self._table)
        return self._healthy_set

    def route(self, req: RouteRequest) -> RouteDecision:
        """Pick a worker for ``req`` and account it as in flight there (on_routed).

        The request's full blocks are entered as predicted for the chosen worker, so the
        next request with the same prefix sees them before any event arrives; they are
        held until on_first_token / on_finished, then live for the TTL. Raises
        NoWorkerAvailable when no healthy worker outside ``req.exclude`` exists, and
        InvalidRouteRequestError for bad token ids. A request_id still in flight is first
        finished (a retry moves its accounting).
        """
        candidate_set = self._candidate_set(req)
        candidates = candidate_set.views
        if not candidates:
            raise self._no_worker(req)
        now = self._clock()
        if self._unsettled:
            self._settle_picks(now)
        scale = self._recent_scale(now)
        query = self._query(req, 1.0 / scale)
        index = self._index
        index.expire(now)
        hashes = query.block_hashes
        matched = index.find_matches(hashes) if len(hashes) else {}
        i, cost = self._policy.select_set(query, candidate_set, matched, self._rng)
        view = candidates[i]
        depth = matched.get(view.slot, 0)
        matched_tokens = min(depth * query.block_size, query.prompt_tokens)
        confirmed = index.last_confirmed.get(view.slot, 0) if len(hashes) else 0
        event_tokens = min(confirmed * query.block_size, matched_tokens)
        # the best match among the candidates (metrics: cache forgone for load); the
        # matches are at hand, so this walks no index, and candidates only when some
        # matched worker may not have been one
        best = max(matched.values()) if matched else 0
        if best > depth and len(candidates) != len(self._workers):
            best = max(matched.get(v.slot, 0) for v in candidates)
        best_tokens = max(min(best * query.block_size, query.prompt_tokens), matched_tokens)
        if req.request_id in self._inflight:
            self.on_finished(req.request_id)
        flight = self._account(
            req.request_id, view, query.prompt_tokens - matched_tokens, not matched_tokens, now
        )
        uncached = query.prompt_tokens - matched_tokens
        view.recent_prefill += uncached * scale
        if flight.extra_active:  # the replicas' same-moment picks, until the window ends
            flight.extra_recent = uncached * flight.extra_active * scale
            flight.extra_recent_t0 = self._recent_t0
            view.recent_prefill += flight.extra_recent
        if len(hashes) and self._policy.uses_matches:
            deadline = now + self._ttl
            if not self._use_events and depth:  # approx mode: what was used stays longer
                index.refresh_predicted(hashes[:depth], deadline)
            # held until the first token: however long it queues there, the worker will
            # write these blocks, and its events confirm them soon after
            flight.held = index.predict(view.slot, hashes, deadline, start=depth, hold=True)
        if self._replica_listener is not None:
            self._replica_listener(
                ReplicaRouted(
                    req.request_id,
                    view.worker_id,
                    query.prompt_tokens,
                    matched_tokens,
                    hashes if self._policy.uses_matches else (),
                )
            )
        return RouteDecision(
            req.request_id,
            view.worker_id,
            view.address,
            query.prompt_tokens,
            matched_tokens,
            float(cost),
            self._policy.name,
            best_tokens,
            event_tokens,
        )

    def _no_worker(self, req: RouteRequest) -> NoWorkerAvailable:
        num_excluded = sum(1 for v in self._healthy if v.worker_id in req.exclude)
        return NoWorkerAvailable(
            req.request_id, len(self._workers), len(self._healthy), num_excluded
        )

    def explain(self, req: RouteRequest) -> Explanation:
        """Per-worker match, load, cost and the pick route() would make; changes nothing
        (beyond dropping predictions past their deadline, which route() would drop too).

        Ties are broken with a generator seeded by the request id (not the router's), and
        stateful policies (round_robin) are consulted on a copy.
        """
        now = self._clock()
        if self._unsettled:  # as route() would see the fleet
            self._settle_picks(now)
        unscale = 1.0 / self._recent_scale(now)
        query = self._query(req, unscale)
        hashes = query.block_hashes
        self._index.expire(now)  # as route() does: a lapsed prediction matches nothing
        matched = self._index.find_matches(hashes, touch=False) if len(hashes) else {}
        confirmed, predicted = (
            self._index.find_matches_by_source(hashes) if len(hashes) else ({}, {})
        )
        candidates = self._candidates(req)
        costs: list[float] | None = None
        chosen: str | None = None
        miss_factor = 0.0
        if candidates:
            policy = copy.copy(self._policy)
            rng = random.Random(req.request_id)
            i, _ = policy.select(query, candidates, matched, rng)
            chosen = candidates[i].worker_id
            costs = policy.costs(query, candidates, matched)
            miss_factor = policy.miss_factor(candidates)
        cost_of = dict(zip((v.worker_id for v in candidates), costs or (), strict=False))
        block_size, prompt_tokens = query.block_size, query.prompt_tokens
        lines = []
        for worker in self._workers.values():
            v = worker.view
            reason = ""
            if not v.healthy:
                reason = UNHEALTHY
            elif req.exclude and v.worker_id in req.exclude:
                reason = EXCLUDED
            lines.append(
                WorkerScore(
                    v.worker_id,
                    v.address,
                    v.healthy,
                    min(matched.get(v.slot, 0) * query.block_size, query.prompt_tokens),
                    v.queued_prefill_tokens,
                    v.num_active,
                    cost_of.get(v.worker_id),
                    v.load,
                    v.recent_prefill * unscale,
                    min(confirmed.get(v.slot, 0) * block_size, prompt_tokens),
                    min(predicted.get(v.slot, 0) * block_size, prompt_tokens),
                    reason,
                    v.slot_queue,
                )
            )
        return Explanation(
            self._policy.name, query.prompt_tokens, chosen, tuple(lines), miss_factor
        )

    def may_match_past(self, token_ids: np.ndarray | Sequence[int], partition: Partition) -> bool:
        """Whether some worker's cached prefix (confirmed or predicted) may go on past
        ``token_ids``, the head of a prompt: False means every match ends inside it, so
        whatever follows cannot change where the request goes (the front end then leaves
        the rest of a text prompt untokenized). May say True wrongly, never False wrongly:
        a prediction is probed only every ``predict_stride`` blocks, so a predicted match
        that reaches the last probe counts as going on. Changes nothing."""
        if self._block_size is None or not self._policy.uses_matches:
            return False
        tokens = np.asarray(token_ids, dtype=np.uint32)
        array = block_hashes(tokens, self._block_size, partition.seed, validate=False)
        hashes = array if self._hash_arrays else array.tolist()
        if not len(hashes):
            return True
        index = self._index
        matched = index.find_matches(hashes, touch=False)
        n = len(hashes)
        confirmed = max(index.last_confirmed.values(), default=0)  # the events' walk
        if confirmed >= n:
            return True
        best = max(matched.values(), default=0)
        if best <= confirmed:  # no prediction goes further than the events' walks end
            return False
        stride = self.config.predict_stride
        return best >= n // stride * stride

    def _account(
        self, request_id: str, view: WorkerView, prefill_tokens: int, cold: bool, now: float
    ) -> _Inflight:
        # with R router replicas a pick counts R times, a cold one at most
        # replica_cold_picks times -- unless the sync keeps pace with this router: lately
        # fewer than replica_cold_window_picks of its own picks in one window (RouterConfig)
        picks: float = self.config.replicas
        if self._cold_window_picks:
            self._note_window_picks(now)
        if (
            cold
            and picks > self.config.replica_cold_picks
            and max(self._window_picks_now, self._window_picks_before) >= self._cold_window_picks
        ):
            picks = self.config.replica_cold_picks
        counted = round(prefill_tokens * picks)
        flight = self._inflight[request_id] = _open_flight(view, counted)
        self._num_routed += 1
        if counted > prefill_tokens and self._sync_window_s != math.inf:
            # with replica sync the others' picks arrive and count themselves: R times only
            # until they can have (RouterConfig.replica_sync_window_s). Until then a pick
            # that found its prefix there stands for the replicas' same-moment picks in
            # every load term: as running requests too (and, in route(), as recent work),
            # not only as queued prefill. A cold one does not: their picks of that worker
            # would mostly find its prefix there (why its queued count is capped), and
            # counting them spread bursts (BENCHMARKS.md, "an own pick that stands for the
            # replicas in every load term")
            due = now + self._sync_window_s
            self._unsettled.append((due, request_id, flight, counted - prefill_tokens))
            extra = int(picks) - 1
            if extra > 0 and not cold:
                flight.extra_active = extra
                view.num_active += extra
                view.refresh()
        return flight

    def _note_window_picks(self, now: float) -> None:
        """Keep the most own picks found inside their sync window at one pick (those still
        counted R times: placed with tokens to prefill, not settled), per period of
        REPLICA_WINDOW_PICKS_PERIOD_S."""
        if now - self._window_picks_since >= REPLICA_WINDOW_PICKS_PERIOD_S:
            # a period with no pick at all leaves nothing to carry over
            late = now - self._window_picks_since >= 2 * REPLICA_WINDOW_PICKS_PERIOD_S
            self._window_picks_before = 0 if late else self._window_picks_now
            self._window_picks_now = 0
            self._window_picks_since = now
        held = len(self._unsettled)
        if held > self._window_picks_now:
            self._window_picks_now = held

    @property
    def replica_sync_window_s(self) -> float:
        """How long an own pick counts R times (inf: until its first token; the window of
        RouterConfig.replica_sync_window_s, measured when that is None)."""
        return self._sync_window_s

    def observe_replica_sync_delay(self, delay_s: float) -> None:
        """The sync delivered a message ``delay_s`` after it was queued (replica sync times
        its own messages' echo). With an auto window (RouterConfig.replica_sync_window_s
        None) the first measurement replaces INITIAL_REPLICA_SYNC_WINDOW_S; after it the
        window rises to a longer delay at once and falls toward shorter ones by
        REPLICA_SYNC_WINDOW_DECAY of the difference; otherwise nothing changes. Negative
        or non-finite delays are ignored."""
        if not self._sync_window_auto or self._sync_window_s == math.inf:
            return
        if not 0 <= delay_s < math.inf:
            return
        window = self._sync_window_s
        if delay_s >= window or not self._sync_window_measured:  # the first replaces the guess
            self._sync_window_s = delay_s
            self._sync_window_measured = True
        else:
            self._sync_window_s = window + (delay_s - window) * REPLICA_SYNC_WINDOW_DECAY

    def _settle_picks(self, now: float) -> None:
        """Own picks whose sync window has ended count once from now on."""
        unsettled = self._unsettled
        inflight = self._inflight
        while unsettled and unsettled[0][0] < now:
            _, request_id, flight, extra = unsettled.popleft()
            view = flight.view
            # still the same request, still queued for prefill (a finish or first token
            # already took off all it counted)
            if flight.prefilling and inflight.get(request_id) is flight:
                flight.prefill_tokens -= extra
                view.inflight_prefill_tokens -= extra
            if flight.extra_active:  # (a finish took it off already)
                view.num_active -= flight.extra_active
                flight.extra_active = 0
            if flight.extra_recent:
                if flight.extra_recent_t0 == self._recent_t0:  # no rebase since
                    view.recent_prefill = max(0.0, view.recent_prefill - flight.extra_recent)
                flight.extra_recent = 0.0
            view.refresh()

    def _release(self, flight: _Inflight, now: float) -> None:
        """End the hold on the request's predicted blocks: their TTL starts ``now``."""
        if flight.held:
            self._index.release_predicted(flight.held, now + self._ttl)
            flight.held = ()

    def on_routed(
        self, request_id: str, worker_id: str, prompt_tokens: int, matched_tokens: int
    ) -> None:
        """Account a request as in flight (route() calls it; the shell needs it only when it
        placed a request itself)."""
        view = self._get(worker_id).view
        if request_id in self._inflight:
            self.on_finished(request_id)
        uncached = max(0, prompt_tokens - matched_tokens)
        self._account(request_id, view, uncached, not matched_tokens, self._clock())
        if self._replica_listener is not None:
            self._replica_listener(
                ReplicaRouted(request_id, worker_id, prompt_tokens, matched_tokens)
            )

    def on_first_token(self, request_id: str) -> None:
        """Prefill of ``request_id`` is done: its tokens leave the queued-prefill estimate."""
        flight = self._inflight.get(request_id)
        if flight is not None and flight.prefilling:
            self._first_token(flight)
            if self._replica_listener is not None:
                self._replica_listener(ReplicaFirstToken(request_id))

    def _first_token(self, flight: _Inflight) -> None:
        self._release(flight, self._clock())
        flight.prefilling = False
        flight.view.inflight_prefill_tokens -= flight.prefill_tokens
        flight.view.refresh()

    def on_finished(self, request_id: str, generated_tokens: int = 0) -> None:
        """The request ended (finished, aborted or failed). Unknown ids are ignored.

        ``generated_tokens``: what the worker decoded for it (the Finished usage); each adds
        ``recent_decode_ratio`` tokens to the worker's recent sum, so a worker busy decoding
        long conversations is not taken for an idle one by the balance term."""
        flight = self._inflight.pop(request_id, None)
        if flight is None:
            return
        self._finish(flight, generated_tokens)
        if self._replica_listener is not None:
            self._replica_listener(ReplicaFinished(request_id, generated_tokens))

    def _finish(self, flight: _Inflight, generated_tokens: int) -> None:
        now = self._clock()
        self._release(flight, now)
        if generated_tokens > 0 and self._recent_decode_ratio:
            scale = self._recent_scale(now)
            flight.view.recent_prefill += self._recent_decode_ratio * generated_tokens * scale
        if flight.prefilling:
            flight.view.inflight_prefill_tokens -= flight.prefill_tokens
        flight.view.num_active -= 1 + flight.extra_active
        flight.extra_active = 0
        flight.view.refresh()

    # ---- replica sync ----------------------------------------------------------------------

    def set_replica_listener(self, listener: Callable[[ReplicaEvent], None] | None) -> None:
        """Call ``listener`` with every pick, first token and finish of this router's own
        requests (:class:`ReplicaRouted` from :meth:`route` and :meth:`on_routed`,
        :class:`ReplicaFirstToken`, :class:`ReplicaFinished`), so the other router replicas
        can count them (:meth:`apply_replica`); None stops. The listener must not block:
        it runs inside every route."""
        self._replica_listener = listener

    def apply_replica(self, router_id: str, event: ReplicaEvent) -> bool:
        """Another router replica (``router_id``) placed, started or ended a request.

        Counted as this router's own picks are, once (not ``replicas`` times: it is what
        happened, not an anticipation): a placed request's uncached tokens queue on the
        worker until its :class:`ReplicaFirstToken`, it counts as active until its
        :class:`ReplicaFinished`, adds to the worker's recent work, and its full blocks are
        predicted there (held until the first token, then kept for the TTL) -- so a burst
        that one router started on a worker is seen as cached there by the others before
        any KV event arrives. Returns False, changing nothing, for a worker this router
        does not know, a request it already counts, or an end it never saw begin."""
        key = (router_id, event.request_id)
        if isinstance(event, ReplicaRouted):
            worker = self._workers.get(event.worker_id)
            if worker is None or key in self._replica_inflight:
                return False
            view = worker.view
            now = self._clock()
            array = np.asarray(event.block_hashes, dtype=np.uint64)
            hashes: Sequence[int] = ()
            start = 0  # the first block to enter as predicted there
            seen = 0  # tokens of the prompt this router sees cached or predicted there
            if len(array) and self._policy.uses_matches and self._block_size is not None:
                # the numba index takes the array; the dict index keys on ints
                hashes = cast(Sequence[int], array) if self._hash_arrays else array.tolist()
                self._index.expire(now)
                start = event.matched_tokens // self._block_size
                if self.config.replica_peer_view:
                    depth = self._index.match_depth(view.slot, hashes)
                    # the blocks either view has there are not entered again
                    start = max(depth, start)
                    seen = min(depth * self._block_size, event.prompt_tokens)
            # with replica_peer_view, uncached by the better of the two views: the peer's
            # pick was cold in its own when this router (or a third) had just started the
            # same prefix there -- a burst's same-instant picks -- and the worker computes
            # that prefix once
            uncached = max(0, event.prompt_tokens - max(event.matched_tokens, seen))
            view.recent_prefill += uncached * self._recent_scale(now)
            flight = self._replica_inflight[key] = _open_flight(view, uncached)
            if len(hashes):
                flight.held = self._index.predict(
                    view.slot, hashes, now + self._ttl, start=min(start, len(hashes)), hold=True
                )
            return True
        if isinstance(event, ReplicaFirstToken):
            started = self._replica_inflight.get(key)
            if started is None or not started.prefilling:
                return False
            self._first_token(started)
            return True
        ended = self._replica_inflight.pop(key, None)
        if ended is None:
            return False
        self._finish(ended, event.generated_tokens)
        return True

    @property
    def num_replica_inflight(self) -> int:
        """Requests of other router replicas this router counts in flight."""
        return len(self._replica_inflight)

    def drop_replica(self, router_id: str) -> int:
        """End every request router ``router_id`` placed (it left, restarted or went
        silent: their ends will never be heard); how many there were."""
        keys = [k for k in self._replica_inflight if k[0] == router_id]
        for key in keys:
            self._finish(self._replica_inflight.pop(key), 0)
        return len(keys)

    # ---- introspection -------------------------------------------------------------------

    def stats(self) -> RouterStats:
        counters: Counter[str] = Counter()
        for worker in self._workers.values():
            counters.update(worker.stream.counters)
        index = self._index
        return RouterStats(
            num_workers=len(self._workers),
            num_healthy=len(self._healthy),
            num_indexed_blocks=index.size(),
            num_index_entries=index.num_entries,
            num_predicted_entries=index.num_predicted,
            num_inflight_requests=len(self._inflight),
            num_routed=self._num_routed,
            apply_errors=dict(index.errors),
            sync_counters=dict(counters),
            num_evicted_blocks=index.num_evicted,
            index_bytes=index.approx_bytes(),
            num_replica_inflight=len(self._replica_inflight),
        )

    def worker_stats(self) -> list[WorkerStats]:
        """Each registered worker's routing state, in registration order (metrics)."""
        index = self._index
        now = self._clock()
        result = []
        for worker in self._workers.values():
            v = worker.view
            stream = worker.stream
            result.append(
                WorkerStats(
                    worker_id=v.worker_id,
                    address=v.address,
                    healthy=v.healthy,
                    num_active_requests=v.num_active,
                    inflight_prefill_tokens=v.inflight_prefill_tokens,
                    num_indexed_blocks=index.num_worker_blocks(v.slot),
                    epoch=stream.epoch,
                    last_seq=stream.last_seq,
                    seconds_since_message=(
                        None if worker.last_message_at is None else now - worker.last_message_at
                    ),
                    sync_counters=dict(stream.counters),
                    load=v.load,
                    max_running=v.max_running,
                )
            )
        return result

    def worker_blocks(self, worker_id: str) -> set[int]:
        """The block hashes the index believes ``worker_id`` holds (confirmed by events)."""
        return self._index.snapshot(self._get(worker_id).view.slot)
