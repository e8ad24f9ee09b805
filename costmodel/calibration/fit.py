"""Fitting microbenchmark timings to profile numbers: pure functions over arrays.

Models (the cost model's; `costmodel.opcost` and `costmodel.collectives` implement them):
- compute:   t = flops / (peak[precision] · e_mm(flops)) + overhead, with e_mm a curve in log(flops);
- memory:    t = bytes / (bandwidth · e_mem(bytes)) + overhead, with e_mem a curve in log(bytes);
- collective (alpha-beta, nccl-tests' bus bandwidth):
             t = steps(kind, n) · alpha + busfactor(kind, n) · nbytes / beta,
  and beyond it, per message size, an efficiency curve e(nbytes) on beta.

Fitting, in two stages:
1. Closed form (this module). `alpha_beta` is least squares on relative residuals
   Σ ((steps·alpha + bus_bytes/beta − t) / t)², so microseconds and seconds weigh alike, with both
   terms kept non-negative. `efficiency_points` inverts the model per sample
   (e = work / (rate · (t − fixed))) and takes the median efficiency around each knot of a log grid
   (a factor 4 apart), clipped to (floor, 1].
2. Refinement through the cost function itself (`refine_knots`): coordinate descent on each knot's
   value, minimising the mean |log(predicted / measured)| over the fit set, where `predicted` comes
   from the very function the simulator calls. Whatever the cost model does beyond the closed form
   (a roofline max, per-kind treatment, latency steps), the knots absorb it, and the held-out points
   check that they generalise rather than memorise.
3. Factor curves (`fit_factor_curve`): where one kind of work (a kernel class at a precision, a
   collective at a group size) departs from the shared curves, a positive multiplier k(x) on a log grid
   of its own sizes is fitted the same way (coordinate descent on mean |log(predicted / measured)|
   through the cost function, starting from the median measured/predicted ratio) and stored in the
   profile as data (`kernel_factors`, `collective_factors`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

EFFICIENCY_FLOOR = 1e-4
"""Lowest efficiency a fitted knot may take (profiles require efficiencies in (0, 1])."""


@dataclass(frozen=True)
class AlphaBeta:
    alpha_s: float
    """Latency per step, seconds."""
    beta: float
    """Bandwidth, bytes/s."""


def alpha_beta(steps: Sequence[float], bus_bytes: Sequence[float], seconds: Sequence[float]) -> AlphaBeta:
    """Least-squares alpha and beta on relative residuals (see the module docstring)."""
    s, x, t = (np.asarray(v, dtype=float) for v in (steps, bus_bytes, seconds))
    if len(t) < 2:
        raise ValueError("alpha-beta needs at least two timings")
    design = np.stack([s / t, x / t], axis=1)
    coef, *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    alpha, inv_beta = coef
    if alpha < 0:  # bandwidth alone explains the data
        alpha, inv_beta = 0.0, float(np.sum(x / t) / np.sum((x / t) ** 2))
    if inv_beta <= 0:  # latency alone explains the data: take the bandwidth of the largest message
        alpha = float(np.sum(s / t) / np.sum((s / t) ** 2))
        big = int(np.argmax(x))
        inv_beta = max(t[big] - s[big] * alpha, t[big] * 1e-3) / x[big]
    return AlphaBeta(alpha_s=float(alpha), beta=float(1.0 / inv_beta))


def efficiency_points(xs: Sequence[float], effs: Sequence[float], *, step: float = 4.0) -> tuple[tuple[float, float], ...]:
    """Knots on a log grid x0·step^k over the data (x0 the smallest x), each the median efficiency of the
    points within a factor √step of it; knots with no points are left out."""
    x = np.asarray(xs, dtype=float)
    e = np.clip(np.asarray(effs, dtype=float), EFFICIENCY_FLOOR, 1.0)
    if len(x) == 0:
        raise ValueError("no points to fit a curve to")
    pos = np.log(x / x.min()) / math.log(step)
    nearest = np.floor(pos + 0.5).astype(int)
    knots = []
    for k in sorted(set(nearest.tolist())):
        knots.append((float(x.min() * step**k), float(np.median(e[nearest == k]))))
    return tuple(knots)


def mean_abs_log_error(predicted: Sequence[float], measured: Sequence[float]) -> float:
    p, m = np.asarray(predicted, dtype=float), np.asarray(measured, dtype=float)
    return float(np.mean(np.abs(np.log(p / m))))


def abs_pct_errors(predicted: Sequence[float], measured: Sequence[float]) -> np.ndarray:
    """|predicted − measured| / measured, per point, in percent."""
    p, m = np.asarray(predicted, dtype=float), np.asarray(measured, dtype=float)
    return np.abs(p - m) / m * 100.0


def refine_knots(values: Sequence[float], objective: Callable[[Sequence[float]], float], *,
                 bounds: Sequence[tuple[float, float]], passes: int = 3, factors: Sequence[float] | None = None
                 ) -> tuple[float, ...]:
    """Coordinate descent: scale one value at a time by the best of `factors`, within `bounds`.

    `objective(values)` is minimised; `bounds[i]` bounds value i. The step shrinks each pass, so the
    search narrows from a 4x range to a few percent.
    """
    current = [float(v) for v in values]
    best = objective(current)
    base = factors or (0.25, 0.4, 0.55, 0.7, 0.8, 0.9, 0.95, 1.05, 1.1, 1.25, 1.4, 1.8, 2.5, 4.0)
    for p in range(passes):
        shrink = 1.0 / (p + 1)
        for i in range(len(current)):
            lo, hi = bounds[i]
            for f in base:
                trial_value = min(hi, max(lo, current[i] * math.exp(math.log(f) * shrink)))
                if trial_value == current[i]:
                    continue
                trial = current.copy()
                trial[i] = trial_value
                score = objective(trial)
                if score < best:
                    best, current = score, trial
    return tuple(current)


def golden_section(loss: Callable[[float], float], low: float, high: float, steps: int) -> float:
    """The minimum of a unimodal `loss` on [low, high] by golden-section search, `steps` narrowings."""
    golden = (math.sqrt(5) - 1) / 2
    a, b = high - golden * (high - low), low + golden * (high - low)
    fa, fb = loss(a), loss(b)
    for _ in range(steps):
        if fa <= fb:
            high, b, fb = b, a, fa
            a = high - golden * (high - low)
            fa = loss(a)
        else:
            low, a, fa = a, b, fb
            b = low + golden * (high - low)
            fb = loss(b)
    return (a + b) / 2


FACTOR_BOUNDS = (1e-3, 1000.0)
"""Range a fitted time factor may take (the profile loader accepts (0, 1000])."""
FACTOR_NEEDED = 0.05
"""Mean |log(predicted / measured)| below which the shared curves already fit and no factor is stored."""


def fit_factor_curve(xs: Sequence[float], measured: Sequence[float],
                     price: Callable[[tuple[tuple[float, float], ...]], Sequence[float]]
                     ) -> tuple[tuple[float, float], ...] | None:
    """A factor curve [(x, k), ...] on the log grid of `xs` (a factor 4 apart) minimising the mean
    |log(price(curve) / measured)|; `price(curve)` predicts every point with that curve in the profile.
    None when the shared curves alone are within `FACTOR_NEEDED` (a curve would only fit noise)."""
    grid = [x for x, _ in efficiency_points(xs, [1.0] * len(xs))]
    if mean_abs_log_error(price(((grid[0], 1.0),)), measured) < FACTOR_NEEDED:
        return None
    start = float(np.median(np.asarray(measured) / np.asarray(price(((grid[0], 1.0),)))))
    start = min(max(start, FACTOR_BOUNDS[0]), FACTOR_BOUNDS[1])

    def objective(values: Sequence[float]) -> float:
        return mean_abs_log_error(price(tuple(zip(grid, values))), measured)

    values = refine_knots([start] * len(grid), objective, bounds=[FACTOR_BOUNDS] * len(grid))
    return tuple((float(f"{x:.4g}"), float(f"{v:.4g}")) for x, v in zip(grid, values))


def held_out(index: int, *, every: int = 3) -> bool:
    """The split used for validation: every `every`-th point of a sweep (offset 1) is held out."""
    return index % every == 1
