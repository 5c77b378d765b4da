"""``kvroute worker``: run one serving worker (gRPC).

Stable output for parent processes (the fleet launcher parses it): once the server is bound,
exactly one line ``listening on HOST:PORT`` is printed to stdout and flushed. Everything else
(logs) goes to stderr. SIGINT/SIGTERM start a graceful shutdown: health NOT_SERVING, KV
event streams end, in-flight requests get ``--grace-s`` seconds, then the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from edge.cli_help import HelpFormatter, add_http_front_args, port_number
from edge.http_front import HttpFrontConfig
from edge.limits import RequestLimits
from edge.registry import (
    DEFAULT_PREFIX,
    DEFAULT_TTL_S,
    RedisRegistration,
    WorkerRecord,
)
from edge.runtime import configure_logging, run_event_loop, stop_signals
from edge.security_cli import redis_auth_from_args
from edge.telemetry import configure_tracing
from kvroute_proto.hashing import set_hash_key
from worker.cache.eviction import strategy_names
from worker.engine.engine_config import EngineConfig
from worker.engine.schedule_policy import POLICIES as SCHEDULE_POLICIES
from worker.errors import ModelLoadError
from worker.service.engine_runner import RunnerConfig
from worker.service.security_flags import add_worker_security_args, apply_worker_security
from worker.service.server import DEFAULT_MODEL_NAME, WorkerServer, WorkerServerConfig

if TYPE_CHECKING:  # torch only when the torch executor runs
    from worker.engine.torch_executor import TorchExecutor

# worker.engine.paged_attention.ATTENTION_CHOICES, without importing torch for --help
ATTENTION_CHOICES = ("gather", "paged", "paged-torch", "paged-triton")
# worker.engine.fused_ops.FUSED_CHOICES, likewise
FUSED_CHOICES = ("off", "torch", "triton")

log = logging.getLogger("kvroute.worker")

_ENGINE_DEFAULTS = EngineConfig()


_USAGE = (
    "%(prog)s [--host HOST] [--port PORT] [--executor {torch,sim}]\n"
    "       [--model DIR] [--device DEVICE]\n"
    "       [--kv-slots KV_SLOTS | --kv-memory-fraction KV_MEMORY_FRACTION]\n"
    "       [--redis-url REDIS_URL --advertise-address HOST:PORT]\n"
    "       [--http-port HTTP_PORT] [options]"
)


def build_parser() -> argparse.ArgumentParser:
    """The worker's parser: the options a first start needs come first, then one titled
    group per concern, in the order ``--help`` prints them."""
    p = argparse.ArgumentParser(
        prog="kvroute worker",
        usage=_USAGE,
        description="Run one kvroute serving worker: a radix KV cache, a continuous-batching "
        "engine and the Worker gRPC service (Generate, Abort, SubscribeKvEvents, GetLoad, "
        "health, reflection). Prints 'listening on HOST:PORT' on stdout once bound.",
        formatter_class=HelpFormatter,
    )
    _add_first_start_args(p)
    _add_model_args(p)
    _add_kernel_args(p)
    _add_engine_args(p)
    _add_event_args(p)
    _add_registry_args(p)
    _add_observability_args(p)
    add_worker_security_args(p)  # TLS, --router-token, Redis TLS, --hash-key
    return p


def _add_first_start_args(p: argparse.ArgumentParser) -> None:
    """Where the worker listens, what it runs, how much KV it holds, how routers find it."""
    g = p.add_argument_group("first start")
    g.add_argument("--host", default="127.0.0.1", help="address to bind")
    g.add_argument("--port", type=port_number, default=0, help="port to bind (0 = pick a free one)")
    g.add_argument(
        "--executor",
        choices=("torch", "sim"),
        default="sim",
        help="torch: the real model (CUDA if present); sim: cost model, no math",
    )
    g.add_argument(
        "--model",
        metavar="DIR",
        default=None,
        help="HF model directory (torch; default: a tiny random Llama)",
    )
    g.add_argument("--device", default=None, help="torch device (default: cuda if present)")
    g.add_argument(
        "--kv-slots", type=int, default=_ENGINE_DEFAULTS.num_kv_slots, help="KV pool size in tokens"
    )
    g.add_argument(
        "--kv-memory-fraction",
        type=float,
        default=None,
        help="torch on CUDA: size the KV pool to this fraction of free GPU memory "
        "(overrides --kv-slots)",
    )
    g.add_argument("--worker-id", default=_ENGINE_DEFAULTS.worker_id, help="this worker's id")
    g.add_argument(
        "--redis-url",
        default=None,
        help="register in this Redis registry (redis://...) so routers find this worker",
    )
    g.add_argument(
        "--advertise-address",
        default=None,
        metavar="HOST:PORT",
        help="address routers dial (default: --host and the bound port)",
    )
    add_http_front_args(
        g,
        "the OpenAI API and the SGLang/vLLM worker endpoints that sglang-router and "
        "vllm-router call",
        model_default="the --model directory's name, else kvroute-tiny",
    )


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and executor")
    g.add_argument("--seed", type=int, default=0, help="model init and sampling seed")
    g.add_argument(
        "--torch-threads",
        type=int,
        default=0,
        help="torch CPU threads (0 = torch's default; 1 is fastest on a small shared CPU)",
    )
    g.add_argument(
        "--sim-max-context-tokens",
        type=int,
        default=None,
        help="sim only: the simulated model's context length (default 8192)",
    )
    g.add_argument(
        "--sim-speedup",
        type=float,
        default=0.0,
        help="sim only: sleep modelled step time / X after each step "
        "(1 = real time, 0 = no pacing)",
    )


def _add_kernel_args(p: argparse.ArgumentParser) -> None:
    """The torch executor's kernels; each defaults by device (decision 0027)."""
    g = p.add_argument_group("GPU kernels (torch executor)")
    g.add_argument(
        "--attention",
        choices=ATTENTION_CHOICES,  # paged_attention's (which imports torch; a test checks)
        default=None,
        help="torch: attention over the paged KV pool: gather (copy each request's K/V out "
        "of the pool, then SDPA), paged (Triton kernels reading K/V through the slot tables "
        "on CUDA, their torch reference elsewhere), paged-torch, paged-triton (default: "
        "paged on CUDA with triton, gather elsewhere)",
    )
    g.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch on CUDA: run decode-only steps, and a prefill of <= 512 tokens alone, as "
        "CUDA graph replays, one graph per size and context bucket, captured on first use "
        "(needs paged attention; "
        "--attention defaults to paged with it); an error on a non-CUDA device (default: "
        "on for CUDA with paged attention, off elsewhere)",
    )
    g.add_argument(
        "--graph-warmup-context",
        type=int,
        default=0,
        metavar="TOKENS",
        help="torch with CUDA graphs: capture every graph bucket (decode batch sizes, lone "
        "prefill sizes) whose context width is at most TOKENS before serving, instead of on "
        "each bucket's first step, which then pays the capture (default 0: on first use)",
    )
    g.add_argument(
        "--fused-kernels",
        choices=FUSED_CHOICES,  # fused_ops' (a test checks)
        default=None,
        help="torch: each layer's residual add fused into its RMSNorm, RoPE with the KV "
        "write, SwiGLU, q/k/v and gate/up as one matmul each: off, triton (Triton kernels; "
        "CUDA only), torch (the same structure with torch ops) (default: triton on CUDA "
        "with triton, off elsewhere)",
    )


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's tuning: pool layout, cache, queue and batch limits."""
    g = p.add_argument_group("engine tuning")
    g.add_argument(
        "--page-size",
        type=int,
        default=_ENGINE_DEFAULTS.page_size,
        help="KV pool allocation unit in tokens (the radix cache matches whole pages)",
    )
    g.add_argument(
        "--block-size",
        type=int,
        default=_ENGINE_DEFAULTS.block_size,
        help="tokens per KV event block (announced to routers)",
    )
    g.add_argument(
        "--eviction-policy",
        default=_ENGINE_DEFAULTS.eviction_policy,
        help=f"which cached prefixes the radix cache evicts first: {', '.join(strategy_names())}",
    )
    g.add_argument(
        "--schedule-policy",
        default=_ENGINE_DEFAULTS.schedule_policy,
        help="order of the waiting queue: "
        + ", ".join(sorted(SCHEDULE_POLICIES))
        + " (lpm: longest cached prefix first)",
    )
    g.add_argument(
        "--max-running",
        type=int,
        default=_ENGINE_DEFAULTS.max_running_requests,
        help="requests in the running batch at most (the rest wait)",
    )
    g.add_argument(
        "--max-waiting",
        type=int,
        default=_ENGINE_DEFAULTS.max_waiting_requests,
        help="waiting queue limit (beyond it: RESOURCE_EXHAUSTED)",
    )
    g.add_argument(
        "--chunk-size",
        type=int,
        default=_ENGINE_DEFAULTS.chunk_size,
        help="chunked prefill size in tokens",
    )
    g.add_argument("--no-cache", action="store_true", help="disable the radix cache")
    g.add_argument(
        "--default-max-new-tokens",
        type=int,
        default=RequestLimits().default_max_new_tokens,
        help="max_new_tokens of requests that leave it 0 (default 0: what is left of the "
        "model's context, as OpenAI and vLLM do)",
    )


