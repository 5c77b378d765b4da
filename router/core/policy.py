"""Routing policies: score the candidate workers of one request and pick one.

Sans-I/O and pure: imports neither asyncio, grpc, torch nor a clock; randomness comes from
the ``random.Random`` passed to :meth:`Policy.select`, so every pick is reproducible. The
only state a policy keeps is its own (round-robin's cursor).

The default, ``cache_aware``, estimates for each candidate the prefill work the request
would wait for there, in token equivalents::

    cost = w.prefill * b    * (prompt_tokens - cached prefix)     # work this request adds
         + w.queued_prefill * q * (1 + q / (w.queued_knee * prompt_tokens))
                                          # q: work queued there (knee 0: w.queued_prefill * q)
         + w.decode         * requests running on the worker      # decode slows each step
         + w.recent_prefill * recent work on the worker           # its share of the past
         + w.slot_wait      * requests it would queue behind for a running slot

and takes the cheapest; equal costs are broken at random (never "always worker 0"); ``b``
is the backlog factor, 1 unless the whole fleet is queued (below). The
queued term is what spreads a hot prefix: every request routed to the holder adds its own
uncached tokens to the holder's queue until its first token, so a burst soon makes a
cold worker (which pays the whole prefix once, then holds it too) cheaper, while a trickle
whose requests finish prefill before the next arrives stays on the holder.

Queued tokens weigh a quarter of a token by default (``CostWeights``): a worker batches
queued prefills (chunked prefill) and a request queued behind others with the same prefix
reuses their KV, so a queue delays a request less than its own uncached tokens do. With
0.25 a holder keeps a hot prefix until its queue is about four times the prefix it saves
(less past the knee, below); at 1.0 even the second request of a burst with
a new prefix would already tie with a cold worker.

The recent term is the balance between bursts. Below saturation queues are empty most of
the time, so the queued term says nothing, and a short prefix that every request shares (a
512-token system prompt) kept all traffic on the few workers that had seen it while the rest
of the fleet idled (support-agent replay on 16 workers: 6 workers never got a request,
prefill per worker max/mean 2.25). ``recent_prefill`` is the router's count of uncached
tokens it sent to the worker, decaying as exp(-t / window) (``RouterConfig.
recent_window_s``, 30 s): at 0.1 a worker that prefilled 5,120 more tokens in the last
half-minute loses a 512-token prefix advantage, while a conversation whose history of a few
thousand tokens is cached stays where it is until the gap is ten times that. The sum also
counts decode work: each finished request adds half a token per generated token
(``RouterConfig.recent_decode_ratio``). Without it, a worker holding many conversations
looked idle to the balance term (their turns hit the cache) while it ran 20-30 decodes, and
long RAG prefills went there, each chunk waiting on that decode batch (support-agent replay
at 8 workers: TTFT p99 292.4 -> 291.9 ms, ahead of approx_tree on five workload seeds where
it had been behind on four; prefill imbalance 1.01 -> 1.08).

The queued term grows faster than the queue past a knee (``queued_knee``, counted in
prompts like the one being routed; 14 by default, 0 keeps the term linear):
``queued_prefill * q * (1 + q / (queued_knee * prompt_tokens))``. A burst on a cold prefix
queues up on the first worker to compute the prefix; with a linear term each queued token
costs the same, so that worker kept a burst of 32 until its queue was four times the prefix
and two workers took all of it (22/10) while the rest of a 16-worker fleet idled. Past the
knee the next request's share of the queue counts more, so the burst spills to more
workers once the holder holds many requests like it, while a short queue (a burst's second
request, a trickle) costs what it did. The knee is counted in prompts, not tokens: a knee of
32,000 tokens helped bursts of 2,300-token prompts as much, but cost the Mooncake trace
(prompts of 15,000 tokens on average, queues to match) 2 points of hit rate, where 14
prompts cost it 0.2 (BENCHMARKS.md, "A queued term with a knee"). 14 was chosen on the
training workloads (cold-bursts, zipf-tenants and support-agent seeds, the Mooncake trace)
against 8; held out, cold-bursts' TTFT p99 fell from 233-319 to 218-298 ms at 8 workers and
from 226-306 to 215-294 ms at 16 for at most 0.4 points of hit rate, and cache_aware had the
lowest TTFT p99 of all policies on 24 of 39 runs instead of 15.

The slot-wait term prices a worker at its engine's running cap (``max_running_requests``,
which the worker states in GetLoad). Past the cap a request waits, with no prefill queued
ahead of it, for a running request to finish; the other terms see a few thousand tokens of
decode and a small queue, so a hot tenant's cached prefix kept winning while requests
waited seconds for a decode slot (zipf-tenants at 4 workers, BENCHMARKS.md). Each request
a new one would wait behind -- ``running + waiting + 1 - cap`` when positive -- costs
``slot_wait`` token equivalents; a worker that does not state its cap pays nothing.

The backlog factor is for a saturated fleet. When every candidate has prefill queued, the
fleet is compute-bound: the tokens a miss adds are work that queued requests wait behind,
and going elsewhere no longer puts an idle worker to use. The prefill term is then
multiplied by ``1 + (smallest queued prefill among the candidates) / backlog_tokens``
(``PolicyConfig.backlog_tokens``, 50,000 by default, about 2 s of prefill of an 8B model on
an H100): a fleet whose least loaded worker has 50k tokens queued counts a miss double.
Below saturation some worker is idle at nearly every decision and the factor is 1. (Mooncake
replay on 4 saturated workers: from 92.6% to 95.5% of the pooled reference hit rate and TTFT
p99 from 17.8 s to 15.8 s; support-agent at 4 workers, queued in bursts: TTFT p99 344 ->
354 ms; the 8- and 16-worker runs barely change. BENCHMARKS.md.)

A queue that every worker keeps is a saturated fleet, and there the factor grows steeply:
past ``saturated_tokens`` (10,000, about 0.45 s of prefill) of queued prefill on the least
loaded candidate, every further ``saturated_scale_tokens`` (2,000) counts a miss once more:
``1 + floor / backlog_tokens + max(0, floor - saturated_tokens) / saturated_scale_tokens``.
The linear factor alone was weak there (1.4 at a 20,000-token floor), so in a sustained
overload hot prefixes still spread and every copy evicted something (Mooncake replay on 4
workers with 400k KV tokens each: 92.1% of the pooled reference, where sglang's gateway
policy, which keeps a request on its longest match regardless of load, reached 103%). A burst's
queue is short-lived and rarely puts 10,000 tokens in front of every worker, so below
that nothing changes (chosen on the training workloads: the Mooncake trace at 4 workers,
400k KV tokens, +0.4 points of hit rate, TTFT p99 -10%, p50 -28%; no cold-bursts,
zipf-tenants or support-agent training run moved; a floor of 5,000 gained 0.3 point more
on Mooncake but moved a zipf-tenants run and, held out, put support-agent's TTFT p99 up 8%
at 4 workers. BENCHMARKS.md, "A saturated fleet").

The spread term is off by default (``PolicyConfig.spread_weight`` 0). A request whose
longest match covers at least half of its prompt, held whole by two or more workers, starts
something that sticks where it lands -- a conversation's first turn on a shared system
prompt: its later turns follow their cached history. Such a request then pays
``spread_weight`` per running request on each candidate, so new conversations go to the
workers with the fewest decodes instead of piling onto the first holders of their prompt.
It trades one target for another (support-agent replay at 16 workers, BENCHMARKS.md): at
1,000 busy-time imbalance 1.43 -> 1.05 and e2e p99 -21%, but TTFT p99 +8%, because keeping
the decode-heavy conversations on a few workers leaves the others free to prefill
It also does harm where shared starts are not conversations: zipf-tenants at 4 workers
TTFT p99 296 -> 808 ms, cold-bursts at 16 workers 9 points of hit rate lost. Opt-in
(``kvroute router --spread-weight``), for conversation-heavy fleets.

The affinity term is for router replicas that cannot see each other's picks (``kvroute
router --replicas R`` without ``--replica-sync``; off otherwise: ``PolicyConfig.
affinity_tokens`` 0). Each replica sees only its own picks, so the first requests of a new
prefix, arriving at several replicas in the same instant, went to as many different workers
(cold-bursts, four routers, 16 workers: 5-6 points of hit rate lost against one router).
The term gives every replica the same order of preference among the workers that lack the
request's next block: a candidate whose match is shorter than the longest (every candidate,
when nothing matches) pays ``affinity_tokens * rank / (m - 1)``, where its rank among the
``m`` candidates of the same match length comes from a hash of the first block it lacks and
of its worker id (rendezvous hashing: the same on every replica, different per prefix). So
the replicas start a new prefix on the same worker and spill it, once that worker's queue
outweighs its saving, to the same next ones; the load terms still decide how far each goes.
In a group of more than 64 candidates the rank is replaced by the hash's own place in
[0, 2**64) (``affinity_tokens * (1 - hash / 2**64)``: no sort per route at 1,024 workers; with
that many the two spread alike, while in small groups even steps did better than hash gaps).
(BENCHMARKS.md, "The replicas' shared order": chosen at 1,000 on cold-bursts seeds 200-204.)

Baselines share the interface: round_robin, random, least_load, power_of_two, and
approx_tree (cache_aware over the router's own routing history only: the core gives it
matches from predicted entries and never applies events for it -- SGLang's approximate
tree mode). The peers' own algorithms -- sglang, dynamo, llm_d, aibrix and
consistent_hash (bounded-load consistent hashing of a prefix, which replaced prefix_hash;
the old name is an alias) -- live in router.core.peer_policies, each citing the source it
follows.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from hashlib import blake2b
from operator import attrgetter

import numpy as np

from kvroute_proto.events import LoadReport

__all__ = [
    "ALIASES",
    "COST_WEIGHTS_FORM",
    "DEFAULT_BACKLOG_TOKENS",
    "DEFAULT_SATURATED_SCALE_TOKENS",
    "DEFAULT_SATURATED_TOKENS",
    "POLICIES",
    "SLOT_WAIT_TOKENS",
    "CandidateSet",
    "CostWeights",
    "Policy",
    "PolicyConfig",
    "RouteQuery",
    "WorkerTable",
    "WorkerView",
    "affinity_terms",
    "make_policy",
    "policy_names",
    "worker_id_hash",
]


SLOT_WAIT_TOKENS = 1024.0  # CostWeights.slot_wait's default; BENCHMARKS.md, "The slot wait"
# PolicyConfig.saturated_tokens / saturated_scale_tokens; BENCHMARKS.md, "A saturated fleet"
DEFAULT_SATURATED_TOKENS = 10_000.0
DEFAULT_SATURATED_SCALE_TOKENS = 2_000.0
QUEUED_KNEE_PROMPTS = 14.0  # CostWeights.queued_knee's default; BENCHMARKS.md, "knee"
# the --cost-weights option's form (CostWeights.parse), shown by every command that takes it
COST_WEIGHTS_FORM = "PREFILL,QUEUED,DECODE[,RECENT[,SLOT_WAIT[,KNEE]]]"
MIN_QUEUED_KNEE = 1e-3  # a knee below a thousandth of a prompt means nothing (and overflows)


@dataclass(frozen=True, slots=True)
class CostWeights:
    """Weights of the cache-aware cost (all in prefill-token equivalents).

    cost(worker) = prefill * (prompt_tokens - matched_tokens)
                 + queued_prefill * queued prefill tokens on the worker
                 + decode * requests running on the worker
                 + recent_prefill * work routed there lately (decayed: uncached prompt
                                    tokens, plus recent_decode_ratio per generated token)
                 + slot_wait * requests ahead of it for a running slot past the
                               worker's max_running_requests (0 if it states none)

    where the queued term is ``queued_prefill * q * (1 + q / (queued_knee * prompt))`` for
    ``q`` queued tokens and a request of ``prompt`` tokens: the knee is counted in prompts
    like the one routed (linear when ``queued_knee`` is 0; the module docstring says why).

    Defaults chosen by trace replay (BENCHMARKS.md): a queued token weighs a quarter of a
    token to prefill here, because a miss costs more than this request's wait -- it spends
    fleet compute and writes a duplicate copy that evicts other prefixes. At 1.0 a burst with
    a new shared prefix did not follow its first request; at 0.5 the Mooncake trace on 8
    workers reached 94% of the pooled reference hit rate with load imbalance 1.12; at 0.25, 96%
    and 1.04. ``recent_prefill`` 0.1 took the support-agent workload's imbalance from
    1.29-2.25 to 1.01-1.07 at 4-16 workers at under a point of hit rate; 0.25 cost more hit
    rate on the overloaded 4-worker runs and TTFT p99 at 8 workers.
    """

    prefill: float = 1.0
    queued_prefill: float = 0.25
    decode: float = 16.0
    recent_prefill: float = 0.1
    slot_wait: float = SLOT_WAIT_TOKENS
    queued_knee: float = QUEUED_KNEE_PROMPTS

    def __post_init__(self) -> None:
        for name in (
            "prefill",
            "queued_prefill",
            "decode",
            "recent_prefill",
            "slot_wait",
            "queued_knee",
        ):
            if not getattr(self, name) >= 0:  # NaN too
                raise ValueError(f"CostWeights.{name} must be >= 0, got {getattr(self, name)}")
        knee = self.queued_knee
        if knee and not MIN_QUEUED_KNEE <= knee < math.inf:
            raise ValueError(
                f"CostWeights.queued_knee must be 0 (off) or a finite number of prompts >= "
                f"{MIN_QUEUED_KNEE:g}, got {knee}"
            )

    def per_knee(self, prompt_tokens: int) -> float:
        """``1 / (queued_knee * prompt_tokens)`` (a prompt of at least one token), the
        queued term's knee for one request; 0 when the term is linear (``queued_knee`` 0)."""
        knee = self.queued_knee
        return 1.0 / (knee * max(prompt_tokens, 1)) if knee else 0.0

    @classmethod
    def parse(cls, text: str) -> CostWeights:
        """``COST_WEIGHTS_FORM``, the form of the ``--cost-weights`` option of ``kvroute
        router`` and ``kvroute replay`` (missing ones keep their defaults); ValueError naming
        the option and the expected form otherwise."""
        parts = text.split(",")
        try:
            if not 3 <= len(parts) <= 6:
                raise ValueError
            values = [float(x) for x in parts]
        except ValueError:
            raise ValueError(
                "--cost-weights: cost weights must be three to six numbers "
                f"{COST_WEIGHTS_FORM}, got {text!r}"
            ) from None
        return cls(*values)


