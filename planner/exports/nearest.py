"""The nearest plan an export target runs, as a complete soap `Plan` with its own simulated metrics.

`nearest_plan` applies an `Adjustment` (`planner.exports.layout`) to a plan: the changed degrees and
techniques, per-op placements reset to the Megatron defaults where the target has no per-op splits,
one recompute policy for every block, and pipeline stages kept where the pipeline is unchanged
(balanced otherwise). It simulates the result with the same simulator `soap simulate` uses
(`costmodel.simulator.simulate`), on the graph the caller traced for the original plan.
"""

from __future__ import annotations

import re
from dataclasses import replace

from costmodel.profiles import cluster_from_dict
from costmodel.simulator import simulate
from costmodel.strategy import ParallelDims
from planner.exports.layout import Adjustment
from planner.plan import Plan, block_records, plan_from_simulation, stage_bounds
from tracer.ir import OpGraph


def custom_op_splits(plan: Plan, graph: OpGraph) -> int:
    """How many ops of the repeated blocks the plan places differently from the Megatron default."""
    strategy = plan.strategy()
    if not strategy.op_splits:
        return 0
    defaults = {b.id: {_in_block(o.op, b.id): _split(o.soap) for o in b.ops}
                for b in block_records(graph, replace(strategy, op_splits=()))}
    return sum(1 for b in plan.blocks if not b.id.startswith("<")
               for o in b.ops if defaults.get(b.id, {}).get(_in_block(o.op, b.id), _split(o.soap)) != _split(o.soap))


def _split(soap: dict[str, int]) -> tuple[int, int]:
    """The (attribute, parameter) degrees: what a per-op split chooses (`Plan.op_splits`)."""
    return soap.get("attribute", 1), soap.get("parameter", 1)


def _in_block(op: str, block_id: str) -> str:
    """An op's name within one block instance (`model.layers.0.self_attn:sdpa` -> `self_attn:sdpa`), as
    plans name it either way."""
    match = re.match(re.escape(block_id) + r"\.\d+(\.|(?=:))", op)
    return op[match.end():] if match else op


def finish(adj: Adjustment, plan: Plan, graph: OpGraph) -> None:
    """The drops every target shares: per-op splits (where the target has none) and per-block recompute."""
    if adj.drop_op_splits:
        count = custom_op_splits(plan, graph)
        if count:
            ops = "1 op" if count == 1 else f"{count} ops"
            adj.dropped.append(f"per-op splits ({ops} off the Megatron default) -> default placements")
    if any(b.recompute != plan.parallelism.recompute for b in plan.blocks if not b.id.startswith("<")):
        adj.dropped.append(f"per-block recompute -> {adj.parallelism['recompute']} everywhere")


def nearest_plan(plan: Plan, graph: OpGraph, adj: Adjustment) -> Plan:
    """`plan` changed as `adj` says, re-simulated; `plan` itself when nothing changed."""
    if not adj.changed:
        return plan
    p, strategy = adj.parallelism, plan.strategy()
    dims = ParallelDims(dp_replicate=p["dp_replicate"], dp_shard=p["dp_shard"], cp=p["cp"], tp=p["tp"], pp=p["pp"],
                        ep=p["ep"])
    train = replace(
        strategy.train, micro_batch=p["micro_batch"], num_microbatches=p["num_microbatches"],
        grad_accum=p["grad_accum"], schedule=p["schedule"], virtual_stages=p["virtual_stages"], zero=p["zero"],
        sequence_parallel=p["sequence_parallel"], recompute=p["recompute"], recompute_per_block=(),
        precision=p["precision"], optimizer=p["optimizer"], offload_optimizer=p["offload_optimizer"],
        attention=p["attention"], compile=p["compile"], cross_entropy=p["cross_entropy"],
    )
    same_mesh = dims == strategy.dims
    op_splits = strategy.op_splits if same_mesh and not adj.drop_op_splits else ()
    changed = replace(strategy, dims=dims, train=train, op_splits=op_splits)
    old = plan.parallelism
    same_stages = same_mesh and old.virtual_stages == p["virtual_stages"]
    bounds = stage_bounds(plan, graph) if same_stages else None
    cluster = cluster_from_dict(plan.cluster.profile)
    result = simulate(graph, changed, cluster, stages=bounds)
    return plan_from_simulation(model=plan.model, graph=graph, cluster=cluster, strategy=changed, result=result,
                                stages=bounds, gpus=plan.cluster.gpus, launch=plan.launch)
