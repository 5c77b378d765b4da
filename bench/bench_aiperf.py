"""NVIDIA's aiperf against ``kvroute up --executor sim --http-port P``, replaying a Mooncake trace.

::

    bench/peers/install_peers.sh aiperf          # once: .peers/aiperf (never a kvroute dependency)
    python -m bench.bench_aiperf --trace tests/bench/data/mooncake_sample.jsonl --workers 4

What it does:

1. takes the first ``--limit`` requests of the trace and divides their timestamps by
   ``--speedup`` (the sim workers run ``--sim-speedup`` at the same factor, so the fleet sees
   the trace's load in fast-forward; the wall-clock latencies aiperf reports times the
   speedup are trace time);
2. writes a byte-level tokenizer (one id per UTF-8 byte, ids 0..255, the sim worker's
   :class:`ByteTokenizer`) as a local Hugging Face cache entry, so aiperf builds each
   hash id's block from its own corpus with exactly the token count the worker will see, and
   nothing is downloaded (aiperf 0.13 loads a tokenizer given as a plain directory path only
   online, hence the cache entry with ``HF_HUB_OFFLINE=1``);
3. starts ``kvroute up --executor sim --workers N --port 0 --http-port P`` and waits until a
   one-token completion goes through its router;
4. runs ``aiperf profile --endpoint-type completions --streaming --custom-dataset-type
   mooncake_trace --fixed-schedule --fixed-schedule-auto-offset --use-server-token-count``
   (``ignore_eos`` so every request generates its trace output length) with a time limit;
5. prints a summary of aiperf's ``profile_export_aiperf.json`` (and writes it as JSON):
   requests, errors, TTFT and request latency percentiles, the prefix-cache hit rate from the
   responses' ``usage.prompt_tokens_details.cached_tokens``, throughput and aiperf's own
   schedule lag (how late it sent requests: a large lag means the box did not keep up);
6. stops the fleet (SIGINT, then SIGKILL of its process group) whatever happened.

Everything binds 127.0.0.1. Needs ``kvroute up --http-port`` (the router's OpenAI front).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from fleetsim.replay.front import REPO_ROOT
from fleetsim.replay.sim_config import DEFAULT_KV_CAPACITY_TOKENS
from fleetsim.replay.trace import TraceRecord, read_trace, write_trace

DEFAULT_AIPERF = REPO_ROOT / ".peers" / "aiperf" / "bin" / "aiperf"
TOKENIZER_REPO = "kvroute/byte-tokenizer"  # a name only: it lives in the run's own HF cache
_SNAPSHOT = "0" * 40
_SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")  # ids 256..259, as ByteTokenizer's


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what the ByteLevel pre-tokenizer emits)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def write_byte_tokenizer(directory: Path) -> Path:
    """A ``tokenizer.json`` + ``tokenizer_config.json`` whose ids are the UTF-8 bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    table = _bytes_to_unicode()
    vocab = {table[b]: b for b in range(256)}
    vocab.update({tok: 256 + i for i, tok in enumerate(_SPECIALS)})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    # The specials are plain vocabulary entries, not added tokens: the text "<s>" stays three
    # byte tokens, as in ByteTokenizer (an added token would be matched inside the text).
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20}
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return directory


def write_tokenizer_cache(hub_dir: Path) -> None:
    """The byte tokenizer as the Hugging Face cache entry ``TOKENIZER_REPO`` under ``hub_dir``."""
    repo = hub_dir / ("models--" + TOKENIZER_REPO.replace("/", "--"))
    write_byte_tokenizer(repo / "snapshots" / _SNAPSHOT)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(_SNAPSHOT, encoding="utf-8")


def scaled_records(records: list[TraceRecord], speedup: float) -> list[TraceRecord]:
    """Timestamps divided by ``speedup`` (whole ms, first request at 0)."""
    if not speedup > 0:
        raise ValueError(f"--speedup must be > 0, got {speedup}")
    t0 = records[0].timestamp_ms if records else 0.0
    return [replace(r, timestamp_ms=float(round((r.timestamp_ms - t0) / speedup))) for r in records]


