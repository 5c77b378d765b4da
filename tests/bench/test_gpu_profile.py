"""bench/gpu_profile.py: the CPU smoke mode profiles every step and writes every figure
(timings are not checked; on the CPU the profiler sees no GPU kernels)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import gpu_profile


def test_smoke_profiles_every_step(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "profile.json"
    assert gpu_profile.main(["--smoke", "--repeats", "1", "--steps", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["mode"] == "smoke" and result["fused"] == "torch"
    assert list(result["steps"]) == [
        "prefill_cached_16_after_192",
        "prefill_cached_16_after_192_graphs",
        "decode_b1_eager",
        "decode_b1_graphs",
        "decode_b4_graphs",
    ]
    for name, step in result["steps"].items():
        assert step["wall_min_ms"] <= step["wall_ms"], name
        assert step["kernel_ms"] == 0 and step["top"] == [], name  # no GPU kernels on the CPU
        assert step["host_ms"] > 0 and step["host_functions"], name
    printed = capsys.readouterr().out
    assert "host time by Python function" in printed and "decode_b4_graphs" in printed


def test_bad_counts_are_usage_errors() -> None:
    with pytest.raises(SystemExit) as exc:
        gpu_profile.main(["--smoke", "--steps", "0"])
    assert exc.value.code == 2
