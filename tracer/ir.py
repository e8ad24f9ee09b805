"""The operator graph: soap's intermediate representation of one training step's forward pass.

This module imports no torch, so the cost model, planner and tests can use it on any machine.

An `OpGraph` is compact: a model's repeated layers (decoder layers, encoder layers) appear once, as
the ops of one representative instance tagged with their `block_id`, and `Block.count` says how many
times the instance repeats in the full model. Everything outside blocks (embeddings, final norm, LM
head, loss) appears once with `block_id=None`. The ops are in execution order, so the model is the
sequence of *segments* returned by `OpGraph.segments()`: runs of non-block ops, and blocks repeated
`count` times.

Shapes are those of the traced batch (`OpGraph.batch` samples of `OpGraph.seq_len` tokens). Every
tensor dimension carries a `DimRole` so that the cost model can compute local shapes under a split:
- SAMPLE: the batch dimension (split by data parallelism);
- ATTRIBUTE: a non-batch activation dimension such as the sequence (split by sequence/context
  parallelism);
- PARAMETER: a dimension tied to a parameter's size, such as hidden features or heads (split by tensor
  parallelism);
- NONE: not splittable (a reduced or size-1 dimension).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import Enum

DTYPE_BYTES: Mapping[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "complex64": 8,
}


class DimRole(str, Enum):
    SAMPLE = "sample"
    ATTRIBUTE = "attribute"
    PARAMETER = "parameter"
    NONE = "none"
    TOKEN = "token"
    """A sample and an attribute (sequence) dim flattened into one, [batch * seq] (the LM head's logits
    and the loss as HF computes them, MoE routing): it grows with the micro-batch and a sequence split
    (context parallelism) divides it, as if it were both (`split_roles`)."""


def split_roles(roles: Iterable[DimRole]) -> set[DimRole]:
    """The roles a tensor's dims answer to when it is split or scaled: TOKEN counts as SAMPLE and ATTRIBUTE."""
    out = set(roles)
    if DimRole.TOKEN in out:
        out |= {DimRole.SAMPLE, DimRole.ATTRIBUTE}
    return out


class OpKind(str, Enum):
    MATMUL = "matmul"  # linear, mm, addmm, bmm, baddbmm, einsum contractions
    ATTENTION = "attention"  # fused scaled-dot-product attention core
    NORM = "norm"  # layer norm, RMS norm, group norm
    SOFTMAX = "softmax"
    ELEMENTWISE = "elementwise"  # activations, add, mul, dropout, rotary, casts
    EMBEDDING = "embedding"
    LOSS = "loss"  # cross entropy, nll
    REDUCTION = "reduction"  # sum, mean, max over a dimension
    VIEW = "view"  # view, reshape, transpose, permute, expand, slice: no bytes moved
    COPY = "copy"  # cat, contiguous copies, index/gather/scatter
    OTHER = "other"


@dataclass(frozen=True)
class TensorMeta:
    """Shape, dtype and the role of each dimension of one tensor."""

    shape: tuple[int, ...]
    dtype: str
    roles: tuple[DimRole, ...]

    def __post_init__(self) -> None:
        if len(self.shape) != len(self.roles):
            raise ValueError(f"shape {self.shape} has {len(self.shape)} dims but {len(self.roles)} roles")

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES.get(self.dtype, 4)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def dims_with(self, role: DimRole) -> tuple[int, ...]:
        """Indices of the dimensions that carry `role`."""
        return tuple(i for i, r in enumerate(self.roles) if r is role)


@dataclass(frozen=True)
class ParamMeta:
    """A parameter (or trainable buffer) an op reads, by its fully qualified name in the model."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    trainable: bool = True

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class OpNode:
    """One operator of the forward pass, with everything the cost model needs to price it."""

    name: str
    """Unique within the graph, e.g. `model.layers.0.self_attn.q_proj:mm`."""
    kind: OpKind
    target: str
    """The ATen overload, e.g. `aten.mm.default`."""
    module_fqn: str
    """The innermost module that called the op, e.g. `model.layers.0.self_attn.q_proj`."""
    block_id: str | None
    """The repeated block this op belongs to (e.g. `model.layers`), or None outside blocks."""
    inputs: tuple[TensorMeta, ...]
    outputs: tuple[TensorMeta, ...]
    params: tuple[ParamMeta, ...]
    fwd_flops: int
    bwd_flops: int
    bytes_moved: int
    """Forward bytes read plus written (0 for pure views)."""
    saved: tuple[TensorMeta, ...]
    """Tensors this op saves for backward: what activation memory is made of."""
    attrs: Mapping[str, int | float | str | bool] = field(default_factory=dict)
    """Kind-specific facts, e.g. attention's `heads`, `kv_heads`, `head_dim`, `causal`."""

    @property
    def saved_bytes(self) -> int:
        return sum(t.nbytes for t in self.saved)


@dataclass(frozen=True)
class Block:
    """A repeated layer type: one representative instance is in the graph, repeated `count` times."""

    id: str
    """The container's FQN with the index removed, e.g. `model.layers` or `encoder.block`."""
    module_type: str
    """The layer's class name, e.g. `LlamaDecoderLayer`."""
    count: int
    """Instances in the full model."""
    traced: int
    """Instances actually traced before the graph was scaled to `count`."""
    stack: str = ""
    """The FQN of the layer container (`model.layers`); equals `id` unless the stack holds several block
    types, whose ids are then `<stack>#<k>`."""
    indices: tuple[int, ...] = ()
    """Positions in `stack` of this type's instances (all of 0..count-1 for a uniform stack)."""


@dataclass(frozen=True)
class ModelDims:
    """The model facts that divisibility rules and the executor need."""

    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    num_experts: int = 0
    experts_per_token: int = 0
    is_encoder_decoder: bool = False


@dataclass(frozen=True)
class Segment:
    """A run of the model in execution order: non-block ops once, or one block's ops `repeat` times."""

    block_id: str | None
    ops: tuple[OpNode, ...]
    repeat: int


@dataclass(frozen=True)
class OpGraph:
    model: str
    task: str
    batch: int
    seq_len: int
    ops: tuple[OpNode, ...]
    blocks: tuple[Block, ...]
    params_total: int
    params_trainable: int
    dims: ModelDims
    frontend: str
    """The capture front-end that produced this graph: `export`, `hf-fx` or `dispatch`."""

    def block(self, block_id: str) -> Block:
        for b in self.blocks:
            if b.id == block_id:
                return b
        raise KeyError(block_id)

    def multiplicity(self, op: OpNode) -> int:
        """How many times `op` runs in the full model."""
        return 1 if op.block_id is None else self.block(op.block_id).count

    def segments(self) -> Iterator[Segment]:
        run: list[OpNode] = []
        current: str | None = None
        for op in self.ops:
            if run and op.block_id != current:
                yield Segment(current, tuple(run), 1 if current is None else self.block(current).count)
                run = []
            current = op.block_id
            run.append(op)
        if run:
            yield Segment(current, tuple(run), 1 if current is None else self.block(current).count)

    def ops_of(self, block_id: str | None) -> tuple[OpNode, ...]:
        return tuple(op for op in self.ops if op.block_id == block_id)

    @property
    def fwd_flops(self) -> int:
        return sum(op.fwd_flops * self.multiplicity(op) for op in self.ops)

    @property
    def bwd_flops(self) -> int:
        return sum(op.bwd_flops * self.multiplicity(op) for op in self.ops)

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len

    @property
    def activation_bytes(self) -> int:
        """Bytes saved for backward over the whole traced batch, with no recomputation."""
        return sum(op.saved_bytes * self.multiplicity(op) for op in self.ops)
