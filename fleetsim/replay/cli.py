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

from edge.cli_help import RawDescriptionHelpFormatter, positive_float
from fleetsim.replay.parallel import REFERENCE_KINDS, resolve_jobs, run_replays
from fleetsim.replay.report import PolicyReport, ReplayReport
from fleetsim.replay.router_options import add_router_options, router_config, router_overrides
from fleetsim.replay.strict import add_strict_options, strict_settings
from fleetsim.replay.trace import DEFAULT_TRACE_BLOCK_SIZE, read_trace

DEFAULT_POLICIES = ("cache_aware", "round_robin")
# the workers' load report interval of a fleet with several routers (replay default)
MULTI_ROUTER_LOAD_INTERVAL_S = 0.05
LIVE_DEFAULT_LIMIT = 200


def available_policies() -> list[str]:
    """Names in the router's policy registry (registration order)."""
    from router.core.registry import POLICIES

    return list(POLICIES)


def build_parser() -> argparse.ArgumentParser:
    from fleetsim.replay.sim_config import DEFAULT_KV_CAPACITY_TOKENS

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
        "router -- except for a peer policy whose load signal is fresher in production, "
        "llm_d and dynamo 0.05, decision 0031 -- or with --replica-sync-delay-s, "
        f"{MULTI_ROUTER_LOAD_INTERVAL_S} with --routers > 1 without sync: those routers see "
        "each other's picks only through the workers' reports; decision 0016)",
    )
    add_router_options(p)
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
        _sim_config(args)  # validates the weights and window before any work
        fronts = _check_args(args, policies)
        records = read_trace(args.trace, args.trace_block_size, _limit(args))
    except (OSError, ValueError) as exc:
        print(f"kvroute replay: {exc}", file=sys.stderr)
        return 2
    _note_instant_routers(args)
    setup = _setup(args, len(records))
    progress = None if args.quiet else sys.stderr
    if args.mode == "sim":
        report = _run_sim(args, records, policies, setup, progress)
    else:
        try:
            report = _run_live(args, records, policies, fronts, setup, progress)
        except ValueError as exc:  # a fleet that did not start
            print(f"kvroute replay: {exc}", file=sys.stderr)
            return 1
    print(report.format_table())
    if args.json:
        Path(args.json).write_text(report.dumps(), encoding="utf-8")
        print(f"wrote {args.json}")
    if args.plot:
        from fleetsim.replay.plot import plot_report

        plot_report(report, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _limit(args: argparse.Namespace) -> int | None:
    if args.limit is None and args.mode == "live":
        return LIVE_DEFAULT_LIMIT
    return args.limit


def _check_args(args: argparse.Namespace, policies: list[str]) -> list:  # -> list[FrontSpec]
    """The options that apply to the whole run, checked; the --front values expanded."""
    if args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    fronts = _fronts(args, policies)
    if args.jobs < 0:
        raise ValueError(f"--jobs must be >= 0 (0: one per CPU), got {args.jobs}")
    if args.jobs != 1 and args.mode != "sim":
        raise ValueError(f"--jobs {args.jobs}: only sim mode runs replays in parallel")
    return fronts


def _note_instant_routers(args: argparse.Namespace) -> None:
    strict = strict_settings(args)
    if args.routers > 1 and not (
        strict.get("route_decision_s", 0) > 0 or strict.get("measure_route_time")
    ):
        print(
            f"kvroute replay: note: {args.routers} routers deciding in no time place requests "
            "that arrive together (a burst) in one instant, before any replica sync or load "
            "report can reach the others; --strict or --route-decision-s charges each "
            "decision its time (decision 0026)",
            file=sys.stderr,
        )


def _setup(args: argparse.Namespace, num_requests: int) -> dict[str, object]:
    """The report's setup: what was replayed, on what."""
    setup: dict[str, object] = {
        "trace": str(args.trace),
        "trace_block_size": args.trace_block_size,
        "requests": num_requests,
        "workers": args.workers,
        "mode": args.mode,
        "kv_capacity_tokens": args.kv_capacity_tokens,
        "seed": args.seed,
        "page_size": args.page_size,
        "block_size": args.block_size,
    }
    if args.cost_weights:
        setup["cost_weights"] = args.cost_weights
    setup.update(router_overrides(args))
    if args.prefix_hash_blocks is not None:
        setup["prefix_hash_blocks"] = args.prefix_hash_blocks
    if args.mode == "sim":
        setup["cost_profile"] = args.cost_profile
    return setup


def _run_live(args, records, policies, fronts, setup, progress) -> ReplayReport:
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
        **router_overrides(args),
    )
    report = ReplayReport(setup=setup)
    try:
        if fronts:
            _run_fronts(args, records, fronts, config, report, progress)
        else:
            for policy in policies:
                report.policies.append(run_live(records, policy, config, progress_stream=progress))
    except LiveReplayError as exc:
        raise ValueError(str(exc)) from exc
    if not args.no_bounds:
        _add_sim_references(args, records, report, progress)
    return report


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


