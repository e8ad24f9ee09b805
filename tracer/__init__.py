"""Model spec -> OpGraph. Knows nothing of devices.

`tracer.trace(MODEL, ...)` is the entry point (see tracer/api.py); `tracer.build_model(spec)` builds a
resolved `ModelSpec` on any device (tracer/build.py). Importing this package imports no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tracer.ir import OpGraph
    from tracer.spec import ModelSpec

__all__ = ["trace", "build_model", "resolve_spec", "preset_names"]


def trace(model: Any, **kwargs: Any) -> OpGraph:
    """Trace MODEL into an OpGraph; see `tracer.api.trace` for the keyword arguments."""
    from tracer.api import trace as _trace

    return _trace(model, **kwargs)


def build_model(spec: ModelSpec, **kwargs: Any) -> Any:
    """Build a resolved ModelSpec's nn.Module; see `tracer.build.build_model`."""
    from tracer.build import build_model as _build

    return _build(spec, **kwargs)


def resolve_spec(model: Any, **kwargs: Any) -> ModelSpec:
    from tracer.spec import resolve_spec as _resolve

    return _resolve(model, **kwargs)


def preset_names() -> list[str]:
    from tracer.spec import preset_names as _names

    return _names()
