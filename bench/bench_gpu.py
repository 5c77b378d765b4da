"""The worker's model path at the GPU's limit: step times against their roofline.

On a CUDA machine this builds a Llama-3-8B-shaped model (random bf16 weights, nothing to
download) with the project's ``LlamaForCausalLM`` + ``TorchExecutor`` and measures:

* ``prefill_cold``: one cold prefill of 2,048 and of 8,064 tokens (tokens/s);
* ``prefill_cached``: 64 new tokens after 8,000 cached (the step a cache hit leaves);
* ``mixed``: those 64 tokens in one step with a decode batch of 32 at 2,048 tokens of
  context (a busy worker's step: a cache hit joining running requests);
* ``decode``: one decode step at batch 1 / 8 / 32 / 128, every request at 2,048 tokens of
  context, and the tokens/s of the full batch;
* the roofline of each: max(bytes moved / HBM bandwidth, FLOPs / peak FLOP/s) -- weights
  streamed once per step plus the KV read, and 2 FLOPs per parameter per token plus
  attention -- with the GPU's specs looked up by name (``--hbm-gbps`` / ``--peak-tflops``
  override);
* ``parity``: greedy output through the ``Engine`` with the prefix cached equals the cold
  run (same prompt, same tokens);
* ``peak_memory_bytes``.

Every step runs once per attention backend of the executor (``--attention``, default
``gather,paged``: today's gather + SDPA path and ``worker.engine.paged_attention``, the
Triton kernels on CUDA), alternating backends inside each step's repeats so both see the
same machine. ``steps`` / ``parity`` / ``decode_full_batch_tokens_s`` are the first
backend's (what ``SimCostModel.from_bench_gpu`` fits); ``*_by_attention`` hold every
backend's, side by side in the printed table.

``--cuda-graphs`` adds, after each paged option, its decode steps with CUDA graphs
(``TorchExecutor(cuda_graphs=True)``: a decode step is one graph replay per batch/context
bucket; a lone prefill of at most 512 new tokens likewise) as the column ``<option>+graphs``;
only the decode steps, the cached-prefill step and the parity run are measured for it (its
cold prefills are the option's own). Off CUDA (``--smoke`` on the CPU) that
column runs the same padded static-shape decode path eagerly (``static_decode``): it checks
the script, not the speed. ``decode_path`` in the JSON says which ran.

``--fused`` adds, after each paged column (``paged``, ``paged+graphs``), the same executor
with ``fused="triton"`` (``worker.engine.fused_ops``: each layer's residual add fused into its
RMSNorm, RoPE over q and k in one pass) as ``<column>+fused``; off CUDA it runs
``fused="torch"`` (the same structure in torch ops: it checks the script, not the speed).
``fused_impl`` in the JSON says which ran. A ``+graphs+fused`` column times decode steps only.

``--smoke`` runs the same code on the project's tiny model with small sizes on the CPU (or
``--device``): seconds, for tests and for a machine without a GPU. The numbers it prints are
of no interest; that every figure is produced is.

Decode contexts are not prefilled: their KV slots are filled with random values (the step's
cost does not depend on them), so the script stays well under three minutes.

Usage::

    python -m bench.bench_gpu --json OUT            # CUDA, Llama-3-8B shape
    python -m bench.bench_gpu --smoke --json OUT    # anywhere, tiny model
    python -m bench.bench_gpu --attention gather,paged-triton --json OUT
    python -m bench.bench_gpu --cuda-graphs --json OUT   # + the paged decode as CUDA graphs
    python -m bench.bench_gpu --cuda-graphs --fused --json OUT   # + fused RMSNorm/RoPE columns
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import TextIO

import numpy as np
import torch

from worker.engine.engine import Engine, EngineConfig
from worker.engine.model import LlamaConfig, LlamaForCausalLM, build_tiny_model
from worker.engine.paged_attention import ATTENTION_CHOICES
from worker.engine.torch_executor import TorchExecutor
from worker.engine.types import EngineRequest, ForwardItem, SamplingParams

# Llama-3-8B (config.json of meta-llama/Meta-Llama-3-8B), bf16.
LLAMA3_8B = LlamaConfig(
    vocab_size=128_256,
    hidden_size=4096,
    intermediate_size=14_336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=500_000.0,
    eos_token_ids=(128_001,),
    dtype=torch.bfloat16,
)

# (HBM bytes/s, dense bf16 FLOP/s) by a substring of torch.cuda.get_device_name().
GPU_SPECS: dict[str, tuple[float, float]] = {
    "H200": (4.8e12, 989e12),
    "H100": (3.35e12, 989e12),  # SXM
    "A100": (2.039e12, 312e12),  # 80 GB SXM
    "L40S": (0.864e12, 362e12),
}

# Issue 14's targets, in seconds per step (None: no target).
TARGETS_S: dict[str, float] = {
    "decode_b1": 0.005,
    "decode_b32": 0.008,
    "decode_b128": 0.015,
    "prefill_cold_8064": 8064 / 30_000,
    "prefill_cached_64_after_8000": 0.008,
}


@dataclass(frozen=True, slots=True)
class Sizes:
    """Token counts of one run."""

    cold: tuple[int, ...] = (2048, 8064)
    cached_prefix: int = 8000
    cached_new: int = 64
    decode_context: int = 2048
    decode_batches: tuple[int, ...] = (1, 8, 32, 128)
    mixed_decode_batch: int = 32  # decode rows beside the cached prefill in the mixed step
    parity_prefix: int = 8000
    parity_new_tokens: int = 16
    repeats: int = 5


SMOKE_SIZES = Sizes(
    cold=(64, 256),
    cached_prefix=192,
    cached_new=16,
    decode_context=128,
    decode_batches=(1, 4),
    mixed_decode_batch=4,
    parity_prefix=192,
    parity_new_tokens=4,
    repeats=2,
)


@dataclass(slots=True)
class Measurement:
    """One step: measured median time, its roofline and what the roofline is made of."""

    name: str
    attention: str  # the executor's attention option
    tokens: int  # new tokens the step runs
    median_s: float
    min_s: float
    flops: float
    bytes: float
    roofline_s: float | None  # None when the device's specs are unknown
    tokens_per_s: float = 0.0
    target_s: float | None = None
    meets_target: bool | None = None
    extra: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Specs:
    hbm_bytes_s: float | None
    peak_flops: float | None
    source: str


def device_specs(device: torch.device, hbm_gbps: float | None, peak_tflops: float | None) -> Specs:
    """The device's bandwidth and peak (flags win; else looked up by CUDA device name)."""
    bw = hbm_gbps * 1e9 if hbm_gbps else None
    peak = peak_tflops * 1e12 if peak_tflops else None
    source = "flags" if bw and peak else "unknown"
    if device.type == "cuda" and not (bw and peak):
        name = torch.cuda.get_device_name(device)
        for key, (table_bw, table_peak) in GPU_SPECS.items():
            if key in name:
                bw = bw or table_bw
                peak = peak or table_peak
                source = f"table:{key}"
                break
    return Specs(bw, peak, source)


