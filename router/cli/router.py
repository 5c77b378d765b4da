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
import sys
from collections.abc import Mapping
from typing import Any

from edge.cli_help import HelpFormatter, port_number
from edge.http_front import HttpFrontConfig
from edge.registry import DEFAULT_PREFIX, DEFAULT_TTL_S
from edge.runtime import configure_logging, run_event_loop, stop_signals
from edge.telemetry import configure_tracing
from edge.tokenizer import ChatTokenizer, TokenizerLoadError
from kvroute_proto.hashing import set_hash_key
from router.cli import processes
from router.cli.security_flags import add_router_security_args, apply_router_security
from router.cli.served_models import load_served_models, served_names
from router.core.admission import AdmissionConfig
from router.core.core_types import DEFAULT_RECENT_DECODE_RATIO, DEFAULT_RECENT_WINDOW_S
from router.core.index_api import IndexConfig
from router.core.policy_config import (
    COST_WEIGHTS_FORM,
    DEFAULT_BACKLOG_TOKENS,
    DEFAULT_SATURATED_SCALE_TOKENS,
    DEFAULT_SATURATED_TOKENS,
    CostWeights,
    PolicyConfig,
)
from router.core.pools import PoolsConfig
from router.core.registry import policy_names
from router.core.replicas import (
    DEFAULT_REPLICA_AFFINITY_TOKENS,
    DEFAULT_REPLICA_COLD_PICKS,
    DEFAULT_REPLICA_COLD_WINDOW_PICKS,
    INITIAL_REPLICA_SYNC_WINDOW_S,
    ReplicaConfig,
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


USAGE = (
    "kvroute router (--worker HOST:PORT [--worker ...] | --redis-url URL) [--port PORT]\n"
    "                      [--http-port PORT] [--model DIR] [--policy NAME] [options]"
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvroute router",
        usage=USAGE,
        description="Run the cache-aware router in front of kvroute workers. A worker source "
        "is required: --worker (repeatable) or --redis-url.",
        formatter_class=HelpFormatter,
        add_help=False,
    )
    _first_start_args(p)
    _network_args(p)
    _tenancy_args(p)
    _routing_tuning_args(p)
    _replica_args(p)
    _observability_args(p)
    add_router_security_args(p)  # TLS, API keys, tenant limits, Redis TLS, --hash-key
    return p


def _first_start_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "first start", "A worker source is REQUIRED: one or more --worker, or --redis-url."
    )
    g.add_argument("-h", "--help", action="help", help="show this help and exit")
    g.add_argument(
        "--worker",
        action="append",
        default=[],
        type=_address,
        metavar="HOST:PORT",
        help="a worker to route to (repeatable); static membership",
    )
    g.add_argument(
        "--redis-url",
        default=None,
        metavar="URL",
        help="Redis registry for dynamic membership (redis://...)",
    )
    g.add_argument(
        "--port", type=port_number, default=50051, help="gRPC port to bind; 0 picks a free one"
    )
    g.add_argument(
        "--http-port",
        type=int,
        default=None,
        metavar="PORT",
        help="also serve the OpenAI-compatible HTTP API here (/v1/completions, "
        "/v1/chat/completions, /v1/models, /health); 0 picks a free one (default: no HTTP)",
    )
    g.add_argument(
        "--model",
        action="append",
        metavar="DIR",
        help="the fleet's HF model directory (the workers' --model), for its tokenizer and chat "
        "template; workers with another tokenizer are left out (without it: the byte tokenizer "
        "of the tiny default model). Repeat it to serve several models: one pool each, routed "
        "by the request's model (docs/decisions/0036)",
    )
    g.add_argument(
        "--policy",
        default="cache_aware",
        choices=POLICIES,
        metavar="NAME",
        help=f"routing policy: {', '.join(POLICIES)}",
    )


def _process_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--processes",
        type=int,
        default=1,
        metavar="N",
        help="serve from N router processes on the same ports (a supervisor holds the ports; "
        "each process is a replica of the others: --replicas N, and --replica-sync with "
        "--redis-url) (default: 1)",
    )


