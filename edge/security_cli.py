"""The security options every kvroute command shares: TLS certificates, Redis TLS and ACL
user, the block-hashing key, and the router <-> worker token.

Each ``add_*`` puts an option group on a parser; each ``*_from_args`` turns the parsed values
into the edge.tls dataclasses (TlsConfigError, a ValueError naming the flag, on a
missing partner or an unreadable file). Secrets can come from the environment instead of the
command line, where other local users could read them in the process list.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any, TypeVar

from edge.tls import (
    ClientTls,
    RedisAuth,
    ServerTls,
    client_tls_from_flags,
    server_tls_from_flags,
)

HASH_KEY_ENV = "KVROUTE_HASH_KEY"
REDIS_PASSWORD_ENV = "KVROUTE_REDIS_PASSWORD"
ROUTER_TOKEN_ENV = "KVROUTE_ROUTER_TOKEN"  # the worker's --router-token
WORKER_TOKEN_ENV = "KVROUTE_WORKER_TOKEN"  # the router's --worker-token


def add_server_tls_args(parser: argparse.ArgumentParser, what: str) -> None:
    g = parser.add_argument_group("TLS")
    g.add_argument(
        "--tls-cert", default=None, metavar="PEM", help=f"serve {what} over TLS with this cert"
    )
    g.add_argument("--tls-key", default=None, metavar="PEM", help="the private key of --tls-cert")
    g.add_argument(
        "--tls-client-ca",
        default=None,
        metavar="PEM",
        help="mutual TLS: accept only clients presenting a certificate this CA signed",
    )


def server_tls_from_args(args: argparse.Namespace) -> ServerTls | None:
    return server_tls_from_flags(args.tls_cert, args.tls_key, args.tls_client_ca)


_Front = TypeVar("_Front", bound=Any)


def server_tls_and_http(
    args: argparse.Namespace, http: _Front | None
) -> tuple[ServerTls | None, _Front | None]:
    """The ``--tls-*`` server TLS, and the HTTP front's config (an
    ``edge.http_front.HttpFrontConfig``, or None when there is no HTTP front) serving with it:
    a service's gRPC port and its HTTP front share one certificate."""
    tls = server_tls_from_args(args)
    if http is not None:
        http = dataclasses.replace(http, tls=tls)
    return tls, http


def add_client_tls_args(parser: argparse.ArgumentParser, prefix: str, whom: str) -> None:
    """``--{prefix}-ca/-cert/-key`` (e.g. ``--tls-ca`` or ``--worker-tls-ca``)."""
    g = parser.add_argument_group(f"TLS to {whom}")
    g.add_argument(
        f"--{prefix}-ca",
        default=None,
        metavar="PEM",
        help=f"connect to {whom} over TLS, trusting this CA",
    )
    g.add_argument(
        f"--{prefix}-cert", default=None, metavar="PEM", help="client certificate (mutual TLS)"
    )
    g.add_argument(f"--{prefix}-key", default=None, metavar="PEM", help="its private key")


def client_tls_from_args(
    args: argparse.Namespace, prefix: str, server_name: str | None = None
) -> ClientTls | None:
    attr = prefix.replace("-", "_")
    return client_tls_from_flags(
        getattr(args, f"{attr}_ca"),
        getattr(args, f"{attr}_cert"),
        getattr(args, f"{attr}_key"),
        server_name=server_name,
        flag=f"--{prefix}",
    )


def add_redis_auth_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("Redis TLS and ACL user (with a rediss:// --redis-url)")
    g.add_argument("--redis-tls-ca", default=None, metavar="PEM", help="CA of the Redis server")
    g.add_argument("--redis-tls-cert", default=None, metavar="PEM", help="client certificate")
    g.add_argument("--redis-tls-key", default=None, metavar="PEM", help="its private key")
    g.add_argument("--redis-username", default=None, help="Redis ACL user")
    g.add_argument(
        "--redis-password",
        default=os.environ.get(REDIS_PASSWORD_ENV),
        help=f"Redis ACL password (default: ${REDIS_PASSWORD_ENV})",
    )


def redis_auth_from_args(args: argparse.Namespace) -> RedisAuth:
    tls = client_tls_from_flags(
        args.redis_tls_ca, args.redis_tls_cert, args.redis_tls_key, flag="--redis-tls"
    )
    auth = RedisAuth(tls, args.redis_username, args.redis_password or None)
    if args.redis_url:
        auth.check_url(args.redis_url)
    return auth


def add_hash_key_arg(parser: argparse.ArgumentParser) -> None:
    """``--hash-key`` in its own titled group (decision 0006: keyed hashing is opt-in)."""
    parser.add_argument_group("block hashing").add_argument(
        "--hash-key",
        default=os.environ.get(HASH_KEY_ENV),
        help="deployment secret keying the block-hash chain (BLAKE2b), so nobody outside can "
        "craft colliding prompts to steer routing; router and workers need the same key "
        f"(default: ${HASH_KEY_ENV}; none: the fast unkeyed hash)",
    )
