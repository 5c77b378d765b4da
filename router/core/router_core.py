"""RouterCore: the sans-I/O router facade the gRPC service and the replay simulator wrap.

Imports neither asyncio, grpc, torch nor a clock: time comes from an injected
``clock: Callable[[], float]`` and randomness from an injected ``random.Random``, so the same
object runs under a virtual clock in the simulator and reproducibly in tests.

What it owns::

    on_stream_message(worker, msg) --> StreamIngest (streams.py; a StreamSequencer per worker,
          |  in-order batches / snapshots                sync.py) | actions (Resubscribe)
          v                                                         v
    the index (index_api) <------ matches ------- route() ---> returned to the shell
          ^                                          |  pick: Policy (registry.py: cost.py,
          |  predicted blocks, held until            v        policy.py, peer_policies.py)
          +---- the first token ---------------- Flights (flights.py): requests in flight,
                                                 the router's and its replicas' (replicas.py)

It delegates: the workers to :class:`~router.core.fleet.Fleet`; stream ingest (sequencing,
Resubscribe, snapshots, the WireBatch fast path) to :class:`~router.core.streams.StreamIngest`;
requests in flight, recent work and replica accounting to :class:`~router.core.flights.Flights`
(with :class:`~router.core.replicas.ReplicaAccounting`); explanations and stats to
:mod:`router.core.introspect`. It keeps the route: hashes, matches, the policy's pick.

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

import random
from collections.abc import Callable, Sequence
from typing import cast

import numpy as np

from kvroute_proto.codec import enable_compiled_decode
from kvroute_proto.events import EventBatch, Partition, Snapshot
from kvroute_proto.hashing import as_token_array, block_hashes, enable_compiled
from router.core.core_types import (  # the API's value types live there; re-exported here
    Action,
    Explanation,
    ReplicaEvent,
    Resubscribe,
    RouteDecision,
    RouterConfig,
    RouteRequest,
    RouterStats,
    WorkerScore,
    WorkerStats,
)
from router.core.cost import affinity_terms
from router.core.errors import (  # re-exported for the shells
    BlockSizeMismatchError,
    DuplicateWorkerError,
    InvalidRouteRequestError,
    NoWorkerAvailable,
    UnknownWorkerError,
)
from router.core.fleet import Fleet
from router.core.flights import Flights
from router.core.index_api import PrefixIndexAPI
from router.core.index_factory import make_index
from router.core.introspect import EXCLUDED, UNHEALTHY, explanation, router_stats, worker_stats
from router.core.policy_config import CostWeights
from router.core.registry import make_policy
from router.core.step_profile import StepProfile
from router.core.streams import StreamIngest
from router.core.sync import SyncConfig
from router.core.views import RouteQuery, WorkerView

__all__ = [
    "EXCLUDED",
    "UNHEALTHY",
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


class RouterCore:
    """The router's brain: index + per-worker stream sequencing + policy + in-flight load.

    ``clock`` returns seconds (monotonic); ``rng`` breaks ties and drives random policies.
    """

    def __init__(
        self, config: RouterConfig | None = None, *, clock: Callable[[], float], rng: random.Random
    ) -> None:
        self.config = config = config or RouterConfig()
        self._clock = clock
        self._rng = rng
        policy_config = config.policy_config
        affinity = config.replica.policy_affinity_tokens  # the replicas decide the term
        if affinity != policy_config.affinity_tokens:
            policy_config = policy_config.with_affinity(affinity)
        self._policy = make_policy(config.policy, policy_config)
        if affinity:  # compile (or load) its kernel now, not on a route
            affinity_terms([1], np.zeros(2, dtype=np.intp), np.arange(2, dtype=np.uint64), 1.0)
        self._index = index = make_index(config.index)
        # a query's hashes as the index takes them fastest: a uint64 array, or a list of ints
        self._hash_arrays = index.takes_arrays
        if self._hash_arrays:  # numba is at hand: hash prompts with its compiled chain too,
            enable_compiled()  # and decode event batches with its compiled scan
            enable_compiled_decode()
        sync = SyncConfig(max_pending_batches=config.max_pending_batches)
        self._fleet = fleet = Fleet(config.policy_config.weights, sync, config.block_size)
        self._workers = fleet.workers
        # batches decoded lazily (kvroute_proto.codec.WireBatch) applied from their scanned
        # layout, without event objects: the numba index, when it need not verify hashes
        wire = index.prefers_wire and not config.index.verify_hashes
        use_events = self._policy.uses_events
        self._streams = StreamIngest(fleet, index, clock, use_events=use_events, wire_apply=wire)
        self._flights = Flights(config, self._policy, fleet, index, clock)

    # ---- fleet membership ----------------------------------------------------------------

    @property
    def block_size(self) -> int | None:
        """The fleet block size (None until the first worker announced one)."""
        return self._fleet.block_size

    @property
    def policy_name(self) -> str:
        return self._policy.name

    @property
    def index(self) -> PrefixIndexAPI:
        """The prefix index (read-only use: metrics, tests)."""
        return self._index

    def add_worker(self, worker_id: str, address: str = "", block_size: int | None = None) -> None:
        """Register a worker (healthy, nothing indexed, not yet subscribed). Raises
        DuplicateWorkerError if known, BlockSizeMismatchError if ``block_size`` differs
        from the fleet's."""
        self._fleet.add(worker_id, address, block_size)

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker: its index entries, stream state and in-flight accounting."""
        view = self._fleet.remove(worker_id)
        self._index.remove_worker(view.slot)
        self._flights.drop_worker(view)
        self._fleet.refresh_healthy()

    def set_max_running(self, worker_id: str, max_running: int) -> None:
        """The worker's stated cap on running requests (GetLoad's ``max_running_requests``;
        0: none stated): past it the cost's slot-wait term applies."""
        if max_running < 0:
            raise InvalidRouteRequestError(
                "max_running_requests", f"must be >= 0, got {max_running}"
            )
        self._fleet.get(worker_id).view.max_running = max_running

    def set_step_profile(self, worker_id: str, profile: StepProfile) -> None:
        """The worker's stated step times (``WorkerInfo``'s step profile; the default where
        it states none): the cost's decode-time term reads them (decision 0031)."""
        self._fleet.get(worker_id).view.step_profile = profile

    def set_health(self, worker_id: str, healthy: bool) -> None:
        """Unhealthy workers keep their index entries but are never routed to."""
        self._fleet.get(worker_id).view.healthy = healthy
        self._fleet.refresh_healthy()

    def workers(self) -> list[str]:
        """Registered worker ids, in registration order."""
        return list(self._workers)

    def has_worker(self, worker_id: str) -> bool:
        return worker_id in self._workers

    def worker_view(self, worker_id: str) -> WorkerView:
        """The live per-worker state policies see (health, in-flight counts, last load)."""
        return self._fleet.get(worker_id).view

    # ---- KV event streams ----------------------------------------------------------------

    def expected_subscription(self, worker_id: str) -> tuple[int, int]:
        """(epoch, after_seq) to (re)subscribe with; (0, 0) when nothing was synced yet.
        Call it whenever a stream (re)starts, whatever the reason."""
        return self._streams.expected_subscription(worker_id)

    def stream_position(self, worker_id: str) -> tuple[int, int]:
        """(epoch, seq) of the last applied batch or snapshot; read-only, unlike
        :meth:`expected_subscription`, which also records the subscription as asked."""
        return self._streams.position(worker_id)

    def on_stream_message(self, worker_id: str, msg: EventBatch | Snapshot) -> list[Action]:
        """Feed one message of a worker's event stream; returns actions for the shell
        (StreamIngest.receive: what is dropped, buffered, applied, raised)."""
        return self._streams.receive(worker_id, msg)

    # ---- routing -------------------------------------------------------------------------

    def _hashes(self, tokens: np.ndarray, seed: int) -> Sequence[int]:
        """The prompt's full blocks' hashes, as the index takes them fastest."""
        array = block_hashes(tokens, self._fleet.block_size or 1, seed, validate=False)
        return cast(Sequence[int], array) if self._hash_arrays else array.tolist()

    def _query(self, req: RouteRequest, recent_scale: float = 1.0) -> RouteQuery:
        tokens = req.token_ids
        if not (isinstance(tokens, np.ndarray) and tokens.dtype == np.uint32 and tokens.ndim == 1):
            try:  # uint32 arrays (what the service decodes) are valid as they are
                tokens = as_token_array(tokens)
            except (TypeError, ValueError) as exc:
                raise InvalidRouteRequestError("token_ids", str(exc)) from None
        block_size = self._fleet.block_size
        hashes: Sequence[int] = []
        if block_size is not None:
            hashes = self._hashes(tokens, req.partition.seed)
        prompt_tokens = len(tokens)
        if req.prompt_tokens is not None:
            if req.prompt_tokens < prompt_tokens:
                raise InvalidRouteRequestError(
                    "prompt_tokens",
                    f"must be >= len(token_ids) = {prompt_tokens}, got {req.prompt_tokens}",
                )
            prompt_tokens = req.prompt_tokens
        return RouteQuery(
            req.request_id,
            prompt_tokens,
            block_size or 1,
            hashes,
            recent_scale,
            self._flights.expected_output_tokens,
        )

    def route(self, req: RouteRequest) -> RouteDecision:
        """Pick a worker for ``req`` and account it as in flight there (Flights.open).

        The request's full blocks are entered as predicted for the chosen worker, so the
        next request with the same prefix sees them before any event arrives; they are
        held until on_first_token / on_finished, then live for the TTL. Raises
        NoWorkerAvailable when no healthy worker outside ``req.exclude`` exists, and
        InvalidRouteRequestError for bad token ids. A request_id still in flight is first
        finished (a retry moves its accounting).
        """
        candidate_set = self._fleet.candidate_set(req.exclude)
        candidates = candidate_set.views
        if not candidates:
            raise self._no_worker(req)
        now = self._clock()
        flights = self._flights
        flights.settle(now)
        scale = flights.recent_scale(now)
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
        flights.open(query, view, depth, matched_tokens, now, scale)
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
        healthy = self._fleet.healthy
        num_excluded = sum(1 for v in healthy if v.worker_id in req.exclude)
        return NoWorkerAvailable(req.request_id, len(self._workers), len(healthy), num_excluded)

    def explain(self, req: RouteRequest) -> Explanation:
        """Per-worker match, load, cost and the pick route() would make; changes nothing
        (beyond dropping predictions past their deadline, which route() would drop too).
        Ties are broken with a generator seeded by the request id (not the router's), and
        stateful policies (round_robin) are consulted on a copy."""
        now = self._clock()
        self._flights.settle(now)  # as route() would see the fleet
        unscale = 1.0 / self._flights.recent_scale(now)
        query = self._query(req, unscale)
        hashes = query.block_hashes
        index = self._index
        index.expire(now)  # as route() does: a lapsed prediction matches nothing
        matched = index.find_matches(hashes, touch=False) if len(hashes) else {}
        confirmed, predicted = index.find_matches_by_source(hashes) if len(hashes) else ({}, {})
        candidates = self._fleet.candidates(req.exclude)
        matches = (matched, confirmed, predicted)
        workers = self._workers.values()
        return explanation(self._policy, req, query, workers, candidates, matches, unscale)

    def may_match_past(self, token_ids: np.ndarray | Sequence[int], partition: Partition) -> bool:
        """Whether some worker's cached prefix (confirmed or predicted) may go on past
        ``token_ids``, the head of a prompt: False means every match ends inside it, so
        whatever follows cannot change where the request goes (the front end then leaves
        the rest of a text prompt untokenized). May say True wrongly, never False wrongly:
        a prediction is probed only every ``predict_stride`` blocks, so a predicted match
        that reaches the last probe counts as going on. Changes nothing."""
        if self._fleet.block_size is None or not self._policy.uses_matches:
            return False
        hashes = self._hashes(np.asarray(token_ids, dtype=np.uint32), partition.seed)
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
        stride = self.config.index.predict_stride
        return best >= n // stride * stride

    # ---- requests in flight (flights.py) -----------------------------------------------

    def on_routed(
        self, request_id: str, worker_id: str, prompt_tokens: int, matched_tokens: int
    ) -> None:
        """Account a request as in flight (route() does; the shell needs it only when it
        placed a request itself)."""
        self._flights.routed(request_id, worker_id, prompt_tokens, matched_tokens)

    def on_first_token(self, request_id: str) -> None:
        """Prefill of ``request_id`` is done: its tokens leave the queued-prefill estimate."""
        self._flights.first_token(request_id)

    def on_finished(self, request_id: str, generated_tokens: int = 0) -> None:
        """The request ended (finished, aborted or failed); ``generated_tokens`` add to the
        worker's recent work (Flights.finished). Unknown ids are ignored."""
        self._flights.finished(request_id, generated_tokens)

    # ---- replica sync (flights.py, replicas.py) ----------------------------------------

    def set_replica_listener(self, listener: Callable[[ReplicaEvent], None] | None) -> None:
        """Tell ``listener`` this router's own picks, first tokens and finishes (None: stop);
        it must not block (Flights.set_listener)."""
        self._flights.set_listener(listener)

    @property
    def replica_sync_window_s(self) -> float:
        """How long an own pick counts R times (inf: until its first token)."""
        return self._flights.replicas.window_s

    def observe_replica_sync_delay(self, delay_s: float) -> None:
        """The sync delivered a message ``delay_s`` after it was queued (an auto window
        follows it: ReplicaAccounting.observe_delay)."""
        self._flights.replicas.observe_delay(delay_s)

    def apply_replica(self, router_id: str, event: ReplicaEvent) -> bool:
        """Another router replica placed, started or ended a request: count it once; False
        if that changed nothing (Flights.apply_replica)."""
        return self._flights.apply_replica(router_id, event)

    @property
    def num_replica_inflight(self) -> int:
        """Requests of other router replicas this router counts in flight."""
        return len(self._flights.replicas.peers)

    def drop_replica(self, router_id: str) -> int:
        """End every request router ``router_id`` placed (it left, restarted or went
        silent: their ends will never be heard); how many there were."""
        return self._flights.drop_replica(router_id)

    # ---- introspection -------------------------------------------------------------------

    def stats(self) -> RouterStats:
        return router_stats(self._fleet, self._index, self._flights)

    def worker_stats(self) -> list[WorkerStats]:
        """Each registered worker's routing state, in registration order (metrics)."""
        blocks_of = self._index.num_worker_blocks
        return worker_stats(self._workers.values(), blocks_of, self._clock())

    def worker_blocks(self, worker_id: str) -> set[int]:
        """The block hashes the index believes ``worker_id`` holds (confirmed by events)."""
        return self._index.snapshot(self._fleet.get(worker_id).view.slot)
