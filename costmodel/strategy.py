"""The strategy vocabulary: parallel degrees and the single-device training techniques.

`ParallelDims` is the mesh (torchtitan's `ParallelDims` shape): a validated value object that touches
no torch.distributed. `TrainingConfig` holds everything else a strategy decides: micro-batching, the
pipeline schedule, recomputation, precision, optimizer and offload. Together they are a `Strategy`,
which the simulator prices and the Plan records.

Batch accounting, per optimizer step:
    global_batch = dp * micro_batch * num_microbatches
`num_microbatches` is the number of micro-batches each data-parallel rank runs per step. With pp > 1
the pipeline schedule runs them; `grad_accum` is the number of times the schedule (or, with pp == 1,
one forward+backward) runs per step, so `num_microbatches % grad_accum == 0` and with pp == 1
`grad_accum == num_microbatches`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from costmodel.context_attention import CP_ATTENTION
from tracer.errors import SoapError

MESH_DIM_NAMES: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""Mesh dimension names, in torch DeviceMesh order (outermost first, as torchtitan builds it)."""

SCHEDULES: tuple[str, ...] = (
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
)
"""Pipeline schedule names, as torch.distributed.pipelining's `get_schedule_class` accepts them."""

MULTI_STAGE_SCHEDULES = frozenset({"Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble"})