def _add_event_args(p: argparse.ArgumentParser) -> None:
    """What the worker tells subscribed routers, and how often."""
    g = p.add_argument_group("KV events")
    g.add_argument(
        "--replay-buffer",
        type=int,
        default=1024,
        help="event batches kept for subscribers that reconnect",
    )
    g.add_argument(
        "--subscriber-queue",
        type=int,
        default=1024,
        help="live batches a subscriber may lag before its stream is dropped",
    )
    g.add_argument(
        "--load-interval-s",
        type=float,
        default=1.0,
        help="seconds between load report batches (0 = off)",
    )
    g.add_argument(
        "--kv-events-zmq",
        metavar="ENDPOINT",
        help="also publish the KV events as vLLM does, on a ZMQ PUB socket bound here "
        "(e.g. tcp://*:5557), so routers written for vLLM's events (vllm-router kv_aware, "
        "Dynamo, llm-d) can front this worker",
    )
    g.add_argument(
        "--kv-events-zmq-replay",
        metavar="ENDPOINT",
        help="with --kv-events-zmq: the replay ROUTER socket bound here (e.g. tcp://*:5558), "
        "answering a consumer's request for the frames from a seq, as vLLM's does",
    )
    g.add_argument(
        "--kv-events-zmq-topic",
        metavar="TOPIC",
        default="",
        help="with --kv-events-zmq: the topic frame of every message (default: empty, "
        "vLLM's default, the only topic vllm-router's --kv-event-source reads; llm-d "
        "expects kv@POD@MODEL)",
    )
    g.add_argument(
        "--step-reports",
        action="store_true",
        help="also send a load report as a step starts, when requests arrived or the step "
        "prefills (counting that prefill as queued), and after a step that halved the queued "
        "prefill: router replicas that cannot see each other's picks (kvroute router "
        "--replicas R without --replica-sync) then learn this worker's queue a step, not a "
        "load interval, later (default: off; decision 0022)",
    )