def aiperf_command(args: argparse.Namespace, url: str, model: str, trace: Path, out: Path) -> list:
    return [
        str(args.aiperf),
        "profile",
        "--url",
        url,
        "--endpoint-type",
        "completions",
        "--streaming",
        "--model",
        model,
        "--tokenizer",
        TOKENIZER_REPO,
        "--input-file",
        str(trace),
        "--custom-dataset-type",
        "mooncake_trace",
        "--prompt-input-tokens-block-size",
        str(args.trace_block_size),
        "--fixed-schedule",
        "--fixed-schedule-auto-offset",
        "--use-server-token-count",
        "--extra-inputs",
        "ignore_eos:true",
        "--request-timeout-seconds",
        str(args.timeout_s),
        "--random-seed",
        str(args.seed),
        "--artifact-dir",
        str(out),
        "--ui",
        "none",
        "--no-server-metrics",
        "--no-gpu-telemetry",
    ]


def _metric(data: dict[str, Any], name: str, stat: str = "avg") -> float:
    value = data.get(name)
    if isinstance(value, dict):
        value = value.get(stat)
    return float(value) if isinstance(value, int | float) else math.nan


def summarize_aiperf(data: dict[str, Any], speedup: float) -> dict[str, float]:
    """The numbers we report from ``profile_export_aiperf.json`` (times in ms, wall clock)."""
    summary = {
        "requests": _metric(data, "request_count"),
        "errors": _metric(data, "error_request_count"),
        "ttft_p50_ms": _metric(data, "time_to_first_token", "p50"),
        "ttft_p99_ms": _metric(data, "time_to_first_token", "p99"),
        "latency_p50_ms": _metric(data, "request_latency", "p50"),
        "latency_p99_ms": _metric(data, "request_latency", "p99"),
        "isl_avg": _metric(data, "input_sequence_length"),
        "osl_avg": _metric(data, "output_sequence_length"),
        "cache_hit_pct": _metric(data, "overall_usage_prompt_cache_read_pct"),
        "request_throughput_rps": _metric(data, "request_throughput"),
        "output_token_throughput": _metric(data, "output_token_throughput"),
        "sched_lag_p99_ms": _metric(data, "replay_sched_lag_p99"),
        "benchmark_duration_s": _metric(data, "benchmark_duration"),
        "speedup": speedup,
    }
    if math.isnan(summary["errors"]):
        summary["errors"] = 0.0
    return summary


def format_summary(s: dict[str, float]) -> str:
    x = s["speedup"]
    return "\n".join(
        [
            f"requests {s['requests']:.0f}, errors {s['errors']:.0f}, "
            f"prefix-cache hit {s['cache_hit_pct']:.1f}% (usage.cached_tokens)",
            f"TTFT p50 {s['ttft_p50_ms']:.1f} ms, p99 {s['ttft_p99_ms']:.1f} ms wall "
            f"(x{x:g} = trace time: {s['ttft_p50_ms'] * x / 1000:.2f} s, "
            f"{s['ttft_p99_ms'] * x / 1000:.2f} s)",
            f"request latency p50 {s['latency_p50_ms']:.1f} ms, p99 {s['latency_p99_ms']:.1f} ms "
            f"wall (trace: {s['latency_p50_ms'] * x / 1000:.2f} s, "
            f"{s['latency_p99_ms'] * x / 1000:.2f} s)",
            f"ISL avg {s['isl_avg']:.0f}, OSL avg {s['osl_avg']:.0f}; "
            f"{s['request_throughput_rps']:.2f} req/s, "
            f"{s['output_token_throughput']:.0f} output tok/s wall; "
            f"schedule lag p99 {s['sched_lag_p99_ms']:.1f} ms; "
            f"{s['benchmark_duration_s']:.1f} s",
        ]
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.bench_aiperf",
        description="Run NVIDIA aiperf (mooncake_trace, fixed schedule) against "
        "kvroute up --executor sim --http-port; print and save its summary.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--trace", required=True, help="Mooncake-format JSONL trace")
    p.add_argument("--trace-block-size", type=int, default=512, help="tokens per hash id")
    p.add_argument("--limit", type=int, default=200, help="the first N requests of the trace")
    p.add_argument("--workers", type=int, default=4, help="sim workers")
    p.add_argument("--policy", default="cache_aware", help="the router's policy")
    p.add_argument(
        "--speedup", type=float, default=10.0, help="trace time and sim executor compressed by"
    )
    p.add_argument(
        "--kv-capacity-tokens",
        type=int,
        default=DEFAULT_KV_CAPACITY_TOKENS,
        help="KV tokens per worker (kvroute replay's default)",
    )
    p.add_argument("--seed", type=int, default=0, help="aiperf's --random-seed")
    p.add_argument("--aiperf", type=Path, default=DEFAULT_AIPERF, help="the aiperf executable")
    p.add_argument("--out", type=Path, default=Path("out/aiperf"), help="artifacts directory")
    p.add_argument("--timeout-s", type=float, default=900.0, help="aiperf's whole run")
    p.add_argument("--startup-timeout-s", type=float, default=120.0, help="the fleet's start")
    return p


