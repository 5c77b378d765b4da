"""The layering rules, checked on the source (docs/ARCHITECTURE.md, "package" table):

- the cores (the router's index, policies and RouterCore; the worker's radix cache and
  scheduler) import no asyncio, grpc, aiohttp, redis or clock;
- only the codec and the service shells import the generated protobuf modules;
- router and worker never import each other, and the router never imports torch;
- product code has no import circle.

Imports are read from the syntax tree (every ``import`` statement, also inside functions;
``if TYPE_CHECKING:`` blocks excepted), so a lazy import counts like any other.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# import name -> folder
PACKAGES = {
    "kvroute_proto": "proto",
    "edge": "edge",
    "router": "router",
    "worker": "worker",
    "fleetsim": "fleetsim",
}

CORE_PREFIXES = ("router.core", "worker.cache", "worker.engine", "worker.bridge")
# Executors that run the real model on the device: not cores. TorchExecutor times its own
# compute with a real clock on purpose (that time is the engine's cost report).
NOT_CORE = {"worker.engine.torch_executor"}
# The bridge's I/O shell lives under the bridge's core package (worker/bridge/service).
SHELL_PREFIXES = ("worker.bridge.service",)
FORBIDDEN_IN_CORE = ("asyncio", "grpc", "aiohttp", "redis", "time", "datetime", "uvloop", "zmq")

GENERATED = ("kvroute_proto.kvroute_pb2", "kvroute_proto.kvroute_pb2_grpc")
# Who may touch the generated classes: the codec, and the shells that speak gRPC.
PB_ALLOWED_PREFIXES = (
    "kvroute_proto.codec",
    *GENERATED,
    "edge",
    "router.service",
    "router.cli",
    "worker.service",
    "worker.bridge.service",
    "fleetsim.replay.live",
    "fleetsim.replay.live_http",
)


def _modules() -> dict[str, Path]:
    found = {}
    for name, folder in PACKAGES.items():
        base = ROOT / folder
        for path in base.rglob("*.py"):
            rel = path.relative_to(base).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            found[".".join((name, *parts))] = path
    return found


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(module: str) -> set[str]:
    """Every module ``module`` imports (absolute dotted names; submodules resolved)."""
    tree = ast.parse(MODULES[module].read_text())
    is_package = MODULES[module].name == "__init__.py"
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = module.split(".")
                keep = len(parts) - node.level + (1 if is_package else 0)
                base = ".".join(parts[:keep] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            out.add(base)
            for alias in node.names:
                if f"{base}.{alias.name}" in MODULES:
                    out.add(f"{base}.{alias.name}")
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


def _in(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


CORES = sorted(
    m for m in MODULES if _in(m, CORE_PREFIXES) and m not in NOT_CORE and not _in(m, SHELL_PREFIXES)
)


def test_the_cores_are_found():
    assert "router.core.router_core" in CORES
    assert "router.core.policy" in CORES
    assert "worker.cache.radix_cache" in CORES
    assert "worker.engine.scheduler" in CORES
    assert "worker.bridge.translate" in CORES and "worker.bridge.engine_wire" in CORES
    assert not any(_in(m, SHELL_PREFIXES) for m in CORES)


@pytest.mark.parametrize("module", CORES)
def test_a_core_imports_no_io_and_no_clock(module):
    bad = sorted(i for i in _imports(module) if _in(i, FORBIDDEN_IN_CORE))
    assert bad == [], f"{module} is a sans-I/O core and imports {bad}"


def test_only_the_codec_and_the_shells_import_the_generated_modules():
    bad = sorted(
        m
        for m in MODULES
        if not _in(m, PB_ALLOWED_PREFIXES) and any(_in(i, GENERATED) for i in _imports(m))
    )
    assert bad == []


def test_router_and_worker_never_import_each_other():
    bad = []
    for m in MODULES:
        side = m.split(".")[0]
        other = {"router": ("worker", "torch"), "worker": ("router",)}.get(side, ())
        bad += [(m, i) for i in _imports(m) if _in(i, other)]
    assert bad == []


def test_the_contract_and_the_edge_import_neither_side():
    bad = [
        (m, i)
        for m in MODULES
        if m.split(".")[0] in ("kvroute_proto", "edge")
        for i in _imports(m)
        if _in(i, ("router", "worker", "fleetsim"))
    ]
    assert bad == []


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    graph = {m: sorted(i for i in _imports(m) if i in MODULES and i != m) for m in MODULES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return found


def test_no_import_circle_in_product_code():
    assert _cycles() == []


def test_the_cycle_finder_finds_a_cycle(monkeypatch):
    """The check above could pass by finding nothing: show it finds a planted circle."""
    fake = {"router.core.a": {"router.core.b"}, "router.core.b": {"router.core.a"}}
    monkeypatch.setitem(MODULES, "router.core.a", MODULES["router.core.policy"])
    monkeypatch.setitem(MODULES, "router.core.b", MODULES["router.core.policy"])
    real = _imports

    def imports(module: str) -> set[str]:
        return fake.get(module) or real(module)

    monkeypatch.setitem(globals(), "_imports", imports)
    assert ["router.core.a", "router.core.b"] in _cycles()
