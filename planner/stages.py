"""Pipeline stage partition: contiguous layers to stages, balancing time under memory (Alpa's inter-op DP).

Model. The model is a sequence of L layers in execution order — the embedding first, the repeated
blocks, then the final norm, LM head and loss last — each with a time t[l] (forward + backward of one
micro-batch on its stage's devices), a static memory s[l] (weights, gradients, optimizer state) and an
activation memory a[l] (what one in-flight micro-batch keeps). Stage k holds layers [b_k, b_{k+1}) and
keeps f[k] micro-batches in flight (1F1B: f[k] = stages - k; GPipe: all of them).

Objective: minimise the bottleneck  max_k T(b_k, b_{k+1}),  T(i, j) = sum_{l=i}^{j-1} t[l],
subject to every stage's memory  S(i, j) + f[k] * A(i, j) <= limit[k]  and every stage non-empty.

Recurrence (`partition_stages`): with prefix sums, best[k][j] is the smallest bottleneck that puts
the first j layers on the first k stages:
    best[k][j] = min_{i < j, stage k-1 = [i, j) fits}  max(best[k-1][i], T(i, j)),
vectorised over i, so the cost is O(stages x L) numpy passes of length L. Ties go to the smallest i
(`argmin`), which makes the result deterministic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StagePartition:
    """Contiguous layer ranges, one per stage, and what they cost."""

    bounds: tuple[int, ...]
    """Stage k holds layers bounds[k] .. bounds[k+1]-1; bounds[0] == 0 and bounds[-1] == L."""
    stage_times: tuple[float, ...]
    stage_memory: tuple[float, ...]

    @property
    def bottleneck(self) -> float:
        return max(self.stage_times)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.bounds, self.bounds[1:]))


def partition_stages(
    layer_time: Sequence[float],
    layer_static_memory: Sequence[float],
    layer_activation_memory: Sequence[float],
    *,
    in_flight: Sequence[float],
    memory_limit: float | Sequence[float],
) -> StagePartition | None:
    """The partition into `len(in_flight)` stages with the smallest bottleneck time that fits, or None."""
    t = np.asarray(layer_time, dtype=float)
    s = np.asarray(layer_static_memory, dtype=float)
    a = np.asarray(layer_activation_memory, dtype=float)
    n, stages = t.size, len(in_flight)
    if not (s.size == a.size == n):
        raise ValueError("layer arrays must have equal lengths")
    if stages < 1 or stages > n:
        return None
    limits = np.broadcast_to(np.asarray(memory_limit, dtype=float), (stages,))
    flight = np.asarray(in_flight, dtype=float)
    T = np.concatenate(([0.0], np.cumsum(t)))
    S = np.concatenate(([0.0], np.cumsum(s)))
    A = np.concatenate(([0.0], np.cumsum(a)))

    best = np.full((stages + 1, n + 1), np.inf)
    choice = np.zeros((stages + 1, n + 1), dtype=np.int64)
    best[0, 0] = 0.0
    for k in range(1, stages + 1):
        # stage k-1 ends at j; layers before it fill k-1 stages, so i >= k-1 and j >= k
        for j in range(k, n - (stages - k) + 1):
            i = np.arange(k - 1, j)
            fits = (S[j] - S[i]) + flight[k - 1] * (A[j] - A[i]) <= limits[k - 1]
            cost = np.where(fits, np.maximum(best[k - 1, i], T[j] - T[i]), np.inf)
            pick = int(np.argmin(cost))
            best[k, j] = cost[pick]
            choice[k, j] = i[pick]
    if not np.isfinite(best[stages, n]):
        return None
    bounds = [n]
    for k in range(stages, 0, -1):
        bounds.append(int(choice[k, bounds[-1]]))
    bounds.reverse()
    times = tuple(float(T[j] - T[i]) for i, j in zip(bounds, bounds[1:]))
    memory = tuple(
        float((S[j] - S[i]) + flight[k] * (A[j] - A[i])) for k, (i, j) in enumerate(zip(bounds, bounds[1:]))
    )
    return StagePartition(bounds=tuple(bounds), stage_times=times, stage_memory=memory)


def one_f_one_b_in_flight(stages: int) -> tuple[int, ...]:
    """Micro-batches each stage keeps in flight under 1F1B: the first stage holds `stages`, the last 1."""
    return tuple(stages - k for k in range(stages))
