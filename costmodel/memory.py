"""Memory per rank: model state, activations, communication buffers and context overhead.

Model state (`model_state_bytes`), per trainable parameter element, as the executor holds it at the
step's peak (forward done, backward under way), by the engine `executor.data_parallel` runs each ZeRO
stage on; d = dp_shard, S = the optimizer's state per element (below):

| zero: engine                       | precision        | weights                          | gradients   | optimizer |
|------------------------------------|------------------|----------------------------------|-------------|-----------|
| 0: one rank, or DDP                | fp32, tf32       | 4 (the fp32 parameters)          | 4           | S         |
|                                    | fp16, bf16, fp8  | 6: 4 + 2 (autocast's copy)       | 4 (fp32)    | S         |
| 1: DDP + ZeroRedundancyOptimizer   | as zero 0        | as zero 0                        | as zero 0   | S / d     |
| 2: FSDP2, gathered fwd to bwd      | fp32, tf32       | 4/d (fp32 shard) + 4 (gathered)  | 4/d (pp: 4) | S / d     |
|                                    | bf16, fp8        | 4/d + 2 (gathered in bf16)       | 4/d (pp: 4) | S / d     |
|                                    | fp16             | 4/d + 4 + 2 (autocast's copy)    | 4/d (pp: 4) | S / d     |
| 3: FSDP2, resharded after forward  | fp32, tf32, bf16, fp8 | 4/d (gathered units: buffers) | 4/d (pp: 4) | S / d  |
|                                    | fp16             | 4/d + 2 (autocast's copy)        | 4/d (pp: 4) | S / d     |

S: adamw 8 (two fp32 moments), adamw8bit 2, sgd 4, adafactor factored (below).
fp8 is what the executor runs (`executor.precision`), as torchtitan runs it: the bf16 regime (FSDP2's
bf16 MixedPrecisionPolicy, or bf16 autocast) with torchao's float8 Linear layers, which cast to fp8
inside each matmul; so its state is bf16's (fp32 master, fp32 gradients, fp32 optimizer state).
- 16-bit without FSDP runs fp32 parameters under autocast: they are the master, and autocast's 16-bit
  copy of each matmul weight is saved for its backward, so it lives from forward to backward (counted
  for every element). bf16 under FSDP2 is its MixedPrecisionPolicy instead: the gathered parameters
  are bf16 (`fsdp_param_bytes`) and nothing autocasts; fp16 under FSDP2 gathers fp32 and autocasts.
- DDP's gradients are views of its reducer's buckets (`gradient_as_bucket_view`): one copy, no buffer.
- ZeroRedundancyOptimizer gives each rank whole parameters (greedily, largest first): S / d is the
  balanced share, which the busiest rank exceeds by less than one parameter's state.
- ZeRO 2 is Megatron-Core's distributed optimizer and more: the fp32 master is sharded with the
  moments (and the gradients too), and the 16-bit compute copy exists only from each unit's forward
  to its backward: bf16 holds 2 + 16/d against Megatron's 6 + 12/d (16-bit weights and fp32
  gradients whole). ZeRO 1 cannot shard the master: DDP's fp32 parameters are the master (autocast
  makes the 16-bit copies) and torch has no DDP-compatible optimizer that keeps 16-bit weights beside
  sharded fp32 masters; it holds 10 + 8/d in bf16 against Megatron's 6 + 12/d (d = 4: 12 against 9).
  In fp32 both hold 8 + 8/d.
- With a pipeline (`pipeline`, pp > 1), torch's pipeline stage turns FSDP's gradient sync (and
  resharding after backward) off until each schedule run's last backward, so the unsharded fp32
  gradients accumulate: 4 per element, whatever d.
- DDP cannot run with tp > 1 (DTensor parameters), a pipeline or offload: zero 0/1 then run on FSDP2
  without resharding over (dp_replicate, dp_shard), holding the zero-2 row with d = dp_shard (zero 0:
  d = 1): callers pass `fsdp=costmodel.strategy.runs_on_fsdp2(...)`, the executor's own rule.
- adamw8bit: bitsandbytes' two 8-bit moments (its per-block absmax scales, 8 bytes per 2048
  elements, are ignored). sgd: one fp32 momentum buffer.
- adafactor (`adafactor_bytes`): fp32 second-moment statistics, factored for a tensor of 2+ dims into
  a row vector (all dims but the last) and a column vector (all dims but the second to last), 4 bytes
  each: 4 * (prod(shape[:-1]) + prod(shape[:-2]) * shape[-1]); a 1-D tensor keeps a full fp32 vector
  (4 bytes per element). No first moment (transformers' default beta1=None). Exact when the shapes are
  given; without them every parameter is assumed to sit in square matrices of side
  `ADAFACTOR_ASSUMED_SIDE` (8 / side bytes per element), an approximation.
- Optimizer-step scalars (torch keeps one `step` value per parameter tensor) are not counted.
- Frozen parameters (`frozen`) have weights only: 4 bytes in fp32/tf32, 2 in 16-bit and fp8 (PEFT's
  frozen base weights among them, `costmodel.peft`). Under FSDP2 they are sharded like the rest: ZeRO 3
  holds their shard (the gathered unit is a buffer), ZeRO 2 their shard and their gathered copy (frozen
  buffers such as rotary `inv_freq`, which FSDP does not shard, are counted alike: a few bytes over).
  With offload they are counted on the device (FSDP's CPUOffloadPolicy moves a PEFT run's frozen base
  to the host too, so this over-counts a LoRA run with offload). QLoRA's 4-bit base weights
  (`quantized`, bytes by `costmodel.peft.nf4_bytes`) are weights only too, held whole on every rank.
- Sharded terms are ceil(bytes / d); zero 2 and 3 shard only over d > 1 (with d = 1 they hold the zero
  0 row).

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
- ZeRO 0/1 (DDP): none; the reducer's buckets are the gradients (`gradient_as_bucket_view`).
- ZeRO 2 over dp_shard > 1 (FSDP2 without resharding after forward; its gathered parameters are in the
  weights term): during backward the unsharded fp32 gradients of one unit and their reduce-scatter
  input (2 x largest unit's trainable elements x 4).
- ZeRO 3 over dp_shard > 1: FSDP's all-gather of the largest unit's parameters at `fsdp_param_bytes` (the
  current unit and the prefetched next one, 2x; fp16 has no MixedPrecisionPolicy, so it gathers fp32) plus
  the fp32 gradients of the largest unit's trainable elements before their reduce-scatter (with PEFT only
  the adapters have gradients).
- Offload (FSDP2 on every rank, even alone): ZeRO 3, the zero-3 term above at `fsdp_param_bytes`
  whatever dp_shard; otherwise the unsharded fp32 gradients of one unit and their reduce-scatter
  input before the copy to the host (2 x largest unit x 4).
A unit is one block instance, or the non-block parameters together (the root FSDP unit).

Tensor parallelism shards the weights of matmuls and embeddings inside the repeated blocks (their
first dimension, ceil(rows / tp)). It also shards the token embedding and the LM head over the
vocabulary (`costmodel.placement.vocab_parallel_ops`), on pipeline stages too (the first stage's
embedding, the last stage's head: `costmodel.strategy.shards_vocabulary`, which callers pass as
`stage_params(vocab_parallel=...)`; by default only when `ops` hold both), so their weights, gradients
and optimizer state are divided by tp too; position and token-type embeddings and the final norm stay
replicated, as `executor.tensor_parallel` runs them. Activations are sized with every
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

from costmodel.memory_activations import ActivationParts, activation_bytes, activation_parts, sdpa_attention
from costmodel.opcost import FLOAT_DTYPES
from costmodel.peft import dequantize_buffer_bytes, is_quantized, nf4_bytes
from costmodel.placement import (is_expert, linear_style, moe_blocks, replicated_in_moe, replicated_kv_projections,
                                 vocab_parallel_ops)
from costmodel.profiles import DeviceProfile
from costmodel.strategy import OPTIMIZERS, PRECISIONS, ParallelDims, TrainingConfig, runs_on_fsdp2
from tracer.errors import SoapError
from tracer.ir import OpGraph, OpKind, OpNode

WEIGHT_BYTES = {"fp32": 4, "tf32": 4, "fp16": 6, "bf16": 6, "fp8": 6}
FROZEN_WEIGHT_BYTES = {"fp32": 4, "tf32": 4, "fp16": 2, "bf16": 2, "fp8": 2}
GRAD_BYTES = {"fp32": 4, "tf32": 4, "fp16": 4, "bf16": 4, "fp8": 4}
OPTIMIZER_BYTES = {"adamw": 8, "adamw8bit": 2, "sgd": 4}
ADAFACTOR_ASSUMED_SIDE = 1024
FSDP_MASTER_BYTES = 4
"""FSDP2 keeps each parameter's shard in fp32 and reduce-scatters fp32 gradients."""
FSDP_GRAD_BYTES = 4
"""FSDP2's sharded gradients are in the parameters' dtype (fp32), also when offloaded."""
AUTOCAST_COPY_BYTES = 2
"""fp16/bf16 autocast's copy of a matmul weight, saved for its backward (in WEIGHT_BYTES without FSDP)."""
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
    fsdp: bool = False,
    quantized: int = 0,
    autocast: bool = True,
    autocast_copied: int | None = None,
) -> StateBytes:
    """Weights, gradients and optimizer state for `params` parameters held by one rank before DP sharding
    (the module docstring's table).

    `params` counts trainable elements (their shapes in `param_shapes`, for adafactor); `frozen`
    elements add weights only, and so do `quantized` bytes (QLoRA's 4-bit base weights); `pipeline`
    (pp > 1): FSDP2's gradients accumulate unsharded; `fsdp`: the
    executor runs data parallelism on FSDP2 (`costmodel.strategy.runs_on_fsdp2`: tp, a pipeline or
    offload), where zero 0/1 hold the zero-2 row (FSDP2 without resharding over dp_shard); `autocast`:
    a 16-bit run autocasts its fp32 trainable weights (False for PEFT, `TrainingConfig.peft`: its fp32
    adapters compute in fp32 beside a 16-bit base, so no 16-bit copy of them lives, 4 bytes per element
    instead of 6 without FSDP); `autocast_copied`: the trainable elements autocast copies (`ParamSet.autocast_copied`;
    None: all), the rest holding their fp32 tensor alone."""
    _check_state_args(precision, optimizer, zero, dp_shard)
    if fsdp and zero < 2:
        zero = 2
    state = optimizer_state_bytes(params, precision=precision, optimizer=optimizer, param_shapes=param_shapes)
    frozen_bytes = frozen * FROZEN_WEIGHT_BYTES[precision]
    state_bytes = _model_state_bytes(params, precision=precision, zero=zero, dp_shard=dp_shard, state=state,
                                     offload_optimizer=offload_optimizer, frozen_bytes=frozen_bytes, pipeline=pipeline,
                                     autocast=autocast, uncopied=0 if autocast_copied is None else
                                     max(params - autocast_copied, 0))
    return StateBytes(weights=state_bytes.weights + quantized, grads=state_bytes.grads,
                      optimizer=state_bytes.optimizer, offloaded=state_bytes.offloaded)


