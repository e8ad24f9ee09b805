"""`trace(MODEL) -> OpGraph`: resolve, build on meta, capture a truncated model, scale to the full one.

Only a few layers per stack are traced (blocks.py decides how many); the graph keeps one instance per
block type with its full count, so FLOPs scale exactly. Parameter counts come from the full model built
on meta (`sum(p.numel())` over `model.parameters()`, shared weights once).

Mixture-of-experts models are built with transformers' `batched_mm` experts implementation: each
token's hidden state is paired with the weights of its top-k experts (a gather of the expert weights,
which the graph treats as parameter-derived, not as activations) and multiplied in a batched matmul.
Routing is thus static on meta (no data-dependent shapes), and the expert FLOPs are exactly those of
top-k routing, tokens x k x expert FLOPs, whatever the actual load balance.

Results are cached per process on (spec, task, batch, seq_len, frontend, dtype), so repeated traces are
free, and what the full model gives (`_Skeleton`) per spec, so tracing a config at a second dtype
builds only the truncated model; `persistent_cache=True` adds the on-disk cache. The default sequence length is min(the model's
maximum positions, 2048) (inputs.py), and patches + 1 for image models.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from tracer.errors import SoapError
from tracer.ir import ModelDims, OpGraph

_CACHE: dict[tuple, OpGraph] = {}


@dataclass(frozen=True)
class _Skeleton:
    """What tracing reads off the whole model (every layer built on meta): none of it depends on the
    dtype, so a second trace of one config in a process (the planner traces fp32 and a 16-bit regime)
    reuses it instead of building every layer again (building on meta is most of an uncached trace's
    own time for llama-3.1-405b's 126 layers). Kept per config (`_spec_key`); a user's module is never
    truncated, so it has none."""

    params_total: int
    params_trainable: int
    types: list[Any]
    positions: tuple[tuple[str, int], ...]


_SKELETONS: dict[tuple, _Skeleton] = {}


def trace(model: Any, *, task: str | None = None, batch: int = 1, seq_len: int | None = None,
          frontend: str = "auto", trust_remote_code: bool = False, persistent_cache: bool = False,
          dtype: Any = None, peft: Any = None) -> OpGraph:
    """Trace MODEL (preset name, config.json path or directory, Hub id, PretrainedConfig, nn.Module or
    module factory) for one training step of `task` on `batch` samples of `seq_len` tokens.

    `persistent_cache` also keeps graphs on disk across processes (serialize.py), keyed on the
    config.json text, the arguments, the torch/transformers versions and the tracer's source; a hit
    imports neither torch nor transformers. `dtype` is the parameter and activation dtype of the traced
    model (`float32` by default; `bfloat16` gives the graph of a bf16 model, upcasts included);
    `autocast-bfloat16`/`autocast-float16` trace fp32 parameters under CUDA autocast's cast policy
    (tracer/autocast.py). `peft` (a `tracer.peft.PeftSpec`, or what `PeftSpec.from_value` takes) traces
    the model with LoRA adapters injected and its base weights frozen (tracer/peft.py)."""
    from tracer.peft import PeftSpec
    from tracer.spec import resolve_spec

    peft = PeftSpec.from_value(peft)

    if not isinstance(batch, int) or batch < 1:
        raise SoapError(f"batch must be a positive integer, got {batch}")
    if seq_len is not None and (not isinstance(seq_len, int) or seq_len < 1):
        raise SoapError(f"seq-len must be a positive integer, got {seq_len}")
    dtype_name = _dtype_name(dtype)
    if peft is not None and dtype_name.startswith("autocast-"):  # PEFT runs its 16-bit base without autocast
        dtype_name = dtype_name.removeprefix("autocast-")
    disk_key = _disk_key(model, task=task, batch=batch, seq_len=seq_len, frontend=frontend,
                         trust_remote_code=trust_remote_code, dtype=dtype_name,
                         **({"peft": peft.to_dict()} if peft else {})) if persistent_cache else None
    if disk_key is not None:
        from tracer.serialize import load_cached, store_cached

        cached = load_cached(disk_key)
        if cached is not None:
            return cached
    graph = _trace_resolved(resolve_spec(model, task=task, trust_remote_code=trust_remote_code), batch, seq_len,
                            frontend, dtype=dtype_name, peft=peft)
    if disk_key is not None:
        store_cached(disk_key, graph)
    return graph


def _disk_key(model: Any, **trace_args: Any) -> str | None:
    """A key for the on-disk cache when MODEL is a preset or a local config; None otherwise."""
    from pathlib import Path

    from tracer.serialize import cache_dir, cache_key
    from tracer.spec import PRESET_DIR

    if not isinstance(model, (str, Path)) or cache_dir() is None:
        return None
    name = str(model)
    if "\x00" in name:
        return None
    candidates = [PRESET_DIR / f"{name}.json", Path(name).expanduser() / "config.json", Path(name).expanduser()]
    for path in candidates:
        try:
            if path.is_file():
                return cache_key(path.read_text(), model=name, **trace_args)
        except (OSError, ValueError, UnicodeDecodeError):
            return None
    return None


def _dtype_name(dtype: Any) -> str:
    from tracer.autocast import AUTOCAST_DTYPES
    from tracer.ir import DTYPE_BYTES

    name = "float32" if dtype is None else str(dtype).removeprefix("torch.")
    if name in AUTOCAST_DTYPES:
        return name
    if name not in DTYPE_BYTES or not name.startswith(("float", "bfloat")):
        raise SoapError(f"dtype {dtype!r} is not a floating dtype; use float32, bfloat16, float16, "
                        f"{', '.join(AUTOCAST_DTYPES)}")
    return name


def _trace_resolved(spec: Any, batch: int, seq_len: int | None, frontend: str, dtype: str = "float32",
                    peft: Any = None) -> OpGraph:
    from tracer.inputs import default_seq_len

    seq = seq_len if seq_len is not None else default_seq_len(spec.config, spec.task)
    if spec.task == "image-cls" and seq != default_seq_len(spec.config, spec.task):
        raise SoapError(f"{spec.name} classifies images of {default_seq_len(spec.config, spec.task)} patch tokens; "
                        "--seq-len does not apply to image models")
    key = (_spec_key(spec), spec.task, batch, seq, frontend, dtype, peft)
    if key not in _CACHE:
        _CACHE[key] = _trace_uncached(spec, batch, seq, frontend, dtype, peft)
    return _CACHE[key]


def _spec_key(spec: Any) -> tuple:
    if spec.module is not None:
        return ("module", id(spec.module))
    text = json.dumps(spec.config.to_dict(), sort_keys=True, default=str)
    return (spec.name, hashlib.sha1(text.encode()).hexdigest(), spec.trust_remote_code)


def _trace_uncached(spec: Any, batch: int, seq_len: int, frontend: str, dtype: str = "float32",
                    peft: Any = None) -> OpGraph:
    import torch

    from tracer.blocks import block_types, layers_to_trace
    from tracer.build import build_model
    from tracer.capture import capture
    from tracer.fp8 import fp8_linear_names
    from tracer.graph import build_graph
    from tracer.inputs import example_inputs

    from tracer.autocast import is_autocast, mark_traced_dtype
    from tracer.autocast_mode import traced_regime

    torch_dtype = torch.float32 if is_autocast(dtype) else getattr(torch, dtype)
    from tracer.peft import apply_lora, meta_safe_adapters, quantized_base, target_base_weights

    def adapted(model: Any) -> Any:
        if peft is None:
            return model
        import copy

        # a user's module may come back as given: the adapters go into a copy, never into the user's model
        return apply_lora(copy.deepcopy(model) if spec.module is not None else model, peft)

    key = (_spec_key(spec), peft) if spec.module is None else None
    full = None
    if key not in _SKELETONS:
        full = adapted(build_model(spec, device="meta", dtype=torch_dtype, static_moe=True))
        skeleton = _Skeleton(
            params_total=sum(p.numel() for p in full.parameters()),
            params_trainable=sum(p.numel() for p in full.parameters() if p.requires_grad),
            types=block_types(full), positions=_learned_positions(full))
        if key is not None:
            _SKELETONS[key] = skeleton
    else:
        skeleton = _SKELETONS[key]
    _check_learned_positions(skeleton.positions, spec.name, seq_len)
    params_total, params_trainable, types = skeleton.params_total, skeleton.params_trainable, skeleton.types
    depth = layers_to_trace(types)
    truncatable = spec.module is None and types and depth < max(len(t.indices) for t in types)
    if truncatable:
        model = adapted(build_model(spec, device="meta", num_layers=depth, dtype=torch_dtype, static_moe=True))
    else:
        model = full if full is not None else adapted(build_model(spec, device="meta", dtype=torch_dtype,
                                                                  static_moe=True))
    del full
    model.train()
    inputs = example_inputs(model, spec.task, batch, seq_len)
    adapters = meta_safe_adapters() if peft is not None else contextlib.nullcontext()  # peft imported for PEFT only
    with torch.device("meta"), adapters, traced_regime(model, dtype, frontend) as frontend:
        captured = capture(model, inputs, frontend, preset=spec.source == "preset")
    graph = build_graph(capture=captured, types=types, name=spec.name, task=spec.task, batch=batch,
                        seq_len=seq_len, params_total=params_total, params_trainable=params_trainable,
                        dims=model_dims(spec.config, types), config=spec.config, last_instance=peft is not None,
                        fp8_linears=fp8_linear_names(model))
    if peft is not None and peft.quantized:
        graph = quantized_base(graph, set(target_base_weights(model)))
    return mark_traced_dtype(graph, dtype)


LEARNED_POSITION_TABLES = ("position_embeddings.weight", "wpe.weight", "embed_positions.weight")


def _learned_positions(model: Any) -> tuple[tuple[str, int], ...]:
    """Each learned absolute position table (FQN, positions): they cap the sequence length (RoPE and
    relative positions do not)."""
    return tuple((fqn, p.shape[0]) for fqn, p in model.named_parameters()
                 if fqn.endswith(LEARNED_POSITION_TABLES) and "relative" not in fqn and p.dim() == 2)


def _check_learned_positions(positions: tuple[tuple[str, int], ...], name: str, seq_len: int) -> None:
    for fqn, rows in positions:
        if rows < seq_len:
            raise SoapError(f"{name} has {rows} learned positions ({fqn}); --seq-len {seq_len} exceeds them")


def model_dims(config: Any, types: list[Any]) -> ModelDims:
    if config is None:
        layers = max((len(t.indices) for t in types), default=0)
        return ModelDims(num_layers=layers, hidden=0, heads=0, kv_heads=0, head_dim=0, ffn=0, vocab=0)
    get = lambda *keys, default=0: next(  # noqa: E731
        (int(getattr(config, k)) for k in keys if isinstance(getattr(config, k, None), int)), default)
    hidden = get("hidden_size", "d_model", "n_embd", "dim")
    heads = get("num_attention_heads", "num_heads", "n_head", "encoder_attention_heads")
    kv_heads = get("num_key_value_heads", "num_kv_heads", "multi_query_group_num", default=heads)
    if getattr(config, "multi_query", False):
        kv_heads = 1
    head_dim = get("head_dim", "d_kv", "kv_channels", default=hidden // heads if heads else 0)
    ffn = get("intermediate_size", "n_inner", "ffn_dim", "d_ff", "encoder_ffn_dim", "ffn_hidden_size",
              default=4 * hidden)
    return ModelDims(
        num_layers=get("num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers"),
        hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim, ffn=ffn,
        vocab=get("vocab_size"),
        num_experts=get("num_local_experts", "num_experts", "n_routed_experts"),
        experts_per_token=get("num_experts_per_tok", "moe_topk", "top_k"),
        is_encoder_decoder=_is_encoder_decoder(config),
    )


def _is_encoder_decoder(config: Any) -> bool:
    if hasattr(config, "is_encoder_decoder"):
        return bool(config.is_encoder_decoder)
    return _class_default_encoder_decoder(config)


def _class_default_encoder_decoder(config: Any) -> bool:
    """`is_encoder_decoder` of the config class of `config.model_type` when `config` (a raw config.json read
    as a namespace) leaves it out: T5Config and BartConfig set it in their constructors, so a config.json
    of T5 need not carry it."""
    from transformers import CONFIG_MAPPING

    model_type = getattr(config, "model_type", None)
    if model_type not in CONFIG_MAPPING:
        return False
    return bool(getattr(CONFIG_MAPPING[model_type](), "is_encoder_decoder", False))
