"""Comparing predicted with measured: per-plan errors, MAPE and Kendall's tau.

    error_i = (predicted_i - measured_i) / measured_i
    MAPE    = 100 * mean_i |error_i|
    tau     = (concordant - discordant) / sqrt((n0 - n1) (n0 - n2))      (tau-b, `kendall_tau`)
with n0 = n(n-1)/2, n1 / n2 the pairs tied in the predicted / measured values; a pair is concordant
when both orderings agree. tau = 1: the simulator ranks the plans exactly as the machine does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Comparison:
    """One plan: predicted against measured."""

    name: str
    predicted_step_s: float
    measured_step_s: float
    predicted_memory_bytes: int
    """The simulator's peak (max over ranks) without the per-process context overhead."""
    measured_memory_bytes: int

    @property
    def step_error_pct(self) -> float:
        return error_pct(self.predicted_step_s, self.measured_step_s)

    @property
    def memory_error_pct(self) -> float:
        return error_pct(self.predicted_memory_bytes, self.measured_memory_bytes)

    def to_json(self) -> dict[str, float | str]:
        return {"name": self.name, "predicted_step_time_s": self.predicted_step_s,
                "measured_step_time_s": self.measured_step_s, "step_error_pct": self.step_error_pct,
                "predicted_peak_memory_bytes": self.predicted_memory_bytes,
                "measured_peak_memory_bytes": self.measured_memory_bytes, "memory_error_pct": self.memory_error_pct}


@dataclass(frozen=True)
class Summary:
    step_mape_pct: float
    memory_mape_pct: float
    step_kendall_tau: float
    plans: int

    def to_json(self) -> dict[str, float]:
        return {"step_mape_pct": self.step_mape_pct, "memory_mape_pct": self.memory_mape_pct,
                "step_kendall_tau": self.step_kendall_tau, "plans": self.plans}


def error_pct(predicted: float, measured: float) -> float:
    return 100.0 * (predicted - measured) / measured


def mape(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Mean absolute percentage error of `predicted` against `measured` (all measured > 0)."""
    if len(predicted) != len(measured) or not measured:
        raise ValueError("mape needs two equally long, non-empty sequences")
    return sum(abs(error_pct(p, m)) for p, m in zip(predicted, measured)) / len(measured)


def kendall_tau(x: Sequence[float], y: Sequence[float]) -> float:
    """Kendall's tau-b between two rankings (nan when either is constant)."""
    if len(x) != len(y):
        raise ValueError("kendall_tau needs two equally long sequences")
    concordant = discordant = ties_x = ties_y = 0
    n = len(x)
    for i in range(n):
        for j in range(i + 1, n):
            dx, dy = _sign(x[i] - x[j]), _sign(y[i] - y[j])
            if dx == 0:
                ties_x += 1
            if dy == 0:
                ties_y += 1
            if dx * dy > 0:
                concordant += 1
            elif dx * dy < 0:
                discordant += 1
    pairs = n * (n - 1) // 2
    denominator = math.sqrt((pairs - ties_x) * (pairs - ties_y))
    return (concordant - discordant) / denominator if denominator else float("nan")


def summarize(rows: Sequence[Comparison]) -> Summary:
    return Summary(
        step_mape_pct=mape([r.predicted_step_s for r in rows], [r.measured_step_s for r in rows]),
        memory_mape_pct=mape([r.predicted_memory_bytes for r in rows], [r.measured_memory_bytes for r in rows]),
        step_kendall_tau=kendall_tau([r.predicted_step_s for r in rows], [r.measured_step_s for r in rows]),
        plans=len(rows),
    )


def _sign(v: float) -> int:
    return (v > 0) - (v < 0)
