"""bench.reliability_table: rows from the fault suite -> RELIABILITY.md's table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import reliability_table as rt


def _row(test: str, **kw) -> dict:
    base = {
        "test": test,
        "fault": f"{test} fault",
        "client_sees": "40 OK",
        "index_after": "index == snapshots",
        "recovery": "restart -> synced",
        "recover_s": 1.25,
        "date": "2026-11-30 19:00 UTC",
    }
    return base | kw


def test_rows_are_ordered_and_rendered(tmp_path: Path) -> None:
    (tmp_path / "zeta.json").write_text(json.dumps(_row("zeta")))
    (tmp_path / "overload.json").write_text(json.dumps(_row("overload", client_sees="a|b")))
    (tmp_path / "worker_sigkill.json").write_text(json.dumps(_row("worker_sigkill")))
    (tmp_path / "overload_bench.json").write_text(json.dumps({"admission": "on"}))  # not a row
    rows = rt.load_rows(tmp_path)
    assert [r["test"] for r in rows] == ["worker_sigkill", "overload", "zeta"]
    table = rt.render_table(rows).splitlines()
    assert len(table) == 5 and table[0].startswith("| Fault |")
    assert "a\\|b" in table[3] and "**1.25 s**" in table[2]


def test_a_row_missing_a_field_is_named(tmp_path: Path) -> None:
    row = _row("x")
    del row["recovery"]
    (tmp_path / "x.json").write_text(json.dumps(row))
    with pytest.raises(ValueError, match=r"x\.json: missing recovery"):
        rt.load_rows(tmp_path)


def test_only_the_marked_part_of_the_document_is_replaced(tmp_path: Path) -> None:
    doc = f"# T\nbefore\n{rt.START}\nold\n{rt.END}\nafter\n"
    assert rt.replace_table(doc, "NEW") == f"# T\nbefore\n{rt.START}\nNEW\n{rt.END}\nafter\n"
    with pytest.raises(ValueError, match="needs"):
        rt.replace_table("no markers", "NEW")
    rows, out = tmp_path / "rows", tmp_path / "doc.txt"
    rows.mkdir()
    (rows / "a.json").write_text(json.dumps(_row("a")))
    out.write_text(doc)
    assert rt.main(["--rows", str(rows), "--doc", str(out)]) == 0
    assert "a fault" in out.read_text() and "old" not in out.read_text()
    assert rt.main(["--rows", str(tmp_path / "none"), "--doc", str(out)]) == 2
