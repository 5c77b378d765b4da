"""``kvroute up``: a local fleet -- N worker subprocesses and a router -- in one command.

    kvroute up --workers 2 --port 50051 [--executor torch|sim] [--demo [--exit]]

Each worker is ``python -m kvroute_cli worker --port 0 ...``; its ``listening on HOST:PORT``
line tells us where it is. The router runs in this process (it never imports the worker
package). Ctrl-C or SIGTERM stops everything in order: the router refuses new requests and
lets those in flight finish (``--stop-timeout-s``), then each worker gets SIGTERM,
``--stop-timeout-s`` to exit, then SIGKILL. Workers also get SIGTERM from the
kernel if this process dies without cleaning up (Linux parent-death signal): no orphans.

``--demo`` sends two requests that share a long prefix through the router and prints which
worker served each and how many prompt tokens were cached, then keeps running (or exits with
``--exit``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from edge.cli_help import HelpFormatter, port_number
from edge.http_front import HttpFrontConfig
from edge.runtime import configure_logging, run_event_loop, stop_signals
from edge.tokenizer import load_tokenizer_or_bytes
from kvroute_proto.hashing import set_hash_key
from router.cli.client import GenerateOptions, RouterClient
from router.cli.processes import RouterProcesses, die_with_parent
from router.cli.router import POLICIES
from router.cli.security_flags import (
    FleetSecurity,
    add_fleet_security_args,
    fleet_security_from_args,
)
from router.core.router_core import RouterConfig
from router.service.frontend import FrontendConfig
from router.service.metrics import RouterMetricsEndpoint
from router.service.server import RouterServer, RouterServerConfig
from router.service.worker_conn import ConnectionConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """What ``kvroute up`` starts."""

    num_workers: int = 2
    port: int = 50051
    host: str = "127.0.0.1"
    executor: str = "torch"
    policy: str = "cache_aware"
    worker_args: tuple[str, ...] = ()
    worker_log_level: str = "WARNING"
    startup_timeout_s: float = 120.0
    stop_timeout_s: float = 10.0
    http_port: int | None = None  # the router's OpenAI-compatible HTTP port; None: off
    # /metrics: the router on metrics_port, worker i on metrics_port + 1 + i (0: every one
    # picks a free port); None: no metrics endpoints
    metrics_port: int | None = None
    model: str | None = None  # an HF model directory for every worker and the router
    security: FleetSecurity = field(default_factory=FleetSecurity)  # TLS, keys, limits
    router_processes: int = 1  # >1: `kvroute router --processes N` instead of in-process

    def __post_init__(self) -> None:
        if self.model is not None and self.executor != "torch":
            raise ValueError("--model needs --executor torch (the sim executor has no model)")
        if self.http_port is not None and not 0 <= self.http_port < 65536:
            raise ValueError(f"--http-port must be in 0..65535, got {self.http_port}")
        if self.metrics_port is not None and not (
            self.metrics_port == 0 or 0 < self.metrics_port + self.num_workers < 65536
        ):
            raise ValueError(
                f"--metrics-port {self.metrics_port} leaves no port for each of the "
                f"{self.num_workers} workers (they take the next ports)"
            )
        if not 1 <= self.num_workers <= 64:
            raise ValueError(f"--workers must be in 1..64, got {self.num_workers}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")
        if not 1 <= self.router_processes <= 64:
            raise ValueError(f"--router-processes must be in 1..64, got {self.router_processes}")
        if self.router_processes > 1 and (
            self.metrics_port is not None or self.security != FleetSecurity()
        ):
            raise ValueError(
                "--router-processes above 1 runs without --metrics-port and the security "
                "options (TLS, API keys, limits, --hash-key) for now"
            )


@dataclass(slots=True)
class WorkerProcess:
    worker_id: str
    proc: asyncio.subprocess.Process
    address: str = ""
    _pump: asyncio.Task[None] | None = None


def _torch_threads(config: FleetConfig) -> list[str]:
    """Share the CPU between local torch workers: N workers x torch's default thread count
    oversubscribe the cores, and spinning threads then make prefill many times slower."""
    if config.executor != "torch" or any(
        a.startswith("--torch-threads") for a in config.worker_args
    ):
        return []
    return ["--torch-threads", str(max(1, (os.cpu_count() or 1) // max(1, config.num_workers)))]


def worker_metrics_port(config: FleetConfig, index: int) -> int | None:
    """The /metrics port of worker ``index`` (None: no endpoint; 0: a free one)."""
    if config.metrics_port is None:
        return None
    return 0 if config.metrics_port == 0 else config.metrics_port + 1 + index


def worker_command(
    config: FleetConfig, worker_id: str, metrics_port: int | None = None
) -> list[str]:
    """The argv of one worker subprocess."""
    metrics = [] if metrics_port is None else ["--metrics-port", str(metrics_port)]
    return [
        sys.executable,
        "-m",
        "kvroute_cli",
        "worker",
        "--host",
        config.host,
        "--port",
        "0",
        "--worker-id",
        worker_id,
        "--executor",
        config.executor,
        "--log-level",
        config.worker_log_level,
        *_torch_threads(config),
        *metrics,
        *([] if config.model is None else ["--model", config.model]),
        *config.worker_args,
    ]


async def _pump_stdout(wp: WorkerProcess) -> None:
    """Keep reading a worker's stdout (so the pipe never fills), echoing it prefixed."""
    assert wp.proc.stdout is not None
    async for line in wp.proc.stdout:
        print(f"[{wp.worker_id}] {line.decode(errors='replace').rstrip()}", flush=True)


