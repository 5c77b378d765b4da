"""``kvroute replay``: play a trace against routing policies and print/save the comparison.

Examples::

    kvroute replay --trace shared/traces/mooncake_synthetic_trace.jsonl --workers 8 \\
        --policy all --json out.json --plot out.png
    kvroute replay --trace bench/data/mooncake_sample.jsonl --workers 8 --policy all \\
        --jobs 0                       # the same report, one replay per CPU at a time
    kvroute workload support-agent -o sa.jsonl
    kvroute replay --trace sa.jsonl --trace-block-size 16 --workers 8 \\
        --policy cache_aware --policy round_robin
    kvroute replay --trace sa.jsonl --trace-block-size 16 --mode live --limit 200 \\
        --speedup 10 --workers 4 --policy cache_aware
    kvroute replay --trace sa.jsonl --trace-block-size 16 --mode live --workers 4 \\
        --front kvroute:cache_aware --front sglang-router:cache_aware \\
        --front vllm-router:consistent_hash --front kvroute:round_robin
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from edge.cli_help import RawDescriptionHelpFormatter, positive_float
from fleetsim.replay.parallel import REFERENCE_KINDS, resolve_jobs, run_replays
from fleetsim.replay.report import PolicyReport, ReplayReport
from fleetsim.replay.strict import add_strict_options, strict_settings
from fleetsim.replay.trace import DEFAULT_TRACE_BLOCK_SIZE, read_trace

DEFAULT_POLICIES = ("cache_aware", "round_robin")
# the workers' load report interval of a fleet with several routers (replay default)
MULTI_ROUTER_LOAD_INTERVAL_S = 0.05
LIVE_DEFAULT_LIMIT = 200


def available_policies() -> list[str]:
    """Names in the router's policy registry (registration order)."""
    from router.core.policy import POLICIES

    return list(POLICIES)


