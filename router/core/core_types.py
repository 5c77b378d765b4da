"""Value types of the router core's API: config, request, decision, explanation, actions.

Plain frozen dataclasses, no logic; ``router.core.router_core`` re-exports the API's names.
Imports neither asyncio, grpc, torch nor a clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvroute_proto.events import DEFAULT_PARTITION, LoadReport, Partition
from router.core.index_api import IndexConfig
from router.core.policy_config import PolicyConfig
from router.core.replicas import (  # re-exported: the replica constants' old home
    DEFAULT_REPLICA_AFFINITY_TOKENS,
    DEFAULT_REPLICA_COLD_PICKS,
    DEFAULT_REPLICA_COLD_WINDOW_PICKS,
    INITIAL_REPLICA_SYNC_WINDOW_S,
    REPLICA_SYNC_WINDOW_DECAY,
    REPLICA_WINDOW_PICKS_PERIOD_S,
    ReplicaConfig,
)

__all__ = [
    "DEFAULT_RECENT_DECODE_RATIO",
    "DEFAULT_RECENT_WINDOW_S",
    "DEFAULT_REPLICA_AFFINITY_TOKENS",
    "DEFAULT_REPLICA_COLD_PICKS",
    "DEFAULT_REPLICA_COLD_WINDOW_PICKS",
    "INITIAL_REPLICA_SYNC_WINDOW_S",
    "REPLICA_SYNC_WINDOW_DECAY",
    "REPLICA_WINDOW_PICKS_PERIOD_S",
    "Action",
    "Explanation",
    "IndexConfig",
    "PolicyConfig",
    "ReplicaConfig",
    "Resubscribe",
    "RouteDecision",
    "RouteRequest",
    "RouterConfig",
    "RouterStats",
    "WorkerScore",
    "WorkerStats",
]


DEFAULT_RECENT_WINDOW_S = 30.0  # decay time constant of each worker's recent work (0009)
DEFAULT_RECENT_DECODE_RATIO = 0.5  # recent-work tokens per generated token (0009)


def _router_index() -> IndexConfig:
    return IndexConfig(backend="numba")


@dataclass(frozen=True, slots=True, kw_only=True)
class RouterConfig:
    """Router core settings; the parts each validate their own fields.

    ``policy``: a name from ``router.core.registry.POLICIES``. ``policy_config``: the
    policies' settings (the cost's weights and factors). ``index``: the prefix index's
    (its backend "numba" by default here: compiled kernels; "dict" is the pure-Python
    reference). ``replica``: router replicas sharing the fleet (ReplicaConfig).
    ``block_size``: the fleet's block size; None lets the first worker that announces one
    set it. ``predicted_ttl_s``: how long a predicted entry not confirmed by an event lives
    after its request's first token (or end); while the request waits for prefill it is
    held however long it queues (``approx_ttl_s`` instead for policies that never read
    events). ``max_pending_batches``: per-worker buffer of out-of-order batches waiting
    for a gap to fill. ``recent_window_s``: time constant of the decay of each worker's
    recent work (the cost's balance term). ``recent_decode_ratio``: recent-work tokens one
    generated token of a finished request adds (decision 0009).
    """

    policy: str = "cache_aware"
    policy_config: PolicyConfig = field(default_factory=PolicyConfig)
    index: IndexConfig = field(default_factory=_router_index)
    replica: ReplicaConfig = field(default_factory=ReplicaConfig)
    block_size: int | None = None
    predicted_ttl_s: float = 5.0
    approx_ttl_s: float = 120.0
    max_pending_batches: int = 1024
    recent_window_s: float = DEFAULT_RECENT_WINDOW_S
    recent_decode_ratio: float = DEFAULT_RECENT_DECODE_RATIO

    def __post_init__(self) -> None:
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"block_size must be >= 1 or None, got {self.block_size}")
        if not self.recent_window_s > 0:
            raise ValueError(f"recent_window_s must be > 0, got {self.recent_window_s}")
        for name in ("predicted_ttl_s", "approx_ttl_s", "recent_decode_ratio"):
            if not getattr(self, name) >= 0:  # NaN too
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """A request to place. ``token_ids``: the prompt (1-D integer array or list of ints).

    ``exclude``: worker ids not to use (e.g. the one a retry is moving away from).
    ``prompt_tokens``: the whole prompt's length when ``token_ids`` is only its routable
    prefix (the router's front end stops tokenizing a text prompt where no cache can match
    it any more, and the worker tokenizes the rest); None: ``len(token_ids)``. It is what
    the cost charges as new prefill and what is accounted in flight.
    """

    request_id: str
    token_ids: np.ndarray | Sequence[int]
    partition: Partition = DEFAULT_PARTITION
    exclude: frozenset[str] = frozenset()
    prompt_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """Where a request goes and what the router expects to find cached there."""

    request_id: str
    worker_id: str
    address: str
    prompt_tokens: int
    matched_tokens: int
    cost: float  # the policy's cost for the chosen worker (0.0 without a cost model)
    policy: str
    # the longest match on any worker route() could have picked (>= matched_tokens); the
    # difference is cache the policy left on the table for load reasons (metrics)
    best_matched_tokens: int = 0
    # of matched_tokens, those the worker's own KV events confirm (the rest: predictions)
    event_matched_tokens: int = 0


@dataclass(frozen=True, slots=True)
class WorkerScore:
    """One worker's line in an explanation (mirrors the WorkerScore proto message)."""

    worker_id: str
    address: str
    healthy: bool
    matched_tokens: int
    inflight_prefill_tokens: int
    num_active_requests: int
    cost: float | None  # None: unhealthy/excluded, or a policy without a cost (round_robin)
    load: LoadReport | None
    recent_prefill_tokens: float = 0.0  # decayed sum of prefill tokens routed there
    # matched_tokens by source: confirmed by the worker's KV events, and predicted from the
    # requests the router sent there lately (matched_tokens is at least the larger of both)
    event_matched_tokens: int = 0
    predicted_matched_tokens: int = 0
    # empty for a candidate; else why route() would not pick it ("unhealthy", "excluded by
    # the request"); the shell adds what only it knows (the last error, an ejection)
    not_candidate_reason: str = ""
    # requests a new one would wait behind for a running slot (the cost's slot-wait term)
    slot_queue: int = 0


@dataclass(frozen=True, slots=True)
class Explanation:
    """What route() would do for a request, per worker (mirrors ExplainResponse)."""

    policy: str
    prompt_tokens: int
    chosen_worker_id: str | None  # None when no worker is available
    workers: tuple[WorkerScore, ...]
    # what a miss's tokens count in every candidate's cost (Policy.miss_factor; 0: no such
    # factor in the policy's cost)
    miss_factor: float = 0.0


@dataclass(frozen=True, slots=True)
class Resubscribe:
    """Action for the shell: re-subscribe to ``worker_id``'s KV event stream.

    Send SubscribeRequest(epoch=epoch, after_seq=after_seq); epoch 0 asks for a snapshot.
    """

    worker_id: str
    epoch: int
    after_seq: int
    reason: str


Action = Resubscribe


@dataclass(frozen=True, slots=True)
class RouterStats:
    """Counters and gauges for metrics and tests."""

    num_workers: int
    num_healthy: int
    num_indexed_blocks: int
    num_index_entries: int
    num_predicted_entries: int
    num_inflight_requests: int
    num_routed: int
    apply_errors: dict[str, int]
    sync_counters: dict[str, int]
    num_evicted_blocks: int = 0  # confirmed blocks dropped by the index's size cap
    index_bytes: int = 0  # estimate of the index's memory (PrefixIndex.approx_bytes)
    # replica sync: requests other router replicas placed and this router counts in flight
    num_replica_inflight: int = 0


@dataclass(frozen=True, slots=True)
class WorkerStats:
    """One worker as the router core sees it (metrics, ``kvroute status``).

    ``seconds_since_message``: how long ago (router clock) its event stream last delivered
    a message (None before the first); the worker sends a load report at a steady interval,
    so this stays near that interval while the stream is live (the event lag).
    ``sync_counters``: its stream's sequencing outcomes (router.core.sync: applied, duplicate,
    out_of_order, new_epoch, ...).
    """

    worker_id: str
    address: str
    healthy: bool
    num_active_requests: int
    inflight_prefill_tokens: int
    num_indexed_blocks: int
    epoch: int
    last_seq: int
    seconds_since_message: float | None
    sync_counters: dict[str, int]
    load: LoadReport | None
    max_running: int = 0  # the cap on running requests it stated in GetLoad (0: none)


# ---- replica sync: what one router replica tells the others ---------------------------------


@dataclass(frozen=True, slots=True)
class ReplicaRouted:
    """This router placed ``request_id`` on ``worker_id``: ``prompt_tokens`` long, of which
    it expects ``matched_tokens`` cached there; ``block_hashes``: the prompt's full blocks
    (the router's block size and hash key; empty when it did not hash them); ``model``: the
    pool it was routed in (router.core.pools; empty: the router's default one)."""

    request_id: str
    worker_id: str
    prompt_tokens: int
    matched_tokens: int
    block_hashes: Sequence[int] | np.ndarray = ()
    model: str = ""


@dataclass(frozen=True, slots=True)
class ReplicaFirstToken:
    """The worker produced the first token of ``request_id`` (its prefill is done)."""

    request_id: str


@dataclass(frozen=True, slots=True)
class ReplicaFinished:
    """``request_id`` ended (finished, aborted or failed) after ``generated_tokens``."""

    request_id: str
    generated_tokens: int = 0


ReplicaEvent = ReplicaRouted | ReplicaFirstToken | ReplicaFinished
