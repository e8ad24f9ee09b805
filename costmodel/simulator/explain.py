"""What each op costs under a strategy: the table behind "why is this plan this fast".

`op_costs(graph, strategy, cluster)` prices every op of the graph the way the simulator does
(`costmodel.simulator.pricing`): its split (`costmodel.placement`), its forward and backward time on
the local shard for one micro-batch, and the time of the collectives its split implies. Rows are per
traced op; `count` says how many times it runs per micro-batch in the full model (a block's instance
count), so `count * (fwd_s + bwd_s + comm_s)` summed over rows is one micro-batch's serial work
without overlap or pipelining. Views and other free ops are left out.
"""

from __future__ import annotations

from dataclasses import dataclass

from costmodel.opcost import activation_itemsize
from costmodel.placement import ActivationShape, block_placements
from costmodel.profiles import ClusterSpec
from costmodel.simulator.pricing import Pricer, mesh_groups, profile_pricer
from costmodel.strategy import Strategy
from tracer.ir import OpGraph


@dataclass(frozen=True)
class OpCostRow:
    op: str
    block: str | None
    count: int
    placement: str
    """Readable split, e.g. `Sample x4, Parameter x2`."""
    fwd_s: float
    bwd_s: float
    comm_s: float
    """Its collectives, forward and backward."""

    @property
    def total_s(self) -> float:
        return self.count * (self.fwd_s + self.bwd_s + self.comm_s)


def op_costs(graph: OpGraph, strategy: Strategy, cluster: ClusterSpec, *, pricer: Pricer | None = None) -> tuple[OpCostRow, ...]:
    t, dims = strategy.train, graph.dims
    pricer = pricer or profile_pricer(cluster, strategy)
    groups = mesh_groups(strategy, cluster.domain_size)
    by_group = {"tp": groups.tp, "cp": groups.cp, "ep": groups.ep}
    shape = ActivationShape(micro_batch=t.micro_batch, seq_len=t.seq_len, hidden=dims.hidden,
                            itemsize=activation_itemsize(t.precision), kv_heads=dims.kv_heads, head_dim=dims.head_dim,
                            experts_per_token=dims.experts_per_token)
    rows = []
    for seg in graph.segments():
        for p in block_placements(seg.ops, strategy, shape):
            fwd, bwd_in, bwd_w = pricer.op(p.op, p.split.local(), t.micro_batch, graph.batch)
            comm = cluster.device.activation_collective_factor * sum(
                pricer.collective(c.kind, c.nbytes, by_group[c.group]) for c in p.collectives)
            if fwd + bwd_in + bwd_w + comm > 0:
                rows.append(OpCostRow(p.op.name, seg.block_id, seg.repeat, p.split.describe(), fwd, bwd_in + bwd_w, comm))
    return tuple(rows)
