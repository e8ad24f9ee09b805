"""The profile JSON format (schema version 1), read strictly and written back with every source.

`_Reader` walks one document and raises SoapError naming the file and the field path; the
`*_from_json` functions convert units (TFLOP/s, GiB, GB/s, microseconds in the JSON; SI in Python).
The `*_to_dict` functions write the same format back, so a profile round-trips with its provenance.

Optional memory fields (their meaning: `costmodel.profiles` module docstring):
- cluster `host_memory_gib` `{"value": GiB > 0, "source": ...}`: host RAM per node; absent loads as
  unknown (`ClusterSpec.host_memory_bytes` None), so profiles and plan.json files written before it
  existed still load; every shipped cluster has it.
- device `compile_factors` `{"source": ..., "notes": ..., "factors": {"<class>/<fwd|bwd>": [[x, f], ...]}}`:
  torch.compile's time over eager's per kernel class and pass, f in [MIN_COMPILE_FACTOR, MAX_COMPILE_FACTOR]
  (compile can fuse an op away but not make it free, and a compiled kernel many times slower than eager is a
  measurement problem); absent: compile priced as no change.
- device `allocator_reserve_fraction` `{"value": f in [0, MAX_ALLOCATOR_RESERVE], "source": ...}`:
  reserved / allocated - 1 of the caching allocator at the peak; absent: not fitted (None).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from costmodel.profiles import (
    GIB,
    NOT_RECORDED,
    COMPILE_PASSES,
    PRECISION_KEYS,
    SCHEMA_VERSION,
    ClusterSpec,
    DeviceProfile,
    KERNEL_CLASSES,
    UNALIGNED_MATMUL,
    EfficiencyCurve,
    FactorCurve,
    LinkLevel,
)
from costmodel.context_attention import LOWER_RIGHT_CLASS
from costmodel.strategy import OPTIMIZERS
from tracer.errors import SoapError

FACTOR_KERNEL_CLASSES = (*KERNEL_CLASSES, "tanh", UNALIGNED_MATMUL, LOWER_RIGHT_CLASS)
"""Kernel classes a profile's `kernel_factors` may name: `profiles.KERNEL_CLASSES` plus `tanh`, which
`costmodel.opcost.kernel_class` gives its own class (a CPU tanh costs several silus at the same bytes),
`matmul-unaligned` (`costmodel.opcost.unaligned_matmul`) and `attention-lower-right` (context parallelism's
rectangular causal kernel, `costmodel.context_attention`)."""

class _Reader:
    """Walks one JSON document, raising SoapError that names the file and the field path."""

    def __init__(self, origin: str) -> None:
        self.origin = origin

    def fail(self, path: str, problem: str) -> SoapError:
        return SoapError(f"profile {self.origin}: field {path}: {problem}; fix the profile JSON")

    def obj(self, data: Any, path: str, required: set[str], optional: set[str] = frozenset()) -> dict:
        if not isinstance(data, dict):
            raise self.fail(path, f"expected an object, got {type(data).__name__}")
        unknown = sorted(set(data) - required - set(optional))
        if unknown:
            raise self.fail(path, f"unknown key(s) {', '.join(unknown)}")
        missing = sorted(required - set(data))
        if missing:
            raise self.fail(path, f"missing key(s) {', '.join(missing)}")
        return data

    def text(self, data: dict, key: str, path: str) -> str:
        value = data[key]
        if not isinstance(value, str) or not value.strip():
            raise self.fail(f"{path}.{key}".lstrip("."), "must be a non-empty string")
        return value

    def integer(self, data: dict, key: str, path: str, minimum: int = 1) -> int:
        value = data[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.fail(f"{path}.{key}".lstrip("."), f"must be an integer >= {minimum}, got {value!r}")
        return value

    def flag(self, data: dict, key: str, path: str) -> bool:
        value = data[key]
        if not isinstance(value, bool):
            raise self.fail(f"{path}.{key}".lstrip("."), f"must be true or false, got {value!r}")
        return value

    def number(self, data: Any, path: str, *, positive: bool = True) -> tuple[float, str]:
        """A `{"value": x, "source": s}` object; x must be > 0 (or >= 0 when not `positive`)."""
        self.obj(data, path, {"value", "source"}, {"notes"})
        value = data["value"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self.fail(f"{path}.value", f"must be a finite number, got {value!r}")
        if value < 0 or (positive and value == 0):
            raise self.fail(f"{path}.value", f"must be {'positive' if positive else 'non-negative'}, got {value}")
        return float(value), self.text(data, "source", path)

    def curve(self, data: Any, path: str, top: float = 1.0) -> EfficiencyCurve:
        self.obj(data, path, {"points", "source"}, {"fit", "notes"})
        points = data["points"]
        if not isinstance(points, list) or not points:
            raise self.fail(f"{path}.points", "must be a non-empty list of [x, efficiency] pairs")
        parsed: list[tuple[float, float]] = []
        for i, pair in enumerate(points):
            ok = isinstance(pair, list) and len(pair) == 2 and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in pair
            )
            if not ok:
                raise self.fail(f"{path}.points[{i}]", f"must be a pair of numbers, got {pair!r}")
            x, eff = float(pair[0]), float(pair[1])
            if x <= 0:
                raise self.fail(f"{path}.points[{i}]", f"x must be positive, got {x}")
            if not 0 < eff <= top:
                raise self.fail(f"{path}.points[{i}]", f"efficiency must be in (0, {top:g}], got {eff}")
            if parsed and x <= parsed[-1][0]:
                raise self.fail(f"{path}.points[{i}]", f"x must increase, got {x} after {parsed[-1][0]}")
            parsed.append((x, eff))
        extras = {k: data[k] for k in ("fit", "notes") if k in data}
        return EfficiencyCurve(tuple(parsed), source=self.text(data, "source", path), extras=extras)

    def factor_table(self, data: Any, path: str, kinds: tuple[str, ...], suffix_ok: Callable[[str], bool],
                     suffix_hint: str, bounds: tuple[float, float] | None = None,
                     notes: bool = False) -> tuple[dict[str, FactorCurve], str]:
        """`{"source": s, "factors": {"<kind>/<suffix>": [[x, factor], ...]}}`: x positive and
        increasing, factors in (0, MAX_FACTOR], or within `bounds` (inclusive) where given; with `notes`,
        an optional `notes` object is allowed (kept by the caller)."""
        self.obj(data, path, {"source", "factors"}, {"notes"} if notes else set())
        low, high = bounds or (0.0, MAX_FACTOR)
        factors = data["factors"]
        if not isinstance(factors, dict):
            raise self.fail(f"{path}.factors", "must be an object of key -> [[x, factor], ...]")
        table: dict[str, FactorCurve] = {}
        for key, points in factors.items():
            where = f"{path}.factors.{key}"
            kind, _, suffix = key.partition("/")
            if kind not in kinds or not suffix_ok(suffix):
                raise self.fail(where, f"key must be <{'|'.join(kinds)}>/<{suffix_hint}>")
            if not isinstance(points, list) or not points:
                raise self.fail(where, "must be a non-empty list of [x, factor] pairs")
            parsed: list[tuple[float, float]] = []
            for i, pair in enumerate(points):
                ok = isinstance(pair, list) and len(pair) == 2 and all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in pair)
                if not ok or pair[0] <= 0 or not (low <= pair[1] <= high and pair[1] > 0):
                    span = f"[{low:g}, {high:g}]" if bounds else f"(0, {high:g}]"
                    raise self.fail(f"{where}[{i}]", f"must be [x > 0, factor in {span}], got {pair!r}")
                if parsed and pair[0] <= parsed[-1][0]:
                    raise self.fail(f"{where}[{i}]", f"x must increase, got {pair[0]} after {parsed[-1][0]}")
                parsed.append((float(pair[0]), float(pair[1])))
            table[key] = FactorCurve(tuple(parsed))
        return table, self.text(data, "source", path)


MAX_FACTOR = 1000.0
"""Largest time multiplier a factor table may hold (a sanity bound, not a physical one)."""
MIN_COMPILE_FACTOR = 0.02
MAX_COMPILE_FACTOR = 10.0
"""Bounds on a `compile_factors` entry: fusion can hide an op in its neighbour's memory pass but not make
it free (50x faster), and a compiled kernel ten times slower than eager is a measurement problem."""


_DEVICE_REQUIRED = {
    "schema_version", "name", "description", "memory_gib", "peak_tflops", "memory_bandwidth_gbps",
    "matmul_efficiency", "memory_efficiency", "kernel_overhead_us", "context_overhead_gib", "host_link_gbps",
}
_DEVICE_STEP_FIELDS = ("optimizer_factors", "concurrency_efficiency", "communication_overlap",
                       "collective_call_overhead_us", "activation_collective_factor", "host_dispatch_us",
                       "host_jitter_us", "pipelined_sync_us")
"""Optional device fields about a rank inside a training step (`costmodel.profiles` module docstring)."""
MAX_STEP_FACTOR = 1000.0
"""Bound on a fitted step multiplier (`activation_collective_factor`): beyond it the profile is wrong."""
MAX_ALLOCATOR_RESERVE = 1.0
"""Bound on `allocator_reserve_fraction`: an allocator reserving more than twice what it hands out is a
measurement problem (a leak, a cache never emptied), not a property of the device."""
MAX_HOST_MEMORY_GIB = 2.0**30
"""Bound on `host_memory_gib` (an exbibyte per node): beyond it the value is in the wrong unit."""
DEVICE_KINDS = ("gpu", "cpu")
"""`kind` of a device profile (`DeviceProfile.kind`); absent means gpu."""
_CLUSTER_REQUIRED = {"schema_version", "name", "description", "device", "gpus_per_node", "tp_across_nodes", "links"}
_LINK_REQUIRED = {"bandwidth_gbps", "latency_us", "efficiency", "sharp"}


def _check_version(r: _Reader, data: dict) -> None:
    if data["schema_version"] != SCHEMA_VERSION:
        raise r.fail("schema_version", f"unsupported version {data['schema_version']!r}, expected {SCHEMA_VERSION}")


def device_from_json(data: Any, origin: str) -> DeviceProfile:
    r = _Reader(origin)
    r.obj(data, "<root>", _DEVICE_REQUIRED, {"kind", "dtype_efficiency", "kernel_factors", "compile_factors",
                                             "runtime_workspace_mib", "notes",
                                             "allocator_reserve_fraction", *_DEVICE_STEP_FIELDS})
    _check_version(r, data)
    sources: dict[str, str] = {}

    def num(key: str, *, positive: bool = True) -> float:
        value, sources[key] = r.number(data[key], key, positive=positive)
        return value

    peaks = r.obj(data["peak_tflops"], "peak_tflops", {"fp32"}, set(PRECISION_KEYS) - {"fp32"})
    peak_flops: dict[str, float] = {}
    for key in PRECISION_KEYS:
        if key in peaks:
            value, sources[f"peak_tflops.{key}"] = r.number(peaks[key], f"peak_tflops.{key}")
            peak_flops[key] = value * 1e12
    dtype_eff: dict[str, float] = {}
    if "dtype_efficiency" in data:
        block = r.obj(data["dtype_efficiency"], "dtype_efficiency", {"source"}, set(PRECISION_KEYS))
        sources["dtype_efficiency"] = r.text(block, "source", "dtype_efficiency")
        for key in PRECISION_KEYS:
            if key in block:
                v = block[key]
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
                    raise r.fail(f"dtype_efficiency.{key}", f"must be in (0, 1], got {v!r}")
                dtype_eff[key] = float(v)
    kernel_factors: dict[str, FactorCurve] = {}
    if "kernel_factors" in data:
        kernel_factors, sources["kernel_factors"] = r.factor_table(
            data["kernel_factors"], "kernel_factors", FACTOR_KERNEL_CLASSES, lambda p: p in PRECISION_KEYS, "|".join(PRECISION_KEYS))
    compile_factors: dict[str, FactorCurve] = {}
    compile_notes = None
    if "compile_factors" in data:
        compile_factors, sources["compile_factors"] = r.factor_table(
            data["compile_factors"], "compile_factors", FACTOR_KERNEL_CLASSES, lambda p: p in COMPILE_PASSES,
            "|".join(COMPILE_PASSES), bounds=(MIN_COMPILE_FACTOR, MAX_COMPILE_FACTOR), notes=True)
        compile_notes = data["compile_factors"].get("notes")
    workspace = 0
    if "runtime_workspace_mib" in data:
        value, sources["runtime_workspace_mib"] = r.number(data["runtime_workspace_mib"], "runtime_workspace_mib",
                                                           positive=False)
        workspace = int(value * 2**20)
    optimizer_factors: dict[str, FactorCurve] = {}
    if "optimizer_factors" in data:
        optimizer_factors, sources["optimizer_factors"] = r.factor_table(
            data["optimizer_factors"], "optimizer_factors", OPTIMIZERS, lambda p: p in PRECISION_KEYS,
            "|".join(PRECISION_KEYS))
    concurrency = r.curve(data["concurrency_efficiency"], "concurrency_efficiency") \
        if "concurrency_efficiency" in data else None
    overlap = 1.0
    if "communication_overlap" in data:
        overlap, sources["communication_overlap"] = r.number(data["communication_overlap"], "communication_overlap",
                                                             positive=False)
        if overlap > 1:
            raise r.fail("communication_overlap.value", f"must be in [0, 1], got {overlap}")
    call_overhead = 0.0
    if "collective_call_overhead_us" in data:
        call_overhead, sources["collective_call_overhead_us"] = r.number(
            data["collective_call_overhead_us"], "collective_call_overhead_us", positive=False)
    host_dispatch = 0.0
    if "host_dispatch_us" in data:
        host_dispatch, sources["host_dispatch_us"] = r.number(data["host_dispatch_us"], "host_dispatch_us",
                                                              positive=False)
    host_jitter = 0.0
    if "host_jitter_us" in data:
        host_jitter, sources["host_jitter_us"] = r.number(data["host_jitter_us"], "host_jitter_us", positive=False)
    pipelined_sync = 0.0
    if "pipelined_sync_us" in data:
        pipelined_sync, sources["pipelined_sync_us"] = r.number(data["pipelined_sync_us"], "pipelined_sync_us",
                                                                positive=False)
    activation_factor = 1.0
    if "activation_collective_factor" in data:
        activation_factor, sources["activation_collective_factor"] = r.number(
            data["activation_collective_factor"], "activation_collective_factor")
        if activation_factor > MAX_STEP_FACTOR:
            raise r.fail("activation_collective_factor.value", f"must be at most {MAX_STEP_FACTOR}, got {activation_factor}")
    reserve = None
    if "allocator_reserve_fraction" in data:
        reserve, sources["allocator_reserve_fraction"] = r.number(
            data["allocator_reserve_fraction"], "allocator_reserve_fraction", positive=False)
        if reserve > MAX_ALLOCATOR_RESERVE:
            raise r.fail("allocator_reserve_fraction.value",
                         f"must be in [0, {MAX_ALLOCATOR_RESERVE:g}] (reserved / allocated - 1), got {reserve}")
    matmul = r.curve(data["matmul_efficiency"], "matmul_efficiency")
    memory = r.curve(data["memory_efficiency"], "memory_efficiency")
    kind = data.get("kind", "gpu")
    if kind not in DEVICE_KINDS:
        raise r.fail("kind", f"must be one of {', '.join(DEVICE_KINDS)}, got {kind!r}")
    return DeviceProfile(
        name=r.text(data, "name", ""),
        description=r.text(data, "description", ""),
        kind=kind,
        peak_flops=peak_flops,
        memory_bytes=int(num("memory_gib") * GIB),
        memory_bandwidth=num("memory_bandwidth_gbps") * 1e9,
        matmul_efficiency=matmul,
        memory_efficiency=memory,
        kernel_overhead_s=num("kernel_overhead_us", positive=False) * 1e-6,
        context_bytes=int(num("context_overhead_gib", positive=False) * GIB),
        runtime_workspace_bytes=workspace,
        host_bandwidth=num("host_link_gbps") * 1e9,
        dtype_efficiency=dtype_eff,
        kernel_factors=kernel_factors,
        compile_factors=compile_factors,
        compile_notes=compile_notes,
        optimizer_factors=optimizer_factors,
        concurrency_efficiency=concurrency,
        communication_overlap=overlap,
        collective_call_overhead_s=call_overhead * 1e-6,
        host_dispatch_s=host_dispatch * 1e-6,
        host_jitter_s=host_jitter * 1e-6,
        pipelined_sync_s=pipelined_sync * 1e-6,
        activation_collective_factor=activation_factor,
        allocator_reserve_fraction=reserve,
        sources=sources,
    )


def _link_from_json(r: _Reader, data: Any, path: str) -> LinkLevel:
    from costmodel.collectives import COLLECTIVES

    r.obj(data, path, _LINK_REQUIRED, {"fit", "notes", "collective_factors", "node_scaling", "collective_node_scaling"})
    bandwidth, bw_src = r.number(data["bandwidth_gbps"], f"{path}.bandwidth_gbps")
    latency, lat_src = r.number(data["latency_us"], f"{path}.latency_us", positive=False)
    sources = {"bandwidth_gbps": bw_src, "latency_us": lat_src}
    collective_factors: dict[str, FactorCurve] = {}
    if "collective_factors" in data:
        collective_factors, sources["collective_factors"] = r.factor_table(
            data["collective_factors"], f"{path}.collective_factors", COLLECTIVES,
            lambda n: n.isdigit() and int(n) >= 2, "ranks >= 2")
    fit = data.get("fit", {})
    if not isinstance(fit, dict):
        raise r.fail(f"{path}.fit", "must be an object")
    factor = fit.get("sharp_all_reduce_factor", 1.0)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 2:
        raise r.fail(f"{path}.fit.sharp_all_reduce_factor", f"must be in (0, 2], got {factor!r}")
    return LinkLevel(
        name=path.split(".")[-1],
        bandwidth=bandwidth * 1e9,
        latency_s=latency * 1e-6,
        efficiency=r.curve(data["efficiency"], f"{path}.efficiency"),
        sharp=r.flag(data, "sharp", path),
        sharp_all_reduce_factor=float(factor),
        collective_factors=collective_factors,
        sources=sources,
        extras={k: data[k] for k in ("fit", "notes") if k in data},
        node_scaling=_node_scaling(r, data.get("node_scaling"), f"{path}.node_scaling"),
        collective_node_scaling=_collective_node_scaling(r, data, path, COLLECTIVES),
    )


def _node_scaling(r: _Reader, data: Any, path: str) -> EfficiencyCurve | None:
    """A `node_scaling` curve: node counts >= 2 against bandwidth factors in (0, 2]."""
    if data is None:
        return None
    curve = r.curve(data, path, top=2.0)
    for nodes, factor in curve.points:
        if nodes < 2 or not 0 < factor <= 2:
            raise r.fail(f"{path}.points", f"need nodes >= 2 and a factor in (0, 2], got [{nodes:g}, {factor:g}]")
    return curve


def _collective_node_scaling(r: _Reader, data: dict, path: str, kinds: tuple[str, ...]) -> dict[str, EfficiencyCurve]:
    """A link's `collective_node_scaling`: {collective: node_scaling curve}."""
    table = data.get("collective_node_scaling", {})
    where = f"{path}.collective_node_scaling"
    if not isinstance(table, dict):
        raise r.fail(where, "must be an object {collective: curve}")
    out = {}
    for kind, curve in table.items():
        if kind not in kinds:
            raise r.fail(f"{where}.{kind}", f"unknown collective; choose one of {', '.join(kinds)}")
        out[kind] = _node_scaling(r, curve, f"{where}.{kind}")
    return out