DEFAULT_BACKLOG_TOKENS = 50_000.0


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """Settings shared by the policies (each reads what it needs).

    ``backlog_tokens``: the cost's backlog factor (module docstring): the smallest queued
    prefill among the candidates at which a miss counts double; 0 turns the factor off.
    ``saturated_tokens`` / ``saturated_scale_tokens``: its steep part for a saturated fleet
    (module docstring): past ``saturated_tokens`` of that smallest queue, every further
    ``saturated_scale_tokens`` counts a miss once more; a scale of 0 turns it off.
    ``spread_weight``: the cost's spread term (module docstring), token equivalents per
    running request for a request that starts something sticky; 0 (default) turns it off.
    ``affinity_tokens``: the affinity term's largest value (module docstring), for router
    replicas without sync; 0 (default) turns it off.
    """

    weights: CostWeights = field(default_factory=CostWeights)
    prefix_hash_blocks: int = 4
    backlog_tokens: float = DEFAULT_BACKLOG_TOKENS
    spread_weight: float = 0.0
    affinity_tokens: float = 0.0
    saturated_tokens: float = DEFAULT_SATURATED_TOKENS
    saturated_scale_tokens: float = DEFAULT_SATURATED_SCALE_TOKENS

    def __post_init__(self) -> None:
        if self.prefix_hash_blocks < 1:
            raise ValueError(f"prefix_hash_blocks must be >= 1, got {self.prefix_hash_blocks}")
        if not self.backlog_tokens >= 0:  # NaN too
            raise ValueError(f"backlog_tokens must be >= 0, got {self.backlog_tokens}")
        if not 0 <= self.spread_weight < math.inf:  # NaN too
            raise ValueError(f"spread_weight must be finite and >= 0, got {self.spread_weight}")
        if not 0 <= self.affinity_tokens < math.inf:  # NaN too
            raise ValueError(f"affinity_tokens must be finite and >= 0, got {self.affinity_tokens}")
        for name in ("saturated_tokens", "saturated_scale_tokens"):
            if not 0 <= getattr(self, name) < math.inf:  # NaN too
                raise ValueError(f"{name} must be finite and >= 0, got {getattr(self, name)}")


