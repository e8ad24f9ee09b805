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

Tied embeddings (GPT-2's LM head shares the token embedding's weight): the first stage holds the
embedding, the last the head, each as its own copy, filled from the same source (`executor.model`).
After each backward the two copies' gradients are summed between the first and the last pipeline rank
of each (dp, cp, tp) coordinate (`TiedAcrossStages`, Megatron's embedding group), so both receive
the tied weight's full gradient and their optimizer steps keep them equal.

Schedules come from `get_schedule_class(plan.parallelism.schedule)`, with `scale_grads=False`: the loss
is already scaled so that gradients sum to the global mean (see `executor.data`). Ranks own stages
`s` with `s % pp == pp_rank` (looped), one per rank unless the plan has virtual stages.

Vocabulary-parallel ends (tp > 1, `executor.tensor_parallel.apply_vocab_parallel`): the last stage's LM
head returns the rank's vocabulary shard of the logits as a plain tensor; the schedule's loss
(`vocab_parallel_loss`) wraps it back into the vocab-sharded DTensor and runs the loss on it, and the
schedule steps inside torch's `loss_parallel()` (`LossParallelSchedule`), which the loss's backward,
run by the schedule, needs too. So a pipeline's loss never gathers the logits, as without one.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from costmodel.schedule import stage_to_rank
from executor.model import tied_aliases
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
    """The stages pipeline rank `pp_rank` holds: the schedule IR's layout (`costmodel.schedule.stage_to_rank`:
    looped, or V-shaped for ZBVZeroBubble), the one the simulator priced and plan.json records."""
    p = plan.parallelism
    return [s for s, rank in enumerate(stage_to_rank(p.schedule, p.pp, p.virtual_stages)) if rank == pp_rank]


def split_stage(model: nn.Module, plan: Plan, stage_index: int) -> nn.Module:
    """A copy of meta `model` holding only stage `stage_index`'s modules (see the module docstring)."""
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
    _drop_other_stages_parameters(module, mine, {fqn for s in stages for fqn in s.modules})
    _add_stage_hooks(module, first=first, last=last)
    module.soap_stage_index = stage_index
    return module


def _drop_other_stages_parameters(module: nn.Module, mine: set[str], listed: set[str]) -> None:
    """What no stage names but sits beside other stages' modules (BERT's head: `cls.predictions` holds the
    bias `cls.predictions.decoder.bias` aliases, `cls.predictions.transform` the activation between the
    named dense and LayerNorm) goes with the stage that names those modules: the other stages drop such
    parameters (they would keep an unused copy, with no gradient, that looks tied across stages) and run
    such parameter-free modules as identities (else the first stage's output would pass through the
    head's activation)."""
    def owned_elsewhere(fqn: str) -> bool:
        below = [m for m in listed if m.startswith(fqn + ".")]
        return bool(below) and not any(m in mine for m in below)

    for fqn, sub in list(module.named_modules()):
        if not fqn or any(fqn == m or fqn.startswith(m + ".") for m in listed):
            continue
        parent, _, name = fqn.rpartition(".")
        if owned_elsewhere(fqn):
            for param, _ in list(sub.named_parameters(recurse=False)):
                sub._parameters[param] = None
        elif parent and owned_elsewhere(parent) and not any(True for _ in sub.parameters()):
            setattr(module.get_submodule(parent), name, nn.Identity())


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


def vocab_parallel_loss(loss_fn: Callable, tp_mesh: Any, vocab: int) -> Callable:
    """`loss_fn` for a last stage whose output is its local vocabulary shard of `vocab` logits: the loss of
    the vocab-sharded DTensor those shards make up (Shard(-1) over `tp_mesh`, uneven when tp does not
    divide `vocab`), returned as a plain tensor (a DTensor loss is replicated: its local value is whole)."""
    from torch.distributed.tensor import DTensor, Shard

    def loss(local: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        shape = (*local.shape[:-1], vocab)
        stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
        logits = DTensor.from_local(local, tp_mesh, [Shard(-1)], run_check=False, shape=torch.Size(shape),
                                    stride=stride)
        out = loss_fn(logits, labels)
        return out.to_local() if isinstance(out, DTensor) else out

    return loss


class LossParallelSchedule:
    """A pipeline schedule whose every step runs inside torch's `loss_parallel()`, so that the last
    stage's vocab-parallel loss (`vocab_parallel_loss`) and its backward, which the schedule runs, use
    the vocab-parallel cross-entropy; everything else is the wrapped schedule's."""

    def __init__(self, schedule: Any) -> None:
        self.schedule = schedule

    def step(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            return self.schedule.step(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.schedule, name)


@dataclass(frozen=True)
class TiedAcrossStages:
    """This rank's copies of parameters tied across the first and last stage, and the group that holds
    the other copies (see the module docstring)."""

    params: list[nn.Parameter]
    """One per tied pair, ordered by the first copy's FQN (the same order on both ranks)."""
    group: Any

    def sum_gradients(self) -> None:
        from torch.distributed.tensor import DTensor

        for param in self.params:
            grad = param.grad
            # under FSDP both copies are sharded alike, so the local shards hold the same rows
            dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=self.group)


def tied_across_stages(template: nn.Module, parts: list[nn.Module], mesh: Any, pp_rank: int,
                       pp: int) -> TiedAcrossStages | None:
    """The tied pairs that the pipeline split separated (None when there are none); collective: every
    rank calls it."""
    pairs = sorted((owner, alias) for alias, owner in tied_aliases(template).items())
    if not pairs:
        return None
    held = {fqn: param for part in parts for fqn, param in part.named_parameters(remove_duplicate=False)}
    split = [(o, a) for o, a in pairs if (o in held) != (a in held) or (o in held and held[o] is not held[a])]
    ranks = mesh.mesh.mesh  # (pp, dp_replicate, dp_shard, cp, tp) global ranks
    group = None
    for first, last in zip(ranks[0].flatten().tolist(), ranks[-1].flatten().tolist()):
        created = dist.new_group([first, last])
        if dist.get_rank() in (first, last):
            group = created
    for owner, alias in split:
        expected = owner if pp_rank == 0 else alias if pp_rank == pp - 1 else None
        if expected is None or expected not in held or (owner in held and alias in held):
            raise SoapError(f"{alias} is tied to {owner}, and the pipeline split puts them on stages other than "
                            "the first and the last; untie them (tie_word_embeddings=false) or plan with pp=1")
    return TiedAcrossStages([held[o] if o in held else held[a] for o, a in split], group)
