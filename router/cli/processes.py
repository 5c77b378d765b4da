"""``kvroute router --processes N``: N router processes serving one address.

::

    kvroute router --processes N        holds the gRPC and HTTP ports: a socket bound with
      |                                 SO_REUSEPORT, never listening, so that nobody else
      |                                 can bind them (a second router gets "address in use")
      +-- kvroute router ...      (N of them, each with KVROUTE_ROUTER_SUPERVISOR_PID set to
                                  the supervisor's pid) bind the same ports with
                                  SO_REUSEPORT and listen; the kernel spreads new
                                  connections over them

One Python process relays about one core's worth of tokens (decision 0030); this puts a
host's cores to work behind one address. Each process is a replica of the others, as
router replicas behind a load balancer are: ``--replicas N`` (its own picks count N times,
decisions 0016-0021), and ``--replica-sync`` when there is a ``--redis-url`` (they publish
their picks to each other). The supervisor prints ``listening on HOST:PORT`` (and ``http
listening on ...``) once every process listens, forwards SIGINT / SIGTERM to them as one
SIGTERM, and stops them all when one exits.

Port ownership: before holding a port the supervisor binds it once without SO_REUSEPORT
(and with SO_REUSEADDR, which a listening or held socket refuses): a port anyone holds is an
error here. The holder itself has no SO_REUSEADDR, so another supervisor's check fails on it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import os
import signal
import socket
import sys
from collections.abc import Iterator

from edge.runtime import stop_signals

_PR_SET_PDEATHSIG = 1
STARTUP_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0


def die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """Linux: SIGTERM this child when its parent dies (no orphaned workers or routers)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class PortInUse(OSError):
    """A port the supervisor was asked to hold is bound by someone else."""


def hold_port(host: str, port: int, what: str = "") -> socket.socket:
    """A socket bound to ``host:port`` with SO_REUSEPORT, not listening: the router's sibling
    processes can bind the port, nobody else can. Port 0 picks a free one (read it back with
    ``getsockname``). Raises :class:`PortInUse` when the port is taken (``what``: which
    port, for its message: "" or "HTTP ")."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    if port:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is free
            try:
                probe.bind(address)
            except OSError as exc:
                raise _in_use(exc, what, host, port) from None
    holder = socket.socket(family, kind, proto)
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        holder.bind(address)
    except OSError as exc:
        holder.close()
        raise _in_use(exc, what, host, port) from None
    return holder


def _in_use(exc: OSError, what: str, host: str, port: int) -> PortInUse:
    hint = "" if what else " (is another kvroute or server listening there?)"
    return PortInUse(exc.errno, f"could not bind {what}{host}:{port}: {exc.strerror}{hint}")


# Set by the supervisor to its pid in each sibling's environment: a router whose parent is
# that pid binds its ports with SO_REUSEPORT beside the ports the supervisor holds. Anyone
# else (a second router started by hand) binds them plainly and gets "Address already in use".
SIBLING_ENV = "KVROUTE_ROUTER_SUPERVISOR_PID"


def is_sibling() -> bool:
    """True in a router process started by a ``--processes`` supervisor."""
    return os.environ.get(SIBLING_ENV) == str(os.getppid())


def child_argv(argv: list[str], args: argparse.Namespace, port: int, http: int | None) -> list[str]:
    """One sibling's ``kvroute router`` arguments: ours without ``--processes``, on the held
    ports, as a replica of the others."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--processes":
            skip = True
        elif not arg.startswith("--processes="):
            out.append(arg)
    out += ["--port", str(port)]
    if http is not None:
        out += ["--http-port", str(http)]
    if args.replicas == 1:
        out += ["--replicas", str(args.processes)]
    if args.redis_url and not args.replica_sync:
        out.append("--replica-sync")
    return [sys.executable, "-m", "kvroute_cli", "router", *out]


def check(args: argparse.Namespace) -> str | None:
    """Why ``--processes`` cannot run with these options, or None."""
    if args.processes < 1:
        return f"--processes must be >= 1, got {args.processes}"
    if args.metrics_port is not None:
        return "--metrics-port with --processes: each process has its own metrics; not supported"
    return None


def supervise(argv: list[str], args: argparse.Namespace) -> int:
    """Run ``args.processes`` routers on one address until SIGINT / SIGTERM."""
    problem = check(args)
    if problem is not None:
        print(f"kvroute router: {problem}", file=sys.stderr)
        return 2
    try:
        with _held(args) as (port, http):
            print(f"kvroute router: starting {args.processes} processes", file=sys.stderr)
            return asyncio.run(_run(child_argv(argv, args, port, http), args, port, http))
    except PortInUse as exc:
        print(f"kvroute router: {exc.strerror}", file=sys.stderr)
        return 1
    except (RuntimeError, TimeoutError) as exc:  # a process that did not start (all stopped)
        print(f"kvroute router: {exc or 'a process did not listen in time'}", file=sys.stderr)
        return 1


@contextlib.contextmanager
def _held(args: argparse.Namespace) -> Iterator[tuple[int, int | None]]:
    with contextlib.ExitStack() as stack:
        grpc_sock = stack.enter_context(hold_port(args.host, args.port))
        http: int | None = None
        if args.http_port is not None:
            http = stack.enter_context(
                hold_port(args.http_host, args.http_port, "HTTP ")
            ).getsockname()[1]
        yield grpc_sock.getsockname()[1], http


