"""A router with API keys is closed by default: it does not start in front of workers anyone
can call unless told to, and its tenants' cache salts are keyed by a secret even when the
operator gave none (kept between starts; shared by replicas through Redis)."""

from __future__ import annotations

import argparse
import os
import stat

import pytest
import redis

from router.cli import router as router_cli
from router.cli.salt_secret import state_file
from router.service.auth import hash_key
from router.service.tenancy import salt_for_tenant


@pytest.fixture
def keys_file(tmp_path, monkeypatch):
    monkeypatch.delenv("KVROUTE_API_KEYS", raising=False)
    monkeypatch.delenv("KVROUTE_TENANT_SALT_SECRET", raising=False)
    monkeypatch.delenv("KVROUTE_WORKER_TOKEN", raising=False)
    f = tmp_path / "keys"
    f.write_text(f"acme:{hash_key('sk-acme')}\n")
    return str(f)


def _args(*extra: str) -> argparse.Namespace:
    return router_cli.build_parser().parse_args(["--worker", "127.0.0.1:7001", *extra])


def test_a_keyed_router_refuses_open_workers_unless_told(keys_file):
    with pytest.raises(ValueError) as err:
        router_cli.config_from_args(_args("--api-keys", keys_file))
    assert "--worker-token" in str(err.value) and "--insecure-workers" in str(err.value)
    assert router_cli.config_from_args(_args("--api-keys", keys_file, "--worker-token", "t"))
    assert router_cli.config_from_args(_args("--api-keys", keys_file, "--insecure-workers"))
    # without keys nothing changes: an open router in front of open workers, as before
    assert router_cli.config_from_args(_args()).api_keys is None


def test_a_keyed_router_keys_salts_with_a_kept_secret(keys_file):
    first = router_cli.config_from_args(_args("--api-keys", keys_file, "--worker-token", "t"))
    secret = first.service.tenancy.salt_secret
    assert secret is not None and len(secret) >= 32
    # the guessable salt a prober would try is not the tenant's salt
    assert salt_for_tenant(first.service.tenancy, "acme") != "tenant:acme"
    path = state_file()
    assert path.read_text().strip().encode() == secret
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    # the next start finds the same secret: the workers' caches still match
    again = router_cli.config_from_args(_args("--api-keys", keys_file, "--worker-token", "t"))
    assert again.service.tenancy.salt_secret == secret
    # an operator's own secret wins; a router without keys keeps the plain salt
    given = router_cli.config_from_args(
        _args("--api-keys", keys_file, "--worker-token", "t", "--tenant-salt-secret", "s3")
    )
    assert given.service.tenancy.salt_secret == b"s3"
    assert router_cli.config_from_args(_args()).service.tenancy.salt_secret is None


def test_replicas_share_the_secret_through_redis(keys_file, redis_url, redis_prefix):
    flags = ("--api-keys", keys_file, "--worker-token", "t", "--redis-url", redis_url)
    a = router_cli.config_from_args(_args(*flags, "--redis-prefix", redis_prefix))
    b = router_cli.config_from_args(_args(*flags, "--redis-prefix", redis_prefix))
    assert a.service.tenancy.salt_secret is not None
    assert a.service.tenancy.salt_secret == b.service.tenancy.salt_secret
    stored = redis.Redis.from_url(redis_url).get(f"{redis_prefix}:tenant-salt-secret")
    assert stored == a.service.tenancy.salt_secret
    assert not state_file().exists()  # with Redis, nothing is written locally


def test_an_unwritable_state_directory_is_a_clear_error(keys_file, tmp_path, monkeypatch):
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the state directory should be")
    monkeypatch.setenv("XDG_STATE_HOME", str(blocked))
    with pytest.raises(ValueError) as err:
        router_cli.config_from_args(_args("--api-keys", keys_file, "--worker-token", "t"))
    assert "--tenant-salt-secret" in str(err.value) and str(blocked) in str(err.value)
