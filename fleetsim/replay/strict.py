"""``kvroute replay`` options of the stricter simulation (sim mode), and ``--strict``.

Each option charges something the plain simulation leaves out. Every one is off by default
(the replay tables in BENCHMARKS.md were measured without them, and stay comparable);
``--strict`` turns on each one not given explicitly, at the values below:

==========================  ===========================================  ==================
option                      what it charges                              --strict value
==========================  ===========================================  ==================
``--weight-read-s S``       a floor on every forward step: one pass      4.79 ms (16.06 GB
                            over the weights (parameter bytes / memory   / 3.35 TB/s, Llama-
                            bandwidth), prefill-only steps too           3-8B on an H100)
``--route-decision-s S``    each routing decision takes S; a router      200 us (the router
                            decides one request at a time, so a burst    core's route p50
                            queues at it (``measured``: RouterCore.route  on the 2-core box,
                            timed in-process; not deterministic)         BENCHMARKS.md)
``--network-delay-s S``     router -> worker: a routed request reaches   0.5 ms (one hop in
                            its worker S later                           a data centre)
``--max-context N``         requests whose prompt + output exceed N are  131,072 (Llama-3.1-
                            rejected by the engine and counted as errors 8B)
``--event-loss P``          each event batch is lost on its way to each  not set (a fault
                            router with probability P; routers recover   to inject, not a
                            through the sequence numbers (Resubscribe)   cost)
``--replica-apply-s S``     with replica sync: applying a peer's pick    150 us (apply
                            is a job of the receiving router, S long (a  90-100 us on a
                            first token or finish S/4), done before its  1M-block index,
                            next queued decision (its event loop reads   decoding the
                            the subscription between a burst's calls)    batch ~50 us)
==========================  ===========================================  ==================

Without ``--max-context`` the context is stretched to fit the longest request of the trace
(the old behaviour). The weight floor and the context limit apply to the pooled and
infinite reference runs too (the same requests are rejected there), so the ratio to the
pooled reference compares like with like; the routing charges and the event loss do not (a
reference has no router).
"""

from __future__ import annotations

import argparse
from typing import Any

from worker.engine.sim_executor import H100_LLAMA3_8B_WEIGHT_READ_S

STRICT_WEIGHT_READ_S = H100_LLAMA3_8B_WEIGHT_READ_S
STRICT_ROUTE_DECISION_S = 200e-6
STRICT_NETWORK_DELAY_S = 0.5e-3
STRICT_MAX_CONTEXT = 131_072
# RouterCore.apply_replica of a peer's pick on bench_replica_apply's index (64 workers, 1M
# blocks): 88-96 us p50 on the 2-core box, plus decoding its batch off the wire (~50 us)
STRICT_REPLICA_APPLY_S = 150e-6


def add_strict_options(p: argparse.ArgumentParser) -> None:
    """The options of the module docstring, in their own help group."""
    g = p.add_argument_group(
        "stricter simulation (sim mode)",
        "Charges the plain simulation leaves out; each is off unless given or --strict.",
    )
    g.add_argument(
        "--strict",
        action="store_true",
        help=f"turn on every charge below not given explicitly: --weight-read-s "
        f"{STRICT_WEIGHT_READ_S:.5f} --route-decision-s {STRICT_ROUTE_DECISION_S:g} "
        f"--network-delay-s {STRICT_NETWORK_DELAY_S:g} --max-context {STRICT_MAX_CONTEXT}, "
        f"and with replica sync --replica-apply-s {STRICT_REPLICA_APPLY_S:g} (event loss "
        "stays off)",
    )
    g.add_argument(
        "--weight-read-s",
        type=float,
        default=None,
        metavar="S",
        help="floor on every step's time: one read of the model's weights (parameter bytes / "
        "memory bandwidth), prefill-only steps too (default: the cost profile's, 0 = none "
        "for h100; --strict: Llama-3-8B on an H100, 4.79 ms)",
    )
    g.add_argument(
        "--route-decision-s",
        default=None,
        metavar="S|measured",
        help="each routing decision takes S seconds, one at a time per router (a burst "
        "queues), charged to the request's TTFT; 'measured': RouterCore.route timed "
        "in-process (not deterministic) (default 0)",
    )
    g.add_argument(
        "--network-delay-s",
        type=float,
        default=None,
        metavar="S",
        help="router -> worker delay of a routed request (default 0)",
    )
    g.add_argument(
        "--max-context",
        type=int,
        default=None,
        metavar="N",
        help="the modelled model's context: a request whose prompt + output exceeds it is "
        "rejected (an error in the table) (default: stretched to fit the longest request; "
        "--strict: 131072, Llama-3.1-8B)",
    )
    g.add_argument(
        "--event-loss",
        type=float,
        default=None,
        metavar="P",
        help="probability that an event batch is lost on its way to a router; the router "
        "recovers through the stream's sequence numbers (default 0)",
    )
    g.add_argument(
        "--replica-apply-s",
        type=float,
        default=None,
        metavar="S",
        help="with --replica-sync-delay-s and a decision time: applying a peer's pick takes "
        "the receiving router S seconds (a first token or finish S/4), done before its next "
        "queued decision, which waits for it (default 0; --strict: "
        f"{STRICT_REPLICA_APPLY_S * 1e6:.0f} us)",
    )


def strict_settings(args: argparse.Namespace) -> dict[str, Any]:
    """SimConfig fields (and ``weight_read_s`` for the cost model) from the options; only
    those that are on. ValueError names the option."""
    out: dict[str, Any] = {}
    strict = bool(getattr(args, "strict", False))
    weight = args.weight_read_s
    if weight is None and strict:
        weight = STRICT_WEIGHT_READ_S
    if weight is not None:
        if not weight >= 0:
            raise ValueError(f"--weight-read-s must be >= 0, got {weight}")
        out["weight_read_s"] = weight
    decision = args.route_decision_s
    if decision is None and strict:
        decision = STRICT_ROUTE_DECISION_S
    if decision == "measured":
        out["measure_route_time"] = True
    elif decision is not None:
        try:
            value = float(decision)
        except ValueError:
            raise ValueError(
                f"--route-decision-s must be seconds or 'measured', got {decision!r}"
            ) from None
        if not value >= 0:
            raise ValueError(f"--route-decision-s must be >= 0, got {value}")
        if value:
            out["route_decision_s"] = value
    net = _seconds(
        args.network_delay_s, STRICT_NETWORK_DELAY_S if strict else None, "--network-delay-s"
    )
    if net:
        out["network_delay_s"] = net
    ctx = args.max_context
    if ctx is None and strict:
        ctx = STRICT_MAX_CONTEXT
    if ctx is not None:
        if ctx < 2:
            raise ValueError(f"--max-context must be >= 2, got {ctx}")
        out["max_context_tokens"] = ctx
    synced = getattr(args, "replica_sync_delay_s", None) is not None
    apply = _seconds(
        getattr(args, "replica_apply_s", None),
        STRICT_REPLICA_APPLY_S if strict and synced else None,
        "--replica-apply-s",
    )
    if apply:
        out["replica_apply_s"] = apply
    loss = args.event_loss
    if loss is not None:
        if not 0 <= loss < 1:
            raise ValueError(f"--event-loss must be in [0, 1), got {loss}")
        if loss:
            out["event_loss"] = loss
    return out


def _seconds(given: float | None, default: float | None, option: str) -> float | None:
    """``given``, else ``default``; ValueError naming ``option`` when below 0 (or NaN)."""
    value = default if given is None else given
    if value is not None and not value >= 0:
        raise ValueError(f"{option} must be >= 0, got {value}")
    return value
