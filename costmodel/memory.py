"""Memory per rank: model state, activations, communication buffers and context overhead.

Model state (`model_state_bytes`), per parameter element (shared/reference/techniques.md):

| precision       | weights                         | gradients | adamw        | adamw8bit | sgd | adafactor |
|-----------------|---------------------------------|-----------|--------------|-----------|-----|-----------|
| fp32, tf32      | 4                               | 4         | 8            | 2         | 4   | factored  |
| fp16, bf16      | 6 (fp32 master + 16-bit copy)   | 4 (fp32)  | 8            | 2         | 4   | factored  |
| fp8 (MS-AMP O2) | 3 (fp16 master + fp8 copy)      | 1 (fp8)   | 3 (fp8 m, fp16 v) | 2    | 4   | factored  |

- adamw: two fp32 moments. adamw8bit: bitsandbytes' two 8-bit moments (its per-block absmax scales,
  8 bytes per 2048 elements, are ignored). sgd: one fp32 momentum buffer.
- adafactor (`adafactor_bytes`): fp32 second-moment statistics, factored for a tensor of 2+ dims into
  a row vector (all dims but the last) and a column vector (all dims but the second to last), 4 bytes
  each: 4 * (prod(shape[:-1]) + prod(shape[:-2]) * shape[-1]); a 1-D tensor keeps a full fp32 vector
  (4 bytes per element). No first moment (transformers' default beta1=None). Exact when the shapes are
  given; without them every parameter is assumed to sit in square matrices of side
  `ADAFACTOR_ASSUMED_SIDE` (8 / side bytes per element), an approximation.
- fp8 follows MS-AMP's O2 level (FP8-LM): fp16 master weights with an fp8 compute copy, fp8 weight
  gradients, Adam's first moment in fp8 and second in fp16. O2 changes Adam only, so sgd and adafactor
  keep their fp32 state; adamw8bit is already 8-bit.
- Optimizer-step scalars (torch keeps one `step` value per parameter tensor) are not counted.
- Frozen parameters (`frozen`) have weights only: 4 bytes in fp32/tf32, 2 in 16-bit, 1 in fp8.

ZeRO over the `dp_shard` ranks: stage 1 shards the optimizer state, 2 also the gradients, 3 also the
weights (both the master and the low-precision copy): each sharded term is ceil(bytes / dp_shard).

Offload (`offload_optimizer`) is what the executor runs: FSDP2 with `CPUOffloadPolicy` over the
dp_shard ranks, whatever the ZeRO stage (`executor.data_parallel`), as ZeRO-Offload does. Per element:
- host (`offloaded`, not on the device): the fp32 parameter shard, its fp32 gradient and the
  optimizer state, each / dp_shard: (FSDP_MASTER_BYTES + FSDP_MASTER_BYTES) / dp_shard + state / dp_shard;
- device weights: FSDP's gathered compute copy (`fsdp_param_bytes`: bf16 under MixedPrecisionPolicy,
  the fp32 parameters otherwise). ZeRO 0/1/2 do not reshard after forward, so every unit stays
  gathered from its forward to its backward (trainable x width); ZeRO 3 reshards, so only the units in
  flight are gathered (a buffer, below) and the weights term is 0. Frozen tensors stay on the device;
- device gradients: without a pipeline 0, each unit's gradients exist on the device only between its
  backward and the copy to the host (a buffer, below); with one (`pipeline`), torch's pipeline stage
  turns FSDP's gradient sync off until each schedule run's last backward, so the stage's unsharded
  gradients accumulate on the device in fp32 (FSDP's reduce dtype): trainable x FSDP_GRAD_BYTES;
- device optimizer state: 0.

Activations: `costmodel.memory_activations.activation_bytes` (re-exported here) and `activation_parts`
(its terms: prologue, blocks kept, epilogue, recompute window; re-exported).

Buffers (`buffer_bytes`), by the engine the executor runs (`executor.data_parallel`):
- ZeRO 0/1 with dp > 1 (DDP): the reducer's buckets, allocated once for every gradient (25 MB
  `bucket_cap_mb` only splits them): a second copy of the gradients, trainable x GRAD_BYTES.
- ZeRO 2 (FSDP2 without resharding after forward): the parameters stay gathered from forward through
  backward next to their fp32 shard, so beyond the weights term there is the shard of the fp32 master
  plus the gathered compute copy, less what the weights term already counts (4/dp_shard + width - w
  per element, at least 0); and during backward the unsharded fp32 gradients of one unit and their
  reduce-scatter input (2 x largest unit x 4).
- ZeRO 3 over dp_shard > 1: FSDP's all-gather of the largest unit's parameters at compute width (the
  current unit and the prefetched next one, 2x) plus that unit's fp32 gradients before their
  reduce-scatter.
- Offload (FSDP2 on every rank, even alone): ZeRO 3, the zero-3 term above at `fsdp_param_bytes`
  whatever dp_shard; otherwise the unsharded fp32 gradients of one unit and their reduce-scatter
  input before the copy to the host (2 x largest unit x 4).
A unit is one block instance, or the non-block parameters together (the root FSDP unit).

Tensor parallelism shards the weights of matmuls and embeddings inside the repeated blocks (their
first dimension, ceil(rows / tp)). With the whole model on the rank (pp == 1) it also shards the
token embedding and the LM head over the vocabulary (`costmodel.placement.vocab_parallel_ops`), so
their weights, gradients and optimizer state are divided by tp too; position and token-type
embeddings and the final norm stay replicated, and a pipeline stage keeps the token embedding and LM
head whole (`stage_params(vocab_parallel=...)`; by default: sharded when `ops` hold both, as only the
whole model does), as `executor.tensor_parallel` runs them. Activations are sized with every
parameter-role dimension divided by tp (`split`), the [tokens, vocab] logits of the head and the
loss's working set included: the vocab-parallel head and loss keep only the rank's vocabulary shard.

Whole stage (`estimate_memory`): the sum of the above for one rank holding `ops` (default: the whole
graph), with activations multiplied by the micro-batches in flight (a pipeline stage's 1F1B warm-up),
plus the device profile's overhead: its context (`context_bytes`, resident before training starts) and
its runtime workspace (`runtime_workspace_bytes`, what a training process allocates beyond the counted
tensors; `soap calibrate --from-runs` fits it from measured peaks).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from costmodel.memory_activations import ActivationParts, activation_bytes, activation_parts
from costmodel.opcost import FLOAT_DTYPES, activation_itemsize
from costmodel.placement import vocab_parallel_ops
from costmodel.profiles import DeviceProfile
from costmodel.strategy import OPTIMIZERS, PRECISIONS, TrainingConfig
from tracer.errors import SoapError
from tracer.ir import OpGraph, OpKind, OpNode

WEIGHT_BYTES = {"fp32": 4, "tf32": 4, "fp16": 6, "bf16": 6, "fp8": 3}
FROZEN_WEIGHT_BYTES = {"fp32": 4, "tf32": 4, "fp16": 2, "bf16": 2, "fp8": 1}
GRAD_BYTES = {"fp32": 4, "tf32": 4, "fp16": 4, "bf16": 4, "fp8": 1}
OPTIMIZER_BYTES = {"adamw": 8, "adamw8bit": 2, "sgd": 4}
FP8_ADAM_BYTES = 3
"""MS-AMP O2: 1-byte first moment + 2-byte second moment."""
ADAFACTOR_ASSUMED_SIDE = 1024
FSDP_MASTER_BYTES = 4
"""FSDP2 keeps each parameter's shard in fp32 and reduce-scatters fp32 gradients."""
FSDP_GRAD_BYTES = 4
"""FSDP2's sharded gradients are in the parameters' dtype (fp32), also when offloaded."""
TENSOR_PARALLEL_KINDS = frozenset({OpKind.MATMUL, OpKind.EMBEDDING})
__all__ = [
    "ActivationParts", "MEMORY_TERMS", "MemoryBreakdown", "ParamSet", "StateBytes", "activation_bytes", "activation_parts",
    "adafactor_bytes", "buffer_bytes", "estimate_memory", "fsdp_param_bytes", "model_state_bytes", "optimizer_state_bytes",
    "stage_params",
]