async def _wait_fleet(url: str, proc: subprocess.Popen, timeout_s: float) -> str:
    import aiohttp

    from fleetsim.replay.live_http import front_model, wait_probe

    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5.0)) as session:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"kvroute up exited (rc={proc.returncode}) before it was ready")
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.get(url + "/health") as resp:
                    if resp.status == 200:
                        break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url}/health not 200 after {timeout_s}s")
            await asyncio.sleep(0.2)
        model = await front_model(session, url)
    if model is None:
        raise RuntimeError(f"{url}/v1/models lists no model")
    await wait_probe(url, model, max(1.0, deadline - time.monotonic()), None)
    return model


def _stop(proc: subprocess.Popen, timeout_s: float = 20.0) -> None:
    """Ctrl-C to a process group leader (``kvroute up`` stops its workers, aiperf its
    services), then SIGKILL of whatever is left in the group."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=timeout_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # anything left in the group
    proc.wait()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from fleetsim.replay.live_http import free_port

    if not args.aiperf.exists():
        print(
            f"bench_aiperf: {args.aiperf} is missing; run bench/peers/install_peers.sh aiperf",
            file=sys.stderr,
        )
        return 2
    try:
        records = scaled_records(
            read_trace(args.trace, args.trace_block_size, args.limit), args.speedup
        )
    except (OSError, ValueError) as exc:
        print(f"bench_aiperf: {exc}", file=sys.stderr)
        return 2
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    trace = out / "trace.jsonl"
    write_trace(trace, records)
    hub = out / "hf-hub"
    write_tokenizer_cache(hub)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    up = [
        sys.executable,
        "-m",
        "kvroute_cli",
        "up",
        "--executor",
        "sim",
        "--workers",
        str(args.workers),
        "--port",
        "0",
        "--http-port",
        str(port),
        "--policy",
        args.policy,
        f"--worker-arg=--sim-speedup={args.speedup}",
        f"--worker-arg=--kv-slots={args.kv_capacity_tokens}",
        "--worker-arg=--sim-max-context-tokens=1048576",
        f"--worker-arg=--load-interval-s={max(0.05, 1.0 / args.speedup)}",
    ]
    print("$ " + " ".join(up), flush=True)
    with open(out / "kvroute_up.log", "wb") as log:
        fleet = subprocess.Popen(
            up, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, start_new_session=True
        )
    try:
        model = asyncio.run(_wait_fleet(url, fleet, args.startup_timeout_s))
        cmd = aiperf_command(args, url, model, trace, out / "aiperf")
        print("$ " + " ".join(cmd), flush=True)
        env = {**os.environ, "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}
        with open(out / "aiperf.log", "wb") as alog:
            bench = subprocess.Popen(
                cmd, stdout=alog, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        try:
            rc = bench.wait(timeout=args.timeout_s + 120)  # its own limit, plus set-up
        finally:
            _stop(bench)  # its service processes too, on a timeout or Ctrl-C
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"bench_aiperf: {exc}; logs in {out}", file=sys.stderr)
        return 1
    finally:
        _stop(fleet)
    export = out / "aiperf" / "profile_export_aiperf.json"
    if rc != 0 or not export.exists():
        log_path = out / "aiperf.log"
        print(f"bench_aiperf: aiperf exited with rc={rc}; see {log_path}", file=sys.stderr)
        return 1
    summary = summarize_aiperf(json.loads(export.read_text()), args.speedup)
    summary.update(requests_in_trace=len(records), workers=args.workers)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    print(format_summary(summary))
    print(f"wrote {out / 'summary.json'} (aiperf's own exports under {out / 'aiperf'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
