"""Model building and materialization: the plan's config -> a meta model -> each rank's real shards.

Building. The model is built on the meta device from the plan's inline HF config and task by the
tracer's builder (`build_meta_model`), then *normalized* (`normalize_for_tp`): modules that DTensor's parallel styles
cannot shard are rewritten into `nn.Linear`s, in every layout alike so that parameter names and
shapes never depend on the layout. Today that is GPT-2's `Conv1D` (weight stored transposed), and its
fused `c_attn` projection, which becomes a `FusedQKV` of three Linears (`q`, `k`, `v`) whose outputs
are concatenated: a column split of each keeps every rank's heads together.

Materialization (`materialize`). After every parallel transform that works on meta (pipeline split,
TP/SP, FSDP), `to_empty` allocates only this rank's shards. Each parameter is then filled from a *full
tensor source*, one parameter-owning module at a time, and only the rank's slice of that full tensor is
kept (the slice comes from the parameter's DTensor placements; no communication):
- `SeededInit(seed)`: HF's own `_init_weights(module)` run on a CPU copy of the unsharded module, with
  the RNG seeded by `sha256(seed, module FQN)`. Every layout therefore starts from bit-identical
  weights, the single-process model included. HF initializes children before their parents, and a parent's
  `_init_weights` may set its children's weights (T5's attention and feed-forward modules scale each
  projection by its fan-in, GPT-2's blocks scale their residual projections): each ancestor's
  `_init_weights` then runs too, nearest first, on a stand-in whose path down to the module is the CPU copy
  and whose other tensors are meta (`_ancestors_around`), re-seeded alike. Without it a T5 drew every
  projection at HF's generic std, T5's `initializer_factor` of 1.0 (its attention's q 32x too large at
  d_model 64), and its unscaled attention made fp32 steps sensitive to the micro-batch split. The copy is
  fp32 whatever the parameter's dtype, and the values are then rounded to it: a 16-bit parameter (a PEFT
  run's frozen base, `executor.peft`) starts as the fp32 run's weights rounded, and the draw takes the
  RNG's fp32 path. On a lent H100 host (torch 2.11, 2026-11-26) the bf16 base of four Llama-3-8B layers
  (1.9e9 elements) was still in `normal_` on its 16-bit tensors after 70 s, one core busy, where the fp32
  run of the same layers initialized and ran 6 steps in 37 s (`benchmarks/data/h100-2026-11-26d`, call 2's
  stack); torch 2.13 draws 16-bit tensors as fast as fp32 ones on this CPU.
- `CheckpointWeights(dir)`: a local HF checkpoint (`*.safetensors`), read tensor by tensor, with the
  normalization's renames and transposes.
Buffers (rotary frequencies, BERT's position ids) are re-created by HF's `_init_weights` on the real
module that owns them. A parameter that the template ties to an earlier one (GPT-2's LM head, tied to
the token embedding) but that is its own tensor here (the pipeline split put the two on different
stages) is filled from the earlier one's source, so both copies start equal.
"""

from __future__ import annotations

import copy
import hashlib
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from tracer.errors import SoapError

TRAINABLE_TASKS = ("causal-lm", "masked-lm", "seq2seq-lm")


def build_meta_model(config: dict[str, Any], task: str, *, plan: Any = None) -> nn.Module:
    """The plan's model on the meta device (no memory), through the tracer's builder, normalized for TP;
    with a PEFT `plan`, its adapters are injected first (`executor.peft.inject`), so they wrap the modules
    peft finds in the HF model (GPT-2's fused c_attn as one)."""
    import transformers

    import tracer

    if task not in TRAINABLE_TASKS:
        raise SoapError(f"soap execute trains {', '.join(TRAINABLE_TASKS)} models, not {task}; "
                        "re-plan with --task causal-lm")
    fields = {k: v for k, v in config.items() if k not in ("transformers_version", "architectures")}
    model_type = fields.pop("model_type", None)
    if model_type is None:
        raise SoapError("the plan's model.config has no model_type; regenerate the plan with `soap plan`")
    try:
        hf_config = transformers.AutoConfig.for_model(model_type, **fields)
    except ValueError as exc:
        raise SoapError(f"cannot rebuild the {model_type} config from the plan: {exc}") from None
    hf_config.use_cache = False
    model = tracer.build_model(tracer.resolve_spec(hf_config, task=task), device="meta")
    if plan is not None:
        from executor.peft import inject

        inject(model, plan)
    normalize_for_tp(model)
    return model