# ---- model ------------------------------------------------------------------------------


def build_model(config: LlamaConfig, device: torch.device, seed: int) -> LlamaForCausalLM:
    """Random weights made on the device itself (an 8B model is never materialised on the
    host): fan-in scaled normals as ``model.init_random``, norms near 1."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(config.dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                param.normal_(1.0, 0.1, generator=gen)
            elif name.endswith("bias"):
                param.zero_()
            elif name == "model.embed_tokens.weight":
                param.normal_(0.0, 1.0, generator=gen)
            else:
                param.normal_(0.0, param.shape[-1] ** -0.5, generator=gen)
    return model.eval()


@dataclass(frozen=True, slots=True)
class Shape:
    """What the roofline needs of the model."""

    streamed_weight_bytes: int  # every parameter a step reads (the embedding table is not)
    matmul_params: int  # parameters in the layers' matmuls (2 FLOPs each per token)
    lm_head_params: int  # 2 FLOPs each per sampled row only
    kv_bytes_per_token: int
    attn_dim: int  # layers * heads * head_dim

    @classmethod
    def of(cls, model: LlamaForCausalLM) -> Shape:
        cfg = model.config
        embed = model.model.embed_tokens.weight
        total_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        total_params = sum(p.numel() for p in model.parameters())
        tied = cfg.tie_word_embeddings
        streamed = total_bytes - (0 if tied else embed.numel() * embed.element_size())
        head = model.lm_head.weight.numel()
        matmul = total_params - (0 if tied else embed.numel()) - head
        kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim
        kv *= embed.element_size()
        attn = cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim
        return cls(streamed, matmul, head, kv, attn)

    def step(self, new_tokens: list[int], contexts: list[int]) -> tuple[float, float]:
        """(FLOPs, bytes) of one step: per request, ``new`` tokens attending to ``context``
        tokens in all (causal inside the new ones); the LM head runs once per request (the
        executor computes logits only at each item's last token)."""
        both = list(zip(new_tokens, contexts, strict=True))
        flops = 2.0 * self.matmul_params * sum(new_tokens) + 2.0 * self.lm_head_params * len(both)
        # QK^T and PV: 2 * 2 * d per (query, key) pair; causal pairs of the new tokens.
        pairs = sum(n * (c - n) + n * (n + 1) / 2 for n, c in both)
        flops += 4.0 * self.attn_dim * pairs
        kv_read = sum(c - n for n, c in both)
        nbytes = self.streamed_weight_bytes + self.kv_bytes_per_token * (kv_read + sum(new_tokens))
        return flops, float(nbytes)


# ---- timing -----------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_forward(
    executor: TorchExecutor, prefill: list[ForwardItem], decode: list[ForwardItem], repeats: int
) -> list[float]:
    """Wall times of ``repeats`` identical forward passes after one warm-up."""
    return time_alternating({"": executor}, prefill, decode, repeats)[""]


