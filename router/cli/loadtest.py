"""``kvroute loadtest``: a bounded closed-loop load driver for a router (gRPC or its OpenAI
HTTP front), on loopback or anywhere you point it.

    kvroute loadtest --router 127.0.0.1:50051 --concurrency 64 --duration 30
    kvroute loadtest --http http://127.0.0.1:8000 --concurrency 16 --duration 10 --json OUT

``--concurrency`` loops each send one streaming request after another until ``--duration``
seconds have passed (no new request after that; the ones in flight end within their
``--timeout``). Prompts are random token ids of ``--prompt-tokens`` tokens whose first
``--shared-prefix-tokens`` are one of ``--prefix-groups`` shared prefixes (so a cache-aware
router has something to find), with ``--max-new-tokens`` generated (ignore_eos). Reported:
requests, throughput (requests and output tokens per second), TTFT and end-to-end latency
percentiles of the successful requests, and every failure by status code (gRPC code, or
``HTTP nnn``). The exit status is 1 when any request failed, 0 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc

from edge.cli_help import HelpFormatter
from kvroute_proto import kvroute_pb2 as pb
from kvroute_proto import kvroute_pb2_grpc as pb_grpc

MAX_CONCURRENCY = 4096
MAX_DURATION_S = 3600.0


@dataclass(frozen=True, slots=True)
class LoadConfig:
    """What to send, how many at a time, for how long."""

    concurrency: int = 8
    duration_s: float = 10.0
    prompt_tokens: int = 128
    shared_prefix_tokens: int = 64
    prefix_groups: int = 8
    max_new_tokens: int = 32
    timeout_s: float = 30.0
    seed: int = 0
    vocab: int = 250  # token ids are drawn from 1..vocab (the byte tokenizer's range)

    def __post_init__(self) -> None:
        if not 1 <= self.concurrency <= MAX_CONCURRENCY:
            raise ValueError(
                f"--concurrency must be in 1..{MAX_CONCURRENCY}, got {self.concurrency}"
            )
        if not 0 < self.duration_s <= MAX_DURATION_S:
            raise ValueError(
                f"--duration must be in (0, {MAX_DURATION_S:g}], got {self.duration_s}"
            )
        if self.prompt_tokens < 1:
            raise ValueError(f"--prompt-tokens must be >= 1, got {self.prompt_tokens}")
        if not 0 <= self.shared_prefix_tokens <= self.prompt_tokens:
            raise ValueError(
                f"--shared-prefix-tokens must be in 0..--prompt-tokens ({self.prompt_tokens}), "
                f"got {self.shared_prefix_tokens}"
            )
        if self.prefix_groups < 1:
            raise ValueError(f"--prefix-groups must be >= 1, got {self.prefix_groups}")
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if not self.timeout_s > 0:
            raise ValueError(f"--timeout must be > 0, got {self.timeout_s}")


@dataclass(slots=True)
class Sample:
    code: str  # "OK", a gRPC status name, or "HTTP nnn"
    ttft_s: float | None
    e2e_s: float
    output_tokens: int


@dataclass
class LoadReport:
    config: LoadConfig
    target: str
    wall_s: float = 0.0
    samples: list[Sample] = field(default_factory=list)

    def summary(self) -> dict:
        ok = [s for s in self.samples if s.code == "OK"]
        errors = Counter(s.code for s in self.samples if s.code != "OK")
        ttft = sorted(s.ttft_s for s in ok if s.ttft_s is not None)
        e2e = sorted(s.e2e_s for s in ok)
        wall = self.wall_s or math.nan
        return {
            "target": self.target,
            "concurrency": self.config.concurrency,
            "duration_s": self.config.duration_s,
            "prompt_tokens": self.config.prompt_tokens,
            "max_new_tokens": self.config.max_new_tokens,
            "wall_s": round(self.wall_s, 3),
            "requests": len(self.samples),
            "ok": len(ok),
            "errors": dict(sorted(errors.items())),
            "requests_per_s": round(len(ok) / wall, 2),
            "output_tokens_per_s": round(sum(s.output_tokens for s in ok) / wall, 1),
            "ttft_ms": _percentiles(ttft),
            "e2e_ms": _percentiles(e2e),
        }


def _percentiles(sorted_s: list[float]) -> dict[str, float]:
    if not sorted_s:
        return {}
    n = len(sorted_s)

    def q(p: float) -> float:
        return round(1000 * sorted_s[min(n - 1, int(p * n))], 2)

    return {"p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "max": round(1000 * sorted_s[-1], 2)}


class Prompts:
    """Random prompts (seeded): a shared prefix out of ``prefix_groups``, then a random tail."""

    def __init__(self, config: LoadConfig) -> None:
        self.config = config
        self._rng = random.Random(config.seed)
        rng = random.Random(config.seed + 1)
        self._prefixes = [
            [rng.randint(1, config.vocab) for _ in range(config.shared_prefix_tokens)]
            for _ in range(config.prefix_groups)
        ]

    def next(self) -> list[int]:
        c, rng = self.config, self._rng
        head = self._prefixes[rng.randrange(c.prefix_groups)]
        return head + [rng.randint(1, c.vocab) for _ in range(c.prompt_tokens - len(head))]


async def _grpc_one(stub: pb_grpc.RouterStub, ids: list[int], c: LoadConfig, md) -> Sample:
    req = pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=ids),
        sampling=pb.SamplingParams(max_new_tokens=c.max_new_tokens, ignore_eos=True),
    )
    start = time.perf_counter()
    ttft: float | None = None
    tokens = 0
    try:
        async for msg in stub.Generate(req, timeout=c.timeout_s, metadata=md):
            if msg.HasField("chunk") and msg.chunk.token_ids:
                if ttft is None:
                    ttft = time.perf_counter() - start
                tokens += len(msg.chunk.token_ids)
    except grpc.aio.AioRpcError as exc:
        return Sample(exc.code().name, ttft, time.perf_counter() - start, tokens)
    return Sample("OK", ttft, time.perf_counter() - start, tokens)


async def _http_one(session, url: str, ids: list[int], c: LoadConfig, headers) -> Sample:
    import aiohttp

    body = {
        "prompt": ids,
        "max_tokens": c.max_new_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},  # exact output token counts
    }
    start = time.perf_counter()
    ttft: float | None = None
    tokens = 0
    try:
        async with session.post(
            f"{url.rstrip('/')}/v1/completions",
            json=body,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=c.timeout_s),
        ) as resp:
            if resp.status != 200:
                await resp.read()
                return Sample(f"HTTP {resp.status}", None, time.perf_counter() - start, 0)
            async for raw in resp.content:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    return Sample("stream error", ttft, time.perf_counter() - start, tokens)
                if ttft is None and any(ch.get("text") for ch in event.get("choices", ())):
                    ttft = time.perf_counter() - start
                usage = event.get("usage")
                if usage:
                    tokens = usage.get("completion_tokens", tokens)
    except TimeoutError:
        return Sample("DEADLINE_EXCEEDED", ttft, time.perf_counter() - start, tokens)
    except aiohttp.ClientError as exc:
        return Sample(type(exc).__name__, ttft, time.perf_counter() - start, tokens)
    return Sample("OK", ttft, time.perf_counter() - start, tokens)


async def run_load(
    config: LoadConfig,
    *,
    router: str | None = None,
    http_url: str | None = None,
    api_key: str | None = None,
) -> LoadReport:
    """Drive the router for ``config.duration_s`` with ``config.concurrency`` loops."""
    if (router is None) == (http_url is None):
        raise ValueError("give exactly one of --router HOST:PORT and --http URL")
    prompts = Prompts(config)
    report = LoadReport(config, router or http_url or "")
    start = time.perf_counter()
    stop_at = start + config.duration_s

    if router is not None:
        md = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        async with grpc.aio.insecure_channel(router) as ch:
            stub = pb_grpc.RouterStub(ch)

            async def grpc_loop() -> None:
                while time.perf_counter() < stop_at:
                    report.samples.append(await _grpc_one(stub, prompts.next(), config, md))

            await asyncio.gather(*(grpc_loop() for _ in range(config.concurrency)))
    else:
        import aiohttp

        assert http_url is not None
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        connector = aiohttp.TCPConnector(limit=config.concurrency)
        async with aiohttp.ClientSession(connector=connector) as session:

            async def http_loop() -> None:
                while time.perf_counter() < stop_at:
                    sample = await _http_one(session, http_url, prompts.next(), config, headers)
                    report.samples.append(sample)

            await asyncio.gather(*(http_loop() for _ in range(config.concurrency)))
    report.wall_s = time.perf_counter() - start
    return report


def format_summary(s: dict) -> str:
    ttft, e2e = s["ttft_ms"], s["e2e_ms"]

    def pct(d: dict) -> str:
        return " ".join(f"{k}={v:.1f}" for k, v in d.items()) if d else "-"

    errors = ", ".join(f"{n} {code}" for code, n in s["errors"].items()) or "none"
    return "\n".join(
        [
            f"target {s['target']}: {s['concurrency']} concurrent for {s['duration_s']:g} s "
            f"({s['prompt_tokens']} prompt tokens, {s['max_new_tokens']} new)",
            f"requests {s['requests']}  ok {s['ok']}  errors: {errors}",
            f"throughput {s['requests_per_s']} req/s, {s['output_tokens_per_s']} output tok/s "
            f"over {s['wall_s']:.1f} s",
            f"TTFT ms  {pct(ttft)}",
            f"e2e ms   {pct(e2e)}",
        ]
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvroute loadtest",
        description="Closed-loop load against a router: throughput, TTFT and end-to-end "
        "latency percentiles, errors by code. Exit 1 when any request failed.",
        formatter_class=HelpFormatter,
    )
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--router", metavar="HOST:PORT", help="the router's gRPC address")
    target.add_argument("--http", metavar="URL", help="the router's OpenAI HTTP front")
    d = LoadConfig()
    p.add_argument("--concurrency", type=int, default=d.concurrency, help="requests in flight")
    p.add_argument("--duration", type=float, default=d.duration_s, help="seconds of load")
    p.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens, help="prompt length")
    p.add_argument(
        "--shared-prefix-tokens",
        type=int,
        default=d.shared_prefix_tokens,
        help="leading tokens shared within a prefix group",
    )
    p.add_argument("--prefix-groups", type=int, default=d.prefix_groups, help="shared prefixes")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help="tokens out")
    p.add_argument("--timeout", type=float, default=d.timeout_s, help="per-request deadline (s)")
    p.add_argument("--seed", type=int, default=d.seed, help="prompt generator seed")
    p.add_argument("--api-key", default=None, help="bearer API key (router --api-keys)")
    p.add_argument("--json", metavar="OUT", default=None, help="also write the summary as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = LoadConfig(
            concurrency=args.concurrency,
            duration_s=args.duration,
            prompt_tokens=args.prompt_tokens,
            shared_prefix_tokens=min(args.shared_prefix_tokens, args.prompt_tokens),
            prefix_groups=args.prefix_groups,
            max_new_tokens=args.max_new_tokens,
            timeout_s=args.timeout,
            seed=args.seed,
        )
    except ValueError as exc:
        print(f"kvroute loadtest: {exc}", file=sys.stderr)
        return 2
    report = asyncio.run(
        run_load(config, router=args.router, http_url=args.http, api_key=args.api_key)
    )
    summary = report.summary()
    print(format_summary(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
            f.write("\n")
    return 1 if summary["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