Precision = Literal["fp32", "tf32", "fp16", "bf16", "fp8"]
PRECISIONS: tuple[str, ...] = ("fp32", "tf32", "fp16", "bf16", "fp8")
Optimizer = Literal["adamw", "adamw8bit", "adafactor", "sgd"]
OPTIMIZERS: tuple[str, ...] = ("adamw", "adamw8bit", "adafactor", "sgd")
Recompute = Literal["none", "selective", "full"]
RECOMPUTE: tuple[str, ...] = ("none", "selective", "full")
ATTENTION_IMPLS: tuple[str, ...] = ("sdpa", "eager")
PARAM_GATHERS: tuple[str, ...] = ("block", "tensor")
"""ZeRO-3 gather granularities (`costmodel.param_gathers`)."""
CROSS_ENTROPY_IMPLS: tuple[str, ...] = ("chunked", "upcast", "megatron")
"""The loss's cross-entropy (`TrainingConfig.cross_entropy`, `costmodel.memory_activations.loss_tensors`)."""
FP8_CASTS: tuple[str, ...] = ("torchao", "transformer-engine")
"""Whose float8 casts an fp8 run's GEMMs take (`TrainingConfig.fp8_casts`, priced by `costmodel.opcost`): torchao's
(soap's executor) or Transformer Engine's."""
EXECUTED_CROSS_ENTROPY: tuple[str, ...] = ("chunked", "upcast")
"""Those the executor computes (`executor.cross_entropy`); "megatron" is priced for another stack only."""


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """Degrees of each mesh dimension; their product is the world size."""

    dp_replicate: int = 1
    """Replicas of the model (DDP, or HSDP's replicate dimension)."""
    dp_shard: int = 1
    """Ranks that shard parameters/gradients/optimizer state (FSDP / ZeRO); 1 means no sharding."""
    cp: int = 1
    """Context parallel degree: the sequence (an attribute dimension) is split for attention."""
    tp: int = 1
    """Tensor parallel degree: parameter dimensions are split (Megatron column/row)."""
    pp: int = 1
    """Pipeline parallel degree: the operator sequence is split into stages."""
    ep: int = 1
    """Expert parallel degree for MoE; borrows ranks from dp_shard x cp (it is not a separate factor)."""

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise SoapError(f"{name}={value!r} must be a positive integer")
        if (self.dp_shard * self.cp) % self.ep:
            raise SoapError(f"ep={self.ep} must divide dp_shard*cp={self.dp_shard * self.cp}")

    @property
    def shard_degree(self) -> int:
        """Ranks that shard model state under ZeRO/FSDP: dp_shard x cp, the executor's FSDP mesh
        (`executor.mesh`'s dp_shard_cp): CP ranks hold other tokens of the same samples, so they hold
        the same parameters and can share them out."""
        return self.dp_shard * self.cp

    @property
    def sync_degree(self) -> int:
        """Ranks that average gradients: dp x cp (`executor.mesh`'s dp_cp)."""
        return self.dp * self.cp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    def check_model(self, *, num_layers: int, heads: int, kv_heads: int, vocab: int, seq_len: int) -> None:
        """Divisibility rules, with messages that show the numbers."""
        if self.tp > 1 and heads % self.tp:
            raise SoapError(f"tp={self.tp} does not divide {heads} attention heads; pick a tp that divides {heads}")
        if self.tp > 1 and kv_heads % self.tp and self.tp % kv_heads:
            raise SoapError(f"tp={self.tp} and {kv_heads} KV heads do not divide one another")
        if self.pp > num_layers:
            raise SoapError(f"pp={self.pp} is larger than the {num_layers} layers; use pp <= {num_layers}")
        if self.cp > 1 and seq_len % (2 * self.cp):
            raise SoapError(f"cp={self.cp} needs the sequence length ({seq_len}) divisible by 2*cp={2 * self.cp}")


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """Everything a strategy decides besides the mesh."""

    global_batch: int
    """Samples (sequences) per optimizer step."""
    seq_len: int
    micro_batch: int = 1
    """Samples per micro-batch on one data-parallel rank."""
    num_microbatches: int = 1
    """Micro-batches per step on one data-parallel rank."""
    grad_accum: int = 1
    """Schedule runs per step (see the module docstring)."""
    schedule: str = "1F1B"
    """Pipeline schedule, by torch.distributed.pipelining name (ignored when pp == 1)."""
    virtual_stages: int = 1
    """Stages per pipeline rank (> 1 only for multi-stage schedules)."""
    zero: int = 0
    """ZeRO stage of the sample-parallel group: 0 (DDP), 1, 2 or 3 (FSDP full shard)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism: norms/dropout on sequence shards between TP regions."""
    recompute: str = "none"
    """Default activation checkpointing policy; `recompute_per_block` overrides it per block id."""
    recompute_per_block: tuple[tuple[str, str], ...] = ()
    precision: str = "bf16"
    optimizer: str = "adamw"
    offload_optimizer: bool = False
    """Optimizer state (and step) on the CPU."""
    attention: str = "sdpa"
    compile: bool = False
    accumulate_locally: bool = False
    """Gradients accumulate on each rank across a step's micro-batches and are synchronized once, whatever
    the engine (how Megatron-LM and nanotron run ZeRO 0/1, and DDP under no_sync); False: the executor's
    rule (`costmodel.simulator.pricing.data_parallel_traffic`). Set to price another stack's run as it ran."""
    param_gather: str = "block"
    """How ZeRO-3 all-gathers parameters (`costmodel.param_gathers`): "block", one gather per unit as the
    executor's FSDP2 does; "tensor", one per parameter tensor, re-gathered for recompute and not overlapped,
    as DeepSpeed ZeRO-3 did in 2021. Set to price another stack's run as it ran."""
    half_model: bool = False
    """fp16/bf16 with the model's parameters held in that type and no autocast (Megatron-LM's and DeepSpeed's
    `--fp16`: the model in half, fp32 master weights in the optimizer): priced on the 16-bit trace, without
    autocast's casts (`planner.regimes.regime_dtype`). False: the executor's regime. Set to price another
    stack's run as it ran."""
    megatron_softmax: bool = False
    """The attention's softmax is Megatron's `FusedScaleMaskSoftmax`: one fused kernel where its availability
    rule holds, else the unfused PyTorch path with its extra kernels (`costmodel.fused_softmax`). False: the
    executor's SDPA. Set to price another stack's run as it ran."""
    cross_entropy: str = "chunked"
    """The loss's cross-entropy: "chunked", the executor's (`executor.cross_entropy`: the gradient made in the
    forward, a slice of tokens at a time); "upcast", `F.cross_entropy(logits.float())` as Hugging Face and
    torchtitan compute it (and soap's executor did before 2026-11-26); "megatron", Megatron-LM's and
    nanotron's vocab-parallel one. Its memory differs (`costmodel.memory_activations.loss_tensors`); its
    passes over the logits are the same, and the chunked one's extra kernels are priced as launches
    (`costmodel.opcost.loss_launches`)."""
    fp8_casts: str = "torchao"
    """Whose float8 casts an fp8 run's GEMMs take (`costmodel.opcost.FP8_CASTS`): "torchao", the executor's;
    "transformer-engine", Transformer Engine's fused cast-transposes. Set to price another stack's run as it ran."""
    cp_attention: str = "all-gather"
    """How a context-parallel attention core runs (`costmodel.context_attention`): "all-gather", the executor's
    (gathered K and V, two lower-right causal kernels a rank); "ring", a load-balanced ring's. Set to price another
    stack's run as it ran."""
    peft: str | None = None
    """PEFT method (lora, qlora) or None: the graph carries the adapters (tracer/peft.py); here it says the
    run has no autocast (executor/peft.py), which the model state reads (`costmodel.memory`)."""

    def __post_init__(self) -> None:
        if self.global_batch < 1 or self.seq_len < 1 or self.micro_batch < 1:
            raise SoapError("global batch, sequence length and micro-batch must be positive")
        if self.num_microbatches < 1 or self.grad_accum < 1 or self.num_microbatches % self.grad_accum:
            raise SoapError(
                f"grad_accum={self.grad_accum} must divide num_microbatches={self.num_microbatches}"
            )
        if self.schedule not in SCHEDULES:
            raise SoapError(f"unknown schedule {self.schedule!r}; choose one of {', '.join(SCHEDULES)}")
        if self.virtual_stages > 1 and self.schedule not in MULTI_STAGE_SCHEDULES:
            raise SoapError(f"schedule {self.schedule} runs one stage per rank; use Interleaved1F1B for virtual stages")
        if self.zero not in (0, 1, 2, 3):
            raise SoapError(f"zero={self.zero} must be 0, 1, 2 or 3")
        for value, allowed, what in (
            (self.precision, PRECISIONS, "precision"),
            (self.optimizer, OPTIMIZERS, "optimizer"),
            (self.recompute, RECOMPUTE, "recompute policy"),
            (self.attention, ATTENTION_IMPLS, "attention implementation"),
            (self.param_gather, PARAM_GATHERS, "parameter gather granularity"),
            (self.cross_entropy, CROSS_ENTROPY_IMPLS, "cross-entropy"),
            (self.fp8_casts, FP8_CASTS, "fp8 casts"),
            (self.cp_attention, CP_ATTENTION, "context-parallel attention"),
        ):
            if value not in allowed:
                raise SoapError(f"unknown {what} {value!r}; choose one of {', '.join(allowed)}")
        for _, policy in self.recompute_per_block:
            if policy not in RECOMPUTE:
                raise SoapError(f"unknown recompute policy {policy!r}; choose one of {', '.join(RECOMPUTE)}")

    def recompute_for(self, block_id: str | None) -> str:
        return dict(self.recompute_per_block).get(block_id or "", self.recompute)


