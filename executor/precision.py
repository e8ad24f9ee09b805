"""Mixed precision: what each plan precision means at run time.

    fp32   nothing
    tf32   TF32 matmuls and convolutions (CUDA flags; no effect on CPU)
    bf16   FSDP: MixedPrecisionPolicy(param bf16, reduce fp32) (see executor.data_parallel);
           otherwise autocast to bf16 around the forward (each pipeline stage's, `autocast_each_forward`),
           not the loss or the backward: leaving it clears its cache of 16-bit weight copies
    fp16   autocast to fp16 and a GradScaler; with more than one rank torch's ShardedGradScaler, whose
           inf/NaN check is all-reduced over all ranks, so every rank skips the same steps (TP and
           pipeline ranks hold different gradients), checking one parameter group (one DTensor mesh, or
           the plain tensors) at a time. Under pipelining the schedule's loss function
           returns the scaled loss (`PrecisionRuntime.scaled_loss`).
    fp8    bf16 as above (FSDP's bf16 MixedPrecisionPolicy, or bf16 autocast), with torchao float8
           training Linear layers (as torchtitan runs fp8) on GPUs with compute capability >= 8.9, applied
           first, before tensor parallelism, compile and FSDP; on a GPU without fp8 a SoapError. On the CPU
           (a smoke run, or a test) torchao emulates them (`Float8LinearConfig(emulate=True)`: the same casts
           and scales, the GEMM in high precision), so every fp8 plan's layout is exercised where no fp8 GPU is.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from planner.plan import Plan
from tracer.errors import SoapError
from tracer.fp8 import fp8_linear


@dataclass
class PrecisionRuntime:
    """The autocast dtype (None: none) and the gradient scaler (None: none) of a run."""

    device_type: str = "cpu"
    autocast_dtype: torch.dtype | None = None
    scaler: Any = None

    def autocast(self) -> Any:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.autocast_dtype)

    def autocast_each_forward(self, module: Any) -> None:
        """Autocast around each forward of `module` alone (a pipeline stage's part), not around the schedule's
        step: leaving it clears autocast's cache of 16-bit weight copies after every forward, which recomputed
        blocks make again in their backward, and the loss and the backward run outside it, as they do without
        a pipeline (`executor.train.train_step`; `costmodel.memory.held_autocast_copies` holds none)."""
        if self.autocast_dtype is None:
            return
        open_: list[Any] = []

        def enter(_module: Any, _args: Any) -> None:
            context = self.autocast()
            context.__enter__()
            open_.append(context)

        def leave(_module: Any, _args: Any, _output: Any) -> None:
            open_.pop().__exit__(None, None, None)

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave)

    def scaled_loss(self, loss_fn: Any) -> Any:
        """`loss_fn` whose loss is multiplied by the scaler's scale (itself without a scaler)."""
        if self.scaler is None:
            return loss_fn

        def scaled(*args: Any) -> torch.Tensor:
            loss = loss_fn(*args)
            # a pipeline stage's shape inference runs the loss on meta tensors: the scale must not live there
            return loss if loss.device.type == "meta" else self.scaler.scale(loss)

        return scaled

    @property
    def loss_scale(self) -> float:
        """What `scaled_loss` multiplies by (1 without a scaler)."""
        return self.scaler.get_scale() if self.scaler is not None else 1.0


def runtime_for(plan: Plan, device: torch.device, *, fsdp: bool) -> PrecisionRuntime:
    p = plan.parallelism
    if p.precision in ("tf32", "bf16", "fp8"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    # a PEFT model holds its base in the compute dtype and its adapters in fp32, without autocast (executor.peft)
    autocast = plan.model.peft is None
    if p.precision in ("bf16", "fp8") and not fsdp:
        return PrecisionRuntime(device.type, torch.bfloat16 if autocast else None)
    if p.precision == "fp16":
        if fsdp or (dist.is_initialized() and dist.get_world_size() > 1):
            scaler: Any = _mesh_grouped_scaler()(device.type)
        else:
            scaler = torch.amp.GradScaler(device.type)
        # the scale is created on first use; a pipeline rank without the loss never scales anything itself
        scaler.scale(torch.zeros((), device=device))
        return PrecisionRuntime(device.type, torch.float16 if autocast else None, scaler)
    return PrecisionRuntime(device.type)


def _mesh_grouped_scaler() -> type:
    """torch's ShardedGradScaler, unscaling one optimizer parameter group at a time: its foreach inf check
    cannot mix plain tensors and DTensors (under TP without FSDP the norms' weights stay plain), and
    `executor.data_parallel.build_optimizer` groups parameters by DTensor mesh, plain ones apart. Every
    group's check writes the same `found_inf`, which the scaler then all-reduces as usual."""
    from types import SimpleNamespace

    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    class MeshGroupedGradScaler(ShardedGradScaler):
        def _unscale_grads_(self, optimizer: Any, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                            allow_fp16: bool = True) -> dict[torch.device, torch.Tensor]:
            per_device: dict[torch.device, torch.Tensor] = {}
            for group in optimizer.param_groups:
                per_device.update(super()._unscale_grads_(SimpleNamespace(param_groups=[group]), inv_scale, found_inf,
                                                          allow_fp16))
            return per_device

    return MeshGroupedGradScaler


def convert_fp8(model: nn.Module, plan: Plan) -> None:
    """Swap Linear layers for torchao's float8 training layers (fp8 plans only)."""
    if plan.parallelism.precision != "fp8":
        return
    cuda = torch.cuda.is_available()
    if cuda and torch.cuda.get_device_capability() < (8, 9):
        raise SoapError("fp8 needs a GPU with compute capability >= 8.9 (H100, L40S, ...); "
                        "re-plan with --precision bf16")
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise SoapError("fp8 training needs torchao (pip install torchao); or re-plan with --precision bf16") from None
    # the layers the cost model prices in fp8; emulated where no GPU runs them (the module docstring)
    convert_to_float8_training(model, module_filter_fn=fp8_linear, config=Float8LinearConfig(emulate=not cuda))
