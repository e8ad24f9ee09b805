"""The TorchFunctionMode that applies CUDA autocast's cast policy while tracing (policy: tracer/autocast.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from tracer.autocast import AUTOCAST_DTYPES, FP32, FP32_OUTPUT, LOWER_PRECISION, PROMOTE, TRACE_FRONTEND
from tracer.errors import SoapError


class CudaAutocastEmulation(TorchFunctionMode):
    """Casts each torch function call's inputs as CUDA autocast to `low_dtype` would."""

    def __init__(self, low_dtype: torch.dtype) -> None:
        super().__init__()
        self.low_dtype = low_dtype
        self.weight_casts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        """id(parameter) -> (parameter, its low-precision copy): autocast casts each weight once."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in LOWER_PRECISION:
            args, kwargs = self._cast((args, kwargs), self.low_dtype)
        elif name in FP32:
            args, kwargs = self._cast((args, kwargs), torch.float32)
        elif name in FP32_OUTPUT and _first_is_floating(args) and not _names_dtype(args, kwargs):
            kwargs = {**kwargs, "dtype": torch.float32}
        elif name in PROMOTE:
            widest = _promoted_floating((args, kwargs))
            if widest is not None:
                args, kwargs = self._cast((args, kwargs), widest)
        return func(*args, **kwargs)

    def _cast(self, obj: Any, dtype: torch.dtype) -> Any:
        if isinstance(obj, torch.Tensor):
            if not obj.is_floating_point() or obj.dtype in (dtype, torch.float64):
                return obj
            if obj.is_leaf and obj.requires_grad and dtype == self.low_dtype:
                if id(obj) not in self.weight_casts:
                    self.weight_casts[id(obj)] = (obj, obj.to(dtype))
                return self.weight_casts[id(obj)][1]
            return obj.to(dtype)
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._cast(o, dtype) for o in obj)
        if isinstance(obj, dict):
            return {k: self._cast(v, dtype) for k, v in obj.items()}
        return obj


@contextlib.contextmanager
def traced_regime(model: Any, dtype_name: str, frontend: str) -> Iterator[str]:
    """Capture `model` in the regime of trace dtype `dtype_name`; yields the front-end to capture with.
    An autocast dtype runs the model under the emulation, captured by the one front-end that runs it
    eagerly (TRACE_FRONTEND); any other dtype changes nothing."""
    if dtype_name not in AUTOCAST_DTYPES:
        yield frontend
        return
    if frontend not in ("auto", TRACE_FRONTEND):
        raise SoapError(f"dtype {dtype_name} is traced with the {TRACE_FRONTEND} front-end; drop --frontend {frontend}")
    with emulate_cuda_autocast(model, dtype_name):
        yield TRACE_FRONTEND


@contextlib.contextmanager
def emulate_cuda_autocast(model: Any, dtype_name: str) -> Iterator[None]:
    """While active, every forward of `model` runs under `CudaAutocastEmulation`: a forward pre-hook of
    the root module pushes it (inside the capture front-end's modes) and its forward hook pops it."""
    mode = CudaAutocastEmulation(getattr(torch, AUTOCAST_DTYPES[dtype_name]))
    def push(module: Any, args: Any) -> None:
        mode.__enter__()

    def pop(module: Any, args: Any, out: Any) -> None:
        mode.__exit__(None, None, None)

    enter = model.register_forward_pre_hook(push)
    leave = model.register_forward_hook(pop, always_call=True)
    try:
        yield
    finally:
        enter.remove()
        leave.remove()


def _first_is_floating(args: tuple) -> bool:
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    return first is not None and first.is_floating_point()


def _names_dtype(args: tuple, kwargs: dict) -> bool:
    return kwargs.get("dtype") is not None or any(isinstance(a, torch.dtype) for a in args)


def _promoted_floating(obj: Any) -> torch.dtype | None:
    """The promoted dtype of the floating tensors in `obj` when they differ; None when they agree."""
    found: set[torch.dtype] = set()

    def visit(o: Any) -> None:
        if isinstance(o, torch.Tensor) and o.is_floating_point():
            found.add(o.dtype)
        elif isinstance(o, (list, tuple)):
            for x in o:
                visit(x)
        elif isinstance(o, dict):
            for x in o.values():
                visit(x)

    visit(obj)
    if len(found) < 2:
        return None
    promoted = found.pop()
    for d in found:
        promoted = torch.promote_types(promoted, d)
    return promoted