class WorkerView:
    """What the router knows about one worker (mutable; the core owns and updates it).

    ``inflight_prefill_tokens``: uncached prompt tokens of requests routed here that have not
    produced their first token (router-tracked). ``num_active``: requests routed here and
    not finished. ``load``: the worker's last load report, if any. ``id_hash``: a 64-bit
    hash of ``worker_id``, the same in every process (the affinity term's). The two derived
    fields below are what policies read; :meth:`refresh` recomputes them after any change (kept as
    plain values because scoring 64 workers per request must not compute them):

    ``queued_prefill_tokens``: the router's count, or the worker's report if larger (it also
    sees other routers' requests; ours may not have reached it yet). ``num_running``:
    likewise for requests (running + waiting on the worker). ``slot_queue``: how many of
    those a new request would wait behind for a running slot, ``num_running + 1 -
    max_running`` when positive (``max_running``: the worker's stated cap, 0 if none; then
    0). ``recent_prefill``: prefill
    tokens routed here (and decode work of finished requests), decayed, times the core's
    current scale factor (policies multiply by
    ``RouteQuery.recent_scale`` to get tokens; see ``RouterCore._recent_scale``).

    A view the core registered is attached to its :class:`WorkerTable`: every change of the
    four cost fields (by :meth:`refresh` or by assignment) is also written there, where the
    cache-aware cost reads them for all candidates at once.
    """

    __slots__ = (
        "_cap",
        "_queued",
        "_recent",
        "_running",
        "_table",
        "address",
        "healthy",
        "id_hash",
        "inflight_prefill_tokens",
        "load",
        "num_active",
        "slot",
        "worker_id",
    )

    def __init__(
        self,
        worker_id: str,
        slot: int,
        address: str = "",
        healthy: bool = True,
        inflight_prefill_tokens: int = 0,
        num_active: int = 0,
        load: LoadReport | None = None,
        queued_prefill_tokens: int = 0,
        num_running: int = 0,
        recent_prefill: float = 0.0,
        max_running: int = 0,
    ) -> None:
        self.worker_id = worker_id
        self.id_hash = worker_id_hash(worker_id)
        self.slot = slot
        self.address = address
        self.healthy = healthy
        self.inflight_prefill_tokens = inflight_prefill_tokens
        self.num_active = num_active
        self.load = load
        self._queued = queued_prefill_tokens
        self._running = num_running
        self._recent = recent_prefill
        self._cap = max_running
        self._table: WorkerTable | None = None

    def __repr__(self) -> str:
        return (
            f"WorkerView(worker_id={self.worker_id!r}, slot={self.slot!r}, "
            f"address={self.address!r}, healthy={self.healthy!r}, "
            f"inflight_prefill_tokens={self.inflight_prefill_tokens!r}, "
            f"num_active={self.num_active!r}, load={self.load!r}, "
            f"queued_prefill_tokens={self._queued!r}, num_running={self._running!r}, "
            f"recent_prefill={self._recent!r}, max_running={self._cap!r})"
        )

    @property
    def queued_prefill_tokens(self) -> int:
        return self._queued

    @queued_prefill_tokens.setter
    def queued_prefill_tokens(self, value: int) -> None:
        self._queued = value
        if self._table is not None:
            self._table.set_load(self.slot, value, self._running, self.slot_queue)

    @property
    def num_running(self) -> int:
        return self._running

    @num_running.setter
    def num_running(self, value: int) -> None:
        self._running = value
        if self._table is not None:
            self._table.set_load(self.slot, self._queued, value, self.slot_queue)

    @property
    def max_running(self) -> int:
        return self._cap

    @max_running.setter
    def max_running(self, value: int) -> None:
        if value < 0:
            raise ValueError(f"max_running must be >= 0, got {value}")
        self._cap = value
        if self._table is not None:
            self._table.set_load(self.slot, self._queued, self._running, self.slot_queue)

    @property
    def slot_queue(self) -> int:
        cap = self._cap
        return max(self._running + 1 - cap, 0) if cap else 0

    @property
    def recent_prefill(self) -> float:
        return self._recent

    @recent_prefill.setter
    def recent_prefill(self, value: float) -> None:
        self._recent = value
        if self._table is not None:
            self._table.fields[2, self.slot] = value

    def refresh(self) -> None:
        """Recompute the derived fields from the router's counts and the last report."""
        load = self.load
        if load is None:
            queued = self.inflight_prefill_tokens
            running = self.num_active
        else:
            queued = max(self.inflight_prefill_tokens, load.num_queued_prefill_tokens)
            running = max(self.num_active, load.num_running + load.num_waiting)
        self._queued = queued
        self._running = running
        if self._table is not None:
            self._table.set_load(self.slot, queued, running, self.slot_queue)


