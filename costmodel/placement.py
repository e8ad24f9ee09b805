"""The strategy vocabulary for ops: which SOAP split a Strategy gives each op, and what it costs to move.

Split of one op (`OpSplit`): degrees of the Sample (data parallel), Attribute (sequence: SP/CP) and
Parameter (TP/EP) splits; Operator (pipeline) placement is the stage, decided elsewhere. The op's
local work is its traced work with every dimension of a split role divided by the degree
(`OpSplit.local()` is what `costmodel.opcost.op_time` takes; the sample split is carried by the
micro-batch size instead, since the micro-batch is already per data-parallel rank).

Megatron rules (`block_placements`), over a block's ops in execution order:
- a column-parallel linear (`COLWISE`: q/k/v, gate/up, fc1, c_attn, c_fc, query/key/value, wi) opens a
  TP region; it and every op until the region's row-parallel linear (`ROWWISE`: o/down, fc2, c_proj,
  attention/output dense, wo) are Parameter x tp (heads and ffn split); the rowwise linear closes it;
- ops between regions (norms, residual adds, dropout) are replicated over tp, or with sequence
  parallelism Attribute x tp (sequence shards);
- every op in a block is Attribute x cp under context parallelism (sequence split), and the
  attention core exchanges K/V;
- MoE expert ops (module path containing `experts`) are Parameter x ep (experts split; their local
  work is unchanged, see `OpSplit.local`); TP does not split experts.
Outside blocks, as `executor.tensor_parallel` runs them (`vocab_parallel_ops` names the two ops;
`costmodel.strategy.shards_vocabulary` says when: tp > 1, pipelined or not): the token embedding is
vocab-parallel (Parameter x tp), the LM head column-parallel over the vocabulary (ops on its logits
stay vocab-sharded) and the loss vocab-parallel. A pipeline's last stage hands its vocabulary shard of
the logits to the schedule's loss as a plain tensor, which wraps it back into the sharded DTensor and
runs torch's `loss_parallel` (`executor.pipeline.vocab_parallel_loss`): the same collectives and the
same 1/tp logits as without a pipeline. Position and token-type embeddings and other non-block ops
replicate (Attribute x tp with sequence parallelism).

Collectives a split implies (`Collective`, sizes in nccl-tests' convention, one micro-batch, one
rank; h = [micro_batch, seq/cp, hidden] at activation width, S = its bytes):
- TP, per region: forward all-reduce(S) after the rowwise linear and backward all-reduce(S) before the
  colwise one. With sequence parallelism: forward all-gather(S) before the colwise linear and
  reduce-scatter(S) after the rowwise one, backward the mirror pair. All-reduce(S) moves
  2(n-1)/n*S per rank, all-gather(S) + reduce-scatter(S) move (n-1)/n*S each: the same bytes.
- vocab-parallel embedding: forward all-reduce(S) of its partial lookups; LM head: backward
  all-reduce(S) of its input gradient; the vocab-parallel loss (torch's `loss_parallel`): three
  forward all-reduces of [micro_batch, seq/cp] fp32 (the max, the sum of exponentials and the target
  logit). With sequence parallelism the executor also slices the embeddings' replicated output to the
  local sequence shard at the first block (backward all-gather(S)) and gathers the last block's output
  (forward all-gather(S)); those two are priced on the token embedding and the LM head, pipelined or
  not (a pipeline's inner stage boundaries are not priced).
- CP, per attention core: forward all-gather of K and V over cp (gathered size: the whole sequence,
  the rank's KV heads, GQA heads not repeated), backward reduce-scatter of their gradients (same size).
- EP, per MoE layer: all-to-all of the routed tokens for dispatch and combine, forward and backward
  (token bytes x experts_per_token), after a forward all-gather of the per-expert token counts (int64,
  ep x experts: the split sizes of the all-to-alls; `executor.expert_parallel`); with sequence
  parallelism the MoE block also all-gathers whole sequences (forward) and its output gradient
  (backward) over tp.

Tables for an op-level search (`planner.intra_op` solves them exactly, by variable elimination or CP-SAT):
- `candidate_splits(op, dims)`: the splits an op may take on a (dp, cp, tp) mesh: replicated over tp,
  Parameter x tp (if it has a parameter-role dimension), Attribute x tp*cp (if it has an attribute
  dimension): each with Sample x dp and Attribute x cp.
- `reshard(prev, next, tensor)` / `reshard_bytes(...)`: the collective that turns the layout `prev`
  leaves a tensor in into the one `next` needs (`output_layout` / `input_layout`: replicate,
  shard(parameter), shard(attribute), partial), with its nccl-size bytes:
      same layout -> none; replicate -> shard: local slice, none; partial -> replicate: all-reduce;
      partial -> shard(attribute): reduce-scatter; shard -> replicate: all-gather;
      shard(a) -> shard(b), a != b: all-to-all.
- `chosen_placements(ops, strategy, shape)`: the ops of a block under the per-op splits a Strategy
  names (`Strategy.op_splits`, chosen by planner/'s search), with the collectives those splits imply;
  the simulator prices these instead of the Megatron rules when a strategy names splits.
- `tp_plan(ops, strategy)`: the executor's `dict[module path relative to the block, style]` in
  torch.distributed.tensor.parallel's vocabulary (colwise, rowwise, sequence_parallel).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from costmodel.opcost import cross_entropy_slices
from costmodel.strategy import ParallelDims, Strategy, shards_vocabulary
from tracer.errors import SoapError
from tracer.ir import DTYPE_BYTES, DimRole, OpKind, OpNode, TensorMeta, split_roles

COLWISE = frozenset({
    "q", "k", "v", "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "w1", "w3", "c_attn", "c_fc", "query", "key",
    "value", "wi", "wi_0", "wi_1", "fc1", "query_key_value", "dense_h_to_4h", "qkv_proj", "gate_up_proj",
})
ROWWISE = frozenset({"o", "o_proj", "down_proj", "w2", "c_proj", "wo", "fc2", "dense_4h_to_h", "out_proj"})
STYLES = ("colwise", "rowwise", "sequence_parallel", "replicate", "vocab_parallel", "expert_parallel")


def is_expert(op: OpNode) -> bool:
    """An MoE expert op (its module path holds `experts`): split by expert parallelism, not TP."""
    return "experts" in op.module_fqn.split(".")


def moe_blocks(ops: Sequence[OpNode]) -> frozenset[str]:
    """Module paths of the MoE blocks among `ops`: the modules holding an `experts` child (`...mlp`)."""
    paths = set()
    for op in ops:
        parts = op.module_fqn.split(".")
        if "experts" in parts:
            paths.add(".".join(parts[:parts.index("experts")]))
    return frozenset(paths)


def replicated_in_moe(op: OpNode, moe: frozenset[str], ep: int) -> bool:
    """A non-expert op of an MoE block (router, shared expert, their gates) under ep > 1: the block runs
    replicated over tp (on whole sequences: `executor.expert_parallel`), so the op is neither TP- nor
    sequence-sharded."""
    return ep > 1 and not is_expert(op) and any(op.module_fqn.startswith(f"{m}.") for m in moe)


def _leaf(module_fqn: str) -> str:
    return module_fqn.rsplit(".", 1)[-1]


def linear_style(op: OpNode) -> str | None:
    """colwise / rowwise for a block's TP linears (by module name), None otherwise."""
    if op.kind is not OpKind.MATMUL or not op.params:
        return None
    leaf = _leaf(op.module_fqn)
    parts = op.module_fqn.split(".")
    if leaf in COLWISE or (leaf == "dense" and len(parts) > 1 and parts[-2] == "intermediate"):
        return "colwise"
    if leaf in ROWWISE or (leaf == "dense" and len(parts) > 1 and parts[-2] == "output"):
        return "rowwise"
    if leaf == "dense":  # GPT-NeoX style attention.dense
        return "rowwise"
    return None


