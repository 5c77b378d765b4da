"""Every routing policy by name: the product's cost, the baselines and the peers' algorithms.

The one module that imports them all, so that none of them imports another to register
itself.
"""

from __future__ import annotations

from collections.abc import Callable

from router.core.cost import ApproxTree, CacheAware
from router.core.peer_policies import PEER_POLICIES
from router.core.policy import BASELINES, Policy
from router.core.policy_config import PolicyConfig

__all__ = ["ALIASES", "POLICIES", "make_policy", "policy_names"]

_ALL: tuple[type[Policy], ...] = (CacheAware, *BASELINES, ApproxTree, *PEER_POLICIES)
POLICIES: dict[str, Callable[[PolicyConfig], Policy]] = {cls.name: cls for cls in _ALL}
"""Policy factories by name, the default first."""

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