class WorkerTable:
    """The cache-aware cost's inputs for every attached view, by worker slot: ``fields``
    rows 0, 1, 2 and 4 hold each slot's ``queued_prefill_tokens``, ``num_running``,
    ``recent_prefill`` and ``slot_queue`` as float64 (the values the cost's float arithmetic
    converts them to), row 3 the cost's load part under ``weights``, ``queued_prefill *
    queued + decode * running + slot_wait * slot_queue`` (the knee, which depends on the
    request, is added per route), computed in Python as :meth:`CacheAware.costs` computes
    it; kept current by the views themselves. ``ids``: each slot's ``WorkerView.id_hash``."""

    __slots__ = ("_wc", "_wd", "_wq", "fields", "ids", "weights")

    def __init__(self, capacity: int = 64, weights: CostWeights | None = None) -> None:
        self.fields = np.zeros((5, max(capacity, 1)))
        self.ids = np.zeros(self.fields.shape[1], dtype=np.uint64)
        self.weights = weights = weights or CostWeights()
        self._wq, self._wd, self._wc = weights.queued_prefill, weights.decode, weights.slot_wait

    def set_load(self, slot: int, queued: int, running: int, slot_queue: int = 0) -> None:
        fields = self.fields
        fields[0, slot] = queued
        fields[1, slot] = running
        fields[4, slot] = slot_queue
        fields[3, slot] = self._wq * queued + self._wd * running + self._wc * slot_queue

    def attach(self, view: WorkerView) -> None:
        """Keep ``view``'s cost fields here from now on (its slot's column is overwritten)."""
        slot = view.slot
        capacity = self.fields.shape[1]
        if slot >= capacity:
            grown = np.zeros((5, max(2 * capacity, slot + 1)))
            grown[:, :capacity] = self.fields
            self.fields = grown
            ids = np.zeros(grown.shape[1], dtype=np.uint64)
            ids[:capacity] = self.ids
            self.ids = ids
        self.ids[slot] = view.id_hash
        view._table = self
        self.fields[2, slot] = view._recent
        self.set_load(slot, view._queued, view._running, view.slot_queue)

    @staticmethod
    def detach(view: WorkerView) -> None:
        """Stop writing ``view``'s fields here (its worker left; the slot may be reused)."""
        view._table = None