def _model_state_bytes(params: int, *, precision: str, zero: int, dp_shard: int, state: int, offload_optimizer: bool,
                       frozen_bytes: int, pipeline: bool, autocast: bool, uncopied: int = 0) -> StateBytes:
    if offload_optimizer:
        host = math.ceil(params * (FSDP_MASTER_BYTES + FSDP_GRAD_BYTES) / dp_shard) + math.ceil(state / dp_shard)
        gathered = 0 if zero == 3 else params * fsdp_param_bytes(precision)
        return StateBytes(weights=gathered + frozen_bytes,
                          grads=params * FSDP_GRAD_BYTES if pipeline else 0, optimizer=0, offloaded=host)
    optimizer_local = math.ceil(state / dp_shard) if zero >= 1 else state
    if zero >= 2 and dp_shard > 1:  # FSDP2
        master = math.ceil(params * FSDP_MASTER_BYTES / dp_shard)
        gathered = params * fsdp_param_bytes(precision) if zero == 2 else 0
        autocast_copy = params * AUTOCAST_COPY_BYTES if precision == "fp16" and autocast else 0
        grads = params * FSDP_GRAD_BYTES if pipeline else math.ceil(params * FSDP_GRAD_BYTES / dp_shard)
        frozen_local = math.ceil(frozen_bytes / dp_shard) + (frozen_bytes if zero == 2 else 0)
        return StateBytes(weights=master + gathered + autocast_copy + frozen_local, grads=grads,
                          optimizer=optimizer_local, offloaded=0)

    def shard(nbytes: int, stage: int) -> int:
        return math.ceil(nbytes / dp_shard) if zero >= stage else nbytes

    held = (params * WEIGHT_BYTES[precision] - uncopied * (WEIGHT_BYTES[precision] - GRAD_BYTES[precision]) if autocast
            else params * GRAD_BYTES[precision])
    return StateBytes(
        weights=shard(held + frozen_bytes, 3),
        grads=shard(params * GRAD_BYTES[precision], 2),
        optimizer=optimizer_local,
        offloaded=0,
    )


