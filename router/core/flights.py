"""Requests in flight: the load a router core counts on each worker until a request ends.

:class:`Flights` holds this router's own requests (by request id) and, with replica sync,
the other router replicas' (:class:`~router.core.replicas.ReplicaAccounting` counts both:
an own pick R times among R replicas, a peer's once). A request in flight queues its
uncached tokens on its worker until its first token, counts as active there until it ends,
adds to the worker's recent work, and holds its predicted blocks in the index until its
first token (their TTL starts then). The recent work decays as exp(-t / window); the views
hold it scaled by exp((t - t0) / window), so that a route touches one view, not all
(:meth:`Flights.recent_scale`).

Sans-I/O: no asyncio, grpc or clock (time comes from the core's injected clock).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import cast

import numpy as np

from router.core.core_types import (
    ReplicaEvent,
    ReplicaFinished,
    ReplicaFirstToken,
    ReplicaRouted,
    RouterConfig,
)
from router.core.fleet import Fleet
from router.core.index_api import PrefixIndexAPI
from router.core.policy import Policy
from router.core.replicas import Inflight, ReplicaAccounting, open_flight
from router.core.views import RouteQuery, WorkerView

__all__ = ["DEFAULT_OUTPUT_TOKENS", "OUTPUT_MEAN_WEIGHT", "Flights"]

DEFAULT_OUTPUT_TOKENS = 256.0  # the expected output before any request has finished
OUTPUT_MEAN_WEIGHT = 1.0 / 64  # each finished request's share of the running mean


class Flights:
    """The requests a router core counts in flight, its own and its peers', and the workers'
    recent work they add (``policy``: the core's; whether it reads the events and the
    index decides the predictions' TTL and whether requests predict their blocks)."""

    def __init__(
        self,
        config: RouterConfig,
        policy: Policy,
        fleet: Fleet,
        index: PrefixIndexAPI,
        clock: Callable[[], float],
    ) -> None:
        self._fleet = fleet
        self._workers = fleet.workers
        self._index = index
        self._clock = clock
        self._use_events = policy.uses_events
        # how long a predicted block lives once its hold ends
        self._ttl = config.predicted_ttl_s if self._use_events else config.approx_ttl_s
        self._uses_matches = policy.uses_matches  # (else no request predicts its blocks)
        # a peer's hashes as the index takes them fastest: a uint64 array, or a list of ints
        self._hash_arrays = index.takes_arrays
        self._peer_view = config.replica.peer_view
        self.own: dict[str, Inflight] = {}  # this router's requests, by request id
        self.replicas = ReplicaAccounting(config.replica, clock())
        self.num_routed = 0
        self._recent_window_s = config.recent_window_s
        self._recent_decode_ratio = config.recent_decode_ratio
        self._recent_t0 = clock()
        # the decode-time term's expected output: a running mean of finished requests'
        # generated tokens, each weighing OUTPUT_MEAN_WEIGHT (decision 0031)
        self.expected_output_tokens = DEFAULT_OUTPUT_TOKENS

    # ---- recent work -----------------------------------------------------------------------

    def recent_scale(self, now: float) -> float:
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

    def settle(self, now: float) -> None:
        """Own picks whose replica sync window has ended count once from ``now`` on."""
        replicas = self.replicas
        if replicas.unsettled:
            replicas.settle(now, self.own, self._recent_t0)

    # ---- own requests ----------------------------------------------------------------------

    def open(
        self,
        query: RouteQuery,
        view: WorkerView,
        depth: int,
        matched_tokens: int,
        now: float,
        scale: float,
    ) -> None:
        """RouterCore.route placed ``query`` on ``view``'s worker, ``depth`` blocks of it
        matched there: account it in flight (a request id still in flight is first
        finished), enter its full blocks as predicted there, held until its first token
        (however long it queues, the worker will write them and its events confirm them
        soon after), and tell the replicas. ``scale``: :meth:`recent_scale` at ``now``."""
        request_id = query.request_id
        if request_id in self.own:
            self.finished(request_id)
        uncached = query.prompt_tokens - matched_tokens
        flight = self._account(request_id, view, uncached, not matched_tokens, now)
        view.recent_prefill += uncached * scale
        if flight.extra_active:  # the replicas' same-moment picks, until the window ends
            flight.extra_recent = uncached * flight.extra_active * scale
            flight.extra_recent_t0 = self._recent_t0
            view.recent_prefill += flight.extra_recent
        hashes = query.block_hashes
        uses_matches = self._uses_matches
        if len(hashes) and uses_matches:
            deadline = now + self._ttl
            if not self._use_events and depth:  # approx mode: what was used stays longer
                self._index.refresh_predicted(hashes[:depth], deadline)
            flight.held = self._index.predict(view.slot, hashes, deadline, start=depth, hold=True)
        listener = self.replicas.listener
        if listener is not None:
            shared = hashes if uses_matches else ()
            listener(
                ReplicaRouted(
                    request_id, view.worker_id, query.prompt_tokens, matched_tokens, shared
                )
            )

    def _account(
        self, request_id: str, view: WorkerView, prefill_tokens: int, cold: bool, now: float
    ) -> Inflight:
        flight = self.replicas.count(request_id, view, prefill_tokens, cold, now)
        self.own[request_id] = flight
        self.num_routed += 1
        return flight

    def _release(self, flight: Inflight, now: float) -> None:
        """End the hold on the request's predicted blocks: their TTL starts ``now``."""
        if flight.held:
            self._index.release_predicted(flight.held, now + self._ttl)
            flight.held = ()

    def routed(
        self, request_id: str, worker_id: str, prompt_tokens: int, matched_tokens: int
    ) -> None:
        """Account a request as in flight (:meth:`open` does for route(); the shell needs
        this only when it placed a request itself)."""
        view = self._fleet.get(worker_id).view
        if request_id in self.own:
            self.finished(request_id)
        uncached = max(0, prompt_tokens - matched_tokens)
        self._account(request_id, view, uncached, not matched_tokens, self._clock())
        listener = self.replicas.listener
        if listener is not None:
            listener(ReplicaRouted(request_id, worker_id, prompt_tokens, matched_tokens))

    def first_token(self, request_id: str) -> None:
        """Prefill of ``request_id`` is done: its tokens leave the queued-prefill estimate."""
        flight = self.own.get(request_id)
        if flight is not None and flight.prefilling:
            self._first_token(flight)
            listener = self.replicas.listener
            if listener is not None:
                listener(ReplicaFirstToken(request_id))

    def _first_token(self, flight: Inflight) -> None:
        self._release(flight, self._clock())
        flight.prefilling = False
        flight.view.inflight_prefill_tokens -= flight.prefill_tokens
        flight.view.num_prefilling -= 1 + flight.extra_active
        flight.view.refresh()

    def finished(self, request_id: str, generated_tokens: int = 0) -> None:
        """The request ended (finished, aborted or failed). Unknown ids are ignored.

        ``generated_tokens``: what the worker decoded for it (the Finished usage); each adds
        ``recent_decode_ratio`` tokens to the worker's recent sum, so a worker busy decoding
        long conversations is not taken for an idle one by the balance term."""
        flight = self.own.pop(request_id, None)
        if flight is None:
            return
        self._finish(flight, generated_tokens)
        listener = self.replicas.listener
        if listener is not None:
            listener(ReplicaFinished(request_id, generated_tokens))

    def _finish(self, flight: Inflight, generated_tokens: int) -> None:
        now = self._clock()
        if generated_tokens > 0:
            mean = self.expected_output_tokens
            self.expected_output_tokens = mean + (generated_tokens - mean) * OUTPUT_MEAN_WEIGHT
        self._release(flight, now)
        if generated_tokens > 0 and self._recent_decode_ratio:
            scale = self.recent_scale(now)
            flight.view.recent_prefill += self._recent_decode_ratio * generated_tokens * scale
        if flight.prefilling:
            flight.view.inflight_prefill_tokens -= flight.prefill_tokens
            flight.view.num_prefilling -= 1 + flight.extra_active
        flight.view.num_active -= 1 + flight.extra_active
        flight.extra_active = 0
        flight.view.refresh()

    def drop_worker(self, view: WorkerView) -> None:
        """The worker of ``view`` left: end the holds of every request counted there."""
        now = self._clock()
        own = self.own
        for request_id in [r for r, f in own.items() if f.view is view]:
            self._release(own.pop(request_id), now)
        peers = self.replicas.peers
        for key in [k for k, f in peers.items() if f.view is view]:
            self._release(peers.pop(key), now)

    # ---- replica sync ----------------------------------------------------------------------

    def set_listener(self, listener: Callable[[ReplicaEvent], None] | None) -> None:
        """Call ``listener`` with every pick, first token and finish of this router's own
        requests, so the other router replicas can count them (:meth:`apply_replica`); None
        stops. The listener must not block: it runs inside every route."""
        self.replicas.listener = listener

    def apply_replica(self, router_id: str, event: ReplicaEvent) -> bool:
        """Another router replica (``router_id``) placed, started or ended a request.

        Counted once (it is what happened, not an anticipation): a placed request's uncached
        tokens queue on the worker until its first token, it counts as active until its
        finish, adds to the worker's recent work, and its full blocks are predicted there
        (held until the first token), so a burst one router started on a worker is seen as
        cached there by the others before any KV event arrives. Returns False, changing
        nothing, for an unknown worker, a request already counted, or an end never begun."""
        key = (router_id, event.request_id)
        peers = self.replicas.peers
        if isinstance(event, ReplicaRouted):
            return self._apply_routed(key, event)
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

    def _apply_routed(self, key: tuple[str, str], event: ReplicaRouted) -> bool:
        peers = self.replicas.peers
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
        if len(array) and self._uses_matches and block_size is not None:
            # the numba index takes the array; the dict index keys on ints
            hashes = cast(Sequence[int], array) if self._hash_arrays else array.tolist()
            self._index.expire(now)
            start = event.matched_tokens // block_size
            if self._peer_view:  # the better of the two views (0020)
                depth = self._index.match_depth(view.slot, hashes)
                start = max(depth, start)
                seen = min(depth * block_size, event.prompt_tokens)
        uncached = max(0, event.prompt_tokens - max(event.matched_tokens, seen))
        view.recent_prefill += uncached * self.recent_scale(now)
        flight = peers[key] = open_flight(view, uncached)
        if len(hashes):
            flight.held = self._index.predict(
                view.slot, hashes, now + self._ttl, start=min(start, len(hashes)), hold=True
            )
        return True

    def drop_replica(self, router_id: str) -> int:
        """End every request router ``router_id`` placed (it left, restarted or went
        silent: their ends will never be heard); how many there were."""
        peers = self.replicas.peers
        keys = [k for k in peers if k[0] == router_id]
        for key in keys:
            self._finish(peers.pop(key), 0)
        return len(keys)
