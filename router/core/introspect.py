"""What a router core reports about itself: explanations, stats per worker (read-only).

Functions over the core's parts, so :mod:`router.core.router_core` keeps to routing.
"""

from __future__ import annotations

import copy
import random
from collections import Counter
from collections.abc import Callable, Iterable

from router.core.core_types import (
    Explanation,
    RouteRequest,
    RouterStats,
    WorkerScore,
    WorkerStats,
)
from router.core.fleet import Fleet, FleetWorker
from router.core.flights import Flights
from router.core.index_api import PrefixIndexAPI
from router.core.policy import Policy
from router.core.views import Matched, RouteQuery, WorkerView

__all__ = ["EXCLUDED", "UNHEALTHY", "explanation", "router_stats", "worker_stats"]

# Explain's reasons for a worker that is not a candidate (WorkerScore.not_candidate_reason)
UNHEALTHY = "unhealthy"
EXCLUDED = "excluded by the request"


def explanation(
    policy: Policy,
    req: RouteRequest,
    query: RouteQuery,
    workers: Iterable[FleetWorker],
    candidates: list[WorkerView],
    matches: tuple[Matched, Matched, Matched],
    unscale: float,
) -> Explanation:
    """Per-worker match, load, cost and the pick ``policy`` would make for ``query``
    (``matches``: the match depths in blocks per slot, all and by source: confirmed,
    predicted). Ties are broken with a generator seeded by the request id, and stateful
    policies are consulted on a copy."""
    matched, confirmed, predicted = matches
    costs: list[float] | None = None
    chosen: str | None = None
    miss_factor = 0.0
    if candidates:
        policy = copy.copy(policy)
        i, _ = policy.select(query, candidates, matched, random.Random(req.request_id))
        chosen = candidates[i].worker_id
        costs = policy.costs(query, candidates, matched)
        miss_factor = policy.miss_factor(candidates)
    cost_of = dict(zip((v.worker_id for v in candidates), costs or (), strict=False))
    block_size, prompt_tokens = query.block_size, query.prompt_tokens

    def tokens(blocks: Matched, slot: int) -> int:
        return min(blocks.get(slot, 0) * block_size, prompt_tokens)

    lines = []
    for worker in workers:
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
                tokens(matched, v.slot),
                v.queued_prefill_tokens,
                v.num_active,
                cost_of.get(v.worker_id),
                v.load,
                v.recent_prefill * unscale,
                tokens(confirmed, v.slot),
                tokens(predicted, v.slot),
                reason,
                v.slot_queue,
            )
        )
    return Explanation(policy.name, prompt_tokens, chosen, tuple(lines), miss_factor)


def worker_stats(
    workers: Iterable[FleetWorker], blocks_of: Callable[[int], int], now: float
) -> list[WorkerStats]:
    """Each worker's routing state (``blocks_of(slot)``: its indexed blocks)."""
    result = []
    for worker in workers:
        v = worker.view
        stream = worker.stream
        seen = worker.last_message_at
        result.append(
            WorkerStats(
                worker_id=v.worker_id,
                address=v.address,
                healthy=v.healthy,
                num_active_requests=v.num_active,
                inflight_prefill_tokens=v.inflight_prefill_tokens,
                num_indexed_blocks=blocks_of(v.slot),
                epoch=stream.epoch,
                last_seq=stream.last_seq,
                seconds_since_message=None if seen is None else now - seen,
                sync_counters=dict(stream.counters),
                load=v.load,
                max_running=v.max_running,
            )
        )
    return result


def router_stats(fleet: Fleet, index: PrefixIndexAPI, flights: Flights) -> RouterStats:
    """The core's totals: workers, index, requests in flight, stream counters summed."""
    counters: Counter[str] = Counter()
    for worker in fleet.workers.values():
        counters.update(worker.stream.counters)
    return RouterStats(
        num_workers=len(fleet.workers),
        num_healthy=len(fleet.healthy),
        num_indexed_blocks=index.size(),
        num_index_entries=index.num_entries,
        num_predicted_entries=index.num_predicted,
        num_inflight_requests=len(flights.own),
        num_routed=flights.num_routed,
        apply_errors=dict(index.errors),
        sync_counters=dict(counters),
        num_evicted_blocks=index.num_evicted,
        index_bytes=index.approx_bytes(),
        num_replica_inflight=len(flights.replicas.peers),
    )