def time_alternating(
    executors: dict[str, TorchExecutor],
    prefill: list[ForwardItem],
    decode: list[ForwardItem],
    repeats: int,
) -> dict[str, list[float]]:
    """Wall times of ``repeats`` identical forward passes per executor, after one warm-up
    each (which also compiles a Triton kernel's variant), taking turns round by round."""
    for executor in executors.values():
        executor.forward(prefill, decode)
    times: dict[str, list[float]] = {name: [] for name in executors}
    for _ in range(repeats):
        for name, executor in executors.items():
            _sync(executor.device)
            start = time.perf_counter()
            executor.forward(prefill, decode)
            _sync(executor.device)
            times[name].append(time.perf_counter() - start)
    return times


def _measure(
    name: str,
    attention: str,
    times: list[float],
    shape: Shape,
    specs: Specs,
    new_tokens: list[int],
    contexts: list[int],
    rate_tokens: int,
    with_targets: bool,
) -> Measurement:
    flops, nbytes = shape.step(new_tokens, contexts)
    roof = None
    if specs.hbm_bytes_s and specs.peak_flops:
        roof = max(nbytes / specs.hbm_bytes_s, flops / specs.peak_flops)
    median = statistics.median(times)
    target = TARGETS_S.get(name) if with_targets else None
    return Measurement(
        name=name,
        attention=attention,
        tokens=sum(new_tokens),
        median_s=median,
        min_s=min(times),
        flops=flops,
        bytes=nbytes,
        roofline_s=roof,
        tokens_per_s=rate_tokens / median if median > 0 else 0.0,
        target_s=target,
        meets_target=None if target is None else median <= target,
    )


