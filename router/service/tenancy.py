"""Tenancy: which cache partition a request belongs to, decided by the server.

The trust model
---------------
A cache partition is ``(cache_salt, extra_key)``. Blocks of different partitions never match
(the salt seeds the block-hash chain), so the salt is what keeps one tenant's prompts from
being served out of -- or timed against -- another tenant's KV cache. A salt taken from the
request body would let any caller name any tenant's partition, so by default:

* The **tenant id** comes from the caller's gRPC metadata, under one configured header
  (``--tenant-header``, default ``x-tenant-id``). Whatever sets that header (an
  authenticating proxy, a mesh sidecar, an API gateway) is the trust anchor; the router does
  not authenticate callers itself. A request without the header belongs to the anonymous
  tenant ``""`` (the default partition); an empty ``--tenant-header`` turns tenancy off.
* The **cache_salt** is derived from the tenant id and *overwrites*
  ``request.partition.cache_salt`` before routing and before forwarding to a worker, so the
  body's salt is ignored. With ``--tenant-salt-secret`` the salt is
  ``HMAC-SHA256(secret, tenant_id)`` (hex, truncated to 128 bits): unguessable, so even a
  worker reachable directly cannot be asked for another tenant's partition by name. Without
  a secret the salt is ``"tenant:" + tenant_id``.
* ``--trust-client-salt`` restores the body's salt (for deployments where the caller *is*
  the trusted tier): a non-empty body salt wins, an empty one falls back to the derived salt.
* ``extra_key`` (e.g. a LoRA adapter name) is not a security boundary; it passes through.

With API keys (``--api-keys``, router/service/auth.py) the tenant is the one the caller's key
maps to, established at the edge (``CallInfo.tenant_id``); the tenant header is then
*ignored* unless ``--trust-tenant-header`` says the key holders are trusted gateways that
name their own users' tenants (``trust_tenant_header``). Without API keys the header is
trusted as described above (the quick start keeps working).

Pure and synchronous: no asyncio, no grpc (metadata arrives as a sequence of key/value pairs).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass

from kvroute_proto.events import Partition

MAX_TENANT_ID_BYTES = 256
MAX_CACHE_SALT_BYTES = 256
MAX_EXTRA_KEY_BYTES = 256


class TenancyError(ValueError):
    """Bad tenant metadata or partition fields (gRPC INVALID_ARGUMENT); names field and limit."""


@dataclass(frozen=True, slots=True)
class TenancyConfig:
    """How the router derives a request's partition.

    ``tenant_header``: metadata key holding the tenant id (lowercase; "" disables tenancy).
    ``salt_secret``: HMAC key for unguessable salts (None: the salt is ``tenant:<id>``).
    ``trust_client_salt``: honour a non-empty ``partition.cache_salt`` from the request body.
    ``trust_tenant_header``: for an authenticated caller (an API key), still honour the
    tenant header (``--trust-tenant-header``: key holders are gateways naming their users);
    a non-empty header then wins over the key's tenant. Unauthenticated calls (no
    ``--api-keys``) always use the header, as before.
    """

    tenant_header: str = "x-tenant-id"
    salt_secret: bytes | None = None
    trust_client_salt: bool = False
    trust_tenant_header: bool = False

    def __post_init__(self) -> None:
        if self.tenant_header != self.tenant_header.lower():
            raise TenancyError(
                f"tenant_header must be lowercase (gRPC metadata keys are), "
                f"got {self.tenant_header!r}"
            )
        if self.salt_secret is not None and len(self.salt_secret) == 0:
            raise TenancyError("salt_secret must be non-empty when given")


def tenant_id_from_metadata(
    config: TenancyConfig, metadata: Iterable[tuple[str, str | bytes]] | None
) -> str:
    """The caller's tenant id ("" when tenancy is off or the header is absent)."""
    if not config.tenant_header or metadata is None:
        return ""
    for key, value in metadata:
        if key.lower() == config.tenant_header:
            tenant = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
            if len(tenant.encode()) > MAX_TENANT_ID_BYTES:
                raise TenancyError(
                    f"metadata {config.tenant_header} must be at most "
                    f"{MAX_TENANT_ID_BYTES} bytes, got {len(tenant.encode())}"
                )
            return tenant
    return ""


def tenant_of(
    config: TenancyConfig,
    metadata: Iterable[tuple[str, str | bytes]] | None,
    authenticated: str | None = None,
) -> str:
    """The request's tenant. Unauthenticated (``authenticated`` None): the header's, as
    without API keys. Authenticated: the key's, unless the header is trusted and set."""
    if authenticated is None:
        return tenant_id_from_metadata(config, metadata)
    if config.trust_tenant_header:
        header = tenant_id_from_metadata(config, metadata)
        if header:
            return header
    return authenticated


def salt_for_tenant(config: TenancyConfig, tenant_id: str) -> str:
    """The cache_salt of a tenant; the anonymous tenant "" keeps the default salt ""."""
    if not tenant_id:
        return ""
    if config.salt_secret is None:
        return f"tenant:{tenant_id}"
    digest = hmac.new(config.salt_secret, tenant_id.encode(), hashlib.sha256).hexdigest()
    return f"t:{digest[:32]}"


def resolve_partition(
    config: TenancyConfig,
    metadata: Iterable[tuple[str, str | bytes]] | None,
    body: Partition,
    tenant_id: str | None = None,
) -> Partition:
    """The partition a request really runs in: server-derived salt, the body's extra_key.
    ``tenant_id``: the authenticated tenant (an API key's), None when unauthenticated."""
    if len(body.extra_key.encode()) > MAX_EXTRA_KEY_BYTES:
        raise TenancyError(
            f"partition.extra_key must be at most {MAX_EXTRA_KEY_BYTES} bytes, "
            f"got {len(body.extra_key.encode())}"
        )
    if config.trust_client_salt and body.cache_salt:
        if len(body.cache_salt.encode()) > MAX_CACHE_SALT_BYTES:
            raise TenancyError(
                f"partition.cache_salt must be at most {MAX_CACHE_SALT_BYTES} bytes, "
                f"got {len(body.cache_salt.encode())}"
            )
        return Partition(body.cache_salt, body.extra_key)
    salt = salt_for_tenant(config, tenant_of(config, metadata, tenant_id))
    return Partition(salt, body.extra_key)
