"""Live replay: real worker and router processes on loopback gRPC, the trace in fast-forward.

For each policy a fresh fleet is started::

    python -m kvroute_cli worker --executor sim --port 0 --sim-speedup X ...   (N of them)
    python -m kvroute_cli router --port 0 --worker HOST:PORT ... --policy P

Each process prints ``listening on HOST:PORT`` once bound. The replayer waits until the
router reports every worker healthy (Explain), then sends request i through the router's
Generate stream at wall time t0 + arrival_i / X. The workers pace their simulated executor
at X times real time, so wall-clock durations times X are trace seconds: the report uses
trace time, like sim mode. Python overhead is not compressed, so a large X inflates latency.

Prompts use the workers' own vocabulary (``GetLoad`` -> vocab_size; the sim worker's byte
vocabulary has 260 ids) and max context: a request the worker cannot hold fails with
INVALID_ARGUMENT and counts as an error. Everything is bounded: process start-up, readiness
and the whole replay (``timeout_s``); processes are terminated (then killed) on the way out.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Self, TextIO

import grpc

from fleetsim.replay.progress import Progress
from fleetsim.replay.report import PolicyReport, RequestResult, summarize
from fleetsim.replay.trace import TokenExpander, TraceRecord
from kvroute_proto import kvroute_pb2 as pb
from kvroute_proto import kvroute_pb2_grpc as pb_grpc
from router.core.core_types import DEFAULT_RECENT_WINDOW_S

REPO_ROOT = Path(__file__).resolve().parents[2]


class LiveReplayError(RuntimeError):
    """The fleet could not be started or did not become ready in time."""


# LiveConfig fields passed to the router process as its option of the same name, unchanged
_PASSED_AS_GIVEN = (
    "backlog_tokens",
    "saturated_tokens",
    "saturated_scale_tokens",
    "recent_decode_ratio",
)


@dataclass(frozen=True, slots=True)
class LiveConfig:
    """Fleet shape and time limits of a live replay."""

    num_workers: int = 4
    kv_capacity_tokens: int = 65_536
    speedup: float = 10.0
    seed: int = 0
    page_size: int = 16
    block_size: int = 16
    trace_block_size: int = 512
    max_context_tokens: int = 1 << 20  # of the simulated model: long trace prompts must fit
    timeout_s: float = 600.0  # the whole replay of one policy
    cost_weights: str | None = None  # the router's --cost-weights (None: its defaults)
    recent_window_s: float | None = None  # in trace seconds (None: the router's default)
    backlog_tokens: float | None = None  # the router's --backlog-tokens (None: its default)
    saturated_tokens: float | None = None  # --saturated-tokens (None: its default)
    saturated_scale_tokens: float | None = None  # --saturated-scale-tokens (None: its default)
    recent_decode_ratio: float | None = None  # --recent-decode-ratio (None: its default)
    startup_timeout_s: float = 60.0  # each process, and readiness
    python: str = sys.executable

    def __post_init__(self) -> None:
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
        if self.speedup <= 0:
            raise ValueError(f"speedup must be > 0, got {self.speedup}")
        for name in ("timeout_s", "startup_timeout_s"):
            if not getattr(self, name) > 0:  # NaN too
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


@dataclass(slots=True)
class _Proc:
    name: str
    process: asyncio.subprocess.Process
    log_path: Path
    address: str = ""

    def log_tail(self, num_chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""

    async def stdout_line(self, what: str, timeout_s: float) -> str:
        """The process's next stdout line, stripped (LiveReplayError naming ``what``, the
        line expected, when none comes within ``timeout_s``)."""
        assert self.process.stdout is not None
        try:
            line = await asyncio.wait_for(self.process.stdout.readline(), timeout=timeout_s)
        except TimeoutError:
            raise LiveReplayError(
                f"{self.name} printed no '{what}' line in {timeout_s}s; "
                f"log tail:\n{self.log_tail()}"
            ) from None
        return line.decode(errors="replace").strip()


class LiveFleet:
    """N sim workers and one router as child processes (an async context manager)."""

    def __init__(self, config: LiveConfig, policy: str) -> None:
        self.config = config
        self.policy = policy
        self.workers: list[_Proc] = []
        self.router: _Proc | None = None
        self._spawned: list[_Proc] = []  # every process started, listening or not: stop() ends them
        self._tmp = tempfile.TemporaryDirectory(prefix="kvroute-live-")

    async def __aenter__(self) -> Self:
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _spawn(self, name: str, args: list[str]) -> _Proc:
        """Start ``python -m kvroute_cli ARGS`` and wait for its ``listening on HOST:PORT``
        line; stderr goes to a log file."""
        proc = await self._start_process(name, self._kvroute_command(args), True)
        process = proc.process
        text = await proc.stdout_line("listening on", self.config.startup_timeout_s)
        if not text.startswith("listening on "):
            await process.wait()
            raise LiveReplayError(
                f"{name} exited (rc={process.returncode}) before listening: {text!r}; "
                f"log tail:\n{proc.log_tail()}"
            )
        proc.address = text.removeprefix("listening on ").strip()
        return proc

    def _kvroute_command(self, args: list[str]) -> list[str]:
        return [self.config.python, "-m", "kvroute_cli", *args]

    async def _start_process(
        self, name: str, argv: list[str], pipe_stdout: bool, env: dict[str, str] | None = None
    ) -> _Proc:
        """Start ``argv`` (``env`` added to ours); stdout is piped when ``pipe_stdout``, else
        logged with stderr."""
        log_path = Path(self._tmp.name) / f"{name}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        with open(log_path, "wb") as log:
            process = await asyncio.create_subprocess_exec(
                *argv,
                stdout=asyncio.subprocess.PIPE if pipe_stdout else log,
                stderr=log,
                cwd=REPO_ROOT,
                env=env,
            )
        proc = _Proc(name, process, log_path)
        self._spawned.append(proc)
        return proc

    def worker_args(self) -> list[str]:
        """Every sim worker's command-line options (without its id)."""
        c = self.config
        return [
            "--executor",
            "sim",
            "--port",
            "0",
            "--sim-speedup",
            str(c.speedup),
            "--kv-slots",
            str(c.kv_capacity_tokens),
            "--page-size",
            str(c.page_size),
            "--block-size",
            str(c.block_size),
            "--seed",
            str(c.seed),
            "--sim-max-context-tokens",
            str(c.max_context_tokens),
            "--load-interval-s",
            str(max(0.05, 1.0 / c.speedup)),
            "--log-level",
            "WARNING",
        ]

    async def _start(self) -> None:
        await self._start_workers(self.worker_args())
        router_args = ["router", "--port", "0", *self.router_args(self.policy)]
        for w in self.workers:
            router_args += ["--worker", w.address]
        self.router = await self._spawn("router", router_args)

    async def _start_workers(
        self, worker_args: list[str], per_worker: Callable[[int], list[str]] | None = None
    ) -> None:
        """Start the N workers; ``per_worker(i)`` adds options to worker i."""
        c = self.config
        # A TaskGroup, not gather: when one worker fails to start, the others' spawns are
        # cancelled and awaited before stop() runs, so none starts behind its back.
        try:
            async with asyncio.TaskGroup() as group:
                spawns = [
                    group.create_task(
                        self._spawn(
                            f"worker-{i}",
                            [
                                "worker",
                                *worker_args,
                                "--worker-id",
                                f"worker-{i}",
                                *(per_worker(i) if per_worker else []),
                            ],
                        )
                    )
                    for i in range(c.num_workers)
                ]
        except ExceptionGroup as group_error:  # report the first failure itself
            raise group_error.exceptions[0] from None
        self.workers = [t.result() for t in spawns]

    def router_args(self, policy: str) -> list[str]:
        """The router's options for ``policy`` (without --port and the workers)."""
        c = self.config
        router_args = ["--policy", policy, "--seed", str(c.seed), "--log-level", "WARNING"]
        if c.cost_weights is not None:
            router_args += ["--cost-weights", c.cost_weights]
        # the router's clock is wall time, the trace's is compressed by the speedup
        window_s = c.recent_window_s if c.recent_window_s is not None else DEFAULT_RECENT_WINDOW_S
        router_args += ["--recent-window-s", repr(window_s / c.speedup)]
        for name in _PASSED_AS_GIVEN:  # the router's option of the same name, when given
            value = getattr(c, name)
            if value is not None:
                router_args += ["--" + name.replace("_", "-"), repr(value)]
        return router_args

    async def stop(self) -> None:
        procs = self._spawned
        for p in procs:
            if p.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    p.process.terminate()
        for p in procs:
            try:
                await asyncio.wait_for(p.process.wait(), timeout=15.0)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    p.process.kill()
                await p.process.wait()
        self._tmp.cleanup()