def progress(message: str) -> None:
    """One line on stderr, flushed: a run stopped part-way (or stuck) shows how far it got."""
    print(f"[bench_gpu {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


GREEDY = SamplingParams(max_new_tokens=1)
GRAPHS_SUFFIX = "+graphs"  # the label of a paged option's CUDA-graph decode column
FUSED_SUFFIX = "+fused"  # a column with the fused RMSNorm/RoPE kernels


def is_graph_variant(label: str) -> bool:
    return GRAPHS_SUFFIX in label


def _item(rid: str, tokens: np.ndarray, start: int, slots: np.ndarray) -> ForwardItem:
    return ForwardItem(rid, tokens[start:], start, slots[: len(tokens)], GREEDY, True, 0)


def run_steps(
    executors: dict[str, TorchExecutor],
    shape: Shape,
    specs: Specs,
    sizes: Sizes,
    seed: int,
    targets: bool,
) -> list[Measurement]:
    """Cold prefill, cached prefill and decode steps on the executors' shared pool, each
    step timed for every executor in turn (``targets``: attach issue 14's targets, which
    are for the full-size model only). Measurements step by step, executors in order.
    A ``+graphs`` executor differs from its option only in decode steps and a lone short
    prefill (the cached-prefill step), so it is timed in those only."""
    first = next(iter(executors.values()))
    rng = np.random.default_rng(seed)
    vocab = first.vocab_size
    out: list[Measurement] = []
    all_slots = np.arange(first.num_kv_slots, dtype=np.int64)

    def measure(
        name: str,
        prefill: list[ForwardItem],
        decode: list[ForwardItem],
        new_tokens: list[int],
        contexts: list[int],
        rate_tokens: int,
    ) -> None:
        timed = executors
        if prefill:  # a graph column differs only where its executor runs a static path
            timed = {
                k: ex
                for k, ex in executors.items()
                if not is_graph_variant(k) or ex.takes_static_path(prefill, decode)
            }
        by_name = time_alternating(timed, prefill, decode, sizes.repeats)
        for attention, times in by_name.items():
            m = _measure(
                name, attention, times, shape, specs, new_tokens, contexts, rate_tokens, targets
            )
            out.append(m)
            progress(
                f"{name} {attention}: median {m.median_s * 1e3:.3f} ms (min {m.min_s * 1e3:.3f})"
            )

    for n in sizes.cold:
        tokens = rng.integers(0, vocab, n, dtype=np.int64)
        measure(f"prefill_cold_{n}", [_item("cold", tokens, 0, all_slots)], [], [n], [n], n)
    n_ctx = sizes.cached_prefix + sizes.cached_new
    tokens = rng.integers(0, vocab, n_ctx, dtype=np.int64)
    first.forward([_item("prefix", tokens[: sizes.cached_prefix], 0, all_slots)], [])
    item = _item("cached", tokens, sizes.cached_prefix, all_slots)
    name = f"prefill_cached_{sizes.cached_new}_after_{sizes.cached_prefix}"
    measure(name, [item], [], [sizes.cached_new], [n_ctx], sizes.cached_new)
    ctx = sizes.decode_context
    _fill_pool_random(first, max(sizes.decode_batches) * ctx, seed)

    def decode_items(b: int) -> list[ForwardItem]:
        items = []
        for i in range(b):
            slots = all_slots[i * ctx : (i + 1) * ctx]
            last = rng.integers(0, vocab, ctx, dtype=np.int64)
            items.append(ForwardItem(f"d{i}", last[ctx - 1 :], ctx - 1, slots, GREEDY, True, 0))
        return items

    # A busy worker's step: the cached prefill beside a decode batch (one eager forward on
    # every column: no static path takes a prefill with decode rows).
    b = sizes.mixed_decode_batch
    name = f"mixed_{sizes.cached_new}_after_{sizes.cached_prefix}_plus_decode_b{b}"
    new_tokens = [sizes.cached_new] + [1] * b
    measure(name, [item], decode_items(b), new_tokens, [n_ctx] + [ctx] * b, sum(new_tokens))
    for b in sizes.decode_batches:
        measure(f"decode_b{b}", [], decode_items(b), [1] * b, [ctx] * b, b)
    return out


def _fill_pool_random(executor: TorchExecutor, num_slots: int, seed: int) -> None:
    """Random K/V in the first ``num_slots`` slots of every layer (decode contexts)."""
    pool = executor.kv_pool
    gen = torch.Generator(device=pool.device).manual_seed(seed)
    with torch.inference_mode():
        for layer in range(pool.config.num_layers):
            for t in (pool.k[layer], pool.v[layer]):
                t[:num_slots].normal_(0.0, 1.0, generator=gen)


# ---- parity -----------------------------------------------------------------------------


def greedy_parity(executor: TorchExecutor, sizes: Sizes, seed: int) -> dict:
    """Greedy tokens of one prompt through the Engine, cold and then with its prefix cached
    (a second request with the same prompt): equal when the cached path is exact enough."""
    rng = np.random.default_rng(seed + 1)
    prompt = rng.integers(0, executor.vocab_size, sizes.parity_prefix + 8, dtype=np.int64)
    config = EngineConfig(
        num_kv_slots=executor.num_kv_slots,
        max_prefill_tokens_per_step=len(prompt),
        chunk_size=len(prompt),
        schedule_policy="fcfs",
    )
    engine = Engine(config, executor, itertools.count(1).__next__)  # type: ignore[arg-type]
    sampling = SamplingParams(max_new_tokens=sizes.parity_new_tokens, ignore_eos=True)
    runs: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    for rid in ("cold", "cached"):
        engine.add_request(EngineRequest(rid, prompt, sampling))
        tokens: list[int] = []
        for _ in range(10 * sizes.parity_new_tokens + 10):
            if not engine.has_work():
                break
            for o in engine.step():
                tokens.extend(o.new_token_ids)
                if o.usage is not None:
                    cached[rid] = o.usage.cached_prompt_tokens
        runs[rid] = tokens
    mismatch = next(
        (i for i, (a, b) in enumerate(zip(runs["cold"], runs["cached"], strict=True)) if a != b),
        None,
    )
    return {
        "equal": runs["cold"] == runs["cached"],
        "first_mismatch": mismatch,
        "prompt_tokens": len(prompt),
        "cached_prompt_tokens": cached.get("cached", 0),
        "new_tokens": sizes.parity_new_tokens,
        "cold_tokens": runs["cold"],
    }


# ---- main -------------------------------------------------------------------------------


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB


def run(
    *,
    smoke: bool,
    device: torch.device,
    seed: int = 0,
    hbm_gbps: float | None = None,
    peak_tflops: float | None = None,
    attention: tuple[str, ...] = ("gather", "paged"),
    cuda_graphs: bool = False,
    fused: bool = False,
    graph_warmup: bool = False,
) -> dict:
    """Every figure as a dict (what ``--json`` writes). ``cuda_graphs``: also each paged
    option's decode with CUDA graphs (the static decode path run eagerly off CUDA).
    ``fused``: also each paged column with the fused RMSNorm/RoPE kernels (their torch
    reference off CUDA)."""
    sizes = SMOKE_SIZES if smoke else Sizes()
    progress(f"building the {'tiny' if smoke else 'Llama-3-8B-shaped'} model on {device}")
    start = time.perf_counter()
    if smoke:
        model = build_tiny_model(seed, device=str(device))
    else:
        model = build_model(LLAMA3_8B, device, seed)
    _sync(device)
    build_s = time.perf_counter() - start
    progress(f"model built in {build_s:.1f} s")
    num_slots = max(
        max(sizes.decode_batches) * sizes.decode_context,
        sizes.cached_prefix + sizes.cached_new,
        max(sizes.cold),
        2 * (sizes.parity_prefix + 8 + sizes.parity_new_tokens),
    )
    # the graph path's padding rows write the scratch slot
    pool = TorchExecutor.pool_for(model, num_slots, scratch_slot=cuda_graphs)
    progress(f"KV pool of {num_slots} slots allocated")
    executors: dict[str, TorchExecutor] = {}
    decode_path: dict[str, str] = {}
    on_cuda = device.type == "cuda"
    fused_impl = "triton" if on_cuda else "torch"
    for name in attention:  # the same model and KV pool
        variants = [(name, False)]
        if cuda_graphs and name != "gather":
            variants.append((name + GRAPHS_SUFFIX, True))
        for base, static in variants:
            for fuse in (False, True) if fused and name != "gather" else (False,):
                label = base + (FUSED_SUFFIX if fuse else "")
                executors[label] = TorchExecutor(
                    model,
                    pool,
                    device,
                    seed=seed,
                    attention=name,
                    cuda_graphs=static and on_cuda,
                    static_decode=static and not on_cuda,
                    fused=fused_impl if fuse else "off",
                )
                decode_path[label] = (
                    ("cuda-graphs" if on_cuda else "static-eager") if static else "regular"
                )
    labels = tuple(executors)
    shape = Shape.of(model)
    specs = device_specs(device, hbm_gbps, peak_tflops)
    progress(f"executors: {', '.join(labels)}")
    warmup: dict[str, dict] = {}
    if graph_warmup:  # every graph bucket captured before the timing, as a worker would
        for label, ex in executors.items():
            if ex.decode_graphs is None or not ex.decode_graphs.capture:
                continue
            _sync(device)
            before = torch.cuda.memory_allocated(device) if on_cuda else 0
            t0 = time.perf_counter()
            captured = ex.capture_graphs(model.config.max_position_embeddings)
            _sync(device)
            warmup[label] = {
                "graphs": captured,
                "seconds": round(time.perf_counter() - t0, 3),
                "memory_bytes": (torch.cuda.memory_allocated(device) if on_cuda else 0) - before,
            }
            progress(f"{label}: {captured} graphs captured in {warmup[label]['seconds']:.1f} s")
    steps = run_steps(executors, shape, specs, sizes, seed, targets=not smoke)
    parity = {}
    for name, ex in executors.items():
        parity[name] = greedy_parity(ex, sizes, seed)
        progress(f"parity {name}: equal={parity[name]['equal']}")
    full_name = f"decode_b{max(sizes.decode_batches)}"
    full = {m.attention: m.tokens_per_s for m in steps if m.name == full_name}
    cold = [p["cold_tokens"] for p in parity.values()]
    by_attention = {name: [asdict(m) for m in steps if m.attention == name] for name in labels}
    graphs = {
        label: sorted(ex.decode_graphs.buckets)
        for label, ex in executors.items()
        if ex.decode_graphs is not None
    }
    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "mode": "smoke" if smoke else "llama3-8b-shape",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "host": platform.node(),
        "torch": torch.__version__,
        "dtype": str(next(model.parameters()).dtype),
        "num_params": sum(p.numel() for p in model.parameters()),
        "num_kv_slots": num_slots,
        "specs": asdict(specs),
        "build_s": round(build_s, 3),
        "attention": list(labels),
        "attention_impl": {name: ex.attention_impl for name, ex in executors.items()},
        "fused_impl": {name: ex.fused_impl for name, ex in executors.items()},
        "decode_path": decode_path,
        "graph_buckets": {k: [list(key) for key in v] for k, v in graphs.items()},
        "graph_warmup": warmup,
        "prefill_graph_buckets": {
            label: sorted(list(key) for key in ex.prefill_graphs.buckets)
            for label, ex in executors.items()
            if ex.prefill_graphs is not None
        },
        "steps": by_attention[attention[0]],
        "steps_by_attention": by_attention,
        "decode_context": sizes.decode_context,
        "decode_full_batch_tokens_s": full[attention[0]],
        "decode_full_batch_tokens_s_by_attention": full,
        "parity": parity[attention[0]],
        "parity_by_attention": parity,
        "greedy_same_across_attention": all(c == cold[0] for c in cold),
        "peak_memory_bytes": peak_memory_bytes(device),
        "total_s": round(time.perf_counter() - start, 3),
    }


