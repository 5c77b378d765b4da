"""The worker's side of the relay stream: its CPU per token and time to first chunk.

::

    python -m bench.bench_relay_worker --seconds 10 --json out/relay_worker.json

One ``kvroute worker --executor sim --sim-speedup 1000`` process (the step cost near zero),
and this process as a router would be to it: one relay stream, ``--concurrency`` (64)
requests kept in flight on it (each a fresh ``--prompt-tokens`` (128) token prompt asking
for ``--max-tokens`` (256) tokens with ``ignore_eos``), a new one started as each finishes.
No router runs: the figures are the worker's own. Reported over the measured window (after
a warm-up): output tokens/s received, the worker's CPU seconds (utime + stime, from /proc)
and CPU microseconds per token, relay batches per second, and the time from writing a
start to reading its first chunk (p50, p99). ``--pin CPU`` puts the worker on that core
alone (this process on the others). ``--rounds K`` starts the worker K times in a row.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
import uuid
from pathlib import Path

import grpc

from bench.bench_dataplane import add_load_args, percentile, stop
from bench.cpu_budget import cpu_seconds
from bench.procs import report, start_kvroute
from kvroute_proto import kvroute_pb2 as pb
from kvroute_proto import kvroute_pb2_grpc as pb_grpc


def _request(rng: random.Random, prompt_tokens: int, max_tokens: int) -> pb.GenerateRequest:
    request = pb.GenerateRequest(request_id=uuid.uuid4().hex)
    request.prompt_token_ids.ids.extend(rng.randrange(1, 250) for _ in range(prompt_tokens))
    request.sampling.max_new_tokens = max_tokens
    request.sampling.ignore_eos = True
    return request


async def drive(address: str, pid: int, args: argparse.Namespace) -> dict[str, object]:
    """Keep ``args.concurrency`` requests in flight on one relay stream; measure."""
    rng = random.Random(1)
    started: dict[str, float] = {}
    firsts: list[float] = []
    tokens = batches = 0
    t0 = time.perf_counter() + args.warmup_s
    t1 = t0 + args.seconds
    async with grpc.aio.insecure_channel(address) as channel:
        call = pb_grpc.WorkerStub(channel).Relay()
        await call.write(pb.RelayRequest(stream_id=uuid.uuid4().hex))
        first = await call.read()
        if first is grpc.aio.EOF or not first.accepts_starts:
            raise SystemExit(f"the worker at {address} takes no starts on its relay stream")

        async def start(n: int) -> None:
            message = pb.RelayRequest()
            for _ in range(n):
                request = _request(rng, args.prompt_tokens, args.max_tokens)
                started[request.request_id] = time.perf_counter()
                message.starts.add(request=request)
            await call.write(message)

        await start(args.concurrency)
        cpu0: float | None = None
        while (now := time.perf_counter()) < t1:
            if cpu0 is None and now >= t0:
                cpu0 = cpu_seconds(pid)
            batch = await call.read()
            if batch is grpc.aio.EOF:
                raise SystemExit("the worker ended the relay stream")
            inside = now >= t0
            batches += inside
            ended = 0
            for response in batch.responses:
                if response.HasField("chunk"):
                    if inside:
                        tokens += len(response.chunk.token_ids)
                    at = started.pop(response.request_id, None)
                    if at is not None and at >= t0:
                        firsts.append(time.perf_counter() - at)
                elif response.HasField("finished"):
                    ended += 1
            ended += len(batch.ends)
            if ended:
                await start(ended)
        cpu = cpu_seconds(pid) - (cpu0 or 0.0)
        call.cancel()
    return {
        "output_tokens_per_s": round(tokens / args.seconds),
        "worker_cpu_s": round(cpu, 3),
        "worker_cpu_us_per_token": round(cpu / max(1, tokens) * 1e6, 2),
        "batches_per_s": round(batches / args.seconds, 1),
        "first_chunk_p50_ms": round(percentile(firsts, 0.5) * 1e3, 2),
        "first_chunk_p99_ms": round(percentile(firsts, 0.99) * 1e3, 2),
        "requests_started": len(firsts),
    }


def run_round(args: argparse.Namespace, logs: Path) -> dict[str, object]:
    ours = os.sched_getaffinity(0)
    if args.pin is not None:
        os.sched_setaffinity(0, {args.pin})  # the worker inherits it
    try:
        proc, address = start_kvroute(
            ["worker", "--executor", "sim", "--sim-speedup", str(args.sim_speedup)],
            logs / "worker.log",
        )
    finally:
        os.sched_setaffinity(0, ours)
    try:
        if args.pin is not None:
            os.sched_setaffinity(0, ours - {args.pin} or ours)
        row = asyncio.run(drive(address, proc.pid, args))
    finally:
        os.sched_setaffinity(0, ours)
        stop(proc)
    print(row, file=sys.stderr, flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_load_args(parser, 10.0, "measured window")
    parser.add_argument("--rounds", type=int, default=1, help="start the worker this many times")
    parser.add_argument("--pin", type=int, metavar="CPU", help="the worker alone on core CPU")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args(argv)
    if args.pin is not None and args.pin not in os.sched_getaffinity(0):
        parser.error(f"--pin {args.pin}: not one of this process's cores")
    with tempfile.TemporaryDirectory(prefix="bench_relay_worker_") as tmp:
        rows = [run_round(args, Path(tmp)) for _ in range(args.rounds)]
    report(
        {
            "bench": "relay_worker",
            "concurrency": args.concurrency,
            "prompt_tokens": args.prompt_tokens,
            "max_tokens": args.max_tokens,
            "sim_speedup": args.sim_speedup,
            "seconds": args.seconds,
            "pin": args.pin,
            "cpu_count": os.cpu_count(),
            "rows": rows,
        },
        args.json,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
