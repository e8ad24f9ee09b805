"""Data parallelism (the Sample dimension) and the optimizer.

Which engine runs the plan's `zero` stage:
    zero 3      FSDP2 `fully_shard` per block (reshard_after_forward=True) and on the root (False, as
                FSDP2 defaults: the root's embedding, norm and head are needed again as soon as backward
                starts, so resharding them would only add one all-gather per step)
    zero 2      FSDP2 with reshard_after_forward=False (parameters stay gathered between forward and
                backward, ZeRO-2-like memory)
    zero 1      DDP + torch's ZeroRedundancyOptimizer (optimizer state sharded)
    zero 0      DDP
With TP (DTensor parameters), PP (DDP's reducer breaks under the pipeline's many micro-batch
backwards) or optimizer offload (only FSDP2 offloads) DDP cannot run: zero 0/1 then use FSDP2 without
resharding over the plan's (dp_replicate, dp_shard) mesh, which is pure replication when dp_shard is 1
(and a mesh of one rank when dp is 1).
FSDP shards over `dp_shard x cp` (HSDP adds `dp_replicate` as the replicate dimension); DDP reduces
over `dp x cp`. bf16 under FSDP is its MixedPrecisionPolicy (bf16 params, fp32 reductions), and
`offload_optimizer` is FSDP's CPUOffloadPolicy: parameters, gradients and optimizer state live in host
memory, each unit is copied to the device for its forward/backward, and the optimizer steps on the CPU.

FSDP is applied on the meta model (before materialization); DDP wraps the materialized model.

Expert parallelism (ep > 1, `executor.expert_parallel`): the experts modules get their own FSDP2 over
the ranks holding the same experts (`MeshView.expert_dp`), gradients summed and divided by dp*cp, before
the blocks are wrapped (zero 2/3, and zero 0/1 on FSDP2: same resharding and mixed precision as the
blocks) or beside DDP (zero 0/1: parameters kept gathered, no mixed-precision policy, DDP ignores them;
under zero 1 ZeroRedundancyOptimizer gets the other parameters and the experts an optimizer of their own,
`OptimizerPair`).

Optimizers: adamw (fused on CUDA and on the host of an offloaded optimizer, foreach on a CPU rank), adafactor
(torch.optim.Adafactor), sgd, adamw8bit (bitsandbytes, when importable). Parameters are grouped by their DTensor
mesh (plain tensors apart), because foreach kernels cannot mix tensors of different meshes.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from costmodel.strategy import runs_on_fsdp2
from executor.expert_parallel import apply_expert_fsdp, expert_parameter_names, is_expert_parameter
from executor.mesh import MeshView
from executor.tensor_parallel import all_blocks
from planner.plan import Plan
from tracer.errors import SoapError


def uses_fsdp(plan: Plan) -> bool:
    p = plan.parallelism
    return runs_on_fsdp2(dp=p.dp, cp=p.cp, tp=p.tp, pp=p.pp, zero=p.zero, offload=p.offload_optimizer)


def apply_fsdp(model: nn.Module, plan: Plan, mesh: MeshView) -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    p = plan.parallelism
    if p.zero in (0, 1):
        # without resharding (the zero-2 row of the memory model), over dp_shard x cp as it prices it
        # (`ParallelDims.shard_degree`): with cp > 1 the context ranks shard, and average, too
        dp_mesh = mesh.mesh["dp_replicate", "dp_shard"] if p.cp == 1 else mesh.hsdp
        reshard = False
    else:
        dp_mesh, reshard = mesh.hsdp, p.zero == 3
    kwargs: dict[str, Any] = {"mesh": dp_mesh}
    if p.precision in ("bf16", "fp8"):  # fp8: bf16 mixed precision around torchao's float8 Linears
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if p.offload_optimizer:
        # pinned host memory speeds up the copies to an accelerator; without one it cannot be allocated
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=mesh.mesh.device_type != "cpu")
    if p.ep > 1:
        apply_expert_fsdp(model, mesh.expert_dp, divide_factor=p.dp * p.cp, reshard=reshard,
                          **{k: v for k, v in kwargs.items() if k != "mesh"})
    for block in all_blocks(model):
        fully_shard(block, reshard_after_forward=reshard, **kwargs)
    fully_shard(model, reshard_after_forward=False, **kwargs)
    # A head Linear with a bias returns its [batch, seq, vocab] output as a view (BERT's decoder), and FSDP2
    # then warns on every forward that an in-place op on it would skip an all-gather; soap's losses read the
    # logits out of place, so the warning only hides real ones.
    root = type(model).__name__
    warnings.filterwarnings("ignore", message=rf"FSDP2-wrapped module \({root}\) returned a view tensor")


def apply_expert_ddp(model: nn.Module, plan: Plan, mesh: MeshView) -> None:
    """Under DDP, FSDP2 on the expert-parallel experts (on the meta model; module docstring)."""
    p = plan.parallelism
    if p.ep > 1:
        apply_expert_fsdp(model, mesh.expert_dp, divide_factor=p.dp * p.cp, reshard=False)


def apply_ddp(model: nn.Module, plan: Plan, mesh: MeshView) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    experts = expert_parameter_names(model)
    if experts:  # reduced over their own replicas by their FSDP (apply_expert_ddp)
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, experts)
    # the gradients are views of the reducer's buckets: one copy of them, not a .grad plus a bucket; the
    # buffers (rotary tables, position ids) are the same on every rank, so no broadcast before each forward
    # (torch 2.13's name for it: `broadcast_buffers` warns that it is deprecated)
    return DistributedDataParallel(model, process_group=mesh.dp_cp.get_group(), forward_sync_buffers=False,
                                   gradient_as_bucket_view=True)


def uses_ddp(plan: Plan) -> bool:
    p = plan.parallelism
    return p.dp * p.cp > 1 and not uses_fsdp(plan)


def build_optimizer(plan: Plan, params: list[nn.Parameter], *, lr: float, mesh: MeshView | None) -> torch.optim.Optimizer:
    """The plan's optimizer over the trainable ones of `params`. A frozen parameter (a PEFT base) is not its:
    ZeroRedundancyOptimizer would broadcast each frozen tensor from its owner every step (traffic the cost model
    does not price, for nothing), and refuses QLoRA's 4-bit (uint8) base beside the float adapters."""
    p = plan.parallelism
    params = [q for q in params if q.requires_grad] or params  # a part with nothing to train still steps
    groups = _group_by_mesh(params)
    # the fused AdamW on a GPU, and on the host an offloaded optimizer steps on: there 4x the foreach one's speed
    # (benchmarks/host_adamw.py); a CPU rank keeps the foreach one its profile's optimizer_factors measured
    fused = params[0].device.type == "cuda" or p.offload_optimizer
    if p.zero == 1 and mesh is not None and uses_ddp(plan):
        from torch.distributed.optim import ZeroRedundancyOptimizer

        cls, kwargs = _optimizer_class(p.optimizer, fused)
        dense = [q for q in params if not is_expert_parameter(q)]
        zero = ZeroRedundancyOptimizer(dense, optimizer_class=cls, process_group=mesh.dp_cp.get_group(), lr=lr,
                                       **kwargs)
        experts = [q for q in params if is_expert_parameter(q)]
        # ZeRO broadcasts each parameter from the rank that steps it: expert-parallel ones differ per rank
        return OptimizerPair(zero, cls(experts, lr=lr, **kwargs)) if experts else zero
    cls, kwargs = _optimizer_class(p.optimizer, fused)
    return cls([{"params": g} for g in groups], lr=lr, **kwargs)