def print_report(result: dict, stream: TextIO | None = None) -> None:
    """The figures as a table (stdout by default): per step its roofline, then each
    attention backend's median and its multiple of the roofline, side by side."""
    stream = stream or sys.stdout
    names = result["attention"]
    paths = result.get("decode_path", {})
    fused = result.get("fused_impl", {})
    impls = ", ".join(
        f"{n} = {result['attention_impl'][n]}"
        + (f" ({paths[n]} decode)" if paths.get(n, "regular") != "regular" else "")
        + (f" (fused {fused[n]})" if fused.get(n, "off") != "off" else "")
        for n in names
    )
    print(
        f"{result['mode']} on {result['device']} (torch {result['torch']}, {result['dtype']}), "
        f"roofline specs: {result['specs']['source']}; attention: {impls}",
        file=stream,
    )
    cols = "".join(f" {n[:18] + ' ms':>21} {'x roof':>7}" for n in names)
    print(f"{'step':<36} {'roofline ms':>12}{cols} {'target ms':>10}", file=stream)
    by_attention = {
        name: {m["name"]: m for m in steps} for name, steps in result["steps_by_attention"].items()
    }
    for m in result["steps_by_attention"][names[0]]:
        roof = m["roofline_s"]
        roof_ms = f"{roof * 1e3:12.2f}" if roof else "           -"
        row = f"{m['name']:<36} {roof_ms}"
        for name in names:
            other = by_attention[name].get(m["name"])
            if other is None:  # a +graphs column times its static steps only
                row += f" {'-':>21} {'-':>7}"
                continue
            median = other["median_s"]
            ratio = f"{median / roof:7.1f}" if roof else "      -"
            row += f" {median * 1e3:21.2f} {ratio}"
        target = f"{m['target_s'] * 1e3:10.1f}" if m["target_s"] else "         -"
        print(f"{row} {target}", file=stream)
    for name in names:
        p = result["parity_by_attention"][name]
        verdict = "equal" if p["equal"] else f"DIFFERS at token {p['first_mismatch']}"
        rate = result["decode_full_batch_tokens_s_by_attention"][name]
        print(
            f"{name}: decode tokens/s at full batch {rate:.0f}; greedy parity cached vs cold: "
            f"{verdict} ({p['cached_prompt_tokens']} of {p['prompt_tokens']} prompt tokens "
            "cached)",
            file=stream,
        )
    same = "same" if result["greedy_same_across_attention"] else "DIFFERENT"
    print(
        f"greedy tokens across attention backends: {same}; peak memory "
        f"{result['peak_memory_bytes'] / 2**30:.2f} GiB; total {result['total_s']:.1f} s",
        file=stream,
    )


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """--smoke, --device, --json, --seed: what every GPU script of bench/ takes."""
    p.add_argument(
        "--smoke",
        action="store_true",
        help="the tiny model at small sizes (seconds; runs on the CPU): checks the script",
    )
    p.add_argument(
        "--device", default=None, help="torch device (default: cuda, or cpu with --smoke)"
    )
    p.add_argument("--json", metavar="OUT", help="write every figure as JSON")
    p.add_argument("--seed", type=int, default=0, help="weights and token seed (default 0)")


