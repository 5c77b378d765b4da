"""``kvroute worker``'s security options: TLS on its gRPC and HTTP ports (mutual TLS with a
client CA: only routers holding a certificate get in), the routers' shared token, Redis TLS
and ACL user, and the block-hashing key.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

from edge.security_cli import (
    ROUTER_TOKEN_ENV,
    add_hash_key_arg,
    add_redis_auth_args,
    add_server_tls_args,
    server_tls_and_http,
)
from worker.service.server import WorkerServerConfig


def add_worker_security_args(p: argparse.ArgumentParser) -> None:
    add_server_tls_args(p, "the Worker gRPC service and the HTTP front")
    g = p.add_argument_group("accepting calls only from routers")
    g.add_argument(
        "--router-token",
        default=os.environ.get(ROUTER_TOKEN_ENV),
        help="Generate, Abort, SubscribeKvEvents and GetLoad require 'authorization: Bearer "
        f"TOKEN' (the router's --worker-token; default: ${ROUTER_TOKEN_ENV}), and so does "
        "HTTP POST /flush_cache; health and reflection stay open",
    )
    g.add_argument(
        "--http-require-token",
        action="store_true",
        help="the HTTP generation routes require the router token too (off by default: peer "
        "routers such as sglang-router cannot send it; /health, /v1/models, /model_info, "
        "/server_info stay open)",
    )
    add_redis_auth_args(p)
    add_hash_key_arg(p)


def apply_worker_security(
    args: argparse.Namespace, config: WorkerServerConfig
) -> WorkerServerConfig:
    """``config`` with the security options of ``args`` (ValueError naming the flag)."""
    tls, http = server_tls_and_http(args, config.http)
    return dataclasses.replace(
        config,
        tls=tls,
        http=http,
        router_token=args.router_token or None,
        http_require_token=args.http_require_token,
    )