def fsdp_param_bytes(precision: str) -> int:
    """Bytes per element of FSDP2's gathered parameters: bf16 under its MixedPrecisionPolicy (bf16, and fp8,
    whose float8 Linear layers cast the bf16 weights inside each matmul); the fp32 parameters themselves
    for the other precisions (fp16 autocasts)."""
    return 2 if precision in ("bf16", "fp8") else 4


@dataclass(frozen=True)
class ParamSet:
    """The distinct parameters a rank holds for a set of ops, at local (tensor-parallel) size."""

    trainable: int
    frozen: int
    shapes: tuple[tuple[int, ...], ...]
    """Local shapes of the trainable tensors, one entry per instance (for adafactor)."""
    largest_unit: int
    """Elements of the largest FSDP unit: one block instance, or all non-block parameters."""
    quantized_bytes: int = 0
    """Bytes of QLoRA's 4-bit base weights (`costmodel.peft.nf4_bytes`, per tensor)."""
    largest_trainable_unit: int | None = None
    """Trainable elements of the unit with the most (what FSDP reduce-scatters); None: `largest_unit`."""
    largest_quantized: int = 0
    """Elements of the largest 4-bit weight (its dequantized copy is a transient buffer)."""
    autocast_copied: int | None = None
    """Trainable elements a 16-bit autocast run holds a 16-bit copy of: the parameters matmuls read (weights,
    biases; a tied embedding through its LM head); an untied token embedding, norms' weights and the like are
    read in fp32 and never copied. None: all of `trainable`."""
    autocast_copied_outside: int | None = None
    """Of `autocast_copied`, those outside the blocks (the LM head, a tied embedding): the copies a run whose
    blocks recompute still holds (`held_autocast_copies`). None: all of `autocast_copied`."""
    fp8_linear: int = 0
    """Of `autocast_copied`, the parameters of float8 Linear layers (`tracer.fp8`). Under fp8 torchao's
    `Float8Linear` casts its fp32 weight straight to fp8 in each matmul and saves the fp32 weight itself for the
    backward, so autocast keeps no 16-bit copy of them (`held_autocast_copies`)."""
    fp8_linear_outside: int = 0
    """Of `fp8_linear`, those outside the blocks."""


