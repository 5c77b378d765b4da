"""Where a worker step's time goes: host time against GPU kernel time, kernel by kernel.

bench_gpu says how long a step takes; this says why. For a few of its steps, with the
fused kernels (``fused="triton"``, what the fastest column runs), it measures the wall time
of the step (median of ``--repeats``), then records ``--steps`` more under torch's profiler
and reports per step: the GPU time summed over every kernel, the number of kernels launched,
the host (CPU) time of torch's ops, the kernels that take the most GPU time, and (cProfile,
``--steps`` more runs) the Python functions that take the most host time.

A step whose wall time is near its kernel time is GPU-bound (faster kernels, fewer bytes);
one whose wall time is far above it waits on the host (launches, Python), which CUDA graphs
or fewer, larger kernels remove. Kernel time well above the roofline is kernels to fuse or
replace. Steps:

* ``decode_b1_eager`` / ``decode_b1_graphs``: one request at 2,048 tokens of context, eager
  and as a CUDA graph replay (the profiler sees the graph's kernels too);
* ``decode_b32_graphs``: 32 requests at 2,048;
* ``prefill_cached_64_after_8000`` / ``..._graphs``: 64 new tokens after 8,000 cached,
  eager and as a graph replay (a lone short prefill).

``--smoke`` runs the tiny model on the CPU (profiling CPU ops only): it checks the script.

Usage::

    python -m bench.gpu_profile --json OUT      # CUDA, Llama-3-8B shape
    python -m bench.gpu_profile --smoke         # anywhere, tiny model
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from bench.bench_gpu import (
    LLAMA3_8B,
    SMOKE_SIZES,
    Sizes,
    _fill_pool_random,
    _item,
    _sync,
    add_run_arguments,
    build_model,
    progress,
    run_device,
    write_json,
)
from worker.engine.model import build_tiny_model
from worker.engine.torch_executor import TorchExecutor
from worker.engine.types import ForwardItem, SamplingParams

GREEDY = SamplingParams(max_new_tokens=1)
TOP_KERNELS = 12
HOST_FUNCTIONS = 18


def _device_time_us(event: object, self_only: bool) -> float:
    """An averaged profiler event's device (GPU) time in us, whatever this torch calls it."""
    names = (
        ("self_device_time_total", "self_cuda_time_total")
        if self_only
        else ("device_time_total", "cuda_time_total")
    )
    for name in names:
        value = getattr(event, name, None)
        if value is not None:
            return float(value)
    return 0.0


def profile_step(
    step: Callable[[], object], device: torch.device, repeats: int, steps: int
) -> dict:
    """Wall median of ``repeats`` runs of ``step`` (after a warm-up), then ``steps`` runs under
    the profiler: per-step kernel time, kernel count, host time and the top kernels."""
    step()
    _sync(device)
    walls = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        step()
        _sync(device)
        walls.append(time.perf_counter() - start)
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
            _sync(device)
    events = prof.key_averages()
    kernels = []
    host_us = 0.0
    for e in events:
        gpu = _device_time_us(e, self_only=True)
        device_type = str(getattr(e, "device_type", "")).lower()
        if gpu > 0 and "cuda" in device_type:
            kernels.append((e.key, e.count / steps, gpu / steps))
        elif "cpu" in device_type or not device_type:
            host_us += float(getattr(e, "self_cpu_time_total", 0.0))
    kernels.sort(key=lambda k: -k[2])
    # Host side, by Python function (what the torch profiler does not see: Triton's
    # launcher, our wrappers): the top of cProfile's own-time table over the same steps.
    python = cProfile.Profile()
    python.enable()
    for _ in range(steps):
        step()
        _sync(device)
    python.disable()
    text = io.StringIO()
    pstats.Stats(python, stream=text).sort_stats("tottime").print_stats(HOST_FUNCTIONS)
    host_top = [line for line in text.getvalue().splitlines() if line.strip()][-HOST_FUNCTIONS:]
    kernel_us = sum(k[2] for k in kernels)
    return {
        "wall_ms": statistics.median(walls) * 1e3,
        "wall_min_ms": min(walls) * 1e3,
        "kernel_ms": kernel_us / 1e3,
        "kernels_per_step": sum(k[1] for k in kernels),
        "host_ms": host_us / steps / 1e3,
        "top": [
            {"kernel": name[:90], "calls": calls, "ms": us / 1e3}
            for name, calls, us in kernels[:TOP_KERNELS]
        ],
        "host_functions": host_top,
    }


