"""--metrics-port on the command lines: a bad value is a usage error naming the option, a
port already taken is a one-line error (exit 1), not a traceback."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvroute_cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("command", ["router", "worker", "up"])
def test_an_out_of_range_port_is_a_usage_error(command: str) -> None:
    extra = ["--worker", "127.0.0.1:1"] if command == "router" else []
    result = _run(command, *extra, "--metrics-port", "70000")
    assert result.returncode == 2
    assert "--metrics-port: must be in 0..65535" in result.stderr


@pytest.mark.parametrize("command", ["router", "worker"])
def test_a_taken_port_is_a_one_line_error(command: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        extra = ["--worker", "127.0.0.1:1"] if command == "router" else ["--executor", "sim"]
        result = _run(command, "--port", "0", *extra, "--metrics-port", port)
    assert result.returncode == 1
    assert f"could not serve metrics on 127.0.0.1:{port}" in result.stderr
    assert "Traceback" not in result.stderr
