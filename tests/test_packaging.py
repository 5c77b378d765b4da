"""Packaging and import hygiene."""

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_is_listed_in_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    mapping = config["package-dir"]
    top = {name.split(".")[0] for name in listed}
    found = set()
    for name in top:
        folder = ROOT / mapping.get(name, name)
        for init in folder.rglob("__init__.py"):
            rel = init.parent.relative_to(folder)
            found.add(".".join((name, *rel.parts)))
    assert found - listed == set(), "add these to [tool.setuptools] packages"
    assert listed - found == set(), "these listed packages do not exist"


def test_bench_is_not_installed():
    """bench/ holds developer scripts run from the repository root, not a shipped package."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert not [p for p in config["packages"] if p.split(".")[0] == "bench"]


def test_router_never_imports_torch_or_worker():
    code = (
        "import sys, importlib, pkgutil, router\n"
        "for m in pkgutil.walk_packages(router.__path__, 'router.'):\n"
        "    importlib.import_module(m.name)\n"
        "bad = sorted(\n"
        "    n for n in sys.modules if n.split('.')[0] in ('torch', 'triton', 'worker')\n"
        ")\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_contract_imports_neither_side():
    code = (
        "import sys, kvroute_proto.codec, kvroute_proto.hashing, kvroute_proto.events\n"
        "import edge.registry, kvroute_proto.generate\n"
        "bad = sorted(n for n in sys.modules if n.split('.')[0] in ('torch', 'worker', 'router'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_cli_help_lists_commands():
    out = subprocess.run(
        [sys.executable, "-m", "kvroute_cli", "--help"],
        check=True,
        capture_output=True,
        text=True,
        cwd=ROOT,
    ).stdout
    for name in ("up", "worker", "router", "generate", "replay", "workload"):
        assert f"  {name}" in out
