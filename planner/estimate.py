"""Cheap analytic step time and memory, to prune and rank candidates before full simulation.

The estimate prices a strategy from per-unit aggregates (`planner.units`) instead of the op-level
timeline the simulator builds, so it can look at every candidate of a 16k-GPU search. It decides what
gets simulated, never what is reported: reported numbers come from `costmodel.simulator`.

Time of one micro-batch on pipeline rank r (`_rank_times`), summed over the unit instances c_u of its
stages:
    t_r = max(sum_u c_u [fwd_u + bwd_u + recompute_u + tp_u + cp_u], 2 v p2p)
    fwd_u, bwd_u   `costmodel.opcost.op_time` over the unit's ops at local shapes
                   (split: parameter=tp, attribute=cp) for micro-batch mb, under torch.compile's factors when
                   the candidate compiles (as the simulator prices it; the search's compile variants of
                   simulated eager candidates keep their eager estimate);
    recompute_u    full: fwd_u again; selective: the forward of the ops selective checkpointing does
                   not cache (every op but every other weight matmul and the SDPA cores:
                   `costmodel.memory_activations.selective_cached`), as the simulator prices it;
    tp_u           2 x (TP regions) all-reduces of mb*s/cp*hidden activations in the tp group (3 x
                   under full recompute, whose forward runs them again);
    cp_u           per attention core, all-gather K,V forward and reduce-scatter dK,dV backward in the
                   cp group, hidden behind the attention compute where it can be;
    ep_u           per MoE layer, four all-to-alls (dispatch and combine, each way) of the routed
                   tokens in the ep group and the forward all-gather of the per-expert token counts;
                   expert ops run at split parameter=ep instead of tp;
    p2p            one send of a micro-batch's activations (or their gradients) to the next stage. A rank sends
                   on a stream of its own (`costmodel.simulator.step`: SEND_F/B), so its v activation and v
                   gradient sends a micro-batch overlap its compute and bound it only where they take longer;
                   a receiver waits for them only while the pipeline fills and drains (the bubble).
Step time:
    pp = 1:  T = m * t_0 + dp_exposed + zero3_exposed + optimizer
    pp > 1:  T = A * ((m/A) * max_r t_r + bubble) + dp_exposed + zero3_exposed + optimizer,
             bubble = (pp - 1) * (max_r t_r / v + 2 p2p)   (GPipe/1F1B v = 1; Interleaved1F1B v chunks;
                                                    ZBVZeroBubble halves the compute term: W fills it)
    dp_exposed     fp32 gradient all-reduce (ZeRO 0/1; ZeRO 1 adds the updated shards' all-gather), or
                   per unit a reduce-scatter over dp_shard (+ HSDP's replicate all-reduce) (ZeRO 2/3),
                   minus one micro-batch's backward it overlaps with, once per step;
    zero3_exposed  per micro-batch, per unit, the parameter all-gathers (ZeRO 3: forward and backward;
                   ZeRO 2: forward) minus the compute they prefetch behind; where gradients sync every
                   micro-batch (ZeRO 3, FSDP2 without a pipeline) the syncs join them on the same dp
                   stream: m x max(0, gathers + syncs - compute), and dp_exposed is 0
                   (`costmodel.simulator.pricing.data_parallel_traffic` and its arithmetic);
    optimizer      device state read and written once at memory bandwidth; with offload the
                   simulator's host share (`costmodel.offload.offload_time`).
Memory: the simulator's model, term by term, from per-unit tables (`planner.memory_estimate`), over
the same stages (`Estimator.stage_bounds`, which `planner.pricing.Pricer` simulates): equal to the
simulated peak, so pruning by it never drops a plan the simulator would accept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from costmodel.collectives import CommGroup, collective_time
from costmodel.memory import GRAD_BYTES, MemoryBreakdown, fsdp_param_bytes, model_state_bytes
from costmodel.memory_activations import sdpa_attention, selective_cached
from costmodel.opcost import activation_itemsize, op_time
from costmodel.offload import offload_time
from costmodel.placement import is_expert, moe_blocks, replicated_in_moe
from costmodel.profiles import ClusterSpec
from costmodel.schedule import stage_to_rank
from costmodel.simulator.pricing import data_parallel_traffic
from costmodel.strategy import ParallelDims, TrainingConfig, runs_on_fsdp2, shards_vocabulary
from planner.memory_estimate import MemoryTables
from planner.space import MeshChoice
from planner.stages import partition_stages
from planner.units import Unit, layer_units
from tracer.ir import OpGraph, OpKind

ACTIVATION_BYTES = {"fp32": 4, "tf32": 4, "fp16": 2, "bf16": 2, "fp8": 2}
"""Bytes per activation element crossing a link (fp8 recipes keep activations in 16 bit between ops)."""


@dataclass(frozen=True)
class _RankTables:
    """One micro-batch's unit costs summed per pipeline rank (`Estimator._rank_tables`)."""

    bottleneck: float
    """The busiest rank's time with TP/CP/EP communication, or its pipeline sends where they take longer."""
    compute_max: float
    params_local: float
    """The local parameters of the rank holding the most."""
    worst_counts: np.ndarray
    """Unit instances on that rank."""
    params_unit: np.ndarray
    worst_bwd: float
    worst_compute: float
    p2p: float = 0.0
    """One stage-to-stage send of a micro-batch's activations (0 without a pipeline)."""


