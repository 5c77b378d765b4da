"""Real processes for end-to-end tests: start ``python -m kvroute_cli ...``, read its
``listening on HOST:PORT`` line, and always kill it (the ``Procs`` context manager)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 60.0
POLL_S = 0.05


async def until(check, what: str, timeout: float = 20.0):
    """Poll a condition of another process (nothing to await) within ``timeout``."""
    try:
        async with asyncio.timeout(timeout):
            while not (result := await check()):
                await asyncio.sleep(POLL_S)
    except TimeoutError:
        raise AssertionError(what) from None
    return result


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    address: str = ""
    lines: list[str] = field(default_factory=list)  # stdout lines seen so far

    def wait(self, timeout: float) -> int:
        return self.popen.wait(timeout=timeout)


def _read_until_listening(proc: Proc, marker: str, timeout: float) -> None:
    """Read stdout lines until one contains ``marker``; the rest is drained in a thread."""
    found = threading.Event()

    def pump() -> None:
        assert proc.popen.stdout is not None
        for raw in proc.popen.stdout:
            line = raw.rstrip("\n")
            proc.lines.append(line)
            if not found.is_set() and marker in line:
                proc.address = line.split()[line.split().index("on") + 1]
                found.set()
        found.set()  # EOF: let the waiter see it failed

    threading.Thread(target=pump, daemon=True).start()
    if not found.wait(timeout) or not proc.address:
        raise RuntimeError(
            f"{proc.name} did not print {marker!r} within {timeout} s; "
            f"exit={proc.popen.poll()} stdout={proc.lines[-20:]}"
        )


class Procs:
    """Starts processes and kills every one of them on exit, whatever happened."""

    def __init__(self) -> None:
        self.procs: list[Proc] = []

    def start(
        self,
        name: str,
        args: list[str],
        *,
        marker: str = "listening on",
        wait: bool = True,
        log: Path | None = None,
    ) -> Proc:
        """``log``: a file the process's stderr (its log lines) goes to; else discarded."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        stderr = subprocess.DEVNULL if log is None else open(log, "w")  # noqa: SIM115
        popen = subprocess.Popen(
            [sys.executable, "-m", "kvroute_cli", *args],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=stderr,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        if log is not None:
            stderr.close()  # the child holds its own descriptor
        proc = Proc(name, popen)
        self.procs.append(proc)
        if wait:
            _read_until_listening(proc, marker, START_TIMEOUT_S)
        return proc

    def worker(self, worker_id: str, *extra: str, port: int = 0, executor: str = "sim") -> Proc:
        return self.start(
            worker_id,
            [
                "worker",
                "--executor",
                executor,
                "--port",
                str(port),
                "--worker-id",
                worker_id,
                "--block-size",
                "4",
                "--load-interval-s",
                "0.2",
                "--log-level",
                "WARNING",
                *extra,
            ],
        )

    def router(self, workers: list[str], *extra: str) -> Proc:
        args = ["router", "--port", "0", "--purge-after-s", "0.5", "--log-level", "WARNING"]
        for w in workers:
            args += ["--worker", w]
        return self.start("router", [*args, *extra])

    def kill(self, proc: Proc, sig: int = signal.SIGKILL) -> None:
        with contextlib.suppress(ProcessLookupError):
            proc.popen.send_signal(sig)
        proc.popen.wait(timeout=30)

    def close(self) -> None:
        for proc in self.procs:
            if proc.popen.poll() is None:
                proc.popen.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(timeout=10)


@contextlib.contextmanager
def procs() -> Iterator[Procs]:
    p = Procs()
    try:
        yield p
    finally:
        p.close()


def run_up(*args: str, workers: int = 1, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``kvroute up --workers N --executor sim ARGS`` to its end (the caller gives --exit or
    expects it to fail)."""
    command = ["up", "--workers", str(workers), "--executor", "sim", *args]
    return subprocess.run(
        [sys.executable, "-m", "kvroute_cli", *command],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def wait_healthy(url: str, timeout: float = 30.0) -> None:
    """GET ``url``/health until 200 (a router connects to its workers after it listens)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except urllib.error.HTTPError as exc:
            if exc.code != 503 or time.monotonic() > deadline:
                raise
        time.sleep(0.05)  # another process: nothing to await
