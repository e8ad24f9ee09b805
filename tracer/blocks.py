"""Repeated blocks: find layer stacks, decide how many layers to trace, map ops to block instances.

A *stack* is an `nn.ModuleList` (or `nn.Sequential`) of two or more modules of one class that holds
parameters and is not inside another stack: `model.layers`, `transformer.h`, `encoder.layer`,
`encoder.block`, `decoder.block`, ... Within a stack, instances whose parameters differ in names or
shapes (T5's first block owns the relative-position bias; DeepSeek's first layers are dense) form
separate *block types*; each type becomes one `Block` whose id is the stack's FQN (suffixed with
`#k` for the k-th type when a stack has several), and whose count is the number of its instances.

The tracer builds the model truncated to `traced_layers(...)` layers per stack: enough to contain at
least one instance of every type (and two of the main type when the model has that many).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class BlockType:
    id: str
    stack: str
    module_type: str
    indices: tuple[int, ...]
    """Instances of this type in the full model."""
    params_per_instance: int


def find_stacks(model: Any) -> dict[str, list[Any]]:
    """FQN -> the list of its layers, for every outermost stack of same-class modules."""
    import torch.nn as nn

    stacks: dict[str, list[Any]] = {}
    for fqn, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < 2:
            continue
        children = list(module)
        if len({type(c) for c in children}) != 1 or not any(True for _ in children[0].parameters()):
            continue
        if any(fqn.startswith(s + ".") for s in stacks):
            continue
        stacks[fqn] = children
    return stacks


def signature(layer: Any) -> tuple:
    return (type(layer).__name__,) + tuple(
        (name, tuple(p.shape)) for name, p in layer.named_parameters(remove_duplicate=False)
    )


def block_types(model: Any) -> list[BlockType]:
    types: list[BlockType] = []
    for stack, layers in find_stacks(model).items():
        groups: dict[tuple, list[int]] = {}
        for i, layer in enumerate(layers):
            groups.setdefault(signature(layer), []).append(i)
        for k, (sig, indices) in enumerate(groups.items()):
            block_id = stack if len(groups) == 1 else f"{stack}#{k}"
            n_params = sum(p.numel() for p in layers[indices[0]].parameters())
            types.append(BlockType(block_id, stack, sig[0], tuple(indices), n_params))
    return types


def layers_to_trace(types: list[BlockType], preferred: int = 2) -> int:
    """Layers per stack to build so every type has an instance (and the big types two when possible)."""
    need = 1
    for t in types:
        need = max(need, t.indices[min(preferred, len(t.indices)) - 1] + 1 if len(t.indices) > 1 else t.indices[0] + 1)
    return need


def instance_of(fqn: str, stacks: list[str]) -> tuple[str, int] | None:
    """(stack, index) of the stack instance that `fqn` lies in, or None outside stacks."""
    for stack in stacks:
        prefix = stack + "." if stack else ""
        if fqn.startswith(prefix):
            rest = fqn[len(prefix):].split(".", 1)[0]
            if rest.isdigit():
                return stack, int(rest)
    return None
