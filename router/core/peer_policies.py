"""The peers' routing algorithms, as baselines in the policy registry.

Each class follows one peer's published source at a stated version (cited in its docstring)
with that peer's defaults, using only what RouterCore gives a policy: the candidates'
:class:`~router.core.views.WorkerView` (router-side in-flight counts, the worker's last
:class:`LoadReport`), the request's :class:`~router.core.views.RouteQuery` and the matched prefix
depth per worker. Where a peer reads a quantity kvroute does not track, the docstring says
what stands in for it. Reading the peers' code to learn their rules is the point; nothing is
copied.

Whether a policy sees the workers' KV events follows the peer's default mode: SGLang's
gateway and AIBrix's default prefix-cache router keep an approximate tree of their own
routing history (``uses_events = False``: the core gives them matches from predicted entries
only, as for ``approx_tree``); Dynamo's KV router and llm-d's precise prefix-cache scorer
consume the engines' KV events (``uses_events = True``).

Sans-I/O and pure like router.core.policy: no asyncio, grpc, torch or clock; randomness only from
the ``random.Random`` passed to ``select``.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from random import Random

from kvroute_proto.hashing import fmix64, partition_seed
from router.core.policy import Policy
from router.core.policy_config import PolicyConfig
from router.core.views import Matched, Pick, RouteQuery, Views, WorkerView

__all__ = ["PEER_POLICIES", "AIBrix", "ConsistentHash", "Dynamo", "LlmD", "SGLang"]


def _matched_tokens(query: RouteQuery, matched: Matched, slot: int) -> int:
    return min(matched.get(slot, 0) * query.block_size, query.prompt_tokens)


def _pick_random(indices: list[int], rng: Random) -> int:
    return indices[rng.randrange(len(indices))] if len(indices) > 1 else indices[0]


def _argmin(values: Sequence[float], rng: Random) -> int:
    best = min(values)
    return _pick_random([i for i, v in enumerate(values) if v == best], rng)


def _kv_usage(view: WorkerView) -> float:
    """Fraction of the worker's KV slots held by running requests (cached-but-evictable
    blocks count as free, as in vLLM's ``gpu_cache_usage``); 0 before the first report."""
    load = view.load
    if load is None or load.num_total_kv_tokens <= 0:
        return 0.0
    used = load.num_total_kv_tokens - load.num_free_kv_tokens - load.num_evictable_kv_tokens
    return min(max(used / load.num_total_kv_tokens, 0.0), 1.0)


class SGLang(Policy):
    """SGLang's gateway ``cache_aware`` policy.

    Follows sgl-project/sglang ``sgl-router/src/policies/cache_aware.rs`` at commit
    026f853ba7ae (the module comment and ``select_worker``), with the router CLI defaults
    ``--cache-threshold 0.3 --balance-abs-threshold 64 --balance-rel-threshold 1.5``:

    1. loads = requests the router has in flight per worker. If ``max - min > 64`` and
       ``max > 1.5 * min`` the fleet is imbalanced: shortest queue (fewest in flight).
    2. Otherwise the worker with the longest prefix match in the router's approximate tree;
       if matched / prompt tokens > 0.3 it takes the request,
    3. else the worker with the smallest tree (most free cache, as the tree sees it).

    Stand-ins: the approximate tree is the core's predicted entries of this policy's own
    picks (``uses_events = False``); they expire ``approx_ttl_s`` after their last use,
    where SGLang evicts LRU leaves only past ``max_tree_size``. The tree size per worker is
    kept here: the tokens each pick inserted (prompt minus its match on the chosen worker),
    never decremented -- SGLang's default max_tree_size (2**26 characters) is never reached
    in a replay -- so a prefix re-sent after its entries expired counts twice. SGLang matches
    characters of the request text; here tokens, at the fleet's block size. Ties (SGLang
    takes the first in its iteration order) are broken at random.
    """

    name = "sglang"
    uses_events = False
    uses_matches = True

    cache_threshold = 0.3
    balance_abs_threshold = 64
    balance_rel_threshold = 1.5

    def __init__(self, config: PolicyConfig) -> None:
        super().__init__(config)
        self.tree_tokens: dict[str, int] = {}  # worker id -> tokens inserted by its picks

    def __copy__(self) -> SGLang:  # explain() consults a copy: it must not grow our trees
        other = SGLang(self.config)
        other.tree_tokens = dict(self.tree_tokens)
        return other

    def select(self, query: RouteQuery, candidates: Views, matched: Matched, rng: Random) -> Pick:
        loads = [c.num_active for c in candidates]
        hi, lo = max(loads), min(loads)
        if hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold:
            i = _argmin(loads, rng)
        else:
            depth = [_matched_tokens(query, matched, c.slot) for c in candidates]
            best = max(depth)
            rate = best / query.prompt_tokens if query.prompt_tokens else 0.0
            if rate > self.cache_threshold:
                i = _pick_random([j for j, d in enumerate(depth) if d == best], rng)
            else:
                i = _argmin([self.tree_tokens.get(c.worker_id, 0) for c in candidates], rng)
        chosen = candidates[i]
        inserted = query.prompt_tokens - _matched_tokens(query, matched, chosen.slot)
        self.tree_tokens[chosen.worker_id] = self.tree_tokens.get(chosen.worker_id, 0) + inserted
        return i, 0.0


