"""Device and cluster profiles: the hardware numbers every cost is computed from.

Numbers are data in `profiles/devices/*.json` and `profiles/clusters/*.json` (format:
the profile schema, version 1). Every number is `{"value": x, "source": "..."}` and every curve is
`{"points": [[x, eff], ...], "source": "..."}`, so a profile says where each figure came from: a
datasheet, a published measurement, an assumption, or `soap calibrate`.

Units inside Python are SI: FLOP/s, bytes, bytes/s, seconds. The JSON uses TFLOP/s, GiB, GB/s
(1e9 bytes/s), microseconds; `costmodel.profiles_json` reads (strictly) and writes the format.

Loading is strict (`profiles_json._Reader`): an unknown key, a missing source, a zero or negative bandwidth, an
efficiency outside (0, 1] or a curve whose x does not increase raises SoapError naming the file and the
field. Two optional tables say how much slower (or faster) one kind of work runs than the shared curves
predict, as data (`FactorCurve`, positive factors against a size axis): a device's `kernel_factors`
(key `class/precision`, classes `KERNEL_CLASSES`, read by `costmodel.opcost`) and a link's
`collective_factors` (key `kind/ranks`, read by `costmodel.collectives`). GPU profiles leave them
out, which means a factor of 1.

A third, `compile_factors` (key `class/pass`, pass `fwd` or `bwd`, the same classes), is torch.compile's
time over eager's per kernel class, measured by `costmodel.calibration.microbench_compile` and read by
`costmodel.opcost` when a strategy compiles. Absent (every GPU profile: no published per-class figure
to put there) compile is priced as no change, so the search never picks it for nothing.

Three more optional device fields say how a rank behaves inside a training step rather than alone,
for machines whose ranks share more than a GPU's ranks do (a CPU whose cores are the ranks):
`optimizer_factors` (key `optimizer/precision`, the optimizer step against its memory-bound estimate,
read by `costmodel.optimizer_step`), `concurrency_efficiency` (the share of its alone speed a rank's
kernels keep while N ranks of the node compute at once, read by the simulator's pricer),
`communication_overlap` (the fraction of a collective's time the rank's compute can run beside it, read
by `costmodel.simulator.step`), `activation_collective_factor` (TP/SP/CP/EP collectives in a step against
their microbenchmark, read by `costmodel.simulator.pricing`), `collective_call_overhead_us` (host time a training framework spends
per collective it issues, read by the simulator's pricer), `host_dispatch_us` (host time per kernel an eager
framework dispatches: the host-bound floor of a chunk, `costmodel.simulator.pricing`) and `host_jitter_us` (the
spread of the hosts' arrival at a synchronous activation collective, `costmodel.host_sync`) and `pipelined_sync_us`
(the wait per rank of such a collective's group in a pipelined run, `costmodel.host_sync.chain_wait`). Absent, they are neutral (factor 1,
efficiency 1, overlap 1, overhead 0): a GPU's optimizer is one fused kernel pass, its neighbours do not
slow its kernels, NCCL runs beside compute, and the host's per-call work hides behind queued kernels. The inline form stored in plan.json (`cluster_to_dict` / `cluster_from_dict`) is the cluster JSON
with the device JSON embedded under "device"; it keeps every source, so a plan carries its provenance.

Memory beyond the device's own:
- A cluster's `host_memory_gib` (`ClusterSpec.host_memory_bytes`) is the host RAM of one node, with its
  source (a datasheet, or measured). Offload plans must fit it, all ranks of a node together
  (`planner.host_memory`). Every shipped cluster carries it; in a user's older file (or an older plan.json)
  it may be absent, which loads as unknown (None): such a cluster's offload plans are not checked
  against host memory, rather than refusing files that were valid when written.
- A device's optional `allocator_reserve_fraction` is what PyTorch's caching allocator reserves beyond
  the tensors it hands out and the segment of the loss's largest fp32 transient (fragmentation, per-stream
  pools), relative to the allocated peak, fitted from runs by `soap calibrate --from-runs`; CUDA runs out of
  memory when the reserved bytes reach the device's.
  With it, soap predicts reserved memory (`costmodel.memory.reserve_bytes`); without it, allocated memory
  (`DeviceProfile.predicted_memory_kind` says which).

Where profiles are found by name: the user's profile folder first (`user_profiles_dir`: what `soap
calibrate` and `soap calibrate --from-runs` write, `$SOAP_PROFILES_DIR`, default
`$XDG_CACHE_HOME/soap/profiles` or `~/.cache/soap/profiles`), then the shipped `profiles/` (`PROFILES_DIR`),
which soap never writes. A profile measured on this machine therefore replaces a shipped one of the same name
(local-cpu).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tracer.errors import SoapError
from tracer.files import read_json

PROFILES_DIR = Path(__file__).resolve().parents[1] / "profiles"
SCHEMA_VERSION = 1
PRECISION_KEYS = ("fp32", "tf32", "fp16", "bf16", "fp8")
GIB = 2**30
NOT_RECORDED = "not recorded: built in code"


KERNEL_CLASSES = ("matmul", "attention", "arithmetic", "transcendental", "softmax", "norm", "dropout")
"""Kernel classes a device's `kernel_factors` may name (`costmodel.opcost.kernel_class` maps ops to them)."""
UNALIGNED_MATMUL = "matmul-unaligned"
"""A `kernel_factors` class besides `KERNEL_CLASSES`: a matmul with a dimension off the 16-byte alignment
(`costmodel.opcost.unaligned_matmul`), as a factor over the device's matmul curve, replacing `matmul`'s."""
COMPILE_PASSES = ("fwd", "bwd")
"""The passes a device's `compile_factors` name: a kernel class's forward and its backward."""


