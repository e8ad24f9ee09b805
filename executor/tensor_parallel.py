"""Tensor and sequence parallelism: the plan's `tp_plan` applied to every block with DTensor.

`tp_plan` maps a module FQN relative to one block to a style, PyTorch's shape:
    colwise  -> ColwiseParallel      (weight Shard(0); output stays sharded on the last dim)
    rowwise  -> RowwiseParallel      (weight Shard(1); output all-reduced, or reduce-scattered to
                                      Shard(1) on the sequence with sequence parallelism)
    sequence / sequence_parallel -> SequenceParallel (norm on a sequence shard; replicated without SP)
    replicate-> nothing (the module stays replicated)
A `FusedQKV` named colwise is split as its three Linears. The blocks are the entries of the model's
layer list.

Outside the blocks (torchtitan's and Megatron's layout), `vocab_parallel=True` (tp > 1, with or without
a pipeline: `costmodel.strategy.shards_vocabulary`):
    token embedding  `shard_embedding_rows`: weight Shard(0); each rank looks up its vocabulary rows,
                     the partial sums are all-reduced in forward (as torch's RowwiseParallel embedding),
                     and backward leaves each rank the gradient of its rows only (Megatron's
                     VocabParallelEmbedding)
    LM head          ColwiseParallel(input Replicate, output Shard(-1)): weight (and bias) Shard(0); the
                     logits stay sharded on the vocabulary, and its input gradient is all-reduced in
                     backward. The whole model returns them as a DTensor (use_local_output=False); a
                     pipeline's last stage returns the rank's local vocabulary shard, a plain tensor as
                     torch.distributed.pipelining needs, and the schedule's loss wraps it back into that
                     DTensor (`executor.pipeline.vocab_parallel_loss`)
    loss             cross-entropy on those logits inside `torch.distributed.tensor.parallel.loss_parallel()`
                     (forward and backward; see `executor.train.train_step`, and for a pipeline
                     `executor.pipeline.LossParallelSchedule`, which runs each schedule step inside it):
                     all-reduces of the per-token max, sum of exponentials and target logit, never the
                     whole logits
A pipeline stage shards what it holds (`ends`): the first stage the token embedding, the last the LM head.
Tied embeddings (GPT-2, BERT) are re-tied after sharding: both styles shard the weight on dim 0, so the
embedding and the head share one DTensor parameter (BERT's `cls.predictions.bias` likewise stays the
decoder's bias); a pipeline's first and last stage each hold their own copy, sharded alike, so the
local shards that `executor.pipeline.TiedAcrossStages` sums hold the same rows. Position and
token-type embeddings and the final norm stay replicated. A vocabulary that tp does not divide is
sharded unevenly (DTensor's Shard gives the first ranks one row more).

Attention modules then get their head counts divided by tp (`num_heads`, `num_attention_heads`,
`num_key_value_heads`, `all_head_size`, `embed_dim`, `split_size`), so HF's reshapes see local heads.

More TP ranks than KV heads (GQA, tp a multiple of the KV heads: `costmodel.strategy.ParallelDims.
check_model`), as Megatron runs it: the K and V projections are replicated over the TP ranks (`Replicate`
DTensors), and TP rank r computes only KV head r // (tp / kv_heads), the one its query heads read
(`replicate_kv_heads`), so each rank holds one local KV head and `num_key_value_groups` becomes its local
query heads. Each rank's weight gradient holds its head's rows from its own query heads' attention, and
the input gradient its head's share: both are partial sums, all-reduced over TP (`to_local` with
`grad_placements=[Partial()]`), which gives exactly the unsplit model's gradients. The cost model prices
the same (`costmodel.placement.replicated_kv_projections`): whole K/V weights on every rank, one KV head of
compute and activations, and a weight-gradient all-reduce per projection and micro-batch.

Sequence parallelism (Megatron-SP). Between TP regions the activations are sharded on the sequence
(dim 1). The parent of each colwise group (the attention or MLP module) all-gathers its input to a
replicated DTensor in a forward pre-hook (backward: reduce-scatter); the rowwise projections
reduce-scatter. The first block (of the model, or of each pipeline stage) slices its replicated input
to the local sequence shard and the last block all-gathers its output, so the embeddings and final
norm see whole sequences (the vocab-parallel embedding's output is all-reduced, then sliced), the LM
head's input is replicated, and pipeline stages exchange whole sequences.
Per block and step that is 2 all-gathers + 2 reduce-scatters forward and the same backward, plus the
all-reduce of the sequence-parallel norm weights' gradients.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from executor.model import FusedQKV
from tracer.errors import SoapError

TP_STYLES = ("colwise", "rowwise", "sequence", "sequence_parallel", "replicate")
LOCAL_HEAD_ATTRS = ("num_heads", "num_attention_heads", "num_key_value_heads", "all_head_size", "embed_dim",
                    "split_size")


def layer_lists(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """The model's outermost non-empty ModuleLists, in module order: its layer stacks (`model.layers`;
    an encoder-decoder's `encoder.block` and `decoder.block`), not the lists inside a layer (T5's
    `block.0.layer`, which can be longer than the stack)."""
    lists = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    return [(fqn, m) for fqn, m in lists if not any(fqn.startswith(f"{outer}.") for outer, _ in lists if outer)]


def find_block_list(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The model's repeated layer list (`model.layers`, `transformer.h`, `bert.encoder.layer`, ...): its
    longest layer stack (`layer_lists`)."""
    stacks = layer_lists(model)
    if not stacks:
        raise SoapError(f"{type(model).__name__} has no layer list to parallelize; soap executes transformer stacks")
    return max(stacks, key=lambda item: len(item[1]))


