"""The Triton paged-attention kernels, on the CPU in Triton's interpreter and on CUDA.

The interpreter is chosen when triton defines the kernels, so each CPU check runs
tests/worker/engine/paged_cases.py in a subprocess with TRITON_INTERPRET=1 (this process may
already have imported triton without it). The gpu-marked test runs the same checks on the
real kernels (``python -m pytest -m gpu``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from triton_subprocess import run_case

CASES = Path(__file__).with_name("paged_cases.py")


@pytest.mark.parametrize("case", ["decode", "prefill", "executor"])
def test_triton_kernels_in_the_interpreter(case: str) -> None:
    """decode / prefill: the kernels against float64 oracles and the torch reference, for
    GQA and MQA, ragged lengths, length 1, several context splits, float32 and bfloat16;
    executor: the tiny model's logits with attention="paged-triton" equal the gather path's
    over mixed prefill + decode steps with cached prefixes."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run_case(CASES, case, env)


def test_triton_kernels_compile_for_hopper(tmp_path: Path) -> None:
    """Compiled (not interpreted) for sm_90 with the installed triton, no GPU needed: the
    decode (1 and 4 splits), combine and prefill kernels at Llama-3-8B head shapes reach a
    cubin, and the bf16 ones multiply on tensor cores."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile for real, not from a cache
    run_case(CASES, "compile-sm90", env)


@pytest.mark.gpu
def test_triton_kernels_on_cuda() -> None:
    """The same checks on the compiled kernels. Fails, never skips, without CUDA."""
    assert torch.cuda.is_available(), "gpu tests need CUDA: run them on a GPU machine"
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
    sys.path.insert(0, str(CASES.parent))
    import paged_cases

    from worker.engine.model import build_tiny_model

    paged_cases.check_decode("triton", "cuda")
    paged_cases.check_prefill("triton", "cuda")
    paged_cases.check_executor("paged-triton", build_tiny_model(0, device="cuda"), atol=1e-4)
