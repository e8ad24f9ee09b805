"""Device and cluster profiles: the hardware numbers every cost is computed from.

Numbers are data in `profiles/devices/*.json` and `profiles/clusters/*.json` (format:
the profile schema, version 1). Every number is `{"value": x, "source": "..."}` and every curve is
`{"points": [[x, eff], ...], "source": "..."}`, so a profile says where each figure came from: a
datasheet, a published measurement, an assumption, or `soap calibrate`.

Units inside Python are SI: FLOP/s, bytes, bytes/s, seconds. The JSON uses TFLOP/s, GiB, GB/s
(1e9 bytes/s), microseconds; `_device_from_json` and `_link_from_json` convert.

Loading is strict (`_Reader`): an unknown key, a missing source, a zero or negative bandwidth, an
efficiency outside (0, 1] or a curve whose x does not increase raises SoapError naming the file and the
field. The inline form stored in plan.json (`cluster_to_dict` / `cluster_from_dict`) is the cluster JSON
with the device JSON embedded under "device"; it keeps every source, so a plan carries its provenance.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tracer.errors import SoapError

PROFILES_DIR = Path(__file__).resolve().parents[1] / "profiles"
SCHEMA_VERSION = 1
PRECISION_KEYS = ("fp32", "tf32", "fp16", "bf16", "fp8")
GIB = 2**30
NOT_RECORDED = "not recorded: built in code"


@dataclass(frozen=True)
class EfficiencyCurve:
    """Piecewise-linear efficiency (0..1] against a size axis (log-interpolated), from profile data."""

    points: tuple[tuple[float, float], ...]
    source: str = field(default=NOT_RECORDED, compare=False)
    extras: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)
    """The curve's optional `fit` / `notes` objects, kept verbatim for round trips."""

    def __post_init__(self) -> None:
        if not self.points:
            raise SoapError("an efficiency curve needs at least one point")

    def at(self, x: float) -> float:
        """Efficiency at size `x`: linear in log(x) between points, clamped at both ends."""
        pts = self.points
        if x <= pts[0][0]:
            return pts[0][1]
        if x >= pts[-1][0]:
            return pts[-1][1]
        lx = math.log(x)
        for (x0, e0), (x1, e1) in zip(pts, pts[1:]):
            if x <= x1:
                w = (lx - math.log(x0)) / (math.log(x1) - math.log(x0))
                return e0 + w * (e1 - e0)
        return pts[-1][1]  # unreachable: x < pts[-1][0] was handled by the loop


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    peak_flops: dict[str, float]
    """FLOP/s per precision: fp32, tf32, fp16, bf16, fp8 (absent where unsupported)."""
    memory_bytes: int
    memory_bandwidth: float
    """bytes/s."""
    matmul_efficiency: EfficiencyCurve
    memory_efficiency: EfficiencyCurve
    kernel_overhead_s: float
    context_bytes: int
    """Framework + CUDA context overhead per process."""
    host_bandwidth: float
    """bytes/s between device and host memory (offload)."""
    description: str = ""
    dtype_efficiency: Mapping[str, float] = field(default_factory=dict, compare=False, hash=False)
    """Optional extra multiplier on the peak per precision (1.0 where absent)."""
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, hash=False)
    """Provenance per JSON field path, e.g. `peak_tflops.bf16` -> "NVIDIA PB-11133"."""

    @property
    def supports_fp8(self) -> bool:
        return "fp8" in self.peak_flops

    def effective_peak(self, precision: str) -> float:
        """Peak FLOP/s at `precision` times its optional dtype efficiency."""
        if precision not in self.peak_flops:
            have = ", ".join(k for k in PRECISION_KEYS if k in self.peak_flops)
            raise SoapError(f"device {self.name} has no {precision} rate; choose one of {have}")
        return self.peak_flops[precision] * self.dtype_efficiency.get(precision, 1.0)


@dataclass(frozen=True)
class LinkLevel:
    name: str
    bandwidth: float
    """Per-GPU unidirectional bytes/s available to a collective at this level (the busbw ceiling)."""
    latency_s: float
    efficiency: EfficiencyCurve
    """Achieved fraction of `bandwidth` against message bytes."""
    sharp: bool = False
    sharp_all_reduce_factor: float = 1.0
    """Bus factor of an in-network (SHARP/NVLS) all-reduce in place of the ring's 2(n-1)/n; from the
    link's `fit.sharp_all_reduce_factor` where a measurement gives it."""
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, hash=False)
    extras: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)
    """The link's optional `fit` / `notes` objects, kept verbatim."""


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    device: DeviceProfile
    gpus_per_node: int
    intra_node: LinkLevel
    inter_node: LinkLevel
    tp_across_nodes: bool = False
    description: str = ""