def run_device(p: argparse.ArgumentParser, args: argparse.Namespace) -> torch.device:
    """The device ``add_run_arguments``' flags ask for; a usage error when it is CUDA and
    there is none."""
    device = torch.device(args.device or ("cpu" if args.smoke else "cuda"))
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("CUDA is not available: run on a GPU machine, or use --smoke for the CPU check")
    return device


def write_json(path: str | None, result: dict) -> None:
    """``result`` as indented JSON at ``path`` (nothing without one)."""
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.bench_gpu",
        description="Step times of the worker's model path (cold and cached prefill, decode "
        "at several batch sizes) against their roofline, greedy parity cached vs cold, peak "
        "memory. Default: a Llama-3-8B-shaped model with random bf16 weights on CUDA.",
    )
    add_run_arguments(p)
    p.add_argument(
        "--hbm-gbps", type=float, default=None, help="HBM bandwidth in GB/s (default: by GPU name)"
    )
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="dense bf16 peak in TFLOP/s (default: by GPU name)",
    )
    p.add_argument(
        "--attention",
        default="gather,paged",
        help="comma-separated executor attention options, timed side by side (default "
        f"gather,paged; choices {', '.join(ATTENTION_CHOICES)}); the first is what the "
        "steps/parity fields and a cost profile fitted from --json describe",
    )
    p.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="also time each paged option's decode steps with CUDA graphs (column "
        "'<option>+graphs'; off CUDA the same static-shape path runs eagerly)",
    )
    p.add_argument(
        "--fused",
        action="store_true",
        help="also time each paged column with the fused RMSNorm/RoPE kernels (column "
        "'<column>+fused'; off CUDA their torch reference runs)",
    )
    p.add_argument(
        "--graph-warmup",
        action="store_true",
        help="with --cuda-graphs on CUDA: capture every graph bucket of each graph column "
        "up to the model's context before timing (what `kvroute worker "
        "--graph-warmup-context` does), and report the graphs, seconds and GPU memory it took",
    )
    args = p.parse_args(argv)
    attention = tuple(a.strip() for a in args.attention.split(",") if a.strip())
    bad = [a for a in attention if a not in ATTENTION_CHOICES]
    if not attention or bad or len(set(attention)) != len(attention):
        p.error(
            f"--attention: give distinct options of {', '.join(ATTENTION_CHOICES)}, "
            f"got {args.attention!r}"
        )
    if args.cuda_graphs and all(a == "gather" for a in attention):
        p.error("--cuda-graphs: needs a paged --attention option (the graphs use paged decode)")
    if args.fused and all(a == "gather" for a in attention):
        p.error("--fused: needs a paged --attention option (fused columns are paged ones)")
    device = run_device(p, args)
    for name in ("hbm_gbps", "peak_tflops"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            p.error(f"--{name.replace('_', '-')} must be > 0, got {value}")
    result = run(
        smoke=args.smoke,
        device=device,
        seed=args.seed,
        hbm_gbps=args.hbm_gbps,
        peak_tflops=args.peak_tflops,
        attention=attention,
        cuda_graphs=args.cuda_graphs,
        fused=args.fused,
        graph_warmup=args.graph_warmup,
    )
    print_report(result)
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