def held_autocast_copies(params: ParamSet, *, blocks_keep: bool, precision: str = "bf16") -> int | None:
    """The trainable elements whose 16-bit autocast copy lives from forward to backward. Without recompute each
    matmul saves its cast weight for the backward. A recomputed block (full, or selective, whose policy caches
    matmul and attention outputs, not casts) re-casts its weights when the backward re-runs its forward, so only
    the copies outside the blocks are held: on a lent H100 (2026-11-26) the 16k selective runs of four
    Llama-3-8B layers, eager and compiled, peaked 1.6 GiB (the blocks' bf16 weights) under the model that kept
    them, and their memory snapshot held none at the upcast loss's peak, in its backward. Autocast caches the
    copies until its context exits, so this holds where the executor leaves autocast after the forward: before
    the loss without a pipeline, after each stage's forward in one (`executor.precision.autocast_each_forward`).
    Until 2026-11-26 it left after the loss (and, in a pipeline, after the whole schedule step): the chunked
    loss's peak, in its forward, held the blocks' 1.6 GiB of copies beside it (the same runs' snapshot).
    Under fp8 the float8 Linear layers' weights have no copy (`ParamSet.fp8_linear`): on a lent H100
    (2026-11-26) the eager fp8 step of four Llama-3-8B layers without recompute peaked 1.56 GiB under the
    bf16-regime price, their blocks' 1.63 GiB of linear weights in bf16 (`benchmarks/fp8_h100.py`).
    `blocks_keep`: `blocks_keep_autocast_copies` of the run. None: every trainable element."""
    fp8 = precision == "fp8"
    if blocks_keep or params.autocast_copied_outside is None:
        if params.autocast_copied is None or not fp8:
            return params.autocast_copied
        return params.autocast_copied - params.fp8_linear
    return params.autocast_copied_outside - (params.fp8_linear_outside if fp8 else 0)