def _add_registry_args(p: argparse.ArgumentParser) -> None:
    """The Redis registry's details (--redis-url and --advertise-address: first start)."""
    g = p.add_argument_group("registry")
    g.add_argument("--redis-prefix", default=DEFAULT_PREFIX, help="registry key prefix")
    g.add_argument(
        "--registry-ttl-s",
        type=float,
        default=DEFAULT_TTL_S,
        help="registry entry TTL; refreshed every third of it",
    )


def _add_observability_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("observability and shutdown")
    g.add_argument(
        "--log-level",
        type=str.upper,
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        default="INFO",
        help="log level (any case)",
    )
    g.add_argument(
        "--metrics-port",
        type=port_number,
        default=None,
        help="serve Prometheus metrics on http://HOST:PORT/metrics (HOST from --host; 0 picks "
        "a free port; default: no metrics endpoint; https with --tls-cert, and only for "
        "clients with a certificate with --tls-client-ca). Names: docs/METRICS.md",
    )
    g.add_argument(
        "--trace-console",
        action="store_true",
        help="print OpenTelemetry spans to stderr (OTLP export: set OTEL_EXPORTER_OTLP_ENDPOINT)",
    )
    g.add_argument(
        "--grace-s", type=float, default=10.0, help="shutdown grace for in-flight requests"
    )


