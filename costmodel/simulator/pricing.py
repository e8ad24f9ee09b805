"""Pricing: OpGraph + Strategy + ClusterSpec -> the simulator's cost tables (`StepCosts`).

Per segment of the graph (the non-block ops, or one instance of a block), priced once and reused for
every instance and every stage (`_UnitPricer.chunk`):
- placement: the Megatron rules (`placement.block_placements`), or, for a block where the strategy's
  `op_splits` (the planner's per-op split search, or a loaded plan's placements) name an op with a split
  other than that default, those splits and the collectives and resharding they imply
  (`placement.chosen_placements`);
- compute: sum over ops of `Pricer.op` at the op's local split (`costmodel.placement`) for one
  micro-batch; backward split into input gradient and weight gradient (half of a parametrized
  matmul's backward, its weight-gradient kernel);
- host-bound floor: a chunk's forward (and its selective recompute) takes at least its kernels x the
  device's `host_dispatch_s`, its backward at least its backward kernels x that (scaled up in proportion):
  an eager framework dispatches each kernel from Python through autograd, and when the kernels are
  shorter than that (small models, small micro-batches, TP shards) the GPU waits for the host. Summed per
  chunk, not per kernel: the launch queue lets a long kernel hide the dispatch of the short ones after it.
  Eager only: a compiled chunk runs Inductor's generated code, which launches its fused kernels without
  autograd's and the dispatcher's per-op Python (each launch is the device's `kernel_overhead_s`; no compiled
  floor has been measured);
- Megatron's softmax (`TrainingConfig.megatron_softmax`, another stack's attention): where its fused kernel is
  unavailable (`costmodel.fused_softmax.fused_kernel_available`: at a 16-head model's tp8 and micro-batch 1,
  for one) the unfused path's extra kernels join the chunk's forward and backward, in time and in the host
  floor's kernel count (`_UnitPricer._softmax_fallback`);
- recompute (`recompute_for(block)`): full -> the block's whole forward again in backward (its
  activation collectives too); selective -> the forward of the ops whose saved tensors it drops (all
  but matmuls, embeddings and losses); none -> 0;
- activation collectives: the placement's TP/SP, CP and EP collectives, forward and backward, each
  `collective_time` on its mesh group, times the device's `activation_collective_factor` (fitted from
  runs: these synchronous collectives cost more in a step than in their microbenchmark), plus each one's wait
  for the slowest host of its group (`costmodel.host_sync.sync_wait`, the device's `host_jitter_s`; 0 in
  the shipped profiles) and, in a pipelined run, for its ring's hosts (`costmodel.host_sync.chain_wait`, the
  device's `pipelined_sync_s`; 0 in the shipped profiles);
- gradient bucket: the segment's local gradients (fp32, `memory.GRAD_BYTES`):
  zero 0/1 all-reduce over dp (DDP's buckets: per chunk its bytes' transfer time, the stage's bucket
  count of fixed call costs shared out by bytes, `_ddp_buckets`); zero 2/3 reduce-scatter over
  dp_shard then all-reduce of the shard over dp_replicate (HSDP);
- zero 3: all-gather of the segment's parameters at `memory.fsdp_param_bytes` over dp_shard (before its
  forward and its backward; per tensor, on the critical path and again for a full recompute, when
  `TrainingConfig.param_gather` says "tensor": `costmodel.param_gathers`); zero 2: the same before its
  forward only (FSDP2 without resharding after forward keeps them through backward and reshards after
  it, so every micro-batch gathers again);
- FSDP2 engines (`fsdp_engine`) without a pipeline sync gradients every micro-batch (no no_sync);
- ZeRO-3/FSDP arithmetic (`data_parallel_traffic`, FSDP2 as `executor.data_parallel` runs it). A unit
  (segment instance) of p local parameters (after tp/ep sharding), sharded over dp_shard = n ranks, g of
  them per node, N = n / g nodes, per micro-batch:
      forward    all-gather p x w bytes (w = `memory.fsdp_param_bytes`: 2 at bf16/fp8 under FSDP2's
                 MixedPrecisionPolicy; 4 at fp32/tf32, and at fp16, which the executor runs as autocast
                 over FSDP2's fp32 parameters, `executor.data_parallel`)
      backward   all-gather p x w again (reshard_after_forward freed them); a full recompute runs under
                 the same gather (FSDP2's pre-backward unshard serves it: its forward pre-hook does not
                 gather in the backward state), so recompute adds no third gather
      gradients  reduce-scatter p x 4 (fp32 reduce dtype, `GRAD_BYTES`), then all-reduce p x 4 / n over
                 dp_replicate (HSDP)
  Every gathered buffer lives (N-1)/N on other nodes and every reduced one goes (N-1)/N to them, and a
  node moves it through its g NICs of B bytes/s each (the cluster's per-GPU inter-node bandwidth), so
  per GPU and micro-batch, at line rate,
      t_dp >= (N-1)/N x p x (2w + 4) / (g x B)                      (zero 3; zero 2: w + 4)
  (the inter-node phase of `collectives.hierarchical_time`; a flat ring moves the same bus bytes at
  min(intra, g x B) per rank), plus each collective's latency steps and per-call overhead. The three
  share the group's one NCCL stream (`dp-comm`) in FSDP2's issue order (`costmodel.simulator.step`)
  and overlap compute, so m micro-batches take at least m x max(compute, sum over units of t_dp). At
  micro-batch 1 over hundreds of nodes the step is communication-bound: llama-3-8b (8.0e9 parameters)
  on 512 H100s (g = 8, B = 50 GB/s, N = 64) moves 8.0e9 x 8 x 63/64 / 400e9 = 0.158 s per micro-batch
  at line rate, about its compute at seq 2048 (tests/test_physics.py holds the simulator and the
  estimator above it). Each collective also pays its ring's latency, which grows with the group
  (`collectives.ring_latency`: NCCL gathers and reduce-scatters across nodes are rings, no hierarchical
  variant), so thousands of ranks make every per-unit call latency-bound at small units;
- worked example, the SC'21 comparison (a 175B GPT on 384-1,536 A100 80GB, ZeRO-3 vs tp8 x pp12; worked
  in full in `costmodel.param_gathers`, which prices the per-tensor gathers of the DeepSpeed ZeRO-3 that was
  measured, `TrainingConfig.param_gather`): for soap's executor at one micro-batch per GPU per step, a
  block holds p = 1.81e9 parameters, gathered at 4 bytes (fp16 under FSDP2 gathers fp32); per micro-batch
  96 x (2 gathers + 1 fp32 reduce-scatter) move 175e9 x 12 B x (N-1)/N through 8 NICs at 0.86 of 25 GB/s:
  12.2 s, plus 288 ring latencies of 0.8 / 1.7 / 3.3 ms at 384 / 768 / 1,536 ranks (0.2-1.0 s), against
  about 14.7 s of compute per micro-batch: hidden by prefetch, so the step stays compute-bound and scales
  with the GPUs (simulated 50.8 / 26.3 / 14.8 s, 231 / 223 / 199 TFLOP/s by the paper's formula), and
  soap ranks ZeRO-3 on its own executor above the 3-D plan. Memory does not change that for the
  ranking: without offload autocast keeps each matmul weight's 16-bit copy from forward to backward
  (`costmodel.memory`), 2 x 175e9 B = 350 GB per GPU (the 3-D plan: about 20 GB; tests/test_physics.py);
  with the optimizer offloaded the planner fits it in 34.8 GB at 26.6 s per step on 768 GPUs. Priced as
  DeepSpeed ran it (3,456 blocking per-tensor gathers per micro-batch) ZeRO-3 falls 181 -> 109 -> 44
  TFLOP/s (published 144 -> 88 -> 44) and ranks below the 3-D plan (`benchmarks/sc21_zero3.py`);
- activations: what `memory.activation_parts` says one micro-batch keeps, per group of ops sharing a
  split; the recompute window (the dropped tensors, re-materialized while the chunk's backward runs)
  is the none set less the kept set. With full recomputation only the block input is kept. Under
  torch.compile a block's none set is what Inductor's partitioner saves (`memory_activations.compiled_keep`).

Per stage: model state from `memory.model_state_bytes` over `memory.stage_params` (TP-sharded
matmul/embedding weights); the optimizer step is memory-bound: local elements updated (the dp_shard
share when zero >= 1) times bytes read (weights, gradients, state) and written (weights, state), at
the device's memory bandwidth, times the device's measured `optimizer_factors`
(`costmodel.optimizer_step`, `Pricer.optimizer_time`); with offload (FSDP2 CPUOffloadPolicy, see
`costmodel.memory`), fp32 parameter shards come up over the host link at every all-gather, gradients go
down at every sync, later syncs accumulate on the CPU, and the CPU steps: `costmodel.offload`.
The host-resident bytes are the stage's `host_bytes`. Zero 1 (ZeroRedundancyOptimizer) all-gathers the updated shards after the step.
Pipeline transfers: the hidden state [micro_batch, seq/cp, hidden] (/tp with SP) as a send_recv.

Ranks sharing a node (`node_ranks`: the plan's ranks on one node): every kernel and the optimizer step
take 1 / `concurrency_efficiency`(n) times their calibrated time (one rank alone), where the device
profile measures that (CPU cores sharing caches, memory and the host's scheduler); a collective's
share of the compute stream (1 - `communication_overlap`) is `StepCosts.comm_compute_share`; and every
collective the step issues costs the device's `collective_call_overhead_us` of framework host time on
top of `collective_time` (`ProfilePricer.collective`).

Data parallelism runs over cp too, as the executor's mesh does: gradients are averaged over dp x cp
(`ParallelDims.sync_degree`) and ZeRO/FSDP shards over dp_shard x cp (`ParallelDims.shard_degree`).
Mesh groups follow torch DeviceMesh order (pp, dp_replicate, dp_shard, cp, tp; tp innermost): a group
of size n whose ranks are `stride` apart shares a node with min(n, gpus_per_node // stride) of its
members; a stream's link is intra_node when its groups fit in one node. "Node" here is the NVLink
domain (`ClusterSpec.domain_size`: the node, or the `nvlink_domain` of a rack such as GB200 NVL72), so
a TP group that spans nodes of one domain stays on NVLink, and one that leaves it (a pinned tp16 on
8-GPU nodes) runs on the inter-node link.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from costmodel.collectives import CommGroup, collective_time
from costmodel.fused_softmax import FallbackCost, fallback_cost, fused_kernel_available
from costmodel.host_sync import chain_wait, sync_wait
from costmodel.memory import (
    FSDP_GRAD_BYTES, FSDP_MASTER_BYTES, GRAD_BYTES, OPTIMIZER_BYTES, ParamSet, blocks_keep_autocast_copies,
    buffer_bytes, fsdp_param_bytes, grads_held_at_peak, held_autocast_copies, model_state_bytes, stage_params,
    workspace_bytes,
)
from costmodel.memory_activations import chunk_activations, chunk_loss_transient, sdpa_attention, selective_cached
from costmodel.offload import offload_time
from costmodel.opcost import activation_itemsize, backward_kernels, fp8_cast_launches, loss_launches, op_time
from costmodel.optimizer_step import memory_pass_time, optimizer_step_time
from costmodel.param_gathers import gather_width, gathers_per_microbatch, tensor_gathers_time
from costmodel.placement import ActivationShape, Collective, OpPlacement, block_placements, chosen_placements
from costmodel.profiles import ClusterSpec
from costmodel.schedule import step_schedule
from costmodel.simulator.costs import ChunkCost, StageCost, StepCosts
from costmodel.simulator.result import StepFacts
from costmodel.simulator.stages import Layer, as_bounds, balanced_bounds, layer_sequence, validate_bounds
from costmodel.strategy import ParallelDims, Strategy, TrainingConfig, runs_on_fsdp2, shards_vocabulary
from tracer.errors import SoapError
from tracer.ir import OpGraph, OpKind, OpNode



class Pricer(Protocol):
    """The simulator's only view of hardware; tests inject fakes with known numbers."""

    def op(self, op: OpNode, split: Mapping[str, int], micro_batch: int, batch_traced: int) -> tuple[float, float, float]:
        """(forward, backward input-gradient, backward weight-gradient) seconds on the local shard."""

    def collective(self, kind: str, nbytes: float, group: CommGroup) -> float: ...

    def memory_time(self, nbytes: float) -> float:
        """A memory-bound pass over `nbytes` on the device."""

    def optimizer_time(self, optimizer: str, elements: float) -> float:
        """The optimizer step over `elements` local parameters (no offload)."""

    def offload_time(self, elements: float, *, pp: int, train: TrainingConfig) -> float:
        """The host's share of a step under offload for `elements` local parameter shards (`costmodel.offload`)."""