class OptimizerPair:
    """ZeroRedundancyOptimizer over the non-expert parameters and an optimizer of the expert-parallel ones
    (zero 1 with ep > 1), stepped together; what the training loop and GradScaler use of an optimizer."""

    def __init__(self, zero: torch.optim.Optimizer, experts: torch.optim.Optimizer) -> None:
        self.optimizers = (zero, experts)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self) -> dict[Any, Any]:
        return {k: v for o in self.optimizers for k, v in o.state.items()}

    def step(self, closure: Any = None) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)


def _optimizer_class(name: str, fused: bool) -> tuple[type, dict[str, Any]]:
    if name == "adamw":
        return torch.optim.AdamW, ({"fused": True} if fused else {"foreach": True})
    if name == "adafactor":
        return torch.optim.Adafactor, {"foreach": True}
    if name == "sgd":
        return torch.optim.SGD, {"momentum": 0.9, "foreach": True}
    if name == "adamw8bit":
        try:
            import bitsandbytes
        except ImportError:
            raise SoapError("adamw8bit needs bitsandbytes (pip install bitsandbytes, CUDA only); "
                            "or re-plan with --optimizer adamw") from None
        return bitsandbytes.optim.AdamW8bit, {}
    raise SoapError(f"unknown optimizer {name!r}; choose adamw, adafactor, sgd or adamw8bit")


def _group_by_mesh(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    from torch.distributed.tensor import DTensor

    groups: dict[Any, list[nn.Parameter]] = {}
    for param in params:
        key = id(param.device_mesh) if isinstance(param, DTensor) else None
        groups.setdefault(key, []).append(param)
    return list(groups.values())
