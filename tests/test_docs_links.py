"""The project explains itself: every Markdown file a tracked file mentions ships in the
repository, and the README links the architecture page."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_MD_REF = re.compile(r"[A-Za-z0-9_./-]*[A-Za-z0-9_-]\.md\b")


def _tracked() -> list[str]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: no list of tracked files")
    return [p for p in out.decode().split("\0") if p]


def test_every_markdown_file_mentioned_is_in_the_repository():
    tracked = _tracked()
    missing = []
    for rel in tracked:
        path = ROOT / rel
        # a kept patch names files as a/PATH and b/PATH
        if path.suffix in {".png", ".jsonl", ".patch"} or not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for i, line in enumerate(text.splitlines(), 1):
            for ref in _MD_REF.findall(line):
                name = ref.lstrip("./")
                if not any(t == name or t.endswith("/" + name) for t in tracked):
                    missing.append(f"{rel}:{i}: {ref}")
    assert missing == []


def test_the_readme_layout_links_the_architecture_page():
    readme = (ROOT / "README.md").read_text()
    layout = readme.split("## Layout", 1)[1].split("\n## ", 1)[0]
    assert "(docs/ARCHITECTURE.md)" in layout
    assert (ROOT / "docs" / "ARCHITECTURE.md").is_file()


_CONFLICT = re.compile(r"^(<{7} |>{7} |={7}$)", re.MULTILINE)


def test_no_tracked_file_holds_merge_conflict_markers():
    """A merge resolved by committing both sides leaves these lines behind (it happened to
    the decisions index once)."""
    found = []
    for rel in _tracked():
        path = ROOT / rel
        if not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        found += [f"{rel}: {m.group(0)!r}" for m in _CONFLICT.finditer(text)]
    assert not found, found