def replicated_kv_projections(ops: Sequence[OpNode], tp: int) -> dict[str, int]:
    """{op name: KV heads} of the K and V projections that tp > KV heads replicates over the TP ranks, as
    `executor.tensor_parallel.replicate_kv_heads` runs them: each rank holds the whole weight (memory: not
    sharded, `costmodel.memory.parameter_degrees`) and computes only its KV head (compute and output: split
    by the KV heads), and the weight's gradient is all-reduced over TP in backward. Read from the graph:
    per attention module, the head size is the attention core's query's last dimension, and a colwise
    linear of that module narrower than its widest colwise sibling (the query) is a K or V projection of
    width / head size KV heads."""
    if tp <= 1:
        return {}
    head_dims = {op.module_fqn: op.inputs[0].shape[-1] for op in ops
                 if op.kind is OpKind.ATTENTION and op.inputs and op.inputs[0].shape}
    linears: dict[str, list[OpNode]] = {}
    for op in ops:
        parent = op.module_fqn.rpartition(".")[0]
        if parent in head_dims and linear_style(op) == "colwise" and op.params and len(op.params[0].shape) == 2:
            linears.setdefault(parent, []).append(op)
    out: dict[str, int] = {}
    for parent, siblings in linears.items():
        widest = max(op.params[0].shape[0] for op in siblings)
        for op in siblings:
            width = op.params[0].shape[0]
            kv, rest = divmod(width, head_dims[parent])
            if width < widest and not rest and 0 < kv < tp and tp % kv == 0:
                out[op.name] = kv
    return out


