"""Suite-wide settings.

A few tests skip when an optional piece is missing on a developer's machine (a Redis server,
the worker's torch extra). CI has all of them, so there a skip would only hide a failure:
with ``KVROUTE_FAIL_ON_SKIP=1`` (set by ``.ci/run``) every skip is reported as a failure.
"""

from __future__ import annotations

import os

import pytest

FAIL_ON_SKIP = os.environ.get("KVROUTE_FAIL_ON_SKIP") == "1"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if FAIL_ON_SKIP and report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.longrepr = f"skipped, and KVROUTE_FAIL_ON_SKIP=1 makes that a failure: {reason}"
