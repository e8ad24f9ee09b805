"""Show a simulated step: Chrome trace JSON (Perfetto) and a Gantt chart PNG with memory beneath.

Chrome trace (`chrome_trace`): one process per pipeline rank (pid = rank, named with its stages),
one thread per stream (tid: 0 compute, 1 tp-comm, 2 dp-comm, 3 pp-p2p); every task is a complete
("X") event in microseconds. A pipeline transfer appears twice, as `send` on the sender's pp-p2p
thread and `recv` on the receiver's, joined by a flow ("s" on the send, "f" on the recv, both at the
transfer's midpoint so each binds to its enclosing slice). Memory per rank is a counter track ("C", GiB).

Gantt chart (`gantt_png`): one row per pipeline rank; its compute lane shows forward (blue), backward
(green; input-gradient orange and weight-gradient olive when split) and the optimizer (purple), one
bar per schedule action from its first chunk's start to its last chunk's end (the activation
collectives it waits for inside are in the tp-comm lane), labelled with the micro-batch; thin lanes
beneath show tp-comm, dp-comm and pp-p2p. Below, memory
over time per rank. Drawn with matplotlib's Agg backend (no display needed) into memory, then
written atomically (`tracer.files.write_atomic`): a crash never leaves half a PNG.
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterable
from typing import Any

from costmodel.simulator.engine import STREAMS
from costmodel.simulator.result import GIB, SimResult, TimelineEvent
from tracer.files import write_atomic

_ACTION = re.compile(r"^(\d+)([FBIW])(\d+)\b")
COLORS = {"F": "#4C72B0", "B": "#55A868", "I": "#DD8452", "W": "#8C8C3C", "optimizer": "#8172B3",
          "tp-comm": "#C44E52", "dp-comm": "#937860", "pp-p2p": "#DA8BC3"}


def _tid(stream: str) -> int:
    return STREAMS.index(stream)


def chrome_trace(result: SimResult, *, stage_names: dict[int, str] | None = None) -> dict[str, Any]:
    """The trace as a JSON-ready dict (write it with json.dump)."""
    events: list[dict[str, Any]] = []
    for m in result.memory:
        label = stage_names.get(m.rank) if stage_names else None
        name = f"pipeline rank {m.rank} (stage{'s' if len(m.stages) > 1 else ''} {', '.join(map(str, m.stages))})"
        events.append({"ph": "M", "name": "process_name", "pid": m.rank, "args": {"name": label or name}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": m.rank, "args": {"sort_index": m.rank}})
        for stream in STREAMS:
            events.append({"ph": "M", "name": "thread_name", "pid": m.rank, "tid": _tid(stream), "args": {"name": stream}})
        for time, total in m.timeline:
            events.append({"ph": "C", "name": "memory", "pid": m.rank, "ts": time * 1e6, "args": {"GiB": total / GIB}})
    for e in result.events:
        events.append(_slice(e, e.rank, e.name if e.flow is None else f"send {e.name.split(' ', 2)[-1]}"))
        if e.flow is not None and e.peer is not None:
            events.append(_slice(e, e.peer, f"recv {e.name.split(' ', 2)[-1]}"))
            middle = (e.start + e.end) / 2 * 1e6  # inside both slices, so each flow end binds to its slice
            events.append({"ph": "s", "id": e.flow, "name": "p2p", "cat": "pp", "pid": e.rank, "tid": _tid(e.stream), "ts": middle})
            events.append({"ph": "f", "bp": "e", "id": e.flow, "name": "p2p", "cat": "pp", "pid": e.peer, "tid": _tid(e.stream), "ts": middle})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"step_time_s": result.step_time_s}}


def _slice(e: TimelineEvent, pid: int, name: str) -> dict[str, Any]:
    return {"ph": "X", "name": name, "cat": e.category, "pid": pid, "tid": _tid(e.stream),
            "ts": e.start * 1e6, "dur": max(e.end - e.start, 0.0) * 1e6}


def _actions(events: Iterable[TimelineEvent]) -> dict[tuple[int, str], list[float]]:
    """Span of each compute action per rank: (rank, '2F0') -> [start, end]."""
    spans: dict[tuple[int, str], list[float]] = {}
    for e in events:
        match = _ACTION.match(e.name) if e.stream == "compute" else None
        if match:
            span = spans.setdefault((e.rank, match[0]), [e.start, e.end])
            span[0], span[1] = min(span[0], e.start), max(span[1], e.end)
    return spans


def gantt_png(result: SimResult, path: str, *, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ranks = len(result.memory)
    scale, unit = (1e3, "ms") if result.step_time_s < 1 else (1.0, "s")
    fig, (ax, mem_ax) = plt.subplots(2, 1, figsize=(12, 2.0 + 0.9 * ranks + 2.2), sharex=True,
                                     gridspec_kw={"height_ratios": [0.9 * ranks + 0.6, 2.2]})
    lane = {"compute": (0.0, 0.5), "tp-comm": (0.52, 0.12), "dp-comm": (0.66, 0.12), "pp-p2p": (0.80, 0.12)}
    for e in result.events:  # communication lanes, and the optimizer on the compute lane
        if e.stream != "compute" or e.category == "optimizer":
            offset, height = lane[e.stream]
            color = COLORS["optimizer"] if e.category == "optimizer" else COLORS.get(e.stream, "grey")
            ax.broken_barh([(e.start * scale, (e.end - e.start) * scale)], (e.rank + offset, height), facecolors=color, linewidth=0)
    for (rank, label), (start, end) in _actions(result.events).items():  # one bar per action, gaps inside it included
        kind = _ACTION.match(label)[2]
        ax.broken_barh([(start * scale, (end - start) * scale)], (rank, 0.5), facecolors=COLORS[kind],
                       edgecolors="white", linewidth=0.6)
        if (end - start) / result.step_time_s > 0.012:
            ax.text((start + end) / 2 * scale, rank + 0.25, re.sub(r"^\d+", "", label), ha="center", va="center",
                    fontsize=7, color="white")
    ax.set_ylim(ranks, -0.1)
    ax.set_yticks([r + 0.45 for r in range(ranks)])
    ax.set_yticklabels([f"rank {m.rank}\nstage {','.join(map(str, m.stages))}" for m in result.memory], fontsize=8)
    ax.legend(handles=[Patch(color=COLORS[k], label=k if len(k) > 1 else {"F": "forward", "B": "backward", "I": "backward (input)", "W": "backward (weight)"}[k])
                       for k in COLORS], loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=8, fontsize=7, frameon=False)
    b = result.breakdown
    ax.set_title(title or f"step {result.step_time_s * scale:.3g} {unit}: compute {b.compute * scale:.3g}, bubble {b.bubble * scale:.3g}, "
                 f"exposed comm {b.exposed_comm * scale:.3g}, optimizer {b.optimizer * scale:.3g} ({unit}, critical rank {result.critical_rank})",
                 fontsize=9)
    for m in result.memory:
        xs = [t * scale for t, _ in m.timeline] + [result.step_time_s * scale]
        ys = [v / GIB for _, v in m.timeline]
        mem_ax.step(xs, ys + ys[-1:], where="post", label=f"rank {m.rank}")
    mem_ax.set_ylabel("memory (GiB)")
    mem_ax.set_xlabel(f"time ({unit})")
    mem_ax.legend(fontsize=7, ncol=min(ranks, 8), loc="lower right")
    mem_ax.grid(alpha=0.3)
    fig.tight_layout()
    image = io.BytesIO()
    fig.savefig(image, format="png", dpi=110)
    plt.close(fig)
    write_atomic(path, image.getvalue(), what="--png")