class Dynamo(Policy):
    """Dynamo's KV router cost (``DefaultWorkerSelector``), lowest wins.

    Follows ai-dynamo/dynamo ``lib/llm/src/kv_router/scheduler.rs`` (``worker_score``) and
    the active-sequence accounting of ``lib/llm/src/kv_router/sequence.rs``
    (``potential_blocks_and_tokens``), as stored at commit 00564be89016, with its defaults
    ``overlap_score_weight = 1.0`` and ``router_temperature = 0`` (no sampling)::

        logit = overlap_score_weight * prefill_blocks + decode_blocks
        prefill_blocks = (active prefill tokens + prompt tokens - overlap * B) / B
        decode_blocks  = active blocks on the worker + the prompt's blocks not in overlap

    ``active prefill tokens`` is the router's own count of uncached tokens of requests not
    yet past their first token (``inflight_prefill_tokens``, as Dynamo tracks it). Dynamo
    also tracks the blocks of active sequences router-side; kvroute does not, so the worker's
    last load report stands in (KV tokens held by running requests: total - free -
    evictable, divided by B), plus the new blocks of every request this policy sent there
    since that report arrived -- the predictive update of Dynamo's first scheduler
    (``process_worker_selection``: "update worker state predictively, will be overwritten on
    next polling of metrics"). Without it every pick between two reports (1 s apart in the
    replays) saw the same stale usage and went to the same worker.
    Dynamo breaks ties by the smaller radix tree, then at random; here at random (a policy
    does not see per-worker index sizes). Overlap comes from the KV events
    (``use_kv_events`` is Dynamo's default).

    Freshness: Dynamo's router counts active blocks itself, at once on every pick and
    finish; the load-report stand-in is as fresh as that only with frequent reports, so the
    sim replay sends this policy's fleet a report every 50 ms (``load_interval_s``) unless
    ``--load-interval-s`` says otherwise.
    """

    name = "dynamo"
    uses_matches = True
    has_cost = True
    load_interval_s = 0.05

    overlap_score_weight = 1.0

    def __init__(self, config: PolicyConfig) -> None:
        super().__init__(config)
        # worker id -> (the load report the count is relative to, blocks sent since)
        self._since_report: dict[str, tuple[object, int]] = {}

    def __copy__(self) -> Dynamo:  # explain() consults a copy: it must not count its pick
        other = Dynamo(self.config)
        other._since_report = dict(self._since_report)
        return other

    def _sent_since_report(self, view: WorkerView) -> int:
        entry = self._since_report.get(view.worker_id)
        return entry[1] if entry is not None and entry[0] is view.load else 0

    def select(self, query: RouteQuery, candidates: Views, matched: Matched, rng: Random) -> Pick:
        costs = self.costs(query, candidates, matched)
        i = _argmin(costs, rng)
        chosen = candidates[i]
        new_blocks = max(
            -(-query.prompt_tokens // query.block_size) - matched.get(chosen.slot, 0), 0
        )
        sent = self._sent_since_report(chosen) + new_blocks
        self._since_report[chosen.worker_id] = (chosen.load, sent)
        return i, costs[i]

    def costs(self, query: RouteQuery, candidates: Views, matched: Matched) -> list[float]:
        bs = query.block_size
        prompt = query.prompt_tokens
        prompt_blocks = -(-prompt // bs)
        w = self.overlap_score_weight
        out = []
        for c in candidates:
            overlap = matched.get(c.slot, 0)
            new_tokens = max(prompt - overlap * bs, 0)
            prefill_blocks = (c.inflight_prefill_tokens + new_tokens) / bs
            load = c.load
            active_blocks = 0.0
            if load is not None:
                used = (
                    load.num_total_kv_tokens
                    - load.num_free_kv_tokens
                    - load.num_evictable_kv_tokens
                )
                active_blocks = max(used, 0) / bs
            active_blocks += self._sent_since_report(c)
            decode_blocks = active_blocks + max(prompt_blocks - overlap, 0)
            out.append(w * prefill_blocks + decode_blocks)
        return out


class LlmD(Policy):
    """llm-d's inference scheduler: weighted scorers and a max-score picker.

    Follows llm-d/llm-d-inference-scheduler's sample profile
    ``deploy/config/epp-precise-prefix-cache-config.yaml`` (commit 17d999e09bec):
    ``precise-prefix-cache-scorer`` weight 2, ``kv-cache-utilization-scorer`` weight 1,
    ``queue-scorer`` weight 1, ``max-score-picker``. Each scorer gives every pod a score in
    [0, 1]:

    - prefix: the longest matched prefix in blocks, min-max normalised over the pods that
      match at all (all equal -> 1.0); pods without a match score 0
      (``pkg/plugins/scorer/utils.go``, ``indexedScoresToNormalizedScoredPods``). Matches
      come from the KV events, as the precise scorer's do.
    - KV utilisation: ``1 - usage``; usage is the share of KV slots held by running
      requests in the worker's last load report (0 before one arrives).
    - queue: ``(max - q) / (max - min)`` of the waiting-request counts (all equal -> 1.0),
      the gateway-api-inference-extension queue scorer.

    The picker takes the highest weighted sum, ties at random. ``costs`` returns the negated
    sum (lower is better, as for every policy). Stand-in: the waiting count and KV usage are
    the worker's load report; llm-d scrapes vLLM's metrics every 50 ms (the gateway's
    default ``refreshMetricsInterval``), so the sim replay sends this policy's fleet a report
    every 50 ms (``load_interval_s``) unless ``--load-interval-s`` says otherwise.
    """

    name = "llm_d"
    uses_matches = True
    has_cost = True
    load_interval_s = 0.05

    prefix_weight = 2.0
    kv_utilization_weight = 1.0
    queue_weight = 1.0

    def costs(self, query: RouteQuery, candidates: Views, matched: Matched) -> list[float]:
        depth = [matched.get(c.slot, 0) for c in candidates]
        hits = [d for d in depth if d > 0]
        lo_d, hi_d = (min(hits), max(hits)) if hits else (0, 0)
        waiting = [c.load.num_waiting if c.load is not None else 0 for c in candidates]
        lo_q, hi_q = min(waiting), max(waiting)
        out = []
        for c, d, q in zip(candidates, depth, waiting, strict=True):
            if d <= 0:
                prefix = 0.0
            elif hi_d == lo_d:
                prefix = 1.0
            else:
                prefix = (d - lo_d) / (hi_d - lo_d)
            queue = 1.0 if hi_q == lo_q else (hi_q - q) / (hi_q - lo_q)
            score = (
                self.prefix_weight * prefix
                + self.kv_utilization_weight * (1.0 - _kv_usage(c))
                + self.queue_weight * queue
            )
            out.append(-score)
        return out


class AIBrix(Policy):
    """AIBrix's ``prefix-cache`` routing algorithm.

    Follows vllm-project/aibrix ``pkg/plugins/gateway/algorithms/prefix_cache.go`` at commit
    01de8a514d00 (``routeOriginal``, the default mode without KV event sync), with its
    defaults ``AIBRIX_PREFIX_CACHE_LOAD_IMBALANCE_FACTOR = 2.0``,
    ``..._LOAD_IMBALANCE_MIN_GAP = 8`` and ``..._STANDARD_DEVIATION_FACTOR = 1``:

    1. counts = running requests per pod. If ``max > 2.0 * (mean + 1)`` and
       ``max - min >= 8`` (load gate), prefix matching is restricted to the pods with the
       minimum count.
    2. Among those pods with a prefix match, by match percentage (descending) then count
       (ascending), ties shuffled: the first whose count is within
       ``mean + 1 * stddev`` of all pods' counts.
    3. No such pod: the least-loaded pod of all (ties at random).

    Stand-ins: the count is the router's in-flight requests per worker (AIBrix's gateway
    keeps a realtime count of the same); matches come from this policy's own routing history
    (``uses_events = False``; AIBrix's default indexer records the pod each prefix was sent
    to), at the fleet's block size where AIBrix hashes its own (128-token) blocks. The
    issue text that asked for this baseline says "mean + 2 sigma"; the source at this
    commit uses a factor of 1, and we follow the source.
    """

    name = "aibrix"
    uses_events = False
    uses_matches = True

    imbalance_factor = 2.0
    imbalance_min_gap = 8
    stddev_factor = 1.0

    def select(self, query: RouteQuery, candidates: Views, matched: Matched, rng: Random) -> Pick:
        counts = [c.num_active for c in candidates]
        n = len(counts)
        mean = sum(counts) / n
        lo, hi = min(counts), max(counts)
        allowed: Sequence[int] = range(n)
        if hi > self.imbalance_factor * (mean + 1) and hi - lo >= self.imbalance_min_gap:
            allowed = [i for i in range(n) if counts[i] == lo]
        prompt = query.prompt_tokens
        pct = {}
        for i in allowed:
            m = _matched_tokens(query, matched, candidates[i].slot)
            if m > 0 and prompt > 0:
                pct[i] = 100 * m // prompt
        if pct:
            std = math.sqrt(sum((x - mean) ** 2 for x in counts) / n)
            limit = mean + self.stddev_factor * std
            order = list(pct)
            rng.shuffle(order)
            order.sort(key=lambda i: (-pct[i], counts[i]))  # stable: the shuffle breaks ties
            for i in order:
                if counts[i] <= limit:
                    return i, 0.0
        return _argmin(counts, rng), 0.0


class ConsistentHash(Policy):
    """Consistent hashing with bounded loads over the first ``prefix_hash_blocks`` blocks.

    The production "sticky" baseline (Mirrokni, Thorup and Zadimoghaddam, "Consistent
    Hashing with Bounded Loads", SODA 2018; HAProxy's ``hash-balance-factor``, Envoy's ring
    hash with bounded load). Each worker has ``vnodes`` points on a 64-bit ring; a request's
    key is the hash of its first ``prefix_hash_blocks`` blocks (the k-th block hash names
    blocks 0..k-1; prompts shorter than one block hash their request id). From the key's
    point it walks the ring clockwise and takes the first worker whose in-flight request
    count is below ``ceil(balance_factor * (total in flight + 1) / workers)``, with
    ``balance_factor`` 1.25 (HAProxy's 125). A worker leaving moves only its keys.

    This replaces ``prefix_hash`` (plain rendezvous hashing of the same prefix), which sent
    every request sharing the first blocks -- a system prompt -- to one worker. The prefix
    length is ``PolicyConfig.prefix_hash_blocks`` (``kvroute replay --prefix-hash-blocks``).
    """

    name = "consistent_hash"

    balance_factor = 1.25
    vnodes = 64

    def __init__(self, config: PolicyConfig) -> None:
        super().__init__(config)
        self._ring_for: tuple[str, ...] = ()
        self._points: list[int] = []
        self._owners: list[str] = []

    def _ring(self, candidates: Views) -> tuple[list[int], list[str]]:
        ids = tuple(c.worker_id for c in candidates)
        if ids != self._ring_for:
            ring = sorted(
                (fmix64(partition_seed("consistent_hash", f"{wid}#{v}")), wid)
                for wid in ids
                for v in range(self.vnodes)
            )
            self._points = [p for p, _ in ring]
            self._owners = [w for _, w in ring]
            self._ring_for = ids
        return self._points, self._owners

    def key(self, query: RouteQuery) -> int:
        """The ring position of ``query``."""
        hashes = query.block_hashes
        if len(hashes):
            raw = int(hashes[min(len(hashes), self.config.prefix_hash_blocks) - 1])
        else:
            raw = partition_seed("consistent_hash/request", query.request_id)
        return fmix64(raw)

    def select(self, query: RouteQuery, candidates: Views, matched: Matched, rng: Random) -> Pick:
        points, owners = self._ring(candidates)
        index_of = {c.worker_id: i for i, c in enumerate(candidates)}
        total = sum(c.num_active for c in candidates)
        cap = math.ceil(self.balance_factor * (total + 1) / len(candidates))
        start = bisect.bisect_left(points, self.key(query))
        size = len(points)
        for step in range(size):
            i = index_of[owners[(start + step) % size]]
            if candidates[i].num_active < cap:
                return i, 0.0
        raise AssertionError("unreachable: some worker is below the mean, hence below cap")

    def __copy__(self) -> ConsistentHash:
        other = ConsistentHash(self.config)
        other._ring_for, other._points, other._owners = (
            self._ring_for,
            self._points,
            self._owners,
        )
        return other


PEER_POLICIES: tuple[type[Policy], ...] = (SGLang, Dynamo, LlmD, AIBrix, ConsistentHash)
"""The peers' algorithms, in the order the replay tables list them."""
