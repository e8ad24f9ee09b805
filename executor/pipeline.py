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
the tied weight's full gradient and their optimizer steps keep them equal; where one rank holds both
stages (ZBVZeroBubble's V layout) the two copies' gradients are summed in place.

Schedules come from `get_schedule_class(plan.parallelism.schedule)`, with `scale_grads=False`: the loss
is already scaled so that gradients sum to the global mean (see `executor.data`). Ranks own the stages
`costmodel.schedule.stage_to_rank` gives them: `s % pp == pp_rank` (looped), one per rank unless the plan
has virtual stages, or the V of ZBVZeroBubble (rank r holds stages r and 2·pp-1-r).
A stage's output is never a view (`_add_stage_hooks`): the zero-bubble schedules' input-only backward
(`I` actions) frees it with `detach_()`, which a view refuses. Under those schedules ZeRO-3's blocks stay
gathered from the schedule's UNSHARD to its RESHARD (`keep_gathered_between_forward_and_weight_backward`).
`PipelineProgress` records which of the rank's schedule-IR actions finished, so the watchdog
(`executor.watchdog`) can name the receive a stuck rank waits on.

Vocabulary-parallel ends (tp > 1, `executor.tensor_parallel.apply_vocab_parallel`): the last stage's LM
head returns the rank's vocabulary shard of the logits as a plain tensor; the schedule's loss
(`vocab_parallel_loss`) wraps it back into the vocab-sharded DTensor and runs the loss on it, and the
schedule steps inside torch's `loss_parallel()` (`LossParallelSchedule`), which the loss's backward,
run by the schedule, needs too. So a pipeline's loss never gathers the logits, as without one.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
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
    """Stands in for an embedding owned by another stage: adds nothing, in the embedding's dtype (an fp32 zero
    added to a 16-bit PEFT base's hidden states made them fp32, which its bf16 linears then refused: BERT's
    token-type and position embeddings on a LoRA pipeline's second stage)."""

    def __init__(self, dim: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.dim, self.dtype = dim, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # broadcastable rather than ids-shaped: under sequence parallelism the hidden states it is added
        # to hold only this rank's tokens
        return torch.zeros((1,) * ids.dim() + (self.dim,), device=ids.device, dtype=self.dtype)


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
        return ZeroEmbedding(module.embedding_dim, module.weight.dtype)
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

    def stage_output(mod: nn.Module, args: tuple, kwargs: dict, out: Any) -> torch.Tensor:
        # HF slices the hidden states before the (here neutral) LM head, so a stage's output is a view;
        # the zero-bubble schedules' input-only backward then frees it with `detach_()`, which views refuse
        logits = out.logits
        return logits.clone() if logits._is_view() else logits

    module.register_forward_pre_hook(to_kwargs, with_kwargs=True)
    module.register_forward_hook(stage_output, with_kwargs=True)
    module.soap_position_ids = lambda x: None


def set_position_ids(stage_module: nn.Module, fn: Callable[[torch.Tensor], Any]) -> None:
    """How the stage computes position ids from its input (global offsets under context parallelism)."""
    stage_module.soap_position_ids = fn


def build_schedule(plan: Plan, stages: list[Any], loss_fn: Callable) -> Any:
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    from costmodel.schedule import build_schedule as schedule_ir

    p = plan.parallelism
    cls = get_schedule_class(p.schedule)
    runs_per_step = p.num_microbatches // p.grad_accum
    ir = schedule_ir(p.schedule, p.pp, runs_per_step, p.virtual_stages)
    if ir.splits_backward:
        keep_gathered_between_forward_and_weight_backward(stages)
    if issubclass(cls, PipelineScheduleSingle):
        if len(stages) != 1:
            raise SoapError(f"schedule {p.schedule} runs one stage per rank; the plan has {len(stages)}")
        schedule = cls(stages[0], n_microbatches=runs_per_step, loss_fn=loss_fn, scale_grads=False)
    else:
        schedule = cls(stages, n_microbatches=runs_per_step, loss_fn=loss_fn, scale_grads=False)
    schedule.soap_progress = PipelineProgress(ir.actions[ir.stage_to_rank[stages[0].stage_index]])
    for stage in stages:
        schedule.soap_progress.watch(stage)
    return schedule


class PipelineProgress:
    """Which of this rank's actions of the current schedule run (the schedule IR's, which torch runs in
    the same order) have finished, for the watchdog (`executor.watchdog`): `waiting_on()` names the
    receive or send the rank waits on, or the compute it is in; `beat` is called after each action."""

    def __init__(self, actions: tuple[Any, ...]) -> None:
        self.actions = actions
        self.done: set[tuple[int, str, int]] = set()
        self.running: tuple[int, str, int] | None = None
        self.beat: Callable[[], None] = lambda: None
        self.stages = sorted({a.stage for a in actions})

    def start_run(self) -> None:
        self.done.clear()
        self.running = None

    def watch(self, stage: Any) -> None:
        """Record `stage`'s forward and backward calls (the schedule calls them through the instance)."""
        def recorded(method: Callable, kind: Callable[[dict], str]) -> Callable:
            def run(chunk: int, *args: Any, **kwargs: Any) -> Any:
                self.running = (stage.stage_index, kind(kwargs), chunk)
                out = method(chunk, *args, **kwargs)
                self.done.add(self.running)
                self.running = None
                self.beat()
                return out
            return run

        stage.forward_one_chunk = recorded(stage.forward_one_chunk, lambda kw: "F")
        stage.backward_one_chunk = recorded(stage.backward_one_chunk,
                                            lambda kw: "B" if kw.get("full_backward", True) else "I")
        stage.backward_weight_one_chunk = recorded(stage.backward_weight_one_chunk, lambda kw: "W")

    def waiting_on(self) -> str:
        """`on RECV_F from stage 0 for micro-batch 3`, `in B of stage 1 for micro-batch 0`, ..."""
        of = (lambda s: f" of stage {s}") if len(self.stages) > 1 else (lambda s: "")
        if self.running is not None:
            s, kind, mb = self.running
            return f"in {kind} of stage {s} for micro-batch {mb}"
        pending, upcoming = [], None
        for a in self.actions:
            if not a.is_compute:
                pending.append(a)
            elif (a.stage, a.kind.value, a.microbatch) in self.done:
                pending = []
            else:
                upcoming = a
                break
        for a in sorted(pending, key=lambda a: not a.kind.value.startswith("RECV")):
            peer = a.stage - 1 if a.kind.value.endswith("_F") == a.kind.value.startswith("RECV") else a.stage + 1
            way = "from" if a.kind.value.startswith("RECV") else "to"
            return f"on {a.kind.value}{of(a.stage)} {way} stage {peer} for micro-batch {a.microbatch}"
        if upcoming is None:
            return "after the run's last action (the stages' gradient reduction)"
        return f"before {upcoming.kind.value} of stage {upcoming.stage} for micro-batch {upcoming.microbatch}"


def keep_gathered_between_forward_and_weight_backward(stages: list[Any]) -> None:
    """Stop ZeRO-3's blocks from resharding after each forward, for schedules that split the backward.

    torch runs a micro-batch's weight backward (`W`, `stage_backward_weight`: `autograd.grad` onto the
    parameters `stage.submod.parameters()` lists when it runs) after later forwards of the same stage; a
    ZeRO-3 block reshards after each of those forwards (its module then holds the sharded parameters), and
    the block's weight gradients come out missing or partial (pp=2 x dp_shard=2 llama: the layers' gradients
    differ from Interleaved1F1B's, the root module's do not). Kept gathered from the schedule's UNSHARD
    to its RESHARD, as torchtitan keeps every pipeline's FSDP blocks, they equal a single process's."""
    from torch.distributed.fsdp import FSDPModule

    for stage in stages:
        for module in stage.submod.modules():
            if isinstance(module, FSDPModule):
                module.set_reshard_after_forward(False)


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
    """One per tied pair whose other copy is on another rank, ordered by the first copy's FQN (the same
    order on both ranks)."""
    group: Any
    local_pairs: list[tuple[nn.Parameter, nn.Parameter]] = field(default_factory=list)
    """Tied pairs whose both copies this rank holds, in two of its stages (ZBVZeroBubble's V puts the
    first and the last stage on pipeline rank 0)."""

    def sum_gradients(self) -> None:
        # a frozen tied pair (a PEFT run's embedding and head) has no gradient on any rank
        for param in self.params:
            if param.requires_grad:
                dist.all_reduce(_local(param.grad), group=self.group)
        for first, last in self.local_pairs:
            if not first.requires_grad:
                continue
            total = _local(first.grad)
            total.add_(_local(last.grad))
            _local(last.grad).copy_(total)


def _local(grad: torch.Tensor) -> torch.Tensor:
    """A gradient's local tensor: under FSDP both copies of a tied pair are sharded alike, so their local
    shards hold the same rows."""
    from torch.distributed.tensor import DTensor

    return grad.to_local() if isinstance(grad, DTensor) else grad


def tied_across_stages(template: nn.Module, parts: list[nn.Module], mesh: Any, pp_rank: int,
                       pp: int) -> TiedAcrossStages | None:
    """The tied pairs that the pipeline split separated (None when there are none); collective: every
    rank calls it."""
    pairs = sorted((owner, alias) for alias, owner in tied_aliases(template).items())
    if not pairs:
        return None
    held = {fqn: param for part in parts for fqn, param in part.named_parameters(remove_duplicate=False)}
    local = [(o, a) for o, a in pairs if o in held and a in held and held[o] is not held[a]]
    split = [(o, a) for o, a in pairs if (o in held) != (a in held)]
    ranks = mesh.mesh.mesh  # (pp, dp_replicate, dp_shard, cp, tp) global ranks
    group = None
    for first, last in zip(ranks[0].flatten().tolist(), ranks[-1].flatten().tolist()):
        created = dist.new_group([first, last])
        if dist.get_rank() in (first, last):
            group = created
    for owner, alias in split:
        expected = owner if pp_rank == 0 else alias if pp_rank == pp - 1 else None
        if expected is None or expected not in held:
            raise SoapError(f"{alias} is tied to {owner}, and the pipeline split puts them on stages other than "
                            "the first and the last; untie them (tie_word_embeddings=false) or plan with pp=1")
    return TiedAcrossStages([held[o] if o in held else held[a] for o, a in split], group,
                            [(held[o], held[a]) for o, a in local])
