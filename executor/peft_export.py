"""Give back a PEFT run: the adapter as peft saves it, the base it adapts, and on request the merged model.

`write_peft_directory(directory, tensors, plan, merge=...)` takes {soap FQN: full tensor} of the trained
PEFT model (`executor.hf_export.save_hf` gathers them; QLoRA's 4-bit base weights dequantized to the
run's dtype first, `dequantized_base`) and writes:
- `directory/adapter_config.json` + `adapter_model.safetensors`: peft's files (`LoraConfig.save_pretrained`;
  keys `base_model.model.<FQN>.lora_A.weight`, the adapter name left out, as `PeftModel.save_pretrained`
  writes them), `base_model_name_or_path` pointing at `directory/base`, so
  `PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(directory/base), directory)` (or
  `AutoPeftModelForCausalLM.from_pretrained(directory)`) rebuilds the trained model;
- `directory/base/`: the frozen base model as an HF directory (`executor.hf_export.write_model`), the
  `base_layer` segment peft inserts removed from its keys and soap's normalization undone as for any model;
- with `merge`, `directory/merged/`: the base with each adapter folded in, W + (alpha / r) B A (transposed
  for GPT-2's Conv1D, which keeps [in, out]), a plain transformers model.
The adapters were injected before soap normalized the model (`executor.model.build_meta_model`), so their
shapes are HF's (GPT-2's fused c_attn has one adapter) and need no transform.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from executor.peft import is_adapter

ADAPTER_NAME = "default"
TASK_TYPES = {"causal-lm": "CAUSAL_LM", "seq2seq-lm": "SEQ_2_SEQ_LM"}


def dequantized_base(state: dict[str, torch.Tensor], parts: list[nn.Module]) -> dict[str, torch.Tensor]:
    """`state` with each bitsandbytes 4-bit weight replaced by its dequantized full tensor."""
    from executor.hf_export import model_fqn

    out = dict(state)
    for part in parts:
        for fqn, module in part.named_modules():
            weight = getattr(module, "weight", None)
            if getattr(weight, "quant_state", None) is None:
                continue
            import bitsandbytes.functional as bnbf

            full = bnbf.dequantize_4bit(weight.data, weight.quant_state)
            out[model_fqn(f"{fqn}.weight")] = full.to(weight.quant_state.dtype).cpu().clone()
    return out


def _plain(fqn: str) -> str:
    return fqn.replace(".base_layer", "")


def write_peft_directory(directory: str | Path, tensors: dict[str, torch.Tensor], plan: Any, *,
                         merge: bool = False) -> Path:
    from safetensors.torch import save_file

    import tracer
    from executor.hf_export import hf_state_dict, write_model
    from executor.model import build_meta_model
    from tracer.peft import lora_config

    spec = plan.model.peft_spec()
    template = build_meta_model(plan.model.config, plan.model.task, plan=plan)
    hf_model = tracer.build_model(tracer.resolve_spec(template.config, task=plan.model.task), device="meta")
    renames = {_plain(fqn): (_plain(key), transform)
               for fqn, (key, transform) in getattr(template, "soap_checkpoint_keys", {}).items()}
    base = hf_state_dict({_plain(fqn): t for fqn, t in tensors.items() if not is_adapter(fqn)},
                         SimpleNamespace(soap_checkpoint_keys=renames), hf_model)
    root = Path(directory)
    write_model(root / "base", base, template.config, hf_model)
    adapters = {fqn: t for fqn, t in tensors.items() if is_adapter(fqn)}
    saved = {"base_model.model." + fqn.replace(f".{ADAPTER_NAME}.", "."): t.contiguous() for fqn, t in adapters.items()}
    save_file(saved, str(root / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = lora_config(spec)
    config.base_model_name_or_path = str((root / "base").resolve())
    config.task_type = TASK_TYPES.get(plan.model.task)
    config.save_pretrained(str(root))
    if merge:
        write_model(root / "merged", merged_state(base, adapters, hf_model, spec.alpha / spec.rank), template.config,
                    hf_model)
    return root


def merged_state(base: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], hf_model: nn.Module,
                 scaling: float) -> dict[str, torch.Tensor]:
    """The base with every adapter folded into its weight (module docstring)."""
    out = dict(base)
    for fqn, a in adapters.items():
        if f".lora_A.{ADAPTER_NAME}." not in fqn:
            continue
        module = fqn.split(f".lora_A.{ADAPTER_NAME}.")[0]
        b = adapters[f"{module}.lora_B.{ADAPTER_NAME}.weight"]
        delta = (b.float() @ a.float()) * scaling
        key = f"{module}.weight"
        if type(hf_model.get_submodule(module)).__name__ == "Conv1D":
            delta = delta.t()
        out[key] = (out[key].float() + delta).to(out[key].dtype)
    return out
