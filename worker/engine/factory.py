"""Build an executor and its tokenizer from the worker's settings.

``torch``: the real model (a local HF checkpoint with ``model_dir``, otherwise the tiny
random default) over a KV pool of ``num_kv_slots`` on CUDA when present, else CPU.
``sim``: the simulated executor (no math; its tokens are hashed, so ``seed`` and ``device``
do not apply) paired with the byte tokenizer. torch is only
imported for ``torch``, so a sim-only process never pays for it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from worker.engine.tokenizer import ByteTokenizer, Tokenizer
from worker.engine.types import Executor

if TYPE_CHECKING:
    from worker.engine.model import LlamaForCausalLM

EXECUTOR_KINDS = ("torch", "sim")
TINY_VOCAB_SIZE = 512  # >= the byte tokenizer's 260 ids; a round size for the tiny model


def default_device() -> str:
    """``cuda`` when a GPU is visible, else ``cpu``."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def build_tiny_default(seed: int = 0, device: str = "cpu") -> LlamaForCausalLM:
    """The default random Llama (vocab 512, hidden 64, 2 layers, 4 heads / 2 KV heads,
    4096 context, float32) whose EOS is the byte tokenizer's."""
    from worker.engine.model import build_tiny_model, tiny_config

    cfg = tiny_config(vocab_size=TINY_VOCAB_SIZE, eos_token_id=ByteTokenizer.EOS)
    return build_tiny_model(seed, device=device, config=cfg)


def build_executor(
    kind: str,
    *,
    model_dir: str | Path | None = None,
    num_kv_slots: int,
    device: str | None = None,
    seed: int = 0,
    kv_memory_fraction: float | None = None,
    sim_max_context_tokens: int | None = None,
    attention: str | None = None,
    cuda_graphs: bool | None = None,
    fused: str | None = None,
) -> tuple[Executor, Tokenizer]:
    """An Executor and the Tokenizer that matches its vocab.

    The torch executor's three speed options default by device (``None``): on CUDA with
    triton installed (torch's CUDA builds bring it) the fastest measured combination --
    paged attention, CUDA graphs, the fused Triton kernels (decision 0027); anywhere else
    the gather path, eagerly, unfused (the CPU's fastest, and what the CPU tests compare
    with).

    ``attention`` (torch only): how the model attends over the paged KV pool (one of
    ``paged_attention.ATTENTION_CHOICES``; None: "paged" on CUDA or with ``cuda_graphs``,
    else "gather").

    ``cuda_graphs`` (torch on CUDA only): decode-only steps, and a short prefill alone,
    replay CUDA graphs captured per size and context bucket
    (``TorchExecutor(cuda_graphs=True)``); ValueError on a
    device that is not CUDA, or with ``attention="gather"``. None: on for CUDA with paged
    attention, else off.

    ``fused`` (torch only): the fused residual-add + RMSNorm, RoPE + KV-write and SwiGLU
    passes, q/k/v and gate/up as one matmul each (one of ``fused_ops.FUSED_CHOICES``; None:
    "triton" on CUDA, else "off"; "triton" needs CUDA).

    ``sim_max_context_tokens`` (sim only): the simulated model's context length (default
    8,192, Llama-3-8B's); trace replays with long prompts raise it.

    ``kv_memory_fraction`` (torch on CUDA only): size the KV pool to that fraction of the
    GPU memory free after the weights are loaded, instead of ``num_kv_slots`` (which stays
    the size on CPU). The pool's size is then ``executor.num_kv_slots``: give the engine that.

    Raises ValueError for an unknown ``kind``, a ``num_kv_slots`` below 1, a fraction
    outside (0, 1], or a ``model_dir`` given to ``sim``; ModelLoadError for a bad model
    directory.
    """
    if num_kv_slots < 1:
        raise ValueError(f"num_kv_slots must be >= 1, got {num_kv_slots}")
    only = (
        ("sim_max_context_tokens", sim_max_context_tokens, "sim"),
        ("attention", attention, "torch"),
        ("cuda_graphs", cuda_graphs, "torch"),
        ("fused", fused, "torch"),
    )
    for name, value, owner in only:
        if value is not None and kind != owner:
            raise ValueError(f"{name}: only the '{owner}' executor takes it")
    if kv_memory_fraction is not None and not 0.0 < kv_memory_fraction <= 1.0:
        raise ValueError(f"kv_memory_fraction must be in (0, 1], got {kv_memory_fraction}")
    match kind:
        case "torch":
            dev = device or default_device()
            attention, cuda_graphs, fused = _torch_defaults(dev, attention, cuda_graphs, fused)
            return _build_torch(
                model_dir,
                num_kv_slots,
                dev,
                seed,
                kv_memory_fraction,
                attention,
                cuda_graphs,
                fused,
            )
        case "sim":
            if model_dir is not None:
                raise ValueError("model_dir: only the 'torch' executor loads a model")
            return _build_sim(sim_max_context_tokens)
        case _:
            raise ValueError(f"executor kind must be one of {EXECUTOR_KINDS}, got {kind!r}")