def all_blocks(model: nn.Module) -> list[nn.Module]:
    """Every block of every layer stack (both stacks of an encoder-decoder): the units FSDP wraps and
    compile compiles."""
    return [block for _, stack in layer_lists(model) for block in stack]


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, tp_plan: dict[str, str], *, sequence_parallel: bool,
             first_block: nn.Module | None, last_block: nn.Module | None, vocab_parallel: bool = False,
             ends: tuple[bool, bool] | None = None) -> None:
    """Shard every block in `model`'s layer list as `tp_plan` says (see the module docstring).

    `first_block` / `last_block` enter and leave the sequence-parallel region (the first and last
    blocks of the model or of its pipeline stage). `vocab_parallel` also shards the token embedding and
    the LM head over the vocabulary, those of them the model holds: `ends` says whether a pipeline stage
    holds the embedding and the head (None: the whole model, both).
    """
    if not tp_plan:
        raise SoapError("the plan has tp > 1 but an empty tp_plan; regenerate it with `soap plan`")
    for fqn, style in tp_plan.items():
        if style not in TP_STYLES:
            raise SoapError(f"tp_plan[{fqn!r}] = {style!r} is not a TP style; use one of {', '.join(TP_STYLES)}")
    tp = tp_mesh.size()
    _, blocks = find_block_list(model)
    for block in blocks:
        styles = _expand_styles(block, tp_plan)
        replicated_kv = _replicated_kv_projections(block, styles, tp)
        parallelize_module(block, tp_mesh, {fqn: _style(kind, sequence_parallel) for fqn, kind in styles.items()
                                            if fqn not in replicated_kv
                                            and kind != "replicate" and (kind in ("colwise", "rowwise") or sequence_parallel)})
        for fqn, kv_heads in replicated_kv.items():
            replicate_kv_heads(block.get_submodule(fqn), tp_mesh, kv_heads)
        for parent_fqn in {fqn.rpartition(".")[0] for fqn, kind in tp_plan.items() if kind == "colwise"}:
            parent = block.get_submodule(parent_fqn)
            _divide_heads(parent, tp)
            if sequence_parallel:
                if parent is block:
                    raise SoapError("sequence parallelism needs the colwise projections inside a submodule "
                                    "(attention / MLP) of the block")
                parent.register_forward_pre_hook(_gather_sequence_hook(tp_mesh), with_kwargs=True)
    if sequence_parallel:
        if first_block is not None:
            first_block.register_forward_pre_hook(_shard_sequence_hook(tp_mesh), with_kwargs=True)
        if last_block is not None:
            last_block.register_forward_hook(_gather_output_hook(tp_mesh))
    if vocab_parallel:
        apply_vocab_parallel(model, tp_mesh, ends=ends)


