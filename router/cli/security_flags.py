"""``kvroute router``'s security options: TLS on its ports and to its workers, API keys,
the workers' token, per-tenant limits, Redis TLS/ACL and the block-hashing key.

``add_router_security_args`` adds them to the router's parser (``kvroute up`` passes the
same flags through); ``apply_router_security`` folds the parsed values into a
:class:`RouterServerConfig` (ValueError naming the flag on a bad value or file).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import secrets

from edge.security_cli import (
    HASH_KEY_ENV,
    ROUTER_TOKEN_ENV,
    WORKER_TOKEN_ENV,
    add_client_tls_args,
    add_hash_key_arg,
    add_redis_auth_args,
    add_server_tls_args,
    client_tls_from_args,
    redis_auth_from_args,
    server_tls_and_http,
    server_tls_from_args,
)
from edge.tls import ClientTls, ServerTls
from kvroute_proto.hashing import key_fingerprint
from router.cli.salt_secret import file_secret, redis_secret, state_file
from router.service.auth import API_KEYS_ENV, ApiKeys
from router.service.quota import QuotaConfig, TenantLimit, parse_overrides
from router.service.server import RouterServerConfig


def add_router_security_args(p: argparse.ArgumentParser) -> None:
    add_server_tls_args(p, "the gRPC and HTTP APIs")
    add_client_tls_args(p, "worker-tls", "workers")
    g = p.add_argument_group("authentication and tenant limits")
    g.add_argument(
        "--worker-tls-server-name",
        default=None,
        help="the name to check in the workers' certificates (default: the dialled host)",
    )
    g.add_argument(
        "--worker-token",
        default=os.environ.get(WORKER_TOKEN_ENV),
        help="token sent to the workers on every call (their --router-token; "
        f"default: ${WORKER_TOKEN_ENV})",
    )
    g.add_argument(
        "--api-keys",
        default=None,
        metavar="FILE",
        help="require an API key (Bearer token) on every call; FILE has tenant_id:sha256hex "
        f"lines (`kvroute keys hash`); also read from ${API_KEYS_ENV}. The key's tenant is "
        "the request's tenant. Health, reflection, /health and /v1/models stay open. Needs "
        "--worker-token or mutual TLS to the workers (or --insecure-workers); without "
        "--tenant-salt-secret a secret is generated and kept (Redis, or ~/.local/state)",
    )
    g.add_argument(
        "--insecure-workers",
        action="store_true",
        help="with API keys: start although the workers are open to anyone who reaches "
        "them (no --worker-token, no mutual TLS): they hand out tenants' prompts and caches",
    )
    g.add_argument(
        "--trust-tenant-header",
        action="store_true",
        help="with API keys: still honour the --tenant-header header (key holders are "
        "trusted gateways naming their users' tenants); without API keys it is always trusted",
    )
    g.add_argument(
        "--tenant-max-inflight",
        type=int,
        default=None,
        help="requests in flight per tenant before RESOURCE_EXHAUSTED / 429 (default: none)",
    )
    g.add_argument(
        "--tenant-tokens-per-s",
        type=float,
        default=None,
        help="tokens (prompt + max_new_tokens) per second per tenant (default: unlimited)",
    )
    g.add_argument(
        "--tenant-burst-tokens",
        type=float,
        default=None,
        help="token bucket size per tenant (default: one second of --tenant-tokens-per-s)",
    )
    g.add_argument(
        "--tenant-limits",
        default=None,
        metavar="FILE",
        help="per-tenant overrides: 'tenant max_inflight tokens_per_s [burst]' lines "
        "('-' = unlimited)",
    )
    add_redis_auth_args(p)
    add_hash_key_arg(p)


def apply_router_security(
    args: argparse.Namespace, config: RouterServerConfig
) -> RouterServerConfig:
    """``config`` with the security options of ``args``."""
    tls, http = server_tls_and_http(args, config.http)
    worker_tls = client_tls_from_args(args, "worker-tls", args.worker_tls_server_name)
    keys = ApiKeys.load(args.api_keys, os.environ.get(API_KEYS_ENV))
    default = TenantLimit(
        args.tenant_max_inflight, args.tenant_tokens_per_s, args.tenant_burst_tokens
    )
    overrides: dict[str, TenantLimit] = {}
    if args.tenant_limits is not None:
        try:
            with open(args.tenant_limits, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except OSError as exc:
            raise ValueError(f"--tenant-limits {args.tenant_limits}: {exc.strerror}") from None
        overrides = parse_overrides(lines, f"--tenant-limits {args.tenant_limits}")
    if keys is not None:
        _check_workers_closed(args, worker_tls)
    tenancy = dataclasses.replace(
        config.service.tenancy,
        trust_tenant_header=args.trust_tenant_header,
        salt_secret=config.service.tenancy.salt_secret
        or (None if keys is None else _kept_salt_secret(args)),
    )
    service = dataclasses.replace(
        config.service, tenancy=tenancy, quotas=QuotaConfig(default, overrides)
    )
    connection = dataclasses.replace(
        config.connection,
        tls=worker_tls,
        token=args.worker_token or None,
        hash_key_fingerprint=key_fingerprint(args.hash_key or None),
    )
    registry = dataclasses.replace(config.registry, auth=redis_auth_from_args(args))
    return dataclasses.replace(
        config,
        tls=tls,
        api_keys=keys,
        service=service,
        connection=connection,
        registry=registry,
        http=http,
    )


def _check_workers_closed(args: argparse.Namespace, worker_tls: ClientTls | None) -> None:
    """A keyed router refuses to start in front of workers anyone can call, unless told."""
    closed = bool(args.worker_token) or (worker_tls is not None and worker_tls.cert_file)
    if not closed and not args.insecure_workers:
        raise ValueError(
            "--api-keys: the workers are open (no --worker-token and no mutual TLS "
            "--worker-tls-cert): whoever reaches a worker reads tenants' prompts and flushes "
            "their caches. Start the workers with --router-token T and the router with "
            "--worker-token T, or pass --insecure-workers"
        )


def _kept_salt_secret(args: argparse.Namespace) -> bytes:
    """The secret a keyed router without --tenant-salt-secret keys salts with (salt_secret)."""
    if args.redis_url:
        options = redis_auth_from_args(args).client_kwargs()
        return redis_secret(args.redis_url, args.redis_prefix, options)
    return file_secret(state_file())


# ---- kvroute up ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class FleetSecurity:
    """``kvroute up``'s security: TLS on the router's public ports, API keys, tenant limits,
    the block-hashing key (router and workers), and -- with API keys -- a random token of
    this run that the workers require from the router (so they serve only it)."""

    tls: ServerTls | None = None
    api_keys: ApiKeys | None = None
    trust_tenant_header: bool = False
    quotas: QuotaConfig = dataclasses.field(default_factory=QuotaConfig)
    hash_key: str | None = None
    worker_token: str | None = None
    salt_secret: bytes | None = None  # keys tenants' cache salts (this run's, with API keys)

    def worker_env(self) -> dict[str, str]:
        """Environment for each worker subprocess (secrets stay out of the argv)."""
        env = dict(os.environ)
        if self.hash_key:
            env[HASH_KEY_ENV] = self.hash_key
        if self.worker_token:
            env[ROUTER_TOKEN_ENV] = self.worker_token
        return env

    def apply(self, config: RouterServerConfig) -> RouterServerConfig:
        """The in-process router's config with these settings."""
        tenancy = dataclasses.replace(
            config.service.tenancy,
            trust_tenant_header=self.trust_tenant_header,
            salt_secret=self.salt_secret,
        )
        service = dataclasses.replace(config.service, tenancy=tenancy, quotas=self.quotas)
        connection = dataclasses.replace(
            config.connection,
            token=self.worker_token,
            hash_key_fingerprint=key_fingerprint(self.hash_key),
        )
        http = config.http
        if http is not None:
            http = dataclasses.replace(http, tls=self.tls)
        return dataclasses.replace(
            config,
            tls=self.tls,
            api_keys=self.api_keys,
            service=service,
            connection=connection,
            http=http,
        )


