"""Issue 40's targets, checked on ``kvroute replay --json`` reports: BENCHMARKS.md's rows.

    python -m bench.replay_targets runs OUT.json [MORE.json ...] [--label-from-name]
    python -m bench.replay_targets pair BEFORE.json AFTER.json [--policy P ...]
    python -m bench.replay_targets routers ONE.json MANY.json [ONE.json MANY.json ...]
    python -m bench.replay_targets frontier OUT.json [MORE.json ...]

``runs``: one row per report for ``cache_aware`` against the best *other* policy on each
figure (``approx_tree`` left out: it is the same cost fed only its own routing history),
then a count of the runs that meet each target. Targets, per run: hit rate >= 95% of the
pooled reference; TTFT p99, e2e p50 and e2e p99 within 2% of the best other policy (or
better); mean inter-token latency within 5%; no errors. A missed latency target is marked
"(conflict)" when no policy that beats it by more than the margin keeps >= 95% of the
pooled reference: then two targets conflict on that run.

``pair``: each policy's figures in two reports of the same trace as "before -> after"
cells (a charge on or off, cache flushes on or off).

``routers``: cache_aware with several routers against one router on the same trace, per
pair of reports: the hit rate's difference in points and the latency figures' ratios, then
how many pairs are within issue 13's bounds (2 points of hit rate, 10% of TTFT p99) and
each figure's range.

``frontier``: where the hit-rate and e2e targets pull apart, every policy of a report as a
point (share of the pooled reference, e2e p99), the points no other beats on both (the
frontier, best hit rate first), and where cache_aware sits: on it, or behind which policy;
and whether it is the fastest of the other policies at >= 95% of pooled, approx_tree aside
(then every faster policy keeps fewer hits: the two targets conflict).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleetsim.replay.markdown import fmt_millis, fmt_seconds

POLICY = "cache_aware"
SAME_COST = ("approx_tree",)
MIN_OF_POOLED = 0.95

# (report key, label, allowed ratio to the best other policy)
LATENCY_TARGETS = (
    ("ttft_p99_s", "TTFT p99", 1.02),
    ("e2e_p50_s", "e2e p50", 1.02),
    ("e2e_p99_s", "e2e p99", 1.02),
    ("itl_mean_s", "ITL", 1.05),
)


def _fmt(key: str, x: float | None) -> str:
    return fmt_millis(x) if key.startswith("itl") else fmt_seconds(x)


@dataclass(frozen=True, slots=True)
class Figure:
    """cache_aware's value of one figure against the best other policy's."""

    label: str
    value: float
    best_policy: str
    best_value: float
    met: bool
    conflict: bool  # missed, and every policy beyond the margin is under 95% of pooled

    @property
    def ratio(self) -> float:
        return self.value / self.best_value if self.best_value else math.inf


@dataclass(frozen=True, slots=True)
class RunVerdict:
    """One run: cache_aware's share of the pooled reference, imbalances, figures, errors."""

    name: str
    of_pooled: float
    prefill_imbalance: float
    busy_imbalance: float
    errors: int
    figures: tuple[Figure, ...]

    @property
    def hit_met(self) -> bool:
        return self.of_pooled >= MIN_OF_POOLED

    @property
    def all_met(self) -> bool:
        return self.hit_met and self.errors == 0 and all(f.met for f in self.figures)


def _of_pooled(report: dict[str, Any], policy: dict[str, Any]) -> float:
    pooled = report.get("pooled_reference_hit_rate")
    if not pooled:
        raise ValueError("the report has no pooled reference (run without --no-reference)")
    return float(policy["hit_rate"]) / float(pooled)


def verdict(report: dict[str, Any], name: str) -> RunVerdict:
    """cache_aware's figures in one report against the best other policy on each; a
    ValueError when cache_aware, another policy or the pooled reference is missing."""
    by_name = {p["policy"]: p for p in report.get("policies", [])}
    if POLICY not in by_name:
        raise ValueError(f"{name}: no {POLICY} in the report")
    ours = by_name[POLICY]
    others = [p for n, p in by_name.items() if n != POLICY and n not in SAME_COST]
    if not others:
        raise ValueError(f"{name}: no other policy to compare with")
    figures = []
    for key, label, margin in LATENCY_TARGETS:
        rated = [p for p in others if p.get(key) is not None]
        best = min(rated, key=lambda p: p[key])
        value = float(ours[key])
        met = value <= margin * float(best[key])
        beyond = [p for p in rated if margin * float(p[key]) < value]
        conflict = not met and all(_of_pooled(report, p) < MIN_OF_POOLED for p in beyond)
        figures.append(Figure(label, value, best["policy"], float(best[key]), met, conflict))
    return RunVerdict(
        name=name,
        of_pooled=_of_pooled(report, ours),
        prefill_imbalance=float(ours.get("load_imbalance", math.nan)),
        busy_imbalance=float(ours.get("busy_imbalance", math.nan)),
        errors=int(ours.get("errors", 0)),
        figures=tuple(figures),
    )


