"""`parallelize(model, plan)`: apply a plan to a model inside an initialized process group.

The transforms run in the fixed order of the executor (see `executor/__init__.py`):
    1. pipeline split            executor.pipeline.split_stage
    2. tensor/sequence parallel  executor.tensor_parallel.apply_tp
       expert parallel           executor.expert_parallel.apply_ep (MoE experts sharded by expert over ep)
    3. context parallel          executor.context_parallel.apply_cp
    4. activation checkpointing  apply_recompute (HF's per-layer checkpointing, non-reentrant)
    5. mixed precision           executor.precision (fp8 conversion here; autocast/GradScaler at run time)
    6. torch.compile             each block, in place (FQNs unchanged)
    7. data parallel             FSDP2 on meta, before materialization (experts first, over the ranks
                                 holding the same experts); DDP after it
A model on the meta device is materialized between 7's FSDP and DDP (`executor.model.materialize`,
seeded per FQN, or from `weights`); a model with real weights keeps them. Parameters go to the rank's device, or
to the host where FSDP offloads them (`parameter_device`); buffers always to the device.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from costmodel.memory_activations import SELECTIVE_MATMUL_PERIOD
from costmodel.plan_rules import SPLIT_BACKWARD_SCHEDULES
from costmodel.strategy import shards_vocabulary
from executor import peft
from executor import precision as precision_mod
from executor.context_parallel import apply_cp
from executor.data import cp_position_ids
from executor.data_parallel import apply_ddp, apply_expert_ddp, apply_fsdp, uses_ddp, uses_fsdp
from executor.expert_parallel import (apply_ep, check_expert_parallel, gather_sequence_around_moe, tag_expert_parameters,
                                      tp_plan_outside_moe)
from executor.mesh import MeshView, build_mesh
from executor.model import materialize, normalize_for_tp
from executor.preflight import check_world_size
from executor.pipeline import (LossParallelSchedule, TiedAcrossStages, build_schedule, set_position_ids, split_stage,
                               stages_of_rank, tied_across_stages, vocab_parallel_loss)
from executor.tensor_parallel import all_blocks, apply_tp, find_block_list
from planner.plan import Plan
from tracer.errors import SoapError


@dataclass
class ParallelModel:
    """The parallelized model on this rank."""

    parts: list[nn.Module]
    """The modules this rank runs: `[model]`, or its pipeline stages' modules."""
    plan: Plan
    mesh: MeshView
    schedule: Any = None
    """For pp > 1: the torch.distributed.pipelining schedule to `step(...)`."""
    stage_indices: list[int] = field(default_factory=list)
    precision: precision_mod.PrecisionRuntime = field(default_factory=precision_mod.PrecisionRuntime)
    tied: TiedAcrossStages | None = None
    """For pp > 1 with tied embeddings: call `sum_tied_gradients()` after each step's backward."""

    def sum_tied_gradients(self) -> None:
        """Sum the gradients of weights tied across pipeline stages (a no-op without any); a training
        loop calls it between the schedule's step and the optimizer's."""
        if self.tied is not None:
            self.tied.sum_gradients()

    @property
    def vocab_parallel(self) -> bool:
        """The token embedding, LM head and loss are vocab-parallel (tp > 1); without a pipeline the model's
        logits are then a DTensor sharded on the vocabulary."""
        p = self.plan.parallelism
        return shards_vocabulary(tp=p.tp, pp=p.pp)

    def loss_parallel(self) -> Any:
        """The context the loss and its backward run in without a pipeline: torch's `loss_parallel()` for
        vocab-sharded logits (cross-entropy without gathering them), otherwise a no-op. A pipeline's
        schedule enters it itself (`executor.pipeline.LossParallelSchedule`)."""
        if not self.vocab_parallel or self.plan.parallelism.pp > 1:
            return contextlib.nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    @property
    def model(self) -> nn.Module:
        """The model (pp == 1) or this rank's first stage module."""
        return self.parts[0]

    @property
    def has_first_stage(self) -> bool:
        return not self.stage_indices or 0 in self.stage_indices

    @property
    def has_last_stage(self) -> bool:
        p = self.plan.parallelism
        return not self.stage_indices or p.pp * p.virtual_stages - 1 in self.stage_indices

    def parameters(self) -> list[nn.Parameter]:
        seen: dict[int, nn.Parameter] = {}
        for part in self.parts:
            for param in part.parameters():
                seen.setdefault(id(param), param)
        return list(seen.values())


