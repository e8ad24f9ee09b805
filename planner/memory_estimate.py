"""The estimator's memory: the simulator's memory model, evaluated from per-unit tables.

The planner prices thousands of candidates, so it cannot build the simulator's cost tables for each;
but it must never prune a plan the simulator would accept, and never keep one it rejects. So every
term is computed by the same functions the simulator calls, over the same stages:

    stages            `Estimator.stage_bounds(pp, v)`, the partition `planner.pricing.Pricer` simulates
    parameters        `costmodel.memory.stage_params` per unit (one instance), summed over a stage's
                      instances; a parameter two non-block units share (tied embedding and LM head) is
                      counted once where one stage (state) or rank (buffers) holds both, as
                      `stage_params` over the stage's ops counts it
    weights, grads,   `costmodel.memory.model_state_bytes` per stage, summed over the rank's stages
    optimizer, host
    buffers           `costmodel.memory.buffer_bytes` over the rank's parameters
    activations       per unit instance `costmodel.simulator.pricing.placed_activations` (each op at its
                      Megatron placement, the recompute policy's kept bytes and window); per stage kept =
                      the sum, backward peak = max over its layers of (prefix of kept + window); per rank
                      `costmodel.memory_schedule.activation_peaks` over the schedule's compute order
    workspace         `costmodel.memory.workspace_bytes`, and on a profile with a fitted allocator reserve
                      `costmodel.memory.reserve_bytes`: the rank's loss transient (per unit instance
                      `costmodel.simulator.pricing.placed_loss_transient`, the largest over the rank's stages)
                      plus the reserve fraction of its tensors
The peak is the worst rank's total; tests/test_memory_agreement.py holds it equal to the simulator's
peak over the search's candidate families. (A plan whose per-op splits differ from the Megatron
placement, `Strategy.op_splits`, is simulated again and checked there.)
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from costmodel.memory import (
    MemoryBreakdown, ParamSet, blocks_keep_autocast_copies, buffer_bytes, grads_held_at_peak, held_autocast_copies,
    model_state_bytes, parameter_degrees, rank_breakdown, stage_params, workspace_bytes,
)
from costmodel.memory_schedule import activation_peaks, stage_activations
from costmodel.placement import OpPlacement, block_placements
from costmodel.profiles import DeviceProfile
from costmodel.schedule import stage_to_rank, step_shape
from costmodel.simulator.pricing import activation_shape, placed_activations, placed_loss_transient
from costmodel.strategy import ParallelDims, Strategy, TrainingConfig, runs_on_fsdp2, shards_vocabulary
from planner.units import Unit, layer_units
from tracer.ir import OpGraph


class MemoryTables:
    """Per-unit parameter and activation tables of one graph, and the memory of a candidate from them."""

    def __init__(self, graph: OpGraph, units: tuple[Unit, ...]) -> None:
        self.graph, self.units = graph, units
        self.layers = np.array(layer_units(units), dtype=int)
        """The unit of every layer, in the order a pipeline partition cuts them."""
        self.outside = [u for u, unit in enumerate(units) if unit.id.startswith("<")]
        self.degrees = lru_cache(maxsize=None)(self._degrees_uncached)
        self.params = lru_cache(maxsize=None)(self._params_uncached)
        self.joint = lru_cache(maxsize=None)(self._joint_uncached)
        self.unit_activations = lru_cache(maxsize=None)(self._unit_activations_uncached)
        self.placements = lru_cache(maxsize=None)(self._placements_uncached)
        self.stage_counts = lru_cache(maxsize=None)(self._stage_counts_uncached)
        self.rank_activations = lru_cache(maxsize=4096)(self._rank_activations_uncached)
        self.held = lru_cache(maxsize=16384)(self._held_uncached)
        self.rank_state = lru_cache(maxsize=8192)(self._rank_state_uncached)

    # --- tables -----------------------------------------------------------------------------------
    def _degrees_uncached(self, tp: int, ep: int, vocab: bool) -> dict[str, int]:
        return parameter_degrees(self.graph.ops, tensor_parallel=tp, expert_parallel=ep, vocab_parallel=vocab)

    def _params_uncached(self, tp: int, ep: int, vocab: bool) -> tuple[ParamSet, ...]:
        """One instance of each unit on its own, its parameters sharded as in the whole model."""
        degrees = self.degrees(tp, ep, vocab)
        return tuple(stage_params(u.ops, block_counts={}, degrees=degrees) for u in self.units)

    def _joint_uncached(self, tp: int, ep: int, vocab: bool, group: frozenset) -> ParamSet:
        """Non-block units held together (a parameter they share counted once)."""
        ops = [op for u in sorted(group) for op in self.units[u].ops]
        return stage_params(ops, block_counts={}, degrees=self.degrees(tp, ep, vocab))

    def _placements_uncached(self, u: int, tp: int, cp: int, ep: int, mb: int, precision: str, sequence_parallel: bool,
                             cross_entropy: str) -> tuple[OpPlacement, ...]:
        """Unit u's ops with their splits and activation collectives, as the simulator places them by default
        (`costmodel.placement.block_placements`), on a strategy reduced to what they read (`_reduced_strategy`)."""
        strategy = self._reduced_strategy(tp, cp, ep, 1, sequence_parallel, mb, precision, cross_entropy)
        return block_placements(self.units[u].ops, strategy, activation_shape(self.graph, strategy))

    def _reduced_strategy(self, tp: int, cp: int, ep: int, pp: int, sequence_parallel: bool, mb: int, precision: str,
                          cross_entropy: str, **train: object) -> Strategy:
        """A strategy reduced to what placements, sizes and activation rules read: the data-parallel and batch fields
        do not matter (dp_shard = ep only so that ep divides it)."""
        return Strategy(dims=ParallelDims(tp=tp, cp=cp, ep=ep, pp=pp, dp_shard=ep),
                        train=TrainingConfig(global_batch=mb, seq_len=self.graph.seq_len, micro_batch=mb,
                                             sequence_parallel=sequence_parallel, precision=precision,
                                             cross_entropy=cross_entropy, **train))

    def _unit_activations_uncached(self, u: int, tp: int, cp: int, ep: int, pp: int, sequence_parallel: bool, mb: int,
                                   policy: str, precision: str, attention: str, compiled: bool,
                                   cross_entropy: str, device_kind: str = "gpu") -> tuple[float, float, float]:
        """(kept, recompute window, loss transient) of one instance of unit u: the simulator's chunk rules, on a
        strategy reduced to what the placements and sizes read (`_reduced_strategy`)."""
        strategy = self._reduced_strategy(tp, cp, ep, pp, sequence_parallel, mb, precision, cross_entropy,
                                          recompute=policy, attention=attention, compile=compiled)
        shape = activation_shape(self.graph, strategy)
        placements = self.placements(u, tp, cp, ep, mb, precision, sequence_parallel, cross_entropy)
        kept, window = placed_activations(placements, strategy, self.graph.batch, shape, policy, device_kind)
        return kept, window, placed_loss_transient(placements, strategy, self.graph.batch)

    def _rank_activations_uncached(self, tp: int, cp: int, ep: int, pp: int, sequence_parallel: bool, mb: int,
                                   recompute: str, recompute_per_block: tuple, precision: str, attention: str,
                                   compiled: bool, cross_entropy: str, bounds: tuple[int, ...], schedule: str,
                                   microbatches: int, stages_per_rank: int, device_kind: str = "gpu"
                                   ) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """Each pipeline rank's activation peak: per layer, then per stage (kept, backward peak), then per
        rank over the schedule; and each rank's loss transient (the largest over its stages' units). Memoized:
        it reads none of the candidate's data-parallel, ZeRO, optimizer or offload choices, which the
        enumeration varies most. `compiled`: torch.compile, whose partitioner saves
        less (`costmodel.memory_activations.compiled_keep`)."""
        policies = dict(recompute_per_block)
        # a unit's activations read the pipeline degree only through whether there is a pipeline (its stages
        # hold the logits) and the vocabulary rule, so they are one table entry for every pp > 1 that shards
        # the vocabulary as pp = 2 does
        unit_pp = 2 if pp > 1 and shards_vocabulary(tp=tp, pp=2) == shards_vocabulary(tp=tp, pp=pp) else pp
        unit_acts = np.array([
            self.unit_activations(u, tp, cp, ep, unit_pp, sequence_parallel, mb,
                                  "none" if unit.id.startswith("<") else policies.get(unit.id, recompute),
                                  precision, attention, compiled, cross_entropy, device_kind)
            for u, unit in enumerate(self.units)])
        stage_acts = stage_activations(unit_acts[self.layers, 0], unit_acts[self.layers, 1], bounds)
        transient = [max(unit_acts[self.layers[a:b], 2], default=0.0) for a, b in zip(bounds, bounds[1:])]
        return (activation_peaks(schedule, pp, microbatches, stages_per_rank, stage_acts),  # step_shape keeps pp
                tuple(max(transient[s] for s in mine) for mine in rank_stages(schedule, pp, stages_per_rank)))

    def _stage_counts_uncached(self, bounds: tuple[int, ...]) -> np.ndarray:
        """Instances of each unit on each stage: shape (stages, units)."""
        counts = np.zeros((len(bounds) - 1, len(self.units)))
        for stage, (a, b) in enumerate(zip(bounds, bounds[1:])):
            np.add.at(counts[stage], self.layers[a:b], 1)
        return counts

    def _held_uncached(self, bounds: tuple[int, ...], stages: tuple[int, ...], tp: int, ep: int, vocab: bool,
                       shapes: bool) -> ParamSet:
        """`_holding` of the unit instances on `stages` of the partition `bounds` (memoized)."""
        counts = self.stage_counts(bounds)
        return self._holding(counts[list(stages)].sum(axis=0), tp, ep, vocab, shapes=shapes)

    # --- one candidate ----------------------------------------------------------------------------
    def _holding(self, counts: np.ndarray, tp: int, ep: int, vocab: bool, *, shapes: bool = False) -> ParamSet:
        """The parameters of unit instances `counts` held together (shared parameters once), as
        `stage_params` over their ops counts them; their local shapes only when asked (adafactor)."""
        alone = self.params(tp, ep, vocab)
        present = [u for u in self.outside if counts[u] > 0]
        outside = self.joint(tp, ep, vocab, frozenset(present)) if len(present) > 1 else \
            alone[present[0]] if present else ParamSet(0, 0, (), 0)
        blocks = [u for u in range(len(alone)) if counts[u] > 0 and u not in self.outside]
        return ParamSet(
            trainable=int(sum(counts[u] * alone[u].trainable for u in blocks)) + outside.trainable,
            frozen=int(sum(counts[u] * alone[u].frozen for u in blocks)) + outside.frozen,
            shapes=tuple(s for u in blocks for s in alone[u].shapes * int(counts[u])) + outside.shapes if shapes else (),
            largest_unit=max([alone[u].largest_unit for u in blocks] + [outside.largest_unit]),
            quantized_bytes=int(sum(counts[u] * alone[u].quantized_bytes for u in blocks)) + outside.quantized_bytes,
            largest_quantized=max([alone[u].largest_quantized for u in blocks] + [outside.largest_quantized]),
            largest_trainable_unit=max([alone[u].largest_trainable_unit or 0 for u in blocks]
                                       + [outside.largest_trainable_unit or 0]),
            autocast_copied=int(sum(counts[u] * _copied(alone[u]) for u in blocks)) + _copied(outside),
            autocast_copied_outside=_copied(outside),
            fp8_linear=int(sum(counts[u] * alone[u].fp8_linear for u in blocks)) + outside.fp8_linear,
            fp8_linear_outside=outside.fp8_linear,
        )

    def _rank_state_uncached(self, bounds: tuple[int, ...], schedule: str, pp: int, v: int, tp: int, ep: int,
                             vocab: bool, precision: str, optimizer: str, zero: int, dp_shard: int, dp_sync: int,
                             offload: bool, fsdp: bool, pipeline: bool, autocast: bool = True,
                             keep_copies: bool = True) -> tuple[tuple[int, int, int, int, int], ...]:
        """Each pipeline rank's (weights, grads, optimizer, buffers, host) bytes: model state per stage on the
        engine the executor runs, summed over the rank's stages, and buffers over the rank's parameters.
        Memoized: it reads none of the micro-batching choices, and of recompute only whether the blocks keep
        their autocast copies (`keep_copies`: `costmodel.memory.blocks_keep_autocast_copies`)."""
        adafactor = optimizer == "adafactor"
        state = []
        same: dict[tuple[int, int, int], object] = {}  # stages holding as many parameters hold as much state
        for s in range(len(bounds) - 1):
            params = self.held(bounds, (s,), tp, ep, vocab, adafactor)
            copies = held_autocast_copies(params, blocks_keep=keep_copies, precision=precision)
            key = (params.trainable, params.frozen, params.quantized_bytes, copies)
            if adafactor or key not in same:
                same[key] = model_state_bytes(
                    params.trainable, precision=precision, optimizer=optimizer, zero=zero, dp_shard=dp_shard,
                    offload_optimizer=offload, param_shapes=params.shapes if adafactor else None, frozen=params.frozen,
                    pipeline=pipeline, fsdp=fsdp, quantized=params.quantized_bytes, autocast=autocast,
                    autocast_copied=copies)
            state.append(same[key])
        out = []
        for mine in rank_stages(schedule, pp, v):
            held = self.held(bounds, mine, tp, ep, vocab, False)
            out.append((
                sum(state[s].weights for s in mine), sum(state[s].grads for s in mine),
                sum(state[s].optimizer for s in mine),
                buffer_bytes(params=held, precision=precision, zero=zero, dp=dp_sync, dp_shard=dp_shard, offload=offload,
                             fsdp=fsdp),
                sum(state[s].offloaded for s in mine),
            ))
        return tuple(out)

    def memory(self, dims: ParallelDims, train: TrainingConfig, bounds: tuple[int, ...], device: DeviceProfile
               ) -> MemoryBreakdown:
        """The worst pipeline rank's memory (see the module docstring)."""
        d, t = dims, train
        vocab = shards_vocabulary(tp=d.tp, pp=d.pp)
        name, pp, m, v, _ = step_shape(t.schedule, d.pp, t.num_microbatches, t.grad_accum, t.virtual_stages)
        activations, transients = self.rank_activations(
            d.tp, d.cp, d.ep, d.pp, t.sequence_parallel, t.micro_batch, t.recompute, t.recompute_per_block,
            t.precision, t.attention, t.compile, t.cross_entropy, bounds, name, m, v, device.kind)
        # model state per stage, on the engine the executor runs
        fsdp = runs_on_fsdp2(dp=d.dp, cp=d.cp, tp=d.tp, pp=d.pp, zero=t.zero, offload=t.offload_optimizer)
        ranks = self.rank_state(bounds, name, pp, v, d.tp, d.ep, vocab, t.precision, t.optimizer, t.zero,
                                d.shard_degree, d.sync_degree, t.offload_optimizer, fsdp, d.pp > 1, t.peft is None,
                                blocks_keep_autocast_copies(t))
        workspace = workspace_bytes(device)
        held = grads_held_at_peak(d, t)
        worst: MemoryBreakdown | None = None
        for (weights, grads, optimizer, buffers, host), peak, transient in zip(ranks, activations, transients):
            total = rank_breakdown(weights=weights, grads=grads, optimizer=optimizer, activations=int(peak),
                                   buffers=buffers, host=host, workspace=workspace,
                                   reserve_fraction=device.allocator_reserve_fraction, grads_held=held,
                                   loss_transient=transient)
            if worst is None or total.total > worst.total:
                worst = total
        assert worst is not None
        return worst


@lru_cache(maxsize=1024)
def rank_stages(schedule: str, pp: int, v: int) -> tuple[tuple[int, ...], ...]:
    """The stages each pipeline rank runs (`costmodel.schedule.stage_to_rank`), rank by rank."""
    owner = stage_to_rank(schedule, pp, v)
    return tuple(tuple(s for s, r in enumerate(owner) if r == rank) for rank in range(pp))


def _copied(params: ParamSet) -> int:
    """`ParamSet.autocast_copied`, None read as every trainable element."""
    return params.trainable if params.autocast_copied is None else params.autocast_copied