@dataclass(slots=True)
class CandidateSet:
    """Candidates of a route as the core hands them to :meth:`Policy.select_set`:
    ``views`` (what :meth:`Policy.select` takes), ``table`` holding their cost fields,
    ``columns`` (their slots in ``table.fields``, in ``views`` order: a slice when the slots
    run 0, 1, ... in order) and ``position`` (slot -> index into ``views``)."""

    views: Sequence[WorkerView]
    table: WorkerTable
    columns: slice | np.ndarray
    position: dict[int, int]

    @classmethod
    def of(cls, views: Sequence[WorkerView], table: WorkerTable) -> CandidateSet:
        slots = [v.slot for v in views]
        columns: slice | np.ndarray
        if slots == list(range(len(slots))):
            columns = slice(0, len(slots))
        else:
            columns = np.array(slots, dtype=np.intp)
        return cls(views, table, columns, {s: i for i, s in enumerate(slots)})


@dataclass(frozen=True, slots=True)
class RouteQuery:
    """The request as policies see it. ``block_hashes``: its full blocks' hashes.
    ``recent_scale``: turns a view's stored ``recent_prefill`` into decayed tokens now."""

    request_id: str
    prompt_tokens: int
    block_size: int
    block_hashes: Sequence[int]
    recent_scale: float = 1.0


