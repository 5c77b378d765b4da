"""Goodput under overload: open-loop arrivals with deadlines, admission on vs off.

    python -m bench.bench_overload [--workers 2] [--load 3] [--duration-s 20] [--json OUT]
    python -m bench.bench_overload --prompt-tokens 8000 --new-tokens 4   # prefill-bound

Starts N sim workers (paced: ``--sim-speedup``) and a router as real processes on
127.0.0.1 (fleetsim.replay.live's fleet), then sends requests of ``--new-tokens`` tokens
(ignore_eos) at a fixed rate for ``--duration-s`` seconds, each with a ``--deadline-s``
gRPC deadline, once with the router's deadline-aware admission off and once on.

The offered rate is ``--load`` times the fleet's capacity, computed from the sim cost
model: per worker the largest concurrency k whose requests still finish in time
(``ttft + n * step(k) <= deadline``, step(k) the modelled decode step at k sequences, slowed
by the pacing) gives k / (n * step(k)) requests per second. Goodput is requests finished
within their deadline per second. Every refused request's time to refusal is recorded.

Everything is bounded (rate x duration requests, each with its deadline) and local.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field

import grpc

from fleetsim.replay.live import LiveConfig, LiveFleet, _wait_ready
from kvroute_proto import kvroute_pb2 as pb
from kvroute_proto import kvroute_pb2_grpc as pb_grpc
from worker.engine.sim_executor import SimCostModel


@dataclass(frozen=True, slots=True)
class OverloadConfig:
    num_workers: int = 2
    load: float = 3.0  # offered rate / capacity
    duration_s: float = 20.0
    deadline_s: float = 4.0
    new_tokens: int = 64
    prompt_tokens: int = 32
    sim_speedup: float = 0.25  # < 1: slower than real time, so the box keeps up
    max_running: int = 256  # the worker's default batch limit


@dataclass(slots=True)
class RunResult:
    admission: str
    offered: int = 0
    ok: int = 0
    refused: int = 0
    late: int = 0  # DEADLINE_EXCEEDED
    other: int = 0
    refusal_ms: list[float] = field(default_factory=list)
    ok_latency_s: list[float] = field(default_factory=list)

    def summary(self, duration_s: float, capacity_rps: float) -> dict[str, object]:
        ref = sorted(self.refusal_ms)
        lat = sorted(self.ok_latency_s)
        return {
            "admission": self.admission,
            "offered": self.offered,
            "ok": self.ok,
            "refused": self.refused,
            "deadline_exceeded": self.late,
            "other_errors": self.other,
            "goodput_rps": round(self.ok / duration_s, 2),
            "goodput_of_capacity": round(self.ok / duration_s / capacity_rps, 3),
            "refusal_p50_ms": round(_pct(ref, 50), 1),
            "refusal_p99_ms": round(_pct(ref, 99), 1),
            "refusal_max_ms": round(ref[-1], 1) if ref else 0.0,
            "ok_latency_p50_s": round(_pct(lat, 50), 2),
            "ok_latency_p99_s": round(_pct(lat, 99), 2),
        }


def _pct(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    i = min(len(sorted_values) - 1, math.ceil(q / 100 * len(sorted_values)) - 1)
    return sorted_values[max(i, 0)]


def capacity_rps(config: OverloadConfig, cost: SimCostModel | None = None) -> tuple[float, int]:
    """(requests/s the fleet can finish within the deadline, the per-worker concurrency)."""
    cost = cost or SimCostModel()
    n, p = config.new_tokens, config.prompt_tokens
    slow = 1.0 / config.sim_speedup
    ttft = cost.prefill_cost_s(p, 0) * slow
    best_rate, best_k = 0.0, 0
    for k in range(1, config.max_running + 1):
        context = k * (p + n / 2)  # mean context over a request's decode
        step = cost.decode_cost_s(k, int(context)) * slow
        if ttft + n * step > config.deadline_s:
            break
        # prefills do not overlap: a worker starts at most one prompt per prefill time
        rate = min(k / (ttft + n * step), 1.0 / ttft if ttft > 0 else math.inf)
        if rate > best_rate:
            best_rate, best_k = rate, k
    return best_rate * config.num_workers, best_k


class _Fleet(LiveFleet):
    def __init__(self, config: LiveConfig, admission: str) -> None:
        super().__init__(config, "cache_aware")
        self.admission = admission

    def router_args(self, policy: str) -> list[str]:
        return [*super().router_args(policy), "--admission", self.admission]


async def _one(stub: pb_grpc.RouterStub, i: int, config: OverloadConfig, result: RunResult) -> None:
    prompt = [(i * 7 + j) % 250 + 1 for j in range(config.prompt_tokens)]
    req = pb.GenerateRequest(
        request_id=f"o{i}",
        prompt_token_ids=pb.TokenIds(ids=prompt),
        sampling=pb.SamplingParams(max_new_tokens=config.new_tokens, ignore_eos=True),
    )
    start = time.perf_counter()
    try:
        async for _ in stub.Generate(req, timeout=config.deadline_s):
            pass
    except grpc.aio.AioRpcError as exc:
        code = exc.code()
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            result.refused += 1
            result.refusal_ms.append((time.perf_counter() - start) * 1000)
        elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
            result.late += 1
        else:
            result.other += 1
        return
    result.ok += 1
    result.ok_latency_s.append(time.perf_counter() - start)


async def run_one(config: OverloadConfig, admission: str, rate_rps: float) -> RunResult:
    live = LiveConfig(num_workers=config.num_workers, speedup=config.sim_speedup)
    result = RunResult(admission)
    async with _Fleet(live, admission) as fleet:
        assert fleet.router is not None
        async with grpc.aio.insecure_channel(fleet.router.address) as channel:
            stub = pb_grpc.RouterStub(channel)
            await _wait_ready(stub, config.num_workers, 60.0)
            total = int(rate_rps * config.duration_s)
            result.offered = total
            t0 = time.perf_counter()
            tasks = []
            for i in range(total):
                delay = t0 + i / rate_rps - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(_one(stub, i, config, result)))
            await asyncio.wait_for(asyncio.gather(*tasks), config.deadline_s + 30)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bench_overload", description=__doc__)
    d = OverloadConfig()
    p.add_argument("--workers", type=int, default=d.num_workers, help="sim workers")
    p.add_argument("--load", type=float, default=d.load, help="offered rate / capacity")
    p.add_argument("--duration-s", type=float, default=d.duration_s, help="arrival window")
    p.add_argument("--deadline-s", type=float, default=d.deadline_s, help="per request")
    p.add_argument("--new-tokens", type=int, default=d.new_tokens, help="per request")
    p.add_argument(
        "--prompt-tokens", type=int, default=d.prompt_tokens, help="per request, uncached"
    )
    p.add_argument("--sim-speedup", type=float, default=d.sim_speedup, help="worker pacing")
    p.add_argument(
        "--admission", choices=("on", "off", "both"), default="both", help="router admission"
    )
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    config = OverloadConfig(
        num_workers=args.workers,
        load=args.load,
        duration_s=args.duration_s,
        deadline_s=args.deadline_s,
        new_tokens=args.new_tokens,
        prompt_tokens=args.prompt_tokens,
        sim_speedup=args.sim_speedup,
    )
    capacity, k = capacity_rps(config)
    if capacity <= 0:
        print("no concurrency meets the deadline: raise --deadline-s", file=sys.stderr)
        return 2
    rate = capacity * config.load
    print(
        f"capacity {capacity:.1f} req/s ({k} per worker in flight); offering {rate:.1f} req/s "
        f"for {config.duration_s:g} s, deadline {config.deadline_s:g} s",
        flush=True,
    )
    modes = ("off", "on") if args.admission == "both" else (args.admission,)
    rows = []
    for mode in modes:
        result = asyncio.run(run_one(config, mode, rate))
        row = result.summary(config.duration_s, capacity)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"config": asdict(config), "capacity_rps": capacity, "rows": rows}, f, indent=1
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
