"""Draw docs/pipeline-1f1b.png: a 4-stage 1F1B step of llama-3-8b, made by `soap simulate --png`.

The plan (tp 2, pp 4, dp 2 with ZeRO-1, sequence parallel, 8 micro-batches, sequence length 4096, on
16 GPUs of dgx-h100) is built from a simulation, saved as plan.json in a temporary directory, and
handed to the CLI exactly as a user would:

    python -m benchmarks.simulate_pipeline_picture
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"


def main() -> None:
    import tracer
    from costmodel.profiles import load_cluster
    from costmodel.simulator import simulate
    from costmodel.strategy import ParallelDims, Strategy, TrainingConfig
    from planner.plan import ModelSpecRecord, config_hash, plan_from_simulation
    from soap.cli import main as soap

    spec = tracer.resolve_spec("llama-3-8b")
    config = json.loads(json.dumps(spec.config.to_dict(), sort_keys=True, default=str))
    record = ModelSpecRecord(name="llama-3-8b", source="preset", task=spec.task, config=config, config_hash=config_hash(config))
    graph = tracer.trace("llama-3-8b", seq_len=4096)
    cluster = load_cluster("dgx-h100")
    strategy = Strategy(
        dims=ParallelDims(tp=2, pp=4, dp_shard=2),
        train=TrainingConfig(global_batch=16, seq_len=4096, num_microbatches=8, schedule="1F1B", zero=1, sequence_parallel=True),
    )
    result = simulate(graph, strategy, cluster)
    plan = plan_from_simulation(model=record, graph=graph, cluster=cluster, gpus=16, strategy=strategy, result=result,
                                launch="soap execute plan.json --nnodes 2 --nproc-per-node 8")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plan.json"
        plan.save(path)
        code = soap(["simulate", str(path), "--png", str(DOCS / "pipeline-1f1b.png")])
    if code:
        raise SystemExit(code)


if __name__ == "__main__":
    main()
