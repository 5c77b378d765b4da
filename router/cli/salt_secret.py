"""The tenant salt secret of a keyed router that was given none.

Without a secret a tenant's cache salt is ``tenant:<id>``: anyone who reaches a worker can
guess it and probe the worker's cache for another tenant's prompts, prefix by prefix. So a
router with API keys and no ``--tenant-salt-secret`` keys its salts with a secret generated
at its first start and kept where its next start (and, with Redis, every replica) finds it:

- with ``--redis-url``: in Redis under ``<prefix>:tenant-salt-secret`` (set once, NX, so
  replicas starting together agree on one);
- else in a file, ``$XDG_STATE_HOME/kvroute/tenant-salt-secret`` (``~/.local/state`` when
  unset), mode 0600.

The secret is never logged; the log says where it is kept.
"""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SECRET_BYTES = 32


def state_file() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(Path.home(), ".local", "state")
    return Path(base) / "kvroute" / "tenant-salt-secret"


def file_secret(path: Path) -> bytes:
    """The secret kept in ``path``, created (0600) at the first call. ValueError when the
    file cannot be read or written, naming it."""
    try:
        text = path.read_text(encoding="ascii").strip()
        if text:
            return text.encode()
    except FileNotFoundError:
        pass
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not a secret written by kvroute"
        raise ValueError(
            f"could not read the tenant salt secret {path} ({why}): "
            "give --tenant-salt-secret (or $KVROUTE_TENANT_SALT_SECRET)"
        ) from None
    new = secrets.token_hex(SECRET_BYTES)
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another router created it first: take its secret
        return file_secret(path)
    except OSError as exc:
        raise ValueError(
            f"could not keep a tenant salt secret in {path} ({exc.strerror}): "
            "give --tenant-salt-secret (or $KVROUTE_TENANT_SALT_SECRET)"
        ) from None
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(new + "\n")
    log.info("tenant salt secret generated and kept in %s", path)
    return new.encode()


def redis_secret(url: str, prefix: str, client_options: dict[str, Any]) -> bytes:
    """The secret kept in Redis, set once (NX) by whichever router starts first."""
    import redis  # the router's dependency; only here when a keyed router has no secret

    key = f"{prefix}:tenant-salt-secret"
    client = redis.Redis.from_url(url, **client_options)
    try:
        created = client.set(key, secrets.token_hex(SECRET_BYTES), nx=True)
        value = client.get(key)
    except redis.RedisError as exc:
        raise ValueError(
            f"could not read the tenant salt secret from Redis ({type(exc).__name__}): "
            "give --tenant-salt-secret (or $KVROUTE_TENANT_SALT_SECRET)"
        ) from None
    finally:
        client.close()
    if not value:
        raise ValueError(f"Redis holds no value at {key}: give --tenant-salt-secret")
    log.info(
        "tenant salt secret %s Redis key %s", "generated into" if created else "read from", key
    )
    return value if isinstance(value, bytes) else str(value).encode()
