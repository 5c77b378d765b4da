"""bench/bench_gpu.py --fused: the fused RMSNorm/RoPE columns. On the CPU (smoke) they run
the fused structure with torch ops (``fused="torch"``); timings are not checked, only that
the columns, which steps each times, and their greedy parity are produced (the GPU run, with
the Triton kernels, is bench/gpu_session.sh)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import bench_gpu


def test_smoke_with_fused_columns(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "gpu.json"
    argv = ["--smoke", "--attention", "paged", "--cuda-graphs", "--fused", "--json", str(out)]
    assert bench_gpu.main(argv) == 0
    result = json.loads(out.read_text())
    labels = ["paged", "paged+fused", "paged+graphs", "paged+graphs+fused"]
    assert result["attention"] == labels
    assert result["fused_impl"] == {
        "paged": "off",
        "paged+fused": "torch",  # no CUDA: the reference ops, not the kernels
        "paged+graphs": "off",
        "paged+graphs+fused": "torch",
    }
    assert result["decode_path"]["paged+graphs+fused"] == "static-eager"
    names = {label: [m["name"] for m in result["steps_by_attention"][label]] for label in labels}
    assert names["paged+fused"] == names["paged"]  # prefill and decode steps
    assert names["paged+graphs+fused"] == names["paged+graphs"]  # static paths only
    assert "decode_b1" in names["paged+graphs"] and "prefill_cold_256" in names["paged+graphs"]
    for label in labels:
        parity = result["parity_by_attention"][label]
        assert parity["equal"] and parity["cached_prompt_tokens"] == parity["prompt_tokens"] - 1
    assert result["greedy_same_across_attention"] is True
    printed = capsys.readouterr().out
    assert "paged+graphs+fused ms" in printed and "(fused torch)" in printed


def test_fused_needs_a_paged_option() -> None:
    with pytest.raises(SystemExit) as exc:
        bench_gpu.main(["--smoke", "--fused", "--attention", "gather"])
    assert exc.value.code == 2
