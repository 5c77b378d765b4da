"""The loadtest figure of RELIABILITY.md: ``kvroute loadtest`` against ``kvroute up``.

    python -m bench.reliability_loadtest [--workers 4] [--concurrency 256] [--duration 60]
        [--http] [--json bench/results/reliability/loadtest.json]

Starts ``kvroute up --executor sim --workers N --port 0 --metrics-port P`` (the router runs
in the ``up`` process, the workers are its children), reads the router's RSS, runs
``kvroute loadtest`` as another process (gRPC, or the OpenAI HTTP front with ``--http``),
reads the RSS again, then checks every worker through its /metrics: nothing running or
waiting, no protected KV slot, free + evictable + protected == total. Prints one JSON
object (the loadtest summary plus those checks); ``up`` is stopped with SIGTERM at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _free_base_port(span: int) -> int:
    """A port P with P..P+span free right now (best effort; the OS may hand one out later)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + span >= 65536:
            continue
        try:
            socks = []
            for port in range(base, base + span + 1):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no run of free ports found")


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        kb = int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1))  # type: ignore[union-attr]
    return round(kb / 1024, 1)


def worker_kv(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^kvroute_worker_([a-z_]+)(?:\{[^}]*\})? ([-+0-9.eE]+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def worker_clean(kv: dict[str, float]) -> bool:
    """Idle, nothing protected, and every slot accounted for."""
    parts = kv["kv_free_tokens"] + kv["kv_evictable_tokens"] + kv["kv_protected_tokens"]
    return (
        kv["running_requests"] == 0
        and kv["waiting_requests"] == 0
        and kv["kv_protected_tokens"] == 0
        and parts == kv["kv_total_tokens"]
    )


def run(workers: int, concurrency: int, duration_s: float, *, http: bool) -> dict:
    """One measured run; see the module docstring."""
    base = _free_base_port(workers + 1)
    cmd = [sys.executable, "-m", "kvroute_cli", "up", "--executor", "sim"]
    cmd += ["--workers", str(workers), "--port", "0", "--metrics-port", str(base)]
    cmd += ["--http-port", "0", "--log-level", "WARNING"]
    up = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    try:
        grpc_addr, http_url = _read_addresses(up, timeout_s=120)
        time.sleep(1.0)  # the router's first load reports
        rss_before = rss_mib(up.pid)
        target = ["--http", http_url] if http else ["--router", grpc_addr]
        with tempfile.TemporaryDirectory() as tmp:
            out_json = Path(tmp) / "summary.json"
            load = subprocess.run(
                [
                    *(sys.executable, "-m", "kvroute_cli", "loadtest", *target),
                    *("--concurrency", str(concurrency), "--duration", str(duration_s)),
                    *("--json", str(out_json), "--timeout", "60"),
                ],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=duration_s + 120,
            )
            rss_after = rss_mib(up.pid)
            if not out_json.exists():
                raise RuntimeError(f"kvroute loadtest failed: {load.stderr[-2000:]}")
            summary = json.loads(out_json.read_text())
        kv = {}
        deadline = time.monotonic() + 10
        for i in range(workers):
            url = f"http://127.0.0.1:{base + 1 + i}/metrics"
            while not worker_clean(kv_i := worker_kv(url)) and time.monotonic() < deadline:
                time.sleep(0.1)
            kv[f"worker-{i}"] = kv_i
        return summary | {
            "loadtest_exit": load.returncode,
            "workers": workers,
            "router_rss_mib_before": rss_before,
            "router_rss_mib_after": rss_after,
            "workers_clean": all(worker_clean(v) for v in kv.values()),
            "worker_kv": {
                k: {
                    n: v[n]
                    for n in (
                        "kv_total_tokens",
                        "kv_free_tokens",
                        "kv_evictable_tokens",
                        "kv_protected_tokens",
                        "running_requests",
                    )
                }
                for k, v in kv.items()
            },
            "command": " ".join(
                [
                    "kvroute",
                    "loadtest",
                    *target,
                    "--concurrency",
                    str(concurrency),
                    "--duration",
                    str(duration_s),
                ]
            ),
            "fleet": f"kvroute up --executor sim --workers {workers}",
            "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, "
            f"Python {platform.python_version()}",
        }
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(timeout=30)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait(timeout=10)


def _read_addresses(up: subprocess.Popen, timeout_s: float) -> tuple[str, str]:
    found: dict[str, str] = {}
    done = threading.Event()

    def pump() -> None:
        assert up.stdout is not None
        for line in up.stdout:
            if m := re.search(r"^router listening on (\S+)", line):
                found["grpc"] = m.group(1)
            if m := re.search(r"http listening on (\S+)", line):
                found["http"] = m.group(1)
            if len(found) == 2:
                done.set()
        done.set()

    threading.Thread(target=pump, daemon=True).start()
    if not done.wait(timeout_s) or len(found) < 2:
        raise RuntimeError(f"kvroute up did not start: {found}, exit={up.poll()}")
    return found["grpc"], found["http"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.reliability_loadtest",
        description="kvroute loadtest against kvroute up --executor sim; RSS and KV checks",
    )
    p.add_argument("--workers", type=int, default=4, help="sim workers")
    p.add_argument("--concurrency", type=int, default=256, help="streams in flight")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    p.add_argument("--http", action="store_true", help="through the OpenAI HTTP front")
    p.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = p.parse_args(argv)
    result = run(args.workers, args.concurrency, args.duration, http=args.http)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    ok = result["workers_clean"] and not result["errors"] and result["loadtest_exit"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
