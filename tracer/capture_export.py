"""The `export` front-end: torch.export (non-strict) of the forward on meta tensors -> RawOps.

Higher-order ops that wrap a sub-graph (`wrap_with_set_grad_enabled`, `wrap_with_autocast`, as HF's
rotary embeddings produce) are inlined, with `grad_enabled` recorded for the set-grad variant.
"""

from __future__ import annotations

from typing import Any

from tracer.capture import Capture, RawOp, Value, ValueTable

_SKIPPED = ("aten._assert_tensor_metadata", "aten._assert_scalar", "aten.sym_constrain_range", "aten._assert_async")


def capture_export(model: Any, inputs: dict[str, Any]) -> Capture:
    import torch

    program = torch.export.export(model, (), dict(inputs), strict=False)
    table = ValueTable()
    sig = program.graph_signature
    named = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}
    env: dict[str, Any] = {}
    user_inputs = [k for k, v in inputs.items() if isinstance(v, torch.Tensor)]
    user_index = 0
    for node in program.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta.get("val")
        if node.name in sig.inputs_to_parameters or node.name in sig.inputs_to_buffers:
            fqn = sig.inputs_to_parameters.get(node.name) or sig.inputs_to_buffers[node.name]
            trainable = bool(getattr(named.get(fqn), "requires_grad", False)) and node.name in sig.inputs_to_parameters
            env[node.name] = table.new(val, param=fqn, trainable=trainable,
                                       buffer=node.name not in sig.inputs_to_parameters)
        elif isinstance(val, torch.Tensor):
            name = user_inputs[user_index] if user_index < len(user_inputs) else node.name
            user_index += 1
            env[node.name] = table.new(val, input_name=name)
        else:
            env[node.name] = val
    ops: list[RawOp] = []
    _walk(program.graph_module, program.graph, env, table, ops, "", True)
    return Capture(ops=ops, frontend="export", values=table.values)


def _walk(root: Any, graph: Any, env: dict[str, Any], table: ValueTable, ops: list[RawOp], outer_fqn: str,
          grad_enabled: bool) -> Any:
    import torch

    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            if node.op == "get_attr":
                env[node.name] = getattr(root, node.target)
            continue
        if node.op == "output":
            return _map(node.args[0], env)
        fqn = _innermost_fqn(node) or outer_fqn
        target = node.target
        args = [_map(a, env) for a in node.args]
        sub = next((a for a in args if isinstance(a, torch.fx.GraphModule)), None)
        if sub is not None:  # a higher-order op wrapping a sub-graph: inline it
            pos = next(i for i, a in enumerate(args) if a is sub)
            sub_args = args[pos + 1:]
            enabled = bool(args[0]) if "set_grad" in str(target) else grad_enabled
            sub_env: dict[str, Any] = {}
            placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
            for ph, a in zip(placeholders, sub_args):
                sub_env[ph.name] = a
            env[node.name] = _walk(sub, sub.graph, sub_env, table, ops, fqn, enabled)
            continue
        if target is _getitem():
            container = _map(node.args[0], env)
            env[node.name] = container[node.args[1]]
            continue
        name = str(target)
        if not isinstance(target, torch._ops.OpOverload):
            env[node.name] = None
            continue
        if name.startswith(_SKIPPED):
            env[node.name] = None
            continue
        val = node.meta.get("val")
        outputs = _outputs(val, table, len(ops))
        env[node.name] = outputs[0] if _single(val) else tuple(outputs)
        ops.append(RawOp(target=name, module_fqn=fqn, args=_map(tuple(node.args), env),
                         kwargs=_map(dict(node.kwargs), env), outputs=tuple(o for o in outputs if o is not None),
                         grad_enabled=grad_enabled))
    return None


def _getitem() -> Any:
    import operator

    return operator.getitem


def _single(val: Any) -> bool:
    return not isinstance(val, (tuple, list))


def _outputs(val: Any, table: ValueTable, producer: int) -> list[Value | None]:
    import torch

    items = list(val) if isinstance(val, (tuple, list)) else [val]
    return [table.new(v, producer=producer) if isinstance(v, torch.Tensor) else None for v in items]


def _map(obj: Any, env: dict[str, Any]) -> Any:
    import torch

    if isinstance(obj, torch.fx.Node):
        return env.get(obj.name)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map(o, env) for o in obj)
    if isinstance(obj, dict):
        return {k: _map(v, env) for k, v in obj.items()}
    return obj


def _innermost_fqn(node: Any) -> str | None:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    return list(stack.values())[-1][0]