def apply_vocab_parallel(model: nn.Module, tp_mesh: DeviceMesh, *, ends: tuple[bool, bool] | None = None) -> None:
    """Shard the token embedding and the LM head over the vocabulary, keeping ties (module docstring).

    `ends`: (holds the embedding, holds the head) for a pipeline stage, whose head then returns its
    local vocabulary shard as a plain tensor; None: the whole model, whose head returns a DTensor."""
    with_embedding, with_head = ends or (True, True)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if (with_embedding and not isinstance(embed, nn.Embedding)) or (with_head and not isinstance(head, nn.Linear)):
        raise SoapError(f"{type(model).__name__}: vocab-parallel TP needs an nn.Embedding input embedding and an "
                        f"nn.Linear LM head, not {type(embed).__name__} / {type(head).__name__}")
    sharded = [m for m, held in ((embed, with_embedding), (head, with_head)) if held]
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                places.setdefault(id(param), []).append((module, name))
    shared = [places[key] for key in {id(p) for m in sharded for p in m.parameters()} if len(places[key]) > 1]
    if with_embedding:
        shard_embedding_rows(embed, tp_mesh)
    if with_head:
        parallelize_module(head, tp_mesh, ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1),
                                                          use_local_output=ends is not None))
    for group in shared:
        # the first sharded copy wins: the embedding's for a tied head weight, the head's for BERT's bias alias
        keep = next(getattr(m, n) for m, n in group if isinstance(getattr(m, n), DTensor))
        for module, name in group:
            module.register_parameter(name, keep)


def shard_embedding_rows(embed: nn.Embedding, tp_mesh: DeviceMesh) -> None:
    """Megatron's vocab-parallel embedding on DTensor: the weight is Shard(0) over `tp_mesh`; forward looks
    up the rank's rows (tokens outside them give zeros) and all-reduces the partial sums, as torch's
    RowwiseParallel embedding does; backward needs no communication and gives each rank the gradient of
    its rows only. (Under RowwiseParallel, torch's sharding rule for the embedding backward computes the
    whole vocabulary's gradient on every rank and keeps it replicated: a whole [vocab, hidden] gradient
    per rank beside a sharded weight.)"""
    from torch.distributed.tensor import Partial, distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if embed.max_norm is not None or embed.scale_grad_by_freq or embed.sparse:
        raise SoapError("vocab-parallel TP shards plain embeddings; this one has max_norm, scale_grad_by_freq "
                        "or sparse gradients")
    embed.weight = nn.Parameter(distribute_tensor(embed.weight, tp_mesh, [Shard(0)], src_data_rank=0))

    def forward(ids: Any) -> Any:
        import torch.nn.functional as F

        weight = embed.weight  # FSDP2 swaps in its gathered parameter: a DTensor over the TP mesh
        local = weight.to_local()
        _, (start, _) = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, weight.placements)
        rows = local.shape[0]
        pad = embed.padding_idx
        local_ids = ids - start
        outside = (local_ids < 0) | (local_ids >= rows)
        out = F.embedding(local_ids.masked_fill(outside, 0), local,
                          padding_idx=pad - start if pad is not None and start <= pad < start + rows else None)
        partial = DTensor.from_local(out.masked_fill(outside.unsqueeze(-1), 0.0), weight.device_mesh, [Partial()],
                                     run_check=False)
        return partial.redistribute(weight.device_mesh, [Replicate()]).to_local()

    embed.forward = forward


def _expand_styles(block: nn.Module, tp_plan: dict[str, str]) -> dict[str, str]:
    styles: dict[str, str] = {}
    for fqn, kind in tp_plan.items():
        try:
            module = block.get_submodule(fqn)
        except AttributeError:
            raise SoapError(f"tp_plan names {fqn!r}, which is not a module of {type(block).__name__}; "
                            "regenerate the plan for this model") from None
        if isinstance(module, FusedQKV):
            if kind != "colwise":
                raise SoapError(f"tp_plan[{fqn!r}]: a fused q/k/v projection can only be split colwise")
            styles.update({f"{fqn}.{part}": kind for part in ("q", "k", "v")})
        else:
            styles[fqn] = kind
    return styles


def _style(kind: str, sequence_parallel: bool) -> Any:
    if kind == "colwise":
        return ColwiseParallel()
    if kind == "rowwise":
        return RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel else RowwiseParallel()
    return SequenceParallel(use_local_output=True)


def _kv_heads(attention: nn.Module) -> tuple[int, int] | None:
    """(KV heads, query heads) of an HF GQA attention module, from its config; None for other modules."""
    config = getattr(attention, "config", None)
    kv, heads = getattr(config, "num_key_value_heads", None), getattr(config, "num_attention_heads", None)
    if isinstance(kv, int) and isinstance(heads, int) and hasattr(attention, "num_key_value_groups"):
        return kv, heads
    return None


