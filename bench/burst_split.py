"""How each burst of a cold-bursts trace is split over the workers, per policy.

``python -m bench.burst_split --trace bursts.jsonl --workers 4 cache_aware round_robin``
replays the trace in the simulator (as ``kvroute replay`` does, seed 0) and prints, for the
first bursts (groups of ``--burst-size`` requests with one timestamp), how many requests each
worker took, and the TTFT p50/p99 of burst requests and of the rest. BENCHMARKS.md ("Where
cache_aware misses: cold-bursts at 4 workers") quotes it.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter, defaultdict

import numpy as np

from bench.replay.cli import default_load_interval_s
from bench.replay.sim import FleetSim, SimConfig
from bench.replay.trace import TokenExpander, read_trace


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
    p.add_argument("policy", nargs="+", help="routing policies")
    args = p.parse_args(argv)
    records = read_trace(args.trace, args.trace_block_size)
    interval = default_load_interval_s(args.routers, replica_sync=False)  # as kvroute replay
    config = SimConfig(num_workers=args.workers, num_routers=args.routers, load_interval_s=interval)
    for policy in args.policy:
        expander = TokenExpander(args.trace_block_size, config.vocab_size, config.seed)
        sim = FleetSim(records, policy, config, expander)
        sim.run()
        groups = defaultdict(list)
        for record, result in zip(records, sim.results, strict=True):
            groups[record.timestamp_ms].append(result)
        splits, burst_ttft, other_ttft = [], [], []
        for group in groups.values():
            ttft = [r.first_token_s - r.arrival_s for r in group if r.first_token_s is not None]
            if len(group) == args.burst_size:
                counts = Counter(r.worker_id for r in group)
                splits.append(sorted(counts.values(), reverse=True))
                burst_ttft += ttft
            else:
                other_ttft += ttft
        print(f"{policy}: burst split (first {args.show}): {splits[: args.show]}")
        for name, values in (("burst", burst_ttft), ("other", other_ttft)):
            if values:
                p50, p99 = np.percentile(values, 50), np.percentile(values, 99)
                print(f"{policy}: {name} TTFT p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