def _network_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("networking")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    _process_args(g)
    g.add_argument("--http-host", default="127.0.0.1", help="address the HTTP API binds")
    g.add_argument(
        "--served-model-name",
        action="append",
        help=f"the model name the API serves (default: the --model directory's name, else "
        f"{DEFAULT_MODEL_NAME}, and without either the names workers announce); repeat it "
        "to name each --model's pool, in order",
    )
    g.add_argument(
        "--tokenize-whole",
        action="store_true",
        help="with --model: tokenize every text prompt whole on the router (default: only as "
        "far as some worker's cache may match it; the worker tokenizes the rest, exact for "
        "byte-level BPE tokenizers, others are always tokenized whole)",
    )
    g.add_argument("--redis-prefix", default=DEFAULT_PREFIX, help="registry key prefix")
    g.add_argument("--redis-poll-s", type=float, default=2.0, help="registry poll interval")
    g.add_argument(
        "--registry-grace-s",
        type=float,
        default=DEFAULT_TTL_S,
        help="keep a worker that vanished from the registry this long before removing it "
        "(a Redis that restarted empty must not empty the fleet; live workers re-register "
        "within one heartbeat)",
    )
    g.add_argument(
        "--max-inflight",
        type=int,
        default=1024,
        help="requests in flight before RESOURCE_EXHAUSTED",
    )
    g.add_argument(
        "--admission",
        choices=("on", "off"),
        default="on",
        help="deadline-aware admission: a request with a deadline that no worker can meet "
        "(by each worker's pace, learnt from the streams) is refused at once with "
        "RESOURCE_EXHAUSTED instead of joining a batch that would make everyone late",
    )
    g.add_argument(
        "--admission-window",
        type=int,
        default=AdmissionConfig().initial_window,
        help="requests with a deadline in flight per worker before its pace is known "
        "(slow start; then twice the largest concurrency measured)",
    )
    g.add_argument(
        "--max-deadline-s",
        type=float,
        default=600.0,
        help="cap on a request's deadline; also the deadline of requests that set none",
    )
    g.add_argument(
        "--eject-after", type=int, default=3, help="consecutive worker failures before ejection"
    )
    g.add_argument("--eject-cooldown-s", type=float, default=10.0, help="ejection duration")
    g.add_argument(
        "--purge-after-s",
        type=float,
        default=10.0,
        help="drop an unreachable worker's index entries after this long",
    )
    g.add_argument(
        "--keepalive-s",
        type=float,
        default=2.0,
        help="HTTP/2 keepalive ping interval to each worker; a worker that misses a ping's "
        "answer for 1 s more is left out (a stalled worker is out within ~3 s)",
    )


def _tenancy_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("tenancy")
    g.add_argument(
        "--tenant-header",
        default="x-tenant-id",
        help="metadata key carrying the tenant id ('' disables tenancy)",
    )
    g.add_argument(
        "--tenant-salt-secret",
        default=os.environ.get(SALT_SECRET_ENV),
        help=f"HMAC secret making cache salts unguessable (default: ${SALT_SECRET_ENV})",
    )
    g.add_argument(
        "--trust-client-salt",
        action="store_true",
        help="honour a non-empty partition.cache_salt from the request body",
    )


def _routing_tuning_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "routing tuning",
        "The cost's numbers, chosen by trace replay (docs/decisions); the defaults need no "
        "touching.",
    )
    g.add_argument(
        "--cost-weights",
        metavar=COST_WEIGHTS_FORM,
        default=None,
        help=f"cache_aware/approx_tree cost weights (default {CostWeights().form()}; KNEE: "
        "the queued term's knee in prompts like the one routed, 0 makes it linear)",
    )
    g.add_argument(
        "--recent-window-s",
        type=float,
        default=DEFAULT_RECENT_WINDOW_S,
        help="decay time constant of each worker's recent-prefill count (default %(default)s)",
    )
    g.add_argument(
        "--recent-decode-ratio",
        type=float,
        default=DEFAULT_RECENT_DECODE_RATIO,
        help="recent-prefill tokens each generated token of a finished request adds to its "
        "worker's balance term (default %(default)s)",
    )
    g.add_argument(
        "--backlog-tokens",
        type=float,
        default=DEFAULT_BACKLOG_TOKENS,
        help="queued prefill tokens on the least loaded worker at which the cost counts a "
        "cache miss double; 0 turns it off (default %(default)s)",
    )
    g.add_argument(
        "--saturated-tokens",
        type=float,
        default=DEFAULT_SATURATED_TOKENS,
        help="a saturated fleet: past this many queued prefill tokens on the least loaded "
        "worker, every --saturated-scale-tokens more count a cache miss once more "
        "(default %(default)s)",
    )
    g.add_argument(
        "--saturated-scale-tokens",
        type=float,
        default=DEFAULT_SATURATED_SCALE_TOKENS,
        help="see --saturated-tokens; 0 turns the saturated part off (default %(default)s)",
    )
    g.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="fleet block size in tokens (default: the first worker's)",
    )
    g.add_argument(
        "--index-backend",
        choices=("dict", "numba"),
        default=RouterConfig().index.backend,
        help="the prefix index's implementation: numba (compiled kernels over flat tables) or "
        "dict (pure Python, the reference; same answers) (default %(default)s)",
    )
    g.add_argument("--seed", type=int, default=None, help="seed for tie-breaks (reproducible runs)")


