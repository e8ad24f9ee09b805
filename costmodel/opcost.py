"""Op cost: the time of one OpGraph op on its local shard. INTERFACE STUB (see profiles.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from costmodel.profiles import DeviceProfile
from tracer.ir import OpNode


@dataclass(frozen=True)
class OpCost:
    fwd_s: float
    bwd_s: float
    fwd_flops: float
    bwd_flops: float
    bytes_moved: float


def op_time(
    op: OpNode,
    *,
    device: DeviceProfile,
    precision: str,
    micro_batch: int,
    batch_traced: int,
    split: Mapping[str, int] | None = None,
) -> OpCost:
    """Time of `op` for a micro-batch of `micro_batch` samples (the graph was traced at `batch_traced`).

    `split` gives the SOAP degree per dimension role ("sample", "attribute", "parameter"); every
    dimension of the op's tensors with that role is divided by the degree, so the local work shrinks.
    """
    raise NotImplementedError