def build_parser() -> argparse.ArgumentParser:
    from fleetsim.replay.sim import DEFAULT_KV_CAPACITY_TOKENS
    from router.core.core_types import (
        DEFAULT_REPLICA_AFFINITY_TOKENS,
        DEFAULT_REPLICA_COLD_PICKS,
        DEFAULT_REPLICA_COLD_WINDOW_PICKS,
    )
    from router.core.policy import COST_WEIGHTS_FORM

    p = argparse.ArgumentParser(
        prog="kvroute replay",
        description="Replay a Mooncake-format JSONL trace (timestamp ms, input_length, "
        "output_length, hash_ids) against a fleet under one or more routing policies; "
        "report hit rate, TTFT, e2e latency, throughput and load imbalance per policy, "
        "next to the pooled-cache hit-rate reference and the infinite-cache ceiling.",
        formatter_class=RawDescriptionHelpFormatter,
        epilog=__doc__.split("Examples::", 1)[1] if __doc__ else None,
    )
    p.add_argument("--trace", required=True, help="Mooncake-format JSONL trace")
    p.add_argument(
        "--trace-block-size",
        type=int,
        default=DEFAULT_TRACE_BLOCK_SIZE,
        help="tokens per trace hash id (default %(default)s, Mooncake's)",
    )
    p.add_argument("--workers", type=int, default=8, help="fleet size (default %(default)s)")
    p.add_argument(
        "--policy",
        action="append",
        default=None,
        help="routing policy (repeatable), or 'all'; default: cache_aware and round_robin",
    )
    p.add_argument(
        "--mode",
        choices=("sim", "live"),
        default="sim",
        help="sim: simulated time, real router and caches; live: real gRPC servers and sim "
        "executors on 127.0.0.1",
    )
    p.add_argument(
        "--kv-capacity-tokens",
        type=int,
        default=DEFAULT_KV_CAPACITY_TOKENS,
        help="KV tokens per worker (default %(default)s ~ an H100 with Llama-3-8B)",
    )
    p.add_argument(
        "--speedup",
        type=positive_float,
        default=10.0,
        help="live mode: trace time and executor cost are compressed by this factor",
    )
    p.add_argument("--seed", type=int, default=0, help="token expansion and tie-break seed")
    p.add_argument("--json", metavar="OUT", help="write the report as JSON")
    p.add_argument("--plot", metavar="OUT.png", help="draw hit rate and TTFT p99 per policy")
    p.add_argument(
        "--event-delay-s",
        type=float,
        default=0.005,
        help="sim mode: worker -> router KV event latency (default %(default)s)",
    )
    p.add_argument(
        "--limit",
        type=int,
        help=f"replay only the first N requests (live mode default: {LIVE_DEFAULT_LIMIT})",
    )
    p.add_argument(
        "--page-size", type=int, default=16, help="engine page size (default %(default)s)"
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=16,
        help="engine event / router block size (default %(default)s)",
    )
    p.add_argument(
        "--load-interval-s",
        type=float,
        default=None,
        help="sim mode: a worker load report every this many seconds (default: 1.0 with one "
        f"router or with --replica-sync-delay-s, {MULTI_ROUTER_LOAD_INTERVAL_S} with --routers "
        "> 1 without sync: those routers see each other's picks only through the workers' "
        "reports; BENCHMARKS.md, several routers)",
    )
    p.add_argument(
        "--routers",
        type=int,
        default=1,
        help="sim mode: independent router replicas, each fed every worker's events but "
        "routing only its share of the requests (default %(default)s)",
    )
    p.add_argument(
        "--router-replicas",
        type=int,
        default=None,
        help="sim mode: the replica count each router is told (RouterConfig.replicas: its "
        "picks count that many times in a worker's queued prefill); default: --routers; 1: "
        "each router counts its own picks once",
    )
    p.add_argument(
        "--replica-cold-picks",
        type=float,
        default=None,
        help="sim mode, --routers > 1: a cold pick (nothing of its prompt on the chosen "
        "worker) counts min(router replicas, this) times in the worker's queued prefill "
        f"(RouterConfig.replica_cold_picks; default: the router's, {DEFAULT_REPLICA_COLD_PICKS})",
    )
    p.add_argument(
        "--replica-affinity-tokens",
        type=float,
        default=None,
        help="sim mode, --routers > 1: the cost's affinity term, the same order of "
        "preference on every router for a new prefix (RouterConfig.replica_affinity_tokens; "
        f"default: {DEFAULT_REPLICA_AFFINITY_TOKENS:g} without replica sync, 0 with it; 0: off)",
    )
    p.add_argument(
        "--replica-peer-view",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="sim mode, with --replica-sync-delay-s: each router counts a peer's pick by the "
        "better of the peer's view and its own of what the worker holds "
        "(RouterConfig.replica_peer_view; default: on; --no-replica-peer-view: the peer's "
        "view alone, with every cold pick capped)",
    )
    p.add_argument(
        "--replica-cold-window-picks",
        type=int,
        default=None,
        help="sim mode, with --replica-sync-delay-s and the peer view: a cold pick counts "
        "--router-replicas times, not capped by --replica-cold-picks, while the most of its "
        "router's own picks found inside their sync window at once (lately) stays under "
        "this: the sync keeps pace with the router "
        f"(RouterConfig.replica_cold_window_picks; default: {DEFAULT_REPLICA_COLD_WINDOW_PICKS}; "
        "0: always capped)",
    )
    p.add_argument(
        "--replica-sync-delay-s",
        type=float,
        default=None,
        help="sim mode, --routers > 1: replica sync -- each router's picks, first tokens and "
        "finishes reach the other routers this many seconds later (what kvroute router "
        "--replica-sync does through Redis); default: no sync",
    )
    p.add_argument(
        "--replica-sync-window-s",
        type=float,
        default=None,
        help="sim mode, with --replica-sync-delay-s: how long each router counts an own pick "
        "--router-replicas times before counting it once (the others' picks have arrived by "
        "then; RouterConfig.replica_sync_window_s; default: the sync delay, as a live "
        "router measures it; inf: until its first token)",
    )
    p.add_argument(
        "--step-reports",
        action="store_true",
        help="sim mode: workers also send load reports around steps (kvroute worker "
        "--step-reports); default: only the periodic ones",
    )
    p.add_argument(
        "--flush-interval-s",
        type=float,
        default=0.0,
        help="sim mode: every this many seconds the next worker in turn drops its cache "
        "(as /flush_cache or a restarted cache would; KV events tell the routers); 0: never",
    )
    p.add_argument(
        "--router-assignment",
        choices=("round_robin", "random", "prefix"),
        default="round_robin",
        help="sim mode, with --routers > 1: request i goes to router i %% R (round_robin, "
        "default: a conversation's turns spread over the routers), to a seeded random one, or "
        "by a hash of its first --affinity-blocks trace blocks (prefix: a load balancer with "
        "prefix affinity)",
    )
    p.add_argument(
        "--affinity-blocks",
        type=int,
        default=8,
        help="sim mode, --router-assignment prefix: leading trace blocks hashed to pick the "
        "router (default %(default)s)",
    )
    p.add_argument(
        "--cost-weights",
        metavar=COST_WEIGHTS_FORM,
        help="cache_aware/approx_tree CostWeights (default: the router's)",
    )
    p.add_argument(
        "--recent-window-s",
        type=float,
        default=None,
        help="decay time constant, in trace seconds, of the recent-prefill balance term "
        "(default: the router's)",
    )
    p.add_argument(
        "--recent-decode-ratio",
        type=float,
        default=None,
        help="recent-prefill tokens per generated token of a finished request "
        "(default: the router's)",
    )
    p.add_argument(
        "--backlog-tokens",
        type=float,
        default=None,
        help="queued prefill on the least loaded worker at which the cost counts a miss "
        "double; 0: off (default: the router's)",
    )
    p.add_argument(
        "--saturated-tokens",
        type=float,
        default=None,
        help="a saturated fleet: past this much queued prefill on the least loaded worker, "
        "every --saturated-scale-tokens more count a miss once more (default: the router's)",
    )
    p.add_argument(
        "--saturated-scale-tokens",
        type=float,
        default=None,
        help="see --saturated-tokens; 0: the saturated part off (default: the router's)",
    )
    p.add_argument(
        "--spread-weight",
        type=float,
        default=None,
        help="the cost's spread term per running request for a request starting something "
        "sticky (router/core/policy.py; default: the router's, 0 = off)",
    )
    p.add_argument(
        "--prefix-hash-blocks",
        type=int,
        default=None,
        help="sim mode: leading blocks consistent_hash keys on (default: the router's, "
        "RouterConfig.prefix_hash_blocks)",
    )
    p.add_argument(
        "--cost-profile",
        default="h100",
        metavar="NAME|FILE.json",
        help="sim mode: the simulated executor's step costs: h100 (a well-tuned engine, "
        "derived; default), kvroute-h200 (our torch executor as issue 14 first measured "
        "it), kvroute-h200-fused (the same executor with its CUDA defaults -- paged "
        "attention, fused kernels, CUDA-graph decode -- measured on an H200 on 2026-12-04), "
        "or a bench/bench_gpu.py --json result (fitted)",
    )
    add_strict_options(p)
    p.add_argument(
        "--no-reference",
        "--no-bounds",
        dest="no_bounds",
        action="store_true",
        help="skip the pooled-reference and infinite-ceiling runs (--no-bounds: old name)",
    )
    p.add_argument(
        "--timeout-s",
        type=float,
        default=600.0,
        help="live mode: overall time limit per policy (default %(default)s)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress line on stderr")
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        metavar="N",
        help="sim mode: run the policies and the two references in up to N processes at once "
        "(0: one per CPU this process may use); each replay is seeded and self-contained, so "
        "the report is the same as with 1, only sooner (default %(default)s)",
    )
    front = p.add_argument_group(
        "live mode through an HTTP front end",
        "With --front, live mode starts the sim workers with their OpenAI-compatible HTTP API "
        "and plays the trace as streamed POST /v1/completions with text prompts (one ASCII "
        "character per token) through each front in turn, one fresh fleet each.",
    )
    front.add_argument(
        "--front",
        action="append",
        default=None,
        metavar="FRONT",
        help="kvroute[:POLICY] (our router's --http-port; no POLICY: each --policy), "
        "sglang-router[:POLICY] or vllm-router[:POLICY] (peer routers from --peers-dir; "
        "default policy cache_aware), or http(s)://HOST:PORT of a running OpenAI-compatible "
        "endpoint (nothing started). Repeatable: one report row per front",
    )
    front.add_argument(
        "--peers-dir",
        default=None,
        help="virtualenvs of the peer routers (default: .peers in the repository; "
        "made by bench/peers/install_peers.sh)",
    )
    front.add_argument(
        "--requests-dir",
        default=None,
        metavar="DIR",
        help="write each front's per-request results (worker, cached tokens, TTFT, e2e) to "
        "DIR/FRONT.jsonl",
    )
    front.add_argument(
        "--model",
        default=None,
        help="the requests' model name (default: the first id of the front's /v1/models)",
    )
    return p