def blocks_keep_autocast_copies(train: TrainingConfig) -> bool:
    """Whether some block keeps its weights' autocast copies to the backward (`held_autocast_copies`): one whose
    policy (`TrainingConfig.recompute`, or its `recompute_per_block`) recomputes nothing. The segments outside the
    blocks (`<prologue>`, `<epilogue>`) recompute nothing and are not blocks."""
    return train.recompute == "none" or any(policy == "none" for block, policy in train.recompute_per_block
                                            if not block.startswith("<"))


def parameter_degrees(ops: Iterable[OpNode], *, tensor_parallel: int = 1, expert_parallel: int = 1,
                      vocab_parallel: bool = False) -> dict[str, int]:
    """How many ways each parameter read by `ops` is sharded, decided per parameter: the largest degree
    of any op that reads it, whatever op reads it first (under autocast an elementwise cast reads every
    weight before its matmul does). What shards, as the executor applies it:
    - an MoE expert op with expert_parallel > 1: its parameters over ep (each rank holds 1/ep of the
      experts; TP does not split them, `costmodel.placement.block_placements`);
    - a non-expert op of an MoE block under ep > 1 (router, shared expert): never, the block runs
      TP-replicated (`placement.replicated_in_moe`);
    - a block's colwise/rowwise linear (`placement.linear_style`, the module names `executor.tensor_parallel`
      applies ColwiseParallel/RowwiseParallel to): over tp, except the K and V projections when tp exceeds
      the KV heads, which every TP rank holds whole (`placement.replicated_kv_projections`);
    - with `vocab_parallel` (`costmodel.strategy.shards_vocabulary`), the token embedding and LM head
      (`placement.vocab_parallel_ops`): over tp.
    Everything else (norms, biases of unsharded modules, position tables, routers) replicates."""
    ops = tuple(ops)
    vocab = {name for name in vocab_parallel_ops(ops) if name is not None} if vocab_parallel else set()
    moe = moe_blocks(ops) if expert_parallel > 1 else frozenset()
    replicated_kv = replicated_kv_projections(ops, tensor_parallel)
    degrees: dict[str, int] = {}
    for op in ops:
        if op.block_id is not None and expert_parallel > 1 and is_expert(op):
            degree = expert_parallel
        elif replicated_in_moe(op, moe, expert_parallel) or op.name in replicated_kv:
            degree = 1
        elif (op.block_id is not None and linear_style(op)) or op.name in vocab:
            degree = tensor_parallel
        else:
            degree = 1
        for p in op.params:
            degrees[p.name] = max(degree, degrees.get(p.name, 1))
    return degrees


