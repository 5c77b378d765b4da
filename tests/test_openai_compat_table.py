"""The compatibility table against vLLM (docs/openai-compat-vllm.md) is the one the peer
run writes: a row for every request of tests/peers/compat_cases.py, in order, and linked
from the API's page. tests/peers/test_openai_compat_vllm.py (``pytest -m peer``) rewrites it
from a live vLLM and fails when what it wrote differs from the committed file."""

from __future__ import annotations

from pathlib import Path

from tests.peers.compat_cases import CASES

DOCS = Path(__file__).resolve().parents[1] / "docs"
TABLE = DOCS / "openai-compat-vllm.md"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def test_the_table_has_a_row_per_case_in_order() -> None:
    rows = [line for line in TABLE.read_text().splitlines() if line.startswith("| ")]
    names = [row[2:].split(" | ", 1)[0] for row in rows[2:]]  # after the header rows
    assert names == [_cell(case.name) for case in CASES]
    assert "of kvroute's" in TABLE.read_text()  # written by a run, with its counts


def test_the_api_page_links_the_table() -> None:
    assert "(openai-compat-vllm.md)" in (DOCS / "openai-api.md").read_text()


def test_the_count_is_the_rows_verdicts() -> None:
    text = TABLE.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ")][2:]
    same = sum(" | yes" in row for row in rows)
    assert f"**{same} of {len(rows)} requests the same**" in text