def add_fleet_security_args(p: argparse.ArgumentParser) -> None:
    add_server_tls_args(p, "the router's gRPC and HTTP APIs")
    g = p.add_argument_group("authentication and tenant limits")
    g.add_argument(
        "--api-keys",
        default=None,
        metavar="FILE",
        help="the router requires an API key (tenant_id:sha256hex lines, `kvroute keys hash`; "
        f"also ${API_KEYS_ENV}); the workers then accept only this router (a random token)",
    )
    g.add_argument("--trust-tenant-header", action="store_true", help="see kvroute router --help")
    g.add_argument(
        "--tenant-max-inflight", type=int, default=None, help="requests in flight per tenant"
    )
    g.add_argument(
        "--tenant-tokens-per-s",
        type=float,
        default=None,
        help="tokens (prompt + max_new_tokens) per second per tenant",
    )
    add_hash_key_arg(p)


def fleet_security_from_args(args: argparse.Namespace) -> FleetSecurity:
    keys = ApiKeys.load(args.api_keys, os.environ.get(API_KEYS_ENV))
    tls = server_tls_from_args(args)
    if getattr(args, "demo", False) and (keys is not None or tls is not None):
        raise ValueError(
            "--demo sends plaintext requests without an API key: drop --demo, or "
            "--tls-cert / --api-keys"
        )
    return FleetSecurity(
        tls=tls,
        api_keys=keys,
        trust_tenant_header=args.trust_tenant_header,
        quotas=QuotaConfig(TenantLimit(args.tenant_max_inflight, args.tenant_tokens_per_s)),
        hash_key=args.hash_key or None,
        worker_token=secrets.token_urlsafe(32) if keys is not None else None,
        # the fleet's caches live as long as this run: a secret of the run keys the salts
        salt_secret=secrets.token_bytes(32) if keys is not None else None,
    )
