"""Waiting-queue orderings, selected by name from a registry.

Pure: imports neither asyncio, grpc, torch nor a clock; randomness comes from an injected
``random.Random``.

A policy only orders candidates; admission (memory, budgets, in-batch dedup) is the
scheduler's. Cache-aware policies (``lpm``, ``dfs-weight``) read each request's prefix-match
estimate (``Req.est_match`` / ``Req.est_node``), which the scheduler keeps fresh
incrementally -- they never switch themselves off under load.

=============  ===========================================================================
fcfs           arrival order (a retracted request keeps its place: it is older)
lof            longest remaining output first, then arrival
random         a seeded shuffle
lpm            longest cached prefix first, then arrival
dfs-weight     DFS over the radix tree, heaviest subtree (most waiting requests) first
routing-key    keys frequent in the running batch first (EngineRequest.routing_key)
=============  ===========================================================================
"""

from __future__ import annotations

import abc
import random
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from worker.engine.request import Req


class SchedulePolicy(abc.ABC):
    """Orders the waiting queue for admission."""

    name: str = ""
    uses_prefix_match: bool = False
    uses_running_batch: bool = False

    @abc.abstractmethod
    def order(
        self, waiting: list[Req], in_arrival_order: bool, running: Sequence[Req] = ()
    ) -> list[Req]:
        """Admission order. ``waiting`` is in queue order, which equals arrival order when
        ``in_arrival_order`` (no retracted request waiting). ``running``: the requests in the
        running batch (the scheduler passes them to policies with ``uses_running_batch``)."""


class FcfsPolicy(SchedulePolicy):
    name = "fcfs"

    def order(
        self, waiting: list[Req], in_arrival_order: bool, running: Sequence[Req] = ()
    ) -> list[Req]:
        if in_arrival_order:
            return waiting
        return sorted(waiting, key=_by_seq)


class LongestOutputFirstPolicy(SchedulePolicy):
    name = "lof"

    def order(
        self, waiting: list[Req], in_arrival_order: bool, running: Sequence[Req] = ()
    ) -> list[Req]:
        return sorted(waiting, key=lambda r: (len(r.output_ids) - r.max_new_tokens, r.seq))


class RandomPolicy(SchedulePolicy):
    name = "random"

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def order(
        self, waiting: list[Req], in_arrival_order: bool, running: Sequence[Req] = ()
    ) -> list[Req]:
        shuffled = list(waiting)
        self._rng.shuffle(shuffled)
        return shuffled


class LongestPrefixMatchPolicy(SchedulePolicy):
    name = "lpm"
    uses_prefix_match = True

    def order(
        self, waiting: list[Req], in_arrival_order: bool, running: Sequence[Req] = ()
    ) -> list[Req]:
        return sorted(waiting, key=lambda r: (-r.est_match, r.seq))


class RoutingKeyPolicy(SchedulePolicy):
    """SGLang's routing-key: a waiting request whose routing key is frequent in the running
    batch goes first (most frequent key first, one key's requests together, then arrival);
    requests with no key, or a key nobody running has, follow in arrival order. Requests of
    one conversation or tenant then run in the same batches, while their shared prefix is
    hot."""

    name = "routing-key"
    uses_running_batch = True

    def order(
        self, waiting: list[Req], in_arrival_order: bool, running: Sequence[Req] = ()
    ) -> list[Req]:
        counts = Counter(r.routing_key for r in running if r.routing_key)
        if not counts:
            return waiting if in_arrival_order else sorted(waiting, key=_by_seq)

        def key(r: Req) -> tuple[int, int, str, int]:
            n = counts.get(r.routing_key, 0) if r.routing_key else 0
            return (0, -n, r.routing_key, r.seq) if n else (1, 0, "", r.seq)

        return sorted(waiting, key=key)


class TreeView(Protocol):
    """What a tree-walking policy may see of the cache: its root and each node's parent
    (read-only; ``PrefixCache`` provides both)."""

    @property
    def root(self) -> Any: ...

    def parent_node(self, node: Any) -> Any | None: ...