def profile_pricer(cluster: ClusterSpec, strategy: Strategy) -> ProfilePricer:
    """The default pricer of `strategy` on `cluster`."""
    t = strategy.train
    return ProfilePricer(cluster, t.precision, node_ranks=node_ranks(strategy, cluster), compile=t.compile,
                         cross_entropy=t.cross_entropy, fp8_casts=t.fp8_casts, microbatches=t.num_microbatches,
                         cp_attention=t.cp_attention)


@dataclass(frozen=True)
class ProfilePricer:
    """Prices from the cluster's profiles via costmodel.opcost and costmodel.collectives."""

    cluster: ClusterSpec
    precision: str
    node_ranks: int = 1
    """Ranks of one node computing at once: the device's `concurrency_efficiency` at this count divides
    every kernel's and the optimizer's speed (1: priced as calibrated, one rank alone)."""
    compile: bool = False
    """torch.compile on: every kernel takes the device's `compile_factors` (`costmodel.opcost`)."""
    cross_entropy: str = "chunked"
    """The run's loss (`TrainingConfig.cross_entropy`): its extra kernels (`costmodel.opcost.op_time`)."""
    fp8_casts: str = "torchao"
    """Whose float8 casts an fp8 run takes (`TrainingConfig.fp8_casts`, `costmodel.opcost.op_time`)."""
    microbatches: int = 1
    """Micro-batches of a step on one rank (`TrainingConfig.num_microbatches`): Transformer Engine casts a weight
    on the first only."""
    cp_attention: str = "all-gather"
    """How a context-parallel attention core runs (`TrainingConfig.cp_attention`, `costmodel.context_attention`)."""

    @property
    def slowdown(self) -> float:
        curve = self.cluster.device.concurrency_efficiency
        return 1.0 if curve is None else 1.0 / curve.at(self.node_ranks)

    def op(self, op: OpNode, split: Mapping[str, int], micro_batch: int, batch_traced: int) -> tuple[float, float, float]:
        cost = op_time(op, device=self.cluster.device, precision=self.precision, micro_batch=micro_batch,
                       batch_traced=batch_traced, split=split, compile=self.compile, cross_entropy=self.cross_entropy,
                       fp8_casts=self.fp8_casts, microbatches=self.microbatches, cp_attention=self.cp_attention)
        weight = cost.bwd_s / 2 if op.kind is OpKind.MATMUL and op.params else 0.0
        k = self.slowdown
        return k * cost.fwd_s, k * (cost.bwd_s - weight), k * weight

    def collective(self, kind: str, nbytes: float, group: CommGroup) -> float:
        t = collective_time(kind, nbytes, group, self.cluster)
        return t + self.cluster.device.collective_call_overhead_s if t > 0 else 0.0

    def memory_time(self, nbytes: float) -> float:
        return self.slowdown * memory_pass_time(self.cluster.device, nbytes)

    def optimizer_time(self, optimizer: str, elements: float) -> float:
        return self.slowdown * optimizer_step_time(self.cluster.device, elements, precision=self.precision,
                                                   optimizer=optimizer)

    def offload_time(self, elements: float, *, pp: int, train: TrainingConfig) -> float:
        return offload_time(elements, pp=pp, train=train, device=self.cluster.device)


