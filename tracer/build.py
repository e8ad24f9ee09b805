"""ModelSpec -> nn.Module, on any device, optionally truncated to fewer layers for tracing.

`build_model(spec, device="meta")` is what the planner and tracer use (no weights are allocated);
the executor calls it with a real device. Truncation (`num_layers=N`) keeps the first N layers of every
repeated stack by editing the config's layer counts (and per-layer lists such as `layer_types`), so
layer i of the truncated model is built exactly like layer i of the full one.
"""

from __future__ import annotations

import copy
from typing import Any

from tracer.errors import SoapError
from tracer.spec import ModelSpec, auto_class_for

LAYER_COUNT_KEYS = (
    "num_hidden_layers", "num_layers", "num_decoder_layers", "encoder_layers", "decoder_layers",
    "n_layer", "n_layers",
)
"""Config attributes that count repeated layers (one of them per stack, depending on the family)."""

PER_LAYER_LIST_KEYS = ("layer_types", "block_types", "attention_layers")
"""Config attributes holding one entry per layer; truncated with the layer count."""


def truncated_config(config: Any, num_layers: int) -> Any:
    """A copy of `config` whose every layer stack has at most `num_layers` layers."""
    config = copy.deepcopy(config)
    for sub in [config, *_sub_configs(config)]:
        for key in LAYER_COUNT_KEYS:
            value = sub.__dict__.get(key)
            if isinstance(value, int) and value > num_layers:
                setattr(sub, key, num_layers)
        for key in PER_LAYER_LIST_KEYS:
            value = sub.__dict__.get(key)
            if isinstance(value, (list, tuple)) and len(value) > num_layers:
                setattr(sub, key, type(value)(value[:num_layers]))
    return config


def _sub_configs(config: Any) -> list[Any]:
    from transformers import PretrainedConfig

    return [v for v in vars(config).values() if isinstance(v, PretrainedConfig)]


def build_model(spec: ModelSpec, *, device: Any = "meta", num_layers: int | None = None, dtype: Any = None,
                static_moe: bool = False) -> Any:
    """Build `spec`'s model for its task on `device` (meta by default: no memory is allocated).

    `num_layers` truncates every layer stack to that many layers (for tracing a few and scaling);
    `dtype` is the parameter dtype (default float32). `static_moe=True` (the tracer's choice) builds
    mixture-of-experts layers with transformers' `batched_mm` experts, whose routing has no
    data-dependent shapes; training keeps the model's default experts implementation. A user module is returned as given (or as its
    factory builds it) when already on `device` in `dtype`, else as a moved copy; it cannot be truncated.
    """
    import torch

    if spec.module is not None:
        module = spec.module if isinstance(spec.module, torch.nn.Module) else spec.module()
        if not isinstance(module, torch.nn.Module):
            raise SoapError(f"the module factory {spec.name} returned a {type(module).__name__}, not an nn.Module")
        return _moved(module, device, dtype)
    # a copy: from_config records the attention and experts implementations (and dtype) on the config it is
    # given, and the caller's config may build the model it trains (a MoE one would then run batched_mm)
    config = copy.deepcopy(spec.config) if num_layers is None else truncated_config(spec.config, num_layers)
    kwargs: dict[str, Any] = {"trust_remote_code": spec.trust_remote_code, "dtype": dtype or torch.float32}
    cls = auto_class_for(spec.task)
    if static_moe and _is_moe(config):
        # Static routing: every token visits its top-k experts through batched matmuls, so capture on meta
        # needs no data-dependent control flow and the FLOPs are exactly those of top-k routing.
        kwargs["experts_implementation"] = "batched_mm"
    try:
        with torch.device(device):
            try:
                return cls.from_config(config, **kwargs)
            except (ValueError, KeyError) as exc:
                if "experts_implementation" not in kwargs or "experts" not in str(exc):
                    raise
                kwargs.pop("experts_implementation")
                return cls.from_config(config, **kwargs)
    except SoapError:
        raise
    except ValueError as exc:
        if "trust_remote_code" in str(exc):
            raise SoapError(f"{spec.name} needs remote code; pass --trust-remote-code if you trust it") from None
        raise SoapError(f"cannot build {spec.name} for {spec.task}: {_first_line(exc)}") from None


def _moved(module: Any, device: Any, dtype: Any) -> Any:
    """`module` on `device` with floating tensors of `dtype`: itself when already there, else a copy
    (the user's module is never moved or cast in place)."""
    import torch

    tensors = [*module.parameters(), *module.buffers()]
    on_device = all(t.device == torch.device(device) for t in tensors)
    of_dtype = dtype is None or all(t.dtype == dtype for t in tensors if t.is_floating_point())
    if on_device and of_dtype:
        return module
    return copy.deepcopy(module).to(device=device, dtype=dtype)


def _is_moe(config: Any) -> bool:
    return any(
        isinstance(getattr(config, key, None), int) and getattr(config, key) > 1
        for key in ("num_local_experts", "num_experts", "n_routed_experts")
    )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
