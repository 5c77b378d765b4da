"""The product's routing cost: ``cache_aware`` (and ``approx_tree``, the same cost over the
router's own routing history).

For each candidate it estimates the prefill work the request would wait for there, in token
equivalents, and takes the cheapest (equal costs broken at random, never "always worker 0")::

    cost = w.prefill * b    * (prompt_tokens - cached prefix)     # work this request adds
         + w.queued_prefill * q * (1 + q / (w.queued_knee * prompt_tokens))
                                          # q: prefill queued there (knee 0: linear)
         + w.decode         * requests running on the worker      # decode slows each step
         + w.recent_prefill * recent work on the worker           # its share of the past
         + w.slot_wait      * requests it would queue behind for a running slot
         + w.decode_time    * decode             # the time it adds, in prefill tokens
         + affinity         (several routers without sync only)

    decode = L * (r * seq + K * ctx)               # its decode, slowed by the batch there
           + L * r * (seq + (P + L / 2) * ctx)     # the running ones' steps, slowed by it

    r: requests there past their prefill (running and waiting, less those the router sent
    that have no first token yet); K: their KV, r x the worker's last reported KV per
    running request (P + L / 2 before a report); L: the tokens it is expected to
    generate (the router's running mean of finished requests' outputs); seq, ctx: one
    more sequence's and one more KV token's share of a decode step in prefill tokens, from
    the step profile the worker states (``router.core.step_profile``).

Why each term (the numbers: ``CostWeights``, ``PolicyConfig`` and the decision records):

- **queued**: every request routed to the holder of a prefix adds its uncached tokens to that
  worker's queue until its first token, so a burst soon makes a cold worker (which pays the
  prefix once, then holds it too) cheaper, while a trickle stays on the holder. A queued
  token weighs a quarter: queued prefills are batched and share their KV (decision 0009).
  Past the knee, counted in prompts like the one routed, the queue counts more, so a burst
  spills to more workers once its holder is deep in it (decision 0013).
- **recent**: far below saturation queues are empty and say nothing; a decayed sum of the
  uncached tokens (and, at half a token each, the generated tokens) the router sent to each
  worker keeps a short shared prefix from holding all traffic on a few workers (0009).
- **slot wait**: past the worker's stated running cap a request waits for a decode slot
  with no prefill queued ahead of it; each request it would wait behind costs ``slot_wait``
  (decision 0012).
- **backlog factor** ``b``: when every candidate has prefill queued the fleet is
  compute-bound and a miss is work others wait behind: ``b = 1 + floor / backlog_tokens``,
  steeper by ``(floor - saturated_tokens) / saturated_scale_tokens`` past
  ``saturated_tokens`` (floor: the least loaded candidate's queue; decisions 0010, 0011).
- **decode time**: e2e latency is mostly decode, and a decode step slows with the batch
  and its KV, so a worker piled with running conversations slows every one of them; the
  term estimates what the request adds to its own and the running requests' time
  (decision 0031).
- **affinity**: router replicas that cannot see each other's picks share an order of
  preference among the workers lacking the request's next block (rendezvous hashing of that
  block and the worker id: ``router.core.affinity_nb``), so they start a new prefix on the
  same worker (decision 0021).

One source of truth: :meth:`CacheAware.costs` (explain, and ``select``) and
:meth:`CacheAware.select_set` (the route) both compute the cost with ``_total`` over the
candidates' cost fields (``WorkerTable`` rows); the route reads them from the table, the
others build them from the views.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from operator import attrgetter
from random import Random

import numpy as np

from router.core.policy import Policy
from router.core.policy_config import PolicyConfig
from router.core.views import ROWS, CandidateSet, Matched, Pick, RouteQuery, Views

__all__ = ["ApproxTree", "CacheAware", "affinity_terms"]

_queued = attrgetter("queued_prefill_tokens")
_FEW_MATCHED = 16  # up to this many matched workers, their prefill terms are set one by one
_affinity_into: Callable[..., bool] | None = None


def affinity_terms(
    block_hashes: Sequence[int] | np.ndarray, depths: np.ndarray, ids: np.ndarray, tokens: float
) -> np.ndarray | None:
    """The affinity term (module docstring) per candidate, from each candidate's matched
    depth in blocks and worker id hash; None when it is 0 for every candidate. Computed by
    a compiled kernel (router.core.affinity_nb; its test holds the numpy definition it is
    checked against)."""
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
            w.decode_time,
            self._per_backlog,
            self._per_saturated,
        )
        self._finite = all(map(math.isfinite, factors))

    def miss_factor(self, candidates: Views) -> float:
        """The backlog factor (module docstring) over ``candidates`` now: 1 while one of
        them has no prefill queued (or the factor is off)."""
        if not (self._per_backlog or self._per_saturated) or not candidates:
            return 1.0
        return self._backlog_factor(min(map(_queued, candidates)))

    def _backlog_factor(self, floor: float) -> float:
        """The prefill term's factor when the least loaded candidate has ``floor`` tokens
        of prefill queued: 1 unless every candidate has a backlog (``floor`` > 0)."""
        if floor <= 0:
            return 1.0
        factor = 1.0 + floor * self._per_backlog
        over = floor - self._saturated
        if over > 0:
            factor += over * self._per_saturated
        return factor

    def costs(self, query: RouteQuery, candidates: Views, matched: Matched) -> list[float]:
        fields = np.array(
            [
                [c.queued_prefill_tokens for c in candidates],
                [c.num_running for c in candidates],
                [c.recent_prefill for c in candidates],
                [0.0] * len(candidates),  # the load part: computed by _total
                [c.slot_queue for c in candidates],
                *zip(*(c.decode_parts() for c in candidates), strict=True),
            ],
            dtype=np.float64,
        ).reshape(ROWS, len(candidates))
        ids = None
        if self.config.affinity_tokens:
            ids = np.array([c.id_hash for c in candidates], dtype=np.uint64)
        position = {c.slot: i for i, c in enumerate(candidates)}
        with np.errstate(invalid="ignore", over="ignore"):  # inf weights: NaN as in Python
            return self._total(query, fields, None, ids, position, matched).tolist()

    def _total(
        self,
        query: RouteQuery,
        fields: np.ndarray,
        load: np.ndarray | None,
        ids: np.ndarray | None,
        position: dict[int, int],
        matched: Matched,
    ) -> np.ndarray:
        """Every candidate's cost: ``fields`` their ``WorkerTable`` rows (one column each),
        ``load`` the load part under this policy's weights when the table keeps it (None:
        computed here), ``ids`` their worker id hashes (the affinity term's; None when it is
        off), ``position``: slot -> column. Per candidate, in this order:
        ((wq*q + wd*r + wc*s) + wr*recent) + prefill, then the knee, then the decode time,
        then the affinity."""
        w = self.config.weights
        wp = w.prefill
        if self._per_backlog or self._per_saturated:
            wp *= self._backlog_factor(float(fields[0].min()))
        cost = fields[2] * (w.recent_prefill * query.recent_scale)
        if load is None:
            load = fields[0] * w.queued_prefill
            load += fields[1] * w.decode
            load += fields[4] * w.slot_wait
        cost += load
        prompt = query.prompt_tokens
        total = cost + wp * prompt
        depths = np.zeros(len(total), dtype=np.intp) if ids is not None else None
        if matched:
            bs = query.block_size
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
        if wqk:  # the knee's part of the queued term, q * (q * wq / knee)
            total += fields[0] * (fields[0] * wqk)
        out = query.expected_output_tokens
        if w.decode_time and out > 0:  # the decode-time term: WorkerView.decode_parts' A, B
            # as L x (A + (P + L / 2) x B), weighted, in four vector operations
            per_part = w.decode_time * out
            total += fields[5] * per_part
            total += fields[6] * (per_part * (query.prompt_tokens + 0.5 * out))
        if depths is not None and ids is not None:
            extra = affinity_terms(query.block_hashes, depths, ids, self.config.affinity_tokens)
            if extra is not None:
                total += extra
        return total

    def select_set(
        self, query: RouteQuery, candidates: CandidateSet, matched: Matched, rng: Random
    ) -> Pick:
        """:meth:`select`'s pick over the candidates' columns of the table: the same costs
        (the same ``_total``), ties and draws from ``rng``."""
        if type(self).costs is not CacheAware.costs or not self._finite:
            # a subclass with a cost of its own, or infinite weights
            return self.select(query, candidates.views, matched, rng)
        table = candidates.table
        columns = candidates.columns
        fields = table.fields[:, columns]
        w = self.config.weights
        load = fields[3] if table.weights is w or table.weights == w else None
        ids = table.ids[columns] if self.config.affinity_tokens else None
        total = self._total(query, fields, load, ids, candidates.position, matched)
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


class ApproxTree(CacheAware):
    """cache_aware over the router's own routing history only (no KV events): the core
    gives it matches from predicted entries and never applies events for it (SGLang's
    approximate tree mode)."""

    name = "approx_tree"
    uses_events = False
