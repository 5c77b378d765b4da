"""``kvroute router``: run the cache-aware router (gRPC Router service, health, reflection).

Prints ``listening on HOST:PORT`` on stdout once bound (``--port 0`` picks a free port), then
serves until SIGINT or SIGTERM, which stop it gracefully (in-flight requests get a grace
period). Runs on uvloop when it is installed.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from edge.cli_help import HelpFormatter, port_number
from edge.http_front import HttpFrontConfig
from edge.registry import DEFAULT_PREFIX, DEFAULT_TTL_S
from edge.runtime import run_event_loop
from edge.telemetry import configure_tracing
from edge.tokenizer import ChatTokenizer, TokenizerLoadError, load_tokenizer_or_bytes
from kvroute_proto.hashing import set_hash_key
from router.cli.security_flags import add_router_security_args, apply_router_security
from router.core.admission import AdmissionConfig
from router.core.core_types import (
    DEFAULT_RECENT_DECODE_RATIO,
    DEFAULT_RECENT_WINDOW_S,
    DEFAULT_REPLICA_AFFINITY_TOKENS,
    DEFAULT_REPLICA_COLD_PICKS,
    DEFAULT_REPLICA_COLD_WINDOW_PICKS,
    INITIAL_REPLICA_SYNC_WINDOW_S,
)
from router.core.policy import (
    COST_WEIGHTS_FORM,
    DEFAULT_BACKLOG_TOKENS,
    DEFAULT_SATURATED_SCALE_TOKENS,
    DEFAULT_SATURATED_TOKENS,
    CostWeights,
    policy_names,
)
from router.core.router_core import RouterConfig
from router.service.frontend import DEFAULT_MODEL_NAME, FrontendConfig
from router.service.resilience import EjectionConfig
from router.service.server import (
    RegistryConfig,
    RouterServer,
    RouterServerConfig,
    check_address,
)
from router.service.tenancy import TenancyConfig
from router.service.worker_conn import ConnectionConfig

POLICIES = tuple(policy_names())
SALT_SECRET_ENV = "KVROUTE_TENANT_SALT_SECRET"


def _address(value: str) -> str:
    try:
        return check_address(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvroute router",
        description="Run the cache-aware router in front of kvroute workers.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument(
        "--port", type=port_number, default=50051, help="port to bind; 0 picks a free one"
    )
    p.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="also serve the OpenAI-compatible HTTP API here (/v1/completions, "
        "/v1/chat/completions, /v1/models, /health); 0 picks a free one (default: no HTTP)",
    )
    p.add_argument("--http-host", default="127.0.0.1", help="address the HTTP API binds")
    p.add_argument(
        "--served-model-name",
        default=None,
        help=f"the model name the HTTP API serves (default {DEFAULT_MODEL_NAME})",
    )
    p.add_argument(
        "--model",
        default=None,
        metavar="DIR",
        help="the fleet's HF model directory (the workers' --model): the router tokenizes text "
        "prompts and renders chat templates with its tokenizer.json / tokenizer_config.json, "
        "and leaves out workers whose tokenizer differs; without it, the byte tokenizer of "
        "the tiny default model and the sim executor",
    )
    p.add_argument(
        "--tokenize-whole",
        action="store_true",
        help="with --model: tokenize every text prompt whole on the router (default: only as "
        "far as some worker's cache may match it; the worker tokenizes the rest, exact for "
        "byte-level BPE tokenizers, others are always tokenized whole)",
    )
    p.add_argument(
        "--worker",
        action="append",
        default=[],
        type=_address,
        metavar="HOST:PORT",
        help="a worker to route to (repeatable); static membership",
    )
    p.add_argument(
        "--redis-url", default=None, help="Redis registry for dynamic membership (redis://...)"
    )
    p.add_argument("--redis-prefix", default=DEFAULT_PREFIX, help="registry key prefix")
    p.add_argument(
        "--trace-console",
        action="store_true",
        help="print OpenTelemetry spans to stderr (OTLP export: set OTEL_EXPORTER_OTLP_ENDPOINT)",
    )
    p.add_argument("--redis-poll-s", type=float, default=2.0, help="registry poll interval")
    p.add_argument(
        "--registry-grace-s",
        type=float,
        default=DEFAULT_TTL_S,
        help="keep a worker that vanished from the registry this long before removing it "
        "(a Redis that restarted empty must not empty the fleet; live workers re-register "
        "within one heartbeat)",
    )
    p.add_argument("--policy", default="cache_aware", choices=POLICIES, help="routing policy")
    p.add_argument(
        "--cost-weights",
        metavar=COST_WEIGHTS_FORM,
        default=None,
        help=f"cache_aware/approx_tree cost weights (default {_default_weights()}; KNEE: "
        "the queued term's knee in prompts like the one routed, 0 makes it linear)",
    )
    p.add_argument(
        "--recent-window-s",
        type=float,
        default=DEFAULT_RECENT_WINDOW_S,
        help="decay time constant of each worker's recent-prefill count (default %(default)s)",
    )
    p.add_argument(
        "--recent-decode-ratio",
        type=float,
        default=DEFAULT_RECENT_DECODE_RATIO,
        help="recent-prefill tokens each generated token of a finished request adds to its "
        "worker's balance term (default %(default)s)",
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="router replicas behind one load balancer, each seeing every worker's events but "
        "only its own picks: each pick counts this many times in its worker's queued prefill "
        "until its first token (with --replica-sync only for --replica-sync-window-s), a "
        "cold one fewer (--replica-cold-picks; without --replica-sync run the workers "
        "with --load-interval-s 0.05 --step-reports; BENCHMARKS.md, several routers)",
    )
    p.add_argument(
        "--replica-cold-picks",
        type=float,
        default=DEFAULT_REPLICA_COLD_PICKS,
        help="with --replicas R > 1, a cold pick (nothing of its prompt cached on the chosen "
        "worker) counts min(R, this) times instead of R: the other replicas' same-instant "
        "picks there would mostly find its prefix and add only their suffixes "
        "(default %(default)s)",
    )
    p.add_argument(
        "--replica-peer-view",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --replica-sync: a peer's pick counts the tokens uncached by the better of "
        "the peer's view and this router's own of what the worker holds (the replicas start "
        "a burst on one worker in the same instant and the worker computes its prefix once); "
        "--no-replica-peer-view: the peer's view alone, every cold pick capped "
        "(default: on)",
    )
    p.add_argument(
        "--replica-cold-window-picks",
        type=int,
        default=DEFAULT_REPLICA_COLD_WINDOW_PICKS,
        help="with --replica-sync and the peer view: a cold pick counts --replicas times, not "
        "capped by --replica-cold-picks, while the most of this router's own picks found "
        "inside their sync window at once, over the last minute or two, stays under this "
        "(the sync keeps pace with the router); 0: always capped (default %(default)s)",
    )
    p.add_argument(
        "--replica-affinity-tokens",
        type=float,
        default=None,
        help="with --replicas R > 1: the cost's affinity term, which gives replicas that "
        "cannot see each other's picks the same order of preference among the workers "
        "lacking a request's next block (rendezvous hashing), so a new prefix arriving at "
        "several of them starts on the same workers; token equivalents, 0: off (default: "
        f"{DEFAULT_REPLICA_AFFINITY_TOKENS:g} without --replica-sync, 0 with it)",
    )
    p.add_argument(
        "--replica-sync",
        action="store_true",
        help="router replicas publish their picks, first tokens and finishes to each other on "
        "the --redis-url Redis (channel <redis-prefix>replica), so each counts the others' "
        "requests in flight a round trip after they are placed; use with --replicas R",
    )
    p.add_argument(
        "--replica-sync-window-s",
        type=_window,
        default=None,
        metavar="SECONDS|auto",
        help="with --replica-sync: each own pick counts --replicas times in its worker's "
        "queued prefill (one that found its prefix there in running requests and recent "
        "work too) only this long, then once, the others' picks of the same moment "
        "having arrived through Redis by then; auto (default) follows the sync's delivery "
        "time, measured on this router's own messages as Redis echoes them (starting at "
        f"{INITIAL_REPLICA_SYNC_WINDOW_S:g} s); a number fixes it; inf: R times in queued "
        "prefill alone, until the first token (as without sync)",
    )
    p.add_argument(
        "--index-backend",
        choices=("dict", "numba"),
        default=RouterConfig().index_backend,
        help="the prefix index's implementation: dict (router/core/index.py, pure Python) or numba "
        "(router/core/index_nb.py: compiled kernels over flat tables, same answers; compiled or "
        "loaded from numba's cache at startup) (default %(default)s)",
    )
    p.add_argument(
        "--backlog-tokens",
        type=float,
        default=DEFAULT_BACKLOG_TOKENS,
        help="queued prefill tokens on the least loaded worker at which the cost counts a "
        "cache miss double; 0 turns it off (default %(default)s)",
    )
    p.add_argument(
        "--saturated-tokens",
        type=float,
        default=DEFAULT_SATURATED_TOKENS,
        help="a saturated fleet: past this many queued prefill tokens on the least loaded "
        "worker, every --saturated-scale-tokens more count a cache miss once more "
        "(default %(default)s)",
    )
    p.add_argument(
        "--saturated-scale-tokens",
        type=float,
        default=DEFAULT_SATURATED_SCALE_TOKENS,
        help="see --saturated-tokens; 0 turns the saturated part off (default %(default)s)",
    )
    p.add_argument(
        "--spread-weight",
        type=float,
        default=0.0,
        help="cost per running request on a worker for a request that starts something "
        "sticky (a conversation's first turn on a prompt several workers share): spreads "
        "conversations by decode load; trades TTFT p99 for busy-time balance and e2e p99, "
        "and hurts traffic whose shared starts are not conversations (hot tenants, bursts): "
        "router/core/policy.py, BENCHMARKS.md; default %(default)s: off",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="fleet block size in tokens (default: the first worker's)",
    )
    p.add_argument(
        "--max-inflight",
        type=int,
        default=1024,
        help="requests in flight before RESOURCE_EXHAUSTED",
    )
    p.add_argument(
        "--admission",
        choices=("on", "off"),
        default="on",
        help="deadline-aware admission: a request with a deadline that no worker can meet "
        "(by each worker's pace, learnt from the streams) is refused at once with "
        "RESOURCE_EXHAUSTED instead of joining a batch that would make everyone late",
    )
    p.add_argument(
        "--admission-window",
        type=int,
        default=AdmissionConfig().initial_window,
        help="requests with a deadline in flight per worker before its pace is known "
        "(slow start; then twice the largest concurrency measured)",
    )
    p.add_argument(
        "--max-deadline-s",
        type=float,
        default=600.0,
        help="cap on a request's deadline; also the deadline of requests that set none",
    )
    p.add_argument(
        "--tenant-header",
        default="x-tenant-id",
        help="metadata key carrying the tenant id ('' disables tenancy)",
    )
    p.add_argument(
        "--tenant-salt-secret",
        default=os.environ.get(SALT_SECRET_ENV),
        help=f"HMAC secret making cache salts unguessable (default: ${SALT_SECRET_ENV})",
    )
    p.add_argument(
        "--trust-client-salt",
        action="store_true",
        help="honour a non-empty partition.cache_salt from the request body",
    )
    p.add_argument(
        "--eject-after",
        type=int,
        default=3,
        help="consecutive worker failures before it is ejected",
    )
    p.add_argument("--eject-cooldown-s", type=float, default=10.0, help="ejection duration")
    p.add_argument(
        "--purge-after-s",
        type=float,
        default=10.0,
        help="drop an unreachable worker's index entries after this long",
    )
    p.add_argument("--keepalive-s", type=float, default=30.0, help="HTTP/2 keepalive ping interval")
    p.add_argument("--seed", type=int, default=None, help="seed for tie-breaks (reproducible runs)")
    p.add_argument(
        "--metrics-port",
        type=port_number,
        default=None,
        help="serve Prometheus metrics on http://HOST:PORT/metrics (HOST from --host; 0 picks "
        "a free port; default: no metrics endpoint). Names: docs/METRICS.md",
    )
    p.add_argument(
        "--log-level",
        default="INFO",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        help="log level (logs go to stderr)",
    )
    add_router_security_args(p)  # TLS, API keys, tenant limits, Redis TLS, --hash-key
    return p


def _default_weights() -> str:
    w = CostWeights()
    return (
        f"{w.prefill:g},{w.queued_prefill:g},{w.decode:g},{w.recent_prefill:g},"
        f"{w.slot_wait:g},{w.queued_knee:g}"
    )


def config_from_args(
    args: argparse.Namespace, *, tokenizer_fingerprint: str | None = None
) -> RouterServerConfig:
    """The server config the command-line options describe (ValueError on bad values).
    ``tokenizer_fingerprint``: the router's tokenizer's; workers reporting another are left
    out of routing."""
    secret = args.tenant_salt_secret.encode() if args.tenant_salt_secret else None
    # the HTTP API's model name: the flag, else the model directory's name
    served: dict[str, Any] = {}
    if args.served_model_name or args.model:
        served["model_name"] = args.served_model_name or Path(args.model).resolve().name
    config = RouterServerConfig(
        host=args.host,
        port=args.port,
        workers=tuple(args.worker),
        registry=RegistryConfig(
            args.redis_url,
            args.redis_prefix,
            args.redis_poll_s,
            args.registry_grace_s,
            replica_sync=args.replica_sync,
        ),
        core=RouterConfig(
            policy=args.policy,
            block_size=args.block_size,
            weights=CostWeights.parse(args.cost_weights) if args.cost_weights else CostWeights(),
            recent_window_s=args.recent_window_s,
            backlog_tokens=args.backlog_tokens,
            saturated_tokens=args.saturated_tokens,
            saturated_scale_tokens=args.saturated_scale_tokens,
            spread_weight=args.spread_weight,
            recent_decode_ratio=args.recent_decode_ratio,
            replicas=args.replicas,
            replica_cold_picks=args.replica_cold_picks,
            replica_peer_view=args.replica_peer_view,
            replica_cold_window_picks=args.replica_cold_window_picks,
            replica_sync=args.replica_sync,
            replica_sync_window_s=args.replica_sync_window_s,
            replica_affinity_tokens=args.replica_affinity_tokens,
            index_backend=args.index_backend,
        ),
        service=FrontendConfig(
            max_inflight=args.max_inflight,
            max_deadline_s=args.max_deadline_s,
            admission=AdmissionConfig(
                enabled=args.admission == "on", initial_window=args.admission_window
            ),
            tenancy=TenancyConfig(args.tenant_header.lower(), secret, args.trust_client_salt),
            ejection=EjectionConfig(args.eject_after, args.eject_cooldown_s),
            split_prompts=not args.tokenize_whole,
            **served,
        ),
        connection=ConnectionConfig(
            keepalive_time_s=args.keepalive_s,
            purge_after_s=args.purge_after_s,
            tokenizer_fingerprint=tokenizer_fingerprint,
        ),
        seed=args.seed,
        http=None
        if args.http_port is None
        else HttpFrontConfig(host=args.http_host, port=args.http_port),
    )
    return apply_router_security(args, config)


async def serve(
    config: RouterServerConfig,
    metrics_port: int | None = None,
    *,
    tokenizer: ChatTokenizer | None = None,
) -> None:
    """Run one router until SIGINT/SIGTERM (with a /metrics endpoint when ``metrics_port``
    is not None); ``tokenizer`` encodes text prompts (None: forwarded as text)."""
    server = RouterServer(config, tokenizer=tokenizer)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await server.start()
    endpoint = None
    if metrics_port is not None:
        from router.service.metrics import RouterMetricsEndpoint

        endpoint = RouterMetricsEndpoint(server, config.host, metrics_port)
        try:
            endpoint.start()
        except BaseException:
            await server.stop()
            raise
        print(f"metrics on {endpoint.url}", flush=True)
    # Start-up objects (modules, configs, the empty index) live for the whole run: move them
    # out of the collector's generations so a full collection does not rescan them (it was
    # the main source of route-latency p99 spikes in bench_index).
    gc.freeze()
    print(f"listening on {server.address}", flush=True)
    if server.http is not None:  # after the gRPC line, which parents wait for first
        print(f"http listening on {server.http.address}", flush=True)
    try:
        await stop.wait()
    finally:
        if endpoint is not None:
            endpoint.stop()
        await server.stop()


def _window(value: str) -> float | None:
    """--replica-sync-window-s: "auto" (None) or seconds >= 0 (inf allowed)."""
    if value.strip().lower() == "auto":
        return None
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be auto or a number of seconds, got {value!r}"
        ) from None
    if not x >= 0:
        raise argparse.ArgumentTypeError(f"must be auto or >= 0, got {value}")
    return x


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not args.worker and not args.redis_url:
        print("kvroute router: give at least one --worker or --redis-url", file=sys.stderr)
        return 2
    try:
        # The fleet's tokenizer: text prompts become the token ids the workers cache.
        tokenizer = load_tokenizer_or_bytes(args.model)
        config = config_from_args(args, tokenizer_fingerprint=tokenizer.fingerprint)
    except (TokenizerLoadError, ValueError) as exc:
        print(f"kvroute router: {exc}", file=sys.stderr)
        return 2
    logging.getLogger(__name__).info(
        "tokenizer: %s (fingerprint %s)",
        args.model or "byte tokenizer (no --model)",
        tokenizer.fingerprint,
    )
    set_hash_key(args.hash_key or None)  # the block-hash chain's key (before any hashing)
    shutdown_tracing = configure_tracing("kvroute-router", console=args.trace_console)
    try:
        run_event_loop(serve(config, args.metrics_port, tokenizer=tokenizer))
    except OSError as exc:  # a port that cannot be bound
        print(f"kvroute router: {exc}", file=sys.stderr)
        return 1
    finally:
        shutdown_tracing()
    return 0
