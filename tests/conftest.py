"""Suite-wide settings.

A few tests skip when an optional piece is missing on a developer's machine (a Redis server,
the worker's torch extra). CI has all of them, so there a skip would only hide a failure:
with ``KVROUTE_FAIL_ON_SKIP=1`` (set by ``.ci/run``) every skip is reported as a failure.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
import redis

FAIL_ON_SKIP = os.environ.get("KVROUTE_FAIL_ON_SKIP") == "1"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if FAIL_ON_SKIP and report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.longrepr = f"skipped, and KVROUTE_FAIL_ON_SKIP=1 makes that a failure: {reason}"


REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture
def redis_url() -> str:
    """The real Redis at 127.0.0.1:6379 (skips when none answers; CI starts one)."""
    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1)
    try:
        client.ping()
    except redis.RedisError as exc:
        pytest.skip(f"Redis is not reachable at 127.0.0.1:6379: {exc}")
    finally:
        client.close()
    return REDIS_URL


@pytest.fixture
def redis_prefix(redis_url: str) -> Iterator[str]:
    """A registry key prefix of this test's own; its keys are deleted afterwards."""
    prefix = f"kvroute-test-{uuid.uuid4().hex}:"
    yield prefix
    client = redis.Redis.from_url(redis_url)
    for key in client.scan_iter(match=f"{prefix}*"):
        client.delete(key)
    client.close()


@pytest.fixture(autouse=True)
def _state_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever a router keeps between starts (its tenant salt secret) goes to a temporary
    directory, never the developer's home; processes the test starts inherit it."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path_factory.mktemp("state")))