def forward_inputs(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor,
                   positions: torch.Tensor) -> dict[str, torch.Tensor]:
    """The keyword inputs of one micro-batch's forward: the token ids and position ids, or, for an
    encoder-decoder, the encoder's ids and the decoder's inputs: the labels shifted right behind the
    decoder's start token (HF's `_shift_right`, with the pad id where a config names no start token)."""
    inner = model.module if isinstance(getattr(model, "module", None), nn.Module) else model  # under DDP
    config = inner.config
    if getattr(config, "is_encoder_decoder", False):
        pad = config.pad_token_id if config.pad_token_id is not None else 0
        start = getattr(config, "decoder_start_token_id", None)
        shifted = torch.cat([torch.full_like(labels[:, :1], pad if start is None else start), labels[:, :-1]], dim=1)
        return {"input_ids": ids, "decoder_input_ids": shifted.masked_fill(shifted == -100, pad)}
    return {"input_ids": ids, "position_ids": positions}


# --- normalization ----------------------------------------------------------------------------------


class FusedQKV(nn.Module):
    """A fused q/k/v projection as three Linears; the output is `cat([q(x), k(x), v(x)], -1)`."""

    def __init__(self, hidden: int, *, bias: bool, device: Any) -> None:
        super().__init__()
        self.q = nn.Linear(hidden, hidden, bias=bias, device=device)
        self.k = nn.Linear(hidden, hidden, bias=bias, device=device)
        self.v = nn.Linear(hidden, hidden, bias=bias, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1)


WeightTransform = Callable[[torch.Tensor], torch.Tensor]


def normalize_for_tp(model: nn.Module) -> None:
    """Rewrite HF `Conv1D`s as `nn.Linear` (and GPT-2's fused c_attn as `FusedQKV`), keeping values. Each module
    it makes carries `soap_from_conv1d`, so that rules about HF's Linears (`tracer.fp8.fp8_linear`) leave it
    as they leave the Conv1D it replaces.

    Records `model.soap_checkpoint_keys: {new param FQN: (checkpoint key, transform)}` so a checkpoint
    in the original layout can be loaded.
    """
    from transformers.pytorch_utils import Conv1D

    renames: dict[str, tuple[str, WeightTransform]] = {}
    for fqn, module in list(model.named_modules()):
        if not isinstance(module, Conv1D):
            continue
        parent_fqn, _, name = fqn.rpartition(".")
        parent = model.get_submodule(parent_fqn)
        n_in, n_out = module.weight.shape
        device = module.weight.device
        has_bias = module.bias is not None
        if name == "c_attn" and n_out == 3 * n_in:
            new: nn.Module = FusedQKV(n_in, bias=has_bias, device=device).to(module.weight.dtype)
            for i, part in enumerate(("q", "k", "v")):
                cols = slice(i * n_in, (i + 1) * n_in)
                renames[f"{fqn}.{part}.weight"] = (f"{fqn}.weight", lambda w, c=cols: w[:, c].t())
                if has_bias:
                    renames[f"{fqn}.{part}.bias"] = (f"{fqn}.bias", lambda b, c=cols: b[c])
                if device.type != "meta":
                    with torch.no_grad():
                        linear = getattr(new, part)
                        linear.weight.copy_(module.weight[:, cols].t())
                        if has_bias:
                            linear.bias.copy_(module.bias[cols])
        else:
            new = nn.Linear(n_in, n_out, bias=has_bias, device=device, dtype=module.weight.dtype)
            renames[f"{fqn}.weight"] = (f"{fqn}.weight", lambda w: w.t())
            if device.type != "meta":
                with torch.no_grad():
                    new.weight.copy_(module.weight.t())
                    if has_bias:
                        new.bias.copy_(module.bias)
        new.requires_grad_(module.weight.requires_grad)  # a frozen (PEFT base) weight stays frozen
        for linear in new.modules():  # the Conv1D's regime stays: fp8 plans keep it in bf16 (tracer.fp8)
            linear.soap_from_conv1d = True
        setattr(parent, name, new)
    model.soap_checkpoint_keys = {**getattr(model, "soap_checkpoint_keys", {}), **renames}  # idempotent


