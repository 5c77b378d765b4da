"""Fused residual-add + RMSNorm, RoPE + KV write, SwiGLU, and q/k/v and gate/up as one matmul
each (``fused_ops``, ``TorchExecutor(fused=...)``).

The torch references run in-process; the Triton kernels run in Triton's CPU interpreter in a
subprocess with TRITON_INTERPRET=1 (the interpreter is chosen when triton defines kernels),
and are compiled ahead of time for sm_90 without a GPU. Tolerances: see fused_cases.py. The
gpu-marked test runs the same checks on the compiled kernels in bfloat16 and float32
(``python -m pytest -m gpu``; bench/gpu_session.sh runs it).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import fused_cases
import numpy as np
import pytest
import torch
from triton_subprocess import run_case

from worker.engine import fused_ops
from worker.engine.factory import build_executor, build_tiny_default
from worker.engine.model import build_tiny_model, tiny_config
from worker.engine.torch_executor import TorchExecutor
from worker.engine.types import ForwardItem, SamplingParams

CASES = Path(__file__).with_name("fused_cases.py")


def test_references_against_float64_oracles() -> None:
    """The torch references (what fused="torch" runs) on odd shapes, float32 and bfloat16:
    the add-norm against the unrounded float64 formula, RoPE against a complex product, the
    SwiGLU gate against float64."""
    fused_cases.check_add_rmsnorm("torch", "cpu")
    fused_cases.check_rope("torch", "cpu")
    fused_cases.check_silu_mul("torch", "cpu")
    fused_cases.check_rope_write("torch", "cpu")


def test_rmsnorm_reference_is_the_models() -> None:
    """The fused path's norm is the model's RMSNorm (the unfused path runs the same code)."""
    model = build_tiny_model(0)
    norm = model.model.layers[0].input_layernorm
    x = torch.randn(9, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    h = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        res, y = fused_ops.add_rmsnorm("torch", x, h, norm.weight, norm.eps)
        assert torch.equal(res, x + h) and torch.equal(y, norm(x + h))


def test_model_fused_torch_equals_unfused() -> None:
    """The restructured layers (residual carried, adds fused into the norms, RoPE from
    float32 half tables) give the unfused model's logits in float32: gather attention,
    paged attention, and the static-shape decode path."""
    model = build_tiny_model(0)
    want = fused_cases.scenario(model, "gather")
    runs = {
        "gather": fused_cases.scenario(model, "gather", fused="torch"),
        "paged": fused_cases.scenario(model, "paged-torch", fused="torch"),
        "static": fused_cases.scenario(model, "paged-torch", fused="torch", static_decode=True),
    }
    for name, got in runs.items():
        for step, (g, w) in enumerate(zip(got, want, strict=True)):
            # Same float32 operations as the unfused path; paged / static attention reduce
            # in other orders (their own tests' 1e-5).
            atol = 0.0 if name == "gather" else 1e-5
            torch.testing.assert_close(g, w, atol=atol, rtol=0, msg=f"{name} step {step}")


def test_bf16_model_fused_torch_close_to_unfused() -> None:
    """In bfloat16 the fused RoPE rounds once (the unfused one rounds cos/sin and each
    product), so logits differ by bfloat16 noise only, and greedy choices agree."""
    import dataclasses

    cfg = dataclasses.replace(tiny_config(), dtype=torch.bfloat16)
    model = build_tiny_model(0, config=cfg)
    want = fused_cases.scenario(model, "gather")
    got = fused_cases.scenario(model, "gather", fused="torch")
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, atol=0.1, rtol=0, msg=f"step {step}")
        assert (g.argmax(-1) == w.argmax(-1)).float().mean() >= 0.9, step


@pytest.mark.parametrize("case", ["interpret", "compile-sm90"])
def test_triton_kernels(case: str, tmp_path: Path) -> None:
    """interpret (TRITON_INTERPRET=1): the kernels against the torch references and float64
    oracles on the odd shapes, float32 and bfloat16, and the tiny model's logits with
    fused="triton" equal the unfused model's within 1e-5 (gather attention, and the static
    decode path). compile-sm90: the kernels compile for Hopper at Llama-3-8B shapes."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if case == "interpret":
        env["TRITON_INTERPRET"] = "1"
    else:
        env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile for real, not from a cache
    run_case(CASES, case, env)


# ---- the option -------------------------------------------------------------------------


def test_resolve() -> None:
    cpu = torch.device("cpu")
    assert fused_ops.resolve("off", cpu) == "off"
    assert fused_ops.resolve("torch", cpu) == "torch"
    with pytest.raises(ValueError, match="is not one of off, torch, triton"):
        fused_ops.resolve("cuda", cpu)