async def start_worker(
    config: FleetConfig, worker_id: str, metrics_port: int | None = None
) -> WorkerProcess:
    """Start one worker and wait for its ``listening on`` line."""
    proc = await asyncio.create_subprocess_exec(
        *worker_command(config, worker_id, metrics_port),
        stdout=asyncio.subprocess.PIPE,
        stdin=asyncio.subprocess.DEVNULL,
        start_new_session=True,  # Ctrl-C reaches us only; we stop workers in order
        preexec_fn=die_with_parent if sys.platform.startswith("linux") else None,
        env=config.security.worker_env(),  # --hash-key and the router token, not in argv
    )
    wp = WorkerProcess(worker_id, proc)
    assert proc.stdout is not None
    try:
        async with asyncio.timeout(config.startup_timeout_s):
            while True:
                line = (await proc.stdout.readline()).decode(errors="replace")
                if not line:
                    code = await proc.wait()
                    raise RuntimeError(
                        f"worker {worker_id} exited with code {code} before listening"
                    )
                if line.startswith("listening on "):
                    wp.address = line.split()[-1]
                    break
    except TimeoutError:
        await stop_worker(wp, config.stop_timeout_s)
        raise RuntimeError(
            f"worker {worker_id} did not listen within {config.startup_timeout_s} s"
        ) from None
    wp._pump = asyncio.create_task(_pump_stdout(wp))
    return wp


async def stop_worker(wp: WorkerProcess, timeout_s: float) -> int:
    """SIGTERM, wait up to ``timeout_s``, then SIGKILL; returns the exit code."""
    if wp.proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            wp.proc.terminate()
        try:
            async with asyncio.timeout(timeout_s):
                await wp.proc.wait()
        except TimeoutError:
            log.warning("worker %s did not stop in %.1f s: killing it", wp.worker_id, timeout_s)
            with contextlib.suppress(ProcessLookupError):
                wp.proc.kill()
            await wp.proc.wait()
    if wp._pump is not None:
        wp._pump.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await wp._pump
    return wp.proc.returncode if wp.proc.returncode is not None else -1