@dataclass(frozen=True)
class MeshGroups:
    """The communication group of each mesh dimension, with how many of its ranks share a node."""

    tp: CommGroup
    cp: CommGroup
    ep: CommGroup
    dp: CommGroup
    dp_shard: CommGroup
    dp_replicate: CommGroup
    pp_pair: CommGroup


def _group(size: int, stride: int, gpus_per_node: int) -> CommGroup:
    per_node = max(1, min(size, gpus_per_node // stride)) if stride <= gpus_per_node else 1
    return CommGroup(size=size, ranks_per_node=per_node)


def node_ranks(strategy: Strategy, cluster: ClusterSpec) -> int:
    """How many ranks of one node compute at once: the plan's ranks on a node."""
    return max(1, min(strategy.dims.world_size, cluster.gpus_per_node))


def mesh_groups(strategy: Strategy, gpus_per_node: int) -> MeshGroups:
    d = strategy.dims
    g = gpus_per_node
    return MeshGroups(
        tp=_group(d.tp, 1, g), cp=_group(d.cp, d.tp, g), ep=_group(d.ep, d.tp, g),
        dp=_group(d.sync_degree, d.tp, g), dp_shard=_group(d.shard_degree, d.tp, g),
        dp_replicate=_group(d.dp_replicate, d.dp_shard * d.cp * d.tp, g),
        pp_pair=_group(min(2, d.pp), d.dp * d.cp * d.tp, g),
    )


def _spans(group: CommGroup) -> bool:
    return group.size > group.ranks_per_node


def activation_shape(graph: OpGraph, strategy: Strategy) -> ActivationShape:
    """What the collectives of one micro-batch are sized from."""
    t, dims = strategy.train, graph.dims
    return ActivationShape(micro_batch=t.micro_batch, seq_len=t.seq_len, hidden=dims.hidden,
                           itemsize=activation_itemsize(t.precision), kv_heads=dims.kv_heads, head_dim=dims.head_dim,
                           experts_per_token=dims.experts_per_token)


def price_step(
    graph: OpGraph, strategy: Strategy, cluster: ClusterSpec, *, stage_bounds: Sequence[int] | None = None, pricer: Pricer | None = None
) -> tuple[StepCosts, StepFacts]:
    d, t = strategy.dims, strategy.train
    if t.seq_len != graph.seq_len:
        raise SoapError(f"the graph was traced at sequence length {graph.seq_len} but the plan trains at {t.seq_len}; trace at {t.seq_len}")
    dims = graph.dims
    d.check_model(num_layers=dims.num_layers, heads=dims.heads, kv_heads=dims.kv_heads, vocab=dims.vocab, seq_len=t.seq_len)
    strategy.check_batch()
    pricer = pricer or profile_pricer(cluster, strategy)
    groups = mesh_groups(strategy, cluster.domain_size)
    n_stages = d.pp * t.virtual_stages
    layers = layer_sequence(graph)
    bounds = as_bounds(stage_bounds) if stage_bounds is not None else balanced_bounds(layers, n_stages)
    validate_bounds(bounds, layers, n_stages)
    shape = activation_shape(graph, strategy)
    units = _UnitPricer(graph, strategy, pricer, groups, shape,
                        activation_factor=cluster.device.activation_collective_factor,
                        host_dispatch_s=cluster.device.host_dispatch_s, kernel_s=cluster.device.kernel_overhead_s,
                        host_jitter_s=cluster.device.host_jitter_s,
                        pipelined_sync_s=cluster.device.pipelined_sync_s if d.pp > 1 else 0.0,
                        device_kind=cluster.device.kind)
    stages = tuple(_price_stage(layers[bounds[k]:bounds[k + 1]], units, strategy, pricer, groups, shape)
                   for k in range(n_stages))
    schedule, passes = step_schedule(t.schedule, d.pp, t.num_microbatches, t.grad_accum, t.virtual_stages)
    # a rank's buffers hold its own stages' parameters or gradients (all of them: DDP's buckets)
    buffers = tuple(
        buffer_bytes(params=stage_param_set([layer for k in schedule.stages_of(rank) for layer in layers[bounds[k]:bounds[k + 1]]],
                                             d.tp, d.pp, d.ep),
                     precision=t.precision, zero=t.zero, dp=d.sync_degree, dp_shard=d.shard_degree, offload=t.offload_optimizer,
                     fsdp=fsdp_engine(strategy))
        for rank in range(schedule.pp))
    costs = StepCosts(
        stages=stages, schedule=schedule, grad_accum=passes,
        grad_sync_every_microbatch=data_parallel_traffic(d, t).sync_every_microbatch,
        gather_in_backward=units.fsdp,
        links={
            "tp-comm": "inter_node" if _spans(groups.tp) or _spans(groups.cp) else "intra_node",
            "dp-comm": "inter_node" if _spans(groups.dp) else "intra_node",
            "pp-p2p": "inter_node" if _spans(groups.pp_pair) else "intra_node",
        },
        rank_buffer_bytes=buffers,
        comm_compute_share=1.0 - cluster.device.communication_overlap,
        workspace_bytes=workspace_bytes(cluster.device),
        allocator_reserve_fraction=cluster.device.allocator_reserve_fraction,
        grads_held=grads_held_at_peak(d, t),
    )
    return costs, _facts(graph, strategy, cluster)


class _UnitPricer:
    """Prices each segment of the graph once (`chunk(layer)`)."""

    def __init__(self, graph: OpGraph, strategy: Strategy, pricer: Pricer, groups: MeshGroups, shape: ActivationShape,
                 *, activation_factor: float = 1.0, host_dispatch_s: float = 0.0, kernel_s: float = 0.0,
                 host_jitter_s: float = 0.0, pipelined_sync_s: float = 0.0, device_kind: str = "gpu") -> None:
        self.graph, self.strategy, self.pricer, self.groups, self.shape = graph, strategy, pricer, groups, shape
        self.device_kind = device_kind
        """`DeviceProfile.kind`: what torch's SDPA keeps and recomputes (`memory_activations.sdpa_attention`)."""
        self.attention = sdpa_attention(strategy.train.attention, strategy.train.precision, device_kind)
        self.activation_factor = activation_factor
        """The device's `activation_collective_factor` (TP/SP/CP/EP collectives in a step)."""
        self.host_dispatch_s = host_dispatch_s
        """The device's `host_dispatch_s` (the host-bound floor of a chunk)."""
        self.kernel_s = kernel_s
        """The device's `kernel_overhead_s` (a per-tensor gather's list copies, `costmodel.param_gathers`)."""
        self.host_jitter_s = host_jitter_s
        """The device's `host_jitter_s` (each activation collective's wait for its group's slowest host)."""
        self.pipelined_sync_s = pipelined_sync_s
        """The device's `pipelined_sync_s` in a pipelined run, else 0 (each activation collective's wait for its
        ring's hosts)."""
        self._chunks: dict[int, ChunkCost] = {}
        self._params: dict[int, int] = {}

    def params(self, layer: Layer) -> int:
        if layer.segment not in self._params:
            d = self.strategy.dims
            self._params[layer.segment] = stage_params(layer.ops, block_counts={}, tensor_parallel=d.tp, expert_parallel=d.ep,
                                                       vocab_parallel=shards_vocabulary(tp=d.tp, pp=d.pp)).trainable
        return self._params[layer.segment]

    def chunk(self, layer: Layer) -> ChunkCost:
        if layer.segment not in self._chunks:
            self._chunks[layer.segment] = self._price(layer)
        return self._chunks[layer.segment]

    def _placements(self, layer: Layer) -> tuple[OpPlacement, ...]:
        """The Megatron default, unless `op_splits` names an op of the block with another split (a
        loaded plan names every op of its blocks, the default ones too)."""
        default = block_placements(layer.ops, self.strategy, self.shape)
        named = dict(self.strategy.op_splits)
        if layer.block_id is not None and any(p.op.name in named and _degrees(named[p.op.name]) != _degrees(p.split.soap())
                                              for p in default):
            return chosen_placements(layer.ops, self.strategy, self.shape, batch_traced=self.graph.batch)
        return default

    def _comm(self, placements: Sequence[OpPlacement], phase: str) -> float:
        """The phase's activation collectives: their time and each one's wait for its group's hosts (the slowest
        of them, and in a pipelined run its ring's, `costmodel.host_sync`)."""
        group = {"tp": self.groups.tp, "cp": self.groups.cp, "ep": self.groups.ep}
        issued = [(c, group[c.group]) for p in placements for c in p.collectives if c.phase == phase]
        return activation_comm_time(issued, self.pricer.collective, factor=self.activation_factor,
                                    jitter_s=self.host_jitter_s, pipelined_s=self.pipelined_sync_s)

    def _price(self, layer: Layer) -> ChunkCost:
        t = self.strategy.train
        placements = self._placements(layer)
        fwd = bwd_in = bwd_w = selective = 0.0
        fwd_kernels = bwd_kernels = selective_kernels = 0
        cached = selective_cached([p.op for p in placements], self.attention)
        for p, kept in zip(placements, cached, strict=True):
            f, bi, bw = self.pricer.op(p.op, p.split.local(), t.micro_batch, self.graph.batch)
            fwd, bwd_in, bwd_w = fwd + f, bwd_in + bi, bwd_w + bw
            fwd_kernels += (f > 0) + loss_launches(p.op, t.cross_entropy, micro_batch=t.micro_batch,
                                                   batch_traced=self.graph.batch, split=p.split.local()) \
                + fp8_cast_launches(p.op, "fwd", precision=t.precision, compile=t.compile, casts=t.fp8_casts)
            bwd_kernels += backward_kernels(p.op) + fp8_cast_launches(
                p.op, "bwd", precision=t.precision, compile=t.compile, casts=t.fp8_casts) if bi + bw > 0 else 0
            if not kept:  # selective checkpointing recomputes it
                selective += f
                selective_kernels += f > 0
        softmax = self._softmax_fallback(placements)
        if softmax is not None:  # the unfused path's casts, scale and mask, recomputed with an attention not kept
            fwd, bwd_in = fwd + softmax.fwd_s, bwd_in + softmax.bwd_s
            fwd_kernels, bwd_kernels = fwd_kernels + softmax.fwd_kernels, bwd_kernels + softmax.bwd_kernels
            if not all(kept for p, kept in zip(placements, cached) if p.op.kind is OpKind.ATTENTION):
                selective, selective_kernels = selective + softmax.fwd_s, selective_kernels + softmax.fwd_kernels
        host = 0.0 if t.compile else self.host_dispatch_s
        if host > 0:  # the host-bound floor: the GPU cannot run kernels faster than the host dispatches them
            fwd, selective = max(fwd, fwd_kernels * host), max(selective, selective_kernels * host)
            if bwd_in + bwd_w < bwd_kernels * host:
                scale = bwd_kernels * host / max(bwd_in + bwd_w, 1e-30)
                bwd_in, bwd_w = (bwd_in * scale, bwd_w * scale) if bwd_in + bwd_w > 0 else (bwd_kernels * host, 0.0)
        fwd_comm, bwd_comm = self._comm(placements, "fwd"), self._comm(placements, "bwd")
        blocking = self._tensor_gathers(layer)  # per tensor: on the critical path, again in a full recompute
        fwd_comm, bwd_comm = fwd_comm + blocking, bwd_comm + blocking
        policy = t.recompute_for(layer.block_id) if layer.block_id is not None else "none"
        kept, recompute_bytes = placed_activations(placements, self.strategy, self.graph.batch, self.shape, policy,
                                                   self.device_kind)
        if policy == "full":
            recompute_s, bwd_comm = fwd, bwd_comm + fwd_comm
        elif policy == "selective":
            recompute_s = selective
        else:
            recompute_s = 0.0
        params = self.params(layer)
        return ChunkCost(
            name=layer.name, fwd_s=fwd, bwd_input_s=bwd_in, bwd_weight_s=bwd_w, recompute_s=recompute_s,
            fwd_comm_s=fwd_comm, bwd_comm_s=bwd_comm, grad_sync_s=self._grad_sync(params),
            param_gather_s=self._gather(params), activation_bytes=kept, recompute_bytes=recompute_bytes,
            loss_transient_bytes=placed_loss_transient(placements, self.strategy, self.graph.batch),
        )

    def _softmax_fallback(self, placements: Sequence[OpPlacement]) -> FallbackCost | None:
        """What Megatron's unfused softmax adds to the chunk's attention, where the stack runs Megatron's softmax
        and its fused kernel is unavailable (`costmodel.fused_softmax`); None elsewhere."""
        t, d = self.strategy.train, self.strategy.dims
        attention = sum(p.op.kind is OpKind.ATTENTION for p in placements)
        if not t.megatron_softmax or not attention:
            return None
        heads, sq, sk = self.graph.dims.heads // d.tp, t.seq_len // d.cp, t.seq_len
        half = t.precision in ("fp16", "bf16")
        if fused_kernel_available(micro_batch=t.micro_batch, local_heads=heads, sq=sq, sk=sk, half=half):
            return None
        one = fallback_cost(scores=t.micro_batch * heads * sq * sk, width=2 if half else 4,
                            pass_time=self.pricer.memory_time, launch_s=self.kernel_s)
        return FallbackCost(fwd_s=attention * one.fwd_s, bwd_s=attention * one.bwd_s,
                            fwd_kernels=attention * one.fwd_kernels, bwd_kernels=attention * one.bwd_kernels)

    @property
    def fsdp(self) -> bool:
        """ZeRO 3 over dp_shard > 1: parameters gathered per chunk (held in `memory.buffer_bytes`)."""
        return data_parallel_traffic(self.strategy.dims, self.strategy.train).gathers_per_microbatch >= 2

    def _grad_sync(self, params: int) -> float:
        d, t = self.strategy.dims, self.strategy.train
        nbytes = params * GRAD_BYTES[t.precision]
        if d.sync_degree == 1 or nbytes == 0:
            return 0.0
        if t.zero >= 2 and d.shard_degree > 1:
            return (self.pricer.collective("reduce_scatter", nbytes, self.groups.dp_shard)
                    + self.pricer.collective("all_reduce", nbytes / d.shard_degree, self.groups.dp_replicate))
        return self.pricer.collective("all_reduce", nbytes, self.groups.dp)

    def _tensor_gathers(self, layer: Layer) -> float:
        """ZeRO-3 gathering per parameter tensor (`costmodel.param_gathers`, `TrainingConfig.param_gather`):
        one gather of the segment's tensors, blocking compute; 0 for FSDP2's per-unit gathers (`_gather`)."""
        t, d = self.strategy.train, self.strategy.dims
        if t.param_gather != "tensor" or t.zero != 3 or d.shard_degree == 1:
            return 0.0
        shapes = stage_params(layer.ops, block_counts={}, tensor_parallel=d.tp, expert_parallel=d.ep,
                              vocab_parallel=shards_vocabulary(tp=d.tp, pp=d.pp)).shapes
        return tensor_gathers_time([math.prod(s) for s in shapes], gather_width(t.precision, t.param_gather),
                                   self.groups.dp_shard, collective=self.pricer.collective, kernel_s=self.kernel_s)

    def _gather(self, params: int) -> float:
        t, d = self.strategy.train, self.strategy.dims
        if t.param_gather == "tensor" and t.zero == 3:
            return 0.0
        if not data_parallel_traffic(d, t).gathers_per_microbatch or params == 0:
            return 0.0
        return self.pricer.collective("all_gather", params * fsdp_param_bytes(t.precision), self.groups.dp_shard)


def activation_comm_time(issued: Iterable[tuple[Collective, CommGroup]],
                         price: Callable[[str, float, CommGroup], float], *, factor: float, jitter_s: float,
                         pipelined_s: float) -> float:
    """Seconds of activation collectives (each with the group it runs on), blocking as a step runs them: their
    prices (`price`, a `Pricer.collective`) times the device's `activation_collective_factor`, plus each one's wait
    for its group's slowest host (`jitter_s`) and, in a pipelined run, for its ring's hosts (`pipelined_s`;
    `costmodel.host_sync`). The simulator's chunks and the planner's estimate both price them so."""
    issued = list(issued)
    wait = sum(sync_wait(1, g.size, jitter_s) + chain_wait(1, g.size, pipelined_s) for _, g in issued)
    return factor * sum(price(c.kind, c.nbytes, g) for c, g in issued) + wait


def placed_activations(placements: Sequence[OpPlacement], strategy: Strategy, batch_traced: int,
                       shape: ActivationShape, policy: str, device_kind: str = "gpu") -> tuple[int, int]:
    """(kept, recompute window) bytes of one chunk under its placements: `memory_activations.chunk_activations`
    with each op at its local split, its attention cores as torch runs them on `device_kind` (`sdpa_attention`);
    the planner's estimate calls this too."""
    d, t = strategy.dims, strategy.train
    sp = t.sequence_parallel and d.tp > 1
    attention = sdpa_attention(t.attention, t.precision, device_kind)
    return chunk_activations(((p.op, p.split.local()) for p in placements), policy=policy, micro_batch=t.micro_batch,
                             batch_traced=batch_traced, attention=attention, precision=t.precision,
                             block_input_bytes=shape.hidden_bytes(d.cp) / (d.tp if sp else 1), compiled=t.compile,
                             pipelined=d.pp > 1, cross_entropy=t.cross_entropy)


def placed_loss_transient(placements: Sequence[OpPlacement], strategy: Strategy, batch_traced: int) -> int:
    """The loss's largest fp32 transient in one chunk under its placements
    (`memory_activations.chunk_loss_transient`); the planner's estimate calls this too."""
    t = strategy.train
    return chunk_loss_transient(((p.op, p.split.local()) for p in placements), micro_batch=t.micro_batch,
                                batch_traced=batch_traced, cross_entropy=t.cross_entropy)


def _degrees(split: Mapping[str, int] | Sequence[tuple[str, int]]) -> tuple[int, int]:
    """(attribute, parameter) degrees of a split: what `Strategy.op_splits` fixes (sample follows dp)."""
    d = dict(split)
    return d.get("attribute", 1), d.get("parameter", 1)


def _price_stage(layers: Sequence[Layer], units: _UnitPricer, strategy: Strategy, pricer: Pricer,
                 groups: MeshGroups, shape: ActivationShape) -> StageCost:
    d, t = strategy.dims, strategy.train
    chunks = _ddp_buckets(tuple(dataclasses.replace(units.chunk(layer), name=layer.name) for layer in layers),
                          [units.params(layer) for layer in layers], strategy, pricer, groups)
    params = stage_param_set(layers, d.tp, d.pp, d.ep)
    state = model_state_bytes(params.trainable, precision=t.precision, optimizer=t.optimizer, zero=t.zero,
                              dp_shard=d.shard_degree, offload_optimizer=t.offload_optimizer,
                              param_shapes=params.shapes if t.optimizer == "adafactor" else None, frozen=params.frozen,
                              pipeline=d.pp > 1, fsdp=fsdp_engine(strategy), quantized=params.quantized_bytes,
                              autocast=t.peft is None,
                              autocast_copied=held_autocast_copies(params, blocks_keep=blocks_keep_autocast_copies(t),
                                                                   precision=t.precision))
    sp = t.sequence_parallel and d.tp > 1
    hidden = shape.hidden_bytes(d.cp) / (d.tp if sp else 1)
    p2p = pricer.collective("send_recv", hidden, groups.pp_pair) if d.pp > 1 else 0.0
    return StageCost(
        chunks=chunks, send_activation_s=p2p, send_gradient_s=p2p,
        optimizer_s=_optimizer_time(params.trainable, strategy, pricer),
        host_bytes=state.offloaded,
        post_step_gather_s=(pricer.collective("all_gather", params.trainable * activation_itemsize(t.precision), groups.dp_shard)
                            if t.zero == 1 and d.shard_degree > 1 else 0.0),
        weights_bytes=state.weights, grads_bytes=state.grads, optimizer_bytes=state.optimizer,
    )


@dataclass(frozen=True)
class DataParallelTraffic:
    """What one rank puts on the data-parallel link per micro-batch (the module docstring's ZeRO/FSDP
    arithmetic); the simulator's task graph and the planner's estimate both follow it."""

    gathers_per_microbatch: int
    """Parameter all-gathers over dp_shard per unit and micro-batch (`costmodel.param_gathers.gathers_per_microbatch`):
    2 with zero 3 (forward; backward, recompute included), 3 gathering per tensor under full recompute, 1 with
    zero 2 (forward), else 0."""
    sync_every_microbatch: bool
    """Gradients reduced after every micro-batch's backward (zero 3; FSDP2 without a pipeline), not once
    per step."""


def data_parallel_traffic(dims: ParallelDims, train: TrainingConfig) -> DataParallelTraffic:
    d, t = dims, train
    sharded = d.shard_degree > 1
    gathers = gathers_per_microbatch(zero=t.zero, sharded=sharded, granularity=t.param_gather, recompute=t.recompute)
    fsdp2 = runs_on_fsdp2(dp=d.dp, cp=d.cp, tp=d.tp, pp=d.pp, zero=t.zero, offload=t.offload_optimizer)
    every = (t.zero == 3 and sharded) or (d.pp == 1 and d.sync_degree > 1 and fsdp2 and not t.accumulate_locally)
    return DataParallelTraffic(gathers, every)


def fsdp_engine(strategy: Strategy) -> bool:
    """Whether the executor runs the strategy's data parallelism on FSDP2 (`costmodel.strategy.runs_on_fsdp2`),
    which syncs per unit and, without a pipeline, every micro-batch."""
    d, t = strategy.dims, strategy.train
    return runs_on_fsdp2(dp=d.dp, cp=d.cp, tp=d.tp, pp=d.pp, zero=t.zero, offload=t.offload_optimizer)


DDP_BUCKET_BYTES = 25 * 2**20
"""torch DDP's `bucket_cap_mb=25` (the executor's DistributedDataParallel keeps the default)."""
DDP_FIRST_BUCKET_BYTES = 2**20
"""torch DDP's first bucket (`torch.distributed._DEFAULT_FIRST_BUCKET_BYTES`), all-reduced on its own."""


def _ddp_buckets(chunks: tuple[ChunkCost, ...], params: Sequence[int], strategy: Strategy, pricer: Pricer,
                 groups: MeshGroups) -> tuple[ChunkCost, ...]:
    """DDP (zero 0/1 over dp > 1) all-reduces the stage's gradients in buckets, not one call per chunk: each
    chunk keeps its gradients' transfer time (the call's time less a 4-byte call's), and the stage's
    1 + ceil((bytes - first bucket) / bucket_cap) fixed call costs (latency and per-call overhead) are
    shared out by gradient bytes, so the sync still follows each chunk's backward."""
    d, t = strategy.dims, strategy.train
    if d.sync_degree == 1 or fsdp_engine(strategy):
        return chunks
    sizes = [n * GRAD_BYTES[t.precision] for n in params]
    total = sum(sizes)
    if total == 0:
        return chunks
    calls = 1 + math.ceil(max(0, total - DDP_FIRST_BUCKET_BYTES) / DDP_BUCKET_BYTES)
    fixed = pricer.collective("all_reduce", 4, groups.dp)
    out = []
    for chunk, nbytes in zip(chunks, sizes):
        if nbytes and chunk.grad_sync_s > 0:
            wire = max(0.0, chunk.grad_sync_s - fixed)
            chunk = dataclasses.replace(chunk, grad_sync_s=wire + fixed * calls * nbytes / total)
        out.append(chunk)
    return tuple(out)


def stage_param_set(layers: Sequence[Layer], tensor_parallel: int, pp: int, expert_parallel: int = 1, *,
                    vocab_parallel: bool | None = None) -> ParamSet:
    """The parameters one rank of a stage holds (its layers, each block instance counted); tp shards the
    token embedding and LM head by `costmodel.strategy.shards_vocabulary` (`executor.tensor_parallel`),
    unless `vocab_parallel` says otherwise (a before/after comparison)."""
    counts: dict[str, int] = {}
    for layer in layers:
        if layer.block_id is not None:
            counts[layer.block_id] = counts.get(layer.block_id, 0) + 1
    seen_segments = {layer.segment: layer for layer in layers}
    ops = [op for layer in seen_segments.values() for op in layer.ops]
    if vocab_parallel is None:
        vocab_parallel = shards_vocabulary(tp=tensor_parallel, pp=pp)
    return stage_params(ops, block_counts=counts, tensor_parallel=tensor_parallel, expert_parallel=expert_parallel,
                        vocab_parallel=vocab_parallel)


def _optimizer_time(params: int, strategy: Strategy, pricer: Pricer) -> float:
    d, t = strategy.dims, strategy.train
    if t.offload_optimizer:
        return pricer.offload_time(params / d.shard_degree, pp=d.pp, train=t)
    sharded = t.zero >= 1 or fsdp_engine(strategy)  # FSDP2 steps on its shards whatever the stage
    return pricer.optimizer_time(t.optimizer, params / (d.shard_degree if sharded else 1))


def _facts(graph: OpGraph, strategy: Strategy, cluster: ClusterSpec) -> StepFacts:
    d, t = strategy.dims, strategy.train
    scale = t.global_batch / graph.batch
    recomputed = 0
    blocks: dict[str, list[OpNode]] = {}
    for op in graph.ops:
        if op.block_id is not None:
            blocks.setdefault(op.block_id, []).append(op)
    attention = sdpa_attention(t.attention, t.precision, cluster.device.kind)
    for block_id, ops in blocks.items():
        policy = t.recompute_for(block_id)
        cached = selective_cached(ops, attention) if policy == "selective" else (False,) * len(ops)
        if policy != "none":
            recomputed += sum(op.fwd_flops * graph.multiplicity(op) for op, kept in zip(ops, cached) if not kept)
    model = (graph.fwd_flops + graph.bwd_flops) * scale
    return StepFacts(
        model_flops=model, hardware_flops=model + recomputed * scale, world_size=d.world_size,
        global_batch=t.global_batch, seq_len=t.seq_len,
        peak_flops_per_gpu=cluster.device.effective_peak(t.precision),
        parallelism={
            "dp": d.dp, "dp_replicate": d.dp_replicate, "dp_shard": d.dp_shard, "zero": t.zero, "tp": d.tp,
            "pp": d.pp, "cp": d.cp, "ep": d.ep, "sequence_parallel": t.sequence_parallel,
            "micro_batch": t.micro_batch, "grad_accum": t.grad_accum, "num_microbatches": t.num_microbatches,
            "schedule": t.schedule, "virtual_stages": t.virtual_stages, "recompute": t.recompute,
            "precision": t.precision, "optimizer": t.optimizer, "offload_optimizer": t.offload_optimizer,
            "compile": t.compile,
        },
    )