def _replicated_kv_projections(block: nn.Module, styles: dict[str, str], tp: int) -> dict[str, int]:
    """{fqn: KV heads} of the colwise K and V projections that tp > KV heads replicates (module docstring):
    the colwise Linears of a GQA attention whose width is the KV heads' (`head_dim` x KV heads)."""
    out: dict[str, int] = {}
    for fqn, kind in styles.items():
        parent_fqn = fqn.rpartition(".")[0]
        module, parent = block.get_submodule(fqn), block.get_submodule(parent_fqn)
        shape = _kv_heads(parent)
        if kind != "colwise" or shape is None or not isinstance(module, nn.Linear) or tp <= shape[0]:
            continue
        kv, _ = shape
        if tp % kv:
            raise SoapError(f"tp={tp} is not a multiple of the {kv} KV heads; pick a tp that divides or is divided by {kv}")
        if module.out_features == kv * parent.head_dim:
            out[fqn] = kv
    return out


def replicate_kv_heads(linear: nn.Linear, tp_mesh: DeviceMesh, kv_heads: int) -> None:
    """K or V projection for tp > KV heads (module docstring): weight (and bias) `Replicate` over `tp_mesh`;
    the forward computes only this rank's KV head and leaves both gradients partial, all-reduced over TP."""
    import torch.nn.functional as F
    from torch.distributed.tensor import Partial, distribute_tensor

    tp = tp_mesh.size()
    head_dim = linear.out_features // kv_heads
    head = tp_mesh.get_local_rank() // (tp // kv_heads)
    rows = slice(head * head_dim, (head + 1) * head_dim)
    linear.weight = nn.Parameter(distribute_tensor(linear.weight, tp_mesh, [Replicate()], src_data_rank=0))
    if linear.bias is not None:
        linear.bias = nn.Parameter(distribute_tensor(linear.bias, tp_mesh, [Replicate()], src_data_rank=0))

    def local(t: Any) -> Any:
        # FSDP2 swaps in its gathered parameter: still a DTensor over the TP mesh
        if not isinstance(t, DTensor):
            t = DTensor.from_local(t, tp_mesh, [Replicate()], run_check=False)
        return t.redistribute(tp_mesh, [Replicate()]).to_local(grad_placements=[Partial()])

    def forward(x: Any) -> Any:
        bias = None if linear.bias is None else local(linear.bias)[rows]
        return F.linear(local(x), local(linear.weight)[rows], bias)

    linear.forward = forward


def _divide_heads(module: nn.Module, tp: int) -> None:
    shape = _kv_heads(module)
    for attr in LOCAL_HEAD_ATTRS:
        value = getattr(module, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            if attr == "num_key_value_heads" and shape and value < tp and tp % value == 0:
                setattr(module, attr, 1)  # replicated KV heads: one per rank (module docstring)
                continue
            if value % tp:
                raise SoapError(f"tp={tp} does not divide {type(module).__name__}.{attr}={value}; pick a tp that divides it")
            setattr(module, attr, value // tp)
    if shape and tp > shape[0]:
        module.num_key_value_groups = shape[1] // tp  # local query heads over one local KV head


def _replace_hidden(args: tuple, kwargs: dict, fn: Any) -> tuple[tuple, dict]:
    if args:
        return (fn(args[0]), *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}


def _gather_sequence_hook(mesh: DeviceMesh) -> Any:
    def gather(x: Any) -> Any:
        return DTensor.from_local(x, mesh, [Shard(1)], run_check=False).redistribute(mesh, [Replicate()])

    return lambda module, args, kwargs: _replace_hidden(args, kwargs, gather)


def _shard_sequence_hook(mesh: DeviceMesh) -> Any:
    def shard(x: Any) -> Any:
        return DTensor.from_local(x, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(1)]).to_local()

    return lambda module, args, kwargs: _replace_hidden(args, kwargs, shard)


def _gather_output_hook(mesh: DeviceMesh) -> Any:
    def gather(module: nn.Module, args: Any, output: Any) -> Any:
        hidden = output[0] if isinstance(output, tuple) else output
        full = DTensor.from_local(hidden, mesh, [Shard(1)], run_check=False).redistribute(mesh, [Replicate()]).to_local()
        return (full, *output[1:]) if isinstance(output, tuple) else full

    return gather
