"""Cheap analytic step time and memory, to prune and rank candidates before full simulation.

The estimate prices a strategy from per-unit aggregates (`planner.units`) instead of the op-level
timeline the simulator builds, so it can look at every candidate of a 16k-GPU search. It decides what
gets simulated, never what is reported: reported numbers come from `costmodel.simulator`.

Time of one micro-batch on pipeline rank r (`_rank_tables`), summed over the unit instances c_u of its
stages:
    t_r = max(sum_u c_u [fwd_u + bwd_u + recompute_u + comm_u], 2 v p2p)
    fwd_u, bwd_u   `costmodel.opcost.op_time` over the unit's ops at the local shapes of the simulator's
                   default placement (`costmodel.placement.block_placements`: tp and cp splits, sequence
                   parallelism's, an expert's whole tokens under ep) for micro-batch mb and the run's loss,
                   under torch.compile's factors when the candidate compiles (the search's compile variants of
                   simulated eager candidates keep their eager estimate); eager, at least the unit's kernels
                   times the device's `host_dispatch_s` (the simulator's host-bound floor);
    recompute_u    full: fwd_u again; selective: the forward of the ops selective checkpointing does
                   not cache (every op but every other weight matmul and the SDPA cores:
                   `costmodel.memory_activations.selective_cached`), as the simulator prices it;
    comm_u         the activation collectives that placement issues, forward and backward (TP/SP regions,
                   the vocabulary-parallel embedding, head and loss, CP's K/V exchange, EP's all-to-alls and
                   token counts; a full recompute runs the forward's again), each blocking as the simulator
                   runs it: its `collective_time` on its group times the device's `activation_collective_factor`,
                   plus its wait for the group's hosts (`costmodel.host_sync`; the pipelined ring's where pp > 1);
    p2p            one send of a micro-batch's activations (or their gradients) to the next stage. A rank sends
                   on a stream of its own (`costmodel.simulator.step`: SEND_F/B), so its v activation and v
                   gradient sends a micro-batch overlap its compute and bound it only where they take longer;
                   a receiver waits for them only while the pipeline fills and drains (the bubble).
Step time:
    pp = 1:  T = m * t_0 + dp_exposed + zero3_exposed + optimizer
    pp > 1:  T = A * ((m/A) * max_r t_r + bubble) + dp_exposed + zero3_exposed + optimizer,
             bubble = sum_{r != busiest} t_r / v + (pp - 1) 2 p2p   (the fill and drain wait for the other
                      stages; GPipe/1F1B v = 1; Interleaved1F1B v chunks; ZBVZeroBubble halves the compute
                      term: W fills it)
    dp_exposed     fp32 gradient all-reduce (ZeRO 0/1; ZeRO 1 adds the updated shards' all-gather), or
                   per unit a reduce-scatter over dp_shard (+ HSDP's replicate all-reduce) (ZeRO 2/3),
                   minus one micro-batch's backward it overlaps with, once per step; without a pipeline at
                   least the sync of the rank's first unit (DDP's last bucket), which closes the backward;
    zero3_exposed  per micro-batch, per unit, the parameter all-gathers (ZeRO 3: forward and backward;
                   ZeRO 2: forward), and where gradients sync every micro-batch (ZeRO 3, FSDP2 without a
                   pipeline; dp_exposed is then 0) the syncs, on the one dp stream, minus the critical path
                   they hide behind (`costmodel.simulator.pricing.data_parallel_traffic` and its arithmetic).
                   With a pipeline the micro-batches interleave: m x max(0, gathers + syncs - W), W = the
                   rank's critical path. Without one each phase hides only its own traffic: a forward its
                   gathers (and the last unit's backward gather, which FSDP2 prefetches), never the first
                   unit's, which opens it; a backward its gathers and syncs, never the first unit's sync,
                   which closes it:
                       m x (g_1 + max(0, G_f - g_1 - W_f) + s_1 + max(0, G_b + S - s_1 - W_b))
                   (W_f, W_b the forward's and backward's critical paths, g_1 and s_1 the first unit's
                   gather and sync); a lower bound on the simulator's per-chunk prefetch, which exposes more
                   where one unit's traffic outlasts its neighbour's compute. Without gathers (FSDP2 at ZeRO
                   0/1) nothing queues behind a micro-batch's syncs, which hide behind the next forward too:
                   max(s_1, m x (S - W_f - W_b));
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
from costmodel.opcost import activation_itemsize, backward_kernels, fp8_cast_launches, loss_launches, op_time
from costmodel.offload import offload_time
from costmodel.profiles import ClusterSpec
from costmodel.schedule import stage_to_rank
from costmodel.simulator.pricing import activation_comm_time, data_parallel_traffic
from costmodel.strategy import ParallelDims, TrainingConfig, runs_on_fsdp2, shards_vocabulary
from planner.memory_estimate import MemoryTables
from planner.space import MeshChoice
from planner.stages import partition_stages
from planner.units import Unit, layer_units
from tracer.ir import OpGraph

ACTIVATION_BYTES = {"fp32": 4, "tf32": 4, "fp16": 2, "bf16": 2, "fp8": 2}
"""Bytes per activation element crossing a link (fp8 recipes keep activations in 16 bit between ops)."""


@dataclass(frozen=True)
class _RankTables:
    """One micro-batch's unit costs summed per pipeline rank (`Estimator._rank_tables`)."""

    bottleneck: float
    """The busiest rank's time with TP/CP/EP communication, or its pipeline sends where they take longer."""
    others: float
    """The other ranks' times (the same terms) summed: what the pipeline's fill and drain wait for."""
    compute_max: float
    params_local: float
    """The local parameters of the rank holding the most."""
    worst_counts: np.ndarray
    """Unit instances on that rank."""
    params_unit: np.ndarray
    worst_bwd: float
    worst_windows: tuple[float, float]
    """That rank's forward and backward critical paths (compute and activation collectives): the most a
    micro-batch's forward or backward can hide of the data-parallel stream (`Estimator._dp_comm`)."""
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
        self.memory_tables = MemoryTables(graph, units)
        self._costed_ops = [frozenset(id(op) for op in u.ops if op.fwd_flops or op.bwd_flops or op.bytes_moved)
                            for u in units]
        """Ops that take time (views move no bytes and run no FLOPs: op_time prices them at zero)."""
        self.unit_time = lru_cache(maxsize=None)(self._unit_time_uncached)
        self.stage_bounds = lru_cache(maxsize=None)(self._stage_bounds_uncached)
        self._comm = lru_cache(maxsize=None)(self._comm_uncached)
        self.unit_costs = lru_cache(maxsize=None)(self._unit_costs_uncached)
        self._placed_comm = lru_cache(maxsize=None)(self._placed_comm_uncached)
        self._local_splits = lru_cache(maxsize=None)(self._local_splits_uncached)
        self.rank_counts = lru_cache(maxsize=None)(self._rank_counts_uncached)
        self._policies = lru_cache(maxsize=None)(self._policies_uncached)
        self._rank_tables = lru_cache(maxsize=16384)(self._rank_tables_uncached)
        self._dp_comm = lru_cache(maxsize=16384)(self._dp_comm_uncached)
        self._per_instance = lru_cache(maxsize=None)(self._per_instance_uncached)

    # --- cached per-unit costs ------------------------------------------------------------------
    def _local_splits_uncached(self, u: int, tp: int, cp: int, ep: int, sequence_parallel: bool) -> tuple[dict, ...]:
        """The split `op_time` takes for each op of unit u, as the simulator places it by default
        (`MemoryTables.placements`, `OpSplit.local`; it depends on neither the micro-batch, the precision nor the
        loss): an expert op's local work is the whole expert's (1/ep of the experts, the tokens of all ep ranks
        routed to them), an MoE block's other ops run replicated over tp under expert parallelism, sequence
        parallelism splits the ops between TP regions over the sequence."""
        placements = self.memory_tables.placements(u, tp, cp, ep, 1, "bf16", sequence_parallel, "chunked")
        return tuple(p.split.local() for p in placements)

    def _unit_time_uncached(
        self, u: int, tp: int, cp: int, ep: int, mb: int, precision: str, attention: str, compile: bool = False,
        cross_entropy: str = "upcast", sequence_parallel: bool = False,
    ) -> tuple[float, float, float, int, int, int]:
        """(forward, backward, selective recompute) seconds of one instance of unit u at its placement's local
        shapes (`_local_splits`), and the kernels each launches, as the simulator prices and counts them for its
        host floor; the selective recompute is the forward of the ops selective checkpointing does not cache
        (`costmodel.memory_activations.selective_cached`)."""
        fwd = bwd = selective = 0.0
        fwd_kernels = bwd_kernels = selective_kernels = 0
        ops = self.units[u].ops
        cached = selective_cached(ops, attention)
        costed = self._costed_ops[u]
        for op, split, kept in zip(ops, self._local_splits(u, tp, cp, ep, sequence_parallel), cached, strict=True):
            if id(op) not in costed:
                continue
            cost = op_time(
                op, device=self.cluster.device, precision=precision, micro_batch=mb,
                batch_traced=self.graph.batch, split=split, compile=compile, cross_entropy=cross_entropy,
            )
            fwd += cost.fwd_s
            bwd += cost.bwd_s
            fwd_kernels += (cost.fwd_s > 0) + fp8_cast_launches(op, "fwd", precision=precision, compile=compile) \
                + loss_launches(op, cross_entropy, micro_batch=mb, batch_traced=self.graph.batch, split=split)
            if cost.bwd_s > 0:
                bwd_kernels += backward_kernels(op) + fp8_cast_launches(op, "bwd", precision=precision, compile=compile)
            if not kept:
                selective += cost.fwd_s
                selective_kernels += cost.fwd_s > 0
        return fwd, bwd, selective, fwd_kernels, bwd_kernels, selective_kernels

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
        compile: bool = False, pipelined: bool = False, sequence_parallel: bool = False,
        cross_entropy: str = "chunked",
    ) -> tuple[float, float, float, float, float]:
        """(compute with recompute, critical path with its activation collectives, backward, forward window,
        backward window) seconds of one instance of unit u for one micro-batch. The windows are the forward's
        and the backward's critical paths (the backward's with recompute): what each can hide of the
        data-parallel stream (`_dp_comm`)."""
        unit = self.units[u]
        fwd, bwd, selective, *kernels = self.unit_time(u, tp, cp, ep, mb, precision, attention, compile, cross_entropy,
                                                       sequence_parallel)
        host = 0.0 if compile else self.cluster.device.host_dispatch_s
        if host > 0:  # the simulator's host-bound floor: an eager chunk's kernels cannot run faster than dispatched
            fwd, bwd, selective = (max(t, k * host) for t, k in zip((fwd, bwd, selective), kernels, strict=True))
        policy = "none" if unit.id.startswith("<") else recompute
        compute = fwd + bwd + (fwd if policy == "full" else selective if policy == "selective" else 0.0)
        fwd_comm, bwd_comm = self._placed_comm(u, tp, cp, ep, mb, precision, pipelined, sequence_parallel,
                                               cross_entropy)
        if policy == "full":  # a full recompute runs the forward's collectives again
            bwd_comm += fwd_comm
        return compute, compute + fwd_comm + bwd_comm, bwd, fwd + fwd_comm, compute - fwd + bwd_comm

    def _placed_comm_uncached(self, u: int, tp: int, cp: int, ep: int, mb: int, precision: str, pipelined: bool,
                              sequence_parallel: bool, cross_entropy: str) -> tuple[float, float]:
        """(forward, backward) seconds of the activation collectives (TP/SP, CP, EP) the placement issues for one
        instance of unit u (`MemoryTables.placements`, the simulator's default placement), priced as the simulator
        prices them (`costmodel.simulator.pricing.activation_comm_time`: the device's `activation_collective_factor`
        and each one's wait for its group's hosts, the pipelined ring's only where pp > 1)."""
        if tp == cp == ep == 1:
            return 0.0, 0.0
        gpn, device = self.cluster.domain_size, self.cluster.device
        groups = {"tp": CommGroup(tp, group_ranks_per_node(tp, 1, gpn)),
                  "cp": CommGroup(cp, group_ranks_per_node(cp, tp, gpn)),
                  "ep": CommGroup(ep, group_ranks_per_node(ep, tp, gpn))}
        placements = self.memory_tables.placements(u, tp, cp, ep, mb, precision, sequence_parallel, cross_entropy)
        times = {}
        for phase in ("fwd", "bwd"):
            issued = [(c, groups[c.group]) for p in placements for c in p.collectives if c.phase == phase]
            times[phase] = activation_comm_time(
                issued, lambda kind, nbytes, g: self._comm(kind, nbytes, g.size, g.ranks_per_node),
                factor=device.activation_collective_factor, jitter_s=device.host_jitter_s,
                pipelined_s=device.pipelined_sync_s if pipelined else 0.0)
        return times["fwd"], times["bwd"]

    def _p2p_dims(self, pp: int, cp: int, tp: int, mb: int, precision: str) -> float:
        """One stage-to-stage send of a micro-batch's activations (module docstring: p2p)."""
        if pp == 1:
            return 0.0
        nbytes = mb * self.graph.seq_len / cp * self.hidden * ACTIVATION_BYTES[precision] / tp
        return self._comm("send_recv", nbytes, 2, 1)

    def time_floor(self, mesh: MeshChoice, mb: int, num_microbatches: int, grad_accum: int, precision: str,
                   bubble_factor: float, compile: bool = False, cross_entropy: str = "chunked") -> float:
        """A lower bound on `estimate(...).step_time_s` over every configuration of `mesh` the search makes
        (sequence parallelism wherever tp > 1, `planner.space`) with this micro-batching, precision and loss: no
        recompute, no data-parallel or optimizer time, the busiest rank no busier than the average, and the
        smallest bubble factor ((pp-1)/v, halved for ZBV) of the schedules allowed."""
        d = mesh.dims
        average = self._per_instance(d.tp, d.cp, d.ep, mb, precision, compile, d.pp > 1, cross_entropy) / d.pp
        return num_microbatches * average + grad_accum * bubble_factor * (d.pp - 1) * average

    def _per_instance_uncached(self, tp: int, cp: int, ep: int, mb: int, precision: str, compile: bool,
                               pipelined: bool, cross_entropy: str) -> float:
        """One micro-batch through every unit instance without recompute (`time_floor`, memoized)."""
        return sum(unit.repeat * self.unit_costs(u, tp, cp, ep, mb, precision, "none", "sdpa", compile, pipelined,
                                                 tp > 1, cross_entropy)[1] for u, unit in enumerate(self.units))

    # --- the estimate ---------------------------------------------------------------------------
    def _policies_uncached(self, recompute: str, recompute_per_block: tuple) -> tuple[str, ...]:
        t = TrainingConfig(global_batch=1, seq_len=1, recompute=recompute, recompute_per_block=recompute_per_block)
        return tuple(t.recompute_for(None if unit.id.startswith("<") else unit.id) for unit in self.units)

    def _rank_tables_uncached(self, pp: int, v: int, schedule: str, tp: int, cp: int, ep: int, mb: int, precision: str,
                              policies: tuple[str, ...], attention: str, compile: bool = False,
                              sequence_parallel: bool = False, cross_entropy: str = "chunked") -> _RankTables:
        """The per-rank sums of one micro-batch's unit costs (memoized: they read none of the candidate's
        data-parallel, ZeRO, optimizer or offload choices, nor its micro-batch count)."""
        counts = self.rank_counts(pp, v, schedule)
        costs = np.array([self.unit_costs(u, tp, cp, ep, mb, precision, policy, attention, compile, pp > 1,
                                          sequence_parallel, cross_entropy) for u, policy in enumerate(policies)])
        compute_unit, per_unit, bwd_unit, fwd_window, bwd_window = costs.T
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
            bottleneck=float(rank_time.max()), others=float(rank_time.sum() - rank_time.max()),
            compute_max=float(rank_compute.max()),
            params_local=float(rank_params[worst]), worst_counts=counts[worst], params_unit=params_unit,
            worst_bwd=float(rank_bwd[worst]),
            worst_windows=(float(counts[worst] @ fwd_window), float(counts[worst] @ bwd_window)), p2p=p2p,
        )

    def estimate(self, mesh: MeshChoice, train: TrainingConfig) -> Estimate:
        d, t = mesh.dims, train
        policies = self._policies(t.recompute, t.recompute_per_block)
        attention = sdpa_attention(t.attention, t.precision, self.cluster.device.kind)  # as the simulator runs it
        tables_key = (d.pp, t.virtual_stages, t.schedule, d.tp, d.cp, d.ep, t.micro_batch, t.precision, policies,
                      attention, t.compile, t.sequence_parallel, t.cross_entropy)
        tables = self._rank_tables(*tables_key)
        bottleneck = tables.bottleneck

        m, runs = t.num_microbatches, t.grad_accum
        bubble = 0.0
        if d.pp > 1:
            bubble = tables.others / (d.pp - 1) / t.virtual_stages
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
        bwd_s = tables.worst_bwd
        t = TrainingConfig(global_batch=1, seq_len=1, zero=zero, precision=precision, offload_optimizer=offload)
        traffic = data_parallel_traffic(d, t)
        inner = d.tp  # data parallelism runs over dp x cp (`ParallelDims.sync_degree`, `shard_degree`)
        grad_b, weight_b = GRAD_BYTES[t.precision], activation_itemsize(t.precision)
        shard_group = (d.shard_degree, group_ranks_per_node(d.shard_degree, inner, gpn))
        replicate_group = (d.dp_replicate, group_ranks_per_node(d.dp_replicate, inner * d.shard_degree, gpn))
        dp_group = (d.sync_degree, group_ranks_per_node(d.sync_degree, inner, gpn))
        present = unit_counts > 0
        held = np.flatnonzero(present)
        first, last = int(held[0]), int(held[-1])  # the first unit's gather opens a forward, its sync closes a backward
        if t.zero >= 2 and d.shard_degree > 1:
            per_unit = [self._comm("reduce_scatter", p * grad_b, *shard_group)
                        + self._comm("all_reduce", p * grad_b / d.shard_degree, *replicate_group) if c else 0.0
                        for p, c in zip(params_unit, present)]
            sync = float(unit_counts @ np.array(per_unit))
            last_sync = per_unit[first]
        else:
            grads = float(unit_counts @ params_unit) * grad_b
            sync = self._comm("all_reduce", grads, *dp_group)
            last_sync = self._comm("all_reduce", params_unit[first] * grad_b, *dp_group)  # DDP's last bucket
            if t.zero == 1 and d.shard_degree > 1:
                sync += self._comm("all_gather", float(unit_counts @ params_unit) * weight_b, *shard_group)
        gather_all = first_gather = last_gather = 0.0
        if traffic.gathers_per_microbatch:
            per_unit = [self._comm("all_gather", p * fsdp_param_bytes(t.precision), *shard_group) if c else 0.0
                        for p, c in zip(params_unit, present)]
            gather_all, first_gather = float(unit_counts @ np.array(per_unit)), per_unit[first]
            last_gather = per_unit[last]
        gathers = traffic.gathers_per_microbatch * gather_all
        critical = sum(tables.worst_windows)
        if d.pp > 1:  # micro-batches' forwards and backwards interleave: the dp stream hides behind any of them
            if traffic.sync_every_microbatch:
                return 0.0, m * max(0.0, gathers + sync - critical)
            return max(0.0, sync - bwd_s), m * max(0.0, gathers - critical)
        fwd_w, bwd_w = tables.worst_windows
        if traffic.sync_every_microbatch and not gathers:
            # syncs alone on the dp stream: a micro-batch's hide behind the next one's forward too (FSDP2 waits for
            # its reduce-scatters only after the last backward), so only the last one's closing sync is sure to show
            return 0.0, max(last_sync, m * (sync - fwd_w - bwd_w))
        # one micro-batch after another: a forward hides only its gathers (never the first unit's, which opens it;
        # the last unit's backward gather is prefetched during it), a backward its gathers and syncs (never the
        # first unit's sync, which closes it: the next forward's first gather queues behind it)
        prefetched = last_gather if traffic.gathers_per_microbatch > 1 else 0.0
        forward = first_gather + max(0.0, gather_all + prefetched - first_gather - fwd_w)
        backward_gathers = gathers - gather_all - prefetched
        if traffic.sync_every_microbatch:
            backward = last_sync + max(0.0, backward_gathers + sync - last_sync - bwd_w)
            return 0.0, m * (forward + backward)
        return max(last_sync, sync - bwd_s), m * (forward + max(0.0, backward_gathers - bwd_w))
