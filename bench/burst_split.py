"""How each burst of a cold-bursts trace is split over the workers, per policy.

``python -m bench.burst_split --trace bursts.jsonl --workers 4 cache_aware round_robin``
replays the trace in the simulator (as ``kvroute replay`` does, seed 0) and prints, for the
first bursts, how many requests each worker took, and the TTFT p50/p99 of burst requests and
of the rest. A burst is the ``--burst-size`` requests that arrive in one instant on one new
prefix (same timestamp, same first block): a unique document arriving in the same
millisecond is not part of it. Decisions 0019 and 0020 (the cold-pick cap, the cold window)
were made with it.

``--replay-args`` passes ``kvroute replay``'s sim options (``--strict``,
``--replica-sync-delay-s``, ``--step-reports``, ...) through, so a run here is the run a
replay made. ``--worst N`` then shows the N bursts with the slowest first token worker by
worker: how many requests each router sent there, their first tokens, which found nothing
cached, and the other requests that reached that worker in the ``--before-s`` before the
burst (what the burst's requests waited behind).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections import Counter, defaultdict

import numpy as np

from fleetsim.replay.report import RequestResult
from fleetsim.replay.sim import FleetSim
from fleetsim.replay.trace import TokenExpander, TraceRecord, read_trace


def _sim_config(args: argparse.Namespace):  # -> SimConfig
    """The SimConfig ``kvroute replay`` builds from the same options."""
    from fleetsim.replay import cli

    argv = [
        "--trace",
        args.trace,
        "--trace-block-size",
        str(args.trace_block_size),
        "--workers",
        str(args.workers),
        "--routers",
        str(args.routers),
        *shlex.split(args.replay_args),
    ]
    try:
        replay_args = cli.build_parser().parse_args(argv)
        return cli._sim_config(replay_args)
    except SystemExit as exc:  # argparse already said what was wrong
        raise ValueError(f"--replay-args {args.replay_args!r}: not kvroute replay options") from exc


def _bursts(
    records: list[TraceRecord], results: list[RequestResult], size: int
) -> tuple[list[tuple[float, list[RequestResult]]], list[RequestResult]]:
    """(arrival, the burst's results) in arrival order, and every other request's result."""
    groups: dict[tuple[float, int], list[RequestResult]] = defaultdict(list)
    for record, result in zip(records, results, strict=True):
        first = record.hash_ids[0] if record.hash_ids else -1
        groups[(record.timestamp_ms, first)].append(result)
    bursts, other = [], []
    for (ts, _), group in sorted(groups.items(), key=lambda kv: kv[0][0]):
        if len(group) == size:
            bursts.append((ts / 1000.0, group))
        else:
            other += group
    return bursts, other


def _ttft(r: RequestResult) -> float | None:
    return None if r.first_token_s is None else r.first_token_s - r.arrival_s


def _detail(
    at: float, burst: list[RequestResult], results: list[RequestResult], before_s: float
) -> list[str]:
    lines = []
    members = {r.index for r in burst}
    by_worker: dict[str, list[RequestResult]] = defaultdict(list)
    for r in burst:
        by_worker[r.worker_id or "(failed)"].append(r)
    for wid, reqs in sorted(by_worker.items()):
        routers = Counter(r.router for r in reqs)
        firsts = [t for r in reqs if (t := _ttft(r)) is not None]
        span = f"{min(firsts) * 1000:.0f}-{max(firsts) * 1000:.0f} ms" if firsts else "none"
        cold = [f"#{r.index}" for r in reqs if r.cached_tokens == 0]
        ahead = [
            f"#{r.index} ({r.prompt_tokens} tokens, router {r.router}, "
            f"{(r.arrival_s - at) * 1000:+.1f} ms)"
            for r in results
            if r.worker_id == wid and r.index not in members and at - before_s <= r.arrival_s <= at
        ]
        lines.append(
            f"  {wid}: {len(reqs)} requests, by router {dict(sorted(routers.items()))}; "
            f"first token {span}; nothing cached: {', '.join(cold) or 'none'}; "
            f"also arrived: {', '.join(ahead) or 'none'}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.burst_split", description=__doc__)
    p.add_argument("--trace", required=True, help="a cold-bursts trace (kvroute workload)")
    p.add_argument("--trace-block-size", type=int, default=16, help="default %(default)s")
    p.add_argument("--workers", type=int, default=4, help="default %(default)s")
    p.add_argument("--burst-size", type=int, default=64, help="default %(default)s")
    p.add_argument("--show", type=int, default=6, help="bursts to print (default %(default)s)")
    p.add_argument(
        "--routers", type=int, default=1, help="router replicas (SimConfig.num_routers), default 1"
    )
    p.add_argument(
        "--replay-args",
        default="",
        metavar="'OPTIONS'",
        help="more kvroute replay sim options as one argument, after an '=': "
        "--replay-args='--strict --replica-sync-delay-s 0.005'",
    )
    p.add_argument(
        "--worst",
        type=int,
        default=0,
        metavar="N",
        help="detail the N bursts with the slowest first token, worker by worker (default 0)",
    )
    p.add_argument(
        "--before-s",
        type=float,
        default=0.3,
        help="with --worst: list other requests that reached the worker this long before "
        "the burst (default %(default)s)",
    )
    p.add_argument("policy", nargs="+", help="routing policies")
    args = p.parse_args(argv)
    if args.worst < 0 or args.before_s < 0:
        p.error("--worst and --before-s must be >= 0")
    try:
        config = _sim_config(args)
    except ValueError as exc:
        p.error(str(exc))
    records = read_trace(args.trace, args.trace_block_size)
    for policy in args.policy:
        expander = TokenExpander(args.trace_block_size, config.vocab_size, config.seed)
        sim = FleetSim(records, policy, config, expander)
        sim.run()
        bursts, other = _bursts(records, sim.results, args.burst_size)
        splits = [sorted(Counter(r.worker_id for r in b).values(), reverse=True) for _, b in bursts]
        print(f"{policy}: burst split (first {args.show}): {splits[: args.show]}")
        burst_ttft = [t for _, b in bursts for r in b if (t := _ttft(r)) is not None]
        other_ttft = [t for r in other if (t := _ttft(r)) is not None]
        for name, values in (("burst", burst_ttft), ("other", other_ttft)):
            if values:
                p50, p99 = np.percentile(values, 50), np.percentile(values, 99)
                print(f"{policy}: {name} TTFT p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms")
        tops = [
            (max((t for r in b if (t := _ttft(r)) is not None), default=0.0), at, b)
            for at, b in bursts
        ]
        tops.sort(key=lambda tab: -tab[0])
        for top, at, burst in tops[: args.worst]:
            print(f"{policy}: burst at {at:.3f} s, slowest first token {top * 1000:.0f} ms")
            for line in _detail(at, burst, sim.results, args.before_s):
                print(f"{policy}:{line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
