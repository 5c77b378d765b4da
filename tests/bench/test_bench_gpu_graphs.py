"""bench/bench_gpu.py --cuda-graphs: the CUDA-graph decode column. On the CPU (smoke) the
column runs the static-shape decode path eagerly; timings are not checked, only that the
column, its buckets and its greedy parity are produced (the GPU run is bench/gpu_session.sh)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import bench_gpu


def test_smoke_with_cuda_graphs_column(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "gpu.json"
    assert bench_gpu.main(["--smoke", "--cuda-graphs", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["attention"] == ["gather", "paged", "paged+graphs"]
    assert result["decode_path"] == {
        "gather": "regular",
        "paged": "regular",
        "paged+graphs": "static-eager",  # no CUDA: the same padded path, not captured
    }
    assert result["attention_impl"]["paged+graphs"] == "torch"
    # The graph column is timed where its executor runs a static path: decode steps, and a
    # lone prefill of at most 512 tokens -- in smoke sizes every prefill step (at full size
    # only the cached one: cold 2,048 and 8,064 are the paged column's own).
    graph_steps = result["steps_by_attention"]["paged+graphs"]
    assert [m["name"] for m in graph_steps] == [
        "prefill_cold_64",
        "prefill_cold_256",
        "prefill_cached_16_after_192",
        "decode_b1",
        "decode_b4",
    ]
    # cold 64; the cached step's 16 new; cold 256 and the parity run's 200-token prompt
    assert result["prefill_graph_buckets"]["paged+graphs"] == [[16, 256], [64, 256], [256, 256]]
    assert all(m["attention"] == "paged+graphs" and m["median_s"] > 0 for m in graph_steps)
    # decode_b1 and decode_b4 at 128 tokens of context, plus the parity run's batch of 1.
    assert result["graph_buckets"] == {"paged+graphs": [[1, 256], [4, 256]]}
    parity = result["parity_by_attention"]["paged+graphs"]
    assert parity["equal"] and parity["cached_prompt_tokens"] == parity["prompt_tokens"] - 1
    assert result["greedy_same_across_attention"] is True
    assert result["steps"] == result["steps_by_attention"]["gather"]  # first column unchanged
    printed = capsys.readouterr().out
    assert "paged+graphs ms" in printed and "static-eager decode" in printed


def test_cuda_graphs_needs_a_paged_option() -> None:
    with pytest.raises(SystemExit) as exc:
        bench_gpu.main(["--smoke", "--cuda-graphs", "--attention", "gather"])
    assert exc.value.code == 2


def test_graph_warmup_is_reported_and_empty_without_cuda(tmp_path: Path) -> None:
    """--graph-warmup: on the CPU the graph column runs eagerly, so nothing is captured
    and the field says so (on CUDA: graphs, seconds and memory per graph column)."""
    out = tmp_path / "gpu.json"
    argv = ["--smoke", "--attention", "paged", "--cuda-graphs", "--graph-warmup"]
    assert bench_gpu.main([*argv, "--json", str(out)]) == 0
    assert json.loads(out.read_text())["graph_warmup"] == {}