def _fronts(args: argparse.Namespace, policies: list[str]) -> list:  # -> list[FrontSpec]
    """The --front values, parsed and expanded (validated before any work)."""
    from fleetsim.replay.front import expand_fronts, parse_front

    if not args.front:
        if args.peers_dir is not None or args.model is not None or args.requests_dir:
            raise ValueError("--peers-dir, --model and --requests-dir only apply with --front")
        return []
    if args.mode != "live":
        raise ValueError("--front needs --mode live")
    known = available_policies()
    return expand_fronts([parse_front(v, known) for v in args.front], policies)


def _policies(requested: list[str] | None) -> list[str]:
    known = available_policies()
    if not requested:
        return list(DEFAULT_POLICIES)
    out: list[str] = []
    for name in requested:
        names = known if name == "all" else [name]
        for n in names:
            if n not in known:
                raise ValueError(f"--policy {n!r} is not one of {', '.join(known)} (or 'all')")
            if n not in out:
                out.append(n)
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        policies = _policies(args.policy)
        sim_config = _sim_config(args)  # validates the weights and window before any work
        if args.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {args.workers}")
        limit = args.limit
        if limit is None and args.mode == "live":
            limit = LIVE_DEFAULT_LIMIT
        fronts = _fronts(args, policies)
        if args.jobs < 0:
            raise ValueError(f"--jobs must be >= 0 (0: one per CPU), got {args.jobs}")
        if args.jobs != 1 and args.mode != "sim":
            raise ValueError(f"--jobs {args.jobs}: only sim mode runs replays in parallel")
        records = read_trace(args.trace, args.trace_block_size, limit)
    except (OSError, ValueError) as exc:
        print(f"kvroute replay: {exc}", file=sys.stderr)
        return 2
    if args.routers > 1 and not (sim_config.route_decision_s > 0 or sim_config.measure_route_time):
        print(
            f"kvroute replay: note: {args.routers} routers deciding in no time place requests "
            "that arrive together (a burst) in one instant, before any replica sync or load "
            "report can reach the others; --strict or --route-decision-s charges each "
            "decision its time (BENCHMARKS.md, several routers)",
            file=sys.stderr,
        )
    setup: dict[str, object] = {
        "trace": str(args.trace),
        "trace_block_size": args.trace_block_size,
        "requests": len(records),
        "workers": args.workers,
        "mode": args.mode,
        "kv_capacity_tokens": args.kv_capacity_tokens,
        "seed": args.seed,
        "page_size": args.page_size,
        "block_size": args.block_size,
    }
    if args.cost_weights:
        setup["cost_weights"] = args.cost_weights
    setup.update(_router_overrides(args))
    if args.prefix_hash_blocks is not None:
        setup["prefix_hash_blocks"] = args.prefix_hash_blocks
    if args.mode == "sim":
        setup["cost_profile"] = args.cost_profile
    progress = None if args.quiet else sys.stderr
    if args.mode == "sim":
        report = _run_sim(args, records, policies, setup, progress)
    else:
        from fleetsim.replay.live import LiveConfig, LiveReplayError, run_live

        setup["speedup"] = args.speedup
        config = LiveConfig(
            num_workers=args.workers,
            kv_capacity_tokens=args.kv_capacity_tokens,
            speedup=args.speedup,
            seed=args.seed,
            page_size=args.page_size,
            block_size=args.block_size,
            trace_block_size=args.trace_block_size,
            timeout_s=args.timeout_s,
            cost_weights=args.cost_weights,
            **_router_overrides(args),
        )
        report = ReplayReport(setup=setup)
        try:
            if fronts:
                _run_fronts(args, records, fronts, config, report, progress)
            else:
                for policy in policies:
                    report.policies.append(
                        run_live(records, policy, config, progress_stream=progress)
                    )
        except (LiveReplayError, ValueError) as exc:  # a fleet that did not start
            print(f"kvroute replay: {exc}", file=sys.stderr)
            return 1
        if not args.no_bounds:
            _add_sim_references(args, records, report, progress)
    print(report.format_table())
    if args.json:
        Path(args.json).write_text(report.dumps(), encoding="utf-8")
        print(f"wrote {args.json}")
    if args.plot:
        from fleetsim.replay.plot import plot_report

        plot_report(report, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _run_fronts(args, records, fronts, config, report, progress) -> None:
    """One fresh fleet per front, back to back, one report row each."""
    from fleetsim.replay.front import DEFAULT_PEERS_DIR
    from fleetsim.replay.live_http import HttpOptions, run_http

    options = HttpOptions(
        peers_dir=Path(args.peers_dir) if args.peers_dir else DEFAULT_PEERS_DIR,
        model=args.model,
        requests_dir=Path(args.requests_dir) if args.requests_dir else None,
    )
    report.setup["fronts"] = [f.label for f in fronts]
    report.setup["prompts"] = "text (1 ASCII character = 1 byte-tokenizer token)"
    for front in fronts:
        report.policies.append(run_http(records, front, config, options, progress))


# RouterConfig fields with a replay option of the same name (None: the router's default);
# LiveConfig has the same fields and passes them to the router process
_ROUTER_OPTIONS = (
    "recent_window_s",
    "backlog_tokens",
    "saturated_tokens",
    "saturated_scale_tokens",
    "recent_decode_ratio",
    "spread_weight",
)


def _router_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The router options given on the command line, by RouterConfig field name."""
    return {k: v for k in _ROUTER_OPTIONS if (v := getattr(args, k)) is not None}


def _sim_config(args: argparse.Namespace):  # -> SimConfig
    from fleetsim.replay.sim import SimConfig

    router = SimConfig().router
    if args.routers != 1 and args.mode != "sim":
        raise ValueError("--routers needs --mode sim")
    if args.flush_interval_s and args.mode != "sim":
        raise ValueError("--flush-interval-s needs --mode sim")
    if args.step_reports and args.mode != "sim":
        raise ValueError("--step-reports needs --mode sim")
    if args.replica_sync_delay_s is not None and args.routers < 2:
        raise ValueError(
            "--replica-sync-delay-s needs --routers 2 or more (sync is between routers)"
        )
    if args.replica_sync_window_s is not None:
        if args.replica_sync_delay_s is None:
            raise ValueError("--replica-sync-window-s needs --replica-sync-delay-s")
        if not args.replica_sync_window_s >= 0:
            raise ValueError(
                f"--replica-sync-window-s must be >= 0, got {args.replica_sync_window_s}"
            )
        router = replace(router, replica_sync_window_s=args.replica_sync_window_s)
    if args.cost_weights is not None:
        from router.core.policy import CostWeights

        router = replace(router, weights=CostWeights.parse(args.cost_weights))
    router = replace(router, **_router_overrides(args))
    if args.prefix_hash_blocks is not None:
        if args.prefix_hash_blocks < 1:
            raise ValueError(f"--prefix-hash-blocks must be >= 1, got {args.prefix_hash_blocks}")
        router = replace(router, prefix_hash_blocks=args.prefix_hash_blocks)
    if args.replica_cold_picks is not None:
        router = replace(router, replica_cold_picks=args.replica_cold_picks)
    if args.replica_peer_view is not None:
        if args.replica_sync_delay_s is None:
            raise ValueError("--replica-peer-view needs --replica-sync-delay-s")
        router = replace(router, replica_peer_view=args.replica_peer_view)
    if args.replica_cold_window_picks is not None:
        if args.replica_sync_delay_s is None:
            raise ValueError("--replica-cold-window-picks needs --replica-sync-delay-s")
        if args.replica_cold_window_picks < 0:
            raise ValueError(
                f"--replica-cold-window-picks must be >= 0, got {args.replica_cold_window_picks}"
            )
        router = replace(router, replica_cold_window_picks=args.replica_cold_window_picks)
    if args.replica_affinity_tokens is not None:
        if args.routers < 2:
            raise ValueError("--replica-affinity-tokens needs --routers 2 or more")
        router = replace(router, replica_affinity_tokens=args.replica_affinity_tokens)
    from worker.engine.sim_executor import cost_profile

    strict = strict_settings(args)
    if strict and args.mode != "sim":
        raise ValueError(
            "--strict, --weight-read-s, --route-decision-s, --network-delay-s, "
            "--max-context, --event-loss and --replica-apply-s need --mode sim"
        )
    if getattr(args, "replica_apply_s", None) is not None and args.replica_sync_delay_s is None:
        raise ValueError("--replica-apply-s needs --replica-sync-delay-s (peers' events to apply)")
    if "replica_apply_s" in strict and not (
        "route_decision_s" in strict or strict.get("measure_route_time")
    ):
        raise ValueError(
            "--replica-apply-s needs a decision time (--route-decision-s, or --strict): "
            "it queues with the router's decisions"
        )
    cost_model = cost_profile(args.cost_profile)
    if "weight_read_s" in strict:
        cost_model = replace(cost_model, weight_read_s=strict.pop("weight_read_s"))
    return SimConfig(
        **strict,
        router=router,
        cost_model=cost_model,
        num_workers=args.workers,
        kv_capacity_tokens=args.kv_capacity_tokens,
        event_delay_s=args.event_delay_s,
        load_interval_s=_load_interval_s(args),
        seed=args.seed,
        page_size=args.page_size,
        block_size=args.block_size,
        num_routers=args.routers,
        router_assignment=args.router_assignment,
        affinity_blocks=args.affinity_blocks,
        router_replicas=args.router_replicas,
        replica_sync_delay_s=args.replica_sync_delay_s,
        flush_interval_s=args.flush_interval_s,
        step_reports=args.step_reports,
    )


def default_load_interval_s(routers: int, replica_sync: bool) -> float:
    """The workers' load report interval a replay uses unless told: 1 s (the worker's
    default) with one router or with replica sync, which carries the routers' picks;
    ``MULTI_ROUTER_LOAD_INTERVAL_S`` for several routers without sync."""
    if routers == 1 or replica_sync:
        return 1.0
    return MULTI_ROUTER_LOAD_INTERVAL_S


def _load_interval_s(args: argparse.Namespace) -> float:
    if args.load_interval_s is not None:
        return float(args.load_interval_s)
    return default_load_interval_s(args.routers, args.replica_sync_delay_s is not None)


def _run_sim(args, records, policies, setup, progress) -> ReplayReport:
    config = _sim_config(args)
    setup = {
        **setup,
        "event_delay_s": args.event_delay_s,
        "load_interval_s": config.load_interval_s,
        "step_reports": config.step_reports,
    }
    if config.num_routers > 1:
        setup.update(
            routers=config.num_routers,
            router_assignment=config.router_assignment,
            router_replicas=config.replicas,
            replica_cold_picks=config.router.replica_cold_picks,
            replica_affinity_tokens=config.router_config().affinity_tokens,
            replica_sync_delay_s=config.replica_sync_delay_s,
        )
        if config.replica_sync_delay_s is not None:
            setup["replica_peer_view"] = config.router.replica_peer_view
            setup["replica_cold_window_picks"] = config.router.replica_cold_window_picks
            window = config.router_config().replica_sync_window_s
            setup["replica_sync_window_s"] = window if window != float("inf") else "inf"
    setup.update(strict_settings(args))
    report = ReplayReport(setup=setup)
    references = () if args.no_bounds else REFERENCE_KINDS
    jobs = resolve_jobs(args.jobs, len(policies) + len(references))
    if jobs > 1 and config.measure_route_time:
        print(
            f"kvroute replay: note: --jobs {jobs} with --route-decision-s measured: each "
            "process times its own routes, slower where the processes outnumber idle cores",
            file=sys.stderr,
        )
    runs = run_replays(records, config, args.trace_block_size, policies, references, jobs, progress)
    report.policies.extend(runs[: len(policies)])
    for kind, ref in zip(references, runs[len(policies) :], strict=True):
        _set_reference(report, kind, ref)
    return report


def _add_sim_references(args, records, report, progress) -> None:
    """The sim's pooled reference and infinite ceiling beside a live replay."""
    refs = run_replays(
        records, _sim_config(args), args.trace_block_size, (), REFERENCE_KINDS, 1, progress
    )
    for kind, ref in zip(REFERENCE_KINDS, refs, strict=True):
        _set_reference(report, kind, ref)


def _set_reference(report: ReplayReport, kind: str, ref: PolicyReport) -> None:
    if ref.errors:
        report.reference_errors[kind] = ref.errors
    if kind == "pooled":
        report.pooled_reference_hit_rate = ref.hit_rate
    else:
        report.infinite_hit_rate = ref.hit_rate


if __name__ == "__main__":
    sys.exit(main())
