"""Run one case of a Triton case module (paged_cases.py, fused_cases.py) in a subprocess.

Triton picks its interpreter when it defines the kernels, and this test process may have
imported triton already without TRITON_INTERPRET, so each CPU or compile-only check runs the
case module in a fresh Python with the environment the test gives it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def run_case(cases: Path, case: str, env: dict[str, str]) -> None:
    """``python cases case`` under ``env``; asserts it exited 0 and printed ``ok case`` last
    (its output tails in the failure message)."""
    proc = subprocess.run(
        [sys.executable, str(cases), case],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        cwd=cases.parent,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.stdout.strip().endswith(f"ok {case}")
