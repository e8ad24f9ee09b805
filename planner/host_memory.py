"""Host memory per node: an offload plan must fit the host RAM of its nodes, all ranks of a node together.

Per rank (`HostMemoryCheck.rank_bytes`). FSDP2's `CPUOffloadPolicy` (the executor's offload,
`executor.data_parallel`) keeps in host memory the rank's fp32 parameter shard, its fp32 gradient shard
and the optimizer state: `costmodel.memory.MemoryBreakdown.host`, for P_r trainable elements on the rank,

    h_r = (4 + 4) P_r / dp_shard + state(P_r) / dp_shard.

Pinned memory. On CUDA the executor asks for `CPUOffloadPolicy(pin_memory=True)`: each parameter shard is
pinned where FSDP2 creates it, and each gradient shard is copied to the host into pinned memory (FSDP2's
non-blocking device-to-host copy); the optimizer state is ordinary pageable memory. No staging buffer
is allocated besides these: the pinned bytes are the shards themselves. But torch's pinned allocator
(`CachingHostAllocator`, torch 2.13 `ATen/core/CachingHostAllocator.h`; its `pinned_max_round_threshold`
is unlimited by default) rounds every pinned allocation up to a power of two, so a shard of b bytes
takes pow2(b) = 2^ceil(log2 b). Counted as

    h'_r = h_r (1 + s (rho - 1)),
    rho  = sum_i pow2(b_i) / sum_i b_i    over the trainable tensors' fp32 shards: each tensor's local
                                          shape (tp and ep shard dim 0, `costmodel.memory.stage_params`), dim 0
                                          split over dp_shard as FSDP2 pads it (ceil), 4 bytes per element;
    s    = 8 P / (8 P + state(P))         the pinned share of h_r,

both over the whole model's tensors (`pinned_rounding`): exact without a pipeline, the model's average
for each stage with one. (A CPU run pins nothing; there the check over-counts by this rounding at most.)

Per node (`node_bytes`). Ranks are numbered in DeviceMesh order with pp outermost
(`costmodel.strategy.MESH_DIM_NAMES`), and consecutive ranks share a node of g = gpus_per_node, so
node n holds ranks [n g, (n + 1) g), rank r runs pipeline stage r // (world / pp), and

    H = max_n  sum_{r in node n} h'_{stage(r)}.

The estimator knows only its worst pipeline rank (`Estimate.memory`): there H = h'_worst x min(world, g)
(`estimate_fits`; an upper bound, exact with pp = 1 or one stage per node); the simulator gives every
stage (`simulation_fits`).

Constraint: H <= the cluster's `host_memory_bytes` (100% of the node's RAM as the profile states it).
The operating system, the page cache, data loaders and every rank's Python process use host memory
too, so passing the check is necessary, not sufficient; a profile may state less than the installed RAM
to leave room for them. A cluster without host memory (a profile from before it was recorded) is not
checked. `--gpus-per-node` changes g, not the RAM per node.

When nothing fits and no offload plan fits host memory, the search says so (`host_memory_error` after
the estimates, `rejected_by_host_memory` after simulation) rather than quoting a device-memory floor that
assumes offload: the least host memory a mesh's most frugal offload plan needs (one that fits the device
where any does), per GPU and per node, and about how many GPUs would shard it into host memory.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from costmodel.memory import FSDP_GRAD_BYTES, FSDP_MASTER_BYTES, optimizer_state_bytes, stage_params
from costmodel.profiles import ClusterSpec
from costmodel.strategy import ParallelDims, TrainingConfig, shards_vocabulary
from planner.space import SpaceRequest, frugal_configs, mesh_choices
from tracer.errors import SoapError
from tracer.ir import OpGraph

GIB = 2**30
PINNED_BYTES_PER_ELEMENT = FSDP_MASTER_BYTES + FSDP_GRAD_BYTES
"""The fp32 parameter shard and its fp32 gradient: what `CPUOffloadPolicy(pin_memory=True)` pins."""
MAX_GPUS = 1 << 20


def pow2_ceil(nbytes: int) -> int:
    """The pinned allocator's block for `nbytes` (a power of two, at least 1)."""
    return 1 << max(0, nbytes - 1).bit_length()


