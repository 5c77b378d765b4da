"""Tests against peer software (vLLM, vllm-router, SGLang) in virtualenvs of their own."""

from __future__ import annotations

import subprocess


def stop(proc: subprocess.Popen[bytes] | subprocess.Popen[str], timeout: float = 30) -> None:
    """Terminate ``proc``, then kill it if it has not exited within ``timeout`` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout)
