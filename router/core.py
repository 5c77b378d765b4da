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

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvroute_proto.events import DEFAULT_PARTITION, EventBatch, LoadReport, Partition, Snapshot
from router.errors import (  # re-exported for the shells
    BlockSizeMismatchError,
    DuplicateWorkerError,
    InvalidRouteRequestError,
    NoWorkerAvailable,
    UnknownWorkerError,
)

__all__ = [
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
]


@dataclass(frozen=True, slots=True)
class CostWeights:
    """Weights of the cache-aware cost (all in prefill-token equivalents).

    cost(worker) = prefill * (prompt_tokens - matched_tokens)
                 + queued_prefill * queued prefill tokens on the worker
                 + decode * requests decoding on the worker
    """

    prefill: float = 1.0
    queued_prefill: float = 1.0
    decode: float = 16.0


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """Router core settings.

    ``policy``: a name from ``router.policy.POLICIES`` (cache_aware, round_robin, random,
    least_load, power_of_two, prefix_hash, approx_tree). ``block_size``: the fleet's block size;
    None lets the first worker that announces one set it. ``max_indexed_blocks``: cap on
    indexed blocks (least recently matched leaves are evicted past it). ``predicted_ttl_s``:
    lifetime of a predicted entry not yet confirmed by an event (``approx_ttl_s`` instead for
    the approx_tree policy, which never reads events). ``max_pending_batches``: per-worker
    buffer of out-of-order batches waiting for a gap to fill. ``prefix_hash_blocks``: how many
    leading blocks prefix_hash hashes.
    """

    policy: str = "cache_aware"
    weights: CostWeights = field(default_factory=CostWeights)
    block_size: int | None = None
    max_indexed_blocks: int = 4_000_000
    predicted_ttl_s: float = 5.0
    approx_ttl_s: float = 120.0
    max_pending_batches: int = 1024
    prefix_hash_blocks: int = 4


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """A request to place. ``token_ids``: the prompt (1-D integer array or list of ints).

    ``exclude``: worker ids not to use (e.g. the one a retry is moving away from).
    """

    request_id: str
    token_ids: np.ndarray | Sequence[int]
    partition: Partition = DEFAULT_PARTITION
    exclude: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """Where a request goes and what the router expects to find cached there."""

    request_id: str
    worker_id: str
    address: str
    prompt_tokens: int
    matched_tokens: int
    cost: float
    policy: str


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


@dataclass(frozen=True, slots=True)
class Explanation:
    """What route() would do for a request, per worker (mirrors ExplainResponse)."""

    policy: str
    prompt_tokens: int
    chosen_worker_id: str | None  # None when no worker is available
    workers: tuple[WorkerScore, ...]


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
        raise NotImplementedError

    # ---- fleet membership ----------------------------------------------------------------

    @property
    def block_size(self) -> int | None:
        """The fleet block size (None until the first worker announced one)."""
        raise NotImplementedError

    @property
    def policy_name(self) -> str:
        raise NotImplementedError

    def add_worker(self, worker_id: str, address: str = "", block_size: int | None = None) -> None:
        """Register a worker (healthy, nothing indexed, not yet subscribed).

        Raises DuplicateWorkerError if known, BlockSizeMismatchError if ``block_size``
        differs from the fleet's.
        """
        raise NotImplementedError

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker: its index entries, stream state and in-flight accounting."""
        raise NotImplementedError

    def set_health(self, worker_id: str, healthy: bool) -> None:
        """Unhealthy workers keep their index entries but are never routed to."""
        raise NotImplementedError

    def workers(self) -> list[str]:
        """Registered worker ids, in registration order."""
        raise NotImplementedError

    def has_worker(self, worker_id: str) -> bool:
        raise NotImplementedError

    # ---- KV event streams ----------------------------------------------------------------

    def expected_subscription(self, worker_id: str) -> tuple[int, int]:
        """(epoch, after_seq) to (re)subscribe with; (0, 0) when nothing was synced yet.

        Call it whenever a stream (re)starts, whatever the reason.
        """
        raise NotImplementedError

    def on_stream_message(self, worker_id: str, msg: EventBatch | Snapshot) -> list[Action]:
        """Feed one message of a worker's event stream; returns actions for the shell.

        Duplicates are dropped, gaps buffered until filled (a Resubscribe is returned), a new
        epoch purges the worker, a Snapshot replaces its state. Bad events are counted
        (``stats().apply_errors``), never raised. Raises BlockSizeMismatchError when the
        message's block_size is not the fleet's and UnknownWorkerError for an unknown worker.
        """
        raise NotImplementedError

    # ---- routing -------------------------------------------------------------------------

    def route(self, req: RouteRequest) -> RouteDecision:
        """Pick a worker for ``req`` and account it as in flight there (on_routed).

        The request's full blocks are entered as predicted for the chosen worker, so the
        next request with the same prefix sees them before any event arrives. Raises
        NoWorkerAvailable when no healthy worker outside ``req.exclude`` exists, and
        InvalidRouteRequestError for bad token ids. A request_id still in flight is first
        finished (a retry moves its accounting).
        """
        raise NotImplementedError

    def explain(self, req: RouteRequest) -> Explanation:
        """Per-worker match, load, cost and the pick route() would make; changes nothing
        except the tie-break random stream."""
        raise NotImplementedError

    def on_routed(
        self, request_id: str, worker_id: str, prompt_tokens: int, matched_tokens: int
    ) -> None:
        """Account a request as in flight (route() calls it; the shell needs it only when it
        placed a request itself)."""
        raise NotImplementedError

    def on_first_token(self, request_id: str) -> None:
        """Prefill of ``request_id`` is done: its tokens leave the queued-prefill estimate."""
        raise NotImplementedError

    def on_finished(self, request_id: str) -> None:
        """The request ended (finished, aborted or failed). Unknown ids are ignored."""
        raise NotImplementedError

    # ---- introspection -------------------------------------------------------------------

    def stats(self) -> RouterStats:
        raise NotImplementedError

    def worker_blocks(self, worker_id: str) -> set[int]:
        """The block hashes the index believes ``worker_id`` holds (confirmed by events)."""
        raise NotImplementedError
