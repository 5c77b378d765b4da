"""Waiting-queue orderings, selected by name from a registry.

Pure: imports neither asyncio, grpc, torch nor a clock; randomness comes from an injected
``random.Random``.

A policy only orders candidates; admission (memory, budgets, in-batch dedup) is the
scheduler's. Cache-aware policies (``lpm``, ``dfs-weight``) read each request's prefix-match
estimate (``Req.est_match`` / ``Req.est_node_key``), which the scheduler keeps fresh
incrementally -- they never switch themselves off under load.

=============  ===========================================================================
fcfs           arrival order (a retracted request keeps its place: it is older)
lof            longest remaining output first, then arrival
random         a seeded shuffle
lpm            longest cached prefix first, then arrival
dfs-weight     requests sharing a matched tree node are kept together, heaviest group first
=============  ===========================================================================
"""

from __future__ import annotations

import abc
import random
from collections import Counter
from collections.abc import Callable

from worker.engine.request import Req


class SchedulePolicy(abc.ABC):
    """Orders the waiting queue for admission."""

    name: str = ""
    uses_prefix_match: bool = False

    @abc.abstractmethod
    def order(self, waiting: list[Req], in_arrival_order: bool) -> list[Req]:
        """Admission order. ``waiting`` is in queue order, which equals arrival order when
        ``in_arrival_order`` (no retracted request waiting)."""


class FcfsPolicy(SchedulePolicy):
    name = "fcfs"

    def order(self, waiting: list[Req], in_arrival_order: bool) -> list[Req]:
        if in_arrival_order:
            return waiting
        return sorted(waiting, key=_by_seq)


class LongestOutputFirstPolicy(SchedulePolicy):
    name = "lof"

    def order(self, waiting: list[Req], in_arrival_order: bool) -> list[Req]:
        return sorted(waiting, key=lambda r: (len(r.output_ids) - r.max_new_tokens, r.seq))


class RandomPolicy(SchedulePolicy):
    name = "random"

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def order(self, waiting: list[Req], in_arrival_order: bool) -> list[Req]:
        shuffled = list(waiting)
        self._rng.shuffle(shuffled)
        return shuffled


class LongestPrefixMatchPolicy(SchedulePolicy):
    name = "lpm"
    uses_prefix_match = True

    def order(self, waiting: list[Req], in_arrival_order: bool) -> list[Req]:
        return sorted(waiting, key=lambda r: (-r.est_match, r.seq))


class DfsWeightPolicy(SchedulePolicy):
    """SGLang's dfs-weight keeps requests that hit the same subtree adjacent so they share
    the cached path while it is hot. We group by the deepest matched node (the tree's own
    internals stay private to the cache) and order groups by size, then by their oldest
    request; a simplification of a full DFS over subtree weights."""

    name = "dfs-weight"
    uses_prefix_match = True

    def order(self, waiting: list[Req], in_arrival_order: bool) -> list[Req]:
        weight = Counter(r.est_node_key for r in waiting)
        first_seq: dict[int, int] = {}
        for r in waiting:
            k = r.est_node_key
            if k not in first_seq or r.seq < first_seq[k]:
                first_seq[k] = r.seq
        return sorted(
            waiting,
            key=lambda r: (-weight[r.est_node_key], first_seq[r.est_node_key], r.seq),
        )


def _by_seq(r: Req) -> int:
    return r.seq


POLICIES: dict[str, Callable[[random.Random], SchedulePolicy]] = {
    "fcfs": lambda rng: FcfsPolicy(),
    "lof": lambda rng: LongestOutputFirstPolicy(),
    "random": RandomPolicy,
    "lpm": lambda rng: LongestPrefixMatchPolicy(),
    "dfs-weight": lambda rng: DfsWeightPolicy(),
}


def make_policy(name: str, rng: random.Random) -> SchedulePolicy:
    """The policy registered as ``name``; ValueError listing the valid names otherwise."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(
            f"schedule_policy must be one of {sorted(POLICIES)}, got {name!r}"
        ) from None
    return factory(rng)
