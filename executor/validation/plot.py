"""The validation scatter plot: predicted against measured step time and peak memory, y = x drawn."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from executor.validation.metrics import Comparison, Summary


def scatter_png(rows: Sequence[Comparison], summary: Summary, path: str | Path, *, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(12, 5.4))
    panels = (
        ("step time (ms)", [r.predicted_step_s * 1e3 for r in rows], [r.measured_step_s * 1e3 for r in rows],
         f"MAPE {summary.step_mape_pct:.1f}%, Kendall tau {summary.step_kendall_tau:.2f}"),
        ("peak memory (MiB, context excluded)", [r.predicted_memory_bytes / 2**20 for r in rows],
         [r.measured_memory_bytes / 2**20 for r in rows], f"MAPE {summary.memory_mape_pct:.1f}%"),
    )
    for ax, (label, predicted, measured, note) in zip(axes, panels):
        ax.scatter(measured, predicted, s=36, color="tab:blue", zorder=3)
        for r, x, y in zip(rows, measured, predicted):
            ax.annotate(r.name, (x, y), fontsize=7, xytext=(4, 3), textcoords="offset points")
        top = max(max(predicted), max(measured)) * 1.1
        ax.plot([0, top], [0, top], color="grey", linestyle="--", linewidth=1, label="y = x")
        ax.set_xlim(0, top)
        ax.set_ylim(0, top)
        ax.set_xlabel(f"measured {label}")
        ax.set_ylabel(f"predicted {label}")
        ax.set_title(note, fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="upper left", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