def _replica_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "several router replicas",
        "For R routers behind one load balancer: --replicas R, with --replica-sync and "
        "--redis-url (decisions 0016-0021). The other numbers need no touching.",
    )
    g.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="router replicas behind one load balancer: each pick counts this many times in "
        "its worker's queued prefill until its first token (with --replica-sync only for "
        "the sync window), a cold one fewer (without --replica-sync run the workers with "
        "--load-interval-s 0.05 --step-reports)",
    )
    g.add_argument(
        "--replica-sync",
        action="store_true",
        help="router replicas publish their picks, first tokens and finishes to each other on "
        "the --redis-url Redis (channel <redis-prefix>replica), so each counts the others' "
        "requests in flight a round trip after they are placed",
    )
    g.add_argument(
        "--replica-cold-picks",
        type=float,
        default=DEFAULT_REPLICA_COLD_PICKS,
        help="a cold pick (nothing of its prompt cached on the chosen worker) counts "
        "min(R, this) times (default %(default)s)",
    )
    g.add_argument(
        "--replica-peer-view",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --replica-sync: a peer's pick counts the tokens uncached by the better of "
        "the peer's view and this router's own (default: on)",
    )
    g.add_argument(
        "--replica-cold-window-picks",
        type=int,
        default=DEFAULT_REPLICA_COLD_WINDOW_PICKS,
        help="with --replica-sync and the peer view: a cold pick is not capped while the most "
        "of this router's own picks inside their sync window at once, lately, stays under "
        "this; 0: always capped (default %(default)s)",
    )
    g.add_argument(
        "--replica-affinity-tokens",
        type=float,
        default=None,
        help="the cost's affinity term: replicas that cannot see each other's picks start a "
        "new prefix on the same workers (rendezvous hashing); 0: off (default: "
        f"{DEFAULT_REPLICA_AFFINITY_TOKENS:g} without --replica-sync, 0 with it)",
    )
    g.add_argument(
        "--replica-sync-window-s",
        type=_window,
        default=None,
        metavar="SECONDS|auto",
        help="with --replica-sync: how long an own pick counts --replicas times before it "
        "counts once; auto (default) follows the sync's measured delivery time (from "
        f"{INITIAL_REPLICA_SYNC_WINDOW_S:g} s); inf: until the first token",
    )


def _observability_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("observability")
    g.add_argument(
        "--metrics-port",
        type=port_number,
        default=None,
        help="serve Prometheus metrics on http://HOST:PORT/metrics (HOST from --host; 0 picks "
        "a free port; default: no metrics endpoint; https with --tls-cert, and only for "
        "clients with a certificate with --tls-client-ca). Names: docs/METRICS.md",
    )
    g.add_argument(
        "--log-level",
        default="INFO",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        help="log level (logs go to stderr)",
    )
    g.add_argument(
        "--trace-console",
        action="store_true",
        help="print OpenTelemetry spans to stderr (OTLP export: set OTEL_EXPORTER_OTLP_ENDPOINT)",
    )