def stage_params(
    ops: Iterable[OpNode], *, block_counts: Mapping[str, int], tensor_parallel: int = 1, expert_parallel: int = 1,
    vocab_parallel: bool | None = None, degrees: Mapping[str, int] | None = None,
) -> ParamSet:
    """Distinct parameters (by name) of `ops`, each block's times its instance count, at the local size
    `parameter_degrees` gives them (the first dimension divided, rounded up), or `degrees` (by parameter
    name) when the caller decided them over more ops than these. Callers pass `vocab_parallel` by
    `costmodel.strategy.shards_vocabulary`; None shards the vocabulary only where `ops` hold both the
    token embedding and the LM head (a whole model) and tp > 1.
    Frozen floating-point tensors (frozen weights, buffers such as rotary `inv_freq`) count as frozen;
    integer buffers (position ids) are left out."""
    ops = tuple(ops)
    if vocab_parallel is None:
        vocab_parallel = tensor_parallel > 1 and None not in vocab_parallel_ops(ops)
    if degrees is None:
        degrees = parameter_degrees(ops, tensor_parallel=tensor_parallel, expert_parallel=expert_parallel,
                                    vocab_parallel=vocab_parallel)
    seen: set[str] = set()
    trainable = frozen = quantized = largest_quantized = copied = copied_outside = fp8 = fp8_outside = 0
    matmul_read = {p.name for op in ops if op.kind is OpKind.MATMUL for p in op.params}
    fp8_read = {p.name for op in ops if op.attrs.get("fp8_linear") for p in op.params}
    shapes: list[tuple[int, ...]] = []
    units: dict[str | None, int] = {}
    trainable_units: dict[str | None, int] = {}
    for op in ops:
        count = 1 if op.block_id is None else block_counts.get(op.block_id, 1)
        for p in op.params:
            if p.name in seen:
                continue
            seen.add(p.name)
            degree = degrees[p.name]
            local = math.ceil(p.numel / degree)
            units[op.block_id] = units.get(op.block_id, 0) + local
            if p.trainable:
                trainable_units[op.block_id] = trainable_units.get(op.block_id, 0) + local
                trainable += local * count
                copied += local * count if p.name in matmul_read else 0
                copied_outside += local if p.name in matmul_read and op.block_id is None else 0
                if p.name in matmul_read and p.name in fp8_read:
                    fp8 += local * count
                    fp8_outside += local if op.block_id is None else 0
                shape = (math.ceil(p.shape[0] / degree), *p.shape[1:]) if p.shape else ()
                shapes.extend([shape] * count)
            elif p.dtype in FLOAT_DTYPES:
                frozen += local * count
            elif is_quantized(p.dtype):
                quantized += nf4_bytes(local) * count
                largest_quantized = max(largest_quantized, local)
    return ParamSet(trainable, frozen, tuple(shapes), max(units.values(), default=0), quantized_bytes=quantized,
                    largest_quantized=largest_quantized,
                    largest_trainable_unit=max(trainable_units.values(), default=0), autocast_copied=copied,
                    autocast_copied_outside=copied_outside, fp8_linear=fp8, fp8_linear_outside=fp8_outside)


def buffer_bytes(*, params: ParamSet, precision: str, zero: int, dp: int, dp_shard: int, offload: bool = False,
                 fsdp: bool = False) -> int:
    """Communication buffers (see the module docstring); `fsdp` as in `model_state_bytes`; plus QLoRA's
    dequantized weight (`costmodel.peft.dequantize_buffer_bytes`)."""
    dequantized = dequantize_buffer_bytes(params.largest_quantized, precision) if params.largest_quantized else 0
    return dequantized + _communication_buffer_bytes(params=params, precision=precision, zero=zero, dp=dp,
                                                     dp_shard=dp_shard, offload=offload, fsdp=fsdp)