def _torch_defaults(
    device: str, attention: str | None, cuda_graphs: bool | None, fused: str | None
) -> tuple[str, bool, str]:
    """The torch executor's speed options, each None resolved by device (decision 0027)."""
    from worker.engine.paged_attention import triton_available

    gpu = device.startswith("cuda") and triton_available()  # the measured defaults
    if attention is None:
        attention = "paged" if gpu or cuda_graphs else "gather"
    if cuda_graphs is None:
        cuda_graphs = gpu and attention != "gather"
    return attention, cuda_graphs, fused or ("triton" if gpu else "off")


def _build_torch(
    model_dir: str | Path | None,
    num_kv_slots: int,
    device: str | None,
    seed: int,
    kv_memory_fraction: float | None,
    attention: str,
    cuda_graphs: bool = False,
    fused: str = "off",
) -> tuple[Executor, Tokenizer]:
    import torch

    from worker.engine import fused_ops
    from worker.engine.kv_pool import cuda_slots_for_memory_fraction
    from worker.engine.loader import load_model
    from worker.engine.torch_executor import TorchExecutor

    dev = device or default_device()
    if cuda_graphs and not dev.startswith("cuda"):  # before loading a model for nothing
        raise ValueError(f"cuda_graphs: CUDA graphs need a CUDA device, got {dev!r}")
    fused_ops.resolve(fused, torch.device(dev))  # likewise: a bad option fails first
    tokenizer: Tokenizer
    if model_dir is None:
        model = build_tiny_default(seed, dev)
        tokenizer = ByteTokenizer()
    else:
        loaded = load_model(model_dir, device=dev)
        model, tokenizer = loaded.model, loaded.tokenizer
    if kv_memory_fraction is not None and dev.startswith("cuda"):
        cfg = model.config
        num_kv_slots = cuda_slots_for_memory_fraction(
            kv_memory_fraction,
            num_layers=cfg.num_hidden_layers,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            dtype=cfg.dtype,
            device=dev,
        )
        if num_kv_slots < 1:
            raise ValueError(
                f"kv_memory_fraction: {kv_memory_fraction} of free GPU memory holds no KV slot"
            )
    executor = TorchExecutor.create(
        model,
        num_kv_slots,
        seed=seed,
        attention=attention,
        cuda_graphs=cuda_graphs,
        fused=fused,
    )
    return executor, tokenizer


def _build_sim(max_context_tokens: int | None) -> tuple[Executor, Tokenizer]:
    # Imported lazily: another module's owner maintains it; the torch path never needs it.
    from worker.engine.sim_executor import SimCostModel, SimExecutor, SimExecutorConfig

    tokenizer = ByteTokenizer()
    # The vocab matches the byte tokenizer, so every simulated token decodes (or is a
    # special); the cost model stays the Llama-3-8B one.
    config = SimExecutorConfig(vocab_size=tokenizer.vocab_size, eos_token_id=tokenizer.eos_token_id)
    if max_context_tokens is not None:
        config = dataclasses.replace(config, max_context_tokens=max_context_tokens)
    return SimExecutor(SimCostModel(), config), tokenizer