def log_interpolate(points: tuple[tuple[float, float], ...], x: float) -> float:
    """y at `x` on a piecewise-linear curve in log(x), clamped at both ends."""
    if x <= points[0][0]:
        return points[0][1]
    if x >= points[-1][0]:
        return points[-1][1]
    lx = math.log(x)
    for (x0, e0), (x1, e1) in zip(points, points[1:]):
        if x <= x1:
            w = (lx - math.log(x0)) / (math.log(x1) - math.log(x0))
            return e0 + w * (e1 - e0)
    return points[-1][1]  # unreachable: x < points[-1][0] was handled by the loop


@dataclass(frozen=True)
class FactorCurve:
    """A positive time multiplier against a size axis (log-interpolated, clamped), from profile data."""

    points: tuple[tuple[float, float], ...]

    def at(self, x: float) -> float:
        return log_interpolate(self.points, x)


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
        return log_interpolate(self.points, x)


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
    kind: str = "gpu"
    """What runs a rank: "gpu" (a CUDA or ROCm device: torch's `cuda`) or "cpu" (a process on the host, as
    `soap calibrate --device cpu` measures it). `soap execute` refuses a GPU plan on a host without one."""
    runtime_workspace_bytes: int = 0
    """Memory a training process allocates beyond the tensors the model counts (allocator, communication
    library and autograd workspaces), on top of `context_bytes`; optional (0: not measured)."""
    dtype_efficiency: Mapping[str, float] = field(default_factory=dict, compare=False, hash=False)
    """Optional extra multiplier on the peak per precision (1.0 where absent)."""
    kernel_factors: Mapping[str, FactorCurve] = field(default_factory=dict, compare=False, hash=False)
    """Optional time multiplier per `class/precision` (e.g. `softmax/bf16`) against the kernel's FLOPs
    (matmul, attention) or bytes (the rest); 1.0 where absent. Provenance under `sources["kernel_factors"]`."""
    compile_factors: Mapping[str, FactorCurve] = field(default_factory=dict, compare=False, hash=False)
    """Optional torch.compile time multiplier per `class/pass` (e.g. `tanh/fwd`, `norm/bwd`), against the
    kernel's FLOPs (matmul, attention) or bytes (the rest); 1.0 where absent (compile gains nothing).
    Provenance under `sources["compile_factors"]`."""
    compile_notes: Any = field(default=None, compare=False, hash=False)
    """The `compile_factors` table's optional `notes` (how it was measured, the raw chain ratios), verbatim."""
    optimizer_factors: Mapping[str, FactorCurve] = field(default_factory=dict, compare=False, hash=False)
    """Optional time multiplier per `optimizer/precision` (e.g. `adamw/fp32`) of the optimizer step against
    its memory-bound estimate, against the bytes that estimate counts (`costmodel.optimizer_step`); 1.0
    where absent. A CPU's foreach AdamW makes about a dozen passes over its state, not one."""
    concurrency_efficiency: EfficiencyCurve | None = field(default=None, compare=False, hash=False)
    """Optional share (0, 1] of its alone speed a rank's kernels keep against the number of ranks of one
    node computing at once (x = 1, 2, 4, ...); None: 1 (each GPU has its own SMs and memory)."""
    collective_call_overhead_s: float = 0.0
    """Host time a training framework (FSDP2, DTensor, DDP) spends per collective it issues, beyond the
    collective itself; 0 where absent."""
    host_dispatch_s: float = 0.0
    """Host (CPU) time the training framework spends per kernel it dispatches in eager mode (Python, autograd,
    the launch): a chunk's forward or backward takes at least its kernel count times this, however short its
    kernels (`costmodel.simulator.pricing`, the host-bound floor). 0: no floor. A stack's value is fitted from
    its runs: soap's own executor's in the default H100/H200 (benchmarks/gpu_repredict.py), other stacks' in their
    benchmarks only (e.g. benchmarks/vtrain_tp.py)."""
    host_jitter_s: float = 0.0
    """Standard deviation of a rank's host arrival at a synchronous activation collective (TP/SP/CP/EP): each
    one waits for the slowest of its group's hosts, `costmodel.host_sync`. 0: no wait (the shipped profiles;
    like `host_dispatch_s` a stack's value, fitted from its runs, e.g. benchmarks/vtrain_tp.py)."""
    pipelined_sync_s: float = 0.0
    """Wait per rank of its group that a synchronous activation collective (TP/SP/CP/EP) adds in a pipelined run
    (pp > 1), `costmodel.host_sync.chain_wait`. 0: none (the shipped profiles; a stack's value, fitted from its
    runs, e.g. benchmarks/playbook_grid.py)."""
    communication_overlap: float = 1.0
    """Fraction [0, 1] of a collective's time the rank's compute can run beside it; the rest occupies the
    compute stream too (gloo's threads need the CPU cores the ranks compute on). 1 where absent."""
    activation_collective_factor: float = 1.0
    """Time multiplier on the activation collectives of TP / SP / CP / EP (synchronous, one per region,
    issued through DTensor, every rank waiting for the slowest) against the same collective priced from
    the links, beyond what gradient and parameter collectives pay; fitted from runs by `soap calibrate
    --from-runs`. 1 where absent."""
    allocator_reserve_fraction: float | None = None
    """What PyTorch's caching allocator reserves beyond what tensors hold at the peak, as a fraction of the
    allocated peak (fragmentation, per-stream pools): reserved = allocated x (1 + fraction). Fitted by
    `soap calibrate --from-runs` from runs that report both `max_memory_allocated` and
    `max_memory_reserved`; None: not fitted, and soap predicts allocated memory (`predicted_memory_kind`)."""
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, hash=False)
    """Provenance per JSON field path, e.g. `peak_tflops.bf16` -> "NVIDIA PB-11133"."""

    @property
    def rank_noun(self) -> str:
        """What one rank is, in messages: "CPU process" on a CPU profile (`kind` cpu, as `soap calibrate
        --device cpu` writes it), else "GPU"."""
        return "CPU process" if self.kind == "cpu" else "GPU"

    @property
    def predicts_reserved_memory(self) -> bool:
        """Whether predicted device memory is the allocator's reserved peak (a reserve is fitted) rather
        than its allocated peak."""
        return self.allocator_reserve_fraction is not None

    @property
    def predicted_memory_kind(self) -> str:
        """"reserved" when the profile has a fitted allocator reserve, else "allocated": which of
        `torch.cuda.max_memory_reserved` / `max_memory_allocated` soap's memory predictions stand for."""
        return "reserved" if self.predicts_reserved_memory else "allocated"

    @property
    def compile_pays(self) -> bool:
        """Whether torch.compile makes any kernel class faster on this device (a compile factor below 1
        somewhere); when not, the search leaves compile off unless it is pinned."""
        return any(f < 1.0 for curve in self.compile_factors.values() for _, f in curve.points)

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
    collective_factors: Mapping[str, FactorCurve] = field(default_factory=dict, compare=False, hash=False)
    """Optional time multiplier per `kind/ranks` (e.g. `reduce_scatter/4`) against message bytes; 1.0
    where absent. Provenance under `sources["collective_factors"]`."""
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, hash=False)
    extras: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)
    """The link's optional `fit` / `notes` objects, kept verbatim."""
    node_scaling: EfficiencyCurve | None = field(default=None, compare=False, hash=False)
    """Optional multiplier on this level's achieved bandwidth against the number of nodes a collective's
    group spans (x = nodes, log-interpolated, clamped at the ends): the fabric's measured fall-off with
    scale (`costmodel.collectives` module docstring). None: 1 at every node count."""
    collective_node_scaling: Mapping[str, EfficiencyCurve] = field(default_factory=dict, compare=False, hash=False)
    """Optional per-collective `node_scaling` (key: the collective, e.g. `all_gather`), used for that collective
    in place of `node_scaling`: measured fall-offs differ by collective (the Playbook's EFA cluster: all-reduce
    362 -> 33 GB/s, all-gather 185 -> 11 GB/s from 2 to 64 nodes)."""

    def scale_at(self, nodes: float, kind: str | None = None) -> float:
        """The `node_scaling` factor (`kind`'s own curve where the link has one) for a group spanning `nodes`
        nodes (1 inside one node or without a curve)."""
        if nodes <= 1:
            return 1.0
        curve = self.collective_node_scaling.get(kind, self.node_scaling) if kind else self.node_scaling
        return curve.at(nodes) if curve is not None else 1.0


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    device: DeviceProfile
    gpus_per_node: int
    intra_node: LinkLevel
    inter_node: LinkLevel
    tp_across_nodes: bool = False
    description: str = ""
    host_memory_bytes: int | None = None
    """Host RAM of one node (bytes), which the offloaded model state of all its ranks must fit in
    (`planner.host_memory`); None: not recorded (a profile written before it was a field), and then
    offload plans are not checked against host memory."""
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, hash=False)
    """Provenance of the cluster's own numbers (`host_memory_gib`)."""
    nvlink_domain: int | None = None
    """GPUs that share one NVLink fabric (72 on a GB200 NVL72 rack), when larger than a node; None: the
    node is the domain. Groups inside a domain use `intra_node`, groups that leave it `inter_node`."""

    @property
    def domain_size(self) -> int:
        """GPUs per NVLink domain: `nvlink_domain`, or the node."""
        return self.nvlink_domain or self.gpus_per_node