def cluster_from_json(data: Any, origin: str, device_by_name: Callable[[str], DeviceProfile]) -> ClusterSpec:
    """A cluster document; a device given by name is resolved with `device_by_name`."""
    r = _Reader(origin)
    r.obj(data, "<root>", _CLUSTER_REQUIRED, {"notes", "host_memory_gib", "nvlink_domain"})
    _check_version(r, data)
    device_ref = data["device"]
    if isinstance(device_ref, dict):
        device = device_from_json(device_ref, f"{origin} (inline device)")
    elif isinstance(device_ref, str) and device_ref:
        device = device_by_name(device_ref)
    else:
        raise r.fail("device", "must be a device profile name or an inline device object")
    links = r.obj(data["links"], "links", {"intra_node", "inter_node"})
    host_memory, sources = None, {}
    if "host_memory_gib" in data:
        gib, sources["host_memory_gib"] = r.number(data["host_memory_gib"], "host_memory_gib")
        if gib > MAX_HOST_MEMORY_GIB:
            raise r.fail("host_memory_gib.value", f"must be at most {MAX_HOST_MEMORY_GIB:g} GiB per node, got {gib:g}")
        host_memory = round(gib * GIB)
    return ClusterSpec(
        name=r.text(data, "name", ""),
        description=r.text(data, "description", ""),
        device=device,
        gpus_per_node=r.integer(data, "gpus_per_node", ""),
        tp_across_nodes=r.flag(data, "tp_across_nodes", ""),
        intra_node=_link_from_json(r, links["intra_node"], "links.intra_node"),
        inter_node=_link_from_json(r, links["inter_node"], "links.inter_node"),
        host_memory_bytes=host_memory,
        sources=sources,
        nvlink_domain=_nvlink_domain(r, data),
    )


