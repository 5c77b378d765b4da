"""The data plane, A/B in the same window: a base checkout's router against this one's.

On a box other jobs load, fronts measured one after the other see different loads; here both
routers (and the direct path) serve the same closed-loop load *at the same time*, in front
of the same two sim workers (this checkout's; a worker serves a router of decision 0033 as
before), so the box's load falls on both alike. Per concurrency and front door (HTTP/SSE,
gRPC), each round runs: direct to the workers' HTTP APIs (split evenly), the base router,
and this checkout's router, each with ``--concurrency`` streams, in one window; it reports
each router's tokens per CPU-second and TTFT p50 (and their excess over the direct path's).

    git worktree add /tmp/base BASE_COMMIT
    python -m bench.bench_dataplane_ab --base /tmp/base --concurrency 1 8 64
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from bench.bench_dataplane import (
    Load,
    Tally,
    _grpc,
    _http,
    free_port,
    percentile,
    start_workers,
    stop,
    wait_ready,
)
from bench.cpu_budget import cpu_seconds
from bench.procs import ROOT, report, start_kvroute


def start_router(workers: list[str], logs: Path, name: str, base: Path | None):
    """``kvroute router`` from this checkout, or from ``base`` (its own protobuf stubs)."""
    http_port = free_port()
    args = ["router", "--port", "0", "--http-port", str(http_port)]
    for address in workers:
        args += ["--worker", address]
    if base is None:
        proc, address = start_kvroute(args, logs / f"router-{name}.log")
    else:
        stubs = logs / "base-stubs"
        stubs.mkdir(exist_ok=True)
        link = stubs / "kvroute_proto"
        if not link.exists():
            link.symlink_to(base.resolve() / "proto")
        env = {"PYTHONPATH": str(stubs)}
        proc, address = start_kvroute(args, logs / f"router-{name}.log", cwd=base, env=env)
    return proc, address, f"http://127.0.0.1:{http_port}"


Client = Callable[[Tally], Awaitable[None]]


async def measure_together(load: Load, fronts: list[tuple[str, int | None, Client]]) -> list[dict]:
    """Run every front's client in one window; each front's row."""
    t0 = time.perf_counter() + load.warmup_s
    tallies = [Tally(t0=t0, t1=t0 + load.seconds) for _ in fronts]
    tasks = [
        asyncio.ensure_future(client(t)) for (_, _, client), t in zip(fronts, tallies, strict=True)
    ]
    await asyncio.sleep(max(0.0, t0 - time.perf_counter()))
    cpu0 = [cpu_seconds(pid) if pid else 0.0 for _, pid, _ in fronts]
    await asyncio.sleep(max(0.0, t0 + load.seconds - time.perf_counter()))
    cpu = [
        cpu_seconds(pid) - c if pid else 0.0 for (_, pid, _), c in zip(fronts, cpu0, strict=True)
    ]
    await asyncio.gather(*tasks)
    rows = []
    for (name, pid, _), tally, used in zip(fronts, tallies, cpu, strict=True):
        rows.append(
            {
                "front": name,
                "output_tokens_per_s": round(tally.tokens / load.seconds),
                "front_cpu_s": round(used, 2) if pid else None,
                "tokens_per_front_cpu_s": round(tally.tokens / used) if pid and used else None,
                "ttft_p50_ms": round(percentile(tally.ttfts, 0.5) * 1e3, 3),
                "ttft_p99_ms": round(percentile(tally.ttfts, 0.99) * 1e3, 3),
                "tokens_per_message": round(tally.tokens / max(1, tally.messages), 2),
                "requests_started": len(tally.ttfts),
                "errors": tally.errors,
            }
        )
    return rows


async def run(args: argparse.Namespace, logs: Path) -> list[dict]:
    fleet = start_workers(2, args.sim_speedup, logs)
    routers = []
    try:
        base = start_router(fleet.grpc_addresses, logs, "base", Path(args.base))
        routers.append(base[0])
        this = start_router(fleet.grpc_addresses, logs, "this", None)
        routers.append(this[0])
        for url in (fleet.http_urls[0], base[2], this[2]):
            await wait_ready(url)
        results = []
        for concurrency in args.concurrency:
            load = Load(
                concurrency, args.prompt_tokens, args.max_tokens, args.warmup_s, args.seconds
            )
            for rnd in range(1, args.rounds + 1):
                for door in ("HTTP/SSE", "gRPC"):
                    make = _http if door == "HTTP/SSE" else _grpc
                    at = 2 if door == "HTTP/SSE" else 1
                    fronts = [
                        ("direct", None, _http(fleet.http_urls, load)),
                        (f"base {door}", base[0].pid, make(base[at], load)),
                        (f"this {door}", this[0].pid, make(this[at], load)),
                    ]
                    rows = await measure_together(load, fronts)
                    for row in rows:
                        row.update(concurrency=concurrency, round=rnd, door=door)
                    print(_line(rows), file=sys.stderr, flush=True)
                    results += rows
        return results
    finally:
        for proc in routers + fleet.procs:
            stop(proc)


def _line(rows: list[dict]) -> str:
    direct, base, this = rows
    d = direct["ttft_p50_ms"]
    return (
        f"c={base['concurrency']} r{base['round']} {base['door']}: tokens/CPU-s base "
        f"{base['tokens_per_front_cpu_s']} this {this['tokens_per_front_cpu_s']}; TTFT p50 "
        f"direct {d} base +{base['ttft_p50_ms'] - d:.2f} this +{this['ttft_p50_ms'] - d:.2f} ms"
    )


def _commit(checkout: Path) -> str:
    """The checkout's commit (short hash; ``+`` when its tree has changes)."""
    git = ["git", "-C", str(checkout)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(
        [*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
    )
    return head.stdout.strip() + ("+" if dirty.stdout.strip() else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="a checkout of the base commit")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=8.0, help="measured window per round")
    parser.add_argument("--warmup-s", type=float, default=1.5)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--sim-speedup", type=float, default=1000.0)
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_dataplane_ab_") as tmp:
        rows = asyncio.run(run(args, Path(tmp)))
    report(
        {
            "bench": "dataplane_ab",
            "base": _commit(Path(args.base)),
            "this": _commit(ROOT),
            "prompt_tokens": args.prompt_tokens,
            "max_tokens": args.max_tokens,
            "sim_speedup": args.sim_speedup,
            "seconds": args.seconds,
            "rows": rows,
        },
        args.json,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