class TraceClock:
    """Trace time played on the event loop's clock, ``speedup`` times faster: the first
    arrival is played 50 ms from now (the requests' tasks are created by then)."""

    def __init__(self, first_arrival_s: float, speedup: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._first = first_arrival_s
        self._speedup = speedup
        self._t0 = self._loop.time() + 0.05

    def now(self) -> float:
        """The trace time now (seconds)."""
        return self._first + (self._loop.time() - self._t0) * self._speedup

    async def until(self, arrival_s: float) -> None:
        """Sleep until trace time ``arrival_s`` (at once if it has passed)."""
        delay = self._t0 + (arrival_s - self._first) / self._speedup - self._loop.time()
        if delay > 0:
            await asyncio.sleep(delay)


async def await_bounded(
    tasks: list[asyncio.Task[None]], results: list[RequestResult], timeout_s: float
) -> None:
    """Wait for every request's task at most ``timeout_s``; cancel the rest and mark each
    request that did not finish as timed out (so no figure drops it silently)."""
    _, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for task in pending:
        task.cancel()
    for task in pending:
        with contextlib.suppress(asyncio.CancelledError):
            await task
    for r in results:
        if r.finish_s is None and r.error is None:
            r.error = f"timeout after {timeout_s}s"


PlayOne = Callable[[int, Callable[[], float]], Awaitable[None]]


async def play_trace(
    records: Sequence[TraceRecord],
    results: list[RequestResult],
    play: PlayOne,
    label: str,
    config: LiveConfig,
    progress_stream: TextIO | None,
) -> None:
    """The replay clients' core (gRPC here, HTTP in live_http): each request starts at its
    trace arrival, ``config.speedup`` times faster, where ``play(i, trace_now)`` sends
    request ``i`` and fills ``results[i]`` (``trace_now()``: the trace time now). A progress
    line labelled ``label`` goes to ``progress_stream``; requests not done after
    ``config.timeout_s`` are cancelled and marked timed out."""
    progress = Progress(label, len(records), progress_stream) if progress_stream else None
    num_done = 0
    clock = TraceClock(records[0].arrival_s if records else 0.0, config.speedup)

    async def one(i: int) -> None:
        nonlocal num_done
        await clock.until(records[i].arrival_s)
        await play(i, clock.now)
        num_done += 1
        if progress is not None:
            progress.update(num_done, clock.now())

    tasks = [asyncio.create_task(one(i)) for i in range(len(records))]
    await await_bounded(tasks, results, config.timeout_s)
    if progress is not None:
        progress.update(num_done, clock.now(), force=True)
        progress.close()


async def _wait_ready(stub: pb_grpc.RouterStub, num_workers: int, timeout_s: float) -> None:
    """Poll Explain (bounded) until the router sees every worker healthy."""
    deadline = time.monotonic() + timeout_s
    probe = pb.ExplainRequest(request=pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1])))
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            resp = await stub.Explain(probe, timeout=5.0)
            healthy = sum(1 for w in resp.workers if w.healthy)
            if healthy >= num_workers:
                return
            last = f"{healthy}/{num_workers} workers healthy"
        except grpc.aio.AioRpcError as exc:
            last = f"{exc.code().name}: {exc.details()}"
        await asyncio.sleep(0.1)
    raise LiveReplayError(f"router not ready after {timeout_s}s: {last}")