def parallelize(model: nn.Module, plan: Plan, *, mesh: MeshView | None = None, seed: int = 0,
                weights: str | None = None, loss_fn: Callable | None = None,
                device: torch.device | None = None) -> ParallelModel:
    """Apply `plan` to `model` on this rank (see the module docstring); returns a `ParallelModel`.

    `loss_fn(logits, labels)` is the pipeline's loss (pp > 1); by default the mean token cross-entropy.
    `seed` / `weights` fill a meta-device model; `device` defaults to cuda:LOCAL_RANK or the CPU.

    With tp > 1 the token embedding and LM head are vocab-parallel (as torchtitan and Megatron run
    them, on pipeline stages too); with pp == 1 the model's logits are a DTensor sharded on the
    vocabulary (`Shard(-1)` over the TP mesh).
    Compute the loss and run its backward inside `loss_parallel()` (`ParallelModel.loss_parallel()`
    enters it only when needed), where `F.cross_entropy` on the DTensor logits all-reduces per-token
    statistics instead of gathering the logits:

        with parallel.loss_parallel():
            logits = parallel.model(input_ids=ids).logits
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
            loss.backward()

    `logits.full_tensor()` gathers them whole where something needs every vocabulary column.
    """
    if not dist.is_initialized():
        raise SoapError("soap.parallelize needs an initialized process group; run under torchrun "
                        "(or `soap execute`) and call torch.distributed.init_process_group first")
    check_world_size(plan, dist.get_world_size())
    p = plan.parallelism
    check_expert_parallel(plan, model)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    mesh = mesh or build_mesh(plan, device.type)
    peft.inject(model, plan)
    normalize_for_tp(model)
    on_meta = next(model.parameters()).device.type == "meta"
    template = model if p.pp > 1 else copy.deepcopy(model) if on_meta else None

    stage_indices = stages_of_rank(plan, mesh.pp_rank) if p.pp > 1 else []
    parts = [split_stage(model, plan, s) for s in stage_indices] if p.pp > 1 else [model]
    for part in parts:
        _apply_intra_stage(part, plan, mesh)
    held = parameter_device(plan, device)
    for part in parts:
        if on_meta:
            materialize(part, template, held, seed=seed, weights_dir=weights)
        elif held.type != "cpu":
            part.to(held)
        _buffers_to(part, device)
    for part in parts:
        peft.quantize_base(part, plan)
    if p.ep > 1:
        for part in parts:
            tag_expert_parameters(part)
    tied = tied_across_stages(template, parts, mesh, mesh.pp_rank, p.pp) if p.pp > 1 else None
    if uses_ddp(plan):
        parts = [apply_ddp(part, plan, mesh) for part in parts]
    for part in parts:
        part.train()
    runtime = precision_mod.runtime_for(plan, device, fsdp=uses_fsdp(plan))
    result = ParallelModel(parts=parts, plan=plan, mesh=mesh, stage_indices=stage_indices, precision=runtime,
                           tied=tied)
    if p.pp > 1:
        result.schedule = _pipeline(result, device, loss_fn or _mean_loss(p.cross_entropy))
    return result


def parameter_device(plan: Plan, device: torch.device) -> torch.device:
    """Where materialization puts the parameters: the host when FSDP offloads them (its CPUOffloadPolicy keeps
    parameters, gradients and optimizer state in host memory and refuses parameters allocated on the device), else
    the device the rank computes on."""
    return torch.device("cpu") if plan.parallelism.offload_optimizer and uses_fsdp(plan) else device


def _buffers_to(part: nn.Module, device: torch.device) -> None:
    """Buffers (rotary tables, position ids) are no FSDP state: they stay on the device the forward runs on,
    also when the parameters were materialized on the host."""
    for module in part.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.device != device:
                module._buffers[name] = buffer.to(device)


