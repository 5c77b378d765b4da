"""bench/gpu_probe.py: stage lines printed as each stage completes; without CUDA it stops
after importing torch and exits 1 (the GPU session's first step, so a stalled machine shows
how far it got)."""

from __future__ import annotations

import re

import torch

from bench import gpu_probe


def test_probe_without_cuda_stops_after_torch(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # runs on a GPU machine too
    assert gpu_probe.main() == 1
    lines = capsys.readouterr().out.splitlines()
    assert [re.sub(r"\+ *[0-9.]+ s", "+T s", line) for line in lines] == [
        "[gpu_probe +T s] start",
        f"[gpu_probe +T s] torch {torch.__version__} imported (cuda {torch.version.cuda})",
        "[gpu_probe +T s] CUDA is not available",
    ]