def config_from_args(args: argparse.Namespace) -> WorkerServerConfig:
    """The server config the flags describe (raises ValueError naming a bad flag)."""
    if args.sim_speedup and args.executor != "sim":
        raise ValueError("--sim-speedup applies to --executor sim only")
    if args.torch_threads < 0:
        raise ValueError(f"--torch-threads must be >= 0, got {args.torch_threads}")
    if args.kv_memory_fraction is not None and args.executor != "torch":
        raise ValueError("--kv-memory-fraction applies to --executor torch only")
    if args.cuda_graphs is not None and args.executor != "torch":
        raise ValueError("--cuda-graphs applies to --executor torch only")
    if args.fused_kernels is not None and args.executor != "torch":
        raise ValueError("--fused-kernels applies to --executor torch only")
    if args.graph_warmup_context < 0:
        raise ValueError(f"--graph-warmup-context must be >= 0, got {args.graph_warmup_context}")
    if args.graph_warmup_context and args.executor != "torch":
        raise ValueError("--graph-warmup-context applies to --executor torch only")
    if args.default_max_new_tokens < 0:
        raise ValueError(
            f"--default-max-new-tokens must be >= 0, got {args.default_max_new_tokens}"
        )
    if args.redis_url and args.advertise_address is None and args.host in ("0.0.0.0", "::", ""):
        raise ValueError(
            f"--advertise-address is needed with --redis-url when binding {args.host!r}: "
            "routers cannot dial a wildcard address"
        )
    engine = EngineConfig(
        worker_id=args.worker_id,
        num_kv_slots=args.kv_slots,
        page_size=args.page_size,
        block_size=args.block_size,
        eviction_policy=args.eviction_policy,
        schedule_policy=args.schedule_policy,
        max_running_requests=args.max_running,
        max_waiting_requests=args.max_waiting,
        chunk_size=args.chunk_size,
        enable_cache=not args.no_cache,
        seed=args.seed,
    )
    http = None
    if args.http_port is not None:
        http = HttpFrontConfig(host=args.http_host, port=args.http_port)  # ValueError: bad port
    model_name = args.served_model_name or (
        Path(args.model).resolve().name if args.model else DEFAULT_MODEL_NAME
    )
    config = WorkerServerConfig(
        http=http,
        model_name=model_name,
        model_path=args.model,
        engine=engine,
        executor_kind=args.executor,
        host=args.host,
        port=args.port,
        replay_buffer_size=args.replay_buffer,
        runner=RunnerConfig(
            pace_speedup=args.sim_speedup,
            load_interval_s=args.load_interval_s,
            step_reports=args.step_reports,
            subscriber_queue_size=args.subscriber_queue,
        ),
        limits=RequestLimits(default_max_new_tokens=args.default_max_new_tokens),
        shutdown_grace_s=args.grace_s,
        zmq_events=_zmq_events_config(args),
    )
    return apply_worker_security(args, config)


