"""``kvroute bridge``: put kvroute's router in front of a vLLM or SGLang engine.

One bridge per engine, started beside it. Stable output for parent processes: once bound,
exactly one line ``listening on HOST:PORT`` on stdout (then ``metrics on URL`` with
``--metrics-port``); logs go to stderr. SIGINT/SIGTERM stop it gracefully.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import sys

from edge.cli_help import RawDescriptionHelpFormatter, port_number
from edge.runtime import configure_logging, run_event_loop, stop_signals
from edge.security_cli import HASH_KEY_ENV, ROUTER_TOKEN_ENV
from kvroute_proto import hashing
from kvroute_proto.hashing import set_hash_key
from worker.bridge import engine_wire, hash_table
from worker.bridge.service.events import EventSourceConfig
from worker.bridge.service.server import ENGINES, BridgeConfig, BridgeServer

log = logging.getLogger("kvroute.bridge")

_USAGE = (
    "%(prog)s [--engine vllm|sglang] --engine-url URL\n"
    "       (--events ENDPOINT | --events-bind ENDPOINT) [--replay ENDPOINT]\n"
    "       [--block-size B] [--host HOST] [--port PORT] [options]"
)
_EPILOG = """\
example (a vLLM engine on this host, then a router in front of its bridge):
  vllm serve MODEL --port 8000 --enable-prompt-tokens-details \\
    --kv-events-config '{"enable_kv_cache_events":true,"publisher":"zmq",
      "endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558"}'
  kvroute bridge --engine-url http://127.0.0.1:8000 --events tcp://127.0.0.1:5557 \\
    --replay tcp://127.0.0.1:5558 --port 50061
  kvroute router --worker 127.0.0.1:50061      # no --model: prompts are token ids
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvroute bridge",
        usage=_USAGE,
        description="Serve kvroute's Worker gRPC service for one vLLM or SGLang engine: its KV\n"
        "events (ZMQ) become kvroute's event stream, Generate/Abort go to its HTTP API with\n"
        "token-id prompts (vLLM /v1/completions, SGLang /generate). Prints 'listening on\n"
        "HOST:PORT' on stdout once bound.",
        epilog=_EPILOG,
        formatter_class=RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("first start")
    g.add_argument(
        "--engine",
        choices=ENGINES,
        default="vllm",
        help="the engine's kind: vllm (its /v1/completions, vllm:* metrics) or sglang (its "
        "/generate with input_ids, sglang:* metrics with --enable-metrics)",
    )
    g.add_argument(
        "--engine-url",
        metavar="URL",
        required=True,
        help="the engine's HTTP address (its /v1/completions, /v1/models, /metrics)",
    )
    ev = g.add_mutually_exclusive_group(required=True)
    ev.add_argument(
        "--events",
        metavar="ENDPOINT",
        help="connect to the engine's KV-event publisher, when the engine binds it (its "
        "kv-events endpoint has a wildcard: tcp://*:5557 -> tcp://HOST:5557)",
    )
    ev.add_argument(
        "--events-bind",
        metavar="ENDPOINT",
        help="bind here and let the engine connect, when its kv-events endpoint names a host "
        "(tcp://127.0.0.1:5557)",
    )
    g.add_argument(
        "--replay",
        metavar="ENDPOINT",
        default=None,
        help="the engine's replay_endpoint (connected; fills gaps and catches up on start; "
        "without it a gap starts a new event epoch)",
    )
    g.add_argument(
        "--block-size",
        type=int,
        default=16,
        help="kvroute's block size: the router's --block-size (the engine's may differ)",
    )
    g.add_argument("--host", default="127.0.0.1", help="address to bind the gRPC service")
    g.add_argument("--port", type=port_number, default=0, help="gRPC port (0 = pick a free one)")
    g.add_argument("--worker-id", default="bridge-0", help="this worker's id at the router")
    _add_tuning_args(p)
    return p


