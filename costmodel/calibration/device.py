"""Fit a device profile (schema version 1) from kernel measurements.

From the fit set (held-out points excluded):
- `peak_tflops[p]`: the best FLOP/s any matmul reached at precision p, so efficiencies stay ≤ 1;
- `memory_bandwidth_gbps` and `memory_efficiency` (x = bytes): from the memory-bound reference kernels
  (`MEMORY_REFERENCE_OPS`, add and mul: STREAM-style, one arithmetic op per element, nothing to hide
  behind) at the reference precision, best bytes/s and then knots refined through `op_time`;
- `matmul_efficiency` (x = FLOPs): closed-form knots refined through `op_time` on the reference
  precision's matmuls. One curve serves every precision, each with its own peak, so the curve follows
  the precision the device trains in (the caller's `reference`): at other precisions small matmuls
  may run at a different share of their peak, which their `matmul/<precision>` kernel factor absorbs;
- `kernel_overhead_us`: the time of a 12-byte add;
- `host_link_gbps`: a pinned host-to-device copy on a GPU; the memory bandwidth on a CPU, whose host
  memory is its device memory.
Knots start from `fit.efficiency_points` and are refined with `fit.refine_knots`.

Kernels the roofline cannot express on a device (on a CPU: transcendental activations, norms and
softmax are bound by vector arithmetic the tracer does not count as FLOPs; bf16 elementwise kernels by
conversions; small bf16 matmuls by a fixed cost) get a factor curve per kernel class and precision
(`kernel_factors`, key `class/precision` with `opcost.kernel_class`, e.g. `softmax/bf16`), fitted on the
fit set through `op_time` (`fit.fit_factor_curve`) for every class except the two that shape the
curves (matmul and arithmetic at the reference precision). `op_time` reads them. A matmul with a
dimension off the 16-byte alignment (a 50,257-token LM head) is not one of the curve's matmuls: it gets
its own factor, `matmul-unaligned/<precision>`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from costmodel.calibration.fit import efficiency_points, fit_factor_curve, mean_abs_log_error, refine_knots
from costmodel.calibration.predict import predict_kernel
from costmodel.calibration.microbench import KernelSample
from costmodel.opcost import MATMUL_LIKE, kernel_class, unaligned_matmul
from costmodel.profiles import GIB, UNALIGNED_MATMUL, DeviceProfile, EfficiencyCurve, FactorCurve, cluster_from_dict

MEMORY_REFERENCE_OPS = frozenset({"add", "mul"})
"""The kernels that define the device's memory-bound behaviour."""


def family_key(case) -> str:
    return f"{case.family}/{case.precision_key}"


def _fit_sets(samples: Sequence[KernelSample], reference: str) -> tuple[list[KernelSample], list[KernelSample]]:
    """(matmuls, memory-bound reference kernels) at the reference precision."""
    at_ref = [s for s in samples if s.case.precision_key == reference]
    if not any(s.case.family == "matmul" for s in at_ref):
        raise ValueError(f"no {reference} matmul was measured to fit the curves on")
    aligned = [s for s in at_ref if s.case.family == "matmul" and not unaligned_matmul(s.case.op_node())]
    return aligned, [s for s in at_ref if s.case.op in MEMORY_REFERENCE_OPS]


def _num(value: float, source: str, digits: int = 4) -> dict:
    return {"value": float(f"{value:.{digits}g}"), "source": source}


def _curve(points: Sequence[tuple[float, float]], source: str, fit: dict | None = None) -> dict:
    out: dict = {"points": [[float(f"{x:.4g}"), float(f"{e:.4g}")] for x, e in points], "source": source}
    if fit:
        out["fit"] = fit
    return out


def closed_form_device(samples: Sequence[KernelSample], *, reference: str, name: str, description: str, source: str,
                       overhead_s: float, memory_bytes: int, context_bytes: int, host_bandwidth: float | None) -> dict:
    """The device JSON from the closed-form estimates alone (before refinement)."""
    compute, memory = _fit_sets(samples, reference)
    peaks: dict[str, float] = {}
    for s in samples:
        if s.case.family == "matmul":
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
        "host_link_gbps": _num((host_bandwidth or bandwidth) / 1e9, source),
    }


def _as_profile(device_json: dict) -> DeviceProfile:
    """Validate a device JSON through the profile loader (wrapped in a throwaway cluster)."""
    link = {"bandwidth_gbps": {"value": 1, "source": "-"}, "latency_us": {"value": 0, "source": "-"},
            "efficiency": {"points": [[1, 1]], "source": "-"}, "sharp": False}
    cluster = {"schema_version": 1, "name": "probe", "description": "probe", "device": device_json,
               "gpus_per_node": 1, "tp_across_nodes": False, "links": {"intra_node": link, "inter_node": link}}
    return cluster_from_dict(cluster).device


def factor_key(case) -> str:
    """`class/precision`: the key of `case`'s kernel factor (`opcost.kernel_class`; `matmul-unaligned` for a
    matmul off the 16-byte alignment, `opcost.unaligned_matmul`)."""
    node = case.op_node()
    return f"{UNALIGNED_MATMUL if unaligned_matmul(node) else kernel_class(node)}/{case.precision_key}"


def fit_kernel_factors(dev: DeviceProfile, samples: Sequence[KernelSample], *, reference: str
                       ) -> dict[str, tuple[tuple[float, float], ...]]:
    """A factor curve per kernel class and precision, except the classes that shaped the curves."""
    groups: dict[str, list[KernelSample]] = {}
    for s in samples:
        key = factor_key(s.case)
        if key not in (f"matmul/{reference}", f"arithmetic/{reference}"):
            groups.setdefault(key, []).append(s)
    table = {}
    for key, group in sorted(groups.items()):
        nodes = [s.case.op_node() for s in group]
        xs = [n.fwd_flops if n.kind in MATMUL_LIKE else n.bytes_moved for n in nodes]

        def price(points, key=key, group=group) -> list[float]:
            trial = dataclasses.replace(dev, kernel_factors={key: FactorCurve(points)})
            return [predict_kernel(s.case, trial) for s in group]

        curve = fit_factor_curve(xs, [s.seconds for s in group], price)
        if curve is not None:
            table[key] = curve
    return table


def refine_device(device_json: dict, samples: Sequence[KernelSample], *, reference: str) -> dict:
    """Refine the curves' knots through `op_time`: the memory curve on the memory-bound reference
    kernels, then the matmul curve on the matmuls (both at the reference precision); then fit the kernel
    factor curves of every other class and precision."""
    base = _as_profile(device_json)
    matmuls, memory = _fit_sets(samples, reference)

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
    factors = fit_kernel_factors(dev, samples, reference=reference)
    out = {
        **device_json,
        "matmul_efficiency": _curve(dev.matmul_efficiency.points, source),
        "memory_efficiency": _curve(dev.memory_efficiency.points, source),
    }
    if factors:
        out["kernel_factors"] = {"source": source, "factors": {k: [list(p) for p in v] for k, v in factors.items()}}
    return out
