"""``--plot OUT.png``: hit rate, TTFT p99 and imbalance per policy, side by side.

The hit-rate panel draws the pooled reference and the infinite ceiling as lines; the
imbalance panel shows prefill and busy-time imbalance (max / mean) next to each other. A
policy with failed requests gets its error count under its name on every panel: hit rate
and latency are measured over completed requests only, so the count must be seen with them.

matplotlib (the ``bench`` extra) with the Agg backend, imported only when a plot is asked for.
"""

from __future__ import annotations

import math
from pathlib import Path

from fleetsim.replay.report import PolicyReport, ReplayReport


def policy_label(p: PolicyReport) -> str:
    """A policy's axis label: its name, and its error count when it has any."""
    if not p.errors:
        return p.policy
    return f"{p.policy}\n({p.errors} error{'s' if p.errors != 1 else ''})"


def plot_report(report: ReplayReport, path: str | Path, title: str | None = None) -> Path:
    """Draw the report's policies into a PNG at ``path``; returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [policy_label(p) for p in report.policies]
    hits = [p.hit_rate * 100 for p in report.policies]
    ttft = [0.0 if math.isnan(p.ttft_p99_s) else p.ttft_p99_s for p in report.policies]
    colors = ["tab:green" if p.policy == "cache_aware" else "tab:blue" for p in report.policies]

    fig, (ax_hit, ax_ttft, ax_imb) = plt.subplots(
        3, 1, figsize=(max(8.0, 0.8 * len(names) + 3), 12.0)
    )
    x = range(len(names))
    ax_hit.bar(x, hits, color=colors)
    for value, style, label in (
        (
            report.pooled_reference_hit_rate,
            "--",
            "pooled reference" + report.reference_errors_note("pooled"),
        ),
        (
            report.infinite_hit_rate,
            ":",
            "infinite ceiling" + report.reference_errors_note("infinite"),
        ),
    ):
        if value is not None:
            ax_hit.axhline(value * 100, color="black", linestyle=style, linewidth=1, label=label)
    if report.pooled_reference_hit_rate is not None or report.infinite_hit_rate is not None:
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

    width = 0.4
    prefill = [p.load_imbalance for p in report.policies]
    busy = [math.nan if p.busy_imbalance is None else p.busy_imbalance for p in report.policies]
    ax_imb.bar([i - width / 2 for i in x], prefill, width, color="tab:orange", label="prefill")
    ax_imb.bar([i + width / 2 for i in x], busy, width, color="tab:purple", label="busy time")
    ax_imb.axhline(1.0, color="black", linewidth=0.8)
    ax_imb.set_ylabel("max / mean per worker")
    ax_imb.set_title("imbalance (1.0 = even)")
    ax_imb.legend(loc="upper right", fontsize=8)
    finite = [v for v in (*prefill, *busy) if not math.isnan(v)]
    if finite and max(finite) > 4:
        ax_imb.set_yscale("log")

    for ax in (ax_hit, ax_ttft, ax_imb):
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