def _check_sim_options(args: argparse.Namespace) -> None:
    """Options that need sim mode, several routers or replica sync, and their ranges."""
    sim_only = {
        "--routers": args.routers != 1,
        "--flush-interval-s": bool(args.flush_interval_s),
        "--step-reports": args.step_reports,
    }
    for flag, given in sim_only.items():
        if given and args.mode != "sim":
            raise ValueError(f"{flag} needs --mode sim")
    sync = args.replica_sync_delay_s is not None
    if sync and args.routers < 2:
        raise ValueError(
            "--replica-sync-delay-s needs --routers 2 or more (sync is between routers)"
        )
    for flag, name in (
        ("--replica-sync-window-s", "replica_sync_window_s"),
        ("--replica-peer-view", "replica_peer_view"),
        ("--replica-cold-window-picks", "replica_cold_window_picks"),
    ):
        if getattr(args, name) is not None and not sync:
            raise ValueError(f"{flag} needs --replica-sync-delay-s")
    if args.replica_affinity_tokens is not None and args.routers < 2:
        raise ValueError("--replica-affinity-tokens needs --routers 2 or more")
    strict = strict_settings(args)
    if strict and args.mode != "sim":
        raise ValueError(
            "--strict, --weight-read-s, --route-decision-s, --network-delay-s, "
            "--max-context, --event-loss and --replica-apply-s need --mode sim"
        )
    if getattr(args, "replica_apply_s", None) is not None and not sync:
        raise ValueError("--replica-apply-s needs --replica-sync-delay-s (peers' events to apply)")
    if "replica_apply_s" in strict and not (
        "route_decision_s" in strict or strict.get("measure_route_time")
    ):
        raise ValueError(
            "--replica-apply-s needs a decision time (--route-decision-s, or --strict): "
            "it queues with the router's decisions"
        )


def _sim_config(args: argparse.Namespace):  # -> SimConfig
    from fleetsim.replay.sim_config import SimConfig
    from worker.engine.sim_executor import cost_profile

    _check_sim_options(args)
    router = router_config(args)
    strict = strict_settings(args)
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
        replica_sync_delay_s=args.replica_sync_delay_s,
        flush_interval_s=args.flush_interval_s,
        step_reports=args.step_reports,
        policy_load_intervals=args.load_interval_s is None and args.routers == 1,
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
            router_assignment="round_robin",  # request i to router i % R
            router_replicas=config.num_routers,
            replica_cold_picks=config.router.replica.cold_picks,
            replica_affinity_tokens=config.router_config().replica.policy_affinity_tokens,
            replica_sync_delay_s=config.replica_sync_delay_s,
        )
        if config.replica_sync_delay_s is not None:
            setup["replica_peer_view"] = config.router.replica.peer_view
            setup["replica_cold_window_picks"] = config.router.replica.cold_window_picks
            window = config.router_config().replica.sync_window_s
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