# --- materialization --------------------------------------------------------------------------------


def fqn_seed(seed: int, fqn: str) -> int:
    """A 63-bit RNG seed for module `fqn`, the same on every rank and in every layout."""
    digest = hashlib.sha256(f"{seed}:{fqn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class SeededInit:
    """Full tensors from HF's `_init_weights`, seeded per module FQN (see the module docstring)."""

    def __init__(self, template: nn.Module, seed: int) -> None:
        self.template = template
        self.seed = seed
        self.skeleton = _meta_skeleton(template)

    def module_params(self, fqn: str, names: list[str]) -> dict[str, torch.Tensor]:
        source = self.template.get_submodule(fqn)
        cpu = _shallow_copy_on_cpu(source, dtype=torch.float32)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(fqn_seed(self.seed, fqn))
            self.template._init_weights(cpu)
            for ancestor in _ancestors_around(self.skeleton, fqn, cpu):  # HF inits children first, parents last
                torch.manual_seed(fqn_seed(self.seed, fqn))
                self.template._init_weights(ancestor)
        return {name: getattr(cpu, name).to(source.get_parameter(name).dtype) for name in names}


def _meta_skeleton(module: nn.Module) -> nn.Module:
    """`module`'s tree of shallow copies holding meta tensors of its parameters' and buffers' shapes: what a parent's
    `_init_weights` may write to without touching memory (the template itself may hold a materialized stage)."""
    clone = copy.copy(module)
    clone._parameters = {n: None if p is None else nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                                                requires_grad=p.requires_grad)
                         for n, p in module._parameters.items()}
    clone._buffers = {n: None if b is None else torch.empty(b.shape, dtype=b.dtype, device="meta")
                      for n, b in module._buffers.items()}
    clone._modules = {n: None if m is None else _meta_skeleton(m) for n, m in module._modules.items()}
    return clone


def _ancestors_around(skeleton: nn.Module, fqn: str, leaf: nn.Module) -> list[nn.Module]:
    """The ancestors of module `fqn`, nearest first, each a copy of its skeleton whose path down to `fqn` ends in
    `leaf`: a parent's `_init_weights` that sets its children (T5's attention and feed-forward scale each projection
    by its fan-in; GPT-2's blocks scale their residual projections) then sets `leaf` and only meta tensors beside it."""
    if not fqn:
        return []
    parts = fqn.split(".")
    nodes = [skeleton]
    for part in parts[:-1]:
        nodes.append(nodes[-1]._modules[part])
    out, child = [], leaf
    for node, part in zip(reversed(nodes), reversed(parts)):
        stand_in = copy.copy(node)
        stand_in._modules = {**node._modules, part: child}
        out.append(stand_in)
        child = stand_in
    return out


class CheckpointWeights:
    """Full tensors read from a local HF checkpoint directory (`*.safetensors`)."""

    def __init__(self, directory: str | Path, renames: dict[str, tuple[str, WeightTransform]]) -> None:
        from safetensors import safe_open

        root = Path(directory)
        files = sorted(root.glob("*.safetensors")) if root.is_dir() else []
        if not files:
            raise SoapError(f"--weights {directory}: no *.safetensors files there; save the model with "
                            "`model.save_pretrained(DIR)` or point at an HF checkpoint directory")
        self.renames = renames
        self.key_to_file: dict[str, Any] = {}
        for f in files:
            handle = safe_open(str(f), framework="pt")
            for key in handle.keys():
                self.key_to_file[key] = handle

    def tensor(self, fqn: str) -> torch.Tensor:
        key, transform = self.renames.get(fqn, (fqn, lambda t: t))
        # checkpoints saved from the base model lack the prefix; a base model's has no PEFT `base_layer`
        for candidate in (key, key.partition(".")[2], key.replace(".base_layer", "")):
            if candidate in self.key_to_file:
                return transform(self.key_to_file[candidate].get_tensor(candidate)).contiguous()
        raise SoapError(f"--weights: the checkpoint has no tensor {key!r}; is it a checkpoint of this model?")

    def module_params(self, fqn: str, names: list[str]) -> dict[str, torch.Tensor]:
        prefix = f"{fqn}." if fqn else ""
        return {name: self.tensor(prefix + name) for name in names}