def _apply_intra_stage(part: nn.Module, plan: Plan, mesh: MeshView) -> None:
    p = plan.parallelism
    # float8 Linears first, as torchtitan converts before it parallelizes: torchao's swap makes new modules,
    # which would drop the input and output hooks a TP style registered on the old ones (tests/test_fp8_execute.py)
    precision_mod.convert_fp8(part, plan)
    if p.tp > 1:
        _, blocks = find_block_list(part)
        modules = list(blocks)
        # every stage enters and leaves the sequence-parallel region itself, so HF's model-level code
        # (masks, position embeddings) always sees whole sequences
        index = getattr(part, "soap_stage_index", None)
        ends = None if index is None else (index == 0, index == p.pp * p.virtual_stages - 1)
        # under ep, MoE blocks (router, shared expert) run TP-replicated, on whole sequences under SP
        # (executor.expert_parallel; costmodel.placement.replicated_in_moe prices them so)
        apply_tp(part, mesh.tp, tp_plan_outside_moe(part, plan.tp_plan) if p.ep > 1 else plan.tp_plan,
                 sequence_parallel=p.sequence_parallel, first_block=modules[0], last_block=modules[-1],
                 vocab_parallel=shards_vocabulary(tp=p.tp, pp=p.pp), ends=ends)
        if p.ep > 1 and p.sequence_parallel:
            gather_sequence_around_moe(part, mesh.tp)
    if p.ep > 1:
        apply_ep(part, mesh.ep)
    if p.cp > 1:
        apply_cp(part, mesh.cp)
    apply_recompute(part, _recompute_policy(plan))
    if p.compile:
        compile_blocks(part, plan)
    if uses_fsdp(plan):
        apply_fsdp(part, plan, mesh)
    elif uses_ddp(plan):
        apply_expert_ddp(part, plan, mesh)


def compile_blocks(part: nn.Module, plan: Plan) -> None:
    """torch.compile each block in place. AOTAutograd donates the saved tensors a compiled backward
    consumes (frees them as it goes), which it may only do when autograd runs that backward once; the
    schedules that split the backward (`costmodel.plan_rules.SPLIT_BACKWARD_SCHEDULES`) run it twice, an
    input pass with `retain_graph=True` and a weight pass later, and a donating backward refuses the
    first ("compiled with non-empty donated buffers"). Under those schedules the blocks compile without
    donation: the saved tensors then live until the weight pass, which is what the simulator prices for
    the split backward anyway (they are held until W, compiled or not).

    A TP block under full recompute compiles inside its checkpoint (`_compile_inside_checkpoint`), not
    around it: compiling HF's checkpointed forward whole makes AOTAutograd's partitioner save the TP
    mesh (a DeviceMesh, not a tensor) for the recomputation, and the first step fails ("expected all
    tensors_saved_with_vc_check to be Tensors", torch 2.13; found by benchmarks/plans_execute.py).
    Either order recomputes the whole compiled forward in backward, which is what full recompute prices."""
    from torch._functorch import config as functorch_config
    from transformers.modeling_layers import GradientCheckpointingLayer

    p = plan.parallelism
    # read when a block first runs (compilation is lazy), so set per plan, before the step
    functorch_config.donated_buffer = not (p.pp > 1 and p.schedule in SPLIT_BACKWARD_SCHEDULES)
    for block in all_blocks(part):
        if p.tp > 1 and _recompute_policy(plan) == "full" and isinstance(block, GradientCheckpointingLayer):
            _compile_inside_checkpoint(block)
        else:
            block.compile()


def _compile_inside_checkpoint(block: nn.Module) -> None:
    """Compile `block`'s own forward and leave HF's checkpointing (`GradientCheckpointingLayer`, which
    checkpoints `partial(forward, self, **kwargs)`) around it, eager: the checkpoint then runs, and
    recomputes, the compiled forward. One compiled frame serves every block of the class (the blocks
    differ in parameters, which dynamo takes as inputs, not in code)."""
    compiled = torch.compile(type(block).forward.__wrapped__)  # the forward HF's checkpointing wrapper wraps
    checkpoint = block._gradient_checkpointing_func

    def checkpointed(forward: functools.partial, *args: Any) -> Any:
        return checkpoint(functools.partial(compiled, *forward.args, **forward.keywords), *args)

    block._gradient_checkpointing_func = checkpointed


