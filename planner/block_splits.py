"""Cost tables for the per-op split search of one block, the splits it picks, and the plan's per-op placements.

For a block (or the ops outside blocks) on a (dp, cp, tp) mesh, op i may take each split of
`costmodel.placement.candidate_splits` (replicated over tp, Parameter x tp, Attribute x tp*cp). The
tables `planner.intra_op.solve_block_splits` minimises (one micro-batch, forward + backward) are the
simulator's own pricing of explicit splits (`costmodel.placement.chosen_placements`), so the search
and the simulator agree on what a choice costs:
- node cost c_i[k]: `opcost.op_time` at the split's local shapes, plus the collectives the split
  implies by itself (`placement.split_collectives`: an attention core whose sequence is split over
  tp gathers K/V over tp). A norm cannot split its hidden dimension (its statistics span it), and a
  linear or an embedding does not replicate its weights over tp (the memory TP exists to save):
  those choices are forbidden (inf).
- edge cost r_(j,i)[a, b], for each dataflow edge (`placement.dataflow_edges`: op i reads op j's
  output); the resharding from split a's output layout to split b's input layout,
  forward and mirrored backward (`placement.edge_collectives`), each `collectives.collective_time`
  on its mesh group, divided among op j's consumers (the simulator reshards a tensor once per
  layout and shares it; the split into equal shares is exact when the consumers agree, which is
  the linear model's approximation of the shared cost).
With tp = 1 every op has one choice and no solver runs. Tables are solved once per distinct block
type and degrees (`intra_op.BlockSplitCache`), so repeats are free.

`chosen_op_splits` turns the solution into `Strategy.op_splits` for the blocks where it costs less
than the Megatron default under these tables; the planner keeps it only when the simulator prices
the whole step faster (`planner.pricing`).
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np

from costmodel.collectives import collective_time
from costmodel.opcost import op_time
from costmodel.placement import (
    Collective, OpSplit, block_placements as default_placements, candidate_splits, chosen_placements, dataflow_edges,
    edge_collectives, split_collectives,
)
from costmodel.profiles import ClusterSpec
from costmodel.simulator.pricing import activation_shape, mesh_groups
from costmodel.strategy import Strategy
from planner.intra_op import BlockSplitCache, assignment_cost
from planner.plan import BlockPlacement, OpPlacement
from planner.units import Unit
from tracer.ir import OpGraph, OpKind, OpNode


def block_tables(
    ops: tuple[OpNode, ...], graph: OpGraph, strategy: Strategy, cluster: ClusterSpec
) -> tuple[list[tuple[OpSplit, ...]], list[np.ndarray], dict[tuple[int, int], np.ndarray]]:
    d, t = strategy.dims, strategy.train
    groups = mesh_groups(strategy, cluster.domain_size)
    shape = activation_shape(graph, strategy)
    scale = t.micro_batch / graph.batch

    def comm(colls: tuple[Collective, ...]) -> float:
        return sum(collective_time(c.kind, c.nbytes, getattr(groups, c.group), cluster) for c in colls)

    choices, nodes = [], []
    for op in ops:
        splits = candidate_splits(op, d)
        costs = []
        for split in splits:
            if (op.kind is OpKind.NORM and split.parameter > 1) or (
                op.kind in (OpKind.MATMUL, OpKind.EMBEDDING) and op.params and split.parameter == 1 and d.tp > 1
            ):
                costs.append(math.inf)
                continue
            c = op_time(op, device=cluster.device, precision=t.precision, micro_batch=t.micro_batch,
                        batch_traced=graph.batch, split=split.local())
            costs.append(c.fwd_s + c.bwd_s + comm(split_collectives(op, split, d, shape, scale=scale)))
        choices.append(splits)
        nodes.append(np.array(costs))
    edges: dict[tuple[int, int], np.ndarray] = {}
    flow = dataflow_edges(ops)
    consumers = Counter(j for j, _ in flow)
    for j, i in flow:
        table = np.zeros((len(choices[j]), len(choices[i])))
        for a, prev in enumerate(choices[j]):
            for b, nxt in enumerate(choices[i]):
                table[a, b] = comm(edge_collectives(ops[j], prev, ops[i], nxt, cp=d.cp, scale=scale,
                                                    itemsize=shape.itemsize)) / consumers[j]
        if table.any():
            edges[(j, i)] = table
    return choices, nodes, edges


def solved_splits(
    ops: tuple[OpNode, ...], graph: OpGraph, strategy: Strategy, cluster: ClusterSpec, cache: BlockSplitCache
) -> list[OpSplit]:
    """The split the per-op search picks for every op of one block."""
    choices, nodes, edges = block_tables(ops, graph, strategy, cluster)
    picked = [0] * len(choices) if all(len(c) == 1 for c in choices) else cache.solve(nodes, edges)
    return [splits[k] for splits, k in zip(choices, picked)]


def chosen_op_splits(
    units: tuple[Unit, ...], graph: OpGraph, strategy: Strategy, cluster: ClusterSpec, cache: BlockSplitCache
) -> tuple[tuple[str, tuple[tuple[str, int], ...]], ...]:
    """`Strategy.op_splits` naming every op of each block where the searched splits cost less than the
    Megatron default under the search's own tables (empty when none do, with tp = 1, or with expert
    parallelism, whose splits the search does not model)."""
    d = strategy.dims
    if d.tp == 1 or d.ep > 1:
        return ()
    shape = activation_shape(graph, strategy)
    out = []
    for unit in units:
        if unit.id.startswith("<"):
            continue
        choices, nodes, edges = block_tables(unit.ops, graph, strategy, cluster)
        if all(len(c) == 1 for c in choices):
            continue
        picked = cache.solve(nodes, edges)
        default = [p.split.soap() for p in default_placements(unit.ops, strategy, shape)]
        index = [next((k for k, c in enumerate(cs) if c.soap() == want), None) for cs, want in zip(choices, default)]
        if None not in index and assignment_cost(picked, nodes, edges) >= assignment_cost(index, nodes, edges) * (1 - 1e-9):
            continue
        out += [(op.name, (("attribute", cs[k].attribute), ("parameter", cs[k].parameter)))
                for op, cs, k in zip(unit.ops, choices, picked)]
    return tuple(out)


def block_placements(units: tuple[Unit, ...], graph: OpGraph, strategy: Strategy) -> tuple[BlockPlacement, ...]:
    """Per-block op placements for plan.json: what the simulator priced (the strategy's `op_splits`
    where it names a block's ops, the Megatron default elsewhere)."""
    shape = activation_shape(graph, strategy)
    named = {name for name, _ in strategy.op_splits}
    out = []
    for unit in units:
        if any(op.name in named for op in unit.ops):
            placed = chosen_placements(unit.ops, strategy, shape, batch_traced=graph.batch)
        else:
            placed = default_placements(unit.ops, strategy, shape)
        ops = tuple(
            OpPlacement(op=p.op.name, soap={"operator": strategy.dims.pp, **p.split.soap()} if strategy.dims.pp > 1
                        else p.split.soap(), style=p.split.style)
            for p in placed
        )
        block_id = unit.id if not unit.id.startswith("<") else None
        out.append(BlockPlacement(id=unit.id, module_type=unit.module_type, count=unit.repeat,
                                  recompute=strategy.train.recompute_for(block_id) if block_id else "none", ops=ops))
    return tuple(out)