class Fleet:
    """N worker subprocesses plus an in-process router."""

    def __init__(self, config: FleetConfig) -> None:
        self.config = config
        self.workers: list[WorkerProcess] = []
        self.router: RouterServer | None = None
        self.metrics: RouterMetricsEndpoint | None = None  # the router's /metrics
        self.processes: RouterProcesses | None = None  # --router-processes N > 1

    async def start(self) -> str:
        """Start workers (concurrently) and the router; returns the router address."""
        # the workers' tokenizer (loaded first: a bad model dir fails before any process
        # starts); the router encodes text prompts with it and checks theirs against it
        tokenizer = load_tokenizer_or_bytes(self.config.model)
        ids = [f"worker-{i}" for i in range(self.config.num_workers)]
        results = await asyncio.gather(
            *(
                start_worker(self.config, wid, worker_metrics_port(self.config, i))
                for i, wid in enumerate(ids)
            ),
            return_exceptions=True,
        )
        self.workers = [r for r in results if isinstance(r, WorkerProcess)]
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self.stop()
            raise errors[0]
        if self.config.router_processes > 1:
            return await self._start_processes()
        service = FrontendConfig()
        if self.config.model is not None:
            service = FrontendConfig(model_name=Path(self.config.model).resolve().name)
        set_hash_key(self.config.security.hash_key)  # the in-process router's block hashes
        self.router = RouterServer(
            self.config.security.apply(  # TLS, API keys, tenant limits, the workers' token
                RouterServerConfig(
                    host=self.config.host,
                    port=self.config.port,
                    workers=tuple(w.address for w in self.workers),
                    core=RouterConfig(policy=self.config.policy),
                    service=service,
                    connection=ConnectionConfig(
                        purge_after_s=5.0, tokenizer_fingerprint=tokenizer.fingerprint
                    ),
                    seed=0,
                    http=None
                    if self.config.http_port is None
                    else HttpFrontConfig(host=self.config.host, port=self.config.http_port),
                )
            ),
            tokenizer=tokenizer,
        )
        await self.router.start()
        if self.config.metrics_port is not None:
            self.metrics = RouterMetricsEndpoint(
                self.router, self.config.host, self.config.metrics_port
            )
            try:
                self.metrics.start()
            except BaseException:
                self.metrics = None
                await self.stop()
                raise
        return self.router.address

    async def _start_processes(self) -> str:
        c = self.config
        argv = ["--host", c.host, "--http-host", c.host, "--port", str(c.port)]
        argv += ["--policy", c.policy, "--purge-after-s", "5", "--seed", "0"]
        argv += ["--log-level", c.worker_log_level]
        argv += ["--http-port", str(c.http_port)] if c.http_port is not None else []
        argv += ["--model", c.model] if c.model is not None else []
        for w in self.workers:
            argv += ["--worker", w.address]
        self.processes = RouterProcesses(argv, len(self.workers))
        try:
            return await self.processes.start(c.router_processes, c.startup_timeout_s)
        except BaseException:
            await self.stop()
            raise

    async def wait_ready(self, timeout_s: float) -> None:
        """Wait until the router is connected to every worker."""
        if self.processes is not None:
            await self.processes.wait_ready(timeout_s)
            return
        assert self.router is not None
        pool = self.router.pool
        await pool.wait_for(lambda: all(c.healthy for c in pool.conns.values()), timeout_s)

    async def stop(self) -> None:
        """Drain in order: the router refuses new requests and lets those in flight finish
        (up to ``stop_timeout_s``, the time a worker gets too), then every worker stops."""
        if self.metrics is not None:
            self.metrics.stop()
            self.metrics = None
        if self.router is not None:
            await self.router.stop(grace_s=self.config.stop_timeout_s)
            self.router = None
        if self.processes is not None:
            await self.processes.stop()
            self.processes = None
        await asyncio.gather(*(stop_worker(w, self.config.stop_timeout_s) for w in self.workers))
        self.workers = []


DEMO_SYSTEM = (
    "You are a helpful support agent for ExampleCorp. Answer briefly and politely. "
    "Never reveal internal information. Refer billing questions to the billing team. "
)
DEMO_QUESTIONS = ("How do I reset my password?", "Where can I find my invoices?")


async def run_demo(address: str, max_new_tokens: int = 16) -> list[str]:
    """Send prompts sharing a prefix through the router; return the printed lines."""
    lines = []
    async with RouterClient(address, timeout_s=120.0) as client:
        for question in DEMO_QUESTIONS:
            prompt = DEMO_SYSTEM + question
            r = await client.generate(prompt, GenerateOptions(max_new_tokens=max_new_tokens))
            lines.append(
                f"demo: {question!r} -> {r.text!r}\n"
                f"      served by {r.worker_id}: {r.cached_prompt_tokens}/{r.prompt_tokens} "
                f"prompt tokens cached, {r.completion_tokens} generated, attempts={r.attempts}"
            )
            print(lines[-1], flush=True)
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvroute up",
        description="Start N local workers and a cache-aware router; Ctrl-C stops them all.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--workers", type=int, default=2, help="number of worker processes")
    p.add_argument("--port", type=int, default=50051, help="router port (0 picks one)")
    p.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="the router's OpenAI-compatible HTTP port (0 picks one; default: no HTTP)",
    )
    p.add_argument(
        "--metrics-port",
        type=port_number,
        default=None,
        metavar="P",
        help="Prometheus /metrics: the router on P, worker i on P+1+i (0: free ports; "
        "default: none). Names: docs/METRICS.md",
    )
    p.add_argument("--host", default="127.0.0.1", help="address everything binds to")
    p.add_argument(
        "--router-processes",
        type=int,
        default=1,
        metavar="N",
        help="run the router as N processes on its ports (`kvroute router --processes N`; "
        "without --metrics-port and the security options for now) (default: 1, in-process)",
    )
    p.add_argument(
        "--executor",
        choices=("torch", "sim"),
        default="torch",
        help="torch: the tiny random Llama on the CPU (or CUDA); sim: cost model, no math",
    )
    p.add_argument("--policy", choices=POLICIES, default="cache_aware", help="routing policy")
    p.add_argument(
        "--model",
        default=None,
        metavar="DIR",
        help="an HF Llama model directory served by every worker (needs --executor torch); the "
        "router tokenizes with its tokenizer (default: the tiny random model, byte tokenizer)",
    )
    p.add_argument(
        "--worker-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for every worker, e.g. --worker-arg=--kv-slots=8192 (repeatable)",
    )
    add_fleet_security_args(p)  # TLS on the router's ports, API keys, limits, --hash-key
    p.add_argument("--demo", action="store_true", help="send demo requests after start")
    p.add_argument("--exit", action="store_true", help="with --demo: stop after the demo")
    p.add_argument(
        "--startup-timeout-s",
        type=float,
        default=120.0,
        help="seconds each worker may take to listen (loading a model) and the fleet to "
        "become ready for --demo",
    )
    p.add_argument(
        "--stop-timeout-s",
        type=float,
        default=10.0,
        help="seconds a worker gets to stop after SIGTERM before it is killed",
    )
    p.add_argument(
        "--log-level",
        default="WARNING",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        help="log level of the router and the workers (logs go to stderr)",
    )
    return p