def config_from_args(
    args: argparse.Namespace,
    *,
    tokenizer_fingerprint: str | None = None,
    pool_fingerprints: tuple[tuple[str, str], ...] = (),
) -> RouterServerConfig:
    """The server config the command-line options describe (ValueError on bad values).
    ``tokenizer_fingerprint``: the router's tokenizer's; workers reporting another are left
    out of routing; ``pool_fingerprints``: the other pools' own (several --model)."""
    secret = args.tenant_salt_secret.encode() if args.tenant_salt_secret else None
    shared = processes.is_sibling()  # a --processes supervisor's child: SO_REUSEPORT
    # the served models (router/cli/served_models.py): the flags, else the directories' names
    names = served_names(args.model, args.served_model_name)
    served: dict[str, Any] = {"model_name": names[0]} if names else {}
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
        core=core_config_from_args(args),
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
            pool_fingerprints=pool_fingerprints,
            # no --model: an engine bridge (no fingerprint) is routed to, with a warning
            accept_no_fingerprint=args.model is None,
        ),
        seed=args.seed,
        http=None
        if args.http_port is None
        else HttpFrontConfig(host=args.http_host, port=args.http_port, reuse_port=shared),
        reuse_port=shared,
        pools=PoolsConfig(tuple(names)) if names else None,
    )
    return apply_router_security(args, config)


def core_config_from_args(args: argparse.Namespace) -> RouterConfig:
    """The router core's config the routing options describe (ValueError on bad values)."""
    weights = CostWeights.parse(args.cost_weights) if args.cost_weights else CostWeights()
    return RouterConfig(
        policy=args.policy,
        block_size=args.block_size,
        recent_window_s=args.recent_window_s,
        recent_decode_ratio=args.recent_decode_ratio,
        policy_config=PolicyConfig(
            weights=weights,
            backlog_tokens=args.backlog_tokens,
            saturated_tokens=args.saturated_tokens,
            saturated_scale_tokens=args.saturated_scale_tokens,
        ),
        index=IndexConfig(backend=args.index_backend),
        replica=ReplicaConfig(
            count=args.replicas,
            cold_picks=args.replica_cold_picks,
            sync=args.replica_sync,
            sync_window_s=args.replica_sync_window_s,
            peer_view=args.replica_peer_view,
            cold_window_picks=args.replica_cold_window_picks,
            affinity_tokens=args.replica_affinity_tokens,
        ),
    )


async def serve(
    config: RouterServerConfig,
    metrics_port: int | None = None,
    *,
    tokenizer: ChatTokenizer | None = None,
    pool_tokenizers: Mapping[str, ChatTokenizer] | None = None,
) -> None:
    """Run one router until SIGINT/SIGTERM (with a /metrics endpoint when ``metrics_port``
    is not None); ``tokenizer`` encodes text prompts (None: forwarded as text), and
    ``pool_tokenizers`` those of the pools with their own."""
    server = RouterServer(config, tokenizer=tokenizer, pool_tokenizers=pool_tokenizers)
    with stop_signals() as stop:
        await _serve(server, config, metrics_port, stop)


async def _serve(
    server: RouterServer, config: RouterServerConfig, metrics_port: int | None, stop: asyncio.Event
) -> None:
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
    configure_logging(args.log_level)
    if not args.worker and not args.redis_url:
        print(
            "kvroute router: a worker source is required: give --worker HOST:PORT (repeatable) "
            "or --redis-url URL",
            file=sys.stderr,
        )
        return 2
    try:
        # The fleet's tokenizer: text prompts become the token ids the workers cache.
        models = load_served_models(args)
        tokenizer = models.tokenizer
        config = config_from_args(
            args,
            tokenizer_fingerprint=tokenizer.fingerprint,
            pool_fingerprints=models.fingerprints,
        )
    except (TokenizerLoadError, ValueError) as exc:
        print(f"kvroute router: {exc}", file=sys.stderr)
        return 2
    if args.processes != 1:  # the options are checked here, once, before any process starts
        from router.cli.processes import supervise

        return supervise(argv, args)
    logging.getLogger(__name__).info(
        "tokenizer: %s (fingerprint %s)",
        ", ".join(args.model or ()) or "byte tokenizer (no --model)",
        tokenizer.fingerprint,
    )
    set_hash_key(args.hash_key or None)  # the block-hash chain's key (before any hashing)
    shutdown_tracing = configure_tracing("kvroute-router", console=args.trace_console)
    try:
        pools = dict(models.pool_tokenizers)
        run_event_loop(serve(config, args.metrics_port, tokenizer=tokenizer, pool_tokenizers=pools))
    except OSError as exc:  # a port that cannot be bound
        print(f"kvroute router: {exc}", file=sys.stderr)
        return 1
    finally:
        shutdown_tracing()
    return 0
