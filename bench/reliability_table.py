"""Render RELIABILITY.md's fault table from the rows the fault suite wrote.

    KVROUTE_RELIABILITY_OUT=bench/results/reliability python -m pytest tests/faults
    python -m bench.reliability_table [--rows bench/results/reliability] [--doc RELIABILITY.md]

Each test in tests/faults writes one JSON row (fault, what the client saw, the index after,
what recovery meant and how long it took) into ``--rows``; this replaces the part of
``--doc`` between the ``faults-table`` markers with a Markdown table of them, so every row
of the table comes from a test run (its date and machine are in the row's file).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

START = "<!-- faults-table:start -->"
END = "<!-- faults-table:end -->"
# the table's order; rows of tests not listed here follow in name order
ORDER = (
    "worker_sigkill",
    "worker_restart",
    "worker_stall",
    "event_loss",
    "event_duplication",
    "event_reordering",
    "event_mixed",
    "replay_gap",
    "router_cold_start",
    "router_restart",
    "redis_down",
    "slow_client",
    "overload",
    "long_prompt_overload",
)
FIELDS = ("test", "fault", "client_sees", "index_after", "recovery", "recover_s")


def load_rows(folder: Path) -> list[dict]:
    """Every ``*.json`` row in ``folder`` (ValueError naming a file that lacks a field)."""
    rows = []
    for path in sorted(folder.glob("*.json")):
        row = json.loads(path.read_text())
        if "fault" not in row:  # another result in the folder (a bench's JSON)
            continue
        missing = [f for f in FIELDS if f not in row]
        if missing:
            raise ValueError(f"{path}: missing {', '.join(missing)}")
        rows.append(row)
    rank = {name: i for i, name in enumerate(ORDER)}
    return sorted(rows, key=lambda r: (rank.get(r["test"], len(ORDER)), r["test"]))


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_table(rows: list[dict]) -> str:
    lines = [
        "| Fault | What the client sees | Index after | Time to recover | Row from |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        took = "-" if r["recover_s"] is None else f"**{r['recover_s']} s**"
        lines.append(
            f"| {_cell(r['fault'])} | {_cell(r['client_sees'])} | {_cell(r['index_after'])} "
            f"| {_cell(r['recovery'])}: {took} | `{r['test']}` ({_cell(r.get('date', '?'))}) |"
        )
    return "\n".join(lines)


def replace_table(doc: str, table: str) -> str:
    """``doc`` with the text between the markers replaced by ``table``."""
    if START not in doc or END not in doc or doc.index(START) > doc.index(END):
        raise ValueError(f"the document needs {START} ... {END}")
    head, rest = doc.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{table}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.reliability_table", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--rows", type=Path, default=Path("bench/results/reliability"))
    p.add_argument("--doc", type=Path, default=Path("RELIABILITY.md"))
    args = p.parse_args(argv)
    try:
        rows = load_rows(args.rows)
        if not rows:
            raise ValueError(
                f"no rows in {args.rows}: run the fault suite with "
                "KVROUTE_RELIABILITY_OUT set first"
            )
        args.doc.write_text(replace_table(args.doc.read_text(), render_table(rows)))
    except (OSError, ValueError) as exc:
        print(f"reliability_table: {exc}", file=sys.stderr)
        return 2
    print(f"{args.doc}: {len(rows)} rows")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
