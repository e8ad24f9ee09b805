"""Which layers run in fp8 under an fp8 plan: the one rule the tracer marks and the executor applies.

soap executes fp8 as torchtitan does (`executor.precision.convert_fp8`): torchao's float8 training swaps
`nn.Linear` layers for `Float8Linear`, whose forward and two backward GEMMs run `torch._scaled_mm` on fp8
operands with dynamic tensor-wise scales. Everything else keeps the bf16 regime:
- the LM head (its logits feed the loss; torchtitan and soap leave it in bf16),
- layers whose in or out features are not multiples of 16 (`_scaled_mm` needs them; torchtitan's filter
  skips them),
- every GEMM that is not an `nn.Linear` module: GPT-2's `Conv1D` (an `addmm` on a transposed weight),
  the attention core (SDPA), a MoE expert's batched matmul, embedding lookups. The executor rewrites
  Conv1Ds as Linears for tensor parallelism (`executor.model.normalize_for_tp`), and those keep the bf16
  regime too (`soap_from_conv1d`), as torchao's swap of the HF model leaves them. Until 2026-11-26 the
  executor converted them: on a lent H200, GPT-2's eager fp8 step ran 3.4x slower than bf16 (torchao's
  eager casts, `costmodel.opcost.fp8_cast_kernels`) where soap priced the two alike.

The tracer marks each matmul op of an eligible module (`fp8_linear` in the op's attrs), so the cost model
prices fp8 exactly where the executor runs it (`costmodel.opcost.compute_peak`): a model with no
eligible layer, such as GPT-2, costs the same under fp8 as under bf16.
"""

from __future__ import annotations

from typing import Any


def fp8_linear(module: Any, fqn: str) -> bool:
    """True when an fp8 plan runs `module` (at `fqn`) as a float8 Linear."""
    import torch

    return (isinstance(module, torch.nn.Linear) and "lm_head" not in fqn
            and not getattr(module, "soap_from_conv1d", False)
            and module.in_features % 16 == 0 and module.out_features % 16 == 0)


def fp8_linear_names(model: Any) -> frozenset[str]:
    """The fully qualified names of `model`'s layers an fp8 plan runs in fp8."""
    return frozenset(name for name, module in model.named_modules() if fp8_linear(module, name))
