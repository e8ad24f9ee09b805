"""Expert parallelism (EP): each MoE layer's routed experts sharded by expert over the ep ranks, tokens
sent to the rank owning their expert and back by all-to-all.

Mesh. ep borrows ranks from dp_shard x cp (`costmodel.strategy.ParallelDims`: ep divides it), as
torchtitan's `dp_shard_in_ep`: the flattened (dp_replicate, dp_shard, cp) view is unflattened into
(edp_replicate = dp_replicate, dp_shard_mod_ep = dp_shard*cp/ep, ep), ep innermost
(`executor.mesh.build_mesh`). The ranks of one ep group hold different tokens (different samples or
sequence chunks) and, together, every expert once; the R/ep ranks of one (edp_replicate,
dp_shard_mod_ep) group, R = dp*cp, hold the same experts. TP ranks (the innermost mesh dim) each run
their own ep group over their identical tokens: the experts are not TP-sharded (as
`costmodel.placement` prices them: split Sample x dp, Parameter x ep).

Parameters. transformers 5 stores an MoE layer's experts fused, `gate_up_proj [E, 2I, H]` and
`down_proj [E, H, I]` (or `up_proj`), on one module `experts(hidden, top_k_index, top_k_weights)`
(`expert_modules` finds them). `apply_ep` makes each such parameter a DTensor `Shard(0)` over the ep
mesh (rank j holds experts [j*E/ep, (j+1)*E/ep)) and sets the module's `num_experts` to E/ep, so HF's
own experts forward (grouped_mm / batched_mm / eager) runs the local experts on local expert ids.
Materialization (`executor.model.materialize`) fills each rank's slice of the same seeded full
[E, ...] tensor a single process gets.

Dispatch and combine (`ExpertDispatch`), per MoE layer and micro-batch, on T local tokens routed to k
experts each by the model's own router (`gate`, replicated):
    1. sort the T*k (token, expert) pairs by expert id; count the pairs per global expert, `c [E]`;
    2. all-gather `c` over ep -> `C [ep, E]` (int64, ep*E*8 bytes): rank r sends sum(C[r, experts of
       j]) rows to rank j and receives sum(C[i, experts of r]) rows from rank i, ordered by local expert;
    3. all-to-all the sorted token rows (dispatch, `all_to_all_single_autograd`);
    4. run the local experts on them, top-1 with unit weights;
    5. all-to-all the outputs back (combine), undo the sort, and sum the k outputs of each token
       weighted by its routing weights (applied on the sending rank, so their gradient stays local).
Backward runs the two all-to-alls in reverse (torch's functional collectives differentiate them).
Collectives per MoE layer and micro-batch, on the ep group:
    forward   1 all-gather (the counts) + 2 all-to-alls (dispatch, combine), T*k*H*itemsize bytes each
    backward  2 all-to-alls (combine's and dispatch's reverse)
which is what `costmodel.placement.block_placements` schedules for an MoE block under ep > 1
(activation checkpointing runs the forward three again in backward). The split sizes are read back to
the host once per layer (the `.tolist()` of step 2), so a compiled block runs the dispatch eagerly.

Gradient reduction. Every rank scales its local loss by R/N (`executor.data`: N labelled tokens in the
global batch), so a non-expert gradient averaged over the R data-parallel ranks is the single-process
gradient. An expert's gradient on its owner already sums, through the all-to-all backward, the
contributions of every token its ep group routed to it: (R/N) * sum over the ep group's tokens.
Summed over the R/ep ranks holding the same experts it is (R/N) * sum over all tokens, R times the
single-process gradient; so expert gradients are *summed* over (edp_replicate, dp_shard_mod_ep) and
divided by R (torchtitan's gradient divide factor), never reduced over ep. `apply_expert_fsdp` does
that with FSDP2 on each experts module over that mesh (`set_gradient_divide_factor(R)`; HSDP when
dp_replicate > 1), before the blocks and the root are wrapped (their FSDP leaves the expert parameters
alone) or, under DDP (zero 0/1), beside it: DDP ignores the expert parameters. Non-expert parameters are
reduced exactly as without ep.

ZeRO-1 under DDP: ZeroRedundancyOptimizer, which broadcasts each parameter from the rank that steps it,
gets the non-expert parameters only; the expert parameters get the plan's optimizer of their own
(`executor.data_parallel.build_optimizer`).

Sequence parallelism (tp > 1): each MoE block gathers whole sequences on entry and keeps its sequence
shard of the output on exit (`gather_sequence_around_moe`: forward one all-gather over tp, backward one
all-gather of the output gradient), so the router, the experts and a shared expert run as under plain
TP, replicated over the TP ranks with whole gradients. With or without sequence parallelism a shared
expert is not TP-sharded under ep (`tp_plan_outside_moe`): the whole MoE block is TP-replicated, as
`costmodel.placement.replicated_in_moe` prices it (and leaves it out of the plan's tp_plan).
`costmodel.placement` prices the two all-gathers on the MoE block.

Not supported, refused with a SoapError before any work: MoE layers whose experts are not one fused
module (a ModuleList of per-expert MLPs; `expert_modules`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn

from tracer.errors import SoapError

EXPERT_MARK = "soap_expert_parallel"
"""Attribute set on an experts module sharded by `apply_ep` (its ep degree)."""
EXPERT_PARAM = "_soap_expert_parameter"
"""Attribute set on its parameters once they are final (`tag_expert_parameters`)."""


def expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The fused routed-experts modules of `model` (FQN, module): modules named `experts` whose parameters
    are all 3-D with the expert count `num_experts` first (`costmodel.placement.is_expert`'s modules)."""
    found = []
    for fqn, module in model.named_modules():
        if fqn.rpartition(".")[2] != "experts":
            continue
        params = list(module.parameters(recurse=False))
        count = getattr(module, "num_experts", None)
        if not params or not isinstance(count, int) or any(p.dim() != 3 or p.shape[0] != count for p in params):
            raise SoapError(f"{fqn} ({type(module).__name__}) is not a fused experts module with [num_experts, ...] "
                            "parameters; soap's expert parallelism shards transformers 5's fused MoE experts only")
        found.append((fqn, module))
    return found


