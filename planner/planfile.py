"""Turn the chosen, simulated candidate into a `Plan` (plan.json).

The plan is self-contained: the model config inline with its hash, the cluster profile inline, the
mesh, the parallelism record, per-block recomputation and per-op SOAP placements, the pipeline stages
(module FQNs per stage, from the stage-partition bounds) and the simulator's predicted metrics.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from costmodel.profiles import cluster_to_dict
from costmodel.simulator.stages import layer_sequence, stage_modules
from costmodel.strategy import MESH_DIM_NAMES
from planner.plan import (
    SCHEMA_VERSION,
    BlockPlacement,
    ClusterRecord,
    MeshRecord,
    ModelSpecRecord,
    PeftRecord,
    Plan,
    StageRecord,
    config_hash,
    parallelism_record,
)
from planner.search import Priced
from tracer.ir import OpGraph

def stage_records(graph: OpGraph, bounds: Sequence[int] | None, pp: int, schedule: str) -> tuple[StageRecord, ...]:
    if pp == 1 or bounds is None:
        return ()
    stages = len(bounds) - 1
    modules = stage_modules(layer_sequence(graph), bounds)
    records = []
    for index in range(stages):
        rank = (index if index < pp else stages - 1 - index) if schedule == "ZBVZeroBubble" else index % pp
        records.append(StageRecord(index=index, rank=rank, modules=modules[index]))
    return tuple(records)


def launch_command(gpus: int, gpus_per_node: int) -> str:
    nodes = -(-gpus // gpus_per_node)
    per_node = min(gpus, gpus_per_node)
    if nodes == 1:
        return f"soap execute plan.json --nproc-per-node {per_node}"
    return (f"soap execute plan.json --nnodes {nodes} --nproc-per-node {per_node} "
            "--node-rank $NODE_RANK --master-addr $MASTER_ADDR")


def build_plan(
    request: Any, graph: OpGraph, chosen: Priced, bounds: Sequence[int] | None,
    *, blocks: tuple[BlockPlacement, ...] = (), tp_plan: dict[str, str] | None = None,
) -> Plan:
    ref, cluster = request.model, request.cluster
    strategy = chosen.candidate.strategy
    d, t = strategy.dims, strategy.train
    config = ref.config_json
    predicted = chosen.result.to_contract()
    return Plan(
        schema_version=SCHEMA_VERSION,
        model=ModelSpecRecord(name=ref.name, source=ref.source, task=graph.task, config=config,
                              config_hash=config_hash(config), peft=PeftRecord.of(ref.peft)),
        cluster=ClusterRecord(name=cluster.name, gpus=request.space.gpus, gpus_per_node=cluster.gpus_per_node,
                              profile=cluster_to_dict(cluster)),
        global_batch=t.global_batch,
        seq_len=t.seq_len,
        mesh=MeshRecord(names=MESH_DIM_NAMES, degrees=d.mesh_shape),
        parallelism=parallelism_record(strategy),
        tp_plan=dict(sorted((tp_plan or {}).items())),
        blocks=blocks,
        stages=stage_records(graph, bounds, d.pp, t.schedule),
        predicted=json.loads(json.dumps(predicted, sort_keys=True)),
        launch=launch_command(request.space.gpus, cluster.gpus_per_node),
    )