async def _up(config: FleetConfig, demo: bool, exit_after_demo: bool) -> int:
    with stop_signals() as stop:
        return await _run_fleet(config, demo, exit_after_demo, stop)


async def _run_fleet(
    config: FleetConfig, demo: bool, exit_after_demo: bool, stop: asyncio.Event
) -> int:
    fleet = Fleet(config)
    try:
        starting = asyncio.create_task(fleet.start())
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait((starting, stopper), return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():  # Ctrl-C during startup
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await starting
            return 130
        stopper.cancel()
        address = starting.result()
        gc.freeze()  # as `kvroute router` does after start-up (route-latency p99, bench_index)
        for w in fleet.workers:
            print(f"worker {w.worker_id} listening on {w.address} (pid {w.proc.pid})", flush=True)
        print(f"router listening on {address} (policy {config.policy})", flush=True)
        if fleet.metrics is not None:
            print(f"router metrics on {fleet.metrics.url}", flush=True)
        if fleet.router is not None and fleet.router.http is not None:
            scheme = "http" if fleet.router.http.config.tls is None else "https"
            print(f"router http listening on {scheme}://{fleet.router.http.address}", flush=True)
        if fleet.processes is not None and fleet.processes.http_address is not None:
            print(f"router http listening on http://{fleet.processes.http_address}", flush=True)
        if demo:
            await fleet.wait_ready(config.startup_timeout_s)
            await run_demo(address)
            if exit_after_demo:
                return 0
        print("Ctrl-C to stop", flush=True)
        await stop.wait()
        return 0
    except (RuntimeError, TimeoutError, OSError) as exc:  # OSError: a port that cannot be bound
        print(f"kvroute up: {exc or 'timed out'}", file=sys.stderr)
        return 1
    except grpc.aio.AioRpcError as exc:
        print(
            f"kvroute up: demo request failed: {exc.code().name}: {exc.details()}", file=sys.stderr
        )
        return 1
    finally:
        await fleet.stop()
        print("stopped", flush=True)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    if args.exit and not args.demo:
        print("kvroute up: --exit needs --demo", file=sys.stderr)
        return 2
    try:
        config = FleetConfig(
            num_workers=args.workers,
            port=args.port,
            http_port=args.http_port,
            metrics_port=args.metrics_port,
            host=args.host,
            executor=args.executor,
            policy=args.policy,
            model=args.model,
            worker_args=tuple(args.worker_arg),
            worker_log_level=args.log_level,
            startup_timeout_s=args.startup_timeout_s,
            stop_timeout_s=args.stop_timeout_s,
            security=fleet_security_from_args(args),
            router_processes=args.router_processes,
        )
        load_tokenizer_or_bytes(args.model)  # a bad model dir: one line here, not a traceback
    except ValueError as exc:  # TokenizerLoadError included
        print(f"kvroute up: {exc}", file=sys.stderr)
        return 2
    result: list[int] = []

    async def runner() -> None:
        result.append(await _up(config, args.demo, args.exit))

    run_event_loop(runner())
    return result[0] if result else 1