@dataclass(frozen=True)
class Estimate:
    step_time_s: float
    memory: MemoryBreakdown
    """Per-GPU bytes on the worst pipeline rank, by term."""
    compute_s: float
    comm_s: float
    bubble_s: float
    optimizer_s: float

    @property
    def memory_bytes(self) -> float:
        return self.memory.total


def group_ranks_per_node(size: int, inner: int, gpus_per_node: int) -> int:
    """Ranks of a mesh group that share a node, when `inner` consecutive ranks sit inside it."""
    if size == 1:
        return 1
    return max(1, min(size, gpus_per_node // inner)) if inner <= gpus_per_node else 1


class Estimator:
    """Prices (mesh, training config) pairs for one graph on one cluster, caching per-unit costs."""

    def __init__(self, graph: OpGraph, cluster: ClusterSpec, units: tuple[Unit, ...]) -> None:
        self.graph, self.cluster, self.units = graph, cluster, units
        self.hidden = graph.dims.hidden
        self.kv_width = graph.dims.kv_heads * graph.dims.head_dim
        self.memory_tables = MemoryTables(graph, units)
        self._costed_ops = [tuple(op for op in u.ops if op.fwd_flops or op.bwd_flops or op.bytes_moved) for u in units]
        """Ops that take time (views move no bytes and run no FLOPs: op_time prices them at zero)."""
        self.unit_time = lru_cache(maxsize=None)(self._unit_time_uncached)
        self.stage_bounds = lru_cache(maxsize=None)(self._stage_bounds_uncached)
        self._comm = lru_cache(maxsize=None)(self._comm_uncached)
        self.unit_costs = lru_cache(maxsize=None)(self._unit_costs_uncached)
        self.rank_counts = lru_cache(maxsize=None)(self._rank_counts_uncached)
        self._policies = lru_cache(maxsize=None)(self._policies_uncached)
        self._rank_tables = lru_cache(maxsize=16384)(self._rank_tables_uncached)
        self._dp_comm = lru_cache(maxsize=16384)(self._dp_comm_uncached)
        self._per_instance = lru_cache(maxsize=None)(self._per_instance_uncached)

    # --- cached per-unit costs ------------------------------------------------------------------
    def _unit_time_uncached(
        self, u: int, tp: int, cp: int, ep: int, mb: int, precision: str, attention: str, compile: bool = False
    ) -> tuple[float, float, float, float]:
        """(forward, backward, attention-core forward, selective recompute) seconds of one instance of
        unit u; the selective recompute is the forward of the ops selective checkpointing does not cache,
        as the simulator prices it (`costmodel.memory_activations.selective_cached`)."""
        # as the simulator places them (`costmodel.placement`, `OpSplit.local`): an expert op's local work is the
        # whole expert's (1/ep of the experts, the tokens of all ep ranks routed to them), and an MoE block's other
        # ops run replicated over tp under expert parallelism
        dense, whole = {"parameter": tp, "attribute": cp}, {"parameter": 1, "attribute": cp}
        fwd = bwd = attn = selective = 0.0
        ops = self.units[u].ops
        moe = moe_blocks(ops) if ep > 1 else frozenset()
        cached = {id(op): kept for op, kept in zip(ops, selective_cached(ops, attention), strict=True)}
        for op in self._costed_ops[u]:
            split = whole if is_expert(op) or replicated_in_moe(op, moe, ep) else dense
            cost = op_time(
                op, device=self.cluster.device, precision=precision, micro_batch=mb,
                batch_traced=self.graph.batch, split=split, compile=compile,
            )
            fwd += cost.fwd_s
            bwd += cost.bwd_s
            if op.kind in (OpKind.ATTENTION, OpKind.SOFTMAX):
                attn += cost.fwd_s
            if not cached[id(op)]:
                selective += cost.fwd_s
        return fwd, bwd, attn, selective

    def _comm_uncached(self, kind: str, nbytes: float, size: int, per_node: int) -> float:
        if size <= 1 or nbytes <= 0:
            return 0.0
        # as the simulator's `ProfilePricer.collective`: the collective plus the device's per-call host time
        return (collective_time(kind, nbytes, CommGroup(size=size, ranks_per_node=per_node), self.cluster)
                + self.cluster.device.collective_call_overhead_s)

    def _stage_bounds_uncached(self, pp: int, v: int) -> tuple[int, ...]:
        """Layer bounds of the pp*v stages (`planner.units.layer_units` order), time-balanced at one sample
        per micro-batch, at one precision: the partition both the estimate and the simulation (`planner.pricing.Pricer`) use."""
        layers = layer_units(self.units)
        stages = pp * v
        if stages == 1:
            return (0, len(layers))
        # one precision for every candidate, so that all share the partition: bf16 where the device has it
        precision = next(p for p in ("bf16", "fp16", "fp32") if p in self.cluster.device.peak_flops)
        times = [sum(self.unit_time(i, 1, 1, 1, 1, precision, "sdpa", False)[:2]) for i in layers]
        zeros = [0.0] * len(layers)
        part = partition_stages(times, zeros, zeros, in_flight=[1] * stages, memory_limit=math.inf)
        assert part is not None, "a partition without memory limits always exists when stages <= layers"
        return tuple(part.bounds)

    def _rank_counts_uncached(self, pp: int, v: int, schedule: str) -> np.ndarray:
        """Instances of each unit on each pipeline rank: shape (pp, units) (`rank_counts`, memoized)."""
        stage_counts = self.memory_tables.stage_counts(self.stage_bounds(pp, v))
        ranks = np.zeros((pp, len(self.units)))
        for row, rank in zip(stage_counts, stage_to_rank(schedule, pp, v)):
            ranks[rank] += row
        return ranks

    def _unit_costs_uncached(
        self, u: int, tp: int, cp: int, ep: int, mb: int, precision: str, recompute: str, attention: str,
        compile: bool = False,
    ) -> tuple[float, float, float]:
        """(compute with recompute, critical path with TP/CP communication, backward) seconds of one
        instance of unit u for one micro-batch."""
        unit, gpn, seq = self.units[u], self.cluster.domain_size, self.graph.seq_len
        act_b = ACTIVATION_BYTES[precision]
        fwd, bwd, attn, selective = self.unit_time(u, tp, cp, ep, mb, precision, attention, compile)
        policy = "none" if unit.id.startswith("<") else recompute
        compute = fwd + bwd + (fwd if policy == "full" else selective if policy == "selective" else 0.0)
        regions = 1 if unit.id.startswith("<") else unit.tp_regions
        passes = 3 if policy == "full" else 2  # a full recompute runs the forward's collectives again
        tp_comm = passes * regions * self._comm(
            "all_reduce", mb * seq / cp * self.hidden * act_b, tp, group_ranks_per_node(tp, 1, gpn))
        cp_exposed = 0.0
        if cp > 1:
            kv_bytes = 2 * mb * seq * self.kv_width * act_b / tp
            cp_comm = unit.attention_ops * 3 * self._comm("all_gather", kv_bytes, cp, group_ranks_per_node(cp, tp, gpn))
            cp_exposed = max(0.0, cp_comm - 3 * attn)
        ep_comm = 0.0
        if ep > 1 and unit.expert_params:
            routed = mb * seq / cp * self.hidden * act_b * max(1, self.graph.dims.experts_per_token)
            ep_comm = (4 * self._comm("all_to_all", routed, ep, group_ranks_per_node(ep, tp, gpn))
                       + self._comm("all_gather", ep * max(ep, self.graph.dims.num_experts) * 8, ep,
                                    group_ranks_per_node(ep, tp, gpn)))
        return compute, compute + tp_comm + cp_exposed + ep_comm, bwd

    def _p2p_dims(self, pp: int, cp: int, tp: int, mb: int, precision: str) -> float:
        """One stage-to-stage send of a micro-batch's activations (module docstring: p2p)."""
        if pp == 1:
            return 0.0
        nbytes = mb * self.graph.seq_len / cp * self.hidden * ACTIVATION_BYTES[precision] / tp
        return self._comm("send_recv", nbytes, 2, 1)

    def time_floor(self, mesh: MeshChoice, mb: int, num_microbatches: int, grad_accum: int, precision: str,
                   bubble_factor: float, compile: bool = False) -> float:
        """A lower bound on `estimate(...).step_time_s` over every configuration of `mesh` with this
        micro-batching and precision: no recompute, no data-parallel or optimizer time, the busiest
        rank no busier than the average, and the smallest bubble factor ((pp-1)/v, halved for ZBV)
        of the schedules allowed."""
        d = mesh.dims
        average = self._per_instance(d.tp, d.cp, d.ep, mb, precision, compile) / d.pp
        return num_microbatches * average + grad_accum * bubble_factor * (d.pp - 1) * average

    def _per_instance_uncached(self, tp: int, cp: int, ep: int, mb: int, precision: str, compile: bool = False) -> float:
        """One micro-batch through every unit instance without recompute (`time_floor`, memoized)."""
        return sum(unit.repeat * self.unit_costs(u, tp, cp, ep, mb, precision, "none", "sdpa", compile)[1]
                   for u, unit in enumerate(self.units))

    # --- the estimate ---------------------------------------------------------------------------
    def _policies_uncached(self, recompute: str, recompute_per_block: tuple) -> tuple[str, ...]:
        t = TrainingConfig(global_batch=1, seq_len=1, recompute=recompute, recompute_per_block=recompute_per_block)
        return tuple(t.recompute_for(None if unit.id.startswith("<") else unit.id) for unit in self.units)

    def _rank_tables_uncached(self, pp: int, v: int, schedule: str, tp: int, cp: int, ep: int, mb: int, precision: str,
                              policies: tuple[str, ...], attention: str, compile: bool = False) -> _RankTables:
        """The per-rank sums of one micro-batch's unit costs (memoized: they read none of the candidate's
        data-parallel, ZeRO, optimizer or offload choices, nor its micro-batch count)."""
        counts = self.rank_counts(pp, v, schedule)
        costs = np.array([self.unit_costs(u, tp, cp, ep, mb, precision, policy, attention, compile)
                          for u, policy in enumerate(policies)])
        compute_unit, per_unit, bwd_unit = costs.T
        # local parameters per unit instance, as `costmodel.memory.stage_params` shards them (time only)
        alone = self.memory_tables.params(tp, ep, shards_vocabulary(tp=tp, pp=pp))
        params_unit = np.array([p.trainable for p in alone], dtype=float)
        p2p = self._p2p_dims(pp, cp, tp, mb, precision)
        rank_time = np.maximum(counts @ per_unit, 2 * v * p2p)  # the sends overlap the compute (module docstring)
        rank_compute = counts @ compute_unit
        rank_bwd = counts @ bwd_unit
        rank_params = counts @ params_unit
        worst = int(np.argmax(rank_params))
        return _RankTables(
            bottleneck=float(rank_time.max()), compute_max=float(rank_compute.max()),
            params_local=float(rank_params[worst]), worst_counts=counts[worst], params_unit=params_unit,
            worst_bwd=float(rank_bwd[worst]), worst_compute=float(rank_compute[worst]), p2p=p2p,
        )

    def estimate(self, mesh: MeshChoice, train: TrainingConfig) -> Estimate:
        d, t = mesh.dims, train
        policies = self._policies(t.recompute, t.recompute_per_block)
        attention = sdpa_attention(t.attention, t.precision, self.cluster.device.kind)  # as the simulator runs it
        tables_key = (d.pp, t.virtual_stages, t.schedule, d.tp, d.cp, d.ep, t.micro_batch, t.precision, policies,
                      attention, t.compile)
        tables = self._rank_tables(*tables_key)
        bottleneck = tables.bottleneck

        m, runs = t.num_microbatches, t.grad_accum
        bubble = 0.0
        if d.pp > 1:
            bubble = bottleneck / t.virtual_stages
            if t.schedule == "ZBVZeroBubble":
                bubble /= 2
            bubble = runs * (d.pp - 1) * (bubble + 2 * tables.p2p)
        pipeline = m * bottleneck + bubble

        params_local = tables.params_local
        state = model_state_bytes(
            int(params_local), precision=t.precision, optimizer=t.optimizer, zero=t.zero,
            dp_shard=d.shard_degree, offload_optimizer=t.offload_optimizer, pipeline=d.pp > 1,
            fsdp=runs_on_fsdp2(dp=d.dp, cp=d.cp, tp=d.tp, pp=d.pp, zero=t.zero, offload=t.offload_optimizer),
            autocast=t.peft is None,
        )
        dp_exposed, zero3_exposed = self._dp_comm(d, t.zero, t.precision, t.offload_optimizer, m, tables_key)
        device = self.cluster.device
        if t.offload_optimizer:
            optimizer_s = offload_time(params_local / d.shard_degree, pp=d.pp, train=t, device=device)
        else:
            optimizer_s = 2 * (state.weights + state.grads + state.optimizer) / device.memory_bandwidth
        step = pipeline + dp_exposed + zero3_exposed + optimizer_s
        compute_s = m * tables.compute_max

        memory = self.memory_tables.memory(d, t, self.stage_bounds(d.pp, t.virtual_stages), device)
        return Estimate(
            step_time_s=step, memory=memory, compute_s=compute_s,
            comm_s=max(0.0, pipeline - bubble - compute_s) + dp_exposed + zero3_exposed,
            bubble_s=bubble, optimizer_s=optimizer_s,
        )

    def _dp_comm_uncached(self, d: ParallelDims, zero: int, precision: str, offload: bool, m: int,
                          tables_key: tuple) -> tuple[float, float]:
        """(gradient sync, parameter gather) seconds exposed per step, by the simulator's rule
        (`costmodel.simulator.pricing.data_parallel_traffic` and its module docstring's ZeRO/FSDP
        arithmetic): each unit instance gathers its parameters and reduces its fp32 gradients in calls of
        its own, on one dp stream that overlaps compute. Memoized on what it reads: the mesh, the ZeRO
        stage, precision, offload and micro-batch count, and the worst rank's tables (`_rank_tables`)."""
        gpn = self.cluster.domain_size
        if d.sync_degree == 1:
            return 0.0, 0.0
        tables = self._rank_tables(*tables_key)
        unit_counts, params_unit = tables.worst_counts, tables.params_unit
        bwd_s, compute_s = tables.worst_bwd, tables.worst_compute
        t = TrainingConfig(global_batch=1, seq_len=1, zero=zero, precision=precision, offload_optimizer=offload)
        traffic = data_parallel_traffic(d, t)
        inner = d.tp  # data parallelism runs over dp x cp (`ParallelDims.sync_degree`, `shard_degree`)
        grad_b, weight_b = GRAD_BYTES[t.precision], activation_itemsize(t.precision)
        shard_group = (d.shard_degree, group_ranks_per_node(d.shard_degree, inner, gpn))
        replicate_group = (d.dp_replicate, group_ranks_per_node(d.dp_replicate, inner * d.shard_degree, gpn))
        dp_group = (d.sync_degree, group_ranks_per_node(d.sync_degree, inner, gpn))
        present = unit_counts > 0
        if t.zero >= 2 and d.shard_degree > 1:
            per_unit = [self._comm("reduce_scatter", p * grad_b, *shard_group)
                        + self._comm("all_reduce", p * grad_b / d.shard_degree, *replicate_group) if c else 0.0
                        for p, c in zip(params_unit, present)]
            sync = float(unit_counts @ np.array(per_unit))
        else:
            grads = float(unit_counts @ params_unit) * grad_b
            sync = self._comm("all_reduce", grads, *dp_group)
            if t.zero == 1 and d.shard_degree > 1:
                sync += self._comm("all_gather", float(unit_counts @ params_unit) * weight_b, *shard_group)
        gathers = 0.0
        if traffic.gathers_per_microbatch:
            per_unit = [self._comm("all_gather", p * fsdp_param_bytes(t.precision), *shard_group) if c else 0.0
                        for p, c in zip(params_unit, present)]
            gathers = traffic.gathers_per_microbatch * float(unit_counts @ np.array(per_unit))
        if traffic.sync_every_microbatch:
            return 0.0, m * max(0.0, gathers + sync - compute_s)
        return max(0.0, sync - bwd_s), m * max(0.0, gathers - compute_s)
