"""The bridge's core modules are sans-I/O: no event loop, sockets, RPC, torch or clock."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import worker.bridge

CORE = sorted(Path(worker.bridge.__file__).parent.glob("*.py"))
FORBIDDEN = ("asyncio", "zmq", "grpc", "torch", "time", "datetime", "aiohttp", "uvloop")


@pytest.mark.parametrize("path", CORE, ids=lambda p: p.name)
def test_no_io_no_clock_imported(path: Path) -> None:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    bad = sorted(n for n in names if n.split(".")[0] in FORBIDDEN)
    assert bad == [], f"{path.name} imports {bad}"


def test_importing_the_bridge_loads_no_transport() -> None:
    code = (
        "import sys, worker.bridge.translate, worker.bridge.engine_wire;"
        "print(sorted(m for m in ('torch', 'zmq', 'grpc', 'asyncio') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_bridge_service_never_imports_torch() -> None:
    code = (
        "import sys, worker.bridge.service.cli, worker.bridge.service.metrics;"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