def test_bad_inputs_are_refused() -> None:
    x = torch.zeros(3, 8)
    with pytest.raises(ValueError, match="the Triton kernel needs one dtype"):
        fused_ops.add_rmsnorm("triton", x, None, torch.ones(8, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(ValueError, match="weight"):
        fused_ops.add_rmsnorm("torch", x, None, torch.ones(7), 1e-5)
    with pytest.raises(ValueError, match="delta"):
        fused_ops.add_rmsnorm("torch", x, torch.zeros(3, 7), torch.ones(8), 1e-5)
    q, k = torch.zeros(2, 4, 8), torch.zeros(2, 2, 8)
    kc = torch.zeros(5, 2, 8)
    cos4 = torch.zeros(2, 4)
    slots = torch.arange(2)
    with pytest.raises(ValueError, match=r"cos/sin must be \[2, 4\]"):
        cos8 = torch.zeros(2, 8)
        fused_ops.rope_write_("torch", q, k, k, cos8, cos8, kc, kc, slots)
    with pytest.raises(ValueError, match="need q"):
        k3 = torch.zeros(3, 2, 8)
        fused_ops.rope_write_("torch", q, k3, k3, cos4, cos4, kc, kc, slots)
    with pytest.raises(ValueError, match=r"rope_write_: v \(2, 3, 8\) must match k"):
        fused_ops.rope_write_("torch", q, k, torch.zeros(2, 3, 8), cos4, cos4, kc, kc, q[:, 0, 0])
    with pytest.raises(ValueError, match="do not hold rows of"):
        fused_ops.rope_write_("torch", q, k, k, cos4, cos4, torch.zeros(5, 2, 4), kc, q[:, 0, 0])
    with pytest.raises(ValueError, match="one slot per token"):
        fused_ops.rope_write_("torch", q, k, k, cos4, cos4, kc, kc, torch.zeros(3).long())
    with pytest.raises(ValueError, match=r"silu_mul: need \[\.\.\., 2 \* I\]"):
        fused_ops.silu_mul("torch", torch.zeros(2, 7))


# ---- q/k/v and gate/up as one matmul ------------------------------------------------------


def _fused_logits(model, tokens: np.ndarray) -> torch.Tensor:
    ex = TorchExecutor.create(model, 64, fused="torch")
    item = ForwardItem("r", tokens, 0, np.arange(len(tokens)), SamplingParams(), True)
    return ex.forward_logits([item], [])


def test_projections_are_views_into_one_matmul_and_state_dicts_are_unchanged() -> None:
    """An executor with fused kernels concatenates each layer's q/k/v and gate/up once; the
    HF-named parameters become views into the concatenation (no second copy of the weights)
    and the state dict keeps its keys, shapes and values."""
    model = build_tiny_model(0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    size = sum(p.numel() for p in model.parameters())
    TorchExecutor.create(model, 16, fused="torch")
    after = model.state_dict()
    assert list(after) == list(before)
    for key, value in before.items():
        assert torch.equal(after[key], value), key
    assert sum(p.numel() for p in model.parameters()) == size
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    qkv, gate_up = attn._qkv, mlp._gate_up
    assert qkv is not None and gate_up is not None
    assert attn.q_proj.weight.data_ptr() == qkv.weight.data_ptr()
    assert attn.v_proj.weight.data_ptr() == qkv.weight[-attn.v_proj.out_features :].data_ptr()
    assert mlp.up_proj.weight.data_ptr() == gate_up.weight[mlp.gate_proj.out_features :].data_ptr()
    # untouched by an unfused executor
    plain = build_tiny_model(0)
    TorchExecutor.create(plain, 16)
    assert plain.model.layers[0].self_attn._qkv is None


def test_fused_projections_follow_a_reload_and_a_dtype_change() -> None:
    """Loading new weights in place reaches the concatenation (the parameters are views);
    replacing the parameters (load_state_dict(assign=True), .to(dtype)) makes the next
    fused forward concatenate again, so the fused logits always match the unfused ones."""
    tokens = np.array([5, 9, 1, 44, 3, 7])
    model = build_tiny_model(0)
    fused = _fused_logits(model, tokens)
    other = build_tiny_model(1)
    with torch.inference_mode():
        model.load_state_dict(other.state_dict())  # in place, into the views
        want = TorchExecutor.create(other, 64).forward_logits(
            [ForwardItem("r", tokens, 0, np.arange(6), SamplingParams(), True)], []
        )
        ex = TorchExecutor.create(model, 64, fused="torch")
        got = ex.forward_logits(
            [ForwardItem("r", tokens, 0, np.arange(6), SamplingParams(), True)], []
        )
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert not torch.equal(got, fused)
    # assign=True replaces the parameters: the old concatenation is stale and is rebuilt
    third = build_tiny_model(2)
    model.load_state_dict({k: v.clone() for k, v in third.state_dict().items()}, assign=True)
    torch.testing.assert_close(
        _fused_logits(model, tokens), _fused_logits(third, tokens), atol=0, rtol=0
    )
    # a dtype change replaces them too
    model.to(torch.float64)
    model.config = dataclasses.replace(model.config, dtype=torch.float64)
    want64 = TorchExecutor.create(model, 64).forward_logits(
        [ForwardItem("r", tokens, 0, np.arange(6), SamplingParams(), True)], []
    )
    got64 = _fused_logits(model, tokens)  # a stale float32 concatenation would not run
    assert model.model.layers[0].mlp._gate_up.weight.dtype == torch.float64
    # logits come back float32; the fused RoPE takes float32 tables: float32-level agreement
    torch.testing.assert_close(got64, want64, atol=1e-5, rtol=0)


def test_fused_projections_with_biases_match_unfused() -> None:
    """attention_bias / mlp_bias models (Qwen2-style q/k/v biases): the concatenated bias
    is added once to the one matmul, and the logits equal the unfused layers'."""
    cfg = dataclasses.replace(tiny_config(), attention_bias=True, mlp_bias=True)
    model = build_tiny_model(0, config=cfg)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(3)
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    want = fused_cases.scenario(model, "gather")
    got = fused_cases.scenario(model, "gather", fused="torch")
    assert model.model.layers[0].self_attn._qkv.bias is not None
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0, msg=f"step {step}")


def test_save_hf_after_fusion(tmp_path: Path) -> None:
    """A fused model's views share memory; save_hf still writes a checkpoint that loads
    back to the same weights."""
    from worker.engine.loader import load_model, save_hf

    model = build_tiny_model(0)
    TorchExecutor.create(model, 16, fused="torch")
    save_hf(model, tmp_path / "m")
    loaded = load_model(tmp_path / "m").model
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


def test_triton_refused_on_the_cpu_unless_interpreted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = build_tiny_model(0)
    with pytest.raises(ValueError, match="fused='triton' needs a CUDA device, got 'cpu'"):
        TorchExecutor.create(model, 16, fused="triton")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        build_executor("torch", num_kv_slots=16, device="cpu", fused="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert fused_ops.resolve("triton", torch.device("cpu")) == "triton"


def test_executor_and_factory_plumbing() -> None:
    """``kvroute worker --fused-kernels``: the CLI's choices are fused_ops'; the factory
    passes the option to the executor, whose batches carry it; sim refuses it."""
    from worker import cli

    assert cli.FUSED_CHOICES == fused_ops.FUSED_CHOICES
    args = cli.build_parser().parse_args(["--executor", "torch", "--fused-kernels", "torch"])
    assert args.fused_kernels == "torch"
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["--fused-kernels", "cuda"])
    bad = cli.build_parser().parse_args(["--executor", "sim", "--fused-kernels", "torch"])
    with pytest.raises(ValueError, match="--fused-kernels applies to --executor torch only"):
        cli.config_from_args(bad)
    with pytest.raises(ValueError, match="fused: only the 'torch' executor"):
        build_executor("sim", num_kv_slots=16, fused="off")
    ex, _ = build_executor("torch", num_kv_slots=32, device="cpu", fused="torch")
    assert isinstance(ex, TorchExecutor) and ex.fused_impl == "torch"
    default, _ = build_executor("torch", num_kv_slots=32, device="cpu")
    assert isinstance(default, TorchExecutor) and default.fused_impl == "off"
    item = ForwardItem("r", np.array([1, 2, 3]), 0, np.arange(3), SamplingParams(), True)
    assert ex._build_batch([item], [], all_positions=False).fused == "torch"
    static = TorchExecutor.create(
        build_tiny_default(), 64, attention="paged-torch", static_decode=True, fused="torch"
    )
    assert static.decode_graphs is not None and static.decode_graphs.fused == "torch"


# ---- on a GPU -----------------------------------------------------------------------------


@pytest.mark.gpu
def test_fused_kernels_on_cuda() -> None:
    """The compiled kernels: the same checks in float32 and bfloat16, the tiny model's logits
    fused vs unfused (float32), and the static decode path captured as CUDA graphs with
    fused="triton" against the regular unfused path. Fails, never skips, without CUDA."""
    assert torch.cuda.is_available(), "gpu tests need CUDA: run them on a GPU machine"
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
    fused_cases.check_add_rmsnorm("triton", "cuda")
    fused_cases.check_rope("triton", "cuda")
    fused_cases.check_silu_mul("triton", "cuda")
    fused_cases.check_rope_write("triton", "cuda")
    model = build_tiny_model(0, device="cuda")
    fused_cases.check_model("triton", model, atol=1e-4)
    want = fused_cases.scenario(model, "paged")
    got = fused_cases.scenario(model, "paged", fused="triton", cuda_graphs=True)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=0, msg=f"graphs step {step}")
