"""Eviction strategies: each is a pure ``priority(node)`` sort key; the smallest key goes first.

Pure Python; imports neither asyncio, grpc, torch nor a clock.

A strategy reads only ``last_access``, ``creation_time``, ``hit_count`` and ``priority`` of a
node. The radix cache keeps evictable leaves in a persistent heap keyed by these values and
re-keys a leaf whenever one of those fields changes, so a strategy must depend on nothing
else. Register new ones with :func:`register_strategy`; look them up with :func:`get_strategy`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol


class EvictableNode(Protocol):
    """The node fields a strategy may read."""

    last_access: float
    creation_time: float
    hit_count: int
    priority: int


PriorityFn = Callable[[EvictableNode], Any]

SLRU_PROTECTED_HITS = 2
"""SLRU: a node hit at least this many times sits in the protected segment."""


@dataclass(frozen=True, slots=True)
class EvictionStrategy:
    """A named priority key.

    ``grows_on_touch``: touching a node (an access, a hit, a priority bump) never lowers its
    key. The cache then skips re-keying touched leaves and corrects a stale key when it
    pops it (the popped entry is still the true minimum, since stored <= current for all).
    """

    name: str
    priority: PriorityFn
    grows_on_touch: bool = True


_REGISTRY: dict[str, EvictionStrategy] = {}


def register_strategy(
    name: str, *, grows_on_touch: bool = True
) -> Callable[[PriorityFn], PriorityFn]:
    """Decorator: register ``fn`` as eviction strategy ``name`` (lower-case)."""

    def deco(fn: PriorityFn) -> PriorityFn:
        key = name.lower()
        if key in _REGISTRY:
            raise ValueError(f"eviction strategy {key!r} is already registered")
        _REGISTRY[key] = EvictionStrategy(key, fn, grows_on_touch)
        return fn

    return deco


def get_strategy(name: str) -> EvictionStrategy:
    """The strategy registered under ``name``; ValueError lists the known names."""
    try:
        return _REGISTRY[name.lower()]
    except (KeyError, AttributeError):
        known = ", ".join(sorted(_REGISTRY))
        raise ValueError(f"eviction_policy must be one of [{known}], got {name!r}") from None


def strategy_names() -> list[str]:
    return sorted(_REGISTRY)


@register_strategy("lru")
def lru(node: EvictableNode) -> Any:
    """Least recently used first."""
    return node.last_access


@register_strategy("mru", grows_on_touch=False)
def mru(node: EvictableNode) -> Any:
    """Most recently used first."""
    return -node.last_access


@register_strategy("fifo")
def fifo(node: EvictableNode) -> Any:
    """Oldest node first."""
    return node.creation_time


@register_strategy("filo")
def filo(node: EvictableNode) -> Any:
    """Newest node first."""
    return -node.creation_time


@register_strategy("lfu")
def lfu(node: EvictableNode) -> Any:
    """Fewest hits first, then least recently used."""
    return (node.hit_count, node.last_access)


@register_strategy("slru")
def slru(node: EvictableNode) -> Any:
    """Segmented LRU: the probation segment (< 2 hits) goes first, LRU within each."""
    return (node.hit_count >= SLRU_PROTECTED_HITS, node.last_access)


@register_strategy("priority")
def priority(node: EvictableNode) -> Any:
    """Lowest request priority first, then least recently used."""
    return (node.priority, node.last_access)