# ---------------------------------------------------------------------------------------------
# Strict reading


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

    def curve(self, data: Any, path: str) -> EfficiencyCurve:
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
            if not 0 < eff <= 1:
                raise self.fail(f"{path}.points[{i}]", f"efficiency must be in (0, 1], got {eff}")
            if parsed and x <= parsed[-1][0]:
                raise self.fail(f"{path}.points[{i}]", f"x must increase, got {x} after {parsed[-1][0]}")
            parsed.append((x, eff))
        extras = {k: data[k] for k in ("fit", "notes") if k in data}
        return EfficiencyCurve(tuple(parsed), source=self.text(data, "source", path), extras=extras)


_DEVICE_REQUIRED = {
    "schema_version", "name", "description", "memory_gib", "peak_tflops", "memory_bandwidth_gbps",
    "matmul_efficiency", "memory_efficiency", "kernel_overhead_us", "context_overhead_gib", "host_link_gbps",
}
_CLUSTER_REQUIRED = {"schema_version", "name", "description", "device", "gpus_per_node", "tp_across_nodes", "links"}
_LINK_REQUIRED = {"bandwidth_gbps", "latency_us", "efficiency", "sharp"}


def _check_version(r: _Reader, data: dict) -> None:
    if data["schema_version"] != SCHEMA_VERSION:
        raise r.fail("schema_version", f"unsupported version {data['schema_version']!r}, expected {SCHEMA_VERSION}")


def _device_from_json(data: Any, origin: str) -> DeviceProfile:
    r = _Reader(origin)
    r.obj(data, "<root>", _DEVICE_REQUIRED, {"dtype_efficiency", "notes"})
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
    matmul = r.curve(data["matmul_efficiency"], "matmul_efficiency")
    memory = r.curve(data["memory_efficiency"], "memory_efficiency")
    return DeviceProfile(
        name=r.text(data, "name", ""),
        description=r.text(data, "description", ""),
        peak_flops=peak_flops,
        memory_bytes=int(num("memory_gib") * GIB),
        memory_bandwidth=num("memory_bandwidth_gbps") * 1e9,
        matmul_efficiency=matmul,
        memory_efficiency=memory,
        kernel_overhead_s=num("kernel_overhead_us", positive=False) * 1e-6,
        context_bytes=int(num("context_overhead_gib", positive=False) * GIB),
        host_bandwidth=num("host_link_gbps") * 1e9,
        dtype_efficiency=dtype_eff,
        sources=sources,
    )


def _link_from_json(r: _Reader, data: Any, path: str) -> LinkLevel:
    r.obj(data, path, _LINK_REQUIRED, {"fit", "notes"})
    bandwidth, bw_src = r.number(data["bandwidth_gbps"], f"{path}.bandwidth_gbps")
    latency, lat_src = r.number(data["latency_us"], f"{path}.latency_us", positive=False)
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
        sources={"bandwidth_gbps": bw_src, "latency_us": lat_src},
        extras={k: data[k] for k in ("fit", "notes") if k in data},
    )


def _cluster_from_json(data: Any, origin: str, device_dir: Path | None) -> ClusterSpec:
    r = _Reader(origin)
    r.obj(data, "<root>", _CLUSTER_REQUIRED, {"notes"})
    _check_version(r, data)
    device_ref = data["device"]
    if isinstance(device_ref, dict):
        device = _device_from_json(device_ref, f"{origin} (inline device)")
    elif isinstance(device_ref, str) and device_ref:
        device = _device_by_name(device_ref, origin, device_dir)
    else:
        raise r.fail("device", "must be a device profile name or an inline device object")
    links = r.obj(data["links"], "links", {"intra_node", "inter_node"})
    return ClusterSpec(
        name=r.text(data, "name", ""),
        description=r.text(data, "description", ""),
        device=device,
        gpus_per_node=r.integer(data, "gpus_per_node", ""),
        tp_across_nodes=r.flag(data, "tp_across_nodes", ""),
        intra_node=_link_from_json(r, links["intra_node"], "links.intra_node"),
        inter_node=_link_from_json(r, links["inter_node"], "links.inter_node"),
    )


# ---------------------------------------------------------------------------------------------
# Finding files


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except OSError as exc:
        raise SoapError(f"cannot read profile {path}: {exc.strerror}; check the path") from None
    except json.JSONDecodeError as exc:
        raise SoapError(f"profile {path} is not valid JSON (line {exc.lineno}: {exc.msg}); fix the file") from None


def _names(kind: str) -> list[str]:
    return sorted(p.stem for p in (PROFILES_DIR / kind).glob("*.json"))


def list_devices() -> list[str]:
    """Names of the shipped device profiles (local-cpu only once `soap calibrate` has written it)."""
    return _names("devices")


def list_clusters() -> list[str]:
    """Names of the shipped cluster profiles (local-cpu only once `soap calibrate` has written it)."""
    return _names("clusters")


def _looks_like_path(name_or_path: str) -> bool:
    return name_or_path.endswith(".json") or "/" in name_or_path or Path(name_or_path).is_file()


