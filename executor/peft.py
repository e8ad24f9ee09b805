"""PEFT at run time: LoRA adapters (and QLoRA's 4-bit base) on the plan's model, before it is parallelized.

What a PEFT plan (`plan.model.peft`) runs, as Hugging Face users run it (`torch_dtype=bfloat16`, then
peft), and as the cost model prices it (costmodel/peft.py):
1. `inject` (first in `executor.api.parallelize`, on the meta model): under bf16/fp16 the whole model
   is cast to the compute dtype, then `tracer.peft.apply_lora` injects the adapters (peft's
   `inject_adapter_in_model`: module FQNs unchanged, everything but the adapters frozen) and keeps the
   adapters in fp32 (peft's `autocast_adapter_dtype`). The run has no autocast (`executor.precision.runtime_for`): the
   base computes in its own dtype, the adapters in fp32 (peft casts their input), so the frozen weights
   hold 2 bytes per element and autocast keeps no copy of them. Pipeline split, recompute and FSDP2
   (frozen and trainable parameters in one unit; FSDP2 checks one dtype over the trainable ones only)
   then apply as to any model.
2. `init_source` (materialization): the base weights come from the seeded init or a checkpoint (a
   checkpoint of the base model names `q_proj.weight` where the adapted model has
   `q_proj.base_layer.weight`, `executor.model.CheckpointWeights` reads either); the adapters start as
   peft starts them: A Kaiming-uniform (seeded per
   FQN, as every soap parameter), B zero, so the adapted model equals its base at step 0.
3. `quantize_base` (QLoRA, after materialization, before DDP): each adapted module's base linear (but what the
   model keeps in fp32, and an MoE's stacked experts: `tracer.peft.quantized_modules`) becomes a
   bitsandbytes `Linear4bit` (NF4, double quantization, compute dtype = the run's), its weight quantized
   where it lies. bitsandbytes 0.50 quantizes and runs 4-bit matmuls on the CPU too (its CPU backend),
   so QLoRA executes and is tested on CPU; without bitsandbytes the run stops with one line.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from planner.plan import Plan
from tracer.errors import SoapError
from tracer.peft import apply_lora, quantized_modules

COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(plan: Plan) -> torch.dtype:
    return COMPUTE_DTYPES.get(plan.parallelism.precision, torch.float32)


def inject(model: nn.Module, plan: Plan) -> None:
    """Step 1 of the module docstring (a no-op without PEFT)."""
    spec = plan.model.peft_spec()
    if spec is None or getattr(model, "peft_config", None):  # none, or injected already (build_meta_model)
        return
    if spec.quantized:
        bitsandbytes_or_error()
    dtype = compute_dtype(plan)
    if dtype != torch.float32:
        model.to(dtype)
    apply_lora(model, spec)


def is_adapter(fqn: str) -> bool:
    return ".lora_A." in f".{fqn}." or ".lora_B." in f".{fqn}."


class LoraInit:
    """Parameters for materialization: adapters as peft initializes them, the rest from `source`."""

    def __init__(self, source: Any, template: nn.Module, seed: int) -> None:
        self.source, self.template, self.seed = source, template, seed

    def module_params(self, fqn: str, names: list[str]) -> dict[str, torch.Tensor]:
        from executor.model import fqn_seed

        if not is_adapter(fqn):
            return self.source.module_params(fqn, names)
        module = self.template.get_submodule(fqn)
        out = {}
        for name in names:
            tensor = torch.empty(module.get_parameter(name).shape, dtype=torch.float32)
            if ".lora_A." in f".{fqn}.":
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(fqn_seed(self.seed, fqn))
                    nn.init.kaiming_uniform_(tensor, a=math.sqrt(5))
            else:
                nn.init.zeros_(tensor)
            out[name] = tensor
        return out


def init_source(source: Any, template: nn.Module, *, seed: int) -> Any:
    """Step 2: wrap a materialization source when the template carries adapters."""
    if not any(is_adapter(fqn) for fqn, _ in template.named_modules()):
        return source
    return LoraInit(source, template, seed)


def bitsandbytes_or_error() -> Any:
    try:
        import bitsandbytes
    except ImportError:
        raise SoapError("--peft qlora needs bitsandbytes, which is not installed here; install soap[peft] "
                        "or plan --peft lora") from None
    return bitsandbytes


def quantize_base(model: nn.Module, plan: Plan) -> None:
    """Step 3 (QLoRA plans only): each adapted module's base linear as an NF4 `Linear4bit`
    (`tracer.peft.quantized_modules`: the ones the tracer prices as NF4)."""
    spec = plan.model.peft_spec()
    if spec is None or not spec.quantized:
        return
    bnb = bitsandbytes_or_error()
    dtype = compute_dtype(plan)
    for fqn in quantized_modules(model):
        module = model.get_submodule(fqn)
        base = module.base_layer
        weight = base.weight.detach()
        if type(base).__name__ == "Conv1D":  # GPT-2 keeps [in, out]
            weight = weight.t()
        out_features, in_features = weight.shape
        bias = getattr(base, "bias", None)
        quantized = bnb.nn.Linear4bit(in_features, out_features, bias=bias is not None, compute_dtype=dtype,
                                      quant_type="nf4", compress_statistics=True, device="meta")
        quantized.weight = bnb.nn.Params4bit(weight.contiguous().to(dtype), requires_grad=False, quant_type="nf4",
                                             compress_statistics=True)
        if bias is not None:
            quantized.bias = nn.Parameter(bias.detach().to(dtype), requires_grad=False)
        try:
            module.base_layer = quantized.to(weight.device)
        except (RuntimeError, NotImplementedError, AttributeError) as exc:
            raise SoapError(f"bitsandbytes {getattr(bnb, '__version__', '?')} cannot quantize 4-bit weights on "
                            f"{weight.device.type} ({str(exc).splitlines()[0]}); run --peft qlora where it can, "
                            "or plan --peft lora") from None
