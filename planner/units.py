"""The model as a sequence of pipeline units: the prologue, each repeated block, the epilogue.

A unit is what a pipeline stage boundary may fall between: the ops before the first block
(embeddings), one instance of a repeated block, or the ops after the last block (final norm, LM head,
loss). `model_units` reads them off `OpGraph.segments()`; `layer_sequence` expands repeats into the
per-layer list that `planner.stages.partition_stages` partitions.

A parameter read by several ops (tied embeddings) is counted once, in the first unit that reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

from costmodel.placement import is_expert
from tracer.ir import OpGraph, OpKind, OpNode

PROLOGUE = "<prologue>"
EPILOGUE = "<epilogue>"


@dataclass(frozen=True)
class Unit:
    """One pipeline-partitionable piece of the model, as traced (one instance of a block)."""

    id: str
    """The block id, or PROLOGUE / EPILOGUE for the ops outside blocks."""
    module_type: str
    ops: tuple[OpNode, ...]
    repeat: int
    """Instances in the full model (1 outside blocks)."""
    params: int
    """Parameters of one instance (tied parameters counted once in the model)."""
    expert_params: int
    """The part of `params` in MoE experts (split by expert parallelism, not TP)."""
    fwd_flops: int
    """Forward FLOPs of one instance at the traced batch."""
    bwd_flops: int
    attention_ops: int
    """Attention cores in one instance (each is one TP region and one CP exchange)."""
    has_mlp_down: bool
    """Whether the instance ends an MLP with a down projection (a second TP region)."""
    modules: tuple[str, ...]
    """Module FQNs outside blocks (prologue/epilogue), in execution order."""

    @property
    def tp_regions(self) -> int:
        """Megatron TP regions per instance: one all-reduce (or RS+AG pair) each way per region."""
        return self.attention_ops + int(self.has_mlp_down)


def _is_down_projection(op: OpNode) -> bool:
    if op.kind is not OpKind.MATMUL or not op.params or not op.inputs or not op.outputs:
        return False
    k, n = op.inputs[0].shape[-1], op.outputs[0].shape[-1]
    return k > n and not is_expert(op)


def model_units(graph: OpGraph) -> tuple[Unit, ...]:
    """The graph's segments as units, in execution order."""
    seen: set[str] = set()
    units: list[Unit] = []
    segments = list(graph.segments())
    for index, seg in enumerate(segments):
        params = experts = 0
        for op in seg.ops:
            for p in op.params:
                if p.name not in seen:
                    seen.add(p.name)
                    params += p.numel
                    experts += p.numel if is_expert(op) else 0
        if seg.block_id is None:
            uid = PROLOGUE if index == 0 else EPILOGUE if index == len(segments) - 1 else f"<between-{index}>"
            module_type = uid
            modules = tuple(dict.fromkeys(op.module_fqn for op in seg.ops if op.module_fqn))
        else:
            uid = seg.block_id
            module_type = graph.block(seg.block_id).module_type
            modules = ()
        units.append(
            Unit(
                id=uid, module_type=module_type, ops=seg.ops, repeat=seg.repeat, params=params, expert_params=experts,
                fwd_flops=sum(op.fwd_flops for op in seg.ops), bwd_flops=sum(op.bwd_flops for op in seg.ops),
                attention_ops=sum(op.kind is OpKind.ATTENTION for op in seg.ops),
                has_mlp_down=any(_is_down_projection(op) for op in seg.ops), modules=modules,
            )
        )
    return tuple(units)


def layer_units(units: tuple[Unit, ...]) -> tuple[int, ...]:
    """The unit index of every layer of the sequence a pipeline partition cuts (each block instance is
    a layer; so is each run of non-block ops): `costmodel.simulator.stages.layer_sequence`'s order."""
    return tuple(i for i, unit in enumerate(units) for _ in range(unit.repeat))


def total_params(units: tuple[Unit, ...]) -> int:
    return sum(u.params * u.repeat for u in units)