# ---------------------------------------------------------------------------------------------
# Finding files


def _read_json(path: Path, kind: str = "") -> Any:
    return read_json(path, what=f"{kind} profile".lstrip(), fix="fix the file or check the path")


def _is_file(path: Path) -> bool:
    """`path.is_file()`, False for a name the file system refuses (too long, a NUL byte)."""
    try:
        return path.is_file()
    except (OSError, ValueError):
        return False


def user_profiles_dir() -> Path:
    """The user's profile folder (`devices/` and `clusters/` inside): `$SOAP_PROFILES_DIR`, else
    `$XDG_CACHE_HOME/soap/profiles` (default `~/.cache/soap/profiles`)."""
    import os

    if os.environ.get("SOAP_PROFILES_DIR"):
        return Path(os.environ["SOAP_PROFILES_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "soap" / "profiles"


def user_profile_paths(device: str, cluster: str) -> tuple[Path, Path]:
    """Where a profile written by soap goes: `devices/DEVICE.json` and `clusters/CLUSTER.json` in
    `user_profiles_dir`."""
    root = user_profiles_dir()
    return root / "devices" / f"{device}.json", root / "clusters" / f"{cluster}.json"


def _profile_path(kind: str, name: str) -> Path | None:
    """The file of profile `name` (kind `devices` or `clusters`): the user's first, then the shipped one."""
    for root in (user_profiles_dir(), PROFILES_DIR):
        if _is_file(root / kind / f"{name}.json"):
            return root / kind / f"{name}.json"
    return None


def _names(kind: str) -> list[str]:
    return sorted({p.stem for root in (PROFILES_DIR, user_profiles_dir()) for p in (root / kind).glob("*.json")})


def list_devices() -> list[str]:
    """Names of the shipped device profiles and the user's (`user_profiles_dir`)."""
    return _names("devices")


def list_clusters() -> list[str]:
    """Names of the shipped cluster profiles and the user's (`user_profiles_dir`)."""
    return _names("clusters")


def _looks_like_path(name_or_path: str) -> bool:
    return name_or_path.endswith(".json") or "/" in name_or_path or _is_file(Path(name_or_path))


def _missing(kind: str, name: str) -> SoapError:
    if name == "local-cpu":
        return SoapError(f"no local-cpu {kind} profile yet; run `soap calibrate` to measure this machine")
    choices = ", ".join(_names(f"{kind}s")) or "none shipped"
    return SoapError(f"unknown {kind} {name!r}; choose one of {choices}, or give a JSON file path")


def _read_device(path: Path) -> DeviceProfile:
    from costmodel.profiles_json import device_from_json

    return device_from_json(_read_json(path, "device"), str(path))


def _read_cluster(path: Path, *, devices_beside: bool) -> ClusterSpec:
    """A cluster file; with `devices_beside`, its device name is looked up in `../devices/` first."""
    from costmodel.profiles_json import cluster_from_json

    data = _read_json(path, "cluster")
    device_dir = path.resolve().parent.parent / "devices" if devices_beside else None
    return cluster_from_json(data, str(path), lambda name: _device_by_name(name, str(path), device_dir))


def _device_by_name(name: str, origin: str, device_dir: Path | None) -> DeviceProfile:
    if device_dir is not None and _is_file(device_dir / f"{name}.json"):
        return _read_device(device_dir / f"{name}.json")
    path = _profile_path("devices", name)
    if path is not None:
        return _read_device(path)
    raise SoapError(f"profile {origin}: field device: {_missing('device', name)}")


def load_device(name_or_path: str) -> DeviceProfile:
    """A device profile by shipped name (`h100-sxm`) or JSON file path, validated."""
    if _looks_like_path(name_or_path):
        return _read_device(Path(name_or_path))
    path = _profile_path("devices", name_or_path)
    if path is None:
        raise _missing("device", name_or_path)
    return _read_device(path)


def load_cluster(name_or_path: str) -> ClusterSpec:
    """A cluster profile by shipped name (`dgx-h100`) or JSON file path, validated with its device.

    A file's device name is looked up next to it (`../devices/NAME.json`) and then among the shipped
    devices; a file may also embed the device object inline (the plan.json form)."""
    if _looks_like_path(name_or_path):
        return _read_cluster(Path(name_or_path), devices_beside=True)
    path = _profile_path("clusters", name_or_path)
    if path is None:
        raise _missing("cluster", name_or_path)
    return _read_cluster(path, devices_beside=False)


def check_profile(name_or_path: str) -> DeviceProfile | ClusterSpec:
    """Validate one profile: a JSON file (device or cluster, told apart by the `links` key) or a
    shipped name (clusters first, then devices)."""
    if not _looks_like_path(name_or_path):
        if _profile_path("clusters", name_or_path):
            return load_cluster(name_or_path)
        if _profile_path("devices", name_or_path):
            return load_device(name_or_path)
        raise SoapError(
            f"no device or cluster profile named {name_or_path!r}; choose one of "
            f"{', '.join(list_clusters() + list_devices())}, or give a JSON file path"
        )
    data = _read_json(Path(name_or_path))
    if isinstance(data, dict) and "links" in data:
        return load_cluster(name_or_path)
    return load_device(name_or_path)


# ---------------------------------------------------------------------------------------------
# The inline form (plan.json)


def cluster_from_dict(data: dict) -> ClusterSpec:
    """Build a ClusterSpec from the inline JSON form stored in plan.json (validated)."""
    from costmodel.profiles_json import cluster_from_json

    return cluster_from_json(data, "inline cluster (plan.json)", lambda name: _device_by_name(name, "inline cluster", None))


def device_to_dict(device: DeviceProfile) -> dict:
    """The device profile JSON (schema version 1), sources kept."""
    from costmodel.profiles_json import device_to_dict as to_dict

    return to_dict(device)


def cluster_to_dict(cluster: ClusterSpec) -> dict:
    """The inline JSON form (cluster with its device profile, provenance kept)."""
    from costmodel.profiles_json import cluster_to_dict as to_dict

    return to_dict(cluster)


def with_measured_factors(table: dict | None, factors: Mapping[str, Any], source: str) -> dict:
    """A factor table as profile JSON holds one (`{"source": ..., "factors": {class/precision: curve}}`, e.g.
    `kernel_factors`, `optimizer_factors`) with `factors` measured apart written over its own, their `source`
    appended once."""
    out = {"source": "", "factors": {}} if not table else dict(table)
    own = out.get("source", "")
    if source not in own:
        own = f"{own}; {source}" if own else source
    return {**out, "source": own, "factors": {**out.get("factors", {}), **factors}}