def _nvlink_domain(r: _Reader, data: dict) -> int | None:
    """`nvlink_domain`: a multiple of `gpus_per_node` (whole nodes share the fabric), or absent."""
    if "nvlink_domain" not in data:
        return None
    domain, node = r.integer(data, "nvlink_domain", ""), r.integer(data, "gpus_per_node", "")
    if domain % node:
        raise r.fail("nvlink_domain", f"must be a multiple of gpus_per_node={node} (whole nodes share "
                                      f"an NVLink domain), got {domain}")
    return None if domain == node else domain


def _us(seconds: float) -> float:
    """Seconds as the microseconds a profile stores, to 12 significant digits: x 1e6 then / 1e6 on reading
    must give back the same float (5.31 us read is 5.309999999999999e-06 s, which x 1e6 is 5.309999999999999)."""
    return float(f"{seconds * 1e6:.12g}")


def _number(value: float, source: str | None) -> dict:
    return {"value": value, "source": source or NOT_RECORDED}


def _curve_dict(curve: EfficiencyCurve) -> dict:
    return {"points": [[x, e] for x, e in curve.points], "source": curve.source, **dict(curve.extras)}


def device_to_dict(device: DeviceProfile) -> dict:
    """The device profile JSON (schema version 1), sources kept."""
    src = device.sources.get
    out: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "name": device.name,
        "description": device.description or device.name,
        **({"kind": device.kind} if device.kind != "gpu" else {}),
        "memory_gib": _number(device.memory_bytes / GIB, src("memory_gib")),
        "peak_tflops": {
            k: _number(device.peak_flops[k] / 1e12, src(f"peak_tflops.{k}")) for k in PRECISION_KEYS if k in device.peak_flops
        },
        "memory_bandwidth_gbps": _number(device.memory_bandwidth / 1e9, src("memory_bandwidth_gbps")),
        "matmul_efficiency": _curve_dict(device.matmul_efficiency),
        "memory_efficiency": _curve_dict(device.memory_efficiency),
        "kernel_overhead_us": _number(_us(device.kernel_overhead_s), src("kernel_overhead_us")),
        "context_overhead_gib": _number(device.context_bytes / GIB, src("context_overhead_gib")),
        "host_link_gbps": _number(device.host_bandwidth / 1e9, src("host_link_gbps")),
    }
    if device.runtime_workspace_bytes:
        out["runtime_workspace_mib"] = _number(device.runtime_workspace_bytes / 2**20, src("runtime_workspace_mib"))
    if device.dtype_efficiency:
        out["dtype_efficiency"] = {**device.dtype_efficiency, "source": src("dtype_efficiency") or NOT_RECORDED}
    if device.kernel_factors:
        out["kernel_factors"] = _factor_table_dict(device.kernel_factors, src("kernel_factors"))
    if device.compile_factors:
        out["compile_factors"] = _factor_table_dict(device.compile_factors, src("compile_factors"))
        if device.compile_notes is not None:
            out["compile_factors"]["notes"] = device.compile_notes
    if device.optimizer_factors:
        out["optimizer_factors"] = _factor_table_dict(device.optimizer_factors, src("optimizer_factors"))
    if device.concurrency_efficiency is not None:
        out["concurrency_efficiency"] = _curve_dict(device.concurrency_efficiency)
    if device.communication_overlap != 1.0 or "communication_overlap" in device.sources:
        out["communication_overlap"] = _number(device.communication_overlap, src("communication_overlap"))
    if device.host_dispatch_s or "host_dispatch_us" in device.sources:
        out["host_dispatch_us"] = _number(_us(device.host_dispatch_s), src("host_dispatch_us"))
    if device.host_jitter_s or "host_jitter_us" in device.sources:
        out["host_jitter_us"] = _number(_us(device.host_jitter_s), src("host_jitter_us"))
    if device.pipelined_sync_s or "pipelined_sync_us" in device.sources:
        out["pipelined_sync_us"] = _number(_us(device.pipelined_sync_s), src("pipelined_sync_us"))
    if device.collective_call_overhead_s or "collective_call_overhead_us" in device.sources:
        out["collective_call_overhead_us"] = _number(_us(device.collective_call_overhead_s),
                                                     src("collective_call_overhead_us"))
    if device.activation_collective_factor != 1.0 or "activation_collective_factor" in device.sources:
        out["activation_collective_factor"] = _number(device.activation_collective_factor,
                                                      src("activation_collective_factor"))
    if device.allocator_reserve_fraction is not None:
        out["allocator_reserve_fraction"] = _number(device.allocator_reserve_fraction, src("allocator_reserve_fraction"))
    return out


