"""One tenant flooding the router with huge prompts: how much slower is another tenant?

    python -m bench.bench_tenant_flood [--seconds 10] [--prompt-chars 3000000] [--json OUT]

Starts a worker (the tiny model on the CPU) and a router as real processes on 127.0.0.1;
the router has the fleet's tokenizer (``--model``, a BPE model directory written for the
run) and per-tenant limits:
tenant ``a`` 1 request in flight and 100 tokens/s, tenant ``b`` generous ones. Tenant b sends
short Generate calls one after another and records their latency, first alone, then while
tenant a sends ``--prompt-chars``-character prompts (about a million tokens) as Explain and
Generate calls, closed-loop on 4 connections. Prints b's p50 / p99 in both phases, their
ratio, a's outcomes, and the router process's CPU seconds in each phase (from /proc).

Everything is bounded (each phase runs ``--seconds``; every call has a deadline) and local.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path

import grpc

from bench.bpe import english_like_text, write_bpe_model_dir
from bench.cpu_budget import own_cpu_seconds
from bench.procs import report, start_kvroute
from kvroute_proto import kvroute_pb2 as pb
from kvroute_proto import kvroute_pb2_grpc as pb_grpc

DEADLINE_S = 10.0
B_PROMPT = "Summarise the weather report for tomorrow in one line, please."


def _request(prompt: str, max_new_tokens: int) -> pb.GenerateRequest:
    req = pb.GenerateRequest(prompt_text=prompt)
    req.sampling.max_new_tokens = max_new_tokens
    req.sampling.ignore_eos = True
    return req


async def _tenant_b(address: str, seconds: float) -> list[float]:
    """Sequential short calls for ``seconds``: their latencies in ms (all must succeed)."""
    out: list[float] = []
    md = (("x-tenant-id", "b"),)
    async with grpc.aio.insecure_channel(address) as ch:
        stub = pb_grpc.RouterStub(ch)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            start = time.perf_counter()
            async for _ in stub.Generate(_request(B_PROMPT, 4), metadata=md, timeout=DEADLINE_S):
                pass
            out.append((time.perf_counter() - start) * 1000)
            await asyncio.sleep(0.02)
    return out


async def _tenant_a(address: str, prompt: str, stop: asyncio.Event, codes: Counter) -> None:
    """One connection of the flood: Explain and Generate in turn until ``stop``."""
    md = (("x-tenant-id", "a"),)
    req = _request(prompt, 16)
    explain = pb.ExplainRequest(request=req)
    options = [("grpc.max_send_message_length", 64 << 20)]
    async with grpc.aio.insecure_channel(address, options=options) as ch:
        stub = pb_grpc.RouterStub(ch)
        i = 0
        while not stop.is_set():
            try:
                if i % 2:
                    await stub.Explain(explain, metadata=md, timeout=DEADLINE_S)
                else:
                    async for _ in stub.Generate(req, metadata=md, timeout=DEADLINE_S):
                        pass
                codes["OK"] += 1
            except grpc.aio.AioRpcError as exc:
                codes[exc.code().name] += 1
            i += 1


async def _phases(address: str, pid: int, seconds: float, prompt: str) -> dict[str, object]:
    cpu0 = own_cpu_seconds(pid)
    alone = await _tenant_b(address, seconds)
    cpu1 = own_cpu_seconds(pid)
    stop, codes = asyncio.Event(), Counter[str]()
    flood = [asyncio.create_task(_tenant_a(address, prompt, stop, codes)) for _ in range(4)]
    await asyncio.sleep(0.5)  # the flood under way
    cpu2 = own_cpu_seconds(pid)
    during = await _tenant_b(address, seconds)
    cpu3 = own_cpu_seconds(pid)
    stop.set()
    await asyncio.gather(*flood)

    def q(xs: list[float], p: float) -> float:
        return statistics.quantiles(xs, n=100)[int(p) - 1] if len(xs) > 1 else xs[0]

    return {
        "b_calls_alone": len(alone),
        "b_p50_ms_alone": round(statistics.median(alone), 2),
        "b_p99_ms_alone": round(q(alone, 99), 2),
        "b_calls_flood": len(during),
        "b_p50_ms_flood": round(statistics.median(during), 2),
        "b_p99_ms_flood": round(q(during, 99), 2),
        "b_p50_ratio": round(statistics.median(during) / statistics.median(alone), 2),
        "a_outcomes": dict(codes),
        "router_cpu_s_alone": round(cpu1 - cpu0, 2),
        "router_cpu_s_flood": round(cpu3 - cpu2, 2),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bench_tenant_flood", description=__doc__)
    p.add_argument("--seconds", type=float, default=10.0, help="length of each phase")
    p.add_argument("--prompt-chars", type=int, default=3_000_000, help="tenant a's prompts")
    p.add_argument("--json", default=None, help="write the result here too")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        model = write_bpe_model_dir(tmp / "model")
        (tmp / "limits").write_text("b 64 1000000\n")
        procs: list[subprocess.Popen] = []
        try:
            worker, worker_address = start_kvroute(
                ["worker", "--executor", "torch", "--model", str(model), "--port", "0"],
                tmp / "worker.log",
            )
            procs.append(worker)
            router, address = start_kvroute(
                [
                    "router", "--port", "0", "--worker", worker_address, "--model", str(model),
                    "--tenant-max-inflight", "1", "--tenant-tokens-per-s", "100",
                    "--tenant-limits", str(tmp / "limits"),
                ],
                tmp / "router.log",
            )  # fmt: skip
            procs.append(router)
            words = english_like_text(args.prompt_chars // 5 + 1, seed=1)
            prompt = words[: args.prompt_chars]
            asyncio.run(asyncio.sleep(1.0))  # the router connects to its worker
            result = asyncio.run(_phases(address, router.pid, args.seconds, prompt))
        finally:
            for proc in procs:
                proc.kill()
                proc.wait(timeout=10)
    result |= {"prompt_chars": args.prompt_chars, "seconds_per_phase": args.seconds}
    report(result, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