def pinned_rounding(graph: OpGraph, *, tp: int, pp: int, dp_shard: int, optimizer: str, precision: str,
                    ep: int = 1) -> tuple[float, float]:
    """(rho, s) of the module docstring for the graph's trainable tensors."""
    counts = {b.id: b.count for b in graph.blocks}
    params = stage_params(graph.ops, block_counts=counts, tensor_parallel=tp, expert_parallel=ep,
                          vocab_parallel=shards_vocabulary(tp=tp, pp=pp))
    exact = rounded = 0
    for shape in params.shapes:
        rows, rest = (shape[0], math.prod(shape[1:])) if shape else (1, 1)
        nbytes = FSDP_MASTER_BYTES * math.ceil(rows / dp_shard) * rest
        exact += nbytes
        rounded += pow2_ceil(nbytes)
    rho = rounded / exact if exact else 1.0
    pinned = PINNED_BYTES_PER_ELEMENT * params.trainable
    state = optimizer_state_bytes(params.trainable, precision=precision, optimizer=optimizer,
                                  param_shapes=params.shapes)
    share = pinned / (pinned + state) if pinned + state else 0.0
    return rho, share


@dataclass
class HostMemoryCheck:
    """Host memory of one request's plans against its cluster's host RAM per node (module docstring)."""

    cluster: ClusterSpec
    gpus_per_node: int
    graph: OpGraph
    _rounding: dict[tuple, tuple[float, float]] = field(default_factory=dict, repr=False)

    @property
    def capacity_bytes(self) -> int | None:
        """Host RAM per node, None when the cluster profile does not record it."""
        return self.cluster.host_memory_bytes

    def rank_bytes(self, host: float, dims: ParallelDims, train: TrainingConfig) -> float:
        """h'_r: one rank's offloaded bytes `host` with the pinned allocator's rounding."""
        if host <= 0:
            return 0.0
        key = (dims.tp, dims.pp, dims.ep, dims.dp_shard, train.optimizer, train.precision)
        if key not in self._rounding:
            self._rounding[key] = pinned_rounding(self.graph, tp=dims.tp, pp=dims.pp, ep=dims.ep,
                                                  dp_shard=dims.dp_shard, optimizer=train.optimizer,
                                                  precision=train.precision)
        rho, share = self._rounding[key]
        return host * (1 + share * (rho - 1))

    def node_bytes(self, stage_host: Sequence[float], dims: ParallelDims, train: TrainingConfig) -> float:
        """H: the most host memory one node's ranks hold, from each pipeline stage's per-rank `host` bytes."""
        per_stage = [self.rank_bytes(h, dims, train) for h in stage_host]
        if not any(per_stage):
            return 0.0
        world, g = dims.world_size, self.gpus_per_node
        if len(set(per_stage)) == 1:
            return max(per_stage) * min(world, g)
        ranks = np.repeat(np.asarray(per_stage, dtype=float), world // len(per_stage))
        nodes = -(-ranks.size // g)
        padded = np.zeros(nodes * g)
        padded[:ranks.size] = ranks
        return float(padded.reshape(nodes, g).sum(axis=1).max())

    def fits_bytes(self, node: float) -> bool:
        return self.capacity_bytes is None or node <= self.capacity_bytes

    def estimate_fits(self, mesh: Any, train: TrainingConfig, estimate: Any) -> bool:
        """Whether an estimated candidate fits host memory (its worst pipeline rank on every rank of a node)."""
        if not train.offload_optimizer or self.capacity_bytes is None:
            return True
        return self.fits_bytes(self.node_bytes([estimate.memory.host], mesh.dims, train))

    def simulation_fits(self, dims: ParallelDims, train: TrainingConfig, result: Any) -> bool:
        """Whether a simulated plan fits host memory (`result.memory`: one entry per pipeline stage)."""
        if not train.offload_optimizer or self.capacity_bytes is None:
            return True
        return self.fits_bytes(self.simulated_node_bytes(dims, train, result))

    def simulated_node_bytes(self, dims: ParallelDims, train: TrainingConfig, result: Any) -> float:
        return self.node_bytes([m.at_peak.host for m in result.memory], dims, train)


@dataclass(frozen=True)
class HostNeed:
    """The host memory of the offload plan a host-memory error names."""

    per_gpu_bytes: float
    """Its most loaded rank's host bytes (pinned rounding included)."""
    node_bytes: float
    world: int


def _error(model: str, gpus: int, limit: float, need: HostNeed, check: HostMemoryCheck) -> SoapError:
    capacity = check.capacity_bytes or 0
    g = check.gpus_per_node
    more = need.world * 2
    # the offloaded state shards over data parallelism: a rank's share falls as 1 / world
    while more <= MAX_GPUS and min(more, g) * need.per_gpu_bytes * need.world / more > capacity:
        more *= 2
    hint = f"add GPUs (sharded over {more} GPUs it would fit)" if more <= MAX_GPUS else "add GPUs"
    return SoapError(
        f"{model} does not fit on {gpus} x {limit / GIB:g} GiB: offloading needs {need.per_gpu_bytes / GIB:.1f} GiB "
        f"of host memory per GPU, {need.node_bytes / GIB:.1f} GiB on a node with {capacity / GIB:.4g} GiB; "
        f"{hint}, or use nodes with more host memory"
    )


def host_memory_error(model: str, req: SpaceRequest, estimator: Any, limit: float,
                      check: HostMemoryCheck) -> SoapError | None:
    """The error when no offload plan fits host memory (None otherwise), for a request nothing fits.

    Each mesh's most memory-frugal offload configuration (smallest micro-batch, the strongest recompute
    policy) is a candidate; of those that fit the device (all of them when none does) the one needing the
    least host memory per node is named. When even it does not fit, host memory is what stops the plan: the
    device-memory floor the search would quote assumes an offload no node can hold."""
    if check.capacity_bytes is None:
        return None
    best: tuple[bool, float, HostNeed] | None = None
    for mesh in mesh_choices(req):
        for train in frugal_configs(req, mesh):
            if not train.offload_optimizer:
                continue
            est = estimator.estimate(mesh, train)
            node = check.node_bytes([est.memory.host], mesh.dims, train)
            key = (est.memory_bytes > limit, node)
            if best is None or key < best[:2]:
                best = (*key, HostNeed(check.rank_bytes(est.memory.host, mesh.dims, train), node, mesh.dims.world_size))
    if best is None or check.fits_bytes(best[1]):
        return None
    return _error(model, req.gpus, limit, best[2], check)


def rejected_by_host_memory(model: str, gpus: int, limit: float, rejected: Sequence[Any],
                            check: HostMemoryCheck) -> SoapError | None:
    """The error when every simulated plan that fit the device was rejected for host memory (None
    otherwise); `rejected` are `planner.search.Priced` plans that did not fit."""
    host_bound = [p for p in rejected if p.peak_memory_bytes <= limit and p.candidate.train.offload_optimizer]
    if not host_bound or check.capacity_bytes is None:
        return None
    needs = [HostNeed(max(check.rank_bytes(m.at_peak.host, p.candidate.mesh.dims, p.candidate.train)
                          for m in p.result.memory),
                      check.simulated_node_bytes(p.candidate.mesh.dims, p.candidate.train, p.result),
                      p.candidate.mesh.dims.world_size) for p in host_bound]
    return _error(model, gpus, limit, min(needs, key=lambda n: n.node_bytes), check)