def check_expert_parallel(plan: Any, model: nn.Module | None = None) -> None:
    """Refuse, before any work, the ep > 1 combinations the executor cannot run (module docstring), and a
    `model` (the whole one, before any pipeline split) without fused MoE experts."""
    p = plan.parallelism
    if p.ep == 1:
        return
    if model is not None and not expert_modules(model):
        raise SoapError(f"the plan has ep={p.ep} but {type(model).__name__} has no MoE experts; re-plan with --ep 1")
    if (p.dp_shard * p.cp) % p.ep:
        raise SoapError(f"ep={p.ep} must divide dp_shard*cp={p.dp_shard * p.cp} (expert parallelism borrows those "
                        "ranks); re-plan with `soap plan`")


def tp_plan_outside_moe(model: nn.Module, tp_plan: dict[str, str]) -> dict[str, str]:
    """`tp_plan` without the entries inside an MoE block (a shared expert's projections), which runs
    TP-replicated under ep (on whole sequences under sequence parallelism, `gather_sequence_around_moe`);
    plans soap writes leave them out already (`costmodel.placement.tp_plan`)."""
    from executor.tensor_parallel import find_block_list

    layers, _ = find_block_list(model)
    moe = set()
    for fqn, _ in expert_modules(model):
        parent = fqn.rpartition(".")[0]
        if parent.startswith(f"{layers}."):  # `{layers}.{i}.mlp` -> `mlp`
            moe.add(parent[len(layers) + 1:].partition(".")[2])
    prefixes = tuple(f"{m}." for m in moe if m)
    return {k: v for k, v in tp_plan.items() if not k.startswith(prefixes)}