def _add_tuning_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine and events")
    g.add_argument("--topic", default="", help="only this event topic (default: all)")
    g.add_argument(
        "--max-running",
        type=int,
        default=0,
        help="the engine's running-batch cap (vLLM --max-num-seqs), reported to routers "
        "(0: not stated)",
    )
    g.add_argument("--replay-buffer", type=int, default=1024, help="our batches kept for routers")
    g.add_argument(
        "--load-interval-s", type=float, default=1.0, help="engine /metrics poll and load report"
    )
    g.add_argument(
        "--hash-key",
        default=os.environ.get(HASH_KEY_ENV),
        help=f"the block-hash key (the router's --hash-key; default: ${HASH_KEY_ENV})",
    )
    g.add_argument(
        "--router-token",
        default=os.environ.get(ROUTER_TOKEN_ENV),
        help="Generate, Abort, SubscribeKvEvents and GetLoad require 'authorization: Bearer "
        f"TOKEN' (the router's --worker-token; default: ${ROUTER_TOKEN_ENV}); a router with "
        "API keys needs it",
    )
    o = p.add_argument_group("observability and shutdown")
    o.add_argument(
        "--metrics-port",
        type=port_number,
        default=None,
        help="serve kvroute_bridge_* on http://HOST:PORT/metrics (0 picks a free port)",
    )
    o.add_argument(
        "--log-level",
        type=str.upper,
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        default="INFO",
        help="log level (any case)",
    )
    o.add_argument("--grace-s", type=float, default=5.0, help="shutdown grace for requests")


def config_from_args(args: argparse.Namespace) -> BridgeConfig:
    """The bridge config the flags describe (ValueError naming a bad flag)."""
    if args.max_running < 0:
        raise ValueError(f"--max-running must be >= 0, got {args.max_running}")
    if args.replay_buffer < 1:
        raise ValueError(f"--replay-buffer must be >= 1, got {args.replay_buffer}")
    if args.grace_s < 0:
        raise ValueError(f"--grace-s must be >= 0, got {args.grace_s}")
    events = EventSourceConfig(
        connect=args.events,
        bind=args.events_bind,
        replay=args.replay,
        topic=args.topic.encode(),
    )
    return BridgeConfig(
        engine_url=args.engine_url,
        events=events,
        worker_id=args.worker_id,
        block_size=args.block_size,
        host=args.host,
        port=args.port,
        replay_buffer_size=args.replay_buffer,
        load_interval_s=args.load_interval_s,
        max_running_requests=args.max_running,
        shutdown_grace_s=args.grace_s,
        router_token=args.router_token or None,
        engine=args.engine,
    )


def enable_compiled_event_path() -> None:
    """Engine events decoded and hashed by compiled loops (numba), not a Python int per
    token: the event path's cost per block (decision 0042); the held maps' table compiled
    (or loaded) now rather than in the first event (decision 0046)."""
    engine_wire.enable_compiled()
    hashing.enable_compiled()
    hash_table.warm_up()


async def serve(config: BridgeConfig, metrics_port: int | None = None) -> None:
    """Run one bridge until SIGINT/SIGTERM."""
    with stop_signals() as stop:
        await _serve(config, metrics_port, stop)


async def _serve(config: BridgeConfig, metrics_port: int | None, stop: asyncio.Event) -> None:
    enable_compiled_event_path()
    server = BridgeServer(config)
    metrics = None
    try:
        port = await server.start()
        if metrics_port is not None:
            from worker.bridge.service.metrics import BridgeMetricsEndpoint

            metrics = BridgeMetricsEndpoint(server, config.host, metrics_port)
            metrics.start()
        # Start-up objects (modules, the engine's model, sockets) live for the whole run:
        # out of the collector's generations, so a full collection does not rescan them
        # and hold events back (as `kvroute router` does; decision 0041).
        gc.freeze()
        print(f"listening on {config.host}:{port}", flush=True)
        if metrics is not None:
            print(f"metrics on {metrics.url}", flush=True)
        await stop.wait()
        log.info("shutting down (grace %.1fs)", config.shutdown_grace_s)
    finally:
        if metrics is not None:
            metrics.stop()
        await server.stop()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"kvroute bridge: {exc}", file=sys.stderr)
        return 2
    set_hash_key(args.hash_key or None)
    try:
        run_event_loop(serve(config, args.metrics_port))
    except ValueError as exc:  # the events socket could not be opened
        print(f"kvroute bridge: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"kvroute bridge: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
