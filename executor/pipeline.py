"""Pipeline split (torchtitan style) and the torch.distributed.pipelining schedule the plan names.

Splitting. Each pipeline rank keeps a copy of the (meta) model per stage it runs and deletes what other
stages own, so parameter FQNs never change:
- a layer of another stage is dropped from the layer list (the list keeps the original indices as
  names, so `model.layers.5` stays `model.layers.5`);
- a parameter-holding module named by another stage becomes neutral: an embedding outside the first
  stage returns zeros (GPT-2 adds its position embeddings to the received hidden states), anything else
  (final norm, LM head) becomes `nn.Identity`. Dropouts named by the first stage become identities on
  the others. Other parameter-free modules (rotary embeddings) stay everywhere.
Stage modules are the HF models themselves: a pre-hook turns the stage input into `input_ids` (first
stage) or `inputs_embeds` (later stages) plus the position ids, and a hook returns `.logits` (the hidden
states on all but the last stage, whose norm and head are identities).

Schedules come from `get_schedule_class(plan.parallelism.schedule)`, with `scale_grads=False`: the loss
is already scaled so that gradients sum to the global mean (see `executor.data`). Ranks own stages
`s` with `s % pp == pp_rank` (looped), one per rank unless the plan has virtual stages.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
from torch import nn

from executor.tensor_parallel import find_block_list
from planner.plan import Plan
from tracer.errors import SoapError


class ZeroEmbedding(nn.Module):
    """Stands in for an embedding owned by another stage: adds nothing."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # broadcastable rather than ids-shaped: under sequence parallelism the hidden states it is added
        # to hold only this rank's tokens
        return torch.zeros((1,) * ids.dim() + (self.dim,), device=ids.device)


def stages_of_rank(plan: Plan, pp_rank: int) -> list[int]:
    p = plan.parallelism
    return [s for s in range(p.pp * p.virtual_stages) if s % p.pp == pp_rank]


def split_stage(model: nn.Module, plan: Plan, stage_index: int) -> nn.Module:
    """A copy of meta `model` holding only stage `stage_index`'s modules (see the module docstring)."""
    if plan.model.config.get("tie_word_embeddings", False) and plan.model.task == "causal-lm":
        raise SoapError("pipeline parallelism needs untied input/output embeddings (they live on different "
                        "stages); set tie_word_embeddings=false in the config or plan with pp=1")
    stages = sorted(plan.stages, key=lambda s: s.index)
    mine = set(stages[stage_index].modules)
    first, last = stage_index == 0, stage_index == len(stages) - 1
    module = copy.deepcopy(model)
    list_fqn, layers = find_block_list(module)
    kept: dict[str, nn.Module] = {}
    for key, layer in layers._modules.items():
        fqn = f"{list_fqn}.{key}"
        if fqn in mine:
            kept[key] = layer
        elif not any(fqn in s.modules for s in stages):
            raise SoapError(f"plan.stages assigns {fqn} to no stage; regenerate the plan")
    layers._modules = kept
    for stage in stages:
        for fqn in stage.modules:
            if fqn in mine or fqn.startswith(f"{list_fqn}."):
                continue
            try:
                target = module.get_submodule(fqn)
            except AttributeError:
                raise SoapError(f"plan.stages names {fqn}, which is not a module of this model") from None
            replacement = _neutral(target, owner_is_first=stage.index == 0)
            if replacement is not None:
                parent, _, name = fqn.rpartition(".")
                setattr(module.get_submodule(parent), name, replacement)
    _add_stage_hooks(module, first=first, last=last)
    module.soap_stage_index = stage_index
    return module


def _neutral(module: nn.Module, *, owner_is_first: bool) -> nn.Module | None:
    if isinstance(module, nn.Embedding):
        return ZeroEmbedding(module.embedding_dim)
    if isinstance(module, nn.Dropout) and owner_is_first:
        return nn.Identity()
    if any(True for _ in module.parameters()):
        return nn.Identity()
    return None


def _add_stage_hooks(module: nn.Module, *, first: bool, last: bool) -> None:
    def to_kwargs(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        x = args[0]
        key = "input_ids" if first else "inputs_embeds"
        return (), {key: x, "use_cache": False, "position_ids": mod.soap_position_ids(x)}

    module.register_forward_pre_hook(to_kwargs, with_kwargs=True)
    module.register_forward_hook(lambda mod, args, kwargs, out: out.logits, with_kwargs=True)
    module.soap_position_ids = lambda x: None


def set_position_ids(stage_module: nn.Module, fn: Callable[[torch.Tensor], Any]) -> None:
    """How the stage computes position ids from its input (global offsets under context parallelism)."""
    stage_module.soap_position_ids = fn


def build_schedule(plan: Plan, stages: list[Any], loss_fn: Callable) -> Any:
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    p = plan.parallelism
    cls = get_schedule_class(p.schedule)
    runs_per_step = p.num_microbatches // p.grad_accum
    if issubclass(cls, PipelineScheduleSingle):
        if len(stages) != 1:
            raise SoapError(f"schedule {p.schedule} runs one stage per rank; the plan has {len(stages)}")
        return cls(stages[0], n_microbatches=runs_per_step, loss_fn=loss_fn, scale_grads=False)
    return cls(stages, n_microbatches=runs_per_step, loss_fn=loss_fn, scale_grads=False)