def _recompute_policy(plan: Plan) -> str:
    # segments outside the blocks (<prologue>, <epilogue>, an encoder-decoder's <between-k>) recompute nothing
    policies = {b.recompute for b in plan.blocks if not b.id.startswith("<")}
    if len(policies) > 1:
        raise SoapError(f"blocks ask for different recompute policies {sorted(policies)}; the executor applies "
                        "one policy to the layer stack")
    return policies.pop() if policies else plan.parallelism.recompute


def apply_recompute(model: nn.Module, policy: str) -> None:
    """Activation checkpointing per block: `full` recomputes each block, `selective` caches what
    `selective_policy` says."""
    if policy == "none":
        return
    if not hasattr(model, "activation_checkpointing_enable") and not hasattr(model, "gradient_checkpointing_enable"):
        raise SoapError(f"{type(model).__name__} does not support per-layer activation checkpointing")
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if policy == "selective":
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        kwargs["context_fn"] = lambda: create_selective_checkpoint_contexts(selective_policy())
    if hasattr(model, "activation_checkpointing_enable"):  # the old name warns and goes in transformers 6
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def selective_policy() -> Callable:
    """A fresh policy for one checkpointed block (torchtitan's "op" selective checkpointing): cache the
    output of every other weight matmul, counting from the first, and of every fused attention core;
    recompute everything else in backward. Forward and recomputation count their matmuls apart, so both
    make the same choices. `costmodel.memory_activations.selective_cached` prices this rule."""
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    # weight matmuls: linear layers (mm, addmm; fp8's _scaled_mm) and MoE experts (grouped_mm, transformers' default)
    matmuls = {aten.mm.default, aten.addmm.default, aten._scaled_mm.default, aten._grouped_mm.default}
    attention = {aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
                 aten._scaled_dot_product_cudnn_attention.default,
                 aten._scaled_dot_product_flash_attention_for_cpu.default}
    counts = {False: 0, True: 0}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op in matmuls:
            counts[ctx.is_recompute] += 1
            save = counts[ctx.is_recompute] % SELECTIVE_MATMUL_PERIOD == 1
        else:
            save = op in attention
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _mean_loss(cross_entropy: str) -> Callable:
    import torch.nn.functional as F

    from executor.cross_entropy import IGNORE, chunked_cross_entropy

    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if cross_entropy == "chunked":
            return chunked_cross_entropy(logits, labels) / (labels != IGNORE).sum().clamp(min=1)
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE)

    return loss


def _pipeline(parallel: ParallelModel, device: torch.device, loss_fn: Callable) -> Any:
    from torch.distributed.pipelining import PipelineStage

    plan, mesh = parallel.plan, parallel.mesh
    p = plan.parallelism
    positions = cp_position_ids(plan.seq_len, p.cp, mesh.cp_rank, device)
    stages = []
    for part, index in zip(parallel.parts, parallel.stage_indices):
        inner = part.module if hasattr(part, "module") and isinstance(part.module, nn.Module) else part
        set_position_ids(inner, lambda x: positions)
        parallel.precision.autocast_each_forward(part)
        stages.append(PipelineStage(part, index, p.pp * p.virtual_stages, device, group=mesh.pp.get_group()))
    scaled = parallel.precision.scaled_loss
    if not parallel.vocab_parallel:
        return build_schedule(plan, stages, scaled(loss_fn))
    # the last stage returns its vocabulary shard of the logits (executor.tensor_parallel)
    if parallel.has_last_stage:
        loss_fn = vocab_parallel_loss(loss_fn, mesh.tp, parallel.parts[-1].get_output_embeddings().weight.shape[0])
    return LossParallelSchedule(build_schedule(plan, stages, scaled(loss_fn)))