@dataclass(frozen=True)
class StateBytes:
    weights: int
    grads: int
    optimizer: int
    offloaded: int
    """Bytes in host memory (not counted on the device)."""


MEMORY_TERMS = ("weights", "grads", "optimizer", "activations", "buffers", "workspace", "host")
"""The terms of `MemoryBreakdown`, in the order tables and `memory_breakdown_gib` show them."""


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes one rank holds at its peak, by term: what the estimator, the simulator and the reports share."""

    weights: float
    grads: float
    optimizer: float
    activations: float
    buffers: float
    """Communication buffers: DDP buckets, FSDP's gathered units and unsharded gradients (`buffer_bytes`)."""
    workspace: float
    """The device's context and runtime workspace (`workspace_bytes`)."""
    host: float = 0
    """Host bytes (offload: fp32 parameter shards, their gradients and the optimizer state); not part of `total`."""

    @property
    def total(self) -> float:
        """Device bytes: every term but `host`."""
        return self.weights + self.grads + self.optimizer + self.activations + self.buffers + self.workspace

    def as_gib(self) -> dict[str, float]:
        return {**{term: getattr(self, term) / 2**30 for term in MEMORY_TERMS}, "total": self.total / 2**30}


def adafactor_bytes(shape: Sequence[int]) -> int:
    """Adafactor's fp32 statistics for one tensor (see the module docstring)."""
    if len(shape) < 2:
        return 4 * math.prod(shape)
    rows = math.prod(shape[:-1])
    cols = math.prod(shape[:-2]) * shape[-1]
    return 4 * (rows + cols)


