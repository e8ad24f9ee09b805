"""Collective cost over the cluster topology. INTERFACE STUB (see profiles.py)."""

from __future__ import annotations

from dataclasses import dataclass

from costmodel.profiles import ClusterSpec

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv", "broadcast")


@dataclass(frozen=True)
class CommGroup:
    size: int
    """Ranks in the group."""
    ranks_per_node: int
    """How many of them share a node (== size for an intra-node group)."""


def collective_time(kind: str, nbytes: float, group: CommGroup, cluster: ClusterSpec) -> float:
    """Seconds for one collective. `nbytes` follows nccl-tests' "size": the full buffer per rank
    (all-reduce: the tensor; all-gather: the gathered output; reduce-scatter: the input;
    send_recv: the message)."""
    raise NotImplementedError