class DfsWeightPolicy(SchedulePolicy):
    """SGLang's dfs-weight: requests under one subtree of the radix tree are admitted
    together, so the path they share is computed once and stays hot.

    A subtree's weight is the number of waiting requests whose matched node lies in it.
    Walking from the root, heavier children go first (ties: the subtree holding the oldest
    request first); a node's own requests (those whose match ends exactly there, oldest
    first) follow its children -- deeper matches before shallower ones, as in SGLang::

        root ─┬─ S ─┬─ U1   {a}          weights: S=3 (a, b, c), T=2 (x1, x2)
              │     ├─ U2   {b}          order:   a, b, c, x1, x2
              │     └ (own) {c}
              └─ T          {x1, x2}

    Only the paths from the waiting requests' matched nodes up to the root are walked
    (``TreeView.parent_node``), never the whole tree. A request whose matched node has left
    the tree since it was matched counts at the root until its estimate is refreshed.
    """

    name = "dfs-weight"
    uses_prefix_match = True

    def __init__(self, tree: TreeView) -> None:
        self._tree = tree

    def order(
        self, waiting: list[Req], in_arrival_order: bool, running: Sequence[Req] = ()
    ) -> list[Req]:
        root = self._tree.root
        parent_of = self._tree.parent_node
        own: dict[Any, list[Req]] = {}
        for r in waiting:
            own.setdefault(r.est_node, []).append(r)
        # Link each matched node's path into a sparse tree of the nodes that matter.
        kids: dict[Any, list[Any]] = {root: []}
        orphans: list[Req] = []
        for node in list(own):
            path: list[Any] = []
            cur: Any = node
            while cur not in kids:
                path.append(cur)
                cur = parent_of(cur)
                if cur is None:
                    break
            if cur is None:  # left the tree since it was matched
                orphans.extend(own.pop(node))
                continue
            for child in reversed(path):  # top-down, so every parent is linked first
                kids[cur].append(child)
                kids[child] = []
                cur = child
        if orphans:
            own.setdefault(root, []).extend(orphans)
        # Post-order sums: subtree weight and the oldest request under it.
        weight: dict[Any, int] = {}
        oldest: dict[Any, int] = {}
        stack: list[tuple[Any, bool]] = [(root, False)]
        while stack:
            node, done = stack.pop()
            if not done:
                stack.append((node, True))
                stack.extend((c, False) for c in kids[node])
                continue
            mine = own.get(node, ())
            w = len(mine)
            first = min((r.seq for r in mine), default=_NO_SEQ)
            for c in kids[node]:
                w += weight[c]
                first = min(first, oldest[c])
            weight[node] = w
            oldest[node] = first
        # Pre-order walk, heaviest child first; a node's own requests after its children.
        out: list[Req] = []
        walk: list[tuple[Any, bool]] = [(root, False)]
        while walk:
            node, emit = walk.pop()
            if emit:
                out.extend(sorted(own.get(node, ()), key=_by_seq))
                continue
            walk.append((node, True))
            ranked = sorted(kids[node], key=lambda c: (-weight[c], oldest[c]))
            walk.extend((c, False) for c in reversed(ranked))
        assert len(out) == len(waiting)
        return out


_NO_SEQ = 1 << 62


def _by_seq(r: Req) -> int:
    return r.seq


POLICIES: dict[str, Callable[[random.Random, TreeView], SchedulePolicy]] = {
    "fcfs": lambda rng, tree: FcfsPolicy(),
    "lof": lambda rng, tree: LongestOutputFirstPolicy(),
    "random": lambda rng, tree: RandomPolicy(rng),
    "lpm": lambda rng, tree: LongestPrefixMatchPolicy(),
    "dfs-weight": lambda rng, tree: DfsWeightPolicy(tree),
    "routing-key": lambda rng, tree: RoutingKeyPolicy(),
}


def make_policy(name: str, rng: random.Random, tree: TreeView) -> SchedulePolicy:
    """The policy registered as ``name`` (``tree``: the cache, for policies that walk it);
    ValueError listing the valid names otherwise."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(
            f"schedule_policy must be one of {sorted(POLICIES)}, got {name!r}"
        ) from None
    return factory(rng, tree)