def _shallow_copy_on_cpu(module: nn.Module, *, dtype: torch.dtype | None = None) -> nn.Module:
    """A copy of `module` with its own parameters and buffers (empty) on the CPU and its children removed:
    what HF's `_init_weights` fills (it may touch a buffer beside the weights, as DeepSeek-V3's router).
    `dtype`: the floating-point parameters' dtype in the copy (None: their own)."""
    clone = copy.copy(module)
    clone._modules = {}
    clone._parameters = {n: None if p is None else nn.Parameter(torch.empty(
        p.shape, dtype=dtype if dtype is not None and p.dtype.is_floating_point else p.dtype))
        for n, p in module._parameters.items()}
    clone._buffers = {n: None if b is None else torch.empty(b.shape, dtype=b.dtype) for n, b in module._buffers.items()}
    return clone


def materialize(model: nn.Module, template: nn.Module, device: torch.device, *, seed: int,
                weights_dir: str | None = None) -> None:
    """Allocate this rank's shards of `model` on `device` and fill them (see the module docstring).

    `template` is the unsharded meta model the plan was applied to; its FQNs name every parameter.
    """
    from torch.distributed.tensor import DTensor

    tied = _tied_pairs(model)
    model.to_empty(device=device)
    for module, name, owner, owner_name in tied:
        setattr(module, name, getattr(owner, owner_name))
    from executor.peft import init_source

    source: Any = (CheckpointWeights(weights_dir, getattr(template, "soap_checkpoint_keys", {}))
                   if weights_dir else SeededInit(template, seed))
    source = init_source(source, template, seed=seed)
    aliases = tied_aliases(template)
    seen: set[int] = set()
    with torch.no_grad():
        for fqn, module in model.named_modules():
            names = [n for n, p in module._parameters.items() if p is not None and id(p) not in seen]
            seen.update(id(module._parameters[n]) for n in names)
            prefix = f"{fqn}." if fqn else ""
            own = [n for n in names if prefix + n not in aliases]
            full = source.module_params(fqn, own) if own else {}
            for name in names:
                owner_module, _, owner_name = aliases.get(prefix + name, "").rpartition(".")
                value = full[name] if name in full else source.module_params(owner_module, [owner_name])[owner_name]
                _copy_local_slice(getattr(module, name), value, DTensor)
            if module._buffers and not names:
                template._init_weights(module)
            elif module._buffers:
                _init_buffers(template, fqn, module, seed)


def _init_buffers(template: nn.Module, fqn: str, module: nn.Module, seed: int) -> None:
    """Fill the buffers of a module that also holds parameters (DeepSeek-V3's router score bias) by HF's
    `_init_weights` on a CPU copy, seeded as its parameters are; the parameters keep what they were given."""
    cpu = _shallow_copy_on_cpu(template.get_submodule(fqn))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(fqn_seed(seed, fqn))
        template._init_weights(cpu)
    for name, value in cpu._buffers.items():
        if value is not None and module._buffers.get(name) is not None:
            module._buffers[name].copy_(value)


def _copy_local_slice(param: torch.Tensor, full: torch.Tensor, dtensor_cls: type) -> None:
    if isinstance(param, dtensor_cls):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(full.shape, param.device_mesh, param.placements)
        local = full[tuple(slice(o, o + s) for o, s in zip(offset, shape))]
        param.to_local().copy_(local)
    else:
        param.copy_(full)


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """{parameter FQN: FQN of the parameter it is tied to, registered first} (e.g. lm_head.weight ->
    transformer.wte.weight); empty when nothing is tied."""
    first: dict[int, str] = {}
    aliases = {}
    for fqn, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[fqn] = first[id(param)]
        else:
            first[id(param)] = fqn
    return aliases


def _tied_pairs(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module, str]]:
    """Parameters registered under two names (tied embeddings), to re-tie after `to_empty`."""
    first: dict[int, tuple[nn.Module, str]] = {}
    pairs = []
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is None:
                continue
            if id(p) in first:
                pairs.append((module, name, *first[id(p)]))
            else:
                first[id(p)] = (module, name)
    return pairs
