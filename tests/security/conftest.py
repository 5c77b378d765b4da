"""Fixtures of the security tests: a PKI made once per module at test time."""

from __future__ import annotations

from pathlib import Path

import pytest
from tls_certs import Pki, make_pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(Path(tmp_path_factory.mktemp("pki")))
