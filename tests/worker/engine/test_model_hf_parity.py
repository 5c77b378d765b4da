"""Our Llama equals transformers' LlamaForCausalLM on the same HF-format checkpoint.

transformers is a test-only dependency; this file is skipped when it is not installed.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from worker.engine.factory import build_tiny_default
from worker.engine.loader import load_model, save_hf
from worker.engine.model import LlamaForCausalLM, RopeScaling, build_tiny_model, tiny_config
from worker.engine.torch_executor import TorchExecutor
from worker.engine.types import ForwardItem, SamplingParams

transformers = pytest.importorskip("transformers")

RTOL = 1e-4


def our_logits(
    model: LlamaForCausalLM, ids: np.ndarray, *, attention: str = "gather", fused: str = "off"
) -> torch.Tensor:
    """Float32 logits at every prompt position, through the executor (slots scattered)."""
    ex = TorchExecutor.create(model, len(ids), attention=attention, fused=fused)
    slots = np.random.default_rng(0).permutation(len(ids))
    return ex.prompt_logits(ForwardItem("r", ids, 0, slots, SamplingParams())).float()


def hf_logits(
    model_dir, ids: np.ndarray, *, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    hf = transformers.LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=dtype)
    hf = hf.to(device).eval()
    with torch.no_grad():
        return hf(torch.from_numpy(ids).to(device)[None]).logits[0].float()


def assert_rel_close(ours: torch.Tensor, ref: torch.Tensor, rtol: float = RTOL) -> None:
    rel = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert rel < rtol, f"max relative error {rel:.2e} (limit {rtol:g})"


@pytest.mark.parametrize(
    "variant",
    [
        {},
        {"tie_word_embeddings": True},
        {
            "rope_theta": 500000.0,
            "rope_scaling": RopeScaling(
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=256,  # one band blended
            ),
        },
        {"num_key_value_heads": 1},
    ],
    ids=["tiny-default", "tied", "llama3-rope", "mqa"],
)
def test_logits_match_transformers(tmp_path, variant):
    cfg = dataclasses.replace(tiny_config(), **variant)
    model = build_tiny_model(seed=3, config=cfg)
    save_hf(model, tmp_path)
    ids = np.random.default_rng(5).integers(0, cfg.vocab_size, 150).astype(np.int64)
    assert_rel_close(our_logits(model, ids), hf_logits(tmp_path, ids))


def test_default_model_round_trips_and_matches_transformers(tmp_path):
    model = build_tiny_default(seed=0)
    save_hf(model, tmp_path)
    loaded = load_model(tmp_path).model
    ids = np.random.default_rng(6).integers(0, 512, 64).astype(np.int64)
    ours = our_logits(model, ids)
    torch.testing.assert_close(our_logits(loaded, ids), ours, atol=0, rtol=0)
    assert_rel_close(ours, hf_logits(tmp_path, ids))


@pytest.mark.parametrize("rope_scaling", [None, "llama3"])
def test_checkpoint_written_by_transformers_loads_and_matches(tmp_path, rope_scaling):
    """The other direction: transformers saves (its own config keys, e.g. rope_parameters),
    our loader reads, and the logits agree."""
    extra = {}
    if rope_scaling:
        extra["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    cfg = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=500000.0,
        **extra,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    ids = np.random.default_rng(7).integers(0, 300, 120).astype(np.int64)
    loaded = load_model(tmp_path).model
    assert (loaded.config.rope_scaling is not None) == bool(rope_scaling)
    assert_rel_close(our_logits(loaded, ids), hf_logits(tmp_path, ids))


# ---- on a GPU -----------------------------------------------------------------------------

# (attention, fused): the gather + SDPA path, the paged Triton kernels, and those with the
# fused RMSNorm/RoPE kernels.
CUDA_PATHS = [("gather", "off"), ("paged", "off"), ("paged", "triton")]
# float32: the kernels multiply float32 exactly (input_precision="ieee"), but cuBLAS, SDPA and
# the Triton kernels each block their reductions their own way on a GPU; bfloat16: both models
# round every activation to 8 bits of mantissa, in a different order.
CUDA_RTOL = {torch.float32: 1e-3, torch.bfloat16: 5e-2}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("attention,fused", CUDA_PATHS, ids=["gather", "paged", "paged-fused"])
def test_logits_match_transformers_on_cuda(tmp_path, dtype, attention, fused):
    """Our model on CUDA, through each attention path, against transformers' Llama on CUDA
    in the same dtype (the same checkpoint). Fails, never skips, without CUDA."""
    assert torch.cuda.is_available(), "gpu tests need CUDA: run them on a GPU machine"
    cfg = dataclasses.replace(tiny_config(), num_key_value_heads=2)
    save_hf(build_tiny_model(seed=3, config=cfg), tmp_path)
    ours = load_model(tmp_path, device="cuda", dtype=dtype).model
    ids = np.random.default_rng(5).integers(0, cfg.vocab_size, 150).astype(np.int64)
    got = our_logits(ours, ids, attention=attention, fused=fused)
    ref = hf_logits(tmp_path, ids, device="cuda", dtype=dtype)
    assert_rel_close(got, ref, CUDA_RTOL[dtype])
    # the greedy choice agrees wherever the reference's top two are clearly apart
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 4 * CUDA_RTOL[dtype] * ref.abs().max()
    agree = got.argmax(-1) == ref.argmax(-1)
    assert bool(agree[clear].all()), f"argmax differs at {(~agree & clear).nonzero().tolist()}"