@dataclass(frozen=True)
class OpSplit:
    sample: int = 1
    attribute: int = 1
    parameter: int = 1
    style: str | None = None
    """TP style of the op's module (colwise/rowwise/sequence_parallel/vocab_parallel), if any."""

    def soap(self) -> dict[str, int]:
        """Degrees > 1 only, in SOAP order: what plan.json shows."""
        return {k: v for k, v in (("sample", self.sample), ("attribute", self.attribute), ("parameter", self.parameter)) if v > 1}

    def local(self) -> dict[str, int]:
        """The split `op_time` and `activation_bytes` take (the sample split is in the micro-batch).

        Expert parallelism leaves an expert op's local work unchanged: each rank holds 1/ep of the
        experts but receives the tokens routed to them from all ep ranks (balanced routing)."""
        parameter = 1 if self.style == "expert_parallel" else self.parameter
        return {k: v for k, v in (("attribute", self.attribute), ("parameter", parameter)) if v > 1}

    def describe(self) -> str:
        parts = [f"{k.capitalize()} x{v}" for k, v in self.soap().items()]
        return ", ".join(parts) if parts else "replicated"


@dataclass(frozen=True)
class Collective:
    kind: str
    """all_reduce, all_gather, reduce_scatter, all_to_all."""
    nbytes: float
    """nccl-tests size for one micro-batch on one rank."""
    group: str
    """Mesh group: tp, cp or ep."""
    phase: str
    """fwd or bwd."""
    reason: str


@dataclass(frozen=True)
class OpPlacement:
    op: OpNode
    split: OpSplit
    collectives: tuple[Collective, ...] = ()


@dataclass(frozen=True, kw_only=True)
class ActivationShape:
    """What collective sizes are computed from (one micro-batch on one rank)."""

    micro_batch: int
    seq_len: int
    hidden: int
    itemsize: int
    kv_heads: int = 0
    head_dim: int = 0
    experts_per_token: int = 0

    def hidden_bytes(self, cp: int) -> float:
        return self.micro_batch * self.seq_len / cp * self.hidden * self.itemsize

    def kv_bytes(self, tp: int) -> float:
        """K and V over the whole sequence for this rank's KV heads (GQA heads are not repeated)."""
        local_heads = self.kv_heads / min(tp, self.kv_heads) if self.kv_heads else 0
        return 2 * self.micro_batch * self.seq_len * local_heads * self.head_dim * self.itemsize


