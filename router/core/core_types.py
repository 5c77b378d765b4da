"""Value types of the router core's API: config, request, decision, explanation, actions.

Plain frozen dataclasses, no logic; ``router.core.router_core`` re-exports every name here. Imports
neither asyncio, grpc, torch nor a clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvroute_proto.events import DEFAULT_PARTITION, LoadReport, Partition
from router.core.policy import (
    DEFAULT_BACKLOG_TOKENS,
    DEFAULT_SATURATED_SCALE_TOKENS,
    DEFAULT_SATURATED_TOKENS,
    CostWeights,
)

__all__ = [
    "DEFAULT_RECENT_DECODE_RATIO",
    "DEFAULT_RECENT_WINDOW_S",
    "Action",
    "Explanation",
    "Resubscribe",
    "RouteDecision",
    "RouteRequest",
    "RouterConfig",
    "RouterStats",
    "WorkerScore",
    "WorkerStats",
]


DEFAULT_RECENT_WINDOW_S = 30.0  # decay time constant of each worker's recent prefill
DEFAULT_RECENT_DECODE_RATIO = 0.5  # recent-sum tokens per generated token of a finished request
# RouterConfig.replica_cold_picks: first chosen (2.5) on cold-bursts seeds 200-204 at 4, 8
# and 16 workers, before the peer view and the sync window were defaults; re-chosen with
# today's defaults on those seeds and on cold-bursts seeds 400-404 of 32-request bursts on
# 3,000-token prefixes (four routers, 1 ms sync): 2.5 and 2.25
# spread each burst over one worker more than one router does (up to -2.0 points of hit
# rate at 16 workers, four routers), 1.75 herds (TTFT p99 +10.8%), 2.0 is within on all 30
# (BENCHMARKS.md, "A cold pick counts at most twice"). Two routers never reach the cap.
DEFAULT_REPLICA_COLD_PICKS = 2.0
# RouterConfig.replica_cold_window_picks: chosen on cold-bursts seeds 200-204 at 4, 8 and 16
# workers, four routers, in three settings (--strict with a 0.5 ms and with a 5 ms sync, the
# plain sim); reported on other seeds (BENCHMARKS.md, "A cold pick's count that follows the
# sync's pace")
DEFAULT_REPLICA_COLD_WINDOW_PICKS = 3
# how long the most own picks one sync window held is remembered (RouterCore): between one
# and two of these
REPLICA_WINDOW_PICKS_PERIOD_S = 60.0
# RouterConfig.replica_affinity_tokens' default for replicas without sync: chosen on
# cold-bursts seeds 200-204 at 4, 8 and 16 workers with two and four routers (rank-graded
# 600-1,500 and top-k variants tried; BENCHMARKS.md, the replicas' shared order)
DEFAULT_REPLICA_AFFINITY_TOKENS = 1000.0
# RouterConfig.replica_sync_window_s None (auto): the window follows the sync's measured
# delivery time (RouterCore.observe_replica_sync_delay; the replay sim: its sync delay);
# this is where it starts before the first measurement. Chosen on cold-bursts seeds
# 200-204 with the --strict sim (BENCHMARKS.md, "Replica sync and the router's decision
# time"): a window short of the delivery time herds, a longer one spreads bursts
INITIAL_REPLICA_SYNC_WINDOW_S = 0.005
# how an auto window follows the measured delays: up at once to a longer one, down by this
# share of the difference per measurement (a sync that was slow lately may be again)
REPLICA_SYNC_WINDOW_DECAY = 0.05


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """Router core settings.

    ``policy``: a name from ``router.core.policy.POLICIES`` (cache_aware, round_robin, random,
    least_load, power_of_two, prefix_hash, approx_tree). ``block_size``: the fleet's block size;
    None lets the first worker that announces one set it. ``max_indexed_blocks``: cap on
    indexed blocks (least recently matched leaves are evicted past it). ``predicted_ttl_s``:
    how long a predicted entry not confirmed by an event lives after its request's first
    token (or end); while the request waits for prefill it is held however long it queues
    (``approx_ttl_s`` instead for the approx_tree policy, which never reads events).
    ``max_pending_batches``: per-worker buffer of out-of-order batches waiting for a gap to
    fill. ``prefix_hash_blocks``: how many leading blocks prefix_hash hashes.
    ``verify_hashes``: recompute stored chains from their tokens (slow; mismatches are
    counted and dropped). ``predict_stride``: predictions keep
    every stride-th block, so a predicted match is a multiple of it (router.core.predicted).
    ``recent_window_s``: time constant of the decay of each worker's recent prefill tokens
    (the cost's balance term; router.core.policy). ``backlog_tokens``: the least loaded worker's
    queued prefill at which the cost counts a miss double (0: off; router.core.policy).
    ``saturated_tokens`` / ``saturated_scale_tokens``: past ``saturated_tokens`` of the
    least loaded worker's queued prefill, every ``saturated_scale_tokens`` more count a miss
    once more (a saturated fleet; scale 0: off; router.core.policy).
    ``recent_decode_ratio``: prefill tokens that one generated token of a finished request
    adds to its worker's recent sum (decode work counts toward the balance term, at half).
    ``replicas``: router replicas sharing the fleet behind one load balancer (each sees only
    its own picks). With R > 1 each pick counts R times in the worker's queued-prefill
    estimate until its first token: the others, seeing the same events and load reports,
    are likely placing the same burst the same way; a load report showing more still wins
    (BENCHMARKS.md, several routers). ``replica_cold_picks``: a cold pick (nothing of its
    prompt cached or predicted on the chosen worker) counts min(R, this) times: the other
    replicas' same-instant picks of that worker would mostly find its prefix there and add
    only their suffixes, so counting it R times spread a burst over every worker.
    ``replica_sync``: the replicas tell each other their picks (``kvroute router
    --replica-sync``). ``replica_peer_view`` (on): with sync, a peer's pick counts the
    tokens uncached by the better of the peer's view and this router's own
    (RouterCore.apply_replica), not the peer's alone: the replicas start a burst on one
    worker in the same instant, each pick cold in its own router's view, and the worker
    computes the prefix once -- exact once the picks have arrived. Off: the peer's view
    alone (the cap below then always applies). ``replica_cold_window_picks``: with sync and
    the peer view, a cold pick counts R times, not capped, while the most of the router's
    own picks found inside their sync window (below) at once stays under this, lately
    (over the last one to two REPLICA_WINDOW_PICKS_PERIOD_S): the sync keeps pace with the
    router and the view is exact again a pick or two later; past it (a slow sync, or
    bursts placed faster than the sync delivers) the cap holds, as without sync, or the
    router would send each next pick of a burst to another worker (BENCHMARKS.md, "A cold
    pick's count that follows the sync's pace"); 0: always capped.
    ``replica_sync_window_s``: with sync, an own pick counts R times (as above) only this
    long after it is placed, then once: by then the other replicas' picks of the same moment
    have arrived through the sync and count themselves, so counting it R times too would
    count the burst twice and spread it over too many workers, while a window shorter than
    the sync's delivery time lets the replicas herd in between. Inside the window a pick
    that found its prefix on the worker stands for the others' in every load term: it also
    counts R running requests, and R times its uncached tokens as recent work; a cold pick
    does not (BENCHMARKS.md, "an own pick that stands for the replicas in every load
    term"). None (default): the sync's
    own measured delivery time (:meth:`RouterCore.observe_replica_sync_delay`),
    INITIAL_REPLICA_SYNC_WINDOW_S until it is measured; inf keeps the R times, in queued
    prefill alone, until the first token (as without sync).
    ``replica_affinity_tokens``: the cost's affinity term
    (router.core.policy), which gives replicas that cannot see each other's picks the same
    order of preference for a new prefix; None (default) is
    DEFAULT_REPLICA_AFFINITY_TOKENS with R > 1 and no sync, else 0. With one router it is
    always off (:attr:`affinity_tokens`).
    ``index_backend``: the prefix index's implementation, "numba" (router.core.index_nb:
    compiled kernels over flat tables; the default) or "dict" (router.core.index: pure Python,
    the reference implementation; same answers).
    """

    policy: str = "cache_aware"
    weights: CostWeights = field(default_factory=CostWeights)
    block_size: int | None = None
    max_indexed_blocks: int = 4_000_000
    predicted_ttl_s: float = 5.0
    approx_ttl_s: float = 120.0
    max_pending_batches: int = 1024
    prefix_hash_blocks: int = 4
    verify_hashes: bool = False
    predict_stride: int = 4
    recent_window_s: float = DEFAULT_RECENT_WINDOW_S
    backlog_tokens: float = DEFAULT_BACKLOG_TOKENS
    saturated_tokens: float = DEFAULT_SATURATED_TOKENS
    saturated_scale_tokens: float = DEFAULT_SATURATED_SCALE_TOKENS
    recent_decode_ratio: float = DEFAULT_RECENT_DECODE_RATIO
    replicas: int = 1
    replica_cold_picks: float = DEFAULT_REPLICA_COLD_PICKS
    replica_sync: bool = False
    replica_sync_window_s: float | None = None
    replica_peer_view: bool = True
    replica_cold_window_picks: int = DEFAULT_REPLICA_COLD_WINDOW_PICKS
    replica_affinity_tokens: float | None = None
    index_backend: str = "numba"
    spread_weight: float = 0.0  # the cost's spread term (router.core.policy; 0: off)

    def __post_init__(self) -> None:
        if self.index_backend not in ("dict", "numba"):
            raise ValueError(f"index_backend must be dict or numba, got {self.index_backend!r}")
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if not 1 <= self.replica_cold_picks < float("inf"):  # NaN too
            raise ValueError(
                f"replica_cold_picks must be finite and >= 1, got {self.replica_cold_picks}"
            )
        if self.replica_cold_window_picks < 0:
            raise ValueError(
                f"replica_cold_window_picks must be >= 0, got {self.replica_cold_window_picks}"
            )
        window = self.replica_sync_window_s
        if window is not None and not window >= 0:  # NaN too; inf allowed
            raise ValueError(f"replica_sync_window_s must be >= 0 or None, got {window}")
        if not 0 <= self.spread_weight < float("inf"):  # NaN too
            raise ValueError(f"spread_weight must be finite and >= 0, got {self.spread_weight}")
        affinity = self.replica_affinity_tokens
        if affinity is not None and not 0 <= affinity < float("inf"):  # NaN too
            raise ValueError(
                f"replica_affinity_tokens must be finite and >= 0 or None, got {affinity}"
            )
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"block_size must be >= 1 or None, got {self.block_size}")
        if not self.recent_window_s > 0:
            raise ValueError(f"recent_window_s must be > 0, got {self.recent_window_s}")
        for name in ("predicted_ttl_s", "approx_ttl_s", "backlog_tokens", "recent_decode_ratio"):
            if not getattr(self, name) >= 0:  # NaN too
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("saturated_tokens", "saturated_scale_tokens"):
            if not 0 <= getattr(self, name) < float("inf"):  # NaN too
                raise ValueError(f"{name} must be finite and >= 0, got {getattr(self, name)}")
        if self.max_indexed_blocks < 1:
            raise ValueError(f"max_indexed_blocks must be >= 1, got {self.max_indexed_blocks}")

    @property
    def affinity_tokens(self) -> float:
        """The affinity term's weight the policy gets: 0 with one router; else
        ``replica_affinity_tokens``, or its default when None (on without sync)."""
        if self.replicas < 2:
            return 0.0
        if self.replica_affinity_tokens is not None:
            return self.replica_affinity_tokens
        return 0.0 if self.replica_sync else DEFAULT_REPLICA_AFFINITY_TOKENS


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
    (the router's block size and hash key; empty when it did not hash them)."""

    request_id: str
    worker_id: str
    prompt_tokens: int
    matched_tokens: int
    block_hashes: Sequence[int] | np.ndarray = ()


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
