"""Memory: model state, activations, buffers and overhead per rank. INTERFACE STUB (see profiles.py)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from tracer.ir import OpNode


@dataclass(frozen=True)
class StateBytes:
    weights: int
    grads: int
    optimizer: int
    offloaded: int
    """Bytes moved to host memory (not counted on the device)."""


@dataclass(frozen=True)
class MemoryEstimate:
    weights: int
    grads: int
    optimizer: int
    activations: int
    buffers: int
    overhead: int

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.activations + self.buffers + self.overhead


def model_state_bytes(
    params: int, *, precision: str, optimizer: str, zero: int, dp_shard: int, offload_optimizer: bool
) -> StateBytes:
    """Weights, gradients and optimizer state for `params` parameters held by one rank before DP sharding."""
    raise NotImplementedError


def activation_bytes(
    ops: Iterable[OpNode],
    *,
    micro_batch: int,
    batch_traced: int,
    recompute: str,
    attention: str,
    split: Mapping[str, int] | None = None,
) -> int:
    """Bytes saved for backward by `ops` for one micro-batch, under a recompute policy and attention
    implementation, at local shapes (`split` as in opcost.op_time)."""
    raise NotImplementedError
