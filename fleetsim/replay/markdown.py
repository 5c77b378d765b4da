"""Replay reports (``kvroute replay --json``) as the Markdown tables of BENCHMARKS.md.

    python -m fleetsim.replay.markdown OUT.json [MORE.json ...] [--title "..."]

One table per file: every policy's hit rate, its share of the pooled reference (one cache
of N times the capacity: a reference, not a bound), prefill and busy-time imbalance, TTFT
p50 / p99, e2e p50 / p99, mean and p99 inter-token latency and errors; the lowest TTFT p99
in bold, and the references above the table. Several files of the same trace and fleet
(one policy per process, ``--no-reference`` beside one run with the references) can be
merged into one table with ``--merge``, and runs at several router counts (``--routers R``)
into one table with ``--by-routers``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

COLUMNS = (
    "policy",
    "hit rate",
    "of pooled ref",
    "prefill imb",
    "busy imb",
    "TTFT p50",
    "TTFT p99",
    "e2e p50",
    "e2e p99",
    "ITL mean",
    "ITL p99",
    "errors",
)


def fmt_seconds(x: float | None) -> str:
    """Seconds as the tables write them: ms under a second, else s; "-" when unknown."""
    if x is None or not math.isfinite(x):
        return "-"
    return f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s"


def fmt_millis(x: float | None) -> str:
    """An inter-token latency in ms (one decimal); "-" when the report has none."""
    return "-" if x is None or not math.isfinite(x) else f"{x * 1000:.1f} ms"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def merge(reports: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One report from several of the same trace and fleet: every policy once (the first
    report that has it), the references from the first report that has them."""
    if not reports:
        raise ValueError("nothing to merge")
    keys = ("trace", "workers", "kv_capacity_tokens")
    first = reports[0].get("setup", {})
    for r in reports[1:]:
        setup = r.get("setup", {})
        for k in keys:
            if setup.get(k) != first.get(k):
                raise ValueError(f"cannot merge: setup.{k} differs ({setup.get(k)!r})")
    out: dict[str, Any] = {"setup": first, "policies": []}
    seen: set[str] = set()
    for r in reports:
        for p in r.get("policies", []):
            if p["policy"] not in seen:
                seen.add(p["policy"])
                out["policies"].append(p)
        for ref in ("pooled_reference_hit_rate", "infinite_hit_rate"):
            if out.get(ref) is None and r.get(ref) is not None:
                out[ref] = r[ref]
    return out


def table(report: dict[str, Any]) -> str:
    """The report as a Markdown table (references on the line above it)."""
    pooled = report.get("pooled_reference_hit_rate")
    infinite = report.get("infinite_hit_rate")
    policies = report.get("policies", [])
    finite = [p["ttft_p99_s"] for p in policies if p.get("ttft_p99_s") is not None]
    best = min(finite) if finite else None
    lines = []
    refs = []
    if pooled is not None:
        refs.append(f"pooled reference {pooled:.1%}")
    if infinite is not None:
        refs.append(f"infinite ceiling {infinite:.1%}")
    workers = report.get("setup", {}).get("workers")
    head = f"**{workers} workers**" if workers is not None else ""
    if refs:
        head = f"{head} — {', '.join(refs)}" if head else ", ".join(refs)
    if head:
        lines += [head, ""]
    lines.append("| " + " | ".join(COLUMNS) + " |")
    lines.append("|---" + "|---:" * (len(COLUMNS) - 1) + "|")
    for p in policies:
        hit = p["hit_rate"]
        ttft99 = fmt_seconds(p.get("ttft_p99_s"))
        if best is not None and p.get("ttft_p99_s") == best:
            ttft99 = f"**{ttft99}**"
        row = [
            p["policy"],
            f"{hit:.1%}",
            f"{hit / pooled:.1%}" if pooled else "-",
            _ratio(p.get("load_imbalance")),
            _ratio(p.get("busy_imbalance")),
            fmt_seconds(p.get("ttft_p50_s")),
            ttft99,
            fmt_seconds(p.get("e2e_p50_s")),
            fmt_seconds(p.get("e2e_p99_s")),
            fmt_millis(p.get("itl_mean_s")),
            fmt_millis(p.get("itl_p99_s")),
            str(p.get("errors", 0)),
        ]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


ROUTER_COLUMNS = (
    "policy",
    "routers",
    "hit rate",
    "of pooled ref",
    "TTFT p50",
    "TTFT p99",
    "vs 1 router",
    "prefill imb",
    "busy imb",
    "errors",
)


def routers_table(reports: Sequence[dict[str, Any]]) -> str:
    """Reports of one trace and fleet at several router counts (``kvroute replay --routers
    R``; ``setup.routers``, 1 when absent) as one table: each policy's rows by router count,
    its TTFT p99 against its own one-router run, the pooled reference from whichever report
    has it. ValueError when the reports' traces or fleets differ or no one-router run is
    among them."""
    merged = merge(reports)  # checks trace / fleet / capacity agree; finds the references
    pooled = merged.get("pooled_reference_hit_rate")
    by_count: dict[int, dict[str, dict[str, Any]]] = {}
    for r in reports:
        count = int(r.get("setup", {}).get("routers", 1))
        if count in by_count:
            raise ValueError(f"two reports with {count} router(s)")
        by_count[count] = {p["policy"]: p for p in r.get("policies", [])}
    if 1 not in by_count:
        raise ValueError("no report with one router (the rows' baseline)")
    counts = sorted(by_count)
    lines = []
    workers = merged.get("setup", {}).get("workers")
    head = f"**{workers} workers**" if workers is not None else ""
    if pooled is not None:
        head = f"{head} — pooled reference {pooled:.1%}" if head else f"pooled {pooled:.1%}"
    if head:
        lines += [head, ""]
    lines.append("| " + " | ".join(ROUTER_COLUMNS) + " |")
    lines.append("|---" + "|---:" * (len(ROUTER_COLUMNS) - 1) + "|")
    for name in by_count[1]:
        one = by_count[1][name].get("ttft_p99_s")
        for count in counts:
            p = by_count[count].get(name)
            if p is None:
                continue
            hit = p["hit_rate"]
            ttft99 = p.get("ttft_p99_s")
            vs = "-" if not one or ttft99 is None else f"{ttft99 / one - 1:+.0%}"
            row = [
                name,
                str(count),
                f"{hit:.1%}",
                f"{hit / pooled:.1%}" if pooled else "-",
                fmt_seconds(p.get("ttft_p50_s")),
                fmt_seconds(ttft99),
                vs,
                _ratio(p.get("load_imbalance")),
                _ratio(p.get("busy_imbalance")),
                str(p.get("errors", 0)),
            ]
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fleetsim.replay.markdown",
        description="Replay JSON reports as BENCHMARKS.md's Markdown tables.",
    )
    parser.add_argument("reports", nargs="+", metavar="REPORT.json")
    parser.add_argument(
        "--merge", action="store_true", help="merge every report into one table (same run)"
    )
    parser.add_argument(
        "--by-routers",
        action="store_true",
        help="one table of reports at several router counts (kvroute replay --routers R), "
        "each policy's TTFT p99 against its one-router run",
    )
    args = parser.parse_args(argv)
    try:
        loaded = [json.loads(Path(f).read_text()) for f in args.reports]
        if args.by_routers:
            print(routers_table(loaded))
            return 0
        if args.merge:
            loaded = [merge(loaded)]
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("\n\n".join(table(r) for r in loaded))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
