"""The `dispatch` front-end: run the forward on meta tensors under a TorchDispatchMode and record ops.

Module forward pre/post hooks keep a stack of module FQNs, so every ATen op is attributed to the
innermost module running when it was dispatched. A TorchFunctionMode records a few composite functions
(linear, SDPA, layer norm, embedding, dropout, cross entropy) as one op each, under the same names the
export front-end gives them, and keeps their decomposition out of the record.

Reading a scalar out of a meta tensor (`.item()`, `bool(t)`) has no data to read: it returns a
static value (see `_static_scalar`), so Python branches on tensor values take one fixed path.

Nothing here needs the model to be traceable: any forward that runs on meta tensors is captured,
Python control flow included (it is simply executed).
"""

from __future__ import annotations

from typing import Any

from tracer.capture import Capture, RawOp, Value, ValueTable

COMPOSITES = {
    "linear": "aten.linear.default",
    "scaled_dot_product_attention": "aten.scaled_dot_product_attention.default",
    "layer_norm": "aten.layer_norm.default",
    "rms_norm": "aten.rms_norm.default",
    "group_norm": "aten.group_norm.default",
    "embedding": "aten.embedding.default",
    "dropout": "aten.dropout.default",
    "cross_entropy": "aten.cross_entropy_loss.default",
    "cross_entropy_loss": "aten.cross_entropy_loss.default",
    "contiguous": "aten.contiguous.default",
}
"""torch functions recorded whole (by `__name__`), with the ATen name export uses for them."""


def capture_dispatch(model: Any, inputs: dict[str, Any]) -> Capture:
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    recorder = _Recorder(model, inputs)

    class FunctionMode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            target = COMPOSITES.get(getattr(func, "__name__", ""))
            if target is None or recorder.depth:
                return func(*args, **kwargs)
            recorder.depth += 1
            try:
                out = func(*args, **kwargs)
            finally:
                recorder.depth -= 1
            if out is not (args[0] if args else None):  # `contiguous` of a contiguous tensor is itself: no op
                recorder.record(target, args, kwargs, out)
            return out

    class DispatchMode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.ops.aten._local_scalar_dense.default:
                return _static_scalar(args[0])
            out = func(*args, **kwargs)
            if not recorder.depth:
                recorder.record(str(func), args, kwargs, out)
            return out

    handles = []
    for fqn, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(recorder.enter(fqn)))
        handles.append(module.register_forward_hook(recorder.leave(fqn), always_call=True))
    try:
        with FunctionMode(), DispatchMode():
            model(**inputs)
    finally:
        for h in handles:
            h.remove()
    recorder.note_requires_grad()
    return Capture(ops=recorder.ops, frontend="dispatch", values=recorder.table.values)


def _static_scalar(tensor: Any) -> Any:
    """A data-dependent scalar read on a meta tensor: there is no data, so take the static branch.

    Bools read True (HF's "is everything unpadded/valid" checks then skip their data-dependent paths),
    integers 1 and floats 1.0.
    """
    import torch

    if tensor.dtype == torch.bool:
        return True
    return 1 if not tensor.dtype.is_floating_point else 1.0


class _Recorder:
    def __init__(self, model: Any, inputs: dict[str, Any]) -> None:
        import torch

        self.table = ValueTable()
        self.ops: list[RawOp] = []
        self.stack: list[str] = []
        self.depth = 0
        self.by_id: dict[int, Value] = {}
        self.keep: list[Any] = []  # holds recorded tensors so their ids stay unique
        for name, p in model.named_parameters(remove_duplicate=False):
            self._bind(p, param=name, trainable=p.requires_grad)
        for name, b in model.named_buffers(remove_duplicate=False):
            self._bind(b, param=name, buffer=True)
        for name, t in inputs.items():
            if isinstance(t, torch.Tensor):
                self._bind(t, input_name=name)

    def note_requires_grad(self) -> None:
        """Autograd marks an op's output after the op returns, so read the marks once the forward is done
        (this sees through custom autograd.Functions, whose inner ops run without grad)."""
        for tensor in self.keep:
            value = self.by_id.get(id(tensor))
            if value is not None and value.producer is not None:
                value.requires_grad = bool(tensor.requires_grad)

    def _bind(self, tensor: Any, **kw: Any) -> Value:
        if id(tensor) in self.by_id:
            return self.by_id[id(tensor)]
        value = self.table.new(tensor, **kw)
        self.by_id[id(tensor)] = value
        self.keep.append(tensor)
        return value

    def enter(self, fqn: str) -> Any:
        def hook(module: Any, args: Any) -> None:
            self.stack.append(fqn)

        return hook

    def leave(self, fqn: str) -> Any:
        def hook(module: Any, args: Any, out: Any) -> None:
            if self.stack and self.stack[-1] == fqn:
                self.stack.pop()

        return hook

    def record(self, target: str, args: Any, kwargs: Any, out: Any) -> None:
        import torch

        grad = torch.is_grad_enabled()
        mapped_args = self._map(args)
        mapped_kwargs = self._map(kwargs)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        producer = len(self.ops)
        values = []
        for o in outs:
            if isinstance(o, torch.Tensor):
                value = self.table.new(o, producer=producer)
                self.by_id[id(o)] = value
                self.keep.append(o)
                values.append(value)
        self.ops.append(RawOp(target=target, module_fqn=self.stack[-1] if self.stack else "",
                              args=mapped_args, kwargs=mapped_kwargs, outputs=tuple(values), grad_enabled=grad))

    def _map(self, obj: Any) -> Any:
        import torch

        if isinstance(obj, torch.Tensor):
            return self.by_id.get(id(obj)) or self._bind(obj)
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._map(o) for o in obj)
        if isinstance(obj, dict):
            return {k: self._map(v) for k, v in obj.items()}
        return obj