def _missing(kind: str, name: str) -> SoapError:
    if name == "local-cpu":
        return SoapError(f"no local-cpu {kind} profile yet; run `soap calibrate` to measure this machine")
    choices = ", ".join(_names(f"{kind}s")) or "none shipped"
    return SoapError(f"unknown {kind} {name!r}; choose one of {choices}, or give a JSON file path")


def _device_by_name(name: str, origin: str, device_dir: Path | None) -> DeviceProfile:
    for folder in (device_dir, PROFILES_DIR / "devices"):
        if folder is not None and (folder / f"{name}.json").is_file():
            path = folder / f"{name}.json"
            return _device_from_json(_read_json(path), str(path))
    raise SoapError(f"profile {origin}: field device: {_missing('device', name)}")


def load_device(name_or_path: str) -> DeviceProfile:
    """A device profile by shipped name (`h100-sxm`) or JSON file path, validated."""
    path = Path(name_or_path) if _looks_like_path(name_or_path) else PROFILES_DIR / "devices" / f"{name_or_path}.json"
    if not path.is_file():
        if _looks_like_path(name_or_path):
            raise SoapError(f"device profile file {name_or_path} does not exist; check the path")
        raise _missing("device", name_or_path)
    return _device_from_json(_read_json(path), str(path))


def load_cluster(name_or_path: str) -> ClusterSpec:
    """A cluster profile by shipped name (`dgx-h100`) or JSON file path, validated with its device.

    A file's device name is looked up next to it (`../devices/NAME.json`) and then among the shipped
    devices; a file may also embed the device object inline (the plan.json form)."""
    if _looks_like_path(name_or_path):
        path = Path(name_or_path)
        if not path.is_file():
            raise SoapError(f"cluster profile file {name_or_path} does not exist; check the path")
        device_dir = path.resolve().parent.parent / "devices"
    else:
        path = PROFILES_DIR / "clusters" / f"{name_or_path}.json"
        if not path.is_file():
            raise _missing("cluster", name_or_path)
        device_dir = None
    return _cluster_from_json(_read_json(path), str(path), device_dir)


def check_profile(name_or_path: str) -> DeviceProfile | ClusterSpec:
    """Validate one profile: a JSON file (device or cluster, told apart by the `links` key) or a
    shipped name (clusters first, then devices)."""
    if not _looks_like_path(name_or_path):
        if (PROFILES_DIR / "clusters" / f"{name_or_path}.json").is_file():
            return load_cluster(name_or_path)
        if (PROFILES_DIR / "devices" / f"{name_or_path}.json").is_file():
            return load_device(name_or_path)
        raise SoapError(
            f"no device or cluster profile named {name_or_path!r}; choose one of "
            f"{', '.join(list_clusters() + list_devices())}, or give a JSON file path"
        )
    data = _read_json(Path(name_or_path))
    if isinstance(data, dict) and "links" in data:
        return load_cluster(name_or_path)
    return _device_from_json(data, name_or_path)


# ---------------------------------------------------------------------------------------------
# The inline form (plan.json)


def cluster_from_dict(data: dict) -> ClusterSpec:
    """Build a ClusterSpec from the inline JSON form stored in plan.json (validated)."""
    return _cluster_from_json(data, "inline cluster (plan.json)", None)


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
        "memory_gib": _number(device.memory_bytes / GIB, src("memory_gib")),
        "peak_tflops": {
            k: _number(device.peak_flops[k] / 1e12, src(f"peak_tflops.{k}")) for k in PRECISION_KEYS if k in device.peak_flops
        },
        "memory_bandwidth_gbps": _number(device.memory_bandwidth / 1e9, src("memory_bandwidth_gbps")),
        "matmul_efficiency": _curve_dict(device.matmul_efficiency),
        "memory_efficiency": _curve_dict(device.memory_efficiency),
        "kernel_overhead_us": _number(device.kernel_overhead_s * 1e6, src("kernel_overhead_us")),
        "context_overhead_gib": _number(device.context_bytes / GIB, src("context_overhead_gib")),
        "host_link_gbps": _number(device.host_bandwidth / 1e9, src("host_link_gbps")),
    }
    if device.dtype_efficiency:
        out["dtype_efficiency"] = {**device.dtype_efficiency, "source": src("dtype_efficiency") or NOT_RECORDED}
    return out


def _link_dict(link: LinkLevel) -> dict:
    out = {
        "bandwidth_gbps": _number(link.bandwidth / 1e9, link.sources.get("bandwidth_gbps")),
        "latency_us": _number(link.latency_s * 1e6, link.sources.get("latency_us")),
        "efficiency": _curve_dict(link.efficiency),
        "sharp": link.sharp,
    }
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
    return {
        "schema_version": SCHEMA_VERSION,
        "name": cluster.name,
        "description": cluster.description or cluster.name,
        "device": device_to_dict(cluster.device),
        "gpus_per_node": cluster.gpus_per_node,
        "tp_across_nodes": cluster.tp_across_nodes,
        "links": {"intra_node": _link_dict(cluster.intra_node), "inter_node": _link_dict(cluster.inter_node)},
    }