def _cell(f: Figure, key: str) -> str:
    text = f"{_fmt(key, f.value)} ({f.ratio - 1:+.0%} {f.best_policy})"
    return text if f.met else f"**{text}**"


def _missed(v: RunVerdict) -> str:
    missed = [] if v.hit_met else ["hit rate"]
    missed += [f.label + (" (conflict)" if f.conflict else "") for f in v.figures if not f.met]
    if v.errors:
        missed.append("errors")
    return "met" if not missed else "missed: " + ", ".join(missed)


RUN_COLUMNS = (
    "run",
    "of pooled",
    "prefill / busy imb",
    "TTFT p99",
    "e2e p50",
    "e2e p99",
    "ITL mean",
    "errors",
    "verdict",
)


def runs_table(verdicts: Sequence[RunVerdict]) -> str:
    """One Markdown row per run (misses in bold, each cell against the best other policy)."""
    lines = ["| " + " | ".join(RUN_COLUMNS) + " |"]
    lines.append("| --- | ---: | ---: | --- | --- | --- | --- | ---: | --- |")
    for v in verdicts:
        row = [
            v.name,
            f"{v.of_pooled:.1%}" if v.hit_met else f"**{v.of_pooled:.1%}**",
            f"{v.prefill_imbalance:.2f} / {v.busy_imbalance:.2f}",
            *(_cell(f, key) for f, (key, _, _) in zip(v.figures, LATENCY_TARGETS, strict=True)),
            str(v.errors),
            _missed(v),
        ]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def summary(verdicts: Sequence[RunVerdict]) -> str:
    """How many runs meet each target, and how many misses are conflicts."""
    n = len(verdicts)
    parts = [f">= 95% of pooled on {sum(v.hit_met for v in verdicts)}/{n}"]
    for i, (_, label, margin) in enumerate(LATENCY_TARGETS):
        met = sum(v.figures[i].met for v in verdicts)
        conflicts = sum(v.figures[i].conflict for v in verdicts)
        parts.append(f"{label} (within {margin - 1:.0%}) on {met}/{n} (conflicts: {conflicts})")
    parts.append(f"no errors on {sum(v.errors == 0 for v in verdicts)}/{n}")
    parts.append(f"all targets on {sum(v.all_met for v in verdicts)}/{n}")
    return "; ".join(parts)


PAIR_KEYS = (
    ("hit_rate", "hit"),
    ("ttft_p50_s", "TTFT p50"),
    ("ttft_p99_s", "TTFT p99"),
    ("e2e_p50_s", "e2e p50"),
    ("e2e_p99_s", "e2e p99"),
    ("itl_mean_s", "ITL mean"),
    ("load_imbalance", "prefill imb"),
    ("errors", "errors"),
)


def _value(key: str, p: dict[str, Any]) -> str:
    x = p.get(key)
    if key == "hit_rate":
        return f"{x:.1%}"
    if key == "errors":
        return str(x or 0)
    if key == "load_imbalance":
        return f"{x:.2f}"
    return _fmt(key, x)