class Policy:
    """Base class: ``select`` picks an index into ``candidates``.

    ``uses_events``: False for policies that must not see event-fed index entries
    (approx_tree). ``uses_matches``: whether the pick depends on cached prefixes (the core
    then enters predicted entries for each pick). ``has_cost``: whether :meth:`costs`
    returns numbers.
    """

    name = "base"
    uses_events = True
    uses_matches = False
    has_cost = False

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config

    def costs(
        self, query: RouteQuery, candidates: Sequence[WorkerView], matched: dict[int, int]
    ) -> list[float] | None:
        """Per-candidate cost (lower is better), or None for a policy without one.

        ``matched``: matched prefix length in blocks per worker slot (absent = 0).
        """
        return None

    def select(
        self,
        query: RouteQuery,
        candidates: Sequence[WorkerView],
        matched: dict[int, int],
        rng: random.Random,
    ) -> tuple[int, float]:
        """(index into ``candidates``, its cost -- 0.0 without a cost model).

        ``candidates`` is non-empty and holds only healthy, non-excluded workers. The default
        picks the lowest :meth:`costs`, ties at random; policies without costs override it.
        """
        costs = self.costs(query, candidates, matched)
        if costs is None:
            raise NotImplementedError(f"policy {self.name!r} has neither costs nor select")
        i = _argmin_random(costs, rng)
        return i, costs[i]

    def miss_factor(self, candidates: Sequence[WorkerView]) -> float:
        """What one uncached token counts in every candidate's cost now, relative to an idle
        fleet; 0 for a policy whose cost has no such factor (Explain reports it)."""
        return 0.0

    def select_set(
        self,
        query: RouteQuery,
        candidates: CandidateSet,
        matched: dict[int, int],
        rng: random.Random,
    ) -> tuple[int, float]:
        """What :meth:`select` returns for ``candidates.views`` (the core calls this one).
        Policies whose cost reads the :class:`WorkerTable` override it to score every
        candidate at once, with the same pick and the same draws from ``rng``."""
        return self.select(query, candidates.views, matched, rng)


def _argmin_random(values: list[float], rng: random.Random) -> int:
    """Index of the smallest value; equal minima are broken uniformly at random."""
    best = min(values)
    num_ties = values.count(best)
    i = values.index(best)
    for _ in range(rng.randrange(num_ties) if num_ties > 1 else 0):
        i = values.index(best, i + 1)  # the k-th tie, found in C
    return i


_queued = attrgetter("queued_prefill_tokens")


def worker_id_hash(worker_id: str) -> int:
    """A 64-bit hash of a worker id, the same in every process and on every machine (not
    Python's salted ``hash``): the affinity term's worker half."""
    return int.from_bytes(blake2b(worker_id.encode(), digest_size=8).digest(), "little")


_affinity_into: Callable[..., bool] | None = None


def affinity_terms(
    block_hashes: Sequence[int] | np.ndarray, depths: np.ndarray, ids: np.ndarray, tokens: float
) -> np.ndarray | None:
    """The affinity term (module docstring) per candidate, from each candidate's matched
    depth in blocks and worker id hash; None when it is 0 for every candidate. Computed by
    a compiled kernel (router.core.affinity_nb: ~2 µs at 64 candidates, ~25 µs in numpy; its
    test holds a numpy definition it is checked against)."""
    global _affinity_into
    if len(block_hashes) == 0 or len(depths) < 2:
        return None
    if _affinity_into is None:  # numba's compile or cache load: on first use, not at import
        from router.core.affinity_nb import affinity_into

        _affinity_into = affinity_into
    kernel: Callable[..., bool] = _affinity_into
    keys = block_hashes
    if type(keys) is not np.ndarray or keys.dtype != np.uint64:
        keys = np.asarray(keys, dtype=np.uint64)
    out = np.empty(len(depths))
    if not kernel(keys, depths.astype(np.intp, copy=False), ids, float(tokens), out):
        return None
    return out