def _has(op: OpNode, role: DimRole) -> bool:
    """Whether a tensor of `op` has a `role` dim (a flattened token dim has both sample and attribute)."""
    return any(role in split_roles(t.roles) for t in (*op.inputs, *op.outputs))


def block_placements(ops: Sequence[OpNode], strategy: Strategy, shape: ActivationShape) -> tuple[OpPlacement, ...]:
    """Every op of one block instance (or the non-block ops) with its split and collectives."""
    d, sp = strategy.dims, strategy.train.sequence_parallel and strategy.dims.tp > 1
    dp, cp, tp = d.dp, d.cp, d.tp
    s_bytes = shape.hidden_bytes(cp)
    tp_kinds = ("all_gather", "reduce_scatter") if sp else ("all_reduce", "all_reduce")
    out: list[OpPlacement] = []
    inside = after_head = False
    vocab = vocab_parallel_ops(ops) if tp > 1 else (None, None)
    moe = moe_blocks(ops) if d.ep > 1 else frozenset()
    replicated_kv = replicated_kv_projections(ops, tp)
    for op in ops:
        style = linear_style(op) if op.block_id is not None else None
        colls: list[Collective] = []
        if op.block_id is None:
            placed = _outside_placement(op, d, sp, s_bytes, shape, after_head, vocab, strategy.train.cross_entropy)
            after_head = after_head or placed.split.style == "colwise"
            out.append(placed)
            continue
        if is_expert(op) and d.ep > 1:
            split = OpSplit(dp, cp, d.ep, "expert_parallel")
        elif replicated_in_moe(op, moe, d.ep):
            split = OpSplit(dp, cp, 1, None)
        elif style == "colwise" and tp > 1:
            kv_heads = replicated_kv.get(op.name)
            if not inside:
                colls.append(Collective(tp_kinds[0], s_bytes, "tp", "fwd", "enter TP region") if sp else
                             Collective("all_reduce", s_bytes, "tp", "bwd", "input gradient of the TP region"))
                if sp:
                    colls.append(Collective("reduce_scatter", s_bytes, "tp", "bwd", "input gradient of the TP region"))
            inside = True
            split = OpSplit(dp, cp, kv_heads or tp, "colwise")
            if kv_heads:
                grad = sum(p.numel * DTYPE_BYTES.get(p.dtype, 4) for p in op.params)
                colls.append(Collective("all_reduce", grad, "tp", "bwd", "gradient of the TP-replicated K/V weight"))
        elif style == "rowwise" and tp > 1:
            inside = False
            split = OpSplit(dp, cp, tp, "rowwise")
            colls.append(Collective(tp_kinds[1], s_bytes, "tp", "fwd", "leave TP region"))
            if sp:
                colls.append(Collective("all_gather", s_bytes, "tp", "bwd", "gradient entering the TP region"))
        elif inside:
            split = OpSplit(dp, cp, tp if _has(op, DimRole.PARAMETER) else 1, None)
        elif sp and _has(op, DimRole.ATTRIBUTE):
            split = OpSplit(dp, cp * tp, 1, "sequence_parallel")
        else:
            split = OpSplit(dp, cp, 1, None)
        if op.kind is OpKind.ATTENTION and cp > 1:
            kv = shape.kv_bytes(tp)
            colls.append(Collective("all_gather", kv, "cp", "fwd", "gather K/V over the sequence"))
            colls.append(Collective("reduce_scatter", kv, "cp", "bwd", "scatter K/V gradients"))
        out.append(OpPlacement(op, split, tuple(colls)))
    if d.ep > 1 and any(is_expert(p.op) for p in out):
        a2a = s_bytes * max(1, shape.experts_per_token)
        counts_bytes = d.ep * moe_expert_count(ops, d.ep) * 8  # int64 tokens per expert, from every ep rank
        counts = Collective("all_gather", counts_bytes, "ep", "fwd", "MoE token counts per expert")
        moe = (Collective("all_to_all", a2a, "ep", ph, f"MoE {what}") for ph in ("fwd", "bwd") for what in ("dispatch", "combine"))
        # under sequence parallelism the MoE block runs on whole sequences: it gathers them, and its output
        # gradient is gathered back (the forward keeps a local slice)
        whole = (Collective("all_gather", s_bytes, "tp", ph, f"MoE block {what}") for ph, what in
                 (("fwd", "gathers whole sequences"), ("bwd", "output gradient gathered"))) if sp else ()
        out[-1] = OpPlacement(out[-1].op, out[-1].split, (*out[-1].collectives, *whole, counts, *moe))
    return tuple(out)


