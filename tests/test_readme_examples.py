"""What the README runs ships in the repository: its replay example runs on a fresh clone, and
no tracked file points at the team's shared folder outside the repository."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

import kvroute_cli

ROOT = Path(__file__).resolve().parents[1]


def _readme_replay_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return [
        line.strip()
        for line in text.splitlines()
        if line.strip().startswith("kvroute replay --trace bench/")
    ]


def test_the_readme_replay_example_runs_on_the_shipped_sample(monkeypatch, capsys):
    commands = _readme_replay_commands()
    assert len(commands) == 1, "the README shows one runnable replay example"
    argv = shlex.split(commands[0])
    trace = argv[argv.index("--trace") + 1]
    assert (ROOT / trace).is_file()
    monkeypatch.chdir(ROOT)  # the README runs it from the repository root
    assert kvroute_cli.main([*argv[1:], "--quiet"]) == 0
    out = capsys.readouterr().out
    for policy in re.findall(r"--policy (\S+)", commands[0]):
        row = next(line for line in out.splitlines() if line.startswith(policy))
        assert re.search(r"\b300\b +0 ", row), row  # every request served, no errors


def _tracked_text_files() -> list[Path]:
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: no list of tracked files")
    paths = [ROOT / p for p in listed.decode().split("\0") if p]
    return [p for p in paths if p.is_file() and p.suffix not in {".png", ".pyc"}]


def test_nothing_tracked_points_outside_the_repository():
    pattern = re.compile(r"(\.\.|/work)/shared\b")  # a parent's or the box's shared folder
    offenders = []
    for path in _tracked_text_files():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        offenders += [
            f"{path.relative_to(ROOT)}:{i}"
            for i, line in enumerate(text.splitlines(), 1)
            if pattern.search(line)
        ]
    assert offenders == []


def test_the_readme_says_how_to_get_torchs_cpu_build_for_the_quick_starts_pin():
    text = (ROOT / "README.md").read_text()
    quick_start = re.search(r"pip install torch==(\S+) &&", text)
    assert quick_start, "the quick start installs a pinned torch first"
    pin = quick_start.group(1)
    # On Linux, PyPI's torch wheel pulls the CUDA libraries (~3 GB); PyTorch's own CPU index
    # has the same version without them.
    cpu = f"pip install torch=={pin} --index-url https://download.pytorch.org/whl/cpu"
    assert cpu in text