class CacheAware(Policy):
    """Lowest estimated prefill wait (see the module docstring)."""

    name = "cache_aware"
    uses_matches = True
    has_cost = True

    def __init__(self, config: PolicyConfig) -> None:
        super().__init__(config)
        backlog = config.backlog_tokens
        self._per_backlog = 1.0 / backlog if backlog else 0.0
        scale = config.saturated_scale_tokens
        self._per_saturated = 1.0 / scale if scale else 0.0
        self._saturated = config.saturated_tokens
        w = config.weights
        # an infinite weight times 0 is NaN, where select()'s min() depends on the order:
        # select_set leaves such a configuration to select()
        factors = (
            w.prefill,
            w.queued_prefill,
            w.decode,
            w.recent_prefill,
            w.slot_wait,
            self._per_backlog,
            self._per_saturated,
        )
        self._finite = all(map(math.isfinite, factors))

    def miss_factor(self, candidates: Sequence[WorkerView]) -> float:
        """The backlog factor (module docstring) over ``candidates`` now: 1 while one of
        them has no prefill queued (or the factor is off); the prefill term's factor in
        :meth:`costs` (``select_set`` reads the same floor from the table)."""
        if not (self._per_backlog or self._per_saturated) or not candidates:
            return 1.0
        return self._backlog_factor(min(map(_queued, candidates)))

    def _backlog_factor(self, floor: float) -> float:
        """The prefill term's factor when the least loaded candidate has ``floor`` tokens
        of prefill queued (module docstring: the backlog factor, steep past
        ``saturated_tokens``): 1 unless every candidate has a backlog (``floor`` > 0)."""
        if floor <= 0:
            return 1.0
        factor = 1.0 + floor * self._per_backlog
        over = floor - self._saturated
        if over > 0:
            factor += over * self._per_saturated
        return factor

    def costs(
        self, query: RouteQuery, candidates: Sequence[WorkerView], matched: dict[int, int]
    ) -> list[float]:
        w = self.config.weights
        wp, wq, wd, wc = w.prefill, w.queued_prefill, w.decode, w.slot_wait
        wp *= self.miss_factor(candidates)  # above 1 when every candidate has a backlog
        wr = w.recent_prefill * query.recent_scale
        prompt = query.prompt_tokens
        full = wp * prompt
        if not matched:
            costs = [
                wq * c.queued_prefill_tokens
                + wd * c.num_running
                + wc * c.slot_queue
                + wr * c.recent_prefill
                + full
                for c in candidates
            ]
        else:
            bs = query.block_size
            # the prefill term of the (few) matched workers; everyone else pays ``full``
            get = {s: wp * max(prompt - d * bs, 0) for s, d in matched.items()}.get
            ws = self._spread_weight(query, matched)
            if ws:  # as select_set adds it: after the recent term, before the prefill term
                costs = [
                    wq * c.queued_prefill_tokens
                    + wd * c.num_running
                    + wc * c.slot_queue
                    + wr * c.recent_prefill
                    + ws * c.num_running
                    + get(c.slot, full)
                    for c in candidates
                ]
            else:
                costs = [
                    wq * c.queued_prefill_tokens
                    + wd * c.num_running
                    + wc * c.slot_queue
                    + wr * c.recent_prefill
                    + get(c.slot, full)
                    for c in candidates
                ]
        wqk = wq * w.per_knee(prompt)
        if wqk:  # the knee's part of the queued term, q * (q * wq / knee): as select_set
            costs = [
                x + c.queued_prefill_tokens * (c.queued_prefill_tokens * wqk)
                for x, c in zip(costs, candidates, strict=True)
            ]
        if self.config.affinity_tokens:  # last, as select_set adds it
            depths = np.array([matched.get(c.slot, 0) for c in candidates], dtype=np.intp)
            ids = np.array([c.id_hash for c in candidates], dtype=np.uint64)
            extra = affinity_terms(query.block_hashes, depths, ids, self.config.affinity_tokens)
            if extra is not None:
                costs = [c + e for c, e in zip(costs, extra.tolist(), strict=True)]
        return costs

    def _spread_weight(self, query: RouteQuery, matched: dict[int, int]) -> float:
        """The spread term's weight for this request: ``spread_weight`` when its longest
        match covers at least half of the prompt and two or more workers hold all of it (a
        shared start: a conversation's first turn on a common system prompt), else 0."""
        ws = self.config.spread_weight
        if not ws or len(matched) < 2:
            return 0.0
        depths = list(matched.values())
        top = max(depths)
        if 2 * top * query.block_size < query.prompt_tokens or depths.count(top) < 2:
            return 0.0
        return ws

    def select_set(
        self,
        query: RouteQuery,
        candidates: CandidateSet,
        matched: dict[int, int],
        rng: random.Random,
    ) -> tuple[int, float]:
        """:meth:`costs` and :meth:`select`'s pick, computed over the candidates' columns of
        the table: the same float operations in the same order per candidate (IEEE
        arithmetic, elementwise), so the same costs, ties and draws from ``rng``."""
        if type(self).costs is not CacheAware.costs or not self._finite:
            # a subclass with a cost of its own, or infinite weights
            return self.select(query, candidates.views, matched, rng)
        table = candidates.table
        fields = table.fields[:, candidates.columns]
        w = self.config.weights
        wp = w.prefill
        if self._per_backlog or self._per_saturated:  # as costs(), floor from the table
            wp *= self._backlog_factor(float(fields[0].min()))
        # per candidate, as costs() adds them: ((wq*q + wd*r + wc*s) + wr*recent) + prefill,
        # then the knee and the affinity term
        cost = fields[2] * (w.recent_prefill * query.recent_scale)
        if table.weights is w or table.weights == w:
            cost += fields[3]  # wq*q + wd*r + wc*s, kept by the table
        else:
            load = fields[0] * w.queued_prefill
            load += fields[1] * w.decode
            load += fields[4] * w.slot_wait
            cost += load
        if matched:
            ws = self._spread_weight(query, matched)
            if ws:
                cost += fields[1] * ws
        prompt = query.prompt_tokens
        total = cost + wp * prompt
        affinity = self.config.affinity_tokens
        depths = np.zeros(len(total), dtype=np.intp) if affinity else None
        if matched:
            bs = query.block_size
            position = candidates.position
            if len(matched) <= _FEW_MATCHED:
                item = cost.item
                for s, d in matched.items():
                    i = position.get(s)
                    if i is not None:
                        total[i] = item(i) + wp * max(prompt - d * bs, 0)
                        if depths is not None:
                            depths[i] = d
            else:
                at = [position.get(s, -1) for s in matched]
                terms = [wp * max(prompt - d * bs, 0) for d in matched.values()]
                pos = np.array(at, dtype=np.intp)
                keep = pos >= 0
                pos = pos[keep]
                total[pos] = cost[pos] + np.array(terms)[keep]
                if depths is not None:
                    found = np.fromiter(matched.values(), dtype=np.intp, count=len(matched))
                    depths[pos] = found[keep]
        wqk = w.queued_prefill * w.per_knee(prompt)
        if wqk:  # the knee's part of the queued term, after the prefill term, as costs()
            total += fields[0] * (fields[0] * wqk)
        if depths is not None:
            extra = affinity_terms(
                query.block_hashes, depths, table.ids[candidates.columns], affinity
            )
            if extra is not None:
                total += extra
        i = int(total.argmin())  # the first minimum, as select()'s list.index finds it
        best = total.item(i)
        if best != best:  # NaN (inf * 0 after an overflow): select()'s own order
            return self.select(query, candidates.views, matched, rng)
        ties = total == best
        n = int(np.count_nonzero(ties))
        if n > 1:
            i = int(np.flatnonzero(ties)[rng.randrange(n)])
            best = total.item(i)
        return i, best


