"""Fit a device profile (schema version 1) from kernel measurements.

From the fit set (held-out points excluded):
- `peak_tflops[p]`: the best FLOP/s any matmul reached at precision p, so efficiencies stay ≤ 1;
- `memory_bandwidth_gbps`: the best bytes/s any memory-bound kernel reached;
- `kernel_overhead_us`: the time of a 12-byte add;
- `matmul_efficiency` (x = FLOPs) and `memory_efficiency` (x = bytes): closed-form knots
  (`calibrate_fit.efficiency_points`), then refined through `costmodel.opcost.op_time`
  (`calibrate_fit.refine_knots`): the memory curve on the elementwise, norm and softmax kernels, then
  the matmul curve on the matmuls. The cost model prices attention with the matmul curve too; its
  points are validated but do not bend the curve (CPU attention kernels run far from matmul speed). The per-family median of measured/predicted on the
  fit set is kept under the curves' `fit.residual_by_family`: how far one curve is from each family.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence

from costmodel.calibrate_fit import efficiency_points, mean_abs_log_error, refine_knots
from costmodel.calibrate_predict import predict_kernel
from costmodel.microbench import KernelSample
from costmodel.profiles import GIB, DeviceProfile, EfficiencyCurve, cluster_from_dict

COMPUTE_FAMILIES = ("matmul", "attention")


def _num(value: float, source: str, digits: int = 4) -> dict:
    return {"value": float(f"{value:.{digits}g}"), "source": source}


def _curve(points: Sequence[tuple[float, float]], source: str, fit: dict | None = None) -> dict:
    out: dict = {"points": [[float(f"{x:.4g}"), float(f"{e:.4g}")] for x, e in points], "source": source}
    if fit:
        out["fit"] = fit
    return out


def closed_form_device(samples: Sequence[KernelSample], *, name: str, description: str, source: str,
                       overhead_s: float, memory_bytes: int, context_bytes: int) -> dict:
    """The device JSON from the closed-form estimates alone (before refinement)."""
    compute = [s for s in samples if s.case.family == "matmul"]
    memory = [s for s in samples if s.case.family not in COMPUTE_FAMILIES]
    peaks: dict[str, float] = {}
    for s in compute:
        prec = s.case.precision_key
        peaks[prec] = max(peaks.get(prec, 0.0), s.case.flops / s.seconds)
    bandwidth = max(s.case.bytes_moved / s.seconds for s in memory)

    def busy(s: KernelSample) -> float:
        return max(s.seconds - overhead_s, 0.05 * s.seconds)

    mm_points = efficiency_points(
        [s.case.flops for s in compute], [s.case.flops / (peaks[s.case.precision_key] * busy(s)) for s in compute]
    )
    mem_points = efficiency_points([s.case.bytes_moved for s in memory], [s.case.bytes_moved / (bandwidth * busy(s)) for s in memory])
    return {
        "schema_version": 1,
        "name": name,
        "description": description,
        "memory_gib": _num(memory_bytes / GIB, source),
        "peak_tflops": {p: _num(v / 1e12, source) for p, v in sorted(peaks.items())},
        "memory_bandwidth_gbps": _num(bandwidth / 1e9, source),
        "matmul_efficiency": _curve(mm_points, source),
        "memory_efficiency": _curve(mem_points, source),
        "kernel_overhead_us": _num(overhead_s * 1e6, source),
        "context_overhead_gib": _num(context_bytes / GIB, source),
        "host_link_gbps": _num(bandwidth / 1e9, source),
    }


def _as_profile(device_json: dict) -> DeviceProfile:
    """Validate a device JSON through the profile loader (wrapped in a throwaway cluster)."""
    link = {"bandwidth_gbps": {"value": 1, "source": "-"}, "latency_us": {"value": 0, "source": "-"},
            "efficiency": {"points": [[1, 1]], "source": "-"}, "sharp": False}
    cluster = {"schema_version": 1, "name": "probe", "description": "probe", "device": device_json,
               "gpus_per_node": 1, "tp_across_nodes": False, "links": {"intra_node": link, "inter_node": link}}
    return cluster_from_dict(cluster).device


def refine_device(device_json: dict, samples: Sequence[KernelSample]) -> dict:
    """Refine the curves' knots through `op_time`: the memory curve on the memory-bound kernels, then the
    matmul curve on the matmuls (attention is priced with the matmul curve but does not bend it); record
    per-family residuals."""
    base = _as_profile(device_json)
    memory = [s for s in samples if s.case.family not in COMPUTE_FAMILIES]
    matmuls = [s for s in samples if s.case.family == "matmul"]

    def refine(dev: DeviceProfile, field: str, fit_on: Sequence[KernelSample]) -> DeviceProfile:
        knots = getattr(dev, field).points
        measured = [s.seconds for s in fit_on]

        def with_values(values: Sequence[float]) -> DeviceProfile:
            return dataclasses.replace(dev, **{field: EfficiencyCurve(tuple((x, v) for (x, _), v in zip(knots, values)))})

        def objective(values: Sequence[float]) -> float:
            trial = with_values(values)
            return mean_abs_log_error([predict_kernel(s.case, trial) for s in fit_on], measured)

        return with_values(refine_knots([e for _, e in knots], objective, bounds=[(1e-4, 1.0)] * len(knots)))

    dev = refine(refine(base, "memory_efficiency", memory), "matmul_efficiency", matmuls)
    source = device_json["matmul_efficiency"]["source"]
    residuals = {}
    for fam in sorted({s.case.family for s in samples}):
        ratios = [s.seconds / predict_kernel(s.case, dev) for s in samples if s.case.family == fam]
        residuals[fam] = float(f"{statistics.median(ratios):.3g}")
    mm_fit = {"residual_by_family": {k: v for k, v in residuals.items() if k in COMPUTE_FAMILIES}}
    mem_fit = {"residual_by_family": {k: v for k, v in residuals.items() if k not in COMPUTE_FAMILIES}}
    return {
        **device_json,
        "matmul_efficiency": _curve(dev.matmul_efficiency.points, source, mm_fit),
        "memory_efficiency": _curve(dev.memory_efficiency.points, source, mem_fit),
    }