def shards_vocabulary(*, tp: int, pp: int) -> bool:
    """Whether tensor parallelism shards the token embedding, the LM head and the loss over the vocabulary
    (`executor.tensor_parallel.apply_vocab_parallel`): whenever tp > 1, as Megatron-Core and torchtitan
    do; under a pipeline (any `pp`) the first stage shards the embedding and the last the head and loss.
    The executor, the simulator's placements and both memory models read this one rule."""
    return tp > 1


def runs_on_fsdp2(*, dp: int, cp: int, tp: int, pp: int, zero: int, offload: bool) -> bool:
    """Whether data parallelism runs on FSDP2 rather than DDP (`executor.data_parallel`): zero 2/3, DTensor
    parameters under TP, a pipeline (DDP's reducer breaks under many micro-batch backwards), or offload
    (even alone). The simulator prices FSDP2's per-unit syncs by the same rule."""
    if offload:
        return True
    return dp * cp > 1 and (zero >= 2 or tp > 1 or pp > 1)


@dataclass(frozen=True)
class Strategy:
    """A mesh plus a training configuration, and optional per-op SOAP overrides.

    `op_splits` maps an op name (or module FQN pattern) to its SOAP configuration, e.g.
    {"sample": 4, "parameter": 2}; ops not named follow the default implied by `dims`.
    """

    dims: ParallelDims
    train: TrainingConfig
    op_splits: tuple[tuple[str, tuple[tuple[str, int], ...]], ...] = field(default=())

    def check_batch(self) -> None:
        expect = self.dims.dp * self.train.micro_batch * self.train.num_microbatches
        if expect != self.train.global_batch:
            raise SoapError(
                f"global batch {self.train.global_batch} != dp {self.dims.dp} x micro-batch "
                f"{self.train.micro_batch} x micro-batches {self.train.num_microbatches}"
            )