_FEW_MATCHED = 16  # up to this many matched workers, their prefill terms are set one by one


class ApproxTree(CacheAware):
    """cache_aware over the router's own routing history only (no KV events)."""

    name = "approx_tree"
    uses_events = False


class RoundRobin(Policy):
    """Each request to the next candidate in turn."""

    name = "round_robin"

    def __init__(self, config: PolicyConfig) -> None:
        super().__init__(config)
        self._cursor = 0

    def select(
        self,
        query: RouteQuery,
        candidates: Sequence[WorkerView],
        matched: dict[int, int],
        rng: random.Random,
    ) -> tuple[int, float]:
        i = self._cursor % len(candidates)
        self._cursor += 1
        return i, 0.0


class RandomPolicy(Policy):
    """Uniformly random candidate."""

    name = "random"

    def select(
        self,
        query: RouteQuery,
        candidates: Sequence[WorkerView],
        matched: dict[int, int],
        rng: random.Random,
    ) -> tuple[int, float]:
        return rng.randrange(len(candidates)), 0.0


def _load(c: WorkerView) -> float:
    return c.queued_prefill_tokens + c.num_running


class LeastLoad(Policy):
    """Fewest queued prefill tokens plus running requests (ties at random)."""

    name = "least_load"
    has_cost = True

    def costs(
        self, query: RouteQuery, candidates: Sequence[WorkerView], matched: dict[int, int]
    ) -> list[float]:
        return [_load(c) for c in candidates]


class PowerOfTwo(Policy):
    """Two distinct random candidates; the less loaded one (ties at random)."""

    name = "power_of_two"

    def select(
        self,
        query: RouteQuery,
        candidates: Sequence[WorkerView],
        matched: dict[int, int],
        rng: random.Random,
    ) -> tuple[int, float]:
        n = len(candidates)
        if n == 1:
            return 0, float(_load(candidates[0]))
        a, b = rng.sample(range(n), 2)
        la, lb = _load(candidates[a]), _load(candidates[b])
        if la == lb:
            return (a if rng.random() < 0.5 else b), float(la)
        i = a if la < lb else b
        return i, float(min(la, lb))


POLICIES: dict[str, Callable[[PolicyConfig], Policy]] = {
    cls.name: cls
    for cls in (CacheAware, RoundRobin, RandomPolicy, LeastLoad, PowerOfTwo, ApproxTree)
}
"""Policy factories by name; router.core.peer_policies adds the peers' algorithms (imported at
the end of this module, since they subclass Policy)."""

ALIASES: dict[str, str] = {"prefix_hash": "consistent_hash"}
"""Old names still accepted by :func:`make_policy` (not listed by :func:`policy_names`, so
``--policy all`` runs each policy once): ``prefix_hash`` was plain rendezvous hashing of the
first blocks, replaced by consistent hashing with bounded loads."""


def policy_names() -> list[str]:
    """Registered policy names, default first."""
    return list(POLICIES)


def make_policy(name: str, config: PolicyConfig | None = None) -> Policy:
    """A new policy instance by name (or alias); ValueError listing the valid names
    otherwise."""
    factory = POLICIES.get(ALIASES.get(name, name))
    if factory is None:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {name!r}")
    return factory(config or PolicyConfig())


# registers sglang, dynamo, llm_d, aibrix and consistent_hash in POLICIES
import router.core.peer_policies  # noqa: E402, F401
