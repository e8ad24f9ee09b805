"""How `soap compare` shows a `planner.compare.Comparison`: rich tables and a tokens/s-against-cost picture.

`render_comparison` prints the ranking (one row per cluster at its headline count: the plan, step time,
tokens/s, MFU, memory, time and cost to train the tokens, cost per million tokens, and under `--gpus auto`
the smallest count that fits, the best count per GPU and the knee), then, under `--gpus auto`, each
cluster's scaling curve, and the prices with their dates and sources (never presented as current).
`comparison_png` draws tokens/s against cost per million tokens, one labelled point per cluster and GPU
count, a line through each cluster's counts.
"""

from __future__ import annotations

import math
import sys
from typing import Any

from planner.compare import Comparison, ClusterResult, Point
from planner.report import describe

GIB = 2**30


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "-"
    for unit, size in (("y", 365 * 86400.0), ("d", 86400.0), ("h", 3600.0)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds / 60:.1f} min"


def _usd(value: float) -> str:
    if not math.isfinite(value):
        return "-"
    return f"${value:,.0f}" if value >= 100 else f"${value:.3g}" if value < 1 else f"${value:,.2f}"


def _counts(r: ClusterResult) -> str:
    if r.min_gpus is None:
        return "-"
    return f"{r.min_gpus} / {r.best_per_gpu} / {r.knee}{'' if r.knee_reached else '+'}"


def render_comparison(comparison: Comparison) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(file=sys.stdout, highlight=False)
    if not console.is_terminal:
        console.width = 160
    auto = comparison.gpus is None
    how_many = (f"GPU counts searched up to {comparison.max_gpus}; each cluster at its knee" if auto
                else f"{comparison.gpus} GPUs each")
    console.print(f"[bold]{comparison.model}[/bold], {comparison.tokens:.3g} tokens at sequence length "
                  f"{comparison.seq_len}: {how_many}; ranked by cost per million tokens")
    table = Table(title="Clusters, cheapest per token first", title_justify="left",
                  caption="min / best per GPU / knee: the smallest count that fits, the count with the most tokens/s "
                  "per GPU, the last count before a doubling gains < 60% (+: not reached by the cap)" if auto else None,
                  caption_justify="left")
    if not auto:
        table.caption = "the smallest count that fits, the best count per GPU and the knee: --gpus auto"
    columns = ["#", "cluster", "GPUs", "plan", "step s", "tokens/s", "MFU", "GiB/GPU", "train time", "$/M tokens",
               "train cost"] + (["min / best / knee"] if auto else [])
    for col in columns:
        table.add_column(col, justify="left" if col in ("cluster", "plan") else "right")
    for rank, r in enumerate(comparison.clusters, start=1):
        p = r.chosen
        if p is None:
            reason = next((q.error for q in r.points[::-1] if q.error), "no plan")
            table.add_row(str(rank), r.name, str(comparison.gpus or "-"), f"does not fit: {reason[:80]}",
                          *["-"] * (len(columns) - 4))
            continue
        m = p.report.chosen.result.to_contract()
        cost = p.cost_per_million(r.price)
        row = [str(rank), r.name, str(p.gpus), describe(p.report.chosen), f"{m['step_time_s']:.2f}",
               f"{m['tokens_per_s']:,.0f}", f"{100 * m['mfu']:.1f}%", f"{m['peak_memory_gib']:.1f}",
               _duration(p.train_time_s(comparison.tokens)), _usd(cost), _usd(cost * comparison.tokens / 1e6)]
        table.add_row(*row, *([_counts(r)] if auto else []))
    console.print(table)
    if auto:
        _render_scaling(console, comparison)
    prices = Table(title="Prices used (USD per GPU-hour; dated defaults, not current quotes: pass --price for yours)",
                   title_justify="left")
    for col in ("cluster", "$/GPU-h", "as of", "source"):
        prices.add_column(col, justify="right" if col == "$/GPU-h" else "left")
    for r in comparison.clusters:
        prices.add_row(r.name, f"{r.price.usd_per_gpu_hour:.2f}", r.price.as_of, r.price.source)
    console.print(prices)


def _render_scaling(console: Any, comparison: Comparison) -> None:
    from rich.table import Table

    table = Table(title="Scaling: every count searched", title_justify="left")
    for col in ("cluster", "GPUs", "tokens/s", "tokens/s per GPU", "gain over half", "$/M tokens", "train time", "plan"):
        table.add_column(col, justify="left" if col in ("cluster", "plan") else "right")
    for r in comparison.clusters:
        fitting = {p.gpus: p for p in r.points if p.fits}
        for p in r.points:
            if not p.fits:
                table.add_row(r.name, str(p.gpus), "-", "-", "-", "-", "-", "does not fit")
                continue
            half = fitting.get(p.gpus // 2) if p.gpus % 2 == 0 else None
            gain = f"{p.tokens_per_s / half.tokens_per_s:.2f}x" if half else "-"
            table.add_row(r.name, str(p.gpus), f"{p.tokens_per_s:,.0f}", f"{p.tokens_per_s / p.gpus:,.0f}", gain,
                          _usd(p.cost_per_million(r.price)), _duration(p.train_time_s(comparison.tokens)),
                          describe(p.report.chosen))
    console.print(table)


def _label(r: ClusterResult, p: Point) -> str:
    return f"{r.name} x{p.gpus}"


def comparison_png(comparison: Comparison, path: str) -> None:
    """Tokens/s (y) against cost per million tokens (x), log-log, one labelled point per cluster and count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 6), dpi=120)
    for r in comparison.clusters:
        points = [p for p in r.points if p.fits]
        if not points:
            continue
        xs = [p.cost_per_million(r.price) for p in points]
        ys = [p.tokens_per_s for p in points]
        (line,) = ax.plot(xs, ys, marker="o", label=f"{r.name} (${r.price.usd_per_gpu_hour:.2f}/GPU-h)")
        for p, x, y in zip(points, xs, ys):
            ax.annotate(_label(r, p), (x, y), textcoords="offset points", xytext=(5, 3), fontsize=7,
                        color=line.get_color())
        chosen = r.chosen
        if chosen is not None:
            ax.plot([chosen.cost_per_million(r.price)], [chosen.tokens_per_s], marker="*", markersize=14,
                    color=line.get_color(), linestyle="none")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("cost per million tokens, USD (lower is cheaper)")
    ax.set_ylabel("tokens/s (higher is faster)")
    ax.set_title(f"{comparison.model}: throughput against cost (soap compare; * = ranked count)", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
