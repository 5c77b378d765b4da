"""A port that is taken is an error, never shared: a second `kvroute up` on the gRPC or the
HTTP port of a running one exits with one clear line (grpc's SO_REUSEPORT default once let
two fleets split one port's clients between them)."""

from __future__ import annotations

import re
import subprocess

import pytest
from e2e_procs import procs, run_up

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def _up(*args: str) -> subprocess.CompletedProcess[str]:
    return run_up(*args, workers=1, timeout=60)


def _our_lines(stderr: str) -> list[str]:
    """stderr without grpc's own C-core log lines (``E1206 13:26:36.5 ... add_port.cc``)."""
    return [x for x in stderr.splitlines() if x.strip() and not re.match(r"[EIWD]\d{4} ", x)]


def test_a_second_up_on_a_taken_port_exits_with_one_line() -> None:
    with procs() as p:
        first = p.start(
            "up",
            ["up", "--workers", "1", "--executor", "sim", "--port", "0", "--http-port", "0"],
            marker="router listening on",
        )
        grpc_port = first.address.rsplit(":", 1)[1]
        second = _up("--port", grpc_port)
        assert second.returncode == 1
        assert _our_lines(second.stderr) == [
            f"kvroute up: could not bind 127.0.0.1:{grpc_port}: Address already in use "
            "(is another kvroute or server listening there?)"
        ]
        assert "router listening" not in second.stdout
        http_line = next(x for x in first.lines if x.startswith("router http listening on"))
        http_port = http_line.rsplit(":", 1)[1]
        third = _up("--port", "0", "--http-port", http_port)
        assert third.returncode == 1
        assert _our_lines(third.stderr) == [
            f"kvroute up: could not bind HTTP 127.0.0.1:{http_port}: Address already in use"
        ]
        assert first.popen.poll() is None  # the first fleet is untouched
