"""``kvroute replay``'s options for the routers: how many, replica sync, the cost's numbers.

Each defaults to the router's own default (``kvroute router``), so a replay with none of them
routes as a router started with none of its routing options.
"""

from __future__ import annotations

import argparse
from typing import Any

from router.core.policy_config import COST_WEIGHTS_FORM
from router.core.replicas import (
    DEFAULT_REPLICA_AFFINITY_TOKENS,
    DEFAULT_REPLICA_COLD_PICKS,
    DEFAULT_REPLICA_COLD_WINDOW_PICKS,
)

__all__ = ["add_router_options", "router_config", "router_overrides"]


def add_router_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "routers and routing tuning", "Defaults: the router's (kvroute router --help)."
    )
    _add_replica_options(g)
    _add_tuning_options(g)


def _add_replica_options(g: argparse._ArgumentGroup) -> None:
    """Several routers in the sim: how many, and how their picks reach each other."""
    g.add_argument(
        "--routers",
        type=int,
        default=1,
        help="sim mode: independent router replicas, each fed every worker's events but "
        "routing only its share of the requests (default %(default)s)",
    )
    g.add_argument(
        "--replica-cold-picks",
        type=float,
        default=None,
        help="sim mode, --routers > 1: a cold pick (nothing of its prompt on the chosen "
        "worker) counts min(router replicas, this) times in the worker's queued prefill "
        f"(RouterConfig.replica_cold_picks; default: the router's, {DEFAULT_REPLICA_COLD_PICKS})",
    )
    g.add_argument(
        "--replica-affinity-tokens",
        type=float,
        default=None,
        help="sim mode, --routers > 1: the cost's affinity term, the same order of "
        "preference on every router for a new prefix (RouterConfig.replica_affinity_tokens; "
        f"default: {DEFAULT_REPLICA_AFFINITY_TOKENS:g} without replica sync, 0 with it; 0: off)",
    )
    g.add_argument(
        "--replica-peer-view",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="sim mode, with --replica-sync-delay-s: each router counts a peer's pick by the "
        "better of the peer's view and its own of what the worker holds "
        "(RouterConfig.replica_peer_view; default: on; --no-replica-peer-view: the peer's "
        "view alone, with every cold pick capped)",
    )
    g.add_argument(
        "--replica-cold-window-picks",
        type=int,
        default=None,
        help="sim mode, with --replica-sync-delay-s and the peer view: a cold pick counts "
        "--routers times, not capped by --replica-cold-picks, while the most of its "
        "router's own picks found inside their sync window at once (lately) stays under "
        "this: the sync keeps pace with the router "
        f"(RouterConfig.replica_cold_window_picks; default: {DEFAULT_REPLICA_COLD_WINDOW_PICKS}; "
        "0: always capped)",
    )
    g.add_argument(
        "--replica-sync-delay-s",
        type=float,
        default=None,
        help="sim mode, --routers > 1: replica sync -- each router's picks, first tokens and "
        "finishes reach the other routers this many seconds later (what kvroute router "
        "--replica-sync does through Redis); default: no sync",
    )
    g.add_argument(
        "--replica-sync-window-s",
        type=float,
        default=None,
        help="sim mode, with --replica-sync-delay-s: how long each router counts an own pick "
        "--routers times before counting it once (the others' picks have arrived by "
        "then; RouterConfig.replica_sync_window_s; default: the sync delay, as a live "
        "router measures it; inf: until its first token)",
    )


def _add_tuning_options(g: argparse._ArgumentGroup) -> None:
    """The workers' reports and the cost's numbers (the router's defaults when left out)."""
    g.add_argument(
        "--step-reports",
        action="store_true",
        help="sim mode: workers also send load reports around steps (kvroute worker "
        "--step-reports); default: only the periodic ones",
    )
    g.add_argument(
        "--flush-interval-s",
        type=float,
        default=0.0,
        help="sim mode: every this many seconds the next worker in turn drops its cache "
        "(as /flush_cache or a restarted cache would; KV events tell the routers); 0: never",
    )
    g.add_argument(
        "--cost-weights",
        metavar=COST_WEIGHTS_FORM,
        help="cache_aware/approx_tree CostWeights (default: the router's)",
    )
    g.add_argument(
        "--recent-window-s",
        type=float,
        default=None,
        help="decay time constant, in trace seconds, of the recent-prefill balance term "
        "(default: the router's)",
    )
    g.add_argument(
        "--recent-decode-ratio",
        type=float,
        default=None,
        help="recent-prefill tokens per generated token of a finished request "
        "(default: the router's)",
    )
    g.add_argument(
        "--backlog-tokens",
        type=float,
        default=None,
        help="queued prefill on the least loaded worker at which the cost counts a miss "
        "double; 0: off (default: the router's)",
    )
    g.add_argument(
        "--saturated-tokens",
        type=float,
        default=None,
        help="a saturated fleet: past this much queued prefill on the least loaded worker, "
        "every --saturated-scale-tokens more count a miss once more (default: the router's)",
    )
    g.add_argument(
        "--saturated-scale-tokens",
        type=float,
        default=None,
        help="see --saturated-tokens; 0: the saturated part off (default: the router's)",
    )
    g.add_argument(
        "--prefix-hash-blocks",
        type=int,
        default=None,
        help="sim mode: leading blocks consistent_hash keys on (default: the router's, "
        "RouterConfig.prefix_hash_blocks)",
    )


# RouterConfig options a replay passes on (None: the router's default): the core's own
# fields, then PolicyConfig's; LiveConfig has the same fields and passes them to the router
_CORE_OPTIONS = ("recent_window_s", "recent_decode_ratio")
_POLICY_OPTIONS = ("backlog_tokens", "saturated_tokens", "saturated_scale_tokens")
_ROUTER_OPTIONS = (
    "recent_window_s",
    "backlog_tokens",
    "saturated_tokens",
    "saturated_scale_tokens",
    "recent_decode_ratio",
)


def router_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The router options given on the command line, by RouterConfig field name."""
    return {k: v for k in _ROUTER_OPTIONS if (v := getattr(args, k)) is not None}


def router_config(args: argparse.Namespace):  # -> RouterConfig
    """The routers' config the routing options describe (ValueError on bad values)."""
    from router.core.policy_config import CostWeights, PolicyConfig
    from router.core.replicas import ReplicaConfig
    from router.core.router_core import RouterConfig

    given = router_overrides(args)
    policy: dict[str, Any] = {k: given[k] for k in _POLICY_OPTIONS if k in given}
    if args.cost_weights is not None:
        policy["weights"] = CostWeights.parse(args.cost_weights)
    if args.prefix_hash_blocks is not None:
        policy["prefix_hash_blocks"] = args.prefix_hash_blocks
    replica: dict[str, Any] = {}
    for option, name in (
        ("replica_cold_picks", "cold_picks"),
        ("replica_peer_view", "peer_view"),
        ("replica_cold_window_picks", "cold_window_picks"),
        ("replica_affinity_tokens", "affinity_tokens"),
        ("replica_sync_window_s", "sync_window_s"),
    ):
        if getattr(args, option) is not None:
            replica[name] = getattr(args, option)
    return RouterConfig(
        policy_config=PolicyConfig(**policy),
        replica=ReplicaConfig(**replica),
        **{k: given[k] for k in _CORE_OPTIONS if k in given},
    )
