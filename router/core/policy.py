"""Routing policies: the interface, and the load-only baselines.

A policy scores the candidate workers of one request and picks one. Sans-I/O and pure:
imports neither asyncio, grpc, torch nor a clock; randomness comes from the
``random.Random`` passed to :meth:`Policy.select`, so every pick is reproducible. The only
state a policy keeps is its own (round-robin's cursor).

Where the policies live: this module has the interface and the baselines that ignore the
caches (round_robin, random, least_load, power_of_two); :mod:`router.core.cost` the
product's cache-aware cost (cache_aware, approx_tree); :mod:`router.core.peer_policies` the
peers' algorithms; :mod:`router.core.registry` names them all (``make_policy``). The
inputs a policy reads are in :mod:`router.core.views`, its settings in
:mod:`router.core.policy_config`; both are re-exported here.
"""

from __future__ import annotations

from random import Random

from router.core.policy_config import (
    COST_WEIGHTS_FORM,
    DEFAULT_BACKLOG_TOKENS,
    DEFAULT_SATURATED_SCALE_TOKENS,
    DEFAULT_SATURATED_TOKENS,
    SLOT_WAIT_TOKENS,
    CostWeights,
    PolicyConfig,
)
from router.core.views import (
    CandidateSet,
    Matched,
    Pick,
    RouteQuery,
    Views,
    WorkerTable,
    WorkerView,
    worker_id_hash,
)

__all__ = [
    "BASELINES",
    "COST_WEIGHTS_FORM",
    "DEFAULT_BACKLOG_TOKENS",
    "DEFAULT_SATURATED_SCALE_TOKENS",
    "DEFAULT_SATURATED_TOKENS",
    "SLOT_WAIT_TOKENS",
    "CandidateSet",
    "CostWeights",
    "LeastLoad",
    "Matched",
    "Pick",
    "Policy",
    "PolicyConfig",
    "PowerOfTwo",
    "RandomPolicy",
    "RoundRobin",
    "RouteQuery",
    "Views",
    "WorkerTable",
    "WorkerView",
    "argmin_random",
    "worker_id_hash",
]


class Policy:
    """Base class: ``select`` picks an index into ``candidates``.

    ``uses_events``: False for policies that must not see event-fed index entries
    (approx_tree). ``uses_matches``: whether the pick depends on cached prefixes (the core
    then enters predicted entries for each pick). ``has_cost``: whether :meth:`costs`
    returns numbers. ``load_interval_s``: how fresh the workers' load signals are where this
    policy runs in production, when that differs from kvroute's worker reports (None: the
    replay's interval); the sim replay gives each policy its own (decision 0031).
    """

    name = "base"
    uses_events = True
    uses_matches = False
    has_cost = False
    load_interval_s: float | None = None

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config

    def costs(self, query: RouteQuery, candidates: Views, matched: Matched) -> list[float] | None:
        """Per-candidate cost (lower is better), or None for a policy without one.

        ``matched``: matched prefix length in blocks per worker slot (absent = 0).
        """
        return None

    def select(self, query: RouteQuery, candidates: Views, matched: Matched, rng: Random) -> Pick:
        """(index into ``candidates``, its cost -- 0.0 without a cost model).

        ``candidates`` is non-empty and holds only healthy, non-excluded workers. The default
        picks the lowest :meth:`costs`, ties at random; policies without costs override it.
        """
        costs = self.costs(query, candidates, matched)
        if costs is None:
            raise NotImplementedError(f"policy {self.name!r} has neither costs nor select")
        i = argmin_random(costs, rng)
        return i, costs[i]

    def miss_factor(self, candidates: Views) -> float:
        """What one uncached token counts in every candidate's cost now, relative to an idle
        fleet; 0 for a policy whose cost has no such factor (Explain reports it)."""
        return 0.0

    def select_set(
        self, query: RouteQuery, candidates: CandidateSet, matched: Matched, rng: Random
    ) -> Pick:
        """What :meth:`select` returns for ``candidates.views`` (the core calls this one).
        Policies whose cost reads the :class:`WorkerTable` override it to score every
        candidate at once, with the same pick and the same draws from ``rng``."""
        return self.select(query, candidates.views, matched, rng)


def argmin_random(values: list[float], rng: Random) -> int:
    """Index of the smallest value; equal minima are broken uniformly at random."""
    best = min(values)
    num_ties = values.count(best)
    i = values.index(best)
    for _ in range(rng.randrange(num_ties) if num_ties > 1 else 0):
        i = values.index(best, i + 1)  # the k-th tie, found in C
    return i


class RoundRobin(Policy):
    """Each request to the next candidate in turn."""

    name = "round_robin"

    def __init__(self, config: PolicyConfig) -> None:
        super().__init__(config)
        self._cursor = 0

    def select(self, query: RouteQuery, candidates: Views, matched: Matched, rng: Random) -> Pick:
        i = self._cursor % len(candidates)
        self._cursor += 1
        return i, 0.0


class RandomPolicy(Policy):
    """Uniformly random candidate."""

    name = "random"

    def select(self, query: RouteQuery, candidates: Views, matched: Matched, rng: Random) -> Pick:
        return rng.randrange(len(candidates)), 0.0


def _load(c: WorkerView) -> float:
    return c.queued_prefill_tokens + c.num_running


class LeastLoad(Policy):
    """Fewest queued prefill tokens plus running requests (ties at random)."""

    name = "least_load"
    has_cost = True

    def costs(self, query: RouteQuery, candidates: Views, matched: Matched) -> list[float]:
        return [_load(c) for c in candidates]


class PowerOfTwo(Policy):
    """Two distinct random candidates; the less loaded one (ties at random)."""

    name = "power_of_two"

    def select(self, query: RouteQuery, candidates: Views, matched: Matched, rng: Random) -> Pick:
        n = len(candidates)
        if n == 1:
            return 0, float(_load(candidates[0]))
        a, b = rng.sample(range(n), 2)
        la, lb = _load(candidates[a]), _load(candidates[b])
        if la == lb:
            return (a if rng.random() < 0.5 else b), float(la)
        i = a if la < lb else b
        return i, float(min(la, lb))


BASELINES: tuple[type[Policy], ...] = (RoundRobin, RandomPolicy, LeastLoad, PowerOfTwo)
"""The load-only baselines, in the order the replay tables list them."""
