"""Predicting microbenchmark points from a profile, through the simulator's own cost functions.

A kernel case becomes its `OpNode` (`KernelCase.op_node`) priced by `costmodel.opcost.op_time`
(forward time, micro-batch = traced batch, no split; an SDPA case as SDPA's own kernel, which a causal call
without a mask gets at fp32 too, not as the math path a model's fp32 core runs); a collective case is priced by
`costmodel.collectives.collective_time` on a one-node group of its size (send_recv: a pair).
Calibration fits through these predictors and validates held-out points with them, so a profile is
judged by the numbers the planner will actually see.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from costmodel.calibration.fit import abs_pct_errors
from costmodel.collectives import CommGroup, collective_time
from costmodel.calibration.microbench import KernelCase
from costmodel.calibration.microbench_comm import CommCase
from costmodel.opcost import op_time
from costmodel.profiles import ClusterSpec, DeviceProfile


def predict_kernel(case: KernelCase, device: DeviceProfile) -> float:
    """Forward seconds the cost model gives `case` on `device`."""
    return op_time(case.op_node(), device=device, precision=case.precision_key, micro_batch=1, batch_traced=1,
                   math_attention=False).fwd_s  # the sweep times SDPA's own kernel on a causal call


def comm_group(case: CommCase) -> CommGroup:
    size = 2 if case.kind == "send_recv" else case.group_size
    return CommGroup(size=size, ranks_per_node=size)


def predict_comm(case: CommCase, cluster: ClusterSpec) -> float:
    """Seconds the cost model gives `case` on `cluster` (all ranks in one node)."""
    return collective_time(case.kind, float(case.nbytes), comm_group(case), cluster)


@dataclass(frozen=True)
class PointError:
    """One predicted point against its measurement."""

    family: str
    label: str
    measured_s: float
    predicted_s: float

    @property
    def abs_pct(self) -> float:
        return abs(self.predicted_s - self.measured_s) / self.measured_s * 100.0


@dataclass(frozen=True)
class ErrorSummary:
    family: str
    points: int
    median_abs_pct: float
    max_abs_pct: float


def summarize(errors: Sequence[PointError]) -> list[ErrorSummary]:
    """Median and max absolute % error per family, then over all points (family "all")."""
    out = []
    families = sorted({e.family for e in errors})
    for fam in [*families, "all"]:
        sel = [e for e in errors if fam in ("all", e.family)]
        if not sel:
            continue
        pct = abs_pct_errors([e.predicted_s for e in sel], [e.measured_s for e in sel])
        out.append(ErrorSummary(fam, len(sel), float(np.median(pct)), float(np.max(pct))))
    return out