async def _run(argv: list[str], args: argparse.Namespace, port: int, http: int | None) -> int:
    procs: list[asyncio.subprocess.Process] = []
    pumps: list[asyncio.Task[None]] = []
    try:
        with stop_signals() as stop:
            for i in range(args.processes):
                proc = await asyncio.create_subprocess_exec(
                    *argv,
                    env={**os.environ, SIBLING_ENV: str(os.getpid())},
                    stdout=asyncio.subprocess.PIPE,
                    stdin=asyncio.subprocess.DEVNULL,
                    start_new_session=True,  # Ctrl-C reaches us only; we stop them
                    preexec_fn=die_with_parent if sys.platform.startswith("linux") else None,
                )
                procs.append(proc)
                await _wait_listening(proc, http is not None, i)
                pumps.append(asyncio.create_task(_pump(proc, i)))
            print(f"listening on {args.host}:{port}", flush=True)
            if http is not None:
                print(f"http listening on {args.http_host}:{http}", flush=True)
            ended = asyncio.ensure_future(
                asyncio.wait(
                    [asyncio.ensure_future(p.wait()) for p in procs],
                    return_when=asyncio.FIRST_COMPLETED,
                )
            )
            stopped = asyncio.ensure_future(stop.wait())
            await asyncio.wait([ended, stopped], return_when=asyncio.FIRST_COMPLETED)
            failed = not stopped.done()
            ended.cancel()
            stopped.cancel()
    finally:
        codes = await asyncio.gather(*(_stop(p) for p in procs))
        for pump in pumps:
            pump.cancel()
    if failed:
        print(
            f"kvroute router: a process exited (codes {codes}); stopped the others", file=sys.stderr
        )
        return 1
    return max((abs(c) for c in codes), default=0)


async def _wait_listening(proc: asyncio.subprocess.Process, http: bool, index: int) -> None:
    """Until the process printed its ``listening on`` lines (RuntimeError when it exits)."""
    assert proc.stdout is not None
    wanted = 2 if http else 1
    async with asyncio.timeout(STARTUP_TIMEOUT_S):
        while wanted:
            line = (await proc.stdout.readline()).decode(errors="replace")
            if not line:
                raise RuntimeError(f"router process {index} exited with {await proc.wait()}")
            if "listening on " in line:
                wanted -= 1


async def _pump(proc: asyncio.subprocess.Process, index: int) -> None:
    """Keep reading a process's stdout (the pipe must never fill), echoing it prefixed."""
    assert proc.stdout is not None
    async for line in proc.stdout:
        print(f"[router {index}] {line.decode(errors='replace').rstrip()}", flush=True)


async def _stop(proc: asyncio.subprocess.Process) -> int:
    """SIGTERM, then SIGKILL after ``STOP_TIMEOUT_S``; the exit code."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            return await asyncio.wait_for(proc.wait(), STOP_TIMEOUT_S)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
    return await proc.wait()


# ---- `kvroute up --router-processes N` ---------------------------------------------------


class RouterProcesses:
    """``kvroute router --processes N`` as a child of ``kvroute up`` (the in-process router
    is one process; this is N): start, wait until it sees every worker, stop."""

    def __init__(self, argv: list[str], num_workers: int) -> None:
        self._argv = argv  # the router's arguments, without --processes
        self._num_workers = num_workers
        self.proc: asyncio.subprocess.Process | None = None
        self.address = ""
        self.http_address: str | None = None
        self._pump: asyncio.Task[None] | None = None

    async def start(self, processes: int, timeout_s: float) -> str:
        """Start the supervisor; its gRPC address once every process listens."""
        http = "--http-port" in self._argv
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "kvroute_cli",
            "router",
            *self._argv,
            "--processes",
            str(processes),
            stdout=asyncio.subprocess.PIPE,
            stdin=asyncio.subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=die_with_parent if sys.platform.startswith("linux") else None,
        )
        assert self.proc.stdout is not None
        async with asyncio.timeout(timeout_s):
            while not self.address or (http and self.http_address is None):
                line = (await self.proc.stdout.readline()).decode(errors="replace")
                if not line:
                    raise RuntimeError(f"the router exited with {await self.proc.wait()}")
                if line.startswith("listening on "):
                    self.address = line.split()[-1]
                elif line.startswith("http listening on "):
                    self.http_address = line.split()[-1]
        self._pump = asyncio.create_task(_pump(self.proc, 0))
        return self.address

    async def wait_ready(self, timeout_s: float) -> None:
        """Until the router (whichever process answers) sees every worker healthy."""
        import grpc

        from kvroute_proto import kvroute_pb2 as pb
        from kvroute_proto import kvroute_pb2_grpc as pb_grpc

        probe = pb.ExplainRequest(request=pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1])))
        async with asyncio.timeout(timeout_s), grpc.aio.insecure_channel(self.address) as ch:
            stub = pb_grpc.RouterStub(ch)
            while True:
                with contextlib.suppress(grpc.aio.AioRpcError):
                    resp = await stub.Explain(probe, timeout=5.0)
                    if sum(w.healthy for w in resp.workers) >= self._num_workers:
                        return
                await asyncio.sleep(0.1)

    async def stop(self) -> None:
        if self.proc is not None:
            await _stop(self.proc)
        if self._pump is not None:
            self._pump.cancel()
