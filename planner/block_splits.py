"""Cost tables for the per-op split search of one block, and the plan's per-op placements.

For a block (or the ops outside blocks) on a (dp, cp, tp) mesh, op i may take each split of
`costmodel.placement.candidate_splits` (replicated over tp, Parameter x tp, Attribute x tp*cp). The
tables `planner.intra_op.solve_block_splits` minimises (one micro-batch, forward + backward):
- node cost c_i[k]: `opcost.op_time` at the split's local shapes, plus what the split itself implies:
  an attention core whose sequence is split over tp gathers K/V over tp (all-gather forward,
  reduce-scatter backward); an op whose parameters are replicated while its tokens are split over tp
  all-reduces its weight gradients over tp once per step (amortised over the micro-batches).
  A norm cannot split its hidden dimension (its statistics span it), and a linear or an embedding
  does not replicate its weights over tp (the memory TP exists to save): those choices are
  forbidden (inf).
- edge cost r_(i,i+1)[a, b]: the dataflow follows execution order; op i's first output, laid out by
  split a (`placement.output_layout`), is resharded into the layout split b needs
  (`placement.input_layout`, `placement.reshard`), a collective over tp priced by
  `collectives.collective_time`, twice (the backward mirrors it).
With tp = 1 every op has one choice and no solver runs. Tables are solved once per distinct block
type and degrees (`intra_op.BlockSplitCache`), so repeats are free.
"""

from __future__ import annotations

import math

import numpy as np

from costmodel.collectives import CommGroup, collective_time
from costmodel.opcost import op_time
from costmodel.placement import OpSplit, candidate_splits, input_layout, output_layout, reshard
from costmodel.profiles import ClusterSpec
from costmodel.strategy import Strategy
from planner.intra_op import BlockSplitCache
from planner.plan import BlockPlacement, OpPlacement
from planner.units import Unit
from tracer.ir import OpGraph, OpKind, OpNode


def _tp_group(strategy: Strategy, cluster: ClusterSpec) -> CommGroup:
    tp = strategy.dims.tp
    return CommGroup(size=tp, ranks_per_node=min(tp, cluster.gpus_per_node))


def block_tables(
    ops: tuple[OpNode, ...], graph: OpGraph, strategy: Strategy, cluster: ClusterSpec
) -> tuple[list[tuple[OpSplit, ...]], list[np.ndarray], dict[tuple[int, int], np.ndarray]]:
    d, t = strategy.dims, strategy.train
    group = _tp_group(strategy, cluster)
    scale = t.micro_batch / graph.batch

    def comm(kind: str | None, nbytes: float) -> float:
        return collective_time(kind, nbytes, group, cluster) if kind and d.tp > 1 and nbytes > 0 else 0.0

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
            cost = c.fwd_s + c.bwd_s
            if split.attribute > d.cp and split.parameter == 1:
                if op.kind is OpKind.ATTENTION and len(op.inputs) >= 3:
                    kv = (op.inputs[1].nbytes + op.inputs[2].nbytes) * scale / d.cp
                    cost += comm("all_gather", kv) + comm("reduce_scatter", kv)
                grad_bytes = 4.0 * sum(p.numel for p in op.params)
                cost += comm("all_reduce", grad_bytes) / t.num_microbatches
            costs.append(cost)
        choices.append(splits)
        nodes.append(np.array(costs))
    edges: dict[tuple[int, int], np.ndarray] = {}
    for i in range(len(ops) - 1):
        if not ops[i].outputs:
            continue
        tensor = ops[i].outputs[0]
        nbytes = tensor.nbytes * scale / d.cp
        table = np.zeros((len(choices[i]), len(choices[i + 1])))
        for a, prev in enumerate(choices[i]):
            for b, nxt in enumerate(choices[i + 1]):
                if output_layout(prev, d.cp) != input_layout(nxt, d.cp):
                    table[a, b] = 2 * comm(reshard(prev, nxt, tensor, cp=d.cp).kind, nbytes)
        edges[(i, i + 1)] = table
    return choices, nodes, edges


def block_placements(
    units: tuple[Unit, ...], graph: OpGraph, strategy: Strategy, cluster: ClusterSpec, cache: BlockSplitCache
) -> tuple[BlockPlacement, ...]:
    """Per-block op placements for plan.json, from the per-op split search."""
    out = []
    for unit in units:
        choices, nodes, edges = block_tables(unit.ops, graph, strategy, cluster)
        if all(len(c) == 1 for c in choices):
            picked = [0] * len(choices)
        else:
            picked = list(cache.solve(nodes, edges))
        ops = tuple(
            OpPlacement(op=op.name, soap={"operator": strategy.dims.pp, **splits[k].soap()} if strategy.dims.pp > 1
                        else splits[k].soap(), style=splits[k].style)
            for op, splits, k in zip(unit.ops, choices, picked)
        )
        block_id = unit.id if not unit.id.startswith("<") else None
        out.append(BlockPlacement(id=unit.id, module_type=unit.module_type, count=unit.repeat,
                                  recompute=strategy.train.recompute_for(block_id) if block_id else "none", ops=ops))
    return tuple(out)
