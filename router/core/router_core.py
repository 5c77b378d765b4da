"""RouterCore: the sans-I/O router facade the gRPC service and the replay simulator wrap.

Imports neither asyncio, grpc, torch nor a clock: time comes from an injected
``clock: Callable[[], float]`` and randomness from an injected ``random.Random``, so the same
object runs under a virtual clock in the simulator and reproducibly in tests.

What it owns::

    on_stream_message(worker, EventBatch|Snapshot) --> StreamSequencer (per worker, sync.py)
          |  in-order batches / snapshots                   | actions (Resubscribe)
          v                                                 v
    the index (index_api) <-- predicted entries --- route() ---> returned to the shell
          |  matched blocks per worker
          v
    Policy (registry.py: cost.py, policy.py, peer_policies.py): cost per worker, pick

It delegates: the workers and their streams to :class:`~router.core.fleet.Fleet`, requests
in flight among router replicas to :class:`~router.core.replicas.ReplicaAccounting`,
explanations and per-worker stats to :mod:`router.core.introspect`.

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

import math
import random
from collections import Counter
from collections.abc import Callable, Sequence
from typing import cast

import numpy as np

from kvroute_proto.codec import WireBatch, enable_compiled_decode
from kvroute_proto.events import EventBatch, Partition, Snapshot
from kvroute_proto.hashing import as_token_array, block_hashes, enable_compiled
from router.core.core_types import (  # the API's value types live there; re-exported here
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
from router.core.cost import affinity_terms
from router.core.errors import (  # re-exported for the shells
    BlockSizeMismatchError,
    DuplicateWorkerError,
    InvalidRouteRequestError,
    NoWorkerAvailable,
    UnknownWorkerError,
)
from router.core.fleet import Fleet
from router.core.index_api import PrefixIndexAPI
from router.core.index_factory import make_index
from router.core.introspect import EXCLUDED, UNHEALTHY, explanation, worker_stats
from router.core.policy_config import CostWeights
from router.core.registry import make_policy
from router.core.replicas import Inflight, ReplicaAccounting, open_flight
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
        self._use_events = self._policy.uses_events
        self._ttl = config.predicted_ttl_s if self._use_events else config.approx_ttl_s
        self._index = make_index(config.index)
        # batches decoded lazily (kvroute_proto.codec.WireBatch) applied from their scanned
        # layout, without event objects: the numba index, when it need not verify hashes
        self._wire_apply = self._index.prefers_wire and not config.index.verify_hashes
        # a query's hashes as the index takes them fastest: a uint64 array, or a list of ints
        self._hash_arrays = self._index.takes_arrays
        if self._hash_arrays:  # numba is at hand: hash prompts with its compiled chain too,
            enable_compiled()  # and decode event batches with its compiled scan
            enable_compiled_decode()
        weights = config.policy_config.weights
        sync = SyncConfig(max_pending_batches=config.max_pending_batches)
        self._fleet = Fleet(weights, sync, config.block_size)
        self._workers = self._fleet.workers
        self._inflight: dict[str, Inflight] = {}
        self._replicas = ReplicaAccounting(config.replica, clock())
        self._num_routed = 0
        # recent work per worker decays as exp(-t / window); views hold it scaled by
        # exp((t - t0) / window) so that a route touches one view, not all (_recent_scale)
        self._recent_window_s = config.recent_window_s
        self._recent_decode_ratio = config.recent_decode_ratio
        self._recent_t0 = clock()

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
        now = self._clock()
        for request_id in [r for r, f in self._inflight.items() if f.view is view]:
            self._release(self._inflight.pop(request_id), now)
        peers = self._replicas.peers
        for key in [k for k, f in peers.items() if f.view is view]:
            self._release(peers.pop(key), now)
        self._fleet.refresh_healthy()

    def set_max_running(self, worker_id: str, max_running: int) -> None:
        """The worker's stated cap on running requests (GetLoad's ``max_running_requests``;
        0: none stated): past it the cost's slot-wait term applies."""
        if max_running < 0:
            raise InvalidRouteRequestError(
                "max_running_requests", f"must be >= 0, got {max_running}"
            )
        self._fleet.get(worker_id).view.max_running = max_running

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

        Call it whenever a stream (re)starts, whatever the reason.
        """
        return self._fleet.get(worker_id).stream.expected_subscription()

    def stream_position(self, worker_id: str) -> tuple[int, int]:
        """(epoch, seq) of the last applied batch or snapshot; read-only, unlike
        :meth:`expected_subscription`, which also records the subscription as asked."""
        stream = self._fleet.get(worker_id).stream
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
        worker = self._fleet.get(worker_id)
        self._fleet.check_block_size(worker_id, msg.block_size)
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
        return RouteQuery(req.request_id, prompt_tokens, block_size or 1, hashes, recent_scale)

    def route(self, req: RouteRequest) -> RouteDecision:
        """Pick a worker for ``req`` and account it as in flight there (on_routed).

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
        replicas = self._replicas
        if replicas.unsettled:
            replicas.settle(now, self._inflight, self._recent_t0)
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
        uncached = query.prompt_tokens - matched_tokens
        flight = self._account(req.request_id, view, uncached, not matched_tokens, now)
        view.recent_prefill += uncached * scale
        if flight.extra_active:  # the replicas' same-moment picks, until the window ends
            flight.extra_recent = uncached * flight.extra_active * scale
            flight.extra_recent_t0 = self._recent_t0
            view.recent_prefill += flight.extra_recent
        uses_matches = self._policy.uses_matches
        if len(hashes) and uses_matches:
            deadline = now + self._ttl
            if not self._use_events and depth:  # approx mode: what was used stays longer
                index.refresh_predicted(hashes[:depth], deadline)
            # held until the first token: however long it queues there, the worker will
            # write these blocks, and its events confirm them soon after
            flight.held = index.predict(view.slot, hashes, deadline, start=depth, hold=True)
        if replicas.listener is not None:
            replicas.listener(
                ReplicaRouted(
                    req.request_id,
                    view.worker_id,
                    query.prompt_tokens,
                    matched_tokens,
                    hashes if uses_matches else (),
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
        healthy = self._fleet.healthy
        num_excluded = sum(1 for v in healthy if v.worker_id in req.exclude)
        return NoWorkerAvailable(req.request_id, len(self._workers), len(healthy), num_excluded)

    def explain(self, req: RouteRequest) -> Explanation:
        """Per-worker match, load, cost and the pick route() would make; changes nothing
        (beyond dropping predictions past their deadline, which route() would drop too).
        Ties are broken with a generator seeded by the request id (not the router's), and
        stateful policies (round_robin) are consulted on a copy."""
        now = self._clock()
        if self._replicas.unsettled:  # as route() would see the fleet
            self._replicas.settle(now, self._inflight, self._recent_t0)
        unscale = 1.0 / self._recent_scale(now)
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

    # ---- requests in flight --------------------------------------------------------------

    def _account(
        self, request_id: str, view: WorkerView, prefill_tokens: int, cold: bool, now: float
    ) -> Inflight:
        flight = self._replicas.count(request_id, view, prefill_tokens, cold, now)
        self._inflight[request_id] = flight
        self._num_routed += 1
        return flight

    def _release(self, flight: Inflight, now: float) -> None:
        """End the hold on the request's predicted blocks: their TTL starts ``now``."""
        if flight.held:
            self._index.release_predicted(flight.held, now + self._ttl)
            flight.held = ()

    def on_routed(
        self, request_id: str, worker_id: str, prompt_tokens: int, matched_tokens: int
    ) -> None:
        """Account a request as in flight (route() calls it; the shell needs it only when it
        placed a request itself)."""
        view = self._fleet.get(worker_id).view
        if request_id in self._inflight:
            self.on_finished(request_id)
        uncached = max(0, prompt_tokens - matched_tokens)
        self._account(request_id, view, uncached, not matched_tokens, self._clock())
        listener = self._replicas.listener
        if listener is not None:
            listener(ReplicaRouted(request_id, worker_id, prompt_tokens, matched_tokens))

    def on_first_token(self, request_id: str) -> None:
        """Prefill of ``request_id`` is done: its tokens leave the queued-prefill estimate."""
        flight = self._inflight.get(request_id)
        if flight is not None and flight.prefilling:
            self._first_token(flight)
            listener = self._replicas.listener
            if listener is not None:
                listener(ReplicaFirstToken(request_id))

    def _first_token(self, flight: Inflight) -> None:
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
        listener = self._replicas.listener
        if listener is not None:
            listener(ReplicaFinished(request_id, generated_tokens))

    def _finish(self, flight: Inflight, generated_tokens: int) -> None:
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
        requests, so the other router replicas can count them (:meth:`apply_replica`); None
        stops. The listener must not block: it runs inside every route."""
        self._replicas.listener = listener

    @property
    def replica_sync_window_s(self) -> float:
        """How long an own pick counts R times (inf: until its first token)."""
        return self._replicas.window_s

    def observe_replica_sync_delay(self, delay_s: float) -> None:
        """The sync delivered a message ``delay_s`` after it was queued (an auto window
        follows it: ReplicaAccounting.observe_delay)."""
        self._replicas.observe_delay(delay_s)

    def apply_replica(self, router_id: str, event: ReplicaEvent) -> bool:
        """Another router replica (``router_id``) placed, started or ended a request.

        Counted once (it is what happened, not an anticipation): a placed request's uncached
        tokens queue on the worker until its first token, it counts as active until its
        finish, adds to the worker's recent work, and its full blocks are predicted there
        (held until the first token), so a burst one router started on a worker is seen as
        cached there by the others before any KV event arrives. Returns False, changing
        nothing, for an unknown worker, a request already counted, or an end never begun."""
        key = (router_id, event.request_id)
        peers = self._replicas.peers
        if isinstance(event, ReplicaRouted):
            worker = self._workers.get(event.worker_id)
            if worker is None or key in peers:
                return False
            view = worker.view
            now = self._clock()
            array = np.asarray(event.block_hashes, dtype=np.uint64)
            hashes: Sequence[int] = ()
            start = 0  # the first block to enter as predicted there
            seen = 0  # tokens of the prompt this router sees cached or predicted there
            block_size = self._fleet.block_size
            if len(array) and self._policy.uses_matches and block_size is not None:
                # the numba index takes the array; the dict index keys on ints
                hashes = cast(Sequence[int], array) if self._hash_arrays else array.tolist()
                self._index.expire(now)
                start = event.matched_tokens // block_size
                if self.config.replica.peer_view:  # the better of the two views (0020)
                    depth = self._index.match_depth(view.slot, hashes)
                    start = max(depth, start)
                    seen = min(depth * block_size, event.prompt_tokens)
            uncached = max(0, event.prompt_tokens - max(event.matched_tokens, seen))
            view.recent_prefill += uncached * self._recent_scale(now)
            flight = peers[key] = open_flight(view, uncached)
            if len(hashes):
                flight.held = self._index.predict(
                    view.slot, hashes, now + self._ttl, start=min(start, len(hashes)), hold=True
                )
            return True
        if isinstance(event, ReplicaFirstToken):
            started = peers.get(key)
            if started is None or not started.prefilling:
                return False
            self._first_token(started)
            return True
        ended = peers.pop(key, None)
        if ended is None:
            return False
        self._finish(ended, event.generated_tokens)
        return True

    @property
    def num_replica_inflight(self) -> int:
        """Requests of other router replicas this router counts in flight."""
        return len(self._replicas.peers)

    def drop_replica(self, router_id: str) -> int:
        """End every request router ``router_id`` placed (it left, restarted or went
        silent: their ends will never be heard); how many there were."""
        peers = self._replicas.peers
        keys = [k for k in peers if k[0] == router_id]
        for key in keys:
            self._finish(peers.pop(key), 0)
        return len(keys)

    # ---- introspection -------------------------------------------------------------------

    def stats(self) -> RouterStats:
        counters: Counter[str] = Counter()
        for worker in self._workers.values():
            counters.update(worker.stream.counters)
        index = self._index
        return RouterStats(
            num_workers=len(self._workers),
            num_healthy=len(self._fleet.healthy),
            num_indexed_blocks=index.size(),
            num_index_entries=index.num_entries,
            num_predicted_entries=index.num_predicted,
            num_inflight_requests=len(self._inflight),
            num_routed=self._num_routed,
            apply_errors=dict(index.errors),
            sync_counters=dict(counters),
            num_evicted_blocks=index.num_evicted,
            index_bytes=index.approx_bytes(),
            num_replica_inflight=len(self._replicas.peers),
        )

    def worker_stats(self) -> list[WorkerStats]:
        """Each registered worker's routing state, in registration order (metrics)."""
        blocks_of = self._index.num_worker_blocks
        return worker_stats(self._workers.values(), blocks_of, self._clock())

    def worker_blocks(self, worker_id: str) -> set[int]:
        """The block hashes the index believes ``worker_id`` holds (confirmed by events)."""
        return self._index.snapshot(self._fleet.get(worker_id).view.slot)
