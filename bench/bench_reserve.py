"""Engine settings compared in the simulated fleet replay: fixed vs adaptive new-token
reserve ratio, and the radix cache's split recency.

Replays one trace through the sim fleet (real router and caches, modelled step time, as
``kvroute replay --mode sim``) once per reserve setting and reports, per setting, the
engines' retractions (summed over workers), output throughput, hit rate and TTFT. A small
``--kv-capacity-tokens`` makes decode outgrow the pool, which is where the reserve matters.

Settings: ``fixed:R`` (EngineConfig.new_token_reserve_ratio = R, adaptive off) and
``adaptive`` (new_token_reserve_ratio None, the default: SGLang's rule, 0.7 decaying to 0.098 over
600 decode steps, raised after each retraction); ``split:keep`` / ``split:stamp``
(EngineConfig.split_recency: whether the unused half of a split edge counts as accessed;
compare the hit rates).

Usage::

    kvroute workload support-agent -o /tmp/sa.jsonl --duration-s 60 --seed 1
    python -m bench.bench_reserve --trace /tmp/sa.jsonl --trace-block-size 16 \\
        --workers 2 --kv-capacity-tokens 40000 [--setting fixed:0.25 --setting adaptive]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, replace

from fleetsim.replay.sim import FleetSim, SimConfig
from fleetsim.replay.trace import TokenExpander, read_trace
from worker.cache.base import SPLIT_RECENCY
from worker.engine.engine import EngineConfig
from worker.engine.engine_config import AdaptiveReserve

DEFAULT_SETTINGS = ("fixed:0.0", "fixed:0.25", "adaptive")


@dataclass(frozen=True, slots=True)
class ReserveRow:
    setting: str
    retractions: int
    throughput_tok_s: float
    hit_rate: float
    ttft_p50_s: float
    ttft_p99_s: float
    e2e_p99_s: float
    sim_duration_s: float
    errors: int


def engine_config_for(setting: str, base: EngineConfig) -> EngineConfig:
    """``fixed:R``, ``adaptive`` or ``split:keep|stamp`` -> the engine config (ValueError
    naming the setting)."""
    if setting == "adaptive":
        return replace(base, new_token_reserve_ratio=None, adaptive_reserve=AdaptiveReserve())
    kind, _, value = setting.partition(":")
    if kind == "split" and value in SPLIT_RECENCY:
        return replace(base, split_recency=value)
    if kind == "fixed" and value:
        try:
            ratio = float(value)
        except ValueError:
            ratio = -1.0
        if 0.0 <= ratio <= 1.0:
            return replace(base, new_token_reserve_ratio=ratio)
    raise ValueError(
        "--setting must be 'adaptive', 'fixed:R' with R in [0, 1], or 'split:keep' / "
        f"'split:stamp', got {setting!r}"
    )


def run_setting(
    records: list,
    setting: str,
    config: SimConfig,
    trace_block_size: int,
    policy: str,
) -> ReserveRow:
    cfg = replace(config, engine=engine_config_for(setting, config.engine))
    expander = TokenExpander(block_size=trace_block_size, vocab_size=cfg.vocab_size, seed=cfg.seed)
    sim = FleetSim(records, policy, cfg, expander)
    sim.run()
    report = sim.report(setting)
    retractions = sum(w.engine.stats().num_retractions for w in sim.workers.values())
    return ReserveRow(
        setting=setting,
        retractions=retractions,
        throughput_tok_s=report.throughput_tok_s,
        hit_rate=report.hit_rate,
        ttft_p50_s=report.ttft_p50_s,
        ttft_p99_s=report.ttft_p99_s,
        e2e_p99_s=report.e2e_p99_s,
        sim_duration_s=float(report.extra["sim_duration_s"]),
        errors=report.errors,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.bench_reserve",
        description="Retractions and throughput of fixed vs adaptive new-token reserve "
        "ratios in the simulated fleet replay.",
    )
    p.add_argument("--trace", required=True, help="Mooncake-format JSONL trace")
    p.add_argument(
        "--trace-block-size", type=int, default=512, help="tokens per trace hash id (512)"
    )
    p.add_argument("--workers", type=int, default=2, help="fleet size (default 2)")
    p.add_argument(
        "--kv-capacity-tokens",
        type=int,
        default=40_000,
        help="KV tokens per worker; small makes decode outgrow the pool (default 40000)",
    )
    p.add_argument("--policy", default="cache_aware", help="routing policy (cache_aware)")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument(
        "--setting",
        action="append",
        default=None,
        help="'fixed:R', 'adaptive', or 'split:keep' / 'split:stamp' (the radix cache's "
        "split recency, reserve at its default) (repeatable; default: "
        + ", ".join(DEFAULT_SETTINGS)
        + ")",
    )
    p.add_argument("--seed", type=int, default=0, help="token expansion seed (default 0)")
    p.add_argument("--json", metavar="OUT", help="write the rows as JSON")
    args = p.parse_args(argv)
    settings = args.setting or list(DEFAULT_SETTINGS)
    try:
        for s in settings:
            engine_config_for(s, EngineConfig())
        records = read_trace(args.trace, args.trace_block_size, args.limit)
        config = SimConfig(
            num_workers=args.workers, kv_capacity_tokens=args.kv_capacity_tokens, seed=args.seed
        )
    except (ValueError, OSError) as exc:
        p.error(str(exc))
    rows = []
    print(
        f"{'setting':<12} {'retractions':>11} {'tok/s':>9} {'hit':>6} {'ttft p50':>9} "
        f"{'ttft p99':>9} {'e2e p99':>8} {'sim s':>8} {'wall s':>7}"
    )
    for s in settings:
        start = time.monotonic()
        row = run_setting(records, s, config, args.trace_block_size, args.policy)
        wall = time.monotonic() - start
        rows.append(row)
        print(
            f"{row.setting:<12} {row.retractions:>11} {row.throughput_tok_s:>9.0f} "
            f"{row.hit_rate:>6.3f} {row.ttft_p50_s:>9.3f} {row.ttft_p99_s:>9.3f} "
            f"{row.e2e_p99_s:>8.2f} {row.sim_duration_s:>8.1f} {wall:>7.1f}",
            flush=True,
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"trace": args.trace, "rows": [asdict(r) for r in rows]}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