def _zmq_events_config(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """--kv-events-zmq's config (None when not given; ValueError naming a bad flag)."""
    if args.kv_events_zmq is None:
        for flag in ("replay", "topic"):
            if getattr(args, f"kv_events_zmq_{flag}"):
                raise ValueError(f"--kv-events-zmq-{flag} needs --kv-events-zmq")
        return None
    from worker.service.zmq_events import ZmqEventsConfig  # pyzmq: the worker extra

    return ZmqEventsConfig(args.kv_events_zmq, args.kv_events_zmq_replay, args.kv_events_zmq_topic)


def build_server(args: argparse.Namespace) -> WorkerServer:
    """Build the executor, tokenizer, engine and server the flags describe."""
    from worker.engine.engine import Engine
    from worker.engine.factory import build_executor

    config = config_from_args(args)
    set_hash_key(args.hash_key or None)  # the block-hash chain's key (before any hashing)
    if args.executor == "torch" and args.torch_threads > 0:
        import torch

        torch.set_num_threads(args.torch_threads)
    executor, tokenizer = build_executor(
        args.executor,
        model_dir=args.model,
        num_kv_slots=args.kv_slots,
        device=args.device,
        seed=args.seed,
        kv_memory_fraction=args.kv_memory_fraction,
        sim_max_context_tokens=args.sim_max_context_tokens,
        attention=args.attention,
        cuda_graphs=args.cuda_graphs,
        fused=args.fused_kernels,
    )
    if args.executor == "torch":
        from worker.engine.torch_executor import TorchExecutor

        assert isinstance(executor, TorchExecutor)
        _start_torch_executor(executor, args.graph_warmup_context)
    num_slots = getattr(executor, "num_kv_slots", config.engine.num_kv_slots)
    if num_slots != config.engine.num_kv_slots:  # sized from GPU memory
        log.info("KV pool sized from GPU memory: %d slots", num_slots)
        config = dataclasses.replace(
            config, engine=dataclasses.replace(config.engine, num_kv_slots=num_slots)
        )
    engine = Engine(config.engine, executor, clock=time.monotonic)
    return WorkerServer(engine, tokenizer, config)


def _start_torch_executor(executor: TorchExecutor, graph_warmup_context: int) -> None:
    """Say which options the torch executor runs with (they default by device), and with
    ``--graph-warmup-context`` capture its CUDA graphs before serving."""
    log.info(
        "torch executor on %s: attention %s (%s), CUDA graphs %s, fused kernels %s",
        executor.device,
        executor.attention,
        executor.attention_impl,
        "on" if executor.cuda_graphs else "off",
        executor.fused_impl,
    )
    if not graph_warmup_context:
        return
    if not executor.cuda_graphs:
        raise ValueError(
            "--graph-warmup-context needs CUDA graphs (a CUDA device; not --no-cuda-graphs)"
        )
    start = time.monotonic()
    captured = executor.capture_graphs(graph_warmup_context)
    log.info(
        "captured %d CUDA graphs (contexts up to %d tokens) in %.1f s",
        captured,
        graph_warmup_context,
        time.monotonic() - start,
    )


def _registration(server: WorkerServer, args: argparse.Namespace) -> RedisRegistration | None:
    if not args.redis_url:
        return None
    engine = server.config.engine
    record = WorkerRecord(
        worker_id=engine.worker_id,
        address=args.advertise_address or server.address,
        epoch=server.epoch,
        block_size=engine.block_size,
        kv_capacity_tokens=engine.num_kv_slots,
        model=server.config.model_name,
    )
    return RedisRegistration(
        args.redis_url,
        record,
        prefix=args.redis_prefix,
        ttl_s=args.registry_ttl_s,
        client_options=redis_auth_from_args(args).client_kwargs(),  # rediss://, ACL user
    )


async def serve(server: WorkerServer, args: argparse.Namespace | None = None) -> None:
    """Run until SIGINT/SIGTERM, then stop gracefully (deregistering first)."""
    with stop_signals() as stop:
        await _serve(server, args, stop)


async def _serve(
    server: WorkerServer, args: argparse.Namespace | None, stop: asyncio.Event
) -> None:
    registration: RedisRegistration | None = None
    metrics = None
    try:
        port = await server.start()
        metrics_port = None if args is None else args.metrics_port
        if metrics_port is not None:
            from worker.service.metrics import WorkerMetricsEndpoint

            metrics = WorkerMetricsEndpoint(server, server.config.host, metrics_port)
            metrics.start()
        registration = None if args is None else _registration(server, args)
        if registration is not None and await registration.start():
            log.info("registered in Redis as %s", registration.key)
        # printed once serving and (best effort) registered
        print(f"listening on {server.config.host}:{port}", flush=True)
        if metrics is not None:
            print(f"metrics on {metrics.url}", flush=True)
        if server.http is not None:  # after the gRPC line, which parents wait for first
            print(f"http listening on {server.http.address}", flush=True)
        await stop.wait()
        log.info("shutting down (grace %.1fs)", server.config.shutdown_grace_s)
    finally:
        if registration is not None:
            await registration.stop()  # routers stop sending here before we drain
        if metrics is not None:
            metrics.stop()
        await server.stop()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    try:
        server = build_server(args)
    except (ValueError, ModelLoadError) as exc:
        print(f"kvroute worker: {exc}", file=sys.stderr)
        return 2
    shutdown_tracing = configure_tracing("kvroute-worker", console=args.trace_console)
    try:
        run_event_loop(serve(server, args))
    except OSError as exc:
        print(f"kvroute worker: {exc}", file=sys.stderr)
        return 1
    finally:
        shutdown_tracing()
    return 0


if __name__ == "__main__":
    sys.exit(main())