def _communication_buffer_bytes(*, params: ParamSet, precision: str, zero: int, dp: int, dp_shard: int, offload: bool,
                                fsdp: bool) -> int:
    if fsdp and zero < 2:
        zero = 2
    graded = params.largest_unit if params.largest_trainable_unit is None else params.largest_trainable_unit
    if offload:
        if zero == 3:
            return params.largest_unit * 2 * fsdp_param_bytes(precision) + graded * FSDP_GRAD_BYTES
        return 2 * graded * FSDP_GRAD_BYTES
    if zero == 3 and dp_shard > 1:
        return params.largest_unit * 2 * fsdp_param_bytes(precision) + graded * 4
    if zero == 2 and dp_shard > 1 and dp > 1:
        return 2 * graded * FSDP_GRAD_BYTES
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
    pipelined: bool = False,
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
    - `pipelined`: the run has pipeline stages, which hold the logits through backward.
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
        quantized=params.quantized_bytes,
        autocast=train.peft is None,
        autocast_copied=held_autocast_copies(params, blocks_keep=blocks_keep_autocast_copies(train),
                                             precision=train.precision),
    )
    activations = in_flight_microbatches * activation_bytes(
        ops,
        micro_batch=train.micro_batch,
        batch_traced=graph.batch,
        recompute=train.recompute,
        attention=sdpa_attention(train.attention, train.precision, device.kind),
        split={"parameter": tp} if split is None else split,
        precision=train.precision,
        block_counts=counts,
        recompute_per_block=dict(train.recompute_per_block),
        compiled=train.compile,
        pipelined=pipelined,
        cross_entropy=train.cross_entropy,
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


def reserve_bytes(device: DeviceProfile, allocated: float, loss_transient: float = 0.0) -> float:
    """The bytes PyTorch's caching allocator reserves beyond `allocated` (the allocator's peak of live
    tensors) on a profile with a fitted reserve (`DeviceProfile.allocator_reserve_fraction` r, fitted by `soap
    calibrate --from-runs`): the segment of the loss's largest fp32 transient, freed before the peak
    (`loss_transient`, `costmodel.memory_activations.loss_transient`), plus r x `allocated`
    (`costmodel.allocator`, (1)); 0 on a profile without one."""
    fraction = device.allocator_reserve_fraction
    return 0.0 if fraction is None else loss_transient + allocated * fraction


def grads_held_at_peak(dims: ParallelDims, train: TrainingConfig) -> bool:
    """Whether a rank's gradients are live at its activation peak (the start of the backward). The executor
    frees them after each optimizer step (`zero_grad(set_to_none=True)`), so they are not, unless a second
    micro-batch of the step finds the first one's accumulated (`num_microbatches` > 1 per optimizer step on
    the rank, or a pipeline), or DDP (more than one data rank, not on FSDP2: `costmodel.strategy.runs_on_fsdp2`)
    holds them in its reducer's buckets for the whole run (`gradient_as_bucket_view`, allocated when the model
    is wrapped). Measured on a lent H100 (2026-11-26, `soap execute --memory-snapshot`):
    one micro-batch of four Llama-3-8B layers at 16k tokens peaked in the loss's backward with no gradient
    allocated (fp32 parameters and AdamW moments 21.6 GiB, the step's tensors 29.0 GiB)."""
    ddp = dims.dp * dims.cp > 1 and not runs_on_fsdp2(dp=dims.dp, cp=dims.cp, tp=dims.tp, pp=dims.pp, zero=train.zero,
                                                      offload=train.offload_optimizer)
    return dims.pp > 1 or train.num_microbatches > 1 or ddp


def rank_breakdown(*, weights: float, grads: float, optimizer: float, activations: float, buffers: float,
                   host: float, workspace: float, reserve_fraction: float | None,
                   grads_held: bool = True, loss_transient: float = 0.0) -> MemoryBreakdown:
    """One rank's memory at its peak: the one place the estimator (`planner.memory_estimate`) and the
    simulator (`costmodel.simulator.result`) assemble it. `workspace` is `workspace_bytes(device)`; with a
    fitted allocator reserve (`reserve_fraction`, the device's `allocator_reserve_fraction`) it also holds
    what the caching allocator reserves beyond the tensors (`reserve_bytes`: the rank's `loss_transient` plus
    the fraction of its tensors), so the total is the reserved peak; without one the total is the allocated
    peak. Without `grads_held` (`grads_held_at_peak`) the
    gradients grow through the backward as the activations they replace are freed: the peak holds
    max(activations, gradients), and the breakdown's `grads` is what they add beyond the activations."""
    if not grads_held:
        grads = max(0.0, grads - activations)
    tensors = weights + grads + optimizer + activations + buffers
    reserve = 0.0 if reserve_fraction is None else loss_transient + tensors * reserve_fraction
    return MemoryBreakdown(weights=weights, grads=grads, optimizer=optimizer, activations=activations, buffers=buffers,
                           workspace=workspace + reserve, host=host)
