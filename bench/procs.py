"""Helpers the process-level benchmarks share: start a ``kvroute`` command and wait for its
``listening on HOST:PORT`` line, and print (and keep) a result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def start_kvroute(
    args: list[str],
    log: Path,
    timeout_s: float = 60.0,
    *,
    cwd: Path = ROOT,
    env: dict[str, str] | None = None,
) -> tuple[subprocess.Popen, str]:
    """``python -m kvroute_cli ARGS`` with stderr in ``log``; the process and the address it
    listens on (RuntimeError with the log's tail when it does not start)."""
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvroute_cli", *args],
            stdout=subprocess.PIPE,
            stderr=err,
            stdin=subprocess.DEVNULL,
            text=True,
            cwd=cwd,
            env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"},
        )
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    for line in proc.stdout:  # bounded: the process prints a few lines, then listens
        if line.startswith("listening on "):
            return proc, line.split()[-1]
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise RuntimeError(f"{args[0]} did not start; log: {log.read_text()[-2000:]}")


def report(result: dict[str, object], json_path: str | None) -> None:
    """Print ``result`` as JSON, and write it to ``json_path`` too when given."""
    text = json.dumps(result, indent=2)
    print(text)
    if json_path:
        Path(json_path).write_text(text + "\n")