def moe_expert_count(ops: Sequence[OpNode], ep: int) -> int:
    """Routed experts of an MoE block: the leading dim of its fused 3-D expert weights (at least `ep`)."""
    return max((p.shape[0] for op in ops if is_expert(op) for p in op.params if len(p.shape) == 3), default=ep)


def vocab_parallel_ops(ops: Sequence[OpNode]) -> tuple[str | None, str | None]:
    """(token embedding, LM head): the names of the ops among `ops` that tensor parallelism shards over
    the vocabulary when the whole model is on the rank, None where `ops` hold none.

    The token embedding is the first parameterized embedding outside the blocks and before them whose
    output has sample and sequence dimensions (a lookup of token ids; position and token-type tables
    are not); the LM head is the last parameterized matmul outside the blocks that comes after them
    (or, in ops without blocks, after no embedding: an epilogue on its own), so a head's transform
    (BERT's `cls.predictions.transform.dense`) replicates."""
    embedding = head = None
    seen_block = seen_embedding = False
    for op in ops:
        if op.block_id is not None:
            seen_block = True
        elif op.params and op.kind is OpKind.EMBEDDING:
            roles = set(op.outputs[0].roles) if op.outputs else set()
            if embedding is None and not seen_block and {DimRole.SAMPLE, DimRole.ATTRIBUTE} <= roles:
                embedding = op.name
            seen_embedding = True
        elif op.params and op.kind is OpKind.MATMUL and (seen_block or not seen_embedding):
            head = op.name
    return embedding, head


