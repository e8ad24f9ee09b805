"""Activation peak of each pipeline rank, read off the schedule's action order.

One rule for the estimator (`planner.estimate`) and the simulator (`costmodel.simulator.result`): a
rank runs its compute actions one after the other in the schedule's order (`costmodel.schedule`), so
which micro-batches hold activations at any moment follows from that order alone, not from timing.

Per stage s (its chunks c_1..c_n in forward order, each keeping k_i bytes from its forward to its
backward and re-materializing a window w_i while its backward recomputes; `StageActivations`):
    kept_s          = sum_i k_i                       what one micro-batch holds between F and B
    backward_peak_s = max_i (k_1 + ... + k_i + w_i)    the most one micro-batch holds during its backward:
                                                        chunk i recomputes after chunks i+1..n have
                                                        freed theirs
    window_s        = max_i w_i                        the largest window (an input-gradient pass frees
                                                        nothing, so every chunk's kept bytes stay)
Walking rank r's actions, with live = sum over in-flight (stage, micro-batch) of kept_s:
    F(s):  live += kept_s;  peak = max(peak, live)
    B(s):  peak = max(peak, live - kept_s + max(kept_s, backward_peak_s));  live -= kept_s
    I(s):  peak = max(peak, live + window_s): the activations stay until W (zero-bubble: W still
           needs the saved inputs)
    W(s):  live -= kept_s
`stage_activations` computes the three per stage, for the simulator's chunks and the estimator's layers
alike. Every point is linear in them, so `_peak_points` records, once per schedule, the distinct
in-flight count vectors at forward points and (counts, stage) pairs at backward and input-gradient
points, over the rank's own stages only (O(v) per action, not O(pp v)); `rank_activation_peaks` evaluates
them for any stage sizes with three matrix products. Without a
pipeline (one stage, one micro-batch at a time) the peak is max(kept, backward_peak).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from costmodel.schedule import B, F, I, W, PipelineSchedule, compute_order


@dataclass(frozen=True)
class StageActivations:
    """Activation bytes of one stage for one micro-batch (see the module docstring)."""

    kept: float
    backward_peak: float
    window: float = 0.0


def stage_activations(kept: Sequence[float], windows: Sequence[float], bounds: Sequence[int]
                      ) -> tuple[StageActivations, ...]:
    """Each stage's `StageActivations` from its chunks' kept bytes and recompute windows, all chunks of all
    stages in forward order, stage k holding chunks bounds[k]..bounds[k+1]-1 (every stage at least one)."""
    kept_c, window_c = np.asarray(kept, dtype=float), np.asarray(windows, dtype=float)
    cumulative = np.cumsum(kept_c)
    starts, ends = np.asarray(bounds[:-1]), np.asarray(bounds[1:])
    base = np.where(starts > 0, cumulative[np.maximum(starts - 1, 0)], 0.0)
    kept_s = cumulative[ends - 1] - base
    peak_s = np.maximum.reduceat(cumulative + window_c, starts) - base
    window_s = np.maximum.reduceat(window_c, starts)
    return tuple(StageActivations(float(k), float(p), float(w)) for k, p, w in zip(kept_s, peak_s, window_s))


@dataclass(frozen=True)
class _RankPoints:
    own: np.ndarray
    """The stages this rank runs: the count vectors' columns (a rank holds no other stage's activations)."""
    forward: np.ndarray
    """Distinct in-flight count vectors (rows, one column per own stage) right after a forward."""
    backward: np.ndarray
    """Distinct in-flight count vectors at the start of a backward (the micro-batch included)."""
    backward_stage: np.ndarray
    """The stage each row of `backward` runs."""
    input_grad: np.ndarray
    """Distinct in-flight count vectors during an input-gradient pass (I)."""
    input_stage: np.ndarray


@functools.lru_cache(maxsize=512)
def _peak_points(name: str, pp: int, microbatches: int, stages_per_rank: int) -> tuple[_RankPoints, ...]:
    out = []
    for actions in compute_order(name, pp, microbatches, stages_per_rank):
        own = sorted({a.stage for a in actions})
        column = {stage: i for i, stage in enumerate(own)}
        width = len(own)
        counts = [0] * width
        forward: set[tuple[int, ...]] = set()
        backward: set[tuple[tuple[int, ...], int]] = set()
        input_grad: set[tuple[tuple[int, ...], int]] = set()
        for a in actions:
            kind = a.kind
            if kind is F:
                counts[column[a.stage]] += 1
                forward.add(tuple(counts))
            elif kind is B:
                backward.add((tuple(counts), a.stage))
                counts[column[a.stage]] -= 1
            elif kind is I:
                input_grad.add((tuple(counts), a.stage))
            elif kind is W:
                counts[column[a.stage]] -= 1
        back, inputs = sorted(backward), sorted(input_grad)
        out.append(_RankPoints(
            own=np.array(own, dtype=int),
            forward=np.array(sorted(forward), dtype=float).reshape(-1, width),
            backward=np.array([c for c, _ in back], dtype=float).reshape(-1, width),
            backward_stage=np.array([s for _, s in back], dtype=int),
            input_grad=np.array([c for c, _ in inputs], dtype=float).reshape(-1, width),
            input_stage=np.array([s for _, s in inputs], dtype=int),
        ))
    return tuple(out)


def rank_activation_peaks(schedule: PipelineSchedule, stages: Sequence[StageActivations]) -> tuple[float, ...]:
    """Peak activation bytes of each pipeline rank of `schedule` (see the module docstring)."""
    return activation_peaks(schedule.name, schedule.pp, schedule.num_microbatches, schedule.stages_per_rank, stages)


def activation_peaks(name: str, pp: int, microbatches: int, stages_per_rank: int,
                     stages: Sequence[StageActivations]) -> tuple[float, ...]:
    """`rank_activation_peaks` of the schedule `build_schedule(name, pp, microbatches, stages_per_rank)`,
    without building it: the points come from its compute order alone (`_peak_points`, memoized)."""
    if len(stages) != pp * stages_per_rank:
        raise ValueError(f"{len(stages)} stage activations for a schedule of {pp * stages_per_rank} stages")
    kept = np.array([s.kept for s in stages], dtype=float)
    extra = np.array([max(0.0, s.backward_peak - s.kept) for s in stages], dtype=float)
    window = np.array([s.window for s in stages], dtype=float)
    peaks = []
    for points in _peak_points(name, pp, microbatches, stages_per_rank):
        peak = 0.0
        own_kept = kept[points.own]
        if len(points.forward):
            peak = float((points.forward @ own_kept).max())
        if len(points.backward):
            peak = max(peak, float((points.backward @ own_kept + extra[points.backward_stage]).max()))
        if len(points.input_grad):
            peak = max(peak, float((points.input_grad @ own_kept + window[points.input_stage]).max()))
        peaks.append(peak)
    return tuple(peaks)
