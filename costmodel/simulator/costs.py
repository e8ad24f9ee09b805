"""The simulator's cost tables: what one micro-batch costs on one representative rank of each stage.

The simulator works in two phases. Pricing (`costmodel.simulator.pricing`) turns an OpGraph, a
Strategy and a ClusterSpec into a `StepCosts`: plain numbers per stage and per chunk (one block
instance, or a run of non-block ops). Simulation (`costmodel.simulator.step`) turns a `StepCosts`
and the pipeline schedule into timed tasks. Tests build `StepCosts` by hand to check the
simulation against textbook formulas; the planner can build them once per candidate and re-simulate.

All times are seconds for one micro-batch on one rank; all sizes are bytes on one rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from costmodel.schedule import PipelineSchedule


@dataclass(frozen=True, kw_only=True)
class ChunkCost:
    """One block instance (or non-block run of ops) of a stage, for one micro-batch."""

    name: str
    fwd_s: float
    """Forward compute on the local shard."""
    bwd_input_s: float
    """Backward compute for the input gradient (the critical-path half; `I` in zero-bubble)."""
    bwd_weight_s: float
    """Backward compute for the weight gradient (`W` in zero-bubble; part of `B` otherwise)."""
    recompute_s: float = 0.0
    """Forward recomputed at the start of this chunk's backward (activation checkpointing)."""
    fwd_comm_s: float = 0.0
    """Activation collectives on the critical path after the forward compute (TP all-reduce or SP
    reduce-scatter + all-gather, CP K/V exchange, MoE all-to-all)."""
    bwd_comm_s: float = 0.0
    """The same in backward."""
    grad_sync_s: float = 0.0
    """This chunk's DP gradient bucket: all-reduce (zero 0/1) or reduce-scatter (zero >= 2)."""
    param_gather_s: float = 0.0
    """FSDP all-gather of the chunk's parameters before its forward and its backward (zero 3)."""
    activation_bytes: int = 0
    """Saved for backward per micro-batch (after recomputation policy)."""
    recompute_bytes: int = 0
    """Extra activations alive while the chunk's backward recomputes its forward."""
    loss_transient_bytes: int = 0
    """The loss's largest fp32 transient (`costmodel.memory_activations.loss_transient`; 0 without a loss):
    the caching allocator's reserve on a profile with a fitted one (`costmodel.memory.rank_breakdown`)."""

    @property
    def bwd_s(self) -> float:
        return self.recompute_s + self.bwd_input_s + self.bwd_weight_s


@dataclass(frozen=True, kw_only=True)
class StageCost:
    chunks: tuple[ChunkCost, ...]
    send_activation_s: float = 0.0
    """Point-to-point time of this stage's output to the next stage, per micro-batch."""
    send_gradient_s: float = 0.0
    """Point-to-point time of this stage's input gradient to the previous stage, per micro-batch."""
    optimizer_s: float = 0.0
    """The optimizer step over this stage's local state (memory-bound; with offload, the host link
    transfer plus the CPU step)."""
    post_step_gather_s: float = 0.0
    """All-gather of updated parameter shards after the step (zero 1: ZeroRedundancyOptimizer)."""
    weights_bytes: int = 0
    grads_bytes: int = 0
    optimizer_bytes: int = 0
    host_bytes: int = 0
    """Offloaded to host memory (fp32 parameter shards, their gradients, the optimizer state)."""


@dataclass(frozen=True, kw_only=True)
class StepCosts:
    stages: tuple[StageCost, ...]
    schedule: PipelineSchedule
    """One pass over `schedule.num_microbatches` micro-batches; it runs `grad_accum` times per step."""
    grad_accum: int = 1
    grad_sync_every_microbatch: bool = False
    """FSDP2 reduces every micro-batch's gradients (zero 3; and every FSDP2 engine without a pipeline,
    whose training loop has no no_sync); otherwise gradients accumulate locally and are synchronized
    after the stage's last backward of the step."""
    gather_in_backward: bool = True
    """Chunks with `param_gather_s` all-gather again before their backward (zero 3, resharded after
    forward); False: once per micro-batch before the forward (zero 2: FSDP2 keeps them gathered through
    backward and reshards after it)."""
    links: Mapping[str, str] = field(default_factory=lambda: {"tp-comm": "intra_node", "dp-comm": "inter_node", "pp-p2p": "inter_node"})
    """The link level each communication stream crosses; streams on one link are serialized."""
    rank_buffer_bytes: tuple[int, ...] = ()
    """Communication buffers of each pipeline rank, constant through the step (`costmodel.memory.buffer_bytes`
    over the rank's stages: DDP buckets, FSDP's gathered units and unsharded gradients); () for none."""
    workspace_bytes: int = 0
    """Framework and CUDA context plus the runtime workspace per rank (`costmodel.memory.workspace_bytes`)."""
    allocator_reserve_fraction: float | None = None
    """The device's fitted allocator reserve (`costmodel.memory.rank_breakdown`); None: allocated memory."""
    grads_held: bool = True
    """Whether the gradients are live at the activation peak (`costmodel.memory.grads_held_at_peak`)."""
    comm_compute_share: float = 0.0
    """Fraction [0, 1] of every communication task's time that also occupies its rank's compute stream
    (1 - the device's `communication_overlap`; 0 on GPUs, where NCCL runs beside compute)."""

    def __post_init__(self) -> None:
        if len(self.stages) != self.schedule.num_stages:
            raise ValueError(f"{len(self.stages)} stage costs for a schedule of {self.schedule.num_stages} stages")