async def _worker_limits(address: str) -> pb.WorkerInfo:
    async with grpc.aio.insecure_channel(address) as channel:
        return await pb_grpc.WorkerStub(channel).GetLoad(pb.GetLoadRequest(), timeout=10.0)


async def replay_live_async(
    records: Sequence[TraceRecord],
    policy: str,
    config: LiveConfig,
    progress_stream: TextIO | None = None,
) -> PolicyReport:
    """Start a fleet for ``policy``, play ``records`` through its router, stop it."""
    wall_start = time.monotonic()
    results = [
        RequestResult(index=i, arrival_s=r.arrival_s, prompt_tokens=r.input_length)
        for i, r in enumerate(records)
    ]
    async with LiveFleet(config, policy) as fleet:
        assert fleet.router is not None
        info = await _worker_limits(fleet.workers[0].address)
        expander = TokenExpander(config.trace_block_size, info.vocab_size, config.seed)
        requests = [
            pb.GenerateRequest(
                request_id=f"r{i}",
                prompt_token_ids=pb.TokenIds(ids=expander.expand_record(r).tolist()),
                sampling=pb.SamplingParams(max_new_tokens=r.output_length, ignore_eos=True),
            )
            for i, r in enumerate(records)
        ]
        async with grpc.aio.insecure_channel(
            fleet.router.address,
            options=[("grpc.max_receive_message_length", 64 << 20)],
        ) as channel:
            stub = pb_grpc.RouterStub(channel)
            await _wait_ready(stub, config.num_workers, config.startup_timeout_s)

            async def play(i: int, trace_now: Callable[[], float]) -> None:
                result = results[i]
                try:
                    async for msg in stub.Generate(requests[i], timeout=config.timeout_s):
                        match msg.WhichOneof("kind"):
                            case "chunk":
                                if result.first_token_s is None and msg.chunk.token_ids:
                                    result.first_token_s = trace_now()
                            case "finished":
                                fin = msg.finished
                                result.finish_s = trace_now()
                                result.worker_id = fin.worker_id
                                result.cached_tokens = fin.usage.cached_prompt_tokens
                                result.completion_tokens = fin.usage.completion_tokens
                                if fin.reason == pb.FINISH_REASON_ABORT:
                                    result.error = "aborted"
                    if result.finish_s is None:
                        result.error = "stream ended without Finished"
                except grpc.aio.AioRpcError as exc:
                    result.error = f"{exc.code().name}: {exc.details()}"

            await play_trace(records, results, play, policy, config, progress_stream)
        worker_ids = [f"worker-{i}" for i in range(config.num_workers)]
    extra: dict[str, float | int] = {"speedup": config.speedup, "vocab_size": info.vocab_size}
    return summarize(policy, results, worker_ids, extra=extra, wall_s=time.monotonic() - wall_start)


def run_live(
    records: Sequence[TraceRecord],
    policy: str,
    config: LiveConfig,
    progress_stream: TextIO | None = None,
) -> PolicyReport:
    """Synchronous wrapper of :func:`replay_live_async` (one event loop per call)."""
    return asyncio.run(replay_live_async(records, policy, config, progress_stream))
