"""``--plot OUT.png``: hit rate and TTFT p99 per policy, side by side, bounds as lines.

matplotlib (the ``bench`` extra) with the Agg backend, imported only when a plot is asked for.
"""

from __future__ import annotations

import math
from pathlib import Path

from bench.replay.report import ReplayReport


def plot_report(report: ReplayReport, path: str | Path, title: str | None = None) -> Path:
    """Draw the report's policies into a PNG at ``path``; returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [p.policy for p in report.policies]
    hits = [p.hit_rate * 100 for p in report.policies]
    ttft = [0.0 if math.isnan(p.ttft_p99_s) else p.ttft_p99_s for p in report.policies]
    colors = ["tab:green" if n == "cache_aware" else "tab:blue" for n in names]

    fig, (ax_hit, ax_ttft) = plt.subplots(1, 2, figsize=(max(8.0, 1.3 * len(names) + 4), 4.2))
    x = range(len(names))
    ax_hit.bar(x, hits, color=colors)
    for value, style, label in (
        (report.pooled_hit_rate, "--", "pooled bound"),
        (report.infinite_hit_rate, ":", "infinite bound"),
    ):
        if value is not None:
            ax_hit.axhline(value * 100, color="black", linestyle=style, linewidth=1, label=label)
    if report.pooled_hit_rate is not None or report.infinite_hit_rate is not None:
        ax_hit.legend(loc="upper right", fontsize=8)
    ax_hit.set_ylabel("prefix cache hit rate (%)")
    ax_hit.set_ylim(0, 100)
    ax_hit.set_title("hit rate (higher is better)")
    for i, h in enumerate(hits):
        ax_hit.text(i, h + 1, f"{h:.1f}", ha="center", fontsize=8)

    ax_ttft.bar(x, ttft, color=colors)
    positive = [t for t in ttft if t > 0]
    if positive and max(positive) > 50 * min(positive):
        ax_ttft.set_yscale("log")  # one outlier must not flatten the others
    ax_ttft.set_ylabel("TTFT p99 (s)")
    ax_ttft.set_title("TTFT p99 (lower is better)")
    for i, t in enumerate(ttft):
        ax_ttft.text(i, t, f"{t:.2f}", ha="center", va="bottom", fontsize=8)

    for ax in (ax_hit, ax_ttft):
        ax.set_xticks(list(x))
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    setup = report.setup
    fig.suptitle(
        title
        or f"{Path(str(setup.get('trace', ''))).name}: {setup.get('workers')} workers, "
        f"{setup.get('mode')} mode"
    )
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
