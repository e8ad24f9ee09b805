"""Pipeline stages over the layer sequence: the default balanced split, validation, module names.

The layer sequence (`layer_sequence`) is the graph's segments expanded in execution order: each run
of non-block ops is one layer (the prologue with the embeddings, the epilogue with the final norm, LM
head and loss, anything between two block stacks), and each block instance is one layer. This is
the same sequence as planner.units.layer_sequence, so the planner's partition bounds can be passed
to `simulate(..., stages=bounds)` unchanged.

Stage bounds are `(0, b1, ..., L)`: stage k holds layers bounds[k] .. bounds[k+1]-1 (`as_bounds` also
takes per-stage `(first, end)` ranges, as plan.json's `stages[k].layers` holds them). The default
(`balanced_bounds`) spreads the block instances evenly over the stages (extra instances to the
stages after the first, which carries the embeddings), keeps the prologue on the first stage and
the epilogue on the last, and attaches a between-stacks run to the stage of the block after it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from costmodel.placement import block_container
from tracer.errors import SoapError
from tracer.ir import OpGraph, OpNode
from tracer.peft import adapted_module


@dataclass(frozen=True)
class Layer:
    segment: int
    """Index of the graph segment this layer is an instance of (layers of one segment cost the same)."""
    block_id: str | None
    instance: int
    ops: tuple[OpNode, ...]
    name: str
    """The instance's module FQN (`model.layers.3`, `encoder.block.7`), or `<prologue>` / `<epilogue>` /
    `<between-i>` for runs of non-block ops."""

    @property
    def modules(self) -> tuple[str, ...]:
        """Module FQNs this layer puts on its stage: an adapted module whole, not peft's parts inside it (BERT's
        MLM head's dense, which LoRA adapts: its `lora_A.default` replaced on another stage broke the adapter)."""
        if self.block_id is not None:
            return (self.name,)
        return tuple(dict.fromkeys(adapted_module(op.module_fqn) for op in self.ops if op.module_fqn and op.params))


def layer_sequence(graph: OpGraph) -> tuple[Layer, ...]:
    layers: list[Layer] = []
    segments = list(graph.segments())
    for index, seg in enumerate(segments):
        if seg.block_id is None:
            label = "<prologue>" if index == 0 else "<epilogue>" if index == len(segments) - 1 else f"<between-{index}>"
            layers.append(Layer(index, None, 0, seg.ops, label))
        else:
            container, positions = block_container(seg.block_id), _positions(graph, seg.block_id, seg.ops, seg.repeat)
            layers.extend(Layer(index, seg.block_id, i, seg.ops, f"{container}.{positions[i]}")
                          for i in range(seg.repeat))
    return tuple(layers)


def _positions(graph: OpGraph, block_id: str, ops: Sequence[OpNode], repeat: int) -> tuple[int, ...]:
    """Each instance's index in the block's module list: the positions the tracer recorded for its type
    (`Block.indices`; `encoder.block#1` starts at 1), else counted from the first index the representative's
    ops name. Not from the ops alone where the tracer recorded them: a PEFT graph keeps the last traced instance
    as the representative (`tracer.graph.build_graph`'s `last_instance`), whose ops name `model.layers.1`."""
    indices = graph.block(block_id).indices
    if len(indices) == repeat:
        return tuple(indices)
    prefix = block_container(block_id) + "."
    for op in ops:
        if op.module_fqn.startswith(prefix):
            head = op.module_fqn[len(prefix):].split(".", 1)[0]
            if head.isdigit():
                return tuple(range(int(head), int(head) + repeat))
    return tuple(range(repeat))


def balanced_bounds(layers: Sequence[Layer], n_stages: int) -> tuple[int, ...]:
    if n_stages == 1:
        return (0, len(layers))
    block_positions = [i for i, layer in enumerate(layers) if layer.block_id is not None]
    if len(block_positions) < n_stages:
        raise SoapError(
            f"{n_stages} pipeline stages need at least {n_stages} layers but the model has {len(block_positions)}; "
            "lower pp or virtual stages"
        )
    base, extra = divmod(len(block_positions), n_stages)
    counts = [base + (1 if 1 <= k <= extra else 0) for k in range(n_stages)]
    bounds = [0]
    taken = 0
    for k in range(n_stages - 1):
        taken += counts[k]
        bounds.append(block_positions[taken])  # a stage starts at its first block (runs before it join it)
    bounds.append(len(layers))
    return tuple(bounds)


def as_bounds(stages: Sequence[int] | Sequence[tuple[int, int]]) -> tuple[int, ...]:
    """Bounds `(0, b1, ..., L)` from bounds, or from per-stage `(first, end)` layer ranges."""
    items = list(stages)
    if items and isinstance(items[0], (tuple, list)):
        for (_, end), (start, _) in zip(items, items[1:]):
            if end != start:
                raise SoapError(f"stages: layer ranges {items} are not contiguous; stage k must start where stage k-1 ends")
        return (items[0][0], *(end for _, end in items))
    return tuple(int(b) for b in items)


def validate_bounds(bounds: Sequence[int], layers: Sequence[Layer], n_stages: int) -> None:
    if len(bounds) != n_stages + 1:
        raise SoapError(f"stages: expected {n_stages + 1} bounds for {n_stages} stages, got {len(bounds)}")
    if bounds[0] != 0 or bounds[-1] != len(layers):
        raise SoapError(f"stages: bounds must start at 0 and end at {len(layers)} (the layer count), got {tuple(bounds)}")
    for k in range(n_stages):
        if bounds[k + 1] <= bounds[k]:
            raise SoapError(f"stages: stage {k} has no layers (bounds {tuple(bounds)}); every stage needs at least one")


def stage_modules(layers: Sequence[Layer], bounds: Sequence[int]) -> tuple[tuple[str, ...], ...]:
    """Module FQNs per stage, for plan.json."""
    out = []
    for k in range(len(bounds) - 1):
        mods: list[str] = []
        for layer in layers[bounds[k]:bounds[k + 1]]:
            mods.extend(layer.modules)
        out.append(tuple(dict.fromkeys(mods)))
    return tuple(out)