def pair_table(before: dict[str, Any], after: dict[str, Any], policies: Sequence[str]) -> str:
    """Each policy's figures as "before -> after" (one value when they are equal)."""
    b = {p["policy"]: p for p in before.get("policies", [])}
    a = {p["policy"]: p for p in after.get("policies", [])}
    names = list(policies) or [n for n in b if n in a]
    lines = ["| policy | " + " | ".join(label for _, label in PAIR_KEYS) + " |"]
    lines.append("| --- |" + " --- |" * len(PAIR_KEYS))
    for name in names:
        if name not in b or name not in a:
            raise ValueError(f"{name} is not in both reports")
        cells = []
        for key, _ in PAIR_KEYS:
            x, y = _value(key, b[name]), _value(key, a[name])
            cells.append(x if x == y else f"{x} -> {y}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def routers_row(one: dict[str, Any], many: dict[str, Any]) -> dict[str, float]:
    """cache_aware with several routers against one router: hit rate in points, the
    latency figures as ratios."""
    p1 = {p["policy"]: p for p in one.get("policies", [])}[POLICY]
    pn = {p["policy"]: p for p in many.get("policies", [])}[POLICY]
    row = {"hit_points": 100 * (pn["hit_rate"] - p1["hit_rate"])}
    for key, _, _ in LATENCY_TARGETS:
        row[key] = pn[key] / p1[key] if p1[key] else math.inf
    row["errors"] = pn.get("errors", 0)
    return row


HIT_POINTS, TTFT_RATIO = 2.0, 1.10  # issue 13's bounds for several routers against one


def routers_summary(rows: Sequence[dict[str, float]]) -> str:
    """How many pairs are within the bounds, and each figure's range over them."""
    within = sum(abs(r["hit_points"]) <= HIT_POINTS and r["ttft_p99_s"] <= TTFT_RATIO for r in rows)
    hits = [r["hit_points"] for r in rows]
    parts = [f"{within} / {len(rows)} within", f"{min(hits):+.2f}..{max(hits):+.2f} points"]
    for key, label, _ in LATENCY_TARGETS:
        ratios = [r[key] - 1 for r in rows]
        parts.append(f"{label} {min(ratios):+.1%}..{max(ratios):+.1%}")
    errors = sum(int(r["errors"]) for r in rows)
    return ", ".join(parts) + (f", {errors} errors" if errors else "")


@dataclass(frozen=True, slots=True)
class Point:
    """A policy in one report: its share of the pooled reference's hit rate, its e2e p99."""

    policy: str
    of_pooled: float
    e2e_p99_s: float


@dataclass(frozen=True, slots=True)
class FrontierRow:
    """One report's frontier (hit rate of pooled, e2e p99) and cache_aware's place."""

    name: str
    frontier: tuple[Point, ...]  # best hit rate first
    ours: Point
    beaten_by: Point | None  # the frontier point with the best hit rate among those beating ours
    fastest_at_target: bool  # the lowest e2e p99 at >= 95% of pooled (approx_tree aside)


def _beats(a: Point, b: Point) -> bool:
    """``a`` is at least as good as ``b`` on both, better on one."""
    return (
        a.of_pooled >= b.of_pooled
        and a.e2e_p99_s <= b.e2e_p99_s
        and (a.of_pooled > b.of_pooled or a.e2e_p99_s < b.e2e_p99_s)
    )


def frontier_row(report: dict[str, Any], name: str) -> FrontierRow:
    """The frontier of every policy in ``report`` (approx_tree, the same cost, among them)."""
    points = [
        Point(p["policy"], _of_pooled(report, p), float(p["e2e_p99_s"]))
        for p in report.get("policies", [])
    ]
    by_name = {pt.policy: pt for pt in points}
    if POLICY not in by_name:
        raise ValueError(f"{name}: no {POLICY} in the report")
    ours = by_name[POLICY]
    front = sorted(
        (p for p in points if not any(_beats(q, p) for q in points)),
        key=lambda p: (-p.of_pooled, p.e2e_p99_s),
    )
    beating = [p for p in front if _beats(p, ours)]
    at_target = [p for p in points if p.of_pooled >= MIN_OF_POOLED and p.policy not in SAME_COST]
    fastest = bool(at_target) and ours.e2e_p99_s <= min(p.e2e_p99_s for p in at_target)
    return FrontierRow(name, tuple(front), ours, beating[0] if beating else None, fastest)


def _point(p: Point) -> str:
    return f"{p.policy} {p.of_pooled:.1%} / {fmt_seconds(p.e2e_p99_s)}"


def frontier_table(rows: Sequence[FrontierRow]) -> str:
    lines = [
        "| run | frontier (of pooled / e2e p99, best hit rate first) | cache_aware |",
        "| --- | --- | --- |",
    ]
    for r in rows:
        where = "on it" if r.beaten_by is None else f"behind {_point(r.beaten_by)}"
        if r.fastest_at_target:
            where += "; the fastest at >= 95% of pooled"
        front = ", ".join(_point(p) for p in r.frontier)
        lines.append(f"| {r.name} | {front} | {_point(r.ours)}: {where} |")
    on = sum(r.beaten_by is None for r in rows)
    fastest = sum(r.fastest_at_target for r in rows)
    n = len(rows)
    lines.append("")
    lines.append(
        f"cache_aware on the frontier in {on}/{n} runs; "
        f"the fastest policy at >= 95% of pooled in {fastest}/{n}"
    )
    return "\n".join(lines)


def _load(path: str) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.replay_targets", description=__doc__.split("\n\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    runs = sub.add_parser("runs", help="cache_aware against the best other policy, per run")
    runs.add_argument("reports", nargs="+", metavar="REPORT.json")
    pair = sub.add_parser("pair", help="every policy, before -> after")
    pair.add_argument("before")
    pair.add_argument("after")
    pair.add_argument("--policy", action="append", default=[])
    routers = sub.add_parser("routers", help="several routers against one, cache_aware")
    routers.add_argument("pairs", nargs="+", metavar="ONE.json MANY.json")
    frontier = sub.add_parser("frontier", help="hit rate vs e2e p99: the frontier, per run")
    frontier.add_argument("reports", nargs="+", metavar="REPORT.json")
    args = parser.parse_args(argv)
    try:
        if args.command == "runs":
            verdicts = [verdict(_load(f), Path(f).stem) for f in args.reports]
            print(runs_table(verdicts) + "\n\n" + summary(verdicts))
        elif args.command == "frontier":
            print(frontier_table([frontier_row(_load(f), Path(f).stem) for f in args.reports]))
        elif args.command == "pair":
            print(pair_table(_load(args.before), _load(args.after), args.policy))
        else:
            if len(args.pairs) % 2:
                raise ValueError("routers takes pairs: a one-router report, then its match")
            rows = []
            for one, many in zip(args.pairs[::2], args.pairs[1::2], strict=True):
                rows.append(routers_row(_load(one), _load(many)))
                print(Path(many).stem, json.dumps({k: round(v, 4) for k, v in rows[-1].items()}))
            print(routers_summary(rows))
    except (OSError, ValueError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
