"""What a router pays for the other replicas' picks: ``RouterCore.apply_replica`` per event.

With replica sync (``kvroute router --replica-sync``) every router applies every other
replica's picks, first tokens and finishes, so at R replicas each router applies R - 1
picks for every one it routes itself. This times one router's ``apply_replica`` of a peer's
:class:`ReplicaRouted` (a prompt of a shared system prompt and a unique tail, its full
blocks' hashes attached, as the sync carries them), then its first token and finish, on the
same populated index ``bench.bench_index``'s route section uses (``ScaleConfig``: 64 workers,
1M indexed blocks, 4k-token system prompts on 8 holders each, 8k-token prompts). Next to
it, in the same run and process, this router's own ``route`` of the same kind of prompt:
the ratio of the two is what to compare across versions (absolute times on a shared
machine are noisy).

    python -m bench.bench_replica_apply [--events 3000] [--workers 64] [--no-peer-view]
        [--json OUT]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import platform
import random
import sys
import time

import numpy as np

from bench.bench_index import VOCAB, ScaleConfig, _fill, _route_percentiles, _system_prompts
from kvroute_proto.events import DEFAULT_PARTITION
from kvroute_proto.hashing import block_hashes
from router.core.core_types import ReplicaFinished, ReplicaFirstToken, ReplicaRouted
from router.core.index_api import IndexConfig
from router.core.replicas import ReplicaConfig
from router.core.router_core import RouterConfig, RouterCore, RouteRequest


def bench_apply(
    cfg: ScaleConfig, num_events: int, backend: str = "numba", peer_view: bool = True
) -> dict[str, float]:
    """p50/p99 µs (wall and thread CPU) of apply_replica (routed; first token + finish)
    and of route; ``peer_view``: RouterConfig.replica_peer_view (the router's default, on)."""
    rng = np.random.default_rng(cfg.seed)
    bs = cfg.block_size
    systems, system_hashes = _system_prompts(cfg, rng)
    seed = DEFAULT_PARTITION.seed
    now = [0.0]
    config = RouterConfig(
        block_size=bs,
        index=IndexConfig(max_blocks=2 * cfg.num_blocks, backend=backend),
        replica=ReplicaConfig(count=4, sync=True, peer_view=peer_view),
    )
    core = RouterCore(config, clock=lambda: now[0], rng=random.Random(cfg.seed))
    for w in range(cfg.num_workers):
        core.add_worker(f"w{w}", f"10.0.{w // 256}.{w % 256}:50051", block_size=bs)
    _fill(core.index, cfg, system_hashes)
    tail = cfg.prompt_tokens - cfg.system_tokens

    def prompt(i: int) -> np.ndarray:
        own = rng.integers(0, VOCAB, tail)
        return np.concatenate([systems[i % len(systems)], own]).astype(np.uint32)

    # the peers' picks as the sync delivers them: hashes computed by the sender
    events = []
    for i in range(num_events):
        tokens = prompt(i)
        hashes = block_hashes(tokens, bs, seed)
        # half of the picks go to a holder of the prompt's system prompt (as _fill placed
        # them: prompt p on workers p * holders + k), which the sender saw cached there
        holder = i % 2 == 1
        first = (i % len(systems)) * cfg.holders_per_prompt + (
            0 if holder else cfg.holders_per_prompt
        )
        worker = f"w{(first + i % cfg.holders_per_prompt) % cfg.num_workers}"
        matched = cfg.system_tokens if holder else 0
        events.append(ReplicaRouted(f"p{i}", worker, len(tokens), matched, hashes))
    own = [prompt(i) for i in range(num_events)]
    # wall and thread-CPU ns per section: a peer's pick, its first token + finish, own route
    wall = np.empty((3, num_events))
    cpu = np.empty((3, num_events))
    applied = 0
    gc.collect()
    gc.freeze()  # as the router service does after start-up
    try:
        for i, event in enumerate(events):
            c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
            applied += core.apply_replica("peer", event)
            c1, t1 = time.thread_time_ns(), time.perf_counter_ns()
            core.route(RouteRequest(f"r{i}", own[i]))
            c2, t2 = time.thread_time_ns(), time.perf_counter_ns()
            applied += core.apply_replica("peer", ReplicaFirstToken(event.request_id))
            applied += core.apply_replica("peer", ReplicaFinished(event.request_id, 16))
            c3, t3 = time.thread_time_ns(), time.perf_counter_ns()
            wall[:, i] = (t1 - t0, t3 - t2, t2 - t1)
            cpu[:, i] = (c1 - c0, c3 - c2, c2 - c1)
            core.on_first_token(f"r{i}")
            core.on_finished(f"r{i}")
            now[0] += 0.01
    finally:
        gc.unfreeze()
    left = core.stats().num_replica_inflight
    if applied != 3 * num_events or left:  # every event counted, and every pick ended
        raise RuntimeError(f"applied {applied} of {3 * num_events} events, {left} left in flight")
    skip = min(100, num_events // 10)
    results: dict[str, float] = {"events_applied": applied}
    for k, name in enumerate(("apply_routed", "apply_first_token_and_finish", "route")):
        results.update(_route_percentiles(name, wall[k, skip:], cpu[k, skip:]))
    results["apply_routed_over_route_p50"] = (
        results["apply_routed_p50_us"] / results["route_p50_us"]
    )
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.bench_replica_apply",
        description="Time RouterCore.apply_replica (a peer replica's pick, first token and "
        "finish) next to RouterCore.route, on a populated index.",
    )
    p.add_argument("--events", type=int, default=3000, help="peer picks applied (default 3000)")
    p.add_argument("--workers", type=int, default=64, help="workers (default 64)")
    p.add_argument(
        "--blocks", type=int, default=1_000_000, help="indexed blocks (default 1,000,000)"
    )
    p.add_argument("--backend", choices=("numba", "dict"), default="numba")
    p.add_argument(
        "--peer-view",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="count a peer's pick by the better of its view and this router's, as routers "
        "do by default (--no-peer-view: the peer's view alone, no index walk)",
    )
    p.add_argument("--json", metavar="OUT", help="write the results as JSON")
    args = p.parse_args(argv)
    if args.events < 10 or args.workers < 1 or args.blocks < 1:
        p.error("--events must be >= 10, --workers and --blocks >= 1")
    cfg = dataclasses.replace(ScaleConfig(), num_workers=args.workers, num_blocks=args.blocks)
    results = bench_apply(cfg, args.events, args.backend, args.peer_view)
    for key, value in results.items():
        print(f"{key:40s} {value:10.2f}")
    if args.json:
        out = {
            "config": {
                **dataclasses.asdict(cfg),
                "events": args.events,
                "backend": args.backend,
                "peer_view": args.peer_view,
            },
            "machine": {"python": sys.version.split()[0], "platform": platform.platform()},
            "results": results,
        }
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