def gather_sequence_around_moe(model: nn.Module, tp_mesh: Any) -> None:
    """Under sequence parallelism, each MoE block (the parent of `experts`) all-gathers its sequence shard
    on entry and keeps its own shard of the output on exit: the router and experts see whole sequences,
    identical on every TP rank, so their gradients need no TP reduction (module docstring). Backward: a
    local slice of the input gradient, an all-gather of the output gradient."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def gather(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        def whole(x: torch.Tensor) -> torch.Tensor:
            return DTensor.from_local(x, tp_mesh, [Shard(1)], run_check=False).redistribute(tp_mesh, [Replicate()]).to_local()

        if args:
            return (whole(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": whole(kwargs["hidden_states"])}

    def keep_shard(module: nn.Module, args: Any, output: Any) -> Any:
        hidden = output[0] if isinstance(output, tuple) else output
        local = DTensor.from_local(hidden, tp_mesh, [Replicate()], run_check=False).redistribute(tp_mesh, [Shard(1)]).to_local()
        return (local, *output[1:]) if isinstance(output, tuple) else local

    for fqn, _ in expert_modules(model):
        block = model.get_submodule(fqn.rpartition(".")[0])
        block.register_forward_pre_hook(gather, with_kwargs=True)
        block.register_forward_hook(keep_shard)


def apply_ep(model: nn.Module, ep_mesh: Any) -> list[nn.Module]:
    """Shard every experts module of `model` by expert over `ep_mesh` and route its tokens by all-to-all
    (module docstring); works on the meta device. Returns the experts modules (none for a pipeline stage
    of dense layers only)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    ep = ep_mesh.size()
    modules = [m for _, m in expert_modules(model)]
    for module in modules:
        if module.num_experts % ep:
            raise SoapError(f"ep={ep} does not divide {type(module).__name__}'s {module.num_experts} experts")
        for name, param in list(module.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        module.num_experts //= ep
        dispatch = ExpertDispatch(module, ep_mesh)
        module.forward = dispatch
        setattr(module, EXPERT_MARK, ep)
    return modules


def apply_expert_fsdp(model: nn.Module, expert_dp_mesh: Any, *, divide_factor: int, reshard: bool,
                      **fsdp_kwargs: Any) -> None:
    """FSDP2 on each expert-parallel experts module over `expert_dp_mesh` (the ranks holding the same
    experts), gradients summed and divided by `divide_factor` = dp*cp (module docstring)."""
    from torch.distributed.fsdp import fully_shard

    for module in model.modules():
        if getattr(module, EXPERT_MARK, 0):
            fully_shard(module, mesh=expert_dp_mesh, reshard_after_forward=reshard, **fsdp_kwargs)
            module.set_gradient_divide_factor(float(divide_factor))
            # gloo has no PREMUL_SUM: sum, then divide
            module.set_force_sum_reduction_for_comms(expert_dp_mesh.device_type == "cpu")


def tag_expert_parameters(model: nn.Module) -> None:
    """Mark the expert-parallel parameters `model` holds now (after FSDP and materialization), so the
    optimizer builder can tell them apart (`is_expert_parameter`)."""
    for module in model.modules():
        if getattr(module, EXPERT_MARK, 0):
            for param in module.parameters(recurse=False):
                setattr(param, EXPERT_PARAM, True)


def is_expert_parameter(param: nn.Parameter) -> bool:
    return getattr(param, EXPERT_PARAM, False)


def expert_parameter_names(model: nn.Module) -> list[str]:
    """FQNs of the expert-parallel parameters (DDP must leave them to their own reduction)."""
    names = []
    for fqn, module in model.named_modules():
        if getattr(module, EXPERT_MARK, 0):
            prefix = f"{fqn}." if fqn else ""
            names += [prefix + n for n, _ in module.named_parameters(recurse=False)]
    return names


class ExpertDispatch:
    """The forward of an expert-parallel experts module: dispatch, local experts, combine (module docstring)."""

    def __init__(self, experts: nn.Module, ep_mesh: Any) -> None:
        self.experts = experts
        self.run_local = experts.forward  # HF's experts forward, on local expert ids
        self.group = ep_mesh.get_group()
        self.ep = ep_mesh.size()
        self.rank = ep_mesh.get_local_rank()

    @torch.compiler.disable  # data-dependent split sizes: a compiled block runs the dispatch eagerly
    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                 **kwargs: Any) -> torch.Tensor:
        import torch.distributed._functional_collectives as funcol

        local, ep = self.experts.num_experts, self.ep
        tokens, top_k = top_k_index.shape
        expert_ids = top_k_index.reshape(-1)
        order = torch.argsort(expert_ids, stable=True)
        send = hidden_states[order // top_k]
        counts = torch.bincount(expert_ids, minlength=local * ep)
        table = funcol.all_gather_single(counts, 0, self.group).view(ep, ep, local)  # [source, owner, local expert]
        send_sizes = table[self.rank].sum(-1).tolist()
        received_counts = table[:, self.rank]
        recv_sizes = received_counts.sum(-1).tolist()
        received = funcol.wait_tensor(funcol.all_to_all_single_autograd(send, recv_sizes, send_sizes, self.group))
        local_ids = torch.arange(local, device=send.device).repeat(ep)
        local_ids = local_ids.repeat_interleave(received_counts.reshape(-1), output_size=sum(recv_sizes)).unsqueeze(-1)
        with _local_parameters(self.experts):
            if received.shape[0] == 0:
                # keep the empty rows in the graph, so this rank still joins the backward all-to-alls
                out = self.run_local(received.sum(0, keepdim=True), local_ids.new_zeros((1, 1)),
                                     received.new_ones((1, 1)), **kwargs)[:0]
            else:
                out = self.run_local(received, local_ids, torch.ones_like(local_ids, dtype=received.dtype), **kwargs)
        back = funcol.wait_tensor(funcol.all_to_all_single_autograd(out, send_sizes, recv_sizes, self.group))
        per_slot = back[torch.argsort(order)].view(tokens, top_k, -1)
        return (per_slot * top_k_weights.unsqueeze(-1).to(per_slot.dtype)).sum(dim=1).to(hidden_states.dtype)


@contextlib.contextmanager
def _local_parameters(module: nn.Module) -> Iterator[None]:
    """The module's DTensor parameters as their local shards for the duration (HF's experts forward indexes
    plain tensors); autograd reaches the DTensors through `to_local`."""
    from torch.distributed.tensor import DTensor

    originals = {n: p for n, p in module._parameters.items() if isinstance(p, DTensor)}
    module._parameters.update({n: p.to_local() for n, p in originals.items()})
    try:
        yield
    finally:
        module._parameters.update(originals)