def _factor_table_dict(table: dict[str, FactorCurve], source: str | None) -> dict:
    factors = {key: [[x, f] for x, f in curve.points] for key, curve in sorted(table.items())}
    return {"source": source or NOT_RECORDED, "factors": factors}


def _link_dict(link: LinkLevel) -> dict:
    out = {
        "bandwidth_gbps": _number(link.bandwidth / 1e9, link.sources.get("bandwidth_gbps")),
        "latency_us": _number(_us(link.latency_s), link.sources.get("latency_us")),
        "efficiency": _curve_dict(link.efficiency),
        "sharp": link.sharp,
    }
    if link.collective_factors:
        out["collective_factors"] = _factor_table_dict(link.collective_factors, link.sources.get("collective_factors"))
    if link.node_scaling is not None:
        out["node_scaling"] = _curve_dict(link.node_scaling)
    if link.collective_node_scaling:
        out["collective_node_scaling"] = {k: _curve_dict(c) for k, c in sorted(link.collective_node_scaling.items())}
    notes = link.extras.get("notes")
    fit = dict(link.extras.get("fit", {}))
    if link.sharp_all_reduce_factor != 1.0:
        fit["sharp_all_reduce_factor"] = link.sharp_all_reduce_factor
    if fit:
        out["fit"] = fit
    if notes is not None:
        out["notes"] = notes
    return out


def cluster_to_dict(cluster: ClusterSpec) -> dict:
    """The inline JSON form (cluster with its device profile, provenance kept)."""
    out: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "name": cluster.name,
        "description": cluster.description or cluster.name,
        "device": device_to_dict(cluster.device),
        "gpus_per_node": cluster.gpus_per_node,
        "tp_across_nodes": cluster.tp_across_nodes,
    }
    if cluster.nvlink_domain is not None:
        out["nvlink_domain"] = cluster.nvlink_domain
    if cluster.host_memory_bytes is not None:
        out["host_memory_gib"] = _number(cluster.host_memory_bytes / GIB, cluster.sources.get("host_memory_gib"))
    out["links"] = {"intra_node": _link_dict(cluster.intra_node), "inter_node": _link_dict(cluster.inter_node)}
    return out