def optimizer_state_bytes(
    params: int, *, precision: str, optimizer: str, param_shapes: Iterable[Sequence[int]] | None = None
) -> int:
    """Unsharded optimizer state for `params` trainable elements (shapes needed for exact adafactor)."""
    if optimizer == "adafactor":
        if param_shapes is not None:
            return sum(adafactor_bytes(s) for s in param_shapes)
        return math.ceil(params * 8 / ADAFACTOR_ASSUMED_SIDE)
    if optimizer == "adamw" and precision == "fp8":
        return params * FP8_ADAM_BYTES
    return params * OPTIMIZER_BYTES[optimizer]


def _check_state_args(precision: str, optimizer: str, zero: int, dp_shard: int) -> None:
    if precision not in PRECISIONS:
        raise SoapError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    if optimizer not in OPTIMIZERS:
        raise SoapError(f"unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
    if zero not in (0, 1, 2, 3):
        raise SoapError(f"zero={zero} must be 0, 1, 2 or 3")
    if dp_shard < 1:
        raise SoapError(f"dp_shard={dp_shard} must be a positive integer")


def model_state_bytes(
    params: int,
    *,
    precision: str,
    optimizer: str,
    zero: int,
    dp_shard: int,
    offload_optimizer: bool,
    param_shapes: Iterable[Sequence[int]] | None = None,
    frozen: int = 0,
    pipeline: bool = False,
) -> StateBytes:
    """Weights, gradients and optimizer state for `params` parameters held by one rank before DP sharding.

    `params` counts trainable elements (their shapes in `param_shapes`, for adafactor); `frozen`
    elements add weights only; `pipeline` (pp > 1) matters to offload only."""
    _check_state_args(precision, optimizer, zero, dp_shard)
    weights = params * WEIGHT_BYTES[precision] + frozen * FROZEN_WEIGHT_BYTES[precision]
    grads = params * GRAD_BYTES[precision]
    state = optimizer_state_bytes(params, precision=precision, optimizer=optimizer, param_shapes=param_shapes)

    def shard(nbytes: int, stage: int) -> int:
        return math.ceil(nbytes / dp_shard) if zero >= stage else nbytes

    optimizer_local = shard(state, 1)
    if offload_optimizer:
        host = math.ceil(params * (FSDP_MASTER_BYTES + FSDP_GRAD_BYTES) / dp_shard) + math.ceil(state / dp_shard)
        gathered = 0 if zero == 3 else params * fsdp_param_bytes(precision)
        return StateBytes(weights=gathered + frozen * FROZEN_WEIGHT_BYTES[precision],
                          grads=params * FSDP_GRAD_BYTES if pipeline else 0, optimizer=0, offloaded=host)
    return StateBytes(
        weights=shard(weights, 3),
        grads=shard(grads, 2),
        optimizer=optimizer_local,
        offloaded=0,
    )


def fsdp_param_bytes(precision: str) -> int:
    """Bytes per element of FSDP2's gathered parameters: bf16 under its MixedPrecisionPolicy; the fp32
    parameters themselves for the other precisions (fp16 autocasts, fp8 casts inside torchao's linear)."""
    return 2 if precision == "bf16" else 4


@dataclass(frozen=True)
class ParamSet:
    """The distinct parameters a rank holds for a set of ops, at local (tensor-parallel) size."""

    trainable: int
    frozen: int
    shapes: tuple[tuple[int, ...], ...]
    """Local shapes of the trainable tensors, one entry per instance (for adafactor)."""
    largest_unit: int
    """Elements of the largest FSDP unit: one block instance, or all non-block parameters."""


def stage_params(
    ops: Iterable[OpNode], *, block_counts: Mapping[str, int], tensor_parallel: int = 1,
    vocab_parallel: bool | None = None,
) -> ParamSet:
    """Distinct parameters (by name) of `ops`, each block's times its instance count. Parameters read by
    matmuls and embeddings inside blocks are sharded `tensor_parallel` ways (their first dimension);
    with `vocab_parallel` also those of the token embedding and the LM head (pp == 1; None: when `ops`
    hold both, i.e. the whole model); others (position embeddings, norms) replicate.
    Frozen floating-point tensors (frozen weights, buffers such as rotary `inv_freq`) count as frozen;
    integer buffers (position ids) are left out."""
    ops = tuple(ops)
    vocab_ops = {name for name in vocab_parallel_ops(ops) if name is not None}
    if vocab_parallel is None:
        vocab_parallel = len(vocab_ops) == 2
    sharded = vocab_ops if vocab_parallel else set()
    seen: set[str] = set()
    trainable = frozen = 0
    shapes: list[tuple[int, ...]] = []
    units: dict[str | None, int] = {}
    for op in ops:
        in_tp = op.kind in TENSOR_PARALLEL_KINDS and op.block_id is not None
        degree = tensor_parallel if in_tp or op.name in sharded else 1
        count = 1 if op.block_id is None else block_counts.get(op.block_id, 1)
        for p in op.params:
            if p.name in seen:
                continue
            seen.add(p.name)
            local = math.ceil(p.numel / degree)
            units[op.block_id] = units.get(op.block_id, 0) + local
            if p.trainable:
                trainable += local * count
                shape = (math.ceil(p.shape[0] / degree), *p.shape[1:]) if p.shape else ()
                shapes.extend([shape] * count)
            elif p.dtype in FLOAT_DTYPES:
                frozen += local * count
    return ParamSet(trainable, frozen, tuple(shapes), max(units.values(), default=0))


def buffer_bytes(*, params: ParamSet, precision: str, zero: int, dp: int, dp_shard: int, offload: bool = False) -> int:
    """Communication buffers (see the module docstring)."""
    if offload:
        if zero == 3:
            return params.largest_unit * (2 * fsdp_param_bytes(precision) + FSDP_GRAD_BYTES)
        return 2 * params.largest_unit * FSDP_GRAD_BYTES
    width = activation_itemsize(precision)
    if zero == 3 and dp_shard > 1:
        return params.largest_unit * (2 * width + 4)
    if zero == 2 and dp > 1:
        gathered = max(0.0, FSDP_MASTER_BYTES / dp_shard + width - WEIGHT_BYTES[precision])
        return math.ceil(params.trainable * gathered) + 2 * params.largest_unit * FSDP_MASTER_BYTES
    if dp > 1:
        return params.trainable * GRAD_BYTES[precision]
    return 0


def workspace_bytes(device: DeviceProfile) -> int:
    """What a training process holds beyond the counted tensors: the device's context (resident before
    training starts) and its runtime workspace (fitted from measured peaks by `soap calibrate --from-runs`)."""
    return device.context_bytes + device.runtime_workspace_bytes


def estimate_memory(
    graph: OpGraph,
    *,
    device: DeviceProfile,
    train: TrainingConfig,
    dp: int = 1,
    dp_shard: int = 1,
    tp: int = 1,
    ops: Sequence[OpNode] | None = None,
    block_counts: Mapping[str, int] | None = None,
    split: Mapping[str, int] | None = None,
    in_flight_microbatches: int = 1,
    vocab_parallel: bool | None = None,
) -> MemoryBreakdown:
    """Peak memory of one rank that runs `ops` (default: all of `graph`) under `train`.

    - `dp`, `dp_shard`, `tp`: the data-parallel degree, the ZeRO/FSDP shard degree (train.zero says
      what is sharded) and the tensor-parallel degree that shards matmul/embedding weights.
    - `block_counts`: block instances on this rank (default: the graph's counts; a pipeline stage
      passes its share).
    - `split`: role degrees for local activation shapes (default {"parameter": tp}).
    - `in_flight_microbatches`: micro-batches whose activations are live at once (1 without pipeline;
      a 1F1B stage s of p holds p - s).
    - `vocab_parallel`: whether tp also shards the token embedding and LM head (`stage_params`).
    """
    if train.seq_len != graph.seq_len:
        raise SoapError(
            f"the graph was traced at sequence length {graph.seq_len} but training uses {train.seq_len}; "
            "trace at the training sequence length"
        )
    ops = graph.ops if ops is None else ops
    counts = {b.id: b.count for b in graph.blocks} if block_counts is None else dict(block_counts)
    params = stage_params(ops, block_counts=counts, tensor_parallel=tp, vocab_parallel=vocab_parallel)
    state = model_state_bytes(
        params.trainable,
        precision=train.precision,
        optimizer=train.optimizer,
        zero=train.zero,
        dp_shard=dp_shard,
        offload_optimizer=train.offload_optimizer,
        param_shapes=params.shapes,
        frozen=params.frozen,
    )
    activations = in_flight_microbatches * activation_bytes(
        ops,
        micro_batch=train.micro_batch,
        batch_traced=graph.batch,
        recompute=train.recompute,
        attention=train.attention,
        split={"parameter": tp} if split is None else split,
        precision=train.precision,
        block_counts=counts,
        recompute_per_block=dict(train.recompute_per_block),
    )
    return MemoryBreakdown(
        weights=state.weights,
        grads=state.grads,
        optimizer=state.optimizer,
        activations=activations,
        buffers=buffer_bytes(params=params, precision=train.precision, zero=train.zero, dp=dp, dp_shard=dp_shard,
                             offload=train.offload_optimizer),
        workspace=workspace_bytes(device),
        host=state.offloaded,
    )
