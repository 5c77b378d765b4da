"""API keys: bearer tokens mapped to tenant ids, stored only as SHA-256 hashes.

Key file (``--api-keys FILE``) and environment (``KVROUTE_API_KEYS``), one entry per line
(the environment also takes commas)::

    # tenant_id:sha256hex        blank lines and '#' comments are ignored
    acme:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08
    globex:60303ae22b998861bce3b28f33eec1be758a213c86c93c076dbe9f558c11c752

Make a hash with ``kvroute keys hash`` (reads the key from stdin) or
``printf %s "$KEY" | sha256sum``. A caller sends ``authorization: Bearer KEY`` (gRPC
metadata) or ``Authorization: Bearer KEY`` (HTTP); the router hashes the key and compares it
with every stored hash in constant time (``hmac.compare_digest``, no early exit), so neither
the key nor which tenant's hash it nearly matched leaks through timing. Missing or wrong key:
UNAUTHENTICATED / HTTP 401. The tenant the key maps to is the request's tenant: its cache
partition and its quota.

Pure: no grpc, no aiohttp (the edge -- edge.auth -- calls :meth:`ApiKeys.authenticate`).
"""

from __future__ import annotations

import argparse
import getpass
import hashlib
import hmac
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from edge.auth import Metadata, bearer_token
from edge.frontdoor import Unauthenticated

API_KEYS_ENV = "KVROUTE_API_KEYS"
_HEX = frozenset("0123456789abcdef")


def hash_key(key: str) -> str:
    """The stored form of an API key: SHA-256 of its UTF-8 bytes, lowercase hex."""
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class ApiKeys:
    """The accepted keys: (tenant_id, sha256 digest) pairs."""

    entries: tuple[tuple[str, bytes], ...]

    def __post_init__(self) -> None:
        if not self.entries:
            raise ValueError("no API keys given (the key file and environment are empty)")

    @property
    def tenants(self) -> frozenset[str]:
        return frozenset(t for t, _ in self.entries)

    @classmethod
    def parse(cls, lines: Iterable[str], source: str) -> ApiKeys:
        """Parse ``tenant_id:sha256hex`` lines; ValueError names the source and line."""
        entries: list[tuple[str, bytes]] = []
        seen: dict[bytes, str] = {}
        for num, raw in enumerate(lines, 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            tenant, sep, digest = line.rpartition(":")
            digest = digest.strip().lower()
            tenant = tenant.strip()
            if not sep or not tenant:
                raise ValueError(f"{source} line {num}: expected tenant_id:sha256hex")
            if len(digest) != 64 or not set(digest) <= _HEX:
                raise ValueError(
                    f"{source} line {num}: the hash must be 64 hex digits (SHA-256 of the key; "
                    f"`kvroute keys hash`), got {len(digest)} characters"
                )
            if len(tenant.encode()) > 256:
                raise ValueError(f"{source} line {num}: tenant_id must be at most 256 bytes")
            raw_digest = bytes.fromhex(digest)
            if raw_digest in seen and seen[raw_digest] != tenant:
                raise ValueError(
                    f"{source} line {num}: the same key is listed for tenants "
                    f"{seen[raw_digest]!r} and {tenant!r}"
                )
            seen[raw_digest] = tenant
            entries.append((tenant, raw_digest))
        return cls(tuple(entries))

    @classmethod
    def load(cls, path: str | None, env_value: str | None) -> ApiKeys | None:
        """Keys from the file at ``path`` and the environment value (None when neither)."""
        entries: list[tuple[str, bytes]] = []
        if path is not None:
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read()
            except OSError as exc:
                raise ValueError(f"--api-keys {path}: cannot read: {exc.strerror}") from None
            if text.strip():
                entries += cls.parse(text.splitlines(), f"--api-keys {path}").entries
        if env_value:
            lines = env_value.replace(",", "\n").splitlines()
            entries += cls.parse(lines, f"${API_KEYS_ENV}").entries
        if path is None and not env_value:
            return None
        return cls(tuple(entries))

    def tenant_of(self, key: str) -> str | None:
        """The tenant of ``key``, or None. Compares against every entry (constant time)."""
        digest = hashlib.sha256(key.encode()).digest()
        found: str | None = None
        for tenant, stored in self.entries:
            if hmac.compare_digest(digest, stored):
                found = tenant
        return found

    def authenticate(self, metadata: Metadata) -> str:
        """The caller's tenant (Unauthenticated when the key is missing or wrong)."""
        key = bearer_token(metadata)
        if key is None:
            raise Unauthenticated(
                "missing API key: send 'authorization: Bearer <key>' (gRPC metadata) or "
                "'Authorization: Bearer <key>' (HTTP)"
            )
        tenant = self.tenant_of(key)
        if tenant is None:
            raise Unauthenticated("invalid API key")
        return tenant


# ---- kvroute keys ----------------------------------------------------------------------


def keys_main(argv: Sequence[str]) -> int:
    """``kvroute keys hash [--tenant T]``: print the key-file line for a key read from stdin
    (or a prompt on a terminal); the key itself is never stored."""
    p = argparse.ArgumentParser(
        prog="kvroute keys",
        description="Make API-key file entries (tenant_id:sha256hex) for kvroute router "
        "--api-keys. The key is read from stdin (or prompted for on a terminal).",
    )
    sub = p.add_subparsers(dest="command", required=True)
    h = sub.add_parser("hash", help="print tenant_id:sha256hex for a key read from stdin")
    h.add_argument("--tenant", default=None, help="prefix the hash with this tenant id")
    args = p.parse_args(list(argv))
    tty = sys.stdin.isatty()
    key = getpass.getpass("API key: ") if tty else sys.stdin.read().rstrip("\r\n")
    if not key:
        print("kvroute keys hash: empty key", file=sys.stderr)
        return 2
    digest = hash_key(key)
    print(f"{args.tenant}:{digest}" if args.tenant else digest)
    return 0
