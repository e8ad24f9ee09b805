"""Device and cluster profiles: the hardware numbers every cost is computed from.

INTERFACE STUB written before the cost-model work started; the cost-model owner replaces the bodies
(and may add fields with defaults) but keeps these names and signatures.

Numbers are data in `profiles/devices/*.json` and `profiles/clusters/*.json`, each with its source.
Units inside Python are SI: FLOP/s, bytes, bytes/s, seconds.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EfficiencyCurve:
    """Piecewise-linear efficiency (0..1] against a size axis (log-interpolated), from profile data."""

    points: tuple[tuple[float, float], ...]

    def at(self, x: float) -> float:
        raise NotImplementedError


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

    @property
    def supports_fp8(self) -> bool:
        return "fp8" in self.peak_flops


@dataclass(frozen=True)
class LinkLevel:
    name: str
    bandwidth: float
    """Per-GPU unidirectional bytes/s available to a collective at this level (the busbw ceiling)."""
    latency_s: float
    efficiency: EfficiencyCurve
    """Achieved fraction of `bandwidth` against message bytes."""
    sharp: bool = False


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    device: DeviceProfile
    gpus_per_node: int
    intra_node: LinkLevel
    inter_node: LinkLevel
    tp_across_nodes: bool = False


def load_device(name_or_path: str) -> DeviceProfile:
    raise NotImplementedError


def load_cluster(name_or_path: str) -> ClusterSpec:
    raise NotImplementedError


def cluster_from_dict(data: dict) -> ClusterSpec:
    """Build a ClusterSpec from the inline JSON form stored in plan.json (validated)."""
    raise NotImplementedError


def cluster_to_dict(cluster: ClusterSpec) -> dict:
    """The inline JSON form (cluster with its device profile, provenance kept)."""
    raise NotImplementedError
