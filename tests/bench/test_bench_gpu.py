"""bench/bench_gpu.py: the CPU smoke mode produces every figure (timings are not checked:
timing does not go into tests), the roofline arithmetic is exact, and -- on a CUDA machine,
``python -m pytest -m gpu`` -- the Llama-3-8B-shaped run completes with greedy parity."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench import bench_gpu
from worker.engine.model import build_tiny_model

SMOKE_STEPS = [
    "prefill_cold_64",
    "prefill_cold_256",
    "prefill_cached_16_after_192",
    "mixed_16_after_192_plus_decode_b4",
    "decode_b1",
    "decode_b4",
]


def test_smoke_run_writes_every_figure(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Both attention backends (the default gather,paged) measured step by step; the first
    one's figures keep the single-backend fields a cost profile is fitted from."""
    out = tmp_path / "gpu.json"
    argv = ["--smoke", "--json", str(out), "--hbm-gbps", "100", "--peak-tflops", "1"]
    assert bench_gpu.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["mode"] == "smoke"
    assert result["specs"] == {"hbm_bytes_s": 1e11, "peak_flops": 1e12, "source": "flags"}
    assert result["attention"] == ["gather", "paged"]
    assert result["attention_impl"] == {"gather": "gather", "paged": "torch"}  # CPU: reference
    assert result["steps"] == result["steps_by_attention"]["gather"]
    for attention in ("gather", "paged"):
        steps = {m["name"]: m for m in result["steps_by_attention"][attention]}
        assert list(steps) == SMOKE_STEPS
        for m in steps.values():
            assert m["attention"] == attention
            assert m["median_s"] > 0 and m["min_s"] <= m["median_s"]
            assert m["roofline_s"] == max(m["bytes"] / 1e11, m["flops"] / 1e12)
            assert m["target_s"] is None  # the targets are for the 8B shape only
        assert steps["decode_b4"]["tokens"] == 4
        assert steps["mixed_16_after_192_plus_decode_b4"]["tokens"] == 16 + 4
        rate = result["decode_full_batch_tokens_s_by_attention"][attention]
        assert rate == steps["decode_b4"]["tokens_per_s"]
        parity = dict(result["parity_by_attention"][attention])
        assert len(parity.pop("cold_tokens")) == 4
        assert parity == {
            "equal": True,
            "first_mismatch": None,
            "prompt_tokens": 200,
            "cached_prompt_tokens": 199,
            "new_tokens": 4,
        }
    assert result["decode_full_batch_tokens_s"] == result["steps"][-1]["tokens_per_s"]
    assert result["parity"]["cold_tokens"] == result["parity_by_attention"]["gather"]["cold_tokens"]
    assert result["greedy_same_across_attention"] is True
    printed = capsys.readouterr().out
    assert "gather ms" in printed and "paged ms" in printed and "decode_b4" in printed


def test_smoke_with_one_backend(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    assert bench_gpu.main(["--smoke", "--attention", "paged-torch", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["attention"] == ["paged-torch"]
    assert [m["attention"] for m in result["steps"]] == ["paged-torch"] * len(SMOKE_STEPS)


def test_roofline_arithmetic_on_the_tiny_model() -> None:
    model = build_tiny_model(0)
    cfg = model.config
    shape = bench_gpu.Shape.of(model)
    params = sum(p.numel() for p in model.parameters())
    embed = cfg.vocab_size * cfg.hidden_size
    assert shape.lm_head_params == embed
    assert shape.matmul_params == params - 2 * embed
    assert shape.streamed_weight_bytes == 4 * (params - embed)  # float32, embedding not read
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4
    assert shape.kv_bytes_per_token == kv
    attn = cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim
    # Two decode requests at context 10 and 20: one new token each.
    flops, nbytes = shape.step([1, 1], [10, 20])
    pairs = (9 + 1) + (19 + 1)
    assert flops == 2.0 * shape.matmul_params * 2 + 2.0 * embed * 2 + 4.0 * attn * pairs
    assert nbytes == shape.streamed_weight_bytes + kv * (9 + 19 + 2)
    # A cold prefill of 8 tokens: 36 causal pairs, nothing read from the pool.
    flops, nbytes = shape.step([8], [8])
    assert flops == 2.0 * shape.matmul_params * 8 + 2.0 * embed + 4.0 * attn * 36
    assert nbytes == shape.streamed_weight_bytes + kv * 8


def test_specs_by_flag_and_unknown_cpu() -> None:
    cpu = torch.device("cpu")
    assert bench_gpu.device_specs(cpu, None, None) == bench_gpu.Specs(None, None, "unknown")
    assert bench_gpu.device_specs(cpu, 2000, 500) == bench_gpu.Specs(2e12, 5e14, "flags")


@pytest.mark.parametrize(
    "argv",
    [
        ["--smoke", "--hbm-gbps", "0"],
        ["--smoke", "--peak-tflops", "-1"],
        ["--smoke", "--attention", "gather,flash"],
        ["--smoke", "--attention", "gather,gather"],
        ["--smoke", "--attention", ","],
    ],
)
def test_bad_numbers_are_usage_errors(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench_gpu.main(argv)
    assert exc.value.code == 2


@pytest.mark.gpu
def test_llama3_8b_shape_on_cuda(tmp_path: Path) -> None:
    """The full run (Llama-3-8B shape, bf16, gather and paged attention side by side, a few
    minutes on an H100/H200; both backends' greedy cached-vs-cold parity). Deselected by
    default (pyproject addopts ``-m 'not gpu'``); run with ``python -m pytest -m gpu``. Fails,
    never skips, without CUDA."""
    assert torch.cuda.is_available(), "gpu tests need CUDA: run them on a GPU machine"
    out = tmp_path / "gpu.json"
    assert bench_gpu.main(["--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["attention_impl"] == {"gather": "gather", "paged": "triton"}
    for attention in ("gather", "paged"):
        names = [m["name"] for m in result["steps_by_attention"][attention]]
        assert names == [
            "prefill_cold_2048",
            "prefill_cold_8064",
            "prefill_cached_64_after_8000",
            "mixed_64_after_8000_plus_decode_b32",
            "decode_b1",
            "decode_b8",
            "decode_b32",
            "decode_b128",
        ]
        parity = result["parity_by_attention"][attention]
        assert parity["cached_prompt_tokens"] == parity["prompt_tokens"] - 1
        assert parity["equal"], (attention, parity)
    assert result["dtype"] == "torch.bfloat16"
    assert result["num_params"] == 8_030_261_248  # Llama-3-8B
