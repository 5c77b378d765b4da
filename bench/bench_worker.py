"""Worker benchmarks: serving-loop throughput and time to first token with a cached prefix.

Keys written with ``--json OUT``:

* ``sched_req_s``: requests per second the serving loop takes from arrival (add_request) to
  finish with the simulated executor at zero cost -- pure scheduling + cache overhead.
  Short prompts (a shared 16-token system prompt + a unique tail), a few output tokens each,
  with the waiting queue kept topped up (closed loop). Default engine config (LPM policy);
  ``sched_req_s_fcfs`` is the same with FCFS; ``sched_req_s_step_reports`` the same with the
  step reports a ``--step-reports`` worker builds (worker/engine/load_reports.py: a load report
  at a step's start and after it, when due; built, not sent).
* ``prefill_cold_s`` / ``prefill_cached_s``: time to first token of a 2,048-token shared
  prefix + 64-token suffix on the torch executor's tiny default model, cold and then with the
  prefix cached (another suffix).

Usage::

    python -m bench.bench_worker [--quick] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import dataclass

import numpy as np

from worker.engine.engine import Engine, EngineConfig
from worker.engine.load_reports import StepReports
from worker.engine.sim_executor import SimCostModel, SimExecutor, SimExecutorConfig
from worker.engine.types import EngineRequest, SamplingParams


@dataclass(frozen=True, slots=True)
class SchedBenchConfig:
    num_requests: int = 20_000
    prompt_tokens: int = 48  # 16 shared + 32 unique
    shared_tokens: int = 16
    max_new_tokens: int = 4
    queue_depth: int = 512  # waiting requests kept topped up
    schedule_policy: str = "lpm"
    seed: int = 0
    step_reports: bool = False


def bench_sched(cfg: SchedBenchConfig) -> dict[str, float]:
    """Requests/s from arrival to finish through Engine.step with a zero-cost sim executor."""
    vocab = 32_000
    rng = np.random.default_rng(cfg.seed)
    shared = rng.integers(1, vocab, cfg.shared_tokens)
    unique = rng.integers(1, vocab, (cfg.num_requests, cfg.prompt_tokens - cfg.shared_tokens))
    prompts = [np.concatenate((shared, u)) for u in unique]
    sampling = SamplingParams(max_new_tokens=cfg.max_new_tokens)
    executor = SimExecutor(
        SimCostModel.zero(), SimExecutorConfig(vocab_size=vocab, max_context_tokens=8192)
    )
    engine = Engine(
        EngineConfig(schedule_policy=cfg.schedule_policy, max_waiting_requests=cfg.queue_depth),
        executor,
        clock=time.monotonic,
    )
    reports = StepReports(engine) if cfg.step_reports else None

    def at_start() -> None:
        load = reports.at_step_start()  # type: ignore[union-attr]
        if load is not None:
            reports.published(load)  # type: ignore[union-attr]

    finished = 0
    next_i = 0
    steps = 0
    t0 = time.perf_counter()
    c0 = time.process_time()
    while finished < cfg.num_requests:
        while next_i < cfg.num_requests and engine.num_waiting < cfg.queue_depth:
            engine.add_request(EngineRequest(f"r{next_i}", prompts[next_i], sampling))
            next_i += 1
        for out in engine.step() if reports is None else engine.step(at_start):
            if out.finish_reason is not None:
                finished += 1
        if reports is not None and (load := reports.after_step()) is not None:
            reports.published(load)
        steps += 1
    elapsed = time.perf_counter() - t0
    cpu = time.process_time() - c0
    stats = engine.stats()
    assert stats.generated_tokens == cfg.num_requests * cfg.max_new_tokens
    return {
        "req_s": cfg.num_requests / elapsed,
        "req_per_cpu_s": cfg.num_requests / cpu,
        "elapsed_s": elapsed,
        "steps": steps,
        "tokens_s": stats.generated_tokens / elapsed,
        "cached_prompt_fraction": stats.cached_prompt_tokens / stats.prompt_tokens,
    }


def bench_prefill(
    prefix_tokens: int = 2048, suffix_tokens: int = 64, repeats: int = 5
) -> dict[str, float]:
    """TTFT on the torch executor (tiny default model): cold, then with the prefix cached.
    Best of ``repeats`` (a cold run after a cache reset, then a cached run): the minimum is
    the run least disturbed by other processes on a shared machine."""
    try:
        from worker.engine.factory import build_executor
    except ImportError as exc:  # pragma: no cover - depends on the torch helper's module
        raise NotImplementedError(
            f"prefill benchmark needs worker.engine.factory.build_executor: {exc}"
        ) from exc
    num_slots = 4 * (prefix_tokens + suffix_tokens) + 64
    executor, _tokenizer = build_executor("torch", num_kv_slots=num_slots, seed=0)
    engine = Engine(EngineConfig(num_kv_slots=num_slots), executor, clock=time.monotonic)
    rng = np.random.default_rng(1)
    vocab = executor.vocab_size
    prefix = rng.integers(0, vocab, prefix_tokens)
    ids = iter(range(1_000_000))

    def ttft() -> tuple[float, int]:
        request_id = f"q{next(ids)}"
        prompt = np.concatenate((prefix, rng.integers(0, vocab, suffix_tokens)))
        engine.add_request(EngineRequest(request_id, prompt, SamplingParams(max_new_tokens=1)))
        t0 = time.perf_counter()
        while True:
            for out in engine.step():
                if out.request_id == request_id:
                    assert out.usage is not None
                    return time.perf_counter() - t0, out.usage.cached_prompt_tokens

    ttft()  # first-call overheads (allocations, kernels) out of the measurement
    cold, cached, hits = [], [], 0
    for _ in range(repeats):
        engine.cache.reset()
        cold.append(ttft()[0])
        t, hits = ttft()
        cached.append(t)
    return {
        "cold_s": min(cold),
        "cached_s": min(cached),
        "cached_tokens": hits,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bench_worker", description="Worker serving-loop and prefill benchmarks."
    )
    parser.add_argument("--json", metavar="OUT", help="write the results as JSON to OUT")
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    parser.add_argument(
        "--no-torch", action="store_true", help="skip the torch prefill benchmark (keys = null)"
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch CPU threads for the prefill benchmark (default 1: on a small shared CPU, "
        "more threads spin against other processes and run many times slower)",
    )
    args = parser.parse_args(argv)

    n = 2_000 if args.quick else 20_000
    lpm = bench_sched(SchedBenchConfig(num_requests=n))
    fcfs = bench_sched(SchedBenchConfig(num_requests=n, schedule_policy="fcfs"))
    reported = bench_sched(SchedBenchConfig(num_requests=n, step_reports=True))
    results: dict[str, object] = {
        "sched_req_s": lpm["req_s"],
        "sched_req_s_fcfs": fcfs["req_s"],
        "sched_req_s_step_reports": reported["req_s"],
        "sched_req_per_cpu_s": lpm["req_per_cpu_s"],
        "sched_tokens_s": lpm["tokens_s"],
        "sched_num_requests": n,
        "prefill_cold_s": None,
        "prefill_cached_s": None,
    }
    if not args.no_torch:
        import torch

        torch.set_num_threads(args.torch_threads)
        results["torch_threads"] = args.torch_threads
        if args.quick:
            prefill = bench_prefill(prefix_tokens=256, suffix_tokens=16, repeats=1)
        else:
            prefill = bench_prefill()
        results["prefill_cold_s"] = prefill["cold_s"]
        results["prefill_cached_s"] = prefill["cached_s"]
        results["prefill_prefix_tokens"] = 256 if args.quick else 2048
        results["prefill_cached_tokens"] = prefill["cached_tokens"]
    results["machine"] = f"{platform.platform()}, {os.cpu_count()} CPUs"
    results["date"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())

    rows = [
        ("sched_req_s (lpm, zero-cost sim)", results["sched_req_s"], "req/s"),
        ("sched_req_s_fcfs", results["sched_req_s_fcfs"], "req/s"),
        ("sched_req_s_step_reports (lpm)", results["sched_req_s_step_reports"], "req/s"),
        ("sched_req_per_cpu_s (lpm, CPU time)", results["sched_req_per_cpu_s"], "req/s"),
        ("sched_tokens_s (lpm)", results["sched_tokens_s"], "tok/s"),
        ("prefill_cold_s (torch tiny)", results["prefill_cold_s"], "s"),
        ("prefill_cached_s (torch tiny)", results["prefill_cached_s"], "s"),
    ]
    width = max(len(r[0]) for r in rows)
    for name, value, unit in rows:
        if not isinstance(value, (int, float)):
            shown = "n/a"
        else:
            shown = f"{value:,.4f}" if value < 100 else f"{value:,.0f}"
        print(f"{name:<{width}}  {shown:>14} {unit}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