def vocab_parallel_loss_collectives(op: OpNode, shape: ActivationShape, *, cp: int, tp: int,
                                    cross_entropy: str) -> tuple[Collective, ...]:
    """The all-reduces of a vocab-parallel loss over [tokens] fp32 statistics: torch's `loss_parallel` (and
    Megatron's) one each of the max, the sum of exponentials and the target logit; the chunked loss
    (`executor.cross_entropy`) the max and the sum per slice of tokens (`costmodel.opcost.cross_entropy_slices`
    of the rank's fp32 logits) and the target logit once."""
    tokens = shape.micro_batch * shape.seq_len / cp
    slices = 1
    if cross_entropy == "chunked":
        vocab = op.inputs[0].shape[-1] if op.inputs else 1
        slices = cross_entropy_slices(tokens * -(-vocab // tp) * 4, int(tokens))
    per_slice = tuple(Collective("all_reduce", tokens * 4 / slices, "tp", "fwd", f"vocab-parallel loss {w}")
                      for _ in range(slices) for w in ("max", "sum of exponentials"))
    return per_slice + (Collective("all_reduce", tokens * 4, "tp", "fwd", "vocab-parallel loss target logit"),)


def _outside_placement(
    op: OpNode, d: ParallelDims, sp: bool, s_bytes: float, shape: ActivationShape, after_head: bool,
    vocab: tuple[str | None, str | None], cross_entropy: str = "chunked",
) -> OpPlacement:
    dp, cp, tp = d.dp, d.cp, d.tp
    if tp == 1:
        return OpPlacement(op, OpSplit(dp, cp, 1, None))
    sharded = shards_vocabulary(tp=tp, pp=d.pp)
    embedding, head = vocab
    if after_head and op.kind is not OpKind.LOSS and _has(op, DimRole.PARAMETER):  # vocab-sharded logits
        return OpPlacement(op, OpSplit(dp, cp, tp, None))
    if op.name == embedding:
        colls = [Collective("all_reduce", s_bytes, "tp", "fwd", "vocab-parallel embedding")] if sharded else []
        if sp:
            colls.append(Collective("all_gather", s_bytes, "tp", "bwd", "sequence slice entering the first block"))
        return OpPlacement(op, OpSplit(dp, cp, tp, "vocab_parallel") if sharded else OpSplit(dp, cp, 1, None),
                           tuple(colls))
    if op.name == head:  # column-parallel over the vocabulary
        colls = [Collective("all_gather", s_bytes, "tp", "fwd", "sequence gather leaving the last block")] if sp else []
        if sharded:
            colls.append(Collective("all_reduce", s_bytes, "tp", "bwd", "LM head input gradient"))
        return OpPlacement(op, OpSplit(dp, cp, tp, "colwise") if sharded else OpSplit(dp, cp, 1, None), tuple(colls))
    if op.kind is OpKind.LOSS and after_head:
        return OpPlacement(op, OpSplit(dp, cp, tp, "vocab_parallel"),
                           vocab_parallel_loss_collectives(op, shape, cp=cp, tp=tp, cross_entropy=cross_entropy))
    if sp and _has(op, DimRole.ATTRIBUTE) and _has(op, DimRole.SAMPLE):
        return OpPlacement(op, OpSplit(dp, cp * tp, 1, "sequence_parallel"))
    return OpPlacement(op, OpSplit(dp, cp, 1, None))


# --- tables for an op-level search ----------------------------------------------------------------


def candidate_splits(op: OpNode, dims: ParallelDims) -> tuple[OpSplit, ...]:
    """The splits `op` may take on the (dp, cp, tp) mesh of `dims` (see the module docstring)."""
    dp, cp, tp = dims.dp, dims.cp, dims.tp
    out = [OpSplit(dp, cp, 1, "replicate")]
    if tp > 1 and _has(op, DimRole.PARAMETER):
        out.append(OpSplit(dp, cp, tp, linear_style(op) or "shard"))
    if tp > 1 and _has(op, DimRole.ATTRIBUTE):
        out.append(OpSplit(dp, cp * tp, 1, "sequence_parallel"))
    return tuple(out)


def output_layout(split: OpSplit, cp: int = 1) -> str:
    """How an op under `split` leaves its output over the tp group."""
    if split.style == "rowwise":
        return "partial"
    if split.parameter > 1:
        return "shard(parameter)"
    if split.attribute > cp:
        return "shard(attribute)"
    return "replicate"


def input_layout(split: OpSplit, cp: int = 1) -> str:
    """The layout an op under `split` needs its activation input in, over the tp group."""
    if split.style == "colwise":
        return "replicate"
    if split.parameter > 1:
        return "shard(parameter)"
    if split.attribute > cp:
        return "shard(attribute)"
    return "replicate"


@dataclass(frozen=True)
class Reshard:
    kind: str | None
    """The collective, or None when no data moves."""
    nbytes: float


def reshard(prev: OpSplit, nxt: OpSplit, tensor: TensorMeta, *, cp: int = 1) -> Reshard:
    """The collective between `prev`'s output and `nxt`'s input for `tensor` (traced, whole batch).

    Bytes are the full tensor divided by the sample and cp splits (nccl size: all-gather's output,
    reduce-scatter's input)."""
    src, dst = output_layout(prev, cp), input_layout(nxt, cp)
    size = tensor.nbytes / max(1, prev.sample) / cp
    if src == dst or src == "replicate":
        return Reshard(None, 0.0)
    if src == "partial":
        return Reshard("reduce_scatter" if dst == "shard(attribute)" else "all_reduce", size)
    if dst == "replicate":
        return Reshard("all_gather", size)
    return Reshard("all_to_all", size)


def reshard_bytes(prev: OpSplit, nxt: OpSplit, tensor: TensorMeta, *, cp: int = 1) -> float:
    return reshard(prev, nxt, tensor, cp=cp).nbytes


def tp_plan(ops: Sequence[OpNode], strategy: Strategy) -> dict[str, str]:
    """torch TP plan for one block: module path relative to the block instance -> style."""
    if strategy.dims.tp == 1:
        return {}
    sp = strategy.train.sequence_parallel
    moe = moe_blocks(ops)
    plan: dict[str, str] = {}
    for op in ops:
        if op.block_id is None or replicated_in_moe(op, moe, strategy.dims.ep):
            continue
        rel = _relative(op.module_fqn, op.block_id)
        style = linear_style(op)
        if style and rel:
            plan[rel] = style
        elif sp and rel and ("norm" in _leaf(rel) or _leaf(rel).startswith("ln")):
            plan[rel] = "sequence_parallel"
    return plan


def block_container(block_id: str) -> str:
    """The module list a block id names: `encoder.block#1` (the second layer type of a stack) ->
    `encoder.block`."""
    return block_id.split("#", 1)[0]


def _relative(module_fqn: str, block_id: str) -> str:
    """`model.layers.0.self_attn.q_proj` -> `self_attn.q_proj` for block `model.layers`."""
    prefix = block_container(block_id) + "."
    if not module_fqn.startswith(prefix):
        return ""
    rest = module_fqn[len(prefix):]
    return rest.split(".", 1)[1] if "." in rest else ""


# --- explicit per-op splits (Strategy.op_splits) ----------------------------------------------------

MIRROR = {"all_reduce": "all_reduce", "all_gather": "reduce_scatter", "reduce_scatter": "all_gather",
          "all_to_all": "all_to_all"}
"""The backward collective of each forward resharding (an all-reduce of a partial sum is mirrored by the
all-reduce of the gradient entering the region, as Megatron's f/g pair)."""


def dataflow_edges(ops: Sequence[OpNode]) -> tuple[tuple[int, int], ...]:
    """(producer, consumer) index pairs among one block's `ops`. The IR keeps no dataflow edges, so an
    input of op i is taken to come from the latest earlier op whose first output has the same shape and
    roles, except that a linear does not read another linear's output directly (q, k and v read the
    norm's output, not each other's, even when their shapes agree). An input no earlier op produced
    comes from the previous repeat of the block: the block's last producer of that shape and roles
    (the residual stream), so the layout a block leaves its output in is the one the next repeat reads;
    inputs nothing in the block produces (constants, position tables) have no edge."""
    latest: dict[tuple, int] = {}
    latest_non_linear: dict[tuple, int] = {}
    edges: set[tuple[int, int]] = set()
    unresolved: list[tuple[int, tuple, bool]] = []
    for i, op in enumerate(ops):
        linear = _is_linear(op)
        source = latest_non_linear if linear else latest
        for t in op.inputs:
            key = (t.shape, t.roles)
            if key in source:
                edges.add((source[key], i))
            else:
                unresolved.append((i, key, linear))
        if op.outputs:
            key = (op.outputs[0].shape, op.outputs[0].roles)
            latest[key] = i
            if not linear:
                latest_non_linear[key] = i
    for i, key, linear in unresolved:
        j = (latest_non_linear if linear else latest).get(key)
        if j is not None and j != i:
            edges.add((j, i))
    return tuple(sorted(edges))


def _is_linear(op: OpNode) -> bool:
    return op.kind is OpKind.MATMUL and bool(op.params)


def split_with_degrees(op: OpNode, dims: ParallelDims, degrees: Mapping[str, int]) -> OpSplit:
    """The candidate split of `op` whose attribute and parameter degrees are `degrees` (the form
    `Strategy.op_splits` keeps; the sample degree always follows the mesh's dp)."""
    wanted = {k: v for k, v in degrees.items() if v > 1 and k != "sample"}
    for split in candidate_splits(op, dims):
        if {k: v for k, v in split.soap().items() if k != "sample"} == wanted:
            return split
    raise SoapError(f"op {op.name} cannot take the split {wanted} on this mesh; "
                    f"its candidates are {', '.join(s.describe() for s in candidate_splits(op, dims))}")


def chosen_placements(
    ops: Sequence[OpNode], strategy: Strategy, shape: ActivationShape, *, batch_traced: int,
) -> tuple[OpPlacement, ...]:
    """Every op of one block with the split `strategy.op_splits` names (the Megatron default for ops it
    does not name) and the collectives the chosen splits imply, per micro-batch on one rank:
    - an attention core whose sequence is split over tp gathers K and V over tp (forward all-gather,
      backward reduce-scatter), and under cp the K/V exchange over cp as in the default placement;
    - along each dataflow edge (`dataflow_edges`), the resharding collective from the producer's output
      layout to the consumer's input layout (`reshard`), forward, and its mirror (`MIRROR`) in
      backward; once per producer and layout (q, k and v share one all-gather of the norm's output).
    This is the objective `planner.block_splits` hands the per-op split search, so the search and the
    simulator agree on what a choice costs."""
    d = strategy.dims
    named = dict(strategy.op_splits)
    default = {p.op.name: p.split for p in block_placements(ops, strategy, shape)}
    splits = [split_with_degrees(op, d, dict(named[op.name])) if op.name in named else default[op.name] for op in ops]
    scale = shape.micro_batch / batch_traced
    colls = [list(split_collectives(op, split, d, shape, scale=scale)) for op, split in zip(ops, splits)]
    resharded: set[tuple[int, str]] = set()
    for j, i in dataflow_edges(ops):
        once = (j, input_layout(splits[i], d.cp))
        if once not in resharded:
            resharded.add(once)
            colls[i].extend(edge_collectives(ops[j], splits[j], ops[i], splits[i], cp=d.cp, scale=scale,
                                             itemsize=shape.itemsize))
    return tuple(OpPlacement(op, split, tuple(c)) for op, split, c in zip(ops, splits, colls))


def split_collectives(op: OpNode, split: OpSplit, dims: ParallelDims, shape: ActivationShape, *,
                      scale: float) -> tuple[Collective, ...]:
    """The collectives `op` needs under `split` by itself (see `chosen_placements`)."""
    if op.kind is not OpKind.ATTENTION:
        return ()
    colls = []
    if split.attribute > dims.cp and split.parameter == 1 and len(op.inputs) >= 3:
        kv = sum(t.numel for t in op.inputs[1:3]) * shape.itemsize * scale / dims.cp
        colls += [Collective("all_gather", kv, "tp", "fwd", "gather K/V over the tp-sharded sequence"),
                  Collective("reduce_scatter", kv, "tp", "bwd", "scatter K/V gradients over tp")]
    if dims.cp > 1:
        kv = shape.kv_bytes(split.parameter)
        colls += [Collective("all_gather", kv, "cp", "fwd", "gather K/V over the sequence"),
                  Collective("reduce_scatter", kv, "cp", "bwd", "scatter K/V gradients")]
    return tuple(colls)


def edge_collectives(prev_op: OpNode, prev: OpSplit, op: OpNode, split: OpSplit, *, cp: int, scale: float,
                     itemsize: int) -> tuple[Collective, ...]:
    """The resharding from `prev_op`'s output under `prev` to `op` under `split`, forward and backward."""
    kind = reshard(prev, split, prev_op.outputs[0], cp=cp).kind
    if kind is None:
        return ()
    nbytes = prev_op.outputs[0].numel * itemsize * scale / cp
    why = f"{output_layout(prev, cp)} -> {input_layout(split, cp)}"
    return (Collective(kind, nbytes, "tp", "fwd", f"reshard {why}"),
            Collective(MIRROR[kind], nbytes, "tp", "bwd", f"reshard {why} (gradient)"))