def run(*, smoke: bool, device: torch.device, seed: int, repeats: int, steps: int) -> dict:
    sizes = SMOKE_SIZES if smoke else Sizes()
    progress(f"building the {'tiny' if smoke else 'Llama-3-8B-shaped'} model on {device}")
    model = (
        build_tiny_model(seed, device=str(device))
        if smoke
        else build_model(LLAMA3_8B, device, seed)
    )
    on_cuda = device.type == "cuda"
    fused = "triton" if on_cuda else "torch"
    batches = (1, max(sizes.decode_batches))
    ctx = sizes.decode_context
    num_slots = max(max(batches) * ctx, sizes.cached_prefix + sizes.cached_new)
    pool = TorchExecutor.pool_for(model, num_slots, scratch_slot=True)
    eager = TorchExecutor(model, pool, device, seed=seed, attention="paged", fused=fused)
    graphs = TorchExecutor(
        model,
        pool,
        device,
        seed=seed,
        attention="paged",
        fused=fused,
        cuda_graphs=on_cuda,
        static_decode=not on_cuda,
    )
    rng = np.random.default_rng(seed)
    vocab = model.config.vocab_size
    all_slots = np.arange(num_slots, dtype=np.int64)
    results: dict[str, dict] = {}

    def decode_items(b: int) -> list[ForwardItem]:
        items = []
        for i in range(b):
            last = rng.integers(0, vocab, ctx, dtype=np.int64)
            slots = all_slots[i * ctx : (i + 1) * ctx]
            items.append(ForwardItem(f"d{i}", last[ctx - 1 :], ctx - 1, slots, GREEDY, True, 0))
        return items

    # the cached prefix first (real K/V), then random K/V for the decode contexts after it
    n_ctx = sizes.cached_prefix + sizes.cached_new
    tokens = rng.integers(0, vocab, n_ctx, dtype=np.int64)
    eager.forward([_item("prefix", tokens[: sizes.cached_prefix], 0, all_slots)], [])
    cached = _item("cached", tokens, sizes.cached_prefix, all_slots)
    name = f"prefill_cached_{sizes.cached_new}_after_{sizes.cached_prefix}"
    results[name] = profile_step(lambda: eager.forward([cached], []), device, repeats, steps)
    progress(f"{name}: {results[name]['wall_ms']:.2f} ms")
    name += "_graphs"  # the same step as one graph replay (a lone short prefill)
    results[name] = profile_step(lambda: graphs.forward([cached], []), device, repeats, steps)
    progress(f"{name}: {results[name]['wall_ms']:.2f} ms")
    _fill_pool_random(eager, max(batches) * ctx, seed)
    one = decode_items(1)
    runs: list[tuple[str, TorchExecutor, list[ForwardItem]]] = [
        ("decode_b1_eager", eager, one),
        ("decode_b1_graphs", graphs, one),
        (f"decode_b{batches[1]}_graphs", graphs, decode_items(batches[1])),
    ]
    for label, ex, items in runs:

        def decode_step(ex: TorchExecutor = ex, items: list[ForwardItem] = items) -> object:
            return ex.forward([], items)

        results[label] = profile_step(decode_step, device, repeats, steps)
        progress(f"{label}: {results[label]['wall_ms']:.2f} ms")
    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "mode": "smoke" if smoke else "llama3-8b-shape",
        "device": torch.cuda.get_device_name(device) if on_cuda else "cpu",
        "torch": torch.__version__,
        "fused": fused,
        "decode_context": ctx,
        "profiled_steps": steps,
        "steps": results,
    }


def print_report(result: dict) -> None:
    head = f"{result['mode']} on {result['device']} (torch {result['torch']}"
    print(f"{head}, fused={result['fused']})")
    print(f"{'step':32} {'wall ms':>9} {'kernels ms':>11} {'kernels':>8} {'host ms':>9}")
    for name, r in result["steps"].items():
        print(
            f"{name:32} {r['wall_ms']:9.2f} {r['kernel_ms']:11.2f} "
            f"{r['kernels_per_step']:8.0f} {r['host_ms']:9.2f}"
        )
    for name, r in result["steps"].items():
        print(f"\n{name}: top kernels per step (ms, calls)")
        for k in r["top"]:
            print(f"  {k['ms']:8.3f} {k['calls']:6.0f}  {k['kernel']}")
    for name, r in result["steps"].items():
        if name.endswith("_graphs"):
            continue
        print(f"\n{name}: host time by Python function ({result['profiled_steps']} steps)")
        for line in r["host_functions"]:
            print("  " + line[:140])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.gpu_profile",
        description="Per step of the worker's model path: wall time, GPU kernel time, kernel "
        "count, host time and the top kernels (torch profiler). Default: Llama-3-8B shape, "
        "random bf16 weights, CUDA, fused kernels.",
    )
    add_run_arguments(p)
    p.add_argument("--repeats", type=int, default=5, help="timed runs per step (default 5)")
    p.add_argument("--steps", type=int, default=3, help="profiled runs per step (default 3)")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.steps < 1:
        p.error(f"--repeats and --steps must be >= 1, got {args.repeats} and {args.steps}")
    device = run_device(p, args)
    with torch.inference_mode():
        result = run(
            smoke=args.smoke, device=device, seed=args.seed, repeats=args.repeats, steps=args.steps
        )
    print_report(result)
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
